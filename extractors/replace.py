"""Tensor replacement: run an HF model with chosen modules' inputs (or outputs) replaced by
another run's tensors of the same positions, and capture what the modules then produce.

reference/002's "Tensor replacement": a module's output carries every error made upstream of
it. Feeding it the expected reference's captured input at the same position (a forward
pre-hook) leaves only the module's own error, its *local* error; replacing a module's output
(a forward hook returning the reference's output) fences a fault in between two points: what
runs after it sees the reference's tensor again.

Layout as ``extractors.modules`` (module docstring there): per prompt, ``prefill`` (step 0,
positions ``0 .. P-1``) then ``decode`` step n feeding continuation token n at ``P + n``. A
source is one dict per prompt ``{(module, phase): array [token, ...]}`` (decode steps stacked in
step order, as ``collect_hf_modules`` returns them); the rows of the forward being run are
taken from it (prefill: all of them, decode step n: row n) and cast to the dtype of the tensor
they replace (a BF16 reference's values are exact in FP32 and back). A module's input is
``extractors.modules.module_input``: its first positional tensor argument, else its
``hidden_states`` keyword (HF calls attention with keywords), else its only tensor keyword; a
module whose input is not a floating tensor (the embedding's token ids) is not replaced.

RoPE on q/k: HF Llama-like attention has no rotary module; it calls the function
``apply_rotary_pos_emb(q, k, cos, sin)`` of its modeling module. The pseudo-module
``<attention>.rope`` (``ROPE_SUFFIX``; e.g. ``model.layers.1.self_attn.rope``) is that call in
that attention: captured and replaced like a module, its input the q and k before rotation and
its output after, as one tensor ``[token, q_heads + kv_heads, head_dim]`` (q's heads, then k's).
Replacing its input feeds the reference's q/k to the model's own rotation (its own cos/sin: a
position or frequency bug stays in). The function is patched in the modeling module while the
hooks are entered and restored on exit. A shape that differs from the tensor replaced, or a source lacking the rows of a
forward, raises ``ValueError`` naming the module, phase and step.

Every replacement is counted (``ReplaceHooks.replaced``): a caller can prove that each module
it asked for was replaced in every forward, rather than trust that a hook fired.

transformers and torch are imported lazily.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Self

from extractors.modules import module_input

__all__ = ["ROPE_SUFFIX", "ReplaceHooks", "collect_hf_replaced", "module_input", "rope_modules", "run_hf_replaced"]

ROPE_SUFFIX = ".rope"
_ROPE_FN = "apply_rotary_pos_emb"


def _rope_function_home(attn):
    """The modeling module whose ``apply_rotary_pos_emb`` ``attn``'s forward calls (None: none)."""
    import sys

    home = sys.modules.get(type(attn).__module__)
    return home if home is not None and callable(getattr(home, _ROPE_FN, None)) else None


def rope_modules(model, attentions: Sequence[str]) -> list[str]:
    """``<attention>.rope`` for each of ``attentions`` (module names) whose class calls an
    ``apply_rotary_pos_emb`` of its modeling module (module docstring)."""
    mods = dict(model.named_modules())
    return [a + ROPE_SUFFIX for a in attentions if a in mods and _rope_function_home(mods[a]) is not None]


