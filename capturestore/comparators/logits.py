"""The logits comparator: per-token logit checks of every generation token, and the logit verdict.

``logit_token_metrics``: one row per prompt x generation token (status, top-k errors, divergence,
three-way L-inf/L2 of BF16 and target vs FP32, their ratios and BC). Verdict:
``metrics.verdict.aggregate_logit_verdict``; its evidence is the first failing token.

Like with like: a run whose config says ``logits_kind: "log_softmax"`` (full-vocabulary
log-probabilities, e.g. ``extractors.vllm_server``) is compared with the log-softmax of the
other runs' logits, computed here in float64 per row. Runs that all hold logits (``logits``,
``raw_logits`` or unsaid) are compared as stored, untouched.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from capturestore.comparators.base import (
    Comparator,
    Localisation,
    PromptCaptures,
    PromptResult,
    TableSpec,
    Verdict,
    finite_or_null,
    phase_at,
)

_f = finite_or_null

LOG_SOFTMAX_KINDS = ("log_softmax",)  # logits_kind values of runs holding log-probabilities


def log_softmax_rows(x) -> np.ndarray:
    """float32 log-softmax of each row of ``[gen_token, vocab]`` (computed in float64; ``-inf``
    entries stay ``-inf``, a row with a NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(np.where(np.isneginf(x), -np.inf, x), axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    return (x - lse).astype(np.float32)


def run_logits_kind(store, run_id: str):
    """The ``logits_kind`` a run's config records (None when it says none)."""
    rows = store.runs().to_pylist()
    row = next((r for r in rows if r["run_id"] == run_id), None)
    if row is None or not row.get("config"):
        return None
    try:
        return json.loads(row["config"]).get("logits_kind")
    except (ValueError, AttributeError):
        return None
_D, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()

DEFAULT_TOPK = (5, 50, 1000, "all")  # metrics.logits.DEFAULT_TOLERANCE_MAP's keys

LOGIT_TOKEN_METRICS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("gen_token_idx", _I), ("position", _I),
    ("status", _S), ("passed", _B), ("divergence", _B), ("divergence_difference", _D),
    ("divergence_threshold", _D), ("expected_token", _I), ("actual_token", _I), ("teacher_token", _I),
    ("shift", _D), *((f"topk_{k}_error", _D) for k in DEFAULT_TOPK),
    ("base_linf", _D), ("tgt_linf", _D), ("base_l2", _D), ("tgt_l2", _D),
    ("linf_ratio", _D), ("l2_ratio", _D), ("bc", _D),
]), 1)


