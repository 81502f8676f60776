"""RunWriter: writes one run's arrays, then commits its table rows in one step.

Commit protocol (what makes a SIGKILL at any point safe):
1. ``begin_run`` creates ``pending/<run_id>.json`` already locked (flock; written under a temp
   name, locked, renamed), then the run's Zarr group. The lock is released by the kernel when
   the writer dies, which is how ``gc`` tells a dead writer from a live one.
2. Arrays are written (streamed appends are buffered to whole chunks).
3. ``commit`` flushes the last partial chunks, writes the ``prompts`` and ``captures``
   segments, and last the ``runs`` segment: the commit marker. Catalog views only show rows
   of runs that have a ``runs`` row, so no catalog row ever points at missing data.
4. The pending file is removed.

The store does the storage side (``Store._pending_lock``, ``_write_block``, ``_write_segment``,
...): on a directory as above; on object storage (objectstore.py) with a heartbeat lease
instead of the flock and single PUTs instead of renames, in the same order (docs/scale.md).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import zarr

from capturestore.arrays import CODEC_NAMES, ArrayRef, create_array, create_group
from capturestore.chunkio import wait_all
from capturestore.dtypes import (
    FLOAT_DTYPES,
    LOGICAL_DTYPES,
    LogicalDtype,
    check_dtype,
    to_numpy,
    to_storage,
)
from capturestore.layout import (
    ARRAYS_DIR,
    POSITION_DIM,
    TENSOR_GROUPS,
    check_component,
    check_module_name,
    run_format_version,
    tensor_chunks,
    token_chunk,
)
from capturestore.tables import CAPTURES_SCHEMA, PROMPTS_SCHEMA, RUN_TABLES, RUNS_SCHEMA

if TYPE_CHECKING:
    from capturestore.store import Store

KV_DIMS = ["layer", "kv_head", POSITION_DIM, "head_dim"]
STREAM_BUFFER_BYTES = 64 << 20  # K + V staging of one streamed prompt: peak RSS stays flat
# A one-shot KV layer up to this size is one chunk: a contiguous slice of the caller's
# [layer, kv_head, seq, head_dim] array (compressed without a gather copy) and half the chunk
# files of ~4 MiB token blocks. benchmarks/bench_store.py: ~15-25% less CPU per written byte.
KV_LAYER_CHUNK_BYTES = 8 << 20
LOGITS_DIMS = ["gen_token", "vocab"]
TOKENS_DIMS = [POSITION_DIM]  # KV and tokens share it: xarray aligns them
_INT32_MAX = np.iinfo(np.int32).max


def prompt_id(token_ids: Any) -> str:
    """Stable id of a prompt: a hash of its integer token ids (same tokens => same id anywhere)."""
    ids = _check_token_ids(token_ids, "prompt_id")
    return hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:16]


def _check_token_ids(token_ids: Any, where: str) -> np.ndarray:
    """token_ids: [token] integers in [0, 2**31) -> int32 array; ValueError otherwise."""
    arr = to_numpy(token_ids, f"{where}: token_ids")
    if arr.dtype == object or arr.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{where}: token ids must be a non-empty 1-d sequence [token], got shape {arr.shape}")
    if arr.min() < 0 or arr.max() > _INT32_MAX:
        raise ValueError(f"{where}: token ids must lie in [0, 2**31), got min {arr.min()} max {arr.max()}")
    return arr.astype(np.int32)


def _normalise_dtype_name(dtype: Any, where: str) -> str:
    """Logical float dtype name from a name, a numpy/ml_dtypes dtype or a torch dtype."""
    if isinstance(dtype, str) or type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{where}: dtype {dtype} is not supported; supported: {', '.join(FLOAT_DTYPES)}")
    return name


@dataclass
class _Buffer:
    """Whole-chunk staging area for a streamed array growing along ``axis``."""

    axis: int
    data: np.ndarray  # storage dtype, chunk-sized along axis
    fill: int = 0
    pending: list = field(default_factory=list)  # chunk writes still reading ``data``


@dataclass
class _ArrayState:
    ref: ArrayRef
    live: zarr.Array | None  # the open array; None once parked (``park``), reopened when needed
    kind: str
    ld: LogicalDtype
    dims: list[str]
    kv_group: str | None = None
    module: str | None = None
    phase: str | None = None
    steps: list[int] = field(default_factory=list)
    layer_names: list[str] | None = None
    length: int = 0  # rows flushed along the growing axis (streamed arrays)
    buffer: _Buffer | None = None
    layers_written: set[int] | None = None  # for create_kv + write_kv_layer
    steps_stored: int = 0  # how many of ``steps`` the array's attributes already hold
    # {chunk key: bytes} of every chunk file, while all were written here (None: ask the store)
    chunk_bytes: dict[str, int] | None = field(default_factory=dict)
    zstore: Any = None  # where a parked array is reopened
    modules: list[str] | None = None  # a tensor group's modules, by index (write_tensor_group)
    module_dims: list[str] | None = None  # and the dims of each module's step
    parked: tuple | None = None  # (shape, chunks) of a parked array

    @property
    def arr(self) -> zarr.Array:
        if self.live is None:
            self.live = zarr.open_array(store=self.zstore, path=self.ref.path, mode="r+")
            self.parked = None
        return self.live

    def park(self) -> None:
        """Drop the open ``zarr.Array`` of an array written whole (its metadata and codec objects,
        ~3 KB of Python objects each: 3.3 of the 6.5 MiB an 8-prompt module run held before its
        commit), keeping its shape and chunks for the catalogue; a later append reopens it."""
        if self.live is not None:
            self.parked = (tuple(self.live.shape), tuple(self.live.chunks))
            self.live = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parked[0] if self.parked is not None else tuple(self.arr.shape)

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.parked[1] if self.parked is not None else tuple(self.arr.chunks)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.buffer is not None:
            shape[self.buffer.axis] = self.length + self.buffer.fill
        return tuple(shape)


class RunWriter:
    """Writes one run. Use as a context manager (commit on success, abort on exception)."""

    def __init__(self, store: Store, run_id: str, meta: dict[str, Any], chunk_tokens: int | None = None,
                 durable: bool = False, compression: str | None = "lz4"):
        self.store = store
        self.durable = durable
        self.compression = compression
        self.run_id = run_id
        self._meta = meta
        self._chunk_tokens = chunk_tokens
        self._created_at = datetime.now(timezone.utc)
        self._prompts: dict[str, dict[str, Any]] = {}
        self._arrays: dict[tuple[str, str], _ArrayState] = {}
        # (prompt, tensors/<module>/<phase>) -> (its group array's state, the module's index there)
        self._grouped: dict[tuple[str, str], tuple[_ArrayState, int]] = {}
        self._group_count: dict[tuple[str, str], int] = {}  # (prompt, phase) -> its group arrays so far
        self._kv_geometry: dict[str, tuple] = {}  # group -> (layers, kv_heads, head_dim, dtype, names)
        self._logits_geometry: tuple[int, str] | None = None  # (vocab, dtype)
        self._closed = False
        self._dirs = store._made_dirs()  # directories of this run's arrays, made once each
        self._lock = store._pending_lock(run_id, {"run_id": run_id, "started_at": self._created_at.isoformat(),
                                                  "status": "running"})  # pending/<run_id>.json, locked
        create_group(store._zstore, run_id, {"run_id": run_id}, self._dirs)

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"run {self.run_id} is already committed or aborted")

    def record_config(self, **entries: Any) -> None:
        """Add ``entries`` to the run config before the commit, for what a capture learns only as
        it runs (e.g. the batches it formed); a key the config already has is refused, so what
        ``begin_run`` recorded is never rewritten."""
        self._check_open()
        config = json.loads(self._meta["config"])
        again = sorted(set(entries) & set(config))
        if again:
            raise ValueError(f"run {self.run_id}: record_config: the run config already has {again}")
        try:
            self._meta = {**self._meta, "config": json.dumps({**config, **entries}, sort_keys=True)}
        except (TypeError, ValueError) as e:
            raise ValueError(f"run {self.run_id}: record_config: entries must be JSON-serialisable ({e})") from None

    @property
    def prompt_ids(self) -> list[str]:
        return list(self._prompts)

    def abort(self) -> None:
        """Drop everything this run wrote; nothing of it is catalogued."""
        if self._closed:
            return
        self._closed = True
        for st in self._arrays.values():  # queued chunk writes must land before the rmtree
            if st.buffer is not None:
                try:
                    wait_all(st.buffer.pending)
                except Exception:  # noqa: BLE001 - the run is being dropped anyway
                    pass
        try:
            self._lock.rewrite({"run_id": self.run_id, "status": "aborted"})
            for t in ("prompts", "captures"):
                self.store._remove_segment(t, self.run_id)
            self.store._remove_run_arrays(self.run_id)
        finally:
            self._lock.release()

    def commit(self) -> None:
        """Flush the arrays, then commit prompts, captures and (last) runs segments."""
        self._check_open()
        self._check_complete()
        for st in self._arrays.values():
            self._finalise(st)
        store = self.store
        if self.durable:  # arrays on disk before any row that points at them
            store._sync_run_arrays(self.run_id)
        d = self.durable
        store._write_segment("prompts", self._prompts_table(), segment=self.run_id, durable=d)
        store._write_segment("captures", self._captures_table(), segment=self.run_id, durable=d)
        try:
            store._write_segment("runs", self._runs_table(), segment=self.run_id, durable=d)  # the commit marker
        finally:
            if store._segment_exists("runs", self.run_id):  # in place: committed, even if a later fsync failed,
                self._closed = True  # so __exit__'s abort() must not delete what the marker points at
                store._release_writer_lock(self._lock)  # held on while an invocation may still roll it back
                self.store._committed.add(self.run_id)
        store._after_commit(RUN_TABLES)  # committed: the run's tables compacted when due

    def _check_complete(self) -> None:
        for (pid, name), st in self._arrays.items():
            where = f"run {self.run_id}, prompt {pid}, array {name}: commit"
            if st.kind == "logits":
                self._check_logit_rows(pid, st.logical_shape[0], where)
            elif st.kind in ("kv_k", "kv_v"):
                self._check_kv_seq(pid, st.logical_shape[2], where)
            if st.layers_written is not None:
                n = st.arr.shape[0]
                missing = sorted(set(range(n)) - st.layers_written)
                if missing:
                    raise ValueError(
                        f"run {self.run_id}, prompt {pid}, array {name}: layers {missing} were created "
                        "with create_kv but never written with write_kv_layer"
                    )

    # ---- prompts ---------------------------------------------------------------------------
    def add_prompt(self, token_ids: Any, text: str | None = None, continuation: Any = None) -> str:
        """Register a prompt and write its tokens int32 [token]; returns its prompt_id.

        The prompt_id hashes the prompt alone, so one prompt lines up across runs whatever was
        generated after it. ``continuation``: the teacher / generated tokens captured after the
        prompt; the ``tokens`` array then holds prompt + continuation (the positions of the KV
        and the rows of the logits), and the prompts table records ``n_prompt_tokens``.
        """
        self._check_open()
        where = f"run {self.run_id}: add_prompt"
        ids = _check_token_ids(token_ids, where)
        pid = prompt_id(ids)
        seq = ids
        if continuation is not None and len(continuation):
            seq = np.concatenate([ids, _check_token_ids(continuation, f"{where} continuation")])
        if pid in self._prompts:
            if not np.array_equal(self._prompts[pid]["tokens"], seq):
                raise ValueError(f"{where}: prompt {pid} was already added with another continuation")
            return pid
        if text is not None and not isinstance(text, str):
            raise ValueError(f"run {self.run_id}: add_prompt text must be a str, got {type(text).__name__}")
        if self._logits_geometry is not None:
            self._check_vocab(pid, seq, self._logits_geometry[0], where)
        create_group(self.store._zstore, f"{self.run_id}/{pid}", {"prompt_id": pid}, self._dirs)
        ld = LOGICAL_DTYPES["int32"]
        st = self._new_array(pid, "tokens", "tokens", ld, seq.shape, (max(1, min(seq.size, 1 << 20)),), TOKENS_DIMS,
                             {"n_prompt_tokens": int(ids.size)})
        self._write(st, seq)
        self._prompts[pid] = {"idx": len(self._prompts), "tokens": seq, "n_prompt": int(ids.size), "text": text}
        return pid

    def _check_prompt(self, pid: str, what: str) -> None:
        self._check_open()
        if pid not in self._prompts:
            raise ValueError(f"run {self.run_id}: {what}: prompt {pid!r} was not added to this run (add_prompt first)")

    # Documented conventions (docs/tables.md): tokens = prompt + continuation; logits row j
    # predicts continuation token j (one row per continuation token); KV seq index = position
    # (one per token). Anything else would be stored and later compared against wrong positions.
    def _counts(self, pid: str) -> str:
        p = self._prompts[pid]
        n, n_prompt = int(p["tokens"].size), p["n_prompt"]
        return f"{n} tokens = prompt {n_prompt} + continuation {n - n_prompt}"

    def _check_logit_rows(self, pid: str, rows: int, where: str, partial: bool = False) -> None:
        p = self._prompts[pid]
        n_cont = int(p["tokens"].size) - p["n_prompt"]
        if rows > n_cont or (not partial and rows != n_cont):
            raise ValueError(
                f"{where}: {rows} logits rows{' so far' if partial else ''} but the prompt holds {self._counts(pid)}; "
                f"logits [gen_token, vocab] hold one row per continuation token (row j predicts continuation "
                f"token j; pass the teacher/generated tokens to add_prompt(..., continuation=...))"
            )

    def _check_kv_seq(self, pid: str, seq: int, where: str, partial: bool = False) -> None:
        n = int(self._prompts[pid]["tokens"].size)
        if seq > n or (not partial and seq != n):
            raise ValueError(
                f"{where}: KV seq {seq}{' so far' if partial else ''} but the prompt holds {self._counts(pid)}; "
                f"KV [layer, kv_head, seq, head_dim] holds one position per token (NaN where a position was not "
                f"written)"
            )

    def _check_vocab(self, pid: str, tokens: np.ndarray, vocab: int, where: str) -> None:
        bad = np.flatnonzero(tokens >= vocab)
        if bad.size:
            raise ValueError(
                f"{where}: token id {int(tokens[bad[0]])} at position {int(bad[0])} of prompt {pid} is >= the vocab "
                f"size {vocab} (the logits width); {bad.size} token(s) out of range"
            )

    # ---- generic array plumbing -----------------------------------------------------------
    def _new_array(self, pid: str, name: str, kind: str, ld: LogicalDtype, shape: tuple[int, ...],
                   chunks: tuple[int, ...], dims: list[str], attrs: dict[str, Any], one_shot: bool = False,
                   **state: Any) -> _ArrayState:
        if (pid, name) in self._arrays:
            raise ValueError(f"run {self.run_id}, prompt {pid}: array {name} was already written")
        ref = ArrayRef(self.run_id, pid, name)
        attributes = {"logical_dtype": ld.name, "kind": kind, "run_id": self.run_id, "prompt_id": pid, **attrs}
        shape = tuple(int(s) for s in shape)
        # arrays written whole in one call may be sharded where the store wants few objects (objectstore.py)
        shards = self.store._shard_shape(shape, chunks, ld.storage.itemsize) if one_shot else None
        arr = create_array(self.store._zstore, ref, shape, ld.storage, chunks, dims, attributes,
                           compression=self.compression, shards=shards, dirs=self._dirs,
                           separator=self.store._chunk_separator)
        st = _ArrayState(ref=ref, live=arr, kind=kind, ld=ld, dims=dims, zstore=self.store._zstore, **state)
        self._arrays[(pid, name)] = st
        return st

    def _write(self, st: _ArrayState, block: np.ndarray, offset: tuple[int, ...] | None = None,
               pending: list | None = None) -> None:
        """Write ``block`` (storage dtype) at ``offset`` (default: origin) of the array; with
        ``pending``, queue the chunk writes and collect their futures there."""
        offset = offset or (0,) * block.ndim
        sizes = st.chunk_bytes if pending is None else None
        if pending is not None:  # sizes known only once the queued writes are done
            st.chunk_bytes = None
        if not self.store._write_block(st.ref, st.arr, block, offset, self.compression is not None, pending,
                                       self._dirs, sizes):
            st.chunk_bytes = None
            st.arr[tuple(slice(o, o + n) for o, n in zip(offset, block.shape))] = block  # unaligned: zarr

    def _tokens_per_chunk(self, bytes_per_token: int, known_len: int | None) -> int:
        if self._chunk_tokens is not None:
            return max(1, self._chunk_tokens if known_len is None else min(self._chunk_tokens, max(1, known_len)))
        return token_chunk(bytes_per_token, known_len)

    def _append_rows(self, st: _ArrayState, bits: np.ndarray) -> None:
        """Stage ``bits`` (storage dtype) along the buffer axis, flushing whole chunks."""
        buf = st.buffer
        assert buf is not None
        ax = buf.axis
        cap = buf.data.shape[ax]
        n = bits.shape[ax]
        done = 0
        while done < n:
            if buf.fill == 0 and buf.pending:  # the last flush may still be reading the buffer
                wait_all(buf.pending)
            take = min(cap - buf.fill, n - done)
            dst = [slice(None)] * bits.ndim
            dst[ax] = slice(buf.fill, buf.fill + take)
            src = [slice(None)] * bits.ndim
            src[ax] = slice(done, done + take)
            buf.data[tuple(dst)] = bits[tuple(src)]
            buf.fill += take
            done += take
            if buf.fill == cap:
                self._flush(st)

    def _flush(self, st: _ArrayState) -> None:
        buf = st.buffer
        if buf is None or buf.fill == 0:
            return
        ax = buf.axis
        new_shape = list(st.arr.shape)
        new_shape[ax] = st.length + buf.fill
        st.arr.resize(tuple(new_shape))
        region = [slice(None)] * len(new_shape)
        region[ax] = slice(st.length, st.length + buf.fill)
        src = [slice(None)] * len(new_shape)
        src[ax] = slice(0, buf.fill)
        offset = [0] * len(new_shape)
        offset[ax] = st.length
        self._write(st, buf.data[tuple(src)], tuple(offset), pending=buf.pending)
        st.length += buf.fill
        buf.fill = 0

    def _finalise(self, st: _ArrayState) -> None:
        if st.buffer is not None:
            self._flush(st)
            wait_all(st.buffer.pending)
            st.buffer = None
        if st.kind == "tensor" and len(st.steps) != st.steps_stored:  # steps appended after creation
            st.arr.update_attributes({"steps": st.steps})

    # ---- logits ----------------------------------------------------------------------------
    def _check_logits(self, pid: str, x: Any, what: str, allow_1d: bool) -> tuple[np.ndarray, LogicalDtype]:
        self._check_prompt(pid, what)
        where = f"run {self.run_id}, prompt {pid}: {what}"
        arr = to_numpy(x, where)
        if allow_1d and arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2:
            raise ValueError(f"{where}: logits must be [gen_token, vocab], got shape {arr.shape}")
        ld = check_dtype(arr, where, FLOAT_DTYPES)
        if self._logits_geometry is not None:
            vocab, dt = self._logits_geometry
            if (arr.shape[1], ld.name) != (vocab, dt):
                raise ValueError(
                    f"{where}: logits [gen_token, vocab={arr.shape[1]}] {ld.name} disagree with what run "
                    f"{self.run_id} already holds (vocab={vocab}, {dt})"
                )
        else:  # the vocab becomes known: every prompt of the run must fit it
            for other, p in self._prompts.items():
                self._check_vocab(other, p["tokens"], arr.shape[1], where)
        return arr, ld

    def write_logits(self, pid: str, logits: Any) -> None:
        """logits: [gen_token, vocab], written in one go: one row per continuation token."""
        arr, ld = self._check_logits(pid, logits, "write_logits", allow_1d=False)
        if (pid, "logits") not in self._arrays:
            self._check_logit_rows(pid, arr.shape[0], f"run {self.run_id}, prompt {pid}: write_logits")
        t = self._tokens_per_chunk(arr.shape[1] * ld.storage.itemsize, arr.shape[0])
        st = self._new_array(pid, "logits", "logits", ld, arr.shape, (t, arr.shape[1]), LOGITS_DIMS, {}, one_shot=True)
        self._write(st, to_storage(np.ascontiguousarray(arr), ld))
        self._logits_geometry = (arr.shape[1], ld.name)

    def append_logits(self, pid: str, step_logits: Any) -> None:
        """step_logits: [n, vocab] (or [vocab]) for the next n decode steps."""
        arr, ld = self._check_logits(pid, step_logits, "append_logits", allow_1d=True)
        st = self._arrays.get((pid, "logits"))
        if st is None:
            self._check_logit_rows(pid, arr.shape[0], f"run {self.run_id}, prompt {pid}: append_logits", partial=True)
            t = self._tokens_per_chunk(arr.shape[1] * ld.storage.itemsize, None)
            st = self._new_array(pid, "logits", "logits", ld, (0, arr.shape[1]), (t, arr.shape[1]), LOGITS_DIMS, {})
            st.buffer = _Buffer(axis=0, data=np.empty((t, arr.shape[1]), ld.storage))
            self._logits_geometry = (arr.shape[1], ld.name)
        elif st.buffer is None:
            raise ValueError(f"run {self.run_id}, prompt {pid}: append_logits after write_logits; logits already written")
        self._check_logit_rows(pid, st.length + st.buffer.fill + arr.shape[0],
                               f"run {self.run_id}, prompt {pid}: append_logits", partial=True)
        self._append_rows(st, to_storage(arr, ld))

    # ---- KV --------------------------------------------------------------------------------
    def _kv_names(self, group: str | None) -> tuple[str, str, str]:
        if group is None:
            return "kv_k", "kv_v", ""
        check_component(group, "kv group")
        return f"kv_k_{group}", f"kv_v_{group}", group

    def _check_kv_geometry(self, pid: str, what: str, group: str, n_layers: int, kv_heads: int,
                           head_dim: int, ld: LogicalDtype, layer_names: list[str]) -> None:
        geo = (n_layers, kv_heads, head_dim, ld.name, tuple(layer_names))
        held = self._kv_geometry.get(group)
        if held is not None and held != geo:
            raise ValueError(
                f"run {self.run_id}, prompt {pid}: {what}: KV [layer={n_layers}, kv_head={kv_heads}, "
                f"head_dim={head_dim}] {ld.name} layers {list(layer_names)[:4]}... disagree with what the run "
                f"already holds{' in group ' + group if group else ''}: [layer={held[0]}, kv_head={held[1]}, "
                f"head_dim={held[2]}] {held[3]} layers {list(held[4])[:4]}..."
            )

    @staticmethod
    def _layer_names(layer_names: Any, n_layers: int, where: str) -> list[str]:
        if layer_names is None:
            return [str(i) for i in range(n_layers)]
        names = [str(n) for n in layer_names]
        if len(names) != n_layers:
            raise ValueError(f"{where}: {len(names)} layer_names for {n_layers} layers")
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: layer_names are not unique: {names}")
        return names

    def _kv_pair(self, pid: str, k: Any, v: Any, where: str, ndim: int, dims_doc: str) -> tuple[np.ndarray, np.ndarray, LogicalDtype]:
        ka = to_numpy(k, f"{where}: k")
        va = to_numpy(v, f"{where}: v")
        if ka.ndim != ndim or va.ndim != ndim:
            raise ValueError(f"{where}: k and v must be {dims_doc}, got k {ka.shape}, v {va.shape}")
        if ka.shape != va.shape:
            raise ValueError(f"{where}: k {ka.shape} and v {va.shape} differ in shape")
        ld = check_dtype(ka, f"{where}: k", FLOAT_DTYPES)
        if va.dtype != ka.dtype:
            raise ValueError(f"{where}: k is {ka.dtype} but v is {va.dtype}")
        return ka, va, ld

    def _kv_chunks(self, kv_heads: int, head_dim: int, ld: LogicalDtype, seq: int | None) -> tuple[int, int, int, int]:
        """Chunk of K or V [layer, kv_head, seq, head_dim]: one layer by a block of tokens;
        a whole layer when the length is known and the layer holds <= KV_LAYER_CHUNK_BYTES."""
        per_token = kv_heads * head_dim * ld.storage.itemsize
        if self._chunk_tokens is None and seq is not None and seq * per_token <= KV_LAYER_CHUNK_BYTES:
            return (1, kv_heads, max(1, seq), head_dim)
        t = self._tokens_per_chunk(per_token, seq)
        return (1, kv_heads, t, head_dim)

    def _create_kv_arrays(self, pid: str, group: str | None, shape: tuple[int, int, int, int], ld: LogicalDtype,
                          names: list[str], chunks: tuple[int, ...], one_shot: bool = False,
                          **state: Any) -> tuple[_ArrayState, _ArrayState]:
        kname, vname, g = self._kv_names(group)
        for n in (kname, vname):
            if (pid, n) in self._arrays:
                raise ValueError(f"run {self.run_id}, prompt {pid}: array {n} was already written")
        attrs = {"layer_names": names, "kv_group": g}
        sk = self._new_array(pid, kname, "kv_k", ld, shape, chunks, KV_DIMS, attrs, one_shot, kv_group=g,
                             layer_names=names, **state)
        state = {k: (set() if isinstance(v, set) else v) for k, v in state.items()}
        sv = self._new_array(pid, vname, "kv_v", ld, shape, chunks, KV_DIMS, attrs, one_shot, kv_group=g,
                             layer_names=names, **state)
        self._kv_geometry[g] = (shape[0], shape[1], shape[3], ld.name, tuple(names))
        return sk, sv

    def write_kv(self, pid: str, k: Any, v: Any, layer_names: Any = None, group: str | None = None) -> None:
        """k, v: [layer, kv_head, seq, head_dim], written in one go."""
        self._check_prompt(pid, "write_kv")
        where = f"run {self.run_id}, prompt {pid}: write_kv"
        ka, va, ld = self._kv_pair(pid, k, v, where, 4, "[layer, kv_head, seq, head_dim]")
        L, H, S, D = ka.shape
        names = self._layer_names(layer_names, L, where)
        g = self._kv_names(group)[2]
        self._check_kv_geometry(pid, "write_kv", g, L, H, D, ld, names)
        self._check_kv_seq(pid, S, where)
        sk, sv = self._create_kv_arrays(pid, group, ka.shape, ld, names, self._kv_chunks(H, D, ld, S), one_shot=True)
        pending: list = []  # K and V chunks encode together
        self._write(sk, to_storage(np.ascontiguousarray(ka), ld), pending=pending)
        self._write(sv, to_storage(np.ascontiguousarray(va), ld), pending=pending)
        wait_all(pending)

    def create_kv(self, pid: str, layer_names: Any, num_kv_heads: int, seq_len: int, head_dim: int,
                  dtype: Any, group: str | None = None) -> None:
        """Create empty K and V [layer, kv_head, seq, head_dim] to be filled by write_kv_layer."""
        self._check_prompt(pid, "create_kv")
        where = f"run {self.run_id}, prompt {pid}: create_kv"
        if isinstance(layer_names, int):
            layer_names = None if layer_names < 0 else [str(i) for i in range(layer_names)]
        if layer_names is None or len(layer_names) == 0:
            raise ValueError(f"{where}: layer_names must name at least one layer (or be the layer count)")
        for what, val in (("num_kv_heads", num_kv_heads), ("seq_len", seq_len), ("head_dim", head_dim)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{where}: {what} must be a positive integer, got {val!r}")
        self._check_kv_seq(pid, int(seq_len), where)
        ld = LOGICAL_DTYPES[_normalise_dtype_name(dtype, where)]
        names = self._layer_names(layer_names, len(layer_names), where)
        g = self._kv_names(group)[2]
        self._check_kv_geometry(pid, "create_kv", g, len(names), int(num_kv_heads), int(head_dim), ld, names)
        shape = (len(names), int(num_kv_heads), int(seq_len), int(head_dim))
        self._create_kv_arrays(pid, group, shape, ld, names, self._kv_chunks(shape[1], shape[3], ld, shape[2]),
                               layers_written=set())

    def write_kv_layer(self, pid: str, layer: int | str, k: Any, v: Any, group: str | None = None) -> None:
        """k, v: [kv_head, seq, head_dim] of one layer (by index or name) of a create_kv array."""
        self._check_prompt(pid, "write_kv_layer")
        where = f"run {self.run_id}, prompt {pid}: write_kv_layer {layer!r}"
        kname, vname, _ = self._kv_names(group)
        sk, sv = self._arrays.get((pid, kname)), self._arrays.get((pid, vname))
        if sk is None or sk.layers_written is None:
            raise ValueError(f"{where}: call create_kv for this prompt first")
        idx = self._layer_index(layer, sk.layer_names or [], where)
        ka, va, ld = self._kv_pair(pid, k, v, where, 3, "[kv_head, seq, head_dim]")
        expect = tuple(sk.arr.shape[1:])
        if ka.shape != expect or ld.name != sk.ld.name:
            raise ValueError(f"{where}: got [kv_head, seq, head_dim] {ka.shape} {ld.name}, "
                             f"the run holds {expect} {sk.ld.name} for this prompt")
        self._write(sk, to_storage(np.ascontiguousarray(ka), ld)[None], (idx, 0, 0, 0))
        self._write(sv, to_storage(np.ascontiguousarray(va), ld)[None], (idx, 0, 0, 0))
        sk.layers_written.add(idx)
        sv.layers_written.add(idx)

    @staticmethod
    def _layer_index(layer: int | str, names: list[str], where: str) -> int:
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            if not 0 <= int(layer) < len(names):
                raise ValueError(f"{where}: layer index out of range [0, {len(names)})")
            return int(layer)
        if isinstance(layer, str) and layer in names:
            return names.index(layer)
        raise ValueError(f"{where}: unknown layer; layers are {names[:8]}{'...' if len(names) > 8 else ''}")

    def append_kv(self, pid: str, k_step: Any, v_step: Any, layer_names: Any = None, group: str | None = None) -> None:
        """k_step, v_step: [layer, kv_head, n, head_dim] (or [layer, kv_head, head_dim]) for n more tokens."""
        self._check_prompt(pid, "append_kv")
        where = f"run {self.run_id}, prompt {pid}: append_kv"
        ka, va = to_numpy(k_step, f"{where}: k"), to_numpy(v_step, f"{where}: v")
        if ka.ndim == 3:
            ka = ka[:, :, None, :]
        if va.ndim == 3:
            va = va[:, :, None, :]
        ka, va, ld = self._kv_pair(pid, ka, va, where, 4, "[layer, kv_head, n, head_dim]")
        L, H, n_new, D = ka.shape
        kname, vname, g = self._kv_names(group)
        sk = self._arrays.get((pid, kname))
        if sk is None:
            names = self._layer_names(layer_names, L, where)
            self._check_kv_geometry(pid, "append_kv", g, L, H, D, ld, names)
            self._check_kv_seq(pid, n_new, where, partial=True)
            chunks = self._kv_chunks(H, D, ld, None)
            if self._chunk_tokens is None:  # staging holds one chunk per layer for K and V: bound it
                chunks = (1, H, stream_chunk_tokens(chunks[2], 2 * L * H * D * ld.storage.itemsize), D)
            sk, sv = self._create_kv_arrays(pid, group, (L, H, 0, D), ld, names, chunks)
            for st in (sk, sv):
                st.buffer = _Buffer(axis=2, data=np.empty((L, H, chunks[2], D), ld.storage))
        else:
            sv = self._arrays[(pid, vname)]
            if sk.buffer is None:
                raise ValueError(f"{where}: KV of this prompt was written with write_kv/create_kv, not appendable")
            held = (sk.arr.shape[0], sk.arr.shape[1], sk.arr.shape[3], sk.ld.name)
            if (L, H, D, ld.name) != held:
                raise ValueError(f"{where}: step [layer={L}, kv_head={H}, head_dim={D}] {ld.name} disagrees with "
                                 f"what the run holds [layer={held[0]}, kv_head={held[1]}, head_dim={held[2]}] {held[3]}")
            self._check_kv_seq(pid, sk.length + sk.buffer.fill + n_new, where, partial=True)
        self._append_rows(sk, to_storage(ka, ld))
        self._append_rows(sv, to_storage(va, ld))

    # ---- module tensors --------------------------------------------------------------------
    def write_tensor(self, pid: str, module: str, array: Any, step: int = 0, phase: str = "prefill",
                     dims: list[str] | None = None) -> None:
        """array: one step of a module's tensor, stored as ``tensors/<module>/<phase>`` [step, ...].

        ``dims`` names the array's own axes (default ``<module>.dim<i>``); steps of one
        (module, phase) must share shape and dtype. Written step by step, an array holds one
        step per chunk; ``write_tensor_steps`` puts many steps into each chunk.
        """
        where = f"run {self.run_id}, prompt {pid}: write_tensor {module} ({phase}, step {step})"
        arr = to_numpy(array, where)
        self.write_tensor_steps(pid, module, arr[None], [step], phase, dims, where=where)

    def write_tensor_steps(self, pid: str, module: str, array: Any, steps: Any, phase: str = "decode",
                           dims: list[str] | None = None, where: str | None = None) -> None:
        """array: ``[len(steps), ...]``, several steps of one module at once (as ``write_tensor``
        step by step, in one write). A new array written this way holds up to
        ``layout.TARGET_CHUNK_BYTES`` of steps per chunk (``layout.tensor_chunks``): a capture's
        decode steps of one module and prompt are one chunk file, not one per step."""
        self._check_prompt(pid, "write_tensor")
        check_module_name(module)
        check_component(phase, "phase")
        where = where or f"run {self.run_id}, prompt {pid}: write_tensor_steps {module} ({phase})"
        arr = to_numpy(array, where)
        steps = list(steps)
        if arr.ndim < 1 or arr.shape[0] != len(steps) or not steps:
            raise ValueError(f"{where}: {len(steps)} steps for an array of shape {arr.shape} ([step, ...] expected)")
        steps = _step_numbers(steps, where)  # all checked before any is written
        if len(set(steps)) != len(steps):
            raise ValueError(f"{where}: steps {steps} repeat a step")
        ld = check_dtype(arr, where)
        name = f"tensors/{module}/{phase}"
        if (pid, name) in self._grouped:
            raise ValueError(f"{where}: module {module} ({phase}) was already written in a tensor group")
        st = self._arrays.get((pid, name))
        bits = to_storage(np.ascontiguousarray(arr), ld)
        if st is None:
            one = arr.shape[1:]
            if dims is not None and len(dims) != len(one):
                raise ValueError(f"{where}: {len(dims)} dims for an array of shape {one}")
            own = list(dims) if dims is not None else [f"{module}.dim{i}" for i in range(len(one))]
            chunks = self._step_chunks(one, len(steps), ld)
            # created at its final shape with its steps: no resize, no attribute rewrite at commit
            st = self._new_array(pid, name, "tensor", ld, arr.shape, chunks, ["step", *own],
                                 {"module": module, "phase": phase, "steps": steps}, module=module, phase=phase,
                                 steps=list(steps))
            st.steps_stored = len(steps)
            self._write(st, bits)
            st.park()  # written whole: the run keeps its shape, not the open array
            return
        if tuple(st.arr.shape[1:]) != arr.shape[1:] or st.ld.name != ld.name:
            raise ValueError(f"{where}: shape {arr.shape[1:]} {ld.name} disagrees with earlier steps of this "
                             f"module/phase in the run: {tuple(st.arr.shape[1:])} {st.ld.name}")
        again = sorted(set(steps) & set(st.steps))
        if again:
            raise ValueError(f"{where}: step {again[0]} was already written")
        n = st.arr.shape[0]
        st.arr.resize((n + len(steps), *arr.shape[1:]))
        self._write(st, bits, (n,) + (0,) * (arr.ndim - 1))
        st.steps.extend(steps)

    def _step_chunks(self, one: tuple[int, ...], n_steps: int, ld: LogicalDtype) -> tuple[int, ...]:
        """Chunk of a module tensor ``[step, *one]`` written ``n_steps`` at a time: its token axis
        (``one[0]``) in blocks of about TARGET_CHUNK_BYTES, as many steps as fit (``layout.tensor_chunks``);
        one step a chunk with ``chunk_tokens`` set."""
        row_bytes = math.prod(one[1:]) * ld.storage.itemsize if len(one) else 0
        rest = list(one)
        if len(one) >= 1:
            rest[0] = self._tokens_per_chunk(max(1, row_bytes), max(1, one[0]))
        rest = [max(1, c) for c in rest]
        return tensor_chunks(n_steps, rest, ld.storage.itemsize) if self._chunk_tokens is None else (1, *rest)

    def write_tensor_group(self, pid: str, phase: str, modules: list[str], arrays: list[Any], steps: Any,
                           dims: list[str] | None = None) -> None:
        """Several modules' tensors of one phase as one array ``tensor_groups/<phase>_<k>``
        ``[module, step, ...]`` (store format 6, layout.py): ``arrays[i]`` is module ``modules[i]``'s
        ``[len(steps), ...]``, all of one shape and dtype. Read back per module exactly as
        ``write_tensor_steps`` writes them (``Store.read_tensor``), and catalogued one row per module;
        each module's steps are their own chunk(s), so reading one module reads no other's bytes.
        What it saves is per-array metadata: a directory, a zarr.json and a group per module."""
        self._check_prompt(pid, "write_tensor_group")
        check_component(phase, "phase")
        where = f"run {self.run_id}, prompt {pid}: write_tensor_group ({phase})"
        if not self.store.grouped_tensors:
            raise ValueError(f"{where}: store {self.store.root} is of a format before grouped module tensors (6), "
                             "which the capturestore versions sharing it would not read; write_tensor_steps per "
                             "module, or raise the store with `capturestore upgrade`")
        modules = [check_module_name(m) for m in modules]
        if not modules or len(arrays) != len(modules):
            raise ValueError(f"{where}: {len(arrays)} arrays for {len(modules)} modules (one each, at least one)")
        if len(set(modules)) != len(modules):
            raise ValueError(f"{where}: modules {sorted(m for m in set(modules) if modules.count(m) > 1)} repeat")
        steps = _step_numbers(steps, where)
        if not steps or len(set(steps)) != len(steps):
            raise ValueError(f"{where}: steps {steps} must be one or more, none repeated")
        parts, ld = [], None
        for m, a in zip(modules, arrays):
            w = f"{where}: module {m}"
            x = to_numpy(a, w)
            got = check_dtype(x, w)
            if x.ndim < 1 or x.shape[0] != len(steps):
                raise ValueError(f"{w}: {len(steps)} steps for an array of shape {x.shape} ([step, ...] expected)")
            if parts and (x.shape != parts[0].shape or got.name != ld.name):
                raise ValueError(f"{w}: shape {x.shape} {got.name} disagrees with module {modules[0]}'s "
                                 f"{parts[0].shape} {ld.name} (one group holds one shape and dtype)")
            name = f"tensors/{m}/{phase}"
            if (pid, name) in self._arrays or (pid, name) in self._grouped:
                raise ValueError(f"{w}: already written for this prompt and phase")
            parts.append(x)
            ld = got
        one = parts[0].shape[1:]
        if dims is not None and len(dims) != len(one):
            raise ValueError(f"{where}: {len(dims)} dims for an array of shape {one}")
        k = self._group_count.get((pid, phase), 0)
        self._group_count[(pid, phase)] = k + 1
        step_chunks = self._step_chunks(one, len(steps), ld)
        own = list(dims) if dims is not None else [f"dim{i}" for i in range(len(one))]
        st = self._new_array(pid, f"{TENSOR_GROUPS}/{phase}_{k}", "tensor_group", ld, (len(modules), len(steps), *one),
                             (1, *step_chunks), ["module", "step", *own],
                             {"phase": phase, "steps": steps, "modules": modules}, one_shot=True,
                             phase=phase, steps=list(steps))
        st.steps_stored = len(steps)
        st.modules = modules
        st.module_dims = own
        if st.arr.shards is not None:  # a shard holds several modules: written whole, once
            self._write(st, np.stack([to_storage(np.ascontiguousarray(x), ld) for x in parts]))
        else:
            origin = (0,) * len(one)
            for i, x in enumerate(parts):
                self._write(st, to_storage(np.ascontiguousarray(x), ld)[None], (i, 0, *origin))
        st.park()
        for i, m in enumerate(modules):
            self._grouped[(pid, f"tensors/{m}/{phase}")] = (st, i)

    # ---- table rows ------------------------------------------------------------------------
    def _prompts_table(self) -> pa.Table:
        rows = [{"run_id": self.run_id, "prompt_id": pid, "prompt_idx": p["idx"], "n_tokens": int(p["tokens"].size),
                 "n_prompt_tokens": p["n_prompt"], "text": p["text"], "token_ids": p["tokens"].tolist()} for pid, p in self._prompts.items()]
        return pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA)

    def _captures_table(self) -> pa.Table:
        rows = []
        for (pid, name), st in self._arrays.items():
            shape = [int(s) for s in st.shape]
            if st.kind == "tensor_group":  # its modules' bytes, each from its own chunks
                per = _group_stored_bytes(st, self.store)
                stored = sum(per)
            else:
                stored = (sum(st.chunk_bytes.values()) if st.chunk_bytes is not None
                          else self.store._stored_bytes(st.ref, self.store._chunk_separator))
            row = {
                "run_id": self.run_id, "prompt_id": pid, "array_name": name, "kind": st.kind,
                "kv_group": st.kv_group, "module": st.module, "phase": st.phase,
                "steps": st.steps if st.kind == "tensor" else None,
                "shape": shape, "dimension_names": st.dims, "chunks": [int(c) for c in st.chunks],
                "dtype": st.ld.name, "storage_dtype": st.ld.storage.name, "codec": CODEC_NAMES[self.compression],
                "nbytes": math.prod(shape) * st.ld.numpy.itemsize, "stored_bytes": stored,
                "layer_names": st.layer_names, "path": f"{ARRAYS_DIR}/{st.ref.path}", "group_index": None,
            }
            if st.kind != "tensor_group":
                rows.append(row)
                continue
            # one row per module, as its own array would have (the group itself has none)
            for i, m in enumerate(st.modules):
                rows.append({**row, "array_name": f"tensors/{m}/{st.phase}", "kind": "tensor", "module": m,
                             "steps": st.steps, "shape": shape[1:], "dimension_names": ["step", *st.module_dims],
                             "chunks": row["chunks"][1:], "nbytes": row["nbytes"] // len(st.modules),
                             "stored_bytes": per[i], "group_index": i})
        return pa.Table.from_pylist(rows, schema=CAPTURES_SCHEMA)

    def _runs_table(self) -> pa.Table:
        m = self._meta
        row = {**m, "run_id": self.run_id, "status": "complete", "n_prompts": len(self._prompts),
               "created_at": self._created_at, "committed_at": datetime.now(timezone.utc),
               "hostname": socket.gethostname(), "pid": os.getpid(),
               "format_version": run_format_version(self.store._chunk_separator, bool(self._grouped))}
        return pa.Table.from_pylist([row], schema=RUNS_SCHEMA)


def _step_numbers(steps: Any, where: str) -> list[int]:
    """``steps`` as ints, each a non-negative integer (a bool is none)."""
    steps = list(steps)
    for s in steps:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 0:
            raise ValueError(f"{where}: step must be a non-negative integer, got {s!r}")
    return [int(s) for s in steps]


def _group_stored_bytes(st: _ArrayState, store: Store) -> list[int]:
    """The stored bytes of each module of a group array, from the sizes of its own chunks (a chunk
    holds one module's steps, ``write_tensor_group``): as written here, else listed once (zarr wrote
    them, on object storage). A sharded group (a shard holds several modules): its objects' bytes
    shared evenly."""
    from capturestore.store import chunk_objects

    n, sep, sizes = len(st.modules), store._chunk_separator, st.chunk_bytes  # sizes kept: no shards
    if sizes is None:
        base = f"{ARRAYS_DIR}/{st.ref.path}"
        sizes = {k[len(base) + 1:]: v for k, v in chunk_objects(store.backend, base, sep).items()}
        if st.arr.shards is not None:
            total = sum(sizes.values())
            return [total // n + (1 if i < total % n else 0) for i in range(n)]
    per = [0] * n
    for key, size in sizes.items():
        per[int(key.split(sep)[1])] += size
    return per


def stream_chunk_tokens(tokens: int, staged_bytes_per_token: int) -> int:
    """Tokens per chunk of a streamed array, so its staging buffers stay within
    STREAM_BUFFER_BYTES (a power of two, at least 16 tokens)."""
    cap = max(16, STREAM_BUFFER_BYTES // max(1, staged_bytes_per_token))
    cap = 1 << int(np.log2(cap))
    return max(1, min(tokens, cap))


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + os.urandom(4).hex()


def check_label(label: str, what: str) -> str:
    """A label printed on one line (a release): ValueError when it holds a line break or another
    control character, which would let a label print a line of its own (``FAKE overall: PASS``)."""
    import unicodedata

    bad = next((c for c in label if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"{what} {label!r} holds a control character or line break ({bad!r}); give a one-line label")
    return label


def run_meta(engine: str, model_path: str, model_hash: str | None, dtype: str, device: str,
             engine_version: str | None, tp_degree: int, release: str | None, config: Any) -> dict[str, Any]:
    """Validated metadata of a run; ValueError naming the bad field."""
    for what, val in (("engine", engine), ("model_path", model_path), ("dtype", dtype), ("device", device)):
        if not isinstance(val, str) or not val:
            raise ValueError(f"begin_run: {what} must be a non-empty string, got {val!r}")
    for what, val in (("model_hash", model_hash), ("engine_version", engine_version), ("release", release)):
        if val is not None and not isinstance(val, str):
            raise ValueError(f"begin_run: {what} must be a string or None, got {val!r}")
    if release is not None:
        check_label(release, "begin_run: release")
    if not isinstance(tp_degree, (int, np.integer)) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ValueError(f"begin_run: tp_degree must be a positive integer, got {tp_degree!r}")
    try:
        config_json = json.dumps(config if config is not None else {}, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"begin_run: config must be JSON-serialisable ({e})") from None
    return {"engine": engine, "engine_version": engine_version, "model_path": str(model_path),
            "model_hash": model_hash, "dtype": dtype, "device": device, "tp_degree": int(tp_degree),
            "release": release, "config": config_json}
