"""Store: open a capture store directory, begin runs, read captures, query the catalog."""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import zarr

from capturestore import catalog, integrity
from capturestore.arrays import ArrayRef, check_compression, checked_read, open_array, open_zarr_store, stored_bytes
from capturestore.chunkio import read_region, write_block
from capturestore.dtypes import LOGICAL_DTYPES, from_storage
from capturestore.errors import FormatVersionError, StoreError
from capturestore.layout import (
    ARRAYS_DIR,
    FORMAT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    PENDING_DIR,
    TABLES_DIR,
    check_component,
    check_module_name,
    check_table_name,
)
from capturestore.tables import (
    RUN_TABLES,
    SegmentSchemas,
    committed_run_ids,
    ensure_schema_segments,
    fsync_tree,
    read_table,
    rows_to_table,
    segment_files,
    table_dir,
    write_segment,
)
from capturestore.writer import RunWriter, new_run_id, run_meta


def read_format(root: Path) -> dict[str, Any] | None:
    p = root / FORMAT_FILE
    if not p.exists():
        return None
    try:
        text = p.read_text()
    except OSError as e:
        raise StoreError(f"{p}: unreadable format file ({e})") from None
    return parse_format(text, p)


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
    """``path`` with ``~`` expanded; ValueError naming ``what`` for '~user' of no user."""
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


def _is_layout_entry(name: str) -> bool:
    """Entries a store creation leaves, so a creation cut short (or racing another) resumes."""
    return name in _LAYOUT_ENTRIES or name.startswith(".")


