"""The comparator protocol, the rules every comparison shares, and the comparisons table.

A comparator is one kind of evidence (logits, KV, module tensors, the FP8 KV floor). It
declares the tables it writes (``tables``: {name: ``TableSpec(schema, version)``}) and the
captures it reads (``needs``). It is a map/reduce: ``compare_runs`` hands it one prompt's
captures at a time (``map(prompt) -> PromptResult(rows, partial)``: that prompt's rows and a
partial state, ``self`` untouched, so a prompt can run anywhere: on a Dask worker), then gives
it every prompt's partial in prompt order (``reduce(partials) -> {table: rows}``: what it writes
once, keeping what its ``verdict()`` needs). A comparator written before map/reduce (overriding
``compare(prompt) -> {table: rows}`` and ``finish()``, keeping state in ``self``) still runs:
the defaults of ``map`` / ``reduce`` call those. The rules that combine verdicts are written here once:

- pass (``overall_passed``): at least one verdict judged, and every verdict passed; a verdict
  that judged nothing (``passed`` None) or failed is no pass;
- phase (``phase_at``): evidence computed at a position before the prompt's end is prefill,
  at or after it decode (a logit row ``j`` is computed at position ``prompt_len - 1 + j``, so
  only generation token 0 is prefill; a KV row at its own position);
- localisation (``localise``): the combined ``{"phase", "layer", "module", "token"}`` of a
  failed comparison, each key from the first failing verdict that has it, in the comparators'
  ``localisation_rank`` order (module tensors 0, logits 10, the FP8 floor 15, KV 20);
- errors: a comparator raising ``ValueError`` refuses the comparison (bad input, nothing stored);
  raising anything else, it is errored: its verdict judges nothing (no pass), its rows are
  dropped, its traceback goes into the row's ``errored`` column, the other comparators go on.

Comparators are the plugins of ``capturestore run`` (``capturestore.pipeline``): ``needs`` says
what the engine must give (``logits``, ``kv``, ``tensors``) and decides what is captured.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pyarrow as pa

__all__ = [
    "COMPARISONS_SCHEMA_VERSION",
    "Comparator",
    "ComparisonContext",
    "Localisation",
    "PromptCaptures",
    "PromptResult",
    "TableSpec",
    "Verdict",
    "comparisons_schema",
    "decoder_layer_index",
    "finite_or_null",
    "localise",
    "overall_passed",
    "phase_at",
    "to_arrow",
]

SCHEMA_METADATA_KEY = b"capturestore.schema"


class TableSpec(NamedTuple):
    """A table's declared Arrow schema and its version (bumped when a column changes meaning or
    is added; a view reads older segments' missing columns as NULL)."""

    schema: pa.Schema
    version: int


# ------------------------------------------------------------------------------------ rules


def phase_at(position, prompt_len):
    """"prefill" where evidence was computed before the prompt's end, else "decode" (scalar or
    array of positions; see the module docstring)."""
    if np.ndim(position):
        return np.where(np.asarray(position) < prompt_len, "prefill", "decode").astype(object)
    return "prefill" if position < prompt_len else "decode"


def overall_passed(verdicts) -> bool:
    """The pass rule: some verdict judged and every verdict passed (``None`` entries are the
    verdicts of comparators that did not run; a verdict whose ``passed`` is None judged nothing)."""
    ran = [v for v in verdicts if v is not None]
    return bool(ran) and all(v.passed is True for v in ran)


_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")


def decoder_layer_index(name: str | None) -> int | None:
    """The decoder-layer index of a layer or module name (``model.layers.3.self_attn.attn`` -> 3;
    a bare index ``"3"`` -> 3), None for names outside the decoder layers."""
    if name is None:
        return None
    if str(name).isdigit():
        return int(name)
    m = _LAYER_RE.search(str(name))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Localisation:
    """Where excess error first appears. ``layer``: decoder-layer index (None outside the decoder
    layers or unknown); ``module``: module name (None when only KV / logits say it); ``token``:
    the generation token index of the first failure (None when unknown)."""

    phase: str | None = None
    layer: int | None = None
    module: str | None = None
    token: int | None = None

    def as_dict(self) -> dict:
        return {"phase": self.phase, "layer": self.layer, "module": self.module, "token": self.token}


