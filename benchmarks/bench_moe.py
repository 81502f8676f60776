"""Benchmark of MoE routing capture (issue 20, "Performance"; docs/moe.md).

Run: ``python benchmarks/bench_moe.py`` (a minute or two on 2 cores; ``--tokens N``,
``--prompts N``). Every figure is a ratio to a reference measured in the same run, on the tiny
Mixtral (``mixtral-moe``: 3 layers, 8 experts, top-2), HF BF16, prompts of 16 tokens + ``--tokens``
decode steps:

1. Time: plain generation of the same tokens (prefill + one decode forward per token with a cache,
   no hooks: what the engine runs anyway) against
   (a) routing capture in memory (hooks on every router cloning its logits,
       ``extractors.modules.capture_hf_modules`` with ``extractors.routing`` patterns), goal <= 1.5x;
   (b) routing capture into a store (``capture_hf_module_run``: hooks + a Zarr write per router and
       step), goal <= 3x (per-write overhead shows on a model whose forward is ~ms).
2. Memory per token: what routing capture adds per token position, stored (the router logits'
   bytes on disk over the positions captured) against its lower bound ``layers x experts x 2``
   bytes (BF16 logits uncompressed), and what the routing comparator holds per position until
   its verdict (three roles' logits as float64: ``layers x experts x 24`` bytes).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (run as a script)
from bench_modules import plain_forwards as plain_generation
from timing import best_of

ARCH, PROMPT_LEN = "mixtral-moe", 16


def main(n_tokens: int, n_prompts: int) -> int:
    import json

    import torch

    from capturestore import Store
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.modules import capture_hf_module_run, capture_hf_modules
    from extractors.routing import router_spec, routing_patterns

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    path = tiny_model(ARCH)
    cfg = json.loads((path / "config.json").read_text())
    _, n_exp, k = router_spec(cfg)
    layers = int(cfg["num_hidden_layers"])
    pats = list(routing_patterns(cfg))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 1000, size=PROMPT_LEN).tolist() for _ in range(n_prompts)]
    conts = [rng.integers(4, 1000, size=n_tokens + 1).tolist() for _ in range(n_prompts)]
    model = load_hf_model(path, "bfloat16")

    def over_prompts(fn):
        return lambda: [fn(p, c) for p, c in zip(prompts, conts)]

    over_prompts(lambda p, c: plain_generation(model, p, c))()  # warm-up
    t_plain = best_of(over_prompts(lambda p, c: plain_generation(model, p, c)), 3)
    kept = []
    t_hooks = best_of(over_prompts(lambda p, c: capture_hf_modules(model, p, c, lambda *a: kept.append(a[-1]), pats)), 3)
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(os.path.join(d, "s"))
        t_store = best_of(lambda: capture_hf_module_run(store, path, prompts, conts, pats, dtype="bfloat16",
                                                        model=model), 1)
        arrays = os.path.join(d, "s", "arrays.zarr")
        routed = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(arrays) for f in fs
                     if "tensors" in r)
    positions = sum(PROMPT_LEN + n_tokens for _ in prompts)  # prefill + decode steps
    bound = layers * n_exp * 2
    rows = [
        (f"plain generation ({n_prompts} prompts x (1 prefill + {n_tokens} decode), BF16)", f"{t_plain:.3f} s", "1.00x", ""),
        (f"  (a) routing capture in memory ({len(pats)} pattern, {layers} routers)", f"{t_hooks:.3f} s",
         f"{t_hooks / t_plain:.2f}x", "<= 1.5x: " + ("met" if t_hooks / t_plain <= 1.5 else "MISSED")),
        ("  (b) routing capture into a store", f"{t_store:.3f} s", f"{t_store / t_plain:.2f}x",
         "<= 3x: " + ("met" if t_store / t_plain <= 3 else "MISSED")),
        (f"stored router logits per token position ({positions} positions)", f"{routed / positions:.0f} B",
         f"{routed / positions / bound:.2f}x", f"vs {bound} B = {layers} layers x {n_exp} experts x 2 B"),
        ("routing comparator memory per token position (3 roles, float64)", f"{layers * n_exp * 24} B", "", ""),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'measured':>10}  {'ratio':>7}  goal")
    for name, val, ratio, goal in rows:
        print(f"{name:<{w}}  {val:>10}  {ratio:>7}  {goal}")
    print(f"(top-{k} of {n_exp} experts; machine load affects times, the ratios less; take the best of repeats)")
    return 0 if t_hooks / t_plain <= 1.5 and t_store / t_plain <= 3 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    a = ap.parse_args()
    sys.exit(main(a.tokens, a.prompts))
