"""Attention that reads K and V from the paged cache through each sequence's block table.

Sequence s owns the blocks block_tables[s, 0 .. ceil(context_lens[s] / block_size) - 1], in order: token j
of its context lives in block block_tables[s, j // block_size] at offset j % block_size. Slots past the
context are never read (tests fill them with NaN to prove it). The caches are in any format of
reference/kv_format.py (read back through its kv_decode; k_scale, v_scale: fp8's per-tensor scales).

- `prefill_attention`: a variable-length batch of query chunks; the q_len queries of sequence s (rows
  cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1) are the last q_len tokens of its context, so a chunk of a long
  prompt, or a prompt whose prefix came from the prefix cache, attends to everything before it.
- `paged_attention`: decode, one query per sequence at position context_len - 1.
- `paged_attention_walk`: the same as `paged_attention`, written the way the kernel walks the cache: token by
  token along the block table, with an online softmax.
- `paged_attention_partitioned` and `paged_attention_reduce`: split-K decode in the kernel's two passes:
  each partition of the context gives a partial (max, sum, unnormalised acc), then the partials are merged.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from reference.attention import attention
from reference.kv_format import kv_decode
from reference.parallel import WORKERS, run_all


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, context_len: int,
              k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The first context_len tokens of one sequence as float32 (context_len, Hkv, d) K and V."""
    block_size = k_cache.shape[1]
    blocks = np.asarray(block_table[: -(-context_len // block_size)])
    k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:context_len]
    v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:context_len]
    return kv_decode(k, k_scale), kv_decode(v, v_scale)


# A long chunk of queries is attended QUERY_TILE at a time: a tile reads only the keys up to its last
# position (the later ones are masked for all of its rows), which skips half the work of a long prompt, and
# its scores, Hq x QUERY_TILE x context floats, stay small (20 MB, not 685, for the default model's 9 heads
# over 4,363 tokens). With at least PARALLEL_SCORES scores in all, the tiles are dealt out to every core
# (reference/parallel.py); below that (decode steps, short prompts), threads would cost more than they save.
QUERY_TILE = 128
PARALLEL_SCORES = 1 << 20


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                      cu_seqlens_q: np.ndarray, context_lens: np.ndarray, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> np.ndarray:
    """q (T, Hq, d) float32 for all sequences' new tokens -> (T, Hq, d) float32."""
    out = np.empty_like(q, dtype=np.float32)
    chunks = []                     # per sequence: (its rows of q, their positions, the sequence)
    for s in range(len(context_lens)):
        begin, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        if begin < end:
            ctx = int(context_lens[s])
            chunks.append((slice(begin, end), np.arange(ctx - (end - begin), ctx), s))
    if q.shape[1] * sum(len(positions) * (positions[-1] + 1) for _, positions, _ in chunks) >= PARALLEL_SCORES:
        kv = [gather_kv(k_cache, v_cache, block_tables[s], positions[-1] + 1, k_scale, v_scale)
              for _, positions, s in chunks]
        _attend_in_threads(q, out, chunks, kv, scale)
        return out
    for rows, positions, s in chunks:
        k, v = gather_kv(k_cache, v_cache, block_tables[s], positions[-1] + 1, k_scale, v_scale)
        for tile, tile_positions in _query_tiles(rows, positions):
            seen = tile_positions[-1] + 1
            out[tile] = attention(q[tile], k[:seen], v[:seen], tile_positions, scale)
    return out


def _query_tiles(rows: slice, positions: np.ndarray):
    """(rows, positions) of each tile of QUERY_TILE queries of a chunk."""
    for start in range(0, len(positions), QUERY_TILE):
        stop = min(start + QUERY_TILE, len(positions))
        yield slice(rows.start + start, rows.start + stop), positions[start:stop]


def _attend_in_threads(q: np.ndarray, out: np.ndarray, chunks: list, kv: list, scale: float) -> None:
    """prefill_attention's tiles, each KV head of each a piece of work, dealt out to the worker threads in
    turn (a tile's cost grows along its sequence, so each worker gets a similar share); kv: each chunk's
    sequence's K and V. The same math as `attention`, with fewer passes over the scores, the largest
    array of a long prefill (see the NOTEs)."""
    # NOTE: the scale multiplies q, not the scores; for head_dim 64 or 256 it is a power of two and the
    # scores are the same bits.
    q = np.asarray(q, np.float32) * np.float32(scale)
    pieces = []
    for (rows, positions, _), (k, v) in zip(chunks, kv):
        group = q.shape[1] // k.shape[1]
        # K^T of each KV head, contiguous: the products read it 10% faster than a strided view of K.
        # NOTE: V gets a column of ones: its product with the softmax weights then also gives their sum.
        kt = np.ascontiguousarray(k.transpose(1, 2, 0))                                          # (Hkv, d, ctx)
        v1 = np.concatenate([v, np.ones((*v.shape[:2], 1), np.float32)], axis=2).transpose(1, 0, 2)
        for tile, tile_positions in _query_tiles(rows, positions):
            seen = tile_positions[-1] + 1
            for h in range(len(kt)):        # per KV head: the G query heads that share it, together
                heads = slice(h * group, (h + 1) * group)
                pieces.append((tile, tile_positions, heads, kt[h, :, :seen], v1[h, :seen]))
    run_all([partial(_attend_pieces, q, out, pieces[w::WORKERS]) for w in range(WORKERS)])


def _attend_pieces(q: np.ndarray, out: np.ndarray, pieces: list) -> None:
    """_attend_piece for each piece, all writing their scores into one buffer allocated here."""
    if not pieces:
        return
    # NOTE: a fresh array per piece would cost as much as its exp(): each is larger than the last, so the
    # allocator maps new pages, and the kernel zeroes them, every time.
    size = max((heads.stop - heads.start) * len(positions) * kt.shape[1] for _, positions, heads, kt, _ in pieces)
    scratch = np.empty(size, np.float32)
    for piece in pieces:
        _attend_piece(q, out, *piece, scratch)


def _attend_piece(q: np.ndarray, out: np.ndarray, rows: slice, positions: np.ndarray, heads: slice,
                  kt: np.ndarray, v1: np.ndarray, scratch: np.ndarray) -> None:
    """out[rows, heads] = attention of the (already scaled) queries q[rows, heads] at `positions` (n
    consecutive ones) over the keys kt (d, seen) and values-with-a-ones-column v1 (seen, d + 1) of the KV
    head those G query heads share, `seen` = positions[-1] + 1; the scores go to scratch."""
    n, group, d = q[rows, heads].shape
    seen = kt.shape[1]
    # The G query heads are stacked into one (G * n, d) matrix: one product for the KV head.
    scores = np.matmul(q[rows, heads].transpose(1, 0, 2).reshape(group * n, d), kt,
                       out=scratch[:group * n * seen].reshape(group * n, seen))
    first = positions[0]                  # keys before the first query are visible to every query
    hidden = np.arange(first, seen)[None, :] > positions[:, None]                # (n, seen - first)
    np.copyto(scores.reshape(group, n, seen)[..., first:], np.float32(-np.inf), where=hidden)
    # NOTE: subtracting the row maximum keeps exp() in range; every query sees at least key 0, so the
    # maximum is finite. In place: the scores are a prefill's largest array. The weights are normalised
    # after the product with V, as the kernels do.
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    weighted = scores @ v1                                                        # (G * n, d + 1)
    out[rows, heads] = (weighted[:, :d] / weighted[:, d:]).reshape(group, n, d).transpose(1, 0, 2)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """q (S, Hq, d) float32, one decode query per sequence -> (S, Hq, d) float32."""
    cu = np.arange(len(context_lens) + 1)
    return prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, scale, k_scale, v_scale)


