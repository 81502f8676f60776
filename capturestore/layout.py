"""Where things live inside a store directory and how arrays are laid out on disk.

This module is about bytes and paths only (chunking, codecs, file names); what a run or a
capture means lives in writer.py / store.py.

    <store>/capturestore.json                        format version
    <store>/arrays.zarr/<run_id>/<prompt_id>/...     Zarr v3 arrays
    <store>/tables/<table>/<segment>.parquet         append-only Parquet segments
    <store>/pending/<run_id>.json                    lock file of a run being written
    <store>/pending/cmp-<...>.json                   lock file of a comparison being written
    <store>/catalog.duckdb                           views over tables/, rebuildable, relocatable
    <store>/catalog.stamp                            which views catalog.duckdb was built with
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

FORMAT_NAME = "capturestore"
# 1: KV arrays [layer, kv_head, seq, head_dim], tokens [token] (FORMAT1_POSITION_DIMS).
# 2: the axis they share is named POSITION_DIM in both, as in the SQL views' `position`.
# 3: merged table segments may replace merged segments (compaction tiers); runs are written as in
#    2. A store becomes 3 at its first such merge (an older capturestore would count those rows twice).
# 4: arrays are written with Zarr v3's "." chunk key separator (``c.0.0.0``, one file in the array's
#    directory) instead of "/" (``c/0/0/0``, a directory per leading chunk index). A capture's arrays
#    are small and many (a module tensor per module and phase, KV arrays per layer group): the
#    directories were two thirds of what a capture made on disk (docs/module-compare.md, "Chunk keys
#    with `.`"; docs/reading.md). Each array names its separator in its zarr.json and every reader
#    here takes it from there, so a store holds arrays of both kinds; an older capturestore would
#    look for "c/..." keys and find no chunk, so a store of version 4 is refused by it.
# 5: compaction footers name each distinct column list of their sources once (``column_lists``)
#    and each source entry its list's index (``columns``: an int) instead of the list: the runs
#    table's footers after a year of nightly CI (10,000 sources, 17 columns each) 4.3 -> 2.3 MB,
#    their parse at each Store.open about a third (docs/compact.md, "A year of nightly CI"). An
#    older capturestore would take such a footer for unreadable. Written only in stores of version 5
#    (created so, or raised by ``capturestore upgrade``): a store of 4 or earlier keeps whole lists.
# 6: a prompt's module tensors of one phase, logical dtype, step list and step shape are one array
#    ``tensor_groups/<phase>_<k>`` [module, step, ...] (its ``modules`` attribute names the module of
#    each index; one chunk per module, or several along its steps), not one array per module and
#    phase under ``tensors/<module>/<phase>``: a tiny model's prompt made 142 arrays, each a
#    directory, a zarr.json and a chunk file, and their metadata, not the bytes, was the capture's
#    cost (docs/module-compare.md, "Grouped module tensors"). The captures table keeps one row per
#    module and phase, as before, naming the group's array in ``path`` and the module's index in
#    ``group_index``. Written only in stores of version 6 (an older capturestore would find no
#    ``tensors/<module>/<phase>`` array); ``write_tensor`` / ``write_tensor_steps`` still write the
#    one-array-per-module layout in any store, and readers take each module from where it is.
# 7: a compaction footer's source entry may hold its binary row hash alone (``rows_sha256_binary``,
#    docs/compact.md), without the JSON one (``rows_sha256``), where the source's columns have the
#    binary form: the JSON hash was written for capturestores that know no other, and cost a
#    compaction ~0.1 s per 50,000 rows (Python's float repr), the binary one ~50x less. An older
#    capturestore would take such an entry for a damaged footer. Written only in stores of version 7
#    (created so, or raised by ``capturestore upgrade``): a store of 6 or earlier keeps both hashes.
# Every earlier version is read; each run records its arrays' layout (runs.format_version: 4 where
# they use "." keys, else 2). FORMAT_VERSION is what a new store is created as and its runs are
# written as; a store of an earlier version keeps "/" keys (RUN_FORMAT_VERSION_SLASH_KEYS), so
# the capturestore versions that share it keep reading it. READABLE_FORMAT_VERSION: the newest
# store this reads.
FORMAT_VERSION = 7
REMERGED_FORMAT_VERSION = 3
DOT_KEYS_FORMAT_VERSION = 4
SHARED_COLUMNS_FORMAT_VERSION = 5
GROUPED_TENSORS_FORMAT_VERSION = 6
BINARY_ROW_HASH_FORMAT_VERSION = 7
READABLE_FORMAT_VERSION = 7
RUN_FORMAT_VERSION_SLASH_KEYS = 2
POSITION_DIM = "position"
FORMAT1_POSITION_DIMS = ("seq", "token")
FORMAT_FILE = "capturestore.json"
ARRAYS_DIR = "arrays.zarr"
TENSOR_GROUPS = "tensor_groups"  # a prompt's group of grouped module tensors (format 6)
TABLES_DIR = "tables"
PENDING_DIR = "pending"
CATALOG_FILE = "catalog.duckdb"
CATALOG_STAMP_FILE = "catalog.stamp"  # the view version and tables catalog.duckdb holds: open skips a rebuild
LEGACY_CATALOG_ROOT_FILE = "catalog.root"  # stamp of older catalogs with absolute paths; removed on rebuild
COMPARISON_ID_PREFIX = "cmp-"  # comparison ids (pending/cmp-*.json); run ids start with a timestamp
TMP_SUFFIX = ".tmp"  # segments are written as <name>.parquet.<pid>.tmp, then renamed

# Target bytes per chunk: each chunk is a file, and creating a file costs ~0.3 ms on ext4
# (measured here: 1 MiB files write at ~1.0 GB/s, 4 MiB files at ~1.4 GB/s, one big file at
# ~1.4 GB/s). Streamed arrays use smaller chunks where needed to bound their staging buffers
# (writer.STREAM_BUFFER_BYTES).
TARGET_CHUNK_BYTES = 4 << 20
MAX_CHUNK_TOKENS = 4096

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_RE = re.compile(r"^[A-Za-z0-9_.\-:\[\]]+$")


def check_table_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"table name {name!r} must be an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


def check_module_name(module: str) -> str:
    if not isinstance(module, str) or not _MODULE_RE.match(module) or module in (".", ".."):
        raise ValueError(
            f"module name {module!r} must be non-empty and use only letters, digits and . _ - : [ ]"
        )
    return module


def check_component(name: str, what: str) -> str:
    """A path component we create ourselves (group name, phase): an identifier."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must be an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return name


