"""The paged KV cache and its write.

Per layer, K and V each live in one pool of fixed-size blocks, (num_blocks, block_size, kv_heads, head_dim)
bf16. Token t of a batch goes to the flat slot ``slot_mapping[t] = block * block_size + offset``; slot -1
marks a padding token that writes nothing. Values are rounded to bf16, nearest even, on write.

copy_blocks copies whole blocks of one pool (copy-on-write of a block that several sequences share: the n
completions of one prompt, cuda_kernels/kv_cache.py on the GPU).
"""

import numpy as np

from reference.bf16 import f32_to_bf16

# A quiet-NaN bf16 pattern: unused cache slots hold it, so a kernel that reads one produces NaN and fails.
BF16_NAN = np.uint16(0x7FC0)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """One K or V pool for one layer, every slot NaN."""
    return np.full((num_blocks, block_size, num_kv_heads, head_dim), BF16_NAN, dtype=np.uint16)


def kv_cache_write(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """key, value (T, kv_heads, d) float32 -> k_cache, v_cache at slots slot_mapping (T,), in place."""
    slots = np.asarray(slot_mapping)
    keep = slots >= 0
    block_size = k_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    k_cache[blocks, offsets] = f32_to_bf16(key[keep])
    v_cache[blocks, offsets] = f32_to_bf16(value[keep])


def copy_blocks(cache: np.ndarray, pairs: np.ndarray) -> None:
    """cache (num_blocks, block_size, kv_heads, d), in place: block pairs[i, 1] <- block pairs[i, 0] for each
    row of pairs (P, 2) int32. Destinations are distinct and no destination is also a source."""
    pairs = np.asarray(pairs).reshape(-1, 2)
    cache[pairs[:, 1]] = cache[pairs[:, 0]]
