"""A store after a year of nightly CI: do its queries stay within 2x of a young store's (issue 24 §3)?

Every committed run adds three Parquet segments (prompts, captures, runs: the last is the commit
marker) and every comparison one segment per table it writes plus its comparisons row, and each
catalog view is a glob over its table's segments. This builds, through the public API
(``Store.begin_run``/``commit`` and ``integrity.commit_comparison``, the path ``compare_runs``
takes), an old store of --runs runs and --comparisons comparisons over one fixed prompt set, and a
young store of 10 comparisons (and the 20 runs they compare), and times the same queries on both:
the README's two queries, one comparison's metrics (what ``diff``/``report`` read), one run's
prompts, ``check_evidence`` of one comparison (what ``diff``/``report`` call first) and
``diff.history`` of the model's pass/fail (``capturestore history``). Ratio old/young, goal
<= 2x, printed beside each.

``diff`` and ``report`` themselves are not timed here (their comparisons need real captures
and comparator tables); the queries above are the reads they make of the catalog.
The old store is timed before and after ``capturestore compact`` (docs/compact.md); the ratios
against the 2x goal are the compacted ones. Each query is timed through Store.sql's explicit file
lists and, beside it, through the window form of the reader rule (catalog.duckdb's views, what
Store.sql used before). The stores compared are called in turn in each of --repeat rounds (best
of each), so the other load of a shared machine falls on both sides of a ratio alike. A second table (written before compact existed)
estimates it at the DuckDB level, on the two tables that grow most (runs: one segment a run;
kv_head_metrics: one a comparison): the same aggregate over today's glob of the old store's
segments, over the same segments through the reader rule of docs/compact.md (a window over one
scan; no merged segment yet: what every query would pay for compaction to be possible), and
over one merged segment of all their rows through that rule (the store after ``compact``), each
against today's glob of the young store.

A fresh process's first query (``Store.open`` and one query, what each CLI command pays; the
import of capturestore not counted) is timed on both stores after compaction, in a new process
per call, stores in turn, best of --repeat; ``--baseline DIR`` times it beside that with the
capturestore of another checkout (``PYTHONPATH=DIR``: the code before a change) in the same
rounds. ``--s3`` times instead one query a call on a store of three runs on a moto S3 server
(each listing one LIST request): Store.sql listing the tables the query's views read against
listing every table (what it did before), called in turn.

Usage: python benchmarks/bench_store_growth.py [--quick] [--year] [--runs N] [--comparisons N] [--dir DIR]
       [--baseline DIR] [--first-query-only] [--s3] [--as-ci-leaves-it]
The default (= --quick, what `make bench` runs) is 300 runs and 100 comparisons; --year is the
issue's year of nightly CI, 10,000 runs and 3,000 comparisons, in the stores a nightly CI leaves
(``--as-ci-leaves-it``: compacted after each night's 36 commits, and with automatic compaction;
not the store as written, whose every query opens ~40,000 segment files): ~25 min here, building
dominates (docs/compact.md, "A year of nightly CI").
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from timing import best_of, best_of_interleaved

GOAL = 2.0
PROMPTS = [[1 + p, 2 + p, 3 + p, 5 + p, 8 + p] for p in range(4)]  # the fixed prompt set of every night
LAYERS = 4


def build(root: Path, n_runs: int, n_cmp: int, compact_every: int = 0, auto: str = "0") -> list[str]:
    """A store of ``n_runs`` runs and ``n_cmp`` comparisons, each of two consecutive runs.
    ``compact_every``: ``capturestore compact`` after every that many commits (runs and
    comparisons), as a CI job that compacts after its nightly runs leaves a store. ``auto``:
    $CAPTURESTORE_AUTO_COMPACT while it builds ("0": as written; None: the default)."""
    import os

    saved = os.environ.get("CAPTURESTORE_AUTO_COMPACT")
    if auto is None:
        os.environ.pop("CAPTURESTORE_AUTO_COMPACT", None)
    else:
        os.environ["CAPTURESTORE_AUTO_COMPACT"] = auto
    try:
        return _build(root, n_runs, n_cmp, compact_every)
    finally:
        if saved is None:
            os.environ.pop("CAPTURESTORE_AUTO_COMPACT", None)
        else:
            os.environ["CAPTURESTORE_AUTO_COMPACT"] = saved


def _build(root: Path, n_runs: int, n_cmp: int, compact_every: int) -> list[str]:
    from capturestore import Store
    from capturestore.comparators import comparisons_schema
    from capturestore.comparators.base import (
        COMPARISONS_SCHEMA_VERSION,
        TableSpec,
        to_arrow,
    )
    from capturestore.comparators.kv import KVComparator
    from capturestore.integrity import commit_comparison

    store = Store.open(root)
    commits = [0]

    def committed():
        commits[0] += 1
        if compact_every and commits[0] % compact_every == 0:
            store.compact(grace_s=0)  # no reader runs while it builds: sources go at once

    runs = []
    for r in range(n_runs):
        with store.begin_run("vllm" if r % 2 else "hf", "tiny-llama", dtype="bfloat16",
                             release=f"nightly-{r // 2:05d}") as w:
            for toks in PROMPTS:
                w.add_prompt(toks)
        runs.append(w.run_id)
        committed()
    spec = KVComparator.tables["kv_head_metrics"]
    cspec = TableSpec(comparisons_schema([]), COMPARISONS_SCHEMA_VERSION)
    rng = np.random.default_rng(0)
    n_rows = len(PROMPTS) * LAYERS
    ids = []
    for c in range(n_cmp):
        cid = f"cmp-{c:05d}"
        expected, actual = runs[(2 * c) % n_runs], runs[(2 * c + 1) % n_runs]
        cols = {"comparison_id": [cid] * n_rows, "prompt_id": [f"p{i // LAYERS}" for i in range(n_rows)],
                "layer": [f"model.layers.{i % LAYERS}" for i in range(n_rows)],
                "layer_idx": np.arange(n_rows) % LAYERS, "gen_token_idx": np.zeros(n_rows, dtype=np.int64),
                "k_l2": rng.random(n_rows), "v_l2": rng.random(n_rows)}
        data = to_arrow([cols], spec, "kv_head_metrics")
        row = {"comparison_id": cid, "expected_run": expected, "actual_run": actual, "passed": bool(c % 7),
               "n_prompts": len(PROMPTS)}
        commit_comparison(store, cid, {"kv_head_metrics": data}, to_arrow([[row]], cspec, "comparisons"))
        ids.append(cid)
        committed()
    if compact_every:
        store.compact(grace_s=0)  # the night's last compaction
    return ids


def build_auto(base: Path, n_runs: int, n_cmp: int) -> None:
    """The young and old stores written with automatic compaction at its default (no compact
    called), as ``base / "young auto"`` and ``base / "old auto"``; prints their build time and files."""
    t = time.perf_counter()
    build(base / "young auto", 20, 10, auto=None)
    build(base / "old auto", n_runs, n_cmp, auto=None)
    print(f"the same two stores written with automatic compaction at its default (no compact called): built in "
          f"{time.perf_counter() - t:.1f} s; segment files: "
          + ", ".join(f"{w} {segment_count(base / w)}" for w in ("old auto", "young auto")))


def segment_count(root: Path) -> str:
    """Segment files of every table (schema segments not counted), and how many of them a query
    reads: merged segments not replaced and segments no merged segment covers (the others wait
    for the grace to pass before a later compaction removes them)."""
    from capturestore import Store
    from capturestore.catalog import segment_files
    from capturestore.tables import SCHEMA_SEGMENT

    b = Store.open(root, create=False).backend
    files = sum(len([n for n in b.segment_names(t) if n != SCHEMA_SEGMENT]) for t in b.table_names())
    read = sum(len([n for n in f.files if n != SCHEMA_SEGMENT]) for f in segment_files(b).values())
    return f"{files} ({read} read by a query)"


def queries(cid: str) -> dict[str, str]:
    return {
        "README: runs": "SELECT run_id, engine, dtype, release FROM runs",
        "README: kv per layer": "SELECT layer, max(k_l2), max(v_l2) FROM kv_head_metrics GROUP BY layer",
        "one comparison's metrics (diff/report)": f"SELECT * FROM kv_head_metrics WHERE comparison_id = '{cid}'",
        "one run's prompts (show)": None,  # filled in by main: needs a run id of that store
    }


def calls(root: Path, cid: str, window: bool = False) -> dict[str, object]:
    """{query: a call of it} on the store at ``root`` (views built, files cached). ``window``: the
    store's views in the window form of the reader rule (catalog.duckdb's) instead of Store.sql's
    explicit file lists: the form Store.sql used before, timed beside it."""
    from capturestore import Store, catalog
    from capturestore.diff import history

    store = Store.open(root, create=False)
    if window:  # this Store's views are built without the listing: the glob and its window
        add_views = catalog.add_views
        real_sql = store.sql

        def sql(query, params=None):
            catalog.add_views = lambda con, where, names, relative=False, files=None: add_views(con, where, names, relative)
            try:
                return real_sql(query, params)
            finally:
                catalog.add_views = add_views

        store.sql = sql
    run_id = store.sql("SELECT max(run_id) AS r FROM runs").column("r")[0].as_py()
    out = {}
    for name, q in queries(cid).items():
        q = q or f"SELECT prompt_id, n_prompt_tokens FROM prompts WHERE run_id = '{run_id}'"
        out[name] = lambda q=q: store.sql(q)
    out["check_evidence (diff/report, first)"] = lambda: store.check_evidence([cid])
    out["diff.history (capturestore history)"] = lambda: history(store, "tiny-llama", "passed")
    assert out["diff.history (capturestore history)"]().num_rows > 0
    for f in out.values():
        f()  # views built, files cached
    return out


def interleaved(stores: dict[str, dict[str, object]], repeat: int) -> dict[str, dict[str, float]]:
    """{store: {query: best of ``repeat``}}, each round calling every store's query in turn: on a
    machine shared with other load the stores compared see the same moments of it."""
    best = {k: {q: float("inf") for q in v} for k, v in stores.items()}
    for _ in range(repeat):
        for q in next(iter(stores.values())):
            for k, fns in stores.items():
                best[k][q] = min(best[k][q], best_of(fns[q], 1))
    return best


RULE = ("SELECT * EXCLUDE (__capturestore_source, filename, __s, __covered) FROM ("
        "SELECT *, coalesce(__capturestore_source, parse_filename(filename)) AS __s, "
        "bool_or(__capturestore_source IS NOT NULL) OVER (PARTITION BY __s) AS __covered FROM ("
        "SELECT NULL::VARCHAR AS __capturestore_source WHERE false UNION ALL BY NAME "
        "SELECT * FROM read_parquet('{glob}', union_by_name = true, filename = true))) "
        "WHERE __capturestore_source IS NOT NULL OR NOT __covered")
PLAIN = "SELECT * FROM read_parquet('{glob}', union_by_name = true)"
AGGREGATES = {"runs": "SELECT engine, count(*) FROM ({src}) GROUP BY engine",
              "kv_head_metrics": "SELECT layer, max(k_l2), max(v_l2) FROM ({src}) GROUP BY layer"}


def merged_copy(tables: Path, table: str, out: Path) -> Path:
    """One segment of every row of ``table``, each with its source's file name (docs/compact.md)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from capturestore.tables import read_checked

    parts = []
    for f in sorted((tables / table).glob("*.parquet")):
        t = read_checked(f)  # page CRCs checked, as every read of a segment in the project
        parts.append(t.append_column("__capturestore_source", pa.array([f.name] * t.num_rows, pa.string())))
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.concat_tables(parts, promote_options="default"), out / "compacted-0.parquet")
    return out


