"""Cache adapters: how ``capturestore.cachecheck`` drives an engine's KV cache.

An adapter is a small class with one required method and a cached session whose operations are
each optional (``docs/cachecheck.md`` shows how to write one for your own engine):

required
    ``full_logits(seqs) -> list of float32 [len_i, vocab]``: the full-prefix reference of the
    same engine: every position recomputed from its whole prefix, no cache. ``seqs`` may hold
    several sequences (a batch); an engine that cannot batch loops.
optional (a scenario needing a missing one is reported "not run" with the reason, never passed)
    ``reset()``                          a fresh engine: no sequences, every slot/block free
    ``prefill(prompts, chunk_size=None)`` new sequences, prefilled together as one ragged batch,
                                         ``chunk_size`` tokens per forward -> (handles, logits of
                                         every prompt position [len_i, vocab], or its last rows)
    ``step(handles, tokens)``            one decode step of those sequences (the batch is exactly
                                         ``handles``) -> float32 [len(handles), vocab]
    ``free(handles)``                    finish or cancel sequences (their slots/blocks freed,
                                         the batch compacted)
    ``truncate(handle, length)``         cut a sequence back to its first ``length`` tokens
    ``fork(handle, n)``                  ``n`` new sequences sharing ``handle``'s cache -> handles
    ``kv(handle)``, ``full_kv(tokens)``  (k, v) float32 [layer, kv_head, seq, head_dim], cached and
                                         full-prefix, NaN where the engine holds nothing (a
                                         sliding window): lets a failure name its first KV layer
Attributes: ``name``, ``vocab_size``, ``dtype`` ("float32" | "bfloat16"), ``max_context`` (positions a sequence
may hold; a step past it must raise), ``max_batch``, ``block_size`` (None if not paged),
``window`` (sliding window, None if none), ``padding_side`` ("left" | "right" | None: how a
ragged prefill batch is padded).

An operation the adapter has but cannot do for one call (a chunk size, say) raises
``NotSupported``: that scenario is not run. Handles are any hashable values.

Adapters here: ``PagedEngineAdapter`` (``extractors.cache_engine``, with planted bugs) and
``HFCacheAdapter`` (transformers' ``DynamicCache``: ``batch_select_indices`` to compact,
``crop`` to truncate, ``batch_repeat_interleave`` to fork).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OPERATIONS = ("reset", "prefill", "step", "free", "truncate", "fork", "kv")


class NotSupported(Exception):
    """The adapter cannot do what a scenario asks: the scenario is reported not run, with this reason."""


class CacheAdapter:
    """Base class of adapters (module docstring): subclasses override ``full_logits`` and the
    operations they have; ``supports(op)`` says which."""

    name: str = "engine"
    dtype: str = "float32"
    max_context: int = 0
    max_batch: int = 8
    block_size: int | None = None
    window: int | None = None
    padding_side: str | None = None
    vocab_size: int = 0

    def full_logits(self, seqs):
        raise NotImplementedError

    def full_kv(self, tokens):
        raise NotImplementedError

    def reset(self):
        raise NotImplementedError

    def prefill(self, prompts, chunk_size=None):
        raise NotImplementedError

    def step(self, handles, tokens):
        raise NotImplementedError

    def free(self, handles):
        raise NotImplementedError

    def truncate(self, handle, length):
        raise NotImplementedError

    def fork(self, handle, n):
        raise NotImplementedError

    def kv(self, handle):
        raise NotImplementedError

    def close(self):
        """Release the engine (optional)."""

    def supports(self, op: str) -> bool:
        """Whether this adapter implements operation ``op`` (overridden, not None)."""
        mine = getattr(type(self), op, None)
        return mine is not None and mine is not getattr(CacheAdapter, op, None) and getattr(self, op, None) is not None


# ------------------------------------------------------------------------ the paged test engine


class PagedEngineAdapter(CacheAdapter):
    """``extractors.cache_engine.PagedEngine`` over a Llama checkpoint; ``bugs`` plants cache bugs."""

    padding_side = "right"

    def __init__(self, model_dir, dtype: str = "float32", *, block_size: int = 16, max_context: int = 128,
                 max_batch: int = 8, bugs=(), num_blocks: int | None = None):
        from extractors.cache_engine import LlamaWeights, PagedEngine

        self.weights = LlamaWeights(model_dir, dtype)
        if max_context > self.weights.max_position:
            raise ValueError(f"PagedEngineAdapter: max_context {max_context} exceeds the model's "
                             f"max_position_embeddings {self.weights.max_position}")
        blocks = num_blocks or 2 * max_batch * (max_context // block_size)
        self.engine = PagedEngine(self.weights, block_size=block_size, num_blocks=blocks, max_context=max_context,
                                  max_batch=max_batch, bugs=bugs)
        self.name = "paged" + (f"[{','.join(sorted(bugs))}]" if bugs else "")
        self.dtype, self.block_size, self.max_context, self.max_batch = dtype, block_size, max_context, max_batch
        self.vocab_size = self.weights.vocab

    def full_logits(self, seqs):
        return self.weights.forward_full([list(s) for s in seqs])[0]

    def full_kv(self, tokens):
        _, k, v = self.weights.forward_full([list(tokens)])
        return k[0], v[0]

    def reset(self):
        self.engine.reset()

    def prefill(self, prompts, chunk_size=None):
        return self.engine.prefill(prompts, chunk_size)

    def step(self, handles, tokens):
        return self.engine.step(handles, tokens)

    def free(self, handles):
        self.engine.free(handles)

    def truncate(self, handle, length):
        self.engine.truncate(handle, length)

    def fork(self, handle, n):
        return self.engine.fork(handle, n)

    def kv(self, handle):
        return self.engine.kv(handle)


# ------------------------------------------------------------------------ transformers


class ContextLimitError(ValueError):
    """A position beyond the model's context (the HF adapter refuses it: RoPE alone would not)."""


