"""Shared fixtures for tests/extractors: tiny local models, built once and cached on disk.

Use the factory fixture in tests::

    def test_something(tiny_model):
        path = tiny_model("llama-gqa")          # Path to a cached model directory

or ``tiny_arch`` (parametrised over every arch in ``TINY_ARCHS``) for per-arch tests.
Outside this directory (module-level code, other test packages, subprocess scripts) call
``extractors.models.tiny_model(arch, seed=0)`` directly, or ``tiny_model_path`` from here.
Models are cached under ``$CAPTURESTORE_CACHE/tiny-models`` (default ``~/.cache/capturestore``),
so concurrent pytest processes share one build.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from extractors.models import TINY_ARCHS
from extractors.models import tiny_model as _cached_tiny_model


def tiny_model_path(arch: str, seed: int = 0) -> Path:
    """Path of the cached tiny model ``arch`` (built on first use); skips if transformers is absent."""
    pytest.importorskip("transformers", reason="tiny models need transformers (pip install -e '.[hf]')")
    return _cached_tiny_model(arch, seed=seed)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: ``tiny_model(arch, seed=0) -> Path``."""
    return tiny_model_path


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_arch(request):
    """``(arch, path)`` for every supported tiny arch."""
    return request.param, tiny_model_path(request.param)