class ReplaceHooks:
    """Hooks on ``model``: capture ``capture`` modules' outputs (and inputs, ``inputs=True``, as the
    module received them: after a replacement) to ``sink(name, phase, step, tensor [token, ...])``;
    replace the inputs of the modules in ``replace_inputs`` and the outputs of those in
    ``replace_outputs`` by ``source(module, phase, step, like, kind)`` (``like``: the tensor
    replaced, ``[1, token, ...]``; ``kind``: "input" or "output"). A module's captured output is what it computed, before its own output
    replacement. Only a module's first call per forward is captured or replaced (as
    ``ModuleHooks``). Use as a context manager; ``new_forward`` before each forward."""

    def __init__(self, model, capture: Sequence[str] = (), sink: Callable | None = None, inputs: bool = False,
                 replace_inputs: Sequence[str] = (), replace_outputs: Sequence[str] = (),
                 source: Callable | None = None):
        self.model, self.capture, self.sink, self.inputs = model, list(capture), sink, inputs
        self.replace_inputs, self.replace_outputs = set(replace_inputs), set(replace_outputs)
        if (self.replace_inputs or self.replace_outputs) and source is None:
            raise ValueError("ReplaceHooks: replacing tensors needs a source")
        self.source = source
        self.phase, self.step = "prefill", 0
        self.order: list[str] = []
        self.replaced: dict[tuple[str, str], int] = {}  # (module, "input"/"output") -> forwards replaced
        self.not_floating: set[str] = set()  # modules asked for whose input is not floating (token ids)
        self._pre_seen: set[str] = set()
        self._seen: set[str] = set()
        self._handles: list = []
        self._rope_of: dict[str, str] = {}  # attention module -> its rope pseudo-module
        self._rope_now: list[str] = []  # the attention(s) running now (innermost last)
        self._patched: list = []  # (modeling module, original apply_rotary_pos_emb)

    def new_forward(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, int(step)
        self._pre_seen.clear()
        self._seen.clear()

    def _rope_wrapper(self, orig):
        import torch

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            name = self._rope_of.get(self._rope_now[-1]) if self._rope_now else None
            if name is None or name in self._pre_seen:
                return orig(q, k, cos, sin, *args, **kwargs)
            self._pre_seen.add(name)
            hq = q.shape[1]
            x = torch.cat([q, k], dim=1).transpose(1, 2)  # [batch, token, q_heads + kv_heads, head_dim]
            if name in self.replace_inputs:
                x = self._take(name, x, "input")
                xt = x.transpose(1, 2)
                q, k = xt[:, :hq].contiguous(), xt[:, hq:].contiguous()
            if self.inputs and name in self._capture_set:
                self.sink(name + ":input", self.phase, self.step, x.detach()[0].to("cpu", copy=True))
            qo, ko = orig(q, k, cos, sin, *args, **kwargs)
            y = torch.cat([qo, ko], dim=1).transpose(1, 2)
            if name in self._capture_set:
                if name not in self.order:
                    self.order.append(name)
                self.sink(name, self.phase, self.step, y.detach()[0].to("cpu", copy=True))
            if name in self.replace_outputs:
                y = self._take(name, y, "output")
                yt = y.transpose(1, 2)
                qo, ko = yt[:, :hq].contiguous(), yt[:, hq:].contiguous()
            return qo, ko
        return apply_rotary_pos_emb

    def _attn_enter(self, attn: str):
        def hook(module, args, kwargs):
            self._rope_now.append(attn)
        return hook

    def _attn_exit(self, attn: str):
        def hook(module, args, output):
            if self._rope_now and self._rope_now[-1] == attn:
                self._rope_now.pop()
        return hook

    def _take(self, name: str, like, kind: str):
        new = self.source(name, self.phase, self.step, like, kind)
        if tuple(new.shape) != tuple(like.shape):
            raise ValueError(f"replacement of {name} ({self.phase} step {self.step}): the source holds shape "
                             f"{tuple(new.shape)}, the model's tensor is {tuple(like.shape)}")
        self.replaced[(name, kind)] = self.replaced.get((name, kind), 0) + 1
        return new.to(dtype=like.dtype, device=like.device)

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if name in self._pre_seen:
                return None
            self._pre_seen.add(name)
            x, where = module_input(args, kwargs)
            if name in self.replace_inputs and x is not None and x.is_floating_point():
                x = self._take(name, x, "input")
                if where[0] == "arg":
                    args = (x, *args[1:])
                else:
                    kwargs = {**kwargs, where[1]: x}
            elif name in self.replace_inputs and x is not None:
                self.not_floating.add(name)
            if self.inputs and name in self._capture_set and x is not None:
                self.sink(name + ":input", self.phase, self.step, x.detach()[0].to("cpu", copy=True))
            return args, kwargs
        return hook

    def _post(self, name: str):
        import torch

        def hook(module, args, output):
            if name in self._seen:
                return None
            self._seen.add(name)
            first = output if torch.is_tensor(output) else (
                output[0] if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]) else None)
            if name in self._capture_set and first is not None:
                if name not in self.order:
                    self.order.append(name)
                self.sink(name, self.phase, self.step, first.detach()[0].to("cpu", copy=True))
            if name in self.replace_outputs and first is not None:
                new = self._take(name, first, "output")
                return new if torch.is_tensor(output) else type(output)((new, *output[1:]))
            return None
        return hook

    def __enter__(self) -> Self:
        mods = dict(self.model.named_modules())
        self._capture_set = set(self.capture)
        wanted = [*self.capture, *sorted(self.replace_inputs - set(self.capture)),
                  *sorted(self.replace_outputs - set(self.capture) - self.replace_inputs)]
        ropes = [n for n in wanted if n.endswith(ROPE_SUFFIX) and n not in mods]
        missing = [n for n in wanted if n not in mods and not (n in ropes and n[:-len(ROPE_SUFFIX)] in mods)]
        if missing:
            raise ValueError(f"tensor replacement: the model ({type(self.model).__name__}) has no module(s) {missing[:4]}")
        homes = {}
        for r in ropes:
            attn = r[:-len(ROPE_SUFFIX)]
            home = _rope_function_home(mods[attn])
            if home is None:
                raise ValueError(f"tensor replacement: {attn} ({type(mods[attn]).__name__}) calls no "
                                 f"{_ROPE_FN} of its modeling module: {r} cannot be hooked")
            homes[id(home)] = home
            self._rope_of[attn] = r
            self._handles.append(mods[attn].register_forward_pre_hook(self._attn_enter(attn), with_kwargs=True))
            self._handles.append(mods[attn].register_forward_hook(self._attn_exit(attn)))
        for home in homes.values():
            orig = getattr(home, _ROPE_FN)
            self._patched.append((home, orig))
            setattr(home, _ROPE_FN, self._rope_wrapper(orig))
        for name in wanted:
            if name in ropes:
                continue
            self._handles.append(mods[name].register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(mods[name].register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for home, orig in reversed(self._patched):
            setattr(home, _ROPE_FN, orig)
        self._patched.clear()
        self._rope_of.clear()
        self._rope_now.clear()


def _dict_source(caps: Mapping, what: str):
    """``source`` over one prompt's ``{(module, phase): array [token, ...]}`` (inputs under
    ``module:input``): prefill all rows, decode step n row n."""
    import numpy as np
    import torch

    def source(name, phase, step, like, kind):
        name = name + ":input" if kind == "input" else name
        a = caps.get((name, phase))
        if a is None:
            raise ValueError(f"replacement of {name} ({phase}): the {what} holds no {name} ({phase})")
        if phase == "decode":
            if step >= len(a):
                raise ValueError(f"replacement of {name} (decode step {step}): the {what} holds {len(a)} decode steps")
            a = a[step:step + 1]
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))[None]
    return source


