"""PagedAttention for decode as the engine runs it: one block per (sequence, KV head[, partition]) serves all
the query heads of the group, so each K/V row is read from global memory once; K and V stay in registers,
several lanes share a key, and a long context is split into partitions (split-K). The versions it builds on
(a key at a time, tiles through shared memory, the first split-K and its reduce kernel, which this one
reuses) are in paged_attention.py.

For sequence s and query head h (KV head h // G, G = Hq / Hkv), over the keys j < context_len of the context:

    s_j = scale * <q, k_j>,      out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),   m = max_j s_j

computed with an online softmax: a walker keeps a running max m, a running sum l = sum exp(s_j - m) and an
unnormalised acc = sum exp(s_j - m) v_j, rescaled by exp(m - m') when a key raises the max to m'. Two such
states over disjoint keys merge into M = max(m1, m2), l = e1 l1 + e2 l2, acc = e1 acc1 + e2 acc2 with
e_i = exp(m_i - M): that is how the walkers of a block combine, and how the partitions do (in
paged_attention.paged_attention_reduce).

Shapes and dtypes:
    q             (S, Hq, d)              float32   one query per sequence, at position context_len - 1
    k/v_cache     (blocks, bs, Hkv, d)    format    uint16 bf16 bits, float32, or uint8 fp8 e4m3 bits
                                                    (cuda_kernels/kv_format.py); slots past a context are
                                                    never read
    block_tables  (S, max_blocks)         int32     token j in block block_tables[s, j // bs], offset j % bs
    context_lens  (S,)                    int32     0 marks a padding slot: its output is 0
    out           (S, Hq, d)              float32
    workspace     (n,)                    float32   the split's partials, carved from one buffer of
                                                    attention_policy.decode_workspace_size(...) floats
d must be a multiple of 8 and at most 128 (K/V are loaded 64 bits at a time: 4 bf16, 2 fp32 or 8 fp8).
Argument checks: attention_args.py. The cache's format is a compile-time choice of the kernel factory
(kv_format.codec: a 64-bit word's values); the fp8 cache's per-tensor scales are folded in by the launcher
(the score scale times k_scale, the output times v_scale).

`paged_attention`. Per key the work is fixed by the math: 2 d bf16 of K and V read, and for each of the G
query heads a d-long dot product, one exp and a d-long axpy. paged_attention_v1 adds to that, per head, a
shared-memory store and load of every K/V word and a 32-lane max per tile; this kernel removes both and
reads K/V once for all G heads.
    grid  = (S, Hkv * HEAD_CHUNKS, P): HEAD_CHUNKS = ceil(G / BLOCK_HEADS) chunks of BLOCK_HEADS <= 4 query
            heads per KV head (register budget), P partitions of the block table (P = 1: no workspace, the
            kernel writes out itself); WARPS, P and LANES_PER_KEY from shapes only, by the policies of
            attention_policy.py (8 warps and no split for a batch-1 decode graph up to 512 keys)
    block = WARPS warps; lane = slot * L + sub, L = LANES_PER_KEY (8, or 4): the L lanes of a slot share one
            key, lane sub owning 64-bit words sub, sub + L, ... of the K and V rows (4 bf16 each), so one
            warp load instruction reads 32 / L whole 32-byte sectors; the 32 / L slots take 32 / L keys.
    walk  : warp w takes KV blocks w, w + WARPS, ... of its partition (one block-table load per block of
            BLOCK_SIZE tokens, read a block ahead); a slot takes keys slot, slot + 32 / L, ... of the block,
            KEYS_PER_SLOT at a time: a chunk. Software-pipelined: the loads of the warp's next chunk are
            issued before the current chunk is consumed, into a second set of registers, so one is always in
            flight. The score of a key for head h is the lane's partial dot product (q times scale log2(e),
            held in registers) summed over the slot's L lanes with L-wide xor shuffles; every lane of the
            slot then has it. Under PDL the first chunk's table entry and K/V loads go out before the wait
            for the kernel before, all but the newest key's (see attend).
    state : per slot and head an online-softmax state (m, l, acc), acc over the lane's own dims: no
            cross-slot traffic in the loop; acc and l are rescaled only when a key raises m (rare after the
            first keys), instead of every tile.
    merge : every (warp, slot) writes its states to shared memory; one weight exp(m - M) per state, then
            thread t sums output (head, dim) pairs t, t + 32 WARPS, ... over the states. With P > 1 each
            block writes its partition's partial (max, sum, acc) instead, and
            paged_attention.paged_attention_reduce merges the partitions. Given a planes workspace, the
            kernel that writes out writes its bf16 planes too, for the O projection (cuda_kernels/planes.py).
Per key (G = 4, d = 64, L = 8), each of its 8 lanes: 4 64-bit loads, 16 bf16 unpacks, 32 + 32 FMA (scores,
P V), 12 shuffles and adds, 4 exp2 (one MUFU op each: scores are kept in log2 units): about 130 lane
instructions, so ~33 warp instructions per key for all 4 heads and 256 bytes of K/V read once; v1 spends
~25 per key per head (~100 for the group) and stages the same rows 4 times.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from cuda_kernels import kv_format, pdl
from cuda_kernels.attention import LOG2E, NEG_INF, SHARED_BUDGET, U64_ZERO
from cuda_kernels.attention_args import check_decode_args, folded_scales
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import WORD_ELEMS
from cuda_kernels.launch import launch
from cuda_kernels.planes import planes_output, planes_store
from cuda_kernels.paged_attention import MAX_WARPS, cache_rows, paged_attention_reduce
from cuda_kernels.primitives import FULL_MASK, WARP, exp2_ftz, fmax

LN2 = float32(math.log(2))
# Lanes sharing one key (LANES_PER_KEY): 8, or 4 (fewer instructions per key, more registers; registers per
# configuration: docs/performance.md, "decode attention"). attention_policy.decode_lanes_policy picks.
# 64-bit words of K (and of V) a lane loads per chunk of keys. The walk keeps two chunks in registers (one
# consumed, the next in flight). NOTE: 8 was the best or near it at every shape measured on the H200
# (docs/performance.md, "decode attention").
CHUNK_WORDS = 8
MAX_BLOCK_HEADS = 4                 # query heads one block of the fast kernel serves (registers: q and acc)
# The most warps a caller may ask for. NOTE: the register file (65,536 registers per SM) bounds a block too:
# at 12 warps every configuration fits, at 16 one does not (tools/offline_compile.py --attention-warps checks
# every configuration offline; the register counts are in docs/performance.md, "decode attention").
MAX_FAST_WARPS = 12
# NOTE: per KV format: every fp8 configuration fits at the warps its shared memory allows (up to 12), but an
# fp32 cache at head_dim 128, one query head per block and 4 lanes per key would not at its 11
# (docs/performance.md): fp32 is capped at 8 warps, which the policy never exceeds anyway.
FAST_WARPS_BY_FORMAT = {"bf16": MAX_FAST_WARPS, "fp8": MAX_FAST_WARPS, "fp32": 8}

# ---------------------------------------------------------------------------------------------------------
# device helpers and kernels


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
                 fmt: str = "bf16", pieces: int = 0):
    """(direct kernel, split kernel) of the fast decode attention for one configuration (see the module
    docstring). The direct kernel (grid z = 1) writes out, and with pieces 1 or 3 out's bf16 planes as well;
    the split kernel writes the partials of its partition, which paged_attention.paged_attention_reduce
    merges. fmt: the KV format (a word holds E = 4 bf16, 2 fp32 or 8 fp8 elements; everything below counts
    words)."""
    D, BLOCK_SIZE, HKV, G, LANES_PER_KEY, WARPS = head_dim, block_size, num_kv_heads, group, lanes_per_key, warps
    E = WORD_ELEMS[fmt]
    store_planes = planes_store(pieces)
    unpack = kv_format.codec(fmt)[2]
    THREADS = WARPS * WARP
    BLOCK_HEADS = heads_per_block(G)         # query heads per block
    HEAD_CHUNKS = -(-G // BLOCK_HEADS)       # blocks (head chunks) per KV head
    SLOTS = WARP // LANES_PER_KEY            # slots (keys in flight) per warp
    ROW_WORDS = D // E                       # 64-bit words (E elements) per K/V row
    WORDS_PER_LANE = -(-ROW_WORDS // LANES_PER_KEY)   # lane sub owns words sub, sub + LANES_PER_KEY, ...
    EVEN = ROW_WORDS % LANES_PER_KEY == 0    # every lane owns WORDS_PER_LANE words (else the last ones are masked)
    # keys per slot per chunk: CHUNK_WORDS words of K, of V
    KEYS_PER_SLOT = max(1, min(CHUNK_WORDS // WORDS_PER_LANE, -(-BLOCK_SIZE // SLOTS)))
    CHUNK_KEYS = KEYS_PER_SLOT * SLOTS       # keys per warp per chunk
    CHUNKS_PER_BLOCK = -(-BLOCK_SIZE // CHUNK_KEYS)   # chunks per KV block
    Q_PER_LANE = BLOCK_HEADS * WORDS_PER_LANE * E     # q values (and acc values) per lane
    # K words (and V words) per lane in a chunk (two chunks in registers)
    LANE_CHUNK_WORDS = KEYS_PER_SLOT * WORDS_PER_LANE
    STATES = WARPS * SLOTS                   # online-softmax states per head in a block, one per (warp, slot)
    STATE_STRIDE = BLOCK_HEADS * D + 1       # NOTE: odd stride between the states' acc rows: fewer bank conflicts
    ACC_SIZE = STATES * STATE_STRIDE         # (array sizes must be plain constants for numba, not expressions)
    ML_SIZE = STATES * BLOCK_HEADS

    @cuda.jit(device=True)
    def seq_and_heads():
        """(sequence, KV head, first query head, query heads) of this block."""
        kvh, chunk = cuda.blockIdx.y // HEAD_CHUNKS, cuda.blockIdx.y % HEAD_CHUNKS
        return cuda.blockIdx.x, kvh, kvh * G + chunk * BLOCK_HEADS, min(BLOCK_HEADS, G - chunk * BLOCK_HEADS)

    @cuda.jit(device=True)
    def table_blocks(ctx, block_tables):
        """KV blocks holding the context's keys (never past the block table, whatever context_lens says)."""
        return min(max(ctx + BLOCK_SIZE - 1, 0) // BLOCK_SIZE, block_tables.shape[1])

    @cuda.jit(device=True, inline=True)   # NOTE: inlined, so that kw and vw stay in registers
    def load_keys(k_rows, v_rows, kvh, phys, b, c0, live, limit, kw, vw):
        """Issue the loads of the lane's KEYS_PER_SLOT keys c0 + u * SLOTS + slot of KV block b (physical block
        phys): its words of their K and V rows, 0 for a key at or past `limit` (or past the block)."""
        lane = cuda.threadIdx.x % WARP
        # NOTE: unsigned indices (primitives' module docstring, "Index arithmetic")
        slot, col = lane // LANES_PER_KEY, uint64(lane % LANES_PER_KEY)
        for u in range(KEYS_PER_SLOT):
            off = c0 + u * SLOTS + slot
            ok = live and off < BLOCK_SIZE and b * BLOCK_SIZE + off < limit
            row = uint64((phys * BLOCK_SIZE + off) * HKV + kvh)
            for i in range(WORDS_PER_LANE):
                # NOTE: mask before the load: a slot past the context may hold anything (NaN in the tests)
                # and 0 * NaN is NaN, so it is never read.
                if ok and (EVEN or lane % LANES_PER_KEY + LANES_PER_KEY * i < ROW_WORDS):
                    kw[u * WORDS_PER_LANE + i] = k_rows[row, col + uint64(LANES_PER_KEY * i)]
                    vw[u * WORDS_PER_LANE + i] = v_rows[row, col + uint64(LANES_PER_KEY * i)]
                else:
                    kw[u * WORDS_PER_LANE + i] = U64_ZERO
                    vw[u * WORDS_PER_LANE + i] = U64_ZERO

    @cuda.jit(device=True, inline=True)   # NOTE: inlined, so that every local array stays in registers
    def consume(kw, vw, b, c0, live, ctx, qr, acc, m, l, sc):
        """Fold the lane's KEYS_PER_SLOT keys c0 + u * SLOTS + slot of KV block b (their words in kw, vw) into
        its online-softmax states (m, l, acc) of the block's heads."""
        lane = cuda.threadIdx.x % WARP
        slot = lane // LANES_PER_KEY
        for u in range(KEYS_PER_SLOT):
            # Scores: the lane's share of each dot product (fp32, one FMA per product), then the slot's sum.
            for h in range(BLOCK_HEADS):
                sc[h] = float32(0)
            for i in range(WORDS_PER_LANE):
                kx = unpack(kw[u * WORDS_PER_LANE + i])
                for h in range(BLOCK_HEADS):
                    e = (h * WORDS_PER_LANE + i) * E
                    dot = sc[h]
                    for c in range(E):
                        dot += qr[e + c] * kx[c]
                    sc[h] = dot
            for h in range(BLOCK_HEADS):
                sc[h] = slot_sum(sc[h], LANES_PER_KEY)
            off = c0 + u * SLOTS + slot
            if live and off < BLOCK_SIZE and b * BLOCK_SIZE + off < ctx:
                for h in range(BLOCK_HEADS):
                    score = sc[h]
                    if score > m[h]:
                        # NOTE: rescale only when the max grows (m = -inf at first: c = 0, and l and acc are
                        # still 0), not once per key.
                        c = exp2_ftz(m[h] - score)
                        l[h] *= c
                        for a in range(WORDS_PER_LANE * E):
                            acc[h * WORDS_PER_LANE * E + a] *= c
                        m[h] = score
                    p = exp2_ftz(score - m[h])
                    l[h] += p
                    sc[h] = p
                for i in range(WORDS_PER_LANE):
                    vx = unpack(vw[u * WORDS_PER_LANE + i])
                    for h in range(BLOCK_HEADS):
                        e = (h * WORDS_PER_LANE + i) * E
                        for c in range(E):
                            acc[e + c] += sc[h] * vx[c]

    @cuda.jit(device=True)
    def attend(q, k_rows, v_rows, block_tables, seq, kvh, h0, nh, b_begin, b_end, ctx, scale, sm, sl, sacc):
        """Walk KV blocks b_begin .. b_end - 1 of sequence seq for query heads h0 .. h0 + nh - 1; leaves each
        (warp, slot) state in shared memory: m in sm, l in sl, acc in sacc (row (warp * SLOTS + slot) *
        STATE_STRIDE, head h at h * D). Executes pdl.grid_wait() after the first loads (see below).

        The walk is software-pipelined: a warp's keys come in chunks of CHUNK_KEYS (CHUNKS_PER_BLOCK chunks per
        KV block, the warp's blocks b_begin + warp, + WARPS, ...), and the loads of chunk t + 1 are issued
        before chunk t is consumed, into a second set of registers (kn, vn), so a lane always has a chunk's K/V
        words in flight while it computes. The block-table entry of the warp's next block is read one block
        ahead."""
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        slot, sub = lane // LANES_PER_KEY, lane % LANES_PER_KEY
        col = uint64(sub)
        qr = cuda.local.array(Q_PER_LANE, float32)   # q of the block's heads at the lane's dims, times scale log2(e)
        acc = cuda.local.array(Q_PER_LANE, float32)
        m = cuda.local.array(BLOCK_HEADS, float32)
        l = cuda.local.array(BLOCK_HEADS, float32)
        sc = cuda.local.array(BLOCK_HEADS, float32)
        kw = cuda.local.array(LANE_CHUNK_WORDS, uint64)   # the chunk being consumed
        vw = cuda.local.array(LANE_CHUNK_WORDS, uint64)
        kn = cuda.local.array(LANE_CHUNK_WORDS, uint64)   # the next chunk, in flight
        vn = cuda.local.array(LANE_CHUNK_WORDS, uint64)
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
        b_next = b + WARPS
        live_next = b_next < b_end
        phys_next = block_tables[seq, b_next] if live_next else 0
        pdl.grid_wait()
        for u in range(KEYS_PER_SLOT):
            off = u * SLOTS + slot
            if live and off < BLOCK_SIZE and b * BLOCK_SIZE + off == ctx - 1:
                row = uint64((phys * BLOCK_SIZE + off) * HKV + kvh)
                for i in range(WORDS_PER_LANE):
                    if EVEN or sub + LANES_PER_KEY * i < ROW_WORDS:
                        kw[u * WORDS_PER_LANE + i] = k_rows[row, col + uint64(LANES_PER_KEY * i)]
                        vw[u * WORDS_PER_LANE + i] = v_rows[row, col + uint64(LANES_PER_KEY * i)]
        for h in range(BLOCK_HEADS):
            for i in range(WORDS_PER_LANE):
                w = sub + LANES_PER_KEY * i
                for c in range(E):
                    value = float32(0)
                    if h < nh and (EVEN or w < ROW_WORDS):
                        value = scale2 * q[seq, h0 + h, E * w + c]
                    qr[(h * WORDS_PER_LANE + i) * E + c] = value
                    acc[(h * WORDS_PER_LANE + i) * E + c] = float32(0)
            m[h] = NEG_INF
            l[h] = float32(0)

        # Every warp makes the same number of steps (some on no block): the simulator's shuffles are block
        # barriers. On the GPU the loop bounds are warp-uniform, as the shuffles need.
        for t in range(CHUNKS_PER_BLOCK * ((b_end - b_begin + WARPS - 1) // WARPS)):
            c0 = (t % CHUNKS_PER_BLOCK) * CHUNK_KEYS
            if c0 + CHUNK_KEYS < BLOCK_SIZE:
                load_keys(k_rows, v_rows, kvh, phys, b, c0 + CHUNK_KEYS, live, ctx, kn, vn)
            else:
                # the next chunk is the first of the warp's next block (nothing to load past the last)
                load_keys(k_rows, v_rows, kvh, phys_next, b_next, 0, live_next, ctx, kn, vn)
            consume(kw, vw, b, c0, live, ctx, qr, acc, m, l, sc)
            for i in range(LANE_CHUNK_WORDS):
                kw[i] = kn[i]
                vw[i] = vn[i]
            if c0 + CHUNK_KEYS >= BLOCK_SIZE:
                b, live, phys = b_next, live_next, phys_next
                b_next = b + WARPS
                live_next = b_next < b_end
                phys_next = block_tables[seq, b_next] if live_next else 0

        # (unsigned shared-memory indices here and in the merge: no wraparound test and select per access)
        state = uint32(warp * SLOTS + slot)
        if sub == 0:
            for h in range(BLOCK_HEADS):
                sm[state * uint32(BLOCK_HEADS) + uint32(h)] = m[h]
                sl[state * uint32(BLOCK_HEADS) + uint32(h)] = l[h]
        for h in range(BLOCK_HEADS):
            for i in range(WORDS_PER_LANE):
                w = uint32(sub + LANES_PER_KEY * i)
                if EVEN or w < uint32(ROW_WORDS):
                    for c in range(E):
                        sacc[state * uint32(STATE_STRIDE) + uint32(h * D + c) + uint32(E) * w] = \
                            acc[(h * WORDS_PER_LANE + i) * E + c]
        cuda.syncthreads()

    @cuda.jit(device=True)
    def weigh(sm, sl, sw):
        """sw[state * BLOCK_HEADS + h] <- exp(m - M_h), M_h the block's max for head h (0 for a state without
        keys)."""
        for i in range(cuda.threadIdx.x, ML_SIZE, THREADS):
            t = uint32(i)
            h = t % uint32(BLOCK_HEADS)
            big = NEG_INF
            for st in range(STATES):
                big = fmax(big, sm[uint32(st * BLOCK_HEADS) + h])
            big_safe = big if big != NEG_INF else float32(0)
            sw[t] = exp2_ftz(sm[t] - big_safe)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def merged(sl, sacc, sw, h, dim):
        """The block's (sum, acc[dim]) of head h: the states rescaled to the common max and added (h and dim
        unsigned)."""
        total = float32(0)
        value = float32(0)
        for st in range(STATES):
            e = sw[uint32(st * BLOCK_HEADS) + h]
            total += e * sl[uint32(st * BLOCK_HEADS) + h]
            value += e * sacc[uint32(st * STATE_STRIDE) + h * uint32(D) + dim]
        return total, value

    @cuda.jit
    def direct_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, v_scale, out, planes):
        # q, out (S, Hq, D) f32; k_rows, v_rows (blocks * BLOCK_SIZE * HKV, D/E) u64, row (block * BLOCK_SIZE
        # + offset) * HKV + kv head; block_tables (S, max_blocks) i32; grid (S, HKV * HEAD_CHUNKS); scale
        # includes fp8's k_scale; planes (>= pieces * S * Hq * D,) u16: out's bf16 planes (unused for pieces 0)
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
        size = out.shape[0] * out.shape[1] * D
        for t in range(cuda.threadIdx.x, nh * D, THREADS):
            h, dim = uint32(t) // uint32(D), uint32(t) % uint32(D)
            total, value = merged(sl, sacc, sw, h, dim)
            result = value / total * v_scale if total > float32(0) else float32(0)
            head = uint32(h0) + h
            out[uint32(seq), head, dim] = result
            store_planes(planes, size, (uint32(seq) * uint32(out.shape[1]) + head) * uint32(D) + dim, result)

    @cuda.jit
    def split_kernel(q, k_rows, v_rows, block_tables, context_lens, scale, v_scale, partition_blocks, partial_out,
                     partial_max, partial_sum):
        # partial_out (S, Hq, P, D) f32 (times v_scale); partial_max, partial_sum (S, Hq, P) f32; grid
        # (S, HKV * HEAD_CHUNKS, P), partition p = KV blocks p * partition_blocks .. (p + 1) * partition_blocks - 1
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
        for t in range(cuda.threadIdx.x, nh * D, THREADS):
            h, dim = uint32(t) // uint32(D), uint32(t) % uint32(D)
            total, value = merged(sl, sacc, sw, h, dim)
            head = uint32(h0) + h
            partial_out[uint32(seq), head, uint32(part), dim] = value * v_scale
            if dim == 0:
                big = NEG_INF
                for st in range(STATES):
                    big = fmax(big, sm[uint32(st * BLOCK_HEADS) + h])
                partial_max[uint32(seq), head, uint32(part)] = big * LN2   # back to natural units for the reduce
                partial_sum[uint32(seq), head, uint32(part)] = total

    return direct_kernel, split_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def heads_per_block(group: int) -> int:
    """Query heads per block of the fast kernel: the group cut into the fewest chunks of <= MAX_BLOCK_HEADS,
    as even as they can be (a group of 6 is two blocks of 3, not 4 + 2)."""
    return -(-group // -(-group // MAX_BLOCK_HEADS))


def fast_warps(head_dim: int, group: int, lanes_per_key: int, most: int = MAX_WARPS) -> int:
    """Warps per block of the fast kernel: up to `most`, as many as their merge buffers fit in 48 KB."""
    heads = heads_per_block(group)
    per_warp = 4 * (WARP // lanes_per_key) * (heads * head_dim + 1 + 3 * heads)
    return max(1, min(most, SHARED_BUDGET // per_warp))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out, stream=0, *, lanes_per_key, warps,
                    partition_blocks=None, workspace=None, k_scale=1.0, v_scale=1.0, planes=None,
                    bf16_inputs: bool = False):
    """out (S, Hq, d) <- decode attention of each sequence's one query over its paged context (fast kernel).

    The caches in any format of kv_format; k_scale, v_scale: the fp8 cache's per-tensor scales.
    The configuration is the caller's (attention_policy.decode_attention, the engine's entry point, picks it
    from the shapes); every valid one is correct:
    lanes_per_key: 4 or 8 lanes share a key. warps: per block, 1 to fast_warps(d, G, lanes_per_key,
    FAST_WARPS_BY_FORMAT[format]). partition_blocks: KV blocks per partition of the split, any int >= 1: the
    block table is cut into P = ceil(max_blocks / partition_blocks) partitions whose partials go to workspace
    (a float32 device array of at least S * Hq * P * (d + 2) elements) and a second kernel merges them; None,
    or P = 1: one pass, no workspace needed.
    planes: out's bf16 planes as well, written by whichever kernel writes out, into this uint16 workspace
    (planes.planes_output: one plane, rounded, with bf16_inputs, else the three of the bf16x3 split), so that the O
    projection that follows needs no conversion kernel.
    NOTE: launched with PDL, so the kernel before it in the stream may still run while this one reads
    block_tables, context_lens and the K/V of every key but each sequence's newest (position
    context_len - 1): only that key may come from the kernel before (a decode step's QKV + RoPE)."""
    d, block_size = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    fmt, scale, v_scale = folded_scales(k_cache, scale, k_scale, v_scale)
    num_seqs, num_heads = q.shape[:2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if lanes_per_key not in (4, 8):
        raise ValueError(f"lanes_per_key must be 4 or 8, got {lanes_per_key!r}")
    most = fast_warps(d, group, lanes_per_key, most=FAST_WARPS_BY_FORMAT[fmt])
    if not 1 <= warps <= most:
        raise ValueError(f"warps must be 1 to {most} for head_dim {d}, group {group}, {lanes_per_key} lanes per "
                         f"key; got {warps!r}")
    max_blocks = max(block_tables.shape[1], 1)
    if partition_blocks is None:
        partition_blocks = max_blocks
    if int(partition_blocks) != partition_blocks or partition_blocks < 1:
        raise ValueError(f"partition_blocks must be a positive int, got {partition_blocks!r}")
    parts = -(-max_blocks // int(partition_blocks))
    if parts > 1:
        partials = _carve(workspace, num_seqs, num_heads, parts, d)
    pieces, planes_arg = planes_output(planes, out, bf16_inputs)
    if num_seqs == 0:
        return
    direct = _gqa_kernels(d, block_size, num_kv_heads, group, lanes_per_key, warps, fmt, pieces)[0]
    split = _gqa_kernels(d, block_size, num_kv_heads, group, lanes_per_key, warps, fmt)[1]   # (writes no planes)
    grid = (num_seqs, num_kv_heads * -(-group // heads_per_block(group)))
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    if parts == 1:
        launch(direct, grid, warps * WARP, stream, q, k_rows, v_rows, block_tables, context_lens, scale, v_scale,
               out, planes_arg, dependent=True)
        return
    launch(split, grid + (parts,), warps * WARP, stream, q, k_rows, v_rows, block_tables, context_lens,
           scale, v_scale, int(partition_blocks), *partials, dependent=True)
    paged_attention_reduce(*partials, context_lens, int(partition_blocks) * block_size, out, stream, planes,
                           bf16_inputs)


def _carve(workspace, num_seqs, num_heads, parts, d):
    """(partial_out, partial_max, partial_sum) as views of the front of the flat workspace: no allocation."""
    n = num_seqs * num_heads * parts
    if workspace is None:
        raise ValueError(f"{parts} partitions need a workspace (see attention_policy.decode_workspace_size)")
    if workspace.ndim != 1 or workspace.dtype != np.float32 or workspace.shape[0] < n * (d + 2):
        raise ValueError(f"workspace: expected at least ({n * (d + 2)},) float32 for {parts} partitions, "
                         f"got {tuple(workspace.shape)} {workspace.dtype}")
    return (workspace[:n * d].reshape(num_seqs, num_heads, parts, d),
            workspace[n * d:n * (d + 1)].reshape(num_seqs, num_heads, parts),
            workspace[n * (d + 1):n * (d + 2)].reshape(num_seqs, num_heads, parts))
