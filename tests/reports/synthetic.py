"""Small synthetic capture stores for report tests, written through the public Store API and
compared with the real ``compare_runs``: every number a report shows comes from real rows."""
from __future__ import annotations

import numpy as np

from capturestore import Store
from capturestore.analysis import compare_runs

XSS_PROMPTS = ("<script>alert(1)</script>", "\"><img src=x onerror=alert(1)>", "plain & simple 'quoted' text")


def add_runs(store: Store, *, n_prompts: int = 3, n_layers: int = 4, n_heads: int = 2, head_dim: int = 8,
             vocab: int = 64, n_gen: int = 6, bug_layer: int | None = None, texts=XSS_PROMPTS, seed: int = 0,
             model_hash: str = "synthetic-model", release: str = "r1") -> dict:
    """Baseline (FP32), expected and actual runs over the same prompts; the actual run's noise is
    the expected run's (a correct engine) except in ``bug_layer``'s KV and, with a bug, the logits.
    Returns {role: run_id}."""
    rng = np.random.default_rng(seed)
    layers = [f"model.layers.{i}.self_attn" for i in range(n_layers)]
    prompts = []
    for p in range(n_prompts):
        plen = 5 + 3 * p
        ids = rng.integers(0, vocab, plen + n_gen).astype(np.int32)
        seq = plen + n_gen
        base_logits = rng.normal(0, 3, (n_gen, vocab)).astype(np.float32)
        base_k = rng.normal(0, 1, (n_layers, n_heads, seq, head_dim)).astype(np.float32)
        base_v = rng.normal(0, 1, (n_layers, n_heads, seq, head_dim)).astype(np.float32)
        prompts.append((ids[:plen], ids[plen:], texts[p % len(texts)] if texts else None, base_logits, base_k, base_v))

    def noisy(x, scale):
        return (x + rng.normal(0, scale, x.shape)).astype(np.float32)

    runs = {}
    for role, dtype, engine in (("baseline", "float32", "hf"), ("expected", "bfloat16", "hf"),
                                ("actual", "bfloat16", "vllm")):
        with store.begin_run(engine=engine, model_path="/models/synthetic", model_hash=model_hash, dtype=dtype,
                             engine_version="0.0-test", release=release) as w:
            for ids, cont, text, lg, k, v in prompts:
                pid = w.add_prompt(ids, text=text, continuation=cont)
                if role == "baseline":
                    w.write_logits(pid, lg)
                    w.write_kv(pid, k, v, layer_names=layers)
                    continue
                bug = role == "actual" and bug_layer is not None
                w.write_logits(pid, noisy(lg, 0.3 if bug else 0.01))
                kk, vv = noisy(k, 0.01), noisy(v, 0.01)
                if bug:
                    kk[bug_layer:] = noisy(k[bug_layer:], 0.2)
                    vv[bug_layer:] = noisy(v[bug_layer:], 0.2)
                w.write_kv(pid, kk, vv, layer_names=layers)
            runs[role] = w.run_id
    return runs


def make_comparison(store: Store, label: str = "synthetic", **kw):
    runs = add_runs(store, **kw)
    return compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"],
                        baseline_run=runs["baseline"], label=label)
