"""The engine's host <-> device copies as single driver calls (cuda_kernels/driver.py holds the driver calls
themselves).

Numba's copies cost tens of microseconds of Python per call (a device-array slice is a new object, every
copy re-checks its arguments); in the engine's per-step path those microseconds are GPU idle time.
"""

from __future__ import annotations

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.driver import device_pointer, driver, ok, stream_handle


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
