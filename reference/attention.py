"""Causal attention with grouped-query heads: the math, and the online-softmax algorithm the kernels use.

For query head h (its KV head is h // (Hq / Hkv)) at position p, over keys at positions j = 0 .. Tk-1:

    s_j = scale * <q, k_j>   for j <= p   (causal: later keys are masked out)
    out = sum_j softmax(s)_j * v_j

`attention` materialises the scores. `online_softmax_attention` walks the keys tile by tile and keeps a
running maximum m, a running denominator l and an unnormalised output acc, rescaling them by exp(m_old -
m_new) whenever the maximum grows: the result is the same, but no row of scores is ever held whole, which
is what lets a kernel keep everything in registers and shared memory (flash attention).
"""

from __future__ import annotations

import numpy as np


def _group(q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """(T, Hq, d) -> (Hkv, G, T, d): the G = Hq / Hkv query heads that share each KV head."""
    t, hq, d = q.shape
    return q.reshape(t, num_kv_heads, hq // num_kv_heads, d).transpose(1, 2, 0, 3)


def _ungroup(out: np.ndarray) -> np.ndarray:
    """(Hkv, G, T, d) -> (T, Hq, d)."""
    hkv, g, t, d = out.shape
    return out.transpose(2, 0, 1, 3).reshape(t, hkv * g, d)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray, scale: float) -> np.ndarray:
    """q (Tq, Hq, d), k and v (Tk, Hkv, d) float32; q_positions (Tq,) -> (Tq, Hq, d) float32."""
    tk, hkv = k.shape[:2]
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    positions = np.asarray(q_positions)
    first = int(positions.min())                  # keys before the first query are visible to every query
    hidden = np.arange(first, tk)[None, :] > positions[:, None]       # (Tq, Tk - first): causally masked
    # NOTE: one (Tq, d) @ (d, Tk) product per query head (a matrix-vector product when Tq = 1, as in decode).
    scores = _group(q, hkv) @ k.transpose(1, 2, 0)[:, None]            # (Hkv, G, Tq, Tk)
    scores *= np.float32(scale)
    np.copyto(scores[..., first:], np.float32(-np.inf), where=hidden)
    # NOTE: subtracting the row maximum keeps exp() in range; every query sees at least key 0, so the
    # maximum is finite. The softmax is computed in place (the scores are a prefill's largest array), and
    # its weights are normalised after the product with V, as the kernels do.
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    return _ungroup((scores @ v.transpose(1, 0, 2)[:, None]) / total)  # (Hkv, G, Tq, d) -> (Tq, Hq, d)


def online_softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                             scale: float, tile_size: int = 16) -> np.ndarray:
    """Same result as `attention`, computed one key tile at a time with a running max and sum."""
    hkv = k.shape[1]
    qg = _group(np.asarray(q, np.float32), hkv)                      # (Hkv, G, Tq, d)
    shape = qg.shape[:3]
    m = np.full(shape + (1,), -np.inf, np.float32)                   # running max of the scores
    l = np.zeros(shape + (1,), np.float32)                           # running sum of exp(s - m)
    acc = np.zeros(qg.shape, np.float32)                             # running sum of exp(s - m) * v
    positions = np.asarray(q_positions)[:, None]
    for start in range(0, k.shape[0], tile_size):
        stop = min(start + tile_size, k.shape[0])
        kt = np.asarray(k[start:stop], np.float32).transpose(1, 2, 0)[:, None]
        vt = np.asarray(v[start:stop], np.float32).transpose(1, 0, 2)[:, None]
        s = (qg @ kt) * np.float32(scale)                            # (Hkv, G, Tq, tile)
        s = np.where(np.arange(start, stop)[None, :] <= positions, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        # A query whose every key so far is masked keeps m = -inf; use 0 there so exp() gives 0, not NaN.
        m_safe = np.where(np.isfinite(m_new), m_new, np.float32(0))
        correction = np.exp(m - m_safe)
        p = np.exp(s - m_safe)
        l = l * correction + p.sum(axis=-1, keepdims=True)
        acc = acc * correction + p @ vt
        m = m_new
    return _ungroup(acc / l).astype(np.float32)
