"""The KV cache's formats (reference/kv_format.py, cuda_kernels/kv_format.py): e4m3 against an independent
float64 implementation (the nearest of its 254 finite values, ties to the even code), and the GPU's
conversions against the NumPy twins, bit for bit: the bit-arithmetic e4m3 decode everywhere, the hardware
one (cvt.rn.f16x2.e4m3x2, GPU only) in test_e4m3_hardware_decode_matches_the_reference_bit_for_bit."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_support import SIM, device_empty, examples, to_device
from numba import cuda, uint8, uint32, uint64

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


# NOTE: x / scale overflows float32 for the largest values at scale < 1, on the GPU as in the reference (the fp8
# encode then saturates); the simulator divides numpy scalars, which warn about it.
@pytest.mark.filterwarnings("ignore:overflow encountered in scalar divide:RuntimeWarning")
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


def same_values(got: np.ndarray, want: np.ndarray) -> bool:
    """float32 arrays equal bit for bit where want is a number, and NaN exactly where want is NaN (the NaN's
    sign and payload may differ: the reference's -NaN for 0xFF, the GPU's own quiet NaN)."""
    nan = np.isnan(want)
    return (np.array_equal(np.isnan(got), nan)
            and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)))


@pytest.mark.skipif(not SIM, reason="a GPU device function cannot be called from the host; kernels use it there")
def test_e4m3_pair_decode_by_bit_arithmetic():
    """The decode the simulator runs (the bit arithmetic, also the GPU's below sm_89): every code in the low
    byte and in the high byte of a pair, next to another code, and the readers' helpers over it."""
    partner = (CODES.astype(np.int64) * 37 + 11) % 256
    pairs = np.concatenate([CODES | (partner << 8), partner | (CODES.astype(np.int64) << 8)]).astype(np.uint16)
    for fn in (kernels.e4m3x2_to_f32x2_arith, kernels.e4m3x2_to_f32x2):
        got = np.array([fn(np.uint16(p)) for p in pairs], np.float32)
        assert same_values(got[:, 0], ref.e4m3_to_f32((pairs & 0xFF).astype(np.uint8)))
        assert same_values(got[:, 1], ref.e4m3_to_f32((pairs >> 8).astype(np.uint8)))
    assert same_values(np.array([kernels.e4m3_to_f32(c) for c in CODES], np.float32), ref.e4m3_to_f32(CODES))
    got = np.array([kernels.e4m3x4_to_f32x4(q) for q in CODES.view(np.uint32)], np.float32).ravel()
    assert same_values(got, ref.e4m3_to_f32(CODES))


@cuda.jit
def _decode_everything(pairs, words, out_pairs, out_codes, out_words, out_quads):
    """pairs (65536,) u16 -> out_pairs (2, 65536, 2) f32 (the chosen decode, then the bit arithmetic); codes
    0..255 -> out_codes (256,) f32; words (W,) u64 -> out_words (W, 8) f32 (the fp8 codec's unpack) and
    out_quads (W, 2) u64 (bf16 quads of each half)."""
    i = cuda.grid(1)
    if i < pairs.shape[0]:
        lo, hi = kernels.e4m3x2_to_f32x2(pairs[i])
        out_pairs[0, i, 0] = lo
        out_pairs[0, i, 1] = hi
        lo, hi = kernels.e4m3x2_to_f32x2_arith(pairs[i])
        out_pairs[1, i, 0] = lo
        out_pairs[1, i, 1] = hi
    if i < out_codes.shape[0]:
        out_codes[i] = kernels.e4m3_to_f32(uint8(i))
    if i < words.shape[0]:
        f = kernels.unpack_e4m3x8(words[i])
        for c in range(8):
            out_words[i, c] = f[c]
        out_quads[i, 0] = kernels.e4m3x4_to_bf16x4(uint32(words[i] & uint64(0xFFFFFFFF)))
        out_quads[i, 1] = kernels.e4m3x4_to_bf16x4(uint32(words[i] >> uint64(32)))


@pytest.mark.skipif(SIM, reason="the hardware e4m3 decode (inline PTX through an @intrinsic) exists on a GPU "
                                "only; the simulator runs the bit arithmetic (test_e4m3_pair_decode_by_bit_arithmetic)")
def test_e4m3_hardware_decode_matches_the_reference_bit_for_bit():
    """One launch: every 16-bit pair (each code in both bytes, next to every other code), every code alone,
    and every code at each position of a 64-bit word, through the helpers the readers use, against the
    reference; the pairs through the bit arithmetic too (the definition, here on the device). On sm_89 and
    later the kernel must contain the hardware conversion (else the bit arithmetic)."""
    pairs = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    words = np.concatenate([CODES, CODES[::-1], np.roll(CODES, 3)]).view(np.uint64)
    out_pairs, out_codes = device_empty((2, 65536, 2), np.float32), device_empty(256, np.float32)
    out_words, out_quads = device_empty((len(words), 8), np.float32), device_empty((len(words), 2), np.uint64)
    _decode_everything[256, 256](to_device(pairs), to_device(words), out_pairs, out_codes, out_words, out_quads)
    ptx = next(iter(_decode_everything.inspect_asm().values()))
    hardware = tuple(cuda.get_current_device().compute_capability) >= kernels.E4M3_CVT_MIN_CC
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == hardware
    for got in out_pairs.copy_to_host():   # the chosen decode, then the bit arithmetic
        assert same_values(got[:, 0], ref.e4m3_to_f32((pairs & 0xFF).astype(np.uint8)))
        assert same_values(got[:, 1], ref.e4m3_to_f32((pairs >> 8).astype(np.uint8)))
    assert same_values(out_codes.copy_to_host(), ref.e4m3_to_f32(CODES))
    want = ref.e4m3_to_f32(words.view(np.uint8))
    assert same_values(out_words.copy_to_host().ravel(), want)
    bf16 = out_quads.copy_to_host().view(np.uint16).ravel()   # element order: 4 bf16 a half, 8 a word
    nan = np.isnan(want)
    assert np.array_equal(bf16[~nan], f32_to_bf16(want[~nan])) and np.isnan(ref.kv_decode(bf16[nan])).all()
