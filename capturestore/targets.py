"""Engines under test as plugins: what a target gives, its dtypes and options, its check, its capture.

A target (``EngineTarget``) declares

- ``gives``: the captures it can make, of ``GIVES`` (``logits``, ``kv``, ``tensors`` = module
  tensors, ``routing`` = MoE expert choices); a comparator needing more is refused before anything
  is captured (``capturestore.pipeline.resolve_plugins``);
- ``dtypes``: the dtypes it runs in (the first is its default) and ``expected_dtype(dtype)``: the
  dtype of the HF ``expected`` reference its captures are judged against (DESIGN.md "Roles");
- ``options``: what its spec takes after the name (``{"dtype": help}`` for ``NAME:DTYPE``,
  ``{"url": help}`` for ``NAME=URL``, ``{"tp": help}`` for ``--tp``);
- ``default_plugins``: the comparators run when ``--plugins`` is not given;
- ``kernel_rounding(dtype[, target])``: how its kernels round FP32 to ``dtype`` when not as torch does
  (``vllm``: probed, ``extractors.kernel_rounding``); the BF16 expected reference rounds the same way;
- ``check(ctx)``: what can be probed of the engine before anything is written (``ValueError`` or
  ``EngineStartError`` in one line);
- ``capture(ctx)``: the target run (teacher-forced on ``ctx.teacher_rows``, written into
  ``ctx.store``), and with ``ctx.patterns`` a module-tensor run; returns
  ``TargetRuns(run_id, module_run_id)``.

Targets register through the entry-point group ``capturestore.targets`` (``name =
"package.module:TargetClass"``), the built-ins (``vllm``, ``vllm-server``, ``hf``, ``hf-fp8-kv``)
too. The built-ins are also resolved from ``BUILTIN`` when the installed package metadata does
not list them (an editable install made before the group existed). ``capturestore run --target
NAME`` runs any installed target; an unknown name is refused with the installed ones.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "GIVES",
    "EngineTarget",
    "TargetCheck",
    "TargetContext",
    "TargetRuns",
    "engine_target",
    "target_names",
]

ENTRY_POINT_GROUP = "capturestore.targets"
GIVES = ("logits", "kv", "tensors", "routing")
BUILTIN = {
    "vllm": "capturestore.targets:VllmTarget",
    "vllm-server": "capturestore.targets:VllmServerTarget",
    "hf": "capturestore.targets:HfTarget",
    "hf-fp8-kv": "capturestore.targets:HfFp8KVTarget",
}


@dataclass(frozen=True)
class TargetCheck:
    """What a target's ``check`` sees, before the store is touched."""

    target: Any  # capturestore.pipeline.Target
    model_path: Any
    model_config: dict  # the effective text config
    rows: list  # prompt token ids, one list per prompt
    num_tokens: int
    tp: int
    needs: frozenset  # capture kinds the chosen plugins read
    from_task: bool  # the prompts come from an lm-eval task analysis


@dataclass
class TargetContext:
    """What a target's ``capture`` gets: the store to write into (``store``; progress-counting),
    the references' teacher tokens, and the pipeline's options."""

    target: Any  # capturestore.pipeline.Target
    store: Any  # write runs here (begin_run / the extractors' capture functions take it)
    model_path: Any
    model_config: dict
    model_hash: str
    rows: list  # prompt token ids
    prompt_ids: list
    teacher_rows: list  # teacher tokens after each prompt (the FP32 baseline's greedy tokens)
    num_tokens: int
    release: str | None
    needs: frozenset
    patterns: tuple | None  # module patterns when a plugin compares module tensors, else None
    config: dict  # entries for the target run's config (e.g. the task analysis it belongs to)
    say: Callable[[str], None]
    progress: Any = None  # capturestore.pipeline._Progress (begin/end of a progress bar)
    expected_run: str | None = None
    baseline_run: str | None = None
    tp: int = 1
    engine_options: dict = field(default_factory=dict)
    engine_hook: Callable | None = None
    timings: dict = field(default_factory=dict)
    module_inputs: bool = False  # the module run records each module's input too (an input snapshot)
    extra: dict = field(default_factory=dict)  # the built-ins' own inputs (FP8 scales, platform, checks' results)


@dataclass(frozen=True)
class TargetRuns:
    run_id: str
    module_run_id: str | None = None


class EngineTarget:
    """Base class of a target (module docstring). Subclasses set the class attributes and
    implement ``capture``; ``check`` and ``expected_dtype`` have defaults."""

    name: ClassVar[str] = ""
    gives: ClassVar[frozenset] = frozenset({"logits"})
    dtypes: ClassVar[tuple] = ("bfloat16",)
    options: ClassVar[dict] = {}
    default_plugins: ClassVar[tuple] = ("logits",)
    engine: ClassVar[str] = ""  # what the runs' ``engine`` column says (default: the name)

    def expected_dtype(self, dtype: str) -> str:
        """The dtype of the HF expected reference for this target running in ``dtype``."""
        return dtype

    def check(self, ctx: TargetCheck) -> None:
        """Refuse, in one line, what would fail after the store was touched. Default: nothing."""

    def kernel_rounding(self, dtype: str, target=None) -> str | None:
        """How this engine's own kernels round FP32 to ``dtype`` where that differs from torch's
        round-to-nearest (``extractors.kernel_rounding.ROUNDINGS``), probed before the references
        are captured: the HF expected reference then rounds the same way. Default: None (torch's).
        ``target``: the parsed target (its ``url``, ...), given where the method accepts it (a
        plugin's ``kernel_rounding(self, dtype)`` keeps working)."""
        return None

    def capture(self, ctx: TargetContext) -> TargetRuns:
        raise NotImplementedError(f"target {self.name!r} has no capture")


