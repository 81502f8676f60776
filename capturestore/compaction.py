"""Compaction of table segments: many small Parquet segments of a table merged into one (docs/compact.md).

The merged segment ``tables/<t>/compacted-<utc>-<uuid>.parquet`` is the only commit: it holds its
sources' rows, each with one more column, ``__capturestore_source`` (the file name of the segment
the row came from), and in its footer (``capturestore.compaction``) each source's row count,
SHA-256 of its bytes and SHA-256 of its rows in canonical form (``rows_sha256``, JSON; and
``rows_sha256_binary`` where its columns have that form, the one check_evidence checks). The reader
rule: a segment named as a source by a merged segment of the same listing is hidden; its rows are
read from the merged segment. Sources are removed (by a later ``compact`` or by ``gc``) only once
the merged segment is older than a grace period, so a query that listed a source a moment before
still finds it. Checking one source's rows (check_evidence) reads the source column, then only the
row groups holding that source (row groups are cut at source boundaries: ``source_row_groups``),
and hashes its rows in canonical form (``merged_problems``).

Tiers: a compaction also merges merged segments of about its own size (``_tier``), so a store
compacted every night holds a few merged segments per table, not one per night. The new merged
segment names the merged segments it replaces (``replaces``, transitively) and carries their
sources' rows under the writers' file names; a replaced merged segment is hidden as a source is,
and sorts before the one replacing it (the window form of the rule keeps, of the merged rows of
one source, those of the last merged segment by name). A store whose merged segments replace
others is format version 3 (``layout.REMERGED_FORMAT_VERSION``): a capturestore that knows only
one level of merging would read both and count the rows twice, so it refuses to open it.
"""
from __future__ import annotations

import base64
import calendar
import dataclasses
import hashlib
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from capturestore.errors import StoreError, WriterIdTaken
from capturestore.footer import footer_bytes
from capturestore.layout import BINARY_ROW_HASH_FORMAT_VERSION, PENDING_DIR, SHARED_COLUMNS_FORMAT_VERSION, TABLES_DIR
from capturestore.tables import (
    RUN_TABLES,
    SCHEMA_SEGMENT,
    SCHEMAS,
    checked_file,
    read_checked,
    segment_bytes,
    validated,
)

__all__ = ["COMPACTED_PREFIX", "CompactResult", "MergedSegment", "SOURCE_COLUMN", "TableCompaction", "compact",
           "coverage", "grace_seconds", "is_merged", "logical_names", "merged_segments", "read_source", "rows_sha256",
           "rows_sha256_binary"]

COMPACTED_PREFIX = "compacted-"
_STAMP = "%Y%m%dT%H%M%S"  # a merged segment's name: compacted-<_STAMP in UTC>-<12 hex digits>.parquet
SOURCE_COLUMN = "__capturestore_source"
META_KEY = b"capturestore.compaction"
LOCK_PREFIX = "compact-"  # pending/compact-<table>.json: one compaction of a table at a time
# Tiers (_tier): a merged segment is merged again when it holds at most TIER_FACTOR times the rows
# merged with it so far, and whenever more than MAX_MERGED merged segments would stay beside the new one.
TIER_FACTOR = 4
MAX_MERGED = 8
# A merged segment's row groups (source_row_groups): at most this many rows unless one source holds
# more; DuckDB's own row groups are 122,880 rows, pyarrow's default about a million.
MERGED_ROW_GROUP_ROWS = 1 << 17


AUTO_ENV = "CAPTURESTORE_AUTO_COMPACT"
DEFAULT_AUTO_SEGMENTS = 64


