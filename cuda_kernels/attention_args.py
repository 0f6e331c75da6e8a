"""Argument checks shared by the attention launchers: prefill (attention.py, attention_tc.py) and decode
(paged_attention.py, paged_attention_gqa.py). q is float32, the caches (num_blocks, block_size, num_kv_heads,
head_dim) in one of kv_format's formats, C-contiguous (the kernels read them 64 bits at a time), block tables
and context lengths int32; see the kernel modules' docstrings for every shape."""

import numpy as np

from cuda_kernels import kv_format


def folded_scales(k_cache, scale, k_scale, v_scale):
    """(format, the score scale times k_scale, v_scale) as float32, after kv_format.check_scales: the fp8
    cache's scales, applied outside the kernels' loops (the kernel modules' "KV formats")."""
    fmt = kv_format.format_of(k_cache)
    k_scale, v_scale = kv_format.check_scales(fmt, k_scale, v_scale)
    return fmt, np.float32(np.float32(scale) * k_scale), v_scale


def _describe(array):
    return f"{tuple(array.shape)} {array.dtype}"


def expect(name, array, shape, dtype):
    """ValueError unless array has exactly this shape and dtype."""
    if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected {tuple(shape)} {np.dtype(dtype)}, got {_describe(array)}")


def _is_c_contiguous(array):
    check = getattr(array, "is_c_contiguous", None)
    return check() if callable(check) else bool(array.flags["C_CONTIGUOUS"])


def check_cache_args(q, k_cache, v_cache, block_tables, context_lens):
    """Checks shared by every attention launcher; returns (head_dim, block_size)."""
    if q.ndim != 3 or q.dtype != np.float32:
        raise ValueError(f"q: expected (tokens, num_heads, head_dim) float32, got {_describe(q)}")
    d = q.shape[2]
    if d % 8 or not 8 <= d <= 128:
        raise ValueError(f"head_dim must be a multiple of 8 in 8..128, got {d}")
    if k_cache.ndim != 4 or k_cache.dtype not in kv_format.DTYPES.values() or k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected (num_blocks, block_size, num_kv_heads, {d}) uint16 (bf16), float32 "
                         f"(fp32) or uint8 (fp8), got {_describe(k_cache)}")
    expect("v_cache", v_cache, k_cache.shape, k_cache.dtype)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _is_c_contiguous(cache):
            raise ValueError(f"{name} must be C-contiguous (it is read 64 bits at a time)")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if context_lens.ndim != 1 or context_lens.dtype != np.int32:
        raise ValueError(f"context_lens: expected (num_seqs,) int32, got {_describe(context_lens)}")
    if block_tables.ndim != 2 or block_tables.dtype != np.int32 or block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables: expected ({context_lens.shape[0]}, max_blocks) int32, "
                         f"got {_describe(block_tables)}")
    return d, k_cache.shape[1]


def check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, max_q_len):
    """check_cache_args, plus the packed queries' offsets, out like q and a host int max_q_len (prefill)."""
    d, block_size = check_cache_args(q, k_cache, v_cache, block_tables, context_lens)
    expect("cu_seqlens_q", cu_seqlens_q, (context_lens.shape[0] + 1,), np.int32)
    expect("out", out, q.shape, np.float32)
    if int(max_q_len) != max_q_len or max_q_len < 0:
        raise ValueError(f"max_q_len must be a non-negative int, got {max_q_len!r}")
    return d, block_size


def check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out):
    """check_cache_args, plus one context length and one output row per query (decode)."""
    d, block_size = check_cache_args(q, k_cache, v_cache, block_tables, context_lens)
    if context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens: expected ({q.shape[0]},) int32 (one per query), "
                         f"got {tuple(context_lens.shape)}")
    expect("out", out, q.shape, np.float32)
    return d, block_size
