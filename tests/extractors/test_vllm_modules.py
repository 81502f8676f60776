"""vLLM module capture under HF names, judged three-way against HF FP32 / BF16 captured on the
engine's own tokens: no false alarm on a correct engine, a hook fault named with its module,
layer and phase, unmappable modules refused."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

N_PROMPTS, N_TOKENS = 8, 6


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 1000, size=int(rng.integers(6, 16))).tolist() for _ in range(N_PROMPTS)]


def _judge(path, prompts, act, toks, names):
    from extractors.hf import load_hf_model
    from extractors.modules import collect_hf_modules
    from metrics.modules import judge_modules

    base, order = collect_hf_modules(load_hf_model(path, "float32"), prompts, toks, names)
    exp, _ = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts, toks, names)
    assert order == names  # the table's order is HF's execution order
    return judge_modules([{k: (b[k], e[k], a[k]) for k in b} for b, e, a in zip(base, exp, act)], order,
                         prompt_lens=[len(p) for p in prompts])


@pytest.fixture(scope="module")
def llama_engine():
    from extractors.models import tiny_model
    from extractors.vllm_rpc import close_llm, make_llm

    path = tiny_model("llama-gqa")
    llm = make_llm(path, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)
    yield path, llm
    close_llm(llm)


def test_no_false_alarm_vllm_bf16_vs_hf_llama(llama_engine):
    from extractors.vllm_modules import collect_vllm_modules

    path, llm = llama_engine
    prompts = _prompts()
    act, toks, names = collect_vllm_modules(llm, prompts, N_TOKENS)
    assert len(names) == 1 + 3 * 12 + 1 and all(len(t) == N_TOKENS for t in toks)
    a = act[0][("model.layers.1.self_attn.q_proj", "prefill")]
    assert a.shape == (len(prompts[0]), 128)
    assert act[0][("model.layers.1.self_attn.k_proj", "decode")].shape == (N_TOKENS - 1, 64)
    v = _judge(path, prompts, act, toks, names)
    assert v.passed, [m.summary() for m in v.modules if not m.passed]
    assert len(v.modules) == 2 * len(names)


def test_vllm_hook_fault_is_named_with_module_layer_and_phase(llama_engine):
    from extractors.faults import inject_output_scale, remove_faults
    from extractors.vllm_modules import collect_vllm_modules

    path, llm = llama_engine
    prompts = _prompts(1)
    fault = inject_output_scale(llm, "model.layers.1.mlp.down_proj", 1.05, prompts[0])
    try:
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread  # proven to take effect
        act, toks, names = collect_vllm_modules(llm, prompts, N_TOKENS)
    finally:
        remove_faults(llm)
    v = _judge(path, prompts, act, toks, names)
    assert v.localisation["module"] == "model.layers.1.mlp.down_proj", v.summary()
    assert v.localisation["layer"] == 1 and v.localisation["phase"] == "prefill"
    assert all(m.passed for m in v.modules if m.phase == "prefill" and
               names.index(m.module) < names.index("model.layers.1.mlp.down_proj"))


def test_unmappable_modules_are_refused_with_the_mappable_list(llama_engine):
    from extractors.vllm_modules import install_vllm_module_capture

    _, llm = llama_engine
    with pytest.raises(ValueError, match=r"'lm_head' matches no module.*can give under HF names: "
                                         r"\['model.embed_tokens', 'model.layers.\*'"):
        install_vllm_module_capture(llm, ["model.norm", "lm_head"])
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.act_fn' matches no module.*mlp.down_proj"):
        install_vllm_module_capture(llm, "model.layers.*.mlp.act_fn")


def test_vllm_module_run_in_a_store_compares_with_hf_runs(llama_engine, tmp_path):
    import json

    from capturestore import Store
    from capturestore.analysis import compare_runs
    from extractors.modules import capture_hf_module_run
    from extractors.vllm_modules import capture_vllm_module_run

    path, llm = llama_engine
    store = Store.open(tmp_path / "s")
    prompts = _prompts(3)[:4]
    act = capture_vllm_module_run(store, llm, path, prompts, 4, modules=["model.layers.*.mlp", "model.norm"])
    rows = store.sql(f"SELECT token_ids, n_prompt_tokens FROM prompts WHERE run_id = '{act}' ORDER BY prompt_idx"
                     ).to_pylist()
    teacher = [r["token_ids"][r["n_prompt_tokens"]:] for r in rows]
    assert [r["token_ids"][:r["n_prompt_tokens"]] for r in rows] == prompts and all(len(t) == 4 for t in teacher)
    order = json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{act}'").column(0)[0].as_py())["module_order"]
    assert order == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp", "model.norm"]
    base = capture_hf_module_run(store, path, prompts, teacher, order, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, teacher, order, dtype="bfloat16")
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    assert r.passed, r.verdicts["modules"].text
    n = store.sql(f"SELECT count(*) FROM module_verdicts WHERE comparison_id = '{r.comparison_id}'").column(0)[0]
    assert n.as_py() == 2 * len(order)


def test_teacher_forced_vllm_module_run_follows_the_given_tokens(llama_engine, tmp_path):
    """Teacher-forced on tokens the engine would not pick (random ids): the run stores those
    tokens, its decode steps ran on them (they pass against HF captured on the same tokens), and
    a teacher list of the wrong length for num_tokens is refused before a run exists."""
    from capturestore import Store
    from capturestore.analysis import compare_runs
    from extractors.modules import capture_hf_module_run
    from extractors.vllm_modules import capture_vllm_module_run, collect_vllm_modules

    path, llm = llama_engine
    prompts = _prompts(6)[:4]
    rng = np.random.default_rng(6)
    teacher = [rng.integers(4, 1000, size=n).tolist() for n in (4, 5, 4, 3)]
    _, greedy, _ = collect_vllm_modules(llm, prompts, 5, "model.norm")
    assert all(g[:len(t)] != t for g, t in zip(greedy, teacher))  # forcing has something to change
    store = Store.open(tmp_path / "s")
    mods = ["model.layers.1.self_attn.*", "model.layers.2", "model.norm"]
    act = capture_vllm_module_run(store, llm, path, prompts, None, modules=mods, teacher_tokens=teacher)
    rows = store.sql(f"SELECT token_ids, n_prompt_tokens FROM prompts WHERE run_id = '{act}' ORDER BY prompt_idx"
                     ).to_pylist()
    assert [r["token_ids"] for r in rows] == [p + t for p, t in zip(prompts, teacher)]
    base = capture_hf_module_run(store, path, prompts, teacher, mods, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, teacher, mods, dtype="bfloat16")
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    assert r.passed, r.verdicts["modules"].text
    n_runs = store.sql("SELECT count(*) FROM runs").column(0)[0].as_py()
    with pytest.raises(ValueError, match=r"capture_vllm_module_run, prompt 1: 5 teacher tokens but num_tokens=4"):
        capture_vllm_module_run(store, llm, path, prompts, 4, modules="model.norm", teacher_tokens=teacher)
    with pytest.raises(ValueError, match=r"prompt 0: teacher token 99999 at index 0 is outside the vocabulary"):
        capture_vllm_module_run(store, llm, path, prompts[:1], None, modules="model.norm", teacher_tokens=[[99999]])
    assert store.sql("SELECT count(*) FROM runs").column(0)[0].as_py() == n_runs


def _install_decode_only_scale(worker, name, factor):
    """On the worker: scale ``name``'s output in single-token (decode) forwards only."""
    mod = worker.model_runner.model.get_submodule(name)
    calls = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.shape[0] != 1:
            return None
        calls.append(1)
        return (output[0] * factor, *output[1:]) if isinstance(output, tuple) else output * factor

    worker._f2_decode_fault = (mod.register_forward_hook(hook), calls)
    return True


