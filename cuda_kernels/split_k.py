"""Split K: the blocks of one output tile share its K range and meet through a partials workspace.

    out[m, n] = sum_z partial_z[m, n],    partial_z[m, n] = sum over split z's slabs of x[m, k] W[n, k]

A decode batch of 16-256 rows gives a GEMM few output tiles: too few blocks to stream the weight from every SM.
So grid z = splits, and block z of a tile multiplies only its share of K's slabs: ceil(slabs / splits)
consecutive ones (split_range; the launchers accept only split counts that leave no share empty). Then
(``meeting``): every block stores its accumulators in the partials workspace, thread-major (element e of
thread t at e * THREADS + t, so the stores coalesce), fences, and counts itself in by an atomic add on its
tile's counter. The block that counts last resets the counter (for the next launch), adds every split's
partials in split order 0, 1, ... (so the sum does not depend on which block came last: the result is
deterministic) and runs the epilogue; the others leave. The partials are read through L2 (primitives.load_l2):
other SMs wrote them.

Used by gemm_pipelined (version 7 of matmul.py's list) and gemm_wgmma (version 11). Workspace: float32
partials of tiles * splits * BM * BN, int32 counters of tiles, zero before the first launch (every launch
leaves them so).
"""

from __future__ import annotations

import functools

import numpy as np

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.primitives import load_l2
from numba import cuda, float32, int32, uint32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def valid_splits(slabs: int) -> list[int]:
    """The split counts of `slabs` K slabs that leave no split empty (each split takes ceil(slabs / splits)
    slabs, the last what is left): 1 .. slabs, except counts like 3 splits of 4 slabs (2 + 2 + 0)."""
    return [s for s in range(1, slabs + 1) if (s - 1) * _cdiv(slabs, s) < slabs]


def partials_size(tiles: int, splits: int, bm: int, bn: int) -> int:
    """float32 partial sums a split launch needs: every split's BM x BN accumulators of every tile."""
    return tiles * splits * bm * bn


def check_split_args(kernel: str, splits: int, slabs: int, slab_k: int, split_workspace, tiles: int,
                     tile_elems: int):
    """Check a split launch's arguments: `splits` leaves no share of `slabs` K slabs (of slab_k) empty, and
    split_workspace (when splits > 1) is (float32 partials of at least tiles * splits * tile_elems, int32 counters
    of at least tiles). Returns (partials, counters), or None for splits = 1; a ValueError names the kernel and
    the need."""
    if splits not in valid_splits(slabs):
        raise ValueError(f"{kernel}: {splits} splits of {slabs} slabs of {slab_k} would leave a split empty "
                         f"(see valid_splits)")
    if splits == 1:
        return None
    partials, counters = split_workspace if split_workspace is not None else (None, None)
    need_p = tiles * splits * tile_elems
    if (partials is None or partials.dtype != np.float32 or len(partials.shape) != 1 or partials.shape[0] < need_p
            or counters.dtype != np.int32 or len(counters.shape) != 1 or counters.shape[0] < tiles):
        raise ValueError(f"{kernel}: {splits} splits need split_workspace = (float32 partials of >= {need_p}, "
                         f"int32 counters of >= {tiles}, zero)")
    return partials, counters


@cuda.jit(device=True, inline=True)
def split_range(slabs):
    """(first slab, number of slabs) of this block's share of K: gridDim.z splits of ceil(slabs / splits)."""
    per = (slabs + cuda.gridDim.z - 1) // cuda.gridDim.z
    first = cuda.blockIdx.z * per
    return first, min(slabs - first, per)


@functools.lru_cache(maxsize=None)
def meeting(acc_len: int, threads: int):
    """The device function meet(acc, partials, counters) -> bool for blocks whose first `threads` threads each
    hold `acc_len` float32 accumulators (acc, a local array): the module docstring's meeting. It returns True in
    the block that arrives last, with acc then the sum of every split's partials in split order, False in the
    others (which have nothing left to do). Every thread of the block must call it; threads past `threads`
    (gemm_tma's producer warp) hold no accumulators and only take part in the block barriers."""
    # NOTE: the partials of RED splits are loaded before any is added: independent loads in flight together,
    # so the sum costs splits / RED L2 round trips, not one per split
    RED = max(1, 64 // acc_len)

    @cuda.jit(device=True)
    def meet(acc, partials, counters):
        tile_id = cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.y
        splits = cuda.gridDim.z
        tid = cuda.threadIdx.x
        holds = tid < threads
        # NOTE: unsigned 32-bit indices (the workspace holds far fewer than 2^32 partials; primitives' module
        # docstring, "Index arithmetic")
        mine = uint32((tile_id * splits + cuda.blockIdx.z) * acc_len * threads + tid)
        if holds:
            for e in range(acc_len):
                partials[mine + uint32(e * threads)] = acc[e]
        cuda.threadfence()   # the partials are visible device-wide before the count says so
        last = cuda.shared.array(1, int32)
        cuda.syncthreads()
        if tid == 0:
            last[0] = cuda.atomic.add(counters, tile_id, 1) == splits - 1
        cuda.syncthreads()
        if last[0] == 0:
            return False
        if tid == 0:
            counters[tile_id] = 0   # every split has arrived: ready for the next launch
        cuda.threadfence()
        if not holds:
            return True
        for e in range(acc_len):
            acc[e] = float32(0)
        batch = cuda.local.array((RED, acc_len), float32)
        for z0 in range(0, splits, RED):
            for r in range(RED):
                if z0 + r < splits:
                    theirs = uint32((tile_id * splits + z0 + r) * acc_len * threads + tid)
                    for e in range(acc_len):
                        batch[r, e] = load_l2(partials, theirs + uint32(e * threads))
            for r in range(RED):
                if z0 + r < splits:
                    for e in range(acc_len):
                        acc[e] += batch[r, e]
        return True

    return meet
