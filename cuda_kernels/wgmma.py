"""Hopper's warpgroup tensor-core primitive: ``wgmma.mma_async`` m64nNk16 (bf16 in, fp32 accumulators), with
both operands read by the tensor cores straight from shared memory.

    D (64 x N, f32) += A (64 x 16, bf16) @ B (16 x N, bf16)            (one instruction, a warpgroup)

A warpgroup is four consecutive warps (128 threads, the first warp a multiple of 4). Where mma.sync
(cuda_kernels/mma.py) takes its operands from each lane's registers, so that every warp first loads its
fragments (ldmatrix) and issues 16 x 8 products, wgmma names two shared-memory tiles by 64-bit *matrix
descriptors* and does a 64 x N x 16 product for the four warps at once: no fragment loads, and instructions
four to sixteen times as large, which is what lets an H100 or H200 go past mma.sync's ceiling
(docs/performance.md, "wgmma").

Operand layout in shared memory (this module's one layout, "K-major, 128-byte swizzle"). A tile is R rows
(64 for A; N for B, i.e. W's rows, nn.Linear layout) of 64 bf16 along k = 128 bytes a row, rows one after
another, the tile starting on a 1,024-byte boundary. Row r's 16-byte chunk c (k = 8c .. 8c + 7) is stored at
chunk position c ^ (r % 8) of the row:

    element (r, k) of a tile at element offset base  ->  base + 64 r + 8 ((k // 8) ^ (r % 8)) + k % 8

The swizzle spreads the 8 rows of each 1,024-byte group over all 32 banks, so the tensor cores read without
conflicts; a thread that writes a 16-byte chunk (cp.async) computes its position with ``swizzled``, and a
kernel places its tiles from ``aligned_start(sh)``, the first 1,024-byte boundary of its shared memory.
The descriptor of a k16 slice: start address >> 4 (bits 0-13), leading byte offset 1 (unused with this
swizzle, bits 16-29), stride byte offset 1,024 >> 4 = 64 (8 rows to the next 8; bits 32-45), swizzle mode 1
= 128 bytes (bits 62-63). The slice k = 16 s .. 16 s + 15 starts 32 s bytes into the tile: the hardware
applies the swizzle to the address it forms, which is why the tile must sit on a 1,024-byte boundary.

Accumulators (PTX ISA, "wgmma 64N16 D"): warp w of the warpgroup, lane (g, t) = (lane // 4, lane % 4),
holds N / 2 floats, for n8 tile j = 0 .. N / 8 - 1:

    acc[4j]     = D[16w + g,     8j + 2t]     acc[4j + 1] = D[16w + g,     8j + 2t + 1]
    acc[4j + 2] = D[16w + g + 8, 8j + 2t]     acc[4j + 3] = D[16w + g + 8, 8j + 2t + 1]

i.e. mma.sync's m16n8 layout, one 16-row band per warp, repeated across the n8 tiles.

``wgmma_k64(n)`` gives the device function ``mma(sh, a, b, acc)``: acc (a local float32 array of N / 2)
+= the product of the A tile at element offset a of sh (uint16, shared) and the B tile at b, over their 64 k
(four wgmma k16 steps). It is synchronous: fence, the four instructions, commit and wait in one asm block,
so the compiler never sees the accumulators while the tensor cores own them. ``wgmma_k64(n, wait=False)``
leaves out the wait: the products run on while the warps go on (to the next slab's barrier and copies), and
``wgmma_wait(p)()`` returns once at most p of the warpgroup's groups are in flight; until then neither the
accumulators nor the two tiles may be touched (ptxas checks the registers: where the code between would read
them, it serialises the instructions and says so). Before it, every thread that wrote the tiles calls
``fence_async_shared()`` (writes by ordinary stores and cp.async are not ordered with the tensor cores'
reads without it), then the block synchronises.

Two implementations, chosen at import time:
- GPU (compute capability 9.0, code for sm_90a, which numba-cuda targets on such a device): ``@intrinsic``
  functions emitting the PTX as inline assembly; the accumulators go in and out as tied registers.
- Numba's CUDA simulator: an emulation with the same per-thread semantics, reading the swizzled tiles with
  the formula above (products exact in fp32, summed in k order).
``wgmma_tile`` launches one warpgroup on one tile: the tests check the primitive, and the layout, with it.
``device_has_wgmma()`` says whether the current GPU has the instruction (compute capability 9.0 exactly).
Rules for callers: all 128 threads of a warpgroup call ``mma`` together with the same a and b (the
warpgroup's), the same number of times.
"""

from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.async_copy import shared_address
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import WARP, bf16_to_f32

