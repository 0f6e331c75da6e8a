"""cuda_kernels/gemv_tc.py (the tensor-core GEMV) against reference/matmul.py.

x's bf16 plane comes from reference.matmul.bf16_planes (what bf16_planes or the rmsnorm writes in the engine),
so the expected result is the reference on x rounded to bf16. Each configuration is checked on shapes that
cut its work unevenly: weight rows not a multiple of a block's, M not a multiple of 8 (x rows padded with
zeros), K over fewer chunks than a pass or several passes, |x| up to 3e15; the gated epilogues against
gated_matmul, the bf16-plane output bit for bit against the float32 one of the same kernel, and a second
launch bit-identical (the K parts are added in part order). Configurations with several row tiles a warp
(row_tiles > 1) run every epilogue too, and once more on one fixed odd shape (M odd, weight rows not a
multiple of a row group's 16 * row_tiles and over two blocks, K an odd number of chunks). The tail that the K
parts share (k_warps > 1) runs every epilogue and KV format in drawn configurations at M up to 64, and one test
pins its sums to part order bit for bit (exact parts whose sum depends on the order).
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, pick, to_device
from test_matmul_kernels import (ROPE_FORMATS, check, check_gated, check_rope, make_inputs, rope_case, rope_formats,
                                 seeds, stale_out, x_scales)

from cuda_kernels import gemv_tc as gt
from cuda_kernels import matmul as mm
from cuda_kernels import matmul_policy as mp
from reference.bf16 import f32_to_bf16
from reference.matmul import bf16_planes as reference_bf16_planes

# (k_warps, row_warps, unroll, pipelined, row_tiles): one part; K split over warps, pipelined; two row groups
# a block of two row tiles each (64 rows a block); three row tiles a warp, K split, pipelined (the parts
# reduced one tile after another). On the GPU the same kinds at real sizes, two and four row tiles.
CONFIGS = ([gt.GemvTcConfig(1, 1, 1, False), gt.GemvTcConfig(2, 1, 1, True), gt.GemvTcConfig(2, 2, 2, False, 2),
            gt.GemvTcConfig(2, 1, 1, True, 3)]
           if SIM else [gt.GemvTcConfig(4, 1, 4, False), gt.GemvTcConfig(4, 2, 2, True),
                        gt.GemvTcConfig(8, 1, 2, True), gt.GemvTcConfig(2, 2, 8, False),
                        gt.GemvTcConfig(8, 1, 2, False, 2), gt.GemvTcConfig(4, 1, 1, True, 4)])
ms = st.integers(1, pick(20, 64))
rows = st.integers(1, pick(40, 5000))
chunks = st.integers(1, pick(3, 260))   # K = 32 * chunks
# (Hq, Hkv, head_dim) of the RoPE epilogue's QKV weight: (Hq + 2 Hkv) d rows, a multiple of 16 or not
rope_heads = st.sampled_from([(2, 1, 8), (3, 1, 8)] if SIM else [(32, 8, 64), (3, 1, 40)])


def planes_of(x):
    """x's bf16 plane as the engine's workspace holds it: flat uint16, padded to a multiple of 4 elements."""
    flat = reference_bf16_planes(x, True).ravel()
    return to_device(np.concatenate([flat, np.full(-flat.size % 4, 0xFFFF, np.uint16)]))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=examples(3, 6))
@given(seeds, ms, rows, chunks, x_scales)
def test_gemv_tc(config, seed, m, n, c, x_scale):
    """out = bf16(x) @ W^T within the summation tolerance; a second launch gives the same bits."""
    k = 32 * c
    x, w = make_inputs(seed, m, n, k, x_scale)
    planes, dw = planes_of(x), to_device(w)
    out = stale_out(m, n)
    gt.gemv_tc(planes, m, dw, out, config=config)
    check(out, x, w, bf16_inputs=True)
    again = stale_out(m, n)
    gt.gemv_tc(planes, m, dw, again, config=config)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint32), again.copy_to_host().view(np.uint32))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=examples(2, 5))
@given(seeds, ms, st.integers(1, pick(20, 3000)), chunks, x_scales)
def test_gemv_tc_gated(config, seed, m, f, c, x_scale):
    """silu(x @ gate^T) * (x @ up^T) for W = [gate; up] (2F rows, F not a multiple of a block's 8 features a
    row tile); the bf16-plane output is exactly the rounding of the same kernel's float32 output."""
    k = 32 * c
    x, w = make_inputs(seed, m, 2 * f, k, x_scale)
    planes, dw = planes_of(x), to_device(w)
    out = stale_out(m, f)
    gt.gemv_tc(planes, m, dw, out, config=config, gated=True)
    check_gated(out, x, w, bf16_inputs=True)
    act = to_device(np.full((m, f), 0xBEEF, np.uint16))
    gt.gemv_tc(planes, m, dw, act, config=config, gated=True)
    np.testing.assert_array_equal(act.copy_to_host(), f32_to_bf16(out.copy_to_host()))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@settings(max_examples=examples(2, 4))
