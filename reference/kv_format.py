"""The KV cache's storage formats (EngineOptions.kv_cache_dtype), as NumPy: what a write stores, what a read
gives back. cuda_kernels/kv_format.py is the GPU twin (the same functions as device functions).

    format   cache dtype   stored element                          read back
    "bf16"   uint16        bf16 bits of x, rounded to nearest even  exactly the bf16 value (reference/bf16.py)
    "fp32"   float32       x itself                                 x
    "fp8"    uint8         e4m3 bits of x / scale (see below)       e4m3 value * scale

fp8 is vLLM's fp8_e4m3 KV cache: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, one
NaN per sign (S.1111.111). Normal values (1 + m/8) 2^(e-7) for e = 1..15 (the largest 1.75 * 2^8 = 448),
subnormals m 2^-9. A write divides by the tensor's scale, rounds to the nearest e4m3 value (ties to even
mantissa), saturates to +-448 (vLLM's satfinite: an infinity too) and keeps a NaN a NaN (0x7F, sign kept).

Scale scheme: per tensor, one scale for K and one for V (k_scale, v_scale, float32), as vLLM's
`kv_cache_dtype="fp8"` with checkpoint scales; the engine uses 1.0 for both (vLLM's value when a checkpoint
carries none), the kernels and this reference take any positive scale. The bf16 and fp32 formats are not
scaled (scale 1; kernel launchers refuse another).

Unused cache slots are filled with the format's NaN, so a kernel that reads one produces NaN and fails.
"""

from __future__ import annotations

import numpy as np

from reference.bf16 import bf16_to_f32, f32_to_bf16

FORMATS = ("bf16", "fp32", "fp8")
DTYPES = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32), "fp8": np.dtype(np.uint8)}
NANS = {"bf16": np.uint16(0x7FC0), "fp32": np.float32(np.nan), "fp8": np.uint8(0x7F)}
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6


def format_of(cache: np.ndarray) -> str:
    """The format of a cache array, from its dtype (uint16: bf16, float32: fp32, uint8: fp8)."""
    for name, dtype in DTYPES.items():
        if np.dtype(cache.dtype) == dtype:
            return name
    raise ValueError(f"a KV cache is uint16 (bf16), float32 (fp32) or uint8 (fp8), got {cache.dtype}")


def check_format(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {FORMATS}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def f32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 values -> e4m3 bit patterns (uint8): nearest, ties to even, saturated to +-448, NaN kept.

    Normal results round the float32 at mantissa bit 20 (as f32_to_bf16 does at bit 16) and re-bias the
    exponent (127 -> 7); below 2^-6 the result is the integer nearest to |x| * 2^9 (subnormal mantissa m;
    m = 8 is the smallest normal, 0x08, which the same bits spell)."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    u = x.view(np.uint32)
    sign = ((u >> np.uint32(24)) & np.uint32(0x80)).astype(np.int64)
    a = u & np.uint32(0x7FFFFFFF)
    rounded = a.astype(np.int64) + 0x7FFFF + ((a >> np.uint32(20)) & np.uint32(1))
    normal = (rounded >> 20) - (120 << 3)                  # (exponent - 120) << 3 | top three mantissa bits
    magnitude = np.abs(x)
    with np.errstate(invalid="ignore"):
        sub = np.rint(magnitude.astype(np.float64) * 512.0)    # exact: |x| < 2^-6 has few bits
        code = np.where(magnitude < np.float32(E4M3_MIN_NORMAL), sub, normal)
    code = np.minimum(code, 0x7E).astype(np.int64)
    code[np.isnan(x)] = 0x7F
    return (code | sign).astype(np.uint8)


_E4M3_VALUES = None


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """e4m3 bit patterns (uint8) -> their float32 values, exactly (NaN for 0x7F and 0xFF)."""
    global _E4M3_VALUES
    if _E4M3_VALUES is None:
        codes = np.arange(256)
        e, m = (codes >> 3) & 15, codes & 7
        mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))
        mag[(codes & 0x7F) == 0x7F] = np.nan
        _E4M3_VALUES = np.where(codes & 0x80, -mag, mag).astype(np.float32)
    return _E4M3_VALUES[np.asarray(bits, dtype=np.uint8)]


def kv_encode(values: np.ndarray, fmt: str, scale: float = 1.0) -> np.ndarray:
    """float32 K or V values -> the elements the cache of format fmt stores."""
    values = np.asarray(values, np.float32)
    if fmt == "bf16":
        return f32_to_bf16(values)
    if fmt == "fp32":
        return values.copy()
    with np.errstate(over="ignore"):   # beyond float32: an infinity, which saturates
        return f32_to_e4m3(values / np.float32(scale))


def kv_decode(stored: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Cache elements (the format from their dtype) -> float32 values."""
    fmt = format_of(stored)
    if fmt == "bf16":
        return bf16_to_f32(stored)
    if fmt == "fp32":
        return np.asarray(stored, np.float32)
    return e4m3_to_f32(stored) * np.float32(scale)


def round_kv(values: np.ndarray, fmt: str, scale: float = 1.0) -> np.ndarray:
    """float32 -> stored -> read back: the value attention sees for x."""
    return kv_decode(kv_encode(values, fmt, scale), scale)
