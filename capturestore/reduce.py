"""Minimal reproduction: shrink a failing module comparison to a small self-contained bundle.

``reduce(store, comparison_id, engine, out)`` takes a comparison whose module verdict failed
(first failing module ``M`` in phase ``P``, in place) and searches, with the engine under test
re-run in memory on each candidate, for the smallest case that still fails **at the same module
and phase** (the same bug, not another failure the shrinking made):

1. prompts: the first prompt that fails alone, else prompts removed one at a time while it fails
   (the full case judged first: where the engine does not fail on it, nothing is reduced);
2. continuation: the fewest teacher tokens that fail (binary search, at least 1: a decode-only
   bug keeps as many as its decode step needs);
3. prompt length: the shortest prefix of the prompt(s) that fails (binary search);
4. layers: the fewest decoder layers (a checkpoint of the first ``n`` layers; ``M``'s layer
   ``L`` needs ``n > L``, a module outside the layers, ``model.norm``, any ``n``): binary search.

Each step makes the next one's trials cheaper (the last ones run one prompt of a few tokens).

Each candidate is judged like the comparison was (``metrics.modules.judge_modules``: the
module verdict's noise-relative rule) on the FP32 and BF16 references re-run from the reduced
checkpoint and the engine built by ``engine(model_dir)`` on it. The binary searches assume
that a smaller case fails only if a larger one does; the end result is judged again.

Local verdict (``local=True``, ``capturestore reduce --local``; or ``comparison_id`` an isolation's
own comparison, whose localisation carries ``"local": true``): the failure kept is the isolation's
(``capturestore.isolate``: a fault that may pass every in-place verdict), and each candidate judges
``M`` alone by the local rule through isolation's own code (``isolate.local_inputs``,
``on_reference_inputs``, ``judge_local``): the engine's and the FP32 ``M`` on the BF16 reference's
input to ``M``, against the BF16 ``M``'s output there. The bundle records ``verdict: "local"``; its
expected run holds ``M``'s output and input (``M:input``), its baseline run the FP32 ``M`` on that
stored input, and ``reproduce`` judges it the same way.

The bundle (``out``): ``model/`` the reduced checkpoint (the original's first ``n`` layers, bit
for bit, and its tokenizer), ``store/`` a capture store with the FP32 and BF16 module references
of the reduced case, ``case.json`` (the case, the failure, the sizes, the engine) and
``reproduce.sh``: one command, ``capturestore reproduce BUNDLE [--engine MODULE:FUNCTION]``,
which builds the engine on ``model/``, judges its module tensors against the stored references
and exits 1 when a module fails (the bug reproduces), 0 when every module passes. ``reduce``
runs it on the bundle before returning: it must fail with the engine given, and pass with
``correct`` (a correct engine) where one is given.

Engines: ``engine`` is a callable ``(model_dir) -> transformers model`` (the engine under test,
e.g. a fault installed on a loaded model) or a ``"module:function"`` naming one; the bundle
records the name so its command rebuilds it (a callable without an importable name is refused:
the bundle would not be self-contained). Without an engine the actual run's HF engine is rebuilt
from the checkpoint (its dtype and attention implementation). HF engines only: a comparison whose
actual run is vLLM or a server target is refused without ``engine`` (an HF engine that reproduces
its failure may be given); ``capturestore isolate`` localises those.
"""
from __future__ import annotations

import importlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ReductionError", "ReductionResult", "checkpoint_layers", "reduce", "reduced_checkpoint",
           "reproduce"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ReductionError(ValueError):
    """Reduction refused or failed (one line saying why)."""


@dataclass(frozen=True)
class Case:
    """One candidate: the prompts, their teacher tokens, the decoder layers kept."""

    prompts: tuple
    continuations: tuple
    layers: int

    def size(self) -> str:
        p = sum(len(x) for x in self.prompts)
        c = sum(len(x) for x in self.continuations)
        return (f"{len(self.prompts)} prompt(s), {p} prompt + {c} continuation tokens, {self.layers} decoder "
                f"layer(s)")

    def as_dict(self) -> dict:
        return {"prompts": len(self.prompts), "prompt_tokens": sum(len(x) for x in self.prompts),
                "continuation_tokens": sum(len(x) for x in self.continuations), "layers": self.layers}