@dataclass
class _Group:
    """Sequences sharing one ``DynamicCache`` (one left-padded batch): ``mask`` [B, columns] 1 on
    real tokens, ``pos`` [B] the next position id of each row."""

    cache: object
    rows: list
    mask: object
    pos: object


class HFCacheAdapter(CacheAdapter):
    """A transformers model with its ``DynamicCache``: each prefill call is one left-padded batch
    (a group); stepping part of a group splits it (a copy of the cache, ``batch_select_indices``),
    ``free`` compacts (``batch_select_indices``), ``truncate`` is ``crop``, ``fork`` is
    ``batch_repeat_interleave``. Sliding-window layers record their past so they can be cropped.
    ``max_context``: the model's ``max_position_embeddings``, enforced here."""

    padding_side = "left"

    def __init__(self, model_dir, dtype: str = "float32", *, max_batch: int = 8, max_context: int | None = None):
        from extractors.hf import load_hf_model

        raw = json.loads((Path(model_dir) / "config.json").read_text())
        limit = (raw.get("text_config") or raw).get("max_position_embeddings")
        if max_context and limit and max_context > limit:  # refused before the model loads
            raise ValueError(f"HFCacheAdapter: max_context {max_context} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.model = load_hf_model(model_dir, dtype)
        cfg = self.model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        self.config = cfg
        self.max_context = int(max_context or cfg.max_position_embeddings)
        if self.max_context > cfg.max_position_embeddings:
            raise ValueError(f"HFCacheAdapter: max_context {self.max_context} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        kinds = getattr(cfg, "layer_types", None) or []
        self.window = getattr(cfg, "sliding_window", None) if (
            "sliding_attention" in kinds or cfg.model_type in ("mistral",)) else None
        self.name = f"hf:{cfg.model_type}"
        self.dtype, self.max_batch = dtype, max_batch
        self.vocab_size = int(cfg.vocab_size)
        self.reset()

    # -- helpers

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()  # sliding layers keep their past so crop() can roll back
        return cache

    def _forward(self, ids, mask, pos, cache):
        import torch

        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=cache is not None)
        return out.logits.float()

    def _check(self, last_pos: int):
        if last_pos >= self.max_context:
            raise ContextLimitError(f"HFCacheAdapter: position {last_pos} is beyond the context of "
                                    f"{self.max_context} tokens")

    @staticmethod
    def _left_pad(seqs):
        import torch

        lens = [len(s) for s in seqs]
        T = max(lens)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, T - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[b, T - len(s):] = 1
        return ids, mask, lens

    # -- the reference

    def full_logits(self, seqs):
        ids, mask, lens = self._left_pad(seqs)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, pos, None)
        T = ids.shape[1]
        return [logits[b, T - n:].numpy() for b, n in enumerate(lens)]

    def full_kv(self, tokens):
        import torch

        cache = self._new_cache()
        ids = torch.as_tensor([list(tokens)], dtype=torch.long)
        self._forward(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], cache)
        return self._kv_of(cache, 0, torch.ones_like(ids)[0])

    def _kv_of(self, cache, row, mask_row):
        real = mask_row.bool()
        n = int(real.sum())
        ks, vs = [], []
        for layer in cache.layers:
            k, v = layer.keys[row], layer.values[row]  # [kv_head, held columns, D]
            held = k.shape[1]
            cols = real[-held:]  # a cropped sliding layer holds only the last columns
            k, v = k[:, cols].float().numpy(), v[:, cols].float().numpy()
            pad = n - k.shape[1]
            if pad:
                nan = np.full((k.shape[0], pad, k.shape[2]), np.nan, np.float32)
                k, v = np.concatenate([nan, k], 1), np.concatenate([nan, v], 1)
            ks.append(k)
            vs.append(v)
        return np.stack(ks), np.stack(vs)

    # -- the session

    def reset(self):
        self.groups: list[_Group] = []
        self._next = 0

    def _group_of(self, h) -> _Group:
        for g in self.groups:
            if h in g.rows:
                return g
        raise KeyError(f"HFCacheAdapter: no live sequence {h!r}")

    def _split(self, g: _Group, subset) -> _Group:
        """Move the rows ``subset`` of ``g`` into a group of their own (a copy of the cache)."""
        import torch

        take = [g.rows.index(h) for h in subset]
        if len(take) == len(g.rows):
            return g
        keep = [i for i in range(len(g.rows)) if i not in take]
        new_cache = copy.deepcopy(g.cache)
        new_cache.batch_select_indices(torch.as_tensor(take))
        g.cache.batch_select_indices(torch.as_tensor(keep))
        new = _Group(new_cache, [g.rows[i] for i in take], g.mask[take], g.pos[take])
        g.rows, g.mask, g.pos = [g.rows[i] for i in keep], g.mask[keep], g.pos[keep]
        self.groups.append(new)
        return new

    def prefill(self, prompts, chunk_size=None):
        import torch

        if sum(len(g.rows) for g in self.groups) + len(prompts) > self.max_batch:
            raise RuntimeError(f"HFCacheAdapter: more than max_batch {self.max_batch} sequences")
        self._check(max(len(p) for p in prompts) - 1)
        ids, mask, lens = self._left_pad(prompts)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = self._new_cache()
        T = ids.shape[1]
        cs = chunk_size or T
        parts = []
        for s in range(0, T, cs):
            parts.append(self._forward(ids[:, s:s + cs], mask[:, :s + cs], pos[:, s:s + cs], cache))
        logits = torch.cat(parts, 1)
        handles = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        self.groups.append(_Group(cache, handles, mask, torch.as_tensor(lens)))
        return handles, [logits[b, T - n:].numpy() for b, n in enumerate(lens)]

    def step(self, handles, tokens):
        import torch

        handles = list(handles)
        tok = dict(zip(handles, tokens))
        out = {}
        for g in {id(self._group_of(h)): self._group_of(h) for h in handles}.values():
            g = self._split(g, [h for h in g.rows if h in tok])
            for p in g.pos.tolist():
                self._check(p)
            ids = torch.as_tensor([[int(tok[h])] for h in g.rows], dtype=torch.long)
            g.mask = torch.cat([g.mask, torch.ones(len(g.rows), 1, dtype=g.mask.dtype)], 1)
            logits = self._forward(ids, g.mask, g.pos[:, None], g.cache)
            g.pos = g.pos + 1
            for b, h in enumerate(g.rows):
                out[h] = logits[b, -1].numpy()
        return np.stack([out[h] for h in handles])

    def free(self, handles):
        import torch

        for h in handles:
            g = self._group_of(h)
            keep = [i for i, x in enumerate(g.rows) if x != h]
            if not keep:
                self.groups.remove(g)
                continue
            g.cache.batch_select_indices(torch.as_tensor(keep))
            g.rows, g.mask, g.pos = [g.rows[i] for i in keep], g.mask[keep], g.pos[keep]

    def truncate(self, handle, length):
        g = self._split(self._group_of(handle), [handle])
        n = int(g.pos[0])
        if not 0 < length <= n:
            raise ValueError(f"HFCacheAdapter: truncate to {length} of a {n}-token sequence")
        if length < n:
            for layer in g.cache.layers:  # a sliding layer holds its last W-1 positions after a crop
                w = getattr(layer, "sliding_window", None)
                if w and layer.keys is not None and layer.keys.shape[-2] < (n - length) + min(w - 1, length):
                    raise NotSupported(f"transformers' sliding-window cache holds {layer.keys.shape[-2]} positions: "
                                       f"it cannot roll back {n - length} of {n}")
            g.cache.crop(-(n - length))
            g.mask = g.mask[:, : g.mask.shape[1] - (n - length)]
        g.pos = g.pos.clone()
        g.pos[0] = length

    def fork(self, handle, n):
        g = self._split(self._group_of(handle), [handle])
        if sum(len(x.rows) for x in self.groups) + n > self.max_batch:
            raise RuntimeError(f"HFCacheAdapter: forking {n} exceeds max_batch {self.max_batch}")
        g.cache.batch_repeat_interleave(n + 1)
        new = list(range(self._next, self._next + n))
        self._next += n
        g.rows = [handle, *new]
        g.mask = g.mask.repeat(n + 1, 1)
        g.pos = g.pos.repeat(n + 1)
        return new

    def kv(self, handle):
        g = self._group_of(handle)
        return self._kv_of(g.cache, g.rows.index(handle), g.mask[g.rows.index(handle)])


def model_type(model_dir) -> str:
    """``model_type`` of a checkpoint directory's config.json ('' when unreadable)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return ""
