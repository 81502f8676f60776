"""The contract every storage backend keeps (capturestore/backends.py): a directory, an S3 bucket
(moto's server, reached over HTTP) and memory. The same run written, read back bit-exact,
queried, verified and collected; the same corruption found by ``verify`` on each, with the same
kind of problem. Before one verify (integrity.verify over the Backend interface) served both, a
bucket's verify missed a changed dtype and a missing group (measured in issue 19)."""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import numpy as np
import pytest

from capturestore import Store
from capturestore.backends import Backend, LocalBackend, MemoryBackend, backend_for
from capturestore.objectstore import S3Backend
from tests.capturestore.s3server import make_bucket
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
def _first_chunk(b: Backend, array: str) -> str:
    """The first chunk (or shard) object of an array, by key, whichever separator it uses."""
    return min(k for k in b.find(array) if not k.endswith("/zarr.json"))


FAULTS = {
    "logical-dtype": (lambda b, a: _edit_meta(b, f"{a}/kv_k/zarr.json",
                                              lambda m: m["attributes"].update(logical_dtype="float16")),
                      [("dtype-mismatch", "kv_k")]),
    "zarr-data-type": (lambda b, a: _edit_meta(b, f"{a}/kv_k/zarr.json", lambda m: m.update(data_type="int16")),
                       [("dtype-mismatch", "kv_k")]),
    "run-group": (lambda b, a: b.remove([f"{a.rsplit('/', 1)[0]}/zarr.json"]), [("missing-group", None)]),
    "prompt-group": (lambda b, a: b.remove([f"{a}/zarr.json"]), [("missing-group", None)]),
    "flipped-chunk": (lambda b, a: _flip_byte(b, _first_chunk(b, f"{a}/kv_v")), [("corrupt-chunk", "kv_v")]),
    "deleted-chunk": (lambda b, a: b.remove([_first_chunk(b, f"{a}/logits")]), [("corrupt-chunk", "logits")]),
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


# ---- crash and concurrency: the commit protocol on every backend -----------------------------
# Which case runs where, and why:
# - writers in other processes, one SIGKILLed in the middle of its commit (prompts and captures
#   segments written, the runs marker not): local and S3. A memory:// store lives in the memory
#   of one process: no other process can open it, so none can write to it or be killed in it.
# - the same protocol in one process: two writers interleaved prompt by prompt with a reader between
#   the steps (every backend), and a writer dying in the middle of its commit (memory: its lock
#   object no longer held is how a memory store's writer is dead; a directory's writer is dead when
#   the kernel drops its flock, a bucket's when its lease runs out: both need the process to end,
#   which the SIGKILL case does for real).
DISK_BACKENDS = ("local", "s3")
CAPTURES_PER_PROMPT = 4  # tokens, kv_k, kv_v, logits


@pytest.fixture(params=DISK_BACKENDS)
def disk_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return f"s3://{make_bucket()}/store"


def _visible(url: str) -> set[str]:
    """The runs a fresh client sees, each whole (all its prompts and captures), and no row of a
    run it does not see. Rows are read before runs: a row seen belongs to a run committed by then."""
    store = Store.open(url, create=False)
    rows = {t: {r["run_id"]: r["n"] for r in store.sql(f"SELECT run_id, count(*) AS n FROM {t} GROUP BY run_id")
                .to_pylist()} for t in ("prompts", "captures")}
    runs = {r["run_id"]: r["n_prompts"] for r in store.runs().to_pylist()}
    for t, per_run in rows.items():
        assert set(per_run) <= set(runs), (t, per_run, runs)  # no row of a run that is not committed
    late = set(runs) - set(rows["prompts"])
    fresh = Store.open(url, create=False) if late else None  # runs committed since the rows were read
    for t in rows if late else ():
        rows[t].update({r["run_id"]: r["n"] for r in fresh.sql(f"SELECT run_id, count(*) AS n FROM {t} GROUP BY run_id")
                        .to_pylist() if r["run_id"] in late})
    for rid, n in runs.items():
        assert rows["prompts"].get(rid) == n and rows["captures"].get(rid) == CAPTURES_PER_PROMPT * n, rid
    return set(runs)


def _assert_holds(store: Store, run_id: str, seed: int, n_prompts: int) -> None:
    """The oracle is writer_proc.prompt_data, recomputed here, not read from the store."""
    rows = sorted(store.prompts(run_id).to_pylist(), key=lambda p: p["prompt_idx"])
    assert len(rows) == n_prompts
    for i, p in enumerate(rows):
        d = prompt_data(seed, i)
        k, v = store.read_kv(run_id, p["prompt_id"])
        assert k.view(np.uint16).tobytes() == d["k"].view(np.uint16).tobytes()
        assert v.view(np.uint16).tobytes() == d["v"].view(np.uint16).tobytes()
        assert np.array_equal(store.read_logits(run_id, p["prompt_id"]), d["logits"])
        assert np.array_equal(store.read_tokens(run_id, p["prompt_id"]), d["tokens"].astype(np.int32))


def _keys_of(b: Backend, run_id: str) -> list[str]:
    return [k for k in b.find("") if run_id in k]


def _assert_collected(store: Store, run_id: str) -> None:
    report = store.verify()
    assert [(p.kind, p.run_id) for p in report] == [("orphan", run_id)], report.summary()
    removed = store.gc()
    assert {f"arrays.zarr/{run_id}", f"tables/prompts/{run_id}.parquet", f"tables/captures/{run_id}.parquet"} \
        <= set(removed), removed
    assert _keys_of(store.backend, run_id) == []
    assert store.verify().ok and store.gc() == []


def test_a_writer_sigkilled_mid_commit_is_never_visible_and_gc_collects_it(disk_url, monkeypatch):
    from tests.capturestore.conftest import start_writer

    # a bucket's dead writer: dead once its lease ran out; the live one's heartbeat (lease / 3) and
    # the server's whole-second stamps need the slack of a 5 s lease on a loaded machine
    monkeypatch.setenv("CAPTURESTORE_LEASE_S", "5")
    store = Store.open(disk_url)
    good, _ = _write_run(store, seed=5)
    p = start_writer(disk_url, "hold-commit")
    line = p.stdout.readline().split()
    assert line and line[0] == "committing", p.stderr.read()[-2000:]
    victim = line[1]
    assert _keys_of(store.backend, f"tables/captures/{victim}")  # stopped mid-commit: its segments are written
    assert _visible(disk_url) == {good}  # a reader during the commit sees none of it
    live = Store.open(disk_url, create=False)
    assert live.verify().ok and live.gc() == []  # a live writer's segments and arrays are not orphans
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    if disk_url.startswith("s3://"):
        time.sleep(6.5)  # the lease (5 s) runs out by the server's clock
    assert _visible(disk_url) == {good}
    after = Store.open(disk_url, create=False)
    _assert_collected(after, victim)
    _assert_holds(after, good, seed=5, n_prompts=2)


def test_two_writer_processes_and_a_reader_at_once_lose_nothing(disk_url):
    from tests.capturestore.conftest import start_writer

    Store.open(disk_url)  # created once, before the writers race
    seeds = (11, 12)
    writers = [start_writer(disk_url, "stream", "2", str(s)) for s in seeds]
    polls = 0
    while any(w.poll() is None for w in writers):
        _visible(disk_url)  # every run a reader sees while they write is whole
        polls += 1
        time.sleep(0.5)
    outs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], [err[-1500:] for _, err in outs]
    runs = [out.split()[-1] for out, _ in outs]
    assert polls > 0 and _visible(disk_url) == set(runs)
    store = Store.open(disk_url, create=False)
    for rid, seed in zip(runs, seeds):
        _assert_holds(store, rid, seed=seed, n_prompts=2)
    n = store.sql("SELECT seed, count(*) AS n FROM writer_metrics GROUP BY seed ORDER BY seed").to_pylist()
    assert n == [{"seed": 11, "n": 2}, {"seed": 12, "n": 2}]
    assert store.verify().ok and store.gc() == []


