"""Device helpers every kernel family uses: bf16 bit casts and warp/block reductions.

Each helper has two implementations chosen at import time, so one kernel source runs on both targets:

- on a GPU: bit casts through libdevice (`__int_as_float`, `__float_as_int`) and warp shuffles
  (`shfl_xor_sync`: after the 5 butterfly steps over offsets 16, 8, 4, 2, 1 every lane holds the result);
- in Numba's CUDA simulator (CI), which has neither: NumPy scalar views for the casts, and a shared-memory
  exchange for the warp reductions (each thread writes its value, the block synchronises, each thread reads
  its warp's 32 values).

Rules for callers (both implementations rely on them):
- every thread of the block calls a warp or block reduction, in the same order (no reduction inside a branch
  that only some threads take): shuffles need all 32 lanes, and the simulator's version synchronises the
  block; blocks are a whole number of warps;
- a block reduction needs a `cuda.shared.array(32, float32)` scratch buffer from the calling kernel.

`load_l2(array, i)` reads a global element past the SM's L1 (GPU: ld.global.cg; simulator: a plain read),
for data other blocks of the running grid wrote. `exp2_ftz(x)` is 2^x and `fmax(a, b)` the larger of two values,
each in one instruction (ex2.approx.ftz, fmaxf).

Index arithmetic (the kernels' NOTEs about unsigned indices point here): numba types integer arithmetic in
signed 64 bits, so every // and % takes a floor fix-up, every array index a negative-wraparound test and a
select, and a ``range(threadIdx.x, n, blockDim.x)`` a 64-bit division for its trip count and a signed counter.
Where an index is known to be small and non-negative (a row, a cache slot, a workspace offset: far below 2^32)
the kernels hold it in uint32, cast back after each operation (``uint32(a + b)``: numba widens uint32 + uint32
to 64 bits), and stride with ``while j < n: ...; j += step``. The instruction counts this saved:
docs/performance.md ("Fewer instructions per key tile", "More kernels of the decode step").

bf16 -> f32 is exact (the bits become the upper half of an fp32). f32 -> bf16 rounds to nearest, ties to
even, as reference/bf16.py does: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``, NaN kept a quiet NaN.
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from cuda_kernels.compat import SIMULATOR

WARP = 32
FULL_MASK = 0xFFFFFFFF
SM_COUNT = 132   # SMs of the H200 and the H100 SXM: the GPU the shape policies size their grids for

if SIMULATOR:
    # Simulated kernels are Python: NumPy scalar views give the bit casts.
    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        return (np.uint32(bits) << np.uint32(16)).view(np.float32)

    @cuda.jit(device=True)
    def f32_bits(x):
        return np.float32(x).view(np.uint32)

    @cuda.jit(device=True)
    def f32_from_bits(bits):
        return np.uint32(bits).view(np.float32)

    @cuda.jit(device=True)
    def _linear_tid():
        return cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)

    @cuda.jit(device=True)
    def _exchange(value):
        """Every thread's value, in a block-wide shared buffer; returns (buffer, my index, my warp's first)."""
        buf = cuda.shared.array(1024, float32)
        tid = _linear_tid()
        cuda.syncthreads()
        buf[tid] = value
        cuda.syncthreads()
        return buf, tid, tid - tid % WARP

    @cuda.jit(device=True)
    def warp_sum(value):
        buf, _, first = _exchange(value)
        total = float32(0)
        for lane in range(WARP):
            total += buf[first + lane]
        return total

    @cuda.jit(device=True)
    def warp_max(value):
        buf, _, first = _exchange(value)
        best = buf[first]
        for lane in range(1, WARP):
            best = max(best, buf[first + lane])
        return best

    @cuda.jit(device=True)
    def warp_broadcast(value, src_lane):
        buf, _, first = _exchange(value)
        return buf[first + src_lane]

    @cuda.jit(device=True)
    def load_l2(array, i):
        """array[i]: the simulator has one memory, no caches."""
        return array[i]

    @cuda.jit(device=True)
    def fmax(a, b):
        """The larger of two fp32 values (for non-NaN ones, what the GPU's fmaxf gives)."""
        return max(float32(a), float32(b))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(bits):
        return libdevice.int_as_float(int32(uint32(bits) << uint32(16)))

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        return uint32(libdevice.float_as_int(x))

    @cuda.jit(device=True, inline=True)
    def f32_from_bits(bits):
        return libdevice.int_as_float(int32(uint32(bits)))

    @cuda.jit(device=True, inline=True)
    def warp_sum(value):
        offset = 16
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        return value

    @cuda.jit(device=True, inline=True)
    def warp_max(value):
        offset = 16
        while offset > 0:
            value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
            offset //= 2
        return value

    @cuda.jit(device=True, inline=True)
    def warp_broadcast(value, src_lane):
        return cuda.shfl_sync(FULL_MASK, value, src_lane)

    @cuda.jit(device=True, inline=True)
    def load_l2(array, i):
        """array[i] read through L2 only (ld.global.cg): an SM's L1 is not coherent with other SMs' writes,
        so data that other blocks of the same grid wrote (after a threadfence) is read this way."""
        return cuda.ldcg(array, i)

    @cuda.jit(device=True, inline=True)
    def fmax(a, b):
        """The larger of two fp32 values, in one instruction (fmaxf; a NaN loses to a number). Python's max()
        compiles to a compare and a select, to keep its NaN rule."""
        return libdevice.fmaxf(float32(a), float32(b))


@cuda.jit(device=True)
def f32_to_bf16(x):
    """Round an fp32 value to the nearest bf16 (ties to even); returns the uint16 bit pattern. A NaN stays a
    quiet NaN (the rounding carry could turn it into infinity).
    NOTE: one expression whose two arms are a few 32-bit operations, so that it compiles to a select: Numba
    widens integer sums to 64 bits, and the earlier form (an early return for NaN, the sum shifted in 64
    bits) compiled to a branch and ten 64-bit instructions per value, which made the bf16-input gemv
    (it rounds every x it reads) 8% slower than the fp32 one in the batch-1 decode step. The uint32() of the
    sum lets LLVM drop the high half; the sum wraps only for negative NaNs, which take the other arm."""
    u = f32_bits(x)
    return uint16(((u >> uint32(16)) | uint32(0x40)) if x != x else
                  (uint32(u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16)))


@cuda.jit(device=True)
def round_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), as an fp32 value: what a bf16 store then load gives back.
    The matmuls' bf16-input mode (matmul_precision "bf16") rounds x with it, as reference/bf16.round_to_bf16."""
    return bf16_to_f32(f32_to_bf16(x))


