"""Diff one comparison (one engine release) against another, and one metric across releases.

``diff(store, base, head)`` reads the rows two comparisons stored (nothing is recomputed from
arrays) and returns a ``DiffResult``: verdict changes (the comparison, each KV layer, each module
x phase), per-layer / per-module / per-prompt-token / per-generation-token x layer metric deltas,
new and resolved logit divergences per prompt, and the change of the σ-ratio per (layer, K|V,
phase), per (module, phase) and of the logits, with a paired bootstrap confidence interval over
the prompts both comparisons hold (docs/diff.md). BASE and HEAD are comparison ids or release
labels (the ``release`` of the comparison's actual run: the latest comparison of that release for
the same model and prompts).

The σ-ratio statistic (per group g): ``sqrt(Σ tgt_l2² / Σ base_l2²)`` over every row of g (per-head
KV rows, per-token module rows, per-token logit rows) of the resampled prompts; ``*_l2`` are the
relative L2 errors the metric tables hold (target vs FP32, BF16 vs FP32), so a correct BF16 engine
sits near 1. The bootstrap: prompts sorted by id, ``idx = numpy.random.default_rng(seed).integers(0,
P, (n_boot, P))`` (the same draw for base and head: the prompts are paired), the statistic's change
head - base per resample, and the 2.5 / 97.5 % quantiles (``numpy.nanquantile``, linear).

A regression is (1) a verdict that passed in base and does not pass in head, or (2) a σ-ratio
change whose interval lies entirely above ``SIGMA_MARGIN`` (the interval excludes zero, and the
change exceeds a quarter of the BF16 noise's own RMS: changes below it are BF16-noise sized and
are reported, not flagged), or (3) when both comparisons stored ``raw_errors``, an aggregate-BC
change per (layer, K|V) over the generation positions (``kv_aggregate_bc``) whose interval lies
entirely below ``-BC_MARGIN``. Two-way comparisons have no ``base_*`` errors: only verdicts count.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from capturestore.cachecheck_diff import CacheCheckDiff

__all__ = ["BC_MARGIN", "DiffResult", "SIGMA_MARGIN", "StatChange", "VerdictChange", "bootstrap_bc_change",
           "bootstrap_sigma_change", "diff",
           "history", "resolve_comparison"]

SIGMA_MARGIN = 0.25  # σ-ratio change (in units of the BF16 noise RMS) below which nothing is a regression
BC_MARGIN = 0.05  # aggregate-BC drop below which nothing is a regression
CI_LEVEL = 0.95
_VERDICT_COLUMNS = ("passed", "logit_passed", "kv_passed", "fp8_floor_passed")


def _in(name: str, values) -> tuple[str, dict[str, str]]:
    from capturestore.aggregate import in_params

    return in_params(name, values)


@dataclass(frozen=True)
class VerdictChange:
    """A verdict that differs: ``check`` (a comparisons column, ``kv_layer``, ``module``), where
    (``layer``, ``module``, ``phase``), base and head values; ``regression``: passed in base,
    not passed (False or not judged) in head."""

    check: str
    base: bool | None
    head: bool | None
    regression: bool
    layer: str | None = None
    module: str | None = None
    phase: str | None = None


@dataclass(frozen=True)
class StatChange:
    """A σ-ratio of one group in base and head, its change and the bootstrap interval of the change."""

    metric: str  # "kv_sigma_ratio", "module_sigma_ratio", "logit_sigma_ratio", "kv_aggregate_bc"
    layer: str | None
    kv: str | None  # "k" | "v" | None
    module: str | None
    phase: str | None
    base: float
    head: float
    delta: float
    ci_low: float
    ci_high: float
    regression: bool


@dataclass(frozen=True)
class DiffResult:
    base_id: str
    head_id: str
    model_hash: str | None
    prompt_ids: tuple  # the prompts compared (sorted)
    note: str | None  # e.g. the prompts compared when the comparisons' prompt sets differ
    verdict_changes: tuple
    stat_changes: tuple
    divergences: tuple  # {"prompt_id", "new": [...], "resolved": [...]} of prompts with a change
    # name -> pa.Table: layer_deltas, module_deltas, token_deltas, gen_bc_deltas
    tables: dict = field(default_factory=dict)
    seed: int = 0
    n_boot: int = 2000
    margin: float = SIGMA_MARGIN

    @property
    def regressions(self) -> list:
        return [c for c in (*self.verdict_changes, *self.stat_changes) if c.regression]

    @property
    def regression(self) -> bool:
        return bool(self.regressions)

    @property
    def localisation(self) -> dict | None:
        """Where the regression is: the first regressing verdict's layer / module / phase, filled in
        from the largest regressing σ change (None: no regression)."""
        regs = self.regressions
        if not regs:
            return None
        out = {"layer": None, "module": None, "phase": None}
        stats = sorted((c for c in regs if isinstance(c, StatChange)), key=lambda c: -abs(c.delta))
        for c in [c for c in regs if isinstance(c, VerdictChange)] + stats:
            for k in out:
                if out[k] is None and getattr(c, k) is not None:
                    out[k] = getattr(c, k)
        return out

    def to_dict(self) -> dict:
        return {
            "base_id": self.base_id, "head_id": self.head_id, "model_hash": self.model_hash,
            "prompt_ids": list(self.prompt_ids), "note": self.note, "regression": self.regression,
            "localisation": self.localisation, "seed": self.seed, "n_boot": self.n_boot, "margin": self.margin,
            "verdict_changes": [asdict(c) for c in self.verdict_changes],
            "stat_changes": [asdict(c) for c in self.stat_changes],
            "divergences": [dict(d) for d in self.divergences],
            "tables": {k: t.to_pylist() for k, t in self.tables.items()},
        }


# ---- resolving ids and labels -------------------------------------------------------------------
_FROM = "FROM comparisons c LEFT JOIN runs r ON r.run_id = c.actual_run"


def _has_comparisons(store) -> bool:
    views = set(store.sql("SELECT table_name FROM information_schema.tables").column("table_name").to_pylist())
    return "comparisons" in views


def comparison_rows(store, where: str = "", params: dict | None = None) -> list[dict]:
    """Comparisons rows with their actual run's release, model_hash and model_path, newest first;
    ``where``: a filter over ``c`` (comparisons) and ``r`` (the actual run) with ``params``. Callers
    ask for the rows they need: a store after a year of nightly CI holds thousands, and turning
    every one into a dict was what made ``history`` and ``diff`` grow with it (docs/compact.md,
    "A year of nightly CI")."""
    if not _has_comparisons(store):
        return []
    return store.sql(f"SELECT c.*, r.release AS release, r.model_hash AS model_hash, r.model_path AS model_path "
                     f"{_FROM} {'WHERE ' + where if where else ''} "
                     f"ORDER BY c.created_at DESC, c.comparison_id DESC", params=params).to_pylist()


def _is_comparison(store, ref: str) -> bool:
    return bool(comparison_rows(store, "c.comparison_id = $ref", {"ref": ref}))


def _prompt_set(store, row) -> frozenset:
    return frozenset(store.sql("SELECT prompt_id FROM prompts WHERE run_id = $r", params={"r": row["actual_run"]})
                     .column(0).to_pylist())


def resolve_comparison(store, ref: str, other: dict | None = None, *, command: str = "diff") -> dict:
    """The comparisons row (with the actual run's release / model) of ``ref``: a comparison id, or a
    release label (the latest comparison whose actual run has that release, preferring the model and
    prompts of ``other``). ValueError in one line when neither."""
    rows = comparison_rows(store, "c.comparison_id = $ref", {"ref": ref})
    if rows:
        return rows[0]
    cands = comparison_rows(store, "r.release = $ref", {"ref": ref})
    if not cands:
        releases = sorted(store.sql(f"SELECT DISTINCT r.release {_FROM} WHERE r.release <> ''").column(0).to_pylist()
                          if _has_comparisons(store) else [])
        raise ValueError(f"{command}: {ref!r} is neither a comparison id nor a release label of {store.root} "
                         f"(releases: {', '.join(releases) or 'none'})")
    if other is not None:
        same = [r for r in cands if r["model_hash"] == other["model_hash"]]
        cands = same or cands
        want = _prompt_set(store, other)
        cands = [r for r in cands if _prompt_set(store, r) == want] or cands
    return cands[0]


# ---- the bootstrap ----------------------------------------------------------------------------------
def bootstrap_weights(idx: np.ndarray) -> np.ndarray:
    """``[n_boot, n_prompts]``: how often each prompt is drawn in each resample."""
    n_boot, P = idx.shape
    return np.bincount((np.arange(n_boot)[:, None] * P + idx).ravel(), minlength=n_boot * P).reshape(n_boot, P) \
        .astype(np.float64)


MAX_BOOT = 1_000_000  # resamples: a 95% interval's ends settle well before this
MAX_BOOT_DRAWS = 1 << 27  # n_boot x prompts: the bootstrap's [n_boot, prompts] int64 arrays at 1 GiB each


def bootstrap_indices(n_prompts: int, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, n_prompts]`` prompt indices drawn with replacement (the documented protocol)."""
    return np.random.default_rng(seed).integers(0, n_prompts, (n_boot, n_prompts))


def bootstrap_sigma_change(tb, bb, th, bh, idx: np.ndarray, level: float = CI_LEVEL, weights=None):
    """σ-ratio change head - base per group, with its bootstrap interval.

    tb, bb, th, bh: ``[prompt, group]`` sums of squared relative L2 of target / BF16 rows, base and
    head comparisons (the same prompt order); idx: ``bootstrap_indices``. Returns (base, head,
    delta, low, high), each ``[group]``."""
    weights = bootstrap_weights(idx) if weights is None else weights

    def ratio(t, b, w=None):
        with np.errstate(divide="ignore", invalid="ignore"):
            if w is None:
                return np.sqrt(t.sum(0) / b.sum(0))
            return np.sqrt((w @ t) / (w @ b))

    base, head = ratio(tb, bb), ratio(th, bh)
    reps = ratio(th, bh, weights) - ratio(tb, bb, weights)
    a = (1 - level) / 2
    with np.errstate(invalid="ignore"):
        reps[~np.isfinite(reps)] = np.nan
        if np.isnan(reps).all(axis=0).any():
            lo = np.full(reps.shape[1], np.nan)
            hi = lo.copy()
            ok = ~np.isnan(reps).all(axis=0)
            if ok.any():
                lo[ok], hi[ok] = np.nanquantile(reps[:, ok], [a, 1 - a], axis=0)
        else:
            lo, hi = np.nanquantile(reps, [a, 1 - a], axis=0)
    return base, head, head - base, lo, hi


def _prompt_hists(x: np.ndarray, prompt: np.ndarray, n_prompts: int, edges: np.ndarray) -> np.ndarray:
    """``[n_prompts, bins]`` counts of the finite values of ``x: [row, width]`` per prompt of each row,
    numpy.histogram's rule over ``edges`` (bin i holds edge_i <= x < edge_{i+1}, the last bin its
    right edge too); every value in the last bin when the range is one point."""
    nb = len(edges) - 1
    p = np.repeat(prompt, x.shape[1])
    x = x.ravel()
    ok = np.isfinite(x)
    x, p = x[ok], p[ok]
    if edges[0] == edges[-1]:
        b = np.full(x.shape, nb - 1)
    else:
        b = np.searchsorted(edges, x, side="right") - 1
        b[x == edges[-1]] = nb - 1
    return np.bincount(p * nb + b, minlength=n_prompts * nb).reshape(n_prompts, nb).astype(np.float64)


def bootstrap_bc_change(side_b, side_h, idx: np.ndarray, bins: int = 100, level: float = CI_LEVEL, weights=None):
    """Aggregate BC change head - base of one (layer, K|V), with its bootstrap interval.

    side_b, side_h: ``(bf16_errors [row, width], target_errors [row, width], prompt [row])`` float32
    errors of base and head, each row's prompt index (the same prompt order, ``idx``'s range). The
    estimates are the exact BC of each comparison's pooled errors (``metrics.bc``); a resample pools
    the drawn prompts' histograms over the bins of the full pool's joint [min, max] (so every
    resample of a comparison is binned alike). Returns (base, head, delta, low, high)."""
    from metrics.bc import bhattacharyya_batched

    P = idx.shape[1]
    weights = bootstrap_weights(idx) if weights is None else weights
    est, reps = [], []
    for e, t, prompt in (side_b, side_h):
        est.append(float(bhattacharyya_batched(e.reshape(1, -1), t.reshape(1, -1))[0]))
        with np.errstate(invalid="ignore"):
            lo = np.float32(np.nanmin([np.nanmin(e), np.nanmin(t)]))
            hi = np.float32(np.nanmax([np.nanmax(e), np.nanmax(t)]))
        edges = np.linspace(lo, hi, bins + 1, dtype=np.float32)
        wb, wt = weights @ _prompt_hists(e, prompt, P, edges), weights @ _prompt_hists(t, prompt, P, edges)
        pb = wb / (wb.sum(1, keepdims=True) + 1e-10)
        pt = wt / (wt.sum(1, keepdims=True) + 1e-10)
        reps.append(np.clip(np.sqrt(pb * pt).sum(1), 0.0, 1.0))
    d = reps[1] - reps[0]
    a = (1 - level) / 2
    lo, hi = np.quantile(d, [a, 1 - a])
    return est[0], est[1], est[1] - est[0], float(lo), float(hi)


def _bc_stats(store, q, base_id, head_id, pids, idx) -> list[StatChange]:
    """``kv_aggregate_bc`` per (layer, K|V) from the raw_errors both comparisons stored (none: [])."""
    from capturestore.aggregate import iter_raw_errors

    if not q.has("raw_errors", "base_k", "tgt_k"):
        return []
    names = {}
    for cid in (base_id, head_id):
        t = store.sql("SELECT DISTINCT layer_idx, layer FROM raw_errors WHERE comparison_id = $c",
                      params={"c": cid}).to_pylist()
        names[cid] = {r["layer_idx"]: r["layer"] for r in t}
    if not names[base_id] or names[base_id] != names[head_id]:
        return []  # one stored none, or their layers differ: no aggregate BC to compare
    n_layers = len(names[head_id])
    weights = bootstrap_weights(idx)
    out = []
    both = zip(iter_raw_errors(store, base_id, pids, n_layers, order="prompt"),
               iter_raw_errors(store, head_id, pids, n_layers, order="prompt"))
    for (lb, rb), (lh, rh) in both:
        if lb != lh:
            raise ValueError(f"diff: raw_errors of {base_id} and {head_id} disagree on layer {lb} vs {lh}")
        for kv in ("k", "v"):
            b, h, d, lo, hi = bootstrap_bc_change((rb[f"base_{kv}"], rb[f"tgt_{kv}"], rb["prompt"]),
                                                  (rh[f"base_{kv}"], rh[f"tgt_{kv}"], rh["prompt"]), idx,
                                                  weights=weights)
            out.append(StatChange("kv_aggregate_bc", names[head_id][lb], kv, None, "decode", b, h, d, lo, hi,
                                  bool(np.isfinite(hi) and hi < -BC_MARGIN)))
    return out


def _group_sums(store, cid, sql_from, keys, tcol, bcol, pids) -> dict:
    """{(prompt, *keys): (Σ tcol², Σ bcol²)} of one comparison's rows."""
    ids, params = _in("p", pids)
    ks = ", ".join(keys)
    t = store.sql(f"SELECT prompt_id, {ks}, sum({tcol} * {tcol}) AS t, sum({bcol} * {bcol}) AS b FROM {sql_from} "
                  f"WHERE comparison_id = $c AND prompt_id IN ({ids}) AND {tcol} IS NOT NULL "
                  f"AND {bcol} IS NOT NULL GROUP BY ALL", params={**params, "c": cid}).to_pylist()
    return {tuple(r[k] for k in ("prompt_id", *keys)): (r["t"] or 0.0, r["b"] or 0.0) for r in t}


def _sigma_stats(store, base_id, head_id, pids, idx, spec) -> list[StatChange]:
    metric, table, keys, tcols, bcols = spec
    weights = bootstrap_weights(idx)
    out = []
    for tcol, bcol, kv in zip(tcols, bcols, ("k", "v") if len(tcols) == 2 else (None,)):
        sums = {s: _group_sums(store, cid, table, keys, tcol, bcol, pids)
                for s, cid in (("b", base_id), ("h", head_id))}
        groups = sorted({k[1:] for d in sums.values() for k in d}, key=lambda g: tuple(_natural(x) for x in g))
        if not groups:
            continue
        arr = {}
        p_at, g_at = {p: i for i, p in enumerate(pids)}, {g: i for i, g in enumerate(groups)}
        for s in ("b", "h"):
            t = np.zeros((len(pids), len(groups)))  # a prompt without rows of a group adds nothing
            b = np.zeros_like(t)
            for (p, *g), (tv, bv) in sums[s].items():
                t[p_at[p], g_at[tuple(g)]], b[p_at[p], g_at[tuple(g)]] = tv, bv
            arr[s] = (t, b)
        base, head, delta, lo, hi = bootstrap_sigma_change(*arr["b"], *arr["h"], idx, weights=weights)
        for gi, g in enumerate(groups):
            d = dict(zip(keys, g))
            reg = bool(np.isfinite(lo[gi]) and lo[gi] > SIGMA_MARGIN)
            out.append(StatChange(metric, _str(d.get("layer")), kv, d.get("module"), d.get("phase"),
                                  _f(base[gi]), _f(head[gi]), _f(delta[gi]), _f(lo[gi]), _f(hi[gi]), reg))
    return out


def _natural(x):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(x))]


