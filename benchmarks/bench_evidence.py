"""What the manifest guard of the catalog views costs a query (issue 17).

Every view of a table that comparisons write reads, besides the rows a query asks for, each
segment's file name and ``comparison_id`` against the manifests of committed comparisons, so that
a missing, cut short or copied segment fails the query instead of shrinking its answer. This
measures that price on a store of many committed comparisons (written through
``integrity.commit_comparison``, the path ``compare_runs`` takes), as the ratio of each query with
the guard to the same query over the same views without it (built in the same run), and the
``check_evidence`` call ``diff``/``report``/``aggregate`` make before reading (one query for the
manifests, a count through each guarded view, SHA-256 of the comparison's own segments) against
the unguarded query of one comparison.

Both also as the first call of a new process (a CLI command's: connection, views, footers and their
statistics read by that call), best of 3 processes each.

Usage: python benchmarks/bench_evidence.py [--quick] [--comparisons 200] [--rows 50000] [--dir DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from timing import best_of  # noqa: E402

GOAL_FILTERED, GOAL_ALL, GOAL_CHECK = 3.0, 3.0, 3.0


def build(root: Path, n_cmp: int, n_rows: int) -> list[str]:
    from capturestore import Store
    from capturestore.comparators.base import COMPARISONS_SCHEMA_VERSION, TableSpec, to_arrow
    from capturestore.comparators import comparisons_schema
    from capturestore.comparators.kv import KVComparator
    from capturestore.integrity import commit_comparison

    store = Store.open(root)
    spec = KVComparator.tables["kv_head_metrics"]
    rng = np.random.default_rng(0)
    ids = []
    for c in range(n_cmp):
        cid = f"cmp-bench-{c:05d}"
        cols = {f.name: None for f in spec.schema}
        cols.update(comparison_id=[cid] * n_rows, prompt_id=[f"p{i % 100}" for i in range(n_rows)],
                    layer=[f"model.layers.{i % 32}" for i in range(n_rows)], layer_idx=np.arange(n_rows) % 32,
                    gen_token_idx=np.arange(n_rows) // 3200, k_l2=rng.random(n_rows), v_l2=rng.random(n_rows))
        data = to_arrow([{k: v for k, v in cols.items() if v is not None}], spec, "kv_head_metrics")
        row = {"comparison_id": cid, "expected_run": "e", "actual_run": "a", "passed": True, "n_prompts": 100}
        cspec = TableSpec(comparisons_schema([]), COMPARISONS_SCHEMA_VERSION)
        commit_comparison(store, cid, {"kv_head_metrics": data}, to_arrow([[row]], cspec, "comparisons"))
        ids.append(cid)
    return ids


def child(root: Path, what: str, cid: str) -> None:
    """One call in this new process, as a CLI command makes it: no connection, view, footer or
    statistics read before. Prints its seconds. Libraries are loaded first, pandas too: pyarrow
    imports it (~150 ms here) on the first array or scalar made from Python values, which every
    command makes; the unguarded query alone makes none."""
    import duckdb  # noqa: F401
    import pandas  # noqa: F401

    from capturestore import Store, catalog

    store = Store.open(root)
    if what == "query":
        catalog._manifest_guard = lambda *args: "SELECT NULL::VARCHAR AS comparison_id WHERE false"
    t = time.perf_counter()
    if what == "query":
        store.sql(f"SELECT layer, max(k_l2) FROM kv_head_metrics WHERE comparison_id = '{cid}' GROUP BY layer")
    else:
        store.check_evidence([cid])
    print(time.perf_counter() - t)


def first_calls(root: Path, cid: str, rounds: int = 3) -> tuple[float, float]:
    """(check_evidence, unguarded query): each the best of ``rounds`` first calls in a new process,
    the two alternated."""
    import subprocess

    best = {"check": float("inf"), "query": float("inf")}
    for _ in range(rounds):
        for what in best:
            out = subprocess.run([sys.executable, __file__, "--dir", str(root), "--child", what, cid],
                                 capture_output=True, text=True, check=True).stdout
            best[what] = min(best[what], float(out.split()[-1]))
    return best["check"], best["query"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--comparisons", type=int, default=200)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--dir", default=str(REPO / ".bench-tmp" / "evidence"))
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "CID"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(Path(a.dir), *a.child)
        return 0
    n_cmp, n_rows = (20, 20_000) if a.quick else (a.comparisons, a.rows)
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    ids = build(root, n_cmp, n_rows)
    print(f"store: {n_cmp} comparisons x {n_rows} kv_head_metrics rows, built in {time.perf_counter() - t:.1f} s")

    from capturestore import Store, catalog

    guarded = Store.open(root)
    plain = Store.open(root)
    real = catalog._manifest_guard
    catalog._manifest_guard = lambda *args: "SELECT NULL::VARCHAR AS comparison_id WHERE false"
    try:
        plain.sql("SELECT 1 FROM kv_head_metrics LIMIT 1")  # its views built without the guard
    finally:
        catalog._manifest_guard = real
    cid = ids[len(ids) // 2]
    queries = {
        "one comparison, per layer": (f"SELECT layer, max(k_l2) FROM kv_head_metrics WHERE comparison_id = '{cid}' "
                                      f"GROUP BY layer", GOAL_FILTERED),
        "every comparison, per layer": ("SELECT layer, avg(k_l2) FROM kv_head_metrics GROUP BY layer", GOAL_ALL),
    }
    rows = []
    missed = False
    for name, (q, goal) in queries.items():
        g, p = guarded.sql(q).sort_by("layer"), plain.sql(q).sort_by("layer")
        assert g.column(0).equals(p.column(0)) and np.allclose(g.column(1).to_numpy(), p.column(1).to_numpy(),
                                                                rtol=1e-12), name  # avg: summation order varies
        tg = best_of(lambda: guarded.sql(q), 5)
        tp = best_of(lambda: plain.sql(q), 5)
        rows.append((name, tg, tp, tg / tp, goal))
        missed |= tg / tp > goal
    tc = best_of(lambda: guarded.check_evidence([cid]), 5)
    tr = rows[0][2]
    rows.append(("check_evidence (one comparison)", tc, tr, tc / tr, GOAL_CHECK))
    fc, fq = first_calls(root, cid)
    rows.append(("  first call in a new process", fc, fq, fc / fq, GOAL_CHECK))
    print(f"{'query':34s} {'guarded s':>10s} {'limit s':>10s} {'ratio':>7s} {'goal':>6s}")
    for name, tg, tp, r, goal in rows:
        print(f"{name:34s} {tg:10.4f} {tp:10.4f} {r:7.2f} {goal:6.1f}{'  MISSED' if r > goal else ''}")
    print("limit: the same query on views without the guard; for check_evidence (what diff/report/aggregate call "
          "first), the unguarded one-comparison query; a first call (a CLI command's) against the unguarded "
          "query's first call in a new process (connection, views and footers made by each)")
    return 1 if missed or tc / tr > GOAL_CHECK or fc / fq > GOAL_CHECK else 0


if __name__ == "__main__":
    sys.exit(main())