@dataclass(frozen=True)
class ReductionResult:
    source: str  # the comparison reduced
    status: str  # "reduced" | "nothing_to_reduce" (the comparison passed; nothing written)
    bundle: Path | None = None
    failure: dict | None = None  # {"module", "phase", "layer"}: the failure kept
    start: dict | None = None  # sizes of the source case (Case.as_dict)
    end: dict | None = None  # sizes of the bundle's case
    trials: int = 0  # candidates judged (re-runs of the engine under test and the references)
    command: str | None = None  # the bundle's command
    faulty_exit: int | None = None  # the command's exit status with the engine under test (1: fails)
    correct_exit: int | None = None  # with the correct engine given (0: passes), None without one
    wall_s: float = 0.0
    verdict: str = "in_place"  # the rule the failure is kept by: "in_place" | "local" (an isolation's)
    isolation: str | None = None  # the isolation whose local failure was reduced (verdict "local")

    def summary(self) -> str:
        if self.status == "nothing_to_reduce":
            if self.verdict == "local":
                return (f"nothing to reduce: isolation {self.isolation} of comparison {self.source} found no module "
                        f"failing locally")
            return f"nothing to reduce: comparison {self.source} passed"
        s, e = self.start, self.end
        how = f", locally: isolation {self.isolation}" if self.verdict == "local" else ""
        return (f"reduced comparison {self.source} (fails at {self.failure['module']}, {self.failure['phase']}{how}) from "
                f"{s['prompts']} prompt(s) x {s['prompt_tokens']}+{s['continuation_tokens']} tokens, {s['layers']} "
                f"layer(s) to {e['prompts']} prompt(s) x {e['prompt_tokens']}+{e['continuation_tokens']} tokens, "
                f"{e['layers']} layer(s) in {self.trials} trial(s); bundle {self.bundle}: `{self.command}` exits "
                f"{self.faulty_exit} on the engine under test"
                + ("" if self.correct_exit is None else f", {self.correct_exit} on the correct engine"))


# ------------------------------------------------------------------------------ engines and checkpoints


def _engine_name(engine) -> str | None:
    """The ``module:function`` that names ``engine`` (None: not importable by name)."""
    if isinstance(engine, str):
        return engine
    name = f"{getattr(engine, '__module__', '')}:{getattr(engine, '__qualname__', '')}"
    try:
        return name if _resolve_engine(name) is engine else None
    except ReductionError:
        return None


def _import_engine(spec: str):
    return _checked_engine(_resolve_engine(spec), spec)


def _resolve_engine(spec: str):
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ReductionError(f"engine {spec!r}: give MODULE:FUNCTION (a function taking the model directory and "
                             f"returning the engine under test)")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ReductionError(f"engine {spec!r} cannot be imported: {e}") from None
    if not callable(obj):
        raise ReductionError(f"engine {spec!r} is not callable")
    return obj


def _checked_engine(obj, what):
    """``obj`` when it can be called with one argument (the model directory); ReductionError else."""
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: it is tried as it is
        return obj
    try:
        sig.bind("model_dir")
    except TypeError as e:
        raise ReductionError(f"engine {what!r} cannot be called with the model directory alone ({sig}: {e}); give "
                             f"a function taking the model directory and returning the engine under test") from None
    return obj


def _built(build, path, what):
    """``build(path)``, checked to be a torch module (the engine under test)."""
    import torch

    model = build(str(path))
    if not isinstance(model, torch.nn.Module):
        raise ReductionError(f"engine {what!r} returned a {type(model).__name__} for {path}, not a model "
                             f"(a torch.nn.Module)")
    return model


def checkpoint_layers(model_dir) -> int:
    """The number of decoder layers of the checkpoint ``model_dir`` (its config.json's
    ``layer_types`` or ``num_hidden_layers``, under ``text_config`` where the model keeps its
    text decoder's config there); ReductionError naming the file when it says neither."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReductionError(f"{path}: cannot read the checkpoint's config ({e})") from None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = len(text.get("layer_types") or []) or text.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ReductionError(f"{path}: no decoder layer count (num_hidden_layers or layer_types"
                             f"{', under text_config' if text is not cfg else ''})")
    return n


def _decoder_layers(model):
    """``(holder, attribute)`` of the model's decoder-layer list (a text model's ``model.layers``,
    a multimodal model's ``language_model.layers``); None when neither is there."""
    import torch

    for path in ("model", "model.language_model", "language_model.model", "language_model"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and isinstance(getattr(obj, "layers", None), torch.nn.ModuleList):
            return obj
    return None


def _hf_engine(dtype: str, attn: str):
    def build(model_dir):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                                    attn_implementation=attn).eval()
    return build


