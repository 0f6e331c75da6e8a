"""The matmul family against reference/matmul.py: cuda_kernels/gemm_simt.py (naive, gemm), gemv.py (gemv_warp,
gemv and its epilogues (gemv_epilogues.py), the staged gemv), gemm_tc.py, gemm_pipelined.py, the dispatch of
matmul.py and the policies of matmul_policy.py; and the primitives of cuda_kernels/mma.py and
cuda_kernels/async_copy.py on their own.

Every version is checked the same way: random x and bf16 W of hypothesis-chosen shapes and magnitudes, the
output compared elementwise with a tolerance derived from the numerics (fp32 sums in another order than
NumPy's), NaN confined to the row (of x) or column (of W) it came from, and the launchers' argument checks.
With bf16_inputs the expected result is the reference on x rounded to bf16 (reference.bf16.round_to_bf16):
the products stay exact, so the same tolerance applies. gemm_tc's tile policy is checked as a pure function.
Simulator shapes are tiny; on the GPU profile the Llama-3.2-1B projection shapes are used.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, LLAMA3, SIM, device_empty, dot_tolerance, examples, pick, sizes, to_device
from numba import cuda
from tests_support import LLAMA_1B_MATMULS

from cuda_kernels import async_copy
from cuda_kernels import gemm_pipelined as gp
from cuda_kernels import gemm_simt as simt
from cuda_kernels import gemm_tc as tc
from cuda_kernels import gemv as gv
from cuda_kernels import matmul as mm
from cuda_kernels import matmul_policy as mp
from cuda_kernels import mma
from cuda_kernels.launch import OPT_IN_SHARED_LIMIT, STATIC_SHARED_LIMIT
from cuda_kernels.primitives import WARP
from reference.bf16 import bf16_to_f32, f32_to_bf16, round_to_bf16
from reference.kv_cache import allocate_kv_cache
from reference.kv_format import kv_decode
from reference.matmul import bf16_planes as reference_bf16_planes
from reference.matmul import matmul as reference_matmul
from reference.matmul import matmul_rope_kv_write as reference_matmul_rope_kv_write
from reference.matmul import mlp as reference_mlp
from reference.rope import rope_tables
from reference.tolerance import gated_bound, rope_bounds


# Llama-3.2-1B weights as (N, K): QKV fused, O, gate/up fused, down, LM head.
LLAMA_1B_WEIGHTS = [(n, k) for n, k, _ in LLAMA_1B_MATMULS]

seeds = st.integers(0, 2**32 - 1)
# |x| and |W| scales: typical activations and weights, tiny ones, and large ones (products up to ~1e26,
# sums of 8192 of them still far below the fp32 maximum).
x_scales = st.sampled_from([1.0, 1e-3, 1e6, 3e15])
w_scales = st.sampled_from([0.02, 1.0, 1e10])


def weight_shapes(sim_n: int, sim_k: int):
    """(N, K): 1..sim_n x 1..sim_k in the simulator; on the GPU the 1B shapes or odd ones."""
    if SIM:
        return st.tuples(st.integers(1, sim_n), st.integers(1, sim_k))
    return st.one_of(st.sampled_from(LLAMA_1B_WEIGHTS), st.tuples(st.integers(1, 5000), st.integers(1, 3000)))


def cap_m(m: int, n: int, k: int) -> int:
    # NOTE: on the GPU profile the NumPy reference is the slow part (an LM head at M = 1024 is 270 GFLOP on
    # the CPU); larger M for big weights stay covered by the smaller weights.
    return m if SIM else max(1, min(m, 2**34 // (n * k)))


def make_inputs(seed, m, n, k, x_scale=1.0, w_scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k), dtype=np.float32) * np.float32(x_scale)).astype(np.float32)
    w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(w_scale))
    return x, w


def check(out, x, w, bf16_inputs=False):
    """out == x @ W^T to within the fp32 summation error (elementwise, NaN where the reference has NaN);
    with bf16_inputs, x is rounded to bf16 first."""
    if bf16_inputs:
        x = round_to_bf16(x)
    want = reference_matmul(x, w)
    # absolute sum of each dot's terms: the scale of its rounding error (fp32 is plenty for a tolerance)
    magnitude = np.abs(x) @ np.abs(bf16_to_f32(w)).T
    magnitude = np.where(np.isfinite(magnitude), magnitude, 0)
    # NOTE: atol covers the summation order; rtol only the final rounding of the result (2 ulps)
    atol = dot_tolerance(x.shape[1], magnitude)
    got = out.copy_to_host() if hasattr(out, "copy_to_host") else np.asarray(out)
    assert got.shape == want.shape
    # elementwise |got - want| <= atol + rtol * |want| (assert_close's form, with a per-element atol)
    err = np.abs(got.astype(np.float64) - want)
    bound = atol + 2 * F32_EPS * np.abs(want.astype(np.float64))
    both_nan = np.isnan(got) & np.isnan(want)
    bad = ~((err <= bound) | both_nan)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)), got.shape)
        raise AssertionError(f"{bad.sum()} of {bad.size} outputs off; worst at {i}: got {got[i]!r}, want "
                             f"{want[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}")


def stale_out(m, n):
    # NOTE: filled with a finite sentinel rather than left uninitialised: an output the kernel forgets to
    # write fails the comparison for certain, even where the reference is NaN.
    return to_device(np.full((m, n), -7777.0, np.float32))


def run(launcher, x, w, **kwargs):
    out = stale_out(x.shape[0], w.shape[0])
    launcher(to_device(x), to_device(w), out, **kwargs)
    return out


# ---------------------------------------------------------------------------------------------------------
# each version against the reference
# ---------------------------------------------------------------------------------------------------------

@settings(max_examples=examples(8, 10))
@given(seeds, sizes(9, [1, 2, 7]), weight_shapes(40, 80), x_scales, w_scales, st.booleans())
def test_matmul_naive(seed, m, nk, x_scale, w_scale, bf16_inputs):
    n, k = nk
    if not SIM:
        n, k = min(n, 4096), min(k, 2048)  # a teaching kernel: keep it to a few ms
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(simt.matmul_naive, x, w, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


@settings(max_examples=examples(6, 10))
@given(seeds, sizes(4, [1, 2, 8]), weight_shapes(13, 80), x_scales, w_scales, st.booleans())
@example(seed=0, m=2, nk=(6, 70), x_scale=1.0, w_scale=1.0, bf16_inputs=False)  # always: a warp past the last row
def test_gemv_warp(seed, m, nk, x_scale, w_scale, bf16_inputs):
    """The plain warp-per-row GEMV: N not a multiple of a block's 4 rows (warps past the last row compute a
    clamped row and store nothing), K not a multiple of 32 (lanes with one term fewer), several rows of x."""
    n, k = nk
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(gv.gemv_warp, x, w, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


POLICY = "policy"   # in a list of configurations: matmul_policy.gemv_config's pick for the shape
GEMV_CONFIGS = [POLICY, gv.GemvConfig(), gv.GemvConfig(warps_per_block=3, rows_per_warp=1)]
# Loads in flight and K split: (warps, rows per warp, unroll, k_split); a pass of the block covers
# 32 * unroll * k_split words (4 bf16 each) of a row.
# The simulator takes configurations whose passes are short (256-512 columns: the same code paths), pipelined
# or not; the GPU every policy configuration too.
GEMV_PASS_CONFIGS = [gv.GemvConfig(2, 1, 2, 1), gv.GemvConfig(2, 2, 1, 2), gv.GemvConfig(4, 1, 2, 2),
                     gv.GemvConfig(2, 1, 2, 1, True), gv.GemvConfig(2, 2, 1, 2, True)]
if not SIM:
    GEMV_PASS_CONFIGS += [gv.GemvConfig(8, 1, 4, 4), mp.GEMV_WIDE, mp.GEMV_SPLIT, mp.GEMV_SPLIT_SMALL, mp.GEMV_LONG_K,
                          mp.GEMV_LONG_K_M, mp.GEMV_WIDE_M, mp.GEMV_SPLIT_M]


@pytest.mark.parametrize("path", ["u64", "u64-view-given", "scalar"])
@settings(max_examples=examples(4, 15))
@given(seeds, sizes(9, [1, 2, 3, 7, 8], 16), weight_shapes(20, 64), x_scales, w_scales,
       st.sampled_from(GEMV_CONFIGS), st.booleans())
def test_gemv(path, seed, m, nk, x_scale, w_scale, config, bf16_inputs):
    """Any M (chunks of up to 8 rows), odd N (partial blocks); 64-bit loads when K % 4 == 0 (the launcher
    views W as uint64, or the caller passes the view), the scalar path for other K; both input precisions."""
    n, k = nk
    k = 4 * max(1, k // 4) if path != "scalar" else (k if k % 4 else k + 1)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    out = stale_out(m, n)
    w_dev = to_device(w)
    config = mp.gemv_config(m, n, k) if config == POLICY else config
    gv.gemv(to_device(x), w_dev.view(np.uint64) if path == "u64-view-given" else w_dev, out, config=config,
            bf16_inputs=bf16_inputs)
    check(out, x, w, bf16_inputs)


@pytest.mark.parametrize("m, n, k, want", [
    (1, 3072, 2048, mp.GEMV_SPLIT), (1, 2048, 2048, mp.GEMV_SPLIT_SMALL), (1, 2048, 8192, mp.GEMV_LONG_K),
    (1, 128256, 2048, mp.GEMV_WIDE),
    (2, 2048, 8192, mp.GEMV_LONG_K_M), (4, 2048, 8192, mp.GEMV_SPLIT_M), (8, 16384, 2048, mp.GEMV_WIDE_M),
])
def test_gemv_config_policy(m, n, k, want):
    assert mp.gemv_config(m, n, k) == want


# NOTE: the configurations are parameters, not drawn by hypothesis: drawn, a given one went untested in about a
# quarter of the runs (6 examples over 5 configurations), so a bug in one code path could pass CI.
@pytest.mark.parametrize("config", GEMV_PASS_CONFIGS)
@settings(max_examples=examples(2, 4))
@given(seeds, st.integers(0, 2), st.integers(0, 40), st.integers(0, 3), st.sampled_from([1, 2, 5, 8]),
       st.integers(1, 9), st.booleans())
@example(seed=0, passes=2, words=3, tail=1, m=2, n=5, bf16_inputs=False)  # always: a pipelined config's 2nd pass
def test_gemv_passes(config, seed, passes, words, tail, m, n, bf16_inputs):
    """Unrolled loads and the K split: K = whole passes of the block + leftover words (fewer than a pass,
    spread over the K-split warps one word at a time) + a scalar tail of K % 4 columns (the uint16 path,
    as the launcher sees no uint64 view then), with N not a multiple of the block's rows."""
    step = 4 * WARP * config.unroll * config.k_split   # columns of one pass
    k = max(1, passes * step + 4 * min(words, step // 4 - 1) + tail)
    x, w = make_inputs(seed, m, n, k)
    out = stale_out(m, n)
    gv.gemv(to_device(x), to_device(w), out, config=config, bf16_inputs=bf16_inputs)
    check(out, x, w, bf16_inputs)


def check_gated(out, x, w, bf16_inputs=False):
    """out == silu(x @ gate^T) * (x @ up^T), W = [gate; up], within gated_bound."""
    want, bound = gated_bound(x, w, bf16_inputs)
    got = out.copy_to_host()
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want)
    bad = ~((err <= bound) | (np.isnan(got) & np.isnan(want)))
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)), got.shape)
        raise AssertionError(f"{bad.sum()} of {bad.size} outputs off; worst at {i}: got {got[i]!r}, want "
                             f"{want[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}")


