"""Benchmark of layer-streamed references (issue 18): a model far larger than its memory budget.

Run: ``python benchmarks/bench_streamed_reference.py [--full | --quick] [--skip-whole] [--readers N]``.

Builds once (cached under ``.bench-tmp/``, git-ignored) a random Llama, as sharded BF16 safetensors
written shard by shard (a few layers each) so that building it never holds the model. Default (the
size ``make bench`` runs, ~2 min of CPU): hidden 1024, 6 layers, MLP 3072, 16/4 heads, vocabulary
32,000 (526 MiB in FP32: the shape the prefetch was profiled on) streamed under a 0.39 GiB budget,
so the model is still larger than its budget and every ratio and RSS goal below is judged.
``--full``: ~3.6B parameters, hidden 3072, 28 layers, GQA 24/8 heads of 128, MLP 8192, vocabulary
128,256 (~6.7 GiB BF16, 13.4 GiB FP32; budget 2 GiB): about 35 minutes on 2 cores and 20 GiB of
RSS for the whole-FP32 step (``--skip-whole`` leaves those out). ``--quick``: hidden 512, 6 layers,
vocabulary 32,000 (budget 2 GiB, seconds); ``--mid``: the default shape, kept as a name. ``--cli``
(or ``--cli-only``): also ``capturestore run --target hf:bfloat16 --reference-memory`` end to end
on it, its peak RSS (from outside) against one FP32 copy of the weights.

Then, each step in its own child process, peak RSS measured from outside (psutil polling the
child every 10 ms) and wall time of the step's work (imports and skeleton excluded, printed apart):

- ``read``: one read of every weight of the checkpoint (the streamed loader's own reads, no cast);
- ``streamed fp32`` / ``streamed bf16``: ``capture_hf_run`` teacher-forced, ``stream=True``,
  ``--reference-memory`` (``--memory``), P prompts x T teacher tokens into a fresh store;
- ``streamed fp32 serial``: the same with ``prefetch=False`` (each unit read after the last is
  freed), for the prefetch's gain and its memory in the same run;
- ``streamed fp32 greedy``: the FP32 baseline's greedy teacher tokens, streamed (one pass over the
  weights per forward: prefill + T decode steps);
- ``whole fp32`` / ``whole bf16`` (unless ``--skip-whole``): the whole model loaded, then the same
  capture (the forward's time apart from the load's); the streamed runs' logits and KV are then
  compared with these bit for bit.

``--repeat N``: every step N times in turn, its best wall time kept (and its highest peak RSS):
the machine is shared, a ratio is of best against best. ``uptime`` is printed before and after.

OpenMP: every child runs with ``GOMP_SPINCOUNT=1000`` (``--gomp-spincount``; ``default`` leaves
it unset). libgomp spins a waiting thread 300,000 times, but only 1,000 once the process has more
OpenMP threads than CPUs — which the streamed path's worker threads (each its own team) make it
have, and a whole-model forward on the main thread alone does not: under load the whole model's
forward then burned 3-5x the CPU time of the same forward in a worker thread (docs/references.md).
The same spin count in every step times both paths' forwards under one regime.

Printed: a table of each step's wall time, its ratio to its limit measured in the same run —
``max(read, whole-model forward of the same tokens)`` for a teacher-forced streamed capture (goal
<= 1.2), ``(T + 1) x`` that for the greedy one — and each step's peak RSS against the budget (goal
<= budget + 0.5 GiB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo (run as a script)

FULL = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
            intermediate_size=8192, vocab_size=128256)
QUICK = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1536, vocab_size=32000)
MID = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
           intermediate_size=3072, vocab_size=32000)
LAYERS_PER_SHARD = 4
GiB = 1 << 30


# ----------------------------------------------------------------------------------------------
# the model, written shard by shard


def build_model(path: Path, shape: dict, seed: int = 0) -> Path:
    """A random BF16 Llama of ``shape`` as sharded safetensors + index + config in ``path``.

    Each projection std 1/sqrt(fan_in), embedding std 1, LM head std 3/sqrt(hidden), norms 1 +
    N(0, 0.1) (``extractors.models``' scales). Drawn with torch's generator per tensor (seeded by
    name), converted to BF16 and written one shard (embedding, LAYERS_PER_SHARD layers, or norm +
    LM head) at a time."""
    import hashlib

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    stamp = path / "built.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"shape": shape, "seed": seed}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.safetensors"):
        f.unlink()
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_theta=500000.0)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(path))
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]

    def draw(name, shp, std=None, norm=False):
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        out = torch.empty(shp, dtype=torch.bfloat16)
        rows = max(1, (64 << 20) // (4 * (shp[-1] if len(shp) > 1 else 1)))
        flat = out.view(shp[0], -1)
        for a in range(0, shp[0], rows):  # in row blocks: never the whole tensor in FP32
            blk = torch.randn((min(rows, shp[0] - a), flat.shape[1]), generator=g)
            flat[a:a + blk.shape[0]] = (1 + 0.1 * blk if norm else blk * std).to(torch.bfloat16)
        return out

    def layer(i):
        p = f"model.layers.{i}."
        return {p + "self_attn.q_proj.weight": draw(p + "q", (q, h), h ** -0.5),
                p + "self_attn.k_proj.weight": draw(p + "k", (kv, h), h ** -0.5),
                p + "self_attn.v_proj.weight": draw(p + "v", (kv, h), h ** -0.5),
                p + "self_attn.o_proj.weight": draw(p + "o", (h, q), q ** -0.5),
                p + "mlp.gate_proj.weight": draw(p + "gate", (inter, h), h ** -0.5),
                p + "mlp.up_proj.weight": draw(p + "up", (inter, h), h ** -0.5),
                p + "mlp.down_proj.weight": draw(p + "down", (h, inter), inter ** -0.5),
                p + "input_layernorm.weight": draw(p + "in_norm", (h,), norm=True),
                p + "post_attention_layernorm.weight": draw(p + "post_norm", (h,), norm=True)}

    shards = [lambda: {"model.embed_tokens.weight": draw("embed", (shape["vocab_size"], h), 1.0)}]
    for a in range(0, L, LAYERS_PER_SHARD):
        shards.append(lambda a=a: {k: v for i in range(a, min(L, a + LAYERS_PER_SHARD)) for k, v in layer(i).items()})
    shards.append(lambda: {"model.norm.weight": draw("norm", (h,), norm=True),
                           "lm_head.weight": draw("lm_head", (shape["vocab_size"], h), 3 * h ** -0.5)})
    weight_map, total = {}, 0
    for s, make in enumerate(shards):
        fn = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make()
        save_file(tensors, str(path / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in tensors})
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
        print(f"  wrote {fn}", flush=True)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}, indent=1))
    stamp.write_text(json.dumps({"shape": shape, "seed": seed}))
    return path


# ----------------------------------------------------------------------------------------------
# steps, each run in a child process (``--step``)


def _prompts(vocab: int, n: int, length: int, teach: int):
    import numpy as np

    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, vocab, length - 1 - 3 * i).tolist() for i in range(n)]  # ragged
    teachers = [rng.integers(3, vocab, teach).tolist() for _ in range(n)]
    return prompts, teachers


def child_step(args) -> dict:
    """One measured step in this process; returns its figures (printed as JSON on the last line)."""
    import torch

    from capturestore import Store
    from extractors.hf import capture_hf_run, load_hf_model
    from extractors.streamed import Checkpoint

    torch.set_num_threads(args.threads)
    if args.readers:  # the streamed steps' reading threads (default: the library's, by the CPU count)
        import extractors.streamed as streamed

        streamed.READERS, streamed.CPUS_PER_READER = args.readers, 1
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    prompts, teachers = _prompts(cfg["vocab_size"], args.prompts, args.length, args.teach)
    out = {"step": args.step}
    mem = int(args.memory * GiB)
    # imports (transformers' model module, the store) and a skeleton before the clock starts:
    # the whole-model steps' load is timed apart too
    from extractors.streamed import StreamedModel

    t0 = time.perf_counter()
    StreamedModel(args.model, "bfloat16")
    Store.open(Path(args.store).parent / "warm").runs()
    out["setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.step == "read":
        ck = Checkpoint(args.model)
        t0 = time.perf_counter()
        for name, e in ck.entries.items():
            ck.read(name, getattr(torch, {"BF16": "bfloat16", "F32": "float32"}[e.dtype]))
        out["bytes"] = ck.nbytes()
    elif args.step.startswith("streamed"):
        dtype = "float32" if "fp32" in args.step else "bfloat16"
        st = Store.open(args.store)
        info = {}
        greedy = args.step.endswith("greedy")
        rid = capture_hf_run(st, args.model, prompts, teacher_tokens=None if greedy else teachers,
                             num_tokens=args.teach, dtype=dtype, stream=True, memory=mem, info=info,
                             model_hash=args.model_hash, prefetch=not args.step.endswith("serial"))
        out.update(run=rid, groups=info["groups"], passes=info["weight_passes"], plan=info["plan"],
                   prefetched=info["prefetched_units"])
    elif args.step.startswith("whole"):
        dtype = "float32" if "fp32" in args.step else "bfloat16"
        from extractors.streamed import available_memory

        need = Checkpoint(args.model).nbytes() * (2 if dtype == "float32" else 1) + 3 * GiB
        if available_memory() < need:  # a shared machine: never push others' jobs out
            raise SystemExit(f"whole {dtype}: {available_memory() / GiB:.1f} GiB available, {need / GiB:.1f} needed")
        model = load_hf_model(args.model, dtype)
        out["load_s"] = time.perf_counter() - t0
        # the limit: the whole model's forwards of the same tokens, timed as the capture that the
        # streamed runs are compared with bit for bit (its store writes are a few MB: counted in)
        t1 = time.perf_counter()
        st = Store.open(args.store)
        out["run"] = capture_hf_run(st, args.model, prompts, teacher_tokens=teachers, dtype=dtype, model=model,
                                    model_hash=args.model_hash)
        out["forward_s"] = time.perf_counter() - t1
    out["wall_s"] = time.perf_counter() - t0 if "forward_s" not in out else out["forward_s"]
    return out


def run_child(args, step: str, store: Path) -> dict:
    import psutil

    cmd = [sys.executable, __file__, "--step", step, "--model", str(args.model), "--store", str(store),
           "--memory", str(args.memory), "--prompts", str(args.prompts), "--length", str(args.length),
           "--teach", str(args.teach), "--threads", str(args.threads), "--model-hash", args.model_hash,
           "--readers", str(args.readers or 0)]
    env = dict(os.environ)
    if args.gomp_spincount != "default":
        env["GOMP_SPINCOUNT"] = args.gomp_spincount
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.01)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    res = json.loads(stdout.strip().splitlines()[-1])
    res["peak_rss"] = peak
    res["process_s"] = time.perf_counter() - t0
    return res


def compare_runs_bits(store_a: Path, run_a: str, store_b: Path, run_b: str) -> str:
    import numpy as np

    from capturestore import Store

    a, b = Store.open(store_a), Store.open(store_b)
    n = 0
    for p in a.prompts(run_a).to_pylist():
        pid = p["prompt_id"]
        la, lb = a.read_logits(run_a, pid), b.read_logits(run_b, pid)
        if not np.array_equal(np.asarray(la).view(np.uint8), np.asarray(lb).view(np.uint8)):
            return f"logits of prompt {pid} differ (max abs {np.nanmax(np.abs(la.astype(np.float64) - lb)):.3g})"
        for x, y in zip(a.read_kv(run_a, pid), b.read_kv(run_b, pid)):
            if not np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)):
                return f"KV of prompt {pid} differs"
        n += 1
    return f"bit-identical ({n} prompts: logits + KV)"


def cli_run(args) -> None:
    """``capturestore run --target hf:bfloat16 --reference-memory`` on the model, as a child;
    prints its own lines (plans, peaks, verdict), its wall time and its peak RSS from outside."""
    import psutil

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    prompts, _ = _prompts(cfg["vocab_size"], args.prompts, args.length, args.teach)
    with tempfile.TemporaryDirectory(dir=ROOT / ".bench-tmp") as tmp:
        pf = Path(tmp) / "prompts.jsonl"
        pf.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
        cmd = [sys.executable, "-m", "capturestore.cli", "run", "--model", str(args.model), "--prompts", str(pf),
               "--target", "hf:bfloat16", "--num-tokens", str(args.teach), "--store", str(Path(tmp) / "store"),
               "--reference-memory", str(args.memory)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.01)
        out = proc.communicate()[0]
        wall = time.perf_counter() - t0
    fp32 = sum(e.nbytes for e in __import__("extractors.streamed", fromlist=["Checkpoint"]).Checkpoint(
        args.model).entries.values()) * 2
    lines = out.strip().splitlines()
    plans = [x for x in lines[:-30] if ": streamed (" in x or ": whole (" in x]  # the references' plans
    print("\n".join("  | " + line for line in plans + lines[-30:]))
    print(f"capturestore run --target hf:bfloat16 --reference-memory {args.memory}: exit {proc.returncode}, "
          f"{wall:.1f} s, peak RSS {peak / GiB:.2f} GiB (one FP32 copy of the weights: {fp32 / GiB:.2f} GiB; "
          f"{'below' if peak < fp32 else 'NOT below'})", flush=True)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model of the same shape (seconds)")
    ap.add_argument("--mid", action="store_true", help="hidden 1024, 6 layers (the default; the prefetch's "
                    "profiling shape)")
    ap.add_argument("--full", action="store_true", help="~3.6B parameters, budget 2 GiB (~35 min, 20 GiB RSS "
                    "for whole fp32)")
    ap.add_argument("--repeat", type=int, default=1, help="run every step N times, keep its best wall time")
    ap.add_argument("--gomp-spincount", default="1000", help="GOMP_SPINCOUNT of every step ('default': unset)")
    ap.add_argument("--skip-whole", action="store_true", help="no whole-model steps (they need 1x the FP32 weights)")
    ap.add_argument("--memory", type=float, default=None, help="--reference-memory of the streamed steps, GiB "
                    "(default 0.39; 2 with --full or --quick)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--length", type=int, default=64, help="tokens of the longest prompt (others 3 fewer each)")
    ap.add_argument("--teach", type=int, default=8, help="teacher tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--readers", type=int, default=0, help="threads reading a unit's tensors in the streamed steps "
                    "(default: the library's choice, one per 4 usable CPUs, at most 4)")
    ap.add_argument("--cli", action="store_true", help="also `capturestore run --target hf:bfloat16 "
                    "--reference-memory MEMORY` end to end (peak RSS from outside, against one FP32 copy)")
    ap.add_argument("--cli-only", action="store_true", help="only the --cli step")
    ap.add_argument("--steps", help="comma-separated subset of: read, streamed fp32, streamed fp32 serial, streamed "
                    "bf16, streamed fp32 greedy, whole bf16, whole fp32 (read is always run; a ratio whose steps did "
                    "not run is not shown)")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--model-hash", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        print(json.dumps(child_step(args)))
        return

    if args.quick + args.mid + args.full > 1:
        ap.error("one of --quick, --mid, --full")
    shape = QUICK if args.quick else FULL if args.full else MID
    args.model = ROOT / ".bench-tmp" / ("streamed-llama-quick" if args.quick else "streamed-llama-3b" if args.full
                                        else "streamed-llama-mid")
    if args.memory is None:
        args.memory = 2.0 if args.quick or args.full else 0.39
    print(f"load at start: {_uptime()}", flush=True)
    print(f"model {args.model}: {shape}", flush=True)
    t0 = time.perf_counter()
    build_model(args.model, shape)
    print(f"  built/cached in {time.perf_counter() - t0:.1f} s", flush=True)
    from extractors.models import model_content_hash

    hash_file = args.model / "hash.txt"
    if not hash_file.exists():
        hash_file.write_text(model_content_hash(args.model))
    args.model_hash = hash_file.read_text()
    if args.cli or args.cli_only:
        cli_run(args)
        if args.cli_only:
            return
    with tempfile.TemporaryDirectory(dir=ROOT / ".bench-tmp") as tmp:
        tmp = Path(tmp)
        steps = ["read", "streamed fp32", "streamed fp32 serial", "streamed bf16", "streamed fp32 greedy"]
        if not args.skip_whole:
            steps += ["whole bf16", "whole fp32"]
        if args.steps:
            keep = {x.strip() for x in args.steps.split(",")} | {"read"}
            steps = [x for x in steps if x in keep]
        res = {}
        run_child(args, "read", tmp / "warm")  # warm the page cache the same way for every step: read once first
        for rep in range(args.repeat):  # in turn, so each step sees the machine's load alike
            for step in steps:
                store = tmp / f"{step.replace(' ', '-')}-{rep}"
                r = run_child(args, step, store)
                r["store"] = store
                best = res.get(step)
                if best is None or r["wall_s"] < best["wall_s"]:
                    r["peak_rss"] = max(r["peak_rss"], best["peak_rss"]) if best else r["peak_rss"]
                    res[step] = r
                else:
                    best["peak_rss"] = max(best["peak_rss"], r["peak_rss"])
                print(f"  [{rep + 1}/{args.repeat}] {step:22s} {r['wall_s']:8.2f} s  (process {r['process_s']:.1f} s)"
                      f"  peak RSS {r['peak_rss'] / GiB:.2f} GiB"
                      + (f"  prefetched {r['prefetched']} units; {r.get('plan', '')}" if "plan" in r else ""),
                      flush=True)
        print(f"load at end: {_uptime()}", flush=True)
        weights = res["read"]["bytes"]
        n_params = weights // 2
        print(f"\n{n_params / 1e9:.2f} B parameters, {weights / GiB:.2f} GiB BF16; {args.prompts} prompts of "
              f"{[args.length - 3 * i for i in range(args.prompts)]} tokens + {args.teach} teacher tokens; "
              f"budget {args.memory} GiB; {args.threads} threads; "
              f"{f'{args.readers} reading threads' if args.readers else 'reading threads: the library default'}; "
              f"best of {args.repeat}; GOMP_SPINCOUNT "
              f"{args.gomp_spincount}")
        read = res["read"]["wall_s"]
        rows = []
        for dtype in ("fp32", "bf16"):
            fwd = res.get(f"whole {dtype}", {}).get("forward_s")
            limit = max(read, fwd) if fwd is not None else read
            what = "max(read, whole forward)" if fwd is not None else "read (no whole step)"
            s = res.get(f"streamed {dtype}")
            if s is not None:
                rows.append((f"streamed {dtype} teacher-forced", s["wall_s"], limit, what, 1.2, s["peak_rss"]))
            s = res.get(f"streamed {dtype} serial")
            if s is not None:
                rows.append((f"streamed {dtype} no prefetch", s["wall_s"], limit, what, 1.2, s["peak_rss"]))
            if dtype == "fp32" and "streamed fp32 greedy" in res:
                g = res["streamed fp32 greedy"]
                k = g["passes"]
                rows.append((f"streamed fp32 greedy ({k:.0f} passes)", g["wall_s"], k * limit, f"{k:.0f} x ({what})",
                             1.2, g["peak_rss"]))
        print(f"\n{'step':36s} {'wall s':>8s} {'limit s':>8s} {'ratio':>6s} {'goal':>5s}  {'peak RSS':>9s} "
              f"{'budget+0.5':>10s}  limit")
        ok = True
        for name, wall, limit, what, goal, peak in rows:
            ratio = wall / limit
            mem_ok = peak <= (args.memory + 0.5) * GiB
            ok &= ratio <= goal and mem_ok
            print(f"{name:36s} {wall:8.2f} {limit:8.2f} {ratio:6.2f} {goal:5.1f}  {peak / GiB:7.2f} G "
                  f"{'ok' if mem_ok else 'OVER':>10s}  {what}")
        for dtype in ("fp32", "bf16"):
            for kind in ("", " serial"):
                if f"whole {dtype}" in res and f"streamed {dtype}{kind}" in res:
                    w, s = res[f"whole {dtype}"], res[f"streamed {dtype}{kind}"]
                    print(f"whole {dtype}: load {w['load_s']:.1f} s, forward {w['forward_s']:.1f} s, peak RSS "
                          f"{w['peak_rss'] / GiB:.2f} GiB; streamed{kind} vs whole: "
                          + compare_runs_bits(s["store"], s["run"], w["store"], w["run"]))
        print("\ngoal (ratio <= goal, peak RSS <= budget + 0.5 GiB): " + ("met" if ok else "MISSED: some figure over its goal"))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
