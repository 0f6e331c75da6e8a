"""The reference Llama forward: the KV cache, chunking and batching change nothing but summation order."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.bf16 import bf16_to_f32
from reference.llama import ForwardBatch, ReferenceLlama, single_sequence_batch
from tinyvllm.config import ModelConfig
from tinyvllm.weights import load_weights

BLOCK = 4


@pytest.fixture(scope="module", params=["tiny", "tiny-llama3"])
def model(request):
    model_dir = request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "tiny_llama3_model_dir")
    config = ModelConfig.from_dir(model_dir)
    return ReferenceLlama(config, load_weights(model_dir, config))


def full_logits(model, tokens):
    """Logits at every position, each by recomputing the whole prefix from an empty cache."""
    out = []
    for n in range(1, len(tokens) + 1):
        kv = model.new_kv_cache(-(-n // BLOCK), BLOCK)
        table = np.random.default_rng(n).permutation(kv.num_blocks).astype(np.int32)
        out.append(model.forward(single_sequence_batch(tokens[:n], 0, table, BLOCK), kv)[0])
    return np.stack(out)


def close(a, b):
    # Only the summation order differs (one token vs many per matmul), but K and V are rounded to bf16 in
    # the cache: an order-dependent fp32 difference can flip one rounding, a relative change of up to 2^-8
    # in one cached value, which moves the logits by that fraction of their scale.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2 ** -8 * np.abs(b).max())


@settings(max_examples=5)
@given(st.lists(st.integers(0, 259), min_size=2, max_size=20))
def test_cached_decode_equals_recomputing_the_sequence(model, tokens):
    kv = model.new_kv_cache(-(-len(tokens) // BLOCK) + 2, BLOCK)
    table = np.random.default_rng(0).permutation(kv.num_blocks).astype(np.int32)
    step_logits = [model.forward(single_sequence_batch(tokens[:1], 0, table, BLOCK), kv)[0]]
    for i in range(1, len(tokens)):
        step_logits.append(model.forward(single_sequence_batch(tokens[i:i + 1], i, table, BLOCK), kv)[0])
    close(np.stack(step_logits), full_logits(model, tokens))


@settings(max_examples=5)
@given(st.lists(st.integers(0, 259), min_size=2, max_size=24), st.integers(1, 7))
@example([0] * 13 + [101], 2)  # on "tiny", a layer-0 K two bf16 units apart (see below)
def test_chunked_prefill_equals_prefill_at_once(model, tokens, chunk):
    kv_once = model.new_kv_cache(-(-len(tokens) // BLOCK), BLOCK)
    table = np.arange(kv_once.num_blocks, dtype=np.int32)
    at_once = model.forward(single_sequence_batch(tokens, 0, table, BLOCK), kv_once)
    kv = model.new_kv_cache(kv_once.num_blocks, BLOCK)
    for start in range(0, len(tokens), chunk):
        last = model.forward(single_sequence_batch(tokens[start:start + chunk], start, table, BLOCK), kv)
    close(last, at_once)
    # The caches hold the same bf16 K and V. Layer 0's come from the same inputs in another summation order:
    # one bf16 unit apart where that order flipped a rounding (rtol), plus the fp32 difference itself, which
    # scales with the summed terms, not with the value: where a dot product or RoPE's a c - b s cancels to a
    # tiny value, a few fp32 ulps of the layer's scale are several bf16 units of it (CI found -2.110e-5
    # against -2.134e-5, two units, in a layer whose values reach 2.6). 2^-16 of the layer's largest value
    # (128 fp32 ulps) bounds that. A later layer's inputs went through attention over the earlier layers'
    # cached (possibly flipped) values, so its K and V may differ by a few units, bounded like close()'s
    # logits by one rounding (2^-8) of the layer's scale, with slack. The unwritten slots are NaN in both.
    layers = len(kv.k)
    for i, (a, b) in enumerate(zip(kv.k + kv.v, kv_once.k + kv_once.v)):
        fa, fb = bf16_to_f32(a), bf16_to_f32(b)
        assert np.array_equal(np.isnan(fa), np.isnan(fb))
        fa, fb = fa[~np.isnan(fb)], fb[~np.isnan(fb)]
        atol = (2 ** -16 if i % layers == 0 else 2 ** -7) * np.abs(fb).max()
        np.testing.assert_allclose(fa, fb, rtol=2 ** -7, atol=atol)


def test_a_mixed_batch_equals_each_sequence_alone(model):
    """Three sequences in one step: a decode, a chunk of a prompt with cached context, and a fresh prompt."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 260, n).tolist() for n in (9, 13, 6)]
    already = [8, 5, 0]                     # tokens of each sequence already in the cache
    nblocks = [-(-len(s) // BLOCK) for s in seqs]
    kv = model.new_kv_cache(sum(nblocks), BLOCK)
    perm = rng.permutation(kv.num_blocks).astype(np.int32)
    tables = np.full((3, max(nblocks)), -1, np.int32)
    offsets = np.cumsum([0] + nblocks)
    for s in range(3):
        tables[s, : nblocks[s]] = perm[offsets[s]: offsets[s + 1]]
        if already[s]:
            model.forward(single_sequence_batch(seqs[s][: already[s]], 0, tables[s], BLOCK), kv)
    new = [seq[a:] for seq, a in zip(seqs, already)]
    positions = np.concatenate([np.arange(a, len(seq)) for seq, a in zip(seqs, already)])
    seq_of_token = np.repeat(np.arange(3), [len(n) for n in new])
    batch = ForwardBatch(
        token_ids=np.concatenate(new),
        positions=positions,
        slot_mapping=tables[seq_of_token, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK,
        cu_seqlens_q=np.concatenate([[0], np.cumsum([len(n) for n in new])]),
        context_lens=np.array([len(s) for s in seqs]),
        block_tables=tables,
        logits_indices=np.cumsum([len(n) for n in new]) - 1,
    )
    batched = model.forward(batch, kv)
    for s in range(3):
        close(batched[s], full_logits(model, seqs[s])[-1])


def test_row_blocks_and_attention_in_threads_change_nothing_but_summation_order(model, monkeypatch):
    """A prompt long enough for the thread pool (forced here: two workers, blocks of about 5 rows,
    attention tiles of 4 queries in threads): the same logits and cache as in one piece."""
    tokens = np.random.default_rng(5).integers(0, 260, 30).tolist()
    table = np.arange(-(-len(tokens) // BLOCK), dtype=np.int32)
    kv_once = model.new_kv_cache(len(table), BLOCK)
    at_once = model.forward(single_sequence_batch(tokens, 0, table, BLOCK), kv_once)
    for name, value in [("parallel.WORKERS", 2), ("parallel.ROW_BLOCK", 5), ("paged_attention.WORKERS", 2),
                        ("paged_attention.PARALLEL_SCORES", 0), ("paged_attention.QUERY_TILE", 4)]:
        monkeypatch.setattr("reference." + name, value)
    kv = model.new_kv_cache(len(table), BLOCK)
    close(model.forward(single_sequence_batch(tokens, 0, table, BLOCK), kv), at_once)
    for a, b in zip(kv.k + kv.v, kv_once.k + kv_once.v):       # one bf16 rounding apart at most
        a, b = bf16_to_f32(a), bf16_to_f32(b)
        np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=2 ** -7 * np.nanmax(np.abs(b)))


def test_trace_sees_whole_results_with_the_thread_pool_on(model, monkeypatch):
    """With the thread pool forced on, tracing runs each layer as one block: trace sees every operation
    once, in order, with all rows; the logits and an fp8 cache with scales come out as without the trace."""
    from reference.kv_format import kv_decode
    from reference.llama import TRACE_POINTS, PagedKVCache

    for name, value in [("parallel.WORKERS", 2), ("parallel.ROW_BLOCK", 5), ("paged_attention.WORKERS", 2),
                        ("paged_attention.PARALLEL_SCORES", 0), ("paged_attention.QUERY_TILE", 4)]:
        monkeypatch.setattr("reference." + name, value)
    c = model.config
    tokens = np.random.default_rng(6).integers(0, 260, 23).tolist()
    table = np.arange(-(-len(tokens) // BLOCK), dtype=np.int32)
    batch = single_sequence_batch(tokens, 0, table, BLOCK)

    def cache():
        return PagedKVCache(c.num_layers, len(table), BLOCK, c.num_kv_heads, c.head_dim, "fp8", 0.5, 2.0)

    kv_plain = cache()
    plain = model.forward(batch, kv_plain)
    seen = []
    model.trace = lambda layer, name, array: seen.append((layer, name, array))     # kept, not copied
    try:
        kv = cache()
        traced = model.forward(batch, kv)
    finally:
        model.trace = None
    close(traced, plain)
    np.testing.assert_allclose(kv_decode(kv.k[0], 0.5), kv_decode(kv_plain.k[0], 0.5), rtol=2 ** -3)
    expected = [(-1, "embedding")] + [(i, op) for i in range(c.num_layers) for op in TRACE_POINTS]
    assert [(layer, name) for layer, name, _ in seen] == expected + [(-1, "final_norm"), (-1, "logits")]
    t = len(tokens)
    for layer, name, array in seen[:-2]:
        assert len(array) == t, (layer, name, array.shape)
    # what trace was given is not overwritten later (x and q are updated in place by the forward)
    np.testing.assert_array_equal(seen[0][2], bf16_to_f32(model.embed_tokens[tokens]))
    traced_q = {layer: array for layer, name, array in seen if name == "q"}
    assert not np.array_equal(traced_q[0], traced_q[1])


def test_logits_are_varied_and_finite(model):
    logits = full_logits(model, [1, 2, 3, 4, 5])
    assert np.all(np.isfinite(logits))
    assert logits.std() > 0.1 and len(set(np.argmax(logits, -1).tolist())) > 1


def test_bf16_matmul_precision_rounds_every_projection_input(tiny_model_dir):
    """matmul_precision "bf16" changes the logits by about bf16's relative precision, no more, and rounds
    every projection's input: with every weight but one row of the embedding zero, nothing differs."""
    config = ModelConfig.from_dir(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config)
    fp32 = ReferenceLlama(config, weights)
    bf16 = ReferenceLlama(config, weights, matmul_precision="bf16")
    tokens = list(range(1, 12))
    table = np.arange(4, dtype=np.int32)
    a = fp32.forward(single_sequence_batch(tokens, 0, table, BLOCK), fp32.new_kv_cache(4, BLOCK))
    b = bf16.forward(single_sequence_batch(tokens, 0, table, BLOCK), bf16.new_kv_cache(4, BLOCK))
    assert not np.array_equal(a, b)
    scale = np.abs(a).max()
    np.testing.assert_allclose(b, a, atol=0.05 * scale)
    # the LM head alone: its input is rounded, so the logits are the rounded input times the head
    x = np.random.default_rng(0).standard_normal((3, config.hidden_size)).astype(np.float32)
    from reference.bf16 import round_to_bf16
    np.testing.assert_array_equal(bf16._linear(x, bf16.lm_head), round_to_bf16(x) @ bf16.lm_head.T)
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        ReferenceLlama(config, weights, matmul_precision="fp16")
