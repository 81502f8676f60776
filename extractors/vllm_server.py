"""Teacher-forced capture from an already-running OpenAI-compatible ``vllm serve`` (the engine as deployed).

The server is reached over HTTP only (``/v1/models``, ``/version``, ``/v1/completions``): each
prompt + its teacher tokens is sent as one token-id prompt with ``prompt_logprobs`` = the
vocabulary size and ``max_tokens=1``, so one prefill returns, for every position, the
full-vocabulary log-softmax of the next token (ENGINES.md, "Teacher forcing through vLLM"). Row
``i`` of a prompt is the distribution predicting teacher token ``i`` (position ``len(prompt) + i -
1``), the rows an HF or in-process capture stores. The server must be started with
``--max-logprobs`` >= the vocabulary size (or ``-1``), else it refuses the request.

What the server gives is log-probabilities, not raw logits: the run records
``logits_kind: "log_softmax"`` and the logits comparator log-softmaxes the references before
comparing (``capturestore.comparators.logits``). The server clamps ``-inf`` to ``-9999.0`` in
its JSON; that value is read back as ``-inf`` (a masked token).

No KV cache and no module tensors: the HTTP API does not expose them. A server started with
``--worker-extension-cls extractors.vllm_rpc.KVCaptureWorkerExtension`` carries the capture
worker extension, but nothing in the OpenAI API calls its methods, so this module captures
logits only (docs/vllm_server.md).

Checks before anything is stored (one-line ``ValueError``): the URL answers (else the line names
it), the server serves ``model_path`` (its ``root`` is the same directory, or a directory with
the same weights and config, ``extractors.models.model_content_hash``), every prompt fits the
server's ``max_model_len``, and every answered position holds the whole vocabulary.

Only the standard library talks HTTP here; vLLM need not be installed on this side.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["ServerInfo", "capture_vllm_server_run", "check_server", "server_teacher_forced_logprobs"]

CLAMPED_NEG_INF = -9999.0  # vllm.entrypoints...clamp_prompt_logprobs writes -inf as this
ENGINE = "vllm-server"


class ServerInfo(dict):
    """What ``check_server`` learned: ``url``, ``served_model_name``, ``root``, ``max_model_len``,
    ``version`` (vLLM's), ``vocab_size`` (of ``model_path``)."""


def base_url(url: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValueError("vLLM server URL is empty; give e.g. http://127.0.0.1:8000")
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    if not u.startswith(("http://", "https://")):
        u = "http://" + u
    return u


def request_json(base: str, path: str, payload: dict | None = None, timeout: float = 30.0) -> tuple[dict, int]:
    """(decoded JSON, bytes received) of GET (payload None) or POST ``base + path``; one-line ValueError."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            err = json.loads(detail)
            detail = (err.get("error") or {}).get("message") or err.get("message") or detail
        except (ValueError, AttributeError):
            pass
        raise ValueError(f"vLLM server {base}: {path} answered HTTP {e.code}: {' '.join(str(detail).split())[:300]}") \
            from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", None) or e
        raise ValueError(f"vLLM server {base} is unreachable ({why}); start it with `vllm serve MODEL_DIR "
                         f"--max-logprobs -1` (docs/vllm_server.md)") from None
    try:
        return json.loads(body), len(body)
    except ValueError:
        raise ValueError(f"vLLM server {base}: {path} answered {len(body)} bytes that are not JSON: "
                         f"{body[:80]!r}") from None


def _vocab_size(model_path: Path) -> int:
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model {model_path}: cannot read config.json ({e})") from None
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"model {model_path}: config.json has no vocab_size")
    return vocab


def _same_model(root: str, model_path: Path) -> bool:
    served = Path(root).expanduser()
    try:
        if served.resolve() == model_path.resolve():
            return True
    except OSError:
        return False
    if not (served / "config.json").is_file():
        return False
    from extractors.models import model_content_hash

    return model_content_hash(served) == model_content_hash(model_path)


def check_server(url: str, model_path, *, timeout: float = 10.0) -> ServerInfo:
    """Check that ``url`` answers and serves ``model_path`` (see the module docstring)."""
    base = base_url(url)
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise ValueError(f"model directory {model_path} has no config.json")
    models, _ = request_json(base, "/v1/models", timeout=timeout)
    cards = (models.get("data") or []) if isinstance(models, dict) else []
    if not cards:
        raise ValueError(f"vLLM server {base}: /v1/models lists no model")
    base_cards = [c for c in cards if not c.get("parent")]  # LoRA adapters name a parent
    card = next((c for c in base_cards if _same_model(str(c.get("root") or c.get("id")), model_path)), None)
    if card is None:
        served = ", ".join(f"{c.get('id')!r} (root {c.get('root')!r})" for c in base_cards)
        raise ValueError(f"vLLM server {base} serves {served}, not the model {model_path} (neither the same "
                         f"directory nor the same weights and config)")
    try:
        version = request_json(base, "/version", timeout=timeout)[0].get("version")
    except ValueError:
        version = None
    return ServerInfo(url=base, served_model_name=card["id"], root=card.get("root"),
                      max_model_len=card.get("max_model_len"), version=version, vocab_size=_vocab_size(model_path))


def _dense(prompt_logprobs, positions: range, vocab: int, where: str) -> np.ndarray:
    """``[len(positions), vocab]`` float32 from the JSON ``prompt_logprobs`` (list of {token id: {logprob}})."""
    out = np.empty((len(positions), vocab), dtype=np.float32)
    for i, p in enumerate(positions):
        d = prompt_logprobs[p] if p < len(prompt_logprobs) else None
        if d is None or len(d) != vocab:
            n = 0 if d is None else len(d)
            raise ValueError(f"{where}, position {p}: the server returned {n} logprobs for a vocabulary of {vocab}; "
                             f"start `vllm serve` with --max-logprobs -1 (or >= {vocab})")
        ids = np.fromiter((int(k) for k in d), dtype=np.int64, count=vocab)
        vals = np.fromiter((v["logprob"] for v in d.values()), dtype=np.float64, count=vocab)
        if len(np.unique(ids)) != vocab or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"{where}, position {p}: the server's token ids do not cover [0, {vocab}) once each")
        vals[vals == CLAMPED_NEG_INF] = -np.inf
        out[i, ids] = vals
    return out


def server_teacher_forced_logprobs(info: ServerInfo, prompts: Sequence[Sequence[int]],
                                   teacher_tokens: Sequence[Sequence[int]], *, concurrency: int = 4,
                                   timeout: float = 300.0, report: dict | None = None) -> list[np.ndarray]:
    """Full-vocabulary teacher-forced log-softmax ``[teacher_token, vocab]`` float32 per prompt, from
    the server ``info`` describes (``check_server``); ``concurrency`` requests in flight.
    ``report`` (a dict, if given) gains ``http_s`` (wall seconds of the requests), ``parse_s`` and
    ``bytes`` (response bytes received)."""
    vocab = int(info["vocab_size"])
    rows = list(zip(prompts, teacher_tokens))
    stats = report if report is not None else {}
    for k in ("http_s", "parse_s", "bytes"):
        stats.setdefault(k, 0)

    def one(i: int):
        p, t = rows[i]
        ids = p + t
        payload = {"model": info["served_model_name"], "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": vocab, "return_token_ids": True}
        return request_json(info["url"], "/v1/completions", payload, timeout=timeout)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, int(concurrency))) as pool:
        answers = list(pool.map(one, range(len(rows))))
    stats["http_s"] += time.perf_counter() - t0
    out = []
    t0 = time.perf_counter()
    for i, ((p, t), (ans, nbytes)) in enumerate(zip(rows, answers)):
        stats["bytes"] += nbytes
        where = f"vLLM server {info['url']}, prompt {i}"
        choice = (ans.get("choices") or [None])[0]
        if not choice or choice.get("prompt_logprobs") is None:
            raise ValueError(f"{where}: the answer holds no prompt_logprobs")
        got = choice.get("prompt_token_ids")
        sent = p + t
        if got is not None and list(got) != sent:
            first = next((j for j, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
            raise ValueError(f"{where}: the server ran {len(got)} prompt tokens, not the {len(sent)} sent "
                             f"(first difference at {first})")
        out.append(_dense(choice["prompt_logprobs"], range(len(p), len(p) + len(t)), vocab, where))
    stats["parse_s"] += time.perf_counter() - t0
    return out


def capture_vllm_server_run(store, url: str, model_path, prompts: Sequence[Sequence[int]],
                            teacher_tokens: Sequence[Sequence[int]], *, model_hash: str | None = None,
                            release: str | None = None, config: dict | None = None, dtype: str | None = None,
                            batch_size: int = 16, concurrency: int = 4, report: dict | None = None) -> str:
    """Teacher-forced full-vocabulary logprobs of ``prompts`` from the vLLM server at ``url`` into
    ``store``; returns the run id.

    Per prompt: tokens = prompt + teacher tokens; logits ``[teacher_token, vocab]`` float32 =
    the server's log-softmax predicting each teacher token (run config ``logits_kind:
    "log_softmax"``, ``capture: "teacher_forced_prefill"``). No KV (see the module docstring).
    The run records engine ``vllm-server``, the server's vLLM version, URL, served model name
    and ``dtype`` (the server's dtype, which its API does not say: pass it; default
    ``"unknown"``). Every check (server, model, prompt lengths) runs before the run begins, so
    a refused capture stores nothing; ``batch_size`` prompts are fetched at a time.
    ``report`` receives ``http_s``, ``parse_s``, ``store_s`` and ``bytes``.
    """
    from capturestore.capture import begin_capture_run, write_prompt_capture
    from extractors.vllm_logits import check_forcing_inputs

    if batch_size < 1:
        raise ValueError(f"capture_vllm_server_run: batch_size must be >= 1, got {batch_size}")
    info = check_server(url, model_path)
    max_len = int(info["max_model_len"]) if info.get("max_model_len") else 1 << 62
    prompts, teacher_tokens = check_forcing_inputs(prompts, teacher_tokens, int(info["vocab_size"]), max_len,
                                                   f"vLLM server {info['url']}")
    stats = report if report is not None else {}
    stats.update(http_s=0.0, parse_s=0.0, store_s=0.0, bytes=0)
    if model_hash is None:
        from extractors.models import model_content_hash

        model_hash = model_content_hash(model_path)
    meta = {
        "server_url": info["url"], "served_model_name": info["served_model_name"], "served_root": info["root"],
        "max_model_len": info["max_model_len"], "teacher_forced": True,
        "logits_layout": "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j; full-vocabulary "
                         "log-softmax from the server's prompt_logprobs (-9999.0 read as -inf)",
        **(config or {}),
    }
    run = begin_capture_run(store, engine=ENGINE, capture="teacher_forced_prefill", prompts=prompts,
                            layer_names=None, logits_kind="log_softmax", config=meta, model_path=str(model_path),
                            model_hash=model_hash, dtype=dtype or "unknown", device="server",
                            engine_version=info["version"], release=release)
    with run:
        for lo in range(0, len(prompts), batch_size):
            bp, bt = prompts[lo:lo + batch_size], teacher_tokens[lo:lo + batch_size]
            rows = server_teacher_forced_logprobs(info, bp, bt, concurrency=concurrency, report=stats)
            t0 = time.perf_counter()
            for p, t, lp in zip(bp, bt, rows):
                write_prompt_capture(run, p, t, lp)
            stats["store_s"] += time.perf_counter() - t0
        return run.run_id
