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
