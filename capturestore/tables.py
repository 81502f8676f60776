"""Parquet segments: the append-only tables of a store.

Each writer commit adds one segment per table, written under a temporary name and renamed into
place (``os.replace`` is atomic on POSIX), so a reader sees a segment whole or not at all.
A run's ``runs`` segment is written last: it is the commit marker. ``prompts`` and ``captures``
rows whose run has no ``runs`` row are invisible in the catalog views and removed by ``gc``.
Comparisons work alike: a ``comparisons`` row is written last, and rows of any other table with
a ``comparison_id`` column are invisible until their comparison has its row (integrity.py).
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from capturestore.layout import TABLES_DIR, segment_tmp_name

RUN_TABLES = ("runs", "prompts", "captures")
SCHEMA_SEGMENT = "_schema.parquet"  # zero-row segment so an empty table still has columns

_TS = pa.timestamp("us", tz="UTC")

RUNS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("status", pa.string()),
    ("engine", pa.string()),
    ("engine_version", pa.string()),
    ("model_path", pa.string()),
    ("model_hash", pa.string()),
    ("dtype", pa.string()),
    ("device", pa.string()),
    ("tp_degree", pa.int32()),
    ("release", pa.string()),
    ("config", pa.string()),  # JSON text
    ("n_prompts", pa.int32()),
    ("created_at", _TS),
    ("committed_at", _TS),
    ("hostname", pa.string()),
    ("pid", pa.int64()),
    ("format_version", pa.int32()),
])

PROMPTS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("prompt_id", pa.string()),
    ("prompt_idx", pa.int32()),
    ("n_tokens", pa.int32()),  # prompt + continuation (teacher / generated tokens)
    ("n_prompt_tokens", pa.int32()),
    ("text", pa.string()),
    ("token_ids", pa.list_(pa.int32())),
])

CAPTURES_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("prompt_id", pa.string()),
    ("array_name", pa.string()),  # path below the prompt group: tokens, logits, kv_k, tensors/<m>/<phase>
    ("kind", pa.string()),  # tokens | logits | kv_k | kv_v | tensor
    ("kv_group", pa.string()),
    ("module", pa.string()),
    ("phase", pa.string()),
    ("steps", pa.list_(pa.int64())),
    ("shape", pa.list_(pa.int64())),
    ("dimension_names", pa.list_(pa.string())),
    ("chunks", pa.list_(pa.int64())),
    ("dtype", pa.string()),  # logical dtype
    ("storage_dtype", pa.string()),
    ("codec", pa.string()),
    ("nbytes", pa.int64()),  # logical bytes
    ("stored_bytes", pa.int64()),  # bytes of the chunk files on disk
    ("layer_names", pa.list_(pa.string())),
    ("path", pa.string()),  # relative to the store root: the array holding the capture
    # a grouped module tensor (format 6): its index along the module axis of the array at ``path``
    # ([module, step, ...]); null where the array is the capture's own
    ("group_index", pa.int32()),
])

SCHEMAS = {"runs": RUNS_SCHEMA, "prompts": PROMPTS_SCHEMA, "captures": CAPTURES_SCHEMA}


def table_dir(root: Path, table: str) -> Path:
    return root / TABLES_DIR / table


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (power-loss durability, not needed for
    crashes), several at a time: one fsync's latency would otherwise dominate small chunks."""
    from concurrent.futures import ThreadPoolExecutor

    paths = []
    for dirpath, _, files in os.walk(root):
        paths += [Path(dirpath) / f for f in files]
        paths.append(Path(dirpath))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(fsync_path, paths))


VECTOR_ROW_GROUP_BYTES = 1 << 20

# Every segment's pages carry Parquet's CRC-32 page checksum, and every read of a segment in this
# process checks it (``read_checked``, ``checked_file``): one flipped bit in a segment's zstd page
# read back as another value with no error (a column summed to 4999950001 where 4999950000 was
# written, through pyarrow and DuckDB alike). DuckDB does not check the CRC, so a query still
# reads such a page; ``verify`` and ``compact`` (which would otherwise merge the damage into a new
# segment with a fresh CRC and row hash) do. Segments written before carry none and read as before.
WRITE_OPTIONS = {"write_page_checksum": True}


