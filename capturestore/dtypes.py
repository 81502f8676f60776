"""Logical dtypes of captures and their bit-exact storage form.

Zarr has no bfloat16 or float8 type, so those are stored as their raw bits (uint16 / uint8) and
the logical dtype is recorded in the array's attributes. Everything here is pure numpy; torch is
only touched when the caller hands in (or asks for) torch tensors, and is detected by duck typing
so that importing this module never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class LogicalDtype:
    """One supported capture dtype: its name, numpy (ml_dtypes) dtype and on-disk dtype."""

    name: str
    numpy: np.dtype
    storage: np.dtype
    torch_name: str | None  # attribute of the torch module, None where torch has no such dtype
    is_float: bool


def _ld(name: str, numpy_dtype: Any, storage: Any, torch_name: str | None, is_float: bool) -> LogicalDtype:
    return LogicalDtype(name, np.dtype(numpy_dtype), np.dtype(storage), torch_name, is_float)


LOGICAL_DTYPES: dict[str, LogicalDtype] = {
    d.name: d
    for d in (
        _ld("float32", np.float32, np.float32, "float32", True),
        _ld("float16", np.float16, np.float16, "float16", True),
        _ld("bfloat16", ml_dtypes.bfloat16, np.uint16, "bfloat16", True),
        _ld("float8_e4m3fn", ml_dtypes.float8_e4m3fn, np.uint8, "float8_e4m3fn", True),
        # IEEE-style e4m3 (has inf, bias 7): ml_dtypes has it, torch 2.13 does not.
        _ld("float8_e4m3", ml_dtypes.float8_e4m3, np.uint8, None, True),
        _ld("float8_e5m2", ml_dtypes.float8_e5m2, np.uint8, "float8_e5m2", True),
        _ld("int8", np.int8, np.int8, "int8", False),
        _ld("uint8", np.uint8, np.uint8, "uint8", False),
        _ld("int16", np.int16, np.int16, "int16", False),
        _ld("int32", np.int32, np.int32, "int32", False),
        _ld("int64", np.int64, np.int64, "int64", False),
        _ld("bool", np.bool_, np.bool_, "bool", False),
    )
}

FLOAT_DTYPES = tuple(n for n, d in LOGICAL_DTYPES.items() if d.is_float)

# torch dtypes whose numpy conversion goes through a same-width integer view.
_TORCH_BIT_VIEWS = {
    "bfloat16": ("int16", np.uint16),
    "float8_e4m3fn": ("uint8", np.uint8),
    "float8_e5m2": ("uint8", np.uint8),
}


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor, decided without importing torch."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


# the first name of each numpy dtype, looked up by the dtype (a module capture asks ~150 times a prompt)
_NAME_OF_NUMPY = {d.numpy: n for n, d in reversed(LOGICAL_DTYPES.items())}


def logical_dtype_name(x: np.ndarray) -> str | None:
    """Name of the logical dtype of a numpy array, or None if it is not a supported one."""
    name = _NAME_OF_NUMPY.get(x.dtype)
    if name is not None:
        return name
    for name, d in LOGICAL_DTYPES.items():  # a dtype equal to one of ours that hashes apart from it
        if x.dtype == d.numpy:
            return name
    return None


_TORCH_DTYPE_NAMES: dict = {}  # torch dtype -> its name without "torch." (str() of a dtype is ~1 us)


def to_numpy(x: Any, what: str) -> np.ndarray:
    """A numpy view (no copy where possible) of a numpy array or torch tensor.

    bf16/fp8 torch tensors come back with the matching ml_dtypes dtype, bit for bit.
    Raises ValueError naming ``what`` for inputs that are neither.
    """
    if is_torch_tensor(x):
        t = x.detach()
        if not t.is_cpu:
            t = t.cpu()
        t = t.contiguous()
        tname = _TORCH_DTYPE_NAMES.get(t.dtype)
        if tname is None:
            tname = _TORCH_DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
        if tname in _TORCH_BIT_VIEWS:
            import torch

            int_name, storage = _TORCH_BIT_VIEWS[tname]
            bits = t.view(getattr(torch, int_name)).numpy().view(storage)
            return bits.view(LOGICAL_DTYPES[tname].numpy)
        try:
            return t.numpy()
        except TypeError as e:
            raise ValueError(f"{what}: torch dtype {t.dtype} cannot be stored ({e})") from None
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)) or np.isscalar(x):
        return np.asarray(x)
    raise ValueError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def check_dtype(x: np.ndarray, what: str, allowed: tuple[str, ...] | None = None) -> LogicalDtype:
    """The LogicalDtype of ``x``; ValueError naming ``what`` if unsupported or not allowed."""
    name = logical_dtype_name(x)
    allowed_names = allowed if allowed is not None else tuple(LOGICAL_DTYPES)
    if name is None or name not in allowed_names:
        hint = " (cast float64 to float32 first)" if x.dtype == np.float64 else ""
        raise ValueError(
            f"{what}: dtype {x.dtype} is not supported{hint}; supported: {', '.join(allowed_names)}"
        )
    return LOGICAL_DTYPES[name]


def to_storage(x: np.ndarray, ld: LogicalDtype) -> np.ndarray:
    """The bits of ``x`` as the storage dtype (a view, no copy)."""
    return x.view(ld.storage) if ld.storage != ld.numpy else x


def from_storage(bits: np.ndarray, logical: str, as_torch: bool, what: str) -> Any:
    """Reinterpret stored bits as the logical dtype; numpy (ml_dtypes) or torch."""
    ld = LOGICAL_DTYPES[logical]
    arr = bits.view(ld.numpy) if ld.storage != ld.numpy else bits
    if not as_torch:
        return arr
    import torch

    if ld.torch_name is None:
        raise ValueError(
            f"{what}: logical dtype {logical} has no torch equivalent in torch {torch.__version__}; "
            "read it with as_torch=False (ml_dtypes) instead"
        )
    if logical in _TORCH_BIT_VIEWS:
        int_name, _ = _TORCH_BIT_VIEWS[logical]
        as_int = np.ascontiguousarray(bits).view(np.dtype(int_name))
        return torch.from_numpy(as_int).view(getattr(torch, ld.torch_name))
    return torch.from_numpy(np.ascontiguousarray(arr))
