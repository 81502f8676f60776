"""Engine-agnostic teacher-forced decode capture into the store.

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

__all__ = ["capture_teacher_forced_run"]


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
    config.update({"capture": "teacher_forced_decode", "generate_calls": len(result.calls),
                   "diverged_at": [c["diverged_at"] for c in result.calls if c["diverged_at"] is not None]})
    run = store.begin_run(**{**run_kwargs, "config": config})
    with run:
        for b, prompt in enumerate(rows):
            pid = run.add_prompt(prompt, continuation=teacher[b].tolist())
            run.write_logits(pid, actual[:, b])
            if result.merged_kv is not None:
                names = list(layer_names) if layer_names is not None else list(result.merged_kv)
                seq = len(prompt) + T
                k = _stack([result.merged_kv[n][0][b, :, :seq] for n in names])
                v = _stack([result.merged_kv[n][1][b, :, :seq] for n in names])
                run.write_kv(pid, k, v, layer_names=names)
    return run.run_id, result


def _stack(parts):
    """Stack per-layer KV in its own library (torch or numpy): the store keeps bf16 bit-exact."""
    if hasattr(parts[0], "detach"):
        import torch

        return torch.stack(parts)
    return np.stack(parts)
