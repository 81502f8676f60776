"""Independent, slow, obvious FP8 E4M3 / E4M3FN oracle written from the bit layout alone.

Used by the tests as the ground truth that ml_dtypes, torch and nki_fp8 are all checked against.
"""
import math

FORMATS = {"trn2": "e4m3", "trn3": "e4m3fn"}


def decode(code: int, fmt: str) -> float:
    """Value of an 8-bit code: sign | 4-bit exponent (bias 7) | 3-bit mantissa."""
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0xF:
        if fmt == "e4m3":  # IEEE-style: inf at mantissa 0, NaN otherwise
            return sign * math.inf if m == 0 else math.nan
        if m == 7:  # OCP FN: only S.1111.111 is NaN, no inf
            return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0**-6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def positive_finite_codes(fmt: str) -> list[int]:
    """Codes 0x00.. of the non-negative finite values, ascending in value."""
    return [c for c in range(0x80) if math.isfinite(decode(c, fmt))]


def encode_rne(v: float, fmt: str) -> int:
    """Round-to-nearest-even encoding of a finite v with |v| <= max (the caller clamps)."""
    codes = positive_finite_codes(fmt)
    a = abs(v)
    best = min(codes, key=lambda c: (abs(decode(c, fmt) - a), c & 1))  # tie -> even mantissa
    return best | (0x80 if math.copysign(1.0, v) < 0 else 0)
