"""cuda_kernels/primitives.py's bf16 narrowing on its own: f32_to_bf16, round_bf16 and round_bf16_pair against
reference/bf16.py, bit for bit (round_bf16_pair: NaN only as NaN, its payload is the hardware's), on the corner
bit patterns (NaNs of either sign and any payload, infinities, subnormals, the largest finites that round up
to infinity, exact ties) as well as random ones; the fp32 bit casts f32_bits and f32_from_bits, which
must move every pattern unchanged; and the one-instruction exp2_ftz and fmax (with mma's split of finite values)
that the tensor-core prefill attention's softmax uses.

Every kernel that writes the KV cache or takes bf16 matmul inputs goes through these three helpers, so they
get a test of their own that walks the corners the kernel tests hit only by chance.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import device_empty, examples, pick, to_device
from numba import cuda

from cuda_kernels.mma import split_bf16x3, split_bf16x3_finite
from cuda_kernels.primitives import (exp2_ftz, f32_bits, f32_from_bits, f32_to_bf16, fmax, round_bf16,
                                    round_bf16_pair)
from reference.bf16 import f32_to_bf16 as reference_f32_to_bf16
from reference.bf16 import round_to_bf16

CORNERS = np.array([
    0x00000000, 0x80000000,              # +-0
    0x00000001, 0x807FFFFF, 0x00008000,  # subnormals (the last a tie that rounds to 0)
    0x3F808000, 0x3F818000,              # ties on an even and an odd bf16 mantissa
    0x3F807FFF, 0x3F808001,              # just below and above a tie
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # largest finites: kept, a tie, rounded up to infinity
    0xFF7FFFFF,                          # its negative: rounds to -inf
    0x7F800000, 0xFF800000,              # +-inf
    0x7F800001, 0x7FBFFFFF, 0x7FC00000,  # NaNs: signalling (low payload, full payload) and quiet
    0xFFFFFFFF, 0xFF800001, 0xFFC00000,  # negative NaNs (the rounding carry would wrap 32 bits)
], np.uint32)


@cuda.jit
def narrow_kernel(x, bits, rounded, pairs):
    """Thread i: f32_to_bf16 and round_bf16 of x[i], and round_bf16_pair of (x[i], x[i + 1 mod n])."""
    i = cuda.grid(1)
    n = x.shape[0]
    if i < n:
        bits[i] = f32_to_bf16(x[i])
        rounded[i] = round_bf16(x[i])
        pairs[i, 0], pairs[i, 1] = round_bf16_pair(x[i], x[(i + 1) % n])


def check_patterns(patterns: np.ndarray):
    x = patterns.astype(np.uint32).view(np.float32)
    bits, rounded = device_empty(x.shape, np.uint16), device_empty(x.shape, np.float32)
    pairs = device_empty((x.size, 2), np.float32)
    narrow_kernel[-(-x.size // 32), 32](to_device(x), bits, rounded, pairs)
    want = round_to_bf16(x)
    np.testing.assert_array_equal(bits.copy_to_host(), reference_f32_to_bf16(x))
    np.testing.assert_array_equal(rounded.copy_to_host().view(np.uint32), want.view(np.uint32))
    got = pairs.copy_to_host()
    for column, expected in enumerate((want, np.roll(want, -1))):
        nan = np.isnan(expected)
        np.testing.assert_array_equal(np.isnan(got[:, column]), nan)
        np.testing.assert_array_equal(got[~nan, column].view(np.uint32), expected[~nan].view(np.uint32))


def test_corners_match_the_reference_bit_for_bit():
    check_patterns(CORNERS)


@settings(max_examples=examples(10, 40))
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=pick(32, 4096)))
def test_any_pattern_matches_the_reference_bit_for_bit(patterns):
    check_patterns(np.array(patterns, np.uint64).astype(np.uint32))


@cuda.jit
def cast_kernel(bits, floats, back):
    """Thread i: floats[i] = the fp32 of bits[i]; back[i] = the bits of that fp32."""
    i = cuda.grid(1)
    if i < bits.shape[0]:
        f = f32_from_bits(bits[i])
        floats[i] = f
        back[i] = f32_bits(f)


@settings(max_examples=examples(5, 20))
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=pick(32, 4096)))
def test_bit_casts_keep_every_pattern(patterns):
    bits = np.concatenate([CORNERS, np.array(patterns, np.uint64).astype(np.uint32)])
    floats, back = device_empty(bits.shape, np.float32), device_empty(bits.shape, np.uint32)
    cast_kernel[-(-bits.size // 32), 32](to_device(bits), floats, back)
    np.testing.assert_array_equal(floats.copy_to_host().view(np.uint32), bits)
    np.testing.assert_array_equal(back.copy_to_host(), bits)


@cuda.jit
def fast_math_kernel(x, y, powers, larger, pieces):
    """Thread i: exp2_ftz(x[i]); fmax(x[i], y[i]); split_bf16x3_finite(x[i]) and split_bf16x3(x[i]) (when
    finite)."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        powers[i] = exp2_ftz(x[i])
        larger[i] = fmax(x[i], y[i])
        if abs(x[i]) < np.float32(np.inf):
            pieces[i, 0], pieces[i, 1], pieces[i, 2] = split_bf16x3_finite(x[i])
            pieces[i, 3], pieces[i, 4], pieces[i, 5] = split_bf16x3(x[i])


@settings(max_examples=examples(5, 20))
@given(st.lists(st.floats(-150, 130, width=32), min_size=1, max_size=pick(32, 4096)),
       st.integers(0, 2**32 - 1))
def test_exp2_fmax_and_the_finite_split(values, seed):
    """exp2_ftz is 2^x within 2 ulp, 0 for results below 2^-126 (and for -inf), inf past 2^128; fmax is the
    larger value; split_bf16x3_finite gives the same pieces as split_bf16x3 (hi + mid + lo == x exactly where
    x is not tiny)."""
    x = np.concatenate([np.array(values, np.float32),
                        np.float32([0, -0.0, 1, -1, -126, -126.5, -149, 127.9, 128, -np.inf, np.inf])])
    y = np.random.default_rng(seed).permutation(x)
    powers, larger = device_empty(x.shape, np.float32), device_empty(x.shape, np.float32)
    pieces = device_empty((x.size, 6), np.uint32)
    fast_math_kernel[-(-x.size // 32), 32](to_device(x), to_device(y), powers, larger, pieces)
    want = np.exp2(x.astype(np.float64))
    got = powers.copy_to_host().astype(np.float64)
    normal = (want >= 2.0**-126) & (want < 2.0**128)
    np.testing.assert_allclose(got[normal], want[normal], rtol=2 * 2.0**-23, atol=0)
    assert np.all(got[want < 2.0**-126] == 0)
    assert np.all(np.isposinf(got[want >= 2.0**128]))
    np.testing.assert_array_equal(larger.copy_to_host(), np.maximum(x, y))
    finite = np.isfinite(x)
    split = pieces.copy_to_host()[finite]
    np.testing.assert_array_equal(split[:, :3], split[:, 3:])
    hi, mid, lo = (split[:, p] for p in range(3))
    widen = lambda b: (b.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)  # noqa: E731
    exact = np.abs(x[finite]) >= 2.0**-100   # (below, lo's bits fall under bf16's normal range)
    np.testing.assert_array_equal((widen(hi) + widen(mid) + widen(lo))[exact], x[finite][exact].astype(np.float64))