WARPGROUP = 4 * WARP   # threads of one wgmma
TILE_K = 64            # bf16 of a swizzled row (128 bytes): the k of one wgmma_k64 call
TILE_ALIGN = 1024      # bytes: a tile's start (the swizzle repeats every 8 rows of 128 bytes)
_SWIZZLE_ROWS = 8
_DESC_FIXED = (1 << 16) | ((TILE_ALIGN // 16) << 32) | (1 << 62)   # LBO 1, SBO 1,024 bytes, 128-byte swizzle


def _swizzled(r, c):
    return TILE_K * r + 8 * (c ^ (r % _SWIZZLE_ROWS))


# Element offset, within a tile, of row r's 16-byte chunk c (k = 8c .. 8c + 7): on the device, and on the host
swizzled = cuda.jit(device=True, inline=True)(_swizzled)


def swizzle_tile(tile: np.ndarray) -> np.ndarray:
    """(R, 64) uint16 -> its (R * 64,) shared-memory image (host side, for the tests)."""
    rows = tile.shape[0]
    image = np.zeros(rows * TILE_K, np.uint16)
    for r in range(rows):
        for c in range(TILE_K // 8):
            at = _swizzled(r, c)
            image[at:at + 8] = tile[r, 8 * c:8 * c + 8]
    return image


@cuda.jit(device=True, inline=True)
def aligned_start(sh):
    """The element offset in sh (a uint16 shared array) of its first 1,024-byte boundary, where tiles start."""
    return ((TILE_ALIGN - shared_address(sh) % TILE_ALIGN) % TILE_ALIGN) // 2


@lru_cache(maxsize=None)
def device_has_wgmma() -> bool:
    """Whether the current GPU runs wgmma: compute capability 9.0 exactly (the instruction is sm_90a's; later
    architectures do not have it)."""
    return tuple(cuda.get_current_device().compute_capability) == (9, 0)


def _check_n(n: int) -> None:
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: N must be a multiple of 8 in 8 .. 256, got {n}")


if SIMULATOR:
    @cuda.jit(device=True)
    def fence_async_shared():
        """No-op in the simulator (the emulation reads shared memory directly)."""

    @lru_cache(maxsize=None)
    def wgmma_wait(pending: int):
        @cuda.jit(device=True)
        def wait():
            """No-op in the simulator: its products are done when issued."""

        return wait

    @lru_cache(maxsize=None)
    def wgmma_k64(n: int, wait: bool = True):
        _check_n(n)

        @cuda.jit(device=True)
        def mma(sh, a, b, acc):
            """acc += A (64 x 64 at a) @ B (n x 64 at b)^T for this thread's accumulators (module docstring)."""
            lane = cuda.threadIdx.x % WARP
            row = 16 * ((cuda.threadIdx.x % WARPGROUP) // WARP) + lane // 4
            col = 2 * (lane % 4)
            for j in range(n // 8):
                for q in range(4):
                    r, c = row + 8 * (q // 2), 8 * j + col + q % 2
                    s = float32(0)
                    for k in range(TILE_K):
                        ka, kb = a + swizzled(r, k // 8) + k % 8, b + swizzled(c, k // 8) + k % 8
                        s += bf16_to_f32(sh[ka]) * bf16_to_f32(sh[kb])
                    acc[4 * j + q] += s

        return mma

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from cuda_kernels.async_copy import ptx_statement, volatile_asm

    _F32, _I64 = ir.FloatType(), ir.IntType(64)

    # order this thread's earlier shared-memory writes before later reads by the tensor cores (the async proxy)
    fence_async_shared = ptx_statement("fence.proxy.async.shared::cta;")

    def wgmma_wait(pending: int):
        """A device function that waits until at most `pending` of this warpgroup's wgmma groups are in flight."""
        return ptx_statement(f"wgmma.wait_group.sync.aligned {pending};")

    def _k64_asm(n: int, wait: bool):
        """The inline assembly of four chained m64nNk16 steps: $0 .. $R-1 the accumulators (outputs, and the
        inputs $R .. $2R-1 tied to them), $2R and $2R+1 the descriptors of the k = 0 slices; each step moves
        both 32 bytes on (+2 in units of 16)."""
        regs = n // 2
        d = "{" + ", ".join(f"${i}" for i in range(regs)) + "}"
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {d}, da, db, p, 1, 1, 0, 0;"
        step = "add.s64 da, da, 2;\nadd.s64 db, db, 2;\n"
        return ("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, 1, 0;\n"
                f"mov.b64 da, ${2 * regs};\nmov.b64 db, ${2 * regs + 1};\n"
                "wgmma.fence.sync.aligned;\n" + (op + "\n" + step) * 3 + op + "\n"
                "wgmma.commit_group.sync.aligned;\n" + ("wgmma.wait_group.sync.aligned 0;\n" if wait else "") + "}")

    @lru_cache(maxsize=None)
    def _k64_intrinsic(n: int, wait: bool):
        regs = n // 2

        @intrinsic
        def k64_asm(typingctx, da, db, acc):
            def codegen(context, builder, signature, args):
                data = context.make_array(signature.args[2])(context, builder, args[2]).data
                slots = [builder.gep(data, [ir.Constant(_I64, i)]) for i in range(regs)]
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * regs + [_I64, _I64])
                constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["l", "l"])
                out = builder.call(volatile_asm(fnty, _k64_asm(n, wait), constraints),
                                   [builder.load(s) for s in slots] + [args[0], args[1]])
                for i, s in enumerate(slots):
                    builder.store(builder.extract_value(out, i), s)
                return context.get_dummy_value()

            return types.void(types.uint64, types.uint64, acc), codegen

        return k64_asm

    @cuda.jit(device=True, inline=True)
    def _descriptor(address):
        return uint64(_DESC_FIXED) | uint64((address & uint32(0x3FFFF)) >> uint32(4))

    @lru_cache(maxsize=None)
    def wgmma_k64(n: int, wait: bool = True):
        _check_n(n)
        asm = _k64_intrinsic(n, wait)

        @cuda.jit(device=True, inline=True)
        def mma(sh, a, b, acc):
            """acc += A (64 x 64 at a) @ B (n x 64 at b)^T for this thread's accumulators (module docstring)."""
            base = shared_address(sh)
            asm(_descriptor(base + uint32(2 * a)), _descriptor(base + uint32(2 * b)), acc)

        return mma


# ---------------------------------------------------------------------------------------------------------
# kernels: the primitive alone, for the tests
# ---------------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _tile_kernel(n: int):
    mma = wgmma_k64(n)
    regs = n // 2
    a_elems, b_elems = 64 * TILE_K, n * TILE_K

    @cuda.jit
    def wgmma_tile_kernel(a_image, b_image, slices, d):
        """One warpgroup: d (64, n) f32 = sum over k slabs s < slices of A_s @ B_s^T, the slabs' swizzled
        images given one after another in a_image, b_image (uint16)."""
        sh = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        skip = aligned_start(sh)
        acc = cuda.local.array(regs, float32)
        for i in range(regs):
            acc[i] = float32(0)
        for s in range(slices):
            for i in range(tid, a_elems, WARPGROUP):
                sh[skip + i] = a_image[s * a_elems + i]
            for i in range(tid, b_elems, WARPGROUP):
                sh[skip + a_elems + i] = b_image[s * b_elems + i]
            fence_async_shared()
            cuda.syncthreads()
            mma(sh, skip, skip + a_elems, acc)
            cuda.syncthreads()   # every warp is done with the tiles before the next slab overwrites them
        lane = tid % WARP
        row, col = 16 * (tid // WARP) + lane // 4, 2 * (lane % 4)
        for j in range(n // 8):
            for q in range(4):
                d[row + 8 * (q // 2), 8 * j + col + q % 2] = acc[4 * j + q]

    wgmma_tile_kernel.shared = 2 * (a_elems + b_elems) + TILE_ALIGN   # and room to align the tiles
    return wgmma_tile_kernel


def wgmma_tile(a, b, d, stream=0):
    """d (64, N) float32 <- a (64, K) @ b (N, K)^T on one warpgroup, K a multiple of 64; a, b uint16 bf16 host
    arrays (swizzled here), d a device array."""
    from cuda_kernels.launch import launch

    (m, k), n = a.shape, b.shape[0]
    if m != 64 or b.shape[1] != k or k % TILE_K or tuple(d.shape) != (64, n):
        raise ValueError(f"wgmma_tile: a (64, K), b (N, K), K % 64 == 0, d (64, N); got a {a.shape}, b {b.shape}, "
                         f"d {tuple(d.shape)}")
    slices = k // TILE_K
    a_image = np.concatenate([swizzle_tile(a[:, s * TILE_K:(s + 1) * TILE_K]) for s in range(slices)])
    b_image = np.concatenate([swizzle_tile(b[:, s * TILE_K:(s + 1) * TILE_K]) for s in range(slices)])
    kernel = _tile_kernel(n)
    launch(kernel, 1, WARPGROUP, stream, cuda.to_device(a_image, stream=stream),
           cuda.to_device(b_image, stream=stream), np.int64(slices), d, shared=kernel.shared)
