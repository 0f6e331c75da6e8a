"""Attention kernels against reference/: prefill (naive, flash, and flash on tensor cores) and decode
(PagedAttention v1, split-K, and the fast GQA-shared kernel with its own split-K).

Every case writes random K/V through random, non-contiguous block tables into caches whose other slots are
NaN, so a kernel that reads past a context (even inside the last, partly filled block) returns NaN and
fails. Value kinds cover ordinary scores, large ones (a near one-hot softmax), exactly tied ones and very
negative ones. The caches come in every KV format the kernel reads (bf16, fp32, fp8 with and without scales:
reference/kv_format.py).
"""

from functools import partial

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, SIM, assert_close, device_empty, examples, pick, to_device

from numba import cuda

from cuda_kernels import (attention, attention_policy, attention_tc, attention_tc_pipelined, gemv, kv_format,
                          matmul_policy, paged_attention, paged_attention_gqa)
from reference import paged_attention as ref
from reference.bf16 import f32_to_bf16, round_to_bf16
from reference.matmul import bf16_planes as reference_bf16_planes
from reference.kv_cache import allocate_kv_cache, kv_cache_write
from reference.kv_format import NANS, kv_decode, round_kv
from reference.rope import rope_tables
from tinyvllm.cuda_graph import CUDAGraph

seeds = st.integers(0, 2**32 - 1)
KINDS = ("normal", "large", "tied", "negative")
kinds = st.sampled_from(KINDS)
# (num_kv_heads, group): GQA ratios 1, 3 and 4 (and 2 with several KV heads); the simulator keeps Hq <= 4.
heads = st.sampled_from(pick([(1, 1), (2, 1), (1, 3), (1, 4), (2, 2)], [(8, 4), (8, 1), (8, 3), (2, 4), (1, 3)]))
head_dims = st.sampled_from(pick([8, 16, 24], [64, 64, 128, 8, 40]))
block_sizes = st.sampled_from(pick([1, 3, 16], [16, 32, 16, 5]))
# (format, k_scale, v_scale): every KV format, fp8 with its engine scales (1) and others; bf16 twice (the default)
KV_FORMATS = [("bf16", 1.0, 1.0), ("bf16", 1.0, 1.0), ("fp32", 1.0, 1.0), ("fp8", 1.0, 1.0), ("fp8", 0.07, 3.0)]
kv_formats = st.sampled_from(KV_FORMATS)


def decode_contexts(shortest=1):
    """Context lengths of a decode batch; shortest=0 lets padding slots (context 0) into the batch."""
    if SIM:  # past 64 keys a warp of the simulator's 2-warp blocks walks a second tile (the rescaling path)
        return st.lists(st.one_of(st.integers(shortest, 40), st.integers(60, 140)), min_size=1, max_size=3)
    few_long = st.lists(st.one_of(st.integers(shortest, 8192), st.sampled_from([1, 33, 4096, 8191, 8192])),
                        min_size=1, max_size=3)
    many_short = st.lists(st.integers(shortest, 300), min_size=1, max_size=256)
    return st.one_of(few_long, many_short)


def prefill_chunks():
    """(q_len, cached prefix) per sequence; q_len 0 is a sequence with nothing to prefill this step."""
    if SIM:
        chunk = st.tuples(st.integers(0, 12), st.integers(0, 40))   # past 32 keys: a second K/V tile
        return st.lists(chunk, min_size=1, max_size=3).filter(lambda c: any(n for n, _ in c))
    few_long = st.lists(st.tuples(st.integers(0, 512), st.integers(0, 1536)), min_size=1, max_size=2)
    many_short = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 300)), min_size=1, max_size=64)
    return st.one_of(few_long, many_short).filter(lambda c: any(n for n, _ in c))


# ---------------------------------------------------------------------------------------------------------
# inputs and tolerances


