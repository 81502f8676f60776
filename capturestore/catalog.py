"""The DuckDB catalog: one view per table directory under ``tables/``.

The catalog holds nothing but views over the Parquet segments, so it is always rebuildable
from ``tables/`` alone. Queries from this library run on a private in-memory DuckDB connection
with the same views (no file lock is ever held, so any number of processes can read and write
the store at once). ``catalog.duckdb`` is the same set of views in a file for people running
``duckdb <store>/catalog.duckdb``; it is rebuilt into a temporary file and renamed into place.
"""
from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import duckdb

from capturestore.layout import CATALOG_FILE, CATALOG_ROOT_FILE, TABLES_DIR
from capturestore.tables import table_dir


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def table_names(root: Path) -> list[str]:
    """Tables that have at least one segment (run tables always exist in a store)."""
    d = root / TABLES_DIR
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.iterdir()):
        if p.is_dir() and any(f.name.endswith(".parquet") for f in p.iterdir()):
            out.append(p.name)
    return out


def view_sql(root: Path, table: str) -> str:
    glob = str(table_dir(root, table) / "*.parquet")
    src = f"read_parquet({_quote_str(glob)}, union_by_name = true)"
    if table in ("prompts", "captures"):
        # Only rows of committed runs: the runs segment is the commit marker.
        runs_glob = str(table_dir(root, "runs") / "*.parquet")
        return (
            f"CREATE OR REPLACE VIEW {_quote_ident(table)} AS SELECT * FROM {src} "
            f"WHERE run_id IN (SELECT run_id FROM read_parquet({_quote_str(runs_glob)}, union_by_name = true))"
        )
    return f"CREATE OR REPLACE VIEW {_quote_ident(table)} AS SELECT * FROM {src}"


def create_views(con: duckdb.DuckDBPyConnection, root: Path) -> list[str]:
    names = table_names(root)
    for t in names:
        con.execute(view_sql(root, t))
    return names


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


def connect_memory(root: Path) -> duckdb.DuckDBPyConnection:
    """A private in-memory connection, confined to ``root/tables`` and locked; no views yet (add_views)."""
    import duckdb  # lazily: a writer that never queries does not pay for it

    try:
        con = duckdb.connect(":memory:", config=dict(_CONFINED_CONFIG))
        # allowed_directories cannot be given to connect(); it must be set before access is switched off
        con.execute(f"SET allowed_directories = [{_quote_str(str(root / TABLES_DIR) + os.sep)}]")
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


def add_views(con: duckdb.DuckDBPyConnection, root: Path, names: list[str]) -> dict[str, str]:
    """Create (or replace) the views of ``names`` on ``con``; returns {table: why} of unreadable ones.

    A table whose segments DuckDB cannot read (a truncated Parquet file) gets a view with the
    columns of its readable segments that raises the reason, naming the file, when a query reads
    it: only the queries that touch that table fail, and none of them returns partial rows.
    """
    import duckdb

    broken = {}
    for t in names:
        try:
            con.execute(view_sql(root, t))
        except duckdb.Error as e:
            broken[t] = why = f"table {t} is unreadable: {_without_kind(_duckdb_message(e))}"
            con.execute(f"CREATE OR REPLACE VIEW {_quote_ident(t)} AS SELECT {_readable_columns(con, root, t)} "
                        f"FROM range(1) WHERE error({_quote_str(why)}) IS NULL")
    return broken


def _readable_columns(con: duckdb.DuckDBPyConnection, root: Path, table: str) -> str:
    """``CAST(NULL AS type) AS "column", ...`` of the segments of ``table`` that DuckDB can read."""
    import duckdb

    cols: dict[str, str] = {}
    for f in sorted(table_dir(root, table).glob("*.parquet")):
        try:
            described = con.execute(f"DESCRIBE SELECT * FROM read_parquet({_quote_str(str(f))})").fetchall()
        except duckdb.Error:
            continue
        for name, typ, *_ in described:
            cols.setdefault(name, typ)
    if not cols:
        return "NULL AS unreadable"
    return ", ".join(f"CAST(NULL AS {typ}) AS {_quote_ident(name)}" for name, typ in cols.items())


