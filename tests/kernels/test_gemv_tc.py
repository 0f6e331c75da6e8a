"""cuda_kernels/gemv_tc.py (the tensor-core GEMV) against reference/matmul.py.

x's bf16 plane comes from reference.matmul.bf16_planes (what bf16_planes or the rmsnorm writes in the engine),
so the expected result is the reference on x rounded to bf16. Each configuration is checked on shapes that
cut its work unevenly: weight rows not a multiple of a block's, M not a multiple of 8 (x rows padded with
zeros), K over fewer chunks than a pass or several passes, |x| up to 3e15; the gated epilogues against
gated_matmul, the bf16-plane output bit for bit against the float32 one of the same kernel, and a second
launch bit-identical (the K parts are added in part order).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, pick, to_device
from test_matmul_kernels import (check, check_gated, check_rope, make_inputs, rope_case, rope_formats, seeds,
                                 stale_out, x_scales)

from cuda_kernels import gemv_tc as gt
from cuda_kernels import matmul as mm
from reference.bf16 import f32_to_bf16
from reference.matmul import bf16_planes as reference_bf16_planes

# (k_warps, row_warps, unroll, pipelined): one part, K split over warps, two row tiles a block, pipelined
CONFIGS = ([gt.GemvTcConfig(1, 1, 1, False), gt.GemvTcConfig(2, 1, 1, True), gt.GemvTcConfig(2, 2, 2, False)]
           if SIM else [gt.GemvTcConfig(4, 1, 4, False), gt.GemvTcConfig(4, 2, 2, True),
                        gt.GemvTcConfig(8, 1, 2, True), gt.GemvTcConfig(2, 2, 8, False)])
ms = st.integers(1, pick(20, 64))
rows = st.integers(1, pick(40, 5000))
chunks = st.integers(1, pick(3, 260))   # K = 32 * chunks


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
@given(seeds, ms, rope_formats)
def test_gemv_tc_rope(config, seed, m, fmt):
    """The QKV projection with RoPE and the KV-cache write as its epilogue, in each cache format: rotated q,
    and rotated K and V in the cache slots (one token's slot -1: not written), as rope_kv_write after the
    product."""
    heads, k = pick(((2, 1, 8), 32), ((32, 8, 64), 2048))
    x, w, cos, sin, positions, slots, cache = rope_case(seed, m, heads, k, 16, fmt)
    q_out = to_device(np.full((m, heads[0], heads[2]), -7777.0, np.float32))
    k_dev, v_dev = to_device(cache), to_device(cache)
    gt.gemv_tc_rope(planes_of(x), m, to_device(w), to_device(positions), to_device(cos), to_device(sin), k_dev,
                    v_dev, to_device(slots), q_out, config=config, k_scale=fmt[1], v_scale=fmt[2])
    check_rope(q_out, k_dev, v_dev, x, w, cos, sin, positions, slots, cache, heads[0], True, fmt)


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


def test_n_tiles_cover_m():
    """The compiled n8 tile counts cover every M up to the maximum with at most one tile count of slack."""
    for m in range(1, 8 * gt.MAX_NT + 1):
        nt = gt.n_tiles(m)
        assert 8 * nt >= m and nt in (2, 4, gt.MAX_NT)


@settings(max_examples=examples(2, 4))
@given(seeds, st.integers(pick(1, 9), mm.GEMV_TC_MAX_M))
def test_engine_entry_points_take_gemv_tc(seed, m):
    """matmul, gated_matmul, mlp and matmul_rope_kv_write with bf16 inputs and a planes workspace run gemv_tc
    at decode batches (in
    the simulator once GEMV_TC_IN_ENGINE is switched on): each against the reference; mlp passes act from the
    gated gemv_tc to the down gemv_tc as a bf16 plane; planes_ready reads the workspace, not x."""
    n, f, k = pick((40, 24, 64), (3072, 1536, 2048))   # weights gemv_tc serves (matmul.GEMV_TC_MAX_WEIGHT)
    x, w = make_inputs(seed, m, n, k)
    gate_up, down = make_inputs(seed + 1, 1, 2 * f, k)[1], make_inputs(seed + 2, 1, k, f)[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mm, "GEMV_TC_IN_ENGINE", True)
        if SIM:   # the policy's 256-thread blocks cost seconds a launch there: a 64-thread configuration
            small = gt.GemvTcConfig(2, 1, 1)
            patch.setattr(mm, "GEMV_TC_CONFIGS", {nt: (small, small) for nt in mm.GEMV_TC_CONFIGS})
        assert mm.uses_gemv_tc(m, n, k, True) and not mm.uses_gemv_tc(m, n, k, False)
        assert not mm.uses_gemv_tc(mm.GEMV_TC_MAX_M + 1, n, k, True)
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
