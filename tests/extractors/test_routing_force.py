"""``extractors.routing_force`` on the three router families (Mixtral, Qwen3-MoE, GPT-OSS), tiny HF
models in BF16: forcing a model's own choices is bit-identical to not forcing; forcing other
experts takes effect, and the routing weights then applied are the architecture's rule computed
by hand (numpy, float64) from the model's own router logits over the forced experts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from extractors.models import tiny_model
from extractors.routing import ROUTERS
from extractors.routing_force import ForcedRouting, RoutingPlan, chosen_experts

torch = pytest.importorskip("torch")

TOKENS = list(range(5, 25))


def _weights_by_hand(model_type, logits, experts, norm_topk_prob):
    z = np.asarray(logits, np.float64)
    if model_type == "gpt_oss":  # softmax over the chosen experts' logits only
        w = np.exp(z[experts] - z[experts].max())
        return w / w.sum()
    p = np.exp(z - z.max())
    p /= p.sum()
    w = p[experts]
    return w / w.sum() if (model_type == "mixtral" or norm_topk_prob) else w


@pytest.mark.parametrize("arch", ["mixtral-moe", "qwen3-moe", "gpt-oss"])
def test_forcing_own_choices_is_identity_and_other_choices_get_the_architectures_weights(arch):
    from extractors.hf import load_hf_model
    from extractors.modules import modules_of

    torch.set_num_threads(1)
    path = tiny_model(arch)
    cfg = json.loads((path / "config.json").read_text())
    mt, k = cfg["model_type"], cfg["num_experts_per_tok"]
    m = load_hf_model(path, "bfloat16")
    routers = modules_of(m, [ROUTERS[mt].pattern])
    ids, pos = torch.tensor([TOKENS]), torch.arange(len(TOKENS))[None]
    seen: dict = {}

    def spy(name):
        return lambda _m, _a, out: seen.__setitem__(name, tuple(o.detach().clone() for o in out))

    hs = [dict(m.named_modules())[r].register_forward_hook(spy(r)) for r in routers]
    with torch.inference_mode():
        ref = m(input_ids=ids, position_ids=pos).logits
    own = {r: np.sort(seen[r][2].numpy(), -1) for r in routers}
    for r in routers:  # chosen_experts reproduces the router's choice from its logits alone
        assert np.array_equal(chosen_experts(seen[r][0].float().numpy(), k, mt, "bfloat16"), own[r])
    with ForcedRouting(m, RoutingPlan([TOKENS], [own]), routers, mt) as fr, torch.inference_mode():
        same = m(input_ids=ids, position_ids=pos).logits
    assert torch.equal(ref, same) and fr.stats == {"forced": len(TOKENS) * len(routers), "changed": 0, "own": 0,
                                                   "prompts": 1}
    # force layer 0, token 3 onto its k-th and (k+1)-th ranked experts' swap
    z0 = seen[routers[0]][0][3].float().numpy()
    order = np.argsort(-z0, kind="stable")
    want = np.sort(np.r_[order[:k - 1], order[k]])
    forced = {r: v.copy() for r, v in own.items()}
    forced[routers[0]][3] = want
    for h in hs:
        h.remove()
    seen.clear()
    with ForcedRouting(m, RoutingPlan([TOKENS], [forced]), routers, mt) as fr, torch.inference_mode():
        h = dict(m.named_modules())[routers[0]].register_forward_hook(spy(routers[0]))  # after the forcing hook
        moved = m(input_ids=ids, position_ids=pos).logits
        h.remove()
    diff = (moved - ref).abs().amax(-1)[0]
    assert (diff[:3] == 0).all() and diff[3] > 0.05  # took effect at token 3, causal
    logits, scores, idx = seen[routers[0]]  # the spy ran after the forcing hook: what the experts received
    assert np.array_equal(np.sort(idx[3].numpy()), want)
    got = dict(zip(idx[3].tolist(), scores[3].double().numpy()))
    hand = _weights_by_hand(mt, logits[3].float().numpy(), np.sort(want), cfg.get("norm_topk_prob", False))
    tol = 1e-6 if scores.dtype == torch.float32 else 2 ** -8
    assert np.allclose([got[e] for e in np.sort(want)], hand, rtol=tol, atol=tol), (got, hand)


def test_a_plan_whose_tokens_differ_from_what_is_fed_is_refused():
    from extractors.hf import load_hf_model

    path = tiny_model("mixtral-moe")
    m = load_hf_model(path, "float32")
    routers = ["model.layers.0.mlp.gate"]
    plan = RoutingPlan([[7] * len(TOKENS)], [{routers[0]: np.zeros((len(TOKENS), 2), np.int64) + [0, 1]}])
    with pytest.raises(ValueError, match="not the plan's"), ForcedRouting(m, plan, routers, "mixtral"):
        m(input_ids=torch.tensor([TOKENS]), position_ids=torch.arange(len(TOKENS))[None])
