"""Forced routing (docs/moe.md "Forced routing"): references captured with the engine's expert
choices, so an explained router flip's discrete consequence does not fail the continuous verdicts,
while a real fault still fails, localised.

The engine is HF BF16 eager (the expected run's own computation) whose layer-0 router breaks one
near-tie the other way: at the token with the smallest FP32 top-2 margin (one the expected run did
not flip), the 3rd expert's logit is raised one BF16 step above the 2nd's (a change of the size of
BF16 router noise). Everything else it computes is the expected run's, bit for bit, which is the
oracle for the forced references. Two models: the tiny Mixtral (real fault: layer 1's MoE output
x 1.05) and the tiny GPT-OSS (real fault: layer 2's attention sinks ignored, the fault
docs/gpt-oss.md could not localise against unforced references). One module fixture per model;
~1 + 1.5 min on 2 loaded cores.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.forced_routing import (
    capture_forced_references,
    logits_routed_alike,
    read_router_logits,
    routing_decision,
)
from capturestore.pipeline import encode_prompts
from extractors.hf import capture_hf_run, load_hf_model
from extractors.models import tiny_model
from extractors.modules import capture_hf_module_run
from extractors.routing_force import ROUTER_WEIGHTS
from metrics.routing import top_k_experts, top_k_margin

torch = pytest.importorskip("torch")

ARCHS = {
    "mixtral-moe": {
        "prompts": ["The quick brown fox jumps over the lazy dog and then", "In 2024 the numbers were 17 and 42 while"],
        "modules": ["model.layers.*.mlp", "model.layers.*.mlp.gate"], "router": "model.layers.{}.mlp.gate",
        "fault": "mlp_scale", "fault_layer": 1, "fault_module": "model.layers.1.mlp"},
    "gpt-oss": {  # token ids (the tiny GPT-OSS's prompts of tests/capturestore/gpt_oss_checks.py)
        "prompts": [[1] + [40 + (7 * i) % 300 for i in range(39)], [1, 43, 323, 79, 82, 391, 326, 72]],
        "modules": ["model.layers.*.self_attn", "model.layers.*.mlp", "model.layers.*.mlp.router"],
        "router": "model.layers.{}.mlp.router", "fault": "sinks_ignored", "fault_layer": 2,
        "fault_module": "model.layers.2.self_attn"},
}


def _route(module, logits, model_type):
    """The router's own choice and weights from ``logits`` (transformers' rule, ``ROUTER_WEIGHTS``)."""
    x = logits if model_type == "gpt_oss" else torch.softmax(logits.float(), -1)
    ix = torch.topk(x, 2, dim=-1).indices
    return logits, ROUTER_WEIGHTS[model_type](module, logits, ix), ix


class NearTieFlip:
    """Forward hooks on ``model``: at ``positions`` of prompt ``prompt`` (prompts counted by forwards
    starting at position 0, modulo ``n_prompts``), ``router``'s 3rd-ranked logit is raised just above
    its 2nd, and the routing recomputed from those logits by the model's own rule."""

    def __init__(self, model, router, prompt, positions, n_prompts, model_type):
        self.prompt, self.positions, self.n, self.i, self.pos = prompt, set(positions), n_prompts, -1, None
        self.model_type = model_type
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        dict(model.named_modules())[router].register_forward_hook(self._hook)

    def _pre(self, module, args, kwargs):
        self.pos = kwargs["position_ids"][0].tolist()
        if self.pos[0] == 0:
            self.i = (self.i + 1) % self.n

    def _hook(self, module, args, out):
        logits, _, _ = out
        rows = [j for j, p in enumerate(self.pos) if p in self.positions] if self.i == self.prompt else []
        if not rows:
            return out
        logits = logits.clone()
        for r in rows:
            o = torch.argsort(logits[r].float(), descending=True)
            logits[r, o[2]] = logits[r, o[1]] + abs(float(logits[r, o[1]])) * 2.0 ** -7  # one BF16 step up
            assert logits[r, o[2]] > logits[r, o[1]]
        return _route(module, logits, self.model_type)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def refs(request, tmp_path_factory):
    torch.set_num_threads(1)
    arch = ARCHS[request.param]
    model = tiny_model(request.param)
    model_type = json.loads((model / "config.json").read_text())["model_type"]
    rows = arch["prompts"] if isinstance(arch["prompts"][0], list) else encode_prompts(model, arch["prompts"])
    modules, r0 = arch["modules"], arch["router"].format(0)
    st = Store.open(tmp_path_factory.mktemp("forced") / "s")
    base = capture_hf_run(st, model, rows, num_tokens=8, dtype="float32")
    pids = [r["prompt_id"] for r in st.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{base}' "
                                           "ORDER BY prompt_idx").to_pylist()]
    teacher = [st.read_tokens(base, p)[len(r):].tolist() for p, r in zip(pids, rows)]
    exp = capture_hf_run(st, model, rows, teacher_tokens=teacher, dtype="bfloat16")
    mb = capture_hf_module_run(st, model, rows, teacher, modules, dtype="float32")
    me = capture_hf_module_run(st, model, rows, teacher, modules, dtype="bfloat16")
    # the near-tie: the smallest FP32 top-2 margin of layer 0 in prompt 0 where BF16 kept FP32's experts
    b = read_router_logits(st, mb, pids[0], r0, len(rows[0]))
    e = read_router_logits(st, me, pids[0], r0, len(rows[0]))
    margin = np.where((top_k_experts(b, 2) == top_k_experts(e, 2)).all(-1), top_k_margin(b, 2), np.inf)
    pos = int(np.argmin(margin))
    return {"model": model, "st": st, "rows": rows, "pids": pids, "teacher": teacher, "base": base, "exp": exp,
            "mb": mb, "me": me, "pos": pos, "margin": float(margin[pos]), "arch": arch, "model_type": model_type,
            "modules": modules, "r0": r0}


