"""Log-probabilities on the GPU: each row's log-softmax normalizer, its N most likely tokens, and the rank and
log-probability of one given token (the sampled one, or the next prompt token for prompt_logprobs).

Math (per row s of logits l, vocabulary V; exactly reference/sampling.top_logprobs):

    lse   = M + log(sum_j exp(l_j - M)),  M = max_j l_j          (float64: an online max and sum per thread)
    lp_i  = float32(l_i - lse)
    ids[s, 0] = t = targets[s],   values[s, 0] = lp_t,   ranks[s] = #{j : l_j >= l_t}     (vLLM's rank)
    ids[s, 1 + k], values[s, 1 + k] = the k-th largest l (the lower id first among equals) and its lp, k < N

with N = num_logprobs[s] <= width - 1; a row with N < 0 is skipped (nothing written). Only these ids,
values and ranks leave the GPU: (S, width) words twice and S more, against S x V logits.

Shapes and dtypes (device arrays):
    logits (S, V) float32; targets, num_logprobs (S,) int32
    out_ids (S, width) int32, out_logprobs (S, width) float32, out_ranks (S,) int32 (width = the most
        logprobs a request may ask for, + 1; it sizes each thread's candidate list at compile time)

Thread mapping: grid = (S,), one block of THREADS threads per row; thread t reads l[t], l[t + THREADS], ...
once, keeping an online (max, sum of exp) in float64, its count of l_j >= l_t, and its own N best
(value, id) pairs in a sorted local list (an insertion when a value beats its N-th). The block then reduces
(max, sum) and the count through shared memory, and takes N rounds of a block argmax over the threads' list
heads: the round's winner pops its head. The N best of the row are among the threads' N best.
Ties and NaN follow argmax._beats (numpy.argmax's order); a row holding NaN gives NaN values.

Versions: v1 only. One block per row reads a row at a single SM's bandwidth: at batch 1 and V = 128256 that
is one 0.5 MB pass where a split kernel (as argmax v3) would use every SM. Logprobs are asked
for rarely, and only their rows run.
"""

import math
from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (the numpy shim precedes numba.cuda)
from numba import cuda, float32, float64, int32

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.primitives import WARP
# the argmax order and the block reductions of argmax.py (shared memory only, no shuffles)
from cuda_kernels.argmax import NO_INDEX, _beats, _block_argmax, _block_max, _block_sum

THREADS = 32 if SIMULATOR else 256


# --- device helpers ---------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _insert(x, i, values, ids, kept, n):
    """Put (x, i) into the sorted list values/ids[:kept] (best first) that keeps at most n; returns the new
    length. The caller checks first that (x, i) belongs in the list."""
    j = min(kept, n - 1)
    while j > 0 and _beats(x, i, values[j - 1], ids[j - 1]):
        values[j] = values[j - 1]
        ids[j] = ids[j - 1]
        j -= 1
    values[j] = x
    ids[j] = i
    return min(kept + 1, n)


# --- kernels ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _top_logprobs_kernel(width, threads):
    slots = max(width - 1, 1)

    @cuda.jit
    def top_logprobs_kernel(logits, targets, num_logprobs, out_ids, out_logprobs, out_ranks):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = num_logprobs[row]
        if n < 0:  # block-uniform: the row asked for nothing
            return
        vbuf = cuda.shared.array(threads, float64)
        ibuf = cuda.shared.array(threads, int32)
        wv = cuda.shared.array(WARP, float64)
        wi = cuda.shared.array(WARP, int32)
        values = cuda.local.array(slots, float32)
        ids = cuda.local.array(slots, int32)
        target = targets[row]
        lt = logits[row, target]
        m = float64(-math.inf)
        s = float64(0)
        at_least = 0
        kept = 0
        for i in range(tid, logits.shape[1], threads):
            x = logits[row, i]
            if x >= lt:
                at_least += 1
            xd = float64(x)
            if xd > m:  # NOTE: online softmax: rescale the sum to the new maximum (exp(-inf) = 0 at the start)
                s = s * math.exp(m - xd) + float64(1)
                m = xd
            elif xd != -math.inf:  # -inf adds nothing (and -inf - -inf is NaN); NaN propagates
                s += math.exp(xd - m)
            if n > 0 and (kept < n or _beats(x, i, values[n - 1], ids[n - 1])):
                kept = _insert(x, int32(i), values, ids, kept, n)
        big = _block_max(m, vbuf, wv)
        part = float64(0)
        if m != -math.inf:
            part = s * math.exp(m - big)
        lse = big + math.log(_block_sum(part, vbuf, wv))
        rank = _block_sum(float64(at_least), vbuf, wv)
        if tid == 0:
            out_ids[row, 0] = target
            out_logprobs[row, 0] = float32(float64(lt) - lse)
            out_ranks[row] = int32(rank)
        head = 0
        for k in range(n):
            cv = float32(-math.inf)
            ci = int32(NO_INDEX)
            if head < kept:
                cv = values[head]
                ci = ids[head]
            best, best_index = _block_argmax(float64(cv), ci, vbuf, ibuf, wv, wi)
            if head < kept and ci == best_index:
                head += 1
            if tid == 0:
                if best_index == NO_INDEX:  # fewer than n tokens in the row
                    out_ids[row, 1 + k] = -1
                    out_logprobs[row, 1 + k] = float32(math.nan)
                else:
                    out_ids[row, 1 + k] = best_index
                    out_logprobs[row, 1 + k] = float32(best - lse)

    return top_logprobs_kernel


# --- launchers --------------------------------------------------------------------------------------------

def _check(name, array, dtype, shape):
    if isinstance(array, np.ndarray) or not hasattr(array, "shape"):
        raise TypeError(f"{name} must be a device array, got {type(array).__name__}")
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {np.dtype(array.dtype).name}")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(array.shape)}")


def top_logprobs(logits, targets, num_logprobs, out_ids, out_logprobs, out_ranks, stream=0, threads=None):
    """Per row with num_logprobs >= 0: the target's log-probability and rank, and the num_logprobs most likely
    tokens with theirs (module docstring). num_logprobs must be <= out_ids.shape[1] - 1 (not checked on the
    device: the host packs it from validated requests); targets in [0, V)."""
    if isinstance(logits, np.ndarray) or not hasattr(logits, "shape") or len(logits.shape) != 2:
        raise TypeError(f"logits must be a 2-D device array, got {type(logits).__name__}")
    rows = logits.shape[0]
    _check("logits", logits, np.float32, logits.shape)
    _check("targets", targets, np.int32, (rows,))
    _check("num_logprobs", num_logprobs, np.int32, (rows,))
    if len(out_ids.shape) != 2 or out_ids.shape[1] < 1:
        raise ValueError(f"out_ids must be (S, width >= 1), got shape {tuple(out_ids.shape)}")
    width = out_ids.shape[1]
    _check("out_ids", out_ids, np.int32, (rows, width))
    _check("out_logprobs", out_logprobs, np.float32, (rows, width))
    _check("out_ranks", out_ranks, np.int32, (rows,))
    threads = THREADS if threads is None else threads
    if threads % WARP or not WARP <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of {WARP} in [{WARP}, 1024], got {threads}")
    if rows:
        launch(_top_logprobs_kernel(width, threads), rows, threads, stream, logits, targets, num_logprobs, out_ids,
               out_logprobs, out_ranks)
