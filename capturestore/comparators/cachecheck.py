"""The tables of a cache check (``capturestore.cachecheck``): a comparison of its own kind.

A cache check compares an engine's cached logits with its own full-prefix recomputation, not
stored runs, so it is not a comparator of ``compare_runs``: ``CacheCheckTables`` only declares
its tables (so the catalog shows them by their declared columns, docs/tables.md documents them,
and ``verify``/``gc`` treat them as comparison rows), and refuses to be asked for as a comparator.

- ``cachecheck_engines``: one row per check: engine, model, dtype, context, block size, window,
  padding side, measured noise and tolerance, the verdict and counts, wall time;
- ``cachecheck_scenarios``: one row per scenario: status (pass | fail | not_run), the reason a
  scenario did not run, the first failing request and position, the diagnosis;
- ``cachecheck_requests``: one row per request of a scenario: tokens and logits apart, the first
  differing position (any, token, logit), the first differing KV layer where the engine gives KV;
- ``cachecheck_positions``: one row per judged position: the cached and reference greedy tokens,
  the relative logit error and the tolerance.
"""
from __future__ import annotations

import math

import pyarrow as pa

from capturestore.comparators.base import Comparator, ComparisonContext, TableSpec

_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()


def _schema(*cols):
    return pa.schema([pa.field(n, t) for n, t in cols])


TABLES = {
    "cachecheck_engines": TableSpec(_schema(
        ("comparison_id", _S), ("engine", _S), ("model_path", _S), ("model_hash", _S), ("dtype", _S),
        ("max_context", _I), ("block_size", _I), ("window", _I), ("padding_side", _S), ("noise", _F),
        ("tolerance", _F), ("passed", _B), ("verdict", _S), ("n_scenarios", _I), ("n_passed", _I), ("n_failed", _I),
        ("n_not_run", _I), ("wall_s", _F)), 1),
    "cachecheck_scenarios": TableSpec(_schema(
        ("comparison_id", _S), ("scenario", _S), ("kind", _S), ("status", _S), ("reason", _S), ("n_requests", _I),
        ("n_failed", _I), ("first_request", _S), ("first_position", _I), ("first_kv_layer", _I),
        ("max_logit_err", _F), ("tolerance", _F), ("diagnosis", _S), ("summary", _S)), 1),
    "cachecheck_requests": TableSpec(_schema(
        ("comparison_id", _S), ("scenario", _S), ("request", _S), ("kind", _S), ("status", _S), ("n_positions", _I),
        ("n_token_mismatch", _I), ("first_position", _I), ("first_token_position", _I),
        ("first_logit_position", _I), ("max_logit_err", _F), ("tolerance", _F), ("kv_layer", _I),
        ("kv_position", _I), ("kv_err", _F), ("diagnosis", _S), ("detail", _S)), 1),
    "cachecheck_positions": TableSpec(_schema(
        ("comparison_id", _S), ("scenario", _S), ("request", _S), ("position", _I), ("cached_token", _I),
        ("reference_token", _I), ("token_match", _B), ("token_ok", _B), ("logit_err", _F), ("tolerance", _F),
        ("within_tolerance", _B)), 1),
}


class CacheCheckTables(Comparator):
    """Declares the cache check's tables (module docstring); not a comparator of stored runs."""

    name = "cachecheck"
    tables = TABLES

    def prepare(self, context: ComparisonContext) -> None:
        raise ValueError("cachecheck is not a comparator of stored runs: run `capturestore cachecheck --model DIR` "
                         "(capturestore.cachecheck.cachecheck)")


def _f(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def engine_row(cid, result, model, model_hash, adapter) -> dict:
    return {"comparison_id": cid, "engine": result.engine, "model_path": model, "model_hash": model_hash,
            "dtype": result.dtype, "max_context": getattr(adapter, "max_context", None),
            "block_size": getattr(adapter, "block_size", None), "window": getattr(adapter, "window", None),
            "padding_side": getattr(adapter, "padding_side", None), "noise": _f(result.noise),
            "tolerance": _f(result.tolerance), "passed": result.passed, "verdict": result.verdict(),
            "n_scenarios": len(result.scenarios),
            "n_passed": sum(s.status == "pass" for s in result.scenarios), "n_failed": len(result.failed),
            "n_not_run": len(result.not_run), "wall_s": _f(result.wall_s)}


def scenario_rows(cid, result) -> list:
    rows = []
    for s in result.scenarios:
        first = s.failed[0] if s.failed else None
        errs = [r.judgement.max_err for r in s.requests if r.judgement is not None]
        rows.append({"comparison_id": cid, "scenario": s.name, "kind": s.kind, "status": s.status, "reason": s.reason,
                     "n_requests": len(s.requests), "n_failed": len(s.failed),
                     "first_request": None if first is None else first.request,
                     "first_position": None if first is None else first.first_position,
                     "first_kv_layer": None if first is None or first.kv_diff is None else first.kv_diff[0],
                     "max_logit_err": _f(max(errs)) if errs else None, "tolerance": _f(result.tolerance),
                     "diagnosis": s.diagnosis, "summary": s.summary()})
    return rows


def request_rows(cid, result) -> list:
    rows = []
    for s in result.scenarios:
        for r in s.requests:
            j = r.judgement
            rows.append({"comparison_id": cid, "scenario": s.name, "request": r.request, "kind": r.kind,
                         "status": r.status, "n_positions": len(r.positions),
                         "n_token_mismatch": None if j is None else int((~j.token_match).sum()),
                         "first_position": r.first_position,
                         "first_token_position": None if j is None else j.first_token_diff,
                         "first_logit_position": None if j is None else j.first_logit_diff,
                         "max_logit_err": None if j is None else _f(j.max_err),
                         "tolerance": _f(result.tolerance),
                         "kv_layer": None if r.kv_diff is None else r.kv_diff[0],
                         "kv_position": None if r.kv_diff is None else r.kv_diff[1],
                         "kv_err": None if r.kv_diff is None else _f(r.kv_diff[2]),
                         "diagnosis": r.diagnosis, "detail": r.detail})
    return rows


def position_rows(cid, result) -> dict:
    """Columns (one row per judged position), built as arrays."""
    import numpy as np

    cols = {k: [] for k in TABLES["cachecheck_positions"].schema.names}
    for s in result.scenarios:
        for r in s.requests:
            j = r.judgement
            if j is None:
                continue
            n = len(j.positions)
            cols["comparison_id"] += [cid] * n
            cols["scenario"] += [s.name] * n
            cols["request"] += [r.request] * n
            cols["position"] += j.positions.tolist()
            cols["cached_token"] += j.cached_token.tolist()
            cols["reference_token"] += j.reference_token.tolist()
            cols["token_match"] += j.token_match.tolist()
            cols["token_ok"] += j.token_ok.tolist()
            cols["logit_err"] += [None if not np.isfinite(e) else float(e) for e in j.logit_err]
            cols["tolerance"] += [j.tol] * n
            cols["within_tolerance"] += j.logit_ok.tolist()
    return cols
