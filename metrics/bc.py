"""Bhattacharyya coefficient (BC) between two error samples, single and batched.

Definition (reference/000, upstream ``_compute_bc``): ``bins`` equal-width bins over the joint
``[min, max]`` of both samples, ``p = h / (sum(h) + 1e-10)``, ``BC = clip(sum(sqrt(p*q)), 0, 1)``,
0.0 when either sample is empty. Callers pass absolute errors (``|x - baseline|``); the samples
are binned as given. BC ~ 1 means the two error distributions overlap completely (the target's
errors look like dtype noise), BC -> 0 means they do not overlap at all.

Bin edges are exactly the ones the upstream gets from ``np.linspace(lo, hi, bins + 1)`` in the
samples' dtype (float32 for float32 errors under NumPy 2), with ``np.histogram``'s rule: bin i
holds ``edge_i <= x < edge_{i+1}``, the last bin also holds ``hi``; when ``lo == hi`` every value
falls in the last bin (so two all-zero samples give BC ~ 1). The batched form reproduces this
per row without a Python loop: an arithmetic bin estimate, corrected against the edges.
NaN values are excluded from a sample (they never reach a bin).
"""
from __future__ import annotations

import numpy as np

from .errors import to_numpy

__all__ = ["bhattacharyya_coefficient", "bhattacharyya_batched", "DEFAULT_BINS"]

DEFAULT_BINS = 100
_NORM_EPS = 1e-10
_CHUNK_ELEMS = 1 << 20  # values binned per step: keeps temporaries cache-sized


def _float_samples(x) -> np.ndarray:
    a = to_numpy(x)
    if a.dtype == np.float64 or a.dtype == np.float32:
        return a
    if a.dtype.name == "bfloat16":
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def bhattacharyya_coefficient(a, b, bins: int = DEFAULT_BINS) -> float:
    """BC between two 1-D samples ``a: [n_a]`` and ``b: [n_b]`` (any shape is flattened)."""
    a = _float_samples(a).reshape(1, -1)
    b = _float_samples(b).reshape(1, -1)
    return float(bhattacharyya_batched(a, b, bins=bins)[0])


