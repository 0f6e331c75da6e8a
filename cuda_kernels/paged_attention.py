"""PagedAttention for decode: one query per sequence, keys and values read through the block table. The first
versions: a key at a time, tiles through shared memory, and split-K with its reduce kernel. The kernel the
engine runs (a block per KV head for all its query heads, K/V in registers) is in paged_attention_gqa.py.

For sequence s and query head h (KV head h // G, G = Hq / Hkv), over the keys j < context_len of the context:

    s_j = scale * <q, k_j>,      out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),   m = max_j s_j

computed with an online softmax: a walker keeps a running max m, a running sum l = sum exp(s_j - m) and an
unnormalised acc = sum exp(s_j - m) v_j; when a tile raises the max to m', l and acc are rescaled by
exp(m - m'). Two such partial states (m1, l1, acc1), (m2, l2, acc2) over disjoint keys merge into
M = max(m1, m2), l = e1 l1 + e2 l2, acc = e1 acc1 + e2 acc2 with e_i = exp(m_i - M): that merge is how the
warps of one block combine, and how the split-K partitions combine.

Shapes and dtypes:
    q             (S, Hq, d)              float32   one query per sequence, at position context_len - 1
    k/v_cache     (blocks, bs, Hkv, d)    format    uint16 bf16 bits, float32, or uint8 fp8 e4m3 bits
                                                    (cuda_kernels/kv_format.py); slots past a context are
                                                    never read
    block_tables  (S, max_blocks)         int32     token j in block block_tables[s, j // bs], offset j % bs
    context_lens  (S,)                    int32     0 marks a padding slot: its output is 0
    out           (S, Hq, d)              float32
    partial_out   (S, Hq, P, d)           float32   split-K workspace (see split_workspace_shapes)
    partial_max, partial_sum (S, Hq, P)   float32
d must be a multiple of 8 and at most 128 (K/V are loaded 64 bits at a time: 4 bf16, 2 fp32 or 8 fp8).
Argument checks: attention_args.py.

KV formats: the walk reads every format, a compile-time choice of its factory (kv_format.codec: an element's
values); the fp8 cache's per-tensor scales are folded in by the launcher (the score scale times k_scale, the
output times v_scale). v1 and split stage bf16 words for their 4-dims-per-lane P V phase and read bf16
caches only (their launchers say so).

Versions:
- `paged_attention_walk` (the first): the math of reference.paged_attention.paged_attention_walk, one key at a
  time. grid = (S, Hq), one warp per (sequence, head); lane i owns dims i, i + 32, ... of q, of the running
  acc and of out. For each key j < context_len in order, the warp reads the block table entry of j, each
  lane multiplies its dims of q and k_j, a warp_sum gives the score in every lane, and each lane updates
  (m, l) and its dims of acc. Simple and correct, and slow: each key costs a block-table load, a dependent K
  load, a warp_sum (5 shuffles) and an exp before the next key's loads are issued, so a warp has about one
  64-byte load in flight; each lane reads 2-byte values.
- `paged_attention_v1`: grid = (S, Hq), a block of WARPS warps (4, or 2 for d > 64 so the tiles fit in 48 KB;
  2 in the simulator) per (sequence, head) walks the whole context 32 keys at a time. Warp w takes tiles w,
  w + WARPS, ..., each warp with its own online-softmax state and its own shared buffers. For a tile: lane j
  looks up the cache row of key j (block table, offset, KV head) once; the warp copies the tile's K and V
  rows (raw bf16, 64-bit words, 8 loads in flight per lane) into shared memory; lane j scores key j (q
  broadcast from shared memory; K rows padded to an odd stride so the 32 lanes hit 32 banks); one warp max
  gives the new running max (it replaces 32 warp sums); then lane (g, w) = (lane // (d/4), lane % (d/4))
  accumulates dims 4w .. 4w+3 of P V over keys g, g + 32 / (d/4), ... At the end the block merges its warps'
  states through shared memory. Enough blocks when the batch is large; at batch 1 it fills only Hq SMs. The
  G query heads of a KV head each stage the same K/V tiles (from L2), and every K/V word goes through shared
  memory.
- `paged_attention_split` + `paged_attention_reduce` (split-K): grid = (S, Hq, P); block p walks keys
  p * partition_size .. (p + 1) * partition_size - 1 as v1 does and writes its partial (max, sum,
  unnormalised acc), a neutral (-inf, 0, 0) past the context; then grid = (S, Hq), one warp per (sequence,
  head) merges the ceil(context_len / partition_size) partitions (paged_attention_gqa.py's split uses the
  same reduce). For long contexts at small batch.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint64

from cuda_kernels import kv_format, pdl
from cuda_kernels.attention import NEG_INF, SHARED_BUDGET, TILE, U64_ZERO, store_words, warp_barrier
from cuda_kernels.attention_args import check_decode_args, expect, folded_scales
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import unpack_bf16x4
from cuda_kernels.launch import launch, view
from cuda_kernels.planes import planes_output, planes_store
from cuda_kernels.primitives import WARP, warp_max, warp_sum

MAX_WARPS = 2 if SIMULATOR else 4   # warps per block (the simulator runs one Python thread per CUDA thread)


# ---------------------------------------------------------------------------------------------------------
# device helpers and kernels


@lru_cache(maxsize=None)
def _walk_kernel(head_dim: int, block_size: int, num_kv_heads: int, fmt: str = "bf16"):
    """The walk kernel (paged_attention_walk) for one head_dim, block size, KV head count and KV format."""
    D, BLOCK_SIZE, HKV = head_dim, block_size, num_kv_heads
    DIMS_PER_LANE = -(-D // WARP)    # lane i owns dims i, i + 32, ... of q, acc and out
    decode = kv_format.codec(fmt)[1]

    @cuda.jit
    def walk_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, v_scale, out):
        # q, out (S, Hq, D) f32; k_cache, v_cache (blocks, BLOCK_SIZE, HKV, D) in format fmt; block_tables (S,
        # max_blocks) i32; context_lens (S,) i32; scale includes fp8's k_scale. grid (S, Hq), one warp per block.
        seq, head = cuda.blockIdx.x, cuda.blockIdx.y
        lane = cuda.threadIdx.x
        kvh = head // (q.shape[1] // HKV)
        qr = cuda.local.array(DIMS_PER_LANE, float32)
        acc = cuda.local.array(DIMS_PER_LANE, float32)
        for i in range(DIMS_PER_LANE):
            d = lane + i * WARP
            qr[i] = q[seq, head, d] if d < D else float32(0)
            acc[i] = float32(0)
        m = NEG_INF
        l = float32(0)
        for j in range(context_lens[seq]):
            # token j of the context: block table entry j // BLOCK_SIZE, offset j % BLOCK_SIZE (the paged-cache lookup)
            block = block_tables[seq, j // BLOCK_SIZE]
            offset = j % BLOCK_SIZE
            dot = float32(0)
            for i in range(DIMS_PER_LANE):
                d = lane + i * WARP
                if d < D:
                    dot += qr[i] * decode(k_cache[block, offset, kvh, d])
            score = scale * warp_sum(dot)
            # online softmax: rescale what was accumulated against the old max when the max grows
            m_new = max(m, score)
            c = math.exp(m - m_new)         # 0 at the first key (m = -inf)
            p = math.exp(score - m_new)
            l = l * c + p
            for i in range(DIMS_PER_LANE):
                d = lane + i * WARP
                if d < D:
                    acc[i] = acc[i] * c + p * decode(v_cache[block, offset, kvh, d])
            m = m_new
        for i in range(DIMS_PER_LANE):
            d = lane + i * WARP
            if d < D:
                out[seq, head, d] = acc[i] / l * v_scale if l > float32(0) else float32(0)

    return walk_kernel


def _row_words(k_rows, v_rows, rows, base, u, words):
    """Word u of a warp's K/V tile: (K word, V word) of tile row u // words, whose cache row index is
    rows[base + u // words] (-1: the token is past the range, and nothing is loaded). Zeros when masked.

    NOTE: mask before the load: a slot past the context may hold anything (NaN in the tests) and 0 * NaN is
    NaN, so such slots are never read."""
    if u < TILE * words:
        row = rows[base + u // words]
        if row >= 0:
            w = u % words
            return k_rows[row, w], v_rows[row, w]
    return U64_ZERO, U64_ZERO


if SIMULATOR:
    row_words = _row_words  # plain Python: a simulated device-function call costs more than this body
else:
    row_words = cuda.jit(device=True, inline=True)(_row_words)


@lru_cache(maxsize=None)
def _decode_kernels(head_dim: int, block_size: int, num_kv_heads: int, warps: int):
    """(v1 kernel, split kernel) for one head_dim, block size, KV head count and warps per block."""
    D, BLOCK_SIZE, HKV, WARPS = head_dim, block_size, num_kv_heads, warps
    THREADS = WARPS * WARP
    ROW_WORDS = D // 4               # uint64 words (4 bf16) per K/V row
    K_STRIDE = ROW_WORDS + 1         # NOTE: odd row stride (in 64-bit words) of the K tile: conflict-free column reads
    KEY_GROUPS = WARP // ROW_WORDS   # key groups in the P V phase: lane = g * ROW_WORDS + w for g < KEY_GROUPS
    # Shared memory, one float32 and one uint64 arena (offsets in elements):
    #   f32: q (D) | p (WARPS x TILE) | warp max (WARPS) | warp sum (WARPS) | warp acc (WARPS x KEY_GROUPS x D)
    #   u64: K tiles (WARPS x TILE x K_STRIDE) | V tiles (WARPS x TILE x ROW_WORDS), one tile of each per warp
    #   i32: cache row of each key of each warp's tile (WARPS x TILE)
    P_OFF = D
    MAX_OFF = P_OFF + WARPS * TILE
    SUM_OFF = MAX_OFF + WARPS
    ACC_OFF = SUM_OFF + WARPS
    F32_SIZE = ACC_OFF + WARPS * KEY_GROUPS * D
    V_OFF = WARPS * TILE * K_STRIDE
    U64_SIZE = V_OFF + WARPS * TILE * ROW_WORDS
    ROWS_SIZE = WARPS * TILE         # (array sizes must be plain constants for numba, not expressions)

    @cuda.jit(device=True)
    def walk(q, k_rows, v_rows, block_tables, seq, head, k_begin, k_end, scale, f32, u64, rows):
        """The online-softmax state of each warp over its tiles of keys k_begin .. k_end - 1, left in the
        warp max / sum / acc slots of the f32 arena."""
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        kvh = head // (q.shape[1] // HKV)
        g, w_own = lane // ROW_WORDS, lane % ROW_WORDS
        k_tile = warp * TILE * K_STRIDE              # this warp's K tile in u64
        v_tile = V_OFF + warp * TILE * ROW_WORDS     # this warp's V tile in u64
        p_row = P_OFF + warp * TILE                  # this warp's probabilities in f32
        r_row = warp * TILE                          # this warp's cache rows in i32
        for t in range(tid, D, THREADS):
            f32[t] = q[seq, head, t]
        cuda.syncthreads()

        n_tiles = (k_end - k_begin + TILE - 1) // TILE if k_end > k_begin else 0
        m = NEG_INF
        l = float32(0)            # this lane's share of the sum (its own keys); added across lanes at the end
        a0 = float32(0)           # dims 4 * w_own .. 4 * w_own + 3 of acc, over this lane's key group
        a1 = float32(0)
        a2 = float32(0)
        a3 = float32(0)
        # Every warp makes the same number of rounds (some on empty tiles): the simulator's warp reductions
        # are block barriers, and it costs one masked tile at most.
        for rnd in range((n_tiles + WARPS - 1) // WARPS):
            t0 = k_begin + (rnd * WARPS + warp) * TILE
            # Lane j looks up the cache row of key t0 + j once (block table, offset, KV head); then the warp
            # copies the tile, lane taking words lane + 32 n of it.
            key = t0 + lane
            row = -1
            if key < k_end:
                row = (block_tables[seq, key // BLOCK_SIZE] * BLOCK_SIZE + key % BLOCK_SIZE) * HKV + kvh
            rows[r_row + lane] = row
            warp_barrier()
            # NOTE: eight loads, then eight stores: a load's first use stalls the (in-order) warp until the
            # data arrives, so issuing them together pays the memory latency once per eight words.
            for n in range(0, ROW_WORDS, 8):
                u = lane + WARP * n
                ka, va = row_words(k_rows, v_rows, rows, r_row, u, ROW_WORDS)
                kb, vb = row_words(k_rows, v_rows, rows, r_row, u + WARP, ROW_WORDS)
                kc, vc = row_words(k_rows, v_rows, rows, r_row, u + 2 * WARP, ROW_WORDS)
                kd, vd = row_words(k_rows, v_rows, rows, r_row, u + 3 * WARP, ROW_WORDS)
                ke, ve = row_words(k_rows, v_rows, rows, r_row, u + 4 * WARP, ROW_WORDS)
                kf, vf = row_words(k_rows, v_rows, rows, r_row, u + 5 * WARP, ROW_WORDS)
                kg, vg = row_words(k_rows, v_rows, rows, r_row, u + 6 * WARP, ROW_WORDS)
                kh, vh = row_words(k_rows, v_rows, rows, r_row, u + 7 * WARP, ROW_WORDS)
                store_words(u64, k_tile, v_tile, u, ka, va, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + WARP, kb, vb, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 2 * WARP, kc, vc, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 3 * WARP, kd, vd, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 4 * WARP, ke, ve, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 5 * WARP, kf, vf, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 6 * WARP, kg, vg, ROW_WORDS, K_STRIDE)
                store_words(u64, k_tile, v_tile, u + 7 * WARP, kh, vh, ROW_WORDS, K_STRIDE)
            warp_barrier()

            # Lane j scores key t0 + j. NOTE: fp32 accumulation of the bf16 products.
            dot = float32(0)
            for w in range(ROW_WORDS):
                k0, k1, k2, k3 = unpack_bf16x4(u64[k_tile + lane * K_STRIDE + w])
                dot += f32[4 * w] * k0 + f32[4 * w + 1] * k1 + f32[4 * w + 2] * k2 + f32[4 * w + 3] * k3
            score = scale * dot if t0 + lane < k_end else NEG_INF
            m_new = max(m, warp_max(score))
            # A walker that has seen no key yet keeps m = -inf: use 0 so exp() gives 0, not NaN.
            m_safe = m_new if m_new != NEG_INF else float32(0)
            c = math.exp(m - m_safe)
            p = math.exp(score - m_safe)
            l = l * c + p
            a0 *= c
            a1 *= c
            a2 *= c
            a3 *= c
            m = m_new
            f32[p_row + lane] = p
            warp_barrier()

            if g < KEY_GROUPS:
                for j in range(g, TILE, KEY_GROUPS):   # masked keys: p = 0 and a zero V row
                    pj = f32[p_row + j]
                    v0, v1, v2, v3 = unpack_bf16x4(u64[v_tile + j * ROW_WORDS + w_own])
                    a0 += pj * v0
                    a1 += pj * v1
                    a2 += pj * v2
                    a3 += pj * v3
            warp_barrier()  # before the next round overwrites this warp's buffers

        total = warp_sum(l)
        if lane == 0:
            f32[MAX_OFF + warp] = m
            f32[SUM_OFF + warp] = total
        if g < KEY_GROUPS:
            base = ACC_OFF + (warp * KEY_GROUPS + g) * D + 4 * w_own
            f32[base] = a0
            f32[base + 1] = a1
            f32[base + 2] = a2
            f32[base + 3] = a3
        cuda.syncthreads()

    @cuda.jit(device=True)
    def merged(f32, dim):
        """The block's (max, sum, acc[dim]): the warps' states rescaled to their common max and added."""
        big = NEG_INF
        for w in range(WARPS):
            big = max(big, f32[MAX_OFF + w])
        big_safe = big if big != NEG_INF else float32(0)
        total = float32(0)
        acc = float32(0)
        for w in range(WARPS):
            e = math.exp(f32[MAX_OFF + w] - big_safe)   # 0 for a warp that saw no key
            total += e * f32[SUM_OFF + w]
            part = float32(0)
            for g in range(KEY_GROUPS):
                part += f32[ACC_OFF + (w * KEY_GROUPS + g) * D + dim]
            acc += e * part
        return big, total, acc

    @cuda.jit
    def decode_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, out):
        # q, out (S, Hq, D) f32; k_rows, v_rows (blocks * BLOCK_SIZE * HKV, D/4) u64, row (block * BLOCK_SIZE
        # + offset) * HKV + kv head; block_tables (S, max_blocks) i32
        seq, head = cuda.blockIdx.x, cuda.blockIdx.y
        f32 = cuda.shared.array(F32_SIZE, float32)
        u64 = cuda.shared.array(U64_SIZE, uint64)
        rows = cuda.shared.array(ROWS_SIZE, int32)
        walk(q, k_rows, v_rows, block_tables, seq, head, 0, context_lens[seq], scale, f32, u64, rows)
        for dim in range(cuda.threadIdx.x, D, THREADS):
            _, total, acc = merged(f32, dim)
            out[seq, head, dim] = acc / total if total > float32(0) else float32(0)

    @cuda.jit
    def split_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, partition_size, partial_out,
                     partial_max, partial_sum):
        # partial_out (S, Hq, P, D) f32; partial_max, partial_sum (S, Hq, P) f32; grid z = partition
        seq, head, part = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        f32 = cuda.shared.array(F32_SIZE, float32)
        u64 = cuda.shared.array(U64_SIZE, uint64)
        rows = cuda.shared.array(ROWS_SIZE, int32)
        k_begin = part * partition_size
        k_end = min(context_lens[seq], k_begin + partition_size)
        # A partition past the context walks no tile and writes the neutral (-inf, 0, 0).
        walk(q, k_rows, v_rows, block_tables, seq, head, k_begin, k_end, scale, f32, u64, rows)
        for dim in range(cuda.threadIdx.x, D, THREADS):
            big, total, acc = merged(f32, dim)
            partial_out[seq, head, part, dim] = acc
            if dim == 0:
                partial_max[seq, head, part] = big
                partial_sum[seq, head, part] = total

    return decode_kernel, split_kernel


@lru_cache(maxsize=None)
def _reduce_kernel(pieces: int = 0):
    """The reduce kernel; with pieces 1 or 3 it writes out's bf16 planes as well (planes.planes_store)."""
    store_planes = planes_store(pieces)

    @cuda.jit
    def paged_attention_reduce_kernel(partial_out, partial_max, partial_sum, context_lens, partition_size, out,
                                      planes):
        # grid = (S, Hq), one warp: lane i reads partitions i, i + 32, ... and owns dims i, i + 32, ...;
        # planes (>= pieces * S * Hq * D,) u16: out's bf16 planes (unused for pieces 0)
        pdl.launch_dependents()
        pdl.grid_wait()
        seq, head = cuda.blockIdx.x, cuda.blockIdx.y
        lane = cuda.threadIdx.x
        n = (context_lens[seq] + partition_size - 1) // partition_size
        n = min(max(n, 0), partial_max.shape[2])   # never read past the workspace, whatever context_lens says
        local = NEG_INF
        for p in range(lane, n, WARP):
            local = max(local, partial_max[seq, head, p])
        big = warp_max(local)
        big_safe = big if big != NEG_INF else float32(0)
        local = float32(0)
        for p in range(lane, n, WARP):
            local += math.exp(partial_max[seq, head, p] - big_safe) * partial_sum[seq, head, p]
        total = warp_sum(local)
        hq, d = out.shape[1], out.shape[2]
        for dim in range(lane, d, WARP):
            acc = float32(0)
            for p in range(n):
                # NOTE: rescale each partition from its own max to the common one before adding.
                acc += math.exp(partial_max[seq, head, p] - big_safe) * partial_out[seq, head, p, dim]
            result = acc / total if total > float32(0) else float32(0)
            out[seq, head, dim] = result
            store_planes(planes, out.shape[0] * hq * d, (seq * hq + head) * d + dim, result)

    return paged_attention_reduce_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def cache_rows(cache):
    """The cache (blocks, bs, Hkv, d) seen as (blocks * bs * Hkv, d / E) uint64 rows (E elements of its format
    per word), as a kernel argument (launch.view: no copy, no new device array)."""
    blocks, bs, hkv, d = cache.shape
    return view(cache, (blocks * bs * hkv, d * np.dtype(cache.dtype).itemsize // 8), np.uint64)


def decode_warps(head_dim: int) -> int:
    """Warps per decode block: up to MAX_WARPS, as many as their K/V tile buffers fit in 48 KB."""
    per_warp = 8 * TILE * (2 * (head_dim // 4) + 1) + 4 * TILE + 4 * TILE + 4 * WARP * 4
    return max(1, min(MAX_WARPS, (SHARED_BUDGET - 4 * head_dim) // per_warp))


def paged_attention_walk(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0, k_scale=1.0,
                         v_scale=1.0):
    """out (S, Hq, d) <- decode attention of each sequence's one query over its paged context, one warp per
    (sequence, head) walking the block table one key at a time (the first version); any KV format (k_scale,
    v_scale: fp8's). Twin: reference.paged_attention.paged_attention_walk."""
    d, block_size = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    if q.shape[0] == 0:
        return
    kernel = _walk_kernel(d, block_size, k_cache.shape[2], fmt)
    launch(kernel, (q.shape[0], q.shape[1]), WARP, stream, q, k_cache, v_cache, block_tables, context_lens,
           scale, v_scale, out)


def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0):
    """out (S, Hq, d) <- decode attention of each sequence's one query over its paged context (v1; bf16
    caches only)."""
    d, block_size = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    kv_format.require_bf16(k_cache, "paged_attention_v1")
    if q.shape[0] == 0:
        return
    warps = decode_warps(d)
    kernel, _ = _decode_kernels(d, block_size, k_cache.shape[2], warps)
    launch(kernel, (q.shape[0], q.shape[1]), warps * WARP, stream, q, cache_rows(k_cache), cache_rows(v_cache),
           block_tables, context_lens, np.float32(scale), out)


def split_workspace_shapes(num_seqs, num_heads, head_dim, max_context_len, partition_size):
    """Shapes of (partial_out, partial_max, partial_sum), all float32, for contexts up to max_context_len."""
    num_partitions = max(1, -(-int(max_context_len) // int(partition_size)))
    return ((num_seqs, num_heads, num_partitions, head_dim), (num_seqs, num_heads, num_partitions),
            (num_seqs, num_heads, num_partitions))


def paged_attention_split(q, k_cache, v_cache, block_tables, context_lens, scale, out, partial_out, partial_max,
                          partial_sum, partition_size, stream=0):
    """out (S, Hq, d) <- decode attention, split-K: partials per partition of partition_size keys, then merged.

    The workspace (shapes from split_workspace_shapes) must cover the longest context: P * partition_size >=
    max(context_lens). Any partition_size >= 1 is correct; multiples of 32 * warps keep every warp busy."""
    d, block_size = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    kv_format.require_bf16(k_cache, "paged_attention_split")
    _check_workspace(*q.shape, partial_out, partial_max, partial_sum, partition_size)
    if q.shape[0] == 0:
        return
    warps = decode_warps(d)
    _, kernel = _decode_kernels(d, block_size, k_cache.shape[2], warps)
    launch(kernel, (q.shape[0], q.shape[1], partial_out.shape[2]), warps * WARP, stream, q, cache_rows(k_cache),
           cache_rows(v_cache), block_tables, context_lens, np.float32(scale), int(partition_size), partial_out,
           partial_max, partial_sum)
    paged_attention_reduce(partial_out, partial_max, partial_sum, context_lens, partition_size, out, stream)


def paged_attention_reduce(partial_out, partial_max, partial_sum, context_lens, partition_size, out, stream=0,
                           planes=None, bf16_inputs: bool = False):
    """out (S, Hq, d) <- the split-K partials merged: the second kernel of paged_attention_split, and of
    paged_attention_gqa.paged_attention when it splits. planes: out's bf16 planes as well, into this uint16
    workspace (planes.planes_output: one plane, rounded, with bf16_inputs, else the three of the bf16x3 split)."""
    if partial_out.ndim != 4 or partial_out.dtype != np.float32:
        raise ValueError(f"partial_out: expected (num_seqs, num_heads, partitions, head_dim) float32, "
                         f"got {tuple(partial_out.shape)} {partial_out.dtype}")
    s, hq, _, d = partial_out.shape
    _check_workspace(s, hq, d, partial_out, partial_max, partial_sum, partition_size)
    expect("context_lens", context_lens, (s,), np.int32)
    expect("out", out, (s, hq, d), np.float32)
    pieces, planes = planes_output(planes, out, bf16_inputs)
    if s == 0:
        return
    launch(_reduce_kernel(pieces), (s, hq), WARP, stream, partial_out, partial_max, partial_sum,
           context_lens, int(partition_size), out, planes, dependent=True)


def _check_workspace(s, hq, d, partial_out, partial_max, partial_sum, partition_size):
    if int(partition_size) != partition_size or partition_size < 1:
        raise ValueError(f"partition_size must be a positive int, got {partition_size!r}")
    if partial_out.ndim != 4 or tuple(partial_out.shape[:2]) != (s, hq) or partial_out.shape[3] != d \
            or partial_out.dtype != np.float32:
        raise ValueError(f"partial_out: expected ({s}, {hq}, partitions, {d}) float32, "
                         f"got {tuple(partial_out.shape)} {partial_out.dtype}")
    expect("partial_max", partial_max, partial_out.shape[:3], np.float32)
    expect("partial_sum", partial_sum, partial_out.shape[:3], np.float32)
