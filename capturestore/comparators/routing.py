"""The routing comparator: per MoE layer, the tokens whose chosen experts differ from FP32, judged.

Reads the router modules' tensors (``extractors.routing``: router logits ``[token, expert]`` under
``tensors/<router>/<phase>``, prefill then decode steps) of every role, from the module runs the
pipeline captured (``capture_run(plugins="routing")`` adds the router modules to the module
patterns). Per layer and token, ``metrics.routing.routing_flips``: the experts the actual run's
router chose against those the FP32 baseline's chose (each run's choice as its engine's router
makes it from its logits, ``extractors.routing_force.chosen_experts``, so exact BF16 ties are
broken as the engine broke them, not by the lower expert id), each flip explained by BF16 noise (the margin it needed: the
baseline's k-th largest logit minus that of each expert the actual run chose outside the baseline's
top-k, the largest, within ``2 x`` the expected run's router-logit error there, or its layer's 95th
percentile) or not.

Per layer, the router logits themselves are also judged by the module verdict's noise-relative
rule (``metrics.modules.ModuleJudge``, every prompt and position of the layer pooled): actual vs
FP32 against expected vs FP32. Flip counting alone misses a router error that moves logits well
beyond BF16 noise yet flips few tokens, or flips them where the margins are small (a bias of
1.9x the layer's p95 noise on one expert flipped 8 tokens where BF16 flipped 5, all "explained").
A statistical test of ``n_flips`` against ``noise_flips`` cannot catch it: flips are rare (a few
per hundred tokens), so 8 against 5 is no evidence at all; the logits' error is measured at every
token and expert, and the module rule is the one already calibrated on correct BF16 engines.

Verdict: fails on any unexplained flip, on router logits beyond BF16 noise, on a layer whose
evidence is missing (a role lacks the router tensor or a decode step, shapes differ, a router only
some roles hold, named with the run) or not finite, naming it; a two-way comparison (no FP32
baseline) is "not judged"; neither passes. Prompt positions a run never computed (a vLLM prefix
cache hit: ``tensors/not_computed/prefill``, NaN rows) are left out in every role, as the modules
comparator does (``capturestore.comparators.modules.not_computed_positions``), and counted
(``routing_layers.not_computed``); a layer with nothing else is "not judged", never a pass. A
model without a router (a dense model) is refused (ValueError: one line, nothing stored).

Localisation: the earliest failing layer (decoder-layer order: where the error enters); in it the
earliest unexplained flip (prefill before decode, across prompts: a short prompt's decode step
comes after a long prompt's prefill position; then the prompt position or decode step; a tie goes
to the earlier prompt), else the logit verdict's first position beyond noise (phase, layer, router
module, generation token ``position - prompt_len``).

Tables: ``routing_layers`` (layer: tokens, flips of the actual and of the expected run, explained
and unexplained flips, the noise scale, positions not computed, the router-logit verdict, pass,
problem) and ``routing_flips`` (one row per flip: prompt, layer, position, the baseline's /
expected's / actual's experts, margin, noise, threshold, explained, needed margin). ``top_k`` and ``n_experts``:
from the expected run's config (``routing``, recorded at capture by
``extractors.routing.routing_run_config``; else another role's), else, for runs captured before
that, the model's ``config.json`` (the expected run's ``model_path``; the verdict text says so).
``top_k`` may also be given.

Memory: the router logits of every layer and prompt of the three roles, float64, until ``finish``
(tokens x layers x experts x 24 bytes; 1.5 MB for 1000 tokens x 8 layers x 8 experts), and the
logit verdict's errors (float32, twice that over 3).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

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

_D, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()
ROUTER_LOGITS_PHASE = "prefill+decode"  # the logit verdict pools every position of a layer

ROUTING_LAYERS = TableSpec(pa.schema([
    ("comparison_id", _S), ("layer", _I), ("module", _S), ("top_k", _I), ("n_experts", _I), ("n_prompts", _I),
    ("n_tokens", _I), ("n_flips", _I), ("flip_share", _D), ("n_explained", _I), ("n_unexplained", _I),
    ("noise_flips", _I), ("noise_flip_share", _D), ("noise_scale", _D), ("passed", _B), ("problem", _S),
    ("not_computed", _I), ("logit_passed", _B), ("logit_decided_by", _S), ("logit_sigma_ratio", _D),
]), 2)
ROUTING_FLIPS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("layer", _I), ("module", _S), ("position", _I),
    ("gen_token_idx", _I), ("phase", _S), ("base_experts", pa.list_(_I)), ("expected_experts", pa.list_(_I)),
    ("actual_experts", pa.list_(_I)), ("margin", _D), ("noise", _D), ("threshold", _D), ("explained", _B),
    ("needed_margin", _D),
]), 2)  # v2: needed_margin, and explained judges it (v1 judged margin, whatever experts the engine chose)


def routing_config(store, run_id: str, others=()) -> tuple[int, int, str, str, str | None]:
    """``(n_experts, top_k, router pattern, source, model_type)`` of the model run ``run_id`` was captured
    from: the ``routing`` entry its run config (else the first of the runs ``others``) recorded at
    capture, else, for a store captured before that, ``run_id``'s model folder's ``config.json``
    (``source`` says which); ValueError for a dense model or a config that cannot be read."""
    from extractors.routing import router_spec

    for rid in (run_id, *others):
        got = store.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()
        rc = (json.loads(got[0]["config"]) if got and got[0]["config"] else {}).get("routing")
        if isinstance(rc, dict) and {"n_experts", "top_k", "router_pattern"} <= set(rc):
            return (int(rc["n_experts"]), int(rc["top_k"]), str(rc["router_pattern"]), f"the config of run {rid}",
                    rc.get("model_type"))
    rows = store.sql(f"SELECT model_path FROM runs WHERE run_id = '{run_id}'").to_pylist()
    path = Path(rows[0]["model_path"]) / "config.json" if rows and rows[0]["model_path"] else None
    if path is None or not path.is_file():
        raise ValueError(f"routing comparator: run {run_id} records no top_k (captured before it was recorded) and "
                         f"its model ({path}) is not here to read it from; pass RoutingComparator(top_k=K)")
    cfg = json.loads(path.read_text())
    spec, n, k = router_spec(cfg.get("text_config") or cfg, f"routing comparator (run {run_id}, {path.parent})")
    return (n, k, spec.pattern, f"the model folder {path.parent} (an old store: its run config records no top_k)",
            cfg.get("model_type"))


class RoutingComparator(Comparator):
    """Router logits of every role, judged per layer (module docstring)."""

    name = "routing"
    tables: ClassVar[dict] = {"routing_layers": ROUTING_LAYERS, "routing_flips": ROUTING_FLIPS}
    needs = ("routing",)
    localisation_rank = 5  # after module tensors, before logits and KV

    def __init__(self, top_k: int | None = None):
        self.top_k = top_k
        self.unjudged: str | None = None
        self._verdict: Verdict | None = None

    def prepare(self, context: ComparisonContext) -> None:
        from capturestore.comparators.modules import tensor_index
        from extractors.modules import resolve_modules

        super().prepare(context)
        exp = context.runs["expected"]
        self.n_experts, k, pattern, self.config_source, self.model_type = routing_config(
            context.store, exp, [rid for role, rid in context.runs.items() if role != "expected"])
        self.top_k = self.top_k or k
        # each role's router as it ran: engine and dtype decide how it broke exact ties (chosen_experts)
        self.router_rule = {}
        for role, rid in context.runs.items():
            got = context.store.sql(f"SELECT engine, dtype FROM runs WHERE run_id = '{rid}'").to_pylist()
            if not got:  # never guessed: another engine's tie-break would count other flips
                raise ValueError(f"routing comparator: the {role} run {rid} has no runs row (its engine and dtype "
                                 f"decide how its router broke ties)")
            self.router_rule[role] = (got[0]["engine"], got[0]["dtype"])
        self.index = tensor_index(context.store, context.runs)
        # routers of every role's run, not the expected run's alone: one only some runs hold fails, named
        held = {role: {m for (r, _), mods in self.index.items() if r == rid for m, _ in mods}
                for role, rid in context.runs.items()}
        routers = {}
        for role, mods in held.items():
            try:
                for m in resolve_modules(sorted(mods), [pattern], where="routing comparator"):
                    routers.setdefault(m, []).append(role)
            except ValueError:
                pass
        self.routers = sorted(routers, key=lambda m: (decoder_layer_index(m) or 0, m))
        self.data: dict = {m: [] for m in self.routers}  # module -> [(prompt_id, prompt_len, positions, b, e, a, n_nc)]
        self.problems: dict = {}  # module -> first problem
        for m in self.routers:
            lacking = [role for role in context.runs if role not in routers[m]]
            if lacking:
                self.problems[m] = (f"{m}: only the {' and '.join(f'{r} run {context.runs[r]}' for r in routers[m])} "
                                    f"holds this router, the {lacking[0]} run {context.runs[lacking[0]]} does not")
        if not self.routers:
            self.unjudged = (f"not compared: the expected run {exp} holds no router logits ({pattern}); capture with "
                             f"--plugins routing")
        elif not context.three_way:
            self.unjudged = ("not judged: two-way comparison: without a FP32 baseline there are no expert flips to "
                             "count nor router noise to judge them by; pass baseline_run (CLI: --baseline)")

    def _logits(self, prompt: PromptCaptures, role: str, module: str):
        """``(positions, logits [token, expert])`` of prefill then decode steps, or a problem string."""
        rid, pid = prompt.runs[role], prompt.prompt_id
        held = self.index.get((rid, pid), {})
        parts, pos = [], []
        for phase in ("prefill", "decode"):
            if (module, phase) not in held:
                if phase == "prefill":
                    return f"the {role} run {rid} holds no {module} (prefill) for prompt {pid}"
                continue
            a = np.asarray(prompt.context.store.read_tensor(rid, pid, module, phase=phase), dtype=np.float64)
            a = a.reshape(-1, a.shape[-1])
            steps = held[(module, phase)]
            parts.append(a)
            pos.append(np.arange(a.shape[0]) if phase == "prefill" else prompt.prompt_len + np.asarray(steps))
        out = np.concatenate(parts)
        positions = np.concatenate(pos)
        if out.shape[0] != positions.size:
            return f"the {role} run {rid}: {module} of prompt {pid} has {out.shape[0]} rows for {positions.size} positions"
        return positions, out

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """No rows; partial: ``{router: (prompt_id, prompt_len, positions, baseline, expected, actual,
        positions left out as not computed) or the first problem}`` of this prompt (``self``
        unchanged: it runs on a copy on Dask)."""
        from capturestore.comparators.modules import leave_out_not_computed, not_computed_positions

        part: dict = {}
        if self.unjudged is not None:
            return PromptResult({}, part)
        skip = not_computed_positions(prompt, {role: self.index.get((rid, prompt.prompt_id), {})
                                               for role, rid in prompt.runs.items()})
        for m in self.routers:
            if m in self.problems:  # held by some runs only (prepare): nothing to compare
                continue
            got = {role: self._logits(prompt, role, m) for role in ("baseline", "expected", "actual")}
            bad = next((g for g in got.values() if isinstance(g, str)), None)
            n_nc = 0
            if bad is None:
                (pb, b), (pe, e), (pa_, a) = got["baseline"], got["expected"], got["actual"]
                if not (np.array_equal(pb, pe) and np.array_equal(pb, pa_)) or not b.shape == e.shape == a.shape:
                    bad = (f"prompt {prompt.prompt_id}: {m} covers positions/shapes {b.shape}, {e.shape}, {a.shape} "
                           f"in baseline, expected, actual: they differ")
                elif b.shape[-1] != self.n_experts:
                    bad = f"prompt {prompt.prompt_id}: {m} has {b.shape[-1]} experts, the model {self.n_experts}"
                else:
                    pb, x, n_nc = leave_out_not_computed(pb, {"baseline": b, "expected": e, "actual": a}, skip)
                    b, e, a = x["baseline"], x["expected"], x["actual"]
                    for role, y in (("baseline", b), ("expected", e), ("actual", a)):
                        if not np.isfinite(y).all():
                            bad = (f"the {role} run {prompt.runs[role]}: {m} of prompt {prompt.prompt_id} has "
                                   f"{int((~np.isfinite(y)).sum())} non-finite router logits")
                            break
            part[m] = bad if bad is not None else (prompt.prompt_id, prompt.prompt_len, pb, b, e, a, n_nc)
        return PromptResult({}, part)

    def chosen(self, b, e, a) -> tuple:
        """The experts each role's router chose from its logits ``[token, expert]`` (baseline,
        expected, actual), ties broken as that engine's router breaks them
        (``extractors.routing_force.chosen_experts``; its engine and dtype from the run)."""
        from extractors.routing_force import chosen_experts

        return tuple(chosen_experts(x, self.top_k, self.model_type or "", self.router_rule[role][1],
                                    self.router_rule[role][0])
                     for role, x in (("baseline", b), ("expected", e), ("actual", a)))

    def reduce(self, partials: list) -> dict:
        for part in partials:  # prompt order
            for m, x in (part or {}).items():
                if isinstance(x, str):
                    self.problems.setdefault(m, x)
                else:
                    self.data[m].append(x)
        return self.finish()

    def finish(self) -> dict:
        if self.unjudged is not None:
            return {}
        from metrics.modules import ModuleJudge
        from metrics.routing import noise_scale, router_noise, routing_flips

        cid, k = self.context.comparison_id, self.top_k
        layers, flips = [], []
        self.logit_verdicts: dict = {}  # module -> metrics.modules.ModuleVerdict of its router logits
        for m in self.routers:
            items = [x for x in self.data[m] if x[2].size]  # prompts with positions computed
            n_nc = sum(x[6] for x in self.data[m])
            layer = decoder_layer_index(m)
            problem = self.problems.get(m)
            if not self.data[m] and problem is None:
                problem = f"{m}: no prompt holds its router logits in every role"
            scale = (noise_scale(np.concatenate([router_noise(x[4], x[3]) for x in items]))
                     if items else None)
            n_tok = n_flip = n_expl = n_noise = 0
            judge = ModuleJudge()  # the module verdict's noise-relative rule on the router logits themselves
            for pid, plen, pos, b, e, a, _ in items:
                judge.add(pid, m, ROUTER_LOGITS_PHASE, b, e, a, positions=pos, prompt_len=plen)
                r = routing_flips(b, e, a, k, layer_noise=scale, experts=self.chosen(b, e, a))
                n_tok += pos.size
                n_flip += int(r["flip"].sum())
                n_expl += int(r["explained"].sum())
                n_noise += int(r["noise_flip"].sum())
                for i in np.flatnonzero(r["flip"]):
                    p = int(pos[i])
                    flips.append({
                        "comparison_id": cid, "prompt_id": pid, "layer": layer, "module": m, "position": p,
                        "gen_token_idx": p - plen, "phase": phase_at(p, plen),
                        "base_experts": r["base_experts"][i].tolist(),
                        "expected_experts": r["expected_experts"][i].tolist(),
                        "actual_experts": r["actual_experts"][i].tolist(), "margin": float(r["margin"][i]),
                        "noise": float(r["noise"][i]), "threshold": float(r["threshold"][i]),
                        "explained": bool(r["explained"][i]), "needed_margin": float(r["needed"][i]),
                    })
            lv = judge.verdict().modules[0] if items else None
            self.logit_verdicts[m] = lv
            n_unexpl = n_flip - n_expl
            if problem is not None or n_unexpl or (lv is not None and lv.passed is False):
                passed = False
            elif not n_tok or lv is None or lv.passed is None:  # e.g. every position not computed: no pass
                passed = None
            else:
                passed = True
            layers.append({
                "comparison_id": cid, "layer": layer, "module": m, "top_k": k, "n_experts": self.n_experts,
                "n_prompts": len(items), "n_tokens": n_tok, "n_flips": n_flip,
                "flip_share": n_flip / n_tok if n_tok else None, "n_explained": n_expl, "n_unexplained": n_unexpl,
                "noise_flips": n_noise, "noise_flip_share": n_noise / n_tok if n_tok else None,
                "noise_scale": finite_or_null(scale) if scale is not None else None,
                "passed": passed, "problem": problem, "not_computed": n_nc,
                "logit_passed": None if lv is None else lv.passed,
                "logit_decided_by": None if lv is None else lv.decided_by,
                "logit_sigma_ratio": finite_or_null(lv.tensor.sigma_ratio) if lv is not None and lv.tensor else None,
            })
        self.layers, self.flips = layers, flips
        self.first = first_unexplained_flip(flips)
        out = {"routing_layers": layers}
        if flips:
            out["routing_flips"] = flips
        return out

    def verdict(self) -> Verdict | None:
        if self.unjudged is not None:
            return Verdict(self.name, None, self.unjudged, None, None, self.localisation_rank)
        if not hasattr(self, "layers"):
            return None
        n_tok = sum(r["n_tokens"] for r in self.layers)
        n_flip = sum(r["n_flips"] for r in self.layers)
        n_un = sum(r["n_unexplained"] for r in self.layers)
        bad = [r for r in self.layers if r["problem"]]
        loud = [r for r in self.layers if r["logit_passed"] is False]
        unjudged = [r for r in self.layers if r["passed"] is None]
        failed = [r for r in self.layers if r["passed"] is False]
        passed = False if failed else (None if unjudged else True)
        head = {True: "PASS", False: "FAIL", None: "NOT JUDGED"}[passed]
        text = (f"routing {head}: {n_flip} of {n_tok} token-layer expert choices flipped "
                f"against FP32 (the expected BF16 run: {sum(r['noise_flips'] for r in self.layers)}), "
                f"{n_flip - n_un} explained by BF16 router noise, {n_un} not")
        text += (f"; router logits beyond BF16 noise in {len(loud)} layer(s), first "
                 f"{self.logit_verdicts[loud[0]['module']].summary()[6:]}" if loud else
                 "; router logits within BF16 noise in every layer judged")
        n_nc = sum(r["not_computed"] for r in self.layers)
        if n_nc:
            text += f"; {n_nc} token-layer positions not computed by a run (prefix cache), left out"
        if unjudged:
            text += (f"; {len(unjudged)} layer(s) not judged (no position computed in every run, or router logits "
                     f"the module rule cannot judge), first {unjudged[0]['module']}")
        if bad:
            text += f"; {len(bad)} layer(s) failed on their evidence: {bad[0]['problem']}"
        if "model folder" in self.config_source:
            text += f"; top_k {self.top_k} read from {self.config_source}"
        loc = None
        first_layer = min(failed, key=lambda r: (r["layer"] if r["layer"] is not None else -1, r["module"]),
                          default=None)
        if first_layer is not None:
            f, lv = self.first, self.logit_verdicts.get(first_layer["module"])
            if f is not None and f["module"] == first_layer["module"]:
                text += (f"; first unexplained: layer {f['layer']} position {f['position']} (prompt {f['prompt_id']}) "
                         f"experts {f['actual_experts']} instead of {f['base_experts']} (needed margin "
                         f"{f['needed_margin']:.3g} > {f['threshold']:.3g})")
                loc = Localisation(f["phase"], f["layer"], f["module"], f["gen_token_idx"])
            elif first_layer["problem"] is None and lv is not None and lv.passed is False:
                phase = None if lv.token is None else ("prefill" if lv.token < 0 else "decode")
                loc = Localisation(phase, first_layer["layer"], first_layer["module"], lv.token)
            else:
                loc = Localisation(None, first_layer["layer"], first_layer["module"], None)
        return Verdict(self.name, passed, text, loc, {"layers": self.layers}, self.localisation_rank)


def first_unexplained_flip(flips: list) -> dict | None:
    """The earliest unexplained flip of ``routing_flips`` rows (given in prompt order): smallest
    decoder layer (where the error enters the forward), then prefill before decode (across prompts:
    a short prompt's decode step comes after a long prompt's prefill), then the position within the
    phase (prompt position, or decode step ``gen_token_idx``), then the earlier prompt; None if
    every flip is explained."""
    order = {}
    for f in flips:
        order.setdefault(f["prompt_id"], len(order))
    cands = [f for f in flips if not f["explained"]]

    def key(f):
        decode = f["phase"] == "decode"
        return (f["layer"] if f["layer"] is not None else -1, decode,
                f["gen_token_idx"] if decode else f["position"], order[f["prompt_id"]])

    return min(cands, key=key, default=None)
