"""Prepared check of the CUDA reference path (issue 18), for a machine with a CUDA GPU and torch +
transformers (vLLM not needed). Not run yet: the development machine has no GPU.

Run: ``python benchmarks/cuda_reference_check.py [--device cuda:0] [--big]``.

For every tiny architecture (``extractors.models.TINY_ARCHS``), FP32 and BF16, on the device:

1. streamed vs whole model, same device and dtype: teacher-forced logits + KV of a group of
   ragged prompts, greedy logits + KV, module tensors — max abs difference must be exactly 0;
2. FP32 on CUDA (TF32 off: ``extractors.hf.strict_fp32``) vs FP32 on CPU: the max abs and max
   relative difference of logits and KV, and whether the greedy tokens agree (rounding only: the
   figures go in docs/references.md);
3. TF32 left on, for contrast: how much larger the CUDA-CPU difference becomes.

``--big``: the same for the ~3B model of ``benchmarks/bench_streamed_reference.py`` (built there,
under ``.bench-tmp/``; the whole-model FP32 copy needs ~12 GB of GPU memory), streamed with a
2 GiB budget. Exit status 1 if any streamed/whole pair is not bit-identical.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [[1] + list(range(40, 61)), [1, 300, 301, 302, 303], [1] + list(range(500, 515))]
TEACHERS = [[700, 701, 702, 703, 704], [710, 711], [720, 721, 722, 723, 724, 725, 726, 727]]


def _diff(a, b):
    """(max abs, max relative) difference of two tensors, NaN where both are NaN ignored."""
    a, b = a.double().cpu(), b.double().cpu()
    both = a.isnan() & b.isnan()
    d = (a - b).abs().masked_fill(both, 0)
    rel = (d / b.abs().clamp_min(1e-30)).masked_fill(both, 0)
    return float(d.max()) if d.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0


def _captures(model, sm=None, prompts=PROMPTS, teachers=TEACHERS, greedy=4):
    from extractors.hf import extract_hf_kv_caches_teacher_forced, generate_hf_logits_and_kv
    from extractors.streamed import run_streamed

    m = sm.model if sm is not None else model
    fns = [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(m, [p], [t], return_logits=True)
           for p, t in zip(prompts, teachers)]
    fns += [lambda p=p: generate_hf_logits_and_kv(m, [p], greedy) for p in prompts]
    return run_streamed(sm, fns) if sm is not None else [f() for f in fns]


def _worst(a, b):
    out = [0.0, 0.0]
    for (la, kva), (lb, kvb) in zip(a, b):
        for x, y in [(la, lb)] + [(kva[n][i], kvb[n][i]) for n in kva for i in (0, 1)]:
            d, r = _diff(x, y)
            out = [max(out[0], d), max(out[1], r)]
    return out


def check(path, device, label, memory=None):
    import torch

    from extractors.hf import load_hf_model, strict_fp32
    from extractors.streamed import StreamedModel

    ok = True
    cpu32 = None
    for dtype in ("float32", "bfloat16"):
        strict_fp32()
        whole = load_hf_model(path, dtype, device)
        sm = StreamedModel(path, dtype, device)
        w, s = _captures(whole), _captures(None, sm)
        d = _worst(w, s)
        same = d[0] == 0.0
        ok &= same
        print(f"{label:16s} {dtype:9s} {device}: streamed vs whole max abs {d[0]:.3g} "
              f"{'(bit-identical)' if same else 'NOT IDENTICAL'}", flush=True)
        if dtype == "float32":
            cpu32 = _captures(load_hf_model(path, "float32", "cpu"))
            d = _worst(w, cpu32)
            tok_same = all(torch.equal(a[0].argmax(-1), b[0].argmax(-1)) for a, b in zip(w[3:], cpu32[3:]))
            print(f"{label:16s} float32   CUDA (no TF32) vs CPU: max abs {d[0]:.3g}, max rel {d[1]:.3g}; greedy "
                  f"tokens {'agree' if tok_same else 'DIFFER'}", flush=True)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            d = _worst(_captures(whole), cpu32)
            print(f"{label:16s} float32   CUDA with TF32 vs CPU: max abs {d[0]:.3g}, max rel {d[1]:.3g} "
                  f"(for contrast; references never use TF32)", flush=True)
            strict_fp32()
        del whole, sm
        torch.cuda.empty_cache()
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--big", action="store_true", help="also the ~3B model of bench_streamed_reference.py")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs one")
    from extractors.hf import device_name
    from extractors.models import TINY_ARCHS, tiny_model

    print(f"device {args.device}: {device_name(args.device)}; torch {torch.__version__}")
    ok = True
    for arch in TINY_ARCHS:
        ok &= check(tiny_model(arch), args.device, arch)
    if args.big:
        from bench_streamed_reference import FULL, build_model

        path = build_model(ROOT / ".bench-tmp" / "streamed-llama-3b", FULL)
        ok &= check(path, args.device, "llama-3b")
    print("all streamed references bit-identical" if ok else "SOME STREAMED REFERENCE DIFFERS")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
