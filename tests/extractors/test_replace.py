"""Tensor replacement on a real HF model: inputs and outputs replaced by another run's tensors of
the same positions, every replacement counted; oracles are the plain capture
(``collect_hf_modules``) and the clean model's logits."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from extractors.hf import load_hf_model
from extractors.hf_faults import install_hf_fault
from extractors.modules import collect_hf_modules
from extractors.replace import collect_hf_replaced

PROMPTS = [[5, 17, 99, 400, 3, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
CONTS = [[20, 21, 22, 23], [30, 31, 32, 33]]
TOP = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"]


@pytest.fixture(scope="module")
def llama():
    from extractors.models import tiny_model

    return tiny_model("llama-gqa")


def test_capture_matches_the_plain_capture_and_own_inputs_reproduce_it_bit_for_bit(llama):
    m = load_hf_model(llama, "bfloat16")
    want, _ = collect_hf_modules(m, PROMPTS, CONTS, TOP)
    got = collect_hf_replaced(m, PROMPTS, CONTS, TOP, inputs=True)
    for w, (g, _, replaced) in zip(want, got):
        assert not replaced
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])
        # a layer's input is the previous layer's output, the LM head's the final norm's
        np.testing.assert_array_equal(g[("model.layers.1:input", "decode")], w[("model.layers.0", "decode")])
        np.testing.assert_array_equal(g[("lm_head:input", "prefill")], w[("model.norm", "prefill")])
    again = collect_hf_replaced(m, PROMPTS, CONTS, TOP, replace_inputs=TOP, sources=[g for g, _, _ in got])
    for w, (g, _, replaced) in zip(want, again):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])
        # every module with a floating input, in each of the 4 forwards (prefill + 3 decode steps); not the embedding
        assert replaced == {(m, "input"): 4 for m in TOP[1:]}


def test_attention_input_given_as_a_keyword_is_captured_and_replaced(llama):
    m = load_hf_model(llama, "float32")
    mods = ["model.layers.1.input_layernorm", "model.layers.1.self_attn"]
    got = collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], mods, inputs=True)[0][0]
    np.testing.assert_array_equal(got[("model.layers.1.self_attn:input", "prefill")],
                                  got[("model.layers.1.input_layernorm", "prefill")])
    src = dict(got)
    src[("model.layers.1.self_attn:input", "prefill")] = src[("model.layers.1.self_attn:input", "prefill")] * 2.0
    moved = collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], mods, replace_inputs=["model.layers.1.self_attn"],
                                sources=[src])[0][0]
    assert not np.array_equal(moved[("model.layers.1.self_attn", "prefill")], got[("model.layers.1.self_attn", "prefill")])
    np.testing.assert_array_equal(moved[("model.layers.1.input_layernorm", "prefill")],
                                  got[("model.layers.1.input_layernorm", "prefill")])


def test_output_replacement_fences_a_fault_and_input_replacement_skips_it(llama):
    """A 5% MLP fault in layer 1 changes the logits (proof); with that MLP's output replaced by the
    clean model's, or the final norm's input replaced by the clean model's, the logits are the
    clean model's bit for bit."""
    clean = load_hf_model(llama, "bfloat16")
    ref = collect_hf_replaced(clean, PROMPTS, CONTS, ["model.layers.1.mlp", "model.norm"], inputs=True)
    faulty = load_hf_model(llama, "bfloat16")
    assert install_hf_fault(faulty, "mlp", 1, 0.05) == "model.layers.1.mlp"
    plain = collect_hf_replaced(faulty, PROMPTS, CONTS)
    for (_, lf, _), (_, lc, _) in zip(plain, ref):
        assert not torch.equal(lf, lc)  # the fault takes effect
    src = [c for c, _, _ in ref]
    fenced = collect_hf_replaced(faulty, PROMPTS, CONTS, ["model.layers.1.mlp"], replace_outputs=["model.layers.1.mlp"],
                                 sources=src)
    skipped = collect_hf_replaced(faulty, PROMPTS, CONTS, replace_inputs=["model.norm"], sources=src)
    for (caps, lf, rep), (_, ls, _), (c, lc, _) in zip(fenced, skipped, ref):
        torch.testing.assert_close(lf, lc, rtol=0, atol=0)
        torch.testing.assert_close(ls, lc, rtol=0, atol=0)
        assert rep == {("model.layers.1.mlp", "output"): 4}
        # what the faulty module computed is captured before its output is replaced: 1.05 x the clean output
        np.testing.assert_allclose(caps[("model.layers.1.mlp", "prefill")], c[("model.layers.1.mlp", "prefill")] * 1.05,
                                   rtol=1e-2, atol=1e-2)
        assert not np.array_equal(caps[("model.layers.1.mlp", "prefill")], c[("model.layers.1.mlp", "prefill")])


