"""Stores on object storage (capturestore/objectstore.py) against a real S3 API: moto's server
on 127.0.0.1, reached over HTTP through s3fs, zarr's FsspecStore and DuckDB's fsspec bridge."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from capturestore import Store, StoreError
from capturestore.errors import QueryError
from tests.capturestore.conftest import REPO, start_writer
from tests.capturestore.s3server import auth_moto_server, bucket_keys, free_port, make_bucket
from tests.capturestore.writer_proc import LAYERS, PROMPT_LEN, prompt_data

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _write_run(store, seed: int, n_prompts: int = 2, **kw) -> tuple[str, list[str]]:
    pids = []
    with store.begin_run(engine="test", model_path=f"seed{seed}", **kw) as run:
        for i in range(n_prompts):
            d = prompt_data(seed, i)
            pid = run.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
            run.write_kv(pid, d["k"], d["v"])
            run.write_logits(pid, d["logits"])
            pids.append(pid)
    return run.run_id, pids


def test_roundtrip_bit_exact_and_queries(s3_url):
    store = Store.open(s3_url)
    assert repr(store) == f"Store({s3_url!r})"
    run_id, pids = _write_run(store, seed=3)
    again = Store.open(s3_url, create=False)  # a second client sees the committed run
    for i, pid in enumerate(pids):
        d = prompt_data(3, i)
        k, v = again.read_kv(run_id, pid)
        assert k.dtype == ml_dtypes.bfloat16 and k.view(np.uint16).tobytes() == d["k"].view(np.uint16).tobytes()
        assert v.view(np.uint16).tobytes() == d["v"].view(np.uint16).tobytes()
        assert np.array_equal(again.read_logits(run_id, pid), d["logits"])
        assert np.array_equal(again.read_tokens(run_id, pid), d["tokens"].astype(np.int32))
        k1, _ = again.read_kv(run_id, pid, layers=[1], tokens=slice(3, 9))
        assert k1.view(np.uint16).tobytes() == d["k"][1:2, :, 3:9].view(np.uint16).tobytes()
    rows = again.sql(f"SELECT prompt_id, n_tokens FROM prompts WHERE run_id = '{run_id}' ORDER BY prompt_idx").to_pylist()
    assert [r["prompt_id"] for r in rows] == pids
    assert [r["n_tokens"] for r in rows] == [len(prompt_data(3, i)["tokens"]) for i in range(2)]
    caps = again.sql(f"SELECT count(*) AS n FROM captures WHERE run_id = '{run_id}'").to_pylist()
    assert caps == [{"n": 2 * 4}]  # tokens, kv_k, kv_v, logits per prompt
    report = again.verify()
    assert report.ok, report.summary()
    assert report.checked_arrays == 8


def test_sql_stays_confined_to_the_stores_tables(s3_url, tmp_path):
    store = Store.open(s3_url)
    _write_run(store, seed=1, n_prompts=1)
    bucket = s3_url.split("/")[2]
    other = Store.open(f"s3://{bucket}/other")
    _write_run(other, seed=2, n_prompts=1)
    with pytest.raises(QueryError, match="refused"):
        store.sql(f"SELECT * FROM read_parquet('s3://{bucket}/other/tables/runs/*.parquet')")
    with pytest.raises(QueryError, match="refused"):
        store.sql("SELECT * FROM read_csv('/etc/passwd')")
    with pytest.raises(QueryError, match="read-only"):
        store.sql(f"COPY (SELECT 1 AS x) TO 's3://{bucket}/store/tables/runs/evil.parquet'")
    assert not any(k.endswith("evil.parquet") for k in bucket_keys(bucket))
    assert store.sql("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 1}]


def test_segments_are_never_replaced(s3_url):
    store = Store.open(s3_url)
    run_id, _ = _write_run(store, seed=4, n_prompts=1)
    before = store.prompts(run_id).to_pylist()
    import pyarrow as pa

    with pytest.raises(StoreError, match="already exists"):
        store._write_segment("prompts", pa.table({"run_id": ["x"]}), segment=run_id)
    assert Store.open(s3_url, create=False).prompts(run_id).to_pylist() == before


def test_a_writer_id_two_writers_drew_alike_is_refused_to_the_second(s3_url):
    store = Store.open(s3_url)
    first = store._pending_lock("20990101T000000-deadbeef", {"status": "running"})
    try:
        with pytest.raises(StoreError, match="already taken"):
            Store.open(s3_url, create=False)._pending_lock("20990101T000000-deadbeef", {"status": "running"})
        assert [p["alive"] for p in store.pending()] == [True]
    finally:
        first.release()
    assert store.pending() == []


def test_file_url_and_plain_path_open_the_same_store(tmp_path):
    a = Store.open(f"file://{tmp_path / 's'}")
    run_id, _ = _write_run(a, seed=5, n_prompts=1)
    assert run_id in {r["run_id"] for r in Store.open(tmp_path / "s", create=False).runs().to_pylist()}


def test_unsupported_scheme_is_one_line():
    with pytest.raises(StoreError, match="unsupported URL scheme 'gs'"):
        Store.open("gs://bucket/x")


# ---- many writers, crashes, gc ----------------------------------------------------------------


def _wait_line(proc, prefix: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.split()[1]
        if not line and proc.poll() is not None:
            raise AssertionError(f"writer exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"no {prefix!r} line within {timeout} s")


def test_many_writer_processes_one_bucket(s3_url, monkeypatch):
    """Four writer processes stream runs into one bucket at once while a fifth is SIGKILLed
    mid-run and a reader polls: every committed run is whole (all prompts, bit-exact), the
    killed one never shows, and gc removes it once its lease has run out."""
    monkeypatch.setenv("CAPTURESTORE_LEASE_S", "3")
    Store.open(s3_url)  # created once, before the writers race
    seeds = [11, 12, 13, 14]
    writers = [start_writer(s3_url, "stream", "3", str(s)) for s in seeds]
    victim = start_writer(s3_url, "hold")
    victim_run = _wait_line(victim, "ready")
    reader = Store.open(s3_url, create=False)
    while any(w.poll() is None for w in writers):
        for row in reader.runs().to_pylist():  # a visible run is a whole run
            prompts = reader.prompts(row["run_id"]).to_pylist()
            assert len(prompts) == row["n_prompts"] == 3, row
        time.sleep(0.5)
    outs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0] * 4, [o[1][-1500:] for o in outs]
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=30)

    store = Store.open(s3_url, create=False)
    runs = {r["config"]: r["run_id"] for r in store.runs().to_pylist()}
    assert sorted(json.loads(c)["seed"] for c in runs) == seeds  # none lost
    assert victim_run not in {r["run_id"] for r in store.runs().to_pylist()}  # the killed one not visible
    for cfg, run_id in runs.items():
        seed = json.loads(cfg)["seed"]
        for i, p in enumerate(sorted(store.prompts(run_id).to_pylist(), key=lambda p: p["prompt_idx"])):
            d = prompt_data(seed, i)
            k, v = store.read_kv(run_id, p["prompt_id"])
            assert k.shape == (LAYERS, *d["k"].shape[1:])
            assert k.view(np.uint16).tobytes() == d["k"].view(np.uint16).tobytes()
            assert np.array_equal(store.read_logits(run_id, p["prompt_id"]), d["logits"])
    metrics = store.sql("SELECT seed, count(*) AS n FROM writer_metrics GROUP BY seed ORDER BY seed").to_pylist()
    assert metrics == [{"seed": s, "n": 3} for s in seeds]

    time.sleep(4.5)  # the victim's lease (3 s) runs out: it is dead by the server's clock
    report = store.verify()
    assert [p.kind for p in report] == ["orphan"] and report[0].run_id == victim_run, report.summary()
    removed = store.gc()
    assert f"arrays.zarr/{victim_run}" in removed and f"pending/{victim_run}.json" in removed
    bucket = s3_url.split("/")[2]
    assert not [k for k in bucket_keys(bucket) if victim_run in k]
    assert store.verify().ok
    assert {r["run_id"] for r in store.runs().to_pylist()} == set(runs.values())


def test_gc_leaves_a_live_writer_alone(s3_url, monkeypatch):
    # heartbeat every lease / 3; the server's Last-Modified stamps are whole seconds, so a lease
    # of 2 s left a loaded machine ~0.3 s of slack
    monkeypatch.setenv("CAPTURESTORE_LEASE_S", "4")
    store = Store.open(s3_url)
    run = store.begin_run(engine="test", model_path="live")
    d = prompt_data(0, 0)
    pid = run.add_prompt(d["tokens"])
    run.write_kv(pid, d["k"], d["v"])
    time.sleep(5.5)  # longer than the lease and a second's stamp rounding: only the heartbeat keeps it alive
    assert store.gc() == []
    assert [p["alive"] for p in store.pending()] == [True]
    run.commit()
    assert store.verify().ok
    assert store.gc() == []


def test_a_writer_whose_lease_gc_took_does_not_commit(s3_url, monkeypatch):
    monkeypatch.setenv("CAPTURESTORE_LEASE_S", "600")
    store = Store.open(s3_url)
    run = store.begin_run(engine="test", model_path="stalled")
    d = prompt_data(0, 0)
    pid = run.add_prompt(d["tokens"])
    run.write_kv(pid, d["k"], d["v"])
    store.backend.remove([f"pending/{run.run_id}.json"])  # as gc does once the lease has run out
    with pytest.raises(StoreError, match=f"run {run.run_id} lost its lease"):
        run.commit()
    assert run.run_id not in {r["run_id"] for r in store.runs().to_pylist()}


# ---- bad input ---------------------------------------------------------------------------------


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capturestore.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **(env or {})})


def test_unreachable_endpoint_is_one_line_naming_the_url(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(StoreError) as e:
        Store.open("s3://bucket-x/store")
    msg = str(e.value)
    assert "\n" not in msg and "s3://bucket-x/store" in msg and endpoint in msg and "does not answer" in msg
    r = _cli("runs", "--store", "s3://bucket-x/store")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "s3://bucket-x/store" in r.stderr and "Traceback" not in r.stderr


def test_missing_bucket_is_one_line_and_nothing_is_written(s3_env):
    import boto3

    before = [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
    with pytest.raises(StoreError, match=r"s3://no-such-bucket-42/store .*bucket 'no-such-bucket-42' does not exist"):
        Store.open("s3://no-such-bucket-42/store")
    r = _cli("demo", "--store", "s3://no-such-bucket-42/store")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no-such-bucket-42" in r.stderr, r.stderr
    assert [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]] == before


def test_wrong_credentials_say_so_without_the_secret(s3_env, monkeypatch):
    secret = "wrong-secret-d41d8cd98f00b204"
    with auth_moto_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        with pytest.raises(StoreError) as e:
            Store.open("s3://some-bucket/store")
        msg = str(e.value)
        assert "credentials were refused" in msg and "s3://some-bucket/store" in msg and secret not in msg
        r = _cli("runs", "--store", "s3://some-bucket/store")
        assert r.returncode == 2 and "credentials were refused" in r.stderr
        assert secret not in r.stderr and secret not in r.stdout


def test_open_refuses_a_prefix_holding_other_objects(s3_env):
    import boto3

    bucket = make_bucket()
    boto3.client("s3").put_object(Bucket=bucket, Key="data/notes.txt", Body=b"x")
    with pytest.raises(StoreError, match="holds other objects"):
        Store.open(f"s3://{bucket}/data")
    assert bucket_keys(bucket) == ["data/notes.txt"]
    with pytest.raises(StoreError, match="is not a capture store"):
        Store.open(f"s3://{bucket}/empty", create=False)
    assert bucket_keys(bucket) == ["data/notes.txt"]


@pytest.mark.parametrize("sharded", [True, False])
def test_a_corrupt_or_missing_object_is_named_by_read_and_verify(s3_url, sharded):
    import boto3

    from capturestore.errors import CorruptChunkError

    store = Store.open(s3_url)
    if not sharded:
        store.shard_bytes = None
    run_id, pids = _write_run(store, seed=6, n_prompts=1)
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    keys = [k for k in bucket_keys(bucket) if f"/{run_id}/{pids[0]}/kv_k/c." in k]  # a new store: "." chunk keys
    # sharded: K [3 layers, ...] is one shard object; else one object per layer (3 chunks)
    assert len(keys) == (1 if sharded else LAYERS)
    client = boto3.client("s3")
    original = client.get_object(Bucket=bucket, Key=keys[0])["Body"].read()
    body = bytearray(original)
    body[len(body) // 3] ^= 0x40
    client.put_object(Bucket=bucket, Key=keys[0], Body=bytes(body))
    fresh = Store.open(s3_url, create=False)
    with pytest.raises(CorruptChunkError, match=f"run {run_id}, prompt {pids[0]}, array kv_k"):
        fresh.read_kv(run_id, pids[0])
    report = fresh.verify()
    assert [(p.kind, p.array) for p in report] == [("corrupt-chunk", "kv_k")], report.summary()
    client.put_object(Bucket=bucket, Key=keys[0], Body=original)
    vkeys = [k for k in bucket_keys(bucket) if f"/{run_id}/{pids[0]}/kv_v/c." in k]
    client.delete_object(Bucket=bucket, Key=vkeys[0])
    with pytest.raises(CorruptChunkError, match="array kv_v.*missing"):
        Store.open(s3_url, create=False).read_kv(run_id, pids[0])


@pytest.mark.parametrize("how", ["deleted", "copied"])
def test_a_comparisons_missing_or_copied_segment_fails_queries_diff_and_verify_on_a_bucket(s3_url, how, capsys):
    """Issue 17: the manifest is checked on object storage as on disk (evidence_problems reads only
    the store's segment listing and bytes; the views' guard is the same SQL)."""
    import boto3

    from capturestore.analysis import compare_runs
    from capturestore.cli import main

    store = Store.open(s3_url)

    def run(scale, release=None, dtype="bfloat16"):  # the same prompts, K/V and logits scaled
        with store.begin_run(engine="test", model_path="m", dtype=dtype, release=release) as w:
            for i in range(2):
                d = prompt_data(5, i)
                pid = w.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
                w.write_kv(pid, (d["k"].astype(np.float32) * scale).astype(ml_dtypes.bfloat16),
                           (d["v"].astype(np.float32) * scale).astype(ml_dtypes.bfloat16))
                w.write_logits(pid, d["logits"] * scale)
        return w.run_id

    base, exp = run(1.0, dtype="float32"), run(1.001)
    c1 = compare_runs(store, expected_run=exp, actual_run=run(1.002, "r1"), baseline_run=base)
    c2 = compare_runs(store, expected_run=exp, actual_run=run(1.05, "r2"), baseline_run=base)
    assert Store.open(s3_url, create=False).verify().ok
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    client = boto3.client("s3")
    segs = [k for k in bucket_keys(bucket) if k.startswith(f"{prefix}/tables/kv_head_metrics/")]
    (seg,) = [k for k in segs if c2.comparison_id in
              set(__import__("pyarrow.parquet", fromlist=["x"]).read_table(
                  __import__("io").BytesIO(client.get_object(Bucket=bucket, Key=k)["Body"].read()),
                  columns=["comparison_id"]).column(0).to_pylist())]
    if how == "deleted":
        client.delete_object(Bucket=bucket, Key=seg)
    else:
        client.copy_object(Bucket=bucket, Key=seg.replace(".parquet", "-copy.parquet"),
                           CopySource={"Bucket": bucket, "Key": seg})
    fresh = Store.open(s3_url, create=False)
    with pytest.raises(QueryError, match=f"table kv_head_metrics, comparison {c2.comparison_id}: segment"):
        fresh.sql(f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{c2.comparison_id}'")
    n1 = fresh.sql(f"SELECT count(*) AS n FROM kv_head_metrics WHERE comparison_id = '{c1.comparison_id}'")
    assert n1.to_pylist()[0]["n"] > 0
    kinds = [p.kind for p in fresh.verify()]
    assert kinds == [{"deleted": "missing-segment", "copied": "foreign-segment"}[how]]
    capsys.readouterr()
    assert main(["diff", c1.comparison_id, c2.comparison_id, "--store", s3_url]) == 2
    err = capsys.readouterr().err
    assert "evidence incomplete" in err and "kv_head_metrics" in err and len(err.strip().splitlines()) == 1


def test_grouped_module_tensors_on_s3(s3_url):
    """Store format 6's tensor groups through the S3 API: the group is written whole as shards (a
    shard holds several modules), and a second client reads each module alone, bit for bit."""
    from capturestore.layout import ARRAYS_DIR, TENSOR_GROUPS

    store = Store.open(s3_url)
    assert store.grouped_tensors
    rng = np.random.default_rng(5)
    mods = {f"model.layers.{i}.mlp": rng.standard_normal((3, 1, 16)).astype(ml_dtypes.bfloat16) for i in range(4)}
    with store.begin_run(engine="test", model_path="m", dtype="bfloat16") as run:
        pid = run.add_prompt([1, 2, 3], continuation=[4, 5, 6])
        run.write_tensor_group(pid, "decode", list(mods), list(mods.values()), [0, 1, 2], dims=["position", "hidden"])
    again = Store.open(s3_url, create=False)
    for m, x in mods.items():
        got = again.read_tensor(run.run_id, pid, m, phase="decode")
        assert got.dtype == ml_dtypes.bfloat16 and got.view(np.uint16).tobytes() == x.view(np.uint16).tobytes()
        assert again.read_tensor(run.run_id, pid, m, step=2).view(np.uint16).tobytes() == x[2].view(np.uint16).tobytes()
    rows = again.sql(f"SELECT module, group_index, stored_bytes, path FROM captures WHERE run_id = '{run.run_id}' "
                     f"AND kind = 'tensor' ORDER BY group_index").to_pylist()
    assert [r["module"] for r in rows] == list(mods) and [r["group_index"] for r in rows] == [0, 1, 2, 3]
    assert {r["path"] for r in rows} == {f"{ARRAYS_DIR}/{run.run_id}/{pid}/{TENSOR_GROUPS}/decode_0"}
    objects = again.backend.find(f"{ARRAYS_DIR}/{run.run_id}/{pid}/{TENSOR_GROUPS}/decode_0")
    shards = {k: v for k, v in objects.items() if not k.endswith("zarr.json")}
    assert len(shards) == 1 and sum(r["stored_bytes"] for r in rows) == sum(shards.values())
    report = again.verify()
    assert report.ok and report.checked_arrays == 5, report.summary()  # 4 modules + tokens
