"""`capturestore report` bad input: one line on stderr, exit status 2, nothing written."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from capturestore import Store
from tests.reports.conftest import REPO


def _report(store_root, cid, out, *extra, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-m", "capturestore.cli", "report", cid, "--store", str(store_root),
                           "--out", str(out), *extra], capture_output=True, text=True, cwd=REPO, timeout=120)


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("capturestore report: error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


def test_unknown_comparison_lists_the_latest_ones(compared, tmp_path):
    line = _one_error_line(_report(compared["store"].root, "cmp-nope", tmp_path / "out"))
    assert "no comparison 'cmp-nope'" in line
    assert compared["ok"].comparison_id in line and compared["bug"].comparison_id in line
    assert not (tmp_path / "out").exists()


def test_comparison_whose_runs_were_removed(compared, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(compared["store"].root, copy)
    actual = compared["ok"].runs["actual"]
    (copy / "tables" / "runs" / f"{actual}.parquet").unlink()
    line = _one_error_line(_report(copy, compared["ok"].comparison_id, tmp_path / "out"))
    assert f"actual run {actual}" in line and "no longer in" in line
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file(compared, tmp_path):
    (tmp_path / "f").write_text("keep me")
    line = _one_error_line(_report(compared["store"].root, compared["ok"].comparison_id, tmp_path / "f"))
    assert "is not a directory" in line and (tmp_path / "f").read_text() == "keep me"


def test_output_that_cannot_be_created(compared):
    # /proc refuses a new directory even to root (CI runs as root: permission bits do not stop it)
    line = _one_error_line(_report(compared["store"].root, compared["ok"].comparison_id, "/proc/capturestore-report"))
    assert "cannot be written" in line


def test_output_directory_that_cannot_be_written(compared, tmp_path, read_only_prefix):
    # an existing directory: check_out_dir must probe it by writing, and leave it as it was.
    # Mode 555 stops a non-root user; root ignores permission bits (CI runs as root), so there the
    # directory is bind-mounted read-only in a private mount namespace instead.
    d = tmp_path / "ro"
    if os.geteuid() == 0:
        d.mkdir()
        prefix = read_only_prefix(d)
    else:
        d.mkdir(mode=0o555)
        prefix = ()
    r = _report(compared["store"].root, compared["ok"].comparison_id, d, prefix=prefix)
    assert "Traceback" not in r.stderr, r.stderr
    line = _one_error_line(r)
    assert f"output directory {d} cannot be written" in line, line
    assert d.is_dir() and list(d.iterdir()) == []


def test_empty_comparison(tmp_path):
    store = Store.open(tmp_path / "store")
    store.append_table("comparisons", {"comparison_id": ["cmp-empty"], "label": ["nothing"],
                                       "created_at": [datetime.now(timezone.utc)], "passed": [False]})
    line = _one_error_line(_report(store.root, "cmp-empty", tmp_path / "out"))
    assert "cmp-empty holds no metrics" in line
    assert not (tmp_path / "out").exists()


def test_report_prints_the_index_path_and_exits_0(compared, tmp_path):
    r = _report(compared["store"].root, compared["bug"].comparison_id, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "out" / "index.html")


@pytest.mark.parametrize("cid", ["cmp-x", "x' OR '1'='1"])
def test_store_without_comparisons(tmp_path, cid):
    store = Store.open(tmp_path / "store")
    line = _one_error_line(_report(store.root, cid, tmp_path / "out"))
    assert f"no comparison {cid!r}" in line and "the store holds no comparison" in line
    assert not (tmp_path / "out").exists()


def test_a_diff_base_that_is_empty_or_the_comparison_itself_is_refused(compared, tmp_path):
    """--diff-base '' was read as no --diff-base (index.html written); --diff-base C for comparison C
    wrote diff.html of C against itself (diff refuses it). Both: one line, nothing written."""
    cid = compared["bug"].comparison_id
    line = _one_error_line(_report(compared["store"].root, cid, tmp_path / "out", "--diff-base", ""))
    assert "--diff-base is empty" in line
    line = _one_error_line(_report(compared["store"].root, cid, tmp_path / "out", "--diff-base", cid))
    assert f"--diff-base {cid} is the comparison itself" in line
    assert not (tmp_path / "out").exists()
    r = _report(compared["store"].root, cid, tmp_path / "out", "--diff-base", compared["ok"].comparison_id)
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "out" / "diff.html"), r.stderr