def _remove_decode_only_scale(worker):
    handle, calls = worker.__dict__.pop("_f2_decode_fault")
    handle.remove()
    return len(calls)


def test_vllm_decode_only_fault_is_named_in_decode(llama_engine):
    from extractors.vllm_modules import collect_vllm_modules

    path, llm = llama_engine
    prompts = _prompts(4)
    clean, toks, names = collect_vllm_modules(llm, prompts, N_TOKENS)
    llm.collective_rpc(_install_decode_only_scale, args=("model.layers.2.self_attn.o_proj", 1.05))
    try:
        act, toks2, _ = collect_vllm_modules(llm, prompts, N_TOKENS)
    finally:
        calls = llm.collective_rpc(_remove_decode_only_scale)[0]
    assert calls == N_PROMPTS * (N_TOKENS - 1)
    # proven to take effect: decode of the faulted module moved, prefill bit-identical
    key = ("model.layers.2.self_attn.o_proj", "decode")
    assert all(np.abs(c[key] - a[key]).max() > 0 for c, a in zip(clean, act))
    assert all(np.array_equal(c[k], a[k]) for c, a in zip(clean, act) for k in c if k[1] == "prefill")
    if toks2 != toks:  # the fault changed a greedy token: the references follow the faulty engine's tokens
        toks = toks2
    v = _judge(path, prompts, act, toks, names)
    assert v.localisation["module"] == "model.layers.2.self_attn.o_proj", v.summary()
    assert v.localisation["layer"] == 2 and v.localisation["phase"] == "decode"
    assert all(m.passed for m in v.modules if m.phase == "prefill")


# last: a second engine in this process; it must start after every test of the Llama engine ran
def test_no_false_alarm_vllm_bf16_vs_hf_gemma3():
    from extractors.models import tiny_model
    from extractors.vllm_modules import collect_vllm_modules
    from extractors.vllm_rpc import close_llm, make_llm

    path = tiny_model("gemma3-sliding")
    llm = make_llm(path, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)
    try:
        prompts = _prompts(2)
        act, toks, names = collect_vllm_modules(llm, prompts, N_TOKENS)
    finally:
        close_llm(llm)
    assert "model.layers.3.post_feedforward_layernorm" in names and "model.embed_tokens" not in names
    v = _judge(path, prompts, act, toks, names)
    assert v.passed, [m.summary() for m in v.modules if not m.passed]
