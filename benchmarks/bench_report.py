"""Report rendering at scale: 200 prompts x 32 layers x 64 generated tokens.

A synthetic store is written through the public Store API (runs with their prompts through
``begin_run``; the metric tables of one three-way comparison through ``append_table``, its
``comparisons`` row last, with the columns of docs/tables.md): 64 prompt + 64 generated tokens per
prompt, 8 KV heads, so ``kv_head_metrics`` holds 200 x 128 x 32 x 8 = 6.6 M rows. Then
``reports.render_comparison`` renders it (best of --repeat), and where Playwright and Chromium
are installed the first page is opened headless from file:// (time until the verdict banner is
in the DOM).

Goals (issue 12): render < 10 s, whole output directory < 50 MB, first page usable < 2 s.
Exit status 1 when a goal is missed.

Usage: python benchmarks/bench_report.py [--prompts 200] [--layers 32] [--gen 64] [--repeat 2] [--dir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOALS = {"render_s": 10.0, "total_mb": 50.0, "first_page_s": 2.0}


def build_store(root: Path, n_prompts: int, n_layers: int, n_gen: int, n_prompt_tokens: int = 64,
                n_heads: int = 8, seed: int = 0) -> str:
    from capturestore import Store
    from capturestore.integrity import PendingLock

    rng = np.random.default_rng(seed)
    store = Store.open(root)
    prompts = [rng.integers(0, 1000, n_prompt_tokens + n_gen).astype(np.int32) for _ in range(n_prompts)]
    runs = {}
    for role, dtype, engine in (("baseline", "float32", "hf"), ("expected", "bfloat16", "hf"),
                                ("actual", "bfloat16", "vllm")):
        with store.begin_run(engine=engine, model_path="/models/bench", model_hash="bench-model", dtype=dtype,
                             engine_version="bench", release="bench") as w:
            pids = [w.add_prompt(p[:n_prompt_tokens], text=f"synthetic prompt {i}: <b>not bold</b>",
                                 continuation=p[n_prompt_tokens:]) for i, p in enumerate(prompts)]
            runs[role] = w.run_id
    cid = "cmp-bench-report"
    # a comparison's rows are written under its pending lock, the comparisons row last (as compare_runs does)
    lock = PendingLock(store.root, cid, {"comparison_id": cid, "status": "running"})
    try:
        _write_metrics(store, cid, runs, pids, rng, n_prompts, n_layers, n_gen, n_prompt_tokens, n_heads)
    finally:
        lock.release()
    return cid


def _write_metrics(store, cid, runs, pids, rng, n_prompts, n_layers, n_gen, n_prompt_tokens, n_heads) -> None:
    layers = np.array([f"model.layers.{i}.self_attn.attn" for i in range(n_layers)], dtype=object)
    seq = n_prompt_tokens + n_gen
    pid_arr = np.array(pids, dtype=object)

    # logit_token_metrics: prompt x generation token
    P, G = np.meshgrid(np.arange(n_prompts), np.arange(n_gen), indexing="ij")
    n = P.size
    noise = rng.lognormal(-4.5, 0.3, n)
    ratio = rng.lognormal(0.0, 0.1, n)
    div = rng.random(n) < 0.02
    store.append_table("logit_token_metrics", pa.table({
        "comparison_id": np.full(n, cid, dtype=object), "prompt_id": pid_arr[P.ravel()], "gen_token_idx": G.ravel(),
        "position": G.ravel() + n_prompt_tokens, "status": np.where(div, "ACCEPTABLE_DIVERGENCE", "MATCHED").astype(object),
        "passed": np.ones(n, bool), "divergence": div, "expected_token": rng.integers(0, 1000, n),
        "actual_token": rng.integers(0, 1000, n), "teacher_token": rng.integers(0, 1000, n), "shift": rng.normal(0, 1e-3, n),
        "topk_5_error": noise, "topk_50_error": noise * 1.2, "topk_1000_error": noise * 1.4, "topk_all_error": noise * 1.5,
        "base_linf": noise, "tgt_linf": noise * ratio, "base_l2": noise / 3, "tgt_l2": noise * ratio / 3,
        "linf_ratio": ratio, "l2_ratio": ratio, "bc": 1 - rng.lognormal(-5, 0.5, n),
    }))
    # kv_head_metrics: prompt x position x layer x head, one segment per prompt as a comparator writes
    for p in range(n_prompts):
        S, L, H = np.meshgrid(np.arange(seq), np.arange(n_layers), np.arange(n_heads), indexing="ij")
        m = S.size
        base = rng.lognormal(-4.5, 0.3, (4, m))
        r = rng.lognormal(0.0, 0.1, (4, m))
        store.append_table("kv_head_metrics", pa.table({
            "comparison_id": np.full(m, cid, dtype=object), "prompt_id": np.full(m, pids[p], dtype=object),
            "position": S.ravel(), "gen_token_idx": S.ravel() - n_prompt_tokens,
            "phase": np.where(S.ravel() < n_prompt_tokens, "prefill", "decode").astype(object),
            "layer": layers[L.ravel()], "head": H.ravel(), "k_cos": 1 - base[0] ** 2, "v_cos": 1 - base[1] ** 2,
            "k_linf": base[0] * r[0], "v_linf": base[1] * r[1], "k_l2": base[2] * r[2], "v_l2": base[3] * r[3],
            "base_k_linf": base[0], "base_v_linf": base[1], "base_k_l2": base[2], "base_v_l2": base[3],
        }))
    S, L, P = np.meshgrid(np.arange(seq), np.arange(n_layers), np.arange(n_prompts), indexing="ij")
    m = S.size
    store.append_table("kv_token_bc", pa.table({
        "comparison_id": np.full(m, cid, dtype=object), "prompt_id": pid_arr[P.ravel()], "position": S.ravel(),
        "gen_token_idx": S.ravel() - n_prompt_tokens, "layer": layers[L.ravel()],
        "k_bc": 1 - rng.lognormal(-3, 0.5, m), "v_bc": 1 - rng.lognormal(-3, 0.5, m),
    }))
    G, L = np.meshgrid(np.arange(n_gen), np.arange(n_layers), indexing="ij")
    m = G.size
    store.append_table("kv_gen_bc", pa.table({
        "comparison_id": np.full(m, cid, dtype=object), "gen_token_idx": G.ravel(), "layer": layers[L.ravel()],
        "k_bc": 1 - rng.lognormal(-5, 0.5, m), "v_bc": 1 - rng.lognormal(-5, 0.5, m), "n_prompts": np.full(m, n_prompts),
    }))
    store.append_table("kv_layer_verdicts", pa.table({
        "comparison_id": np.full(n_layers, cid, dtype=object), "layer": layers, "passed": np.ones(n_layers, bool),
        "k_sigma_ratio": rng.lognormal(0, 0.05, n_layers), "k_bc": 1 - rng.lognormal(-6, 0.5, n_layers),
        "v_sigma_ratio": rng.lognormal(0, 0.05, n_layers), "v_bc": 1 - rng.lognormal(-6, 0.5, n_layers),
    }))
    store.append_table("comparisons", [{
        "comparison_id": cid, "label": "bench", "created_at": datetime.now(timezone.utc),
        "baseline_run": runs["baseline"], "expected_run": runs["expected"], "actual_run": runs["actual"],
        "three_way": True, "n_prompts": n_prompts, "models_differ": False, "passed": True, "logit_passed": True,
        "logit_decided_by": "sigma_ratio", "logit_sigma_ratio": 0.98, "logit_min_bc": 0.991,
        "logit_summary": "PASS: sigma-ratio 0.9800 <= 1.0", "kv_passed": True, "kv_first_failing_layer": None,
        "kv_summary": f"PASS: {n_layers} layers within the expected source's noise", "failure_phase": None,
        "first_failing_token": None,
    }])


def browser_seconds(index: Path, prompt_page: Path) -> tuple[float, float] | None:
    """(seconds from navigation until the verdict banner is in the DOM, seconds until the first
    figures of ``prompt_page`` are drawn; figures further down are drawn as they scroll into view),
    in headless Chromium; None when Playwright or Chromium is not installed."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path(chromium).is_file():
        return None
    import tempfile

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = ctx.new_page()
            page.goto("about:blank")
            t = time.perf_counter()
            page.goto(index.as_uri(), wait_until="domcontentloaded")
            page.wait_for_selector("#verdict-headline")
            first = time.perf_counter() - t
            t = time.perf_counter()
            page.goto(prompt_page.as_uri(), wait_until="load")
            page.wait_for_function("document.querySelectorAll('div.fig > .plot-container').length >= "
                                   "Math.min(2, document.querySelectorAll('div.fig').length)")
            return first, time.perf_counter() - t
        finally:
            ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=str(REPO / ".bench-tmp" / "bench_report"))
    args = ap.parse_args()
    import reports
    from capturestore import Store

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t = time.perf_counter()
    cid = build_store(work / "store", args.prompts, args.layers, args.gen)
    build_s = time.perf_counter() - t
    store = Store.open(work / "store", create=False)
    n_rows = store.sql(f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{cid}'").column(0)[0].as_py()
    best = float("inf")
    for i in range(args.repeat):
        out = work / f"report{i}"
        t = time.perf_counter()
        index = reports.render_comparison(Store.open(work / "store", create=False), cid, out)  # cold: a new Store
        best = min(best, time.perf_counter() - t)
    files = [p for p in out.rglob("*") if p.is_file()]
    total_mb = sum(p.stat().st_size for p in files) / 1e6
    pages = sorted((out / "prompts").glob("*.html"), key=lambda p: p.stat().st_size)
    timed = browser_seconds(index, pages[-1])
    first, prompt_s = timed if timed else (None, None)
    print(f"shape: {args.prompts} prompts x {args.layers} layers x {args.gen} generated tokens "
          f"(64 prompt tokens, 8 KV heads; kv_head_metrics {n_rows:,} rows; store built in {build_s:.1f} s)")
    rows = [
        ("render_comparison (best of %d)" % args.repeat, f"{best:.2f} s", f"< {GOALS['render_s']:.0f} s", best < GOALS["render_s"]),
        ("output directory total", f"{total_mb:.1f} MB ({len(files)} files)", f"< {GOALS['total_mb']:.0f} MB",
         total_mb < GOALS["total_mb"]),
        ("  index.html", f"{index.stat().st_size / 1e3:.0f} kB", "", None),
        ("  plotly.min.js", f"{(out / 'plotly.min.js').stat().st_size / 1e6:.1f} MB", "", None),
        ("  prompt page (largest)", f"{pages[-1].stat().st_size / 1e3:.0f} kB", "", None),
        ("first page usable (headless Chromium)", "n/a (no playwright/chromium)" if first is None else f"{first:.2f} s",
         f"< {GOALS['first_page_s']:.0f} s", None if first is None else first < GOALS["first_page_s"]),
        ("largest prompt page: first figures drawn", "n/a" if prompt_s is None else f"{prompt_s:.2f} s", "", None),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'figure':<{w0}}  {'measured':<{w1}}  {'goal':<7}  met")
    for name, val, goal, ok in rows:
        print(f"{name:<{w0}}  {val:<{w1}}  {goal:<7}  {'' if ok is None else 'yes' if ok else 'NO'}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
