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

import json
import os
import socket
import threading
import uuid
import weakref
from datetime import UTC, datetime
from typing import Any

import zarr

from capturestore.backends import (
    FsspecBackend,
    shard_shape,  # noqa: F401 - its home before backends.py
)
from capturestore.errors import StoreError, WriterIdTaken
from capturestore.layout import (
    ARRAYS_DIR,
    COMPARISON_ID_PREFIX,
    PENDING_DIR,
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


def open_url(url: str, create: bool = True):
    """``Store.open(url)``: the one Store class over this backend."""
    from capturestore.store import Store

    return Store.open(url, create=create)


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


class S3Backend(FsspecBackend):
    """One store's bucket and key prefix (backends.Backend): conditional PUTs, leases by the
    server's clock."""

    scheme = "s3://"

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
        self.lease_s = lease_seconds()
        self.shard_bytes = shard_bytes()  # None: one object per chunk

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

    def where(self, rel: str = "") -> str:
        if rel:
            return f"{self.url}/{rel}"
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
    def put(self, rel: str, data: bytes, if_absent: bool = False, durable: bool = False) -> None:
        """One PUT (atomic: whole or not at all, stored when it returns); ``if_absent``:
        FileExistsError when the key exists (``If-None-Match: *``; on a server without
        conditional writes, a HEAD first)."""
        key = self.key(rel)
        if if_absent and self._conditional:
            try:
                self.fs.pipe_file(key, data, IfNoneMatch="*")
                return
            except FileExistsError:
                raise
            except Exception as e:
                if _error_code(e) not in ("NotImplemented", "501") and "NotImplemented" not in str(e):
                    raise
                self._conditional = False
        if if_absent and self.fs.exists(key):
            raise FileExistsError(key)
        self.fs.pipe_file(key, data)

    def server_now(self) -> datetime:
        """The server's clock: the Last-Modified of a probe object PUT now (removed again)."""
        rel = f"{PENDING_DIR}/.clock-{uuid.uuid4().hex}"
        try:
            self.put(rel, b"")
        except PermissionError:  # read-only credentials (`capturestore runs`): this host's clock
            return datetime.now(UTC)
        try:
            return _modified(self.info(rel))
        finally:
            self.remove([rel])

    def unwritable(self, rels: list[str]) -> tuple[str, str] | None:
        """One probe PUT (removed again): read-only credentials are refused before any work."""
        rel = f"{PENDING_DIR}/.probe-{uuid.uuid4().hex}"
        try:
            self.put(rel, b"")
        except PermissionError as e:
            return self.url, f"the credentials may not write ({' '.join(str(e).split())[:200]})"
        except Exception as e:  # noqa: BLE001 - a refusal by error code, as explain() reads it
            if self.explain(e) is None:
                raise
            return self.url, str(self.explain(e))
        self.remove([rel])
        return None

    # ---- the commit protocol -----------------------------------------------------------------
    def writer_lock(self, writer_id: str, info: dict[str, Any]) -> Lease:
        return Lease(self, writer_id, info, self.lease_s)

    def writer_alive(self, writer_id: str, now: datetime | None = None) -> bool:
        """Its lease object was re-PUT within its ``lease_s``, by the server's clock."""
        info = self.info(f"{PENDING_DIR}/{writer_id}.json")
        if info is None:
            return False
        try:
            lease = float(json.loads(self.read(f"{PENDING_DIR}/{writer_id}.json")).get("lease_s", self.lease_s))
        except (FileNotFoundError, ValueError, TypeError):
            lease = self.lease_s
        now = now or self.server_now()
        return (now - _modified(info)).total_seconds() < lease

    def liveness(self):
        now = self.server_now()  # one probe: every writer is judged at the same moment
        return lambda writer_id: self.writer_alive(writer_id, now)


ObjectStorage = S3Backend  # its name before backends.py


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
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value))


# ------------------------------------------------------------------------------ the lease


class Lease:
    """``pending/<id>.json`` on object storage: created with If-None-Match, re-PUT by a heartbeat
    thread every ``lease_s / 3`` seconds until ``release`` removes it. The object store's
    stand-in for integrity.PendingLock (whose flock the kernel drops when the writer dies)."""

    def __init__(self, storage: ObjectStorage, writer_id: str, info: dict[str, Any], lease_s: float):
        self.storage, self.rel, self.lease_s = storage, f"{PENDING_DIR}/{writer_id}.json", lease_s
        self._info = {"pid": os.getpid(), "hostname": socket.gethostname(),
                      "started_at": datetime.now(UTC).isoformat(), "lease_s": lease_s, **info}
        try:
            storage.put(self.rel, json.dumps(self._info).encode(), if_absent=True)
        except FileExistsError:
            raise WriterIdTaken(f"{storage.url}: writer id {writer_id} is already taken by another writer") from None
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


__all__ = ["COMPARISON_ID_PREFIX", "Lease", "ObjectStorage", "S3Backend", "is_url", "open_url", "shard_shape"]
