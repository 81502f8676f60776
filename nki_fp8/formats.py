"""FP8 formats of the Neuron platforms, the clamp bound, and `kv_cache_dtype` strings.

Two E4M3 encodings share one bit layout (sign, 4 exponent bits, bias 7, 3 mantissa bits) and
differ only in what the all-ones exponent means:

| platform | format | largest finite | exponent 1111 | numpy dtype |
|---|---|---|---|---|
| trn2 | IEEE-style E4M3 | 240 | inf (mantissa 0) / NaN | `ml_dtypes.float8_e4m3` |
| trn3 | OCP E4M3FN      | 448 | finite 256..448, NaN at mantissa 111 | `ml_dtypes.float8_e4m3fn` |

Below 240 the two encodings are bit-identical (same bias, same subnormals 2^-9 * m). That is why
vLLM Neuron can keep `torch.float8_e4m3fn` tensors on TRN2 (compiler flag
`--experimental-unsafe-fp8e4m3fn-as-fp8e4m3`) provided every value is clamped to +-240 before the
cast: `FP8_CLAMP_MAX` is that clamp bound.

The platform comes from an argument, else the environment variable ``NKI_FP8_PLATFORM``
("trn2" | "trn3"), else "trn2", read each time it is used: `FP8_CLAMP_MAX` (a module attribute
resolved on access) and functions without ``platform=`` read the variable then, so importing
never fails on a bad value; the use does, naming the variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np

PLATFORM_ENV_VAR = "NKI_FP8_PLATFORM"
DEFAULT_PLATFORM = "trn2"


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its name, numpy dtype, largest finite value and torch counterpart."""

    name: str
    numpy_dtype: np.dtype
    max_finite: float
    torch_dtype_name: str | None  # exact torch dtype with the same value set, if torch has one
    has_inf: bool

    @property
    def min_normal(self) -> float:
        return 2.0**-6

    @property
    def min_subnormal(self) -> float:
        return 2.0**-9

    @property
    def mantissa_bits(self) -> int:
        return 3


E4M3 = Fp8Format("float8_e4m3", np.dtype(ml_dtypes.float8_e4m3), 240.0, None, True)
E4M3FN = Fp8Format("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), 448.0, "float8_e4m3fn", False)

PLATFORM_FORMATS: dict[str, Fp8Format] = {"trn2": E4M3, "trn3": E4M3FN}


def resolve_platform(platform: str | None = None) -> str:
    """The platform name: the argument, else $NKI_FP8_PLATFORM, else "trn2"; unknown names refused."""
    name = platform if platform is not None else os.environ.get(PLATFORM_ENV_VAR, DEFAULT_PLATFORM)
    key = str(name).strip().lower()
    if key not in PLATFORM_FORMATS:
        source = "argument platform=" if platform is not None else f"${PLATFORM_ENV_VAR}="
        raise ValueError(
            f"unknown FP8 platform {source}{name!r}; valid platforms: {sorted(PLATFORM_FORMATS)}"
        )
    return key


def fp8_format(platform: str | None = None) -> Fp8Format:
    """The FP8 encoding of `platform` (trn2 -> E4M3 max 240, trn3 -> E4M3FN max 448)."""
    return PLATFORM_FORMATS[resolve_platform(platform)]


def fp8_clamp_max(platform: str | None = None) -> float:
    """The bound every K/V value is clamped to before the FP8 cast on `platform`."""
    return fp8_format(platform).max_finite


def __getattr__(name: str):
    """``FP8_CLAMP_MAX``: the clamp bound of $NKI_FP8_PLATFORM, read when it is used (not at
    import, so a bad value fails the use, with the variable named, not ``import nki_fp8``)."""
    if name == "FP8_CLAMP_MAX":
        return fp8_clamp_max()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- kv_cache_dtype strings (vllm_neuron.utils.dtype_utils) ---------------------------------
QUANTIZED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_UNQUANTIZED = {
    "float32": (np.dtype(np.float32), "float32", 4),
    "float16": (np.dtype(np.float16), "float16", 2),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "bfloat16", 2),
}
VALID_KV_CACHE_DTYPES = ("auto", *QUANTIZED_KV_CACHE_DTYPES, *_UNQUANTIZED)


@dataclass(frozen=True)
class KVCacheDtype:
    """What a `kv_cache_dtype` string resolves to.

    `torch_dtype_name` is the dtype of the cache tensors as vLLM Neuron allocates them: FP8 is
    always `float8_e4m3fn` (on TRN2 its bits are read as E4M3, valid because of the 240 clamp).
    `numpy_dtype` is the value set the hardware actually holds (E4M3 on trn2, E4M3FN on trn3).
    """

    name: str
    numpy_dtype: np.dtype
    torch_dtype_name: str
    bytes_per_value: int
    is_fp8: bool
    fp8: Fp8Format | None


def kv_cache_dtype_str_to_dtype(
    kv_cache_dtype: str, model_dtype: str = "bfloat16", platform: str | None = None
) -> KVCacheDtype:
    """Resolve a vLLM `kv_cache_dtype` string; "auto" means the model dtype.

    Anything outside ("auto", "fp8", "fp8_e4m3", "float32", "float16", "bfloat16") is refused
    with the list of valid values.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in VALID_KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv_cache_dtype {kv_cache_dtype!r}; valid values: {list(VALID_KV_CACHE_DTYPES)}"
        )
    name = kv_cache_dtype
    if name == "auto":
        name = str(model_dtype).removeprefix("torch.")
        if name not in _UNQUANTIZED:
            raise ValueError(
                f"kv_cache_dtype='auto' resolves to the model dtype {model_dtype!r}, which is not one of "
                f"{sorted(_UNQUANTIZED)}"
            )
    if name in QUANTIZED_KV_CACHE_DTYPES:
        fmt = fp8_format(platform)
        return KVCacheDtype(kv_cache_dtype, fmt.numpy_dtype, "float8_e4m3fn", 1, True, fmt)
    np_dtype, torch_name, nbytes = _UNQUANTIZED[name]
    return KVCacheDtype(name, np_dtype, torch_name, nbytes, False, None)
