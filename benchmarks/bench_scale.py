"""Past one machine: object-storage stores (sharded or not) and comparisons on a Dask cluster.

Everything runs here: the S3 API is a moto server in its own process on 127.0.0.1 (requests go
over HTTP; its throughput is moto's, a Python server on this machine, not AWS's: the figures
compare layouts and paths with each other, and docs/scale.md scales them by measured ratios).

1. Storage (per run of --prompts prompts, BF16 KV [layer, kv_head, position, head_dim] written with
   write_kv + FP32 logits): objects per run, write and read throughput of the store, on local disk
   and through the S3 API with one object per chunk and with the Zarr sharding codec (shards of up
   to objectstore.SHARD_BYTES). Limits measured in the same run on the same backend: the same
   bytes written/read as one raw object per array (numpy tofile/fromfile on disk, s3fs pipe/cat).
2. Comparison (three-way, --cmp-prompts prompts of small captures, logits + KV): single process
   vs LocalCluster(processes=True) with 1 and 2 workers, on the local and the S3-API store: wall
   time, stored bytes read per second, ratio to the single process (the limit). Cluster start-up
   is not timed. On this 2-core machine shared with other work, 2 workers cannot beat 1 by 2x.

Default size (what ``make bench`` runs): 2 prompts x KV [8, 8, 1024, 128], 8 compared prompts (16 until
2026-12-07: the S3-API comparisons through moto were a minute of ``make bench``'s 30),
projection on 4 layers, best of 2. ``--full``: 4 prompts x [16, 8, 2048, 128], 64 compared prompts,
16 projection layers (the size docs/scale.md was measured at; over 25 minutes of wall time under
load, 224 s CPU before its comparison section ended). ``--quick``: the default size, one repeat.

Usage: python benchmarks/bench_scale.py [--quick | --full] [--prompts 2] [--cmp-prompts 8] [--repeat 2]
Prints tables; exits 1 only when something failed (these are measurements, not goals).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import best_of  # noqa: E402

MB = 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> subprocess.Popen:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    return proc


def new_bucket() -> str:
    import boto3

    name = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


# ---- 1. storage -----------------------------------------------------------------------------------

def kv_data(prompts: int, layers: int, heads: int, seq: int, dim: int, vocab: int):
    rng = np.random.default_rng(0)
    out = []
    for i in range(prompts):
        k = rng.standard_normal((layers, heads, seq, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
        v = rng.standard_normal((layers, heads, seq, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
        out.append((rng.integers(0, vocab, seq).tolist(), k, v, rng.standard_normal((16, vocab), dtype=np.float32)))
    return out


def objects_under(store, run_id: str) -> int:
    if isinstance(store.root, Path):
        return sum(len(f) for _, _, f in os.walk(store.root / "arrays.zarr" / run_id))
    return len(store.backend.find(f"arrays.zarr/{run_id}/"))


def write_run(store, data) -> str:
    with store.begin_run(engine="bench", model_path="m", dtype="bfloat16") as run:
        for toks, k, v, logits in data:
            pid = run.add_prompt(toks[:-16], continuation=toks[-16:])
            run.write_kv(pid, k, v)
            run.write_logits(pid, logits)
    return run.run_id


def raw_limit(kind: str, data, where):
    """(write s, read s) of the same K/V/logits bytes as one raw object per array."""
    arrays = [a for _, k, v, lg in data for a in (k.view(np.uint16), v.view(np.uint16), lg)]
    if kind == "local":
        d = Path(where) / f"raw-{uuid.uuid4().hex[:6]}"
        d.mkdir()

        def w():
            for i, a in enumerate(arrays):
                a.tofile(d / f"{i}.bin")

        def r():
            for i, a in enumerate(arrays):
                np.fromfile(d / f"{i}.bin", a.dtype)
        os.sync()
        tw = best_of(w, 1)
        tr = best_of(r, 1)
        shutil.rmtree(d)
        return tw, tr
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    bucket = new_bucket()
    keys = [f"{bucket}/raw/{i}" for i in range(len(arrays))]
    tw = best_of(lambda: fs.pipe({k: a.tobytes() for k, a in zip(keys, arrays)}), 1)
    tr = best_of(lambda: fs.cat(keys), 1)
    return tw, tr


def bench_storage(args, tmp: Path) -> list[dict]:
    from capturestore import Store

    data = kv_data(args.prompts, args.layers, 8, args.seq, 128, 4096)
    logical = sum(k.nbytes + v.nbytes + lg.nbytes for _, k, v, lg in data)
    rows = []
    configs = [("local dir (chunk files)", "local", None), ("S3 API, chunk objects", "s3", None)]
    configs += [(f"S3 API, shards <= {mb} MiB", "s3", mb << 20) for mb in args.shard_mib]
    for name, kind, shard in configs:
        best_w, best_r, best_l = float("inf"), float("inf"), float("inf")
        n_obj = 0
        for _ in range(args.repeat):
            store = Store.open(tmp / f"st-{uuid.uuid4().hex[:6]}" if kind == "local" else f"s3://{new_bucket()}/s")
            if kind == "s3":
                store.shard_bytes = shard
            t = time.perf_counter()
            rid = write_run(store, data)
            best_w = min(best_w, time.perf_counter() - t)
            n_obj = objects_under(store, rid)
            pids = [p["prompt_id"] for p in store.prompts(rid).to_pylist()]
            t = time.perf_counter()
            for pid in pids:
                store.read_kv(rid, pid)
                store.read_logits(rid, pid)
            best_r = min(best_r, time.perf_counter() - t)
            t = time.perf_counter()
            store.read_kv(rid, pids[0], layers=[args.layers // 2])
            best_l = min(best_l, time.perf_counter() - t)
        raw_w, raw_r = raw_limit(kind, data, tmp)
        rows.append({"backend": name, "objects/run": n_obj, "write MB/s": logical / best_w / MB,
                     "write/raw": raw_w / best_w, "read MB/s": logical / best_r / MB, "read/raw": raw_r / best_r,
                     "1-layer read ms": best_l * 1e3})
    return rows


# ---- 2. comparisons ---------------------------------------------------------------------------------

def cmp_runs(store, n_prompts: int):
    rng = np.random.default_rng(1)
    L, H, D, V = 4, 4, 64, 512
    prompts = [(rng.integers(1, V, 48).tolist(), rng.integers(1, V, 16).tolist()) for _ in range(n_prompts)]
    data = [(rng.standard_normal((L, H, 64, D), dtype=np.float32), rng.standard_normal((L, H, 64, D), dtype=np.float32),
             rng.standard_normal((16, V), dtype=np.float32)) for _ in prompts]
    ids = {}
    for role, dt in (("baseline_run", "float32"), ("expected_run", "bfloat16"), ("actual_run", "bfloat16")):
        cast = (lambda x: x.astype(ml_dtypes.bfloat16)) if dt == "bfloat16" else (lambda x: x)
        with store.begin_run(engine="bench", model_path="m", model_hash="h", dtype=dt) as run:
            for (p, c), (k, v, lg) in zip(prompts, data):
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(k), cast(v))
                run.write_logits(pid, cast(lg))
        ids[role] = run.run_id
    stored = store.sql(f"SELECT sum(stored_bytes) AS b FROM captures WHERE run_id IN "
                       f"({', '.join(repr(r) for r in ids.values())})").to_pylist()[0]["b"]
    return ids, int(stored)


def bench_compare(args, tmp: Path) -> list[dict]:
    from dask.distributed import Client, LocalCluster

    from capturestore import Store
    from capturestore.analysis import compare_runs

    rows = []
    stores = {"local": Store.open(tmp / "cmp-store"), "S3 API": Store.open(f"s3://{new_bucket()}/cmp")}
    prepared = {k: cmp_runs(s, args.cmp_prompts) for k, s in stores.items()}
    for where, store in stores.items():
        ids, stored = prepared[where]
        single = best_of(lambda: compare_runs(store, **ids), args.repeat)
        rows.append({"store": where, "path": "single process", "s": single, "read MB/s": stored / single / MB,
                     "vs single": 1.0})
        for n in (1, 2):
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                    Client(cluster) as client:
                compare_runs(store, **ids, client=client)  # warm: workers import numpy/metrics, open the store
                t = best_of(lambda: compare_runs(store, **ids, client=client), args.repeat)
            rows.append({"store": where, "path": f"LocalCluster {n} worker{'s' if n > 1 else ''}", "s": t,
                         "read MB/s": stored / t / MB, "vs single": single / t})
    return rows


# ---- 3. per-worker figures for docs/scale.md's projection ------------------------------------------

def bench_projection(args, tmp: Path) -> list[dict]:
    """Per-core comparison throughput on larger prompts (stored bytes compared per second, local
    store, single process) and the rate at which the client writes metric rows (kv_head_metrics
    rows through to_arrow + append_table)."""
    import pyarrow as pa

    from capturestore import Store
    from capturestore.analysis import compare_runs
    from capturestore.comparators.base import to_arrow
    from capturestore.comparators.kv import KV_HEAD_METRICS

    rng = np.random.default_rng(2)
    L, H, S, D, G, V = args.proj_layers, 8, 512, 128, 32, 32000
    store = Store.open(tmp / "proj-store")
    prompts = [(rng.integers(1, V, S - G).tolist(), rng.integers(1, V, G).tolist()) for _ in range(2)]
    data = [(rng.standard_normal((L, H, S, D), dtype=np.float32), rng.standard_normal((L, H, S, D), dtype=np.float32),
             rng.standard_normal((G, V), dtype=np.float32)) for _ in prompts]
    ids = {}
    for role, dt in (("baseline_run", "float32"), ("expected_run", "bfloat16"), ("actual_run", "bfloat16")):
        cast = (lambda x: x.astype(ml_dtypes.bfloat16)) if dt == "bfloat16" else (lambda x: x)
        with store.begin_run(engine="bench", model_path="m", model_hash="h", dtype=dt) as run:
            for (p, c), (k, v, lg) in zip(prompts, data):
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(k), cast(v))
                run.write_logits(pid, cast(lg))
        ids[role] = run.run_id
    stored = store.sql(f"SELECT sum(stored_bytes) AS b FROM captures WHERE run_id IN "
                       f"({', '.join(repr(r) for r in ids.values())})").to_pylist()[0]["b"]
    stored = int(stored)
    t = best_of(lambda: compare_runs(store, **ids), args.repeat)
    n = 1_000_000
    cols = {f.name: (np.full(n, 0.5) if pa.types.is_floating(f.type) else np.arange(n) if pa.types.is_integer(f.type)
                     else ["x"] * n) for f in KV_HEAD_METRICS.schema}
    cols["comparison_id"] = ["cmp-bench"] * n

    def write_rows():
        tbl = to_arrow([cols], KV_HEAD_METRICS, "kv_head_metrics")
        store._write_segment("bench_rows", tbl)
    tw = best_of(write_rows, args.repeat)
    rows_per_prompt = L * H * S
    return [{"figure": f"compare, local store, 1 process (KV [{L}, {H}, {S}, {D}] x 2 prompts x 3 runs)",
             "value": stored / t / MB, "unit": "MB/s stored bytes compared"},
            {"figure": "  the same per prompt", "value": t / len(prompts), "unit": "s"},
            {"figure": "  kv_head_metrics rows per prompt", "value": float(rows_per_prompt), "unit": "rows"},
            {"figure": "client: kv_head_metrics rows to Parquet", "value": n / tw / 1e6, "unit": "M rows/s"}]


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    width = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, width)), "  ".join("-" * w for w in width)]
    out += ["  ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, width)) for r in rows]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default sizes, one repeat (about a minute)")
    ap.add_argument("--full", action="store_true", help="4 prompts x 16 layers x 2048, 64 compared prompts, "
                    "16 projection layers (docs/scale.md's size; long)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cmp-prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--skip-storage", action="store_true")
    ap.add_argument("--skip-projection", action="store_true")
    ap.add_argument("--proj-layers", type=int, default=4)
    ap.add_argument("--shard-mib", type=int, nargs="*", default=[16, 64],
                    help="shard sizes to measure (objectstore.SHARD_BYTES is the default the store uses)")
    args = ap.parse_args()
    if args.quick and args.full:
        ap.error("one of --quick, --full")
    if args.quick:
        args.prompts, args.layers, args.seq, args.cmp_prompts, args.repeat, args.proj_layers = 2, 8, 1024, 8, 1, 4
    if args.full:
        args.prompts, args.layers, args.seq, args.cmp_prompts, args.proj_layers = 4, 16, 2048, 64, 16
    moto = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=REPO / ".bench-tmp" if (REPO / ".bench-tmp").is_dir()
                                else None))
    try:
        kv_mb = args.prompts * 2 * args.layers * 8 * args.seq * 128 * 2 / MB
        print(f"== storage: {args.prompts} prompts x BF16 K+V [{args.layers}, 8, {args.seq}, 128] "
              f"({kv_mb:.0f} MB) + FP32 logits [16, 4096], best of {args.repeat}")
        if not args.skip_storage:
            print(table(bench_storage(args, tmp)))
        if not args.skip_compare:
            print(f"\n== comparison: three-way, {args.cmp_prompts} prompts (KV [4, 4, 64, 64], logits [16, 512]), "
                  f"best of {args.repeat}")
            print(table(bench_compare(args, tmp)))
        if not args.skip_projection:
            print(f"\n== per-worker figures for docs/scale.md, best of {args.repeat}")
            print(table(bench_projection(args, tmp)))
    finally:
        moto.terminate()
        moto.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\ninfo: no goal; every ratio above is to its limit measured in this run (docs/scale.md projects "
          "them to a cluster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