def _f(x) -> float:
    return float(x) if x is not None else math.nan


def _str(x):
    return None if x is None else str(x)


# ---- the diff -----------------------------------------------------------------------------------------
def diff(store, base: str, head: str, *, common_prompts: bool = False, seed: int = 0,
         n_boot: int = 2000) -> DiffResult | CacheCheckDiff:
    """Diff comparison (or release) ``head`` against ``base`` (module docstring); ``store``: a
    ``Store`` or its path / URL. Two cache checks (``capturestore cachecheck``; ids or labels)
    are diffed by ``cachecheck_diff.diff_cachecheck`` instead (a ``CacheCheckDiff``; the other
    arguments do not apply), as is a cache check against a name that is neither. ValueError in one
    line: an unknown id or label, a cache check against a comparison of runs, comparisons of
    different models, prompt sets that are disjoint or (unless ``common_prompts``) differ."""
    from capturestore.cachecheck_diff import diff_cachecheck, is_cachecheck
    from capturestore.store import as_store

    store = as_store(store)
    kinds = [is_cachecheck(store, x) for x in (base, head)]
    if any(kinds):
        other = head if kinds[0] else base
        if not all(kinds) and comparison_rows(store, "c.comparison_id = $x OR r.release = $x", {"x": other}):
            raise ValueError(f"diff: {other!r} is a comparison of runs and the other a cache check; diff a cache "
                             "check against another cache check")
        return diff_cachecheck(store, base, head)
    if n_boot < 100:
        raise ValueError(f"diff: n_boot {n_boot} is too few resamples for a 95% interval (at least 100)")
    if n_boot > MAX_BOOT:
        raise ValueError(f"diff: n_boot {n_boot} is more resamples than a 95% interval needs (at most {MAX_BOOT:,}; "
                         "the default is 2,000)")
    if seed < 0:
        raise ValueError(f"diff: seed {seed} must be a non-negative integer")
    if _is_comparison(store, base) and not _is_comparison(store, head):  # a label resolves against the side given by id
        brow = resolve_comparison(store, base)
        hrow = resolve_comparison(store, head, brow)
    else:
        hrow = resolve_comparison(store, head)
        brow = resolve_comparison(store, base, hrow)
    b_id, h_id = brow["comparison_id"], hrow["comparison_id"]
    if b_id == h_id:
        raise ValueError(f"diff: {base!r} and {head!r} are the same comparison {b_id}: nothing to diff")
    store.check_evidence([b_id, h_id], "diff")  # a regression must never read as none by losing rows
    if brow["model_hash"] != hrow["model_hash"]:
        raise ValueError(f"diff: the comparisons are of different models (base {b_id}: model_hash "
                         f"{brow['model_hash']}, head {h_id}: {hrow['model_hash']}); a diff across models measures "
                         f"the model, not the engine")
    pb, ph = _prompt_set(store, brow), _prompt_set(store, hrow)
    shared = sorted(pb & ph)
    note = None
    if not shared:
        raise ValueError(f"diff: base {b_id} ({len(pb)} prompts) and head {h_id} ({len(ph)} prompts) share no prompt")
    if pb != ph:
        if not common_prompts:
            raise ValueError(f"diff: base {b_id} holds {len(pb)} prompts and head {h_id} {len(ph)}, {len(shared)} of "
                             f"them shared; pass common_prompts=True (CLI: --common-prompts) to compare those")
        note = (f"compared the {len(shared)} prompts both hold (base {len(pb)}, head {len(ph)}); verdicts are the "
                f"comparisons' own, over all of their prompts")
    if n_boot * len(shared) > MAX_BOOT_DRAWS:  # [n_boot, prompts] int64 arrays, several of them
        raise ValueError(f"diff: n_boot {n_boot} x {len(shared)} shared prompts is {n_boot * len(shared):,} bootstrap "
                         f"draws, over {MAX_BOOT_DRAWS:,} (1 GiB an array); use fewer resamples")
    q = _Q(store, b_id, h_id, shared)
    verdicts = _verdict_changes(q, brow, hrow)
    idx = bootstrap_indices(len(shared), n_boot, seed)
    stats = []
    specs = [("kv_sigma_ratio", "kv_head_metrics", ("layer", "phase"), ("k_l2", "v_l2"), ("base_k_l2", "base_v_l2")),
             ("module_sigma_ratio", "module_metrics", ("module", "phase", "layer"), ("tgt_l2",), ("base_l2",)),
             ("logit_sigma_ratio", "(SELECT *, CASE WHEN gen_token_idx = 0 THEN 'prefill' ELSE 'decode' END AS phase "
                                   "FROM logit_token_metrics)", ("phase",), ("tgt_l2",), ("base_l2",))]
    for spec in specs:
        view = "logit_token_metrics" if spec[0] == "logit_sigma_ratio" else spec[1]
        if not q.has(view, "prompt_id", *spec[3], *spec[4]):
            continue
        stats += _sigma_stats(store, b_id, h_id, shared, idx, spec)
    bc = _bc_stats(store, q, b_id, h_id, shared, idx)
    if not bc and brow.get("three_way") and hrow.get("three_way") and q.has("kv_head_metrics", "prompt_id"):
        why = "aggregate-BC change not computed: it needs the raw errors of both comparisons (compare --raw-errors)"
        note = why if note is None else f"{note}; {why}"
    stats += bc
    return DiffResult(b_id, h_id, hrow["model_hash"], tuple(shared), note, tuple(verdicts), tuple(stats),
                      tuple(q.divergences()), q.tables(), seed, n_boot, SIGMA_MARGIN)


