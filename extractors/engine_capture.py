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

- **KV cache contents** (the cache, not the projections that feed it): ``kv=reader`` calls
  ``reader()`` when the ``with`` block ends (before the engine reuses the request's cache),
  or the engine hands them itself with ``capture.set_kv(per_layer)`` while they are its own.
  Either gives the request's K and V per layer, ``[kv_head, position, head_dim]`` (index ==
  position; a leading batch axis of 1 is dropped): a dict ``{layer name: (k, v)}`` named as
  the references name layers (``extractors.hf.hf_layer_names(model)``), or a sequence of
  ``(k, v)`` in layer order, named so. They are copied at once; positions past the tokens the
  request was fed are cut (never written for it: what they hold is another request's), and
  positions it was fed but the cache does not hold are NaN (never a pass).

``capture.result()`` is the request's ``RequestCapture``; ``write_module_run(store, model_path,
requests, dtype)`` writes requests into a run laid out like ``capture_hf_module_run``'s (the
store writing both use: ``extractors.modules.write_prompt_modules``), so its run compares with
HF module references like any other (``compare_runs(..., comparators=["modules"])``), and, with
KV captured, its KV in the built-in layout (``[layer, kv_head, seq, head_dim]`` over prompt +
continuation, NaN at the last continuation token, never fed: the run declares ``capture:
"teacher_forced_decode"``) against HF runs' KV (``capture_hf_run``, ``compare_runs(...,
kv=True)``).

Teacher forcing is the engine's: feed the references' continuation (``capturestore run``'s
teacher tokens) to the loop so the positions hold the same tokens in every run.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extractors.modules import DEFAULT_MODULES, INPUT_SUFFIX, first_tensor, module_input, modules_of

__all__ = ["EngineCapture", "RequestCapture", "nan_padded", "write_module_run"]


@dataclass
class RequestCapture:
    """One request's captures. prefill: ``{module: [prompt_len, ...]}``; decode: ``{module: [step
    tensors [1, ...]]}``; logits: ``[gen_token, vocab]`` float32 (prefill's last row, then one per
    decode step); order: modules in execution order; fed: tokens the request was fed; kv:
    ``{layer: (k, v)}`` ``[kv_head, fed, head_dim]`` of the engine's cache (None: not captured)."""

    prompt_len: int
    prefill: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    logits: object = None
    order: list = field(default_factory=list)
    fed: int = 0
    kv: dict | None = None


