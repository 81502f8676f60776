"""Quantize `clamp(x * s, -max, max)` then cast to FP8; dequantize `x_fp8 / s`.

`s` is a kernel scale (a multiplier; see `scales`). The cast is round-to-nearest-even, as in
ml_dtypes and torch. Special values, stated once and pinned by tests:

- ``+-inf`` saturates to ``+-max`` (240 on trn2, 448 on trn3): the clamp runs before the cast.
- ``NaN`` stays NaN (clamp propagates it, both formats encode NaN) and dequantizes to NaN.
  Its bit pattern is not pinned (ml_dtypes writes 0x7f/0x7c, torch bf16 NaN writes 0xff).
- ``-0.0`` stays ``-0.0`` (code 0x80); values below half the smallest subnormal (2^-10) flush
  to +-0, the tie at exactly 2^-10 rounds to even, i.e. to 0.
- Without the clamp the raw casts disagree beyond max: ml_dtypes E4M3FN gives NaN, ml_dtypes E4M3
  gives inf, torch `float8_e4m3fn` saturates to 448. The clamp makes all three agree.

`compute_dtype` says where `x * s` is rounded: "float32" (default; one rounding, in the cast)
or "bfloat16" (the product rounded to bf16 first, as `bf16_tensor * bf16_scale` in the vLLM
Neuron fallback does — a double rounding that can move a value by one FP8 step).

Group scales (`scales.absmax(..., "group")`) have shape `[..., n_groups, 1]`; pass `group_size`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import fp8_format
from .scales import grouped

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _scaled(x, scale, compute_dtype: str, group_size: int | None) -> tuple[np.ndarray, tuple]:
    x = np.asarray(x)
    shape = x.shape
    xf = x.astype(np.float32)
    if group_size is not None:
        xf = grouped(xf, group_size)
    s = np.asarray(scale, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf*s and NaN are handled by clamp/cast
        return _product(xf, s, compute_dtype), shape


def _product(xf: np.ndarray, s: np.ndarray, compute_dtype: str) -> np.ndarray:
    if compute_dtype == "float32":
        y = xf * s
    elif compute_dtype == "bfloat16":
        # bf16 * bf16 is exact in float32 (8+8 mantissa bits), so this is torch's bf16 multiply.
        y = (xf.astype(_BF16).astype(np.float32) * s.astype(_BF16).astype(np.float32)).astype(_BF16)
        y = y.astype(np.float32)
    else:
        raise ValueError(f"compute_dtype must be 'float32' or 'bfloat16', got {compute_dtype!r}")
    return y


def quantize(
    x,
    scale,
    *,
    platform: str | None = None,
    compute_dtype: str = "float32",
    group_size: int | None = None,
) -> np.ndarray:
    """FP8 codes of `x` (same shape as `x`), as the platform's ml_dtypes FP8 dtype.

    x: any float array (float32, float16, bfloat16); scale: kernel scale broadcastable to x
    (or `[..., n_groups, 1]` with `group_size`).
    """
    fmt = fp8_format(platform)
    y, shape = _scaled(x, scale, compute_dtype, group_size)
    y = np.asarray(y, dtype=np.float32)  # a 0-d product comes back as a numpy scalar
    np.clip(y, -fmt.max_finite, fmt.max_finite, out=y)  # NaN passes through np.clip
    return y.astype(fmt.numpy_dtype).reshape(shape)


def dequantize(q, scale, *, out_dtype=np.float32, group_size: int | None = None) -> np.ndarray:
    """`q / scale` computed in float32 (a true division, one rounding), then cast to `out_dtype`.

    q: FP8 codes as an ml_dtypes FP8 array; scale: the kernel scale used to quantize.
    """
    q = np.asarray(q)
    shape = q.shape
    qf = q.astype(np.float32)
    if group_size is not None:
        qf = grouped(qf, group_size)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = qf / np.asarray(scale, dtype=np.float32)
    return out.reshape(shape).astype(out_dtype)


def fake_quantize(x, scale, *, platform: str | None = None, out_dtype=np.float32, **kw) -> np.ndarray:
    """Round trip `dequantize(quantize(x, s), s)`: what a reader of the FP8 cache sees."""
    group_size = kw.get("group_size")
    return dequantize(quantize(x, scale, platform=platform, **kw), scale, out_dtype=out_dtype, group_size=group_size)


# --- torch paths (the engine side; bit-identical to the numpy reference, tested) ----------------
def quantize_torch(x, scale, *, platform: str | None = None):
    """`(x.float() * s).clamp(-max, max).to(torch.float8_e4m3fn)`, as vLLM Neuron writes the cache.

    On trn2 the result's bits are the E4M3 codes (identical below 240); read them with
    `fp8_codes_to_numpy(t, platform)`.
    """
    import torch

    m = fp8_format(platform).max_finite
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.to(torch.float32) * s).clamp(-m, m).to(torch.float8_e4m3fn)


def dequantize_torch(q, scale, *, out_dtype=None):
    """`q.float() / s` cast to `out_dtype` (default float32). q: torch.float8_e4m3fn codes."""
    import torch

    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    out = q.to(torch.float32) / s
    return out if out_dtype is None else out.to(out_dtype)


def fp8_codes_to_numpy(q, platform: str | None = None) -> np.ndarray:
    """Reinterpret torch FP8 codes (uint8 bits) as the platform's ml_dtypes FP8 array."""
    import torch

    bits = q.contiguous().view(torch.uint8).cpu().numpy()
    return bits.view(fp8_format(platform).numpy_dtype)


