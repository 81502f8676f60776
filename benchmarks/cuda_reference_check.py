"""Prepared check of the CUDA reference path (issue 18), for a machine with a CUDA GPU and torch +
transformers (vLLM not needed; the store part also needs the store's packages: zarr, numcodecs,
duckdb, pyarrow). Results: docs/references.md ("Devices").

Run: ``python benchmarks/cuda_reference_check.py [--device cuda:0] [--store] [--big] [--json F]``.

For every tiny architecture (``extractors.models.TINY_ARCHS``), FP32 and BF16, on the device:

1. streamed vs whole model, same device and dtype: teacher-forced logits + KV of each prompt
   alone and of the ragged prompts as one left-padded batch, greedy logits + KV, and every module
   tensor (inputs too) of a stepwise capture — max abs difference must be exactly 0;
2. on the device vs on the CPU, same dtype (FP32: TF32 off, ``extractors.hf.strict_fp32``): the
   max abs and max relative difference of logits and KV, and whether the greedy tokens agree
   (rounding only: figures);
3. FP32 with TF32 left on, for contrast: how much larger the device-CPU difference becomes.

``--store``: ``capturestore``'s main job (``pipeline.run``, target ``hf:bfloat16``, plugins
logits, kv and modules) with its references on the device, once with the whole model and once
streamed under a 1 MiB budget: every stored array of every run must be bit-identical between the
two, the runs' config must name the device and TF32 off, and the verdict must be PASS; the same
job with CPU references gives the stored device-CPU difference (figures).

``--big``: part 1-3 for the ~3.6B model of ``benchmarks/bench_streamed_reference.py`` (built there,
under ``.bench-tmp/``; the whole-model FP32 copy needs ~14 GB of device memory), streamed unit by
unit, and the wall time of all its captures streamed (a unit's tensors read by
``StreamedModel.readers`` threads, then by one) vs whole (the whole model's second run).

``--device cpu`` runs everything on the CPU (the device-CPU figures are then 0): a dry run of
this script where no GPU is. Each part is guarded: a part that fails prints its traceback and the
others still run. Exit status 1 if any streamed/whole pair is not bit-identical or a part failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPTS = [[1] + list(range(40, 61)), [1, 300, 301, 302, 303], [1] + list(range(500, 515))]
TEACHERS = [[700, 701, 702, 703, 704], [710, 711], [720, 721, 722, 723, 724, 725, 726, 727]]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time", "Numbers: 3 1 4 1 5 9 2 6 5 3 5"]
RESULTS: list[dict] = []


def say(**row):
    RESULTS.append(row)
    print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def _diff(a, b):
    """(max abs, max relative) difference of two tensors; NaN where both are NaN is ignored, NaN
    on one side only is an infinite difference."""
    import torch

    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    if a.shape != b.shape:
        return float("inf"), float("inf")
    both = a.isnan() & b.isnan()
    d = (a - b).abs().masked_fill(both, 0).nan_to_num(float("inf"))
    rel = (d / b.abs().clamp_min(1e-30)).masked_fill(both, 0)
    return float(d.max()) if d.numel() else 0.0, float(rel.max()) if rel.numel() else 0.0


def _flat(capture):
    """A capture as a flat list of tensors: (logits, {layer: (K, V)}) or the module collection."""
    if isinstance(capture, tuple) and len(capture) == 3:  # module capture: logits, order, {key: tensor}
        logits, _, got = capture
        return [logits] + [got[k] for k in sorted(got, key=str)]
    logits, kv = capture
    return [logits] + [kv[n][i] for n in kv for i in (0, 1)]


def _worst(a, b):
    out = [0.0, 0.0]
    for x, y in zip(a, b):
        fx, fy = _flat(x), _flat(y)
        if len(fx) != len(fy):
            return [float("inf"), float("inf")]
        for u, v in zip(fx, fy):
            d, r = _diff(u, v)
            out = [max(out[0], d), max(out[1], r)]
    return out


def _captures(model, sm=None, with_modules=True):
    """Teacher-forced per prompt, the ragged prompts as one left-padded batch, greedy per prompt,
    and (``with_modules``) the stepwise module capture (inputs too) per prompt."""
    from extractors.hf import extract_hf_kv_caches_teacher_forced, generate_hf_logits_and_kv
    from extractors.modules import capture_hf_modules
    from extractors.streamed import run_streamed

    m = sm.model if sm is not None else model

    def modules(p, t):
        got = {}
        logits, order = capture_hf_modules(m, p, t, lambda mod, ph, st, x: got.setdefault((mod, ph, st), x.cpu()),
                                           inputs=True)
        return logits.cpu(), order, got

    fns = [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(m, [p], [t], return_logits=True)
           for p, t in zip(PROMPTS, TEACHERS)]
    fns.append(lambda: extract_hf_kv_caches_teacher_forced(m, PROMPTS, TEACHERS, return_logits=True))
    fns += [lambda p=p: generate_hf_logits_and_kv(m, [p], 4) for p in PROMPTS]
    if with_modules:
        fns += [lambda p=p, t=t: modules(p, t) for p, t in zip(PROMPTS, TEACHERS)]
    return run_streamed(sm, fns) if sm is not None else [f() for f in fns]


GREEDY = slice(len(PROMPTS) + 1, 2 * len(PROMPTS) + 1)


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def check(path, device, label, timed=False, with_modules=True):
    import torch

    from extractors.hf import load_hf_model, strict_fp32
    from extractors.streamed import StreamedModel

    ok = True
    for dtype in ("float32", "bfloat16"):
        strict_fp32()
        t0 = time.perf_counter()
        whole = load_hf_model(path, dtype, device)
        _sync(device)
        t_load = time.perf_counter() - t0
        sm = StreamedModel(path, dtype, device)
        w = _captures(whole, with_modules=with_modules)
        _sync(device)
        t0 = time.perf_counter()
        w = _captures(whole, with_modules=with_modules)
        _sync(device)
        t_whole = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = _captures(None, sm, with_modules=with_modules)
        _sync(device)
        t_streamed = time.perf_counter() - t0
        d = _worst(w, s)
        extra = {}
        if timed:  # the same with one reading thread, for the readers' share
            passes, readers = sm.loads // max(1, len(sm.units)), sm.readers
            sm.readers = 1
            t0 = time.perf_counter()
            s1 = _captures(None, sm, with_modules=with_modules)
            _sync(device)
            extra = {"whole_load_s": f"{t_load:.2f}", "whole_s": f"{t_whole:.2f}",
                     f"streamed_{readers}_readers_s": f"{t_streamed:.2f}",
                     "streamed_1_reader_s": f"{time.perf_counter() - t0:.2f}", "weight_passes": passes}
            d1 = _worst(w, s1)
            d = [max(d[0], d1[0]), max(d[1], d1[1])]
            del s1
        same = d[0] == 0.0
        ok &= same
        say(model=label, dtype=dtype, device=device, check="streamed vs whole", max_abs=f"{d[0]:.3g}",
            result="bit-identical" if same else "NOT IDENTICAL", **extra)
        del sm
        if device != "cpu":
            cpu = load_hf_model(path, dtype, "cpu")
            ref = _captures(cpu, with_modules=with_modules)
            d = _worst(w, ref)
            tok = all(torch.equal(a[0].argmax(-1).cpu(), b[0].argmax(-1).cpu()) for a, b in zip(w[GREEDY], ref[GREEDY]))
            say(model=label, dtype=dtype, device=device, check=f"{device} (TF32 off) vs cpu" if dtype == "float32"
                else f"{device} vs cpu", max_abs=f"{d[0]:.3g}", max_rel=f"{d[1]:.3g}",
                greedy_tokens="agree" if tok else "DIFFER")
            if dtype == "float32":
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
                d = _worst(_captures(whole, with_modules=with_modules), ref)
                say(model=label, dtype=dtype, device=device, check=f"{device} with TF32 vs cpu (contrast only)",
                    max_abs=f"{d[0]:.3g}", max_rel=f"{d[1]:.3g}")
                strict_fp32()
            del cpu, ref
        del whole, w, s
        if device != "cpu":
            torch.cuda.empty_cache()
    return ok


def _same_bits(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _read(s, run_id, row):
    kind = row["kind"]
    if kind == "tokens":
        return s.read_tokens(run_id, row["prompt_id"])
    if kind == "logits":
        return s.read_logits(run_id, row["prompt_id"])
    if kind in ("kv_k", "kv_v"):
        kv = s.read_kv(run_id, row["prompt_id"])
        return kv[0 if kind == "kv_k" else 1]
    return s.read_tensor(run_id, row["prompt_id"], row["module"], phase=row["phase"])


def store_check(device) -> bool:
    """The main job with references on ``device``, whole and streamed: the same bits stored."""
    import numpy as np

    from capturestore import Store, pipeline
    from extractors.models import tiny_model

    model = tiny_model("llama-gqa", seed=3)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for name, dev, mem in (("whole", device, None), ("streamed", device, 1 / 1024), ("cpu", "cpu", None)):
            stores[name] = Path(tmp) / name
            lines = []
            r = pipeline.run(model, TEXTS, target="hf:bfloat16", num_tokens=4, store=stores[name],
                             plugins="logits,kv,modules", reference_device=dev, reference_memory=mem,
                             out=lines.append)
            said = [x for x in lines if "streamed (" in x]
            say(store=name, reference_device=dev, verdict="PASS" if r.passed else "FAIL",
                streamed_lines=len(said))
            ok &= bool(r.passed) and (len(said) > 0) == (name == "streamed")
        opened = {k: Store.open(v) for k, v in stores.items()}
        runs = {k: s.sql("SELECT run_id, device, config FROM runs ORDER BY committed_at").to_pylist()
                for k, s in opened.items()}
        ok &= len(runs["whole"]) == len(runs["streamed"]) == len(runs["cpu"])
        refs = 0
        for x in runs["whole"]:
            cfg = json.loads(x["config"])
            if cfg.get("reference_device") == device:
                refs += 1
                good = (cfg.get("cuda_matmul_allow_tf32") is False and cfg.get("cudnn_allow_tf32") is False
                        if device != "cpu" else True)
                say(run=x["run_id"][:8], reference_device=cfg["reference_device"], device_name=cfg.get("device_name"),
                    tf32_off=good)
                ok &= good
        ok &= refs >= 2
        n_arrays, worst_cpu = 0, 0.0
        for x, y, z in zip(runs["whole"], runs["streamed"], runs["cpu"]):
            a, b, c = opened["whole"], opened["streamed"], opened["cpu"]
            rows_x = sorted(a.captures(x["run_id"]).to_pylist(), key=lambda r: (r["prompt_id"], r["array_name"]))
            rows_y = sorted(b.captures(y["run_id"]).to_pylist(), key=lambda r: (r["prompt_id"], r["array_name"]))
            if [(r["prompt_id"], r["array_name"]) for r in rows_x] != [(r["prompt_id"], r["array_name"]) for r in rows_y]:
                say(run=x["run_id"][:8], result="DIFFERENT ARRAYS stored whole vs streamed")
                ok = False
                continue
            for r in rows_x:
                u, v = _read(a, x["run_id"], r), _read(b, y["run_id"], r)
                n_arrays += 1
                if not _same_bits(u, v):
                    say(run=x["run_id"][:8], array=f"{r['prompt_id'][:8]}/{r['array_name']}",
                        result="NOT IDENTICAL whole vs streamed")
                    ok = False
                if r["kind"] == "logits":
                    w = _read(c, z["run_id"], r)
                    worst_cpu = max(worst_cpu, float(np.nanmax(np.abs(np.asarray(u, np.float64) -
                                                                      np.asarray(w, np.float64)))))
        say(check="stored arrays, whole vs streamed", arrays=n_arrays, result="bit-identical" if ok else "DIFFER",
            stored_logits_vs_cpu_max_abs=f"{worst_cpu:.3g}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--store", action="store_true", help="also the main job with references on the device")
    ap.add_argument("--big", action="store_true", help="also the ~3.6B model of bench_streamed_reference.py")
    ap.add_argument("--big-shape", default="FULL", help=argparse.SUPPRESS)  # QUICK: a dry run of --big
    ap.add_argument("--json", help="write every result row to this JSON file")
    ap.add_argument("--archs", help="comma-separated tiny architectures to check (default all; '' none)")
    args = ap.parse_args()
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs one (--device cpu: a dry run)")
    import transformers

    from extractors.hf import device_name
    from extractors.models import TINY_ARCHS, tiny_model

    say(device=args.device, name=device_name(args.device), torch=torch.__version__,
        transformers=transformers.__version__)
    ok = True
    big_path = ROOT / ".bench-tmp" / f"streamed-llama-{args.big_shape.lower()}"
    t_build = time.perf_counter()
    build = None
    if args.big:  # written by a child process while the tiny models are checked
        import subprocess

        build = subprocess.Popen([sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:3]; "
                                  "import bench_streamed_reference as b; "
                                  "b.build_model(__import__('pathlib').Path(sys.argv[3]), getattr(b, sys.argv[4]))",
                                  str(ROOT / "benchmarks"), str(ROOT), str(big_path), args.big_shape])

    def part(name, fn):
        nonlocal ok
        t0 = time.perf_counter()
        try:
            good = fn()
        except Exception:
            traceback.print_exc()
            good = False
            say(part=name, result="FAILED (traceback above)")
        ok &= bool(good)
        say(part=name, seconds=f"{time.perf_counter() - t0:.1f}", ok=bool(good))
        if args.json:
            Path(args.json).write_text(json.dumps(RESULTS, indent=1))

    for arch in (TINY_ARCHS if args.archs is None else [a for a in args.archs.split(",") if a]):
        part(arch, lambda arch=arch: check(tiny_model(arch), args.device, arch))
    if args.store:
        part("store", lambda: store_check(args.device))
    if args.big:
        def big():
            if build.wait() != 0:
                raise RuntimeError(f"building {big_path} failed (exit {build.returncode})")
            say(model=big_path.name, built_s=f"{time.perf_counter() - t_build:.1f} (from the start, beside the rest)")
            # no module capture here: its stepwise decode is 8 passes over the weights, the rest 5
            return check(big_path, args.device, "llama-3.6b" if args.big_shape == "FULL" else args.big_shape,
                         timed=True, with_modules=False)

        part("big", big)
    say(result="all streamed references bit-identical, every part ran" if ok else "SOME PART FAILED OR DIFFERS")
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
