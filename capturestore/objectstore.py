"""A capture store on object storage: ``Store.open("s3://bucket/prefix")``.

The layout is a directory store's (layout.py) under a key prefix: Zarr v3 arrays through
zarr's own ``FsspecStore`` (s3fs), Parquet segments read by pyarrow and by DuckDB through the
same fsspec filesystem registered on its confined connection (catalog.py). There is no
``catalog.duckdb`` on object storage: queries build their views in memory, as they do on a
directory. Endpoint and credentials come from the standard variables ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` (any S3-compatible server).

Commit protocol without POSIX locks or renames (docs/scale.md):

- every key a writer creates is its own: under ``arrays.zarr/<run_id>/``, the segments named
  after the run (``tables/*/<run_id>.parquet``) or a fresh uuid, the lease ``pending/<id>.json``;
  run and comparison ids carry 32 random bits and the lease is created with ``If-None-Match: *``,
  so an id two writers drew alike is refused to the second, never shared;
- segments are single PUTs, conditional (``If-None-Match: *``) where the server supports it
  (AWS S3, MinIO, moto do): an object is visible whole or not at all, none is ever replaced;
- the ``runs`` segment (for a comparison, its ``comparisons`` row) is PUT last, after the arrays
  and the other segments: the commit marker, as on a directory;
- liveness is a lease: the writer re-PUTs ``pending/<id>.json`` every ``lease_s / 3`` seconds;
  a writer whose lease object is older than its ``lease_s`` by the server's clock (read from a
  probe object's Last-Modified, never the local clock) is dead, and ``gc`` removes what it left.
"""
from __future__ import annotations

import io
import json
import os
import socket
import threading
import uuid
import weakref
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from capturestore import integrity
from capturestore.arrays import ArrayRef, crc_problem, open_array
from capturestore.chunkio import read_region
from capturestore.errors import FormatVersionError, StoreError
from capturestore.layout import (
    ARRAYS_DIR,
    COMPARISON_ID_PREFIX,
    FORMAT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    PENDING_DIR,
    TABLES_DIR,
    chunk_keys,
)
from capturestore.store import Store, _is_layout_entry, parse_format
from capturestore.tables import (
    RUN_TABLES,
    SCHEMA_SEGMENT,
    SCHEMAS,
    _unifiable,
)

SCHEMES = ("s3://",)
LEASE_ENV = "CAPTURESTORE_LEASE_S"
DEFAULT_LEASE_S = 120.0  # a writer's lease; heartbeats every third of it


# Arrays written whole (write_kv, write_logits) go into shards of up to this many bytes: one
# object per shard instead of one per chunk. Measured (benchmarks/bench_scale.py, docs/scale.md):
# 16 MiB shards cut the objects of a run 2.5x for 0.6x the write/read throughput through the S3
# API here; 64 MiB shards cut them 4x but a one-layer read took 14x longer. $CAPTURESTORE_SHARD_MIB
# overrides (0: one object per chunk).
SHARD_ENV = "CAPTURESTORE_SHARD_MIB"
SHARD_BYTES: int | None = 16 << 20


def shard_bytes() -> int | None:
    raw = os.environ.get(SHARD_ENV)
    if not raw:
        return SHARD_BYTES
    try:
        mib = int(raw)
    except ValueError:
        raise StoreError(f"${SHARD_ENV}={raw!r} is not a whole number of MiB (0: no shards)") from None
    if mib < 0:
        raise StoreError(f"${SHARD_ENV}={raw!r} must be >= 0 (0: no shards)")
    return mib << 20 if mib else None


