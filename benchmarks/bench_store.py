"""Capture store: KV write/read throughput against raw numpy I/O, compression, streaming RSS.

Limits measured in the same run, on the same disk (the --dir, default .bench-tmp/ in the repo):
- write: `ndarray.tofile` of the same K and V bytes; read: `np.fromfile` of them. Both sides
  go through the page cache, each timed write starting after an os.sync() (no dirty pages of
  an earlier write being flushed under it); the "+ fsync" row also fsyncs every file written (the bytes are
  on the disk). Each figure is the best of --repeat, raw and store runs interleaved so both
  see the same machine load, in a process that keeps the memory it frees
  (``timing.keep_freed_memory``: on this VM freed memory goes back to the host, and touching it
  again cost more than the I/O, e.g. ``np.fromfile`` of 256 MiB at 0.22 GB/s). Goal: >= 0.5x raw. Store writes are CPU-bound (compression on a
  thread pool, one chunk per task), so the page-cache ratio grows with cores. Two info rows
  split the cost: the same write with the earlier ~4 MiB token chunks, and the blosc encode
  of the same layers alone (no files): a ceiling no compressed write can beat on this machine.
- compression: logical bytes / bytes of chunk files on disk (checksums included), for BF16 KV
  from a bf16 forward of the tiny random-initialised llama-gqa model and FP32 logits from its
  fp32 forward (when torch + transformers + extractors.models are importable), and for
  synthetic data: BF16 KV
  with log-normal per-channel scales (the outlier channels of real K caches), FP32 logits
  N(0, 3^2). The codec is named in the table.
- RSS: a subprocess appends --rss-gb of BF16 KV one decode token at a time
  ([32 layer, 8 kv_head, 1, 128 head_dim] per step) and reports its peak RSS (VmHWM),
  also sampled from outside with psutil. Limit: 300 MB.

Usage: python benchmarks/bench_store.py [--quick] [--repeat 3] [--rss-gb 2] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from capturestore import Store  # noqa: E402
from capturestore.arrays import CODEC_NAME  # noqa: E402
from capturestore.chunkio import _blosc, _pool, wait_all  # noqa: E402
from capturestore.layout import token_chunk  # noqa: E402
from capturestore.tables import fsync_tree  # noqa: E402
from timing import best_of, keep_freed_memory  # noqa: E402
from capturestore.writer import KV_LAYER_CHUNK_BYTES  # noqa: E402

GOAL = 0.5
RSS_LIMIT_MB = 300.0


def synthetic_kv(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """k, v: [layer, kv_head, seq, head_dim] bf16 with log-normal per-channel scales."""
    L, H, S, D = shape
    out = []
    for _ in range(2):
        scale = rng.lognormal(0.0, 1.0, (L, H, 1, D)).astype(np.float32)
        x = np.empty(shape, ml_dtypes.bfloat16)
        for layer in range(L):  # per layer, so float32 temporaries stay small
            x[layer] = (rng.standard_normal((H, S, D), dtype=np.float32) * scale[layer]).astype(ml_dtypes.bfloat16)
        out.append(x)
    return out[0], out[1]


def tiny_model_tensors(seq: int = 256):
    """(k, v, logits) from a bf16 forward of the tiny llama-gqa model, or None if unavailable."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from extractors.models import tiny_model
    except Exception as e:  # noqa: BLE001
        print(f"(tiny model unavailable: {e}; synthetic data only)")
        return None
    path = tiny_model("llama-gqa")
    ids = None
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):  # KV from the bf16 model, logits from the fp32 one
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        if ids is None:
            ids = torch.randint(4, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs[dtype] = (model(ids, use_cache=True), model.config.num_hidden_layers)
    out, n_layers = outs[torch.bfloat16]
    cache = out.past_key_values
    ks, vs = [], []
    for layer in range(n_layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
        else:
            k, v = cache[layer]
        ks.append(k[0])
        vs.append(v[0])
    k = torch.stack(ks)  # [layer, kv_head, seq, head_dim] bf16
    v = torch.stack(vs)
    logits = outs[torch.float32][0].logits[0]  # [gen_token, vocab] fp32 (a bf16 model's would be upcast bf16)
    return k, v, logits


def throughput(workdir: Path, shape, repeat: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    k, v = synthetic_kv(rng, shape)
    nbytes = k.nbytes + v.nbytes
    raw_dir = workdir / "raw"
    store_root = workdir / "tp-store"
    times = {"raw_w": [], "raw_r": [], "st_w": [], "st_r": [], "st_stream": [], "raw_wd": [], "st_wd": [],
             "nc_w": [], "nc_r": [], "st_w4": [], "enc": []}
    # KV chunk tokens now (whole layer up to KV_LAYER_CHUNK_BYTES) and before (~4 MiB token blocks)
    per_token = shape[1] * shape[3] * 2
    tokens_before = token_chunk(per_token, shape[2])
    tokens_now = shape[2] if shape[2] * per_token <= KV_LAYER_CHUNK_BYTES else tokens_before
    for _ in range(repeat):
        shutil.rmtree(raw_dir, ignore_errors=True)
        raw_dir.mkdir(parents=True)
        os.sync()  # every timed write starts with no dirty pages waiting for writeback
        t = time.perf_counter()
        k.tofile(raw_dir / "k.bin")
        v.tofile(raw_dir / "v.bin")
        times["raw_w"].append(time.perf_counter() - t)
        fsync_tree(raw_dir)
        times["raw_wd"].append(time.perf_counter() - t)

        shutil.rmtree(store_root, ignore_errors=True)
        store = Store.open(store_root)
        os.sync()
        t = time.perf_counter()
        with store.begin_run(engine="bench", model_path="synthetic") as run:
            pid = run.add_prompt([1] * shape[2])  # one token per KV position
            run.write_kv(pid, k, v)
        times["st_w"].append(time.perf_counter() - t)
        fsync_tree(store_root / "arrays.zarr" / run.run_id)
        times["st_wd"].append(time.perf_counter() - t)

        if tokens_before != tokens_now:
            os.sync()
            t = time.perf_counter()
            with store.begin_run(engine="bench", model_path="synthetic", chunk_tokens=tokens_before) as run4:
                pid4 = run4.add_prompt([6] * shape[2])
                run4.write_kv(pid4, k, v)
            times["st_w4"].append(time.perf_counter() - t)

        # the compression alone: every layer of K and V encoded on the store's pool, no files
        # (each encoded buffer dropped at once, as the store's writer drops it after writing)
        t = time.perf_counter()
        enc = _blosc(2)
        futures = [_pool().submit(lambda a: len(enc.encode(a)), x[layer].view(np.uint16))
                   for x in (k, v) for layer in range(shape[0])]
        wait_all(futures)
        times["enc"].append(time.perf_counter() - t)

        t = time.perf_counter()
        rk = np.fromfile(raw_dir / "k.bin", dtype=np.uint16)
        rv = np.fromfile(raw_dir / "v.bin", dtype=np.uint16)
        times["raw_r"].append(time.perf_counter() - t)
        del rk, rv

        t = time.perf_counter()
        sk, sv = store.read_kv(run.run_id, pid)
        times["st_r"].append(time.perf_counter() - t)
        assert np.array_equal(sk.view(np.uint16), k.view(np.uint16)) and np.array_equal(sv.view(np.uint16), v.view(np.uint16))
        del sk, sv

        os.sync()
        t = time.perf_counter()  # checksum-only chunks: compression=None
        with store.begin_run(engine="bench", model_path="synthetic", compression=None) as run3:
            pid3 = run3.add_prompt([5] * shape[2])
            run3.write_kv(pid3, k, v)
        times["nc_w"].append(time.perf_counter() - t)
        t = time.perf_counter()
        store.read_kv(run3.run_id, pid3)
        times["nc_r"].append(time.perf_counter() - t)

        step = 16  # streamed decode: 16 tokens per append
        os.sync()
        t = time.perf_counter()
        with store.begin_run(engine="bench", model_path="synthetic") as run2:
            pid2 = run2.add_prompt([4] * shape[2])
            for s in range(0, shape[2], step):
                run2.append_kv(pid2, k[:, :, s : s + step], v[:, :, s : s + step])
        times["st_stream"].append(time.perf_counter() - t)
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(store_root, ignore_errors=True)
    gbps = {n: nbytes / min(ts) / 1e9 for n, ts in times.items() if ts}
    mib = nbytes / 2**20
    H, D = shape[1], shape[3]
    before = [(f"  same, chunks [1,{H},{tokens_before},{D}] (~4 MiB token blocks, before)", f"{gbps['st_w4']:.2f} GB/s",
               f"raw tofile {gbps['raw_w']:.2f} GB/s; the layout before, for comparison (no goal)",
               gbps["st_w4"] / gbps["raw_w"], None)] if "st_w4" in gbps else []
    return [
        (f"KV write, one shot ({mib:.0f} MiB bf16, chunks [1,{H},{tokens_now},{D}])", f"{gbps['st_w']:.2f} GB/s",
         f"raw tofile {gbps['raw_w']:.2f} GB/s", gbps["st_w"] / gbps["raw_w"], GOAL),
        *before,
        (f"  blosc encode alone on the pool, no files", f"{gbps['enc']:.2f} GB/s",
         f"raw tofile {gbps['raw_w']:.2f} GB/s; compression CPU ceiling", gbps["enc"] / gbps["raw_w"], None),
        (f"KV write + fsync (on disk)", f"{gbps['st_wd']:.2f} GB/s", f"raw tofile + fsync {gbps['raw_wd']:.2f} GB/s",
         gbps["st_wd"] / gbps["raw_wd"], GOAL),
        (f"KV write, streamed 16 tok/append", f"{gbps['st_stream']:.2f} GB/s", f"raw tofile {gbps['raw_w']:.2f} GB/s",
         gbps["st_stream"] / gbps["raw_w"], GOAL),
        (f"KV read ({mib:.0f} MiB bf16)", f"{gbps['st_r']:.2f} GB/s", f"raw fromfile {gbps['raw_r']:.2f} GB/s",
         gbps["st_r"] / gbps["raw_r"], GOAL),
        ("KV write, compression=None (crc32c only)", f"{gbps['nc_w']:.2f} GB/s", f"raw tofile {gbps['raw_w']:.2f} GB/s",
         gbps["nc_w"] / gbps["raw_w"], GOAL),
        ("KV read, compression=None (crc32c only)", f"{gbps['nc_r']:.2f} GB/s", f"raw fromfile {gbps['raw_r']:.2f} GB/s",
         gbps["nc_r"] / gbps["raw_r"], GOAL),
    ]


def compression(workdir: Path, quick: bool) -> list[tuple]:
    store_root = workdir / "cr-store"
    shutil.rmtree(store_root, ignore_errors=True)
    store = Store.open(store_root)
    rng = np.random.default_rng(1)
    cases = []
    tiny = tiny_model_tensors()
    k, v = synthetic_kv(rng, (8, 8, 512 if quick else 2048, 128))
    logits = (rng.standard_normal((64, 32000), dtype=np.float32) * 3).astype(np.float32)
    if tiny is not None:
        with store.begin_run(engine="bench", model_path="tiny llama-gqa") as run:
            # one token per KV position, one logits row per continuation token (the prompt is 1 token)
            pid = run.add_prompt([1], continuation=[1] * (tiny[0].shape[2] - 1))
            run.write_kv(pid, tiny[0], tiny[1])
            run.write_logits(pid, tiny[2][:-1])
        cases.append((run.run_id, ["kv_k", "kv_v"], "BF16 KV, tiny llama-gqa bf16 forward"))
        cases.append((run.run_id, ["logits"], "FP32 logits, tiny llama-gqa fp32 forward"))
    with store.begin_run(engine="bench", model_path="synthetic") as run:
        pid = run.add_prompt([2] * (k.shape[2] - len(logits)), continuation=[2] * len(logits))
        run.write_kv(pid, k, v)
        run.write_logits(pid, logits)
    cases.append((run.run_id, ["kv_k", "kv_v"], "BF16 KV, synthetic log-normal channels"))
    cases.append((run.run_id, ["logits"], "FP32 logits, synthetic N(0,9)"))
    rows = []
    for run_id, names, label in cases:
        in_list = ", ".join(f"'{n}'" for n in names)
        t = store.sql(
            f"SELECT sum(nbytes) AS n, sum(stored_bytes) AS s FROM captures WHERE run_id = '{run_id}' "
            f"AND array_name IN ({in_list})"
        ).to_pylist()[0]
        rows.append((f"compression: {label}", f"{t['n'] / t['s']:.3f}x", f"{t['n'] / 2**20:.1f} MiB logical", None, None))
    shutil.rmtree(store_root, ignore_errors=True)
    return rows


RSS_CHILD = r"""
import json, os, sys, time
import numpy as np, ml_dtypes
sys.path.insert(0, sys.argv[3])
from capturestore import Store
path, total = sys.argv[1], int(sys.argv[2])
L, H, D = 32, 8, 128
per_token = 2 * L * H * D * 2  # K and V, bf16
steps = total // per_token
rng = np.random.default_rng(0)
pool = [(rng.standard_normal((L, H, 1, D), dtype=np.float32).astype(ml_dtypes.bfloat16),
         rng.standard_normal((L, H, 1, D), dtype=np.float32).astype(ml_dtypes.bfloat16)) for _ in range(16)]
def vm(field):  # VmRSS / VmHWM of this process in MB (ru_maxrss would include the parent's, inherited at fork)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
store = Store.open(path)
base = vm("VmHWM")
print("ready", flush=True)
t = time.perf_counter()
with store.begin_run(engine="bench", model_path="rss") as run:
    pid = run.add_prompt([1] * steps)  # one token per KV position
    for s in range(steps):
        k, v = pool[s % len(pool)]
        run.append_kv(pid, k, v)
dt = time.perf_counter() - t
peak = vm("VmHWM")
print(json.dumps({"base_mb": base, "peak_mb": peak, "steps": steps, "bytes": steps * per_token, "seconds": dt,
                  "run_id": run.run_id, "pid": pid}), flush=True)
"""


def streaming_rss(workdir: Path, total_bytes: int) -> list[tuple]:
    import psutil

    store_root = workdir / "rss-store"
    shutil.rmtree(store_root, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", RSS_CHILD, str(store_root), str(total_bytes), str(REPO)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc = psutil.Process(p.pid)
    sampled = 0.0
    while p.poll() is None:
        try:
            sampled = max(sampled, proc.memory_info().rss / 2**20)
        except psutil.Error:
            break
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"RSS child failed:\n{err}")
    res = json.loads(out.strip().splitlines()[-1])
    store = Store.open(store_root, create=False)
    shape = store.captures(res["run_id"]).to_pylist()
    kv_rows = [c for c in shape if c["kind"] == "kv_k"]
    seq = kv_rows[0]["shape"][2]
    report = store.verify()
    shutil.rmtree(store_root, ignore_errors=True)
    gb = res["bytes"] / 1e9
    note = f"{res['steps']} appends, seq {seq}, {gb / res['seconds']:.2f} GB/s, verify {'OK' if report.ok else 'FAILED'}"
    return [
        (f"peak RSS appending {res['bytes'] / 2**30:.2f} GiB KV", f"{res['peak_mb']:.0f} MB",
         f"limit {RSS_LIMIT_MB:.0f} MB; {note}", res["peak_mb"] / RSS_LIMIT_MB, 1.0),
        ("  RSS before appending (imports, store open)", f"{res['base_mb']:.0f} MB",
         f"psutil-sampled peak {sampled:.0f} MB", None, None),
    ]


def print_table(rows: list[tuple]) -> bool:
    """Print the rows; whether every goal was met."""
    headers = ("measure", "value", "limit measured / context", "ratio", "goal", "ok")
    cells = []
    for name, value, ctx, ratio, goal in rows:
        if ratio is None or goal is None:
            ok = ""
        elif goal == 1.0 and "RSS" in name:
            ok = "yes" if ratio <= goal else "NO"
        else:
            ok = "yes" if ratio >= goal else "NO"
        cells.append((name, value, ctx, "" if ratio is None else f"{ratio:.2f}x",
                      "" if goal is None else (f"<= {goal:.1f}x" if "RSS" in name else f">= {goal:.1f}x"), ok))
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)))
    missed = [c[0].strip() for c in cells if c[-1] == "NO"]
    print("goal: " + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    return not missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (64 MiB KV, 256 MiB RSS test)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rss-gb", type=float, default=None, help="GiB of KV appended in the RSS test (default 2)")
    ap.add_argument("--dir", default=str(REPO / ".bench-tmp"), help="scratch directory (same disk as a store)")
    args = ap.parse_args(argv)
    workdir = Path(args.dir) / f"bench_store-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    shape = (16, 8, 1024 if args.quick else 4096, 128)  # K+V: 64 MiB quick, 256 MiB default
    rss_bytes = int((args.rss_gb if args.rss_gb is not None else (0.25 if args.quick else 2.0)) * 2**30)
    alloc = keep_freed_memory()  # this process only: the RSS test runs in a child of its own
    try:
        rows = throughput(workdir, shape, args.repeat)
        rows += compression(workdir, args.quick)
        rows += streaming_rss(workdir, rss_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"bench_store: codec {CODEC_NAME}; KV chunks: one whole layer up to 8 MiB, else one layer x ~4 MiB "
          f"token block (streamed KV: 64 MiB staging per prompt); {os.cpu_count()} CPUs, load avg "
          f"{os.getloadavg()[0]:.1f}, dir {args.dir}" + (f"; {alloc}" if alloc else ""))
    return 0 if print_table(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