@given(seeds, ms, rope_formats, rope_heads)
def test_gemv_tc_rope(config, seed, m, fmt, heads):
    """The QKV projection with RoPE and the KV-cache write as its epilogue, in each cache format: rotated q,
    and rotated K and V in the cache slots (one token's slot -1: not written), as rope_kv_write after the
    product."""
    run_rope(seed, m, heads, pick(32, 2048), fmt, config)


def run_rope(seed, m, heads, k, fmt, config):
    """gemv_tc_rope on a rope_case, checked by check_rope (q, and K and V in the cache)."""
    x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, k, 16, fmt)
    q_out = to_device(np.full((m, heads[0], heads[2]), -7777.0, np.float32))
    k_dev, v_dev = to_device(cache), to_device(cache)
    gt.gemv_tc_rope(planes_of(x), m, to_device(w), to_device(positions), to_device(cos), to_device(sin), k_dev,
                    v_dev, to_device(slots), q_out, config=config, k_scale=fmt[1], v_scale=fmt[2])
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], True, fmt)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.row_tiles > 1], ids=lambda c: "-".join(map(str, c)))
def test_gemv_tc_row_tiles_odd_shape(config):
    """Each epilogue with several row tiles a warp on a shape hypothesis might not draw: M = 13, K = 3 chunks
    and weight rows (70 plain, 2 x 35 gated, 72 QKV rows) that end inside a second block's row tiles, so a
    row group at the wrong rows or a tile's result at the wrong columns leaves an output unwritten or wrong."""
    m, k = 13, 32 * 3
    x, w = make_inputs(7, m, 70, k)
    out = stale_out(m, 70)
    gt.gemv_tc(planes_of(x), m, to_device(w), out, config=config)
    check(out, x, w, bf16_inputs=True)
    x, w = make_inputs(8, m, 2 * 35, k)
    out = stale_out(m, 35)
    gt.gemv_tc(planes_of(x), m, to_device(w), out, config=config, gated=True)
    check_gated(out, x, w, bf16_inputs=True)
    heads = (7, 1, 8)   # (7 + 2) x 8 = 72 rows: 36 pairs, the last row tiles past them
    x, w, cos, sin, positions, slots, cache = rope_case(9, m, heads, k, 16)
    q_out, k_dev, v_dev = to_device(np.full((m, 7, 8), -7777.0, np.float32)), to_device(cache), to_device(cache)
    gt.gemv_tc_rope(planes_of(x), m, to_device(w), to_device(positions), to_device(cos), to_device(sin), k_dev,
                    v_dev, to_device(slots), q_out, config=config)
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], True)


# The spread tail (k_warps > 1, each part adds and stores its half tiles): whole configurations drawn, so that
# the 2 NT half tiles (16 at M = 64) fall on the parts in every way: k_warps 2 (an even split), 3 (a part's share
# crosses n8 tiles) and 5 (more parts than the 4 half tiles at M <= 16: a part with none), with one or two row
# groups a block and row tiles a warp (the parts reduced tile after tile through one buffer), pipelined or not.
spread_configs = st.builds(gt.GemvTcConfig, st.sampled_from(pick([2, 3, 5], [2, 3, 5, 8])), st.integers(1, 2),
                           st.integers(1, pick(1, 4)), st.booleans(), st.integers(1, pick(2, 4)))
# every epilogue, the RoPE one in each KV format (ROPE_FORMATS' distinct entries)
SPREAD_EPILOGUES = [("plain", None), ("gated", None)] + [("rope", f) for f in dict.fromkeys(ROPE_FORMATS)]


