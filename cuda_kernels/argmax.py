"""Greedy decoding on the GPU: the index of the largest logit of each row, exactly as numpy.argmax.

    token = min { i : l_i = max_j l_j }          (NaN counts as largest, like numpy)

Shapes and dtypes (device arrays):
    logits (S, V) float32 (any strides); out (S,) int32
    argmax with P > 1 partitions: workspace (n,) int32, n >= S * P; its first S * P elements hold the
    partials, part_index[s * P + p] = the best index of partition p of row s
Twin: reference.sampling.sample at temperature 0 (numpy.argmax per row).

Thread mapping:
    argmax_naive  grid = ceil(S / threads); one thread per row walks the whole row.
    argmax        grid = (S,); one block per row; thread t reads l[t], l[t + threads], ... (coalesced) and
                  the block reduces (value, index) pairs through shared memory.
    argmax (partitions=) split in two kernels, P and chunk = ceil(V / P) from the launcher's partitions:
                  stage 1  grid = (S, P); block (s, p) reduces l[s, p*chunk : (p+1)*chunk] with the strided
                           mapping, UNROLL loads in flight per thread before it compares any, and writes the
                           best index to the workspace (P = 1: to out, and stage 2 is skipped);
                  stage 2  grid = (S,); thread t of row s's block reads partial t, re-reads its logit, and
                           the block reduces the P pairs under the same order.
                  The engine's P is sampling_policy.argmax_partitions(S, V) (sampling_policy.greedy).
    Block sizes: 32-1024, powers of two (whole warps).

The block-wide reductions and scans here (_block_argmax, _block_max, _block_sum, _block_scan2) go through
shared memory, no warp shuffles, so the simulator runs exactly the GPU's source; sampling.py and logprobs.py
build on them too.

Versions:
    argmax_naive  v1: one thread per row. Neighbouring threads read addresses V floats apart: no load is
                  coalesced, and one row is one thread's sequential walk. Teaching only.
    argmax        v2: one block per row, strided loads (coalesced), two-level (value, index) reduction in
                  shared memory. A row per block leaves most SMs idle at small batches, and one load in
                  flight per thread starves it at large ones.
    argmax        v3 (with partitions=): split over (row, partition) blocks so that even one row fills the
                  GPU, UNROLL loads in flight per thread, a second kernel merges P indices per row;
                  bit-identical tokens to v2 (the order is total). What the engine runs.
Measured times of each version: docs/course/09-sampling.md.
"""

from functools import lru_cache

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from numba import cuda, float32, float64, int32, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.launch import launch
from cuda_kernels.primitives import WARP

