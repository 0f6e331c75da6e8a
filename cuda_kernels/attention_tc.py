"""Causal prefill attention over the paged KV cache on tensor cores: flash attention (online softmax) with
both matrix products on mma.sync m16n8k16 bf16 -> fp32 (cuda_kernels/mma.py). The SIMT versions it builds on
(naive, then flash in fp32) are in attention.py; its pipelined successor in attention_tc_pipelined.py (the
engine runs the successor where a GPU has verified it, this kernel for the other tensor-core cases:
attention_policy.uses_prefill_pipelined).

For query head h of sequence s at position p (its KV head is h // G, G = Hq / Hkv), over the keys j <= p of
the sequence's context:

    s_j = scale * <q, k_j>,      out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),   m = max_j s_j

The q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s] queries of sequence s are the last q_len tokens of its
context; token j lives in block block_tables[s, j // block_size] at offset j % block_size.

Shapes and dtypes (those of attention.prefill_attention):
    q             (T, Hq, d)              float32   the new tokens of every sequence, packed
    k/v_cache     (blocks, bs, Hkv, d)    format    uint16 bf16 bits or uint8 fp8 e4m3 bits
                                                    (cuda_kernels/kv_format.py); slots past a context are
                                                    never read
    block_tables  (S, max_blocks)         int32     -1 past the end
    cu_seqlens_q  (S + 1,)                int32     rows of q per sequence
    context_lens  (S,)                    int32     cached prefix + the new tokens
    out           (T, Hq, d)              float32
d must be in TC_HEAD_DIMS (16, 32, 64, 128) and the cache in TC_FORMATS (bf16, fp8): the launcher raises
ValueError otherwise, for callers to fall back to attention.prefill_attention. An e4m3 value is a bf16 value:
staged as bf16, the mma operands stay exact; the fp8 scales are folded in by the launcher (the score scale
times k_scale, the output times v_scale). fp32 is refused: its K/V would need the 3-piece split of Q as well
(the engine runs the SIMT flash kernel for an fp32 cache: that format is for checking, not speed).

`prefill_attention_tc`: grid = (S, ceil(max_q_len * G / ROWS), Hkv) as in the SIMT flash kernel: a block
owns ROWS query rows of one sequence and one KV head, a row being a (query token, query head of the group)
pair, so the group's query heads share every K/V tile. ROWS = 16 * WARPS (WARPS and TILE_KEYS are the
caller's; attention_policy.prefill_tc_config: 4 warps, 64-key tiles at d <= 64). Warp w owns rows
16 w .. 16 w + 15 of the block (one m16 tile); lane (g, t) = (lane // 4, lane % 4) holds, in the mma's D
layout, rows g and g + 8 and columns 2t, 2t + 1 of every n8 tile. Per tile of TILE_KEYS keys the block
stages K and V in shared memory as bf16 quads (uint64), then each warp computes
    S (16 x TILE_KEYS) = Q K^T   A = Q (three bf16 pieces, quads in shared memory), B[k = dim, n = key] = K
    online softmax of S          in registers, row max/sum across the 4 lanes of a group (2 shuffles)
    O (16 x d) += P V            A = P straight from S's accumulators, B[k = key, n = dim] = V
and after the last tile out = O / l. Nothing of size context is held; causal: a block walks keys 0 .. its
last row's position only, and only tiles reaching past its first row's position are masked.

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

Numerics (the policy of the SIMT flash kernel, summation order aside): K and V are bf16 already, exact as B
operands. Q and P are fp32: each is split into three bf16 pieces, x = hi + mid + lo exactly (mma.py's
split_bf16x3), and each product is three mma into the same fp32 accumulators: every piece * bf16 product
is exact, so S and P V are fp32 sums of exact products (3x the tensor-core work, still far above SIMT
fp32). The scale, m, l, the rescaling exp(m_old - m_new) and the final division are fp32 (scores kept in log2
units, so each exp is one exp2: online_softmax_step); a masked score is -inf before exp (p = 0 exactly) and a
key slot past the block's last visible key is never loaded (staged as zeros: an unused slot may hold NaN, and
0 * NaN is NaN).

The step from the SIMT flash kernel: the same algorithm, with both matrix products on mma tiles, keeping S
and P in registers between them.
"""

