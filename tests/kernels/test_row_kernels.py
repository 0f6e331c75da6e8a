"""Embedding, row gather, RMSNorm (plain and fused with the residual add), RoPE + KV-cache write and
SiLU-and-mul kernels against their NumPy twins in reference/."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, LLAMA3, assert_close, device_empty, examples, pick, random_bf16, sizes, to_device

from cuda_kernels import activation, embedding, rmsnorm, rope
from reference import activation as ref_activation
from reference import embedding as ref_embedding
from reference import rmsnorm as ref_rmsnorm
from reference.matmul import bf16_planes as reference_bf16_planes
from reference import rope as ref_rope
from reference.bf16 import f32_to_bf16
from reference.kv_cache import allocate_kv_cache
from reference.kv_format import kv_decode

seeds = st.integers(0, 2**32 - 1)
hidden = sizes(70, [2048, 576], 3000)
tokens = sizes(5, [1, 7, 64, 256], 300)
# embedding and gather_rows: also a row wider than the simulator's 256 threads (a second pass over the columns)
row_widths = st.one_of(hidden, st.just(pick(300, 2048)))


@given(seeds, tokens, row_widths, st.sampled_from(pick([1, 7, 50], [1, 49152, 128256])))
def test_embedding(seed, t, h, vocab):
    rng = np.random.default_rng(seed)
    table, d_table = random_bf16((vocab, h))
    ids = rng.integers(0, vocab, t).astype(np.int32)
    out = device_empty((t, h), np.float32)
    embedding.embedding(to_device(ids), d_table, out)
    assert_close(out, ref_embedding.embedding(ids, table), atol=0, rtol=0)


@given(seeds, tokens, sizes(9, [1, 64, 256]), row_widths)
def test_gather_rows(seed, s, t, h):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h), dtype=np.float32)
    idx = rng.integers(0, t, s).astype(np.int32)
    out = device_empty((s, h), np.float32)
    embedding.gather_rows(to_device(x), to_device(idx), out)
    assert_close(out, ref_embedding.gather_rows(x, idx), atol=0, rtol=0)


@given(seeds, sizes(70, [1, 256, 1000]), st.integers(1, 300))
def test_chain_tokens(seed, t, n):
    """Entries with a source take that sampled id, the others keep theirs (src -1, as padding and prefill
    rows have); on the GPU profile also over several blocks of threads."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, t).astype(np.int32)
    sampled = rng.integers(0, 128256, n).astype(np.int32)
    src = np.where(rng.random(t) < 0.7, rng.integers(0, n, t), -1).astype(np.int32)
    d_ids = to_device(ids)
    embedding.chain_tokens(d_ids, to_device(sampled), to_device(src))
    want = ref_embedding.chain_tokens(ids, sampled, src)
    np.testing.assert_array_equal(d_ids.copy_to_host(), want)
    assert np.array_equal(want[src < 0], ids[src < 0]) and np.array_equal(want[src >= 0], sampled[src[src >= 0]])


def norm_tolerance(h):
    # the mean square is a sum of h fp32 terms in another order; its relative error, halved by the square
    # root, is the output's relative error (plus a few ulps for the multiplies)
    return 4 * F32_EPS * np.sqrt(h) + 8 * F32_EPS


@given(seeds, tokens, hidden, st.sampled_from([1e-5, 1e-6]), st.sampled_from([1.0, 1e3, 1e-3]))
def test_rmsnorm(seed, t, h, eps, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, h)) * scale).astype(np.float32)
    w = f32_to_bf16(rng.standard_normal(h, dtype=np.float32))
    out = device_empty((t, h), np.float32)
    rmsnorm.rmsnorm(to_device(x), to_device(w), eps, out)
    want = ref_rmsnorm.rmsnorm(x, w, eps)
    assert_close(out, want, atol=1e-30, rtol=norm_tolerance(h))


