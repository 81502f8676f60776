"""Platform resolution, FP8_CLAMP_MAX and kv_cache_dtype strings."""
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from nki_fp8.formats import (
    PLATFORM_ENV_VAR,
    VALID_KV_CACHE_DTYPES,
    fp8_clamp_max,
    kv_cache_dtype_str_to_dtype,
    resolve_platform,
)


def test_platform_defaults_to_trn2_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(PLATFORM_ENV_VAR, raising=False)
    assert resolve_platform() == "trn2" and fp8_clamp_max() == 240.0
    monkeypatch.setenv(PLATFORM_ENV_VAR, "TRN3")
    assert resolve_platform() == "trn3" and fp8_clamp_max() == 448.0
    assert fp8_clamp_max("trn2") == 240.0  # an argument wins over the environment


def test_unknown_platform_is_refused_naming_the_source(monkeypatch):
    with pytest.raises(ValueError, match=r"platform='trn1'.*\['trn2', 'trn3'\]"):
        resolve_platform("trn1")
    monkeypatch.setenv(PLATFORM_ENV_VAR, "h100")
    with pytest.raises(ValueError, match=r"\$NKI_FP8_PLATFORM='h100'"):
        fp8_clamp_max()


@pytest.mark.parametrize("env,want", [(None, "240.0"), ("trn3", "448.0")])
def test_fp8_clamp_max_follows_the_environment_of_a_fresh_process(env, want):
    e = {k: v for k, v in os.environ.items() if k != PLATFORM_ENV_VAR}
    if env:
        e[PLATFORM_ENV_VAR] = env
    out = subprocess.run(
        [sys.executable, "-c", "from nki_fp8.formats import FP8_CLAMP_MAX; print(FP8_CLAMP_MAX)"],
        env=e, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
    )
    assert out.stdout.strip() == want


def test_a_bad_platform_variable_fails_its_use_not_the_import():
    """``import nki_fp8`` (and everything that imports it, the CLI included) works whatever
    $NKI_FP8_PLATFORM holds; reading FP8_CLAMP_MAX or resolving the platform then fails, naming
    the variable, and an explicit platform= still works."""
    e = {**os.environ, PLATFORM_ENV_VAR: "h100"}
    code = (
        "import nki_fp8, nki_fp8.formats as f, capturestore.cli\n"
        "print(nki_fp8.fp8_clamp_max('trn3'))\n"
        "for get in (lambda: nki_fp8.FP8_CLAMP_MAX, lambda: f.FP8_CLAMP_MAX, nki_fp8.resolve_platform):\n"
        "    try:\n"
        "        get()\n"
        "    except ValueError as err:\n"
        "        print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "448.0" and len(lines) == 4
    assert all("$NKI_FP8_PLATFORM='h100'" in line for line in lines[1:]), lines


def test_fp8_clamp_max_is_read_when_used(monkeypatch):
    import nki_fp8
    from nki_fp8 import formats

    monkeypatch.setenv(PLATFORM_ENV_VAR, "trn3")
    assert nki_fp8.FP8_CLAMP_MAX == formats.FP8_CLAMP_MAX == 448.0
    monkeypatch.setenv(PLATFORM_ENV_VAR, "trn2")
    assert nki_fp8.FP8_CLAMP_MAX == 240.0
    with pytest.raises(AttributeError, match="no attribute 'FP8_CLAMP_MIN'"):
        nki_fp8.FP8_CLAMP_MIN  # noqa: B018


def test_kv_cache_dtype_strings_resolve_like_vllm_neuron():
    assert VALID_KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "float32", "float16", "bfloat16")
    for name in ("fp8", "fp8_e4m3"):
        d2 = kv_cache_dtype_str_to_dtype(name, platform="trn2")
        d3 = kv_cache_dtype_str_to_dtype(name, platform="trn3")
        assert d2.is_fp8 and d2.bytes_per_value == 1 and d2.torch_dtype_name == "float8_e4m3fn"
        assert d2.numpy_dtype == np.dtype(ml_dtypes.float8_e4m3) and d2.fp8.max_finite == 240.0
        assert d3.numpy_dtype == np.dtype(ml_dtypes.float8_e4m3fn) and d3.fp8.max_finite == 448.0
    assert kv_cache_dtype_str_to_dtype("auto", "bfloat16").bytes_per_value == 2
    assert kv_cache_dtype_str_to_dtype("auto", "torch.float32").numpy_dtype == np.float32
    assert kv_cache_dtype_str_to_dtype("float16").bytes_per_value == 2
    assert not kv_cache_dtype_str_to_dtype("bfloat16").is_fp8


@pytest.mark.parametrize("bad", ["fp8_e5m2", "FP8", "int8", "", None])
def test_other_kv_cache_dtypes_are_refused_with_the_valid_list(bad):
    with pytest.raises(ValueError) as e:
        kv_cache_dtype_str_to_dtype(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    assert all(repr(v) in msg for v in VALID_KV_CACHE_DTYPES)