def compaction_estimate(base: Path, repeat: int) -> bool:
    import duckdb

    con = duckdb.connect()
    print(f"\n{'DuckDB level, per table':50s} {'s':>9s} {'young s':>9s} {'ratio':>7s} {'goal':>6s}")
    missed = False
    for table, agg in AGGREGATES.items():
        old_glob = base / "old" / "tables" / table / "*.parquet"
        merged = merged_copy(base / "old" / "tables", table, base / "merged" / table) / "*.parquet"
        yq = agg.format(src=PLAIN.format(glob=base / "young" / "tables" / table / "*.parquet"))
        young = best_of(lambda q=yq: con.sql(q).fetchall(), repeat)
        for what, q, goal in (
                # the store as written, before compaction: the cost compaction exists to remove, so
                # no goal, as in the query table's "not compacted" column (the 2x goal is the compacted store's)
                ("today's glob", agg.format(src=PLAIN.format(glob=old_glob)), None),
                ("reader rule, not compacted", agg.format(src=RULE.format(glob=old_glob)), None),
                ("reader rule, one merged segment", agg.format(src=RULE.format(glob=merged)), GOAL)):
            # max and count: exact whatever the order, so the rule must give today's answer
            assert sorted(con.sql(q).fetchall()) == sorted(con.sql(agg.format(src=PLAIN.format(glob=old_glob))).fetchall()), \
                f"{table}: {what} answers differently from the segments it replaces"
            t = best_of(lambda q=q: con.sql(q).fetchall(), repeat)
            r = t / young
            miss = goal is not None and r > goal
            missed |= miss
            print(f"{table + ': ' + what:50s} {t:9.4f} {young:9.4f} {r:7.2f} "
                  f"{'-' if goal is None else f'{goal:.1f}':>6s}{'  MISSED' if miss else ''}")
    print("limit: today's glob over the young store's segments of the same table; today's glob of the old store is "
          "the store as written (no goal: what compaction removes; the 2x goal is the compacted store's), the "
          "not-compacted rule row what compaction's reader rule costs before any compaction (no goal)")
    return missed


