"""Choosing the backend that runs the model: the CUDA runner on a usable GPU, else the CPU reference."""

from __future__ import annotations

import sys


class BackendError(RuntimeError):
    """The requested backend cannot run here."""


def choose_backend(requested: str) -> str:
    """'cpu' or 'cuda' for a requested 'auto' | 'cpu' | 'cuda', saying on stderr what auto picked and why."""
    from tinyvllm.device import gpu_status

    if requested == "cpu":
        return "cpu"
    usable, detail = gpu_status()
    if requested == "cuda":
        if not usable:
            raise BackendError(f"backend 'cuda': no usable GPU: {detail}")
        raise BackendError(f"backend 'cuda': found {detail}, but the CUDA engine is not built yet; use 'cpu'")
    if usable:
        print(f"tinyvllm: GPU found ({detail}) but the CUDA engine is not built yet; "
              "using the CPU reference backend", file=sys.stderr)
    else:
        print(f"tinyvllm: no usable GPU ({detail}); using the CPU reference backend", file=sys.stderr)
    return "cpu"


def make_runner(options, config, weights):
    from tinyvllm.cpu_runner import CPURunner

    choose_backend(options.backend)
    return CPURunner(config, weights, options.block_size, options.num_kv_blocks)
