"""Sampling kernels against reference/sampling.py: argmax (v2 without a workspace, the split v3 with one),
argmax_naive and sample (v1 without a workspace, the split v2 with one).

Greedy tokens must equal the reference's exactly. A sampled token may differ from the reference's only
where floating-point summation order can legitimately decide it: the reference sums p in float32 (a
sequential cumsum for top-p and for the draw, numpy's pairwise sum for the softmax denominator), the kernel
in float64 and in exact fixed point. So where the two tokens differ, `acceptable_tokens` must show that the
reference's row sits within rounding of a decision boundary (its cumulative mass within tolerance of top_p,
or u * total within tolerance of a cumulative boundary, or a p within a few ulps of a threshold), and the
kernel's token must be one that the other side of that boundary gives. Tolerances are derived from float32
eps: the reference's own cumsum error (measured against float64), plus a bound for the kernel's p (exp and
the softmax denominator a few ulps apart). `test_the_oracle_is_narrow` checks that these windows are rare,
so the comparison is not vacuous.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, SIM, device_empty, examples, pick, sizes, to_device

from cuda_kernels import argmax as am
from cuda_kernels import sampling as kernels
from cuda_kernels import sampling_policy as sp
from cuda_kernels import sampling_steps as steps
from cuda_kernels.launch import launch
from reference import sampling as ref

seeds = st.integers(0, 2**32 - 1)
vocabs = sizes(300, [128256, 49152], 5000)
rows = sizes(4, [1, 64, 256], 300)
# simulated threads are Python threads: small blocks there; the engine's sizes on the GPU
block_sizes = st.sampled_from(pick([32, 64], [256, 512, 1024]))
BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))
KINDS = ("normal", "ties", "equal", "neg_inf", "huge", "very_negative", "peaked", "flat")


# --- helpers ------------------------------------------------------------------------------------------------

def make_row(rng, kind, vocab):
    """One row of logits of the given kind (see KINDS); every row has at least one finite logit."""
    x = (rng.standard_normal(vocab) * 4).astype(np.float32)
    if kind == "ties":  # many exactly equal logits, so thresholds fall on ties
        x = np.round(x)
    elif kind == "equal":
        x = np.full(vocab, np.float32(rng.standard_normal() * 10), np.float32)
    elif kind == "neg_inf":  # masked tokens
        x[rng.random(vocab) < 0.4] = -np.inf
        x[rng.integers(vocab)] = np.float32(rng.standard_normal())
    elif kind == "huge":  # one-hot-like softmax, z far from 0 (finite for T >= 0.05)
        x = (rng.standard_normal(vocab) * 1e30).astype(np.float32)
    elif kind == "very_negative":  # the max subtraction must happen before exp
        x = (x - np.float32(3e4)).astype(np.float32)
    elif kind == "peaked":  # a few likely tokens over a long flat tail, as in real LM logits
        x = (rng.standard_normal(vocab) * 0.5).astype(np.float32)
        x[rng.integers(vocab, size=min(vocab, 3))] += np.float32(8)
    elif kind == "flat":  # distinct p within a few percent of each other: many share their leading bits, so
        # the radix searches need all three digits (as a 128256-token vocabulary does)
        x = (rng.standard_normal(vocab) * 0.05).astype(np.float32)
    return x


def launch_sample(logits, temperature, top_k, top_p, min_p, uniform, threads):
    out = device_empty(logits.shape[0], np.int32)
    kernels.sample(to_device(logits), to_device(np.asarray(temperature, np.float32)),
                   to_device(np.asarray(top_k, np.int32)), to_device(np.asarray(top_p, np.float32)),
                   to_device(np.asarray(min_p, np.float32)), to_device(np.asarray(uniform, np.float32)), out,
                   threads=threads)
    return out.copy_to_host()


def acceptable_tokens(row, temperature, top_k, top_p, min_p, u):
    """Every token a correct kernel may draw for this row, given float32 rounding in both implementations.

    Work on groups of equal z = l / T (equal z give equal p in any implementation, and p is non-decreasing in
    z in both, so every kept set is a run of the largest groups: "keep groups 0..g"). For each filter, the
    range of g that rounding can produce; then, for each possible kept set, the tokens whose cumulative mass
    interval touches u * total within tolerance.
    """
    row = np.asarray(row, np.float32)
    vocab = row.size
    if temperature == 0:
        return {int(ref.argmax(row[None])[0])}
    z = row / np.float32(temperature)
    p = np.exp(z - z.max())
    p /= p.sum()                                     # the reference's float32 p, bit for bit
    levels, group = np.unique(-z, return_inverse=True)  # group 0 holds the largest z
    group = group.reshape(-1)
    n = levels.size
    pg = np.zeros(n, np.float64)
    pg[group] = p
    # the kernel's p may differ from the reference's by a few ulps: exp (libdevice vs numpy, 2-3 ulps each),
    # the denominator (numpy's pairwise float32 sum vs float64, up to ~log2(V) ulps) and the division
    delta = (32 + 2 * math.log2(vocab)) * F32_EPS
    fixed = vocab * 2.0 ** -56                       # the kernel's fixed-point truncation, at most

    def last_near(t):
        """the last group whose p is within delta of t or above: ties the kernel may see that p hides"""
        return int(np.count_nonzero(pg >= t * (1 - delta))) - 1

    ranges = [(n - 1, n - 1)]
    if 0 < top_k < vocab:
        # the k-th largest token by z is the same in both; its group is kept, and any group tied with it
        g = int(np.searchsorted(np.cumsum(np.bincount(group, minlength=n)), top_k))
        ranges.append((g, last_near(pg[g])))
    if top_p < 1:
        mass = np.cumsum(pg * np.bincount(group, minlength=n))   # exact mass of groups 0..g
        ordered = np.sort(p)[::-1]
        cum_error = float(np.max(np.abs(np.cumsum(ordered) - np.cumsum(ordered.astype(np.float64)))))
        tol = cum_error + 2 * delta + fixed
        ok = [g for g in range(n) if mass[g] >= top_p - tol and (g == 0 or mass[g - 1] < top_p + tol)]
        if mass[-1] < top_p + tol:
            ok.append(n - 1)                          # short of top_p: every token kept
        ranges.append((min(ok), last_near(pg[max(ok)])))
    if min_p > 0:
        # no group sits at this threshold: the ones within delta of it may fall either side
        t = np.float32(min_p) * p.max()
        ranges.append((max(int(np.count_nonzero(pg > t * (1 + delta))) - 1, 0), max(last_near(t), 0)))
    g_lo, g_hi = min(r[0] for r in ranges), min(r[1] for r in ranges)

    tokens = set()
    for g in range(g_lo, g_hi + 1):
        kept = np.where(group <= g, p, np.float32(0))
        c64 = np.cumsum(kept.astype(np.float64))
        total = c64[-1]
        tol = float(np.max(np.abs(np.cumsum(kept) - c64))) + (F32_EPS + 2 * delta) * total + fixed
        target = float(np.float32(u)) * total
        before = np.concatenate([[0.0], c64[:-1]])
        tokens.update(np.flatnonzero((kept > 0) & (before <= target + tol) & (c64 > target - tol)).tolist())
        if target + tol >= total:
            tokens.add(int(np.flatnonzero(kept)[-1]))
    return tokens


def assert_tokens_match(got, logits, temperature, top_k, top_p, min_p, uniform):
    # the parameters exactly as the kernel saw them
    temperature, top_p, min_p, uniform = (np.asarray(a, np.float32) for a in (temperature, top_p, min_p, uniform))
    top_k = np.asarray(top_k, np.int32)
    want = ref.sample(logits, temperature, top_k, top_p, min_p, uniform)
    for s in np.flatnonzero(got != want):
        ok = acceptable_tokens(logits[s], temperature[s], int(top_k[s]), float(top_p[s]), float(min_p[s]),
                               uniform[s])
        params = dict(T=temperature[s], top_k=top_k[s], top_p=top_p[s], min_p=min_p[s], u=uniform[s])
        assert int(want[s]) in ok, f"row {s}: the oracle rejects the reference's token {want[s]} ({params})"
        assert int(got[s]) in ok, (f"row {s}: kernel drew {got[s]}, reference {want[s]}, and no rounding "
                                   f"boundary explains it; acceptable {sorted(ok)[:8]} ({params})")


# --- argmax -------------------------------------------------------------------------------------------------

@given(seeds, rows, vocabs, block_sizes, st.sampled_from(KINDS))
def test_argmax_matches_reference(seed, num_seqs, vocab, threads, kind):
    rng = np.random.default_rng(seed)
    logits = np.stack([make_row(rng, kind, vocab) for _ in range(num_seqs)])
    d_logits, out = to_device(logits), device_empty(num_seqs, np.int32)
    want = ref.argmax(logits)
    am.argmax(d_logits, out, threads=threads)
    np.testing.assert_array_equal(out.copy_to_host(), want)
    am.argmax_naive(d_logits, out, threads=32)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_argmax_ties_nan_and_infinities_follow_numpy():
    v = pick(70, 128256)
    logits = np.zeros((6, v), np.float32)
    logits[0, [5, 9, v - 1]] = 3.0                      # tied maxima: the first
    logits[1] = -np.inf                                 # all -inf: index 0
    logits[1, v - 1] = -np.inf
    logits[2, [3, 40]] = np.nan                         # NaN beats everything, the first NaN wins
    logits[2, 10] = np.inf
    logits[3, v - 1] = np.inf                           # +inf at the very end
    logits[4] = np.float32(-3e38)                       # all equal and very negative
    logits[5, 33] = np.float32(1e-45)                   # a denormal above zeros
    want = np.argmax(logits, axis=-1)
    assert want.tolist() == [5, 0, 3, v - 1, 0, 33]
    d, out = to_device(logits), device_empty(6, np.int32)
    for threads in pick([32, 64], [256, 1024]):
        am.argmax(d, out, threads=threads)
        assert out.copy_to_host().tolist() == want.tolist()
    am.argmax_naive(d, out)
    assert out.copy_to_host().tolist() == want.tolist()
    zeros = np.zeros(6)
    got = launch_sample(logits, zeros, zeros, np.ones(6), zeros, np.full(6, 0.5), pick(32, 512))
    assert got.tolist() == want.tolist()                # temperature 0 rows are greedy


# --- split argmax (argmax with a workspace) -----------------------------------------------------------------

POISON = 2 ** 30  # an index past any row: a stage 2 that read a partial stage 1 never wrote would fail on it


def split_shape(num_seqs, vocab, partitions):
    """(P, chunk) of a split launch: the policy's (partitions None), or the override's."""
    if partitions is None:
        return sp.argmax_partitions(num_seqs, vocab)
    return am.partition(vocab, partitions)


def launch_split_argmax(logits, partitions=None, threads=None, d_logits=None):
    """The split argmax on a poisoned workspace (a size for these rows, at least what the policy needs) and a
    poisoned out: the engine's entry point (sampling_policy.greedy) where neither partitions nor threads is
    given, else the launcher with the policy's choice for the one left None."""
    num_seqs, vocab = logits.shape
    parts, _ = split_shape(num_seqs, vocab, partitions)
    size = max(num_seqs * parts, sp.argmax_workspace_size(num_seqs, vocab))
    workspace = to_device(np.full(size, POISON, np.int32))
    out = to_device(np.full(num_seqs, -1, np.int32))
    d_logits = to_device(logits) if d_logits is None else d_logits
    if partitions is None and threads is None:
        sp.greedy(d_logits, out, workspace=workspace)
    else:
        am.argmax(d_logits, out, workspace=workspace, partitions=parts if partitions is None else partitions,
                  threads=threads or sp.SPLIT_THREADS)
    return out.copy_to_host()


