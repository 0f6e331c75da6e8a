"""Hopper's bulk tensor copies (TMA) and the shared-memory barriers (mbarrier) that say when they have landed.

    shared tile (R x 64 bf16, 128-byte swizzle) <- global[row0 : row0 + R, k0 : k0 + 64]     (one instruction)

cp.async (cuda_kernels/async_copy.py) makes every thread of a block copy 16 bytes at a time: a 128 x 64 slab
of bf16 is 1,024 copies, each with its own address arithmetic, and the block synchronises before anyone reads
them. The Tensor Memory Accelerator of compute capability 9.0 copies a whole box of a 2-D array in one
instruction issued by one thread, writes it in the swizzled layout the tensor cores read (cuda_kernels/wgmma.py:
row r's 16-byte chunk c at c ^ (r % 8)), fills rows and columns outside the array with zeros, and reports
its bytes to an mbarrier. The rest of the block waits on that barrier instead of a block-wide one, so one warp
can feed the others while they multiply (cuda_kernels/gemm_tma.py).

Tensor maps. The copy reads a *tensor map*: 128 bytes the driver encodes (cuTensorMapEncodeTiled) from the
array's address, its extent (rows x cols of uint16, row stride cols * 2 bytes, a multiple of 16) and the box
(box_rows x 64 elements; 64 bf16 = the 128 bytes of one swizzled row). ``tensor_map(array, rows, cols,
box_rows)`` makes one and keeps it in a device array (the kernel gets its address) and caches it by exactly
what it encodes, so a map is made once per buffer and box, before any CUDA graph captures a launch that uses
it (making one copies 128 bytes to the device).

mbarrier. A 64-bit word in shared memory that counts arrivals and expected transaction bytes for the current
*phase*; when both reach zero the phase completes and the barrier re-arms for the next with the same arrival
count. ``mbarrier_init(bars, i, count)`` (one thread, then ``fence_barrier_init()`` and a block barrier);
``mbarrier_arrive_expect(bars, i, nbytes)``: arrive and expect nbytes more (the thread that issues the copies);
``mbarrier_arrive(bars, i)``; ``mbarrier_wait(bars, i, parity)``: returns once the phase of that parity (the
count of phases completed so far, mod 2) has completed: a pipeline stage used for the j-th time waits for
parity j % 2; ``syncwarp()`` after a lane's own branch or wait, before warp-aligned instructions.
``tma_load(sh, offset, tensor_map, k0, row0, box_rows, bars, i)`` copies the box at (row0, k0) into sh from
element offset `offset` (on 1,024 bytes) and completes its bytes on barrier i.

Two implementations, chosen at import time:
- GPU (sm_90a): inline PTX (``mbarrier.*.shared::cta.b64``, ``cp.async.bulk.tensor.2d.shared::cluster.global.
  tile.mbarrier::complete_tx::bytes``); a barrier is one uint64 (BARRIER_WORDS = 1).
- Numba's CUDA simulator: the tensor map is the 2-D array itself; a copy is done at once (zeros outside it) and
  its bytes completed; a barrier is four int64 words (expected arrivals, pending arrivals, pending bytes,
  phases completed) updated under one lock, and a wait yields the interpreter until its phase completes. The
  simulator runs every thread of a block in a Python thread, so the producer / consumer handshakes are real.
Kernels declare n barriers as ``cuda.shared.array(N_WORDS, BARRIER_DTYPE)``, N_WORDS = n * BARRIER_WORDS computed
outside the kernel (Numba takes a shared array's shape from a constant; it does not fold an expression).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint16, uint32, uint64

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.wgmma import TILE_K, aligned_start

BOX_K = TILE_K   # elements of a box along k: one 128-byte swizzled row

if SIMULATOR:
    import threading
    import time

    from cuda_kernels.wgmma import swizzled

    BARRIER_WORDS, BARRIER_DTYPE = 4, int64
    _LOCK = threading.Lock()

    def _complete_if_done(bars, b):
        if bars[b + 1] == 0 and bars[b + 2] == 0:
            bars[b + 1] = bars[b]
            bars[b + 3] += 1

    def mbarrier_init(bars, i, count):
        """Barrier i expects `count` arrivals a phase."""
        b = BARRIER_WORDS * i
        bars[b], bars[b + 1], bars[b + 2], bars[b + 3] = count, count, 0, 0

    def fence_barrier_init():
        """No-op in the simulator (the block barrier after the inits orders them)."""

    def mbarrier_arrive(bars, i):
        """One arrival on barrier i."""
        b = BARRIER_WORDS * i
        with _LOCK:
            bars[b + 1] -= 1
            _complete_if_done(bars, b)

    def mbarrier_arrive_expect(bars, i, nbytes):
        """One arrival on barrier i, and nbytes more that copies will complete in this phase."""
        b = BARRIER_WORDS * i
        with _LOCK:
            bars[b + 2] += nbytes
            bars[b + 1] -= 1
            _complete_if_done(bars, b)

    def mbarrier_wait(bars, i, parity):
        """Return once barrier i's phase of this parity has completed."""
        b = BARRIER_WORDS * i
        while bars[b + 3] % 2 == parity:
            time.sleep(0)   # let the thread that will complete the phase run

    def tensormap_acquire(tensor_map):
        """No-op in the simulator."""

    def syncwarp():
        """No-op in the simulator (it has no syncwarp, and its threads never run in lockstep)."""

    def tma_load(sh, offset, tensor_map, k0, row0, box_rows, bars, i):
        """sh[offset ...] <- the swizzled box_rows x 64 box of tensor_map at (row0, k0), zeros outside it; then
        its bytes complete on barrier i."""
        rows, cols = tensor_map.shape
        for r in range(box_rows):
            for k in range(BOX_K):
                inside = row0 + r < rows and k0 + k < cols
                sh[offset + swizzled(r, k // 8) + k % 8] = (tensor_map[row0 + r, k0 + k] if inside
                                                            else sh.dtype.type(0))
        b = BARRIER_WORDS * i
        with _LOCK:
            bars[b + 2] -= 2 * box_rows * BOX_K
            _complete_if_done(bars, b)

    def tensor_map(array, rows: int, cols: int, box_rows: int, stream=0, readable: int | None = None):
        """The simulator's tensor map: array seen as (rows, cols)."""
        from cuda_kernels.launch import view

        _check_map(array, rows, cols, box_rows, readable)
        return view(array, (rows, cols))

    def tensor_map_to_end(array, cols: int, box_rows: int, stream=0):
        """The map of every whole row of `cols` from array's first element to the end of its memory: the
        simulator's arrays own their memory."""
        return tensor_map(array, int(np.prod(array.shape)) // cols, cols, box_rows, stream)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from cuda_kernels.async_copy import element_pointer, ptx_statement, shared_pointer_address, volatile_asm

    BARRIER_WORDS, BARRIER_DTYPE = 1, uint64
    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def _shared_word(context, builder, arrty, arr, index):
        """The 32-bit shared-window address of arr[index] (arr a 1-D shared array)."""
        return shared_pointer_address(builder, element_pointer(context, builder, arrty, arr, index))

    def _global_address(context, builder, arrty, arr):
        """The 64-bit generic address of arr[0]."""
        return builder.ptrtoint(element_pointer(context, builder, arrty, arr, ir.Constant(_I64, 0)), _I64)

    def _asm_call(builder, text, constraints, values, result=ir.VoidType()):
        fnty = ir.FunctionType(result, [v.type for v in values])
        return builder.call(volatile_asm(fnty, text, constraints), values)

    @intrinsic
    def _init_asm(typingctx, bars, i, count):
        def codegen(context, builder, signature, args):
            bar = _shared_word(context, builder, signature.args[0], args[0], args[1])
            _asm_call(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", [bar, args[2]])
            return context.get_dummy_value()

        return types.void(bars, types.int64, types.uint32), codegen

    @intrinsic
    def _arrive_asm(typingctx, bars, i):
        def codegen(context, builder, signature, args):
            bar = _shared_word(context, builder, signature.args[0], args[0], args[1])
            _asm_call(builder, "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [$0];\n}", "r", [bar])
            return context.get_dummy_value()

        return types.void(bars, types.int64), codegen

    @intrinsic
    def _arrive_expect_asm(typingctx, bars, i, nbytes):
        def codegen(context, builder, signature, args):
            bar = _shared_word(context, builder, signature.args[0], args[0], args[1])
            _asm_call(builder, "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n}",
                      "r,r", [bar, args[2]])
            return context.get_dummy_value()

        return types.void(bars, types.int64, types.uint32), codegen

    @intrinsic
    def _try_wait_asm(typingctx, bars, i, parity):
        def codegen(context, builder, signature, args):
            bar = _shared_word(context, builder, signature.args[0], args[0], args[1])
            return _asm_call(builder, "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\n"
                             "selp.u32 $0, 1, 0, p;\n}", "=r,r,r", [bar, args[2]], _I32)

        return types.uint32(bars, types.int64, types.uint32), codegen

    @intrinsic
    def _acquire_asm(typingctx, tensor_map):
        def codegen(context, builder, signature, args):
            address = _global_address(context, builder, signature.args[0], args[0])
            _asm_call(builder, "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l", [address])
            return context.get_dummy_value()

        return types.void(tensor_map), codegen

    @intrinsic
    def _tma_asm(typingctx, sh, offset, tensor_map, k0, row0, bars, i):
        def codegen(context, builder, signature, args):
            dst = _shared_word(context, builder, signature.args[0], args[0], args[1])
            address = _global_address(context, builder, signature.args[2], args[2])
            bar = _shared_word(context, builder, signature.args[5], args[5], args[6])
            _asm_call(builder, "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                      " [$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r", [dst, address, args[3], args[4], bar])
            return context.get_dummy_value()

        return types.void(sh, types.int64, tensor_map, types.int32, types.int32, bars, types.int64), codegen

    fence_barrier_init = ptx_statement("fence.mbarrier_init.release.cluster;")

    @cuda.jit(device=True, inline=True)
    def mbarrier_init(bars, i, count):
        """Barrier i expects `count` arrivals a phase."""
        _init_asm(bars, int64(i), uint32(count))

    @cuda.jit(device=True, inline=True)
    def mbarrier_arrive(bars, i):
        """One arrival on barrier i."""
        _arrive_asm(bars, int64(i))

    @cuda.jit(device=True, inline=True)
    def mbarrier_arrive_expect(bars, i, nbytes):
        """One arrival on barrier i, and nbytes more that copies will complete in this phase."""
        _arrive_expect_asm(bars, int64(i), uint32(nbytes))

    @cuda.jit(device=True, inline=True)
    def mbarrier_wait(bars, i, parity):
        """Return once barrier i's phase of this parity has completed (try_wait suspends the thread for a
        while in hardware before it says no)."""
        while _try_wait_asm(bars, int64(i), uint32(parity)) == 0:
            pass

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """The warp's lanes reconverge: the warp-aligned instructions after a lane's own branch or wait (wgmma,
        block barriers) need all 32 together."""
        cuda.syncwarp()

    @cuda.jit(device=True, inline=True)
    def tensormap_acquire(tensor_map):
        """Make the map the host wrote into global memory visible to the copy engine's reads (the tensor-map
        proxy) before the first copy through it."""
        _acquire_asm(tensor_map)

    @cuda.jit(device=True, inline=True)
    def tma_load(sh, offset, tensor_map, k0, row0, box_rows, bars, i):
        """sh[offset ...] <- the swizzled box of tensor_map at (row0, k0) (box_rows is the map's own; the
        simulator's emulation needs it), zeros outside the array; its bytes complete on barrier i."""
        _tma_asm(sh, int64(offset), tensor_map, int32(k0), int32(row0), bars, int64(i))

    _MAPS: dict = {}

    def tensor_map(array, rows: int, cols: int, box_rows: int, stream=0, readable: int | None = None):
        """A device array holding the tensor map of `array` (uint16, C-contiguous, rows * cols elements readable
        from its start: its own, or `readable` where the caller knows its allocation goes on) seen as (rows,
        cols), boxes of box_rows x 64 with the 128-byte swizzle, zeros outside.
        Cached by what it encodes (address, extent, box): a map is made once, its 128 bytes copied in `stream`
        order. NOTE: so a CUDA graph must not be the first to use a map (capture forbids the copy); the eager
        steps of the engine's warm-up make them all first. Each launch asks again: the array keeps its maps, so
        that asking costs a dict lookup (as launch.py keeps an array's parameters)."""
        from cuda_kernels.driver import device_pointer, driver, ok, stream_handle

        mine = getattr(array, "_tinyvllm_maps", None)
        if mine is None:
            mine = array._tinyvllm_maps = {}
        found = mine.get((rows, cols, box_rows))
        if found is not None:
            return found
        _check_map(array, rows, cols, box_rows, readable)
        key = (device_pointer(array), rows, cols, box_rows)
        if key not in _MAPS:
            drv = driver()
            if stream and ok(drv.cuStreamIsCapturing(stream_handle(stream))) != \
                    drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                raise RuntimeError(f"tensor_map: the map of the array at {key[0]:#x} ({rows} x {cols}, boxes of "
                                   f"{box_rows} rows) is first needed inside a CUDA graph capture, which cannot copy "
                                   f"it to the device: launch the kernel once eagerly first")
            u64, u32 = drv.cuuint64_t, drv.cuuint32_t
            encoded = ok(drv.cuTensorMapEncodeTiled(
                drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, drv.CUdeviceptr(key[0]),
                [u64(cols), u64(rows)], [u64(cols * 2)], [u32(BOX_K), u32(box_rows)], [u32(1), u32(1)],
                drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
            words = np.array([int(w) for w in encoded.opaque], np.uint64)
            _MAPS[key] = cuda.to_device(words, stream=stream)
        mine[rows, cols, box_rows] = _MAPS[key]
        return _MAPS[key]

    def tensor_map_to_end(array, cols: int, box_rows: int, stream=0):
        """The map of every whole row of `cols` uint16 from array's first element to the end of the allocation
        it lies in, which may go on past the array itself (a slice of a buffer, or a buffer carved from a larger
        allocation): gemm_tma's maps of x cover the whole buffer. The rows are kept on the array."""
        from cuda_kernels.driver import device_pointer, driver, ok

        cached = getattr(array, "_tinyvllm_rows_to_end", None)
        if cached is None or cached[0] != cols:
            pointer = device_pointer(array)
            base, size = ok(driver().cuMemGetAddressRange(driver().CUdeviceptr(pointer)))
            cached = array._tinyvllm_rows_to_end = (cols, (int(base) + int(size) - pointer) // (2 * cols))
        rows = cached[1]
        return tensor_map(array, rows, cols, box_rows, stream, readable=rows * cols)


def _check_map(array, rows: int, cols: int, box_rows: int, readable: int | None = None) -> None:
    size = int(np.prod(array.shape)) if readable is None else readable
    if array.dtype != np.uint16 or rows * cols > size or cols % 8 or box_rows % 8 or not 8 <= box_rows <= 256:
        raise ValueError(f"tensor_map: need a uint16 array of >= rows * cols elements, cols % 8 == 0 (16-byte rows) "
                         f"and box_rows a multiple of 8 in 8 .. 256; got {array.dtype} of {size}, rows {rows}, "
                         f"cols {cols}, box_rows {box_rows}")


# ---------------------------------------------------------------------------------------------------------
# kernels: the copy alone, for the tests
# ---------------------------------------------------------------------------------------------------------

_TEST_BOX_ELEMENTS = 64 * BOX_K + 512   # one 64-row box and room to align it (uint16 elements)


@cuda.jit
def _box_kernel(tensor_map, k0, row0, box_rows, out):
    """One block: thread 0 copies the box at (row0, k0) by TMA; every thread waits on the barrier, then the
    block writes the shared image (still swizzled) to out."""
    sh = cuda.shared.array(_TEST_BOX_ELEMENTS, uint16)
    bars = cuda.shared.array(BARRIER_WORDS, BARRIER_DTYPE)
    start = aligned_start(sh)
    if cuda.threadIdx.x == 0:
        mbarrier_init(bars, 0, 1)
        fence_barrier_init()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        tensormap_acquire(tensor_map)
        mbarrier_arrive_expect(bars, 0, 2 * box_rows * BOX_K)
        tma_load(sh, start, tensor_map, k0, row0, box_rows, bars, 0)
    mbarrier_wait(bars, 0, 0)
    for e in range(cuda.threadIdx.x, box_rows * BOX_K, cuda.blockDim.x):
        out[e] = sh[start + e]


def load_box(array, rows: int, cols: int, box_rows: int, k0: int, row0: int, out, stream=0):
    """out (box_rows * 64,) uint16 <- the swizzled shared image of array's (rows, cols) box at (row0, k0), copied
    by one TMA instruction (box_rows <= 64). The test of the copy and of its barrier."""
    from cuda_kernels.launch import launch

    if box_rows > 64 or out.shape[0] < box_rows * BOX_K:
        raise ValueError(f"load_box: box_rows <= 64 and out of >= box_rows * 64 elements; got {box_rows}, "
                         f"{out.shape[0]}")
    launch(_box_kernel, 1, 64, stream, tensor_map(array, rows, cols, box_rows, stream), np.int32(k0), np.int32(row0),
           np.int32(box_rows), out)
