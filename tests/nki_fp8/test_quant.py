"""Casts and quantize/dequantize against an independent bit-layout oracle, ml_dtypes and torch."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_fp8.formats import fp8_format
from nki_fp8.quant import (
    Fp8Codec,
    dequantize,
    dequantize_torch,
    fake_quantize,
    fp8_codes_to_numpy,
    quantize,
    quantize_torch,
)
from tests.forked import result_in_forked_child

from .fp8_oracle import FORMATS, decode, encode_rne, positive_finite_codes

BF16 = ml_dtypes.bfloat16


def codes(q) -> list[int]:
    return [int(b) for b in np.asarray(q).reshape(-1).view(np.uint8)]


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
def test_all_256_codes_decode_as_the_bit_layout_says(platform):
    fmt = FORMATS[platform]
    got = np.arange(256, dtype=np.uint16).astype(np.uint8).view(fp8_format(platform).numpy_dtype).astype(np.float64)
    want = np.array([decode(c, fmt) for c in range(256)])
    np.testing.assert_array_equal(got, want)  # NaN == NaN positions in assert_array_equal
    if platform == "trn3":
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double().numpy()
        np.testing.assert_array_equal(t, want)


def test_largest_finite_values_are_240_and_448():
    assert max(decode(c, "e4m3") for c in positive_finite_codes("e4m3")) == 240.0
    assert max(decode(c, "e4m3fn") for c in positive_finite_codes("e4m3fn")) == 448.0
    assert fp8_format("trn2").max_finite == 240.0 and fp8_format("trn3").max_finite == 448.0


def test_e4m3_and_e4m3fn_share_every_code_up_to_240():
    # Why TRN2 can keep torch.float8_e4m3fn tensors once values are clamped to 240.
    for c in range(256):
        a, b = decode(c, "e4m3"), decode(c, "e4m3fn")
        if math.isfinite(a) and abs(a) <= 240:
            assert a == b or (a == 0 and b == 0), hex(c)


# Hand-derived: value -> code after quantize(x, scale=1). Derivations in the comments.
HAND_CASES = [
    ("trn2", 240.0, 0x77),  # 0 1110 111 = 1.875 * 2^7
    ("trn2", 1.0, 0x38),  # 0 0111 000
    ("trn2", -2.0, 0xC0),  # 1 1000 000
    ("trn2", 2.0**-6, 0x08),  # smallest normal
    ("trn2", 7 / 8 * 2.0**-6, 0x07),  # largest subnormal
    ("trn2", 2.0**-9, 0x01),  # smallest subnormal
    ("trn2", 2.0**-10, 0x00),  # tie between 0 and 2^-9 -> even (0)
    ("trn2", 3 * 2.0**-10, 0x02),  # tie between 2^-9 (m=1) and 2^-8 (m=2) -> even
    ("trn2", -(2.0**-11), 0x80),  # flushes to negative zero
    ("trn2", -0.0, 0x80),
    ("trn2", 1 + 1 / 16, 0x38),  # tie 1.0 / 1.125 -> 1.0 (even mantissa)
    ("trn2", 1 + 3 / 16, 0x3A),  # tie 1.125 / 1.25 -> 1.25
    ("trn2", 232.0, 0x76),  # tie 224 (m=6) / 240 (m=7) -> 224
    ("trn2", 300.0, 0x77),  # beyond max: clamped to 240
    ("trn2", 1e30, 0x77),
    ("trn2", math.inf, 0x77),  # inf saturates
    ("trn2", -math.inf, 0xF7),
    ("trn3", 448.0, 0x7E),  # 0 1111 110 = 1.75 * 2^8
    ("trn3", 248.0, 0x78),  # tie 240 (m=7) / 256 (m=0) -> 256: a value TRN2 cannot hold
    ("trn3", 432.0, 0x7E),  # tie 416 (m=5) / 448 (m=6) -> 448
    ("trn3", 464.0, 0x7E),  # beyond max: clamped
    ("trn3", 1e30, 0x7E),
    ("trn3", math.inf, 0x7E),
    ("trn3", -math.inf, 0xFE),
    ("trn3", -0.0, 0x80),
    ("trn3", 2.0**-9, 0x01),
]


@pytest.mark.parametrize("platform,value,code", HAND_CASES)
def test_hand_derived_encodings(platform, value, code):
    assert codes(quantize(np.float32(value), 1.0, platform=platform)) == [code]
    if math.isfinite(value) and abs(value) <= fp8_format(platform).max_finite:
        assert encode_rne(value, FORMATS[platform]) == code  # the oracle agrees with the hand
    if platform == "trn3":
        t = quantize_torch(torch.tensor([value], dtype=torch.float32), 1.0, platform=platform)
        assert codes(t.view(torch.uint8).numpy()) == [code]


def _midpoint_probes(fmt):
    """Every midpoint between neighbouring positive finite values, and one float32 ulp either side."""
    vals = sorted(decode(c, fmt) for c in positive_finite_codes(fmt))
    probes = []
    for lo, hi in zip(vals, vals[1:]):
        mid = np.float32((lo + hi) / 2)  # exact: both are short binary fractions
        probes += [np.nextafter(mid, np.float32(0)), mid, np.nextafter(mid, np.float32(np.inf))]
    return np.array(probes, dtype=np.float32)


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
def test_round_to_nearest_even_at_every_midpoint_matches_oracle_ml_dtypes_and_torch(platform):
    fmt = FORMATS[platform]
    x = _midpoint_probes(fmt)
    x = np.concatenate([x, -x])
    want = [encode_rne(float(v), fmt) for v in x]
    assert codes(quantize(x, 1.0, platform=platform)) == want
    assert codes(x.astype(fp8_format(platform).numpy_dtype)) == want  # raw ml_dtypes cast
    # torch has only E4M3FN; below 240 its codes are the E4M3 codes too.
    t = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert codes(t) == want


def test_raw_casts_disagree_beyond_max_and_the_clamp_makes_them_agree():
    x = np.array([480.0, 1e6, np.inf], np.float32)
    assert np.isnan(x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()  # ml_dtypes FN: NaN
    assert np.isinf(np.array([256.0, 1e6], np.float32).astype(ml_dtypes.float8_e4m3).astype(np.float32)).all()
    assert torch.from_numpy(x).to(torch.float8_e4m3fn).float().tolist() == [448.0] * 3  # torch saturates
    assert quantize(x, 1.0, platform="trn3").astype(np.float32).tolist() == [448.0] * 3
    assert quantize(x, 1.0, platform="trn2").astype(np.float32).tolist() == [240.0] * 3


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
def test_nan_stays_nan_through_quantize_and_dequantize(platform):
    x = np.array([np.nan, 1.0, -np.nan], np.float32)
    q = quantize(x, 4.0, platform=platform)
    d = dequantize(q, 4.0)
    assert np.isnan(d[[0, 2]]).all() and d[1] == 1.0
    t = dequantize_torch(quantize_torch(torch.from_numpy(x), 4.0, platform=platform), 4.0)
    assert torch.isnan(t[[0, 2]]).all() and t[1].item() == 1.0


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
@pytest.mark.parametrize("scale", [1.0, 37.5, 0.013, 240 / 3.7])
def test_torch_quantize_is_bit_identical_to_numpy_reference(platform, scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * rng.choice([1e-3, 1.0, 30.0], 4096)).astype(np.float32)
    x[:8] = [0.0, -0.0, 1e9, -1e9, np.inf, -np.inf, 2.0**-12, -(2.0**-12)]
    xb = x.astype(BF16)
    ref = quantize(xb, scale, platform=platform)
    tq = quantize_torch(torch.from_numpy(xb.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16), scale, platform=platform)
    got = fp8_codes_to_numpy(tq, platform)
    assert codes(got) == codes(ref)  # on trn2: torch E4M3FN bits read as E4M3 (the 240 clamp)


def test_bfloat16_compute_double_rounds_a_value_just_above_a_tie():
    # x = 1 + 1/16 + 2^-12: float32 keeps it above the 1.0/1.125 tie -> 1.125 (0x39).
    # bf16 rounds the product to 1.0625 first (spacing 2^-7), the tie then goes to even -> 1.0.
    x = np.float32(1 + 1 / 16 + 2.0**-12)
    assert codes(quantize(x, 1.0, platform="trn2")) == [0x39]
    assert codes(quantize(x, 1.0, platform="trn2", compute_dtype="bfloat16")) == [0x38]


def test_dequantize_divides_by_the_kernel_scale():
    q = quantize(np.array([1.0, -3.0, 0.25], np.float32), 64.0, platform="trn2")
    assert q.astype(np.float32).tolist() == [64.0, -192.0, 16.0]
    assert dequantize(q, 64.0).tolist() == [1.0, -3.0, 0.25]
    assert fake_quantize(np.float32(1.0 + 1 / 32), 1.0, platform="trn2") == np.float32(1.0)


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
@pytest.mark.parametrize("scale", [1.0, 3.3, 1e-4, 2.0**20])
def test_lut_codec_equals_reference_on_all_65536_bf16_patterns(platform, scale):
    xb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16)
    codec = Fp8Codec(scale, platform=platform, chunk=5000, backend="numpy")  # chunk not dividing the size
    q = codec.quantize(xb)
    ref = quantize(xb, scale, platform=platform)
    nan = np.isnan(ref.astype(np.float32))
    assert (np.isnan(q.astype(np.float32)) == nan).all()
    np.testing.assert_array_equal(q.view(np.uint8)[~nan], ref.view(np.uint8)[~nan])
    d = codec.dequantize(q)
    np.testing.assert_array_equal(d.view(np.uint16)[~nan], dequantize(ref, scale, out_dtype=BF16).view(np.uint16)[~nan])
    q2, d2 = codec.round_trip(xb)
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(d2.view(np.uint16), d.view(np.uint16))


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
@pytest.mark.parametrize("scale", [1.0, 3.3, 1e-4, 2.0**20, 12.0, 240 / 1e-3])
def test_fused_numba_round_trip_equals_reference_on_all_65536_bf16_patterns(platform, scale):
    pytest.importorskip("numba")
    xb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16)
    q, d = Fp8Codec(scale, platform=platform, backend="numba").round_trip(xb)
    ref = quantize(xb, scale, platform=platform)
    nan = np.isnan(ref.astype(np.float32))
    assert (np.isnan(q.astype(np.float32)) == nan).all() and (np.isnan(d.astype(np.float32)) == nan).all()
    np.testing.assert_array_equal(q.view(np.uint8)[~nan], ref.view(np.uint8)[~nan])
    want_d = dequantize(ref, scale, out_dtype=BF16)
    np.testing.assert_array_equal(d.view(np.uint16)[~nan], want_d.view(np.uint16)[~nan])


@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_round_trip_of_a_large_tensor_equals_the_numpy_tables_bit_for_bit(threads):
    pytest.importorskip("numba")
    from nki_fp8 import fastpath

    n = 2 * fastpath.PARALLEL_MIN_ELEMENTS + 12345  # uneven slices
    bits = np.random.default_rng(7).integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    tables = Fp8Codec(12.0, platform="trn2", backend="numpy")
    q_ref, d_ref = tables.round_trip(bits.view(BF16))  # the exhaustively tested lookup tables
    q, d = np.empty(n, np.uint8), np.empty(n, np.uint16)
    fastpath.round_trip(bits, np.float32(12.0), tables.fmt.max_finite, q, d, threads=threads)
    q1, d1 = np.empty(n, np.uint8), np.empty(n, np.uint16)
    fastpath.round_trip(bits, np.float32(12.0), tables.fmt.max_finite, q1, d1, threads=1)
    np.testing.assert_array_equal(q, q1)  # the split changes no bit, NaN payloads included
    np.testing.assert_array_equal(d, d1)
    ok = ~np.isnan(bits.view(BF16).astype(np.float32))  # NaN: both NaN, codes may differ (see above)
    assert np.isnan(d_ref[~ok].astype(np.float32)).all() and np.isnan(d.view(BF16)[~ok].astype(np.float32)).all()
    np.testing.assert_array_equal(q[ok], q_ref.view(np.uint8)[ok])
    np.testing.assert_array_equal(d[ok], d_ref.view(np.uint16)[ok])


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    platform=st.sampled_from(["trn2", "trn3"]),
    values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=40),
    scale=st.floats(min_value=2.0**-20, max_value=2.0**20, width=32),
)
def test_quantize_equals_the_oracle_for_any_float32_and_scale(platform, values, scale):
    x = np.array(values, np.float32)
    m = fp8_format(platform).max_finite
    with np.errstate(over="ignore"):
        y = np.clip(x * np.float32(scale), -m, m)  # the clamp the oracle assumes, in float32
    want = [encode_rne(float(v), FORMATS[platform]) for v in y]
    assert codes(quantize(x, scale, platform=platform)) == want


def _round_trip_in_child(q, bits, max_finite):
    from nki_fp8 import fastpath

    out, dq = np.empty(bits.size, np.uint8), np.empty(bits.size, np.uint16)
    fastpath.round_trip(bits, np.float32(12.0), max_finite, out, dq, threads=2)
    q.put((out.tobytes(), dq.tobytes()))


def test_a_forked_child_round_trips_on_a_pool_of_its_own():
    """A child forked after the threaded round trip ran in its parent inherits the pool without
    its threads (its slices were never run); the pool is made again there, the bits the same."""
    pytest.importorskip("numba")
    from nki_fp8 import fastpath

    n = 2 * fastpath.PARALLEL_MIN_ELEMENTS + 7
    bits = np.random.default_rng(8).integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    fmt = Fp8Codec(12.0, platform="trn2", backend="numpy").fmt
    q, d = np.empty(n, np.uint8), np.empty(n, np.uint16)
    fastpath.round_trip(bits, np.float32(12.0), fmt.max_finite, q, d, threads=2)
    assert result_in_forked_child(_round_trip_in_child, bits, fmt.max_finite, timeout=120) == (q.tobytes(), d.tobytes())
