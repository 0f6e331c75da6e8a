"""The matmul family's policies: which kernel, in which tile or configuration, runs ``out = x @ W^T`` for a
shape (the entry points that follow them: matmul.py; the kernels: one file per family, listed there).

Every policy is a pure function of the shape, so a captured CUDA graph stays valid:
- uses_gemv: gemv for M <= GEMV_MAX_M (GEMV_WIDE_MAX_M for weights of GEMV_WIDE_N rows or more), with the
  configuration gemv_config(M, N, K);
- uses_gemv_tc: gemv_tc for bf16 inputs from gemv's rows to GEMV_TC_MAX_M (given a planes workspace), with
  gemv_tc_config(M, N, K);
- pipelined_plan: gemm_pipelined where the caller gives a planes workspace and M is large enough (with a
  split workspace, every M above gemv's, K split for skinny M: skinny_plan, else pipelined_tile; the split
  workspace's sizes: split_workspace_sizes);
- wgmma_plan: gemm_wgmma instead of gemm_pipelined for bf16 inputs on a GPU of compute capability 9.0 (given
  a planes workspace): from WGMMA_MIN_M rows in the tile of wgmma_tile(M, N), and with a split workspace from
  wgmma_split_min_m(N, K) rows with K split over blocks (wgmma_split_plan); with TMA_IN_ENGINE its prefill
  plans go to gemm_tma in tma_tile(M, N), and with TMA_DECODE_IN_ENGINE its split plans too (tma_plan);
- gemm_tc with gemm_tc_tile(M, N, K) for the rest; in the simulator gemm with GEMM_TILE instead (every
  emulated mma costs two block barriers over Python threads; the kernel tests still run gemm_tc there).
The numbers behind each choice are in docs/performance.md.
"""

from __future__ import annotations

import os

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import gemm_pipelined, gemm_tma, gemm_wgmma, gemv_tc, wgmma
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.gemm_pipelined import PipelinedTile
from cuda_kernels.gemm_simt import GemmTile
from cuda_kernels.gemm_tc import GemmTcTile
from cuda_kernels.gemv import GemvConfig
from cuda_kernels.gemm_tma import TmaTile
from cuda_kernels.gemm_wgmma import WgmmaTile
from cuda_kernels.primitives import SM_COUNT

# Largest M that the engine's matmul sends to gemv (GEMV_WIDE_MAX_M for weights of GEMV_WIDE_N rows or
# more); above it gemm_tc or gemm_pipelined. Measured, not derived: at M = 8 gemv still beat gemm_tc's skinny
# tile on the narrow weights but lost on the wide ones (docs/performance.md, "GEMV or GEMM").
GEMV_MAX_M = 8
GEMV_WIDE_MAX_M = 4
if SIMULATOR:
    # Each simulated warp reduction is two block barriers over Python threads: the engine's matmuls take the
    # barrier-light tiled path there (the kernel tests still run gemv itself in the simulator).
    GEMV_MAX_M = GEMV_WIDE_MAX_M = 0

# gemv_config's choices (GemvConfig(warps, rows per warp, unroll, K split, pipelined); measured:
# docs/performance.md). GemvConfig() is the first version's one-load loop.
GEMV_WIDE, GEMV_SPLIT = GemvConfig(4, 4, 4, 2), GemvConfig(4, 4, 4, 2, True)
GEMV_SPLIT_SMALL, GEMV_LONG_K = GemvConfig(8, 4, 2, 4, True), GemvConfig(8, 4, 4, 4, True)
GEMV_SMALL_N = 2048
GEMV_WIDE_M, GEMV_LONG_K_M, GEMV_SPLIT_M = GemvConfig(4, 2, 4, 1), GemvConfig(8, 2, 2, 4), GemvConfig(4, 2, 4, 2)
GEMV_WIDE_N = 8192
# The simulator runs one Python thread per CUDA thread: fewer, busier threads keep engine tests affordable
# there (the kernel tests cover the GPU's configurations too).
GEMM_TILE = GemmTile(16, 16, 8, 2, 2) if SIMULATOR else GemmTile()