SPLIT_KINDS = KINDS + ("nan", "all_neg_inf", "boundary_ties")


def make_argmax_row(rng, kind, vocab, chunk):
    """A row for the argmax: make_row's kinds, NaNs, all -inf, or the maximum tied across partition edges."""
    if kind == "nan":
        x = make_row(rng, "normal", vocab)
        x[rng.integers(vocab, size=2)] = np.nan
        x[rng.integers(vocab)] = np.inf
    elif kind == "all_neg_inf":
        x = np.full(vocab, -np.inf, np.float32)
    elif kind == "boundary_ties":  # the maximum at the last element of one chunk and the first of the next
        x = make_row(rng, "ties", vocab)
        edge = chunk * int(rng.integers(1, max(2, -(-vocab // chunk))))
        tied = [i for i in (edge - 1, edge, edge + 1, int(rng.integers(vocab))) if 0 <= i < vocab]
        x[tied] = np.float32(100)
    else:
        x = make_row(rng, kind, vocab)
    return x


# small and odd sizes everywhere (1, around a warp, around a round of UNROLL loads); the real ones on the GPU
split_vocabs = st.sampled_from([1, 2, 31, 33, 255, 257, 513]) | st.integers(1, pick(600, 128256)) | \
    (st.sampled_from([128256, 49152]) if not SIM else st.nothing())
split_rows = st.integers(1, 5) if SIM else st.one_of(st.integers(1, 5), rows)
# None: the policy's (sampling_policy; P = 1 at simulator sizes, so the overrides are what split there)
split_partitions = st.sampled_from([None, 1, 2, 3, 5, 8] + pick([], [63, 100, 1000]))


@settings(max_examples=examples(25, 40))
@given(seeds, split_rows, split_vocabs, st.sampled_from(pick([32, 64], [128, 256, 512, 1024])), split_partitions)
def test_split_argmax_matches_reference(seed, num_seqs, vocab, threads, partitions):
    rng = np.random.default_rng(seed)
    _, chunk = split_shape(num_seqs, vocab, partitions)
    kinds = rng.choice(SPLIT_KINDS, num_seqs)
    logits = np.stack([make_argmax_row(rng, k, vocab, chunk) for k in kinds])
    got = launch_split_argmax(logits, partitions, threads)
    np.testing.assert_array_equal(got, ref.argmax(logits), err_msg=f"rows {list(kinds)}")


def test_split_argmax_ties_across_partitions_take_the_lowest_index():
    v, parts = pick(200, 128256), 4
    c = am.partition(v, parts)[1]
    assert am.partition(v, parts)[0] == parts and c < v
    logits = np.zeros((9, v), np.float32)
    logits[0, [c - 1, c]] = 5.0                         # the last of chunk 0 against the first of chunk 1
    logits[1, [c, 2 * c - 1, 3 * c]] = 5.0              # chunk 1's first against later chunks'
    logits[2, [c + 1, 3 * c + 1]] = 5.0                 # not at an edge, and not in chunk 0
    logits[3, [0, c, 2 * c, 3 * c]] = 5.0               # every chunk's first
    logits[4, [2 * c + 3, c + 7]] = np.nan              # NaN wins over +inf, and the first NaN wins
    logits[4, 0] = np.inf
    logits[5] = -np.inf                                 # every logit -inf: index 0
    logits[6] = np.float32(-3e38)                       # all equal: index 0
    logits[7] = -np.inf                                 # only the very last is NaN
    logits[7, v - 1] = np.nan
    logits[8, v - 1] = np.inf                           # +inf at the very end, in the last (short) chunk
    want = ref.argmax(logits)
    assert want.tolist() == [c - 1, c, c + 1, 0, c + 7, 0, 0, v - 1, v - 1]
    d = to_device(logits)
    for threads in pick([32, 64], [128, 256, 1024]):
        assert launch_split_argmax(logits, parts, threads, d).tolist() == want.tolist()


def test_split_argmax_rounds_of_loads_and_the_default_policy():
    """Chunks several rounds of UNROLL * threads long, with a tie between rounds; then a vocabulary big enough
    that the launcher's own policy splits (P > 1) even for one row."""
    rng = np.random.default_rng(21)
    threads = pick(32, 256)
    rnd = am.UNROLL * threads
    v = 2 * (2 * rnd + 37)                              # P = 2: two full rounds and a partial one per chunk
    logits = np.stack([make_row(rng, k, v) for k in ("normal", "ties", "neg_inf")])
    logits[0, [rnd - 1, rnd, 2 * rnd + 5]] = 50.0       # a tie between the first two rounds of chunk 0
    assert launch_split_argmax(logits, 2, threads).tolist() == ref.argmax(logits).tolist()
    v = 3 * sp.MIN_CHUNK + 5
    parts, c = sp.argmax_partitions(1, v)
    assert parts == 3
    row = make_row(rng, "ties", v)
    row[[c - 1, c, 2 * c]] = 50.0
    assert launch_split_argmax(row[None]).tolist() == [c - 1]


def test_split_argmax_merge_with_more_partials_than_threads():
    """Stage 2 where each thread merges several partials (t, t + threads, ...): the launcher gives it that only
    past 1024 partitions, so both stages are launched here directly, with the maximum tied across the passes."""
    rng = np.random.default_rng(34)
    threads, parts, chunk = 32, 70, 3                    # partials 0-31, 32-63, 64-69: three passes
    vocab = parts * chunk
    logits = np.stack([make_argmax_row(rng, k, vocab, chunk) for k in ("normal", "nan", "boundary_ties", "ties")])
    logits[3, [45 * chunk + 1, 69 * chunk, 66 * chunk + 2]] = 100.0   # the winner in the second pass
    d_logits, part_index, out = to_device(logits), device_empty(len(logits) * parts, np.int32), \
        device_empty(len(logits), np.int32)
    launch(am._argmax_partial_kernel(threads), (len(logits), parts), threads, 0, d_logits, chunk, part_index)
    launch(am._argmax_merge_kernel(threads), len(logits), threads, 0, d_logits, part_index, parts, out)
    np.testing.assert_array_equal(out.copy_to_host(), ref.argmax(logits))


def test_split_argmax_strided_logits():
    """Logits that are a window of a wider buffer (row stride > V, and an offset): any strides are allowed."""
    rng = np.random.default_rng(22)
    wide = make_row(rng, "ties", 3 * 150).reshape(3, 150)
    d = to_device(wide)[:, 7:7 + 131]
    want = ref.argmax(wide[:, 7:7 + 131])
    for partitions in (1, 3):
        assert launch_split_argmax(wide[:, 7:7 + 131], partitions, pick(32, 256), d).tolist() == want.tolist()


def test_argmax_partition_policy():
    """From shapes only: no empty partition, chunks of at least MIN_CHUNK when split, about TARGET_BLOCKS
    blocks, P = 1 for many rows, the launcher splitting as the policy says, and argmax_workspace_size covering
    every batch up to its row count."""
    for v in (1, 2, 100, sp.MIN_CHUNK, 2 * sp.MIN_CHUNK - 1, 2 * sp.MIN_CHUNK, 49152, 128256,
              10 ** 6):
        need = 0
        for s in list(range(1, 300)) + [1023, 1024, 1025, 5000]:
            parts, chunk = sp.argmax_partitions(s, v)
            assert (parts - 1) * chunk < v <= parts * chunk, (s, v)
            assert parts == 1 or (chunk >= sp.MIN_CHUNK and s * parts < sp.TARGET_BLOCKS + s), (s, v)
            assert (parts == 1) == (s >= sp.TARGET_BLOCKS or v < 2 * sp.MIN_CHUNK), (s, v)
            assert am.partition(v, parts) == (parts, chunk), (s, v)    # what greedy's launcher splits
            if parts > 1:
                need = max(need, s * parts)
            if s < 300:
                assert sp.argmax_workspace_size(s, v) == max(1, need), (s, v)
    assert [sp.argmax_partitions(s, 128256) for s in (1, 64, 256)] == [(62, 2069), (16, 8016), (4, 32064)]
    assert am.partition(9, 4) == (3, 3)                               # 4 asked, 3 non-empty
    assert am.partition(5, 100) == (5, 1)


def test_split_argmax_checks_its_workspace():
    v = 40
    logits, out = to_device(np.zeros((3, v), np.float32)), device_empty(3, np.int32)
    with pytest.raises(ValueError, match=r"at least 12 int32 elements \(3 rows x 4 partitions"):
        am.argmax(logits, out, workspace=device_empty(11, np.int32), partitions=4)
    with pytest.raises(TypeError, match="workspace must be int32, got float32"):
        am.argmax(logits, out, workspace=device_empty(12, np.float32), partitions=4)
    with pytest.raises(TypeError, match="workspace must be a device array"):
        am.argmax(logits, out, workspace=np.zeros(12, np.int32), partitions=4)
    with pytest.raises(ValueError, match="must be 1-D"):
        am.argmax(logits, out, workspace=device_empty((3, 4), np.int32), partitions=4)
    with pytest.raises(ValueError, match="4 partitions need a workspace: an int32 device array of at least 12"):
        am.argmax(logits, out, partitions=4)
    with pytest.raises(ValueError, match="a workspace is for the split kernels: pass partitions too"):
        am.argmax(logits, out, workspace=device_empty(12, np.int32))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="partitions must be a positive int"):
            am.argmax(logits, out, workspace=device_empty(12, np.int32), partitions=bad)
    with pytest.raises(ValueError, match="threads must be one of"):
        am.argmax(logits, out, threads=48, workspace=device_empty(12, np.int32))
    # P = 1 needs no workspace (stage 1 writes out itself); a larger workspace than needed is fine
    host = np.zeros((3, v), np.float32)
    host[:, [3, 17]] = 1.0
    am.argmax(to_device(host), out, partitions=1, threads=32)
    assert out.copy_to_host().tolist() == [3, 3, 3]
    am.argmax(to_device(host), out, workspace=device_empty(1000, np.int32), partitions=4, threads=32)
    assert out.copy_to_host().tolist() == [3, 3, 3]
    # zero rows: checked, nothing launched
    am.argmax(to_device(np.zeros((0, v), np.float32)), device_empty(0, np.int32),
              workspace=device_empty(1, np.int32), partitions=1)


# --- sample -------------------------------------------------------------------------------------------------

@st.composite
def sampling_batches(draw, num_rows=rows, vocab_sizes=vocabs, threads=block_sizes):
    """(logits, temperature, top_k, top_p, min_p, uniform, threads): per-row kinds and parameters."""
    num_seqs, vocab, threads = draw(num_rows), draw(vocab_sizes), draw(threads)
    rng = np.random.default_rng(draw(seeds))
    # the first row's parameters are drawn; further rows (on the GPU, up to hundreds) mix them at random
    first = dict(
        kind=draw(st.sampled_from(KINDS)),
        temperature=draw(st.sampled_from([0.0, 0.05, 0.7, 1.0]) | st.floats(0.05, 3.0)),
        top_k=draw(st.sampled_from([0, -1, 1, 2, vocab - 1, vocab, vocab + 3]) | st.integers(1, vocab)),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 1e-6, BELOW_ONE]) | st.floats(0.01, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 1.0]) | st.floats(0.0, 0.5)),
        u=draw(st.sampled_from([0.0, 0.5, BELOW_ONE]) | st.floats(0.0, 1.0, exclude_max=True)),
    )
    table = [first] + [dict(
        kind=KINDS[rng.integers(len(KINDS))],
        temperature=float(rng.choice([0.0, 0.6, 1.0, 1.5])),
        top_k=int(rng.choice([0, 1, 50, vocab, int(rng.integers(1, vocab + 1))])),
        top_p=float(rng.choice([1.0, 0.9, 0.3, rng.random()])),
        min_p=float(rng.choice([0.0, 0.1, rng.random() * 0.3])),
        u=float(rng.random()),
    ) for _ in range(num_seqs - 1)]
    logits = np.stack([make_row(rng, r["kind"], vocab) for r in table])
    column = lambda key, dtype: np.array([r[key] for r in table], dtype)  # noqa: E731
    return (logits, column("temperature", np.float32), column("top_k", np.int32), column("top_p", np.float32),
            column("min_p", np.float32), column("u", np.float32), threads)