def read_checked(source: Any, columns: list[str] | None = None, where: str | None = None) -> pa.Table:
    """``pq.read_table`` of a segment (a path, a file or a ``pa.BufferReader``), every page's CRC
    checked where the writer stored one (OSError naming the page when one differs). where: the
    segment as a user finds it, named in the error (default: the path, where source is one)."""
    with naming_segment(where if where is not None or not isinstance(source, (str, Path)) else str(source)):
        return pq.read_table(source, columns=columns, page_checksum_verification=True)


@contextlib.contextmanager
def naming_segment(where: str | None) -> Iterator[None]:
    """Errors of the Parquet reader inside (a failed page CRC, an undecodable page or footer: Arrow
    names neither the file nor the table) re-raised as their own type, the segment named first, so
    that a command reading the store says which file, not only "CRC checksum verification failed
    for page_ordinal 0". where None: unchanged."""
    try:
        yield
    except (OSError, pa.ArrowException) as e:
        if where is None or where in str(e):
            raise
        damage = "CRC" in str(e) or isinstance(e, pa.ArrowInvalid)  # not so a network error or a missing column
        hint = " (`capturestore verify` lists every damaged segment)" if damage else ""
        try:
            named = type(e)(f"segment {where}: {e}{hint}")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments: as it came
            raise e from None
        raise named from e


def checked_file(source: Any, **kw: Any) -> pq.ParquetFile:
    """``pq.ParquetFile`` whose reads check every page's CRC (as ``read_checked``)."""
    return pq.ParquetFile(source, page_checksum_verification=True, **kw)


