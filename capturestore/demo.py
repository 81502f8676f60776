"""The built-in demo: the main job end to end on a tiny local model.

1. Build (or reuse) a tiny random-initialised GQA Llama and its local tokenizer.
2. Capture the HF FP32 baseline (greedy continuation = the teacher tokens) and the HF BF16
   expected run, teacher-forced on those tokens; both are reused from the store when a run of
   the same model, dtype and prompts is already there.
3. Run vLLM-CPU in BF16 as the engine under test, teacher-forced through its decode path in
   one pass per prompt (``extractors.vllm_rpc.capture_vllm_run``), and capture its raw logits
   (recorded in the worker) and paged KV cache.
4. Compare the three runs (three-way logit validation + KV comparison), store every metric,
   and print a per-layer summary and the verdicts.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


__all__ = ["DEMO_PROMPTS", "run_demo", "format_layer_summary"]

# Varied lengths; the longest spans more than one 32-token KV block.
DEMO_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In a paged KV cache every sequence owns a list of fixed-size blocks, and a block table "
    "maps each logical block to a physical one, so sequences of different lengths share memory.",
    "Numbers: 3 1 4 1 5 9 2 6 5 3 5",
    "Once upon a time",
)


def _say(out: Callable[[str], None]):
    t0 = time.monotonic()

    def say(msg: str) -> None:
        out(f"[{time.monotonic() - t0:6.1f}s] {msg}")

    return say


def encode_prompts(model_path, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text with the local tokenizer, BOS first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    rows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows.append([tok.bos_token_id, *ids] if tok.bos_token_id is not None else list(ids))
    return rows


def make_vllm_engine(model_path, dtype: str = "bfloat16", block_size: int = 32, max_model_len: int = 256):
    """An in-process vLLM-CPU engine with the KV capture worker extension and full-vocab logprobs."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from extractors.vllm_rpc import make_llm

    return make_llm(model_path, dtype=dtype, max_model_len=max_model_len, block_size=block_size)


def inject_o_proj_bug(llm, layer: int, probe: Sequence[int], factor: float = 1.1):
    """Make the engine under test wrong on purpose: layer ``layer``'s attention output (its
    ``o_proj``) is scaled by ``factor`` (10% by default), a stand-in for a kernel bug inside that
    layer. Its own K/V are untouched; the error first shows in the KV of layer ``layer + 1`` (a
    layer's K and V come from its input). Proven on the engine with ``probe`` before it is used
    (``extractors.faults.inject_output_scale``): returns the ``InjectedFault``, or raises
    ``ValueError`` when the fault changed nothing."""
    from extractors.faults import inject_output_scale, o_proj_module

    return inject_output_scale(llm, o_proj_module(layer), factor, probe)


