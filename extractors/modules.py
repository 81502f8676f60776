"""Module tensors: capture chosen modules' outputs (and inputs on request), per phase, teacher-forced.

Modules are chosen by patterns over dotted module names, one segment per dot:
``*`` matches one segment, ``**`` any number of segments (zero included), ``a-b`` an integer
segment in ``[a, b]`` (so ``model.layers.0-31`` is the decoder layers 0..31 themselves and
``model.layers.*.mlp`` every layer's MLP), anything else matches literally. A pattern matching no
module is refused with the names closest to it. ``DEFAULT_MODULES`` is every module of a
decoder model whose output is an activation: the embedding, each decoder layer and everything
inside it, the final norm and the LM head (not the rotary embedding, a function of positions).

Phases (layout of what is stored, ``tensors/<module>/<phase>`` in the run):
- ``prefill``: one forward over the prompt (positions ``0 .. P-1``); step 0, ``[P, ...]``.
- ``decode``: step ``n`` feeds continuation token ``n`` at position ``P + n`` with the cache of
  everything before it (teacher-forced: the continuation is given, not sampled); ``[1, ...]``
  per step. By default ``n = 0 .. T-2`` for ``T`` continuation tokens: the forwards that
  produce continuation logit rows ``1 .. T-1``, as a greedy engine asked for ``T`` tokens runs
  them (the last token it samples is never fed back).
The batch dimension is dropped (one prompt per forward); a module's trailing dims are its own.
A 2-D output is already flattened over batch and tokens (``[token, ...]``: MoE routers' logits
``[token, expert]`` and experts' outputs) and is kept whole, as is (one prompt per forward).
A tuple output (attention returns ``(output, weights)``) is captured as its first tensor. A
module that runs several times in one forward (Gemma3's rotary embedding) keeps its first call.

Capture is a copy: every captured tensor is cloned before the forward goes on, so a kernel
that later reuses the buffer in place cannot change what was captured. Tensors go to a sink as
they are produced (into the store: once the prompt's last step ran, its module tensors of one
phase, dtype, step list and shape with one ``RunWriter.write_tensor_group``, an array
``tensor_groups/<phase>_<k>`` [module, step, ...] with a chunk per module, in a store of format 6;
in an older store each module's prefill output and its decode steps with one
``RunWriter.write_tensor_steps``: docs/module-compare.md "Store layout", "Grouped module tensors";
a whole model's prompt is written on a background thread while the next prompt's forwards run), so
memory holds two prompts' outputs at most, never the run. Readers name a module tensor
``tensors/<module>/<phase>`` (the captures row's ``array_name``) in either layout.

transformers and torch are imported lazily.
"""
from __future__ import annotations

import difflib
import re
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_MODULES",
    "PHASES",
    "resolve_modules",
    "ModuleHooks",
    "module_input",
    "capture_hf_modules",
    "capture_hf_module_run",
    "collect_hf_modules",
    "write_module_groups",
    "write_prompt_modules",
]

DEFAULT_MODULES = ("model.embed_tokens", "model.layers.*", "model.layers.*.**", "model.norm", "lm_head")
PHASES = ("prefill", "decode")
_RANGE = re.compile(r"^(\d+)-(\d+)$")
INPUT_SUFFIX = ":input"
MODULE_TENSOR_LAYOUT = ("tensors/<module>/prefill: step 0 [prompt_len, ...]; tensors/<module>/decode: step n [1, ...] "
                        "feeding continuation token n at position prompt_len + n")
MODULE_LOGITS_LAYOUT = "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j"


def _seg_match(pat: str, seg: str) -> bool:
    if pat == "*":
        return True
    m = _RANGE.match(pat)
    if m:
        return seg.isdigit() and int(m.group(1)) <= int(seg) <= int(m.group(2))
    return pat == seg


