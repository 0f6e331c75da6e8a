"""Is there a GPU tinyvllm can use? Answered once, with the reason when the answer is no."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(usable, description): a CUDA device numba can talk to, or why not."""
    try:
        from cuda_kernels.compat import SIMULATOR
        from numba import cuda
    except Exception as exc:  # numba-cuda missing or broken
        return False, f"numba.cuda cannot be imported ({exc})"
    if SIMULATOR:
        return False, "NUMBA_ENABLE_CUDASIM=1 is set (the CUDA simulator is not a GPU)"
    try:
        if not cuda.is_available():
            return False, "no CUDA driver or device found"
        device = cuda.get_current_device()
        name = device.name.decode() if isinstance(device.name, bytes) else device.name
        return True, f"{name} (compute capability {device.compute_capability[0]}.{device.compute_capability[1]})"
    except Exception as exc:
        return False, f"CUDA is present but unusable ({exc})"
