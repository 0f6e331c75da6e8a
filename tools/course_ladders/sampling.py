"""Chapter 9 (sampling on the GPU): the argmax and sample ladders against reference/sampling.py, on 64 rows of
Llama 3's 128,256 logits (a decode batch). Greedy tokens must equal numpy.argmax's exactly; sampled tokens
(temperature 0.8, top-k 50, top-p 0.9, fixed uniforms) the reference's, which they do unless a draw falls
within rounding of a boundary (tests/kernels/test_sampling_kernels.py holds the full oracle). The roofline is
one read of the logits, though sampling needs several passes over them (argmax.py and sampling.py say which).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from cuda_kernels import argmax, sampling, sampling_policy
from reference import sampling as ref
from tools.course_ladders.common import Step
from tools.kernel_benchmarks.common import Case

SHAPES = {"real": (64, 128256), "tiny": (3, 300)}   # (rows, vocabulary)


def sampling_steps(real: bool) -> list[Step]:
    s, v = SHAPES["real" if real else "tiny"]
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((s, v)) * 4).astype(np.float32)
    temperature, top_p, min_p = (np.full(s, value, np.float32) for value in (0.8, 0.9, 0.0))
    top_k, uniform = np.full(s, 50, np.int32), rng.random(s).astype(np.float32)
    dl, dt, dk, dp, dm, du = (cuda.to_device(a) for a in (logits, temperature, top_k, top_p, min_p, uniform))
    tokens = cuda.device_array(s, np.int32)
    argmax_work = cuda.device_array(sampling_policy.argmax_workspace_size(s, v), np.int32)
    sample_work = cuda.device_array(sampling_policy.sample_workspace_size(s, v), np.uint64)
    greedy = ref.argmax(logits)
    drawn = ref.sample(logits, temperature, top_k, top_p, min_p, uniform)

    def case(name, run, want):
        def check():
            tokens.copy_to_device(np.full(s, -1, np.int32))
            run(0)
            got = tokens.copy_to_host()
            assert np.array_equal(got, want), f"tokens {got.tolist()} != reference {np.asarray(want).tolist()}"
        return Case("sampling", name, run, check, bytes_moved=logits.nbytes)

    sample_args = (dl, dt, dk, dp, dm, du, tokens)
    rungs = [
        ("9a argmax_naive", "one thread per row: uncoalesced, one row per thread",
         lambda stream: argmax.argmax_naive(dl, tokens, stream), greedy),
        ("9b argmax (one block per row)", "coalesced strided loads, a block reduction",
         lambda stream: argmax.argmax(dl, tokens, stream), greedy),
        ("9c argmax (split)", "(row, partition) blocks, 8 loads in flight, a merge kernel",
         lambda stream: sampling_policy.greedy(dl, tokens, stream, workspace=argmax_work), greedy),
        ("9d sample (one block per row)", "radix-select thresholds, fixed-point masses, inverse CDF",
         lambda stream: sampling.sample(*sample_args, stream), drawn),
        ("9e sample (split)", "the same passes over (row, partition) blocks, ten kernels",
         lambda stream: sampling_policy.sample(*sample_args, stream, workspace=sample_work), drawn),
    ]
    return [Step(version, idea, case(version, run, want)) for version, idea, run, want in rungs]
