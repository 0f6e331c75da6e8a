"""RMSNorm, and the residual add fused with it (one pass over the row instead of two kernels).

    rmsnorm:           out[t, i] = x[t, i] / sqrt(mean_j x[t, j]^2 + eps) * w[i]
    fused_add_rmsnorm: residual[t] += x[t] (in place);  out[t] = rmsnorm(residual[t])

x, residual, out: (T, H) float32; w: (H,) uint16 bf16; eps a float. The mean square is accumulated in fp32.

Thread mapping: grid = (T,), one block of THREADS threads per row. Thread i owns columns i, i + THREADS, ...
(C = ceil(H / THREADS) of them, a compile-time count, so they live in registers): it loads them all at once,
sums their squares, a block reduction (warp shuffles, then one value per warp through shared memory) gives
every thread the row's sum, and it writes its scaled columns from the registers. The bf16 weight is loaded
before grid_wait (cuda_kernels/pdl.py), so under PDL that load overlaps the previous kernel.

NOTE: at decode one row is the whole grid, so the kernel is a chain of memory latencies. The first version
strode over the row twice (sum, then scale) and loaded the weight after the reduction. That made three
dependent memory round trips plus the reduction, about 3.6 us per call on the H200. Now there is one round
trip before the reduction and the stores after it.

Versions: v1 only (restructured as above).
"""

import math
from functools import lru_cache

from numba import cuda, float32

from cuda_kernels import pdl
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.primitives import bf16_to_f32, block_sum

# The simulator runs one Python thread per CUDA thread: keep its blocks small.
# NOTE: 1024 threads on the GPU: at decode one row is the whole grid, so the more threads share it, the fewer
# loads each issues (2 for H = 2048). The first version at 256 threads took about 7 us per call inside the
# batch-1 decode step (tools/profile_step.py, BENCHMARKS.md).
THREADS = 64 if SIMULATOR else 1024

# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _rmsnorm_kernel(fused: bool, h: int, threads: int):
    C = -(-h // threads)   # columns per thread

    @cuda.jit
    def rmsnorm_kernel(x, residual, weight, eps, out):
        scratch = cuda.shared.array(32, float32)
        w = cuda.local.array(C, float32)
        v = cuda.local.array(C, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        pdl.launch_dependents()
        for i in range(C):
            col = tid + i * threads
            w[i] = bf16_to_f32(weight[col]) if col < h else float32(0)
        pdl.grid_wait()
        squares = float32(0)
        for i in range(C):
            col = tid + i * threads
            value = float32(0)
            if col < h:
                value = x[row, col]
                if fused:
                    value += residual[row, col]
                    residual[row, col] = value
            v[i] = value
            squares += value * value
        # NOTE: fp32 accumulation of the squares, as the reference; eps inside the square root.
        inv_rms = float32(1) / math.sqrt(block_sum(squares, scratch) / float32(h) + float32(eps))
        for i in range(C):
            col = tid + i * threads
            if col < h:
                out[row, col] = v[i] * inv_rms * w[i]

    return rmsnorm_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def rmsnorm(x, weight, eps, out, stream=0):
    """out (T, H) float32 <- rmsnorm of x (T, H) float32 with bf16 weight (H,)."""
    _check_shapes(x, weight, out)
    if x.shape[0]:
        launch(_rmsnorm_kernel(False, x.shape[1], THREADS), x.shape[0], THREADS, stream, x, x, weight, eps, out,
               dependent=True)


def fused_add_rmsnorm(x, residual, weight, eps, out, stream=0):
    """residual += x in place; out <- rmsnorm(residual). All (T, H) float32; weight (H,) bf16."""
    _check_shapes(x, weight, out)
    if residual.shape != x.shape or residual.dtype.name != "float32":
        raise ValueError(f"residual: expected {tuple(x.shape)} float32, got {tuple(residual.shape)} {residual.dtype}")
    if x.shape[0]:
        launch(_rmsnorm_kernel(True, x.shape[1], THREADS), x.shape[0], THREADS, stream, x, residual, weight, eps,
               out, dependent=True)


def _check_shapes(x, weight, out):
    if x.ndim != 2 or x.dtype.name != "float32":
        raise ValueError(f"x: expected (T, H) float32, got {tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype.name != "uint16":
        raise ValueError(f"weight: expected ({x.shape[1]},) uint16 bf16, got {tuple(weight.shape)} {weight.dtype}")
    if out.shape != x.shape or out.dtype.name != "float32":
        raise ValueError(f"out: expected {tuple(x.shape)} float32, got {tuple(out.shape)} {out.dtype}")