_STATEMENT_NAMES = {"LOAD": "INSTALL/LOAD", "SET": "SET/RESET/USE", "VARIABLE_SET": "SET VARIABLE",
                    "CALL": "CALL/CHECKPOINT", "CREATE_FUNC": "CREATE MACRO/FUNCTION",
                    "COPY_DATABASE": "COPY DATABASE", "MULTI": "PIVOT without an IN list (a multi-statement)"}


def run_query(con: duckdb.DuckDBPyConnection, sql: str, views: list[str] | None = None,
              broken: dict[str, str] | None = None) -> pa.Table:
    """Run ``sql`` (one or more SELECT statements; the last one's result) on a connect_memory connection.

    Raises QueryError in one line: a statement that is not a query is refused before any of
    ``sql`` runs; a file outside the store is refused by DuckDB; any other DuckDB error is named.
    ``views``: the store's views, named in the message when a query names an unknown table;
    ``broken``: {table: why} from add_views, added to the message of a failing query naming it.
    """
    import duckdb

    from capturestore.errors import QueryError

    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {_duckdb_message(e)}") from None
    if not statements:
        raise QueryError("no SQL statement given")
    for st in statements:
        if st.type != duckdb.StatementType.SELECT:
            kind = _STATEMENT_NAMES.get(st.type.name, st.type.name)
            raise QueryError(
                f"refused: {kind} statement; SQL on a capture store is read-only: only queries "
                f"(SELECT, WITH, FROM, VALUES, DESCRIBE, SUMMARIZE, PIVOT ... IN) run (docs/sql.md)"
            )
    table = pa.table({})
    for st in statements:  # the parsed statements themselves: exactly what was checked runs
        try:
            rel = con.sql(st)
            if rel is not None:
                to_table = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table  # duckdb >= 1.4 / older
                table = to_table()
        except duckdb.PermissionException as e:
            allowed = con.execute("SELECT current_setting('allowed_directories')").fetchall()[0][0]
            where = ", ".join(str(d).rstrip(os.sep) for d in allowed) if allowed else "nothing"
            raise QueryError(f"refused: {_without_kind(_duckdb_message(e))}; SQL on a capture store reads only "
                             f"its own segments under {where} (docs/sql.md)") from None
        except duckdb.CatalogException as e:
            raise QueryError(_with_broken(_catalog_message(e, views), st.query, broken)) from None
        except duckdb.Error as e:
            raise QueryError(_with_broken(f"SQL error: {_duckdb_message(e)}", st.query, broken)) from None
    return table


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


def rebuild_catalog_file(root: Path) -> Path:
    """Write catalog.duckdb afresh (views only) and rename it into place."""
    import duckdb

    final = root / CATALOG_FILE
    tmp = root / f".{CATALOG_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    con = duckdb.connect(str(tmp))
    try:
        create_views(con, root)
        con.execute("CHECKPOINT")
    finally:
        con.close()
    wal = Path(str(tmp) + ".wal")
    if wal.exists():  # a clean close checkpoints; a leftover WAL would be lost by the rename
        wal.unlink()
    os.replace(tmp, final)
    (root / CATALOG_ROOT_FILE).write_text(str(root) + "\n" + "\n".join(table_names(root)) + "\n")
    return final


def catalog_is_current(root: Path) -> bool:
    """True when catalog.duckdb exists and was built for this path and this set of tables."""
    try:
        lines = (root / CATALOG_ROOT_FILE).read_text().splitlines()
    except FileNotFoundError:
        return False
    return (root / CATALOG_FILE).exists() and lines[:1] == [str(root)] and lines[1:] == table_names(root)


def ensure_catalog_file(root: Path) -> None:
    if not catalog_is_current(root):
        rebuild_catalog_file(root)