def _row_group_rows(data: pa.Table) -> int | None:
    """Rows per Parquet row group: pyarrow's default, except for rows holding float vectors (the
    ``raw_errors`` table), whose row groups are kept near 1 MB so that a query selecting some
    prompts skips the row groups of the others (their min/max statistics) instead of decoding all.
    Measured on raw errors (100 prompts x 16 layers x 16 tokens): 4.8 MB written so, 5.4 MB with
    pyarrow's defaults, 8.4 MB in 1 MB row groups with dictionary pages."""
    if not data.num_rows or not any(pa.types.is_list(f.type) and pa.types.is_floating(f.type.value_type)
                                    for f in data.schema):
        return None
    per_row = max(1, data.nbytes // data.num_rows)
    return int(max(256, VECTOR_ROW_GROUP_BYTES // per_row))


def write_segment(root: Path, table: str, data: pa.Table, segment: str | None = None, durable: bool = False) -> Path:
    """Write ``data`` as one segment of ``table`` atomically; returns the final path.

    ``durable``: fsync the segment before the rename and the directory after it.
    """
    d = table_dir(root, table)
    d.mkdir(parents=True, exist_ok=True)
    if segment is None:
        segment = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    final = d / f"{segment}.parquet"
    tmp = segment_tmp_name(final)
    rows = _row_group_rows(data)
    if rows is None:
        pq.write_table(data, tmp, **WRITE_OPTIONS)
    else:  # float vectors: byte-stream-split + zstd (dictionary pages of small row groups double them)
        vec = [f.name for f in data.schema if pa.types.is_list(f.type) and pa.types.is_floating(f.type.value_type)]
        pq.write_table(data, tmp, row_group_size=rows, compression="zstd", **WRITE_OPTIONS,
                       use_dictionary=[n for n in data.column_names if n not in vec],
                       column_encoding=dict.fromkeys(vec, "BYTE_STREAM_SPLIT"))
    if durable:
        fsync_path(tmp)
    os.replace(tmp, final)
    if durable:
        fsync_path(d)
    return final


def segment_bytes(data: pa.Table, store_schema: bool = True, groups: list[int] | None = None) -> bytes:
    """``data`` as one segment's bytes, encoded as ``write_segment`` writes it. ``store_schema``
    False: without pyarrow's ``ARROW:schema`` footer entry, a base64 copy of the schema and of its
    metadata (a merged segment's per-source metadata would be in its footer twice). ``groups``:
    row counts (summing to the rows) that each start a new row group, cut further where a count
    exceeds the table's own row group size; default: that size's cuts alone."""
    sink = pa.BufferOutputStream()
    rows = _row_group_rows(data)
    opts: dict = {}
    if rows is not None:
        vec = [f.name for f in data.schema if pa.types.is_list(f.type) and pa.types.is_floating(f.type.value_type)]
        opts = {"compression": "zstd", "use_dictionary": [n for n in data.column_names if n not in vec],
                "column_encoding": dict.fromkeys(vec, "BYTE_STREAM_SPLIT")}
    if groups is not None and sum(groups) != data.num_rows:
        raise ValueError(f"segment_bytes: row groups of {sum(groups)} rows for a table of {data.num_rows}")
    with pq.ParquetWriter(sink, data.schema, store_schema=store_schema, **WRITE_OPTIONS, **opts) as w:
        if groups is None:
            w.write_table(data, row_group_size=rows)
        else:  # each write starts a row group of its own (pyarrow never fills one across writes)
            at = 0
            for n in groups:
                w.write_table(data.slice(at, n), row_group_size=rows)
                at += n
        if data.schema.metadata and not store_schema:
            # the schema's metadata as plain footer entries (pyarrow writes it only inside ARROW:schema)
            w.add_key_value_metadata(data.schema.metadata)
    return sink.getvalue().to_pybytes()


def ensure_schema_segments(root: Path) -> None:
    for name, schema in SCHEMAS.items():
        p = table_dir(root, name) / SCHEMA_SEGMENT
        if not p.exists():
            write_segment(root, name, schema.empty_table(), segment=SCHEMA_SEGMENT.removesuffix(".parquet"))


def rows_to_table(rows: Any, what: str) -> pa.Table:
    """pyarrow.Table from a Table, a list of dicts, or a dict of columns; ValueError naming the
    column when an Arrow table given holds data that is not valid for its type."""
    return validated(_as_table(rows, what), what)


def validated(t: pa.Table, what: str) -> pa.Table:
    """``t``, checked in full by Arrow (a string column's bytes are UTF-8, offsets in bounds):
    a table built from raw buffers could hold a string of invalid UTF-8, which Parquet stores as
    given and every later reader decoding it to Python (compaction's row hash) failed on."""
    try:
        t.validate(full=True)
    except pa.ArrowInvalid as e:
        for f, c in zip(t.schema, t.columns):
            try:
                c.validate(full=True)
            except pa.ArrowInvalid as ce:
                raise ValueError(f"{what}: column {f.name} ({f.type}) is not valid Arrow data: "
                                 f"{str(ce).splitlines()[0]}") from None
        raise ValueError(f"{what}: not valid Arrow data: {str(e).splitlines()[0]}") from None
    return t


def _as_table(rows: Any, what: str) -> pa.Table:
    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, dict):
        return pa.table(rows)
    if isinstance(rows, list):
        if not rows:
            raise ValueError(f"{what}: no rows to append")
        if not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{what}: rows must be dicts")
        return pa.Table.from_pylist(rows)
    if hasattr(rows, "to_arrow"):  # polars / duckdb relations
        return rows.to_arrow()
    if type(rows).__name__ == "DataFrame":  # pandas, without importing it
        return pa.Table.from_pandas(rows, preserve_index=False)
    raise ValueError(f"{what}: expected a pyarrow.Table, a list of dicts or a dict of columns, got {type(rows).__name__}")


def segment_files(root: Path, table: str) -> list[Path]:
    d = table_dir(root, table)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name.endswith(".parquet"))


def _kind(t: pa.DataType):
    """What DuckDB's ``union_by_name`` unifies across segments: numbers with numbers (upcast),
    strings, times (any unit or time zone spelling), lists by their items' kind, structs; None
    for an all-NULL column (it reads as any type)."""
    if pa.types.is_null(t):
        return None
    for name, test in (("number", lambda x: pa.types.is_integer(x) or pa.types.is_floating(x) or pa.types.is_decimal(x)),
                       ("string", lambda x: pa.types.is_string(x) or pa.types.is_large_string(x)),
                       ("binary", lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x)),
                       ("time", pa.types.is_temporal), ("bool", pa.types.is_boolean),
                       ("struct", pa.types.is_struct), ("map", pa.types.is_map)):
        if test(t):
            return name
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return ("list", _kind(t.value_type))
    return str(t)


