"""The KV cache's storage formats on the GPU: one place that says how K and V are stored and read back, so
that every kernel that writes or reads the cache takes the format as a compile-time choice of its factory
instead of a copy of itself per format. reference/kv_format.py is the NumPy twin.

    format   cache dtype   elements per 64-bit word   stored element
    "bf16"   uint16        4                          bf16 bits of x, rounded to nearest even
    "fp32"   float32       2                          x
    "fp8"    uint8         8                          e4m3 bits of x / scale, nearest even, saturated to +-448

The format of a cache is its dtype (`format_of`). Per format, `codec(fmt)` gives three device functions:
    encode(x, scale) -> the stored element (the write kernels: rope.py, the QKV gemv's epilogue)
    decode(element)  -> float32 (element-wise readers: the first attention versions)
    unpack(word)     -> the E float32 values of a uint64 word of the cache (element 0 in the low bits), the
                        readers that load 64 bits at a time (the fast decode kernel, flash prefill)
Reads are unscaled: fp8's per-tensor scales are folded in by the attention launchers (the score scale is
multiplied by k_scale, the output by v_scale: sum_j p_j (v_scale v_j) = v_scale sum_j p_j v_j), so a read
costs no multiply per element. bf16 and fp32 are unscaled; their launchers refuse a scale other than 1.

e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity; S.1111.111 is NaN), by arithmetic on
the float32 bits, which runs the same on the GPU and in the simulator:
    encode  |x| >= 2^-6: round the float32 at mantissa bit 20 (nearest even, a carry may bump the exponent),
            then code = (bits >> 20) - (120 << 3) (exponent re-biased 127 -> 7), saturated to 0x7E (448);
            |x| < 2^-6: code = the integer nearest |x| 2^9 (ties to even: |x| 2^9 + 2^23 in float32 rounds
            there, and its low mantissa bits are the integer); NaN -> 0x7F; the sign bit on top.
    decode  the 7 magnitude bits placed at float32 bits 20..26 make a float32 whose exponent is biased
            by 127 instead of 7, so times 2^120 it is the e4m3 value, subnormals included (they become
            float32 subnormals, exact, then normal); 0x7F -> NaN.

The decode is a ladder of two versions of one helper, e4m3x2_to_f32x2 (two codes in 16 bits, element 0 in the
low byte, -> two float32), on which every reader's decoder is built (e4m3_to_f32, e4m3x4_to_f32x4,
unpack_e4m3x8, e4m3x4_to_bf16x4); the version is chosen at import time, as mma.py chooses its mma:
    1. e4m3x2_to_f32x2_arith: the bit arithmetic above, about six instructions per element (masks, shifts,
       or, multiply, compare, select). The definition: the simulator's (where @intrinsic raises), equal to
       reference/kv_format.e4m3_to_f32 for every code, and the GPU's below compute capability 8.9.
    2. e4m3x2_to_f32x2_cvt (GPU): the hardware conversion, inline PTX through an @intrinsic:
       `cvt.rn.f16x2.e4m3x2` (two e4m3 -> two f16, exact) then `cvt.f32.f16` per element (exact). Equal to
       version 1 bit for bit, but for a NaN code's NaN bits (both NaN). The instruction exists from sm_89 on: a kernel
       compiled for an older device gets version 1, decided when it compiles, for the compute capability
       it is compiled for (as pdl.py decides griddepcontrol).
The encode stays the bit arithmetic: the hardware's (`cvt.rn.satfinite.e4m3x2.f32`) would have to be shown
to keep a NaN's sign as the reference does, and a write happens once per token, off the readers' path.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint8, uint16, uint32, uint64

from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import bf16_to_f32, f32_bits, f32_from_bits, f32_to_bf16

FORMATS = ("bf16", "fp32", "fp8")
DTYPES = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32), "fp8": np.dtype(np.uint8)}
WORD_ELEMS = {"bf16": 4, "fp32": 2, "fp8": 8}   # elements per uint64 word

F32_NAN = float32(np.nan)
E4M3_MIN_NORMAL = float32(2.0 ** -6)
E4M3_REBIAS = float32(2.0 ** 120)
_ROUNDER = float32(2.0 ** 23)   # x + 2^23 (0 <= x < 2^22) rounds x to an integer, nearest even
_ROUNDER_BITS = uint32(0x4B000000)
E4M3_CVT_MIN_CC = (8, 9)   # cvt.rn.f16x2.e4m3x2 (the hardware decode): PTX ISA 7.8, sm_89


def format_of(cache) -> str:
    """The format of a (device or host) cache array, from its dtype; ValueError for another dtype."""
    dtype = np.dtype(cache.dtype)
    for name, d in DTYPES.items():
        if dtype == d:
            return name
    raise ValueError(f"a KV cache is uint16 (bf16), float32 (fp32) or uint8 (fp8), got {dtype}")


def check_scales(fmt: str, k_scale, v_scale) -> tuple:
    """(k_scale, v_scale) as float32 after checks: positive finite for fp8, exactly 1 for the others."""
    k, v = float(k_scale), float(v_scale)
    if fmt == "fp8":
        if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
            raise ValueError(f"fp8 KV cache scales must be positive and finite, got k_scale={k}, v_scale={v}")
    elif (k, v) != (1.0, 1.0):
        raise ValueError(f"k_scale and v_scale are the fp8 cache's; a {fmt} cache takes 1.0, got {k}, {v}")
    return np.float32(k), np.float32(v)


def require_bf16(cache, who: str) -> None:
    """For the simple kernel versions that read bf16 caches only (the engine never runs them)."""
    if format_of(cache) != "bf16":
        raise ValueError(f"{who} reads bf16 caches only, got a {format_of(cache)} cache; the engine's kernels "
                         f"(paged_attention, prefill_attention) take every format")


# ---------------------------------------------------------------------------------------------------------
# e4m3 conversions


@cuda.jit(device=True)
def f32_to_e4m3(x):
    """float32 -> e4m3 bits (uint8): nearest even, saturated to +-448, NaN kept (see the module docstring)."""
    u = f32_bits(x)
    sign = (u >> uint32(24)) & uint32(0x80)
    a = u & uint32(0x7FFFFFFF)
    mag = f32_from_bits(a)
    rounded = uint32(a + uint32(0x7FFFF) + ((a >> uint32(20)) & uint32(1)))
    normal = min(int32(rounded >> uint32(20)) - int32(960), int32(0x7E))
    # (the min: no overflow for the large values that take the other arm)
    sub = int32(f32_bits(min(mag, E4M3_MIN_NORMAL) * float32(512) + _ROUNDER) - _ROUNDER_BITS)
    code = int32(0x7F) if x != x else (sub if mag < E4M3_MIN_NORMAL else normal)
    return uint8(uint32(code) | sign)


# Decode, version 1: bit arithmetic. The definition: the simulator's and the reference twin's, and the GPU's
# below compute capability 8.9.


@cuda.jit(device=True)
def e4m3_to_f32_arith(bits):
    """e4m3 bits -> float32, exactly (NaN for S.1111.111), by arithmetic on the float32 bits."""
    b = uint32(bits)
    value = f32_from_bits(((b & uint32(0x80)) << uint32(24)) | ((b & uint32(0x7F)) << uint32(20))) * E4M3_REBIAS
    return F32_NAN if (b & uint32(0x7F)) == uint32(0x7F) else value


@cuda.jit(device=True)
def e4m3x2_to_f32x2_arith(pair):
    """Two e4m3 in 16 bits (element 0 in the low byte) -> two float32, by bit arithmetic."""
    p = uint32(pair)
    return e4m3_to_f32_arith(p & uint32(0xFF)), e4m3_to_f32_arith((p >> uint32(8)) & uint32(0xFF))


# Decode, version 2: the hardware conversion (sm_89 and later: Ada, Hopper). One instruction turns two e4m3
# into two f16 (exact: e4m3's values are f16 values, its smallest subnormal 2^-9 an f16 normal), and two more
# widen them to float32 (exact). Version 1's arithmetic per element left the fp8 decode attention slower than
# bf16's although it reads half the bytes (BENCHMARKS.md, measured before this version existed).

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.core import targetconfig
    from numba.cuda.extending import intrinsic

    # PTX: the low byte of the 16-bit input becomes the low f16 of the pair (element 0), as in memory.
    # A NaN code (S.1111.111) becomes an f16 NaN, then a float32 NaN.
    _CVT_E4M3X2 = ("{\n"
                   ".reg .b32 f16x2;\n"
                   ".reg .b16 f16lo, f16hi;\n"
                   "cvt.rn.f16x2.e4m3x2 f16x2, $2;\n"
                   "mov.b32 {f16lo, f16hi}, f16x2;\n"
                   "cvt.f32.f16 $0, f16lo;\n"
                   "cvt.f32.f16 $1, f16hi;\n"
                   "}")

    def _target_has_cvt() -> bool:
        """Whether the kernel being compiled targets sm_89 or later (numba's own lowering asks the same
        way: the compute capability in the compile's flags; None, unknown, takes the arithmetic)."""
        flags = targetconfig.ConfigStack().top_or_none()
        cc = getattr(flags, "compute_capability", None)
        return cc is not None and tuple(cc) >= E4M3_CVT_MIN_CC

    @intrinsic
    def _e4m3x2_cvt(typingctx, pair):
        sig = types.UniTuple(types.float32, 2)(types.uint16)

        def codegen(context, builder, signature, args):
            # NOTE: decided when the kernel compiles, for the compute capability it is compiled for: the
            # instruction does not exist before sm_89, where the bit arithmetic is compiled instead.
            if not _target_has_cvt():
                return context.compile_internal(builder, e4m3x2_to_f32x2_arith.py_func, signature, args)
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(16)])
            out = builder.call(ir.InlineAsm(fnty, _CVT_E4M3X2, "=f,=f,h"), list(args))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(out, 0), builder.extract_value(out, 1)])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def e4m3x2_to_f32x2_cvt(pair):
        """Two e4m3 in 16 bits (element 0 in the low byte) -> two float32, by the hardware conversion (the
        bit arithmetic on a GPU older than sm_89)."""
        return _e4m3x2_cvt(uint16(pair))

    e4m3x2_to_f32x2 = e4m3x2_to_f32x2_cvt
