"""Fixtures for store tests: real store directories on disk, real subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capturestore import Store
from tests.capturestore.s3server import moto_endpoint, s3_env, s3_url  # noqa: F401 - one moto server per session

REPO = Path(__file__).resolve().parents[2]
WRITER_SCRIPT = Path(__file__).with_name("writer_proc.py")


@pytest.fixture
def mkdirs(monkeypatch):
    """Every os.mkdir call's path, in order."""
    made: list[str] = []
    real = os.mkdir

    def counting(path, *a, **kw):
        made.append(os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", counting)
    return made


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "store")


def start_writer(store_path: Path, *args: str, **kw) -> subprocess.Popen:
    """Start tests/capturestore/writer_proc.py against ``store_path`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(WRITER_SCRIPT), str(store_path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE,
                            env=env, text=True, **kw)