def _build_engine(engine, default: dict):
    """A ``(model_dir) -> model`` callable: ``engine`` (callable or name), else the HF engine of
    ``default`` (``{"dtype", "attn_implementation"}``)."""
    if engine is None:
        return _hf_engine(default["dtype"], default.get("attn_implementation") or "eager")
    return _import_engine(engine) if isinstance(engine, str) else _checked_engine(engine, _engine_name(engine) or
                                                                                    repr(engine))


def reduced_checkpoint(model_dir, out, layers: int) -> Path:
    """Write the checkpoint of ``model_dir`` reduced to its first ``layers`` decoder layers into
    ``out`` (weights in their stored dtype, bit for bit; tokenizer and other files copied)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, out = Path(model_dir), Path(out)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    holder = _decoder_layers(model)
    if holder is None:
        raise ReductionError(f"{model_dir}: {type(model).__name__} keeps its decoder layers where reduce does not "
                             f"look (model.layers, model.language_model.layers): its layers cannot be cut")
    n = len(holder.layers)
    if not 1 <= layers <= n:
        raise ReductionError(f"{model_dir}: cannot keep {layers} of its {n} decoder layers")
    holder.layers = torch.nn.ModuleList(list(holder.layers)[:layers])
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(cfg, "num_hidden_layers"):
            cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:layers]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in model_dir.iterdir():
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
    return out


# ------------------------------------------------------------------------------ judging one case


def _modules_of(order, layers: int) -> list[str]:
    from metrics.modules import module_layer

    return [m for m in order if module_layer(m) is None or module_layer(m) < layers]


def _judge(refs, engine, case: Case, order):
    """The module verdict of ``engine`` on ``case`` against ``refs`` (``[(baseline caps,
    expected caps)]`` per prompt, or a callable giving them)."""
    from extractors.modules import collect_hf_modules
    from metrics.modules import judge_modules

    mods = _modules_of(order, case.layers)
    got, _ = collect_hf_modules(engine, case.prompts, case.continuations, mods)
    per = []
    for (b, e), a in zip(refs, got):
        caps = {}
        for k in e:
            if k in b:
                caps[k] = (b[k], e[k], a[k]) if k in a else None
        per.append(caps)
    missing = [(k, i) for i, caps in enumerate(per) for k, v in caps.items() if v is None]
    if missing:
        (m, ph), i = missing[0]
        raise ReductionError(f"the engine under test produced no {m} ({ph}) for prompt {i}")
    return judge_modules(per, mods, prompt_lens=[len(p) for p in case.prompts])


def _judge_local(exp_caps, base_caps, engine, case: Case, mods):
    """The local verdict of ``engine``'s ``mods`` on ``case``: each run on the expected reference's
    input (``exp_caps``, with ``module:input``) against the FP32 module on that input
    (``base_caps``): ``capturestore.isolate``'s rule, through its code."""
    from capturestore.isolate import judge_local, on_reference_inputs

    act = on_reference_inputs(engine, case.prompts, case.continuations, mods, exp_caps)
    prompts = [(str(i), p, c) for i, (p, c) in enumerate(zip(case.prompts, case.continuations))]
    return judge_local(prompts, mods, exp_caps, act, base_caps, mods)


def _first(verdict):
    f = verdict.first_failing
    return None if f is None else (f.module, f.phase)


# ------------------------------------------------------------------------------ the search


