"""Warp-level tensor-core primitive: one ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``.

    D (16 x 8, f32) = A (16 x 16, bf16) @ B (16 x 8, bf16) + C (16 x 8, f32)

All 32 lanes of a warp call ``mma_bf16_m16n8k16`` together; each passes its own fragment registers and gets
its own four elements of D back. A register of A or B is a uint32 holding two bf16 bit patterns, the element
with the smaller index in the low 16 bits. With g = lane // 4 (the "group", 0..7) and t = lane % 4 (the
thread in the group, 0..3), lane (g, t) holds (PTX ISA, "Matrix Fragments for mma.m16n8k16"):

    A (row-major, 16 x 16)   a0 = A[g,     2t : 2t+2]      a1 = A[g + 8, 2t : 2t+2]
                             a2 = A[g,     2t+8 : 2t+10]   a3 = A[g + 8, 2t+8 : 2t+10]
    B (column-major, 16 x 8) b0 = B[2t : 2t+2,    g]       b1 = B[2t+8 : 2t+10, g]
    C, D (16 x 8, f32)       c0, c1 = C[g, 2t], C[g, 2t+1]  c2, c3 = C[g + 8, 2t], C[g + 8, 2t+1]

So a lane's A registers are two pairs of neighbouring k in rows g and g + 8, its B registers the same k pairs
of column g, and its accumulators columns 2t and 2t + 1 of rows g and g + 8. "col" for B means B[k, n] is
stored with k contiguous, which is exactly a row of a weight in nn.Linear layout (W[n, k] = B[k, n]).

Two implementations, chosen at import time (the same kernel source runs on both):
- GPU: a Numba ``@intrinsic`` emitting the instruction as inline PTX (llvmlite ``InlineAsm``). The C inputs
  are tied to the D outputs ("0".."3" constraints), so ptxas accumulates in place.
- Numba's CUDA simulator (CI), where ``@intrinsic`` raises: an emulation with the same per-lane semantics.
  Every lane writes its six A/B registers to a per-warp shared scratch, the block synchronises, every lane
  reassembles the warp's 16 x 16 A and 16 x 8 B and computes its own four D elements (products exact in
  fp32, summed in fp32, then added to C), and the block synchronises again before the scratch can be reused.

Fragment helpers for the kernels that feed it (gemm_tc.gemm_tc, attention_tc.prefill_attention_tc):
``split_bf16x3`` cuts an fp32 value into three bf16 pieces that sum to it exactly (so an fp32 operand costs
three exact mma products), ``pack4`` packs four bf16 into the uint64 "quad" both kernels stage in shared
memory, and ``halves`` splits a quad into the two uint32 registers of a fragment.

``mma_tile`` launches one warp on one tile with exactly this layout: the tests use it to check the primitive
on its own, and a reader can follow a fragment from the matrix to the lane and back.

Rules for callers: all 32 lanes of every warp of the block call it, the same number of times and in the same
order (the hardware instruction needs the whole warp; the emulation synchronises the block), and blocks are
at most 1024 threads. The tensor core's own addition order and internal rounding are unspecified (it is not
a chain of IEEE round-to-nearest adds), so D equals the exact sum only to within fp32 summation error; the
products of two bf16 values are exact in either implementation.
"""

import numpy as np
from numba import cuda, float32, uint32, uint64

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import WARP, bf16_to_f32, f32_bits

# ---------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------

if SIMULATOR:
    _MAX_WARPS = 32   # 1024 threads

    def _bf16_halves(regs):
        """uint32 registers of two bf16 each -> fp32 values, shape regs.shape + (2,) (low half first)."""
        halves = np.stack([regs & np.uint32(0xFFFF), regs >> np.uint32(16)], axis=-1).astype(np.uint32)
        return (halves << np.uint32(16)).view(np.float32)

    @cuda.jit(device=True)
    def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(d0, d1, d2, d3) for this lane: D = A @ B + C over the warp (see the module docstring)."""
        regs = cuda.shared.array((_MAX_WARPS, WARP, 6), uint32)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        warp, lane = tid // WARP, tid % WARP
        regs[warp, lane] = (a0, a1, a2, a3, b0, b1)
        cuda.syncthreads()
        # NOTE: the simulator runs device functions as Python, so the warp's fragments are reassembled with
        # NumPy (one lane alone would be ~100x slower as a scalar loop). Register r of A is (row block
        # r % 2, k block r // 2): lanes x registers -> [g, t, k block, row block, half] -> A[row, k].
        frag = regs[warp]
        a = _bf16_halves(frag[:, :4].reshape(8, 4, 2, 2)).transpose(3, 0, 2, 1, 4).reshape(16, 16)
        # B: lanes x registers 4, 5 -> [g = column, t, k block, half] -> B[k, column]
        b = _bf16_halves(frag[:, 4:].reshape(8, 4, 2)).transpose(2, 1, 3, 0).reshape(16, 8)
        g, t = lane // 4, lane % 4
        # fp32 products are exact (8 x 8 significant bits); the sums are fp32, in NumPy's order
        with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, silently, as on the GPU
            d = (a[[g, g + 8]] @ b[:, [2 * t, 2 * t + 1]]).ravel() + np.array([c0, c1, c2, c3], np.float32)
        cuda.syncthreads()  # every lane has read the scratch: the next call may overwrite it
        return float32(d[0]), float32(d[1]), float32(d[2]), float32(d[3])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    @intrinsic
    def _mma_asm(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, _PTX, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
            d = builder.call(asm, list(args))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(d, i) for i in range(4)])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(d0, d1, d2, d3) for this lane: D = A @ B + C over the warp (see the module docstring)."""
        return _mma_asm(uint32(a0), uint32(a1), uint32(a2), uint32(a3), uint32(b0), uint32(b1),
                        float32(c0), float32(c1), float32(c2), float32(c3))


