"""FP8 quantize + dequantize throughput of a 1 GiB bf16 tensor against one numpy pass.

Limit measured in the same run: `np.copyto` of the same bytes (one read + one write pass, the
fastest thing numpy can do over them). Paths timed (best of --repeat, outputs preallocated and
touched first so page faults are not counted):

- lut round trip: `Fp8Codec(backend="numpy").round_trip` (two table gathers per element),
- fused (numba): `Fp8Codec(backend="numba").round_trip`, one vectorised pass (when numba imports),
  split over `nki_fp8.fastpath.num_threads()` threads for large tensors ($NKI_FP8_THREADS),
  both bit-identical to the reference on all 65536 bf16 patterns (tested),
- reference: `quantize` + `dequantize` (float32 element-wise numpy), on a slice (--ref-mb),
- torch: `quantize_torch` + `dequantize_torch`, chunked, on the same slice.
A bf16 -> float32 conversion pass and a bf16 `x * s` ufunc pass are shown for context (the
limit is the copy). The LUT path is gather-bound: two table lookups per element (np.take, about
1 ns each when the machine is quiet) against the copy's ~0.2 ns per element.

Throughput = input bf16 bytes / second. Goal: the faster round trip >= 0.2x the copy.
Usage: python benchmarks/bench_fp8.py [--size-mb 1024] [--ref-mb 16] [--repeat 3]
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from timing import best_of

from nki_fp8 import fastpath
from nki_fp8.quant import Fp8Codec, dequantize, dequantize_torch, quantize, quantize_torch

GOAL = 0.2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="bf16 tensor size in MiB (default 1024 = 1 GiB)")
    ap.add_argument("--ref-mb", type=int, default=16, help="slice for the slow element-wise paths")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--platform", default="trn2")
    args = ap.parse_args(argv)

    n = args.size_mb * (1 << 20) // 2
    rng = np.random.default_rng(0)
    x = np.empty(n, np.uint16)
    step = 1 << 24
    for i in range(0, n, step):  # bf16 values ~ N(0, 3): a realistic K/V range
        x[i : i + step] = (rng.standard_normal(min(step, n - i), dtype=np.float32) * 3).astype(ml_dtypes.bfloat16).view(np.uint16)
    xb = x.view(ml_dtypes.bfloat16)
    scale = float(240.0 / 20.0)
    nbytes = x.nbytes

    copy_dst = np.ones_like(x)
    t_copy = best_of(lambda: np.copyto(copy_dst, x), args.repeat)
    del copy_dst
    f32 = np.ones(n, np.float32)
    t_f32 = best_of(lambda: np.copyto(f32, xb, casting="unsafe"), args.repeat)  # one bf16 -> f32 pass
    del f32
    prod = np.ones_like(xb)
    s_bf16 = ml_dtypes.bfloat16(12.0)
    t_mul = best_of(lambda: np.multiply(xb, s_bf16, out=prod), args.repeat)  # one bf16 arithmetic pass
    del prod

    q = np.ones(n, np.uint8)
    d = np.ones(n, np.uint16)
    codec = Fp8Codec(scale, platform=args.platform, backend="numpy")
    t_lut = best_of(lambda: codec.round_trip(xb, q, d), args.repeat)
    t_fused = None
    if fastpath.available():
        fused = Fp8Codec(scale, platform=args.platform, backend="numba")
        fused.round_trip(xb[:16])  # compile outside the timing
        t_fused = best_of(lambda: fused.round_trip(xb, q, d), args.repeat)

    m = min(n, args.ref_mb * (1 << 20) // 2)
    xs = xb[:m]
    t_ref = best_of(lambda: dequantize(quantize(xs, scale, platform=args.platform), scale, out_dtype=ml_dtypes.bfloat16), 1) * n / m

    import torch

    xt = torch.from_numpy(x[:m].view(np.int16)).view(torch.bfloat16)

    def torch_rt():
        for i in range(0, m, 1 << 20):
            dequantize_torch(quantize_torch(xt[i : i + (1 << 20)], scale, platform=args.platform), scale, out_dtype=torch.bfloat16)

    t_torch = best_of(torch_rt, 1) * n / m

    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    rows = [
        ("np.copyto (limit)", t_copy, args.size_mb),
        ("bf16->f32 pass", t_f32, args.size_mb),
        ("bf16 x*s pass", t_mul, args.size_mb),
        ("lut round trip", t_lut, args.size_mb),
        *([("fused (numba)", t_fused, args.size_mb)] if t_fused else []),
        ("reference numpy", t_ref, args.ref_mb),
        ("torch chunked", t_torch, args.ref_mb),
    ]
    print(f"FP8 ({args.platform}) quantize+dequantize of a {args.size_mb} MiB bf16 tensor; best of {args.repeat}")
    print(f"{'path':<20} {'measured MiB':>12} {'s per tensor':>13} {'GB/s':>8} {'x limit':>8}")
    for name, t, mb in rows:
        print(f"{name:<20} {mb:>12} {t:>13.3f} {gbs(t):>8.2f} {t_copy / t:>8.3f}")
    best_name, best = ("fused (numba)", t_fused) if t_fused and t_fused < t_lut else ("lut round trip", t_lut)
    ratio = t_copy / best
    print(f"goal: {best_name} >= {GOAL}x the copy: {'met' if ratio >= GOAL else 'NOT met'} ({ratio:.3f}x); "
          f"vs one bf16 arithmetic pass (x*s): {t_mul / best:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