# --- fast per-tensor path: lookup tables, bit-identical to quantize/dequantize ------------------
class Fp8Codec:
    """bf16 <-> FP8 with one per-tensor kernel scale, through two lookup tables.

    The tables are built by running `quantize` / `dequantize` on all 65536 bf16 bit patterns and
    all 256 FP8 codes, so the codec is the reference by construction (and is tested
    exhaustively). It processes `chunk` elements at a time to stay in cache; indices are in
    range by construction (uint16 into 65536 entries, uint8 into 256), so `mode="clip"` only
    skips numpy's bounds check.

    `round_trip` uses the fused numba kernel of `fastpath` when `backend` is "numba" (or "auto"
    and numba imports): same bits, one vectorised pass instead of two table gathers.
    """

    def __init__(self, scale: float, *, platform: str | None = None, chunk: int = 1 << 17, backend: str = "auto"):
        from . import fastpath

        if backend not in ("auto", "numpy", "numba"):
            raise ValueError(f"Fp8Codec backend must be 'auto', 'numpy' or 'numba', got {backend!r}")
        if backend == "numba" and not fastpath.available():
            raise ValueError("Fp8Codec backend='numba' but numba is not importable (it comes with the vllm extra)")
        self.backend = "numba" if backend == "numba" or (backend == "auto" and fastpath.available()) else "numpy"
        self.platform = platform
        self.fmt = fp8_format(platform)
        self.scale = np.float32(scale)
        self.chunk = chunk
        all_bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(_BF16)
        self.q_lut = quantize(all_bf16, self.scale, platform=platform).view(np.uint8)
        codes = np.arange(256, dtype=np.uint16).astype(np.uint8).view(self.fmt.numpy_dtype)
        self.dq_lut = dequantize(codes, self.scale, out_dtype=_BF16).view(np.uint16)

    def quantize(self, x_bf16: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x_bf16: bfloat16 array -> FP8 codes (platform dtype), same shape."""
        src = np.ascontiguousarray(x_bf16).view(np.uint16).reshape(-1)
        dst = np.empty(src.size, np.uint8) if out is None else out.view(np.uint8).reshape(-1)
        for i in range(0, src.size, self.chunk):
            np.take(self.q_lut, src[i : i + self.chunk], out=dst[i : i + self.chunk], mode="clip")
        return dst.view(self.fmt.numpy_dtype).reshape(np.shape(x_bf16))

    def dequantize(self, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """q: FP8 codes -> bfloat16 values `q / s`, same shape."""
        src = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
        dst = np.empty(src.size, np.uint16) if out is None else out.view(np.uint16).reshape(-1)
        for i in range(0, src.size, self.chunk):
            np.take(self.dq_lut, src[i : i + self.chunk], out=dst[i : i + self.chunk], mode="clip")
        return dst.view(_BF16).reshape(np.shape(q))

    def round_trip(self, x_bf16: np.ndarray, q_out: np.ndarray | None = None, out: np.ndarray | None = None):
        """(FP8 codes, dequantized bf16) of x_bf16, chunk by chunk so the codes stay in cache."""
        src = np.ascontiguousarray(x_bf16).view(np.uint16).reshape(-1)
        q = np.empty(src.size, np.uint8) if q_out is None else q_out.view(np.uint8).reshape(-1)
        d = np.empty(src.size, np.uint16) if out is None else out.view(np.uint16).reshape(-1)
        if self.backend == "numba":
            from . import fastpath

            fastpath.round_trip(src, self.scale, self.fmt.max_finite, q, d)
            shape = np.shape(x_bf16)
            return q.view(self.fmt.numpy_dtype).reshape(shape), d.view(_BF16).reshape(shape)
        for i in range(0, src.size, self.chunk):
            j = i + self.chunk
            np.take(self.q_lut, src[i:j], out=q[i:j], mode="clip")
            np.take(self.dq_lut, q[i:j], out=d[i:j], mode="clip")
        shape = np.shape(x_bf16)
        return q.view(self.fmt.numpy_dtype).reshape(shape), d.view(_BF16).reshape(shape)
