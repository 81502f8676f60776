"""Cross-prompt KV BC over any SQL selection of a comparison's prompts, from stored raw errors.

``aggregate_bc(store, comparison, prompts_sql)`` answers "how does the target's KV error compare
with BF16 noise over *these* prompts" (one task, prompts longer than 512 tokens, ...): the BC per
generation token x layer over the absolute errors of the selected prompts pooled, exactly what
``metrics.kv.aggregate_kv_bc_arrays`` returns from the KV arrays of those prompts (the same
float32 samples, binned the same way: identical, not approximately equal), without reading a KV
array. It reads the ``raw_errors`` table that the ``raw_errors`` comparator writes once per
comparison (``compare_runs(..., comparators=["raw_errors"])``, CLI ``compare --raw-errors``).

The selection is SQL that runs through ``Store.sql`` (read-only, confined to the store:
docs/sql.md) and returns a ``prompt_id`` column; only the prompt ids it returns reach the query of
the raw errors, as string literals. ``where_prompts(store, comparison, where)`` makes one from a
condition on the ``prompts`` view of the comparison's expected run (the CLI's ``--where``).

Generation token g is position ``n_prompt_tokens + g`` of each prompt; only the generation
indices every selected prompt has are aggregated (as ``aggregate_kv_bc_arrays`` does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["AggregateBC", "aggregate", "aggregate_bc", "comparison_row", "raw_errors_storage", "where_prompts"]


@dataclass(frozen=True)
class AggregateBC:
    """``k_bc, v_bc: [gen_token, layer]`` float64 (NaN where no error of any selected prompt is
    finite), over the errors of ``prompt_ids`` pooled; ``layers`` in the KV comparator's order."""

    comparison_id: str
    prompt_ids: tuple
    layers: tuple
    k_bc: np.ndarray
    v_bc: np.ndarray

    def to_table(self) -> pa.Table:
        """One row per generation token x layer: ``gen_token_idx, layer, k_bc, v_bc, n_prompts``."""
        G, L = self.k_bc.shape
        g, li = np.meshgrid(np.arange(G), np.arange(L), indexing="ij")
        return pa.table({
            "gen_token_idx": pa.array(g.ravel(), pa.int64()),
            "layer": pa.array([self.layers[i] for i in li.ravel()], pa.string()),
            "k_bc": pa.array(self.k_bc.ravel(), pa.float64(), from_pandas=True),
            "v_bc": pa.array(self.v_bc.ravel(), pa.float64(), from_pandas=True),
            "n_prompts": pa.array(np.full(G * L, len(self.prompt_ids)), pa.int64()),
        })


def _literal(s: str) -> str:
    """``s`` as a SQL string literal, for SQL text handed out (``where_prompts``); queries run
    here bind their values instead (``Store.sql(..., params=...)``)."""
    return "'" + str(s).replace("'", "''") + "'"


def in_params(name: str, values) -> tuple[str, dict[str, str]]:
    """(``$name0, $name1, ...``, {name0: value, ...}): an IN list whose values DuckDB binds (as
    constants: a filter on them is pushed down to the Parquet row groups as a literal list is)."""
    params = {f"{name}{i}": str(v) for i, v in enumerate(values)}
    return ", ".join(f"${k}" for k in params), params


def comparison_row(store, comparison: str, command: str = "aggregate") -> dict:
    """The committed ``comparisons`` row of ``comparison``, else ValueError in one line."""
    if not isinstance(comparison, str) or not comparison:
        raise ValueError(f"{command}: give a comparison id")
    rows = store.sql("SELECT * FROM comparisons WHERE comparison_id = $c", params={"c": comparison}).to_pylist() \
        if "comparisons" in _views(store) else []
    if not rows:
        raise ValueError(f"{command}: no committed comparison {comparison!r} in {store.root} "
                         f"(capturestore sql \"SELECT comparison_id, label FROM comparisons\")")
    return rows[0]


def _views(store) -> set:
    return set(store.sql("SELECT table_name FROM information_schema.tables").column("table_name").to_pylist())


def where_prompts(store, comparison: str, where: str) -> str:
    """A ``prompts_sql`` selecting the prompts of ``comparison``'s expected run that satisfy the
    condition ``where`` (SQL over the ``prompts`` view's columns: ``n_tokens > 512``,
    ``text LIKE '%math%'``, ``prompt_id IN (SELECT ...)``). It runs through ``Store.sql``."""
    row = comparison_row(store, comparison)
    if not where or not where.strip():
        raise ValueError("aggregate: --where is empty; give a condition on the prompts view (e.g. \"n_tokens > 512\")")
    return (f"SELECT prompt_id FROM prompts WHERE run_id = {_literal(row['expected_run'])} AND (\n{where}\n)")