# gemm_tc tiles (gemm_tc_tile picks one; every one can also be passed as gemm_tc's `tile`). All of them fit
# gemm_tc.GEMM_TC_MAX_SHARED in fp32 mode, so the choice does not depend on bf16_inputs.
# Prefill: 128 x 128 of 8 warps of 64 x 32, and 64 x 64 of 4 warps of 32 x 32.
GEMM_TC_TILE = GemmTcTile(128, 128, 32, 64, 32)
GEMM_TC_SMALL_TILE = GemmTcTile(64, 64, 32, 32, 32)
# Skinny M (decode batches): the m16 of one mma (or two) for the block's rows, narrow columns for more blocks,
# 128-deep slabs split over 4 K groups of warps (8 or 16 warps a block, each on 2 k-steps a slab).
GEMM_TC_SKINNY_TILES = {
    16: (GemmTcTile(16, 64, 128, 16, 16, 4), GemmTcTile(16, 32, 128, 16, 16, 4),
         GemmTcTile(16, 16, 128, 16, 8, 4)),
    32: (GemmTcTile(32, 64, 64, 32, 16, 2), GemmTcTile(32, 32, 128, 32, 16, 4),
         GemmTcTile(32, 16, 128, 32, 8, 4)),
}
# In fp32 mode the 32-row tiles are compiled for two blocks per SM (SKINNY32_FP32_MIN_BLOCKS, see gemm_tc_tile).
SKINNY32_FP32_MIN_BLOCKS = 2
# The narrowest 16-row tile with 256-deep slabs: twice the weight bytes in flight per block, for long K.
GEMM_TC_SKINNY_DEEP_TILE = GemmTcTile(16, 16, 256, 16, 8, 4)
GEMM_TC_BIG_BLOCKS = 128       # the big tile from this many blocks up (measured: docs/performance.md)
GEMM_TC_SMALL_MIN_M = 256      # the 64 x 64 tile only above this M (measured: docs/performance.md)
GEMM_TC_SKINNY_BLOCKS = 2 * SM_COUNT // 3   # the widest skinny tile with at least this many blocks
GEMM_TC_DEEP_K = 4096          # K from which the narrowest skinny tile takes the deep slabs
# From this many rows (PIPELINED_WIDE_MIN_M for weights of GEMV_WIDE_N rows or more) matmul takes
# gemm_pipelined when it is given a planes workspace (no split workspace): below it gemm_tc's skinny split-K
# tiles were faster on the narrow weights (docs/performance.md, "gemm_tc or gemm_pipelined").
PIPELINED_MIN_M = 128
PIPELINED_WIDE_MIN_M = 64
# gemm_pipelined tiles (pipelined_tile; measured on the H200, docs/performance.md): a wide tile per mode where the
# grid still has about a block per SM (with bf16 inputs and at most one wave of blocks, its 64-deep slab),
# else 64 rows (and, with bf16 inputs and a small grid, 64 x 64).
PIPELINED_WIDE_FP32 = PipelinedTile(128, 256, 32, 64, 64, 3)
PIPELINED_WIDE_BF16 = PipelinedTile(128, 128, 32, 64, 32, 3)
PIPELINED_WIDE_BF16_DEEP = PipelinedTile(128, 128, 64, 64, 32, 3)
PIPELINED_NARROW = PipelinedTile(64, 128, 32, 32, 32, 4)
PIPELINED_SMALL = PipelinedTile(64, 64, 32, 32, 32, 4)
PIPELINED_MIN_BLOCKS = 120     # of the 132 SMs: fewer blocks than this leave too many idle
PIPELINED_ONE_WAVE = 132       # blocks the GPU runs at once with one 128 x 128 block per SM
# Tiles worth timing against them (tools/kernel_benchmarks/matmul.py --pipelined)
PIPELINED_CANDIDATES = (PipelinedTile(128, 128, 32, 64, 32, 4), PipelinedTile(128, 128, 32, 64, 32, 3),
                        PipelinedTile(128, 128, 32, 64, 32, 3, 2), PipelinedTile(128, 128, 64, 64, 32, 3),
                        PipelinedTile(64, 64, 32, 32, 32, 4), PipelinedTile(128, 64, 32, 64, 32, 4),
                        PipelinedTile(64, 128, 32, 32, 32, 4), PipelinedTile(128, 256, 32, 64, 64, 3))
# Skinny M (decode batches above gemv's rows, short prefill chunks): the whole of M in one block row (BM = M
# rounded up to 16, 32, 64 or 128), 128 weight rows a block, 64-deep slabs, and K split over enough blocks
# that the grid has about a block per SM (skinny_plan). The weight is the traffic here:
# each block streams its BN x K / splits share of it, STAGES - 1 slabs ahead.
PIPELINED_SKINNY_TILES = {16: PipelinedTile(16, 128, 64, 16, 32, 4), 32: PipelinedTile(32, 128, 64, 32, 32, 4),
                          64: PipelinedTile(64, 128, 64, 32, 32, 4), 128: PipelinedTile(128, 128, 64, 64, 32, 3)}
