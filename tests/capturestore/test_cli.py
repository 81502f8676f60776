"""The CLI on a real store: main([...]) in-process, and the console entry point as a subprocess."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from typing import Sequence

import numpy as np
import pyarrow as pa
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
        pid = run.add_prompt([1, 2, 3], text="abc", continuation=[0, 2])  # logits rows: the 2 continuation tokens
        run.write_logits(pid, np.arange(8, dtype=np.float32).reshape(2, 4))
    store.append_table("kv_head_metrics", [{"run_id": run.run_id, "layer": 0, "k_linf": 0.125}])
    return store, run.run_id, pid


def test_runs_and_show_print_the_run(filled, capsys):
    store, rid, pid = filled
    assert main(["runs", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert rid in out and "hf" in out and "r1" in out and "(1 row)" in out
    assert main(["show", rid, "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "/models/tiny" in out and pid in out and "logits" in out and "[2, 4]" in out


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
    assert pq.read_table(out).column("shape").to_pylist() == [[2, 4], [5]]
    assert main(["sql", "SELECT shape FROM captures ORDER BY array_name", "--store", str(store.root), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ['"[2, 4]"', '"[5]"']


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
    err = capsys.readouterr().err
    assert "not a capture store" in err and "--store" in err and "create=True" not in err
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


# ---- user errors: one line on stderr, exit 2, nothing written (issue 8 part 6) ------------------
def _one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"capturestore {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _cli(*args: str, cwd=None, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*prefix, sys.executable, "-m", "capturestore.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_usage_errors_are_one_line(capsys):
    for argv, command, why in [(["sql"], "sql", "the following arguments are required: query"),
                               (["nope"], "", "invalid choice: 'nope'"),
                               (["sql", "SELECT 1", "--format", "xml"], "sql", "invalid choice: 'xml'")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and why in err and err.startswith(f"capturestore {command}".strip()), err


def test_sql_errors_are_one_line(filled, capsys):
    store, rid, _ = filled
    S = ["--store", str(store.root)]
    assert main(["sql", "SELEC 1", *S]) == 2
    line = _one_error_line(capsys.readouterr().err, "sql")
    assert 'syntax error at or near "SELEC"' in line
    assert main(["sql", "SELECT * FROM no_such_table", *S]) == 2
    line = _one_error_line(capsys.readouterr().err, "sql")
    assert "no_such_table does not exist" in line and "views: " in line and "runs" in line and "kv_head_metrics" in line
    assert "pg_" not in line  # DuckDB's suggestion of its own system tables is dropped
    assert main(["sql", "SELECT * FROM runz", *S]) == 2
    assert 'Did you mean "runs"' in _one_error_line(capsys.readouterr().err, "sql")
    assert main(["sql", "   ", *S]) == 2
    _one_error_line(capsys.readouterr().err, "sql")
    # the same through the console script: exit status 2, no traceback
    r = _cli("sql", "SELECT * FROM no_such_table", *S)
    assert r.returncode == 2 and r.stdout == ""
    _one_error_line(r.stderr, "sql")


def test_sql_output_that_cannot_be_written_fails_before_the_query(filled, capsys, tmp_path):
    store, _, _ = filled
    S = ["--store", str(store.root)]
    for args, why in [
        (["--output", "/nonexistent/x.csv", "--format", "csv"], "directory /nonexistent does not exist"),
        (["--output", str(tmp_path), "--format", "csv"], "is a directory"),
        (["--format", "parquet"], "--format parquet needs --output FILE"),
    ]:
        assert main(["sql", "SELECT 1 AS one", *S, *args]) == 2, args
        assert why in _one_error_line(capsys.readouterr().err, "sql")
        assert main(["runs", *S, *args]) == 2, args
        assert why in _one_error_line(capsys.readouterr().err, "runs")
    assert not os.path.exists("/nonexistent")
    # a query that fails leaves an existing output file as it was, and no temporary file
    out = tmp_path / "keep.csv"
    out.write_text("old\n")
    assert main(["sql", "SELECT * FROM nope", *S, "--output", str(out), "--format", "csv"]) == 2
    capsys.readouterr()
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["keep.csv"]
    assert main(["sql", "SELECT 7 AS n", *S, "--output", str(out), "--format", "csv"]) == 0
    assert out.read_text().splitlines() == ['"n"', "7"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["keep.csv"]


def test_an_empty_store_path_is_an_error_not_the_working_directory(filled, capsys, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for cmd in (["runs"], ["sql", "SELECT 1"], ["verify"], ["gc"], ["rebuild-catalog"], ["demo"]):
        assert main([*cmd, "--store", ""]) == 2, cmd
        assert "--store is empty" in _one_error_line(capsys.readouterr().err, cmd[0])
    assert list(cwd.iterdir()) == []
    # an empty $CAPTURESTORE counts as unset: the default ./capturestore-store, which is not a store here
    monkeypatch.setenv("CAPTURESTORE", "")
    assert main(["runs"]) == 2
    assert "capturestore-store is not a capture store" in _one_error_line(capsys.readouterr().err, "runs")
    assert list(cwd.iterdir()) == []


@pytest.fixture
def kv_store(tmp_path):
    """Two runs of one prompt with logits [2, 8] and KV [layer=2, kv_head=1, seq=5, head_dim=4]."""
    rng = np.random.default_rng(3)
    store = Store.open(tmp_path / "store")
    runs = []
    for _ in range(2):
        with store.begin_run(engine="hf", model_path="/models/tiny", dtype="float32") as run:
            pid = run.add_prompt([1, 2, 3], continuation=[4, 5])
            run.write_logits(pid, rng.standard_normal((2, 8)).astype(np.float32))
            run.write_kv(pid, rng.standard_normal((2, 1, 5, 4)).astype(np.float32),
                         rng.standard_normal((2, 1, 5, 4)).astype(np.float32))
        runs.append(run.run_id)
    return store, runs


def test_calibrate_out_onto_an_existing_file_writes_nothing(kv_store, capsys, tmp_path):
    store, (rid, _) = kv_store
    target = tmp_path / "scales"
    target.write_text("not a directory\n")
    before = _tree(store.root)
    assert main(["calibrate", rid, "--out", str(target), "--store", str(store.root)]) == 2
    line = _one_error_line(capsys.readouterr().err, "calibrate")
    assert f"--out {target} exists and is not a directory" in line
    assert target.read_text() == "not a directory\n"
    assert _tree(store.root) == before and not (store.root / "tables" / "kv_scales").exists()
    assert main(["calibrate", rid, "--out", str(target / "sub"), "--store", str(store.root)]) == 2
    assert f"{target} is not a directory" in _one_error_line(capsys.readouterr().err, "calibrate")
    assert _tree(store.root) == before


def test_writing_commands_on_a_read_only_store_fail_in_one_line_with_nothing_written(kv_store, tmp_path,
                                                                                    read_only_prefix):
    store, (expected, actual) = kv_store
    S = ["--store", str(store.root)]
    ro = read_only_prefix(store.root)
    before = _tree(store.root)
    out = tmp_path / "scales"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a prompt\n")
    for cmd in (["compare", "--expected", expected, "--actual", actual], ["calibrate", expected, "--out", str(out)],
                ["rebuild-catalog"], ["gc"], ["compact"], ["upgrade"], ["isolate", "cmp-any"],
                ["run", "--model", str(tmp_path), "--prompts", str(prompts)], ["demo"]):  # refused before any other check
        r = _cli(*cmd, *S, prefix=ro)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        line = _one_error_line(r.stderr, cmd[0])
        assert f"store {store.root} is not writable" in line and "read-only file system" in line, line
        assert f"`capturestore {cmd[0]}` writes to the store" in line, line  # demo's said `run`
        assert _tree(store.root) == before
    assert not out.exists()  # calibrate wrote no scales before finding the store read-only
    # reading a read-only store works
    r = _cli("sql", "SELECT count(*) AS n FROM runs", "--format", "csv", *S, prefix=ro)
    assert r.returncode == 0 and r.stdout.splitlines() == ['"n"', "2"], r.stderr
    for cmd in (["runs"], ["verify"], ["show", expected], ["gc", "--dry-run"]):
        r = _cli(*cmd, *S, prefix=ro)
        assert r.returncode == 0, (cmd, r.stderr)
    assert _tree(store.root) == before


def test_a_truncated_metric_segment_fails_only_the_queries_that_read_it(filled, capsys):
    store, rid, _ = filled
    seg, = (store.root / "tables" / "kv_head_metrics").glob("*.parquet")
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])
    S = ["--store", str(store.root), "--format", "csv"]
    assert main(["sql", "SELECT 1 AS one", *S]) == 0
    assert capsys.readouterr().out.splitlines() == ['"one"', "1"]
    assert main(["sql", "SELECT run_id FROM runs", *S]) == 0
    assert capsys.readouterr().out.splitlines() == ['"run_id"', f'"{rid}"']
    assert main(["sql", "SELECT max(k_linf) FROM kv_head_metrics", *S]) == 2
    line = _one_error_line(capsys.readouterr().err, "sql")
    assert "kv_head_metrics" in line and seg.name in line


def test_debug_shows_the_traceback_and_internal_bugs_keep_theirs(filled, capsys, monkeypatch):
    store, _, _ = filled
    assert main(["sql", "SELEC 1", "--store", str(store.root), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("capturestore sql: error: ")
    # an exception that is no user error is a bug: it propagates with its traceback (exit status 1)
    import capturestore.cli as cli

    def broken(args):
        raise TypeError("a bug")

    monkeypatch.setattr(cli, "cmd_runs", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["runs", "--store", str(store.root)])


@pytest.mark.parametrize("command", ["runs", "demo"])
def test_a_store_path_under_an_unknown_users_home_is_a_one_line_error(capsys, command):
    # Path.expanduser raises RuntimeError for '~nosuchuser/...': it escaped as a traceback
    assert main([command, "--store", "~no-such-user-capturestore/s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"capturestore {command}: error: store path ~no-such-user-capturestore/s") \
        and err.count("\n") == 1, err


def test_output_paths_under_an_unknown_users_home_are_one_line_errors(kv_store, capsys):
    # Path.expanduser's RuntimeError escaped as a traceback
    store, runs = kv_store
    assert main(["sql", "SELECT 1", "--store", str(store.root), "--output", "~no-such-user-capturestore/x.csv"]) == 2
    line = _one_error_line(capsys.readouterr().err, "sql")
    assert "--output ~no-such-user-capturestore/x.csv" in line
    assert main(["calibrate", runs[0], "--store", str(store.root), "--out", "~no-such-user-capturestore/d"]) == 2
    assert "--out ~no-such-user-capturestore/d" in _one_error_line(capsys.readouterr().err, "calibrate")


def test_json_output_writes_nan_and_infinity_as_null(filled, capsys):
    # json.dumps wrote NaN / Infinity, which no JSON parser accepts
    store, _, _ = filled
    q = "SELECT 'nan'::DOUBLE AS a, 'inf'::DOUBLE AS b, [1.5, 'nan'::DOUBLE] AS c, 2.5::DOUBLE AS d"
    assert main(["sql", q, "--store", str(store.root), "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == \
        [{"a": None, "b": None, "c": [1.5, None], "d": 2.5}]


# ---- issue 17: labels printed as they are, output paths named as given, models found by any path ----
@pytest.fixture
def releases_of_a_model(tmp_path):
    """A real tiny model copied to ``tmp/work/models/m``; references and two releases' actual runs
    recorded with the relative model path ``models/m`` (as `run` records a path given relative to
    its working directory), compared logits-only; then the r2 run's release rewritten in its commit
    segment to hold a newline (a store written before labels were validated)."""
    import shutil

    from capturestore.analysis import compare_runs
    from extractors.models import model_content_hash, tiny_model

    work = tmp_path / "work"
    model = work / "models" / "m"
    shutil.copytree(tiny_model("llama-mha", seed=5), model)
    mhash = model_content_hash(model)
    store = Store.open(tmp_path / "store")
    rng = np.random.default_rng(3)
    prompts = [([1, 5, 9, 11], [4, 4, 7]), ([1, 20, 30], [8, 2, 6])]
    logits = [rng.standard_normal((3, 64)).astype(np.float32) for _ in prompts]

    def run(dtype, release=None):
        with store.begin_run(engine="hf", model_path="models/m", model_hash=mhash, dtype=dtype,
                             release=release) as w:
            for (p, c), lg in zip(prompts, logits):
                w.write_logits(w.add_prompt(p, continuation=c), lg)
        return w.run_id

    exp = run("float32")
    cids = [compare_runs(store, expected_run=exp, actual_run=run("float32", rel), kv=False).comparison_id
            for rel in ("r1", "r2")]
    r2 = store.sql(f"SELECT actual_run FROM comparisons WHERE comparison_id = '{cids[1]}'").column(0)[0].as_py()
    seg = store.root / "tables" / "runs" / f"{r2}.parquet"
    t = pq.read_table(seg)
    t = t.set_column(t.schema.get_field_index("release"), "release",
                     pa.array(["r2\nFAKE overall: PASS"], pa.string()))
    pq.write_table(t, seg)
    return store, work, model, cids


def test_a_label_holding_a_newline_is_printed_escaped_by_runs_and_history(releases_of_a_model):
    store, work, model, cids = releases_of_a_model
    for args in (["runs"], ["history", "--model", str(model), "--metric", "passed"]):
        r = _cli(*args, "--store", str(store.root), cwd=work)
        assert r.returncode == 0, r.stderr
        assert not any(line.lstrip().startswith("FAKE") for line in r.stdout.splitlines()), r.stdout
        assert "r2\\nFAKE overall: PASS" in r.stdout, r.stdout


def test_history_finds_a_model_by_any_path_naming_its_directory_or_by_its_content(releases_of_a_model, tmp_path):
    """The runs recorded ``models/m`` (relative): before issue 17 only that exact string matched."""
    store, work, model, cids = releases_of_a_model
    copy = tmp_path / "elsewhere" / "same-weights"
    import shutil

    shutil.copytree(model, copy)
    for given, cwd in ((str(model), work), ("./models/m/", work), (str(model), tmp_path), (str(copy), tmp_path),
                       ("models/m", work)):
        r = _cli("history", "--model", given, "--metric", "passed", "--store", str(store.root), cwd=cwd)
        assert r.returncode == 0, (given, cwd, r.stderr)
        assert [c for c in cids if c in r.stdout] == cids, (given, r.stdout)
    r = _cli("history", "--model", str(tmp_path / "nope"), "--store", str(store.root), cwd=work)
    assert r.returncode == 2 and "no comparison of model" in _one_error_line(r.stderr, "history")


def test_diff_and_history_output_errors_name_the_out_option_and_the_users_path(releases_of_a_model, tmp_path):
    store, work, model, cids = releases_of_a_model
    r = _cli("history", "--model", "models/m", "--metric", "passed", "--format", "html", "--out", "/proc/x.html",
             "--store", str(store.root), cwd=work)
    line = _one_error_line(r.stderr, "history")
    assert r.returncode == 2 and line.startswith("capturestore history: error: --out /proc/x.html: "), line
    assert ".tmp" not in line and not os.path.exists("/proc/x.html")
    r = _cli("history", "--model", "models/m", "--metric", "passed", "--format", "json", "--out",
             str(tmp_path / "no-dir" / "h.json"), "--store", str(store.root), cwd=work)
    line = _one_error_line(r.stderr, "history")
    assert f"--out {tmp_path / 'no-dir' / 'h.json'}: directory {tmp_path / 'no-dir'} does not exist" in line, line
    r = _cli("diff", cids[0], cids[1], "--format", "json", "--out", str(tmp_path / "no-dir" / "d.json"),
             "--store", str(store.root))
    line = _one_error_line(r.stderr, "diff")
    assert f"--out {tmp_path / 'no-dir' / 'd.json'}: directory" in line and "--output" not in line, line


def test_the_script_exits_with_the_commands_status_after_pythons_own_shutdown_steps(kv_store, tmp_path):
    # console_main leaves by os._exit (Arrow's native teardown can abort a finished command with SIGABRT):
    # what a normal exit does first must still happen: non-daemon threads joined, atexit callbacks run,
    # every byte of output flushed, the command's status kept
    store, (expected, _) = kv_store
    marks = tmp_path / "marks"
    marks.mkdir()
    code = ("import atexit, sys, threading, time\n"
            "from pathlib import Path\n"
            "marks = Path(sys.argv.pop())\n"
            "atexit.register((marks / 'atexit').write_text, 'ran')\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), (marks / 'thread').write_text('ran'))).start()\n"
            "from capturestore.cli import console_main\n"
            "console_main()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args, status in ((["show", expected, "--store", str(store.root)], 0),
                         (["show", "no-such-run", "--store", str(store.root)], 2)):
        for f in marks.iterdir():
            f.unlink()
        r = subprocess.run([sys.executable, "-c", code, *args, str(marks)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == status, (args, r.stdout, r.stderr)
        assert (marks / "atexit").read_text() == "ran" and (marks / "thread").read_text() == "ran", args
        if status == 0:  # the whole table, to its last row: flushed before os._exit
            assert f"run_id: {expected}" in r.stdout and r.stdout.endswith("(4 rows)\n"), r.stdout
        else:
            assert _one_error_line(r.stderr, "show") and "no-such-run" in r.stderr, r.stderr


def test_a_reader_that_closes_the_pipe_is_no_error(filled, tmp_path):
    """`capturestore show RUN | head -2`: the reader leaves before the output ends. `show` said
    "error: [Errno 32] Broken pipe" and exited 2; a command whose last buffer met the closed pipe
    exited 1 in silence. Now both exit 141 (128 + SIGPIPE, as a shell reports a tool the pipe
    stopped) with nothing on stderr, whether the pipe closes during the output (1.4 MB of `sql`)
    or at its last flush (a few lines of `runs`, `show`)."""
    store, run_id, _ = filled
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (["sql", "SELECT range FROM range(200000)"], ["runs"], ["show", run_id]):
        p = subprocess.Popen([sys.executable, "-m", "capturestore.cli", *argv, "--store", str(store.root)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        p.stdout.close()  # the reader gone before the first write
        with p.stderr:
            err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", (argv, p.returncode, err)


def test_a_negative_demo_seed_is_refused_before_any_model_is_built(tmp_path, capsys, monkeypatch):
    """numpy's "expected non-negative integer" named neither the option nor the command."""
    import extractors.models

    monkeypatch.setattr(extractors.models, "tiny_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["demo", "--store", str(tmp_path / "s"), "--seed", "-1"]) == 2
    line = _one_error_line(capsys.readouterr().err, "demo")
    assert "seed must be a non-negative integer, got -1" in line
    assert not (tmp_path / "s").exists()


def test_a_path_of_the_wrong_kind_is_named_as_such(filled, tmp_path, capsys):
    """--model FILE said "no such directory", --prompts DIR "no such file", --output FILE/x.csv
    "directory FILE does not exist": each path exists, of the other kind."""
    store, _, _ = filled
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a prompt\n")
    assert main(["sql", "SELECT 1", "--store", str(store.root), "--output", str(a_file / "x.csv")]) == 2
    assert f"{a_file} is a file, not a directory" in _one_error_line(capsys.readouterr().err, "sql")
    assert main(["run", "--model", str(a_file), "--prompts", str(prompts), "--store", str(tmp_path / "s")]) == 2
    assert f"--model {a_file}: a file, not a model directory" in _one_error_line(capsys.readouterr().err, "run")
    from extractors.models import tiny_model

    model = tiny_model("llama-gqa")  # a model directory, so that the prompts are checked
    assert main(["run", "--model", str(model), "--prompts", str(tmp_path), "--store", str(tmp_path / "s")]) == 2
    assert f"--prompts {tmp_path}: a directory, not a prompt file" in _one_error_line(capsys.readouterr().err, "run")
    # an empty path is no path (it read as the working directory: "--model .: no config.json")
    assert main(["run", "--model", "", "--prompts", str(prompts), "--store", str(tmp_path / "s")]) == 2
    assert "--model is empty" in _one_error_line(capsys.readouterr().err, "run")
    assert main(["run", "--model", str(model), "--prompts", " ", "--store", str(tmp_path / "s")]) == 2
    assert "--prompts is empty" in _one_error_line(capsys.readouterr().err, "run")
    assert a_file.read_text() == "x" and not (tmp_path / "s").exists()
