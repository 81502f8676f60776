"""Zarr v3 arrays of one store: creation with our codecs, checked reads, chunk checksums.

Every array is written with a fast lossless compressor followed by the crc32c checksum codec, so
each chunk file ends in a CRC32C of its compressed bytes. ``verify`` checks that CRC straight from
the file (no decompression); a read that hits a bad chunk raises CorruptChunkError naming the
run, prompt, array and chunk.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ShardingCodec
from zarr.core.metadata.v3 import ArrayV3Metadata

from capturestore.chunkio import MadeDirs, blosc_frame_problem
from capturestore.errors import CorruptChunkError
from capturestore.layout import chunk_keys, chunk_keys_in_region, key_separator

# Blosc/LZ4 with bit shuffle: the sign and exponent bits of bf16/fp16/fp32 line up into long
# runs LZ4 can match (LZ4 has no entropy coder, so byte shuffle alone gains little). Measured
# (one thread, 4 MiB chunks, best of 5-8 interleaved, loaded 2-core box), ms per MiB / ratio:
#   bf16 KV (synthetic; tiny-model KV ratio in brackets)  bit+lz4 clevel 1: 0.61-0.83 / 1.145 [1.234]
#     clevel 5: 0.69-0.87 / 1.148 [1.251]; byte shuffle+lz4: 1.3-2.0 / 1.03-1.11 [1.15-1.19];
#     blosclz (bit or byte): gives up, 1.00; zstd-1 + byte shuffle: 2.2 / 1.23.
#   fp32 logits  bit+lz4 clevel 5: 0.57-0.63 / 1.084; byte shuffle+lz4: 0.9-1.0 / 1.05-1.07.
# Byte shuffle loses on both counts for both dtypes, so one codec serves all; blocksize
# (8-128 KiB) and clevel 1-5 made no measurable difference to the store's write throughput
# (best of 8: 1.23 / 1.29 / 1.20 GB/s at clevel 1 / 3 / 5), so clevel 5 keeps the best ratio.
# crc32c is the hardware (SSE4.2) `crc32c` package: ~0.07 ms/MiB, once over the compressed bytes.
CODEC_NAME = "blosc-lz4-bitshuffle-clevel5+crc32c"
# compression=None: checksum only, for when CPU, not disk, is the bottleneck.
CODEC_NAMES = {"lz4": CODEC_NAME, None: "crc32c"}


def check_compression(compression: str | None) -> str | None:
    if compression not in CODEC_NAMES:
        raise ValueError(f"compression must be one of {list(CODEC_NAMES)}, got {compression!r}")
    return compression


def compressors_for(itemsize: int, compression: str | None = "lz4") -> list[Any]:
    if compression is None:
        return [Crc32cCodec()]
    return [
        BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=itemsize),
        Crc32cCodec(),
    ]


class CheckedBloscCodec(BloscCodec):
    """zarr's blosc codec, refusing a frame whose header is not its chunk's
    (``chunkio.blosc_frame_problem``): zarr decodes the inner chunks of a sharded array, and
    hands blosc a frame with no length, as chunkio would."""

    def _decode_sync(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
        nbytes = math.prod(chunk_spec.shape) * chunk_spec.dtype.to_native_dtype().itemsize
        problem = blosc_frame_problem(chunk_bytes.as_numpy_array(), nbytes)
        if problem is not None:
            raise CorruptChunkError(problem)
        return super()._decode_sync(chunk_bytes, chunk_spec)


def _checked_codecs(codecs: tuple) -> tuple:
    out = []
    for c in codecs:
        if type(c) is BloscCodec:
            c = CheckedBloscCodec(typesize=c.typesize, cname=c.cname, clevel=c.clevel, shuffle=c.shuffle,
                                  blocksize=c.blocksize)
        elif isinstance(c, ShardingCodec):
            c = dataclasses.replace(c, codecs=_checked_codecs(c.codecs))
        out.append(c)
    return tuple(out)


def read_metadata(doc: dict) -> ArrayV3Metadata:
    """An array's parsed zarr.json for reading through zarr, its blosc codecs (inner ones of a
    shard too) ``CheckedBloscCodec``."""
    meta = ArrayV3Metadata.from_dict(dict(doc))
    return dataclasses.replace(meta, codecs=_checked_codecs(meta.codecs))


@dataclass(frozen=True)
class ArrayRef:
    """Where one array lives and what it is, for error messages."""

    run_id: str
    prompt_id: str
    name: str  # path below the prompt group, e.g. "kv_k" or "tensors/<module>/<phase>"

    @property
    def path(self) -> str:
        return f"{self.run_id}/{self.prompt_id}/{self.name}"

    def where(self) -> str:
        return f"run {self.run_id}, prompt {self.prompt_id}, array {self.name}"


def open_zarr_store(root: Path) -> zarr.storage.LocalStore:
    return zarr.storage.LocalStore(str(root))


def create_array(
    zstore: zarr.storage.LocalStore,
    ref: ArrayRef,
    shape: tuple[int, ...],
    storage_dtype: np.dtype,
    chunks: tuple[int, ...],
    dimension_names: list[str],
    attributes: dict[str, Any],
    compression: str | None = "lz4",
    shards: tuple[int, ...] | None = None,
    dirs: MadeDirs | None = None,
    separator: str = "/",
) -> zarr.Array | DocumentArray:
    """``shards``: group the chunks into shard objects of this shape (Zarr's sharding codec; each
    inner chunk keeps its codecs and CRC32C, the shard index has its own CRC32C).

    In a directory, an unsharded array's zarr.json (and its missing parent groups') is written
    here, the bytes zarr writes (``array_document``, ``write_document``; pinned by tests against zarr.create_array):
    zarr's own creation costs ~10 ms an array on a loaded machine, which dominated a module
    capture of ~150 small arrays per prompt (benchmarks/bench_modules.py). ``dirs``: the writer's
    ``chunkio.MadeDirs`` under the store's root (each directory made once). ``separator``: the
    chunk key separator, "." only in a store of ``layout.DOT_KEYS_FORMAT_VERSION`` or later."""
    if shards is None and isinstance(zstore, zarr.storage.LocalStore):
        doc = array_document(shape, storage_dtype, chunks, dimension_names, attributes, compression, separator)
        write_document(Path(zstore.root), ref.path, doc, dirs,
                       array_document_bytes(doc, (np.dtype(storage_dtype).str, compression, separator)))
        return array_from_document(zstore, ref.path, doc)
    return zarr.create_array(
        store=zstore,
        name=ref.path,
        shape=shape,
        dtype=storage_dtype,
        chunks=chunks,
        shards=shards,
        compressors=compressors_for(storage_dtype.itemsize, compression),
        fill_value=0,
        dimension_names=dimension_names,
        attributes=attributes,
        chunk_key_encoding={"name": "default", "separator": separator},
        config={"write_empty_chunks": True},  # every chunk exists on disk, so verify can see gaps
        overwrite=False,
    )


def create_group(zstore: zarr.abc.store.Store, path: str, attributes: dict[str, Any],
                 dirs: MadeDirs | None = None) -> None:
    """A Zarr group at ``path`` (and its missing parent groups); FileExistsError (in a directory)
    or zarr's ContainsGroupError where a node is already there. In a directory its zarr.json is
    written here, the bytes zarr.create_group writes (pinned by tests): ~3 ms a group through zarr."""
    if isinstance(zstore, zarr.storage.LocalStore):
        write_document(Path(zstore.root), path, {"attributes": attributes, "zarr_format": 3, "node_type": "group"},
                       dirs)
        return
    zarr.create_group(store=zstore, path=path, attributes=attributes)


_GROUP_DOCUMENT = json.dumps({"attributes": {}, "zarr_format": 3, "node_type": "group"}, indent=2).encode()


def array_document(shape: tuple[int, ...], storage_dtype: np.dtype, chunks: tuple[int, ...],
                   dimension_names: list[str], attributes: dict[str, Any], compression: str | None = "lz4",
                   separator: str = "/") -> dict:
    """The zarr.json of an unsharded array of ours, as zarr.create_array writes it (fill value 0,
    codecs of ``compressors_for``, chunk keys with ``separator``)."""
    if separator not in ("/", "."):
        raise ValueError(f"chunk key separator must be '/' or '.', got {separator!r}")
    dt = np.dtype(storage_dtype)
    codec_bytes: dict[str, Any] = {"name": "bytes"}
    if dt.itemsize > 1:
        codec_bytes["configuration"] = {"endian": "little"}
    codecs = [codec_bytes]
    if compression is not None:
        codecs.append({"name": "blosc", "configuration": {"typesize": dt.itemsize, "cname": "lz4", "clevel": 5,
                                                          "shuffle": "bitshuffle", "blocksize": 0}})
    codecs.append({"name": "crc32c"})
    fill: Any = False if dt.kind == "b" else 0.0 if dt.kind == "f" else 0
    return {
        "shape": [int(n) for n in shape],
        "data_type": dt.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(c) for c in chunks]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attributes,
        "dimension_names": list(dimension_names),
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def write_document(root: Path, path: str, doc: dict, dirs: MadeDirs | None = None, raw: bytes | None = None) -> None:
    """``root/path/zarr.json`` = ``doc`` (an array's or a group's), with a group zarr.json for
    every parent that has none (as zarr does); FileExistsError where an array or group is already
    there. ``dirs``: the writer's ``MadeDirs`` under ``root`` (directories made, and groups seen,
    once each). ``raw``: ``document_bytes(doc)`` where the caller has it."""
    root_s = os.fspath(root)
    dirs = dirs if dirs is not None else MadeDirs(root_s)
    array_dir = f"{root_s}/{path}"
    target = f"{array_dir}/zarr.json"
    try:  # O_EXCL: the existence check and the creation in one call
        fd = dirs.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        raise FileExistsError(f"{target}: a node already exists") from None
    dirs.fresh.discard(array_dir)  # it holds a zarr.json now
    try:
        parent = os.path.dirname(array_dir)
        missing = []
        # a directory this writer just made holds no zarr.json: no stat for it (a module's group, ~70 a prompt)
        while (parent != root_s and parent not in dirs.groups
               and (parent in dirs.fresh or not os.path.exists(f"{parent}/zarr.json"))):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for p in missing:
            _write_file(f"{p}/zarr.json", _GROUP_DOCUMENT)
        dirs.groups.update(missing)
        if parent != root_s:
            dirs.groups.add(parent)
        _write_all(fd, document_bytes(doc) if raw is None else raw)
    finally:
        os.close(fd)


def document_bytes(doc: Any) -> bytes:
    """``json.dumps(doc, indent=2).encode()``, the bytes zarr writes, at about half its cost: the
    indenting encoder is json's pure-Python one, ~80 us an array document (tests pin the two
    equal on random documents)."""
    return _indented(doc, "").encode()


# the text of an array document's entries that follow from its storage dtype, compression and
# chunk key separator alone (chunk_key_encoding, fill_value, codecs: 19 of its ~40 JSON values)
_ARRAY_CONSTANT_KEYS = ("chunk_key_encoding", "fill_value", "codecs")
_ARRAY_CONSTANT_TEXT: dict[tuple, str] = {}


def array_document_bytes(doc: dict, constant_key: tuple) -> bytes:
    """``document_bytes(doc)`` of a document of ``array_document``'s making, its constant entries'
    text rendered once per ``constant_key`` (storage dtype, compression, separator: what they
    follow from): ~half of the ~25 us an array's document took to encode (tests pin the two equal)."""
    keys = tuple(doc)
    i = keys.index("chunk_key_encoding") if "chunk_key_encoding" in doc else -1
    if i < 0 or keys[i:i + 3] != _ARRAY_CONSTANT_KEYS:
        return document_bytes(doc)
    middle = _ARRAY_CONSTANT_TEXT.get(constant_key)
    if middle is None:
        middle = ",\n".join(f"  {_json_str(k)}: {_indented(doc[k], '  ')}" for k in _ARRAY_CONSTANT_KEYS)
        if len(_ARRAY_CONSTANT_TEXT) < 256:  # a few dtypes x codecs x separators in practice
            _ARRAY_CONSTANT_TEXT[constant_key] = middle
    parts = [f"  {_json_str(k)}: {_indented(doc[k], '  ')}" for k in keys[:i]]
    parts.append(middle)
    parts.extend(f"  {_json_str(k)}: {_indented(doc[k], '  ')}" for k in keys[i + 3:])
    return ("{\n" + ",\n".join(parts) + "\n}").encode()


