"""Store.sql and `capturestore sql` are read-only and confined to the store (docs/sql.md).

Each attack of issue 8 part 3 runs against a real store on disk, through the library and through
the console entry point in a subprocess, and the files it aimed at are checked afterwards.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capturestore import Store
from capturestore.errors import QueryError
from capturestore.layout import CATALOG_FILE, TABLES_DIR
from tests.capturestore.conftest import REPO

PROMPT, CONT = [1, 2, 3], [4, 5]  # 5 positions; logits rows predict the 2 continuation tokens
VOCAB = 8


def _fill(store: Store) -> str:
    rng = np.random.default_rng(0)
    with store.begin_run(engine="hf", model_path="/models/tiny", dtype="float32") as run:
        pid = run.add_prompt(PROMPT, continuation=CONT)
        run.write_logits(pid, rng.standard_normal((len(CONT), VOCAB)).astype(np.float32))
        run.write_kv(pid, rng.standard_normal((2, 1, 5, 4)).astype(np.float32),
                     rng.standard_normal((2, 1, 5, 4)).astype(np.float32))
    store.append_table("kv_head_metrics", [{"run_id": run.run_id, "layer": 0, "k_linf": 0.125}])
    return run.run_id


@pytest.fixture
def filled(tmp_path):
    store = Store.open(tmp_path / "store")
    return store, _fill(store)


def _digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (what an attack must leave as it was)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _segments(store: Store, table: str) -> list[Path]:
    return sorted((store.root / TABLES_DIR / table).glob("*.parquet"))


def _refused(store: Store, query: str, why: str) -> str:
    with pytest.raises(QueryError) as e:
        store.sql(query)
    msg = str(e.value)
    assert "\n" not in msg and why in msg, msg
    return msg


def test_copy_over_a_runs_segment_is_refused_and_the_run_stays(filled):
    store, rid = filled
    seg = store.root / TABLES_DIR / "runs" / f"{rid}.parquet"  # the run's commit marker
    before = _digest(store.root)
    msg = _refused(store, f"COPY (SELECT * FROM runs WHERE false) TO '{seg}' (FORMAT parquet)", "COPY")
    assert "read-only" in msg
    assert _digest(store.root) == before
    assert pq.read_table(seg).column("run_id").to_pylist() == [rid]
    reopened = Store.open(store.root, create=False)
    assert reopened.runs().column("run_id").to_pylist() == [rid]
    assert reopened.verify().ok
    assert reopened.show(rid)["run"]["run_id"] == rid


def test_attach_the_catalog_and_drop_a_view_is_refused_and_the_file_keeps_its_views(filled):
    store, rid = filled
    cat = store.root / CATALOG_FILE
    assert cat.exists()
    _refused(store, f"ATTACH '{cat}' AS c; DROP VIEW c.runs", "ATTACH")
    _refused(store, "DROP VIEW runs", "DROP")
    _refused(store, "CREATE VIEW runs2 AS SELECT 1", "CREATE")
    # the file catalog, opened in a plain DuckDB client, still has its runs view
    con = duckdb.connect(str(cat), read_only=True)
    try:
        assert con.sql("SELECT run_id FROM runs").fetchall() == [(rid,)]
    finally:
        con.close()
    # and the library's own connection still has its views after the refused statements
    assert store.sql("SELECT run_id FROM runs").column("run_id").to_pylist() == [rid]


def test_no_file_is_written_anywhere(filled, tmp_path):
    store, _ = filled
    before = _digest(store.root)
    outside = tmp_path / "x.csv"
    inside = store.root / TABLES_DIR / "kv_head_metrics" / "evil.parquet"
    for q, why in [
        (f"COPY (SELECT 1 AS a) TO '{outside}'", "COPY"),
        (f"COPY (SELECT 1 AS a) TO '{inside}' (FORMAT parquet)", "COPY"),
        (f"EXPORT DATABASE '{tmp_path / 'exp'}'", "EXPORT"),
        (f"EXPORT DATABASE '{store.root / TABLES_DIR / 'exp'}'", "EXPORT"),
        (f"EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{inside}' (FORMAT parquet)", "EXPLAIN"),
        # a refused statement after an allowed one: nothing of the string runs
        (f"SELECT 1; COPY (SELECT 1 AS a) TO '{outside}'", "COPY"),
    ]:
        _refused(store, q, why)
    assert not outside.exists() and not inside.exists() and not (tmp_path / "exp").exists()
    assert _digest(store.root) == before


def test_attaching_another_database_is_refused(filled, tmp_path):
    store, _ = filled
    other = tmp_path / "other.duckdb"
    _refused(store, f"ATTACH '{other}'", "ATTACH")
    assert not other.exists()
    con = duckdb.connect(str(other))
    con.execute("CREATE TABLE secret AS SELECT 42 AS x")
    con.close()
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    _refused(store, f"ATTACH '{other}' AS o", "ATTACH")
    _refused(store, f"SELECT * FROM read_parquet('{other}')", "reads only")
    assert hashlib.sha256(other.read_bytes()).hexdigest() == digest


def test_files_outside_the_store_cannot_be_read(filled, tmp_path):
    store, _ = filled
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pq.write_table(pa.table({"secret": [7]}), elsewhere / "s.parquet")
    # a second store next to this one: its segments are outside this store
    other = Store.open(tmp_path / "other")
    _fill(other)
    for q in [
        "SELECT * FROM read_csv_auto('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM sniff_csv('/etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
        f"SELECT * FROM read_parquet('{elsewhere / 's.parquet'}')",
        f"SELECT * FROM '{elsewhere / 's.parquet'}'",
        f"SELECT * FROM read_parquet('{other.root / TABLES_DIR / 'runs' / '*.parquet'}')",
        f"SELECT * FROM read_parquet('{store.root / TABLES_DIR / '..' / '..' / 'elsewhere' / 's.parquet'}')",
    ]:
        msg = _refused(store, q, "refused")
        assert "reads only" in msg and str(store.root / TABLES_DIR) in msg, msg
    # the store's own segments stay readable, by view and by path
    assert store.sql("SELECT count(*) AS n FROM kv_head_metrics").column("n").to_pylist() == [1]
    seg_glob = store.root / TABLES_DIR / "kv_head_metrics" / "*.parquet"
    assert store.sql(f"SELECT k_linf FROM read_parquet('{seg_glob}')").column("k_linf").to_pylist() == [0.125]


def test_extensions_and_settings_are_refused(filled):
    store, _ = filled
    for q, why in [("INSTALL httpfs", "INSTALL"), ("LOAD httpfs", "LOAD"), ("SET threads = 1", "SET"),
                   ("RESET threads", "SET"), ("PRAGMA threads = 1", "SET"),
                   ("SET enable_external_access = true", "SET"), ("SET lock_configuration = false", "SET"),
                   ("CALL pragma_version()", "CALL"), ("CREATE TEMP TABLE t AS SELECT 1", "CREATE")]:
        _refused(store, q, why)
    rows = store.sql("SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
                     "'lock_configuration', 'autoload_known_extensions', 'autoinstall_known_extensions')").to_pylist()
    settings = {r["name"]: r["value"] for r in rows}
    assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                        "autoload_known_extensions": "false", "autoinstall_known_extensions": "false"}


def test_several_queries_return_the_last_result(filled):
    store, rid = filled
    assert store.sql("SELECT 1 AS a; SELECT run_id FROM runs").to_pylist() == [{"run_id": rid}]


def test_a_table_appearing_after_the_lockdown_gets_its_view(filled):
    store, rid = filled
    assert store.sql("SELECT count(*) AS n FROM runs").column("n").to_pylist() == [1]
    store.append_table("kv_scales", [{"run_id": rid, "layer": 3, "k_scale": 0.5}])
    assert store.sql("SELECT layer, k_scale FROM kv_scales").to_pylist() == [{"layer": 3, "k_scale": 0.5}]
    assert store.sql("SELECT count(*) AS n FROM kv_head_metrics").column("n").to_pylist() == [1]


def _truncate(seg: Path) -> None:
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("when", ["before_first_query", "after_first_query"])
def test_a_truncated_segment_fails_only_the_queries_that_touch_it(filled, when):
    store, rid = filled
    store.append_table("kv_head_metrics", [{"run_id": rid, "layer": 1, "k_linf": 0.25}])
    if when == "after_first_query":
        assert store.sql("SELECT count(*) AS n FROM kv_head_metrics").column("n").to_pylist() == [2]
    bad, = [f for f in _segments(store, "kv_head_metrics") if pq.read_table(f).column("layer").to_pylist() == [1]]
    _truncate(bad)
    for q in ("SELECT * FROM kv_head_metrics", "SELECT count(*) FROM kv_head_metrics",
              "SELECT r.run_id FROM runs r JOIN kv_head_metrics k USING (run_id)"):
        with pytest.raises(QueryError) as e:
            store.sql(q)
        assert bad.name in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert store.sql("SELECT 1 AS one").column("one").to_pylist() == [1]
    assert store.sql("SELECT run_id FROM runs").column("run_id").to_pylist() == [rid]
    assert store.sql("SELECT count(*) AS n FROM captures").column("n").to_pylist() == [4]
    # once the bad segment is gone, the table reads again in the same Store
    bad.unlink()
    assert store.sql("SELECT k_linf FROM kv_head_metrics").column("k_linf").to_pylist() == [0.125]


def _cli(store_root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "capturestore.cli", *args, "--store", str(store_root)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_refuses_each_attack_with_one_line_and_exit_2(filled, tmp_path):
    store, rid = filled
    before = _digest(store.root)
    seg = store.root / TABLES_DIR / "runs" / f"{rid}.parquet"
    outside = tmp_path / "x.csv"
    for q, why in [
        (f"COPY (SELECT * FROM runs WHERE false) TO '{seg}' (FORMAT parquet)", "COPY"),
        (f"ATTACH '{store.root / CATALOG_FILE}' AS c; DROP VIEW c.runs", "ATTACH"),
        (f"COPY (SELECT 1 AS a) TO '{outside}'", "COPY"),
        (f"ATTACH '{tmp_path / 'other.duckdb'}'", "ATTACH"),
        ("SELECT * FROM read_csv_auto('/etc/passwd')", "/etc/passwd"),
    ]:
        r = _cli(store.root, "sql", q)
        assert r.returncode == 2, (q, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("capturestore sql: error: refused") and why in lines[0], r.stderr
        assert r.stdout == "" and "root:" not in r.stderr
    assert not outside.exists() and not (tmp_path / "other.duckdb").exists()
    assert _digest(store.root) == before
    r = _cli(store.root, "verify")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = _cli(store.root, "show", rid)
    assert r.returncode == 0 and rid in r.stdout, r.stderr


@pytest.mark.parametrize("cte", ["", "MATERIALIZED "])
def test_copy_inside_a_cte_is_refused_and_the_run_stays(filled, tmp_path, cte):
    # DuckDB's parser calls `WITH x AS (COPY ... TO ...) SELECT ...` a SELECT statement, and runs
    # the COPY even when nothing reads x: with the segment as target it deleted the run (issue 8 part 3)
    store, rid = filled
    seg = store.root / TABLES_DIR / "runs" / f"{rid}.parquet"
    before = _digest(store.root)
    outside = tmp_path / "x.csv"
    copy = "WITH x AS {}(COPY (SELECT * FROM runs WHERE false) TO '{}' (FORMAT parquet)) SELECT 1 AS one"
    for target in (seg, store.root / TABLES_DIR / "runs" / "new.parquet"):
        msg = _refused(store, copy.format(cte, target), "COPY_TO_FILE inside a query")
        assert "read-only" in msg, msg
    _refused(store, copy.format(cte, outside), "reads only")  # DuckDB refuses the path while planning
    # nothing of a string runs when a later statement writes
    _refused(store, f"SELECT 1; {copy.format(cte, seg)}", "COPY_TO_FILE")
    assert _digest(store.root) == before and not outside.exists()
    assert Store.open(store.root, create=False).runs().column("run_id").to_pylist() == [rid]


def test_the_working_directory_temp_folder_is_not_readable(filled, tmp_path, monkeypatch):
    # DuckDB allows its temp_directory (default: '.tmp' in the working directory) on top of
    # allowed_directories: a query could read <cwd>/.tmp/* (and write there through a CTE COPY)
    store, _ = filled
    cwd = tmp_path / "cwd"
    (cwd / ".tmp").mkdir(parents=True)
    (cwd / ".tmp" / "secret.csv").write_text("secret\n")
    monkeypatch.chdir(cwd)
    fresh = Store.open(store.root, create=False)  # its connection is made in this working directory
    _refused(fresh, f"SELECT * FROM read_text('{cwd / '.tmp' / 'secret.csv'}')", "reads only")
    _refused(fresh, "SELECT * FROM read_text('.tmp/secret.csv')", "reads only")
    allowed = fresh.sql("SELECT current_setting('allowed_directories') AS a").column("a").to_pylist()[0]
    assert str(store.root / TABLES_DIR) + os.sep in allowed and not any(a.startswith(str(cwd)) for a in allowed), allowed
