"""Fast chunk I/O for our own Zarr v3 arrays, byte-compatible with zarr-python.

zarr-python's generic pipeline (asyncio, a temp file + rename per chunk, copies for the
checksum) runs at a fraction of disk speed here. Our arrays all use one codec chain
(bytes little-endian -> blosc -> crc32c) and our writes are chunk-aligned, so this module
encodes and decodes chunks directly on a thread pool (blosc and file I/O release the GIL) and
writes the exact bytes zarr would. Zarr, xarray and dask read the result unchanged; the tests
read our chunks back through zarr to pin that.

A chunk file is written in place, without a rename: only arrays of a run that has not yet
committed are ever written, and a torn chunk of a writer that died is never catalogued.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import numcodecs.blosc as _nc_blosc
from numcodecs import Blosc

from capturestore.errors import CorruptChunkError
from capturestore.layout import chunk_key

_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor)
# read_region reads chunks on the pool only when they average at least this many bytes: in stores
# written before 2026-12 a module tensor's decode steps are one chunk of [1, hidden] each (a few
# hundred bytes), where submitting to a thread took longer than the read (bench_modules.py).
_THREADED_READ_BYTES = 64 << 10


def _pool() -> ThreadPoolExecutor:
    """The chunk I/O threads; made again in a forked child, which inherits the executor but not
    its threads (a task submitted there was never run: the child's read waited for ever)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        # the CPUs this process may run on (a container's or taskset's share), not the machine's
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(2, cpus), thread_name_prefix="capturestore-io"))
    return _POOL[1]


def _blosc(itemsize: int) -> Blosc:
    # Must match arrays.compressors_for: blosc lz4, clevel 5, bitshuffle, typesize = itemsize.
    return Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE, typesize=itemsize)


def _compress(raw: np.ndarray, itemsize: int) -> bytes:
    """``_blosc(itemsize).encode(raw)``, the same bytes (tests/capturestore/test_chunkio.py), by
    numcodecs' own function: the codec object made and its input checked per chunk cost ~7 of
    the ~12 us a module capture's small chunk took to encode (bench_modules.py)."""
    return _nc_blosc.compress(raw, b"lz4", 5, Blosc.BITSHUFFLE, 0, itemsize)


_IOV_MAX = 1024
_MAX_SLABS = 4096


def _slabs(part: np.ndarray, chunk_shape: tuple[int, ...]) -> list[np.ndarray] | None:
    """The bytes of ``part`` zero-padded to ``chunk_shape``, in C order, as contiguous views of
    the caller's array (no copy), or None when that takes too many pieces.

    A chunk [1, kv_head, t, head_dim] of a C-ordered [layer, kv_head, position, head_dim] array is
    kv_head contiguous [t, head_dim] slabs; an edge chunk pads each slab along t."""
    j = 0
    while j < part.ndim and not part[(0,) * j].flags.c_contiguous:
        j += 1
    if j == part.ndim or any(part.shape[i] != chunk_shape[i] for i in range(part.ndim) if i != j):
        return None
    n_slabs = int(np.prod(part.shape[:j], dtype=np.int64))
    pad_elems = (chunk_shape[j] - part.shape[j]) * int(np.prod(chunk_shape[j + 1:], dtype=np.int64))
    if n_slabs * (2 if pad_elems else 1) > _MAX_SLABS:
        return None
    pad = np.zeros(pad_elems * part.dtype.itemsize, np.uint8) if pad_elems else None
    out = []
    for idx in np.ndindex(*part.shape[:j]):
        out.append(part[idx].reshape(-1).view(np.uint8))
        if pad is not None:
            out.append(pad)
    return out


