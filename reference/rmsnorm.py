"""RMSNorm, and the residual add fused with it.

    rmsnorm(x)[t, i] = x[t, i] / sqrt(mean_j x[t, j]^2 + eps) * w[i]

The fused form is what a pre-norm transformer needs between sublayers: the sublayer output is added to the
residual stream, and the new residual is normalised for the next sublayer, in one pass:

    residual' = residual + x ;  out = rmsnorm(residual')
"""

import numpy as np

from reference.bf16 import bf16_to_f32


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, H) float32; weight (H,) uint16 bf16 -> (T, H) float32. The mean square is taken in fp32."""
    x = np.asarray(x, dtype=np.float32)
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(mean_square + np.float32(eps))) * bf16_to_f32(weight)


def fused_add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                      eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Returns (rmsnorm(residual + x), residual + x); all float32 (T, H)."""
    new_residual = np.asarray(residual, dtype=np.float32) + np.asarray(x, dtype=np.float32)
    return rmsnorm(new_residual, weight, eps), new_residual
