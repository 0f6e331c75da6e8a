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
strode over the row twice (sum, then scale) and loaded the weight after the reduction: three dependent
memory round trips plus the reduction. Now there is one round trip before the reduction and the stores after
it (the times: docs/performance.md, "RMSNorm").

With `planes` (a 1-D uint16 workspace; the engine passes it where the next matmul runs on gemm_pipelined),
each result is also written as its P bf16 planes, piece p of out[t, i] at planes[p * T * H + t * H + i]: the
layout gemm_pipelined.bf16_planes writes (P = 1, out rounded to bf16, or 3, the bf16x3 split), so the GEMM
that multiplies the normed rows next needs no conversion kernel of its own.

Versions: v1 (restructured as above); v2 the same with the planes output.
"""

import math
from functools import lru_cache

from numba import cuda, float32, uint32

from cuda_kernels import pdl
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.planes import planes_output, planes_store
from cuda_kernels.primitives import bf16_to_f32, block_sum

# The simulator runs one Python thread per CUDA thread: keep its blocks small.
# NOTE: 1024 threads on the GPU: at decode one row is the whole grid, so the more threads share it, the fewer
# loads each issues (2 for H = 2048; docs/performance.md, "RMSNorm").
THREADS = 64 if SIMULATOR else 1024

# ---------------------------------------------------------------------------------------------------------
# kernels


@lru_cache(maxsize=None)
def _rmsnorm_kernel(fused: bool, h: int, threads: int, pieces: int = 0):
    """pieces: 0 (no planes output), 1 or 3 (out's bf16 planes as well, see the module docstring)."""
    C = -(-h // threads)   # columns per thread
    store_planes = planes_store(pieces)
    # NOTE: unsigned 32-bit indices (a row, and the planes of all T rows, hold far fewer than 2^32 elements):
    # primitives' module docstring, "Index arithmetic".
    H = uint32(h)

    @cuda.jit(device=True, inline=True)
    def body(x, residual, weight, eps, out, planes):
        scratch = cuda.shared.array(32, float32)
        w = cuda.local.array(C, float32)
        v = cuda.local.array(C, float32)
        row = uint32(cuda.blockIdx.x)
        tid = uint32(cuda.threadIdx.x)
        pdl.launch_dependents()
        for i in range(C):
            col = uint32(tid + uint32(i * threads))
            w[i] = bf16_to_f32(weight[col]) if col < H else float32(0)
        pdl.grid_wait()
        squares = float32(0)
        for i in range(C):
            col = uint32(tid + uint32(i * threads))
            value = float32(0)
            if col < H:
                value = x[row, col]
                if fused:
                    value += residual[row, col]
                    residual[row, col] = value
            v[i] = value
            squares += value * value
        # NOTE: fp32 accumulation of the squares, as the reference; eps inside the square root.
        inv_rms = float32(1) / math.sqrt(block_sum(squares, scratch) / float32(h) + float32(eps))
        size = uint32(out.shape[0] * h)
        for i in range(C):
            col = uint32(tid + uint32(i * threads))
            if col < H:
                result = v[i] * inv_rms * w[i]
                out[row, col] = result
                store_planes(planes, size, uint32(row * H + col), result)

    if pieces:
        @cuda.jit
        def rmsnorm_planes_kernel(x, residual, weight, eps, out, planes):
            body(x, residual, weight, eps, out, planes)

        return rmsnorm_planes_kernel

    @cuda.jit
    def rmsnorm_kernel(x, residual, weight, eps, out):
        body(x, residual, weight, eps, out, weight)   # (no planes: their stores are compiled out)

    return rmsnorm_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers


def rmsnorm(x, weight, eps, out, stream=0, planes=None, bf16_inputs: bool = False):
    """out (T, H) float32 <- rmsnorm of x (T, H) float32 with bf16 weight (H,). planes: also out's bf16 planes
    (one, rounded, with bf16_inputs; else the three of the bf16x3 split) into this uint16 workspace."""
    _check_shapes(x, weight, out)
    _launch(False, x, x, weight, eps, out, stream, planes, bf16_inputs)


def fused_add_rmsnorm(x, residual, weight, eps, out, stream=0, planes=None, bf16_inputs: bool = False):
    """residual += x in place; out <- rmsnorm(residual). All (T, H) float32; weight (H,) bf16. planes: as
    rmsnorm's."""
    _check_shapes(x, weight, out)
    if residual.shape != x.shape or residual.dtype.name != "float32":
        raise ValueError(f"residual: expected {tuple(x.shape)} float32, got {tuple(residual.shape)} {residual.dtype}")
    _launch(True, x, residual, weight, eps, out, stream, planes, bf16_inputs)


def _launch(fused, x, residual, weight, eps, out, stream, planes, bf16_inputs):
    t, h = x.shape
    pieces, planes = planes_output(planes, out, bf16_inputs)
    if t:
        args = (x, residual, weight, eps, out) + ((planes,) if pieces else ())
        launch(_rmsnorm_kernel(fused, h, THREADS, pieces), t, THREADS, stream, *args, dependent=True)


def _check_shapes(x, weight, out):
    if x.ndim != 2 or x.dtype.name != "float32":
        raise ValueError(f"x: expected (T, H) float32, got {tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype.name != "uint16":
        raise ValueError(f"weight: expected ({x.shape[1]},) uint16 bf16, got {tuple(weight.shape)} {weight.dtype}")
    if out.shape != x.shape or out.dtype.name != "float32":
        raise ValueError(f"out: expected {tuple(x.shape)} float32, got {tuple(out.shape)} {out.dtype}")
