"""Tensor replacement inside a vLLM engine: chosen modules' inputs (or outputs) replaced by another
run's tensors of the same positions, through the worker extension (``ReplaceMixin``, part of
``extractors.vllm_rpc.KVCaptureWorkerExtension``), while ``extractors.vllm_modules`` captures what
the modules then produce. The vLLM counterpart of ``extractors.replace`` (HF): the same source
layout and the same counting, so ``capturestore.isolate`` judges a vLLM target as it judges an HF one.

Names and fused modules: HF names are mapped to vLLM modules by ``extractors.vllm_modules.VLLM_TO_HF``.
A fused module's *input* is the input of each of its parts (HF's ``q_proj``, ``k_proj``, ``v_proj``
all take the normed hidden state that vLLM's ``qkv_proj`` takes; ``gate_proj`` / ``up_proj`` and
``gate_up_proj`` likewise), so replacing any part's input replaces the fused module's input, once,
from the first part asked for. A fused module's *output* part (``split:i``) is replaced in its
slice of the last axis only.

Positions: vLLM runs a flattened batch ``[num_tokens, ...]``; a pre-hook on the model records the
forward's ``positions`` and the rows of each request (``forward_segments``). A source is one array
per module indexed by position (prefill rows ``0 .. P-1`` then decode step n at ``P + n``, exactly
``extractors.replace``'s per-prompt dict concatenated), so row r of the forward takes the source's
row ``positions[r]``: prefill, chunked prefill and decode alike. One request at a time (a forward
holding rows of two requests is refused); prefix caching must be off (cached positions are never
computed, so never replaced).

vLLM's separate residual stream. HF's decoder layer ``i`` takes the residual stream ``h`` and
returns ``h + attn + mlp``; vLLM's takes ``(hidden, residual)`` with ``h = hidden + residual``
(``residual`` None for layer 0: ``hidden`` is then the embedding) and returns ``(mlp_out,
residual)``, the add being done by the next fused add + RMSNorm. So:

- the *input* of a vLLM decoder layer, of an RMSNorm called with a residual (``input_layernorm``
  of layers > 0, ``post_attention_layernorm``, ``model.norm``), is the sum ``hidden + residual``,
  which is HF's input of that module. It is replaced by ``(x, zeros)``: the module's own fused
  add + norm kernel still runs (``x + 0`` is exact in every dtype) and its residual output is
  ``x``. A layer or norm called without a residual (layer 0) gets ``x`` as its hidden state.
- the *output* of a vLLM decoder layer is ``mlp_out + residual`` (HF's output, ``"sum"`` in the
  capture map); replaced by ``(y, zeros)``, so the next layer sees ``y``.
- a norm's residual output follows the replaced input (``residual := x``) where HF's residual
  keeps the unreplaced stream. Isolation replaces one depth of the module tree at a time, so no
  judged module sees that difference (a level-2 pass replaces every norm, attention and MLP of a
  layer; the decoder layer that adds the residual is judged at level 1).

Capture order: a module's captured output is what it computed, before its own output replacement
(as ``extractors.replace``): the replacement's forward hook is moved behind every other hook of
its module at each forward. Faults installed as forward hooks before it (``extractors.faults``)
act first, as they do on the unreplaced engine.

Tensor parallelism: every rank gets the whole source and takes its own part, cut as the module
capture merges it (``extractors.vllm_modules.shard_kind``): a row-parallel layer's input
(``o_proj``, ``down_proj``) and a column-parallel output (``q_proj`` / ``k_proj`` / ``v_proj`` parts
of ``qkv_proj``, ``gate_up_proj``'s parts) are this rank's slice of the last axis (K/V heads
replicated over ``num_kv_head_replicas`` ranks); everything else is whole on every rank. Every
rank must replace in the same forwards (checked). RoPE q/k are not replaced under TP > 1 (each
rank rotates its own heads; refused in one line). The engine needs the worker in eager mode
(``make_llm``'s ``enforce_eager=True``).

Every replacement is counted per vLLM module and forward; ``collect_vllm_replaced`` refuses a
module asked for that was not replaced in every forward its request ran.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["ReplaceMixin", "collect_vllm_replaced", "position_sources", "replacement_plan"]

_RSTATE = "_capturestore_module_replace"


def position_sources(caps: Mapping, modules: Sequence[str], kind: str, where: str, n_positions: int) -> dict:
    """One prompt's ``{(module[:input], phase): [token, ...]}`` (``extractors.replace`` layout) ->
    ``{module: float32 [P + decode steps, ...]}`` indexed by position; ``n_positions`` (prompt +
    teacher tokens - 1: the last is sampled, never fed) rows are needed, checked here, before the
    engine runs (an error raised inside a forward would reach the engine's step loop)."""
    out = {}
    for m in modules:
        key = m + ":input" if kind == "input" else m
        pre = caps.get((key, "prefill"))
        if pre is None:
            raise ValueError(f"vLLM replacement: the {where} holds no {key} (prefill)")
        dec = caps.get((key, "decode"))
        parts = [np.asarray(pre, np.float32)] + ([] if dec is None else [np.asarray(dec, np.float32)])
        out[m] = np.ascontiguousarray(np.concatenate(parts, axis=0))
        if out[m].shape[0] != n_positions:
            raise ValueError(f"vLLM replacement: the {where} holds {out[m].shape[0]} positions of {key} "
                             f"(prefill + decode), the request runs {n_positions}")
    return out


def replacement_plan(llm, replace_inputs: Sequence[str], replace_outputs: Sequence[str]) -> list[list]:
    """``[[hf, vllm_module, how, kind]]`` for the HF names asked for (``kind`` "input"/"output");
    a name vLLM cannot give (``mappable_hf_modules``) is refused with the mappable list."""
    from extractors.vllm_modules import mappable_hf_modules, rope_hf_modules, vllm_architecture

    arch, n_layers = vllm_architecture(llm)
    table = {**mappable_hf_modules(arch, n_layers), **rope_hf_modules(arch, n_layers)}
    plan = []
    for kind, names in (("input", replace_inputs), ("output", replace_outputs)):
        for hf in names:
            if hf not in table:
                kinds = sorted({re.sub(r"\.layers\.\d+", ".layers.*", n) for n in table})
                raise ValueError(f"vLLM replacement: {hf} has no vLLM counterpart in {arch}; replaceable: {kinds}")
            plan.append([hf, *table[hf], kind])
    return plan


# ---------------------------------------------------------------------------------- worker side


def _split_offsets(mod, part: int) -> tuple[int, int]:
    from extractors.vllm_modules import split_sizes

    sizes = split_sizes(mod)
    lo = sum(sizes[:part])
    return lo, lo + sizes[part]


def _worker_install(worker, plan: list, sources: dict) -> dict:
    import torch

    from extractors.vllm_modules import (ROPE_HOW, forward_segments, rope_hooks, rope_layout, rope_split,
                                         vllm_module_input)
    from extractors.vllm_transport import decode_tensor

    model = worker.model_runner.model
    if hasattr(model, _RSTATE):
        raise ValueError("vLLM replacement: already installed on this engine; remove it first")
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from extractors.vllm_modules import shard_kind

    tp, rank = int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())
    if tp > 1 and any(how == ROPE_HOW for _, _, how, _ in plan):
        raise ValueError(f"vLLM replacement: RoPE q/k under tensor parallelism {tp} is not supported (each rank "
                         "rotates its own heads); replace the attention's input instead")
    mods = dict(model.named_modules())
    src = {(hf, kind): decode_tensor(t) for hf, kind, t in sources}
    state = {"handles": [], "positions": None, "rows": None, "forwards": 0, "counts": {}, "moves": [],
             "not_floating": set()}

    def pre_model(module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        state["forwards"] += 1
        state["positions"] = pos.detach().to("cpu").long()
        segs = forward_segments(worker.model_runner, int(pos.numel()))
        if len({r for r, _, _ in segs}) > 1:
            raise ValueError(f"vLLM replacement: a forward holds rows of {len(segs)} requests; replacement runs one "
                             "request at a time")
        state["rows"] = (segs[0][1], segs[0][2]) if segs else (0, 0)
        for mod, hid in state["moves"]:  # output replacement after every other hook (capture sees the computed)
            if hid in mod._forward_hooks:
                mod._forward_hooks.move_to_end(hid)

    def rank_cols(shard, width):
        """This rank's columns of a source ``width`` wide that the engine shards as ``shard``
        (``shard_kind``, as the module capture merges it); None: the whole width."""
        kind, replicas = shard
        if kind != "cat" or tp <= 1:
            return None
        n = tp // int(replicas)
        if width % n:
            raise ValueError(f"vLLM replacement: a source {width} wide cannot be cut into {n} rank slices")
        k, i = width // n, rank // int(replicas)
        return i * k, (i + 1) * k

    def rows_like(name, kind, like, lo_col=None, hi_col=None, shard=("same", 1)):
        t = src[(name, kind)]
        lo, hi = state["rows"]
        pos = state["positions"][lo:hi]
        if pos.numel() and int(pos.max()) >= t.shape[0]:
            raise ValueError(f"vLLM replacement of {name} ({kind}): position {int(pos.max())} but the source holds "
                             f"{t.shape[0]} positions")
        rows = t.index_select(0, pos)
        cols = rank_cols(shard, rows.shape[-1])
        if cols is not None:  # under tensor parallelism: this rank's slice of the whole source
            rows = rows[..., cols[0]:cols[1]]
        cols = like[lo:hi] if lo_col is None else like[lo:hi, ..., lo_col:hi_col]
        if tuple(rows.shape) != tuple(cols.shape):
            raise ValueError(f"vLLM replacement of {name} ({kind}): the source holds rows of shape "
                             f"{tuple(rows.shape[1:])}, the engine's tensor is {tuple(cols.shape[1:])}")
        new = like.clone()
        if lo_col is None:
            new[lo:hi] = rows.to(dtype=like.dtype, device=like.device)
        else:
            new[lo:hi, ..., lo_col:hi_col] = rows.to(dtype=like.dtype, device=like.device)
        return new

    def count(vl, kind):
        key = f"{vl}|{kind}"
        state["counts"][key] = state["counts"].get(key, 0) + 1

    def pre_for(vl, hf):
        def hook(module, args, kwargs):
            if state["positions"] is None:
                return None
            x, where, res, res_at = vllm_module_input(args, kwargs)
            if x is None:
                state["not_floating"].add(vl)
                return None  # token ids (the embedding): nothing to replace, as on HF
            new = rows_like(hf, "input", x, shard=shard_kind(module, "input"))
            args, kwargs = list(args), dict(kwargs)
            if where[0] == "kw":
                kwargs["hidden_states"] = new
            else:
                args[where[1]] = new
            if res is not None:  # vLLM's residual stream: the input is hidden + residual -> (x, 0)
                if res_at[0] == "arg":
                    args[res_at[1]] = torch.zeros_like(res)
                else:
                    kwargs["residual"] = torch.zeros_like(res)
            count(vl, "input")
            return tuple(args), kwargs
        return hook

    def post_for(vl, targets):
        def hook(module, args, output):
            if state["positions"] is None:
                return None
            for hf, how in targets:
                first = output[0] if isinstance(output, (tuple, list)) else output
                if how == "sum":  # decoder layer (mlp_out, residual): HF's output is their sum -> (y, 0)
                    output = (rows_like(hf, "output", output[0]), torch.zeros_like(output[1]))
                    continue
                if how.startswith("split:"):
                    lo, hi = _split_offsets(module, int(how.split(":")[1]))  # this rank's part
                    new = rows_like(hf, "output", first, lo, hi, shard=shard_kind(module, how))
                else:
                    new = rows_like(hf, "output", first, shard=shard_kind(module, how))
                output = (new, *output[1:]) if isinstance(output, (tuple, list)) else new
            count(vl, "output")
            return output
        return hook

    def rope_for(kind):  # RoPE q/k in HF's layout (``extractors.vllm_modules.rope_layout``), split back
        def act(a, rot, qk):
            if state["positions"] is None or (a, kind) not in ropes:
                return None
            q, k = qk
            new = rows_like(ropes[(a, kind)], kind, rope_layout(q, k, int(rot.head_size)))
            count(a + ".rotary_emb", kind)
            return rope_split(new, q.shape[-1] // int(rot.head_size))
        return act

    state["handles"].append(model.register_forward_pre_hook(pre_model, with_kwargs=True))
    ins, outs, ropes = {}, {}, {}
    for hf, vl, how, kind in plan:
        if vl not in mods:
            raise ValueError(f"vLLM replacement: the engine's model ({type(model).__name__}) has no module {vl!r} "
                             f"(for HF {hf})")
        if how == ROPE_HOW:
            ropes[(vl, kind)] = hf
        elif kind == "input":
            ins.setdefault(vl, hf)  # a fused module's input: the first of its parts asked for
        else:
            outs.setdefault(vl, []).append((hf, how))
    for vl, hf in ins.items():
        state["handles"].append(mods[vl].register_forward_pre_hook(pre_for(vl, hf), with_kwargs=True))
    for vl, targets in outs.items():
        h = mods[vl].register_forward_hook(post_for(vl, targets))
        state["handles"].append(h)
        state["moves"].append((mods[vl], h.id))
    if ropes:
        rin, rout = rope_for("input"), rope_for("output")

        def pre_rope(a, rot, args):
            pos, q, k = args[:3]
            got = rin(a, rot, (q, k))
            return None if got is None else (pos, *got, *args[3:])
        handles = rope_hooks(mods, sorted({a for a, _ in ropes}), pre=pre_rope,
                             post=lambda a, rot, out: rout(a, rot, out))
        state["handles"] += handles
        for a in {a for a, kind in ropes if kind == "output"}:
            rot = mods[a].rotary_emb
            state["moves"] += [(rot, h.id) for h in handles if h.id in rot._forward_hooks]
    hooked_ropes = {kind: [a + ".rotary_emb" for a, k in ropes if k == kind] for kind in ("input", "output")}
    setattr(model, _RSTATE, state)
    return {"input": sorted([*ins, *hooked_ropes["input"]]), "output": sorted([*outs, *hooked_ropes["output"]])}


def _worker_counts(worker) -> dict:
    state = getattr(worker.model_runner.model, _RSTATE, None)
    if state is None:
        return {"forwards": 0, "counts": {}, "not_floating": []}
    return {"forwards": state["forwards"], "counts": dict(state["counts"]), "not_floating": sorted(state["not_floating"])}


class ReplaceMixin:
    """Replacement methods of the worker extension (``self`` is the worker), through
    ``collective_rpc(name)``."""

    def install_module_replacement(self, plan: list, sources: list) -> dict:
        """Hooks replacing ``plan``'s (``[hf, vllm_module, how, kind]``) inputs / outputs from
        ``sources`` (``[hf, kind, tensor by position]``); returns the vLLM modules hooked."""
        return _worker_install(self, [tuple(p) for p in plan], sources)

    def module_replacement_counts(self) -> dict:
        """``{"forwards", "counts": {"vllm_module|kind": forwards replaced}}`` since the install."""
        return _worker_counts(self)

    def remove_module_replacement(self) -> int:
        from extractors.vllm_modules import remove_worker_hooks

        return remove_worker_hooks(self, _RSTATE)


# ---------------------------------------------------------------------------------- caller side


def _check_engine(llm) -> None:
    cfg = llm.llm_engine.vllm_config
    if bool(getattr(cfg.cache_config, "enable_prefix_caching", False)):
        raise ValueError("vLLM replacement: the engine serves prompts from the prefix cache (positions never computed "
                         "cannot be replaced); build it with enable_prefix_caching=False")


def collect_vllm_replaced(llm, prompts, continuations, capture: Sequence[str], replace_inputs: Sequence[str] = (),
                          replace_outputs: Sequence[str] = (), sources: Sequence[Mapping] | None = None,
                          what: str = "source"):
    """``extractors.replace.collect_hf_replaced`` on a vLLM engine: per prompt, the engine made to
    sample ``continuations[i]`` (teacher forcing: prefill, then decode step n on token n), the
    modules in ``replace_inputs`` / ``replace_outputs`` fed from ``sources[i]`` (one dict per
    prompt as ``collect_hf_modules`` returns it, inputs under ``module:input``), ``capture``'s
    outputs captured. Returns per prompt ``({(module, phase): float32 [token, ...]}, replaced)``
    (``replaced``: ``{(vllm_module, "input"/"output"): forwards}``). ``ValueError`` when a module
    asked for was not replaced in every forward of its request (on any TP rank), or on prefix caching."""
    from extractors.vllm_modules import collect_vllm_modules
    from extractors.vllm_transport import call_workers, encode_tensor, rpc_transport

    import torch

    _check_engine(llm)
    if not capture:
        raise ValueError("vLLM replacement: nothing to capture (capture=[])")
    if (replace_inputs or replace_outputs) and (sources is None or len(sources) != len(prompts)):
        raise ValueError(f"collect_vllm_replaced: need one source per prompt ({len(prompts)}), got "
                         f"{None if sources is None else len(sources)}")
    plan = replacement_plan(llm, replace_inputs, replace_outputs)
    transport = rpc_transport(llm)
    out = []
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        enc = []
        if plan:
            where = f"{what} of prompt {i}"
            for kind, names in (("input", replace_inputs), ("output", replace_outputs)):
                for m, a in position_sources(sources[i], names, kind, where,
                                                         len(prompt) + len(cont) - 1).items():
                    enc.append([m, kind, encode_tensor(torch.from_numpy(a), transport)])
        try:
            hooked = call_workers(llm, "install_module_replacement", plan=plan, sources=enc)[0]
            caps, _, _ = collect_vllm_modules(llm, [prompt], None, list(capture), teacher_tokens=[list(cont)],
                                              first_index=i)
            per_rank = call_workers(llm, "module_replacement_counts")
        finally:
            call_workers(llm, "remove_module_replacement")
        got = per_rank[0]
        for r, other in enumerate(per_rank[1:], start=1):  # every TP rank replaced in the same forwards
            if other != got:
                raise ValueError(f"vLLM replacement, prompt {i}: worker {r} (in answer order) replaced {other} where "
                                 f"worker 0 replaced {got}")
        fw = int(got["forwards"])
        if fw != len(cont):
            raise ValueError(f"vLLM replacement, prompt {i}: the engine ran {fw} forwards for {len(cont)} teacher "
                             "tokens (one request at a time, prefill + decode steps)")
        replaced = {}
        for kind in ("input", "output"):
            for vl in hooked[kind]:
                n = int(got["counts"].get(f"{vl}|{kind}", 0))
                replaced[(vl, kind)] = n
                if n != fw and not (kind == "input" and vl in got["not_floating"]):
                    raise ValueError(f"vLLM replacement: {vl}'s {kind} was replaced in {n} of {fw} forwards "
                                     f"(prompt {i})")
        out.append((caps[0], replaced))
    return out
