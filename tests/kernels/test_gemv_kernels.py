"""cuda_kernels/gemv.py (gemv, gemv_silu_mul and the launcher's config choice) against reference/.

gemv is checked against reference.matmul.matmul, gemv_silu_mul against reference.activation.silu_and_mul of
it, with tolerances derived from the numerics (fp32 sums in another order than NumPy's), for any M (chunks of
8 rows), odd N and K (partial blocks, the scalar path for K % 4 != 0), the caller's uint64 view, every config
knob, bf16_inputs on and off (x rounded with reference.bf16.round_to_bf16 here, so these tests do not depend
on the reference's own flag), NaN confined to its row and column, the launchers' argument checks, and
gemv_config's choices as a pure function. Simulator shapes are tiny; the GPU profile uses the Llama-3.2-1B
projection shapes.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import F32_EPS, SIM, device_empty, dot_tolerance, pick, sizes, to_device
from numba import cuda

from cuda_kernels import gemv as gv
from reference.activation import silu_and_mul as reference_silu_and_mul
from reference.bf16 import bf16_to_f32, f32_to_bf16, round_to_bf16
from reference.matmul import matmul as reference_matmul

# Llama-3.2-1B weights as (N, K): QKV fused, O, gate/up fused, down, LM head.
LLAMA_1B_WEIGHTS = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]

seeds = st.integers(0, 2**32 - 1)
# |x| and |W| scales: typical, tiny and large (products up to ~1e26, sums of 8192 still far below fp32 max)
x_scales = st.sampled_from([1.0, 1e-3, 1e6, 3e15])
w_scales = st.sampled_from([0.02, 1.0, 1e10])
# silu(g) * u multiplies two dot products: keep their product finite (overflow is tested by neither side)
silu_x_scales = st.sampled_from([1.0, 1e-3, 1e6])
silu_w_scales = st.sampled_from([0.02, 1.0])

# Small configs for the simulator (few threads, every knob away from its default), and on the GPU the same
# plus None (the launcher's choice), which is also what the simulator's None draws exercise.
SMALL_CONFIGS = [None, gv.GemvConfig(1, 1, 1, 1, 1024), gv.GemvConfig(2, 2, 1, 2, 64),
                 gv.GemvConfig(1, 2, 2, 2, 16), gv.GemvConfig(4, 1, 2, 1, 128)]


def weight_shapes(sim_n: int, sim_k: int):
    """(N, K): 1..sim_n x 1..sim_k in the simulator; on the GPU the 1B shapes or odd ones."""
    if SIM:
        return st.tuples(st.integers(1, sim_n), st.integers(1, sim_k))
    return st.one_of(st.sampled_from(LLAMA_1B_WEIGHTS), st.tuples(st.integers(1, 5000), st.integers(1, 3000)))


def make_inputs(seed, m, n, k, x_scale=1.0, w_scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k), dtype=np.float32) * np.float32(x_scale)).astype(np.float32)
    w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * np.float32(w_scale))
    return x, w


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _dots(x, w, bf16_inputs):
    """(x @ W^T, the absolute sum of each dot's terms, the atol of its summation order) on the host."""
    xr = round_to_bf16(x) if bf16_inputs else x
    want = reference_matmul(xr, w)
    magnitude = np.abs(xr) @ np.abs(bf16_to_f32(w)).T
    magnitude = np.where(np.isfinite(magnitude), magnitude, 0)
    return want, dot_tolerance(x.shape[1], magnitude)


def _assert_within(got, want, bound):
    err = np.abs(got.astype(np.float64) - want)
    ok = (err <= bound) | (np.isnan(got) & np.isnan(want)) | (got == want)  # (== : equal infinities)
    if not ok.all():
        bad = ~ok
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)), got.shape)
        raise AssertionError(f"{bad.sum()} of {bad.size} outputs off; worst at {i}: got {got[i]!r}, want "
                             f"{want[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}")


def check_gemv(out, x, w, bf16_inputs=False):
    """out == x @ W^T (x rounded to bf16 first if bf16_inputs) to within the fp32 summation error."""
    want, atol = _dots(x, w, bf16_inputs)
    got = _host(out)
    assert got.shape == want.shape
    # NOTE: atol covers the summation order; the rtol term only the final rounding of the result (2 ulps)
    _assert_within(got, want, atol + 2 * F32_EPS * np.abs(want.astype(np.float64)))


