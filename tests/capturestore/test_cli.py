"""The CLI on a real store: main([...]) in-process, and the console entry point as a subprocess."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from capturestore import Store
from capturestore.cli import main
from capturestore.layout import ARRAYS_DIR
from tests.capturestore.conftest import REPO


@pytest.fixture
def filled(tmp_path):
    store = Store.open(tmp_path / "store")
    with store.begin_run(engine="hf", model_path="/models/tiny", dtype="bfloat16", release="r1") as run:
        pid = run.add_prompt([1, 2, 3], text="abc")
        run.write_logits(pid, np.arange(6, dtype=np.float32).reshape(2, 3))
    store.append_table("kv_head_metrics", [{"run_id": run.run_id, "layer": 0, "k_linf": 0.125}])
    return store, run.run_id, pid


def test_runs_and_show_print_the_run(filled, capsys):
    store, rid, pid = filled
    assert main(["runs", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert rid in out and "hf" in out and "r1" in out and "(1 row)" in out
    assert main(["show", rid, "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "/models/tiny" in out and pid in out and "logits" in out and "[2, 3]" in out


def test_sql_formats(filled, capsys, tmp_path):
    store, rid, _ = filled
    q = "SELECT run_id, layer, k_linf FROM kv_head_metrics"
    assert main(["sql", q, "--store", str(store.root), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert rows == [{"run_id": rid, "layer": "0", "k_linf": "0.125"}]
    assert main(["sql", q, "--store", str(store.root), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"run_id": rid, "layer": 0, "k_linf": 0.125}]
    out = tmp_path / "r.parquet"
    assert main(["sql", "SELECT shape FROM captures ORDER BY array_name", "--store", str(store.root),
                 "--format", "parquet", "--output", str(out)]) == 0
    assert pq.read_table(out).column("shape").to_pylist() == [[2, 3], [3]]
    assert main(["sql", "SELECT shape FROM captures ORDER BY array_name", "--store", str(store.root), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ['"[2, 3]"', '"[3]"']


def test_verify_gc_and_rebuild_catalog_exit_codes(filled, capsys):
    store, rid, pid = filled
    assert main(["verify", "--store", str(store.root)]) == 0
    assert "OK" in capsys.readouterr().out
    # a dead writer's leftovers: an uncommitted run directory with no live lock
    (store.root / ARRAYS_DIR / "20990101T000000-deadbeef").mkdir()
    assert main(["verify", "--store", str(store.root)]) == 1
    assert "orphan" in capsys.readouterr().out
    assert main(["gc", "--store", str(store.root), "--dry-run"]) == 0
    assert "would remove arrays.zarr/20990101T000000-deadbeef" in capsys.readouterr().out
    assert main(["gc", "--store", str(store.root)]) == 0
    assert "removed 1 item(s)" in capsys.readouterr().out
    assert main(["verify", "--store", str(store.root)]) == 0
    (store.root / "catalog.duckdb").unlink()
    assert main(["rebuild-catalog", "--store", str(store.root)]) == 0
    assert (store.root / "catalog.duckdb").exists()


def test_errors_exit_2_with_the_message(filled, capsys, tmp_path):
    store, _, _ = filled
    assert main(["show", "nope", "--store", str(store.root)]) == 2
    assert "unknown run id 'nope'" in capsys.readouterr().err
    assert main(["runs", "--store", str(tmp_path / "absent")]) == 2
    assert "not a capture store" in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()


def test_console_script_uses_env_store(filled):
    store, rid, _ = filled
    env = {**os.environ, "CAPTURESTORE": str(store.root), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "sql", "SELECT count(*) AS n FROM runs",
                        "--format", "json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"n": 1}]


def test_demo_and_calibrate_are_registered(capsys):
    for cmd in (["demo", "--help"], ["calibrate", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--num-tokens" in out and "--arch" in out and "--method" in out and "--out" in out
    assert "--platform" in out and "--percentile" in out


def test_runs_lists_uncommitted_runs_as_pending(filled, capsys):
    store, _, _ = filled
    run = store.begin_run(engine="hf", model_path="m")
    assert main(["runs", "--store", str(store.root)]) == 0
    assert f"pending {run.run_id}: pid {os.getpid()}" in capsys.readouterr().out
    run.abort()
    assert main(["runs", "--store", str(store.root)]) == 0
    assert "pending" not in capsys.readouterr().out