class _Q:
    """The SQL of a diff over both comparisons' rows (restricted to the compared prompts)."""

    def __init__(self, store, b, h, pids):
        self.store, self.b, self.h = store, b, h
        self.ids, self.id_params = _in("p", pids)
        t = store.sql("SELECT table_name, column_name FROM information_schema.columns")
        self.views: dict = {}
        for tn, c in zip(t.column(0).to_pylist(), t.column(1).to_pylist()):
            self.views.setdefault(tn, set()).add(c)

    def has(self, view, *cols) -> bool:
        return view in self.views and set(cols) <= self.views[view]

    def side(self, view, cid, prompts=False) -> str:
        """Rows of one side: ``$b`` (base) or ``$h`` (head), bound by ``params``."""
        extra = f" AND prompt_id IN ({self.ids})" if prompts else ""
        return f"(SELECT * FROM {view} WHERE comparison_id = {'$b' if cid == self.b else '$h'}{extra})"

    def params(self, prompts: bool) -> dict:
        return {"b": self.b, "h": self.h, **(self.id_params if prompts else {})}

    def joined(self, view, keys, cols, prompts=False) -> pa.Table | None:
        if not self.has(view, *keys, *cols):
            return None
        sel = ", ".join(f"b.{c} AS base_{c}, h.{c} AS head_{c}" + (
            f", h.{c} - b.{c} AS delta_{c}" if c not in ("passed", "status", "k_passed", "v_passed") else "")
            for c in cols)
        return self.store.sql(f"SELECT {', '.join(f'coalesce(b.{k}, h.{k}) AS {k}' for k in keys)}, {sel} "
                              f"FROM {self.side(view, self.b, prompts)} b "
                              f"FULL JOIN {self.side(view, self.h, prompts)} h "
                              f"USING ({', '.join(keys)}) ORDER BY ALL", params=self.params(prompts))

    def tables(self) -> dict:
        out = {
            "layer_deltas": self.joined("kv_layer_verdicts", ("layer",), ("passed", "k_sigma_ratio", "v_sigma_ratio",
                                                                           "k_bc", "v_bc", "max_k_linf", "max_v_linf")),
            "module_deltas": self.joined("module_verdicts", ("module", "phase"), ("passed", "sigma_ratio", "bc",
                                                                                  "max_l2_ratio")),
            "token_deltas": self.joined("logit_token_metrics", ("prompt_id", "gen_token_idx"),
                                        ("status", "linf_ratio", "l2_ratio", "topk_all_error"), prompts=True),
            "gen_bc_deltas": self.joined("kv_gen_bc", ("gen_token_idx", "layer"), ("k_bc", "v_bc")),
        }
        return {k: v for k, v in out.items() if v is not None}

    def divergences(self) -> list[dict]:
        if not self.has("logit_token_metrics", "divergence"):
            return []
        rows = self.store.sql(
            f"SELECT comparison_id, prompt_id, list(gen_token_idx ORDER BY gen_token_idx) AS d "
            f"FROM logit_token_metrics "
            f"WHERE comparison_id IN ($b, $h) AND prompt_id IN ({self.ids}) AND divergence "
            f"GROUP BY ALL", params=self.params(True)).to_pylist()
        div = {(r["comparison_id"], r["prompt_id"]): set(r["d"]) for r in rows}
        out = []
        for pid in sorted({p for _, p in div}):
            b, h = div.get((self.b, pid), set()), div.get((self.h, pid), set())
            if b != h:
                out.append({"prompt_id": pid, "new": sorted(h - b), "resolved": sorted(b - h)})
        return out