def selected_prompts(store, prompts_sql: str) -> list[str]:
    """The prompt ids ``prompts_sql`` returns (a ``prompt_id`` column, or a single column)."""
    t = store.sql(prompts_sql)
    if "prompt_id" in t.column_names:
        col = t.column("prompt_id")
    elif t.num_columns == 1:
        col = t.column(0)
    else:
        raise ValueError(f"aggregate: the selection returns columns {t.column_names}; it must return prompt_id")
    return list(dict.fromkeys(str(p) for p in col.to_pylist() if p is not None))


def _flat(col: pa.ChunkedArray, n: int, width_hint=None) -> np.ndarray:
    """list<float32> column of equal-length rows -> float32 [n, width]."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(arr, pa.ChunkedArray):  # combine_chunks of a list column can give a chunked array back
        arr = arr.chunk(0) if arr.num_chunks == 1 else pa.concat_arrays(arr.chunks)
    if n == 0:
        return np.zeros((0, 0), np.float32)
    offsets = arr.offsets.to_numpy()
    widths = np.diff(offsets)
    if widths.min() != widths.max():
        raise ValueError(f"aggregate: raw_errors rows of one layer differ in width ({widths.min()} vs {widths.max()})")
    vals = arr.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]  # NaN stays NaN (no nulls written)
    return np.asarray(vals, dtype=np.float32).reshape(n, int(widths[0]))


BATCH_BYTES = 256 << 20  # raw errors read per query (a batch of layers): bounds memory


def iter_raw_errors(store, comparison: str, pids, n_layers: int, order: str = "gen", n_gen: int | None = None):
    """Yield ``(layer_idx, {"n", "prompt": int [n], "gen": int [n], "base_k", "tgt_k", "base_v",
    "tgt_v": float32 [n, width]})`` per layer of ``comparison``'s raw errors of ``pids`` (prompt
    index = position in ``pids``), rows ordered by (gen, prompt) (``order="gen"``) or (prompt, gen)
    (``"prompt"``). Several layers are read per query, about ``BATCH_BYTES`` at a time."""
    import pyarrow.compute as pc

    ids, params = in_params("p", pids)
    params["c"] = comparison
    where = f"comparison_id = $c AND prompt_id IN ({ids})" + (
        f" AND gen_token_idx < {int(n_gen)}" if n_gen is not None else "")
    probe = store.sql(f"SELECT len(base_k) + len(base_v) AS w, count(*) OVER () AS n FROM raw_errors WHERE {where} "
                      f"AND layer_idx = 0 LIMIT 1", params=params).to_pylist()
    if not probe:
        return
    per_layer = 2 * 4 * int(probe[0]["w"]) * int(probe[0]["n"])  # bytes of one layer's four vectors
    step = max(1, BATCH_BYTES // max(1, per_layer))
    value_set = pa.array(list(pids), pa.string())
    for l0 in range(0, n_layers, step):
        t = store.sql(f"SELECT layer_idx, prompt_id, gen_token_idx, base_k, tgt_k, base_v, tgt_v FROM raw_errors "
                      f"WHERE {where} AND layer_idx >= {l0} AND layer_idx < {l0 + step}", params=params)
        layer = t.column("layer_idx").to_numpy()
        prompt = pc.index_in(t.column("prompt_id"), value_set=value_set).to_numpy(zero_copy_only=False)
        gen = t.column("gen_token_idx").to_numpy()
        keys = (prompt, gen, layer) if order == "gen" else (gen, prompt, layer)
        idx = np.lexsort(keys)
        t = t.take(pa.array(idx))
        layer, prompt, gen = layer[idx], prompt[idx], gen[idx]
        bounds = np.flatnonzero(np.diff(layer)) + 1
        for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(layer)]):
            if a == b:
                continue
            part = t.slice(a, b - a)
            yield int(layer[a]), {"n": b - a, "prompt": prompt[a:b], "gen": gen[a:b],
                                  **{f: _flat(part.column(f), b - a) for f in ("base_k", "tgt_k", "base_v", "tgt_v")}}


def aggregate_bc(store, comparison: str, prompts_sql: str) -> AggregateBC:
    """Cross-prompt K/V BC per generation token x layer over the prompts ``prompts_sql`` selects
    (module docstring). ValueError (one line) when the comparison is unknown, stored no raw errors,
    or the selection matches none of its prompts."""
    from metrics.bc import bhattacharyya_batched

    row = comparison_row(store, comparison)
    store.check_evidence([comparison], "aggregate")
    wanted = selected_prompts(store, prompts_sql)
    if "raw_errors" not in _views(store) or not store.sql(
            "SELECT 1 FROM raw_errors WHERE comparison_id = $c LIMIT 1", params={"c": comparison}).num_rows:
        raise ValueError(f"aggregate: comparison {comparison} stored no raw errors (a three-way comparison run with "
                         f"comparators=['raw_errors'], CLI: capturestore compare ... --baseline RUN --raw-errors)")
    if not wanted:
        raise ValueError(f"aggregate: the selection matches no prompt (of {row['n_prompts']} in comparison "
                         f"{comparison})")
    ids, params = in_params("p", wanted)
    have = store.sql(f"SELECT prompt_id, min(layer_idx) AS l0, count(DISTINCT layer_idx) AS n_layers, "
                     f"max(gen_token_idx) + 1 AS n_gen FROM raw_errors WHERE comparison_id = $c "
                     f"AND prompt_id IN ({ids}) GROUP BY prompt_id", params={**params, "c": comparison}).to_pylist()
    if not have:
        raise ValueError(f"aggregate: the selection ({len(wanted)} prompt id(s), first {wanted[0]}) matches no prompt "
                         f"of comparison {comparison} ({row['n_prompts']} prompts)")
    pids = tuple(p for p in wanted if p in {h["prompt_id"] for h in have})
    n_gen = min(int(h["n_gen"]) for h in have)
    layers_t = store.sql("SELECT DISTINCT layer_idx, layer FROM raw_errors WHERE comparison_id = $c "
                         "ORDER BY layer_idx", params={"c": comparison}).to_pylist()
    layers = tuple(r["layer"] for r in layers_t)
    if [r["layer_idx"] for r in layers_t] != list(range(len(layers))):
        raise ValueError(f"aggregate: comparison {comparison}: raw_errors layer indices are not 0..{len(layers) - 1}")
    k_bc = np.full((n_gen, len(layers)), np.nan)
    v_bc = np.full((n_gen, len(layers)), np.nan)
    for li, rows in iter_raw_errors(store, comparison, pids, len(layers), order="gen", n_gen=n_gen):
        if rows["n"] != n_gen * len(pids):
            raise ValueError(f"aggregate: comparison {comparison}, layer {layers[li]}: {rows['n']} raw_errors rows, "
                             f"expected {n_gen} generation tokens x {len(pids)} prompts")
        # rows are ordered [gen, prompt]: each gen index's pooled sample is one contiguous row
        base_k, tgt_k, base_v, tgt_v = (rows[f].reshape(n_gen, -1) for f in ("base_k", "tgt_k", "base_v", "tgt_v"))
        k_bc[:, li] = bhattacharyya_batched(base_k, tgt_k)
        v_bc[:, li] = bhattacharyya_batched(base_v, tgt_v)
        # no finite error pair at a generation index: no BC (NaN), as aggregate_kv_bc_arrays says
        k_bc[np.all(np.isnan(base_k) | np.isnan(tgt_k), axis=1), li] = np.nan
        v_bc[np.all(np.isnan(base_v) | np.isnan(tgt_v), axis=1), li] = np.nan
    return AggregateBC(comparison, pids, layers, k_bc, v_bc)


def aggregate(store, comparison: str, *, where: str | None = None, sql: str | None = None) -> AggregateBC:
    """``capturestore aggregate``: ``aggregate_bc`` over the prompts of ``comparison`` that satisfy
    the condition ``where`` (``where_prompts``) or that the query ``sql`` returns, exactly one of
    the two; ``store`` is a ``Store`` or its path / URL (only read)."""
    from capturestore.store import as_store

    if (where is None) == (sql is None):
        raise ValueError("give exactly one of --where CONDITION and --sql QUERY")
    store = as_store(store)
    return aggregate_bc(store, comparison, sql if sql is not None else where_prompts(store, comparison, where))


def raw_errors_storage(store, comparison: str) -> tuple[int | None, int]:
    """(bytes of the raw_errors segments of ``comparison``, stored bytes of the KV arrays of its
    runs): what storing raw errors costs next to the captures they derive from. Sizes are the
    backend's (a file's, an object's) on every backend."""
    from capturestore.layout import TABLES_DIR

    raw = 0
    sizes = store.backend.find(f"{TABLES_DIR}/raw_errors") if "raw_errors" in _views(store) else {}
    for rel, size in sorted(sizes.items()):
        name = rel.rsplit("/", 1)[-1]
        if name.startswith("_") or not name.endswith(".parquet"):
            continue
        raw += size if comparison in (store.segment_comparison_ids("raw_errors", name) or set()) else 0
    row = comparison_row(store, comparison)
    runs, params = in_params("r", [r for r in (row["baseline_run"], row["expected_run"], row["actual_run"]) if r])
    kv = store.sql(f"SELECT sum(stored_bytes) FROM captures WHERE kind IN ('kv_k', 'kv_v') AND run_id IN ({runs})",
                   params=params)
    return raw, int(kv.column(0)[0].as_py() or 0)