def run_demo(store_path="demo-store", arch: str = "llama-gqa", num_tokens: int = 8, seed: int = 0,
             release: str | None = None, prompts: Sequence[str] = DEMO_PROMPTS,
             out: Callable[[str], None] = print, inject_bug_layer: int | None = None,
             inject_bug_factor: float = 1.1):
    """Run the demo into ``store_path``; returns the ``ComparisonResult``.

    inject_bug_layer: scale that layer's attention output in the vLLM engine by
    ``inject_bug_factor`` (``inject_o_proj_bug``) to watch the verdict fail and name the first
    deviating KV layer. The fault is first proven to change the engine's output on the first
    prompt; a fault that changes nothing raises ``ValueError`` before anything is captured.
    The vLLM run's config records the CPU kernels the engine ran (``cpu_paths``) and the fault.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo prints its own progress
    from capturestore import Store
    from capturestore.analysis import compare_runs, find_reference_run, prompt_split
    from capturestore.writer import prompt_id
    from extractors.hf import capture_hf_run
    from extractors.models import model_content_hash, tiny_model

    say = _say(out)
    if num_tokens < 1:
        raise ValueError(f"run_demo: num_tokens must be >= 1, got {num_tokens}")
    say(f"building (or reusing) tiny model {arch!r} seed {seed}")
    model_path = tiny_model(arch, seed=seed)
    if inject_bug_layer is not None:  # refused before any capture, not after the references
        n_layers = json.loads((model_path / "config.json").read_text())["num_hidden_layers"]
        if not 0 <= inject_bug_layer < n_layers:
            raise ValueError(f"run_demo: --inject-bug-layer {inject_bug_layer} is outside the {arch} model's "
                             f"layers 0..{n_layers - 1}")
    model_hash = model_content_hash(model_path)
    rows = encode_prompts(model_path, prompts)
    pids = [prompt_id(r) for r in rows]
    store = Store.open(store_path)
    say(f"store {store.root}: {len(rows)} prompts, lengths {[len(r) for r in rows]}, {num_tokens} tokens each")

    base = find_reference_run(store, model_hash=model_hash, dtype="float32", prompt_ids=pids)
    if base is not None and any(len(prompt_split(store, base, p)[0]) != len(r) + num_tokens for p, r in zip(pids, rows)):
        base = None  # same prompts, other continuation length
    if base is None:
        say("capturing HF FP32 baseline (greedy continuation = teacher tokens)")
        base = capture_hf_run(store, model_path, rows, num_tokens=num_tokens, dtype="float32", release=release)
    else:
        say(f"reusing HF FP32 baseline run {base}")
    teacher = {p: store.read_tokens(base, p) for p in pids}
    teacher_rows = [teacher[p][len(r):].tolist() for p, r in zip(pids, rows)]

    exp = find_reference_run(store, model_hash=model_hash, dtype="bfloat16", prompt_ids=pids, teacher_tokens=teacher)
    if exp is None:
        say("capturing HF BF16 expected run (teacher-forced)")
        exp = capture_hf_run(store, model_path, rows, teacher_tokens=teacher_rows, dtype="bfloat16", release=release)
    else:
        say(f"reusing HF BF16 expected run {exp}")

    say("starting vLLM-CPU (bfloat16) with the KV capture worker extension")
    import vllm

    from extractors.faults import engine_cpu_paths
    from extractors.vllm_rpc import capture_vllm_run, close_llm, extract_vllm_kv_cache_config

    llm = make_vllm_engine(model_path, dtype="bfloat16")
    try:
        cpu_paths = engine_cpu_paths(llm)
        say(f"vLLM-CPU kernels: attention {cpu_paths['attn_isa']}, linear {cpu_paths['linear_backends']}")
        fault = None
        if inject_bug_layer is not None:
            say(f"injecting a bug: layer {inject_bug_layer}'s attention output scaled by {inject_bug_factor:g}")
            fault = inject_o_proj_bug(llm, inject_bug_layer, rows[0], inject_bug_factor)
            say(f"the bug bites: {fault.summary()}")
        kv_config = extract_vllm_kv_cache_config(llm)  # first RPC: starts block-table snapshotting
        say("teacher-forcing vLLM through its decode path (one pass per prompt) and capturing raw logits + paged KV")
        timing: dict = {}
        act = capture_vllm_run(
            store, llm, model_path, rows, teacher_rows, mode="decode", model_hash=model_hash, release=release,
            kv_config=kv_config, report=timing,
            config={"cpu_paths": cpu_paths, "injected_bug": None if fault is None else fault.as_config()},
        )
    finally:
        close_llm(llm)  # now, not at some later GC inside another engine's start
    say(f"vLLM run {act}: engine's own greedy token first differs from the teacher at {timing['diverged_at']} "
        f"(per prompt; None = never)")

    say("comparing runs (three-way: FP32 baseline, BF16 expected, vLLM actual)")
    result = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, label="demo",
                          progress=say)
    out("")
    out(format_layer_summary(result))
    out("")
    if result.logit_verdict is not None:
        out(f"logit verdict: {result.logit_verdict.summary()}")
    if result.kv_verdict is not None:
        out(f"KV verdict:    {result.kv_verdict.summary()}")
    out(f"overall:       {'PASS' if result.passed else 'FAIL'}"
        + (f" (first failure in {result.phase})" if result.phase else ""))
    out(f"comparison {result.comparison_id} stored in {store.root}; try:")
    out(f"  capturestore sql --store {store_path} \"SELECT layer, max(k_linf), max(base_k_linf) FROM kv_head_metrics "
        f"WHERE comparison_id = '{result.comparison_id}' GROUP BY layer ORDER BY layer\"")
    from reports import render_comparison  # the report sits beside the store, rendered from its queries

    beside = (store.root.parent / f"{store.root.name}-report" if isinstance(store.root, Path)
              else Path(f"{store.root.rstrip('/').rsplit('/', 1)[-1]}-report"))  # a bucket's store: here
    report = render_comparison(store, result.comparison_id, beside)
    out(f"report: {report} (capturestore report {result.comparison_id} --store {store_path} --out DIR)")
    return result


def format_layer_summary(result) -> str:
    """Per-layer table of the KV comparison: worst target and BF16 L-inf, pooled BC, sigma-ratio."""
    head = (f"{'layer':<32} {'K linf tgt':>10} {'K linf bf16':>11} {'K BC':>7} {'K σ-ratio':>9} "
            f"{'V linf tgt':>10} {'V linf bf16':>11} {'V BC':>7} {'V σ-ratio':>9}  verdict")
    lines = [head, "-" * len(head)]

    def f(x, w, p=4):
        return f"{'—':>{w}}" if x is None else f"{x:>{w}.{p}f}"

    for r in result.kv_layers:
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[r["passed"]]
        lines.append(
            f"{r['layer']:<32} {f(r['max_k_linf'], 10)} {f(r['max_base_k_linf'], 11)} {f(r['k_bc'], 7)} "
            f"{f(r['k_sigma_ratio'], 9, 3)} {f(r['max_v_linf'], 10)} {f(r['max_base_v_linf'], 11)} "
            f"{f(r['v_bc'], 7)} {f(r['v_sigma_ratio'], 9, 3)}  {verdict}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:  # pragma: no cover - the CLI's `demo` is the entry point
    run_demo()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
