"""Shared test configuration.

Tests marked ``vllm`` need the real vllm-cpu engine. CI installs it (``make test`` bootstraps
``.[all]``); where it is missing they are skipped and ``-ra`` prints the reason.
"""
import importlib.util
import os

import pytest

# Engines never reach a hub from tests: every model is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm-cpu is not installed (make test installs it: pip install -e '.[vllm]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
