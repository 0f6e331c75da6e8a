"""Picking the next token on the GPU: greedy argmax, and temperature / top-k / top-p / min-p sampling.

Math (per row s of logits l, vocabulary size V; exactly reference/sampling.py):

    greedy (temperature 0):  token = min { i : l_i = max_j l_j }          (NaN counts as largest, like numpy)
    otherwise:               z_i = l_i / T,  e_i = exp(z_i - max_j z_j),  p_i = e_i / sum_j e_j
                             keep_i = p_i >= max(t_k, t_p, t_min)          (every filter is a threshold on p)
                             t_k   = the k-th largest p                    (top_k in (0, V); else 0)
                             t_p   = max { t in p : M(t) >= top_p },  M(t) = sum_{p_j >= t} p_j   (top_p < 1)
                             t_min = min_p * max_j p_j                      (min_p > 0)
                             token = min { i : C_i > u * C_{V-1} },  C_i = sum_{j <= i, keep_j} p_j

  t_p is the reference's sorted-cumsum threshold: with p sorted decreasingly and r the first rank whose
  cumulative sum reaches top_p, every value t above p_(r) has M(t) equal to a cumulative sum at a rank below
  r, hence < top_p, while M(p_(r)) >= cumsum_r >= top_p. So no sort is needed: both t_k and t_p are found by
  a search over the values of p. If no t reaches top_p (rounding left the total mass short of it) every
  token is kept, as the reference's clamp to the last rank does.

Shapes and dtypes (device arrays):
    logits (S, V) float32 (any strides); out (S,) int32
    argmax with a workspace: workspace (n,) int32, n >= argmax_workspace_size(S, V); its first S * P elements
    hold the partials, part_index[s * P + p] = the best index of partition p of row s
    sample only: temperature, top_p, min_p, uniform (S,) float32; top_k (S,) int32; uniform in [0, 1)
    sample with a workspace: workspace (n,) uint64, n >= sample_workspace_size(S, V); its front holds, in
    this order (P partitions, T threads per block; a unit is thread t's contiguous sub-chunk of partition p,
    [p*chunk + t*sub, ... + sub) with sub = ceil(chunk / T), numbered p*T + t, so units run in vocabulary order):
        hist        (S, 3, 1024) uint64   the current digit's count_k, count_p, mass_p of each row
        state       (S, 7) int64          greedy token, k_done, k_prefix, k_left, p_done, p_prefix, p_left
        zstate      (S, 2) float64        max z, sum of e (float32 values)
        part_index  (S, P) int64          best index of each partition      part_low (S, P) float64  its min
        part_sum    (S, P) float64        partial sums of e                 part_last (S, P) int64   last kept
        unit_mass   (S, P * T) uint64     fixed-point kept mass of each unit

Thread mapping:
    argmax_naive  grid = ceil(S / threads); one thread per row walks the whole row.
    argmax        grid = (S,); one block per row; thread t reads l[t], l[t + threads], ... (coalesced) and
                  the block reduces (value, index) pairs through shared memory.
    argmax (workspace=) split in two kernels, P and chunk = ceil(V / P) from argmax_partitions(S, V):
                  stage 1  grid = (S, P); block (s, p) reduces l[s, p*chunk : (p+1)*chunk] with the strided
                           mapping, UNROLL loads in flight per thread before it compares any, and writes the
                           best index to the workspace (P = 1: to out, and stage 2 is skipped);
                  stage 2  grid = (S,); thread t of row s's block reads partial t, re-reads its logit, and
                           the block reduces the P pairs under the same order.
                  P aims at about TARGET_BLOCKS blocks in all with chunks of at least MIN_CHUNK elements.
    sample        grid = (S,); one block per row, the same strided mapping for the passes that only reduce;
                  for the draw thread t owns the contiguous chunk [t*C, (t+1)*C), C = ceil(V / threads).
                  Static shared memory: 28 * threads bytes + 17 KB of histograms (45 KB at 1024 threads,
                  under the 48 KB static limit).
    sample (workspace=) ten kernels, P and chunk from argmax_partitions(S, V) as the split argmax, T threads
                  (SPLIT_THREADS) in every kernel; (S, P) kernels use the strided mapping within a partition,
                  UNROLL loads in flight per thread; a row already decided makes the later kernels return:
                  max      (S, P) the partition's best index (and min for T < 0); resets part_last, histograms
                  sum      (S, P) merges the P winners itself (max z), float64 partial sum of e; block (s, 0)
                           stores the greedy token, max z and where the searches start
                  hist d   (S, P) the digit's histograms of the partition in shared memory, added to the row's
                           with global integer atomics                                      } d = 0, 1, 2
                  select d (S)    the digit from the row's histograms, which it clears; d = 0 also  }
                           stores sum e (partials added in partition order)
                  mass     (S, P) thread t: its unit's kept mass; the partition's last kept token by atomic max
                  draw     (S)    thread t scans units [t*P, (t+1)*P) for the unit holding u * total; the
                           block re-reads that unit in sub-chunks for the token
    Block sizes: 32-1024, powers of two (whole warps, and a divisor of the 1024 histogram bins).

Passes over the row in `sample` (p is recomputed from the logits in every pass, never stored):
    1. the greedy answer (max l, lowest index); for T > 0 it also gives max z = fl(max l / T), since
       x -> fl(x / T) is monotone (T < 0, which SamplingParams forbids, costs one more block reduction)
       -- temperature-0 rows stop here
    2. sum of e
    3-5. radix select on the bits of p: 10 bits per pass (positive floats order like their bits, and p <= 1
       leaves 30 significant bits); one pass builds both the top-k count histogram and the top-p mass
       histogram. A search stops as soon as its bucket is decided (every member needed, or one member),
       usually after the second digit; both are skipped when off.
    6. kept mass of each thread's chunk, a block-wide exclusive scan, the chunk holding u * total
    +  the whole block re-reads that one chunk (V / threads elements) in sub-chunks to find the token
  So 3 passes for plain temperature sampling, up to 6 with top-k or top-p (5 typical at V = 128256).
  The split version makes the same passes, one kernel each, with a per-row kernel after each radix pass; its
  draw pass reads every element once (the kept mass of each unit) and then one unit of each row again.

Edge cases, all as the reference where it is defined: u * total rounding up to the total (or u >= 1) draws
the last kept token; top_p <= 0 keeps the largest p (and its ties); top_k <= 0 or >= V is off. Where the
reference is undefined (NaN logits, +inf logits, every logit -inf, min_p > 1: nothing kept) the kernel
returns the greedy token rather than an out-of-range one.

NOTE: masses (top-p histogram, chunk sums, the scan) are fixed-point integers, p * 2^56 truncated to uint64.
Integer addition is associative, so shared-memory atomics and scans give bit-identical results on every run
and in any order, and the error is at most V * 2^-56 (~2e-12 for V = 128256): the kernel's masses are the
exact masses of its float32 p to that precision, so a disagreement with the reference at a top-p or u
boundary comes from the reference's float32 cumsum (or from p itself: exp and the denominator may differ
from numpy's by a few ulps), never from the order of the kernel's additions.

Every reduction and scan here goes through shared memory (no warp shuffles), so the simulator runs exactly
the GPU's source; the only target-dependent piece is `f32_bits` from primitives (libdevice on the GPU).

Versions:
    argmax_naive  v1: one thread per row; teaching only (V sequential loads per thread).
    argmax        v2: one block per row, strided loads, two-level (value, index) reduction in shared memory.
                  A row per block leaves most SMs idle at small batches, and one load in flight per thread
                  starves it at large ones: 63.5 us at 1 x 128256 on the H200 (~3% of a 1B decode step).
    argmax        v3 (with workspace=): split over (row, partition) blocks, UNROLL loads in flight, a second
                  kernel merges P indices per row; bit-identical tokens to v2 (the order is total).
    sample        v1: one block per row; radix-select thresholds, fixed-point masses, two-level inverse CDF.
                  A row per block leaves most SMs idle at small batches: 370-480 us at 1 x 128256 on the H200.
    sample        v2 (with workspace=): the same passes split over (row, partition) blocks, ten kernels with
                  per-row decisions in between, nothing read back to the host (CUDA-graph safe). Tokens equal
                  v1's: thresholds and draws are the same integer searches on the same float32 p; only sum e
                  is added in another order (float64, rounded once), which moves a token only if that sum lies
                  within ~1e-16 of a float32 rounding boundary and the token at a boundary.
"""

