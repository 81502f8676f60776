"""The contract every storage backend keeps (capturestore/backends.py): a directory, an S3 bucket
(moto's server, reached over HTTP) and memory. The same run written, read back bit-exact,
queried, verified and collected; the same corruption found by ``verify`` on each, with the same
kind of problem. Before one verify (integrity.verify over the Backend interface) served both, a
bucket's verify missed a changed dtype and a missing group (measured in issue 19)."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from capturestore import Store
from capturestore.backends import Backend, LocalBackend, MemoryBackend, backend_for
from capturestore.objectstore import S3Backend
from tests.capturestore.s3server import make_bucket, moto_endpoint, s3_env  # noqa: F401
from tests.capturestore.writer_proc import PROMPT_LEN, prompt_data

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BACKENDS = ("local", "s3", "memory")


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return f"s3://{make_bucket()}/store"
    return f"memory://contract-{uuid.uuid4().hex[:12]}"


def _write_run(store: Store, seed: int, n_prompts: int = 2) -> tuple[str, list[str]]:
    pids = []
    with store.begin_run(engine="test", model_path=f"seed{seed}") as run:
        for i in range(n_prompts):
            d = prompt_data(seed, i)
            pid = run.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
            run.write_kv(pid, d["k"], d["v"])
            run.write_logits(pid, d["logits"])
            pids.append(pid)
    return run.run_id, pids


def test_backend_for_maps_each_kind_of_location(store_url, tmp_path):
    b = backend_for(store_url)
    assert isinstance(b, Backend)
    want = {"s3": S3Backend, "memory": MemoryBackend}.get(store_url.split("://")[0], LocalBackend)
    assert type(b) is want
    assert type(backend_for(f"file://{tmp_path}")) is LocalBackend


def test_a_run_round_trips_and_verifies_on_every_backend(store_url):
    store = Store.open(store_url)
    run_id, pids = _write_run(store, seed=5)
    again = Store.open(store_url, create=False)  # a second client sees the committed run
    for i, pid in enumerate(pids):
        d = prompt_data(5, i)
        k, v = again.read_kv(run_id, pid)
        assert k.view(np.uint16).tobytes() == d["k"].view(np.uint16).tobytes()
        assert v.view(np.uint16).tobytes() == d["v"].view(np.uint16).tobytes()
        assert np.array_equal(again.read_logits(run_id, pid), d["logits"])
        assert np.array_equal(again.read_tokens(run_id, pid), d["tokens"].astype(np.int32))
    rows = again.sql("SELECT prompt_id FROM prompts WHERE run_id = $r ORDER BY prompt_idx", params={"r": run_id})
    assert [r["prompt_id"] for r in rows.to_pylist()] == pids
    assert again.sql("SELECT count(*) AS n FROM captures").to_pylist() == [{"n": 8}]
    report = again.verify()
    assert report.ok and report.checked_arrays == 8, report.summary()
    assert again.gc() == [] and again.pending() == []


def _edit_meta(b: Backend, rel: str, edit) -> None:
    meta = json.loads(b.read(rel))
    edit(meta)
    b.put(rel, json.dumps(meta).encode())


def _flip_byte(b: Backend, rel: str) -> None:
    data = bytearray(b.read(rel))
    data[len(data) // 2] ^= 0xFF
    b.put(rel, bytes(data))


# fault -> (what it does to the store's bytes, the problems verify must report: (kind, array or None))
FAULTS = {
    "logical-dtype": (lambda b, a: _edit_meta(b, f"{a}/kv_k/zarr.json",
                                              lambda m: m["attributes"].update(logical_dtype="float16")),
                      [("dtype-mismatch", "kv_k")]),
    "zarr-data-type": (lambda b, a: _edit_meta(b, f"{a}/kv_k/zarr.json", lambda m: m.update(data_type="int16")),
                       [("dtype-mismatch", "kv_k")]),
    "run-group": (lambda b, a: b.remove([f"{a.rsplit('/', 1)[0]}/zarr.json"]), [("missing-group", None)]),
    "prompt-group": (lambda b, a: b.remove([f"{a}/zarr.json"]), [("missing-group", None)]),
    "flipped-chunk": (lambda b, a: _flip_byte(b, min(b.find(f"{a}/kv_v/c"))),
                      [("corrupt-chunk", "kv_v")]),
    "deleted-chunk": (lambda b, a: b.remove([min(b.find(f"{a}/logits/c"))]), [("corrupt-chunk", "logits")]),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_backend_finds_the_same_corruption(store_url, fault):
    store = Store.open(store_url)
    run_id, pids = _write_run(store, seed=7)
    assert store.verify().ok
    b = store.backend
    prompt = f"arrays.zarr/{run_id}/{pids[0]}"
    before = {k: b.read(k) for k in b.find(f"arrays.zarr/{run_id}")}
    inject, want = FAULTS[fault]
    inject(b, prompt)
    after = {k: b.read(k) for k in b.find(f"arrays.zarr/{run_id}")}
    assert after != before  # the fault changed what is stored
    report = Store.open(store_url, create=False).verify()
    assert [(p.kind, p.array) for p in report] == want, report.summary()
    assert all(p.run_id == run_id for p in report), report.summary()
    if fault == "prompt-group":
        assert report[0].prompt_id == pids[0]


def _scaled_run(store: Store, scale: float, dtype: str = "bfloat16") -> str:
    """The same prompts, K/V and logits scaled (two runs of it compare as nearly equal)."""
    import ml_dtypes

    with store.begin_run(engine="test", model_path="m", dtype=dtype) as w:
        for i in range(2):
            d = prompt_data(5, i)
            pid = w.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
            w.write_kv(pid, (d["k"].astype(np.float32) * scale).astype(ml_dtypes.bfloat16),
                       (d["v"].astype(np.float32) * scale).astype(ml_dtypes.bfloat16))
            w.write_logits(pid, d["logits"] * scale)
    return w.run_id


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_every_backend_checks_a_comparisons_evidence_against_its_manifest(store_url, how):
    """test_evidence's checks, on every backend: a segment the manifest lists, deleted or cut
    short through the backend, fails the queries that read it, ``check_evidence`` and ``verify``."""
    from capturestore.analysis import compare_runs
    from capturestore.errors import QueryError, StoreError

    store = Store.open(store_url)
    exp = _scaled_run(store, 1.0)
    c1 = compare_runs(store, expected_run=exp, actual_run=_scaled_run(store, 1.002))
    c2 = compare_runs(store, expected_run=exp, actual_run=_scaled_run(store, 1.05))
    assert store.verify().ok
    b = store.backend
    (seg,) = [n for n in b.segment_names("kv_head_metrics")
              if c2.comparison_id in (store.segment_comparison_ids("kv_head_metrics", n) or set())]
    rel = f"tables/kv_head_metrics/{seg}"
    data = b.read(rel)
    if how == "deleted":
        b.remove([rel])
    else:
        b.put(rel, data[: len(data) // 2])
    assert b.read_many([rel])[rel] != data  # the fault is in place
    fresh = Store.open(store_url, create=False)
    with pytest.raises(QueryError, match="kv_head_metrics"):
        fresh.sql("SELECT count(*) FROM kv_head_metrics WHERE comparison_id = $c", params={"c": c2.comparison_id})
    with pytest.raises(StoreError, match="evidence incomplete: .*kv_head_metrics"):
        fresh.check_evidence([c2.comparison_id], "diff")
    if how == "deleted":  # (a cut-short segment makes the whole table unreadable, for every comparison)
        fresh.check_evidence([c1.comparison_id], "diff")  # the other comparison's evidence is whole
    kinds = [p.kind for p in fresh.verify()]
    want = {"deleted": ["missing-segment"], "truncated": ["bad-segment", "altered-segment"]}[how]
    assert sorted(kinds) == sorted(want), kinds