_registry: dict[str, type[EngineTarget]] = {}
_errors: dict[str, str] = {}
_loaded = False


def _import(spec: str):
    import importlib

    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _load() -> None:
    """The entry points first (a package may re-register a built-in's name with its own class),
    then any built-in the metadata did not list. A broken entry point is remembered and named
    when asked for, never skipped silently."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry or ep.name in _errors:
            continue
        try:
            cls = ep.load()
            _check_class(ep.name, cls)
        except Exception as e:  # noqa: BLE001 - one line naming the plugin
            _errors[ep.name] = f"target {ep.name!r} ({ep.value}) cannot be loaded: {' '.join(str(e).split())}"
            continue
        _registry[ep.name] = cls
    for name, spec in BUILTIN.items():
        if name not in _registry and name not in _errors:
            _registry[name] = _import(spec)


def _check_class(name: str, cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EngineTarget)):
        raise TypeError(f"{cls!r} is not a subclass of capturestore.targets.EngineTarget")
    if cls.name != name:
        raise TypeError(f"its class says name {cls.name!r}, the entry point {name!r}")
    bad = set(cls.gives) - set(GIVES)
    if bad or not cls.gives:
        raise TypeError(f"gives {sorted(cls.gives)}: each must be one of {', '.join(GIVES)}")
    if not cls.dtypes:
        raise TypeError("declares no dtypes")


def target_names() -> list[str]:
    """The installed targets' names, sorted (those whose entry point failed to load included)."""
    _load()
    return sorted({*_registry, *_errors})


def engine_target(name: str) -> EngineTarget:
    """The target named ``name`` (an instance); ValueError listing the installed ones."""
    _load()
    if name in _errors:
        raise ValueError(_errors[name])
    try:
        return _registry[name]()
    except KeyError:
        raise ValueError(f"unknown target {name!r}; installed: {', '.join(target_names())}") from None


# ------------------------------------------------------------------------------------ built-ins


class VllmTarget(EngineTarget):
    """In-process vLLM: raw logits + paged KV teacher-forced through its decode path, module tensors.

    dtypes: bfloat16 (default), float16, float32. A BF16 / FP16 engine is judged against HF in its
    own dtype. An FP32 engine is judged against the BF16 noise (expected = HF BF16): HF FP32 eager
    against the FP32 baseline differs by nothing, so no FP32 spread can be measured to judge it by;
    a verdict on an FP32 engine therefore says "no worse than BF16 rounding", and a fault whose
    error stays below BF16 noise passes it (docs/run.md)."""

    name = "vllm"
    gives = frozenset({"logits", "kv", "tensors", "routing"})
    dtypes = ("bfloat16", "float16", "float32")
    options: ClassVar[dict] = {"dtype": "bfloat16 | float16 | float32 (--dtype)", "tp": "tensor-parallel degree (--tp)"}
    default_plugins = ("logits", "kv")

    def expected_dtype(self, dtype: str) -> str:
        return "bfloat16" if dtype == "float32" else dtype

    def check(self, ctx: TargetCheck) -> None:
        from capturestore.pipeline import check_engine_can_start

        check_engine_can_start(ctx.target)

    def kernel_rounding(self, dtype: str) -> str | None:
        """vLLM-CPU's BF16 kernels round toward zero without AVX512-BF16 (extractors.kernel_rounding)."""
        if dtype != "bfloat16":
            return None
        from extractors.kernel_rounding import probe_vllm_cpu_rounding

        return probe_vllm_cpu_rounding()

    def capture(self, ctx: TargetContext) -> TargetRuns:
        from capturestore.pipeline import capture_vllm_target, model_context

        act, mod = capture_vllm_target(ctx.store, ctx.progress, ctx.model_path, ctx.model_hash, ctx.rows, ctx.teacher_rows,
                                 ctx.release, ctx.tp, "kv" in ctx.needs, ctx.patterns, ctx.engine_options or {},
                                 ctx.engine_hook, ctx.timings, model_context(ctx.model_config), ctx.config,
                                 dtype=ctx.target.dtype, module_inputs=ctx.module_inputs)
        return TargetRuns(act, mod)