from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from cuda_kernels.attention import LOG2E, NEG_INF, U64_ZERO, row_tile
from cuda_kernels.attention_args import check_prefill_args, folded_scales
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import e4m3x4_to_bf16x4
from cuda_kernels.launch import launch, view
from cuda_kernels.mma import halves, mma_bf16_m16n8k16, pack4, split_bf16x3, split_bf16x3_finite
from cuda_kernels.primitives import FULL_MASK, WARP, exp2_ftz, fmax


TC_HEAD_DIMS = (16, 32, 64, 128)   # the head dims it compiles for
TC_FORMATS = ("bf16", "fp8")   # the KV formats it reads (see the module docstring)


# ---------------------------------------------------------------------------------------------------------
# device helpers


# Quad (4-lane group) reductions over the mma D layout, and the 4 x 4 transpose of bf16 that stages V as the
# mma's B operand.

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


@cuda.jit(device=True)
def _same_quad(word):
    """A bf16 cache's quad as it is staged (an fp8 cache's goes through e4m3x4_to_bf16x4)."""
    return word


@lru_cache(maxsize=None)
def online_softmax_step(key_tiles: int, dim_tiles: int):
    """A device function step(sacc, m, l, oacc, scale): one tile's online-softmax update for a lane's two rows
    (g and g + 8) in the mma D layout. sacc holds the tile's products <q, k>, -inf where masked (4 per n8 key
    tile: elements 0, 1 of row g, 2, 3 of row g + 8), and scale > 0 includes log2(e), so that x = scale <q, k>
    is a score in log2 units; they become p = 2^(x - m_new) = exp(s - m_new / log2(e)), m (the running max of
    x, equal in the group's 4 lanes) moves to m_new, and this lane's running sums l and the O accumulators oacc
    (4 per n8 dim tile) are rescaled by 2^(m_old - m_new). A row that has seen no visible key yet keeps m = -inf
    and gets p = 0 (2^ against 0, not against -inf, which would give NaN).
    NOTE: exp2, not exp: one instruction a score (primitives.exp2_ftz), where exp is exp2 of x log2(e) plus a
    range reduction of a few instructions more, for each of a tile's scores (the launchers fold log2(e) into
    the score scale)."""
    KEY_TILES, DIM_TILES = key_tiles, dim_tiles

    @cuda.jit(device=True, inline=True)
    def step(sacc, m, l, oacc, scale):
        mx_lo, mx_hi = NEG_INF, NEG_INF
        for j in range(KEY_TILES):
            mx_lo = fmax(mx_lo, fmax(sacc[4 * j], sacc[4 * j + 1]))
            mx_hi = fmax(mx_hi, fmax(sacc[4 * j + 2], sacc[4 * j + 3]))
        mx_lo, mx_hi = quad_max2(mx_lo, mx_hi)
        # (scale > 0: the scaled max is the max's product, rounded alike)
        m_lo, m_hi = max(m[0], scale * mx_lo), max(m[1], scale * mx_hi)
        safe_lo = m_lo if m_lo != NEG_INF else float32(0)
        safe_hi = m_hi if m_hi != NEG_INF else float32(0)
        corr_lo, corr_hi = exp2_ftz(m[0] - safe_lo), exp2_ftz(m[1] - safe_hi)
        m[0], m[1] = m_lo, m_hi
        sum_lo, sum_hi = float32(0), float32(0)
        for j in range(KEY_TILES):
            for c in range(4):
                prob = exp2_ftz(scale * sacc[4 * j + c] - (safe_lo if c < 2 else safe_hi))   # (one FFMA)
                sacc[4 * j + c] = prob
                if c < 2:
                    sum_lo += prob
                else:
                    sum_hi += prob
        l[0] = l[0] * corr_lo + sum_lo
        l[1] = l[1] * corr_hi + sum_hi
        for j in range(DIM_TILES):
            oacc[4 * j] *= corr_lo
            oacc[4 * j + 1] *= corr_lo
            oacc[4 * j + 2] *= corr_hi
            oacc[4 * j + 3] *= corr_hi

    return step


