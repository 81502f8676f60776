"""A comparison is atomic: its comparisons row, written last, commits it. Rows of a comparison
that failed or was killed at any write are invisible in every view (library and catalog.duckdb),
reported by verify and removed by gc; a comparison still being written is never collected.
Real stores, real processes, real SIGKILLs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.layout import CATALOG_FILE
from capturestore.tables import write_segment
from tests.capturestore.conftest import REPO

COMPARE_SCRIPT = Path(__file__).with_name("compare_proc.py")
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
H, D, V = 2, 16, 64
# compare_runs' writes in three-way mode: five metric tables, then the comparisons row
N_WRITES = 6


def _write_run(store, dtype, kv, logits, prompts):
    with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype=dtype) as run:
        for (p, c), (k, v), lg in zip(prompts, kv, logits):
            pid = run.add_prompt(p, continuation=c)
            run.write_kv(pid, k, v, layer_names=LAYERS)
            run.write_logits(pid, lg)
    return run.run_id


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A store with an FP32 baseline, its BF16 rounding as expected and a perturbed actual run."""
    rng = np.random.default_rng(0)
    prompts = [(rng.integers(4, V, n).tolist(), rng.integers(4, V, 4).tolist()) for n in (5, 7)]
    kv = [(rng.standard_normal((2, H, len(p) + len(c), D)).astype(np.float32),
           rng.standard_normal((2, H, len(p) + len(c), D)).astype(np.float32)) for p, c in prompts]
    logits = [rng.standard_normal((len(c), V)).astype(np.float32) for _, c in prompts]
    bf = lambda x: x.astype(ml_dtypes.bfloat16)  # noqa: E731
    path = tmp_path_factory.mktemp("atomic") / "store"
    store = Store.open(path)
    base = _write_run(store, "float32", kv, logits, prompts)
    exp = _write_run(store, "bfloat16", [(bf(k), bf(v)) for k, v in kv], [bf(x) for x in logits], prompts)
    act = _write_run(store, "bfloat16", [(bf(k * 1.02), bf(v)) for k, v in kv], [bf(x) for x in logits], prompts)
    # the oracle: what one clean comparison stores, table by table
    clean = tmp_path_factory.mktemp("clean") / "store"
    shutil.copytree(path, clean)
    res = compare_runs(Store.open(clean), expected_run=exp, actual_run=act, baseline_run=base)
    counts = _rows_on_disk(clean, res.comparison_id)
    assert len(counts) == N_WRITES and counts["comparisons"] == 1, counts
    assert counts["kv_head_metrics"] == sum(2 * H * (len(p) + len(c)) for p, c in prompts)
    assert counts["logit_token_metrics"] == sum(len(c) for _, c in prompts)
    return {"path": path, "runs": (exp, act, base), "counts": counts}


def _rows_on_disk(root: Path, cid: str) -> dict[str, int]:
    """Rows of ``cid`` per table, read straight from the Parquet files (not through any view)."""
    out = {}
    for seg in sorted((root / "tables").glob("*/*.parquet")):
        try:
            t = pq.read_table(seg)
        except Exception:  # noqa: BLE001 - a segment a test truncated
            continue
        if "comparison_id" in t.column_names:
            n = t.column("comparison_id").to_pylist().count(cid)
            if n:
                out[seg.parent.name] = out.get(seg.parent.name, 0) + n
    return out


def _metric_tables(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tables").iterdir()
                  if p.is_dir() and p.name not in ("runs", "prompts", "captures") and any(p.glob("*.parquet")))


def _visible(store: Store) -> dict[str, int]:
    """Rows per comparison table through the library's views."""
    return {t: store.sql(f"SELECT count(*) AS n FROM {t}").column("n")[0].as_py() for t in _metric_tables(store.root)}


def _visible_in_catalog_file(root: Path) -> dict[str, int]:
    con = duckdb.connect(str(root / CATALOG_FILE), read_only=True)
    try:
        return {t: con.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in _metric_tables(root)}
    finally:
        con.close()


def _pending(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "pending").iterdir())


def _start(root: Path, runs, mode: str, n: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(COMPARE_SCRIPT), str(root), *runs, mode, str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env)