# gated gemv configurations: the policy's (for the weight's 2F rows) and hand-picked ones, K split or not
GATED_CONFIGS = [POLICY, gv.GemvConfig(2, 2, 1, 1), gv.GemvConfig(2, 2, 1, 2), gv.GemvConfig(1, 4, 2, 1),
                 gv.GemvConfig(2, 2, 1, 2, True)]
if not SIM:
    GATED_CONFIGS += [mp.GEMV_WIDE, mp.GEMV_WIDE_M, mp.GEMV_SPLIT, mp.GEMV_SPLIT_M]
# (F, K): the gate/up of the 1B model (F = 8192) on the GPU, or odd sizes; tiny ones in the simulator
gated_shapes = (st.tuples(st.integers(1, 9), st.integers(1, 300)) if SIM else
                st.one_of(st.just((8192, 2048)), st.tuples(st.integers(1, 3000), st.integers(1, 3000))))


@pytest.mark.parametrize("config", GATED_CONFIGS)
@settings(max_examples=examples(3, 4))
@given(seeds, st.sampled_from([1, 2, 3, 5, 8]), gated_shapes, x_scales, st.booleans())
def test_gemv_gated(config, seed, m, fk, x_scale, bf16_inputs):
    """The SiLU*mul epilogue: F not a multiple of a block's features, K with and without a uint64 view and a
    scalar tail, M over several chunks of 8 rows; |x| up to 3e15, where silu saturates (g) or flushes (-0)."""
    f, k = fk
    x, w = make_inputs(seed, m, 2 * f, k, x_scale)
    out = stale_out(m, f)
    config = mp.gemv_config(m, 2 * f, k) if config == POLICY else config
    gv.gemv(to_device(x), to_device(w), out, config=config, bf16_inputs=bf16_inputs, gated=True)
    check_gated(out, x, w, bf16_inputs)


@settings(max_examples=examples(4, 8))
@given(seeds, st.sampled_from(pick([1, 3, 20], [1, 4, 5, 64, 200])), st.booleans(), st.booleans())
def test_gated_matmul_dispatch(seed, m, bf16_inputs, with_workspace):
    """The engine's entry point: the gated gemv at decode sizes; above, gemm_pipelined's gated epilogue when
    given a planes workspace (on the GPU from 64 rows of the 1B gate/up), else matmul + silu_and_mul."""
    f, k = pick((6, 40), (8192, 2048))
    x, w = make_inputs(seed, m, 2 * f, k)
    out, scratch = stale_out(m, f), device_empty((m, 2 * f), np.float32)
    workspace = device_empty(gp.workspace_size(m, k, bf16_inputs), np.uint16) if with_workspace else None
    mm.gated_matmul(to_device(x), to_device(w), out, scratch, bf16_inputs=bf16_inputs, workspace=workspace)
    check_gated(out, x, w, bf16_inputs)


def test_gemv_gated_checks():
    x, w = device_empty((1, 8), np.float32), device_empty((6, 8), np.uint16)
    with pytest.raises(ValueError, match=r"out \(M, N/2\) = \(1, 3\)"):
        gv.gemv(x, w, device_empty((1, 6), np.float32), gated=True)
    with pytest.raises(ValueError, match="even rows_per_warp"):
        gv.gemv(x, w, device_empty((1, 3), np.float32), config=gv.GemvConfig(2, 1, 1, 1), gated=True)


# (KV format, k_scale, v_scale) of the caches the QKV epilogue writes: bf16 twice (the default), fp32, fp8 scaled
ROPE_FORMATS = [("bf16", 1.0, 1.0), ("bf16", 1.0, 1.0), ("fp32", 1.0, 1.0), ("fp8", 0.3, 2.0)]
rope_formats = st.sampled_from(ROPE_FORMATS)
# how far a stored value may move when the fp32 value before its rounding moves a little: one step of the format
# (relative), and fp8's subnormal step (absolute, times the scale)
ROUNDING_STEP = {"bf16": (2 ** -7, 0.0), "fp32": (0.0, 0.0), "fp8": (2 ** -3, 2 ** -9)}


def rope_case(seed, m, heads, k, block_size, fmt=ROPE_FORMATS[0]):
    """x, the fused QKV weight, the RoPE tables (llama3-scaled), positions, slots (one -1 when m > 1) and
    NaN-poisoned caches in format fmt[0] for `m` tokens of `heads` = (Hq, Hkv, d)."""
    hq, hkv, d = heads
    rng = np.random.default_rng(seed)
    x, w = make_inputs(seed, m, (hq + 2 * hkv) * d, k)
    max_pos = pick(64, 9000)
    cos, sin = rope_tables(d, max_pos, 500000.0, LLAMA3)
    positions = rng.integers(0, max_pos, m).astype(np.int32)
    num_blocks = -(-m // block_size) + 1
    slots = rng.permutation(num_blocks * block_size)[:m].astype(np.int32)
    if m > 1:
        slots[rng.integers(0, m)] = -1  # a padding token writes nothing
    return x, w, cos, sin, positions, slots, allocate_kv_cache(num_blocks, block_size, hkv, d, fmt[0])


def check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, num_heads, bf16_inputs,
               fmt=ROPE_FORMATS[0]):
    """q_out and the caches == reference.matmul.matmul_rope_kv_write. Each dot product carries its summation
    error (dot_tolerance); a rotated value a c - b s adds those of its pair (|c|, |s| <= 1) and a few ulps of
    |a| + |b|; K and V add the rounding of the moved value to the cache's format (one step: bf16 2^-7 relative,
    fp32 none, fp8 2^-3 relative or its subnormal step). Slots not written keep their NaN bit for bit."""
    fmt, k_scale, v_scale = fmt
    k_ref, v_ref = cache.copy(), cache.copy()
    q_ref = reference_matmul_rope_kv_write(x, w, positions, cos, sin, k_ref, v_ref, slots, num_heads, bf16_inputs,
                                           k_scale, v_scale)
    tol, bound = rope_bounds(x, w, cache.shape[3], bf16_inputs)   # (M, Hq + 2 Hkv, d) each
    hkv = cache.shape[2]
    got_q = q_out.copy_to_host()
    assert np.all(np.abs(got_q - q_ref) <= bound[:, :num_heads]), "q"
    rel, sub = ROUNDING_STEP[fmt]
    for name, got, want, part, scale in (
            ("K", k_dev.copy_to_host(), k_ref, slice(num_heads, num_heads + hkv), k_scale),
            ("V", v_dev.copy_to_host(), v_ref, slice(num_heads + hkv, None), v_scale)):
        written = slots >= 0
        blocks, offsets = slots[written] // cache.shape[1], slots[written] % cache.shape[1]
        g, r = kv_decode(got[blocks, offsets], scale), kv_decode(want[blocks, offsets], scale)
        if name == "V":  # V is not rotated: its own dot's tolerance
            b = tol[written][:, part]
        else:
            b = bound[written][:, part]
        err = np.abs(g.astype(np.float64) - r)
        assert np.all(err <= b + rel * np.abs(r) + sub * scale), f"{name}: worst {err.max():.3g}"
        untouched = np.ones(cache.shape[:2], bool)
        untouched[blocks, offsets] = False
        assert np.array_equal(got[untouched].view(np.uint8), cache[untouched].view(np.uint8)), \
            f"{name}: a slot not in slot_mapping was written"


