"""Benchmark cases for the sampling kernels (greedy argmax, top-k/top-p sampling) at the Llama-3.2 vocabulary.

argmax is timed in both versions: v2 without a workspace (one block per row, the comparison), and v3 with
one (the split argmax: stage 1 over (row, partition) blocks, stage 2 merging P indices per row; the
engine's P (sampling_policy), then other P and block sizes around it, for tuning sampling_policy's MIN_CHUNK /
TARGET_BLOCKS / SPLIT_THREADS). sample likewise: v1 without a workspace (one block per row) and v2 with one (the
split sample: ten kernels over (row, partition) blocks; the engine's P and block size, then others around them).
The workspaces are allocated once, sized for the largest case, as the runner sizes them for max_num_seqs.

bytes_moved counts the logits once per pass the kernel makes over them: argmax makes one; sample makes max,
sum and draw passes, one radix-select pass per digit its searches needed (1-3, counted here per row by
replaying the kernel's search on the reference's p), and re-reads one chunk of each row for the draw (v2: one
unit, chunk / threads elements). Rows stay partly in L2 between passes, so this is the traffic the kernel asks
for, not what reaches DRAM.
"""

import math

import numpy as np
from numba import cuda

from cuda_kernels import argmax, sampling, sampling_policy, sampling_steps
from reference import sampling as ref
from tools.kernel_benchmarks.common import Case

VOCAB = 128256
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9
ROWS = (1, 64, 256)
#: split argmax cases per row count: (partitions, threads); None = the policy's (sampling_policy)
SPLIT_CASES = {
    1: [(None, None), (None, 128), (None, 512), (16, None), (32, None), (128, None), (256, None)],
    64: [(None, None), (None, 128), (None, 512), (4, None), (8, None), (32, None)],
    256: [(None, None), (None, 128), (None, 512), (1, None), (2, None), (8, None)],
}

#: split sample cases per row count, the same way
SPLIT_SAMPLE_CASES = {
    1: [(None, None), (None, 256), (124, None), (248, None)],
    64: [(None, None), (None, 256), (32, None)],
    256: [(None, None), (None, 256), (8, None)],
}


def radix_passes(p: np.ndarray, top_k: int, top_p: float) -> int:
    """How many radix-select passes cuda_kernels/sampling.sample makes on this row (its early stops included)."""
    bits = p.view(np.uint32)
    mass = (p.astype(np.float64) * sampling_steps.FIXED_SCALE).astype(np.uint64)
    k_done, p_done = not 0 < top_k < p.size, not top_p < 1
    k_prefix = p_prefix = 0
    k_left = top_k
    p_left = max(1, math.ceil(float(np.float32(top_p)) * sampling_steps.FIXED_SCALE))
    passes = 0
    for digit in range(sampling_steps.RADIX_PASSES):
        if k_done and p_done:
            break
        passes += 1
        shift = sampling_steps.RADIX_BITS * (sampling_steps.RADIX_PASSES - 1 - digit)
        above = shift + sampling_steps.RADIX_BITS
        buckets = (bits >> shift) & sampling_steps.RADIX_MASK
        last = digit == sampling_steps.RADIX_PASSES - 1
        if not k_done:
            cand = (bits >> above) == (k_prefix >> above)
            counts = np.bincount(buckets[cand], minlength=sampling_steps.RADIX_BINS)
            at_least = np.cumsum(counts[::-1])[::-1]            # candidates in this bucket or above
            b = int(np.flatnonzero(at_least >= k_left)[-1])
            k_left -= int(at_least[b] - counts[b])
            k_prefix |= b << shift
            k_done = counts[b] == k_left or last
        if not p_done:
            cand = (bits >> above) == (p_prefix >> above)
            sums = np.zeros(sampling_steps.RADIX_BINS, np.uint64)
            np.add.at(sums, buckets[cand], mass[cand])  # exact integer sums, as the kernel's
            counts = np.bincount(buckets[cand], minlength=sampling_steps.RADIX_BINS)
            at_least = np.cumsum(sums[::-1])[::-1]
            hits = np.flatnonzero(at_least >= p_left)
            if hits.size == 0:
                p_done = True
            else:
                b = int(hits[-1])
                p_left -= int(at_least[b] - sums[b])
                p_prefix |= b << shift
                p_done = counts[b] == 1 or last
    return passes


def _device(a, dtype):
    return cuda.to_device(np.ascontiguousarray(a, dtype))


def _split(s, partitions):
    """(P, chunk) of a split case of s rows: the policy's (partitions None) or the override's."""
    return sampling_policy.argmax_partitions(s, VOCAB) if partitions is None else argmax._partition(VOCAB, partitions)


def split_argmax_cases(s, d_logits, d_out, greedy, workspace) -> list[Case]:
    """The split argmax (v3) at the policy's configuration and around it, on the shared workspace."""
    out = []
    for partitions, threads in SPLIT_CASES[s]:
        parts, chunk = _split(s, partitions)
        t = threads or sampling_policy.SPLIT_THREADS
        label = (f"argmax split (v3) {s}x{VOCAB} P={parts}{'' if partitions is None else ' (override)'} "
                 f"chunk={chunk} threads={t}")

        def run(stream, d_logits=d_logits, d_out=d_out, parts=parts, t=t):
            argmax.argmax(d_logits, d_out, stream, threads=t, workspace=workspace, partitions=parts)

        def check(d_logits=d_logits, d_out=d_out, greedy=greedy, parts=parts, t=t):
            d_out.copy_to_device(np.full(d_out.shape, -1, np.int32))
            argmax.argmax(d_logits, d_out, threads=t, workspace=workspace, partitions=parts)
            np.testing.assert_array_equal(d_out.copy_to_host(), greedy)

        out.append(Case("sampling", label, run, check, bytes_moved=4 * s * VOCAB))
    return out


