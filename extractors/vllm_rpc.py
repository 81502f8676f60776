"""Real vLLM KV extraction through a worker extension, plus teacher-forced capture into the store.

Use it as ``LLM(..., worker_extension_cls="extractors.vllm_rpc.KVCaptureWorkerExtension")``
(``make_llm`` does, and adds the teacher-forcing logits processor); the extension adds the RPC
contract of reference/000 (``get_kv_caches``, ``get_kv_cache_config``, ``get_block_tables``) to
any vLLM worker, reached with ``llm.collective_rpc(name)``, and the raw-logits recording of
``extractors.vllm_logits``. It works with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and in a separate engine process (scripts then need an
``if __name__ == "__main__":`` guard), with TP > 1 (one worker process per rank).

Request lifetime (ENGINES.md): a request's blocks are freed when it finishes and reused, and
zeroed, by the next request at once. The extension therefore snapshots a finishing request's
blocks when the worker learns it finished (wrapping the model runner's ``_update_states``,
before the step that may overwrite them). Snapshotting starts on the first call of any
method of the extension (``extract_vllm_kv_cache_config`` is the natural first call, before
``generate``) and costs nothing before. Requests that finished before it started are lost.

Values cross the process boundary as ``{"dtype", "shape", "data": bytes}`` (tensors in RPC
results come back undecoded); in-process they are passed as tensors, with no copy
(``extractors.vllm_transport``).

``capture_vllm_run`` stores raw logits and KV of a teacher-forced run, one pass per prompt
(``extractors.vllm_logits``). The logprob-based helpers (``vllm_teacher_forced_logprobs``,
``make_vllm_generate_fn``) remain for the teacher-forcing loop of ``metrics.logits``; their
full-vocabulary logprobs are Python objects, slow and GiB-sized at real vocabulary sizes.

vLLM is imported lazily: this module imports without it.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from extractors.paged import reconstruct_contiguous_kv_batch
from extractors.vllm_fp8 import Fp8CaptureMixin, check_fp8_config_scales, decode_paged_kv
from extractors.vllm_logits import LogitsCaptureMixin
from extractors.vllm_modules import ModuleCaptureMixin, hf_kv_layer_name
from extractors.vllm_replace import ReplaceMixin
from extractors.vllm_transport import (
    EXTENSION_QUALNAME,
    TEACHER_FORCING_QUALNAME,
    decode_tensor,
    encode_tensor,
)
from extractors.vllm_transport import call_workers as _rpc
from extractors.vllm_transport import rpc_transport as _transport

DEFAULT_MAX_FINISHED = 64

# ---------------------------------------------------------------------------------- engine


# Also applied wherever this library imports numba (metrics._numba), so that a user's own
# vllm.LLM(...) works too; make_llm applies it for a numba the caller imported directly.
from metrics._numba import guard_llvmlite_against_vllm_kernel_scan as _guard_llvmlite_against_vllm_kernel_scan  # noqa: E402,E501


def make_llm(model, **kwargs):
    """``vllm.LLM(model, **kwargs)`` with what extraction needs: the capture worker extension (KV
    and raw logits), the teacher-forcing logits processor (``extractors.vllm_teacher``),
    full-vocab logprobs (``max_logprobs=-1``), eager mode, and a low ``gpu_memory_utilization``
    (the CPU worker refuses to start unless that fraction of the host's RAM is free; the KV
    cache itself is sized by ``VLLM_CPU_KVCACHE_SPACE`` or ``num_gpu_blocks_override``).
    Any keyword overrides these defaults."""
    from vllm import LLM

    _guard_llvmlite_against_vllm_kernel_scan()
    defaults = dict(worker_extension_cls=EXTENSION_QUALNAME, logits_processors=[TEACHER_FORCING_QUALNAME],
                    max_logprobs=-1, enforce_eager=True, gpu_memory_utilization=0.1, seed=0)
    return LLM(model=str(model), **{**defaults, **kwargs})


SHUTDOWN_GRACE_S = 15.0


def close_llm(llm, timeout: float = SHUTDOWN_GRACE_S) -> None:
    """Shut the engine down now rather than whenever the garbage collector finds it.

    The engine core's finalizer tears down vLLM's process-wide distributed state; run late, from
    inside a later engine's start in the same process, it removes that engine's parallel groups
    ("pipeline model parallel group is not initialized"). Idempotent.

    ``timeout`` is the engine processes' grace after SIGTERM (vLLM's own is 5 s, which a tensor
    parallel engine on two busy cores can overrun). Past it vLLM kills the process tree, naming
    each child for its log line first; a child that exits between the listing and the naming
    raises ``psutil.NoSuchProcess`` out of vLLM's shutdown (seen in CI), with the rest of the tree
    alive and the client's sockets open. That case is finished here: every process left is
    killed and the client's resources closed."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    import psutil

    try:
        core.shutdown(timeout=timeout)
    except psutil.NoSuchProcess:
        resources = getattr(core, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        _kill_process_trees(getattr(manager, "processes", ()))
        if resources is not None:
            resources()  # sockets and coordinator; the manager's own shutdown is spent already


def _kill_process_trees(procs) -> None:
    """SIGKILL each live process of ``procs`` and all its descendants, tolerating any that exit
    meanwhile, then reap them."""
    import psutil

    for proc in procs:
        if proc.pid is None or not proc.is_alive():
            continue
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)