class MadeDirs:
    """The directories under ``root`` that one writer knows exist, so that a file is opened after
    one ``mkdir`` per directory it lacks, where ``mkdir(parents=True)`` per file took ~7 calls an
    array (0.29 s of a module capture's ~150 arrays per prompt, bench_modules.py). ``groups``: the
    Zarr groups it knows hold their zarr.json (``arrays.write_array_document``).

    What it knows can go stale: another writer, ``gc`` or an abort may remove a directory. A file
    whose directory is gone is still written, the directories made again (as mkdir(parents=True)
    did), and everything known is forgotten."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        self._known = {self.root}
        self.groups: set[str] = set()
        self.fresh: set[str] = set()  # directories this writer's mkdir made: empty when made, no file to look for

    def make(self, d: str) -> None:
        """Make directory ``d`` (str) and its missing parents."""
        if d in self._known:
            return
        parent = os.path.dirname(d)
        if parent != self.root and not parent.startswith(self.root + os.sep):  # not below root: no shortcut
            os.makedirs(d, exist_ok=True)
        else:
            self.make(parent)
            try:
                os.mkdir(d)
                self.fresh.add(d)
            except FileExistsError:
                pass
            except FileNotFoundError:  # a parent removed behind this writer's back
                self.forget()
                os.makedirs(d, exist_ok=True)
        self._known.add(d)

    def forget(self) -> None:
        self._known = {self.root}
        self.groups = set()
        self.fresh = set()

    def open(self, path: str, flags: int) -> int:
        """``os.open(path, flags, 0o644)`` after making its directory."""
        d = os.path.dirname(path)
        self.make(d)
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # a directory removed behind this writer's back
            self.forget()
            os.makedirs(d, exist_ok=True)
            return os.open(path, flags, 0o644)


def _write_buffers(path: Path | str, bufs: list, dirs: MadeDirs | None = None) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if dirs is not None:
        fd = dirs.open(os.fspath(path), flags)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        for i in range(0, len(bufs), _IOV_MAX):
            group = bufs[i : i + _IOV_MAX]
            want = sum(memoryview(b).nbytes for b in group)
            done = os.writev(fd, group)
            if done != want:  # short write (rare on local disks): finish piecewise
                rest = b"".join(bytes(memoryview(b).cast("B")) for b in group)[done:]
                while rest:
                    rest = rest[os.write(fd, rest):]
    finally:
        os.close(fd)


def _encode_and_write(path: Path | str, block: np.ndarray, itemsize: int, compressed: bool,
                      chunk_shape: tuple[int, ...] | None = None, dirs: MadeDirs | None = None) -> int:
    """Write one chunk: ``block`` is the chunk's data, padded to ``chunk_shape`` if given."""
    if not compressed and chunk_shape is not None:
        bufs = _slabs(block, chunk_shape)  # checksum-only chunks go straight from the caller's memory
        if bufs is not None:
            crc = 0
            for b in bufs:
                crc = crc32c.crc32c(b, crc)
            _write_buffers(path, [*bufs, struct.pack("<I", crc)], dirs)
            return sum(b.nbytes for b in bufs) + 4
    if chunk_shape is not None and block.shape != chunk_shape:
        full = np.zeros(chunk_shape, block.dtype)
        full[tuple(slice(0, n) for n in block.shape)] = block
        block = full
    raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    enc = _compress(raw, itemsize) if compressed else raw
    _write_buffers(path, [enc, struct.pack("<I", crc32c.crc32c(enc))], dirs)
    return len(enc) + 4


