"""The DuckDB catalog: one view per table directory under ``tables/``.

The catalog holds nothing but views over the Parquet segments, so it is always rebuildable
from ``tables/`` alone. Views show committed rows only: ``prompts``/``captures`` rows of runs with
a ``runs`` row, and rows of tables with a ``comparison_id`` column of comparisons with a
``comparisons`` row. A table whose columns are declared in code (the comparators' tables and
``comparisons``, ``capturestore.comparators.declared_tables``) is a view of those columns by
name and type, whatever its segments hold (a column older segments lack reads as NULL); the
declared schema versions are part of ``catalog.stamp``. Queries from this library run on a private in-memory DuckDB connection
with the same views over absolute paths, each table read as explicit file lists of one listing (segment_files)
instead of the glob and its window (no file lock is ever held, so any number of processes
can read and write the store at once).

``catalog.duckdb`` is the same set of views in a file for people running ``duckdb
<store>/catalog.duckdb``. It travels with its store (``cp -a``, ``tar``, ``rsync``): its views
find the segments relative to the catalog file itself, whatever the working directory. DuckDB
resolves a relative path against the working directory (or ``file_search_path``), and a table
function's arguments must be constants (no subquery of ``duckdb_databases()``), so a view reads
the one constant that carries the database's own path: ``temp_directory``, which DuckDB sets to
``<database file>.tmp`` when it opens a file (DuckDB's "files created by DuckDB" page; measured
with duckdb 2.0.1; ``catalog.tmp`` is accepted too). Where that does not hold (the file ATTACHed to
another database, ``temp_directory`` set, or a client with another default: duckdb-java 1.5.1 on
Windows set ``.tmp``, duckdb/duckdb-java#622) the views use ``file_search_path`` when it is set
(``SET file_search_path = '<store>'``) and otherwise refuse in one line saying so, never reading
the segments of whatever store the working directory holds. The file is rebuilt into a temporary file and renamed into place,
only when ``catalog.stamp`` says its tables or view version changed (not on every open).
"""
from __future__ import annotations

import fcntl
import functools
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import duckdb

    from capturestore.backends import Backend

from capturestore.compaction import SOURCE_COLUMN
from capturestore.layout import CATALOG_FILE, CATALOG_STAMP_FILE, LEGACY_CATALOG_ROOT_FILE, TABLES_DIR
from capturestore.tables import RUN_TABLES, SCHEMAS

# First line of catalog.stamp (with _view_code_digest); a change to what view_sql writes changes
# it, so stores rebuild.
CATALOG_STAMP = ("capturestore catalog views 10: segments relative to catalog.duckdb, committed rows only, "
                 "declared tables by named columns, manifest guard, glob-escaped store path, "
                 "compacted segments hide their sources, a table's own filename column kept, "
                 "the last merged segment of a source wins, float columns may hold NaN")
SEGMENT_FILE_COLUMN = "__capturestore_file"  # read_parquet's file name column (never shown in a view)
SEGMENT_COLUMN = "__capturestore_segment"  # the segment a writer wrote a row in (the manifest guard's)

# The store directory with a trailing '/', as a constant DuckDB folds when it binds a view.
_STORE_DIR_SQL = (
    f"CASE WHEN suffix(current_setting('temp_directory'), '/{CATALOG_FILE}.tmp') "
    f"OR suffix(current_setting('temp_directory'), '/{CATALOG_FILE.removesuffix('.duckdb')}.tmp') "
    "THEN parse_dirpath(current_setting('temp_directory')) || '/' "
    "WHEN current_setting('file_search_path') <> '' THEN '' "
    f"ELSE error('{CATALOG_FILE}: cannot tell which store this catalog belongs to; open it directly "
    f"(duckdb <store>/{CATALOG_FILE}) or SET file_search_path to the store directory') END"
)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


# ``root`` of the functions of the in-memory connection (connect_memory, add_views, view_sql,
# table_names) is the store's backend (backends.Backend: a directory, a bucket, memory): it lists
# its own tables and segments and says where DuckDB opens them (``tables_url``, ``segment_urls``),
# and declares the filesystem DuckDB must read them through (``duckdb_filesystem``, registered on
# the connection before the lockdown; None for a directory). The confinement is the same on every
# backend (allowed_directories = its tables/). The file catalog (catalog.duckdb) exists for a
# directory only: its functions take the directory's Path. The quoters above build DDL (views,
# settings), where DuckDB binds no parameters; queries bind theirs.
def _directory(root: Path) -> Backend:
    from capturestore.backends import LocalBackend

    return LocalBackend(root)


def table_names(root: Backend) -> list[str]:
    """Tables that have at least one segment (run tables always exist in a store)."""
    return root.table_names()


def glob_escape(path: str) -> str:
    """``path`` as a literal in a DuckDB glob: its glob characters as one-character classes."""
    return re.sub(r"([\[*?])", r"[\1]", path)


def _glob_escape_sql(expr: str) -> str:
    """SQL of ``expr`` (a path) with its glob characters escaped as glob_escape does."""
    return f"regexp_replace({expr}, '([\\[*?])', '[\\1]', 'g')"


@dataclass(frozen=True)
class SegmentFiles:
    """One listing of a table's segments with the reader rule of compaction (docs/compact.md)
    decided on it before any query reads a row: the merged segments, and the segments no merged
    segment of the same listing names (the footer of each merged segment says which sources it
    holds: no row is read to decide). ``listed``: every name the listing held; ``window``: a
    merged segment's footer could not be read, so the rule is left to the window over the rows."""
    listed: tuple[str, ...]
    merged: tuple[str, ...] = ()
    uncovered: tuple[str, ...] = ()
    window: bool = False

    @property
    def files(self) -> tuple[str, ...]:
        """What a query reads, in the order a glob would list them (a view's column order)."""
        return tuple(sorted(self.merged + self.uncovered))


