"""The few CUDA driver calls made directly, through cuda.bindings, beside Numba's own.

Numba's wrappers are general and cost tens of microseconds of Python per call (a device-array slice is a
new object, every copy re-checks its arguments); on a per-step path those microseconds are GPU idle time.
launch.py launches kernels with one cuLaunchKernelEx; the engine's stream capture (tinyvllm/cuda_graph.py)
and host copies (tinyvllm/cuda_driver.py) use these too. Nothing here runs in the simulator, which has no
driver.
"""

from __future__ import annotations


def driver():
    from cuda.bindings import driver as drv

    return drv


def ok(result):
    """cuda.bindings calls return (error, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def stream_handle(stream):
    """The driver's CUstream for a Numba stream."""
    handle = stream.handle
    return driver().CUstream(int(handle.value if hasattr(handle, "value") else handle))


def device_pointer(array) -> int:
    """The device address of a Numba device array's first element."""
    return int(array.__cuda_array_interface__["data"][0])
