"""The course's runner: every version of a chapter's ladder, checked against reference/ and, on a GPU, timed.

    python tools/course.py --list           # the chapters, in order, with their pages in docs/course/
    python tools/course.py 5                # chapter 5: every GEMV version, checked (and timed on a GPU)
    python tools/course.py 5 --size tiny    # the simulator's shapes, also on a GPU (a quick check)

Each chapter of docs/course/ climbs a ladder: versions of one operation, simplest first, each faster for a
reason the chapter explains. This runs them all at the chapter's shapes. Without a GPU (Numba's simulator,
NUMBA_ENABLE_CUDASIM=1, as CI runs) every version is checked against reference/ at tiny shapes; with one, at
the Llama-3.2-1B shapes, each version is checked and then timed (a CUDA graph of 50 launches, weights cold in
L2 for the matmuls) and set against its roofline, and the table is printed in the form the chapter's
"Measured" section takes, under a line naming the time and the git tree of the run. Chapters about the
engine (1, 2, 10, 11) run on the CPU backend with a tiny random model and report counts that do not depend on
the machine. Chapter 12 issues one step's 82 kernels eagerly, from a CUDA graph and from a graph with PDL, and
times each way per step and per kernel (the simulator cannot capture graphs: there it checks the recorded
launches eagerly). Chapter 13 measures nothing: it reads the committed benchmark results
(tools/serving_cost.py, which takes any results file and price). Chapter 14 runs decode attention over one
cache in each KV format (fp32, bf16, fp8), each against its own roofline. Exit status 1 if any version fails its check.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cuda_kernels.compat import SIMULATOR  # noqa: E402  (also the numpy shim, before numba.cuda)
from numba import cuda  # noqa: E402

from tools.course_ladders import attention, engine, kv_formats, launches, matmul, rows, sampling, serving  # noqa: E402
from tools.course_ladders.common import run_steps, table  # noqa: E402


@dataclass(frozen=True)
class Chapter:
    number: int
    title: str
    page: str                       # docs/course/<page>
    steps: Callable[[bool], list]   # steps(real shapes?) -> the ladder's Steps or HostSteps


CHAPTERS = [
    Chapter(1, "Tokens in, tokens out: prefill, decode and the KV cache", "01-tokens.md", engine.token_steps),
    Chapter(2, "Weights: safetensors, bf16 as uint16, a Hugging Face checkpoint", "02-weights.md",
            engine.weight_steps),
    Chapter(3, "Row kernels: embedding, RMSNorm, SiLU * up", "03-row-kernels.md", rows.row_steps),
    Chapter(4, "RoPE and writing the KV cache", "04-rope-kv-write.md", rows.rope_steps),
    Chapter(5, "GEMV, the decode matmul", "05-gemv.md", matmul.gemv_steps),
    Chapter(6, "GEMM on tensor cores", "06-gemm.md", matmul.gemm_steps),
    Chapter(7, "Attention with online softmax", "07-attention.md", attention.prefill_steps),
    Chapter(8, "The KV cache and decode: PagedAttention", "08-paged-attention.md", attention.decode_steps),
    Chapter(9, "Sampling on the GPU", "09-sampling.md", sampling.sampling_steps),
    Chapter(10, "Batching: static, continuous, chunked prefill, preemption", "10-batching.md",
            engine.batching_steps),
    Chapter(11, "Paged KV management: block tables, prefix caching, copy-on-write", "11-paged-kv.md",
            engine.paged_kv_steps),
    Chapter(12, "Launch overhead: CUDA graphs and programmatic dependent launch", "12-launch-overhead.md",
            launches.launch_steps),
    Chapter(13, "Serving economics: latency, throughput and the cost of a million tokens", "13-serving-cost.md",
            serving.cost_steps),
    Chapter(14, "KV-cache formats: bf16, fp32 and fp8 e4m3", "14-kv-formats.md", kv_formats.format_steps),
]


def run(number: int, size: str = "auto") -> tuple[str, bool]:
    """Run chapter `number`: (its report in markdown, whether every version passed its check). size: "real"
    (the 1B shapes; a GPU only), "tiny", or "auto" (real on a GPU, tiny in the simulator)."""
    chapter = next((c for c in CHAPTERS if c.number == number), None)
    if chapter is None:
        raise SystemExit(f"no chapter {number}: see --list")
    if not SIMULATOR and not cuda.is_available():
        raise SystemExit("no GPU here: run the chapters in Numba's simulator (NUMBA_ENABLE_CUDASIM=1)")
    real = not SIMULATOR if size == "auto" else size == "real"
    if real and SIMULATOR:
        raise SystemExit("--size real needs a GPU: the simulator runs every CUDA thread as a Python thread")
    rows, copy_gbs = run_steps(chapter.steps(real), timed=not SIMULATOR)
    where = "simulator, tiny shapes: checked, not timed" if SIMULATOR else (
        f"{_device_name()}, {'Llama-3.2-1B' if real else 'tiny'} shapes")
    report = f"## {chapter.number}. {chapter.title} ({where})\n\n{_provenance(number, size)}\n\n{table(rows, copy_gbs)}\n"
    return report, all(r.check == "ok" for r in rows)


def _provenance(number: int, size: str) -> str:
    """When and on which tree this ran, for the chapter's source column."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        tree = (commit + ("-dirty" if dirty else "")) or "unknown (not a git checkout)"
    except (OSError, subprocess.SubprocessError):
        tree = "unknown (no git)"
    command = f"python tools/course.py {number}" + ("" if size == "auto" else f" --size {size}")
    return f"Run {when}, tree {tree}: `{command}`"


def _device_name() -> str:
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", nargs="?", type=int, help="the chapter to run")
    parser.add_argument("--list", action="store_true", help="list the chapters")
    parser.add_argument("--size", choices=("auto", "real", "tiny"), default="auto",
                        help="shapes: the 1B model's (GPU only), the simulator's, or by the machine (default)")
    args = parser.parse_args()
    if args.list or args.chapter is None:
        for c in CHAPTERS:
            print(f"{c.number:2d}  {c.title}  (docs/course/{c.page})")
        return 0
    report, ok = run(args.chapter, args.size)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