import math
from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.primitives import WARP, f32_bits

#: block sizes the kernels accept: whole warps, at most 32 of them, and a divisor of RADIX_BINS
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
DEFAULT_THREADS = 64 if SIMULATOR else 512   # the simulator runs a Python thread per CUDA thread
RADIX_BITS = 10
RADIX_BINS = 1 << RADIX_BITS
RADIX_MASK = RADIX_BINS - 1
#: p <= 1 has bits <= 0x3F800000, so bits 30 and 31 are always 0: three 10-bit digits cover the rest
RADIX_PASSES = 3
FIXED_SCALE = float(2 ** 56)      # p * 2^56 < 2^56 and sum(p) ~ 1, far from the 2^64 limit of uint64
NO_INDEX = 2 ** 31 - 1            # an index larger than any real one: loses every tie in the argmax
#: split argmax (argmax with a workspace): block size of stage 1, loads each thread issues before it compares
#: any, the grid it aims for (about 8 blocks per SM of the H200's 132) and the smallest chunk worth a block
# NOTE: 128 threads measured on the H200 (V = 128256): 11.0 us at 1 row (256: 10.9, 512: 12.1), 21.8 at 64
# rows (256: 27.5), 60.7 at 256 (256: 66.0); the one-block-per-row kernel took 63 / 65 / 125 us at 512.
SPLIT_THREADS = 32 if SIMULATOR else 128
UNROLL = 8
TARGET_BLOCKS = 1024
MIN_CHUNK = 2048
#: the split sample's per-row state (workspace section `state`, int64): the greedy token and both searches
GREEDY, K_DONE, K_PREFIX, K_LEFT, P_DONE, P_PREFIX, P_LEFT = range(7)
STATE_WORDS = 7
#: and its float64 section `zstate`: max z and the softmax denominator (float32 values, exact in float64)
ZMAX, TOTAL = range(2)


