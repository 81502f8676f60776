"""The DuckDB catalog: one view per table directory under ``tables/``.

The catalog holds nothing but views over the Parquet segments, so it is always rebuildable
from ``tables/`` alone. Queries from this library run on a private in-memory DuckDB connection
with the same views (no file lock is ever held, so any number of processes can read and write
the store at once). ``catalog.duckdb`` is the same set of views in a file for people running
``duckdb <store>/catalog.duckdb``; it is rebuilt into a temporary file and renamed into place.
"""
from __future__ import annotations

import os
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


def connect_memory(root: Path) -> duckdb.DuckDBPyConnection:
    import duckdb  # lazily: a writer that never queries does not pay for it

    con = duckdb.connect(":memory:")
    create_views(con, root)
    return con


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    rel = con.sql(sql)
    if rel is None:  # a statement without a result (SET, CREATE ...)
        return pa.table({})
    to_table = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table  # duckdb >= 1.4 / older
    return to_table()


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