def _verdict_changes(q: _Q, brow: dict, hrow: dict) -> list[VerdictChange]:
    out = []

    def add(check, b, h, **where):
        if b != h:
            out.append(VerdictChange(check, b, h, b is True and h is not True, **where))

    for c in _VERDICT_COLUMNS:
        if c in brow or c in hrow:
            where = {}
            if c == "passed" and hrow.get("passed") is not True:
                where = {"layer": _str(hrow.get("failure_layer")), "module": hrow.get("failure_module"),
                         "phase": hrow.get("failure_phase")}
            add(c, brow.get(c), hrow.get(c), **where)
    t = q.joined("kv_layer_verdicts", ("layer",), ("passed",))
    for r in t.to_pylist() if t is not None else []:
        add("kv_layer", r["base_passed"], r["head_passed"], layer=r["layer"])
    t = q.joined("module_verdicts", ("module", "phase"), ("passed",))
    for r in t.to_pylist() if t is not None else []:
        from capturestore.comparators import decoder_layer_index

        li = decoder_layer_index(r["module"])
        add("module", r["base_passed"], r["head_passed"], module=r["module"], phase=r["phase"],
            layer=None if li is None else str(li))
    return out


# ---- history ------------------------------------------------------------------------------------------
_DERIVED = {
    "kv_sigma_ratio": "(SELECT max(greatest(k_sigma_ratio, v_sigma_ratio)) FROM kv_layer_verdicts v "
                      "WHERE v.comparison_id = c.comparison_id)",
    "kv_bc": "(SELECT min(least(k_bc, v_bc)) FROM kv_layer_verdicts v WHERE v.comparison_id = c.comparison_id)",
    "module_sigma_ratio": "(SELECT max(sigma_ratio) FROM module_verdicts v WHERE v.comparison_id = c.comparison_id)",
}