def check_silu(out, x, w, bf16_inputs=False):
    """out == silu(x @ W_gate^T) * (x @ W_up^T), w = [W_gate; W_up], to within the error the dots carry.

    With g, u off by at most tg, tu (their summation tolerances) and |silu'| <= 1.1:
    |silu(g') u' - silu(g) u| <= 1.1 tg (|u| + tu) + |silu(g)| tu, plus a few ulps of the epilogue."""
    i = w.shape[0] // 2
    dots, atol = _dots(x, w, bf16_inputs)
    want = reference_silu_and_mul(dots)
    g, u, tg, tu = dots[:, :i], dots[:, i:], atol[:, :i], atol[:, i:]
    with np.errstate(over="ignore"):
        silu_g = np.abs(g / (np.float32(1) + np.exp(-g)))
    bound = 1.1 * tg * (np.abs(u) + tu) + silu_g * tu
    bound = bound + 8 * F32_EPS * (np.abs(want.astype(np.float64)) + bound) + 1e-30
    got = _host(out)
    assert got.shape == want.shape
    _assert_within(got, want, bound)


def stale_out(m, n):
    # NOTE: a finite sentinel rather than uninitialised memory: an output the kernel forgets to write fails
    # the comparison for certain, even where the reference is NaN.
    return to_device(np.full((m, n), -7777.0, np.float32))


def weight_for(path, w):
    """The device weight a path launches with: uint16 (viewed as uint64 by the launcher when K % 4 == 0), or
    the caller's own uint64 view."""
    dw = to_device(w)
    return dw.view(np.uint64) if path == "u64-view-given" else dw


def path_k(path, k):
    """K for a path: a multiple of 4 for the 64-bit paths, K % 4 != 0 for the scalar one."""
    return 4 * max(1, k // 4) if path != "scalar" else (k if k % 4 else k + 1)


def cap_m(m, n, k):
    # NOTE: on the GPU profile the NumPy reference is the slow part; big M stays covered by smaller weights.
    return m if SIM else max(1, min(m, 2**33 // (n * k)))


PATHS = ["u64", "u64-view-given", "scalar"]


# ---------------------------------------------------------------------------------------------------------
# against the reference
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=pick(3, 15))
@given(seeds, sizes(9, [1, 2, 3, 4, 7, 8], 20), weight_shapes(9, 64), x_scales, w_scales,
       st.sampled_from(SMALL_CONFIGS), st.booleans())
def test_gemv(path, seed, m, nk, x_scale, w_scale, config, bf16_inputs):
    """Any M (9 and above take two chunks of x rows), odd N (partial blocks), the three weight paths."""
    n, k = nk
    k = path_k(path, k)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k, x_scale, w_scale)
    out = stale_out(m, n)
    gv.gemv(to_device(x), weight_for(path, w), out, config=config, bf16_inputs=bf16_inputs)
    check_gemv(out, x, w, bf16_inputs)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=pick(2, 15))
@given(seeds, sizes(9, [1, 2, 3, 4, 7, 8], 20), weight_shapes(6, 64), silu_x_scales, silu_w_scales,
       st.sampled_from(SMALL_CONFIGS), st.booleans())
