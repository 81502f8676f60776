"""References with the engine's expert choices forced: the verdict rule for MoE engines (docs/moe.md).

A correct BF16 engine may route a token to another expert than FP32 where FP32's top-k margin is
within BF16 router noise (an *explained* flip, ``metrics.routing``). Its consequence is discrete
(another expert's output: O(1) at that token, inherited downstream), and the logits, KV and module
verdicts, which judge continuous error against the BF16 expected run's spread, count it as error.
Tokens are teacher-forced for the same reason; here the expert choices are: when every flip of the
actual run against FP32 is explained (``routing_decision``), the FP32 baseline and the expected
references are captured again with their routers choosing the actual run's experts (the top-k of
its router logits at every token and layer; ``extractors.routing_force``), each keeping its own
routing weights over those experts. Those runs record ``routing_forced_from: <actual module run>``
and are what logits, KV and modules are judged against; routing itself is judged against the
unforced references (the flips are what it counts). An unexplained flip is never forced: routing
fails anyway, and the other verdicts see its consequence.

Forcing is per layer: the routers before the first layer whose routing fails (an unexplained flip,
or router logits beyond BF16 noise) are judged trustworthy and forced; that layer and every later
one keep the references' own routing. A fault at layer L cannot reach layers < L (tokens are
teacher-forced, and a layer reads only earlier layers), so their evidence is the engine's own; forcing
them gives the references layer L's inputs as the engine had them, which keeps layer L's verdicts local:
an explained flip before L no longer fails the modules of its own layer ahead of the real fault.
Nothing is forced when routing fails at the first MoE layer, or on missing evidence. The forced
runs record ``routing_forced_layers``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["CONSISTENCY_FACTOR", "RoutingDecision", "capture_forced_references", "logits_routed_alike",
           "read_router_logits", "routing_decision"]

CONSISTENCY_FACTOR = 2.0


@dataclass
class RoutingDecision:
    """Whether to force: ``force`` (the routers of the layers before the first failing one, some
    choice differs there), ``reason`` (one line), counts over every layer and prompt, the ``plan``
    (``extractors.routing_force.RoutingPlan``: the actual run's choices at every router; set whenever
    the evidence is complete, also when not forcing, e.g. to show a fault fails against forced
    references), ``forced`` (the router modules to force: every router when routing passes, those
    of the layers before ``failed_layer`` when it fails there; empty when not forcing) and
    ``failed_layer`` (the first decoder layer whose routing fails; None when none does)."""
    force: bool
    reason: str
    n_flips: int = 0
    n_noise_flips: int = 0
    n_unexplained: int = 0
    routers: list = field(default_factory=list)
    model_type: str = ""
    plan: object = None
    forced: list = field(default_factory=list)
    failed_layer: int | None = None

    @property
    def forced_layers(self) -> list[int]:
        """The decoder-layer indices of the forced routers."""
        from capturestore.comparators.base import decoder_layer_index

        return sorted({decoder_layer_index(m) for m in self.forced})


def read_router_logits(st, run_id: str, pid: str, module: str, prompt_len: int) -> np.ndarray:
    """``[position, expert]`` float64 router logits of a module run, prefill then decode steps
    (positions ``0 .. prompt_len + steps - 1``); ValueError naming run, prompt and module if absent."""
    try:
        parts = [np.asarray(st.read_tensor(run_id, pid, module, phase="prefill"), np.float64)]
    except Exception as e:  # noqa: BLE001 - missing evidence: one line
        raise ValueError(f"forced routing: run {run_id} holds no {module} (prefill) for prompt {pid}: {e}") from None
    try:
        parts.append(np.asarray(st.read_tensor(run_id, pid, module, phase="decode"), np.float64))
    except Exception:  # noqa: BLE001 - a prompt with one continuation token has no decode step
        pass
    out = np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts])
    if parts[0].reshape(-1, parts[0].shape[-1]).shape[0] != prompt_len:
        raise ValueError(f"forced routing: run {run_id} prompt {pid} {module}: prefill rows "
                         f"{parts[0].shape} for a prompt of {prompt_len} tokens")
    return out


def _model_config(model_path) -> dict:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg.get("text_config") or cfg


def routing_decision(st, runs: dict, model_path, pids: list[str]) -> RoutingDecision:
    """Judge the module runs ``runs`` (``baseline``, ``expected``, ``actual``) as the routing
    comparator does (``metrics.routing``, layer noise pooled over prompts) and decide whether the
    references are to be forced to the actual run's experts (module docstring)."""
    from extractors.modules import resolve_modules
    from extractors.routing import router_spec
    from extractors.routing_force import RoutingPlan
    from extractors.routing_force import chosen_experts
    from metrics.routing import noise_scale, router_noise, routing_flips

    cfg = _model_config(model_path)
    spec, _, k = router_spec(cfg, "forced routing")
    act = runs["actual"]
    order = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{act}'").to_pylist()[0]["config"])
    routers = resolve_modules(list(order.get("module_order") or order.get("modules") or []), [spec.pattern],
                              where="forced routing")
    if not routers:
        return RoutingDecision(False, f"not forced: the actual run {act} holds no router logits ({spec.pattern})")
    plens = {r["prompt_id"]: int(r["n_prompt_tokens"]) for r in
             st.sql(f"SELECT prompt_id, n_prompt_tokens FROM prompts WHERE run_id = '{act}'").to_pylist()}
    data = {m: [] for m in routers}
    for pid in pids:
        for m in routers:
            try:
                b, e, a = (read_router_logits(st, runs[r], pid, m, plens[pid])
                           for r in ("baseline", "expected", "actual"))
            except (ValueError, KeyError) as err:  # missing evidence: the routing comparator fails it, naming it
                return RoutingDecision(False, f"not forced: {err}", routers=routers)
            if not (b.shape == e.shape == a.shape) or not all(np.isfinite(x).all() for x in (b, e, a)):
                return RoutingDecision(False, f"not forced: prompt {pid} {m}: router logits of shapes {b.shape}, "
                                              f"{e.shape}, {a.shape} or not finite", routers=routers)
            data[m].append((b, e, a))
    mt = cfg["model_type"]
    rule = {}  # role -> (engine, dtype): how its router broke exact ties (chosen_experts)
    for role in ("baseline", "expected", "actual"):
        got = st.sql(f"SELECT engine, dtype FROM runs WHERE run_id = '{runs[role]}'").to_pylist()[0]
        rule[role] = (got["engine"], got["dtype"])

    def choices(b, e, a):  # each role's experts as its router chose them, as the routing comparator counts
        return tuple(chosen_experts(x, k, mt, rule[role][1], rule[role][0])
                     for role, x in (("baseline", b), ("expected", e), ("actual", a)))

    chosen = {m: [choices(*x) for x in data[m]] for m in routers}
    from capturestore.comparators.routing import ROUTER_LOGITS_PHASE
    from metrics.modules import ModuleJudge

    from capturestore.comparators.base import decoder_layer_index

    per = {}  # router -> (flips, expected's flips, unexplained, logits beyond noise)
    for m in routers:
        judge = ModuleJudge()
        for pid, (b, e, a) in zip(pids, data[m]):
            judge.add(pid, m, ROUTER_LOGITS_PHASE, b, e, a, positions=np.arange(b.shape[0]), prompt_len=plens[pid])
        beyond = judge.verdict().modules[0].passed is False  # the routing comparator's logit rule
        scale = noise_scale(np.concatenate([router_noise(e, b) for b, e, _ in data[m]]))
        n = np.zeros(3, np.int64)
        for (b, e, a), ch in zip(data[m], chosen[m]):
            r = routing_flips(b, e, a, k, layer_noise=scale, experts=ch)
            n += (int(r["flip"].sum()), int(r["noise_flip"].sum()), int((r["flip"] & ~r["explained"]).sum()))
        per[m] = (*n.tolist(), beyond)
    n_flip, n_noise, n_un = (sum(v[i] for v in per.values()) for i in range(3))
    tokens = [st.read_tokens(act, pid).tolist() for pid in pids]
    experts = [{m: chosen[m][i][2] for m in routers} for i in range(len(pids))]
    counts = {"n_flips": n_flip, "n_noise_flips": n_noise, "n_unexplained": n_un, "routers": routers,
              "model_type": mt, "plan": RoutingPlan(tokens, experts, source_run=act)}
    failing = [m for m in routers if per[m][2] or per[m][3]]
    layer = {m: decoder_layer_index(m) for m in routers}
    if any(layer[m] is None for m in routers):  # no layer order to trust: all or nothing
        bad = next((m for m in routers if layer[m] is None), None)
        if failing:
            return RoutingDecision(False, f"not forced: routing fails at {failing[0]} and router {bad} has no decoder "
                                          f"layer index to order the layers by", **counts)
        forced, first = list(routers), None
    elif failing:
        first = min(layer[m] for m in failing)
        forced = [m for m in routers if layer[m] < first]
    else:
        forced, first = list(routers), None
    fm = min((m for m in failing if layer[m] == first), default=None)
    why = "" if fm is None else (
        f"{per[fm][2]} of its {per[fm][0]} flips not explained by BF16 router noise" if per[fm][2]
        else "its router logits beyond BF16 noise")
    if first is not None and not forced:
        return RoutingDecision(False, f"not forced: routing fails at the first MoE layer {first} ({fm}: {why}): no "
                                      f"layer before it to force", failed_layer=first, **counts)
    f_flip, f_noise = sum(per[m][0] for m in forced), sum(per[m][1] for m in forced)
    where = "" if first is None else f" before layer {first}"
    if not f_flip and not f_noise:
        return RoutingDecision(False, f"not forced: every role chose the same experts at every token{where}",
                               failed_layer=first, **counts)
    if first is None:
        return RoutingDecision(True, f"forced: the actual run flipped {n_flip} token-layer expert choices against FP32 "
                                     f"(the expected run {n_noise}), every one explained by BF16 router noise",
                               forced=forced, **counts)
    ls = [layer[m] for m in forced]
    return RoutingDecision(True, f"forced layers {min(ls)}-{max(ls)} only: routing fails at layer {first} ({fm}: "
                                 f"{why}); before it the actual run flipped {f_flip} token-layer expert choices "
                                 f"against FP32 (the expected run {f_noise}), every one explained by BF16 router "
                                 f"noise; layers {first}+ keep the references' own routing",
                           forced=forced, failed_layer=first, **counts)


