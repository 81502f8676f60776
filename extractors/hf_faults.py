"""Deliberate faults in an HF model (the engine under test of the isolation tests and benchmark).

Each is a kind of bug an engine ships with; installed on a loaded model (hooks or an attribute),
never on the checkpoint. Whoever judges a verdict on one first proves that it changes the
model's output (``tests/capturestore/test_isolate.py`` compares the faulty capture with the clean).

- ``mlp``: decoder layer ``layer``'s MLP output x ``1 + size`` (a wrong scale in a fused kernel).
- ``softmax``: layer ``layer``'s attention softmax scale x ``1 + size``.
- ``decode_pos``: positions ``+ size`` in decode forwards only (a RoPE position offset in decode).
- ``norm_eps``: the final norm's epsilon set to ``size``.
- ``kv_slot``: in layer ``layer``'s decode forwards the new token's K/V are also written into the
  previous position's slot (an off-by-one cache write: the previous token's K/V are lost).
- ``v_head``: layer ``layer``'s V of KV head ``head`` x ``1 + size`` (its v_proj output slice).
- ``rope_pos``: layer ``layer``'s RoPE positions ``+ size`` in every forward (its attention gets
  the rotary embedding of shifted positions: a per-layer RoPE position offset); sits in
  ``model.layers.<layer>.self_attn.rope`` (``extractors.replace``'s RoPE pseudo-module).
- ``layer_norm_eps``: layer ``layer``'s input RMSNorm epsilon set to ``size``.
- ``lm_head``: the LM head's output (the logits) x ``1 + size``.
"""
from __future__ import annotations

__all__ = ["FAULT_KINDS", "install_hf_fault"]

FAULT_KINDS = ("mlp", "softmax", "decode_pos", "norm_eps", "kv_slot", "v_head", "rope_pos", "layer_norm_eps", "lm_head")


class _WrongSlotCache:
    """A cache proxy whose ``update`` in a decode forward (one new token) also writes the new K/V
    over the previous position's slot; everything else goes to the real cache."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = self._cache.update(key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] == 1 and k.shape[-2] >= 2:
            k[..., -2, :] = k[..., -1, :]
            v[..., -2, :] = v[..., -1, :]
        return k, v


def install_hf_fault(model, kind: str, layer: int | None = None, size: float = 0.0, head: int = 0) -> str:
    """Install fault ``kind`` (module docstring) on ``model``; returns the name of the module it
    sits in (where isolation should find it)."""
    layers = model.model.layers
    per_layer = ("mlp", "softmax", "kv_slot", "v_head", "rope_pos", "layer_norm_eps")
    if kind in per_layer and not (layer is not None and 0 <= layer < len(layers)):
        raise ValueError(f"fault {kind}: layer {layer} outside the model's {len(layers)} decoder layers")
    if kind == "mlp":
        layers[layer].mlp.register_forward_hook(lambda mod, a, o: o * (1.0 + size))
        return f"model.layers.{layer}.mlp"
    if kind == "softmax":
        layers[layer].self_attn.scaling *= 1.0 + size
        return f"model.layers.{layer}.self_attn"
    if kind == "decode_pos":
        def shift(mod, args, kwargs):
            pos = kwargs.get("position_ids")
            if pos is not None and pos.shape[-1] == 1:  # one new token: a decode forward
                kwargs["position_ids"] = pos + int(size)
            return args, kwargs
        model.model.register_forward_pre_hook(shift, with_kwargs=True)
        return "model.layers.0.self_attn"
    if kind == "norm_eps":
        norm = model.model.norm
        setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", size)
        return "model.norm"
    if kind == "kv_slot":
        def wrap(mod, args, kwargs):
            cache = kwargs.get("past_key_values")
            if cache is not None and not isinstance(cache, _WrongSlotCache):
                kwargs["past_key_values"] = _WrongSlotCache(cache)
            return args, kwargs
        layers[layer].self_attn.register_forward_pre_hook(wrap, with_kwargs=True)
        return f"model.layers.{layer}.self_attn"
    if kind == "v_head":
        attn = layers[layer].self_attn
        hd = attn.head_dim

        def scale(mod, a, o):
            o = o.clone()
            o[..., head * hd:(head + 1) * hd] *= 1.0 + size
            return o
        attn.v_proj.register_forward_hook(scale)
        return f"model.layers.{layer}.self_attn.v_proj"
    if kind == "rope_pos":
        rotary = model.model.rotary_emb

        def shifted(mod, args, kwargs):
            pos, x = kwargs.get("position_ids"), kwargs.get("hidden_states")
            if pos is None or x is None:
                raise ValueError("fault rope_pos: the attention was called without position_ids/hidden_states")
            kwargs["position_embeddings"] = rotary(x, pos + int(size))
            return args, kwargs
        layers[layer].self_attn.register_forward_pre_hook(shifted, with_kwargs=True)
        return f"model.layers.{layer}.self_attn.rope"
    if kind == "layer_norm_eps":
        norm = layers[layer].input_layernorm
        setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", size)
        return f"model.layers.{layer}.input_layernorm"
    if kind == "lm_head":
        model.lm_head.register_forward_hook(lambda mod, a, o: o * (1.0 + size))
        return "lm_head"
    raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
