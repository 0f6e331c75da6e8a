"""The few CUDA driver calls tinyvllm makes itself, through cuda.bindings, beside Numba's own.

Numba's wrappers are general and cost tens of microseconds of Python per call (a device-array slice is a
new object, every copy re-checks its arguments); in the engine's per-step path those microseconds are GPU
idle time. Stream capture (tinyvllm/cuda_graph.py) is not wrapped by Numba at all.
"""

from __future__ import annotations

from cuda_kernels.compat import SIMULATOR


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


class PinnedCopy:
    """Asynchronous copies between a prefix of a pinned host array and of a device array, on one stream.

    The addresses and the stream handle are resolved once, so a copy is one driver call. In Numba's
    simulator (no driver) the same copies go through Numba's API."""

    def __init__(self, host, device, stream):
        self.host, self.device, self.stream = host, device, stream
        self.capacity = min(host.nbytes, device.nbytes)
        if not SIMULATOR:
            self._host_ptr = int(host.ctypes.data)
            self._device_ptr = device_pointer(device)
            self._stream = stream_handle(stream)

    def to_device(self, nbytes: int) -> None:
        self._check(nbytes)
        if SIMULATOR:
            n = nbytes // self.host.itemsize
            self.device[:n].copy_to_device(self.host[:n], stream=self.stream)
        else:
            ok(driver().cuMemcpyHtoDAsync(self._device_ptr, self._host_ptr, nbytes, self._stream))

    def to_host(self, nbytes: int) -> None:
        self._check(nbytes)
        if SIMULATOR:
            n = nbytes // self.host.itemsize
            self.device[:n].copy_to_host(self.host[:n], stream=self.stream)
        else:
            ok(driver().cuMemcpyDtoHAsync(self._host_ptr, self._device_ptr, nbytes, self._stream))

    def _check(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"copy of {nbytes} bytes: the buffers hold {self.capacity}")