# ---------------------------------------------------------------------------------- transport

_encode, _decode = encode_tensor, decode_tensor  # the names this module and its tests use


# ---------------------------------------------------------------------------------- index maps

_INDEX_MAP_CACHE: dict[tuple, tuple[list[int], list[int]]] = {}
_DIGIT = 64  # small integers are exact in every float dtype the CPU backend stores


def derive_cpu_index_maps(dtype: torch.dtype, block_size: int, head_dim: int, isa: str,
                          num_kv_heads: int = 2) -> tuple[list[int], list[int]]:
    """In-block orders of the vLLM CPU cache, found by writing known values through the real
    cache-write op (``cpu_attn_reshape_and_cache``) once. Cached per (dtype, block_size,
    head_dim, isa).

    Returns (k_index, v_index), flat lists of ``block_size*head_dim`` offsets: element
    (token t, dim d) of K (V) sits at ``k_index[t*head_dim + d]`` inside one (block, head) row of
    ``2*block_size*head_dim`` values. Each token carries its id in base-64 digits, one write per
    digit, K positive and V negative, into a cache of two blocks and ``num_kv_heads`` heads; the
    maps must agree across heads and stay inside each head's row, or this raises.
    """
    key = (str(dtype), block_size, head_dim, isa)
    if key in _INDEX_MAP_CACHE:
        return _INDEX_MAP_CACHE[key]
    from vllm import _custom_ops as ops

    h, bs, d = num_kv_heads, block_size, head_dim
    region = 2 * bs * d
    n_ids = bs * h * d
    ids = torch.arange(n_ids, dtype=torch.int64).view(bs, h, d)  # [token, kv_head, head_dim]
    slots = torch.arange(bs, dtype=torch.int64) + bs  # all of block 1; block 0 must stay untouched
    k_pos = torch.zeros(2 * h * region, dtype=torch.int64)
    v_pos = torch.zeros_like(k_pos)
    written_k = written_v = None
    for j in range(max(1, math.ceil(math.log(n_ids, _DIGIT)))):
        digit = (ids // _DIGIT ** j) % _DIGIT
        cache = torch.full((2, h, bs, 2 * d), float("nan"), dtype=dtype)
        key_cache, value_cache = cache.view(2, h, 2 * bs, d).chunk(2, dim=2)
        vals = (digit + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(vals, -vals, key_cache, value_cache, slots, isa)
        flat = cache.reshape(-1).to(torch.float64)
        wk, wv = flat > 0, flat < 0
        if written_k is None:
            written_k, written_v = wk, wv
        elif not (torch.equal(wk, written_k) and torch.equal(wv, written_v)):
            raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {dtype}) wrote different slots per pass")
        k_pos[wk] += (flat[wk].round().long() - 1) * _DIGIT ** j
        v_pos[wv] += (-flat[wv].round().long() - 1) * _DIGIT ** j
    if int(written_k.sum()) != n_ids or int(written_v.sum()) != n_ids:
        raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {dtype}, block {bs}, head {d}) wrote "
                           f"{int(written_k.sum())} K / {int(written_v.sum())} V values, expected {n_ids} each")
    maps = []
    for written, pos in ((written_k, k_pos), (written_v, v_pos)):
        offsets = torch.nonzero(written).flatten()
        elem_ids = pos[offsets]
        where = torch.empty(n_ids, dtype=torch.int64)
        where[elem_ids] = offsets
        where = where.view(bs, h, d).permute(1, 0, 2)  # [kv_head, token, head_dim] -> flat offset
        local = where - (h * region) - torch.arange(h).view(h, 1, 1) * region  # block 1, own head row
        if bool((local < 0).any() or (local >= region).any()):
            raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}) wrote outside a (block, head) row")
        if not all(torch.equal(local[0], local[i]) for i in range(h)):
            raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}) uses different in-block orders per head")
        maps.append(local[0].reshape(-1).tolist())
    _INDEX_MAP_CACHE[key] = (maps[0], maps[1])
    return maps[0], maps[1]


# ---------------------------------------------------------------------------------- worker side


def _spec_dict(spec) -> dict:
    return {
        "spec_type": type(spec).__name__,
        "block_size": int(spec.block_size),
        "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
        "head_size": int(getattr(spec, "head_size", 0)),
        "sliding_window": getattr(spec, "sliding_window", None),
        "dtype": str(getattr(spec, "dtype", "")).removeprefix("torch."),
    }