def write_block(array_dir: Path, shape: tuple[int, ...], chunks: tuple[int, ...], block: np.ndarray,
                offset: tuple[int, ...], compressed: bool = True, pending: list | None = None,
                dirs: MadeDirs | None = None, sizes: dict[str, int] | None = None, sep: str = "/") -> bool:
    """Write ``block`` (storage dtype) at ``offset`` of the array; True if done (or queued).

    ``compressed``: the array's codecs are bytes+blosc+crc32c (else bytes+crc32c).
    ``pending``: if given, the chunk jobs are queued on the pool and their futures appended to
    it instead of awaited; ``block`` must then stay unchanged until they are done.
    ``dirs``: the writer's ``MadeDirs`` (chunk directories made once each).
    ``sizes``: ``{chunk key: bytes in its file}`` of the chunks written here (not of queued ones).
    ``sep``: the chunk key separator the array's zarr.json names (``layout.key_separator``).

    Returns False (nothing written) when the block does not start on chunk boundaries or ends
    inside a chunk that is not the array's last along that axis: such writes need a
    read-modify-write and are left to zarr.
    """
    if block.ndim != len(shape) or len(offset) != len(shape):
        return False
    ranges = []
    for s, c, o, n in zip(shape, chunks, offset, block.shape):
        end = o + n
        if o % c or end > s or (end % c and end != s) or n == 0:
            return False
        ranges.append(range(o // c, (end + c - 1) // c))
    itemsize = block.dtype.itemsize
    base = os.fspath(array_dir)
    jobs = []
    for idx in itertools.product(*ranges):
        src = tuple(slice(i * c - o, min((i + 1) * c, o + n) - o) for i, c, o, n in zip(idx, chunks, offset, block.shape))
        # an edge chunk is stored padded to the full chunk shape with the fill value 0, as zarr does
        jobs.append((chunk_key(idx, sep), block[src]))
    cshape = tuple(chunks)
    if pending is None and len(jobs) == 1:
        n = _encode_and_write(f"{base}/{jobs[0][0]}", jobs[0][1], itemsize, compressed, cshape, dirs)
        if sizes is not None:
            sizes[jobs[0][0]] = n
        return True
    if dirs is not None:  # here, not racing on the pool's threads ("." keys: the array's directory only)
        for key, _ in jobs:
            dirs.make(os.path.dirname(f"{base}/{key}"))
    futures = [_pool().submit(_encode_and_write, f"{base}/{key}", b, itemsize, compressed, cshape, dirs)
               for key, b in jobs]
    if pending is not None:
        pending.extend(futures)
    else:
        wait_all(list(futures))
        if sizes is not None:
            sizes.update((key, f.result()) for (key, _), f in zip(jobs, futures))
    return True


def wait_all(futures: list) -> None:
    """Wait for every future (all of them, even after a failure), then raise the first error."""
    first = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            first = first or e
    futures.clear()
    if first is not None:
        raise first


# A chunk file of at least _BUFFERED_READ_BYTES is read into a kept buffer: a fresh ``bytes`` per
# chunk is a fresh mapping for a chunk of megabytes, every page of it faulted in and cleared before
# the file's bytes are copied over it (bench_store.py's KV read). The buffers are shared by every
# reading thread (the I/O pool has a thread per CPU of the machine, not of this process), at most
# _KEPT_READ_BUFFERS of them and _KEPT_READ_BYTES in all; a smaller file is read into a new bytes,
# which the allocator serves from memory it holds.
_BUFFERED_READ_BYTES = 256 << 10
_KEPT_READ_BUFFERS = 8
_KEPT_READ_BYTES = 64 << 20
_read_buffers: list[bytearray] = []
_read_buffers_lock = threading.Lock()


def _take_buffer(size: int) -> bytearray:
    with _read_buffers_lock:
        for i, buf in enumerate(_read_buffers):
            if len(buf) >= size:
                return _read_buffers.pop(i)
    return bytearray(size)


def _give_buffer(buf: bytearray) -> None:
    """Keep ``buf`` for a later read, the largest buffers first, within the bounds above."""
    with _read_buffers_lock:
        kept, total = [], 0
        for b in sorted([*_read_buffers, buf], key=len, reverse=True):
            if len(kept) < _KEPT_READ_BUFFERS and total + len(b) <= _KEPT_READ_BYTES:
                kept.append(b)
                total += len(b)
        _read_buffers[:] = kept


def read_to_end(fd: int, first: int = 1 << 16) -> bytes:
    """The bytes of open file ``fd`` from where it stands to its end: a first ``os.read`` of
    ``first`` bytes (one call for a small file, where a file object and its buffer cost ~5 us
    more), then 1 MiB at a time."""
    parts = []
    while part := os.read(fd, first if not parts else 1 << 20):
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_file(path: str) -> tuple[Any, bytearray | None]:
    """(the bytes of the file at ``path`` or None if it does not exist, the kept buffer they lie in
    or None): a file past ``_BUFFERED_READ_BYTES`` is read into a kept buffer, which the caller
    gives back (``_give_buffer``) once done with the bytes. A plain function: a chunk read by
    ``read_region`` pays no context manager (~10 us a chunk here, as much as its bytes' read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    buf = None
    try:
        size = os.fstat(fd).st_size
        if size < _BUFFERED_READ_BYTES:
            return read_to_end(fd, max(size, 1 << 16)), None
        buf = _take_buffer(size + 1)  # one byte more than the file: a file grown since fstat is seen
        view, got = memoryview(buf), 0
        while got < len(view) and (n := os.readv(fd, [view[got:]])):
            got += n
        if got < len(view):
            return view[:got], buf
        rest = []  # it grew while read: the rest too
        while part := os.read(fd, 1 << 20):
            rest.append(part)
        data = bytes(view) + b"".join(rest)
        _give_buffer(buf)
        return data, None
    except OSError as e:  # os.read names no file (a directory where the chunk should be: EISDIR)
        if buf is not None:
            _give_buffer(buf)
        raise type(e)(e.errno, e.strerror, path) from None
    finally:
        os.close(fd)


def blosc_frame_problem(frame, nbytes: int) -> str | None:
    """Why ``frame`` (a chunk's bytes before its CRC32C) cannot be the blosc frame of a chunk of
    ``nbytes`` bytes, or None.

    blosc (1.x) is given no length, only the frame's 16-byte header: a frame decoding to fewer
    bytes than its destination leaves the rest as it was, and one cut short (its CRC taken after
    the cut) reads on past its bytes, into whatever the buffer held next. So the header's sizes
    must be the chunk's and the frame's: bytes 4-7 the decoded size, 12-15 the frame's length."""
    if len(frame) < 16:
        return f"blosc frame of {len(frame)} bytes, shorter than its header"
    held, length = struct.unpack_from("<I", frame, 4)[0], struct.unpack_from("<I", frame, 12)[0]
    if held != nbytes:
        return f"blosc frame of {held} bytes where {nbytes} were expected"
    if length != len(frame):
        return f"blosc frame says it is {length} bytes long, the chunk holds {len(frame)} before its checksum"
    return None


def decode_chunk(data, chunks: tuple[int, ...], dtype: np.dtype, where: str, key: str,
                 compressed: bool, out: np.ndarray | None = None) -> np.ndarray:
    """One chunk's array from its stored bytes (None: missing), its CRC32C checked first.

    ``out``: a C-contiguous array of the chunk's shape and dtype to decode into (returned),
    else a new one."""
    if data is None:
        raise CorruptChunkError(f"{where}, chunk {key}: chunk file is missing")
    if len(data) < 4:
        raise CorruptChunkError(f"{where}, chunk {key}: chunk file is truncated ({len(data)} bytes)")
    mv = memoryview(data)
    stored = struct.unpack_from("<I", mv, len(mv) - 4)[0]
    computed = crc32c.crc32c(mv[:-4])
    if stored != computed:
        raise CorruptChunkError(
            f"{where}, chunk {key}: checksum mismatch (stored crc32c {stored:#010x}, computed {computed:#010x})"
        )
    out = np.empty(chunks, dtype) if out is None else out
    dest = out.reshape(-1).view(np.uint8)
    if not compressed:
        if len(mv) - 4 != out.nbytes:
            raise CorruptChunkError(f"{where}, chunk {key}: {len(mv) - 4} bytes where {out.nbytes} were expected")
        dest[:] = np.frombuffer(mv[:-4], np.uint8)
        return out
    problem = blosc_frame_problem(mv[:-4], out.nbytes)
    if problem is not None:
        raise CorruptChunkError(f"{where}, chunk {key}: {problem}")
    try:
        _nc_blosc.decompress(mv[:-4], dest)  # Blosc().decode's own call, without a codec object per chunk
    except Exception as e:  # noqa: BLE001 - a valid CRC over an undecodable frame
        raise CorruptChunkError(f"{where}, chunk {key}: cannot decode ({e})") from None
    return out


def read_region(array_dir: Path | None, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype,
                region: tuple[slice, ...], where: str, compressed: bool = True, fetch=None,
                sep: str = "/") -> np.ndarray:
    """array[region] (step-1 slices), checking every chunk's CRC32C; errors name the chunk.

    ``fetch``: instead of files under ``array_dir``, a function {chunk key: bytes or None} of a
    list of chunk keys (an object store's batched GETs). ``sep``: the chunk key separator the
    array's zarr.json names (``layout.key_separator``)."""
    bounds = [r.indices(s)[:2] for r, s in zip(region, shape)]
    out = np.empty(tuple(max(0, b - a) for a, b in bounds), dtype)
    if out.size == 0:
        return out
    ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(bounds, chunks)]
    fetched = None if fetch is None else fetch([chunk_key(i, sep) for i in itertools.product(*ranges)])

    base = None if array_dir is None else os.fspath(array_dir)
    # per dimension, per chunk index along it: (its part in the chunk, its part in out, whole?)
    parts = [{i: (slice(max(a, i * c) - i * c, min(b, (i + 1) * c) - i * c), slice(max(a, i * c) - a, min(b, (i + 1) * c) - a),
                  a <= i * c and (i + 1) * c <= b) for i in r} for (a, b), c, r in zip(bounds, chunks, ranges)]

    def one(idx: tuple[int, ...]) -> None:
        key = chunk_key(idx, sep)
        at = [p[i] for p, i in zip(parts, idx)]
        dst = tuple(x[1] for x in at)
        whole = all(x[2] for x in at)
        into = out[dst] if whole else None  # a whole chunk decodes in place when its part of out is contiguous
        into = into if into is not None and into.flags.c_contiguous else None
        if fetched is None:
            data, buf = _read_file(f"{base}/{key}")
            try:
                chunk = decode_chunk(data, chunks, dtype, where, key, compressed, out=into)
            finally:
                if buf is not None:
                    _give_buffer(buf)
        else:
            chunk = decode_chunk(fetched.get(key), chunks, dtype, where, key, compressed, out=into)
        if into is None:
            out[dst] = chunk[tuple(x[0] for x in at)]

    idxs = list(itertools.product(*ranges))
    if len(idxs) == 1:
        one(idxs[0])
    else:
        errors = []
        if math.prod(chunks) * out.itemsize < _THREADED_READ_BYTES:  # a thread hand-off costs more than a read
            calls = [functools.partial(one, i) for i in idxs]
        else:
            calls = [f.result for f in [_pool().submit(one, i) for i in idxs]]
        for call in calls:
            try:
                call()
            except CorruptChunkError as e:
                errors.append(str(e))
        if errors:
            more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
            raise CorruptChunkError(f"{len(errors)} corrupt chunk(s): " + "; ".join(errors[:8]) + more)
    return out
