"""The penalties / logit-bias kernel and its undo against reference/sampling.apply_penalties: bit for bit.

The processed logits are a few float32 operations per entry in a fixed order, so the kernel must give the
reference's values exactly (a greedy row's token is their argmax); restore_logits must give back the input
exactly. Rows are drawn with every kind of entry: prompt-only, output-only, both, biased, masked to -inf,
and a pending token that has an entry of its own or not.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, sizes, to_device

from cuda_kernels import penalties as kernels
from reference import sampling as ref

seeds = st.integers(0, 2**32 - 1)
rows = sizes(4, [1, 64, 256], 300)
vocabs = sizes(300, [128256, 49152], 5000)


def make_step(rng, num_rows, vocab, max_entries, capacity_slack=3):
    """A step's penalty inputs: logits, token ids and the packed per-row entries (distinct tokens per row),
    in a buffer a few entries larger than used (as the runner's, whose capacity is fixed)."""
    logits = (rng.standard_normal((num_rows, vocab)) * 3).astype(np.float32)
    logits[rng.random((num_rows, vocab)) < 0.02] = 0.0                        # l = 0: neither side of the rule
    token_ids = rng.integers(0, vocab, num_rows * 2).astype(np.int32)
    logits_indices = (np.arange(num_rows) * 2 + 1).astype(np.int32)           # the second token of each row
    pending = (rng.random(num_rows) < 0.5).astype(np.int32)
    offsets, chunks = [0], []
    for s in range(num_rows):
        n = int(rng.integers(0, min(vocab, max_entries) + 1))
        tokens = rng.choice(vocab, n, replace=False)
        if n and rng.random() < 0.5:  # the pending token has an entry of its own
            tokens[0] = token_ids[logits_indices[s]]
            tokens = np.unique(tokens)
            rng.shuffle(tokens)
        e = np.zeros((len(tokens), 4), np.int32)
        e[:, 0] = tokens
        e[:, 1] = np.where(rng.random(len(tokens)) < 0.5, rng.integers(0, 9, len(tokens)), 0)
        e[:, 2] = rng.random(len(tokens)) < 0.5
        bias = np.where(rng.random(len(tokens)) < 0.4, rng.uniform(-100, 100, len(tokens)), 0).astype(np.float32)
        bias[rng.random(len(tokens)) < 0.1] = -np.inf                            # min_tokens masks
        e[:, 3] = bias.view(np.int32)
        chunks.append(e)
        offsets.append(offsets[-1] + len(tokens))
    used = offsets[-1]
    entries = np.zeros((used + capacity_slack, 4), np.int32)
    if used:
        entries[:used] = np.concatenate(chunks)
    entries[used:] = [0, 99, 1, np.float32(np.nan).view(np.int32)]             # unused capacity: poison
    params = (rng.choice([1.0, 0.5, 1.3, 2.0], num_rows).astype(np.float32),
              rng.uniform(-2, 2, num_rows).astype(np.float32), rng.uniform(-2, 2, num_rows).astype(np.float32))
    return logits, token_ids, logits_indices, pending, params, np.asarray(offsets, np.int32), entries


def run_kernel(logits, token_ids, logits_indices, pending, params, offsets, entries):
    d_logits = to_device(logits)
    e_cap, rows_ = entries.shape[0], logits.shape[0]
    saved, extra_token, extra_saved = (device_empty(e_cap, np.float32), device_empty(rows_, np.int32),
                                       device_empty(rows_, np.float32))
    d_entries, d_offsets = to_device(entries), to_device(offsets)
    kernels.apply_penalties(d_logits, to_device(token_ids), to_device(logits_indices), to_device(pending),
                            *(to_device(p) for p in params), d_offsets, d_entries, saved, extra_token,
                            extra_saved)
    processed = d_logits.copy_to_host()
    kernels.restore_logits(d_logits, d_offsets, d_entries, saved, extra_token, extra_saved)
    return processed, d_logits.copy_to_host()


@settings(max_examples=examples(15, 15))
@given(seeds, rows, vocabs, st.sampled_from([0, 3, 40]))
def test_penalties_match_the_reference_bit_for_bit_and_restore(seed, num_rows, vocab, max_entries):
    rng = np.random.default_rng(seed)
    step = make_step(rng, num_rows, vocab, max_entries if SIM else max_entries * 10)
    logits, token_ids, logits_indices, pending, params, offsets, entries = step
    want = ref.apply_penalties(logits, token_ids, logits_indices, pending, *params, offsets, entries)
    got, restored = run_kernel(*step)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    np.testing.assert_array_equal(restored.view(np.int32), logits.view(np.int32))


def test_the_rules_one_by_one():
    """Hand-computed values: bias, the repetition rule on each sign, frequency and presence, the pending token
    counted once more (with and without its own entry), and untouched logits."""
    logits = np.array([[2.0, -2.0, 1.0, 4.0, 0.0, 3.0, 5.0]], np.float32)
    token_ids = np.array([5], np.int32)                                      # the pending token: 5
    entries = np.array([[0, 0, 1, 0], [1, 0, 1, 0], [2, 2, 0, 0], [3, 0, 0, 0], [4, 0, 0, 0]], np.int32)
    entries[3, 3] = np.float32(0.5).view(np.int32)
    entries[4, 3] = np.float32(-np.inf).view(np.int32)
    params = (np.float32([2.0]), np.float32([0.25]), np.float32([0.5]))
    offsets = np.array([0, 5], np.int32)
    got, restored = run_kernel(logits, token_ids, np.array([0], np.int32), np.array([1], np.int32), params,
                               offsets, entries)
    # 2/2; -2*2; (1/2) - 0.5*2 - 0.25; 4 + 0.5 (no count, not in the prompt); -inf; the pending 5 alone:
    # 3/2 - 0.5 - 0.25; 6 untouched
    assert got[0].tolist() == [1.0, -4.0, -0.75, 4.5, -np.inf, 0.75, 5.0]
    np.testing.assert_array_equal(restored, logits)
    entries[2, 0] = 5                                                        # now the pending token has an entry
    got, _ = run_kernel(logits, token_ids, np.array([0], np.int32), np.array([1], np.int32), params, offsets,
                        entries)
    assert got[0, 5] == np.float32(3.0 / 2 - 0.5 * 3 - 0.25) and got[0, 2] == 1.0    # count 2 + 1
    np.testing.assert_array_equal(ref.apply_penalties(logits, token_ids, np.array([0], np.int32),
                                                      np.array([1], np.int32), *params, offsets, entries), got)


def test_launcher_checks_its_arguments():
    logits = to_device(np.zeros((2, 10), np.float32))
    i32, f32 = to_device(np.zeros(2, np.int32)), to_device(np.ones(2, np.float32))
    entries, saved = to_device(np.zeros((4, 4), np.int32)), device_empty(4, np.float32)
    offsets = to_device(np.zeros(3, np.int32))
    args = (i32, i32, i32, f32, f32, f32, offsets, entries, saved, i32, f32)
    kernels.apply_penalties(logits, *args)
    with pytest.raises(TypeError, match="logits must be a device array"):
        kernels.apply_penalties(np.zeros((2, 10), np.float32), *args)
    with pytest.raises(ValueError, match=r"entry_offsets must have shape \(3,\)"):
        kernels.apply_penalties(logits, *args[:6], i32, *args[7:])
    with pytest.raises(ValueError, match=r"entries must be \(E, 4\)"):
        kernels.apply_penalties(logits, *args[:7], to_device(np.zeros((4, 3), np.int32)), *args[8:])
    with pytest.raises(ValueError, match=r"saved must have shape \(4,\)"):
        kernels.restore_logits(logits, offsets, entries, device_empty(3, np.float32), i32, f32)
    with pytest.raises(TypeError, match="repetition_penalty must be float32"):
        kernels.apply_penalties(logits, *args[:3], i32, *args[4:])
