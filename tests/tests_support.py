"""Paths shared by test files."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
GOLDENS = TESTS / "goldens"
GOLDEN_FRANCE = GOLDENS / "smollm2_capital_of_france.json"
