"""Warming the CUDA engine up before it reports ready, so that no request waits on a compile or a capture.

Two things would otherwise happen at a request's expense: a kernel signature met for the first time is
compiled (about a second; or loaded from the on-disk kernel cache, cuda_kernels/kernel_cache.py), and a
decode step of a new (batch, width) bucket is captured as a CUDA graph. Both depend on the step's shape
alone, and the shapes a runner can meet are finite: token counts up to max_num_batched_tokens, sampled rows
up to max_num_seqs, and the runner's graph buckets. The warm-up walks them:

1. kernels: for a representative of every class of shapes the kernel policies tell apart, the step's
   launches are walked without running anything (`CUDARunner.prepare`, cuda_kernels/launch.preparing);
   the classes: the matmul policies choose by M within (64 (k - 1), 64 k] above 128 rows, by the skinny
   tile's 16, 32, 64, 128 rows below, and by every M up to 8 (gemv), so `token_counts` takes 1 .. 8, 16, 32,
   64, 128 and the multiples of 64; sampled rows (the LM head's M) the same way up to max_num_seqs;
2. graphs: every batch bucket x width bucket, greedy and sampled, is captured (`CUDARunner.capture`):
   recorded from the launches alone, which is cheap once the kernels are ready. Without graphs (enforce_eager,
   the simulator) the same buckets' decode steps are prepared instead: their attention policies depend on
   the block-table width.
Prompt logprobs run the LM head on the prompt rows max_num_seqs at a time, so step 1 walks them at the
sampled rows' classes. Steps with penalties or logprobs get their kernels in step 1, and so does the
copy-on-write kernel of parallel sampling (it launches before a step, outside it); their graphs are
captured when first met (a capture takes milliseconds, not the seconds of a compile), and again after a
step with more penalty entries than the step inputs hold has grown them (tinyvllm/step_inputs.py). The KV
cache's format (kv_cache_dtype) is a compile-time choice of the attention and KV-write kernels, taken from
the runner's caches, so the walk meets the format's own variants: nothing here depends on the format.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from cuda_kernels import launch
from tinyvllm import cuda_graph
from tinyvllm.cuda_runner import SamplingMode
from tinyvllm.step_inputs import StepShape

GEMV_ROWS = 8   # every M up to here is its own class (matmul's gemv tiles and configurations)
MODES = [SamplingMode(greedy, penalties, logprobs) for greedy in (True, False) for penalties in (False, True)
         for logprobs in (False, True)]


def token_counts(limit: int) -> list[int]:
    """M values, one per class of the matmul policies, up to limit (see the module docstring)."""
    counts = set(range(1, min(GEMV_ROWS, limit) + 1)) | {m for m in (16, 32, 64, 128) if m <= limit}
    counts |= set(range(192, limit + 1, 64)) | {limit}
    return sorted(counts)


def warm_up(runner, progress: bool = True) -> dict:
    """Make every kernel of `runner` (a CUDARunner) ready and capture its decode graphs; returns what it did."""
    start = time.perf_counter()
    kernels_before, compiled_before = launch.prepared(), launch.compiled()
    graphs_before = cuda_graph.captures()
    max_width = runner.width_buckets[-1]
    bs = runner.block_size
    # a kernel that does run (one launched with Numba's own syntax) reads zeros: padding-like rows
    runner.inputs.device.copy_to_device(np.zeros(runner.inputs.device.shape, np.int32))

    def width(tokens: int) -> int:
        return min(max_width, -(-(tokens + 1) // bs))

    steps = [(StepShape(t, 1, 1, width(t)), t, mode) for t in token_counts(runner.max_tokens)
             for mode in MODES[::4]]   # greedy and sampled, plain: the layer stack at every class of M
    # prompt logprobs: the LM head runs on the prompt rows max_num_seqs at a time (CUDARunner._prompt_logprobs),
    # so its classes are those of the sampled rows (walking every token count repeated them thousands of times)
    rows = token_counts(min(runner.max_seqs, runner.max_tokens))
    steps += [(StepShape(m, 1, 1, width(m), m), m, MODES[0]) for m in rows]
    for n in token_counts(runner.max_seqs):   # the LM head and sampling at every class of sampled rows
        steps += [(StepShape(n, n, n, width(1)), q_len, mode) for mode in MODES for q_len in (1, 2)]
    buckets = [(b, w, mode) for b in runner.batch_buckets for w in runner.width_buckets for mode in MODES[::4]]
    graphs = buckets if runner.use_graphs else []
    if not runner.use_graphs:   # decode steps launch eagerly: their kernels at every bucket (attention's
        steps += [(StepShape(b, b, b, w), 1, mode) for b, w, mode in buckets]   # policies depend on the width)
    bar = _progress(len(steps) + len(graphs), progress)
    for shape, q_len, mode in steps:
        runner.prepare(shape, q_len, mode)
        bar.update()
    runner.prepare_block_copy()
    for b, w, mode in graphs:
        runner.capture(b, w, mode)
        bar.update()
    runner.stream.synchronize()
    bar.close()
    done = {"kernels": launch.prepared() - kernels_before, "compiled": launch.compiled() - compiled_before,
            "graphs": cuda_graph.captures() - graphs_before, "seconds": time.perf_counter() - start}
    if progress:
        print(f"tinyvllm: warm-up: {done['kernels']} kernel signatures ready ({done['compiled']} compiled, the "
              f"others from the kernel cache), {done['graphs']} CUDA graphs captured, {done['seconds']:.1f} s",
              file=sys.stderr)
    return done


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="warming up", unit="step", disable=not enabled, file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 5.0, leave=False)
