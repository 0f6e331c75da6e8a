"""The tensor-core GEMV: ``out = x @ W^T`` for a decode batch of a few dozen rows, each weight word streamed
once from DRAM straight into an mma fragment.

    out[m, n] = sum_k bf16(x[m, k]) * W[n, k]            (bf16 x bf16 products, exact in fp32)

x is given as its bf16 plane (uint16 (M, K), x rounded to the nearest bf16: gemm_pipelined.bf16_planes with
bf16_inputs, or the rmsnorm that wrote it); W (N, K) uint16 bf16 in nn.Linear layout; out (M, N) float32.
Needs K % 32 == 0 and M <= 8 * NT (NT, the n8 tiles, a compile-time constant). Twin: reference.matmul.matmul
with bf16_inputs=True (gated_matmul for the gated epilogue).

The idea. At M = 16-64 a decode matmul is still bound by reading W (M multiply-adds per weight byte pair is
far below the tensor cores' rate), but M rows are too many for gemv's CUDA-core FMAs. So keep gemv's memory
side (every weight word loaded once, straight into registers, many loads in flight per lane, K split over the
warps of a block, no shared-memory staging of W, no split over blocks) and do the arithmetic on tensor cores:
the weight is the mma's A operand (16 weight rows x 16 k), x^T its B operand (16 k x 8 rows of x), so one
mma.m16n8k16 multiplies 16 weight rows by 8 rows of x, and NT of them cover the batch.

The fragment trick. A sum over k does not care in which order the k arrive, as long as A and B agree. mma.py's
layout gives lane (g, t) = (lane // 4, lane % 4) the "logical" k pairs 2t, 2t+1 and 2t+8, 2t+9 of rows g and
g + 8 of A (and of column g of B). Here those four logical k are mapped to the four consecutive physical k
4t .. 4t+3 of the step's 16, so a lane's A registers for rows g and g + 8 are one uint64 word each (4 bf16:
low half a0/a1, high half a2/a3), and its B registers for x row n one uint64 word of that row (low half b0,
high half b1). Every operand is a plain 8-byte load; the four lanes of a group read 32 contiguous bytes of a
row. A chunk of 32 k is two mma k-steps: step s reads the words 8c + 4s + t of the rows (c the chunk).

Thread mapping (``gemv_tc``, a GemvTcConfig(k_warps, row_warps, unroll, pipelined)): grid = ceil(N / (16 *
row_warps)) blocks (gated: ceil(F / (8 * row_warps))), block = 32 * k_warps * row_warps threads. Warp w owns
the 16-row tile r = blockIdx.x * row_warps + w // k_warps of W and the K part p = w % k_warps. Plain, tile r
is weight rows 16 r .. 16 r + 15 (A rows g and g + 8 are rows 16 r + g and 16 r + g + 8); gated (W = [gate;
up], 2F rows), A row g is gate row 8 r + g and A row g + 8 up row F + 8 r + g, so a lane's accumulators for
D rows g and g + 8 are the gate and the up value of the same feature and the same x row: silu(gate) * up
needs no exchange. The 32-k chunks are taken in passes of k_warps * unroll: in pass i part p takes chunks
(i * k_warps + p) * unroll + u, u < unroll, all 4 * unroll weight words of a pass loaded before the first
is used (pipelined: the next pass's words are loaded before this one is multiplied, into a second set of
registers). Lane (g, t) accumulates D[g, 2t], D[g, 2t+1], D[g+8, 2t], D[g+8, 2t+1] of each n8 tile j, i.e.
out[8j + 2t (+1), row]. With k_warps > 1 the parts meet in shared memory ([row warp][part][accumulator][lane],
consecutive lanes, consecutive words) and part 0 adds them in part order: deterministic, and no atomics or
second kernel. Warps past the last row tile work on a clamped valid row and skip the stores; chunks past K
and x rows past M are zeros (every warp of a block runs the same mma sequence: the simulator's mma
synchronises the block).

Programmatic dependent launch: the first pass's weight words (pipelined: two passes) are loaded before
pdl.grid_wait (weights are never written), as gemv does; x is read after it.

Epilogues (compile-time; gemv.epilogue_rows' row pairings and stores, shared with gemv): plain, out (M, N)
float32; "gated", out (M, F) = silu(gate) * up; "gated_planes", the same as a uint16 bf16 plane, which the
down projection multiplies next (matmul.mlp), so the activation never exists in fp32; "rope" (gemv_tc_rope,
the QKV projection), A rows g and g + 8 are rows i and i + d/2 of a head, rotated in the epilogue and written
as rope.rope_kv_write would (q; K and V into the cache in its format), so no qkv intermediate and no RoPE
kernel.

Versions (continuing matmul.py's list): 8. this kernel, for bf16 inputs at M between gemv's rows and 64, where
gemm_pipelined's skinny plan stages W through shared memory and adds split-K partials across blocks. It wins on
small weights and loses on large ones (each warp reads x's fragments itself, one load per n8 tile and k-step,
where the skinny plan stages x once per block): matmul.uses_gemv_tc picks it by shape, gemv_tc_config its
configuration, both as timed with ``python -m tools.kernel_benchmarks.matmul --gemv-tc``
(docs/performance.md, "gemv_tc").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels import kv_format, pdl, rope
from cuda_kernels.gemv_epilogues import epilogue_rows
from cuda_kernels.launch import launch, view
from cuda_kernels.mma import halves, mma_bf16_m16n8k16
from cuda_kernels.primitives import WARP
from numba import cuda, float32, uint64

CHUNK_K = 32                 # k per chunk: two mma k-steps of 16
MAX_NT = 8                   # n8 tiles of x rows: M <= 64
PAIRINGS = ("", "gated", "gated_planes", "rope")   # the epilogues (gemv.epilogue_rows)
SHARED_LIMIT = 48 * 1024     # static shared memory of the K-part reduction


class GemvTcConfig(NamedTuple):
    """K parts per row tile (warps that split K), row tiles per block (16 weight rows each), chunks of 32 k
    per part and pass, and whether the next pass's weight words are loaded before this pass is multiplied."""
    k_warps: int = 4
    row_warps: int = 1
    unroll: int = 4
    pipelined: bool = False


