"""The KV cache's formats (reference/kv_format.py, cuda_kernels/kv_format.py): e4m3 against an independent
float64 implementation (the nearest of its 254 finite values, ties to the even code), and the GPU's
conversions against the NumPy twins, bit for bit."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, to_device

from cuda_kernels import kv_format as kernels
from reference import kv_format as ref
from reference.bf16 import f32_to_bf16

CODES = np.arange(256, dtype=np.uint8)


def e4m3_value64(code: int) -> float:
    """The value of an e4m3 code, in float64, from the definition (NaN for S.1111.111)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return np.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


POSITIVE = np.array([e4m3_value64(c) for c in range(0x7F)])   # codes 0 .. 0x7E, ascending


def e4m3_oracle(x: np.ndarray) -> np.ndarray:
    """float32 values -> e4m3 codes: the nearest finite value in float64 (ties: the even code), saturated to
    448 (an infinity too), NaN -> 0x7F; the sign bit of x on top (so -0 -> 0x80)."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.uint8)
    for i, v in enumerate(x.astype(np.float64).ravel()):
        sign = 0x80 if np.signbit(v) else 0
        a = abs(v)
        if np.isnan(v):
            code = 0x7F
        elif a >= 448.0:
            code = 0x7E
        else:
            hi = int(np.searchsorted(POSITIVE, a))      # POSITIVE[hi - 1] < a <= POSITIVE[hi]
            lo = max(hi - 1, 0)
            down, up = a - POSITIVE[lo], POSITIVE[hi] - a
            code = lo if down < up else hi if up < down else (lo if lo % 2 == 0 else hi)
        out.ravel()[i] = code | sign
    return out


def interesting_values() -> np.ndarray:
    """Every e4m3 value, the midpoints between neighbours (ties) and one float32 ulp either side of them, the
    saturation edge, subnormals of both kinds, zeros, infinities and NaNs, with both signs."""
    v = POSITIVE.astype(np.float32)
    mid = ((POSITIVE[1:] + POSITIVE[:-1]) / 2).astype(np.float32)   # exact in float32
    around = np.concatenate([np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    edge = np.array([448, 455, 463.9, 464, 464.1, 479, 480, 500, 1e6, 3e38, np.inf, 2.0 ** -10, 2.0 ** -11,
                     1e-30, 1e-45, 0.0, np.nan], np.float32)
    x = np.concatenate([v, mid, around, edge])
    return np.concatenate([x, -x]).astype(np.float32)


def test_e4m3_encode_matches_the_float64_nearest_value():
    x = interesting_values()
    want = e4m3_oracle(x)
    got = ref.f32_to_e4m3(x)
    assert np.array_equal(got, want), x[got != want][:8]


@settings(max_examples=200)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64),
       st.sampled_from([1.0, 2.0 ** -8, 0.37, 2.0 ** 9]))
def test_e4m3_encode_of_any_float(values, scale):
    x = np.array(values, np.float32)
    with np.errstate(over="ignore"):
        scaled = x / np.float32(scale)
    np.testing.assert_array_equal(ref.kv_encode(x, "fp8", scale), e4m3_oracle(scaled))


def test_e4m3_decode_is_exact_and_round_trips():
    got = ref.e4m3_to_f32(CODES)
    want = np.array([e4m3_value64(c) for c in range(256)])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].astype(np.float64), want[finite])
    assert np.array_equal(ref.f32_to_e4m3(got[finite]), CODES[finite])      # -0 included: 0x80
    assert got[0x7E] == 448 and got[0x08] == 2.0 ** -6 and got[0x01] == 2.0 ** -9


def test_kv_format_names_and_nans():
    for fmt in ref.FORMATS:
        cache = np.full(3, ref.NANS[fmt], ref.DTYPES[fmt])
        assert ref.format_of(cache) == kernels.format_of(cache) == fmt
        assert np.isnan(ref.kv_decode(cache)).all()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ref.check_format("fp16")
    with pytest.raises(ValueError, match="KV cache is uint16"):
        kernels.format_of(np.zeros(2, np.float16))


# ---------------------------------------------------------------------------------------------------------
# the GPU's conversions (kv_format.kv_encode / kv_decode kernels over the codec's device functions)


@settings(max_examples=examples(3, 10))
@given(st.integers(0, 2**32 - 1), st.sampled_from(ref.FORMATS), st.sampled_from([1.0, 0.05, 3.0]))
def test_encode_and_decode_kernels_match_the_reference(seed, fmt, scale):
    rng = np.random.default_rng(seed)
    x = interesting_values()
    if not SIM:
        x = np.concatenate([x, rng.standard_normal(100_000).astype(np.float32) * np.float32(rng.choice([1, 100]))])
    x = x[rng.permutation(len(x))]
    scale = scale if fmt == "fp8" else 1.0
    stored = device_empty(x.shape, ref.DTYPES[fmt])
    kernels.kv_encode(to_device(x), stored, scale)
    want = ref.kv_encode(x, fmt, scale)
    got = stored.copy_to_host()
    if fmt == "fp32":
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    else:  # NaN payloads: the format's own quiet NaN on both sides
        assert np.array_equal(got, want), (x[got != want][:5], got[got != want][:5], want[got != want][:5])
    back = device_empty(x.shape, np.float32)
    kernels.kv_decode(stored, back, scale)
    want_back = ref.kv_decode(want, scale)
    np.testing.assert_array_equal(back.copy_to_host(), want_back)


def test_conversion_launchers_check_their_arguments():
    x = to_device(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="a fp32 cache takes 1.0"):
        kernels.kv_encode(x, device_empty(4, np.float32), 2.0)
    with pytest.raises(ValueError, match="positive and finite"):
        kernels.kv_encode(x, device_empty(4, np.uint8), 0.0)
    with pytest.raises(ValueError, match="same shape"):
        kernels.kv_decode(device_empty(4, np.uint8), device_empty(3, np.float32))


@pytest.mark.skipif(not SIM, reason="a GPU device function cannot be called from the host; kernels use it there")
def test_word_unpacking_device_versions():
    """The GPU's unpacking of a uint64 of the cache (the simulator's kernels use NumPy ones) and the e4m3 ->
    bf16 quads of the tensor-core prefill, against the reference, for every e4m3 code and fp32 values."""
    words = CODES.view(np.uint64)
    for i, word in enumerate(words):
        want = ref.e4m3_to_f32(CODES[8 * i: 8 * i + 8])
        for fn in (kernels.unpack_e4m3x8_device, kernels.unpack_e4m3x8):
            got = np.array(fn(word), np.float32)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or np.array_equal(
                np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
        for half in range(2):
            quad = kernels.e4m3x4_to_bf16x4(np.uint32(np.uint64(word) >> np.uint64(32 * half) & np.uint64(0xFFFFFFFF)))
            bf16 = np.array([quad], np.uint64).view(np.uint16)
            part = want[4 * half: 4 * half + 4]
            assert np.array_equal(bf16[~np.isnan(part)], f32_to_bf16(part[~np.isnan(part)]))
            assert np.isnan(ref.kv_decode(bf16[np.isnan(part)])).all()
    values = np.array([1.5, -2.25, 3e38, -0.0, np.nan, 1e-40], np.float32)
    for word, pair in zip(values.view(np.uint64), values.reshape(-1, 2)):
        for fn in (kernels.unpack_f32x2_device, kernels.unpack_f32x2):
            got = np.array(fn(word), np.float32)
            assert got.view(np.uint32).tolist() == pair.view(np.uint32).tolist()
