"""The main job on the user's own model: references, the engine under test, plugins, one comparison.

``run(model, prompts, target, num_tokens, ...)`` (the CLI's ``capturestore run``; docs/run.md):

1. Checks every input before the store is touched: the model directory (``config.json`` with
   ``model_type``, whole safetensors weights), the prompt file (``.txt`` one prompt per line,
   ``.jsonl`` with ``"prompt"`` or ``"token_ids"`` and an optional ``"id"``), the target, the
   plugins, the ``--modules`` patterns (against the module names of the model's meta-device
   skeleton), ``num_tokens`` and each prompt's length against the context of the model's
   effective config (transformers' defaults filled in), the labels, what can be probed of the
   engine's start. Bad input is one ``ValueError`` line naming the file, line or prompt; nothing
   is written. A run failing later rolls back every run it committed and removes a store it
   created; interrupted, it keeps its complete references for the next run (docs/run.md).
2. References (DESIGN.md "Roles"): the HF FP32 ``baseline`` generates ``num_tokens`` greedy
   tokens per prompt (the teacher tokens) and the HF ``expected`` run in the target's dtype is
   teacher-forced on them. Each is reused when the store already holds a run of the same model
   content (``model_hash``: weights + config, not the path), prompts, dtype and number of tokens,
   captured the same way; the output says which were reused.
3. The target (``actual``), teacher-forced on the same tokens: ``vllm`` (in-process vLLM, raw
   logits + paged KV through its decode path), ``vllm-server=URL`` (a running OpenAI-compatible
   vLLM server, ``extractors.vllm_server``: checked to answer and serve this model before anything
   is written), ``hf:bfloat16`` / ``hf:float16`` (HF with SDPA
   attention against the eager reference), ``hf-fp8-kv`` (the FP8 KV cache of ``nki_fp8``, scales
   calibrated on the expected run's KV unless given), or a target another package registers
   (``capturestore.targets``: what it gives, its dtypes, its check and its capture).
4. The plugins compare them in one ``compare_runs`` comparison and its verdict is returned.

Plugins are the comparators (``capturestore.comparators``: ``name``, ``needs`` = what they need
captured from the engine, ``compare``/``finish``/``verdict`` = run, ``tables`` = what they save),
registered in code or through the entry-point group ``capturestore.comparators``. ``needs``
decides what is captured: ``kv`` turns on KV capture, ``tensors`` module-tensor runs of every
role (compared by the ``modules`` plugin through ``compare_runs(comparator_runs=...)``). A plugin
that raises is recorded as errored with its traceback (``compare_runs``) and never passes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODULE_PATTERNS",
    "EngineStartError",
    "PLUGIN_ALIASES",
    "Prompt",
    "Target",
    "check_model_dir",
    "encode_prompts",
    "format_layer_summary",
    "parse_target",
    "read_prompt_file",
    "resolve_plugins",
    "run",
]

PLUGIN_ALIASES = {"fp8-kv": "fp8_kv_floor"}
DEFAULT_MODULE_PATTERNS = ("model.layers.*.self_attn", "model.layers.*.mlp", "model.layers.*", "model.norm")
INSTALL = {"vllm": "pip install 'capturestore[vllm]'", "hf": "pip install 'capturestore[hf]'"}


class EngineStartError(RuntimeError):
    """An engine could not start (not installed, or it failed at start): one line saying what
    failed and what to install. The CLI reports it like bad input (exit 2)."""


# ------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Target:
    """The engine under test: ``kind`` (the target's name: vllm | vllm-server | hf | hf-fp8-kv or an
    installed plugin target, ``capturestore.targets``), its ``dtype``, the dtype of its expected
    reference (``expected_dtype``; the target decides it, default its own dtype) and, for a
    server, its ``url``."""

    kind: str
    dtype: str = "bfloat16"
    url: str | None = None
    expected_dtype: str | None = None
    show_dtype: bool = False  # written in the target's name (hf:float16, vllm:float32)

    @property
    def reference_dtype(self) -> str:
        return self.expected_dtype or self.dtype

    def __str__(self) -> str:
        if self.kind == "hf" or self.show_dtype:
            return f"{self.kind}:{self.dtype}"
        return f"{self.kind}={self.url}" if self.url else self.kind


def parse_target(spec: str, dtype: str | None = None) -> Target:
    """``NAME``, ``NAME:DTYPE`` or ``NAME=URL`` of an installed target (``capturestore.targets``):
    ``vllm``, ``vllm:float16``, ``vllm-server=URL``, ``hf:bfloat16``, ``hf:float16``, ``hf-fp8-kv``, or a
    plugin's name. ``dtype`` (``--dtype``): the target's dtype, for targets that take one."""
    from capturestore.targets import engine_target

    s = str(spec).strip()
    cut = min([i for i in (s.find(":"), s.find("=")) if i > 0] or [len(s)])
    name, sep, arg = s[:cut], s[cut:cut + 1], s[cut + 1:].strip()
    eng = engine_target(name)
    url = None
    if sep == ":":
        if "dtype" not in eng.options:
            raise ValueError(f"--target {spec}: target {name} takes no dtype (it runs in {', '.join(eng.dtypes)})")
        if dtype is not None and dtype != arg:
            raise ValueError(f"--target {spec} and --dtype {dtype} disagree; give the dtype once")
        dtype = arg
    elif sep == "=":
        if "url" not in eng.options:
            raise ValueError(f"--target {spec}: target {name} takes no URL")
        from urllib.parse import urlparse

        url = arg.rstrip("/")
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"--target {spec}: the server URL must be http(s)://HOST:PORT")
    elif "url" in eng.options:
        raise ValueError(f"--target {spec}: give the server, {name}=http://HOST:PORT")
    if dtype is not None and "dtype" not in eng.options:
        raise ValueError(f"--dtype {dtype}: target {name} takes no dtype (it runs in {', '.join(eng.dtypes)})")
    if dtype is None:
        dtype = eng.dtypes[0]
    elif dtype not in eng.dtypes:
        raise ValueError(f"--target {spec}: the {name} target's dtype must be one of {', '.join(eng.dtypes)}, "
                         f"not {dtype!r}")
    return Target(name, dtype, url, eng.expected_dtype(dtype), show_dtype=dtype != eng.dtypes[0])


def resolve_plugins(names, target: Target) -> list[str]:
    """Comparator names of the plugins ``names`` (a comma-separated string or names; None: the
    target's defaults), checked against the registry and against what the target can give."""
    from capturestore.comparators import comparator_class, comparator_names
    from capturestore.targets import engine_target

    eng = engine_target(target.kind)
    if names is None:
        names = eng.default_plugins
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    out = []
    for n in names:
        if not n:
            raise ValueError("--plugins: an empty plugin name (a stray comma?)")
        name = PLUGIN_ALIASES.get(n, n)
        if name not in comparator_names():
            known = sorted({*comparator_names(), *PLUGIN_ALIASES} - set(PLUGIN_ALIASES.values()))
            raise ValueError(f"unknown plugin {n!r}; registered: {', '.join(known)}")
        if name in out:
            raise ValueError(f"--plugins names {n!r} twice")
        lacking = set(comparator_class(name).needs) - set(eng.gives)
        if lacking:
            raise ValueError(f"plugin {n!r} needs {', '.join(sorted(lacking))} captures, which target {target} "
                             f"does not give (it gives {', '.join(sorted(eng.gives))})")
        if name == "fp8_kv_floor" and target.kind != "hf-fp8-kv":
            raise ValueError(f"plugin {n!r} judges an FP8 KV cache: it needs --target hf-fp8-kv, not {target}")
        out.append(name)
    if not out:
        raise ValueError("--plugins: no plugin given")
    return out


def check_model_dir(path) -> tuple[Path, dict]:
    """``(path, text config)`` of a Hugging Face model directory, or ValueError naming what is
    missing: config.json (JSON, with ``model_type``, ``vocab_size``, ``num_hidden_layers``),
    weights (every ``.safetensors`` file whole). The config is the effective one (transformers'
    defaults filled in: ``effective_config``)."""
    from capturestore.store import expand_path

    p = expand_path(str(path), "--model")
    if not p.is_dir():
        raise ValueError(f"--model {path}: " + ("a file, not a model directory" if p.exists() else "no such directory"))
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"--model {p}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model {cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {cfg_file}: not a JSON object")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ValueError(f"--model {p}: no weights (*.safetensors or *.bin)")
    raw = cfg.get("text_config") or cfg
    for key in ("vocab_size", "num_hidden_layers"):
        if not isinstance(raw.get(key), int):
            raise ValueError(f"--model {cfg_file}: no integer {key!r}")
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise ValueError(f"--model {cfg_file}: no \"model_type\" (transformers cannot tell which model it is)")
    text = effective_config(p)
    for f in sorted(p.glob("*.safetensors")):
        _check_safetensors(f)
    return p, text