else:
    e4m3x2_to_f32x2 = e4m3x2_to_f32x2_arith


# The decoders the readers use (codec's decode and unpack, the tensor-core prefill's bf16 quads), over the
# chosen pair conversion.


@cuda.jit(device=True)
def e4m3_to_f32(bits):
    """e4m3 bits -> float32, exactly (NaN for S.1111.111)."""
    return e4m3x2_to_f32x2(uint32(bits) & uint32(0xFF))[0]


@cuda.jit(device=True)
def e4m3x4_to_f32x4(word):
    """Four e4m3 in a uint32 (element 0 low) -> four float32, exactly."""
    w = uint32(word)
    f0, f1 = e4m3x2_to_f32x2(w & uint32(0xFFFF))
    f2, f3 = e4m3x2_to_f32x2(w >> uint32(16))
    return f0, f1, f2, f3


@cuda.jit(device=True)
def e4m3x4_to_bf16x4(word):
    """Four e4m3 in a uint32 (element 0 low) -> the same four values as bf16 bits in a uint64 (element 0 low):
    exact, e4m3 values being bf16 values (3 mantissa bits, exponents within bf16's). For mma operands."""
    f0, f1, f2, f3 = e4m3x4_to_f32x4(word)
    return (uint64(f32_bits(f0) >> uint32(16)) | (uint64(f32_bits(f1) >> uint32(16)) << uint64(16))
            | (uint64(f32_bits(f2) >> uint32(16)) << uint64(32)) | (uint64(f32_bits(f3) >> uint32(16)) << uint64(48)))


