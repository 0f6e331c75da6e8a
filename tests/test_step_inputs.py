"""The one-transfer step inputs: compact layout, padding that changes nothing real, typed device views, the
penalty entries after the shape's words (and their buffer's growth)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from numba import cuda

from reference.llama import ForwardBatch
from tinyvllm.batch import SamplingBatch
from tinyvllm.cuda_runner import batch_buckets, width_buckets
from tinyvllm.step_inputs import StepInputs, StepShape, layout


def decode_step(rng, s, width):
    """A decode step of s sequences, one token each, every row sampled."""
    ctx = rng.integers(1, width * 4 + 1, s).astype(np.int32)
    tables = rng.integers(0, 1000, (s, width)).astype(np.int32)
    batch = ForwardBatch(token_ids=rng.integers(0, 500, s).astype(np.int32), positions=ctx - 1,
                         slot_mapping=rng.integers(0, 4000, s).astype(np.int32),
                         cu_seqlens_q=np.arange(s + 1, dtype=np.int32), context_lens=ctx, block_tables=tables,
                         logits_indices=np.arange(s, dtype=np.int32))
    sampling = SamplingBatch(temperature=rng.random(s).astype(np.float32), top_k=rng.integers(0, 50, s).astype(np.int32),
                             top_p=rng.random(s).astype(np.float32), min_p=rng.random(s).astype(np.float32),
                             uniform=rng.random(s).astype(np.float32))
    if rng.random() < 0.7:  # penalties and logprobs on some rows
        counts = rng.integers(0, 4, s)
        sampling.entry_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        sampling.entries = rng.integers(0, 500, (int(counts.sum()), 4)).astype(np.int32)
        sampling.pending = rng.integers(0, 2, s).astype(np.int32)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(sampling, name, rng.random(s).astype(np.float32))
        sampling.num_logprobs = rng.integers(-1, 21, s).astype(np.int32)
    return batch, sampling


def test_layout_is_compact_and_ordered():
    offsets, words = layout(StepShape(7, 3, 2, 5))
    assert offsets["token_ids"] == (0, 7) and offsets["chain_src"] == (7, 7) and offsets["slot_mapping"] == (21, 7)
    assert offsets["cu_seqlens_q"] == (28, 4) and offsets["logits_indices"] == (35, 2)
    assert offsets["entry_offsets"] == (57, 3) and offsets["prompt_rows"] == (60, 0)
    assert offsets["block_tables"] == (words - 15, 15)
    assert words == 4 * 7 + 4 + 3 + 11 * 2 + 3 + 15
    offsets, more = layout(StepShape(7, 3, 2, 5, 4))  # with prompt-logprob rows
    assert offsets["prompt_rows"] == (60, 4) and offsets["prompt_num_logprobs"] == (68, 4) and more == words + 12


@given(s=st.integers(1, 6), pad=st.integers(0, 5), width=st.integers(1, 4), wpad=st.integers(0, 3),
       seed=st.integers(0, 2 ** 32 - 1))
def test_padded_step_round_trips_through_the_device(s, pad, width, wpad, seed):
    rng = np.random.default_rng(seed)
    batch, sampling = decode_step(rng, s, width)
    b, w = s + pad, width + wpad
    shape = StepShape(b, b, b, w)
    inputs = StepInputs(16, 16, 8)
    stream = cuda.stream()
    # a first step in the other host buffer: the second write must not disturb what it uploaded
    inputs.write(shape, *decode_step(np.random.default_rng(seed + 1), s, width))
    inputs.upload(shape, stream)
    first = inputs.host
    chain = np.where(rng.random(s) < 0.5, rng.integers(0, s, s), -1).astype(np.int32)
    inputs.write(shape, batch, sampling, chain)
    assert inputs.host is not first
    inputs.upload(shape, stream)
    stream.synchronize()
    got = {k: v.copy_to_host() for k, v in inputs.views(shape).items()}
    np.testing.assert_array_equal(got["chain_src"], np.concatenate([chain, np.full(pad, -1)]))
    assert got["temperature"].dtype == np.float32 and got["block_tables"].shape == (b, w)
    for name in ("token_ids", "positions", "slot_mapping", "context_lens", "logits_indices"):
        np.testing.assert_array_equal(got[name][:s], getattr(batch, name))
    for name in ("temperature", "top_k", "top_p", "min_p", "uniform"):
        np.testing.assert_array_equal(got[name][:s], getattr(sampling, name))
    if sampling.entries is not None:
        for name in ("pending", "repetition_penalty", "presence_penalty", "frequency_penalty", "num_logprobs"):
            np.testing.assert_array_equal(got[name][:s], getattr(sampling, name))
        np.testing.assert_array_equal(got["entry_offsets"][: s + 1], sampling.entry_offsets)
        np.testing.assert_array_equal(got["entries"][: len(sampling.entries)], sampling.entries)
    # padding and unused rows: neutral penalties, no entries, no logprobs
    last = 0 if sampling.entry_offsets is None else sampling.entry_offsets[-1]
    assert (got["entry_offsets"][s:] == last).all() and got["entries"].shape == (inputs.entry_capacity, 4)
    assert (got["num_logprobs"][s:] == -1).all() and (got["pending"][s:] == 0).all()
    assert (got["repetition_penalty"][s:] == 1).all() and (got["presence_penalty"][s:] == 0).all()
    np.testing.assert_array_equal(got["block_tables"][:s, :width], batch.block_tables)
    # padding rows: no KV write, an empty context, greedy, their own row sampled, one token each
    assert (got["slot_mapping"][s:] == -1).all() and (got["context_lens"][s:] == 0).all()
    assert (got["temperature"][s:] == 0).all() and (got["top_p"][s:] == 1).all()
    np.testing.assert_array_equal(got["logits_indices"], np.arange(b))
    np.testing.assert_array_equal(got["cu_seqlens_q"], np.arange(b + 1))
    assert (got["block_tables"][s:] == -1).all() and (got["block_tables"][:, width:] == -1).all()


def test_buckets():
    assert batch_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 32, 40) and batch_buckets(1) == (1,)
    assert batch_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300)
    assert width_buckets(8192) == (16, 32, 64, 256, 1024, 4096, 8192)
    assert width_buckets(100) == (16, 32, 64, 100) and width_buckets(5) == (5,) and width_buckets(20) == (16, 20)


def test_short_contexts_decode_in_one_pass():
    """A context of up to 512 tokens (16-token blocks) lands in a bucket whose decode attention takes one pass
    (no split-K partitions, no reduce kernel) at the batches the decode-step goals measure (Llama-3.2-1B heads)."""
    from cuda_kernels import attention_policy as pa

    for tokens in (129, 272, 511):
        width = next(w for w in width_buckets(8192) if w >= -(-(tokens + 1) // 16))
        for batch, warps in ((1, 8), (16, 8), (64, 4)):   # the GPU's warps policy (the simulator's uses fewer)
            assert pa.decode_partitions(batch, 32, 8, width, warps)[0] == 1, (tokens, batch, width)


def test_entries_grow_and_are_copied_after_the_shape():
    rng = np.random.default_rng(0)
    batch, sampling = decode_step(rng, 3, 2)
    sampling.entry_offsets = np.array([0, 5, 5, 9], np.int32)
    sampling.entries = rng.integers(0, 500, (9, 4)).astype(np.int32)
    inputs = StepInputs(8, 4, 4, entry_capacity=4)
    shape = StepShape(3, 3, 3, 2)
    with pytest.raises(ValueError, match="9 penalty entries, the buffers hold 4"):
        inputs.write(shape, batch, sampling)
    inputs.grow_entries(9)
    assert inputs.entry_capacity == 16
    stream = cuda.stream()
    inputs.write(shape, batch, sampling)
    inputs.upload(shape, stream)
    stream.synchronize()
    np.testing.assert_array_equal(inputs.views(shape)["entries"].copy_to_host()[:9], sampling.entries)