# Fragment helpers shared by the tensor-core kernels (gemm_tc.gemm_tc, attention_tc.prefill_attention_tc)

@cuda.jit(device=True)
def split_bf16x3(v):
    """fp32 v -> (hi, mid, lo) bf16 bit patterns (uint32) with hi + mid + lo == v exactly (the bf16x3 split).

    Truncation: hi keeps v's top 16 bits (sign, exponent, 7 mantissa bits), so v - hi is exact (it is v's
    low 16 mantissa bits); mid truncates that remainder the same way, and what is left has at most 8
    significant bits, so lo = bf16(v - hi - mid) is exact. Every piece has v's sign and |piece| <= |v|.
    NOTE: exact for |v| >= about 2^-100; below, lo lies under the normal range (2^-126) and truncating it to
    its top 16 bits drops some of its 8, so the sum is within 2^-133 of v (nothing, beside a softmax's 1).
    """
    hi = f32_bits(v) >> uint32(16)
    # NOTE: an infinite v is all hi (inf - inf would be NaN and poison a finite product); NaN stays NaN
    rest = float32(0) if abs(v) == float32(np.inf) else v - bf16_to_f32(hi)
    mid = f32_bits(rest) >> uint32(16)
    lo = f32_bits(rest - bf16_to_f32(mid)) >> uint32(16)
    return hi, mid, lo


@cuda.jit(device=True)
def split_bf16x3_finite(v):
    """split_bf16x3 of a finite v (an infinite one would leave NaN pieces), without the infinity test: a
    compare and a select fewer per value, for values known finite (softmax weights in [0, 1])."""
    hi = f32_bits(v) >> uint32(16)
    rest = v - bf16_to_f32(hi)
    mid = f32_bits(rest) >> uint32(16)
    lo = f32_bits(rest - bf16_to_f32(mid)) >> uint32(16)
    return hi, mid, lo


@cuda.jit(device=True)
def pack4(b0, b1, b2, b3):
    """Four bf16 bit patterns -> one uint64, b0 in the low 16 bits (the memory order of 4 bf16)."""
    return (uint64(b0) | (uint64(b1) << uint64(16)) | (uint64(b2) << uint64(32)) | (uint64(b3) << uint64(48)))


@cuda.jit(device=True)
def halves(word):
    """A uint64 -> (low, high) uint32 words: two mma registers of two bf16 each."""
    return uint32(uint64(word) & uint64(0xFFFFFFFF)), uint32(uint64(word) >> uint64(32))


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _pair(lo, hi):
    """Two bf16 bit patterns -> one mma register (lo in the low half)."""
    return uint32(lo) | (uint32(hi) << uint32(16))


@cuda.jit
def _mma_tile_kernel(a, b, c, d):
    """a (16, 16) u16 bf16 A; b (8, 16) u16 bf16 with b[n, k] = B[k, n] (nn.Linear layout); c, d (16, 8) f32.
    One warp: lane (g, t) gathers exactly the fragment of the module docstring and scatters its D elements."""
    lane = cuda.threadIdx.x
    g = lane // 4
    t = lane % 4
    k = 2 * t
    d0, d1, d2, d3 = mma_bf16_m16n8k16(
        _pair(a[g, k], a[g, k + 1]), _pair(a[g + 8, k], a[g + 8, k + 1]),
        _pair(a[g, k + 8], a[g, k + 9]), _pair(a[g + 8, k + 8], a[g + 8, k + 9]),
        _pair(b[g, k], b[g, k + 1]), _pair(b[g, k + 8], b[g, k + 9]),
        c[g, k], c[g, k + 1], c[g + 8, k], c[g + 8, k + 1])
    d[g, k] = d0
    d[g, k + 1] = d1
    d[g + 8, k] = d2
    d[g + 8, k + 1] = d3


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------

def mma_tile(a, b, c, d, stream=0):
    """d = A @ B + c for one 16 x 8 x 16 tile on one warp: the primitive alone, to check its fragment layout.

    a (16, 16) uint16 bf16 bits of A; b (8, 16) uint16 bf16 bits of B transposed (b[n, k] = B[k, n], as a
    weight is stored); c, d (16, 8) float32; all device arrays.
    """
    for name, arr, shape, dtype in (("a", a, (16, 16), np.uint16), ("b", b, (8, 16), np.uint16),
                                    ("c", c, (16, 8), np.float32), ("d", d, (16, 8), np.float32)):
        if tuple(arr.shape) != shape or arr.dtype != dtype:
            raise ValueError(f"mma_tile: {name} must be {shape} {np.dtype(dtype)}, got {tuple(arr.shape)} "
                             f"{arr.dtype}")
    _mma_tile_kernel[1, WARP, stream](a, b, c, d)
