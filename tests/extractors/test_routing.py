"""``extractors.routing``: router specs read from the configs the tiny MoE models write (no engine)."""
from __future__ import annotations

import json

import pytest

from extractors.models import MOE_ARCHS, tiny_model
from extractors.routing import router_spec, routing_run_config


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_tiny_moe_configs_give_their_expert_count_and_top_k(arch):
    """transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts`` (its
    ``attribute_map``): the count is read under either name (before, ``--plugins routing`` refused
    the tiny qwen3-moe: "num_experts=None")."""
    path = tiny_model(arch)
    cfg = json.loads((path / "config.json").read_text())
    spec, n, k = router_spec(cfg)
    assert (n, k) == (8, 2) and spec.pattern == "model.layers.*.mlp.gate"
    assert routing_run_config(path)["routing"] == {"n_experts": 8, "top_k": 2, "router_pattern": spec.pattern,
                                                   "model_type": cfg["model_type"]}


def test_a_published_style_qwen3_moe_config_and_a_dense_one():
    assert router_spec({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8})[1:] == (128, 8)
    with pytest.raises(ValueError, match="not a mixture of experts"):
        router_spec({"model_type": "llama"})
    with pytest.raises(ValueError, match="num_experts=None"):
        router_spec({"model_type": "qwen3_moe", "num_experts_per_tok": 2})
