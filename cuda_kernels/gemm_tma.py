"""The warp-specialized Hopper GEMM of the matmul family: ``out = x @ W^T`` on warpgroup tensor cores (wgmma),
its operands brought into shared memory by the Tensor Memory Accelerator (TMA), one warp loading for the
warpgroups that multiply.

    out[m, n] = sum_k bf16(x)[m, k] * W[n, k]                (bf16 x bf16 products, fp32 sums)

Operands, outputs and epilogues as gemm_wgmma's (x as its bf16 plane, W (N, K) uint16 bf16, out (M, cols)
float32 or the bf16 plane; gated SiLU * up; K split over blocks for decode batches). Needs K % 8 == 0 and
compute capability 9.0. Twin: reference.matmul.matmul(x, W, bf16_inputs=True).

Why after gemm_wgmma (version 12 of matmul.py's list): there every thread copies its 16-byte chunks of every
slab with cp.async (a 128 x 128 block: 16 copies a thread a slab, each with its address arithmetic), waits for
its own copies, and the whole block meets at a barrier each slab before anyone multiplies or reuses a buffer,
so the warps alternate between copying and multiplying. Here one thread issues a slab's copies as a few TMA
instructions, one per 64-row box (cuda_kernels/tma.py), that write the swizzled layout wgmma reads, and the
copies and the products meet through mbarriers, per stage, instead of block barriers:

    full[s]   the producer arms it with the stage's bytes; the copies complete them; consumers wait on it
    empty[s]  each consumer warp arrives once its products of the stage are done; the producer waits on it
              before it loads the stage again (so no thread is ever two phases behind a barrier)

Thread mapping: grid = (ceil(M / BM), ceil(cols / (BN or BN / 2 gated)), splits). A block is BM / 64 consumer
warpgroups (as gemm_wgmma: warpgroup g owns rows 64 g .. 64 g + 63 of the tile and all BN columns, BN / 2
accumulators a thread) and one producer warp after them, whose lane 0 issues every copy. A stage holds one
64-deep K slab: x's BM rows, then W's BN rows (gated: the BN / 2 gate rows of the block's features, then their
up rows), each part copied in boxes of X_BOX or W_BOX rows, every box on 1,024 bytes. The producer loads W's
boxes of the first STAGES slabs before the PDL wait (weights are never written), x's after it, then stage by
stage as consumers free them.
Consumers issue a slab's four k16 wgmma, wait for the previous slab's (wgmma.wait_group 1) and free that
stage: the tensor cores always have the next slab's products queued.

x's tensor map covers the whole planes buffer (its capacity in rows of K), not just M rows: one map per buffer
serves every M, so a CUDA graph captured for one batch size keeps its maps. Rows from M to the capacity hold
stale planes; they only ever reach output rows >= M, which are never stored (rows are independent in a
product). W's rows and K past the array are zeros (the map's out-of-bounds fill).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import pdl, tma
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.gemm_pipelined import check_planes_args
from cuda_kernels.gemm_wgmma import epilogue
from cuda_kernels.launch import OPT_IN_SHARED_LIMIT, launch, view
from cuda_kernels.primitives import WARP
from cuda_kernels.split_k import check_split_args, meeting, partials_size, split_range
from cuda_kernels.tma import BARRIER_DTYPE, BARRIER_WORDS
from cuda_kernels.wgmma import TILE_ALIGN, TILE_K, WARPGROUP, aligned_start, wgmma_k64, wgmma_wait
from numba import cuda, float32, uint16


class TmaTile(NamedTuple):
    """Block tile BM x BN (BM: 64 to 256, one consumer warpgroup per 64 rows; BN the wgmma's N, up to 256, a
    multiple of W_BOX, gated of 2 W_BOX) and STAGES shared buffers of one 64-deep K slab."""
    bm: int = 128
    bn: int = 256
    stages: int = 4


# The simulator's tile: one consumer warpgroup, 16 columns (the emulated wgmma is a Python loop).
SIM_TILE = TmaTile(64, 16, 3)
MAX_STAGES = 8   # (the barriers' shared array has a fixed size)
# NOTE: a module constant, not the expression in the kernel: Numba types a shared array's shape only from a
# constant, and does not fold 2 * MAX_STAGES * BARRIER_WORDS (the simulator does).
BARRIER_ELEMENTS = 2 * MAX_STAGES * BARRIER_WORDS
# Rows of a box: one map per array serves every tile (a tile's stage is loaded box by box), so that the maps the
# eager steps make are all a captured graph needs. x's box is a warpgroup's 64 rows; W's is 64 rows on the GPU
# and 8 in the simulator, whose tile is 16 columns wide.
X_BOX = 64
W_BOX = 8 if SIMULATOR else 64


def shared_bytes(tile: TmaTile) -> int:
    """Dynamic shared memory of a block: STAGES slabs of BM + BN rows of 128 bytes, and room to align them."""
    return tile.stages * (tile.bm + tile.bn) * TILE_K * 2 + TILE_ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gemm_kernel(bm: int, bn: int, stages: int, gated: bool = False, planes_out: bool = False,
                 split_k: bool = False):
    """The kernel for one tile and epilogue (the module docstring's mapping)."""
    tile = TmaTile(bm, bn, stages)
    if bm % X_BOX or not 64 <= bm <= 256 or bn % (2 * W_BOX if gated else W_BOX) or not 8 <= bn <= 256 \
            or not 2 <= stages <= MAX_STAGES or shared_bytes(tile) > OPT_IN_SHARED_LIMIT:
        raise ValueError(f"gemm_tma tile {tuple(tile)}: need BM a multiple of 64 in 64 .. 256, BN a multiple of "
                         f"{W_BOX} ({2 * W_BOX} gated) up to 256, 2 <= stages <= {MAX_STAGES}, and its stages in "
                         f"{OPT_IN_SHARED_LIMIT} bytes of shared memory")
    GROUPS = bm // 64
    CONSUMERS = WARPGROUP * GROUPS
    THREADS = CONSUMERS + WARP                 # the consumer warpgroups, then the producer warp
    W_ROWS = bn // 2 if gated else bn          # W rows of one part of a stage (gated: gate, then up)
    A_ELEMS = bm * TILE_K
    STAGE = A_ELEMS + bn * TILE_K              # bf16 per stage: a multiple of 512 (1,024 bytes)
    STAGE_BYTES = 2 * STAGE
    ACC = bn // 2
    FULL, EMPTY = 0, MAX_STAGES                # barrier indices: full[s], empty[s]
    # NOTE: on the GPU lane 0 of a consumer warp frees a stage for its warp: a warpgroup's wgmma is one
    # operation, done for every lane once one lane's wait returns. The simulator's lanes are separate threads
    # that may lag far behind lane 0 (still reading the stage), so there each consumer thread frees it.
    RELEASERS = CONSUMERS if SIMULATOR else CONSUMERS // WARP
    mma = wgmma_k64(bn, False)
    wait_previous, wait_all = wgmma_wait(1), wgmma_wait(0)
    store_tile = epilogue(bm, bn, gated, planes_out)
    meet = meeting(ACC, CONSUMERS)

    @cuda.jit(device=True, inline=True)
    def load_weight(sh, base, w_map, cols, k0, bars, s):
        """W's box(es) of slab k0 into the stage at base: rows blockIdx.y * BN ..., or gated the gate rows of
        the block's features, then their up rows (cols further down W)."""
        row0 = cuda.blockIdx.y * W_ROWS
        for part in range(2 if gated else 1):
            for b in range(W_ROWS // W_BOX):
                tma.tma_load(sh, base + A_ELEMS + (part * W_ROWS + b * W_BOX) * TILE_K, w_map, k0,
                             part * cols + row0 + b * W_BOX, W_BOX, bars, FULL + s)

    @cuda.jit(device=True, inline=True)
    def load_x(sh, base, x_map, k0, bars, s):
        """x's boxes of slab k0 (one per warpgroup) into the stage at base."""
        for g in range(GROUPS):
            tma.tma_load(sh, base + g * X_BOX * TILE_K, x_map, k0, cuda.blockIdx.x * bm + g * X_BOX, X_BOX, bars,
                         FULL + s)

    @cuda.jit(device=True, inline=True)
    def produce(sh, skip, x_map, w_map, cols, first, count, bars):
        """Lane 0 of the producer warp: every copy of the block's slabs, each stage once consumers freed it."""
        lead = cuda.threadIdx.x == CONSUMERS
        if lead:
            tma.tensormap_acquire(x_map)
            tma.tensormap_acquire(w_map)
            for s in range(min(stages, count)):
                tma.mbarrier_arrive_expect(bars, FULL + s, STAGE_BYTES)
                load_weight(sh, skip + s * STAGE, w_map, cols, (first + s) * TILE_K, bars, s)
        pdl.grid_wait()
        if lead:
            for s in range(min(stages, count)):
                load_x(sh, skip + s * STAGE, x_map, (first + s) * TILE_K, bars, s)
            for kt in range(stages, count):
                s = kt % stages
                tma.mbarrier_wait(bars, EMPTY + s, (kt // stages - 1) % 2)
                base = skip + s * STAGE
                k0 = (first + kt) * TILE_K
                tma.mbarrier_arrive_expect(bars, FULL + s, STAGE_BYTES)
                load_weight(sh, base, w_map, cols, k0, bars, s)
                load_x(sh, base, x_map, k0, bars, s)
        tma.syncwarp()   # the warp reconverges before the barriers of the split-K meeting

    @cuda.jit(device=True, inline=True)
    def consume(sh, skip, count, bars, acc, group):
        """A consumer warpgroup: the products of every slab, each stage freed once its products are done."""
        pdl.grid_wait()
        for kt in range(count):
            s = kt % stages
            tma.mbarrier_wait(bars, FULL + s, (kt // stages) % 2)
            tma.syncwarp()   # wgmma is warp-aligned: every lane issues it together
            base = skip + s * STAGE
            mma(sh, base + group * 64 * TILE_K, base + A_ELEMS, acc)
            wait_previous()   # slab kt - 1's products are done (slab kt's run on)
            if kt > 0 and (SIMULATOR or cuda.threadIdx.x % WARP == 0):
                tma.mbarrier_arrive(bars, EMPTY + (kt - 1) % stages)
            tma.syncwarp()
        wait_all()

    @cuda.jit(device=True, inline=True)
    def gemm_body(x_map, w_map, out, K, partials, counters):
        sh = cuda.shared.array(0, uint16)
        bars = cuda.shared.array(BARRIER_ELEMENTS, BARRIER_DTYPE)
        skip = aligned_start(sh)   # the stages start on 1,024 bytes
        cols = out.shape[1]
        if cuda.threadIdx.x == 0:
            for s in range(stages):
                tma.mbarrier_init(bars, FULL + s, 1)                     # the producer's arrival, and bytes
                tma.mbarrier_init(bars, EMPTY + s, RELEASERS)
            tma.fence_barrier_init()
        cuda.syncthreads()
        first, count = 0, (K + TILE_K - 1) // TILE_K
        if split_k:
            first, count = split_range(count)
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = float32(0)
        group = cuda.threadIdx.x // WARPGROUP
        if cuda.threadIdx.x >= CONSUMERS:
            produce(sh, skip, x_map, w_map, cols, first, count, bars)
        else:
            consume(sh, skip, count, bars, acc, group)
        pdl.launch_dependents()
        if split_k:
            if cuda.gridDim.z > 1 and not meet(acc, partials, counters):
                return   # another block of the tile adds the splits and stores the result
        if cuda.threadIdx.x < CONSUMERS:
            store_tile(out, acc, group)

    # NOTE: launch_bounds caps the registers so that the block fits an SM: without it ptxas may give the consumers'
    # 128 accumulators (BN = 256) more registers than 65,536 / THREADS
    options = {} if SIMULATOR else {"launch_bounds": (THREADS, 1)}
    if split_k:
        @cuda.jit(**options)
        def gemm_tma_kernel(x_map, w_map, out, K, partials, counters):
            """x_map, w_map: tensor maps of x's plane (capacity rows x K) and W (N x K), cuda_kernels/tma.py;
            out (M, cols) f32 or, planes_out, u16; cols = N or, gated, N / 2; partials (>= tiles * gridDim.z * BM
            * BN,) f32 and counters (>= tiles,) int32, zero between launches."""
            gemm_body(x_map, w_map, out, K, partials, counters)
    else:
        @cuda.jit(**options)
        def gemm_tma_kernel(x_map, w_map, out, K):
            """As above, each block over the whole K."""
            gemm_body(x_map, w_map, out, K, out, out)   # (no partials: the split-K branch is compiled out)

    gemm_tma_kernel.threads = THREADS
    return gemm_tma_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def gemm_tma(plane, m: int, weight, out, stream=0, tile: TmaTile | None = None, gated: bool = False,
             splits: int = 1, split_workspace=None):
    """out = x @ W^T (gated: silu(x @ gate^T) * (x @ up^T) for W = [gate; up]) for an x (m, K) given as its bf16
    plane: plane uint16 (>= m * K,) flat, the planes buffer whose whole capacity (size // K rows) the tensor map
    covers. weight (N, K) uint16 C-contiguous, K % 8 == 0; out float32 (m, cols) or uint16 (m, cols) for the
    bf16 plane (cols = N, or N / 2 gated). tile: SIM_TILE in the simulator, else TmaTile(). splits > 1: K's slabs
    split over that many blocks per tile, with split_workspace = (partials, counters) (cuda_kernels/split_k.py;
    sizes: tiles and split_partials_size)."""
    N, K, cols = check_planes_args("gemm_tma", plane, m, weight, out, 1, gated)
    if m == 0 or N == 0:
        return
    tile = TmaTile(*tile) if tile else (SIM_TILE if SIMULATOR else TmaTile())
    kernel = _gemm_kernel(*tile, gated=bool(gated), planes_out=out.dtype == np.uint16, split_k=splits > 1)
    source = plane.array if not SIMULATOR and isinstance(plane, view) else plane   # (a view: its array)
    x_map = tma.tensor_map_to_end(source, K, X_BOX, stream)
    w_map = tma.tensor_map(weight, N, K, W_BOX, stream)
    grid = _cdiv(m, tile.bm), _cdiv(cols, tile.bn // 2 if gated else tile.bn)
    args = (x_map, w_map, out, np.int64(K))
    split_args = check_split_args("gemm_tma", splits, _cdiv(K, TILE_K), TILE_K, split_workspace,
                                  tiles(tile, m, N), tile.bm * tile.bn)
    if split_args:
        grid, args = (*grid, splits), (*args, *split_args)
    launch(kernel, grid, kernel.threads, stream, *args, shared=shared_bytes(tile), dependent=True)


def tiles(tile: TmaTile, m: int, n: int) -> int:
    """Output tiles (blocks per split) of x (m, K) @ W (n, K)^T (n: the weight's rows, gated 2F)."""
    return _cdiv(m, tile.bm) * _cdiv(n, tile.bn)


def split_partials_size(tile: TmaTile, m: int, n: int, splits: int) -> int:
    """float32 partial sums a split launch needs: every split's BM x BN accumulators of every tile."""
    return partials_size(tiles(tile, m, n), splits, tile.bm, tile.bn)
