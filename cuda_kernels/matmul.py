"""Matmul against bf16 weights in nn.Linear layout: ``out = x @ W^T``, accumulated in fp32.

    out[m, n] = sum_k x[m, k] * bf16_to_f32(W[n, k])

x (M, K) float32 activations; W (N, K) uint16 bf16 bit patterns (one row per output feature, as nn.Linear
stores it); out (M, N) float32, written by the kernel (the caller allocates it). Fused projections (Q, K and
V as one weight; gate and up as one) are the same op on row-concatenated weights. Twin: reference/matmul.py.

Two input precisions (the engine's matmul_precision): "fp32" (the default) multiplies x as it is;
"bf16" (``bf16_inputs=True`` on every launcher; what vLLM and HF transformers do)
multiplies bf16(x), x rounded to the nearest bf16 (ties to even, primitives.round_bf16):

    out[m, n] = sum_k bf16(x[m, k]) * bf16_to_f32(W[n, k])

Either way every product is exact in fp32, so the kernels differ from reference.matmul.matmul(x, W,
bf16_inputs) only in the order of the fp32 sums.

Thread mappings:

- ``matmul_naive``: grid = (ceil(N / 128), M), block = (128, 1); thread (n, m) computes out[m, n] with a
  plain loop over K.
- ``gemv`` (decode, small M): grid = (ceil(N / rows_per_block), ceil(M / m_tile)), block = 32 * warps,
  rows_per_block = (warps / k_split) * rows_per_warp; warp w of block (bx, by) owns weight rows
  (bx * warps / k_split + w // k_split) * rows_per_warp + r, K part w % k_split, and activation rows
  by * m_tile + mm (m_tile in 1, 2, 4, 8, the smallest >= M). A row's uint64 words (4 bf16 each) are
  consumed in passes of 32 * unroll * k_split words: in each pass part p reads the unroll runs of 32 words
  starting at (p * unroll + u) * 32, lane i word i of each run (a warp load reads 256 contiguous bytes),
  all unroll * rows_per_warp loads issued before the first is used (a pipelined config also issues the
  next pass's loads before it consumes this one, into a second set of registers); each word is widened
  once and multiplied by all m_tile activation rows. A warp_sum per (row, m) gives a part's dot; with k_split > 1
  the parts meet in shared memory and are added in part order. When K % 4 != 0 (no uint64 view) the
  bf16 at k = i, i + 32, ... are read one at a time instead. gemv_config(M, N, K) picks the configuration.
  The first pass's weight loads are issued before pdl.grid_wait (weights are never written), so under
  programmatic dependent launch they are in flight while the kernel that produces x finishes.
  Gated (``gemv(..., gated=True)``, the engine's gate/up at decode): W = [gate; up] (2F, K) and a warp's R
  rows are R/2 gate rows j.. and the R/2 up rows F + j.. of the same features, so the epilogue writes
  silu(gate) * up for features j.. directly (out (M, F)): no (M, 2F) intermediate, no SiLU kernel.
  RoPE (``gemv_rope``, the engine's QKV projection at decode): the same pairing on the fused QKV weight, a
  warp's R/2 pairs being rows i and i + d/2 of a head, so the epilogue rotates each pair and writes what
  rope.rope_kv_write would (rotated q; the rotated K and the V into the cache slots): no qkv intermediate,
  no RoPE kernel.
- ``gemv`` with a ``GemvStaged(rows_per_block, warps)`` config (the staged gemv): grid = (ceil(N / R),
  ceil(M / m_tile)), block = 32 * warps threads, R = rows_per_block; block (bx, by) owns weight rows
  bx * R + r (paired: R / 2 pairs, as above) and activation rows by * m_tile + mm. Before the PDL wait the
  block copies its R rows whole into a shared tile with cp.async (16-byte copies, thread t taking copies
  t, t + threads, ...; K % 8 == 0; the tile, R * K * 2 bytes, is dynamic shared memory, up to what a block
  may opt in to); after it,
  thread t loads x (two fp32 per 64-bit load) for the uint64 words t, t + threads, ... of a row, then
  multiplies them with the same words of each of the R tile rows (consecutive threads, consecutive words:
  conflict-free). Each thread's R x m_tile partial sums go through warp_sum, meet in shared memory and are
  added in warp order; the same epilogues as above (plain, gated, rope), thread t < m_tile * outputs
  writing one, with what its store reads besides the sums (rope: position, cos, sin, slot) loaded before
  the PDL wait, so that no dependent load follows the reduction. Weights in flight wait in shared
  memory rather than registers, so a block holds few registers (40-56 at m = 1 against 80-128 for
  the picks above, offline ptxas) and the next kernel's blocks can be resident, and loading, while this
  one finishes.
- ``gemm`` (prefill, large M): grid = (ceil(N / BN), ceil(M / BM)), block = (BM / TM) * (BN / TN)
  threads; a block computes a BM x BN tile of out, staging BK-wide slabs of x and of W (widened to fp32)
  through shared memory; thread (tx, ty) owns the TM x TN outputs (ty + i * BM/TM, tx + j * BN/TN).
- ``gemm_tc`` (tensor cores; prefill and decode batches above GEMV_MAX_M): grid = (ceil(N / BN),
  ceil(M / BM)), block = 32 * (BM / WM) * (BN / WN) * KW; warp w works on warp tile v = w % ((BM/WM) *
  (BN/WN)), the WM x WN sub-tile at ((v // (BN/WN)) * WM, (v % (BN/WN)) * WN), i.e. (WM/16) x (WN/8) mma
  tiles of 16 x 8, whose fragments follow cuda_kernels/mma.py (lane (g, t) = (lane // 4, lane % 4)
  accumulates rows g, g + 8 and columns 2t, 2t + 1 of each), over the k-steps of K group w // (number of
  warp tiles): a slab's BK / 16 k-steps are split into KW equal runs, one per group (split-K inside the
  block, so that a skinny tile still has 8-16 warps), and at the end groups 1..KW-1 add their partial
  tiles into group 0's through shared memory, in that fixed order. Per BK slab, thread i stages 4-element
  quads i, i + threads, ... of x (three bf16 planes, or one with bf16_inputs) and of W into shared memory
  (one of STAGES buffers), while the next slab's quads are already loading into its registers. The tile
  (BM, BN, BK, WM, WN, KW, STAGES) comes from gemm_tc_tile(M, N, K), a policy by shape (16- and 32-row
  tiles for decode batches, 64 x 64 and 128 x 128 for prefill; its docstring gives the reasoning).

The bf16x3 split (gemm_tc, fp32 mode). Tensor cores multiply bf16, but x is fp32 (DESIGN.md: GPU and
reference may differ only in summation order). So each x is cut into three bf16 pieces, x = hi + mid + lo
exactly (24 significant bits = 8 + 8 + 8; see split_bf16x3), and out = hi @ W^T + mid @ W^T + lo @ W^T, three mma per
16 x 8 x 16 tile, all into the same fp32 accumulators. A product of two bf16 (8 significant bits each) is
exact in fp32, so every term piece * w is exact and only the order (and the tensor core's internal rounding)
of the fp32 sums differs from the reference. W is bf16 already: one B fragment serves all three pieces.
The price is 3x the tensor-core work: the ceiling is a third of the mma peak. Exactness needs the pieces to
be normal numbers: below about 2^-110 the low pieces become subnormal (or zero) and some low bits of x go
(an absolute error of at most about 2^-125 |w| per term, far under the tolerance). An infinite x stays
infinite (it is all hi); an infinite weight meets zero pieces and gives NaN, not +-inf (weights are finite).
With bf16_inputs there is one piece, bf16(x), staged as one shared-memory plane instead of three: one mma
per tile (the ceiling is the whole mma peak) and a third of the x staging and its shared memory.

Versions:
1. matmul_naive: one thread per output, uncoalesced W reads. The teaching baseline.
2. gemv: a warp per weight row (or a few), 64-bit weight loads, each weight read once for up to 8 x rows;
   several loads per row in flight per lane and, for few rows, K split over the warps of a block (the
   first version, GemvConfig(), issued one load per row at a time: 1.6-2.5x slower on the 1B weights of
   fewer than 8192 rows, gemv_config's docstring). With the gated epilogue, gate/up and SiLU*mul are one
   kernel (`gated_matmul`; above decode sizes gemm_pipelined's gated epilogue where matmul would take
   gemm_pipelined, else matmul + activation.silu_and_mul).
   With the RoPE epilogue the QKV projection, RoPE and the KV-cache write are one kernel
   (`matmul_rope_kv_write`, which falls back to matmul + rope.rope_kv_write above decode sizes).
   The staged variant (GemvStaged) keeps the weights in flight in shared memory instead of registers. It
   is tested (simulator) but not yet timed on the GPU, so gemv_config does not pick it (see its NOTE).
3. gemm: shared-memory tiled fp32 GEMM with a register tile per thread (no tensor cores).
4. gemm_tc: tensor cores (mma.sync m16n8k16 bf16, fp32 accumulators) with the bf16x3 split of x (or x
   rounded to bf16: one mma instead of three), tiled through shared memory as packed bf16 quads (64-bit,
   conflict-free fragment loads), W read as 64-bit words when K % 4 == 0, the next slab prefetched into
   registers; skinny tiles with split-K across the warps of a block for decode batches, an optional second
   shared-memory stage (one block barrier per slab), the tile picked by shape (gemm_tc_tile).
   Its addressing is flat: flat shared slabs and flat x / W, each thread's staging offsets computed once
   instead of per slab, uint64 indices (no negative-index wraparound), no k checks on interior slabs.
   NOTE: a first version indexed multi-dimensional arrays and recomputed (row, k) per slab; integer index
   arithmetic was ~75% of its main loop's SASS (offline ptxas + nvdisasm, 32 x 64 x 64 tile with bf16
   inputs: 297 of 387 instructions per slab for 8 HMMA). The flat map cuts that to 179 of 326 (104
   registers instead of 128-133), and measured on the H200 it was faster on every 1B weight at M = 16, 64,
   256 and 1024 in both modes: 1.1-1.4x, e.g. QKV at M = 64 with bf16 inputs 30.6 us against 38.6, gate/up
   at M = 1024 in fp32 mode 1,006 against 1,389 (BENCHMARKS.md).
5. matmul: what the engine calls; gemv for M <= GEMV_MAX_M (GEMV_WIDE_MAX_M for wide weights), gemm_tc
   above (gemm in the simulator), and from PIPELINED_MIN_M rows (PIPELINED_WIDE_MIN_M for wide weights),
   when the caller gives a workspace for x's bf16 planes, version 6.
6. gemm_pipelined (cuda_kernels/gemm_pipelined.py): x converted once into bf16 planes, then both operands
   streamed into shared memory by cp.async several K slabs ahead, fragments loaded with ldmatrix (no
   register staging): up to 2.7x gemm_tc with bf16 inputs and 1.6x in fp32 mode at M = 256 (BENCHMARKS.md).
   With its gated epilogue writing bf16 planes, `mlp` runs the whole MLP at prefill sizes as two GEMMs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import activation, gemm_pipelined, pdl, rope
from cuda_kernels.async_copy import cp_async_16, cp_async_commit, cp_async_wait
from numba import cuda, float32, int64, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import OPT_IN_SHARED_LIMIT, launch, view
from cuda_kernels.mma import halves, mma_bf16_m16n8k16, pack4, split_bf16x3
from cuda_kernels.primitives import (WARP, bf16_to_f32, f32_from_bits, f32_to_bf16, round_bf16, round_bf16_pair,
                                     warp_sum)

# Largest M that the engine's matmul sends to gemv (GEMV_WIDE_MAX_M for weights of GEMV_WIDE_N rows or
# more); above it gemm_tc. NOTE: measured on the H200, cold weights: at M = 8 gemv beat gemm_tc's skinny
# tile on QKV, O and down (19 / 14 / 50 us against 25 / 21 / 78) but lost on gate/up and the LM head
# (83 / 560 against 50 / 377); at M = 4 it won on all five (gate/up 42 against 50).
GEMV_MAX_M = 8
GEMV_WIDE_MAX_M = 4
if SIMULATOR:
    # Each simulated warp reduction is two block barriers over Python threads: the engine's matmuls take the
    # barrier-light tiled path there (the kernel tests still run gemv itself in the simulator).
    GEMV_MAX_M = GEMV_WIDE_MAX_M = 0

# gemv compiles one kernel per m_tile (accumulators are registers, so their count must be a constant).
_GEMV_M_TILES = (1, 2, 4, 8)


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


class GemmTile(NamedTuple):
    bm: int = 64   # output tile rows (M)
    bn: int = 64   # output tile columns (N)
    bk: int = 16   # K slab staged in shared memory per step
    tm: int = 4    # outputs per thread along M
    tn: int = 4    # outputs per thread along N


class GemmTcTile(NamedTuple):
    bm: int = 128  # output tile rows (M), a multiple of wm
    bn: int = 128  # output tile columns (N), a multiple of wn
    bk: int = 32   # K slab staged in shared memory per step, a multiple of 16 (one mma k-step)
    wm: int = 64   # rows of the warp tile, a multiple of 16 (m16 of the mma)
    wn: int = 32   # columns of the warp tile, a multiple of 8 (n8 of the mma)
    kw: int = 1    # K groups: warps splitting each slab's k-steps over the same warp tiles (bk/16 % kw == 0)
    stages: int = 1  # shared-memory slab buffers: 2 = one block barrier per slab instead of two
    min_blocks: int = 0  # blocks per SM the registers must allow (ptxas launch bounds); 0: ptxas decides


# gemv_config's choices (measured; see its docstring; GemvConfig() is the first version's one-load loop)
GEMV_WIDE, GEMV_SPLIT = GemvConfig(4, 4, 4, 2), GemvConfig(4, 4, 4, 2, True)
GEMV_SPLIT_SMALL, GEMV_LONG_K = GemvConfig(8, 4, 2, 4, True), GemvConfig(8, 4, 4, 4, True)
GEMV_SMALL_N = 2048
GEMV_WIDE_M, GEMV_LONG_K_M, GEMV_SPLIT_M = GemvConfig(4, 2, 4, 1), GemvConfig(8, 2, 2, 4), GemvConfig(4, 2, 4, 2)
GEMV_WIDE_N = 8192
# The simulator runs one Python thread per CUDA thread: fewer, busier threads keep engine tests affordable
# there (the kernel tests cover the GPU's configurations too).
GEMM_TILE = GemmTile(16, 16, 8, 2, 2) if SIMULATOR else GemmTile()

# gemm_tc tiles (gemm_tc_tile picks one; every one can also be passed as gemm_tc's `tile`). Static shared
# memory is capped at 48 KB per block (more needs a dynamic opt-in, GPU.md); all of these fit in fp32 mode,
# so the choice does not depend on bf16_inputs.
SM_COUNT = 132                 # H200
GEMM_TC_MAX_SHARED = 48 * 1024
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
GEMM_TC_BIG_BLOCKS = 128       # the big tile from this many blocks up (measured, see gemm_tc_tile)
GEMM_TC_SMALL_MIN_M = 256      # the 64 x 64 tile only above this M (measured, see gemm_tc_tile)
GEMM_TC_SKINNY_BLOCKS = 2 * SM_COUNT // 3   # the widest skinny tile with at least this many blocks
GEMM_TC_DEEP_K = 4096          # K from which the narrowest skinny tile takes the deep slabs
# Simulator default: 4 warps (2 along N, 2 K groups) with one k-step each, every code path at 128 threads.
GEMM_TC_SIM_TILE = GemmTcTile(16, 16, 32, 16, 8, 2)
# From this many rows (PIPELINED_WIDE_MIN_M for weights of GEMV_WIDE_N rows or more) matmul takes
# gemm_pipelined when it is given a planes workspace. NOTE: measured on the H200 at M = 64, gemm_tc's skinny
# split-K tiles beat it on QKV, O and down (fp32: 44 / 31 / 118 us against 58 / 58 / 218) while it wins on
# gate/up and the LM head (62 / 354 against 114 / 850); at M = 256 it wins or ties on every weight.
PIPELINED_MIN_M = 128
PIPELINED_WIDE_MIN_M = 64
_NAIVE_BLOCK_N = 128


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
def _matmul_naive_kernel(bf16_inputs: bool):
    """The naive kernel; with bf16_inputs every x is rounded to the nearest bf16 as it is read."""

    @cuda.jit
    def matmul_naive_kernel(x, weight, out):
        """x (M, K) f32, weight (N, K) u16 bf16, out (M, N) f32. Thread (n, m) computes out[m, n]."""
        n, m = cuda.grid(2)
        if m >= x.shape[0] or n >= weight.shape[0]:
            return
        # NOTE: neighbouring threads read W rows K elements apart (uncoalesced); gemv fixes that by giving a
        # row to a warp. fp32 accumulation throughout, as everywhere in the project.
        acc = float32(0)
        for k in range(x.shape[1]):
            xv = round_bf16(x[m, k]) if bf16_inputs else x[m, k]
            acc += xv * bf16_to_f32(weight[n, k])
        out[m, n] = acc

    return matmul_naive_kernel


@functools.lru_cache(maxsize=None)
def _gemv_rows(rows: int, pairing: str, head_dim: int):
    """(weight_row, store_inputs, store): the device functions by which a gemv kernel maps a group of `rows`
    weight rows to the weight and writes their results, for a pairing (see _gemv_kernel).

    weight_row(n0, r, N): the weight row of row r of the group starting at n0 (a multiple of rows), clamped
    to a valid one (the caller skips the store for it). store(dst, m, j, a, b, pre): write output j of
    activation row m from its row total a (paired: the totals a and b of pair j); dst holds the arrays
    written, pre = store_inputs(dst, m, j) what else the store reads (rope: cos, sin and the slot). Those
    are step inputs and constants, never written by a kernel of the step, so a kernel may read them before
    its PDL wait (cuda_kernels/pdl.py, rule 2) and keep the dependent loads out of its tail."""
    R = rows
    RH = R // 2                             # paired: pairs per group
    GATED, ROPE = pairing == "gated", pairing == "rope"
    PAIRED = GATED or ROPE
    HALF = head_dim // 2

    @cuda.jit(device=True, inline=True)
    def weight_row(n0, r, N):
        """n0 + r, or paired, row r % (R/2) of pair n0 / 2 + r % (R/2) (its first row for r < R/2, else its
        second): gated, gate row p or up row F + p (N = 2F); rope, row i or i + d/2 of head h for pair
        p = h d/2 + i."""
        if not PAIRED:
            return min(n0 + r, N - 1)
        pair = min(n0 // 2 + r % RH, N // 2 - 1)
        if GATED:
            return pair + (r // RH) * (N // 2)
        return (pair // HALF) * (2 * HALF) + pair % HALF + (r // RH) * HALF

    # One store (and its inputs) per epilogue, picked below.
    @cuda.jit(device=True, inline=True)
    def no_inputs(dst, m, j):
        return 0

    @cuda.jit(device=True, inline=True)
    def store_row(dst, m, j, a, b, pre):
        dst[0][m, j] = a

    @cuda.jit(device=True, inline=True)
    def store_gated(dst, m, j, a, b, pre):
        dst[0][m, j] = activation.silu(a) * b

    @cuda.jit(device=True, inline=True)
    def rope_inputs(dst, m, j):
        """(cos, sin) of pair j at row m's position, and row m's cache slot."""
        q_out, positions, cos, sin, k_cache, v_cache, slot_mapping = dst
        pos, i = positions[m], j % HALF
        return cos[pos, i], sin[pos, i], slot_mapping[m]

    @cuda.jit(device=True, inline=True)
    def store_rope(dst, m, j, a, b, pre):
        q_out, positions, cos, sin, k_cache, v_cache, slot_mapping = dst
        c, s, slot = pre
        head, i = j // HALF, j % HALF
        num_heads, num_kv_heads = q_out.shape[1], k_cache.shape[2]
        if head < num_heads + num_kv_heads:
            # rope_kv_write's rotation, the same expressions
            a, b = a * c - b * s, b * c + a * s
        if head < num_heads:
            q_out[m, head, i] = a
            q_out[m, head, i + HALF] = b
        elif slot >= 0:
            block, offset = slot // k_cache.shape[1], slot % k_cache.shape[1]
            if head < num_heads + num_kv_heads:
                k_cache[block, offset, head - num_heads, i] = f32_to_bf16(a)
                k_cache[block, offset, head - num_heads, i + HALF] = f32_to_bf16(b)
            else:
                v_cache[block, offset, head - num_heads - num_kv_heads, i] = f32_to_bf16(a)
                v_cache[block, offset, head - num_heads - num_kv_heads, i + HALF] = f32_to_bf16(b)

    if ROPE:
        return weight_row, rope_inputs, store_rope
    return weight_row, no_inputs, store_gated if GATED else store_row


@functools.lru_cache(maxsize=None)
def _gemv_kernel(m_tile: int, warps_per_block: int, rows_per_warp: int, unroll: int, k_split: int,
                 pipelined: bool, bf16_inputs: bool, pairing: str = "", head_dim: int = 0):
    """The gemv kernel for m_tile activation rows per block, rows_per_warp weight rows per warp, `unroll`
    64-bit weight loads per row in flight per lane, and K split over k_split warps of the block; pipelined,
    the loads of a lane's next pass are issued before its current one is consumed; with bf16_inputs every x
    is rounded to the nearest bf16 as it is read.

    pairing: "" (plain rows n0.., out (M, N)), or an epilogue on pairs of rows, a warp's first R/2 rows
    pairing with its last R/2 (R even). "gated": W is [gate; up] (2F rows); the pair of feature j is gate
    row j and up row F + j, and the kernel writes silu(gate) * up (out (M, F)). "rope": W is the fused QKV
    weight, heads of head_dim rows; the pair of (head, i) is rows i and i + head_dim/2 of the head, the two
    halves RoPE rotates together, and the kernel (gemv_rope_kernel) writes what rope.rope_kv_write would
    from the product: rotated q, and the rotated K and the V of each token into its cache slot."""
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
    weight_row, store_inputs, store = _gemv_rows(R, pairing, head_dim)

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
    def gemv_rope_kernel(x, w64, w16, kv, q_out, positions, cos, sin, k_cache, v_cache, slot_mapping):
        # q_out (M, Hq, d) f32; positions, slot_mapping (M,) int; cos, sin (max_positions, d/2) f32;
        # k_cache, v_cache (blocks, block_size, Hkv, d) u16 bf16 (rope.py's arguments)
        gemv_body(x, w64, w16, kv, (q_out, positions, cos, sin, k_cache, v_cache, slot_mapping))

    kernel = gemv_rope_kernel if ROPE else gemv_kernel
    kernel.rows_per_block = ROWS_PER_BLOCK
    return kernel


@functools.lru_cache(maxsize=None)
def _gemv_staged_kernel(m_tile: int, rows_per_block: int, warps_per_block: int, k: int, bf16_inputs: bool,
                        pairing: str = "", head_dim: int = 0):
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
    weight_row, store_inputs, store = _gemv_rows(R, pairing, head_dim)
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
        # NOTE: 64-bit x loads were never slower than 32-bit ones in a lab copy of the register gemv and up to
        # 0.28 us faster on the 1B weights (BENCHMARKS.md, 2026-12-04 fifth run). The register gemv itself
        # keeps 32-bit ones: there they cost registers (offline ptxas: gate/up 64 -> 72, the m = 8 kernels
        # 80 -> 94 and 94 -> 114), hence occupancy, which only a GPU run can weigh.
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
    def gemv_staged_rope_kernel(x64, w64, q_out, positions, cos, sin, k_cache, v_cache, slot_mapping):
        # the arguments of gemv_rope_kernel (x as x64, no w16, no kv)
        staged_body(x64, w64, (q_out, positions, cos, sin, k_cache, v_cache, slot_mapping))

    return gemv_staged_rope_kernel if pairing == "rope" else gemv_staged_kernel


@functools.lru_cache(maxsize=None)
def _gemm_kernel(bm: int, bn: int, bk: int, tm: int, tn: int, bf16_inputs: bool):
    """The tiled gemm kernel for a BM x BN output tile, BK-wide K slabs and a TM x TN register tile; with
    bf16_inputs every x is rounded to the nearest bf16 as it is staged."""
    if bm % tm or bn % tn:
        raise ValueError(f"tile ({bm}, {bn}) is not a multiple of the thread tile ({tm}, {tn})")
    TX = bn // tn                 # threads along N
    TY = bm // tm                 # threads along M
    THREADS = TX * TY
    if THREADS % WARP or THREADS > 1024:
        raise ValueError(f"gemm tile gives {THREADS} threads per block: need a multiple of 32, at most 1024")
    if (bm * bk) % THREADS or (bn * bk) % THREADS:
        raise ValueError(f"the {bm}x{bk} and {bn}x{bk} slabs must split evenly over {THREADS} threads")
    X_LOADS = bm * bk // THREADS
    W_LOADS = bn * bk // THREADS
    # NOTE: the slabs are stored transposed (k major) so the inner loop reads a row of BM (or BN) values.
    # The loads walk k fastest (coalesced in global memory) and so write shared memory with a stride of one
    # padded row; 32 // BK rows of a warp land on distinct banks when the row length is BM + 32 // BK.
    PAD = max(1, WARP // bk)
    XS_COLS = bm + PAD
    WS_COLS = bn + PAD

    @cuda.jit
    def gemm_kernel(x, weight, out):
        """x (M, K) f32, weight (N, K) u16 bf16, out (M, N) f32; block (bx, by) computes the out tile
        [by*BM : by*BM+BM, bx*BN : bx*BN+BN]."""
        M = x.shape[0]
        K = x.shape[1]
        N = weight.shape[0]
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn

        xs = cuda.shared.array((bk, XS_COLS), float32)   # xs[k, m] = x[m0 + m, k0 + k]
        ws = cuda.shared.array((bk, WS_COLS), float32)   # ws[k, n] = W[n0 + n, k0 + k] widened
        acc = cuda.local.array((tm, tn), float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        for i in range(tm):
            for j in range(tn):
                acc[i, j] = float32(0)

        for k0 in range(0, K, bk):
            # Stage the slabs; zeros past the edges of x and W make the inner loop edge-free.
            for e in range(X_LOADS):
                idx = tid + THREADS * e
                r = idx // bk
                c = idx % bk
                m = m0 + r
                k = k0 + c
                xv = x[m, k] if m < M and k < K else float32(0)
                xs[c, r] = round_bf16(xv) if bf16_inputs else xv
            for e in range(W_LOADS):
                idx = tid + THREADS * e
                r = idx // bk
                c = idx % bk
                n = n0 + r
                k = k0 + c
                ws[c, r] = bf16_to_f32(weight[n, k]) if n < N and k < K else float32(0)
            cuda.syncthreads()

            for kk in range(bk):
                for i in range(tm):
                    a[i] = xs[kk, ty + TY * i]
                for j in range(tn):
                    b[j] = ws[kk, tx + TX * j]
                for i in range(tm):
                    for j in range(tn):
                        acc[i, j] += a[i] * b[j]
            cuda.syncthreads()  # the next slab overwrites xs and ws

        for i in range(tm):
            m = m0 + ty + TY * i
            if m < M:
                for j in range(tn):
                    n = n0 + tx + TX * j
                    if n < N:
                        out[m, n] = acc[i, j]

    gemm_kernel.threads = THREADS
    return gemm_kernel


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
# launchers
# ---------------------------------------------------------------------------------------------------------

def _is_device_array(a) -> bool:
    # Duck-typed: numba's DeviceNDArray and the simulator's FakeCUDAArray both have copy_to_host (the
    # simulator has no cuda.is_cuda_array). A host array would make numba copy it in and out on every launch.
    return hasattr(a, "copy_to_host") and hasattr(a, "dtype") and hasattr(a, "shape")


def _check_args(x, weight, out, allow_u64_weight=False, gated=False):
    """Validate x (M, K) f32, weight (N, K) u16 [or (N, K/4) u64 view], out (M, N) f32 (gated: N even and out
    (M, N/2); None: not checked, the caller checks its outputs); return (M, N, K)."""
    for name, a in (("x", x), ("weight", weight), ("out", out)):
        if a is None:
            continue
        if not _is_device_array(a):
            raise TypeError(f"matmul: {name} must be a numba device array (cuda.to_device / device_array), "
                            f"got {type(a).__name__}")
        if len(a.shape) != 2:
            raise ValueError(f"matmul: {name} must be 2-D, got shape {tuple(a.shape)}")
    if x.dtype != np.float32:
        raise ValueError(f"matmul: x must be float32, got {x.dtype} (shape {tuple(x.shape)})")
    if out is not None and out.dtype != np.float32:
        raise ValueError(f"matmul: out must be float32, got {out.dtype} (shape {tuple(out.shape)})")
    M, K = x.shape
    N, wk = weight.shape
    if weight.dtype == np.uint64 and allow_u64_weight:
        wk *= 4  # the uint64 view of a uint16 (N, K) weight
    elif weight.dtype != np.uint16:
        allowed = "uint16 bf16 bits (or its uint64 view)" if allow_u64_weight else "uint16 bf16 bits"
        raise ValueError(f"matmul: weight must be {allowed}, got {weight.dtype} "
                         f"(shape {tuple(weight.shape)})")
    if wk != K:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"({weight.dtype}) disagree on K ({K} vs {wk})")
    if out is None:
        return M, N, K
    if gated and (N % 2 or tuple(out.shape) != (M, N // 2)):
        raise ValueError(f"gated matmul: weight must be [gate; up] with an even row count and out (M, N/2) = "
                         f"({M}, {N // 2}) for x {tuple(x.shape)} and weight {tuple(weight.shape)}, "
                         f"got out {tuple(out.shape)}")
    if not gated and tuple(out.shape) != (M, N):
        raise ValueError(f"matmul: out must have shape (M, N) = ({M}, {N}) for x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}, got {tuple(out.shape)}")
    return M, N, K


def matmul_naive(x, weight, out, stream=0, bf16_inputs: bool = False):
    """out = x @ W^T, one thread per output element (the teaching baseline); x rounded to bf16 first if asked."""
    M, N, _ = _check_args(x, weight, out)
    if M == 0 or N == 0:
        return
    grid = ((N + _NAIVE_BLOCK_N - 1) // _NAIVE_BLOCK_N, M)
    _matmul_naive_kernel(bool(bf16_inputs))[grid, (_NAIVE_BLOCK_N, 1), stream](x, weight, out)


def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """The GemvConfig gemv uses by default for x (m, k) @ W (n, k)^T (a pure function of the shape).

    A decode GEMV is a race to keep enough weight bytes in flight: each lane issues rows_per_warp * unroll
    8-byte loads before using the first. With many rows (n >= GEMV_WIDE_N) the grid alone fills the SMs;
    with few, each row's K is split over 4 warps of a block as well. Above m = 1 each weight word also meets
    m rows of x, so fewer loads are kept in flight per lane, and K is split by 4 only for a long K (k >= 4096,
    m <= 2).
    NOTE: measured on the H200 with weights cold in L2 (tools/kernel_benchmarks/matmul.py --gemv;
    BENCHMARKS.md); each pick was the fastest (or within 0.2 us of it) of up to 14 configurations. At m = 1:
    QKV (3072 x 2048) 5.9 us against 10.0 for the first version's (4, 2, 1, 1); O (2048 x 2048) 5.1
    against 10.1; gate/up (16384 x 2048) 19.2 against 23.6; down (2048 x 8192) 11.8 against 31.5; LM head
    (128256 x 2048) 123 against 133. At m = 2..8 the (4, 2, 4, 2) split won on most shapes (down at m = 2:
    13.8 us with (8, 2, 2, 4), 18.0 with it), the unsplit (4, 2, 4, 1) on the wide ones.
    NOTE: under programmatic dependent launch a gemv's first pass of weight loads overlaps the kernel before
    it, so the m = 1 picks were measured again inside the batch-1 decode graph (tools/profile_step.py
    --gemv, the whole step's time, each variant against the old picks in the same run): twice the loads per
    pass on the wide weights, (4, 4, 4, 2) instead of (4, 4, 2, 2), took the step from 1,065.7 to 1,042.5
    us (on gate/up; on the LM head alone 1,063.0 to 1,060.6), and (8, 2, 4, 4) on QKV and O, half the rows
    per warp and twice the loads per pass of (8, 4, 2, 4), from 1,063.3 to 1,055.9 (down already had that
    configuration). Three further variants on down and two on QKV / O were within 0.1% or slower.
    NOTE: the pipelined configurations (the next pass's loads issued before the current one is consumed)
    were measured against the picks above in one run, cold, m = 1 (BENCHMARKS.md, 2026-12-04 fourth
    run): QKV 4.03 us with (4, 4, 4, 2, pipelined) against 6.24 for the old pick (8, 2, 4, 4); O 3.09 us
    with (8, 4, 2, 4, pipelined) against 4.04 (3.59 with QKV's pick; (8, 4, 2, 4, pipelined) took 4.47 us
    on QKV); down 9.36 us with (8, 4, 4, 4, pipelined) against 10.12. Inside the batch-1 bf16 decode step
    the three took 931.8 us against 957.3 with the old picks. On the wide weights and at m > 1 the second
    set of registers cost more than it gained (gate/up 17.7 us against 16.9; the LM head at m = 8, 621
    against 561), so those stay unpipelined.
    NOTE: what still separates QKV and O (about 3,000 and 2,750 GB/s) from a kernel that only reads their
    bytes (4,460 and 4,360) is mostly the x reads: without them (x a constant, same loads and FMAs) QKV took
    3.27 us against 4.36 and O 2.28 against 2.86 (BENCHMARKS.md, 2026-12-04 fifth run). Staging x a pass
    ahead in registers, or once per block in shared memory, was slower; so were 8 rows per warp.
    Loading all of a pass's x values of a row before its first FMA (the PTX issued them one word at a time
    between the FMAs) was within 0.3 us of the picks at m = 1 and 1.35-1.6x slower at m = 8 on O, gate/up,
    down and the LM head (H100, BENCHMARKS.md, 2026-12-05 second run), so it was not kept.
    NOTE: the picks above hold 80-128 registers per thread (offline ptxas): QKV's 384 blocks of 128 threads x
    128 registers take about 3 of the 4 blocks an SM's register file holds, so little of the next kernel
    can be resident, and loading, before they exit (an inference from the register counts, not measured;
    it would also explain why the read probe, with fewer registers, overlaps more). The staged gemv
    (GemvStaged) holds its weights in shared memory instead (40-56 registers at m = 1).
    NOTE: the staged gemv timed cold against the picks in one run (BENCHMARKS.md, 2026-12-05): QKV 3.47 us
    (3,633 GB/s) with GemvStaged(16, 8) against 4.27 for GEMV_SPLIT, 3.52 with (8, 8), 3.88-7.03 for the
    other 9. It lost on O (best 3.19 us against 3.03) and on down (best 10.15 against 9.32); gate/up (8, 4)
    took 16.00 us against 16.86. In the batch-1 step (16, 4) and (8, 4) on QKV and O were even or 0.7%
    slower. (16, 8) on QKV alone, timed in the step (BENCHMARKS.md, 2026-12-05 second run): 951.3 us against
    930.4 for GEMV_SPLIT on the H200 (on an H100, both with the x-load order tried above, 1,151 against
    1,168), so the pick stays GEMV_SPLIT: faster alone and cold is not faster between its neighbours under PDL.
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


def gemv(x, weight, out, stream=0, config: GemvConfig | None = None, bf16_inputs: bool = False,
         gated: bool = False):
    """out = x @ W^T for small M (decode), one warp per weight row (or rows_per_warp rows).

    weight is the (N, K) uint16 array, or its uint64 view (N, K/4) (``weight.view(np.uint64)``, no copy),
    which a caller can make once to save the view's Python cost on every call. A uint16 weight is viewed as
    uint64 here when K % 4 == 0 and it is C-contiguous (64-bit loads); otherwise the kernel takes the scalar
    path (16-bit loads), which is correct for any K but slower. Any M works: x is walked in chunks of up to
    8 rows and the weight is read once per chunk. config: warps per block, weight rows per warp, loads in
    flight per row and K split (tuning); by default gemv_config(M, N, K).
    gated: W is the fused [gate; up] (2F, K) and out (M, F) <- silu(x @ gate^T) * (x @ up^T), the SiLU*mul
    in the epilogue (config.rows_per_warp must be even: a warp pairs its gate and up rows).
    config may also be a GemvStaged (the staged gemv; K % 8 == 0, C-contiguous x and weight, and
    gemv_staged_shared_bytes within launch.OPT_IN_SHARED_LIMIT, else ValueError; gated: rows_per_block even).
    """
    M, N, K = _check_args(x, weight, out, allow_u64_weight=True, gated=gated)
    setup = _gemv_setup(x, weight, M, N, K, config, bf16_inputs, "gated" if gated else "")
    if setup:
        kernel, grid, block, inputs, shared = setup
        launch(kernel, grid, block, stream, *inputs, out, shared=shared, dependent=True)


def gemv_rope(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream=0,
              config: GemvConfig | None = None, bf16_inputs: bool = False):
    """The QKV projection with rope.rope_kv_write as its epilogue, for small M (decode): of qkv = x @ W^T
    (W the fused QKV weight, (Hq + 2 Hkv) d rows) only the results are written: q_out (M, Hq, d) the rotated
    queries, and each token's rotated K and its V into the caches at slot_mapping[m] (-1: not written).
    positions, cos, sin, k_cache, v_cache, slot_mapping as rope.rope_kv_write takes them; weight and config
    as gemv (config.rows_per_warp, or a GemvStaged's rows_per_block, must be even: rows i and i + d/2 of a
    head are paired)."""
    M, N, K = _check_args(x, weight, None, allow_u64_weight=True)
    t, hq, hkv, d = rope.check_rope_args(positions, cos, sin, k_cache, v_cache, slot_mapping, q_out)
    if (M, N) != (t, (hq + 2 * hkv) * d):
        raise ValueError(f"gemv_rope: x {tuple(x.shape)} and weight {tuple(weight.shape)} give a ({M}, {N}) "
                         f"product; q_out and the caches need ({t}, {(hq + 2 * hkv) * d}) for Hq={hq}, "
                         f"Hkv={hkv}, d={d}")
    setup = _gemv_setup(x, weight, M, N, K, config, bf16_inputs, "rope", d)
    if setup:
        kernel, grid, block, inputs, shared = setup
        launch(kernel, grid, block, stream, *inputs, q_out, positions, cos, sin, k_cache, v_cache,
               slot_mapping, shared=shared, dependent=True)


def _m_tile(m: int) -> int:
    """Activation rows per gemv block for x of m rows: the smallest compiled m_tile >= m (at most 8)."""
    return next((t for t in _GEMV_M_TILES if t >= m), _GEMV_M_TILES[-1])


def gemv_staged_shared_bytes(config: GemvStaged, m: int, k: int) -> int:
    """Shared memory per block of the staged gemv at x (m, k): the weight tile (dynamic) and the warps'
    partial sums (static)."""
    rows, warps = config
    return rows * k * 2 + warps * _m_tile(m) * rows * 4


def _gemv_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim=0):
    """(the gemv kernel, its grid and block, its arguments for x and the weight, its dynamic shared memory in
    bytes) for x (M, K) @ weight^T, or None when there is nothing to compute; checks config."""
    if M == 0 or N == 0:
        return None
    config = config or gemv_config(M, N, K)
    if isinstance(config, GemvStaged):
        return _gemv_staged_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim)
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
    kernel = _gemv_kernel(m_tile, *config, bool(bf16_inputs), pairing, head_dim)
    grid = ((N + kernel.rows_per_block - 1) // kernel.rows_per_block, (M + m_tile - 1) // m_tile)
    return kernel, grid, WARP * config.warps_per_block, (x, w64, w16, kv), 0


def _gemv_staged_setup(x, weight, M, N, K, config, bf16_inputs, pairing, head_dim):
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
    kernel = _gemv_staged_kernel(m_tile, rows, warps, K, bool(bf16_inputs), pairing, head_dim)
    grid = (-(-N // rows), -(-M // m_tile))
    inputs = (view(x, dtype=np.uint64), view(weight, shape=(N * K // 4,), dtype=np.uint64))
    return kernel, grid, WARP * warps, inputs, rows * K * 2


def gemm(x, weight, out, stream=0, tile: GemmTile = GEMM_TILE, bf16_inputs: bool = False):
    """out = x @ W^T for large M (prefill): shared-memory tiled fp32 GEMM, any M, N, K; x rounded to bf16
    first if asked."""
    M, N, _ = _check_args(x, weight, out)
    if M == 0 or N == 0:
        return
    kernel = _gemm_kernel(*tile, bool(bf16_inputs))
    grid = ((N + tile.bn - 1) // tile.bn, (M + tile.bm - 1) // tile.bm)
    launch(kernel, grid, kernel.threads, stream, x, weight, out)


def _blocks(tile: GemmTcTile, m: int, n: int) -> int:
    return ((n + tile.bn - 1) // tile.bn) * ((m + tile.bm - 1) // tile.bm)


def gemm_tc_tile(m: int, n: int, k: int, bf16_inputs: bool = False) -> GemmTcTile:
    """The tile gemm_tc uses by default for x (m, k) @ W (n, k)^T (a pure function of the shape and mode).

    1. GEMM_TC_TILE (128 x 128) when m > 64 and its grid has at least GEMM_TC_BIG_BLOCKS blocks: most reuse
       per byte staged. NOTE: measured on the H200 (BENCHMARKS.md, fp32 mode): at 128 blocks (down, M = 1024) it took
       705 us against 957 us for the 64 x 64 tile; at 32 blocks (down, M = 256) 696 against 404 us; at 192
       (QKV, M = 1024) the 64 x 64 tile was 4-12% faster in fp32 mode and 4% slower with bf16 inputs.
    2. Else GEMM_TC_SMALL_TILE (64 x 64) when m > GEMM_TC_SMALL_MIN_M and its grid has GEMM_TC_BIG_BLOCKS
       blocks too.
    3. Else a skinny tile (decode batches, or outputs too small to fill the SMs): bm = 16 for m <= 16, else
       32; the widest of its bn = 64, 32, 16 whose grid has at least GEMM_TC_SKINNY_BLOCKS blocks, else the
       narrowest. At small m the weight read dominates (2.47 GB per decode step), and a weight is read at
       full bandwidth only with enough bytes in flight: each block keeps its next slab of W (bn x bk bf16:
       4 to 16 KB) in registers, so the grid needs blocks on most SMs, and each block 8 or 16 warps (the K
       groups) to issue those loads. Wider bn reads x fewer times per weight byte and stages more W per
       barrier, so it is preferred while the grid still covers two thirds of the SMs.
       NOTE: measured on the H200 at M = 64, 128 and 256 on the QKV, O and down weights in both modes
       (BENCHMARKS.md): the 32-row tile so chosen was the fastest candidate in every case but one (a 1%
       loss), e.g. QKV at M = 64: 32 x 64 (96 blocks) 38 us with bf16 inputs against 61 for 32 x 32 (192
       blocks); O at M = 64: 32 x 32 (128 blocks) 31 us against 39 for 32 x 64 (64 blocks); at M = 256 the
       32 x 64 tile beat the 64 x 64 one by 1.0-2.4x (down: 198 against 470 us with bf16 inputs), which is
       why rule 2 starts above M = 256.
    4. When even the narrowest has fewer than GEMM_TC_SKINNY_BLOCKS blocks, m <= 16 and K is at least
       GEMM_TC_DEEP_K, GEMM_TC_SKINNY_DEEP_TILE: 256-deep slabs double each block's bytes in flight, and a
       long K keeps its 4 K groups busy over many slabs (from the costs above, not measured yet).
    The mode matters in one place: in fp32 mode a 32-row tile gets min_blocks = SKINNY32_FP32_MIN_BLOCKS.
    NOTE: ptxas gives those tiles 133-136 registers in fp32 mode (one 256-thread block per SM) and 128
    when asked for two, without spills (tools/offline_compile.py's machinery); measured on the H200 that made
    fp32 mode 1.3-1.5x faster (QKV at M = 256: 107 against 141 us; gate/up at M = 64: 135 against 193),
    while with bf16 inputs (128 registers already) the bound made them 5-12% slower.
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


def gemm_tc(x, weight, out, stream=0, tile: GemmTcTile | None = None, bf16_inputs: bool = False):
    """out = x @ W^T on tensor cores, any M, N, K: x as three bf16 pieces (bf16x3, fp32-exact products) or,
    with bf16_inputs, rounded to the nearest bf16 (one piece, a third of the mma work).

    tile: the block and warp tiles, K groups and stages; by default gemm_tc_tile(M, N, K) (GEMM_TC_SIM_TILE
    in the simulator). x and the weight must be C-contiguous. The weight is read 4 bf16 per load through its
    uint64 view when K % 4 == 0, one bf16 per load otherwise.
    """
    M, N, K = _check_args(x, weight, out)
    for name, a in (("x", x), ("weight", weight)):
        if not a.is_c_contiguous():  # the kernel indexes both as flat arrays
            raise ValueError(f"gemm_tc: {name} must be C-contiguous, got shape {tuple(a.shape)} with strides "
                             f"{tuple(a.strides)} (copy it into a contiguous buffer)")
    if M == 0 or N == 0:
        return
    tile = GemmTcTile(*tile) if tile else (GEMM_TC_SIM_TILE if SIMULATOR else gemm_tc_tile(M, N, K, bf16_inputs))
    w_words = K % 4 == 0
    w = view(weight, (N * K // 4,), np.uint64) if w_words else view(weight, (N * K,))
    kernel = _gemm_tc_kernel(*tile, w_words, bool(bf16_inputs))
    grid = ((N + tile.bn - 1) // tile.bn, (M + tile.bm - 1) // tile.bm)
    launch(kernel, grid, kernel.threads, stream, view(x, (M * K,)), w, out)


def uses_pipelined(m: int, n: int, k: int) -> bool:
    """Whether matmul, given a planes workspace, sends x (m, k) @ W (n, k)^T to gemm_pipelined, not gemm_tc."""
    return not SIMULATOR and k % 8 == 0 and m >= (PIPELINED_WIDE_MIN_M if n >= GEMV_WIDE_N else PIPELINED_MIN_M)


def uses_gemv(m: int, n: int) -> bool:
    """Whether matmul sends x (m, K) @ W (n, K)^T to gemv (decode sizes) rather than a tiled kernel."""
    return m <= (GEMV_WIDE_MAX_M if n >= GEMV_WIDE_N else GEMV_MAX_M)


def pipelined_plan(m: int, n: int, k: int, bf16_inputs: bool, gated: bool = False,
                   split_workspace=None) -> tuple[gemm_pipelined.PipelinedTile, int] | None:
    """(tile, splits) when matmul (given a planes workspace) runs x (m, k) @ W (n, k)^T on gemm_pipelined, else
    None: with a split workspace every M from gemv's limit up to gemm_pipelined.SKINNY_MAX_M takes the skinny
    plan (K split over blocks, so that the weight streams from every SM), larger M the policy's tile;
    without one, M from PIPELINED_MIN_M (PIPELINED_WIDE_MIN_M for wide weights) only."""
    if SIMULATOR or k % 8 or uses_gemv(m, n):
        return None
    if split_workspace is not None and m <= gemm_pipelined.SKINNY_MAX_M:
        return gemm_pipelined.skinny_plan(m, n, k, bf16_inputs, gated)
    if uses_pipelined(m, n, k):
        return gemm_pipelined.pipelined_tile(m, n, k, bf16_inputs), 1
    return None


def gated_matmul(x, weight, out, scratch, stream=0, bf16_inputs: bool = False, workspace=None,
                 split_workspace=None, planes_ready: bool = False):
    """out (M, F) <- silu(x @ gate^T) * (x @ up^T) for the fused weight [gate; up] (2F, K): at decode sizes
    one gemv with the SiLU*mul in its epilogue; where matmul would take gemm_pipelined (given a planes
    workspace; pipelined_plan), gemm_pipelined with the same epilogue; else matmul into scratch (at least
    (M, 2F) float32) and activation.silu_and_mul. planes_ready: as matmul's. Twin: reference.matmul.gated_matmul."""
    plan = workspace is not None and pipelined_plan(x.shape[0], weight.shape[0], x.shape[1], bf16_inputs, True,
                                                    split_workspace)
    if uses_gemv(x.shape[0], weight.shape[0]):
        gemv(x, weight, out, stream, bf16_inputs=bf16_inputs, gated=True)
    elif plan:
        _check_args(x, weight, out, gated=True)
        gemm_pipelined.gemm_pipelined(x, weight, out, workspace, stream, bf16_inputs=bf16_inputs, gated=True,
                                      tile=plan[0], splits=plan[1], split_workspace=split_workspace,
                                      planes_ready=planes_ready)
    else:
        gate_up = _rows(scratch, x.shape[0])
        matmul(x, weight, gate_up, stream, bf16_inputs=bf16_inputs, workspace=workspace)
        activation.silu_and_mul(gate_up, out, stream)


def mlp(x, gate_up, down, out, act, scratch, stream=0, bf16_inputs: bool = False, workspace=None, act_planes=None,
        split_workspace=None, planes_ready: bool = False):
    """The gated MLP: out (M, H) <- act @ down^T, act = silu(x @ gate^T) * (x @ up^T) (M, F), for the fused
    [gate; up] (2F, H) and down (H, F). Where both GEMMs run on gemm_pipelined (given the planes workspace
    for x and act_planes, uint16 (P * M, F) with P = gemm_pipelined.pieces(bf16_inputs)), the gated GEMM
    writes act straight as the bf16 planes the down GEMM multiplies: act never exists in fp32 and no planes
    conversion runs between the two (act itself is not written). Else gated_matmul into act (at least
    (M, F) float32, scratch as gated_matmul takes it), then matmul. planes_ready: x's planes are in the
    workspace already (see matmul). Twin: reference.matmul.mlp."""
    M, N, K = _check_args(x, gate_up, None)
    plans = workspace is not None and act_planes is not None and (
        pipelined_plan(M, N, K, bf16_inputs, True, split_workspace),
        pipelined_plan(M, *down.shape, bf16_inputs, False, split_workspace))
    if plans and all(plans):
        (up_tile, up_splits), (down_tile, down_splits) = plans
        planes = view(act_planes, (act_planes.shape[0] * act_planes.shape[1],))
        gemm_pipelined.gemm_pipelined(x, gate_up, act_planes, workspace, stream, bf16_inputs=bf16_inputs, gated=True,
                                      tile=up_tile, splits=up_splits, split_workspace=split_workspace,
                                      planes_ready=planes_ready)
        gemm_pipelined.gemm_planes(planes, M, down, out, stream, bf16_inputs=bf16_inputs, tile=down_tile,
                                   splits=down_splits, split_workspace=split_workspace)
    else:
        gated_matmul(x, gate_up, act, scratch, stream, bf16_inputs=bf16_inputs, workspace=workspace,
                     split_workspace=split_workspace, planes_ready=planes_ready)
        matmul(act, down, out, stream, bf16_inputs=bf16_inputs, workspace=workspace, split_workspace=split_workspace)


def matmul_rope_kv_write(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, scratch, stream=0,
                         bf16_inputs: bool = False, workspace=None, split_workspace=None, planes_ready: bool = False):
    """The QKV projection, then RoPE and the KV-cache write (rope.rope_kv_write's outputs from qkv = x @ W^T):
    at decode sizes one gemv with the rotation and the cache write in its epilogue (gemv_rope: no qkv in
    memory, no RoPE kernel), else matmul into scratch (at least (M, N) float32) and rope.rope_kv_write.
    planes_ready: as matmul's. Twin: reference.matmul.matmul_rope_kv_write."""
    if uses_gemv(x.shape[0], weight.shape[0]):
        gemv_rope(x, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream,
                  bf16_inputs=bf16_inputs)
    else:
        qkv = _rows(scratch, x.shape[0])
        matmul(x, weight, qkv, stream, bf16_inputs=bf16_inputs, workspace=workspace, split_workspace=split_workspace,
               planes_ready=planes_ready)
        rope.rope_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream)


def _rows(scratch, m: int):
    """The first m rows of scratch; scratch itself when it has m (a slice is a new device array: tens of us)."""
    return scratch if scratch.shape[0] == m else scratch[:m]


def matmul(x, weight, out, stream=0, bf16_inputs: bool = False, workspace=None, split_workspace=None,
           planes_ready: bool = False):
    """out = x @ W^T: the launcher the engine calls; gemv for M <= GEMV_MAX_M (GEMV_WIDE_MAX_M for weights
    of GEMV_WIDE_N rows or more); given a workspace for x's bf16 planes (at least
    gemm_pipelined.workspace_size(M, K, bf16_inputs) uint16), gemm_pipelined where pipelined_plan says (with
    a split workspace, gemm_pipelined.split_workspace_sizes: every M above gemv's, K split for skinny M);
    gemm_tc for the rest.

    bf16_inputs (the engine's matmul_precision "bf16"): x is rounded to the nearest bf16 before it is
    multiplied, by whichever kernel runs. planes_ready: where gemm_pipelined runs, x's bf16 planes are in the
    workspace already (its producer wrote them; the other kernels read x itself).
    NOTE: in the simulator the engine takes gemm instead of gemm_tc: every emulated mma costs two block
    barriers over Python threads (gemm_tc's own tests still run there)."""
    if len(getattr(x, "shape", ())) == 2 and len(getattr(weight, "shape", ())) == 2 and uses_gemv(
            x.shape[0], weight.shape[0]):
        gemv(x, weight, out, stream, bf16_inputs=bf16_inputs)
        return
    if SIMULATOR:
        gemm(x, weight, out, stream, bf16_inputs=bf16_inputs)
        return
    M, N, K = _check_args(x, weight, out)
    plan = workspace is not None and pipelined_plan(M, N, K, bf16_inputs, False, split_workspace)
    if plan:
        gemm_pipelined.gemm_pipelined(x, weight, out, workspace, stream, tile=plan[0], bf16_inputs=bf16_inputs,
                                      splits=plan[1], split_workspace=split_workspace, planes_ready=planes_ready)
    else:
        gemm_tc(x, weight, out, stream, bf16_inputs=bf16_inputs)
