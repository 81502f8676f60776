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
  router untouched: every token is served by other experts than its router chose.

A caller proves the fault took effect (the logits or the chosen experts changed) before judging.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = ["MOE_FAULTS", "write_moe_fault"]

MOE_FAULTS = ("router_bias", "permute_experts")


def write_moe_fault(src, dst, fault: str, layer: int, expert: int = 0, factor: float = -4.0) -> Path:
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
        old = dict(tensors)
        for n, m in experts.items():
            tensors[n] = old[f"{m.group(1)}{(int(m.group(2)) + 1) % n_exp}{m.group(3)}"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst
