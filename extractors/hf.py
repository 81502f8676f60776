"""HuggingFace references: teacher-forced and greedy logits + KV caches from a transformers model.

Conventions shared by every function here (and by the vLLM extractors, so dicts compare directly):

- KV dicts are ``{layer_name: (k, v)}`` keyed by vLLM's attention layer names
  ``model.layers.{i}.self_attn.attn``; ``k, v: [batch, kv_head, seq, head_dim]`` in the model's
  dtype (bf16 stays bf16).
- **seq index == token position.** Row ``b`` holds its own tokens at indices ``0 .. len_b - 1``
  (``len_b`` = prompt + teacher/generated tokens of that row); indices ``>= len_b`` of shorter rows
  are padding and are NaN. ``seq`` = the longest row.
- Sliding-window layers: HF's cache keeps only the last ``window - 1`` positions. Positions it
  dropped come back as NaN (``[0, len_b - window + 1)``), the kept ones at their own positions.
- Logits: ``[gen_token, batch, vocab]``; ``logits[j, b]`` is the model's output at position
  ``prompt_len_b - 1 + j``, i.e. the distribution that predicts token ``j`` after the prompt
  (teacher token ``j``, or generated token ``j``). This is the layout ``metrics.logits`` takes as
  ``expected_logits``. Rows with fewer teacher tokens are NaN past their end.
- Batches of prompts of different lengths are run left-padded (so sliding-window caches of every
  row end at the same column) with an attention mask and explicit ``position_ids`` starting at 0
  per row; padding is masked out of attention and returned as NaN, never as a real token.

transformers and torch are imported lazily so the package imports without them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

LAYER_NAME = "model.layers.{i}.self_attn.attn"


def hf_layer_names(model) -> list[str]:
    """vLLM-style attention layer names for ``model``'s decoder layers, in order."""
    n = _text_config(model).num_hidden_layers
    return [LAYER_NAME.format(i=i) for i in range(n)]


def load_hf_model(path, dtype: str = "float32", device: str = "cpu"):
    """Load a causal LM from a local directory on ``device`` (``cpu`` or ``cuda[:N]``) in eval mode.

    ``dtype``: ``"float32"`` or ``"bfloat16"`` (also ``"float16"``). Attention is ``"eager"`` so
    sliding windows and masks are applied exactly as written (no fused-kernel shortcuts). On CUDA,
    FP32 means FP32: :func:`strict_fp32` turns TF32 off first.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"load_hf_model({path}): dtype {dtype!r} not one of {sorted(dtypes)}")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtypes[dtype], attn_implementation="eager", device_map=None
    )
    if str(device) != "cpu":
        strict_fp32()
    return model.to(device).eval()


def strict_fp32() -> dict:
    """Turn TF32 off for CUDA matmuls and cuDNN (an FP32 reference computes in FP32); returns the
    settings now in force, for the run config."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


def model_device(model):
    """The device a model computes on: a streamed skeleton's (its parameters live on meta) or its
    parameters'."""
    dev = getattr(model, "_capture_device", None)
    return dev if dev is not None else next(model.parameters()).device


def device_name(device: str) -> str:
    """What ``device`` is, for the run config: the CUDA device's name, or the CPU's model name."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------------------
# input normalisation


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _to_rows(x, what: str) -> list[list[int]]:
    """Token ids as a list of rows: accepts [seq] / [batch, seq] tensors, arrays or lists."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"{what}: expected token ids (list, tensor or array), got {type(x).__name__}")
    if len(x) == 0:
        return [[]]
    if all(isinstance(t, (list, tuple)) for t in x):
        rows = [list(r) for r in x]
    elif any(isinstance(t, (list, tuple)) for t in x):
        raise ValueError(f"{what}: mixes token ids and lists of token ids")
    else:
        rows = [list(x)]
    for b, row in enumerate(rows):
        for j, t in enumerate(row):
            if isinstance(t, bool) or not isinstance(t, int):
                if isinstance(t, float) and t.is_integer():
                    raise ValueError(f"{what}[{b}][{j}]: token id {t!r} is a float, not an int")
                raise ValueError(f"{what}[{b}][{j}]: token id {t!r} is not an int")
    return rows


def _check_rows(rows: list[list[int]], vocab: int, what: str, allow_empty: bool) -> None:
    for b, row in enumerate(rows):
        if not row and not allow_empty:
            raise ValueError(f"{what}[{b}]: empty; a prompt needs at least one token")
        for j, t in enumerate(row):
            if not 0 <= t < vocab:
                raise ValueError(f"{what}[{b}][{j}]: token id {t} outside the vocabulary [0, {vocab})")


def _left_pad(rows: list[list[int]], pad_id: int):
    """``ids, mask, pos: [batch, seq]`` left-padded; position ids count from 0 in each row."""
    import torch

    T = max(len(r) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r)
        ids[b, T - n:] = torch.tensor(r, dtype=torch.long)
        mask[b, T - n:] = 1
        pos[b, T - n:] = torch.arange(n)
    return ids, mask, pos


def _pad_id(model) -> int:
    cfg = _text_config(model)
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(cfg, attr, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


# ----------------------------------------------------------------------------------------------
# cache -> position-aligned KV


def _cache_layers(cache) -> list[tuple[Any, Any]]:
    """``[(keys, values)]`` per layer from a transformers 5.x Cache (``.layers[i].keys/.values``)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v, *_ in cache]  # legacy tuple-of-tuples


def _align_kv(cache, lengths: Sequence[int], names: list[str]) -> dict:
    """Cache of a left-padded batch -> ``{layer: (k, v)}``, ``[batch, kv_head, seq, head_dim]``.

    ``lengths[b]``: real tokens of row ``b``; the padded width is ``max(lengths)``. A layer whose
    cache holds ``S < width`` columns (sliding window) holds the last ``S`` columns.
    """
    import torch

    width = max(lengths)
    layers = _cache_layers(cache)
    if len(layers) != len(names):
        raise ValueError(f"HF cache has {len(layers)} layers, model has {len(names)} decoder layers")
    out = {}
    for name, (k, v) in zip(names, layers):
        k, v = k.cpu(), v.cpu()
        B, H, S, D = k.shape
        if S > width:
            raise ValueError(f"{name}: cache holds {S} positions, more than the {width} fed")
        ko = torch.full((B, H, width, D), float("nan"), dtype=k.dtype)
        vo = torch.full((B, H, width, v.shape[-1]), float("nan"), dtype=v.dtype)
        for b, n in enumerate(lengths):
            # column c of the padded batch is position c - (width - n) of row b; the cache
            # starts at column width - S.
            first = max(0, n - S)  # first position of row b still in the cache
            src0 = (width - n + first) - (width - S)
            ko[b, :, first:n] = k[b, :, src0:S]
            vo[b, :, first:n] = v[b, :, src0:S]
        out[name] = (ko, vo)
    return out


def _gather_logits(kept, teacher_lens):
    """Last-columns logits of a left-padded batch -> ``[gen_token, batch, vocab]``.

    kept: ``[batch, K, vocab]``, the last ``K = max(teacher_lens) + 1`` columns. Row ``b``'s gen
    token ``j`` comes from its position ``prompt_len_b - 1 + j``, which is kept column
    ``K - 1 - teacher_lens[b] + j`` (every row ends at the last column).
    """
    import torch

    kept = kept.cpu()
    B, K, V = kept.shape
    G = K - 1
    out = torch.full((G, B, V), float("nan"), dtype=kept.dtype)
    for b, n in enumerate(teacher_lens):
        out[:n, b] = kept[b, G - n : G]
    return out


# ----------------------------------------------------------------------------------------------
# public extractors


def extract_hf_kv_caches_teacher_forced(model, input_ids, teacher_tokens, return_logits: bool = False,
                                         cache_factory=None):
    """KV (and logits) of prompt + teacher tokens in ONE forward pass.

    input_ids: one prompt ``[seq]`` or several ``[batch][seq_b]`` (lists may differ in length;
        a 2-D tensor is read as rows of real tokens, so pass ragged prompts as lists, not padded).
    teacher_tokens: tokens to force after each prompt, same nesting as ``input_ids`` (a row may
        be empty: its KV is then the prompt's alone).
    Returns ``kv`` or, with ``return_logits``, ``(logits, kv)``:
      kv: ``{layer_name: (k, v)}``, k, v ``[batch, kv_head, seq, head_dim]``, seq index == position,
          ``seq = max(prompt_len_b + teacher_len_b)``; padding and dropped sliding positions NaN.
      logits: ``[gen_token, batch, vocab]``, ``logits[j, b]`` from position ``prompt_len_b - 1 + j``
          (the distribution that predicts teacher token ``j``); NaN past row ``b``'s teacher tokens.
    cache_factory: ``config -> Cache`` for the pass (default ``DynamicCache(config=config)``), e.g.
        an FP8 cache that quantizes on write (``nki_fp8.target``).
    See the module docstring for the full convention.
    """
    import torch

    prompts = _to_rows(input_ids, "input_ids")
    teachers = _to_rows(teacher_tokens, "teacher_tokens")
    if len(teachers) != len(prompts):
        raise ValueError(f"teacher_tokens has {len(teachers)} rows, input_ids has {len(prompts)}")
    vocab = _text_config(model).vocab_size
    _check_rows(prompts, vocab, "input_ids", allow_empty=False)
    _check_rows(teachers, vocab, "teacher_tokens", allow_empty=True)

    rows = [p + t for p, t in zip(prompts, teachers)]
    lengths = [len(r) for r in rows]
    dev = model_device(model)
    ids, mask, pos = (x.to(dev) for x in _left_pad(rows, _pad_id(model)))
    teacher_lens = [len(t) for t in teachers]
    # Only the last max(teacher_len) + 1 columns hold logits we return: skip the LM head elsewhere.
    keep = max(teacher_lens) + 1 if return_logits else 1
    cache = _new_cache(model, cache_factory)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=keep)
    kv = _align_kv(out.past_key_values, lengths, hf_layer_names(model))
    if not return_logits:
        return kv
    return _gather_logits(out.logits, teacher_lens), kv


def _new_cache(model, cache_factory):
    from transformers import DynamicCache

    return (cache_factory or (lambda config: DynamicCache(config=config)))(model.config)


def generate_hf_logits_and_kv(model, input_ids, num_tokens: int, cache_factory=None):
    """Greedy decoding of ``num_tokens`` tokens with the KV of every position.

    input_ids: one prompt ``[seq]`` or several ``[batch][seq_b]``. No early stop at EOS: every row
    gets exactly ``num_tokens`` tokens. Returns ``(logits, kv)``:
      logits: ``[gen_token, batch, vocab]``, step ``j``'s logits; the generated tokens are
          ``logits.argmax(-1)`` (first maximum, as used while decoding).
      kv: as in :func:`extract_hf_kv_caches_teacher_forced` with ``seq = max(prompt_len_b) + num_tokens``.
          After the last token an extra forward pass runs so the KV also covers it.
    cache_factory: as in :func:`extract_hf_kv_caches_teacher_forced`.
    """
    import torch

    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"generate_hf_logits_and_kv: num_tokens must be an int >= 1, got {num_tokens!r}")
    prompts = _to_rows(input_ids, "input_ids")
    _check_rows(prompts, _text_config(model).vocab_size, "input_ids", allow_empty=False)
    dev = model_device(model)
    ids, mask, pos = (x.to(dev) for x in _left_pad(prompts, _pad_id(model)))
    cache = _new_cache(model, cache_factory)
    steps = []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        next_pos = pos[:, -1:] + 1
        for step in range(num_tokens):
            last = out.logits[:, -1]  # [batch, vocab]
            steps.append(last)
            tok = last.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            # the last step's forward is the "extra" one: it only writes that token's KV
            out = model(input_ids=tok, attention_mask=mask, position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            next_pos = next_pos + 1
    lengths = [len(p) + num_tokens for p in prompts]
    kv = _align_kv(out.past_key_values, lengths, hf_layer_names(model))
    return torch.stack(steps).cpu(), kv


# ----------------------------------------------------------------------------------------------
# into the store


def capture_hf_run(store, model_path, prompts, teacher_tokens=None, num_tokens: int = 8,
                   dtype: str = "float32", release=None, model=None, config: dict | None = None,
                   device: str = "cpu", memory: int | None = None, stream: bool | None = None,
                   info: dict | None = None, model_hash: str | None = None,
                   kernel_rounding: str | None = None, prefetch: bool = True,
                   model_given: bool | None = None) -> str:
    """Capture HF logits + KV for ``prompts`` into ``store``; returns the run id.

    prompts: list of token-id lists. With ``teacher_tokens`` (one list per prompt) the run is
    teacher-forced in one forward pass per prompt; without, ``num_tokens`` greedy tokens are
    generated. Per prompt the store gets tokens = prompt + forced/generated tokens (the prompt
    id hashes the prompt alone; the forced/generated tokens are its ``continuation``), logits
    ``[gen_token, vocab]`` and KV ``[layer, kv_head, seq, head_dim]`` (sliding layers NaN outside
    HF's window). Every prompt runs alone (a batch of one), so what is stored does not depend on
    which prompts share a run.
    ``model``: an already loaded model of ``model_path`` in ``dtype`` (skips loading). ``config``:
    extra entries for the run config. model_given: recorded in the run config: the model captured
    may differ from what ``model_path`` loads (a patched fault), so the run is never a reference
    nor rebuilt from the checkpoint; None: whenever ``model`` is passed (False: the caller loaded
    ``model_path`` plainly, e.g. the pipeline's ``hf`` target).
    device: ``cpu`` or ``cuda[:N]`` (FP32 on CUDA without TF32). memory: the reference's memory
    budget in bytes (default: what the device has available); when the weights do not fit it, the
    reference is **streamed** layer by layer (``extractors.streamed``, bit-identical) in groups of
    prompts sized to it; prefetch False: a streamed reference loads every unit after the last is
    freed (no next unit read ahead; benchmarks). stream: True / False force the path. info: a dict that receives the
    plan (``path``, ``groups``, ``plan``) and the peak memory (``peak``). model_hash: the
    checkpoint's ``model_content_hash`` when the caller has it (it reads every weight).
    kernel_rounding: ``"toward_zero"`` rounds the (BF16) rotary embedding and attention outputs
    as vLLM-CPU's kernels do without AVX512-BF16 (``extractors.kernel_rounding``; recorded in the
    run config, a reuse key); None / ``"nearest"``: torch's own rounding.
    """
    import transformers

    from extractors.kernel_rounding import ROUNDINGS, check_kernel_rounding
    from extractors.kernel_rounding import kernel_rounding as rounding_as

    from capturestore.capture import begin_capture_run, write_prompt_capture
    from extractors.models import model_content_hash
    from extractors.streamed import PeakMemory, prepare_reference, run_streamed

    prompt_rows = [_to_rows(p, f"prompts[{i}]")[0] for i, p in enumerate(prompts)]
    teacher_rows = None
    if teacher_tokens is not None:
        teacher_rows = [_to_rows(t, f"teacher_tokens[{i}]")[0] for i, t in enumerate(teacher_tokens)]
        if len(teacher_rows) != len(prompt_rows):
            raise ValueError(f"capture_hf_run: {len(teacher_rows)} teacher rows for {len(prompt_rows)} prompts")
    if kernel_rounding is not None and kernel_rounding not in ROUNDINGS:
        raise ValueError(f"capture_hf_run: kernel_rounding must be one of {ROUNDINGS} or None, got {kernel_rounding!r}")
    kernel_rounding = None if kernel_rounding == "nearest" else kernel_rounding
    device = _device_str(device)
    info = info if info is not None else {}
    if model_given is None:  # a model passed in may differ from model_path's (a patched fault): never a reference
        model_given = model is not None
    sm = plan = None
    if model is None:
        seqs = [(len(p) + (len(teacher_rows[i]) if teacher_rows is not None else num_tokens),
                 (len(teacher_rows[i]) + 1) if teacher_rows is not None else num_tokens) for i, p in enumerate(prompt_rows)]
        plan, sm = prepare_reference(model_path, dtype, device, memory, stream, seqs,  # checks before any write
                                     prefetch=prefetch)
        if plan is None or plan.path == "whole":
            model, sm = load_hf_model(model_path, dtype, device), None
        else:
            model = sm.model
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if model_dtype != dtype:
        raise ValueError(f"capture_hf_run: the model passed is {model_dtype}, the run says dtype={dtype!r}")
    check_kernel_rounding(model, kernel_rounding)  # before the run exists
    names = hf_layer_names(model)
    cfg = _text_config(model)
    groups = plan.groups if sm is not None else [list(range(len(prompt_rows)))]
    info.update(path="streamed" if sm is not None else "whole", groups=[len(g) for g in groups],
                plan=plan.describe() if plan is not None else "whole (model given or no safetensors)")
    config = {
        "mode": "teacher_forced" if teacher_tokens is not None else "greedy",
        "num_tokens": None if teacher_tokens is not None else num_tokens,
        "attn_implementation": getattr(model.config, "_attn_implementation", None) or "eager",
        "layer_names": names,
        "prompt_lens": [len(p) for p in prompt_rows],
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": list(getattr(cfg, "layer_types", None) or []) or None,
        "kv_layout": "[layer, kv_head, seq, head_dim]; seq index == position; NaN where HF's "
                     "sliding-window cache dropped positions",
        "logits_layout": "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j",
        "model_given": model_given,
        **reference_config(device, info["path"], info["groups"], plan),
        **({"kernel_rounding": kernel_rounding} if kernel_rounding is not None else {}),
        **(config or {}),
    }

    def one(i):
        if teacher_rows is not None:
            logits, kv = extract_hf_kv_caches_teacher_forced(model, [prompt_rows[i]], [teacher_rows[i]],
                                                             return_logits=True)
            return teacher_rows[i], logits, kv
        logits, kv = generate_hf_logits_and_kv(model, [prompt_rows[i]], num_tokens)
        return logits[:, 0].argmax(-1).tolist(), logits, kv

    run = begin_capture_run(store, engine="hf", capture="teacher_forced_prefill" if teacher_tokens is not None else "greedy",
                            prompts=prompt_rows, layer_names=names, logits_kind="logits", config=config,
                            model_path=str(Path(model_path)), dtype=dtype,
                            model_hash=model_hash or model_content_hash(model_path),
                            device=device, engine_version=transformers.__version__, release=release)
    with run, PeakMemory(device) as peak, rounding_as(model, kernel_rounding):
        for group in groups:
            if sm is None:
                results = ((i, one(i)) for i in group)  # one prompt in memory at a time
            else:  # one pass over the weights for the whole group (per forward: greedy runs num_tokens + 1)
                results = zip(group, run_streamed(sm, [lambda i=i: one(i) for i in group]))
            for i, (gen, logits, kv) in results:
                write_prompt_capture(run, prompt_rows[i], gen, logits[:, 0],
                                     {n: (kv[n][0][0], kv[n][1][0]) for n in names}, names)
    info["peak"] = peak
    if sm is not None:
        info["weight_passes"] = sm.loads / len(sm.units)
        info["prefetched_units"] = sm.prefetched
    return run.run_id


def _device_str(device) -> str:
    """``cpu``, or ``cuda:N`` (an index always: it is what the run records)."""
    d = str(device)
    if d == "cpu":
        return d
    if d.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"reference device {d}: torch sees no CUDA device here")
        dev = torch.device(d)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"reference device {d}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    raise ValueError(f"reference device {d!r}: give cpu or cuda[:N]")


def reference_config(device: str, path: str, groups, plan=None) -> dict:
    """Run-config entries saying where and how a reference was computed (none is a reuse key:
    a streamed reference is the same reference as a whole-model one)."""
    out = {"reference_device": device, "device_name": device_name(device), "reference_path": path,
           "reference_groups": list(groups)}
    if device.startswith("cuda"):
        out.update(strict_fp32())
    if plan is not None:
        out["reference_memory_budget"] = plan.budget
    return out