def _engine(refs, fault=None):
    """``(logits/KV run, module run)`` of the near-tie-flipping BF16 engine (``fault``: a model patch)."""
    m = load_hf_model(refs["model"], "bfloat16")
    NearTieFlip(m, refs["r0"], 0, [refs["pos"]], len(refs["rows"]), refs["model_type"])
    if fault is not None:
        fault(m)
    st, model, rows, teacher = refs["st"], refs["model"], refs["rows"], refs["teacher"]
    return (capture_hf_run(st, model, rows, teacher_tokens=teacher, dtype="bfloat16", model=m),
            capture_hf_module_run(st, model, rows, teacher, refs["modules"], dtype="bfloat16", model=m))


def _judge(refs, act, mod_act):
    """``(decision, unforced result, forced result or None, forced runs)``."""
    st = refs["st"]
    own = {"baseline": refs["mb"], "expected": refs["me"], "actual": mod_act}
    d = routing_decision(st, own, refs["model"], refs["pids"])
    kw = {"kv": True, "comparators": ["routing", "modules"], "allow_different_models": True}
    plain = compare_runs(st, expected_run=refs["exp"], actual_run=act, baseline_run=refs["base"],
                         comparator_runs={"routing": own, "modules": own}, **kw)
    if d.plan is None:
        return d, plain, None, None
    order = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{mod_act}'").to_pylist()[0]["config"])
    f = capture_forced_references(st, refs["model"], None, refs["rows"], refs["teacher"], d, "bfloat16",
                                  module_order=order["module_order"], routers=d.forced or d.routers)
    fm = {"baseline": f["mod_baseline"], "expected": f["mod_expected"], "actual": mod_act}
    forced = compare_runs(st, expected_run=f["expected"], actual_run=act, baseline_run=f["baseline"],
                          comparator_runs={"routing": own, "modules": fm}, **kw)
    return d, plain, forced, f


@pytest.fixture(scope="module")
def flip(refs):
    act, mod_act = _engine(refs)
    return (act, mod_act) + _judge(refs, act, mod_act)


