"""The KV-cache block copy (copy-on-write of a shared block) against reference/kv_cache.copy_blocks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import examples, pick, to_device

from cuda_kernels import kv_cache as kernels
from reference.kv_cache import copy_blocks
from reference.kv_format import DTYPES


@settings(max_examples=examples(10, 20))
@given(st.integers(0, 2**32 - 1), st.integers(2, pick(12, 512)), st.sampled_from(pick([1, 4, 16], [16, 32])),
       st.sampled_from(pick([(2, 16), (3, 8)], [(8, 64), (3, 64), (32, 128)])), st.integers(0, pick(4, 256)),
       st.sampled_from(["bf16", "fp32", "fp8"]))
def test_copy_blocks_matches_the_reference(seed, num_blocks, block_size, heads_dim, num_pairs, fmt):
    """Every KV format (random bits, NaN patterns included: a copy is a copy of bytes)."""
    rng = np.random.default_rng(seed)
    kv_heads, head_dim = heads_dim
    dtype = DTYPES[fmt]
    cache = rng.integers(0, 256, (num_blocks, block_size, kv_heads, head_dim * dtype.itemsize),
                         dtype=np.uint8).view(dtype)
    ids = rng.permutation(num_blocks)
    num_pairs = min(num_pairs, num_blocks // 2)
    # distinct destinations, none of them a source (as the block manager's copy-on-write gives)
    pairs = np.stack([rng.choice(ids[num_pairs:], num_pairs), ids[:num_pairs]], axis=1).astype(np.int32)
    want = cache.copy()
    copy_blocks(want, pairs)
    d = to_device(cache)
    kernels.copy_blocks(d, to_device(pairs.reshape(-1, 2)))
    np.testing.assert_array_equal(d.copy_to_host().view(np.uint8), want.view(np.uint8))
    if num_pairs:
        np.testing.assert_array_equal(want[pairs[:, 1]].view(np.uint8), cache[pairs[:, 0]].view(np.uint8))


def test_launcher_checks_its_arguments():
    cache = to_device(np.zeros((4, 2, 2, 8), np.uint16))
    with pytest.raises(ValueError, match=r"pairs must be \(P, 2\) int32"):
        kernels.copy_blocks(cache, to_device(np.zeros((2, 3), np.int32)))
    with pytest.raises(ValueError, match="cache must be"):
        kernels.copy_blocks(to_device(np.zeros((4, 1, 1, 7), np.uint16)), to_device(np.zeros((1, 2), np.int32)))
    with pytest.raises(ValueError, match="cache must be"):
        kernels.copy_blocks(to_device(np.zeros((4, 2, 2, 8), np.float16)), to_device(np.zeros((1, 2), np.int32)))
    with pytest.raises(TypeError, match="device arrays"):
        kernels.copy_blocks(np.zeros((4, 2, 2, 8), np.uint16), to_device(np.zeros((1, 2), np.int32)))