def test_gemv_silu_mul(path, seed, m, nk, x_scale, w_scale, config, bf16_inputs):
    """The fused gate/up projection: weight [W_gate; W_up] (2I, K) -> silu(gate) * up (M, I)."""
    i, k = nk
    if not SIM:
        i = max(1, i // 2)  # the 1B gate_up weight is (16384, 2048): I = 8192
    k = path_k(path, k)
    m = cap_m(m, 2 * i, k)
    x, w = make_inputs(seed, m, 2 * i, k, x_scale, w_scale)
    out = stale_out(m, i)
    gv.gemv_silu_mul(to_device(x), weight_for(path, w), out, config=config, bf16_inputs=bf16_inputs)
    check_silu(out, x, w, bf16_inputs)


# Every value of every knob, each at least once away from the others' defaults: rows per warp 1, 2, 4 (and 8
# on the GPU); split_k 1, 2, 4 (8); unroll 1, 2, 4; warps per block 1, 2, 4 (8), with 2 row groups of a
# split; k_chunk below one step (rounded up to it), several steps per chunk, and more than K (one chunk).
KNOB_CONFIGS = [
    gv.GemvConfig(1, 1, 1, 1, 1),
    gv.GemvConfig(2, 1, 4, 2, 4096),
    gv.GemvConfig(4, 1, 1, 1, 256),
    gv.GemvConfig(1, 2, 1, 4, 128),
    gv.GemvConfig(2, 4, 1, 4, 4096),
    gv.GemvConfig(1, 4, 2, 4, 512),
    gv.GemvConfig(4, 2, 2, 2, 256),
] + ([] if SIM else [gv.GemvConfig(1, 8, 4, 8, 4096), gv.GemvConfig(8, 1, 1, 4, 512),   # 256-thread blocks:
                     gv.GemvConfig(4, 8, 1, 8, 512)])                                  # too slow to simulate


@pytest.mark.parametrize("config", KNOB_CONFIGS, ids=lambda c: "R%d-S%d-U%d-W%d-kc%d" % tuple(c))
def test_config_knobs(config):
    """Each config on gemv (fp32 inputs) and on gemv_silu_mul (bf16 inputs): M = 2, one output column more
    than a block's (two blocks, the second almost empty: clamped rows), K = 260 (65 words: several steps,
    and several chunks where k_chunk is small). On the GPU also the 1B down and QKV shapes."""
    rows_per_block = config.warps_per_block // config.split_k * config.rows_per_warp
    shapes = [(2, rows_per_block + 1, 260)] + ([] if SIM else [(8, 2048, 8192), (1, 3072, 2048)])
    for seed, (m, n, k) in enumerate(shapes):
        try:
            gv.gemv_plan(config, m, k, True, True)
        except ValueError:   # k_chunk too big for 8 rows of x at real K: stage one step at a time instead
            config = config._replace(k_chunk=1)
        x, w = make_inputs(seed, m, n, k)
        out = stale_out(m, n)
        gv.gemv(to_device(x), to_device(w), out, config=config)
        check_gemv(out, x, w)
        x, w = make_inputs(seed + 100, m, 2 * n, k)
        out = stale_out(m, n)
        gv.gemv_silu_mul(to_device(x), to_device(w), out, config=config, bf16_inputs=True)
        check_silu(out, x, w, bf16_inputs=True)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 11])
def test_every_m_tile_with_the_default_config(m):
    """M = 1, 2, 4 and 8 compile the four m tiles (with the launcher's rows per warp: 1, 1, 2, 4); 11 is two
    chunks (8 + 3 rows: a partial tile). The scalar path (K = 37) alongside, below M = 11 (simulator time)."""
    for k in (40,) if m > 8 else (40, 37):
        x, w = make_inputs(m * 100 + k, m, 5, k)   # N = 5: two blocks at R = 1, the second partial
        out = stale_out(m, 5)
        gv.gemv(to_device(x), to_device(w), out)
        check_gemv(out, x, w)


def test_bf16_inputs_round_x_to_nearest_even():
    """bf16 keeps 8 significant bits (spacing 2^-7 at 1): x = 1 + 2^-9 rounds to 1, and x = 1 + 3 * 2^-8, the
    midpoint of 1 + 2^-7 and 1 + 2^-6, to the even one, 1 + 2^-6. Against W = 1 every sum is exact, so the
    kernel must give K times the rounded x bit for bit, and K times x itself without bf16_inputs."""
    k = 8
    x = np.array([[1 + 2**-9] * k, [1 + 3 * 2**-8] * k], np.float32)
    w = f32_to_bf16(np.ones((3, k), np.float32))
    for bf16_inputs, row_values in ((True, [1.0, 1 + 2**-6]), (False, [1 + 2**-9, 1 + 3 * 2**-8])):
        out = stale_out(2, 3)
        gv.gemv(to_device(x), to_device(w), out, bf16_inputs=bf16_inputs)
        want = np.broadcast_to(np.float32(k) * np.float32(row_values)[:, None], (2, 3))
        np.testing.assert_array_equal(out.copy_to_host(), want)
        out = stale_out(2, 1)
        gv.gemv_silu_mul(to_device(x), to_device(w[:2]), out, bf16_inputs=bf16_inputs)
        check_silu(out, x, w[:2], bf16_inputs)


def test_split_k_is_deterministic_and_on_a_stream():
    """The split-K partials are added in a fixed order: the same launch twice gives the same bits."""
    m, n, k = pick((2, 5, 260), (8, 2048, 8192))
    x, w = make_inputs(7, m, n, k)
    config = gv.GemvConfig(1, 4, 1, 4, 128)
    dx, dw = to_device(x), to_device(w)
    stream = cuda.stream()
    results = []
    for _ in range(2):
        out = stale_out(m, n)
        gv.gemv(dx, dw, out, stream, config=config)
        stream.synchronize()
        results.append(out.copy_to_host())
    check_gemv(results[0], x, w)
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