def effective_config(path: Path) -> dict:
    """The text config transformers runs the model with (``AutoConfig.from_pretrained``, which fills
    in defaults such as ``max_position_embeddings`` that the raw ``config.json`` may lack), as a dict."""
    from transformers import AutoConfig

    try:
        conf = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - whatever transformers says about the config, in one line
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"--model {path / 'config.json'}: transformers cannot read it ({msg})") from None
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return text.to_dict()


def model_context(cfg: dict) -> int | None:
    """The model's context in tokens from its effective config (None: the config states none)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool) and cfg[key] > 0:
            return cfg[key]
    return None


def _check_safetensors(f: Path) -> None:
    """A ``.safetensors`` file whose header parses and whose tensors' bytes are all there (read
    without loading them), else ValueError in one line: a truncated or corrupt download."""
    import struct

    from safetensors import safe_open

    size = f.stat().st_size
    try:
        with f.open("rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0] if size >= 8 else None
            header = json.loads(fh.read(n)) if n is not None and 8 + n <= size else None
        if not isinstance(header, dict):
            raise ValueError("its header is cut off")
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"it holds {size} bytes, its header describes {8 + n + end}: truncated")
        with safe_open(str(f), framework="pt") as sf:
            list(sf.keys())
    except Exception as e:  # noqa: BLE001 - SafetensorError, JSON, struct: one line naming the file
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"--model {f}: not a readable safetensors file ({msg}); re-download or re-save the "
                         f"checkpoint") from None


def check_module_patterns(model_path: Path, patterns) -> list[str]:
    """The modules ``patterns`` name in the model, matched against the module names of its
    skeleton built on the meta device (no weights read, nothing allocated); ValueError naming a
    pattern that matches none, before anything is captured."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from extractors.modules import resolve_modules

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    except Exception as e:  # noqa: BLE001 - an architecture transformers cannot build, in one line
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"--model {model_path}: transformers cannot build a causal LM of it ({msg})") from None
    names = [n for n, _ in model.named_modules() if n]
    return resolve_modules(names, patterns, where="--modules")


def check_engine_can_start(target) -> None:
    """What can be probed of the vLLM engine's start without starting it: installed, and a
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB) it can allocate on this machine. EngineStartError in one line."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineStartError(f"target vllm: vLLM is not installed; install it: {INSTALL['vllm']}")
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if space is None or not space.strip():
        return
    try:
        gib = float(space)
    except ValueError:
        raise EngineStartError(f"target vllm: VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB") from None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return
    if not 0 <= gib < total:
        raise EngineStartError(f"target vllm: VLLM_CPU_KVCACHE_SPACE={space} GiB of KV cache cannot be allocated on "
                               f"this machine ({total:.0f} GiB of memory): the engine cannot start; lower it")


@dataclass(frozen=True)
class Prompt:
    """One prompt as given: ``where`` it came from (``file line N`` / ``prompts[i]``), the
    user's ``id`` (if any), its ``text`` or its ``token_ids``."""

    where: str
    id: str | None = None
    text: str | None = None
    token_ids: tuple | None = None