PIPELINED_SKINNY_MAX_M = 128
MIN_SPLIT_SLABS = 4            # a split shorter than this spends its time filling and draining the pipeline
# gemv_tc for bf16 inputs from gemv's rows up to this many, for weights of at most GEMV_TC_MAX_WEIGHT elements
# (the small ones: QKV, O). NOTE: alone it beat the skinny plan on them up to 64 rows, but inside the decode step
# its RoPE + KV-write epilogue costs more with every n8 tile, and from 32 rows the step was slower
# (docs/performance.md, "gemv_tc"). The kernel serves 8 * gemv_tc.MAX_NT rows; GEMV_TC_CONFIGS keeps the
# configurations timed at 32 and 64.
GEMV_TC_MAX_M = 16
GEMV_TC_MAX_WEIGHT = 8 << 20
# gemv_tc_config's picks by n8 tiles (x rows / 8) and weight rows (up to GEMV_TC_NARROW_N, O-like; above, QKV-like)
GEMV_TC_CONFIGS = {2: (gemv_tc.GemvTcConfig(8, 1, 4), gemv_tc.GemvTcConfig(8, 1, 4)),
                   4: (gemv_tc.GemvTcConfig(8, 1, 4), gemv_tc.GemvTcConfig(8, 1, 2)),
                   8: (gemv_tc.GemvTcConfig(8, 1, 2, True), gemv_tc.GemvTcConfig(4, 1, 8))}