def run_hf_replaced(model, prompt: Sequence[int], continuation: Sequence[int], hooks: ReplaceHooks,
                    decode_steps: int | None = None):
    """``extractors.modules.capture_hf_modules``' stepwise forwards (prefill, then decode step n
    feeding continuation token n at position ``P + n``) under ``hooks`` (entered here). Returns
    the logits ``[gen_token, vocab]`` float of the forwards run."""
    from extractors.modules import stepwise_forward

    prompt, continuation = [int(t) for t in prompt], [int(t) for t in continuation]
    n_dec = max(0, len(continuation) - 1) if decode_steps is None else int(decode_steps)
    with hooks:
        return stepwise_forward(model, hooks, prompt, continuation, n_dec)


def collect_hf_replaced(model, prompts, continuations, capture: Sequence[str] = (), inputs: bool = False,
                        replace_inputs: Sequence[str] = (), replace_outputs: Sequence[str] = (),
                        sources: Sequence[Mapping] | None = None, what: str = "source"):
    """In memory, per prompt: ``({(module, phase): float32 [token, ...]}, logits, replaced)``
    with ``capture``'s outputs (and ``name:input`` entries with ``inputs``), the modules in
    ``replace_inputs`` / ``replace_outputs`` fed from ``sources[i]`` (one dict per prompt, as
    ``collect_hf_modules`` returns). ``replaced``: ``{(module, "input"/"output"): forwards}``.
    ``ValueError`` when a module asked for was not replaced in every forward it ran in."""
    import numpy as np

    from metrics.errors import as_float

    if (replace_inputs or replace_outputs) and (sources is None or len(sources) != len(prompts)):
        raise ValueError(f"collect_hf_replaced: need one source per prompt ({len(prompts)}), got "
                         f"{None if sources is None else len(sources)}")
    out = []
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        got: dict = {}

        def sink(module, phase, step, t, got=got):
            got.setdefault((module, phase), []).append(as_float(t, np.float32))

        src = _dict_source(sources[i], f"{what} of prompt {i}") if sources is not None else None
        hooks = ReplaceHooks(model, capture, sink, inputs, replace_inputs, replace_outputs, src)
        logits = run_hf_replaced(model, prompt, cont, hooks)
        forwards = len(logits)
        for name in replace_inputs:
            n = hooks.replaced.get((name, "input"), 0)
            if n != forwards and name not in hooks.not_floating:
                raise ValueError(f"tensor replacement: {name}'s input was replaced in {n} of {forwards} forwards "
                                 f"(prompt {i})")
        for name in replace_outputs:
            if hooks.replaced.get((name, "output"), 0) != forwards:
                raise ValueError(f"tensor replacement: {name}'s output was replaced in "
                                 f"{hooks.replaced.get((name, 'output'), 0)} of {forwards} forwards (prompt {i})")
        out.append(({k: np.concatenate(v, axis=0) for k, v in got.items()}, logits, dict(hooks.replaced)))
    return out