@settings(max_examples=examples(25, 20))
@given(sampling_batches())
def test_sample_matches_reference(batch):
    *args, threads = batch
    assert_tokens_match(launch_sample(*args, threads), *args)


def extreme_rows(v):
    """(logits, temperature, top_k, top_p, min_p) of nine rows: every kind of row and filter at once."""
    rng = np.random.default_rng(7)
    kinds = ["normal", "ties", "equal", "neg_inf", "huge", "very_negative", "peaked", "flat", "normal"]
    logits = np.stack([make_row(rng, k, v) for k in kinds])
    # the last row's negative temperature is outside SamplingParams but defined by the reference: p of -l
    temperature = np.array([1, 0.8, 1, 0.5, 1, 1, 0.05, 2, -0.7], np.float32)
    top_k = np.array([1, 5, 3, 0, 2, 50, v, v - 1, 0], np.int32)
    top_p = np.array([1, 0.9, 0.5, 0.95, 1e-6, 0.2, BELOW_ONE, 0.7, 1], np.float32)
    min_p = np.array([0, 0.1, 0, 0.01, 0, 0.05, 1.0, 0, 0.1], np.float32)
    return logits, temperature, top_k, top_p, min_p


def test_sample_extreme_rows_in_one_launch():
    """Every kind of row and filter at once, so each run covers them whatever hypothesis draws."""
    params = extreme_rows(pick(150, 49152))
    for u in (0.0, 0.37, BELOW_ONE):
        args = (*params, np.full(9, u, np.float32))
        assert_tokens_match(launch_sample(*args, pick(32, 512)), *args)


