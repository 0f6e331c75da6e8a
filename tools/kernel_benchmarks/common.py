"""What a kernel benchmark case is, and how it is timed.

A case checks its kernel against the NumPy reference once (a benchmark of a wrong kernel is meaningless),
then times it and reports time per launch, achieved bandwidth (the bytes the kernel must move at least) or
throughput (useful flops), and the fraction of the measured ceiling.

Timing: a kernel launch from Python costs 20-80 us of host time, more than most decode kernels run, so
back-to-back eager launches would time Python. The launches are therefore captured into a CUDA graph
(tinyvllm/cuda_graph.py) and the graph is replayed between two CUDA events; a replayed
kernel costs about 1 us of launch overhead (docs/performance.md). Numba's CUDA simulator has neither graphs nor
event timing: there a case's time is the wall time of one eager launch, which shows that the case runs, not how
fast (every CUDA thread is a Python thread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from cuda_kernels.compat import SIMULATOR  # (also the numpy shim, which must precede numba.cuda)
from numba import cuda

from tinyvllm.cuda_graph import CUDAGraph


@dataclass
class Case:
    family: str
    name: str                        # e.g. "gemv_warp 1x2048 @ 3072x2048^T"
    launch: Callable[[object], None]  # one launch on the given numba stream, all buffers preallocated
    check: Callable[[], None]        # raises AssertionError when the result disagrees with reference/
    bytes_moved: float = 0.0         # minimum DRAM traffic of one launch
    flops: float = 0.0               # useful floating-point operations of one launch
    shape: str = ""                  # the shape and the configuration, for reports that tabulate them apart
    config: str = ""                 # (tools/bench.py); the older cases give both in their name


def time_launch(launch: Callable[[object], None], repeats: int = 50, rounds: int = 3) -> float:
    """Mean seconds per launch: `repeats` launches captured in a graph, replayed between CUDA events, the best
    of `rounds` replays (in the simulator: the wall time of one eager launch).
    NOTE: the best of several, because a run's first timed replay could read slower than the same kernel
    timed later in that run."""
    if SIMULATOR:
        start = time.perf_counter()
        launch(0)
        cuda.synchronize()
        return time.perf_counter() - start
    stream = cuda.stream()
    launch(stream)  # compile and warm up outside the capture
    stream.synchronize()
    graph = CUDAGraph(lambda s: [launch(s) for _ in range(repeats)], stream)
    graph.replay()  # warm-up replay
    start, stop = cuda.event(), cuda.event()
    best = float("inf")
    for _ in range(rounds):
        start.record(stream)
        graph.replay()
        stop.record(stream)
        stop.synchronize()
        best = min(best, cuda.event_elapsed_time(start, stop) / 1e3 / repeats)
    return best


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """The GPU's device-to-device copy rate in GB/s, read and write both counted: the practical ceiling that
    GB/s figures of bandwidth-bound kernels are set against. Two buffers of `nbytes` each; a GPU only (the
    simulator's events do not time)."""
    src, dst = cuda.device_array(nbytes // 4, np.float32), cuda.device_array(nbytes // 4, np.float32)
    dst.copy_to_device(src)
    # A 1 GiB copy takes a few hundred microseconds: eager copies suffice, no graph needed.
    start, stop = cuda.event(), cuda.event()
    start.record()
    for _ in range(repeats):
        dst.copy_to_device(src)
    stop.record()
    stop.synchronize()
    return 2 * src.nbytes * repeats / (cuda.event_elapsed_time(start, stop) / 1e3) / 1e9


def checked_time(case: Case) -> float | str:
    """Mean seconds per launch of `case` once its check has passed, or the failure as a line of text (a
    sweep reports it and goes on: one bad case must not cost the rest of a GPU run)."""
    try:
        case.check()
        return time_launch(case.launch)
    except Exception as exc:
        return f"FAILED: {type(exc).__name__}: {str(exc)[:120]}"
