"""What a kernel benchmark case is, and how it is timed.

A case checks its kernel against the NumPy reference once (a benchmark of a wrong kernel is meaningless),
then times it and reports time per launch, achieved bandwidth (the bytes the kernel must move at least) or
throughput (useful flops), and the fraction of the measured ceiling.

Timing: a kernel launch from Python costs 20-80 us of host time, more than most decode kernels run, so
back-to-back eager launches would time Python. The launches are therefore captured into a CUDA graph
(cuStreamBeginCapture on the numba stream) and the graph is replayed between two CUDA events; a replayed
kernel costs about 1 us of launch overhead (see shared GPU.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from numba import cuda


@dataclass
class Case:
    family: str
    name: str                        # e.g. "gemv_warp 1x2048 @ 3072x2048^T"
    launch: Callable[[object], None]  # one launch on the given numba stream, all buffers preallocated
    check: Callable[[], None]        # raises AssertionError when the result disagrees with reference/
    bytes_moved: float = 0.0         # minimum DRAM traffic of one launch
    flops: float = 0.0               # useful floating-point operations of one launch


def _driver():
    from cuda.bindings import driver

    return driver


def _ok(result):
    """cuda.bindings calls return (error, *values); raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def capture_graph(launch: Callable[[object], None], stream, count: int):
    """A CUDA graph of `count` launches on `stream`, instantiated, ready to replay."""
    drv = _driver()
    handle = drv.CUstream(int(stream.handle.value if hasattr(stream.handle, "value") else stream.handle))
    _ok(drv.cuStreamBeginCapture(handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    try:
        for _ in range(count):
            launch(stream)
    finally:
        graph = _ok(drv.cuStreamEndCapture(handle))
    return _ok(drv.cuGraphInstantiate(graph, 0)), handle


def time_launch(launch: Callable[[object], None], repeats: int = 50) -> float:
    """Mean seconds per launch: `repeats` launches captured in a graph, replayed between CUDA events."""
    drv = _driver()
    stream = cuda.stream()
    launch(stream)  # compile and warm up outside the capture
    stream.synchronize()
    with cuda.defer_cleanup():
        graph_exec, handle = capture_graph(launch, stream, repeats)
        _ok(drv.cuGraphLaunch(graph_exec, handle))  # warm-up replay
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        _ok(drv.cuGraphLaunch(graph_exec, handle))
        stop.record(stream)
        stop.synchronize()
    return cuda.event_elapsed_time(start, stop) / 1e3 / repeats