class _Trials:
    """Judges candidates: checkpoints per layer count (written once), references re-run per case."""

    def __init__(self, model_dir, work: Path, engine, exp_dtype, order, failure, say, rounding=None, local=False):
        self.model_dir, self.work, self.engine, self.exp_dtype = Path(model_dir), work, engine, exp_dtype
        self.local = local  # judge the failing module by the local rule (capturestore.isolate.judge_local)
        self.rounding = rounding  # the expected run's kernel_rounding: its reference re-runs round the same way
        self.order, self.failure, self.say, self.n = order, failure, say, 0
        self.engine_name = getattr(engine, "__qualname__", repr(engine))
        self._models: dict = {}
        self._seen: dict = {}  # Case -> fails (the searches ask some cases twice)

    def checkpoint(self, layers: int, full: int) -> Path:
        if layers == full:
            return self.model_dir
        return self.work / f"layers-{layers}"

    def models(self, layers: int, full: int):
        if layers not in self._models:
            from extractors.hf import load_hf_model

            path = self.checkpoint(layers, full)
            if path != self.model_dir and not path.exists():
                reduced_checkpoint(self.model_dir, path, layers)
            self._models.clear()  # one layer count at a time: the tiny models are cheap, memory is not
            try:
                refs = (load_hf_model(path, "float32"), load_hf_model(path, self.exp_dtype))
            except Exception as e:  # noqa: BLE001 - transformers' loaders raise many kinds: one line naming it
                raise ReductionError(f"cannot load the reference checkpoint {path}: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}") from None
            self._models[layers] = (*refs, _built(self.engine, path, self.engine_name))
        return self._models[layers]

    def fails(self, case: Case, full: int) -> bool:
        from extractors.kernel_rounding import kernel_rounding
        from extractors.modules import collect_hf_modules

        if case in self._seen:
            return self._seen[case]
        base, exp, eng = self.models(case.layers, full)
        if self.local:
            from capturestore.isolate import local_inputs, on_reference_inputs

            mods = [self.failure[0]]
            e = local_inputs(exp, case.prompts, case.continuations, mods, self.rounding)
            b = on_reference_inputs(base, case.prompts, case.continuations, mods, e)
            first = _first(_judge_local(e, b, eng, case, mods))
        else:
            mods = _modules_of(self.order, case.layers)
            b, _ = collect_hf_modules(base, case.prompts, case.continuations, mods)
            with kernel_rounding(exp, self.rounding):
                e, _ = collect_hf_modules(exp, case.prompts, case.continuations, mods)
            first = _first(_judge(list(zip(b, e)), eng, case, self.order))
        self.n += 1
        self.say(f"trial {self.n}: {case.size()}: {'fails at ' + ' '.join(first) if first else 'passes'}")
        self._seen[case] = first == self.failure
        return self._seen[case]