def _match(pat: list[str], name: list[str]) -> bool:
    if not pat:
        return not name
    if pat[0] == "**":
        return any(_match(pat[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and _seg_match(pat[0], name[0]) and _match(pat[1:], name[1:])


def _is_literal(pat: list[str]) -> bool:
    """A pattern that only matches the module of that very name (no ``*``, ``**`` or range)."""
    return not any(seg in ("*", "**") or _RANGE.match(seg) for seg in pat)


def resolve_modules(names: Sequence[str], patterns: Iterable[str] | str, where: str = "module capture") -> list[str]:
    """The names (in the order given) matched by any pattern; ``ValueError`` naming a pattern that
    matches none, with the closest names. ``names``: e.g. ``[n for n, _ in model.named_modules()]``."""
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise ValueError(f"{where}: no module patterns given")
    split = [n.split(".") for n in names]
    index: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        index.setdefault(n, []).append(i)
    chosen: set[int] = set()
    for p in patterns:
        if not isinstance(p, str) or not p or any(s == "" for s in p.split(".")):
            raise ValueError(f"{where}: module pattern {p!r} must be a non-empty dotted name")
        pat = p.split(".")
        if _is_literal(pat):  # a module's own name (a capture re-resolves its ~80 names): one lookup, not ~80 matches
            hits = index.get(p, [])
        else:
            hits = [i for i, s in enumerate(split) if _match(pat, s)]
        if not hits:
            close = difflib.get_close_matches(p, list(names), n=5, cutoff=0.5)
            if not close:  # a wrong range/wildcard part: show names of the same depth
                close = [n for n in names if n.count(".") == p.count(".")][:5]
            raise ValueError(f"{where}: module pattern {p!r} matches no module of the model; closest: {close}")
        chosen.update(hits)
    return [names[i] for i in sorted(chosen)]


def first_tensor(x):
    import torch

    if torch.is_tensor(x):
        return x
    if isinstance(x, (tuple, list)) and x and torch.is_tensor(x[0]):
        return x[0]
    return None


def module_input(args, kwargs):
    """The tensor a module takes as its input and where it was: ``(tensor, ("arg", 0))`` for its
    first positional argument when that is a tensor, else ``(tensor, ("kw", name))`` for its
    ``hidden_states`` keyword (HF calls attention with keywords), else for its only tensor
    keyword argument; ``(None, None)`` when none is (or several tensor keywords, none of them
    ``hidden_states``: which one is the input would be a guess)."""
    import torch

    if args and torch.is_tensor(args[0]):
        return args[0], ("arg", 0)
    kwargs = kwargs or {}
    x = kwargs.get("hidden_states")
    if torch.is_tensor(x):
        return x, ("kw", "hidden_states")
    tensors = [k for k, v in kwargs.items() if torch.is_tensor(v)]
    if len(tensors) == 1:
        return kwargs[tensors[0]], ("kw", tensors[0])
    return None, None


class ModuleHooks:
    """Forward hooks on ``modules`` of ``model`` that hand each output (``[batch, token, ...]``,
    batch row 0 kept) to ``sink(module, phase, step, tensor)`` as a clone (and, ``inputs=True``, its
input under ``module:input``: ``module_input``, positional or keyword). Set ``phase`` and
    ``step`` before each forward. ``order``: modules in the order their outputs were first
    produced (execution order: a parent finishes after its children). Use as a context manager.
    Only forwards of the thread that entered it are captured (a streamed model runs the forwards
    of a group in one thread each, through the same modules). For an engine whose loop is not
    this module's (its own phases, batch rows, padding): ``extractors.engine_capture.EngineCapture``."""

    def __init__(self, model, modules: Sequence[str], sink: Callable, inputs: bool = False):
        self.model, self.modules, self.sink, self.inputs = model, list(modules), sink, inputs
        self.phase, self.step = "prefill", 0
        self.order: list[str] = []
        self._ordered: set[str] = set()  # the names in ``order`` (a list scan was ~1 us a captured tensor)
        self._seen: set[str] = set()  # modules already captured in this forward
        self._handles: list = []

    def new_forward(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, int(step)
        self._seen.clear()

    def _hook(self, name: str):
        import torch

        # what every call reads, bound once: a hook runs for each captured tensor (~2,300 a prompt of
        # the tiny model), where attribute lookups and a thread object cost as much as the clone
        tid, seen, ordered, order, sink = self._tid, self._seen, self._ordered, self.order, self.sink
        get_ident, is_tensor = threading.get_ident, torch.is_tensor

        def hook(module, args, kwargs, output):
            if get_ident() != tid:
                return  # another capture's forward through the same (streamed, shared) model
            if name in seen:
                return  # a second call in the same forward: keep the first
            seen.add(name)
            if name not in ordered:
                ordered.add(name)
                order.append(name)
            if self.inputs:
                t, _ = module_input(args, kwargs)  # positional or keyword (HF attention: hidden_states=)
                if t is not None:
                    sink(name + INPUT_SUFFIX, self.phase, self.step, _prompt_rows(t))
            t = output if is_tensor(output) else first_tensor(output)
            if t is not None:
                sink(name, self.phase, self.step, _prompt_rows(t))
        return hook

    def __enter__(self) -> "ModuleHooks":
        self._tid = threading.get_ident()
        mods = dict(self.model.named_modules())
        for name in self.modules:
            self._handles.append(mods[name].register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _prompt_rows(t):
    """The one prompt's rows of a captured tensor, cloned: batch row 0 of ``[batch, token, ...]``;
    a 2-D ``[token, ...]`` (batch already flattened into tokens, module docstring) whole."""
    if t.requires_grad:  # under inference_mode (every capture here) there is no history to drop
        t = t.detach()
    t = t if t.ndim == 2 else t[0]
    return t.clone() if t.is_cpu else t.to("cpu", copy=True)  # clone: the same copy, ~1 us less than .to's


def modules_of(model, patterns) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    return resolve_modules(names, patterns, where=f"module capture ({type(model).__name__})")


def capture_hf_modules(model, prompt: Sequence[int], continuation: Sequence[int], sink: Callable,
                       modules: Iterable[str] | str = DEFAULT_MODULES, inputs: bool = False,
                       decode_steps: int | None = None):
    """Run ``prompt`` then ``continuation`` through an HF causal LM step by step (module docstring:
    prefill, then decode step n feeding continuation token n) and hand each chosen module's
    output to ``sink(module, phase, step, tensor)``: prefill ``[P, ...]``, decode ``[1, ...]``.

    Returns ``(logits, order)``: logits ``[gen_token, vocab]`` float of the same forwards (row j
    predicts continuation token j; ``decode_steps + 1`` rows) and the modules in execution order.
    decode_steps: default ``len(continuation) - 1``.
    """
    from extractors.hf import _check_rows, _text_config, _to_rows

    prompt = _to_rows(prompt, "prompt")[0]
    continuation = _to_rows(continuation, "continuation")[0] if len(continuation) else []
    vocab = _text_config(model).vocab_size
    _check_rows([prompt], vocab, "prompt", allow_empty=False)
    _check_rows([continuation], vocab, "continuation", allow_empty=True)
    n_dec = max(0, len(continuation) - 1) if decode_steps is None else int(decode_steps)
    if not 0 <= n_dec <= len(continuation):
        raise ValueError(f"capture_hf_modules: decode_steps {decode_steps} outside [0, {len(continuation)}] "
                         f"(continuation tokens)")
    names = modules_of(model, modules)
    with ModuleHooks(model, names, sink, inputs) as hooks:
        logits = stepwise_forward(model, hooks, prompt, continuation, n_dec)
    return logits, list(hooks.order)


def stepwise_forward(model, hooks, prompt: Sequence[int], continuation: Sequence[int], n_dec: int):
    """The module captures' forwards on a fresh ``DynamicCache``: the prefill of ``prompt``, then
    decode step n feeding ``continuation[n]`` at position ``len(prompt) + n``, each announced to
    ``hooks.new_forward(phase, step)``. Returns the last position's logits of each forward, float
    on the CPU ``[1 + n_dec, vocab]``."""
    import torch
    from transformers import DynamicCache

    from extractors.hf import model_device

    P, dev = len(prompt), model_device(model)
    cache = DynamicCache(config=model.config)
    rows = []
    with torch.inference_mode():
        hooks.new_forward("prefill", 0)
        out = model(input_ids=torch.tensor([prompt], device=dev), position_ids=torch.arange(P, device=dev)[None],
                    past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float().to("cpu", copy=True))
        for n in range(n_dec):
            hooks.new_forward("decode", n)
            out = model(input_ids=torch.tensor([[continuation[n]]], device=dev),
                        position_ids=torch.tensor([[P + n]], device=dev), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1].float().to("cpu", copy=True))
    return torch.stack(rows)


def collect_hf_modules(model, prompts, continuations, modules: Iterable[str] | str = DEFAULT_MODULES,
                       inputs: bool = False) -> tuple[list[dict], list[str]]:
    """In memory: one dict per prompt ``{(module, phase): float32 numpy [token, ...]}`` (decode
    steps stacked in step order) and the modules in execution order. For tests and small models;
    ``capture_hf_module_run`` streams into a store instead."""
    import numpy as np

    from metrics.errors import as_float

    out, order = [], []
    for prompt, cont in zip(prompts, continuations):
        got: dict = {}

        def sink(module, phase, step, t):
            got.setdefault((module, phase), []).append(as_float(t, np.float32))

        _, order = capture_hf_modules(model, prompt, cont, sink, modules, inputs=inputs)
        out.append({k: np.concatenate(v, axis=0) for k, v in got.items()})
    return out, order


def capture_hf_module_run(store, model_path, prompts, teacher_tokens, modules: Iterable[str] | str = DEFAULT_MODULES,
                          dtype: str = "float32", inputs: bool = False, release=None, model=None,
                          config: dict | None = None, device: str = "cpu", memory: int | None = None,
                          stream: bool | None = None, info: dict | None = None,
                          model_hash: str | None = None, kernel_rounding: str | None = None,
                          model_given: bool | None = None) -> str:
    """Capture module tensors (and the logits of the same forwards) of ``prompts`` teacher-forced
    with ``teacher_tokens`` (one list per prompt, >= 1 token) into ``store``; returns the run id.

    Per prompt the run holds tokens = prompt + teacher tokens, logits ``[gen_token, vocab]`` of
    the forwards run (prefill + ``len(teacher) - 1`` decode steps: one row per teacher token) and
    ``tensors/<module>/<phase>`` as in the module docstring. The run config records the patterns,
    the modules in execution order (``module_order``) and the phase layout. ``model``: an already
    loaded model (e.g. with a fault patched in) of ``model_path`` in ``dtype``. ``config``: extra
    entries for the run config. device, memory, stream, info, model_given: as in
    ``extractors.hf.capture_hf_run`` (a streamed module run reads the weights once per forward of
    the stepwise capture: prefill + ``len(teacher) - 1`` decode steps, for the whole group).
    kernel_rounding: ``"toward_zero"`` rounds the rotary embedding and attention outputs as
    vLLM-CPU's kernels do without AVX512-BF16 (``extractors.kernel_rounding``; recorded in the run
    config); None: torch's own rounding.
    """
    import transformers

    from extractors.hf import _device_str, _to_rows, load_hf_model, reference_config
    from extractors.models import model_content_hash
    from extractors.streamed import PeakMemory, prepare_reference, run_streamed

    prompt_rows = [_to_rows(p, f"prompts[{i}]")[0] for i, p in enumerate(prompts)]
    if teacher_tokens is None or len(teacher_tokens) != len(prompt_rows):
        raise ValueError(f"capture_hf_module_run: need one teacher-token list per prompt ({len(prompt_rows)}), "
                         f"got {None if teacher_tokens is None else len(teacher_tokens)}")
    teacher_rows = [_to_rows(t, f"teacher_tokens[{i}]")[0] for i, t in enumerate(teacher_tokens)]
    for i, t in enumerate(teacher_rows):
        if not t:
            raise ValueError(f"capture_hf_module_run: teacher_tokens[{i}] is empty; module capture needs >= 1 "
                             "continuation token per prompt")
    device = _device_str(device)
    info = info if info is not None else {}
    if model_given is None:
        model_given = model is not None
    patterns = [modules] if isinstance(modules, str) else list(modules)
    sm = plan = None
    if model is None:
        seqs = [(len(p) + len(t), len(t)) for p, t in zip(prompt_rows, teacher_rows)]
        plan, sm = prepare_reference(model_path, dtype, device, memory, stream, seqs,
                                     extra_per_prompt=_module_bytes_bound(model_path, dtype, patterns,
                                                                          max(a for a, _ in seqs)))
        if plan is None or plan.path == "whole":
            model, sm = load_hf_model(model_path, dtype, device), None
        else:
            model = sm.model
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if model_dtype != dtype:
        raise ValueError(f"capture_hf_module_run: the model passed is {model_dtype}, the run says dtype={dtype!r}")
    names = modules_of(model, patterns)  # refuse a bad pattern before a run exists
    # whole model: one prompt at a time (its tensors written while the next one runs, below)
    groups = plan.groups if sm is not None else [[i] for i in range(len(prompt_rows))]
    info.update(path="streamed" if sm is not None else "whole",
                groups=[len(g) for g in groups] if sm is not None else [len(prompt_rows)],
                plan=plan.describe() if plan is not None else "whole (model given or no safetensors)")

    def one(i, sink):
        return capture_hf_modules(model, prompt_rows[i], teacher_rows[i], sink, names, inputs=inputs)

    from extractors.kernel_rounding import kernel_rounding as rounding_as
    from extractors.routing import routing_run_config

    def write_group(group, results, held):
        for i, (logits, _) in zip(group, results):
            try:
                write_prompt_modules(run, prompt_rows[i], teacher_rows[i], held[i]["prefill"], held[i]["decode"],
                                     logits)
            except BaseException as e:
                if background:
                    e.add_note(f"capture_hf_module_run: raised writing prompts[{i}] into run {run.run_id} on the "
                               "background writer thread; the run is aborted")
                raise
            del held[i]

    # A whole model writes a prompt on a background thread while the next prompt's forwards run
    # (file creation is most of a capture's store time: ~300 files a prompt); at most one prompt is
    # queued, so memory holds two prompts' tensors at most. A streamed model's memory plan holds one
    # group's, so it writes in turn.
    background = sm is None and len(groups) > 1 and background_writes(model)
    run = writing = None
    with PeakMemory(device) as peak, rounding_as(model, kernel_rounding), \
            ThreadPoolExecutor(1, thread_name_prefix="capturestore-module-writer") as writer:
        try:
            for group in groups:
                held = {i: {"prefill": [], "decode": {}} for i in group}

                def sink_of(i):
                    def sink(module, phase, step, t):
                        if phase == "decode":
                            held[i]["decode"].setdefault(module, []).append(t)
                        else:
                            held[i]["prefill"].append((module, step, t))
                    return sink

                if sm is None:
                    results = [one(i, sink_of(i)) for i in group]
                else:
                    results = run_streamed(sm, [lambda i=i: one(i, sink_of(i)) for i in group])
                if writing is not None:  # the previous prompt's write: its error surfaces here
                    writing, done = None, writing
                    done.result()
                if run is None:
                    # execution order, as the hooks saw the modules finish in the first prompt's prefill
                    order = results[0][1]
                    cfg = {
                        "mode": "teacher_forced_stepwise",
                        "attn_implementation": getattr(model.config, "_attn_implementation", None),
                        "module_patterns": patterns,
                        "modules": names,
                        "module_order": order,
                        "module_inputs": bool(inputs),
                        "prompt_lens": [len(p) for p in prompt_rows],
                        "tensor_layout": MODULE_TENSOR_LAYOUT,
                        "logits_layout": MODULE_LOGITS_LAYOUT,
                        "model_given": model_given,  # a model passed in (e.g. a patched fault) is never a reference
                        **({"kernel_rounding": kernel_rounding} if kernel_rounding not in (None, "nearest") else {}),
                        **reference_config(device, info["path"], info["groups"], plan),
                        **routing_run_config(model_path),  # MoE: top_k and experts, so the store judges routing alone
                        **(config or {}),
                    }
                    run = store.begin_run(engine="hf", model_path=str(Path(model_path)),
                                          model_hash=model_hash or model_content_hash(model_path), dtype=dtype,
                                          device=device, engine_version=transformers.__version__, release=release,
                                          config=cfg)
                    run.__enter__()
                if background:
                    writing = writer.submit(write_group, group, results, held)
                else:
                    write_group(group, results, held)
            if writing is not None:
                writing, done = None, writing
                done.result()
        except BaseException as e:
            if writing is not None:  # the writer must be done with the run before it is aborted
                wait([writing])
                other = writing.exception()
                if other is not None and other is not e:
                    e.add_note(f"capture_hf_module_run: the background writer failed too: {other!r}")
            if run is not None:
                run.__exit__(type(e), e, e.__traceback__)
            raise
    run.__exit__(None, None, None)
    info["peak"] = peak
    if sm is not None:
        info["weight_passes"] = sm.loads / len(sm.units)
        info["prefetched_units"] = sm.prefetched
    return run.run_id


BACKGROUND_WRITER = None  # True / False: always / never write on a thread; None: background_writes decides


def background_writes(model) -> bool:
    """Whether ``capture_hf_module_run`` writes a prompt on a thread while the next prompt's
    forwards run: when ``BACKGROUND_WRITER`` says so, else when the forwards leave a CPU to the
    writer (the model on an accelerator, or torch's intra-op threads fewer than this process's
    CPUs). Measured on 2 cores with torch on both (docs/module-compare.md): no gain, the writer's
    Python competing with the forwards (random Llama 1024 x 8 layers, 4 prompts: 1.60x / 1.63x
    the plain forwards with it, 1.56x / 1.51x in turn, FP32 / BF16)."""
    if BACKGROUND_WRITER is not None:
        return bool(BACKGROUND_WRITER)
    import torch

    p = next(model.parameters(), None)
    if p is not None and p.device.type != "cpu":
        return True
    from extractors.streamed import usable_cpus

    return torch.get_num_threads() < usable_cpus()


def write_prompt_modules(run, prompt, continuation, prefill, decode: dict, logits) -> str:
    """One prompt of a module run into ``run`` (a ``RunWriter``): its tokens, prefill tensors
    (``[(module, step, [prompt_len, ...])]``), decode steps (``{module: [step tensors [1, ...]]}``,
    step n at index n) and logits ``[gen_token, vocab]`` (None: not captured). Returns the prompt id.
    The one writer of the module layout: ``capture_hf_module_run`` and the user's own engine
    (``extractors.engine_capture.write_module_run``) both go through it."""
    import torch

    pid = run.add_prompt(prompt, continuation=continuation)
    if run.store.grouped_tensors:  # format 6: a group array per phase, dtype, steps and shape
        by_module: dict[str, tuple[list, list]] = {}
        for module, step, t in prefill:
            got = by_module.setdefault(module, ([], []))
            got[0].append(step)
            got[1].append(t)
        write_module_groups(run, pid, "prefill", [(m, steps, ts[0][None] if len(ts) == 1 else torch.stack(ts))
                                            for m, (steps, ts) in by_module.items()])
        write_module_groups(run, pid, "decode", [(m, list(range(len(ts))), torch.stack(ts)) for m, ts in decode.items() if ts])
    else:
        for module, step, t in prefill:
            run.write_tensor(pid, module, t, step=step, phase="prefill", dims=_dims(t))
        for module, ts in decode.items():
            if ts:
                run.write_tensor_steps(pid, module, torch.stack(ts), range(len(ts)), phase="decode", dims=_dims(ts[0]))
    if logits is not None:
        run.write_logits(pid, logits)
    return pid


def write_module_groups(run, pid: str, phase: str, tensors: list) -> None:
    """``tensors``: [(module, steps, [len(steps), ...])] of one phase, written as one
    ``write_tensor_group`` per steps, shape and dtype, modules in the order given."""
    groups: dict[tuple, list] = {}
    for module, steps, t in tensors:
        groups.setdefault((tuple(steps), tuple(t.shape), str(t.dtype)), []).append((module, t))
    for (steps, _, _), members in groups.items():
        run.write_tensor_group(pid, phase, [m for m, _ in members], [t for _, t in members], steps,
                               dims=_dims(members[0][1][0]))


def _module_bytes_bound(model_path, dtype, patterns, seq) -> int:
    """A bound on one prompt's captured module tensors: every matched module's output as wide as
    the widest activation (hidden, MLP or vocabulary) for ``seq`` tokens, in float32."""
    import json

    c = json.loads((Path(model_path) / "config.json").read_text())
    c = c.get("text_config", c)
    layers = int(c.get("num_hidden_layers", 1))
    width = max(int(c.get("hidden_size", 1)), int(c.get("intermediate_size", 1)))
    per_layer_modules = 12  # a decoder layer and what is inside it, at most, that patterns pick
    n = 2 + layers * per_layer_modules if any("**" in p or p.endswith("*") for p in patterns) else len(patterns) * layers
    return n * seq * width * 4


def _dims(t) -> list[str]:
    return ["position", *(f"dim{i}" for i in range(1, t.ndim))]
