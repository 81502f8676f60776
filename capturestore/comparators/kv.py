"""The KV comparator: per-head KV metrics of every position and layer, and the KV verdict.

Tables: ``kv_head_metrics`` (prompt x position x layer x KV head, columns as
``metrics.kv.HeadMetrics``), three-way only ``kv_token_bc`` (prompt x position x layer BC of the
target's vs BF16's absolute errors), ``kv_gen_bc`` (BC per generation index and layer, errors of
all prompts pooled) and ``kv_layer_verdicts`` (the pooled per-layer verdict numbers). Verdict:
``metrics.verdict.aggregate_kv_verdict``; two-way has no noise to judge against ("not judged"),
an actual run without the references' KV, or a reference without KV, is "not compared": neither
passes.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from capturestore.comparators.base import (
    Comparator,
    ComparisonContext,
    Localisation,
    PromptCaptures,
    PromptResult,
    TableSpec,
    Verdict,
    decoder_layer_index,
    finite_or_null,
    phase_at,
)

_f = finite_or_null
_D, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()

KV_HEAD_METRICS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("position", _I), ("gen_token_idx", _I), ("phase", _S),
    ("layer", _S), ("head", _I), ("k_cos", _D), ("v_cos", _D), ("k_linf", _D), ("v_linf", _D),
    ("k_l2", _D), ("v_l2", _D), ("base_k_linf", _D), ("base_v_linf", _D), ("base_k_l2", _D), ("base_v_l2", _D),
]), 1)
KV_TOKEN_BC = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("position", _I), ("gen_token_idx", _I), ("layer", _S),
    ("k_bc", _D), ("v_bc", _D),
]), 1)
KV_GEN_BC = TableSpec(pa.schema([
    ("comparison_id", _S), ("gen_token_idx", _I), ("layer", _S), ("k_bc", _D), ("v_bc", _D), ("n_prompts", _I),
]), 1)
KV_LAYER_VERDICTS = TableSpec(pa.schema([
    ("comparison_id", _S), ("layer", _S), ("passed", _B),
    *((f"{w}_{c}", t) for w in ("k", "v") for c, t in (
        ("passed", _B), ("decided_by", _S), ("sigma_ratio", _D), ("bc", _D), ("noise_bc", _D),
        ("linf_ratio", _D), ("max_linf_ratio", _D), ("nonfinite", _I))),
    ("max_k_linf", _D), ("max_v_linf", _D), ("max_base_k_linf", _D), ("max_base_v_linf", _D),
]), 1)


def kv_layer_names(store, runs: dict) -> dict:
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


def kv_coverage(runs: dict, prompt_ids, kv_names: dict) -> str | None:
    """Check the KV layers of every prompt before anything is computed or stored.

    The references are the expected run and (three-way) the baseline. Returns None when every
    run holds KV of every prompt, or the reason the KV cannot be compared (a reference or the
    actual run lacks a prompt's KV). Raises ValueError naming run, prompt and layers when a
    run holds KV but lacks a layer the references hold."""
    refs = [r for r in ("baseline", "expected") if r in runs]
    for role in refs:  # KV asked for, absent from a reference: nothing to judge it against, never a pass
        lacking = [pid for pid in prompt_ids if (runs[role], pid) not in kv_names]
        if lacking:
            return (f"{role} run {runs[role]} holds no KV for {len(lacking)} of the {len(prompt_ids)} compared "
                    f"prompt(s) ({', '.join(lacking[:3])}{'...' if len(lacking) > 3 else ''}): the reference has "
                    f"no KV to judge the actual run's against; capture it with KV, or compare logits only with "
                    f"kv=False (CLI: --no-kv)")
    missing = []
    for pid in prompt_ids:
        ref_layers = {}  # layer -> the reference roles holding it
        for role in refs:
            for name in _all_layers(kv_names.get((runs[role], pid))):
                ref_layers.setdefault(name, []).append(role)
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


# Captures whose engine samples the last token and never feeds it back, so never writes its KV
# (capturestore.capture.CAPTURE_MODES); a prefill over prompt + teacher tokens writes every position.
NEVER_FEEDS_LAST_TOKEN = ("teacher_forced_decode", "greedy")


def actual_never_feeds_last_token(store, run_id: str) -> bool:
    """Whether run ``run_id`` declares (its config's ``capture``) that it never feeds each prompt's
    last token back: only then is an unwritten (NaN) last KV position exempt from the verdict."""
    import json

    rows = [r for r in store.runs().to_pylist() if r["run_id"] == run_id]
    try:
        config = json.loads(rows[0].get("config") or "{}") if rows else {}
    except json.JSONDecodeError:
        return False
    return isinstance(config, dict) and config.get("capture") in NEVER_FEEDS_LAST_TOKEN


def read_kv_layers(store, run_id, pid, groups: dict) -> dict:
    """``{layer: (k, v)}`` with ``k, v: [1, kv_head, position, head_dim]`` from a stored capture (the
    layers of every KV group of it)."""
    out = {}
    for group, names in groups.items():
        k, v = store.read_kv(run_id, pid, group=group)
        names = list(names) if names else [f"{group + '.' if group else ''}{i}" for i in range(k.shape[0])]
        out.update({n: (k[i][None], v[i][None]) for i, n in enumerate(names)})
    return out


class KVComparator(Comparator):
    """KV of every layer (all KV groups) against the references (module docstring).

    config: ``metrics.verdict.KVVerdictConfig`` (defaults when None)."""

    name = "kv"
    tables = {"kv_head_metrics": KV_HEAD_METRICS, "kv_token_bc": KV_TOKEN_BC, "kv_gen_bc": KV_GEN_BC,
              "kv_layer_verdicts": KV_LAYER_VERDICTS}
    needs = ("kv",)
    localisation_rank = 20
    comparison_fields = (
        pa.field("kv_passed", _B), pa.field("kv_first_failing_layer", _S), pa.field("kv_summary", _S),
    )

    def __init__(self, config=None):
        self.config = config
        self.not_compared: str | None = None
        self.layer_rows: list[dict] = []
        self._verdict = None

    def prepare(self, context: ComparisonContext) -> None:
        super().prepare(context)
        self.names = kv_layer_names(context.store, context.runs)
        self.last_never_fed = actual_never_feeds_last_token(context.store, context.runs["actual"])
        self.not_compared = kv_coverage(context.runs, context.prompt_ids, self.names)
        if self.not_compared is not None:
            self.names = {}  # judge no prompt's KV rather than some of them

    def kv(self, prompt: PromptCaptures, role: str) -> dict:
        """``{layer: (k, v)}`` ``[1, kv_head, position, head_dim]`` of ``role``'s run (read once per prompt)."""
        rid = prompt.runs[role]
        return prompt.cached(("kv", role), lambda: read_kv_layers(
            prompt.context.store, rid, prompt.prompt_id, self.names[(rid, prompt.prompt_id)]))

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """The prompt's rows; partial: ``KVPartial`` (None for a prompt whose KV is not compared)."""
        from metrics.kv import compare_kv_caches

        pid, plen, cid = prompt.prompt_id, prompt.prompt_len, prompt.comparison_id
        if not all((rid, pid) in self.names for rid in prompt.runs.values()):
            return PromptResult({})
        three_way = "baseline" in prompt.runs
        kvs = {role: self.kv(prompt, role) for role in prompt.runs}
        out = compare_kv_caches(kvs["expected"], kvs["actual"], baseline_kv=kvs.get("baseline"),
                                return_raw_errors=three_way)
        res, raw = out if three_way else (out, None)
        cols = res.to_columns()
        for repeated in ("batch", "k_bc", "v_bc"):  # one row per prompt; BCs live in kv_token_bc
            cols.pop(repeated)
        pos = cols.pop("token")
        n_rows = len(pos)
        head = {
            "comparison_id": np.full(n_rows, cid, dtype=object), "prompt_id": np.full(n_rows, pid, dtype=object),
            "position": pos, "gen_token_idx": pos - plen, "phase": phase_at(pos, plen), **cols,
        }
        rows = {"kv_head_metrics": head}
        partial = KVPartial(pid, plen, _worst_linf(head), raw)
        if three_way:
            T, L = res.k_bc.shape[1:]
            t_idx, l_idx = np.meshgrid(np.arange(T), np.arange(L), indexing="ij")
            rows["kv_token_bc"] = {
                "comparison_id": np.full(T * L, cid, dtype=object), "prompt_id": np.full(T * L, pid, dtype=object),
                "position": t_idx.ravel(), "gen_token_idx": t_idx.ravel() - plen,
                "layer": np.asarray(res.layers, dtype=object)[l_idx.ravel()],
                "k_bc": res.k_bc[0].ravel(), "v_bc": res.v_bc[0].ravel(),
            }
            from capturestore.comparators.raw_errors import RAW_KEY

            prompt.cached(RAW_KEY, lambda: raw)  # shared with the raw_errors comparator (no second pass)
        return PromptResult(rows, partial)

    def reduce(self, partials: list) -> dict:
        from metrics.kv import aggregate_kv_bc_arrays
        from metrics.verdict import KVVerdict, aggregate_kv_verdict

        cid = self.context.comparison_id
        v = None
        out: dict = {}
        compared = [p for p in partials if p is not None]
        three = [p for p in compared if p.raw is not None]
        raw_errors, prompt_lens = [p.raw for p in three], [p.prompt_len for p in three]
        if self.not_compared is not None:
            v = KVVerdict.not_compared_because(self.not_compared, self.config)
        elif compared and not self.context.three_way:
            v = KVVerdict.not_judged_because(
                "two-way comparison: without a baseline (FP32) run there is no dtype noise to judge the KV against "
                "(its metrics are in kv_head_metrics); pass baseline_run (CLI: --baseline) for a KV verdict, or "
                "kv=False (CLI: --no-kv) to judge logits only", self.config)
        if raw_errors:
            v = aggregate_kv_verdict(raw_errors, prompt_lens=prompt_lens, config=self.config,
                                     prompt_ids=[p.prompt_id for p in three], run=self.context.runs["actual"],
                                     last_never_fed=self.last_never_fed)
            layers, gk, gv = aggregate_kv_bc_arrays(raw_errors, prompt_lens)
            G, L = gk.shape
            g_idx, l_idx = np.meshgrid(np.arange(G), np.arange(L), indexing="ij")
            if G * L:
                out["kv_gen_bc"] = {
                    "comparison_id": [cid] * (G * L), "gen_token_idx": g_idx.ravel().tolist(),
                    "layer": [layers[i] for i in l_idx.ravel()], "k_bc": [_f(x) for x in gk.ravel()],
                    "v_bc": [_f(x) for x in gv.ravel()], "n_prompts": [len(raw_errors)] * (G * L),
                }
            self.layer_rows = _kv_layer_rows(cid, v, [p.worst for p in compared])
            out["kv_layer_verdicts"] = self.layer_rows
        self._verdict = v
        return out

    def verdict(self) -> Verdict | None:
        v = self._verdict
        if v is None:
            return None
        loc = None
        if not v.passed and v.unjudged is None:
            pre = getattr(v, "prefill", None)
            loc = Localisation(phase="prefill" if pre is not None and not pre.passed else "decode",
                               layer=decoder_layer_index(v.first_failing_layer))
        passed = None if v.unjudged is not None else bool(v.passed)
        return Verdict(self.name, passed, v.summary(), loc, v, self.localisation_rank)

    def comparison_columns(self, verdict: Verdict | None, passed: bool) -> dict:
        v = None if verdict is None else verdict.detail
        return {
            "kv_passed": None if v is None or v.unjudged is not None else bool(v.passed),
            "kv_first_failing_layer": None if v is None else v.first_failing_layer,
            "kv_summary": None if v is None else v.summary(),
        }


class KVPartial(NamedTuple):
    """What ``KVComparator.map`` keeps of one compared prompt for ``reduce``: the per-layer worst
    L-inf (``_worst_linf``) and, three-way, the raw errors the pooled verdict bins."""

    prompt_id: str
    prompt_len: int
    worst: dict
    raw: Any = None


_LINF = ("k_linf", "v_linf", "base_k_linf", "base_v_linf")


def _fold_worst(worst: dict, layer: str, name: str, m: float) -> None:
    """The worst so far of ``name`` in ``layer`` with ``m`` (NaN: nothing finite yet)."""
    d = worst.setdefault(layer, {})
    d[name] = m if math.isnan(d.get(name, math.nan)) else max(d[name], m)


def _worst_linf(head: dict) -> dict:
    """``{layer: {name: worst}}`` of one prompt's ``kv_head_metrics`` columns (NaN where none is finite)."""
    worst: dict[str, dict] = {}
    for name in _LINF:
        vals = np.asarray(head[name], dtype=np.float64)
        layers = head["layer"]
        for layer in np.unique(layers):
            sel = vals[layers == layer]
            _fold_worst(worst, str(layer), name, float(np.nanmax(sel)) if np.isfinite(sel).any() else math.nan)
    return worst


def _kv_layer_rows(cid, verdict, worsts) -> list[dict]:
    """Per layer: the pooled verdict numbers plus the worst per-head L-inf of target and BF16 over
    every prompt's ``_worst_linf`` (in prompt order)."""
    worst: dict[str, dict] = {}
    for part in worsts:
        for layer, names in part.items():
            for name, m in names.items():
                _fold_worst(worst, layer, name, m)
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
