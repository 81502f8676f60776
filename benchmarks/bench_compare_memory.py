"""The memory a comparison's client holds: rows written as they come (issue 19), single process and Dask.

A synthetic store is written through the public Store API: an FP32 baseline, its BF16 rounding
(expected) and a BF16 actual run (the baseline times 1 + 5e-4 noise), each with logits and KV of
every prompt (default 64 prompts x 8 layers x (32 prompt + 32 generated) positions, 2 KV heads x
32 head_dim). The comparison is three-way with ``raw_errors`` (its rows are the largest: four
float vectors per generated position and layer). Measured, with ``tracemalloc`` (Python and numpy
allocations of the measuring process; a Dask run measures the client only, its workers are
other processes):

- the peak during ``compare_runs`` in one process holding every prompt's rows until the end
  (``analysis.ROWS_HELD_PROMPTS`` = the number of prompts: how comparisons ran before);
- the same with rows written every ``ROWS_HELD_PROMPTS`` prompts (today's default);
- the client of a Dask ``LocalCluster`` (2 worker processes) with today's default.

Goals, printed beside each ratio: the Dask client below the single process holding every row
(ratio < 1), and the rows of at most ``ROWS_HELD_PROMPTS`` prompts held (the largest number of
prompts' rows held at once, counted by wrapping ``HeldRows``). What is held whatever the
batching: every comparator's partials (the KV verdict pools every prompt's raw errors), which
is the floor of all three figures. The exit status is 1 when a goal is missed.

Usage: python benchmarks/bench_compare_memory.py [--prompts 64] [--layers 8] [--gen 32] [--no-dask] [--dir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H, D, V = 2, 32, 256


def build(root: Path, n_prompts: int, n_layers: int, n_prompt: int, n_gen: int) -> dict:
    import ml_dtypes

    from capturestore import Store

    store = Store.open(root)
    rng = np.random.default_rng(0)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    prompts = [(rng.integers(1, V, n_prompt).tolist(), rng.integers(1, V, n_gen).tolist()) for _ in range(n_prompts)]
    runs = {}
    for role, dtype in (("baseline", "float32"), ("expected", "bfloat16"), ("actual", "bfloat16")):
        rng = np.random.default_rng(1)  # the same arrays for every role, then rounded / perturbed
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h", dtype=dtype) as run:
            for p, c in prompts:
                n = len(p) + len(c)
                k = rng.standard_normal((n_layers, H, n, D)).astype(np.float32)
                v = rng.standard_normal((n_layers, H, n, D)).astype(np.float32)
                lg = rng.standard_normal((len(c), V)).astype(np.float32)
                if role == "actual":
                    noise = np.random.default_rng(len(p)).standard_normal
                    k, v = k * (1 + 5e-4 * noise(k.shape)), v * (1 + 5e-4 * noise(v.shape))
                cast = (lambda x: x.astype(ml_dtypes.bfloat16)) if dtype == "bfloat16" else (lambda x: x)
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(k.astype(np.float32)), cast(v.astype(np.float32)), layer_names=layers)
                run.write_logits(pid, cast(lg))
        runs[f"{role}_run"] = run.run_id
    return runs


def measure(root: Path, runs: dict, held: int | None, client=None) -> tuple[float, int, int]:
    """(peak MiB during compare_runs, most prompts' rows held at once, rows written)."""
    from capturestore import Store, analysis

    most = [0]
    real_done = analysis.HeldRows.prompt_done

    def prompt_done(self):
        most[0] = max(most[0], self.held + 1)
        real_done(self)

    saved = analysis.ROWS_HELD_PROMPTS
    analysis.HeldRows.prompt_done = prompt_done
    if held is not None:
        analysis.ROWS_HELD_PROMPTS = held
    store = Store.open(root)
    try:
        tracemalloc.start()
        res = analysis.compare_runs(store, **runs, comparators=["raw_errors"], client=client)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        analysis.HeldRows.prompt_done = real_done
        analysis.ROWS_HELD_PROMPTS = saved
    n = store.sql("SELECT count(*) AS n FROM raw_errors WHERE comparison_id = ?",
                  params=[res.comparison_id]).column("n")[0].as_py()
    return peak / 2**20, most[0], n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--no-dask", action="store_true", help="single-process figures only")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    from capturestore import analysis

    tmp = args.dir or Path(tempfile.mkdtemp(prefix="bench-compare-memory-"))
    root = tmp / "store"
    try:
        runs = build(root, args.prompts, args.layers, args.prompt_tokens, args.gen)
        every, every_held, n_rows = measure(root, runs, held=args.prompts)
        batched, batched_held, _ = measure(root, runs, held=None)
        rows = [("single process, every prompt's rows held", every, every_held, "the reference")]
        rows.append((f"single process, rows written every {analysis.ROWS_HELD_PROMPTS} prompts", batched,
                     batched_held, f"ratio {batched / every:.2f}"))
        ok = batched_held <= analysis.ROWS_HELD_PROMPTS
        if not args.no_dask:
            from dask.distributed import Client, LocalCluster

            with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                    Client(cluster) as client:
                client_peak, client_held, _ = measure(root, runs, held=None, client=client)
            rows.append(("Dask client (2 worker processes)", client_peak, client_held,
                         f"ratio {client_peak / every:.2f}  goal < 1"))
            ok = ok and client_peak < every and client_held <= analysis.ROWS_HELD_PROMPTS
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"shape: {args.prompts} prompts x {args.layers} layers x ({args.prompt_tokens} + {args.gen}) positions, "
          f"{H} KV heads x {D}; raw_errors rows: {n_rows}")
    w = max(len(r[0]) for r in rows)
    print(f"{'run'.ljust(w)}  peak MiB  prompts' rows held (goal <= {analysis.ROWS_HELD_PROMPTS})  against the reference")
    for name, peak, held, note in rows:
        print(f"{name.ljust(w)}  {peak:8.1f}  {held:>42d}  {note}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