# The commit markers are listed before the tables they commit: a marker in the listing then has
# its rows (written before it) in the later listing of their table.
_MARKERS_FIRST = ("runs", "comparisons")


def segment_files(root: Backend, footers: dict | None = None,
                  tables: list[str] | None = None) -> dict[str, SegmentFiles]:
    """{table: SegmentFiles} of every table with a segment, each table listed once, the marker
    tables first. ``footers``: {(table, merged segment): MergedSegment} kept between calls (a
    merged segment is written once and never replaced: its footer never changes). ``tables``:
    list only these (Store.sql: the tables a query's views are built from, view_tables); by
    default every table under ``tables/``."""
    from capturestore.compaction import is_merged, merged_segments

    tables = root.listdir(TABLES_DIR) if tables is None else list(dict.fromkeys(tables))
    order = [t for t in _MARKERS_FIRST if t in tables] + [t for t in tables if t not in _MARKERS_FIRST]
    out = {}
    for t in order:
        names = root.segment_names(t)
        if not names:
            continue
        ms, bad = merged_segments(root, t, names, footers)
        if bad:
            out[t] = SegmentFiles(tuple(names), window=True)
            continue
        covered = {s for m in ms for s in m.sources}
        out[t] = SegmentFiles(tuple(names), tuple(m.name for m in ms),
                              tuple(n for n in names if not is_merged(n) and n not in covered))
    return {t: out[t] for t in tables if t in out}


def listed_files_gone(root: Backend, files: dict[str, SegmentFiles]) -> list[str]:
    """The segments of ``files`` (``table/name``) no longer there: removed since they were listed."""
    return [f"{t}/{n}" for t, f in files.items() for n in sorted(set(f.listed) - set(root.segment_names(t)))]


def view_tables(table: str) -> tuple[str, ...]:
    """The tables whose listings the view of ``table`` is built from (view_sql): its own, and
    the marker table that commits its rows (``runs`` for prompts/captures, ``comparisons`` for a
    table a comparison writes; listed for any other table too, since whether it has a
    ``comparison_id`` column is known only from its segments)."""
    if table in ("runs", "comparisons"):
        return (table,)
    return (table, "runs") if table in RUN_TABLES else (table, "comparisons")


def view_key(files: dict[str, SegmentFiles], table: str) -> tuple:
    """What the view of ``table`` built from ``files`` depends on: the listings of view_tables."""
    return tuple(files.get(t) for t in view_tables(table))


# Table references of DuckDB's parse tree (json_serialize_sql) whose tables tables_named can
# name: a table by name, a join, a subquery, no FROM, VALUES. Any other (a table function such
# as query_table('runs') or duckdb_views(), DESCRIBE/SHOW, PIVOT) may read views by other means.
_NAMED_REFS = {"BASE_TABLE", "JOIN", "SUBQUERY", "EMPTY", "EXPRESSION_LIST"}


def tables_named(con: duckdb.DuckDBPyConnection, sql: str, tables: list[str]) -> set[str] | None:
    """The tables of ``tables`` (a store's) that ``sql`` reads, from DuckDB's own parse tree
    (``json_serialize_sql``; nothing is bound or run); None when the tree cannot tell: a
    statement DuckDB does not serialise (not a SELECT, a syntax error), a reference other than a
    table by name, join, subquery or VALUES (a table function, DESCRIBE, SHOW, PIVOT), a
    schema-qualified name (``information_schema.columns``), or a name that is neither one of
    ``tables`` nor a CTE of the query. Names match as DuckDB's identifiers do: case-insensitively.
    A CTE named like a store table counts as that table (read or not, its view is then current)."""
    import json

    import duckdb

    try:
        # fetchall, not fetchone: a result fetched in part stays open, and the next con.sql() is refused
        tree = json.loads(con.execute("SELECT json_serialize_sql($1::VARCHAR)", [sql]).fetchall()[0][0])
    except (duckdb.Error, IndexError, TypeError, ValueError):
        return None
    if not isinstance(tree, dict) or tree.get("error") is not False or not tree.get("statements"):
        return None
    refs: list[str] = []
    ctes: set[str] = set()
    unsure = False

    def walk(node) -> None:
        nonlocal unsure
        if isinstance(node, list):
            for v in node:
                walk(v)
            return
        if not isinstance(node, dict):
            return
        # a table reference (a query node has a sample but no alias; an expression has a class)
        if "sample" in node and "alias" in node and "class" not in node and isinstance(node.get("type"), str):
            kind = node["type"]
            if kind not in _NAMED_REFS:
                unsure = True
            elif kind == "BASE_TABLE":
                if node.get("schema_name") or node.get("catalog_name") or not isinstance(node.get("table_name"), str):
                    unsure = True
                else:
                    refs.append(node["table_name"])
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            ctes.update(str(e.get("key", "")).lower() for e in cte_map.get("map") or () if isinstance(e, dict))
        for v in node.values():
            walk(v)

    walk(tree["statements"])
    if unsure:
        return None
    by_name: dict[str, list[str]] = {}
    for t in tables:
        by_name.setdefault(t.lower(), []).append(t)
    out: set[str] = set()
    for r in refs:
        hit = by_name.get(r.lower())
        if hit:
            out.update(hit)
        elif r.lower() not in ctes:
            return None
    return out


