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
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint8, uint32, uint64

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


@cuda.jit(device=True)
def e4m3_to_f32(bits):
    """e4m3 bits -> float32, exactly (NaN for S.1111.111)."""
    b = uint32(bits)
    value = f32_from_bits(((b & uint32(0x80)) << uint32(24)) | ((b & uint32(0x7F)) << uint32(20))) * E4M3_REBIAS
    return F32_NAN if (b & uint32(0x7F)) == uint32(0x7F) else value


@cuda.jit(device=True)
def e4m3x4_to_bf16x4(word):
    """Four e4m3 in a uint32 (element 0 low) -> the same four values as bf16 bits in a uint64 (element 0 low):
    exact, e4m3 values being bf16 values (3 mantissa bits, exponents within bf16's). For mma operands."""
    w = uint32(word)
    b0 = uint64(f32_bits(e4m3_to_f32(w & uint32(0xFF))) >> uint32(16))
    b1 = uint64(f32_bits(e4m3_to_f32((w >> uint32(8)) & uint32(0xFF))) >> uint32(16))
    b2 = uint64(f32_bits(e4m3_to_f32((w >> uint32(16)) & uint32(0xFF))) >> uint32(16))
    b3 = uint64(f32_bits(e4m3_to_f32(w >> uint32(24))) >> uint32(16))
    return b0 | (b1 << uint64(16)) | (b2 << uint64(32)) | (b3 << uint64(48))


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
    lo = uint32(word & uint64(0xFFFFFFFF))
    hi = uint32(word >> uint64(32))
    m = uint32(0xFF)
    return (e4m3_to_f32(lo & m), e4m3_to_f32((lo >> uint32(8)) & m), e4m3_to_f32((lo >> uint32(16)) & m),
            e4m3_to_f32(lo >> uint32(24)), e4m3_to_f32(hi & m), e4m3_to_f32((hi >> uint32(8)) & m),
            e4m3_to_f32((hi >> uint32(16)) & m), e4m3_to_f32(hi >> uint32(24)))


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
