"""Comparators as map/reduce, and a comparison's rows written as they come.

- The committed format-2 fixture's comparison (written by the code of its day, which kept every
  row until the end and comparator state in ``self``) recomputed today, one prompt's rows per
  segment, is the same row for row in every table: an oracle the refactor did not write.
- ``map`` leaves every built-in comparator as ``prepare`` left it (so a Dask worker can run
  every prompt through the same prepared comparators); a comparator that keeps evidence in
  ``self`` is refused on a worker in one line naming it, one that keeps none runs there.
- Rows written before the comparison commits are in no view while it runs, and a comparison
  interrupted after some of its segments leaves none of them.
"""
from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from capturestore import Store, analysis
from capturestore.analysis import compare_prompt, compare_runs
from capturestore.comparators import Comparator, ComparisonContext, comparator_class

FIXTURE = Path(__file__).parents[2] / "tests" / "fixtures" / "format2_store"
TABLES = ["logit_token_metrics", "kv_head_metrics", "kv_token_bc", "kv_gen_bc", "kv_layer_verdicts", "raw_errors"]
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MODULES = ["model.layers.0.mlp", "model.layers.1.mlp"]


def _key(v):
    return (0, "") if v is None else (1, "nan") if isinstance(v, float) and math.isnan(v) else (2, repr(v))


def _rows(store, table, cid):
    rows = store.sql(f"SELECT * EXCLUDE (comparison_id) FROM {table} WHERE comparison_id = ?", params=[cid]).to_pylist()
    return sorted(rows, key=lambda r: [_key(v) for v in r.values()])


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def fixture_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mr") / "store"
    shutil.copytree(FIXTURE, root)
    (root / "pending").mkdir()  # git keeps no empty directory
    return Store.open(root)


def test_the_fixture_comparison_recomputed_one_prompt_per_segment_is_the_committed_one(fixture_store, monkeypatch):
    store = fixture_store
    (old,) = store.sql("SELECT * FROM comparisons").to_pylist()
    monkeypatch.setattr(analysis, "ROWS_HELD_PROMPTS", 1)  # every prompt's rows written on their own
    new = compare_runs(store, expected_run=old["expected_run"], actual_run=old["actual_run"],
                       baseline_run=old["baseline_run"], label=old["label"], comparators=["raw_errors"])
    n_prompts = old["n_prompts"]
    assert n_prompts > 1 and new.passed is True
    for table in TABLES:
        want, got = _rows(store, table, old["comparison_id"]), _rows(store, table, new.comparison_id)
        assert want, table
        assert _same(want, got), f"{table}: the recomputed rows differ from the committed ones"
    (row,) = store.sql("SELECT * FROM comparisons WHERE comparison_id = ?", params=[new.comparison_id]).to_pylist()
    newer = ("judged", "manifest_tables", "manifest_segments", "manifest_rows", "manifest_sha256")  # schema 4: NULL there
    for col, value in old.items():  # every column the fixture's row has (its schema is version 2)
        if col not in ("comparison_id", "created_at", *newer):
            assert _same(row[col], value), col
    segments = dict.fromkeys(row["manifest_tables"], 0)
    for t in row["manifest_tables"]:
        segments[t] += 1
    assert segments["logit_token_metrics"] == segments["raw_errors"] == n_prompts  # written as they came
    assert segments["kv_gen_bc"] == 1  # reduce's rows, once
    assert store.verify().ok, store.verify().summary()


def _synthetic(store):
    rng = np.random.default_rng(3)
    prompts = [(rng.integers(1, 64, 5 + i).tolist(), rng.integers(1, 64, 3).tolist()) for i in range(3)]
    data = [(rng.standard_normal((2, 2, len(p) + len(c), 8)).astype(np.float32),
             rng.standard_normal((2, 2, len(p) + len(c), 8)).astype(np.float32),
             rng.standard_normal((len(c), 64)).astype(np.float32),
             [rng.standard_normal((len(p) + len(c), 8)).astype(np.float32) for _ in MODULES]) for p, c in prompts]
    ids = {}
    for role, dtype, scale in (("baseline", "float32", 1.0), ("expected", "bfloat16", 1.0),
                               ("actual", "bfloat16", 1.02)):
        cast = (lambda x: x.astype(ml_dtypes.bfloat16)) if dtype == "bfloat16" else (lambda x: x)
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h", dtype=dtype) as run:
            for (p, c), (k, v, lg, ts) in zip(prompts, data):
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(k * scale), cast(v), layer_names=LAYERS)
                run.write_logits(pid, cast(lg * scale))
                for m, t in zip(MODULES, ts):
                    run.write_tensor(pid, m, cast(t * scale), step=0, phase="prefill")
        ids[role] = run.run_id
    return ids


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    store = Store.open(tmp_path_factory.mktemp("mr") / "syn")
    return store, _synthetic(store)


