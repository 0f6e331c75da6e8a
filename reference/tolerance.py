"""How far a kernel's result may lie from these references: bounds on the fp32 summation-order error.

The kernels apply exactly the reference's roundings (README.md, "Numerics"), so a kernel and its reference
differ only in the order of their fp32 sums. The kernel tests (tests/kernels) and the benchmarks' checks
(tools/kernel_benchmarks, tools/bench.py's kernels workload) compare against the same bounds, defined here:

- a dot product of length n whose terms' absolute values sum to `magnitude` is off by at most
  4 sqrt(n) eps magnitude (eps = 2^-23; a random-walk estimate with a safety factor, not the n eps worst
  case, which no summation order reaches in practice);
- silu(g) * u carries the errors of g and u through |silu'(g)| <= 1.1, plus a few ulps for exp, the
  division and the products;
- a RoPE-rotated value a c - b s (|c|, |s| <= 1) carries the errors of both members of its pair, plus a few
  ulps of |a| + |b|.
"""

from __future__ import annotations

import numpy as np

from reference.bf16 import bf16_to_f32, round_to_bf16
from reference.matmul import gated_matmul, matmul

F32_EPS = float(np.finfo(np.float32).eps)


def dot_tolerance(n: int, magnitude):
    """Absolute tolerance of an fp32 dot product of length n whose terms' absolute sum is `magnitude`."""
    return 4 * F32_EPS * np.sqrt(n) * magnitude + 1e-30


def _dots(x: np.ndarray, w: np.ndarray, bf16_inputs: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T in float64, the dot tolerance of each product) for x (M, K) float32 and W (N, K) bf16 bits;
    x rounded to bf16 first with bf16_inputs, as the kernels do. A non-finite magnitude (an inf or NaN in x)
    gets tolerance 0: such outputs must match exactly."""
    xr = round_to_bf16(x) if bf16_inputs else x
    magnitude = np.abs(xr) @ np.abs(bf16_to_f32(w)).T
    tol = dot_tolerance(x.shape[1], np.where(np.isfinite(magnitude), magnitude, 0)).astype(np.float64)
    return matmul(xr, w).astype(np.float64), tol


def gated_bound(x: np.ndarray, w: np.ndarray, bf16_inputs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(reference.matmul.gated_matmul(x, W), the elementwise bound on a kernel's error), W = [gate; up] (2F, K):
    the dot products' summation errors carried through silu(g) * u, plus a few ulps."""
    dots, tol = _dots(x, w, bf16_inputs)
    f = w.shape[0] // 2
    g, u, tol_g, tol_u = dots[:, :f], dots[:, f:], tol[:, :f], tol[:, f:]
    with np.errstate(over="ignore", invalid="ignore"):
        silu = g / (1 + np.exp(-g))
        want = gated_matmul(x, w, bf16_inputs)
        bound = 1.1 * tol_g * (np.abs(u) + tol_u) + (np.abs(silu) + 1.1 * tol_g) * tol_u + 8 * F32_EPS * np.abs(want)
    return want, bound


def rope_bounds(x: np.ndarray, w: np.ndarray, head_dim: int, bf16_inputs: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on a fused QKV projection + RoPE (reference.matmul.matmul_rope_kv_write), per output value,
    both (M, Hq + 2 Hkv, head_dim) in the qkv row's head order: (each dot's own tolerance, for values that are
    not rotated (V); the rotated bound, for Q and K: the tolerances of both members of the value's pair (i,
    i + d/2) plus 4 ulps of their magnitudes). A value stored as bf16 (K, V) may add one bf16 rounding of its
    own, 2^-7 relative: the caller adds it."""
    dots, tol = _dots(x, w, bf16_inputs)
    m, half = x.shape[0], head_dim // 2
    dots, tol = dots.reshape(m, -1, 2, half), tol.reshape(m, -1, 2, half)
    pair = tol.sum(axis=2, keepdims=True) + 4 * F32_EPS * np.abs(dots).sum(axis=2, keepdims=True)
    rotated = np.broadcast_to(pair, dots.shape).reshape(m, -1, head_dim)
    return tol.reshape(m, -1, head_dim), rotated
