"""Module tensors from a vLLM engine, under the HF module names, per phase like ``extractors.modules``.

Hooks are installed on the worker's model by plain functions run through in-process
``collective_rpc`` (as ``extractors.faults`` does: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank,
``enforce_eager=True`` so modules run eagerly and call hooks). Each hook clones the rows it keeps
before the forward goes on (vLLM reuses buffers in place).

Layout: vLLM runs a flattened batch, ``[num_tokens, ...]``; a pre-hook on the model records the
forward's ``positions``. Prompts are generated one at a time (greedy, no prefix caching), so every
row of a forward belongs to the one request and row r sits at ``positions[r]`` (rows past
``len(positions)``, padding, are trimmed). A forward starting at position 0 is the prefill
(``[P, ...]``); one with a single token at position ``P + n`` is decode step n (``[1, ...]``): the
same layout as the HF capture, so HF references captured teacher-forced on the engine's own tokens
line up step for step (prefill + ``T - 1`` decode forwards for ``T`` generated tokens).

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
the list of those that can be captured. Tensor parallelism: one rank only here (TP shards of
``split`` outputs would concatenate per part along the last axis; not implemented).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from extractors.modules import resolve_modules

__all__ = ["VLLM_TO_HF", "mappable_hf_modules", "install_vllm_module_capture", "remove_vllm_module_capture",
           "collect_vllm_modules", "capture_vllm_module_run"]

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
VLLM_TO_HF = {"LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA, "Gemma3ForCausalLM": _GEMMA3}

_STATE = "_capturestore_module_capture"  # on the worker: {"records", "handles", "positions"}


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


# ---------------------------------------------------------------------------------- worker side


def _split_sizes(mod) -> list[int]:
    if hasattr(mod, "num_kv_heads") and hasattr(mod, "head_size"):  # QKVParallelLinear (this rank's heads)
        q = mod.num_heads * mod.head_size
        kv = mod.num_kv_heads * mod.head_size
        return [q, kv, kv]
    n = int(mod.output_size_per_partition)
    return [n // 2, n // 2]


def _worker_install(worker, plan: list[tuple[str, str, str]]) -> int:
    import torch

    model = worker.model_runner.model
    if hasattr(model, _STATE):
        raise ValueError("vLLM module capture: already installed on this engine; remove it first")
    state = {"records": [], "handles": [], "positions": None}
    mods = dict(model.named_modules())

    def pre(module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        state["positions"] = pos.detach().clone().cpu() if pos is not None else None

    state["handles"].append(model.register_forward_pre_hook(pre, with_kwargs=True))
    by_vllm: dict[str, list] = {}
    for hf, vl, how in plan:
        if vl not in mods:
            raise ValueError(f"vLLM module capture: the engine's model ({type(model).__name__}) has no module {vl!r} "
                             f"(for HF {hf})")
        by_vllm.setdefault(vl, []).append((hf, how))

    def hook_for(vl, targets):
        mod = mods[vl]
        sizes = _split_sizes(mod) if any(h.startswith("split") for _, h in targets) else None

        def hook(module, args, output):
            pos = state["positions"]
            if pos is None:
                return
            n = int(pos.numel())
            first = output[0] if isinstance(output, (tuple, list)) else output
            for hf, how in targets:
                if how == "first":
                    t = first[:n]
                elif how == "sum":
                    t = output[0][:n] + output[1][:n]
                else:
                    part = int(how.split(":")[1])
                    t = torch.split(first[:n], sizes, dim=-1)[part]
                state["records"].append((hf, pos, t.detach().to("cpu", copy=True)))
        return hook

    for vl, targets in by_vllm.items():
        state["handles"].append(mods[vl].register_forward_hook(hook_for(vl, targets)))
    setattr(model, _STATE, state)
    return len(plan)


def _worker_pop(worker) -> list:
    state = getattr(worker.model_runner.model, _STATE)
    out, state["records"] = state["records"], []
    return out


def _worker_remove(worker) -> int:
    model = worker.model_runner.model
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return 0
    for h in state["handles"]:
        h.remove()
    return 1


# ---------------------------------------------------------------------------------- caller side


def _rpc(llm, fn, *args):
    from extractors.faults import _rpc_in_process

    return _rpc_in_process(llm, fn, *args)


def _arch_and_layers(llm) -> tuple[str, int]:
    cfg = llm.llm_engine.model_config.hf_config
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return arch, int(text.num_hidden_layers)


def install_vllm_module_capture(llm, modules: Iterable[str] | str) -> list[str]:
    """Hook the HF-named ``modules`` (patterns as ``extractors.modules``) on the engine's worker;
    returns the HF names captured, in execution order. A pattern matching no mappable module is
    refused with the list of the mappable ones."""
    arch, n_layers = _arch_and_layers(llm)
    table = mappable_hf_modules(arch, n_layers)
    try:
        names = resolve_modules(list(table), modules, where=f"vLLM module capture ({arch})")
    except ValueError as e:
        raise ValueError(f"{e}. Modules vLLM's {arch} can give under HF names: "
                         f"{_compact(list(table))}") from None
    _rpc(llm, _worker_install, [(hf, *table[hf]) for hf in names])
    return names


def _compact(names: list[str]) -> list[str]:
    return sorted({re.sub(r"\.layers\.\d+", ".layers.*", n) for n in names})


def remove_vllm_module_capture(llm) -> int:
    return _rpc(llm, _worker_remove)


def _group(records, prompt_len: int, where: str) -> dict:
    """Records of one request -> ``{(hf, phase): [token, ...] tensors}`` (prefill, decode by step)."""
    import torch

    pre, dec = {}, {}
    for hf, pos, t in records:
        p = pos.tolist()
        if p and p[0] == 0:
            if len(p) != prompt_len:
                raise ValueError(f"{where}: {hf}: a prefill forward of {len(p)} tokens for a prompt of {prompt_len} "
                                 "(chunked prefill or prefix caching? build the engine with "
                                 "enable_prefix_caching=False)")
            pre[hf] = t
        elif len(p) == 1:
            dec.setdefault(hf, {})[p[0] - prompt_len] = t
        else:
            raise ValueError(f"{where}: {hf}: a forward over positions {p[:4]}... is neither prefill nor one "
                             "decode step")
    out = {(hf, "prefill"): t for hf, t in pre.items()}
    for hf, steps in dec.items():
        n = sorted(steps)
        if n != list(range(len(n))):
            raise ValueError(f"{where}: {hf}: decode steps {n} are not 0..{len(n) - 1}")
        out[(hf, "decode")] = torch.cat([steps[s] for s in n], dim=0)
    return out


def collect_vllm_modules(llm, prompts: Sequence[Sequence[int]], num_tokens: int,
                         modules: Iterable[str] | str = ("**",), sink=None):
    """Generate ``num_tokens`` greedy tokens per prompt (one prompt at a time) with module capture.

    Returns ``(captures, tokens, order)``: captures one dict per prompt ``{(hf_module, phase):
    float32 numpy [token, ...]}`` (None when ``sink`` is given: ``sink(i, module, phase, step,
    tensor)`` receives each step instead), the generated tokens per prompt, and the HF names in
    execution order."""
    from vllm import SamplingParams

    from metrics.errors import as_float

    names = install_vllm_module_capture(llm, modules)
    caps, toks = [], []
    try:
        for i, prompt in enumerate(prompts):
            _rpc(llm, _worker_pop)
            out = llm.generate([{"prompt_token_ids": list(map(int, prompt))}],
                               SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
            toks.append(list(out[0].outputs[0].token_ids))
            got = _group(_rpc(llm, _worker_pop), len(prompt), f"vLLM module capture, prompt {i}")
            missing = [n for n in names if (n, "prefill") not in got]
            if missing:
                raise ValueError(f"vLLM module capture, prompt {i}: no output captured for {missing[:4]} (hooks not "
                                 "called: build the engine with enforce_eager=True)")
            if sink is None:
                caps.append({k: as_float(t, np.float32) for k, t in got.items()})
            else:
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


def capture_vllm_module_run(store, llm, model_path, prompts, num_tokens: int,
                            modules: Iterable[str] | str = ("**",), release=None, config: dict | None = None) -> str:
    """Module tensors of a vLLM engine into ``store`` as a run (engine "vllm"), greedy ``num_tokens``
    per prompt; per prompt tokens = prompt + generated and ``tensors/<hf_module>/<phase>`` as the
    HF capture lays them out. Capture HF references with ``capture_hf_module_run`` on the generated
    tokens (``teacher_tokens``) to compare them."""
    import vllm

    from extractors.models import model_content_hash

    arch, n_layers = _arch_and_layers(llm)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    order = install_vllm_module_capture(llm, modules)
    remove_vllm_module_capture(llm)
    cfg = {"mode": "greedy", "num_tokens": num_tokens, "module_patterns": list([modules] if isinstance(modules, str)
                                                                               else modules),
           "modules": order, "module_order": order, "prompt_lens": [len(p) for p in prompts],
           "vllm_architecture": arch, "tensor_layout": "as extractors.modules (HF names via extractors.vllm_modules)",
           **(config or {})}
    pending: dict = {}

    def sink(i, hf, phase, step, t):
        pending.setdefault(i, []).append((hf, phase, step, t))

    run = store.begin_run(engine="vllm", model_path=str(Path(model_path)), model_hash=model_content_hash(model_path),
                          dtype=dtype, device="cpu", engine_version=vllm.__version__, release=release, config=cfg)
    with run:
        for i, prompt in enumerate(prompts):
            pending.clear()
            _, toks, _ = collect_vllm_modules(llm, [prompt], num_tokens, order, sink=lambda _i, *a: sink(i, *a))
            pid = run.add_prompt(list(prompt), continuation=toks[0])
            for hf, phase, step, t in pending.get(i, []):
                run.write_tensor(pid, hf, t, step=step, phase=phase,
                                 dims=["position", *(f"dim{d}" for d in range(1, t.ndim))])
    return run.run_id