# Every scan of segments: float columns may hold NaN. Parquet's min / max statistics leave NaN out
# (pyarrow writes [1, NaN, 3] as min 1, max 3), and without this DuckDB 2.0 takes them for the
# whole range: `WHERE isnan(x)` and `WHERE x > 5` (NaN sorts above every number in DuckDB) found no
# row of such a file and `max(x)` read 3.0; with it, DuckDB uses no min / max of a float column.
_NAN = ", can_have_nan = true"


def _listed_segments(root: Backend, table: str, files: SegmentFiles, filename: bool) -> str:
    """The rows of ``files``: the merged segments and the segments they do not cover, read as
    one explicit list with no window, so a filter on any column reaches the scan (row-group
    statistics skip what it excludes). The rule was decided on the listing (SegmentFiles)."""
    urls = ", ".join(_quote_str(glob_escape(f"{root.tables_url}{root.sep}{table}{root.sep}{n}")) for n in files.files)
    opts = f", filename = {_quote_str(SEGMENT_FILE_COLUMN)}" if filename else ""
    scan = f"read_parquet([{urls}], union_by_name = true{_NAN}{opts})"
    hidden = ([SOURCE_COLUMN] if files.merged else []) + ([SEGMENT_FILE_COLUMN] if filename else [])
    cols = f"COLUMNS(lambda c: c NOT IN ({', '.join(_quote_str(c) for c in hidden)}))" if hidden else "*"
    if filename:
        name = f"parse_filename({_quote_ident(SEGMENT_FILE_COLUMN)})"
        seg = f"coalesce({_quote_ident(SOURCE_COLUMN)}, {name})" if files.merged else name
        cols += f", {seg} AS {_quote_ident(SEGMENT_COLUMN)}"
    return f"(SELECT {cols} FROM {scan})"


def _segments(root: Backend, table: str, relative: bool, allow_empty: bool = False, filename: bool = False,
              files: dict[str, SegmentFiles] | None = None) -> str:
    """A subquery of the rows of every segment of ``table``: by absolute path, or relative to the
    catalog file. The store's own path is escaped: a '*', '?' or '[' in it is no glob (``st*ar``
    would otherwise also read a sibling store ``st-old-ar``).

    The reader rule of compaction (docs/compact.md): a row of a merged segment (its
    ``__capturestore_source`` names the segment it came from) is shown; a row of a plain segment
    is shown unless a merged segment of the same glob expansion names that segment. One scan
    decides both, so a merge or a source removal between two listings never counts a row twice
    nor hides it. The scan's file name column is ``__capturestore_file`` (a table may have its own
    ``filename`` column), never shown. ``filename``: a ``__capturestore_segment`` column naming the
    segment a writer wrote the row in (the source, for a merged row). The empty first branch
    declares the columns the rule reads: with ``allow_empty`` and no segment left, the scan has no
    file name column either.

    ``files`` (Store.sql; never catalog.duckdb, which other clients open): the listing of every
    table, read through _listed_segments instead of the glob and its window. A table absent from
    it has no segment: with ``allow_empty``, no rows."""
    if files is not None and not relative:
        listed = files.get(table)
        if listed is None and allow_empty:
            return f"(SELECT NULL::VARCHAR AS comparison_id WHERE false)"
        if listed is not None and not listed.window and listed.files:
            return _listed_segments(root, table, listed, filename)
    if relative:
        where = f"{_glob_escape_sql(f'({_STORE_DIR_SQL})')} || {_quote_str(f'{TABLES_DIR}/{table}/*.parquet')}"
    else:
        where = _quote_str(glob_escape(f"{root.tables_url}/{table}") + "/*.parquet")
    opts = ", allow_empty = true" if allow_empty else ""
    scan = f"read_parquet({where}, union_by_name = true{_NAN}, filename = {_quote_str(SEGMENT_FILE_COLUMN)}{opts})"
    src = _quote_ident(SOURCE_COLUMN)
    hidden = ", ".join(_quote_str(c) for c in (SOURCE_COLUMN, SEGMENT_FILE_COLUMN, "__cs_seg", "__cs_covered"))
    shown = f", __cs_seg AS {_quote_ident(SEGMENT_COLUMN)}" if filename else ""
    return (f"(SELECT COLUMNS(lambda c: c NOT IN ({hidden})){shown} FROM ("
            f"SELECT *, max(CASE WHEN {src} IS NOT NULL THEN {_quote_ident(SEGMENT_FILE_COLUMN)} END) "
            f"OVER (PARTITION BY __cs_seg) AS __cs_covered FROM ("
            f"SELECT *, coalesce({src}, parse_filename({_quote_ident(SEGMENT_FILE_COLUMN)})) AS __cs_seg FROM ("
            f"SELECT NULL::VARCHAR AS {src}, NULL::VARCHAR AS {_quote_ident(SEGMENT_FILE_COLUMN)} WHERE false "
            f"UNION ALL BY NAME SELECT * FROM {scan}))) "
            f"WHERE __cs_covered IS NULL OR {_quote_ident(SEGMENT_FILE_COLUMN)} = __cs_covered)")


def _declared() -> dict:
    """{table: TableSpec} of the tables whose columns are declared in code (comparators)."""
    from capturestore.comparators import declared_tables

    return declared_tables()