def _unifiable(a: pa.DataType, b: pa.DataType) -> bool:
    ka, kb = _kind(a), _kind(b)
    if ka is None or kb is None:
        return True
    if isinstance(ka, tuple) and isinstance(kb, tuple):  # lists: their items must unify
        return ka[1] is None or kb[1] is None or ka[1] == kb[1]
    return ka == kb


class SegmentSchemas:
    """Column types of a table's segments, read from their footers once each (``append_table``
    checks a new segment against them)."""

    def __init__(self) -> None:
        self.read: set[str] = set()  # segment file names already read
        self.columns: dict[str, tuple[pa.DataType, str]] = {}  # column -> (type, first segment with it)

    def check(self, backend, table: str, data: pa.Table) -> None:
        """Refuse ``data`` as a new segment of ``table`` when a column's type cannot be read together
        with an existing segment's: one such segment makes every query on the table fail.
        ``backend``: the store's (backends.Backend)."""
        for name in backend.segment_names(table):
            if name in self.read:
                continue
            try:
                schema = backend.read_schema(f"{TABLES_DIR}/{table}/{name}")
            except Exception:  # noqa: BLE001 - an unreadable segment is verify's to report
                continue
            self.read.add(name)
            for f in schema:
                self.columns.setdefault(f.name, (f.type, name))
        for f in data.schema:
            have = self.columns.get(f.name)
            if have is not None and not _unifiable(have[0], f.type):
                raise ValueError(f"append_table {table}: column {f.name!r} is {f.type} here but {have[0]} in segment "
                                 f"{table}/{have[1]}; one table cannot hold both (DuckDB could not read the table)")


def committed_run_ids(root: Path) -> set[str]:
    """Run ids with a runs segment (the commit marker); segments are named after the run."""
    return {p.name.removesuffix(".parquet") for p in segment_files(root, "runs") if p.name != SCHEMA_SEGMENT}


def committed_comparison_ids(root: Path) -> set[str] | None:
    """Comparison ids with a ``comparisons`` row (the commit marker); None when a ``comparisons``
    segment is unreadable (then nobody can tell which comparisons committed)."""
    out: set[str] = set()
    for seg in segment_files(root, "comparisons"):
        try:
            out |= set(read_checked(seg, columns=["comparison_id"]).column(0).to_pylist())
        except Exception:  # noqa: BLE001 - verify reports unreadable segments
            return None
    out.discard(None)
    return out


def segment_comparison_ids(seg: Path | bytes) -> set[str] | None:
    """The comparison ids of one segment's rows (from the footer's statistics where they pin a
    single id, else from the column); None when the segment has no ``comparison_id`` column.
    ``seg``: its path, or its bytes."""
    if isinstance(seg, (bytes, bytearray, memoryview)):
        data = seg
        seg = pa.BufferReader(data)
    else:
        data = None
    meta = pq.read_metadata(seg)
    leaves = [meta.schema.column(j).path for j in range(meta.num_columns)]
    if "comparison_id" not in leaves:
        return None
    col = leaves.index("comparison_id")
    ids: set[str] = set()
    for i in range(meta.num_row_groups):
        st = meta.row_group(i).column(col).statistics
        if st is None or not st.has_min_max or st.min != st.max or (st.has_null_count and st.null_count):
            src = seg if data is None else pa.BufferReader(data)
            return set(read_checked(src, columns=["comparison_id"]).column(0).to_pylist()) - {None}
        ids.add(st.min if isinstance(st.min, str) else st.min.decode())
    return ids


def read_table(root: Path, table: str, run_id: str | None = None) -> pa.Table:
    """All rows of one run table (committed runs only for prompts/captures)."""
    schema = SCHEMAS[table]
    files = segment_files(root, table)
    if table != "runs":
        ok = committed_run_ids(root)
        files = [f for f in files if f.name.removesuffix(".parquet") in ok]
    if run_id is not None:
        files = [f for f in files if f.name == f"{run_id}.parquet"]
    else:
        files = [f for f in files if f.name != SCHEMA_SEGMENT]
    parts = [read_checked(f) for f in files]
    parts = [p.select([n for n in schema.names if n in p.column_names]) for p in parts]
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts, promote_options="default")