FIRST_QUERY = """
import sys, time
from capturestore import Store
t, c = time.perf_counter(), time.process_time()
Store.open(sys.argv[1], create=False).sql(sys.argv[2])
print(time.perf_counter() - t, time.process_time() - c)
"""


def first_queries(stores: dict[str, Path], codes: dict[str, str], query: str, repeat: int,
                  cpu: bool = False) -> dict[tuple, float]:
    """{(code, store): best of ``repeat``} seconds of Store.open and ``query`` in a fresh process
    (import not counted), each round calling every code on every store in turn. ``cpu``: the
    process's CPU time (every thread's) instead of the wall time: less moved by a loaded machine."""
    import os
    import subprocess

    best = {(c, k): float("inf") for c in codes for k in stores}
    for _ in range(repeat):
        for c, path in codes.items():
            for k, root in stores.items():
                env = {**os.environ, "PYTHONPATH": path}
                out = subprocess.run([sys.executable, "-c", FIRST_QUERY, str(root), query], env=env, check=True,
                                     capture_output=True, text=True).stdout
                best[(c, k)] = min(best[(c, k)], float(out.split()[-1 if cpu else -2]))
    return best


def print_first_queries(base: Path, baseline: str | None, repeat: int) -> None:
    codes = {"this checkout": str(REPO)} | ({"baseline": baseline} if baseline else {})
    for query in ("SELECT run_id, engine, dtype, release FROM runs",
                  "SELECT layer, max(k_l2), max(v_l2) FROM kv_head_metrics GROUP BY layer"):
        # CPU time: on a loaded 2-core machine the wall time of a fresh process flipped this ratio between runs
        got = first_queries({"young": base / "young", "old": base / "old"}, codes, query, repeat, cpu=True)
        print(f"\nfresh process, Store.open + `{query}`, CPU time (best of {repeat}, in turn):")
        for c in codes:
            print(f"  {c:14s} young {got[(c, 'young')] * 1e3:7.1f} ms  old {got[(c, 'old')] * 1e3:7.1f} ms  "
                  f"old/young {got[(c, 'old')] / got[(c, 'young')]:5.2f}")
        if baseline:
            print(f"  this checkout / baseline: young {got[('this checkout', 'young')] / got[('baseline', 'young')]:.2f}, "
                  f"old {got[('this checkout', 'old')] / got[('baseline', 'old')]:.2f}")