def auto_compact_segments() -> int:
    """$CAPTURESTORE_AUTO_COMPACT: a commit that leaves a table with this many segments no merged
    segment covers compacts that table (default 64; 0: never). StoreError in one line otherwise."""
    raw = os.environ.get(AUTO_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_AUTO_SEGMENTS
    try:
        value = int(raw)
    except ValueError:
        raise StoreError(f"${AUTO_ENV}={raw!r} is not a whole number of segments (0 turns automatic "
                         f"compaction off)") from None
    if value < 0 or value == 1:
        raise StoreError(f"${AUTO_ENV}={raw!r} must be 0 (off) or a number of segments >= 2")
    return value


def is_merged(name: str) -> bool:
    """True for a merged segment's file name."""
    return name.startswith(COMPACTED_PREFIX)


def grace_seconds() -> float:
    """How long a merged segment's sources stay after it is written: the writer lease
    ($CAPTURESTORE_LEASE_S, default 120 s), the longest a reader is expected to hold a listing."""
    from capturestore.objectstore import lease_seconds

    return lease_seconds()


class ListingChanged(FileNotFoundError):
    """A merged segment of a listing was removed before its footer was read: decide on a new listing."""


@dataclass(frozen=True)
class MergedSegment:
    name: str
    created_at: float  # seconds since the epoch, written by compact
    sources: dict[str, dict[str, Any]]  # source file name -> {rows, sha256, rows_sha256, columns}
    replaces: tuple[str, ...] = ()  # merged segments whose rows it holds (hidden by it), transitively

    @property
    def rows(self) -> int:
        return sum(int(i["rows"]) for i in self.sources.values())


def _meta_of(schema: pa.Schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"no {META_KEY.decode()} metadata")
    return json.loads(raw)


# A source's footer entry: each key, and the JSON types its value may have (bool is no count)
_ENTRY_KEYS = {"rows": (int,), "sha256": (str,), "rows_sha256": (str,), "columns": (list,)}


def _merged_of(name: str, meta: Any) -> MergedSegment:
    """The MergedSegment a compaction footer describes; ValueError in one line naming what is
    missing or of the wrong type (every later use of an entry may then take its keys as given:
    a renamed key was a KeyError traceback out of verify and compact)."""
    if not isinstance(meta, dict):
        raise ValueError(f"its {META_KEY.decode()} entry is not a JSON object")
    created = meta.get("created_at")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ValueError(f"created_at is {created!r}, not a time")
    sources, replaces = meta.get("sources"), meta.get("replaces", [])
    if not isinstance(sources, dict):
        raise ValueError(f"sources is {type(sources).__name__}, not an object of source entries")
    if not isinstance(replaces, list) or not all(isinstance(r, str) for r in replaces):
        raise ValueError("replaces is not a list of names")
    column_lists: set[tuple] = set()  # the column lists checked: most sources of a table share one
    shared = meta.get("column_lists")
    if shared is not None:  # format 5 (pack_columns): each entry names its list by index
        if not isinstance(shared, list) or not all(isinstance(c, list) and all(type(x) is str for x in c)
                                                   for c in shared):
            raise ValueError("column_lists is not a list of column name lists")
        column_lists.update(tuple(c) for c in shared)
        for src, info in sources.items():
            i = info.get("columns") if isinstance(info, dict) else None
            if i is None:
                continue  # _entry_problem names what is missing
            if type(i) is not int or not 0 <= i < len(shared):
                raise ValueError(f"source {src}: columns is {i!r}, not an index of the {len(shared)} column_lists")
            info["columns"] = shared[i]
    for src, info in sources.items():
        if not _entry_ok(info, column_lists):
            _entry_problem(src, info)
    return MergedSegment(name, float(created), dict(sources), tuple(replaces))


def pack_columns(sources: dict[str, dict[str, Any]]) -> tuple[list[list[str]], dict[str, dict[str, Any]]]:
    """(column_lists, sources with each entry's ``columns`` the index of its list in column_lists):
    how a store of format 5 (layout.SHARED_COLUMNS_FORMAT_VERSION) writes a compaction footer;
    _merged_of reads both forms into the same entries."""
    lists: list[list[str]] = []
    index: dict[tuple, int] = {}
    out = {}
    for src, info in sources.items():
        key = tuple(info["columns"])
        if key not in index:
            index[key] = len(lists)
            lists.append(list(key))
        out[src] = {**info, "columns": index[key]}
    return lists, out


def _entry_ok(info: Any, column_lists: set[tuple]) -> bool:
    """Whether a source's footer entry has _ENTRY_KEYS of their types (and rows_sha256_binary a
    str where present): _entry_problem's checks, by exact type (JSON gives no subclass; bool is
    not int), a column list once per distinct list. A year of nightly CI merges 10,000 runs
    into a few segments, each footer entry checked at every Store.open: 7 ms for 8,388 entries in
    a fresh process (docs/compact.md, "A year of nightly CI")."""
    if type(info) is not dict:
        return False
    rows, columns = info.get("rows"), info.get("columns")
    if type(rows) is not int or rows < 0 or type(info.get("sha256")) is not str \
            or type(info.get("rows_sha256", info.get("rows_sha256_binary"))) is not str \
            or type(info.get("rows_sha256_binary", "")) is not str or type(columns) is not list:
        return False
    try:
        key = tuple(columns)
        if key in column_lists:
            return True
    except TypeError:  # an unhashable item: not a column name
        return False
    if not all(type(c) is str for c in columns):
        return False
    column_lists.add(key)
    return True


def _entry_problem(src: str, info: Any) -> None:
    """ValueError in one line naming what is wrong with source ``src``'s entry (the first check
    that fails, in _ENTRY_KEYS's order)."""
    if not isinstance(info, dict):
        raise ValueError(f"source {src}: its entry is not an object")
    for key, types in _ENTRY_KEYS.items():
        if key == "rows_sha256" and key not in info and "rows_sha256_binary" in info:
            continue  # format 7: the binary row hash alone
        if key not in info:
            raise ValueError(f"source {src}: no {key!r}")
        if isinstance(info[key], bool) or not isinstance(info[key], types):
            raise ValueError(f"source {src}: {key} is {info[key]!r}")
    raise ValueError(f"source {src}: rows, columns or rows_sha256_binary of the wrong form")


def merged_segments(b, table: str, names: list[str] | None = None, footers: dict | None = None,
                    include_replaced: bool = False) -> tuple[list[MergedSegment], dict[str, str]]:
    """([merged segments of ``table``], {name: why} of merged segments whose footer cannot be read).
    ``names``: the listing to use (one listing for every decision of a reader). ``footers``:
    {(table, name): MergedSegment} read before (a merged segment's file is never rewritten), filled
    here. Merged segments that another merged segment of the listing replaces are hidden, as
    sources are, unless ``include_replaced``."""
    names = b.segment_names(table) if names is None else names
    out, bad, missing = [], {}, []
    for n in sorted(names):
        if not is_merged(n):
            continue
        if footers is not None and (table, n) in footers:
            out.append(footers[(table, n)])
            continue
        try:
            out.append(_merged_of(n, _meta_of(b.read_schema(f"{TABLES_DIR}/{table}/{n}"))))
            if footers is not None:
                footers[(table, n)] = out[-1]
        except FileNotFoundError:
            missing.append(n)
            continue
        except Exception as e:  # noqa: BLE001 - verify reports it
            bad[n] = str(e).splitlines()[0] if str(e) else type(e).__name__
    # only a replaced merged segment is ever removed, once its replacer is older than the grace; one
    # the listing's own merged segments replace hides nothing, but one whose replacer came after the
    # listing (grace 0, or a reader slower than the grace) holds rows this listing would drop
    lost = sorted(set(missing) - {r for m in out for r in m.replaces})
    if lost:
        raise ListingChanged(f"table {table}: merged segment {lost[0]} was listed and then removed (merged again); "
                             f"list again")
    return (out if include_replaced else visible_merged(out)), bad


def visible_merged(merged: list[MergedSegment]) -> list[MergedSegment]:
    """Those of ``merged`` (one listing's) that no other of them replaces: the ones readers read."""
    replaced = {r for m in merged for r in m.replaces}
    return [m for m in merged if m.name not in replaced]


def coverage(b, table: str, names: list[str] | None = None, footers: dict | None = None) -> dict[str, str]:
    """{source file name: merged segment naming it} in ``table``'s listing ``names`` (default: a
    listing of its own, made again where a merged segment of it was merged again and removed
    meanwhile); ``footers``: as merged_segments."""
    for attempt in range(4):
        try:
            merged, _ = merged_segments(b, table, names, footers)
            return {s: m.name for m in merged for s in m.sources}
        except ListingChanged:
            if names is not None or attempt == 3:  # the caller's listing: the caller lists again
                raise
    raise AssertionError("unreachable")


def logical_names(b, table: str, names: list[str] | None = None, footers: dict | None = None) -> list[str]:
    """The file names of ``table``'s segments as writers wrote them, whether still a file or
    merged into a compacted segment (never a merged segment's own name, nor the schema segment).
    ``footers``: as merged_segments."""
    for attempt in range(4):
        listing = b.segment_names(table) if names is None else names
        try:
            covered = coverage(b, table, listing, footers)
        except ListingChanged:  # a listing of its own: made again; the caller's: the caller lists again
            if names is not None or attempt == 3:
                raise
            continue
        plain = [n for n in listing if not is_merged(n) and n != SCHEMA_SEGMENT]
        return sorted(set(plain) | set(covered))
    raise AssertionError("unreachable")


def read_source(b, table: str, name: str, cover: dict[str, str] | None = None) -> pa.Table:
    """The rows writers wrote as segment ``name`` of ``table``: from the merged segment covering
    it (without the source column), else from its own file. FileNotFoundError when neither holds it."""
    cover = coverage(b, table) if cover is None else cover
    merged = cover.get(name)
    if merged is None:
        return read_checked(pa.BufferReader(b.read(f"{TABLES_DIR}/{table}/{name}")))
    t = read_checked(pa.BufferReader(b.read(f"{TABLES_DIR}/{table}/{merged}")))
    return _source_rows(t, name)


def _rows_of_one_source(b, rel: str, name: str, stats_problems: list[str] | None = None) -> pa.Table:
    """The rows of merged segment ``rel`` whose source column is ``name`` (the source column
    kept), from the row groups holding any: the source column of each row group that may hold
    ``name`` is read first, dictionary-encoded (names repeat: the rows are found by comparing
    integer codes), then those row groups whole. Decoded by pyarrow as the whole-file read decodes
    them, so what is hashed is what a reader gets from those bytes. ``stats_problems``: where
    given, what ``statistics_problems`` finds in the footer statistics of those row groups is
    appended.

    Which row groups may hold ``name``: those whose footer statistics of the source column
    bound it (min <= name <= max), and every one whose statistics are missing or do not decode.
    A merged segment of a year of CI holds millions of rows in hundreds of row groups; reading
    the source column of all of them was 41 ms of a 138 ms ``check_evidence`` of one comparison
    (bench_evidence). The statistics pyarrow writes cover the column's values (a dictionary
    column's: its dictionary's), so no row group holding a row of ``name`` is passed over unless
    its statistics are damaged, and then: if those are rows compaction merged, this source comes
    out short of its footer's row count (reported); only rows added to a row group beside the
    merged ones AND statistics damaged to exclude them escape this check (two faults in one row
    group), and ``check_evidence``'s guard count still finds those where they carry the
    comparison's id (it counts by source, whatever the source column's statistics say);
    ``verify`` reads every row group."""
    import numpy as np

    from capturestore import footer as F

    md = b.read_parquet_metadata(rel)
    sizes = np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)
    foot = None
    try:
        foot = b.read_parquet_footer(rel)
        maybe = _groups_bounding(F.row_group_statistics(foot), len(sizes), name)
    except (F.FooterError, RecursionError):
        maybe = list(range(len(sizes)))
    col = b.read_row_groups(rel, maybe, [SOURCE_COLUMN]).column(SOURCE_COLUMN) if maybe else None
    if col is not None and int(sizes[maybe].sum()) != len(col):
        raise ValueError(f"its row groups {maybe} hold {int(sizes[maybe].sum())} rows, their source column {len(col)}")
    hits, off = [], 0
    for ch in col.chunks if col is not None else ():
        if pa.types.is_dictionary(ch.type):  # every code spelling ``name`` (a dictionary may hold it twice)
            codes = np.flatnonzero(pc.equal(ch.dictionary, name).fill_null(False).to_numpy(zero_copy_only=False))
            found = np.flatnonzero(np.isin(ch.indices.fill_null(-1).to_numpy(zero_copy_only=False), codes))
        else:
            found = np.flatnonzero(pc.equal(ch, name).to_numpy(zero_copy_only=False))
        hits.append(np.asarray(found, dtype=np.int64) + off)
        off += len(ch)
    at_read = np.concatenate(hits) if hits else np.zeros(0, np.int64)  # places among the groups read
    ends = np.cumsum(sizes[maybe]) if maybe else np.zeros(0, np.int64)
    which = np.searchsorted(ends, at_read, side="right")  # index into ``maybe``
    group_of = np.asarray(maybe, dtype=np.int64)[which]
    groups = np.unique(group_of).tolist()
    if not groups:  # none here: the file's columns, no row
        return b.read_schema(rel).empty_table()
    # each hit's place in the selected row groups read one after the other
    starts = ends - sizes[maybe]
    base = np.zeros(len(sizes), dtype=np.int64)
    base[groups] = np.concatenate([[0], np.cumsum(sizes[groups])[:-1]])
    at = at_read - starts[which] + base[group_of]
    whole = b.read_row_groups(rel, groups, None)
    if stats_problems is not None:
        stats_problems += statistics_problems(md, b.read_parquet_footer(rel) if foot is None else foot, whole, groups)
    # its rows are one run where compaction wrote them so: a slice of the groups read, not a copy
    t = whole.slice(int(at[0]), len(at)) if int(at[-1]) - int(at[0]) == len(at) - 1 else whole.take(pa.array(at))
    if not pc.all(pc.equal(t.column(SOURCE_COLUMN), name).fill_null(False)).as_py():
        raise ValueError(f"the rows of {name} moved between two reads of its source column")
    return t


