"""Attention that reads K and V from the paged cache through each sequence's block table.

Sequence s owns the blocks block_tables[s, 0 .. ceil(context_lens[s] / block_size) - 1], in order: token j
of its context lives in block block_tables[s, j // block_size] at offset j % block_size. Slots past the
context are never read (tests fill them with NaN to prove it).

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

from reference.bf16 import bf16_to_f32
from reference.parallel import WORKERS, run_all


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
              context_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first context_len tokens of one sequence as float32 (context_len, Hkv, d) K and V."""
    block_size = k_cache.shape[1]
    blocks = np.asarray(block_table[: -(-context_len // block_size)])
    k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:context_len]
    v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:context_len]
    return bf16_to_f32(k), bf16_to_f32(v)


# A long chunk of queries is attended QUERY_TILE at a time: a tile reads only the keys up to its last
# position (the later ones are masked for all of its rows), which skips half the work of a long prompt, and
# its scores, Hq x QUERY_TILE x context floats, stay small (20 MB, not 685, for the default model's 9 heads
# over 4,363 tokens). The tiles are independent: when there are at least PARALLEL_SCORES scores in all,
# they are dealt out to every core (reference/parallel.py); below that, threads cost more than they save.
QUERY_TILE = 128
PARALLEL_SCORES = 1 << 20


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                      cu_seqlens_q: np.ndarray, context_lens: np.ndarray, scale: float) -> np.ndarray:
    """q (T, Hq, d) float32 for all sequences' new tokens -> (T, Hq, d) float32."""
    out = np.empty_like(q, dtype=np.float32)
    # NOTE: the scale multiplies q, not the scores (a pass over the largest array less); for head_dim 64
    # or 256 the scale is a power of two and the scores are the same bits.
    q = np.asarray(q, np.float32) * np.float32(scale)
    tiles = []
    for s in range(len(context_lens)):
        begin, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        if begin == end:
            continue
        ctx = int(context_lens[s])
        k, v = gather_kv(k_cache, v_cache, block_tables[s], ctx)
        # K^T of each KV head, contiguous: the products read it 10% faster than a strided view of k.
        # NOTE: V gets a column of ones: its product with the softmax weights then also gives their sum.
        kt = np.ascontiguousarray(k.transpose(1, 2, 0))                                   # (Hkv, d, ctx)
        v1 = np.concatenate([v, np.ones((ctx, v.shape[1], 1), np.float32)], axis=2).transpose(1, 0, 2)
        first = ctx - (end - begin)             # the position of the sequence's first query
        for row in range(begin, end, QUERY_TILE):
            rows = slice(row, min(row + QUERY_TILE, end))
            positions = np.arange(rows.start, rows.stop) - begin + first
            seen = positions[-1] + 1
            tiles.append((rows, positions, kt[..., :seen], v1[:, :seen]))
    num_scores = q.shape[1] * sum(len(positions) * kt.shape[2] for _, positions, kt, _ in tiles)
    # Tiles dealt out in turn: their cost grows along a sequence, so each worker gets a similar share.
    workers = WORKERS if num_scores >= PARALLEL_SCORES else 1
    run_all([partial(_attend_tiles, q, out, tiles[w::workers]) for w in range(workers)])
    return out


def _attend_tiles(q: np.ndarray, out: np.ndarray, tiles: list) -> None:
    """_attend_tile for each tile, all writing their scores into one buffer allocated here."""
    if not tiles:
        return
    # NOTE: a fresh array per tile would cost as much as its exp(): each is larger than the last, so the
    # allocator maps new pages, and the kernel zeroes them, every time.
    scratch = np.empty(q.shape[1] * max(len(positions) * kt.shape[2] for _, positions, kt, _ in tiles), np.float32)
    for tile in tiles:
        _attend_tile(q, out, *tile, scratch)


def _attend_tile(q: np.ndarray, out: np.ndarray, rows: slice, positions: np.ndarray, kt: np.ndarray,
                 v1: np.ndarray, scratch: np.ndarray) -> None:
    """out[rows] = attention of the (already scaled) queries q[rows] at `positions` (n consecutive ones) over
    keys kt (Hkv, d, seen) and values-with-a-ones-column v1 (Hkv, seen, d + 1), `seen` = positions[-1] + 1;
    the scores go to scratch (at least Hq * n * seen floats)."""
    n, hq, d = q[rows].shape
    hkv, seen = kt.shape[0], kt.shape[2]
    group = hq // hkv
    # The G query heads that share a KV head are stacked into one (G * n, d) matrix: one product per KV head.
    qg = q[rows].reshape(n, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = np.matmul(qg, kt, out=scratch[:hq * n * seen].reshape(hkv, group * n, seen))
    first = positions[0]                  # keys before the first query are visible to every query
    hidden = np.arange(first, seen)[None, :] > positions[:, None]                # (n, seen - first)
    np.copyto(scores.reshape(hkv, group, n, seen)[..., first:], np.float32(-np.inf), where=hidden)
    # NOTE: subtracting the row maximum keeps exp() in range; every query sees at least key 0, so the
    # maximum is finite. In place: the scores are a prefill's largest array. The weights are normalised
    # after the product with V, as the kernels do.
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    weighted = scores @ v1                                                        # (Hkv, G * n, d + 1)
    result = weighted[..., :d] / weighted[..., d:]
    out[rows] = result.reshape(hkv, group, n, d).transpose(2, 0, 1, 3).reshape(n, hq, d)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, scale: float) -> np.ndarray:
    """q (S, Hq, d) float32, one decode query per sequence -> (S, Hq, d) float32."""
    cu = np.arange(len(context_lens) + 1)
    return prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, scale)


def paged_attention_walk(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                         context_lens: np.ndarray, scale: float) -> np.ndarray:
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
                key = bf16_to_f32(k_cache[block, offset, h // group])
                score = np.float32(scale) * np.dot(q[s, h], key)
                m_new = max(m, score)
                correction = np.exp(np.float32(m - m_new))
                p = np.exp(np.float32(score - m_new))
                l = l * correction + p
                acc = acc * correction + p * bf16_to_f32(v_cache[block, offset, h // group])
                m = m_new
            out[s, h] = acc / l
    return out


def paged_attention_partitioned(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                block_tables: np.ndarray, context_lens: np.ndarray, scale: float,
                                partition_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        k, v = gather_kv(k_cache, v_cache, block_tables[s], ctx)
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
