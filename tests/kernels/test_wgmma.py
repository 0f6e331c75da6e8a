"""Hopper's warpgroup mma (cuda_kernels/wgmma.py) and the GEMM built on it (cuda_kernels/gemm_wgmma.py) against
reference/matmul.py, in the simulator (the emulation, tiny shapes) and on a GPU of compute capability 9.0.

The primitive is checked on one warpgroup through wgmma_tile: A and B in the swizzled shared-memory layout,
every N the engine can use, one or more 64-deep slabs; a wrong descriptor, swizzle or accumulator mapping
puts values in the wrong place and fails elementwise. The GEMM is checked as gemm_pipelined is
(test_matmul_kernels.py): bf16(x) @ W^T within the fp32 summation tolerance, partial tiles along M, N and K,
the gated and the planes-out epilogues, and its argument checks.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, dot_tolerance, examples, pick, sizes, to_device
from test_matmul_kernels import cap_m, check, check_gated, gated_shapes, make_inputs, stale_out, weight_shapes
from tests_support import LLAMA_1B_MATMULS

from cuda_kernels import gemm_pipelined as gp
from cuda_kernels import gemm_wgmma as gw
from cuda_kernels import matmul as mm
from cuda_kernels import matmul_policy as mp
from cuda_kernels import wgmma
from reference.bf16 import bf16_to_f32, f32_to_bf16
from reference.matmul import bf16_planes as reference_bf16_planes

pytestmark = pytest.mark.skipif(not SIM and not wgmma.device_has_wgmma(), reason="wgmma needs compute capability 9.0")
seeds = st.integers(0, 2**32 - 1)


def test_swizzle_tile_places_each_chunk_by_the_xor_of_its_row():
    """Row r's chunk c lands at chunk position c ^ (r % 8) of the row: every element once, rows kept."""
    tile = np.arange(16 * 64, dtype=np.uint16).reshape(16, 64)
    image = wgmma.swizzle_tile(tile).reshape(16, 8, 8)
    for r in range(16):
        for c in range(8):
            np.testing.assert_array_equal(image[r, c ^ (r % 8)], tile[r, 8 * c:8 * c + 8])
    assert sorted(image.ravel()) == list(range(16 * 64))


@settings(max_examples=examples(3, 12))
@given(seeds, st.sampled_from(pick([8, 16], [8, 16, 64, 128, 256, 24, 72, 200])), st.integers(1, pick(2, 4)))
def test_wgmma_tile_multiplies_swizzled_tiles(seed, n, slabs):
    """One warpgroup, A (64, 64 s) @ B (n, 64 s)^T from swizzled shared memory: each of the 64 x n outputs in
    its place, within the fp32 summation tolerance of the float64 product."""
    rng = np.random.default_rng(seed)
    a = f32_to_bf16(rng.standard_normal((64, 64 * slabs), dtype=np.float32))
    b = f32_to_bf16(rng.standard_normal((n, 64 * slabs), dtype=np.float32))
    d = device_empty((64, n), np.float32)
    wgmma.wgmma_tile(a, b, d)
    af, bf = bf16_to_f32(a).astype(np.float64), bf16_to_f32(b).astype(np.float64)
    want = af @ bf.T
    err = np.abs(d.copy_to_host() - want)
    assert (err <= dot_tolerance(64 * slabs, np.abs(af) @ np.abs(bf).T)).all(), np.argwhere(err > 1e-3)[:8]


def test_wgmma_rejects_other_widths():
    for n in (0, 4, 12, 264):
        with pytest.raises(ValueError, match="multiple of 8"):
            wgmma.wgmma_k64(n)


# tiles: the simulator's (one warpgroup, narrow), a two-stage one and an overlapping one; on the GPU the
# candidates the policy picks from and larger blocks
WGMMA_TILES = pick([gw.SIM_TILE, gw.WgmmaTile(64, 32, 2), gw.WgmmaTile(64, 16, 3, 0, True)],
                   [gw.WgmmaTile(), gw.WgmmaTile(128, 128, 4, 0, True), gw.WgmmaTile(128, 128, 3, 2, True),
                    gw.WgmmaTile(64, 128, 4, 0, True), gw.WgmmaTile(128, 64, 4), gw.WgmmaTile(256, 128, 4, 0, True),
                    gw.WgmmaTile(192, 192, 4, 0, True)])
