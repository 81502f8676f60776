"""KV cache comparison: per token x layer x head errors and per token x layer BC, vectorised.

Inputs are ``{layer_name: (k, v)}`` with ``k, v: [batch, kv_head, seq, head_dim]`` (torch or
numpy, any float dtype incl. bfloat16; differences and dot products in float32 like the
upstream, the cosine combined in float64 from ``|r|^2, r.d, |d|^2`` so that ``1 - cos`` stays
accurate at bf16 noise, where the upstream float32 cosine is off by ~4 %). Roles as in
reference/000 and ``logit_validation``:

- two-way (no baseline): errors of ``actual`` relative to ``expected``;
- three-way: ``ref = baseline`` (FP32 ground truth); ``k_linf`` etc. are actual vs baseline
  (target error), ``base_k_linf`` etc. expected vs baseline (dtype-only error), and
  ``{layer}._bc`` is the BC between the two absolute-error samples of one token and layer
  (all heads x head_dim values), i.e. whether the target's errors look like dtype noise.

Where this differs from the upstream ``compare_kv_caches`` on purpose:
- every position is compared, including the last (upstream stops at ``seq_len - 1``);
- every batch row is compared (upstream reads row 0 only); ``result[t]`` is row 0 as upstream,
  ``result.row(b)[t]`` any other row, and the arrays hold all rows;
- a position that is NaN (sliding-window fill) is excluded element-wise; a token x layer x head
  with nothing left gives NaN metrics (never 0, never a crash); BC excludes NaN errors and is
  NaN when a token x layer has no valid error at all;
- two-way ``base_*`` fields and BCs are NaN ("not measured") rather than 0.0.

The result is a thin view: the numbers live in arrays ``[batch, token, layer, head]``
(``result.k_linf`` ...) and ``[batch, token, layer]`` (``result.k_bc``, ``result.v_bc``);
``result[t][layer][h]`` builds a ``HeadMetrics`` on access.

Two implementations give the same numbers (``backend``): a fused numba kernel
(``metrics._fused``, the default when numba imports: one read of each source per position,
bf16 widened in registers) and the numpy path below (the fallback, and the reference the fused
one is tested against: BC, L-inf and raw errors bit for bit, L2 / cosine to float32 rounding).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .bc import DEFAULT_BINS, bc_grouped, bhattacharyya_batched, numba_available
from .errors import COS_EPS, EPS, as_float, cosine, rel_l2, rel_linf, to_numpy

__all__ = [
    "HeadMetrics",
    "TokenKVMetrics",
    "TokenKVErrors",
    "KVComparison",
    "KVRawErrors",
    "HEAD_METRIC_NAMES",
    "compare_kv_caches",
    "aggregate_kv_bc_across_prompts",
    "aggregate_kv_bc_arrays",
    "compute_combined_bc_per_layer",
    "natural_sort_key",
    "resolve_backend",
]

HEAD_METRIC_NAMES = (
    "k_cos", "v_cos", "k_linf", "v_linf", "k_l2", "v_l2",
    "base_k_linf", "base_v_linf", "base_k_l2", "base_v_l2",
)


@dataclass(frozen=True)
class HeadMetrics:
    """One token x layer x KV head. ``*_linf``/``*_l2`` relative to the reference
    (baseline in three-way mode, else expected); ``base_*`` expected vs baseline (three-way)."""

    k_cos: float
    v_cos: float
    k_linf: float
    v_linf: float
    k_l2: float
    v_l2: float
    base_k_linf: float
    base_v_linf: float
    base_k_l2: float
    base_v_l2: float


@dataclass(frozen=True)
class TokenKVMetrics:
    """BC between expected and actual absolute errors (vs baseline) of one token x layer."""

    k_bc: float
    v_bc: float


@dataclass(frozen=True)
class TokenKVErrors:
    """Absolute errors of one token x layer, each ``[kv_head * head_dim]`` float32."""

    base_k: np.ndarray
    base_v: np.ndarray
    tgt_k: np.ndarray
    tgt_v: np.ndarray


def natural_sort_key(name: str):
    """'layers.10' sorts after 'layers.9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# ----------------------------------------------------------------------------- result views


