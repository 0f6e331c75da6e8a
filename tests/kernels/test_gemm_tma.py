"""The bulk tensor copy (cuda_kernels/tma.py) and the warp-specialized GEMM built on it (cuda_kernels/gemm_tma.py)
against reference/, in the simulator (emulated copies and barriers, tiny shapes) and on a GPU of compute
capability 9.0.

The copy is checked box by box: the shared image must be the swizzled layout wgmma reads, zeros outside the
array. The GEMM as gemm_wgmma is (test_wgmma.py): bf16(x) @ W^T within the fp32 summation tolerance, partial
tiles along M, N and K, more slabs than stages (each stage loaded again once the consumers free it), the gated
and planes-out epilogues, K split over blocks; and a plane inside a larger buffer, whose rows past M (which the
tensor map covers) hold NaN.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, pick, sizes, to_device
from test_matmul_kernels import cap_m, check, check_gated, gated_shapes, make_inputs, stale_out, weight_shapes
from test_wgmma import check_split_entry_points, check_split_k
from tests_support import LLAMA_1B_MATMULS

from cuda_kernels import gemm_pipelined as gp
from cuda_kernels import gemm_tma as gt
from cuda_kernels import matmul_policy as mp
from cuda_kernels import tma, wgmma
from cuda_kernels.split_k import valid_splits

pytestmark = pytest.mark.skipif(not SIM and not wgmma.device_has_wgmma(), reason="TMA needs compute capability 9.0")
seeds = st.integers(0, 2**32 - 1)


@settings(max_examples=examples(6, 20))
@given(seeds, st.integers(1, 80), st.integers(1, 20), st.sampled_from([8, 16, 64]), st.data())
def test_load_box_is_the_swizzled_box_with_zeros_outside(seed, rows, cols8, box_rows, data):
    """One box of a (rows, 8 * cols8) array at a random corner, inside, across an edge or wholly outside: the
    shared image holds wgmma's swizzled layout of the array's values there and zeros elsewhere."""
    cols = 8 * cols8
    row0 = data.draw(st.integers(0, rows + 8))
    k0 = data.draw(st.sampled_from([0, 64, 128]))
    array = np.random.default_rng(seed).integers(0, 1 << 16, (rows, cols), dtype=np.uint16)
    out = device_empty(box_rows * tma.BOX_K, np.uint16)
    tma.load_box(to_device(array.ravel()), rows, cols, box_rows, k0, row0, out)
    box = np.zeros((box_rows, tma.BOX_K), np.uint16)
    part = array[row0:row0 + box_rows, k0:k0 + tma.BOX_K]
    box[:part.shape[0], :part.shape[1]] = part
    np.testing.assert_array_equal(out.copy_to_host(), wgmma.swizzle_tile(box))


def test_tensor_map_rejects_what_the_copy_cannot_address():
    words = device_empty(64 * 24, np.uint16)
    for rows, cols, box_rows in ((64, 20, 8), (65, 24, 8), (64, 24, 12), (64, 24, 512)):
        with pytest.raises(ValueError, match="tensor_map"):
            tma.tensor_map(words, rows, cols, box_rows)
    with pytest.raises(ValueError, match="uint16"):
        tma.tensor_map(device_empty(64 * 24, np.float32), 64, 24, 8)


# tiles: the simulator's (one consumer warpgroup, narrow) and a two-stage one; on the GPU the benchmark's candidates
TMA_TILES = pick([gt.SIM_TILE, gt.TmaTile(64, 16, 2)],
                 [gt.TmaTile(), gt.TmaTile(128, 256, 3), gt.TmaTile(128, 128, 6), gt.TmaTile(256, 128, 4),
                  gt.TmaTile(64, 256, 5), gt.TmaTile(64, 128, 8)])
tile_ids = {"ids": lambda t: "x".join(map(str, t))}


def plane_of(x, extra_rows: int = 0):
    """x's bf16 plane at the start of an allocation with extra_rows more rows of NaN: a slice of it holding the
    first half of those rows, the rest past the slice's end (the engine's planes buffer is carved from a larger
    allocation, to whose end x's map reaches)."""
    m, k = x.shape
    allocation = to_device(np.full((m + extra_rows) * k, 0x7FC0, np.uint16))
    gp.bf16_planes(to_device(x), allocation, bf16_inputs=True)
    return allocation[:(m + extra_rows // 2) * k]


@pytest.mark.parametrize("tile", TMA_TILES, **tile_ids)
@settings(max_examples=examples(2, 8))
@given(seeds, sizes(70, [64, 300, 1024], 1100), weight_shapes(40, 260), st.integers(0, 3))
def test_gemm_tma(tile, seed, m, nk, extra):
    """Partial block tiles along M and N, K short of a slab, one slab or more slabs than stages; the plane inside
    an allocation whose next rows are NaN (read by the map, never reaching a stored output); every output
    written."""
    n, k = nk
    k = 8 * -(-k // 8)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    out = stale_out(m, n)
    gt.gemm_tma(plane_of(x, 16 * extra), m, to_device(w), out, tile=tile)
    check(out, x, w, bf16_inputs=True)


@pytest.mark.parametrize("tile", TMA_TILES, **tile_ids)
@settings(max_examples=examples(2, 6))
@given(seeds, sizes(70, [64, 300, 1024], 1100), gated_shapes, st.sampled_from([1.0, 3e15]))
def test_gemm_tma_gated(tile, seed, m, fk, x_scale):
    """SiLU*mul over the gate and up boxes of each block's features; F not a multiple of BN / 2."""
    f, k = fk
    k = 8 * -(-k // 8)
    m = cap_m(m, 2 * f, k)
    x, w = make_inputs(seed, m, 2 * f, k, x_scale)
    out = stale_out(m, f)
    gt.gemm_tma(plane_of(x), m, to_device(w), out, tile=tile, gated=True)
    check_gated(out, x, w, bf16_inputs=True)


def split_workspace(tile, m, n, splits):
    """(partials, counters) for a split launch: partials poisoned with NaN, counters zero."""
    partials = to_device(np.full(max(1, gt.split_partials_size(tile, m, n, splits)), np.nan, np.float32))
    return partials, to_device(np.zeros(gt.tiles(tile, m, n), np.int32))


@pytest.mark.parametrize("tile", pick([gt.SIM_TILE], [gt.TmaTile(64, 128, 8), gt.TmaTile(128, 128, 6)]), **tile_ids)
@pytest.mark.parametrize("epilogue", ["plain", "gated", "planes"])
@settings(max_examples=examples(2, 4))
@given(seeds, sizes(20, [16, 64, 129, 256], 256), st.integers(1, pick(24, 3000)), st.integers(1, pick(4, 40)),
       st.data())
def test_gemm_tma_split_k(tile, epilogue, seed, m, n, slabs, data):
    """K split over gridDim.z blocks per tile, the producer warp taking part in the meeting's barriers: the result
    within the summation tolerance, bit-identical on a second launch, the counters zero again, and the planes
    epilogue exactly bf16 of the float32 result."""
    check_split_k(gt.gemm_tma, split_workspace, tile, epilogue, seed, m, n, slabs, data)


def test_tma_plans():
    """matmul_policy.tma_plan: at prefill sizes tma_tile's tile over the whole K; at decode sizes from 129 rows the
    wide tile unsplit for a weight of enough column tiles (gate/up, the LM head), else the first decode tile whose
    rows cover M, with splits as TMA_DECODE_SPLITS says for its rows and none empty or short, which
    split_workspace_sizes covers for the 1B model's weights."""
    partials, counters = mp.split_workspace_sizes(LLAMA_1B_MATMULS, True)
    assert mp.tma_plan(1024, 16384, 2048) == (mp.tma_tile(1024, 16384), 1) == (gt.TmaTile(256, 128, 4), 1)
    assert mp.tma_plan(1024, 2048, 2048) == (gt.TmaTile(128, 128, 6), 1)   # 256-row tiles: 64 blocks, too few
    for n, k, _ in LLAMA_1B_MATMULS:
        for m in range(mp.wgmma_split_min_m(n, k), mp.WGMMA_MIN_M):
            tile, splits = mp.tma_plan(m, n, k)
            if m >= mp.TMA_DECODE_WIDE_MIN_M and n in (16384, 128256):   # gate/up, LM head: 128, 1,002 wide tiles
                assert (tile, splits) == (mp.TMA_DECODE_WIDE_TILE, 1)
                continue
            assert tile == mp.TMA_DECODE_TILES[min(r for r in mp.TMA_DECODE_TILES if r >= m)]
            slabs, tiles = -(-k // 64), gt.tiles(tile, m, n)
            assert splits in valid_splits(slabs)
            blocks, min_slabs = mp.TMA_DECODE_SPLITS[min(r for r in mp.TMA_DECODE_TILES if r >= m)]
            assert splits == 1 or slabs // splits >= min_slabs
            assert splits == 1 or tiles * (splits - 0.5) <= blocks
            assert splits == 1 or (gt.split_partials_size(tile, m, n, splits) <= partials and tiles <= counters)
    assert mp.tma_plan(64, 2048, 8192) == (gt.TmaTile(64, 128, 8), 4)     # down: 16 tiles x 4 splits of 32 slabs
    assert mp.tma_plan(128, 3072, 2048) == (gt.TmaTile(128, 128, 6), 4)   # QKV: 24 tiles x 4 splits of 8 slabs
    assert mp.tma_plan(17, 2048, 2048) == (gt.TmaTile(64, 128, 8), 2)     # O from TMA_DECODE_MIN_M rows
    assert mp.tma_plan(128, 16384, 2048) == (gt.TmaTile(128, 128, 6), 1)  # gate/up: 128 tiles, no split
    assert mp.tma_plan(129, 16384, 2048) == (gt.TmaTile(256, 128, 4), 1)  # the wide tile: 128 blocks
    assert mp.tma_plan(256, 2048, 8192) == (gt.TmaTile(128, 128, 6), 4)   # down: 16 wide tiles would be too few


def test_entry_points_take_the_tma_decode_plan(monkeypatch):
    """With gemm_tma for decode switched on (TMA_DECODE_IN_ENGINE, as TINYVLLM_TMA_DECODE=1 on a GPU of compute
    capability 9.0), matmul and gated_matmul given a split workspace send decode rows to gemm_tma with K split:
    each result within the summation bounds, the counters zero afterwards."""
    for name in ("WGMMA_IN_ENGINE", "WGMMA_SPLIT_IN_ENGINE", "TMA_IN_ENGINE", "TMA_DECODE_IN_ENGINE"):
        monkeypatch.setattr(mp, name, True)
    monkeypatch.setattr(wgmma, "device_has_wgmma", lambda: True)
    if SIM:   # one block tile of rows (a simulated block costs seconds)
        monkeypatch.setattr(mp, "TMA_DECODE_TILES", {mp.WGMMA_MIN_M - 1: gt.SIM_TILE})
        monkeypatch.setattr(mp, "TMA_DECODE_MIN_M", 9)
    m, n, f, k, calls = check_split_entry_points(monkeypatch, gt, "gemm_tma", with_mlp=False)
    plans = [mp.tma_plan(m, n, k)[1], mp.tma_plan(m, 2 * f, k)[1]]
    assert calls == plans and min(plans) > 1


def test_gemm_tma_rejects_bad_arguments():
    x, w = make_inputs(0, 4, 16, 128)
    plane, dw = plane_of(x), to_device(w)
    with pytest.raises(ValueError, match="multiple of 8"):
        gt.gemm_tma(device_empty(4 * 12, np.uint16), 4, to_device(w[:, :12].copy()), stale_out(4, 16))
    with pytest.raises(ValueError, match="out must be"):
        gt.gemm_tma(plane, 4, dw, stale_out(4, 5))
    for tile in (gt.TmaTile(32, 16, 2), gt.TmaTile(64, 12, 2), gt.TmaTile(64, 16, 1), gt.TmaTile(320, 16, 2),
                 gt.TmaTile(256, 256, 4)):   # (the last: 263 KB of stages)
        with pytest.raises(ValueError, match="gemm_tma tile"):
            gt.gemm_tma(plane, 4, dw, stale_out(4, 16), tile=tile)
    with pytest.raises(ValueError, match=r"2 splits need split_workspace"):
        gt.gemm_tma(plane, 4, dw, stale_out(4, 16), splits=2)


@pytest.mark.skipif(SIM, reason="the simulator has no CUDA graphs")
def test_a_tensor_map_first_needed_inside_a_capture_is_a_clear_error():
    """A map is copied to the device when first made, which a graph capture cannot record: the error says so and
    the capture ends (the next eager launch makes the map and works)."""
    from numba import cuda

    from tinyvllm.cuda_graph import CUDAGraph

    stream = cuda.stream()
    array = to_device(np.arange(64 * 64, dtype=np.uint16))
    out = device_empty(64 * tma.BOX_K, np.uint16)
    with pytest.raises(RuntimeError, match="first needed inside a CUDA graph capture"):
        CUDAGraph(lambda s: tma.load_box(array, 64, 64, 64, 0, 0, out, s), stream)
    tma.load_box(array, 64, 64, 64, 0, 0, out, stream)
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), wgmma.swizzle_tile(array.copy_to_host().reshape(64, 64)))