def test_a_compare_killed_at_each_write_is_invisible_reported_and_collected(prepared, tmp_path):
    copies = {}
    for n in range(N_WRITES + 1):  # killed before the first write, after each metric table, after the comparisons row
        copies[n] = tmp_path / f"kill{n}"
        shutil.copytree(prepared["path"], copies[n])
    procs = {n: _start(root, prepared["runs"], "kill", n) for n, root in copies.items()}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == -9, (n, out, err)
        assert out.count("wrote ") == n, (n, out, err)

    for n, root in copies.items():
        (pending,) = _pending(root)  # the writer died holding it
        cid = pending.removesuffix(".json")
        on_disk = _rows_on_disk(root, cid)
        assert len(on_disk) == n, (n, on_disk)
        store = Store.open(root)
        report = store.verify()
        assert all(p.kind == "orphan" for p in report), (n, report.summary())
        if n == N_WRITES:  # the comparisons row made it: committed, whole, only the pending file is stale
            assert on_disk == prepared["counts"]
            assert _visible(store) == prepared["counts"]
            assert _visible_in_catalog_file(root) == prepared["counts"]
            assert [str(p) for p in report] == [f"[orphan] pending file pending/{pending} of a dead comparison "
                                                "writer (run `capturestore gc`)"]
            assert store.gc() == [f"pending/{pending}"]
            assert _visible(store) == prepared["counts"]
        else:  # never committed: not one row in any view, library or catalog.duckdb
            assert set(_visible(store).values()) <= {0}, (n, _visible(store))
            assert set(_visible_in_catalog_file(root).values()) <= {0}, n
            assert len(report) == 1 and f"comparison {cid} never committed" in str(report[0]), (n, report.summary())
            segments = [str(seg.relative_to(root)) for seg in root.glob("tables/*/*.parquet")
                        if cid in pq.read_table(seg).to_pydict().get("comparison_id", [])]
            assert len(segments) == n
            assert sorted(store.gc()) == sorted(segments + [f"pending/{pending}"])
            assert _rows_on_disk(root, cid) == {}
        assert _pending(root) == []
        assert store.verify().ok, (n, store.verify().summary())


def test_a_compare_failing_at_each_write_leaves_nothing(prepared, tmp_path, monkeypatch):
    real = Store.append_table
    for n in range(N_WRITES):
        root = tmp_path / f"fail{n}"
        shutil.copytree(prepared["path"], root)
        calls = []

        def append_table(self, name, rows, n=n, calls=calls):
            if len(calls) == n:
                raise OSError(f"injected: no space left writing {name}")
            calls.append(name)
            return real(self, name, rows)

        monkeypatch.setattr(Store, "append_table", append_table)
        store = Store.open(root)
        with pytest.raises(OSError, match="injected"):
            compare_runs(store, expected_run=prepared["runs"][0], actual_run=prepared["runs"][1],
                         baseline_run=prepared["runs"][2])
        monkeypatch.setattr(Store, "append_table", real)
        assert len(calls) == n
        assert [seg for seg in root.glob("tables/*/*.parquet") if "comparison_id" in pq.read_schema(seg).names] == []
        assert _pending(root) == []
        assert set(_visible(store).values()) <= {0}
        assert store.verify().ok, (n, store.verify().summary())
        assert store.gc() == []


def test_a_compare_whose_table_directory_cannot_be_written_leaves_nothing(prepared, tmp_path):
    root = tmp_path / "s"
    shutil.copytree(prepared["path"], root)
    (root / "tables" / "kv_token_bc").write_text("a file where the table's directory should be")
    store = Store.open(root)
    with pytest.raises(OSError):
        compare_runs(store, expected_run=prepared["runs"][0], actual_run=prepared["runs"][1],
                     baseline_run=prepared["runs"][2])
    assert [seg for seg in root.glob("tables/*/*.parquet") if "comparison_id" in pq.read_schema(seg).names] == []
    assert _pending(root) == [] and store.verify().ok
    (root / "tables" / "kv_token_bc").unlink()
    res = compare_runs(store, expected_run=prepared["runs"][0], actual_run=prepared["runs"][1],
                       baseline_run=prepared["runs"][2])
    assert _rows_on_disk(root, res.comparison_id) == prepared["counts"] and store.verify().ok


def test_gc_never_collects_a_comparison_being_written_by_another_process(prepared, tmp_path):
    root = tmp_path / "s"
    shutil.copytree(prepared["path"], root)
    p = _start(root, prepared["runs"], "hold", 3)
    for _ in range(3):
        assert p.stdout.readline().startswith("wrote "), p.stderr.read()
    assert p.stdout.readline() == "paused\n"
    (pending,) = _pending(root)
    cid = pending.removesuffix(".json")
    assert len(_rows_on_disk(root, cid)) == 3
    store = Store.open(root)
    assert store.gc() == []
    assert store.verify().ok  # a live writer's rows are not orphans
    assert set(_visible(store).values()) <= {0}
    assert len(_rows_on_disk(root, cid)) == 3
    out, err = p.communicate("go\n", timeout=300)
    assert p.returncode == 0, err
    assert f"committed {cid}" in out
    assert _visible(store) == prepared["counts"] and _rows_on_disk(root, cid) == prepared["counts"]
    assert _pending(root) == [] and store.verify().ok


