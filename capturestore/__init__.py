"""capturestore: a columnar store of teacher-forced captures from LLM inference engines.

Layout of a store (see ../shared/DESIGN.md): Zarr v3 arrays under ``arrays.zarr/``, append-only
Parquet segments under ``tables/``, and a rebuildable DuckDB catalog ``catalog.duckdb``.
"""
