"""Copying whole blocks of a paged KV cache on the GPU: the copy-on-write of a block that several sequences
share (the n completions of one prompt share its blocks; the partly filled last one is copied for a sequence
the first time it writes there: the PagedAttention paper's parallel sampling, tinyvllm/block_manager.py).

    copy_blocks:  cache[pairs[p, 1]] = cache[pairs[p, 0]]   for p < P      (reference/kv_cache.copy_blocks)

Shapes and dtypes (device arrays): cache (num_blocks, block_size, kv_heads, head_dim) in any format of
cuda_kernels/kv_format.py (uint16 bf16 bits, float32, uint8 fp8 bits: a copy needs no format), C-contiguous,
read as 32-bit words (a block's bytes a multiple of 4); pairs (P, 2) int32, destinations distinct and never a
source. One launch copies P blocks of one pool: the runner launches it for each layer's K and V.

Thread mapping: grid = (P,), one block of THREADS threads per pair; thread t copies words t, t + THREADS, ...
of the block (consecutive threads, consecutive addresses).

Versions: v1 only: a copy happens once per completion of an n > 1 request, at its first decode step.
"""

from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from numba import cuda

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.kv_format import DTYPES
from cuda_kernels.launch import launch, view

THREADS = 64 if SIMULATOR else 256


@lru_cache(maxsize=None)
def _copy_blocks_kernel():
    @cuda.jit
    def copy_blocks_kernel(words, pairs):
        # words (num_blocks, W) uint32: the cache, one row per block
        p = cuda.blockIdx.x
        src = pairs[p, 0]
        dst = pairs[p, 1]
        for w in range(cuda.threadIdx.x, words.shape[1], cuda.blockDim.x):
            words[dst, w] = words[src, w]

    return copy_blocks_kernel


def copy_blocks(cache, pairs, stream=0):
    """cache (num_blocks, block_size, kv_heads, head_dim) in any KV format, in place: block pairs[p, 1] <- block
    pairs[p, 0] for every row of pairs (P, 2) int32 (block ids in range, destinations distinct)."""
    if isinstance(cache, np.ndarray) or isinstance(pairs, np.ndarray):
        raise TypeError("cache and pairs must be device arrays")
    dtype = np.dtype(cache.dtype)
    if len(cache.shape) != 4 or dtype not in DTYPES.values() or (cache.size // max(cache.shape[0], 1)
                                                                   * dtype.itemsize) % 4:
        raise ValueError(f"cache must be (blocks, block_size, kv_heads, head_dim) uint16, float32 or uint8 with "
                         f"blocks of a multiple of 4 bytes, got shape {tuple(cache.shape)} {dtype.name}")
    if len(pairs.shape) != 2 or pairs.shape[1] != 2 or np.dtype(pairs.dtype) != np.int32:
        raise ValueError(f"pairs must be (P, 2) int32, got shape {tuple(pairs.shape)} {np.dtype(pairs.dtype).name}")
    blocks = cache.shape[0]
    per_block = cache.shape[1] * cache.shape[2] * cache.shape[3] * dtype.itemsize // 4
    if pairs.shape[0]:
        launch(_copy_blocks_kernel(), pairs.shape[0], THREADS, stream, view(cache, (blocks, per_block), np.uint32),
               pairs)
