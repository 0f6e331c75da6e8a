"""tinyvllm: a small, readable LLM inference engine whose every GPU operation is a hand-written Numba kernel."""

__version__ = "0.1.0"