@dataclass(frozen=True)
class Verdict:
    """One comparator's verdict: ``passed`` True / False / None (judged nothing), a one-line
    ``summary()``, ``localisation`` evidence when it failed, and the comparator's own result
    object in ``detail`` (e.g. ``metrics.verdict.KVVerdict``)."""

    comparator: str
    passed: bool | None
    text: str
    localisation: Localisation | None = None
    detail: Any = None
    rank: int = 100  # the comparator's localisation_rank

    def summary(self) -> str:
        return self.text


def localise(verdicts) -> Localisation | None:
    """The combined localisation of a failed comparison (module docstring) from the evidence its
    verdicts carry (a comparator gives evidence where it saw failures, e.g. a failing logit token
    under a passing logit verdict), None when none says where."""
    evidence = sorted((v for v in verdicts if v is not None and v.localisation is not None), key=lambda v: v.rank)
    if not evidence:
        return None
    pick = {k: next((getattr(v.localisation, k) for v in evidence if getattr(v.localisation, k) is not None), None)
            for k in ("phase", "layer", "module", "token")}
    return Localisation(**pick)


# ---------------------------------------------------------------------------- the protocol


@dataclass
class ComparisonContext:
    """What every comparator of one comparison sees before the first prompt."""

    store: Any
    comparison_id: str
    runs: dict  # role -> run id ("baseline" only in three-way mode)
    prompt_ids: list
    label: str | None = None

    @property
    def three_way(self) -> bool:
        return "baseline" in self.runs


@dataclass
class PromptCaptures:
    """One prompt's captures of every role, read lazily and once (memory: one prompt's captures).

    ``tokens``: int32 [position], the same in every run (checked before comparators run);
    ``prompt_len``: positions ``< prompt_len`` are the prompt."""

    context: ComparisonContext
    prompt_id: str
    tokens: np.ndarray
    prompt_len: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def runs(self) -> dict:
        return self.context.runs

    @property
    def comparison_id(self) -> str:
        return self.context.comparison_id

    def cached(self, key, read):
        """``read()`` once per prompt under ``key`` (comparators share what they read)."""
        if key not in self._cache:
            self._cache[key] = read()
        return self._cache[key]

    def has(self, key) -> bool:
        """Whether something is cached under ``key``."""
        return key in self._cache

    def keep(self, key, value) -> None:
        """Cache ``value`` under ``key``, as ``cached`` would have read it (a batched read's parts)."""
        self._cache[key] = value

    def logits(self, role: str):
        """``[gen_token, vocab]`` of ``role``'s run."""
        rid = self.runs[role]
        return self.cached(("logits", role), lambda: self.context.store.read_logits(rid, self.prompt_id))


class PromptResult(NamedTuple):
    """What a comparator's ``map`` gives for one prompt: its rows (``{table: rows}``, written as
    they come) and its partial state (anything picklable, None for nothing; ``reduce`` gets every
    prompt's, in prompt order)."""

    rows: dict
    partial: Any = None


class Comparator:
    """Base class of comparators (see the module docstring). Subclasses set the class attributes
    and override ``map`` / ``reduce`` / ``verdict``; ``prepare`` may refuse the comparison
    (ValueError) before anything is computed or stored.

    ``comparison_fields``: the columns this comparator adds to the ``comparisons`` row, filled
    by ``comparison_columns(verdict, passed)``."""

    name: ClassVar[str] = ""
    tables: ClassVar[dict[str, TableSpec]] = {}
    needs: ClassVar[tuple[str, ...]] = ()  # capture kinds read: "logits", "kv", "tensors"
    comparison_fields: ClassVar[tuple[pa.Field, ...]] = ()
    localisation_rank: ClassVar[int] = 100  # lower decides a localisation key first

    def prepare(self, context: ComparisonContext) -> None:
        """Called once before the first prompt; the place to refuse bad input."""
        self.context = context

    def map(self, prompt: PromptCaptures) -> PromptResult:
        """One prompt's rows ({table: list of dicts | dict of columns}) and partial state, without
        changing ``self`` (it runs on a copy on a Dask worker). The default calls ``compare``."""
        return PromptResult(self.compare(prompt), None)

    def reduce(self, partials: list) -> dict[str, Any]:
        """Rows written once, after the last prompt (e.g. pooled per-layer numbers), from every
        prompt's partial in prompt order; keeps what ``verdict`` needs. The default calls ``finish``."""
        return self.finish()

    def compare(self, prompt: PromptCaptures) -> dict[str, Any]:
        """Before map/reduce: rows of one prompt, evidence kept in ``self`` (see ``map``)."""
        return {}

    def finish(self) -> dict[str, Any]:
        """Before map/reduce: rows written once, after the last prompt (see ``reduce``)."""
        return {}

    def verdict(self) -> Verdict | None:
        """The verdict after the last prompt; None when this comparator judged nothing (for a
        comparator asked for by ``compare_runs(comparators=...)`` that holds the comparison back
        unless the class declares ``judges = False``: evidence only, e.g. ``raw_errors``)."""
        return None

    def comparison_columns(self, verdict: Verdict | None, passed: bool) -> dict:
        """This comparator's cells of the ``comparisons`` row (``comparison_fields``); ``passed``:
        the comparison's overall pass."""
        return {}

    def table_spec(self, table: str) -> TableSpec:
        """The spec rows of ``table`` are written with (an instance may widen the class's)."""
        return self.tables[table]