@cuda.jit(device=True, inline=True)
def p_pieces(sacc, s):
    """P's A fragment of key step s, taken from the accumulators of S's n8 tiles 2 s (a0, a1) and 2 s + 1
    (a2, a3), as three fragments of bf16 pieces (hi, mid, lo: mma.split_bf16x3, exact; P is in [0, 1], so
    without the infinity test): 12 registers."""
    j0, j1 = 8 * s, 8 * s + 4
    h0, d0, l0 = split_bf16x3_finite(sacc[j0])
    h1, d1, l1 = split_bf16x3_finite(sacc[j0 + 1])
    h2, d2, l2 = split_bf16x3_finite(sacc[j0 + 2])
    h3, d3, l3 = split_bf16x3_finite(sacc[j0 + 3])
    h4, d4, l4 = split_bf16x3_finite(sacc[j1])
    h5, d5, l5 = split_bf16x3_finite(sacc[j1 + 1])
    h6, d6, l6 = split_bf16x3_finite(sacc[j1 + 2])
    h7, d7, l7 = split_bf16x3_finite(sacc[j1 + 3])
    return (bf16_pair(h0, h1), bf16_pair(h2, h3), bf16_pair(h4, h5), bf16_pair(h6, h7),
            bf16_pair(d0, d1), bf16_pair(d2, d3), bf16_pair(d4, d5), bf16_pair(d6, d7),
            bf16_pair(l0, l1), bf16_pair(l2, l3), bf16_pair(l4, l5), bf16_pair(l6, l7))


@lru_cache(maxsize=None)
def output_store(dim_tiles: int):
    """A device function store(out, oacc, l, v_scale, q_begin, kvh, group, n_rows, r_lo, t): out = O / l for
    this lane's rows r_lo and r_lo + 8 (dims 8 j + 2 t, + 1 of each of the dim_tiles n8 tiles), after the row
    sums across the group's 4 lanes; rows past n_rows are not stored."""
    DIM_TILES = dim_tiles

    @cuda.jit(device=True, inline=True)
    def store(out, oacc, l, v_scale, q_begin, kvh, group, n_rows, r_lo, t):
        total_lo, total_hi = quad_sum2(l[0], l[1])
        for half in range(2):
            r = r_lo + 8 * half
            # NOTE: one division a row, then products: an fp32 division is a dozen instructions and a slow-path
            # check (within an ulp of O / l, the reference's order of rounding aside)
            inv = v_scale / (total_lo if half == 0 else total_hi)
            if r < n_rows:
                token = q_begin + r // group
                head = kvh * group + r % group
                for j in range(DIM_TILES):
                    out[token, head, 8 * j + 2 * t] = oacc[4 * j + 2 * half] * inv
                    out[token, head, 8 * j + 2 * t + 1] = oacc[4 * j + 2 * half + 1] * inv

    return store


# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _tc_kernel(head_dim: int, block_size: int, warps: int, keys: int, fmt: str = "bf16"):
    """The tensor-core flash kernel: `warps` warps of 16 query rows each, K/V tiles of `keys` keys; fmt "bf16"
    (cache words: uint64 quads of bf16) or "fp8" (uint32 quads of e4m3, made bf16 quads as they are staged)."""
    D, BLOCK_SIZE, WARPS, TILE_KEYS = head_dim, block_size, warps, keys
    quad = _same_quad if fmt == "bf16" else e4m3x4_to_bf16x4
    ROWS = 16 * WARPS                # query rows per block: one m16 tile per warp
    THREADS = WARPS * WARP
    DIM_STEPS = D // 16              # mma k-steps over the head dim (S = Q K^T)
    DIM_TILES = D // 8               # n8 tiles over the head dim (O = P V)
    KEY_TILES = TILE_KEYS // 8       # n8 tiles over the keys of a tile (S)
    KEY_STEPS = TILE_KEYS // 16      # mma k-steps over the keys of a tile (P V)
    ROW_WORDS = D // 4               # uint64 words (4 bf16) per K/V row
    # NOTE: one padding row per plane moves consecutive planes 8 banks apart, so the half-warp that stores
    # the four planes' quads of one row (K) or of four rows (V) hits 32 distinct banks; fragment loads read a
    # half-warp's 16 consecutive quads either way.
    K_PLANE_ROWS = TILE_KEYS + 1     # ks plane (one per 16 dims): TILE_KEYS key rows of 4 quads
    V_PLANE_ROWS = D + 1             # vs plane (one per 16 keys): D dim rows of 4 quads
    Q_SHARED = 3 * DIM_STEPS * ROWS * 4
    K_SHARED = DIM_STEPS * K_PLANE_ROWS * 4   # NOTE: array sizes must be plain closure constants for numba
    V_SHARED = KEY_STEPS * V_PLANE_ROWS * 4
    KEY_QUADS = TILE_KEYS // 4       # key quads per tile
    if THREADS % ROW_WORDS or THREADS % KEY_QUADS:
        raise ValueError(f"prefill_attention_tc: {THREADS} threads must be a multiple of {ROW_WORDS} and of "
                         f"{KEY_QUADS}")
    K_STEP = THREADS // ROW_WORDS    # K rows staged per pass of the block
    K_PER_THREAD = (TILE_KEYS + K_STEP - 1) // K_STEP   # K words staged per thread
    V_STEP = THREADS // KEY_QUADS    # V words (of 4 dims) staged per pass, each for 4 keys
    V_PER_THREAD = (ROW_WORDS + V_STEP - 1) // V_STEP
    V_LOADS = 4 * V_PER_THREAD
    SACC = KEY_TILES * 4             # S (then P) accumulators per lane
    OACC = DIM_TILES * 4             # O accumulators per lane
    softmax_step = online_softmax_step(KEY_TILES, DIM_TILES)
    store_output = output_store(DIM_TILES)

    @cuda.jit
    def prefill_tc_kernel(q, k_words, v_words, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_words, v_words (blocks, BLOCK_SIZE, Hkv, D/4): quads of 4 elements (bf16:
        # u64; fp8: u32); scale includes fp8's k_scale
        seq = cuda.blockIdx.x
        group = q.shape[1] // k_words.shape[2]
        kvh, q_begin, n_rows, row0, first, k_end = row_tile(group, k_words.shape[2], cu_seqlens_q, context_lens, ROWS)
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

        # ks[(s * K_PLANE_ROWS + row) * 4 + u]: dims 16 s + 4 u .. + 3 of the key at shared row `row` (a
        # permuted key order, see the docstring); vs[(s * V_PLANE_ROWS + dim) * 4 + u]: dim `dim` of keys
        # 16 s + 4 u .. + 3. qs[((p * DIM_STEPS + s) * ROWS + row) * 4 + u]: bf16 piece p of dims
        # 16 s + 4 u .. + 3 of the block's row.
        qs = cuda.shared.array(Q_SHARED, uint64)
        ks = cuda.shared.array(K_SHARED, uint64)
        vs = cuda.shared.array(V_SHARED, uint64)
        # NOTE: every shared access goes through a per-thread slice at a compile-time offset: the address is
        # then a base register plus an immediate, instead of one live 64-bit register per unrolled access
        # (LLVM hoists the loop-invariant addresses out of the key loop; the spills this avoids:
        # docs/performance.md, "prefill attention (tensor cores)").
        k_row, k_word = tid // ROW_WORDS, tid % ROW_WORDS
        v_quad, v_word = tid % KEY_QUADS, tid // KEY_QUADS
        k_store = ks[((k_word // 4) * K_PLANE_ROWS + k_row) * 4 + k_word % 4:]
        v_store = vs[((v_quad // 4) * V_PLANE_ROWS + 4 * v_word) * 4 + v_quad % 4:]
        q_frag = qs[(16 * warp + g) * 4 + t:]     # A fragments of S: quad t of rows g, g + 8, plane (p, s)
        k_frag = ks[4 * g + t:]      # B fragments of S: quad t of shared row 8 j + g, plane s
        v_frag = vs[4 * g + t:]      # B fragments of P V: quad t of dim 8 j + g, plane s
        kr = cuda.local.array(K_PER_THREAD, uint64)   # the tile's words in flight, between loads and stores
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
            for s in range(DIM_STEPS):
                dim = 16 * s + 4 * t
                x0, x1, x2, x3 = float32(0), float32(0), float32(0), float32(0)
                if r < n_rows:
                    x0, x1, x2, x3 = q[token, head, dim], q[token, head, dim + 1], q[token, head, dim + 2], \
                        q[token, head, dim + 3]
                h0, d0, l0 = split_bf16x3(x0)
                h1, d1, l1 = split_bf16x3(x1)
                h2, d2, l2 = split_bf16x3(x2)
                h3, d3, l3 = split_bf16x3(x3)
                q_frag[(s * ROWS + 8 * half) * 4] = pack4(h0, h1, h2, h3)
                q_frag[((DIM_STEPS + s) * ROWS + 8 * half) * 4] = pack4(d0, d1, d2, d3)
                q_frag[((2 * DIM_STEPS + s) * ROWS + 8 * half) * 4] = pack4(l0, l1, l2, l3)
        for i in range(OACC):
            oacc[i] = float32(0)
        for half in range(2):
            m[half] = NEG_INF
            l[half] = float32(0)

        for t0 in range(0, k_end, TILE_KEYS):
            # Stage the tile: all loads first, then all stores (NOTE: a load's first use stalls the warp, so
            # issuing them together pays the memory latency once). Thread tid fills shared K rows
            # tid // ROW_WORDS + n * K_STEP, word tid % ROW_WORDS (a half-warp reads one key's row: coalesced),
            # and V blocks (keys 4 (tid % KEY_QUADS) .. + 3) x (word tid // KEY_QUADS + n * V_STEP), one 4 x 4
            # transpose each.
            for n in range(K_PER_THREAD):
                row = k_row + n * K_STEP
                kr[n] = U64_ZERO
                if row < TILE_KEYS:
                    # the key stored at shared row `row` (the inverse of the permutation in the docstring)
                    kk = 16 * (row // 16) + 4 * ((row % 8) // 2) + 2 * ((row // 8) % 2) + row % 2
                    kr[n] = cache_word(k_words, block_tables, seq, kvh, t0 + kk, k_end, k_word, BLOCK_SIZE)
            for n in range(V_PER_THREAD):
                w = v_word + n * V_STEP
                for i in range(4):
                    vr[4 * n + i] = U64_ZERO
                    if w < ROW_WORDS:
                        vr[4 * n + i] = cache_word(v_words, block_tables, seq, kvh, t0 + 4 * v_quad + i, k_end, w,
                                                   BLOCK_SIZE)
            for n in range(K_PER_THREAD):
                if k_row + n * K_STEP < TILE_KEYS:
                    k_store[4 * K_STEP * n] = quad(kr[n])
            for n in range(V_PER_THREAD):
                if v_word + n * V_STEP < ROW_WORDS:
                    c0, c1, c2, c3 = transpose_bf16x4(quad(vr[4 * n]), quad(vr[4 * n + 1]), quad(vr[4 * n + 2]),
                                                      quad(vr[4 * n + 3]))
                    v_store[16 * V_STEP * n] = c0
                    v_store[16 * V_STEP * n + 4] = c1
                    v_store[16 * V_STEP * n + 8] = c2
                    v_store[16 * V_STEP * n + 12] = c3
            cuda.syncthreads()

            # S = Q K^T (16 rows x TILE_KEYS keys per warp): per k-step, 3 mma (the Q pieces) per n8 tile of keys.
            for i in range(SACC):
                sacc[i] = float32(0)
            for s in range(DIM_STEPS):
                for p in range(3):
                    a0, a2 = halves(q_frag[((p * DIM_STEPS + s) * ROWS) * 4])
                    a1, a3 = halves(q_frag[((p * DIM_STEPS + s) * ROWS + 8) * 4])
                    for j in range(KEY_TILES):
                        b0, b1 = halves(k_frag[(s * K_PLANE_ROWS + 8 * j) * 4])
                        sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b0, b1, sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3])

            # Online softmax. Element (j, c) of this lane is row g (c < 2) or g + 8, key t0 + 16 (j // 2)
            # + 4 t + 2 (j % 2) + c % 2.
            masked = t0 + TILE_KEYS - 1 > diag   # the diagonal tile(s): some key lies past some row's position
            for j in range(KEY_TILES):
                for c in range(4):
                    if masked and t0 + 16 * (j // 2) + 4 * t + 2 * (j % 2) + c % 2 > (pos_lo if c < 2 else pos_hi):
                        sacc[4 * j + c] = NEG_INF
            softmax_step(sacc, m, l, oacc, scale)

            # O += P V. The S accumulators of n8 tiles 2s and 2s + 1 are exactly the A fragment of key step s
            # (keys 16 s + 4 t, + 1 in a0 / a1, + 2, + 3 in a2 / a3), split into three bf16 pieces.
            for s in range(KEY_STEPS):
                h0, h1, h2, h3, d0, d1, d2, d3, l0, l1, l2, l3 = p_pieces(sacc, s)
                for p in range(3):
                    if p == 0:
                        a0, a1, a2, a3 = h0, h1, h2, h3
                    elif p == 1:
                        a0, a1, a2, a3 = d0, d1, d2, d3
                    else:
                        a0, a1, a2, a3 = l0, l1, l2, l3
                    for j in range(DIM_TILES):
                        b0, b1 = halves(v_frag[(s * V_PLANE_ROWS + 8 * j) * 4])
                        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b0, b1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])
            cuda.syncthreads()  # before the next tile overwrites ks, vs

        # Epilogue: the row sums across the group's 4 lanes, then out = O / l.
        store_output(out, oacc, l, v_scale, q_begin, kvh, group, n_rows, r_lo, t)

    return prefill_tc_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def check_tc_args(name, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, max_q_len, warps,
                  keys_per_tile, scale, k_scale, v_scale):
    """A tensor-core prefill launcher's checks (ValueError naming `name`): prefill_attention's arguments, a cache
    in TC_FORMATS, head_dim in TC_HEAD_DIMS, keys_per_tile a multiple of 16, at least one warp. Returns
    (head_dim, block_size, format, the score scale times k_scale times log2(e), v_scale): the kernels keep
    scores in log2 units (online_softmax_step)."""
    d, block_size = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                                       max_q_len)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    if fmt not in TC_FORMATS:
        raise ValueError(f"{name} reads {' and '.join(TC_FORMATS)} caches, got {fmt} "
                         f"(prefill_attention takes every format)")
    if d not in TC_HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be one of {TC_HEAD_DIMS}, got {d} "
                         f"(prefill_attention takes any multiple of 8)")
    if keys_per_tile < 16 or keys_per_tile % 16:
        raise ValueError(f"{name}: keys_per_tile must be a multiple of 16, got {keys_per_tile}")
    if warps < 1:
        raise ValueError(f"{name}: warps must be at least 1, got {warps}")
    if not scale > 0:
        raise ValueError(f"{name}: the score scale (times k_scale) must be positive, got {scale}")
    return d, block_size, fmt, np.float32(scale * LOG2E), v_scale


def prefill_attention_tc(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                         max_q_len, stream=0, *, warps, keys_per_tile, k_scale=1.0, v_scale=1.0):
    """attention.prefill_attention on tensor cores (same arguments and result). head_dim must be one of
    TC_HEAD_DIMS and the cache bf16 or fp8: a ValueError otherwise, so that a caller can fall back to
    prefill_attention.
    The configuration is the caller's (attention_policy.prefill_tc_config picks it by head_dim): warps per
    block (16 query rows each) and keys_per_tile, a multiple of 16, keys per K/V tile; the block's threads
    must be a multiple of the words of a K/V row (head_dim / 4) and of the key quads of a tile."""
    d, block_size, fmt, scale, v_scale = check_tc_args("prefill_attention_tc", q, k_cache, v_cache, block_tables,
                                                       cu_seqlens_q, context_lens, out, max_q_len, warps,
                                                       keys_per_tile, scale, k_scale, v_scale)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    kernel = _tc_kernel(d, block_size, warps, keys_per_tile, fmt)
    grid = (num_seqs, -(-max_q_len * group // (16 * warps)), num_kv_heads)
    quads = np.uint64 if fmt == "bf16" else np.uint32     # 4 elements per word
    launch(kernel, grid, warps * WARP, stream, q, view(k_cache, dtype=quads), view(v_cache, dtype=quads),
           block_tables, cu_seqlens_q, context_lens, scale, v_scale, out)
