"""Paths and shapes shared by test files."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
GOLDENS = TESTS / "goldens"
GOLDEN_FRANCE = GOLDENS / "smollm2_capital_of_france.json"

# Llama-3.2-1B's five matmuls as (weight rows N, K, gated): QKV fused, O, gate/up fused (run gated: silu(gate) *
# up), down, LM head
LLAMA_1B_MATMULS = [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True), (2048, 8192, False),
                    (128256, 2048, False)]
