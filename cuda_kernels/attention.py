"""Causal prefill attention over the paged KV cache, SIMT fp32: a naive version and a flash-attention (online
softmax) one. The tensor-core flash attention that the engine runs where it can is in attention_tc.py.

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
d must be a multiple of 8 and at most 128 (K/V are loaded 64 bits at a time). Argument checks:
attention_args.py.

KV formats: the cache's format is a compile-time choice of each kernel factory (kv_format.codec: how an
element or a 64-bit word is read); both kernels read every format. The fp8 cache's per-tensor scales are
folded in by the launchers (the score scale times k_scale; the output times v_scale), so the kernels read
unscaled e4m3 values.

Versions:
- `prefill_attention_naive` (teaching): grid = (S, max_q_len, Hq), one warp per (query token, head). It
  materialises the query's whole row of scores in shared memory (so the context is capped at
  NAIVE_MAX_CONTEXT) and makes three passes: scores and their max, exp and their sum, the weighted sum of V.
  K and V are re-read from global memory by every query.
- `prefill_attention` (flash attention, SIMT fp32): grid = (S, ceil(max_q_len * G / ROWS), Hkv). A block owns
  ROWS query rows of one sequence and one KV head (which tile and head: row_tile, the longest tiles first), a row
  being a (query token, query head of the group) pair, so the G query heads that share a KV head share every K/V
  tile. It walks the keys in tiles of 32: the block stages a tile in shared memory (widened to fp32), each warp
  scores it against its ROWS / WARPS rows (lane j owns key j of the tile), and updates each row's online softmax
  state: running max m, per-lane running sum l, unnormalised accumulator acc (lane i owns dims i, i + 32, ...),
  rescaled by exp(m_old - m_new) when the max grows. Nothing of size context is ever held, so any context length
  works, in one pass over K and V.
  ROWS and WARPS are the launcher's rows and warps (attention_policy.prefill_flash_config picks them).

The step from naive to flash: the naive kernel needs the max of the whole row before it can exponentiate
anything, so it holds (or recomputes) every score; the online softmax exponentiates against the max seen so
far and corrects what it has accumulated when the max grows, which lets K/V tiles stream through shared
memory once and be shared by ROWS queries.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from cuda_kernels import kv_format
from cuda_kernels.attention_args import check_prefill_args, folded_scales
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import WORD_ELEMS, unpack_bf16x4
from cuda_kernels.launch import launch, view
from cuda_kernels.primitives import WARP, warp_max, warp_sum

NEG_INF = float32(-np.inf)
U64_ZERO = np.uint64(0)        # typed constants (a numba type cast is slow in the simulator's inner loops)
LOG2E = float32(1 / math.log(2))   # scores in log2 units: exp(s - m) = 2^(s log2(e) - m log2(e))
TILE = WARP                    # keys per tile: one key per lane when scoring
NAIVE_MAX_CONTEXT = 8192       # the naive kernel's row of scores lives in shared memory (32 KB)
SHARED_BUDGET = 48 * 1024      # static shared memory per block without the opt-in attribute

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


# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _naive_kernel(head_dim: int, block_size: int, fmt: str = "bf16"):
    D, BLOCK_SIZE = head_dim, block_size
    ARENA = NAIVE_MAX_CONTEXT + D      # shared floats: the row of scores, then the query
    decode = kv_format.codec(fmt)[1]

    @cuda.jit
    def prefill_naive_kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_cache, v_cache (blocks, BLOCK_SIZE, Hkv, D) in format fmt; block_tables
        # (S, max_blocks) i32; scale includes fp8's k_scale
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
            block, offset = block_tables[seq, j // BLOCK_SIZE], j % BLOCK_SIZE
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
                block, offset = block_tables[seq, j // BLOCK_SIZE], j % BLOCK_SIZE
                acc += scores[j] * decode(v_cache[block, offset, kvh, t])
            out[row, h, t] = acc / total * v_scale

    return prefill_naive_kernel


@cuda.jit(device=True)
def row_tile(group, kv_heads, cu_seqlens_q, context_lens, rows):
    """The KV head and query rows of a flash block (grid (sequence, row tile, KV head); attention_tc.py's too):
    with G = group = Hq / Hkv query heads per KV head (a run-time value, or a kernel's compile-time constant),
    row r of sequence s is (token r // G, head kvh * G + r % G), so a KV head's n_rows = q_len * G rows are cut
    into tiles of `rows`. Returns (kvh, q_begin, n_rows, row0, first, k_end): the block's KV head, the
    sequence's first token in q, its row count, the tile's first row (row0 >= n_rows: an empty tile), the
    position of the sequence's first query, and the keys any row of the tile may see (positions < k_end,
    causal).

    NOTE: the last row tiles see the most keys, so they should start first. Blocks start in the order of their
    ids (x fastest, then y, then z), so a sequence's blocks are ranked z * gridDim.y + y and the rank read
    longest first across every KV head: rank i is KV head i % Hkv of row tile gridDim.y - 1 - i // Hkv. (Ranked
    by y alone, the last KV head's longest tiles would start last, after every other head's short ones.)"""
    seq = cuda.blockIdx.x
    rank = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    kvh = rank % kv_heads
    tile = cuda.gridDim.y - 1 - rank // kv_heads
    q_begin = cu_seqlens_q[seq]
    q_len = cu_seqlens_q[seq + 1] - q_begin
    n_rows = q_len * group
    row0 = tile * rows
    first = context_lens[seq] - q_len
    last_row = min(row0 + rows, n_rows) - 1
    return kvh, q_begin, n_rows, row0, first, first + last_row // group + 1


@lru_cache(maxsize=None)
def _flash_kernel(head_dim: int, block_size: int, rows: int, warps: int, fmt: str = "bf16"):
    D, BLOCK_SIZE, ROWS, WARPS = head_dim, block_size, rows, warps
    ROWS_PER_WARP = ROWS // WARPS      # query rows per warp
    THREADS = WARPS * WARP
    ROW_WORDS = D // WORD_ELEMS[fmt]   # uint64 words per K/V row (4 bf16, 2 fp32 or 8 fp8 each)
    stage = widening_store(fmt)
    # NOTE: odd row stride: lane j reading ks[j * K_STRIDE + i] hits bank (j + i) % 32
    K_STRIDE = D + 1
    DIMS_PER_LANE = (D + WARP - 1) // WARP      # output dims per lane: lane owns dims lane, lane + 32, ...
    WORDS_PER_THREAD = (TILE * ROW_WORDS + THREADS - 1) // THREADS  # uint64 words of a K (or V) tile
    Q_PER_THREAD = (ROWS * D + THREADS - 1) // THREADS              # floats of the block's query rows
    K_OFF = ROWS * D                   # shared-memory layout, in floats
    V_OFF = K_OFF + TILE * K_STRIDE
    P_OFF = V_OFF + TILE * D
    L_OFF = P_OFF + ROWS * TILE
    SHARED_FLOATS = L_OFF + ROWS
    ACC = ROWS_PER_WARP * DIMS_PER_LANE   # accumulators per lane (sizes must be plain constants for numba)

    @cuda.jit
    def prefill_flash_kernel(q, k_words, v_words, block_tables, cu_seqlens_q, context_lens, scale, v_scale, out):
        # q, out (T, Hq, D) f32; k_words, v_words (blocks, BLOCK_SIZE, Hkv, ROW_WORDS) u64 (the caches, 64 bits
        # per word); scale includes fp8's k_scale
        seq = cuda.blockIdx.x
        group = q.shape[1] // k_words.shape[2]
        kvh, q_begin, n_rows, row0, first, k_end = row_tile(group, k_words.shape[2], cu_seqlens_q, context_lens, ROWS)
        if row0 >= n_rows:
            return  # the whole block leaves together, before any barrier
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        wrow0 = warp * ROWS_PER_WARP                       # this warp's first row within the block

        arena = cuda.shared.array(SHARED_FLOATS, float32)  # one allocation (they are slow in the simulator)
        qs = arena[:K_OFF]              # the block's query rows (ROWS x D), reused for the output
        ks = arena[K_OFF:V_OFF]         # K tile (TILE x K_STRIDE), widened to fp32, padded rows
        vs = arena[V_OFF:P_OFF]         # V tile (TILE x D), widened to fp32
        ps = arena[P_OFF:L_OFF]         # per row (ROWS x TILE): the tile's scores, then its probabilities
        inv_l = arena[L_OFF:]           # per row: 1 / sum of the probabilities

        for n in range(Q_PER_THREAD):
            e = tid + THREADS * n
            if e < ROWS * D:
                r = row0 + e // D
                value = float32(0)
                if r < n_rows:
                    value = q[q_begin + r // group, kvh * group + r % group, e % D]
                qs[e] = value

        # Per-row state of this warp's rows. m is the same in every lane; l is each lane's share of the sum
        # (its own keys), added across lanes once at the end, not once per tile.
        m = cuda.local.array(ROWS_PER_WARP, float32)
        l = cuda.local.array(ROWS_PER_WARP, float32)
        corr = cuda.local.array(ROWS_PER_WARP, float32)
        acc = cuda.local.array(ACC, float32)
        sc = cuda.local.array(ROWS_PER_WARP, float32)
        for r in range(ROWS_PER_WARP):
            m[r] = NEG_INF
            l[r] = float32(0)
        for a in range(ACC):
            acc[a] = float32(0)
        cuda.syncthreads()

        for t0 in range(0, k_end, TILE):
            # Stage the tile: thread tid copies words tid + THREADS * n. NOTE: four loads, then four stores: a
            # load's first use stalls the (in-order) warp until the data arrives, so issuing them together pays
            # the memory latency once per four words instead of once per word.
            for n in range(0, WORDS_PER_THREAD, 4):
                u = tid + THREADS * n
                ka, va = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u, ROW_WORDS, BLOCK_SIZE)
                kb, vb = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + THREADS, ROW_WORDS,
                                   BLOCK_SIZE)
                kc, vc = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + 2 * THREADS, ROW_WORDS,
                                   BLOCK_SIZE)
                kd, vd = tile_word(k_words, v_words, block_tables, seq, kvh, t0, k_end, u + 3 * THREADS, ROW_WORDS,
                                   BLOCK_SIZE)
                stage(ks, vs, u, ka, va, ROW_WORDS, K_STRIDE)
                stage(ks, vs, u + THREADS, kb, vb, ROW_WORDS, K_STRIDE)
                stage(ks, vs, u + 2 * THREADS, kc, vc, ROW_WORDS, K_STRIDE)
                stage(ks, vs, u + 3 * THREADS, kd, vd, ROW_WORDS, K_STRIDE)
            cuda.syncthreads()

            # Scores of key t0 + lane against the warp's rows (q broadcast from shared memory).
            for r in range(ROWS_PER_WARP):
                sc[r] = float32(0)
            for i in range(D):
                kv = ks[lane * K_STRIDE + i]
                for r in range(ROWS_PER_WARP):
                    sc[r] += qs[(wrow0 + r) * D + i] * kv
            for r in range(ROWS_PER_WARP):
                ps[(wrow0 + r) * TILE + lane] = sc[r]

            # Online softmax update of every row (same trip count in every lane: the reductions need it).
            key = t0 + lane
            for r in range(ROWS_PER_WARP):
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
            for r in range(ROWS_PER_WARP):
                for c in range(DIMS_PER_LANE):
                    acc[r * DIMS_PER_LANE + c] *= corr[r]
            for j in range(TILE):
                for c in range(DIMS_PER_LANE):
                    dim = lane + WARP * c
                    if dim < D:
                        v = vs[j * D + dim]
                        for r in range(ROWS_PER_WARP):
                            acc[r * DIMS_PER_LANE + c] += ps[(wrow0 + r) * TILE + j] * v
            cuda.syncthreads()  # before the next tile overwrites ks, vs

        # Epilogue: the row sums across lanes, then the output through shared memory (coalesced stores).
        for r in range(ROWS_PER_WARP):
            total = warp_sum(l[r])
            if lane == 0:
                inv_l[wrow0 + r] = v_scale / total if total > float32(0) else float32(0)
        for r in range(ROWS_PER_WARP):
            for c in range(DIMS_PER_LANE):
                dim = lane + WARP * c
                if dim < D:
                    qs[(wrow0 + r) * D + dim] = acc[r * DIMS_PER_LANE + c]
        cuda.syncthreads()
        for n in range(Q_PER_THREAD):
            e = tid + THREADS * n
            if e < ROWS * D:
                r = row0 + e // D
                if r < n_rows:
                    out[q_begin + r // group, kvh * group + r % group, e % D] = qs[e] * inv_l[e // D]

    return prefill_flash_kernel


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


def cache_words(cache):
    """The cache (blocks, bs, Hkv, d) seen as (blocks, bs, Hkv, d / E) uint64 (E elements of its format per
    word), as a kernel argument (launch.view: no copy, no new device array)."""
    return view(cache, dtype=np.uint64)


def flash_shared_bytes(head_dim: int, rows: int) -> int:
    """Static shared memory of a flash block of `rows` query rows: the rows, a K tile (padded rows) and a V tile
    widened to fp32, each row's scores of a tile and its 1 / sum (the kernel's arena)."""
    return 4 * (rows * head_dim + TILE * (head_dim + 1) + TILE * head_dim + rows * TILE + rows)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, max_q_len,
                      stream=0, *, warps, rows, k_scale=1.0, v_scale=1.0):
    """out (T, Hq, d) <- causal attention of every sequence's new tokens over its paged context.

    max_q_len: the longest q_len in the batch (host int; it sizes the grid). The caches in any format
    (kv_format); k_scale, v_scale: the fp8 cache's per-tensor scales.
    The configuration is the caller's (attention_policy.prefill_flash_config picks it by head_dim): warps per
    block and query rows per block, a multiple of warps, whose block fits SHARED_BUDGET (flash_shared_bytes)."""
    d, block_size = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                                       max_q_len)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    if warps < 1 or rows < warps or rows % warps:
        raise ValueError(f"prefill_attention: rows must be a positive multiple of warps, got {rows} rows of "
                         f"{warps} warps")
    if flash_shared_bytes(d, rows) > SHARED_BUDGET:
        raise ValueError(f"prefill_attention: {rows} rows of head_dim {d} need {flash_shared_bytes(d, rows)} bytes "
                         f"of shared memory, more than {SHARED_BUDGET}")
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    kernel = _flash_kernel(d, block_size, rows, warps, fmt)
    grid = (num_seqs, -(-max_q_len * group // rows), num_kv_heads)
    launch(kernel, grid, warps * WARP, stream, q, cache_words(k_cache), cache_words(v_cache), block_tables,
           cu_seqlens_q, context_lens, scale, v_scale, out)