class KVCaptureWorkerExtension(LogitsCaptureMixin, ModuleCaptureMixin, ReplaceMixin, Fp8CaptureMixin):
    """Mixed into the vLLM worker (``worker_extension_cls``); ``self`` is the worker.

    RPC methods (all via ``llm.collective_rpc(name, kwargs=...)``, one result per rank):
      get_kv_cache_config()            -> dict, see extractors.paged (groups, layout, TP info)
      get_kv_caches(request_id=None)   -> {layer: tensor}: the whole paged cache, or the
                                          request's own blocks only (live or snapshotted)
      get_block_tables(request_id=None)-> list per group: the live batch's rows
                                          ``[max_num_reqs, max_blocks]``, or the request's table
                                          renumbered to index its own blocks (0..n-1)
      get_kv_requests()                -> {engine request id: {num_tokens, finished, ...}}
      get_request_kv(request_id)       -> the request's blocks, tables and token count at once
    the raw-logits methods of ``extractors.vllm_logits.LogitsCaptureMixin``
    (``enable_logits_capture``, ``get_logits_capture_info``, ``take_request_logits``) and the
    module-capture methods of ``extractors.vllm_modules.ModuleCaptureMixin``
    (``install_module_capture``, ``take_module_capture``, ``remove_module_capture``) and the
    replacement methods of ``extractors.vllm_replace.ReplaceMixin`` (``install_module_replacement``,
    ``module_replacement_counts``, ``remove_module_replacement``).
    State lives in attributes prefixed ``_kvcap_`` (the worker must not already have them).
    """

    # -------------------------------------------------------------- state

    def _kvcap_state(self) -> dict:
        state = getattr(self, "_kvcap", None)
        if state is None:
            state = self._kvcap_enable()
        return state

    def _kvcap_enable(self, max_finished: int = DEFAULT_MAX_FINISHED) -> dict:
        runner = self.model_runner
        state = {"lengths": {}, "finished": OrderedDict(), "max_finished": max_finished}
        self._kvcap = state
        original = runner._update_states

        def update_states_with_capture(scheduler_output, *args, **kwargs):
            # Finished requests' blocks may be reused (and zeroed) in this very step: copy first.
            for req_id in scheduler_output.finished_req_ids:
                if req_id in runner.requests and req_id not in state["finished"]:
                    self._kvcap_snapshot(req_id)
            result = original(scheduler_output, *args, **kwargs)
            lengths = state["lengths"]
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                req = runner.requests.get(req_id)
                if req is not None:
                    lengths[req_id] = int(req.num_computed_tokens) + int(n)
            return result

        runner._update_states = update_states_with_capture
        return state

    def _kvcap_layers(self) -> dict[str, torch.Tensor]:
        """{layer: paged cache tensor} in KV cache group order."""
        ctx = self.model_runner.compilation_config.static_forward_context
        out = {}
        for group in self.model_runner.kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                kv = ctx[name].kv_cache
                if isinstance(kv, (list, tuple)):  # older vLLM: one tensor per virtual engine
                    kv = kv[0]
                out[name] = kv
        return out

    def _kvcap_num_tokens(self, req_id: str) -> int:
        state = self._kvcap
        if req_id in state["lengths"]:
            return state["lengths"][req_id]
        # Not seen since capture started: num_computed_tokens lags the last step by its tokens.
        req = self.model_runner.requests[req_id]
        return int(req.num_computed_tokens)

    def _kvcap_snapshot(self, req_id: str) -> None:
        state = self._kvcap
        req = self.model_runner.requests[req_id]
        block_ids = [list(ids) for ids in req.block_ids]
        layers = {}
        groups = self.model_runner.kv_cache_config.kv_cache_groups
        all_layers = self._kvcap_layers()
        for gi, group in enumerate(groups):
            idx = torch.as_tensor(block_ids[gi], dtype=torch.int64)
            for name in group.layer_names:
                layers[name] = all_layers[name].index_select(0, idx)
        state["finished"][req_id] = {"num_tokens": self._kvcap_num_tokens(req_id), "block_ids": block_ids,
                                     "layers": layers}
        state["lengths"].pop(req_id, None)
        while len(state["finished"]) > state["max_finished"]:
            state["finished"].popitem(last=False)

    def _kvcap_resolve(self, request_id: str) -> str:
        """Engine request id for a user id: exact, or the unique id with a '-suffix' added."""
        known = list(self._kvcap["finished"]) + [r for r in self.model_runner.requests
                                                 if r not in self._kvcap["finished"]]
        if request_id in known:
            return request_id
        matches = [r for r in known if r.startswith(f"{request_id}-")]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ValueError(f"request {request_id!r} is neither live nor snapshotted on this worker "
                             f"(known: {known[:8]}{'...' if len(known) > 8 else ''}); did it finish "
                             "before capture was enabled, or was it evicted?")
        raise ValueError(f"request id {request_id!r} is ambiguous: {matches}")

    def _kvcap_request(self, request_id: str) -> dict:
        """{num_tokens, block_ids (per group), layers: {layer: own blocks}, finished}."""
        state = self._kvcap_state()
        req_id = self._kvcap_resolve(request_id)
        if req_id in state["finished"]:
            return {"request_id": req_id, "finished": True, **state["finished"][req_id]}
        req = self.model_runner.requests[req_id]
        block_ids = [list(ids) for ids in req.block_ids]
        all_layers = self._kvcap_layers()
        layers = {}
        for gi, group in enumerate(self.model_runner.kv_cache_config.kv_cache_groups):
            idx = torch.as_tensor(block_ids[gi], dtype=torch.int64)
            for name in group.layer_names:
                layers[name] = all_layers[name].index_select(0, idx)
        return {"request_id": req_id, "finished": False, "num_tokens": self._kvcap_num_tokens(req_id),
                "block_ids": block_ids, "layers": layers}

    # -------------------------------------------------------------- RPC methods

    def enable_kv_capture(self, max_finished: int = DEFAULT_MAX_FINISHED) -> bool:
        """Start snapshotting finished requests (keeps the newest ``max_finished``)."""
        state = self._kvcap_state()
        state["max_finished"] = int(max_finished)
        return True

    def get_kv_cache_config(self) -> dict:
        self._kvcap_state()
        runner = self.model_runner
        cfg = runner.kv_cache_config
        layers = self._kvcap_layers()
        ctx = runner.compilation_config.static_forward_context
        groups = []
        for group in cfg.kv_cache_groups:
            g = {"layer_names": list(group.layer_names), **_spec_dict(group.kv_cache_spec)}
            first = layers[group.layer_names[0]]
            if first.dim() != 4 or first.shape[-1] != 2 * g["head_size"]:
                raise RuntimeError(f"group of {group.layer_names[0]}: paged cache {tuple(first.shape)} is not the "
                                   "vLLM CPU layout [num_blocks, kv_head, block_size, 2*head_dim]")
            if first.shape[2] != g["block_size"]:
                raise RuntimeError(f"group of {group.layer_names[0]}: kernel block size {first.shape[2]} differs "
                                   f"from the manager's {g['block_size']}; not supported")
            if first.dtype == torch.uint8:  # FP8: layout maps + the scales the kernels get (extractors.vllm_fp8)
                from extractors.vllm_fp8 import fp8_group
                g.update(fp8_group(self, group, first, g, getattr(ctx[group.layer_names[0]], "isa", None)))
                groups.append(g)
                continue
            g["num_kv_heads"] = int(first.shape[1])
            isa = getattr(ctx[group.layer_names[0]], "isa", None)
            if isa is None:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
                isa = _get_attn_isa(first.dtype, g["block_size"], g["head_size"])
            k_index, v_index = derive_cpu_index_maps(first.dtype, g["block_size"], g["head_size"], isa)
            g["dtype"] = str(first.dtype).removeprefix("torch.")
            g["layout"] = {"name": "vllm_cpu", "isa": isa, "k_index": k_index, "v_index": v_index}
            groups.append(g)
        vcfg = self.vllm_config
        return {
            "num_blocks": int(cfg.num_blocks),
            "groups": groups,
            "layout": "vllm_cpu",
            "total_num_kv_heads": int(vcfg.model_config.get_total_num_kv_heads()),
            "tp_size": int(vcfg.parallel_config.tensor_parallel_size),
            "tp_rank": int(getattr(self, "rank", 0)),
            "pp_size": int(vcfg.parallel_config.pipeline_parallel_size),
            "dcp_size": int(getattr(vcfg.parallel_config, "decode_context_parallel_size", 1)),
            "kv_cache_dtype": str(vcfg.cache_config.cache_dtype),
            "hybrid_kv_cache_manager": not bool(vcfg.scheduler_config.disable_hybrid_kv_cache_manager),
        }

    def get_kv_caches(self, request_id: str | None = None, transport: str = "bytes") -> dict:
        if request_id is not None:
            return {k: _encode(v, transport) for k, v in self._kvcap_request(request_id)["layers"].items()}
        self._kvcap_state()
        return {k: _encode(v, transport) for k, v in self._kvcap_layers().items()}

    def get_block_tables(self, request_id: str | None = None, transport: str = "bytes") -> list:
        state = self._kvcap_state()
        if request_id is not None:
            req_id = self._kvcap_resolve(request_id)
            if req_id in state["finished"]:
                ids = state["finished"][req_id]["block_ids"]
            else:
                ids = self.model_runner.requests[req_id].block_ids
            return [_encode(torch.arange(len(g), dtype=torch.int64), transport) for g in ids]
        tables = self.model_runner.input_batch.block_table
        return [_encode(tables[i].get_cpu_tensor().clone(), transport)
                for i in range(len(self.model_runner.kv_cache_config.kv_cache_groups))]

    def get_kv_requests(self) -> dict:
        state = self._kvcap_state()
        out = {}
        for req_id, snap in state["finished"].items():
            out[req_id] = {"num_tokens": snap["num_tokens"], "finished": True,
                           "num_blocks": [len(b) for b in snap["block_ids"]]}
        for req_id, req in self.model_runner.requests.items():
            if req_id not in out:
                out[req_id] = {"num_tokens": self._kvcap_num_tokens(req_id), "finished": False,
                               "num_blocks": [len(b) for b in req.block_ids],
                               "row": self.model_runner.input_batch.req_id_to_index.get(req_id)}
        return out

    def get_request_kv(self, request_id: str, transport: str = "bytes") -> dict:
        """One request's KV blocks: ``layers`` + ``block_tables`` (per group) + ``num_tokens``.

        In-process (transport "tensor") a live request is answered with the whole cache tensors
        and its physical block ids, no copy (``full_cache`` True); otherwise with copies of its
        own blocks and tables renumbered 0..n-1.
        """
        state = self._kvcap_state()
        req_id = self._kvcap_resolve(request_id)
        if transport == "tensor" and req_id not in state["finished"]:
            block_ids = [list(ids) for ids in self.model_runner.requests[req_id].block_ids]
            return {"request_id": req_id, "finished": False, "num_tokens": self._kvcap_num_tokens(req_id),
                    "full_cache": True, "block_tables": block_ids, "physical_block_ids": block_ids,
                    "layers": self._kvcap_layers()}
        snap = self._kvcap_request(req_id)
        return {"request_id": snap["request_id"], "finished": snap["finished"], "num_tokens": snap["num_tokens"],
                "full_cache": False, "block_tables": [list(range(len(b))) for b in snap["block_ids"]],
                "physical_block_ids": snap["block_ids"],
                "layers": {k: _encode(v, transport) for k, v in snap["layers"].items()}}

    def clear_kv_snapshots(self) -> int:
        state = self._kvcap_state()
        n = len(state["finished"])
        state["finished"].clear()
        return n


