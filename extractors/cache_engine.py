"""A small paged-KV-cache engine over a Llama checkpoint: the reference "user's own engine".

It is what an engineer building a cache writes, at the smallest size that still has every
moving part the cache-equivalence harness (``capturestore.cachecheck``) checks:

- ``LlamaWeights``: a Llama decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) written here
  from the equations, loading the same ``model.safetensors`` transformers loads (so its plain
  forward is checked against HF's, an oracle independent of this file).
- ``PagedEngine``: a block pool ``[layer, block, kv_head, block_size, head_dim]`` with a
  per-position ``valid`` map, reference counts, a free list, per-sequence block tables, a running
  batch whose per-row state (``row_pos``: the next position id of each row) is compacted when a
  sequence finishes, chunked prefill of ragged batches packed with right padding, truncation,
  forks sharing blocks with copy-on-write, and a hard context limit.

Attention reads every ``valid`` entry of a sequence's blocks that was written before this
forward, plus the entries written in this forward at positions up to the query's own: the engine
trusts its bookkeeping, as real kernels trust their block tables and lengths. That is why each
bookkeeping bug below changes the output rather than hiding behind a causal mask.

Planted bugs (``bugs=``), each a realistic cache bug (``BUGS`` says what each does):
``stale_slot``, ``truncate_keeps_pos``, ``fork_no_cow``, ``compaction_shift``,
``chunk_pos_off_by_one``, ``pad_read``, ``context_off_by_one``.

Shapes: ``k, v: [layer, kv_head, seq, head_dim]`` (post-RoPE K, as transformers caches it);
logits ``[position, vocab]`` float32 numpy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BUGS = {
    "stale_slot": "free() returns blocks to the pool without clearing their valid map: the next "
                  "request in them attends to the previous request's K/V",
    "truncate_keeps_pos": "truncate() cuts the cache back but keeps the old position counter",
    "fork_no_cow": "a fork's branches write into their shared last block (no copy-on-write)",
    "compaction_shift": "freeing a row compacts the row ids but drops the last row's position "
                        "state instead of the freed one: survivors after it shift",
    "chunk_pos_off_by_one": "chunked prefill gives RoPE positions one too high after the first chunk",
    "pad_read": "ragged prefill writes the padded tail into the cache as valid entries",
    "context_off_by_one": "the context check lets position max_context through; the block table "
                          "wraps it onto the sequence's first block",
}


class ContextOverflowError(ValueError):
    """A position at or beyond the engine's context limit."""


@dataclass
class _Layer:
    q: object
    k: object
    v: object
    o: object
    gate: object
    up: object
    down: object
    ln1: object
    ln2: object


