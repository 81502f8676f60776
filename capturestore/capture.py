"""The capture driver every extractor feeds, and engine-agnostic teacher-forced decode capture.

``begin_capture_run`` begins a run with the run configuration every engine records the same
way (``CAPTURE_CONFIG_KEYS``: how it was captured, prompt lengths, stored layer names and the
stored layouts), merged over the engine's own keys (block size, scales, kernels, ...);
``write_prompt_capture`` writes one prompt's tokens, logits and KV. ``extractors.hf``,
``extractors.vllm_rpc``, ``nki_fp8.target`` and ``capture_teacher_forced_run`` go through them.

``capture_teacher_forced_run`` drives ``metrics.logits.validate_logits`` (the upstream
teacher-forcing loop) with any engine's ``generate_fn`` / ``kv_extract_fn`` and stores what the
engine produced at every validated generation index: its logits and its KV, merged across
re-feeds so that only positions whose input token is the teacher's are kept. Unlike a single
prefill over prompt + teacher tokens, this exercises the engine's decode path and its KV cache
writes, where the bugs of interest live.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["CAPTURE_CONFIG_KEYS", "begin_capture_run", "capture_teacher_forced_run", "write_prompt_capture"]

CAPTURE_MODES = ("teacher_forced_prefill", "teacher_forced_decode", "greedy")
STORED_KV_LAYOUT = ("[layer, kv_head, position, head_dim]; NaN where the engine holds no value "
                    "(outside a sliding window, a position never fed back)")
STORED_LOGITS_LAYOUT = "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j"
# The keys every run's config holds, whatever the engine (values from begin_capture_run).
CAPTURE_CONFIG_KEYS = ("capture", "capture_config_version", "prompt_lens", "layer_names", "logits_kind",
                       "stored_kv_layout", "stored_logits_layout")


def begin_capture_run(store, *, engine: str, capture: str, prompts: Sequence[Sequence[int]],
                      layer_names: Sequence[str] | None, logits_kind: str | None, config: dict | None = None,
                      **run_kwargs):
    """``store.begin_run`` with the common run config (``CAPTURE_CONFIG_KEYS``) over ``config``.

    capture: ``teacher_forced_prefill`` (prompt + teacher tokens in one pass), ``teacher_forced_decode``
    (the engine's decode path fed the teacher tokens) or ``greedy``; layer_names: the KV layers in
    stored order (None: no KV or not known up front); logits_kind: ``logits``, ``raw_logits``,
    ``log_softmax`` or None (not said). run_kwargs: the rest of ``begin_run`` (model_path,
    model_hash, dtype, device, engine_version, tp_degree, release). Returns the ``RunWriter``.
    """
    if capture not in CAPTURE_MODES:
        raise ValueError(f"begin_capture_run ({engine}): capture must be one of {CAPTURE_MODES}, got {capture!r}")
    common = {
        "capture": capture,
        "capture_config_version": 1,
        "prompt_lens": [len(p) for p in prompts],
        "layer_names": None if layer_names is None else list(layer_names),
        "logits_kind": logits_kind,
        "stored_kv_layout": STORED_KV_LAYOUT,
        "stored_logits_layout": STORED_LOGITS_LAYOUT,
    }
    return store.begin_run(engine=engine, config={**(config or {}), **common}, **run_kwargs)


def write_prompt_capture(run, prompt, continuation, logits, kv: dict | None = None,
                         layer_names: Sequence[str] | None = None) -> str:
    """One prompt of a capture: tokens = prompt + continuation, ``logits [gen_token, vocab]`` and,
    with ``kv`` (``{layer: (k, v)}``, ``[kv_head, position, head_dim]`` each), KV stacked in
    ``layer_names`` order (default: ``kv``'s). Returns the prompt id."""
    pid = run.add_prompt([int(t) for t in prompt], continuation=[int(t) for t in continuation])
    run.write_logits(pid, logits)
    if kv is not None:
        names = list(layer_names) if layer_names is not None else list(kv)
        run.write_kv(pid, _stack([kv[n][0] for n in names]), _stack([kv[n][1] for n in names]), layer_names=names)
    return pid


def capture_teacher_forced_run(
    store,
    *,
    generate_fn: Callable,
    prompts: Sequence[Sequence[int]],
    expected_logits,
    baseline_logits=None,
    kv_extract_fn: Callable | None = None,
    layer_names: Sequence[str] | None = None,
    run_kwargs: dict,
    tol_map=None,
) -> tuple[str, Any]:
    """Teacher-force an engine through ``validate_logits`` and store its logits and KV.

    prompts: one token-id list per prompt (batch row). expected_logits, baseline_logits:
    ``[gen_token, batch, vocab]`` of the references; the teacher tokens are the argmax of the
    baseline (three-way) or expected logits, exactly as the loop uses them.
    generate_fn(input_ids) -> ``[n_new, batch, vocab]``; kv_extract_fn(seq_len) ->
    ``{layer: (k, v)}`` ``[batch, kv_head, seq, head_dim]`` (see ``validate_logits``).
    run_kwargs: passed to ``store.begin_run`` (engine, model_path, dtype, ...).

    Per prompt the run holds tokens = prompt + teacher tokens, logits ``[gen_token, vocab]``
    (the engine's output at each generation index, taken from the call that validated it) and,
    with ``kv_extract_fn``, KV ``[layer, kv_head, position, head_dim]`` (NaN where no call wrote a
    teacher-token position, e.g. the last token, which is never fed back).
    Returns ``(run_id, LogitValidationResult)``.
    """
    from metrics.logits import validate_logits

    outputs: list[np.ndarray] = []

    def recording_generate_fn(input_ids):
        out = generate_fn(input_ids)
        logits = out[0] if isinstance(out, tuple) else out
        outputs.append(np.asarray(logits.float().numpy() if hasattr(logits, "numpy") else logits, dtype=np.float32))
        return out

    rows = [[int(t) for t in p] for p in prompts]
    result = validate_logits(rows, recording_generate_fn, expected_logits, tol_map=tol_map,
                             baseline_logits=baseline_logits, kv_extract_fn=kv_extract_fn)
    teacher_src = baseline_logits if baseline_logits is not None else expected_logits
    teacher_src = np.asarray(teacher_src.float().numpy() if hasattr(teacher_src, "numpy") else teacher_src)
    T, B, V = teacher_src.shape
    teacher = np.argmax(teacher_src, axis=-1).T  # [batch, gen_token]

    actual = np.full((T, B, V), np.nan, dtype=np.float32)
    for call, out in zip(result.calls, outputs):
        s, n = call["start"], call["validated"]
        actual[s : s + n] = out[:n]

    config = dict(run_kwargs.get("config") or {})
    config.update({"generate_calls": len(result.calls),
                   "diverged_at": [c["diverged_at"] for c in result.calls if c["diverged_at"] is not None]})
    names = None
    if result.merged_kv is not None:
        names = list(layer_names) if layer_names is not None else list(result.merged_kv)
    kwargs = {k: v for k, v in run_kwargs.items() if k not in ("config", "engine")}
    run = begin_capture_run(store, engine=run_kwargs["engine"], capture="teacher_forced_decode", prompts=rows,
                            layer_names=names, logits_kind=config.get("logits_kind"), config=config, **kwargs)
    with run:
        for b, prompt in enumerate(rows):
            kv = None
            if names is not None:
                seq = len(prompt) + T
                kv = {n: (result.merged_kv[n][0][b, :, :seq], result.merged_kv[n][1][b, :, :seq]) for n in names}
            write_prompt_capture(run, prompt, teacher[b].tolist(), actual[:, b], kv, names)
    return run.run_id, result


def _stack(parts):
    """Stack per-layer KV in its own library (torch or numpy): the store keeps bf16 bit-exact."""
    if hasattr(parts[0], "detach"):
        import torch

        return torch.stack(parts)
    return np.stack(parts)