class EngineCapture:
    """Hooks for one request of the user's engine (module docstring). Use as a context manager
    around the engine's loop; ``result()`` after it."""

    def __init__(self, model, modules: Iterable[str] | str = DEFAULT_MODULES, *, prompt_len: int | None = None,
                 row: int = 0, inputs: bool = False, logits: bool = True, kv=None):
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
        if kv is not None and not callable(kv):
            raise ValueError(f"EngineCapture: kv must be a callable returning the request's K/V per layer, got "
                             f"{type(kv).__name__}")
        self._kv_reader = kv
        self._kv: dict | None = None

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

    def set_kv(self, per_layer, layer_names: Sequence[str] | None = None) -> None:
        """The request's cache contents, ``{layer: (k, v)}`` or ``[(k, v), ...]`` in layer order
        (named ``layer_names``, default ``extractors.hf.hf_layer_names(model)``); k, v
        ``[kv_head, position, head_dim]`` (or ``[1, kv_head, position, head_dim]``). Copied now."""
        import torch

        if isinstance(per_layer, dict):
            items = list(per_layer.items())
        else:
            pairs = list(per_layer)
            if layer_names is None:
                from extractors.hf import hf_layer_names

                layer_names = hf_layer_names(self.model)
            if len(layer_names) != len(pairs):
                raise ValueError(f"EngineCapture.set_kv: {len(pairs)} layers of K/V for {len(layer_names)} layer "
                                 f"names")
            items = list(zip(layer_names, pairs))
        if not items:
            raise ValueError("EngineCapture.set_kv: no layers")
        out = {}
        for name, kv in items:
            if not isinstance(kv, (tuple, list)) or len(kv) != 2:
                raise ValueError(f"EngineCapture.set_kv: layer {name}: expected a (k, v) pair")
            pair = []
            for what, t in zip("kv", kv):
                t = torch.as_tensor(t).detach()
                if t.ndim == 4 and t.shape[0] == 1:
                    t = t[0]
                if t.ndim != 3:
                    raise ValueError(f"EngineCapture.set_kv: layer {name}: {what} of shape {tuple(t.shape)}, expected "
                                     f"[kv_head, position, head_dim]")
                pair.append(t.to("cpu", copy=True))
            if pair[0].shape[:2] != pair[1].shape[:2]:
                raise ValueError(f"EngineCapture.set_kv: layer {name}: k {tuple(pair[0].shape)} and v "
                                 f"{tuple(pair[1].shape)} differ in heads or positions")
            out[str(name)] = tuple(pair)
        self._kv = out

    def _kv_fed(self) -> dict | None:
        """The K/V handed, cut or NaN-padded to the positions the request was fed."""
        if self._kv is None:
            return None
        return {name: tuple(nan_padded(t[:, :self._fed], self._fed) for t in pair) for name, pair in self._kv.items()}

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
                              self._fed, self._kv_fed())

    # ---------------------------------------------------------------- hooks

    def __enter__(self) -> EngineCapture:
        self._thread = threading.current_thread()
        mods = dict(self.model.named_modules())
        self._handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._end, with_kwargs=True))
        for name in self.modules:
            self._handles.append(mods[name].register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._kv_reader is not None and exc_type is None:
            self.set_kv(self._kv_reader())

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
        def hook(module, args, kwargs, output):
            if threading.current_thread() is not self._thread or self._cur is None or name in self._seen:
                return
            self._seen.add(name)
            if name not in self._order:
                self._order.append(name)
            if self.inputs:
                t, _ = module_input(args, kwargs)  # positional or keyword (HF attention: hidden_states=)
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
    ``engine_loop`` (never taken for a reference). Captures holding KV (``EngineCapture(kv=...)``
    / ``set_kv``; all requests or none, the same layers) also write it: ``[layer, kv_head, seq,
    head_dim]`` over prompt + continuation in the given layer order, NaN past the positions fed
    (the last continuation token is sampled, never fed: the run's ``capture`` is
    ``teacher_forced_decode``, so the KV verdict exempts that position)."""
    import torch

    from extractors.models import model_content_hash
    from extractors.modules import MODULE_LOGITS_LAYOUT, MODULE_TENSOR_LAYOUT, write_prompt_modules
    from extractors.routing import routing_run_config

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
    with_kv = [cap.kv is not None for _, _, cap in rows]
    kv_names = list(rows[0][2].kv) if with_kv[0] else None
    for i, (_, _, cap) in enumerate(rows):
        if with_kv[i] != with_kv[0] or (kv_names is not None and list(cap.kv) != kv_names):
            raise ValueError(f"write_module_run: requests[{i}]: KV layers {list(cap.kv or [])[:3]} where requests[0] "
                             f"holds {(kv_names or [])[:3]}: capture the same KV layers for every request, or none")
    order = rows[0][2].order
    cfg = {"mode": "engine_loop", "module_order": order, "modules": order,
           "module_patterns": order, "prompt_lens": [len(p) for p, _, _ in rows],
           "tensor_layout": MODULE_TENSOR_LAYOUT, "logits_layout": MODULE_LOGITS_LAYOUT, "model_given": True,
           **({"capture": "teacher_forced_decode", "layer_names": kv_names,
               "kv_layout": "[layer, kv_head, seq, head_dim]; seq index == position; the engine's cache contents, "
                            "NaN at positions not fed (the last continuation token)"} if kv_names else {}),
           **routing_run_config(model_path), **(config or {})}
    run = store.begin_run(engine=engine, model_path=str(Path(model_path)),
                          model_hash=model_hash or model_content_hash(model_path), dtype=dtype, device=device,
                          engine_version=engine_version, release=release, config=cfg)
    with run:
        for prompt, cont, cap in rows:
            n = len(cont) - 1
            decode = {m: steps[:n] for m, steps in cap.decode.items() if n}
            logits = None if cap.logits is None else cap.logits[:n + 1]
            pid = write_prompt_modules(run, prompt, cont, [(m, 0, t) for m, t in cap.prefill.items()], decode, logits)
            if kv_names is not None:
                seq = len(prompt) + len(cont)
                k, v = (torch.stack([nan_padded(cap.kv[n][j][:, :seq], seq) for n in kv_names]) for j in (0, 1))
                run.write_kv(pid, k, v, layer_names=kv_names)
    return run.run_id


def nan_padded(t, n: int):
    """``t`` ``[kv_head, position, head_dim]`` NaN-padded along positions to ``n`` (as is when it holds them)."""
    import torch

    if t.shape[1] >= n:
        return t
    return torch.cat([t, torch.full((t.shape[0], n - t.shape[1], t.shape[2]), float("nan"), dtype=t.dtype)], dim=1)