def token_chunk(bytes_per_token: int, known_len: int | None) -> int:
    """Tokens per chunk so that one chunk holds about TARGET_CHUNK_BYTES.

    ``known_len``: the final length where it is known (one-shot writes), so that a short
    sequence gets one chunk exactly its size instead of a mostly-padding chunk.
    """
    t = max(1, min(MAX_CHUNK_TOKENS, TARGET_CHUNK_BYTES // max(1, bytes_per_token)))
    if t >= 16:
        t = 1 << int(math.log2(t))  # power of two: appends fill chunks evenly
    if known_len is not None:
        t = max(1, min(t, known_len))
    return t


def tensor_chunks(n_steps: int, step_chunk: list[int], itemsize: int) -> tuple[int, ...]:
    """Chunk of a module tensor ``[step, ...]`` written ``n_steps`` at a time: as many steps as fit
    in TARGET_CHUNK_BYTES (at least one, at most ``n_steps``) by ``step_chunk``, one step's chunk.

    Module tensor layout, by writer: before 2026-12 every step was its own chunk (``[1, ...]``:
    a capture of 32 decode steps wrote 32 files per module, a few hundred bytes each); since, a
    prompt's decode steps of one module are written together and share chunks. Readers take the
    chunk shape from each array's zarr.json, so both read alike (docs/module-compare.md)."""
    per_step = max(1, int(math.prod(step_chunk)) * itemsize)
    return (max(1, min(int(n_steps), TARGET_CHUNK_BYTES // per_step)), *step_chunk)


def separator_for(store_version: int) -> str:
    """The chunk key separator of the arrays a writer makes in a store of ``store_version``."""
    return "." if store_version >= DOT_KEYS_FORMAT_VERSION else "/"


def run_format_version(separator: str, grouped: bool = False) -> int:
    """What a run whose arrays use ``separator`` records as its runs.format_version: 6 where it
    holds grouped module tensors (``grouped``), else 4 ("." keys) or 2."""
    if grouped:
        return GROUPED_TENSORS_FORMAT_VERSION
    return DOT_KEYS_FORMAT_VERSION if separator == "." else RUN_FORMAT_VERSION_SLASH_KEYS


def key_separator(meta: dict) -> str:
    """The chunk key separator an array's zarr.json (``meta``, parsed) names: Zarr v3's "default"
    encoding, "/" where its configuration names none (the specification's default). ValueError
    for any other encoding (not an array of this store: no reader here builds its keys)."""
    enc = meta.get("chunk_key_encoding", {"name": "default"})
    name = sep = None
    if isinstance(enc, dict):
        name, conf = enc.get("name"), enc.get("configuration") or {}
        sep = conf.get("separator", "/") if isinstance(conf, dict) else None
    if name != "default" or sep not in ("/", "."):
        raise ValueError(f"chunk key encoding {enc!r}: this store's arrays use Zarr v3's default encoding "
                         f"with separator '/' or '.'")
    return sep


def chunk_key(idx: tuple[int, ...], sep: str = "/") -> str:
    """The key of chunk ``idx`` below its array (Zarr v3 default encoding): ``c`` + sep + the
    indices joined by sep, ``c`` for a 0-d array."""
    return "c" + sep + sep.join(str(i) for i in idx) if idx else "c"


_CHUNK_NAME = {"/": re.compile(r"c(?:/[0-9]+)*"), ".": re.compile(r"c(?:\.[0-9]+)*")}


def is_chunk_name(rel: str, sep: str) -> bool:
    """Whether ``rel``, a path below an array's directory ("/"-separated), is a chunk key with
    separator ``sep`` (``c``, then the indices: not a temporary file zarr writes beside a chunk,
    ``c.0.0.<uuid>.partial``)."""
    return _CHUNK_NAME[sep].fullmatch(rel) is not None


def chunk_keys(shape: tuple[int, ...], chunks: tuple[int, ...],
               sep: str = "/") -> list[tuple[tuple[int, ...], str]]:
    """Every (chunk index, relative key) of an array with Zarr v3 default chunk key encoding."""
    grid = [max(1, math.ceil(s / c)) if s > 0 else 0 for s, c in zip(shape, chunks)]
    if any(g == 0 for g in grid):
        return []
    return [(idx, chunk_key(idx, sep)) for idx in _ndindex(grid)]


def chunk_keys_in_region(
    shape: tuple[int, ...], chunks: tuple[int, ...], region: tuple[slice, ...], sep: str = "/"
) -> list[tuple[tuple[int, ...], str]]:
    """Chunk (index, key) pairs that overlap ``region`` (a tuple of step-1 slices)."""
    ranges = []
    for s, c, r in zip(shape, chunks, region):
        start, stop, _ = r.indices(s)
        if stop <= start:
            return []
        ranges.append(range(start // c, (stop - 1) // c + 1))
    return [(idx, chunk_key(idx, sep)) for idx in _product(ranges)]


def _ndindex(grid: list[int]):
    return _product([range(g) for g in grid])


def _product(ranges):
    import itertools

    return itertools.product(*ranges)


def segment_tmp_name(final: Path) -> Path:
    return final.with_name(f"{final.name}.{os.getpid()}{TMP_SUFFIX}")
