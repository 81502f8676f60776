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


def bhattacharyya_batched(a, b, bins: int = DEFAULT_BINS) -> np.ndarray:
    """Many BCs at once, one per leading index.

    a: ``[..., n_a]``, b: ``[..., n_b]`` with the same leading shape (e.g. ``[token, layer]``).
    Returns ``[...]`` float64. A row where either side has no value left (empty or all-NaN)
    gets 0.0, as the upstream does for empty samples; a row holding an infinite value gets NaN.
    """
    a = _float_samples(a)
    b = _float_samples(b)
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"BC batch shapes differ: a {a.shape} vs b {b.shape} (leading dims must match)")
    lead = a.shape[:-1]
    dtype = np.result_type(a.dtype, b.dtype)
    nrows = int(np.prod(lead, dtype=np.int64))
    a2 = a.reshape(nrows, a.shape[-1]).astype(dtype, copy=False)
    b2 = b.reshape(nrows, b.shape[-1]).astype(dtype, copy=False)
    rows = a2.shape[0]
    out = np.zeros(rows, dtype=np.float64)
    if rows == 0:
        return out.reshape(lead)
    per_row = max(1, a2.shape[1] + b2.shape[1])
    # Row offsets ride in the float bin index: keep them exact in float32 (< 2**24).
    step = max(1, min(_CHUNK_ELEMS // per_row, (1 << 24) // bins - 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = _bc_rows(a2[r0:r1], b2[r0:r1], bins)
    return out.reshape(lead)


def _bc_rows(a: np.ndarray, b: np.ndarray, bins: int) -> np.ndarray:
    """a: [R, n_a], b: [R, n_b] same float dtype -> BC [R]."""
    dtype = a.dtype.type
    R = a.shape[0]
    with np.errstate(invalid="ignore"):
        a_min, a_nan = _row_nanmin(a)
        b_min, b_nan = _row_nanmin(b)
        ok = ~np.isnan(a_min) & ~np.isnan(b_min)  # both sides hold at least one value
        if not ok.any():
            return np.zeros(R)
        lo = np.fmin(a_min, b_min).astype(dtype)
        hi = np.fmax(_row_nanmax(a, a_nan), _row_nanmax(b, b_nan)).astype(dtype)
    finite = np.isfinite(lo) & np.isfinite(hi)
    lo = np.where(ok & finite, lo, dtype(0))
    hi = np.where(ok & finite, hi, dtype(0))
    ha = _row_hist(a, a_nan, lo, hi, bins)
    hb = _row_hist(b, b_nan, lo, hi, bins)
    p = ha / (ha.sum(axis=1, keepdims=True) + _NORM_EPS)
    q = hb / (hb.sum(axis=1, keepdims=True) + _NORM_EPS)
    bc = np.clip(np.sqrt(p * q).sum(axis=1), 0.0, 1.0)
    # An infinite error has no finite bin range (np.histogram raises on it): report NaN.
    return np.where(ok, np.where(finite, bc, np.nan), 0.0)


def _row_nanmin(x):
    """Row minimum ignoring NaN, and which rows hold a NaN at all."""
    if x.shape[1] == 0:
        return np.full(x.shape[0], np.nan, x.dtype), np.zeros(x.shape[0], bool)
    m = np.min(x, axis=1)
    has_nan = np.isnan(m)  # np.min propagates NaN, so only these rows need the slow path
    if has_nan.any():
        with np.errstate(all="ignore"):
            m[has_nan] = np.fmin.reduce(x[has_nan], axis=1)
    return m, has_nan


def _row_nanmax(x, has_nan):
    if x.shape[1] == 0:
        return np.full(x.shape[0], np.nan, x.dtype)
    m = np.max(x, axis=1)
    if has_nan.any():
        with np.errstate(all="ignore"):
            m[has_nan] = np.fmax.reduce(x[has_nan], axis=1)
    return m


def _row_hist(x: np.ndarray, has_nan: np.ndarray, lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """Counts ``[R, bins]`` of each row of ``x: [R, n]`` over its own edges ``linspace(lo, hi)``.

    Edge k is ``k*step + lo`` with ``step = (hi - lo) / bins`` in x's dtype, which is what
    np.linspace computes; bin = last edge <= x, the last bin closed (np.histogram's rule).
    """
    R, n = x.shape
    if n == 0:
        return np.zeros((R, bins), dtype=np.int64)
    dtype = x.dtype.type
    width = (hi - lo).astype(dtype)
    step = (width / dtype(bins)).astype(dtype)
    flat = step == 0  # lo == hi: np.histogram puts every value in the last bin
    # A range only a few ulps wide has edges that collapse onto each other; the one-step
    # correction below is exact only when a bin spans many ulps, so such rows go the slow way.
    tiny = ~flat & (step < 64 * np.spacing(np.maximum(np.abs(lo), np.abs(hi))))
    with np.errstate(all="ignore"):
        scale = np.where(flat, dtype(0), dtype(bins) / np.where(flat, dtype(1), width)).astype(dtype)
        lo_c, step_c = lo[:, None], step[:, None]
        t = x - lo_c
        t *= scale[:, None]
        np.floor(t, out=t)
        np.clip(t, 0, bins - 1, out=t)  # estimate, at most one bin off
        e = t * step_c
        e += lo_c
        dec = x < e  # never true in bin 0, whose edge is lo itself
        np.add(t, 1, out=e)
        e *= step_c
        e += lo_c
        inc = x >= e
        t -= dec
        t += inc
        np.minimum(t, bins - 1, out=t)  # hi belongs to the last (closed) bin
    t[flat] = bins - 1
    t += (np.arange(R, dtype=dtype) * bins)[:, None]
    nan = np.isnan(x) if has_nan.any() else None
    if nan is not None:
        t[nan] = 0
    flat_idx = t.astype(np.intp)
    if nan is not None:
        flat_idx = flat_idx[~nan]
    counts = np.bincount(flat_idx.ravel(), minlength=R * bins).reshape(R, bins)
    for r in np.nonzero(tiny)[0]:
        counts[r] = _exact_row_hist(x[r], lo[r], hi[r], bins)
    return counts


def _exact_row_hist(x, lo, hi, bins):
    edges = np.linspace(lo, hi, bins + 1)
    x = x[~np.isnan(x)]
    return np.histogram(x, bins=edges)[0]
