"""The routing comparator: per MoE layer, the tokens whose chosen experts differ from FP32, judged.

Reads the router modules' tensors (``extractors.routing``: router logits ``[token, expert]`` under
``tensors/<router>/<phase>``, prefill then decode steps) of every role, from the module runs the
pipeline captured (``capture_run(plugins="routing")`` adds the router modules to the module
patterns). Per layer and token, ``metrics.routing.routing_flips``: the actual run's top-k expert
set against the FP32 baseline's, each flip explained by BF16 noise (the baseline's top-k margin
within ``2 x`` the expected run's router-logit error there, or its layer's 95th percentile) or not.

Verdict: fails on any unexplained flip, and on a layer whose evidence is missing (a role lacks the
router tensor or a decode step, shapes differ) or not finite, naming it; a two-way comparison
(no FP32 baseline) is "not judged"; neither passes. A model without a router (a dense model) is
refused (ValueError: one line, nothing stored). Localisation: the first unexplained flip in layer
order, then position (phase, layer, router module, generation token ``position - prompt_len``).

Tables: ``routing_layers`` (layer: tokens, flips of the actual and of the expected run, explained
and unexplained flips, the noise scale, pass, problem) and ``routing_flips`` (one row per flip:
prompt, layer, position, the baseline's / expected's / actual's experts, margin, noise, threshold,
explained). ``top_k``: from the model's config (the expected run's ``model_path``), or given.

Memory: the router logits of every layer and prompt of the three roles, float64, until ``finish``
(tokens x layers x experts x 24 bytes; 1.5 MB for 1000 tokens x 8 layers x 8 experts).
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

ROUTING_LAYERS = TableSpec(pa.schema([
    ("comparison_id", _S), ("layer", _I), ("module", _S), ("top_k", _I), ("n_experts", _I), ("n_prompts", _I),
    ("n_tokens", _I), ("n_flips", _I), ("flip_share", _D), ("n_explained", _I), ("n_unexplained", _I),
    ("noise_flips", _I), ("noise_flip_share", _D), ("noise_scale", _D), ("passed", _B), ("problem", _S),
]), 1)
ROUTING_FLIPS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("layer", _I), ("module", _S), ("position", _I),
    ("gen_token_idx", _I), ("phase", _S), ("base_experts", pa.list_(_I)), ("expected_experts", pa.list_(_I)),
    ("actual_experts", pa.list_(_I)), ("margin", _D), ("noise", _D), ("threshold", _D), ("explained", _B),
]), 1)


def _model_top_k(store, run_id: str) -> tuple[int, int, str]:
    """``(n_experts, top_k, router pattern)`` of the model a run was captured from; ValueError for
    a dense model or a config that cannot be read."""
    from extractors.routing import router_spec

    rows = store.sql(f"SELECT model_path FROM runs WHERE run_id = '{run_id}'").to_pylist()
    path = Path(rows[0]["model_path"]) / "config.json" if rows and rows[0]["model_path"] else None
    if path is None or not path.is_file():
        raise ValueError(f"routing comparator: the model of run {run_id} ({path}) is not here to read top_k from; "
                         f"pass RoutingComparator(top_k=K)")
    cfg = json.loads(path.read_text())
    spec, n, k = router_spec(cfg.get("text_config") or cfg, f"routing comparator (run {run_id}, {path.parent})")
    return n, k, spec.pattern


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
        self.n_experts, k, pattern = _model_top_k(context.store, exp)
        self.top_k = self.top_k or k
        self.index = tensor_index(context.store, context.runs)
        held = sorted({m for (rid, _), mods in self.index.items() if rid == exp for m, _ in mods})
        try:
            self.routers = resolve_modules(held, [pattern], where="routing comparator")
        except ValueError:
            self.routers = []
        self.routers.sort(key=lambda m: (decoder_layer_index(m) or 0, m))
        self.data: dict = {m: [] for m in self.routers}  # module -> [(prompt_id, prompt_len, positions, b, e, a)]
        self.problems: dict = {}  # module -> first problem
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
        """No rows; partial: ``{router: (prompt_id, prompt_len, positions, baseline, expected, actual)
        or the first problem}`` of this prompt (``self`` unchanged: it runs on a copy on Dask)."""
        part: dict = {}
        if self.unjudged is not None:
            return PromptResult({}, part)
        for m in self.routers:
            got = {role: self._logits(prompt, role, m) for role in ("baseline", "expected", "actual")}
            bad = next((g for g in got.values() if isinstance(g, str)), None)
            if bad is None:
                (pb, b), (pe, e), (pa_, a) = got["baseline"], got["expected"], got["actual"]
                if not (np.array_equal(pb, pe) and np.array_equal(pb, pa_)) or not b.shape == e.shape == a.shape:
                    bad = (f"prompt {prompt.prompt_id}: {m} covers positions/shapes {b.shape}, {e.shape}, {a.shape} "
                           f"in baseline, expected, actual: they differ")
                elif b.shape[-1] != self.n_experts:
                    bad = f"prompt {prompt.prompt_id}: {m} has {b.shape[-1]} experts, the model {self.n_experts}"
                else:
                    for role, x in (("baseline", b), ("expected", e), ("actual", a)):
                        if not np.isfinite(x).all():
                            bad = (f"the {role} run {prompt.runs[role]}: {m} of prompt {prompt.prompt_id} has "
                                   f"{int((~np.isfinite(x)).sum())} non-finite router logits")
                            break
            part[m] = bad if bad is not None else (prompt.prompt_id, prompt.prompt_len, pb, b, e, a)
        return PromptResult({}, part)

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
        from metrics.routing import noise_scale, router_noise, routing_flips

        cid, k = self.context.comparison_id, self.top_k
        layers, flips = [], []
        first = None  # (layer, position order) of the first unexplained flip
        for m in self.routers:
            items = self.data[m]
            layer = decoder_layer_index(m)
            problem = self.problems.get(m)
            if not items and problem is None:
                problem = f"{m}: no prompt holds its router logits in every role"
            scale = noise_scale(np.concatenate([router_noise(e, b) for _, _, _, b, e, _ in items])) if items else None
            n_tok = n_flip = n_expl = n_noise = 0
            for pid, plen, pos, b, e, a in items:
                r = routing_flips(b, e, a, k, layer_noise=scale)
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
                        "explained": bool(r["explained"][i]),
                    })
                    if not r["explained"][i] and first is None:
                        first = flips[-1]
            n_unexpl = n_flip - n_expl
            layers.append({
                "comparison_id": cid, "layer": layer, "module": m, "top_k": k, "n_experts": self.n_experts,
                "n_prompts": len(items), "n_tokens": n_tok, "n_flips": n_flip,
                "flip_share": n_flip / n_tok if n_tok else None, "n_explained": n_expl, "n_unexplained": n_unexpl,
                "noise_flips": n_noise, "noise_flip_share": n_noise / n_tok if n_tok else None,
                "noise_scale": finite_or_null(scale) if scale is not None else None,
                "passed": problem is None and n_unexpl == 0, "problem": problem,
            })
        self.layers, self.flips, self.first = layers, flips, first
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
        passed = not bad and n_un == 0
        text = (f"routing {'PASS' if passed else 'FAIL'}: {n_flip} of {n_tok} token-layer expert choices flipped "
                f"against FP32 (the expected BF16 run: {sum(r['noise_flips'] for r in self.layers)}), "
                f"{n_flip - n_un} explained by BF16 router noise, {n_un} not")
        loc = None
        if self.first is not None:
            f = self.first
            text += (f"; first unexplained: layer {f['layer']} position {f['position']} experts "
                     f"{f['actual_experts']} instead of {f['base_experts']} (margin {f['margin']:.3g} > "
                     f"{f['threshold']:.3g})")
            loc = Localisation(f["phase"], f["layer"], f["module"], f["gen_token_idx"])
        if bad:
            text += f"; {len(bad)} layer(s) not judged: {bad[0]['problem']}"
            if loc is None:
                loc = Localisation(None, bad[0]["layer"], bad[0]["module"], None)
        return Verdict(self.name, passed, text, loc, {"layers": self.layers}, self.localisation_rank)
