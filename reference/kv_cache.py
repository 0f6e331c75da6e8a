"""The paged KV cache and its write.

Per layer, K and V each live in one pool of fixed-size blocks, (num_blocks, block_size, kv_heads, head_dim)
in the cache's format (reference/kv_format.py: bf16 bits as uint16 by default, float32, or fp8 e4m3 bits as
uint8). Token t of a batch goes to the flat slot ``slot_mapping[t] = block * block_size + offset``; slot -1
marks a padding token that writes nothing. Values are stored in the format on write (bf16: rounded to
nearest even; fp8: divided by the tensor's scale, rounded, saturated).

copy_blocks copies whole blocks of one pool (copy-on-write of a block that several sequences share: the n
completions of one prompt, cuda_kernels/kv_cache.py on the GPU).
"""

import numpy as np

from reference.kv_format import DTYPES, NANS, check_format, format_of, kv_encode

# A quiet-NaN bf16 pattern: unused cache slots hold it, so a kernel that reads one produces NaN and fails.
BF16_NAN = NANS["bf16"]


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      fmt: str = "bf16") -> np.ndarray:
    """One K or V pool for one layer in format fmt, every slot the format's NaN."""
    check_format(fmt)
    return np.full((num_blocks, block_size, num_kv_heads, head_dim), NANS[fmt], dtype=DTYPES[fmt])


def kv_cache_write(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key, value (T, kv_heads, d) float32 -> k_cache, v_cache at slots slot_mapping (T,), in place, in the
    caches' format (k_scale, v_scale: fp8's per-tensor scales)."""
    slots = np.asarray(slot_mapping)
    keep = slots >= 0
    block_size = k_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    fmt = format_of(k_cache)
    k_cache[blocks, offsets] = kv_encode(key[keep], fmt, k_scale)
    v_cache[blocks, offsets] = kv_encode(value[keep], fmt, v_scale)


def copy_blocks(cache: np.ndarray, pairs: np.ndarray) -> None:
    """cache (num_blocks, block_size, kv_heads, d), in place: block pairs[i, 1] <- block pairs[i, 0] for each
    row of pairs (P, 2) int32. Destinations are distinct and no destination is also a source."""
    pairs = np.asarray(pairs).reshape(-1, 2)
    cache[pairs[:, 1]] = cache[pairs[:, 0]]