def test_the_engine_flips_one_near_tie_and_its_mlp_output_moves(refs, flip):
    st, pid, p = refs["st"], refs["pids"][0], refs["pos"]
    _, mod_act, *_ = flip
    a = read_router_logits(st, mod_act, pid, refs["r0"], len(refs["rows"][0]))
    b = read_router_logits(st, refs["mb"], pid, refs["r0"], len(refs["rows"][0]))
    assert (top_k_experts(a, 2)[p] != top_k_experts(b, 2)[p]).any()  # the flip took effect
    assert refs["margin"] < 0.02  # a near-tie in FP32
    mlp = {r: np.asarray(st.read_tensor(r, pid, "model.layers.0.mlp", phase="prefill"), np.float64).reshape(
        len(refs["rows"][0]), -1) for r in (mod_act, refs["me"])}
    moved = np.abs(mlp[mod_act] - mlp[refs["me"]]).max(-1)
    assert moved[p] > 10 * np.median(np.abs(mlp[refs["me"]]).max(-1)) * 2.0 ** -8  # far beyond BF16 rounding
    assert (moved[:p] == 0).all()  # causal: nothing before the flip moved (same computation as expected)


def test_explained_flip_fails_without_forcing_and_passes_with_forced_references(flip):
    _, _, d, plain, forced, f = flip
    assert d.force and d.n_unexplained == 0 and d.n_flips > 0, d.reason
    assert plain.verdicts["routing"].passed is True
    assert plain.passed is False  # before: the flip's consequence fails the continuous verdicts
    assert plain.verdicts["modules"].passed is False  # (Mixtral: at layer 0's MoE block; GPT-OSS: layer 2)
    assert forced is not None and forced.passed is True, {k: v.text for k, v in forced.verdicts.items()}
    assert all(v.passed for v in forced.verdicts.values())
    assert f["stats"]["mod_expected"]["changed"] >= 1 and f["stats"]["mod_baseline"]["changed"] >= 1


def test_the_engines_logits_run_routed_as_its_module_run(refs, flip):
    act, mod_act = flip[:2]
    alike, diff, bar = logits_routed_alike(refs["st"], act, mod_act, refs["base"], refs["exp"], refs["pids"])
    assert alike is True and diff < bar
    # against a run that routed otherwise (the unforced expected: no flip at the near-tie) it is not alike
    alike, diff, bar = logits_routed_alike(refs["st"], refs["exp"], mod_act, refs["base"], refs["exp"], refs["pids"])
    assert alike is False and diff > bar


def test_forced_references_record_their_source_and_the_forced_expected_is_the_engine(refs, flip):
    """Oracle: the engine is HF BF16 eager plus one flip; the BF16 reference forced to its experts
    computes the same thing: logits bit-equal where the flipped token's routing weights cannot reach
    (prompt 1 entirely), and within BF16 rounding of a changed routing weight elsewhere."""
    st = refs["st"]
    act, mod_act, _, _, _, f = flip
    for rid in (f["baseline"], f["expected"], f["mod_baseline"], f["mod_expected"]):
        cfg = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()[0]["config"])
        assert cfg["routing_forced_from"] == mod_act and cfg["model_given"] is True
    la, lf = (np.asarray(st.read_logits(r, refs["pids"][1]), np.float64) for r in (act, f["expected"]))
    assert np.array_equal(la, lf)
    la, lf, lu = (np.asarray(st.read_logits(r, refs["pids"][0]), np.float64) for r in (act, f["expected"], refs["exp"]))
    assert np.abs(la - lf).max() < 0.25 * np.abs(la - lu).max()


def _fault(refs):
    """The real fault of the model (``ARCHS``): a model patch."""
    arch = refs["arch"]
    if arch["fault"] == "mlp_scale":  # the MoE block's output x 1.05

        def patch(m):
            dict(m.named_modules())[arch["fault_module"]].register_forward_hook(
                lambda _m, _a, o: tuple(x * 1.05 if i == 0 else x for i, x in enumerate(o)) if isinstance(o, tuple)
                else o * 1.05)
    else:  # the attention sinks of one layer ignored: their logit -> -1e4 (exp underflows to 0)

        def patch(m):
            with torch.no_grad():
                dict(m.named_modules())[arch["fault_module"]].sinks.fill_(-1e4)
    return patch