def catalog_stamp() -> str:
    """First line of catalog.stamp: the view version, a digest of the code that writes the views
    and every declared table's schema version, so a change to any rebuilds catalog.duckdb."""
    versions = " ".join(f"{t}/{spec.version}" for t, spec in sorted(_declared().items()))
    return f"{CATALOG_STAMP}; view code {_view_code_digest(_NAN)}; declared schemas {versions}"


@functools.lru_cache(maxsize=4)
def _view_code_digest(nan: str) -> str:
    """12 hex digits of SHA-256 of this module's source and the SQL pieces its views are made of
    (``nan``: ``_NAN``, passed so that a value set at run time is part of the key). A change to how
    views are written then rebuilds every store's catalog.duckdb at its next open, whether or not
    CATALOG_STAMP was bumped: 55dfc54 changed every scan without a bump, and stores kept views
    that hid NaN while ``verify`` reported every view altered (a review's repro). Any edit of this
    file rebuilds them once; a rebuild is what an open already does when the stamp differs."""
    import hashlib
    import inspect
    import sys

    try:
        source = inspect.getsource(sys.modules[__name__])
    except (OSError, TypeError):  # no source shipped: the constants alone
        source = ""
    pieces = [source, nan, _STORE_DIR_SQL, SEGMENT_FILE_COLUMN, SEGMENT_COLUMN, SOURCE_COLUMN]
    return hashlib.sha256("\x00".join(pieces).encode()).hexdigest()[:12]


def _columns_sql(root: Backend, table: str, relative: bool, spec, files=None) -> str:
    """The declared columns of ``table``, by name and type; a declared column an older segment
    lacks reads as NULL. Columns a segment holds beyond them are not shown (DuckDB's ``* EXCLUDE``
    serialises in no fixed order, so the view would not be reproducible for verify)."""
    typed = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS {_quote_ident(f.name)}" for f in spec.schema)
    cols = ", ".join(f"CAST({_quote_ident(f.name)} AS {_duck_type(f.type)}) AS {_quote_ident(f.name)}"
                     for f in spec.schema)
    src = _segments(root, table, relative, files=files)
    return f"SELECT {cols} FROM (SELECT {typed} WHERE false UNION ALL BY NAME SELECT * FROM {src})"


_DUCK_TYPES = {"string": "VARCHAR", "large_string": "VARCHAR", "bool": "BOOLEAN", "double": "DOUBLE",
               "float": "FLOAT", "int64": "BIGINT", "int32": "INTEGER", "int16": "SMALLINT", "int8": "TINYINT",
               "uint64": "UBIGINT", "uint32": "UINTEGER", "timestamp[us, tz=UTC]": "TIMESTAMP WITH TIME ZONE",
               "list<item: string>": "VARCHAR[]", "list<item: int64>": "BIGINT[]", "list<item: int32>": "INTEGER[]",
               "list<item: float>": "FLOAT[]"}


def _duck_type(t: pa.DataType) -> str:
    try:
        return _DUCK_TYPES[str(t)]
    except KeyError:
        raise ValueError(f"catalog: no DuckDB type for declared Arrow type {t}") from None


def view_sql(root: Backend, table: str, relative: bool = False, files: dict[str, SegmentFiles] | None = None) -> str:
    """CREATE VIEW statement of ``table``: its committed rows (see the module docstring).

    A table declared in code (``capturestore.comparators.declared_tables``) and written by
    comparisons (its segments have ``comparison_id``) is a view over its declared columns by name
    and type; any other table shows the columns of its segments.
    ``relative``: the catalog.duckdb form, whose paths follow the catalog file wherever it moves.
    """
    spec = _declared().get(table)
    has_cid = table not in RUN_TABLES and root.has_column(table, "comparison_id")
    if spec is not None and has_cid:
        body = _columns_sql(root, table, relative, spec, files)
    elif table in RUN_TABLES:  # every column of the table's schema, in its order, also one added after a
        # store's segments were written (captures.group_index, format 6: NULL in a store before it)
        typed = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS {_quote_ident(f.name)}" for f in SCHEMAS[table])
        body = (f"SELECT * FROM (SELECT {typed} WHERE false UNION ALL BY NAME "
                f"SELECT * FROM {_segments(root, table, relative, files=files)})")
    else:  # not declared, or rows a user appended under a declared name (no comparison_id): as stored
        body = f"SELECT * FROM {_segments(root, table, relative, files=files)}"
    view = f"CREATE OR REPLACE VIEW {_quote_ident(table)} AS {body}"
    if table in ("prompts", "captures"):  # the runs segment is the commit marker
        return f"{view} WHERE run_id IN (SELECT run_id FROM {_segments(root, 'runs', relative, files=files)})"
    if table != "comparisons" and has_cid:
        # the comparisons row is the commit marker; none yet (no segment, no column) hides every row
        committed = (f"SELECT NULL::VARCHAR AS comparison_id, NULL::VARCHAR[] AS manifest_tables, "
                     f"NULL::VARCHAR[] AS manifest_segments, NULL::BIGINT[] AS manifest_rows WHERE false "
                     f"UNION ALL BY NAME SELECT * FROM {_segments(root, 'comparisons', relative, allow_empty=True, files=files)}")
        rows = f"SELECT * FROM ({body}) WHERE comparison_id IN (SELECT comparison_id FROM ({committed}))"
        return (f"CREATE OR REPLACE VIEW {_quote_ident(table)} AS {rows} "
                f"UNION ALL BY NAME {_manifest_guard(root, table, relative, committed, body, files)}")
    return view