GEMV_TC_NARROW_N = 2048
# NOTE: on by default on a GPU (TINYVLLM_GEMV_TC=0 turns it off, for an A/B of the step); never in the
# simulator, where every emulated mma costs two block barriers over Python threads (a test switches it on to
# walk the entry points).
GEMV_TC_IN_ENGINE = not SIMULATOR and os.environ.get("TINYVLLM_GEMV_TC", "1") != "0"
# gemm_wgmma from this many rows, in the tiles of wgmma_tile: on by default on a GPU of compute capability 9.0,
# where it beat gemm_pipelined on every prefill GEMM of the 1B model (docs/performance.md, "gemm_wgmma");
# TINYVLLM_WGMMA=0 turns it off (for an A/B). NOTE: from 257 rows, above the default 256 decode sequences (the
# decode batches take the split plans below); a multiple of 64 plus one, so that every class of M the warm-up
# walks takes one kernel.
WGMMA_MIN_M = 257
WGMMA_TILE = WgmmaTile(128, 128, 4, overlap=True)
WGMMA_TWO_BLOCK_TILE = WgmmaTile(128, 128, 3, 2, overlap=True)   # two blocks per SM: for grids above a wave
WGMMA_ONE_WAVE = 132
# Four warpgroups a block sharing each W slab (fewer operand bytes from L2 per product): wgmma_tile takes it
# for more than 128 rows where its grid has WGMMA_TALL_MIN_BLOCKS blocks or more. NOTE: about a wave; it won at
# 128 and 512 blocks, lost at 64 (docs/performance.md, "gemm_wgmma").
WGMMA_TALL_TILE = WgmmaTile(256, 128, 4, overlap=True)
WGMMA_TALL_MIN_BLOCKS = 128
WGMMA_TALL_IN_ENGINE = True
WGMMA_IN_ENGINE = not SIMULATOR and os.environ.get("TINYVLLM_WGMMA", "1") != "0"
# gemm_wgmma with K split over blocks (version 11) for decode batches from WGMMA_SPLIT_MIN_M rows up to
# WGMMA_MIN_M - 1, given a split workspace, in the tile of WGMMA_SPLIT_TILES for M (the first whose rows cover
# it) and about a block per SM (wgmma_split_plan); TINYVLLM_WGMMA_SPLIT=0 turns it off. NOTE: from 65 rows,
# where it made the decode step faster; at 17-64 rows on every weight it made it slower than gemv_tc and
# gemm_pipelined's skinny plan (docs/performance.md, "gemm_wgmma"), but not on the wide weights (below).
# NOTE: WGMMA_SPLIT_MIN_M is one more than a class boundary of the warm-up (8, 16, 32, 64, 128 or a multiple of
# 64: tinyvllm/warmup.py), so that every class of M takes one kernel.
WGMMA_SPLIT_MIN_M = 65
# Wide weights (WGMMA_WIDE_WEIGHT elements or more: the 1B model's gate/up, down, LM head) take the split plan from
# WGMMA_WIDE_SPLIT_MIN_M rows, where alone they beat the skinny plan and O did not (docs/performance.md,
# "gemm_wgmma"). Also one more than a class boundary of the warm-up.
WGMMA_WIDE_SPLIT_MIN_M = 33
WGMMA_WIDE_WEIGHT = 16 << 20
WGMMA_SPLIT_TILES = {64: WgmmaTile(64, 128, 4, overlap=True), WGMMA_MIN_M - 1: WGMMA_TILE}
# NOTE: gemm_wgmma's splits run at least this many 64-deep slabs (MIN_SPLIT_SLABS is gemm_pipelined's): its four
# stages fill and drain in every split; O at 128 rows (32 slabs) was faster in 4 splits than in 8, down (128) in 8.
WGMMA_MIN_SPLIT_SLABS = 8
WGMMA_SPLIT_IN_ENGINE = WGMMA_IN_ENGINE and os.environ.get("TINYVLLM_WGMMA_SPLIT", "1") == "1"
# gemm_tma (version 12: TMA copies by a producer warp, mbarriers instead of block barriers) in place of
# gemm_wgmma for prefill (from WGMMA_MIN_M rows), in the first of TMA_TILES whose grid has TMA_MIN_BLOCKS
# blocks, else the one with the most blocks (the tiles measured fastest at 1,024 rows: docs/performance.md,
# "gemm_tma"). TINYVLLM_TMA=0 turns it off (gemm_wgmma then).
TMA_TILES = (TmaTile(256, 128, 4), TmaTile(128, 128, 6), TmaTile(64, 128, 8))
TMA_MIN_BLOCKS = 96
TMA_IN_ENGINE = WGMMA_IN_ENGINE and os.environ.get("TINYVLLM_TMA", "1") == "1"
# gemm_tma for decode batches too, where the warpgroup split plans run (wgmma_plan below WGMMA_MIN_M rows): the
# first of TMA_DECODE_TILES whose rows cover M, K split as TMA_DECODE_SPLITS says (tma_plan). NOTE: it took the
# decode step at batch 64 / 128 / 256 5%, 5% and 2% below gemm_wgmma's split K (docs/performance.md, "gemm_tma");
# TINYVLLM_TMA_DECODE=0 turns it off (gemm_wgmma's split plans then).
TMA_DECODE_TILES = {64: TmaTile(64, 128, 8), WGMMA_MIN_M - 1: TmaTile(128, 128, 6)}
TMA_DECODE_IN_ENGINE = TMA_IN_ENGINE and os.environ.get("TINYVLLM_TMA_DECODE", "1") == "1"
# With TMA_DECODE_IN_ENGINE the split plans take every weight from this many rows (wgmma_split_min_m). NOTE: from
# 17 rows (one more than a warm-up class boundary) the decode step at batch 32 / 64 was 8% / 4% faster than with
# QKV and O on gemm_pipelined's skinny plan below 65 rows and every weight below 33 (docs/performance.md,
# "gemm_tma"); gemm_wgmma's split plans had lost there.
TMA_DECODE_MIN_M = 17
# gemm_tma's K splits by the rows of TMA_DECODE_TILES (the same keys): (the blocks a split plan aims at, the
# fewest slabs a split takes) for tma_plan. NOTE: for the 64-row tile, half gemm_wgmma's block target and twice
# its shortest split (the 1B model at 17-64 rows: QKV and O in 2 splits, down in 4, not 4 and 8) took the decode
# step at batch 32 / 64 2.6% / 6.5% lower (docs/performance.md, "gemm_tma"): the last block of a tile adds every
# split's partials alone, so each split costs the tile's tail more than its blocks gain in weight bandwidth.
# The 128-row tile keeps gemm_wgmma's rule: the same change held batch 128 (+0.5%) and was not timed at 256.
TMA_DECODE_SPLITS = {64: (SM_COUNT // 2, 16), WGMMA_MIN_M - 1: (SM_COUNT, WGMMA_MIN_SPLIT_SLABS)}
# From TMA_DECODE_WIDE_MIN_M rows, a weight whose grid of TMA_DECODE_WIDE_TILE tiles has TMA_MIN_BLOCKS blocks (the
# 1B model's gate/up and LM head) takes that tile over the whole K, as prefill does: four consumer warpgroups
# share each W slab, and every W tile is read by one block instead of two. NOTE: on gate/up at 256 rows it took
# 0.70 of the 128-row tile's time; on the weights with fewer column tiles (16-24 blocks) it lost by 1.3-3.2x
# (docs/performance.md, "Decode batches of 129-256 rows").
TMA_DECODE_WIDE_TILE = TmaTile(256, 128, 4)
TMA_DECODE_WIDE_MIN_M = 129


# ---------------------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------------------

def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """The GemvConfig gemv uses for x (m, k) @ W (n, k)^T in the engine (a pure function of the shape).

    A decode GEMV is a race to keep enough weight bytes in flight: each lane issues rows_per_warp * unroll
    8-byte loads before using the first. With many rows (n >= GEMV_WIDE_N) the grid alone fills the SMs;
    with few, each row's K is split over 4 warps of a block as well. Above m = 1 each weight word also meets
    m rows of x, so fewer loads are kept in flight per lane, and K is split by 4 only for a long K (k >= 4096,
    m <= 2). The narrow weights at m = 1 take pipelined configurations (the next pass's loads issued before
    the current one is consumed); on the wide weights and at m > 1 the second set of registers cost more
    than it gained. Each pick was the fastest (or within noise of it) of the configurations timed, alone
    with cold weights and inside the batch-1 decode graph under PDL, where a gemv's first pass of loads
    overlaps the kernel before it (docs/performance.md, "gemv configurations"). The staged gemv
    (GemvStaged) is not picked: faster alone on QKV, not inside the step.
    """
    wide, long_k = n >= GEMV_WIDE_N, k >= 4096
    if m == 1:
        if wide:
            return GEMV_WIDE
        if long_k:
            return GEMV_LONG_K
        return GEMV_SPLIT_SMALL if n <= GEMV_SMALL_N else GEMV_SPLIT
    if wide:
        return GEMV_WIDE_M
    return GEMV_LONG_K_M if long_k and m <= 2 else GEMV_SPLIT_M


def _blocks(tile: GemmTcTile | PipelinedTile, m: int, n: int) -> int:
    return ((n + tile.bn - 1) // tile.bn) * ((m + tile.bm - 1) // tile.bm)


def gemm_tc_tile(m: int, n: int, k: int, bf16_inputs: bool = False) -> GemmTcTile:
    """The tile gemm_tc uses for x (m, k) @ W (n, k)^T in the engine (a pure function of the shape and mode).

    1. GEMM_TC_TILE (128 x 128) when m > 64 and its grid has at least GEMM_TC_BIG_BLOCKS blocks: most reuse
       per byte staged.
    2. Else GEMM_TC_SMALL_TILE (64 x 64) when m > GEMM_TC_SMALL_MIN_M and its grid has GEMM_TC_BIG_BLOCKS
       blocks too.
    3. Else a skinny tile (decode batches, or outputs too small to fill the SMs): bm = 16 for m <= 16, else
       32; the widest of its bn = 64, 32, 16 whose grid has at least GEMM_TC_SKINNY_BLOCKS blocks, else the
       narrowest. At small m the weight read dominates (2.47 GB per decode step), and a weight is read at
       full bandwidth only with enough bytes in flight: each block keeps its next slab of W (bn x bk bf16:
       4 to 16 KB) in registers, so the grid needs blocks on most SMs, and each block 8 or 16 warps (the K
       groups) to issue those loads. Wider bn reads x fewer times per weight byte and stages more W per
       barrier, so it is preferred while the grid still covers two thirds of the SMs.
    4. When even the narrowest has fewer than GEMM_TC_SKINNY_BLOCKS blocks, m <= 16 and K is at least
       GEMM_TC_DEEP_K, GEMM_TC_SKINNY_DEEP_TILE: 256-deep slabs double each block's bytes in flight, and a
       long K keeps its 4 K groups busy over many slabs (from the costs above, not measured yet).
    The mode matters in one place: in fp32 mode a 32-row tile gets min_blocks = SKINNY32_FP32_MIN_BLOCKS
    (ptxas then fits two 256-thread blocks per SM without spills, 128 registers instead of 133-136), which
    was faster in fp32 mode and slower with bf16 inputs (128 registers already).
    The rules' thresholds were measured on the H200 (docs/performance.md, "gemm_tc tiles").
    """
    if m > 64 and _blocks(GEMM_TC_TILE, m, n) >= GEMM_TC_BIG_BLOCKS:
        return GEMM_TC_TILE
    if m > GEMM_TC_SMALL_MIN_M and _blocks(GEMM_TC_SMALL_TILE, m, n) >= GEMM_TC_BIG_BLOCKS:
        return GEMM_TC_SMALL_TILE
    if m <= 16:
        skinny = GEMM_TC_SKINNY_TILES[16]
        tile = next((t for t in skinny if _blocks(t, m, n) >= GEMM_TC_SKINNY_BLOCKS), None)
        return tile or (GEMM_TC_SKINNY_DEEP_TILE if k >= GEMM_TC_DEEP_K else skinny[-1])
    skinny = GEMM_TC_SKINNY_TILES[32]
    tile = next((t for t in skinny if _blocks(t, m, n) >= GEMM_TC_SKINNY_BLOCKS), skinny[-1])
    return tile if bf16_inputs else tile._replace(min_blocks=SKINNY32_FP32_MIN_BLOCKS)


def uses_pipelined(m: int, n: int, k: int) -> bool:
    """Whether matmul, given a planes workspace, sends x (m, k) @ W (n, k)^T to gemm_pipelined, not gemm_tc."""
    return not SIMULATOR and k % 8 == 0 and m >= (PIPELINED_WIDE_MIN_M if n >= GEMV_WIDE_N else PIPELINED_MIN_M)


def uses_gemv_tc(m: int, n: int, k: int, bf16_inputs: bool) -> bool:
    """Whether matmul, given a planes workspace, sends x (m, k) @ W (n, k)^T to gemv_tc: bf16 inputs, m above
    gemv's rows and at most GEMV_TC_MAX_M, a weight of at most GEMV_TC_MAX_WEIGHT elements, k a multiple of
    gemv_tc's 32-k chunk (GEMV_TC_IN_ENGINE: not in the simulator). n: the weight's rows (gated: 2F)."""
    return (GEMV_TC_IN_ENGINE and bf16_inputs and not uses_gemv(m, n) and m <= GEMV_TC_MAX_M
            and n * k <= GEMV_TC_MAX_WEIGHT and k % gemv_tc.CHUNK_K == 0)


def wgmma_plan(m: int, n: int, k: int, bf16_inputs: bool, split_workspace=None) -> tuple[WgmmaTile, int] | None:
    """(tile, splits) when matmul, given a planes workspace, sends x (m, k) @ W (n, k)^T to gemm_wgmma, else None:
    bf16 inputs, k a multiple of 8, a GPU of compute capability 9.0 (WGMMA_IN_ENGINE: not in the simulator);
    from WGMMA_MIN_M rows wgmma_tile(m, n) over the whole K, and with a split workspace from wgmma_split_min_m(n,
    k) rows wgmma_split_plan (WGMMA_SPLIT_IN_ENGINE). n: the weight's rows (gated: 2F)."""
    if not (WGMMA_IN_ENGINE and bf16_inputs and k % 8 == 0 and wgmma.device_has_wgmma()):
        return None
    if m >= WGMMA_MIN_M:
        return wgmma_tile(m, n), 1
    if split_workspace is not None and WGMMA_SPLIT_IN_ENGINE and m >= wgmma_split_min_m(n, k):
        return wgmma_split_plan(m, n, k)
    return None


def wgmma_split_min_m(n: int, k: int) -> int:
    """The fewest rows of x (m, k) @ W (n, k)^T that the warpgroup split plans take: TMA_DECODE_MIN_M where they run
    on gemm_tma (TMA_DECODE_IN_ENGINE); on gemm_wgmma WGMMA_WIDE_SPLIT_MIN_M for weights of WGMMA_WIDE_WEIGHT
    elements or more, else WGMMA_SPLIT_MIN_M."""
    if TMA_DECODE_IN_ENGINE:
        return TMA_DECODE_MIN_M
    return WGMMA_WIDE_SPLIT_MIN_M if n * k >= WGMMA_WIDE_WEIGHT else WGMMA_SPLIT_MIN_M


def wgmma_split_plan(m: int, n: int, k: int, tile: WgmmaTile | None = None) -> tuple[WgmmaTile, int]:
    """(tile, splits) of gemm_wgmma for a decode batch x (m < WGMMA_MIN_M, k) @ W (n, k)^T: the first tile of
    WGMMA_SPLIT_TILES whose rows cover m (or `tile`), K's 64-deep slabs split for about one block per SM
    (split_count, each split at least WGMMA_MIN_SPLIT_SLABS slabs). Where that grid needs no split, wgmma_tile's
    choice: above 128 rows the 256-row tile or two blocks per SM above a wave, as at prefill; at 64 rows or
    fewer the 128-row tile where its grid is one wave or less (gate/up: faster than the 64-row tile), else the
    64-row tile (the LM head: faster than two 128-row blocks per SM). n: the weight's rows (gated: 2F)."""
    chosen = tile or next(t for rows, t in WGMMA_SPLIT_TILES.items() if m <= rows)
    splits = split_count(gemm_wgmma.tiles(chosen, m, n), -(-k // wgmma.TILE_K), WGMMA_MIN_SPLIT_SLABS)
    if tile is None and splits == 1 and (chosen == WGMMA_TILE
                                         or gemm_wgmma.tiles(WGMMA_TILE, m, n) <= WGMMA_ONE_WAVE):
        return wgmma_tile(m, n), 1
    return chosen, splits


def gemv_tc_config(m: int, n: int, k: int) -> gemv_tc.GemvTcConfig:
    """The GemvTcConfig gemv_tc uses for x (m, k) @ W (n, k)^T (gated: W = [gate; up], n = 2F rows): a pure
    function of the n8 tiles and the weight's rows. The small weights it serves have few 16-row tiles, so K
    is split over 8 warps a tile (4 for the widest at 64 rows) to put enough loads in flight on every SM; the
    unroll and pipelining are the fastest of the configurations timed (GEMV_TC_CONFIGS)."""
    return GEMV_TC_CONFIGS[gemv_tc.n_tiles(m)][n > GEMV_TC_NARROW_N]


def reads_planes(m: int, n: int, k: int, bf16_inputs: bool, gated: bool = False, split_workspace=None) -> bool:
    """Whether the engine's matmul of x (m, k) by W (n, k) reads x's bf16 planes (gemv_tc or gemm_pipelined, given
    a planes workspace), so that the kernel producing x may write them (rmsnorm's planes output)."""
    return (uses_gemv_tc(m, n, k, bf16_inputs) or bool(wgmma_plan(m, n, k, bf16_inputs, split_workspace))
            or bool(pipelined_plan(m, n, k, bf16_inputs, gated, split_workspace)))


def uses_gemv(m: int, n: int) -> bool:
    """Whether matmul sends x (m, K) @ W (n, K)^T to gemv (decode sizes) rather than a tiled kernel."""
    return m <= (GEMV_WIDE_MAX_M if n >= GEMV_WIDE_N else GEMV_MAX_M)


def pipelined_plan(m: int, n: int, k: int, bf16_inputs: bool, gated: bool = False,
                   split_workspace=None) -> tuple[PipelinedTile, int] | None:
    """(tile, splits) when matmul (given a planes workspace) runs x (m, k) @ W (n, k)^T on gemm_pipelined, else
    None: with a split workspace every M from gemv's limit up to PIPELINED_SKINNY_MAX_M takes the skinny plan
    (skinny_plan: K split over blocks, so that the weight streams from every SM), larger M pipelined_tile;
    without one, M from PIPELINED_MIN_M (PIPELINED_WIDE_MIN_M for wide weights) only."""
    if SIMULATOR or k % 8 or uses_gemv(m, n):
        return None
    if split_workspace is not None and m <= PIPELINED_SKINNY_MAX_M:
        return skinny_plan(m, n, k, bf16_inputs, gated)
    if uses_pipelined(m, n, k):
        return pipelined_tile(m, n, k, bf16_inputs), 1
    return None


def pipelined_tile(m: int, n: int, k: int, bf16_inputs: bool) -> PipelinedTile:
    """The tile gemm_pipelined uses for x (m, k) @ W (n, k)^T in the engine (a pure function of the shape and
    mode).

    The wide tiles where their grid has PIPELINED_MIN_BLOCKS blocks; below that 64-row tiles, and with bf16
    inputs, when even 64 x 128 has too few blocks, 64 x 64. A 128-row tile is taken only when it pads M no more
    than a 64-row one does (at M = 64 it would do twice the work). With bf16 inputs and a grid of one wave or
    less, every block runs alone on its SM for the whole K, and the 64-deep slab (half the barriers and waits
    per K) is faster; with more blocks it is slower. Measured on the H200 (tools/kernel_benchmarks/matmul.py
    --pipelined; docs/performance.md, "gemm_pipelined tiles")."""
    wide = PIPELINED_WIDE_BF16 if bf16_inputs else PIPELINED_WIDE_FP32
    if -(-m // 128) * 128 <= -(-m // 64) * 64 and _blocks(wide, m, n) >= PIPELINED_MIN_BLOCKS:
        return PIPELINED_WIDE_BF16_DEEP if bf16_inputs and _blocks(wide, m, n) <= PIPELINED_ONE_WAVE else wide
    if bf16_inputs and _blocks(PIPELINED_NARROW, m, n) < PIPELINED_MIN_BLOCKS:
        return PIPELINED_SMALL
    return PIPELINED_NARROW


def skinny_plan(m: int, n: int, k: int, bf16_inputs: bool, gated: bool = False,
                tile: PipelinedTile | None = None) -> tuple[PipelinedTile, int]:
    """(tile, splits) of gemm_pipelined for x (m <= PIPELINED_SKINNY_MAX_M, k) @ W (n, k)^T: the tile of
    PIPELINED_SKINNY_TILES for m (or `tile`), and about one block per SM: splits = round(SM_COUNT / tiles), at
    least 1, each split at least MIN_SPLIT_SLABS slabs long. n: the weight's rows (gated: 2F).
    NOTE: about one block per SM was the best or within 5% of it for every 1B weight at M = 16, 64 and 128;
    more splits cost more in partial sums than they gain in blocks (H100, cold weights: BENCHMARKS.md,
    "What limits each figure")."""
    rows = next(b for b in PIPELINED_SKINNY_TILES if b >= min(m, PIPELINED_SKINNY_MAX_M))
    tile = tile or PIPELINED_SKINNY_TILES[rows]
    return tile, split_count(gemm_pipelined.split_counters_size(tile, m, n, gated), -(-k // tile.bk))


def split_count(tiles: int, slabs: int, min_slabs: int = MIN_SPLIT_SLABS, blocks: int = SM_COUNT) -> int:
    """K splits for a grid of `tiles` output tiles over `slabs` K slabs: about `blocks` blocks (one per SM by
    default), round(blocks / tiles), at least 1, each split at least min_slabs slabs long, none empty."""
    splits = max(1, min(round(blocks / tiles), slabs // min_slabs))
    while (splits - 1) * -(-slabs // splits) >= slabs:   # no empty split
        splits -= 1
    return splits


def split_workspace_sizes(weights, bf16_inputs: bool) -> tuple[int, int]:
    """(float32 partials, int32 counters) that every split plan of x (m, K) @ W^T needs, for weights given as
    (n, k, gated) (the runner allocates them once; matmul(..., split_workspace=)): the skinny plans of
    gemm_pipelined up to PIPELINED_SKINNY_MAX_M rows and, with bf16 inputs, gemm_wgmma's and gemm_tma's split
    plans from WGMMA_SPLIT_MIN_M rows (wherever they may run: the sizes do not ask the GPU)."""
    plans = [(gemm_pipelined.split_partials_size(t, m, n, s, gated), gemm_pipelined.split_counters_size(t, m, n, gated))
             for n, k, gated in weights for m in PIPELINED_SKINNY_TILES
             for t, s in [skinny_plan(m, n, k, bf16_inputs, gated)] if s > 1]
    if bf16_inputs:
        plans += [(gemm_wgmma.split_partials_size(t, m, n, s), gemm_wgmma.tiles(t, m, n))
                  for n, k, _ in weights for m in range(wgmma_split_min_m(n, k), WGMMA_MIN_M)
                  for t, s in [wgmma_split_plan(m, n, k)] if s > 1]
        plans += [(gemm_tma.split_partials_size(t, m, n, s), gemm_tma.tiles(t, m, n))
                  for n, k, _ in weights for m in range(wgmma_split_min_m(n, k), WGMMA_MIN_M)
                  for t, s in [tma_plan(m, n, k)] if s > 1]
    return max([1] + [p for p, _ in plans]), max([1] + [c for _, c in plans])


def wgmma_tile(m: int, n: int) -> WgmmaTile:
    """The tile gemm_wgmma uses for x (m, K) @ W (n, K)^T (n: the weight's rows; gated, 2F, which a block covers
    128 rows at a time as well): above 128 rows WGMMA_TALL_TILE where its grid has WGMMA_TALL_MIN_BLOCKS
    blocks; else, with more 128 x 128 blocks than one wave, the three-stage tile that fits two blocks per SM;
    else the four-stage one (docs/performance.md, "gemm_wgmma")."""
    if (WGMMA_TALL_IN_ENGINE and m > WGMMA_TALL_TILE.bm // 2
            and gemm_wgmma.tiles(WGMMA_TALL_TILE, m, n) >= WGMMA_TALL_MIN_BLOCKS):
        return WGMMA_TALL_TILE
    return WGMMA_TWO_BLOCK_TILE if gemm_wgmma.tiles(WGMMA_TILE, m, n) > WGMMA_ONE_WAVE else WGMMA_TILE


def uses_tma(m: int) -> bool:
    """Whether a warpgroup GEMM of m rows (wgmma_plan's) runs gemm_tma: the prefill plans with TMA_IN_ENGINE,
    and the decode split plans with TMA_DECODE_IN_ENGINE as well."""
    return TMA_IN_ENGINE and (m >= WGMMA_MIN_M or TMA_DECODE_IN_ENGINE)


def tma_plan(m: int, n: int, k: int) -> tuple[TmaTile, int]:
    """(tile, splits) of gemm_tma for x (m, k) @ W (n, k)^T: tma_tile(m, n) over the whole K from WGMMA_MIN_M
    rows; from TMA_DECODE_WIDE_MIN_M rows TMA_DECODE_WIDE_TILE over the whole K where its grid has TMA_MIN_BLOCKS
    blocks; else the first of TMA_DECODE_TILES whose rows cover m with K split as TMA_DECODE_SPLITS says for those
    rows (split_count: about that many blocks, splits of at least that many slabs). n: the weight's rows."""
    if m >= WGMMA_MIN_M:
        return tma_tile(m, n), 1
    wide = TmaTile(*TMA_DECODE_WIDE_TILE)
    if m >= TMA_DECODE_WIDE_MIN_M and gemm_tma.tiles(wide, m, n) >= TMA_MIN_BLOCKS:
        return wide, 1
    rows = next(r for r in TMA_DECODE_TILES if m <= r)
    # (TmaTile of a plain tuple too: tools/profile_step.py --set gives literals)
    tile, (blocks, min_slabs) = TmaTile(*TMA_DECODE_TILES[rows]), TMA_DECODE_SPLITS[rows]
    return tile, split_count(gemm_tma.tiles(tile, m, n), -(-k // wgmma.TILE_K), min_slabs, blocks)


def tma_tile(m: int, n: int) -> TmaTile:
    """The tile gemm_tma uses for x (m, K) @ W (n, K)^T (n: the weight's rows, gated 2F): the first of TMA_TILES
    whose grid has TMA_MIN_BLOCKS blocks, else the one with the most."""
    for tile in TMA_TILES:
        if gemm_tma.tiles(tile, m, n) >= TMA_MIN_BLOCKS:
            return tile
    return max(TMA_TILES, key=lambda t: gemm_tma.tiles(t, m, n))
