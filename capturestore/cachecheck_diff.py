"""Diff two cache checks (two releases of an engine, ``capturestore cachecheck``): which scenarios
went from pass to fail (or stopped running), which were fixed, and, where a scenario fails in
both, how its first differing request / position, magnitude and diagnosis moved.

``diff_cachecheck(store, base, head)`` reads the ``cachecheck_scenarios`` and
``cachecheck_requests`` rows both checks stored (nothing is rerun). BASE and HEAD are comparison
ids or labels (``--label`` of the check; the latest check with that label). ``diff.diff`` (and so
``capturestore diff``, whose text form is ``format_cachecheck_diff`` in the CLI) calls it when both
sides are cache checks. A regression: a scenario that passed in base and
in head fails, did not run, or is missing; a request that passed in base and fails in head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CacheCheckDiff", "ScenarioChange", "diff_cachecheck", "is_cachecheck"]


def _views(store) -> set:
    return set(store.sql("SELECT table_name FROM information_schema.tables").column("table_name").to_pylist())


def _checks(store) -> list[dict]:
    """Cache-check comparisons, newest first: comparison id, label, created_at, model hash, engine."""
    if not {"comparisons", "cachecheck_engines"} <= _views(store):
        return []
    return store.sql("SELECT c.comparison_id, c.label, c.created_at, e.model_hash, e.engine, e.dtype, e.verdict "
                     "FROM comparisons c JOIN cachecheck_engines e USING (comparison_id) "
                     "ORDER BY c.created_at DESC, c.comparison_id DESC").to_pylist()


def is_cachecheck(store, ref: str) -> bool:
    """Whether ``ref`` (a comparison id or a label) names a cache check in ``store``."""
    return any(ref in (r["comparison_id"], r["label"]) for r in _checks(store))


def _resolve(store, ref: str) -> dict:
    rows = _checks(store)
    for r in rows:
        if r["comparison_id"] == ref:
            return r
    for r in rows:  # newest first
        if r["label"] == ref:
            return r
    labels = sorted({r["label"] for r in rows if r["label"]})
    raise ValueError(f"diff: {ref!r} is neither the id nor the label of a cache check in {store.root} "
                     f"(cache-check labels: {', '.join(labels) or 'none'})")


@dataclass(frozen=True)
class ScenarioChange:
    """One scenario in both checks (or one of them). ``change``: ``regressed`` (passed in base; in head
    it fails, did not run or is missing), ``fixed``, ``still failing``, ``unchanged``, ``new``."""

    scenario: str
    base_status: str | None
    head_status: str | None
    change: str
    base_first: tuple | None = None  # (request, position) of the first failure
    head_first: tuple | None = None
    base_err: float | None = None  # worst relative logit error of the scenario
    head_err: float | None = None
    tolerance: tuple = (None, None)
    base_diagnosis: str | None = None
    head_diagnosis: str | None = None
    requests_regressed: tuple = ()  # requests passing in base, failing in head

    @property
    def regression(self) -> bool:
        return self.change == "regressed" or bool(self.requests_regressed)


@dataclass
class CacheCheckDiff:
    base: dict
    head: dict
    scenarios: list = field(default_factory=list)

    @property
    def regression(self) -> bool:
        return any(s.regression for s in self.scenarios)

    @property
    def regressions(self) -> list:
        return [s for s in self.scenarios if s.regression]

    def to_dict(self) -> dict:
        """The diff as plain values (``capturestore diff --format json``)."""
        from dataclasses import asdict

        return {"kind": "cachecheck", "base": {k: str(v) if v is not None else None for k, v in self.base.items()},
                "head": {k: str(v) if v is not None else None for k, v in self.head.items()},
                "regression": self.regression,
                "scenarios": [asdict(s) | {"regression": s.regression} for s in self.scenarios]}


def _scenario_rows(store, cid) -> dict:
    return {r["scenario"]: r for r in store.sql(
        "SELECT * FROM cachecheck_scenarios WHERE comparison_id = $c", params={"c": cid}).to_pylist()}


def _request_status(store, cid) -> dict:
    if "cachecheck_requests" not in _views(store):
        return {}
    return {(r["scenario"], r["request"]): r["status"] for r in store.sql(
        "SELECT scenario, request, status FROM cachecheck_requests WHERE comparison_id = $c",
        params={"c": cid}).to_pylist()}


def diff_cachecheck(store, base: str, head: str) -> CacheCheckDiff:
    """Diff cache check ``head`` against ``base`` (module docstring). ValueError in one line: an
    unknown id or label, the same check twice, checks of different models."""
    b, h = _resolve(store, base), _resolve(store, head)
    if b["comparison_id"] == h["comparison_id"]:
        raise ValueError(f"diff: {base!r} and {head!r} are the same cache check {b['comparison_id']}: nothing to diff")
    if b["model_hash"] and h["model_hash"] and b["model_hash"] != h["model_hash"]:
        raise ValueError(f"diff: the cache checks are of different models (base {b['comparison_id']}: model_hash "
                         f"{b['model_hash']}, head {h['comparison_id']}: {h['model_hash']}); a diff across models "
                         "measures the model, not the engine")
    store.check_evidence([b["comparison_id"], h["comparison_id"]], "diff")
    bs, hs = _scenario_rows(store, b["comparison_id"]), _scenario_rows(store, h["comparison_id"])
    br, hr = _request_status(store, b["comparison_id"]), _request_status(store, h["comparison_id"])
    out = []
    for name in [*bs, *[n for n in hs if n not in bs]]:
        x, y = bs.get(name), hs.get(name)
        sb, sh = x and x["status"], y and y["status"]
        if sb == "pass" and sh != "pass":
            change = "regressed"
        elif sb is None:
            change = "new"
        elif sb != "pass" and sh == "pass":
            change = "fixed"
        elif sb == "fail" and sh == "fail":
            change = "still failing"
        else:
            change = "unchanged"
        worse = tuple(sorted(r for (s, r), st in hr.items() if s == name and st == "fail" and br.get((s, r)) == "pass"))

        def first(row):
            return None if not row or row["first_request"] is None else (row["first_request"], row["first_position"])

        out.append(ScenarioChange(name, sb, sh, change, first(x), first(y), x and x["max_logit_err"],
                                  y and y["max_logit_err"], (x and x["tolerance"], y and y["tolerance"]),
                                  x and x["diagnosis"], y and y["diagnosis"], worse))
    return CacheCheckDiff(b, h, out)


def to_dict(d: CacheCheckDiff) -> dict:
    return d.to_dict()