class _HeadsView(Sequence):
    __slots__ = ("_m", "_b", "_t", "_l", "_n")

    def __init__(self, metrics, b, t, l, n):
        self._m, self._b, self._t, self._l, self._n = metrics, b, t, l, n

    def __len__(self):
        return self._n

    def __getitem__(self, h):
        if isinstance(h, slice):
            return [self[i] for i in range(*h.indices(self._n))]
        if h < 0:
            h += self._n
        if not 0 <= h < self._n:
            raise IndexError(f"head {h} out of range (layer has {self._n} KV heads)")
        m = self._m
        return HeadMetrics(*(float(m[name][self._b, self._t, self._l, h]) for name in HEAD_METRIC_NAMES))


class _TokenView(Mapping):
    """``{layer: [HeadMetrics per head], f"{layer}._bc": TokenKVMetrics}`` for one row/token."""

    __slots__ = ("_c", "_b", "_t")

    def __init__(self, comparison, b, t):
        self._c, self._b, self._t = comparison, b, t

    def _keys(self):
        c = self._c
        keys = list(c.layers)
        if c.three_way:
            keys += [f"{layer}._bc" for layer in c.layers]
        return keys

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def __getitem__(self, key):
        c = self._c
        if key.endswith("._bc") and c.three_way and key[:-4] in c._layer_idx:
            li = c._layer_idx[key[:-4]]
            return TokenKVMetrics(float(c.k_bc[self._b, self._t, li]), float(c.v_bc[self._b, self._t, li]))
        if key in c._layer_idx:
            li = c._layer_idx[key]
            return _HeadsView(c.arrays, self._b, self._t, li, int(c.num_heads[li]))
        raise KeyError(f"{key!r}: not a compared layer (layers: {list(c.layers)[:4]}...)")


class _RowView(Sequence):
    """The tokens of one batch row; ``make(t)`` builds the view of token ``t``."""

    __slots__ = ("_n", "_make")

    def __init__(self, num_tokens, make):
        self._n, self._make = num_tokens, make

    def __len__(self):
        return self._n

    def __getitem__(self, t):
        n = self._n
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(n))]
        if t < 0:
            t += n
        if not 0 <= t < n:
            raise IndexError(f"token {t} out of range ({n} positions)")
        return self._make(t)


class KVComparison(Sequence):
    """Result of ``compare_kv_caches``.

    Arrays: ``arrays[name]: [batch, token, layer, head]`` for each of ``HEAD_METRIC_NAMES``
    (also reachable as attributes, e.g. ``result.k_linf``), ``k_bc, v_bc: [batch, token, layer]``.
    Heads beyond a layer's own count (layers with fewer KV heads) are NaN.
    ``result[t][layer][h]`` / ``result[t][f"{layer}._bc"]`` view batch row 0 like the upstream;
    ``result.row(b)`` views any row.
    """

    def __init__(self, layers, arrays, k_bc, v_bc, num_heads, three_way):
        self.layers = tuple(layers)
        self.arrays = arrays
        self.k_bc = k_bc
        self.v_bc = v_bc
        self.num_heads = np.asarray(num_heads, dtype=np.int64)
        self.three_way = bool(three_way)
        self._layer_idx = {name: i for i, name in enumerate(self.layers)}

    def __getattr__(self, name):
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(name)

    @property
    def shape(self):
        """(batch, token, layer, head)."""
        return self.arrays["k_linf"].shape

    @property
    def batch_size(self):
        return self.shape[0]

    @property
    def num_tokens(self):
        return self.shape[1]

    def row(self, b: int) -> Sequence:
        if not -self.batch_size <= b < self.batch_size:
            raise IndexError(f"batch row {b} out of range (batch {self.batch_size})")
        b %= self.batch_size
        return _RowView(self.num_tokens, lambda t: _TokenView(self, b, t))

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, t):
        return self.row(0)[t]

    def layer_index(self, layer: str) -> int:
        return self._layer_idx[layer]

    def to_columns(self) -> dict:
        """Long-format columns (one entry per batch x token x layer x head), for tables such as
        ``kv_head_metrics``: ``batch, token, layer, head`` plus every metric, and the layer's
        ``k_bc``/``v_bc`` repeated on its heads. Heads a layer does not have are left out."""
        B, T, L, H = self.shape
        b, t, li, h = np.meshgrid(np.arange(B), np.arange(T), np.arange(L), np.arange(H), indexing="ij")
        keep = (h < self.num_heads[li]).ravel()
        cols = {
            "batch": b.ravel()[keep],
            "token": t.ravel()[keep],
            "layer": np.asarray(self.layers, dtype=object)[li.ravel()[keep]],
            "head": h.ravel()[keep],
        }
        for name in HEAD_METRIC_NAMES:
            cols[name] = self.arrays[name].ravel()[keep]
        cols["k_bc"] = np.broadcast_to(self.k_bc[..., None], (B, T, L, H)).ravel()[keep]
        cols["v_bc"] = np.broadcast_to(self.v_bc[..., None], (B, T, L, H)).ravel()[keep]
        return cols


