"""Store: open a capture store directory, begin runs, read captures, query the catalog."""
from __future__ import annotations

import contextlib

import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from capturestore import catalog, integrity
from capturestore.arrays import ArrayRef, bad_chunks, check_compression, read_metadata, separator_of
from capturestore.chunkio import MadeDirs, read_region, write_block
from capturestore.compaction import LOCK_PREFIX as COMPACTION_LOCK_PREFIX
from capturestore.compaction import SOURCE_COLUMN, ListingChanged, coverage, is_merged, logical_names
from capturestore.dtypes import LOGICAL_DTYPES, from_storage
from capturestore.errors import FormatVersionError, StoreError, WriterIdTaken
from capturestore.layout import (
    ARRAYS_DIR,
    DOT_KEYS_FORMAT_VERSION,
    FORMAT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPED_TENSORS_FORMAT_VERSION,
    PENDING_DIR,
    READABLE_FORMAT_VERSION,
    TABLES_DIR,
    TENSOR_GROUPS,
    check_component,
    check_module_name,
    check_table_name,
    is_chunk_name,
    key_separator,
    separator_for,
)
from capturestore.tables import (
    RUN_TABLES,
    SCHEMA_SEGMENT,
    SCHEMAS,
    SegmentSchemas,
    ensure_schema_segments,
    read_checked,
    rows_to_table,
    segment_bytes,
)
from capturestore.writer import RunWriter, new_run_id, run_meta

if TYPE_CHECKING:
    from capturestore.backends import Backend


def parse_format(text: str, p: Any) -> dict[str, Any]:
    """The format file's content checked; StoreError naming ``p`` otherwise."""
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(f"{p}: unreadable format file ({e})") from None
    version = info.get("format_version") if isinstance(info, dict) else None
    if (not isinstance(info, dict) or info.get("format") != FORMAT_NAME or not isinstance(version, int)
            or isinstance(version, bool) or version < 1):
        raise StoreError(f"{p}: not a capturestore format file: {info!r}")
    return info


