"""Matmul against bf16 weights stored as nn.Linear stores them: ``out = x @ W^T``.

x (M, K) float32, W (N, K) uint16 bf16 -> (M, N) float32, accumulated in fp32. Fused projections (Q, K and V
as one weight; gate and up as one) are the same operation on row-concatenated weights.
"""

import numpy as np

from reference.bf16 import bf16_to_f32


def matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x (M, K) float32 @ bf16 weight (N, K) transposed -> (M, N) float32."""
    return np.asarray(x, dtype=np.float32) @ bf16_to_f32(weight).T
