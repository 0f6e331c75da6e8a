"""PagedAttention for decode: one query per sequence, keys and values read through the block table.

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
    workspace     (n,)                    float32   the fast kernel's split-K partials, carved from one buffer
                                                    of decode_workspace_size(...) floats
d must be a multiple of 8 and at most 128 (K/V are loaded 64 bits at a time: 4 bf16, 2 fp32 or 8 fp8).

KV formats: the walk and the fast kernel read every format, a compile-time choice of their factories
(kv_format.codec: an element's or a 64-bit word's values); the fp8 cache's per-tensor scales are folded in by
the launchers (the score scale times k_scale, the output times v_scale). v1 and split stage bf16 words for
their 4-dims-per-lane P V phase and read bf16 caches only (their launchers say so).

Thread mapping of the walk kernel: grid = (S, Hq), one warp per (sequence, head); lane i owns dims i, i + 32,
... of q, of the running acc and of out. For each key j < context_len in order, the warp reads the block
table entry of j (block_tables[s, j // bs], offset j % bs), each lane multiplies its dims of q and k_j, a
warp_sum gives the score in every lane, and each lane updates (m, l) and its dims of acc.

Thread mapping of v1 and split (both walk keys the same way): a block of WARPS warps (4, or 2 for d > 64 so
the tiles fit in 48 KB; 2 in the simulator) per (sequence, head[, partition]). The keys are cut into tiles of
32; warp w takes tiles w, w + WARPS, ..., each warp with its own online-softmax state and its own shared
buffers. For a tile: lane j looks up the cache row of key j (block table, offset, KV head) once; the warp
copies the tile's K and V rows (raw bf16, 64-bit words, 8 loads in flight per lane) into shared memory; lane j
scores key j (q broadcast from shared memory; K rows padded to an odd stride so the 32 lanes hit 32 banks);
one warp max gives the new running max; then lane (g, w) = (lane // (d/4), lane % (d/4)) accumulates dims
4w .. 4w+3 of P V over keys g, g + 32 / (d/4), ... At the end the block merges its warps' states through
shared memory.

Versions:
- `paged_attention_walk` (the first): the math of reference.paged_attention.paged_attention_walk, one key at a
  time. Simple and correct, and slow: each key costs a block-table load, a dependent K load, a warp_sum (5
  shuffles) and an exp before the next key's loads are issued, so a warp has about one 64-byte load in
  flight; each lane reads 2-byte values.
- `paged_attention_v1`: grid = (S, Hq), one block per (sequence, head) walks the whole context, 32 keys at a
  time: a warp copies a tile of 32 keys' K and V rows (64-bit words, 8 loads in flight per lane) into shared
  memory, lane j scores key j, and one warp max per tile replaces 32 warp sums. Enough blocks when the batch
  is large; at batch 1 it fills only Hq SMs. The G query heads of a KV head each stage the same K/V tiles
  (from L2), and every K/V word goes through shared memory.
- `paged_attention_split` + `paged_attention_reduce` (split-K): grid = (S, Hq, P); block p walks keys
  p * partition_size .. (p + 1) * partition_size - 1 and writes its partial (max, sum, unnormalised acc), a
  neutral (-inf, 0, 0) past the context; then grid = (S, Hq), one warp per (sequence, head) merges the
  ceil(context_len / partition_size) partitions. For long contexts at small batch.
- `paged_attention` (the engine's; GQA-shared, register-resident, split-K): one block per (sequence, KV
  head[, partition]) serves all the query heads of the group, so each K/V row is read from global memory
  once; K/V stay in registers, several lanes share a key. See "The fast kernel" below.

The fast kernel (`paged_attention`). Per key the work is fixed by the math: 2 d bf16 of K and V read, and
for each of the G query heads a d-long dot product, one exp and a d-long axpy. v1 adds to that, per head, a
shared-memory store and load of every K/V word and a 32-lane max per tile; the fast kernel removes both and
reads K/V once for all G heads.
    grid  = (S, Hkv * C, P): C = ceil(G / HB) chunks of HB <= 4 query heads per KV head (register budget),
            P partitions of the block table (P = 1: no workspace, the kernel writes out itself); NW and P
            from shapes only (decode_warps_policy, decode_partitions: 8 warps and no split for a batch-1
            decode graph up to 512 keys; see the NOTE at SMALL_GRID_WARPS); LPK from shapes too
            (decode_lanes_policy)
    block = NW warps; lane = slot * LPK + sub: the LPK (8, or 4) lanes of a slot share one key,
            lane sub owning 64-bit words sub, sub + LPK, ... of the K and V rows (4 bf16 each), so one warp
            load instruction reads 32 / LPK whole 32-byte sectors; the 32 / LPK slots take 32 / LPK keys.
    walk  : warp w takes KV blocks w, w + NW, ... of its partition (one block-table load per block of BS
            tokens, read a block ahead); a slot takes keys slot, slot + 32 / LPK, ... of the block, U at
            a time: a chunk. Software-pipelined: the loads of the warp's next chunk are issued before the
            current chunk is consumed, into a second set of registers, so one is always in flight. The
            score of a key for head h is the lane's partial dot product (q times scale log2(e), held in
            registers) summed over the slot's LPK lanes with LPK-wide xor shuffles; every lane of the slot
            then has it. Under PDL the first chunk's table entry and K/V loads go out before the wait for
            the kernel before, all but the newest key's (see attend).
    state : per slot and head an online-softmax state (m, l, acc), acc over the lane's own dims: no
            cross-slot traffic in the loop; acc and l are rescaled only when a key raises m (rare after the
            first keys), instead of every tile.
    merge : every (warp, slot) writes its states to shared memory; one weight exp(m - M) per state, then
            thread t sums output (head, dim) pairs t, t + 32 NW, ... over the states.
Per key (G = 4, d = 64, LPK = 8), each of its 8 lanes: 4 64-bit loads, 16 bf16 unpacks, 32 + 32 FMA (scores,
P V), 12 shuffles and adds, 4 exp2 (one MUFU op each: scores are kept in log2 units): about 130 lane
instructions, so ~33 warp instructions per key for all 4 heads and 256 bytes of K/V read once; v1 spends
~25 per key per head (~100 for the group) and stages the same rows 4 times.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint64

from cuda_kernels import kv_format, pdl
from cuda_kernels.attention import (NEG_INF, SHARED_BUDGET, TILE, U64_ZERO, _expect, check_cache_args, folded_scales,
                                    store_words, unpack_bf16x4, warp_barrier)
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import WORD_ELEMS
from cuda_kernels.launch import launch, view
from cuda_kernels.primitives import FULL_MASK, WARP, warp_max, warp_sum

MAX_WARPS = 2 if SIMULATOR else 4   # the simulator runs one Python thread per CUDA thread
LOG2E = float32(1 / math.log(2))
LN2 = float32(math.log(2))
# Lanes sharing one key in the fast kernel. 8 (d = 64: 8 dims each) compiles to 166 registers, 12 warps per
# SM; 4 needs ~20% fewer instructions per key but 233 registers, 8 warps per SM. decode_lanes_policy picks
# 4 for some shapes, LANES_PER_KEY otherwise.
LANES_PER_KEY = 8
# NOTE: 4 lanes per key won where the grid has at most TARGET_BLOCKS blocks and each warp walks at least
# LONG_WALK_ROUNDS KV blocks (512 blocks are two full waves of 2 blocks per SM at 4 lanes, 1.3 waves of 3 at
# 8); everywhere else 8 lanes tied or won. At head_dim 128, 4 lanes spill. Measured on the H200:
# docs/performance.md, "decode attention".
LONG_WALK_ROUNDS = 16
# 64-bit words of K (and of V) a lane loads per chunk of keys. The walk keeps two chunks in registers (one
# consumed, the next in flight). NOTE: 8 was the best or near it at every shape measured on the H200
# (docs/performance.md, "decode attention").
CHUNK_WORDS = 8
MAX_BLOCK_HEADS = 4                 # query heads one block of the fast kernel serves (registers: q and acc)
# The fast kernel's policy (from shapes only, so a captured CUDA graph stays valid). Warps: SMALL_GRID_WARPS per
# block when the grid has no more blocks than the GPU has SMs, MAX_WARPS otherwise. Partitions: none while
# each warp walks at most SPLIT_ROUNDS KV blocks; past that, partitions of PARTITION_ROUNDS blocks per warp,
# as many as keep the grid at about TARGET_BLOCKS blocks.
# NOTE: the reduce kernel and the partials cost about two rounds of a warp's walk, so a split pays only for
# long contexts at small batches; a short context takes one pass of more warps (docs/performance.md, "decode
# attention").
SMALL_GRID_WARPS = MAX_WARPS if SIMULATOR else 8
# The most warps a caller may ask for. NOTE: the register file bounds a block too (65,536 registers per SM).
# ptxas (sm_90, CUDA 13.0) gives the fast kernel 40-255 registers per thread, the most where the shared
# memory allows the fewest warps. At 32 warps a one-head block (72 x 1,024) would not launch, and at 16 one
# configuration fails (head_dim 40, group 4, 8 lanes: 134 x 512). At 12 the most any configuration needs is
# 64,512 of the 65,536 (head_dim 40, groups 7 and 8, 8 lanes: 168 x 384, with the walk's two chunks of
# registers; 161 x 384 before): tools/offline_compile.py --attention-warps checks every configuration offline.
MAX_FAST_WARPS = 12
# NOTE: per KV format (ptxas of CUDA 13.5, tools/offline_compile.py --attention-warps --kv-cache-dtype): every
# fp8 configuration fits (57,856 at most: head_dim 40, group 7, 4 lanes, 8 warps: 226 x 256), but with an fp32
# cache head_dim 128, one query head per block and 4 lanes per key take 221 registers, and the 11 warps its
# shared memory allows would need 77,792. fp32 is capped at 8 warps (255 x 256 always fits); the policy never
# asks for more than 8 anyway.
FAST_WARPS_BY_FORMAT = {"bf16": MAX_FAST_WARPS, "fp8": MAX_FAST_WARPS, "fp32": 8}
SM_COUNT = 132                      # H200
SPLIT_ROUNDS = 4
PARTITION_ROUNDS = 2
TARGET_BLOCKS = 512

# ---------------------------------------------------------------------------------------------------------
# device helpers and kernels


@lru_cache(maxsize=None)
def _walk_kernel(head_dim: int, block_size: int, num_kv_heads: int, fmt: str = "bf16"):
    """The walk kernel (paged_attention_walk) for one head_dim, block size, KV head count and KV format."""
    D, BS, HKV = head_dim, block_size, num_kv_heads
    DPL = -(-D // WARP)          # dims per lane: lane i owns dims i, i + 32, ... of q, acc and out
    decode = kv_format.codec(fmt)[1]

    @cuda.jit
    def walk_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, v_scale, out):
        # q, out (S, Hq, D) f32; k_cache, v_cache (blocks, BS, HKV, D) in format fmt; block_tables (S,
        # max_blocks) i32; context_lens (S,) i32; scale includes fp8's k_scale. grid (S, Hq), one warp per block.
        seq, head = cuda.blockIdx.x, cuda.blockIdx.y
        lane = cuda.threadIdx.x
        kvh = head // (q.shape[1] // HKV)
        qr = cuda.local.array(DPL, float32)
        acc = cuda.local.array(DPL, float32)
        for i in range(DPL):
            d = lane + i * WARP
            qr[i] = q[seq, head, d] if d < D else float32(0)
            acc[i] = float32(0)
        m = NEG_INF
        l = float32(0)
        for j in range(context_lens[seq]):
            # token j of the context: block table entry j // BS, offset j % BS (the paged-cache lookup)
            block = block_tables[seq, j // BS]
            offset = j % BS
            dot = float32(0)
            for i in range(DPL):
                d = lane + i * WARP
                if d < D:
                    dot += qr[i] * decode(k_cache[block, offset, kvh, d])
            score = scale * warp_sum(dot)
            # online softmax: rescale what was accumulated against the old max when the max grows
            m_new = max(m, score)
            c = math.exp(m - m_new)         # 0 at the first key (m = -inf)
            p = math.exp(score - m_new)
            l = l * c + p
            for i in range(DPL):
                d = lane + i * WARP
                if d < D:
                    acc[i] = acc[i] * c + p * decode(v_cache[block, offset, kvh, d])
            m = m_new
        for i in range(DPL):
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
    D, BS, HKV, NW = head_dim, block_size, num_kv_heads, warps
    NT = NW * WARP
    WD = D // 4                  # uint64 words (4 bf16) per K/V row
    KS = WD + 1                  # NOTE: odd row stride (in 64-bit words) of the K tile: conflict-free column reads
    KG = WARP // WD              # key groups in the P V phase: lane = g * WD + w for g < KG
    # Shared memory, one float32 and one uint64 arena (offsets in elements):
    #   f32: q (D) | p (NW x TILE) | warp max (NW) | warp sum (NW) | warp acc (NW x KG x D)
    #   u64: K tiles (NW x TILE x KS) | V tiles (NW x TILE x WD), one tile of each per warp
    #   i32: cache row of each key of each warp's tile (NW x TILE)
    P_OFF = D
    MAX_OFF = P_OFF + NW * TILE
    SUM_OFF = MAX_OFF + NW
    ACC_OFF = SUM_OFF + NW
    F32_SIZE = ACC_OFF + NW * KG * D
    V_OFF = NW * TILE * KS
    U64_SIZE = V_OFF + NW * TILE * WD
    ROWS_SIZE = NW * TILE                # (array sizes must be plain constants for numba, not expressions)

    @cuda.jit(device=True)
    def walk(q, k_rows, v_rows, block_tables, seq, head, k_begin, k_end, scale, f32, u64, rows):
        """The online-softmax state of each warp over its tiles of keys k_begin .. k_end - 1, left in the
        warp max / sum / acc slots of the f32 arena."""
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        kvh = head // (q.shape[1] // HKV)
        g, w_own = lane // WD, lane % WD
        k_tile = warp * TILE * KS                 # this warp's K tile in u64
        v_tile = V_OFF + warp * TILE * WD         # this warp's V tile in u64
        p_row = P_OFF + warp * TILE               # this warp's probabilities in f32
        r_row = warp * TILE                       # this warp's cache rows in i32
        for t in range(tid, D, NT):
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
        for rnd in range((n_tiles + NW - 1) // NW):
            t0 = k_begin + (rnd * NW + warp) * TILE
            # Lane j looks up the cache row of key t0 + j once (block table, offset, KV head); then the warp
            # copies the tile, lane taking words lane + 32 n of it.
            key = t0 + lane
            row = -1
            if key < k_end:
                row = (block_tables[seq, key // BS] * BS + key % BS) * HKV + kvh
            rows[r_row + lane] = row
            warp_barrier()
            # NOTE: eight loads, then eight stores: a load's first use stalls the (in-order) warp until the
            # data arrives, so issuing them together pays the memory latency once per eight words.
            for n in range(0, WD, 8):
                u = lane + WARP * n
                ka, va = row_words(k_rows, v_rows, rows, r_row, u, WD)
                kb, vb = row_words(k_rows, v_rows, rows, r_row, u + WARP, WD)
                kc, vc = row_words(k_rows, v_rows, rows, r_row, u + 2 * WARP, WD)
                kd, vd = row_words(k_rows, v_rows, rows, r_row, u + 3 * WARP, WD)
                ke, ve = row_words(k_rows, v_rows, rows, r_row, u + 4 * WARP, WD)
                kf, vf = row_words(k_rows, v_rows, rows, r_row, u + 5 * WARP, WD)
                kg, vg = row_words(k_rows, v_rows, rows, r_row, u + 6 * WARP, WD)
                kh, vh = row_words(k_rows, v_rows, rows, r_row, u + 7 * WARP, WD)
                store_words(u64, k_tile, v_tile, u, ka, va, WD, KS)
                store_words(u64, k_tile, v_tile, u + WARP, kb, vb, WD, KS)
                store_words(u64, k_tile, v_tile, u + 2 * WARP, kc, vc, WD, KS)
                store_words(u64, k_tile, v_tile, u + 3 * WARP, kd, vd, WD, KS)
                store_words(u64, k_tile, v_tile, u + 4 * WARP, ke, ve, WD, KS)
                store_words(u64, k_tile, v_tile, u + 5 * WARP, kf, vf, WD, KS)
                store_words(u64, k_tile, v_tile, u + 6 * WARP, kg, vg, WD, KS)
                store_words(u64, k_tile, v_tile, u + 7 * WARP, kh, vh, WD, KS)
            warp_barrier()

            # Lane j scores key t0 + j. NOTE: fp32 accumulation of the bf16 products.
            dot = float32(0)
            for w in range(WD):
                k0, k1, k2, k3 = unpack_bf16x4(u64[k_tile + lane * KS + w])
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

            if g < KG:
                for j in range(g, TILE, KG):   # masked keys: p = 0 and a zero V row
                    pj = f32[p_row + j]
                    v0, v1, v2, v3 = unpack_bf16x4(u64[v_tile + j * WD + w_own])
                    a0 += pj * v0
                    a1 += pj * v1
                    a2 += pj * v2
                    a3 += pj * v3
            warp_barrier()  # before the next round overwrites this warp's buffers

        total = warp_sum(l)
        if lane == 0:
            f32[MAX_OFF + warp] = m
            f32[SUM_OFF + warp] = total
        if g < KG:
            base = ACC_OFF + (warp * KG + g) * D + 4 * w_own
            f32[base] = a0
            f32[base + 1] = a1
            f32[base + 2] = a2
            f32[base + 3] = a3
        cuda.syncthreads()

    @cuda.jit(device=True)
    def merged(f32, dim):
        """The block's (max, sum, acc[dim]): the warps' states rescaled to their common max and added."""
        big = NEG_INF
        for w in range(NW):
            big = max(big, f32[MAX_OFF + w])
        big_safe = big if big != NEG_INF else float32(0)
        total = float32(0)
        acc = float32(0)
        for w in range(NW):
            e = math.exp(f32[MAX_OFF + w] - big_safe)   # 0 for a warp that saw no key
            total += e * f32[SUM_OFF + w]
            part = float32(0)
            for g in range(KG):
                part += f32[ACC_OFF + (w * KG + g) * D + dim]
            acc += e * part
        return big, total, acc

    @cuda.jit
    def decode_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, out):
        # q, out (S, Hq, D) f32; k_rows, v_rows (blocks * BS * HKV, D/4) u64, row (block * BS + offset) * HKV
        # + kv head; block_tables (S, max_blocks) i32
        seq, head = cuda.blockIdx.x, cuda.blockIdx.y
        f32 = cuda.shared.array(F32_SIZE, float32)
        u64 = cuda.shared.array(U64_SIZE, uint64)
        rows = cuda.shared.array(ROWS_SIZE, int32)
        walk(q, k_rows, v_rows, block_tables, seq, head, 0, context_lens[seq], scale, f32, u64, rows)
        for dim in range(cuda.threadIdx.x, D, NT):
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
        for dim in range(cuda.threadIdx.x, D, NT):
            big, total, acc = merged(f32, dim)
            partial_out[seq, head, part, dim] = acc
            if dim == 0:
                partial_max[seq, head, part] = big
                partial_sum[seq, head, part] = total

    return decode_kernel, split_kernel


@cuda.jit
def paged_attention_reduce_kernel(partial_out, partial_max, partial_sum, context_lens, partition_size, out):
    # grid = (S, Hq), one warp: lane i reads partitions i, i + 32, ... and owns dims i, i + 32, ...
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
    for dim in range(lane, out.shape[2], WARP):
        acc = float32(0)
        for p in range(n):
            # NOTE: rescale each partition from its own max to the common one before adding.
            acc += math.exp(partial_max[seq, head, p] - big_safe) * partial_out[seq, head, p, dim]
        out[seq, head, dim] = acc / total if total > float32(0) else float32(0)


if SIMULATOR:
    @cuda.jit(device=True)
    def slot_sum(value, width):
        """The sum of `value` over the `width` lanes of this lane's slot (lanes width * k .. width * k + width
        - 1), in every one of them. The simulator has no shuffles: a block-wide shared-memory exchange (every
        thread of the block must call it the same number of times)."""
        buf = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        buf[tid] = value
        cuda.syncthreads()
        first = tid - tid % width
        total = float32(0)
        for i in range(width):
            total += buf[first + i]
        return total
else:
    @cuda.jit(device=True, inline=True)
    def slot_sum(value, width):
        """The sum of `value` over the `width` lanes of this lane's slot, in every one of them: a butterfly of
        xor shuffles within the slot (width a power of two; all 32 lanes of the warp take part)."""
        offset = width // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        return value


@lru_cache(maxsize=None)
def _gqa_kernels(head_dim: int, block_size: int, num_kv_heads: int, group: int, lanes_per_key: int, warps: int,
                 fmt: str = "bf16"):
    """(direct kernel, split kernel) of the fast decode attention for one configuration (see the module
    docstring, "The fast kernel"). The direct kernel (grid z = 1) writes out; the split kernel writes the
    partials of its partition, which paged_attention_reduce_kernel merges. fmt: the KV format (a word holds
    E = 4 bf16, 2 fp32 or 8 fp8 elements; everything below counts words)."""
    D, BS, HKV, G, LPK, NW = head_dim, block_size, num_kv_heads, group, lanes_per_key, warps
    E = WORD_ELEMS[fmt]
    unpack = kv_format.codec(fmt)[2]
    NT = NW * WARP
    HB = heads_per_block(G)          # query heads per block
    C = -(-G // HB)                  # blocks (head chunks) per KV head
    KPW = WARP // LPK                # slots (keys in flight) per warp
    WD = D // E                      # 64-bit words (E elements) per K/V row
    WPL = -(-WD // LPK)              # words per lane: lane sub owns words sub, sub + LPK, ...
    EVEN = WD % LPK == 0             # every lane owns WPL words (else the last ones are masked)
    U = max(1, min(CHUNK_WORDS // WPL, -(-BS // KPW)))  # keys per slot per chunk: CHUNK_WORDS words of K, of V
    CH = U * KPW                     # keys per warp per chunk
    NCH = -(-BS // CH)               # chunks per KV block
    QW = HB * WPL * E                # q values (and acc values) per lane
    KW = U * WPL                     # K words (and V words) per lane in a chunk (two chunks in registers)
    STATES = NW * KPW                # online-softmax states per head in a block, one per (warp, slot)
    SS = HB * D + 1                  # NOTE: odd stride between the states' acc rows: fewer bank conflicts
    ACC_SIZE = STATES * SS           # (array sizes must be plain constants for numba, not expressions)
    ML_SIZE = STATES * HB

    @cuda.jit(device=True)
    def seq_and_heads():
        """(sequence, KV head, first query head, query heads) of this block."""
        kvh, chunk = cuda.blockIdx.y // C, cuda.blockIdx.y % C
        return cuda.blockIdx.x, kvh, kvh * G + chunk * HB, min(HB, G - chunk * HB)

    @cuda.jit(device=True)
    def table_blocks(ctx, block_tables):
        """KV blocks holding the context's keys (never past the block table, whatever context_lens says)."""
        return min(max(ctx + BS - 1, 0) // BS, block_tables.shape[1])

    @cuda.jit(device=True, inline=True)   # NOTE: inlined, so that kw and vw stay in registers
    def load_keys(k_rows, v_rows, kvh, phys, b, c0, live, limit, kw, vw):
        """Issue the loads of the lane's U keys c0 + u * KPW + slot of KV block b (physical block phys): its
        words of their K and V rows, 0 for a key at or past `limit` (or past the block)."""
        lane = cuda.threadIdx.x % WARP
        slot, col = lane // LPK, uint64(lane % LPK)   # NOTE: unsigned indices: no wraparound code per load
        for u in range(U):
            off = c0 + u * KPW + slot
            ok = live and off < BS and b * BS + off < limit
            row = uint64((phys * BS + off) * HKV + kvh)
            for i in range(WPL):
                # NOTE: mask before the load: a slot past the context may hold anything (NaN in the tests)
                # and 0 * NaN is NaN, so it is never read.
                if ok and (EVEN or lane % LPK + LPK * i < WD):
                    kw[u * WPL + i] = k_rows[row, col + uint64(LPK * i)]
                    vw[u * WPL + i] = v_rows[row, col + uint64(LPK * i)]
                else:
                    kw[u * WPL + i] = U64_ZERO
                    vw[u * WPL + i] = U64_ZERO

    @cuda.jit(device=True, inline=True)   # NOTE: inlined, so that every local array stays in registers
    def consume(kw, vw, b, c0, live, ctx, qr, acc, m, l, sc):
        """Fold the lane's U keys c0 + u * KPW + slot of KV block b (their words in kw, vw) into its
        online-softmax states (m, l, acc) of the block's heads."""
        lane = cuda.threadIdx.x % WARP
        slot = lane // LPK
        for u in range(U):
            # Scores: the lane's share of each dot product (fp32, one FMA per product), then the slot's sum.
            for h in range(HB):
                sc[h] = float32(0)
            for i in range(WPL):
                kx = unpack(kw[u * WPL + i])
                for h in range(HB):
                    e = (h * WPL + i) * E
                    dot = sc[h]
                    for c in range(E):
                        dot += qr[e + c] * kx[c]
                    sc[h] = dot
            for h in range(HB):
                sc[h] = slot_sum(sc[h], LPK)
            off = c0 + u * KPW + slot
            if live and off < BS and b * BS + off < ctx:
                for h in range(HB):
                    score = sc[h]
                    if score > m[h]:
                        # NOTE: rescale only when the max grows (m = -inf at first: c = 0, and l and acc are
                        # still 0), not once per key.
                        c = math.exp2(m[h] - score)
                        l[h] *= c
                        for a in range(WPL * E):
                            acc[h * WPL * E + a] *= c
                        m[h] = score
                    p = math.exp2(score - m[h])
                    l[h] += p
                    sc[h] = p
                for i in range(WPL):
                    vx = unpack(vw[u * WPL + i])
                    for h in range(HB):
                        e = (h * WPL + i) * E
                        for c in range(E):
                            acc[e + c] += sc[h] * vx[c]

    @cuda.jit(device=True)
    def attend(q, k_rows, v_rows, block_tables, seq, kvh, h0, nh, b_begin, b_end, ctx, scale, sm, sl, sacc):
        """Walk KV blocks b_begin .. b_end - 1 of sequence seq for query heads h0 .. h0 + nh - 1; leaves each
        (warp, slot) state in shared memory: m in sm, l in sl, acc in sacc (row (warp * KPW + slot) * SS,
        head h at h * D). Executes pdl.grid_wait() after the first loads (see below).

        The walk is software-pipelined: a warp's keys come in chunks of CH (NCH chunks per KV block, the
        warp's blocks b_begin + warp, + NW, ...), and the loads of chunk t + 1 are issued before chunk t is
        consumed, into a second set of registers (kn, vn), so a lane always has a chunk's K/V words in
        flight while it computes. The block-table entry of the warp's next block is read one block ahead."""
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        slot, sub = lane // LPK, lane % LPK
        col = uint64(sub)
        qr = cuda.local.array(QW, float32)       # q of the block's heads at the lane's dims, times scale log2(e)
        acc = cuda.local.array(QW, float32)
        m = cuda.local.array(HB, float32)
        l = cuda.local.array(HB, float32)
        sc = cuda.local.array(HB, float32)
        kw = cuda.local.array(KW, uint64)        # the chunk being consumed
        vw = cuda.local.array(KW, uint64)
        kn = cuda.local.array(KW, uint64)        # the next chunk, in flight
        vn = cuda.local.array(KW, uint64)
        scale2 = scale * LOG2E   # scores in log2 units: exp(s - m) = exp2(s log2(e) - m log2(e))

        # NOTE: the first chunk's loads go out before pdl.grid_wait. A decode step's kernels write only the
        # newest key of each sequence (position ctx - 1, the QKV projection's RoPE + cache write); the block
        # table, the context lengths and every older key were written before the step began. So the table
        # entries and the K/V words of the older keys are read while the kernel before finishes (pdl.py,
        # rule 2), and the newest key, if it is among them, is loaded after the wait.
        b = b_begin + warp
        live = b < b_end
        phys = block_tables[seq, b] if live else 0
        load_keys(k_rows, v_rows, kvh, phys, b, 0, live, ctx - 1, kw, vw)
        b_next = b + NW
        live_next = b_next < b_end
        phys_next = block_tables[seq, b_next] if live_next else 0
        pdl.grid_wait()
        for u in range(U):
            off = u * KPW + slot
            if live and off < BS and b * BS + off == ctx - 1:
                row = uint64((phys * BS + off) * HKV + kvh)
                for i in range(WPL):
                    if EVEN or sub + LPK * i < WD:
                        kw[u * WPL + i] = k_rows[row, col + uint64(LPK * i)]
                        vw[u * WPL + i] = v_rows[row, col + uint64(LPK * i)]
        for h in range(HB):
            for i in range(WPL):
                w = sub + LPK * i
                for c in range(E):
                    value = float32(0)
                    if h < nh and (EVEN or w < WD):
                        value = scale2 * q[seq, h0 + h, E * w + c]
                    qr[(h * WPL + i) * E + c] = value
                    acc[(h * WPL + i) * E + c] = float32(0)
            m[h] = NEG_INF
            l[h] = float32(0)

        # Every warp makes the same number of steps (some on no block): the simulator's shuffles are block
        # barriers. On the GPU the loop bounds are warp-uniform, as the shuffles need.
        for t in range(NCH * ((b_end - b_begin + NW - 1) // NW)):
            c0 = (t % NCH) * CH
            if c0 + CH < BS:
                load_keys(k_rows, v_rows, kvh, phys, b, c0 + CH, live, ctx, kn, vn)
            else:
                # the next chunk is the first of the warp's next block (nothing to load past the last)
                load_keys(k_rows, v_rows, kvh, phys_next, b_next, 0, live_next, ctx, kn, vn)
            consume(kw, vw, b, c0, live, ctx, qr, acc, m, l, sc)
            for i in range(KW):
                kw[i] = kn[i]
                vw[i] = vn[i]
            if c0 + CH >= BS:
                b, live, phys = b_next, live_next, phys_next
                b_next = b + NW
                live_next = b_next < b_end
                phys_next = block_tables[seq, b_next] if live_next else 0

        state = warp * KPW + slot
        if sub == 0:
            for h in range(HB):
                sm[state * HB + h] = m[h]
                sl[state * HB + h] = l[h]
        for h in range(HB):
            for i in range(WPL):
                w = sub + LPK * i
                if EVEN or w < WD:
                    for c in range(E):
                        sacc[state * SS + h * D + E * w + c] = acc[(h * WPL + i) * E + c]
        cuda.syncthreads()

    @cuda.jit(device=True)
    def weigh(sm, sl, sw):
        """sw[state * HB + h] <- exp(m - M_h), M_h the block's max for head h (0 for a state without keys)."""
        for t in range(cuda.threadIdx.x, ML_SIZE, NT):
            h = t % HB
            big = NEG_INF
            for st in range(STATES):
                big = max(big, sm[st * HB + h])
            big_safe = big if big != NEG_INF else float32(0)
            sw[t] = math.exp2(sm[t] - big_safe)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def merged(sl, sacc, sw, h, dim):
        """The block's (sum, acc[dim]) of head h: the states rescaled to the common max and added."""
        total = float32(0)
        value = float32(0)
        for st in range(STATES):
            e = sw[st * HB + h]
            total += e * sl[st * HB + h]
            value += e * sacc[st * SS + h * D + dim]
        return total, value

    @cuda.jit
    def direct_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, v_scale, out):
        # q, out (S, Hq, D) f32; k_rows, v_rows (blocks * BS * HKV, D/E) u64, row (block * BS + offset) * HKV
        # + kv head; block_tables (S, max_blocks) i32; grid (S, HKV * C); scale includes fp8's k_scale
        pdl.launch_dependents()
        seq, kvh, h0, nh = seq_and_heads()
        sm = cuda.shared.array(ML_SIZE, float32)
        sl = cuda.shared.array(ML_SIZE, float32)
        sw = cuda.shared.array(ML_SIZE, float32)
        sacc = cuda.shared.array(ACC_SIZE, float32)
        ctx = context_lens[seq]   # a step input, read before the wait (see attend)
        attend(q, k_rows, v_rows, block_tables, seq, kvh, h0, nh, 0, table_blocks(ctx, block_tables), ctx,
               scale, sm, sl, sacc)
        weigh(sm, sl, sw)
        for t in range(cuda.threadIdx.x, nh * D, NT):
            h, dim = t // D, t % D
            total, value = merged(sl, sacc, sw, h, dim)
            out[seq, h0 + h, dim] = value / total * v_scale if total > float32(0) else float32(0)

    @cuda.jit
    def split_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, v_scale, partition_blocks, partial_out,
                     partial_max, partial_sum):
        # partial_out (S, Hq, P, D) f32 (times v_scale); partial_max, partial_sum (S, Hq, P) f32; grid (S, HKV * C, P),
        # partition p = KV blocks p * partition_blocks .. (p + 1) * partition_blocks - 1
        pdl.launch_dependents()
        seq, kvh, h0, nh = seq_and_heads()
        part = cuda.blockIdx.z
        ctx = context_lens[seq]   # a step input, read before the wait (see attend)
        b_begin = part * partition_blocks
        b_end = min(table_blocks(ctx, block_tables), b_begin + partition_blocks)
        if b_begin >= b_end:
            pdl.grid_wait()   # before the early return too (cuda_kernels/pdl.py, rule 1)
            return  # past the context: paged_attention_reduce_kernel never reads this partition
        sm = cuda.shared.array(ML_SIZE, float32)
        sl = cuda.shared.array(ML_SIZE, float32)
        sw = cuda.shared.array(ML_SIZE, float32)
        sacc = cuda.shared.array(ACC_SIZE, float32)
        attend(q, k_rows, v_rows, block_tables, seq, kvh, h0, nh, b_begin, b_end, ctx, scale, sm, sl, sacc)
        weigh(sm, sl, sw)
        for t in range(cuda.threadIdx.x, nh * D, NT):
            h, dim = t // D, t % D
            total, value = merged(sl, sacc, sw, h, dim)
            partial_out[seq, h0 + h, part, dim] = value * v_scale
            if dim == 0:
                big = NEG_INF
                for st in range(STATES):
                    big = max(big, sm[st * HB + h])
                partial_max[seq, h0 + h, part] = big * LN2   # back to natural units for the reduce
                partial_sum[seq, h0 + h, part] = total

    return direct_kernel, split_kernel


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
    d, block_size = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    if q.shape[0] == 0:
        return
    kernel = _walk_kernel(d, block_size, k_cache.shape[2], fmt)
    launch(kernel, (q.shape[0], q.shape[1]), WARP, stream, q, k_cache, v_cache, block_tables, context_lens,
           scale, v_scale, out)


def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0):
    """out (S, Hq, d) <- decode attention of each sequence's one query over its paged context (v1; bf16
    caches only)."""
    d, block_size = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
    kv_format.require_bf16(k_cache, "paged_attention_v1")
    if q.shape[0] == 0:
        return
    warps = decode_warps(d)
    kernel, _ = _decode_kernels(d, block_size, k_cache.shape[2], warps)
    launch(kernel, (q.shape[0], q.shape[1]), warps * WARP, stream, q, cache_rows(k_cache), cache_rows(v_cache),
           block_tables, context_lens, np.float32(scale), out)


