"""Module capture on real HF engines, and the module verdict on faults injected into them.

Faults are patched into an HF BF16 model (the actual role); FP32 is the baseline and a clean
BF16 model the expected source. Each fault is first proven to take effect: the faulty capture
differs from the clean one at the faulted module and is bit-identical before it.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from extractors.hf import extract_hf_kv_caches_teacher_forced, load_hf_model  # noqa: E402
from extractors.modules import (  # noqa: E402
    DEFAULT_MODULES,
    ModuleHooks,
    capture_hf_module_run,
    capture_hf_modules,
    collect_hf_modules,
    resolve_modules,
)
from metrics.modules import judge_modules  # noqa: E402

N_PROMPTS = 8


def _prompts(n=N_PROMPTS, seed=0, cont=6):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 1000, size=int(rng.integers(6, 16))).tolist() for _ in range(n)]
    conts = [rng.integers(4, 1000, size=cont).tolist() for _ in range(n)]
    return prompts, conts


# ------------------------------------------------------------------------------ patterns

NAMES = ["model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.mlp",
         "model.layers.0.mlp.up_proj", "model.layers.1", "model.layers.1.mlp", "model.layers.1.mlp.up_proj",
         "model.layers.2", "model.layers.2.self_attn", "model.layers.12", "model.norm", "lm_head"]


def test_patterns_ranges_wildcards_and_globstar_keep_the_model_order():
    assert resolve_modules(NAMES, "model.layers.0-1") == ["model.layers.0", "model.layers.1"]
    assert resolve_modules(NAMES, "model.layers.1-31") == ["model.layers.1", "model.layers.2", "model.layers.12"]
    assert resolve_modules(NAMES, ["lm_head", "model.layers.*.mlp"]) == [
        "model.layers.0.mlp", "model.layers.1.mlp", "lm_head"]
    assert resolve_modules(NAMES, "model.layers.1.**") == [
        "model.layers.1", "model.layers.1.mlp", "model.layers.1.mlp.up_proj"]
    assert resolve_modules(NAMES, "**.up_proj") == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]


def test_a_modules_own_name_resolves_to_it_alone_in_the_model_order():
    # a capture resolves the names it resolved before as literal patterns (one lookup each)
    assert resolve_modules(NAMES, NAMES[::-1]) == NAMES
    assert resolve_modules(NAMES, ["model.layers.12", "model.layers.1"]) == ["model.layers.1", "model.layers.12"]
    assert resolve_modules(NAMES, ["model.layers.1-2", "lm_head"]) == ["model.layers.1", "model.layers.2", "lm_head"]
    with pytest.raises(ValueError, match=r"'model.layers.3' matches no module.*model.layers.2"):
        resolve_modules(NAMES, ["model.layers.3"])


def test_a_pattern_matching_nothing_is_refused_with_close_matches():
    with pytest.raises(ValueError, match=r"'model.layers.\*.mpl' matches no module.*model.layers.0.mlp"):
        resolve_modules(NAMES, ["lm_head", "model.layers.*.mpl"])
    with pytest.raises(ValueError, match="'model.layers.40-50' matches no module"):
        resolve_modules(NAMES, "model.layers.40-50")
    with pytest.raises(ValueError, match="non-empty dotted name"):
        resolve_modules(NAMES, "model..norm")


def test_write_tensor_steps_refuses_repeated_or_miscounted_steps(tmp_path):
    from capturestore import Store

    store = Store.open(tmp_path / "s")
    run = store.begin_run(engine="hf", model_path="m", dtype="float32")
    pid = run.add_prompt([5, 6, 7], continuation=[8, 9])
    x = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    with pytest.raises(ValueError, match="repeat a step"):
        run.write_tensor_steps(pid, "model.norm", x, [0, 1, 1])
    with pytest.raises(ValueError, match=r"2 steps for an array of shape \(3, 1, 4\)"):
        run.write_tensor_steps(pid, "model.norm", x, [0, 1])
    run.write_tensor_steps(pid, "model.norm", x, [0, 1, 2])
    with pytest.raises(ValueError, match="step 2 was already written"):
        run.write_tensor_steps(pid, "model.norm", x[:2], [3, 2])
    run.commit()
    np.testing.assert_array_equal(store.read_tensor(run.run_id, pid, "model.norm", phase="decode"), x)


def test_capture_refuses_a_bad_pattern_before_writing_a_run(tmp_path, tiny_model):
    from capturestore import Store

    store = Store.open(tmp_path / "s")
    with pytest.raises(ValueError, match="'model.layer.0' matches no module.*model.layers.0"):
        capture_hf_module_run(store, tiny_model("llama-gqa"), [[5, 6, 7]], [[8, 9]], modules=["model.layer.0"])
    assert store.runs().num_rows == 0


# ------------------------------------------------------------------------------ capture is correct


def test_stepwise_capture_matches_one_forward_over_the_whole_sequence(tiny_model):
    """Oracle: one FP32 forward over prompt + continuation (no cache) with a plain hook. Prefill
    rows are positions 0..P-1, decode step n is position P+n; the returned logits are
    extract_hf_kv_caches_teacher_forced's."""
    path = tiny_model("llama-gqa")
    model = load_hf_model(path, "float32")
    prompt, cont = [5, 17, 99, 400, 3, 8], [11, 12, 13, 14]
    got, order = collect_hf_modules(model, [prompt], [cont], ["model.layers.1.mlp", "model.norm", "lm_head"])
    got = got[0]
    full = {}
    hs = [dict(model.named_modules())[m].register_forward_hook(
        lambda mod, a, o, m=m: full.__setitem__(m, o[0].detach().clone())) for m in ("model.layers.1.mlp", "model.norm")]
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt + cont]))
    for h in hs:
        h.remove()
    P = len(prompt)
    for m in ("model.layers.1.mlp", "model.norm"):
        assert got[(m, "prefill")].shape == (P, 128)
        assert got[(m, "decode")].shape == (len(cont) - 1, 128)
        np.testing.assert_allclose(got[(m, "prefill")], full[m][:P].numpy(), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(got[(m, "decode")], full[m][P:P + len(cont) - 1].numpy(), atol=2e-5, rtol=1e-5)
    logits, _ = capture_hf_modules(model, prompt, cont, lambda *a: None, ["lm_head"])
    ref, _ = extract_hf_kv_caches_teacher_forced(model, [prompt], [cont], return_logits=True)
    np.testing.assert_allclose(logits.numpy(), ref[:, 0].numpy(), atol=2e-5, rtol=1e-5)
    assert order == ["model.layers.1.mlp", "model.norm", "lm_head"]


def test_inputs_on_request_are_the_previous_modules_outputs(tiny_model):
    model = load_hf_model(tiny_model("llama-gqa"), "float32")
    got, order = collect_hf_modules(model, [[5, 6, 7, 8]], [[9, 10, 11]], ["model.layers.2", "model.norm"],
                                    inputs=True)
    got = got[0]
    assert ("model.norm:input", "decode") in got and order == ["model.layers.2", "model.norm"]
    for phase in ("prefill", "decode"):
        np.testing.assert_array_equal(got[("model.norm:input", phase)], got[("model.layers.2", phase)])


def test_capture_is_a_copy_of_a_buffer_a_later_module_overwrites_in_place():
    class InPlace(torch.nn.Module):  # reuses its input's buffer, as fused kernels do
        def forward(self, x):
            return x.mul_(100.0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = InPlace()

        def forward(self, x):
            return self.b(self.a(x))

    net = Net()
    x = torch.randn(1, 3, 4)
    with torch.no_grad():
        want = net.a(x)[0].clone()
        got = {}
        with ModuleHooks(net, ["a"], lambda m, ph, st, t: got.__setitem__(m, t)):
            net(x)
    torch.testing.assert_close(got["a"], want)  # without the clone: 100x want


def test_run_in_the_store_holds_every_phase_and_step_and_the_execution_order(tmp_path, tiny_model):
    from capturestore import Store

    path = tiny_model("gemma3-sliding")
    store = Store.open(tmp_path / "s")
    model = load_hf_model(path, "bfloat16")
    prompts, conts = _prompts(2, cont=4)
    run = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", model=model)
    mem, order = collect_hf_modules(model, prompts, conts)
    pids = store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{run}' ORDER BY prompt_idx").column(0).to_pylist()
    for pid, want, p in zip(pids, mem, prompts):
        pre = store.read_tensor(run, pid, "model.layers.3.mlp", phase="prefill")
        dec = store.read_tensor(run, pid, "model.layers.3.mlp", phase="decode")
        assert pre.shape == (1, len(p), 128) and dec.shape == (3, 1, 128) and str(pre.dtype) == "bfloat16"
        np.testing.assert_array_equal(pre[0].astype(np.float32), want[("model.layers.3.mlp", "prefill")])
        np.testing.assert_array_equal(dec[:, 0].astype(np.float32), want[("model.layers.3.mlp", "decode")])
        np.testing.assert_array_equal(store.read_tensor(run, pid, "lm_head", step=2, phase="decode")[0].astype(np.float32),
                                      want[("lm_head", "decode")][2])
    steps = store.sql(f"SELECT steps FROM captures WHERE run_id = '{run}' AND module = 'lm_head' AND phase = 'decode'")
    assert steps.column(0).to_pylist() == [[0, 1, 2]] * 2
    import json

    cfg = json.loads(store.runs().to_pylist()[0]["config"])
    assert cfg["module_order"] == order
    # a parent finishes after its children; the rotary embedding is not an activation
    assert order.index("model.layers.0.mlp") < order.index("model.layers.0") < order.index("model.layers.1.input_layernorm")
    assert order[0] == "model.embed_tokens" and order[-2:] == ["model.norm", "lm_head"]
    assert "model.rotary_emb" not in order and len(order) == len(set(order))


# ------------------------------------------------------------------------------ faults


def _refs(path, prompts, conts):
    base, order = collect_hf_modules(load_hf_model(path, "float32"), prompts, conts)
    exp, _ = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts, conts)
    return base, exp, order


@pytest.fixture(scope="module")
def llama_refs():
    from extractors.models import tiny_model

    path = tiny_model("llama-gqa")
    prompts, conts = _prompts()
    return path, prompts, conts, *_refs(path, prompts, conts)


@pytest.fixture(scope="module")
def gemma_refs():
    from extractors.models import tiny_model

    path = tiny_model("gemma3-sliding")
    prompts, conts = _prompts()
    return path, prompts, conts, *_refs(path, prompts, conts)


def faulty_model(path, kind, layer=None, size=0.0):
    """HF BF16 model with one fault: 'mlp' (layer's MLP output x (1 + size)), 'softmax' (layer's
    attention softmax scale x (1 + size)), 'decode_pos' (positions + size in decode forwards only),
    'norm_eps' (final norm epsilon = size)."""
    m = load_hf_model(path, "bfloat16")
    if kind == "mlp":
        m.model.layers[layer].mlp.register_forward_hook(lambda mod, a, o: o * (1.0 + size))
    elif kind == "softmax":
        m.model.layers[layer].self_attn.scaling *= 1.0 + size
    elif kind == "decode_pos":
        def shift(mod, args, kwargs):
            pos = kwargs.get("position_ids")
            if pos is not None and pos.shape[-1] == 1:  # one new token: a decode forward
                kwargs["position_ids"] = pos + int(size)
            return args, kwargs
        m.model.register_forward_pre_hook(shift, with_kwargs=True)
    elif kind == "norm_eps":
        norm = m.model.norm
        setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", size)
    else:
        raise ValueError(kind)
    return m


def _judge(base, exp, act, order, prompts):
    return judge_modules([{k: (b[k], e[k], a[k]) for k in b} for b, e, a in zip(base, exp, act)], order,
                         prompt_lens=[len(p) for p in prompts])


def _prove_effect(exp, act, order, first_module, phase):
    """The fault changed the faulted module's output and nothing that ran before it."""
    diffs = {m: max(float(np.abs(e[(m, phase)] - a[(m, phase)]).max()) for e, a in zip(exp, act)) for m in order}
    assert diffs[first_module] > 0, f"fault had no effect on {first_module}"
    before = order[:order.index(first_module)]
    assert all(diffs[m] == 0 for m in before), {m: diffs[m] for m in before if diffs[m]}
    return diffs


def _check_named(v, module_prefix, layer, phase):
    loc = v.localisation
    assert not v.passed and loc is not None, v.summary()
    assert loc["module"].startswith(module_prefix), loc
    assert loc["layer"] == layer and loc["phase"] == phase, loc


def test_no_false_alarm_on_a_correct_bf16_engine(llama_refs, gemma_refs):
    """Actual: HF BF16 with SDPA attention (other kernels, other rounding) vs the eager BF16 expected."""
    import transformers

    for path, prompts, conts, base, exp, order in (llama_refs, gemma_refs):
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        act, _ = collect_hf_modules(sdpa, prompts, conts)
        assert any(float(np.abs(e[k] - a[k]).max()) > 0 for e, a in zip(exp, act) for k in e)  # not the same engine
        v = _judge(base, exp, act, order, prompts)
        assert v.passed, [m.summary() for m in v.modules if not m.passed]
        assert len(v.modules) == 2 * len(order)


def test_late_mlp_output_off_by_one_percent_is_named(llama_refs):
    path, prompts, conts, base, exp, order = llama_refs
    act, _ = collect_hf_modules(faulty_model(path, "mlp", 2, 0.01), prompts, conts)
    _prove_effect(exp, act, order, "model.layers.2.mlp", "prefill")
    v = _judge(base, exp, act, order, prompts)
    _check_named(v, "model.layers.2.mlp", 2, "prefill")
    assert v.first_failing.module == "model.layers.2.mlp"


def test_attention_softmax_scale_off_by_ten_percent_is_named(gemma_refs):
    path, prompts, conts, base, exp, order = gemma_refs
    act, _ = collect_hf_modules(faulty_model(path, "softmax", 1, 0.10), prompts, conts)
    _prove_effect(exp, act, order, "model.layers.1.self_attn.o_proj", "prefill")
    v = _judge(base, exp, act, order, prompts)
    _check_named(v, "model.layers.1.self_attn", 1, "prefill")
    assert v.first_failing.position >= 1  # one key: the softmax of one score is 1 whatever its scale


def test_decode_only_position_offset_is_named_in_decode(llama_refs):
    path, prompts, conts, base, exp, order = llama_refs
    act, _ = collect_hf_modules(faulty_model(path, "decode_pos", size=1), prompts, conts)
    assert all(np.array_equal(e[k], a[k]) for e, a in zip(exp, act) for k in e if k[1] == "prefill")
    _prove_effect(exp, act, order, "model.layers.0.self_attn.o_proj", "decode")
    v = _judge(base, exp, act, order, prompts)
    assert all(m.passed for m in v.modules if m.phase == "prefill")
    _check_named(v, "model.layers.0.self_attn", 0, "decode")
    assert v.first_failing.token == 0 and v.first_failing.position == len(prompts[int(v.first_failing.token_prompt)])


def test_wrong_final_norm_epsilon_is_named_outside_the_layers(llama_refs):
    path, prompts, conts, base, exp, order = llama_refs
    act, _ = collect_hf_modules(faulty_model(path, "norm_eps", size=0.1), prompts, conts)
    _prove_effect(exp, act, order, "model.norm", "prefill")
    v = _judge(base, exp, act, order, prompts)
    _check_named(v, "model.norm", None, "prefill")
    assert all(m.passed for m in v.modules if m.layer is not None)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["mlp", "softmax"]), layer=st.integers(0, 2), size=st.floats(0.02, 0.3),
       sign=st.sampled_from([-1.0, 1.0]))
def test_faults_of_any_layer_and_size_are_named_at_their_layer(llama_refs, kind, layer, size, sign):
    path, prompts, conts, base, exp, order = llama_refs
    act, _ = collect_hf_modules(faulty_model(path, kind, layer, sign * size), prompts[:4], conts[:4])
    v = _judge(base[:4], exp[:4], act, order, prompts[:4])
    part = "mlp" if kind == "mlp" else "self_attn"
    _check_named(v, f"model.layers.{layer}.{part}", layer, "prefill")


def test_default_modules_cover_every_activation_of_the_layers(tiny_model):
    model = load_hf_model(tiny_model("llama-gqa"), "float32")
    names = [n for n, _ in model.named_modules() if n]
    got = resolve_modules(names, DEFAULT_MODULES)
    assert "model.layers.2.self_attn.q_proj" in got and "model.layers" not in got and "model" not in got
    assert "model.rotary_emb" not in got and got[-1] == "lm_head"
