"""Module tensors from a vLLM engine, under the HF module names, per phase like ``extractors.modules``.

Hooks are installed on the worker's model by the worker extension's module-capture methods
(``ModuleCaptureMixin``, part of ``extractors.vllm_rpc.KVCaptureWorkerExtension``; build the engine
with ``extractors.vllm_rpc.make_llm``), called by name through ``collective_rpc``, so they run on
every rank, in this process or in worker processes (``enforce_eager=True`` so modules run eagerly
and call hooks). Each hook clones the rows it keeps before the forward goes on (vLLM reuses
buffers in place); the records cross back as tensors in-process, as bytes otherwise
(``extractors.vllm_transport``).

Layout: vLLM runs a flattened batch, ``[num_tokens, ...]``, request after request; a pre-hook on
the model records the forward's ``positions`` and which rows are whose (``forward_segments``: the
model runner's input-batch order and ``query_start_loc`` of the step), and each hook keeps every
request's rows apart, so requests batched into one forward are captured by request. A request's
forwards over prompt positions are its prefill (``[P, ...]``; chunks of a chunked prefill
stitched in position order; positions served from the prefix cache, below its first computed
position, are NaN rows listed as not computed, ``NOT_COMPUTED``); one with a single token at
position ``P + n`` is decode step n (``[1, ...]``): the same layout as the HF capture, so HF
references captured teacher-forced on the engine's own tokens line up step for step (prefill +
``T - 1`` decode forwards for ``T`` generated tokens).

Names: vLLM fuses and restructures modules. ``VLLM_TO_HF`` maps, per architecture, each HF module
name to the vLLM module whose output gives it and how:
- ``first``: the output, or the first element of a tuple (linear layers return ``(out, bias)``,
  fused add + RMSNorm returns ``(normed, residual)``);
- ``split:i``: part i of a fused projection's output along the last axis (``qkv_proj`` -> q, k,
  v sized by the module's heads x head size; ``gate_up_proj`` -> gate, up halves);
- ``sum``: ``out[0] + out[1]`` of a decoder layer (vLLM returns the last sublayer's output and
  the residual apart; HF's layer output is their sum, in the model's dtype as HF adds them).
HF modules without a vLLM counterpart (``lm_head``: vLLM never calls it, it computes logits from
its weight; ``mlp.act_fn``: vLLM's ``SiluAndMul`` also multiplies by up; Gemma3's scaled
embedding: vLLM scales after the module; ``q_norm``/``k_norm``: head-shaped) are refused with
the list of those that can be captured.

Tensor parallelism: every rank records its own output of each hooked module and the caller merges
them (``merge_tp_records``). Column-parallel outputs (``qkv_proj``, ``gate_up_proj``: each rank
holds its heads / features) are split per part on each rank and the parts concatenated along the
last axis in rank order, which is HF's head and feature order (K and V heads that vLLM replicates
over ranks when there are fewer KV heads than ranks are taken once per replica group). Everything
else (the embedding and the row-parallel ``o_proj`` / ``down_proj`` after their all-reduce, norms,
attention and MLP outputs, decoder layers) is the same on every rank, and must be: a rank whose
copy differs by one bit is refused, naming the module, phase and ranks, rather than one rank
picked.

Teacher forcing: with ``teacher_tokens`` the engine is made to sample the given tokens
(``extractors.vllm_teacher``), so its decode forwards run on, e.g., the FP32 baseline's tokens;
without, it generates greedily.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from extractors.modules import INPUT_SUFFIX, resolve_modules, write_module_groups

__all__ = ["NOT_COMPUTED", "RESIDUAL_SUM", "ROPE_HOW", "VLLM_TO_HF", "ModuleCaptureMixin", "capture_vllm_module_run",
           "collect_vllm_modules", "forward_segments", "group_request_records", "hf_kv_layer_name",
           "install_vllm_module_capture", "input_not_hf", "mappable_hf_modules", "merge_tp_records",
           "remove_vllm_module_capture", "residual_sum", "rope_hf_modules", "rope_hooks", "rope_layout", "rope_split",
           "row_parallel_modules", "shard_kind", "split_sizes", "vllm_architecture", "vllm_engine_options",
           "vllm_module_input", "vllm_rope_modules"]

_LLAMA = {
    "model.embed_tokens": ("model.embed_tokens", "first"),
    "model.layers.{i}.input_layernorm": ("model.layers.{i}.input_layernorm", "first"),
    "model.layers.{i}.self_attn.q_proj": ("model.layers.{i}.self_attn.qkv_proj", "split:0"),
    "model.layers.{i}.self_attn.k_proj": ("model.layers.{i}.self_attn.qkv_proj", "split:1"),
    "model.layers.{i}.self_attn.v_proj": ("model.layers.{i}.self_attn.qkv_proj", "split:2"),
    "model.layers.{i}.self_attn.o_proj": ("model.layers.{i}.self_attn.o_proj", "first"),
    "model.layers.{i}.self_attn": ("model.layers.{i}.self_attn", "first"),
    "model.layers.{i}.post_attention_layernorm": ("model.layers.{i}.post_attention_layernorm", "first"),
    "model.layers.{i}.mlp.gate_proj": ("model.layers.{i}.mlp.gate_up_proj", "split:0"),
    "model.layers.{i}.mlp.up_proj": ("model.layers.{i}.mlp.gate_up_proj", "split:1"),
    "model.layers.{i}.mlp.down_proj": ("model.layers.{i}.mlp.down_proj", "first"),
    "model.layers.{i}.mlp": ("model.layers.{i}.mlp", "first"),
    "model.layers.{i}": ("model.layers.{i}", "sum"),
    "model.norm": ("model.norm", "first"),
}
_GEMMA3 = {}  # Llama's, less the (scaled) embedding, with the two extra norms in execution order
for _k, _v in _LLAMA.items():
    if _k == "model.embed_tokens":
        continue
    if _k == "model.layers.{i}.mlp.gate_proj":
        _GEMMA3["model.layers.{i}.pre_feedforward_layernorm"] = ("model.layers.{i}.pre_feedforward_layernorm", "first")
    if _k == "model.layers.{i}":
        _GEMMA3["model.layers.{i}.post_feedforward_layernorm"] = ("model.layers.{i}.post_feedforward_layernorm",
                                                                 "first")
    _GEMMA3[_k] = _v
# GPT-OSS: vLLM names the embedding ``embedding`` and the attention ``attn`` (HF: ``self_attn``).
# ``mlp.router``: its logits [token, expert] (HF returns (logits, scores, indices), the batch
# flattened, which the module capture keeps whole; vLLM's ``GateLinear`` the logits), what the
# routing comparator reads (docs/moe.md). Not mapped: HF's ``mlp.experts`` takes the routing as
# inputs and has no vLLM module with the same output.
_GPT_OSS = {
    "model.embed_tokens": ("model.embedding", "first"),
    "model.layers.{i}.input_layernorm": ("model.layers.{i}.input_layernorm", "first"),
    "model.layers.{i}.self_attn.q_proj": ("model.layers.{i}.attn.qkv_proj", "split:0"),
    "model.layers.{i}.self_attn.k_proj": ("model.layers.{i}.attn.qkv_proj", "split:1"),
    "model.layers.{i}.self_attn.v_proj": ("model.layers.{i}.attn.qkv_proj", "split:2"),
    "model.layers.{i}.self_attn.o_proj": ("model.layers.{i}.attn.o_proj", "first"),
    "model.layers.{i}.self_attn": ("model.layers.{i}.attn", "first"),
    "model.layers.{i}.post_attention_layernorm": ("model.layers.{i}.post_attention_layernorm", "first"),
    "model.layers.{i}.mlp.router": ("model.layers.{i}.mlp.router", "first"),  # logits [token, expert]
    "model.layers.{i}.mlp": ("model.layers.{i}.mlp", "first"),
    "model.layers.{i}": ("model.layers.{i}", "sum"),
    "model.norm": ("model.norm", "first"),
}



_VLLM_ATTN_LAYER = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|attn)\.attn$")


def hf_kv_layer_name(vllm_name: str) -> str:
    """The KV layer name the HF references use (``extractors.hf.LAYER_NAME``) for a vLLM attention
    layer: ``model.layers.{i}.self_attn.attn``. Llama-style models already use it; GPT-OSS's
    attention module is ``attn`` in vLLM (``model.layers.{i}.attn.attn``), ``self_attn`` in HF.
    A name of another shape is returned unchanged (it then must match the references' as it is)."""
    m = _VLLM_ATTN_LAYER.match(vllm_name)
    return f"model.layers.{m.group(1)}.self_attn.attn" if m else vllm_name



def _moe_map(block: str, attention: dict) -> dict:
    """A MoE architecture's map: ``attention`` (Llama's attention and norms) less the dense
    MLP's projections, with the router (``mlp.gate``: its logits ``[token, expert]``), the experts
    (``mlp.experts``: the routing-weighted sum of the chosen experts' outputs) and the MoE block
    under vLLM's module ``block`` of each layer (docs/moe.md)."""
    out = {}
    for k, v in attention.items():
        if k.startswith("model.layers.{i}.mlp"):
            if k == "model.layers.{i}.mlp":
                out["model.layers.{i}.mlp.gate"] = (f"model.layers.{{i}}.{block}.gate", "first")
                out["model.layers.{i}.mlp.experts"] = (f"model.layers.{{i}}.{block}.experts", "first")
                out[k] = (f"model.layers.{{i}}.{block}", "first")
            continue
        out[k] = v
    return out


VLLM_TO_HF = {"LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA, "Gemma3ForCausalLM": _GEMMA3,
              "MixtralForCausalLM": _moe_map("block_sparse_moe", _LLAMA),
              "Qwen3MoeForCausalLM": _moe_map("mlp", _LLAMA), "GptOssForCausalLM": _GPT_OSS}

_STATE = "_capturestore_module_capture"  # on the worker: {"records", "handles", "positions"}


# RoPE on q/k (``extractors.replace``'s pseudo-module ``<attention>.rope``): vLLM's attention calls its
# ``rotary_emb`` module as ``(q, k) = rotary_emb(positions, q, k)`` on the flattened ``[token, heads *
# head_size]`` q and k (in place on the CPU backend); captured and replaced through that call, laid out as
# HF's ``[token, q_heads + kv_heads, head_dim]`` (q's heads, then k's). vLLM shares one rotary module
# between every attention with the same rope (``get_rope``'s cache), so a hook on it acts only while the
# attention it is mapped for runs and calls it as its own ``rotary_emb`` (``how`` "rope": the vLLM name is
# the attention). Asked for by exact name only: a pattern never matches it (the HF module capture has no
# such module), and TP = 1 only (each rank holds its own heads).
ROPE_HOW = "rope"
_ROPE_ATTENTION = {"GptOssForCausalLM": "attn"}  # vLLM's attention module name, else self_attn


def rope_hf_modules(arch: str, num_layers: int) -> dict[str, tuple[str, str]]:
    """``{"model.layers.{i}.self_attn.rope": (vllm attention, "rope")}`` of an architecture the name
    map knows (module comment above)."""
    if arch not in VLLM_TO_HF:
        return {}
    attn = _ROPE_ATTENTION.get(arch, "self_attn")
    return {f"model.layers.{i}.self_attn.rope": (f"model.layers.{i}.{attn}", ROPE_HOW) for i in range(num_layers)}


def vllm_rope_modules(llm, attentions) -> list[str]:
    """``<attention>.rope`` for each of ``attentions`` (HF names) whose RoPE the engine's name map
    gives (``rope_hf_modules``): ``extractors.replace.rope_modules`` for a vLLM engine."""
    table = rope_hf_modules(*vllm_architecture(llm))
    return [a + ".rope" for a in attentions if a + ".rope" in table]


def mappable_hf_modules(arch: str, num_layers: int) -> dict[str, tuple[str, str]]:
    """``{hf_name: (vllm_name, how)}`` for an architecture, in HF execution order."""
    if arch not in VLLM_TO_HF:
        raise ValueError(f"vLLM module capture: no HF name map for architecture {arch!r}; mapped: "
                         f"{sorted(VLLM_TO_HF)}")
    out = {}
    table = VLLM_TO_HF[arch]
    for hf, (vl, how) in table.items():
        if "{i}" not in hf and hf != "model.norm":
            out[hf] = (vl, how)
    for i in range(num_layers):
        for hf, (vl, how) in table.items():
            if "{i}" in hf:
                out[hf.format(i=i)] = (vl.format(i=i), how)
    if "model.norm" in table:
        out["model.norm"] = table["model.norm"]
    return out


# Captured inputs (``inputs=True``) are HF's inputs of the HF module: a fused projection's input is
# the input of each of its parts (``qkv_proj`` takes what HF's q/k/v_proj each take); a module
# called with vLLM's separate residual gets ``hidden + residual`` (``vllm_module_input``). Where
# vLLM's module takes something else than HF's, no input is recorded and the run says why:
_INPUT_NOT_HF = (
    (re.compile(r"\.mlp\.experts$"), "HF's experts take the routing (the chosen experts and their weights) beside "
     "the hidden state; vLLM's fused MoE takes the router logits and routes inside, so the captured hidden state "
     "alone is not the HF module's input"),
)


def input_not_hf(hf: str) -> str | None:
    """Why vLLM's captured input of HF module ``hf`` is not HF's input of it (None: it is)."""
    return next((why for pat, why in _INPUT_NOT_HF if pat.search(hf)), None)


# What a captured input holds where vLLM passes a residual beside the hidden state (the run config's
# ``module_input_residual_sum``): vLLM's fused add + RMSNorm adds the two in FP32 and normalises that
# sum unrounded (only the residual it passes on is rounded to the model's dtype; measured, docs/isolate.md),
# so the sum is kept in FP32 (exact for two BF16 / FP16 summands but where it loses low bits to FP32's
# own rounding) and an input snapshot replays the norm on the very input it saw. HF's BF16 module,
# fed it, rounds it as HF's own residual add does (``extractors.replace`` casts to the input's dtype).
RESIDUAL_SUM = "float32"


def residual_sum(x, res):
    """``x + res`` as vLLM's fused add + RMSNorm forms it: in FP32 (``RESIDUAL_SUM``); in the inputs'
    dtype where that is wider (an FP64 model)."""
    import torch

    if x.dtype in (torch.float32, torch.float64):
        return x + res
    return x.float() + res.float()


def vllm_module_input(args, kwargs):
    """``(x, where, residual, residual_at)`` of a vLLM module call: ``x`` its floating input (the
    ``hidden_states`` keyword, else the first floating positional argument: positions and token
    ids are not), ``where`` ``("kw", name)`` / ``("arg", j)``; ``residual`` the tensor vLLM passes
    beside it (a decoder layer's, a fused add + RMSNorm's: HF's input is ``x + residual``) or None,
    at ``residual_at``. ``(None, None, None, None)`` when no argument is floating (token ids)."""
    import torch

    kwargs = kwargs or {}
    if "hidden_states" in kwargs and torch.is_tensor(kwargs["hidden_states"]):
        x, where, res_at = kwargs["hidden_states"], ("kw", "hidden_states"), ("kw", "residual")
    else:
        j = next((k for k, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()), None)
        if j is None:
            return None, None, None, None
        x, where = args[j], ("arg", j)
        res_at = ("arg", j + 1) if len(args) > j + 1 else ("kw", "residual")
    res = args[res_at[1]] if res_at[0] == "arg" else kwargs.get("residual")
    return x, where, (res if torch.is_tensor(res) else None), res_at


# ---------------------------------------------------------------------------------- worker side
# Plain functions of the worker (``fn(worker, ...)``), reached through the worker extension's
# methods (``ModuleCaptureMixin``) by name, so that they run in every rank's process.


def split_sizes(mod) -> list[int]:
    if hasattr(mod, "num_kv_heads") and hasattr(mod, "head_size"):  # QKVParallelLinear (this rank's heads)
        q = mod.num_heads * mod.head_size
        kv = mod.num_kv_heads * mod.head_size
        return [q, kv, mod.num_kv_heads * getattr(mod, "v_head_size", mod.head_size)]
    n = int(mod.output_size_per_partition)
    return [n // 2, n // 2]


def shard_kind(mod, how: str) -> tuple[str, int]:
    """How this rank's output of ``mod`` relates to the whole: ``("cat", replicas)`` when it is a
    slice of the last axis (column-parallel without gather: ranks ``0, replicas, 2*replicas, ...``
    hold consecutive slices, the ranks in between copies), ``("same", 1)`` when every rank holds
    all of it (all-reduced row-parallel outputs, norms, the embedding, decoder layers). Of an
    input (``how`` "input"): a row-parallel layer's (``o_proj``, ``down_proj``: ``input_is_parallel``)
    is this rank's slice of the last axis, every other module's input is whole on every rank."""
    if how == "input":
        tp = int(getattr(mod, "tp_size", 1))
        return ("cat", 1) if tp > 1 and getattr(mod, "input_is_parallel", False) else ("same", 1)
    if int(getattr(mod, "tp_size", 1)) <= 1 or getattr(mod, "gather_output", True):
        return ("same", 1)
    if how.startswith("split:") and int(how.split(":")[1]) > 0 and hasattr(mod, "num_kv_head_replicas"):
        return ("cat", int(mod.num_kv_head_replicas))  # K, V: fewer KV heads than ranks are replicated
    return ("cat", 1)


def forward_segments(runner, n_tokens: int) -> list[tuple[str | None, int, int]]:
    """``[(request id, first row, end row)]`` of a forward's flattened batch, in row order.

    vLLM lays a step's tokens out request after request, in the input batch's order (decodes
    first on the CPU backend: the runner reorders before it prepares the inputs), request ``j``
    owning rows ``query_start_loc[j] .. query_start_loc[j + 1] - 1``; both are the model
    runner's, set for this step before the model runs. A runner without them (not a V1 GPU/CPU
    model runner) gives one unnamed segment of every row, as before batching was mapped."""
    batch = getattr(runner, "input_batch", None)
    qsl = getattr(getattr(runner, "query_start_loc", None), "cpu", None)
    if batch is None or qsl is None:
        return [(None, 0, n_tokens)]
    n_req = int(batch.num_reqs)
    starts = [int(x) for x in qsl[:n_req + 1].tolist()]
    ids = list(batch.req_ids[:n_req])
    if starts[-1] > n_tokens:
        raise ValueError(f"vLLM module capture: the step schedules {starts[-1]} tokens for {n_req} requests but the "
                         f"model ran {n_tokens}")
    return [(rid, starts[j], starts[j + 1]) for j, rid in enumerate(ids) if starts[j + 1] > starts[j]]


def rope_layout(q, k, head_size: int):
    """vLLM's rotary call's ``q [token, q_heads * head_size]``, ``k [token, kv_heads * head_size]`` as
    HF's rope tensor ``[token, q_heads + kv_heads, head_size]`` (a new tensor)."""
    import torch

    n = q.shape[0]
    return torch.cat([q.reshape(n, -1, head_size), k.reshape(n, -1, head_size)], dim=1)


def rope_split(x, q_heads: int):
    """``rope_layout``'s inverse: ``(q [token, q_heads * head_size], k [token, kv_heads * head_size])``, contiguous."""
    n = x.shape[0]
    return x[:, :q_heads].reshape(n, -1).contiguous(), x[:, q_heads:].reshape(n, -1).contiguous()


def rope_hooks(mods: dict, attentions, pre=None, post=None) -> list:
    """Hooks calling ``pre(attention, rotary, args)`` (its return: new args, or None) before and
    ``post(attention, rotary, output)`` (new output or None) after each of ``attentions``' (vLLM
    module names) own ``rotary_emb`` call (``rope_hf_modules``' comment: a rotary module shared by
    several attentions acts only for the one running, and only when it is that attention's own:
    a module wrapping it, e.g. a planted fault, is hooked instead). Returns the handles."""
    now = {"attn": None}
    handles, rotaries = [], {}
    for a in attentions:
        rot = getattr(mods[a], "rotary_emb", None)
        if rot is None:
            raise ValueError(f"vLLM RoPE: attention {a} ({type(mods[a]).__name__}) has no rotary_emb module")

        def enter(module, args, kwargs, a=a):
            now["attn"] = a

        def leave(module, args, output):
            now["attn"] = None
        handles.append(mods[a].register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(mods[a].register_forward_hook(leave))
        rotaries[id(rot)] = rot
    wanted = set(attentions)

    def own(module):
        a = now["attn"]
        return a if a in wanted and getattr(mods[a], "rotary_emb", None) is module else None

    def pre_hook(module, args):
        a = own(module)
        return None if a is None or pre is None else pre(a, module, args)

    def post_hook(module, args, output):
        a = own(module)
        return None if a is None or post is None else post(a, module, output)
    for rot in rotaries.values():
        handles.append(rot.register_forward_pre_hook(pre_hook))
        handles.append(rot.register_forward_hook(post_hook))
    return handles


def _rope_args(args):
    """``(positions, q, k)`` of a rotary call (all positional in vLLM's attentions)."""
    if len(args) < 3:
        raise ValueError(f"vLLM RoPE: the rotary call took {len(args)} positional arguments, not (positions, q, k)")
    return args[0], args[1], args[2]


def _worker_install(worker, plan: list[tuple[str, str, str]]) -> dict:
    import torch

    model = worker.model_runner.model
    if hasattr(model, _STATE):
        raise ValueError("vLLM module capture: already installed on this engine; remove it first")
    state = {"records": [], "handles": [], "positions": None, "segments": None}
    mods = dict(model.named_modules())

    def pre(module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        state["positions"] = pos.detach().clone().cpu() if pos is not None else None
        state["segments"] = None if pos is None else forward_segments(worker.model_runner, int(pos.numel()))

    by_vllm: dict[str, list] = {}
    ins: dict[str, list] = {}  # vLLM module -> the HF ``name:input`` records its input gives
    ropes: dict[str, dict] = {}  # vLLM attention -> {"rope_input": hf, "rope": hf}
    for hf, vl, how in plan:
        if vl not in mods:
            raise ValueError(f"vLLM module capture: the engine's model ({type(model).__name__}) has no module {vl!r} "
                             f"(for HF {hf})")
        if how in (ROPE_HOW, "rope_input"):
            ropes.setdefault(vl, {})[how] = hf
        else:
            (ins.setdefault(vl, []).append(hf) if how == "input" else by_vllm.setdefault(vl, []).append((hf, how)))
    if ropes:
        from vllm.distributed import get_tensor_model_parallel_world_size

        if int(get_tensor_model_parallel_world_size()) != 1:
            raise ValueError("vLLM module capture: RoPE q/k is captured at TP = 1 only (each rank holds its own heads)")

    def keep_rope(a, how, rot, q, k):
        pos, hf = state["positions"], ropes[a].get(how)
        if pos is None or hf is None:
            return
        t = rope_layout(q, k, int(rot.head_size)).detach().to("cpu", copy=True)  # before the in-place kernel
        for req, lo, hi in state["segments"]:
            state["records"].append((hf, pos[lo:hi], t[lo:hi], req))

    def in_hook_for(targets):
        def hook(module, args, kwargs):
            pos = state["positions"]
            if pos is None:
                return None
            x, _, res, _ = vllm_module_input(args, kwargs)
            if x is None:  # token ids (the embedding): its input is the run's tokens
                return None
            t = x if res is None else residual_sum(x, res)  # HF's input: the residual stream hidden + residual
            for req, lo, hi in state["segments"]:
                kept = t[lo:hi].detach().to("cpu", copy=True)
                for hf in targets:
                    state["records"].append((hf, pos[lo:hi], kept, req))
            return None
        return hook

    def hook_for(vl, targets):
        mod = mods[vl]
        sizes = split_sizes(mod) if any(h.startswith("split") for _, h in targets) else None

        def hook(module, args, output):
            pos = state["positions"]
            if pos is None:
                return
            first = output[0] if isinstance(output, (tuple, list)) else output
            for req, lo, hi in state["segments"]:  # each request's rows of the flattened batch
                for hf, how in targets:
                    if how == "first":
                        t = first[lo:hi]
                    elif how == "sum":
                        t = output[0][lo:hi] + output[1][lo:hi]
                    else:
                        part = int(how.split(":")[1])
                        t = torch.split(first[lo:hi], sizes, dim=-1)[part]
                    state["records"].append((hf, pos[lo:hi], t.detach().to("cpu", copy=True), req))
        return hook

    state["handles"].append(model.register_forward_pre_hook(pre, with_kwargs=True))
    for vl, targets in ins.items():
        state["handles"].append(mods[vl].register_forward_pre_hook(in_hook_for(targets), with_kwargs=True))
    for vl, targets in by_vllm.items():
        state["handles"].append(mods[vl].register_forward_hook(hook_for(vl, targets)))
    if ropes:
        state["handles"] += rope_hooks(
            mods, list(ropes), pre=lambda a, rot, args: keep_rope(a, "rope_input", rot, *_rope_args(args)[1:]),
            post=lambda a, rot, out: keep_rope(a, ROPE_HOW, rot, out[0], out[1]))
    setattr(model, _STATE, state)
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return {"tp_size": int(get_tensor_model_parallel_world_size()), "tp_rank": int(get_tensor_model_parallel_rank()),
            "shards": {hf: ("same", 1) if how in (ROPE_HOW, "rope_input") else shard_kind(mods[vl], how)
                       for hf, vl, how in plan}}


def _worker_pop(worker, transport: str = "tensor") -> list:
    from extractors.vllm_transport import encode_tensor

    state = getattr(worker.model_runner.model, _STATE, None)
    if state is None:
        raise ValueError("vLLM module capture: not installed on this worker (install_vllm_module_capture first)")
    out, state["records"] = state["records"], []
    return [(hf, pos.tolist(), encode_tensor(t, transport), req) for hf, pos, t, req in out]


def remove_worker_hooks(worker, key: str = _STATE) -> int:
    """Remove the hooks a worker-extension method installed on the worker's model under ``key``
    (module capture's, or replacement's: ``extractors.vllm_replace``); 1 when there were some, else 0."""
    state = worker.model_runner.model.__dict__.pop(key, None)
    if state is None:
        return 0
    for h in state["handles"]:
        h.remove()
    return 1


class ModuleCaptureMixin:
    """Module capture methods of the worker extension (``extractors.vllm_rpc.KVCaptureWorkerExtension``
    mixes them in; ``self`` is the worker), one answer per rank through ``collective_rpc(name)``."""

    def install_module_capture(self, plan: list) -> dict:
        """Hook ``plan`` (``[hf, vllm_module, how]`` rows); returns this rank's TP rank and size and
        per HF name how its output is sharded (``shard_kind``)."""
        return _worker_install(self, [tuple(p) for p in plan])

    def take_module_capture(self, transport: str = "bytes") -> list:
        """This rank's records since the last call, ``[(hf, positions, tensor)]``, removed here."""
        return _worker_pop(self, transport)

    def remove_module_capture(self) -> int:
        return remove_worker_hooks(self)


# ---------------------------------------------------------------------------------- caller side


def _rpc(llm, method: str, **kwargs) -> list:
    from extractors.vllm_transport import call_workers

    return call_workers(llm, method, **kwargs)


def merge_tp_records(per_rank: Sequence[Sequence], shards: dict, where: str = "vLLM module capture") -> list:
    """One record list ``[(hf, positions, tensor)]`` from each TP rank's, in the same order.

    Per record: a ``("cat", k)`` module's slices (ranks ``0, k, 2k, ...``) concatenated along the
    last axis, HF's head / feature order; every other rank of it, and every rank of a ``"same"``
    module, must equal the slice or tensor it copies, bit for bit (NaN equal to NaN), or the
    merge refuses naming the module, phase, positions and ranks: vLLM gives every rank the
    all-reduced or replicated value, so a difference means the ranks computed different things."""
    import torch

    n_ranks = len(per_rank)
    if n_ranks == 1:
        return list(per_rank[0])
    lens = [len(r) for r in per_rank]
    if len(set(lens)) != 1:
        raise ValueError(f"{where}: ranks captured different numbers of module outputs {lens}")
    out = []
    for j, recs in enumerate(zip(*per_rank)):
        hf, pos = recs[0][0], list(recs[0][1])
        for r, (h, p, _) in enumerate(recs[1:], start=1):
            if h != hf or list(p) != pos:
                raise ValueError(f"{where}: output {j} is {hf} at positions {pos[:4]} on rank 0 but {h} at "
                                 f"{list(p)[:4]} on rank {r}")
        kind, k = shards.get(hf, ("same", 1))
        ts = [t for _, _, t in recs]
        owner = [r - r % k if kind == "cat" else 0 for r in range(n_ranks)]
        for r in range(n_ranks):
            a, b = ts[owner[r]], ts[r]
            if r != owner[r] and not _same(a, b):
                phase = "prefill" if pos and pos[0] == 0 else f"decode at position {pos[0] if pos else '?'}"
                what = "replicated" if kind == "same" else "KV-head replica"
                diff = f"{(a.float() - b.float()).abs().nan_to_num(float('inf')).max().item():.3g}" \
                    if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
                raise ValueError(f"{where}: {hf} ({phase}) is {what} under tensor parallelism but rank {r} differs "
                                 f"from rank {owner[r]} (max |diff| {diff}); refusing to pick one")
        if kind == "cat":
            t = torch.cat([ts[r] for r in range(0, n_ranks, k)], dim=-1)
        else:
            t = ts[0]
        out.append((hf, pos, t))
    return out


def _same(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _take(llm, info: dict, where: str) -> list:
    """Every rank's records since the last take, in TP rank order, merged (``merge_tp_records``):
    ``[(hf, positions, tensor, engine request id)]``."""
    from extractors.vllm_transport import decode_tensor, rpc_transport

    answers = _rpc(llm, "take_module_capture", transport=rpc_transport(llm))
    per_rank = [[(hf, pos, decode_tensor(t), req) for hf, pos, t, req in answers[j]] for j in info["rank_order"]]
    merged = merge_tp_records([[r[:3] for r in recs] for recs in per_rank], info["shards"], where)
    reqs = [r[3] for r in per_rank[0]]
    for k, recs in enumerate(per_rank[1:], start=1):
        if [r[3] for r in recs] != reqs:
            raise ValueError(f"{where}: rank {k} laid the requests of a forward out differently from rank 0")
    return [(*m, req) for m, req in zip(merged, reqs)]


def vllm_engine_options(llm) -> dict:
    """The engine options that shape its numerics and layout, as ``vllm.LLM`` keywords (recorded in
    a module run's config, so ``capturestore isolate`` rebuilds the same engine): KV cache dtype,
    block size, the longest sequence, the scheduler's token budget and chunked prefill."""
    cfg = llm.llm_engine.vllm_config
    sched = cfg.scheduler_config
    out = {"kv_cache_dtype": str(cfg.cache_config.cache_dtype), "block_size": int(cfg.cache_config.block_size),
           "max_model_len": int(cfg.model_config.max_model_len),
           "max_num_batched_tokens": int(sched.max_num_batched_tokens)}
    if getattr(sched, "enable_chunked_prefill", None) is not None:
        out["enable_chunked_prefill"] = bool(sched.enable_chunked_prefill)
    return out


def vllm_architecture(llm) -> tuple[str, int]:
    """(HF architecture name, number of decoder layers) of the engine's model."""
    cfg = llm.llm_engine.model_config.hf_config
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return arch, int(text.num_hidden_layers)


def _resolve(llm, modules) -> tuple[list[str], dict]:
    arch, n_layers = vllm_architecture(llm)
    table = mappable_hf_modules(arch, n_layers)
    ropes = rope_hf_modules(arch, n_layers)
    modules = [modules] if isinstance(modules, str) else list(modules)
    asked = [m for m in modules if m in ropes]  # by exact name only (``rope_hf_modules``)
    rest = [m for m in modules if m not in ropes]
    try:
        names = resolve_modules(list(table), rest, where=f"vLLM module capture ({arch})") if rest or not asked else []
    except ValueError as e:
        raise ValueError(f"{e}. Modules vLLM's {arch} can give under HF names: "
                         f"{_compact(list(table))}") from None
    return [*names, *(r for r in ropes if r in asked)], {**table, **ropes}


def _install(llm, modules, inputs: bool = False) -> tuple[list[str], dict]:
    """Hooks on every rank; returns the HF names and ``{hf: (kind, replicas)}`` agreed by all ranks.
    ``inputs``: each module's input too, as ``hf:input`` (not where ``input_not_hf`` says why not)."""
    names, table = _resolve(llm, modules)
    plan = [[hf, *table[hf]] for hf in names]
    if inputs:
        plan += [[hf + INPUT_SUFFIX, table[hf][0], "rope_input" if table[hf][1] == ROPE_HOW else "input"]
                 for hf in names if input_not_hf(hf) is None]
    infos = _rpc(llm, "install_module_capture", plan=plan)
    tp = {int(i["tp_size"]) for i in infos}
    if tp != {len(infos)} or sorted(int(i["tp_rank"]) for i in infos) != list(range(len(infos))):
        remove_vllm_module_capture(llm)
        raise ValueError(f"vLLM module capture: {len(infos)} workers answered with TP sizes {sorted(tp)} and ranks "
                         f"{[i['tp_rank'] for i in infos]}; only tensor parallelism (no pipeline stages) is supported")
    rank_order = sorted(range(len(infos)), key=lambda j: int(infos[j]["tp_rank"]))  # answer index of rank r
    infos = [infos[j] for j in rank_order]
    shards = {hf: tuple(k) for hf, k in infos[0]["shards"].items()}
    for i in infos[1:]:
        if {hf: tuple(k) for hf, k in i["shards"].items()} != shards:
            remove_vllm_module_capture(llm)
            raise ValueError(f"vLLM module capture: rank {i['tp_rank']} shards the modules differently from rank 0")
    return names, {"tp_size": len(infos), "shards": shards, "rank_order": rank_order}


def row_parallel_modules(llm, modules: Iterable[str] | str = ("**",)) -> list[str]:
    """The HF names among ``modules`` (default: every module vLLM gives) whose vLLM module is
    row-parallel under the engine's tensor parallelism (its input is each rank's slice, its output
    all-reduced: ``RowParallelLinear``, ``input_is_parallel``), in execution order; [] at TP 1. Asked
    of the workers by installing the capture hooks and removing them again. A module run records
    them all, captured or not: a captured attention holds its ``o_proj`` whether or not ``o_proj``
    itself was captured, and its replay must compute it as the engine does. Dense linear layers
    only: a MoE block's experts (vLLM's ``FusedMoE``, its intermediate dimension split over ranks and
    the experts' output all-reduced) are not listed, and no replay emulates them (docs/isolate.md)."""
    names, info = _install(llm, modules, inputs=True)
    remove_vllm_module_capture(llm)
    if info["tp_size"] <= 1:
        return []
    return [hf for hf in names if info["shards"].get(hf + INPUT_SUFFIX) == ("cat", 1)]


def install_vllm_module_capture(llm, modules: Iterable[str] | str) -> list[str]:
    """Hook the HF-named ``modules`` (patterns as ``extractors.modules``) on every worker (TP rank) of
    the engine; returns the HF names captured, in execution order. A pattern matching no mappable
    module is refused with the list of the mappable ones. The engine needs the worker extension
    (``extractors.vllm_rpc.make_llm``)."""
    return _install(llm, modules)[0]


def _compact(names: list[str]) -> list[str]:
    return sorted({re.sub(r"\.layers\.\d+", ".layers.*", n) for n in names})


def remove_vllm_module_capture(llm) -> int:
    return sum(_rpc(llm, "remove_module_capture"))


def group_request_records(records, prompt_len: int, where: str) -> tuple[dict, list[int]]:
    """One request's records ``[(hf, positions, tensor)]`` -> ``({(hf, phase): [token, ...]},
    not_computed)``: the prefill ``[prompt_len, ...]`` and the decode steps ``[steps, ...]``.

    Forwards over positions below ``prompt_len`` are prefill chunks (chunked prefill: the scheduler
    split the prompt across forwards), stitched in position order. A prefill whose first forward
    starts at position ``s > 0`` had positions ``0 .. s-1`` served from the prefix cache: never
    computed in this request, they are NaN rows and listed in ``not_computed`` (the same for every
    module, or refused). A gap or overlap between chunks, a forward mixing prompt and generated
    positions, or decode steps out of order are refused."""
    import torch

    chunks, dec = {}, {}
    for hf, p, t in records:
        p = list(p)
        if p and p[0] < prompt_len:
            if p != list(range(p[0], p[0] + len(p))) or p[-1] >= prompt_len:
                raise ValueError(f"{where}: {hf}: a forward over positions {p[:4]}...{p[-1:]} mixes the prompt of "
                                 f"{prompt_len} tokens with other positions")
            chunks.setdefault(hf, []).append((p[0], len(p), t))
        elif len(p) == 1:
            dec.setdefault(hf, {})[p[0] - prompt_len] = t
        else:
            raise ValueError(f"{where}: {hf}: a forward over positions {p[:4]}... is neither prefill nor one "
                             "decode step")
    out, cached = {}, {}
    for hf, cs in chunks.items():
        cs.sort(key=lambda c: c[0])
        cached[hf] = at = cs[0][0]  # served from the prefix cache below the first computed position
        for start, n, _ in cs:
            if start != at:
                raise ValueError(f"{where}: {hf}: prefill chunks leave positions {at}..{start - 1} uncovered or "
                                 f"overlap there (chunks at {[c[0] for c in cs]})")
            at = start + n
        if at != prompt_len:
            raise ValueError(f"{where}: {hf}: the prefill chunks cover positions {cs[0][0]}..{at - 1} of a prompt of "
                             f"{prompt_len}")
        parts = [t for _, _, t in cs]
        if cached[hf]:
            t0 = parts[0]
            parts.insert(0, torch.full((cached[hf], *t0.shape[1:]), float("nan"), dtype=t0.dtype))
        out[(hf, "prefill")] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
    if len(set(cached.values())) > 1:
        raise ValueError(f"{where}: modules disagree on where the prefill starts: "
                         f"{dict(sorted(cached.items(), key=lambda kv: kv[1])[:4])}")
    for hf, steps in dec.items():
        n = sorted(steps)
        if n != list(range(len(n))):
            raise ValueError(f"{where}: {hf}: decode steps {n} are not 0..{len(n) - 1}")
        out[(hf, "decode")] = torch.cat([steps[s] for s in n], dim=0)
    return out, list(range(next(iter(cached.values()), 0)))


def _token_plan(llm, prompts, num_tokens, teacher_tokens, where: str) -> tuple[list, list | None]:
    """(prompts as int lists, teacher lists or None); checks that make a forced run meaningful."""
    if teacher_tokens is None:
        if num_tokens is None or int(num_tokens) < 1:
            raise ValueError(f"{where}: num_tokens must be >= 1 without teacher_tokens, got {num_tokens}")
        return [[int(x) for x in p] for p in prompts], None
    from extractors.vllm_logits import check_forcing_inputs

    mc = llm.llm_engine.model_config
    prompts, teacher = check_forcing_inputs(prompts, teacher_tokens, int(mc.get_vocab_size()), int(mc.max_model_len),
                                            where)
    if num_tokens is not None:
        bad = [i for i, t in enumerate(teacher) if len(t) != int(num_tokens)]
        if bad:
            raise ValueError(f"{where}, prompt {bad[0]}: {len(teacher[bad[0]])} teacher tokens but num_tokens="
                             f"{num_tokens} (pass num_tokens=None to take each prompt's teacher length)")
    return prompts, teacher


def _sampling(prompt_len: int, num_tokens: int, teacher):
    from vllm import SamplingParams

    from extractors.vllm_logits import CAPTURE_KEY

    if teacher is None:
        return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    # the teacher-forcing logits processor (extractors.vllm_teacher) makes the engine sample these;
    # an empty from/to range: the raw-logits recording of extractors.vllm_logits keeps no rows of it
    spec = {"teacher": list(teacher), "from": prompt_len, "to": prompt_len}
    return SamplingParams(max_tokens=len(teacher), temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={CAPTURE_KEY: spec})


def _request_index(req, batch: dict):
    """The batch index of engine request ``req`` (``batch``: the outputs' request ids -> index;
    the engine adds a ``-<8 chars>`` suffix to the id it was given), None if it is not one of them."""
    if req is None:  # a runner without the batch layout: every row is the one request's
        return next(iter(batch.values())) if len(batch) == 1 else None
    if req in batch:
        return batch[req]
    return batch.get(req.rsplit("-", 1)[0])


def _check_batch_size(batch_size, where: str, auto: bool = False) -> None:
    """``auto``: "auto" is a value too (``capture_vllm_module_run``)."""
    if auto and batch_size == "auto":
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        allowed = "an integer >= 1 or 'auto'" if auto else "an integer >= 1"
        raise ValueError(f"{where}: batch_size must be {allowed}, got {batch_size!r}")


def collect_vllm_modules(llm, prompts: Sequence[Sequence[int]], num_tokens: int | None,
                         modules: Iterable[str] | str = ("**",), sink=None, *,
                         teacher_tokens: Sequence[Sequence[int]] | None = None, first_index: int = 0,
                         batch_size: int = 1, not_computed: list | None = None, inputs: bool = False):
    """Run the prompts through the engine with module capture, ``batch_size`` requests at a time
    (one ``generate`` call: the scheduler batches them, chunks their prefills and serves prefix-
    cache hits as it is configured to): ``num_tokens`` greedy tokens, or, with ``teacher_tokens``
    (one list per prompt), the engine made to sample those (``extractors.vllm_teacher``; the
    engine needs ``make_llm``'s logits processor; ``num_tokens`` then None or each list's length),
    so its decode forwards run on the teacher's tokens. Each request's rows are taken out of every
    forward it was in by the step's batch layout (``forward_segments``).

    Returns ``(captures, tokens, order)``: captures one dict per prompt ``{(hf_module, phase):
    float32 numpy [token, ...]}`` (None when ``sink`` is given: ``sink(i, module, phase, step,
    tensor)`` receives each step instead), the tokens the engine sampled per prompt (the teacher
    tokens when forced), and the HF names in execution order. Prefill positions served from the
    prefix cache are NaN rows; ``not_computed`` (a list, if given) receives per prompt the list
    of those positions. Under tensor parallelism every rank's output is taken and merged
    (``merge_tp_records``). ``inputs``: each module's input too, under ``module:input``, HF's input
    of the HF module (``vllm_module_input``: ``hidden + residual`` where vLLM keeps the residual
    apart, summed in FP32 as vLLM's fused add + RMSNorm sums it: ``residual_sum``; a fused
    projection's input for each of its parts); none for the embedding (token ids)
    nor where ``input_not_hf`` says vLLM's module takes something else. ``first_index``: the index of ``prompts[0]`` in the caller's prompts,
    for the messages (a caller passing a slice of its prompts)."""
    from metrics.errors import as_float

    where = "vLLM module capture"
    _check_batch_size(batch_size, where)
    prompts, teacher = _token_plan(llm, prompts, num_tokens, teacher_tokens, where)
    names, info = _install(llm, modules, inputs)
    caps, toks = [], []
    try:
        for lo in range(0, len(prompts), batch_size):
            idx = list(range(lo, min(lo + batch_size, len(prompts))))
            _take(llm, info, where)  # drop anything recorded outside these requests
            params = [_sampling(len(prompts[j]), num_tokens, None if teacher is None else teacher[j]) for j in idx]
            outs = llm.generate([{"prompt_token_ids": prompts[j]} for j in idx], params, use_tqdm=False)
            span = f"prompt {idx[0] + first_index}" if len(idx) == 1 else \
                f"prompts {idx[0] + first_index}..{idx[-1] + first_index}"
            batch = {o.request_id: j for o, j in zip(outs, idx)}
            per: dict = {j: [] for j in idx}
            for hf, pos, t, req in _take(llm, info, f"{where}, {span}"):
                j = _request_index(req, batch)
                if j is None:
                    raise ValueError(f"{where}, {span}: rows of engine request {req!r}, not one of these requests "
                                     f"{sorted(batch)}, in their forwards")
                per[j].append((hf, pos, t))
            for j, o in zip(idx, outs):
                i = j + first_index
                toks.append(list(o.outputs[0].token_ids))
                forced = None if teacher is None else teacher[j]
                if forced is not None and toks[-1] != forced:
                    k = next((m for m, (a, b) in enumerate(zip(toks[-1], forced)) if a != b),
                             min(len(toks[-1]), len(forced)))
                    raise ValueError(f"{where}, prompt {i}: the engine sampled {toks[-1][k:k + 1]} at teacher index "
                                     f"{k}, not the teacher's {forced[k:k + 1]}: teacher forcing is not in effect "
                                     "(build the engine with extractors.vllm_rpc.make_llm, which adds its logits "
                                     "processor)")
                got, nc = group_request_records(per[j], len(prompts[j]), f"{where}, prompt {i}")
                missing = [n for n in names if (n, "prefill") not in got]
                if missing:
                    raise ValueError(f"{where}, prompt {i}: no output captured for {missing[:4]} (hooks not "
                                     "called: build the engine with enforce_eager=True)")
                if not_computed is not None:
                    not_computed.append(nc)
                if sink is None:
                    caps.append({k: as_float(t, np.float32) for k, t in got.items()})
                    continue
                for (hf, phase), t in got.items():
                    if phase == "prefill":
                        sink(i, hf, phase, 0, t)
                    else:
                        for s in range(t.shape[0]):
                            sink(i, hf, phase, s, t[s:s + 1])
                caps.append(None)
    finally:
        remove_vllm_module_capture(llm)
    return caps, toks, names


def _by_module(records) -> dict:
    """``{(module, phase): [(step, tensor)]}`` of a prompt's ``(module, phase, step, tensor)`` records,
    in the order they came."""
    out: dict = {}
    for hf, phase, step, t in records:
        out.setdefault((hf, phase), []).append((step, t))
    return out


def _stack(ts):
    """Steps ``[...]`` (torch or numpy) as one ``[step, ...]``."""
    import torch

    return torch.stack(ts) if torch.is_tensor(ts[0]) else np.stack(ts)


NOT_COMPUTED = "not_computed"  # tensors/not_computed/prefill: [n] int64, prompt positions served from the prefix cache


def capture_vllm_module_run(store, llm, model_path, prompts, num_tokens: int | None,
                            modules: Iterable[str] | str = ("**",), release=None, config: dict | None = None, *,
                            teacher_tokens: Sequence[Sequence[int]] | None = None, batch_size: int | str = 1,
                            inputs: bool = False) -> str:
    """Module tensors of a vLLM engine into ``store`` as a run (engine "vllm"): greedy ``num_tokens``
    per prompt, or teacher-forced on ``teacher_tokens`` (one list per prompt; ``num_tokens`` None
    or their length), e.g. the FP32 baseline's tokens, so every role's decode steps see the same
    tokens. Prompts go to the engine ``batch_size`` at a time (``collect_vllm_modules``);
    ``"auto"``: the first prompt alone, then as many together (up to ``AUTO_BATCH_PROMPTS``, as
    ``capture_vllm_run`` batches) as the engine's KV cache holds at once (no request preempted
    and recomputed, which the stitching refuses) and as fit ``AUTO_BATCH_BYTES`` at the first
    prompt's captured bytes a token, counted ``tp + 1`` times (the records and their stitched
    copies; every rank's copy of a replicated module reaches this process), so the captured data
    held at once stays near ``AUTO_BATCH_BYTES``; the run config records the prompts of each batch
    sent (``module_batches``, in order; the engine's batching can change its numbers, so a rerun
    must know it) and, for ``"auto"``, the limits they were formed within (``auto_batch_limits``);
    the engine's decode forwards then serve several
    requests, as it serves (one request at a time read every weight once a token for each
    prompt: 2.4x a plain ``generate`` of 4 prompts at a 1.5B shape). Per
    prompt tokens = prompt + sampled (teacher) tokens and ``tensors/<hf_module>/<phase>`` as the
    HF capture lays them out; prompt positions served from the prefix cache are NaN rows, listed
    in ``tensors/not_computed/prefill`` (``NOT_COMPUTED``; only where there are any), which the
    module comparator leaves out of every verdict and counts. ``inputs``: the modules' inputs too
    (``tensors/<hf_module>:input/<phase>``, ``collect_vllm_modules``), what an input snapshot
    replays (``capturestore isolate --snapshot``); the run config lists the modules whose input is
    withheld and why (``module_inputs_not_hf``). Greedy: capture HF references with
    ``capture_hf_module_run`` on the generated tokens (``teacher_tokens``) to compare them."""
    import vllm

    from capturestore.capture import begin_capture_run
    from extractors.models import model_content_hash
    from extractors.routing import routing_run_config

    where = "capture_vllm_module_run"
    _check_batch_size(batch_size, where, auto=True)
    if "module_batches" in (config or {}):  # recorded by the capture itself, at its end
        raise ValueError(f"{where}: config must not set 'module_batches' (the capture records the batches it sends)")
    prompts, teacher = _token_plan(llm, prompts, num_tokens, teacher_tokens, where)
    arch, _ = vllm_architecture(llm)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    order, _ = _resolve(llm, modules)  # a bad pattern is refused before a run exists
    tp = int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    limits = _auto_batch_limits(llm, tp)  # "auto" decides by these, and the run config records them
    cfg = {"mode": "greedy" if teacher is None else "teacher_forced_decode", "num_tokens": num_tokens,
           "module_patterns": list([modules] if isinstance(modules, str) else modules),
           "modules": order, "module_order": order, "batch_size": batch_size, "module_inputs": bool(inputs),
           "engine_options": vllm_engine_options(llm),
           **({"module_inputs_not_hf": {m: input_not_hf(m) for m in order if input_not_hf(m)},
               "module_input_residual_sum": RESIDUAL_SUM} if inputs else {}),
           **({"row_parallel_modules": row_parallel_modules(llm)} if tp > 1 else {}),
           "enable_prefix_caching": bool(getattr(llm.llm_engine.vllm_config.cache_config, "enable_prefix_caching",
                                                 False)),
           **({"auto_batch_limits": limits} if batch_size == "auto" else {}),
           "vllm_architecture": arch, "tensor_layout": "as extractors.modules (HF names via extractors.vllm_modules)",
           **routing_run_config(model_path), **(config or {})}
    run = begin_capture_run(store, engine="vllm", capture="greedy" if teacher is None else "teacher_forced_decode",
                            prompts=prompts, layer_names=None, logits_kind=None, config=cfg,
                            model_path=str(Path(model_path)), model_hash=model_content_hash(model_path), dtype=dtype,
                            device="cpu", engine_version=vllm.__version__, tp_degree=tp, release=release)
    lengths = [len(p) + (len(teacher[i]) if teacher is not None else num_tokens) for i, p in enumerate(prompts)]
    per_token = None  # "auto": the bytes a token of the first prompt captured
    budget = limits["bytes"] / limits["bytes_counted_times"]
    formed = []  # prompts per batch sent, recorded in the run config (batch_size "auto" decides them as it runs)
    with run:
        lo = 0
        while lo < len(prompts):
            n = batch_size if batch_size != "auto" else 1 if per_token is None else \
                _auto_batch(lengths[lo:], per_token, budget, limits["kv_block_size"], limits["kv_blocks"])
            part = prompts[lo:lo + n]
            formed.append(len(part))
            pending: dict = {i: [] for i in range(lo, lo + len(part))}
            skipped: list = []
            _, toks, _ = collect_vllm_modules(llm, part, num_tokens, order,
                                              sink=lambda i, *a, into=pending: into[i].append(a),
                                              teacher_tokens=None if teacher is None else teacher[lo:lo + len(part)],
                                              first_index=lo, batch_size=len(part), not_computed=skipped,
                                              inputs=inputs)
            for k, prompt in enumerate(part):
                pid = run.add_prompt(list(prompt), continuation=toks[k])
                by_phase: dict = {}  # phase: [(module, steps, [step, ...])], a module's steps in one write
                for (hf, phase), steps in _by_module(pending[lo + k]).items():
                    by_phase.setdefault(phase, []).append((hf, [s for s, _ in steps], _stack([x for _, x in steps])))
                for phase, tensors in by_phase.items():
                    if run.store.grouped_tensors:  # format 6: one array per steps, shape and dtype
                        write_module_groups(run, pid, phase, tensors)
                        continue
                    for hf, steps, t in tensors:
                        run.write_tensor_steps(pid, hf, t, steps, phase=phase,
                                               dims=["position", *(f"dim{d}" for d in range(1, t.ndim - 1))])
                if skipped[k]:
                    run.write_tensor(pid, NOT_COMPUTED, np.asarray(skipped[k], dtype=np.int64), phase="prefill",
                                     dims=["index"])
            if batch_size == "auto" and per_token is None:
                per_token = max(1.0, sum(int(rec[3].nbytes) for rec in pending[lo]) / lengths[lo])  # torch or numpy
            lo += len(part)
        run.record_config(module_batches=formed)
    return run.run_id


AUTO_BATCH_BYTES = 512 << 20  # batch_size="auto": the captured data of a batch held at once, about
AUTO_BATCH_PROMPTS = 16  # and at most this many prompts a batch (capture_vllm_run's batch)


def _auto_batch_limits(llm, tp: int) -> dict:
    """What ``batch_size="auto"`` forms its batches within, for the run config: the byte budget,
    how many times it is counted, the prompts a batch at most and the engine's KV cache (block
    size and blocks; None where the engine does not say)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return {"bytes": AUTO_BATCH_BYTES, "bytes_counted_times": tp + 1, "max_prompts": AUTO_BATCH_PROMPTS,
            "kv_block_size": cache.block_size, "kv_blocks": cache.num_gpu_blocks}


def _auto_batch(lengths: Sequence[int], per_token: float, budget: float, block_size: int | None,
                num_blocks: int | None) -> int:
    """How many of the next prompts (their token counts ``lengths``) go to the engine together:
    while their tensors at ``per_token`` bytes a token fit ``budget`` and their KV blocks
    (``ceil(tokens / block_size)`` each) fit the engine's ``num_blocks`` at once; one at least,
    and one alone where the cache's size is unknown."""
    if not block_size or not num_blocks:
        return 1
    n, held, blocks = 0, 0.0, 0
    for m in lengths[:AUTO_BATCH_PROMPTS]:
        held += m * per_token
        blocks += -(-m // block_size)
        if n and (held > budget or blocks > num_blocks):
            break
        n += 1
    return max(1, n)
