"""Paths shared by test files."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
GOLDEN_FRANCE = TESTS / "goldens" / "smollm2_capital_of_france.json"
