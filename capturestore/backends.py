"""Storage backends: the bytes of a store under one root, and each medium's commit protocol.

A store's layout (layout.py) is the same everywhere; what differs is how bytes are kept and how
a writer proves it is alive. ``Backend`` is that byte-level interface (the shape of zarr-python
3's ``Store``): keys are '/'-separated paths relative to the store's root (``tables/runs/x.parquet``,
``arrays.zarr/<run>/<prompt>/kv_k/c.0.0.0.0``, or ``.../kv_k/c/0/0/0/0`` in a store of format 3 or earlier), and each backend declares what it can do:

- ``LocalBackend``: a directory. Objects are written under a temp name and renamed; a writer is
  alive while it holds the flock on its ``pending/<id>.json`` (integrity.PendingLock), which the
  kernel drops when it dies. It alone keeps a ``catalog.duckdb`` and temp files of dead writers.
- ``objectstore.S3Backend``: an S3-compatible bucket. Conditional PUTs, leases by the server's
  clock (objectstore.py holds all of how a store works on object storage).
- ``MemoryBackend``: an fsspec memory filesystem in this process, for fast tests; a writer is
  alive while its lock object is held.

``backend_for(path)`` maps a path or URL to its backend. integrity.verify and integrity.gc use
only this interface, so every check runs on every backend.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from capturestore.chunkio import read_to_end
from capturestore.errors import StoreError, WriterIdTaken
from capturestore.layout import FORMAT_FILE, PENDING_DIR, TABLES_DIR, TMP_SUFFIX
from capturestore.tables import checked_file, naming_segment, read_checked

MEMORY_SCHEME = "memory://"


class Backend:
    """The bytes of one store. Subclasses implement the primitives; the rest is written here once.

    Capabilities: ``path`` (a local directory, or None), ``has_catalog_file`` (a catalog.duckdb
    is kept next to the tables), ``shard_bytes`` (arrays written whole are sharded into objects of
    about this size; None: one object per chunk)."""

    root: Any  # what Store.root shows: a Path for a directory, the URL otherwise
    url: str
    path: Path | None = None
    has_catalog_file = False
    shard_bytes: int | None = None

    # ---- primitives -------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        raise NotImplementedError

    def put(self, rel: str, data: bytes, if_absent: bool = False, durable: bool = False) -> None:
        """Store ``data`` whole or not at all; ``if_absent``: FileExistsError when ``rel`` exists."""
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:
        """Sorted names directly under ``rel`` (objects and prefixes); [] when nothing is there."""
        raise NotImplementedError

    def find(self, rel: str) -> dict[str, int]:
        """{key: size} of every object under ``rel``."""
        raise NotImplementedError

    def remove(self, rels: list[str]) -> None:
        """Remove these objects (missing ones are no error)."""
        raise NotImplementedError

    def zarr_store(self, rel: str) -> zarr.abc.store.Store:
        """The zarr store of the arrays under ``rel``."""
        raise NotImplementedError

    def writer_lock(self, writer_id: str, info: dict[str, Any]):
        """``pending/<writer_id>.json``, held (``rewrite``, ``release``) until released; while held,
        ``liveness()(writer_id)`` is True everywhere."""
        raise NotImplementedError

    def liveness(self) -> Callable[[str], bool]:
        """A function writer id -> whether that writer is alive now."""
        raise NotImplementedError

    # ---- what follows from them -------------------------------------------------------------
    def check(self) -> None:
        """StoreError in one line when the medium cannot be reached (before anything is written)."""

    def explain(self, e: BaseException) -> StoreError | None:
        """The one-line StoreError of a failure of the medium itself (None: another error)."""
        return None

    def where(self, rel: str = "") -> str:
        """``rel`` as a user finds it (a path, or a URL)."""
        return f"{self.url}/{rel}" if rel else self.url

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """{rel: bytes, None where missing}."""
        out = {}
        for r in rels:
            try:
                out[r] = self.read(r)
            except FileNotFoundError:
                out[r] = None
        return out

    def remove_tree(self, rel: str) -> None:
        self.remove(list(self.find(rel)))

    def segment_names(self, table: str) -> list[str]:
        """File names of ``table``'s segments."""
        return [n for n in self.listdir(f"{TABLES_DIR}/{table}") if n.endswith(".parquet")]

    def read_parquet(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        return read_checked(pa.BufferReader(self.read(rel)), columns=columns, where=self.where(rel))

    def dead_temp_files(self) -> list[str]:
        """Temp objects left by writers that died (only a backend that renames has them)."""
        return []

    def catalog_problems(self) -> list[str]:
        """How catalog.duckdb differs from a rebuild (only a backend that keeps one)."""
        return []

    def refresh_catalog(self) -> None:
        """Bring catalog.duckdb up to date with the tables (a no-op without one)."""

    def sync_tree(self, rel: str) -> None:
        """Make everything under ``rel`` survive power loss (a no-op where a write returns stored)."""

    def makedirs(self, rels: list[str]) -> None:
        """Create these directories (a no-op where there are none, only keys)."""

    def unwritable(self, rels: list[str]) -> tuple[str, str] | None:
        """(where, why) when ``rels`` cannot be written, found before any work is done; None when
        they can (or only the first write can tell)."""
        return None

    def refuse_creation(self, others: list[str]) -> str | None:
        """Why no store may be created here, given the names ``others`` already there (not a store's)."""
        if others:
            return (f"{self.url} holds other objects ({', '.join(others[:3])}) and no {FORMAT_FILE}; refusing to make "
                    f"it a store")
        return None

    def zarr_location(self, rel: str) -> Any:
        """What ``xarray.open_zarr`` opens for the group at ``rel``."""
        return self.zarr_store(rel)

    def catalog_root(self) -> Any:
        """What catalog.py's in-memory connection reads the tables through: this backend (its
        ``duckdb_filesystem``, ``tables_url``, ``sep``, ``table_names``, ``segment_urls``, ``has_column``)."""
        return self

    # ---- the tables as DuckDB reads them (catalog.py) -----------------------------------------------
    # Declared capability: the fsspec filesystem DuckDB must read the segments through (registered on
    # its confined connection), None where DuckDB opens them as local files itself.
    duckdb_filesystem: Any = None
    sep = "/"  # what joins ``tables_url`` and a name in the paths DuckDB checks against allowed_directories

    @property
    def tables_url(self) -> str:
        """``tables/`` as DuckDB opens it: a directory path or a URL."""
        raise NotImplementedError

    def segment_rels(self, table: str) -> list[str]:
        return [f"{TABLES_DIR}/{table}/{n}" for n in self.segment_names(table)]

    def segment_urls(self, table: str) -> list[str]:
        """``table``'s segments as DuckDB opens them."""
        return [f"{self.tables_url}{self.sep}{table}{self.sep}{n}" for n in self.segment_names(table)]

    def table_names(self) -> list[str]:
        """Tables that have at least one segment (run tables always exist in a store)."""
        return [t for t in self.listdir(TABLES_DIR) if self.segment_names(t)]

    def has_column(self, table: str, column: str) -> bool:
        """Whether any readable segment of ``table`` has ``column`` (footers only)."""
        for rel in self.segment_rels(table):
            try:
                if column in self.read_schema(rel).names:
                    return True
            except Exception:  # noqa: BLE001 - an unreadable segment is verify's to report
                continue
        return False

    def read_schema(self, rel: str) -> pa.Schema:
        return pq.read_schema(pa.BufferReader(self.read(rel)))

    def read_parquet_metadata(self, rel: str) -> pq.FileMetaData:
        """The Parquet footer of a segment (row groups, their column chunks and statistics)."""
        return pq.read_metadata(pa.BufferReader(self.read(rel)))

    def read_parquet_footer(self, rel: str) -> bytes:
        """A segment's footer as its bytes (Thrift), for ``capturestore.footer``."""
        from capturestore.footer import footer_bytes

        return footer_bytes(self.read(rel))

    def read_row_groups(self, rel: str, groups: list[int] | None, columns: list[str] | None) -> pa.Table:
        """``columns`` (None: all) of row groups ``groups`` (None: all) of a segment, reading only
        those; named columns dictionary-encoded (a merged segment's source column decodes ~20x
        faster so: its names repeat)."""
        data = self.read(rel)
        with naming_segment(self.where(rel)):
            return _row_groups(checked_file(pa.BufferReader(data), read_dictionary=columns), groups, columns)


def _footer_of(f) -> bytes:
    """The Thrift footer of an open Parquet file, read from its end (two reads)."""
    from capturestore.footer import footer_length

    size = f.seek(0, 2)
    f.seek(max(0, size - 8))
    n = footer_length(size, f.read(8))
    f.seek(size - 8 - n)
    return f.read(n)


def _row_groups(f: pq.ParquetFile, groups: list[int] | None, columns: list[str] | None) -> pa.Table:
    return f.read(columns=columns) if groups is None else f.read_row_groups(groups, columns=columns)


def shard_shape(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int,
                target: int | None) -> tuple[int, ...] | None:
    """Chunks grouped along the first axis (layers, generation tokens) and spanning the rest of
    the array, up to ``target`` bytes (at least one chunk row: a layer larger than ``target`` is
    one shard); None when a shard would hold a single chunk anyway (or ``target`` is None)."""
    import numpy as np

    if target is None or not shape or any(s == 0 for s in shape):
        return None
    rest = [-(-s // c) * c for s, c in zip(shape[1:], chunks[1:])]  # whole array beyond axis 0, chunk multiples
    per_row = int(np.prod(rest, dtype=np.int64)) * itemsize
    rows = max(chunks[0], (target // max(1, per_row)) // chunks[0] * chunks[0])
    rows = min(rows, -(-shape[0] // chunks[0]) * chunks[0])
    out = (rows, *rest)
    return None if out == tuple(chunks) else out


# ------------------------------------------------------------------------------ a directory


_TMP_PID = re.compile(r"\.(\d+)(?:\.[0-9a-f]+)?\.tmp$")


class LocalBackend(Backend):
    """A store directory: temp name + rename for every object, flock for liveness."""

    has_catalog_file = True

    def __init__(self, path: Path):
        self.root = self.path = path
        self.url = str(path)

    def _p(self, rel: str) -> Path:
        return self.path / rel if rel else self.path

    def where(self, rel: str = "") -> str:
        return str(self._p(rel))

    def read(self, rel: str) -> bytes:
        # a str path (pathlib's joins were ~30 us a read: a module compare reads thousands) and
        # os.read (chunkio.read_to_end: ~5 of the ~10 us a zarr.json took through a file object)
        path = f"{self.url}/{rel}" if rel else self.url
        try:
            fd = os.open(path, os.O_RDONLY)
        except (IsADirectoryError, NotADirectoryError):
            raise FileNotFoundError(self.where(rel)) from None
        try:
            return read_to_end(fd)
        except IsADirectoryError:  # os.open opens a directory; reading it fails
            raise FileNotFoundError(self.where(rel)) from None
        except OSError as e:  # os.read names no file
            raise type(e)(e.errno, e.strerror, path) from None
        finally:
            os.close(fd)

    def makedirs(self, rels: list[str]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        for r in rels:
            self._p(r).mkdir(exist_ok=True)

    def refuse_creation(self, others: list[str]) -> str | None:
        if self.path.exists() and not self.path.is_dir():
            return f"{self.path} exists and is not a directory"
        if others:
            return f"{self.path} is a non-empty directory without {FORMAT_FILE}; refusing to make it a store"
        return None

    def zarr_location(self, rel: str) -> str:
        return str(self._p(rel))

    def unwritable(self, rels: list[str]) -> tuple[str, str] | None:
        """The first existing directory of ``rels`` this process may not write (a read-only mount,
        no write permission)."""
        for r in rels:
            d = self._p(r)
            if d.exists() and not os.access(d, os.W_OK | os.X_OK):
                try:
                    why = "read-only file system" if os.statvfs(d).f_flag & os.ST_RDONLY else "permission denied"
                except OSError as e:
                    why = e.strerror or str(e)
                return str(d), why
        return None

    sep = os.sep

    @property
    def tables_url(self) -> str:
        return str(self.path / TABLES_DIR)

    def read_schema(self, rel: str) -> pa.Schema:
        return pq.read_schema(self._p(rel))

    def read_parquet_metadata(self, rel: str) -> pq.FileMetaData:
        return pq.read_metadata(self._p(rel))

    def read_parquet_footer(self, rel: str) -> bytes:
        with open(self._p(rel), "rb") as f:
            return _footer_of(f)

    def read_row_groups(self, rel: str, groups: list[int] | None, columns: list[str] | None) -> pa.Table:
        with open(self._p(rel), "rb") as f:
            with naming_segment(self.where(rel)):
                return _row_groups(checked_file(f, read_dictionary=columns), groups, columns)

    def put(self, rel: str, data: bytes, if_absent: bool = False, durable: bool = False) -> None:
        from capturestore.tables import fsync_path

        final = self._p(rel)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the directory should be: not "the key exists"
            raise NotADirectoryError(f"{final.parent} is not a directory") from None
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident():x}{TMP_SUFFIX}")
        try:
            tmp.write_bytes(data)
            if durable:
                fsync_path(tmp)
            if if_absent:
                os.link(tmp, final)  # fails, replacing nothing, when ``final`` exists
            else:
                os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        if durable:
            fsync_path(final.parent)

    def exists(self, rel: str) -> bool:
        return self._p(rel).exists()

    def listdir(self, rel: str) -> list[str]:
        d = self._p(rel)
        try:
            return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        except FileNotFoundError:
            return []

    def find(self, rel: str) -> dict[str, int]:
        base = self._p(rel.rstrip("/"))
        if base.is_file():
            return {rel: base.stat().st_size}
        out = {}
        for dirpath, _, files in os.walk(base):
            for f in files:
                p = Path(dirpath) / f
                try:
                    size = p.stat().st_size
                except FileNotFoundError:  # renamed or removed since the walk listed it (a writer's temp file)
                    continue
                out[p.relative_to(self.path).as_posix()] = size
        return out

    def remove(self, rels: list[str]) -> None:
        for r in rels:
            p = self._p(r)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._p(rel), ignore_errors=True)

    def zarr_store(self, rel: str) -> zarr.storage.LocalStore:
        return zarr.storage.LocalStore(str(self._p(rel)))

    def writer_lock(self, writer_id: str, info: dict[str, Any]):
        from capturestore.integrity import PendingLock

        return PendingLock(self.path, writer_id, info)

    def liveness(self) -> Callable[[str], bool]:
        from capturestore.integrity import writer_is_alive

        return lambda writer_id: writer_is_alive(self.path / PENDING_DIR / f"{writer_id}.json")

    def dead_temp_files(self) -> list[str]:
        """Temp files (segments, catalog, pending, format) whose writing process is gone."""
        from capturestore.integrity import pid_is_alive

        out = []
        dirs = ["", PENDING_DIR] + [f"{TABLES_DIR}/{t}" for t in self.listdir(TABLES_DIR)]
        for d in dirs:
            if not self._p(d).is_dir():
                continue
            for name in self.listdir(d):
                if not name.endswith(TMP_SUFFIX) and not name.endswith(".tmp.wal"):
                    continue
                m = _TMP_PID.search(name.removesuffix(".wal"))
                if m is None or not pid_is_alive(int(m.group(1))):
                    out.append(f"{d}/{name}" if d else name)
        return out

    def catalog_problems(self) -> list[str]:
        from capturestore.catalog import catalog_problems

        return catalog_problems(self.path)

    def refresh_catalog(self) -> None:
        from capturestore.catalog import ensure_catalog_file

        ensure_catalog_file(self.path)

    def sync_tree(self, rel: str) -> None:
        from capturestore.tables import fsync_tree

        fsync_tree(self._p(rel))


# ------------------------------------------------------------------------------ fsspec (bucket, memory)


class FsspecBackend(Backend):
    """What an fsspec filesystem gives every backend built on one (objectstore.S3Backend,
    MemoryBackend): keys under ``<bucket>/<prefix>``, DuckDB reading the segments through the
    same filesystem (catalog.py registers ``fs`` on its confined connection)."""

    scheme = ""
    fs: Any
    bucket: str
    prefix: str

    def key(self, rel: str = "") -> str:
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    def rel(self, key: str) -> str:
        base = self.key() + "/"
        return key.removeprefix(base)

    @property
    def root(self) -> str:
        return self.url

    @property
    def tables_url(self) -> str:
        return f"{self.scheme}{self.key(TABLES_DIR)}"

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self.key(rel))

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """{rel: bytes, None where missing}, fetched concurrently."""
        if not rels:
            return {}
        keys = [self.key(r) for r in rels]
        got = self.fs.cat(keys, on_error="return")
        out = {}
        for r, k in zip(rels, keys):
            v = got.get(k) if isinstance(got, dict) else got
            if isinstance(v, FileNotFoundError):
                v = None
            elif isinstance(v, BaseException):
                raise v
            out[r] = v
        return out

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.key(rel))

    def info(self, rel: str) -> dict | None:
        try:
            return self.fs.info(self.key(rel))
        except FileNotFoundError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.key(rel), detail=False))
        except FileNotFoundError:
            return []

    def find(self, rel: str) -> dict[str, int]:
        try:
            found = self.fs.find(self.key(rel), detail=True)
        except FileNotFoundError:
            return {}
        return {self.rel(k): int(v.get("size") or 0) for k, v in found.items() if v.get("type") != "directory"}

    def remove(self, rels: list[str]) -> None:
        keys = [self.key(r) for r in rels]
        if keys:
            try:
                self.fs.rm(keys)
            except FileNotFoundError:
                pass

    # ---- tables (catalog.py reads these for the views) -----------------------------------------
    @property
    def duckdb_filesystem(self) -> Any:
        return self.fs

    def read_schema(self, rel: str) -> pa.Schema:
        with self.fs.open(self.key(rel), "rb") as f:
            return pq.read_schema(f)

    def read_parquet_metadata(self, rel: str) -> pq.FileMetaData:
        with self.fs.open(self.key(rel), "rb") as f:
            return pq.read_metadata(f)

    def read_parquet_footer(self, rel: str) -> bytes:
        with self.fs.open(self.key(rel), "rb") as f:
            return _footer_of(f)

    def read_row_groups(self, rel: str, groups: list[int] | None, columns: list[str] | None) -> pa.Table:
        with self.fs.open(self.key(rel), "rb") as f:
            with naming_segment(self.where(rel)):
                return _row_groups(checked_file(f, read_dictionary=columns), groups, columns)


# ------------------------------------------------------------------------------ memory


class _MemoryLock:
    """A memory store's pending object, alive while held (this process is the only writer)."""

    def __init__(self, backend: MemoryBackend, writer_id: str, info: dict[str, Any]):
        self.backend, self.writer_id, self.rel = backend, writer_id, f"{PENDING_DIR}/{writer_id}.json"
        self._info = {"pid": os.getpid(), **info}
        with backend._put_lock:  # created if absent, or taken over from a writer no longer holding it
            if writer_id in backend.held:
                raise WriterIdTaken(f"{backend.url}: writer id {writer_id} is already taken by another writer")
            backend.fs.pipe_file(backend.key(self.rel), json.dumps(self._info).encode())
            backend.held.add(writer_id)

    def rewrite(self, info: dict[str, Any]) -> None:
        if self.writer_id in self.backend.held:
            self._info = {**self._info, **info}
            self.backend.put(self.rel, json.dumps(self._info).encode())

    def release(self) -> None:
        if self.writer_id in self.backend.held:
            self.backend.remove([self.rel])
            self.backend.held.discard(self.writer_id)


_MEMORY: dict[str, MemoryBackend] = {}  # name -> backend: ``memory://name`` reopens the same store
_MEMORY_LOCK = threading.Lock()
_counter = itertools.count()


class MemoryBackend(FsspecBackend):
    """A store held in this process's memory (fsspec's memory filesystem): fast tests of
    everything above the bytes. ``Store.open("memory://name")``; ``memory://`` alone: a new one."""

    scheme = MEMORY_SCHEME

    def __init__(self, name: str):
        from fsspec.implementations.memory import MemoryFileSystem

        self.fs = MemoryFileSystem()
        self.bucket, self.prefix = f"capturestore-{name}", ""
        self.url = f"{MEMORY_SCHEME}{name}"
        self.held: set[str] = set()
        self._put_lock = threading.Lock()

    @classmethod
    def named(cls, url: str) -> MemoryBackend:
        name = url[len(MEMORY_SCHEME):].strip("/")
        with _MEMORY_LOCK:
            if not name:
                name = f"store{os.getpid()}-{next(_counter)}"
            if "/" in name or not re.fullmatch(r"[0-9A-Za-z_.-]+", name):
                raise StoreError(f"store {url}: a memory store's name is one plain word (memory://NAME)")
            if name not in _MEMORY:
                _MEMORY[name] = cls(name)
            return _MEMORY[name]

    def put(self, rel: str, data: bytes, if_absent: bool = False, durable: bool = False) -> None:
        with self._put_lock:  # the check and the write are one step: no other writer is in between
            if if_absent and self.exists(rel):
                raise FileExistsError(self.key(rel))
            self.fs.pipe_file(self.key(rel), bytes(data))

    def key(self, rel: str = "") -> str:  # the memory filesystem's paths start with '/'
        return "/" + super().key(rel)

    def zarr_store(self, rel: str) -> zarr.abc.store.Store:
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

        return zarr.storage.FsspecStore(AsyncFileSystemWrapper(self.fs, asynchronous=True), path=self.key(rel))

    def writer_lock(self, writer_id: str, info: dict[str, Any]) -> _MemoryLock:
        return _MemoryLock(self, writer_id, info)

    def liveness(self) -> Callable[[str], bool]:
        return lambda writer_id: writer_id in self.held


def backend_for(path: str | os.PathLike) -> Backend:
    """The backend of the store at ``path``: a directory (or ``file://`` URL), ``s3://bucket/prefix``
    (objectstore.S3Backend; endpoint and credentials from the AWS_* variables) or ``memory://name``."""
    from capturestore import objectstore

    if isinstance(path, str) and path.startswith(MEMORY_SCHEME):
        return MemoryBackend.named(path)
    if objectstore.is_url(path):
        return objectstore.S3Backend(str(path))
    if isinstance(path, str) and path.startswith("file://"):
        path = path.removeprefix("file://")
    from capturestore.store import store_root

    return LocalBackend(store_root(path))