@given(seeds, tokens, hidden)
def test_fused_add_rmsnorm_updates_residual_in_place(seed, t, h):
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((2, t, h), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal(h, dtype=np.float32))
    d_res, out = to_device(r), device_empty((t, h), np.float32)
    rmsnorm.fused_add_rmsnorm(to_device(x), d_res, to_device(w), 1e-5, out)
    want_out, want_res = ref_rmsnorm.fused_add_rmsnorm(x, r, w, 1e-5)
    assert_close(d_res, want_res, atol=0, rtol=0)
    assert_close(out, want_out, atol=1e-30, rtol=norm_tolerance(h))


@given(seeds, tokens, hidden, st.booleans(), st.booleans())
def test_rmsnorm_writes_the_planes_of_its_output(seed, t, h, fused, bf16_inputs):
    """v2: the normed rows as the next GEMM's bf16 planes, exactly reference.matmul.bf16_planes of the
    kernel's own float32 output; the output itself as v1's; the workspace past the planes untouched."""
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((2, t, h), dtype=np.float32)
    w = f32_to_bf16(rng.standard_normal(h, dtype=np.float32))
    p = 1 if bf16_inputs else 3
    planes = to_device(np.full(p * t * h + 5, 0xBEEF, np.uint16))
    out = device_empty((t, h), np.float32)
    if fused:
        rmsnorm.fused_add_rmsnorm(to_device(x), to_device(r), to_device(w), 1e-5, out, planes=planes,
                                  bf16_inputs=bf16_inputs)
        want = ref_rmsnorm.fused_add_rmsnorm(x, r, w, 1e-5)[0]
    else:
        rmsnorm.rmsnorm(to_device(x), to_device(w), 1e-5, out, planes=planes, bf16_inputs=bf16_inputs)
        want = ref_rmsnorm.rmsnorm(x, w, 1e-5)
    got = out.copy_to_host()
    assert_close(got, want, atol=1e-30, rtol=norm_tolerance(h))
    written = planes.copy_to_host()
    np.testing.assert_array_equal(written[:p * t * h], reference_bf16_planes(got, bf16_inputs).ravel())
    assert (written[p * t * h:] == 0xBEEF).all()
    with pytest.raises(ValueError, match="planes: expected a 1-D uint16 workspace of at least"):
        rmsnorm.rmsnorm(to_device(x), to_device(w), 1e-5, out, planes=planes[:p * t * h - 1],
                        bf16_inputs=bf16_inputs)


def test_rmsnorm_rows_are_independent():
    x = np.ones((3, 40), np.float32)
    x[1, 7] = np.nan
    w = f32_to_bf16(np.ones(40, np.float32))
    out = device_empty((3, 40), np.float32)
    rmsnorm.rmsnorm(to_device(x), to_device(w), 1e-5, out)
    got = out.copy_to_host()
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


# (Hq, Hkv, d); (4, 4, 40): more rotation pairs and V entries than the simulator's 128 threads (a second pass)
head_shapes = st.sampled_from(pick([(2, 1, 8), (3, 1, 4), (4, 1, 16), (2, 2, 8), (4, 4, 40)],
                                   [(32, 8, 64), (9, 3, 64), (24, 8, 128), (4, 4, 64)]))


# (KV format, k_scale, v_scale) of the caches rope_kv_write fills: bf16 twice (the default), fp32, fp8 scaled
KV_FORMATS = [("bf16", 1.0, 1.0), ("bf16", 1.0, 1.0), ("fp32", 1.0, 1.0), ("fp8", 1.0, 1.0), ("fp8", 0.04, 5.0)]
# one step of each format at a value (relative) and below fp8's normals (absolute, times the scale)
ROUNDING_STEP = {"bf16": (2 ** -7, 0.0), "fp32": (0.0, 0.0), "fp8": (2 ** -3, 2 ** -9)}