# --------------------------------------------------------------------------- the comparisons table

COMPARISONS_SCHEMA_VERSION = 4  # 2: localisation, failure_layer, failure_module, failure_token; 3: errored,
#                                 comparator_runs; 4: judged, manifest_tables/_segments/_rows/_sha256

_TS = pa.timestamp("us", tz="UTC")
# Before the comparators' fields (the order of today's row).
COMPARISONS_HEAD = (
    pa.field("comparison_id", pa.string()),
    pa.field("label", pa.string()),
    pa.field("created_at", _TS),
    pa.field("baseline_run", pa.string()),
    pa.field("expected_run", pa.string()),
    pa.field("actual_run", pa.string()),
    pa.field("three_way", pa.bool_()),
    pa.field("n_prompts", pa.int64()),
    pa.field("models_differ", pa.bool_()),
    pa.field("passed", pa.bool_()),
)
COMPARISONS_TAIL = (
    pa.field("failure_phase", pa.string()),
    pa.field("first_failing_token", pa.string()),  # JSON: the first failing logit token
    pa.field("localisation", pa.string()),  # JSON {"phase", "layer", "module", "token"}
    pa.field("failure_layer", pa.int64()),
    pa.field("failure_module", pa.string()),
    pa.field("failure_token", pa.int64()),
    pa.field("errored", pa.string()),  # JSON {comparator: traceback} of comparators that raised
    pa.field("comparator_runs", pa.string()),  # JSON {comparator: {role: run_id}} read instead of the row's runs
    pa.field("judged", pa.list_(pa.string())),  # comparators whose verdict judged (passed or failed), e.g. logits, kv
    # the segments the comparison wrote, one entry per segment (integrity.commit_comparison fills them)
    pa.field("manifest_tables", pa.list_(pa.string())),
    pa.field("manifest_segments", pa.list_(pa.string())),
    pa.field("manifest_rows", pa.list_(pa.int64())),
    pa.field("manifest_sha256", pa.list_(pa.string())),
)


def comparisons_schema(comparators) -> pa.Schema:
    """The ``comparisons`` table: head, every comparator's fields (in the order given), tail."""
    fields = list(COMPARISONS_HEAD)
    for c in comparators:
        fields += [f for f in c.comparison_fields if f.name not in {x.name for x in fields}]
    fields += COMPARISONS_TAIL
    return pa.schema(fields)


# ------------------------------------------------------------------------------- rows -> Arrow


def finite_or_null(x) -> float | None:
    """Float for a table cell: NaN/inf become NULL so SQL aggregates skip them."""
    x = float(x)
    return x if math.isfinite(x) else None


def to_arrow(parts: list, spec: TableSpec, table: str) -> pa.Table:
    """One Arrow table of ``table`` from parts (each a list of row dicts or a dict of column
    arrays), typed by ``spec``: declared columns cast to their type (missing ones NULL), extra
    columns kept after them with their inferred type; NaN in float arrays becomes NULL."""
    tables = []
    for part in parts:
        if isinstance(part, dict):
            tables.append(pa.table({k: pa.array(v, from_pandas=True) for k, v in part.items()}))
        elif part:
            tables.append(pa.Table.from_pylist(part))
    t = pa.concat_tables(tables, promote_options="default") if tables else spec.schema.empty_table()
    n = t.num_rows
    fields = list(spec.schema) + [pa.field(k, t.schema.field(k).type) for k in t.column_names
                                  if k not in spec.schema.names]  # e.g. top-k errors of a custom tol_map
    arrays = [t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(n, f.type) for f in fields]
    meta = {SCHEMA_METADATA_KEY: f"{table}/{spec.version}".encode()}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))