# ---------------------------------------------------------------------------------- client side


def enable_vllm_kv_capture(llm, max_finished: int = DEFAULT_MAX_FINISHED) -> None:
    """Start snapshotting finishing requests on every worker, keeping the newest ``max_finished``
    (each snapshot holds a copy of the request's blocks in every layer: size it to memory)."""
    _rpc(llm, "enable_kv_capture", max_finished=int(max_finished))


def extract_vllm_kv_cache_config(llm) -> dict:
    """The KV cache config of rank 0 as a plain dict (see extractors.paged for the fields).

    Also starts block snapshotting on every worker, so call it before ``generate``.
    """
    configs = _rpc(llm, "get_kv_cache_config")
    cfg = configs[0]
    for r, other in enumerate(configs[1:], start=1):
        if [g["layer_names"] for g in other["groups"]] != [g["layer_names"] for g in cfg["groups"]]:
            raise RuntimeError(f"rank {r} reports KV cache groups that differ from rank 0's")
    return cfg


def _per_rank(results: list, kv_config: dict):
    tp = int(kv_config.get("tp_size", 1))
    if len(results) != tp:  # e.g. pipeline parallel: not supported
        raise RuntimeError(f"{len(results)} workers answered for tp_size={tp}; only TP is supported")
    return results[0] if tp == 1 else results