# ---------------------------------------------------------------------------------------------------------
# word unpacking: a uint64 of the cache -> its E float32 values


@cuda.jit(device=True)
def unpack_bf16x4_device(word):
    """Four bf16 packed in a uint64 (element 0 in the low bits) -> four float32 (the GPU's unpacking)."""
    lo = uint32(word & uint64(0xFFFFFFFF))
    hi = uint32(word >> uint64(32))
    # bf16_to_f32 shifts its argument left by 16 in 32 bits, which drops the upper element by itself.
    return bf16_to_f32(lo), bf16_to_f32(lo >> uint32(16)), bf16_to_f32(hi), bf16_to_f32(hi >> uint32(16))


@cuda.jit(device=True)
def unpack_f32x2_device(word):
    """Two float32 in a uint64 (element 0 low) -> the two values."""
    return f32_from_bits(uint32(word & uint64(0xFFFFFFFF))), f32_from_bits(uint32(word >> uint64(32)))


@cuda.jit(device=True)
def unpack_e4m3x8_device(word):
    """Eight e4m3 in a uint64 (element 0 low) -> eight float32, unscaled."""
    f0, f1, f2, f3 = e4m3x4_to_f32x4(uint32(word & uint64(0xFFFFFFFF)))
    f4, f5, f6, f7 = e4m3x4_to_f32x4(uint32(word >> uint64(32)))
    return f0, f1, f2, f3, f4, f5, f6, f7