def _groups_bounding(stats, n_groups: int, name: str) -> list[int]:
    """The row groups (of ``n_groups``) whose footer statistics ``stats`` (``row_group_statistics``)
    of the source column bound ``name``, or that have none to tell by (no such column chunk, no
    min or max, another physical type, two chunks of its path): every one that may hold a row of
    ``name``."""
    from capturestore import footer as F

    if len(stats) != n_groups:
        return list(range(n_groups))
    key = name.encode()  # Parquet orders BYTE_ARRAY statistics by their unsigned bytes, as bytes compare
    out = []
    for g, chunks in enumerate(stats):
        mine = [c for c in chunks if c.path == (SOURCE_COLUMN,)]
        st = mine[0] if len(mine) == 1 else None  # none, or two chunks of one path (damage): no telling
        if st is None or st.physical_type != F.BYTE_ARRAY or st.min is None or st.max is None \
                or st.min <= key <= st.max:
            out.append(g)
    return out


# Parquet statistics a reader prunes row groups by, and how to compare them with decoded values:
# logically for numbers, strings, bytes and booleans; as the physical integers for dates and times
# (pyarrow gives datetime / pandas Timestamp objects there, which need not compare with Arrow's)
def _comparable(t: pa.DataType) -> str | None:
    if pa.types.is_dictionary(t):
        return _comparable(t.value_type)
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_string(t) or pa.types.is_large_string(t) \
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_float32(t) or pa.types.is_float64(t):
        return "logical"
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_duration(t):
        return "physical"
    return None  # float16, decimals, nested types: not checked (no reader of this store prunes on them)