def extract_vllm_kv_caches(llm, kv_config: dict, request_id: str | None = None):
    """Paged KV ``{layer: [num_blocks, kv_head, block_size, 2*head_dim]}`` (a list per rank when TP > 1).

    request_id: None gives the whole paged cache; an id (the ``RequestOutput.request_id`` or
    the engine id with its suffix) gives only that request's blocks, live or snapshotted after
    it finished, to be read with ``extract_vllm_block_tables(llm, request_id)``.
    """
    transport = _transport(llm)
    results = _rpc(llm, "get_kv_caches", request_id=request_id, transport=transport)
    decoded = [{k: _decode(v) for k, v in r.items()} for r in results]
    return _per_rank(decoded, kv_config)


def extract_vllm_block_tables(llm, request_id: str | None = None) -> list[torch.Tensor]:
    """Block tables, one per KV cache group (rank 0's: the scheduler is shared).

    request_id None: the live batch rows, each ``[max_num_reqs, max_blocks]`` (row order is the
    worker's input batch; see ``extract_vllm_requests``). With a request id: ``[logical_block]``
    indexing the blocks ``extract_vllm_kv_caches(llm, cfg, request_id)`` returns.
    Starts block snapshotting on the first call (no cost before).
    """
    results = _rpc(llm, "get_block_tables", request_id=request_id, transport=_transport(llm))
    return [_decode(t).to(torch.int64) for t in results[0]]


def extract_vllm_requests(llm) -> dict:
    """``{engine request id: {"num_tokens", "finished", "num_blocks", ...}}`` known to rank 0."""
    return _rpc(llm, "get_kv_requests")[0]


def extract_vllm_request_kv(llm, kv_config: dict, request_id: str, seq_len: int | None = None) -> dict:
    """Contiguous KV of one request: ``{layer: (k, v)}`` each ``[1, kv_head, seq, head_dim]``.

    seq defaults to the tokens the engine computed for the request (prompt + generated - 1:
    the last sampled token is never fed back). Works after the request finished and its blocks
    were reused, provided capture was enabled before it finished.
    """
    return extract_vllm_batch_kv(llm, kv_config, [request_id], seq_len)


def extract_vllm_batch_kv(llm, kv_config: dict, request_ids: Sequence[str], seq_len: int | None = None) -> dict:
    """Contiguous KV of several requests: ``{layer: (k, v)}`` each ``[batch, kv_head, seq, head_dim]``.

    Rows follow ``request_ids``; each row holds that request's own computed tokens, rows
    shorter than the seq axis are NaN at the end. ``seq_len`` (optional) fixes the seq axis:
    longer rows are cut, shorter ones NaN-padded.
    """
    transport = _transport(llm)
    rows = []  # per request: per rank answers
    for rid in request_ids:
        rows.append(_rpc(llm, "get_request_kv", request_id=str(rid), transport=transport))
    lens = [int(r[0]["num_tokens"]) for r in rows]
    if min(lens) < 1:
        raise ValueError(f"requests {list(request_ids)} have {lens} computed tokens; nothing to read")
    per_rank = []
    n_ranks = len(rows[0])
    for rank in range(n_ranks):
        answers = [r[rank] for r in rows]
        fp8 = any(g.get("fp8") for g in kv_config["groups"])  # decode only the requests' own blocks
        if all(a.get("full_cache") for a in answers) and not fp8:  # in-process, all live: read the cache itself
            per_rank.append(answers[0]["layers"])
            tables = [[a["block_tables"][gi] for a in answers] for gi in range(len(kv_config["groups"]))]
            continue
        # Stack each request's own blocks; offset its renumbered table by the blocks before it.
        layers, tables = {}, [[] for _ in kv_config["groups"]]
        offsets = [0] * len(kv_config["groups"])
        group_of = {n: gi for gi, g in enumerate(kv_config["groups"]) for n in g["layer_names"]}
        for ans in answers:
            for gi, t in enumerate(ans["block_tables"]):
                tables[gi].append([offsets[gi] + j for j in range(len(t))])
                offsets[gi] += len(t)
            for name, blob in ans["layers"].items():
                x = _decode(blob)
                if ans.get("full_cache"):
                    x = x.index_select(0, torch.as_tensor(ans["block_tables"][group_of[name]], dtype=torch.int64))
                layers.setdefault(name, []).append(x)
        per_rank.append({name: (ts[0] if len(ts) == 1 else torch.cat(ts)) for name, ts in layers.items()})
    paged_kv = per_rank[0] if len(per_rank) == 1 else per_rank
    paged_kv = decode_paged_kv(paged_kv, kv_config)  # FP8 groups -> dequantized values (no-op otherwise)
    out = reconstruct_contiguous_kv_batch(paged_kv, kv_config, tables, lens, len(rows))
    if seq_len is not None:
        out = {name: (_fit_seq(k, seq_len), _fit_seq(v, seq_len)) for name, (k, v) in out.items()}
    return out


