"""Per-family kernel benchmark cases for tools/bench_kernels.py."""