class Store:
    """A capture store directory. Open with ``Store.open(path)``."""

    def __init__(self, root: Path):
        self.root = root
        self._zstore = open_zarr_store(root / ARRAYS_DIR)
        self._committed: set[str] = set()
        self._con = None  # in-memory DuckDB connection with the catalog views, made on first sql()
        self._con_tables: list[str] = []
        self._con_broken: dict[str, str] = {}  # table -> why its segments cannot be read
        self._con_pid = -1
        self._con_lock = threading.Lock()
        self._segment_schemas: dict[str, SegmentSchemas] = {}  # table -> its segments' column types

    # ---- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, create: bool = True) -> Store:
        """Open (and by default create) the store at ``path``; refuses a newer format version.

        ``path``: a directory (or ``file://`` URL), or ``s3://bucket/prefix`` for a store on
        object storage (objectstore.py; endpoint and credentials from the AWS_* variables)."""
        from capturestore import objectstore

        if objectstore.is_url(path):
            return objectstore.open_url(str(path), create=create)
        if isinstance(path, str) and path.startswith("file://"):
            path = path.removeprefix("file://")
        root = store_root(path)
        info = read_format(root)
        if info is None:
            if not create:
                raise StoreError(f"{root} is not a capture store (no {FORMAT_FILE}); Store.open(path, create=True) makes a new one")
            if root.exists() and not root.is_dir():
                raise StoreError(f"{root} exists and is not a directory")
            if root.is_dir() and any(not _is_layout_entry(p.name) for p in root.iterdir()):
                raise StoreError(f"{root} is a non-empty directory without {FORMAT_FILE}; refusing to make it a store")
            cls._create_layout(root)
        elif info["format_version"] > FORMAT_VERSION:
            raise FormatVersionError(
                f"store {root} has format version {info['format_version']}, newer than the {FORMAT_VERSION} this "
                f"capturestore reads; upgrade capturestore to open it"
            )
        store = cls(root)
        store._committed = committed_run_ids(root)
        try:
            catalog.ensure_catalog_file(root)  # only when catalog.stamp is out of date
        except Exception:  # noqa: BLE001 - the file catalog is a convenience; queries never need it
            pass
        return store

    @staticmethod
    def _create_layout(root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        for d in (ARRAYS_DIR, TABLES_DIR, PENDING_DIR):
            (root / d).mkdir(exist_ok=True)
        try:
            zarr.open_group(store=zarr.storage.LocalStore(str(root / ARRAYS_DIR)), mode="a", zarr_format=3)
        except zarr.errors.ContainsGroupError:  # a concurrent creation made it between zarr's check and write
            pass
        ensure_schema_segments(root)
        tmp = root / f".{FORMAT_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION}, indent=2) + "\n")
        os.replace(tmp, root / FORMAT_FILE)  # written last: a half-created directory is not a store

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def __reduce__(self):  # picklable (multiprocessing): reopen by path in the other process
        return (Store.open, (str(self.root), False))

    # ---- storage: what a store on object storage does otherwise (objectstore.RemoteStore) ----
    def _committed_ids(self) -> set[str]:
        return committed_run_ids(self.root)

    def _pending_lock(self, writer_id: str, info: dict[str, Any]) -> integrity.PendingLock:
        """``pending/<writer_id>.json``, held until ``release()`` (a lock the kernel drops on death)."""
        return integrity.PendingLock(self.root, writer_id, info)

    def _write_block(self, ref: ArrayRef, arr: zarr.Array, block: np.ndarray, offset: tuple[int, ...],
                     compressed: bool, pending: list | None) -> bool:
        """Write chunk-aligned ``block`` straight to the chunk files; False: left to zarr (``arr[...] = block``)."""
        return write_block(self.root / ARRAYS_DIR / ref.path, tuple(arr.shape), tuple(arr.chunks), block, offset,
                           compressed=compressed, pending=pending)

    def _shard_shape(self, shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
        """Shard shape of an array written whole (None: one file per chunk, as here: benchmarks/bench_scale.py)."""
        return None

    def _write_segment(self, table: str, data: pa.Table, segment: str | None = None, durable: bool = False) -> Path:
        """One Parquet segment of ``table``, whole or not at all (written under a temp name, renamed)."""
        return write_segment(self.root, table, data, segment=segment, durable=durable)

    def _segment_exists(self, table: str, segment: str) -> bool:
        return (table_dir(self.root, table) / f"{segment}.parquet").exists()

    def _remove_segment(self, table: str, segment: str) -> None:
        (table_dir(self.root, table) / f"{segment}.parquet").unlink(missing_ok=True)

    def _remove_written(self, segment: Path) -> None:
        """Remove a segment ``append_table`` wrote (a comparison that failed before its marker)."""
        segment.unlink(missing_ok=True)

    # ---- segments as bytes: what comparison manifests are checked against (integrity.evidence_problems)
    def segment_names(self, table: str) -> list[str]:
        """File names of ``table``'s segments."""
        return [p.name for p in segment_files(self.root, table)]

    def read_segment(self, table: str, name: str) -> bytes:
        """The bytes of one segment of ``table``."""
        return (table_dir(self.root, table) / name).read_bytes()

    def segment_comparison_ids(self, table: str, name: str) -> set[str] | None:
        """Comparison ids of one segment's rows (None: it has no ``comparison_id`` column)."""
        from capturestore.tables import segment_comparison_ids

        return segment_comparison_ids(table_dir(self.root, table) / name)

    def check_evidence(self, comparison_ids, command: str = "check") -> None:
        """StoreError naming comparison, table and segment when any of ``comparison_ids`` lacks
        evidence its manifest lists, or has rows no manifest lists (integrity.evidence_problems)."""
        integrity.check_evidence(self, comparison_ids, command)

    def _committed_comparison_ids(self) -> set[str] | None:
        from capturestore.tables import committed_comparison_ids

        return committed_comparison_ids(self.root)

    def _refresh_catalog(self) -> None:
        catalog.ensure_catalog_file(self.root)

    def _remove_run_arrays(self, run_id: str) -> None:
        shutil.rmtree(self.root / ARRAYS_DIR / run_id, ignore_errors=True)

    def _sync_run_arrays(self, run_id: str) -> None:
        fsync_tree(self.root / ARRAYS_DIR / run_id)

    def _stored_bytes(self, ref: ArrayRef) -> int:
        return stored_bytes(self.root / ARRAYS_DIR / ref.path)

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
        is_new = not self._table_exists(name)
        path = self._write_segment(name, table)
        if is_new:
            try:
                self._refresh_catalog()
            except Exception:  # noqa: BLE001 - the file catalog catches up on the next open
                pass
        return path

    # the storage-specific checks of append_table (objectstore.RemoteStore has its own)
    def _check_comparison_rows(self, table: str, comparison_ids) -> None:
        """Rows of a comparison must belong to one being written or committed, and not sealed."""
        integrity.check_comparison_rows(self.root, table, comparison_ids)
        integrity.check_sealed(self, table, [c for c in comparison_ids if c is not None and not integrity.writer_is_alive(
            self.root / PENDING_DIR / f"{c}.json")])

    def _check_segment_types(self, name: str, table: pa.Table) -> None:
        self._segment_schemas.setdefault(name, SegmentSchemas()).check(self.root, name, table)

    def _table_exists(self, name: str) -> bool:
        return table_dir(self.root, name).is_dir()

    # ---- reading ---------------------------------------------------------------------------
    def _require_run(self, run_id: str) -> None:
        if not isinstance(run_id, str):
            raise ValueError(f"run id must be a string, got {run_id!r}")
        if run_id in self._committed:
            return
        self._committed = self._committed_ids()
        if run_id not in self._committed:
            known = sorted(self._committed)[-5:]
            raise ValueError(f"unknown run id {run_id!r} in store {self.root} (latest committed runs: {known})")

    def _ref(self, run_id: str, prompt_id: str, name: str) -> tuple[ArrayRef, dict[str, Any]]:
        """The array's ref and its zarr.json metadata; ValueError for an unknown run/prompt/array."""
        self._require_run(run_id)
        ref = ArrayRef(run_id, prompt_id, name)
        pdir = self.root / ARRAYS_DIR / run_id / str(prompt_id)
        if not isinstance(prompt_id, str) or not pdir.is_dir():
            raise ValueError(f"run {run_id} has no prompt {prompt_id!r}")
        try:
            meta = json.loads((pdir / name / "zarr.json").read_text())
        except FileNotFoundError:
            have = sorted(self._array_names(pdir))
            raise ValueError(f"run {run_id}, prompt {prompt_id} has no array {name!r}; it has {have}") from None
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"{ref.where()}: array metadata zarr.json is unreadable ({e})") from None
        return ref, meta

    @staticmethod
    def _array_names(pdir: Path) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(pdir):
            if "zarr.json" in files and Path(dirpath) != pdir:
                rel = Path(dirpath).relative_to(pdir).as_posix()
                if json.loads((Path(dirpath) / "zarr.json").read_text()).get("node_type") == "array":
                    out.append(rel)
        return out

    def _read(self, ref: ArrayRef, meta: dict[str, Any], region: tuple[slice, ...] | None, as_torch: bool) -> Any:
        shape = tuple(meta["shape"])
        chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        full = tuple(slice(0, n) for n in shape)
        region = full if region is None else tuple(region) + full[len(region):]
        codecs = [c["name"] for c in meta.get("codecs", [])]
        if codecs in (["bytes", "blosc", "crc32c"], ["bytes", "crc32c"]):
            bits = read_region(self.root / ARRAYS_DIR / ref.path, shape, chunks, np.dtype(meta["data_type"]),
                               region, ref.where(), compressed=len(codecs) == 3)
        else:  # not our codec chain: let zarr decode, still naming corrupt chunks
            bits = checked_read(self.root / ARRAYS_DIR, open_array(self._zstore, ref), ref, region)
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
        """A module tensor: [step, ...] of one phase (step=None), or one step's array."""
        check_module_name(module)
        self._require_run(run_id)
        phases = self._tensor_phases(run_id, str(prompt_id), module, phase)
        if not phases:
            raise ValueError(f"run {run_id}, prompt {prompt_id} has no tensor for module {module!r}")
        if phase is not None:
            if phase not in phases:
                raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: no phase {phase!r}; it has {phases}")
            phases = [phase]
        for ph in phases:
            ref, meta = self._ref(run_id, prompt_id, f"tensors/{module}/{ph}")
            steps = list(meta["attributes"].get("steps", []))
            if step is None:
                if len(phases) > 1:
                    raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: several phases {phases}; "
                                     "pass phase= or step=")
                return self._read(ref, meta, None, as_torch)
            if step in steps:
                i = steps.index(step)
                return self._read(ref, meta, (slice(i, i + 1),), as_torch)[0]
        raise ValueError(f"run {run_id}, prompt {prompt_id}, module {module}: no step {step} in phases {phases}")

    def _tensor_phases(self, run_id: str, prompt_id: str, module: str, phase: Any = None) -> list[str]:
        """The module's phases; only ``[phase]`` when that one is there (no listing: the others are
        only named in errors)."""
        mdir = self.root / ARRAYS_DIR / run_id / prompt_id / "tensors" / module
        if (isinstance(phase, str) and phase not in ("", ".", "..") and "/" not in phase and os.sep not in phase
                and (mdir / phase / "zarr.json").is_file()):
            return [phase]
        return sorted(p.name for p in mdir.iterdir() if (p / "zarr.json").exists()) if mdir.is_dir() else []

    def _prompt_group(self, run_id: str, prompt_id: str) -> Any:
        """What ``xarray.open_zarr`` opens for one prompt's group, None when the run has no such prompt."""
        pdir = self.root / ARRAYS_DIR / run_id / str(prompt_id)
        return str(pdir) if isinstance(prompt_id, str) and pdir.is_dir() else None

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
        return read_table(self.root, table, run_id)

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
        with self._con_lock:
            names = catalog.table_names(self.root)
            if self._con is None or self._con_pid != os.getpid():
                self._con = catalog.connect_memory(self.root)
                self._con_pid = os.getpid()
                self._con_tables, self._con_broken = [], {}
            todo = sorted(set(names) - set(self._con_tables) | set(self._con_broken))  # new tables, unreadable ones
            if todo:  # views are created after the lockdown: they read only under tables/
                self._con_broken = catalog.add_views(self._con, self.root, todo)
                self._con_tables = names
            return catalog.run_query(self._con, query, names, self._con_broken, params)

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
        pdir = self.root / PENDING_DIR
        for p in sorted(pdir.glob("*.json")) if pdir.is_dir() else []:
            rid = p.name.removesuffix(".json")
            if rid in committed_run_ids(self.root) or integrity.is_comparison_id(rid):
                continue
            try:
                info = json.loads(p.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                info = {}
            out.append({"run_id": rid, "pid": info.get("pid"), "hostname": info.get("hostname"),
                        "started_at": info.get("started_at"), "status": info.get("status"),
                        "alive": integrity.writer_is_alive(p)})
        return out

    # ---- maintenance -----------------------------------------------------------------------
    def verify(self) -> integrity.VerifyReport:
        """Checksums of every chunk, catalog-vs-array consistency, commit markers, Zarr group
        metadata, catalog.duckdb against a rebuild, leftovers of dead writers, every committed
        comparison's segments against its manifest; see integrity.verify."""
        report = integrity.verify(self.root)
        report.extend(integrity.evidence_problems(self))
        return report

    def gc(self, dry_run: bool = False) -> list[str]:
        """Remove what dead writers left (arrays, segments of uncommitted runs and comparisons,
        pending and temp files); returns what was removed. A live writer is never touched."""
        return integrity.gc(self.root, dry_run=dry_run)

    def remove_run(self, run_id: str) -> None:
        """Uncommit and delete committed run ``run_id``: its ``runs`` segment (the commit marker)
        first, so no reader ever sees a committed run with missing data, then its ``prompts`` and
        ``captures`` segments and its arrays (a crash midway leaves what ``gc`` removes).
        StoreError, removing nothing, when it is not a committed run or a committed comparison
        uses it. ``capturestore run`` rolls back with it the runs a failed invocation committed."""
        import re

        if not isinstance(run_id, str) or not re.fullmatch(r"[0-9A-Za-z_.-]+", run_id) or \
                run_id not in self._committed_ids():
            raise StoreError(f"remove_run: {run_id!r} is not a committed run of {self.root}")
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
        self._remove_segment("runs", run_id)  # uncommitted from here on
        self._committed.discard(run_id)
        for table in ("captures", "prompts"):
            self._remove_segment(table, run_id)
        self._remove_run_arrays(run_id)
        try:
            self._refresh_catalog()
        except Exception:  # noqa: BLE001 - the file catalog is a convenience; queries never need it
            pass

    def rebuild_catalog(self) -> Path:
        """Rebuild catalog.duckdb from tables/ alone. StoreError when it cannot be written, or
        names the tables whose segments are unreadable (their views in the new file raise that)."""
        import duckdb

        try:
            ensure_schema_segments(self.root)
            path, broken = catalog.rebuild_catalog_file(self.root)
        except (OSError, duckdb.Error) as e:
            raise StoreError(f"cannot write {self.root / catalog.CATALOG_FILE}: {e}".splitlines()[0]) from None
        if broken:
            raise StoreError(f"rebuilt {path}, but {'; '.join(broken.values())} (run capturestore verify)")
        return path


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