rope_heads = st.sampled_from(pick([(2, 1, 8), (3, 1, 4), (2, 2, 8)], [(32, 8, 64), (9, 3, 64), (24, 8, 128), (4, 4, 64)]))
# the policy's QKV configurations and hand-picked ones, K split or not (rows_per_warp even: pairs)
ROPE_CONFIGS = [POLICY, gv.GemvConfig(2, 2, 1, 1), gv.GemvConfig(2, 2, 1, 2), gv.GemvConfig(1, 4, 2, 1),
                 gv.GemvConfig(2, 2, 1, 2, True)]
if not SIM:
    ROPE_CONFIGS += [mp.GEMV_SPLIT, mp.GEMV_SPLIT_SMALL, mp.GEMV_SPLIT_M, gv.GemvConfig(8, 4, 2, 4)]


@pytest.mark.parametrize("config", ROPE_CONFIGS)
@settings(max_examples=examples(3, 4))
@given(seeds, st.sampled_from([1, 2, 3, 8]), rope_heads, st.sampled_from(pick([4, 20, 70], [2048, 1000, 8192])),
       st.sampled_from([4, 16]), st.booleans(), rope_formats)
def test_gemv_rope(config, seed, m, heads, k, block_size, bf16_inputs, fmt):
    """The QKV gemv with rope_kv_write as its epilogue: every head's pairs (i, i + d/2) rotated, q written,
    K and V in their slots in the cache's format (a padding token's slot -1 writes nothing), K with and
    without a uint64 view."""
    x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, k, block_size, fmt)
    q_out = to_device(np.full((m, heads[0], heads[2]), -7777.0, np.float32))
    k_dev, v_dev = to_device(cache), to_device(cache)
    config = mp.gemv_config(m, w.shape[0], k) if config == POLICY else config
    gv.gemv_rope(to_device(x), to_device(w), to_device(positions), to_device(cos), to_device(sin), k_dev, v_dev,
                 to_device(slots), q_out, config=config, bf16_inputs=bf16_inputs, k_scale=fmt[1], v_scale=fmt[2])
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], bf16_inputs, fmt)


@settings(max_examples=examples(3, 6))
@given(seeds, st.sampled_from(pick([1, 20], [1, 8, 64])), st.booleans(), rope_formats)
def test_matmul_rope_kv_write_dispatch(seed, m, bf16_inputs, fmt):
    """The engine's entry point: gemv_rope at decode sizes, matmul + rope.rope_kv_write above."""
    heads, k = pick(((2, 1, 8), 24), ((32, 8, 64), 2048))
    x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, k, 16, fmt)
    q_out, scratch = device_empty((m, heads[0], heads[2]), np.float32), device_empty((64, w.shape[0]), np.float32)
    k_dev, v_dev = to_device(cache), to_device(cache)
    mm.matmul_rope_kv_write(to_device(x), to_device(w), to_device(positions), to_device(cos), to_device(sin),
                            k_dev, v_dev, to_device(slots), q_out, scratch, bf16_inputs=bf16_inputs,
                            k_scale=fmt[1], v_scale=fmt[2])
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], bf16_inputs, fmt)


def test_gemv_rope_checks():
    x, cache = device_empty((2, 8), np.float32), device_empty((2, 4, 1, 8), np.uint16)
    ids, cos = device_empty(2, np.int32), device_empty((10, 4), np.float32)
    q_out = device_empty((2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"q_out and the caches need \(2, 32\) for Hq=2, Hkv=1, d=8"):
        gv.gemv_rope(x, device_empty((24, 8), np.uint16), ids, cos, cos, cache, cache, ids, q_out)
    with pytest.raises(ValueError, match="even rows_per_warp"):
        gv.gemv_rope(x, device_empty((32, 8), np.uint16), ids, cos, cos, cache, cache, ids, q_out,
                     config=gv.GemvConfig(2, 1, 1, 1))
    with pytest.raises(ValueError, match=r"slot_mapping: expected \(2,\) integer"):
        gv.gemv_rope(x, device_empty((32, 8), np.uint16), ids, cos, cos, cache, cache, device_empty(3, np.int32),
                     q_out)


# The staged gemv (whole weight rows copied into shared memory before the PDL wait): plain rows, then the gated
# and RoPE epilogues. Odd rows per block and K / 4 not a multiple of the threads (the guarded last word) in the
# simulator, with K large enough in some examples that every warp holds words (else a lost warp sum would pass);
# the configurations worth timing on the 1B shapes on the GPU.
STAGED_CONFIGS = [gv.GemvStaged(2, 1), gv.GemvStaged(3, 2), gv.GemvStaged(4, 2)]
if not SIM:
    STAGED_CONFIGS += [gv.GemvStaged(8, 4), gv.GemvStaged(4, 4), gv.GemvStaged(8, 2), gv.GemvStaged(16, 4),
                       gv.GemvStaged(2, 8), gv.GemvStaged(8, 16), gv.GemvStaged(8, 8), gv.GemvStaged(16, 8)]
STAGED_PAIRED_CONFIGS = [c for c in STAGED_CONFIGS if c.rows_per_block % 2 == 0]


def staged_k(config, k, m):
    """k cut down to the largest multiple of 8 whose tile fits a block's shared memory at m rows of x."""
    while gv.gemv_staged_shared_bytes(config, m, k) > OPT_IN_SHARED_LIMIT:
        k -= 8
    return k


staged_shapes = (st.tuples(st.integers(1, 9), st.integers(1, 40).map(lambda c: 8 * c)) if SIM else
                 st.one_of(st.sampled_from(LLAMA_1B_WEIGHTS[:4]),
                           st.tuples(st.integers(1, 3000), st.integers(1, 1000).map(lambda c: 8 * c))))


@pytest.mark.parametrize("config", STAGED_CONFIGS)
@settings(max_examples=examples(3, 6))
@given(seeds, st.sampled_from([1, 2, 3, 8, 9]), staged_shapes, x_scales, w_scales, st.booleans(), st.booleans())
@example(seed=0, m=2, nk=(5, 320), x_scale=1.0, w_scale=1.0, bf16_inputs=False, u64_view=True)  # every warp has words
def test_gemv_staged(config, seed, m, nk, x_scale, w_scale, bf16_inputs, u64_view):
    """Plain rows: N not a multiple of the block's rows, M over several chunks of 8, both input precisions,
    W as uint16 or as the caller's uint64 view."""
    n, k = nk
    k = staged_k(config, k, m)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    out, w_dev = stale_out(m, n), to_device(w)
    gv.gemv(to_device(x), w_dev.view(np.uint64) if u64_view else w_dev, out, config=config, bf16_inputs=bf16_inputs)
    check(out, x, w, bf16_inputs)


@pytest.mark.parametrize("config", STAGED_PAIRED_CONFIGS)
@settings(max_examples=examples(2, 4))
@given(seeds, st.sampled_from([1, 3, 8]), st.sampled_from(pick([(5, 16), (3, 264)], [(8192, 2048), (1000, 512)])),
       st.booleans())
@example(seed=0, m=3, fk=pick((3, 264), (8192, 2048)), bf16_inputs=False)  # always: several rows, every warp busy
def test_gemv_staged_gated(config, seed, m, fk, bf16_inputs):
    """The SiLU*mul epilogue on the staged gemv: a block's gate rows and their up rows staged together."""
    f, k = fk
    x, w = make_inputs(seed, m, 2 * f, staged_k(config, k, m))
    out = stale_out(m, f)
    gv.gemv(to_device(x), to_device(w), out, config=config, bf16_inputs=bf16_inputs, gated=True)
    check_gated(out, x, w, bf16_inputs)


@pytest.mark.parametrize("config", STAGED_PAIRED_CONFIGS)
@settings(max_examples=examples(2, 4))
@given(seeds, st.sampled_from([1, 2, 8]), rope_heads, st.sampled_from(pick([8, 136], [2048, 1024])),
       st.sampled_from([4, 16]), st.booleans(), rope_formats)
@example(seed=0, m=8, heads=pick((2, 1, 8), (32, 8, 64)), k=pick(136, 2048), block_size=4, bf16_inputs=False,
         fmt=ROPE_FORMATS[0])
def test_gemv_staged_rope(config, seed, m, heads, k, block_size, bf16_inputs, fmt):
    """The RoPE + KV-write epilogue on the staged gemv, whose position, cos, sin and slot are read before the
    PDL wait: rotated q, K and V in their slots in the cache's format, a padding token's slot untouched."""
    x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, staged_k(config, k, m), block_size, fmt)
    q_out = to_device(np.full((m, heads[0], heads[2]), -7777.0, np.float32))
    k_dev, v_dev = to_device(cache), to_device(cache)
    gv.gemv_rope(to_device(x), to_device(w), to_device(positions), to_device(cos), to_device(sin), k_dev, v_dev,
                 to_device(slots), q_out, config=config, bf16_inputs=bf16_inputs, k_scale=fmt[1], v_scale=fmt[2])
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], bf16_inputs, fmt)