def shard_shape(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int,
                target: int | None) -> tuple[int, ...] | None:
    """Chunks grouped along the first axis (layers, generation tokens) and spanning the rest of
    the array, up to ``target`` bytes (at least one chunk row: a layer larger than ``target`` is
    one shard); None when a shard would hold a single chunk anyway."""
    if target is None or not shape or any(s == 0 for s in shape):
        return None
    rest = [-(-s // c) * c for s, c in zip(shape[1:], chunks[1:])]  # whole array beyond axis 0, chunk multiples
    per_row = int(np.prod(rest, dtype=np.int64)) * itemsize
    rows = max(chunks[0], (target // max(1, per_row)) // chunks[0] * chunks[0])
    rows = min(rows, -(-shape[0] // chunks[0]) * chunks[0])
    out = (rows, *rest)
    return None if out == tuple(chunks) else out


def is_url(path: Any) -> bool:
    """True for an object-storage URL (``s3://...``); other ``scheme://`` URLs are refused by name."""
    if not isinstance(path, str) or "://" not in path:
        return False
    if path.startswith("file://"):
        return False
    if not path.startswith(SCHEMES):
        raise StoreError(f"store {path}: unsupported URL scheme {path.split('://')[0]!r}; use a directory, "
                         f"file://PATH or s3://BUCKET/PREFIX")
    return True


def open_url(url: str, create: bool = True) -> RemoteStore:
    return RemoteStore.open_url(url, create=create)


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV)
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        raise StoreError(f"${LEASE_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise StoreError(f"${LEASE_ENV}={raw!r} must be positive")
    return value


# ------------------------------------------------------------------------------ the bucket


def _error_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", ""))
    return ""


_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                     "InvalidToken", "Forbidden", "403")


class ObjectStorage:
    """One store's bucket and key prefix, and the few operations the store needs of it."""

    def __init__(self, url: str):
        rest = url[len("s3://"):].strip("/")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StoreError(f"store {url}: no bucket in the URL (s3://BUCKET/PREFIX)")
        if "\\" in rest or "//" in rest or any(p in (".", "..") for p in rest.split("/")):
            raise StoreError(f"store {url}: the key prefix must be plain '/'-separated names")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{self.key()}"
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
        self._conditional = True  # If-None-Match honoured; False once the server says it is not
        self.fs = self._filesystem(asynchronous=False)

    def _filesystem(self, asynchronous: bool):
        import s3fs

        client = {"region_name": os.environ["AWS_REGION"]} if os.environ.get("AWS_REGION") else {}
        return s3fs.S3FileSystem(
            endpoint_url=self.endpoint, client_kwargs=client, skip_instance_cache=True, asynchronous=asynchronous,
            use_listings_cache=False,  # other writers add objects: every listing asks the server
            config_kwargs={"connect_timeout": 5, "read_timeout": 60,
                           "retries": {"max_attempts": 3, "mode": "standard"}})

    @property
    def afs(self):
        """The asynchronous twin of ``fs`` that zarr's FsspecStore needs (one per store, closed with it)."""
        if getattr(self, "_afs", None) is None:
            self._afs = self._filesystem(asynchronous=True)
            weakref.finalize(self, _close_async, self._afs)
        return self._afs

    def zarr_store(self, rel: str = ARRAYS_DIR) -> zarr.storage.FsspecStore:
        return zarr.storage.FsspecStore(self.afs, path=self.key(rel))

    # ---- names -------------------------------------------------------------------------------
    def key(self, rel: str = "") -> str:
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    def rel(self, key: str) -> str:
        base = self.key() + "/"
        return key[len(base):] if key.startswith(base) else key

    @property
    def tables_url(self) -> str:
        return f"s3://{self.key(TABLES_DIR)}"

    def where(self) -> str:
        return f"{self.url} (endpoint {self.endpoint or 'the AWS default'})"

    # ---- errors ------------------------------------------------------------------------------
    def explain(self, e: BaseException) -> StoreError | None:
        """The one-line StoreError of a connection, bucket or credentials failure (None: another error).
        Never shows a credential: the secret key is scrubbed from any message that might hold it."""
        import botocore.exceptions as bex

        msg = " ".join(str(e).split()) or type(e).__name__
        for secret in (os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")):
            if secret:
                msg = msg.replace(secret, "***")
        code = _error_code(e)
        if isinstance(e, (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ConnectionClosedError,
                          ConnectionError, TimeoutError)) or "Could not connect" in msg:
            return StoreError(f"cannot reach {self.url}: endpoint {self.endpoint or 'the AWS default'} does not "
                              f"answer ({msg}); check AWS_ENDPOINT_URL")
        if isinstance(e, bex.NoCredentialsError):
            return StoreError(f"{self.where()}: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if isinstance(e, PermissionError) or code in _CREDENTIAL_CODES:
            return StoreError(f"{self.where()}: the credentials were refused ({msg}); check AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY (not shown)")
        if code == "NoSuchBucket" or "bucket does not exist" in msg:
            return StoreError(f"{self.where()}: bucket {self.bucket!r} does not exist; create it first")
        return None

    def check(self) -> None:
        """One listing: the endpoint answers, the bucket exists, the credentials are accepted."""
        try:
            self.fs.ls(self.bucket, detail=False)
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            raise (self.explain(e) or StoreError(f"{self.where()}: cannot list the bucket ({e})")) from None

    # ---- objects -----------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        return self.fs.cat_file(self.key(rel))

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """{rel: bytes, None where missing}, fetched concurrently."""
        if not rels:
            return {}
        keys = [self.key(r) for r in rels]
        got = self.fs.cat(keys, on_error="return")
        out = {}
        for r, k in zip(rels, keys):
            v = got.get(k)
            if isinstance(v, FileNotFoundError):
                v = None
            elif isinstance(v, BaseException):
                raise v
            out[r] = v
        return out

    def put(self, rel: str, data: bytes, if_absent: bool = False) -> None:
        """One PUT (atomic: whole or not at all); ``if_absent``: FileExistsError when the key exists
        (``If-None-Match: *``; on a server without conditional writes, a HEAD first)."""
        key = self.key(rel)
        if if_absent and self._conditional:
            try:
                self.fs.pipe_file(key, data, IfNoneMatch="*")
                return
            except FileExistsError:
                raise
            except Exception as e:  # noqa: BLE001
                if _error_code(e) not in ("NotImplemented", "501") and "NotImplemented" not in str(e):
                    raise
                self._conditional = False
        if if_absent and self.fs.exists(key):
            raise FileExistsError(key)
        self.fs.pipe_file(key, data)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.key(rel))

    def info(self, rel: str) -> dict | None:
        try:
            return self.fs.info(self.key(rel))
        except FileNotFoundError:
            return None

    def listdir(self, rel: str) -> list[str]:
        """Names directly under ``rel`` (objects and common prefixes); [] when nothing is there."""
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.key(rel), detail=False))
        except FileNotFoundError:
            return []

    def find(self, rel: str) -> dict[str, dict]:
        """{rel key: info} of every object under ``rel``."""
        try:
            found = self.fs.find(self.key(rel), detail=True)
        except FileNotFoundError:
            return {}
        return {self.rel(k): v for k, v in found.items() if v.get("type") != "directory"}

    def remove(self, rels: list[str]) -> None:
        keys = [self.key(r) for r in rels]
        if keys:
            self.fs.rm(keys)

    def remove_tree(self, rel: str) -> None:
        self.remove(list(self.find(rel)))

    def server_now(self) -> datetime:
        """The server's clock: the Last-Modified of a probe object PUT now (removed again)."""
        rel = f"{PENDING_DIR}/.clock-{uuid.uuid4().hex}"
        try:
            self.put(rel, b"")
        except PermissionError:  # read-only credentials (`capturestore runs`): this host's clock
            return datetime.now(timezone.utc)
        try:
            return _modified(self.info(rel))
        finally:
            self.remove([rel])

    # ---- tables (catalog.py reads these for the views) -----------------------------------------
    def segment_rels(self, table: str) -> list[str]:
        return [f"{TABLES_DIR}/{table}/{n}" for n in self.listdir(f"{TABLES_DIR}/{table}") if n.endswith(".parquet")]

    def segment_urls(self, table: str) -> list[str]:
        return [f"s3://{self.key(r)}" for r in self.segment_rels(table)]

    def table_names(self) -> list[str]:
        return [t for t in self.listdir(TABLES_DIR) if self.segment_rels(t)]

    def read_parquet(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(io.BytesIO(self.read(rel)), columns=columns)

    def read_schema(self, rel: str) -> pa.Schema:
        with self.fs.open(self.key(rel), "rb") as f:
            return pq.read_schema(f)

    def has_column(self, table: str, column: str) -> bool:
        for rel in self.segment_rels(table):
            try:
                if column in self.read_schema(rel).names:
                    return True
            except Exception:  # noqa: BLE001 - an unreadable segment is verify's to report
                continue
        return False


def _close_async(fs) -> None:
    """Close an asynchronous s3fs session on zarr's event loop (s3fs closes only its synchronous ones)."""
    creator = getattr(fs, "_s3creator", None)
    if creator is None:
        return
    try:
        from zarr.core.sync import _get_loop

        type(fs).close_session(_get_loop(), creator)
    except Exception:  # noqa: BLE001 - at exit, best effort
        pass


def _modified(info: dict | None) -> datetime:
    value = (info or {}).get("LastModified")
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(str(value))


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ------------------------------------------------------------------------------ the lease


class Lease:
    """``pending/<id>.json`` on object storage: created with If-None-Match, re-PUT by a heartbeat
    thread every ``lease_s / 3`` seconds until ``release`` removes it. The object store's
    stand-in for integrity.PendingLock (whose flock the kernel drops when the writer dies)."""

    def __init__(self, storage: ObjectStorage, writer_id: str, info: dict[str, Any], lease_s: float):
        self.storage, self.rel, self.lease_s = storage, f"{PENDING_DIR}/{writer_id}.json", lease_s
        self._info = {"pid": os.getpid(), "hostname": socket.gethostname(),
                      "started_at": datetime.now(timezone.utc).isoformat(), "lease_s": lease_s, **info}
        try:
            storage.put(self.rel, json.dumps(self._info).encode(), if_absent=True)
        except FileExistsError:
            raise StoreError(f"{storage.url}: writer id {writer_id} is already taken by another writer") from None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name=f"capturestore-lease-{writer_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if not self.storage.exists(self.rel):  # gc took it (we stalled past the lease): stay dead
                        self.lost = True
                        return
                    self.storage.put(self.rel, json.dumps(self._info).encode())
                except Exception:  # noqa: BLE001 - a missed beat; the next one retries
                    pass

    lost = False

    def rewrite(self, info: dict[str, Any]) -> None:
        with self._lock:
            self._info = {**self._info, **info}
            if not self._stop.is_set():
                self.storage.put(self.rel, json.dumps(self._info).encode())

    def release(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        try:
            self.storage.remove([self.rel])
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------------------ the store


class RemoteStore(Store):
    """A capture store under ``s3://bucket/prefix``: the Store API, object storage underneath."""

    def __init__(self, storage: ObjectStorage):
        self.storage = storage
        self.root = storage.url
        self._zstore = storage.zarr_store()
        self._committed: set[str] = set()
        self._con = None
        self._con_tables: list[str] = []
        self._con_broken: dict[str, str] = {}
        self._con_pid = -1
        self._con_lock = threading.Lock()
        self._segment_columns: dict[str, dict[str, tuple[pa.DataType, str]]] = {}
        self._segment_schemas = {}
        self.lease_s = lease_seconds()
        self.shard_bytes = shard_bytes()  # None: one object per chunk
        # a committed run never changes: its segments and array metadata are read once per Store
        self._run_segments: dict[tuple[str, str], pa.Table] = {}
        self._array_meta: dict[str, dict] = {}
        self._server_skew = None

    @classmethod
    def open_url(cls, url: str, create: bool = True) -> RemoteStore:
        storage = ObjectStorage(url)
        storage.check()  # unreachable, no bucket, credentials refused: one line, before anything is written
        try:
            info = parse_format(storage.read(FORMAT_FILE).decode(), f"{storage.url}/{FORMAT_FILE}")
        except FileNotFoundError:
            info = None
        except Exception as e:  # noqa: BLE001
            raise (storage.explain(e) or e) from None
        if info is None:
            if not create:
                raise StoreError(f"{storage.url} is not a capture store (no {FORMAT_FILE}); "
                                 f"Store.open(url, create=True) makes a new one")
            other = [n for n in storage.listdir("") if not _is_layout_entry(n)]
            if other:
                raise StoreError(f"{storage.url} holds other objects ({', '.join(other[:3])}) and no {FORMAT_FILE}; "
                                 f"refusing to make it a store")
            cls._create_remote_layout(storage)
        elif info["format_version"] > FORMAT_VERSION:
            raise FormatVersionError(
                f"store {storage.url} has format version {info['format_version']}, newer than the {FORMAT_VERSION} "
                f"this capturestore reads; upgrade capturestore to open it")
        store = cls(storage)
        store._committed = store._committed_ids()
        return store

    @staticmethod
    def _create_remote_layout(storage: ObjectStorage) -> None:
        zarr.open_group(store=storage.zarr_store(), mode="a", zarr_format=3)
        for name, schema in SCHEMAS.items():
            try:
                storage.put(f"{TABLES_DIR}/{name}/{SCHEMA_SEGMENT}", _parquet_bytes(schema.empty_table()),
                            if_absent=True)
            except FileExistsError:
                pass
        try:  # written last: a prefix without it is not a store
            storage.put(FORMAT_FILE, (json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION}, indent=2)
                                      + "\n").encode(), if_absent=True)
        except FileExistsError:  # a concurrent creation made it first
            pass

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    def __reduce__(self):  # picklable (multiprocessing, Dask): reopen by URL in the other process
        return (Store.open, (self.root, False))

    # ---- storage hooks (see Store) -----------------------------------------------------------
    def _committed_ids(self) -> set[str]:
        return {n.removesuffix(".parquet") for n in self.storage.listdir(f"{TABLES_DIR}/runs")
                if n.endswith(".parquet") and n != SCHEMA_SEGMENT}

    def _pending_lock(self, writer_id: str, info: dict[str, Any]) -> Lease:
        return Lease(self.storage, writer_id, info, self.lease_s)

    def _writer_alive(self, writer_id: str, now: datetime | None = None) -> bool:
        info = self.storage.info(f"{PENDING_DIR}/{writer_id}.json")
        if info is None:
            return False
        try:
            lease = float(json.loads(self.storage.read(f"{PENDING_DIR}/{writer_id}.json")).get("lease_s", self.lease_s))
        except (FileNotFoundError, ValueError, TypeError):
            lease = self.lease_s
        now = now or self.storage.server_now()
        return (now - _modified(info)).total_seconds() < lease

    def _write_block(self, ref, arr, block, offset, compressed, pending) -> bool:
        return False  # zarr writes the chunks through its FsspecStore (one PUT each)

    def _shard_shape(self, shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
        return shard_shape(shape, chunks, itemsize, self.shard_bytes)

    def _write_segment(self, table: str, data: pa.Table, segment: str | None = None, durable: bool = False) -> str:
        if segment is None:
            segment = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex}"
        rel = f"{TABLES_DIR}/{table}/{segment}.parquet"
        if table == "runs" and not self.storage.exists(f"{PENDING_DIR}/{segment}.json"):
            # the marker would point at what gc may be removing: a writer stalled past its lease
            raise StoreError(f"{self.root}: run {segment} lost its lease (stalled longer than {self.lease_s:g} s, "
                             f"${LEASE_ENV}); gc may have removed its arrays, so it is not committed")
        try:
            self.storage.put(rel, _parquet_bytes(data), if_absent=True)
        except FileExistsError:
            raise StoreError(f"{self.root}: segment {rel} already exists; segments are never replaced") from None
        return rel

    def _segment_exists(self, table: str, segment: str) -> bool:
        return self.storage.exists(f"{TABLES_DIR}/{table}/{segment}.parquet")

    def _remove_segment(self, table: str, segment: str) -> None:
        if self._segment_exists(table, segment):
            self.storage.remove([f"{TABLES_DIR}/{table}/{segment}.parquet"])

    def _remove_written(self, segment: str) -> None:
        if self.storage.exists(segment):
            self.storage.remove([segment])

    def segment_names(self, table: str) -> list[str]:
        return [rel.rsplit("/", 1)[-1] for rel in self.storage.segment_rels(table)]

    def read_segment(self, table: str, name: str) -> bytes:
        return self.storage.read(f"{TABLES_DIR}/{table}/{name}")

    def segment_comparison_ids(self, table: str, name: str) -> set[str] | None:
        rel = f"{TABLES_DIR}/{table}/{name}"
        if "comparison_id" not in self.storage.read_schema(rel).names:
            return None
        return set(self.storage.read_parquet(rel, ["comparison_id"]).column(0).to_pylist()) - {None}

    def _committed_comparison_ids(self) -> set[str] | None:
        out: set[str] = set()
        for rel in self.storage.segment_rels("comparisons"):
            try:
                out |= set(self.storage.read_parquet(rel, ["comparison_id"]).column(0).to_pylist())
            except Exception:  # noqa: BLE001 - verify reports unreadable segments
                return None
        out.discard(None)
        return out

    def _refresh_catalog(self) -> None:
        pass  # no catalog.duckdb on object storage

    def _remove_run_arrays(self, run_id: str) -> None:
        self.storage.remove_tree(f"{ARRAYS_DIR}/{run_id}")

    def _sync_run_arrays(self, run_id: str) -> None:
        pass  # a PUT returns once the object is stored

    def _stored_bytes(self, ref: ArrayRef) -> int:
        return sum(int(v.get("size", 0)) for v in self.storage.find(f"{ARRAYS_DIR}/{ref.path}/c").values())

    # ---- writing tables: Store.append_table with these checks ----------------------------------
    def _table_exists(self, name: str) -> bool:
        return True  # no catalog.duckdb to refresh for a new table

    def _check_comparison_rows(self, table: str, comparison_ids) -> None:
        ids = set(comparison_ids)
        if None in ids:
            raise ValueError(f"append_table {table}: a comparison_id is NULL; rows with a comparison_id column "
                             f"belong to a comparison (see docs/tables.md)")
        committed = self._committed_comparison_ids() or set()
        integrity.check_sealed(self, table, sorted(ids & committed))
        for c in sorted(ids - committed):
            if not self.storage.exists(f"{PENDING_DIR}/{c}.json"):
                raise ValueError(f"append_table {table}: comparison_id {c!r} is no committed comparison and none is "
                                 f"being written; its rows would be invisible and removed by gc")

    def _check_segment_types(self, name: str, table: pa.Table) -> None:
        cols = self._segment_columns.setdefault(name, {})
        seen = self._segment_schemas.setdefault(name, set())
        for rel in self.storage.segment_rels(name):
            if rel in seen:
                continue
            try:
                schema = self.storage.read_schema(rel)
            except Exception:  # noqa: BLE001
                continue
            seen.add(rel)
            for f in schema:
                cols.setdefault(f.name, (f.type, rel.rsplit("/", 1)[-1]))
        for f in table.schema:
            have = cols.get(f.name)
            if have is not None and not _unifiable(have[0], f.type):
                raise ValueError(f"append_table {name}: column {f.name!r} is {f.type} here but {have[0]} in segment "
                                 f"{name}/{have[1]}; one table cannot hold both (DuckDB could not read the table)")

    # ---- reading -----------------------------------------------------------------------------
    def _ref(self, run_id: str, prompt_id: str, name: str) -> tuple[ArrayRef, dict[str, Any]]:
        self._require_run(run_id)
        ref = ArrayRef(run_id, prompt_id, name)
        if isinstance(prompt_id, str) and ref.path in self._array_meta:
            return ref, self._array_meta[ref.path]
        if not isinstance(prompt_id, str) or not self.storage.exists(f"{ARRAYS_DIR}/{run_id}/{prompt_id}/zarr.json"):
            raise ValueError(f"run {run_id} has no prompt {prompt_id!r}")
        try:
            meta = self._array_meta[ref.path] = json.loads(self.storage.read(f"{ARRAYS_DIR}/{ref.path}/zarr.json"))
        except FileNotFoundError:
            have = sorted(self._remote_array_names(run_id, prompt_id))
            raise ValueError(f"run {run_id}, prompt {prompt_id} has no array {name!r}; it has {have}") from None
        except ValueError as e:
            raise StoreError(f"{ref.where()}: array metadata zarr.json is unreadable ({e})") from None
        return ref, meta

    def _remote_array_names(self, run_id: str, prompt_id: str) -> list[str]:
        base = f"{ARRAYS_DIR}/{run_id}/{prompt_id}/"
        metas = [k for k in self.storage.find(base) if k.endswith("/zarr.json") and k != base + "zarr.json"]
        got = self.storage.read_many(metas)
        return [k[len(base):-len("/zarr.json")] for k, v in got.items()
                if v is not None and json.loads(v).get("node_type") == "array"]

    def _read(self, ref: ArrayRef, meta: dict[str, Any], region, as_torch: bool) -> Any:
        from capturestore.dtypes import from_storage

        shape = tuple(meta["shape"])
        chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        full = tuple(slice(0, n) for n in shape)
        region = full if region is None else tuple(region) + full[len(region):]
        codecs = [c["name"] for c in meta.get("codecs", [])]
        if codecs in (["bytes", "blosc", "crc32c"], ["bytes", "crc32c"]):
            base = f"{ARRAYS_DIR}/{ref.path}/"

            def fetch(keys: list[str]) -> dict[str, bytes | None]:
                got = self.storage.read_many([base + k for k in keys])
                return {k: got[base + k] for k in keys}

            bits = read_region(None, shape, chunks, np.dtype(meta["data_type"]), region, ref.where(),
                               compressed=len(codecs) == 3, fetch=fetch)
        else:  # sharded or another codec chain: zarr decodes (its crc32c codec checks every inner chunk)
            bits = _checked_zarr_read(self, ref, meta, region)
        return from_storage(bits, meta["attributes"]["logical_dtype"], as_torch, ref.where())

    def _tensor_phases(self, run_id: str, prompt_id: str, module: str, phase=None) -> list[str]:
        base = f"{ARRAYS_DIR}/{run_id}/{prompt_id}/tensors/{module}"
        names = self.storage.listdir(base)
        have = self.storage.read_many([f"{base}/{n}/zarr.json" for n in names])
        return sorted(n for n in names if have.get(f"{base}/{n}/zarr.json") is not None)

    def _prompt_group(self, run_id: str, prompt_id: str) -> Any:
        if not isinstance(prompt_id, str) or not self.storage.exists(f"{ARRAYS_DIR}/{run_id}/{prompt_id}/zarr.json"):
            return None
        return self.storage.zarr_store(f"{ARRAYS_DIR}/{run_id}/{prompt_id}")

    def _read_run_table(self, table: str, run_id: str | None = None) -> pa.Table:
        if run_id is not None and table != "runs":  # _require_run checked it is committed: cache its segment
            if (table, run_id) not in self._run_segments:
                self._run_segments[(table, run_id)] = self._read_run_table_now(table, run_id)
            return self._run_segments[(table, run_id)]
        return self._read_run_table_now(table, run_id)

    def _read_run_table_now(self, table: str, run_id: str | None = None) -> pa.Table:
        schema = SCHEMAS[table]
        rels = [r for r in self.storage.segment_rels(table) if not r.endswith("/" + SCHEMA_SEGMENT)]
        if table != "runs":
            ok = self._committed_ids()
            rels = [r for r in rels if r.rsplit("/", 1)[-1].removesuffix(".parquet") in ok]
        if run_id is not None:
            rels = [r for r in rels if r.endswith(f"/{run_id}.parquet")]
        got = self.storage.read_many(rels)
        parts = [pq.read_table(io.BytesIO(got[r])) for r in rels if got.get(r) is not None]
        parts = [p.select([n for n in schema.names if n in p.column_names]) for p in parts]
        if not parts:
            return schema.empty_table()
        return pa.concat_tables(parts, promote_options="default")

    def sql(self, query: str, params: dict | list | None = None) -> pa.Table:
        """As Store.sql: read-only, confined to this store's ``tables/`` (the s3:// URL), views in memory."""
        from capturestore import catalog

        with self._con_lock:
            names = catalog.table_names(self.storage)
            if self._con is None or self._con_pid != os.getpid():
                self._con = catalog.connect_memory(self.storage)
                self._con_pid = os.getpid()
                self._con_tables, self._con_broken = [], {}
            todo = sorted(set(names) - set(self._con_tables) | set(self._con_broken))
            if todo:
                self._con_broken = catalog.add_views(self._con, self.storage, todo)
                self._con_tables = names
            return catalog.run_query(self._con, query, names, self._con_broken, params)

    def pending(self) -> list[dict[str, Any]]:
        out = []
        committed = self._committed_ids()
        now = self.storage.server_now()
        for n in self.storage.listdir(PENDING_DIR):
            if not n.endswith(".json"):
                continue
            rid = n.removesuffix(".json")
            if rid in committed or integrity.is_comparison_id(rid):
                continue
            try:
                info = json.loads(self.storage.read(f"{PENDING_DIR}/{n}") or b"{}")
            except (FileNotFoundError, ValueError):
                info = {}
            out.append({"run_id": rid, "pid": info.get("pid"), "hostname": info.get("hostname"),
                        "started_at": info.get("started_at"), "status": info.get("status"),
                        "alive": self._writer_alive(rid, now)})
        return out

    # ---- maintenance -------------------------------------------------------------------------
    def rebuild_catalog(self):
        raise StoreError(f"{self.root}: a store on object storage has no {TABLES_DIR}-side catalog.duckdb; its queries "
                         f"(capturestore sql) build their views in memory")

    def verify(self) -> integrity.VerifyReport:
        """Segments readable, every committed run's arrays present with the catalogued shape and
        dtype and every chunk's CRC32C, tokens as catalogued, leftovers of dead writers, every
        committed comparison's segments against its manifest."""
        report = _verify(self)
        report.extend(integrity.evidence_problems(self))
        return report

    def gc(self, dry_run: bool = False) -> list[str]:
        """Remove what writers whose lease ran out left: arrays, segments without a commit marker,
        lease objects. A writer within its lease is never touched."""
        return _gc(self, dry_run)


def _checked_zarr_read(store: RemoteStore, ref: ArrayRef, meta: dict, region) -> np.ndarray:
    """arr[region] through zarr, refusing missing chunk/shard objects (zarr would read the fill value)."""
    from capturestore.errors import CorruptChunkError
    from capturestore.layout import chunk_keys_in_region

    grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    keys = [k for _, k in chunk_keys_in_region(tuple(meta["shape"]), grid, region)]
    base = f"{ARRAYS_DIR}/{ref.path}/"
    present = set(store.storage.find(base + "c"))
    missing = [k for k in keys if base + k not in present]
    if missing:
        raise CorruptChunkError(f"{ref.where()}, chunk {missing[0]}: chunk file is missing")
    from zarr.core.array import Array, AsyncArray
    from zarr.storage import StorePath

    arr = Array(AsyncArray(metadata=meta, store_path=StorePath(store._zstore, ref.path)))  # no second GET of zarr.json
    try:
        return arr[region]
    except Exception as e:  # noqa: BLE001
        listing = ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
        raise CorruptChunkError(f"{ref.where()}, shard {listing}: {' '.join(str(e).split())}") from None


# ------------------------------------------------------------------------------ verify and gc


def _dead_uncommitted(store: RemoteStore, now: datetime) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(run ids, {comparison id: its segments}, lease objects) left by writers whose lease ran out."""
    st = store.storage
    committed = store._committed_ids()
    pending = {n.removesuffix(".json") for n in st.listdir(PENDING_DIR) if n.endswith(".json")}
    seen = {n for n in st.listdir(ARRAYS_DIR) if n != "zarr.json"}
    for t in ("prompts", "captures"):
        seen |= {r.rsplit("/", 1)[-1].removesuffix(".parquet") for r in st.segment_rels(t)
                 if not r.endswith(SCHEMA_SEGMENT)}
    seen |= {i for i in pending if not integrity.is_comparison_id(i)}
    runs = [r for r in sorted(seen - committed) if not store._writer_alive(r, now)]
    runs = [r for r in runs if r not in store._committed_ids()]  # committed while we looked
    segments: dict[str, list[str]] = {}
    for t in st.table_names():
        if t in (*RUN_TABLES, "comparisons") or not st.has_column(t, "comparison_id"):
            continue
        for rel in st.segment_rels(t):
            try:
                ids = set(st.read_parquet(rel, ["comparison_id"]).column(0).to_pylist()) - {None}
            except Exception:  # noqa: BLE001 - reported as a bad segment
                continue
            if len(ids) == 1:
                segments.setdefault(next(iter(ids)), []).append(rel)
    ccommitted = store._committed_comparison_ids()
    if ccommitted is None:
        return runs, {}, []
    cmp_pending = {i for i in pending if integrity.is_comparison_id(i)}
    dead = {c: segments.get(c, []) for c in sorted((set(segments) | cmp_pending) - ccommitted)
            if not store._writer_alive(c, now)}
    ccommitted = store._committed_comparison_ids() or set()
    dead = {c: s for c, s in dead.items() if c not in ccommitted}
    stale = [f"{PENDING_DIR}/{i}.json" for i in sorted(pending)
             if (i in committed or i in ccommitted or i in dead) and i not in runs and not store._writer_alive(i, now)]
    return runs, dead, stale


def _verify(store: RemoteStore) -> integrity.VerifyReport:
    from capturestore.integrity import Problem
    from capturestore.writer import prompt_id as hash_prompt

    st = store.storage
    report = integrity.VerifyReport()
    for t in st.listdir(TABLES_DIR):
        for rel in st.segment_rels(t):
            try:
                st.read_parquet(rel).schema  # noqa: B018
            except Exception as e:  # noqa: BLE001
                run = rel.rsplit("/", 1)[-1].removesuffix(".parquet") if t in RUN_TABLES else None
                report.append(Problem("bad-segment", f"table {t} segment {rel.rsplit('/', 1)[-1]} is unreadable: {e}",
                                      run_id=run))
    for run_id in sorted(store._committed_ids()):
        try:
            rows = st.read_parquet(f"{TABLES_DIR}/runs/{run_id}.parquet", ["run_id", "status"]).to_pylist()
            caps = st.read_parquet(f"{TABLES_DIR}/captures/{run_id}.parquet").to_pylist()
            prompts = st.read_parquet(f"{TABLES_DIR}/prompts/{run_id}.parquet").to_pylist()
        except Exception as e:  # noqa: BLE001
            report.append(Problem("bad-segment", f"runs/prompts/captures segment unreadable: {e}", run_id=run_id))
            continue
        if rows != [{"run_id": run_id, "status": "complete"}]:
            report.append(Problem("bad-marker", "runs segment (the run's commit marker) does not hold one complete "
                                                "row of this run", run_id=run_id))
            continue
        objects = st.find(f"{ARRAYS_DIR}/{run_id}/")
        metas = st.read_many([f"{ARRAYS_DIR}/{run_id}/{c['prompt_id']}/{c['array_name']}/zarr.json" for c in caps])
        n_before = len(report)
        for c in caps:
            base = f"{ARRAYS_DIR}/{run_id}/{c['prompt_id']}/{c['array_name']}"
            where = {"run_id": run_id, "prompt_id": c["prompt_id"], "array": c["array_name"]}
            raw = metas.get(base + "/zarr.json")
            if raw is None:
                report.append(Problem("missing-array", "array is catalogued but missing from arrays.zarr", **where))
                continue
            meta = json.loads(raw)
            if list(meta["shape"]) != list(c["shape"]):
                report.append(Problem("shape-mismatch", f"catalog says shape {c['shape']}, array has {meta['shape']}",
                                      **where))
                continue
            report.checked_arrays += 1
            grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            keys = [k for _, k in chunk_keys(tuple(meta["shape"]), grid)]
            report.checked_chunks += len(keys)
            codecs = [x["name"] for x in meta.get("codecs", [])]
            if codecs and codecs[-1] == "crc32c":  # the CRC sits in the object: checked without decoding
                got = st.read_many([f"{base}/{k}" for k in keys])
                for k in keys:
                    why = crc_problem(got[f"{base}/{k}"])
                    if why:
                        report.append(Problem("corrupt-chunk", why, chunk=k, **where))
            else:  # sharded: each shard's index and inner chunks carry their CRCs; zarr checks them on read
                for k in keys:
                    if f"{base}/{k}" not in objects:
                        report.append(Problem("corrupt-chunk", "chunk file is missing", chunk=k, **where))
                try:
                    open_array(store._zstore, ArrayRef(run_id, c["prompt_id"], c["array_name"]))[...]
                except Exception as e:  # noqa: BLE001
                    report.append(Problem("corrupt-chunk", f"shard unreadable: {e}", **where))
        if len(report) == n_before:
            for p in prompts:
                tokens = store._read(*store._ref(run_id, p["prompt_id"], "tokens"), None, False)
                if p.get("token_ids") is not None and list(tokens) != list(p["token_ids"]):
                    report.append(Problem("tokens-mismatch", "tokens array differs from the prompts row's token_ids",
                                          run_id=run_id, prompt_id=p["prompt_id"], array="tokens"))
                elif hash_prompt(tokens[: p.get("n_prompt_tokens") or len(tokens)]) != p["prompt_id"]:
                    report.append(Problem("tokens-mismatch", "prompt_id is not the hash of its prompt tokens",
                                          run_id=run_id, prompt_id=p["prompt_id"], array="tokens"))
    runs, dead, stale = _dead_uncommitted(store, st.server_now())
    for run_id in runs:
        report.append(Problem("orphan", "uncommitted run left by a dead writer (run `capturestore gc`)", run_id=run_id))
    for cid, segs in dead.items():
        report.append(Problem("orphan", f"comparison {cid} never committed (no comparisons row), its writer is "
                                        f"dead; its rows are hidden: {', '.join(segs) or 'no segment'} "
                                        f"(run `capturestore gc`)"))
    for rel in stale:
        if rel.rsplit("/", 1)[-1].removesuffix(".json") not in dead:
            report.append(Problem("orphan", f"lease {rel} of a dead writer (run `capturestore gc`)"))
    return report


def _gc(store: RemoteStore, dry_run: bool) -> list[str]:
    st = store.storage
    runs, dead, stale = _dead_uncommitted(store, st.server_now())
    removed: list[str] = []
    for run_id in runs:  # arrays and segments first, the lease last: a gc cut short is resumed by the next
        objects = sorted(st.find(f"{ARRAYS_DIR}/{run_id}/"))
        segs = [r for t in ("prompts", "captures") for r in [f"{TABLES_DIR}/{t}/{run_id}.parquet"] if st.exists(r)]
        lease = [r for r in [f"{PENDING_DIR}/{run_id}.json"] if st.exists(r)]
        if objects:
            removed.append(f"{ARRAYS_DIR}/{run_id}")
        removed += segs + lease
        if not dry_run:
            st.remove(objects + segs)
            st.remove(lease)
    for rel in [s for segs in dead.values() for s in segs] + stale:
        removed.append(rel)
        if not dry_run:
            st.remove([rel])
    return removed


__all__ = ["ObjectStorage", "RemoteStore", "Lease", "is_url", "open_url", "COMPARISON_ID_PREFIX"]
