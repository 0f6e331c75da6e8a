"""Choosing the backend that runs the model: the CUDA runner on a usable GPU, else the CPU reference."""

from __future__ import annotations

import sys


class BackendError(RuntimeError):
    """The requested backend cannot run here."""


def choose_backend(requested: str) -> str:
    """'cpu' or 'cuda' for a requested 'auto' | 'cpu' | 'cuda', saying on stderr what auto picked and why.

    In Numba's CUDA simulator, 'cuda' runs the CUDA runner on simulated threads (tests do this with tiny
    models); 'auto' never picks the simulator.
    """
    from tinyvllm.device import gpu_status

    if requested == "cpu":
        return "cpu"
    usable, detail = gpu_status()
    if requested == "cuda":
        from cuda_kernels.compat import SIMULATOR

        if not usable and not SIMULATOR:
            raise BackendError(f"backend 'cuda': no usable GPU: {detail}")
        return "cuda"
    if usable:
        print(f"tinyvllm: using the CUDA engine on {detail}", file=sys.stderr)
        return "cuda"
    print(f"tinyvllm: no usable GPU ({detail}); using the CPU reference backend", file=sys.stderr)
    return "cpu"


# What matmul_precision "auto" means on each backend: the CUDA engine's fast path (bf16 inputs, as vLLM and
# HF transformers compute), the CPU reference's exact inputs.
AUTO_PRECISION = {"cuda": "bf16", "cpu": "fp32"}


def make_runner(options, config, weights):
    backend = choose_backend(options.backend)
    precision = AUTO_PRECISION[backend] if options.matmul_precision == "auto" else options.matmul_precision
    if backend == "cuda":
        from tinyvllm.cuda_runner import CUDARunner

        return CUDARunner(config, weights, options.block_size, options.max_num_seqs,
                          options.max_num_batched_tokens, options.gpu_memory_utilization, options.num_kv_blocks,
                          options.enforce_eager, precision, options.kv_cache_dtype)
    from tinyvllm.cpu_runner import CPURunner

    return CPURunner(config, weights, options.block_size, options.num_kv_blocks, precision, options.kv_cache_dtype)
