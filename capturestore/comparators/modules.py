"""The module-tensor comparator: per module and phase, three-way metrics and the module verdict.

Reads ``tensors/<module>/<phase>`` of every role, a prompt's of a role at once
(``Store.read_tensors``: a group array a call; ``extractors.modules`` / ``extractors.vllm_modules``
layout: prefill step 0 ``[prompt_len, ...]``, decode step n ``[1, ...]`` at position
``prompt_len + n``), lines decode steps up by step number (``metrics.modules.align_decode_captures``)
and hands them to ``metrics.modules.ModuleJudge``. The modules compared are those the expected
run holds; the execution order is the expected (else baseline) run's ``module_order`` config.

Tables: ``module_metrics`` (prompt x module x phase x token: L-inf, L2, cosine of BF16 and target
vs FP32, their ratios, BC) and ``module_verdicts`` (module x phase: the pooled verdict numbers,
in execution order). Verdict: ``metrics.modules``; a module or decode step the actual run lacks,
or a shape that differs, fails (named). Prompt positions a run lists in
``tensors/not_computed/prefill`` (``[n]`` int64: positions a vLLM engine served from its prefix
cache, ``extractors.vllm_modules.NOT_COMPUTED``; NaN in its module tensors) are left out of every
module's prefill in every role, counted per module and phase (``module_verdicts.not_computed``)
and in the verdict's text; never judged equal, they cannot make a verdict pass. A two-way comparison has no noise to judge against
("not judged"), and a comparison whose expected run holds no module tensors "not compared":
neither passes. Localisation: the first failing module (phase, decoder layer, module, generation
token), ranked before logits and KV evidence.

Memory: the absolute errors of every module of every prompt are held until the verdict (pooled
over prompts): twice the captured tensors' size in float32. While a prompt is compared, with numba
nothing more (every tensor read where it lies, bfloat16 as its bits, all of a prompt's tensors in
one job: ``metrics._fused.RowMetricsJob``); without numba, also a float32 copy of its tensors of
every role (the rows of one width stacked and compared at once; ``metrics.modules.ModuleJudge.add_many``,
docs/module-compare.md).
"""
from __future__ import annotations

import json

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
    finite_or_null,
)
from capturestore.errors import StoreError

_f = finite_or_null
_D, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()

MODULE_METRICS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("module", _S), ("phase", _S), ("layer", _I), ("position", _I),
    ("gen_token_idx", _I), ("base_linf", _D), ("tgt_linf", _D), ("linf_ratio", _D), ("base_l2", _D), ("tgt_l2", _D),
    ("l2_ratio", _D), ("base_cos", _D), ("tgt_cos", _D), ("bc", _D),
]), 1)
MODULE_VERDICTS = TableSpec(pa.schema([
    ("comparison_id", _S), ("module", _S), ("phase", _S), ("layer", _I), ("exec_order", _I), ("passed", _B),
    ("decided_by", _S), ("sigma_ratio", _D), ("bc", _D), ("noise_bc", _D), ("bc_threshold", _D), ("linf_ratio", _D),
    ("linf_threshold", _D), ("max_linf_ratio", _D), ("max_l2_ratio", _D), ("static_passed", _B), ("nonfinite", _I),
    ("n_prompts", _I), ("n_tokens", _I), ("first_position", _I), ("first_token", _I), ("first_prompt_id", _S),
    ("problem", _S), ("not_computed", _I),
]), 2)

NOT_COMPUTED = "not_computed"  # extractors.vllm_modules.NOT_COMPUTED (this package does not import extractors)


def tensor_index(store, runs: dict) -> dict:
    """``{(run_id, prompt_id): {(module, phase): steps}}`` of every module tensor of ``runs``."""
    ids = ", ".join(f"'{rid}'" for rid in runs.values())
    rows = store.sql(f"SELECT run_id, prompt_id, module, phase, steps FROM captures "
                     f"WHERE run_id IN ({ids}) AND kind = 'tensor'").to_pylist()
    out: dict = {}
    for r in rows:
        out.setdefault((r["run_id"], r["prompt_id"]), {})[(r["module"], r["phase"])] = list(r["steps"] or [])
    return out


def not_computed_positions(prompt: PromptCaptures, held: dict) -> np.ndarray:
    """Sorted unique prompt positions (int64) that some role of ``prompt`` lists in
    ``tensors/not_computed/prefill`` (served from a vLLM prefix cache: NaN rows in its module
    tensors); empty when none does. ``held``: ``{role: {(module, phase): steps}}`` of this prompt
    (``tensor_index``). The one reader of that list: the modules and routing comparators both
    leave these positions out (``leave_out_not_computed``), count them, and never judge them."""
    parts = [np.asarray(prompt.cached(("tensor", role, NOT_COMPUTED, "prefill"), lambda rid=rid: prompt.context.store
                                      .read_tensor(rid, prompt.prompt_id, NOT_COMPUTED, phase="prefill")),
                        dtype=np.int64).ravel()
             for role, rid in prompt.runs.items() if (NOT_COMPUTED, "prefill") in held.get(role, {})]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def leave_out_not_computed(positions: np.ndarray, arrays: dict, skip: np.ndarray) -> tuple[np.ndarray, dict, int]:
    """``(positions, arrays, n_left_out)`` without the rows whose position is in ``skip``
    (``not_computed_positions``); ``arrays``: ``{role: [row, ...]}`` with one row per position."""
    if not np.size(skip):
        return positions, arrays, 0
    keep = ~np.isin(positions, skip)
    return positions[keep], {role: a[keep] for role, a in arrays.items()}, int(positions.size - keep.sum())