class _RawTokenView(Mapping):
    __slots__ = ("_r", "_b", "_t")

    def __init__(self, raw, b, t):
        self._r, self._b, self._t = raw, b, t

    def __iter__(self):
        return iter(self._r.layers)

    def __len__(self):
        return len(self._r.layers)

    def __getitem__(self, layer):
        r = self._r
        li = r._layer_idx[layer]
        k_at = (self._b, self._t, li, slice(0, int(r.widths[li])))
        v_at = (self._b, self._t, li, slice(0, int(r.v_widths[li])))
        return TokenKVErrors(r.base_k[k_at], r.base_v[v_at], r.tgt_k[k_at], r.tgt_v[v_at])


class KVRawErrors(Sequence):
    """Absolute errors vs baseline, ``base_k, base_v, tgt_k, tgt_v: [batch, token, layer,
    kv_head*head_dim]`` float32. ``raw[t][layer]`` -> ``TokenKVErrors`` of row 0 (upstream
    shape: a list over tokens of ``{layer: TokenKVErrors}``); ``raw.row(b)`` for other rows."""

    def __init__(self, layers, base_k, base_v, tgt_k, tgt_v, widths, v_widths=None):
        self.layers = tuple(layers)
        self.base_k, self.base_v, self.tgt_k, self.tgt_v = base_k, base_v, tgt_k, tgt_v
        self.widths = np.asarray(widths, dtype=np.int64)  # each layer's K values per token
        self.v_widths = self.widths if v_widths is None else np.asarray(v_widths, dtype=np.int64)
        self._layer_idx = {name: i for i, name in enumerate(self.layers)}

    @property
    def num_tokens(self):
        return self.base_k.shape[1]

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, t):
        return self.row(0)[t]

    def row(self, b: int) -> Sequence:
        return _RowView(self.num_tokens, lambda t: _RawTokenView(self, b, t))


# ----------------------------------------------------------------------------- the kernel