def test_gemv_staged_checks():
    x, out = device_empty((1, 12), np.float32), device_empty((1, 4), np.float32)
    with pytest.raises(ValueError, match=r"K % 8 == 0 .* got K = 12"):
        gv.gemv(x, device_empty((4, 12), np.uint16), out, config=gv.GemvStaged(2, 1))
    x = device_empty((1, 8192), np.float32)
    with pytest.raises(ValueError, match="15 rows of K = 8192 need 245820 bytes of shared memory"):
        gv.gemv(x, device_empty((4, 8192), np.uint16), out, config=gv.GemvStaged(15, 1))
    with pytest.raises(ValueError, match="C-contiguous x and weight"):
        gv.gemv(device_empty((2, 16), np.float32)[:, :8], device_empty((4, 8), np.uint16),
                device_empty((2, 4), np.float32), config=gv.GemvStaged(2, 1))
    with pytest.raises(ValueError, match="even for a gated gemv"):
        gv.gemv(device_empty((1, 8), np.float32), device_empty((4, 8), np.uint16), device_empty((1, 2), np.float32),
                config=gv.GemvStaged(3, 1), gated=True)


def test_gemv_config_checks():
    x, w, out = device_empty((1, 8), np.float32), device_empty((4, 8), np.uint16), device_empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="multiple of k_split"):
        gv.gemv(x, w, out, config=gv.GemvConfig(3, 1, 1, 2))


@settings(max_examples=examples(6, 15))
@given(seeds, sizes(9, [16, 64, 256, 1024], 1100), weight_shapes(70, 40), x_scales, w_scales, st.booleans())
def test_gemm(seed, m, nk, x_scale, w_scale, bf16_inputs):
    """The engine's tile (matmul_policy.GEMM_TILE: 64 x 64 on the GPU, 16 x 16 in the simulator): partial tiles and
    K slabs."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(simt.gemm, x, w, tile=mp.GEMM_TILE, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


# Small tiles (64 threads) put many tiles and every kind of edge into shapes the simulator can afford.
SMALL_TILES = [simt.GemmTile(16, 16, 8, 2, 2), simt.GemmTile(32, 16, 8, 4, 2)]


@settings(max_examples=examples(8, 10))
@given(seeds, sizes(40, [16, 64, 256], 700), weight_shapes(40, 40), x_scales, w_scales,
       st.sampled_from(SMALL_TILES), st.booleans())
def test_gemm_small_tiles(seed, m, nk, x_scale, w_scale, tile, bf16_inputs):
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(simt.gemm, x, w, tile=tile, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


@settings(max_examples=examples(5, 10))
@given(seeds)
def test_mma_fragment_layout(seed):
    """One warp, one 16 x 8 x 16 mma through the PTX fragment layout. Small integers keep every product and
    partial sum exact, so D must equal A @ B + C bit for bit: a lane holding the wrong element cannot hide."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (16, 16)).astype(np.float32)
    b = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    c = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    d = device_empty((16, 8), np.float32)
    mma.mma_tile(to_device(f32_to_bf16(a)), to_device(f32_to_bf16(b.T)), to_device(c), d)
    np.testing.assert_array_equal(d.copy_to_host(), a @ b + c)


@settings(max_examples=examples(5, 10))
@given(seeds, x_scales, w_scales)
def test_mma_fragment_random_values(seed, x_scale, w_scale):
    """The same product of random bf16 values: exact products, fp32 sums (the tensor core's own order)."""
    rng = np.random.default_rng(seed)
    a = f32_to_bf16(rng.standard_normal((16, 16), dtype=np.float32) * np.float32(x_scale))
    w = f32_to_bf16(rng.standard_normal((8, 16), dtype=np.float32) * np.float32(w_scale))
    c = np.zeros((16, 8), np.float32)
    d = device_empty((16, 8), np.float32)
    mma.mma_tile(to_device(a), to_device(w), to_device(c), d)
    check(d, bf16_to_f32(a), w)


# Every tile the policy can pick (and two-stage variants) on the GPU. The simulator affords only a few
# hundred thread-mma per slab, so it runs the cheapest real skinny tiles and small tiles that take the same
# code paths as the others: several warps along M and N, MI = NJ = 2 mma tiles per warp, 2 and 4 K groups,
# two k-steps per group, two stages.
GPU_TC_TILES = [mp.GEMM_TC_TILE, mp.GEMM_TC_SMALL_TILE, *[t for ts in mp.GEMM_TC_SKINNY_TILES.values() for t in ts],
                mp.GEMM_TC_SKINNY_DEEP_TILE, mp.GEMM_TC_SMALL_TILE._replace(stages=2),
                tc.GemmTcTile(16, 16, 128, 16, 8, 4, 2)]
SIM_TC_TILES = [tc.SIM_TILE, tc.GemmTcTile(32, 16, 32, 16, 8), tc.GemmTcTile(32, 16, 16, 32, 16),
                tc.GemmTcTile(32, 16, 64, 32, 16, 4), tc.GemmTcTile(16, 16, 64, 16, 16, 2, 2),
                mp.GEMM_TC_SKINNY_TILES[16][-1], mp.GEMM_TC_SKINNY_DEEP_TILE]
TC_TILES = SIM_TC_TILES if SIM else GPU_TC_TILES


@settings(max_examples=examples(6, 20))
@given(seeds, sizes(20, [16, 64, 256, 1024], 1100), weight_shapes(24, 40), x_scales, w_scales, st.booleans())
def test_gemm_tc(seed, m, nk, x_scale, w_scale, bf16_inputs):
    """The policy's tile on the GPU (matmul_policy.gemm_tc_tile), gemm_tc.SIM_TILE in the simulator. K % 4 != 0
    takes the bf16-at-a-time weight loads; K not a multiple of 16 zero-pads the last slab; partial tiles."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    tile = tc.SIM_TILE if SIM else mp.gemm_tc_tile(m, n, k, bf16_inputs)
    check(run(tc.gemm_tc, x, w, tile=tile, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


@pytest.mark.parametrize("tile", TC_TILES, ids=lambda t: "x".join(map(str, t)))
@settings(max_examples=examples(2, 8))
@given(seeds, sizes(40, [16, 64, 256, 1024], 700), weight_shapes(36, 150), st.booleans())
def test_gemm_tc_tiles(tile, seed, m, nk, bf16_inputs):
    """Each tile, both precisions: partial tiles along M and N, K past one slab or short of it."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    check(run(tc.gemm_tc, x, w, tile=tile, bf16_inputs=bf16_inputs), x, w, bf16_inputs)


def test_gemm_tc_refuses_strided_operands():
    """gemm_tc indexes x and W as flat arrays: a column window of a wider buffer is refused by name, not read
    with the wrong row stride."""
    x, w = make_inputs(3, 5, 12, 40)
    wide_x = to_device(np.concatenate([x, np.zeros((5, 8), np.float32)], axis=1))
    wide_w = to_device(np.concatenate([w, np.zeros((12, 8), np.uint16)], axis=1))
    out = stale_out(5, 12)
    with pytest.raises(ValueError, match=r"gemm_tc: x must be C-contiguous, got shape \(5, 40\) with strides"):
        tc.gemm_tc(wide_x[:, :40], to_device(w), out)
    with pytest.raises(ValueError, match=r"gemm_tc: weight must be C-contiguous, got shape \(12, 40\)"):
        tc.gemm_tc(to_device(x), wide_w[:, :40], out)


@pytest.mark.parametrize("launcher", [simt.matmul_naive, gv.gemv_warp, simt.gemm, tc.gemm_tc],
                         ids=lambda f: f.__name__)
def test_bf16_inputs_round_to_nearest_even(launcher):
    """x @ I with x on and around bf16 rounding ties: out must be exactly x rounded to nearest, ties to even
    (truncation, or ties away from zero, would differ in the last bf16 bit)."""
    k = 24
    base = f32_to_bf16(np.linspace(-3, 3, 2 * k, dtype=np.float32)).reshape(2, k)
    bits = (base.astype(np.uint32) << np.uint32(16))
    # +0x8000: exactly halfway to the next bf16 (ties, on even and odd mantissas); +0x7FFF / +0x8001: just off
    offsets = np.array([0x8000, 0x7FFF, 0x8001], np.uint32)[:, None, None]
    x = (bits[None] + offsets).reshape(6, k).view(np.float32)
    w = f32_to_bf16(np.eye(k, dtype=np.float32))
    np.testing.assert_array_equal(run(launcher, x, w, bf16_inputs=True).copy_to_host(), round_to_bf16(x))