def heads_per_block(group: int) -> int:
    """Query heads per block of the fast kernel: the group cut into the fewest chunks of <= MAX_BLOCK_HEADS,
    as even as they can be (a group of 6 is two blocks of 3, not 4 + 2)."""
    return -(-group // -(-group // MAX_BLOCK_HEADS))


def fast_warps(head_dim: int, group: int, lanes_per_key: int, most: int = MAX_WARPS) -> int:
    """Warps per block of the fast kernel: up to `most`, as many as their merge buffers fit in 48 KB."""
    heads = heads_per_block(group)
    per_warp = 4 * (WARP // lanes_per_key) * (heads * head_dim + 1 + 3 * heads)
    return max(1, min(most, SHARED_BUDGET // per_warp))


def _grid_blocks(num_seqs, num_heads, num_kv_heads):
    """Blocks of the fast kernel's grid per partition: (sequence, KV head, chunk of query heads)."""
    group = num_heads // num_kv_heads
    return int(num_seqs) * num_kv_heads * -(-group // heads_per_block(group))


def decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, lanes_per_key=LANES_PER_KEY) -> int:
    """Warps per block of the fast kernel by default: more for a grid that does not fill the SMs."""
    small = _grid_blocks(num_seqs, num_heads, num_kv_heads) <= SM_COUNT
    return fast_warps(head_dim, num_heads // num_kv_heads, lanes_per_key,
                      most=SMALL_GRID_WARPS if small else MAX_WARPS)


def decode_lanes_policy(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """Lanes per key of the fast kernel by default, from shapes only (max_blocks = block_tables.shape[1]):
    4 for a grid of at most TARGET_BLOCKS blocks whose warps each walk LONG_WALK_ROUNDS KV blocks or more
    (long contexts at mid-size batches), 8 otherwise (see the NOTE at LONG_WALK_ROUNDS)."""
    warps = decode_warps_policy(num_seqs, num_heads, num_kv_heads, head_dim, LANES_PER_KEY)
    parts, partition_blocks = decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps)
    blocks = parts * _grid_blocks(num_seqs, num_heads, num_kv_heads)
    long_walk = partition_blocks >= LONG_WALK_ROUNDS * warps
    return 4 if head_dim <= 64 and blocks <= TARGET_BLOCKS and long_walk else LANES_PER_KEY


def decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, warps):
    """(partitions, KV blocks per partition) of the fast kernel with a workspace and `warps` warps per block
    (decode_warps_policy), from shapes only: max_blocks = block_tables.shape[1]. No split (1 partition) while
    a warp walks at most SPLIT_ROUNDS KV blocks; else partitions of PARTITION_ROUNDS blocks per warp, at most
    as many as give the grid about TARGET_BLOCKS blocks."""
    width = max(int(max_blocks), 1)
    parts = 1
    if width > SPLIT_ROUNDS * warps:
        longest = -(-width // (PARTITION_ROUNDS * warps))
        wanted = -(-TARGET_BLOCKS // max(1, _grid_blocks(num_seqs, num_heads, num_kv_heads)))
        parts = max(1, min(longest, wanted))
    partition_blocks = -(-width // parts)
    return -(-width // partition_blocks), partition_blocks


def decode_workspace_size(max_num_seqs, num_heads, num_kv_heads, head_dim, max_blocks) -> int:
    """float32 elements of the fast kernel's workspace for every batch of up to max_num_seqs sequences and
    block tables up to max_blocks wide, at either lanes_per_key (the runner allocates it once;
    `paged_attention(..., workspace=)`)."""
    most = 0
    for s in range(1, int(max_num_seqs) + 1):
        for lanes in (4, 8):
            warps = decode_warps_policy(s, num_heads, num_kv_heads, head_dim, lanes)
            parts, _ = decode_partitions(s, num_heads, num_kv_heads, max_blocks, warps)
            if parts > 1:
                most = max(most, s * num_heads * parts * (head_dim + 2))
    return most


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0, *, workspace=None,
                    partition_blocks=None, lanes_per_key=None, warps=None, k_scale=1.0, v_scale=1.0):
    """out (S, Hq, d) <- decode attention of each sequence's one query over its paged context (fast kernel).

    The caches in any format of kv_format; k_scale, v_scale: the fp8 cache's per-tensor scales.
    workspace: a float32 device array of at least decode_workspace_size(...) elements, or None. With it the
    context is split into decode_partitions(...) partitions (from shapes only: CUDA-graph safe) and a second
    kernel merges them; without it one pass per (sequence, KV head), fine for big batches.
    partition_blocks, lanes_per_key, warps: override the policy (tests and benchmarks); any partition_blocks
    >= 1, lanes_per_key 4 or 8 and warps from 1 to what the shared memory holds are correct.
    NOTE: launched with PDL, so the kernel before it in the stream may still run while this one reads
    block_tables, context_lens and the K/V of every key but each sequence's newest (position
    context_len - 1): only that key may come from the kernel before (a decode step's QKV + RoPE)."""
    d, block_size = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    num_seqs, num_heads = q.shape[:2]
    num_kv_heads = k_cache.shape[2]
    max_blocks = max(block_tables.shape[1], 1)
    lanes = decode_lanes_policy(num_seqs, num_heads, num_kv_heads, d, max_blocks) if lanes_per_key is None \
        else lanes_per_key
    if lanes not in (4, 8):
        raise ValueError(f"lanes_per_key must be 4 or 8, got {lanes_per_key!r}")
    group = num_heads // num_kv_heads
    # NOTE: the split follows the policy's warps even when `warps` overrides them, so that the workspace
    # decode_workspace_size gives always suffices
    policy_warps = decode_warps_policy(num_seqs, num_heads, num_kv_heads, d, lanes)
    if partition_blocks is None:
        partition_blocks = max_blocks if workspace is None else \
            decode_partitions(num_seqs, num_heads, num_kv_heads, max_blocks, policy_warps)[1]
    if int(partition_blocks) != partition_blocks or partition_blocks < 1:
        raise ValueError(f"partition_blocks must be a positive int, got {partition_blocks!r}")
    parts = -(-max_blocks // int(partition_blocks))
    if parts > 1:
        partials = _carve(workspace, num_seqs, num_heads, parts, d)
    if num_seqs == 0:
        return
    if warps is None:
        warps = policy_warps
    elif not 1 <= warps <= fast_warps(d, group, lanes, most=FAST_WARPS_BY_FORMAT[fmt]):
        raise ValueError(f"warps must be 1 to {fast_warps(d, group, lanes, most=FAST_WARPS_BY_FORMAT[fmt])} for "
                         f"head_dim {d}, "
                         f"group {group}, {lanes} lanes per key; got {warps!r}")
    direct, split = _gqa_kernels(d, block_size, num_kv_heads, group, lanes, warps, fmt)
    grid = (num_seqs, num_kv_heads * -(-group // heads_per_block(group)))
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    if parts == 1:
        launch(direct, grid, warps * WARP, stream, q, k_rows, v_rows, block_tables, context_lens, scale, v_scale,
               out, dependent=True)
        return
    launch(split, grid + (parts,), warps * WARP, stream, q, k_rows, v_rows, block_tables, context_lens,
           scale, v_scale, int(partition_blocks), *partials, dependent=True)
    paged_attention_reduce(*partials, context_lens, int(partition_blocks) * block_size, out, stream)


def _carve(workspace, num_seqs, num_heads, parts, d):
    """(partial_out, partial_max, partial_sum) as views of the front of the flat workspace: no allocation."""
    n = num_seqs * num_heads * parts
    if workspace is None:
        raise ValueError(f"{parts} partitions need a workspace (see decode_workspace_size)")
    if workspace.ndim != 1 or workspace.dtype != np.float32 or workspace.shape[0] < n * (d + 2):
        raise ValueError(f"workspace: expected at least ({n * (d + 2)},) float32 for {parts} partitions, "
                         f"got {tuple(workspace.shape)} {workspace.dtype}")
    return (workspace[:n * d].reshape(num_seqs, num_heads, parts, d),
            workspace[n * d:n * (d + 1)].reshape(num_seqs, num_heads, parts),
            workspace[n * (d + 1):n * (d + 2)].reshape(num_seqs, num_heads, parts))


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
    d, block_size = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
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


def paged_attention_reduce(partial_out, partial_max, partial_sum, context_lens, partition_size, out, stream=0):
    """out (S, Hq, d) <- the split-K partials merged (the second kernel of paged_attention_split)."""
    if partial_out.ndim != 4 or partial_out.dtype != np.float32:
        raise ValueError(f"partial_out: expected (num_seqs, num_heads, partitions, head_dim) float32, "
                         f"got {tuple(partial_out.shape)} {partial_out.dtype}")
    s, hq, _, d = partial_out.shape
    _check_workspace(s, hq, d, partial_out, partial_max, partial_sum, partition_size)
    _expect("context_lens", context_lens, (s,), np.int32)
    _expect("out", out, (s, hq, d), np.float32)
    if s == 0:
        return
    launch(paged_attention_reduce_kernel, (s, hq), WARP, stream, partial_out, partial_max, partial_sum,
           context_lens, int(partition_size), out, dependent=True)


def _check_decode(q, k_cache, v_cache, block_tables, context_lens, out):
    d, block_size = check_cache_args(q, k_cache, v_cache, block_tables, context_lens)
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens: expected ({q.shape[0]},) int32 (one per query), "
                         f"got {tuple(context_lens.shape)}")
    _expect("out", out, q.shape, np.float32)
    return d, block_size


def _check_workspace(s, hq, d, partial_out, partial_max, partial_sum, partition_size):
    if int(partition_size) != partition_size or partition_size < 1:
        raise ValueError(f"partition_size must be a positive int, got {partition_size!r}")
    if partial_out.ndim != 4 or tuple(partial_out.shape[:2]) != (s, hq) or partial_out.shape[3] != d \
            or partial_out.dtype != np.float32:
        raise ValueError(f"partial_out: expected ({s}, {hq}, partitions, {d}) float32, "
                         f"got {tuple(partial_out.shape)} {partial_out.dtype}")
    _expect("partial_max", partial_max, partial_out.shape[:3], np.float32)
    _expect("partial_sum", partial_sum, partial_out.shape[:3], np.float32)