def _layer_sources(name, expected_kv, actual_kv, baseline_kv):
    """Fetch one layer from each source (a lazy Mapping loads it here) and check shapes."""
    srcs = {"expected": expected_kv, "actual": actual_kv}
    if baseline_kv is not None:
        srcs["baseline"] = baseline_kv
    out = {}
    for role, kv in srcs.items():
        try:
            pair = kv[name]
        except KeyError:
            raise KeyError(f"layer {name!r} missing from {role}_kv") from None
        if len(pair) != 2:
            raise ValueError(f"layer {name!r} of {role}_kv: expected a (k, v) pair, got {len(pair)} items")
        k, v = to_numpy(pair[0]), to_numpy(pair[1])
        if k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"layer {name!r} of {role}_kv: k and v must be [batch, kv_head, seq, head_dim], "
                f"got k {k.shape}, v {v.shape}"
            )
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"layer {name!r} of {role}_kv: k {k.shape} and v {v.shape} disagree on batch/head/seq")
        out[role] = (k, v)
    first_role = "expected"
    for role, (k, v) in out.items():
        for which, x, y in (("k", k, out[first_role][0]), ("v", v, out[first_role][1])):
            if x.shape != y.shape:
                raise ValueError(
                    f"shape mismatch at layer {name!r} ({which}): {first_role} {y.shape} vs {role} {x.shape}; "
                    "inputs must agree exactly (pad a window-trimmed cache with NaN first)"
                )
    return out


_CHUNK_ELEMS = 1 << 17  # values per position chunk: temporaries stay cache-sized