def test_a_real_fault_still_fails_with_forced_references_localised(refs, flip):
    act, mod_act = _engine(refs, _fault(refs))
    st, layer = refs["st"], refs["arch"]["fault_layer"]
    moved = max(np.abs(np.asarray(st.read_logits(act, p), np.float64) - np.asarray(st.read_logits(flip[0], p))).max()
                for p in refs["pids"])
    assert moved > 0.05  # the fault took effect
    d, plain, forced, _ = _judge(refs, act, mod_act)
    assert d.n_unexplained == 0, d.reason  # every flip explained ...
    # ... but the fault moves a router at or after its layer beyond BF16 noise (both tiny models):
    # routing fails there, and run forces only the layers before it (the near-tie's layer 0 among them)
    assert "beyond BF16 noise" in d.reason and plain.verdicts["routing"].passed is False
    assert d.force and 0 in d.forced_layers and max(d.forced_layers) < d.failed_layer, d.reason
    assert d.failed_layer >= layer
    assert forced.passed is False
    m = forced.verdicts["modules"]
    assert m.passed is False and m.localisation.layer == layer and m.localisation.module == refs["arch"]["fault_module"]
    assert forced.verdicts["kv"].passed is False and forced.verdicts["kv"].localisation.layer == layer + 1


def _router_bias(refs, layer, shift=4.0):
    """A model patch: ``layer``'s router adds ``shift`` to expert 0's logit (a real router fault) and
    routes from those logits by the model's own rule."""
    mt = refs["model_type"]

    def patch(m):
        def hook(module, _a, out):
            logits = out[0].clone()
            logits[:, 0] += shift
            return _route(module, logits, mt)
        dict(m.named_modules())[refs["arch"]["router"].format(layer)].register_forward_hook(hook)
    return patch


def _expert0_share(refs, mod_act, layer):
    a = read_router_logits(refs["st"], mod_act, refs["pids"][0], refs["arch"]["router"].format(layer),
                           len(refs["rows"][0]))
    return float((top_k_experts(a, 2) == 0).any(-1).mean())


def test_an_unexplained_flip_is_never_forced(refs):
    """A router bias (layer 1: expert 0's logit + 4, far beyond BF16 noise) changes the experts of
    most tokens: those flips are not explained, so layer 1 and later are never forced (layer 0,
    before it, may be: its routing is the expected run's own)."""
    layer = 1
    m = load_hf_model(refs["model"], "bfloat16")
    _router_bias(refs, layer)(m)
    mod_act = capture_hf_module_run(refs["st"], refs["model"], refs["rows"], refs["teacher"], refs["modules"],
                                    dtype="bfloat16", model=m)
    assert _expert0_share(refs, mod_act, layer) > 0.9  # took effect: expert 0 chosen nearly everywhere
    d = routing_decision(refs["st"], {"baseline": refs["mb"], "expected": refs["me"], "actual": mod_act},
                         refs["model"], refs["pids"])
    assert d.n_unexplained > 0 and d.failed_layer == layer
    assert set(d.forced_layers) <= {0}
    assert "not explained" in d.reason


def test_an_unexplained_flip_at_the_first_moe_layer_forces_nothing(refs, flip):
    """The near-tie engine with a router bias at layer 0 too: routing fails at the first MoE layer,
    no layer before it is trustworthy: nothing forced, and forcing on this decision is refused."""
    act, mod_act = _engine(refs, _router_bias(refs, 0))
    assert _expert0_share(refs, mod_act, 0) > 0.9  # took effect
    d = routing_decision(refs["st"], {"baseline": refs["mb"], "expected": refs["me"], "actual": mod_act},
                         refs["model"], refs["pids"])
    assert not d.force and d.forced == [] and d.forced_layers == [] and d.failed_layer == 0
    assert d.n_unexplained > 0 and "first MoE layer 0" in d.reason and "not explained" in d.reason
    with pytest.raises(ValueError, match="no router to force"):
        capture_forced_references(refs["st"], refs["model"], None, refs["rows"], refs["teacher"], d, "bfloat16")


