"""cuda_kernels/matmul.py (naive, gemv, gemm, gemm_tc and the matmul dispatcher) against reference/matmul.py,
and the tensor-core primitive of cuda_kernels/mma.py on its own.

Every version is checked the same way: random x and bf16 W of hypothesis-chosen shapes and magnitudes, the
output compared elementwise with a tolerance derived from the numerics (fp32 sums in another order than
NumPy's), NaN confined to the row (of x) or column (of W) it came from, and the launchers' argument checks.
Simulator shapes are tiny; on the GPU profile the Llama-3.2-1B projection shapes are used.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, SIM, device_empty, dot_tolerance, pick, sizes, to_device
from numba import cuda

from cuda_kernels import matmul as mm
from cuda_kernels import mma
from reference.bf16 import bf16_to_f32, f32_to_bf16
from reference.matmul import matmul as reference_matmul

# Llama-3.2-1B weights as (N, K): QKV fused, O, gate/up fused, down, LM head.
LLAMA_1B_WEIGHTS = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]

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


def check(out, x, w):
    """out == x @ W^T to within the fp32 summation error (elementwise, NaN where the reference has NaN)."""
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

@settings(max_examples=pick(8, 10))
@given(seeds, sizes(9, [1, 2, 7]), weight_shapes(40, 80), x_scales, w_scales)
def test_matmul_naive(seed, m, nk, x_scale, w_scale):
    n, k = nk
    if not SIM:
        n, k = min(n, 4096), min(k, 2048)  # a teaching kernel: keep it to a few ms
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(mm.matmul_naive, x, w), x, w)


GEMV_CONFIGS = [mm.GEMV_CONFIG, mm.GemvConfig(warps_per_block=3, rows_per_warp=1)]


@pytest.mark.parametrize("path", ["u64", "u64-view-given", "scalar"])
@settings(max_examples=pick(4, 15))
@given(seeds, sizes(9, [1, 2, 3, 7, 8], 16), weight_shapes(20, 64), x_scales, w_scales,
       st.sampled_from(GEMV_CONFIGS))
def test_gemv(path, seed, m, nk, x_scale, w_scale, config):
    """Any M (chunks of up to 8 rows), odd N (partial blocks); 64-bit loads when K % 4 == 0 (the launcher
    views W as uint64, or the caller passes the view), the scalar path for other K."""
    n, k = nk
    k = 4 * max(1, k // 4) if path != "scalar" else (k if k % 4 else k + 1)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    out = stale_out(m, n)
    w_dev = to_device(w)
    mm.gemv(to_device(x), w_dev.view(np.uint64) if path == "u64-view-given" else w_dev, out, config=config)
    check(out, x, w)


@settings(max_examples=pick(6, 15))
@given(seeds, sizes(9, [16, 64, 256, 1024], 1100), weight_shapes(70, 40), x_scales, w_scales)
def test_gemm(seed, m, nk, x_scale, w_scale):
    """The engine's 64 x 64 tile. Simulator shapes: one tile row, one or two tile columns, partial K slabs."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(mm.gemm, x, w), x, w)


# Small tiles (64 threads) put many tiles and every kind of edge into shapes the simulator can afford.
SMALL_TILES = [mm.GemmTile(16, 16, 8, 2, 2), mm.GemmTile(32, 16, 8, 4, 2)]


@settings(max_examples=pick(8, 10))
@given(seeds, sizes(40, [16, 64, 256], 700), weight_shapes(40, 40), x_scales, w_scales,
       st.sampled_from(SMALL_TILES))
def test_gemm_small_tiles(seed, m, nk, x_scale, w_scale, tile):
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(mm.gemm, x, w, tile=tile), x, w)


@settings(max_examples=pick(5, 10))
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


@settings(max_examples=pick(5, 10))
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


def gemm_tc_tiles():
    """Simulator: the engine's tile and two small ones (several warps along M and N with two k-steps per slab;
    one warp with 2 x 2 mma tiles). GPU: the engine's two tiles and the same small ones."""
    small = [mm.GemmTcTile(32, 16, 32, 16, 8), mm.GemmTcTile(32, 16, 16, 32, 16)]
    engine = [mm.GEMM_TC_TILE] if SIM else [mm.GEMM_TC_TILE, mm.GEMM_TC_SMALL_TILE]
    return st.sampled_from(engine + small)


@settings(max_examples=pick(8, 20))
@given(seeds, sizes(20, [16, 64, 256, 1024], 1100), weight_shapes(24, 40), x_scales, w_scales)
def test_gemm_tc(seed, m, nk, x_scale, w_scale):
    """The engine's tile choice (the launcher's default). K % 4 != 0 takes the bf16-at-a-time weight loads;
    K not a multiple of 16 zero-pads the last slab; partial tiles along M and N."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    check(run(mm.gemm_tc, x, w), x, w)


@settings(max_examples=pick(8, 15))
@given(seeds, sizes(40, [16, 64, 256, 1024], 700), weight_shapes(20, 40), gemm_tc_tiles())
def test_gemm_tc_tiles(seed, m, nk, tile):
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    check(run(mm.gemm_tc, x, w, tile=tile), x, w)


def test_gemm_tc_keeps_infinity():
    """An infinite activation is carried whole by the hi piece (inf - inf would make the others NaN)."""
    x, w = make_inputs(0, 3, 5, 24)
    x[1, 7] = np.inf
    x[2, 3] = -np.inf
    got = run(mm.gemm_tc, x, w).copy_to_host()
    want = reference_matmul(x, w)
    np.testing.assert_array_equal(got[1:], want[1:])   # +-inf in the infinite rows, signs per column
    check(got[:1], x[:1], w)


@settings(max_examples=pick(5, 15))
@given(seeds, sizes(12, [1, 2, 7, 8, 9, 16, 64, 256, 1024], 1100), weight_shapes(24, 40))
def test_matmul_dispatch(seed, m, nk):
    """The engine's entry point on both sides of GEMV_MAX_M, launched on a stream of its own."""
    n, k = nk
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    stream = cuda.stream()
    out = stale_out(m, n)
    mm.matmul(to_device(x), to_device(w), out, stream)
    stream.synchronize()
    check(out, x, w)


# ---------------------------------------------------------------------------------------------------------
# NaN stays where it came from
# ---------------------------------------------------------------------------------------------------------

VERSIONS = {
    "naive": mm.matmul_naive,
    "gemv": mm.gemv,
    "gemm": mm.gemm,
    "gemm-small-tile": lambda x, w, out: mm.gemm(x, w, out, tile=SMALL_TILES[0]),
    "gemm_tc": mm.gemm_tc,
    "matmul": mm.matmul,
}


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=pick(3, 5))
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
    out = run(VERSIONS[version], x, w).copy_to_host()
    poisoned = np.zeros((m, n), bool)
    poisoned[bad_m, :] = True
    poisoned[:, bad_n] = True
    assert np.isnan(out[poisoned]).all()
    assert not np.isnan(out[~poisoned]).any()
    check(out, x, w)


# ---------------------------------------------------------------------------------------------------------
# launcher argument checks
# ---------------------------------------------------------------------------------------------------------

LAUNCHERS = [mm.matmul_naive, mm.gemv, mm.gemm, mm.gemm_tc, mm.matmul]


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
        mm.gemv(x, device_empty((5, 1), np.uint64), out)
    with pytest.raises(ValueError, match="weight must be uint16 bf16 bits, got uint64"):
        mm.gemm(x, w.view(np.uint64), out)
    with pytest.raises(ValueError, match="weight must be uint16 bf16 bits, got uint64"):
        mm.gemm_tc(x, w.view(np.uint64), out)