@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_gemm_tc_keeps_infinity(bf16_inputs):
    """An infinite activation is carried whole by the hi piece (inf - inf would make the others NaN), and
    stays infinite when rounded to bf16."""
    x, w = make_inputs(0, 3, 5, 24)
    x[1, 7] = np.inf
    x[2, 3] = -np.inf
    got = run(tc.gemm_tc, x, w, bf16_inputs=bf16_inputs).copy_to_host()
    want = reference_matmul(round_to_bf16(x) if bf16_inputs else x, w)
    np.testing.assert_array_equal(got[1:], want[1:])   # +-inf in the infinite rows, signs per column
    check(got[:1], x[:1], w, bf16_inputs)


@settings(max_examples=examples(5, 15))
@given(seeds, sizes(12, [1, 2, 7, 8, 9, 16, 64, 256, 1024], 1100), weight_shapes(24, 40), st.booleans())
def test_matmul_dispatch(seed, m, nk, bf16_inputs):
    """The engine's entry point on both sides of GEMV_MAX_M, launched on a stream of its own."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    stream = cuda.stream()
    out = stale_out(m, n)
    mm.matmul(to_device(x), to_device(w), out, stream, bf16_inputs=bf16_inputs)
    stream.synchronize()
    check(out, x, w, bf16_inputs)


# ---------------------------------------------------------------------------------------------------------
# gemm_tc's tile policy (a pure function of the shape: the same on both profiles)
# ---------------------------------------------------------------------------------------------------------

T = tc.GemmTcTile
SKINNY16, SKINNY32 = mp.GEMM_TC_SKINNY_TILES[16], mp.GEMM_TC_SKINNY_TILES[32]


@pytest.mark.parametrize("m, n, k, want", [
    (16, 3072, 2048, T(16, 32, 128, 16, 16, 4)),    # QKV, decode 16: 96 blocks; 16 x 64 would give 48
    (16, 16384, 2048, T(16, 64, 128, 16, 16, 4)),   # gate/up: 256 blocks at the widest
    (9, 128256, 2048, T(16, 64, 128, 16, 16, 4)),   # LM head
    (16, 2048, 2048, T(16, 16, 128, 16, 8, 4)),     # O: 64 blocks at 16 x 32, 128 at 16 x 16
    (16, 2048, 8192, T(16, 16, 128, 16, 8, 4)),     # down: the same
    (16, 1024, 8192, mp.GEMM_TC_SKINNY_DEEP_TILE),  # 64 blocks even at 16 x 16, long K
    (32, 3072, 2048, SKINNY32[1]),                # 32 x 32: 96 blocks
    (64, 3072, 2048, SKINNY32[0]),                 # 32 x 64, measured: 96 blocks, 38 us against 61 (32 x 32)
    (64, 2048, 8192, SKINNY32[1]),                 # 32 x 32, measured: 128 blocks, 132 us against 185 (32 x 64)
    (128, 3072, 2048, SKINNY32[0]),
    (256, 3072, 2048, SKINNY32[0]),                # measured: 83 us against 115 (64 x 64), bf16 inputs
    (256, 2048, 8192, SKINNY32[0]),                # measured: 198 against 470 us, bf16 inputs
    (512, 3072, 2048, mp.GEMM_TC_SMALL_TILE),       # 96 big blocks; 384 small ones
    (256, 16384, 2048, mp.GEMM_TC_TILE),            # 256 big blocks
    (1024, 2048, 8192, mp.GEMM_TC_TILE),            # measured: 705 against 957 us, 128 blocks
])
def test_gemm_tc_tile_policy_examples(m, n, k, want):
    assert mp.gemm_tc_tile(m, n, k, bf16_inputs=True) == want
    # fp32 mode: the same tile, bounded to two blocks per SM when it has 32 rows
    assert mp.gemm_tc_tile(m, n, k) == (want._replace(min_blocks=2) if want.bm == 32 else want)


def blocks(tile, m, n):
    return -(-n // tile.bn) * -(-m // tile.bm)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 200_000), st.integers(1, 10_000))
def test_gemm_tc_tile_policy_rules(m, n, k):
    """The rules of gemm_tc_tile's docstring, for any shape; every pick fits shared memory in both modes."""
    tile = mp.gemm_tc_tile(m, n, k, bf16_inputs=True)
    assert mp.gemm_tc_tile(m, n, k)._replace(min_blocks=0) == tile
    assert all(tc.gemm_tc_shared_bytes(tile, bf16) <= tc.GEMM_TC_MAX_SHARED for bf16 in (False, True))
    if m > 64 and blocks(mp.GEMM_TC_TILE, m, n) >= mp.GEMM_TC_BIG_BLOCKS:
        assert tile == mp.GEMM_TC_TILE
        return
    if m > mp.GEMM_TC_SMALL_MIN_M and blocks(mp.GEMM_TC_SMALL_TILE, m, n) >= mp.GEMM_TC_BIG_BLOCKS:
        assert tile == mp.GEMM_TC_SMALL_TILE
        return
    skinny = SKINNY16 if m <= 16 else SKINNY32
    full = [t for t in skinny if blocks(t, m, n) >= mp.GEMM_TC_SKINNY_BLOCKS]
    if full:
        assert tile == full[0]          # the widest that covers two thirds of the SMs
    elif m <= 16 and k >= mp.GEMM_TC_DEEP_K:
        assert tile == mp.GEMM_TC_SKINNY_DEEP_TILE
    else:
        assert tile == skinny[-1]


# ---------------------------------------------------------------------------------------------------------
# NaN stays where it came from
# ---------------------------------------------------------------------------------------------------------

def policy_gemv(x, w, out, bf16_inputs=False):
    gv.gemv(x, w, out, config=mp.gemv_config(x.shape[0], w.shape[0], x.shape[1]), bf16_inputs=bf16_inputs)


VERSIONS = {
    "naive": simt.matmul_naive,
    "gemv_warp": gv.gemv_warp,
    "gemv": policy_gemv,
    "gemm": lambda x, w, out: simt.gemm(x, w, out, tile=mp.GEMM_TILE),
    "gemm-small-tile": lambda x, w, out: simt.gemm(x, w, out, tile=SMALL_TILES[0]),
    "gemm_tc": tc.gemm_tc,
    "gemm_tc-skinny": lambda x, w, out: tc.gemm_tc(x, w, out, tile=mp.GEMM_TC_SKINNY_TILES[16][-1]),
    "matmul": mm.matmul,
}
# bf16_inputs: a NaN x rounds to a NaN bf16, so it must stay as confined as in fp32 mode
BF16_VERSIONS = {
    "naive-bf16": lambda x, w, out: simt.matmul_naive(x, w, out, bf16_inputs=True),
    "gemv_warp-bf16": lambda x, w, out: gv.gemv_warp(x, w, out, bf16_inputs=True),
    "gemm-bf16": lambda x, w, out: simt.gemm(x, w, out, tile=mp.GEMM_TILE, bf16_inputs=True),
    "gemm_tc-bf16": lambda x, w, out: tc.gemm_tc(x, w, out, bf16_inputs=True),
}


@pytest.mark.parametrize("version", [*VERSIONS, *BF16_VERSIONS])
@settings(max_examples=examples(3, 5))
@given(seeds, st.integers(2, pick(9, 20)), weight_shapes(16, 20), st.data())
def test_nan_row_and_column_stay_confined(version, seed, m, nk, data):
    """A NaN in one row of x poisons that output row only; a NaN in one W row, that output column only."""
    n, k = nk
    if not SIM:
        n, k = min(n, 4096), min(k, 2048)
    n = max(n, 2)
    x, w = make_inputs(seed, m, n, k)
    bad_m, bad_n = data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, n - 1))
    x[bad_m, data.draw(st.integers(0, k - 1))] = np.nan
    w[bad_n, data.draw(st.integers(0, k - 1))] = 0x7FC0  # a bf16 quiet NaN
    bf16_inputs = version in BF16_VERSIONS
    out = run((BF16_VERSIONS if bf16_inputs else VERSIONS)[version], x, w).copy_to_host()
    poisoned = np.zeros((m, n), bool)
    poisoned[bad_m, :] = True
    poisoned[:, bad_n] = True
    assert np.isnan(out[poisoned]).all()
    assert not np.isnan(out[~poisoned]).any()
    check(out, x, w, bf16_inputs)


# ---------------------------------------------------------------------------------------------------------
# launcher argument checks
# ---------------------------------------------------------------------------------------------------------

LAUNCHERS = [simt.matmul_naive, gv.gemv_warp, gv.gemv, simt.gemm, tc.gemm_tc, mm.matmul]