def _leaves(t: pa.DataType) -> int:
    """How many Parquet leaf columns an Arrow field of type ``t`` is stored as."""
    if pa.types.is_dictionary(t):
        return _leaves(t.value_type)
    if pa.types.is_struct(t):
        return sum(_leaves(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaves(t.key_type) + _leaves(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaves(t.value_type)
    return 1


def statistics_problems(md: pq.FileMetaData, footer: bytes, t: pa.Table, groups: list[int]) -> list[str]:
    """How the footer statistics of row groups ``groups`` of a segment misdescribe their rows
    ``t`` (those row groups decoded, in that order): a column's min / max other than its values'
    (covering them where the footer says inexact, or for an Arrow dictionary column), a null
    count other than its nulls, a min / max on a row group with no value, a statistic that does
    not decode, a column chunk whose path or physical type is not the schema's. DuckDB skips a
    row group by them when a filter falls outside them and answers ``min()`` / ``max()`` from
    them, so a damaged footer could drop rows from a filtered query or change an aggregate while
    the rows themselves, the row counts and the manifest guard's count by comparison all agree
    (a review's repro: one row group's k_linf min and max changed, ``WHERE comparison_id = ...
    AND k_linf < 1e299`` lost its rows, check_evidence and verify passed). NaN is outside min /
    max by the Parquet rule, as Arrow's min_max skips it. Flat columns are checked; the leaves of
    nested ones are not (this store writes none). Exact bounds assume pyarrow computed them from
    the values, as it does for every column but an Arrow dictionary: a merged segment keeps Arrow's
    schema whenever a column is one (``merged_bytes``), so such a column reads back as a
    dictionary here and is held to covering only. ``footer``: the file's Thrift footer, decoded by
    ``capturestore.footer`` (pyarrow's statistics accessors abort the process on some damaged
    footers); ``md`` gives the row groups' row counts and the schema only."""
    from capturestore import footer as F

    try:
        stats = F.row_group_statistics(footer)
    except (F.FooterError, RecursionError) as e:
        return [f"its footer's statistics do not decode: {e}"]
    if len(stats) != md.num_row_groups:
        return [f"its footer lists {len(stats)} row groups' statistics for {md.num_row_groups} row groups"]
    out: list[str] = []
    fields = list(t.schema)
    stored = md.schema.to_arrow_schema()  # the types as Parquet holds them (timestamp[s] as [ms], date64 as days)
    if len(stored) != len(fields):
        return [f"its schema has {len(stored)} columns where its rows have {len(fields)}"]
    kinds = {name: k for k, name in enumerate(("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY",
                                               "FIXED_LEN_BYTE_ARRAY"))}
    first_leaf = [0]
    for sf in stored:  # leaves counted on the types Parquet holds (an extension type's storage, list views as lists)
        first_leaf.append(first_leaf[-1] + _leaves(sf.type))
    off = 0
    for g in groups:
        n = md.row_group(g).num_rows
        rows = t.slice(off, n)
        off += n
        for i, (f, col) in enumerate(zip(fields, rows.columns)):
            j, sf = first_leaf[i], stored.field(i)
            how = _comparable(sf.type)
            if how is None or _leaves(sf.type) != 1:
                continue
            where = f"row group {g}, column {f.name}"
            if j >= len(stats[g]):
                out.append(f"{where}: its footer holds no column chunk {j}")
                continue
            st, want = stats[g][j], kinds.get(md.schema.column(j).physical_type)
            if st.path != (f.name,) or st.physical_type != want:
                out.append(f"{where}: its column chunk's path {'.'.join(st.path)!r} / physical type {st.physical_type} "
                           f"is not the schema's ({f.name!r} / {want}): readers decode it by the schema")
                continue
            if pa.types.is_dictionary(f.type):
                col = col.cast(f.type.value_type)
            if st.null_count is not None and st.null_count != col.null_count:
                out.append(f"{where}: its footer statistics count {st.null_count} nulls where it holds "
                           f"{col.null_count} (a filtered query could skip its rows)")
            if st.min is None and st.max is None:
                continue
            if how == "physical":  # the stored integers: the column in the type Parquet holds, then its bits
                try:
                    col = col.cast(sf.type).cast(pa.int32() if sf.type.bit_width == 32 else pa.int64())
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    continue
            mm = pc.min_max(col)
            vlo, vhi = mm["min"].as_py(), mm["max"].as_py()
            if vlo is None or (isinstance(vlo, float) and math.isnan(vlo)):
                out.append(f"{where}: its footer statistics give a min / max to a row group with no value (all null "
                           f"or NaN): DuckDB answers min() and max() from them")
                continue
            unsigned = pa.types.is_unsigned_integer(sf.type)
            lo, hi = (None if v is None else F.decode_value(v, want, unsigned) for v in (st.min, st.max))
            if (st.min is not None and lo is None) or (st.max is not None and hi is None):
                out.append(f"{where}: its footer statistics do not decode as its physical type {want}")
                continue
            if isinstance(vlo, str):  # Parquet orders strings by their UTF-8 bytes
                vlo, vhi = vlo.encode(), vhi.encode()
            # DuckDB prunes by them and answers min() / max() from them: they must be the values' own,
            # only covering them where the footer says inexact or pyarrow wrote an Arrow dictionary
            # (its statistics come from the dictionary: a null slot counts the entry it points at)
            loose = pa.types.is_dictionary(f.type)
            try:
                bad_lo = lo is not None and (lo > vlo if loose or st.min_exact is False else lo != vlo)
                bad_hi = hi is not None and (hi < vhi if loose or st.max_exact is False else hi != vhi)
            except TypeError:
                bad_lo = bad_hi = True
            if bad_lo or bad_hi:
                out.append(f"{where}: its footer statistics (min {lo!r}, max {hi!r}) are not its values' (min {vlo!r}, "
                           f"max {vhi!r}): a filtered query would skip its rows, min() / max() would read them")
    return out


def _source_array(merged: pa.Table) -> pa.Array:
    """A merged table's source column as one array: a string column as ``large_string`` first
    (its names pass 2 GiB of string data at ~50 M rows, beyond what ``string`` offsets address:
    combining the chunks raised there, a review's repro)."""
    col = merged.column(SOURCE_COLUMN)
    if pa.types.is_string(col.type):
        col = col.cast(pa.large_string())
    return col.combine_chunks()


def split_sources(merged: pa.Table) -> dict[str, pa.Table]:
    """{source: its rows, in order, without the source column or schema metadata} of a merged
    table, in one pass (filtering the whole table once per source was sources x rows). Where each
    source's rows are one run of consecutive rows, as compaction writes them, the rows are slices
    of ``merged`` (no copy); otherwise (another tool's file, damage) gathered by a stable sort."""
    import numpy as np

    runs = _source_runs(merged.column(SOURCE_COLUMN))
    if runs is not None:
        rows = merged.drop_columns([SOURCE_COLUMN]).replace_schema_metadata(None)
        return {src: rows.slice(a, n) for src, a, n in runs}
    col = _source_array(merged).dictionary_encode()
    names = col.dictionary.to_pylist() + [None]  # rows with no source name (damage) under None
    codes = col.indices.fill_null(len(names) - 1).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(codes, kind="stable")  # each source's rows together, in their order
    rows = merged.drop_columns([SOURCE_COLUMN]).take(pa.array(order)).replace_schema_metadata(None)
    counts = np.bincount(codes, minlength=len(names))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    return {src: rows.slice(a, n) for src, a, n in zip(names, starts, counts.tolist()) if n}


_MAX_SOURCE_RUNS = 1 << 20  # beyond this many runs of names the sort is the faster way anyway


def _source_runs(col: pa.ChunkedArray) -> list[tuple[str | None, int, int]] | None:
    """[(source name or None, first row, rows)] of a merged table's source column when every name
    (a null too) fills one run of consecutive rows; None when one comes back after another name.
    On a merged segment of 10 M rows this replaced a sort and a gather of the whole table (8 of
    verify's 43 s on bench_evidence's store) by one comparison of neighbouring names."""
    out: list[tuple[str | None, int, int]] = []
    seen: set[str | None] = set()
    at = 0
    for ch in col.chunks:
        if not len(ch):
            continue
        if pa.types.is_dictionary(ch.type):
            ch = ch.dictionary_decode()
        try:
            ree = pc.run_end_encode(ch, run_end_type=pa.int64())
        except pa.ArrowNotImplementedError:  # a type it has no kernel for (string_view): the sort
            return None
        if len(ree.values) + len(out) > _MAX_SOURCE_RUNS:
            return None
        start = 0
        for name, end in zip(ree.values.to_pylist(), ree.run_ends.to_pylist()):
            if out and out[-1][0] == name and out[-1][1] + out[-1][2] == at + start:  # across chunks
                out[-1] = (name, out[-1][1], out[-1][2] + end - start)
            elif name in seen:  # a name coming back: not one run each
                return None
            else:
                out.append((name, at + start, end - start))
                seen.add(name)
            start = end
        at += len(ch)
    return out


def plain_segment_rows(data: bytes, table: str) -> pa.Table:
    """The rows of a segment a writer wrote (not a merged one), checked whole: every page against
    its CRC, the rows by Arrow's full validation, their names and types against the second copy
    the footer holds (pyarrow's ``ARROW:schema``, where the writer left one) and, in a run table,
    against its schema, and the footer's row-group statistics against the rows (what DuckDB
    prunes by). The CRCs cover pages, not the footer: one flipped bit there renamed a column
    (``value`` -> ``walue``: its sum read 0.25 for 249750.25) or moved a bound (``WHERE i = 999``
    counted 1000 rows), read by pyarrow and DuckDB without an error (a review's sweep of every
    footer bit). ValueError / OSError in one line saying what disagrees."""
    f = checked_file(pa.BufferReader(data))
    t = validated(f.read(), "its rows")
    md = f.metadata
    got = t.schema.remove_metadata()
    arrow = (md.metadata or {}).get(b"ARROW:schema")
    if arrow is not None:
        try:
            kept = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(arrow))).remove_metadata()
        except Exception as e:  # noqa: BLE001 - damaged in the footer
            raise ValueError(f"its footer's copy of the columns (ARROW:schema) is unreadable: {e}") from None
        if not got.equals(kept):
            raise ValueError(f"its columns {_columns(got)} differ from the footer's copy of them {_columns(kept)}")
    if table in SCHEMAS:  # an older segment may lack a column added since, never hold one of another name or type
        want = SCHEMAS[table]
        odd = [f for f in got if want.get_field_index(f.name) < 0 or want.field(f.name).type != f.type]
        if odd:
            raise ValueError(f"its column {odd[0].name} ({odd[0].type}) is not one of the {table} table's columns")
    stats = statistics_problems(md, footer_bytes(data), t, list(range(md.num_row_groups)))
    if stats:
        raise ValueError(stats[0])
    return t


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} ({f.type})" for f in schema)


def _source_rows(merged: pa.Table, name: str, columns: list[str] | None = None) -> pa.Table:
    rows = merged.filter(pc.equal(merged.column(SOURCE_COLUMN), name)).drop_columns([SOURCE_COLUMN])
    rows = rows.replace_schema_metadata(None)
    return rows.select(columns) if columns is not None else rows


def rows_sha256(t: pa.Table) -> str:
    """SHA-256 of ``t``'s rows in canonical form: the rows in order, as JSON of their Python
    values in ``t``'s column order (floats exactly; NaN spelt NaN)."""
    names = t.column_names
    if names and len(set(names)) == len(names):  # by column: the same values, no dict per row
        rows: Any = list(zip(*(_py_values(c) for c in t.columns)))  # a tuple is written as a list
    else:  # no column, or a name twice (to_pylist's dicts keep one of them): as it was defined
        rows = [list(r.values()) for r in t.to_pylist()]
    text = json.dumps(rows, default=repr, allow_nan=True)
    return hashlib.sha256(json.dumps(names).encode() + b"\n" + text.encode()).hexdigest()