@pytest.mark.parametrize("epilogue", SPREAD_EPILOGUES, ids=lambda e: f"{e[0]}-{e[1][0]}" if e[1] else e[0])
@settings(max_examples=examples(4, 4))
@given(seeds, spread_configs, st.integers(1, 8 * gt.MAX_NT), st.integers(1, pick(3, 100)))
@example(1, gt.GemvTcConfig(3, 1, 1, True, 2), 8 * gt.MAX_NT, 3)   # always: 16 half tiles over 3 parts, 2 row tiles
@example(2, gt.GemvTcConfig(5, 2, 1, False, 2), 13, 2)              # and 4 half tiles over 5 parts
def test_gemv_tc_spread_tail(epilogue, seed, config, m, c):
    """Each epilogue with the K parts' tail spread over the parts, at any M up to 64 (2, 4 or 8 n8 tiles):
    plain and gated against the reference (gated_planes bit for bit the rounding of gated), rope's q and K/V
    cache writes against rope_kv_write after the product; a half tile given to no part, or to two, or a part
    left out of a sum, leaves a stale or wrong output."""
    assume(gt.reduction_bytes(config, gt.n_tiles(m)) <= gt.SHARED_LIMIT)   # GPU: 8 parts x 2 row groups at M > 32
    kind, fmt = epilogue
    k = 32 * c
    if kind == "rope":
        run_rope(seed, m, pick((3, 1, 8), (5, 1, 64)), k, fmt, config)
        return
    gated = kind == "gated"
    n = pick(37, 3001) * (2 if gated else 1)   # odd (features, gated): the last row tile partial in any configuration
    x, w = make_inputs(seed, m, n, k)
    planes, dw = planes_of(x), to_device(w)
    out = stale_out(m, n // 2 if gated else n)
    gt.gemv_tc(planes, m, dw, out, config=config, gated=gated)
    if not gated:
        check(out, x, w, bf16_inputs=True)
        return
    check_gated(out, x, w, bf16_inputs=True)
    act = to_device(np.full((m, n // 2), 0xBEEF, np.uint16))
    gt.gemv_tc(planes, m, dw, act, config=config, gated=True)
    np.testing.assert_array_equal(act.copy_to_host(), f32_to_bf16(out.copy_to_host()))


@pytest.mark.parametrize("config", [gt.GemvTcConfig(3, 1, 1, False), gt.GemvTcConfig(5, 2, 1, True, 2)],
                         ids=lambda c: "-".join(map(str, c)))
def test_gemv_tc_parts_added_in_part_order(config):
    """Every part adds a half tile's parts in part order 0, 1, 2, .., so the bits do not depend on which part
    does it. K is one chunk a part (part p: chunk p) and each output's parts are exact: 2^25, -2^25, then small
    products s_p (|s_p| <= 3). In part order the first two cancel and the result is exactly the sum of the s_p;
    any other order rounds an s_p at 2^25 (whose ulp is 4), a part counted twice keeps a 2^25 and one left out
    loses its s_p. M = 64 (16 half tiles: every part has several), 40 weight rows (the last row tile partial)."""
    m, n, kw = 8 * gt.MAX_NT, 40, config.k_warps
    rng = np.random.default_rng(0)
    x, w = np.zeros((m, 32 * kw), np.float32), np.zeros((n, 32 * kw), np.float32)
    x[:, 0] = x[:, 32] = 1.0
    w[:, 0], w[:, 32] = 2.0 ** 25, -(2.0 ** 25)
    x[:, 64::32] = rng.choice([-1.0, 1.0], (m, kw - 2))
    w[:, 64::32] = rng.choice([-3.0, -1.0, 1.0, 2.0, 3.0], (n, kw - 2))
    out = stale_out(m, n)
    gt.gemv_tc(planes_of(x), m, to_device(f32_to_bf16(w)), out, config=config)
    want = (x[:, 64::32, None] * w[:, 64::32].T[None]).sum(axis=1)   # small integers: exact in any order
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_gemv_tc_arguments():
    """The launcher names what is wrong: K not a multiple of 32, too many rows, a short workspace, an odd
    gated weight, an out of the wrong type or shape."""
    x, w = make_inputs(0, 4, 16, 64)
    planes, dw = planes_of(x), to_device(w)
    with pytest.raises(ValueError, match="K % 32"):
        gt.gemv_tc(planes, 4, to_device(make_inputs(0, 4, 16, 40)[1]), stale_out(4, 16))
    with pytest.raises(ValueError, match="m must be"):
        gt.gemv_tc(to_device(np.zeros(65 * 64, np.uint16)), 65, dw, stale_out(65, 16))
    with pytest.raises(ValueError, match="planes must be"):
        gt.gemv_tc(planes, 8, dw, stale_out(8, 16))
    with pytest.raises(ValueError, match="even number"):
        gt.gemv_tc(planes, 4, to_device(make_inputs(0, 4, 15, 64)[1]), stale_out(4, 7), gated=True)
    with pytest.raises(ValueError, match="out must be"):
        gt.gemv_tc(planes, 4, dw, to_device(np.zeros((4, 16), np.uint16)))
    with pytest.raises(ValueError, match="out must be"):
        gt.gemv_tc(planes, 4, dw, stale_out(4, 16), gated=True)


def test_gemv_tc_configs_that_do_not_fit():
    """A configuration whose K-part reduction is over SHARED_LIMIT at the batch's n8 tiles, whose block is over
    1024 threads or that has a count below 1 is refused with a message saying which; row tiles take no shared
    memory (their parts are reduced one tile after another through the same buffer), so only their register
    cost, not a refusal, bounds them."""
    x, w = make_inputs(0, 64, 16, 64)
    planes, dw = planes_of(x), to_device(w)
    fits = gt.GemvTcConfig(12, 1, 1, False, 8)   # 12 parts x 32 accumulators x 32 lanes x 4 bytes: 48 KB
    assert gt.reduction_bytes(fits, gt.MAX_NT) == gt.SHARED_LIMIT == gt.reduction_bytes(fits._replace(row_tiles=1), 8)
    gt.check_config(fits, gt.MAX_NT)
    with pytest.raises(ValueError, match="K-part reduction.*SHARED_LIMIT"):
        gt.gemv_tc(planes, 64, dw, stale_out(64, 16), config=gt.GemvTcConfig(8, 2, 1, False, 2))
    gt.check_config(gt.GemvTcConfig(8, 2, 1, False, 2), gt.n_tiles(32))   # the same at M = 32: 32 KB
    with pytest.raises(ValueError, match="threads a block"):
        gt.check_config(gt.GemvTcConfig(16, 4, 1), 2)
    with pytest.raises(ValueError, match="at least 1"):
        gt.gemv_tc(planes, 64, dw, stale_out(64, 16), config=gt.GemvTcConfig(4, 1, 2, False, 0))


def test_n_tiles_cover_m():
    """The compiled n8 tile counts cover every M up to the maximum with at most one tile count of slack."""
    for m in range(1, 8 * gt.MAX_NT + 1):
        nt = gt.n_tiles(m)
        assert 8 * nt >= m and nt in (2, 4, gt.MAX_NT)


@settings(max_examples=examples(2, 4))
@given(seeds, st.integers(pick(1, 9), mp.GEMV_TC_MAX_M))
def test_engine_entry_points_take_gemv_tc(seed, m):
    """matmul, gated_matmul, mlp and matmul_rope_kv_write with bf16 inputs and a planes workspace run gemv_tc
    at decode batches (in
    the simulator once GEMV_TC_IN_ENGINE is switched on): each against the reference; mlp passes act from the
    gated gemv_tc to the down gemv_tc as a bf16 plane; planes_ready reads the workspace, not x."""
    n, f, k = pick((40, 24, 64), (3072, 1536, 2048))   # weights gemv_tc serves (matmul_policy.GEMV_TC_MAX_WEIGHT)
    x, w = make_inputs(seed, m, n, k)
    gate_up, down = make_inputs(seed + 1, 1, 2 * f, k)[1], make_inputs(seed + 2, 1, k, f)[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mp, "GEMV_TC_IN_ENGINE", True)
        if SIM:   # the policy's 256-thread blocks cost seconds a launch there: a 64-thread configuration
            small = gt.GemvTcConfig(2, 1, 1)
            patch.setattr(mp, "GEMV_TC_CONFIGS", {nt: (small, small) for nt in mp.GEMV_TC_CONFIGS})
        assert mp.uses_gemv_tc(m, n, k, True) and not mp.uses_gemv_tc(m, n, k, False)
        assert not mp.uses_gemv_tc(mp.GEMV_TC_MAX_M + 1, n, k, True)
        workspace = device_empty(m * max(k, f), np.uint16)
        out = stale_out(m, n)
        mm.matmul(to_device(x), to_device(w), out, bf16_inputs=True, workspace=workspace)
        check(out, x, w, bf16_inputs=True)
        poisoned = to_device(np.full((m, k), np.nan, np.float32))   # planes_ready: x itself is not read
        out = stale_out(m, n)
        mm.matmul(poisoned, to_device(w), out, bf16_inputs=True, workspace=workspace, planes_ready=True)
        check(out, x, w, bf16_inputs=True)
        act = stale_out(m, f)
        mm.gated_matmul(to_device(x), to_device(gate_up), act, None, bf16_inputs=True, workspace=workspace)
        check_gated(act, x, gate_up, bf16_inputs=True)
        out = stale_out(m, k)
        mm.mlp(to_device(x), to_device(gate_up), to_device(down), out, stale_out(m, f), None, bf16_inputs=True,
               workspace=workspace, act_planes=device_empty((m, f), np.uint16))
        # the down product of the same kernel's act (gated_matmul's, above): its bf16 plane is what down reads
        check(out, act.copy_to_host(), down, bf16_inputs=True)
        heads, k = pick(((2, 1, 8), 64), ((32, 8, 64), 2048))
        x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, k, 16)
        q_out, k_dev, v_dev = device_empty((m, heads[0], heads[2]), np.float32), to_device(cache), to_device(cache)
        mm.matmul_rope_kv_write(to_device(x), to_device(w), to_device(positions), to_device(cos), to_device(sin),
                                k_dev, v_dev, to_device(slots), q_out, None, bf16_inputs=True,
                                workspace=device_empty(m * k, np.uint16))
        check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], True)
