"""Isolation on the tiny Llama: engine re-runs used and wall time against one plain module capture
of the same prompts, and tensor replacement's own overhead on a forward against the forward with
capture alone (goal <= 1.5x).

Run: ``PYTHONPATH=. python benchmarks/bench_isolate.py [--prompts 4] [--tokens 6] [--repeat 2]``.
Every ratio is against a limit measured in the same run (the machine's load moves the absolute
times; the ratios move less)."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from timing import best_of


def main(n_prompts: int, n_tokens: int, repeat: int) -> int:
    from capturestore import Store
    from capturestore.analysis import compare_runs
    from capturestore.isolate import isolate
    from extractors.hf import load_hf_model
    from extractors.hf_faults import install_hf_fault
    from extractors.models import tiny_model
    from extractors.modules import (
        DEFAULT_MODULES,
        capture_hf_module_run,
        collect_hf_modules,
    )
    from extractors.replace import collect_hf_replaced

    path = tiny_model("llama-gqa")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 1000, size=int(rng.integers(8, 16))).tolist() for _ in range(n_prompts)]
    conts = [rng.integers(4, 1000, size=n_tokens).tolist() for _ in range(n_prompts)]
    model = load_hf_model(path, "bfloat16")
    top = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"]
    src = [c for c, _, _ in collect_hf_replaced(model, prompts, conts, top, inputs=True)]

    t_cap = best_of(lambda: collect_hf_replaced(model, prompts, conts, top), repeat)
    t_rep = best_of(lambda: collect_hf_replaced(model, prompts, conts, top, replace_inputs=top, sources=src), repeat)
    t_plain = best_of(lambda: collect_hf_modules(model, prompts, conts, DEFAULT_MODULES), repeat)

    with tempfile.TemporaryDirectory() as d:
        store = Store.open(Path(d) / "s")
        base = capture_hf_module_run(store, path, prompts, conts, dtype="float32")
        exp = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16")
        faulty = load_hf_model(path, "bfloat16")
        install_hf_fault(faulty, "mlp", 2, 0.01)
        t0 = time.perf_counter()
        act = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", model=faulty)
        t_store_cap = time.perf_counter() - t0
        r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                         comparators=["modules"])
        t0 = time.perf_counter()
        res = isolate(store, r.comparison_id, target=faulty)
        t_iso = time.perf_counter() - t0

    rows = [
        ("limit: forward with capture alone (6 top-level modules)", f"{t_cap * 1e3:.0f} ms", "", ""),
        ("forward with those modules' inputs replaced + capture", f"{t_rep * 1e3:.0f} ms",
         f"{t_rep / t_cap:.2f}x limit", "goal <= 1.5x: " + ("met" if t_rep / t_cap <= 1.5 else "MISSED")),
        ("plain capture of every module (DEFAULT_MODULES), in memory", f"{t_plain * 1e3:.0f} ms", "", ""),
        ("limit: one plain module capture of the target into the store", f"{t_store_cap * 1e3:.0f} ms", "", ""),
        (f"isolate (1% MLP fault, layer 2): {res.localisation['module'] if res.localisation else res.status}",
         f"{t_iso * 1e3:.0f} ms", f"{t_iso / t_store_cap:.2f}x limit",
         f"{res.engine_reruns} engine + {res.reference_reruns} reference re-runs"),
    ]
    print(f"isolation, tiny llama-gqa (3 layers), {n_prompts} prompts x {n_tokens} tokens, best of {repeat}")
    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"  {r[0]:<{w}}  {r[1]:>10}  {r[2]:>14}  {r[3]}")
    return 0 if t_rep / t_cap <= 1.5 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    sys.exit(main(a.prompts, a.tokens, a.repeat))
