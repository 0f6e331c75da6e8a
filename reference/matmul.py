"""Matmul against bf16 weights stored as nn.Linear stores them: ``out = x @ W^T``.

x (M, K) float32, W (N, K) uint16 bf16 -> (M, N) float32, accumulated in fp32. Fused projections (Q, K and V
as one weight; gate and up as one) are the same operation on row-concatenated weights.

Two input precisions (the engine's ``matmul_precision``): "fp32" multiplies x as it is; "bf16"
(``bf16_inputs=True``, what vLLM and HF transformers do) first rounds every x to the nearest bf16, so that
tensor cores can take x in one bf16 piece. Either way a product of x and a bf16 weight is exact in fp32, so
the kernels differ from this only in the order of the fp32 sums.
"""

import numpy as np

from reference.activation import silu_and_mul
from reference.bf16 import bf16_to_f32, round_to_bf16
from reference.rope import rope_kv_write


def matmul(x: np.ndarray, weight: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """x (M, K) float32 @ bf16 weight (N, K) transposed -> (M, N) float32; x rounded to bf16 first if asked."""
    x = np.asarray(x, dtype=np.float32)
    return (round_to_bf16(x) if bf16_inputs else x) @ bf16_to_f32(weight).T


def gated_matmul(x: np.ndarray, weight: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """silu(x @ gate^T) * (x @ up^T) for the fused weight [gate; up] (2F, K) -> (M, F) float32."""
    return silu_and_mul(matmul(x, weight, bf16_inputs))


def matmul_rope_kv_write(x: np.ndarray, weight: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                         k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray, num_heads: int,
                         bf16_inputs: bool = False) -> np.ndarray:
    """The fused QKV projection followed by reference.rope.rope_kv_write: returns the rotated q (T, Hq, d) and
    writes each token's rotated K and its V into the caches at slot_mapping (in place)."""
    return rope_kv_write(matmul(x, weight, bf16_inputs), positions, cos, sin, k_cache, v_cache, slot_mapping,
                         num_heads)