def test_a_source_of_the_wrong_shape_or_without_the_module_is_refused_by_name(llama):
    m = load_hf_model(llama, "float32")
    src = collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], ["model.norm"], inputs=True)[0][0]
    bad = {k: v[:, :64] for k, v in src.items()}
    with pytest.raises(ValueError, match=r"replacement of model.norm \(prefill step 0\).*\(1, 6, 64\).*\(1, 6, 128\)"):
        collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], replace_inputs=["model.norm"], sources=[bad])
    with pytest.raises(ValueError, match=r"holds no lm_head:input \(prefill\)"):
        collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], replace_inputs=["lm_head"], sources=[src])
    with pytest.raises(ValueError, match="has no module"):
        collect_hf_replaced(m, PROMPTS[:1], CONTS[:1], replace_inputs=["model.nrom"], sources=[src])


# ------------------------------------------------------------------------------ keyword inputs


class _Scale(torch.nn.Module):
    def forward(self, x, *, bias=None):
        return 3.0 * x


class _Outer(torch.nn.Module):
    """Calls its child with keyword arguments only (``inner(x=..., bias=None)``)."""

    def __init__(self):
        super().__init__()
        self.inner = _Scale()

    def forward(self, t):
        return self.inner(x=t + 1.0, bias=None)


def test_a_module_called_with_keywords_has_its_input_captured_and_replaced():
    from extractors.modules import ModuleHooks
    from extractors.replace import ReplaceHooks

    t = torch.arange(6, dtype=torch.float32).reshape(1, 3, 2)
    got = {}
    with ModuleHooks(_Outer(), ["inner"], lambda m, ph, st, x: got.__setitem__(m, x), inputs=True) as h:
        h.new_forward("prefill", 0)
        _Outer.forward(h.model, t)
    assert torch.equal(got["inner:input"], (t + 1.0)[0])  # the keyword input, by hand
    assert torch.equal(got["inner"], 3.0 * (t + 1.0)[0])
    model = _Outer()
    fed = torch.full((1, 3, 2), 7.0)
    hooks = ReplaceHooks(model, ["inner"], lambda m, ph, st, x: got.__setitem__(("r", m), x), inputs=True,
                         replace_inputs=["inner"], source=lambda name, ph, st, like, kind: fed)
    with hooks:
        hooks.new_forward("prefill", 0)
        out = model(t)
    assert hooks.replaced == {("inner", "input"): 1}
    assert torch.equal(out, 3.0 * fed) and torch.equal(got[("r", "inner:input")], fed[0])


def test_hf_attention_called_with_hidden_states_has_its_input_captured(llama):
    """HF calls self_attn(hidden_states=...): its captured input is its input norm's output (an
    independent capture of the same tensor), bit for bit."""
    m = load_hf_model(llama, "bfloat16")
    caps, _ = collect_hf_modules(m, PROMPTS[:1], CONTS[:1], ["model.layers.1.input_layernorm",
                                                             "model.layers.1.self_attn"], inputs=True)
    for phase in ("prefill", "decode"):
        got = caps[0][("model.layers.1.self_attn:input", phase)]
        assert np.array_equal(got, caps[0][("model.layers.1.input_layernorm", phase)])
