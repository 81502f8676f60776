"""MoE routing: which module of a model is its router, and how many experts it chooses (docs/moe.md).

Routing is captured as module tensors (``extractors.modules`` on HF, ``extractors.vllm_modules``
on vLLM): the router module's output, its logits ``[token, expert]`` under the HF name
(``model.layers.<i>.mlp.gate``), prefill ``[prompt_len, expert]`` and one ``[1, expert]`` per
decode step, in the run's ``tensors/<router>/<phase>``. The chosen experts of a token are the
``top_k`` largest logits: what transformers' ``*TopKRouter`` and vLLM's CPU router
(``fused_moe/router``) both choose, the softmax being monotone. vLLM's own record of the chosen
experts (``enable_return_routed_experts``) needs its V2 model runner, which needs Triton: not
available on CPU (docs/moe.md).

``ROUTERS``: HF ``model_type`` -> the router modules' pattern and the config keys of the number
of experts and of the experts per token. A MoE architecture plugs in by one entry here (and, for
vLLM, its names in ``extractors.vllm_modules.VLLM_TO_HF``).

Every module run of a MoE model records ``routing`` (``n_experts``, ``top_k``, ``router_pattern``)
in its run config (``routing_run_config``, called by the HF, vLLM and own-engine module captures),
so the routing comparator judges a store without the model folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROUTERS", "RouterSpec", "router_spec", "routing_patterns", "routing_run_config"]


@dataclass(frozen=True)
class RouterSpec:
    pattern: str  # the router modules, an ``extractors.modules`` pattern over HF names
    experts_key: str  # config key: number of experts
    top_k_key: str  # config key: experts chosen per token
    experts_alias: str | None = None  # the same count under the name transformers 5 writes (attribute_map)


ROUTERS = {
    "mixtral": RouterSpec("model.layers.*.mlp.gate", "num_local_experts", "num_experts_per_tok"),
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (Qwen3MoeConfig.attribute_map);
    # published checkpoints (and vLLM's reader, through that map) take either
    "qwen3_moe": RouterSpec("model.layers.*.mlp.gate", "num_experts", "num_experts_per_tok", "num_local_experts"),
    "qwen2_moe": RouterSpec("model.layers.*.mlp.gate", "num_experts", "num_experts_per_tok", "num_local_experts"),
    "olmoe": RouterSpec("model.layers.*.mlp.gate", "num_experts", "num_experts_per_tok", "num_local_experts"),
    "gpt_oss": RouterSpec("model.layers.*.mlp.router", "num_local_experts", "num_experts_per_tok"),
}


def router_spec(config: dict, where: str = "routing") -> tuple[RouterSpec, int, int]:
    """``(spec, n_experts, top_k)`` of a model's text config (a dict), or ValueError in one line
    naming the model type when it has no router (a dense model) or no usable counts."""
    mt = config.get("model_type")
    spec = ROUTERS.get(mt)
    if spec is None:
        raise ValueError(f"{where}: the model (model_type {mt!r}) is not a mixture of experts: it has no router "
                         f"to compare (routing is for {', '.join(sorted(ROUTERS))})")
    n, k = config.get(spec.experts_key), config.get(spec.top_k_key)
    if n is None and spec.experts_alias:
        n = config.get(spec.experts_alias)
    if not (isinstance(n, int) and isinstance(k, int) and 0 < k < n):
        raise ValueError(f"{where}: the model's config gives {spec.experts_key}={n!r}, {spec.top_k_key}={k!r}; "
                         f"routing needs 0 < top_k < experts")
    return spec, n, k


def routing_patterns(config: dict, patterns=()) -> tuple[str, ...]:
    """``patterns`` plus the model's router modules (ValueError for a model without a router)."""
    spec, _, _ = router_spec(config, "--plugins routing")
    return tuple(patterns) + ((spec.pattern,) if spec.pattern not in patterns else ())


def routing_run_config(model_path) -> dict:
    """``{"routing": {"n_experts", "top_k", "router_pattern", "model_type"}}`` for the run config of
    a module run of the model in ``model_path`` (its ``config.json``); ``{}`` for a dense model or
    a folder without a readable config (nothing to record: the routing comparator refuses those)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        cfg = cfg.get("text_config") or cfg
        spec, n, k = router_spec(cfg)
    except (OSError, ValueError, AttributeError):
        return {}
    return {"routing": {"n_experts": n, "top_k": k, "router_pattern": spec.pattern,
                        "model_type": cfg.get("model_type")}}
