"""Matmul against bf16 weights on the CUDA cores (no tensor cores): the naive kernel and the tiled GEMM.

    out[m, n] = sum_k x[m, k] * bf16_to_f32(W[n, k])        (with bf16_inputs: bf16(x[m, k]) instead of x)

x (M, K) float32 activations; W (N, K) uint16 bf16 bit patterns in nn.Linear layout (one row per output
feature); out (M, N) float32, written by the kernel (the caller allocates it). Every product is exact in fp32
and the sums are fp32, so a kernel differs from reference.matmul.matmul(x, W, bf16_inputs) only in the order
of its sums. Twin: reference/matmul.py. With bf16_inputs every x is rounded to the nearest bf16 (ties to
even, primitives.round_bf16) as it is read, as vLLM and HF transformers do.

Thread mappings:

- ``matmul_naive``: grid = (ceil(N / 128), M), block = (128, 1); thread (n, m) computes out[m, n] with a
  plain loop over K.
- ``gemm``: grid = (ceil(N / BN), ceil(M / BM)), block = (BM / TM) * (BN / TN) threads; a block computes a
  BM x BN tile of out, staging BK-wide slabs of x and of W (widened to fp32) through shared memory; thread
  (tx, ty) owns the TM x TN outputs (ty + i * BM/TM, tx + j * BN/TN).

Versions (the matmul ladder; matmul.py's docstring lists all of them):
1. matmul_naive: one thread per output. Neighbouring threads read W rows K elements apart, so no weight load
   is coalesced, and each weight is read once per row of x. The teaching baseline of both the GEMV
   (gemv.py) and the GEMM (gemm_tc.py) ladders.
3. gemm: shared-memory tiled fp32 GEMM with a register tile per thread. A slab of W staged once serves BM
   rows of x, and each thread reuses every value it loads TM or TN times from registers. CUDA-core FMAs
   bound it far below the tensor cores (docs/performance.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32

from cuda_kernels.launch import launch
from cuda_kernels.matmul_args import check_args
from cuda_kernels.primitives import WARP, bf16_to_f32, round_bf16

_NAIVE_BLOCK_N = 128


class GemmTile(NamedTuple):
    bm: int = 64   # output tile rows (M)
    bn: int = 64   # output tile columns (N)
    bk: int = 16   # K slab staged in shared memory per step
    tm: int = 4    # outputs per thread along M
    tn: int = 4    # outputs per thread along N


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _matmul_naive_kernel(bf16_inputs: bool):
    """The naive kernel; with bf16_inputs every x is rounded to the nearest bf16 as it is read."""

    @cuda.jit
    def matmul_naive_kernel(x, weight, out):
        """x (M, K) f32, weight (N, K) u16 bf16, out (M, N) f32. Thread (n, m) computes out[m, n]."""
        n, m = cuda.grid(2)
        if m >= x.shape[0] or n >= weight.shape[0]:
            return
        # NOTE: neighbouring threads read W rows K elements apart (uncoalesced); gemv fixes that by giving a
        # row to a warp. fp32 accumulation throughout, as everywhere in the project.
        acc = float32(0)
        for k in range(x.shape[1]):
            xv = round_bf16(x[m, k]) if bf16_inputs else x[m, k]
            acc += xv * bf16_to_f32(weight[n, k])
        out[m, n] = acc

    return matmul_naive_kernel


@functools.lru_cache(maxsize=None)
def _gemm_kernel(bm: int, bn: int, bk: int, tm: int, tn: int, bf16_inputs: bool):
    """The tiled gemm kernel for a BM x BN output tile, BK-wide K slabs and a TM x TN register tile; with
    bf16_inputs every x is rounded to the nearest bf16 as it is staged."""
    if bm % tm or bn % tn:
        raise ValueError(f"tile ({bm}, {bn}) is not a multiple of the thread tile ({tm}, {tn})")
    TX = bn // tn                 # threads along N
    TY = bm // tm                 # threads along M
    THREADS = TX * TY
    if THREADS % WARP or THREADS > 1024:
        raise ValueError(f"gemm tile gives {THREADS} threads per block: need a multiple of 32, at most 1024")
    if (bm * bk) % THREADS or (bn * bk) % THREADS:
        raise ValueError(f"the {bm}x{bk} and {bn}x{bk} slabs must split evenly over {THREADS} threads")
    X_LOADS = bm * bk // THREADS
    W_LOADS = bn * bk // THREADS
    # NOTE: the slabs are stored transposed (k major) so the inner loop reads a row of BM (or BN) values.
    # The loads walk k fastest (coalesced in global memory) and so write shared memory with a stride of one
    # padded row; 32 // BK rows of a warp land on distinct banks when the row length is BM + 32 // BK.
    PAD = max(1, WARP // bk)
    XS_COLS = bm + PAD
    WS_COLS = bn + PAD

    @cuda.jit
    def gemm_kernel(x, weight, out):
        """x (M, K) f32, weight (N, K) u16 bf16, out (M, N) f32; block (bx, by) computes the out tile
        [by*BM : by*BM+BM, bx*BN : bx*BN+BN]."""
        M = x.shape[0]
        K = x.shape[1]
        N = weight.shape[0]
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn

        xs = cuda.shared.array((bk, XS_COLS), float32)   # xs[k, m] = x[m0 + m, k0 + k]
        ws = cuda.shared.array((bk, WS_COLS), float32)   # ws[k, n] = W[n0 + n, k0 + k] widened
        acc = cuda.local.array((tm, tn), float32)
        a = cuda.local.array(tm, float32)
        b = cuda.local.array(tn, float32)
        for i in range(tm):
            for j in range(tn):
                acc[i, j] = float32(0)

        for k0 in range(0, K, bk):
            # Stage the slabs; zeros past the edges of x and W make the inner loop edge-free.
            for e in range(X_LOADS):
                idx = tid + THREADS * e
                r = idx // bk
                c = idx % bk
                m = m0 + r
                k = k0 + c
                xv = x[m, k] if m < M and k < K else float32(0)
                xs[c, r] = round_bf16(xv) if bf16_inputs else xv
            for e in range(W_LOADS):
                idx = tid + THREADS * e
                r = idx // bk
                c = idx % bk
                n = n0 + r
                k = k0 + c
                ws[c, r] = bf16_to_f32(weight[n, k]) if n < N and k < K else float32(0)
            cuda.syncthreads()

            for kk in range(bk):
                for i in range(tm):
                    a[i] = xs[kk, ty + TY * i]
                for j in range(tn):
                    b[j] = ws[kk, tx + TX * j]
                for i in range(tm):
                    for j in range(tn):
                        acc[i, j] += a[i] * b[j]
            cuda.syncthreads()  # the next slab overwrites xs and ws

        for i in range(tm):
            m = m0 + ty + TY * i
            if m < M:
                for j in range(tn):
                    n = n0 + tx + TX * j
                    if n < N:
                        out[m, n] = acc[i, j]

    gemm_kernel.threads = THREADS
    return gemm_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def matmul_naive(x, weight, out, stream=0, bf16_inputs: bool = False):
    """out = x @ W^T, one thread per output element (the teaching baseline); x rounded to bf16 first if asked."""
    M, N, _ = check_args(x, weight, out)
    if M == 0 or N == 0:
        return
    grid = ((N + _NAIVE_BLOCK_N - 1) // _NAIVE_BLOCK_N, M)
    _matmul_naive_kernel(bool(bf16_inputs))[grid, (_NAIVE_BLOCK_N, 1), stream](x, weight, out)


def gemm(x, weight, out, stream=0, tile: GemmTile = GemmTile(), bf16_inputs: bool = False):
    """out = x @ W^T for large M (prefill): shared-memory tiled fp32 GEMM, any M, N, K; x rounded to bf16
    first if asked."""
    M, N, _ = check_args(x, weight, out)
    if M == 0 or N == 0:
        return
    kernel = _gemm_kernel(*tile, bool(bf16_inputs))
    grid = ((N + tile.bn - 1) // tile.bn, (M + tile.bm - 1) // tile.bm)
    launch(kernel, grid, kernel.threads, stream, x, weight, out)
