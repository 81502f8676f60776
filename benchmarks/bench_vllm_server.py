"""The vLLM server target: how fast full-vocabulary logprobs come over HTTP, against the server's own work.

A real ``vllm serve`` (tests/vllm_serve.py: 127.0.0.1, CPU, eager, FP32, ``--max-logprobs -1``)
serves a random-initialised Llama built locally (no download). Per round, the same prompts:
- ``plain``: one ``/v1/completions`` request per prompt + teacher tokens, ``max_tokens=1``, no
  logprobs: the prefill the server does anyway. The limit.
- ``capture``: ``capture_vllm_server_run`` into a fresh store: the same requests with
  ``prompt_logprobs`` = the vocabulary, JSON decoding into float32 rows, store writes.
Times are wall seconds, the best of ``--repeat`` interleaved rounds (a shared 2-core machine
swings with its neighbours' load: compare within one run). Printed: the capture's time over
the limit, and the logit transfer rate: MB/s of float32 teacher-forced logits stored, and of
JSON received (the server sends every position of the prompt, each entry as
``{"logprob", "rank", "decoded_token"}``, so JSON bytes far exceed the logits kept).
No goal is set: the rate is a property of vLLM's JSON API, reported so that a slow target is
understood (``--quick``: the tiny test model, vocab 1,024; default: vocab 32,000, one prompt: two
until 2026-12-07, 25 s a capture round of ``make bench``'s 30 minutes; the rates are per byte).

Usage: python benchmarks/bench_vllm_server.py [--quick] [--repeat 2] [--prompts 1] [--prompt-len 16] [--teacher 8]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny test model (vocab 1,024), a smoke run")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--teacher", type=int, default=8)
    a = p.parse_args()

    import numpy as np

    from capturestore import Store
    from extractors.vllm_server import capture_vllm_server_run, check_server
    from tests.vllm_serve import vllm_server

    if a.quick:
        from extractors.models import tiny_model

        model, size = tiny_model("llama-mha", 3), "tiny llama-mha, vocab 1024"
    else:
        from bench_vllm_capture import build_llama

        model, size = build_llama(32000, 512, 4), "llama v32k h512 L4"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(4, min(vocab, 30000), a.prompt_len - 1).tolist() for _ in range(a.prompts)]
    teacher = [rng.integers(4, min(vocab, 30000), a.teacher).tolist() for _ in range(a.prompts)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-server-"))
    try:
        with vllm_server(model, log_dir=tmp) as url:
            info = check_server(url, model)

            def plain():
                for pr, t in zip(prompts, teacher):
                    body = json.dumps({"model": info["served_model_name"], "prompt": pr + t, "max_tokens": 1,
                                       "temperature": 0.0}).encode()
                    req = urllib.request.Request(url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=600) as r:
                        r.read()

            report: dict = {}

            def capture():
                d = tempfile.mkdtemp(dir=tmp)
                report.clear()
                capture_vllm_server_run(Store.open(d), url, model, prompts, teacher, dtype="float32", report=report)
                shutil.rmtree(d)

            plain()  # warm-up
            capture()
            best = {"plain": float("inf"), "capture": float("inf")}
            best_report: dict = {}
            for _ in range(a.repeat):
                for name, fn in (("plain", plain), ("capture", capture)):
                    t = time.perf_counter()
                    fn()
                    s = time.perf_counter() - t
                    if s < best[name]:
                        best[name] = s
                        if name == "capture":
                            best_report = dict(report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    logit_mb = a.prompts * a.teacher * vocab * 4 / 1e6
    json_mb = best_report["bytes"] / 1e6
    cap = best["capture"]
    print(f"vLLM server target, {size}, {a.prompts} prompts x {a.prompt_len} tokens + {a.teacher} teacher, "
          f"best of {a.repeat}")
    rows = [
        ("plain prefill requests (limit)", f"{best['plain']:.3f} s", "1.00x"),
        ("capture_vllm_server_run", f"{cap:.3f} s", f"{cap / best['plain']:.2f}x"),
        ("  of which HTTP (server + transfer)", f"{best_report['http_s']:.3f} s", ""),
        ("  of which JSON -> float32 rows", f"{best_report['parse_s']:.3f} s", ""),
        ("  of which store writes", f"{best_report['store_s']:.3f} s", ""),
        ("logits stored (float32)", f"{logit_mb:.2f} MB", f"{logit_mb / cap:.2f} MB/s"),
        ("JSON received", f"{json_mb:.2f} MB", f"{json_mb / cap:.2f} MB/s"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'value':>12}  {'ratio / rate':>12}")
    for name, v, r in rows:
        print(f"{name:<{w}}  {v:>12}  {r:>12}")
    print("info: no goal; the logit transfer rate is that of vLLM's JSON prompt_logprobs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
