"""CUDA graphs from Numba: record a sequence of kernel launches once, replay it with one driver call.

A Numba kernel launch costs 20-80 us of Python (argument checks, typing, marshalling); a decode step of a
16-layer model is about 150 launches, so launched one by one it is bound by Python, not by the GPU. Stream
capture records the launches made on a stream (cuStreamBeginCapture ... cuStreamEndCapture) into a graph
whose kernel nodes keep their arguments, device pointers included. Replaying it (cuGraphLaunch) costs about
1 us per kernel on the device and a few microseconds of Python in all.

What this asks of the captured code (see shared GPU.md): every launch on the capturing stream; every kernel
compiled before the capture (a first launch loads a module, which capture forbids); no allocation, no
free, no host synchronisation inside; and every buffer a kernel reads or writes stays at its address, since
the addresses are baked into the graph. New inputs are therefore copied into the same buffers before each
replay. `cuda.defer_cleanup()` keeps Numba from freeing memory (which synchronises) during the capture.
"""

from __future__ import annotations

from typing import Callable

from numba import cuda

from cuda_kernels.driver import driver, ok, stream_handle


_captures = 0


def captures() -> int:
    """How many graphs this process has captured (a warm-up captures them all; none should follow)."""
    return _captures


class CUDAGraph:
    """The launches `record(stream)` makes on `stream`, captured once and replayable on that stream."""

    def __init__(self, record: Callable[[object], None], stream):
        global _captures
        _captures += 1
        drv = driver()
        self.stream = stream
        self._handle = stream_handle(stream)
        with cuda.defer_cleanup():
            ok(drv.cuStreamBeginCapture(self._handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
            try:
                record(stream)
            finally:
                self._graph = ok(drv.cuStreamEndCapture(self._handle))
        self._exec = ok(drv.cuGraphInstantiate(self._graph, 0))

    def replay(self) -> None:
        """Enqueue the recorded launches on the stream (asynchronous, like the launches themselves)."""
        ok(driver().cuGraphLaunch(self._exec, self._handle))