def _manifest_guard(root, table: str, relative: bool, committed: str, body: str, files=None) -> str:
    """A query of no rows that raises, naming the segment, when ``table``'s segments disagree with
    the manifest of a committed comparison (integrity.commit_comparison): a listed segment gone or
    holding other row counts, a segment no manifest lists holding rows of a manifested comparison
    (a copy counts every row twice). Every query reading the view reads it too, filtered by the
    same conditions, so a comparison's rows never read as if it had fewer. The error sits in the
    guard's filter and in every column but ``comparison_id`` (typed by a join with no row of the
    table: ``coalesce(COLUMNS(t.*), error)``), so neither a filter on any column nor a count can
    prune it the way a constant NULL column is folded away; CASE keeps it unevaluated while the
    counts agree, and a filter on another comparison's id passes it by. Comparisons without a
    manifest (older ones) are not checked."""
    # expected rows (w, one manifest entry: m) and rows present (h) per comparison and segment, summed
    # over a UNION ALL: a filter on comparison_id passes through it into the segments' scan, whose
    # row-group statistics then skip every other comparison's segments
    want = (f"SELECT comparison_id, seg, n AS w, 0 AS h, 1 AS m FROM (SELECT comparison_id, "
            f"unnest(manifest_tables) AS t, unnest(manifest_segments) AS seg, unnest(manifest_rows) AS n "
            f"FROM ({committed}) WHERE manifest_tables IS NOT NULL) WHERE t = {_quote_str(table)}")
    manifested = f"SELECT comparison_id FROM ({committed}) WHERE manifest_tables IS NOT NULL"
    have = (f"SELECT comparison_id, {_quote_ident(SEGMENT_COLUMN)} AS seg, 0 AS w, 1 AS h, 0 AS m "
            f"FROM {_segments(root, table, relative, filename=True, files=files)} WHERE comparison_id IN ({manifested})")
    counts = f"SELECT comparison_id, seg, sum(w) AS w, sum(h) AS h, sum(m) AS m FROM ({want} UNION ALL {have}) GROUP BY ALL"
    why = (f"'table {table}, comparison ' || comparison_id || ': segment ' || seg || CASE WHEN h = 0 THEN "
           f"' is missing (its manifest lists ' || w || ' rows)' WHEN m = 0 THEN ' holds ' || h || ' rows of it but "
           f"is in no manifest (a copied or foreign segment)' ELSE ' holds ' || h || ' rows where its manifest lists ' "
           f"|| w END || '; its evidence is incomplete (run capturestore verify)'")
    guard = f"SELECT comparison_id, w <> h AS bad, {why} AS why FROM ({counts})"
    return (f"SELECT g.comparison_id, coalesce(COLUMNS(t.* EXCLUDE (comparison_id)), "
            f"CASE WHEN g.bad THEN error(g.why) END) FROM ({guard}) g "
            f"LEFT JOIN (SELECT * FROM ({body}) LIMIT 0) t ON false "
            f"WHERE CASE WHEN g.bad THEN error(g.why) ELSE false END")


def create_views(con: duckdb.DuckDBPyConnection, root: Backend, relative: bool = False) -> dict[str, str]:
    """Create the view of every table on ``con`` (see add_views); returns {table: why} of those
    whose segments DuckDB cannot read."""
    return add_views(con, root, table_names(root), relative)


# SQL through Store.sql is read-only and confined to the store (docs/sql.md), by DuckDB's own
# means in two layers. The connection opens files only under tables/ (allowed_directories with
# enable_external_access off), loads no extension, and its configuration is locked. And only
# statements DuckDB's parser classifies as SELECT run: allowed_directories grants writing as
# well as reading (COPY ... TO a segment would replace it), and a read-only database does not
# stop COPY TO, EXPORT or EXPLAIN ANALYZE (all measured with duckdb 2.0.1).
_CONFINED_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "python_enable_replacements": False,  # a table name never resolves to a Python variable of the caller
}


def connect_memory(root: Backend) -> duckdb.DuckDBPyConnection:
    """A private in-memory connection, confined to ``root/tables`` and locked; no views yet (add_views)."""
    import duckdb  # lazily: a writer that never queries does not pay for it

    try:
        # DuckDB adds its temp_directory (default: '.tmp' in the working directory) to the allowed
        # directories: a private one keeps spilling possible and the working directory out of reach
        temp = Path(tempfile.gettempdir()) / f"capturestore-duckdb-{uuid.uuid4().hex}"
        con = duckdb.connect(":memory:", config={**_CONFINED_CONFIG, "temp_directory": str(temp)})
        # allowed_directories cannot be given to connect(); it must be set before access is switched off
        # the views' globs spell a '[' of the store's path as '[[]', and DuckDB checks the pattern as spelt
        if root.duckdb_filesystem is not None:  # before the lockdown; DuckDB reads s3:// URLs through it
            con.register_filesystem(root.duckdb_filesystem)
        tables = root.tables_url + root.sep
        allowed = dict.fromkeys((tables, glob_escape(tables)))
        con.execute(f"SET allowed_directories = [{', '.join(_quote_str(d) for d in allowed)}]")
        # footers are read once per connection and file version (DuckDB checks the file's modification
        # time), not at every bind: a view binds its tables' segments several times (the manifest guard)
        con.execute("SET parquet_metadata_cache = true")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as e:  # fail closed: no query runs unconfined
        from capturestore.errors import QueryError

        raise QueryError(f"duckdb {duckdb.__version__} cannot confine queries to the store ({_duckdb_message(e)}); "
                         f"upgrade duckdb (tested with 2.0.1)") from None
    return con