def _chunk_metrics(r, a, e, bins):
    """r, a, e: float arrays [B, H, s, D] of one position chunk (e None in two-way)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d = a - r
        # Dot products in float32 (SIMD), combined in float64: with R = |r|^2, p = r.d,
        # q = |d|^2, cos = (R + p) / sqrt(R (R + 2p + q)) keeps 1 - cos accurate to ~1e-4
        # relative where a float32 r.a / (|r||a|) is off by ~4 % at bf16 noise (1 - cos ~ 1e-6).
        R = np.einsum("bhsd,bhsd->bhs", r, r).astype(np.float64)
        p = np.einsum("bhsd,bhsd->bhs", r, d).astype(np.float64)
        q = np.einsum("bhsd,bhsd->bhs", d, d).astype(np.float64)
        np.abs(d, out=d)
        den_inf = np.maximum(np.maximum(r.max(axis=-1), -r.min(axis=-1)), EPS)
        nr = np.sqrt(R)
        na = np.sqrt(np.maximum(R + 2 * p + q, 0.0))
        d_max = d.max(axis=-1)
        out = {
            "linf": d_max / den_inf,
            "l2": np.sqrt(q) / np.maximum(nr, EPS),
            "cos": (R + p) / (np.maximum(nr, COS_EPS) * np.maximum(na, COS_EPS)),
        }
        den_l2 = np.maximum(nr, EPS)
        db = None
        if e is not None:
            db = e - r
            np.abs(db, out=db)
            db_max = db.max(axis=-1)
            out["base_linf"] = db_max / den_inf
            out["base_l2"] = np.sqrt(np.einsum("bhsd,bhsd->bhs", db, db)) / den_l2
    # NaN anywhere in a head vector shows up in these reductions; only those vectors are
    # recomputed with the NaN positions masked out (sliding-window fill is whole positions).
    bad = np.isnan(out["linf"]) | np.isnan(out["cos"])
    if e is not None:
        bad |= np.isnan(out["base_linf"])
    if bad.any():
        idx = np.nonzero(bad)
        rv, av = r[idx].astype(np.float64), a[idx].astype(np.float64)
        out["linf"][idx] = rel_linf(rv, av)
        out["l2"][idx] = rel_l2(rv, av)
        out["cos"][idx] = cosine(rv, av)
        if e is not None:
            ev = e[idx].astype(np.float64)
            out["base_linf"][idx] = rel_linf(rv, ev)
            out["base_l2"][idx] = rel_l2(rv, ev)
    if e is not None:
        minmax = None
        if not bad.any():  # group min/max from per-head ones: no strided reductions
            def grp(x):
                return x.max(axis=1)[:, None, :, None]
            minmax = (
                db.min(axis=-1).min(axis=1)[:, None, :, None], grp(db_max),
                d.min(axis=-1).min(axis=1)[:, None, :, None], grp(d_max),
            )
        bc = bc_grouped(db, d, (1, 3), bins, minmax)  # [B, s]: over heads x head_dim, no transpose
        # A token x layer with no valid error at all (sliding-window fill) has no BC.
        if bad.any():
            none_valid = np.all(np.isnan(d) | np.isnan(db), axis=(1, 3))
            bc[none_valid] = np.nan
        out["bc"] = bc
    return out, d, db


def _one_tensor(ref, act, exp, want_raw, bins=DEFAULT_BINS, backend="numpy"):
    """Metrics of one layer's K (or V). ref/act/exp: [B, H, S, D] (exp None in two-way).

    Returns dict of [B, S, H] arrays (cos, linf, l2, base_linf, base_l2), ``bc`` [B, S]
    (three-way) and, when asked, absolute errors ``tgt_err``/``base_err`` as [B, S, H*D]
    float32. backend "numba": the fused kernel (``metrics._fused``), with positions holding a
    NaN or infinity redone here; "numpy": chunks of positions so temporaries stay small.
    """
    B, H, S, D = ref.shape
    if backend == "numba" and B * H * S * D > 0:
        return _fused_tensors([(ref, act, exp, None)], want_raw, bins)[0]
    names = ["linf", "l2", "cos"] + (["base_linf", "base_l2"] if exp is not None else [])
    res = {n: np.empty((B, S, H)) for n in names}
    if exp is not None:
        res["bc"] = np.empty((B, S))
    if want_raw:
        res["tgt_err"] = np.empty((B, S, H * D), np.float32)
        res["base_err"] = np.empty((B, S, H * D), np.float32)
    cs = max(1, _CHUNK_ELEMS // max(1, B * H * D))
    for s0 in range(0, S, cs):
        s1 = min(S, s0 + cs)
        sl = (slice(None), slice(None), slice(s0, s1))
        r = as_float(ref[sl])
        a = as_float(act[sl])
        e = as_float(exp[sl]) if exp is not None else None
        out, d, db = _chunk_metrics(r, a, e, bins)
        for n in names:
            res[n][:, s0:s1] = out[n].transpose(0, 2, 1)
        if exp is not None:
            res["bc"][:, s0:s1] = out["bc"]
        if want_raw:
            res["tgt_err"][:, s0:s1] = d.transpose(0, 2, 1, 3).reshape(B, s1 - s0, H * D)
            res["base_err"][:, s0:s1] = db.transpose(0, 2, 1, 3).reshape(B, s1 - s0, H * D)
    return res


def _fused_tensors(items, want_raw, bins):
    """``_one_tensor`` (numba) of several tensors at once (``(ref, act, exp, dest)``; dest:
    arrays to write into, or None), their parts sharing the threads; positions holding a NaN
    or infinity are then redone by the numpy path (its exclusion rules, those positions only)."""
    from . import _fused

    out = []
    for (ref, act, exp, _), (res, redo) in zip(items, _fused.kv_tensors_metrics(items, want_raw, bins)):
        if redo.size:
            sub = _one_tensor(ref[:, :, redo], act[:, :, redo], None if exp is None else exp[:, :, redo], want_raw, bins)
            for n, arr in sub.items():
                res[n][:, redo] = arr
        out.append(res)
    return out


def _uninit(shape, dtype=np.float64):
    """A result array every element of which the layer loop writes (the kernel's slices, the
    NaN tails of layers narrower than the widest): no NaN fill first, which on a 70B-shaped
    cache was 2-5 % of a three-way compare (a 5 MB write per metric) and, with raw errors,
    16 % (a write of four [batch, seq, layer, heads x head_dim] float32 arrays)."""
    return np.empty(shape, dtype)


_BACKENDS = ("auto", "numba", "numpy")


def resolve_backend(backend: str = "auto") -> str:
    """"numba" when asked for, or for "auto" when numba imports (the fused kernels of
    ``metrics._fused``); else "numpy". Both give the same numbers: L-inf, BC and raw errors
    bit for bit, L2 and cosine to float32 rounding of the sums."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "numpy":
        return "numpy"
    ok = numba_available()
    if backend == "numba" and not ok:
        raise ValueError("backend='numba' but numba does not import (install the 'fast' extra)")
    return "numba" if ok else "numpy"