def _same_directory(stored: str, given: str) -> bool:
    """Whether the model path a run recorded and the one given name the same directory (a relative
    path, ``~``, a symlink or a trailing slash of either resolved here)."""
    if stored == given:
        return True
    try:
        a, b = (os.path.realpath(os.path.expanduser(x)) for x in (stored, given))
    except (OSError, ValueError):
        return False
    return a == b and os.path.isdir(a)


def history(store, model: str, metric: str = "logit_sigma_ratio") -> pa.Table:
    """``metric`` of every comparison whose actual run is of ``model``: its model_hash, or a path
    naming the directory the run recorded (relative or absolute, resolved here), or a model
    directory of the same content (its hash, when no path matches), oldest first: ``created_at, release, comparison_id, passed, <metric>``. ``metric``:
    a comparisons column, or ``kv_sigma_ratio`` (worst layer), ``kv_bc`` (lowest layer),
    ``module_sigma_ratio`` (worst module). ``store``: a ``Store`` or its path / URL."""
    from capturestore.store import as_store

    store = as_store(store)
    # the models compared, not every comparison's row: what grows with a year of CI is the answer below
    rows = store.sql(f"SELECT DISTINCT r.model_path, r.model_hash {_FROM}").to_pylist() \
        if _has_comparisons(store) else []
    cols = set(store.sql("DESCRIBE comparisons").column("column_name").to_pylist()) if rows else set()
    if metric in _DERIVED:
        view = {"kv_sigma_ratio": "kv_layer_verdicts", "kv_bc": "kv_layer_verdicts",
                "module_sigma_ratio": "module_verdicts"}[metric]
        names = set(store.sql("SELECT table_name FROM information_schema.tables").column(0).to_pylist())
        if view not in names:
            raise ValueError(f"history: no comparison stored {view} (needed for {metric})")
        expr = _DERIVED[metric]
    elif metric in cols and metric not in ("comparison_id",):
        expr = f"c.{metric}"
    else:
        choices = sorted(_DERIVED) + sorted(c for c in cols if c.endswith(("passed", "ratio", "bc")))
        raise ValueError(f"history: unknown metric {metric!r}; choose one of {', '.join(choices)}")
    paths = {r["model_path"] for r in rows if r["model_path"] is not None and _same_directory(r["model_path"], model)}
    hashes = {r["model_hash"] for r in rows if r["model_hash"] is not None}
    if not paths and model not in hashes and os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
        from extractors.models import model_content_hash  # a copied or moved checkpoint: the same content

        try:
            model = model_content_hash(os.path.expanduser(model))
        except Exception:  # noqa: BLE001 - unreadable weights: nothing matches, said below
            pass
    same, params = _in("path", sorted(paths))
    match = " OR ".join(["r.model_path = $model", "r.model_hash = $model", *([f"r.model_path IN ({same})"] if same else [])])
    t = store.sql(f"SELECT c.created_at, r.release, c.comparison_id, c.passed, {expr} AS {metric} "
                  f"FROM comparisons c JOIN runs r ON r.run_id = c.actual_run "
                  f"WHERE {match} "
                  f"ORDER BY c.created_at, c.comparison_id", params={**params, "model": model})
    if not t.num_rows:
        models = sorted({f"{r['model_path']} ({r['model_hash']})" for r in rows})
        raise ValueError(f"history: no comparison of model {model!r} (models compared: {', '.join(models) or 'none'})")
    return t
