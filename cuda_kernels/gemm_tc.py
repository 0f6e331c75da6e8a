"""Matmul against bf16 weights on the tensor cores: ``out = x @ W^T`` with mma.sync m16n8k16 (bf16 in, fp32
accumulators), tiled through shared memory.

    out[m, n] = sum_k X[m, k] * bf16_to_f32(W[n, k])

x (M, K) float32; W (N, K) uint16 bf16 bits in nn.Linear layout; out (M, N) float32. X is x cut into three
bf16 pieces (fp32 mode, the default) or x rounded to bf16 (bf16_inputs). Twin: reference.matmul.matmul.

The bf16x3 split (fp32 mode). Tensor cores multiply bf16, but x is fp32, and the GPU may differ from the
reference only in summation order. So each x is cut into three bf16 pieces, x = hi + mid + lo exactly (24
significant bits = 8 + 8 + 8; mma.split_bf16x3), and out = hi @ W^T + mid @ W^T + lo @ W^T, three mma per
16 x 8 x 16 tile, all into the same fp32 accumulators. A product of two bf16 (8 significant bits each) is
exact in fp32, so every term piece * w is exact and only the order (and the tensor core's internal rounding)
of the fp32 sums differs from the reference. W is bf16 already: one B fragment serves all three pieces.
The price is 3x the tensor-core work: the ceiling is a third of the mma peak. Exactness needs the pieces to
be normal numbers: below about 2^-110 the low pieces become subnormal (or zero) and some low bits of x go
(an absolute error of at most about 2^-125 |w| per term, far under the tolerance). An infinite x stays
infinite (it is all hi); an infinite weight meets zero pieces and gives NaN, not +-inf (weights are finite).
With bf16_inputs there is one piece, bf16(x), staged as one shared-memory plane instead of three: one mma
per tile (the ceiling is the whole mma peak) and a third of the x staging and its shared memory.

Thread mapping (``gemm_tc``): grid = (ceil(N / BN), ceil(M / BM)), block = 32 * (BM / WM) * (BN / WN) * KW;
warp w works on warp tile v = w % ((BM/WM) * (BN/WN)), the WM x WN sub-tile at ((v // (BN/WN)) * WM,
(v % (BN/WN)) * WN), i.e. (WM/16) x (WN/8) mma tiles of 16 x 8, whose fragments follow cuda_kernels/mma.py
(lane (g, t) = (lane // 4, lane % 4) accumulates rows g, g + 8 and columns 2t, 2t + 1 of each), over the
k-steps of K group w // (number of warp tiles): a slab's BK / 16 k-steps are split into KW equal runs, one
per group (split-K inside the block, so that a skinny tile still has 8-16 warps), and at the end groups
1..KW-1 add their partial tiles into group 0's through shared memory, in that fixed order. Per BK slab,
thread i stages 4-element quads i, i + threads, ... of x (three bf16 planes, or one with bf16_inputs) and
of W into shared memory (one of STAGES buffers), while the next slab's quads are already loading into its
registers. The tile (BM, BN, BK, WM, WN, KW, STAGES) is an argument; the engine's choice by shape is
matmul_policy.gemm_tc_tile (16- and 32-row tiles for decode batches, 64 x 64 and 128 x 128 for prefill).

Version 4 of the matmul ladder (matmul.py's docstring lists all of them): what it changes over the tiled
SIMT gemm (gemm_simt.py) is the product itself, one mma for 16 x 8 x 16 multiply-adds instead of one FMA
each. Tiles are staged as packed bf16 quads (64-bit, conflict-free fragment loads), W is read as 64-bit
words when K % 4 == 0, the next slab is prefetched into registers; skinny tiles split K across the warps of
a block for decode batches; an optional second shared-memory stage takes one block barrier per slab instead
of two. Its addressing is flat: flat shared slabs and flat x / W, each thread's staging offsets computed
once instead of per slab, uint64 indices (no negative-index wraparound), no k checks on interior slabs
(integer index arithmetic was most of the main loop's instructions before: docs/performance.md).
Its limit is that each slab goes global -> registers -> shared, so a block has one slab in flight:
gemm_pipelined.py (version 6) streams several slabs ahead with cp.async instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, int64, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch, view
from cuda_kernels.matmul_args import check_args
from cuda_kernels.mma import halves, mma_bf16_m16n8k16, pack4, split_bf16x3
from cuda_kernels.primitives import WARP, f32_to_bf16


class GemmTcTile(NamedTuple):
    bm: int = 128  # output tile rows (M), a multiple of wm
    bn: int = 128  # output tile columns (N), a multiple of wn
    bk: int = 32   # K slab staged in shared memory per step, a multiple of 16 (one mma k-step)
    wm: int = 64   # rows of the warp tile, a multiple of 16 (m16 of the mma)
    wn: int = 32   # columns of the warp tile, a multiple of 8 (n8 of the mma)
    kw: int = 1    # K groups: warps splitting each slab's k-steps over the same warp tiles (bk/16 % kw == 0)
    stages: int = 1  # shared-memory slab buffers: 2 = one block barrier per slab instead of two
    min_blocks: int = 0  # blocks per SM the registers must allow (ptxas launch bounds); 0: ptxas decides

# Static shared memory is capped at 48 KB per block (more needs a dynamic opt-in: launch.OPT_IN_SHARED_LIMIT).
GEMM_TC_MAX_SHARED = 48 * 1024
# The simulator's default tile: 4 warps (2 along N, 2 K groups) with one k-step each, every code path at 128
# threads (one Python thread per simulated thread).
SIM_TILE = GemmTcTile(16, 16, 32, 16, 8, 2)


# ---------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------

def _occupancy(threads: int, min_blocks: int) -> dict:
    """cuda.jit options asking ptxas to fit `min_blocks` blocks of `threads` threads per SM in registers
    (spilling if it must); none for min_blocks 0, or in the simulator (which refuses launch_bounds)."""
    return {"launch_bounds": (threads, min_blocks)} if min_blocks and not SIMULATOR else {}


def _gemm_tc_pad(bk: int) -> int:
    """Rows of padding per k-step plane of gemm_tc's shared slabs, so that the slab stores are conflict-free.

    NOTE: a 64-bit store is served per half-warp: 16 consecutive quad indices, i.e. quads t = 0..3 (banks
    2t, 2t + 1) of 16 / 4 k-steps of one row when a row has Q = bk / 4 >= 16 quads, or of 2 k-steps of 2 rows
    when Q = 8. A row is 4 uint64 = 8 banks, so with bm (or bn) a multiple of 4, `pad` rows of padding put
    consecutive planes 8 * pad banks apart (mod 32): pad 1 spreads 4 k-steps over 0, 8, 16, 24; for Q = 8,
    pad 2 puts the second k-step 16 banks over and the second row 8 banks over (0, 8, 16, 24 again). Fragment
    reads are conflict-free either way (a half-warp reads 4 rows x 4 consecutive uint64 of one plane)."""
    return 2 if bk == 32 else 1


def gemm_tc_shared_bytes(tile: GemmTcTile, bf16_inputs: bool = False) -> int:
    """Static shared memory of a gemm_tc block: the x planes and the W slab (per stage), and the K-group
    reduction buffer when kw > 1. Must stay within GEMM_TC_MAX_SHARED."""
    steps = tile.bk // 16
    pieces = 1 if bf16_inputs else 3
    pad = _gemm_tc_pad(tile.bk)
    x_bytes = tile.stages * pieces * steps * (tile.bm + pad) * 4 * 8
    w_bytes = tile.stages * steps * (tile.bn + pad) * 4 * 8
    return x_bytes + w_bytes + (4 * tile.bm * tile.bn if tile.kw > 1 else 0)


@functools.lru_cache(maxsize=None)
def _gemm_tc_kernel(bm: int, bn: int, bk: int, wm: int, wn: int, kw: int, stages: int, min_blocks: int,
                    w_words: bool, bf16_inputs: bool):
    """The tensor-core gemm kernel for a BM x BN block tile of WM x WN warp tiles, BK-wide K slabs split over
    KW groups of warps, STAGES shared-memory buffers.

    Math: out[m, n] = sum_k X[m, k] * W[n, k] with X = x cut into its three bf16 pieces (hi + mid + lo, the
    bf16x3 split, module docstring) or, with bf16_inputs, x rounded to bf16 (one piece); computed as mma
    tiles D (16 x 8) += A (16 x 16) @ B (16 x 8) with A = a piece of x's tile and B[k, n] = W[n, k] (mma's
    "col" B is a row of W).

    Shared memory holds quads: a uint64 of 4 bf16 of one row at k = k0 + 16 s + 4 t .. + 3 (s: mma k-step of
    the slab, t = 0..3), xs[buf, p, s, row, t] for piece p of x and ws[buf, s, row, t] for W (flat arrays in
    that order, each row padded, see _gemm_tc_pad). For W that is
    just its memory layout (one 64-bit load). The fragments come from these quads with one 64-bit shared
    load per register pair: lane (g, t) takes quad t of rows g and g + 8 (A) and of column g (B), and uses
    low word -> a0 (row g) / a1 (row g + 8) / b0, high word -> a2 / a3 / b1.
    NOTE: this feeds mma the k's of a step in another order than its nominal layout (mma.py): its k-slots
    2t, 2t+1 hold real k 4t, 4t+1 and slots 2t+8, 2t+9 real k 4t+2, 4t+3. A and B use the same order, so the
    sum over k is unchanged; the order buys a whole quad per load and conflict-free banks (a half-warp reads
    4 rows x 4 consecutive quads = 32 consecutive words). Each lane's D elements keep the nominal layout.

    K groups (kw > 1): warp w works on warp tile w % (WARPS_M * WARPS_N) and on k-steps
    [(w // (WARPS_M * WARPS_N)) * S/kw, + S/kw) of every slab, so kw warps accumulate partial sums of the same
    outputs. At the end groups 1..kw-1 hand their accumulators to group 0 through shared memory one group at
    a time, group 0 adds them in that fixed order (deterministic, no atomics) and stores.
    Stages: with 2, the next slab is stored into the other buffer while this one is read (one block barrier
    per slab); with 1, the block waits for every warp to finish the slab before overwriting it (two).

    Tails: x rows >= M, W rows >= N and k >= K are staged as zeros (K need not be a multiple of 16 or 4);
    outputs are stored only inside (M, N).

    x comes flat, (M * K,) (C order); the weight as its flat uint64 view (N * K/4,), 4 bf16 per load, when
    w_words (needs K % 4 == 0); otherwise as the flat (N * K,) uint16 array, read one bf16 at a time (any K).
    """
    tile = GemmTcTile(bm, bn, bk, wm, wn, kw, stages, min_blocks)
    if (bk % 16 or wm % 16 or wn % 8 or bm % wm or bn % wn or kw < 1 or (bk // 16) % kw or stages not in (1, 2)
            or min_blocks < 0):
        raise ValueError(f"gemm_tc tile {tuple(tile)}: need bk % 16, wm % 16, wn % 8, bm % wm, bn % wn and "
                         f"(bk / 16) % kw all zero, kw >= 1, stages 1 or 2 and min_blocks >= 0")
    WARPS_N = bn // wn
    WARPS_MN = (bm // wm) * WARPS_N   # warp tiles per block tile; kw warps share each
    THREADS = WARP * WARPS_MN * kw
    if THREADS > 1024:
        raise ValueError(f"gemm_tc tile {tuple(tile)} gives {THREADS} threads per block (max 1024)")
    shared = gemm_tc_shared_bytes(tile, bf16_inputs)
    if shared > GEMM_TC_MAX_SHARED:
        raise ValueError(f"gemm_tc tile {tuple(tile)} (bf16_inputs={bf16_inputs}) needs {shared} bytes of "
                         f"shared memory (max {GEMM_TC_MAX_SHARED})")
    S = bk // 16          # mma k-steps per slab
    SW = S // kw          # k-steps per slab of each K group
    P = 1 if bf16_inputs else 3   # bf16 pieces of x
    MI = wm // 16         # m16 tiles per warp
    NJ = wn // 8          # n8 tiles per warp
    Q = bk // 4           # 4-element quads per row of a slab (one uint64 of shared memory each)
    X_QUADS = bm * Q      # quads of an x slab, spread over the threads
    W_QUADS = bn * Q
    X_PER = (X_QUADS + THREADS - 1) // THREADS
    W_PER = (W_QUADS + THREADS - 1) // THREADS
    XS_ROWS = bm + _gemm_tc_pad(bk)
    WS_ROWS = bn + _gemm_tc_pad(bk)

    XS_PLANE = XS_ROWS * 4    # uint64 quads per (buffer, piece, k-step) plane of the x slab
    WS_PLANE = WS_ROWS * 4
    XS_SIZE, WS_SIZE = stages * P * S * XS_PLANE, stages * S * WS_PLANE
    # Each thread's staging map, computed once (thread_offsets) instead of per slab: offs[e] = the flat x
    # offset of its quad e's row start plus the quad's k (-1: a row past M, staged as zeros), offs[XP + e] =
    # the quad's k within the slab, offs[2 XP + e] = its place in a shared plane (-1: no quad e); then the
    # same three for W from offs[WO]; offs[OFFS_K] = K, so that load_slab needs no shape.
    # NOTE: indexing with this map (and casting indices to uint64, which spares numba's negative-index
    # wraparound) instead of recomputing (row, k) per slab cut the main loop's integer instructions by 40%.
    XP = X_PER
    WO = 3 * X_PER
    OFFS_K = 3 * (X_PER + W_PER)
    OFFS = OFFS_K + 1

    @cuda.jit(device=True)
    def k_of(x, out):
        return x.shape[0] // out.shape[0]   # x is flat (M * K,)

    @cuda.jit(device=True)
    def thread_offsets(x, w, out, offs):
        M = out.shape[0]
        N = out.shape[1]
        K = k_of(x, out)
        row_words = K // 4 if w_words else K
        offs[OFFS_K] = K
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn
        for e in range(X_PER):
            idx = cuda.threadIdx.x + THREADS * e
            r = idx // Q
            q = idx % Q
            offs[XP + e] = 4 * q
            offs[2 * XP + e] = ((q // 4) * XS_ROWS + r) * 4 + q % 4 if idx < X_QUADS else -1
            offs[e] = (m0 + r) * K + 4 * q if idx < X_QUADS and m0 + r < M else -1
        for e in range(W_PER):
            idx = cuda.threadIdx.x + THREADS * e
            r = idx // Q
            q = idx % Q
            offs[WO + W_PER + e] = 4 * q
            offs[WO + 2 * W_PER + e] = ((q // 4) * WS_ROWS + r) * 4 + q % 4 if idx < W_QUADS else -1
            offs[WO + e] = (n0 + r) * row_words + (q if w_words else 4 * q) if idx < W_QUADS and n0 + r < N else -1

    @cuda.jit(device=True)
    def load_slab(x, w, k0, xr, wr, offs):
        """Global -> registers: this thread's quads of the x slab (fp32) and W slab (4 bf16 words) at k0;
        interior slabs (k0 + bk <= K) skip the k checks."""
        K = offs[OFFS_K]
        whole = k0 + bk <= K
        for e in range(X_PER):
            o = offs[e]
            for j in range(4):
                v = float32(0)
                if o >= 0 and (whole or k0 + offs[XP + e] + j < K):
                    v = x[uint64(o + k0 + j)]
                xr[e, j] = v
        for e in range(W_PER):
            o = offs[WO + e]
            word = uint64(0)
            if o >= 0:
                if w_words:
                    if whole or k0 + offs[WO + W_PER + e] < K:
                        word = w[uint64(o + k0 // 4)]
                else:
                    for j in range(4):
                        if whole or k0 + offs[WO + W_PER + e] + j < K:
                            word |= uint64(w[uint64(o + k0 + j)]) << uint64(16 * j)
            wr[e] = word

    @cuda.jit(device=True)
    def store_slab(xr, wr, xs, ws, buf, offs):
        """Registers -> shared buffer buf: x as its bf16 plane(s) (rounded to nearest even, or the hi, mid and
        lo planes of the bf16x3 split), W words as they are."""
        for e in range(X_PER):
            o = offs[2 * XP + e]
            if o >= 0:
                base = buf * (P * S * XS_PLANE) + o
                if bf16_inputs:
                    xs[uint64(base)] = pack4(f32_to_bf16(xr[e, 0]), f32_to_bf16(xr[e, 1]), f32_to_bf16(xr[e, 2]),
                                             f32_to_bf16(xr[e, 3]))
                else:
                    h0, d0, l0 = split_bf16x3(xr[e, 0])
                    h1, d1, l1 = split_bf16x3(xr[e, 1])
                    h2, d2, l2 = split_bf16x3(xr[e, 2])
                    h3, d3, l3 = split_bf16x3(xr[e, 3])
                    xs[uint64(base)] = pack4(h0, h1, h2, h3)
                    xs[uint64(base + S * XS_PLANE)] = pack4(d0, d1, d2, d3)
                    xs[uint64(base + 2 * S * XS_PLANE)] = pack4(l0, l1, l2, l3)
        for e in range(W_PER):
            o = offs[WO + 2 * W_PER + e]
            if o >= 0:
                ws[uint64(buf * (S * WS_PLANE) + o)] = wr[e]

    @cuda.jit(device=True)
    def frag_a(xs, buf, p, s, r, t):
        """A registers (a0, a1, a2, a3) of piece p, k-step s: quad t of rows r and r + 8 (see the docstring)."""
        o = ((buf * P + p) * S + s) * XS_PLANE + r * 4 + t
        a0, a2 = halves(xs[uint64(o)])
        a1, a3 = halves(xs[uint64(o + 32)])   # row r + 8: 8 rows of 4 quads further
        return a0, a1, a2, a3

    @cuda.jit(device=True)
    def frag_b(ws, buf, s, r, t):
        """B registers (b0, b1) of k-step s: quad t of W row (tile column) r."""
        return halves(ws[uint64((buf * S + s) * WS_PLANE + r * 4 + t)])

    @cuda.jit(device=True)
    def store_out(acc, out, m_base, n_base):
        """This lane's accumulators -> out, inside (M, N) only (mma D layout: rows g, g + 8, columns 2t, 2t+1)."""
        for i in range(MI):
            for j in range(NJ):
                for c in range(4):
                    m = m_base + 16 * i + 8 * (c // 2)
                    n = n_base + 8 * j + c % 2
                    if m < out.shape[0] and n < out.shape[1]:
                        out[m, n] = acc[i, j, c]

    if kw == 1:
        @cuda.jit(device=True)
        def finish(acc, out, kg, v, lane, m_base, n_base):
            store_out(acc, out, m_base, n_base)
    else:
        @cuda.jit(device=True)
        def finish(acc, out, kg, v, lane, m_base, n_base):
            """Sum the K groups' partial tiles into group 0 in the order 1, 2, .., kw-1; group 0 stores."""
            # red[v, i, j, c, lane]: lane fastest, so a warp's 32 stores or loads hit 32 distinct banks
            red = cuda.shared.array((WARPS_MN, MI, NJ, 4, WARP), float32)
            for src in range(1, kw):
                if kg == src:
                    for i in range(MI):
                        for j in range(NJ):
                            for c in range(4):
                                red[v, i, j, c, lane] = acc[i, j, c]
                cuda.syncthreads()
                if kg == 0:
                    for i in range(MI):
                        for j in range(NJ):
                            for c in range(4):
                                acc[i, j, c] += red[v, i, j, c, lane]
                cuda.syncthreads()  # red is free for the next group
            if kg == 0:
                store_out(acc, out, m_base, n_base)

    @cuda.jit(**_occupancy(THREADS, min_blocks))
    def gemm_tc_kernel(x, w, out):
        """x (M, K) f32; w (N, K/4) u64 [w_words] or (N, K) u16 bf16; out (M, N) f32. Block (bx, by)
        computes out[by*BM : by*BM+BM, bx*BN : bx*BN+BN]; warp w the WM x WN sub-tile at rows
        (v // WARPS_N) * WM, columns (v % WARPS_N) * WN of it (v = w % WARPS_MN), over the k-steps of K group
        w // WARPS_MN of every slab."""
        K = k_of(x, out)
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        g = lane // 4
        t = lane % 4
        kg = warp // WARPS_MN
        v = warp % WARPS_MN
        wm0 = (v // WARPS_N) * wm
        wn0 = (v % WARPS_N) * wn

        # xs[buf, p, s, r, t]: bf16 piece p of x[m0 + r, k0 + 16 s + 4 t : +4], packed in a uint64;
        # ws[buf, s, r, t]: W[n0 + r, k0 + 16 s + 4 t : +4], the same packing (flat; see the docstring above).
        xs = cuda.shared.array(XS_SIZE, uint64)
        ws = cuda.shared.array(WS_SIZE, uint64)
        xr = cuda.local.array((X_PER, 4), float32)   # the next slab, in flight during the current one's mma
        wr = cuda.local.array(W_PER, uint64)
        offs = cuda.local.array(OFFS, int64)         # this thread's staging map (thread_offsets)
        thread_offsets(x, w, out, offs)
        acc = cuda.local.array((MI, NJ, 4), float32)
        bf = cuda.local.array((NJ, 2), uint32)
        for i in range(MI):
            for j in range(NJ):
                for c in range(4):
                    acc[i, j, c] = float32(0)

        load_slab(x, w, 0, xr, wr, offs)
        store_slab(xr, wr, xs, ws, 0, offs)
        cuda.syncthreads()
        slabs = (K + bk - 1) // bk
        for slab in range(slabs):
            buf = slab % stages
            more = slab + 1 < slabs
            if more:
                load_slab(x, w, (slab + 1) * bk, xr, wr, offs)
            for ss in range(SW):
                s = kg * SW + ss
                for j in range(NJ):
                    bf[j, 0], bf[j, 1] = frag_b(ws, buf, s, wn0 + 8 * j + g, t)
                for p in range(P):
                    for i in range(MI):
                        a0, a1, a2, a3 = frag_a(xs, buf, p, s, wm0 + 16 * i + g, t)
                        for j in range(NJ):
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_bf16_m16n8k16(
                                a0, a1, a2, a3, bf[j, 0], bf[j, 1],
                                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
            if stages == 1:
                cuda.syncthreads()  # every warp is done with the buffer the next store overwrites
            if more:
                store_slab(xr, wr, xs, ws, (slab + 1) % stages, offs)
            cuda.syncthreads()  # the stored slab is visible to every warp

        finish(acc, out, kg, v, lane, cuda.blockIdx.y * bm + wm0 + g, cuda.blockIdx.x * bn + wn0 + 2 * t)

    gemm_tc_kernel.threads = THREADS
    gemm_tc_kernel.shared_bytes = shared
    return gemm_tc_kernel


# ---------------------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------------------

def gemm_tc(x, weight, out, stream=0, tile: GemmTcTile | None = None, bf16_inputs: bool = False):
    """out = x @ W^T on tensor cores, any M, N, K: x as three bf16 pieces (bf16x3, fp32-exact products) or,
    with bf16_inputs, rounded to the nearest bf16 (one piece, a third of the mma work).

    tile: the block and warp tiles, K groups and stages; by default GemmTcTile(), 128 x 128 (SIM_TILE in the
    simulator); the engine passes matmul_policy.gemm_tc_tile's pick. x and the weight must be C-contiguous. The
    weight is read 4 bf16 per load through its uint64 view when K % 4 == 0, one bf16 per load otherwise.
    """
    M, N, K = check_args(x, weight, out)
    for name, a in (("x", x), ("weight", weight)):
        if not a.is_c_contiguous():  # the kernel indexes both as flat arrays
            raise ValueError(f"gemm_tc: {name} must be C-contiguous, got shape {tuple(a.shape)} with strides "
                             f"{tuple(a.strides)} (copy it into a contiguous buffer)")
    if M == 0 or N == 0:
        return
    tile = GemmTcTile(*tile) if tile else (SIM_TILE if SIMULATOR else GemmTcTile())
    w_words = K % 4 == 0
    w = view(weight, (N * K // 4,), np.uint64) if w_words else view(weight, (N * K,))
    kernel = _gemm_tc_kernel(*tile, w_words, bool(bf16_inputs))
    grid = ((N + tile.bn - 1) // tile.bn, (M + tile.bm - 1) // tile.bm)
    launch(kernel, grid, kernel.threads, stream, view(x, (M * K,)), w, out)
