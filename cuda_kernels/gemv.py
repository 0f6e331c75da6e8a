"""Decode-time matmul for small M against bf16 weights in nn.Linear layout, and its fused SiLU-gate variant.

    gemv:          out[m, n] = sum_k x[m, k] * bf16_to_f32(W[n, k])
    gemv_silu_mul: out[m, j] = silu(g) * u,  g = sum_k x[m, k] W[j, k],  u = sum_k x[m, k] W[I + j, k],
                   silu(g) = g / (1 + exp(-g))   (as cuda_kernels/activation.py and reference/activation.py)

x (M, K) float32; W (N, K) uint16 bf16 bit patterns, or its uint64 view (N, K/4) (4 bf16 per word); out
(M, N) float32 for gemv; for gemv_silu_mul W is the row-concatenation [W_gate; W_up] of shape (2I, K) and
out is (M, I). All sums are fp32. With bf16_inputs=True every x is first rounded to the nearest bf16
(primitives.round_bf16; the engine's matmul_precision "bf16"), as reference.matmul.matmul(round_to_bf16(x), W).
Twins: reference/matmul.py, reference/activation.py (silu_and_mul of the gemv of [W_gate; W_up]).

Why a kernel of its own: at M <= 8 the weight read is the whole cost (a 1B decode step reads 2.47 GB of
weights), so the kernel must stream W at copy bandwidth whatever M is. Three things stand in the way:
1. x traffic. With x read from global memory once per weight word per lane (matmul.gemv), a lane loads
   4 M x values per 8-byte weight word: at M = 8 that is 16 bytes of L1 traffic per weight byte, and the
   4-element stride makes every scalar load a 4-way bank conflict. Here the block stages x in shared
   memory once (per K-chunk), split into E planes, xs[m, e, q] = x[m, E q + e] (E = 4 bf16 per weight word),
   so the 32 lanes of a warp read 32 consecutive floats of a plane: conflict-free, one shared-memory cycle
   per plane and row. Every x value a lane loads then serves all the rows_per_warp weight rows it holds.
2. Bytes in flight. A 3072 x 2048 weight is 12.6 MB, 3 us at copy bandwidth, only a few DRAM latencies:
   the whole GPU must keep megabytes in flight. Each lane issues unroll x rows_per_warp independent 64-bit
   loads before it uses any of them.
3. Too few rows. down (2048 x 8192) has 2048 rows: one warp per row is 16 warps per SM. split_k warps share
   a row group, each owning an interleaved slice of K; their partial sums are added through shared memory
   in a fixed order (s = 0, 1, ...): deterministic, no atomics.

Thread mapping (both kernels; config = GemvConfig(rows_per_warp R, split_k S, unroll U, warps_per_block W,
k_chunk)):
    grid  = (ceil(N_out / (G R)), ceil(M / MT)): G = W / S row groups per block; MT in (1, 2, 4, 8) is the
            smallest >= M (8 for M > 8: the weight is read once per 8-row chunk of x); N_out = N (gemv) or
            I (gemv_silu_mul).
    block = 32 W threads; warp w belongs to row group g = w // S as K-slice s = w % S. Group g of block
            (bx, by) owns output columns n0 .. n0 + R - 1, n0 = (bx G + g) R, and x rows by MT .. by MT + MT - 1.
            gemv_silu_mul: the group reads weight rows n0 + r (gate) and I + n0 + r (up), 2R rows per warp.
    x     : per chunk of KC words (k_chunk columns, a multiple of a step), the block copies x rows
            [by MT, by MT + MT) (zeros past M and K, rounded to bf16 if bf16_inputs) into xs, between two
            syncthreads.
    K walk: a step covers 32 S U words of the chunk; lane i of slice s takes words
            j0 + i + 32 (s + S u), u = 0 .. U - 1, of each of its rows (a warp reads 256 contiguous bytes per
            row and u), all U R loads issued first; then for each word the E x values of each of the MT rows
            are read from xs once and multiplied by the widened weights of all R rows.
    end   : a warp_sum per accumulator (MT R of them, 2 MT R fused); with S = 1 lane (i % 32) stores output
            i; with S > 1 lane (i % 32) of each slice writes its partial to shared memory and, after a
            syncthreads, the group's threads add the S partials in order s = 0 .. S - 1 (then silu * up) and
            store.
    Weight rows past N are clamped to row N - 1 and x rows past M staged as zeros; neither is stored. Nothing
    returns early: every lane must reach every warp_sum and syncthreads.
    K % 4 != 0 (or a non-contiguous uint16 weight): the same kernel with E = 1, one bf16 per "word".

Versions:
1. matmul.gemv: a warp per weight row (or a few), 64-bit weight loads, x re-read from global per word.
2. gemv (this file): x staged in shared memory in conflict-free planes, U x R loads in flight per lane,
   split-K across warps for short grids, a fixed-order partial sum; launcher-chosen config (gemv_config).
3. gemv_silu_mul: version 2 with gate and up rows in one warp and silu(g) * u in the epilogue (saves the
   (M, 2I) intermediate and a launch per layer).

Launchers: gemv and gemv_silu_mul check their arguments, view a uint16 weight as uint64 when they can, take
gemv_config(M, N_out, K, fused) unless given a config, and gemv_plan turns the config into the kernel's
compile-time chunk size (and refuses one whose shared memory exceeds 48 KB).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, int64, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import WARP, bf16_to_f32, round_bf16, warp_sum

# Largest M the engine sends to gemv (above it the tensor-core gemm wins: gemv reads W once per 8 rows).
GEMV_MAX_M = 8
_M_TILES = (1, 2, 4, 8)

# Launcher policy constants (gemv_config). NOTE: first choices from the shapes and the H200's limits (132
# SMs, 64 resident warps and 228 KB shared memory per SM), not measured: tools/kernel_benchmarks/gemv.py
# times the variants to re-tune them.
SMS = 132
TARGET_WARPS = SMS * 32     # split K until the grid has at least this many warps (half the resident maximum)
MAX_SPLIT_K = 8
XS_BUDGET = 16 * 1024       # bytes of staged x per block the default config aims at (occupancy: 14 blocks/SM)
SHARED_LIMIT = 48 * 1024    # static shared memory per block without an opt-in


class GemvConfig(NamedTuple):
    rows_per_warp: int = 1     # R: weight rows per warp (per row group): each x value loaded serves R rows
    split_k: int = 1           # S: warps sharing a row group, each one an interleaved slice of K
    unroll: int = 4            # U: words per row each lane loads per step, all in flight together
    warps_per_block: int = 4   # W: a multiple of split_k; W / S row groups per block
    k_chunk: int = 4096        # x columns staged in shared memory per pass (rounded up to whole steps)


# ---------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _word_low(word):
    """bf16 elements 0 and 1 of a uint64 of four (little-endian), as fp32."""
    # NOTE: cast to uint32 before shifting (the simulator applies NumPy promotion; on the GPU typed constants
    # keep the arithmetic unsigned). LLVM folds (b & 0xFFFF) << 16 and (b >> 16) << 16 into one op each.
    lo = uint32(uint64(word) & uint64(0xFFFFFFFF))
    return bf16_to_f32(lo & uint32(0xFFFF)), bf16_to_f32(lo >> uint32(16))


@cuda.jit(device=True)
def _word_high(word):
    """bf16 elements 2 and 3 of a uint64 of four, as fp32."""
    hi = uint32(uint64(word) >> uint64(32))
    return bf16_to_f32(hi & uint32(0xFFFF)), bf16_to_f32(hi >> uint32(16))


if SIMULATOR:
    @cuda.jit(device=True)
    def _exp(v):
        # NOTE: the simulator's math.exp is Python's, which raises OverflowError above 709 (fp32 expf gives
        # inf above 88, which silu relies on): NumPy's fp32 exp behaves as the GPU's.
        with np.errstate(over="ignore"):
            return np.exp(np.float32(v))
else:
    @cuda.jit(device=True, inline=True)
    def _exp(v):
        return math.exp(v)


@cuda.jit(device=True)
def _silu_mul(g, u):
    # NOTE: the formulation of activation.py: for g < -88 exp(-g) is inf and g / inf = -0 (silu's limit).
    return g / (float32(1) + _exp(-g)) * u


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gemv_kernel(m_tile: int, rows_per_warp: int, split_k: int, unroll: int, warps_per_block: int,
                 chunk_words: int, words4: bool, bf16_inputs: bool, silu: bool):
    """The gemv kernel for one configuration (all compile-time: local arrays and unrolled loops need them).

    chunk_words: weight words of x staged per pass, a multiple of the step 32 * split_k * unroll.
    words4: the weight comes as its uint64 view (4 bf16 per word); else as uint16, one bf16 per word.
    silu: the gemv_silu_mul epilogue (gate rows n, up rows I + n)."""
    MT, R, S, U, W = m_tile, rows_per_warp, split_k, unroll, warps_per_block
    E = 4 if words4 else 1            # bf16 per weight word = x planes
    G = W // S                        # row groups per block
    RW = 2 * R if silu else R         # weight rows a warp reads
    NACC = MT * RW                    # accumulators per lane
    NOUT = MT * R                     # outputs per row group
    NWR = RW * U                      # weight words in flight per lane
    NWF = RW * E
    STEP = WARP * S * U
    KCW = chunk_words
    # NOTE: one float of padding per plane: the staging stores (consecutive threads walk e fastest) then fall
    # on different banks; the compute loads (consecutive lanes, consecutive q of one plane) stay conflict-free.
    PLANE = KCW + (1 if E > 1 else 0)
    XS_ELEMS = MT * E * KCW
    THREADS = WARP * W
    WDT = uint64 if words4 else uint32

    @cuda.jit
    def gemv_kernel(x, w, out):
        """x (M, K) f32; w (N_w, K/4) u64 [words4] or (N_w, K) u16 bf16; out (M, N_out) f32, N_w = N_out
        (gemv) or 2 N_out (silu: gate rows then up rows)."""
        M = x.shape[0]
        K = x.shape[1]
        words = w.shape[1]
        N = out.shape[1]
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = warp // S
        s = warp % S
        n0 = (cuda.blockIdx.x * G + g) * R
        m0 = cuda.blockIdx.y * MT

        xs = cuda.shared.array((MT, E, PLANE), float32)   # xs[m, e, q] = x[m0 + m, E (c0 + q) + e]
        acc = cuda.local.array(NACC, float32)             # acc[mm * RW + r]: x row mm times weight row r
        wr = cuda.local.array(NWR, WDT)                   # wr[r * U + u]: raw words of the current step
        wf = cuda.local.array(NWF, float32)               # wf[r * E + e]: one word of each row, widened
        xv = cuda.local.array(E, float32)
        rows = cuda.local.array(RW, int64)
        for i in range(NACC):
            acc[i] = float32(0)
        for r in range(RW):
            # Clamp, do not return (module docstring): rows past N read row N - 1 and are never stored.
            if silu and r >= R:
                rows[r] = N + min(n0 + r - R, N - 1)
            else:
                rows[r] = min(n0 + r, N - 1)

        for c0 in range(0, words, KCW):
            cw = min(KCW, words - c0)
            cuda.syncthreads()  # the previous chunk's readers are done with xs
            for idx in range(tid, XS_ELEMS, THREADS):
                mm = idx // (E * KCW)
                col = idx % (E * KCW)            # consecutive threads: consecutive x columns (coalesced)
                k = E * c0 + col
                v = float32(0)                   # zeros past M and K: they meet zero weight words
                if m0 + mm < M and k < K:
                    v = x[m0 + mm, k]
                    if bf16_inputs:
                        v = round_bf16(v)        # once per staged value, not once per multiply
                xs[mm, col % E, col // E] = v
            cuda.syncthreads()

            for j0 in range(0, cw, STEP):
                # all U * RW loads first: they are independent, so they are in flight together
                for u in range(U):
                    j = c0 + j0 + lane + WARP * (s + S * u)
                    for r in range(RW):
                        word = WDT(0)
                        if j < words:
                            word = WDT(w[rows[r], j])
                        wr[r * U + u] = word
                for u in range(U):
                    q = j0 + lane + WARP * (s + S * u)   # < KCW: KCW is a whole number of steps
                    for r in range(RW):
                        if words4:
                            wf[4 * r], wf[4 * r + 1] = _word_low(wr[r * U + u])
                            wf[4 * r + 2], wf[4 * r + 3] = _word_high(wr[r * U + u])
                        else:
                            wf[r] = bf16_to_f32(wr[r * U + u])
                    for mm in range(MT):
                        for e in range(E):
                            xv[e] = xs[mm, e, q]
                        for r in range(RW):
                            a = acc[mm * RW + r]
                            for e in range(E):
                                a += xv[e] * wf[r * E + e]
                            acc[mm * RW + r] = a

        if S == 1:
            # every lane gets every total; lane i % 32 stores output i (stores spread over the lanes)
            for i in range(NOUT):
                mm = i // R
                r = i % R
                total = warp_sum(acc[mm * RW + r])
                if silu:
                    total = _silu_mul(total, warp_sum(acc[mm * RW + R + r]))
                if lane == i % WARP and m0 + mm < M and n0 + r < N:
                    out[m0 + mm, n0 + r] = total
        else:
            part = cuda.shared.array((G, S, NACC), float32)   # part[g, s, i]: slice s's total of acc i
            for i in range(NACC):
                total = warp_sum(acc[i])
                if lane == i % WARP:
                    part[g, s, i] = total
            cuda.syncthreads()
            # NOTE: the S partials are added in slice order by one thread: the result does not depend on
            # which warp finished first (deterministic, unlike atomics).
            for i in range(s * WARP + lane, NOUT, S * WARP):
                mm = i // R
                r = i % R
                total = part[g, 0, mm * RW + r]
                for ss in range(1, S):
                    total += part[g, ss, mm * RW + r]
                if silu:
                    up = part[g, 0, mm * RW + R + r]
                    for ss in range(1, S):
                        up += part[g, ss, mm * RW + R + r]
                    total = _silu_mul(total, up)
                if m0 + mm < M and n0 + r < N:
                    out[m0 + mm, n0 + r] = total

    gemv_kernel.rows_per_block = G * R
    gemv_kernel.threads = THREADS
    return gemv_kernel


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def _m_tile(m: int) -> int:
    return next((t for t in _M_TILES if t >= m), _M_TILES[-1])


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def gemv_config(m: int, n: int, k: int, fused: bool = False) -> GemvConfig:
    """The launcher's default config for x (m, k) and n output columns: the weight's N rows for gemv; for
    gemv_silu_mul (fused=True) I, half the rows of [W_gate; W_up]. A pure function of the shape.

    The rules are in weight rows read per warp, RW (= R for gemv, 2R for the fused kernel, whose warps read
    R gate and R up rows):
    - RW: 1 up to M = 2, 2 at M = 4, 4 at M = 8 (fused: at least 2): the x values read from shared memory
      per weight byte fall as 1 / RW (at M = 8, RW = 4 leaves 32 B of weight per shared-memory cycle, twice
      the share of copy bandwidth one SM needs), and RW = 4 at M = 8 is 32 accumulators per lane;
    - unroll: 4 words per row at RW = 1, 2 at RW = 2, 1 at RW = 4: 4 64-bit loads (32 B) in flight per lane;
    - split_k: the smallest power of two (<= 8) that gives the grid TARGET_WARPS warps, but no more than
      leaves every warp a whole step of K and keeps one step of staged x within XS_BUDGET;
    - warps_per_block: 4, or split_k if larger;
    - k_chunk: all of K when the block's x rows fit in XS_BUDGET, else the most whole steps that do
      (at least one).
    """
    mt = _m_tile(m)
    words4 = k % 4 == 0
    words = k // 4 if words4 else k
    e = 4 if words4 else 1
    reads = 1 if mt <= 2 else 2 if mt == 4 else 4
    if fused:
        reads = max(reads, 2)
    rows = reads // 2 if fused else reads
    unroll = {1: 4, 2: 2, 4: 1}[reads]
    groups = -(-n // rows)
    split = 1
    while (split < MAX_SPLIT_K and groups * split < TARGET_WARPS
           and 2 * split * WARP * unroll <= max(words, 1)
           and mt * e * (2 * split * WARP * unroll) * 4 <= XS_BUDGET):
        split *= 2
    step_cols = e * WARP * split * unroll
    fit = max(1, XS_BUDGET // (mt * 4 * step_cols)) * step_cols
    k_chunk = min(_round_up(max(k, 1), step_cols), fit)
    return GemvConfig(rows, split, unroll, max(4, split), k_chunk)


def gemv_plan(config: GemvConfig, m: int, k: int, words4: bool = True, silu: bool = False,
              name: str = "gemv") -> tuple[int, int]:
    """(weight words of x staged per chunk, shared memory bytes per block) of a launch with config on x (m, k),
    64-bit words or not; ValueError if the launcher would refuse config. k_chunk is rounded up to whole steps
    (32 split_k unroll words) and down to what K needs."""
    R, S, U, W, k_chunk = config
    if min(config) < 1 or W % S or W > 32:
        raise ValueError(f"{name}: config {config}: every field must be >= 1, warps_per_block a multiple of "
                         f"split_k and at most 32")
    mt = _m_tile(m)
    e = 4 if words4 else 1
    step = WARP * S * U
    words = k // e
    chunk_words = min(_round_up(-(-k_chunk // e), step), _round_up(max(words, 1), step))
    nacc = mt * R * (2 if silu else 1)
    shared = 4 * (mt * e * (chunk_words + (e > 1)) + ((W // S) * S * nacc if S > 1 else 0))
    if shared > SHARED_LIMIT:
        raise ValueError(f"{name}: config {config} at M tile {mt} needs {shared} bytes of shared memory "
                         f"(x chunk of {chunk_words * e} columns), more than {SHARED_LIMIT}: lower k_chunk, "
                         f"split_k or unroll")
    return chunk_words, shared


def _is_device_array(a) -> bool:
    # Duck-typed: numba's DeviceNDArray and the simulator's FakeCUDAArray both have copy_to_host.
    return hasattr(a, "copy_to_host") and hasattr(a, "dtype") and hasattr(a, "shape")


def _check_args(name, x, weight, out, silu):
    """x (M, K) f32, weight (N_w, K) u16 or its (N_w, K/4) u64 view, out (M, N_w or N_w / 2) f32; -> M, K."""
    for arg, a in (("x", x), ("weight", weight), ("out", out)):
        if not _is_device_array(a):
            raise TypeError(f"{name}: {arg} must be a numba device array (cuda.to_device / device_array), "
                            f"got {type(a).__name__}")
        if len(a.shape) != 2:
            raise ValueError(f"{name}: {arg} must be 2-D, got shape {tuple(a.shape)}")
    for arg, a in (("x", x), ("out", out)):
        if a.dtype != np.float32:
            raise ValueError(f"{name}: {arg} must be float32, got {a.dtype} (shape {tuple(a.shape)})")
    M, K = x.shape
    nw, wk = weight.shape
    if weight.dtype == np.uint64:
        wk *= 4
    elif weight.dtype != np.uint16:
        raise ValueError(f"{name}: weight must be uint16 bf16 bits (or its uint64 view), got {weight.dtype} "
                         f"(shape {tuple(weight.shape)})")
    if wk != K:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} ({weight.dtype}) "
                         f"disagree on K ({K} vs {wk})")
    if silu and nw % 2:
        raise ValueError(f"{name}: weight must be [W_gate; W_up] with an even number of rows, got "
                         f"{tuple(weight.shape)}")
    n_out = nw // 2 if silu else nw
    if tuple(out.shape) != (M, n_out):
        what = "(M, N / 2)" if silu else "(M, N)"
        raise ValueError(f"{name}: out must have shape {what} = ({M}, {n_out}) for x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}, got {tuple(out.shape)}")
    return M, K


def _launch(name, x, weight, out, stream, config, bf16_inputs, silu):
    M, K = _check_args(name, x, weight, out, silu)
    n_out = out.shape[1]
    if M == 0 or n_out == 0:
        return
    if weight.dtype == np.uint64:
        w, words4 = weight, True
    elif K % 4 == 0 and weight.is_c_contiguous():
        w, words4 = weight.view(np.uint64), True   # no copy: 4 bf16 per 64-bit load
    else:
        w, words4 = weight, False                  # any K: one bf16 per load (slower, always correct)
    config = config or gemv_config(M, n_out, K, fused=silu)
    chunk_words, _ = gemv_plan(config, M, K, words4, silu, name)
    R, S, U, W, _ = config
    mt = _m_tile(M)
    kernel = _gemv_kernel(mt, R, S, U, W, chunk_words, words4, bool(bf16_inputs), silu)
    grid = (-(-n_out // kernel.rows_per_block), -(-M // mt))
    kernel[grid, kernel.threads, stream](x, w, out)


def gemv(x, weight, out, stream=0, config: GemvConfig | None = None, bf16_inputs: bool = False):
    """out (M, N) = x (M, K) @ W^T for small M (decode); W (N, K) uint16 bf16 or its uint64 view (N, K/4).

    A uint16 weight is viewed as uint64 here when K % 4 == 0 and it is C-contiguous (64-bit loads); otherwise
    the kernel reads one bf16 per load (any K). Any M works: x is walked in chunks of up to 8 rows and the
    weight is read once per chunk. config: the tuning knobs (default gemv_config(M, N, K)); bf16_inputs:
    round every x to the nearest bf16 before the multiply (matmul_precision "bf16").
    """
    _launch("gemv", x, weight, out, stream, config, bf16_inputs, silu=False)


def gemv_silu_mul(x, weight, out, stream=0, config: GemvConfig | None = None, bf16_inputs: bool = False):
    """out (M, I) = silu(x @ W_gate^T) * (x @ W_up^T), weight = [W_gate; W_up] (2I, K) uint16 bf16 (or its
    uint64 view): the gate/up projection and the activation in one kernel. Arguments as gemv; the default
    config is gemv_config(M, I, K, fused=True) (each warp reads R gate rows and R up rows)."""
    _launch("gemv_silu_mul", x, weight, out, stream, config, bf16_inputs, silu=True)