def make_cache(rng, contexts, block_size, hkv, d, kind, spare_blocks=3, fmt=("bf16", 1.0, 1.0)):
    """K/V for each context written through random non-contiguous block tables; every other slot is NaN.
    fmt: (KV format, k_scale, v_scale).

    Returns k_cache, v_cache, block_tables, and per sequence the (ctx, Hkv, d) K and V as the cache holds them
    (rounded to the format), plus one unit-ish direction per KV head that the 'negative' kind aligns the
    queries against."""
    fmt, k_scale, v_scale = fmt
    blocks_needed = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_needed) + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = np.full((len(contexts), max(max(blocks_needed), 1)), -1, np.int32)
    k_cache = allocate_kv_cache(num_blocks, block_size, hkv, d, fmt)
    v_cache = allocate_kv_cache(num_blocks, block_size, hkv, d, fmt)
    direction = rng.standard_normal((hkv, d)).astype(np.float32)
    ks, vs, used = [], [], 0
    for s, ctx in enumerate(contexts):
        tables[s, : blocks_needed[s]] = perm[used: used + blocks_needed[s]]
        used += blocks_needed[s]
        if kind == "tied":        # every key of a head is the same vector: all scores exactly equal
            k = np.broadcast_to(rng.standard_normal((1, hkv, d), dtype=np.float32), (ctx, hkv, d))
        elif kind == "negative":  # keys close to `direction`; queries point the other way
            k = direction + 0.05 * rng.standard_normal((ctx, hkv, d), dtype=np.float32)
        else:
            k = rng.standard_normal((ctx, hkv, d), dtype=np.float32)
        v = rng.standard_normal((ctx, hkv, d), dtype=np.float32)
        j = np.arange(ctx)
        kv_cache_write(np.ascontiguousarray(k, np.float32), v, k_cache, v_cache,
                       tables[s, j // block_size] * block_size + j % block_size, k_scale, v_scale)
        ks.append(round_kv(k, fmt, k_scale))
        vs.append(round_kv(v, fmt, v_scale))
    return k_cache, v_cache, tables, ks, vs, direction


def make_queries(rng, n, hkv, group, d, kind, direction):
    q = rng.standard_normal((n, hkv * group, d), dtype=np.float32)
    if kind == "large":
        q *= np.float32(100)
    elif kind == "negative":
        # scores around -300 * |direction|^2 * scale (hundreds to thousands below zero), spread by the noise
        q = np.repeat(-300 * direction, group, axis=0)[None] + q
    return q.astype(np.float32)


def attention_atol(queries, ks, vs, scale, group):
    """Absolute tolerance on attention outputs, from the fp32 error terms (both sides compute in fp32).

    queries, ks, vs: per sequence, its (n, Hq, d) queries and (ctx, Hkv, d) keys and values. smag is the
    largest scale * sum_i |q_i k_i| over the (query, key) pairs that meet (it bounds every |score|), n the
    longest context. The output is a weighted mean of values, so errors are in units of max|v|:
    - exp(s - m) and the rescaling by exp(m_old - m_new) carry the rounding of their arguments, about
      eps * |score|, into every weight: 16 eps (1 + smag), as in test_reference_ops' online-softmax test;
    - a score is an fp32 dot product of length d, summed in another order: about eps sqrt(d) smag per side,
      and a score error moves the output by up to twice that: 4 eps sqrt(d) smag;
    - the sums of up to n weights and weighted values, in another order: 8 eps sqrt(n).
    """
    smag, vmax, n = 0.0, 0.0, 1
    for q, k, v in zip(queries, ks, vs):
        if len(q) and len(k):
            qa = np.abs(q).transpose(1, 0, 2)                                   # (Hq, n_q, d)
            ka = np.repeat(np.abs(k), group, axis=1).transpose(1, 2, 0)         # (Hq, d, ctx)
            smag = max(smag, abs(scale) * float((qa @ ka).max()))
            vmax = max(vmax, float(np.abs(v).max()))
            n = max(n, len(k))
    d = ks[0].shape[-1]
    return vmax * F32_EPS * (16 * (1 + smag) + 4 * np.sqrt(d) * smag + 8 * np.sqrt(n)) + 1e-30


def decode_atol(q, ks, vs, scale, group):
    """attention_atol for decode: query s belongs to sequence s."""
    return attention_atol([q[s:s + 1] for s in range(len(q))], ks, vs, scale, group)


def decode_case(seed, contexts, hg, d, block_size, kind, fmt=("bf16", 1.0, 1.0)):
    """One decode batch: queries (S, Hkv * G, d), the paged cache, block tables, context lengths, and the
    K and V per sequence as the cache holds them (for tolerances). hg = (Hkv, G); fmt as make_cache's."""
    rng = np.random.default_rng(seed)
    hkv, group = hg
    k_cache, v_cache, tables, ks, vs, direction = make_cache(rng, contexts, block_size, hkv, d, kind, fmt=fmt)
    q = make_queries(rng, len(contexts), hkv, group, d, kind, direction)
    return q, k_cache, v_cache, tables, np.array(contexts, np.int32), ks, vs


def devices(*arrays):
    return [to_device(a) for a in arrays]


# A configuration of the fast decode kernel valid at every shape of these tests (its launcher takes one).
FAST_CONFIG = dict(lanes_per_key=8, warps=2)


def prefill_flash(q, *args, **kwargs):
    """attention.prefill_attention (same arguments) in attention_policy.prefill_flash_config's configuration for
    q's head_dim."""
    warps, rows = attention_policy.prefill_flash_config(q.shape[2])
    attention.prefill_attention(q, *args, warps=warps, rows=rows, **kwargs)


def prefill_tc(q, *args, keys_per_tile=None, **kwargs):
    """attention_tc.prefill_attention_tc (same arguments) in attention_policy.prefill_tc_config's configuration
    for q's head_dim; keys_per_tile: another tile size."""
    warps, keys = attention_policy.prefill_tc_config(q.shape[2])
    attention_tc.prefill_attention_tc(q, *args, warps=warps, keys_per_tile=keys_per_tile or keys, **kwargs)


def prefill_tc_pipelined(q, *args, keys_per_tile=None, **kwargs):
    """attention_tc_pipelined.prefill_attention_tc_pipelined (same arguments) in
    attention_policy.prefill_pipelined_config's configuration; keys_per_tile: another tile size."""
    warps, keys = attention_policy.prefill_pipelined_config(q.shape[2])
    attention_tc_pipelined.prefill_attention_tc_pipelined(q, *args, warps=warps, keys_per_tile=keys_per_tile or keys,
                                                          **kwargs)


# ---------------------------------------------------------------------------------------------------------
# decode: the first PagedAttention (paged_attention_walk: one warp per (sequence, head), one key at a time)


@settings(max_examples=examples(6, 30))
@given(seeds, decode_contexts(shortest=0), heads, head_dims, block_sizes, kinds, kv_formats)
# always: padding, a one-token and a multi-block context in one batch, two KV heads of two query heads, and a
# head_dim over 32 (lanes own two dims, the second one masked for lanes past d)
@example(seed=3, contexts=[0, 1, 45], hg=(2, 2), d=40, block_size=3, kind="normal", fmt=KV_FORMATS[0])
@example(seed=4, contexts=[0, 7], hg=(1, 3), d=16, block_size=3, kind="normal", fmt=KV_FORMATS[-1])
def test_paged_attention_walk_matches_reference(seed, contexts, hg, d, block_size, kind, fmt):
    q, k_cache, v_cache, tables, lens, ks, vs = decode_case(seed, contexts, hg, d, block_size, kind, fmt)
    scale = 1 / np.sqrt(d)
    out = to_device(np.full(q.shape, np.nan, np.float32))
    paged_attention.paged_attention_walk(*devices(q, k_cache, v_cache, tables, lens), scale, out,
                                         k_scale=fmt[1], v_scale=fmt[2])
    want = decode_reference(q, k_cache, v_cache, tables, lens, scale, fmt)
    assert_close(out, want, atol=decode_atol(q, ks, vs, scale, hg[1]), rtol=4 * F32_EPS)


# ---------------------------------------------------------------------------------------------------------
# decode: PagedAttention v1 (tiles of 32 keys through shared memory)


@settings(max_examples=examples(10, 60))
@given(seeds, decode_contexts(), heads, head_dims, block_sizes, kinds)
# always: two KV heads of two query heads each, and a warp that walks several tiles (rescaling its state)
@example(seed=1, contexts=[300, 3], hg=(2, 2), d=16, block_size=3, kind="normal")
def test_paged_attention_v1_matches_reference(seed, contexts, hg, d, block_size, kind):
    q, k_cache, v_cache, tables, lens, ks, vs = decode_case(seed, contexts, hg, d, block_size, kind)
    group = hg[1]
    scale = 1 / np.sqrt(d)
    out = device_empty(q.shape, np.float32)
    paged_attention.paged_attention_v1(*devices(q, k_cache, v_cache, tables, lens), scale, out)
    want = ref.paged_attention(q, k_cache, v_cache, tables, lens, scale)
    assert_close(out, want, atol=decode_atol(q, ks, vs, scale, group), rtol=4 * F32_EPS)


# ---------------------------------------------------------------------------------------------------------
# decode: the fast kernel (paged_attention, the engine's), one pass or split-K through a workspace

# GQA ratios 1, 3, 4 (and 2); groups of 5 and 7 are cut into two blocks of query heads, the last one short.
fast_heads = st.sampled_from(pick([(1, 1), (1, 3), (1, 4), (2, 2), (1, 5)],
                                  [(8, 4), (8, 1), (8, 3), (2, 4), (1, 3), (2, 7), (1, 6)]))
fast_head_dims = st.sampled_from(pick([8, 16, 24], [64, 64, 128, 8, 40]))
# "none": no workspace (one pass); "policy": a workspace and attention_policy.decode_partitions' split (at the
# policy's warps); n: n KV blocks per partition (the simulator's contexts are shorter than the policy's shortest
# partition).
fast_splits = st.sampled_from(pick(["none", "policy", 1, 2, 3], ["none", "policy", "policy", 1, 4, 33]))


def decode_reference(q, k_cache, v_cache, tables, lens, scale, fmt=("bf16", 1.0, 1.0)):
    """ref.paged_attention, and zeros for the padding slots (context 0)."""
    want = np.zeros(q.shape, np.float32)
    live = lens > 0
    if live.any():
        want[live] = ref.paged_attention(q[live], k_cache, v_cache, tables[live], lens[live], scale, *fmt[1:])
    return want


# warps per block: the policy's (None), one, or more than the policy gives ("most": what the shared memory holds,
# at most MAX_FAST_WARPS; in the simulator at most 4, every thread being a Python thread)
fast_warp_counts = st.sampled_from(pick([None, 1, 3], [None, 8, "most"]))


@settings(max_examples=examples(10, 80))
@given(seeds, decode_contexts(shortest=0), fast_heads, fast_head_dims, st.sampled_from([16, 32]), kinds,
       st.sampled_from([4, 8]), fast_splits, fast_warp_counts, kv_formats, st.sampled_from([0, 1, 3]))
# always: padding, a one-token and a multi-block context in one batch, split into several partitions; a group
# of 5 query heads (two blocks, the second one short) and a head_dim that is not a multiple of 4 words; fp32
# and scaled fp8 caches (2 and 8 elements per word: a row of 3 and of 1 words for 8 lanes)
@example(seed=1, contexts=[0, 1, 70], hg=(2, 2), d=16, block_size=16, kind="normal", lanes=4, split=1, warps=None,
         fmt=KV_FORMATS[0], pieces=1)
@example(seed=2, contexts=[33, 0], hg=(1, 5), d=24, block_size=32, kind="large", lanes=8, split="none", warps=3,
         fmt=KV_FORMATS[0], pieces=3)
@example(seed=3, contexts=[0, 40], hg=(1, 3), d=24, block_size=16, kind="normal", lanes=8, split=1, warps=None,
         fmt=KV_FORMATS[2], pieces=0)
@example(seed=4, contexts=[19, 50], hg=(1, 4), d=8, block_size=16, kind="normal", lanes=4, split="none", warps=None,
         fmt=KV_FORMATS[4], pieces=1)
def test_paged_attention_fast_matches_reference(seed, contexts, hg, d, block_size, kind, lanes, split, warps,
                                                fmt, pieces):
    """Against the reference, and with pieces 1 or 3 the O projection's bf16 planes of the output as well,
    written by the direct or the reduce kernel (each piece exactly reference.matmul.bf16_planes' of the
    output), into a workspace poisoned with 0xFFFF past them (a NaN bf16 pattern) that must stay so."""
    q, k_cache, v_cache, tables, lens, ks, vs = decode_case(seed, contexts, hg, d, block_size, kind, fmt)
    hkv, group = hg
    scale = 1 / np.sqrt(d)
    s, hq = q.shape[:2]
    policy_warps = attention_policy.decode_warps_policy(s, hq, hkv, d, lanes)
    if warps is None:
        warps = policy_warps
    else:
        most = paged_attention_gqa.fast_warps(d, group, lanes,
                                              most=pick(4, paged_attention_gqa.FAST_WARPS_BY_FORMAT[fmt[0]]))
        warps = most if warps == "most" else min(warps, most)
    workspace, partition_blocks = None, None
    if split == "policy":
        size = attention_policy.decode_workspace_size(s, hq, hkv, d, tables.shape[1])
        partition_blocks = attention_policy.decode_partitions(s, hq, hkv, tables.shape[1], policy_warps)[1]
    elif split != "none":
        partition_blocks = split
        size = s * hq * -(-tables.shape[1] // split) * (d + 2)
    if split != "none":
        # NaN-filled: a partition the reduce reads but the kernel did not write would show
        workspace = to_device(np.full(max(size, 1), np.nan, np.float32))
    out = device_empty(q.shape, np.float32)
    planes = to_device(np.full(pieces * q.size + 7, 0xFFFF, np.uint16)) if pieces else None
    paged_attention_gqa.paged_attention(*devices(q, k_cache, v_cache, tables, lens), scale, out,
                                        workspace=workspace, partition_blocks=partition_blocks,
                                        lanes_per_key=lanes, warps=warps, k_scale=fmt[1], v_scale=fmt[2],
                                        planes=planes, bf16_inputs=pieces == 1)
    want = decode_reference(q, k_cache, v_cache, tables, lens, scale, fmt)
    assert_close(out, want, atol=decode_atol(q, ks, vs, scale, group), rtol=4 * F32_EPS)
    if pieces:
        written = planes.copy_to_host()
        np.testing.assert_array_equal(written[:pieces * q.size],
                                      reference_bf16_planes(out.copy_to_host(), pieces == 1).ravel())
        assert (written[pieces * q.size:] == 0xFFFF).all()


@settings(max_examples=examples(4, 10))
@given(seeds, st.lists(st.integers(1, pick(40, 128)), min_size=1, max_size=pick(2, 8)), st.booleans(), kv_formats)
@example(seed=3, contexts=[1, 17, 40], split=True, fmt=KV_FORMATS[0])
def test_decode_attention_reads_the_newest_key_after_its_writer(seed, contexts, split, fmt):
    """A decode layer's QKV and attention as the engine runs them (one CUDA graph on the GPU, so that under
    PDL the attention kernel's first loads overlap the gemv): gemv.gemv_rope writes each sequence's newest
    key, at position ctx - 1, into a slot that holds NaN until then, and decode attention must use the new
    key. Its loads before the wait skip that key (it is in their first round for these short contexts) and
    fetch it after; a kernel that read it early would return NaN. split: the split kernel, a partition per
    KV block. fmt: the KV format (the gemv writes it, the attention reads it)."""
    hq, hkv, d, k, bs = pick((4, 2, 8, 24, 4), (32, 8, 64, 2048, 16))
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, _, _, _ = make_cache(rng, contexts, bs, hkv, d, "normal", fmt=fmt)
    scales = dict(k_scale=fmt[1], v_scale=fmt[2])
    lens = np.array(contexts, np.int32)
    positions = lens - 1
    slots = (tables[np.arange(len(lens)), positions // bs] * bs + positions % bs).astype(np.int32)
    k_cache[slots // bs, slots % bs] = NANS[fmt[0]]   # the newest keys are the gemv's to write
    v_cache[slots // bs, slots % bs] = NANS[fmt[0]]
    x = rng.standard_normal((len(lens), k), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal(((hq + 2 * hkv) * d, k), dtype=np.float32) / np.float32(np.sqrt(k)))
    cos, sin = rope_tables(d, 256, 500000.0)
    k_dev, v_dev = to_device(k_cache), to_device(v_cache)
    args = devices(x, w, positions, cos, sin)
    tables_dev, lens_dev, slots_dev = devices(tables, lens, slots)
    q, out = device_empty((len(lens), hq, d), np.float32), device_empty((len(lens), hq, d), np.float32)
    workspace = to_device(np.full(len(lens) * hq * tables.shape[1] * (d + 2), np.nan, np.float32)) if split else None
    scale = 1 / np.sqrt(d)
    lanes, warps, _ = attention_policy.decode_config(len(lens), hq, hkv, d, tables.shape[1])

    def layer(stream):
        gemv.gemv_rope(*args, k_dev, v_dev, slots_dev, q, stream, config=matmul_policy.gemv_config(len(lens), *w.shape),
                       **scales)
        if split:
            paged_attention_gqa.paged_attention(q, k_dev, v_dev, tables_dev, lens_dev, scale, out, stream,
                                                lanes_per_key=lanes, warps=warps, partition_blocks=1,
                                                workspace=workspace, **scales)
        else:
            attention_policy.decode_attention(q, k_dev, v_dev, tables_dev, lens_dev, scale, out, stream, **scales)

    stream = cuda.stream()
    layer(stream)   # in the simulator the test; on the GPU it compiles what the capture needs
    if not SIM:
        stream.synchronize()
        k_dev.copy_to_device(k_cache)
        v_dev.copy_to_device(v_cache)
        CUDAGraph(layer, stream).replay()
    stream.synchronize()
    q_got, k_got, v_got = q.copy_to_host(), k_dev.copy_to_host(), v_dev.copy_to_host()
    assert not np.isnan(kv_decode(k_got[slots // bs, slots % bs])).any()   # the gemv wrote the newest keys
    ks, vs = [], []
    for s_, ctx in enumerate(contexts):
        j = np.arange(ctx)
        blocks, offsets = tables[s_, j // bs], j % bs
        ks.append(kv_decode(k_got[blocks, offsets], fmt[1]))
        vs.append(kv_decode(v_got[blocks, offsets], fmt[2]))
    want = decode_reference(q_got, k_got, v_got, tables, lens, scale, fmt)
    assert_close(out, want, atol=decode_atol(q_got, ks, vs, scale, hq // hkv), rtol=4 * F32_EPS)


def test_decode_policy_depends_on_shapes_only():
    """The warps and split policy: from (batch, heads, head_dim, table width) alone."""
    pa = attention_policy
    small, big = pa.SMALL_GRID_WARPS, pa.MAX_WARPS
    # Llama-3.2-1B heads (8 blocks per sequence): more warps while the grid does not fill the SMs, fewer from
    # LARGE_GRID_MIN_BLOCKS blocks
    assert pa.decode_warps_policy(1, 32, 8, 64) == small
    assert pa.decode_warps_policy(pa.SM_COUNT // 8, 32, 8, 64) == small
    assert pa.decode_warps_policy(pa.SM_COUNT // 8 + 1, 32, 8, 64) == big == pa.MID_GRID_WARPS
    assert pa.decode_warps_policy(pa.LARGE_GRID_MIN_BLOCKS // 8 - 1, 32, 8, 64) == pa.MID_GRID_WARPS
    assert pa.decode_warps_policy(pa.LARGE_GRID_MIN_BLOCKS // 8, 32, 8, 64) == pa.LARGE_GRID_WARPS == 2
    # no split while a warp walks at most SPLIT_ROUNDS KV blocks
    assert pa.decode_partitions(1, 32, 8, pa.SPLIT_ROUNDS * small, small) == (1, pa.SPLIT_ROUNDS * small)
    # batch 1, 128-block tables: partitions of PARTITION_ROUNDS blocks per warp
    parts, blocks = pa.decode_partitions(1, 32, 8, 128, small)
    assert blocks == pa.PARTITION_ROUNDS * small and parts == 128 // blocks
    # ... but no more of them than give about TARGET_BLOCKS blocks
    assert pa.decode_partitions(1, 32, 8, 100_000, small)[0] == pa.TARGET_BLOCKS // 8
    # a big batch fills the GPU without splitting
    assert pa.decode_partitions(256, 32, 8, 64, big) == (1, 64)
    # partitions always cover the table, none is empty of blocks
    for s, width, warps in [(3, 70, 2), (64, 256, 4), (5, 1, 8), (1, 0, 8), (2, 1000, 1)]:
        parts, blocks = pa.decode_partitions(s, 32, 8, width, warps)
        assert parts * blocks >= max(width, 1) > (parts - 1) * blocks
    # the workspace covers every batch up to its size, at either lanes_per_key
    size = pa.decode_workspace_size(16, 32, 8, 64, 512)
    for s in range(1, 17):
        for lanes in (4, 8):
            parts, _ = pa.decode_partitions(s, 32, 8, 512, pa.decode_warps_policy(s, 32, 8, 64, lanes))
            assert parts == 1 or s * 32 * parts * 66 <= size


def test_decode_lanes_policy():
    """4 lanes per key only for a grid of at most FOUR_LANES_MAX_BLOCKS blocks whose warps walk long (the measured
    cases of the NOTEs at LONG_WALK_ROUNDS and FOUR_LANES_MAX_BLOCKS), 8 elsewhere; from shapes only."""
    pa = attention_policy
    assert pa.decode_lanes_policy(64, 32, 8, 64, 256) == 4     # batch 64 x 4,096 keys in 16-token blocks
    assert pa.decode_lanes_policy(32, 32, 8, 64, 256) == 4     # two partitions of 128 blocks: 512 blocks
    # the boundary: each warp walks LONG_WALK_ROUNDS blocks (batch 64 x 512 keys on the large grid's 2 warps)
    walk = pa.LONG_WALK_ROUNDS * pa.decode_warps_policy(64, 32, 8, 64, 8)
    assert pa.decode_lanes_policy(64, 32, 8, 64, walk) == 4
    assert pa.decode_lanes_policy(64, 32, 8, 64, walk - 1) == 8
    assert pa.decode_lanes_policy(128, 32, 8, 64, 128) == 4    # 1,024 blocks
    assert pa.decode_lanes_policy(256, 32, 8, 64, 128) == 8    # 2,048 blocks
    assert pa.decode_lanes_policy(256, 32, 8, 64, 32) == 8
    assert pa.decode_lanes_policy(1, 32, 8, 64, 256) == 8      # batch 1: split into short partitions
    assert pa.decode_lanes_policy(64, 32, 8, 128, 256) == 8    # head_dim 128 would spill at 4 lanes


# ---------------------------------------------------------------------------------------------------------
# decode: the first split-K version (paged_attention_split + paged_attention_reduce)


partition_sizes = st.sampled_from(pick([1, 7, 16, 32, 64], [64, 256, 512, 100, 2048]))


@settings(max_examples=examples(8, 40))
@given(seeds, decode_contexts(), heads, head_dims, block_sizes, partition_sizes, st.integers(0, 2), kinds)
@example(seed=1, contexts=[300, 3], hg=(2, 2), d=16, block_size=16, partition_size=160, extra_partitions=1,
         kind="normal")
def test_paged_attention_split_partials_and_output(seed, contexts, hg, d, block_size, partition_size,
                                                   extra_partitions, kind):
    if SIM:  # the simulator pays per block: at most six partitions per (sequence, head)
        partition_size = max(partition_size, -(-max(contexts) // 6))
    q, k_cache, v_cache, tables, lens, ks, vs = decode_case(seed, contexts, hg, d, block_size, kind)
    hkv, group = hg
    scale = 1 / np.sqrt(d)
    # A workspace sized for a longer maximum context than this batch has: trailing partitions are empty.
    shapes = paged_attention.split_workspace_shapes(len(contexts), hkv * group, d,
                                                    max(contexts) + extra_partitions * partition_size,
                                                    partition_size)
    partial_out, partial_max, partial_sum = (device_empty(shape, np.float32) for shape in shapes)
    out = device_empty(q.shape, np.float32)
    paged_attention.paged_attention_split(*devices(q, k_cache, v_cache, tables, lens), scale, out,
                                          partial_out, partial_max, partial_sum, partition_size)
    atol = decode_atol(q, ks, vs, scale, group)
    assert_close(out, ref.paged_attention(q, k_cache, v_cache, tables, lens, scale), atol=atol, rtol=4 * F32_EPS)

    want_out, want_max, want_sum = ref.paged_attention_partitioned(q, k_cache, v_cache, tables, lens, scale,
                                                                   partition_size)
    got_out, got_max, got_sum = (a.copy_to_host() for a in (partial_out, partial_max, partial_sum))
    p = want_max.shape[2]
    # Partitions past a context, including the workspace's extra ones, are exactly neutral.
    neutral = np.zeros(got_max.shape, bool)
    neutral[:, :, :p] = ~np.isfinite(want_max)
    neutral[:, :, p:] = True
    assert np.all(got_max[neutral] == -np.inf) and np.all(got_sum[neutral] == 0)
    assert np.all(got_out[neutral] == 0)
    live = ~neutral[:, :, :p]
    # The others: the same max (a score, so a score's tolerance), the same sum and normalised acc.
    smax_tol = atol / max(float(np.abs(np.concatenate([v.ravel() for v in vs])).max()), 1e-30)
    np.testing.assert_allclose(got_max[:, :, :p][live], want_max[live], atol=smax_tol, rtol=0)
    np.testing.assert_allclose(got_sum[:, :, :p][live], want_sum[live], rtol=smax_tol + 4 * F32_EPS)
    with np.errstate(invalid="ignore", divide="ignore"):   # 0 / 0 in the neutral partitions, masked out
        got_normalised = got_out[:, :, :p] / got_sum[:, :, :p, None]
        want_normalised = want_out / want_sum[..., None]
    np.testing.assert_allclose(got_normalised[live], want_normalised[live], atol=atol, rtol=4 * F32_EPS)


@settings(max_examples=examples(6, 40))
@given(seeds, decode_contexts(), heads, head_dims, partition_sizes, kinds)
def test_paged_attention_reduce_merges_reference_partials(seed, contexts, hg, d, partition_size, kind):
    rng = np.random.default_rng(seed)
    hkv, group = hg
    k_cache, v_cache, tables, ks, vs, direction = make_cache(rng, contexts, 16, hkv, d, kind)
    q = make_queries(rng, len(contexts), hkv, group, d, kind, direction)
    lens = np.array(contexts, np.int32)
    scale = 1 / np.sqrt(d)
    partials = ref.paged_attention_partitioned(q, k_cache, v_cache, tables, lens, scale, partition_size)
    out = device_empty(q.shape, np.float32)
    paged_attention.paged_attention_reduce(*devices(*partials, lens), partition_size, out)
    want = ref.paged_attention_reduce(*partials, lens, partition_size)
    assert_close(out, want, atol=decode_atol(q, ks, vs, scale, group), rtol=4 * F32_EPS)


@settings(max_examples=examples(40, 100))
@given(seeds, st.lists(st.integers(1, 200), min_size=1, max_size=4), heads, st.sampled_from([8, 16]),
       st.sampled_from([1, 3, 16]), st.integers(1, 80), kinds)
def test_reference_split_k_equals_paged_attention(seed, contexts, hg, d, block_size, partition_size, kind):
    """The NumPy twins of the split-K kernels, against the math reference (NumPy only, no kernel)."""
    q, k_cache, v_cache, tables, lens, ks, vs = decode_case(seed, contexts, hg, d, block_size, kind)
    group = hg[1]
    partials = ref.paged_attention_partitioned(q, k_cache, v_cache, tables, lens, 0.3, partition_size)
    assert partials[0].shape[2] == -(-max(contexts) // partition_size)
    got = ref.paged_attention_reduce(*partials, lens, partition_size)
    want = ref.paged_attention(q, k_cache, v_cache, tables, lens, 0.3)
    np.testing.assert_allclose(got, want, atol=decode_atol(q, ks, vs, 0.3, group), rtol=4 * F32_EPS)


def test_decode_padding_slots_give_zeros():
    """context_len 0 (a padding slot of a fixed-size batch, block table all -1) writes 0, reads nothing."""
    rng = np.random.default_rng(0)
    k_cache, v_cache, tables, ks, vs, _ = make_cache(rng, [5, 1], 4, 1, 8, "normal")
    tables = np.concatenate([tables, np.full((1, tables.shape[1]), -1, np.int32)])
    lens = np.array([5, 1, 0], np.int32)
    q = rng.standard_normal((3, 2, 8), dtype=np.float32)
    want = ref.paged_attention(q[:2], k_cache, v_cache, tables[:2], lens[:2], 0.5)
    shapes = paged_attention.split_workspace_shapes(3, 2, 8, 5, 4)
    work = [device_empty(shape, np.float32) for shape in shapes]
    fast_work = device_empty(3 * 2 * 2 * (8 + 2), np.float32)
    launchers = [
        lambda *args: paged_attention.paged_attention_walk(*args),
        lambda *args: paged_attention.paged_attention_v1(*args),
        lambda *args: paged_attention.paged_attention_split(*args, *work, 4),
        lambda *args: attention_policy.decode_attention(*args),
        lambda *args: paged_attention_gqa.paged_attention(*args, **FAST_CONFIG, partition_blocks=1,
                                                          workspace=fast_work),
    ]
    for launcher in launchers:
        out = to_device(np.full(q.shape, np.nan, np.float32))
        launcher(*devices(q, k_cache, v_cache, tables, lens), 0.5, out)
        got = out.copy_to_host()
        assert np.all(got[2] == 0)
        assert_close(got[:2], want, atol=decode_atol(q[:2], ks, vs, 0.5, 2), rtol=4 * F32_EPS)
    assert np.all(work[1].copy_to_host()[2] == -np.inf)


def test_split_workspace_shapes():
    assert paged_attention.split_workspace_shapes(3, 32, 64, 8192, 512) == ((3, 32, 16, 64), (3, 32, 16),
                                                                            (3, 32, 16))
    assert paged_attention.split_workspace_shapes(1, 8, 64, 513, 512)[1] == (1, 8, 2)
    assert paged_attention.split_workspace_shapes(1, 8, 64, 0, 512)[1] == (1, 8, 1)


# ---------------------------------------------------------------------------------------------------------
# prefill


def run_prefill(launcher, rng, chunks, hkv, group, d, block_size, kind, fmt=("bf16", 1.0, 1.0)):
    q_lens = [n for n, _ in chunks]
    contexts = [n + cached for n, cached in chunks]
    k_cache, v_cache, tables, ks, vs, direction = make_cache(rng, [max(c, 1) for c in contexts], block_size,
                                                             hkv, d, kind, fmt=fmt)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = make_queries(rng, int(cu[-1]), hkv, group, d, kind, direction)
    lens = np.array(contexts, np.int32)
    scale = 1 / np.sqrt(d)
    out = device_empty(q.shape, np.float32)
    launcher(*devices(q, k_cache, v_cache, tables, cu, lens), scale, out, max(q_lens), k_scale=fmt[1],
             v_scale=fmt[2])
    want = ref.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, *fmt[1:])
    atol = attention_atol([q[cu[s]:cu[s + 1]] for s in range(len(chunks))], ks, vs, scale, group)
    assert_close(out, want, atol=atol, rtol=4 * F32_EPS)


@settings(max_examples=examples(10, 60))
@given(seeds, prefill_chunks(), heads, head_dims, block_sizes, kinds, kv_formats)
@example(seed=1, chunks=[(9, 60), (3, 0)], hg=(2, 2), d=16, block_size=3, kind="normal", fmt=KV_FORMATS[0])
@example(seed=2, chunks=[(5, 30)], hg=(1, 3), d=24, block_size=3, kind="normal", fmt=KV_FORMATS[2])
@example(seed=3, chunks=[(4, 33), (2, 0)], hg=(1, 2), d=8, block_size=16, kind="normal", fmt=KV_FORMATS[4])
def test_prefill_attention_matches_reference(seed, chunks, hg, d, block_size, kind, fmt):
    run_prefill(prefill_flash, np.random.default_rng(seed), chunks, *hg, d, block_size, kind, fmt)


@settings(max_examples=examples(5, 30))
@given(seeds, prefill_chunks(), heads, head_dims, block_sizes, kinds, kv_formats)
def test_prefill_attention_naive_matches_reference(seed, chunks, hg, d, block_size, kind, fmt):
    if SIM:  # one simulated block per (query token, head): keep the batch small
        chunks = [(min(n, 6), cached) for n, cached in chunks]
        if not any(n for n, _ in chunks):
            chunks[0] = (1, chunks[0][1])
    run_prefill(attention.prefill_attention_naive, np.random.default_rng(seed), chunks, *hg, d, block_size,
                kind, fmt)


# The tensor-core kernel needs head_dim in attention_tc.TC_HEAD_DIMS (multiples of 16). In the simulator its
# 16-key tiles (2 warps, 32 rows per block) make the contexts of prefill_chunks walk up to four tiles and two row
# tiles.
tc_head_dims = st.sampled_from(pick([16, 32], [64, 64, 128, 16, 32]))


@pytest.mark.parametrize("launcher", [prefill_tc, prefill_tc_pipelined])
@settings(max_examples=examples(6, 60))
@given(seeds, prefill_chunks(), heads, tc_head_dims, block_sizes, kinds, st.sampled_from([None, 32]),
       st.sampled_from([f for f in KV_FORMATS if f[0] in attention_tc.TC_FORMATS]))
@example(seed=1, chunks=[(9, 37), (3, 0)], hg=(2, 2), d=16, block_size=3, kind="normal", keys=None,
         fmt=KV_FORMATS[0])
@example(seed=2, chunks=[(5, 20)], hg=(1, 3), d=16, block_size=3, kind="normal", keys=None, fmt=KV_FORMATS[4])
def test_prefill_attention_tc_matches_reference(launcher, seed, chunks, hg, d, block_size, kind, keys, fmt):
    """Both tensor-core kernels (attention_tc, and the pipelined one, whose two stages alternate from the second
    tile on). keys: keys per K/V tile (None: the policy's); 128-dim heads keep their own (attention_tc's
    accumulators spill registers at 32 keys; at 64 its tiles pass 48 KB of shared memory). fp8 caches are
    staged as bf16 (exact); fp32 ones are refused (test_kv_formats_the_simple_kernels_refuse)."""
    keys = None if d > 64 else keys
    run_prefill(partial(launcher, keys_per_tile=keys), np.random.default_rng(seed), chunks, *hg, d, block_size,
                kind, fmt)


@pytest.mark.parametrize("launcher", [prefill_tc, prefill_tc_pipelined])
@pytest.mark.parametrize("chunks", pick([[(5, 0)], [(3, 3), (4, 0)], [(2, 9)]],
                                        [[(1024, 0)], [(256, 0)] * 4, [(512, 512)]]))
def test_prefill_attention_tc_benchmark_shapes(launcher, chunks):
    """The benchmark's layouts (one 1,024-token prompt, 4 x 256, a 512 chunk after a 512 cached prefix) at the
    model's shapes (32 / 8 heads, head_dim 64) on the GPU; the same layouts shrunk in the simulator."""
    hkv, group, d = pick((1, 4, 16), (8, 4, 64))
    run_prefill(launcher, np.random.default_rng(0), chunks, hkv, group, d, 16, "normal")


@pytest.mark.skipif(not SIM, reason="a GPU device function cannot be called from the host; kernels use it there")
def test_transpose_bf16x4():
    """The 4 x 4 transpose of 16-bit elements that stages V for the tensor-core kernel."""
    m = np.random.default_rng(0).integers(0, 2**16, (4, 4), dtype=np.uint64).astype(np.uint16)
    rows = m.view(np.uint64).ravel()                      # rows[i] holds m[i, 0..3], element 0 lowest
    columns = attention_tc.transpose_bf16x4(*rows)
    assert np.array(columns, np.uint64).view(np.uint16).reshape(4, 4).tolist() == m.T.tolist()


@pytest.mark.parametrize("launcher", [prefill_flash, prefill_tc, prefill_tc_pipelined,
                                      attention_policy.prefill_attention])
def test_prefill_one_query_per_sequence_equals_decode(launcher):
    """q_len 1 at the end of each context is exactly a decode step."""
    rng = np.random.default_rng(1)
    contexts = [1, 33, 17]
    k_cache, v_cache, tables, ks, vs, _ = make_cache(rng, contexts, 16, 1, 16, "normal")
    q = rng.standard_normal((3, 4, 16), dtype=np.float32)
    lens = np.array(contexts, np.int32)
    out = device_empty(q.shape, np.float32)
    launcher(*devices(q, k_cache, v_cache, tables, np.arange(4, dtype=np.int32), lens), 0.25, out, 1)
    want = ref.paged_attention(q, k_cache, v_cache, tables, lens, 0.25)
    assert_close(out, want, atol=decode_atol(q, ks, vs, 0.25, 4), rtol=4 * F32_EPS)


def test_naive_prefill_flags_contexts_it_cannot_hold():
    """Past NAIVE_MAX_CONTEXT keys the naive kernel writes NaN instead of a wrong answer (it reads nothing)."""
    k_cache = allocate_kv_cache(1, 4, 1, 8)
    tables = np.zeros((1, 1), np.int32)
    q = np.ones((2, 1, 8), np.float32)
    out = device_empty(q.shape, np.float32)
    lens = np.array([attention.NAIVE_MAX_CONTEXT + 1], np.int32)
    attention.prefill_attention_naive(*devices(q, k_cache, k_cache, tables, np.array([0, 1], np.int32), lens),
                                      1.0, out, 1)
    assert np.all(np.isnan(out.copy_to_host()[0]))


@pytest.mark.skipif(not SIM, reason="a GPU device function cannot be called from the host; kernels use it there")
def test_bf16x4_unpacking_device_version():
    """The GPU's unpacking of 4 bf16 per uint64 (the simulator uses a NumPy one in the kernels)."""
    values = np.array([1.5, -2.25, 3e38, -0.0, np.nan, 7.0, 1e-38, -65504.0], np.float32)
    words = f32_to_bf16(values).view(np.uint64)
    for i, word in enumerate(words):
        want = round_to_bf16(values[4 * i: 4 * i + 4])
        for fn in (kv_format.unpack_bf16x4_device, kv_format.unpack_bf16x4):
            got = np.array(fn(word), np.float32)
            assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


# ---------------------------------------------------------------------------------------------------------
# launcher errors


def _decode_args(**changes):
    args = dict(q=np.zeros((2, 4, 16), np.float32), k_cache=np.zeros((3, 4, 2, 16), np.uint16),
                v_cache=np.zeros((3, 4, 2, 16), np.uint16), block_tables=np.zeros((2, 2), np.int32),
                context_lens=np.ones(2, np.int32), scale=0.25, out=np.zeros((2, 4, 16), np.float32))
    args.update(changes)
    return {k: (to_device(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}


@pytest.mark.parametrize("changes, message", [
    (dict(q=np.zeros((2, 4, 16), np.float64)), "q: expected"),
    (dict(q=np.zeros((2, 4), np.float32)), "q: expected"),
    (dict(q=np.zeros((2, 4, 12), np.float32), out=np.zeros((2, 4, 12), np.float32)), "multiple of 8"),
    (dict(q=np.zeros((2, 4, 136), np.float32), out=np.zeros((2, 4, 136), np.float32)), "multiple of 8"),
    (dict(k_cache=np.zeros((3, 4, 2, 16), np.float16)), "k_cache"),
    (dict(k_cache=np.zeros((3, 4, 2, 16), np.float32)), "v_cache: expected .* float32"),
    (dict(k_cache=np.zeros((3, 4, 2, 8), np.uint16)), "k_cache"),
    (dict(v_cache=np.zeros((3, 4, 1, 16), np.uint16)), "v_cache"),
    (dict(k_cache=np.zeros((3, 4, 3, 16), np.uint16), v_cache=np.zeros((3, 4, 3, 16), np.uint16)),
     "not a multiple of num_kv_heads"),
    (dict(block_tables=np.zeros((2, 2), np.int64)), "block_tables"),
    (dict(block_tables=np.zeros((3, 2), np.int32)), "block_tables"),
    (dict(context_lens=np.ones(2, np.int64)), "context_lens"),
    (dict(context_lens=np.ones(3, np.int32), block_tables=np.zeros((3, 2), np.int32)), "context_lens"),
    (dict(out=np.zeros((2, 4, 8), np.float32)), "out: expected"),
])
def test_decode_launcher_errors(changes, message):
    for launcher in (partial(paged_attention_gqa.paged_attention, **FAST_CONFIG), paged_attention.paged_attention_v1,
                     paged_attention.paged_attention_walk):
        with pytest.raises(ValueError, match=message):
            launcher(**_decode_args(**changes))


@pytest.mark.parametrize("options, message", [
    (dict(lanes_per_key=3), "lanes_per_key"),
    (dict(warps=0), "warps must be 1 to"),
    (dict(warps=1000), "warps must be 1 to"),
    (dict(partition_blocks=0), "partition_blocks"),
    (dict(partition_blocks=1.5), "partition_blocks"),
    (dict(partition_blocks=1), "need a workspace"),        # 2 partitions of the 2-block table
    (dict(partition_blocks=1, workspace=np.zeros(2 * 4 * 2 * 18 - 1, np.float32)), "workspace: expected"),
    (dict(partition_blocks=1, workspace=np.zeros(2 * 4 * 2 * 18, np.float64)), "workspace: expected"),
    # out's planes: 2 x 4 x 16 = 128 elements, one plane with bf16 inputs, three without
    (dict(planes=np.zeros(127, np.uint16), bf16_inputs=True), "planes: expected a 1-D uint16 workspace of at least 128"),
    (dict(planes=np.zeros(128, np.uint16)), "at least 384 elements .3 bf16 planes of 128."),
    (dict(planes=np.zeros(128, np.float32), bf16_inputs=True), "planes: expected"),
])
def test_fast_decode_launcher_errors(options, message):
    options = {k: (to_device(v) if isinstance(v, np.ndarray) else v) for k, v in options.items()}
    with pytest.raises(ValueError, match=message):
        paged_attention_gqa.paged_attention(**_decode_args(), **{**FAST_CONFIG, **options})


def test_non_contiguous_cache_is_refused():
    cache = to_device(np.zeros((3, 4, 2, 32), np.uint16))[:, :, :, :16]
    with pytest.raises(ValueError, match="C-contiguous"):
        paged_attention_gqa.paged_attention(**_decode_args(k_cache=cache, v_cache=cache), **FAST_CONFIG)


@pytest.mark.parametrize("shapes, partition_size, message", [
    (((2, 4, 2, 16), (2, 4, 2), (2, 4, 2)), 0, "partition_size"),
    (((2, 4, 2, 16), (2, 4, 2), (2, 4, 2)), 2.5, "partition_size"),
    (((2, 4, 2, 8), (2, 4, 2), (2, 4, 2)), 4, "partial_out"),
    (((2, 3, 2, 16), (2, 3, 2), (2, 3, 2)), 4, "partial_out"),
    (((2, 4, 2, 16), (2, 4, 3), (2, 4, 2)), 4, "partial_max"),
    (((2, 4, 2, 16), (2, 4, 2), (2, 4)), 4, "partial_sum"),
])
def test_split_launcher_errors(shapes, partition_size, message):
    work = [device_empty(shape, np.float32) for shape in shapes]
    with pytest.raises(ValueError, match=message):
        paged_attention.paged_attention_split(**_decode_args(), partial_out=work[0], partial_max=work[1],
                                              partial_sum=work[2], partition_size=partition_size)
    if message in ("partition_size", "partial_max", "partial_sum"):
        with pytest.raises(ValueError, match=message):
            paged_attention.paged_attention_reduce(*work, to_device(np.ones(2, np.int32)), partition_size,
                                                   device_empty((2, 4, 16), np.float32))


@pytest.mark.parametrize("launcher", [prefill_flash, attention.prefill_attention_naive, prefill_tc,
                                      prefill_tc_pipelined, attention_policy.prefill_attention])
@pytest.mark.parametrize("changes, message", [
    (dict(cu_seqlens_q=np.zeros(2, np.int32)), "cu_seqlens_q"),
    (dict(cu_seqlens_q=np.zeros(3, np.int64)), "cu_seqlens_q"),
    (dict(out=np.zeros((5, 4, 16), np.float64)), "out: expected"),
    (dict(max_q_len=-1), "max_q_len"),
    (dict(max_q_len=2.5), "max_q_len"),
    (dict(q=np.zeros((5, 4, 20), np.float32), out=np.zeros((5, 4, 20), np.float32)), "multiple of 8"),
])
def test_prefill_launcher_errors(launcher, changes, message):
    with pytest.raises(ValueError, match=message):
        launcher(**_prefill_args(**changes))


@pytest.mark.parametrize("d, warps, keys, message", [(24, 2, 16, "head_dim must be one of"),
                                                     (8, 2, 16, "head_dim must be one of"),
                                                     (16, 2, 24, "keys_per_tile must be a multiple of 16"),
                                                     (16, 2, 0, "keys_per_tile must be a multiple of 16"),
                                                     (16, 0, 16, "warps must be at least 1")])
@pytest.mark.parametrize("launcher", [attention_tc.prefill_attention_tc,
                                      attention_tc_pipelined.prefill_attention_tc_pipelined])
def test_prefill_tc_launcher_errors(launcher, d, warps, keys, message):
    """What the tensor-core kernels refuse that prefill_attention takes (callers fall back on the ValueError),
    and configurations they cannot run."""
    changes = dict(q=np.zeros((5, 4, d), np.float32), out=np.zeros((5, 4, d), np.float32),
                   k_cache=np.zeros((3, 4, 2, d), np.uint16), v_cache=np.zeros((3, 4, 2, d), np.uint16))
    with pytest.raises(ValueError, match=message):
        launcher(**_prefill_args(**changes), warps=warps, keys_per_tile=keys)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan")])
@pytest.mark.parametrize("launcher", [attention_tc.prefill_attention_tc,
                                      attention_tc_pipelined.prefill_attention_tc_pipelined])
def test_prefill_tc_launchers_refuse_a_scale_that_is_not_positive(launcher, scale):
    """The tensor-core kernels take the max of unscaled scores (online_softmax_step), right for a positive
    scale only."""
    args = _prefill_args(q=np.zeros((5, 4, 16), np.float32), out=np.zeros((5, 4, 16), np.float32),
                         k_cache=np.zeros((3, 4, 2, 16), np.uint16), v_cache=np.zeros((3, 4, 2, 16), np.uint16))
    with pytest.raises(ValueError, match="scale .* must be positive"):
        launcher(**{**args, "scale": scale}, warps=1, keys_per_tile=16)


@pytest.mark.parametrize("warps, rows, message", [(0, 16, "rows must be a positive multiple of warps"),
                                                  (4, 2, "rows must be a positive multiple of warps"),
                                                  (4, 18, "rows must be a positive multiple of warps"),
                                                  (4, 512, "more than 49152")])
def test_prefill_flash_launcher_errors(warps, rows, message):
    """Configurations the SIMT flash kernel cannot run: rows that the warps do not share evenly, a block past
    the static shared memory."""
    with pytest.raises(ValueError, match=message):
        attention.prefill_attention(**_prefill_args(), warps=warps, rows=rows)


def test_prefill_flash_config():
    """The most rows of PREFILL_FLASH_ROWS whose block fits the static shared memory, for every head_dim the
    kernel takes; the launcher accepts every pick."""
    budget, candidates = attention.SHARED_BUDGET, attention_policy.PREFILL_FLASH_ROWS
    for d in range(8, 129, 8):
        warps, rows = attention_policy.prefill_flash_config(d)
        assert warps == attention_policy.PREFILL_FLASH_WARPS and rows in candidates and rows % warps == 0
        assert attention.flash_shared_bytes(d, rows) <= budget
        assert all(attention.flash_shared_bytes(d, r) > budget for r in candidates if r > rows)
    if not SIM:
        assert [attention_policy.prefill_flash_config(d)[1] for d in (64, 128)] == [64, 16]


def test_prefill_takes_the_pipelined_kernel_only_where_a_gpu_verified_it(monkeypatch):
    """bf16 caches at head_dim up to 64 (PIPELINED_FORMATS, PIPELINED_MAX_HEAD_DIM); fp8, head_dim 128 and
    PREFILL_PIPELINED off keep attention_tc. The entry point calls the kernel the policy names."""
    assert attention_policy.uses_prefill_pipelined(64, "bf16") and attention_policy.uses_prefill_pipelined(16, "bf16")
    assert not attention_policy.uses_prefill_pipelined(128, "bf16")
    assert not attention_policy.uses_prefill_pipelined(64, "fp8")
    monkeypatch.setattr(attention_policy, "PREFILL_PIPELINED", False)
    assert not attention_policy.uses_prefill_pipelined(64, "bf16")
    monkeypatch.setattr(attention_policy, "PREFILL_PIPELINED", True)
    called = []
    monkeypatch.setattr(attention_policy, "uses_prefill_tc", lambda d, fmt: True)
    for name, module in (("prefill_attention_tc", attention_tc),
                         ("prefill_attention_tc_pipelined", attention_tc_pipelined)):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: called.append((name, k["warps"],
                                                                                    k["keys_per_tile"])))
    for d, fmt in ((64, "bf16"), (64, "fp8"), (128, "bf16")):
        args = _prefill_args(q=np.zeros((5, 4, d), np.float32), out=np.zeros((5, 4, d), np.float32),
                             k_cache=np.zeros((3, 4, 2, d), kv_format.DTYPES[fmt]),
                             v_cache=np.zeros((3, 4, 2, d), kv_format.DTYPES[fmt]))
        attention_policy.prefill_attention(**args)
    assert called == [("prefill_attention_tc_pipelined", *attention_policy.prefill_pipelined_config(64)),
                      ("prefill_attention_tc", *attention_policy.prefill_tc_config(64)),
                      ("prefill_attention_tc", *attention_policy.prefill_tc_config(128))]


def test_kv_formats_the_simple_kernels_refuse():
    """v1 and split read bf16 only, the tensor-core prefill bf16 and fp8; the scales are fp8's alone. Each says
    so, naming the kernels that take the format."""
    for fmt in ("fp32", "fp8"):
        caches = dict(k_cache=np.zeros((3, 4, 2, 16), kv_format.DTYPES[fmt]),
                      v_cache=np.zeros((3, 4, 2, 16), kv_format.DTYPES[fmt]))
        with pytest.raises(ValueError, match="reads bf16 caches only.*take every format"):
            paged_attention.paged_attention_v1(**_decode_args(**caches))
        work = [device_empty(shape, np.float32) for shape in ((2, 4, 2, 16), (2, 4, 2), (2, 4, 2))]
        with pytest.raises(ValueError, match="reads bf16 caches only"):
            paged_attention.paged_attention_split(**_decode_args(**caches), partial_out=work[0],
                                                  partial_max=work[1], partial_sum=work[2], partition_size=4)
    with pytest.raises(ValueError, match="prefill_attention_tc reads bf16 and fp8 caches, got fp32"):
        prefill_tc(**_prefill_args(k_cache=np.zeros((3, 4, 2, 16), np.float32),
                                   v_cache=np.zeros((3, 4, 2, 16), np.float32)))
    with pytest.raises(ValueError, match="prefill_attention_tc_pipelined reads bf16 and fp8 caches, got fp32"):
        prefill_tc_pipelined(**_prefill_args(k_cache=np.zeros((3, 4, 2, 16), np.float32),
                                             v_cache=np.zeros((3, 4, 2, 16), np.float32)))
    fp32 = dict(k_cache=np.zeros((3, 4, 2, 16), np.float32), v_cache=np.zeros((3, 4, 2, 16), np.float32))
    with pytest.raises(ValueError, match="warps must be 1 to 8 "):   # the fp32 kernels' register bound
        paged_attention_gqa.paged_attention(**_decode_args(**fp32), lanes_per_key=8, warps=9)
    with pytest.raises(ValueError, match="a bf16 cache takes 1.0"):
        paged_attention_gqa.paged_attention(**_decode_args(), **FAST_CONFIG, k_scale=0.5)
    with pytest.raises(ValueError, match="positive and finite"):
        prefill_flash(**_prefill_args(k_cache=np.zeros((3, 4, 2, 16), np.uint8),
                                      v_cache=np.zeros((3, 4, 2, 16), np.uint8)), v_scale=-1.0)


def _prefill_args(**changes):
    args = dict(q=np.zeros((5, 4, 16), np.float32), k_cache=np.zeros((3, 4, 2, 16), np.uint16),
                v_cache=np.zeros((3, 4, 2, 16), np.uint16), block_tables=np.zeros((2, 2), np.int32),
                cu_seqlens_q=np.array([0, 2, 5], np.int32), context_lens=np.array([3, 4], np.int32),
                scale=0.25, out=np.zeros((5, 4, 16), np.float32), max_q_len=3)
    args.update(changes)
    return {k: (to_device(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