def compare_kv_caches(
    expected_kv: Mapping,
    actual_kv: Mapping,
    layers: Sequence[str] | None = None,
    baseline_kv: Mapping | None = None,
    return_raw_errors: bool = False,
    bins: int = DEFAULT_BINS,
    backend: str = "auto",
):
    """Compare KV caches token x layer x head (see module docstring for definitions).

    expected_kv, actual_kv, baseline_kv: ``{layer: (k, v)}``, ``k, v: [batch, kv_head, seq,
    head_dim]``; any Mapping works, so a store can hand layers over lazily: each layer is read,
    compared and released before the next (peak memory ~ one layer of every source).
    layers: names to compare, in order (default: the layers all sources share, natural order).
    return_raw_errors: three-way only; also return ``KVRawErrors`` (absolute errors of every
    token x layer, for ``aggregate_kv_bc_across_prompts``).
    backend: "auto" (the fused numba kernel when numba imports, else numpy), "numba", "numpy";
    see ``resolve_backend``.

    Returns ``KVComparison`` or ``(KVComparison, KVRawErrors)``.
    Raises ValueError naming the layer and both shapes on any shape mismatch, and when the
    layers disagree on batch or sequence length.
    """
    three_way = baseline_kv is not None
    backend = resolve_backend(backend)
    if return_raw_errors and not three_way:
        raise ValueError("return_raw_errors needs baseline_kv: raw errors are measured against the baseline")
    if layers is None:
        common = set(expected_kv.keys()) & set(actual_kv.keys())
        if three_way:
            common &= set(baseline_kv.keys())
        layers = sorted(common, key=natural_sort_key)
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to compare (the sources share no layer name)")

    arrays = None
    k_bc = v_bc = None
    num_heads = []
    raw = None
    bs_shape = None
    L = len(layers)
    for li, name in enumerate(layers):
        src = _layer_sources(name, expected_kv, actual_kv, baseline_kv)
        ek, ev = src["expected"]
        ak, av = src["actual"]
        if three_way:
            rk, rv = src["baseline"]
        else:
            rk, rv = ek, ev
        B, H, S, _ = rk.shape
        if bs_shape is None:
            bs_shape = (B, S)
        elif (B, S) != bs_shape:
            raise ValueError(
                f"layer {name!r} has batch x seq {(B, S)} but layer {layers[0]!r} has {bs_shape}; "
                "all layers must cover the same positions (pad with NaN)"
            )
        # Result arrays first (made at the first layer, widened, NaN-padded, when a layer has
        # more KV heads or a wider K / V): the fused kernel writes into this layer's slices.
        if arrays is None:  # two-way leaves the base_* arrays (and the BCs) NaN: "not measured"
            arrays = {n: _uninit((B, S, L, H)) if three_way or not n.startswith("base_") else np.full((B, S, L, H), np.nan)
                      for n in HEAD_METRIC_NAMES}
            k_bc, v_bc = np.full((B, S, L), np.nan), np.full((B, S, L), np.nan)
        elif H > arrays["k_linf"].shape[-1]:
            grown = {n: np.full((B, S, L, H), np.nan) for n in HEAD_METRIC_NAMES}
            for n, arr in arrays.items():
                grown[n][..., : arr.shape[-1]] = arr
            arrays = grown
        num_heads.append(H)
        wk, wv = rk.shape[1] * rk.shape[3], rv.shape[1] * rv.shape[3]
        if return_raw_errors:
            if raw is None:
                raw = {"widths": [], "v_widths": []}
            for f, w in (("base_k", wk), ("tgt_k", wk), ("base_v", wv), ("tgt_v", wv)):
                have = raw.get(f)
                if have is None:
                    raw[f] = _uninit((B, S, L, w), np.float32)
                elif w > have.shape[-1]:  # a wider layer: widen (NaN-padded)
                    grown = np.full((B, S, L, w), np.nan, np.float32)
                    grown[..., : have.shape[-1]] = have
                    raw[f] = grown
            raw["widths"].append(wk)
            raw["v_widths"].append(wv)

        def dest(kv_name, heads, width):
            """This layer's slices of the result arrays, which the kernel or the numpy path
            writes whole; what lies past a narrower layer's heads or width is NaN-filled here."""
            cols = {n: f"{kv_name}_{n}" for n in ("cos", "linf", "l2")}
            if three_way:
                cols.update(base_linf=f"base_{kv_name}_linf", base_l2=f"base_{kv_name}_l2")
            d = {}
            for n, col in cols.items():
                arr = arrays[col]
                d[n] = arr[:, :, li, :heads]
                if heads < arr.shape[-1]:
                    arr[:, :, li, heads:] = np.nan
            if three_way:
                d["bc"] = (k_bc if kv_name == "k" else v_bc)[:, :, li]
            if return_raw_errors:
                for f in ("tgt", "base"):
                    arr = raw[f"{f}_{kv_name}"]
                    d[f"{f}_err"] = arr[:, :, li, :width]
                    if width < arr.shape[-1]:
                        arr[:, :, li, width:] = np.nan
            return d

        dk, dv = dest("k", H, wk), dest("v", rv.shape[1], wv)
        if backend == "numba" and rk.size and rv.size:  # K and V share the threads; written in place
            _fused_tensors([(rk, ak, ek if three_way else None, dk), (rv, av, ev if three_way else None, dv)],
                           return_raw_errors, bins)
        else:
            for d, (r, a, e) in ((dk, (rk, ak, ek)), (dv, (rv, av, ev))):
                m = _one_tensor(r, a, e if three_way else None, return_raw_errors, bins, backend)
                for n, arr in d.items():
                    arr[...] = m[n]
        del src, ek, ev, ak, av, rk, rv

    result = KVComparison(layers, arrays, k_bc, v_bc, num_heads, three_way)
    if return_raw_errors:
        raw_obj = KVRawErrors(layers, raw["base_k"], raw["base_v"], raw["tgt_k"], raw["tgt_v"], raw["widths"],
                              raw["v_widths"])
        return result, raw_obj
    return result