#: block sizes the kernels accept: whole warps, at most 32 of them, and a divisor of sampling's 1024 bins
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
DEFAULT_THREADS = 64 if SIMULATOR else 512   # the simulator runs a Python thread per CUDA thread
NO_INDEX = 2 ** 31 - 1            # an index larger than any real one: loses every tie in the argmax
#: split argmax: loads each thread issues before it compares any
UNROLL = 8


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
#
# NOTE: the helpers of the split argmax (and its kernels) index with unsigned 32-bit integers in while loops
# (V < 2^31, so every index fits): primitives' module docstring, "Index arithmetic".

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
    tid = uint32(cuda.threadIdx.x)
    nwarps = uint32(uint32(cuda.blockDim.x) // uint32(WARP))   # (uint32 // uint32 widens to 64 bits)
    vbuf[tid] = value
    ibuf[tid] = index
    cuda.syncthreads()
    if tid < nwarps:
        j = uint32(tid * uint32(WARP))
        bv = vbuf[j]
        bi = ibuf[j]
        for _ in range(WARP - 1):
            j = uint32(j + uint32(1))
            if _beats(vbuf[j], ibuf[j], bv, bi):
                bv = vbuf[j]
                bi = ibuf[j]
        wv[tid] = bv
        wi[tid] = bi
    cuda.syncthreads()
    bv = wv[0]
    bi = wi[0]
    w = uint32(1)
    while w < nwarps:
        if _beats(wv[w], wi[w], bv, bi):
            bv = wv[w]
            bi = wi[w]
        w = uint32(w + uint32(1))
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
    is cast to uint64 for the load: numba then omits its negative-index wraparound (3 instructions a load). It
    steps by adding `step`, so unsigned base and step (the split argmax's) keep it unsigned throughout.
    """
    j = base
    for k in range(UNROLL):
        if j < end:
            xs[k] = x[uint64(j)]
        j += step


@cuda.jit(device=True)
def _chunk_argmax(x, start, end, xs):
    """This thread's best (value, index) under `_beats` and its smallest value over x[start:end] (x: one row),
    strided mapping, in rounds of `_load_round` (the reason the split argmax beats v2 even where both have
    blocks enough: docs/performance.md). A thread with no element in range returns (-inf, NO_INDEX, inf): it
    loses to every real element. The argmax ignores the smallest value (the compiler drops it there); `sample`
    needs it for T < 0.
    """
    step = uint32(cuda.blockDim.x)
    best = float32(-np.inf)
    best_index = int32(NO_INDEX)
    lowest = float32(np.inf)
    stop = uint32(end)
    base = uint32(start + cuda.threadIdx.x)
    while base < stop:
        _load_round(x, base, step, stop, xs)
        for k in range(UNROLL):
            j = uint32(base + uint32(k * step))
            if j < stop:
                if _beats(xs[k], int32(j), best, best_index):
                    best = xs[k]
                    best_index = int32(j)
                lowest = min(lowest, xs[k])
        base = uint32(base + uint32(UNROLL * step))
    return best, best_index, lowest


@cuda.jit(device=True)
def _merge_argmax(x, indices, vbuf, ibuf, wv, wi):
    """The best (value, index) under `_beats` among the elements x[indices[q]] (x: one row; indices: one row's
    partition winners), to every thread; thread t takes winners t, t + threads, ... NOTE: the partials are
    indices only; their values are read back from x (the same float32, so the same order), which keeps a
    partial one integer. Every partition is non-empty (P = ceil(V / chunk)), so every index is a real one."""
    best = float32(-np.inf)
    best_index = int32(NO_INDEX)
    count, step = uint32(indices.shape[0]), uint32(cuda.blockDim.x)
    q = uint32(cuda.threadIdx.x)
    while q < count:
        i = int32(indices[q])
        value = x[uint32(i)]
        if _beats(value, i, best, best_index):
            best = value
            best_index = i
        q = uint32(q + step)
    value, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
    return float32(value), index


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
        row = uint32(cuda.blockIdx.x)
        part = uint32(cuda.blockIdx.y)
        start = uint32(part * uint32(chunk))
        end = min(uint32(logits.shape[1]), uint32(start + uint32(chunk)))
        best, best_index, _ = _chunk_argmax(logits[row], start, end, xs)
        _, index = _block_argmax(float64(best), best_index, vbuf, ibuf, wv, wi)
        if cuda.threadIdx.x == 0:
            part_index[uint32(row * uint32(cuda.gridDim.y) + part)] = index

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
        row = uint32(cuda.blockIdx.x)
        first = uint32(row * uint32(parts))
        _, index = _merge_argmax(logits[row], part_index[first:uint32(first + uint32(parts))], vbuf, ibuf, wv, wi)
        if cuda.threadIdx.x == 0:
            out[row] = index

    return argmax_merge_kernel


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


def partition(vocab, partitions):
    """(P, chunk) for at most `partitions` chunks: chunk = ceil(V / partitions), then P = ceil(V / chunk), so
    that no partition is empty (V = 9 in 4 asks gives 3 chunks of 3)."""
    chunk = -(-int(vocab) // int(partitions))
    return -(-int(vocab) // chunk), chunk


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


def _split_shape(vocab, partitions, workspace):
    """(P, chunk) of a split kernel for the launcher's partitions (checked); a workspace without partitions is
    refused (the one-block-per-row versions take none)."""
    if partitions is None:
        if workspace is not None:
            raise ValueError("a workspace is for the split kernels: pass partitions too (the engine's: "
                             "sampling_policy.argmax_partitions)")
        return None
    if isinstance(partitions, bool) or int(partitions) != partitions or partitions < 1:
        raise ValueError(f"partitions must be a positive int, got {partitions!r}")
    return partition(vocab, partitions)


def argmax(logits, out, stream=0, threads=DEFAULT_THREADS, *, workspace=None, partitions=None):
    """Greedy tokens: out[s] = the lowest index of the largest logit of row s (numpy.argmax exactly).

    partitions None: v2, one block per row of `threads` threads. partitions given: v3, the split argmax, each
    row in at most that many chunks (any positive int is correct, at most V are used: see partition; the
    engine's is sampling_policy.argmax_partitions(S, V), through sampling_policy.greedy); stage 1 (blocks of
    `threads`) writes one index per (row, partition) to the front of workspace, an int32 device array of at
    least S * P elements (the engine's: sampling_policy.argmax_workspace_size; none needed when P = 1), and
    stage 2 reduces each row's P of them with its own block size. Its contents before the call do not matter.
    Both versions give bit-identical tokens on every run: `_beats` is a strict total order on (value, index)
    pairs, so the order in which pairs are combined cannot change the answer.
    """
    num_seqs, vocab = _check_logits(logits, out)
    _check_threads(threads)
    split = _split_shape(vocab, partitions, workspace)
    if split is None:
        if num_seqs == 0:
            return
        launch(_argmax_kernel(threads), num_seqs, threads, stream, logits, out)
        return
    parts, chunk = split
    if parts > 1:
        _check_workspace(workspace, np.int32, num_seqs * parts, f"{parts} partitions",
                         f"{num_seqs} rows x {parts} partitions")
    if num_seqs == 0:
        return
    if parts == 1:  # stage 1 alone: its one partial per row is the token
        launch(_argmax_partial_kernel(threads), (num_seqs, 1), threads, stream, logits, chunk, out)
        return
    part_index = workspace[:num_seqs * parts]
    launch(_argmax_partial_kernel(threads), (num_seqs, parts), threads, stream, logits, chunk, part_index)
    merge_threads = next((b for b in BLOCK_SIZES if b >= parts), BLOCK_SIZES[-1])
    launch(_argmax_merge_kernel(merge_threads), num_seqs, merge_threads, stream, logits, part_index, parts, out)
