"""Argument checks shared by the matmul launchers (gemm_simt, gemv, gemv_staged, gemm_tc and the dispatch in
matmul.py): x (M, K) float32, W (N, K) uint16 bf16 bits, out (M, N) float32, all numba device arrays."""

import numpy as np


def is_device_array(a) -> bool:
    # Duck-typed: numba's DeviceNDArray and the simulator's FakeCUDAArray both have copy_to_host (the
    # simulator has no cuda.is_cuda_array). A host array would make numba copy it in and out on every launch.
    return hasattr(a, "copy_to_host") and hasattr(a, "dtype") and hasattr(a, "shape")


def check_args(x, weight, out, allow_u64_weight=False, gated=False):
    """Validate x (M, K) f32, weight (N, K) u16 [or (N, K/4) u64 view], out (M, N) f32 (gated: N even and out
    (M, N/2); None: not checked, the caller checks its outputs); return (M, N, K)."""
    for name, a in (("x", x), ("weight", weight), ("out", out)):
        if a is None:
            continue
        if not is_device_array(a):
            raise TypeError(f"matmul: {name} must be a numba device array (cuda.to_device / device_array), "
                            f"got {type(a).__name__}")
        if len(a.shape) != 2:
            raise ValueError(f"matmul: {name} must be 2-D, got shape {tuple(a.shape)}")
    if x.dtype != np.float32:
        raise ValueError(f"matmul: x must be float32, got {x.dtype} (shape {tuple(x.shape)})")
    if out is not None and out.dtype != np.float32:
        raise ValueError(f"matmul: out must be float32, got {out.dtype} (shape {tuple(out.shape)})")
    M, K = x.shape
    N, wk = weight.shape
    if weight.dtype == np.uint64 and allow_u64_weight:
        wk *= 4  # the uint64 view of a uint16 (N, K) weight
    elif weight.dtype != np.uint16:
        allowed = "uint16 bf16 bits (or its uint64 view)" if allow_u64_weight else "uint16 bf16 bits"
        raise ValueError(f"matmul: weight must be {allowed}, got {weight.dtype} "
                         f"(shape {tuple(weight.shape)})")
    if wk != K:
        raise ValueError(f"matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"({weight.dtype}) disagree on K ({K} vs {wk})")
    if out is None:
        return M, N, K
    if gated and (N % 2 or tuple(out.shape) != (M, N // 2)):
        raise ValueError(f"gated matmul: weight must be [gate; up] with an even row count and out (M, N/2) = "
                         f"({M}, {N // 2}) for x {tuple(x.shape)} and weight {tuple(weight.shape)}, "
                         f"got out {tuple(out.shape)}")
    if not gated and tuple(out.shape) != (M, N):
        raise ValueError(f"matmul: out must have shape (M, N) = ({M}, {N}) for x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}, got {tuple(out.shape)}")
    return M, N, K