# ----------------------------------------------------------------------------- aggregation


def _raw_arrays(raw, layers, row):
    """(base_k, base_v, tgt_k, tgt_v) as [token, layer, width] for one prompt's raw errors.

    Accepts ``KVRawErrors`` or the upstream shape: a list over tokens of
    ``{layer: TokenKVErrors}``.
    """
    if isinstance(raw, KVRawErrors):
        idx = [raw._layer_idx[name] for name in layers]
        if idx == list(range(len(raw.layers))):  # all layers in stored order: views, no copy
            return tuple(getattr(raw, f)[row] for f in ("base_k", "base_v", "tgt_k", "tgt_v"))
        return tuple(np.asarray(getattr(raw, f)[row][:, idx, :]) for f in ("base_k", "base_v", "tgt_k", "tgt_v"))
    out = []
    for field in ("base_k", "base_v", "tgt_k", "tgt_v"):
        if len(raw) == 0:
            out.append(np.zeros((0, len(layers), 0), np.float32))
            continue
        out.append(np.stack([np.stack([as_float(getattr(tok[name], field)).ravel() for name in layers]) for tok in raw]))
    return tuple(out)


def _layers_of(raw):
    if isinstance(raw, KVRawErrors):
        return list(raw.layers)
    return sorted(raw[0].keys(), key=natural_sort_key) if len(raw) else []