def paged_attention_walk(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                         context_lens: np.ndarray, scale: float, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> np.ndarray:
    """`paged_attention` as the kernel computes it: one key at a time along the block table, online softmax."""
    num_seqs, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    out = np.empty((num_seqs, hq, d), np.float32)
    for s in range(num_seqs):
        for h in range(hq):
            m, l, acc = -np.inf, np.float32(0), np.zeros(d, np.float32)
            for j in range(int(context_lens[s])):
                block, offset = block_tables[s, j // block_size], j % block_size
                key = kv_decode(k_cache[block, offset, h // group], k_scale)
                score = np.float32(scale) * np.dot(q[s, h], key)
                m_new = max(m, score)
                correction = np.exp(np.float32(m - m_new))
                p = np.exp(np.float32(score - m_new))
                l = l * correction + p
                acc = acc * correction + p * kv_decode(v_cache[block, offset, h // group], v_scale)
                m = m_new
            out[s, h] = acc / l
    return out


def paged_attention_partitioned(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                block_tables: np.ndarray, context_lens: np.ndarray, scale: float,
                                partition_size: int, k_scale: float = 1.0,
                                v_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split-K decode, first pass: each partition of partition_size keys attended on its own.

    Partition p of sequence s holds keys p * partition_size .. min((p + 1) * partition_size, context_len) - 1.
    For it and each query head: m = the largest score, l = sum_j exp(s_j - m), acc = sum_j exp(s_j - m) v_j
    (unnormalised). Partitions past the context are neutral: m = -inf, l = 0, acc = 0.
    Returns partial_out (S, Hq, P, d), partial_max (S, Hq, P), partial_sum (S, Hq, P) float32, with
    P = ceil(max(context_lens) / partition_size) (at least 1).
    """
    num_seqs, hq, d = q.shape
    group = hq // k_cache.shape[2]
    lens = np.asarray(context_lens)
    num_partitions = max(1, -(-int(lens.max(initial=0)) // partition_size))
    partial_out = np.zeros((num_seqs, hq, num_partitions, d), np.float32)
    partial_max = np.full((num_seqs, hq, num_partitions), -np.inf, np.float32)
    partial_sum = np.zeros((num_seqs, hq, num_partitions), np.float32)
    for s in range(num_seqs):
        ctx = int(lens[s])
        if ctx <= 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[s], ctx, k_scale, v_scale)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)     # (ctx, Hq, d)
        for p in range(-(-ctx // partition_size)):
            keys = slice(p * partition_size, min((p + 1) * partition_size, ctx))
            scores = np.einsum("hd,jhd->hj", q[s], k[keys]) * np.float32(scale)   # (Hq, n)
            m = scores.max(axis=1)
            e = np.exp(scores - m[:, None])
            partial_max[s, :, p] = m
            partial_sum[s, :, p] = e.sum(axis=1)
            partial_out[s, :, p] = np.einsum("hj,jhd->hd", e, v[keys])
    return partial_out, partial_max, partial_sum


def paged_attention_reduce(partial_out: np.ndarray, partial_max: np.ndarray, partial_sum: np.ndarray,
                           context_lens: np.ndarray, partition_size: int) -> np.ndarray:
    """Split-K decode, second pass: merge the partitions of each (sequence, head) -> (S, Hq, d) float32.

    With M = max_p m_p, every partition is rescaled to the common maximum:
    out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p. Only the ceil(context_len / partition_size)
    partitions that hold keys are read; a sequence with context_len 0 (a padding slot) gives zeros.
    """
    num_seqs, hq, _, d = partial_out.shape
    out = np.zeros((num_seqs, hq, d), np.float32)
    for s in range(num_seqs):
        n = -(-int(context_lens[s]) // partition_size)
        if n <= 0:
            continue
        m = partial_max[s, :, :n]                                        # (Hq, n)
        weights = np.exp(m - m.max(axis=1, keepdims=True))
        total = (weights * partial_sum[s, :, :n]).sum(axis=1)
        out[s] = np.einsum("hp,hpd->hd", weights, partial_out[s, :, :n]) / total[:, None]
    return out