def _state(c) -> bytes:
    from capturestore.distributed import comparator_state

    return comparator_state(c)


def test_map_leaves_every_builtin_comparator_as_prepared_and_its_partials_carry_the_evidence(synthetic):
    store, runs = synthetic
    pids = store.prompts(runs["expected"]).column("prompt_id").to_pylist()
    context = ComparisonContext(store, "cmp-maptest", runs, pids)
    active = [comparator_class(n)() for n in ("logits", "kv", "modules", "raw_errors")]
    for c in active:
        c.prepare(context)
    before = [_state(c) for c in active]
    results = [compare_prompt(context, active, pid) for pid in pids]
    assert [_state(c) for c in active] == before  # nothing kept in self between prompts
    for c, per_prompt in zip(active, zip(*results)):
        assert all(r.rows for r in per_prompt), c.name  # every prompt gave rows
        if c.name != "raw_errors":  # evidence only: it judges nothing, so it has no partial
            assert all(r.partial is not None for r in per_prompt), c.name
    logits = active[0]
    assert logits.reduce([r[0].partial for r in results]) == {}
    assert len(logits.per_prompt) == len(pids)  # the verdict's evidence came from the partials alone
    assert logits.verdict().passed is False  # logits scaled by 1.02: judged, and failed


class KeepsState(Comparator):
    name = "keeps_state"

    def prepare(self, context):
        super().prepare(context)
        self.seen = []

    def compare(self, prompt):
        self.seen.append(prompt.prompt_id)  # evidence in self: it would stay on the worker
        return {}


class KeepsNothing(Comparator):
    name = "keeps_nothing"

    def compare(self, prompt):
        return {}


def test_a_worker_refuses_a_comparator_keeping_evidence_in_self_and_runs_one_keeping_none(synthetic):
    from capturestore.distributed import _prompt_task

    store, runs = synthetic
    pids = store.prompts(runs["expected"]).column("prompt_id").to_pylist()
    context = ComparisonContext(store, "cmp-worker1", runs, pids)
    fine = [comparator_class("logits")(), KeepsNothing()]
    for c in fine:
        c.prepare(context)
    first = _prompt_task("cmp-worker1", pickle.dumps((context, fine)), pids[0])
    again = _prompt_task("cmp-worker1", pickle.dumps((context, fine)), pids[0])  # the same worker state, reused
    assert len(first[0].rows["logit_token_metrics"]) == 3 and first[1].rows == {}
    assert first[0].rows == again[0].rows
    bad = [comparator_class("logits")(), KeepsState()]
    for c in bad:
        c.prepare(ComparisonContext(store, "cmp-worker2", runs, pids))
    with pytest.raises(ValueError, match=r"^comparator keeps_state changed its own state while comparing prompt "):
        _prompt_task("cmp-worker2", pickle.dumps((context, bad)), pids[0])


def test_rows_written_before_the_commit_are_in_no_view_and_an_interrupted_comparison_leaves_none(synthetic,
                                                                                                 monkeypatch):
    store, runs = synthetic
    monkeypatch.setattr(analysis, "ROWS_HELD_PROMPTS", 1)
    real = Store.append_table
    seen = []

    def append_table(self, name, rows):
        if len(seen) == 4:  # two prompts' rows written: the comparison is interrupted at the next write
            raise KeyboardInterrupt
        seg = real(self, name, rows)
        other = Store.open(self.root)  # another reader, through the views
        seen.append((name, other.sql(f"SELECT count(*) AS n FROM {name}").column("n")[0].as_py()))
        return seg

    before = {t: len(list((store.root / "tables" / t).glob("*.parquet"))) for t in ("logit_token_metrics",)}
    monkeypatch.setattr(Store, "append_table", append_table)
    with pytest.raises(KeyboardInterrupt):
        compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"], baseline_run=runs["baseline"])
    monkeypatch.setattr(Store, "append_table", real)
    assert [n for _, n in seen] == [0, 0, 0, 0]  # written, never visible
    assert {t: len(list((store.root / "tables" / t).glob("*.parquet"))) for t in before} == before
    assert not any((store.root / "pending").iterdir())
    assert store.verify().ok, store.verify().summary()
    assert store.gc() == []
