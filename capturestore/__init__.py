"""capturestore: a columnar store of teacher-forced captures from LLM inference engines.

    from capturestore import Store
    store = Store.open("my-store")                       # creates it; records the format version
    with store.begin_run(engine="hf", model_path=path, dtype="bfloat16") as run:
        pid = run.add_prompt(prompt_ids, continuation=teacher_ids)
        run.write_logits(pid, logits)                    # [gen_token, vocab]
        run.write_kv(pid, k, v, layer_names=names)       # [layer, kv_head, position, head_dim]
    k, v = store.read_kv(run.run_id, pid, as_torch=True)  # same dtype, bit for bit
    store.sql("SELECT * FROM captures WHERE dtype = 'bfloat16'")

Layout (see ../shared/DESIGN.md)::

    <store>/capturestore.json                              {"format": "capturestore", "format_version": 6}  (a new
                                                           store; an older one stays 1 to 5: docs/reading.md)
    <store>/arrays.zarr/<run_id>/<prompt_id>/tokens         int32 [position]  (prompt + continuation)
    <store>/arrays.zarr/<run_id>/<prompt_id>/logits         [gen_token, vocab]
    <store>/arrays.zarr/<run_id>/<prompt_id>/kv_k, kv_v     [layer, kv_head, position, head_dim]  (kv_k_<group> ...)
    <store>/arrays.zarr/<run_id>/<prompt_id>/tensors/<module>/<phase>   [step, ...]
    <store>/arrays.zarr/<run_id>/<prompt_id>/tensor_groups/<phase>_<k>  [module, step, ...]  (format 6: a
                                                           module capture's tensors of one phase and shape)
    <store>/tables/<table>/<segment>.parquet                append-only segments
    <store>/pending/<run_id>.json                           lock file of a run being written
    <store>/catalog.duckdb                                  views only; ``duckdb <store>/catalog.duckdb``

Arrays are Zarr v3 (xarray/dask open them) with ``dimension_names``, chunks of one layer x a
token block (~4 MiB; a one-shot KV layer of up to 8 MiB is one chunk), blosc-lz4-bitshuffle +
crc32c per chunk, each chunk a file beside the array's zarr.json (``c.0.0.0.0``: Zarr v3's "."
chunk keys, format 4; stores of earlier formats keep "/" keys, ``c/0/0/0/0``, and read alike).
bf16 and fp8 are stored as
uint16/uint8 bits with the logical dtype in the ``logical_dtype`` attribute
(``Store.open_xarray(run_id, prompt_id)`` views them back as ml_dtypes). KV and tokens share
the ``position`` dim, the ``position`` column of the SQL metric tables (format 1 said ``seq`` /
``token``; such stores still read). docs/reading.md: reading a store without this library.

SQL views (the stable interface; ``Store.sql`` and ``capturestore sql``):

- ``runs``: run_id, status ('complete'), engine, engine_version, model_path, model_hash, dtype,
  device, tp_degree, release, config (JSON text), n_prompts, created_at, committed_at,
  hostname, pid, format_version. A run appears only once committed.
- ``prompts``: run_id, prompt_id (sha256 of the prompt's int64 token ids, first 16 hex),
  prompt_idx, n_tokens (prompt + continuation), n_prompt_tokens, text, token_ids.
- ``captures``: one row per array, and per module and phase of a tensor group: run_id, prompt_id,
  array_name, kind (tokens | logits | kv_k | kv_v | tensor), kv_group, module, phase, steps, shape,
  dimension_names, chunks, dtype (logical), storage_dtype, codec, nbytes (logical), stored_bytes
  (on disk), layer_names, path (the array holding it), group_index (its index in a tensor group).
- every table written with ``Store.append_table(name, rows)`` (metric tables), as a view of
  the same name over all its segments (columns unioned by name).

Guarantees: a run's rows become visible all at once when its ``runs`` segment is renamed into
place (after its arrays are written); a writer killed at any point leaves no visible rows, and
``gc`` removes what it wrote. Any number of processes may write one store at once.
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
