"""Sampling the next token on the GPU: temperature, top-k / top-p / min-p filters and a seeded draw per row.

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
    sample: temperature, top_p, min_p, uniform (S,) float32; top_k (S,) int32; uniform in [0, 1)
    sample with partitions: workspace (n,) uint64, n >= workspace_elements(S, P, T); its front holds, in
    this order (P partitions, T threads per block; a unit is thread t's contiguous sub-chunk of partition p,
    [p*chunk + t*sub, ... + sub) with sub = ceil(chunk / T), numbered p*T + t, so units run in vocabulary order):
        hist        (S, 3, 1024) uint64   the current digit's count_k, count_p, mass_p of each row
        state       (S, 7) int64          greedy token, k_done, k_prefix, k_left, p_done, p_prefix, p_left
        zstate      (S, 2) float64        max z, sum of e (float32 values)
        part_index  (S, P) int64          best index of each partition      part_low (S, P) float64  its min
        part_sum    (S, P) float64        partial sums of e                 part_last (S, P) int64   last kept
        unit_mass   (S, P * T) uint64     fixed-point kept mass of each unit

Thread mapping (the greedy answer comes first, as argmax.py computes it):
    sample        grid = (S,); one block per row, the same strided mapping for the passes that only reduce;
                  for the draw thread t owns the contiguous chunk [t*C, (t+1)*C), C = ceil(V / threads).
                  Static shared memory: 28 * threads bytes + 17 KB of histograms (45 KB at 1024 threads,
                  under the 48 KB static limit).
    sample (partitions=) ten kernels, P and chunk from the launcher's partitions as the split argmax (the
                  engine's: sampling_policy), T threads in every kernel; (S, P) kernels use the strided mapping
                  within a partition, UNROLL loads in flight per thread; a row already decided makes the later
                  kernels return:
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
The device functions the kernels are built from (p, the radix digits, masses, the draw) are in
sampling_steps.py; the block reductions and the greedy passes in argmax.py.

Versions:
    sample        v1: one block per row; radix-select thresholds, fixed-point masses, two-level inverse CDF.
                  A row per block leaves most SMs idle at small batches.
    sample        v2 (with partitions=): the same passes split over (row, partition) blocks, ten kernels with
                  per-row decisions in between, nothing read back to the host (CUDA-graph safe). Tokens equal
                  v1's: thresholds and draws are the same integer searches on the same float32 p; only sum e
                  is added in another order (float64, rounded once), which moves a token only if that sum lies
                  within ~1e-16 of a float32 rounding boundary and the token at a boundary. What the engine runs.
Measured times of each version: docs/course/09-sampling.md.
"""

import math
from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from cuda_kernels.argmax import (DEFAULT_THREADS, UNROLL, _block_argmax, _block_max, _block_scan2, _block_sum,
                                 _check, _check_logits, _check_threads, _check_workspace, _chunk_argmax, _jit_options,
                                 _load_round, _merge_argmax, _row_argmax, _split_shape)
from cuda_kernels.launch import launch
from cuda_kernels.primitives import WARP
from cuda_kernels.sampling_steps import (GREEDY, K_DONE, K_LEFT, K_PREFIX, P_DONE, P_LEFT, P_PREFIX, RADIX_BINS,
                                         RADIX_BITS, RADIX_PASSES, STATE_WORDS, TOTAL, ZMAX, _count, _draw_in_chunk,
                                         _draw_target, _kept_mass, _prob, _row_total, _search_start, _select_digit,
                                         _store_search, _threshold, _unit_range, _weight)

# --- kernels ------------------------------------------------------------------------------------------------

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


# The split sample (`sample(..., partitions=)`): ten kernels, each pass over the rows a grid (S, P) over P
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


def workspace_elements(num_rows, parts, threads) -> int:
    """uint64 elements of the split sample's workspace for num_rows rows in `parts` partitions of `threads`
    threads (the engine's size for every batch up to a size: sampling_policy.sample_workspace_size)."""
    return _sample_sections(None, num_rows, parts, threads)


def sample(logits, temperature, top_k, top_p, min_p, uniform, out, stream=0, threads=DEFAULT_THREADS, *,
           workspace=None, partitions=None):
    """Next tokens as reference/sampling.sample; every argument is a device array.

    temperature, top_p, min_p, uniform (S,) float32; top_k (S,) int32 (0 or >= V: off); out (S,) int32.
    partitions None: v1, one block per row of `threads` threads. partitions given: v2, the split sample, ten
    kernels of `threads` threads over at most that many partitions per row (any positive int is correct, at
    most V are used; the engine's: sampling_policy.argmax_partitions, through sampling_policy.sample), on
    workspace, a uint64 device array of at least workspace_elements(S, P, threads) elements (its histograms
    and row state live there, so P = 1 needs one too; its contents before the call do not matter).
    """
    num_seqs, vocab = _check_logits(logits, out)
    for name, array, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                               ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                               ("uniform", uniform, np.float32)):
        _check(name, array, dtype, (num_seqs,))
    _check_threads(threads)
    split = _split_shape(vocab, partitions, workspace)
    if split is None:
        if num_seqs == 0:
            return
        launch(_sample_kernel(threads), num_seqs, threads, stream, logits, temperature, top_k, top_p, min_p,
               uniform, out)
        return
    parts, chunk = split
    _check_workspace(workspace, np.uint64, workspace_elements(num_seqs, parts, threads),
                     "the split sample's kernels", f"{num_seqs} rows x {parts} partitions x {threads} threads")
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
