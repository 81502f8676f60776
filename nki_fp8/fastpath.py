"""Optional fused bf16 -> FP8 -> bf16 round trip compiled with numba, bit-identical to `quant`.

One pass per element of branch-free 32-bit integer / float32 arithmetic that LLVM vectorises:
  bf16 bits << 16 -> float32; y = x * s (float32, RNE); |y| clamped to max in the bit domain;
  FP8 encode with round-to-nearest-even — normal range: add 0x7FFFF + lsb, shift by 20, rebias
  127 -> 7; below 2^-6: `|y| * 2^9` (exact) rounded by the 2^23 magic-number add;
  the FP8 value is the rounded float32 itself (bits masked to 3 mantissa bits, or t * 2^-9);
  `/ s` (float32 division, as `dequantize`); bf16 RNE (add 0x7FFF + lsb, shift by 16).
NaN in -> code 0x7F / 0xFF (NaN in both formats) and bf16 NaN out. Every intermediate is wrapped
in np.uint32 so numba keeps 32-bit lanes (its default promotion to 64-bit halves the SIMD width).

Equality with `quantize` / `dequantize` (hence with ml_dtypes) is tested on all 65536 bf16 bit
patterns for several scales on both platforms. numba arrives with the vllm extra; without it
`available()` is False and `quant.Fp8Codec` uses its numpy lookup tables.
"""
from __future__ import annotations

import os

import numpy as np

_KERNEL = None


def available() -> bool:
    try:
        from metrics._numba import import_numba

        import_numba()  # guarded: a vLLM engine still starts in this process
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return False
    return True


def _build():
    from metrics._numba import import_numba

    numba = import_numba()

    u32 = np.uint32

    @numba.njit(nogil=True, boundscheck=False, fastmath=False)
    def round_trip(src, s, m, q_out, d_out):  # pragma: no cover - compiled
        magic = np.float32(8388608.0)  # 2^23
        mb = np.float32(m).view(np.uint32)
        for i in range(src.size):
            x = u32(u32(src[i]) << u32(16)).view(np.float32)
            yb = np.float32(x * s).view(np.uint32)
            sign = u32(u32(yb >> u32(24)) & u32(0x80))
            ab = u32(yb & u32(0x7FFFFFFF))
            isnan = ab > u32(0x7F800000)
            ab = u32(ab if ab < mb else mb)
            a = u32(ab).view(np.float32)
            r = u32(ab + u32(0x7FFFF) + u32(u32(ab >> u32(20)) & u32(1)))
            normal = u32(u32(r >> u32(20)) - u32(960))  # (exponent - 120) << 3 | mantissa
            t = np.float32(np.float32(a * np.float32(512.0) + magic) - magic)  # RNE(|y| * 2^9)
            sub = u32(np.int32(t))
            is_normal = ab >= u32(0x3C800000)  # 2^-6
            code = normal if is_normal else sub
            code = u32(0x7F) if isnan else code
            c = u32(code | sign)
            q_out[i] = np.uint8(c)
            # the FP8 value itself, without decoding the code: the rounded float32 bits
            vb = u32(r & u32(0xFFF00000)) if is_normal else np.float32(t * np.float32(0.001953125)).view(np.uint32)
            v = u32(vb | u32(sign << u32(24))).view(np.float32)
            ob = np.float32(v / s).view(np.uint32)
            rb = u32(u32(ob + u32(0x7FFF) + u32(u32(ob >> u32(16)) & u32(1))) >> u32(16))
            d_out[i] = np.uint16(u32(0x7FC0) | u32(sign << u32(8))) if isnan else np.uint16(rb)

    return round_trip


# Below this many elements one thread does it: handing work to a pool costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 20
_POOL = None
_POOL_PID = None  # the process that made _POOL: a forked child inherits it without its threads


def num_threads() -> int:
    """Threads for large round trips: ``$NKI_FP8_THREADS``, else every CPU this process may use."""
    env = os.environ.get("NKI_FP8_THREADS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def round_trip(x_bits: np.ndarray, scale: np.float32, max_finite: float, q_out: np.ndarray, d_out: np.ndarray,
               threads: int | None = None) -> None:
    """x_bits: bf16 bits uint16 [n] -> q_out uint8 [n] FP8 codes, d_out uint16 [n] bf16 bits.

    Large inputs are split into contiguous slices run on a thread pool (the kernel releases the
    GIL); every element is computed by the same kernel, so the bits do not depend on the split.
    """
    global _KERNEL, _POOL, _POOL_PID
    if _KERNEL is None:
        _KERNEL = _build()
    s, m = np.float32(scale), np.float32(max_finite)
    n = x_bits.size
    k = min(num_threads() if threads is None else max(1, int(threads)), max(1, n // PARALLEL_MIN_ELEMENTS))
    if k == 1:
        _KERNEL(x_bits, s, m, q_out, d_out)
        return
    if _POOL is None or _POOL._max_workers < k or _POOL_PID != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _POOL, _POOL_PID = ThreadPoolExecutor(max_workers=k, thread_name_prefix="nki-fp8"), os.getpid()
    bounds = [n * i // k for i in range(k + 1)]
    futures = [_POOL.submit(_KERNEL, x_bits[a:b], s, m, q_out[a:b], d_out[a:b]) for a, b in zip(bounds, bounds[1:])]
    for f in futures:
        f.result()
