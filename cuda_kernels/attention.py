"""Causal prefill attention over the paged KV cache: a naive version, a flash-attention (online softmax) one,
and flash attention on tensor cores.

For query head h of sequence s at position p (its KV head is h // G, G = Hq / Hkv), over the keys j <= p of
the sequence's context:

    s_j = scale * <q, k_j>,      out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),   m = max_j s_j

The q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s] queries of sequence s are the LAST q_len tokens of its
context (positions context_len - q_len .. context_len - 1), so a chunk of a long prompt, or a prompt whose
prefix came from the prefix cache, attends to everything before it. K and V are read through the block table:
token j lives in block block_tables[s, j // block_size] at offset j % block_size.

Shapes and dtypes:
    q             (T, Hq, d)              float32   the new tokens of every sequence, packed
    k/v_cache     (blocks, bs, Hkv, d)    format    uint16 bf16 bits, float32 or uint8 fp8 e4m3 bits
                                                    (cuda_kernels/kv_format.py); slots past a context are
                                                    never read
    block_tables  (S, max_blocks)         int32     -1 past the end
    cu_seqlens_q  (S + 1,)                int32     rows of q per sequence
    context_lens  (S,)                    int32     cached prefix + the new tokens
    out           (T, Hq, d)              float32
d must be a multiple of 8 and at most 128 (K/V are loaded 64 bits at a time); the tensor-core version takes d
in TC_HEAD_DIMS (16, 32, 64, 128) and raises ValueError otherwise, for callers to fall back.

KV formats: the cache's format is a compile-time choice of each kernel factory (kv_format.codec: how an
element or a 64-bit word is read). The fp8 cache's per-tensor scales are folded in by the launchers (the
score scale times k_scale; the output times v_scale), so the kernels read unscaled e4m3 values. The naive
and flash kernels read every format; the tensor-core kernel reads bf16 and fp8 (an e4m3 value is a bf16
value: staged as bf16, the mma operands stay exact) and refuses fp32, whose K/V would need the 3-piece split
of Q as well (the engine runs the flash kernel for an fp32 cache: that format is for checking, not speed).

Versions:
- `prefill_attention_naive` (teaching): grid = (S, max_q_len, Hq), one warp per (query token, head). It
  materialises the query's whole row of scores in shared memory (so the context is capped at
  NAIVE_MAX_CONTEXT) and makes three passes: scores and their max, exp and their sum, the weighted sum of V.
  K and V are re-read from global memory by every query.
- `prefill_attention` (flash attention, SIMT fp32): grid = (S, ceil(max_q_len * G / ROWS), Hkv). A block owns
  ROWS query rows of one sequence and one KV head, a row being a (query token, query head of the group) pair,
  so the G query heads that share a KV head share every K/V tile. It walks the keys in tiles of 32: the block
  stages a tile in shared memory (widened to fp32), each warp scores it against its ROWS / WARPS rows (lane j
  owns key j of the tile), and updates each row's online softmax state: running max m, per-lane running sum
  l, unnormalised accumulator acc (lane i owns dims i, i + 32, ...), rescaled by exp(m_old - m_new) when the
  max grows. Nothing of size context is ever held, so any context length works, in one pass over K and V.
- `prefill_attention_tc` (flash attention on tensor cores, mma.sync m16n8k16 bf16 -> fp32; cuda_kernels/mma.py):
  the same grid and rows as `prefill_attention`, ROWS = 16 * warps (tc_config: 4 warps, 64-key tiles at
  d <= 64). Warp w owns rows 16 w .. 16 w + 15 of the block (one m16 tile); lane (g, t) = (lane // 4, lane %
  4) holds, in the mma's D layout, rows g and g + 8 and columns 2t, 2t + 1 of every n8 tile. Per tile of KT
  keys the block stages K and V in shared memory as bf16 quads (uint64), then each warp computes
      S (16 x KT) = Q K^T          A = Q (three bf16 pieces, quads in shared memory), B[k = dim, n = key] = K
      online softmax of S          in registers, row max/sum across the 4 lanes of a group (2 shuffles)
      O (16 x d) += P V            A = P straight from S's accumulators, B[k = key, n = dim] = V
  and after the last tile out = O / l. Nothing of size context is held; causal: a block walks keys 0 ..
  its last row's position only, and only tiles reaching past its first row's position are masked.

  The register trick (FlashAttention-2): lane (g, t) holds S[g and g + 8, 2t and 2t + 1] of n8 tiles 2s and
  2s + 1, which is where mma's A layout wants P[g and g + 8, k] of k-step s (a0/a1 = k-slots 2t, 2t + 1,
  a2/a3 = slots 2t + 8, 2t + 9), so P never leaves the registers. To make the V operand one 64-bit load per
  register pair (and conflict-free), the keys are permuted: column 2t + c of S tile 2s + b is key 16 s + 4 t +
  2 b + c, so k-slots 2t, 2t + 1 (2t + 8, 2t + 9) of P V are keys 4t, 4t + 1 (4t + 2, 4t + 3) of the step,
  exactly the low (high) half of the V quad of dim n and keys 16 s + 4 t .. + 3. The K tile is stored with
  that permutation (key 16 s + 4 a + 2 b + c at shared row 16 s + 8 b + 2 a + c), so B fragment column g of S
  tile j reads shared row 8 j + g; V is transposed 4 x 4 (four keys by four dims) on its way into shared
  memory. For Q K^T, quads of 4 dims feed k-slots in the permuted order of gemm_tc (gemm_tc.py): slots 2t,
  2t + 1 hold dims 4t, 4t + 1 and slots 2t + 8, 2t + 9 dims 4t + 2, 4t + 3, the same for Q and K, so the
  dot product is unchanged.

  Numerics (the same policy as the SIMT kernel, summation order aside): K and V are bf16 already, exact as B
  operands. Q and P are fp32: each is split into three bf16 pieces, x = hi + mid + lo exactly (mma.py's
  split_bf16x3), and each product is three mma into the same fp32 accumulators: every piece * bf16 product
  is exact, so S and P V are fp32 sums of exact products (3x the tensor-core work, still far above SIMT
  fp32). The scale, m, l, the rescaling exp(m_old - m_new) and the final division are fp32, as in
  `prefill_attention`; a masked score is -inf before exp (p = 0 exactly) and a key slot past the block's
  last visible key is never loaded (staged as zeros: an unused slot may hold NaN, and 0 * NaN is NaN).

The step from naive to flash: the naive kernel needs the max of the whole row before it can exponentiate
anything, so it holds (or recomputes) every score; the online softmax exponentiates against the max seen so
far and corrects what it has accumulated when the max grows, which lets K/V tiles stream through shared
memory once and be shared by ROWS queries. The step from SIMT to tensor cores keeps that algorithm and moves
both matrix products onto mma tiles, keeping S and P in registers between them.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from cuda_kernels import kv_format
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import WORD_ELEMS, e4m3x4_to_bf16x4, unpack_bf16x4
from cuda_kernels.launch import launch, view
from cuda_kernels.mma import halves, mma_bf16_m16n8k16, pack4, split_bf16x3
from cuda_kernels.primitives import FULL_MASK, WARP, warp_max, warp_sum

NEG_INF = float32(-np.inf)
U64_ZERO = np.uint64(0)        # typed constants (a numba type cast is slow in the simulator's inner loops)
TILE = WARP                    # keys per tile: one key per lane when scoring
NAIVE_MAX_CONTEXT = 8192       # the naive kernel's row of scores lives in shared memory (32 KB)
SHARED_BUDGET = 48 * 1024      # static shared memory per block without the opt-in attribute

# Flash prefill: query rows per block and warps per block. The simulator runs one Python thread per CUDA
# thread and every warp reduction there is two block barriers: it gets smaller blocks (same code path).
PREFILL_WARPS = 2 if SIMULATOR else 4

# Tensor-core prefill: the head dims it compiles for, and per head dim its warps per block (16 query rows
# each) and keys per K/V tile (see tc_config).
TC_HEAD_DIMS = (16, 32, 64, 128)
TC_FORMATS = ("bf16", "fp8")   # the KV formats it reads (see "KV formats" above)


def tc_config(head_dim: int) -> tuple[int, int]:
    """(warps per block, keys per K/V tile) of prefill_attention_tc for head_dim.

    NOTE: from ptxas on sm_90 (tools/offline_compile.py), not yet from timings: at head_dim 64, 64-key tiles
    take 224 registers (2 blocks of 4 warps per SM), 32-key tiles 168 (3 blocks); neither spills. At 128
    the O accumulators alone are 64 registers per lane: 16-key tiles and 2 warps (shared memory under 48 KB)
    are what fits without spills. The simulator's emulated mma costs two block barriers per call: 2 warps
    and 16-key tiles there, so that tiny contexts still walk several tiles (the rescaling path)."""
    if SIMULATOR:
        return 2, 16
    return (4, 64) if head_dim <= 64 else (2, 16)


# ---------------------------------------------------------------------------------------------------------
# device helpers


# (unpack_bf16x4 and its device version: cuda_kernels/kv_format.py, with the other formats' unpacking)


def _tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u, words, block_size):
    """Word u of the K/V tile of tokens t0 .. t0 + TILE - 1 (token t0 + u // words, word u % words of its
    row): (K word, V word). Zeros when u is past the tile or the token is at or past k_end.

    NOTE: mask before the load: a slot past the context may be unused (NaN in the tests, garbage in real
    life) and 0 * NaN is NaN, so such slots are never read, not read and then zeroed."""
    j = u // words
    if u < TILE * words and t0 + j < k_end:
        token = t0 + j
        block = block_tables[seq, token // block_size]
        offset = token % block_size
        w = u % words
        return k_words[block, offset, kvh, w], v_words[block, offset, kvh, w]
    return U64_ZERO, U64_ZERO


def _store_words(buf, k_base, v_base, u, kw, vw, words, k_stride):
    """Word u of a tile into a uint64 shared buffer: K row j at k_base + j * k_stride, V row j at v_base +
    j * words."""
    if u < TILE * words:
        j, w = u // words, u % words
        buf[k_base + j * k_stride + w] = kw
        buf[v_base + j * words + w] = vw


def _store_words_f32(ks, vs, u, kw, vw, words, k_stride):
    """Word u of a tile widened into float32 shared tiles: K row j at j * k_stride, V row j at j * 4 * words."""
    if u < TILE * words:
        j, w = u // words, u % words
        k0, k1, k2, k3 = unpack_bf16x4(kw)
        v0, v1, v2, v3 = unpack_bf16x4(vw)
        base = j * k_stride + 4 * w
        ks[base] = k0
        ks[base + 1] = k1
        ks[base + 2] = k2
        ks[base + 3] = k3
        base = j * 4 * words + 4 * w
        vs[base] = v0
        vs[base + 1] = v1
        vs[base + 2] = v2
        vs[base + 3] = v3


if SIMULATOR:
    # Plain Python in the simulator, where a device-function call costs far more than these bodies.
    tile_word, store_words, store_words_f32 = _tile_word, _store_words, _store_words_f32
else:
    tile_word = cuda.jit(device=True, inline=True)(_tile_word)
    store_words = cuda.jit(device=True, inline=True)(_store_words)
    store_words_f32 = cuda.jit(device=True, inline=True)(_store_words_f32)


@lru_cache(maxsize=None)
def widening_store(fmt: str):
    """store_words_f32 for a cache of format fmt: word u of a tile (E elements) widened into the float32
    tiles, K row j at j * k_stride, V row j at j * E * words. bf16 keeps the unrolled version above."""
    if fmt == "bf16":
        return store_words_f32
    E = WORD_ELEMS[fmt]
    unpack = kv_format.codec(fmt)[2]

    def store(ks, vs, u, kw, vw, words, k_stride):
        if u < TILE * words:
            j, w = u // words, u % words
            kx = unpack(kw)
            vx = unpack(vw)
            base = j * k_stride + E * w
            for c in range(E):
                ks[base + c] = kx[c]
            base = j * E * words + E * w
            for c in range(E):
                vs[base + c] = vx[c]

    return store if SIMULATOR else cuda.jit(device=True, inline=True)(store)


if SIMULATOR:
    @cuda.jit(device=True)
    def warp_barrier():
        # The simulator has no syncwarp; a block barrier is stronger, and every caller reaches this one
        # uniformly (the same number of times in every thread), which its warp reductions need anyway.
        cuda.syncthreads()
else:
    @cuda.jit(device=True, inline=True)
    def warp_barrier():
        # NOTE: orders shared-memory accesses among the lanes of one warp (independent thread scheduling
        # means lanes of a warp are not in lockstep); only for buffers that one warp alone reads and writes.
        cuda.syncwarp()


# Tensor-core prefill (prefill_attention_tc): quad (4-lane group) reductions over the mma D layout, and the
# 4 x 4 transpose of bf16 that stages V as the mma's B operand.

if SIMULATOR:
    @cuda.jit(device=True)
    def quad_max2(a, b):
        """(max of a, max of b) over the 4 lanes of this lane's group (lanes 4g .. 4g + 3). The simulator has
        no shuffles: every thread writes its pair, the block synchronises, each reads its group's four."""
        buf = cuda.shared.array((1024, 2), float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()      # the previous call's readers are done
        buf[tid, 0] = a
        buf[tid, 1] = b
        cuda.syncthreads()
        first = tid - tid % 4
        return (max(buf[first, 0], buf[first + 1, 0], buf[first + 2, 0], buf[first + 3, 0]),
                max(buf[first, 1], buf[first + 1, 1], buf[first + 2, 1], buf[first + 3, 1]))

    @cuda.jit(device=True)
    def quad_sum2(a, b):
        """(sum of a, sum of b) over the 4 lanes of this lane's group (the simulator's exchange)."""
        buf = cuda.shared.array((1024, 2), float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        buf[tid, 0] = a
        buf[tid, 1] = b
        cuda.syncthreads()
        first = tid - tid % 4
        # the butterfly's order: (lane 0 + lane 1) + (lane 2 + lane 3), in fp32 (the buffer's elements)
        return ((buf[first, 0] + buf[first + 1, 0]) + (buf[first + 2, 0] + buf[first + 3, 0]),
                (buf[first, 1] + buf[first + 1, 1]) + (buf[first + 2, 1] + buf[first + 3, 1]))
else:
    @cuda.jit(device=True, inline=True)
    def quad_max2(a, b):
        """(max of a, max of b) over the 4 lanes of this lane's group: two butterfly steps (xor 1, 2)."""
        a = max(a, cuda.shfl_xor_sync(FULL_MASK, a, 1))
        b = max(b, cuda.shfl_xor_sync(FULL_MASK, b, 1))
        a = max(a, cuda.shfl_xor_sync(FULL_MASK, a, 2))
        b = max(b, cuda.shfl_xor_sync(FULL_MASK, b, 2))
        return a, b

    @cuda.jit(device=True, inline=True)
    def quad_sum2(a, b):
        """(sum of a, sum of b) over the 4 lanes of this lane's group."""
        a += cuda.shfl_xor_sync(FULL_MASK, a, 1)
        b += cuda.shfl_xor_sync(FULL_MASK, b, 1)
        a += cuda.shfl_xor_sync(FULL_MASK, a, 2)
        b += cuda.shfl_xor_sync(FULL_MASK, b, 2)
        return a, b


_EVEN16 = np.uint64(0x0000FFFF0000FFFF)   # elements 0 and 2 of four bf16 in a uint64
_ODD16 = np.uint64(0xFFFF0000FFFF0000)    # elements 1 and 3
_LOW32 = np.uint64(0x00000000FFFFFFFF)
_HIGH32 = np.uint64(0xFFFFFFFF00000000)
_U64_16 = np.uint64(16)
_U64_32 = np.uint64(32)
_U32_16 = np.uint32(16)


@cuda.jit(device=True)
def transpose_bf16x4(w0, w1, w2, w3):
    """Four uint64 rows of four bf16 (w_i element e = M[i, e]) -> its four columns (q_e element i = M[i, e]):
    swap the off-diagonal 16-bit elements of each 2 x 2 block, then the off-diagonal 32-bit halves."""
    t0 = (w0 & _EVEN16) | ((w1 & _EVEN16) << _U64_16)    # M[0,0] M[1,0] M[0,2] M[1,2]
    t1 = ((w0 >> _U64_16) & _EVEN16) | (w1 & _ODD16)    # M[0,1] M[1,1] M[0,3] M[1,3]
    t2 = (w2 & _EVEN16) | ((w3 & _EVEN16) << _U64_16)
    t3 = ((w2 >> _U64_16) & _EVEN16) | (w3 & _ODD16)
    return ((t0 & _LOW32) | (t2 << _U64_32), (t1 & _LOW32) | (t3 << _U64_32),
            (t0 >> _U64_32) | (t2 & _HIGH32), (t1 >> _U64_32) | (t3 & _HIGH32))


@cuda.jit(device=True)
def bf16_pair(lo, hi):
    """Two bf16 bit patterns (uint32) -> one mma register, lo in the low half."""
    return lo | (hi << _U32_16)


def _cache_word(words, block_tables, seq, kvh, token, k_end, w, block_size):
    """Word w (4 bf16) of token's K or V row, or zeros at or past k_end (NOTE: masked before the load: a
    slot past the context may hold NaN, and 0 * NaN is NaN)."""
    if token < k_end:
        return words[block_tables[seq, token // block_size], token % block_size, kvh, w]
    return U64_ZERO


cache_word = _cache_word if SIMULATOR else cuda.jit(device=True, inline=True)(_cache_word)


# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _naive_kernel(head_dim: int, block_size: int, fmt: str = "bf16"):
    D, BS = head_dim, block_size
    ARENA = NAIVE_MAX_CONTEXT + D      # shared floats: the row of scores, then the query
    decode = kv_format.codec(fmt)[1]

    @cuda.jit
    def prefill_naive_kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_cache, v_cache (blocks, BS, Hkv, D) in format fmt; block_tables (S, max_blocks)
        # i32; scale includes fp8's k_scale
        seq, i, h = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        lane = cuda.threadIdx.x
        q_begin = cu_seqlens_q[seq]
        q_len = cu_seqlens_q[seq + 1] - q_begin
        if i >= q_len:
            return  # past this sequence's queries: the whole block leaves together
        kvh = h // (q.shape[1] // k_cache.shape[2])
        n_keys = context_lens[seq] - q_len + i + 1      # causal: keys 0 .. position
        row = q_begin + i
        if n_keys > NAIVE_MAX_CONTEXT:
            # The scores would not fit: say so loudly instead of writing a wrong answer.
            for t in range(lane, D, WARP):
                out[row, h, t] = float32(np.nan)
            return
        # Shared memory: the scores of the whole row, then the query (one arena: fewer allocations, which
        # are slow in the simulator).
        arena = cuda.shared.array(ARENA, float32)
        scores = arena[:NAIVE_MAX_CONTEXT]
        qs = arena[NAIVE_MAX_CONTEXT:]
        for t in range(lane, D, WARP):
            qs[t] = q[row, h, t]
        cuda.syncthreads()

        # Pass 1: every score, and their maximum.
        local_max = NEG_INF
        for j in range(lane, n_keys, WARP):
            block, offset = block_tables[seq, j // BS], j % BS
            dot = float32(0)
            for t in range(D):
                dot += qs[t] * decode(k_cache[block, offset, kvh, t])
            scores[j] = float32(scale) * dot
            local_max = max(local_max, scores[j])
        m = warp_max(local_max)

        # Pass 2: exponentiate. NOTE: subtracting the row max keeps exp() in range (the largest term is 1).
        local_sum = float32(0)
        for j in range(lane, n_keys, WARP):
            p = math.exp(scores[j] - m)
            scores[j] = p
            local_sum += p
        total = warp_sum(local_sum)
        cuda.syncthreads()  # pass 3 reads the probabilities every lane wrote

        # Pass 3: lane t owns output dims t, t + 32, ...; every lane walks all the keys.
        for t in range(lane, D, WARP):
            acc = float32(0)
            for j in range(n_keys):
                block, offset = block_tables[seq, j // BS], j % BS
                acc += scores[j] * decode(v_cache[block, offset, kvh, t])
            out[row, h, t] = acc / total * v_scale

    return prefill_naive_kernel


@cuda.jit(device=True)
def _row_tile(q, k_words, cu_seqlens_q, context_lens, rows):
    """The query rows of a prefill block (grid (sequence, row tile, KV head)): with G = Hq / Hkv query heads
    per KV head, row r of sequence s is (token r // G, head kvh * G + r % G), so a KV head's n_rows = q_len * G
    rows are cut into tiles of `rows`. Returns (G, q_begin, n_rows, row0, first, k_end): the sequence's first
    token in q, its row count, the tile's first row (row0 >= n_rows: an empty tile), the position of the
    sequence's first query, and the keys any row of the tile may see (positions < k_end, causal)."""
    seq = cuda.blockIdx.x
    # NOTE: the last row tiles see the most keys; giving them the lowest block ids starts them first.
    tile = cuda.gridDim.y - 1 - cuda.blockIdx.y
    group = q.shape[1] // k_words.shape[2]
    q_begin = cu_seqlens_q[seq]
    q_len = cu_seqlens_q[seq + 1] - q_begin
    n_rows = q_len * group
    row0 = tile * rows
    first = context_lens[seq] - q_len
    last_row = min(row0 + rows, n_rows) - 1
    return group, q_begin, n_rows, row0, first, first + last_row // group + 1


@lru_cache(maxsize=None)
def _flash_kernel(head_dim: int, block_size: int, rows: int, warps: int, fmt: str = "bf16"):
    D, BS, R, NW = head_dim, block_size, rows, warps
    RW = R // NW                       # query rows per warp
    NT = NW * WARP
    WD = D // WORD_ELEMS[fmt]          # uint64 words per K/V row (4 bf16, 2 fp32 or 8 fp8 each)
    stage = widening_store(fmt)
    KS = D + 1                         # NOTE: odd row stride: lane j reading ks[j * KS + i] hits bank (j + i) % 32
    DPL = (D + WARP - 1) // WARP       # output dims per lane: lane owns dims lane, lane + 32, ...
    STAGE = (TILE * WD + NT - 1) // NT     # uint64 words of a K (or V) tile per thread
    QLOAD = (R * D + NT - 1) // NT
    K_OFF = R * D                      # shared-memory layout, in floats
    V_OFF = K_OFF + TILE * KS
    P_OFF = V_OFF + TILE * D
    L_OFF = P_OFF + R * TILE
    SHARED_FLOATS = L_OFF + R
    ACC = RW * DPL                     # accumulators per lane (sizes must be plain constants for numba)

    @cuda.jit
    def prefill_flash_kernel(q, k_words, v_words, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_words, v_words (blocks, BS, Hkv, WD) u64 (the caches, 64 bits per word);
        # scale includes fp8's k_scale
        seq, kvh = cuda.blockIdx.x, cuda.blockIdx.z
        group, q_begin, n_rows, row0, first, k_end = _row_tile(q, k_words, cu_seqlens_q, context_lens, R)
        if row0 >= n_rows:
            return  # the whole block leaves together, before any barrier
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        wrow0 = warp * RW                                  # this warp's first row within the block

        arena = cuda.shared.array(SHARED_FLOATS, float32)  # one allocation (they are slow in the simulator)
        qs = arena[:K_OFF]              # the block's query rows (R x D), reused for the output
        ks = arena[K_OFF:V_OFF]         # K tile (TILE x KS), widened to fp32, padded rows
        vs = arena[V_OFF:P_OFF]         # V tile (TILE x D), widened to fp32
        ps = arena[P_OFF:L_OFF]         # per row (R x TILE): the tile's scores, then its probabilities
        inv_l = arena[L_OFF:]           # per row: 1 / sum of the probabilities

        for n in range(QLOAD):
            e = tid + NT * n
            if e < R * D:
                r = row0 + e // D
                value = float32(0)
                if r < n_rows:
                    value = q[q_begin + r // group, kvh * group + r % group, e % D]
                qs[e] = value

        # Per-row state of this warp's rows. m is the same in every lane; l is each lane's share of the sum
        # (its own keys), added across lanes once at the end, not once per tile.
        m = cuda.local.array(RW, float32)
        l = cuda.local.array(RW, float32)
        corr = cuda.local.array(RW, float32)
        acc = cuda.local.array(ACC, float32)
        sc = cuda.local.array(RW, float32)
        for r in range(RW):
            m[r] = NEG_INF
            l[r] = float32(0)
        for a in range(ACC):
            acc[a] = float32(0)
        cuda.syncthreads()

        for t0 in range(0, k_end, TILE):
            # Stage the tile: thread tid copies words tid + NT * n. NOTE: four loads, then four stores: a load's
            # first use stalls the (in-order) warp until the data arrives, so issuing them together pays the
            # memory latency once per four words instead of once per word.
            for n in range(0, STAGE, 4):
                u = tid + NT * n
                ka, va = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u, WD, BS)
                kb, vb = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + NT, WD, BS)
                kc, vc = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + 2 * NT, WD, BS)
                kd, vd = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + 3 * NT, WD, BS)
                stage(ks, vs, u, ka, va, WD, KS)
                stage(ks, vs, u + NT, kb, vb, WD, KS)
                stage(ks, vs, u + 2 * NT, kc, vc, WD, KS)
                stage(ks, vs, u + 3 * NT, kd, vd, WD, KS)
            cuda.syncthreads()

            # Scores of key t0 + lane against the warp's rows (q broadcast from shared memory).
            for r in range(RW):
                sc[r] = float32(0)
            for i in range(D):
                kv = ks[lane * KS + i]
                for r in range(RW):
                    sc[r] += qs[(wrow0 + r) * D + i] * kv
            for r in range(RW):
                ps[(wrow0 + r) * TILE + lane] = sc[r]

            # Online softmax update of every row (same trip count in every lane: the reductions need it).
            key = t0 + lane
            for r in range(RW):
                row = row0 + wrow0 + r
                visible = row < n_rows and key <= first + row // group
                score = float32(scale) * ps[(wrow0 + r) * TILE + lane] if visible else NEG_INF
                m_new = max(m[r], warp_max(score))
                # A row that has seen no visible key yet keeps m = -inf: use 0 so exp() gives 0, not NaN.
                m_safe = m_new if m_new != NEG_INF else float32(0)
                c = math.exp(m[r] - m_safe)
                p = math.exp(score - m_safe)
                l[r] = l[r] * c + p
                corr[r] = c
                m[r] = m_new
                ps[(wrow0 + r) * TILE + lane] = p
            warp_barrier()  # ps rows are this warp's own

            # acc = acc * exp(m_old - m_new) + P V. NOTE: every accumulation is fp32. Masked keys have p = 0
            # and a zero V row, so the tile is walked whole. The loops indexing acc have compile-time trip
            # counts and small bodies so that acc can live in registers.
            for r in range(RW):
                for c in range(DPL):
                    acc[r * DPL + c] *= corr[r]
            for j in range(TILE):
                for c in range(DPL):
                    dim = lane + WARP * c
                    if dim < D:
                        v = vs[j * D + dim]
                        for r in range(RW):
                            acc[r * DPL + c] += ps[(wrow0 + r) * TILE + j] * v
            cuda.syncthreads()  # before the next tile overwrites ks, vs

        # Epilogue: the row sums across lanes, then the output through shared memory (coalesced stores).
        for r in range(RW):
            total = warp_sum(l[r])
            if lane == 0:
                inv_l[wrow0 + r] = v_scale / total if total > float32(0) else float32(0)
        for r in range(RW):
            for c in range(DPL):
                dim = lane + WARP * c
                if dim < D:
                    qs[(wrow0 + r) * D + dim] = acc[r * DPL + c]
        cuda.syncthreads()
        for n in range(QLOAD):
            e = tid + NT * n
            if e < R * D:
                r = row0 + e // D
                if r < n_rows:
                    out[q_begin + r // group, kvh * group + r % group, e % D] = qs[e] * inv_l[e // D]

    return prefill_flash_kernel


@cuda.jit(device=True)
def _same_quad(word):
    return word


@lru_cache(maxsize=None)
def _tc_kernel(head_dim: int, block_size: int, warps: int, keys: int, fmt: str = "bf16"):
    """The tensor-core flash kernel: `warps` warps of 16 query rows each, K/V tiles of `keys` keys; fmt "bf16"
    (cache words: uint64 quads of bf16) or "fp8" (uint32 quads of e4m3, made bf16 quads as they are staged)."""
    D, BS, NW, KT = head_dim, block_size, warps, keys
    quad = _same_quad if fmt == "bf16" else e4m3x4_to_bf16x4
    R = 16 * NW                  # query rows per block: one m16 tile per warp
    NT = NW * WARP
    DS = D // 16                 # mma k-steps over the head dim (S = Q K^T)
    DJ = D // 8                  # n8 tiles over the head dim (O = P V)
    NJ = KT // 8                 # n8 tiles over the keys of a tile (S)
    KS = KT // 16                # mma k-steps over the keys of a tile (P V)
    WD = D // 4                  # uint64 words (4 bf16) per K/V row
    # NOTE: one padding row per plane moves consecutive planes 8 banks apart, so the half-warp that stores
    # the four planes' quads of one row (K) or of four rows (V) hits 32 distinct banks; fragment loads read a
    # half-warp's 16 consecutive quads either way.
    KROWS = KT + 1               # ks plane (one per 16 dims): KT key rows of 4 quads
    VROWS = D + 1                # vs plane (one per 16 keys): D dim rows of 4 quads
    Q_SHARED = 3 * DS * R * 4
    K_SHARED = DS * KROWS * 4    # NOTE: array sizes must be plain closure constants for numba
    V_SHARED = KS * VROWS * 4
    KQ = KT // 4                 # key quads per tile
    if NT % WD or NT % KQ:
        raise ValueError(f"prefill_attention_tc: {NT} threads must be a multiple of {WD} and of {KQ}")
    K_STEP = NT // WD            # K rows staged per pass of the block
    K_PER = (KT + K_STEP - 1) // K_STEP      # K words staged per thread
    V_STEP = NT // KQ            # V words (of 4 dims) staged per pass, each for 4 keys
    V_PER = (WD + V_STEP - 1) // V_STEP
    V_LOADS = 4 * V_PER
    SACC = NJ * 4                # S (then P) accumulators per lane
    OACC = DJ * 4                # O accumulators per lane

    @cuda.jit
    def prefill_tc_kernel(q, k_words, v_words, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_words, v_words (blocks, BS, Hkv, D/4): quads of 4 elements (bf16: u64; fp8:
        # u32); scale includes fp8's k_scale
        seq, kvh = cuda.blockIdx.x, cuda.blockIdx.z
        group, q_begin, n_rows, row0, first, k_end = _row_tile(q, k_words, cu_seqlens_q, context_lens, R)
        if row0 >= n_rows:
            return  # the whole block leaves together, before any barrier
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        g, t = lane // 4, lane % 4
        diag = first + row0 // group                       # tiles with a key past this need the mask
        # This lane's two rows (g and g + 8 of the warp's m16 tile) and their positions.
        r_lo = row0 + 16 * warp + g
        pos_lo = first + r_lo // group
        pos_hi = first + (r_lo + 8) // group

        # ks[(s * KROWS + row) * 4 + u]: dims 16 s + 4 u .. + 3 of the key at shared row `row` (a permuted
        # key order, see the docstring); vs[(s * VROWS + dim) * 4 + u]: dim `dim` of keys 16 s + 4 u .. + 3.
        # qs[((p * DS + s) * R + row) * 4 + u]: bf16 piece p of dims 16 s + 4 u .. + 3 of the block's row.
        qs = cuda.shared.array(Q_SHARED, uint64)
        ks = cuda.shared.array(K_SHARED, uint64)
        vs = cuda.shared.array(V_SHARED, uint64)
        # NOTE: every shared access goes through a per-thread slice at a compile-time offset: the address is
        # then a base register plus an immediate, instead of one live 64-bit register per unrolled access
        # (LLVM hoists the loop-invariant addresses out of the key loop: 255 registers and spills at 64-key
        # tiles, against 224 and none this way).
        k_row, k_word = tid // WD, tid % WD
        v_quad, v_word = tid % KQ, tid // KQ
        k_store = ks[((k_word // 4) * KROWS + k_row) * 4 + k_word % 4:]
        v_store = vs[((v_quad // 4) * VROWS + 4 * v_word) * 4 + v_quad % 4:]
        q_frag = qs[(16 * warp + g) * 4 + t:]     # A fragments of S: quad t of rows g, g + 8, plane (p, s)
        k_frag = ks[4 * g + t:]      # B fragments of S: quad t of shared row 8 j + g, plane s
        v_frag = vs[4 * g + t:]      # B fragments of P V: quad t of dim 8 j + g, plane s
        kr = cuda.local.array(K_PER, uint64)     # the tile's words in flight, between loads and stores
        vr = cuda.local.array(V_LOADS, uint64)
        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        m = cuda.local.array(2, float32)         # running max of rows g, g + 8 (equal in the 4 lanes)
        l = cuda.local.array(2, float32)         # this lane's share of their running sums

        # Q, once, into shared memory as A-fragment quads: lane (g, t) splits dims 16 s + 4 t .. + 3 of its
        # rows g and g + 8 into three bf16 pieces (hi + mid + lo == q exactly) and stores piece p's quad at
        # plane (p, s). Rows past the block's are zeros. The warp reads only its own rows, after the first
        # tile's barrier.
        for half in range(2):
            r = r_lo + 8 * half
            token = q_begin + r // group
            head = kvh * group + r % group
            for s in range(DS):
                dim = 16 * s + 4 * t
                x0, x1, x2, x3 = float32(0), float32(0), float32(0), float32(0)
                if r < n_rows:
                    x0, x1, x2, x3 = q[token, head, dim], q[token, head, dim + 1], q[token, head, dim + 2], \
                        q[token, head, dim + 3]
                h0, d0, l0 = split_bf16x3(x0)
                h1, d1, l1 = split_bf16x3(x1)
                h2, d2, l2 = split_bf16x3(x2)
                h3, d3, l3 = split_bf16x3(x3)
                q_frag[(s * R + 8 * half) * 4] = pack4(h0, h1, h2, h3)
                q_frag[((DS + s) * R + 8 * half) * 4] = pack4(d0, d1, d2, d3)
                q_frag[((2 * DS + s) * R + 8 * half) * 4] = pack4(l0, l1, l2, l3)
        for i in range(OACC):
            oacc[i] = float32(0)
        for half in range(2):
            m[half] = NEG_INF
            l[half] = float32(0)

        for t0 in range(0, k_end, KT):
            # Stage the tile: all loads first, then all stores (NOTE: a load's first use stalls the warp, so
            # issuing them together pays the memory latency once). Thread tid fills shared K rows
            # tid // WD + n * K_STEP, word tid % WD (a half-warp reads one key's row: coalesced), and V blocks
            # (keys 4 (tid % KQ) .. + 3) x (word tid // KQ + n * V_STEP), one 4 x 4 transpose each.
            for n in range(K_PER):
                row = k_row + n * K_STEP
                kr[n] = U64_ZERO
                if row < KT:
                    # the key stored at shared row `row` (the inverse of the permutation in the docstring)
                    kk = 16 * (row // 16) + 4 * ((row % 8) // 2) + 2 * ((row // 8) % 2) + row % 2
                    kr[n] = cache_word(k_words, block_tables, seq, kvh, t0 + kk, k_end, k_word, BS)
            for n in range(V_PER):
                w = v_word + n * V_STEP
                for i in range(4):
                    vr[4 * n + i] = U64_ZERO
                    if w < WD:
                        vr[4 * n + i] = cache_word(v_words, block_tables, seq, kvh, t0 + 4 * v_quad + i, k_end, w,
                                                   BS)
            for n in range(K_PER):
                if k_row + n * K_STEP < KT:
                    k_store[4 * K_STEP * n] = quad(kr[n])
            for n in range(V_PER):
                if v_word + n * V_STEP < WD:
                    c0, c1, c2, c3 = transpose_bf16x4(quad(vr[4 * n]), quad(vr[4 * n + 1]), quad(vr[4 * n + 2]),
                                                      quad(vr[4 * n + 3]))
                    v_store[16 * V_STEP * n] = c0
                    v_store[16 * V_STEP * n + 4] = c1
                    v_store[16 * V_STEP * n + 8] = c2
                    v_store[16 * V_STEP * n + 12] = c3
            cuda.syncthreads()

            # S = Q K^T (16 rows x KT keys per warp): per k-step, 3 mma (the Q pieces) per n8 tile of keys.
            for i in range(SACC):
                sacc[i] = float32(0)
            for s in range(DS):
                for p in range(3):
                    a0, a2 = halves(q_frag[((p * DS + s) * R) * 4])
                    a1, a3 = halves(q_frag[((p * DS + s) * R + 8) * 4])
                    for j in range(NJ):
                        b0, b1 = halves(k_frag[(s * KROWS + 8 * j) * 4])
                        sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b0, b1, sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3])

            # Online softmax. Element (j, c) of this lane is row g (c < 2) or g + 8, key t0 + 16 (j // 2)
            # + 4 t + 2 (j % 2) + c % 2.
            masked = t0 + KT - 1 > diag   # the diagonal tile(s): some key lies past some row's position
            mx_lo, mx_hi = NEG_INF, NEG_INF
            for j in range(NJ):
                for c in range(4):
                    x = scale * sacc[4 * j + c]
                    if masked:
                        key = t0 + 16 * (j // 2) + 4 * t + 2 * (j % 2) + c % 2
                        if key > (pos_lo if c < 2 else pos_hi):
                            x = NEG_INF
                    sacc[4 * j + c] = x
                    if c < 2:
                        mx_lo = max(mx_lo, x)
                    else:
                        mx_hi = max(mx_hi, x)
            mx_lo, mx_hi = quad_max2(mx_lo, mx_hi)
            m_lo, m_hi = max(m[0], mx_lo), max(m[1], mx_hi)
            # A row that has seen no visible key yet keeps m = -inf: use 0 so exp() gives 0, not NaN.
            safe_lo = m_lo if m_lo != NEG_INF else float32(0)
            safe_hi = m_hi if m_hi != NEG_INF else float32(0)
            corr_lo, corr_hi = float32(math.exp(m[0] - safe_lo)), float32(math.exp(m[1] - safe_hi))
            m[0], m[1] = m_lo, m_hi
            sum_lo, sum_hi = float32(0), float32(0)
            for j in range(NJ):
                for c in range(4):
                    prob = float32(math.exp(sacc[4 * j + c] - (safe_lo if c < 2 else safe_hi)))
                    sacc[4 * j + c] = prob
                    if c < 2:
                        sum_lo += prob
                    else:
                        sum_hi += prob
            l[0] = l[0] * corr_lo + sum_lo
            l[1] = l[1] * corr_hi + sum_hi
            for j in range(DJ):
                oacc[4 * j] *= corr_lo
                oacc[4 * j + 1] *= corr_lo
                oacc[4 * j + 2] *= corr_hi
                oacc[4 * j + 3] *= corr_hi

            # O += P V. The S accumulators of n8 tiles 2s and 2s + 1 are exactly the A fragment of key step s
            # (keys 16 s + 4 t, + 1 in a0 / a1, + 2, + 3 in a2 / a3), split into three bf16 pieces.
            for s in range(KS):
                j0, j1 = 8 * s, 8 * s + 4
                h0, d0, l0 = split_bf16x3(sacc[j0])
                h1, d1, l1 = split_bf16x3(sacc[j0 + 1])
                h2, d2, l2 = split_bf16x3(sacc[j0 + 2])
                h3, d3, l3 = split_bf16x3(sacc[j0 + 3])
                h4, d4, l4 = split_bf16x3(sacc[j1])
                h5, d5, l5 = split_bf16x3(sacc[j1 + 1])
                h6, d6, l6 = split_bf16x3(sacc[j1 + 2])
                h7, d7, l7 = split_bf16x3(sacc[j1 + 3])
                for p in range(3):
                    if p == 0:
                        a0, a1, a2, a3 = bf16_pair(h0, h1), bf16_pair(h2, h3), bf16_pair(h4, h5), bf16_pair(h6, h7)
                    elif p == 1:
                        a0, a1, a2, a3 = bf16_pair(d0, d1), bf16_pair(d2, d3), bf16_pair(d4, d5), bf16_pair(d6, d7)
                    else:
                        a0, a1, a2, a3 = bf16_pair(l0, l1), bf16_pair(l2, l3), bf16_pair(l4, l5), bf16_pair(l6, l7)
                    for j in range(DJ):
                        b0, b1 = halves(v_frag[(s * VROWS + 8 * j) * 4])
                        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b0, b1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])
            cuda.syncthreads()  # before the next tile overwrites ks, vs

        # Epilogue: the row sums across the group's 4 lanes, then out = O / l (lane: dims 8 j + 2 t, + 1).
        total_lo, total_hi = quad_sum2(l[0], l[1])
        for half in range(2):
            r = r_lo + 8 * half
            total = (total_lo if half == 0 else total_hi) / v_scale
            if r < n_rows:
                token = q_begin + r // group
                head = kvh * group + r % group
                for j in range(DJ):
                    out[token, head, 8 * j + 2 * t] = oacc[4 * j + 2 * half] / total
                    out[token, head, 8 * j + 2 * t + 1] = oacc[4 * j + 2 * half + 1] / total

    return prefill_tc_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def prefill_attention_naive(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                            max_q_len, stream=0, k_scale=1.0, v_scale=1.0):
    """The teaching version of `prefill_attention` (same arguments). Contexts up to NAIVE_MAX_CONTEXT; a
    query that sees more keys gets NaN."""
    d, block_size = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                                       max_q_len)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    kernel = _naive_kernel(d, block_size, fmt)
    kernel[(num_seqs, max_q_len, q.shape[1]), WARP, stream](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out)


def prefill_rows_per_block(head_dim: int) -> int:
    """Query rows per flash block: the most (64, 32 or 16, fewer in the simulator) whose tiles fit in 48 KB."""
    for rows in ((16, 8) if SIMULATOR else (64, 32, 16)):
        floats = rows * head_dim + TILE * (head_dim + 1) + TILE * head_dim + rows * TILE + rows
        if 4 * floats <= SHARED_BUDGET:
            return rows
    raise AssertionError("unreachable for head_dim <= 128")


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, max_q_len,
                      stream=0, k_scale=1.0, v_scale=1.0):
    """out (T, Hq, d) <- causal attention of every sequence's new tokens over its paged context.

    max_q_len: the longest q_len in the batch (host int; it sizes the grid). The caches in any format
    (kv_format); k_scale, v_scale: the fp8 cache's per-tensor scales."""
    d, block_size = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                                       max_q_len)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    rows = prefill_rows_per_block(d)
    kernel = _flash_kernel(d, block_size, rows, PREFILL_WARPS, fmt)
    grid = (num_seqs, -(-max_q_len * group // rows), num_kv_heads)
    launch(kernel, grid, PREFILL_WARPS * WARP, stream, q, cache_words(k_cache), cache_words(v_cache), block_tables,
           cu_seqlens_q, context_lens, scale, v_scale, out)


def prefill_attention_tc(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                         max_q_len, stream=0, keys_per_tile=None, k_scale=1.0, v_scale=1.0):
    """`prefill_attention` on tensor cores (same arguments and result). head_dim must be one of TC_HEAD_DIMS
    and the cache bf16 or fp8: a ValueError otherwise, so that a caller can fall back to prefill_attention.
    keys_per_tile (a multiple of 16) overrides tc_config's, for tuning."""
    d, block_size = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                                       max_q_len)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    if fmt not in TC_FORMATS:
        raise ValueError(f"prefill_attention_tc reads {' and '.join(TC_FORMATS)} caches, got {fmt} "
                         f"(prefill_attention takes every format)")
    if d not in TC_HEAD_DIMS:
        raise ValueError(f"prefill_attention_tc: head_dim must be one of {TC_HEAD_DIMS}, got {d} "
                         f"(prefill_attention takes any multiple of 8)")
    warps, keys = tc_config(d)
    keys = keys_per_tile or keys
    if keys % 16:
        raise ValueError(f"prefill_attention_tc: keys_per_tile must be a multiple of 16, got {keys}")
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    kernel = _tc_kernel(d, block_size, warps, keys, fmt)
    grid = (num_seqs, -(-max_q_len * group // (16 * warps)), num_kv_heads)
    quads = np.uint64 if fmt == "bf16" else np.uint32     # 4 elements per word
    launch(kernel, grid, warps * WARP, stream, q, view(k_cache, dtype=quads), view(v_cache, dtype=quads),
           block_tables, cu_seqlens_q, context_lens, scale, v_scale, out)


# ---------------------------------------------------------------------------------------------------------
# argument checks (shared with cuda_kernels/paged_attention.py)


def cache_words(cache):
    """The cache (blocks, bs, Hkv, d) seen as (blocks, bs, Hkv, d / E) uint64 (E elements of its format per
    word), as a kernel argument (launch.view: no copy, no new device array)."""
    return view(cache, dtype=np.uint64)


def folded_scales(k_cache, scale, k_scale, v_scale):
    """(format, the score scale times k_scale, v_scale) as float32, after kv_format.check_scales: the fp8
    cache's scales, applied outside the kernels' loops (see the module docstring)."""
    fmt = kv_format.format_of(k_cache)
    k_scale, v_scale = kv_format.check_scales(fmt, k_scale, v_scale)
    return fmt, np.float32(np.float32(scale) * k_scale), v_scale


def _describe(array):
    return f"{tuple(array.shape)} {array.dtype}"


def _expect(name, array, shape, dtype):
    if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected {tuple(shape)} {np.dtype(dtype)}, got {_describe(array)}")


def _is_c_contiguous(array):
    check = getattr(array, "is_c_contiguous", None)
    return check() if callable(check) else bool(array.flags["C_CONTIGUOUS"])


def check_cache_args(q, k_cache, v_cache, block_tables, context_lens):
    """Checks shared by every attention launcher; returns (head_dim, block_size)."""
    if q.ndim != 3 or q.dtype != np.float32:
        raise ValueError(f"q: expected (tokens, num_heads, head_dim) float32, got {_describe(q)}")
    d = q.shape[2]
    if d % 8 or not 8 <= d <= 128:
        raise ValueError(f"head_dim must be a multiple of 8 in 8..128, got {d}")
    if k_cache.ndim != 4 or k_cache.dtype not in kv_format.DTYPES.values() or k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected (num_blocks, block_size, num_kv_heads, {d}) uint16 (bf16), float32 "
                         f"(fp32) or uint8 (fp8), got {_describe(k_cache)}")
    _expect("v_cache", v_cache, k_cache.shape, k_cache.dtype)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _is_c_contiguous(cache):
            raise ValueError(f"{name} must be C-contiguous (it is read 64 bits at a time)")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if context_lens.ndim != 1 or context_lens.dtype != np.int32:
        raise ValueError(f"context_lens: expected (num_seqs,) int32, got {_describe(context_lens)}")
    if block_tables.ndim != 2 or block_tables.dtype != np.int32 or block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables: expected ({context_lens.shape[0]}, max_blocks) int32, "
                         f"got {_describe(block_tables)}")
    return d, k_cache.shape[1]


def check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, max_q_len):
    d, block_size = check_cache_args(q, k_cache, v_cache, block_tables, context_lens)
    _expect("cu_seqlens_q", cu_seqlens_q, (context_lens.shape[0] + 1,), np.int32)
    _expect("out", out, q.shape, np.float32)
    if int(max_q_len) != max_q_len or max_q_len < 0:
        raise ValueError(f"max_q_len must be a non-negative int, got {max_q_len!r}")
    return d, block_size
