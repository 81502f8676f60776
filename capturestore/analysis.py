"""Comparisons: bind stored runs to roles, compute the metrics, store them as long tables.

A comparison binds runs to roles (``baseline`` optional, ``expected``, ``actual``; DESIGN.md
"Roles") and owns the metrics computed from them. Everything here reads captures through the
store, hands arrays to ``metrics`` (which never sees a path) and appends the results as Parquet
segments, so a report or a user's SQL reads the same numbers later without recomputing them.

Tables written (one segment each per comparison; ``comparisons`` last, so a comparison row
never points at metrics that are not there):

- ``logit_token_metrics``: one row per prompt x generation token: status, top-k errors,
  divergence, and three-way L-inf/L2 of BF16 and target vs FP32 with their ratios and BC.
- ``kv_head_metrics``: one row per prompt x position x layer x KV head (columns as
  ``metrics.kv.HeadMetrics``), ``gen_token_idx = position - prompt_len`` (negative = prefill).
- ``kv_token_bc``: per prompt x position x layer BC of the target vs BF16 absolute errors.
- ``kv_gen_bc``: cross-prompt BC per generation index and layer (errors of all prompts pooled).
- ``kv_layer_verdicts``: the pooled per-layer KV verdict numbers (sigma-ratio, BC, noise BC...,
  ``*_nonfinite``: actual values non-finite where the references are finite).
- ``comparisons``: run ids by role, both verdicts, which check decided, summaries.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

__all__ = ["ComparisonResult", "compare_runs", "find_reference_run", "prompt_split"]

ROLES = ("baseline", "expected", "actual")


@dataclass(frozen=True)
class ComparisonResult:
    """What ``compare_runs`` computed and stored."""

    comparison_id: str
    runs: dict  # role -> run_id
    prompt_ids: tuple
    logit_verdict: Any  # metrics.verdict.LogitVerdict | None
    kv_verdict: Any  # metrics.verdict.KVVerdict | None
    kv_layers: tuple = ()  # per-layer dicts: layer, max k/v L-inf of target and BF16, pooled BC, pass
    first_failing_token: dict | None = None
    phase: str | None = None  # "prefill" | "decode" | None (nothing failed)
    models_differ: bool = False  # the runs' model_hash differ (compared because the user allowed it)

    @property
    def passed(self) -> bool:
        """Every verdict that ran passed, and at least one ran (as the ``comparisons`` row says).
        A KV verdict that compared nothing (the actual run lacks the references' KV) never passes."""
        checks = [v.passed for v in (self.logit_verdict, self.kv_verdict) if v is not None]
        return bool(checks) and all(c is True for c in checks)


def _committed_runs(store) -> dict[str, dict]:
    return {r["run_id"]: r for r in store.runs().to_pylist() if r.get("status") == "complete"}


def prompt_split(store, run_id: str, prompt_id: str) -> tuple[np.ndarray, int]:
    """(tokens int32 [position], prompt_len) of one capture: the prompt is the first ``prompt_len``
    tokens, the rest are the teacher/generated tokens whose logits the run holds."""
    tokens = store.read_tokens(run_id, prompt_id)
    rows = store.sql(
        f"SELECT * FROM prompts WHERE run_id = '{run_id}' AND prompt_id = '{prompt_id}'"
    ).to_pylist()
    if rows and rows[0].get("n_prompt_tokens") is not None:
        return tokens, int(rows[0]["n_prompt_tokens"])
    n_gen = int(store.read_logits(run_id, prompt_id).shape[0])
    return tokens, len(tokens) - n_gen


def find_reference_run(store, *, model_hash: str, dtype: str, prompt_ids, engine: str = "hf",
                       teacher_tokens: dict | None = None) -> str | None:
    """The newest complete ``engine`` run of ``model_hash`` in ``dtype`` holding every prompt in
    ``prompt_ids`` (and, when given, the same captured tokens per prompt), or None.

    References are captured once and reused by every comparison sharing model + prompts + dtype.
    """
    want = set(prompt_ids)
    runs = sorted(
        (r for r in _committed_runs(store).values()
         if r["engine"] == engine and r["model_hash"] == model_hash and r["dtype"] == dtype),
        key=lambda r: r["committed_at"], reverse=True,
    )
    for r in runs:
        have = {p["prompt_id"] for p in store.prompts(r["run_id"]).to_pylist()}
        if not want <= have:
            continue
        if teacher_tokens and any(
            not np.array_equal(store.read_tokens(r["run_id"], pid), np.asarray(t, dtype=np.int32))
            for pid, t in teacher_tokens.items()
        ):
            continue
        return r["run_id"]
    return None


def _common_prompts(store, runs: dict) -> list[str]:
    order = [p["prompt_id"] for p in store.prompts(runs["expected"]).to_pylist()]
    common = set(order)
    for role, rid in runs.items():
        common &= {p["prompt_id"] for p in store.prompts(rid).to_pylist()}
    if not common:
        raise ValueError(f"runs {runs} share no prompt: nothing to compare")
    return [p for p in order if p in common]


def _kv_layer_names(store, runs: dict) -> dict:
    """``{(run_id, prompt_id): {kv group (None: the default array): layer names}}`` of every KV
    capture of ``runs``, in one query. A run whose layers differ in shape holds one KV array per
    group (``write_kv(..., group=)``); their layers are compared together."""
    ids = ", ".join(f"'{rid}'" for rid in runs.values())
    rows = store.sql(
        f"SELECT run_id, prompt_id, kv_group, layer_names FROM captures WHERE run_id IN ({ids}) AND kind = 'kv_k'"
    ).to_pylist()
    out: dict = {}
    for r in rows:
        out.setdefault((r["run_id"], r["prompt_id"]), {})[r["kv_group"] or None] = r["layer_names"]
    return out


def _all_layers(groups: dict | None) -> list:
    return [n for names in (groups or {}).values() for n in (names or [])]


def _check_models(known: dict, runs: dict, allow: bool) -> bool:
    """Whether the runs' ``model_hash`` differ; ValueError if they do and ``allow`` is False.
    An unknown hash (None) differs from a known one: nothing says the model is the same."""
    hashes = {role: known[rid].get("model_hash") for role, rid in runs.items()}
    if len(set(hashes.values())) <= 1:
        return False
    if not allow:
        said = ", ".join(f"{role} run {runs[role]}: {h if h is not None else 'unknown'}" for role, h in hashes.items())
        raise ValueError(
            f"compare_runs: the runs are of different models (model_hash {said}); comparing them measures the "
            f"model difference, not the engine: pass allow_different_models=True (CLI: --allow-different-models) "
            f"if that is meant"
        )
    return True


def _kv_coverage(runs: dict, prompt_ids, kv_names: dict) -> str | None:
    """Check the KV layers of every prompt before anything is computed or stored.

    The references are the expected run and (three-way) the baseline. Returns None when every
    prompt the references hold KV of has KV in every run, or the reason the KV cannot be
    compared (a run lacks a prompt's KV). Raises ValueError naming run, prompt and layers when a
    run holds KV but lacks a layer the references hold."""
    refs = [r for r in ("baseline", "expected") if r in runs]
    missing = []
    for pid in prompt_ids:
        ref_layers = {}  # layer -> the reference roles holding it
        for role in refs:
            for name in _all_layers(kv_names.get((runs[role], pid))):
                ref_layers.setdefault(name, []).append(role)
        if (runs["expected"], pid) not in kv_names:
            continue  # the expected run holds no KV of this prompt: nothing to compare it with
        for role, rid in runs.items():
            if (rid, pid) not in kv_names:
                missing.append((role, rid, pid))
                continue
            have = set(_all_layers(kv_names[(rid, pid)]))
            lacks = [n for n in ref_layers if n not in have]
            if lacks:
                raise ValueError(
                    f"compare_runs: {role} run {rid}, prompt {pid} lacks KV layer(s) {lacks[:4]}"
                    f"{'...' if len(lacks) > 4 else ''} ({len(lacks)} of {len(ref_layers)}) that the references hold "
                    f"({', '.join(f'{r} run {runs[r]}' for r in refs)}); a layer missing from the evidence is no pass"
                )
    if not missing:
        return None
    role, rid, _ = missing[0]
    pids = [p for r, _, p in missing if r == role]
    return (f"{role} run {rid} holds no KV for {len(pids)} prompt(s) ({', '.join(pids[:3])}"
            f"{'...' if len(pids) > 3 else ''}) whose KV the expected run {runs['expected']} holds; "
            f"compare logits only with kv=False (CLI: --no-kv)")


def _kv_dict(store, run_id, pid, groups: dict):
    """``{layer: (k, v)}`` with ``k, v: [1, kv_head, position, head_dim]`` from a stored capture (the
    layers of every KV group of it)."""
    out = {}
    for group, names in groups.items():
        k, v = store.read_kv(run_id, pid, group=group)
        names = list(names) if names else [f"{group + '.' if group else ''}{i}" for i in range(k.shape[0])]
        out.update({n: (k[i][None], v[i][None]) for i, n in enumerate(names)})
    return out


def _f(x) -> float | None:
    """Float for a table cell: NaN/inf become NULL so SQL aggregates skip them."""
    x = float(x)
    return x if math.isfinite(x) else None


def compare_runs(store, *, expected_run: str, actual_run: str, baseline_run: str | None = None,
                 label: str | None = None, logits: bool = True, kv: bool = True, tol_map=None,
                 kv_verdict_config=None, progress=None, allow_different_models: bool = False) -> ComparisonResult:
    """Compare stored captures of ``actual_run`` against ``expected_run`` (and ``baseline_run``
    in three-way mode), store every metric, and return both verdicts.

    All runs must hold the same captured tokens for each shared prompt (teacher forcing), else
    ``ValueError`` names the prompt and the first differing position. Prompts are processed one
    at a time, so memory is bounded by one prompt's captures of the three runs.

    Refused with ``ValueError`` before anything is stored: runs of different ``model_hash``
    (unless ``allow_different_models``; the comparison row then records ``models_differ``), and
    a run whose KV lacks a layer the references hold. When the references hold KV of a prompt
    and another run does not, the KV verdict is "not compared" and the comparison does not pass
    (``kv=False`` compares logits only). A two-way comparison stores KV metrics but has no noise
    to judge them against: its KV verdict is "not judged" and it does not pass unless
    ``kv=False``. Non-finite actual KV where the references are finite fails the KV verdict
    (``metrics.verdict``).
    """
    from metrics.kv import aggregate_kv_bc_arrays, compare_kv_caches
    from metrics.logits import validate_token_logits
    from metrics.verdict import KVVerdict, aggregate_kv_verdict, aggregate_logit_verdict

    from capturestore.integrity import commit_comparison

    runs = {"expected": expected_run, "actual": actual_run}
    if baseline_run is not None:
        runs = {"baseline": baseline_run, **runs}
    known = _committed_runs(store)
    for role, rid in runs.items():
        if rid not in known:
            raise ValueError(f"compare_runs: {role} run {rid!r} is not a complete run of {store.root}")
    three_way = baseline_run is not None
    models_differ = _check_models(known, runs, allow_different_models)
    prompt_ids = _common_prompts(store, runs)
    kv_names = _kv_layer_names(store, runs) if kv else {}
    kv_not_compared = _kv_coverage(runs, prompt_ids, kv_names) if kv else None
    if kv_not_compared is not None:
        kv_names = {}  # judge no prompt's KV rather than some of them
    cid = f"cmp-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"

    logit_rows, head_cols, bc_rows = [], [], []
    per_prompt_logits, raw_errors, prompt_lens, kv_pids = [], [], [], []
    for n, pid in enumerate(prompt_ids):
        if progress:
            progress(f"comparing prompt {n + 1}/{len(prompt_ids)} ({pid})")
        tokens, plen = prompt_split(store, runs["expected"], pid)
        for role, rid in runs.items():
            other = store.read_tokens(rid, pid)
            if other.shape != tokens.shape or not np.array_equal(other, tokens):
                diff = next((i for i, (a, b) in enumerate(zip(other, tokens)) if a != b), min(len(other), len(tokens)))
                raise ValueError(
                    f"compare_runs: prompt {pid}: {role} run {rid} captured other tokens than expected run "
                    f"{runs['expected']} ({len(other)} vs {len(tokens)} tokens, first difference at position {diff}); "
                    f"runs must be teacher-forced on the same tokens"
                )
        if logits:
            lg = {role: store.read_logits(rid, pid) for role, rid in runs.items()}
            shapes = {role: tuple(x.shape) for role, x in lg.items()}
            if len(set(shapes.values())) != 1:
                raise ValueError(f"compare_runs: prompt {pid}: logits shapes differ between roles: {shapes}")
            token_results = []
            for g in range(lg["expected"].shape[0]):
                r = validate_token_logits(
                    lg["expected"][g], lg["actual"][g], tol_map=tol_map,
                    baseline=lg["baseline"][g] if three_way else None, gen_idx=g,
                )
                token_results.append(r)
                tw = r.three_way
                logit_rows.append({
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
            per_prompt_logits.append([token_results])
        if kv and all((rid, pid) in kv_names for rid in runs.values()):
            kvs = {role: _kv_dict(store, rid, pid, kv_names[(rid, pid)]) for role, rid in runs.items()}
            out = compare_kv_caches(kvs["expected"], kvs["actual"], baseline_kv=kvs.get("baseline"),
                                    return_raw_errors=three_way)
            res, raw = out if three_way else (out, None)
            cols = res.to_columns()
            for repeated in ("batch", "k_bc", "v_bc"):  # one row per prompt; BCs live in kv_token_bc
                cols.pop(repeated)
            pos = cols.pop("token")
            n_rows = len(pos)
            head_cols.append({
                "comparison_id": np.full(n_rows, cid, dtype=object), "prompt_id": np.full(n_rows, pid, dtype=object),
                "position": pos, "gen_token_idx": pos - plen,
                "phase": np.where(pos < plen, "prefill", "decode").astype(object), **cols,
            })
            if three_way:
                T, L = res.k_bc.shape[1:]
                t_idx, l_idx = np.meshgrid(np.arange(T), np.arange(L), indexing="ij")
                bc_rows.append({
                    "comparison_id": np.full(T * L, cid, dtype=object), "prompt_id": np.full(T * L, pid, dtype=object),
                    "position": t_idx.ravel(), "gen_token_idx": t_idx.ravel() - plen,
                    "layer": np.asarray(res.layers, dtype=object)[l_idx.ravel()],
                    "k_bc": res.k_bc[0].ravel(), "v_bc": res.v_bc[0].ravel(),
                })
                raw_errors.append(raw)
                prompt_lens.append(plen)
                kv_pids.append(pid)

    logit_verdict = aggregate_logit_verdict(per_prompt_logits, tol_map=tol_map) if per_prompt_logits else None
    kv_verdict = None
    kv_layers: list[dict] = []
    staged: dict = {}  # table -> rows; commit_comparison appends them, then the comparisons row (the commit marker)
    if kv_not_compared is not None:
        kv_verdict = KVVerdict.not_compared_because(kv_not_compared, kv_verdict_config)
    elif head_cols and not three_way:
        kv_verdict = KVVerdict.not_judged_because(
            "two-way comparison: without a baseline (FP32) run there is no dtype noise to judge the KV against "
            "(its metrics are in kv_head_metrics); pass baseline_run (CLI: --baseline) for a KV verdict, or "
            "kv=False (CLI: --no-kv) to judge logits only", kv_verdict_config)
    if raw_errors:
        kv_verdict = aggregate_kv_verdict(raw_errors, prompt_lens=prompt_lens, config=kv_verdict_config,
                                          prompt_ids=kv_pids, run=actual_run)
        layers, gk, gv = aggregate_kv_bc_arrays(raw_errors, prompt_lens)
        G, L = gk.shape
        g_idx, l_idx = np.meshgrid(np.arange(G), np.arange(L), indexing="ij")
        if G * L:
            staged["kv_gen_bc"] = {
                "comparison_id": [cid] * (G * L), "gen_token_idx": g_idx.ravel().tolist(),
                "layer": [layers[i] for i in l_idx.ravel()], "k_bc": [_f(x) for x in gk.ravel()],
                "v_bc": [_f(x) for x in gv.ravel()], "n_prompts": [len(raw_errors)] * (G * L),
            }
        kv_layers = _kv_layer_rows(cid, kv_verdict, head_cols)
        staged["kv_layer_verdicts"] = kv_layers
    if head_cols:
        staged["kv_head_metrics"] = _concat_columns(head_cols)
    if bc_rows:
        staged["kv_token_bc"] = _concat_columns(bc_rows)
    if logit_rows:
        staged["logit_token_metrics"] = logit_rows

    checks = [v.passed for v in (logit_verdict, kv_verdict) if v is not None]
    passed = bool(checks) and all(c is True for c in checks)  # nothing judged is not a pass
    first_fail, phase = (None, None) if passed else _first_failure(logit_rows, kv_verdict)
    commit_comparison(store, cid, staged, [{
        "comparison_id": cid, "label": label, "created_at": datetime.now(timezone.utc),
        "baseline_run": baseline_run, "expected_run": expected_run, "actual_run": actual_run,
        "three_way": three_way, "n_prompts": len(prompt_ids), "models_differ": models_differ,
        "passed": passed,
        "logit_passed": None if logit_verdict is None else bool(logit_verdict.passed),
        "logit_decided_by": None if logit_verdict is None else logit_verdict.decided_by,
        "logit_sigma_ratio": None if logit_verdict is None else _f(logit_verdict.sigma_ratio),
        "logit_min_bc": None if logit_verdict is None else _f(logit_verdict.min_bc),
        "logit_summary": None if logit_verdict is None else logit_verdict.summary(),
        "kv_passed": None if kv_verdict is None or kv_verdict.unjudged is not None else bool(kv_verdict.passed),
        "kv_first_failing_layer": None if kv_verdict is None else kv_verdict.first_failing_layer,
        "kv_summary": None if kv_verdict is None else kv_verdict.summary(),
        "failure_phase": phase,
        "first_failing_token": json.dumps(first_fail) if first_fail else None,
    }])
    return ComparisonResult(cid, runs, tuple(prompt_ids), logit_verdict, kv_verdict, tuple(kv_layers), first_fail, phase,
                            models_differ)


def _concat_columns(parts: list[dict]):
    """One Arrow table from per-prompt column dicts; NaN becomes NULL (see ``_f``)."""
    import pyarrow as pa

    return pa.table({k: pa.array(np.concatenate([p[k] for p in parts]), from_pandas=True) for k in parts[0]})


def _kv_layer_rows(cid, verdict, head_cols) -> list[dict]:
    """Per layer: the pooled verdict numbers plus the worst per-head L-inf of target and BF16."""
    worst: dict[str, dict] = {}
    for part in head_cols:
        for name in ("k_linf", "v_linf", "base_k_linf", "base_v_linf"):
            vals = np.asarray(part[name], dtype=np.float64)
            layers = part["layer"]
            for layer in np.unique(layers):
                sel = vals[layers == layer]
                m = float(np.nanmax(sel)) if np.isfinite(sel).any() else math.nan
                d = worst.setdefault(str(layer), {})
                d[name] = m if math.isnan(d.get(name, math.nan)) else max(d[name], m)
    rows = []
    for lv in verdict.layers:
        row = {"comparison_id": cid, "layer": lv.layer, "passed": lv.passed}
        for which, t in (("k", lv.k), ("v", lv.v)):
            row.update({
                f"{which}_passed": t.passed, f"{which}_decided_by": t.decided_by,
                f"{which}_sigma_ratio": _f(t.sigma_ratio), f"{which}_bc": _f(t.bc),
                f"{which}_noise_bc": _f(t.noise_bc), f"{which}_linf_ratio": _f(t.linf_ratio),
                f"{which}_max_linf_ratio": _f(t.max_linf_ratio), f"{which}_nonfinite": int(t.n_nonfinite),
            })
        w = worst.get(lv.layer, {})
        row.update({f"max_{n}": _f(w.get(n, math.nan)) for n in ("k_linf", "v_linf", "base_k_linf", "base_v_linf")})
        rows.append(row)
    return rows


def _first_failure(logit_rows, kv_verdict):
    """Where the first failing logit token is, and what that says about the phase
    (DESIGN.md: token 0 failing means prefill; later tokens failing means decode or KV cache)."""
    failed = [r for r in logit_rows if not r["passed"]]
    if failed:
        first = min(failed, key=lambda r: (r["gen_token_idx"], r["prompt_id"]))
        info = {k: first[k] for k in ("prompt_id", "gen_token_idx", "status")}
        return info, ("prefill" if first["gen_token_idx"] == 0 else "decode")
    if kv_verdict is not None and not kv_verdict.passed and kv_verdict.unjudged is None:
        pre = getattr(kv_verdict, "prefill", None)
        return None, ("prefill" if pre is not None and not pre.passed else "decode")
    return None, None
