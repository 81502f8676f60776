"""The committed format-2 store (tests/fixtures/format2_store: today's format, written by
tests/fixtures/make_format2_store.py) keeps reading: its arrays bit for bit, every public view with
exactly its declared, versioned columns, its comparison, aggregation over it, and the SQL examples
of the docs run on it. A format change must keep this test green (a migration or a reader for
both), as test_format.py does for format 1."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from capturestore import Store
from capturestore.aggregate import aggregate_bc
from capturestore.comparators import declared_tables
from capturestore.layout import FORMAT_FILE
from capturestore.tables import SCHEMAS

from tests.fixtures import format2_data as F2

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "format2_store"
# views of the fixture that carry declared schemas, and the version each was written with
WRITTEN = {"comparisons": 2, "logit_token_metrics": 1, "kv_head_metrics": 1, "kv_token_bc": 1, "kv_gen_bc": 1,
           "kv_layer_verdicts": 1, "raw_errors": 1}


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("f2") / "store"
    shutil.copytree(FIXTURE, root)
    (root / "pending").mkdir()  # git keeps no empty directory
    return Store.open(root, create=False)


def _runs(store):
    return {r["dtype"] + ("-" + r["release"] if r["release"] else "") + "-" + r["engine"]: r["run_id"]
            for r in store.runs().to_pylist()}


def test_the_fixture_is_format_2_and_reads_bit_exactly(store):
    assert json.loads((FIXTURE / FORMAT_FILE).read_text())["format_version"] == 2
    runs = _runs(store)
    roles = {"baseline": runs["float32-hf"], "expected": runs["bfloat16-hf"],
             "actual": runs["bfloat16-fixture-r1-vllm"]}
    for role, rid in roles.items():
        pids = store.prompts(rid).column("prompt_id").to_pylist()
        for i, pid in enumerate(pids):
            want = F2.run_arrays(role, i)
            k, v = store.read_kv(rid, pid)
            assert k.dtype == want["kv_k"].dtype and np.array_equal(bits(k), bits(want["kv_k"]))
            assert np.array_equal(bits(v), bits(want["kv_v"]))
            assert np.array_equal(bits(store.read_logits(rid, pid)), bits(want["logits"]))
            assert store.read_tokens(rid, pid).tolist() == F2.PROMPTS[i][0] + F2.PROMPTS[i][1]
    assert store.verify().ok, store.verify().summary()


@pytest.mark.parametrize("view", sorted(WRITTEN))
def test_every_view_shows_exactly_its_declared_columns(store, view):
    spec = declared_tables()[view]
    assert spec.version >= WRITTEN[view], f"{view}: declared version {spec.version} is older than the fixture's"
    got = store.sql(f"DESCRIBE {view}").column("column_name").to_pylist()
    assert got == spec.schema.names
    assert store.sql(f"SELECT count(*) FROM {view}").column(0)[0].as_py() > 0
    # columns declared after the fixture's version are absent from its segments and read NULL there
    import pyarrow.parquet as pq

    written = set().union(*(pq.read_schema(f).names for f in (FIXTURE / "tables" / view).glob("*.parquet")
                            if f.name != "_schema.parquet"))
    added = [c for c in spec.schema.names if c not in written]
    assert bool(added) == (spec.version > WRITTEN[view]), (view, added)  # a version bump adds columns
    for c in added:
        assert store.sql(f"SELECT count({c}) FROM {view}").column(0)[0].as_py() == 0, (view, c)


@pytest.mark.parametrize("view", sorted(SCHEMAS))
def test_run_views_show_their_declared_columns(store, view):
    got = store.sql(f"DESCRIBE {view}").column("column_name").to_pylist()
    assert got[: len(SCHEMAS[view].names)] == SCHEMAS[view].names


def test_the_stored_comparison_reads_and_aggregates_like_the_arrays(store):
    from metrics.kv import aggregate_kv_bc_arrays, compare_kv_caches

    row = store.sql("SELECT * FROM comparisons").to_pylist()
    assert len(row) == 1 and row[0]["passed"] is True and row[0]["label"] == "format-2 fixture"
    cid = row[0]["comparison_id"]
    got = aggregate_bc(store, cid, "SELECT DISTINCT prompt_id FROM prompts")
    raws, lens = [], []
    for i, (p, _) in enumerate(F2.PROMPTS):  # from the regenerated arrays: no store involved
        kv = {role: {n: (F2.run_arrays(role, i)["kv_k"][li][None], F2.run_arrays(role, i)["kv_v"][li][None])
                     for li, n in enumerate(F2.LAYER_NAMES)} for role in ("baseline", "expected", "actual")}
        raws.append(compare_kv_caches(kv["expected"], kv["actual"], baseline_kv=kv["baseline"],
                                      return_raw_errors=True)[1])
        lens.append(len(p))
    layers, k_bc, v_bc = aggregate_kv_bc_arrays(raws, lens)
    assert list(got.layers) == layers
    np.testing.assert_allclose(got.k_bc, k_bc, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.v_bc, v_bc, rtol=0, atol=1e-12)


def _sql_blocks(doc: str) -> list[str]:
    return re.findall(r"```sql\n(.*?)```", (ROOT / "docs" / doc).read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["tables.md", "diff.md"])
def test_the_sql_examples_of_the_docs_run_on_the_fixture(store, doc):
    blocks = _sql_blocks(doc)
    assert blocks, f"docs/{doc} has no ```sql example"
    for block in blocks:
        for stmt in [s.strip() for s in block.split(";") if s.strip() and not
                     all(ln.strip().startswith("--") for ln in s.strip().splitlines())]:
            t = store.sql(stmt)
            assert t.num_rows > 0, f"docs/{doc}: example returns no row on the fixture:\n{stmt}"