def logits_routed_alike(st, act: str, mod_act: str, base: str, exp: str,
                        pids: list[str]) -> tuple[bool | None, float, float]:
    """Whether the actual logits/KV run ``act`` routed as its module run ``mod_act`` did (the
    forcing plan is read from the module run): two executions of the engine, which at a near-tie
    may route differently (HF: one forward over prompt + teacher tokens against stepwise decode;
    BF16 rounding differs with the shapes). Both hold the logits of the same positions: they
    must agree within ``CONSISTENCY_FACTOR`` x the median over tokens of the expected run's BF16
    logit error ``max_vocab |exp - base|`` (the median: the expected run's own flips sit in its
    tail). Measured on the tiny Mixtral, HF SDPA BF16: the same routing differs by 0.06-0.10
    (one forward against stepwise), the median noise is ~0.16, a differently routed token 0.35-3.0.
    Returns ``(alike, max difference, bar)``; ``alike`` None when the module run holds no logits
    (vLLM module runs): not checked. A logits run that routed otherwise than the plan then differs
    from the forced references by a flip's consequence and fails: the check guards against a false
    FAIL, never a false PASS."""
    diff, noise = [], []
    for pid in pids:
        a = np.asarray(st.read_logits(act, pid), np.float64)
        try:
            m = np.asarray(st.read_logits(mod_act, pid), np.float64)
        except ValueError:
            return None, float("nan"), float("nan")
        e, b = (np.asarray(st.read_logits(r, pid), np.float64) for r in (exp, base))
        n = min(a.shape[0], m.shape[0], e.shape[0], b.shape[0])
        diff.append(np.abs(a[:n] - m[:n]).max(axis=-1))
        noise.append(np.abs(e[:n] - b[:n]).max(axis=-1))
    d, q = np.concatenate(diff), np.concatenate(noise)
    if not (np.isfinite(d).all() and np.isfinite(q).all()) or not d.size:
        return False, float("nan"), float("nan")
    bar = CONSISTENCY_FACTOR * float(np.median(q))
    return bool(d.max() <= bar), float(d.max()), bar


