"""GEMV, the decode matmul: ``out = x @ W^T`` for few rows of x (M <= 8 in the engine), one warp per weight row.

    out[m, n] = sum_k x[m, k] * bf16_to_f32(W[n, k])        (with bf16_inputs: bf16(x[m, k]) instead of x)

x (M, K) float32; W (N, K) uint16 bf16 bits in nn.Linear layout; out (M, N) float32. Twin:
reference.matmul.matmul (reference.matmul.gated_matmul and matmul_rope_kv_write for the fused epilogues).
At decode every weight byte is used M times, so a GEMV is bound by how fast it reads W: the roofline is the
weight's bytes over the copy bandwidth (docs/course/05-gemv.md).

Thread mappings:

- ``gemv_warp``: grid = (ceil(N / 4), M), block = 4 warps; warp w of block (bx, m) computes out[m, n] for
  n = 4 bx + w: lane i reads W[n, i], W[n, i + 32], ... (a warp load is 32 consecutive bf16, coalesced)
  and x[m] at the same k, and a warp_sum adds the 32 partial dots.
- ``gemv`` (a GemvConfig): grid = (ceil(N / rows_per_block), ceil(M / m_tile)), block = 32 * warps,
  rows_per_block = (warps / k_split) * rows_per_warp; warp w of block (bx, by) owns weight rows
  (bx * warps / k_split + w // k_split) * rows_per_warp + r, K part w % k_split, and activation rows
  by * m_tile + mm (m_tile in 1, 2, 4, 8, the smallest >= M). A row's uint64 words (4 bf16 each) are
  consumed in passes of 32 * unroll * k_split words: in each pass part p reads the unroll runs of 32 words
  starting at (p * unroll + u) * 32, lane i word i of each run (a warp load reads 256 contiguous bytes),
  all unroll * rows_per_warp loads issued before the first is used (a pipelined config also issues the
  next pass's loads before it consumes this one, into a second set of registers); each word is widened
  once and multiplied by all m_tile activation rows. A warp_sum per (row, m) gives a part's dot; with
  k_split > 1 the parts meet in shared memory and are added in part order. When K % 4 != 0 (no uint64 view)
  the bf16 at k = i, i + 32, ... are read one at a time instead. The first pass's weight loads are issued
  before pdl.grid_wait (weights are never written), so under programmatic dependent launch they are in
  flight while the kernel that produces x finishes.
  Epilogues (gemv_epilogues.py): gated (``gemv(..., gated=True)``, the engine's gate/up at decode) and RoPE
  + KV write (``gemv_rope``, its QKV projection) pair a warp's R rows as R/2 pairs (gate row j with up row
  F + j; rows i and i + d/2 of a head) and write silu(gate) * up, or what rope.rope_kv_write would, straight
  from each pair's totals: no (M, 2F) or qkv intermediate, no SiLU or RoPE kernel.
- ``gemv`` with a ``GemvStaged(rows_per_block, warps)`` config (the staged gemv): grid = (ceil(N / R),
  ceil(M / m_tile)), block = 32 * warps threads, R = rows_per_block; block (bx, by) owns weight rows
  bx * R + r (paired: R / 2 pairs, as above) and activation rows by * m_tile + mm. Before the PDL wait the
  block copies its R rows whole into a shared tile with cp.async (16-byte copies, thread t taking copies
  t, t + threads, ...; K % 8 == 0; the tile, R * K * 2 bytes, is dynamic shared memory, up to what a block
  may opt in to); after it, thread t loads x (two fp32 per 64-bit load) for the uint64 words t,
  t + threads, ... of a row, then multiplies them with the same words of each of the R tile rows
  (consecutive threads, consecutive words: conflict-free). Each thread's R x m_tile partial sums go through
  warp_sum, meet in shared memory and are added in warp order; the same epilogues as above (plain, gated,
  rope), thread t < m_tile * outputs writing one, with what its store reads besides the sums (rope:
  position, cos, sin, slot) loaded before the PDL wait, so that no dependent load follows the reduction.

Versions (the GEMV ladder; gemm_simt.matmul_naive, one thread per output, is the rung below them):
2a. gemv_warp: a warp per weight row. The 32 lanes read 32 consecutive bf16, so every weight load is
    coalesced; but each load is 2 bytes, a lane has one in flight at a time, and W is read once per row of x.
2b. gemv, GemvConfig() = (4, 2, 1, 1), the first engine version: a lane reads a uint64 (4 bf16) at a time,
    a warp load 256 contiguous bytes; two rows per warp share each x load, and each weight word, widened
    once, meets all m_tile rows of x (W read once per 8 rows).
2c. gemv with loads in flight: rows_per_warp x unroll 8-byte loads per lane issued before the first is used,
    and for weights of few rows K split over the warps of a block, so that enough bytes are in flight per
    SM to approach the DRAM bandwidth (Little's law: bandwidth x latency).
2d. gemv pipelined (what the engine runs for the narrow weights at M = 1): the next pass's loads are issued
    before the current pass is consumed. matmul_policy.gemv_config picks the configuration by shape.
2e. the staged gemv (GemvStaged): the weights in flight wait in shared memory rather than registers, so a
    block holds few registers and the next kernel's blocks can be resident while this one finishes. Tested,
    timed, not picked by the policy (faster alone on QKV, not inside the decode step: docs/performance.md).
The epilogues (gated, rope) fuse the next kernel into the GEMV; matmul.gated_matmul and
matmul.matmul_rope_kv_write are the engine's entry points.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import kv_format, pdl, rope
from cuda_kernels.async_copy import cp_async_16, cp_async_commit, cp_async_wait
from numba import cuda, float32, uint32, uint64

from cuda_kernels.gemv_epilogues import epilogue_rows
from cuda_kernels.launch import OPT_IN_SHARED_LIMIT, launch, view
from cuda_kernels.matmul_args import check_args
from cuda_kernels.primitives import WARP, bf16_to_f32, f32_from_bits, round_bf16, round_bf16_pair, warp_sum

# gemv compiles one kernel per m_tile (accumulators are registers, so their count must be a constant).
_GEMV_M_TILES = (1, 2, 4, 8)
_WARP_GEMV_WARPS = 4   # warps (weight rows) per block of gemv_warp


class GemvConfig(NamedTuple):
    warps_per_block: int = 4
    rows_per_warp: int = 2   # rows sharing one pass over x: more loads in flight per lane, x loads reused
    unroll: int = 1          # 64-bit loads per row a lane issues before using the first
    k_split: int = 1         # warps of a block splitting each row's K (warps_per_block % k_split == 0)
    pipelined: bool = False  # issue the next pass's loads before consuming this one (twice the registers)


class GemvStaged(NamedTuple):
    """The staged gemv (a `config` for gemv and gemv_rope): each block copies rows_per_block whole weight rows
    into shared memory before the PDL wait (K % 8 == 0; gemv_staged_shared_bytes within a block's opt-in
    shared memory, launch.OPT_IN_SHARED_LIMIT)."""
    rows_per_block: int = 8
    warps_per_block: int = 4


# ---------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _low_pair(word):
    """The two bf16 of the low half of a uint64 word (elements 0 and 1: little-endian), as fp32."""
    # NOTE: cast to uint32 before shifting: in the simulator NumPy promotion rules apply, and on the GPU the
    # typed constants keep the arithmetic in unsigned integers (uint64 op int64 would become float64).
    lo = uint32(uint64(word) & uint64(0xFFFFFFFF))
    return bf16_to_f32(lo & uint32(0xFFFF)), bf16_to_f32(lo >> uint32(16))


@cuda.jit(device=True)
def _high_pair(word):
    """Elements 2 and 3 of a uint64 word of four bf16, as fp32."""
    hi = uint32(uint64(word) >> uint64(32))
    return bf16_to_f32(hi & uint32(0xFFFF)), bf16_to_f32(hi >> uint32(16))


@cuda.jit(device=True)
def _f32_pair(word):
    """The two fp32 of a uint64 word (elements 0 and 1: little-endian)."""
    return (f32_from_bits(uint32(uint64(word) & uint64(0xFFFFFFFF))),
            f32_from_bits(uint32(uint64(word) >> uint64(32))))


@cuda.jit(device=True, inline=True)
def _x_quad(x64, m, j, bf16_inputs):
    """x[m, 4j .. 4j + 3], the four activations that meet weight word j, as two 64-bit loads from x64 (x seen
    as (M, K/2) uint64), each rounded to the nearest bf16 when bf16_inputs."""
    x0, x1 = _f32_pair(x64[m, 2 * j])
    x2, x3 = _f32_pair(x64[m, 2 * j + 1])
    if bf16_inputs:
        x0, x1 = round_bf16_pair(x0, x1)
        x2, x3 = round_bf16_pair(x2, x3)
    return x0, x1, x2, x3


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gemv_warp_kernel(bf16_inputs: bool):
    """The plain warp-per-row kernel; with bf16_inputs every x is rounded to the nearest bf16 as it is read."""

    @cuda.jit
    def gemv_warp_kernel(x, weight, out):
        """x (M, K) f32, weight (N, K) u16 bf16, out (M, N) f32. Warp w of block (bx, m) computes out[m, n],
        n = bx * warps + w."""
        lane = cuda.threadIdx.x % WARP
        n = cuda.blockIdx.x * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
        m = cuda.blockIdx.y
        # NOTE: a warp past the last row does not return early: all 32 lanes must reach warp_sum (and the
        # simulator's version synchronises the block). It reads a valid row and skips the store.
        row = min(n, weight.shape[0] - 1)
        acc = float32(0)
        for k in range(lane, x.shape[1], WARP):
            xv = round_bf16(x[m, k]) if bf16_inputs else x[m, k]
            acc += xv * bf16_to_f32(weight[row, k])
        total = warp_sum(acc)
        if lane == 0 and n < weight.shape[0]:
            out[m, n] = total

    return gemv_warp_kernel


@functools.lru_cache(maxsize=None)
def _gemv_kernel(m_tile: int, warps_per_block: int, rows_per_warp: int, unroll: int, k_split: int,
                 pipelined: bool, bf16_inputs: bool, pairing: str = "", head_dim: int = 0, fmt: str = "bf16"):
    """The gemv kernel for m_tile activation rows per block, rows_per_warp weight rows per warp, `unroll`
    64-bit weight loads per row in flight per lane, and K split over k_split warps of the block; pipelined,
    the loads of a lane's next pass are issued before its current one is consumed; with bf16_inputs every x
    is rounded to the nearest bf16 as it is read.

    pairing: the epilogue (gemv_epilogues.py): "" plain rows n0.. (out (M, N)); "gated" or "rope" on pairs of
    rows, a warp's first R/2 rows with its last R/2 (R even), the rope one in a kernel (gemv_rope_kernel) that
    takes rope.rope_kv_write's outputs (head_dim and the cache's format fmt)."""
    MT = m_tile
    R = rows_per_warp
    RH = R // 2                             # paired: pairs per warp
    U = unroll
    S = k_split
    PIPE = pipelined
    ROPE = pairing == "rope"
    PAIRED = pairing != ""
    OUTS = RH if PAIRED else R              # outputs (pairs or rows) per warp and activation row
    ROW_WARPS = warps_per_block // S        # warps with distinct rows; S warps share each row group
    ROWS_PER_BLOCK = ROW_WARPS * R
    NACC = MT * R
    NW = U * R                              # weight words per lane in a pass (pipelined: two passes in registers)
    STEP = WARP * U * S                     # words of a row consumed by one pass of the block's S warps
    # NOTE: local/shared array sizes must be closure constants, not expressions in the kernel
    RED_SHAPE = (ROW_WARPS, NACC, S)
    weight_row, store_inputs, store = epilogue_rows(R, pairing, head_dim, fmt)

    @cuda.jit(device=True, inline=True)   # NOTE: inlined, so that wv stays in registers
    def load_words(w64, wv, n0, N, j0):
        """Issue the U * R weight loads of one pass (words j0 + 32 u of the warp's R rows) into wv."""
        for u in range(U):
            for r in range(R):
                wv[u * R + r] = w64[weight_row(n0, r, N), j0 + u * WARP]

    @cuda.jit(device=True, inline=True)
    def gemv_body(x, w64, w16, kv, dst):
        """x (M, K) f32; w64 (N, K/4) u64 (4 bf16 per word) or any array when kv == 0; w16 (N, K) u16 bf16;
        kv: number of uint64 words per row to read through w64 (K/4, or 0 for the scalar path). Columns
        4*kv..K-1 are read through w16 (the scalar tail: all of K when kv == 0). dst: the arrays `store`
        writes."""
        M = x.shape[0]
        K = x.shape[1]
        N = w16.shape[0]
        NCOLS = N // 2 if PAIRED else N
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        part = warp % S
        n0 = (cuda.blockIdx.x * ROW_WARPS + warp // S) * R
        m0 = cuda.blockIdx.y * MT
        # NOTE: warps past the last weight row (and m past the last x row) do not return early: every lane of
        # the block must reach every warp_sum (shuffles need the whole warp; the simulator's version
        # synchronises the block) and the barrier of the K-split reduction. They work on a clamped, valid
        # row and skip the store instead, which also keeps bounds checks out of the inner loop.
        acc = cuda.local.array(NACC, float32)
        wv = cuda.local.array(NW, uint64)   # the pass being consumed
        wn = cuda.local.array(NW, uint64)   # pipelined: the next pass, in flight
        for i in range(NACC):
            acc[i] = float32(0)

        # Main loop: pass c covers words [c*STEP, (c+1)*STEP) of every row; this warp's share is the U runs
        # of 32 words at c*STEP + (part*U + u)*32, lane i taking word i of each run (a warp load reads 256
        # contiguous bytes). All U*R loads of a pass are issued before the first is used (pipelined: and the
        # next pass's before this one is consumed, into a second set of registers): that many 8-byte loads in
        # flight per lane is what keeps enough bytes in flight per SM to approach the DRAM bandwidth.
        # NOTE: the first pass's weight loads (pipelined: the first two passes') go out before grid_wait
        # (cuda_kernels/pdl.py): weights are never written, so under PDL they are in flight while the kernel
        # producing x finishes.
        pdl.launch_dependents()
        full = (kv // STEP) * STEP
        j0 = part * U * WARP + lane
        if j0 < full:
            load_words(w64, wv, n0, N, j0)
        if PIPE and j0 + STEP < full:
            load_words(w64, wn, n0, N, j0 + STEP)
        pdl.grid_wait()
        while j0 < full:
            for u in range(U):
                k = 4 * (j0 + u * WARP)
                for mm in range(MT):
                    mi = min(m0 + mm, M - 1)
                    x0 = x[mi, k]
                    x1 = x[mi, k + 1]
                    x2 = x[mi, k + 2]
                    x3 = x[mi, k + 3]
                    if bf16_inputs:
                        x0, x1 = round_bf16_pair(x0, x1)
                        x2, x3 = round_bf16_pair(x2, x3)
                    for r in range(R):
                        w0, w1 = _low_pair(wv[u * R + r])
                        w2, w3 = _high_pair(wv[u * R + r])
                        a = acc[mm * R + r]
                        a += x0 * w0
                        a += x1 * w1
                        a += x2 * w2
                        a += x3 * w3
                        acc[mm * R + r] = a
            j0 += STEP
            if j0 < full:
                if PIPE:
                    # NOTE: moving a word waits for its load; by now it has had a whole pass to arrive
                    for i in range(NW):
                        wv[i] = wn[i]
                    if j0 + STEP < full:
                        load_words(w64, wn, n0, N, j0 + STEP)
                else:
                    load_words(w64, wv, n0, N, j0)

        # The words past the last whole pass, one per lane at a time, spread over the S warps the same way.
        for j in range(full + part * WARP + lane, kv, WARP * S):
            for r in range(R):
                wv[r] = w64[weight_row(n0, r, N), j]
            k = 4 * j
            for mm in range(MT):
                mi = min(m0 + mm, M - 1)
                x0, x1, x2, x3 = x[mi, k], x[mi, k + 1], x[mi, k + 2], x[mi, k + 3]
                if bf16_inputs:
                    x0, x1 = round_bf16_pair(x0, x1)
                    x2, x3 = round_bf16_pair(x2, x3)
                for r in range(R):
                    w0, w1 = _low_pair(wv[r])
                    w2, w3 = _high_pair(wv[r])
                    acc[mm * R + r] += x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3

        # Scalar tail: the K % 4 columns a uint64 view cannot cover (all of K when there is no view).
        for k in range(4 * kv + part * WARP + lane, K, WARP * S):
            for mm in range(MT):
                xv = x[min(m0 + mm, M - 1), k]
                if bf16_inputs:
                    xv = round_bf16(xv)
                for r in range(R):
                    acc[mm * R + r] += xv * bf16_to_f32(w16[weight_row(n0, r, N), k])

        # Epilogue: output o of the warp is row o (plain) or pair o, whose second total is row o + R/2.
        if S == 1:
            for mm in range(MT):
                for o in range(OUTS):
                    a = warp_sum(acc[mm * R + o])
                    b = warp_sum(acc[mm * R + RH + o]) if PAIRED else a
                    j = (n0 // 2 if PAIRED else n0) + o
                    if lane == 0 and m0 + mm < M and j < NCOLS:
                        store(dst, m0 + mm, j, a, b, store_inputs(dst, m0 + mm, j))
        else:
            # the S warps of a row group add their warp sums in part order (deterministic) through shared memory
            red = cuda.shared.array(RED_SHAPE, float32)
            for i in range(NACC):
                total = warp_sum(acc[i])
                if lane == 0:
                    red[warp // S, i, part] = total
            cuda.syncthreads()
            t = cuda.threadIdx.x
            if t < ROW_WARPS * MT * OUTS:
                # thread t: output o of activation row mm of row group `group`
                group, i = t // (MT * OUTS), t % (MT * OUTS)
                mm, o = i // OUTS, i % OUTS
                a = red[group, mm * R + o, 0]
                b = red[group, mm * R + RH + o, 0] if PAIRED else a
                for p in range(1, S):
                    a += red[group, mm * R + o, p]
                    if PAIRED:
                        b += red[group, mm * R + RH + o, p]
                j = (cuda.blockIdx.x * ROW_WARPS + group) * (RH if PAIRED else R) + o
                if m0 + mm < M and j < NCOLS:
                    store(dst, m0 + mm, j, a, b, store_inputs(dst, m0 + mm, j))

    @cuda.jit
    def gemv_kernel(x, w64, w16, kv, out):
        # out (M, N) f32, or gated (M, N/2)
        gemv_body(x, w64, w16, kv, (out,))

    @cuda.jit
    def gemv_rope_kernel(x, w64, w16, kv, q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale,
                         v_scale):
        # q_out (M, Hq, d) f32; positions, slot_mapping (M,) int; cos, sin (max_positions, d/2) f32;
        # k_cache, v_cache (blocks, block_size, Hkv, d) in the format fmt; k_scale, v_scale f32 (rope.py's)
        gemv_body(x, w64, w16, kv, (q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale))

    kernel = gemv_rope_kernel if ROPE else gemv_kernel
    kernel.rows_per_block = ROWS_PER_BLOCK
    return kernel


@functools.lru_cache(maxsize=None)
def _gemv_staged_kernel(m_tile: int, rows_per_block: int, warps_per_block: int, k: int, bf16_inputs: bool,
                        pairing: str = "", head_dim: int = 0, fmt: str = "bf16"):
    """The staged gemv kernel (GemvStaged) for m_tile activation rows per block and K = k (a multiple of 8):
    a block copies its rows_per_block weight rows whole into shared memory (dynamic, rows_per_block * k * 2
    bytes) with cp.async before the PDL wait, then multiplies them by x; pairing as in _gemv_kernel."""
    MT = m_tile
    R = rows_per_block
    RH = R // 2
    PAIRED = pairing != ""
    OUTS = RH if PAIRED else R
    THREADS = WARP * warps_per_block
    KW = k // 4                      # uint64 words (4 bf16) per row
    COPIES = KW // 2                 # 16-byte copies per row (k % 8 == 0)
    WPT = -(-KW // THREADS)          # words of each row per thread
    GUARD = KW % THREADS != 0        # some threads' last word is past the row
    NACC = MT * R
    # NOTE: local/shared array sizes must be closure constants, not expressions in the kernel
    XN = MT * 4 * WPT
    RED_SHAPE = (warps_per_block, NACC)
    weight_row, store_inputs, store = epilogue_rows(R, pairing, head_dim, fmt)
    wait_copies = cp_async_wait(0)

    @cuda.jit(device=True, inline=True)
    def staged_body(x64, w64, dst):
        """x64 (M, k/2) u64, x's fp32 two per word; w64 (N * k/4,) u64, the weight flat (4 bf16 per word);
        dst: the arrays `store` writes."""
        M = x64.shape[0]
        N = w64.shape[0] // KW
        NCOLS = N // 2 if PAIRED else N
        t = cuda.threadIdx.x
        lane, warp = t % WARP, t // WARP
        n0 = cuda.blockIdx.x * R
        m0 = cuda.blockIdx.y * MT
        tile = cuda.shared.array(0, uint64)   # dynamic (16-byte aligned, as cp.async needs); row r: words r*KW ..
        red = cuda.shared.array(RED_SHAPE, float32)

        # The whole tile is requested before the wait (weights are never written): under PDL it streams in
        # while the kernel producing x finishes, and it waits in shared memory, not registers, so that this
        # block holds few registers and the next kernel's blocks can be resident and loading too.
        pdl.launch_dependents()
        for c in range(t, R * COPIES, THREADS):
            r, j = c // COPIES, 2 * (c % COPIES)
            cp_async_16(tile, r * KW + j, w64, weight_row(n0, r, N) * KW + j, True)
        cp_async_commit()
        # thread t < MT * OUTS stores output o of activation row mm (below); what that store reads besides the
        # totals is read now, before the wait, off the path that follows it (indices clamped for the others)
        mm_out, o_out = t // OUTS, t % OUTS
        j_out = (n0 // 2 if PAIRED else n0) + o_out
        pre = store_inputs(dst, min(m0 + mm_out, M - 1), min(j_out, NCOLS - 1))
        pdl.grid_wait()

        # x for this thread's words t, t + THREADS, .. of a row (4 each, as two 64-bit loads), for the block's
        # MT activation rows: loaded while the tile may still be landing.
        # NOTE: 64-bit x loads here; the register gemv keeps 32-bit ones, where 64-bit ones cost registers and
        # so occupancy (docs/performance.md, "x loads").
        xr = cuda.local.array(XN, float32)
        for mm in range(MT):
            for i in range(WPT):
                # the word clamped to the row; one past it is skipped below
                x0, x1, x2, x3 = _x_quad(x64, min(m0 + mm, M - 1), min(t + i * THREADS, KW - 1), bf16_inputs)
                b = (mm * WPT + i) * 4
                xr[b] = x0
                xr[b + 1] = x1
                xr[b + 2] = x2
                xr[b + 3] = x3
        wait_copies()
        cuda.syncthreads()

        # Consecutive threads read consecutive 8-byte words of a tile row: conflict-free shared loads.
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0)
        for i in range(WPT):
            w = t + i * THREADS
            if not GUARD or w < KW:
                for r in range(R):
                    word = tile[r * KW + w]
                    w0, w1 = _low_pair(word)
                    w2, w3 = _high_pair(word)
                    for mm in range(MT):
                        b = (mm * WPT + i) * 4
                        a = acc[mm * R + r]
                        a += xr[b] * w0
                        a += xr[b + 1] * w1
                        a += xr[b + 2] * w2
                        a += xr[b + 3] * w3
                        acc[mm * R + r] = a

        # Every warp's sums meet in shared memory and are added in warp order (deterministic).
        for i in range(NACC):
            total = warp_sum(acc[i])
            if lane == 0:
                red[warp, i] = total
        cuda.syncthreads()
        if t < MT * OUTS:
            a = red[0, mm_out * R + o_out]
            b = red[0, mm_out * R + RH + o_out] if PAIRED else a
            for p in range(1, warps_per_block):
                a += red[p, mm_out * R + o_out]
                if PAIRED:
                    b += red[p, mm_out * R + RH + o_out]
            if m0 + mm_out < M and j_out < NCOLS:
                store(dst, m0 + mm_out, j_out, a, b, pre)

    @cuda.jit
    def gemv_staged_kernel(x64, w64, out):
        # out (M, N) f32, or gated (M, N/2)
        staged_body(x64, w64, (out,))

    @cuda.jit
    def gemv_staged_rope_kernel(x64, w64, q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale,
                                v_scale):
        # the arguments of gemv_rope_kernel (x as x64, no w16, no kv)
        staged_body(x64, w64, (q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale))

    return gemv_staged_rope_kernel if pairing == "rope" else gemv_staged_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def gemv_warp(x, weight, out, stream=0, bf16_inputs: bool = False):
    """out = x @ W^T, one warp per (row of x, row of W): the plain warp-per-row GEMV (version 2a); any M, N, K;
    x rounded to bf16 first if asked."""
    M, N, _ = check_args(x, weight, out)
    if M == 0 or N == 0:
        return
    grid = (-(-N // _WARP_GEMV_WARPS), M)
    launch(_gemv_warp_kernel(bool(bf16_inputs)), grid, WARP * _WARP_GEMV_WARPS, stream, x, weight, out)


def gemv(x, weight, out, stream=0, config: GemvConfig | None = None, bf16_inputs: bool = False,
         gated: bool = False):
    """out = x @ W^T for small M (decode), one warp per weight row (or rows_per_warp rows).

    weight is the (N, K) uint16 array, or its uint64 view (N, K/4) (``weight.view(np.uint64)``, no copy),
    which a caller can make once to save the view's Python cost on every call. A uint16 weight is viewed as
    uint64 here when K % 4 == 0 and it is C-contiguous (64-bit loads); otherwise the kernel takes the scalar
    path (16-bit loads), which is correct for any K but slower. Any M works: x is walked in chunks of up to
    8 rows and the weight is read once per chunk. config: warps per block, weight rows per warp, loads in
    flight per row and K split (tuning); by default GemvConfig(), the first version's one-load loop (the engine
    passes matmul_policy.gemv_config's pick).
    gated: W is the fused [gate; up] (2F, K) and out (M, F) <- silu(x @ gate^T) * (x @ up^T), the SiLU*mul
    in the epilogue (config.rows_per_warp must be even: a warp pairs its gate and up rows).
    config may also be a GemvStaged (the staged gemv; K % 8 == 0, C-contiguous x and weight, and
    gemv_staged_shared_bytes within launch.OPT_IN_SHARED_LIMIT, else ValueError; gated: rows_per_block even).
    """
    M, N, K = check_args(x, weight, out, allow_u64_weight=True, gated=gated)
    setup = _gemv_setup(x, weight, M, N, K, config, bf16_inputs, "gated" if gated else "")
    if setup:
        kernel, grid, block, inputs, shared = setup
        launch(kernel, grid, block, stream, *inputs, out, shared=shared, dependent=True)


def gemv_rope(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream=0,
              config: GemvConfig | None = None, bf16_inputs: bool = False, k_scale=1.0, v_scale=1.0):
    """The QKV projection with rope.rope_kv_write as its epilogue, for small M (decode): of qkv = x @ W^T
    (W the fused QKV weight, (Hq + 2 Hkv) d rows) only the results are written: q_out (M, Hq, d) the rotated
    queries, and each token's rotated K and its V into the caches at slot_mapping[m] (-1: not written).
    positions, cos, sin, k_cache, v_cache, slot_mapping as rope.rope_kv_write takes them; weight and config
    as gemv (config.rows_per_warp, or a GemvStaged's rows_per_block, must be even: rows i and i + d/2 of a
    head are paired). The caches may be in any format of kv_format (k_scale, v_scale: fp8's scales)."""
    M, N, K = check_args(x, weight, None, allow_u64_weight=True)
    t, hq, hkv, d = rope.check_rope_args(positions, cos, sin, k_cache, v_cache, slot_mapping, q_out)
    fmt = kv_format.format_of(k_cache)
    k_scale, v_scale = kv_format.check_scales(fmt, k_scale, v_scale)
    if (M, N) != (t, (hq + 2 * hkv) * d):
        raise ValueError(f"gemv_rope: x {tuple(x.shape)} and weight {tuple(weight.shape)} give a ({M}, {N}) "
                         f"product; q_out and the caches need ({t}, {(hq + 2 * hkv) * d}) for Hq={hq}, "
                         f"Hkv={hkv}, d={d}")
    setup = _gemv_setup(x, weight, M, N, K, config, bf16_inputs, "rope", d, fmt)
    if setup:
        kernel, grid, block, inputs, shared = setup
        launch(kernel, grid, block, stream, *inputs, q_out, positions, cos, sin, k_cache, v_cache,
               slot_mapping, k_scale, v_scale, shared=shared, dependent=True)


def _m_tile(m: int) -> int:
    """Activation rows per gemv block for x of m rows: the smallest compiled m_tile >= m (at most 8)."""
    return next((t for t in _GEMV_M_TILES if t >= m), _GEMV_M_TILES[-1])


def gemv_staged_shared_bytes(config: GemvStaged, m: int, k: int) -> int:
    """Shared memory per block of the staged gemv at x (m, k): the weight tile (dynamic) and the warps'
    partial sums (static)."""
    rows, warps = config
    return rows * k * 2 + warps * _m_tile(m) * rows * 4


def _gemv_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim=0, fmt="bf16"):
    """(the gemv kernel, its grid and block, its arguments for x and the weight, its dynamic shared memory in
    bytes) for x (M, K) @ weight^T, or None when there is nothing to compute; checks config."""
    if M == 0 or N == 0:
        return None
    config = config or GemvConfig()
    if isinstance(config, GemvStaged):
        return _gemv_staged_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim, fmt)
    config = GemvConfig(*config)
    if config.warps_per_block % config.k_split or not 1 <= config.warps_per_block <= 32 or config.unroll < 1:
        raise ValueError(f"gemv config {config}: need 1 <= warps_per_block <= 32, a multiple of k_split, "
                         f"and unroll >= 1")
    if pairing and config.rows_per_warp % 2:
        raise ValueError(f"gemv config {config}: a {pairing} gemv needs an even rows_per_warp (a warp pairs rows)")
    if weight.dtype == np.uint64:
        w64 = w16 = weight  # NOTE: w16 is only read by the scalar tail, which is empty when K % 4 == 0
        kv = K // 4
    elif K % 4 == 0 and weight.is_c_contiguous():
        w64, w16, kv = view(weight, dtype=np.uint64), weight, K // 4
    else:
        w64, w16, kv = weight, weight, 0  # w64 is never read when kv == 0
    m_tile = _m_tile(M)
    kernel = _gemv_kernel(m_tile, *config, bool(bf16_inputs), pairing, head_dim, fmt)
    grid = ((N + kernel.rows_per_block - 1) // kernel.rows_per_block, (M + m_tile - 1) // m_tile)
    return kernel, grid, WARP * config.warps_per_block, (x, w64, w16, kv), 0


def _gemv_staged_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim, fmt="bf16"):
    """_gemv_setup for a GemvStaged config."""
    rows, warps = config
    if not 1 <= warps <= 32 or rows < 1 or (pairing and rows % 2):
        raise ValueError(f"gemv config {config}: need 1 <= warps_per_block <= 32 and rows_per_block >= 1 "
                         f"(even for a {pairing or 'paired'} gemv: a block pairs rows)")
    if K % 8 or not weight.is_c_contiguous() or not x.is_c_contiguous():
        raise ValueError(f"gemv config {config}: the staged gemv copies rows in 16-byte pieces and reads x in 8-byte "
                         f"ones, so it needs K % 8 == 0 and C-contiguous x and weight; got K = {K}, x strides "
                         f"{x.strides}, weight strides {weight.strides}")
    shared = gemv_staged_shared_bytes(config, M, K)
    if shared > OPT_IN_SHARED_LIMIT:
        raise ValueError(f"gemv config {config}: {rows} rows of K = {K} need {shared} bytes of shared memory "
                         f"at M = {M}, over the {OPT_IN_SHARED_LIMIT} a block may have: use fewer rows per block")
    m_tile = _m_tile(M)
    kernel = _gemv_staged_kernel(m_tile, rows, warps, K, bool(bf16_inputs), pairing, head_dim, fmt)
    grid = (-(-N // rows), -(-M // m_tile))
    inputs = (view(x, dtype=np.uint64), view(weight, shape=(N * K // 4,), dtype=np.uint64))
    return kernel, grid, WARP * warps, inputs, rows * K * 2
