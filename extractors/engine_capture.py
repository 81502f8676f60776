"""Module tensors of the user's own engine, captured by hooks on its model while its own loop runs.

An engine with its own loop, cache and patches is captured where it runs, never by re-running its
model through capturestore's loop (``capture_hf_module_run(model=...)``): a fault in the loop or
the cache (a decode position off by one, a KV write into the wrong slot, stale cache entries, a
rounded or scaled cache write) is not in the model, so the project's loop does not have it.

``EngineCapture(model, modules, prompt_len=P)`` hooks ``modules`` of ``model`` (and the model's
own forward) for ONE request while the engine runs it:

- **Which rows and columns are the request's.** ``row``: the request's batch row (change it
  between forwards as a scheduler moves requests, ``capture.row = r``). Its columns in a forward
  are, first found of: ``columns`` given to ``capture.step(...)``; the model call's
  ``attention_mask`` (``[batch, past + seq]``: this forward's ``seq`` columns where the mask is
  non-zero, so left and right padding both drop out); every column. A forward in which the
  request has no column captures nothing for it.
- **Phases, tracked from the tokens the request was fed** (never from the engine's position ids:
  a position bug must not move the capture). Its forwards are ``prefill`` until ``prompt_len``
  of its tokens have been fed (several forwards = prefill chunks, stitched in order into one
  ``[prompt_len, ...]``), then decode step ``0, 1, ...``, one token each. ``prompt_len=None``:
  the first forward is the whole prefill. ``with capture.step(phase, step, row=..., columns=...)``
  states it for the forwards inside instead.
- **Layout** (the same as ``extractors.modules``): prefill ``[prompt_len, ...]`` (step 0), decode
  step n ``[1, ...]`` feeding continuation token n at position ``prompt_len + n``; the batch
  dimension is dropped; a tuple output keeps its first tensor; a module running twice in one
  forward keeps its first call; every tensor is copied as it is produced. The logits of the
  forward that ends the prefill (its last prompt column) and of each decode step make the
  ``[gen_token, vocab]`` logits rows. Hooked modules must return ``[batch, token, ...]``.

``capture.result()`` is the request's ``RequestCapture``; ``write_module_run(store, model_path,
requests, dtype)`` writes requests into a run laid out like ``capture_hf_module_run``'s (the
store writing both use: ``extractors.modules.write_prompt_modules``), so its run compares with
HF module references like any other (``compare_runs(..., comparators=["modules"])``).

Teacher forcing is the engine's: feed the references' continuation (``capturestore run``'s
teacher tokens) to the loop so the positions hold the same tokens in every run.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extractors.modules import DEFAULT_MODULES, INPUT_SUFFIX, first_tensor, modules_of

__all__ = ["EngineCapture", "RequestCapture", "write_module_run"]


@dataclass
class RequestCapture:
    """One request's captures. prefill: ``{module: [prompt_len, ...]}``; decode: ``{module: [step
    tensors [1, ...]]}``; logits: ``[gen_token, vocab]`` float32 (prefill's last row, then one per
    decode step); order: modules in execution order; fed: tokens the request was fed."""

    prompt_len: int
    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    logits: object = None
    order: list = field(default_factory=list)
    fed: int = 0


class EngineCapture:
    """Hooks for one request of the user's engine (module docstring). Use as a context manager
    around the engine's loop; ``result()`` after it."""

    def __init__(self, model, modules: Iterable[str] | str = DEFAULT_MODULES, *, prompt_len: int | None = None,
                 row: int = 0, inputs: bool = False, logits: bool = True):
        if prompt_len is not None and (isinstance(prompt_len, bool) or not isinstance(prompt_len, int)
                                       or prompt_len < 1):
            raise ValueError(f"EngineCapture: prompt_len must be an integer >= 1, got {prompt_len!r}")
        self.model, self.inputs, self.want_logits = model, inputs, logits
        self.modules = modules_of(model, [modules] if isinstance(modules, str) else list(modules))
        self.row = int(row)
        self._prompt_len = prompt_len
        self._forced: dict | None = None  # phase/step/row/columns stated by step()
        self._cur: dict | None = None  # the forward running now: phase, step, row, columns
        self._seen: set = set()
        self._prefill_chunks: dict = {}
        self._decode: dict = {}
        self._logits: list = []
        self._order: list = []
        self._fed = 0
        self._n_decode = 0
        self._handles: list = []
        self._thread = None

    # ---------------------------------------------------------------- the user's side

    @contextlib.contextmanager
    def step(self, phase: str | None = None, step: int | None = None, *, row: int | None = None,
             columns: Sequence[int] | None = None):
        """State the phase / decode step / batch row / columns of the forwards run inside."""
        if phase not in (None, "prefill", "decode"):
            raise ValueError(f"EngineCapture.step: phase must be prefill or decode, got {phase!r}")
        old, self._forced = self._forced, {"phase": phase, "step": step, "row": row,
                                           "columns": None if columns is None else [int(c) for c in columns]}
        try:
            yield self
        finally:
            self._forced = old

    def result(self) -> RequestCapture:
        """The request's captures; ValueError when its prefill is incomplete."""
        import torch

        P = self._prompt_len if self._prompt_len is not None else self._prefill_len()
        got = self._prefill_len()
        if self._fed == 0:
            raise ValueError(f"EngineCapture: nothing of the request was captured: batch row {self.row} was in no "
                             f"forward (or it had no column there)")
        if got != P:
            raise ValueError(f"EngineCapture: the request's prefill covered {got} of its {P} prompt tokens (batch "
                             f"row {self.row}): was it in the forwards run, and in that row?")
        prefill = {m: torch.cat(ts, dim=0) for m, ts in self._prefill_chunks.items()}
        logits = torch.stack(self._logits) if self._logits else None
        return RequestCapture(P, prefill, {m: list(v) for m, v in self._decode.items()}, logits, list(self._order),
                              self._fed)

    # ---------------------------------------------------------------- hooks

    def __enter__(self) -> EngineCapture:
        self._thread = threading.current_thread()
        mods = dict(self.model.named_modules())
        self._handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._end, with_kwargs=True))
        for name in self.modules:
            self._handles.append(mods[name].register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _prefill_len(self) -> int:
        first = next(iter(self._prefill_chunks.values()), [])
        return sum(int(t.shape[0]) for t in first)

    def _begin(self, module, args, kwargs):
        if threading.current_thread() is not self._thread:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None or ids.ndim < 2:
            raise ValueError("EngineCapture: the model was called without [batch, seq] input_ids or inputs_embeds")
        batch, seq = int(ids.shape[0]), int(ids.shape[1])
        forced = self._forced or {}
        row = forced.get("row") if forced.get("row") is not None else self.row
        if not 0 <= row < batch:
            self._cur = None  # the request is not in this forward's batch
            return
        cols = forced.get("columns")
        if cols is None:
            mask = kwargs.get("attention_mask")
            if mask is not None and getattr(mask, "ndim", 0) == 2:
                cols = [int(c) for c in (mask[row, -seq:] != 0).nonzero().flatten().tolist()]
            else:
                cols = list(range(seq))
        if not cols:
            self._cur = None
            return
        if any(not 0 <= c < seq for c in cols):
            raise ValueError(f"EngineCapture: columns {cols} outside the forward's {seq} tokens")
        phase, stp = forced.get("phase"), forced.get("step")
        if phase is None:
            in_prefill = (self._fed == 0 if self._prompt_len is None else self._fed < self._prompt_len)
            phase = "prefill" if in_prefill else "decode"
        if phase == "prefill" and self._prompt_len is not None and self._fed + len(cols) > self._prompt_len:
            raise ValueError(f"EngineCapture: a prefill forward of {len(cols)} tokens after {self._fed} overruns the "
                             f"prompt of {self._prompt_len} (batch row {row}): a forward mixing prompt and "
                             f"continuation tokens needs capture.step(columns=...) per part")
        if phase == "decode":
            if len(cols) != 1:
                raise ValueError(f"EngineCapture: a decode step feeds one token of the request, this forward "
                                 f"{len(cols)} (batch row {row}, columns {cols})")
            stp = self._n_decode if stp is None else int(stp)
        self._cur = {"phase": phase, "step": 0 if phase == "prefill" else stp, "row": row,
                     "columns": cols}
        self._seen.clear()

    def _take(self, t):
        import torch

        cur = self._cur
        idx = torch.as_tensor(cur["columns"], device=t.device)
        return t.detach()[cur["row"]].index_select(0, idx).to("cpu", copy=True)

    def _keep(self, name, t):
        if self._cur["phase"] == "prefill":
            self._prefill_chunks.setdefault(name, []).append(t)
        else:
            steps = self._decode.setdefault(name, [])
            if len(steps) != self._cur["step"]:
                raise ValueError(f"EngineCapture: decode step {self._cur['step']} of {name} after {len(steps)} "
                                 f"steps (steps must come in order)")
            steps.append(t)

    def _hook(self, name: str):
        def hook(module, args, output):
            if threading.current_thread() is not self._thread or self._cur is None or name in self._seen:
                return
            self._seen.add(name)
            if name not in self._order:
                self._order.append(name)
            if self.inputs:
                t = first_tensor(args)
                if t is not None:
                    self._keep(name + INPUT_SUFFIX, self._take(t))
            t = first_tensor(output)
            if t is not None:
                self._keep(name, self._take(t))
        return hook

    def _end(self, module, args, kwargs, output):
        if threading.current_thread() is not self._thread or self._cur is None:
            return
        cur, n = self._cur, len(self._cur["columns"])
        self._fed += n
        done_prefill = cur["phase"] == "prefill" and (self._prompt_len is None or self._fed == self._prompt_len)
        if self.want_logits and (done_prefill or cur["phase"] == "decode"):
            lg = getattr(output, "logits", None)
            if lg is None and isinstance(output, (tuple, list)) and output:
                lg = output[0]
            if lg is not None:
                self._logits.append(lg.detach()[cur["row"], cur["columns"][-1]].float().to("cpu", copy=True))
        if cur["phase"] == "decode":
            self._n_decode = cur["step"] + 1
        if done_prefill and self._prompt_len is None:
            self._prompt_len = self._fed
        self._cur = None


def write_module_run(store, model_path, requests: Sequence[tuple], dtype: str, *, release=None, config=None,
                     model_hash: str | None = None, engine: str = "own", engine_version: str | None = None,
                     device: str = "cpu") -> str:
    """Write the user's engine's captures into a run of ``store``; returns the run id.

    requests: ``(prompt token ids, continuation token ids, RequestCapture)`` per prompt, the
    continuation being the tokens the engine was fed (teacher-forced; ``len(continuation) - 1``
    decode steps captured at least, as ``capture_hf_module_run`` does: logits rows
    ``1 + decode steps``). The run's config records the modules in execution order
    (``module_order``) and the layout, as ``capture_hf_module_run``'s; ``mode`` says
    ``engine_loop`` (never taken for a reference)."""
    from extractors.models import model_content_hash
    from extractors.modules import MODULE_LOGITS_LAYOUT, MODULE_TENSOR_LAYOUT, write_prompt_modules

    if not requests:
        raise ValueError("write_module_run: no requests")
    rows = []
    for i, req in enumerate(requests):
        prompt, cont, cap = req
        prompt, cont = [int(t) for t in prompt], [int(t) for t in cont]
        if cap.prompt_len != len(prompt):
            raise ValueError(f"write_module_run: requests[{i}]: the capture's prefill is {cap.prompt_len} tokens, "
                             f"the prompt {len(prompt)}")
        n_dec = min((len(v) for v in cap.decode.values()), default=0)
        if len(cont) < 1 or n_dec < len(cont) - 1:
            raise ValueError(f"write_module_run: requests[{i}]: {n_dec} decode steps captured for {len(cont)} "
                             f"continuation tokens (need {max(len(cont) - 1, 0)})")
        rows.append((prompt, cont, cap))
    order = rows[0][2].order
    cfg = {"mode": "engine_loop", "module_order": order, "modules": order,
           "module_patterns": order, "prompt_lens": [len(p) for p, _, _ in rows],
           "tensor_layout": MODULE_TENSOR_LAYOUT, "logits_layout": MODULE_LOGITS_LAYOUT, "model_given": True,
           **(config or {})}
    run = store.begin_run(engine=engine, model_path=str(Path(model_path)),
                          model_hash=model_hash or model_content_hash(model_path), dtype=dtype, device=device,
                          engine_version=engine_version, release=release, config=cfg)
    with run:
        for prompt, cont, cap in rows:
            n = len(cont) - 1
            decode = {m: steps[:n] for m, steps in cap.decode.items() if n}
            logits = None if cap.logits is None else cap.logits[:n + 1]
            write_prompt_modules(run, prompt, cont, [(m, 0, t) for m, t in cap.prefill.items()], decode, logits)
    return run.run_id