def _fit_seq(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut or NaN-pad the seq axis of [batch, kv_head, seq, head_dim] to seq_len."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if x.shape[2] >= seq_len:
        return x[:, :, :seq_len]
    pad = torch.full((*x.shape[:2], seq_len - x.shape[2], x.shape[3]), float("nan"), dtype=x.dtype)
    return torch.cat([x, pad], dim=2)


# ---------------------------------------------------------------------------------- logprobs


def _vocab_size(llm) -> int:
    return int(llm.llm_engine.model_config.get_vocab_size())


def _dense_logprobs(entries, positions: Sequence[int], vocab: int, where: str) -> torch.Tensor:
    """Full-vocab rows ``[len(positions), vocab]`` float32 from vLLM logprobs (flat or dicts)."""
    out = np.full((len(positions), vocab), -np.inf, dtype=np.float32)
    if hasattr(entries, "start_indices"):  # FlatLogprobs
        tok = np.asarray(entries.token_ids, dtype=np.int64)
        lp = np.asarray(entries.logprobs, dtype=np.float32)
        for i, p in enumerate(positions):
            s, e = entries.start_indices[p], entries.end_indices[p]
            if e - s < vocab:
                raise ValueError(f"{where}, position {p}: {e - s} logprobs for a vocab of {vocab}; build the "
                                 "engine with max_logprobs=-1")
            out[i, tok[s:e]] = lp[s:e]
    else:
        for i, p in enumerate(positions):
            d = entries[p]
            if d is None or len(d) < vocab:
                raise ValueError(f"{where}, position {p}: {0 if d is None else len(d)} logprobs for a vocab of "
                                 f"{vocab}; build the engine with max_logprobs=-1")
            out[i, np.fromiter(d.keys(), np.int64)] = np.fromiter((x.logprob for x in d.values()), np.float32)
    return torch.from_numpy(out)


def _sampling_params(**kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, detokenize=False, flat_logprobs=True, **kw)


def vllm_teacher_forced_logprobs(llm, prompts: Sequence[Sequence[int]], teacher_tokens: Sequence[Sequence[int]]):
    """Teacher-forced full-vocab log-softmax from vLLM in one prefill per prompt.

    At real vocabulary sizes use ``extractors.vllm_logits.vllm_teacher_forced_logits`` (raw
    logits from the worker): vLLM returns these logprobs as Python objects, ~4.5 GiB and 15 s
    per 1k-token prompt at a 32k vocabulary.

    Each prompt + its teacher tokens is fed as the prompt with ``prompt_logprobs=-1`` (the
    engine needs ``max_logprobs=-1``). Row i of a prompt's result is the distribution that
    predicts teacher token i (position ``len(prompt) + i - 1``), the same rows as HF logits for
    the generated positions. These are log-softmax values: they differ from raw logits by a
    per-token constant (the log partition function), which the logit metrics' shift removal
    (least-squares ``actual ~ a*expected + b``, subtract b) absorbs.

    Returns (logprobs: list of ``[teacher_token, vocab]`` float32, request_ids: list of str);
    the KV of each request then covers ``len(prompt) + len(teacher)`` tokens.
    """
    if len(prompts) != len(teacher_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(teacher_tokens)} teacher token lists")
    for i, (p, t) in enumerate(zip(prompts, teacher_tokens)):
        if len(p) < 1 or len(t) < 1:
            raise ValueError(f"prompt {i}: needs >= 1 prompt token and >= 1 teacher token, got {len(p)} and {len(t)}")
    vocab = _vocab_size(llm)
    params = _sampling_params(max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": [int(x) for x in p] + [int(x) for x in t]}
                         for p, t in zip(prompts, teacher_tokens)], params, use_tqdm=False)
    logprobs = []
    for i, (o, p, t) in enumerate(zip(outs, prompts, teacher_tokens)):
        positions = range(len(p), len(p) + len(t))
        logprobs.append(_dense_logprobs(o.prompt_logprobs, positions, vocab, f"prompt {i} (request {o.request_id})"))
    return logprobs, [o.request_id for o in outs]


