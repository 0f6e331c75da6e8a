"""RMSNorm, and the residual add fused with it (one pass over the row instead of two kernels).

    rmsnorm:           out[t, i] = x[t, i] / sqrt(mean_j x[t, j]^2 + eps) * w[i]
    fused_add_rmsnorm: residual[t] += x[t] (in place);  out[t] = rmsnorm(residual[t])

x, residual, out: (T, H) float32; w: (H,) uint16 bf16; eps a float. The mean square is accumulated in fp32.

Thread mapping: grid = (T,), one block of THREADS threads per row. Each thread strides over the row's
columns summing squares into a register, a block reduction (warp shuffles, then one value per warp through
shared memory) gives every thread the row's sum, and the same threads write the scaled columns. The row is
read twice (sum, then scale); the second read hits L1/L2 for a 2048-wide row.

Versions: v1 only.
"""

import math
from functools import lru_cache

from numba import cuda, float32

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import bf16_to_f32, block_sum

# The simulator runs one Python thread per CUDA thread: keep its blocks small.
# NOTE: 1024 threads on the GPU: at decode one row is the whole grid, and each pass of the strided loop is a
# round trip to memory before the next starts (the loads of a pass are used at once), so the row costs one
# memory latency per pass: 2 passes for H = 2048 instead of 8. At 256 threads the norm took about 7 us per
# call inside the batch-1 decode step (tools/profile_step.py, BENCHMARKS.md).
THREADS = 64 if SIMULATOR else 1024

# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _rmsnorm_kernel(fused: bool):
    @cuda.jit
    def rmsnorm_kernel(x, residual, weight, eps, out):
        scratch = cuda.shared.array(32, float32)
        row = cuda.blockIdx.x
        h = out.shape[1]
        squares = float32(0)
        for col in range(cuda.threadIdx.x, h, cuda.blockDim.x):
            value = x[row, col]
            if fused:
                value += residual[row, col]
                residual[row, col] = value
            squares += value * value
        # NOTE: fp32 accumulation of the squares, as the reference; eps inside the square root.
        inv_rms = float32(1) / math.sqrt(block_sum(squares, scratch) / float32(h) + float32(eps))
        for col in range(cuda.threadIdx.x, h, cuda.blockDim.x):
            # each thread re-reads only the columns it wrote itself, so no barrier is needed in between
            value = residual[row, col] if fused else x[row, col]
            out[row, col] = value * inv_rms * bf16_to_f32(weight[col])

    return rmsnorm_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def rmsnorm(x, weight, eps, out, stream=0):
    """out (T, H) float32 <- rmsnorm of x (T, H) float32 with bf16 weight (H,)."""
    _check_shapes(x, weight, out)
    if x.shape[0]:
        _rmsnorm_kernel(False)[x.shape[0], THREADS, stream](x, x, weight, eps, out)


def fused_add_rmsnorm(x, residual, weight, eps, out, stream=0):
    """residual += x in place; out <- rmsnorm(residual). All (T, H) float32; weight (H,) bf16."""
    _check_shapes(x, weight, out)
    if residual.shape != x.shape or residual.dtype.name != "float32":
        raise ValueError(f"residual: expected {tuple(x.shape)} float32, got {tuple(residual.shape)} {residual.dtype}")
    if x.shape[0]:
        _rmsnorm_kernel(True)[x.shape[0], THREADS, stream](x, residual, weight, eps, out)


def _check_shapes(x, weight, out):
    if x.ndim != 2 or x.dtype.name != "float32":
        raise ValueError(f"x: expected (T, H) float32, got {tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype.name != "uint16":
        raise ValueError(f"weight: expected ({x.shape[1]},) uint16 bf16, got {tuple(weight.shape)} {weight.dtype}")
    if out.shape != x.shape or out.dtype.name != "float32":
        raise ValueError(f"out: expected {tuple(x.shape)} float32, got {tuple(out.shape)} {out.dtype}")