def _args(m=3, n=5, k=8, x_dtype=np.float32, w_dtype=np.uint16, out_dtype=np.float32, out_shape=None):
    return (device_empty((m, k), x_dtype), device_empty((n, k), w_dtype),
            device_empty(out_shape or (m, n), out_dtype))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("args, match", [
    (lambda: _args(x_dtype=np.float64), r"x must be float32, got float64"),
    (lambda: _args(w_dtype=np.float32), r"weight must be uint16"),
    (lambda: _args(out_dtype=np.float16), r"out must be float32, got float16"),
    (lambda: _args(out_shape=(3, 6)), r"out must have shape \(M, N\) = \(3, 5\).*got \(3, 6\)"),
    (lambda: _args(out_shape=(5, 3)), r"out must have shape \(M, N\) = \(3, 5\)"),
    (lambda: (device_empty((3, 8), np.float32), device_empty((5, 7), np.uint16),
              device_empty((3, 5), np.float32)), r"x \(3, 8\) and weight \(5, 7\).*disagree on K \(8 vs 7\)"),
    (lambda: (device_empty((8,), np.float32), device_empty((5, 8), np.uint16),
              device_empty((1, 5), np.float32)), r"x must be 2-D, got shape \(8,\)"),
])
def test_launcher_rejects_bad_arguments(launcher, args, match):
    with pytest.raises(ValueError, match=match):
        launcher(*args())


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_launcher_rejects_host_arrays(launcher):
    x, w, out = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.uint16), device_empty((2, 3), np.float32)
    with pytest.raises(TypeError, match="x must be a numba device array"):
        launcher(x, to_device(w), out)
    with pytest.raises(TypeError, match="weight must be a numba device array"):
        launcher(to_device(x), w, out)


def test_uint64_weight_view_only_where_gemv_takes_it():
    """gemv accepts W's uint64 view (K = 4 * its width); gemm and gemm_tc would read it as bf16: refused."""
    x, w, out = _args(k=8)
    with pytest.raises(ValueError, match=r"x \(3, 8\) and weight \(5, 1\) \(uint64\) disagree on K \(8 vs 4"):
        gv.gemv(x, device_empty((5, 1), np.uint64), out)
    with pytest.raises(ValueError, match="weight must be uint16 bf16 bits, got uint64"):
        simt.gemm(x, w.view(np.uint64), out)
    with pytest.raises(ValueError, match="weight must be uint16 bf16 bits, got uint64"):
        tc.gemm_tc(x, w.view(np.uint64), out)


@pytest.mark.parametrize("tile, bf16_inputs, match", [
    (T(16, 16, 24, 16, 8), False, r"gemm_tc tile \(16, 16, 24, 16, 8, 1, 1, 0\): need bk % 16"),
    (T(16, 16, 32, 16, 8, 3), False, r"\(bk / 16\) % kw all zero"),
    (T(16, 16, 32, 16, 8, 0), False, r"kw >= 1"),
    (T(16, 16, 32, 16, 8, 1, 3), False, r"stages 1 or 2"),
    (T(16, 16, 32, 16, 8, 1, 1, -1), False, r"min_blocks >= 0"),
    (T(128, 128, 32, 16, 16), False, r"gives 2048 threads per block \(max 1024\)"),
    (T(128, 128, 32, 64, 32, 1, 2), False, r"needs 66560 bytes of shared memory \(max 49152\)"),
    (T(32, 64, 128, 32, 16, 4), False, r"bf16_inputs=False\) needs 50176 bytes"),
])
def test_gemm_tc_rejects_bad_tiles(tile, bf16_inputs, match):
    with pytest.raises(ValueError, match=match):
        tc.gemm_tc(*_args(), tile=tile, bf16_inputs=bf16_inputs)


def test_gemm_tc_shared_memory_of_one_plane():
    """bf16_inputs stages one x plane instead of three: a two-stage 128 x 128 tile fits only that way."""
    big2 = mp.GEMM_TC_TILE._replace(stages=2)
    assert tc.gemm_tc_shared_bytes(big2, bf16_inputs=True) == 2 * tc.gemm_tc_shared_bytes(mp.GEMM_TC_TILE, True)
    assert tc.gemm_tc_shared_bytes(big2, True) <= tc.GEMM_TC_MAX_SHARED < tc.gemm_tc_shared_bytes(big2, False)


# ---------------------------------------------------------------------------------------------------------
# the pipelined GEMM (cuda_kernels/gemm_pipelined.py) and its staging primitives (cuda_kernels/async_copy.py)
# ---------------------------------------------------------------------------------------------------------

@settings(max_examples=examples(4, 20))
@given(seeds, st.integers(1, pick(16, 128)), st.data())
def test_cp_async_copies_or_zero_fills_chunks(seed, pairs, data):
    """Every chunk lands where it was sent (read back by the neighbouring thread after the wait and a
    barrier), and a chunk sent with valid False is 16 zero bytes, whatever the source holds."""
    n = 2 * pairs
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 2**16, n * async_copy.CHUNK, dtype=np.uint16)   # no zeros: a zero fill shows
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.int32)
    dst = to_device(np.full(n * async_copy.CHUNK, 7, np.uint16))
    async_copy.copy_chunks(to_device(src), to_device(valid), dst)
    want = np.where(valid[:, None] != 0, src.reshape(n, -1), 0)[np.arange(n) ^ 1].ravel()
    np.testing.assert_array_equal(dst.copy_to_host(), want)


