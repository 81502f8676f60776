"""Comparisons on a real Dask cluster (LocalCluster, 2 worker processes) against a local store
and one on a real S3 API (moto over HTTP): the same rows as the single-process path, bit for
bit; a worker killed mid-task is retried and no row is written twice; lazy xarray reads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from tests.capturestore.conftest import REPO
from tests.capturestore.s3server import free_port, make_bucket

distributed = pytest.importorskip("dask.distributed", reason="dask[distributed] is in the test extra")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning")]

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
MODULES = ["model.layers.0.mlp", "model.layers.1.mlp"]
H, D, V, N_PROMPTS = 2, 16, 64, 6
TABLES = ["logit_token_metrics", "kv_head_metrics", "kv_token_bc", "kv_gen_bc", "kv_layer_verdicts", "module_metrics"]


@pytest.fixture(scope="module")
def cluster_client(moto_endpoint):  # noqa: F811
    """Two worker processes that inherit the AWS_* variables of the moto server."""
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=moto_endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing-secret", AWS_REGION="us-east-1")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write(store, dtype, prompts, data, bug=False):
    with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype=dtype) as run:
        for i, (p, c) in enumerate(prompts):
            pid = run.add_prompt(p, continuation=c)
            k, v, logits, tensors = data[i]
            if bug:  # the actual run: layer 1's V off by 3% on the decode positions, logits a little
                v = v.copy()
                v[1, :, len(p):] *= 1.03
                logits = logits + 0.01 * np.arange(logits.shape[1], dtype=np.float32)
            cast = (lambda x: x.astype(ml_dtypes.bfloat16)) if dtype == "bfloat16" else (lambda x: x)
            run.write_kv(pid, cast(k), cast(v), layer_names=LAYERS)
            run.write_logits(pid, cast(logits))
            for m, t in zip(MODULES, tensors):
                run.write_tensor(pid, m, cast(t), step=0, phase="prefill")
    return run.run_id


def _runs(store):
    rng = np.random.default_rng(7)
    prompts = [(rng.integers(1, V, 5 + i).tolist(), rng.integers(1, V, 4).tolist()) for i in range(N_PROMPTS)]
    data = []
    for p, c in prompts:
        n = len(p) + len(c)
        data.append((rng.standard_normal((3, H, n, D)).astype(np.float32),
                     rng.standard_normal((3, H, n, D)).astype(np.float32),
                     rng.standard_normal((len(c), V)).astype(np.float32) * 3,
                     [rng.standard_normal((n, 8)).astype(np.float32) for _ in MODULES]))
    return {"baseline_run": _write(store, "float32", prompts, data),
            "expected_run": _write(store, "bfloat16", prompts, data),
            "actual_run": _write(store, "bfloat16", prompts, data, bug=True)}


def _rows(store, table, cid):
    t = store.sql(f"SELECT * EXCLUDE (comparison_id) FROM {table} WHERE comparison_id = '{cid}'")
    cols = [c for c in t.column_names if c not in ("created_at", "label")]
    return store.sql(f"SELECT * EXCLUDE (comparison_id) FROM {table} WHERE comparison_id = '{cid}' "
                     f"ORDER BY {', '.join(cols)}").to_pylist()


def _same_results(store, a, b):
    for table in TABLES:
        ra, rb = _rows(store, table, a.comparison_id), _rows(store, table, b.comparison_id)
        assert ra, f"{table}: no rows"
        assert ra == rb, f"{table} differs between the single-process and the Dask comparison"
    # the manifests name each comparison's own segment files (and hash rows holding its id): their
    # tables and row counts must agree, the file names and hashes cannot
    ca, cb = (store.sql(f"SELECT * EXCLUDE (comparison_id, created_at, manifest_segments, manifest_sha256) "
                        f"FROM comparisons WHERE comparison_id = '{c.comparison_id}'").to_pylist() for c in (a, b))
    assert ca == cb and len(ca) == 1 and ca[0]["manifest_tables"] and ca[0]["manifest_rows"]
    layers = [[{k: v for k, v in r.items() if k != "comparison_id"} for r in c.kv_layers] for c in (a, b)]
    assert (a.passed, a.localisation, layers[0]) == (b.passed, b.localisation, layers[1])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_dask_comparison_is_the_single_process_one_bit_for_bit(cluster_client, tmp_path, where):
    store = Store.open(tmp_path / "s" if where == "local" else f"s3://{make_bucket()}/store")
    runs = _runs(store)
    seen = []
    single = compare_runs(store, **runs, comparators=["modules"])
    dask = compare_runs(store, **runs, comparators=["modules"], client=cluster_client, progress=seen.append)
    assert not single.passed and single.localisation["layer"] == 1  # evidence, not an empty pass
    _same_results(store, single, dask)
    assert len(seen) == N_PROMPTS and all("on the cluster" in s for s in seen)
    workers = cluster_client.run(os.getpid)
    assert len(workers) == 2 and os.getpid() not in workers.values()


def test_a_killed_worker_is_retried_and_no_row_is_written_twice(cluster_client, tmp_path):
    from tests.capturestore.dask_helpers import StallOnceComparator

    store = Store.open(tmp_path / "s")
    runs = _runs(store)
    pids = [p["prompt_id"] for p in store.prompts(runs["expected_run"]).to_pylist()]
    marker = tmp_path / "stalled-worker.pid"
    result = {}

    def run():
        result["dask"] = compare_runs(store, **runs, client=cluster_client,
                                      comparators=[StallOnceComparator(str(marker), pids[2])])

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 180
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and t.is_alive(), "the stalling task never started"
        time.sleep(0.2)
    victim = int(marker.read_text())
    assert victim in cluster_client.run(os.getpid).values()
    os.kill(victim, signal.SIGKILL)  # the worker process dies mid-task
    t.join(timeout=300)
    assert not t.is_alive() and "dask" in result
    dask = result["dask"]
    counts = store.sql(f"SELECT prompt_id, count(*) AS n FROM logit_token_metrics WHERE comparison_id = "
                       f"'{dask.comparison_id}' GROUP BY prompt_id").to_pylist()
    assert sorted(r["prompt_id"] for r in counts) == sorted(pids)
    assert all(r["n"] == 4 for r in counts)  # one row per continuation token, none twice
    assert store.sql("SELECT count(*) AS n FROM comparisons").to_pylist() == [{"n": 1}]
    single = compare_runs(store, **runs, comparators=[StallOnceComparator(str(marker), pids[2])])
    for table in TABLES[:-1]:
        assert _rows(store, table, single.comparison_id) == _rows(store, table, dask.comparison_id), table


def test_open_xarray_is_lazy_with_named_dims_on_object_storage(cluster_client):
    import dask.array as da

    store = Store.open(f"s3://{make_bucket()}/store")
    runs = _runs(store)
    rid = runs["expected_run"]
    pid = store.prompts(rid).to_pylist()[0]["prompt_id"]
    ds = store.open_xarray(rid, pid)
    assert ds["kv_k"].dims == ("layer", "kv_head", "position", "head_dim")
    assert isinstance(ds["kv_k"].data, da.Array) and ds["kv_k"].dtype == ml_dtypes.bfloat16
    assert ds["tokens"].dims == ("position",) and ds["logits"].dims == ("gen_token", "vocab")
    k, _ = store.read_kv(rid, pid)
    got = ds["kv_k"].isel(layer=1).data.compute(scheduler=cluster_client.get)  # read on the workers
    assert got.view(np.uint16).tobytes() == k[1].view(np.uint16).tobytes()


def test_a_scheduler_that_does_not_answer_is_one_line(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    Store.open(tmp_path / "s")
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "compare", "--store", str(tmp_path / "s"),
                        "--expected", "a", "--actual", "b", "--scheduler", address],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and address in r.stderr and "does not answer" in r.stderr, r.stderr


def test_a_malformed_scheduler_address_is_one_line_at_once(tmp_path):
    Store.open(tmp_path / "s")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "compare", "--store", str(tmp_path / "s"),
                        "--expected", "a", "--actual", "b", "--scheduler", "bogus"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'bogus' is not a scheduler address" in r.stderr and "missing port" in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 15  # no 10 s connect attempt, no 20 s wait in Client.__del__


def test_cli_compare_on_the_scheduler_stores_what_compare_runs_stores(cluster_client, tmp_path):
    store = Store.open(tmp_path / "s")
    runs = _runs(store)
    address = cluster_client.scheduler.address
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "compare", "--store", str(tmp_path / "s"),
                        "--baseline", runs["baseline_run"], "--expected", runs["expected_run"],
                        "--actual", runs["actual_run"], "--scheduler", address],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 1 and "overall: FAIL" in r.stdout, r.stderr[-2000:]  # the injected V error
    cid = r.stdout.split()[1]
    single = compare_runs(store, **runs)
    for table in TABLES[:-1]:  # the CLI runs logits + KV only
        assert _rows(store, table, cid) == _rows(store, table, single.comparison_id), table
