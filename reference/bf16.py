"""bfloat16 as the project stores it: 16-bit patterns in ``uint16`` arrays.

NumPy has no bfloat16 type, so weights and the KV cache are kept as the upper 16 bits of an IEEE float32.
Widening is exact: ``f32 = bits << 16``. Narrowing rounds to nearest, ties to even, on the 16 bits that are
dropped, which is what the GPU kernels do on a KV-cache write:

    rounded = (u32 + 0x7FFF + ((u32 >> 16) & 1)) >> 16

NaN is kept a (quiet) NaN instead of being rounded into infinity.
"""

import numpy as np


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32 values, exactly."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bf16 bit patterns (uint16), nearest even."""
    u32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding_bias = np.uint32(0x7FFF) + ((u32 >> np.uint32(16)) & np.uint32(1))
    rounded = ((u32 + rounding_bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if np.any(nan):
        # NOTE: keep the sign and force a quiet-NaN mantissa bit; adding the bias could carry into the sign.
        rounded[nan] = ((u32[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 -> float32: the value a bf16 store then load gives back."""
    return bf16_to_f32(f32_to_bf16(values))