# ---------------------------------------------------------------------------------------------------------
# NaN stays where it came from
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["gemv", "gemv_silu_mul"])
@settings(max_examples=pick(2, 5))
@given(seeds, st.integers(2, pick(9, 20)), weight_shapes(8, 20), st.sampled_from(SMALL_CONFIGS), st.data())
def test_nan_row_and_column_stay_confined(fused, seed, m, nk, config, data):
    """A NaN in one row of x poisons that output row only; a NaN in one W row, its output column only (for
    the fused kernel: a NaN gate row j or up row I + j poisons column j)."""
    n, k = nk
    if not SIM:
        n, k = min(n, 4096), min(k, 2048)
    n_out = max(n, 2)
    rows = 2 * n_out if fused else n_out
    x, w = make_inputs(seed, m, rows, k)
    bad_m, bad_n = data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, rows - 1))
    x[bad_m, data.draw(st.integers(0, k - 1))] = np.nan
    w[bad_n, data.draw(st.integers(0, k - 1))] = 0x7FC0  # a bf16 quiet NaN
    out = stale_out(m, n_out)
    (gv.gemv_silu_mul if fused else gv.gemv)(to_device(x), to_device(w), out, config=config)
    got = out.copy_to_host()
    poisoned = np.zeros((m, n_out), bool)
    poisoned[bad_m, :] = True
    poisoned[:, bad_n % n_out] = True
    assert np.isnan(got[poisoned]).all()
    assert not np.isnan(got[~poisoned]).any()
    (check_silu if fused else check_gemv)(got, x, w)


# ---------------------------------------------------------------------------------------------------------
# gemv_config: the launcher's choice
# ---------------------------------------------------------------------------------------------------------

def _step_cols(c, k):
    return (4 if k % 4 == 0 else 1) * 32 * c.split_k * c.unroll