@settings(max_examples=examples(12, 40))
@given(seeds, tokens, head_shapes, st.sampled_from([4, 16, 32]), st.booleans(), st.sampled_from(KV_FORMATS))
def test_rope_kv_write(seed, t, heads, block_size, scaled, fmt):
    fmt, k_scale, v_scale = fmt
    hq, hkv, d = heads
    rng = np.random.default_rng(seed)
    max_pos = pick(200, 9000)
    cos, sin = ref_rope.rope_tables(d, max_pos, 500000.0, LLAMA3 if scaled else None)
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d), dtype=np.float32)
    positions = rng.integers(0, max_pos, t).astype(np.int32)
    num_blocks = -(-t // block_size) + 2
    slots = rng.permutation(num_blocks * block_size)[:t].astype(np.int32)
    if t > 1:
        slots[rng.integers(0, t)] = -1  # a padding token writes nothing
    cache = allocate_kv_cache(num_blocks, block_size, hkv, d, fmt)
    k_ref, v_ref = cache.copy(), cache.copy()
    q_ref = ref_rope.rope_kv_write(qkv, positions, cos, sin, k_ref, v_ref, slots, hq, k_scale, v_scale)
    k_dev, v_dev = to_device(cache), to_device(cache)
    q_out = device_empty((t, hq, d), np.float32)
    rope.rope_kv_write(to_device(qkv), to_device(positions), to_device(cos), to_device(sin), k_dev, v_dev,
                       to_device(slots), q_out, k_scale=k_scale, v_scale=v_scale)
    # two products and a sum per output: a few ulps of the inputs' magnitude
    assert_close(q_out, q_ref, atol=8 * F32_EPS * np.abs(qkv).max(), rtol=0)
    k_got, v_got = k_dev.copy_to_host(), v_dev.copy_to_host()
    assert np.array_equal(v_got.view(np.uint8), v_ref.view(np.uint8))  # V is only stored: bit-identical
    # K: identical where the fp32 rotation agrees. A different FMA contraction moves the fp32 value by the
    # tolerance of q above, and the rounding of the moved value to the format by at most one of its steps.
    # NOTE: the absolute part matters where x1 c and x2 s cancel: there a few fp32 ulps of the inputs are many
    # ulps of the result. Unused slots stay the format's NaN (the NaN masks are equal).
    kg, kr = kv_decode(k_got, k_scale), kv_decode(k_ref, k_scale)
    assert np.array_equal(np.isnan(kg), np.isnan(kr))
    finite = ~np.isnan(kr)
    rel, sub = ROUNDING_STEP[fmt]
    np.testing.assert_allclose(kg[finite], kr[finite], rtol=rel,
                               atol=8 * F32_EPS * np.abs(qkv).max() + sub * k_scale)


def test_rope_kv_write_rejects_mismatched_shapes():
    qkv = to_device(np.zeros((2, 5 * 8), np.float32))
    cache = to_device(allocate_kv_cache(2, 4, 1, 8))
    cos = to_device(np.zeros((10, 4), np.float32))
    ids = to_device(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"qkv: expected \(2, 48\) float32 for Hq=4, Hkv=1, d=8"):
        rope.rope_kv_write(qkv, ids, cos, cos, cache, cache, ids, device_empty((2, 4, 8), np.float32))


@given(seeds, tokens, sizes(50, [8192, 1536], 9000), st.sampled_from([1.0, 30.0]))
def test_silu_and_mul(seed, t, f, spread):
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((t, 2 * f)) * spread).astype(np.float32)
    out = device_empty((t, f), np.float32)
    activation.silu_and_mul(to_device(gate_up), out)
    assert_close(out, ref_activation.silu_and_mul(gate_up), atol=1e-30, rtol=8 * F32_EPS)


def test_launchers_reject_wrong_dtypes():
    with pytest.raises(ValueError, match="table: expected"):
        embedding.embedding(to_device(np.zeros(2, np.int32)), to_device(np.zeros((4, 4), np.float32)),
                            device_empty((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"weight: expected \(8,\) uint16"):
        rmsnorm.rmsnorm(to_device(np.zeros((2, 8), np.float32)), to_device(np.zeros(8, np.float32)), 1e-5,
                        device_empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="gate_up: expected"):
        activation.silu_and_mul(to_device(np.zeros((2, 7), np.float32)), device_empty((2, 3), np.float32))
