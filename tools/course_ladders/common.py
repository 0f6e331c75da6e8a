"""What a course chapter runs, and how its table is made.

A chapter is a ladder: versions of one operation, simplest first. A kernel version is a Step around a Case
(tools/kernel_benchmarks/common.py): `check` compares the kernel with reference/ (raises on a mismatch) and
`launch` runs it once on a stream. In Numba's simulator (no GPU) a Step is only checked, at tiny shapes; on a
GPU it is checked and then timed (checked_time: a CUDA graph of 50 launches between events; or the Step's own
timer, where a graph would hide what is measured), and its time is set against its roofline:

- bandwidth-bound (decode): bytes_moved / the device-to-device copy rate measured in the same run;
- compute-bound (prefill): flops / Step.peak_tflops: the mma.sync peak measured on the H200 for tensor-core
  kernels (a third of it in fp32 mode, which takes three mma per product), the fp32 FMA peak for the others.

Chapters about the engine rather than a kernel (tokens, weights, batching, the paged KV cache) run HostSteps:
a function that runs one version on the CPU backend, checks it against the reference, and returns what it
counted (steps, blocks, tokens); those counts do not depend on the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tools.kernel_benchmarks.common import Case, checked_time, copy_bandwidth_gbs

MMA_PEAK_TFLOPS = 359.0   # mma.sync m16n8k16 bf16 in a register-only loop, H200 (docs/performance.md)
FMA_PEAK_TFLOPS = 67.0    # fp32 FMA on the CUDA cores, H200 datasheet (docs/performance.md)
WGMMA_PEAK_TFLOPS = 989.0  # dense bf16 on the tensor cores through wgmma, H100 / H200 SXM datasheet


@dataclass
class Step:
    version: str                  # "2a gemv_warp": the rung's number and name
    idea: str                     # what it changes over the rung below, in a few words
    case: Case
    peak_tflops: float = 0.0      # compute-bound: its ceiling (MMA_PEAK_TFLOPS, a third of it for bf16x3,
                                  # FMA_PEAK_TFLOPS on CUDA cores); 0: bandwidth-bound (case.bytes_moved)
    timer: Callable[[], float] | None = None   # seconds per run, timed its own way (chapter 12: eager
                                               # launches cannot be timed inside a graph); None: a graph of
                                               # 50 case.launch calls (time_launch)
    launches: int = 0             # kernels per run, when a run is a sequence of them: also time per kernel


@dataclass
class HostStep:
    version: str
    idea: str
    run: Callable[[], dict]       # runs and checks the version; returns its counts


@dataclass
class Row:
    version: str
    idea: str
    check: str                    # "ok" or the failure
    host: bool = False            # a HostStep's row: wall time and counts instead of a roofline
    seconds: float | None = None
    achieved: str = ""
    roofline_seconds: float | None = None
    counts: dict = field(default_factory=dict)


def run_steps(steps: list, timed: bool) -> tuple[list[Row], float | None]:
    """Check every step (and time it when `timed`); returns the rows and the copy rate (GB/s) they were set
    against (None when nothing was timed)."""
    copy_gbs = copy_bandwidth_gbs() if timed and any(isinstance(s, Step) for s in steps) else None
    rows = []
    for step in steps:
        if isinstance(step, HostStep):
            start = time.perf_counter()
            try:
                counts = step.run()
                rows.append(Row(step.version, step.idea, "ok", True, time.perf_counter() - start, counts=counts))
            except Exception as exc:   # one failing version must not hide the others
                rows.append(Row(step.version, step.idea, _failure(exc), True))
            continue
        rows.append(_kernel_row(step, timed, copy_gbs))
    return rows, copy_gbs


def _kernel_row(step: Step, timed: bool, copy_gbs: float | None) -> Row:
    case = step.case
    if not timed:
        try:
            case.check()
            return Row(step.version, step.idea, "ok")
        except Exception as exc:
            return Row(step.version, step.idea, _failure(exc))
    seconds = checked_time(case) if step.timer is None else _checked_timer(step)
    if isinstance(seconds, str):
        return Row(step.version, step.idea, seconds)
    if step.launches:
        return Row(step.version, step.idea, "ok", seconds=seconds,
                   achieved=f"{seconds / step.launches * 1e6:,.2f} us a kernel, "
                            f"{case.bytes_moved / seconds / 1e9:,.0f} GB/s",
                   roofline_seconds=case.bytes_moved / (copy_gbs * 1e9))
    if step.peak_tflops:
        return Row(step.version, step.idea, "ok", seconds=seconds,
                   achieved=f"{case.flops / seconds / 1e12:,.1f} TFLOP/s",
                   roofline_seconds=case.flops / (step.peak_tflops * 1e12))
    return Row(step.version, step.idea, "ok", seconds=seconds, achieved=f"{case.bytes_moved / seconds / 1e9:,.0f} GB/s",
               roofline_seconds=case.bytes_moved / (copy_gbs * 1e9))


def _checked_timer(step: Step) -> float | str:
    """step.timer's seconds once the check has passed, or the failure (as checked_time)."""
    try:
        step.case.check()
        return step.timer()
    except Exception as exc:
        return _failure(exc)


def _failure(exc: Exception) -> str:
    return f"FAILED: {type(exc).__name__}: {str(exc)[:120]}"


def table(rows: list[Row], copy_gbs: float | None) -> str:
    """The chapter's table in markdown: kernel rows with their time against the roofline, host rows with
    their counts."""
    lines = []
    kernel_rows = [r for r in rows if not r.host]
    if kernel_rows and all(r.seconds is None for r in kernel_rows):   # checked only (the simulator)
        lines += ["| version | what it changes | check |", "| --- | --- | --- |"]
        lines += [f"| {r.version} | {r.idea} | {r.check} |" for r in kernel_rows]
    elif kernel_rows:
        lines += ["| version | what it changes | check | time (us) | achieved | roofline (us) | of roofline |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in kernel_rows:
            t = "" if r.seconds is None else f"{r.seconds * 1e6:,.1f}"
            roof = "" if r.roofline_seconds is None else f"{r.roofline_seconds * 1e6:,.2f}"
            share = "" if r.seconds is None or r.roofline_seconds is None else \
                f"{100 * r.roofline_seconds / r.seconds:.0f}%"
            lines.append(f"| {r.version} | {r.idea} | {r.check} | {t} | {r.achieved} | {roof} | {share} |")
        lines.append(f"\nBandwidth rooflines at the device-to-device copy rate measured in this run, "
                     f"{copy_gbs:,.0f} GB/s; compute rooflines at {MMA_PEAK_TFLOPS:.0f} TFLOP/s of mma (a "
                     f"third of it for three mma per product) or {FMA_PEAK_TFLOPS:.0f} of fp32 FMA.\n")
    host_rows = [r for r in rows if r.host]
    if host_rows:
        keys = list(dict.fromkeys(k for r in host_rows for k in r.counts))
        lines += ["| version | what it changes | check | wall time (s) | " + " | ".join(keys) + " |",
                  "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in keys) + " |"]
        lines += [f"| {r.version} | {r.idea} | {r.check} | {'' if r.seconds is None else f'{r.seconds:.3f}'} | "
                  + " | ".join(str(r.counts.get(k, "")) for k in keys) + " |" for r in host_rows]
    return "\n".join(lines)
