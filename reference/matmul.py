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
from reference.bf16 import bf16_to_f32, f32_to_bf16, round_to_bf16
from reference.rope import rope_kv_write


def matmul(x: np.ndarray, weight: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """x (M, K) float32 @ bf16 weight (N, K) transposed -> (M, N) float32; x rounded to bf16 first if asked."""
    x = np.asarray(x, dtype=np.float32)
    return (round_to_bf16(x) if bf16_inputs else x) @ bf16_to_f32(weight).T


def bf16_planes(x: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """The bf16 planes the pipelined GEMM multiplies, (P, M, K) uint16: x rounded to nearest even (P = 1,
    bf16_inputs), or the bf16x3 split (P = 3, cuda_kernels/mma.split_bf16x3): hi keeps x's top 16 bits, mid
    the top 16 bits of x - hi, lo those of x - hi - mid (which has at most 8 significant bits left, so
    nothing is dropped): hi + mid + lo == x exactly. An
    infinite x is all hi. Summing planes @ W^T over p is matmul(x, W, bf16_inputs) up to the order of sums."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if bf16_inputs:
        return f32_to_bf16(x)[None]
    top = np.uint32(0xFFFF0000)
    hi = (x.view(np.uint32) & top).view(np.float32)
    with np.errstate(invalid="ignore"):
        rest = np.where(np.isinf(x), np.float32(0), x - hi).astype(np.float32)
    mid = (rest.view(np.uint32) & top).view(np.float32)
    lo = (rest - mid).astype(np.float32)
    return np.stack([(v.view(np.uint32) >> np.uint32(16)).astype(np.uint16) for v in (hi, mid, lo)])


def gated_matmul(x: np.ndarray, weight: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """silu(x @ gate^T) * (x @ up^T) for the fused weight [gate; up] (2F, K) -> (M, F) float32."""
    return silu_and_mul(matmul(x, weight, bf16_inputs))


def mlp(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, bf16_inputs: bool = False) -> np.ndarray:
    """The gated MLP: gated_matmul(x, [gate; up]) @ down^T -> (M, H) float32."""
    return matmul(gated_matmul(x, gate_up, bf16_inputs), down, bf16_inputs)


def matmul_rope_kv_write(x: np.ndarray, weight: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                         k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray, num_heads: int,
                         bf16_inputs: bool = False, k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """The fused QKV projection followed by reference.rope.rope_kv_write: returns the rotated q (T, Hq, d) and
    writes each token's rotated K and its V into the caches at slot_mapping (in place, in their format)."""
    return rope_kv_write(matmul(x, weight, bf16_inputs), positions, cos, sin, k_cache, v_cache, slot_mapping,
                         num_heads, k_scale, v_scale)