def _indented(o: Any, ind: str) -> str:
    t = type(o)
    if t is dict:
        if not o:
            return "{}"
        inner = ind + "  "
        try:
            parts = [f"{inner}{_json_str(k)}: {_indented(v, inner)}" for k, v in o.items()]
        except TypeError:  # a key that is not a str: json's own conversion
            return json.dumps(o, indent=2).replace("\n", "\n" + ind)
        return "{\n" + ",\n".join(parts) + "\n" + ind + "}"
    if t is list or t is tuple:
        if not o:
            return "[]"
        inner = ind + "  "
        kinds = set(map(type, o))
        if kinds == {int}:
            items = map(int.__repr__, o)
        elif kinds == {str}:
            items = map(_json_str, o)
        else:
            items = (_indented(v, inner) for v in o)
        return "[\n" + inner + (",\n" + inner).join(items) + "\n" + ind + "]"
    if t is str:
        return _json_str(o)
    if t is int:
        return int.__repr__(o)
    if isinstance(o, (dict, list, tuple)):  # a subclass: json's own encoder (a JSON string holds no raw newline)
        return json.dumps(o, indent=2).replace("\n", "\n" + ind)
    return json.dumps(o)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def array_from_document(zstore: zarr.abc.store.Store, path: str, doc: dict) -> DocumentArray:
    """The array whose zarr.json is ``doc``, without reading it back (``DocumentArray``)."""
    return DocumentArray(zstore, path, doc)