class VllmServerTarget(EngineTarget):
    """A running OpenAI-compatible vLLM server (``vllm-server=URL``): teacher-forced prompt logprobs."""

    name = "vllm-server"
    gives = frozenset({"logits"})
    dtypes = ("bfloat16",)
    options: ClassVar[dict] = {"url": "the server, http(s)://HOST:PORT"}
    default_plugins = ("logits",)

    def check(self, ctx: TargetCheck) -> None:
        from capturestore.pipeline import server_capture_functions

        check_server, _ = server_capture_functions()
        try:
            check_server(ctx.target.url, ctx.model_path)
        except ValueError as e:
            raise ValueError(f"target {ctx.target}: {e}") from None

    def kernel_rounding(self, dtype: str, target=None) -> str | None:
        """A server on this machine (a loopback address) running this process's vLLM build: its
        CPU kernels are this machine's, probed here as the in-process target's are (toward zero
        without AVX512-BF16). A server elsewhere, or another vLLM version, cannot be asked: None,
        torch's rounding (its BF16 expected reference then rounds to nearest; docs/vllm_server.md)."""
        if dtype != "bfloat16" or target is None:
            return None
        return server_kernel_rounding(target.url)

    def capture(self, ctx: TargetContext) -> TargetRuns:
        import inspect

        from capturestore.pipeline import server_capture_functions

        _, server_capture = server_capture_functions()
        ctx.progress.begin(f"target {ctx.target}", len(ctx.rows), ctx.num_tokens)
        ctx.say(f"capturing target {ctx.target} (teacher-forced prompt logprobs)")
        kw = {"dtype": ctx.target.dtype} if "dtype" in inspect.signature(server_capture).parameters else {}
        act = server_capture(ctx.store, ctx.target.url, ctx.model_path, ctx.rows, ctx.teacher_rows,
                             model_hash=ctx.model_hash, release=ctx.release, config=ctx.config, **kw)
        return TargetRuns(act)


class HfTarget(EngineTarget):
    """HF in ``hf:bfloat16`` / ``hf:float16`` with SDPA attention (the references run eager)."""

    name = "hf"
    gives = frozenset({"logits", "kv", "tensors", "routing"})
    dtypes = ("bfloat16", "float16")
    options: ClassVar[dict] = {"dtype": "bfloat16 | float16 (hf:DTYPE or --dtype)"}
    default_plugins = ("logits", "kv")

    def check(self, ctx: TargetCheck) -> None:
        # The target is HF's SDPA attention judged against the eager references: an architecture
        # whose only CPU attention is eager (GPT-OSS: its sinks) would be the expected run itself.
        import transformers

        for arch in ctx.model_config.get("architectures") or []:
            cls = getattr(transformers, arch, None)
            if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
                raise ValueError(f"target hf: {arch} has no SDPA attention in transformers {transformers.__version__} "
                                 f"(eager only), so the hf target would be the eager expected run itself; use "
                                 f"--target vllm (docs/gpt-oss.md)")

    def capture(self, ctx: TargetContext) -> TargetRuns:
        from capturestore.pipeline import capture_hf_target

        act, mod = capture_hf_target(ctx.store, ctx.progress, ctx.model_path, ctx.target.dtype, ctx.rows,
                                      ctx.teacher_rows, ctx.release, ctx.patterns, ctx.timings, ctx.config,
                                      module_inputs=ctx.module_inputs)
        return TargetRuns(act, mod)


class HfFp8KVTarget(EngineTarget):
    """HF BF16 with the FP8 KV cache of ``nki_fp8`` (scales from --fp8-scales or absmax-calibrated
    on the expected run's KV), judged against its FP8 rounding floor."""

    name = "hf-fp8-kv"
    gives = frozenset({"logits", "kv"})
    dtypes = ("bfloat16",)
    options: ClassVar[dict] = {}
    default_plugins = ("fp8-kv",)  # FP8 is judged against its rounding floor, not BF16 noise

    def check(self, ctx: TargetCheck) -> None:
        if ctx.from_task:
            raise ValueError("--from-task: the hf-fp8-kv target's run cannot name the task analysis; use another "
                             "target")

    def capture(self, ctx: TargetContext) -> TargetRuns:
        from capturestore.pipeline import capture_fp8_target

        st = ctx.extra["store"]
        act = capture_fp8_target(st, ctx.store, ctx.progress, ctx.model_path, ctx.expected_run, ctx.rows, ctx.teacher_rows,
                           ctx.release, ctx.extra.get("fp8_scales"), ctx.extra.get("fp8_platform"))
        return TargetRuns(act)


def server_kernel_rounding(url: str) -> str | None:
    """``VllmServerTarget.kernel_rounding``: the local probe's answer where the server at ``url`` is
    on a loopback address and reports this process's vLLM version; None otherwise (remote, another
    version, no /version, no local vLLM CPU kernel)."""
    import ipaddress
    import socket
    from urllib.parse import urlparse

    host = urlparse(url if "://" in url else f"http://{url}").hostname
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)} if host else set()
    except OSError:
        return None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return None
    try:
        import vllm

        from extractors.vllm_server import base_url, request_json

        served = request_json(base_url(url), "/version", timeout=10.0)[0].get("version")
    except (ImportError, ValueError, AttributeError):
        return None
    if served != getattr(vllm, "__version__", None):
        return None
    from extractors.kernel_rounding import probe_vllm_cpu_rounding

    return probe_vllm_cpu_rounding()