def test_a_router_fault_after_an_explained_flip_forces_the_layers_before_it_localised_there(refs, flip):
    """The near-tie engine (explained flip at layer 0) with a real fault in layer 2's router (expert
    0's logit + 4). Before (all-or-nothing: nothing forced): the modules fail first at the near-tie's
    consequence, ahead of the fault. After: layers 0-1 forced, every module of layers 0-1 passes, and
    the failure is localised at layer 2."""
    layer = 2
    act, mod_act = _engine(refs, _router_bias(refs, layer))
    st = refs["st"]
    assert _expert0_share(refs, mod_act, layer) > 0.9  # the fault took effect ...
    moved = max(np.abs(np.asarray(st.read_logits(act, p), np.float64) - np.asarray(st.read_logits(flip[0], p))).max()
                for p in refs["pids"])
    assert moved > 0.05  # ... and moves the output
    d, plain, forced, f = _judge(refs, act, mod_act)
    assert d.force and d.failed_layer == layer and d.forced_layers == [0, 1], d.reason
    assert d.forced == [refs["arch"]["router"].format(i) for i in (0, 1)]
    assert "forced layers 0-1 only" in d.reason and "not explained" in d.reason
    # before: nothing forced; the flip's consequence fails a module before layer 2 (or the logits
    # verdict beyond the fault's): the modules' localisation is not the fault's router layer alone
    pm = plain.verdicts["modules"]
    early = [v.module for v in pm.detail.modules if v.passed is False and v.layer is not None and v.layer < layer]
    if refs["model_type"] == "mixtral":  # the near-tie's MoE output fails its own layer-0 block, localised there
        # (and layer 1's router logits, which read it): the wrong layer
        assert pm.passed is False and early[0] == "model.layers.0.mlp" and plain.localisation["layer"] == 0, pm.text
    else:  # GPT-OSS: the near-tie's consequence stays within the modules' noise (logits fail on it, above)
        assert not early and pm.localisation.layer == layer, pm.text
    # after: every module before layer 2 passes, the failure is at layer 2 (routing and modules)
    fm = forced.verdicts["modules"]
    assert all(v.passed for v in fm.detail.modules if v.layer is not None and v.layer < layer), fm.text
    assert fm.passed is False and fm.localisation.layer == layer, fm.text
    r = forced.verdicts["routing"]
    assert r.passed is False and r.localisation.layer == layer
    assert forced.localisation["layer"] == layer
    n_layers = json.loads((refs["model"] / "config.json").read_text())["num_hidden_layers"]
    kv = forced.verdicts["kv"]  # layer 2's MoE output is first read by layer 3's K/V (GPT-OSS; Mixtral has 3)
    assert (kv.passed is False and kv.localisation.layer == layer + 1) if layer + 1 < n_layers else kv.passed, kv.text
    for rid in (f["baseline"], f["expected"], f["mod_baseline"], f["mod_expected"]):
        cfg = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()[0]["config"])
        assert cfg["routing_forced_layers"] == [0, 1] and cfg["routing_forced_from"] == mod_act
    assert f["stats"]["mod_expected"]["changed"] >= 1  # the near-tie was forced


def test_missing_router_evidence_is_not_forced_and_named(refs, flip):
    """A role without router logits (here a logits run in the expected role): nothing forced, the
    reason names run, module and prompt (the routing comparator then fails that layer)."""
    d = routing_decision(refs["st"], {"baseline": refs["mb"], "expected": refs["exp"], "actual": flip[1]},
                         refs["model"], refs["pids"])
    assert not d.force and d.plan is None
    assert refs["exp"] in d.reason and refs["r0"] in d.reason and refs["pids"][0] in d.reason


# ------------------------------------------------------------------ the pipeline's forcing step, stubbed
# (no capture: the decision and the forced capture are spies; the store answers run configs only)


