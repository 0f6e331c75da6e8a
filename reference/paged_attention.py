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
"""

from __future__ import annotations

import numpy as np

from reference.attention import attention
from reference.bf16 import bf16_to_f32


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
              context_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first context_len tokens of one sequence as float32 (context_len, Hkv, d) K and V."""
    block_size = k_cache.shape[1]
    blocks = np.asarray(block_table[: -(-context_len // block_size)])
    k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:context_len]
    v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:context_len]
    return bf16_to_f32(k), bf16_to_f32(v)


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                      cu_seqlens_q: np.ndarray, context_lens: np.ndarray, scale: float) -> np.ndarray:
    """q (T, Hq, d) float32 for all sequences' new tokens -> (T, Hq, d) float32."""
    out = np.empty_like(q, dtype=np.float32)
    for s in range(len(context_lens)):
        begin, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        if begin == end:
            continue
        ctx = int(context_lens[s])
        k, v = gather_kv(k_cache, v_cache, block_tables[s], ctx)
        positions = np.arange(ctx - (end - begin), ctx)
        out[begin:end] = attention(q[begin:end], k, v, positions, scale)
    return out


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
