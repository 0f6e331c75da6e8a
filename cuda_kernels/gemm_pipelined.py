"""The pipelined tensor-core GEMM of the matmul family: ``out = x @ W^T`` with x as bf16 planes, the K slabs
streamed into shared memory by cp.async several stages ahead, fragments loaded by ldmatrix.

    out[m, n] = sum_p sum_k planes[p, m, k] * W[n, k]        (bf16 x bf16 products, exact in fp32)

x (M, K) float32 is first cut into P bf16 planes (``bf16_planes``): with bf16_inputs one plane, x rounded to
the nearest bf16 (ties to even); otherwise three, the bf16x3 split x = hi + mid + lo exactly (see
cuda_kernels/mma.py, split_bf16x3, and gemm_tc.py's docstring). So the math is gemm_tc.gemm_tc's and the twin
is reference.matmul.matmul (and reference.matmul.bf16_planes for the planes). W (N, K) uint16 bf16 in
nn.Linear layout; out (M, N) float32. Needs K % 8 == 0 (16-byte rows for cp.async).

Why a second tensor-core GEMM: gemm_tc.gemm_tc stages a slab through registers (global -> registers ->
convert -> shared), so a block has one slab in flight and its warps wait on each slab's DRAM/L2 latency
(well under the mma rate: docs/performance.md). Here the conversion is done once per x element by
bf16_planes, both operands are bf16 in memory, and a slab goes from global to shared memory by cp.async
without registers, STAGES - 1 slabs ahead of the one the warps multiply.

Thread mapping (``gemm_pipelined``): grid = (ceil(M / BM), ceil(N / BN)), x fastest, so the blocks in flight
share W's column block (read once from DRAM) while x (a few MB) stays in L2. block = 32 * (BM / WM) *
(BN / WN) threads; warp w owns the WM x WN warp tile at rows (w // (BN/WN)) * WM, columns (w % (BN/WN)) * WN
of the block tile: (WM/16) x (WN/8) mma tiles, lane (g, t) = (lane // 4, lane % 4) accumulating rows g,
g + 8 and columns 2t, 2t + 1 of each (mma.py's layout). Per K slab (BK wide), the block's shared stage
holds P * BM rows of x planes then BN rows of W, each row BK bf16 plus 8 of padding; thread i copies the
16-byte chunks i, i + threads, ... of the stage. Per mma k-step, a warp takes each A fragment (16 x 16)
with one ldmatrix.x4 (lane l names row l % 16 at k offset 8 (l // 16)), and the B fragments of two n8 tiles
with one more (lane l names W row (l % 8) + 8 (l // 16) at k offset 8 ((l // 8) % 2)).

Pipeline (STAGES buffers, a cp.async group per slab): the prologue issues slabs 0 .. STAGES - 2. Iteration
kt waits until slab kt has landed (cp.async.wait_group STAGES - 2, then a block barrier, which also means
every warp is done with slab kt - 1), issues slab kt + STAGES - 1 into the buffer slab kt - 1 used, and
multiplies slab kt. One barrier per slab.

Split K (``splits`` > 1, grid z = splits): for a skinny M the tiles alone are too few blocks to stream a
weight from every SM, so block z of a tile multiplies only its share of the slabs and the blocks of a tile
meet as cuda_kernels/split_k.py says (the last to arrive adds the splits' partials in split order and runs
the epilogue: deterministic).

Programmatic dependent launch: the weight chunks of the first STAGES - 1 slabs are issued before
pdl.grid_wait (weights are never written), so they are in flight while the kernel before finishes; x's chunks
and everything else come after the wait.

Tails: rows >= M or N and k >= K are copied as zeros (cp.async with a source size of 0); outputs are stored
inside (M, N) only.

Gated (``gemm_pipelined(..., gated=True)``, the engine's gate/up at prefill): W = [gate; up] (2F, K) and

    out[m, f] = silu(sum_k x[m, k] gate[f, k]) * sum_k x[m, k] up[f, k]        out (M, F)

so the (M, 2F) product never reaches memory and no SiLU*mul kernel runs. Only the rows staged change: a block
covers BN / 2 features (grid y = ceil(F / (BN / 2))), and each warp's WN rows of the W stage are the gate
rows of its WN / 2 features followed by the up rows of the same features. So n8 tile j < NJ / 2 of a warp
holds gate columns and tile j + NJ / 2 the up columns of the same features, in the same lanes and
registers: the epilogue pairs acc[i, j] with acc[i, j + NJ / 2] without any exchange.

Planes out (``gemm_planes`` / ``gemm_pipelined`` given a uint16 out of (P * M, cols)): the epilogue writes
each result as its P bf16 planes (rounded, or the bf16x3 split; plane p in rows p * M ..), the layout
bf16_planes writes, so a GEMM that multiplies the result next (matmul.mlp: the down projection after the
gated gate/up) reads it as its x planes: no float32 intermediate and no conversion kernel between them.

Shared memory: STAGES * (P * BM + BN) * (BK + 8) * 2 bytes, dynamic, opted in above 48 KB per kernel
(by cuda_kernels/launch.py). NOTE: the 8 bf16 of padding make a row 16 bytes longer than BK, so the 8 rows
one ldmatrix matrix reads fall in 8 different 16-byte bank groups (row stride 80 or 144 bytes): conflict-free.

Versions (continuing matmul.py's list): 6. this kernel, for prefill and large batches on the GPU (matmul
sends x here when K % 8 == 0 and a planes workspace is given; gemm_tc stays for the rest); its gated
epilogue (matmul.gated_matmul) replaced gemm + activation.silu_and_mul there, and its planes output the
conversion of the MLP's activation (matmul.mlp). 7. the same kernel with K split over blocks and skinny
tiles (skinny_plan), for decode batches between gemv's rows and PIPELINED_SKINNY_MAX_M (given a split
workspace). Which tile and how many splits run for a shape is matmul_policy.py's choice.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.activation import silu
from numba import cuda, float32, int64, uint16, uint32

from cuda_kernels.async_copy import CHUNK, cp_async_commit, cp_async_wait, ldmatrix_x4, slab_issuer
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch, view
from cuda_kernels.mma import mma_bf16_m16n8k16, split_bf16x3
from cuda_kernels import pdl
from cuda_kernels.planes import pieces, planes_store
from cuda_kernels.primitives import WARP, f32_to_bf16
from cuda_kernels import split_k as split
from cuda_kernels.split_k import check_split_args, meeting, split_range


class PipelinedTile(NamedTuple):
    """Block tile BM x BN, K slab BK, warp tile WM x WN, STAGES shared buffers, and the blocks per SM the
    registers must allow (ptxas launch bounds; 0: ptxas decides)."""
    bm: int = 128
    bn: int = 128
    bk: int = 32
    wm: int = 64
    wn: int = 32
    stages: int = 4
    min_blocks: int = 0


# The simulator's tile: 2 warps of 16 x 16, two k-steps a slab, three stages (every code path, 64 threads).
SIM_TILE = PipelinedTile(16, 32, 32, 16, 16, 3)


def shared_bytes(tile: PipelinedTile, bf16_inputs: bool) -> int:
    """Dynamic shared memory of a block: STAGES stages of P * BM rows of x planes and BN rows of W."""
    return tile.stages * (pieces(bf16_inputs) * tile.bm + tile.bn) * (tile.bk + CHUNK) * 2


def workspace_size(m: int, k: int, bf16_inputs: bool) -> int:
    """uint16 elements of the planes workspace for x (m, k)."""
    return pieces(bf16_inputs) * m * k


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _planes_kernel(bf16_inputs: bool):
    store = planes_store(pieces(bf16_inputs))

    @cuda.jit
    def bf16_planes_kernel(x, planes):
        """x (M * K,) f32 flat; planes (>= P * M * K,) u16: planes[p * M * K + i] = piece p of x[i].
        One thread per element, grid-stride."""
        size = x.shape[0]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, size, step):
            store(planes, size, i, x[i])

    return bf16_planes_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _gemm_kernel(bm: int, bn: int, bk: int, wm: int, wn: int, stages: int, min_blocks: int, planes_per_x: int,
                 gated: bool = False, planes_out: bool = False, split_k: bool = False):
    """The kernel for one tile, number of x planes and epilogue (see the module docstring for the mapping);
    planes_out: out is uint16 (P * M, cols), the P bf16 planes of the result, else float32 (M, cols);
    split_k: the K range is split over gridDim.z blocks per tile, which meet through a partials workspace."""
    tile = PipelinedTile(bm, bn, bk, wm, wn, stages, min_blocks)
    if bk % 16 or wm % 16 or wn % 16 or bm % wm or bn % wn or stages < 2 or min_blocks < 0:
        raise ValueError(f"gemm_pipelined tile {tuple(tile)}: need bk, wm, wn multiples of 16, bm % wm == bn % wn "
                         f"== 0, stages >= 2 and min_blocks >= 0")
    P = planes_per_x
    WARPS_N = bn // wn
    THREADS = WARP * (bm // wm) * WARPS_N
    if THREADS > 1024:
        raise ValueError(f"gemm_pipelined tile {tuple(tile)} gives {THREADS} threads per block (max 1024)")
    LD = bk + CHUNK               # shared row stride in bf16 (16 bytes of padding, see the docstring)
    CH = bk // CHUNK              # 16-byte chunks per slab row
    A_ROWS = P * bm               # x plane rows of a stage (plane p's rows at p * bm)
    A_CHUNKS, B_CHUNKS = A_ROWS * CH, bn * CH
    A_PER, B_PER = _cdiv(A_CHUNKS, THREADS), _cdiv(B_CHUNKS, THREADS)
    B_OFF = A_ROWS * LD           # where W's rows start in a stage
    STAGE = (A_ROWS + bn) * LD    # bf16 per stage
    MI, NJ, S = wm // 16, wn // 8, bk // 16
    ACC = MI * NJ * 4             # accumulators per thread: a tile's partial sums are ACC * THREADS = bm * bn
    HALF_WN = wn // 2             # gated: features per warp (its gate rows, then its up rows)
    P_OUT = P if planes_out else 1  # row blocks of out: one per plane
    wait_for_slab = cp_async_wait(stages - 2)
    options = {"launch_bounds": (THREADS, min_blocks)} if min_blocks and not SIMULATOR else {}

    @cuda.jit(device=True, inline=True)
    def weight_row(r, cols):
        """(the weight row staged at row r of the block's W stage, whether it exists) for out's `cols` columns:
        row blockIdx.y * BN + r; gated, the gate (first WN / 2 rows of each warp's WN) or up row of feature
        f = blockIdx.y * BN / 2 + (r // WN) * WN / 2 + r % (WN / 2), i.e. row f or F + f (F = cols)."""
        if not gated:
            n = cuda.blockIdx.y * bn + r
            return n, n < cols
        f = cuda.blockIdx.y * (bn // 2) + (r // wn) * HALF_WN + r % HALF_WN
        return f + ((r % wn) // HALF_WN) * cols, f < cols

    @cuda.jit(device=True, inline=True)
    def store(out, m, n, v):
        """Write result v of (m, n): as it is, or as its P bf16 planes, piece p at row p * M + m (the layout
        bf16_planes writes, so the next GEMM reads out as its x planes)."""
        if not planes_out:
            out[m, n] = v
        elif P == 1:
            out[m, n] = f32_to_bf16(v)
        else:
            M = out.shape[0] // P_OUT
            hi, mid, lo = split_bf16x3(v)
            out[m, n] = uint16(hi)
            out[M + m, n] = uint16(mid)
            out[2 * M + m, n] = uint16(lo)

    @cuda.jit(device=True)
    def staging_map(out, K, amap, bmap):
        """This thread's chunks: map[e] = (offset in a stage, flat global offset at k = 0 or -1 for a row
        past M or N, the chunk's k within the slab); offset -1 for no chunk e."""
        M = out.shape[0] // P_OUT
        m0 = cuda.blockIdx.x * bm
        for e in range(A_PER):
            c = cuda.threadIdx.x + THREADS * e
            r, q = c // CH, c % CH
            p, m = r // bm, m0 + r % bm
            amap[e, 0] = r * LD + CHUNK * q if c < A_CHUNKS else -1
            amap[e, 1] = (p * M + m) * K + CHUNK * q if c < A_CHUNKS and m < M else -1
            amap[e, 2] = CHUNK * q
        for e in range(B_PER):
            c = cuda.threadIdx.x + THREADS * e
            r, q = c // CH, c % CH
            n, exists = weight_row(r, out.shape[1])
            bmap[e, 0] = B_OFF + r * LD + CHUNK * q if c < B_CHUNKS else -1
            bmap[e, 1] = n * K + CHUNK * q if c < B_CHUNKS and exists else -1
            bmap[e, 2] = CHUNK * q

    issue = slab_issuer(bk)
    meet = meeting(ACC, THREADS)

    @cuda.jit(device=True, inline=True)
    def gemm_body(planes, w, out, K, partials, counters):
        sh = cuda.shared.array(0, uint16)
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        wm0 = (warp // WARPS_N) * wm
        wn0 = (warp % WARPS_N) * wn
        amap = cuda.local.array((A_PER, 3), int64)
        bmap = cuda.local.array((B_PER, 3), int64)
        staging_map(out, K, amap, bmap)
        acc = cuda.local.array(ACC, float32)   # acc[(i * NJ + j) * 4 + c]: mma tile (i, j), register c
        bf = cuda.local.array((NJ, 2), uint32)
        for e in range(ACC):
            acc[e] = float32(0)
        # this lane's ldmatrix rows (module docstring): A row l % 16 at k + 8 (l // 16); B row (l % 8) +
        # 8 (l // 16) at k + 8 ((l // 8) % 2)
        a_lane = (lane % 16) * LD + 8 * (lane // 16)
        b_lane = (lane % 8 + 8 * (lane // 16)) * LD + 8 * ((lane // 8) % 2)

        # this block's slabs: all of K, or with split_k its share (the launcher leaves no share empty)
        slabs = (K + bk - 1) // bk
        first, count = 0, slabs
        if split_k:
            first, count = split_range(slabs)
        # Prologue: the weight chunks of the first STAGES - 1 slabs go out before the PDL wait (weights are
        # never written), x's after it; one cp.async group each, so that slab s has landed once the first
        # STAGES + s groups have (what wait_for_slab checks at iteration s, below).
        for s in range(stages - 1):
            if s < count:
                issue(w, sh, s * STAGE, (first + s) * bk, K, B_PER, bmap)
            cp_async_commit()
        pdl.grid_wait()
        for s in range(stages - 1):
            if s < count:
                issue(planes, sh, s * STAGE, (first + s) * bk, K, A_PER, amap)
            cp_async_commit()
        for it in range(count):
            wait_for_slab()
            cuda.syncthreads()   # slab `it` is in shared memory for every thread; slab it - 1 is free
            nxt = it + stages - 1
            if nxt < count:
                issue(w, sh, (nxt % stages) * STAGE, (first + nxt) * bk, K, B_PER, bmap)
                issue(planes, sh, (nxt % stages) * STAGE, (first + nxt) * bk, K, A_PER, amap)
            cp_async_commit()    # (an empty group past the end keeps the count that wait_for_slab expects)
            base = (it % stages) * STAGE
            for s in range(S):
                for jj in range(NJ // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(sh, base + B_OFF + (wn0 + 16 * jj) * LD + 16 * s + b_lane)
                    bf[2 * jj, 0], bf[2 * jj, 1] = b0, b1
                    bf[2 * jj + 1, 0], bf[2 * jj + 1, 1] = b2, b3
                for p in range(P):
                    for i in range(MI):
                        a0, a1, a2, a3 = ldmatrix_x4(sh, base + (p * bm + wm0 + 16 * i) * LD + 16 * s + a_lane)
                        for j in range(NJ):
                            e = (i * NJ + j) * 4
                            acc[e], acc[e + 1], acc[e + 2], acc[e + 3] = mma_bf16_m16n8k16(
                                a0, a1, a2, a3, bf[j, 0], bf[j, 1], acc[e], acc[e + 1], acc[e + 2], acc[e + 3])
        pdl.launch_dependents()

        if split_k:
            if cuda.gridDim.z > 1 and not meet(acc, partials, counters):
                return   # another block of the tile adds the splits and stores the result

        m_base = cuda.blockIdx.x * bm + wm0 + lane // 4
        M = out.shape[0] // P_OUT
        if gated:
            # tile j holds gate and tile j + NJ / 2 up for features f_base + 8 j + (0, 1) (weight_row)
            f_base = cuda.blockIdx.y * (bn // 2) + (warp % WARPS_N) * HALF_WN + 2 * (lane % 4)
            for i in range(MI):
                for j in range(NJ // 2):
                    for c in range(4):
                        m = m_base + 16 * i + 8 * (c // 2)
                        f = f_base + 8 * j + c % 2
                        if m < M and f < out.shape[1]:
                            store(out, m, f, silu(acc[(i * NJ + j) * 4 + c]) * acc[(i * NJ + j + NJ // 2) * 4 + c])
        else:
            n_base = cuda.blockIdx.y * bn + wn0 + 2 * (lane % 4)
            for i in range(MI):
                for j in range(NJ):
                    for c in range(4):
                        m = m_base + 16 * i + 8 * (c // 2)
                        n = n_base + 8 * j + c % 2
                        if m < M and n < out.shape[1]:
                            store(out, m, n, acc[(i * NJ + j) * 4 + c])

    if split_k:
        @cuda.jit(**options)
        def gemm_pipelined_kernel(planes, w, out, K, partials, counters):
            """planes (>= P * M * K,) u16 flat; w (N * K,) u16 flat; out (M, cols) f32 or, planes_out,
            (P * M, cols) u16, cols = N or, gated, N / 2; K the shared dimension; partials (>= tiles *
            gridDim.z * BM * BN,) f32 and counters (>= tiles,) int32, all zero between launches."""
            gemm_body(planes, w, out, K, partials, counters)
    else:
        @cuda.jit(**options)
        def gemm_pipelined_kernel(planes, w, out, K):
            """As above, each block over the whole K."""
            gemm_body(planes, w, out, K, out, out)   # (no partials: the split-K branch is compiled out)

    gemm_pipelined_kernel.threads = THREADS
    return gemm_pipelined_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def bf16_planes(x, planes, stream=0, bf16_inputs: bool = False):
    """planes[p * M * K + i] <- bf16 piece p of x.flat[i]: x rounded to nearest even (bf16_inputs), or the
    hi, mid and lo pieces of the bf16x3 split. x (M, K) float32, C-contiguous; planes (>= P M K,) uint16.
    Twin: reference.matmul.bf16_planes."""
    size = x.shape[0] * x.shape[1]
    need = pieces(bf16_inputs) * size
    if x.dtype != np.float32 or not x.is_c_contiguous():
        raise ValueError(f"bf16_planes: x must be C-contiguous float32, got {x.dtype} with strides {x.strides}")
    if planes.dtype != np.uint16 or len(planes.shape) != 1 or planes.shape[0] < need:
        raise ValueError(f"bf16_planes: planes must be a 1-D uint16 workspace of at least {need} elements, got "
                         f"{planes.dtype} {tuple(planes.shape)}")
    if size == 0:
        return
    threads = 256
    blocks = min(_cdiv(size, threads), 64 * 132)
    launch(_planes_kernel(bool(bf16_inputs)), blocks, threads, stream, view(x, (size,)), planes)


def gemm_pipelined(x, weight, out, workspace, stream=0, tile: PipelinedTile | None = None,
                   bf16_inputs: bool = False, gated: bool = False, splits: int = 1, split_workspace=None,
                   planes_ready: bool = False):
    """out = x @ W^T: bf16_planes(x) into workspace, then the pipelined kernel (as gemm_planes). x (M, K)
    float32 and weight (N, K) uint16 C-contiguous with K % 8 == 0; out (M, N) float32, or the planes of the
    result (see gemm_planes); workspace (>= workspace_size(M, K),) uint16. tile: by default SIM_TILE in the
    simulator, else PipelinedTile().
    gated: W is [gate; up] (N = 2F rows) and out (M, F) <- silu(x @ gate^T) * (x @ up^T) (the module
    docstring); twin reference.matmul.gated_matmul. splits, split_workspace: as gemm_planes. planes_ready: x's
    planes are in the workspace already (written by the kernel that produced x, e.g. rmsnorm's planes output):
    no conversion kernel."""
    if tuple(weight.shape[1:]) != tuple(x.shape[1:]):
        raise ValueError(f"gemm_pipelined: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    launch_args = _gemm_launch(workspace, x.shape[0], weight, out, tile, bf16_inputs, gated, splits, split_workspace)
    if not planes_ready:
        bf16_planes(x, workspace, stream, bf16_inputs)
    if launch_args:
        kernel, grid, args, nbytes = launch_args
        launch(kernel, grid, kernel.threads, stream, *args, shared=nbytes, dependent=True)


def gemm_planes(planes, m: int, weight, out, stream=0, tile: PipelinedTile | None = None, bf16_inputs: bool = False,
                gated: bool = False, splits: int = 1, split_workspace=None):
    """out = x @ W^T (or gated, as gemm_pipelined) for an x (m, K) given as its bf16 planes (uint16, at least
    workspace_size(m, K); what bf16_planes writes). out is float32 (m, cols), or uint16 (P * m, cols): the P
    bf16 planes of the result (P = pieces(bf16_inputs); plane p in rows p * m ..), which is the planes
    input of a GEMM that multiplies the result next (cols = N, or N / 2 gated).
    splits > 1: K is split over that many blocks per output tile (a skinny M leaves too few tiles to keep the
    SMs streaming the weight); split_workspace = (partials, counters): float32 (>= split_partials_size(...),)
    and int32 (>= split_counters_size(...),), the counters zero (each launch leaves them so)."""
    launch_args = _gemm_launch(planes, m, weight, out, tile, bf16_inputs, gated, splits, split_workspace)
    if launch_args:
        kernel, grid, args, nbytes = launch_args
        launch(kernel, grid, kernel.threads, stream, *args, shared=nbytes, dependent=True)


def _grid(tile: PipelinedTile, m: int, cols: int, gated: bool) -> tuple[int, int]:
    return _cdiv(m, tile.bm), _cdiv(cols, tile.bn // 2 if gated else tile.bn)


def split_counters_size(tile: PipelinedTile, m: int, n: int, gated: bool = False) -> int:
    """int32 counters a split launch needs: one per output tile. n: the weight's rows."""
    gx, gy = _grid(tile, m, n // 2 if gated else n, gated)
    return gx * gy


def split_partials_size(tile: PipelinedTile, m: int, n: int, splits: int, gated: bool = False) -> int:
    """float32 partial sums a split launch needs: every split's BM x BN accumulators of every tile."""
    return split.partials_size(split_counters_size(tile, m, n, gated), splits, tile.bm, tile.bn)


def check_planes_args(kernel: str, planes, m: int, weight, out, p: int, gated: bool) -> tuple[int, int, int]:
    """Check the arguments of a GEMM of x (m, K) given as its p bf16 planes (gemm_pipelined's, gemm_wgmma's):
    planes a 1-D uint16 workspace of at least p * m * K; weight (N, K) C-contiguous uint16, K % 8 == 0, N even
    when gated; out float32 (m, cols) or the result's uint16 planes (p * m, cols), cols = N or, gated, N / 2.
    Returns (N, K, cols); a ValueError names the kernel, the argument and what it got."""
    N, K = weight.shape
    cols = N // 2 if gated else N
    if weight.dtype != np.uint16 or not weight.is_c_contiguous():
        raise ValueError(f"{kernel}: weight must be C-contiguous uint16 ({N}, {K}), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if gated and N % 2:
        raise ValueError(f"{kernel}: a gated weight is [gate; up], an even number of rows, got {N}")
    if K % CHUNK:
        raise ValueError(f"{kernel}: K must be a multiple of {CHUNK} (16-byte rows), got {K}")
    if planes.dtype != np.uint16 or len(planes.shape) != 1 or planes.shape[0] < p * m * K:
        raise ValueError(f"{kernel}: planes must be a 1-D uint16 workspace of at least {p * m * K} elements, "
                         f"got {planes.dtype} {tuple(planes.shape)}")
    planes_out = out.dtype == np.uint16
    if out.dtype not in (np.float32, np.uint16) or tuple(out.shape) != ((p * m, cols) if planes_out else (m, cols)):
        raise ValueError(f"{kernel}: out must be float32 ({m}, {cols}) or its uint16 planes ({p * m}, {cols}), "
                         f"got {out.dtype} {tuple(out.shape)}")
    return N, K, cols


def _gemm_launch(planes, m: int, weight, out, tile, bf16_inputs: bool, gated: bool, splits: int = 1,
                 split_workspace=None):
    """Check the arguments of gemm_planes; (kernel, grid, kernel arguments, shared bytes), or None when there
    is nothing to compute."""
    N, K, cols = check_planes_args("gemm_pipelined", planes, m, weight, out, pieces(bf16_inputs), gated)
    if m == 0 or N == 0:
        return None
    tile = PipelinedTile(*tile) if tile else (SIM_TILE if SIMULATOR else PipelinedTile())
    grid = _grid(tile, m, cols, gated)
    args = (planes, view(weight, (N * K,)), out, np.int64(K))
    tiles = split_counters_size(tile, m, N, gated)
    split_args = check_split_args("gemm_pipelined", splits, _cdiv(K, tile.bk), tile.bk, split_workspace,
                                  tiles, tile.bm * tile.bn)
    if split_args:
        grid, args = (*grid, splits), (*args, *split_args)
    kernel = _gemm_kernel(*tile, pieces(bf16_inputs), bool(gated), out.dtype == np.uint16, splits > 1)
    return kernel, grid, args, shared_bytes(tile, bf16_inputs)


def valid_splits(tile: PipelinedTile, k: int) -> list[int]:
    """The split counts of K's slabs of BK that leave no split empty (split_k.valid_splits)."""
    return split.valid_splits(_cdiv(k, tile.bk))