class _Configs:
    """A store whose ``sql`` answers ``SELECT config FROM runs WHERE run_id = '<id>'``."""

    def __init__(self, configs):
        self.configs = configs

    def sql(self, q):
        rid = q.split("run_id = '")[1].split("'")[0]
        rows = [{"config": json.dumps(self.configs[rid])}]
        return type("R", (), {"to_pylist": lambda self: rows})()


def _forced_step(monkeypatch, configs, model_path="m", *, fp8=False, logits_kv=True, dtype="bfloat16", decision=None):
    """Run ``pipeline._forced_routing`` on a forcing decision (``decision``: one of every router);
    returns ``(capture kwargs or None, said lines, returned (baseline, expected, comparator_runs))``."""
    import capturestore.forced_routing as fr
    from capturestore.pipeline import _forced_routing

    seen, said = {}, []
    monkeypatch.setattr(fr, "routing_decision", lambda *a, **k: decision or fr.RoutingDecision(
        True, "forced: the actual run flipped 3 token-layer expert choices (stub)", n_flips=3, plan=object(),
        forced=[f"model.layers.{i}.mlp.gate" for i in range(3)]))
    monkeypatch.setattr(fr, "logits_routed_alike", lambda *a, **k: (True, 0.0, 1.0))

    def capture(*args, **kw):
        seen.update(kw)
        return {"stats": {}, "mod_baseline": "fmb", "mod_expected": "fme",
                **({"baseline": "fb", "expected": "fe"} if kw.get("logits_kv") else {})}

    monkeypatch.setattr(fr, "capture_forced_references", capture)
    mods = {"baseline": "mb", "expected": "me", "actual": "ma"}
    got = _forced_routing(_Configs(configs), None, said.append, {}, model_path, "h", [[1, 2]], ["p0"], [[3]], mods,
                          {"routing": dict(mods), "modules": dict(mods)}, dtype, logits_kv=logits_kv, base="b",
                          exp="e", act="a", fp8=fp8)
    return (seen or None), said, got


def test_forced_expected_references_round_as_the_unforced_expected_runs_record(monkeypatch):
    """A truncating target (module run: kernel_rounding toward_zero) whose unforced expected runs
    record toward_zero: the forced expected logits/KV run and module run are asked for toward_zero
    too (before: the logits/KV run for none, rounding to nearest against a truncating engine)."""
    configs = {"ma": {"kernel_rounding": "toward_zero", "module_order": ["model.layers.0.mlp"]},
               "me": {"kernel_rounding": "toward_zero"}, "e": {"kernel_rounding": "toward_zero"}}
    kw, said, (base, exp, runs) = _forced_step(monkeypatch, configs)
    assert kw["kernel_rounding"] == "toward_zero" and kw["logits_kernel_rounding"] == "toward_zero"
    assert (base, exp) == ("fb", "fe") and runs["modules"]["expected"] == "fme" and runs["routing"]["expected"] == "me"
    assert any("toward zero (logits, KV), toward zero (modules)" in s for s in said)


def test_forced_references_of_a_gpt_oss_truncating_target_keep_nearest_and_say_so(monkeypatch):
    """GPT-OSS: the rounding emulation does not cover attention sinks, so the unforced module
    expected run rounds to nearest (pipeline._emulated_rounding, real, on the tiny GPT-OSS's
    config); the forced one must too: asking capture_hf_module_run for the raw probed toward_zero
    (as before) raises "no emulation of attention sinks" and ``capturestore run`` exits 2."""
    from capturestore.pipeline import _emulated_rounding
    from extractors.kernel_rounding import kernel_rounding_unsupported

    model = tiny_model("gpt-oss")
    assert kernel_rounding_unsupported(model)  # what toward_zero would raise on
    told = []
    unforced = _emulated_rounding("toward_zero", model, told.append, "module reference")
    assert unforced is None and "rounds to nearest" in told[0]
    configs = {"ma": {"kernel_rounding": "toward_zero", "module_order": ["model.layers.0.mlp"]},
               "me": {"kernel_rounding": unforced}, "e": {}}
    kw, said, _ = _forced_step(monkeypatch, configs, model)
    assert kw["kernel_rounding"] is None and kw["logits_kernel_rounding"] is None
    assert any("nearest (logits, KV), nearest (modules); the target's kernels round toward zero" in s for s in said)