if SIMULATOR:
    @cuda.jit(device=True)
    def round_bf16_pair(a, b):
        """(round_bf16(a), round_bf16(b)): the GPU version's results (@intrinsic raises in the simulator)."""
        return round_bf16(a), round_bf16(b)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _cvt_rn_bf16x2(typingctx, a, b):
        """PTX cvt.rn.bf16x2.f32: a and b rounded to nearest even bf16, packed (a in the high half)."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"), list(args))

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def round_bf16_pair(a, b):
        """(round_bf16(a), round_bf16(b)) for finite and infinite a, b; a NaN stays a NaN (its payload is the
        conversion's, not f32_to_bf16's). One hardware conversion (cvt.rn.bf16x2.f32: round to nearest even,
        subnormals kept) rounds both, where round_bf16 takes about nine integer instructions each: the
        bf16-input gemv rounds every x it reads with it."""
        packed = _cvt_rn_bf16x2(float32(a), float32(b))
        return bf16_to_f32(packed >> uint32(16)), bf16_to_f32(packed & uint32(0xFFFF))


if SIMULATOR:
    @cuda.jit(device=True)
    def exp2_ftz(x):
        """2^x in fp32, a result below 2^-126 flushed to 0 (the GPU version's, exactly rounded here)."""
        if x != x or x >= float32(128):
            return float32(x) if x != x else float32(np.inf)
        return float32(math.exp2(x)) if x >= float32(-126) else float32(0)
else:
    @intrinsic
    def _ex2_approx_ftz(typingctx, x):
        """PTX ex2.approx.ftz.f32: one MUFU.EX2 instruction."""
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), list(args))

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def exp2_ftz(x):
        """2^x in fp32 within 2 ulp, a result below 2^-126 flushed to 0 (-inf gives 0, NaN NaN): one hardware
        instruction, where math.exp2 adds a denormal check and two multiplies around it (its result keeps
        subnormals). For softmax weights p = 2^(x - max) next to the max's 1, a subnormal p is nothing."""
        return _ex2_approx_ftz(float32(x))


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum of `value` over the whole block, returned to every thread. scratch: shared float32[32]."""
    tid = cuda.threadIdx.x
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    partial = warp_sum(value)
    if tid % WARP == 0:
        scratch[tid // WARP] = partial
    cuda.syncthreads()
    lane = tid % WARP
    total = warp_sum(scratch[lane] if lane < nwarps else float32(0))
    cuda.syncthreads()  # scratch may be reused by the caller's next reduction
    return total


@cuda.jit(device=True)
def block_max(value, scratch):
    """Maximum of `value` over the whole block, returned to every thread. scratch: shared float32[32]."""
    tid = cuda.threadIdx.x
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    partial = warp_max(value)
    if tid % WARP == 0:
        scratch[tid // WARP] = partial
    cuda.syncthreads()
    lane = tid % WARP
    best = warp_max(scratch[lane] if lane < nwarps else float32(-np.inf))
    cuda.syncthreads()
    return best
