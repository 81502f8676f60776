"""capturestore: a columnar store of teacher-forced captures from LLM inference engines.

Layout of a store (see ../shared/DESIGN.md): Zarr v3 arrays under ``arrays.zarr/``, append-only
Parquet segments under ``tables/``, and a rebuildable DuckDB catalog ``catalog.duckdb``.
"""

from capturestore.errors import CorruptChunkError, FormatVersionError, StoreError
from capturestore.integrity import Problem, VerifyReport
from capturestore.layout import FORMAT_VERSION
from capturestore.store import Store
from capturestore.writer import RunWriter, prompt_id

__all__ = [
    "Store",
    "RunWriter",
    "StoreError",
    "FormatVersionError",
    "CorruptChunkError",
    "Problem",
    "VerifyReport",
    "FORMAT_VERSION",
    "prompt_id",
]