def _add(run, seed: int, i: int) -> None:
    d = prompt_data(seed, i)
    pid = run.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
    run.write_kv(pid, d["k"], d["v"])
    run.write_logits(pid, d["logits"])


def test_two_writers_interleaved_prompt_by_prompt_with_a_reader_between_the_steps(store_url):
    a, b = Store.open(store_url), Store.open(store_url, create=False)  # two clients of one store
    wa, wb = a.begin_run(engine="test", model_path="a"), b.begin_run(engine="test", model_path="b")
    for i in range(2):
        _add(wa, 21, i)
        _add(wb, 22, i)
        assert _visible(store_url) == set()
    assert a.gc() == [] and Store.open(store_url, create=False).verify().ok  # two live writers: nothing to collect
    wb.commit()  # the later writer commits first
    assert _visible(store_url) == {wb.run_id}
    wa.commit()
    assert _visible(store_url) == {wa.run_id, wb.run_id}
    store = Store.open(store_url, create=False)
    _assert_holds(store, wa.run_id, seed=21, n_prompts=2)
    _assert_holds(store, wb.run_id, seed=22, n_prompts=2)
    assert store.verify().ok and store.gc() == []


class _Died(BaseException):
    """The writer's end, at the moment its commit marker was next."""


def test_a_writer_dying_mid_commit_in_one_process_is_never_visible_and_gc_collects_it(monkeypatch):
    """The memory store's SIGKILL case (above): the writer stops before its runs marker, a reader
    then sees none of it, and once its lock is no longer held (its end) gc collects it."""
    url = f"memory://contract-{uuid.uuid4().hex[:12]}"
    store = Store.open(url)
    good, _ = _write_run(store, seed=5)
    write_segment = Store._write_segment
    during = []

    def dies_at_the_marker(self, table, data, segment=None, durable=False):
        if table == "runs":
            during.append(_visible(url))  # a reader during the commit
            raise _Died
        return write_segment(self, table, data, segment=segment, durable=durable)

    run = store.begin_run(engine="test", model_path="dies")
    _add(run, 3, 0)
    monkeypatch.setattr(Store, "_write_segment", dies_at_the_marker)
    with pytest.raises(_Died):
        run.commit()
    monkeypatch.undo()
    assert during == [{good}]
    assert _keys_of(store.backend, f"tables/captures/{run.run_id}")  # it died mid-commit, segments written
    assert Store.open(url, create=False).gc() == []  # still alive: its lock is held
    store.backend.held.discard(run.run_id)  # its end: the lock is no longer held, the pending object stays
    assert _visible(url) == {good}
    after = Store.open(url, create=False)
    _assert_collected(after, run.run_id)
    _assert_holds(after, good, seed=5, n_prompts=2)


@pytest.mark.parametrize("size", [0, 1, 4095, 65535, 65536, 65537, (1 << 20) + 65536, (3 << 20) + 17])
def test_every_backend_reads_back_the_bytes_put_whatever_their_size(store_url, size):
    """A directory's read is os.read in pieces (64 KiB, then 1 MiB): a file of any size comes
    back whole, the same as from the other backends."""
    b = backend_for(store_url)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    b.put("blobs/x.bin", data)
    assert b.read("blobs/x.bin") == data


def test_a_directory_reads_a_missing_file_a_directory_and_a_path_through_a_file_as_missing(tmp_path):
    b = LocalBackend(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    for rel in ("nothing", "d", "f/below"):
        with pytest.raises(FileNotFoundError, match=str(tmp_path / rel)):
            b.read(rel)