def _module_order(store, runs: dict) -> list[str] | None:
    for role in ("expected", "baseline"):
        if role not in runs:
            continue
        rows = store.sql(f"SELECT config FROM runs WHERE run_id = '{runs[role]}'").to_pylist()
        if rows and rows[0]["config"]:
            order = json.loads(rows[0]["config"]).get("module_order")
            if order:
                return list(order)
    return None


class ModulesComparator(Comparator):
    """Module tensors of every role (module docstring). config: ``metrics.modules.ModuleVerdictConfig``."""

    name = "modules"
    tables = {"module_metrics": MODULE_METRICS, "module_verdicts": MODULE_VERDICTS}
    needs = ("tensors",)
    localisation_rank = 0

    def __init__(self, config=None):
        self.config = config
        self.unjudged: str | None = None
        self._verdict = None
        self._result = None

    def prepare(self, context: ComparisonContext) -> None:
        from metrics.modules import ModuleJudge

        super().prepare(context)
        self.index = tensor_index(context.store, context.runs)
        self.order = _module_order(context.store, context.runs)
        self.judge = ModuleJudge(self.config)  # judges nothing until reduce merges the prompts' judges
        exp = context.runs["expected"]
        if not any(rid == exp for rid, _ in self.index):
            self.unjudged = (f"not compared: the expected run {exp} holds no module tensors (capture them with "
                             f"extractors.modules.capture_hf_module_run)")
        elif not context.three_way:
            self.unjudged = ("not judged: two-way comparison: without a baseline (FP32) run there is no dtype noise "
                             "to judge module tensors against; pass baseline_run (CLI: --baseline)")

    @staticmethod
    def _read_all(prompt: PromptCaptures, held: dict) -> None:
        """Every module tensor this prompt's comparison reads, of each role, read at once into the
        prompt's cache (``Store.read_tensors``: a group array a call, not a module). Where that
        raises (a damaged store), nothing is cached: ``_read`` then reads module by module and
        raises where it did, naming the same array and chunk."""
        want = [key for key in held["expected"] if key[0] != NOT_COMPUTED]
        for role, rid in prompt.runs.items():
            keys = [key for key in want if key in held[role] and not prompt.has(("tensor", role, *key))]
            if not keys:
                continue
            try:
                got = prompt.context.store.read_tensors(rid, prompt.prompt_id, keys)
            except (StoreError, ValueError):
                continue
            for key, a in got.items():
                prompt.keep(("tensor", role, *key), a)

    def _read(self, prompt: PromptCaptures, role: str, module: str, phase: str):
        rid = prompt.runs[role]
        return prompt.cached(("tensor", role, module, phase), lambda: prompt.context.store.read_tensor(
            rid, prompt.prompt_id, module, phase=phase))

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """The prompt's rows; partial: the ``metrics.modules.ModuleJudge`` of this prompt alone."""
        if self.unjudged is not None:
            return PromptResult({})
        from metrics.modules import ModuleJudge, align_decode_captures, module_layer

        judge = ModuleJudge(self.config)
        pid, plen, cid = prompt.prompt_id, prompt.prompt_len, prompt.comparison_id
        held = {role: self.index.get((rid, pid), {}) for role, rid in prompt.runs.items()}
        cols: dict[str, list] = {k: [] for k in MODULE_METRICS.schema.names}
        items = []
        skip = not_computed_positions(prompt, held)  # prompt positions some role never computed
        self._read_all(prompt, held)
        for (module, phase), ref_steps in held["expected"].items():
            if module == NOT_COMPUTED:
                continue
            lacking = [role for role in prompt.runs if (module, phase) not in held[role]]
            if lacking:
                judge.add_problem(pid, module, phase, f"the {lacking[0]} run {prompt.runs[lacking[0]]} holds no "
                                                      f"{module} ({phase})")
                continue
            steps = {role: held[role][(module, phase)] for role in prompt.runs}
            ri = np.arange(len(ref_steps))
            idx = {role: ri for role in prompt.runs}
            ascending = all(x < y for x, y in zip(ref_steps, ref_steps[1:]))
            for role in prompt.runs:
                if role == "expected" or (ascending and steps[role] == ref_steps):  # the same steps: nothing to align
                    continue
                r_i, t_i, missing = align_decode_captures(ref_steps, steps[role])
                if missing.size:
                    judge.add_problem(pid, module, phase, f"the {role} run {prompt.runs[role]} lacks step(s) "
                                                          f"{missing.tolist()[:4]}")
                ri = np.intersect1d(ri, r_i)
                idx[role] = dict(zip(r_i.tolist(), t_i.tolist()))
            if ri.size == 0:
                continue
            arrs = {}
            for role in prompt.runs:
                a = self._read(prompt, role, module, phase)
                sel = ri if role == "expected" else np.asarray([idx[role][i] for i in ri.tolist()])
                if not (sel.size == a.shape[0] and (sel == np.arange(a.shape[0])).all()):  # every step in order: no copy
                    a = a[sel]
                arrs[role] = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) if a.ndim >= 2 else a
            step_ids = np.asarray(ref_steps)[ri]
            rows_per_step = arrs["expected"].shape[0] // max(1, len(step_ids))
            if phase == "decode":
                pos = np.repeat(plen + step_ids, rows_per_step)
            else:
                pos = np.arange(arrs["expected"].shape[0])
                # different row counts: the shape problem is the finding, nothing to leave out
                if skip.size and len({x.shape[0] for x in arrs.values()}) == 1:
                    pos, arrs, n_skipped = leave_out_not_computed(pos, arrs, skip)
                    judge.add_not_computed(pid, module, phase, n_skipped)
                    if not pos.size:
                        continue
            items.append((module, phase, arrs["baseline"], arrs["expected"], arrs["actual"],
                          pos if pos.size == arrs["expected"].shape[0] else None))
        # every module of the prompt at once: one computation per width, not one per tensor
        done = [(it[0], it[1], m.to_columns()) for it, m in zip(items, judge.add_many(pid, items, prompt_len=plen))
                if m is not None]
        if not done:
            return PromptResult({}, judge)
        n = sum(c["position"].size for _, _, c in done)
        cols["comparison_id"] = [cid] * n
        cols["prompt_id"] = [pid] * n
        for module, phase, c in done:
            k = c["position"].size
            cols["module"] += [module] * k
            cols["phase"] += [phase] * k
            cols["layer"] += [module_layer(module)] * k
        position = np.concatenate([c["position"] for _, _, c in done])
        cols["position"], cols["gen_token_idx"] = position, position - plen
        for k in MODULE_METRICS.schema.names[7:]:  # NaN / inf -> NULL (finite_or_null, for whole columns)
            x = np.concatenate([c[k] for _, _, c in done])
            cols[k] = np.where(np.isfinite(x), x, np.nan)
        return PromptResult({"module_metrics": cols}, judge)

    def reduce(self, partials: list) -> dict:
        if self.unjudged is not None:
            return {}
        for judge in partials:
            if judge is not None:
                self.judge.merge(judge)
        res = self.judge.verdict(self.order)
        self._result = res
        cid = self.context.comparison_id
        rank = {m: i for i, m in enumerate(self.order or ())}
        rows = []
        for v in res.modules:
            t = v.tensor
            rows.append({
                "comparison_id": cid, "module": v.module, "phase": v.phase, "layer": v.layer,
                "exec_order": rank.get(v.module), "passed": v.passed, "decided_by": v.decided_by,
                "sigma_ratio": _f(t.sigma_ratio) if t else None, "bc": _f(t.bc) if t else None,
                "noise_bc": _f(t.noise_bc) if t else None, "bc_threshold": _f(t.bc_threshold_used) if t else None,
                "linf_ratio": _f(t.linf_ratio) if t else None,
                "linf_threshold": _f(t.linf_threshold_used) if t else None,
                "max_linf_ratio": _f(t.max_linf_ratio) if t else None, "max_l2_ratio": _f(v.max_l2_ratio),
                "static_passed": v.static_passed, "nonfinite": int(t.n_nonfinite) if t else 0,
                "n_prompts": v.n_prompts, "n_tokens": v.n_tokens, "first_position": v.position,
                "first_token": v.token, "first_prompt_id": v.token_prompt, "problem": v.problem,
                "not_computed": v.n_not_computed,
            })
        return {"module_verdicts": rows} if rows else {}

    @property
    def result(self):
        """The ``metrics.modules.ModulesVerdict`` (None until ``finish`` or when nothing was judged)."""
        return self._result

    def verdict(self) -> Verdict | None:
        if self.unjudged is not None:
            return Verdict(self.name, None, self.unjudged, None, None, self.localisation_rank)
        res = self._result
        if res is None:
            return None
        loc = None
        if res.localisation is not None:
            loc = Localisation(**res.localisation)
        # a module not judged (no value finite in all roles) and none failing: nothing decided, no pass
        passed = True if res.passed else (None if res.first_failing is None and res.unjudged else False)
        return Verdict(self.name, passed, res.summary(), loc, res, self.localisation_rank)