def test_rows_left_without_a_comparisons_row_or_pending_file_are_hidden_reported_and_collected(prepared, tmp_path):
    """What a comparison that failed midway left before comparisons were atomic."""
    root = tmp_path / "s"
    shutil.copytree(prepared["path"], root)
    store = Store.open(root)
    res = compare_runs(store, expected_run=prepared["runs"][0], actual_run=prepared["runs"][1],
                       baseline_run=prepared["runs"][2])
    committed = store.sql("SELECT layer, count(*) AS n, max(k_linf) AS m FROM kv_head_metrics GROUP BY layer "
                          "ORDER BY layer").to_pylist()
    # what the old code left: segments written straight, no pending lock (append_table now refuses such rows)
    write_segment(root, "kv_head_metrics", pa.Table.from_pylist(
        [{"comparison_id": "cmp-old-failed", "layer": LAYERS[0], "head": 0, "position": 0, "k_linf": 1e9}] * 3))
    write_segment(root, "kv_layer_verdicts", pa.Table.from_pylist(
        [{"comparison_id": "cmp-old-failed", "layer": LAYERS[0], "passed": True}]))
    # the README's ungrouped query sees only the committed comparison
    assert store.sql("SELECT layer, count(*) AS n, max(k_linf) AS m FROM kv_head_metrics GROUP BY layer "
                     "ORDER BY layer").to_pylist() == committed
    assert _visible(store) == prepared["counts"]
    assert _visible_in_catalog_file(root) == prepared["counts"]
    (prob,) = store.verify()
    assert prob.kind == "orphan" and "comparison cmp-old-failed never committed" in prob.message
    removed = store.gc()
    assert len(removed) == 2 and all(r.startswith(("tables/kv_head_metrics/", "tables/kv_layer_verdicts/")) for r in removed)
    assert _rows_on_disk(root, "cmp-old-failed") == {}
    assert _rows_on_disk(root, res.comparison_id) == prepared["counts"]
    assert store.verify().ok


def test_an_unreadable_comparisons_segment_makes_gc_keep_every_comparison_row(prepared, tmp_path):
    """Which comparisons committed is unknown then: deleting their metrics would lose data."""
    root = tmp_path / "s"
    shutil.copytree(prepared["path"], root)
    store = Store.open(root)
    res = compare_runs(store, expected_run=prepared["runs"][0], actual_run=prepared["runs"][1],
                       baseline_run=prepared["runs"][2])
    (seg,) = (root / "tables" / "comparisons").glob("*.parquet")
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])  # truncated
    assert store.gc() == []
    assert _rows_on_disk(root, res.comparison_id) == {t: n for t, n in prepared["counts"].items() if t != "comparisons"}
    assert [p.kind for p in store.verify()] == ["bad-segment"]


def test_rows_of_no_live_or_committed_comparison_are_refused_not_hidden_and_collected(tmp_path):
    # A user's own table with a comparison_id column used to be hidden by the views, called a dead
    # comparison by verify and deleted by gc: refused at append instead, nothing written.
    store = Store.open(tmp_path / "s")
    for rows, why in (([{"comparison_id": "my-label", "score": 0.5}], "'my-label' is no committed comparison"),
                      ([{"comparison_id": None, "score": 0.5}], "a comparison_id is NULL")):
        with pytest.raises(ValueError, match=why):
            store.append_table("user_scores", rows)
    assert not (tmp_path / "s" / "tables" / "user_scores").exists() or not list((tmp_path / "s" / "tables" / "user_scores").glob("*.parquet"))
    # under a live pending lock (as commit_comparison holds) and after the commit, rows are accepted
    from capturestore.integrity import PendingLock

    lock = PendingLock(store.root, "cmp-user-1", {"comparison_id": "cmp-user-1"})
    try:
        store.append_table("user_scores", [{"comparison_id": "cmp-user-1", "score": 0.5}])
        store.append_table("comparisons", [{"comparison_id": "cmp-user-1", "passed": True}])
    finally:
        lock.release()
    store.append_table("user_scores", [{"comparison_id": "cmp-user-1", "score": 0.25}])  # more rows of a committed one
    assert store.sql("SELECT sum(score) AS s FROM user_scores").to_pylist() == [{"s": 0.75}]
    assert store.verify().ok and store.gc() == []