def _duckdb_message(e: BaseException) -> str:
    """DuckDB's message in one line: without the LINE/caret context of the statement."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"})


def _without_kind(msg: str) -> str:
    """``Invalid Input Error: No magic bytes ...`` -> ``No magic bytes ...``."""
    return re.sub(r"^[A-Z][A-Za-z ]{0,30} Error: ", "", msg, count=1)


def add_views(con: duckdb.DuckDBPyConnection, root: Backend, names: list[str], relative: bool = False,
              files: dict[str, SegmentFiles] | None = None) -> dict[str, str]:
    """Create (or replace) the views of ``names`` on ``con``; returns {table: why} of unreadable ones.

    A table whose segments DuckDB cannot read (a truncated Parquet file) gets a view with the
    columns of its readable segments that raises the reason, naming the file, when a query reads
    it: only the queries that touch that table fail, and none of them returns partial rows.
    """
    import duckdb

    broken = {}
    for t in names:
        try:
            con.execute(view_sql(root, t, relative, files))
        except duckdb.Error as e:
            broken[t] = why = f"table {t} is unreadable: {_without_kind(_duckdb_message(e))}"
            # every column is the error itself, and so is the filter: a query reading any column, or
            # counting rows, raises; none can be folded to "no rows" (a filter on a constant NULL
            # column was: `WHERE comparison_id = 'x'` then read as an empty comparison)
            raise_ = f"error(CASE WHEN range >= 0 THEN {_quote_str(why)} END)"
            con.execute(f"CREATE OR REPLACE VIEW {_quote_ident(t)} AS SELECT "
                        f"{_readable_columns(con, root, t, raise_)} FROM range(1) WHERE {raise_} IS NULL")
    return broken


def _readable_columns(con: duckdb.DuckDBPyConnection, root: Backend, table: str, value: str = "NULL") -> str:
    """``CAST(NULL AS type) AS "column", ...`` of ``table``'s view: the declared columns of a
    declared table written by comparisons (or with no readable segment left), else those of the
    segments that DuckDB can read."""
    import duckdb

    cols: dict[str, str] = {}
    for f in root.segment_urls(table):
        try:
            described = con.execute(f"DESCRIBE SELECT * FROM read_parquet({_quote_str(glob_escape(str(f)))})").fetchall()
        except duckdb.Error:
            continue
        for name, typ, *_ in described:
            if name != SOURCE_COLUMN:
                cols.setdefault(name, typ)
    spec = _declared().get(table)
    if spec is not None and table not in RUN_TABLES and (not cols or "comparison_id" in cols):
        return ", ".join(f"CAST({value} AS {_duck_type(f.type)}) AS {_quote_ident(f.name)}" for f in spec.schema)
    if not cols:
        return f"{value} AS unreadable"
    return ", ".join(f"CAST({value} AS {typ}) AS {_quote_ident(name)}" for name, typ in cols.items())


_STATEMENT_NAMES = {"LOAD": "INSTALL/LOAD", "SET": "SET/RESET/USE", "VARIABLE_SET": "SET VARIABLE",
                    "CALL": "CALL/CHECKPOINT", "CREATE_FUNC": "CREATE MACRO/FUNCTION",
                    "COPY_DATABASE": "COPY DATABASE", "MULTI": "PIVOT without an IN list (a multi-statement)"}


def run_query(con: duckdb.DuckDBPyConnection, sql: str, views: list[str] | None = None,
              broken: dict[str, str] | None = None, params: dict | list | None = None) -> pa.Table:
    """Run ``sql`` (one or more SELECT statements; the last one's result) on a connect_memory connection.

    Raises QueryError in one line: a statement that is not a query is refused before any of
    ``sql`` runs; a file outside the store is refused by DuckDB; any other DuckDB error is named.
    ``views``: the store's views, named in the message when a query names an unknown table;
    ``broken``: {table: why} from add_views, added to the message of a failing query naming it.
    ``params``: values bound by DuckDB (``$name`` with a dict, ``?`` with a list); one statement only.
    """
    import duckdb

    from capturestore.errors import QueryError

    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_duckdb_message(e)}") from None
    if not statements:
        raise QueryError("no SQL statement given")
    if params is not None and len(statements) != 1:
        raise QueryError(f"params bind one statement; {len(statements)} given")
    for st in statements:
        if st.type != duckdb.StatementType.SELECT:
            kind = _STATEMENT_NAMES.get(st.type.name, st.type.name)
            raise QueryError(f"refused: {kind} statement; {_READ_ONLY}")
    for st in statements:  # a SELECT can still write: `WITH x AS (COPY ... TO f) SELECT 1` runs the COPY
        with _query_errors(con, st.query, views, broken):
            writes = _writing_operators(con, st.query, params)
        if writes:
            raise QueryError(f"refused: {writes[0]} inside a query (a COPY in a WITH clause); {_READ_ONLY}")
    table = pa.table({})
    for st in statements:  # the parsed statements themselves: exactly what was checked runs
        with _query_errors(con, st.query, views, broken):
            rel = con.sql(st) if params is None else con.sql(st.query, params=params)
            if rel is not None:
                to_table = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table  # duckdb >= 1.4 / older
                table = to_table()
    return table


def own_rows(con: duckdb.DuckDBPyConnection, sql: str, views: list[str] | None = None,
             broken: dict[str, str] | None = None, params: dict | list | None = None) -> list[dict[str, Any]]:
    """The rows, as dicts, of one SELECT this package wrote itself (integrity.check_evidence): run
    without run_query's refusals and planned once. run_query's EXPLAIN and the relation of
    ``con.sql()`` (bound, then run) planned a guarded view's query twice more: 29 -> 24 ms of a
    count of one comparison through its guard, and 6 ms saved on each smaller query. Errors as
    run_query's. Still one SELECT only, by DuckDB's parser (~0.3 ms): the text is this package's,
    table names in it quoted, values bound; what EXPLAIN would find, a writing operator inside a
    SELECT (``WITH x AS (COPY ...)``), takes a statement this text never holds."""
    import duckdb

    from capturestore.errors import QueryError

    with _query_errors(con, sql, views, broken):
        kinds = [st.type for st in con.extract_statements(sql)]
    if kinds != [duckdb.StatementType.SELECT]:
        raise QueryError(f"refused: own_rows runs one SELECT, not {len(kinds)} statements of types "
                         f"{[k.name for k in kinds]}")
    with _query_errors(con, sql, views, broken):
        cur = con.execute(sql) if params is None else con.execute(sql, params)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]


_READ_ONLY = ("SQL on a capture store is read-only: only queries "
              "(SELECT, WITH, FROM, VALUES, DESCRIBE, SUMMARIZE, PIVOT ... IN) run (docs/sql.md)")
# Physical operators that write (DuckDB 2.0 names; every *COPY_TO_FILE form counts)
_WRITING_OPERATORS = {"INSERT", "BATCH_INSERT", "UPDATE", "DELETE", "MERGE_INTO", "CREATE_TABLE_AS",
                      "BATCH_CREATE_TABLE_AS", "EXPORT"}


def _writing_operators(con: duckdb.DuckDBPyConnection, query: str, params=None) -> list[str]:
    """The operators of ``query``'s physical plan that write, from DuckDB's own EXPLAIN (which
    plans without running anything)."""
    import json

    names: list[str] = []

    def walk(node: dict) -> None:
        names.append(str(node.get("name", "")))
        for child in node.get("children", []):
            walk(child)

    for row in con.execute(f"EXPLAIN (FORMAT json) {query}", params).fetchall():
        for node in json.loads(row[-1]):
            walk(node)
    return [n for n in names if n.endswith("COPY_TO_FILE") or n in _WRITING_OPERATORS]


@contextmanager
def _query_errors(con: duckdb.DuckDBPyConnection, query: str, views: list[str] | None,
                  broken: dict[str, str] | None):
    """DuckDB's errors of planning or running ``query``, raised as one-line QueryErrors."""
    import duckdb

    from capturestore.errors import QueryError

    try:
        yield
    except duckdb.PermissionException as e:
        allowed, temp = con.execute("SELECT current_setting('allowed_directories'), "
                                    "current_setting('temp_directory')").fetchall()[0]
        where = ", ".join(d.rstrip(os.sep) for d in allowed if d.rstrip(os.sep) != temp.rstrip(os.sep)) or "nothing"
        raise QueryError(f"refused: {_without_kind(_duckdb_message(e))}; SQL on a capture store reads only "
                         f"its own segments under {where} (docs/sql.md)") from None
    except duckdb.CatalogException as e:
        raise QueryError(_with_broken(_catalog_message(e, views), query, broken)) from None
    except duckdb.Error as e:
        raise QueryError(_with_broken(f"SQL error: {_duckdb_message(e)}", query, broken)) from None


def _with_broken(msg: str, query: str, broken: dict[str, str] | None) -> str:
    """``msg`` and why the tables the failed query names are unreadable: with no readable segment
    left, their view cannot carry the columns, so such a query fails binding rather than reading."""
    named = [why for t, why in (broken or {}).items() if why not in msg and re.search(rf"\b{re.escape(t)}\b", query)]
    return msg + "".join(f"; {why}" for why in named)


def _catalog_message(e: BaseException, views: list[str] | None) -> str:
    msg = _duckdb_message(e)
    # DuckDB suggests its own system tables (pg_enum, ...) for a mistyped view: keep only store views
    m = re.search(r' Did you mean "([^"]+)"\?', msg)
    if m and views is not None and m.group(1) not in views:
        msg = msg[: m.start()] + msg[m.end():]
    if views is not None and "Table with name" in msg and "does not exist" in msg:
        msg += f"; the store's views: {', '.join(views) if views else 'none'}"
    return f"SQL error: {msg}"


def _connect_as_catalog(root: Path, path: str, **config):
    """A DuckDB connection on ``path`` whose relative views bind as if it were root/catalog.duckdb."""
    import duckdb

    return duckdb.connect(path, config={"temp_directory": str(root / f"{CATALOG_FILE}.tmp"), **config})


@contextmanager
def _rebuild_lock(root: Path, wait: bool):
    """flock on tables/: one rebuild at a time, so the stamp always describes the file in place.
    Yields False (without waiting) when another process holds it and ``wait`` is false."""
    fd = os.open(root / TABLES_DIR, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _stamp_lines(names: list[str], broken: dict[str, str]) -> list[str]:
    # an unreadable table is stamped apart from its name: open retries until it reads again
    return [catalog_stamp(), *(f"{t} (unreadable)" if t in broken else t for t in names)]


def _rebuild_locked(root: Path) -> dict[str, str]:
    final = root / CATALOG_FILE
    tmp = root / f".{CATALOG_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    wal = Path(f"{tmp}.wal")
    try:
        tables = _directory(root)
        names = table_names(tables)
        con = _connect_as_catalog(root, str(tmp))
        try:
            broken = create_views(con, tables, relative=True)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        wal.unlink(missing_ok=True)  # a clean close checkpoints; a leftover WAL would be lost by the rename
        os.replace(tmp, final)
        # the WAL of the file just replaced (a client held it open for writing) belongs to the old
        # file: DuckDB would refuse to open the new one beside it
        Path(f"{final}.wal").unlink(missing_ok=True)
    finally:  # nothing of a failed rebuild stays behind
        tmp.unlink(missing_ok=True)
        wal.unlink(missing_ok=True)
    stamp = root / CATALOG_STAMP_FILE
    stamp_tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    try:
        stamp_tmp.write_text("\n".join(_stamp_lines(names, broken)) + "\n")
        os.replace(stamp_tmp, stamp)
    finally:
        stamp_tmp.unlink(missing_ok=True)
    (root / LEGACY_CATALOG_ROOT_FILE).unlink(missing_ok=True)
    return broken


def rebuild_catalog_file(root: Path) -> tuple[Path, dict[str, str]]:
    """Write catalog.duckdb afresh (views only) and rename it into place; returns its path and
    {table: why} of tables whose view raises because their segments are unreadable."""
    with _rebuild_lock(root, wait=True):
        broken = _rebuild_locked(root)
    return root / CATALOG_FILE, broken


def catalog_is_current(root: Path) -> bool:
    """True when catalog.duckdb exists and its stamp names this view version and these tables."""
    try:
        lines = (root / CATALOG_STAMP_FILE).read_text().splitlines()
    except OSError:
        return False
    return lines == [catalog_stamp(), *table_names(_directory(root))] and (root / CATALOG_FILE).is_file()


def ensure_catalog_file(root: Path) -> None:
    """Rebuild catalog.duckdb when its stamp is out of date; a rebuild under way elsewhere is left to finish."""
    if catalog_is_current(root):
        return
    with _rebuild_lock(root, wait=False) as mine:
        if mine and not catalog_is_current(root):
            _rebuild_locked(root)


def catalog_problems(root: Path) -> list[str]:
    """How catalog.duckdb differs from what rebuild_catalog_file would write now: missing or
    unreadable file, missing, extra or altered views, any other object. Empty when it matches."""
    import duckdb

    path = root / CATALOG_FILE
    fix = "run `capturestore rebuild-catalog`"
    if not path.is_file():
        return [f"{CATALOG_FILE} is missing ({fix})"]
    want_con = _connect_as_catalog(root, ":memory:")
    try:
        broken = create_views(want_con, _directory(root), relative=True)  # unreadable segments: verify reports those
        want = {v: sql for v, sql in want_con.execute(_VIEWS_SQL).fetchall()}
    finally:
        want_con.close()
    # a copy is read: a DuckDB client holding the file open for writing (`duckdb <store>/catalog.duckdb`
    # does) locks out even read-only connections, and the copy includes its not yet checkpointed WAL
    with tempfile.TemporaryDirectory(prefix="capturestore-verify-") as tmp:
        copy = Path(tmp) / CATALOG_FILE
        shutil.copyfile(path, copy)
        if Path(f"{path}.wal").is_file():
            shutil.copyfile(f"{path}.wal", f"{copy}.wal")
        try:
            con = duckdb.connect(str(copy), read_only=True)
        except duckdb.Error as e:  # DuckDB names the copy; the user has the store's file
            return [f"{CATALOG_FILE} is not a readable DuckDB database "
                    f"({_duckdb_message(e).replace(str(copy), str(path))}; {fix})"]
        try:
            have = dict(con.execute(_VIEWS_SQL).fetchall())
            others = [f"{kind} {name}" for kind, name in con.execute(_OTHER_OBJECTS_SQL).fetchall()]
        except duckdb.Error as e:
            return [f"{CATALOG_FILE} cannot be read ({_duckdb_message(e).replace(str(copy), str(path))}; {fix})"]
        finally:
            con.close()
    out = [f"{CATALOG_FILE} lacks the view {v} ({fix})" for v in sorted(set(want) - set(have))]
    out += [f"{CATALOG_FILE} has a view {v} of no table in tables/ ({fix})" for v in sorted(set(have) - set(want))]
    out += [f"{CATALOG_FILE}: view {v} differs from what rebuild-catalog writes ({fix})"
            for v in sorted(set(want) & set(have)) if want[v] != have[v] and v not in broken]
    out += [f"{CATALOG_FILE} holds {o}, which rebuild-catalog does not write ({fix})" for o in others]
    return out


_VIEWS_SQL = ("SELECT view_name, sql FROM duckdb_views() "
              "WHERE NOT internal AND database_name = current_database()")
_OTHER_OBJECTS_SQL = """
    SELECT 'table', schema_name || '.' || table_name FROM duckdb_tables() WHERE database_name = current_database()
    UNION ALL SELECT 'macro', schema_name || '.' || function_name FROM duckdb_functions()
        WHERE NOT internal AND database_name = current_database()
    UNION ALL SELECT 'sequence', sequence_name FROM duckdb_sequences() WHERE database_name = current_database()
    UNION ALL SELECT 'index', index_name FROM duckdb_indexes() WHERE database_name = current_database()
    UNION ALL SELECT 'type', type_name FROM duckdb_types() WHERE NOT internal AND database_name = current_database()
    UNION ALL SELECT 'schema', schema_name FROM duckdb_schemas()
        WHERE NOT internal AND database_name = current_database() AND schema_name <> 'main'
    ORDER BY 1, 2
"""