def aggregate_kv_bc_arrays(
    all_raw_errors, prompt_lens, layers=None, row: int = 0, bins: int = DEFAULT_BINS, backend: str = "auto"
):
    """Cross-prompt BC per generation token and layer, as arrays.

    all_raw_errors: one entry per prompt (``KVRawErrors`` or upstream list-of-dicts);
    prompt_lens: each prompt's length, so that generation token g is position
    ``prompt_len + g`` of that prompt (0 = first decode token). Only generation indices every
    prompt has are aggregated (upstream: ``min(len - prompt_len)``).
    Returns ``(layers, k_bc [gen_token, layer], v_bc [gen_token, layer])``: for each
    (g, layer) the BC over the errors of all prompts concatenated. backend: how bins are
    counted (``bhattacharyya_batched``; the same numbers either way).
    """
    if len(all_raw_errors) != len(prompt_lens):
        raise ValueError(f"{len(all_raw_errors)} raw-error entries but {len(prompt_lens)} prompt lengths")
    if not all_raw_errors:
        return [], np.zeros((0, 0)), np.zeros((0, 0))
    if layers is None:
        layers = _layers_of(all_raw_errors[0])
    layers = list(layers)
    n_gen = min(len(r) - p for r, p in zip(all_raw_errors, prompt_lens))
    if n_gen <= 0:
        return layers, np.zeros((0, len(layers))), np.zeros((0, len(layers)))
    per_prompt = [_raw_arrays(r, layers, row) for r in all_raw_errors]
    k_bc = np.empty((n_gen, len(layers)))
    v_bc = np.empty((n_gen, len(layers)))
    for li in range(len(layers)):  # one layer at a time bounds the temporaries
        # stacked as [gen, prompt, width]: each gen index's sample is one contiguous row
        base_k, base_v, tgt_k, tgt_v = (
            np.stack([as_float(arrs[f][p : p + n_gen, li, :]) for arrs, p in zip(per_prompt, prompt_lens)], axis=1)
            .reshape(n_gen, -1)
            for f in range(4)
        )
        k_bc[:, li] = bhattacharyya_batched(base_k, tgt_k, bins=bins, backend=backend)
        v_bc[:, li] = bhattacharyya_batched(base_v, tgt_v, bins=bins, backend=backend)
        # A generation index with no valid error in any prompt (e.g. the last teacher token, whose
        # KV an engine never writes) has no BC, as in compare_kv_caches: NaN, not a failing 0.
        k_bc[np.all(np.isnan(base_k) | np.isnan(tgt_k), axis=1), li] = np.nan
        v_bc[np.all(np.isnan(base_v) | np.isnan(tgt_v), axis=1), li] = np.nan
    return layers, k_bc, v_bc


def aggregate_kv_bc_across_prompts(
    all_raw_errors, prompt_lens, layers=None, row: int = 0, bins: int = DEFAULT_BINS, backend: str = "auto"
):
    """Upstream-shaped cross-prompt BC: ``agg[gen_token_idx][layer].k_bc`` (see
    ``aggregate_kv_bc_arrays`` for the definition; this wraps its arrays in a dict)."""
    names, k_bc, v_bc = aggregate_kv_bc_arrays(all_raw_errors, prompt_lens, layers, row, bins, backend)
    return {
        g: {name: TokenKVMetrics(float(k_bc[g, li]), float(v_bc[g, li])) for li, name in enumerate(names)}
        for g in range(k_bc.shape[0])
    }


def compute_combined_bc_per_layer(all_raw_errors, layers=None, row: int = 0, bins: int = DEFAULT_BINS):
    """One BC per layer over every token of every prompt: ``{layer: TokenKVMetrics}``."""
    if not all_raw_errors:
        return {}
    if layers is None:
        layers = _layers_of(all_raw_errors[0])
    layers = list(layers)
    per_prompt = [_raw_arrays(r, layers, row) for r in all_raw_errors]
    out = {}
    for li, name in enumerate(layers):
        cols = [np.concatenate([arrs[f][:, li, :].ravel() for arrs in per_prompt])[None, :] for f in range(4)]
        k = bhattacharyya_batched(cols[0], cols[2], bins=bins)[0]
        v = bhattacharyya_batched(cols[1], cols[3], bins=bins)[0]
        out[name] = TokenKVMetrics(float(k), float(v))
    return out
