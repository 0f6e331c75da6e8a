"""Causal prefill attention on tensor cores, pipelined: attention_tc.py's flash kernel with the next K/V tile
on its way into shared memory while the warps multiply the current one, and every mma operand gathered from
shared memory by ldmatrix.

Math, arguments, result and numerics are those of attention_tc.prefill_attention_tc (its module docstring):
for each query row, s_j = scale <q, k_j> over the keys it may see, online softmax, out = sum_j p_j v_j /
sum_j p_j; Q and P in three bf16 pieces each (every product exact, fp32 sums), K and V bf16 (an fp8 cache's
e4m3 values widened to bf16, exactly).

What changes over attention_tc, and why:
- Two shared-memory stages for K/V tiles. Tile i + 1 is issued into the other stage before the warps multiply
  tile i; with a bf16 cache the copies are cp.async (cuda_kernels/async_copy.py: 16 bytes from global to shared
  memory without registers), so the cache's latency hides behind the mma work. attention_tc loads a tile,
  stores it, waits at a barrier and only then multiplies: every tile pays the full memory latency, and its
  few warps per SM cannot cover it. An fp8 cache is widened on the way (not a copy): the threads load,
  convert and store its next tile into the other stage, so only its stores wait.
- K and V keep the cache's layout in shared memory, a key's D elements in a row and the keys in order, so
  a 16-byte copy lands as it is, and ldmatrix gathers the fragments: a K row is a column of the B operand of
  S = Q K^T (k = dim, n = key), what the plain ldmatrix gives; V is the B operand of P V with k = key, what
  ldmatrix .trans gives; Q's three pieces are staged once as rows, the A operand. The keys of S's n8 tile j
  are 8 j .. 8 j + 7 in order, and the accumulators of tiles 2 s and 2 s + 1 are P's A fragment of key step
  s as they stand (FlashAttention-2's register trick) without attention_tc's key permutation and 4 x 4
  transposes.

Thread mapping: grid = (S, ceil(max_q_len * G / ROWS), Hkv) with ROWS = 16 * WARPS (attention.row_tile: a
block owns ROWS (query token, query head of the group) rows of one sequence and KV head); warp w owns rows
16 w .. 16 w + 15 of the block, lane (g, t) = (lane // 4, lane % 4) rows g and g + 8 and columns 2t, 2t + 1 of
each n8 tile (mma.py's layout). Dynamic shared memory, uint16, every row LD = D + 8 elements long (the 8 rows
an ldmatrix matrix reads fall in 8 different 16-byte bank groups): Q's pieces (3 planes of ROWS rows), then
two stages of TILE_KEYS K rows followed by TILE_KEYS V rows. Staging, thread i takes the chunks i, i +
THREADS, ... of a tile (chunk c of row r: elements 8 c .. 8 c + 7 of key t0 + r; fp8: quads of 4), and
writes zeros for keys at or past the last one the block may see (cp.async with a source size of 0): a slot
past a context may hold NaN, and 0 * NaN is NaN.

The step of the prefill ladder after attention_tc (attention.py: naive, then flash in fp32 on CUDA cores;
attention_tc.py: flash on tensor cores).
"""

from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from cuda_kernels.async_copy import CHUNK, cp_async_16, cp_async_commit, cp_async_wait, ldmatrix_x4, \
    ldmatrix_x4_trans
from cuda_kernels.attention import NEG_INF, row_tile
from cuda_kernels.attention_tc import check_tc_args, online_softmax_step, output_store, p_pieces
from cuda_kernels.kv_format import e4m3x4_to_bf16x4
from cuda_kernels.launch import launch, view
from cuda_kernels.mma import mma_bf16_m16n8k16, split_bf16x3
from cuda_kernels.primitives import WARP

_MASK16 = np.uint64(0xFFFF)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shared_bytes(head_dim: int, warps: int, keys_per_tile: int) -> int:
    """Dynamic shared memory of a block: Q's 3 planes of 16 * warps rows and 2 stages of K and V tiles."""
    return (3 * 16 * warps + 2 * 2 * keys_per_tile) * (head_dim + CHUNK) * 2


# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _kernel(head_dim: int, block_size: int, group: int, warps: int, keys: int, fmt: str = "bf16"):
    """The pipelined tensor-core flash kernel: `group` query heads per KV head, `warps` warps of 16 query rows
    each, K/V tiles of `keys` keys, fmt "bf16" (cp.async copies of the cache's rows) or "fp8" (quads of e4m3
    widened to bf16 as staged)."""
    # NOTE: the group is a compile-time constant here (attention_tc's kernel reads it from q's shape): a row's
    # token and head are row // G and row % G, and by a run-time G those are 64-bit divisions, tens of
    # instructions each, for every quad of Q staged and every output row.
    D, BLOCK_SIZE, GROUP, WARPS, TILE_KEYS = head_dim, block_size, group, warps, keys
    ROWS = 16 * WARPS
    THREADS = WARPS * WARP
    LD = D + CHUNK                       # shared row length (elements)
    Q_PLANE = ROWS * LD
    TILE = TILE_KEYS * LD                # one K or one V tile
    KV_BASE = 3 * Q_PLANE                # stage s: K tile at KV_BASE + 2 s TILE, V tile right after
    DIM_STEPS = D // 16                  # mma k-steps of S = Q K^T
    DIM_TILES = D // 8                   # n8 tiles of O = P V
    KEY_TILES = TILE_KEYS // 8           # n8 tiles of S
    KEY_STEPS = TILE_KEYS // 16          # mma k-steps of P V
    ASYNC = fmt == "bf16"
    # bf16: 16-byte chunks (8 elements) per row; fp8: uint32 quads (4 elements) per row
    ROW_PIECES = D // CHUNK if ASYNC else D // 4
    PIECE = CHUNK if ASYNC else 4
    PER_THREAD = _cdiv(TILE_KEYS * ROW_PIECES, THREADS)
    Q_QUADS = ROWS * (D // 4)
    Q_PER_THREAD = _cdiv(Q_QUADS, THREADS)
    SACC = KEY_TILES * 4
    OACC = DIM_TILES * 4
    wait_all = cp_async_wait(0)
    softmax_step = online_softmax_step(KEY_TILES, DIM_TILES)
    store_output = output_store(DIM_TILES)

    @cuda.jit(device=True, inline=True)
    def piece_offset(i):
        """Staging piece i's offset in a shared tile: row i // ROW_PIECES, piece i % ROW_PIECES of it."""
        return (i // ROW_PIECES) * LD + PIECE * (i % ROW_PIECES)

    @cuda.jit(device=True, inline=True)
    def piece_source(block_tables, seq, kvh, kv_heads, t0, k_end, i):
        """(shared offset in a tile, flat index in the cache, valid) of staging piece i of the tile at t0.
        NOTE: unsigned arithmetic: with signed indices every // and % of a key by the block size takes a
        floor fix-up and every array index a wraparound check: about 60 instructions a piece, which were a
        third of the key-tile loop's instructions."""
        r, c = uint32(i) // uint32(ROW_PIECES), uint32(i) % uint32(ROW_PIECES)
        key = uint32(t0) + r
        src = uint64(0)
        valid = r < uint32(TILE_KEYS) and key < uint32(k_end)
        if valid:
            blk = uint64(block_tables[uint32(seq), key // uint32(BLOCK_SIZE)])
            slot = blk * uint64(BLOCK_SIZE) + uint64(key % uint32(BLOCK_SIZE))
            src = (slot * uint64(kv_heads) + uint64(kvh)) * uint64(ROW_PIECES) + uint64(c)
        return piece_offset(i), src, valid

    @cuda.jit(device=True, inline=True)
    def issue_tiles(sh, base, k_words, v_words, block_tables, seq, kvh, kv_heads, t0, k_end, tid):
        """Stage the K tile (keys t0 ..) at sh[base:] and the V tile of the same keys at sh[base + TILE:]:
        cp.async of 16-byte chunks (bf16), or loads, the e4m3 -> bf16 widening and stores (fp8; all loads
        issued before the first store). Each piece's source is found once for both."""
        if ASYNC:
            for n in range(PER_THREAD):
                i = tid + n * THREADS
                if i < TILE_KEYS * ROW_PIECES:
                    d, src, valid = piece_source(block_tables, seq, kvh, kv_heads, t0, k_end, i)
                    cp_async_16(sh, base + d, k_words, src * uint64(CHUNK), valid)
                    cp_async_16(sh, base + TILE + d, v_words, src * uint64(CHUNK), valid)
        else:
            loaded = cuda.local.array((2, PER_THREAD), uint32)
            for n in range(PER_THREAD):
                d, src, valid = piece_source(block_tables, seq, kvh, kv_heads, t0, k_end, tid + n * THREADS)
                loaded[0, n] = k_words[src] if valid else uint32(0)
                loaded[1, n] = v_words[src] if valid else uint32(0)
            for n in range(PER_THREAD):
                i = tid + n * THREADS
                if i < TILE_KEYS * ROW_PIECES:
                    d = piece_offset(i)   # (the block table was read with the loads)
                    for kv in range(2):
                        x = e4m3x4_to_bf16x4(loaded[kv, n])
                        for e in range(4):
                            sh[base + kv * TILE + d + e] = uint16((x >> uint64(16 * e)) & _MASK16)

    @cuda.jit
    def prefill_tc_pipelined_kernel(q, k_words, v_words, block_tables, cu_seqlens_q, context_lens, scale, v_scale,
                                    out):
        # q, out (T, Hq, D) f32; k_words, v_words: the caches flat, bf16 as uint16 elements (fp8: uint32 quads)
        sh = cuda.shared.array(0, uint16)
        seq, kv_heads = cuda.blockIdx.x, cuda.gridDim.z
        kvh, q_begin, n_rows, row0, first, k_end = row_tile(GROUP, kv_heads, cu_seqlens_q, context_lens, ROWS)
        if row0 >= n_rows:
            return  # the whole block leaves together, before any barrier
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        g, t = lane // 4, lane % 4
        diag = first + row0 // GROUP                       # tiles with a key past this need the mask
        pos_lo = first + (row0 + 16 * warp + g) // GROUP   # positions of this lane's rows g and g + 8
        pos_hi = first + (row0 + 16 * warp + g + 8) // GROUP
        tiles = (k_end + TILE_KEYS - 1) // TILE_KEYS

        # The first tile's copies go out first, so that they are in flight while the threads split Q into its
        # pieces and store them: quad i is dims 4 (i % (D/4)) .. + 3 of block row i // (D/4); rows past n_rows
        # are zeros. (Unsigned indices, as in piece_source.)
        issue_tiles(sh, KV_BASE, k_words, v_words, block_tables, seq, kvh, kv_heads, 0, k_end, tid)
        cp_async_commit()
        for n in range(Q_PER_THREAD):
            i = tid + n * THREADS
            if i < Q_QUADS:
                r, dim = uint32(i) // uint32(D // 4), uint32(4) * (uint32(i) % uint32(D // 4))
                row = uint32(row0) + r
                token = uint32(q_begin) + row // uint32(GROUP)
                head = uint32(kvh) * uint32(GROUP) + row % uint32(GROUP)
                at = r * uint32(LD) + dim
                for e in range(4):
                    x = float32(0)
                    if row < uint32(n_rows):
                        x = q[token, head, dim + uint32(e)]
                    hi, mid, lo = split_bf16x3(x)
                    sh[at + uint32(e)] = uint16(hi)
                    sh[at + uint32(Q_PLANE + e)] = uint16(mid)
                    sh[at + uint32(2 * Q_PLANE + e)] = uint16(lo)

        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        bk = cuda.local.array((KEY_TILES, 2), uint32)
        m = cuda.local.array(2, float32)         # running max of rows g, g + 8 (equal in the 4 lanes)
        l = cuda.local.array(2, float32)         # this lane's share of their running sums
        for i in range(OACC):
            oacc[i] = float32(0)
        for half in range(2):
            m[half] = NEG_INF
            l[half] = float32(0)
        # this lane's ldmatrix rows (async_copy.py): A row 16 w + l % 16 at k + 8 (l // 16); K (B of S) key
        # row (l % 8) + 8 (l // 16) at dim + 8 ((l // 8) % 2); V (B of P V, transposed) key row (l % 8) + 8
        # ((l // 8) % 2) at dim + 8 (l // 16)
        a_lane = (16 * warp + lane % 16) * LD + 8 * (lane // 16)
        k_lane = (lane % 8 + 8 * (lane // 16)) * LD + 8 * ((lane // 8) % 2)
        v_lane = (lane % 8 + 8 * ((lane // 8) % 2)) * LD + 8 * (lane // 16)

        for it in range(tiles):
            t0 = it * TILE_KEYS
            wait_all()           # this thread's copies of tile `it` have landed
            cuda.syncthreads()   # everyone's have (and Q's pieces); every warp is done with tile it - 1
            if it + 1 < tiles:   # tile it + 1 into the stage tile it - 1 used
                nxt = KV_BASE + 2 * TILE * ((it + 1) % 2)
                issue_tiles(sh, nxt, k_words, v_words, block_tables, seq, kvh, kv_heads, t0 + TILE_KEYS, k_end, tid)
            cp_async_commit()
            kt = KV_BASE + 2 * TILE * (it % 2)
            vt = kt + TILE

            # S = Q K^T (16 rows x TILE_KEYS keys per warp): per dim step, the B fragments of every key tile,
            # then 3 mma (Q's pieces) per key tile.
            for i in range(SACC):
                sacc[i] = float32(0)
            for s in range(DIM_STEPS):
                for jj in range(KEY_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(sh, kt + 16 * jj * LD + 16 * s + k_lane)
                    bk[2 * jj, 0], bk[2 * jj, 1], bk[2 * jj + 1, 0], bk[2 * jj + 1, 1] = b0, b1, b2, b3
                for p in range(3):
                    a0, a1, a2, a3 = ldmatrix_x4(sh, p * Q_PLANE + 16 * s + a_lane)
                    for j in range(KEY_TILES):
                        sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, bk[j, 0], bk[j, 1],
                            sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3])

            # Online softmax. Element (j, c) of this lane is row g (c < 2) or g + 8, key t0 + 8 j + 2 t + c % 2.
            # NOTE: the mask in a branch of its own (block-uniform), not a select per score: only the diagonal
            # tile(s), where some key lies past some row's position, pay for it. The scale goes into the
            # softmax's exponent (one FFMA a score).
            if t0 + TILE_KEYS - 1 > diag:
                for j in range(KEY_TILES):
                    for c in range(4):
                        if t0 + 8 * j + 2 * t + c % 2 > (pos_lo if c < 2 else pos_hi):
                            sacc[4 * j + c] = NEG_INF
            softmax_step(sacc, m, l, oacc, scale)

            # O += P V: key step s's A fragment is S's tiles 2 s (a0, a1) and 2 s + 1 (a2, a3), in three bf16
            # pieces; V's B fragments of two dim tiles per ldmatrix .trans.
            for s in range(KEY_STEPS):
                h0, h1, h2, h3, d0, d1, d2, d3, l0, l1, l2, l3 = p_pieces(sacc, s)
                for jj in range(DIM_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(sh, vt + 16 * s * LD + 16 * jj + v_lane)
                    for p in range(3):
                        if p == 0:
                            a0, a1, a2, a3 = h0, h1, h2, h3
                        elif p == 1:
                            a0, a1, a2, a3 = d0, d1, d2, d3
                        else:
                            a0, a1, a2, a3 = l0, l1, l2, l3
                        j = 2 * jj
                        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b0, b1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])
                        j = 2 * jj + 1
                        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_bf16_m16n8k16(
                            a0, a1, a2, a3, b2, b3, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])

        # Epilogue: the row sums across the group's 4 lanes, then out = O / l.
        store_output(out, oacc, l, v_scale, q_begin, kvh, GROUP, n_rows, row0 + 16 * warp + g, t)

    return prefill_tc_pipelined_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def prefill_attention_tc_pipelined(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                                   max_q_len, stream=0, *, warps, keys_per_tile, k_scale=1.0, v_scale=1.0):
    """attention.prefill_attention on tensor cores, pipelined (same arguments and result; the configuration is
    the caller's: attention_policy.prefill_pipelined_config). Refuses (ValueError) what attention_tc refuses: a
    head_dim outside TC_HEAD_DIMS, a cache outside TC_FORMATS, keys_per_tile not a multiple of 16, no warps."""
    d, block_size, fmt, scale, v_scale = check_tc_args("prefill_attention_tc_pipelined", q, k_cache, v_cache,
                                                       block_tables, cu_seqlens_q, context_lens, out, max_q_len,
                                                       warps, keys_per_tile, scale, k_scale, v_scale)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    kernel = _kernel(d, block_size, group, warps, keys_per_tile, fmt)
    grid = (num_seqs, -(-max_q_len * group // (16 * warps)), num_kv_heads)
    words = np.uint16 if fmt == "bf16" else np.uint32     # bf16 elements, or quads of 4 e4m3
    flat = (k_cache.size * k_cache.dtype.itemsize // np.dtype(words).itemsize,)
    launch(kernel, grid, warps * WARP, stream, q, view(k_cache, flat, words), view(v_cache, flat, words),
           block_tables, cu_seqlens_q, context_lens, scale, v_scale, out,
           shared=shared_bytes(d, warps, keys_per_tile))