def _smallest(lo: int, hi: int, fails) -> int:
    """The smallest x in [lo, hi] with fails(x), given fails(hi) (binary search; monotone assumed,
    the end result is checked)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _search(trials: _Trials, case: Case, full: int, fail_layer) -> Case:
    """Prompts, continuation, prompt length, then layers: each step shrinks what the next one's
    trials cost. The full case is judged only when no prompt fails alone."""
    n = case.layers
    keep = next((i for i in range(len(case.prompts))
                 if trials.fails(Case((case.prompts[i],), (case.continuations[i],), n), full)), None)
    if keep is not None:
        P, C = (case.prompts[keep],), (case.continuations[keep],)
    else:
        if len(case.prompts) > 1 and not trials.fails(case, full):
            raise ReductionError("the engine under test does not fail at the comparison's first failing module on "
                                 "its case")
        idx = list(range(len(case.prompts)))
        for i in list(idx):
            rest = [j for j in idx if j != i]
            if rest and trials.fails(Case(tuple(case.prompts[j] for j in rest),
                                          tuple(case.continuations[j] for j in rest), n), full):
                idx = rest
        P, C = tuple(case.prompts[j] for j in idx), tuple(case.continuations[j] for j in idx)
    top = max(len(c) for c in C)
    m = _smallest(1, top, lambda m: m == top or trials.fails(Case(P, tuple(c[:m] for c in C), n), full))
    C = tuple(c[:m] for c in C)
    top = max(len(p) for p in P)
    k = _smallest(1, top, lambda k: k == top or trials.fails(Case(tuple(p[:k] for p in P), C, n), full))
    P = tuple(p[:k] for p in P)
    lo = 1 if fail_layer is None else fail_layer + 1
    n = _smallest(lo, n, lambda x: x == case.layers or trials.fails(Case(P, C, x), full))
    return Case(P, C, n)


# ------------------------------------------------------------------------------ the bundle


def _write_bundle(out: Path, trials: _Trials, case: Case, full: int, info: dict) -> str:
    from capturestore import Store
    from extractors.modules import capture_hf_module_run

    out.mkdir(parents=True, exist_ok=True)
    src = trials.checkpoint(case.layers, full)
    shutil.copytree(src, out / "model")
    store = Store.open(out / "store")
    runs = {}
    if trials.local:
        mods = [info["failure"]["module"]]
        runs["expected"] = capture_hf_module_run(store, out / "model", [list(p) for p in case.prompts],
                                                 [list(c) for c in case.continuations], modules=mods,
                                                 dtype=trials.exp_dtype, inputs=True, kernel_rounding=trials.rounding)
        runs["baseline"] = _write_local_baseline(store, out / "model", case, mods, runs["expected"])
    else:
        mods = _modules_of(trials.order, case.layers)
        for role, dtype in (("baseline", "float32"), ("expected", trials.exp_dtype)):
            runs[role] = capture_hf_module_run(store, out / "model", [list(p) for p in case.prompts],
                                               [list(c) for c in case.continuations], modules=mods, dtype=dtype,
                                               kernel_rounding=trials.rounding if role == "expected" else None)
    cmd = "capturestore reproduce BUNDLE" + ("" if info["engine"] is None else f" --engine {info['engine']}")
    case_json = {**info, "runs": runs, "modules": mods, "prompts": [list(p) for p in case.prompts],
                 "continuations": [list(c) for c in case.continuations], "command": cmd}
    (out / "case.json").write_text(json.dumps(case_json, indent=1) + "\n")
    sh = out / "reproduce.sh"
    eng = "" if info["engine"] is None else f" --engine {info['engine']}"
    sh.write_text("#!/bin/sh\n# exits 1 when the bug reproduces (a module fails), 0 when every module passes;\n"
                  "# another engine: ./reproduce.sh --engine MODULE:FUNCTION\n"
                  f'exec "${{PYTHON:-python3}}" -m capturestore.cli reproduce "$(dirname "$0")"{eng} "$@"\n')
    sh.chmod(0o755)
    return cmd


def _write_local_baseline(store, model_dir: Path, case: Case, mods, expected_run: str) -> str:
    """The local verdict's FP32 reference into ``store``: the FP32 modules ``mods`` of
    ``model_dir`` run on the expected run's stored inputs (``module:input``, read back: the inputs
    ``reproduce`` feeds the engine), written in the module layout; returns its run id."""
    import torch

    from capturestore.isolate import on_reference_inputs, stored_caps
    from extractors.hf import load_hf_model
    from extractors.models import model_content_hash
    from extractors.modules import INPUT_SUFFIX, MODULE_TENSOR_LAYOUT, write_prompt_modules

    pids = store.sql("SELECT prompt_id FROM prompts WHERE run_id = ? ORDER BY prompt_idx",
                     [expected_run]).column(0).to_pylist()
    exp_caps = [stored_caps(store, expected_run, pid, [*mods, *(m + INPUT_SUFFIX for m in mods)]) for pid in pids]
    base = on_reference_inputs(load_hf_model(model_dir, "float32"), case.prompts, case.continuations, mods, exp_caps)
    run = store.begin_run(engine="hf", model_path=str(model_dir), model_hash=model_content_hash(model_dir),
                          dtype="float32", config={"mode": "local", "modules": list(mods), "module_order": list(mods),
                                                   "inputs_of": expected_run, "tensor_layout": MODULE_TENSOR_LAYOUT})
    with run:
        for p, c, caps in zip(case.prompts, case.continuations, base, strict=True):
            pre = [(m, 0, torch.from_numpy(caps[(m, "prefill")])) for m in mods]
            dec = {m: [torch.from_numpy(caps[(m, "decode")][i:i + 1]) for i in range(len(caps[(m, "decode")]))]
                   for m in mods if (m, "decode") in caps}
            write_prompt_modules(run, list(p), list(c), pre, dec, None)
    return run.run_id


def reproduce(bundle, engine=None, progress=None) -> tuple[int, str]:
    """Judge ``engine`` (callable or ``module:function``; default the bundle's) on a bundle
    written by ``reduce``: ``(1, summary)`` when a module fails, ``(0, summary)`` when every
    module passes; ReductionError when the bundle cannot be read whole or a module is not judged. The
    bundle is only read."""
    from capturestore.errors import StoreError
    from capturestore.isolate import stored_caps
    from capturestore.store import open_store_path

    if bundle is None or not str(bundle).strip():  # Path("") is the current directory
        raise ReductionError("BUNDLE is empty; give the bundle's directory (capturestore reduce --out DIR)")
    bundle = Path(bundle)
    try:
        info = json.loads((bundle / "case.json").read_text())
    except (OSError, ValueError) as e:
        raise ReductionError(f"{bundle} is not a reduction bundle (case.json: {e})") from None
    say = progress or (lambda m: None)
    lacking = [k for k in ("actual", "runs", "modules", "prompts", "continuations", "end", "failure")
               if not isinstance(info, dict) or k not in info]
    if lacking:
        raise ReductionError(f"{bundle} is not a reduction bundle (case.json lacks {', '.join(lacking)})")
    engine = engine if engine is not None else info.get("engine")
    build = _build_engine(engine, info["actual"])
    try:  # read only: a bundle without its store is refused, never given an empty one
        store = open_store_path(str(bundle / "store"))
    except StoreError as e:
        raise ReductionError(f"{bundle} is not a reduction bundle ({e})") from None
    runs, mods = info["runs"], info["modules"]
    pids = store.sql("SELECT prompt_id FROM prompts WHERE run_id = ? ORDER BY prompt_idx",
                     [runs["expected"]]).column(0).to_pylist()
    case = Case(tuple(tuple(p) for p in info["prompts"]), tuple(tuple(c) for c in info["continuations"]),
                info["end"]["layers"])
    if len(pids) != len(case.prompts):
        raise ReductionError(f"{bundle}: the store holds {len(pids)} prompts, case.json {len(case.prompts)}")
    local = info.get("verdict", "in_place") == "local"
    if info.get("verdict", "in_place") not in ("in_place", "local"):
        raise ReductionError(f"{bundle}: case.json's verdict {info['verdict']!r} is neither in_place nor local")
    refs = []
    for pid in pids:
        caps = []
        for role in ("baseline", "expected"):
            need = [*mods, *(m + ":input" for m in mods)] if local and role == "expected" else mods
            got = stored_caps(store, runs[role], pid, need)
            absent = [m for m in need if (m, "prefill") not in got]
            if absent:  # evidence the case needs and the bundle lost: never judged as a pass
                raise ReductionError(f"{bundle}: the {role} run {runs[role]} holds no {absent[0]} (prefill) for prompt "
                                     f"{pid}" + (f" (and {len(absent) - 1} more modules)" if len(absent) > 1 else ""))
            caps.append(got)
        refs.append(tuple(caps))
    say(f"engine {engine or 'HF ' + info['actual']['dtype']} on {bundle / 'model'}: {case.size()}"
        + (" (local verdict: each module on the expected reference's input)" if local else ""))
    model = _built(build, bundle / "model", engine or "HF")
    if local:
        verdict = _judge_local([e for _, e in refs], [b for b, _ in refs], model, case, mods)
    else:
        verdict = _judge(refs, model, case, mods)
    f = verdict.first_failing
    how = "locally, on the expected reference's input" if local else "in place"
    if f is None:
        if verdict.passed is not True:  # nothing failed, but not everything was judged: not a pass
            raise ReductionError(f"{bundle}: not judged ({verdict.summary()}; {len(verdict.unjudged)} module x "
                                 f"phase outputs unjudged)")
        return 0, f"PASS: every module passes {how} ({case.size()})"
    same = (f.module, f.phase) == (info["failure"]["module"], info["failure"]["phase"])
    return 1, (f"FAIL at {f.module} ({f.phase}, layer {f.layer}, token {f.token}) {how}: sigma-ratio "
               f"{f.tensor.sigma_ratio:.3f}" if f.tensor is not None else f"FAIL at {f.module} ({f.phase})") + (
        " (the reduced failure)" if same else f" (reduced from a failure at {info['failure']['module']})")


def _isolation_of(store, cid: str):
    """The comparisons row of the newest isolation of comparison ``cid`` (None: never isolated)."""
    try:
        rows = store.sql("SELECT c.* FROM comparisons c JOIN isolations i ON i.comparison_id = c.comparison_id "
                         "WHERE i.source_comparison_id = ? ORDER BY c.created_at DESC LIMIT 1", [cid]).to_pylist()
    except Exception:  # noqa: BLE001 - no isolations view: nothing was ever isolated in this store
        return None
    return rows[0] if rows else None


def reduce(store, comparison_id: str, engine=None, out=None, *, correct=None, local: bool = False,
           progress=None) -> ReductionResult:
    """Reduce the failing module comparison ``comparison_id`` (module docstring) and write the
    bundle to ``out`` (a new or empty directory). engine: the engine under test, a callable
    ``(model_dir) -> model`` or ``"module:function"`` (default: the actual run's HF engine
    rebuilt from its checkpoint). correct: a correct engine the bundle's command must pass on.
    local: reduce the local failure of the comparison's isolation (``capturestore isolate``);
    an isolation's own comparison is reduced locally without it. ``store``: a ``Store`` or its path /
    URL (only read: the bundle is a store of its own)."""
    from capturestore.store import as_store, expand_path

    store = as_store(store)
    if out is None:
        raise ReductionError("give the bundle's directory (out)")
    if not str(out).strip():  # Path("") is the current directory: never a bundle unasked
        raise ReductionError("--out is empty; give the bundle's directory (new or empty)")
    out = expand_path(out, "--out")
    if out.exists() and not out.is_dir():
        raise ReductionError(f"--out {out} is not a directory; give the bundle's directory (new or empty)")
    if out.exists() and any(out.iterdir()):
        raise ReductionError(f"--out {out} is not empty; give the bundle's directory (new or empty)")
    made = [d for d in (out.absolute(), *out.absolute().parents) if not d.exists()]  # deepest first
    try:
        return _reduce(store, comparison_id, engine, out, correct, local, progress or (lambda m: None))
    except BaseException:
        for d in made:  # what this call created and left empty (a failure): gone again; never anything with files
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _reduce(store, comparison_id, engine, out: Path, correct, local, say) -> ReductionResult:
    """``reduce`` once ``out`` is known to be a new or empty directory."""
    from capturestore.isolate import IsolationError, checked_runs, held_prompts

    t0 = time.perf_counter()
    rows = store.sql("SELECT * FROM comparisons WHERE comparison_id = ?", [comparison_id]).to_pylist()
    if not rows:
        raise ReductionError(f"comparison {comparison_id!r} not found in the store")
    row = rows[0]
    loc = json.loads(row.get("localisation") or "null") or {}
    isolation = None
    if loc.get("local") or row.get("judged") == ["isolation"]:  # an isolation's comparison: its local verdict
        isolation, local = comparison_id, True
    elif local:
        iso = _isolation_of(store, comparison_id)
        if iso is None:
            raise ReductionError(f"comparison {comparison_id} has no isolation to reduce locally: run `capturestore "
                                 f"isolate {comparison_id}` first (--even-if-passed where it passed in place)")
        row, isolation = iso, iso["comparison_id"]
        loc = json.loads(row.get("localisation") or "null") or {}
    verdict = "local" if local else "in_place"
    if row["passed"]:
        return ReductionResult(comparison_id, "nothing_to_reduce", verdict=verdict, isolation=isolation)
    try:
        runs, recs = checked_runs(store, comparison_id, row, snapshot=True)  # the engine is checked below
    except IsolationError as e:
        raise ReductionError(str(e)) from None
    if local:
        mv = [{"module": loc.get("module"), "phase": loc.get("phase"), "layer": loc.get("layer")}]
        if mv[0]["module"] is None or mv[0]["phase"] not in ("prefill", "decode"):
            raise ReductionError(f"isolation {isolation} names no failing module (its localisation: {loc})")
    else:
        try:
            mv = store.sql("SELECT module, phase, layer FROM module_verdicts WHERE comparison_id = ? AND passed = false "
                           "ORDER BY CASE phase WHEN 'prefill' THEN 0 ELSE 1 END, exec_order",
                           [comparison_id]).to_pylist()
        except Exception:  # noqa: BLE001 - no module_verdicts view: no module was judged in this store
            mv = []
        if not mv:
            raise ReductionError(f"comparison {comparison_id} has no failing module verdict: reduce shrinks a module "
                                 f"failure (capturestore run --plugins ...,modules; a failure seen only locally: "
                                 f"capturestore isolate {comparison_id}, then reduce --local)")
    failure = {"module": mv[0]["module"], "phase": mv[0]["phase"], "layer": mv[0]["layer"]}
    order = recs["expected"]["config"].get("module_order")
    act = recs["actual"]
    default = {"dtype": act["dtype"], "attn_implementation": act["config"].get("attn_implementation") or "eager"}
    if engine is None and act["engine"] != "hf":
        raise ReductionError(f"the actual run {runs['actual']} is a {act['engine']} engine: reduce re-runs HF engines "
                             f"only (give an HF engine that reproduces the failure: --engine MODULE:FUNCTION); "
                             f"localise it instead with capturestore isolate {comparison_id}")
    if engine is None and act["config"].get("model_given"):
        raise ReductionError(f"the actual run {runs['actual']} was captured from a model passed in (a patched engine "
                             f"the checkpoint does not hold): give that engine (--engine MODULE:FUNCTION)")
    name = None if engine is None else _engine_name(engine)
    if engine is not None and name is None:
        raise ReductionError(f"--engine: engine {engine!r} has no importable MODULE:FUNCTION name: the bundle's "
                             f"command could not rebuild it")
    try:
        build = _build_engine(engine, default)
    except ReductionError as e:  # named as --correct's is (the default HF engine has no flag)
        raise ReductionError(f"--engine: {e}" if engine is not None else str(e)) from None
    if correct is not None:  # checked now, not after the whole reduction where the bundle's command runs it
        try:
            _build_engine(correct, default)
        except ReductionError as e:
            raise ReductionError(f"--correct: {e}") from None
    prompts = held_prompts(store, runs)
    model_dir = Path(recs["expected"]["model_path"])
    full = checkpoint_layers(model_dir)
    start = Case(tuple(tuple(p) for _, p, _ in prompts), tuple(tuple(c) for _, _, c in prompts), full)
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        rounding = recs["expected"]["config"].get("kernel_rounding")
        trials = _Trials(model_dir, work, build, recs["expected"]["dtype"], order,
                         (failure["module"], failure["phase"]), say, rounding, local)
        if rounding:
            say(f"the BF16 reference re-runs round FP32 -> BF16 {rounding.replace('_', ' ')}, as the expected run "
                f"{runs['expected']} records")
        say(f"start: {start.size()}; failure {failure['module']} ({failure['phase']}"
            + (f", local: isolation {isolation})" if local else ", in place)"))
        try:
            end = _search(trials, start, full, failure["layer"])
        except ReductionError as e:
            raise ReductionError(f"comparison {comparison_id}: {e} ({failure['module']}, {failure['phase']}): give "
                                 f"the engine of its actual run {runs['actual']}") from None
        if not trials.fails(end, full):  # the binary searches assume monotone failure: check the result
            raise ReductionError(f"the reduced case ({end.size()}) does not fail: the failure is not monotone in "
                                 f"the case's size")
        info = {"source_comparison": comparison_id, "verdict": verdict, "isolation": isolation,
                "failure": failure, "engine": name, "actual": default,
                "expected_dtype": recs["expected"]["dtype"], "kernel_rounding": rounding,
                "start": start.as_dict(), "end": end.as_dict(),
                "trials": trials.n}
        cmd = _write_bundle(out, trials, end, full, info)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    faulty_exit, text = reproduce(out, engine if engine is not None else None)
    say(f"bundle on the engine under test: {text}")
    if faulty_exit != 1:
        raise ReductionError(f"the bundle {out} does not reproduce the failure: {text}")
    correct_exit = None
    if correct is not None:
        correct_exit, text = reproduce(out, correct)
        say(f"bundle on the correct engine: {text}")
        if correct_exit != 0:
            raise ReductionError(f"the bundle {out} fails on the correct engine too: {text}")
    return ReductionResult(comparison_id, "reduced", out, failure, start.as_dict(), end.as_dict(), trials.n, cmd,
                           faulty_exit, correct_exit, time.perf_counter() - t0, verdict, isolation)
