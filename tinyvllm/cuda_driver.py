"""The few CUDA driver calls tinyvllm makes itself, through cuda.bindings, beside Numba's own.

Numba's wrappers are general and cost tens of microseconds of Python per call (a device-array slice is a
new object, every copy re-checks its arguments); in the engine's per-step path those microseconds are GPU
idle time. Stream capture (tinyvllm/cuda_graph.py) is not wrapped by Numba at all.
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


class HostToDevice:
    """Asynchronous copies of a prefix of a pinned host array into a device array, on one stream.

    The addresses and the stream handle are resolved once, so a copy is one driver call."""

    def __init__(self, host, device, stream):
        self.host_ptr = int(host.ctypes.data)
        self.device_ptr = device_pointer(device)
        self.capacity = min(host.nbytes, device.nbytes)
        self.stream = stream_handle(stream)

    def copy(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"copy of {nbytes} bytes: the buffers hold {self.capacity}")
        ok(driver().cuMemcpyHtoDAsync(self.device_ptr, self.host_ptr, nbytes, self.stream))
