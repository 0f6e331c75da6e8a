"""The logprobs kernel against reference/sampling.top_logprobs and a float64 log-softmax.

Ids and ranks must equal the reference's exactly (the order of logits is exact); values must agree with the
float64 log-softmax of the same logits to float32 rounding (the kernel sums exp in float64 in another order,
so at most one float32 unit apart, plus the float64 sum's own error).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, pick, sizes, to_device

from cuda_kernels import logprobs as kernels
from reference import sampling as ref

seeds = st.integers(0, 2**32 - 1)
rows = sizes(4, [1, 64, 256], 300)
vocabs = sizes(300, [128256, 49152], 5000)
WIDTH = 21  # the engine's: MAX_LOGPROBS + 1
KINDS = ("normal", "ties", "neg_inf", "peaked", "very_negative")


def make_logits(rng, kind, num_rows, vocab):
    x = (rng.standard_normal((num_rows, vocab)) * 4).astype(np.float32)
    if kind == "ties":
        x = np.round(x)
    elif kind == "neg_inf":  # masked tokens (min_tokens, logit_bias -100 is finite but large)
        x[rng.random(x.shape) < 0.5] = -np.inf
        x[:, 0] = 1.0
    elif kind == "peaked":
        x *= np.float32(0.1)
        x[:, rng.integers(vocab, size=min(vocab, 3))] += np.float32(12)
    elif kind == "very_negative":
        x -= np.float32(3e4)
    return x


def run(logits, targets, num, width=WIDTH, threads=None):
    num_rows = logits.shape[0]
    ids, values, ranks = (device_empty((num_rows, width), np.int32), device_empty((num_rows, width), np.float32),
                          device_empty(num_rows, np.int32))
    kernels.top_logprobs(to_device(logits), to_device(np.asarray(targets, np.int32)),
                         to_device(np.asarray(num, np.int32)), ids, values, ranks, threads=threads)
    return ids.copy_to_host(), values.copy_to_host(), ranks.copy_to_host()


def check(logits, targets, num, got, width=WIDTH):
    want_ids, want_values, want_ranks = ref.top_logprobs(logits, targets, num, width - 1)
    exact = ref.log_softmax(logits)
    ids, values, ranks = got
    for s in range(logits.shape[0]):
        n = int(num[s])
        if n < 0:
            continue
        used = slice(0, 1 + min(n, logits.shape[1]))
        np.testing.assert_array_equal(ids[s, used], want_ids[s, used])
        assert ranks[s] == want_ranks[s]
        truth = exact[s, ids[s, used]]
        # one float32 rounding of the float64 value, plus the float64 sums' error (relative 1e-15 of the lse)
        tol = np.spacing(np.abs(truth).astype(np.float32)).astype(np.float64) + 1e-12 * (1 + np.abs(truth))
        got = values[s, used].astype(np.float64)
        finite = np.isfinite(truth)   # a masked token's -inf is exact
        assert np.all(got[~finite] == truth[~finite]), (s, got, truth)
        assert np.all(np.abs(got[finite] - truth[finite]) <= tol[finite]), (s, got, truth)
        np.testing.assert_allclose(values[s, used], want_values[s, used], rtol=0, atol=float(tol[finite].max(
            initial=0)))


@settings(max_examples=examples(15, 12))
@given(seeds, rows, vocabs, st.sampled_from(KINDS), st.sampled_from(pick([32, 64], [128, 256, 1024])))
def test_top_logprobs_match_the_reference_and_float64(seed, num_rows, vocab, kind, threads):
    rng = np.random.default_rng(seed)
    logits = make_logits(rng, kind, num_rows, vocab)
    num = rng.integers(-1, WIDTH, num_rows)
    targets = rng.integers(0, vocab, num_rows)
    if kind == "neg_inf":
        targets[:] = 0
    check(logits, targets, num, run(logits, targets, num, threads=threads))


def test_ranks_ties_and_short_rows():
    """The target's rank counts every token at least as likely (ties included); equal logits list the lower
    id first; a row with fewer tokens than asked gives -1 after its last; skipped rows are not written."""
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0], [5, 4, 3, 2, 1]], np.float32)
    ids, values, ranks = run(logits, [2, 4, 0], [3, 7, -1], width=8)
    assert ids[0, :4].tolist() == [2, 1, 2, 4] and ranks[0] == 3
    assert ids[1, :8].tolist() == [4, 0, 1, 2, 3, 4, -1, -1] and ranks[1] == 5
    np.testing.assert_allclose(values[1, :6], np.log(0.2), rtol=1e-6)
    assert np.isnan(values[1, 6:]).all()
    check(logits[:2], [2, 4], [3, 7], (ids[:2], values[:2], ranks[:2]), width=8)


def test_launcher_checks_its_arguments():
    logits = to_device(np.zeros((2, 10), np.float32))
    i32 = to_device(np.zeros(2, np.int32))
    ids, values = device_empty((2, 4), np.int32), device_empty((2, 4), np.float32)
    with pytest.raises(TypeError, match="logits must be a 2-D device array"):
        kernels.top_logprobs(np.zeros((2, 10), np.float32), i32, i32, ids, values, i32)
    with pytest.raises(ValueError, match=r"out_logprobs must have shape \(2, 4\)"):
        kernels.top_logprobs(logits, i32, i32, ids, device_empty((2, 5), np.float32), i32)
    with pytest.raises(TypeError, match="targets must be int32"):
        kernels.top_logprobs(logits, to_device(np.zeros(2, np.int64)), i32, ids, values, i32)
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        kernels.top_logprobs(logits, i32, i32, ids, values, i32, threads=48)


@pytest.mark.skipif(SIM, reason="GPU only: real shapes")
def test_top_logprobs_on_llama_sized_rows():
    rng = np.random.default_rng(7)
    logits = make_logits(rng, "peaked", 64, 128256)
    num = np.full(64, 20)
    targets = rng.integers(0, 128256, 64)
    check(logits, targets, num, run(logits, targets, num))
