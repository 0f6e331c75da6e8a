"""Benchmark every kernel family at Llama-3.2-1B shapes on the GPU, after checking each against reference/.

    python tools/bench_kernels.py [--family matmul] [--out results.md] [--json results.json]

For each case: time per launch (CUDA graph replay, see tools/kernel_benchmarks/common.py), achieved GB/s
against a device-to-device copy measured in the same run, or TFLOP/s against the fp32 FMA peak (67 TFLOP/s,
the H200 datasheet figure GPU.md confirms by measurement). A case whose check fails is reported as FAILED
and not timed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cuda_kernels import compat  # noqa: E402,F401  (the numpy shim before numba.cuda)
from numba import cuda  # noqa: E402

from tools.kernel_benchmarks.common import copy_bandwidth_gbs, time_launch  # noqa: E402

FAMILIES = ("rows", "matmul", "attention", "sampling")
FP32_PEAK_TFLOPS = 67.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, action="append", help="only these families (repeatable)")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    copy_gbs = copy_bandwidth_gbs()
    lines = [f"{datetime.date.today()} on {name}; device-to-device copy measured at {copy_gbs:,.0f} GB/s", "",
             "| family | case | time (us) | GB/s | % of copy | TFLOP/s | % of fp32 peak |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    results, failed = [], 0
    for family in args.family or FAMILIES:
        try:
            cases = importlib.import_module(f"tools.kernel_benchmarks.{family}").cases()
        except Exception:
            traceback.print_exc()
            lines.append(f"| {family} | (could not build cases) | | | | | |")
            failed += 1
            continue
        for case in cases:
            row = {"family": family, "case": case.name}
            try:
                case.check()
                seconds = time_launch(case.launch)
            except Exception as exc:
                traceback.print_exc()
                failed += 1
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                lines.append(f"| {family} | {case.name} | FAILED: {row['error'][:80]} | | | | |")
                results.append(row)
                continue
            gbs = case.bytes_moved / seconds / 1e9 if case.bytes_moved else None
            tflops = case.flops / seconds / 1e12 if case.flops else None
            row.update(seconds=seconds, gbs=gbs, tflops=tflops)
            results.append(row)
            lines.append(f"| {family} | {case.name} | {seconds * 1e6:,.1f} | "
                         f"{'' if gbs is None else f'{gbs:,.0f}'} | {'' if gbs is None else f'{100 * gbs / copy_gbs:.0f}%'} | "
                         f"{'' if tflops is None else f'{tflops:.1f}'} | "
                         f"{'' if tflops is None else f'{100 * tflops / FP32_PEAK_TFLOPS:.0f}%'} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "copy_gbs": copy_gbs, "results": results}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