def bhattacharyya_batched(a, b, bins: int = DEFAULT_BINS, backend: str = "auto") -> np.ndarray:
    """Many BCs at once, one per leading index.

    a: ``[..., n_a]``, b: ``[..., n_b]`` with the same leading shape (e.g. ``[token, layer]``).
    Returns ``[...]`` float64. A row where either side has no value left (empty or all-NaN)
    gets 0.0, as the upstream does for empty samples; a row holding an infinite value gets NaN.
    backend: "auto" counts bins with the numba kernel of ``metrics._fused`` when numba imports
    (same counts, hence the same BC bit for bit), "numba" always, "numpy" never.
    """
    if backend not in ("auto", "numba", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    fused = backend == "numba" or (backend == "auto" and numba_available())
    a = _float_samples(a)
    b = _float_samples(b)
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"BC batch shapes differ: a {a.shape} vs b {b.shape} (leading dims must match)")
    lead = a.shape[:-1]
    dtype = np.result_type(a.dtype, b.dtype)
    nrows = int(np.prod(lead, dtype=np.int64))
    a2 = a.reshape(nrows, a.shape[-1]).astype(dtype, copy=False)
    b2 = b.reshape(nrows, b.shape[-1]).astype(dtype, copy=False)
    out = np.zeros(nrows, dtype=np.float64)
    if nrows == 0:
        return out.reshape(lead)
    per_row = max(1, a2.shape[1] + b2.shape[1])
    step = max(1, _CHUNK_ELEMS // per_row)
    for r0 in range(0, nrows, step):
        r1 = min(nrows, r0 + step)
        out[r0:r1] = bc_grouped(a2[r0:r1], b2[r0:r1], (1,), bins, fused=fused)
    return out.reshape(lead)


_NUMBA_OK = None


def numba_available() -> bool:
    """Whether the fused kernels (``metrics._fused``, numba) import; checked once."""
    global _NUMBA_OK
    if _NUMBA_OK is None:
        try:
            from . import _fused  # noqa: F401 - compiles nothing until first use
            _NUMBA_OK = True
        except Exception:  # noqa: BLE001 - a numba that fails to import is no numba
            _NUMBA_OK = False
    return _NUMBA_OK


def bc_grouped(a: np.ndarray, b: np.ndarray, sample_axes, bins: int = DEFAULT_BINS, minmax=None, fused=False) -> np.ndarray:
    """BC per group, where a group is one index of the axes *not* in ``sample_axes``.

    a, b: float32/float64 arrays of one dtype that agree on every non-sample axis, e.g.
    errors ``[batch, kv_head, seq, head_dim]`` with ``sample_axes=(1, 3)`` -> BC ``[batch, seq]``
    over heads x head_dim, with no transposed copy. Same definition and edge cases as
    ``bhattacharyya_batched``. minmax: optional ``(a_min, a_max, b_min, b_max)`` per group with
    the sample axes kept as size 1, when the caller already has them (NaN-free data only).
    fused: count 2-D ``[group, sample]`` inputs with ``metrics._fused.hist_counts``.
    """
    axes = tuple(ax % a.ndim for ax in sample_axes)
    kept = tuple(n for i, n in enumerate(a.shape) if i not in axes)
    if tuple(n for i, n in enumerate(b.shape) if i not in axes) != kept:
        raise ValueError(f"BC groups differ: a {a.shape} vs b {b.shape} outside sample axes {axes}")
    dtype = np.result_type(a.dtype, b.dtype).type
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    nrows = int(np.prod(kept, dtype=np.int64))
    if nrows == 0:
        return np.zeros(kept)
    with np.errstate(invalid="ignore"):
        if minmax is not None:
            a_min, a_max, b_min, b_max = (np.asarray(m, dtype) for m in minmax)
            a_nan = b_nan = False
        else:
            a_min, a_max, a_nan = _minmax(a, axes)
            b_min, b_max, b_nan = _minmax(b, axes)
        ok = ~np.isnan(a_min) & ~np.isnan(b_min)  # both sides hold at least one value
        lo = np.fmin(a_min, b_min)
        hi = np.fmax(a_max, b_max)
    finite = np.isfinite(lo) & np.isfinite(hi)
    good = ok & finite
    lo = np.where(good, lo, 0).astype(dtype)
    hi = np.where(good, hi, 0).astype(dtype)
    # Bin edges exactly as np.linspace(lo, hi, bins + 1) in this dtype: edge_k = k*step + lo.
    width = (hi - lo).astype(dtype)
    step = (width / dtype(bins)).astype(dtype)
    flat = step == 0  # lo == hi: np.histogram puts every value in the last bin
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(flat, 0, dtype(bins) / np.where(flat, 1, width)).astype(dtype)
        # How far (in bins) rounding can move an edge or the estimate: values closer than this
        # to an integer bin position are checked against the real edges.
        ulp = np.spacing(np.maximum(np.abs(lo), np.abs(hi))).astype(np.float64)
        eps = np.where(flat, 0.0, 4 * ulp / np.where(flat, 1, step) + 1e-4).astype(dtype)
    # A subnormal-wide range overflows bins / width: no estimate, every value walks the edges
    # from bin 0 (eps 1 makes every value a candidate).
    blind = ~np.isfinite(scale)
    if blind.any():
        scale = np.where(blind, 0, scale).astype(dtype)
        eps = np.where(blind, 1, eps).astype(dtype)
    off_dtype = dtype if nrows * bins < (1 << 24) else np.float64
    row_off = (np.arange(nrows, dtype=off_dtype) * bins).reshape(lo.shape)
    bad_rows = not good.all()
    if fused and a.ndim == 2 and axes == (1,):
        from . import _fused

        ha = _fused.hist_counts(a, lo, step, scale, bins)
        hb = _fused.hist_counts(b, lo, step, scale, bins)
    else:
        ha = _counts(a, lo, step, scale, flat, eps, row_off, bins, nrows, bool(a_nan) or bad_rows)
        hb = _counts(b, lo, step, scale, flat, eps, row_off, bins, nrows, bool(b_nan) or bad_rows)
    p = ha / (ha.sum(axis=1, keepdims=True) + _NORM_EPS)
    q = hb / (hb.sum(axis=1, keepdims=True) + _NORM_EPS)
    bc = np.clip(np.sqrt(p * q).sum(axis=1), 0.0, 1.0).reshape(kept)
    # An infinite error has no finite bin range (np.histogram raises on it): report NaN.
    ok, finite = ok.reshape(kept), finite.reshape(kept)
    return np.where(ok, np.where(finite, bc, np.nan), 0.0)


def _minmax(x, axes):
    """Group min/max ignoring NaN (keepdims), and whether any NaN was seen."""
    if any(x.shape[ax] == 0 for ax in axes):
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        return np.full(shape, np.nan, x.dtype), np.full(shape, np.nan, x.dtype), False
    m = np.min(x, axis=axes, keepdims=True)
    M = np.max(x, axis=axes, keepdims=True)
    has_nan = bool(np.isnan(m).any())  # np.min propagates NaN: only then pay for fmin
    if has_nan:
        with np.errstate(all="ignore"):
            m = np.fmin.reduce(x, axis=axes, keepdims=True)
            M = np.fmax.reduce(x, axis=axes, keepdims=True)
    return m, M, has_nan


def _counts(x, lo, step, scale, flat, eps, row_off, bins, nrows, maybe_bad):
    """Histogram counts ``[nrows, bins]`` of every group of x (np.histogram's bin rule:
    bin = last edge <= x, the last bin closed)."""
    if x.size == 0:
        return np.zeros((nrows, bins), np.int64)
    dtype = x.dtype.type
    with np.errstate(invalid="ignore", over="ignore"):
        t = x - lo
        t *= scale
        fl = np.floor(t)
        t -= fl  # fractional bin position
        t -= dtype(0.5)
        np.abs(t, out=t)
        cand = t > (dtype(0.5) - eps)  # within eps of an edge: check against the real edges
        np.clip(fl, 0, bins - 1, out=fl)
    if flat.any():
        fl = np.where(flat, dtype(bins - 1), fl)
    bad = ~np.isfinite(x) if maybe_bad else None
    if bad is not None:
        cand &= ~bad
    fi = np.flatnonzero(cand)  # rare; np.nonzero on N-d arrays is several times slower
    if fi.size:
        mi = np.unravel_index(fi, x.shape)
        gi = tuple(m if lo.shape[d] != 1 else np.zeros_like(m) for d, m in enumerate(mi))
        xs, lo_s, st_s = x[mi], lo[gi], step[gi]
        k = fl[mi]
        for _ in range(bins + 1):  # one step almost always; more only when edges collapse
            with np.errstate(invalid="ignore"):
                dec = (xs < k * st_s + lo_s) & (k > 0)
                inc = ~dec & (k < bins - 1) & (xs >= (k + 1) * st_s + lo_s)
            if not (dec.any() or inc.any()):
                break
            k = k - dec + inc
        fl[mi] = k
    fl += row_off
    if bad is not None:
        fl[bad] = 0
    # float32 -> int32 is a SIMD cast, ~10x faster than -> int64; bincount takes either.
    ids = fl.astype(np.int32 if nrows * bins < 2**31 else np.intp).ravel()
    if bad is not None:
        ids = ids[~bad.ravel()]
    return np.bincount(ids, minlength=nrows * bins).reshape(nrows, bins)