def read_prompt_file(path) -> list[Prompt]:
    """Prompts of a ``.txt`` (one per line; blank lines skipped) or ``.jsonl`` file (one JSON
    object per line: ``"prompt"`` text or ``"token_ids"``, optional ``"id"``); lines end at
    ``\n`` or ``\r\n`` only, a leading UTF-8 BOM is dropped. ValueError names the file and line
    of anything malformed, and an empty file."""
    from capturestore.store import expand_path

    p = expand_path(str(path), "--prompts")
    if not p.is_file():
        raise ValueError(f"--prompts {path}: " + ("a directory, not a prompt file" if p.is_dir() else "no such file"))
    kind = p.suffix.lower()
    if kind not in (".txt", ".jsonl"):
        raise ValueError(f"--prompts {p}: unknown prompt file type {p.suffix!r}; use .txt (one prompt per line) "
                         f"or .jsonl ({{\"prompt\": ...}} or {{\"token_ids\": [...]}} per line)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {p}: not UTF-8 text (byte {e.start})") from None
    # Lines end at \n or \r\n only: str.splitlines() also splits at U+2028, form feeds, ... which a
    # JSON string or a prompt may hold. A UTF-8 byte-order mark is not part of the first prompt.
    lines = [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p.name} line {n}"
        if kind == ".txt":
            out.append(Prompt(where, text=line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {p} line {n}: not JSON ({e.msg} at column {e.colno})") from None
        out.append(_jsonl_prompt(obj, where, f"--prompts {p} line {n}"))
    if not out:
        raise ValueError(f"--prompts {p}: empty (no prompt in it)")
    return out


def _jsonl_prompt(obj, where: str, say: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ValueError(f"{say}: a JSON object is needed ({{\"prompt\": ...}} or {{\"token_ids\": [...]}}), "
                         f"got {type(obj).__name__}")
    if ("prompt" in obj) == ("token_ids" in obj):
        raise ValueError(f"{say}: needs exactly one of \"prompt\" and \"token_ids\"")
    pid = obj.get("id")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
        raise ValueError(f"{say}: \"id\" must be a string or an integer")
    pid = None if pid is None else str(pid)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError(f"{say}: \"prompt\" must be non-empty text")
        return Prompt(where, pid, text=obj["prompt"])
    ids = obj["token_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{say}: \"token_ids\" must be a non-empty list of token ids")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{say}: token_ids[{j}] = {t!r} is not a token id (an integer >= 0)")
    return Prompt(where, pid, token_ids=tuple(ids))


def task_prompts(results, reference=None):
    """``(prompts, analysis)``: the deviated samples' prompts of an lm-eval output directory and
    its ``capturestore.tasks`` analysis, against ``reference`` (another lm-eval output directory)
    when given; a prompt several samples share is analysed once. ``results`` may also be a
    ``TaskAnalysis`` already made (``capturestore eval``: its thresholds are stored with it)."""
    try:
        from capturestore.tasks import analyse_tasks
    except ImportError as e:
        raise EngineStartError(f"--from-task: this installation has no task analysis "
                               f"(capturestore.tasks: {e})") from None
    from capturestore.tasks import TaskAnalysis

    analysis = results if isinstance(results, TaskAnalysis) else analyse_tasks(results, reference)
    found = analysis.deviated_prompts()
    if not found:
        raise ValueError(f"--from-task {results}: no deviated prompt"
                         + (f" against {reference}" if reference is not None else "") + " (nothing to analyse)")
    out, seen = [], set()
    for d in found:
        if d["prompt"] in seen:
            continue
        seen.add(d["prompt"])
        out.append(Prompt(f"task sample {d['id']}", d["id"], text=d["prompt"]))
    return out, analysis


def _as_prompts(prompts) -> list[Prompt]:
    """A prompt file path, or a sequence of texts / token-id lists (the library call)."""
    if isinstance(prompts, (str, os.PathLike)):
        return read_prompt_file(prompts)
    out = []
    for i, x in enumerate(prompts):
        if isinstance(x, Prompt):
            out.append(x)
        elif isinstance(x, str):
            if not x.strip():
                raise ValueError(f"prompts[{i}]: empty text")
            out.append(Prompt(f"prompts[{i}]", text=x))
        else:
            out.append(_jsonl_prompt({"token_ids": list(x)}, f"prompts[{i}]", f"prompts[{i}]"))
    if not out:
        raise ValueError("prompts: empty (no prompt given)")
    return out


def encode_prompts(model_path, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text with the model's tokenizer, BOS first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    rows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows.append([tok.bos_token_id, *ids] if tok.bos_token_id is not None else list(ids))
    return rows


def _token_rows(model_path: Path, cfg: dict, prompts: list[Prompt], num_tokens: int) -> list[list[int]]:
    """Token ids of every prompt, checked: in the vocabulary, within the context with the
    ``num_tokens`` continuation, no prompt twice."""
    from capturestore.writer import prompt_id

    texts = [p.text for p in prompts if p.token_ids is None]
    encoded = iter(())
    if texts:
        try:
            encoded = iter(encode_prompts(model_path, texts))
        except (OSError, ValueError) as e:
            first = next(p for p in prompts if p.token_ids is None)
            raise ValueError(f"--model {model_path}: its tokenizer cannot be loaded ({str(e).splitlines()[0]}); "
                             f"the prompt of {first.where} is text (give \"token_ids\" in a .jsonl file instead)")
    vocab = int(cfg["vocab_size"])
    context = model_context(cfg)
    rows, seen = [], {}
    for p in prompts:
        row = list(p.token_ids) if p.token_ids is not None else list(next(encoded))
        name = p.where + (f" (id {p.id})" if p.id is not None else "")
        if not row:
            raise ValueError(f"{name}: the prompt has no tokens")
        bad = [t for t in row if t >= vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        if isinstance(context, int) and len(row) + num_tokens > context:
            raise ValueError(f"{name}: the prompt is {len(row)} tokens; with {num_tokens} teacher tokens it is longer "
                             f"than the model's context of {context} (its effective max_position_embeddings)")
        pid = prompt_id(row)
        if pid in seen:
            raise ValueError(f"{name}: the same prompt (token ids) as {seen[pid]}; give each prompt once")
        seen[pid] = name
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ progress


def _silent(_line: str) -> None:
    """Where the lines go when the caller gives no ``out``: nowhere."""


class _Progress:
    """Stage lines, and per-capture progress over prompts and their tokens: a tqdm bar on a
    terminal, a few plain lines otherwise, nothing with ``quiet``."""

    def __init__(self, out: Callable[[str], None], quiet: bool, bar: bool | None, bar_file=None):
        self.out, self.quiet, self.bar_file = out, quiet, bar_file
        self.t0 = time.monotonic()
        self.bar = (out is print and sys.stdout.isatty()) if bar is None else bar
        self._current = None

    def say(self, msg: str) -> None:
        if not self.quiet:
            self.out(f"[{time.monotonic() - self.t0:6.1f}s] {msg}")

    def begin(self, desc: str, n_prompts: int, tokens_per_prompt: int, unit: str = "tok") -> None:
        self.end()
        if self.quiet:
            return
        if self.bar:
            from tqdm import tqdm

            self._current = tqdm(total=n_prompts * tokens_per_prompt, desc=desc, unit=unit, leave=False,
                                 file=self.bar_file or sys.stderr)
            self._current.done = 0
        else:
            self._current = _Lines(self, desc, n_prompts)

    def prompt_done(self, n_tokens: int) -> None:
        if self._current is None:
            return
        if self.bar:
            self._current.done += 1
            self._current.set_postfix_str(f"prompt {self._current.done}", refresh=False)
            self._current.update(n_tokens)
        else:
            self._current.advance(n_tokens)

    def compare_callback(self, n_prompts: int):
        """``compare_runs``' progress: a bar over prompts on a terminal, its lines otherwise."""
        if self.quiet:
            return None
        if not self.bar:
            return self.say
        self.begin("comparing", n_prompts, 1, unit="prompt")
        started = []

        def tick(_msg: str) -> None:  # called as each prompt starts: count the one before
            if started:
                self.prompt_done(1)
            started.append(1)

        return tick

    def end(self) -> None:
        if self._current is not None and self.bar:
            self._current.close()
        self._current = None


class _Lines:
    """Plain progress lines: about ten per capture, whatever the number of prompts."""

    def __init__(self, progress: _Progress, desc: str, n: int):
        self.progress, self.desc, self.n, self.done, self.tokens = progress, desc, n, 0, 0
        self.every = max(1, -(-n // 10))

    def advance(self, n_tokens: int) -> None:
        self.done += 1
        self.tokens += n_tokens
        if self.done % self.every == 0 or self.done == self.n:
            self.progress.say(f"  {self.desc}: prompt {self.done}/{self.n} ({self.tokens} tokens)")


class _ProgressStore:
    """The store, with every run begun through it reporting each prompt it adds (the capture
    functions add a prompt once its engine work is done), so progress needs no capture hook;
    each prompt given as text is stored with it (``prompts.text``, whatever the capture), and
    every run it begins is named in ``begun`` (the runs this invocation wrote)."""

    def __init__(self, store, progress: _Progress, texts: dict | None = None):
        self._store, self._progress, self._texts = store, progress, texts or {}
        self.begun: list[str] = []
        self.appended: list = []  # segments appended through it (task analysis), removed on a roll-back

    def begin_run(self, *args, **kwargs):
        run = self._store.begin_run(*args, **kwargs)
        self.begun.append(run.run_id)
        return _ProgressRun(run, self._progress, self._texts)

    def append_table(self, name, rows):
        segment = self._store.append_table(name, rows)
        self.appended.append(segment)
        return segment

    def __getattr__(self, name):
        return getattr(self._store, name)


class _ProgressRun:
    def __init__(self, run, progress: _Progress, texts: dict):
        self._run, self._progress, self._texts = run, progress, texts

    def add_prompt(self, token_ids, text=None, continuation=None):
        if text is None and self._texts:
            from capturestore.writer import prompt_id

            text = self._texts.get(prompt_id([int(t) for t in token_ids]))
        pid = self._run.add_prompt(token_ids, text=text, continuation=continuation)
        self._progress.prompt_done(0 if continuation is None else len(continuation))
        return pid

    def __enter__(self):
        self._run.__enter__()
        return self

    def __exit__(self, *exc):
        return self._run.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._run, name)


# ------------------------------------------------------------------------------------ engines


def start_vllm_engine(model_path, dtype: str = "bfloat16", tp: int = 1, max_model_len: int = 256,
                      block_size: int = 32, **kwargs):
    """An in-process vLLM engine with the KV capture worker extension (``extractors.vllm_rpc.make_llm``);
    EngineStartError in one line when vLLM is missing or fails to start."""
    if tp == 1:  # in-process: module capture and fault probes reach the worker directly
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # not setdefault: an earlier --tp run set it to 1
    else:  # one worker process per rank, each bound to its own CPU (ENGINES.md)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        kwargs.setdefault("distributed_executor_backend", "mp")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from extractors.vllm_rpc import make_llm

        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineStartError(f"target vllm: vLLM cannot be imported ({e}); install it: {INSTALL['vllm']}") from None
    try:
        return make_llm(model_path, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
                        tensor_parallel_size=tp, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever stopped the engine, said in one line
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise EngineStartError(f"target vllm: the engine failed to start ({type(e).__name__}: {msg}); check that "
                               f"{INSTALL['vllm']} is installed and that the model directory loads in vLLM") from None


def server_capture_functions():
    """``(check_server, capture_vllm_server_run)`` of ``extractors.vllm_server``, or EngineStartError."""
    try:
        from extractors.vllm_server import capture_vllm_server_run, check_server
    except ImportError as e:
        raise EngineStartError(f"target vllm-server: this installation has no server capture "
                               f"(extractors.vllm_server: {e})") from None
    return check_server, capture_vllm_server_run


# ------------------------------------------------------------------------------------ the pipeline


def check_num_tokens(num_tokens) -> None:
    """``--num-tokens``: an integer >= 1 (run, and eval before its server starts)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"--num-tokens must be an integer >= 1, got {num_tokens!r}")


def run(model, prompts=None, target: str | Target = "vllm", num_tokens: int = 8, release: str | None = None,
        store="capturestore-store", plugins=None, modules=None, tp: int = 1, quiet: bool = False,
        out: Callable[[str], None] | None = None, label: str | None = None, progress_bar: bool | None = None,
        engine_options: dict | None = None, engine_hook: Callable | None = None, fp8_scales=None,
        fp8_platform: str | None = None, timings: dict | None = None, from_task=None, task_reference=None,
        bar_file=None, reference_device: str = "cpu", reference_memory: float | None = None,
        dtype: str | None = None, module_inputs: bool = False):
    """The main job (module docstring); returns the ``ComparisonResult`` of the stored comparison.

    model: a Hugging Face model directory. prompts: a ``.txt`` / ``.jsonl`` file, or a sequence
    of texts / token-id lists; or, instead, ``from_task``: an lm-eval output directory whose
    deviated samples' prompts are analysed (``capturestore.tasks``; against ``task_reference``,
    another lm-eval output directory, when given). target: ``vllm`` | ``vllm-server=URL`` | ``hf:bfloat16`` |
    ``hf:float16`` | ``hf-fp8-kv`` | an installed plugin target's name (``capturestore.targets``).
    dtype: the target's dtype where it takes one (``vllm``: bfloat16, float16, float32). plugins: comparator names (comma-separated or a list;
    ``fp8-kv`` = ``fp8_kv_floor``), default per target (its ``default_plugins``, ``capturestore.targets``). modules: module
    patterns for the ``modules`` plugin (default ``DEFAULT_MODULE_PATTERNS``). module_inputs: the
    target's module run records each module's input too (its input snapshot, what
    ``capturestore isolate --snapshot`` replays; HF and vLLM targets). release: the
    target run's release label (references are shared across releases and carry none).
    quiet: no progress lines (the verdict's lines still go to ``out``). out: where the progress and
    verdict lines go (default: nowhere; the library prints nothing, the CLI passes its own). label: the
    comparison's label (default: the target and the release).
    engine_options: extra ``start_vllm_engine`` arguments (block_size, max_model_len, ...).
    engine_hook(llm, rows, say) -> dict: called once the vLLM engine runs, before the capture
    (e.g. to inject a proven fault); its dict is added to the target run's config.
    fp8_scales: a checkpoint directory / .safetensors of KV scales for ``hf-fp8-kv`` (default:
    calibrated by absmax on the expected run's KV). bar_file: the stream of the progress bars
    (default sys.stderr; the CLI passes the terminal while library output goes to a log). timings: a dict receiving seconds per stage
    (``checks``, ``baseline``, ``expected``, ``target``, ``modules``, ``compare``, ``total``).
    reference_device: where the HF references run, ``cpu`` or ``cuda[:N]`` (FP32 without TF32; a
    reference is reused only from the same device). reference_memory: the references' memory
    budget in GiB (default: the device's available memory); a model whose weights do not fit it
    is streamed layer by layer (``extractors.streamed``, bit-identical; docs/references.md), and
    the output says which path each reference took, its prompt groups and its peak memory.
    Bad input raises ValueError before anything is written; an engine that cannot start raises
    ``EngineStartError``. An existing store that cannot be written is refused first, before any capture.
    """
    from capturestore.store import require_writable_if_stored

    require_writable_if_stored(store, "run")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the pipeline prints its own progress
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise EngineStartError(f"the HF references need torch and transformers ({e}); install them: "
                               f"{INSTALL['hf']}") from None
    out = out if out is not None else _silent
    progress = _Progress(out, quiet, progress_bar, bar_file)
    from transformers.utils import logging as hf_logging

    hf_bars = hf_logging.is_progress_bar_enabled()
    if quiet or not progress.bar:
        hf_logging.disable_progress_bar()  # transformers' weight-loading bars: only on a terminal
    try:
        if (prompts is None) == (from_task is None):
            raise ValueError("give the prompts (--prompts FILE) or an lm-eval output directory (--from-task DIR), "
                             "one of the two")
        if task_reference is not None and from_task is None:
            raise ValueError("--task-reference is the lm-eval reference of --from-task; give --from-task DIR")
        if from_task is not None:
            prompts = lambda: task_prompts(from_task, task_reference)  # noqa: E731 - read after the cheap checks
        return _run(model, prompts, target, num_tokens, release, store, plugins, modules, tp, quiet, out, label,
                    progress, engine_options, engine_hook, fp8_scales, fp8_platform, timings,
                    _Reference(reference_device, reference_memory), dtype, module_inputs)
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()


class _Reference:
    """Where and within what memory the HF references run (checked before anything is written)."""

    def __init__(self, device, memory_gib):
        from extractors.hf import _device_str

        try:
            self.device = _device_str(device)
        except ValueError as e:
            raise ValueError(f"--reference-device: {e}") from None
        if memory_gib is not None and (isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float))
                                       or not memory_gib > 0 or memory_gib != memory_gib):
            raise ValueError(f"--reference-memory must be a number of GiB > 0, got {memory_gib!r}")
        self.memory = None if memory_gib is None else int(memory_gib * (1 << 30))

    def check(self, model_path, dtypes, rows, num_tokens):
        """Refuse a checkpoint whose files disagree, or a budget below one layer, before any write."""
        from extractors.streamed import prepare_reference

        for dtype in dtypes:
            prepare_reference(model_path, dtype, self.device, self.memory, None,
                              [(len(r) + num_tokens, num_tokens + 1) for r in rows])


def _run(model, prompts, target, num_tokens, release, store, plugins, modules, tp, quiet, out, label, progress,
         engine_options, engine_hook, fp8_scales, fp8_platform, timings, ref=None, dtype=None,
         module_inputs=False):
    t_start = time.perf_counter()
    tm = timings if timings is not None else {}
    tm.clear()
    say = progress.say

    # 1. every check before the store is touched
    check_num_tokens(num_tokens)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be an integer >= 1, got {tp!r}")
    from capturestore.writer import check_label

    for what, text in (("--release", release), ("--label", label)):
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"{what} must be text, got {text!r}")
            check_label(text, what)
    from capturestore.targets import TargetCheck, engine_target

    tgt = target if isinstance(target, Target) else parse_target(target, dtype)
    eng = engine_target(tgt.kind)
    if tp != 1 and "tp" not in eng.options:
        raise ValueError(f"--tp {tp}: tensor parallelism is for --target vllm, not {tgt}")
    names = resolve_plugins(plugins, tgt)
    needs = _needs(names)
    if modules is not None and "tensors" not in needs:
        raise ValueError("--modules is given but no plugin compares module tensors (add --plugins ...,modules)")
    if module_inputs and "tensors" not in needs:
        raise ValueError("--module-inputs is given but no plugin compares module tensors (add --plugins ...,modules)")
    if module_inputs and tgt.kind not in ("hf", "vllm"):
        raise ValueError(f"--module-inputs: target {tgt} captures no module inputs (HF and vLLM targets do)")
    patterns = _patterns(modules)
    model_path, cfg = check_model_dir(model)
    if "routing" in needs:  # routing is captured as the router modules' tensors (docs/moe.md)
        from extractors.routing import routing_patterns

        patterns = routing_patterns(cfg, patterns if "tensors" in needs else ())
        needs = needs | {"tensors"}
    if "tensors" in needs:
        check_module_patterns(model_path, patterns)
    given, analysis = prompts() if callable(prompts) else (_as_prompts(prompts), None)
    rows = _token_rows(model_path, cfg, given, num_tokens)
    from extractors.models import model_content_hash

    try:
        model_hash = model_content_hash(model_path)
    except Exception as e:  # noqa: BLE001 - weights that cannot be read: one line, nothing written
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"--model {model_path}: its weights cannot be read ({type(e).__name__}: {msg})") from None
    # the target's own check (an engine that can start, a server that serves this model) before any write
    eng.check(TargetCheck(tgt, model_path, cfg, rows, num_tokens, tp, frozenset(needs), callable(prompts)))
    # FP8 vLLM KV cache (issue 20 §1): checks here, engine options/hook and expected run below
    from extractors.vllm_fp8 import plan_from_options
    fp8_plan, engine_options = plan_from_options(tgt.kind, engine_options, fp8_scales, cfg)
    if fp8_scales is not None and tgt.kind != "hf-fp8-kv" and fp8_plan is None:
        raise ValueError(f"--fp8-scales {fp8_scales}: scales are for --target hf-fp8-kv, not {tgt}")
    scales = _load_fp8_scales(fp8_scales, cfg) if fp8_scales is not None and fp8_plan is None else None
    ref = ref or _Reference("cpu", None)
    ref.check(model_path, ("float32", tgt.reference_dtype), rows, num_tokens)

    from capturestore import Store
    from capturestore.store import store_exists
    from capturestore.writer import prompt_id

    pids = [prompt_id(r) for r in rows]
    fresh = not store_exists(store)  # run creates it, and removes it again when it fails
    st = Store.open(store)
    tm["checks"] = time.perf_counter() - t_start
    say(f"store {st.root}: {len(rows)} prompts, lengths {[len(r) for r in rows]}, {num_tokens} tokens each; "
        f"model {model_path} (hash {model_hash[:12]}); target {tgt}; plugins {', '.join(names)}")
    texts = {pid: p.text for pid, p in zip(pids, given) if p.text is not None}
    pstore = _ProgressStore(st, progress, texts)
    references: list[str] = []  # complete reference runs (reusable): an interrupted run keeps them
    # no compaction merges what this invocation commits until it succeeded (its runs' writer locks
    # held, its own automatic compaction deferred): a roll-back removes it segment by segment, and
    # remove_run refuses a merged run (docs/compact.md, "Automatic"); the roll-back runs inside
    emptied = False  # the roll-back left the store this invocation created empty: removed once the locks are
    try:
        with st.auto_compaction_held():
            try:
                result, reused = _capture_and_compare(st, pstore, progress, tm, say, tgt, names, needs, patterns,
                                                      model_path, cfg, model_hash, rows, pids, given, analysis,
                                                      num_tokens, release, label, tp, engine_options, engine_hook, eng,
                                                      scales, fp8_platform, references, ref, fp8_plan, module_inputs)
            except BaseException as e:
                emptied = _roll_back(st, pstore, references, interrupted=isinstance(e, KeyboardInterrupt),
                                     fresh=fresh, say=say)
                raise
    except BaseException:
        if emptied:
            st.remove_if_empty()  # the store this invocation created, when it holds nothing
        raise
    tm["total"] = time.perf_counter() - t_start
    _print_result(out, result, reused, st, tgt)
    return result


def _roll_back(st, pstore, references: list, *, interrupted: bool, fresh: bool, say) -> bool:
    """Undo what a failed invocation committed (docs/run.md "A run that fails commits nothing"):
    every run it began and committed, newest first, and the task-analysis segments it appended.
    Returns whether the store it created is to be removed when nothing else is in it (the caller
    does, once the runs' writer locks are released). Interrupted (Ctrl-C), the complete
    reference runs it captured are kept, so the next invocation reuses them and resumes. Runs of
    earlier invocations are never touched (reused ones are not in ``pstore.begun``)."""
    from capturestore.errors import StoreError

    keep = set(references) if interrupted else set()
    committed = st.committed_ids()
    undone, kept = [], []
    for rid in reversed(pstore.begun):
        if rid not in committed:
            continue  # aborted by its writer: nothing of it is catalogued
        if rid in keep:
            kept.append(rid)
            continue
        try:
            st.remove_run(rid)
            undone.append(rid)
        except (StoreError, OSError) as e:  # used by another comparison meanwhile, or unremovable: say so
            say(f"could not roll back run {rid}: {' '.join(str(e).split())}")
    for seg in reversed(pstore.appended):
        try:
            st.remove_written(seg)
        except OSError:
            pass
    if undone:
        say(f"rolled back the {len(undone)} run(s) this invocation committed: {', '.join(reversed(undone))}")
    if kept:
        say(f"interrupted: kept the complete reference run(s) {', '.join(reversed(kept))} (the next run reuses them)")
    return fresh and not kept


def _capture_and_compare(st, pstore, progress, tm, say, tgt, names, needs, patterns, model_path, cfg, model_hash,
                         rows, pids, given, analysis, num_tokens, release, label, tp, engine_options, engine_hook,
                         eng, scales, fp8_platform, references: list, ref=None, fp8_plan=None,
                         module_inputs: bool = False):
    """Steps 2-4 of ``run``: references, the target, one comparison. Appends each complete reference
    run to ``references`` as it is found or captured. Returns ``(ComparisonResult, reused)``: which
    references were reused, for the output."""
    reused: dict = {}
    if label is None:
        label = f"{tgt} {release}" if release else str(tgt)
    target_config = {}
    if analysis is not None:  # stored, and named by the target run: its report shows the Tasks tab
        from capturestore.tasks import store_task_analysis

        target_config["task_analysis_id"] = store_task_analysis(pstore, analysis, label)
        say(f"lm-eval task analysis {target_config['task_analysis_id']}: {len(given)} deviated prompts to analyse")

    # 2. references
    base, reused["baseline"] = _reference(
        st, pstore, progress, tm, "baseline", "HF FP32 baseline", "greedy continuation = teacher tokens",
        model_path, model_hash, "float32", rows, pids, num_tokens, teacher=None, ref=ref)
    references.append(base)
    teacher = {p: st.read_tokens(base, p) for p in pids}
    teacher_rows = [teacher[p][len(r):].tolist() for p, r in zip(pids, rows)]
    # a target whose kernels round FP32 -> BF16 otherwise than torch (vLLM-CPU without AVX512-BF16:
    # toward zero) is judged against an expected reference rounding the same way (logits, KV)
    rounding = _kernel_rounding(eng, tgt) if tgt.reference_dtype == "bfloat16" else None
    rounding = _emulated_rounding(rounding, model_path, say, "expected reference")
    exp, reused["expected"] = _reference(
        st, pstore, progress, tm, "expected", f"HF {_dt(tgt.reference_dtype)} expected", "teacher-forced",
        model_path, model_hash, tgt.reference_dtype, rows, pids, num_tokens, teacher=teacher, ref=ref,
        kernel_rounding=rounding)
    reused["kernel_rounding"] = rounding if fp8_plan is None else None  # FP8 plans capture their own
    references.append(exp)

    if fp8_plan is not None:  # FP8-aware baseline/expected runs take those roles; the engine gets the scales
        base, exp = fp8_plan.reference_runs(pstore, model_path, model_hash, rows, teacher_rows, say)
        engine_options, engine_hook = fp8_plan.engine_options(engine_options), fp8_plan.hook(engine_hook)

    # 3. the target
    t0 = time.perf_counter()
    mod_runs = None
    from capturestore.targets import TargetContext

    got = eng.capture(TargetContext(
        tgt, pstore, model_path, cfg, model_hash, rows, pids, teacher_rows, num_tokens, release, frozenset(needs),
        patterns if "tensors" in needs else None, target_config, say, progress, expected_run=exp, baseline_run=base,
        tp=tp, engine_options=engine_options or {}, engine_hook=engine_hook, timings=tm, module_inputs=module_inputs,
        extra={"store": st, "fp8_scales": scales, "fp8_platform": fp8_platform}))
    act, mod_act = got.run_id, got.module_run_id
    progress.end()
    tm["target"] = time.perf_counter() - t0 - tm.get("modules", 0.0)
    say(f"target {tgt}: run {act} captured")
    if mod_act is not None:
        mod_runs = _module_references(st, pstore, progress, tm, model_path, model_hash, rows, pids, mod_act,
                                      tgt.reference_dtype, references, ref)
        reused["module references"] = mod_runs.pop("reused")

    comparator_runs = _tensor_plugin_runs(names, mod_runs)
    if "routing" in names and mod_runs:  # explained router flips: judge against forced-routing references
        base, exp, comparator_runs = _forced_routing(st, pstore, say, tm, model_path, model_hash, rows, pids,
                                                     teacher_rows, mod_runs, comparator_runs, tgt.reference_dtype,
                                                     logits_kv=bool({"logits", "kv"} & set(names)),
                                                     base=base, exp=exp, act=act, fp8=fp8_plan is not None)

    # 4. one comparison
    t0 = time.perf_counter()
    say(f"comparing runs (three-way: FP32 baseline, {_dt(tgt.reference_dtype)} expected, {tgt} actual)")
    from capturestore.analysis import compare_runs

    result = compare_runs(st, expected_run=exp, actual_run=act, baseline_run=base, label=label,
                          logits="logits" in names, kv="kv" in names,
                          comparators=[n for n in names if n not in ("logits", "kv")],
                          comparator_runs=comparator_runs,
                          progress=progress.compare_callback(len(pids)))
    progress.end()
    tm["compare"] = time.perf_counter() - t0
    return result, reused


def _kernel_rounding(eng, tgt):
    """``eng.kernel_rounding``, given the parsed target where the method takes it (a plugin's
    ``kernel_rounding(self, dtype)`` keeps working)."""
    import inspect

    takes = "target" in inspect.signature(eng.kernel_rounding).parameters
    return eng.kernel_rounding(tgt.dtype, target=tgt) if takes else eng.kernel_rounding(tgt.dtype)


def _forced_routing(st, pstore, say, tm, model_path, model_hash, rows, pids, teacher_rows, mod_runs, comparator_runs,
                    dtype, *, logits_kv, base, exp, act, fp8=False):
    """docs/moe.md "Forced routing": the references of logits, KV and modules are captured again with
    the target's expert choices forced at the routers before the first layer whose routing fails
    (every router when none does; ``routing_decision``), recorded as ``routing_forced_layers``;
    routing keeps the unforced module runs. Each forced expected run rounds FP32 ->
    BF16 as the unforced one it replaces records (``kernel_rounding``: the target's kernels' rounding
    where emulated, else nearest). ``fp8``: the logits/KV references come from an FP8 plan (FP8 KV
    emulation the forced HF runs lack): logits and KV are not forced. Returns ``(baseline, expected,
    comparator_runs)``."""
    from capturestore.forced_routing import capture_forced_references, routing_decision

    t0 = time.perf_counter()
    decision = routing_decision(st, mod_runs, model_path, pids)
    layers = f" (routing_forced_layers {decision.forced_layers})" if decision.force else ""
    say(f"routing: {decision.reason}{layers}")
    if decision.force and fp8 and logits_kv:
        say("routing: logits and KV not forced: FP8 KV references (the FP8 plan's baseline and expected emulate "
            "the target's FP8 KV cache, forced HF references would not): judged against the unforced ones")
        logits_kv = False
    if not decision.force or not (logits_kv or set(comparator_runs or {}) - {"routing"}):
        return base, exp, comparator_runs

    def config(rid):
        return json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()[0]["config"])

    cfg = config(mod_runs["actual"])
    # the rounding the unforced expected runs record (_emulated_rounding of the target's: nearest on a
    # model the emulation does not cover, e.g. GPT-OSS's attention sinks), never the raw probed one
    rounding, logits_rounding = config(mod_runs["expected"]).get("kernel_rounding"), config(exp).get("kernel_rounding")
    if cfg.get("kernel_rounding") not in (None, "nearest") and dtype == "bfloat16":
        say(f"routing: the forced expected references round FP32 -> BF16 as the unforced ones: "
            f"{(logits_rounding or 'nearest').replace('_', ' ')} (logits, KV), "
            f"{(rounding or 'nearest').replace('_', ' ')} (modules); the target's kernels round "
            f"{cfg['kernel_rounding'].replace('_', ' ')}")
    tensors = set(comparator_runs or {}) - {"routing"}  # other plugins judging module tensors
    if logits_kv:
        from capturestore.forced_routing import logits_routed_alike

        alike, diff, bar = logits_routed_alike(st, act, mod_runs["actual"], base, exp, pids)
        if alike is None:
            say("routing: the target's module run holds no logits: that its logits/KV run routed as it did is "
                "assumed (a run that did not differs from the forced references by a flip and fails)")
        elif not alike:  # the plan is the module run's routing: it does not hold for the logits/KV run
            say(f"routing: logits and KV judged against the unforced references: the target's logits run and its "
                f"module run routed differently (their logits differ by {diff:.3g}, beyond {bar:.3g})")
            logits_kv = False
    got = capture_forced_references(pstore, model_path, model_hash, rows, teacher_rows, decision, dtype,
                                    module_order=cfg["module_order"] if tensors else None, kernel_rounding=rounding,
                                    logits_kernel_rounding=logits_rounding, logits_kv=logits_kv, say=say)
    runs = {n: dict(r) for n, r in (comparator_runs or {}).items()}
    for n in tensors:
        runs[n] = {"baseline": got["mod_baseline"], "expected": got["mod_expected"], "actual": mod_runs["actual"]}
    tm["forced routing"] = time.perf_counter() - t0
    return got.get("baseline", base), got.get("expected", exp), runs


def _dt(dtype: str) -> str:
    return {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}.get(dtype, dtype)


def _needs(names) -> set:
    from capturestore.comparators import comparator_class

    out = set()
    for n in names:
        out |= set(comparator_class(n).needs)
    return out


def _tensor_plugin_runs(names, mod_runs) -> dict | None:
    """Every plugin that needs module tensors reads them from the module runs of every role."""
    from capturestore.comparators import comparator_class

    if not mod_runs:
        return None
    return {n: dict(mod_runs) for n in names if {"tensors", "routing"} & set(comparator_class(n).needs)}


def _patterns(modules) -> tuple[str, ...]:
    if modules is None:
        return DEFAULT_MODULE_PATTERNS
    pats = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else [str(m).strip() for m in modules]
    if not pats or any(not m for m in pats):
        raise ValueError(f"--modules {modules!r}: an empty pattern (give comma-separated patterns such as "
                         f"model.layers.*.mlp)")
    return tuple(pats)


def _load_fp8_scales(path, cfg):
    from nki_fp8.checkpoint import load_kv_scales

    try:
        return load_kv_scales(path, int(cfg["num_hidden_layers"]))
    except (OSError, ValueError) as e:
        raise ValueError(f"--fp8-scales {path}: {e}") from None


def _emulated_rounding(rounding, model_path, say, what: str) -> str | None:
    """The kernel rounding the HF BF16 ``what`` applies for a target whose kernels round ``rounding``
    (``extractors.kernel_rounding``), said in one line; None: torch's round to nearest (the kernels
    do too, or the emulation does not cover this model, which is said)."""
    if rounding in (None, "nearest"):
        return None
    from extractors.kernel_rounding import kernel_rounding_unsupported

    how = rounding.replace("_", " ")
    why = kernel_rounding_unsupported(model_path)
    if why:
        say(f"the target's kernels round FP32 -> BF16 {how} (probed), but {why}: the HF BF16 {what} rounds to "
            f"nearest (attention may show a sigma-ratio above 1 from that rounding alone)")
        return None
    say(f"the target's kernels round FP32 -> BF16 {how} (probed): the HF BF16 {what} rounds its rotary "
        f"embedding and attention outputs the same way")
    return rounding


def _reference(st, pstore, progress, tm, role, what, how, model_path, model_hash, dtype, rows, pids, num_tokens,
               teacher, ref=None, kernel_rounding=None):
    """The run of a reference role: reused from the store (same model content, prompts, dtype,
    tokens, eager HF capture, kernel rounding) or captured. Returns ``(run_id, reused)``."""
    from capturestore.analysis import find_reference_run
    from extractors.hf import capture_hf_run

    t0 = time.perf_counter()
    if teacher is None:
        want = {"capture": "greedy", "num_tokens": num_tokens, "attn_implementation": "eager", "model_given": False}
    else:
        want = {"capture": "teacher_forced_prefill", "attn_implementation": "eager", "model_given": False}
    want["kernel_rounding"] = kernel_rounding  # None: a run that records none (torch's rounding)
    ref = ref or _Reference("cpu", None)
    rid = find_reference_run(st, model_hash=model_hash, dtype=dtype, prompt_ids=pids, teacher_tokens=teacher,
                             config=want, device=ref.device)
    found = rid is not None
    if found:
        progress.say(f"reusing {what} run {rid}")
    else:
        progress.say(f"capturing {what} ({how}) on {ref.device}")
        progress.begin(what, len(rows), num_tokens)
        teacher_rows = None if teacher is None else [teacher[p][len(r):].tolist() for p, r in zip(pids, rows)]
        info = {}
        rid = capture_hf_run(pstore, model_path, rows, teacher_tokens=teacher_rows, num_tokens=num_tokens, dtype=dtype,
                             device=ref.device, memory=ref.memory, model_hash=model_hash, info=info,
                             kernel_rounding=kernel_rounding)
        progress.end()
        progress.say(f"{what}: {info['plan']}; {info['peak'].describe()}")
    tm[role] = time.perf_counter() - t0
    return rid, found


def capture_vllm_target(pstore, progress, model_path, model_hash, rows, teacher_rows, release, tp, kv, patterns,
                  engine_options, engine_hook, tm, context, target_config, dtype: str = "bfloat16",
                  module_inputs: bool = False):
    """The in-process vLLM target: raw logits (and paged KV) teacher-forced through the decode path,
    and with ``patterns`` a module-tensor run of the same engine. Returns ``(run_id, module_run_id)``."""
    from extractors.vllm_rpc import capture_vllm_run, close_llm, extract_vllm_kv_cache_config

    say = progress.say
    say(f"starting vLLM ({dtype}{f', TP {tp}' if tp > 1 else ''}) with the KV capture worker extension")
    need = max(len(r) + len(t) for r, t in zip(rows, teacher_rows))
    max_len = max(256, -(-need // 256) * 256)  # a few sizes, not one per prompt set
    opts = {"max_model_len": min(max_len, context) if isinstance(context, int) else max_len, **engine_options}
    if patterns is not None:  # module capture needs every prefill to run in full, never from cached blocks
        opts.setdefault("enable_prefix_caching", False)
    llm = start_vllm_engine(model_path, dtype, tp, **opts)
    mod_run = None
    try:
        config = dict(target_config)
        if tp == 1:
            from extractors.faults import engine_cpu_paths

            config["cpu_paths"] = cpu = engine_cpu_paths(llm)
            say(f"vLLM-CPU kernels: attention {cpu['attn_isa']}, linear {cpu['linear_backends']}")
        if dtype == "bfloat16":  # how its kernels round FP32 -> BF16: the module references round the same way
            from extractors.kernel_rounding import probe_vllm_cpu_rounding

            config["kernel_rounding"] = probe_vllm_cpu_rounding()
        if engine_hook is not None:  # the engine is no longer the checkpoint's: isolate cannot rebuild it
            added = engine_hook(llm, rows, say) or {}
            config.update(added)
            config["engine_hooked"] = sorted(added)
        kv_config = extract_vllm_kv_cache_config(llm)  # first RPC: starts block-table snapshotting
        say("teacher-forcing vLLM through its decode path (one pass per prompt): raw logits"
            + (" + paged KV" if kv else ""))
        progress.begin("target vllm", len(rows), len(teacher_rows[0]))
        report: dict = {}
        act = capture_vllm_run(pstore, llm, model_path, rows, teacher_rows, mode="decode", model_hash=model_hash,
                               release=release, kv=kv, kv_config=kv_config, report=report, config=config)
        progress.end()
        say(f"vLLM run {act}: engine's own greedy token first differs from the teacher at {report['diverged_at']} "
            f"(per prompt; None = never)")
        if patterns is not None:
            t0 = time.perf_counter()
            mod_run = _vllm_module_run(pstore, progress, llm, model_path, rows, teacher_rows, patterns, release,
                                       config, module_inputs)
            tm["modules"] = time.perf_counter() - t0
    finally:
        close_llm(llm)  # now, not at some later GC inside another engine's start
    return act, mod_run


def _vllm_module_run(pstore, progress, llm, model_path, rows, teacher_rows, patterns, release, config,
                     inputs: bool = False):
    """Module tensors of the vLLM engine, teacher-forced on the references' tokens (every rank's
    shards merged under tensor parallelism, ``extractors.vllm_modules``)."""
    from extractors.vllm_modules import capture_vllm_module_run

    progress.say(f"capturing vLLM module tensors ({', '.join(patterns)}; teacher-forced)")
    progress.begin("target vllm modules", len(rows), len(teacher_rows[0]))
    # batch_size "auto": several requests a forward as the logits + KV run's batches (memory bounded by
    # AUTO_BATCH_BYTES), not a prompt at a time (2.4x a plain generate at 4 prompts of a 1.5B model)
    rid = capture_vllm_module_run(pstore, llm, model_path, rows, len(teacher_rows[0]), modules=list(patterns),
                                  release=release, config={k: v for k, v in config.items() if k != "cpu_paths"},
                                  teacher_tokens=teacher_rows, inputs=inputs, batch_size="auto")
    progress.end()
    return rid


def capture_hf_target(pstore, progress, model_path, dtype, rows, teacher_rows, release, patterns, tm, config,
                      module_inputs: bool = False):
    """HF in ``dtype`` with SDPA attention (the references run eager attention) as the target."""
    from extractors.hf import capture_hf_run, load_hf_model

    progress.say(f"capturing target HF {_dt(dtype)} with SDPA attention (teacher-forced)")
    model = _load_sdpa(model_path, dtype, load_hf_model)
    progress.begin(f"target hf:{dtype}", len(rows), len(teacher_rows[0]))
    # model_given False: the checkpoint loaded plainly (SDPA, so never an eager reference), which
    # isolate and reduce rebuild from model_path
    act = capture_hf_run(pstore, model_path, rows, teacher_tokens=teacher_rows, dtype=dtype, release=release,
                         model=model, config=config, model_given=False)
    progress.end()
    mod = None
    if patterns is not None:
        from extractors.modules import capture_hf_module_run

        t0 = time.perf_counter()
        progress.say(f"capturing target module tensors ({', '.join(patterns)})")
        progress.begin(f"target hf:{dtype} modules", len(rows), len(teacher_rows[0]))
        mod = capture_hf_module_run(pstore, model_path, rows, teacher_rows, list(patterns), dtype=dtype,
                                    release=release, model=model, inputs=module_inputs, model_given=False)
        progress.end()
        tm["modules"] = time.perf_counter() - t0
    return act, mod


def _load_sdpa(model_path, dtype, load_hf_model):
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtypes[dtype], attn_implementation="sdpa",
                                                device_map=None).to("cpu").eval()


def capture_fp8_target(st, pstore, progress, model_path, exp, rows, teacher_rows, release, scales, platform):
    """The FP8 KV cache target (``nki_fp8.target``): kernel scales from ``scales`` or calibrated by
    absmax on the expected run's KV."""
    import numpy as np

    from nki_fp8.target import capture_fp8_kv_run

    if scales is None:
        from nki_fp8.calibration import calibrate_kv_scales

        cal = calibrate_kv_scales(st, exp, method="absmax", platform=platform, record=False)
        ks, vs = (1.0 / np.asarray(cal.k_scale, np.float64)), (1.0 / np.asarray(cal.v_scale, np.float64))
        progress.say(f"FP8 KV scales calibrated (absmax) on the expected run {exp} ({cal.platform})")
    else:
        ks, vs = scales.k_scale, scales.v_scale
    progress.say("capturing target HF BF16 with an FP8 KV cache (teacher-forced)")
    progress.begin("target hf-fp8-kv", len(rows), len(teacher_rows[0]))
    rid = capture_fp8_kv_run(pstore, model_path, rows, teacher_rows, ks, vs, platform=platform, release=release)
    progress.end()
    return rid


def _module_references(st, pstore, progress, tm, model_path, model_hash, rows, pids, mod_act, dtype,
                       references: list, ref=None) -> dict:
    """HF FP32 and ``dtype`` (the target's) module runs on the target module run's tokens, over its
    modules (reused when the store holds them). Returns ``{"baseline", "expected", "actual", "reused"}``."""
    from capturestore.analysis import find_reference_run
    from extractors.modules import capture_hf_module_run

    t0 = time.perf_counter()
    cfg = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{mod_act}'").to_pylist()[0]["config"])
    order = cfg["module_order"]
    tokens = {p: st.read_tokens(mod_act, p) for p in pids}
    teach = [tokens[p][len(r):].tolist() for p, r in zip(pids, rows)]
    out, reused = {"actual": mod_act}, []
    # a target whose kernels round FP32 -> BF16 toward zero (vLLM-CPU without AVX512-BF16) is judged
    # against a BF16 reference rounding the same way (extractors.kernel_rounding), and says so
    rounding = _emulated_rounding(cfg.get("kernel_rounding") if dtype == "bfloat16" else None, model_path,
                                  progress.say, "module reference")
    for role, dtype in (("baseline", "float32"), ("expected", dtype)):
        want = {"mode": "teacher_forced_stepwise", "attn_implementation": "eager", "module_order": order,
                "model_given": False,  # a run of a model passed in (a patched fault) is never a reference
                "kernel_rounding": rounding if role == "expected" else None}
        ref = ref or _Reference("cpu", None)
        rid = find_reference_run(st, model_hash=model_hash, dtype=dtype, prompt_ids=pids, teacher_tokens=tokens,
                                 config=want, device=ref.device)
        if rid is not None:
            progress.say(f"reusing HF {_dt(dtype)} module run {rid}")
            reused.append(rid)
        else:
            progress.say(f"capturing HF {_dt(dtype)} module tensors ({len(order)} modules, teacher-forced)")
            progress.begin(f"HF {_dt(dtype)} modules", len(rows), len(teach[0]))
            info = {}
            rid = capture_hf_module_run(pstore, model_path, rows, teach, order, dtype=dtype, device=ref.device,
                                        memory=ref.memory, model_hash=model_hash, info=info,
                                        kernel_rounding=want["kernel_rounding"])
            progress.end()
            progress.say(f"HF {_dt(dtype)} modules: {info['plan']}; {info['peak'].describe()}")
        out[role] = rid
        references.append(rid)
    tm["module references"] = time.perf_counter() - t0
    out["reused"] = reused
    return out


def _print_result(out, result, reused: dict, st, tgt: Target) -> None:
    runs = result.runs
    rounds = reused.get("kernel_rounding")
    how = {"expected": f", rounding FP32 -> BF16 {rounds.replace('_', ' ')} as the target's kernels" if rounds else ""}
    said = [f"{role} {runs[role]} ({'reused' if reused.get(role) else 'captured'}{how.get(role, '')})"
            for role in ("baseline", "expected")]
    out("")
    out(f"references: {'; '.join(said)}" + (f"; module references reused: {', '.join(reused['module references'])}"
                                            if reused.get("module references") else ""))
    out(f"target {tgt}: {runs['actual']} (captured)")
    if result.kv_layers:
        out("")
        out(format_layer_summary(result))
        out("")
    for name, v in result.verdicts.items():
        head = {"logits": "logit verdict:", "kv": "KV verdict:   "}.get(name, f"{name} verdict:")
        out(f"{head} {'—' if v is None else v.summary()}")
    for name, tb in result.errors.items():
        out(f"plugin {name} errored; its traceback (stored in comparisons.errored):")
        for line in tb.rstrip().splitlines():
            out(f"    {line}")
    out(f"overall:       {'PASS' if result.passed else 'FAIL'}"
        + (f" (first failure in {result.phase})" if result.phase else ""))
    loc = result.localisation
    if loc:
        where = ", ".join(f"{k} {loc[k]}" for k in ("phase", "layer", "module", "token") if loc.get(k) is not None)
        out(f"localisation:  {where or 'not localised'}")
    out(f"comparison {result.comparison_id} stored in {st.root}")


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