def test_top_k_one_tiny_top_p_and_min_p_one_are_greedy():
    rng = np.random.default_rng(3)
    v = pick(100, 128256)
    logits = rng.standard_normal((6, v), dtype=np.float32)
    ones = np.ones(6)
    top_k = np.array([1, 1, 0, 0, 0, 0])
    top_p = np.array([1, 1, 1e-6, 1e-6, 1, 1])
    min_p = np.array([0, 0, 0, 0, 1, 1])
    uniform = np.array([0.0, BELOW_ONE, 0.0, 0.5, 0.3, BELOW_ONE])
    got = launch_sample(logits, ones, top_k, top_p, min_p, uniform, pick(32, 512))
    assert got.tolist() == ref.argmax(logits).tolist()


def test_exact_boundaries_follow_the_reference():
    """Where no rounding happens at all, no tolerance applies: ties give p = 1/n exactly."""
    logits = np.zeros((6, 4), np.float32)           # p = 1/4 each, cumulative 1/4, 1/2, 3/4, 1
    logits[4:, 2:] = -np.inf                        # p = 1/2, 1/2, 0, 0
    uniform = np.array([0.25, 0.5, 0.75, 0.0, 0.5, BELOW_ONE])
    ones, zeros = np.ones(6), np.zeros(6)
    got = launch_sample(logits, ones, zeros, ones, zeros, uniform, 32)
    want = ref.sample(logits, ones, zeros, ones, zeros, uniform)
    assert want.tolist() == [1, 2, 3, 0, 1, 1]      # the first token whose cumulative mass EXCEEDS u * total
    assert got.tolist() == want.tolist()
    # the same inside the draw's second level: V = 2^m equal logits, p = 2^-m, more than one token per
    # sub-chunk, and an odd boundary so that it falls between two tokens of the same sub-chunk
    threads = pick(32, 256)
    v = pick(2048, 131072)
    assert -(-v // threads) > threads
    k = np.array([1001, v - 3])
    got = launch_sample(np.zeros((2, v), np.float32), ones[:2], zeros[:2], ones[:2], zeros[:2], k / v, threads)
    assert got.tolist() == k.tolist()


def test_radix_searches_stop_only_when_decided():
    """Rows built so that a digit's bucket holds the answer together with other tokens: stopping there
    would keep those too."""
    rng = np.random.default_rng(4)
    flat = make_row(rng, "flat", pick(150, 49152))                     # ~50 tokens per first-digit bucket
    # pairs 0.1% apart share their first-digit bucket; top_p ends between the two halves of the second pair
    w = np.array([1.0, 0.999, 0.5, 0.4995, 0.25, 0.24975], np.float64)
    pairs = np.log(w).astype(np.float32)[[0, 1, 2, 4, 5, 3]]            # the 0.4995 token last
    p = np.exp(pairs - pairs.max())
    p /= p.sum()
    bits = p.view(np.uint32) >> (2 * steps.RADIX_BITS)
    assert bits[2] == bits[5] and p[2] != p[5]                          # precondition: one bucket, two values
    top_p = np.float32(p[[0, 1, 2]].sum() - 1e-4)
    padded = np.concatenate([pairs, np.full(flat.size - pairs.size, -np.inf, np.float32)])
    logits = np.stack([flat, flat, padded])
    top_k, top_p = np.array([flat.size // 3, 0, 0]), np.array([1.0, 0.4, top_p])
    for u in (0.0, 0.5, BELOW_ONE):
        args = (logits, np.ones(3), top_k, top_p, np.zeros(3), np.full(3, u))
        assert_tokens_match(launch_sample(*args, pick(32, 256)), *args)


@pytest.mark.skipif(not SIM, reason="needs exp(-ln 2) == 1/2 exactly: true of the simulator's correctly "
                                    "rounded exp, not promised by libdevice's expf")
def test_top_p_reached_exactly_keeps_no_more():
    ln2 = np.float32(np.log(2))
    assert np.exp(-ln2) == np.float32(0.5)
    logits = np.tile(np.array([ln2, 0, 0], np.float32), (4, 1))   # p = 1/2, 1/4, 1/4 exactly
    top_p = np.array([0.5, 0.5, 0.75, np.nextafter(np.float32(0.5), np.float32(1))])
    uniform = np.array([0.9, 0.4, 0.9, 0.9])
    ones, zeros = np.ones(4), np.zeros(4)
    want = ref.sample(logits, ones, zeros, top_p, zeros, uniform)
    # top_p 0.5 is reached by the first token alone; 0.75 by the first two (ties keep the third); just above
    # 0.5 needs the 1/4s too
    assert want.tolist() == [0, 0, 2, 2]
    assert launch_sample(logits, ones, zeros, top_p, zeros, uniform, 32).tolist() == want.tolist()


def test_a_large_vocabulary_walks_sub_chunks():
    """V > threads^2: the draw's second level gives each thread more than one element (sub > 1)."""
    rng = np.random.default_rng(9)
    threads = pick(32, 256)
    v = pick(threads * threads + 100, 128256)
    chunk = -(-v // threads)
    logits = np.stack([make_row(rng, k, v) for k in ("flat", "peaked", "normal")])
    temperature, min_p = np.array([1.0, 0.7, 1.3]), np.array([0.0, 0.0, 0.02])
    # the simulator's shared-memory atomics are slow, so there the radix passes stay off (min_p needs none);
    # other tests cover them at smaller V
    top_k, top_p = pick(np.zeros(3), np.array([0, 40, 0])), pick(np.ones(3), np.array([1.0, 0.9, 0.6]))
    # u in the middle of the likeliest token that sits past the first `threads` places of its chunk: a walk
    # that gave each thread one element of the chunk would miss it
    tail = np.flatnonzero(np.arange(v) % chunk >= threads)
    middle = []
    for s in range(3):
        kept = ref.sampling_probs(logits[s], temperature[s], int(top_k[s]), top_p[s], min_p[s]).astype(np.float64)
        c = np.cumsum(kept)
        j = tail[np.argmax(kept[tail])]
        middle.append((c[j] - kept[j] / 2) / c[-1])
    for u in (np.zeros(3), np.array(middle), np.full(3, BELOW_ONE)):
        args = (logits, temperature, top_k, top_p, min_p, u)
        assert_tokens_match(launch_sample(*args, threads), *args)


def test_draws_follow_the_softmax():
    """An even grid of uniforms over one 4-token row: the counts are exactly the probabilities."""
    n = 20
    logits = np.tile(np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32)), (n, 1))
    uniform = (np.arange(n) + 0.5) / n
    got = launch_sample(logits, np.ones(n), np.zeros(n), np.ones(n), np.zeros(n), uniform, 32)
    assert np.bincount(got, minlength=4).tolist() == [2, 4, 6, 8]
    assert (np.diff(got) >= 0).all()  # the inverse CDF is monotone in u


def test_the_oracle_is_narrow():
    """The rounding windows `acceptable_tokens` allows are rare: otherwise the comparison would prove little."""
    rng = np.random.default_rng(11)
    unique = 0
    for i in range(200):
        row = make_row(rng, KINDS[i % len(KINDS)], int(rng.integers(2, 300)))
        params = (float(rng.choice([0.5, 1.0, 2.0])), int(rng.choice([0, 1, 10, 50])),
                  float(rng.choice([1.0, 0.9, 0.5])), float(rng.choice([0.0, 0.05])), float(rng.random()))
        ok = acceptable_tokens(row, *params)
        want = int(ref.sample(row[None], *[np.array([x]) for x in params])[0])
        assert want in ok
        unique += len(ok) == 1
    assert unique >= 196


def model_kernel(row, temperature, top_k, top_p, min_p, u, rng):
    """The kernel's algorithm in NumPy, with its p a few ulps off the reference's (a different exp and
    denominator, kept monotone in z) and exact masses: a stand-in for the GPU, to test the oracle."""
    z = np.asarray(row, np.float32) / np.float32(temperature)
    levels, group = np.unique(-z, return_inverse=True)            # per distinct z, so ties stay ties
    e = np.exp(-levels - z.max()).astype(np.float64) * (1 + rng.integers(-3, 4, levels.size) * F32_EPS)
    e = np.minimum.accumulate(e).astype(np.float32)[group.reshape(-1)]
    p = (e / np.float32(e.astype(np.float64).sum())).astype(np.float32)
    threshold = np.float32(0)
    if 0 < top_k < p.size:
        threshold = max(threshold, np.sort(p)[::-1][top_k - 1])
    if top_p < 1:
        values = np.unique(p)[::-1]
        mass = np.array([p[p >= v].astype(np.float64).sum() for v in values])
        reached = np.flatnonzero(mass >= np.float32(top_p))
        threshold = max(threshold, values[reached[0]] if reached.size else np.float32(0))
    if min_p > 0:
        threshold = max(threshold, np.float32(min_p) * p.max())
    kept = np.where(p >= threshold, p, 0).astype(np.float64)
    c = np.cumsum(kept)
    above = np.flatnonzero(c > float(np.float32(u)) * c[-1])
    return int(above[0]) if above.size else int(np.flatnonzero(kept)[-1])


def test_the_oracle_accepts_legitimate_rounding_differences():
    """Rows put exactly on top-p and u boundaries, drawn by the model kernel: the oracle must accept its
    token whenever it differs from the reference's, and such differences must actually occur here."""
    rng = np.random.default_rng(12)
    differ = 0
    for i in range(300):
        vocab = int(rng.integers(2, 300))
        row = make_row(rng, KINDS[i % len(KINDS)], vocab)
        temperature, top_k, min_p = float(rng.choice([0.5, 1.0])), int(rng.choice([0, 0, 5])), 0.0
        z = row / np.float32(temperature)
        p = np.exp(z - z.max())
        p /= p.sum()
        ordered = np.sort(p)[::-1].astype(np.float64)
        top_p = float(np.float32(np.cumsum(ordered)[rng.integers(vocab)]))  # a cumulative mass exactly
        kept = ref.sampling_probs(row, temperature, top_k, top_p, min_p).astype(np.float64)
        c = np.cumsum(kept)
        u = float(np.float32(c[rng.integers(vocab)] / c[-1]))                # a draw boundary exactly
        u = min(u, BELOW_ONE)
        got = model_kernel(row, temperature, top_k, top_p, min_p, u, rng)
        want = int(ref.sample(row[None], *[np.array([x]) for x in (temperature, top_k, top_p, min_p, u)])[0])
        if got != want:
            differ += 1
            assert got in acceptable_tokens(row, temperature, top_k, top_p, min_p, u), (i, got, want)
    assert differ >= 5


# --- split sample (sample with a workspace) -----------------------------------------------------------------
#
# The split sample runs ten kernels over (row, partition) blocks: under the simulator each costs tens of ms per
# block, so there these tests keep to few rows and partitions; the GPU profile runs them at real sizes.

POISON64 = 0x5A5A5A5A5A5A5A5A  # as int64 an index past any row, as float64 ~1e127, as a count or mass absurd


def split_sample_size(num_seqs, vocab, partitions, threads):
    """uint64 elements that this launch needs: the runner's size, or more for an override of P."""
    parts, _ = split_shape(num_seqs, vocab, partitions)
    t = sp.SPLIT_THREADS if threads is None else threads
    return max(kernels.workspace_elements(num_seqs, parts, t), sp.sample_workspace_size(num_seqs, vocab, t))


def launch_split_sample(logits, temperature, top_k, top_p, min_p, uniform, partitions=None, threads=None,
                        workspace=None):
    """The split sample into a poisoned out, on `workspace` or on a fresh poisoned one: a kernel that read a
    section no earlier kernel of this launch wrote (an unreset histogram, a partial of another row) fails. The
    engine's entry point (sampling_policy.sample) where neither partitions nor threads is given, else the
    launcher with the policy's choice for the one left None."""
    if workspace is None:
        size = split_sample_size(*logits.shape, partitions, threads)
        workspace = to_device(np.full(size, POISON64, np.uint64))
    out = to_device(np.full(logits.shape[0], -1, np.int32))
    params = [to_device(np.asarray(a, d)) for a, d in ((temperature, np.float32), (top_k, np.int32),
                                                       (top_p, np.float32), (min_p, np.float32),
                                                       (uniform, np.float32))]
    if partitions is None and threads is None:
        sp.sample(to_device(logits), *params, out, workspace=workspace)
    else:
        parts, _ = split_shape(*logits.shape, partitions)
        kernels.sample(to_device(logits), *params, out, threads=threads or sp.SPLIT_THREADS, workspace=workspace,
                       partitions=parts if partitions is None else partitions)
    return out.copy_to_host()


# one or two rows of tiny vocabularies in the simulator (1, around a warp, not a multiple of any chunk)
split_sample_rows = st.integers(1, 2) if SIM else st.one_of(st.integers(1, 5), rows)
split_sample_vocabs = st.sampled_from([1, 2, 33, 100]) | st.integers(1, 120) if SIM else vocabs
# None: the policy's (sampling_policy; P = 1 at simulator sizes); on the GPU up to 400, more partitions than tokens
# for the small vocabularies (P = V then; in the simulator
# test_split_sample_boundaries_fallbacks_and_a_reused_workspace has that case)
split_sample_partitions = st.sampled_from([None, 1, 2, 3] + pick([], [16, 62, 200, 400]))


@settings(max_examples=examples(3, 25))
@given(sampling_batches(split_sample_rows, split_sample_vocabs, st.sampled_from(pick([32], [128, 256, 1024]))),
       split_sample_partitions)
def test_split_sample_matches_reference_and_v1(batch, partitions):
    """As the reference (through the oracle), and the same tokens as the one-block-per-row kernel: its
    thresholds and draws are exact integer searches on the same float32 p. (The denominators are float64 sums
    in another order, rounded to float32: they could differ, and with them a token at a boundary, only where
    the sum falls within ~1e-16 of a float32 rounding boundary; no test row comes near that.)"""
    *args, threads = batch
    got = launch_split_sample(*args, partitions, threads)
    assert_tokens_match(got, *args)
    np.testing.assert_array_equal(got, launch_sample(*args, threads))


def test_split_sample_extreme_rows():
    """The extreme rows of test_sample_extreme_rows_in_one_launch, split, each row with its own u (a uniform per
    row is what the runner passes); on the GPU, each u for every row, several partition counts, and v1's
    tokens exactly."""
    args = extreme_rows(pick(150, 49152))
    cycle = np.resize(np.array([0.0, 0.37, BELOW_ONE], np.float32), 9)
    for uniform in pick([cycle], [np.full(9, u, np.float32) for u in (0.0, 0.37, BELOW_ONE)]):
        for partitions in pick([2], [None, 3, 64]):
            got = launch_split_sample(*args, uniform, partitions, pick(32, 256))
            assert_tokens_match(got, *args, uniform)
            if not SIM:
                np.testing.assert_array_equal(got, launch_sample(*args, uniform, 256))


def test_split_sample_boundaries_fallbacks_and_a_reused_workspace():
    """Exact draw boundaries on a partition edge (p = 1/4 each, no rounding anywhere), u = 1 (no unit crosses
    the target: the last kept token, through part_last), a greedy row and a row where nothing is kept (the
    greedy token); then the same workspace again for another batch, as CUDA-graph replays reuse it, with more
    partitions asked than there are tokens."""
    threads = pick(32, 128)
    logits = np.zeros((4, 4), np.float32)
    logits[1, 2:] = -np.inf                               # p = 1/2, 1/2, 0, 0
    logits[2] = [1, 3, 3, 2]                              # greedy: the first of the tied maxima
    temperature = np.array([1, 1, 0, 1], np.float32)
    uniform = np.array([0.5, 1.0, 0.5, 0.5], np.float32)
    min_p = np.array([0, 0, 0, 1.5], np.float32)          # min_p > 1 keeps nothing: the greedy token, 0
    zeros, ones = np.zeros(4), np.ones(4)
    workspace = to_device(np.full(split_sample_size(4, 4, 4, threads), POISON64, np.uint64))
    # P = 2: u * total is the edge between the partitions, and token 2 the first past it
    got = launch_split_sample(logits, temperature, zeros, ones, min_p, uniform, 2, threads, workspace)
    assert got.tolist() == [2, 1, 1, 0]
    assert got[:3].tolist() == ref.sample(logits[:3], temperature[:3], zeros[:3], ones[:3], min_p[:3],
                                          uniform[:3]).tolist()
    # the used workspace for another row, 5 partitions asked of 4 tokens (P = 4 of one token each)
    args = (make_row(np.random.default_rng(13), "peaked", 4)[None], np.ones(1), np.array([2]), np.array([0.9]),
            np.array([0.1]), np.array([0.6]))
    assert_tokens_match(launch_split_sample(*args, 5, threads, workspace), *args)
    # V = 1
    single = (np.ones((1, 1), np.float32), np.ones(1), np.ones(1), np.full(1, 0.5), np.zeros(1), np.full(1, 0.7))
    assert launch_split_sample(*single, 1000, threads, workspace).tolist() == [0]


def test_split_sample_walks_a_long_unit():
    """A unit (one thread's sub-chunk of a partition) longer than the block: the draw's last level gives each
    thread more than one element of it, and the token sits past the unit's first `threads` places."""
    rng = np.random.default_rng(9)
    threads, parts = pick(32, 128), 2
    v = parts * (threads * threads + 3 * threads)
    chunk = -(-v // parts)
    sub = -(-chunk // threads)
    assert sub > threads
    row = make_row(rng, "flat", v)
    kept = ref.sampling_probs(row, 1.0, 0, 1.0, 0.0).astype(np.float64)
    c = np.cumsum(kept)
    unit_start = chunk + 2 * sub                           # unit 2 of partition 1
    j = unit_start + threads + 1 + int(np.argmax(kept[unit_start + threads + 1:unit_start + sub]))
    # one row per u (rows are independent): the middle of token j, and the very end
    args = (np.stack([row, row]), np.ones(2), np.zeros(2), np.ones(2), np.zeros(2),
            np.array([(c[j] - kept[j] / 2) / c[-1], BELOW_ONE]))
    got = launch_split_sample(*args, parts, threads)
    assert_tokens_match(got, *args)
    assert got[0] == j


def test_sample_workspace_size_covers_every_batch():
    """From shapes only: sample_workspace_size(n, V) is the most that any batch of up to n rows needs at the
    policy's partitions, for the default block size and others."""
    for v in (1, 100, sp.MIN_CHUNK, 2 * sp.MIN_CHUNK, 49152, 128256):
        for threads in (None, 32, 1024):
            t = sp.SPLIT_THREADS if threads is None else threads
            need = [kernels.workspace_elements(s, sp.argmax_partitions(s, v)[0], t) for s in range(1, 301)]
            for n in (1, 2, 64, 256, 300):
                size = sp.sample_workspace_size(n, v) if threads is None else sp.sample_workspace_size(n, v, threads)
                assert size == max(need[:n]), (v, threads, n)
    assert sp.sample_workspace_size(0, 128256) == 1
    big = sp.sample_workspace_size(5000, 128256)                  # past TARGET_BLOCKS rows P = 1
    assert big == kernels.workspace_elements(5000, 1, sp.SPLIT_THREADS)


def test_split_sample_checks_its_workspace():
    v = 40
    logits, out = to_device(np.zeros((3, v), np.float32)), device_empty(3, np.int32)
    f32, i32 = to_device(np.ones(3, np.float32)), to_device(np.zeros(3, np.int32))
    params = (f32, i32, f32, f32, f32)
    need = kernels.workspace_elements(3, 4, 32)
    with pytest.raises(ValueError, match=rf"at least {need} uint64 elements \(3 rows x 4 partitions x 32 threads"):
        kernels.sample(logits, *params, out, threads=32, workspace=device_empty(need - 1, np.uint64), partitions=4)
    with pytest.raises(TypeError, match="workspace must be uint64, got int32"):
        kernels.sample(logits, *params, out, threads=32, workspace=device_empty(need, np.int32), partitions=4)
    with pytest.raises(TypeError, match="workspace must be a device array"):
        kernels.sample(logits, *params, out, threads=32, workspace=np.zeros(need, np.uint64), partitions=4)
    with pytest.raises(ValueError, match="must be 1-D"):
        kernels.sample(logits, *params, out, threads=32, workspace=device_empty((need, 2), np.uint64), partitions=4)
    with pytest.raises(ValueError, match="a workspace is for the split kernels: pass partitions too"):
        kernels.sample(logits, *params, out, threads=32, workspace=device_empty(need, np.uint64))
    for partitions in (1, 4):  # every split launch needs one, P = 1 included (histograms and row state)
        with pytest.raises(ValueError, match="the split sample's kernels need a workspace: a uint64 device array"):
            kernels.sample(logits, *params, out, partitions=partitions)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="partitions must be a positive int"):
            kernels.sample(logits, *params, out, workspace=device_empty(need, np.uint64), partitions=bad)
    with pytest.raises(ValueError, match="threads must be one of"):
        kernels.sample(logits, *params, out, threads=48, workspace=device_empty(need, np.uint64))
    # zero rows: checked, nothing launched
    kernels.sample(to_device(np.zeros((0, v), np.float32)), *[device_empty(0, d) for d in
                   (np.float32, np.int32, np.float32, np.float32, np.float32)], device_empty(0, np.int32),
                   workspace=device_empty(1, np.uint64), partitions=1)


# --- launchers ----------------------------------------------------------------------------------------------

def test_launchers_reject_bad_arguments():
    logits = to_device(np.zeros((2, 10), np.float32))
    out = device_empty(2, np.int32)
    f32, i32 = to_device(np.ones(2, np.float32)), to_device(np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="logits must be a device array"):
        am.argmax(np.zeros((2, 10), np.float32), out)
    with pytest.raises(TypeError, match="logits must be float32"):
        am.argmax(to_device(np.zeros((2, 10), np.float64)), out)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        am.argmax(to_device(np.zeros(10, np.float32)), out)
    with pytest.raises(ValueError, match=r"out must have shape \(2,\)"):
        am.argmax(logits, device_empty(3, np.int32))
    with pytest.raises(TypeError, match="out must be int32"):
        am.argmax_naive(logits, device_empty(2, np.int64))
    with pytest.raises(ValueError, match="vocab size"):
        am.argmax(to_device(np.zeros((2, 0), np.float32)), out)
    with pytest.raises(ValueError, match="threads must be one of"):
        am.argmax(logits, out, threads=48)
    with pytest.raises(TypeError, match="top_k must be int32"):
        kernels.sample(logits, f32, f32, f32, f32, f32, out)
    with pytest.raises(ValueError, match=r"uniform must have shape \(2,\)"):
        kernels.sample(logits, f32, i32, f32, f32, to_device(np.ones(3, np.float32)), out)
    with pytest.raises(TypeError, match="temperature must be a device array"):
        kernels.sample(logits, np.ones(2, np.float32), i32, f32, f32, f32, out)
    with pytest.raises(ValueError, match="threads must be one of"):
        kernels.sample(logits, f32, i32, f32, f32, f32, out, threads=2048)
    # zero rows: nothing to do, no launch
    kernels.sample(to_device(np.zeros((0, 10), np.float32)), *[device_empty(0, d) for d in
                   (np.float32, np.int32, np.float32, np.float32, np.float32)], device_empty(0, np.int32))


@pytest.mark.skipif(SIM, reason="GPU only: real shapes")
def test_sample_on_a_llama_sized_batch():
    rng = np.random.default_rng(5)
    s, v = 256, 128256
    logits = np.stack([make_row(rng, "peaked" if i % 2 else "normal", v) for i in range(s)])
    args = (logits, np.full(s, 0.8), np.full(s, 50), np.full(s, 0.9), np.zeros(s), rng.random(s))
    assert_tokens_match(launch_sample(*args, 512), *args)


@pytest.mark.skipif(SIM, reason="GPU only: real shapes")
def test_split_sample_on_llama_sized_batches():
    """The runner's case: sampling_policy.sample and its workspace size, at 1, 64 and 256 rows of 128256."""
    rng = np.random.default_rng(6)
    v = 128256
    workspace = to_device(np.full(sp.sample_workspace_size(256, v), POISON64, np.uint64))
    for s in (1, 64, 256):
        logits = np.stack([make_row(rng, "peaked" if i % 2 else "normal", v) for i in range(s)])
        args = (logits, np.full(s, 0.8), np.full(s, 50), np.full(s, 0.9), np.zeros(s), rng.random(s))
        got = launch_split_sample(*args, workspace=workspace)
        assert_tokens_match(got, *args)
        np.testing.assert_array_equal(got, launch_sample(*args, 512))