def _jit_options(threads):
    """Launch bounds (block size, blocks per SM) that hold every block size to 64 registers, 1024 resident
    threads per SM. Left to itself ptxas gives `sample` 128 registers (one 512-thread block per SM, and a
    1024-thread block could not launch); at 64 it spills under 32 bytes (ptxas -v, sm_90). The simulator
    rejects the keyword."""
    return {} if SIMULATOR else {"launch_bounds": (threads, max(1, 1024 // threads))}


# --- device helpers -----------------------------------------------------------------------------------------
#
# Block-wide reductions and scans, two levels through shared memory: one thread per warp combines its warp's
# 32 entries, then every thread combines the per-warp results. Two barriers whatever the block size (a
# log2(threads)-step tree needs 5-10), no warp shuffles, so the simulator runs the GPU's code. Every thread of
# the block must call them, in the same order. A reduction reads `buf` only before its second barrier and
# writes `wbuf` only after its first, so reductions may follow each other on the same buffers with no barrier
# in between; a scan also reads `buf` after its second barrier, so the caller must pass a barrier before the
# buffers of a scan are written again.

@cuda.jit(device=True)
def _beats(value, index, best, best_index):
    """numpy.argmax's order: NaN above everything, then larger values, then the lower index among equals."""
    if value != value:
        return best == best or index < best_index
    if best != best:
        return False
    return value > best or (value == best and index < best_index)


@cuda.jit(device=True)
def _block_argmax(value, index, vbuf, ibuf, wv, wi):
    """The block's best (value, index) pair under `_beats`, to every thread. vbuf/ibuf [threads], wv/wi [32]."""
    tid = cuda.threadIdx.x
    nwarps = cuda.blockDim.x // WARP
    vbuf[tid] = value
    ibuf[tid] = index
    cuda.syncthreads()
    if tid < nwarps:
        bv = vbuf[tid * WARP]
        bi = ibuf[tid * WARP]
        for j in range(tid * WARP + 1, tid * WARP + WARP):
            if _beats(vbuf[j], ibuf[j], bv, bi):
                bv = vbuf[j]
                bi = ibuf[j]
        wv[tid] = bv
        wi[tid] = bi
    cuda.syncthreads()
    bv = wv[0]
    bi = wi[0]
    for w in range(1, nwarps):
        if _beats(wv[w], wi[w], bv, bi):
            bv = wv[w]
            bi = wi[w]
    return bv, bi


@cuda.jit(device=True)
def _block_max(value, vbuf, wv):
    """Maximum of a float64 over the block, to every thread. vbuf [threads], wv [32]."""
    tid = cuda.threadIdx.x
    nwarps = cuda.blockDim.x // WARP
    vbuf[tid] = value
    cuda.syncthreads()
    if tid < nwarps:
        best = vbuf[tid * WARP]
        for j in range(tid * WARP + 1, tid * WARP + WARP):
            best = max(best, vbuf[j])
        wv[tid] = best
    cuda.syncthreads()
    best = wv[0]
    for w in range(1, nwarps):
        best = max(best, wv[w])
    return best


@cuda.jit(device=True)
def _block_sum(value, vbuf, wv):
    """Sum of a float64 over the block, to every thread, always in the same order (deterministic)."""
    tid = cuda.threadIdx.x
    nwarps = cuda.blockDim.x // WARP
    vbuf[tid] = value
    cuda.syncthreads()
    if tid < nwarps:
        acc = float64(0)
        for j in range(tid * WARP, tid * WARP + WARP):
            acc += vbuf[j]
        wv[tid] = acc
    cuda.syncthreads()
    acc = float64(0)
    for w in range(nwarps):
        acc += wv[w]
    return acc


@cuda.jit(device=True)
def _block_scan2(a, b, pos, abuf, bbuf, wa, wb):
    """Exclusive prefix sums of two uint64 values over the block, in the order given by `pos`.

    pos is this thread's place in the scan (threadIdx.x for a prefix, threads - 1 - threadIdx.x for a suffix).
    Returns (exclusive a, exclusive b, total a, total b). After the per-warp sums each thread adds the
    segments before its own and the entries before it in its segment: at most 31 + 31 shared loads.
    """
    tid = cuda.threadIdx.x
    nwarps = cuda.blockDim.x // WARP
    abuf[pos] = a
    bbuf[pos] = b
    cuda.syncthreads()
    if tid < nwarps:
        sa = uint64(0)
        sb = uint64(0)
        for j in range(tid * WARP, tid * WARP + WARP):
            sa += abuf[j]
            sb += bbuf[j]
        wa[tid] = sa
        wb[tid] = sb
    cuda.syncthreads()
    my_warp = pos // WARP
    ea = uint64(0)
    eb = uint64(0)
    ta = uint64(0)
    tb = uint64(0)
    for w in range(nwarps):
        if w < my_warp:
            ea += wa[w]
            eb += wb[w]
        ta += wa[w]
        tb += wb[w]
    for j in range(my_warp * WARP, pos):
        ea += abuf[j]
        eb += bbuf[j]
    return ea, eb, ta, tb


@cuda.jit(device=True)
def _row_argmax(logits, row, vbuf, ibuf, wv, wi):
    """One pass over a row with the strided mapping: (largest logit, its lowest index, this thread's minimum)."""
    tid = cuda.threadIdx.x
    best = float32(-np.inf)
    best_index = int32(NO_INDEX)
    lowest = float32(np.inf)
    for i in range(tid, logits.shape[1], cuda.blockDim.x):
        x = logits[row, i]
        if _beats(x, i, best, best_index):
            best = x
            best_index = int32(i)
        lowest = min(lowest, x)
    value, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
    return float32(value), index, lowest


@cuda.jit(device=True)
def _load_round(x, base, step, end, xs):
    """xs[k] = x[base + k * step] for every k < UNROLL with base + k * step < end: one round of independent loads.

    NOTE: a loop that loads and uses one element at a time keeps about one load in flight per thread, 4 KB per
    SM at 1024 resident threads, while by Little's law the H200's bandwidth times its DRAM latency asks for
    roughly 25 KB per SM (4.25 TB/s x ~0.8 us / 132 SMs); so every pass of the split kernels loads a round into
    xs (a local array of UNROLL float32 that the compiler keeps in registers) before it uses any of it. The index
    is cast to uint64 for the load: numba then omits its negative-index wraparound (3 instructions a load).
    """
    for k in range(UNROLL):
        j = base + k * step
        if j < end:
            xs[k] = x[uint64(j)]


@cuda.jit(device=True)
def _chunk_argmax(x, start, end, xs):
    """This thread's best (value, index) under `_beats` and its smallest value over x[start:end] (x: one row),
    strided mapping, in rounds of `_load_round`. Measured on the H200 at 256 x 128256 rows, where both argmax
    kernels have blocks enough: v2 (512 threads, one load at a time) 125 us, the split one 61 us (SPLIT_THREADS).
    A thread with no element in range returns (-inf, NO_INDEX, inf): it loses to every real element. The argmax
    ignores the smallest value (the compiler drops it there); `sample` needs it for T < 0.
    """
    step = cuda.blockDim.x
    best = float32(-np.inf)
    best_index = int32(NO_INDEX)
    lowest = float32(np.inf)
    base = start + cuda.threadIdx.x
    while base < end:
        _load_round(x, base, step, end, xs)
        for k in range(UNROLL):
            j = base + k * step
            if j < end:
                if _beats(xs[k], j, best, best_index):
                    best = xs[k]
                    best_index = int32(j)
                lowest = min(lowest, xs[k])
        base += UNROLL * step
    return best, best_index, lowest


@cuda.jit(device=True)
def _merge_argmax(x, indices, vbuf, ibuf, wv, wi):
    """The best (value, index) under `_beats` among the elements x[indices[q]] (x: one row; indices: one row's
    partition winners), to every thread; thread t takes winners t, t + threads, ... NOTE: the partials are
    indices only; their values are read back from x (the same float32, so the same order), which keeps a
    partial one integer. Every partition is non-empty (P = ceil(V / chunk)), so every index is a real one."""
    best = float32(-np.inf)
    best_index = int32(NO_INDEX)
    for q in range(cuda.threadIdx.x, indices.shape[0], cuda.blockDim.x):
        i = int32(indices[q])
        if _beats(x[i], i, best, best_index):
            best = x[i]
            best_index = i
    value, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
    return float32(value), index


@cuda.jit(device=True)
def _weight(logit, temperature, zmax):
    """e = exp(l / T - max z) in float32, in the reference's order of operations (divide, subtract, exp)."""
    return float32(math.exp(logit / temperature - zmax))


@cuda.jit(device=True)
def _prob(logit, temperature, zmax, total):
    """p = e / sum e. NOTE: a true division, like the reference's `p /= p.sum()`, not a multiply by 1/sum.
    Every pass recomputes p through this one function, so all passes see bit-identical values."""
    return _weight(logit, temperature, zmax) / total


@cuda.jit(device=True)
def _prob_bits(p):
    """The radix key of p: its float32 bits (p >= 0 orders like them); a NaN p (a NaN row) becomes 0."""
    if p != p:
        return uint32(0)
    return uint32(f32_bits(p))


@cuda.jit(device=True)
def _mass(p):
    """p in fixed point, p * 2^56 truncated (see the module NOTE); 0 for a NaN p."""
    if p != p:
        return uint64(0)
    return uint64(float64(p) * FIXED_SCALE)


@cuda.jit(device=True)
def _kept(p, threshold):
    return p == p and _prob_bits(p) >= threshold


@cuda.jit(device=True)
def _search_start(k, top_p, vocab):
    """Where the radix searches of one row begin: (k_done, k_left, p_done, p_left). A search that is off starts
    done (and its prefix, 0, then keeps everything); top_p <= 0 looks for mass 1, the largest p, as the
    reference's rank 0 gives; otherwise M >= top_p  <=>  M_fixed >= ceil(top_p * 2^56), M_fixed an integer."""
    k_on = 0 < k and k < vocab
    p_on = top_p < float32(1)
    k_left = uint64(0)
    if k_on:
        k_left = uint64(k)
    p_left = uint64(1)
    if p_on and top_p > float32(0):
        p_left = max(uint64(1), uint64(math.ceil(float64(top_p) * FIXED_SCALE)))
    return not k_on, k_left, not p_on, p_left


@cuda.jit(device=True)
def _count(p, shift, k_done, k_prefix, p_done, p_prefix, count_k, count_p, mass_p):
    """Adds p to the digit's histograms (shared-memory atomics) for each live search whose prefix (the digits
    above `shift` chosen so far) p's bits share: count_k and count_p count candidates per digit value, mass_p
    adds their fixed-point mass."""
    bits = _prob_bits(p)
    bucket = int32((bits >> shift) & uint32(RADIX_MASK))
    above = shift + uint32(RADIX_BITS)  # the bits above this digit must equal the prefix
    if not k_done and (bits >> above) == (k_prefix >> above):
        cuda.atomic.add(count_k, bucket, 1)
    if not p_done and (bits >> above) == (p_prefix >> above):
        cuda.atomic.add(count_p, bucket, 1)
        cuda.atomic.add(mass_p, bucket, _mass(p))


@cuda.jit(device=True)
def _select_digit(count_k, count_p, mass_p, digit, bins_per_thread, k_done, k_prefix, k_left, p_done, p_prefix,
                  p_left, slot, abuf, bbuf, wa, wb):
    """One digit of both radix searches, decided from its complete histograms by the whole block; returns the
    new (k_done, k_prefix, k_left, p_done, p_prefix, p_left) to every thread.

    Thread t owns bins [t * bins_per_thread, (t + 1) * bins_per_thread): a suffix scan (largest p first) tells
    each thread how much lies above its bins, and the one thread whose bins cross the target walks them from
    the top. Each thread then clears its bins, so the histograms are zero again for the next digit.
    slot (12 int64, shared): two sets of six, alternating by digit so that resetting the next digit's set never
    races a late read of this one's: +0 top-k bucket, +1 rank left, +2 bucket count, +3 top-p bucket, +4 mass
    left, +5 bucket count. A search stops once its bucket is decided: every member needed (top-k; its lowest
    bits are then the threshold), one member (top-p), or the last digit.
    """
    tid = cuda.threadIdx.x
    s = 6 * (digit % 2)
    if tid == 0:
        slot[s] = -1
        slot[s + 3] = -1
    shift = uint32(RADIX_BITS * (RADIX_PASSES - 1 - digit))
    lo = tid * bins_per_thread
    ck = uint64(0)
    mp = uint64(0)
    for j in range(lo, lo + bins_per_thread):
        ck += uint64(count_k[j])
        mp += uint64(mass_p[j])
    above_k, above_p, _, _ = _block_scan2(ck, mp, cuda.blockDim.x - 1 - tid, abuf, bbuf, wa, wb)
    if not k_done and above_k < k_left and k_left <= above_k + ck:
        run = above_k
        for j in range(lo + bins_per_thread - 1, lo - 1, -1):
            c = uint64(count_k[j])
            if run + c >= k_left:
                slot[s] = j
                slot[s + 1] = int64(k_left - run)
                slot[s + 2] = int64(c)
                break
            run += c
    if not p_done and above_p < p_left and p_left <= above_p + mp:
        run = above_p
        for j in range(lo + bins_per_thread - 1, lo - 1, -1):
            m = uint64(mass_p[j])
            if run + m >= p_left:
                slot[s + 3] = j
                slot[s + 4] = int64(p_left - run)
                slot[s + 5] = int64(count_p[j])
                break
            run += m
    for j in range(lo, lo + bins_per_thread):  # only this thread reads these bins: clear them now
        count_k[j] = 0
        count_p[j] = 0
        mass_p[j] = 0
    cuda.syncthreads()
    if not k_done:
        if slot[s] < 0:  # cannot happen for 0 < k < V; keep everything rather than use garbage
            k_prefix = uint32(0)
            k_done = True
        else:
            k_prefix |= uint32(slot[s]) << shift
            k_left = uint64(slot[s + 1])
            k_done = uint64(slot[s + 2]) == k_left or digit == RADIX_PASSES - 1
    if not p_done:
        if slot[s + 3] < 0:  # only on the first digit: the total mass is short of top_p, keep all
            p_prefix = uint32(0)
            p_done = True
        else:
            p_prefix |= uint32(slot[s + 3]) << shift
            p_left = uint64(slot[s + 4])
            p_done = slot[s + 5] == 1 or digit == RADIX_PASSES - 1
    return k_done, k_prefix, k_left, p_done, p_prefix, p_left


@cuda.jit(device=True)
def _threshold(k_prefix, p_prefix, min_p, p_max):
    """The radix key every kept p reaches: max(t_k, t_p, t_min). A search that was off left its prefix 0."""
    threshold = max(k_prefix, p_prefix)
    if min_p > float32(0):
        threshold = max(threshold, uint32(f32_bits(min_p * p_max)))
    return threshold


@cuda.jit(device=True)
def _draw_target(u, kept_total):
    """The fixed-point target of the draw: the token is the first kept one whose cumulative mass C exceeds it.
    floor(u * total), exact enough in float64: C > u * total  <=>  C > floor(u * total) for an integer C.
    u >= 1 or NaN: the total itself, which no C exceeds, and the caller draws the last kept token."""
    target = kept_total
    if u < float32(1):
        target = uint64(0)
        if u > float32(0):
            target = uint64(float64(u) * float64(kept_total))
    return target


@cuda.jit(device=True)
def _kept_mass(x, start, end, temperature, zmax, total, threshold, xs):
    """(the fixed-point kept mass of x[start:end], the last kept index there with p > 0, or -1): one thread's
    contiguous range, in rounds of `_load_round`. The last kept token with p > 0 is the draw when u * total
    reaches the total."""
    kept = uint64(0)
    last = int64(-1)
    base = start
    while base < end:
        _load_round(x, base, 1, end, xs)
        for k in range(UNROLL):
            i = base + k
            if i < end:
                p = _prob(xs[k], temperature, zmax, total)
                if _kept(p, threshold):
                    kept += _mass(p)
                    if p > float32(0):
                        last = int64(i)
        base += UNROLL
    return kept, last


@cuda.jit(device=True)
def _draw_in_chunk(x, start, end, temperature, zmax, total, threshold, run, target, abuf, bbuf, wa, wb):
    """The kept token of x[start:end] at which the kept mass, `run` before start, first exceeds target, to the
    thread that finds it (-1 to the others); target must lie in [run, run + the kept mass of the range).
    The whole block re-reads the range in sub-chunks of ceil((end - start) / threads), scans their masses and the
    thread whose sub-chunk crosses walks it: the sequential walk is then one or two elements, not a whole range.
    Every thread must call it."""
    tid = cuda.threadIdx.x
    sub = (end - start + cuda.blockDim.x - 1) // cuda.blockDim.x
    s_start = start + tid * sub
    s_end = min(end, s_start + sub)
    sub_mass = uint64(0)
    for i in range(s_start, s_end):
        p = _prob(x[i], temperature, zmax, total)
        if _kept(p, threshold):
            sub_mass += _mass(p)
    sub_before, _, _, _ = _block_scan2(sub_mass, uint64(0), tid, abuf, bbuf, wa, wb)
    run += sub_before
    if run <= target and target < run + sub_mass:
        for i in range(s_start, s_end):
            p = _prob(x[i], temperature, zmax, total)
            if _kept(p, threshold):
                run += _mass(p)
                if run > target:
                    return int64(i)
    return int64(-1)


@cuda.jit(device=True)
def _row_total(part_sum, row):
    """The softmax denominator of a row from its partitions' float64 partial sums, added in partition order (so
    every block that asks gets the same float32), rounded once."""
    acc = float64(0)
    for q in range(part_sum.shape[1]):
        acc += part_sum[row, q]
    return float32(acc)


@cuda.jit(device=True)
def _unit_range(unit, threads, chunk, vocab):
    """[start, end) of a draw unit: thread (unit % threads)'s contiguous sub-chunk of ceil(chunk / threads)
    elements in partition (unit // threads); empty past the partition's or the row's end."""
    part = int64(unit) // threads
    sub = (chunk + threads - 1) // threads
    start = min(int64(vocab), part * chunk + (int64(unit) % threads) * sub)
    return start, min(int64(vocab), part * chunk + chunk, start + sub)


@cuda.jit(device=True)
def _store_search(state, row, k_done, k_prefix, k_left, p_done, p_prefix, p_left):
    state[row, K_DONE] = int64(k_done)
    state[row, K_PREFIX] = int64(k_prefix)
    state[row, K_LEFT] = int64(k_left)
    state[row, P_DONE] = int64(p_done)
    state[row, P_PREFIX] = int64(p_prefix)
    state[row, P_LEFT] = int64(p_left)

# --- kernels ------------------------------------------------------------------------------------------------

@cuda.jit
def _argmax_naive_kernel(logits, out):
    # logits (S, V) float32, out (S,) int32; grid ceil(S / threads): one thread per row. Neighbouring threads
    # read addresses V floats apart, so no load is coalesced: the reason `argmax` gives a row a whole block.
    row = cuda.grid(1)
    if row >= logits.shape[0]:
        return
    best = logits[row, 0]
    best_index = 0
    for i in range(1, logits.shape[1]):
        if _beats(logits[row, i], i, best, best_index):
            best = logits[row, i]
            best_index = i
    out[row] = best_index


@lru_cache(maxsize=None)
def _argmax_kernel(threads):
    @cuda.jit(**_jit_options(threads))
    def argmax_kernel(logits, out):
        # logits (S, V) float32, out (S,) int32; grid (S,), block (threads,): one block per row
        vbuf = cuda.shared.array(threads, float64)
        ibuf = cuda.shared.array(threads, int32)
        wv = cuda.shared.array(WARP, float64)
        wi = cuda.shared.array(WARP, int32)
        row = cuda.blockIdx.x
        _, index, _ = _row_argmax(logits, row, vbuf, ibuf, wv, wi)
        if cuda.threadIdx.x == 0:
            out[row] = index

    return argmax_kernel


@lru_cache(maxsize=None)
def _argmax_partial_kernel(threads):
    @cuda.jit(**_jit_options(threads))
    def argmax_partial_kernel(logits, chunk, part_index):
        # logits (S, V) float32; part_index (S * P,) int32, P = gridDim.y. grid (S, P), block (threads,):
        # block (s, p) reduces logits[s, p * chunk : (p + 1) * chunk] and writes the index of its best element
        # to part_index[s * P + p]. With P = 1 that is out[s] itself: the launcher passes out, no stage 2.
        vbuf = cuda.shared.array(threads, float64)
        ibuf = cuda.shared.array(threads, int32)
        wv = cuda.shared.array(WARP, float64)
        wi = cuda.shared.array(WARP, int32)
        xs = cuda.local.array(UNROLL, float32)
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        start = int64(part) * chunk
        end = min(int64(logits.shape[1]), start + chunk)
        best, best_index, _ = _chunk_argmax(logits[uint64(row)], start, end, xs)
        _, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
        if cuda.threadIdx.x == 0:
            part_index[int64(row) * cuda.gridDim.y + part] = index

    return argmax_partial_kernel


@lru_cache(maxsize=None)
def _argmax_merge_kernel(threads):
    @cuda.jit(**_jit_options(threads))
    def argmax_merge_kernel(logits, part_index, parts, out):
        # logits (S, V) float32; part_index (S * parts,) int32 from stage 1; out (S,) int32. grid (S,), block
        # (threads,): thread t takes partials t, t + threads, ... of row s (one each when threads >= parts).
        vbuf = cuda.shared.array(threads, float64)
        ibuf = cuda.shared.array(threads, int32)
        wv = cuda.shared.array(WARP, float64)
        wi = cuda.shared.array(WARP, int32)
        row = cuda.blockIdx.x
        first = int64(row) * parts
        _, index = _merge_argmax(logits[row], part_index[first:first + parts], vbuf, ibuf, wv, wi)
        if cuda.threadIdx.x == 0:
            out[row] = index

    return argmax_merge_kernel


@lru_cache(maxsize=None)
def _sample_kernel(threads):
    bins_per_thread = RADIX_BINS // threads

    @cuda.jit(**_jit_options(threads))
    def sample_kernel(logits, temperature, top_k, top_p, min_p, uniform, out):
        # logits (S, V) float32; temperature, top_p, min_p, uniform (S,) float32; top_k (S,) int32;
        # out (S,) int32. grid (S,), block (threads,): one block per row. Every branch on a row parameter
        # is block-uniform (all threads read the same value), so reductions inside those branches are safe.
        vbuf = cuda.shared.array(threads, float64)
        ibuf = cuda.shared.array(threads, int32)
        abuf = cuda.shared.array(threads, uint64)
        bbuf = cuda.shared.array(threads, uint64)
        wv = cuda.shared.array(WARP, float64)
        wi = cuda.shared.array(WARP, int32)
        wa = cuda.shared.array(WARP, uint64)
        wb = cuda.shared.array(WARP, uint64)
        count_k = cuda.shared.array(RADIX_BINS, int32)   # top-k: candidates per digit value
        count_p = cuda.shared.array(RADIX_BINS, int32)   # top-p: the same, for its early stop
        mass_p = cuda.shared.array(RADIX_BINS, uint64)   # top-p: candidates' fixed-point mass per digit value
        # Values one thread finds and all threads read: 0-11 the radix digits' (see _select_digit), then 12 the
        # draw's chunk, 13 the kept mass before it, 14 the token.
        slot = cuda.shared.array(15, int64)
        xs = cuda.local.array(UNROLL, float32)

        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x
        vocab = logits.shape[1]
        x = logits[row]
        t = temperature[row]

        # ---- pass 1: the greedy answer; for T > 0 it also gives max z, since x -> fl(x / T) is monotone
        best, greedy, lowest = _row_argmax(logits, row, vbuf, ibuf, wv, wi)
        if t == 0:
            if tid == 0:
                out[row] = greedy
            return  # the whole block leaves together
        zmax = best / t
        if t < 0:  # dividing by a negative T reverses the order: max z comes from the smallest logit
            zmax = float32(-_block_max(-float64(lowest), vbuf, wv)) / t

        # ---- pass 2: the softmax denominator (float64 partial sums, rounded once to float32)
        acc = float64(0)
        for i in range(tid, vocab, threads):
            acc += float64(_weight(logits[row, i], t, zmax))
        total = float32(_block_sum(acc, vbuf, wv))
        p_max = float32(1) / total  # exp(0) = 1 at the largest z: the reference's p.max()

        # ---- passes 3-5: top-k and top-p thresholds by radix select on the bits of p, most significant digit
        # first. Each search keeps a prefix (the digits chosen so far) and what is still to be found among the
        # candidates that share it: a rank for top-k, a fixed-point mass for top-p.
        k_done, k_left, p_done, p_left = _search_start(top_k[row], top_p[row], vocab)
        k_prefix = uint32(0)
        p_prefix = uint32(0)
        if not (k_done and p_done):
            for j in range(tid, RADIX_BINS, threads):
                count_k[j] = 0
                count_p[j] = 0
                mass_p[j] = uint64(0)
            cuda.syncthreads()
        for digit in range(RADIX_PASSES):
            if k_done and p_done:  # block-uniform: every thread holds the same search state
                break
            shift = uint32(RADIX_BITS * (RADIX_PASSES - 1 - digit))
            for i in range(tid, vocab, threads):
                _count(_prob(logits[row, i], t, zmax, total), shift, k_done, k_prefix, p_done, p_prefix,
                       count_k, count_p, mass_p)
            cuda.syncthreads()
            k_done, k_prefix, k_left, p_done, p_prefix, p_left = _select_digit(
                count_k, count_p, mass_p, digit, bins_per_thread, k_done, k_prefix, k_left, p_done, p_prefix,
                p_left, slot, abuf, bbuf, wa, wb)
        threshold = _threshold(k_prefix, p_prefix, min_p[row], p_max)

        # ---- pass 6: the draw, inverse CDF in vocabulary order; thread tid owns [tid * chunk, (tid+1) * chunk)
        chunk = (vocab + threads - 1) // threads
        kept_mass, last_kept = _kept_mass(x, tid * chunk, min(vocab, (tid + 1) * chunk), t, zmax, total,
                                          threshold, xs)
        if tid == 0:
            slot[12] = -1
            slot[14] = greedy  # nothing kept (NaN logits, min_p > 1): fall back to the greedy token
        before, _, kept_total, _ = _block_scan2(kept_mass, uint64(0), tid, abuf, bbuf, wa, wb)
        target = _draw_target(uniform[row], kept_total)
        if before <= target and target < before + kept_mass:
            slot[12] = tid
            slot[13] = int64(before)
        cuda.syncthreads()
        owner = slot[12]
        if owner >= 0:  # block-uniform
            c_start = owner * chunk
            token = _draw_in_chunk(x, c_start, min(vocab, c_start + chunk), t, zmax, total, threshold,
                                   uint64(slot[13]), target, abuf, bbuf, wa, wb)
            if token >= 0:
                slot[14] = token
        else:
            last = _block_max(float64(last_kept), vbuf, wv)
            if tid == 0 and last >= 0:
                slot[14] = int64(last)
        cuda.syncthreads()
        if tid == 0:
            out[row] = int32(slot[14])

    return sample_kernel


# The split sample (`sample(..., workspace=)`): ten kernels, each pass over the rows a grid (S, P) over P
# partitions of chunk elements, a per-row kernel wherever a pass needs a decision made from all partitions.
# Every kernel reads what the earlier ones left in the workspace (sections named as in the module docstring)
# and does nothing for a row that is already decided, so the launch sequence depends on shapes only.
# NOTE (shared arrays): these kernels take one shared array per element type and slice it into the reduction
# buffers (per-thread entries, then per-warp ones), because the simulator's cuda.shared.array walks the Python
# stack on every call: ~0.2 ms per simulated thread per array, more than a barrier costs there; and kernels
# with an early exit declare them after it (on the GPU shared memory is static: the placement costs nothing).

@lru_cache(maxsize=None)
def _sample_max_kernel(threads):
    reduce_size = threads + WARP  # a shared array's size must be a constant, not an expression

    @cuda.jit(**_jit_options(threads))
    def sample_max_kernel(logits, temperature, chunk, part_index, part_low, part_last, hist):
        # logits (S, V) float32; part_index (S, P) int64; part_low (S, P) float64; part_last (S, P) int64;
        # hist (S, 3, RADIX_BINS) uint64. grid (S, P), block (threads,): block (s, p) writes the index of the
        # best logit of logits[s, p*chunk : (p+1)*chunk] (and for T < 0 the smallest logit's value), and resets
        # what later passes accumulate into with atomics: its part_last to -1 and its share of row s's
        # histograms to 0 (graph replays reuse the workspace).
        fbuf = cuda.shared.array(reduce_size, float64)  # see NOTE (shared arrays)
        ibuf = cuda.shared.array(reduce_size, int32)
        vbuf, wv = fbuf[:threads], fbuf[threads:]
        ibuf, wi = ibuf[:threads], ibuf[threads:]
        xs = cuda.local.array(UNROLL, float32)
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        start = int64(part) * chunk
        end = min(int64(logits.shape[1]), start + chunk)
        best, best_index, lowest = _chunk_argmax(logits[uint64(row)], start, end, xs)
        _, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
        if temperature[row] < 0:  # block-uniform
            low = -_block_max(-float64(lowest), vbuf, wv)
            if tid == 0:
                part_low[row, part] = low
        if tid == 0:
            part_index[row, part] = index
            part_last[row, part] = -1
        for j in range(part * threads + tid, 3 * RADIX_BINS, cuda.gridDim.y * threads):
            hist[row, j // RADIX_BINS, j % RADIX_BINS] = 0

    return sample_max_kernel


@lru_cache(maxsize=None)
def _sample_sum_kernel(threads):
    reduce_size = threads + WARP  # a shared array's size must be a constant, not an expression

    @cuda.jit(**_jit_options(threads))
    def sample_sum_kernel(logits, temperature, top_k, top_p, chunk, part_index, part_low, part_sum, state,
                          zstate):
        # part_index, part_low (S, P) from the max pass; part_sum (S, P) float64; state (S, STATE_WORDS) int64;
        # zstate (S, 2) float64. grid (S, P), block (threads,): every block merges its row's P max partials
        # itself (P indices and P logits: cheaper than a kernel launch), then sums e over its partition in
        # float64, strided mapping; block (s, 0) writes row s's greedy token, max z and the searches' start.
        # NOTE: the partial sums are combined later in partition order (_row_total), so the denominator is
        # deterministic; it differs from v1's (another order of float64 additions) only where two float64
        # sums ~1e-16 apart round to different float32s.
        fbuf = cuda.shared.array(reduce_size, float64)  # see NOTE (shared arrays)
        ibuf = cuda.shared.array(reduce_size, int32)
        vbuf, wv = fbuf[:threads], fbuf[threads:]
        ibuf, wi = ibuf[:threads], ibuf[threads:]
        xs = cuda.local.array(UNROLL, float32)
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        x = logits[uint64(row)]
        vocab = logits.shape[1]
        t = temperature[row]
        best, greedy = _merge_argmax(x, part_index[row], vbuf, ibuf, wv, wi)
        k_done, k_left, p_done, p_left = _search_start(top_k[row], top_p[row], vocab)
        if t == 0:  # greedy: every later kernel leaves this row alone, and the draw writes the greedy token
            k_done = True
            p_done = True
        if part == 0 and tid == 0:
            state[row, GREEDY] = greedy
            _store_search(state, row, k_done, uint32(0), k_left, p_done, uint32(0), p_left)
        if t == 0:
            return
        zmax = best / t
        if t < 0:  # max z comes from the smallest logit
            low = float64(-np.inf)
            for q in range(tid, part_low.shape[1], threads):
                low = max(low, -part_low[row, q])
            zmax = float32(-_block_max(low, vbuf, wv)) / t
        if part == 0 and tid == 0:
            zstate[row, ZMAX] = zmax
        start = int64(part) * chunk
        end = min(int64(vocab), start + chunk)
        acc = float64(0)
        base = start + tid
        while base < end:
            _load_round(x, base, threads, end, xs)
            for k in range(UNROLL):
                if base + k * threads < end:
                    acc += float64(_weight(xs[k], t, zmax))
            base += UNROLL * threads
        acc = _block_sum(acc, vbuf, wv)
        if tid == 0:
            part_sum[row, part] = acc

    return sample_sum_kernel


@lru_cache(maxsize=None)
def _sample_hist_kernel(threads):
    @cuda.jit(**_jit_options(threads))
    def sample_hist_kernel(logits, temperature, chunk, digit, part_sum, state, zstate, hist):
        # hist (S, 3, RADIX_BINS) uint64: row s's count_k, count_p and mass_p for this digit. grid (S, P), block
        # (threads,): block (s, p) builds the digit's histograms of its partition in shared memory (strided
        # mapping) and adds its non-empty bins to row s's with global integer atomics, which give the same
        # sums in any order. Rows whose searches are both done (or off, or T = 0) return at once.
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        k_done = state[row, K_DONE] != 0
        p_done = state[row, P_DONE] != 0
        if k_done and p_done:
            return
        counts = cuda.shared.array((2, RADIX_BINS), int32)  # see NOTE (shared arrays)
        count_k, count_p = counts[0], counts[1]
        mass_p = cuda.shared.array(RADIX_BINS, uint64)
        xs = cuda.local.array(UNROLL, float32)
        for j in range(tid, RADIX_BINS, threads):
            count_k[j] = 0
            count_p[j] = 0
            mass_p[j] = uint64(0)
        t = temperature[row]
        zmax = float32(zstate[row, ZMAX])
        if digit == 0:  # the first digit's select kernel has not stored the denominator yet
            total = _row_total(part_sum, row)
        else:
            total = float32(zstate[row, TOTAL])
        k_prefix = uint32(state[row, K_PREFIX])
        p_prefix = uint32(state[row, P_PREFIX])
        shift = uint32(RADIX_BITS * (RADIX_PASSES - 1 - digit))
        x = logits[uint64(row)]
        start = int64(part) * chunk
        end = min(int64(logits.shape[1]), start + chunk)
        cuda.syncthreads()
        base = start + tid
        while base < end:
            _load_round(x, base, threads, end, xs)
            for k in range(UNROLL):
                if base + k * threads < end:
                    _count(_prob(xs[k], t, zmax, total), shift, k_done, k_prefix, p_done, p_prefix,
                           count_k, count_p, mass_p)
            base += UNROLL * threads
        cuda.syncthreads()
        for j in range(tid, RADIX_BINS, threads):
            if count_k[j] != 0:
                cuda.atomic.add(hist, (row, 0, j), uint64(count_k[j]))
            if count_p[j] != 0:
                cuda.atomic.add(hist, (row, 1, j), uint64(count_p[j]))
                cuda.atomic.add(hist, (row, 2, j), mass_p[j])

    return sample_hist_kernel


@lru_cache(maxsize=None)
def _sample_select_kernel(threads):
    scan_size = 2 * (threads + WARP)  # a shared array's size must be a constant, not an expression
    bins_per_thread = RADIX_BINS // threads

    @cuda.jit(**_jit_options(threads))
    def sample_select_kernel(temperature, digit, part_sum, state, zstate, hist):
        # grid (S,), block (threads,): row s's digit, decided from its complete histograms by `_select_digit`
        # (which clears them for the next digit); the searches' new state goes back to `state`. The first
        # digit's kernel also stores the denominator for the passes after it.
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        if digit == 0 and tid == 0 and temperature[row] != 0:
            zstate[row, TOTAL] = _row_total(part_sum, row)
        k_done = state[row, K_DONE] != 0
        p_done = state[row, P_DONE] != 0
        if k_done and p_done:
            return
        ubuf = cuda.shared.array(scan_size, uint64)  # see NOTE (shared arrays)
        abuf, bbuf = ubuf[:threads], ubuf[threads:2 * threads]
        wa, wb = ubuf[2 * threads:2 * threads + WARP], ubuf[2 * threads + WARP:]
        slot = cuda.shared.array(12, int64)
        k_done, k_prefix, k_left, p_done, p_prefix, p_left = _select_digit(
            hist[row, 0], hist[row, 1], hist[row, 2], digit, bins_per_thread, k_done,
            uint32(state[row, K_PREFIX]), uint64(state[row, K_LEFT]), p_done, uint32(state[row, P_PREFIX]),
            uint64(state[row, P_LEFT]), slot, abuf, bbuf, wa, wb)
        if tid == 0:  # every thread read the state before _select_digit's barriers
            _store_search(state, row, k_done, k_prefix, k_left, p_done, p_prefix, p_left)

    return sample_select_kernel


@lru_cache(maxsize=None)
def _sample_mass_kernel(threads):
    @cuda.jit(**_jit_options(threads))
    def sample_mass_kernel(logits, temperature, min_p, chunk, state, zstate, part_last, unit_mass):
        # part_last (S, P) int64; unit_mass (S, P * threads) uint64. grid (S, P), block (threads,): thread t of
        # block (s, p) owns unit p * threads + t, the contiguous sub-chunk [p*chunk + t*sub, ... + sub) with
        # sub = ceil(chunk / threads) (units in vocabulary order), and writes its fixed-point kept mass; its
        # last kept token with p > 0 goes to part_last by an integer atomic max (order-independent). No
        # barrier: nothing here needs the rest of the block.
        xs = cuda.local.array(UNROLL, float32)
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        t = temperature[row]
        if t == 0:
            return
        zmax = float32(zstate[row, ZMAX])
        total = float32(zstate[row, TOTAL])
        threshold = _threshold(uint32(state[row, K_PREFIX]), uint32(state[row, P_PREFIX]), min_p[row],
                               float32(1) / total)
        start, end = _unit_range(part * threads + tid, threads, chunk, logits.shape[1])
        kept, last = _kept_mass(logits[uint64(row)], start, end, t, zmax, total, threshold, xs)
        unit_mass[row, part * threads + tid] = kept
        if last >= 0:
            cuda.atomic.max(part_last, (row, part), last)

    return sample_mass_kernel


@lru_cache(maxsize=None)
def _sample_draw_kernel(threads):
    scan_size = 2 * (threads + WARP)  # a shared array's size must be a constant, not an expression

    @cuda.jit(**_jit_options(threads))
    def sample_draw_kernel(logits, temperature, min_p, uniform, chunk, state, zstate, part_last, unit_mass, out):
        # out (S,) int32. grid (S,), block (threads,), the mass pass's block size: the inverse CDF of row s in
        # two levels, each a block scan in vocabulary order: thread t sums the kept masses of units
        # [t*P, (t+1)*P) to find the unit holding u * total; then the block re-reads that unit
        # (`_draw_in_chunk`). T = 0 rows get the greedy token, as do rows with nothing kept.
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        t = temperature[row]
        if t == 0:
            if tid == 0:
                out[row] = int32(state[row, GREEDY])
            return
        ubuf = cuda.shared.array(scan_size, uint64)  # see NOTE (shared arrays)
        abuf, bbuf = ubuf[:threads], ubuf[threads:2 * threads]
        wa, wb = ubuf[2 * threads:2 * threads + WARP], ubuf[2 * threads + WARP:]
        slot = cuda.shared.array(3, int64)  # the unit holding the target, the kept mass before it, the token
        zmax = float32(zstate[row, ZMAX])
        total = float32(zstate[row, TOTAL])
        threshold = _threshold(uint32(state[row, K_PREFIX]), uint32(state[row, P_PREFIX]), min_p[row],
                               float32(1) / total)
        parts = part_last.shape[1]
        mass = uint64(0)
        for unit in range(tid * parts, (tid + 1) * parts):
            mass += unit_mass[row, unit]
        if tid == 0:
            slot[0] = -1
            slot[2] = state[row, GREEDY]  # nothing kept (NaN logits, min_p > 1): the greedy token
        before, _, kept_total, _ = _block_scan2(mass, uint64(0), tid, abuf, bbuf, wa, wb)
        target = _draw_target(uniform[row], kept_total)
        if before <= target and target < before + mass:
            run = before
            for unit in range(tid * parts, (tid + 1) * parts):
                m = unit_mass[row, unit]
                if run + m > target:
                    slot[0] = unit
                    slot[1] = int64(run)
                    break
                run += m
        cuda.syncthreads()
        unit = slot[0]
        if unit >= 0:  # block-uniform
            start, end = _unit_range(unit, threads, chunk, logits.shape[1])
            token = _draw_in_chunk(logits[uint64(row)], start, end, t, zmax, total, threshold, uint64(slot[1]),
                                   target, abuf, bbuf, wa, wb)
            if token >= 0:
                slot[2] = token
        elif tid == 0:  # u * total reached the total: the last kept token, if any
            for q in range(parts):
                if part_last[row, q] >= 0:
                    slot[2] = part_last[row, q]
        cuda.syncthreads()
        if tid == 0:
            out[row] = int32(slot[2])

    return sample_draw_kernel


# --- launchers ----------------------------------------------------------------------------------------------

def _check_device(name, array):
    # Kernels never allocate or copy: a host array here would be copied on every call (and break graph capture).
    if isinstance(array, np.ndarray) or not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{name} must be a device array (cuda.to_device / cuda.device_array), "
                        f"got {type(array).__name__}")


def _check(name, array, dtype, shape):
    """A device array of the given dtype and shape, or a TypeError/ValueError that says what is wrong."""
    _check_device(name, array)
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {np.dtype(array.dtype).name}")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(array.shape)}")


def _check_logits(logits, out):
    _check_device("logits", logits)
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be 2-D (num_seqs, vocab), got shape {tuple(logits.shape)}")
    num_seqs, vocab = logits.shape
    _check("logits", logits, np.float32, (num_seqs, vocab))
    if vocab < 1 or vocab >= 2 ** 31 - 1:
        raise ValueError(f"vocab size must be in [1, 2^31 - 1), got {vocab}")
    _check("out", out, np.int32, (num_seqs,))
    return num_seqs, vocab


def _check_threads(threads):
    if threads not in BLOCK_SIZES:
        raise ValueError(f"threads must be one of {BLOCK_SIZES}, got {threads!r}")


def argmax_naive(logits, out, stream=0, threads=64):
    """Greedy tokens, one thread per row (teaching version). logits (S, V) float32 -> out (S,) int32."""
    num_seqs, _ = _check_logits(logits, out)
    _check_threads(threads)
    if num_seqs == 0:
        return
    launch(_argmax_naive_kernel, (num_seqs + threads - 1) // threads, threads, stream, logits, out)


def argmax_partitions(num_rows, vocab):
    """(P, chunk) of the split argmax from shapes only (CUDA-graph safe): enough partitions per row for about
    TARGET_BLOCKS blocks in all, each chunk at least MIN_CHUNK elements (so P <= V // MIN_CHUNK); P = 1 (no
    stage 2, no workspace) once the rows alone fill the grid or V < 2 * MIN_CHUNK. Llama 3's V = 128256:
    62 x 2069 at 1 row, 16 x 8016 at 64 rows, 4 x 32064 at 256 (1 row: 62 blocks, at most one per SM)."""
    wanted = -(-TARGET_BLOCKS // max(1, int(num_rows)))
    most = int(vocab) // MIN_CHUNK
    return _partition(vocab, max(1, min(wanted, most)))


def _partition(vocab, partitions):
    """(P, chunk) for at most `partitions` chunks: chunk = ceil(V / partitions), then P = ceil(V / chunk), so
    that no partition is empty (V = 9 in 4 asks gives 3 chunks of 3)."""
    chunk = -(-int(vocab) // int(partitions))
    return -(-int(vocab) // chunk), chunk


def argmax_workspace_size(num_rows, vocab) -> int:
    """int32 elements of the split argmax's workspace for every batch of up to num_rows rows of V logits (the
    runner allocates it once for max_num_seqs; `argmax(..., workspace=)`). At least 1, so it can be allocated."""
    most = 0
    for s in range(1, min(int(num_rows), TARGET_BLOCKS) + 1):  # from TARGET_BLOCKS rows on, P = 1
        parts, _ = argmax_partitions(s, vocab)
        if parts > 1:
            most = max(most, s * parts)
    return max(1, most)


def _check_workspace(workspace, dtype, needed, missing, layout):
    """A 1-D device array of `dtype` with at least `needed` elements; `missing` and `layout` say what it is for."""
    dtype = np.dtype(dtype).name
    if workspace is None:
        article = "an" if dtype.startswith("i") else "a"
        raise ValueError(f"{missing} need a workspace: {article} {dtype} device array of at least {needed} elements "
                         f"({layout})")
    _check_device("workspace", workspace)
    if np.dtype(workspace.dtype) != np.dtype(dtype):
        raise TypeError(f"workspace must be {dtype}, got {np.dtype(workspace.dtype).name}")
    if len(workspace.shape) != 1 or workspace.shape[0] < needed:
        raise ValueError(f"workspace must be 1-D with at least {needed} {dtype} elements ({layout}), got shape "
                         f"{tuple(workspace.shape)}")


def _split_shape(num_seqs, vocab, partitions):
    """(P, chunk) of a split kernel: the policy (argmax_partitions), or a checked override."""
    if partitions is None:
        return argmax_partitions(num_seqs, vocab)
    if isinstance(partitions, bool) or int(partitions) != partitions or partitions < 1:
        raise ValueError(f"partitions must be a positive int, got {partitions!r}")
    return _partition(vocab, partitions)


def argmax(logits, out, stream=0, threads=None, *, workspace=None, partitions=None):
    """Greedy tokens: out[s] = the lowest index of the largest logit of row s (numpy.argmax exactly).

    workspace: None, or an int32 device array of at least argmax_workspace_size(max rows, V) elements (the
    runner allocates one for max_num_seqs and passes it on every call). Without it: v2, one block per row
    (threads defaults to DEFAULT_THREADS). With it: v3, the split argmax, P = argmax_partitions(S, V)
    partitions per row; stage 1 writes one index per (row, partition) to the front of the workspace and stage
    2 reduces each row's P of them (threads defaults to SPLIT_THREADS, stage 2 picks its own). Its contents
    before the call do not matter.
    partitions: override the policy (tests and benchmarks): any positive int is correct, at most V are used
    (see _partition); with partitions given, v3 runs even without a workspace when that makes P = 1.
    Both versions give bit-identical tokens on every run: `_beats` is a strict total order on (value, index)
    pairs, so the order in which pairs are combined cannot change the answer.
    """
    num_seqs, vocab = _check_logits(logits, out)
    if workspace is None and partitions is None:
        threads = DEFAULT_THREADS if threads is None else threads
        _check_threads(threads)
        if num_seqs == 0:
            return
        launch(_argmax_kernel(threads), num_seqs, threads, stream, logits, out)
        return
    threads = SPLIT_THREADS if threads is None else threads
    _check_threads(threads)
    parts, chunk = _split_shape(num_seqs, vocab, partitions)
    if parts > 1:
        _check_workspace(workspace, np.int32, num_seqs * parts, f"{parts} partitions",
                         f"{num_seqs} rows x {parts} partitions; argmax_workspace_size({num_seqs}, {vocab}) = "
                         f"{argmax_workspace_size(num_seqs, vocab)}")
    if num_seqs == 0:
        return
    if parts == 1:  # stage 1 alone: its one partial per row is the token
        launch(_argmax_partial_kernel(threads), (num_seqs, 1), threads, stream, logits, chunk, out)
        return
    part_index = workspace[:num_seqs * parts]
    launch(_argmax_partial_kernel(threads), (num_seqs, parts), threads, stream, logits, chunk, part_index)
    merge_threads = next((b for b in BLOCK_SIZES if b >= parts), BLOCK_SIZES[-1])
    launch(_argmax_merge_kernel(merge_threads), num_seqs, merge_threads, stream, logits, part_index, parts, out)


def _sample_sections(workspace, num_rows, parts, threads):
    """The split sample's workspace sections, typed views of its front in this order (the module docstring
    gives their meaning): hist, state, zstate, part_index, part_low, part_sum, part_last, unit_mass. With
    workspace None: the number of uint64 elements they take."""
    s, p = int(num_rows), int(parts)
    layout = ((np.uint64, (s, 3, RADIX_BINS)), (np.int64, (s, STATE_WORDS)), (np.float64, (s, 2)),
              (np.int64, (s, p)), (np.float64, (s, p)), (np.float64, (s, p)), (np.int64, (s, p)),
              (np.uint64, (s, p * int(threads))))
    views, offset = [], 0
    for dtype, shape in layout:
        n = math.prod(shape)
        if workspace is not None:
            views.append(workspace[offset:offset + n].view(dtype).reshape(shape))
        offset += n
    return offset if workspace is None else views


def sample_workspace_size(num_rows, vocab, threads=None) -> int:
    """uint64 elements of the split sample's workspace for every batch of up to num_rows rows of V logits, at
    the launcher's policy and `threads` (default SPLIT_THREADS): the runner allocates it once for
    max_num_seqs (`sample(..., workspace=)`). At least 1, so it can be allocated. Llama 3's V = 128256 at
    128 threads: 256 rows need 7.4 MB, one row 0.09 MB."""
    threads = SPLIT_THREADS if threads is None else threads
    # from TARGET_BLOCKS rows on P = 1, and the size only grows with the rows
    counts = list(range(1, min(int(num_rows), TARGET_BLOCKS) + 1)) + [int(num_rows)]
    return max([1] + [_sample_sections(None, s, argmax_partitions(s, vocab)[0], threads)
                      for s in counts if s > 0])


def sample(logits, temperature, top_k, top_p, min_p, uniform, out, stream=0, threads=None, *, workspace=None,
           partitions=None):
    """Next tokens as reference/sampling.sample; every argument is a device array.

    temperature, top_p, min_p, uniform (S,) float32; top_k (S,) int32 (0 or >= V: off); out (S,) int32.
    workspace: None, or a uint64 device array of at least sample_workspace_size(max rows, V) elements (the
    runner allocates one for max_num_seqs and passes it on every call; its contents before the call do not
    matter). Without it: v1, one block per row (threads defaults to DEFAULT_THREADS). With it: v2, the split
    sample, ten kernels over P = argmax_partitions(S, V) partitions per row (threads defaults to
    SPLIT_THREADS, for every kernel of the sequence).
    partitions: override the policy (tests and benchmarks): any positive int is correct, at most V are used;
    v2 always needs a workspace (its histograms and row state live there), also for P = 1.
    """
    num_seqs, vocab = _check_logits(logits, out)
    for name, array, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                               ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                               ("uniform", uniform, np.float32)):
        _check(name, array, dtype, (num_seqs,))
    if workspace is None and partitions is None:
        threads = DEFAULT_THREADS if threads is None else threads
        _check_threads(threads)
        if num_seqs == 0:
            return
        launch(_sample_kernel(threads), num_seqs, threads, stream, logits, temperature, top_k, top_p, min_p,
               uniform, out)
        return
    threads = SPLIT_THREADS if threads is None else threads
    _check_threads(threads)
    parts, chunk = _split_shape(num_seqs, vocab, partitions)
    _check_workspace(workspace, np.uint64, _sample_sections(None, num_seqs, parts, threads),
                     "the split sample's kernels", f"{num_seqs} rows x {parts} partitions x {threads} threads; "
                     f"sample_workspace_size({num_seqs}, {vocab}, {threads}) = "
                     f"{sample_workspace_size(num_seqs, vocab, threads)}")
    if num_seqs == 0:
        return
    hist, state, zstate, part_index, part_low, part_sum, part_last, unit_mass = \
        _sample_sections(workspace, num_seqs, parts, threads)
    grid = (num_seqs, parts)
    launch(_sample_max_kernel(threads), grid, threads, stream, logits, temperature, chunk, part_index, part_low,
           part_last, hist)
    launch(_sample_sum_kernel(threads), grid, threads, stream, logits, temperature, top_k, top_p, chunk, part_index,
           part_low, part_sum, state, zstate)
    for digit in range(RADIX_PASSES):
        launch(_sample_hist_kernel(threads), grid, threads, stream, logits, temperature, chunk, digit, part_sum,
               state, zstate, hist)
        launch(_sample_select_kernel(threads), num_seqs, threads, stream, temperature, digit, part_sum, state,
               zstate, hist)
    launch(_sample_mass_kernel(threads), grid, threads, stream, logits, temperature, min_p, chunk, state, zstate,
           part_last, unit_mass)
    launch(_sample_draw_kernel(threads), num_seqs, threads, stream, logits, temperature, min_p, uniform, chunk,
           state, zstate, part_last, unit_mass, out)