def n_tiles(m: int) -> int:
    """The n8 tiles that cover m rows of x, as compiled: 2, 4 or 8 (a few kernel variants serve every M)."""
    return next(nt for nt in (2, 4, MAX_NT) if 8 * nt >= m)


def reduction_bytes(config: GemvTcConfig, nt: int) -> int:
    """Shared memory of the K-part reduction (0 for one part)."""
    k_warps, row_warps = config.k_warps, config.row_warps
    return 0 if k_warps == 1 else row_warps * k_warps * 4 * nt * WARP * 4


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gemv_tc_kernel(nt: int, k_warps: int, row_warps: int, unroll: int, pipelined: bool, pairing: str = "",
                    head_dim: int = 0, fmt: str = "bf16"):
    """The kernel for NT n8 tiles, one configuration and one epilogue (pairing: "" plain, "gated",
    "gated_planes" or "rope", gemv.epilogue_rows' stores; head_dim and fmt for rope). The mapping: the
    module docstring."""
    config = GemvTcConfig(k_warps, row_warps, unroll, pipelined)
    if pairing not in PAIRINGS or nt < 1 or min(k_warps, row_warps, unroll) < 1:
        raise ValueError(f"gemv_tc: no kernel for {config}, {nt} n8 tiles, pairing {pairing!r}")
    if reduction_bytes(config, nt) > SHARED_LIMIT or 32 * k_warps * row_warps > 1024:
        raise ValueError(f"gemv_tc: {config} with {nt} n8 tiles needs more than one block's resources")
    KW, RW, U, NT = k_warps, row_warps, unroll, nt
    NACC = 4 * NT                # accumulators per lane: four per n8 tile
    NWORDS = 4 * U               # weight words per lane and pass: 2 rows x 2 steps x unroll chunks
    PASS = KW * U                # chunks per pass of the block's row tile
    PAIRED = pairing != ""
    RED_SHAPE = (RW, KW, NACC, WARP) if KW > 1 else (1, 1, 1, 1)
    weight_row, store_inputs, store = epilogue_rows(16, pairing, head_dim, fmt)

    @cuda.jit(device=True, inline=True)
    def load_pass(w64, words, row_a, row_b, c0, chunks, t):
        """The weight words of chunks c0 .. c0 + U - 1 for rows row_a, row_b (zeros past the last chunk)."""
        for u in range(U):
            c = c0 + u
            if c < chunks:
                words[4 * u] = w64[row_a, 8 * c + t]
                words[4 * u + 1] = w64[row_a, 8 * c + 4 + t]
                words[4 * u + 2] = w64[row_b, 8 * c + t]
                words[4 * u + 3] = w64[row_b, 8 * c + 4 + t]
            else:
                for i in range(4):
                    words[4 * u + i] = uint64(0)

    @cuda.jit(device=True, inline=True)
    def multiply_pass(x64, words, acc, c0, chunks, M, g, t):
        """acc += the pass's 16-row weight tile times x^T, two mma k-steps per chunk and n8 tile; x64 flat,
        row n's words at n * 8 * chunks."""
        for u in range(U):
            c = c0 + u
            for s in range(2):
                a0, a2 = halves(words[4 * u + s])
                a1, a3 = halves(words[4 * u + 2 + s])
                for j in range(NT):
                    n = 8 * j + g
                    xw = uint64(0)
                    if n < M and c < chunks:
                        xw = x64[(n * chunks + c) * 8 + 4 * s + t]
                    b0, b1 = halves(xw)
                    d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, acc[4 * j], acc[4 * j + 1],
                                                       acc[4 * j + 2], acc[4 * j + 3])
                    acc[4 * j] = d0
                    acc[4 * j + 1] = d1
                    acc[4 * j + 2] = d2
                    acc[4 * j + 3] = d3

    @cuda.jit(device=True, inline=True)
    def body(x64, w64, dst, M):
        """x64 (>= M * K/4,) u64: x's bf16 plane, 4 per word, row-major; w64 (N, K/4) u64: W, 4 bf16 per word;
        dst: the arrays the store writes (gemv.epilogue_rows)."""
        N = w64.shape[0]
        chunks = w64.shape[1] // 8
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        g, t = lane // 4, lane % 4
        part, rgroup = warp % KW, warp // KW
        n0 = 16 * (cuda.blockIdx.x * RW + rgroup)      # the row tile's first row (paired: 2 x its first pair)
        row_a, row_b = weight_row(n0, g, N), weight_row(n0, g + 8, N)
        acc = cuda.local.array(NACC, float32)
        words = cuda.local.array(NWORDS, uint64)   # the pass being multiplied
        ahead = cuda.local.array(NWORDS, uint64)   # pipelined: the next pass, in flight
        for i in range(NACC):
            acc[i] = float32(0)

        pdl.launch_dependents()
        c0 = part * U
        load_pass(w64, words, row_a, row_b, c0, chunks, t)
        if pipelined:
            load_pass(w64, ahead, row_a, row_b, c0 + PASS, chunks, t)
        pdl.grid_wait()
        for _ in range((chunks + PASS - 1) // PASS):
            multiply_pass(x64, words, acc, c0, chunks, M, g, t)
            c0 += PASS
            if pipelined:
                for i in range(NWORDS):
                    words[i] = ahead[i]
                load_pass(w64, ahead, row_a, row_b, c0 + PASS, chunks, t)
            else:
                load_pass(w64, words, row_a, row_b, c0, chunks, t)

        if KW > 1:
            # the K parts of a row tile meet in shared memory; part 0 adds them in part order
            red = cuda.shared.array(RED_SHAPE, float32)
            for i in range(NACC):
                red[rgroup, part, i, lane] = acc[i]
            cuda.syncthreads()
            if part == 0:
                for i in range(NACC):
                    total = red[rgroup, 0, i, lane]
                    for p in range(1, KW):
                        total += red[rgroup, p, i, lane]
                    acc[i] = total
        if part == 0:
            # lane (g, t) holds D rows g and g + 8 (paired: the two rows of pair n0 / 2 + g) for x rows 8j + 2t + h
            for j in range(NT):
                for h in range(2):
                    m = 8 * j + 2 * t + h
                    a, b = acc[4 * j + h], acc[4 * j + 2 + h]
                    if m < M:
                        if PAIRED:
                            pair = n0 // 2 + g
                            if pair < N // 2:
                                store(dst, m, pair, a, b, store_inputs(dst, m, pair))
                        else:
                            if n0 + g < N:
                                store(dst, m, n0 + g, a, a, 0)
                            if n0 + g + 8 < N:
                                store(dst, m, n0 + g + 8, b, b, 0)

    @cuda.jit
    def gemv_tc_kernel(x64, w64, out):
        # out (M, N) f32; gated (M, N/2) f32, or u16 for gated_planes
        body(x64, w64, (out,), out.shape[0])

    @cuda.jit
    def gemv_tc_rope_kernel(x64, w64, q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        # q_out (M, Hq, d) f32 and the rest as rope.rope_kv_write takes them (gemv.gemv_rope's arguments)
        body(x64, w64, (q_out, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale),
             q_out.shape[0])

    kernel = gemv_tc_rope_kernel if pairing == "rope" else gemv_tc_kernel
    kernel.threads = 32 * KW * RW
    return kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def gemv_tc(planes, m: int, weight, out, stream=0, config: GemvTcConfig | None = None, gated: bool = False):
    """out = x @ W^T (gated: silu(x @ gate^T) * (x @ up^T) for W = [gate; up]) for x (m, K) given as its bf16
    plane: planes, a C-contiguous uint16 device array of >= m * K elements (any shape: a flat workspace, or
    an (m, K) plane), x rounded to bf16 row by row (gemm_pipelined.bf16_planes with bf16_inputs).
    weight (N, K) uint16 C-contiguous, K % 32 == 0; out float32 (m, cols), or, gated, uint16 (m, cols) for
    the bf16 plane of the result (cols = N, or N / 2 gated); m <= 8 * MAX_NT."""
    N, K = _check(planes, m, weight, gated)
    cols = N // 2 if gated else N
    kinds = (np.float32, np.uint16) if gated else (np.float32,)
    if out.dtype not in kinds or tuple(out.shape) != (m, cols):
        raise ValueError(f"gemv_tc: out must be {'float32 or uint16' if gated else 'float32'} ({m}, {cols}), got "
                         f"{out.dtype} {tuple(out.shape)}")
    pairing = ("gated_planes" if out.dtype == np.uint16 else "gated") if gated else ""
    _launch(planes, m, weight, config, stream, pairing, 0, "bf16", out)


def gemv_tc_rope(planes, m: int, weight, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, stream=0,
                 config: GemvTcConfig | None = None, k_scale=1.0, v_scale=1.0):
    """The QKV projection with rope.rope_kv_write as its epilogue (as gemv.gemv_rope, for the rows gemv_tc
    serves): of qkv = x @ W^T only the rotated q (q_out (m, Hq, d)) and each token's rotated K and its V
    (into the caches at slot_mapping, in their kv_format) are written. x as gemv_tc's planes; weight the
    fused QKV weight ((Hq + 2 Hkv) d, K); the rest as rope.rope_kv_write takes them."""
    N, K = _check(planes, m, weight, True)
    t, hq, hkv, d = rope.check_rope_args(positions, cos, sin, k_cache, v_cache, slot_mapping, q_out)
    fmt = kv_format.format_of(k_cache)
    k_scale, v_scale = kv_format.check_scales(fmt, k_scale, v_scale)
    if (m, N) != (t, (hq + 2 * hkv) * d):
        raise ValueError(f"gemv_tc_rope: x ({m}, {K}) and weight ({N}, {K}) give a ({m}, {N}) product; q_out and the "
                         f"caches need ({t}, {(hq + 2 * hkv) * d}) for Hq={hq}, Hkv={hkv}, d={d}")
    _launch(planes, m, weight, config, stream, "rope", d, fmt, q_out, positions, cos, sin, k_cache, v_cache,
            slot_mapping, k_scale, v_scale)


def _check(planes, m: int, weight, paired: bool) -> tuple[int, int]:
    """Check gemv_tc's x planes and weight; (N, K)."""
    N, K = weight.shape
    if weight.dtype != np.uint16 or not weight.is_c_contiguous():
        raise ValueError(f"gemv_tc: weight must be C-contiguous uint16 ({N}, {K}), got {weight.dtype}")
    if K % CHUNK_K or (paired and N % 2):
        raise ValueError(f"gemv_tc: needs K % {CHUNK_K} == 0 (and an even number of rows paired), got ({N}, {K})")
    if not 1 <= m <= 8 * MAX_NT:
        raise ValueError(f"gemv_tc: m must be 1 .. {8 * MAX_NT}, got {m}")
    size = int(np.prod(planes.shape))
    if planes.dtype != np.uint16 or not planes.is_c_contiguous() or size < m * K or size % 4:
        raise ValueError(f"gemv_tc: planes must be a C-contiguous uint16 array of at least {m * K} elements (a "
                         f"multiple of 4), got {planes.dtype} {tuple(planes.shape)}")
    return N, K


def _launch(planes, m: int, weight, config, stream, pairing: str, head_dim: int, fmt: str, *outputs):
    config = GemvTcConfig(*config) if config else GemvTcConfig()
    N, K = weight.shape
    kernel = _gemv_tc_kernel(n_tiles(m), *config, pairing, head_dim, fmt)
    # the whole workspace as uint64 words (a slice would be a new device array per launch)
    x64 = view(planes, (int(np.prod(planes.shape)) // 4,), np.uint64)
    launch(kernel, -(-N // (16 * config.row_warps)), kernel.threads, stream, x64,
           view(weight, (N, K // 4), np.uint64), *outputs, dependent=True)