def capture_forced_references(pstore, model_path, model_hash: str, rows, teacher_rows, decision: RoutingDecision,
                              dtype: str, module_order=None, kernel_rounding: str | None = None,
                              logits_kv: bool = True, say=lambda s: None,
                              logits_kernel_rounding: str | None = None, routers: list | None = None) -> dict:
    """The FP32 baseline and ``dtype`` expected references with the decision's experts forced:
    logits + KV runs (``logits_kv``; teacher-forced on ``teacher_rows``) and, with ``module_order``,
    module runs over those modules. The expected runs round FP32 -> BF16 as the unforced expected
    runs they replace record (``extractors.kernel_rounding``): ``logits_kernel_rounding`` (logits +
    KV), ``kernel_rounding`` (modules); the baseline never (FP32). Returns ``{"baseline", "expected", "mod_baseline",
    "mod_expected", "stats"}`` (run ids; absent when not captured). Each run's config records
    ``routing_forced_from`` (the actual module run), ``routing_forced_layers`` (the decoder layers
    whose routers were forced) and ``model_given`` (never reused as a plain reference). ``routers``:
    the routers to force, by default ``decision.forced`` (a test may force others, e.g. every
    router where the decision forced none); ValueError when there is none."""
    from extractors.hf import capture_hf_run, load_hf_model
    from extractors.modules import capture_hf_module_run
    from extractors.routing_force import ForcedRouting

    plan = decision.plan
    if routers is None:
        routers = decision.forced
    if not routers:
        raise ValueError(f"forced routing: no router to force ({decision.reason})")
    from capturestore.comparators.base import decoder_layer_index

    extra = {"routing_forced_from": plan.source_run,
             "routing_forced_layers": sorted({decoder_layer_index(m) for m in routers})}
    out: dict = {"stats": {}}
    for role, d in (("baseline", "float32"), ("expected", dtype)):
        model = load_hf_model(model_path, d)
        if logits_kv:
            fr = ForcedRouting(model, plan, routers, decision.model_type)
            with fr:
                out[role] = capture_hf_run(pstore, model_path, rows, teacher_tokens=teacher_rows, dtype=d, model=model,
                                           model_hash=model_hash, config=extra,
                                           kernel_rounding=logits_kernel_rounding if role == "expected" else None)
            out["stats"][role] = dict(fr.stats)
        if module_order:
            fr = ForcedRouting(model, plan, routers, decision.model_type)
            with fr:
                out[f"mod_{role}"] = capture_hf_module_run(
                    pstore, model_path, rows, teacher_rows, list(module_order), dtype=d, model=model,
                    model_hash=model_hash, config=extra,
                    kernel_rounding=kernel_rounding if role == "expected" else None)
            out["stats"][f"mod_{role}"] = dict(fr.stats)
        say(f"forced-routing {role} ({d}): runs {out.get(role)}, {out.get(f'mod_{role}')}; "
            f"{out['stats'].get(f'mod_{role}', out['stats'].get(role))}")
        del model
    return out
