"""A store is self-contained: copied or moved, its catalog.duckdb opens in a plain DuckDB client
from any working directory and reads the copy; the file catalog is rebuilt only when its tables
change, and a failed rebuild leaves no temp file behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from capturestore import Store, StoreError
from capturestore.layout import CATALOG_FILE, CATALOG_STAMP_FILE, LEGACY_CATALOG_ROOT_FILE

# What a user without this library runs: python -c with duckdb only, in a directory of our choice.
PLAIN_CLIENT = """
import duckdb, json, sys
con = duckdb.connect(sys.argv[1], read_only=True)
out = {
    "runs": sorted(r[0] for r in con.sql("SELECT run_id FROM runs").fetchall()),
    "prompts": con.sql("SELECT count(*) FROM prompts").fetchall()[0][0],
    "metric": sorted(r[0] for r in con.sql("SELECT value FROM user_metric").fetchall()),
}
print(json.dumps(out))
"""


def _plain_duckdb(catalog: Path, cwd: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", PLAIN_CLIENT, str(catalog)], cwd=cwd, capture_output=True,
                       text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _fill(store: Store, tokens: list[int], value: float) -> str:
    with store.begin_run(engine="hf", model_path="m") as run:
        run.add_prompt(tokens)
    store.append_table("user_metric", [{"run_id": run.run_id, "value": value}])
    return run.run_id


def _copy(how: str, src: Path, dst: Path) -> None:
    if how == "cp -a":
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    elif how == "tar":
        dst.mkdir()
        tar = subprocess.Popen(["tar", "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-C", str(dst), "-xf", "-"], stdin=tar.stdout, check=True)
        tar.stdout.close()
        assert tar.wait() == 0
    else:
        subprocess.run(["rsync", "-a", f"{src}/", f"{dst}/"], check=True)


@pytest.mark.parametrize("how", ["cp -a", "tar", pytest.param("rsync", marks=pytest.mark.skipif(
    shutil.which("rsync") is None, reason="rsync is not installed"))])
def test_a_copied_store_opens_in_plain_duckdb_from_any_directory_and_reads_the_copy(tmp_path, how):
    orig = tmp_path / "orig"
    first = _fill(Store.open(orig), [1, 2, 3], 0.5)
    copy = tmp_path / "elsewhere" / "copy"
    copy.parent.mkdir()
    _copy(how, orig, copy)
    # The original moves on; the copy, never opened by this library, must read its own segments.
    second = _fill(Store.open(orig), [4, 5], 0.25)
    want_copy = {"runs": [first], "prompts": 1, "metric": [0.5]}
    assert _plain_duckdb(copy / CATALOG_FILE, cwd=Path("/")) == want_copy
    assert _plain_duckdb(orig / CATALOG_FILE, cwd=copy) == {"runs": sorted([first, second]), "prompts": 2,
                                                            "metric": [0.25, 0.5]}
    shutil.rmtree(orig)  # the original gone: the copy still reads, from any working directory
    (tmp_path / "cwd").mkdir()
    for cwd in (Path("/"), tmp_path / "cwd", copy / "tables", copy):
        assert _plain_duckdb(copy / CATALOG_FILE, cwd=cwd) == want_copy
    rel = os.path.relpath(copy / CATALOG_FILE, copy / "tables" / "runs")  # a relative path to the catalog
    assert _plain_duckdb(Path(rel), cwd=copy / "tables" / "runs") == want_copy
    # and the library, opening the copy, writes on into the copy
    third = _fill(Store.open(copy), [6], 1.0)
    assert _plain_duckdb(copy / CATALOG_FILE, cwd=Path("/")) == {"runs": sorted([first, third]), "prompts": 2,
                                                                 "metric": [0.5, 1.0]}


def test_the_catalog_attached_elsewhere_reads_its_store_via_file_search_path_or_says_how(tmp_path):
    store = Store.open(tmp_path / "s")
    rid = _fill(store, [7, 8], 1.0)
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH '{store.root / CATALOG_FILE}' AS c (READ_ONLY)")
        with pytest.raises(duckdb.Error, match="cannot tell which store this catalog belongs to.*file_search_path"):
            con.sql("SELECT * FROM c.runs").fetchall()
        con.execute(f"SET file_search_path = '{store.root}'")
        assert con.sql("SELECT run_id FROM c.runs").fetchall() == [(rid,)]
    finally:
        con.close()


def test_opening_does_not_rebuild_a_current_catalog_and_a_moved_store_keeps_its_catalog(tmp_path):
    store = Store.open(tmp_path / "a")
    _fill(store, [1, 2], 0.5)
    cat = store.root / CATALOG_FILE
    before = (cat.stat().st_ino, cat.stat().st_mtime_ns)
    Store.open(store.root)
    assert (cat.stat().st_ino, cat.stat().st_mtime_ns) == before
    moved = tmp_path / "b"
    os.rename(store.root, moved)
    Store.open(moved)
    assert ((moved / CATALOG_FILE).stat().st_ino, (moved / CATALOG_FILE).stat().st_mtime_ns) == before
    assert Store.open(moved).verify().ok


def test_a_catalog_of_absolute_paths_is_replaced_on_open(tmp_path):
    """Stores written before relocatable catalogs carry catalog.root and absolute view paths."""
    store = Store.open(tmp_path / "s")
    rid = _fill(store, [3, 1], 0.5)
    (store.root / CATALOG_FILE).unlink()
    (store.root / CATALOG_STAMP_FILE).unlink()
    con = duckdb.connect(str(store.root / CATALOG_FILE))
    con.execute(f"CREATE VIEW runs AS SELECT * FROM read_parquet('{store.root}/tables/runs/*.parquet', union_by_name = true)")
    con.close()
    (store.root / LEGACY_CATALOG_ROOT_FILE).write_text(f"{store.root}\ncaptures\nprompts\nruns\nuser_metric\n")
    assert [p.kind for p in Store.open(store.root, create=False).verify()] == []  # open rebuilt it
    assert not (store.root / LEGACY_CATALOG_ROOT_FILE).exists()
    assert _plain_duckdb(store.root / CATALOG_FILE, cwd=Path("/"))["runs"] == [rid]


def _temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp" in p.name)


def test_a_failed_rebuild_leaves_no_temp_file_and_no_stale_view(tmp_path):
    store = Store.open(tmp_path / "s")
    rid = _fill(store, [1, 2, 3], 0.5)
    bad = store.root / "tables" / "broken_metric" / "seg.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1" + b"\0" * 100)  # a truncated segment: DuckDB cannot bind a view over it
    for _ in range(3):
        Store.open(store.root)
        assert _temp_files(store.root) == []
    # the file catalog names the problem where the table is read, and every other view works
    con = duckdb.connect(str(store.root / CATALOG_FILE), read_only=True)
    try:
        assert con.sql("SELECT run_id FROM runs").fetchall() == [(rid,)]
        with pytest.raises(duckdb.Error, match="table broken_metric is unreadable.*tables/broken_metric/seg.parquet"):
            con.sql("SELECT count(*) FROM broken_metric").fetchall()
    finally:
        con.close()
    with pytest.raises(StoreError, match="table broken_metric is unreadable"):
        store.rebuild_catalog()
    assert _temp_files(store.root) == []
    # repaired: the next open rebuilds (the stamp marked the table unreadable) and the view reads
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1.5]}), bad)
    Store.open(store.root)
    con = duckdb.connect(str(store.root / CATALOG_FILE), read_only=True)
    try:
        assert con.sql("SELECT x FROM broken_metric").fetchall() == [(1.5,)]
    finally:
        con.close()
    assert Store.open(store.root).verify().ok


def test_a_rebuild_that_cannot_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """A failure after DuckDB created the temporary database (here: its checkpoint) removes it."""
    store = Store.open(tmp_path / "s")
    _fill(store, [1, 2], 0.5)
    real_connect = duckdb.connect

    class FailingCheckpoint:
        def __init__(self, con):
            self._con = con

        def execute(self, sql, *a):
            if sql == "CHECKPOINT":
                raise duckdb.IOException("disk full (injected)")
            return self._con.execute(sql, *a)

        def __getattr__(self, name):
            return getattr(self._con, name)

    def connect(path=":memory:", *a, **kw):
        con = real_connect(path, *a, **kw)
        return FailingCheckpoint(con) if ".tmp" in str(path) else con

    monkeypatch.setattr(duckdb, "connect", connect)
    with pytest.raises(StoreError, match="cannot write .*catalog.duckdb.*disk full"):
        store.rebuild_catalog()
    assert _temp_files(store.root) == []
    assert [n for n in os.listdir(store.root) if n.endswith(".wal")] == []


def test_library_queries_work_from_any_working_directory(tmp_path, monkeypatch):
    store = Store.open(tmp_path / "s")
    rid = _fill(store, [5, 6], 0.5)
    monkeypatch.chdir("/")
    fresh = Store.open(os.path.relpath(store.root, "/"))
    assert fresh.sql("SELECT run_id FROM runs").column("run_id").to_pylist() == [rid]
    assert np.array_equal(fresh.read_tokens(rid, fresh.prompts(rid).column("prompt_id")[0].as_py()), [5, 6])


def test_a_client_with_another_temp_directory_default_is_refused_then_reads_via_file_search_path(tmp_path):
    """Some clients do not default temp_directory to '<database>.tmp' (duckdb-java 1.5.1 on Windows)."""
    store = Store.open(tmp_path / "s")
    rid = _fill(store, [7, 9], 1.0)
    other = Store.open(tmp_path / "cwd-store")  # a store in the working directory must never be read instead
    _fill(other, [1], 2.0)
    cwd = os.getcwd()
    os.chdir(other.root)
    try:
        con = duckdb.connect(str(store.root / CATALOG_FILE), read_only=True, config={"temp_directory": ".tmp"})
        with pytest.raises(duckdb.Error, match="cannot tell which store this catalog belongs to"):
            con.sql("SELECT run_id FROM runs").fetchall()
        con.execute(f"SET file_search_path = '{store.root}'")
        assert con.sql("SELECT run_id FROM runs").fetchall() == [(rid,)]
        con.close()
    finally:
        os.chdir(cwd)


def test_a_store_under_a_path_with_glob_characters_reads_and_a_backslash_is_refused(tmp_path):
    # '[1]' in the path is a glob class to DuckDB: every query failed with "No files found"
    orig = tmp_path / "orig"
    first = _fill(Store.open(orig), [1, 2, 3], 0.5)
    odd = tmp_path / "odd's [1] {x}"
    _copy("cp -a", orig, odd)
    want = {"runs": [first], "prompts": 1, "metric": [0.5]}
    assert _plain_duckdb(odd / CATALOG_FILE, cwd=Path("/")) == want
    # DuckDB alters a '?' in the temp directory it derives from the file name, so the catalog cannot
    # tell which store it is in: a one-line refusal (never another store's rows); the library still reads
    qm = tmp_path / "what?"
    _copy("cp -a", orig, qm)
    p = subprocess.run([sys.executable, "-c", PLAIN_CLIENT, str(qm / CATALOG_FILE)], cwd="/", capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "cannot tell which store this catalog belongs to" in p.stderr
    assert Store.open(qm).sql("SELECT value FROM user_metric").to_pylist() == [{"value": 0.5}]
    store = Store.open(odd)
    assert store.sql("SELECT run_id FROM runs").to_pylist() == [{"run_id": first}]
    assert store.sql("SELECT value FROM user_metric").to_pylist() == [{"value": 0.5}]
    assert store.verify().ok
    # DuckDB reads '\' in a glob as a path separator: refused in one line rather than finding no tables
    with pytest.raises(StoreError, match=r"a backslash in the path cannot be read by DuckDB"):
        Store.open(tmp_path / "back\\slash")
    assert not (tmp_path / "back\\slash").exists()
