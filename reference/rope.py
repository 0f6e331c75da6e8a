"""Rotary position embeddings (RoPE) with optional Llama 3 frequency scaling.

Each head vector of size d is split into halves (x1, x2) = (x[:d/2], x[d/2:]) (the Hugging Face layout,
"rotate half"), and pair i is rotated by the angle ``pos * inv_freq[i]``:

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin,        inv_freq[i] = theta ** (-2i / d)

Llama 3 scaling rescales inv_freq by wavelength (lambda = 2 pi / inv_freq, L = original context):
lambda > L / low_freq_factor: divided by `factor`; lambda < L / high_freq_factor: kept; in between, a linear
blend with weight s = (L / lambda - low) / (high - low) on the unscaled frequency.

The cos/sin tables are computed on the host in float64 and stored as float32: kernels only look them up.
"""

from __future__ import annotations

import numpy as np

from reference.kv_cache import kv_cache_write


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """(head_dim/2,) float64 inverse frequencies; `scaling` is a config.RopeScaling or None."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    wavelength = 2 * np.pi / inv_freq
    context = scaling.original_max_position_embeddings
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    long_waves = wavelength > context / scaling.low_freq_factor
    short_waves = wavelength < context / scaling.high_freq_factor
    return np.where(long_waves, inv_freq / scaling.factor, np.where(short_waves, inv_freq, blended))


def rope_tables(head_dim: int, max_positions: int, theta: float, scaling=None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (max_positions, head_dim/2) float32, computed in float64."""
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * rope_inv_freq(head_dim, theta, scaling)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, d) float32 rotated at positions (T,) -> (T, heads, d) float32."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32, copy=False)


def rope_kv_write(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
                  v_cache: np.ndarray, slot_mapping: np.ndarray, num_heads: int, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> np.ndarray:
    """RoPE on the Q and K parts of the fused projection output, then K and V into their cache slots.

    qkv (T, (Hq + 2 Hkv) * d) float32 holds, per token, the Hq query heads, then the Hkv key heads, then the
    Hkv value heads (the row layout of the fused QKV weight). Returns the rotated q (T, Hq, d); the caches
    (num_blocks, block_size, Hkv, d) are written in place, in their format (see kv_cache_write).
    """
    t = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    q = qkv[:, : num_heads * d].reshape(t, num_heads, d)
    k = qkv[:, num_heads * d: (num_heads + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (num_heads + hkv) * d:].reshape(t, hkv, d)
    kv_cache_write(apply_rope(k, positions, cos, sin), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return apply_rope(q, positions, cos, sin)