class LogitsComparator(Comparator):
    """Every generation token of every prompt through ``metrics.logits.validate_token_logits``.

    tol_map: the static top-k tolerances (``metrics.logits.DEFAULT_TOLERANCE_MAP`` when None); a
    key other than the defaults adds a ``topk_<k>_error`` column after the declared ones."""

    name = "logits"
    tables = {"logit_token_metrics": LOGIT_TOKEN_METRICS}
    needs = ("logits",)
    localisation_rank = 10
    comparison_fields = (
        pa.field("logit_passed", _B), pa.field("logit_decided_by", _S), pa.field("logit_sigma_ratio", _D),
        pa.field("logit_min_bc", _D), pa.field("logit_summary", _S),
    )  # first_failing_token is a column of the comparisons tail; this comparator fills it

    def __init__(self, tol_map=None):
        self.tol_map = tol_map
        self.per_prompt: list = []  # [[token results]] per prompt, as aggregate_logit_verdict takes them (reduce)
        self.failures: list[tuple] = []  # (gen_token_idx, prompt_id, status, prompt_len) (reduce)
        self.log_softmax_roles: tuple = ()  # roles whose stored logits are log-softmaxed before comparing

    def prepare(self, context) -> None:
        super().prepare(context)
        kinds = {role: run_logits_kind(context.store, rid) for role, rid in context.runs.items()}
        if any(k in LOG_SOFTMAX_KINDS for k in kinds.values()):
            self.log_softmax_roles = tuple(r for r, k in kinds.items() if k not in LOG_SOFTMAX_KINDS)

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """The prompt's rows; partial: (its token results, its failures)."""
        from metrics.logits import validate_token_logits

        lg = {role: prompt.logits(role) for role in prompt.runs}
        for role in self.log_softmax_roles:  # like with like: log-probabilities against log-probabilities
            lg[role] = log_softmax_rows(lg[role])
        shapes = {role: tuple(x.shape) for role, x in lg.items()}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"compare_runs: prompt {prompt.prompt_id}: logits shapes differ between roles: {shapes}")
        three_way = "baseline" in lg
        cid, pid, plen, tokens = prompt.comparison_id, prompt.prompt_id, prompt.prompt_len, prompt.tokens
        for role in ("baseline", "expected"):  # the yardsticks: NaN or +inf there would judge nothing
            if role in lg:
                x = np.asarray(lg[role], dtype=np.float32)
                bad = ~np.isfinite(x) & (x != -np.inf)  # -inf is a masked position (dropped), not broken
                if bad.any():
                    g = int(np.nonzero(bad.any(axis=1))[0][0])
                    raise ValueError(f"compare_runs: prompt {pid}: {role} run {prompt.runs[role]} holds "
                                     f"{int(bad.sum())} NaN/+inf logits (first at gen token {g}); a broken "
                                     f"reference cannot judge the target")
        rows, results, failures = [], [], []
        for g in range(lg["expected"].shape[0]):
            try:
                r = validate_token_logits(lg["expected"][g], lg["actual"][g], tol_map=self.tol_map,
                                          baseline=lg["baseline"][g] if three_way else None, gen_idx=g)
            except ValueError as e:
                raise ValueError(f"compare_runs: prompt {pid}, actual run {prompt.runs['actual']}: {e}") from None
            results.append(r)
            tw = r.three_way
            rows.append({
                "comparison_id": cid, "prompt_id": pid, "gen_token_idx": g, "position": plen + g,
                "status": r.status.name, "passed": r.passed, "divergence": r.divergence,
                "divergence_difference": _f(r.divergence_difference),
                "divergence_threshold": _f(r.divergence_threshold),
                "expected_token": r.expected_token, "actual_token": r.actual_token,
                "teacher_token": int(tokens[plen + g]) if plen + g < len(tokens) else None,
                "shift": _f(r.shift),
                **{f"topk_{k}_error": _f(e) for k, e in r.error_map.items()},
                "base_linf": _f(tw.base_linf) if tw else None, "tgt_linf": _f(tw.tgt_linf) if tw else None,
                "base_l2": _f(tw.base_l2) if tw else None, "tgt_l2": _f(tw.tgt_l2) if tw else None,
                "linf_ratio": _f(tw.linf_ratio) if tw else None, "l2_ratio": _f(tw.l2_ratio) if tw else None,
                "bc": _f(tw.bc) if tw else None,
            })
            if not r.passed:
                failures.append((g, pid, r.status.name, plen))
        return PromptResult({"logit_token_metrics": rows}, (results, failures))

    def reduce(self, partials: list) -> dict:
        self.per_prompt = [[results] for results, _ in partials]
        self.failures = [f for _, failures in partials for f in failures]
        return {}

    def first_failing_token(self) -> dict | None:
        """The first failing token (lowest generation index, then prompt id), or None."""
        if not self.failures:
            return None
        g, pid, status, _ = min(self.failures, key=lambda f: (f[0], f[1]))
        return {"prompt_id": pid, "gen_token_idx": g, "status": status}

    def verdict(self) -> Verdict | None:
        from metrics.verdict import aggregate_logit_verdict

        if not self.per_prompt:
            return None
        v = aggregate_logit_verdict(self.per_prompt, tol_map=self.tol_map)
        loc = None
        first = self.first_failing_token()
        if first is not None:
            plen = next(f[3] for f in self.failures if (f[0], f[1]) == (first["gen_token_idx"], first["prompt_id"]))
            # a logit row j is computed at position prompt_len - 1 + j
            loc = Localisation(phase=phase_at(plen - 1 + first["gen_token_idx"], plen), token=first["gen_token_idx"])
        return Verdict(self.name, bool(v.passed), v.summary(), loc, v, self.localisation_rank)

    def comparison_columns(self, verdict: Verdict | None, passed: bool) -> dict:
        v = None if verdict is None else verdict.detail
        first = None if passed else self.first_failing_token()
        return {
            "logit_passed": None if v is None else bool(v.passed),
            "logit_decided_by": None if v is None else v.decided_by,
            "logit_sigma_ratio": None if v is None else _f(v.sigma_ratio),
            "logit_min_bc": None if v is None else _f(v.min_bc),
            "logit_summary": None if v is None else v.summary(),
            "first_failing_token": json.dumps(first) if first else None,
        }
