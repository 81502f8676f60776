"""A small hand-written serving engine around an HF causal LM, with faults that live in its loop
and cache, never in the model: the user's own engine of ``extractors.engine_capture``'s tests.

It keeps its own KV cache (``[layer, cache_row, kv_head, position, head_dim]``: one cache row per
request, never cleared when a request ends), attends over it with its own attention function
(registered with transformers' ``AttentionInterface`` and switched on only while its loop runs),
and runs requests batched and padded (left or right) through one prefill forward and then one
decode forward per step, teacher-forced on the given continuations. Prefill and decode both read
K/V back from the cache (as vLLM's CPU attention does).

Faults (``FAULTS``):
- ``rope_decode_offset``: decode forwards get position ids one too high (prefill right);
- ``kv_write_prev_slot``: a decode step writes its K/V into the previous position's slot;
- ``stale_read``: a decode step reads one slot past its own, left there by an earlier request;
- ``fp8_cache_writes``: every cache write rounds K and V through FP8 E4M3;
- ``v_head_scale``: kv head 1's V is written scaled by 1.25.
The cache faults (all but ``rope_decode_offset``) act in every layer, or in ``fault_layers`` only.
``cache_of(b)`` reads request ``b``'s cache row of the last ``run`` (what ``EngineCapture(kv=...)``
is handed).
"""
from __future__ import annotations

import contextlib

import torch

FAULTS = ("rope_decode_offset", "kv_write_prev_slot", "stale_read", "fp8_cache_writes", "v_head_scale")
_ATTN = "capturestore_test_own_engine"


class OwnEngine:
    def __init__(self, model, *, cache_rows: int = 4, max_len: int = 128, fault: str | None = None,
                 padding: str = "left", fault_layers=None):
        assert fault in (None, *FAULTS) and padding in ("left", "right")
        from transformers import AttentionInterface

        c = model.config
        self.model, self.fault, self.padding = model, fault, padding
        self.fault_layers = None if fault_layers is None else set(fault_layers)
        self.rows: list = []  # cache row of each request of the last run
        heads = c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        shape = (c.num_hidden_layers, cache_rows, self.kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)
        self.free = list(range(cache_rows))
        self._fwd = None  # this forward: cache row per batch row, position per (batch row, column) or -1, decode?
        AttentionInterface.register(_ATTN, _attention)

    @contextlib.contextmanager
    def _own_attention(self):
        old = self.model.config._attn_implementation
        self.model.set_attn_implementation(_ATTN)
        _RUNNING.append(self)
        try:
            yield
        finally:
            _RUNNING.pop()
            self._fwd = None
            self.model.set_attn_implementation(old)

    def run(self, prompts, continuations):
        """Serve ``prompts`` batched (row i = request i), teacher-forced on ``continuations`` (all of
        one length T): one prefill forward, then T - 1 decode forwards. Returns the logits
        ``[request, gen_token, vocab]`` float32 (prefill's last row, then one per decode step)."""
        B, T = len(prompts), len(continuations[0])
        rows = [self.free.pop(0) for _ in range(B)]
        self.rows = rows
        S = max(len(p) for p in prompts)
        ids = torch.zeros((B, S), dtype=torch.long)
        mask = torch.zeros((B, S), dtype=torch.long)
        pos = torch.full((B, S), -1, dtype=torch.long)
        for b, p in enumerate(prompts):
            cols = range(S - len(p), S) if self.padding == "left" else range(len(p))
            ids[b, list(cols)] = torch.tensor(p)
            mask[b, list(cols)] = 1
            pos[b, list(cols)] = torch.arange(len(p))
        out = []
        with self._own_attention(), torch.inference_mode():
            self._fwd = (rows, pos, False)
            lg = self.model(input_ids=ids, attention_mask=mask, position_ids=pos.clamp(min=0), use_cache=False).logits
            last = [S - 1 if self.padding == "left" else len(p) - 1 for p in prompts]
            out.append(torch.stack([lg[b, last[b]].float() for b in range(B)]))
            for n in range(T - 1):
                ids = torch.tensor([[c[n]] for c in continuations])
                pos = torch.tensor([[len(p) + n] for p in prompts])
                self._fwd = (rows, pos, True)
                fed_pos = pos + 1 if self.fault == "rope_decode_offset" else pos
                lg = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=fed_pos,
                                use_cache=False).logits
                out.append(lg[:, -1].float())
        self._fwd = None
        self.free = rows + self.free  # freed, not cleared: the next request takes the same cache rows
        return torch.stack(out, dim=1)

    def cache_of(self, b: int) -> list:
        """``[(k, v)]`` per layer, ``[kv_head, max_len, head_dim]``: request ``b``'s cache row of the last run."""
        r = self.rows[b]
        return [(self.k[i, r], self.v[i, r]) for i in range(self.k.shape[0])]

    # the engine's attention: write this forward's K/V into its cache, attend over the cache
    def attend(self, module, q, k, v, scaling):
        rows, pos, decode = self._fwd
        layer = module.layer_idx
        fault = self.fault if self.fault_layers is None or layer in self.fault_layers else None
        B, H, S, D = q.shape
        out = torch.zeros((B, S, H, D), dtype=q.dtype)
        for b in range(B):
            r = rows[b]
            cols = [j for j in range(S) if pos[b, j] >= 0]
            for j in cols:
                slot = int(pos[b, j]) - (1 if decode and fault == "kv_write_prev_slot" else 0)
                kk, vv = k[b, :, j], v[b, :, j].clone()
                if fault == "fp8_cache_writes":
                    kk = kk.to(torch.float8_e4m3fn).to(kk.dtype)
                    vv = vv.to(torch.float8_e4m3fn).to(vv.dtype)
                if fault == "v_head_scale":
                    vv[1] = vv[1] * 1.25
                self.k[layer, r, :, slot] = kk
                self.v[layer, r, :, slot] = vv
            qp = pos[b, cols]  # positions of this row's queries
            n_read = int(qp.max()) + 1 + (1 if decode and fault == "stale_read" else 0)
            rep = H // self.kv_heads
            K = self.k[layer, r, :, :n_read].repeat_interleave(rep, dim=0)  # [H, n_read, D]
            V = self.v[layer, r, :, :n_read].repeat_interleave(rep, dim=0)
            scores = torch.matmul(q[b][:, cols], K.transpose(1, 2)) * scaling  # [H, s, n_read]
            limit = qp[:, None] + (1 if decode and fault == "stale_read" else 0)
            causal = torch.arange(n_read)[None, :] <= limit
            scores = scores.masked_fill(~causal[None], float("-inf"))
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[b, cols] = torch.matmul(attn, V).transpose(0, 1)
        return out, None


_RUNNING: list = []  # the engine whose loop runs now


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    eng = _RUNNING[-1]
    return eng.attend(module, query, key, value, scaling if scaling is not None else module.scaling)