def split_sample_cases(s, d_logits, d_params, d_out, sampled, passes, workspace) -> list[Case]:
    """The split sample (v2) at the policy's configuration and around it, on the shared workspace."""
    out = []
    for partitions, threads in SPLIT_SAMPLE_CASES[s]:
        parts, chunk = _split(s, partitions)
        t = threads or sampling_policy.SPLIT_THREADS
        label = (f"sample split (v2) {s}x{VOCAB} T={TEMPERATURE} top_k={TOP_K} top_p={TOP_P} P={parts}"
                 f"{'' if partitions is None else ' (override)'} chunk={chunk} threads={t} ({passes / s:.1f} passes)")

        def run(stream, parts=parts, t=t):
            sampling.sample(d_logits, *d_params, d_out, stream, threads=t, workspace=workspace, partitions=parts)

        def check(parts=parts, t=t):
            d_out.copy_to_device(np.full(d_out.shape, -1, np.int32))
            sampling.sample(d_logits, *d_params, d_out, threads=t, workspace=workspace, partitions=parts)
            got = d_out.copy_to_host()
            differ = int(np.count_nonzero(got != sampled))  # as check_sample in cases()
            assert differ <= max(1, s // 100), f"{differ} of {s} sampled tokens differ from the reference"
            sampling.sample(d_logits, *d_params, d_out)
            np.testing.assert_array_equal(got, d_out.copy_to_host())  # v1's tokens exactly

        unit_bytes = s * 4 * -(-chunk // t)
        out.append(Case("sampling", label, run, check, bytes_moved=passes * VOCAB * 4 + unit_bytes))
    return out


def split_sample_workspace():
    """One workspace for every split sample case: the runner's size for max(ROWS) rows, or more for overrides."""
    need = [sampling.workspace_elements(s, _split(s, p)[0], t or sampling_policy.SPLIT_THREADS)
            for s, configs in SPLIT_SAMPLE_CASES.items() for p, t in configs]
    return cuda.device_array(max([sampling_policy.sample_workspace_size(max(ROWS), VOCAB)] + need), np.uint64)


def split_workspace():
    """One workspace for every split case: the runner's size for max(ROWS) rows, or more for the overrides."""
    need = [s * _split(s, p)[0] for s, configs in SPLIT_CASES.items() for p, _ in configs]
    return cuda.device_array(max([sampling_policy.argmax_workspace_size(max(ROWS), VOCAB)] + need), np.int32)


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    out = []
    workspace, sample_workspace = split_workspace(), split_sample_workspace()
    for s in ROWS:
        # LM-like logits: a broad body (std 3) over the whole vocabulary
        logits = (rng.standard_normal((s, VOCAB)) * 3).astype(np.float32)
        d_logits, d_out = cuda.to_device(logits), cuda.device_array(s, np.int32)
        greedy = ref.argmax(logits)
        params = (np.full(s, TEMPERATURE, np.float32), np.full(s, TOP_K, np.int32), np.full(s, TOP_P, np.float32),
                  np.zeros(s, np.float32), rng.random(s).astype(np.float32))
        d_params = [_device(a, a.dtype) for a in params]
        sampled = ref.sample(logits, *params)
        passes = 0
        for row in logits:
            z = row / np.float32(TEMPERATURE)
            p = np.exp(z - z.max())
            p /= p.sum()
            passes += 3 + radix_passes(p, TOP_K, TOP_P)
        for threads in (256, argmax.DEFAULT_THREADS, 1024):
            def run_argmax(stream, d_logits=d_logits, d_out=d_out, threads=threads):
                argmax.argmax(d_logits, d_out, stream, threads=threads)

            def check_argmax(d_logits=d_logits, d_out=d_out, greedy=greedy, threads=threads):
                d_out.copy_to_device(np.full(d_out.shape, -1, np.int32))
                argmax.argmax(d_logits, d_out, threads=threads)
                np.testing.assert_array_equal(d_out.copy_to_host(), greedy)

            out.append(Case("sampling", f"argmax one block per row (v2, no workspace) {s}x{VOCAB} threads={threads}",
                            run_argmax, check_argmax, bytes_moved=logits.nbytes))

            def run_sample(stream, d_logits=d_logits, d_params=d_params, d_out=d_out, threads=threads):
                sampling.sample(d_logits, *d_params, d_out, stream, threads=threads)

            def check_sample(d_logits=d_logits, d_params=d_params, d_out=d_out, sampled=sampled, threads=threads):
                d_out.copy_to_device(np.full(d_out.shape, -1, np.int32))
                sampling.sample(d_logits, *d_params, d_out, threads=threads)
                got = d_out.copy_to_host()
                # Float32 summation order in the reference can flip a token at a top-p or u boundary (see
                # tests/kernels/test_sampling_kernels.py, which checks each case exactly); a wrong kernel
                # differs on most rows, so allow a rare few here.
                differ = int(np.count_nonzero(got != sampled))
                assert differ <= max(1, s // 100), f"{differ} of {s} sampled tokens differ from the reference"
                assert ((got >= 0) & (got < VOCAB)).all()

            chunk_bytes = s * 4 * -(-VOCAB // threads)  # the draw's re-read of one chunk per row
            out.append(Case("sampling", f"sample {s}x{VOCAB} T={TEMPERATURE} top_k={TOP_K} top_p={TOP_P} "
                            f"threads={threads} ({passes / s:.1f} passes)", run_sample, check_sample,
                            bytes_moved=passes * VOCAB * 4 + chunk_bytes))
        out.extend(split_argmax_cases(s, d_logits, d_out, greedy, workspace))
        out.extend(split_sample_cases(s, d_logits, d_params, d_out, sampled, passes, sample_workspace))
    return out