tile_ids = {"ids": lambda t: "x".join(map(str, t))}


def plane_of(x):
    plane = device_empty(x.size, np.uint16)
    gp.bf16_planes(to_device(x), plane, bf16_inputs=True)
    return plane


@pytest.mark.parametrize("tile", WGMMA_TILES, **tile_ids)
@settings(max_examples=examples(2, 8))
@given(seeds, sizes(70, [64, 300, 1024], 1100), weight_shapes(40, 140))
def test_gemm_wgmma(tile, seed, m, nk):
    """Partial block tiles along M and N, K (a multiple of 8) short of a slab, one slab, or many; every output
    written (the sentinel fails otherwise)."""
    n, k = nk
    k = 8 * -(-k // 8)
    m = cap_m(m, n, k)
    x, w = make_inputs(seed, m, n, k)
    out = stale_out(m, n)
    gw.gemm_wgmma(plane_of(x), m, to_device(w), out, tile=tile)
    check(out, x, w, bf16_inputs=True)


@pytest.mark.parametrize("tile", WGMMA_TILES, **tile_ids)
@settings(max_examples=examples(2, 6))
@given(seeds, sizes(70, [64, 300, 1024], 1100), gated_shapes, st.sampled_from([1.0, 3e15]))
def test_gemm_wgmma_gated(tile, seed, m, fk, x_scale):
    """SiLU*mul: F not a multiple of the block's BN / 2 features (gate and up rows past F staged as zeros,
    nothing stored for them); |x| up to 3e15, where silu saturates or flushes to -0."""
    f, k = fk
    k = 8 * -(-k // 8)
    m = cap_m(m, 2 * f, k)
    x, w = make_inputs(seed, m, 2 * f, k, x_scale)
    out = stale_out(m, f)
    gw.gemm_wgmma(plane_of(x), m, to_device(w), out, tile=tile, gated=True)
    check_gated(out, x, w, bf16_inputs=True)


@pytest.mark.parametrize("tile", WGMMA_TILES, **tile_ids)
@settings(max_examples=examples(2, 4))
@given(seeds, sizes(40, [64, 300], 1100), gated_shapes)
def test_gemm_wgmma_planes_out_is_the_rounded_result(tile, seed, m, fk):
    """The gated GEMM writing bf16(result) (the down projection's x plane): exactly the bf16 rounding of the
    same kernel's float32 result."""
    f, k = (8 * -(-v // 8) for v in fk)
    m = cap_m(m, 2 * f, k)
    x, w = make_inputs(seed, m, 2 * f, k)
    plane, dw = plane_of(x), to_device(w)
    act = stale_out(m, f)
    gw.gemm_wgmma(plane, m, dw, act, tile=tile, gated=True)
    rounded = to_device(np.full((m, f), 0xBEEF, np.uint16))
    gw.gemm_wgmma(plane, m, dw, rounded, tile=tile, gated=True)
    np.testing.assert_array_equal(rounded.copy_to_host().ravel(),
                                  reference_bf16_planes(act.copy_to_host(), True).ravel())


def test_gemm_wgmma_rejects_bad_arguments():
    x, w = make_inputs(0, 4, 6, 16)
    plane, dw = plane_of(x), to_device(w)
    with pytest.raises(ValueError, match="multiple of 8"):
        gw.gemm_wgmma(device_empty(4 * 12, np.uint16), 4, to_device(w[:, :12].copy()), stale_out(4, 6))
    with pytest.raises(ValueError, match="planes must be a 1-D uint16 workspace of at least 64"):
        gw.gemm_wgmma(device_empty(10, np.uint16), 4, dw, stale_out(4, 6))
    with pytest.raises(ValueError, match="out must be"):
        gw.gemm_wgmma(plane, 4, dw, stale_out(4, 5))
    with pytest.raises(ValueError, match="even number"):
        gw.gemm_wgmma(plane, 4, to_device(w[:5].copy()), stale_out(4, 2), gated=True)
    for tile in (gw.WgmmaTile(32, 16, 2), gw.WgmmaTile(64, 16, 2, 0, True)):
        with pytest.raises(ValueError, match="BM a multiple of 64"):
            gw.gemm_wgmma(plane, 4, dw, stale_out(4, 6), tile=tile)


def wgmma_split_workspace(tile, m, n, splits):
    """(partials, counters) for a split launch: partials poisoned with NaN, counters zero."""
    partials = to_device(np.full(max(1, gw.split_partials_size(tile, m, n, splits)), np.nan, np.float32))
    return partials, to_device(np.zeros(gw.tiles(tile, m, n), np.int32))


# split K: the simulator's tiles over a few slabs; on the GPU the split plans' tiles
WGMMA_SPLIT_TILES = pick([gw.SIM_TILE, gw.WgmmaTile(64, 16, 3, 0, True)],
                         list(dict.fromkeys(mp.WGMMA_SPLIT_TILES.values())) + [mp.WGMMA_TWO_BLOCK_TILE])


@pytest.mark.parametrize("tile", WGMMA_SPLIT_TILES, **tile_ids)
@pytest.mark.parametrize("epilogue", ["plain", "gated", "planes"])
@settings(max_examples=examples(2, 4))
@given(seeds, sizes(20, [16, 64, 129, 256], 256), st.integers(1, pick(24, 3000)), st.integers(1, pick(4, 40)),
       st.data())
def test_gemm_wgmma_split_k(tile, epilogue, seed, m, n, slabs, data):
    """K split over gridDim.z blocks per tile (version 11): every split count that leaves no split empty, K
    short of a whole last slab; the result within the summation tolerance, bit-identical on a second launch
    (the splits are added in split order whoever arrives last), the counters zero again, and for the planes
    epilogue exactly bf16 of the float32 result."""
    check_split_k(gw.gemm_wgmma, wgmma_split_workspace, tile, epilogue, seed, m, n, slabs, data)


def check_split_k(launcher, workspace, tile, epilogue, seed, m, n, slabs, data):
    """The split-K property for a launcher with gemm_wgmma's arguments (gemm_wgmma, gemm_tma) and its
    workspace(tile, m, rows, splits): a split count drawn from those valid for K, K short of a whole last slab;
    within the summation tolerance, bit-identical on a second launch, counters zero again, and for the planes
    epilogue exactly bf16 of the float32 result."""
    gated = epilogue != "plain"
    k = max(8, 64 * slabs - 8 * data.draw(st.integers(0, 7)))
    splits = data.draw(st.sampled_from(gw.valid_splits(k)))
    rows = 2 * n if gated else n
    m = cap_m(m, rows, k)
    x, w = make_inputs(seed, m, rows, k)
    plane, dw = plane_of(x), to_device(w)
    partials, counters = workspace(tile, m, rows, splits)
    outs = []
    for _ in range(2):
        out = to_device(np.full((m, n), 0xBEEF, np.uint16)) if epilogue == "planes" else stale_out(m, n)
        launcher(plane, m, dw, out, tile=tile, gated=gated, splits=splits, split_workspace=(partials, counters))
        outs.append(out.copy_to_host())
        assert (counters.copy_to_host() == 0).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    if epilogue == "plain":
        check(outs[0], x, w, bf16_inputs=True)
    elif epilogue == "gated":
        check_gated(to_device(outs[0]), x, w, bf16_inputs=True)
    else:   # the same launch with a float32 out gives the values these planes must encode
        out = stale_out(m, n)
        launcher(plane, m, dw, out, tile=tile, gated=True, splits=splits, split_workspace=(partials, counters))
        np.testing.assert_array_equal(outs[0], f32_to_bf16(out.copy_to_host()))


def test_gemm_wgmma_split_k_rejects_bad_plans():
    x, w = make_inputs(0, 4, 6, 256)   # 4 slabs of 64
    plane, dw = plane_of(x), to_device(w)
    with pytest.raises(ValueError, match=r"3 splits of 4 slabs of 64 would leave a split empty"):
        gw.gemm_wgmma(plane, 4, dw, stale_out(4, 6), splits=3)
    with pytest.raises(ValueError, match=r"2 splits need split_workspace"):
        gw.gemm_wgmma(plane, 4, dw, stale_out(4, 6), splits=2)
    tile = gw.SIM_TILE if SIM else gw.WgmmaTile()
    small = (device_empty(gw.split_partials_size(tile, 4, 6, 2) - 1, np.float32), device_empty(1, np.int32))
    with pytest.raises(ValueError, match=r"2 splits need split_workspace"):
        gw.gemm_wgmma(plane, 4, dw, stale_out(4, 6), splits=2, split_workspace=small)
    assert gw.valid_splits(256) == [1, 2, 4] and gw.valid_splits(320) == [1, 2, 3, 5]


def test_wgmma_tile_policy():
    """Above 128 rows the 256-row tile where its grid has about a wave of blocks; else two blocks per SM where
    the grid has more than a wave of 128 x 128 blocks; else the four-stage tile; and never in the simulator or
    below WGMMA_MIN_M rows."""
    assert mp.wgmma_tile(1024, 16384) == mp.wgmma_tile(129, 16384) == mp.WGMMA_TALL_TILE   # 4 x 128, 1 x 128 blocks
    assert mp.wgmma_tile(1536, 3072) == mp.WGMMA_TALL_TILE                                 # 6 x 24 blocks
    assert mp.wgmma_tile(1024, 3072) == mp.WGMMA_TWO_BLOCK_TILE   # 4 x 24 tall blocks, 8 x 24 of 128 rows
    assert mp.wgmma_tile(128, 16384) == mp.WGMMA_TILE              # 128 rows: 1 x 128 blocks of 128 rows
    assert mp.wgmma_tile(1024, 2048) == mp.wgmma_tile(300, 3072) == mp.WGMMA_TILE
    assert mp.wgmma_tile(1056, 2048) == mp.WGMMA_TWO_BLOCK_TILE   # 9 x 16 blocks
    if SIM:
        assert not mp.wgmma_plan(1024, 2048, 2048, True)
    if mp.WGMMA_IN_ENGINE and wgmma.device_has_wgmma():
        assert mp.wgmma_plan(1024, 2048, 2048, True) == (mp.WGMMA_TILE, 1)
    assert not mp.wgmma_plan(mp.WGMMA_MIN_M - 1, 2048, 2048, True)   # no split workspace
    assert not mp.wgmma_plan(1024, 2048, 2048, False)


def test_wgmma_split_plans(monkeypatch):
    """wgmma_split_plan: the first tile whose rows cover M, splits for about a block per SM without an empty or
    short split (none where the tiles fill the SMs); split_workspace_sizes covers every plan of the engine's
    weights; the first split rows are one past class boundaries of the warm-up (every class one kernel); on
    gemm_wgmma wide weights (gate/up, down, the LM head) from fewer rows than the rest, on gemm_tma every weight
    from TMA_DECODE_MIN_M rows."""
    monkeypatch.setattr(mp, "TMA_DECODE_IN_ENGINE", False)
    partials, counters = mp.split_workspace_sizes(LLAMA_1B_MATMULS, True)
    for n, k, _ in LLAMA_1B_MATMULS:
        for m in range(mp.wgmma_split_min_m(n, k), mp.WGMMA_MIN_M):
            tile, splits = mp.wgmma_split_plan(m, n, k)
            rows = min(r for r in mp.WGMMA_SPLIT_TILES if r >= m)
            wanted = mp.WGMMA_SPLIT_TILES[rows]
            assert tile == wanted or (splits == 1 and tile == mp.wgmma_tile(m, n))
            slabs, tiles = -(-k // 64), gw.tiles(tile, m, n)
            assert splits in gw.valid_splits(k) and (splits == 1 or slabs // splits >= mp.WGMMA_MIN_SPLIT_SLABS)
            assert splits == 1 or tiles * (splits - 0.5) <= mp.SM_COUNT
            assert splits == 1 or (gw.split_partials_size(tile, m, n, splits) <= partials and tiles <= counters)
    for m in (mp.WGMMA_SPLIT_MIN_M - 1, mp.WGMMA_WIDE_SPLIT_MIN_M - 1):
        assert m in (8, 16, 32, 64, 128) or m % 64 == 0
    assert [mp.wgmma_split_min_m(n, k) for n, k, _ in LLAMA_1B_MATMULS] == [65, 65, 33, 33, 33]
    monkeypatch.setattr(mp, "TMA_DECODE_IN_ENGINE", True)
    assert [mp.wgmma_split_min_m(n, k) for n, k, _ in LLAMA_1B_MATMULS] == [17] * 5
    assert mp.TMA_DECODE_MIN_M - 1 in (8, 16, 32, 64, 128)
    assert mp.wgmma_split_plan(128, 2048, 2048) == (mp.WGMMA_TILE, 4)   # O: 16 tiles, 32 slabs in splits of 8
    assert mp.wgmma_split_plan(64, 16384, 2048) == (mp.WGMMA_TILE, 1)   # gate/up: 128 tiles, no split
    assert mp.wgmma_split_plan(64, 128256, 2048) == (mp.WGMMA_SPLIT_TILES[64], 1)   # LM head: 1,002 tiles
    assert mp.wgmma_split_plan(64, 2048, 8192) == (mp.WGMMA_SPLIT_TILES[64], 8)   # down: 16 tiles x 8 splits
    assert mp.wgmma_split_plan(256, 2048, 8192) == (mp.WGMMA_TILE, 4)   # down: 32 tiles x 4 splits
    assert mp.wgmma_split_plan(256, 16384, 2048) == (mp.WGMMA_TALL_TILE, 1)   # gate/up: 128 tall tiles


def test_entry_points_take_the_wgmma_split_plan(monkeypatch):
    """With gemm_wgmma's split plans switched on (as on a GPU of compute capability 9.0), matmul, gated_matmul
    and mlp given a split workspace send decode rows below WGMMA_MIN_M to gemm_wgmma with K split: each result
    within the same bounds, the counters zero afterwards."""
    monkeypatch.setattr(mp, "WGMMA_IN_ENGINE", True)
    monkeypatch.setattr(mp, "WGMMA_SPLIT_IN_ENGINE", True)
    monkeypatch.setattr(mp, "TMA_IN_ENGINE", False)   # (on a GPU gemm_tma would take these plans)
    monkeypatch.setattr(mp, "TMA_DECODE_IN_ENGINE", False)
    monkeypatch.setattr(wgmma, "device_has_wgmma", lambda: True)
    if SIM:   # one block tile of rows (a simulated block costs seconds)
        monkeypatch.setattr(mp, "WGMMA_SPLIT_TILES", {mp.WGMMA_MIN_M - 1: gw.SIM_TILE})
        monkeypatch.setattr(mp, "WGMMA_SPLIT_MIN_M", 9)
    m, n, f, k, calls = check_split_entry_points(monkeypatch, gw, "gemm_wgmma", with_mlp=True)
    plans = [mp.wgmma_split_plan(m, n, k)[1], mp.wgmma_split_plan(m, 2 * f, k)[1]]
    assert calls == plans + [plans[1], mp.wgmma_split_plan(m, k, f)[1]] and min(plans) > 1


def check_split_entry_points(monkeypatch, module, name: str, with_mlp: bool):
    """matmul and gated_matmul (and with_mlp mlp) of wgmma_split_min_m rows given workspaces of
    split_workspace_sizes, K = 8 slabs split in two (WGMMA_MIN_SPLIT_SLABS and TMA_DECODE_SPLITS' slabs set to 4:
    the engine's minimums would need K = 1,024 or more, twice the simulated work): each result within the
    summation bounds, the split counters zero afterwards. The launches of module.name (gemm_wgmma or gemm_tma)
    are recorded. Returns (m, n, f, k, the splits of each recorded launch)."""
    calls = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(kw["splits"]) or kernel(*a, **kw))
    monkeypatch.setattr(mp, "WGMMA_MIN_SPLIT_SLABS", 4)
    monkeypatch.setattr(mp, "TMA_DECODE_SPLITS", {rows: (mp.SM_COUNT, 4) for rows in mp.TMA_DECODE_TILES})
    n, f, k = 16, 8, 512
    m = mp.wgmma_split_min_m(n, k)   # the fewest rows the split plans in force take
    x, w = make_inputs(1, m, n, k)
    ws = device_empty(m * max(k, f), np.uint16)
    sizes_ = mp.split_workspace_sizes([(n, k, False), (2 * f, k, True), (k, f, False)], True)
    split_ws = (device_empty(sizes_[0], np.float32), to_device(np.zeros(sizes_[1], np.int32)))
    out = stale_out(m, n)
    mm.matmul(to_device(x), to_device(w), out, bf16_inputs=True, workspace=ws, split_workspace=split_ws)
    check(out, x, w, bf16_inputs=True)
    wg = make_inputs(2, 1, 2 * f, k)[1]
    gated = stale_out(m, f)
    mm.gated_matmul(to_device(x), to_device(wg), gated, None, bf16_inputs=True, workspace=ws, split_workspace=split_ws)
    check_gated(gated, x, wg, bf16_inputs=True)
    if with_mlp:
        w2 = make_inputs(3, 1, k, f)[1]
        act_planes = device_empty((m, f), np.uint16)
        out2 = stale_out(m, k)
        mm.mlp(to_device(x), to_device(wg), to_device(w2), out2, None, None, bf16_inputs=True, workspace=ws,
               act_planes=act_planes, split_workspace=split_ws)
        np.testing.assert_array_equal(act_planes.copy_to_host(), f32_to_bf16(gated.copy_to_host()))
        check(out2, bf16_to_f32(act_planes.copy_to_host()), w2, bf16_inputs=True)
    assert (split_ws[1].copy_to_host() == 0).all()
    return m, n, f, k, calls


def test_entry_points_take_gemm_wgmma(monkeypatch):
    """With gemm_wgmma switched on (as on a GPU of compute capability 9.0), matmul, gated_matmul and mlp send
    bf16 prefill rows to it, x's plane converted first (or the norm's, planes_ready), act as the down
    projection's plane: each result within the same bounds as the other kernels'."""
    calls = []
    kernel = gw.gemm_wgmma
    monkeypatch.setattr(mp, "WGMMA_IN_ENGINE", True)
    monkeypatch.setattr(mp, "TMA_IN_ENGINE", False)   # (on a GPU gemm_tma would take these rows)
    monkeypatch.setattr(wgmma, "device_has_wgmma", lambda: True)
    monkeypatch.setattr(mp, "wgmma_tile", lambda m, n: gw.SIM_TILE if SIM else mp.WGMMA_TILE)
    monkeypatch.setattr(gw, "gemm_wgmma", lambda *a, **k: calls.append(a[1]) or kernel(*a, **k))
    m, n, f, k = mp.WGMMA_MIN_M, 24, 16, 64
    x, w = make_inputs(1, m, n, k)
    ws = device_empty(m * max(k, f), np.uint16)
    out = stale_out(m, n)
    mm.matmul(to_device(x), to_device(w), out, bf16_inputs=True, workspace=ws)
    check(out, x, w, bf16_inputs=True)
    wg = make_inputs(2, 1, 2 * f, k)[1]
    gated = stale_out(m, f)
    mm.gated_matmul(to_device(x), to_device(wg), gated, None, bf16_inputs=True, workspace=ws)
    check_gated(gated, x, wg, bf16_inputs=True)
    w2 = make_inputs(3, 1, k, f)[1]
    act_planes = device_empty((m, f), np.uint16)
    out2 = stale_out(m, k)
    mm.mlp(to_device(x), to_device(wg), to_device(w2), out2, None, None, bf16_inputs=True, workspace=ws,
           act_planes=act_planes)
    act = bf16_to_f32(act_planes.copy_to_host())   # the plane the down GEMM read: bf16(act)
    np.testing.assert_array_equal(act_planes.copy_to_host(), f32_to_bf16(gated.copy_to_host()))
    check(out2, act, w2, bf16_inputs=True)
    assert calls == [m, m, m, m]
