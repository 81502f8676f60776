"""The ``raw_errors`` comparator: the absolute KV errors cross-prompt BC needs, stored once.

Three-way only. For every generation position of every prompt (``position >= n_prompt_tokens``),
every KV layer and K / V, the absolute error vectors of the BF16 reference and of the target
against the FP32 baseline (``|expected - baseline|``, ``|actual - baseline|`` over heads x
head_dim, float32, exactly the values ``metrics.kv.compare_kv_caches(..., return_raw_errors=True)``
bins) are one row of the table ``raw_errors``. ``capturestore.aggregate.aggregate_bc`` reads them
for any SQL selection of prompts and returns the cross-prompt BC per generation token x layer
bit-identical to recomputing it from the KV arrays (the same float32 samples, the same binning),
without reading a KV array. A value NaN in a capture (a position outside a sliding window) is
stored as NaN inside the vector, as the BC excludes it.

Run it with ``compare_runs(..., comparators=["raw_errors"])`` (CLI ``compare --raw-errors``). When
the KV comparator ran on the same prompt it reuses that comparator's errors (no second pass over
the KV). Storage: 4 float32 vectors of ``kv_heads * head_dim`` per generation position and layer,
before compression as many bytes per generation position as the KV of the three runs together
(stored: 0.54x their KV with 16 prompt + 32 generated tokens, 0.09x with 128 + 16, measured by
benchmarks/bench_diff.py); written again by every comparison while reference runs are shared,
hence opt-in rather than a default of three-way compares (docs/diff.md).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from capturestore.comparators.base import Comparator, ComparisonContext, PromptCaptures, PromptResult, TableSpec

__all__ = ["RAW_ERRORS", "RAW_KEY", "RawErrorsComparator"]

_S, _I, _LF = pa.string(), pa.int64(), pa.list_(pa.float32())
RAW_ERRORS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("position", _I), ("gen_token_idx", _I), ("layer", _S),
    ("layer_idx", _I), ("base_k", _LF), ("tgt_k", _LF), ("base_v", _LF), ("tgt_v", _LF),
]), 1)
RAW_KEY = ("kv_raw_errors",)  # where the KV comparator leaves a prompt's KVRawErrors in its cache


def _lists(x: np.ndarray) -> pa.Array:
    """[n, w] float32 -> list<float32> of n rows (NaN kept inside the vectors)."""
    n, w = x.shape
    flat = pa.array(np.ascontiguousarray(x, dtype=np.float32).ravel(), type=pa.float32(), from_pandas=False)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * w + 1, w, dtype=np.int32)), flat)


class RawErrorsComparator(Comparator):
    """Stores the per-position absolute KV errors of the BF16 reference and the target (module
    docstring). Judges nothing (its verdict is None: it is evidence for aggregation, not a check)."""

    name = "raw_errors"
    judges = False  # evidence for aggregation: its None verdict does not hold a comparison back
    tables = {"raw_errors": RAW_ERRORS}
    needs = ("kv",)

    def prepare(self, context: ComparisonContext) -> None:
        super().prepare(context)
        if not context.three_way:
            raise ValueError("compare_runs: the raw_errors comparator needs a baseline run (errors are measured "
                             "against FP32): pass baseline_run (CLI: --baseline)")
        from capturestore.comparators.kv import kv_layer_names

        self.names = kv_layer_names(context.store, context.runs)

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """The prompt's rows (no partial: it judges nothing)."""
        from capturestore.comparators.kv import read_kv_layers
        from metrics.kv import compare_kv_caches

        pid, plen = prompt.prompt_id, prompt.prompt_len
        if not all((rid, pid) in self.names for rid in prompt.runs.values()):
            return PromptResult({})

        def compute():
            kvs = {role: prompt.cached(("kv", role), lambda r=role: read_kv_layers(
                prompt.context.store, prompt.runs[r], pid, self.names[(prompt.runs[r], pid)])) for role in prompt.runs}
            return compare_kv_caches(kvs["expected"], kvs["actual"], baseline_kv=kvs["baseline"],
                                     return_raw_errors=True)[1]

        raw = prompt.cached(RAW_KEY, compute)
        S, L = raw.base_k.shape[1], len(raw.layers)
        pos = np.arange(plen, S)
        if not len(pos):
            return PromptResult({})
        cols: dict = {f: [] for f in ("base_k", "tgt_k", "base_v", "tgt_v")}
        for li in range(L):
            wk, wv = int(raw.widths[li]), int(raw.v_widths[li])
            for f, w in (("base_k", wk), ("tgt_k", wk), ("base_v", wv), ("tgt_v", wv)):
                cols[f].append(_lists(getattr(raw, f)[0, plen:, li, :w]))
        n = len(pos) * L
        table = {
            "comparison_id": [prompt.comparison_id] * n, "prompt_id": [pid] * n,
            "position": np.tile(pos, L), "gen_token_idx": np.tile(pos - plen, L),
            "layer": pa.array(np.repeat(np.asarray(raw.layers, dtype=object), len(pos)), pa.string()),
            "layer_idx": np.repeat(np.arange(L), len(pos)),
        }
        table.update({f: pa.concat_arrays(parts) for f, parts in cols.items()})
        return PromptResult({"raw_errors": table})