def expand_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` with ``~`` expanded; ValueError naming ``what`` for '~user' of no user, and for an
    empty path (never the working directory: ``Path("")`` is ".")."""
    if not os.fspath(path).strip():
        raise ValueError(f"{what} is empty; give a path")
    try:
        return Path(path).expanduser()
    except RuntimeError as e:  # Path.expanduser: "Could not determine home directory."
        raise ValueError(f"{what} {os.fspath(path)}: {e}") from None


def store_root(path: str | os.PathLike) -> Path:
    """The absolute directory ``path`` names (``~`` expanded); StoreError for '~user' of no user."""
    try:
        root = expand_path(path, "store path").resolve()
    except ValueError as e:
        raise StoreError(str(e)) from None
    if "\\" in str(root):  # DuckDB's file globs read '\' as a path separator: no query could find the tables
        raise StoreError(f"store path {root}: a backslash in the path cannot be read by DuckDB; move the store "
                         f"to a path without one")
    return root


_LAYOUT_ENTRIES = {ARRAYS_DIR, TABLES_DIR, PENDING_DIR, "catalog.duckdb", "catalog.stamp", "catalog.root"}


def _read_format(b: Backend) -> dict[str, Any] | None:
    """The store's format file checked (``parse_format``), None where there is none; StoreError in
    one line naming the file where it cannot be read."""
    try:
        raw = b.read(FORMAT_FILE)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - one line naming the file
        raise (b.explain(e) or StoreError(f"{b.where(FORMAT_FILE)}: unreadable format file ({e})")) from None
    return parse_format(raw.decode(errors="replace"), b.where(FORMAT_FILE))


def _is_layout_entry(name: str) -> bool:
    """Entries a store creation leaves, so a creation cut short (or racing another) resumes."""
    return name in _LAYOUT_ENTRIES or name.startswith(".")


def _plain_name(name: Any) -> bool:
    """A str that names one directory entry (no separator, not '', '.' or '..')."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name


# prompts whose group index a Store keeps (``Store._tensor_groups``): a comparison's three roles of
# many prompts, read prompt by prompt or role by role (a tuple a module, a zarr.json a group array)
_GROUP_INDEXES_KEPT = 64


class Store:
    """A capture store: a directory, ``s3://bucket/prefix`` or ``memory://name``. Open with
    ``Store.open(path)``. Every method is written once over its ``backend`` (backends.py), which
    holds the bytes and the medium's commit protocol."""

    def __init__(self, backend: Backend | Path):
        from capturestore.backends import Backend, LocalBackend

        if not isinstance(backend, Backend):
            backend = LocalBackend(Path(backend))
        self.backend = backend
        self.root = backend.root  # a Path for a directory, the URL otherwise
        self._zstore = backend.zarr_store(ARRAYS_DIR)
        # the chunk key separator of the arrays this store's writers make (layout.separator_for of
        # the store's format version, set by open); readers take each array's from its zarr.json
        self._chunk_separator = "/"
        # whether this store's module captures group a prompt's module tensors (format 6, set by open)
        self.grouped_tensors = False
        self._committed: set[str] = set()
        self._con = None  # in-memory DuckDB connection with the catalog views, made on first sql()
        self._con_views: dict[str, tuple] = {}  # table -> the listings its view was built from
        self._con_broken: dict[str, str] = {}  # table -> why its segments cannot be read
        self._con_tables: list[str] = []  # the tables under tables/ at the last listing (Store.sql)
        self._footers: dict = {}  # (table, merged segment) -> its footer (compaction.MergedSegment)
        self._auto_compact_left: dict[str, int] = {}  # table -> segments an automatic compaction left
        self._auto_compact_held: list[str] | None = None  # tables committed while held (auto_compaction_held)
        self._held_locks: list = []  # writer locks of runs committed while held, released as it ends
        self._con_pid = -1
        self._con_lock = threading.Lock()
        self._segment_schemas: dict[str, SegmentSchemas] = {}  # table -> its segments' column types
        self.shard_bytes = backend.shard_bytes  # arrays written whole go into shards of this size
        # where every read is a round trip, what never changes (a committed run's segments and
        # array metadata) is read once per Store
        self._cache = backend.path is None
        self._run_segments: dict[tuple[str, str], pa.Table] = {}
        self._array_meta: dict[str, dict] = {}
        # (run, prompt) -> its grouped module tensors {(module, phase): (array, its metadata, index)},
        # of the last prompts read (a committed run's arrays never change)
        self._groups: OrderedDict[tuple[str, str], dict] = OrderedDict()
        self._groups_lock = threading.Lock()

    # ---- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, create: bool = True) -> Store:
        """Open (and by default create) the store at ``path``; refuses a newer format version.

        ``path``: a directory (or ``file://`` URL), ``s3://bucket/prefix`` for a store on
        object storage (objectstore.py; endpoint and credentials from the AWS_* variables), or
        ``memory://name`` for one in this process's memory (backends.backend_for)."""
        from capturestore.backends import backend_for

        b = backend_for(path)
        b.check()  # unreachable, no bucket, credentials refused: one line, before anything is written
        info = _read_format(b)
        if info is None:
            if not create:
                raise StoreError(f"{b.url} is not a capture store (no {FORMAT_FILE}); Store.open(path, create=True) "
                                 f"makes a new one")
            # the format file too: a concurrent creation may have finished since the read above
            why = b.refuse_creation([n for n in b.listdir("") if not _is_layout_entry(n) and n != FORMAT_FILE])
            if why:
                raise StoreError(why)
            cls._create_layout(b)
            info = _read_format(b)  # as written: by this creation, or by a concurrent one that came first
            if info is None:
                raise StoreError(f"{b.where(FORMAT_FILE)}: written, then not found (removed meanwhile?)")
        if info["format_version"] > READABLE_FORMAT_VERSION:
            raise FormatVersionError(
                f"store {b.url} has format version {info['format_version']}, newer than the {READABLE_FORMAT_VERSION} "
                f"this capturestore reads; upgrade capturestore to open it"
            )
        from capturestore.compaction import auto_compact_segments

        auto_compact_segments()  # a bad $CAPTURESTORE_AUTO_COMPACT: one line now, not a warning at each commit
        store = cls(b)
        store._chunk_separator = separator_for(info["format_version"])
        store.grouped_tensors = info["format_version"] >= GROUPED_TENSORS_FORMAT_VERSION
        store._committed = store.committed_ids()
        try:
            b.refresh_catalog()  # only when catalog.stamp is out of date
        except Exception:  # noqa: BLE001 - the file catalog is a convenience; queries never need it
            pass
        return store

    @staticmethod
    def _create_layout(b: Backend) -> None:
        """Every step may race another creation or resume one cut short; the format file goes last."""
        b.makedirs([ARRAYS_DIR, TABLES_DIR, PENDING_DIR])
        try:
            zarr.open_group(store=b.zarr_store(ARRAYS_DIR), mode="a", zarr_format=3)
        except zarr.errors.ContainsGroupError:  # a concurrent creation made it between zarr's check and write
            pass
        for name, schema in SCHEMAS.items():
            try:
                b.put(f"{TABLES_DIR}/{name}/{SCHEMA_SEGMENT}", segment_bytes(schema.empty_table()), if_absent=True)
            except FileExistsError:
                pass
        try:  # written last: a half-created store is not a store
            b.put(FORMAT_FILE, (json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION}, indent=2)
                                + "\n").encode(), if_absent=True)
        except FileExistsError:  # a concurrent creation made it first
            pass

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def __reduce__(self):  # picklable (multiprocessing, Dask): reopen by path or URL in the other process
        return (Store.open, (str(self.root), False))

    # ---- storage, through the backend ---------------------------------------------------------
    def committed_ids(self) -> set[str]:
        """Run ids committed now (read from the store, not cached): those with a runs segment, the
        commit marker (segments are named after their run; a runs segment merged by ``compact``
        still counts: compaction.logical_names)."""
        # the footers of merged segments are kept (never replaced): Store.open's read serves Store.sql
        for attempt in range(4):
            try:
                return {n.removesuffix(".parquet") for n in logical_names(self.backend, "runs", footers=self._footers)}
            except ListingChanged:  # a merged segment merged again and removed since the listing: list again
                if attempt == 3:
                    raise
        raise AssertionError("unreachable")

    def _pending_lock(self, writer_id: str, info: dict[str, Any]):
        """``pending/<writer_id>.json``, held until ``release()`` (the backend's liveness says so)."""
        return self.backend.writer_lock(writer_id, info)

    def _write_block(self, ref: ArrayRef, arr: zarr.Array, block: np.ndarray, offset: tuple[int, ...],
                     compressed: bool, pending: list | None, dirs: MadeDirs | None = None,
                     sizes: dict[str, int] | None = None) -> bool:
        """Write chunk-aligned ``block`` straight to the chunk files of a directory; False: left to
        zarr (``arr[...] = block``: one PUT per chunk on object storage). ``dirs``: the writer's
        ``MadeDirs`` under ``_zstore``'s root (``_made_dirs``); ``sizes``: as ``chunkio.write_block``."""
        if self.backend.path is None or (isinstance(arr, zarr.Array) and arr.shards is not None):
            return False  # a shard holds many chunks and their index: zarr writes it (``arr.chunks`` are inner chunks)
        return write_block(f"{self.backend.path}/{ARRAYS_DIR}/{ref.path}", tuple(arr.shape), tuple(arr.chunks), block,
                           offset, compressed=compressed, pending=pending, dirs=dirs, sizes=sizes,
                           sep=separator_of(arr))

    def _made_dirs(self) -> MadeDirs | None:
        """A fresh ``MadeDirs`` for one writer of a directory store (None on object storage)."""
        return None if self.backend.path is None else MadeDirs(self.backend.path / ARRAYS_DIR)

    def _shard_shape(self, shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
        """Shard shape of an array written whole (None: one object per chunk)."""
        from capturestore.backends import shard_shape

        return shard_shape(shape, chunks, itemsize, self.shard_bytes)

    def _write_segment(self, table: str, data: pa.Table, segment: str | None = None, durable: bool = False) -> Any:
        """One Parquet segment of ``table``, whole or not at all and never replacing one; a Path
        on a directory, the object key otherwise."""
        b = self.backend
        if segment is None:
            segment = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        rel = f"{TABLES_DIR}/{table}/{segment}.parquet"
        if table == "runs" and not b.exists(f"{PENDING_DIR}/{segment}.json"):
            # the marker would point at what gc may be removing: a writer stalled past its lease
            raise StoreError(f"{self.root}: run {segment} lost its lease (stalled longer than "
                             f"{getattr(b, 'lease_s', 0):g} s, $CAPTURESTORE_LEASE_S); gc may have removed its "
                             f"arrays, so it is not committed")
        try:
            b.put(rel, segment_bytes(data), if_absent=table in RUN_TABLES or b.path is None, durable=durable)
        except FileExistsError:
            raise StoreError(f"{self.root}: segment {rel} already exists; segments are never replaced") from None
        return b.path / rel if b.path is not None else rel

    def _segment_exists(self, table: str, segment: str) -> bool:
        return self.backend.exists(f"{TABLES_DIR}/{table}/{segment}.parquet")

    def _remove_segment(self, table: str, segment: str) -> None:
        self.backend.remove([f"{TABLES_DIR}/{table}/{segment}.parquet"])

    def remove_written(self, segment: Any) -> None:
        """Remove a segment ``append_table`` wrote (what it returned), e.g. of a comparison or an
        invocation that failed before its commit marker."""
        if isinstance(segment, Path):
            segment = segment.relative_to(self.backend.path).as_posix()
        self.backend.remove([segment])

    def remove_if_empty(self) -> bool:
        """Remove the whole store, on any backend, when it holds nothing: no committed run, no
        writer pending, no segment of any table beyond the empty schema segments of its layout (a
        store that one failed invocation created). True when removed."""
        if self.committed_ids() or self.pending():
            return False
        if any(rel.endswith(".parquet") and rel.rsplit("/", 1)[-1][:1] not in ("_", ".")
               for rel in self.backend.find(TABLES_DIR)):
            return False
        self.backend.remove_tree("")
        return True

    # ---- segments as bytes: what comparison manifests are checked against (integrity.evidence_problems)
    def segment_names(self, table: str) -> list[str]:
        """File names of ``table``'s segments."""
        return self.backend.segment_names(table)

    def read_segment(self, table: str, name: str) -> bytes:
        """The bytes of one segment of ``table``."""
        return self.backend.read(f"{TABLES_DIR}/{table}/{name}")

    def segment_comparison_ids(self, table: str, name: str) -> set[str] | None:
        """Comparison ids of one segment's rows (None: it has no ``comparison_id`` column)."""
        from capturestore.tables import segment_comparison_ids

        return segment_comparison_ids(self.read_segment(table, name))

    def check_evidence(self, comparison_ids, command: str = "check") -> None:
        """StoreError naming comparison, table and segment when any of ``comparison_ids`` lacks
        evidence its manifest lists, or has rows no manifest lists (integrity.evidence_problems)."""
        integrity.check_evidence(self, comparison_ids, command)

    def _committed_comparison_ids(self) -> set[str] | None:
        return integrity.committed_comparisons(self.backend)

    def _refresh_catalog(self) -> None:
        self.backend.refresh_catalog()

    def _remove_run_arrays(self, run_id: str) -> None:
        self.backend.remove_tree(f"{ARRAYS_DIR}/{run_id}")

    def _sync_run_arrays(self, run_id: str) -> None:
        self.backend.sync_tree(f"{ARRAYS_DIR}/{run_id}")

    def _stored_bytes(self, ref: ArrayRef, sep: str) -> int:
        return sum(chunk_objects(self.backend, f"{ARRAYS_DIR}/{ref.path}", sep).values())

    # ---- writing ---------------------------------------------------------------------------
    def begin_run(self, engine: str, model_path: str, model_hash: str | None = None, dtype: str = "bfloat16",
                  device: str = "cpu", engine_version: str | None = None, tp_degree: int = 1,
                  release: str | None = None, config: Any = None, chunk_tokens: int | None = None,
                  durable: bool = False, compression: str | None = "lz4") -> RunWriter:
        """Start a run; write through the returned RunWriter, then commit (or use ``with``).

        ``chunk_tokens`` overrides the tokens per chunk (default: about 4 MiB per chunk;
        a one-shot KV layer of up to 8 MiB is stored as one chunk).
        ``durable``: commit fsyncs the run's arrays and segments, so a committed run also
        survives power loss (a crashed process never loses committed data either way).
        ``compression``: "lz4" (blosc lz4 + bitshuffle) or None (checksum only, for CPU-bound
        writers); readers handle either.
        """
        meta = run_meta(engine, str(model_path), model_hash, dtype, device, engine_version, tp_degree, release, config)
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            raise ValueError(f"begin_run: chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        check_compression(compression)
        return RunWriter(self, new_run_id(), meta, chunk_tokens=chunk_tokens, durable=bool(durable),
                         compression=compression)

    def append_table(self, name: str, rows: Any) -> Path:
        """Append rows (pyarrow.Table | list[dict] | dict of columns) as one atomically committed
        Parquet segment of table ``name``; a catalog view ``name`` shows all its segments.
        Returns the segment written (a path here, an object key on object storage)."""
        check_table_name(name)
        if name in RUN_TABLES:
            raise ValueError(f"append_table: {name!r} is written by runs only; pick another table name")
        table = rows_to_table(rows, f"append_table {name}")
        if table.num_rows == 0:
            raise ValueError(f"append_table {name}: no rows to append")
        if name != "comparisons" and "comparison_id" in table.column_names:
            self._check_comparison_rows(name, table.column("comparison_id").unique().to_pylist())
        self._check_segment_types(name, table)
        is_new = name not in self.backend.listdir(TABLES_DIR)
        path = self._write_segment(name, table)
        if is_new:
            try:
                self._refresh_catalog()
            except Exception:  # noqa: BLE001 - the file catalog catches up on the next open
                pass
        if name != "comparisons" and "comparison_id" not in table.column_names:
            self._after_commit([name])  # a comparison's tables: when its marker is written (PendingComparison)
        return path

    def _check_comparison_rows(self, table: str, comparison_ids) -> None:
        """Refuse rows whose ``comparison_id`` is NULL or names a comparison that is neither committed
        nor being written (a live writer, as ``commit_comparison`` holds): such rows would be
        invisible in every view and removed by ``gc``, i.e. lost; and rows of a committed
        comparison, whose evidence its manifest sealed."""
        ids = set(comparison_ids)
        if None in ids:
            raise ValueError(f"append_table {table}: a comparison_id is NULL; rows with a comparison_id column belong "
                             f"to a comparison (see docs/tables.md) - name the column otherwise for rows of no "
                             f"comparison")
        alive = self.backend.liveness()
        open_ids = sorted(c for c in ids if not alive(c))
        if open_ids:
            committed = self._committed_comparison_ids() or set()
            orphans = [c for c in open_ids if c not in committed]
            if orphans:
                raise ValueError(f"append_table {table}: comparison_id {orphans[0]!r} is no committed comparison and "
                                 f"none is being written; its rows would be invisible and removed by gc (write them "
                                 f"through integrity.commit_comparison, or name the column otherwise)")
        integrity.check_sealed(self, table, open_ids)

    def _check_segment_types(self, name: str, table: pa.Table) -> None:
        self._segment_schemas.setdefault(name, SegmentSchemas()).check(self.backend, name, table)

    # ---- reading ---------------------------------------------------------------------------
    def _require_run(self, run_id: str) -> None:
        if not isinstance(run_id, str):
            raise ValueError(f"run id must be a string, got {run_id!r}")
        if run_id in self._committed:
            return
        self._committed = self.committed_ids()
        if run_id not in self._committed:
            known = sorted(self._committed)[-5:]
            raise ValueError(f"unknown run id {run_id!r} in store {self.root} (latest committed runs: {known})")

    def _ref(self, run_id: str, prompt_id: str, name: str) -> tuple[ArrayRef, dict[str, Any]]:
        """The array's ref and its zarr.json metadata; ValueError for an unknown run/prompt/array."""
        self._require_run(run_id)
        if not isinstance(prompt_id, str):
            raise ValueError(f"run {run_id} has no prompt {prompt_id!r}")
        got = self._ref_if_present(run_id, prompt_id, name)
        if got is None:
            if not self.backend.listdir(f"{ARRAYS_DIR}/{run_id}/{prompt_id}"):
                raise ValueError(f"run {run_id} has no prompt {prompt_id!r}")
            have = sorted(self._array_names(run_id, prompt_id))
            raise ValueError(f"run {run_id}, prompt {prompt_id} has no array {name!r}; it has {have}")
        return got

    def _ref_if_present(self, run_id: str, prompt_id: str, name: str) -> tuple[ArrayRef, dict[str, Any]] | None:
        """``_ref`` of an array that is there, None where its zarr.json is missing (no listing:
        the caller names what is missing); StoreError where it is unreadable."""
        ref = ArrayRef(run_id, prompt_id, name)
        if ref.path in self._array_meta:
            return ref, self._array_meta[ref.path]
        try:
            raw = self.backend.read(f"{ARRAYS_DIR}/{ref.path}/zarr.json")
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{ref.where()}: array metadata zarr.json is unreadable ({e})") from None
        try:
            meta = json.loads(raw)
        except ValueError as e:
            raise StoreError(f"{ref.where()}: array metadata zarr.json is unreadable ({e})") from None
        if self._cache:
            self._array_meta[ref.path] = meta
        return ref, meta

    def _array_names(self, run_id: str, prompt_id: str) -> list[str]:
        base = f"{ARRAYS_DIR}/{run_id}/{prompt_id}/"
        metas = [k for k in self.backend.find(base) if k.endswith("/zarr.json") and k != base + "zarr.json"]
        got = self.backend.read_many(metas)
        return [k[len(base):-len("/zarr.json")] for k, v in got.items()
                if v is not None and json.loads(v).get("node_type") == "array"]

    def _read(self, ref: ArrayRef, meta: dict[str, Any], region: tuple[slice, ...] | None, as_torch: bool) -> Any:
        shape = tuple(meta["shape"])
        chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        full = tuple(slice(0, n) for n in shape)
        region = full if region is None else tuple(region) + full[len(region):]
        codecs = [c["name"] for c in meta.get("codecs", [])]
        b, base = self.backend, f"{ARRAYS_DIR}/{ref.path}"
        if codecs in (["bytes", "blosc", "crc32c"], ["bytes", "crc32c"]):

            def fetch(keys: list[str]) -> dict[str, bytes | None]:
                got = b.read_many([f"{base}/{k}" for k in keys])
                return {k: got[f"{base}/{k}"] for k in keys}

            local = None if b.path is None else f"{os.fspath(b.path)}/{base}"  # a str: no pathlib per read
            bits = read_region(local, shape, chunks, np.dtype(meta["data_type"]),
                               region, ref.where(), compressed=len(codecs) == 3,
                               fetch=fetch if b.path is None else None, sep=_separator(ref, meta))
        else:  # sharded or another codec chain: zarr decodes (its crc32c codec checks every inner chunk)
            bits = _checked_zarr_read(self, ref, meta, region)
        return from_storage(bits, meta["attributes"]["logical_dtype"], as_torch, ref.where())

    def read_tokens(self, run_id: str, prompt_id: str) -> np.ndarray:
        """tokens: int32 [token]."""
        ref, meta = self._ref(run_id, prompt_id, "tokens")
        return self._read(ref, meta, None, False)

    def read_logits(self, run_id: str, prompt_id: str, as_torch: bool = False, tokens: slice | None = None) -> Any:
        """logits: [gen_token, vocab] in the dtype they were written in; ``tokens``: a slice of
        gen_token (only the chunks it touches are read)."""
        ref, meta = self._ref(run_id, prompt_id, "logits")
        return self._read(ref, meta, None if tokens is None else (_token_slice(tokens, ref),), as_torch)

    def read_kv(self, run_id: str, prompt_id: str, layers: Any = None, as_torch: bool = False,
                group: str | None = None, tokens: slice | None = None) -> tuple[Any, Any]:
        """(k, v): [layer, kv_head, position, head_dim]; ``layers``: names or indices (None: all);
        ``tokens``: a slice of positions (only the chunks it touches are read)."""
        kname, vname = ("kv_k", "kv_v") if group is None else (f"kv_k_{check_component(group, 'kv group')}", f"kv_v_{group}")
        out = []
        for name in (kname, vname):
            ref, meta = self._ref(run_id, prompt_id, name)
            seq = slice(None) if tokens is None else _token_slice(tokens, ref)
            idx = self._layer_indices(meta, layers, ref)
            if idx is None:
                out.append(self._read(ref, meta, (slice(None), slice(None), seq), as_torch))
                continue
            parts = [self._read(ref, meta, (slice(i, i + 1), slice(None), seq), False) for i in idx]
            bits = np.concatenate(parts, axis=0)
            out.append(bits if not as_torch else _numpy_to_torch(bits, ref))
        return out[0], out[1]

    @staticmethod
    def _layer_indices(meta: dict[str, Any], layers: Any, ref: ArrayRef) -> list[int] | None:
        if layers is None:
            return None
        names = list(meta["attributes"].get("layer_names", [str(i) for i in range(meta["shape"][0])]))
        if isinstance(layers, (int, str, np.integer)):
            layers = [layers]
        idx = []
        for layer in layers:
            if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
                if not -len(names) <= int(layer) < len(names):
                    raise ValueError(f"{ref.where()}: layer index {layer} out of range for {len(names)} layers")
                idx.append(int(layer) % len(names))
            elif isinstance(layer, str) and layer in names:
                idx.append(names.index(layer))
            else:
                raise ValueError(f"{ref.where()}: unknown layer {layer!r}; layers are {names[:8]}...")
        if not idx:
            raise ValueError(f"{ref.where()}: empty layer selection")
        return idx

    def read_tensor(self, run_id: str, prompt_id: str, module: str, step: int | None = None,
                    phase: str | None = None, as_torch: bool = False) -> Any:
        """A module tensor: [step, ...] of one phase (step=None), or one step's array; from its own
        array ``tensors/<module>/<phase>`` or from its prompt's group array (format 6, ``tensor_groups/``)."""
        check_module_name(module)
        self._require_run(run_id)
        # phase: (ref, meta, index) of this module in its prompt's group arrays
        grouped = self._tensor_groups(run_id, prompt_id).get(module, {}) if isinstance(prompt_id, str) else {}
        known = {}  # phase: (ref, meta) of an own array already read
        if _plain_name(phase) and phase in grouped:
            phases = [phase]
        else:
            tried = isinstance(prompt_id, str) and _plain_name(phase)
            if tried:  # the phase named: its zarr.json read at once (no existence check first: a stat
                # here, a HEAD request on object storage); only where it is missing are phases listed
                got = self._ref_if_present(run_id, prompt_id, f"tensors/{module}/{phase}")
                if got is not None:
                    known[phase] = got
            phases = [phase] if known else sorted(
                {*self._tensor_phases(run_id, str(prompt_id), module, None if tried else phase), *grouped})
        if not phases:
            raise ValueError(f"run {run_id}, prompt {prompt_id} has no tensor for module {module!r}")
        if phase is not None:
            if phase not in phases:
                raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: no phase {phase!r}; it has {phases}")
            phases = [phase]
        if step is None and len(phases) > 1:
            raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: several phases {phases}; "
                             "pass phase= or step=")
        for ph in phases:
            if ph in grouped and ph not in known:
                ref, meta, i = grouped[ph]
                region = (slice(i, i + 1),)
            else:
                ref, meta = known[ph] if ph in known else self._ref(run_id, prompt_id, f"tensors/{module}/{ph}")
                region = ()
            steps = list(meta["attributes"].get("steps", []))
            if step is None:
                got = self._read(ref, meta, region or None, as_torch)
                return got[0] if region else got
            if step in steps:
                j = steps.index(step)
                return self._read(ref, meta, (*region, slice(j, j + 1)), as_torch)[(0,) * (len(region) + 1)]
        raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: no step {step} in phases {phases}")

    def read_tensors(self, run_id: str, prompt_id: str, wanted: Any, as_torch: bool = False) -> dict[tuple[str, str], Any]:
        """Several module tensors of one prompt at once: ``{(module, phase): [step, ...]}`` for each
        ``(module, phase)`` of ``wanted``, as ``read_tensor`` gives them, bit for bit.

        Modules in one group array (format 6) are read with one call per group: the span of its
        module axis that holds them, every chunk of it decoded in place into one array (in threads
        where the chunks are large; one batched request on object storage), each module a view of
        it. The rest are read one by one (``read_tensor``). A prompt's module comparison reads its
        tensors of a role this way (``comparators.modules``): per tensor, ``read_tensor`` spends
        more on finding and opening its array than on its bytes. Errors as ``read_tensor``'s."""
        wanted = [(m, ph) for m, ph in wanted]
        for m, ph in wanted:
            check_module_name(m)
            if not _plain_name(ph):
                raise ValueError(f"run {run_id}, prompt {prompt_id}, module {m}: phase {ph!r} is not a name")
        self._require_run(run_id)
        grouped = self._tensor_groups(run_id, prompt_id) if isinstance(prompt_id, str) else {}
        spans: dict[str, list] = {}  # group path: [ref, meta, {index: (module, phase)}]
        out: dict[tuple[str, str], Any] = {}
        for m, ph in wanted:
            if ph in grouped.get(m, {}):
                ref, meta, i = grouped[m][ph]
                spans.setdefault(ref.path, [ref, meta, {}])[2][i] = (m, ph)
            else:
                out[(m, ph)] = self.read_tensor(run_id, prompt_id, m, phase=ph, as_torch=as_torch)
        for ref, meta, at in spans.values():
            lo, hi = min(at), max(at) + 1
            got = self._read(ref, meta, None if (lo, hi) == (0, meta["shape"][0]) else (slice(lo, hi),), as_torch)
            for i, key in at.items():
                out[key] = got[i - lo]
        return {key: out[key] for key in wanted}

    def _tensor_groups(self, run_id: str, prompt_id: str) -> dict[str, dict[str, tuple[ArrayRef, dict, int]]]:
        """The prompt's grouped module tensors (format 6): {module: {phase: (group array, its
        metadata, the module's index)}}, empty where the prompt has none; kept for the last prompts read."""
        key = (run_id, prompt_id)
        with self._groups_lock:  # comparators read prompts on several threads
            got = self._groups.get(key)
            if got is not None:
                self._groups.move_to_end(key)
                return got
        base = f"{ARRAYS_DIR}/{run_id}/{prompt_id}/{TENSOR_GROUPS}"
        names = [n for n in self.backend.listdir(base) if n != "zarr.json"]
        raw = self.backend.read_many([f"{base}/{n}/zarr.json" for n in names])
        index = {}
        for n in names:
            v = raw.get(f"{base}/{n}/zarr.json")
            if v is None:
                continue
            ref = ArrayRef(run_id, prompt_id, f"{TENSOR_GROUPS}/{n}")
            try:
                meta = json.loads(v)
                attrs = meta["attributes"]
                if meta.get("node_type") != "array" or attrs.get("kind") != "tensor_group":
                    continue
                modules, ph = list(attrs["modules"]), attrs["phase"]
                if len(modules) != meta["shape"][0]:
                    raise ValueError(f"{len(modules)} modules named for {meta['shape'][0]} along its module axis")
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise StoreError(f"{ref.where()}: group metadata zarr.json is unreadable ({e})") from None
            for i, m in enumerate(modules):
                index.setdefault(m, {})[ph] = (ref, meta, i)
        with self._groups_lock:
            self._groups[key] = index
            while len(self._groups) > _GROUP_INDEXES_KEPT:
                self._groups.popitem(last=False)
        return index

    def _tensor_phases(self, run_id: str, prompt_id: str, module: str, phase: Any = None) -> list[str]:
        """The module's phases; only ``[phase]`` when that one is there (no listing: the others are
        only named in errors)."""
        b, mdir = self.backend, f"{ARRAYS_DIR}/{run_id}/{prompt_id}/tensors/{module}"
        if _plain_name(phase) and b.exists(f"{mdir}/{phase}/zarr.json"):
            return [phase]
        names = b.listdir(mdir)
        have = b.read_many([f"{mdir}/{n}/zarr.json" for n in names])
        return sorted(n for n in names if have.get(f"{mdir}/{n}/zarr.json") is not None)

    def _prompt_group(self, run_id: str, prompt_id: str) -> Any:
        """What ``xarray.open_zarr`` opens for one prompt's group, None when the run has no such prompt."""
        rel = f"{ARRAYS_DIR}/{run_id}/{prompt_id}"
        if not isinstance(prompt_id, str) or not self.backend.listdir(rel):
            return None
        return self.backend.zarr_location(rel)

    def open_xarray(self, run_id: str, prompt_id: str, decode_dtypes: bool = True):
        """The prompt's arrays as an xarray.Dataset with their named dims (tokens, logits,
        kv_k, kv_v, ...; module tensors are in the ``tensors/`` subgroups). KV and tokens share
        the ``position`` dim, also for runs written in format 1 (which named it ``seq`` in KV,
        ``token`` in tokens; renamed here where its length is the tokens').

        Zarr has no bf16/fp8 type, so xarray sees their bits (uint16/uint8); with
        ``decode_dtypes`` those variables are loaded and viewed as their ml_dtypes dtype
        (bit-exact), lazily too where xarray gave Dask arrays (dask installed: every variable is a
        Dask array, read chunk by chunk on ``.compute()``, also on a store on object storage).
        docs/reading.md: the same without this library."""
        import xarray as xr

        from capturestore.layout import FORMAT1_POSITION_DIMS, POSITION_DIM

        self._require_run(run_id)
        group = self._prompt_group(run_id, prompt_id)
        if group is None:
            raise ValueError(f"run {run_id} has no prompt {prompt_id!r}")
        ds = xr.open_zarr(group, consolidated=False, zarr_format=3)
        if any(d in ds.dims for d in FORMAT1_POSITION_DIMS) and POSITION_DIM not in ds.dims:
            n = ds.sizes.get("token")
            renamed = {}
            for name, var in ds.variables.items():
                v = var.copy(deep=False)
                if n is None or all(ds.sizes[d] == n for d in v.dims if d in FORMAT1_POSITION_DIMS):
                    v.dims = tuple(POSITION_DIM if d in FORMAT1_POSITION_DIMS else d for d in v.dims)
                renamed[name] = v
            ds = xr.Dataset(renamed, attrs=ds.attrs)
        if decode_dtypes:
            for name, var in list(ds.data_vars.items()):
                logical = var.attrs.get("logical_dtype")
                if logical and np.dtype(LOGICAL_DTYPES[logical].numpy) != var.dtype:
                    ds[name] = var.copy(data=_decode_lazily(var.data, logical, f"{run_id}/{prompt_id}/{name}"))
        return ds

    # ---- tables and queries ----------------------------------------------------------------
    def _read_run_table(self, table: str, run_id: str | None = None) -> pa.Table:
        if self._cache and run_id is not None and table != "runs":  # _require_run checked it is committed
            if (table, run_id) not in self._run_segments:
                self._run_segments[(table, run_id)] = self._read_run_table_now(table, run_id)
            return self._run_segments[(table, run_id)]
        return self._read_run_table_now(table, run_id)

    def _read_run_table_now(self, table: str, run_id: str | None = None) -> pa.Table:
        """All rows of one run table (committed runs only for prompts/captures). A segment listed
        and gone before it was read (compaction removed a merged source after its grace, or
        remove_run): listed and read again, so no row is ever missing from the answer."""
        for _ in range(4):
            try:
                return self._read_run_table_once(table, run_id)
            except _SourceGone:
                continue
        return self._read_run_table_once(table, run_id, retry=False)

    def _read_run_table_once(self, table: str, run_id: str | None = None, retry: bool = True) -> pa.Table:
        schema = SCHEMAS[table]
        listing = self.backend.segment_names(table)  # one listing: a source and its merged segment never both count
        try:
            cover = coverage(self.backend, table, listing, self._footers)
        except ListingChanged:
            if retry:
                raise _SourceGone from None
            raise
        names = [n for n in listing if n != SCHEMA_SEGMENT and not is_merged(n) and n not in cover]
        if table != "runs":
            ok = self.committed_ids()
            names = [n for n in names if n.removesuffix(".parquet") in ok]
        if run_id is not None:
            names = [n for n in names if n == f"{run_id}.parquet"]
        got = self.backend.read_many([f"{TABLES_DIR}/{table}/{n}" for n in names])
        if retry and any(v is None for v in got.values()) and is_merged_anywhere(self.backend, table):
            raise _SourceGone
        parts = [read_checked(pa.BufferReader(v), where=self.backend.where(k)) for k, v in got.items() if v is not None]
        merged = sorted({m for src, m in cover.items()
                         if (run_id is None or src == f"{run_id}.parquet")
                         and (table == "runs" or src.removesuffix(".parquet") in ok)})
        for m, v in self.backend.read_many([f"{TABLES_DIR}/{table}/{m}" for m in merged]).items():
            if v is None:
                if retry:  # merged again and removed after its grace: list again
                    raise _SourceGone
                raise StoreError(f"{self.root}: merged segment {m} was listed but is gone; retry the read")
            t = read_checked(pa.BufferReader(v), where=self.backend.where(m))
            keep = [f"{run_id}.parquet"] if run_id is not None else \
                [src for src, mm in cover.items() if mm == m.rsplit("/", 1)[-1]
                 and (table == "runs" or src.removesuffix(".parquet") in ok)]
            t = t.filter(pa.compute.is_in(t.column(SOURCE_COLUMN), pa.array(keep, pa.string())))
            parts.append(t.drop_columns([SOURCE_COLUMN]).replace_schema_metadata(None))
        parts = [p.select([n for n in schema.names if n in p.column_names]) for p in parts]
        if not parts:
            return schema.empty_table()
        got = pa.concat_tables(parts, promote_options="default")
        for i, f in enumerate(schema):  # a column added after the segments were written (group_index): nulls
            if f.name not in got.column_names:
                got = got.add_column(i, f, pa.nulls(got.num_rows, f.type))
        return got

    def runs(self) -> pa.Table:
        return self._read_run_table("runs")

    def prompts(self, run_id: str | None = None) -> pa.Table:
        if run_id is not None:
            self._require_run(run_id)
        return self._read_run_table("prompts", run_id)

    def captures(self, run_id: str | None = None) -> pa.Table:
        if run_id is not None:
            self._require_run(run_id)
        return self._read_run_table("captures", run_id)

    def sql(self, query: str, params: dict | list | None = None) -> pa.Table:
        """Run a read-only query over the catalog views (runs, prompts, captures and every appended table).

        Only queries run (SELECT, WITH, FROM, DESCRIBE, ...; several separated by ``;`` return the
        last one's result), and they read only this store's ``tables/``: writing files, ATTACH,
        INSTALL/LOAD, SET/PRAGMA and CREATE/DROP are refused (docs/sql.md). A refused statement, a
        SQL error or an unreadable segment raises QueryError in one line naming why; a corrupt
        segment fails only the queries that read its table. ``params``: values DuckDB binds
        (``$name`` with a dict, ``?`` with a list), never spliced into the SQL text.
        """
        return self._query(query, lambda names: catalog.run_query(self._con, query, names, self._con_broken, params))

    def _own_rows(self, query: str, params: dict | list | None = None) -> list[dict[str, Any]]:
        """The rows of one SELECT of this package's own (catalog.own_rows: no refusal to check, planned
        once), its views built and its listing retried as for ``sql``."""
        return self._query(query, lambda names: catalog.own_rows(self._con, query, names, self._con_broken, params))

    def _query(self, query: str, run):
        """``run(names of the views)`` on this process's connection, once the views ``query``
        reads are built from a fresh listing; listed again and rerun where a listed segment went."""
        from capturestore.errors import QueryError

        where = self.backend.catalog_root()  # the backend: where DuckDB opens the segments, and how
        with self._con_lock:
            if self._con is None or self._con_pid != os.getpid():
                self._con = catalog.connect_memory(where)
                self._con_pid = os.getpid()
                self._con_views, self._con_broken = {}, {}
            for attempt in range(4):
                # the tables the query's views are built from (docs/sql.md, "Tables listed"), each
                # listed once, markers first; the views read exactly these files (docs/compact.md,
                # "Store.sql: explicit lists"), rebuilt when their listing changed
                wanted = self._query_tables(query)
                try:
                    files = catalog.segment_files(where, self._footers, self._con_tables if wanted is None else wanted)
                except ListingChanged:  # a merged segment listed, merged again and removed: list again
                    if attempt == 3:
                        raise QueryError(f"{self.root}: tables were compacted under the query 4 times in a row; "
                                         f"retry it") from None
                    continue
                names = list(files) if wanted is None else self._con_tables
                # the views whose every listing was made now; any other keeps its view until a
                # query that lists its tables (a view reads its files, never another view)
                built = [t for t in files if wanted is None or set(catalog.view_tables(t)) <= set(wanted)]
                keys = {t: catalog.view_key(files, t) for t in built}
                todo = [t for t in built if self._con_views.get(t) != keys[t] or t in self._con_broken]
                if todo:  # views are created after the lockdown: they read only under tables/
                    broken = catalog.add_views(self._con, where, todo, files=files)
                    self._con_broken = {t: why for t, why in self._con_broken.items() if t not in todo} | broken
                    self._con_views.update((t, keys[t]) for t in todo)
                try:
                    return run(names)
                except QueryError as e:
                    # a listed segment removed before it was read (a merged source after its
                    # grace, remove_run): list again and rerun; any other failure is the answer
                    gone = catalog.listed_files_gone(where, files)
                    if not gone:
                        raise
                    if attempt == 3:
                        raise QueryError(f"{e}; segment {gone[0]} was listed and then removed (No such file) before "
                                         f"the query read it, {attempt + 1} times in a row; retry the query") from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _query_tables(self, query: str) -> list[str] | None:
        """The tables whose listings the views ``query`` reads are built from (catalog.view_tables
        of each table it names); None when DuckDB's parse tree cannot tell (catalog.tables_named):
        then every table of a fresh listing of ``tables/`` (self._con_tables). The table names
        known from an earlier listing are used first: a store's tables are only ever added, and a
        name not among them lists ``tables/`` again."""
        named = catalog.tables_named(self._con, query, self._con_tables) if self._con_tables else None
        if named is None:
            self._con_tables = self.backend.listdir(TABLES_DIR)
            named = catalog.tables_named(self._con, query, self._con_tables)
            if named is None:
                return None
        return list(dict.fromkeys(d for t in sorted(named) for d in catalog.view_tables(t)))

    def show(self, run_id: str) -> dict[str, Any]:
        """One run: its runs row, and per prompt the arrays it holds."""
        self._require_run(run_id)
        rows = self.runs().filter(pa.compute.equal(pa.compute.field("run_id"), run_id)).to_pylist()
        if not rows:  # the marker file is there, its row is not: the catalog cannot describe the run
            marker = f"{self.root}/{TABLES_DIR}/runs/{run_id}.parquet"
            raise StoreError(f"run {run_id}: its commit marker {marker} holds no row of it (run `capturestore verify`)")
        return {"run": rows[0], "prompts": self.prompts(run_id).to_pylist(), "captures": self.captures(run_id).to_pylist()}

    def pending(self) -> list[dict[str, Any]]:
        """Runs begun but not committed: run_id, pid, hostname, started_at, alive (writer holds its lock).

        A dead one (alive False) is what ``gc`` removes; none of them is in the catalog."""
        out = []
        committed = self.committed_ids()
        alive = self.backend.liveness()
        for n in self.backend.listdir(PENDING_DIR):
            rid = n.removesuffix(".json")
            if not n.endswith(".json") or rid in committed or integrity.is_comparison_id(rid) \
                    or rid.startswith(COMPACTION_LOCK_PREFIX):  # a compaction's lock, no run
                continue
            try:
                info = json.loads(self.backend.read(f"{PENDING_DIR}/{n}") or b"{}")
            except (OSError, ValueError):
                info = {}
            out.append({"run_id": rid, "pid": info.get("pid"), "hostname": info.get("hostname"),
                        "started_at": info.get("started_at"), "status": info.get("status"),
                        "alive": alive(rid)})
        return out

    # ---- maintenance -----------------------------------------------------------------------
    def verify(self) -> integrity.VerifyReport:
        """Checksums of every chunk, catalog-vs-array consistency, commit markers, Zarr group
        metadata, catalog.duckdb against a rebuild, leftovers of dead writers, every committed
        comparison's segments against its manifest; see integrity.verify."""
        report = integrity.verify(self.backend)
        report.extend(integrity.evidence_problems(self))
        return report

    def gc(self, dry_run: bool = False) -> list[str]:
        """Remove what dead writers left (arrays, segments of uncommitted runs and comparisons,
        pending and temp files); returns what was removed. A live writer is never touched."""
        return integrity.gc(self.backend, dry_run=dry_run)

    def compact(self, tables: list[str] | None = None, grace_s: float | None = None, on_step=None):
        """Merge each table's committed segments into one merged segment and remove sources merged
        longer than ``grace_s`` ago (compaction.compact; docs/compact.md). Returns a CompactResult."""
        from capturestore.compaction import compact

        return compact(self, tables, grace_s, on_step)

    @contextlib.contextmanager
    def auto_compaction_held(self):
        """No automatic compaction of this Store's commits inside the block, and every run committed
        in it kept alive to every other compaction (its writer lock held until the block ends: a
        compaction merges only runs whose writer has released it), so that what the block
        committed can still be undone segment by segment: ``remove_run`` refuses a merged run.
        ``capturestore run`` holds it around an invocation and rolls back inside it when it fails.
        As the block ends the locks are released; then, when it ended without an exception, the
        tables it wrote are compacted when due (after the locks: the runs are merged only then)."""
        if self._auto_compact_held is not None:  # nested: the outer block decides
            yield
            return
        self._auto_compact_held = []
        ok = False
        try:
            yield
            ok = True
        finally:
            tables, self._auto_compact_held = self._auto_compact_held, None
            locks, self._held_locks = self._held_locks, []
            for lock in locks:  # every one, whatever the others do: a lock left held keeps its run unmerged
                try:
                    lock.release()
                except Exception as e:  # noqa: BLE001 - the runs are committed; gc clears a lease left behind
                    import warnings

                    warnings.warn(f"{self.root}: a committed run's writer lock was not released: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", stacklevel=3)
        if ok and tables:
            self._after_commit(list(dict.fromkeys(tables)))

    def _release_writer_lock(self, lock) -> None:
        """A committed run's writer lock: released now, or as auto_compaction_held ends."""
        if self._auto_compact_held is not None:
            self._held_locks.append(lock)
        else:
            lock.release()

    def _after_commit(self, tables) -> None:
        """Compact ``tables`` when a commit left one of them with $CAPTURESTORE_AUTO_COMPACT
        segments not merged (compaction.compact_if_due; docs/compact.md, "Automatic"). The commit
        stands whatever happens here: a failure is a warning naming the store and the tables."""
        from capturestore.compaction import compact_if_due

        if self._auto_compact_held is not None:
            self._auto_compact_held.extend(tables)
            return
        import warnings

        try:
            done = compact_if_due(self, list(tables))
        except Exception as e:  # noqa: BLE001 - committed already; a later commit or `compact` retries
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            warnings.warn(f"{self.root}: automatic compaction of {', '.join(tables)} not done: {why}", stacklevel=3)
            return
        # a stopped compaction's lock on object storage (no atomic take-over) leaves the table as
        # written until gc: said at the commit that found it, not only by an explicit compact
        for t in done.tables if done is not None else ():
            if t.stale_lock:
                warnings.warn(f"{self.root}: automatic compaction of {t.table} not done: {t.skipped[0]}", stacklevel=3)

    def remove_run(self, run_id: str) -> None:
        """Uncommit and delete committed run ``run_id``: its ``runs`` segment (the commit marker)
        first, so no reader ever sees a committed run with missing data, then its ``prompts`` and
        ``captures`` segments and its arrays (a crash midway leaves what ``gc`` removes).
        StoreError, removing nothing, when it is not a committed run or a committed comparison
        uses it. ``capturestore run`` rolls back with it the runs a failed invocation committed."""
        import re

        if not isinstance(run_id, str) or not re.fullmatch(r"[0-9A-Za-z_.-]+", run_id) or \
                run_id not in self.committed_ids():
            raise StoreError(f"remove_run: {run_id!r} is not a committed run of {self.root}")
        merged = [t for t in RUN_TABLES if f"{run_id}.parquet" in coverage(self.backend, t)]
        if merged:
            raise StoreError(f"remove_run: run {run_id} is merged into compacted segments of {', '.join(merged)} "
                             f"(capturestore compact); removing one run from a merged segment is not supported; it stays")
        comparisons = self._committed_comparison_ids()
        if comparisons is None:
            raise StoreError(f"remove_run: a comparisons segment of {self.root} is unreadable, so which comparisons use "
                             f"run {run_id} is unknown; it stays (run capturestore verify)")
        used = [] if not comparisons else self.sql(
            "SELECT comparison_id FROM comparisons WHERE $run IN (baseline_run, expected_run, actual_run) "
            "OR coalesce(comparator_runs, '') LIKE '%\"' || $run || '\"%' LIMIT 3", params={"run": run_id}).to_pylist()
        if used:
            raise StoreError(f"remove_run: run {run_id} is used by comparison(s) "
                             f"{', '.join(r['comparison_id'] for r in used)}; it stays")
        # no compaction of runs between here and the marker's removal: one that read the marker
        # before would write it into its merged segment, and the run would read as committed with
        # its data gone (compaction takes the same lock, created only if absent)
        try:
            lock = self.backend.writer_lock(f"{COMPACTION_LOCK_PREFIX}runs", {"status": f"removing run {run_id}"})
        except WriterIdTaken:
            raise StoreError(f"remove_run: a compaction of the runs table of {self.root} is running (or a stopped one "
                             f"left its lock: capturestore gc); run {run_id} stays, retry after it") from None
        try:
            if f"{run_id}.parquet" in coverage(self.backend, "runs"):  # merged before the lock was taken
                raise StoreError(f"remove_run: run {run_id} was merged into a compacted segment of runs while it was "
                                 f"being removed (capturestore compact); it stays")
            self._remove_segment("runs", run_id)  # uncommitted from here on
        finally:
            lock.release()
        self._committed.discard(run_id)
        for table in ("captures", "prompts"):
            self._remove_segment(table, run_id)
        self._remove_run_arrays(run_id)
        try:
            self._refresh_catalog()
        except Exception:  # noqa: BLE001 - the file catalog is a convenience; queries never need it
            pass

    def upgrade_format(self) -> tuple[int, int]:
        """Raise the store to format ``layout.FORMAT_VERSION`` (7), what a new store is created as:
        runs written from now on make their arrays with "." chunk keys (4: one file per chunk beside
        its zarr.json, a third of the directories; docs/reading.md), compaction footers name each
        column list once (5: docs/compact.md, "A year of nightly CI"), and module captures group a
        prompt's module tensors (6: ``tensor_groups/``, docs/reading.md), and compaction writes a
        source's binary row hash alone where it has one (7: docs/compact.md). Arrays and merged segments
        already written keep their form and read as before; a capturestore older than the new version
        no longer opens the store, and a writer that opened the store before keeps writing the
        layout it began with, which reads alike. Returns (version before, version after); a store
        already at 7 or later is left as it is. StoreError when the store cannot be written."""
        require_writable(self, "upgrade")
        b = self.backend
        info = _read_format(b)
        if info is None:
            raise StoreError(f"{b.where(FORMAT_FILE)}: not found (removed since the store was opened?)")
        before = info["format_version"]
        if before < GROUPED_TENSORS_FORMAT_VERSION:  # every table's columns, group_index of captures too,
            # also in a view of a store whose segments all came before it
            for name, schema in SCHEMAS.items():
                b.put(f"{TABLES_DIR}/{name}/{SCHEMA_SEGMENT}", segment_bytes(schema.empty_table()), durable=True)
        if before < FORMAT_VERSION:
            info = {**info, "format": FORMAT_NAME, "format_version": FORMAT_VERSION}
            b.put(FORMAT_FILE, (json.dumps(info, indent=2) + "\n").encode(), durable=True)
        self._chunk_separator = separator_for(max(before, FORMAT_VERSION))
        self.grouped_tensors = max(before, FORMAT_VERSION) >= GROUPED_TENSORS_FORMAT_VERSION
        return before, max(before, FORMAT_VERSION)

    def rebuild_catalog(self) -> Path:
        """Rebuild catalog.duckdb from tables/ alone. StoreError when it cannot be written, or
        names the tables whose segments are unreadable (their views in the new file raise that)."""
        import duckdb

        if not self.backend.has_catalog_file:
            raise StoreError(f"{self.root}: a store on object storage has no {TABLES_DIR}-side catalog.duckdb; its "
                             f"queries (capturestore sql) build their views in memory")
        try:
            ensure_schema_segments(self.root)
            path, broken = catalog.rebuild_catalog_file(self.root)
        except (OSError, duckdb.Error) as e:
            raise StoreError(f"cannot write {self.root / catalog.CATALOG_FILE}: {e}".splitlines()[0]) from None
        if broken:
            raise StoreError(f"rebuilt {path}, but {'; '.join(broken.values())} (run capturestore verify)")
        return path


class _SourceGone(Exception):
    """A segment listed a moment ago is gone (see Store._read_run_table_now)."""


def is_merged_anywhere(b, table: str) -> bool:
    """True when ``table`` has a merged segment now (a listed segment gone may have been merged)."""
    return any(is_merged(n) for n in b.segment_names(table))


def _decode_lazily(data: Any, logical: str, where: str) -> Any:
    """Storage bits -> the logical dtype (a view, bit-exact): per chunk for a Dask array, else at once."""
    if hasattr(data, "map_blocks"):
        return data.map_blocks(from_storage, logical, False, where, dtype=np.dtype(LOGICAL_DTYPES[logical].numpy))
    return from_storage(np.asarray(data), logical, False, where)


def _token_slice(tokens: Any, ref: ArrayRef) -> slice:
    if isinstance(tokens, tuple) and len(tokens) == 2:
        tokens = slice(*tokens)
    if not isinstance(tokens, slice) or tokens.step not in (None, 1):
        raise ValueError(f"{ref.where()}: tokens must be a step-1 slice or (start, stop), got {tokens!r}")
    return tokens


def _numpy_to_torch(bits: np.ndarray, ref: ArrayRef) -> Any:
    # bits here are already the logical numpy dtype; go back to storage bits for the torch view
    from capturestore.dtypes import logical_dtype_name

    name = logical_dtype_name(bits)
    ld = LOGICAL_DTYPES[name]
    return from_storage(bits.view(ld.storage), name, True, ref.where())


def _checked_zarr_read(store: Store, ref: ArrayRef, meta: dict, region) -> np.ndarray:
    """arr[region] through zarr, refusing missing chunk/shard objects (zarr would read the fill
    value) and naming the chunks of a read that fails."""
    from zarr.core.array import Array, AsyncArray
    from zarr.storage import StorePath

    from capturestore.errors import CorruptChunkError
    from capturestore.layout import chunk_keys_in_region

    grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    sep = _separator(ref, meta)
    keys = [k for _, k in chunk_keys_in_region(tuple(meta["shape"]), grid, region, sep)]
    base = f"{ARRAYS_DIR}/{ref.path}/"
    present = set(chunk_objects(store.backend, base.rstrip("/"), sep))
    missing = [k for k in keys if base + k not in present]
    if missing:
        raise CorruptChunkError(f"{ref.where()}, chunk {missing[0]}: chunk file is missing")
    arr = Array(AsyncArray(metadata=read_metadata(meta), store_path=StorePath(store._zstore, ref.path)))  # no second GET of zarr.json
    sharded = meta["codecs"][0]["name"] == "sharding_indexed"
    try:
        return arr[region]
    except Exception as e:  # noqa: BLE001
        if store.backend.path is not None and not sharded:  # a directory of chunk files: name each bad one by its CRC
            bad = bad_chunks(store.backend.path / base, tuple(meta["shape"]), grid, region, sep)
            if bad:
                listing = "; ".join(f"chunk {k}: {why}" for k, why in bad[:8])
                more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
                raise CorruptChunkError(f"{ref.where()}: {len(bad)} corrupt chunk(s): {listing}{more}") from e
        listing = ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
        raise CorruptChunkError(f"{ref.where()}, shard {listing}: {' '.join(str(e).split())}") from None


def _separator(ref: ArrayRef, meta: dict) -> str:
    """The chunk key separator of array ``ref`` (its zarr.json ``meta``); CorruptChunkError naming
    the array where it names an encoding this store never writes."""
    from capturestore.errors import CorruptChunkError

    try:
        return key_separator(meta)
    except ValueError as e:
        raise CorruptChunkError(f"{ref.where()}: {e}") from None


def chunk_objects(b: Backend, base: str, sep: str) -> dict[str, int]:
    """{key: size} of the chunk (or shard) objects of the array whose directory is ``base`` (a key
    below the store's root), keys with separator ``sep`` (``c/0/1`` below ``base/c``, or
    ``c.0.1`` beside its zarr.json)."""
    if sep == "/":
        return b.find(f"{base}/c")
    pre = f"{base}/"
    return {k: v for k, v in b.find(base).items() if k.startswith(pre) and is_chunk_name(k[len(pre):], sep)}


def store_exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a directory, ``file://``, ``s3://`` or ``memory://``) holds a capture store:
    its format file, written last when a store is created."""
    from capturestore.backends import backend_for
    from capturestore.layout import FORMAT_FILE

    return backend_for(path).exists(FORMAT_FILE)


def open_store_path(path: str, create: bool = False):
    """The store at ``path`` (a directory, ``file://``, ``s3://`` or ``memory://``); a directory that is not
    a capture store is refused in one line unless ``create``."""
    from capturestore.errors import StoreError
    from capturestore.layout import FORMAT_FILE
    from capturestore.objectstore import is_url

    if is_url(path):  # s3://bucket/prefix: Store.open says what is wrong in one line
        return Store.open(path, create=create)
    root = store_root(path.removeprefix("file://"))
    if not create and not (root / FORMAT_FILE).exists():
        raise StoreError(f"{root} is not a capture store (no {FORMAT_FILE}); name an existing store with "
                         f"--store PATH or $CAPTURESTORE (`capturestore demo --store PATH` makes one)")
    return Store.open(root, create=create)


def as_store(store, create: bool = False):
    """``store`` itself when it is a ``Store``, else the store at that path or URL
    (``open_store_path``): the library functions the commands call take either."""
    return store if isinstance(store, Store) else open_store_path(str(store), create=create)


def require_writable_if_stored(path, command: str) -> None:
    """``require_writable`` of the store at ``path`` (a directory, a bucket or memory://) where one
    is there already; a path with no store yet is created by the command (a Store passed in: its
    command checks it)."""
    if isinstance(path, (str, os.PathLike)) and store_exists(path):
        require_writable(Store.open(path, create=False), command)


def require_writable(store, command: str) -> None:
    """Refuse before any work when the store cannot be written (a read-only mount, a directory
    without write permission): the command would otherwise fail at its first write, midway."""
    from capturestore.errors import StoreError
    from capturestore.layout import ARRAYS_DIR, PENDING_DIR, TABLES_DIR

    b = store.backend
    bad = b.unwritable(["", TABLES_DIR, PENDING_DIR, ARRAYS_DIR, *(f"{TABLES_DIR}/{t}" for t in b.listdir(TABLES_DIR))])
    if bad:
        raise StoreError(f"store {store.root} is not writable ({bad[0]}: {bad[1]}); "
                         f"`capturestore {command}` writes to the store")