if SIMULATOR:
    # The simulator's unpacking: plain NumPy, vectorised over the word. A simulated device-function call costs
    # far more than the work here, and this sits in the innermost loops (the device versions are tested on
    # their own).
    _HALVES = np.array([0, 16, 32, 48], np.uint64)
    _codes = np.arange(256)
    _e, _m = (_codes >> 3) & 15, _codes & 7
    _mag = np.where(_e == 0, _m * 2.0 ** -9, (8 + _m) * 2.0 ** (_e - 10))
    _mag[(_codes & 0x7F) == 0x7F] = np.nan
    _E4M3_VALUES = np.where(_codes & 0x80, -_mag, _mag).astype(np.float32)

    def unpack_bf16x4(word):
        bits = ((np.uint64(word) >> _HALVES) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
        f = bits.view(np.float32)
        return f[0], f[1], f[2], f[3]

    def unpack_f32x2(word):
        f = np.array([word], np.uint64).view(np.float32)
        return f[0], f[1]

    def unpack_e4m3x8(word):
        return tuple(_E4M3_VALUES[np.array([word], np.uint64).view(np.uint8)])
else:
    unpack_bf16x4, unpack_f32x2, unpack_e4m3x8 = unpack_bf16x4_device, unpack_f32x2_device, unpack_e4m3x8_device


@cuda.jit(device=True)
def _encode_bf16(x, scale):
    return f32_to_bf16(x)


@cuda.jit(device=True)
def _encode_fp32(x, scale):
    return float32(x)


@cuda.jit(device=True)
def _encode_fp8(x, scale):
    return f32_to_e4m3(float32(x) / scale)


@cuda.jit(device=True)
def _decode_fp32(value):
    return float32(value)


_CODECS = {
    "bf16": (_encode_bf16, bf16_to_f32, unpack_bf16x4),
    "fp32": (_encode_fp32, _decode_fp32, unpack_f32x2),
    "fp8": (_encode_fp8, e4m3_to_f32, unpack_e4m3x8),
}


@lru_cache(maxsize=None)
def codec(fmt: str):
    """(encode, decode, unpack) device functions of a format (see the module docstring)."""
    if fmt not in _CODECS:
        raise ValueError(f"kv_cache_dtype must be one of {FORMATS}, got {fmt!r}")
    return _CODECS[fmt]


# ---------------------------------------------------------------------------------------------------------
# kernels: the conversions over whole arrays (tests and tools; the engine converts inside its kernels)


@lru_cache(maxsize=None)
def _convert_kernels(fmt: str):
    encode, decode, _ = codec(fmt)

    @cuda.jit
    def encode_kernel(values, out, scale):
        # values (n,) f32 -> out (n,) in format fmt; grid-stride, one element per thread
        for i in range(cuda.grid(1), values.shape[0], cuda.gridsize(1)):
            out[i] = encode(values[i], scale)

    @cuda.jit
    def decode_kernel(stored, out, scale):
        # stored (n,) in format fmt -> out (n,) f32, times scale
        for i in range(cuda.grid(1), stored.shape[0], cuda.gridsize(1)):
            out[i] = decode(stored[i]) * scale

    return encode_kernel, decode_kernel


THREADS = 64 if SIMULATOR else 256


def _grid(n: int) -> int:
    return max(1, min(-(-n // THREADS), 1024))


def kv_encode(values, out, scale=1.0, stream=0):
    """out (n,) <- values (n,) float32 stored in out's format (its dtype), fp8 divided by scale first. Twin:
    reference.kv_format.kv_encode."""
    fmt = format_of(out)
    if values.ndim != 1 or np.dtype(values.dtype) != np.float32 or out.shape != values.shape:
        raise ValueError(f"kv_encode: expected values (n,) float32 and out of the same shape, got "
                         f"{tuple(values.shape)} {values.dtype} and {tuple(out.shape)}")
    scale = check_scales(fmt, scale, 1.0)[0]
    _convert_kernels(fmt)[0][_grid(values.shape[0]), THREADS, stream](values, out, scale)


def kv_decode(stored, out, scale=1.0, stream=0):
    """out (n,) float32 <- the values of stored (n,) (format from its dtype), times scale. Twin:
    reference.kv_format.kv_decode."""
    fmt = format_of(stored)
    if stored.ndim != 1 or np.dtype(out.dtype) != np.float32 or out.shape != stored.shape:
        raise ValueError(f"kv_decode: expected stored (n,) and out of the same shape float32, got "
                         f"{tuple(stored.shape)} and {tuple(out.shape)} {out.dtype}")
    scale = check_scales(fmt, scale, 1.0)[0]
    _convert_kernels(fmt)[1][_grid(stored.shape[0]), THREADS, stream](stored, out, scale)
