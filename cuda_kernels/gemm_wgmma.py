"""The Hopper GEMM of the matmul family: ``out = x @ W^T`` on warpgroup tensor cores (wgmma), x as its bf16
plane, both operands streamed into swizzled shared memory by cp.async, several K slabs ahead.

    out[m, n] = sum_k bf16(x)[m, k] * W[n, k]                (bf16 x bf16 products, fp32 sums)

x (M, K) float32 enters as its bf16 plane (gemm_pipelined.bf16_planes with bf16_inputs, or the plane a
kernel before wrote: rmsnorm's planes output, the gated GEMM's planes out); W (N, K) uint16 bf16 in
nn.Linear layout; out (M, N) float32. Needs K % 8 == 0 (16-byte rows for cp.async) and a GPU of compute
capability 9.0 (the instruction is sm_90a's). Twin: reference.matmul.matmul(x, W, bf16_inputs=True).

Why after gemm_pipelined: there every warp loads its A and B fragments from shared memory with ldmatrix and
issues m16n8k16 products, 32 of them per 64 x 32 warp tile and k-step; the loads, the issue slots and the
registers of the fragments cap mma.sync near 60% of the card's bf16 rate (BENCHMARKS.md). A wgmma takes both
operands from shared memory through descriptors (cuda_kernels/wgmma.py) and multiplies a 64 x BN x 16 block
for four warps in one instruction.

Thread mapping: grid = (ceil(M / BM), ceil(N / BN)), x fastest (the blocks in flight share W's column block,
as in gemm_pipelined). A block is BM / 64 warpgroups (128 threads each); warpgroup g owns rows 64 g .. 64 g
+ 63 of the block tile and all BN columns: BN / 2 fp32 accumulators per thread, laid out as wgmma.py says
(warp w of the group, lane (r, t): rows 16 w + r and + 8, columns 8 j + 2 t and + 1). A stage holds one
64-deep K slab: BM rows of x then BN rows of W, each row 128 bytes, swizzled (wgmma.swizzled), the stage on
a 1,024-byte boundary; thread i copies the 16-byte chunks i, i + threads, ... of each operand.

Pipeline (STAGES buffers, one cp.async group per slab, as gemm_pipelined): the prologue issues slabs
0 .. STAGES - 2 (W's chunks before the PDL wait: weights are never written). Iteration kt waits for its slab
(cp.async.wait_group STAGES - 2), makes its copies visible to the tensor cores (fence.proxy.async) and
synchronises the block; every warpgroup has then finished slab kt - 1 (wgmma_k64 waits for its products), so
slab kt + STAGES - 1 goes into that buffer; then the four k16 wgmma of slab kt. Tails: rows past M or N and
k past K are copied as zeros; outputs are stored inside (M, cols) only.

Gated (the engine's gate/up, W = [gate; up] (2F, K)): out[m, f] = silu(x gate^T)[m, f] * (x up^T)[m, f],
out (M, F). A block covers BN / 2 features: its W stage holds their gate rows, then their up rows, so
accumulator columns j and j + BN / 2 (registers 4 j + q and 4 (j + BN / 16) + q) of a thread are the gate and
up of one feature. Planes out: out uint16 (M, cols) gets bf16(result) (what the next GEMM reads as its x).

Versions (continuing matmul.py's list): 9. this kernel, one synchronous wgmma group per slab (the warps wait
for a slab's products before the next barrier). 10. ``overlap``: the products of slab kt are issued and left
running (wgmma.wait_group 1 waits only for slab kt - 1's), so the tensor cores work through the barrier and
the copies of the next slab; the copies then run STAGES - 2 slabs ahead, since slab kt - 1's buffer may still
be in use. 11. ``splits`` > 1 (grid z = splits): for decode batches, whose few output tiles leave most SMs
idle, block z of a tile multiplies only its share of the K slabs and the blocks of a tile meet as
cuda_kernels/split_k.py says (the last adds the partials in split order and runs the epilogue).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import pdl
from cuda_kernels.activation import silu
from cuda_kernels.async_copy import CHUNK, cp_async_commit, cp_async_wait, slab_issuer
from cuda_kernels.gemm_pipelined import check_planes_args
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch, view
from cuda_kernels.primitives import WARP, f32_to_bf16
from cuda_kernels import split_k as split
from cuda_kernels.split_k import check_split_args, meeting, split_range
from cuda_kernels.wgmma import (TILE_ALIGN, TILE_K, WARPGROUP, aligned_start, fence_async_shared, swizzled, wgmma_k64,
                                wgmma_wait)
from numba import cuda, float32, int64, uint16, uint32


class WgmmaTile(NamedTuple):
    """Block tile BM x BN (BM a multiple of 64: one warpgroup per 64 rows; BN the wgmma's N), STAGES shared
    buffers of one 64-deep K slab, the blocks per SM the registers must allow (0: ptxas decides), and
    overlap: a slab's wgmma still runs while the warps pass the next barrier (module docstring, version 10)."""
    bm: int = 128
    bn: int = 128
    stages: int = 4
    min_blocks: int = 0
    overlap: bool = False


# The simulator's tile: one warpgroup, 16 columns (every code path; the emulated wgmma is a Python loop).
SIM_TILE = WgmmaTile(64, 16, 3)


def shared_bytes(tile: WgmmaTile) -> int:
    """Dynamic shared memory of a block: STAGES slabs of BM + BN rows of 128 bytes, and room to align them."""
    return tile.stages * (tile.bm + tile.bn) * TILE_K * 2 + TILE_ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def epilogue(bm: int, bn: int, gated: bool, planes_out: bool):
    """The device function store_tile(out, acc, group): warpgroup `group` of a block stores its 64 x BN
    accumulators (wgmma.py's layout) to out (M, cols), inside the bounds only: acc as it is, or gated
    silu(gate) * up of its BN / 2 features; float32, or with planes_out the bf16 plane. Shared with
    cuda_kernels/gemm_tma.py."""
    NJ, HALF = bn // 8, bn // 2

    @cuda.jit(device=True, inline=True)
    def store(out, m, n, v):
        if planes_out:
            out[m, n] = f32_to_bf16(v)
        else:
            out[m, n] = v

    @cuda.jit(device=True, inline=True)
    def store_tile(out, acc, group):
        # NOTE: unsigned 32-bit indices (primitives' module docstring, "Index arithmetic")
        M, cols = uint32(out.shape[0]), uint32(out.shape[1])
        lane = cuda.threadIdx.x % WARP
        m_base = uint32(cuda.blockIdx.x * bm + 64 * group + 16 * ((cuda.threadIdx.x % WARPGROUP) // WARP) + lane // 4)
        if gated:
            f_base = uint32(cuda.blockIdx.y * HALF + 2 * (lane % 4))
            for j in range(NJ // 2):
                for q in range(4):
                    m, f = m_base + uint32(8 * (q // 2)), f_base + uint32(8 * j + q % 2)
                    if m < M and f < cols:
                        store(out, m, f, silu(acc[4 * j + q]) * acc[4 * (j + NJ // 2) + q])
        else:
            n_base = uint32(cuda.blockIdx.y * bn + 2 * (lane % 4))
            for j in range(NJ):
                for q in range(4):
                    m, n = m_base + uint32(8 * (q // 2)), n_base + uint32(8 * j + q % 2)
                    if m < M and n < cols:
                        store(out, m, n, acc[4 * j + q])

    return store_tile


@functools.lru_cache(maxsize=None)
def _gemm_kernel(bm: int, bn: int, stages: int, min_blocks: int, overlap: bool, gated: bool = False,
                 planes_out: bool = False, split_k: bool = False):
    """The kernel for one tile and epilogue (see the module docstring for the mapping); split_k: K is split over
    gridDim.z blocks per tile, which meet through a partials workspace (cuda_kernels/split_k.py)."""
    tile = WgmmaTile(bm, bn, stages, min_blocks, overlap)
    if bm % 64 or bn % (16 if gated else 8) or not 8 <= bn <= 256 or stages < 2 + overlap or min_blocks < 0:
        raise ValueError(f"gemm_wgmma tile {tuple(tile)}: need BM a multiple of 64, BN a multiple of 8 (16 gated) "
                         f"in 8 .. 256, stages >= 2 (3 with overlap), min_blocks >= 0")
    THREADS = WARPGROUP * (bm // 64)
    if THREADS > 1024:
        raise ValueError(f"gemm_wgmma tile {tuple(tile)} gives {THREADS} threads per block (max 1024)")
    CH = TILE_K // CHUNK                      # 16-byte chunks per row
    A_ELEMS, B_ELEMS = bm * TILE_K, bn * TILE_K
    STAGE = A_ELEMS + B_ELEMS                 # bf16 per stage: a multiple of 512 (1,024 bytes)
    A_PER, B_PER = _cdiv(bm * CH, THREADS), _cdiv(bn * CH, THREADS)
    ACC = bn // 2                             # accumulators per thread
    HALF = bn // 2                            # gated: features per block
    mma = wgmma_k64(bn, not overlap)
    wait_previous, wait_all = wgmma_wait(1), wgmma_wait(0)
    # slabs in flight ahead of the one multiplied: with overlap one fewer, since the buffer of slab kt - 1 may
    # still be read by the tensor cores when slab kt's copies go out
    AHEAD = stages - 1 - overlap
    wait_for_slab = cp_async_wait(AHEAD - 1)
    options = {"launch_bounds": (THREADS, min_blocks)} if min_blocks and not SIMULATOR else {}

    @cuda.jit(device=True, inline=True)
    def weight_row(r, cols):
        """(W's row staged at row r of the block's W stage, whether it exists): row blockIdx.y * BN + r; gated,
        the gate (r < BN / 2) or up row of feature f = blockIdx.y * BN / 2 + r % (BN / 2): f or F + f."""
        if not gated:
            n = cuda.blockIdx.y * bn + r
            return n, n < cols
        f = cuda.blockIdx.y * HALF + r % HALF
        return f + (r // HALF) * cols, f < cols

    @cuda.jit(device=True)
    def staging_map(M, cols, K, amap, bmap):
        """This thread's chunks: map[e] = (offset in a stage, flat global offset at k = 0 or -1 for a row past
        M or N, the chunk's k within the slab); offset -1 for no chunk e."""
        m0 = cuda.blockIdx.x * bm
        for e in range(A_PER):
            c = cuda.threadIdx.x + THREADS * e
            r, q = c // CH, c % CH
            amap[e, 0] = swizzled(r, q) if c < bm * CH else -1
            amap[e, 1] = (m0 + r) * K + CHUNK * q if c < bm * CH and m0 + r < M else -1
            amap[e, 2] = CHUNK * q
        for e in range(B_PER):
            c = cuda.threadIdx.x + THREADS * e
            r, q = c // CH, c % CH
            n, exists = weight_row(r, cols)
            bmap[e, 0] = A_ELEMS + swizzled(r, q) if c < bn * CH else -1
            bmap[e, 1] = n * K + CHUNK * q if c < bn * CH and exists else -1
            bmap[e, 2] = CHUNK * q

    issue = slab_issuer(TILE_K)
    store_tile = epilogue(bm, bn, gated, planes_out)
    meet = meeting(ACC, THREADS)

    @cuda.jit(device=True, inline=True)
    def gemm_body(plane, w, out, K, partials, counters):
        sh = cuda.shared.array(0, uint16)
        M, cols = out.shape[0], out.shape[1]
        skip = aligned_start(sh)   # the stages start on 1,024 bytes
        amap = cuda.local.array((A_PER, 3), int64)
        bmap = cuda.local.array((B_PER, 3), int64)
        staging_map(M, cols, K, amap, bmap)
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = float32(0)
        group = cuda.threadIdx.x // WARPGROUP
        # this block's slabs: all of K, or with split_k its share (the launcher leaves no share empty)
        first, count = 0, (K + TILE_K - 1) // TILE_K
        if split_k:
            first, count = split_range(count)
        # Prologue: W's chunks of the first AHEAD slabs before the PDL wait, x's after; one cp.async group per
        # slab, so that slab s has landed once AHEAD + 1 + s groups have (wait_for_slab at iteration s).
        for s in range(AHEAD):
            if s < count:
                issue(w, sh, skip + s * STAGE, (first + s) * TILE_K, K, B_PER, bmap)
            cp_async_commit()
        pdl.grid_wait()
        for s in range(AHEAD):
            if s < count:
                issue(plane, sh, skip + s * STAGE, (first + s) * TILE_K, K, A_PER, amap)
            cp_async_commit()
        for it in range(count):
            wait_for_slab()
            fence_async_shared()
            # slab `it` is in shared memory for every warpgroup; every warpgroup is done with slab it - 1 (with
            # overlap: it - 2), whose buffer the next copies reuse
            cuda.syncthreads()
            nxt = it + AHEAD
            if nxt < count:
                base = skip + (nxt % stages) * STAGE
                issue(w, sh, base, (first + nxt) * TILE_K, K, B_PER, bmap)
                issue(plane, sh, base, (first + nxt) * TILE_K, K, A_PER, amap)
            cp_async_commit()    # (an empty group past the end keeps the count that wait_for_slab expects)
            base = skip + (it % stages) * STAGE
            mma(sh, base + group * 64 * TILE_K, base + A_ELEMS, acc)
            if overlap:
                wait_previous()   # slab it - 1's products are done; slab it's run on past the next barrier
        if overlap:
            wait_all()
        pdl.launch_dependents()
        if split_k:
            if cuda.gridDim.z > 1 and not meet(acc, partials, counters):
                return   # another block of the tile adds the splits and stores the result

        store_tile(out, acc, group)

    if split_k:
        @cuda.jit(**options)
        def gemm_wgmma_kernel(plane, w, out, K, partials, counters):
            """plane (>= M * K,) u16 flat: bf16(x); w (N * K,) u16 flat; out (M, cols) f32 or, planes_out, u16;
            cols = N or, gated, N / 2; K the shared dimension; partials (>= tiles * gridDim.z * BM * BN,) f32
            and counters (>= tiles,) int32, all zero between launches."""
            gemm_body(plane, w, out, K, partials, counters)
    else:
        @cuda.jit(**options)
        def gemm_wgmma_kernel(plane, w, out, K):
            """As above, each block over the whole K."""
            gemm_body(plane, w, out, K, out, out)   # (no partials: the split-K branch is compiled out)

    gemm_wgmma_kernel.threads = THREADS
    return gemm_wgmma_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def gemm_wgmma(plane, m: int, weight, out, stream=0, tile: WgmmaTile | None = None, gated: bool = False,
               splits: int = 1, split_workspace=None):
    """out = x @ W^T (gated: out = silu(x @ gate^T) * (x @ up^T) for W = [gate; up]) for an x (m, K) given as
    its bf16 plane (uint16 (>= m * K,), what gemm_pipelined.bf16_planes writes with bf16_inputs). weight
    (N, K) uint16 C-contiguous, K % 8 == 0; out float32 (m, cols), or uint16 (m, cols) for bf16(result), the
    plane the next GEMM reads (cols = N, or N / 2 gated). tile: SIM_TILE in the simulator, else WgmmaTile().
    splits > 1: K's 64-deep slabs split over that many blocks per output tile (version 11: a decode batch
    leaves too few tiles to stream the weight from every SM); split_workspace = (partials, counters): float32
    (>= split_partials_size(...),) and int32 (>= tiles(...),), the counters zero (each launch leaves them so)."""
    N, K, cols = check_planes_args("gemm_wgmma", plane, m, weight, out, 1, gated)
    if m == 0 or N == 0:
        return
    tile = WgmmaTile(*tile) if tile else (SIM_TILE if SIMULATOR else WgmmaTile())
    grid = _cdiv(m, tile.bm), _cdiv(cols, tile.bn // 2 if gated else tile.bn)
    args = (plane, view(weight, (N * K,)), out, np.int64(K))
    split_args = check_split_args("gemm_wgmma", splits, _cdiv(K, TILE_K), TILE_K, split_workspace,
                                  tiles(tile, m, N), tile.bm * tile.bn)
    if split_args:
        grid, args = (*grid, splits), (*args, *split_args)
    kernel = _gemm_kernel(*tile, gated=bool(gated), planes_out=out.dtype == np.uint16, split_k=splits > 1)
    launch(kernel, grid, kernel.threads, stream, *args, shared=shared_bytes(tile), dependent=True)


def tiles(tile: WgmmaTile, m: int, n: int) -> int:
    """Output tiles (blocks per split) of x (m, K) @ W (n, K)^T; a split launch needs an int32 counter for each.
    n: the weight's rows (gated: 2F, which a block covers BN rows at a time as well)."""
    return _cdiv(m, tile.bm) * _cdiv(n, tile.bn)


def split_partials_size(tile: WgmmaTile, m: int, n: int, splits: int) -> int:
    """float32 partial sums a split launch needs: every split's BM x BN accumulators of every tile."""
    return split.partials_size(tiles(tile, m, n), splits, tile.bm, tile.bn)


def valid_splits(k: int) -> list[int]:
    """The split counts of K's 64-deep slabs that leave no split empty (split_k.valid_splits)."""
    return split.valid_splits(_cdiv(k, TILE_K))
