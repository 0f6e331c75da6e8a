"""The device functions the sampling kernels (sampling.py) are built from: p from a logit, the radix select of
the top-k and top-p thresholds, fixed-point masses and the draw. The math they implement is in sampling.py's
docstring; each function's docstring says which part it computes. Every one is called by all threads of a
block, in the same order, where it contains a block reduction or scan (argmax.py's helpers).
"""

import math

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from cuda_kernels.argmax import UNROLL, _block_scan2, _load_round
from cuda_kernels.primitives import f32_bits

RADIX_BITS = 10
RADIX_BINS = 1 << RADIX_BITS
RADIX_MASK = RADIX_BINS - 1
#: p <= 1 has bits <= 0x3F800000, so bits 30 and 31 are always 0: three 10-bit digits cover the rest
RADIX_PASSES = 3
FIXED_SCALE = float(2 ** 56)      # p * 2^56 < 2^56 and sum(p) ~ 1, far from the 2^64 limit of uint64
#: the split sample's per-row state (workspace section `state`, int64): the greedy token and both searches
GREEDY, K_DONE, K_PREFIX, K_LEFT, P_DONE, P_PREFIX, P_LEFT = range(7)
STATE_WORDS = 7
#: and its float64 section `zstate`: max z and the softmax denominator (float32 values, exact in float64)
ZMAX, TOTAL = range(2)


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