@settings(max_examples=examples(4, 20))
@given(seeds)
def test_ldmatrix_x4_gives_each_lane_its_fragment(seed):
    """Lane (g, t) gets, for matrix q, the bf16 pair at elements 2t, 2t + 1 of the row lane 8 q + g named
    (any rows, repeats allowed), low element in the low half."""
    rng = np.random.default_rng(seed)
    sh = rng.integers(0, 2**16, 1024, dtype=np.uint16)
    rows = (rng.integers(0, 1024 // async_copy.CHUNK, 32) * async_copy.CHUNK).astype(np.int64)
    out = device_empty((32, 4), np.uint32)
    async_copy.ldmatrix(to_device(sh), to_device(rows), out)
    lane = np.arange(32)[:, None]
    start = rows[8 * np.arange(4)[None, :] + lane // 4] + 2 * (lane % 4)
    want = sh[start].astype(np.uint32) | (sh[start + 1].astype(np.uint32) << np.uint32(16))
    np.testing.assert_array_equal(out.copy_to_host(), want)


@settings(max_examples=examples(4, 20))
@given(seeds)
def test_ldmatrix_x4_trans_gives_each_lane_its_transposed_fragment(seed):
    """Transposed: lane (g, t) gets, for matrix q, element g of the rows lanes 8 q + 2t and 8 q + 2t + 1
    named (column g, rows 2t and 2t + 1), the first in the low half."""
    rng = np.random.default_rng(seed)
    sh = rng.integers(0, 2**16, 1024, dtype=np.uint16)
    rows = (rng.integers(0, 1024 // async_copy.CHUNK, 32) * async_copy.CHUNK).astype(np.int64)
    out = device_empty((32, 4), np.uint32)
    async_copy.ldmatrix(to_device(sh), to_device(rows), out, trans=True)
    lane = np.arange(32)[:, None]
    first = 8 * np.arange(4)[None, :] + 2 * (lane % 4)
    low, high = sh[rows[first] + lane // 4], sh[rows[first + 1] + lane // 4]
    want = low.astype(np.uint32) | (high.astype(np.uint32) << np.uint32(16))
    np.testing.assert_array_equal(out.copy_to_host(), want)


@settings(max_examples=examples(4, 15))
@given(seeds, st.integers(1, pick(12, 1100)), st.integers(1, pick(40, 3000)), x_scales, st.booleans())
def test_bf16_planes_match_the_reference_bit_for_bit(seed, m, k, x_scale, bf16_inputs):
    """x -> its bf16 planes, exactly reference.matmul.bf16_planes, infinities and zeros included; the
    workspace past the planes is not written."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k), dtype=np.float32) * np.float32(x_scale)).astype(np.float32)
    x.flat[rng.integers(0, x.size, 3)] = [np.inf, -np.inf, 0.0]
    want = reference_bf16_planes(x, bf16_inputs).ravel()
    planes = to_device(np.full(want.size + 8, 0xBEEF, np.uint16))
    gp.bf16_planes(to_device(x), planes, bf16_inputs=bf16_inputs)
    got = planes.copy_to_host()
    np.testing.assert_array_equal(got[:want.size], want)
    assert (got[want.size:] == 0xBEEF).all()


# tiles for the simulator's tests (tiny, every code path: more than one warp along M and N, chunks that do
# not divide evenly over the threads, two stages) and the GPU's (the candidates the policy picks from)
PIPELINED_TILES = pick([gp.SIM_TILE, gp.PipelinedTile(32, 16, 16, 16, 16, 2)],
                       [mp.PIPELINED_WIDE_FP32, mp.PIPELINED_WIDE_BF16, mp.PIPELINED_NARROW, mp.PIPELINED_SMALL,
                        gp.PipelinedTile(),
                        gp.PipelinedTile(128, 128, 32, 64, 32, 3, 2), gp.PipelinedTile(128, 128, 64, 64, 32, 3)])


def run_pipelined(x, w, tile=None, bf16_inputs=False, stream=0):
    out = stale_out(x.shape[0], w.shape[0])
    workspace = device_empty(gp.workspace_size(*x.shape, bf16_inputs), np.uint16)
    gp.gemm_pipelined(to_device(x), to_device(w), out, workspace, stream, tile=tile, bf16_inputs=bf16_inputs)
    return out


@pytest.mark.parametrize("tile", PIPELINED_TILES, ids=lambda t: "x".join(map(str, t)))
@settings(max_examples=examples(3, 8))
@given(seeds, sizes(40, [64, 256, 1024], 1100), weight_shapes(40, 72), x_scales, w_scales, st.booleans())
def test_gemm_pipelined(tile, seed, m, nk, x_scale, w_scale, bf16_inputs):
    """Each tile, both precisions: partial block tiles along M and N, K (a multiple of 8) short of a slab,
    one slab, fewer slabs than stages, or many."""
    n, k = nk
    k = 8 * -(-k // 8)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run_pipelined(x, w, tile, bf16_inputs), x, w, bf16_inputs)


@pytest.mark.parametrize("tile", PIPELINED_TILES, ids=lambda t: "x".join(map(str, t)))
@settings(max_examples=examples(3, 6))
@given(seeds, sizes(40, [64, 256, 1024], 1100), gated_shapes, x_scales, st.booleans())
def test_gemm_pipelined_gated(tile, seed, m, fk, x_scale, bf16_inputs):
    """The SiLU*mul epilogue: features not a multiple of a block's BN / 2 (nor of a warp's WN / 2), so the
    last block stages gate and up rows past F as zeros and stores nothing for them; |x| up to 3e15, where
    silu saturates or flushes to -0."""
    f, k = fk
    k = 8 * -(-k // 8)
    m = cap_m(m, 2 * f, k)
    x, w = make_inputs(seed, m, 2 * f, k, x_scale)
    out = stale_out(m, f)
    workspace = device_empty(gp.workspace_size(m, k, bf16_inputs), np.uint16)
    gp.gemm_pipelined(to_device(x), to_device(w), out, workspace, tile=tile, bf16_inputs=bf16_inputs, gated=True)
    check_gated(out, x, w, bf16_inputs)


@pytest.mark.parametrize("tile", PIPELINED_TILES, ids=lambda t: "x".join(map(str, t)))
@settings(max_examples=examples(3, 6))
@given(seeds, sizes(40, [64, 256, 1024], 1100), gated_shapes, st.integers(1, pick(40, 3000)), st.booleans())
def test_gemm_pipelined_planes_out_feed_the_next_gemm(tile, seed, m, fk, n, bf16_inputs):
    """The gated GEMM writing its result as bf16 planes (what matmul.mlp does): the planes are exactly
    reference.bf16_planes of the same kernel's float32 result (the rest of out untouched), and gemm_planes
    multiplies them as it would that result: act @ W2^T within the summation tolerance."""
    f, k = (8 * -(-v // 8) for v in fk)
    m = cap_m(m, 2 * f, k)
    x, w = make_inputs(seed, m, 2 * f, k)
    w2 = make_inputs(seed + 1, 1, n, f)[1]
    workspace = device_empty(gp.workspace_size(m, k, bf16_inputs), np.uint16)
    act = stale_out(m, f)
    gp.gemm_pipelined(to_device(x), to_device(w), act, workspace, tile=tile, bf16_inputs=bf16_inputs, gated=True)
    act = act.copy_to_host()
    p = gp.pieces(bf16_inputs)
    planes = to_device(np.full(p * m * f + 8, 0xBEEF, np.uint16))
    gp.gemm_pipelined(to_device(x), to_device(w), planes[:p * m * f].reshape(p * m, f), workspace, tile=tile,
                      bf16_inputs=bf16_inputs, gated=True)
    got = planes.copy_to_host()
    np.testing.assert_array_equal(got[:p * m * f], reference_bf16_planes(act, bf16_inputs).ravel())
    assert (got[p * m * f:] == 0xBEEF).all()
    out = stale_out(m, n)
    gp.gemm_planes(planes, m, to_device(w2), out, tile=tile, bf16_inputs=bf16_inputs)
    check(out, act, w2, bf16_inputs)


def split_workspace(tile, m, n, splits, gated=False):
    """(partials, counters) for a split launch: partials poisoned with NaN (a split that is read before it
    is written shows), counters zero as the engine allocates them."""
    partials = to_device(np.full(gp.split_partials_size(tile, m, n, splits, gated), np.nan, np.float32))
    return partials, to_device(np.zeros(gp.split_counters_size(tile, m, n, gated), np.int32))


# split-K: the simulator's tiles over a few slabs (the one-warp 32 x 32 tile adds its partials two splits at a
# time, so more splits than that take several batches); on the GPU the skinny tiles
SPLIT_TILES = pick([gp.SIM_TILE, gp.PipelinedTile(32, 16, 16, 16, 16, 2), gp.PipelinedTile(32, 32, 16, 32, 32, 2)],
                   list(mp.PIPELINED_SKINNY_TILES.values()))


@pytest.mark.parametrize("tile", SPLIT_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("epilogue", ["plain", "gated", "planes"])
@settings(max_examples=examples(3, 6))
@given(seeds, sizes(20, [9, 16, 33, 64, 128], 128), st.integers(1, pick(24, 3000)),
       st.integers(1, pick(6, 40)), st.data(), st.booleans())
def test_gemm_pipelined_split_k(tile, epilogue, seed, m, n, slabs, data, bf16_inputs):
    """K split over gridDim.z blocks per tile: every split count that leaves no split empty, with a K short
    of a whole last slab; the result within the summation tolerance, bit-identical on a second launch (the
    splits are added in split order whoever arrives last), the counters zero again, and for the planes
    epilogue exactly the planes of the float32 result."""
    gated = epilogue != "plain"
    k = max(8, tile.bk * slabs - 8 * data.draw(st.integers(0, tile.bk // 8 - 1)))
    splits = data.draw(st.sampled_from(gp.valid_splits(tile, k)))
    rows = 2 * n if gated else n
    x, w = make_inputs(seed, m, rows, k)
    p = gp.pieces(bf16_inputs)
    workspace = to_device(reference_bf16_planes(x, bf16_inputs).ravel())
    partials, counters = split_workspace(tile, m, rows, splits, gated)
    outs = []
    for _ in range(2):
        out = (to_device(np.full((p * m, n), 0xBEEF, np.uint16)) if epilogue == "planes" else stale_out(m, n))
        gp.gemm_planes(workspace, m, to_device(w), out, tile=tile, bf16_inputs=bf16_inputs, gated=gated,
                       splits=splits, split_workspace=(partials, counters))
        outs.append(out.copy_to_host())
        assert (counters.copy_to_host() == 0).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    if epilogue == "plain":
        check(outs[0], x, w, bf16_inputs)
    elif epilogue == "gated":
        check_gated(to_device(outs[0]), x, w, bf16_inputs)
    else:   # the same launch with a float32 out gives the values these planes must encode
        out = stale_out(m, n)
        gp.gemm_planes(workspace, m, to_device(w), out, tile=tile, bf16_inputs=bf16_inputs, gated=True,
                       splits=splits, split_workspace=(partials, counters))
        np.testing.assert_array_equal(outs[0].ravel(), reference_bf16_planes(out.copy_to_host(), bf16_inputs).ravel())
        check_gated(out, x, w, bf16_inputs)


def test_split_k_plans():
    """skinny_plan: the tile for M, splits that give about a block per SM without an empty or short split,
    none for a grid that already has that many; split_workspace_sizes covers every plan of the given weights."""
    for bf16 in (False, True):
        sizes_ = mp.split_workspace_sizes(LLAMA_1B_MATMULS, bf16)
        for m in range(9, mp.PIPELINED_SKINNY_MAX_M + 1):
            for n, k, gated in LLAMA_1B_MATMULS:
                tile, splits = mp.skinny_plan(m, n, k, bf16, gated)
                assert tile.bm >= m and (tile.bm == 16 or tile.bm // 2 < m)
                slabs = -(-k // tile.bk)
                assert splits in gp.valid_splits(tile, k) and (splits == 1 or slabs // splits >= mp.MIN_SPLIT_SLABS)
                tiles = gp.split_counters_size(tile, m, n, gated)
                assert splits == 1 or tiles * (splits - 0.5) <= mp.SM_COUNT
                if splits > 1:
                    assert gp.split_partials_size(tile, m, n, splits, gated) <= sizes_[0]
                    assert tiles <= sizes_[1]
    assert mp.skinny_plan(16, 3072, 2048, True) == (mp.PIPELINED_SKINNY_TILES[16], 6)  # 24 tiles -> 144 blocks
    assert mp.skinny_plan(64, 2048, 8192, True) == (mp.PIPELINED_SKINNY_TILES[64], 8)  # down: 16 tiles -> 128
    assert mp.skinny_plan(16, 16384, 2048, True, gated=True)[1] == 1                  # gate/up: 128 tiles
    assert mp.skinny_plan(64, 128256, 2048, True)[1] == 1                             # 1002 tiles: no split


def test_split_k_rejects_bad_plans():
    x, w, out = _args(m=4, n=6, k=64)
    planes = device_empty(gp.workspace_size(4, 64, True), np.uint16)
    tile = gp.PipelinedTile(16, 16, 16, 16, 16, 2)   # 4 slabs of K = 64
    with pytest.raises(ValueError, match=r"5 splits of 4 slabs of 16 would leave a split empty"):
        gp.gemm_planes(planes, 4, w, out, tile=tile, bf16_inputs=True, splits=5)
    with pytest.raises(ValueError, match=r"3 splits of 4 slabs of 16 would leave a split empty"):
        gp.gemm_planes(planes, 4, w, out, tile=tile, bf16_inputs=True, splits=3)
    with pytest.raises(ValueError, match=r"2 splits need split_workspace"):
        gp.gemm_planes(planes, 4, w, out, tile=tile, bf16_inputs=True, splits=2)
    small = (device_empty(gp.split_partials_size(tile, 4, 6, 2) - 1, np.float32), device_empty(1, np.int32))
    with pytest.raises(ValueError, match=r"2 splits need split_workspace"):
        gp.gemm_planes(planes, 4, w, out, tile=tile, bf16_inputs=True, splits=2, split_workspace=small)
    assert gp.valid_splits(tile, 64) == [1, 2, 4] and gp.valid_splits(tile, 80) == [1, 2, 3, 5]


@settings(max_examples=examples(4, 8))
@given(seeds, st.sampled_from(pick([1, 3, 20], [1, 5, 64, 200, 1024])), st.booleans())
def test_mlp_dispatch(seed, m, bf16_inputs):
    """matmul.mlp, the engine's MLP, against reference.mlp: on the GPU, from 128 rows, act only as bf16
    planes between the two GEMMs; below, and in the simulator, gated_matmul into act, then matmul. Bound:
    the gated product's own (gated_bound) and, with bf16 inputs, one bf16 step of act (a summation-order
    difference can flip its rounding), carried through |W2|, plus the down product's summation error."""
    f, h = pick((16, 24), (8192, 2048))
    x, w = make_inputs(seed, m, 2 * f, h)
    w2 = make_inputs(seed + 1, 1, h, f)[1]
    act_want, act_bound = gated_bound(x, w, bf16_inputs)
    if bf16_inputs:
        act_bound = act_bound + 2.0 ** -8 * (np.abs(act_want) + act_bound)
    abs_w2 = np.abs(bf16_to_f32(w2)).astype(np.float64)
    bound = act_bound @ abs_w2.T + dot_tolerance(f, np.abs(act_want) @ abs_w2.T)
    want = reference_mlp(x, w, w2, bf16_inputs)
    p = gp.pieces(bf16_inputs)
    out, act = stale_out(m, h), stale_out(m, f)
    mm.mlp(to_device(x), to_device(w), to_device(w2), out, act, device_empty((m, 2 * f), np.float32),
           bf16_inputs=bf16_inputs, workspace=device_empty(gp.workspace_size(m, h, bf16_inputs), np.uint16),
           act_planes=device_empty((p * m, f), np.uint16))
    err = np.abs(out.copy_to_host().astype(np.float64) - want)
    assert (err <= bound + 2 * F32_EPS * np.abs(want)).all(), f"worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_gemm_pipelined_keeps_infinity_and_confines_nan(bf16_inputs):
    """An infinite x stays in its row (all of it in the hi plane); a NaN weight spoils only its column."""
    x, w = make_inputs(1, 5, 9, 48)
    x[1, 7], x[2, 3] = np.inf, -np.inf
    w[4, 10] = f32_to_bf16(np.array([np.nan], np.float32))[0]
    got = run_pipelined(x, w, bf16_inputs=bf16_inputs).copy_to_host()
    want = reference_matmul(round_to_bf16(x) if bf16_inputs else x, w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[1:3], want[1:3])
    keep = [c for c in range(9) if c != 4]
    check(got[np.ix_([0, 3, 4], keep)], x[[0, 3, 4]], w[keep], bf16_inputs)


def test_gemm_pipelined_rejects_bad_arguments():
    x, w, out = _args(m=4, n=6, k=16)
    workspace = device_empty(gp.workspace_size(4, 16, False), np.uint16)
    with pytest.raises(ValueError, match=r"K must be a multiple of 8 \(16-byte rows\), got 12"):
        gp.gemm_pipelined(*_args(m=4, n=6, k=12), workspace)
    with pytest.raises(ValueError, match=r"planes must be a 1-D uint16 workspace of at least 192 elements, got "
                                         r"uint16 \(191,\)"):
        gp.gemm_pipelined(x, w, out, device_empty(191, np.uint16))
    with pytest.raises(ValueError, match=r"weight must be C-contiguous uint16 \(6, 16\), got float32"):
        gp.gemm_pipelined(x, device_empty((6, 16), np.float32), out, workspace)
    with pytest.raises(ValueError, match=r"out must be float32 \(4, 6\) or its uint16 planes \(12, 6\), got "
                                         r"float32 \(4, 5\)"):
        gp.gemm_pipelined(x, w, device_empty((4, 5), np.float32), workspace)
    with pytest.raises(ValueError, match=r"out must be float32 \(4, 3\) or its uint16 planes \(12, 3\), got "
                                         r"float32 \(4, 6\)"):
        gp.gemm_pipelined(x, w, out, workspace, gated=True)
    with pytest.raises(ValueError, match=r"or its uint16 planes \(4, 6\), got uint16 \(12, 6\)"):
        gp.gemm_pipelined(x, w, device_empty((12, 6), np.uint16), workspace, bf16_inputs=True)
    with pytest.raises(ValueError, match=r"planes must be a 1-D uint16 workspace of at least 64 elements"):
        gp.gemm_planes(device_empty(63, np.uint16), 4, w, out, bf16_inputs=True)
    with pytest.raises(ValueError, match=r"a gated weight is \[gate; up\], an even number of rows, got 5"):
        gp.gemm_pipelined(x, device_empty((5, 16), np.uint16), device_empty((4, 2), np.float32), workspace,
                          gated=True)
    with pytest.raises(ValueError, match=r"tile \(16, 16, 24, 16, 16, 2, 0\): need bk, wm, wn multiples of 16"):
        gp.gemm_pipelined(x, w, out, workspace, tile=gp.PipelinedTile(16, 16, 24, 16, 16, 2))
    with pytest.raises(ValueError, match=r"stages >= 2"):
        gp.gemm_pipelined(x, w, out, workspace, tile=gp.PipelinedTile(16, 16, 16, 16, 16, 1))


@pytest.mark.parametrize("bf16_inputs", [False, True])
@given(st.integers(1, 8192), st.integers(1, 131072), st.integers(1, 16384).map(lambda k: 8 * k))
def test_pipelined_tile_policy(bf16_inputs, m, n, k):
    """The policy's tile is a timed candidate that fits the H200's 227 KB of shared memory, never takes 128
    rows where 64 would pad M less, and has the wide tile's grid of at least PIPELINED_MIN_BLOCKS blocks when
    it is the wide tile."""
    tile = mp.pipelined_tile(m, n, k, bf16_inputs)
    assert tile in mp.PIPELINED_CANDIDATES
    assert gp.shared_bytes(tile, bf16_inputs) <= 227 * 1024
    if tile.bm == 128:
        assert -(-m // 128) * 128 <= -(-m // 64) * 64
        assert -(-m // 128) * -(-n // tile.bn) >= mp.PIPELINED_MIN_BLOCKS


@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_pipelined_tile_policy_picks_the_measured_tiles(bf16_inputs):
    """The choices matmul_policy.pipelined_tile's note measured: gate/up and QKV of the 1B model at M = 256,
    the LM head at M = 64, and at M = 1024 QKV, O and down."""
    wide, narrow = mp.PIPELINED_WIDE_BF16 if bf16_inputs else mp.PIPELINED_WIDE_FP32, mp.PIPELINED_NARROW
    assert mp.pipelined_tile(256, 16384, 2048, bf16_inputs) == wide
    assert mp.pipelined_tile(256, 3072, 2048, bf16_inputs) == (mp.PIPELINED_SMALL if bf16_inputs else narrow)
    assert mp.pipelined_tile(64, 128256, 2048, bf16_inputs) == narrow
    assert mp.pipelined_tile(1024, 3072, 2048, bf16_inputs) == (mp.PIPELINED_WIDE_BF16 if bf16_inputs else narrow)
    for n, k in ((2048, 2048), (2048, 8192)):   # O, down
        assert mp.pipelined_tile(1024, n, k, bf16_inputs) == (mp.PIPELINED_WIDE_BF16_DEEP if bf16_inputs else narrow)


def test_gemm_pipelined_shared_memory():
    """Stages of P * BM rows of planes and BN rows of W, each BK + 8 bf16 (the padding that keeps ldmatrix
    conflict-free): the default tile needs the dynamic opt-in above 48 KB in both modes."""
    tile = gp.PipelinedTile()
    assert gp.shared_bytes(tile, True) == 4 * (128 + 128) * 40 * 2 == 81920
    assert gp.shared_bytes(tile, False) == 4 * (3 * 128 + 128) * 40 * 2
    assert gp.shared_bytes(tile, True) > STATIC_SHARED_LIMIT