_BINARY_FORM = b"capturestore rows, binary form 1\n"


def rows_sha256_binary(t: pa.Table) -> str | None:
    """SHA-256 of ``t``'s rows in a binary canonical form that two tables share exactly when their
    ``rows_sha256`` is the same (its values, not their Arrow types or chunks: every integer as
    int64, every float32 / float64 as float64 with one NaN, strings as UTF-8 of any Arrow string
    type, a column of nulls alone as nulls whatever its type), computed by column in numpy: ~50x
    faster than the JSON of ``rows_sha256`` (check_evidence hashes a source's rows each time).
    None for a table this form does not cover (a column of another type, float16 among them: the
    JSON form spells it as pyarrow's ``to_pylist`` gives it, ``np.float16(0.5)`` before pyarrow 21;
    an integer beyond int64; a name twice): ``rows_sha256`` alone is its hash."""
    import numpy as np

    names = t.column_names
    if len(set(names)) != len(names):
        return None
    h = hashlib.sha256(_BINARY_FORM + json.dumps(names).encode() + b"\n" + t.num_rows.to_bytes(8, "little"))
    for c in t.columns:
        if pa.types.is_dictionary(c.type):  # decoded: a null in the dictionary is a null value
            c = pa.chunked_array([ch.dictionary_decode() for ch in c.chunks], c.type.value_type)
        typ = c.type
        valid = np.ones(len(c), np.uint8) if not c.null_count else \
            np.asarray(pc.is_valid(c).to_numpy(zero_copy_only=False), dtype=np.uint8)
        try:
            if c.null_count == len(c):
                h.update(b"n")
                continue
            if pa.types.is_integer(typ):
                kind, v = b"i", pc.cast(c, pa.int64()).fill_null(0).to_numpy().astype("<i8", copy=False)
            elif pa.types.is_float32(typ) or pa.types.is_float64(typ):
                v = pc.cast(c, pa.float64()).fill_null(0.0).to_numpy().astype("<f8")
                kind, v = b"f", np.where(np.isnan(v), np.float64("nan"), v)  # one NaN, as JSON spells every NaN
            elif pa.types.is_boolean(typ):
                kind, v = b"b", pc.cast(c, pa.uint8()).fill_null(0).to_numpy().astype(np.uint8)
            elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
                a = pc.cast(c, pa.large_string()).combine_chunks().fill_null("")
                off = np.frombuffer(a.buffers()[1], dtype="<i8")[a.offset:a.offset + len(a) + 1]
                data = a.buffers()[2]
                body = b"" if data is None else data.to_pybytes()[int(off[0]):int(off[-1])]
                h.update(b"s" + valid.tobytes() + np.diff(off).astype("<i8").tobytes()
                         + len(body).to_bytes(8, "little") + body)
                continue
            else:
                return None
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # an unsigned value beyond int64
            return None
        h.update(kind + valid.tobytes() + np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def _rows_match(rows: pa.Table, info: dict[str, Any], fast: bool) -> bool:
    """Whether ``rows`` are the rows a footer entry ``info`` describes (its row count is checked
    apart). ``fast``: by the binary digest alone where the entry has one (check_evidence;
    compaction, before it merges a merged segment again or removes the sources one replaces: the
    two digests were made from the same rows, and the binary one is equal exactly where the JSON
    one is); else by every digest it has (verify)."""
    binary = info.get("rows_sha256_binary")
    if binary is not None and rows_sha256_binary(rows) != binary:
        return False
    if (fast or "rows_sha256" not in info) and binary is not None:  # format 7: an entry may hold it alone
        return True
    return rows_sha256(rows) == info["rows_sha256"]


_NUMPY_EXACT = (pa.types.is_integer, pa.types.is_float32, pa.types.is_float64)


def _py_values(c: pa.ChunkedArray) -> list:
    """``c.to_pylist()``: through numpy where that gives the same Python values faster (integers,
    float32 and float64 without nulls: an int, or the float exactly, either way)."""
    if c.null_count == 0 and any(f(c.type) for f in _NUMPY_EXACT):
        return c.to_numpy().tolist()
    return c.to_pylist()


def _entry_rows(by: dict[str, pa.Table], t: pa.Table, s: str, info: dict[str, Any]) -> pa.Table:
    """Source ``s``'s rows of merged table ``t`` (``by``: ``split_sources(t)``) in its footer
    entry's columns; a source of no row holds none here: its columns, no rows."""
    rows = by.get(s, t.slice(0, 0).drop_columns([SOURCE_COLUMN]).replace_schema_metadata(None)) \
        if SOURCE_COLUMN in t.column_names else pa.table({})
    return rows.select([c for c in info["columns"] if c in rows.column_names])


def _with_binary_hashes(m: MergedSegment, t: pa.Table) -> MergedSegment:
    """``m`` with ``rows_sha256_binary`` added to each source entry written without one (by a
    capturestore before it), from that source's rows in ``t``: ``merged_problems`` has just
    checked them against the entry's JSON hash, so a re-merge carries both and check_evidence
    checks those sources by the binary one from then on."""
    by = split_sources(t)
    sources = {}
    for s, info in m.sources.items():
        info = dict(info)
        if "rows_sha256_binary" not in info:
            h = rows_sha256_binary(_entry_rows(by, t, s, info))
            if h is not None:
                info["rows_sha256_binary"] = h
        sources[s] = info
    return dataclasses.replace(m, sources=sources)


def merged_problems(b, table: str, m: MergedSegment, only: str | None = None, t: pa.Table | None = None,
                    md: pq.FileMetaData | None = None, foot: bytes | None = None, fast: bool = False) -> list[str]:
    """How merged segment ``m`` of ``table`` disagrees with its footer: unreadable, a source's
    rows missing, extra or altered (row count, canonical row hash), rows of no listed source, row
    group statistics that do not describe their rows (``statistics_problems``).
    ``only``: the rows of that one source alone (check_evidence; rows of a source the footer does
    not list are verify's to find, and the manifest guard's when they carry a comparison's id; the
    statistics of the row groups holding it). ``t``, ``md``, ``foot``: its rows, footer and footer
    bytes, when the caller has read them. ``fast``: each source's rows checked by the binary row
    hash alone where its entry has one (as ``only`` is): compaction's own checks, before it merges
    a merged segment again or removes the sources of one; verify checks both hashes."""
    where = f"table {table} merged segment {m.name}"
    rel = f"{TABLES_DIR}/{table}/{m.name}"
    stats: list[str] = []
    try:
        if t is None and only is not None:
            # one source: its rows decoded from the row groups that hold it (found by the source
            # column, read dictionary-encoded), not the whole merged segment (up to millions of
            # rows: check_evidence paid that for every comparison it checked)
            t = _rows_of_one_source(b, rel, only, stats)
        else:
            if t is None:
                data = b.read(rel)
                f = checked_file(pa.BufferReader(data))
                t, md, foot = f.read(), f.metadata, footer_bytes(data)
            else:
                md = md if md is not None else b.read_parquet_metadata(rel)
                foot = b.read_parquet_footer(rel) if foot is None else foot
            stats = statistics_problems(md, foot, t, list(range(md.num_row_groups)))
    except Exception as e:  # noqa: BLE001
        return [f"{where} is unreadable: {e}"]
    out = [f"{where}: {p}" for p in stats]
    try:
        by = split_sources(t) if SOURCE_COLUMN in t.column_names else {}
    except Exception as e:  # noqa: BLE001 - verify reports it
        return [f"{where} is unreadable: its source column: {e}"]
    if only is None:
        for s in sorted(set(by) - set(m.sources), key=lambda s: (s is None, s or "")):  # None: rows naming none
            out.append(f"{where} holds rows of {s!r}, which its footer does not list")
    for s, info in sorted(m.sources.items()):
        if only is not None and s != only:
            continue
        # a source of no row holds none here: its columns, no rows (its footer hash names the columns)
        rows = _entry_rows(by, t, s, info)
        if rows.num_rows != info["rows"]:
            out.append(f"{where}: source {s} has {rows.num_rows} rows where compaction merged {info['rows']} "
                       f"(rows lost or added)")
        elif not _rows_match(rows, info, fast=fast or only is not None):
            out.append(f"{where}: the rows of source {s} differ from what compaction merged (row hash)")
    return out


# ---------------------------------------------------------------------------------- compact
@dataclass
class TableCompaction:
    table: str
    segments_before: int  # segment files before (schema segment not counted)
    segments_after: int
    rows: int  # rows merged by this call
    bytes_before: int  # bytes of the table's segment files before
    bytes_after: int
    merged: str | None = None  # the merged segment written, if any
    sources_removed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why segments were left as they are
    remerged: list[str] = field(default_factory=list)  # merged segments merged again into ``merged``
    stale_lock: bool = False  # left because a stopped compaction's lock is still there (gc removes it)


@dataclass
class CompactResult:
    tables: list[TableCompaction]

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


def _sizes(b, table: str) -> dict[str, int]:
    return {rel.rsplit("/", 1)[-1]: size for rel, size in b.find(f"{TABLES_DIR}/{table}").items()
            if rel.endswith(".parquet") and "/" not in rel[len(TABLES_DIR) + len(table) + 2:]}



def source_row_groups(merged: pa.Table, target: int | None = None) -> list[int]:
    """Row counts of a merged segment's row groups: consecutive rows of one source (a run of its
    source column) are never split between row groups unless they are more than ``target`` rows
    (default MERGED_ROW_GROUP_ROWS; then into row groups of their own of ``target`` rows, the last
    fewer), and runs share a row group while it stays within ``target``. So the rows of a source
    lie in row groups of at most ``max(target, its rows)`` rows: ``check_evidence`` decodes those
    (``_rows_of_one_source``), not pyarrow's default of about a million rows."""
    import numpy as np

    target = MERGED_ROW_GROUP_ROWS if target is None else int(target)
    n = merged.num_rows
    if not n:
        return []
    codes = _source_array(merged).dictionary_encode().indices
    codes = codes.fill_null(-1).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(codes[1:] != codes[:-1]) + 1])
    runs = np.diff(np.concatenate([starts, [n]])).tolist()
    out: list[int] = []
    fill = 0  # rows in the row group being filled
    for r in runs:
        if fill and fill + r > target:
            out.append(fill)
            fill = 0
        if r > target:  # a large source: row groups of its own
            out += [target] * (r // target)
            r %= target
            if r:
                out.append(r)
            continue
        fill += r
    if fill:
        out.append(fill)
    return out


def merged_bytes(merged: pa.Table) -> bytes:
    """A merged segment's bytes: without pyarrow's ``ARROW:schema`` footer entry, so the footer
    every reader's listing reads holds the per-source metadata once, unless some column's type
    reads back otherwise without it (``duration`` as int64, ``large_string`` as string, ... in a
    user's table): then with it, since a type changed on disk would change the rows compact
    checked (verify would report them altered). Row groups cut at source boundaries
    (``source_row_groups``)."""
    groups = source_row_groups(merged)
    data = segment_bytes(merged, store_schema=False, groups=groups)
    back = pq.read_schema(pa.BufferReader(data))
    if back.remove_metadata().equals(merged.schema.remove_metadata(), check_metadata=False):
        return data
    return segment_bytes(merged, groups=groups)

def compact(store, tables: list[str] | None = None, grace_s: float | None = None,
            on_step: Callable[[str], None] | None = None) -> CompactResult:
    """Merge each table's committed segments into one merged segment, and remove sources of
    merged segments older than ``grace_s`` (default grace_seconds()). ``tables``: all by default.
    StoreError in one line for an unknown table or a store that cannot be written. ``on_step``:
    called with the name of each step just done (the crash tests kill there)."""
    from capturestore.store import require_writable

    b = store.backend
    known = b.table_names()
    for t in tables or ():
        if t not in known:
            raise StoreError(f"compact: {store.root} has no table {t!r} (its tables: {', '.join(known) or 'none'})")
    if grace_s is not None and not (isinstance(grace_s, (int, float)) and math.isfinite(grace_s) and grace_s >= 0):
        raise StoreError(f"compact: grace {grace_s!r} is not a number of seconds >= 0")
    require_writable(store, "compact")
    grace = grace_seconds() if grace_s is None else float(grace_s)
    step = on_step or (lambda s: None)
    out = []
    for t in tables or known:
        lock_id = f"{LOCK_PREFIX}{t}"
        try:  # created if absent (a dead compaction's lock taken over where the medium allows): atomic
            lock = b.writer_lock(lock_id, {"status": f"compacting {t}"})
        except WriterIdTaken:
            alive = b.liveness()(lock_id)
            why = f"another compaction of {t} is running" if alive else \
                f"a stopped compaction left {PENDING_DIR}/{lock_id}.json (run capturestore gc, then compact)"
            out.append(_untouched(b, t, why))
            out[-1].stale_lock = not alive
            continue
        try:
            out.append(_compact_table(store, t, grace, step))
        finally:
            lock.release()
    return CompactResult(out)


def _merged_table(parts: list[pa.Table], sources: dict[str, dict[str, Any]], remerged: dict[str, dict[str, Any]],
                  json_hash: bool = True) -> tuple[pa.Table | None, dict[str, dict[str, Any]] | None]:
    """(the parts as one table, the footer's per-source entries), each source's rows
    checked to read back unchanged: a new source's against its rows as read, a merged-again
    source's against its merged segment's footer (row count, row hash). (None, None) when some
    would change (a type promotion) or the parts do not concatenate. ``json_hash``: each new entry
    holds the JSON row hash too (a store before format 7), else only where it has no binary one."""
    try:
        merged = pa.concat_tables(parts, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None, None
    meta: dict[str, dict[str, Any]] = {}
    if all(p.schema.equals(merged.schema, check_metadata=False) for p in parts):
        # every part already of the merged schema: concatenated as they are, no value converted, so
        # each source's rows are its part's rows (a merged-again source's checked against its
        # footer before): hashed once each, from its own table, without filtering the merged one
        for n, info in sources.items():
            binary = _own_rows_sha256(info, binary=True)
            meta[n] = _entry(info, _own_rows_sha256(info) if json_hash or binary is None else None, binary)
        for n, info in remerged.items():
            meta[n] = dict(info)
        return merged, meta
    for n, info in sources.items():
        rows = _source_rows(merged, n, info["columns"])
        binary, own = rows_sha256_binary(rows), _own_rows_sha256(info, binary=True)
        if binary is not None and own is not None:  # equal exactly where the JSON hashes are, whatever the types
            if binary != own:  # the merge changed a value (a type promotion): leave it
                return None, None
            h = rows_sha256(rows) if json_hash else None
        else:
            h = rows_sha256(rows)
            if h != _own_rows_sha256(info):
                return None, None
        meta[n] = _entry(info, h, binary)
    for n, info in remerged.items():  # rows merged before: as their merged segment's footer says
        rows = _source_rows(merged, n, info["columns"])
        if rows.num_rows != info["rows"] or not _rows_match(rows, info, fast=False):
            return None, None
        meta[n] = dict(info)
    return merged, meta


def _first_line(e: BaseException) -> str:
    """An error's first line (at most 200 characters), or its type's name where it says nothing."""
    return str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _type_clash(named: list[tuple[str, pa.Table]]) -> str:
    """Why segments (``(name, its rows)``) do not merge unchanged, for the skipped list: a column
    whose values in some segment would not read back unchanged merged ("a column's type differs:
    column 'x' is int64 in A.parquet, double in B.parquet", B one holding the merged type), each
    column tried alone as ``_merged_table`` tries the rows (a null column beside a string one, or
    string beside large_string, merges unchanged and is not named); else what is known. Never
    raises: it only words a refusal already made."""
    try:
        return _type_clash_of(named)
    except Exception as e:  # noqa: BLE001 - e.g. a value the row hash cannot render
        return f"a column's type differs ({type(e).__name__} while finding which)"


def _type_clash_of(named: list[tuple[str, pa.Table]]) -> str:
    cols: dict[str, list[tuple[str, pa.ChunkedArray]]] = {}
    for label, p in named:
        for f in p.schema:
            if f.name != SOURCE_COLUMN:
                cols.setdefault(f.name, []).append((label, p.column(f.name)))
    for col, parts in cols.items():
        if all(c.type.equals(parts[0][1].type) for _, c in parts):
            continue
        try:
            merged = pa.concat_tables([pa.table({col: c}) for _, c in parts], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            label, c = parts[0]
            other = next(lab for lab, d in parts if not d.type.equals(c.type))
            return f"a column's type differs: column {col!r} is {c.type} in {label}, no common type with " \
                   f"{next(d.type for lab, d in parts if lab == other)} in {other}"
        mt = merged.schema.field(col).type
        off = 0
        for label, c in parts:
            if not c.type.equals(mt) and not _same_rows(merged.slice(off, len(c)), pa.table({col: c})):
                holder = next((lab for lab, d in parts if d.type.equals(mt)), "the merged type")
                return f"a column's type differs: column {col!r} is {c.type} in {label}, {mt} in {holder}"
            off += len(c)
    return "the column types agree or merge unchanged; a value would not read back unchanged"


def _same_rows(a: pa.Table, b: pa.Table) -> bool:
    """Whether two tables' rows hash alike: the binary row hash where both have that form, else the JSON one."""
    ha, hb = rows_sha256_binary(a), rows_sha256_binary(b)
    return ha == hb if ha is not None and hb is not None else rows_sha256(a) == rows_sha256(b)


def _entry(info: dict[str, Any], h: str | None, binary: str | None) -> dict[str, Any]:
    """A source's footer entry: its row count, SHA-256 of its bytes, its row hashes (the binary
    one where its columns have that form; the JSON one ``h``, which a capturestore that knows no
    other checks, unless None: a store of format 7 with the binary one), its columns."""
    out = {"rows": info["rows"], "sha256": info["sha256"], "columns": info["columns"]}
    if h is not None:
        out["rows_sha256"] = h
    if binary is not None:
        out["rows_sha256_binary"] = binary
    return out


def _own_rows_sha256(info: dict[str, Any], binary: bool = False) -> str | None:
    """rows_sha256 (binary: rows_sha256_binary) of a new source's rows as read (kept in ``info``:
    the tiers try several merges)."""
    key = "own_rows_sha256_binary" if binary else "own_rows_sha256"
    if key not in info:
        info[key] = (rows_sha256_binary if binary else rows_sha256)(info["table"])
    return info[key]


def _tier(merged: list[MergedSegment], rows: int) -> list[MergedSegment]:
    """The merged segments to merge again with ``rows`` new rows: smallest first, each while it
    holds at most TIER_FACTOR times the rows gathered so far, and any that would leave more than
    MAX_MERGED merged segments beside the new one. Merged segments then grow by tiers: a store
    compacted after every batch holds about log(rows / batch) of them, and a row is merged again
    about that many times."""
    out, acc = [], rows
    ordered = sorted(merged, key=lambda m: (m.rows, m.name))
    for i, m in enumerate(ordered):
        if m.rows > TIER_FACTOR * acc and len(ordered) - i <= MAX_MERGED:
            break
        out.append(m)
        acc += m.rows
    return out


def _merged_name(replaces: list[str]) -> tuple[float, str]:
    """(created_at, file name stem) of a new merged segment, its name sorting after every merged
    segment it replaces (the window form of the reader rule keeps the last by name): its time
    stamp is now, or one second after the last replaced one's where that is not earlier (a
    replaced segment written within this second, or by a host whose clock runs ahead)."""
    created = time.time()
    stamp = time.strftime(_STAMP, time.gmtime(created))
    last = max(replaces)[len(COMPACTED_PREFIX):len(COMPACTED_PREFIX) + len(stamp)] if replaces else ""
    if last and stamp <= last:
        try:
            stamp = time.strftime(_STAMP, time.gmtime(calendar.timegm(time.strptime(last, _STAMP)) + 1))
        except ValueError:  # not a name compact wrote: sort after it whatever it holds
            stamp = last + "~"
    return created, f"{COMPACTED_PREFIX}{stamp}-{uuid.uuid4().hex[:12]}"


def _store_format(store) -> int:
    """The store's format version as its capturestore.json says now (upgrade may have raised it
    since the store was opened)."""
    from capturestore.layout import FORMAT_FILE
    from capturestore.store import parse_format

    b = store.backend
    return parse_format(b.read(FORMAT_FILE).decode(errors="replace"), b.where(FORMAT_FILE))["format_version"]


def _require_remerged_format(store) -> int:
    """Mark the store format version 3 before its first merged segment that replaces merged ones;
    returns the store's format version (as _store_format: one read of capturestore.json)."""
    from capturestore.layout import FORMAT_FILE, FORMAT_NAME, REMERGED_FORMAT_VERSION
    from capturestore.store import parse_format

    b = store.backend
    info = parse_format(b.read(FORMAT_FILE).decode(errors="replace"), b.where(FORMAT_FILE))
    if info["format_version"] < REMERGED_FORMAT_VERSION:
        info = {**info, "format": FORMAT_NAME, "format_version": REMERGED_FORMAT_VERSION}
        b.put(FORMAT_FILE, (json.dumps(info, indent=2) + "\n").encode(), durable=True)
    return info["format_version"]


def compact_if_due(store, tables) -> CompactResult | None:
    """Compact those of ``tables`` that hold auto_compact_segments() or more segments no merged
    segment covers (what a commit calls: Store._after_commit); None when none is due or it is off.
    A table is tried again only once n / 2 more segments came than its last compaction left."""
    n = auto_compact_segments()
    if not n:
        return None
    b = store.backend

    def plain(t: str) -> int | None:
        names = b.segment_names(t)
        if len(names) < n:  # fewer files than that: nothing to read to know
            return None
        merged, _ = merged_segments(b, t, names, store._footers)
        covered = {s for m in merged for s in m.sources}
        return len([x for x in names if not is_merged(x) and x != SCHEMA_SEGMENT and x not in covered])

    due = [t for t in dict.fromkeys(tables) if (plain(t) or 0) >= max(n, store._auto_compact_left.get(t, 0) + n // 2)]
    if not due:
        return None
    try:
        return compact(store, due)
    finally:  # what it could not merge (segments of a killed writer, a comparison not committed), or all
        for t in due:  # of them when it failed, counts once: the next try waits for n / 2 more
            store._auto_compact_left[t] = plain(t) or 0


def _untouched(b, table: str, why: str) -> TableCompaction:
    sizes = _sizes(b, table)
    n = len([s for s in sizes if s != SCHEMA_SEGMENT])
    return TableCompaction(table, n, n, 0, sum(sizes.values()), sum(sizes.values()), skipped=[why])


def remove_finished_sources(b, table: str, grace_s: float, names: list[str] | None = None,
                            dry_run: bool = False, step: Callable[[str], None] | None = None,
                            kept: list[str] | None = None) -> list[str]:
    """Remove the sources of ``table``'s merged segments older than ``grace_s``, and the merged
    segments they replace; returns their keys. A merged segment whose rows disagree with its footer
    (merged_problems) keeps them: they may be the last good copy; why is appended to ``kept``
    (verify reports the disagreement)."""
    names = b.segment_names(table) if names is None else names
    merged, _ = merged_segments(b, table, names)
    now = time.time()
    present = set(names)
    removed = []
    for m in merged:
        if now - m.created_at < grace_s:
            continue
        left = [s for s in sorted(m.sources) if s in present and not is_merged(s)]
        left += [r for r in sorted(m.replaces) if r in present]
        if not left:
            continue
        problems = merged_problems(b, table, m, fast=True)
        if problems:
            if kept is not None:
                kept.append(f"{len(left)} source(s) of {m.name} kept: it disagrees with its footer "
                            f"({problems[0]}; run capturestore verify)")
            continue
        for s in left:
            rel = f"{TABLES_DIR}/{table}/{s}"
            removed.append(rel)
            if not dry_run:
                b.remove([rel])
                if step:
                    step(f"removed {table}/{s}")
    return removed


def _compact_table(store, table: str, grace: float, step: Callable[[str], None]) -> TableCompaction:
    from capturestore import integrity

    b = store.backend
    before = _sizes(b, table)
    names = b.segment_names(table)
    kept: list[str] = []
    removed = remove_finished_sources(b, table, grace, names, step=step, kept=kept)
    names = [n for n in names if f"{TABLES_DIR}/{table}/{n}" not in set(removed)]
    visible, _ = merged_segments(b, table, names)
    cover = {s: m.name for m in visible for s in m.sources}
    res = TableCompaction(table, len([n for n in before if n != SCHEMA_SEGMENT]), 0, 0,
                          sum(before.values()), 0, sources_removed=removed, skipped=kept)
    candidates = [n for n in sorted(names) if not is_merged(n) and n != SCHEMA_SEGMENT and n not in cover]
    step(f"listed {table}")
    manifest_sha: dict[str, str] = {}
    by_comparison = table not in RUN_TABLES and table != "comparisons" and b.has_column(table, "comparison_id")
    ccommitted: set[str] = set()
    if table in RUN_TABLES:
        alive = b.liveness()
        committed = set(logical_names(b, "runs"))
        ok = [n for n in candidates if n in committed and not alive(n.removesuffix(".parquet"))]
        if len(ok) < len(candidates):
            kept = set(ok)
            left = [n for n in candidates if n not in kept]
            res.skipped.append(f"{len(left)} segment(s) of runs not committed or still being written: "
                               f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}")
        candidates = ok
    elif by_comparison:
        got = integrity.committed_comparisons(b)
        manifests = integrity.comparison_manifests(store) if got is not None else None
        ccommitted = got or set()
        if got is None or manifests is None:
            res.skipped.append("a comparisons segment is unreadable: which comparisons committed is unknown")
            candidates = []
        for m in (manifests or {}).values():
            for e in m or ():
                if e["table"] == table:
                    manifest_sha[e["segment"]] = e["sha256"]
    parts: list[pa.Table] = []
    sources: dict[str, dict[str, Any]] = {}
    for n in candidates:
        try:
            data = b.read(f"{TABLES_DIR}/{table}/{n}")
            t = plain_segment_rows(data, table)
        except FileNotFoundError:  # removed meanwhile (remove_run, gc): not ours to merge
            continue
        except Exception as e:  # noqa: BLE001 - a page failing its CRC, a damaged footer: verify reports it
            res.skipped.append(f"{n} is unreadable ({_first_line(e)}); not merged (run capturestore verify)")
            continue
        sha = hashlib.sha256(data).hexdigest()
        if by_comparison and "comparison_id" in t.column_names:
            ids = set(t.column("comparison_id").to_pylist())
            if not ids <= ccommitted:
                res.skipped.append(f"{n} holds rows of a comparison not committed")
                continue
            if n in manifest_sha and manifest_sha[n] != sha:
                res.skipped.append(f"{n} differs from its comparison's manifest (SHA-256); not merged (run capturestore verify)")
                continue
        t = t.replace_schema_metadata(None)
        sources[n] = {"rows": t.num_rows, "sha256": sha, "columns": t.column_names, "table": t}
        parts.append(t.append_column(SOURCE_COLUMN, pa.array([n] * t.num_rows, pa.string())))
    # merged segments of about the size of what is merged now go into the same merged segment
    replaced: list[MergedSegment] = []
    again: list[pa.Table] = []
    for m in _tier(visible, sum(i["rows"] for i in sources.values())):
        try:
            data = b.read(f"{TABLES_DIR}/{table}/{m.name}")
            f = checked_file(pa.BufferReader(data))
            t = f.read()
        except FileNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001 - verify reports the unreadable segment
            res.skipped.append(f"merged segment {m.name} is unreadable ({_first_line(e)}); not merged again "
                               f"(run capturestore verify)")
            continue
        problems = merged_problems(b, table, m, t=t, md=f.metadata, foot=footer_bytes(data), fast=True)
        if problems:  # never launder rows that disagree with their footer into a new one
            res.skipped.append(f"merged segment {m.name} not merged again: {problems[0]} (run capturestore verify)")
            continue
        if any("rows_sha256_binary" not in i for i in m.sources.values()):
            m = _with_binary_hashes(m, t)
        replaced.append(m)
        again.append(t.replace_schema_metadata(None))
    # the merged segments whose rows merge unchanged with the new ones (a user column int64 in
    # one and double in another would read back changed): each tried in turn, any other left
    merged = meta_sources = None
    fmt = _store_format(store)  # read once: which row hashes the entries hold, and the footer's form below
    json_hash = fmt < BINARY_ROW_HASH_FORMAT_VERSION
    base: list[pa.Table] = []  # the new segments, when they merge unchanged among themselves
    if parts and (len(parts) >= 2 or replaced):
        merged, meta_sources = _merged_table(parts, sources, {}, json_hash)
        if merged is None:
            res.skipped.append(f"segments do not merge unchanged ({_type_clash(list(zip(sources, parts)))}): left as "
                               f"written")
        else:
            base = parts
    kept: list[MergedSegment] = []
    kept_tables: list[pa.Table] = []
    for m, t in zip(replaced, again):
        if len(base) + len(kept_tables) == 0:  # no new segment: the first merged one waits for a partner
            kept.append(m)
            kept_tables.append(t)
            continue
        trial = _merged_table(base + kept_tables + [t], sources if base else {},
                              {s: i for x in (*kept, m) for s, i in x.sources.items()}, json_hash)
        if trial[0] is None:
            named = [*zip(sources if base else (), base), *((k.name, kt) for k, kt in zip(kept, kept_tables)),
                     (m.name, t)]
            res.skipped.append(f"merged segment {m.name} not merged again: its rows and the others' do not merge "
                               f"unchanged ({_type_clash(named)})")
            continue
        kept.append(m)
        kept_tables.append(t)
        merged, meta_sources = trial
    if len(base) + len(kept_tables) < 2:
        merged = None
    replaced = kept
    if merged is not None:
        replaces = sorted({m.name for m in replaced} | {r for m in replaced for r in m.replaces})
        version = _require_remerged_format(store) if replaces else fmt
        created, name = _merged_name(replaces)
        meta = {"version": 2 if replaces else 1, "created_at": created, "sources": meta_sources}
        if replaces:
            meta["replaces"] = replaces
        if version >= SHARED_COLUMNS_FORMAT_VERSION:  # a store of 4 keeps whole lists
            meta["version"] = 3
            meta["column_lists"], meta["sources"] = pack_columns(meta_sources)
        merged = merged.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        b.put(f"{TABLES_DIR}/{table}/{name}.parquet", merged_bytes(merged), if_absent=True)
        res.remerged = [m.name for m in replaced]
        res.merged, res.rows = f"{name}.parquet", merged.num_rows
        step(f"merged {table}")
        if grace <= 0:
            res.sources_removed += remove_finished_sources(b, table, grace, step=step, kept=res.skipped)
    after = _sizes(b, table)
    res.segments_after = len([n for n in after if n != SCHEMA_SEGMENT])
    res.bytes_after = sum(after.values())
    return res

