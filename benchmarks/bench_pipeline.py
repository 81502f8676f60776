"""Benchmark of ``capturestore run``'s own overhead (issue 11, "A benchmark prints the pipeline's
own overhead against the sum of its captures and comparisons; aim: <= 10%").

Run: ``python benchmarks/bench_pipeline.py [--quick]`` (~1 min; --quick ~30 s on 2 cores). On the
tiny MHA Llama (seed 5), target ``hf:bfloat16`` (no engine start in the figure), P prompts x T
teacher tokens, into fresh stores:

- limit: the same work called directly, one after the other: ``capture_hf_run`` FP32 greedy,
  BF16 eager teacher-forced, BF16 SDPA teacher-forced (the target), ``compare_runs``;
- ``pipeline.run``: the same job through the pipeline (checks, prompt file, tokenizer, model
  content hash, reference lookups, progress, printing).

The figure judged (goal <= 10%): the pipeline's own overhead, from its stage timers
(``timings=``): (total - captures - comparison) / (captures + comparison), of its fastest run.
The direct calls are the cross-check: pipeline / direct - 1 (best of N each, alternating; on a
machine shared with other jobs this ratio moves by +-20%, so it is printed, not judged).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (run as a script)

GOAL = 0.10
WORDS = ("paged cache block table sequence token layer head value key decode prefill engine kernel "
         "number quick brown fox lazy dog once upon time").split()


def _texts(n):
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + 3 * i)) for i in range(n)]


def direct(model, texts, num_tokens, root) -> float:
    from capturestore import Store
    from capturestore.analysis import compare_runs
    from capturestore.pipeline import _load_sdpa, encode_prompts
    from extractors.hf import capture_hf_run, load_hf_model

    t0 = time.perf_counter()
    store = Store.open(root)
    rows = encode_prompts(model, texts)
    base = capture_hf_run(store, model, rows, num_tokens=num_tokens, dtype="float32")
    teacher = [store.read_tokens(base, p)[len(r):].tolist()
               for p, r in zip(store.prompts(base).column("prompt_id").to_pylist(), rows)]
    exp = capture_hf_run(store, model, rows, teacher_tokens=teacher, dtype="bfloat16")
    act = capture_hf_run(store, model, rows, teacher_tokens=teacher, dtype="bfloat16",
                         model=_load_sdpa(model, "bfloat16", load_hf_model))
    compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    return time.perf_counter() - t0


def piped(model, prompt_file, num_tokens, root, tm) -> float:
    from capturestore import pipeline

    t0 = time.perf_counter()
    pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=num_tokens, store=root, quiet=True,
                 out=lambda _: None, timings=tm)
    return time.perf_counter() - t0


def main() -> int:
    quick = "--quick" in sys.argv
    n_prompts, num_tokens, repeat = (4, 8, 2) if quick else (8, 16, 3)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # noqa: F401  (imports are not the pipeline's overhead)
    from transformers.utils import logging as hf_logging

    from extractors.models import tiny_model

    hf_logging.disable_progress_bar()
    model = tiny_model("llama-mha", seed=5)
    texts = _texts(n_prompts)
    t_direct, t_pipe, own = float("inf"), float("inf"), None
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        prompt_file = os.path.join(tmp, "prompts.txt")
        with open(prompt_file, "w") as f:
            f.write("\n".join(texts) + "\n")
        direct(model, texts[:1], 2, os.path.join(tmp, "warm"))  # first-call costs (tokenizer, kernels) off the clock
        for i in range(repeat):
            t_direct = min(t_direct, direct(model, texts, num_tokens, os.path.join(tmp, f"d{i}")))
            tm: dict = {}
            t = piped(model, prompt_file, num_tokens, os.path.join(tmp, f"p{i}"), tm)
            if t < t_pipe:
                t_pipe, own = t, tm
    work = sum(own[k] for k in ("baseline", "expected", "target", "compare"))
    own_overhead = (own["total"] - work) / work
    rows = [
        ("pipeline.run (hf:bfloat16 target), total", f"{own['total']:.2f} s", ""),
        ("  its captures + comparison (stage timers)", f"{work:.2f} s", ""),
        ("  its own overhead: (total - stages) / stages", f"{own_overhead * 100:+.1f} %", f"goal <= {GOAL * 100:.0f} %"),
        ("    of which checks (files, tokenizer, model hash)", f"{own['checks']:.2f} s", ""),
        ("cross-check, limit: the same calls made directly", f"{t_direct:.2f} s", ""),
        ("  pipeline / direct - 1", f"{(t_pipe / t_direct - 1) * 100:+.1f} %", "(noisy on a shared machine)"),
    ]
    print(f"capturestore run overhead: {n_prompts} prompts x {num_tokens} tokens, tiny llama-mha, best of {repeat}")
    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>10}  {r[2]}")
    ok = own_overhead <= GOAL
    print("goal met" if ok else "goal missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