def make_vllm_generate_fn(llm, num_tokens: int, prompt_lens: Sequence[int] | None = None,
                          return_sequences: bool = False):
    """A ``generate_fn`` for ``metrics.logits.logit_validation`` backed by vLLM.

    ``generate_fn(input_ids: list[list[int]]) -> [n_new, batch, vocab]`` float32 full-vocab
    log-softmax of vLLM's greedy continuation (``logprobs=-1``; the engine needs
    ``max_logprobs=-1``), EOS ignored so every row generates its count. The first call's row
    lengths are the original prompt lengths (or pass ``prompt_lens``); later calls carry the
    teacher tokens fed after a divergence, and generate ``n_new = num_tokens - fed`` tokens
    (the largest over rows; a row fed more returns surplus tokens, which the loop ignores).
    Log-softmax differs from logits by a per-token constant (the log partition function) that
    the logit metrics' shift removal absorbs. With ``return_sequences`` it returns
    ``(logprobs, tokens [batch, n_new])``, vLLM's own greedy tokens.

    ``generate_fn.request_ids`` / ``.token_ids`` hold the last call's request ids and tokens.
    """
    state = {"prompt_lens": list(prompt_lens) if prompt_lens is not None else None}
    vocab = _vocab_size(llm)

    def generate_fn(input_ids):
        rows = [[int(x) for x in (r.tolist() if hasattr(r, "tolist") else r)] for r in input_ids]
        if state["prompt_lens"] is None:
            state["prompt_lens"] = [len(r) for r in rows]
        if len(rows) != len(state["prompt_lens"]):
            raise ValueError(f"generate_fn: {len(rows)} rows, but the first call had {len(state['prompt_lens'])}")
        fed = [len(r) - p for r, p in zip(rows, state["prompt_lens"])]
        n_new = num_tokens - min(fed)
        if n_new < 1:
            raise ValueError(f"generate_fn: every row is >= {min(fed)} tokens past its prompt, nothing left of "
                             f"num_tokens={num_tokens}")
        params = _sampling_params(max_tokens=n_new, logprobs=-1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        out = torch.empty((n_new, len(rows), vocab), dtype=torch.float32)
        for b, o in enumerate(outs):
            out[:, b] = _dense_logprobs(o.outputs[0].logprobs, range(n_new), vocab, f"generate_fn row {b}")
        generate_fn.request_ids = [o.request_id for o in outs]
        generate_fn.token_ids = [list(o.outputs[0].token_ids) for o in outs]
        if return_sequences:
            return out, torch.tensor(generate_fn.token_ids, dtype=torch.int64)
        return out

    generate_fn.request_ids = []
    generate_fn.token_ids = []
    return generate_fn


def make_vllm_kv_extract_fn(llm, kv_config: dict, generate_fn):
    """``kv_extract_fn(seq_len) -> {layer: (k, v)}`` ``[batch, kv_head, seq_len, head_dim]`` of the
    requests of ``generate_fn``'s last call, row b from its position 0 (positions past a row's
    computed tokens, ``len(row) + n_new - 1``, are NaN; so are positions outside the window of
    SlidingWindowSpec layers)."""

    def kv_extract_fn(seq_len: int):
        if not generate_fn.request_ids:
            raise ValueError("kv_extract_fn called before generate_fn")
        return extract_vllm_batch_kv(llm, kv_config, generate_fn.request_ids, seq_len)

    return kv_extract_fn


# ---------------------------------------------------------------------------------- store


def _layer_order(names: Sequence[str]) -> list[str]:
    """Model order: 'layers.10' after 'layers.9'."""
    from metrics.kv import natural_sort_key

    return sorted(names, key=natural_sort_key)


def capture_vllm_run(store, llm, model_path, prompts: Sequence[Sequence[int]],
                     teacher_tokens: Sequence[Sequence[int]], *, mode: str = "decode", model_hash: str | None = None,
                     release: str | None = None, config: dict | None = None, kv: bool = True,
                     kv_config: dict | None = None, batch_size: int = 16, report: dict | None = None) -> str:
    """Teacher-forced vLLM capture of ``prompts`` into ``store``; returns the run id.

    mode "decode" (default): one pass per prompt through vLLM's decode path, the engine made to
    sample each teacher token; "prefill": prompt + teacher tokens as one prompt (prefill-only
    checks). See ``extractors.vllm_logits.vllm_teacher_forced_logits``.

    Per prompt: tokens = prompt + teacher tokens (the prompt id hashes the prompt alone); logits
    ``[teacher_token, vocab]`` = the raw logits (model dtype) predicting each teacher token, row
    i from position ``len(prompt) + i - 1``; KV ``[layer, kv_head, seq, head_dim]`` over prompt +
    teacher tokens, layers in model order, NaN outside the window of SlidingWindowSpec layers and,
    in decode mode, at the last teacher token (it is sampled, never fed back). The run records
    engine version, dtype, TP degree, block size, KV layout, in-block order (ISA), KV cache
    groups, ``logits_kind: "raw_logits"`` and the mode. Per prompt the engine's own greedy token of
    each row (the sampler's greedy op on the raw logits) is stored as tensor ``engine_greedy``
    ``[gen_token]`` int64 (phase "decode" or "prefill"), so divergences from the teacher stay
    visible. Prompts go through the engine ``batch_size`` at a time, so memory holds one batch's
    logits and KV. ``report`` (a dict, if given) receives ``diverged_at`` (per prompt, the first
    teacher index where the engine's greedy token differs, or None) and seconds spent in
    ``engine`` (generate + logits transfer), ``kv`` (KV extraction) and ``store`` (writes).
    """
    import time

    import vllm

    from capturestore.capture import begin_capture_run
    from extractors.vllm_logits import check_forcing_inputs, vllm_teacher_forced_logits

    if batch_size < 1:
        raise ValueError(f"capture_vllm_run: batch_size must be >= 1, got {batch_size}")
    if mode not in ("decode", "prefill"):
        raise ValueError(f"capture_vllm_run: mode must be 'decode' or 'prefill', got {mode!r}")
    mc = llm.llm_engine.model_config
    prompts, teacher_tokens = check_forcing_inputs(prompts, teacher_tokens, int(mc.get_vocab_size()),
                                                   int(mc.max_model_len), f"capture_vllm_run ({mode})")
    timings = report if report is not None else {}
    for key in ("engine", "kv", "store"):
        timings[key] = 0.0
    timings["diverged_at"] = []
    kv_config = kv_config or extract_vllm_kv_cache_config(llm)
    if kv:
        check_fp8_config_scales(llm, kv_config)  # an FP8 decode needs the scales the kernels hold now
    groups = kv_config["groups"]
    meta = {
        "block_size": groups[0]["block_size"] if len({g["block_size"] for g in groups}) == 1
        else [g["block_size"] for g in groups],
        "kv_layout": kv_config["layout"],
        "kv_isa": groups[0]["layout"].get("isa"),
        "kv_cache_dtype": kv_config.get("kv_cache_dtype"),
        "num_blocks": kv_config["num_blocks"],
        "hybrid_kv_cache_manager": kv_config.get("hybrid_kv_cache_manager"),
        "kv_cache_groups": [{k: g[k] for k in ("spec_type", "block_size", "sliding_window", "layer_names")}
                            for g in groups],
        "logits_kind": "raw_logits",
        "logits_layout": "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j; raw lm_head "
                         "output after the TP gather, before any sampler processing",
        "teacher_forced": True,
        "capture": f"teacher_forced_{mode}",
        "engine_greedy": "tensors/engine_greedy: [gen_token] int64, the engine's greedy token of each row",
        "enable_prefix_caching": bool(getattr(llm.llm_engine.vllm_config.cache_config, "enable_prefix_caching", False)),
        **(config or {}),
    }
    dtype = str(mc.dtype).removeprefix("torch.")
    engine_names = [n for g in groups for n in g["layer_names"]]
    if any(hf_kv_layer_name(n) != n for n in engine_names):  # stored under the references' names
        meta["kv_layer_names"] = {n: hf_kv_layer_name(n) for n in engine_names}
    run = begin_capture_run(store, engine="vllm", capture=meta["capture"], prompts=prompts,
                            layer_names=_layer_order([hf_kv_layer_name(n) for n in engine_names]) if kv else None,
                            logits_kind=meta["logits_kind"], config=meta, model_path=str(model_path),
                            model_hash=model_hash, dtype=dtype, device="cpu", engine_version=vllm.__version__,
                            tp_degree=int(kv_config.get("tp_size", 1)), release=release)
    with run:
        for lo in range(0, len(prompts), batch_size):
            batch_p, batch_t = prompts[lo:lo + batch_size], teacher_tokens[lo:lo + batch_size]
            t0 = time.perf_counter()
            forced = vllm_teacher_forced_logits(llm, batch_p, batch_t, mode=mode)
            timings["engine"] += time.perf_counter() - t0
            timings["diverged_at"].extend(forced.diverged_at)
            for i in range(len(batch_p)):
                t0 = time.perf_counter()
                pid = run.add_prompt(batch_p[i], continuation=batch_t[i])
                run.write_logits(pid, forced.logits[i])
                run.write_tensor(pid, "engine_greedy", forced.greedy[i], phase=mode, dims=["gen_token"])
                timings["store"] += time.perf_counter() - t0
                if kv:
                    t0 = time.perf_counter()
                    seq = len(batch_p[i]) + len(forced.teacher[i])
                    per_layer = extract_vllm_request_kv(llm, kv_config, forced.request_ids[i], seq_len=seq)
                    timings["kv"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    _write_request_kv(run, pid, per_layer, groups)
                    timings["store"] += time.perf_counter() - t0
        return run.run_id


def _write_request_kv(run, pid: str, per_layer: dict, groups: list) -> None:
    """``{layer: (k, v) [1, kv_head, seq, head_dim]}`` as one KV array in model layer order, or one
    per KV cache group when heads or head_dim differ between groups; layers under the HF names
    (``hf_kv_layer_name``)."""
    per_layer = {hf_kv_layer_name(n): kv for n, kv in per_layer.items()}
    groups = [{**g, "layer_names": [hf_kv_layer_name(n) for n in g["layer_names"]]} for g in groups]
    names = _layer_order(list(per_layer))
    shapes = {tuple(per_layer[n][0].shape) for n in names}
    if len(shapes) == 1:
        k = torch.cat([per_layer[n][0] for n in names])  # [layer, kv_head, seq, head_dim]
        v = torch.cat([per_layer[n][1] for n in names])
        run.write_kv(pid, k, v, layer_names=names)
        return
    for gi, g in enumerate(groups):
        gn = _layer_order(g["layer_names"])
        run.write_kv(pid, torch.cat([per_layer[n][0] for n in gn]),
                     torch.cat([per_layer[n][1] for n in gn]), layer_names=gn, group=f"g{gi}")