class DocumentArray:
    """An array just created from its zarr.json document: ``shape`` and ``chunks`` from the
    document; anything else (``resize``, ``update_attributes``, ``arr[...] = x``) opens the
    zarr.Array on first use (parsing the metadata costs ~2-5 ms, and most arrays of a capture are
    written once, chunk-aligned, by chunkio, never through zarr)."""

    def __init__(self, zstore: zarr.abc.store.Store, path: str, doc: dict):
        self._zstore, self._path, self._doc = zstore, path, doc
        self._zarr: zarr.Array | None = None

    def _array(self) -> zarr.Array:
        if self._zarr is None:
            from zarr.core.array import Array, AsyncArray
            from zarr.storage import StorePath

            self._zarr = Array(AsyncArray(metadata=self._doc, store_path=StorePath(self._zstore, self._path),
                                          config={"write_empty_chunks": True}))
        return self._zarr

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._doc["shape"]) if self._zarr is None else self._zarr.shape

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(self._doc["chunk_grid"]["configuration"]["chunk_shape"])

    @property
    def shards(self) -> None:
        """None: ``create_array`` makes a document array only where it writes no shards."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._array(), name)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._array()[key] = value

    def __getitem__(self, key: Any) -> Any:
        return self._array()[key]


def separator_of(arr: Any) -> str:
    """The chunk key separator of an array of ours (a ``DocumentArray`` or a zarr.Array)."""
    if isinstance(arr, DocumentArray) and arr._zarr is None:
        return key_separator(arr._doc)
    return key_separator({"chunk_key_encoding": arr.metadata.chunk_key_encoding.to_dict()})


def chunk_problem(array_dir: Path, key: str) -> str | None:
    """Why the chunk file ``key`` under ``array_dir`` is bad, or None if its CRC32C checks out."""
    p = array_dir / key
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        data = None
    return crc_problem(data)


def crc_problem(data: bytes | None) -> str | None:
    """Why a chunk's stored bytes (None: missing) are bad, or None if their CRC32C checks out."""
    if data is None:
        return "chunk file is missing"
    if len(data) < 4:
        return f"chunk file is truncated ({len(data)} bytes)"
    stored = struct.unpack("<I", data[-4:])[0]
    computed = crc32c.crc32c(data[:-4])
    if stored != computed:
        return f"checksum mismatch (stored crc32c {stored:#010x}, computed {computed:#010x})"
    return None


def bad_chunks(array_dir: Path, shape: tuple[int, ...], chunks: tuple[int, ...],
               region: tuple[slice, ...] | None = None, sep: str = "/") -> list[tuple[str, str]]:
    """(chunk key, problem) for every bad chunk of the array (or of ``region``); ``sep``: its
    chunk key separator."""
    keys = chunk_keys(shape, chunks, sep) if region is None else chunk_keys_in_region(shape, chunks, region, sep)
    out = []
    for _, key in keys:
        why = chunk_problem(array_dir, key)
        if why is not None:
            out.append((key, why))
    return out
