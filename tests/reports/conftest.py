"""Fixtures for report tests: one real store with a passing and a failing three-way comparison."""
from __future__ import annotations

from pathlib import Path

import pytest

from capturestore import Store
from tests.reports.synthetic import make_comparison

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def compared(tmp_path_factory) -> dict:
    """{"store": Store, "ok": ComparisonResult (passes), "bug": ComparisonResult (KV bug from layer 2)}."""
    store = Store.open(tmp_path_factory.mktemp("report-store") / "store")
    ok = make_comparison(store, label="ok", seed=0)
    bug = make_comparison(store, label="bug <b>label</b>", bug_layer=2, seed=0)
    assert ok.passed and not bug.passed  # the premise of every test below
    return {"store": store, "ok": ok, "bug": bug}
