"""Benchmark of module capture and module compare (issue 10, "Performance").

Run: ``python benchmarks/bench_modules.py`` (~1-2 min on 2 cores). Every figure is a ratio to a
reference measured in the same run, on the tiny 4-layer Gemma3 model (every module of
``extractors.modules.DEFAULT_MODULES``: 78 modules), one prompt of 16 tokens + 32 decode steps:

1. Capture time against the same step-by-step forwards without hooks (prefill + 32 decode
   forwards with a cache, ``torch.inference_mode``), FP32 and BF16:
   (a) hooks cloning every output into memory (``capture_hf_modules``), goal <= 1.5x;
   (b) into a store (``capture_hf_module_run``: hooks + one Zarr write per module and step),
   printed for what it is (a tiny model's forward is ~1 ms per step, so per-write overhead shows).
2. Peak RSS of a store capture in a fresh process, for 1 and for 8 prompts: bounded means the
   8-prompt peak is about the 1-prompt peak (tensors are written as they are produced).
3. Module compare (``metrics.modules.ModuleJudge``: per-token metrics, BC, pooled verdict) of
   8 prompts three-way against one numpy pass reading the same bytes (max of each array).
   The KV compare reaches >= 0.25x of its limit on large caches (bench_metrics.py); module
   tensors of a tiny model are [tokens, 128..1024] per module, so per-call overhead dominates.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (run as a script)
from timing import best_of  # noqa: E402

ARCH, PROMPT_LEN, DECODE_STEPS = "gemma3-sliding", 16, 32


def _tokens(n_prompts, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.integers(4, 1000, size=PROMPT_LEN).tolist() for _ in range(n_prompts)],
            [rng.integers(4, 1000, size=DECODE_STEPS + 1).tolist() for _ in range(n_prompts)])


def plain_forwards(model, prompt, cont):
    """The capture's forwards without hooks: prefill, then one decode forward per step."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), position_ids=torch.arange(len(prompt))[None], past_key_values=cache,
              use_cache=True)
        for n in range(len(cont) - 1):
            model(input_ids=torch.tensor([[cont[n]]]), position_ids=torch.tensor([[len(prompt) + n]]),
                  past_key_values=cache, use_cache=True)


def child_rss(n_prompts: int) -> None:
    """In a fresh process: RSS before and peak RSS after a store capture of n_prompts."""
    import torch  # noqa: F401  (imported before the baseline RSS is read)

    from capturestore import Store
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.modules import capture_hf_module_run

    path = tiny_model(ARCH)
    model = load_hf_model(path, "bfloat16")
    prompts, conts = _tokens(n_prompts)
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(os.path.join(d, "s"))
        capture_hf_module_run(store, path, prompts[:1], conts[:1], dtype="bfloat16", model=model)  # warm-up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", model=model)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stored = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    print(json.dumps({"before_mib": before / 1024, "peak_mib": peak / 1024, "stored_mib": stored / 2**20}))


def main() -> None:
    import torch

    from capturestore import Store
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.modules import DEFAULT_MODULES, capture_hf_module_run, capture_hf_modules, collect_hf_modules
    from metrics.modules import ModuleJudge

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    path = tiny_model(ARCH)
    prompts, conts = _tokens(8)
    rows = []
    for dtype in ("float32", "bfloat16"):
        model = load_hf_model(path, dtype)
        p, c = prompts[0], conts[0]
        plain_forwards(model, p, c)  # warm-up
        t_plain = best_of(lambda: plain_forwards(model, p, c), 5)
        kept = []
        t_hooks = best_of(lambda: (kept.clear(), capture_hf_modules(model, p, c, lambda *a: kept.append(a[-1]),
                                                                    DEFAULT_MODULES)), 5)
        with tempfile.TemporaryDirectory() as d:
            store = Store.open(os.path.join(d, "s"))
            t_store = best_of(lambda: capture_hf_module_run(store, path, [p], [c], dtype=dtype, model=model), 3)
        rows.append((f"plain forwards ({dtype}, 1 prefill + {DECODE_STEPS} decode)", f"{t_plain * 1e3:.1f} ms", "1.00x", ""))
        rows.append((f"  (a) capture_hf_modules, {len(kept)} clones in memory", f"{t_hooks * 1e3:.1f} ms",
                     f"{t_hooks / t_plain:.2f}x", "<= 1.5x"))
        rows.append(("  (b) capture_hf_module_run into a store", f"{t_store * 1e3:.1f} ms", f"{t_store / t_plain:.2f}x",
                     "(Zarr write per module x step)"))

    # 2. peak RSS, fresh processes
    rss = {}
    for n in (1, 8):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-rss", str(n)], capture_output=True,
                             text=True, check=True)
        rss[n] = json.loads(out.stdout.strip().splitlines()[-1])
    for n in (1, 8):
        r = rss[n]
        rows.append((f"store capture of {n} prompt(s): peak RSS", f"{r['peak_mib']:.0f} MiB",
                     f"+{r['peak_mib'] - r['before_mib']:.1f} MiB over warm", f"stored {r['stored_mib']:.1f} MiB"))
    rows.append(("  8 prompts vs 1 prompt peak RSS", "", f"{rss[8]['peak_mib'] / rss[1]['peak_mib']:.2f}x",
                 "bounded: ~1x"))

    # 3. compare throughput
    base, order = collect_hf_modules(load_hf_model(path, "float32"), prompts, conts)
    exp, _ = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts, conts)
    import transformers

    sdpa = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16,
                                                            attn_implementation="sdpa").eval()
    act, _ = collect_hf_modules(sdpa, prompts, conts)
    nbytes = sum(a.nbytes for caps in (base, exp, act) for d in caps for a in d.values())

    def limit():
        for caps in (base, exp, act):
            for d in caps:
                for a in d.values():
                    a.max()

    def judge():
        j = ModuleJudge()
        for i, (b, e, a) in enumerate(zip(base, exp, act)):
            for k in b:
                j.add(str(i), k[0], k[1], b[k], e[k], a[k])
        return j.verdict(order)

    t_limit = best_of(limit, 3)
    t_cmp = best_of(judge, 2)
    v = judge()
    rows.append((f"  limit: one numpy pass over the same {nbytes / 2**20:.1f} MiB", f"{t_limit * 1e3:.1f} ms",
                 f"{nbytes / 2**30 / t_limit:.2f} GiB/s", ""))
    rows.append((f"module compare 3-way, {len(v.modules)} module x phase, 8 prompts ({'PASS' if v.passed else 'FAIL'})",
                 f"{t_cmp * 1e3:.0f} ms", f"{t_limit / t_cmp:.3f}x limit", "KV compare: >= 0.25x on large caches"))

    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>10}  {r[2]:>22}  {r[3]}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child-rss":
        child_rss(int(sys.argv[2]))
    else:
        main()