class LlamaWeights:
    """A Llama checkpoint (``config.json`` + ``model.safetensors``) as plain tensors in ``dtype``."""

    def __init__(self, model_dir, dtype: str = "float32"):
        import torch
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        if cfg.get("model_type") != "llama":
            raise ValueError(f"LlamaWeights: {model_dir} is a {cfg.get('model_type')!r} model; this engine runs llama")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"LlamaWeights: dtype {dtype!r} not one of {sorted(dtypes)}")
        self.dtype_name = dtype
        self.dtype = dtypes[dtype]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        self.hidden = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.vocab = cfg["vocab_size"]
        self.max_position = cfg.get("max_position_embeddings", 2048)
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        w = {k: v.to(self.dtype) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        p = "model.layers.{}."
        self.layers = [_Layer(*(w[p.format(i) + n] for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight"))) for i in range(self.n_layers)]

    def rms(self, x, w):
        import torch

        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def rope(self, x, positions):
        """x: [B, heads, T, head_dim], positions: int [B, T] -> x rotated (transformers' rotate_half form)."""
        import torch

        freqs = positions.float()[..., None] * self.inv_freq[None, None, :]  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def qkv(self, layer: _Layer, h, positions):
        """h: [B, T, hidden] -> q [B, heads, T, D], k, v [B, kv_head, T, D] (k, q rotated)."""
        B, T, _ = h.shape
        x = self.rms(h, layer.ln1)
        q = (x @ layer.q.T).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = (x @ layer.k.T).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = (x @ layer.v.T).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return self.rope(q, positions), self.rope(k, positions), v

    def attend(self, q, k, v, mask):
        """q [B, H, T, D], k, v [B, KV, S, D], mask bool [B, T, S] -> [B, T, H*D]; a query with
        nothing to attend to (padding) gives zeros."""
        import torch

        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (self.head_dim ** -0.5)
        m = mask[:, None]
        scores = scores.masked_fill(~m, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        probs = torch.where(m.any(-1, keepdim=True), probs, torch.zeros_like(probs))
        out = probs @ v  # [B, H, T, D]
        B, H, T, D = out.shape
        return out.transpose(1, 2).reshape(B, T, H * D)

    def mlp(self, layer: _Layer, h):
        import torch

        x = self.rms(h, layer.ln2)
        return (torch.nn.functional.silu(x @ layer.gate.T) * (x @ layer.up.T)) @ layer.down.T

    def head(self, h):
        return self.rms(h, self.norm) @ self.lm_head.T

    def forward_full(self, seqs):
        """The plain forward, no cache: every position from its whole prefix.

        seqs: list of token lists -> (logits list of float32 [len_i, vocab], k, v lists of
        [layer, kv_head, len_i, head_dim]). Ragged batches are right-padded and masked."""
        import torch

        lens = [len(s) for s in seqs]
        B, T = len(seqs), max(lens)
        ids = torch.zeros(B, T, dtype=torch.long)
        real = torch.zeros(B, T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            real[b, : len(s)] = True
        pos = torch.arange(T)[None].expand(B, T)
        mask = (pos[:, None, :] <= pos[:, :, None]) & real[:, None, :]  # [B, Tq, Tk]
        h = self.embed[ids]
        ks, vs = [], []
        with torch.no_grad():
            for layer in self.layers:
                q, k, v = self.qkv(layer, h, pos)
                ks.append(k)
                vs.append(v)
                h = h + self.attend(q, k, v, mask) @ layer.o.T
                h = h + self.mlp(layer, h)
            logits = self.head(h).float()
        out_l = [logits[b, :n].numpy() for b, n in enumerate(lens)]
        k_all, v_all = torch.stack(ks, 1), torch.stack(vs, 1)  # [B, layer, kv, T, D]
        out_k = [k_all[b, :, :, :n].float().numpy() for b, n in enumerate(lens)]
        out_v = [v_all[b, :, :, :n].float().numpy() for b, n in enumerate(lens)]
        return out_l, out_k, out_v


class PagedEngine:
    """The paged engine (module docstring). Sequence handles are ints; ``bugs`` plants cache bugs."""

    def __init__(self, weights: LlamaWeights, *, block_size: int = 16, num_blocks: int = 64, max_context: int = 128,
                 max_batch: int = 8, bugs=()):
        import torch

        unknown = set(bugs) - set(BUGS)
        if unknown:
            raise ValueError(f"PagedEngine: unknown bug(s) {sorted(unknown)}; known: {', '.join(BUGS)}")
        if max_context % block_size:
            raise ValueError(f"PagedEngine: max_context {max_context} is not a multiple of block_size {block_size}")
        self.w = weights
        self.block_size, self.num_blocks, self.max_context, self.max_batch = block_size, num_blocks, max_context, max_batch
        self.max_blocks = max_context // block_size  # block-table entries per sequence
        self.bugs = frozenset(bugs)
        shape = (weights.n_layers, num_blocks, weights.n_kv, block_size, weights.head_dim)
        self.k_pool = torch.zeros(shape, dtype=weights.dtype)
        self.v_pool = torch.zeros(shape, dtype=weights.dtype)
        self.reset()

    def reset(self) -> None:
        """A fresh engine: every block free and cleared, no sequences."""
        import torch

        self.k_pool.zero_()
        self.v_pool.zero_()
        self.valid = torch.zeros(self.num_blocks, self.block_size, dtype=torch.bool)
        self.refcount = [0] * self.num_blocks
        self.free_blocks = list(range(self.num_blocks))  # a stack: the last freed is reused first
        self.tables: dict[int, list[int]] = {}  # handle -> block ids
        self.lengths: dict[int, int] = {}
        self.rows: list[int] = []  # the running batch, in row order
        self.row_pos = torch.zeros(0, dtype=torch.long)  # next position id of each row
        self._next = 0

    # ------------------------------------------------------------------ blocks

    def _alloc(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("PagedEngine: out of KV blocks")
        b = self.free_blocks.pop()
        self.refcount[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if "stale_slot" not in self.bugs:
                self.valid[b] = False
            self.free_blocks.append(b)

    def _slot(self, h: int, pos: int, write: bool) -> tuple[int, int]:
        """(block, offset) of position ``pos`` of sequence ``h``; ``write``: allocate the block if
        needed and make it private first (copy-on-write)."""
        table = self.tables[h]
        idx = (pos // self.block_size) % self.max_blocks  # only context_off_by_one ever wraps
        while write and len(table) <= idx:
            table.append(self._alloc())
        b = table[idx]
        if write and self.refcount[b] > 1 and "fork_no_cow" not in self.bugs:
            nb = self._alloc()
            self.k_pool[:, nb] = self.k_pool[:, b]
            self.v_pool[:, nb] = self.v_pool[:, b]
            self.valid[nb] = self.valid[b]
            self.refcount[b] -= 1
            table[idx] = nb
            b = nb
        return b, pos % self.block_size

    def _check_context(self, pos: int) -> None:
        limit = self.max_context + (1 if "context_off_by_one" in self.bugs else 0)
        if pos >= limit:
            raise ContextOverflowError(f"PagedEngine: position {pos} is beyond the context of {self.max_context} tokens")

    # ------------------------------------------------------------------ forward

    def _forward(self, handles, chunks, rope_shift=0):
        """Feed ``chunks[i]`` (token list) to sequence ``handles[i]`` at its next positions, all
        rows in one ragged batch (right padding). Returns float32 logits list [len_i, vocab]."""
        import torch

        B = len(handles)
        lens = [len(c) for c in chunks]
        T = max(lens)
        row_of = {h: self.rows.index(h) for h in handles}
        start = [int(self.row_pos[row_of[h]]) for h in handles]
        for h, s, n in zip(handles, start, lens):
            if n:
                self._check_context(s + n - 1)
        ids = torch.zeros(B, T, dtype=torch.long)
        real = torch.zeros(B, T, dtype=torch.bool)
        for b, c in enumerate(chunks):
            ids[b, : len(c)] = torch.as_tensor(c, dtype=torch.long)
            real[b, : len(c)] = True
        pos = torch.as_tensor(start)[:, None] + torch.arange(T)[None]  # [B, T] cache positions
        written = real | ("pad_read" in self.bugs)  # the bug writes the padded tail as well
        # where each token's K/V goes, allocating (and copying on write) before the first layer
        slots = torch.full((B, T, 2), -1, dtype=torch.long)
        for b, h in enumerate(handles):
            for t in range(T):
                if written[b, t] and (real[b, t] or int(pos[b, t]) < self.max_context):
                    slots[b, t] = torch.as_tensor(self._slot(h, int(pos[b, t]), write=True))
        has = slots[..., 0] >= 0
        nb = max(len(self.tables[h]) for h in handles)
        table = torch.zeros(B, nb, dtype=torch.long)
        known = torch.zeros(B, nb * self.block_size, dtype=torch.bool)
        for b, h in enumerate(handles):
            table[b, : len(self.tables[h])] = torch.as_tensor(self.tables[h])
            known[b, : len(self.tables[h]) * self.block_size] = True
        fresh = torch.zeros(B, nb * self.block_size, dtype=torch.bool)  # entries written by this forward
        key_pos = torch.arange(nb * self.block_size)[None].expand(B, -1)
        bi, ti = has.nonzero(as_tuple=True)
        blk, off = slots[bi, ti, 0], slots[bi, ti, 1]
        for b, t, x, o in zip(bi.tolist(), ti.tolist(), blk.tolist(), off.tolist()):
            col = self.tables[handles[b]].index(x) * self.block_size + o
            fresh[b, col] = True
        self.valid[blk, off] = True
        valid = self.valid[table].reshape(B, -1) & known
        # the chunk after the first gets RoPE positions one too high under chunk_pos_off_by_one
        rope_pos = pos + rope_shift
        mask = valid[:, None, :] & ~(fresh[:, None, :] & (key_pos[:, None, :] > pos[:, :, None]))
        mask = mask & real[:, :, None]
        h = self.w.embed[ids]
        with torch.no_grad():
            for li, layer in enumerate(self.w.layers):
                q, k, v = self.w.qkv(layer, h, rope_pos)
                self.k_pool[li, blk, :, off] = k[bi, :, ti]
                self.v_pool[li, blk, :, off] = v[bi, :, ti]
                kk = self.k_pool[li][table].permute(0, 2, 1, 3, 4).reshape(B, self.w.n_kv, -1, self.w.head_dim)
                vv = self.v_pool[li][table].permute(0, 2, 1, 3, 4).reshape(B, self.w.n_kv, -1, self.w.head_dim)
                h = h + self.w.attend(q, kk, vv, mask) @ layer.o.T
                h = h + self.w.mlp(layer, h)
            logits = self.w.head(h).float()
        for b, h_ in enumerate(handles):
            self.row_pos[row_of[h_]] += lens[b]
            self.lengths[h_] += lens[b]
        return [logits[b, :n].numpy() for b, n in enumerate(lens)]

    # ------------------------------------------------------------------ the session

    def prefill(self, prompts, chunk_size: int | None = None):
        """New sequences for ``prompts`` (token lists), prefilled together as one ragged batch,
        ``chunk_size`` tokens of each per forward (None: all at once). -> (handles, logits list
        of [len_i, vocab])."""
        import torch

        if len(self.rows) + len(prompts) > self.max_batch:
            raise RuntimeError(f"PagedEngine: {len(self.rows) + len(prompts)} sequences exceed max_batch {self.max_batch}")
        handles = []
        for p in prompts:
            if not len(p):
                raise ValueError("PagedEngine: an empty prompt")
            self._check_context(len(p) - 1)
            h = self._next
            self._next += 1
            self.tables[h], self.lengths[h] = [], 0
            self.rows.append(h)
            handles.append(h)
        self.row_pos = torch.cat([self.row_pos, torch.zeros(len(prompts), dtype=torch.long)])
        cs = chunk_size or max(len(p) for p in prompts)
        out = [[] for _ in prompts]
        for c, start in enumerate(range(0, max(len(p) for p in prompts), cs)):
            live = [i for i, p in enumerate(prompts) if start < len(p)]
            shift = 1 if (c > 0 and "chunk_pos_off_by_one" in self.bugs) else 0
            logits = self._forward([handles[i] for i in live], [list(prompts[i][start:start + cs]) for i in live], shift)
            for i, lg in zip(live, logits):
                out[i].append(lg)
        return handles, [np.concatenate(o) for o in out]

    def step(self, handles, tokens):
        """One decode step: token ``tokens[i]`` fed to ``handles[i]`` -> logits [len(handles), vocab]."""
        return np.stack([lg[0] for lg in self._forward(list(handles), [[int(t)] for t in tokens])])

    def free(self, handles) -> None:
        """Finish sequences: their blocks return to the pool, their rows leave the batch (compacted)."""
        import torch

        for h in handles:
            for b in self.tables.pop(h):
                self._decref(b)
            del self.lengths[h]
            i = self.rows.index(h)
            self.rows.pop(i)
            drop = len(self.row_pos) - 1 if "compaction_shift" in self.bugs else i
            self.row_pos = torch.cat([self.row_pos[:drop], self.row_pos[drop + 1:]])

    def truncate(self, handle, length: int) -> None:
        """Cut sequence ``handle`` back to its first ``length`` tokens."""
        if not 0 < length <= self.lengths[handle]:
            raise ValueError(f"PagedEngine: truncate to {length} of a {self.lengths[handle]}-token sequence")
        table = self.tables[handle]
        keep = -(-length // self.block_size)
        for b in table[keep:]:
            self._decref(b)
        del table[keep:]
        if length % self.block_size:
            b, off = self._slot(handle, length, write=True)  # the kept partial block becomes private first
            self.valid[b, off:] = False
        self.lengths[handle] = length
        if "truncate_keeps_pos" not in self.bugs:
            self.row_pos[self.rows.index(handle)] = length

    def fork(self, handle, n: int):
        """``n`` new sequences sharing ``handle``'s blocks (copy-on-write) -> their handles."""
        import torch

        if len(self.rows) + n > self.max_batch:
            raise RuntimeError(f"PagedEngine: forking {n} exceeds max_batch {self.max_batch}")
        out = []
        for _ in range(n):
            h = self._next
            self._next += 1
            self.tables[h] = list(self.tables[handle])
            for b in self.tables[h]:
                self.refcount[b] += 1
            self.lengths[h] = self.lengths[handle]
            self.rows.append(h)
            self.row_pos = torch.cat([self.row_pos, self.row_pos[self.rows.index(handle)][None]])
            out.append(h)
        return out

    def kv(self, handle):
        """The cached (k, v) of ``handle``: [layer, kv_head, length, head_dim] float32; positions
        whose entry is not valid are NaN."""
        import torch

        n = self.lengths[handle]
        table = torch.as_tensor(self.tables[handle], dtype=torch.long)
        k = self.k_pool[:, table].permute(0, 2, 1, 3, 4).reshape(self.w.n_layers, self.w.n_kv, -1, self.w.head_dim)
        v = self.v_pool[:, table].permute(0, 2, 1, 3, 4).reshape(self.w.n_layers, self.w.n_kv, -1, self.w.head_dim)
        ok = self.valid[table].reshape(-1)[:n]
        k, v = k[:, :, :n].float().clone(), v[:, :, :n].float().clone()
        k[:, :, ~ok] = float("nan")
        v[:, :, ~ok] = float("nan")
        return k.numpy(), v.numpy()