def footer_sizes(root: Path) -> str:
    """Bytes of the visible merged segments' footers of the runs and kv_head_metrics tables (the
    per-source entries grow with every run and comparison merged: docs/compact.md)."""
    from capturestore import Store
    from capturestore.compaction import merged_segments
    from capturestore.footer import footer_bytes
    from capturestore.layout import TABLES_DIR

    b = Store.open(root, create=False).backend
    out = []
    for t in ("runs", "kv_head_metrics"):
        merged, _ = merged_segments(b, t)
        sizes = [len(footer_bytes(b.read(f"{TABLES_DIR}/{t}/{m.name}"))) for m in merged]
        out.append(f"{t} {len(merged)} merged, footers {sum(sizes) / 1e6:.2f} MB "
                   f"({sum(len(m.sources) for m in merged)} sources)")
    return "; ".join(out)


def as_ci_leaves_it(base: Path, n_runs: int, n_cmp: int, every: int, repeat: int) -> int:
    """The stores a nightly CI leaves after ``n_runs`` runs and ``n_cmp`` comparisons: compacted
    after every ``every`` commits (a night), and written with automatic compaction and no compact
    called, each against a young store of 10 comparisons written the same way; the six queries
    and a fresh process's first query. No store as written: at a year's size each of its queries
    opens tens of thousands of segment files (that store's cost is what compact removes; the
    default size measures it)."""
    t = time.perf_counter()
    young_ids = build(base / "young", 20, 10, every)
    old_ids = build(base / "old", n_runs, n_cmp, every)
    took = time.perf_counter() - t
    print(f"old store: {n_runs} runs x {len(PROMPTS)} prompts, {n_cmp} comparisons, compacted after every {every} "
          f"commits (a night) as it grew; young store: 20 runs, 10 comparisons, the same; built in {took:.1f} s; "
          f"segment files: old {segment_count(base / 'old')}, young {segment_count(base / 'young')}")
    print(f"  old store's merged segments: {footer_sizes(base / 'old')}")
    build_auto(base, n_runs, n_cmp)
    ycid, ocid = young_ids[5], old_ids[len(old_ids) // 2]
    comp = interleaved({"young": calls(base / "young", ycid), "old": calls(base / "old", ocid),
                        "young window": calls(base / "young", ycid, True),
                        "old window": calls(base / "old", ocid, True),
                        "young auto": calls(base / "young auto", ycid),
                        "old auto": calls(base / "old auto", ocid)}, repeat)
    young, old = comp["young"], comp["old"]
    missed = False
    print(f"\n{'query':40s} {'old s':>9s} {'young s':>9s} {'ratio':>7s} {'goal':>6s} {'window':>7s} {'auto':>6s}")
    for name in old:
        r = old[name] / young[name]
        missed |= r > GOAL
        print(f"{name:40s} {old[name]:9.4f} {young[name]:9.4f} {r:7.2f} {GOAL:6.1f} "
              f"{comp['old window'][name] / comp['young window'][name]:7.2f} "
              f"{comp['old auto'][name] / comp['young auto'][name]:6.2f}{'  MISSED' if r > GOAL else ''}")
    print("ratio: the old store over the young one, both compacted every night as written, Store.sql's explicit "
          "file lists; window: the same through the window form of the reader rule (catalog.duckdb's views); auto: "
          "both written with automatic compaction, no compact called (no goal); best of --repeat, the stores "
          "compared called in turn in each round")
    print_first_queries(base, None, repeat)
    shutil.rmtree(base, ignore_errors=True)
    return 1 if missed else 0


def s3_requests(store, query: str) -> dict[str, int]:
    """{S3 operation: count} of one ``store.sql(query)`` (s3fs's requests, DuckDB's reads included:
    it reads through the same filesystem)."""
    from collections import Counter

    fs = store.backend.fs
    counts: Counter = Counter()
    real = fs._call_s3

    async def counted(method, *args, **kw):
        counts[getattr(method, "__name__", str(method))] += 1
        return await real(method, *args, **kw)

    fs._call_s3 = counted
    try:
        store.sql(query)
    finally:
        del fs._call_s3
    return dict(counts)


def s3_queries(repeat: int) -> None:
    """Per-query time of Store.sql on a store of three runs on a moto S3 server: listing the
    tables the query's views read against listing every table (as before)."""
    import os

    from capturestore import Store

    sys.path.insert(0, str(REPO))
    from tests.capturestore.s3server import _moto_server, make_bucket

    with _moto_server({}) as endpoint:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing-secret",
                          AWS_REGION="us-east-1")
        url = f"s3://{make_bucket()}/store"
        store = Store.open(url)
        for r in range(3):
            with store.begin_run("hf", "tiny-llama", dtype="bfloat16", release=f"nightly-{r}") as w:
                for toks in PROMPTS[:2]:
                    w.add_prompt(toks)
        every = Store.open(url, create=False)
        # every table listed, as Store.sql did before (its path when the parse tree cannot tell)
        every._query_tables = lambda query: setattr(every, "_con_tables", every.backend.listdir("tables"))
        named = Store.open(url, create=False)
        print(f"\nS3 (moto at {endpoint}), store of 3 runs, tables {', '.join(named.backend.table_names())}; "
              f"one query a call, views built, best of {repeat}, in turn:")
        for q in ("SELECT run_id, engine, dtype, release FROM runs", "SELECT count(*) FROM prompts"):
            assert every.sql(q).to_pylist() == named.sql(q).to_pylist()
            got = best_of_interleaved({"every": lambda q=q: every.sql(q), "named": lambda q=q: named.sql(q)}, repeat)
            reqs = {k: s3_requests(st, q) for k, st in (("every", every), ("named", named))}
            print(f"  {q:50s} every table {got['every']:.3f} s, the query's tables {got['named']:.3f} s "
                  f"({got['named'] / got['every']:.2f}x); S3 requests " + ", ".join(
                      f"{k}: " + " ".join(f"{op} {n}" for op, n in sorted(v.items())) for k, v in reqs.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default size (300 runs, 100 comparisons)")
    ap.add_argument("--year", action="store_true",
                    help="10,000 runs and 3,000 comparisons, the stores a year of nightly CI leaves: compacted after "
                         "each night's commits, and with automatic compaction (--as-ci-leaves-it); a night is "
                         "--compact-every commits (default here 36: 27 runs and 8 comparisons)")
    ap.add_argument("--as-ci-leaves-it", action="store_true",
                    help="only the nightly-compacted and the automatically compacted stores, their queries and "
                         "first queries (not the store as written, whose 3 segments a commit a query opens one by "
                         "one: at a year's size minutes a query)")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--comparisons", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--compact-every", type=int, default=3,
                    help="the stores compacted as they grow: `compact` after every N commits (default 3: a night's "
                         "two runs and its comparison)")
    ap.add_argument("--dir", default=str(REPO / ".bench-tmp" / "store-growth"))
    ap.add_argument("--baseline", help="a checkout whose capturestore the first-query timing runs beside this one's")
    ap.add_argument("--first-query-only", action="store_true",
                    help="build, compact, and time only a fresh process's first query")
    ap.add_argument("--s3", action="store_true", help="only the per-query time on a moto S3 server")
    a = ap.parse_args()
    if a.s3:
        s3_queries(a.repeat)
        return 0
    n_runs, n_cmp = (10_000, 3_000) if a.year else (a.runs, a.comparisons)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    if a.year or a.as_ci_leaves_it:
        every = a.compact_every if a.compact_every != 3 or not a.year else round((n_runs + n_cmp) / 365)
        return as_ci_leaves_it(base, n_runs, n_cmp, every, a.repeat)
    t = time.perf_counter()
    young_ids = build(base / "young", 20, 10)
    old_ids = build(base / "old", n_runs, n_cmp)
    built = time.perf_counter() - t
    print(f"old store: {n_runs} runs x {len(PROMPTS)} prompts, {n_cmp} comparisons; young store: 20 runs, "
          f"10 comparisons; built in {built:.1f} s")
    t = time.perf_counter()
    build(base / "young nightly", 20, 10, a.compact_every)
    build(base / "old nightly", n_runs, n_cmp, a.compact_every)
    print(f"the same two stores compacted after every {a.compact_every} commits as they grow (tiers): built in "
          f"{time.perf_counter() - t:.1f} s; segment files (schema segments not counted): "
          + ", ".join(f"{w} {segment_count(base / w)}" for w in ("old nightly", "young nightly")))
    build_auto(base, n_runs, n_cmp)
    ycid, ocid = young_ids[5], old_ids[len(old_ids) // 2]
    if a.first_query_only:
        from capturestore import Store

        for which in ("old", "young"):
            Store.open(base / which, create=False).compact(grace_s=0)
        print_first_queries(base, a.baseline, a.repeat)
        shutil.rmtree(base, ignore_errors=True)
        return 0
    raw = interleaved({"young": calls(base / "young", ycid), "old": calls(base / "old", ocid),
                       "young window": calls(base / "young", ycid, True),
                       "old window": calls(base / "old", ocid, True)}, a.repeat)
    missed = compaction_estimate(base, a.repeat)  # reads the old store's segments as written
    from capturestore import Store

    for which in ("old", "young"):
        t = time.perf_counter()
        res = Store.open(base / which, create=False).compact(grace_s=0)  # no reader runs: the sources go at once
        took = time.perf_counter() - t
        before = sum(x.segments_before for x in res.tables)
        after = sum(x.segments_after for x in res.tables)
        print(f"capturestore compact on the {which} store: {before} segments -> {after}, {res.rows} rows merged, "
              f"{took:.1f} s")
    comp = interleaved({"young": calls(base / "young", ycid), "old": calls(base / "old", ocid),
                        "young window": calls(base / "young", ycid, True),
                        "old window": calls(base / "old", ocid, True),
                        "young nightly": calls(base / "young nightly", ycid),
                        "old nightly": calls(base / "old nightly", ocid),
                        "young auto": calls(base / "young auto", ycid),
                        "old auto": calls(base / "old auto", ocid)}, a.repeat)
    young, old = comp["young"], comp["old"]
    print(f"\n{'query':40s} {'old s':>9s} {'young s':>9s} {'ratio':>7s} {'goal':>6s} {'window':>7s} "
          f"{'nightly':>8s} {'auto':>6s} {'vs young as written':>20s} {'not compacted':>14s} {'window':>7s}")
    for name in old:
        r = old[name] / young[name]
        rn = comp["old nightly"][name] / comp["young nightly"][name]
        ra = comp["old auto"][name] / comp["young auto"][name]
        missed |= r > GOAL or rn > GOAL
        print(f"{name:40s} {old[name]:9.4f} {young[name]:9.4f} {r:7.2f} {GOAL:6.1f} "
              f"{comp['old window'][name] / comp['young window'][name]:7.2f} {rn:8.2f} {ra:6.2f} "
              f"{old[name] / raw['young'][name]:20.2f} {raw['old'][name] / raw['young'][name]:14.2f} "
              f"{raw['old window'][name] / raw['young window'][name]:7.2f}{'  MISSED' if max(r, rn) > GOAL else ''}")
    print("ratio: both stores after `compact`, Store.sql's explicit file lists; window: the same through the window "
          "form of the reader rule (catalog.duckdb's views); nightly: the two stores compacted after every "
          f"{a.compact_every} commits as they were written (merged segments merged again by tiers), explicit lists; "
          "auto: the two stores written with automatic compaction at its default, no compact called (no goal: "
          "up to that many segments per table stay as written); "
          "vs young as written: the compacted old store against "
          "the young store before its compaction (timed earlier); not compacted: both as written, and through the "
          "window. Limit: the same query on a store of 10 comparisons, same process, same disk; best of --repeat, "
          "the stores compared called in turn in each round")
    print_first_queries(base, a.baseline, a.repeat)
    for label, t in (("as written", raw), ("compacted", comp)):
        print(f"explicit lists / window, {label}: " + ", ".join(
            f"{w} {sum(t[w][q] for q in t[w]) / sum(t[w + ' window'][q] for q in t[w]):.2f}" for w in ("young", "old")))
    shutil.rmtree(base, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
