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

Thread mapping (``gemv_tc``, a GemvTcConfig(k_warps, row_warps, unroll, pipelined, row_tiles)): R =
row_tiles; grid = ceil(N / (16 * R * row_warps)) blocks (gated: ceil(F / (8 * R * row_warps))), block = 32 *
k_warps * row_warps threads. Warp w of block b is K part p = w % k_warps of row group q = b * row_warps + w //
k_warps, and a row group is R consecutive 16-row tiles of W: tiles q R .. q R + R - 1, weight rows n0 = 16 R q
.. n0 + 16 R - 1 (tile r's first row n0 + 16 r). Plain, tile r's A rows g and g + 8 are weight rows n0 + 16 r
+ g and n0 + 16 r + g + 8; gated (W = [gate; up], 2F rows), tile r's A row g is gate row n0 / 2 + 8 r + g and
A row g + 8 up row F + n0 / 2 + 8 r + g, so a lane's accumulators for D rows g and g + 8 are the gate and the
up value of the same feature and the same x row: silu(gate) * up needs no exchange (rope: rows i and i + d/2
of a head, the same way; gemv_epilogues.epilogue_rows' weight_row, called per tile). The 32-k chunks are taken in
passes of k_warps * unroll: in pass i part p takes chunks (i * k_warps + p) * unroll + u, u < unroll, of all
R tiles, all 4 * unroll * R weight words of a pass loaded before the first is used (pipelined: the next pass's
words are loaded before this one is multiplied, into a second set of registers). Lane (g, t) accumulates
D[g, 2t], D[g, 2t+1], D[g+8, 2t], D[g+8, 2t+1] of each row tile r and n8 tile j (4 * NT * R accumulators),
i.e. out[8j + 2t (+1), row]. With k_warps > 1 the parts meet in shared memory ([row warp][part][accumulator]
[lane], consecutive lanes, consecutive words), one row tile at a time, and every part adds them in part order
for its share of the tile's outputs and stores those (the tail, below): deterministic, and no atomics or
second kernel. Warps past the last row tile work on a clamped valid row and skip the stores; chunks past K and
x rows past M are zeros (every warp of a block runs the same mma sequence: the simulator's mma synchronises
the block).

Row tiles (R). Every k-step a warp loads x's B fragments, one 8-byte word per lane and n8 tile (NT words), and
its weight's A fragments, two words per row tile. With one tile a warp (R = 1) x is read from L1/L2 once per 16
weight rows: NT / 2 x words per weight word, 4 at M = 64, so a large weight (gate/up: 67 MB) drags about four
times its size through L2 in x fragments. With R tiles a k-step's NT x words are loaded once into registers and
each feeds R mma (one per tile), so x traffic falls by R, for 4 * NT * R accumulators and 4 * unroll * R weight
words per lane (registers: keep unroll * R small where NT * R is large). The R tiles of a warp are consecutive:
which tiles a warp takes does not change the loads (each load instruction reads 32 contiguous bytes of 8 rows
whichever the tiles, and a row's words of a pass are 64 * unroll contiguous bytes) nor the stores (a tile's
store writes 8 consecutive outputs of 4 x rows), and consecutive tiles keep a row group's outputs one contiguous
run of 16 R columns (gated, rope: 8 R pairs) and the grid's tail in one place. The K-part reduction takes the
tiles one at a time through the same buffer (2 R - 1 block barriers), so its shared memory does not grow with R:
reduction_bytes, at most SHARED_LIMIT.

The tail (k_warps > 1). A row tile's outputs are 2 NT half tiles (j, h): x row 8j + 2t + h of lane (g, t),
two accumulators a lane (D rows g and g + 8), each summed over the parts, and one store (paired) or two
(plain). Part p takes the half tiles with (2j + h) % k_warps == p: it reads their parts from shared memory,
adds them and runs the epilogue (SiLU, the RoPE rotation and the KV-cache encode included). gemv_tc's first
tail had part 0 do all of that alone while the other k_warps - 1 warps of the row group waited; now up to
min(k_warps, 2 NT) warps share it (half tiles rather than n8 tiles, so that the policy's 8 parts have 4 and
8 busy warps at 2 and 4 n8 tiles, not 2 and 4). Each half tile is still added in part order 0, 1, ..,
starting from part 0's value, so the results are bit for bit those of the first tail; the shared buffer, the
barriers and the stores (8 columns of 4 x rows an instruction, whichever warp issues it) are unchanged.

Programmatic dependent launch: the first pass's weight words (pipelined: two passes) are loaded before
pdl.grid_wait (weights are never written), as gemv does; x is read after it.

Epilogues (compile-time; gemv_epilogues.epilogue_rows' row pairings and stores, shared with gemv): plain, out (M, N)
float32; "gated", out (M, F) = silu(gate) * up; "gated_planes", the same as a uint16 bf16 plane, which the
down projection multiplies next (matmul.mlp), so the activation never exists in fp32; "rope" (gemv_tc_rope,
the QKV projection), A rows g and g + 8 are rows i and i + d/2 of a head, rotated in the epilogue and written
as rope.rope_kv_write would (q; K and V into the cache in its format), so no qkv intermediate and no RoPE
kernel.

Versions (continuing matmul.py's list): 8. this kernel, for bf16 inputs at M between gemv's rows and 64, where
gemm_pipelined's skinny plan stages W through shared memory and adds split-K partials across blocks. It wins on
small weights and loses on large ones (each warp reads x's fragments itself, one load per n8 tile and k-step,
where the skinny plan stages x once per block; row_tiles > 1 divides those x reads): matmul_policy.uses_gemv_tc
picks it by shape, gemv_tc_config its configuration, both as timed with ``python -m
tools.kernel_benchmarks.matmul --gemv-tc`` (docs/performance.md, "gemv_tc").
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
from numba import cuda, float32, int64, uint64

CHUNK_K = 32                 # k per chunk: two mma k-steps of 16
MAX_NT = 8                   # n8 tiles of x rows: M <= 64
PAIRINGS = ("", "gated", "gated_planes", "rope")   # the epilogues (gemv_epilogues.epilogue_rows)
SHARED_LIMIT = 48 * 1024     # static shared memory of the K-part reduction


class GemvTcConfig(NamedTuple):
    """K parts per row group (warps that split K), row groups per block, chunks of 32 k per part and pass,
    whether the next pass's weight words are loaded before this pass is multiplied, and 16-row tiles per row
    group (each x fragment a warp loads is multiplied by all of them: x read once per 16 * row_tiles rows)."""
    k_warps: int = 4
    row_warps: int = 1
    unroll: int = 4
    pipelined: bool = False
    row_tiles: int = 1


def n_tiles(m: int) -> int:
    """The n8 tiles that cover m rows of x, as compiled: 2, 4 or 8 (a few kernel variants serve every M)."""
    return next(nt for nt in (2, 4, MAX_NT) if 8 * nt >= m)


def reduction_bytes(config: GemvTcConfig, nt: int) -> int:
    """Shared memory of the K-part reduction (0 for one part): one row tile's accumulators of every part of
    every row group of a block (the tiles of a group go through it one after another, so row_tiles does not
    count)."""
    k_warps, row_warps = config.k_warps, config.row_warps
    return 0 if k_warps == 1 else row_warps * k_warps * 4 * nt * WARP * 4


def check_config(config: GemvTcConfig, nt: int) -> None:
    """ValueError unless a block of `config` at nt n8 tiles can run: every field at least 1, at most 1024
    threads, and the K-part reduction within SHARED_LIMIT."""
    if nt < 1 or min(config.k_warps, config.row_warps, config.unroll, config.row_tiles) < 1:
        raise ValueError(f"gemv_tc: {config} with {nt} n8 tiles: every count must be at least 1")
    threads = 32 * config.k_warps * config.row_warps
    if threads > 1024:
        raise ValueError(f"gemv_tc: {config} is {threads} threads a block (32 x k_warps x row_warps), over 1024")
    if reduction_bytes(config, nt) > SHARED_LIMIT:
        raise ValueError(f"gemv_tc: {config} with {nt} n8 tiles needs {reduction_bytes(config, nt)} bytes of shared "
                         f"memory for its K-part reduction (row_warps x k_warps x {4 * nt} accumulators x 32 lanes "
                         f"x 4 bytes), over SHARED_LIMIT ({SHARED_LIMIT}): use fewer k_warps or row_warps")


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gemv_tc_kernel(nt: int, config: GemvTcConfig, pairing: str = "", head_dim: int = 0, fmt: str = "bf16"):
    """The kernel for NT n8 tiles, one configuration and one epilogue (pairing: "" plain, "gated",
    "gated_planes" or "rope", gemv_epilogues.epilogue_rows' stores; head_dim and fmt for rope). The mapping: the
    module docstring."""
    config = GemvTcConfig(*config)
    if pairing not in PAIRINGS:
        raise ValueError(f"gemv_tc: no epilogue {pairing!r} (one of {PAIRINGS})")
    check_config(config, nt)
    KW, RW, U, R, NT = config.k_warps, config.row_warps, config.unroll, config.row_tiles, nt
    pipelined = config.pipelined
    NACC = 4 * NT                # accumulators per lane and row tile: four per n8 tile
    NACC_ALL = R * NACC          # accumulators per lane (tile r's at r * NACC)
    NWORDS = 4 * U * R           # weight words per lane and pass: R tiles x 2 rows x 2 steps x unroll chunks
    PASS = KW * U                # chunks per pass of the block's row groups
    R2 = 2 * R                   # A rows per lane: rows g and g + 8 of each tile
    PAIRED = pairing != ""
    RED_SHAPE = (RW, KW, NACC, WARP) if KW > 1 else (1, 1, 1, 1)
    weight_row, store_inputs, store = epilogue_rows(16, pairing, head_dim, fmt)

    @cuda.jit(device=True, inline=True)
    def load_pass(w64, words, rows, c0, chunks, t):
        """The weight words of chunks c0 .. c0 + U - 1 of each row tile r, whose A rows g and g + 8 are weight
        rows rows[2r] and rows[2r + 1] (zeros past the last chunk)."""
        for r in range(R):
            for u in range(U):
                c = c0 + u
                w = 4 * (r * U + u)
                if c < chunks:
                    words[w] = w64[rows[2 * r], 8 * c + t]
                    words[w + 1] = w64[rows[2 * r], 8 * c + 4 + t]
                    words[w + 2] = w64[rows[2 * r + 1], 8 * c + t]
                    words[w + 3] = w64[rows[2 * r + 1], 8 * c + 4 + t]
                else:
                    for i in range(4):
                        words[w + i] = uint64(0)

    @cuda.jit(device=True, inline=True)
    def multiply_pass(x64, words, xs, acc, c0, chunks, M, g, t):
        """acc += each of the pass's R 16-row weight tiles times x^T, two mma k-steps per chunk, n8 tile and
        row tile; x64 flat, row n's words at n * 8 * chunks. A k-step's x words (B fragments) are loaded once,
        into xs, for all R tiles."""
        for u in range(U):
            c = c0 + u
            for s in range(2):
                for j in range(NT):
                    n = 8 * j + g
                    xs[j] = uint64(0)
                    if n < M and c < chunks:
                        xs[j] = x64[(n * chunks + c) * 8 + 4 * s + t]
                for r in range(R):
                    w = 4 * (r * U + u)
                    a0, a2 = halves(words[w + s])
                    a1, a3 = halves(words[w + 2 + s])
                    for j in range(NT):
                        b0, b1 = halves(xs[j])
                        i = r * NACC + 4 * j
                        d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, acc[i], acc[i + 1], acc[i + 2],
                                                           acc[i + 3])
                        acc[i] = d0
                        acc[i + 1] = d1
                        acc[i + 2] = d2
                        acc[i + 3] = d3

    @cuda.jit(device=True, inline=True)
    def part_sum(acc, red, rgroup, i, lane):
        """Accumulator i of the row tile summed over the K parts in part order 0, 1, .. (one part: acc[i])."""
        if KW == 1:
            return acc[i]
        total = red[rgroup, 0, i, lane]
        for p in range(1, KW):
            total += red[rgroup, p, i, lane]
        return total

    @cuda.jit(device=True, inline=True)
    def store_tile(dst, acc, red, n0, M, N, part, rgroup, lane):
        """Write this K part's share of the row tile whose first weight row is n0 (paired: 2 x its first pair):
        the half tiles (j, h) with (2j + h) % KW == part. Lane (g, t) holds D rows g and g + 8 (paired: the two
        rows of pair n0 / 2 + g) for x row 8j + 2t + h in accumulators 4j + h and 4j + 2 + h."""
        g, t = lane // 4, lane % 4
        for j in range(NT):
            for h in range(2):
                m = 8 * j + 2 * t + h
                if (2 * j + h) % KW == part and m < M:
                    a = part_sum(acc, red, rgroup, 4 * j + h, lane)
                    b = part_sum(acc, red, rgroup, 4 * j + 2 + h, lane)
                    if PAIRED:
                        pair = n0 // 2 + g
                        if pair < N // 2:
                            store(dst, m, pair, a, b, store_inputs(dst, m, pair))
                    else:
                        if n0 + g < N:
                            store(dst, m, n0 + g, a, a, 0)
                        if n0 + g + 8 < N:
                            store(dst, m, n0 + g + 8, b, b, 0)

    @cuda.jit(device=True, inline=True)
    def body(x64, w64, dst, M):
        """x64 (>= M * K/4,) u64: x's bf16 plane, 4 per word, row-major; w64 (N, K/4) u64: W, 4 bf16 per word;
        dst: the arrays the store writes (gemv_epilogues.epilogue_rows)."""
        N = w64.shape[0]
        chunks = w64.shape[1] // 8
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        g, t = lane // 4, lane % 4
        part, rgroup = warp % KW, warp // KW
        n0 = 16 * R * (cuda.blockIdx.x * RW + rgroup)   # the row group's first row; tile r's is n0 + 16 r
        rows = cuda.local.array(R2, int64)             # tile r's A rows g and g + 8: rows[2r], rows[2r + 1]
        for r in range(R):
            rows[2 * r] = weight_row(n0 + 16 * r, g, N)
            rows[2 * r + 1] = weight_row(n0 + 16 * r, g + 8, N)
        acc = cuda.local.array(NACC_ALL, float32)
        words = cuda.local.array(NWORDS, uint64)    # the pass being multiplied
        ahead = cuda.local.array(NWORDS, uint64)    # pipelined: the next pass, in flight
        xs = cuda.local.array(NT, uint64)           # a k-step's x words
        for i in range(NACC_ALL):
            acc[i] = float32(0)

        pdl.launch_dependents()
        c0 = part * U
        load_pass(w64, words, rows, c0, chunks, t)
        if pipelined:
            load_pass(w64, ahead, rows, c0 + PASS, chunks, t)
        pdl.grid_wait()
        for _ in range((chunks + PASS - 1) // PASS):
            multiply_pass(x64, words, xs, acc, c0, chunks, M, g, t)
            c0 += PASS
            if pipelined:
                for i in range(NWORDS):
                    words[i] = ahead[i]
                load_pass(w64, ahead, rows, c0 + PASS, chunks, t)
            else:
                load_pass(w64, words, rows, c0, chunks, t)

        # Tile by tile: tile r's accumulators are in acc[0 .. NACC) in round r.
        # NOTE: the other tiles' accumulators move down one tile after each round, so that every index into acc
        # is a compile-time constant even where the compiler keeps this loop a loop (an index that depends on a
        # loop variable would put all of acc into local memory, as a loop over acc[r * NACC + i] did).
        red = cuda.shared.array(RED_SHAPE, float32)
        for r in range(R):
            if KW > 1:
                # the K parts of the tile meet in shared memory, where each part adds those of its half tiles
                if r > 0:
                    cuda.syncthreads()   # every part has read the previous tile's parts
                for i in range(NACC):
                    red[rgroup, part, i, lane] = acc[i]
                cuda.syncthreads()
            store_tile(dst, acc, red, n0 + 16 * r, M, N, part, rgroup, lane)
            for i in range(NACC_ALL - NACC):
                acc[i] = acc[i + NACC]

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
    kernel = _gemv_tc_kernel(n_tiles(m), config, pairing, head_dim, fmt)
    # the whole workspace as uint64 words (a slice would be a new device array per launch)
    x64 = view(planes, (int(np.prod(planes.shape)) // 4,), np.uint64)
    rows_per_block = 16 * config.row_tiles * config.row_warps   # (gated: 2 x the features of a block)
    launch(kernel, -(-N // rows_per_block), kernel.threads, stream, x64,
           view(weight, (N, K // 4), np.uint64), *outputs, dependent=True)