def test_an_fp8_kv_target_is_judged_against_its_unforced_fp8_references(monkeypatch):
    """FP8 KV target: its logits/KV references come from the FP8 plan (FP8 KV emulated); forced
    plain HF references would drop that emulation, so logits and KV stay unforced, said in one line;
    module references (plain HF for every target) are still forced."""
    configs = {"ma": {"module_order": ["model.layers.0.mlp"]}, "me": {}, "e": {}}
    kw, said, (base, exp, runs) = _forced_step(monkeypatch, configs, fp8=True)
    assert (base, exp) == ("b", "e")  # the FP8 plan's runs
    assert kw["logits_kv"] is False and runs["modules"]["expected"] == "fme"
    assert sum("not forced: FP8 KV references" in s for s in said) == 1


def test_capture_forced_references_rounds_the_expected_runs_only(monkeypatch):
    """Spies on the capture functions: the forced expected logits/KV run gets
    ``logits_kernel_rounding`` and the module run ``kernel_rounding``; the FP32 baseline neither."""
    import extractors.hf as hf
    import extractors.modules as mo
    import extractors.routing_force as rf
    from capturestore.forced_routing import RoutingDecision

    calls = []

    class _Forced:
        def __init__(self, *a):
            self.stats = {}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(hf, "load_hf_model", lambda path, d: d)
    monkeypatch.setattr(rf, "ForcedRouting", _Forced)
    monkeypatch.setattr(hf, "capture_hf_run", lambda *a, dtype, kernel_rounding=None, **k:
                        calls.append(("logits", dtype, kernel_rounding)) or f"l-{dtype}")
    monkeypatch.setattr(mo, "capture_hf_module_run", lambda *a, dtype, kernel_rounding=None, **k:
                        calls.append(("modules", dtype, kernel_rounding)) or f"m-{dtype}")
    d = RoutingDecision(True, "forced", plan=type("P", (), {"source_run": "ma"})(), forced=["model.layers.0.mlp.gate"])
    capture_forced_references(None, "m", "h", [[1]], [[2]], d, "bfloat16", module_order=["x"],
                              kernel_rounding="toward_zero", logits_kernel_rounding="toward_zero")
    assert calls == [("logits", "float32", None), ("modules", "float32", None),
                     ("logits", "bfloat16", "toward_zero"), ("modules", "bfloat16", "toward_zero")]


def test_run_says_which_layers_it_forced_and_forces_nothing_on_a_decision_that_forces_nothing(monkeypatch):
    """The pipeline prints the decision with ``routing_forced_layers``; a partial decision's capture
    gets the decision (whose ``forced`` routers ``capture_forced_references`` forces); a decision that
    forces nothing captures nothing and keeps every unforced reference."""
    from capturestore.forced_routing import RoutingDecision

    configs = {"ma": {"module_order": ["model.layers.0.mlp"]}, "me": {}, "e": {}}
    part = RoutingDecision(True, "forced layers 0-1 only: routing fails at layer 2 (stub)", plan=object(),
                           forced=["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"], failed_layer=2)
    kw, said, (base, exp, runs) = _forced_step(monkeypatch, configs, decision=part)
    assert said[0] == "routing: forced layers 0-1 only: routing fails at layer 2 (stub) (routing_forced_layers [0, 1])"
    assert (base, exp) == ("fb", "fe") and runs["modules"]["expected"] == "fme"
    none = RoutingDecision(False, "not forced: routing fails at the first MoE layer 0 (stub)", plan=object(),
                           failed_layer=0)
    kw, said, (base, exp, runs) = _forced_step(monkeypatch, configs, decision=none)
    assert kw is None and said == ["routing: not forced: routing fails at the first MoE layer 0 (stub)"]
    assert (base, exp) == ("b", "e") and runs["modules"]["expected"] == "me"