@pytest.mark.parametrize("fused", [False, True], ids=["gemv", "fused"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 64])
@pytest.mark.parametrize("n, k", LLAMA_1B_WEIGHTS + [(8192, 2048), (1, 1), (7, 37), (5000, 3001)])
def test_gemv_config_is_valid_and_follows_its_rules(m, n, k, fused):
    c = gv.gemv_config(m, n, k, fused)
    assert c == gv.gemv_config(m, n, k, fused)  # a pure function
    mt = next(t for t in (1, 2, 4, 8) if t >= min(m, 8))
    reads = {1: 1, 2: 1, 4: 2, 8: 4}[mt]        # weight rows read per warp
    reads = max(reads, 2) if fused else reads
    assert c.rows_per_warp == (reads // 2 if fused else reads)
    assert c.unroll == {1: 4, 2: 2, 4: 1}[reads]
    assert c.split_k in (1, 2, 4, 8) and c.warps_per_block == max(4, c.split_k)
    step = _step_cols(c, k)
    assert c.k_chunk % step == 0 and c.k_chunk >= step
    assert c.k_chunk <= max(step, -(-k // step) * step)          # never more than K needs
    if c.k_chunk > step:                                         # more than one step only within the budget
        assert mt * c.k_chunk * 4 <= gv.XS_BUDGET
    gv.gemv_plan(c, m, k, k % 4 == 0, fused)                     # the launcher accepts it
    warps = -(-n // c.rows_per_warp) * c.split_k
    words = k // 4 if k % 4 == 0 else k
    if c.split_k > 1:   # split only as far as needed, and never below a whole step per warp
        assert warps // 2 < gv.TARGET_WARPS and c.split_k * 32 * c.unroll <= words
    if c.split_k < gv.MAX_SPLIT_K and warps < gv.TARGET_WARPS:   # why it stopped short of the target
        assert 2 * c.split_k * 32 * c.unroll > words or mt * 2 * step * 4 > gv.XS_BUDGET


def test_gemv_config_on_the_1b_shapes():
    """The choices the docstring promises for the shapes that matter (batch 1 and 8)."""
    c = gv.gemv_config
    assert c(1, 16384, 2048) == gv.GemvConfig(1, 1, 4, 4, 2048)      # gate_up: enough rows, whole K staged
    assert c(1, 128256, 2048) == gv.GemvConfig(1, 1, 4, 4, 2048)     # lm_head
    assert c(1, 3072, 2048) == gv.GemvConfig(1, 2, 4, 4, 2048)       # qkv: 3072 warps < 4224, split 2
    assert c(1, 2048, 2048) == gv.GemvConfig(1, 4, 4, 4, 2048)       # o: split 4 (one step per warp)
    assert c(1, 2048, 8192) == gv.GemvConfig(1, 4, 4, 4, 4096)       # down: split 4, x in two 16 KB chunks
    assert c(8, 2048, 8192) == gv.GemvConfig(4, 4, 1, 4, 512)        # M = 8: one 16 KB step of x per chunk
    assert c(8, 16384, 2048) == gv.GemvConfig(4, 2, 1, 4, 512)
    # the fused gate/up (I = 8192): a gate and an up row per warp at M = 1, two of each at M = 8
    assert c(1, 8192, 2048, fused=True) == gv.GemvConfig(1, 1, 2, 4, 2048)
    assert c(8, 8192, 2048, fused=True) == gv.GemvConfig(2, 2, 1, 4, 512)


# ---------------------------------------------------------------------------------------------------------
# launcher argument checks
# ---------------------------------------------------------------------------------------------------------

LAUNCHERS = [gv.gemv, gv.gemv_silu_mul]


def _args(m=3, n=6, k=8, x_dtype=np.float32, w_dtype=np.uint16, out_dtype=np.float32, out_shape=None, fused=False):
    return (device_empty((m, k), x_dtype), device_empty((n, k), w_dtype),
            device_empty(out_shape or (m, n // 2 if fused else n), out_dtype))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("args, match", [
    (lambda f: _args(x_dtype=np.float64, fused=f), r"x must be float32, got float64"),
    (lambda f: _args(w_dtype=np.float32, fused=f), r"weight must be uint16 bf16 bits \(or its uint64 view\)"),
    (lambda f: _args(out_dtype=np.float16, fused=f), r"out must be float32, got float16"),
    (lambda f: _args(out_shape=(3, 7), fused=f), r"out must have shape \(M, N(/ 2)?.*got \(3, 7\)"),
    (lambda f: (device_empty((3, 8), np.float32), device_empty((6, 7), np.uint16),
                device_empty((3, 6), np.float32)), r"x \(3, 8\) and weight \(6, 7\).*disagree on K \(8 vs 7\)"),
    (lambda f: (device_empty((3, 8), np.float32), device_empty((6, 1), np.uint64),
                device_empty((3, 6), np.float32)),
     r"x \(3, 8\) and weight \(6, 1\) \(uint64\) disagree on K \(8 vs 4\)"),
    (lambda f: (device_empty((8,), np.float32), device_empty((6, 8), np.uint16),
                device_empty((1, 6), np.float32)), r"x must be 2-D, got shape \(8,\)"),
])
def test_launcher_rejects_bad_arguments(launcher, args, match):
    with pytest.raises(ValueError, match=f"{launcher.__name__}: {match}"):
        launcher(*args(launcher is gv.gemv_silu_mul))


def test_fused_launcher_checks_its_shapes():
    with pytest.raises(ValueError, match=r"gemv_silu_mul: weight must be \[W_gate; W_up\] with an even"):
        gv.gemv_silu_mul(*_args(n=5, out_shape=(3, 2)))
    with pytest.raises(ValueError, match=r"gemv_silu_mul: out must have shape \(M, N / 2\) = \(3, 3\)"):
        gv.gemv_silu_mul(*_args(n=6, out_shape=(3, 6)))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_launcher_rejects_host_arrays(launcher):
    x, w, out = np.zeros((2, 8), np.float32), np.zeros((4, 8), np.uint16), device_empty((2, 4), np.float32)
    with pytest.raises(TypeError, match=f"{launcher.__name__}: x must be a numba device array"):
        launcher(x, to_device(w), out)
    with pytest.raises(TypeError, match=f"{launcher.__name__}: weight must be a numba device array"):
        launcher(to_device(x), w, out)


@pytest.mark.parametrize("config, match", [
    (gv.GemvConfig(1, 3, 1, 4, 128), r"warps_per_block a multiple of split_k"),
    (gv.GemvConfig(0, 1, 1, 4, 128), r"every field must be >= 1"),
    (gv.GemvConfig(1, 1, 1, 33, 128), r"at most 32"),
    (gv.GemvConfig(1, 1, 1, 4, 1 << 20), r"needs \d+ bytes of shared memory .* more than 49152"),
])
def test_launcher_rejects_bad_configs(config, match):
    x, w, out = device_empty((8, 1 << 16), np.float32), device_empty((4, 1 << 16), np.uint16), \
        device_empty((8, 4), np.float32)
    with pytest.raises(ValueError, match=r"gemv: config GemvConfig.*" + match):
        gv.gemv(x, w, out, config=config)


def test_empty_shapes_launch_nothing():
    """M = 0 or N = 0: nothing to write (and no zero-sized grid)."""
    gv.gemv(device_empty((0, 8), np.float32), device_empty((4, 8), np.uint16), device_empty((0, 4), np.float32))
    gv.gemv_silu_mul(device_empty((2, 8), np.float32), device_empty((0, 8), np.uint16),
                     device_empty((2, 0), np.float32))
