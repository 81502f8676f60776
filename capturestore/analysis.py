"""Comparisons: bind stored runs to roles, compute the metrics, store them as long tables.

A comparison binds runs to roles (``baseline`` optional, ``expected``, ``actual``; DESIGN.md
"Roles") and owns the metrics computed from them. Everything here reads captures through the
store, hands arrays to ``metrics`` (which never sees a path) and appends the results as Parquet
segments, so a report or a user's SQL reads the same numbers later without recomputing them.

The comparators (``capturestore.comparators``) compute the evidence and declare their tables'
schemas; this module checks the runs, runs the prompt loop and writes the ``comparisons`` row.
Tables written (one segment each per comparison; ``comparisons`` last, so a comparison row
never points at metrics that are not there):

- ``logit_token_metrics``: one row per prompt x generation token: status, top-k errors,
  divergence, and three-way L-inf/L2 of BF16 and target vs FP32 with their ratios and BC.
- ``kv_head_metrics``: one row per prompt x position x layer x KV head (columns as
  ``metrics.kv.HeadMetrics``), ``gen_token_idx = position - prompt_len`` (negative = prefill).
- ``kv_token_bc``: per prompt x position x layer BC of the target vs BF16 absolute errors.
- ``kv_gen_bc``: cross-prompt BC per generation index and layer (errors of all prompts pooled).
- ``kv_layer_verdicts``: the pooled per-layer KV verdict numbers (sigma-ratio, BC, noise BC...,
  ``*_nonfinite``: actual values non-finite where the references are finite).
- ``comparisons``: run ids by role, both verdicts, which check decided, summaries, and where a
  failure starts (``localisation``).
- tables of other comparators given to ``compare_runs`` (e.g. ``fp8_kv_layer_metrics``).
"""
from __future__ import annotations

import json
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

__all__ = ["CompareResult", "ComparisonResult", "compare", "compare_runs", "find_reference_run", "prompt_split"]

ROLES = ("baseline", "expected", "actual")


@dataclass(frozen=True)
class ComparisonResult:
    """What ``compare_runs`` computed and stored."""

    comparison_id: str
    runs: dict  # role -> run_id
    prompt_ids: tuple
    logit_verdict: Any  # metrics.verdict.LogitVerdict | None
    kv_verdict: Any  # metrics.verdict.KVVerdict | None
    kv_layers: tuple = ()  # per-layer dicts: layer, max k/v L-inf of target and BF16, pooled BC, pass
    first_failing_token: dict | None = None
    phase: str | None = None  # "prefill" | "decode" | None (nothing failed)
    models_differ: bool = False  # the runs' model_hash differ (compared because the user allowed it)
    verdicts: dict = field(default_factory=dict)  # comparator name -> comparators.Verdict | None
    # {"phase", "layer", "module", "token"} of a failed comparison (comparators.localise), else None
    localisation: dict | None = None
    errors: dict = field(default_factory=dict)  # comparator name -> traceback of a comparator that raised

    @property
    def passed(self) -> bool:
        """Every verdict that ran passed, and at least one ran (as the ``comparisons`` row says).
        A KV verdict that compared nothing (the actual run lacks the references' KV) never passes."""
        from capturestore.comparators import overall_passed

        if self.verdicts:
            return overall_passed(self.verdicts.values())
        return overall_passed([self.logit_verdict, self.kv_verdict])


@dataclass(frozen=True)
class CompareResult:
    """What ``compare`` did: the stored comparison and, when the raw errors were stored, their
    bytes and the stored bytes of the compared runs' KV (what storing them costs next to it)."""

    comparison: ComparisonResult
    raw_errors_bytes: int | None = None  # None: raw errors not stored
    kv_bytes: int = 0


def compare(store, expected: str, actual: str, baseline: str | None = None, *, label: str | None = None,
            kv: bool = True, allow_different_models: bool = False, raw_errors: bool = False,
            scheduler: str | None = None, progress=None) -> CompareResult:
    """``capturestore compare``: compare stored runs (``compare_runs``; three-way with
    ``baseline``) on the store ``store`` (a ``Store`` or its path / URL, refused before any work
    when it cannot be written). raw_errors: also store the KV raw errors (``comparators=["raw_errors"]``;
    ``capturestore.aggregate`` reads them) and measure their size. scheduler: the address of a Dask
    scheduler whose workers do the per-prompt work (docs/scale.md)."""
    from capturestore.store import as_store, require_writable

    store = as_store(store)
    require_writable(store, "compare")
    client = None
    if scheduler:
        from capturestore.distributed import connect

        client = connect(scheduler)
    try:
        result = compare_runs(store, expected_run=expected, actual_run=actual, baseline_run=baseline, label=label,
                              kv=kv, allow_different_models=allow_different_models,
                              comparators=["raw_errors"] if raw_errors else (), client=client, progress=progress)
    finally:
        if client is not None:
            client.close()
    if not raw_errors:
        return CompareResult(result)
    from capturestore.aggregate import raw_errors_storage

    raw, kv_bytes = raw_errors_storage(store, result.comparison_id)
    return CompareResult(result, raw, kv_bytes)


def _committed_runs(store) -> dict[str, dict]:
    return {r["run_id"]: r for r in store.runs().to_pylist() if r.get("status") == "complete"}


def prompt_split(store, run_id: str, prompt_id: str) -> tuple[np.ndarray, int]:
    """(tokens int32 [position], prompt_len) of one capture: the prompt is the first ``prompt_len``
    tokens, the rest are the teacher/generated tokens whose logits the run holds."""
    tokens = store.read_tokens(run_id, prompt_id)
    rows = [r for r in store.prompts(run_id).to_pylist() if r["prompt_id"] == prompt_id]  # the run's own segment
    if rows and rows[0].get("n_prompt_tokens") is not None:
        return tokens, int(rows[0]["n_prompt_tokens"])
    n_gen = int(store.read_logits(run_id, prompt_id).shape[0])
    return tokens, len(tokens) - n_gen


def find_reference_run(store, *, model_hash: str, dtype: str, prompt_ids, engine: str = "hf",
                       teacher_tokens: dict | None = None, config: dict | None = None,
                       device: str | None = None) -> str | None:
    """The newest complete ``engine`` run of ``model_hash`` in ``dtype`` holding every prompt in
    ``prompt_ids`` (and, when given, the same captured tokens per prompt, and a run config holding
    every key of ``config`` with the same value, e.g. ``{"capture": "greedy", "num_tokens": 8}``, a
    value None meaning the key absent or None; and,
    when given, captured on ``device``: ``cpu``, ``cuda:0``; a CUDA reference differs from a CPU one
    by rounding), or None. How a reference was computed (whole model or streamed layer by layer) is
    not a key: both give the same bits.

    References are captured once and reused by every comparison sharing model + prompts + dtype.
    """
    want = set(prompt_ids)
    runs = sorted(
        (r for r in _committed_runs(store).values()
         if r["engine"] == engine and r["model_hash"] == model_hash and r["dtype"] == dtype
         and (device is None or r.get("device") == device)),
        key=lambda r: r["committed_at"], reverse=True,
    )
    for r in runs:
        if config:
            held = json.loads(r.get("config") or "{}")
            if any(held.get(k) is not None if v is None else (k not in held or held[k] != v)
                   for k, v in config.items()):
                continue
        have = {p["prompt_id"] for p in store.prompts(r["run_id"]).to_pylist()}
        if not want <= have:
            continue
        if teacher_tokens and any(
            not np.array_equal(store.read_tokens(r["run_id"], pid), np.asarray(t, dtype=np.int32))
            for pid, t in teacher_tokens.items()
        ):
            continue
        return r["run_id"]
    return None


def _common_prompts(store, runs: dict) -> list[str]:
    """The actual run's prompts, in the expected run's order. References may hold more prompts
    (they are reused across comparisons); an actual prompt a reference lacks is refused, since it
    would go unjudged while the comparison passed on the others."""
    held = {role: {p["prompt_id"] for p in store.prompts(rid).to_pylist()} for role, rid in runs.items()}
    for role in runs:
        missing = sorted(held["actual"] - held[role])
        if missing:
            raise ValueError(f"compare_runs: {role} run {runs[role]} lacks {len(missing)} of the actual run's "
                             f"{len(held['actual'])} prompts (first: {missing[:3]}); capture them in that run, or "
                             f"compare an actual run of the shared prompts")
    if not held["actual"]:
        raise ValueError(f"compare_runs: actual run {runs['actual']} holds no prompt: nothing to compare")
    order = [p["prompt_id"] for p in store.prompts(runs["expected"]).to_pylist()]
    return [p for p in order if p in held["actual"]]


def _check_models(known: dict, runs: dict, allow: bool) -> bool:
    """Whether the runs' ``model_hash`` differ; ValueError if they do and ``allow`` is False.
    An unknown hash (None) differs from a known one: nothing says the model is the same."""
    hashes = {role: known[rid].get("model_hash") for role, rid in runs.items()}
    if len(set(hashes.values())) <= 1:
        return False
    if not allow:
        said = ", ".join(f"{role} run {runs[role]}: {h if h is not None else 'unknown'}" for role, h in hashes.items())
        raise ValueError(
            f"compare_runs: the runs are of different models (model_hash {said}); comparing them measures the "
            f"model difference, not the engine: pass allow_different_models=True (CLI: --allow-different-models) "
            f"if that is meant"
        )
    return True


def compare_runs(store, *, expected_run: str, actual_run: str, baseline_run: str | None = None,
                 label: str | None = None, logits: bool = True, kv: bool = True, tol_map=None,
                 kv_verdict_config=None, progress=None, allow_different_models: bool = False,
                 comparators=(), comparator_runs: dict | None = None, client=None) -> ComparisonResult:
    """Compare stored captures of ``actual_run`` against ``expected_run`` (and ``baseline_run``
    in three-way mode), store every metric, and return the verdicts.

    The evidence is computed by comparators (``capturestore.comparators``): ``logits`` (unless
    ``logits=False``; ``tol_map``), ``kv`` (unless ``kv=False``; ``kv_verdict_config``) and any
    given in ``comparators`` (instances, or names of registered comparators). This function
    checks the runs, feeds every comparator one prompt at a time (``map``: rows and a partial
    state; memory is bounded by one prompt's captures of the three runs), writes the rows as they
    come (``HeldRows``: at most ``ROWS_HELD_PROMPTS`` prompts' rows are held), hands every
    comparator its partials in prompt order (``reduce``), and commits the comparison with the
    ``comparisons`` row last (``integrity.PendingComparison``: nothing is visible before it).

    All runs must hold the same captured tokens for each shared prompt (teacher forcing), else
    ``ValueError`` names the prompt and the first differing position.

    Refused with ``ValueError`` before anything is stored: runs of different ``model_hash``
    (unless ``allow_different_models``; the comparison row then records ``models_differ``), and
    a run whose KV lacks a layer the references hold. When the references hold KV of a prompt
    and another run does not — or a reference (expected or baseline) holds no KV at all — the KV
    verdict is "not compared" and the comparison does not pass (``kv=False`` compares logits
    only): KV asked for and judged on nothing is never a pass. The row's ``judged`` lists the
    comparators whose verdict judged evidence. A two-way comparison stores KV metrics but has no noise
    to judge them against: its KV verdict is "not judged" and it does not pass unless
    ``kv=False``. Non-finite actual KV where the references are finite fails the KV verdict
    (``metrics.verdict``).

    A comparator that raises anything but ``ValueError`` (bad input, which refuses the whole
    comparison) is recorded as errored: its verdict says so and judges nothing (so the comparison
    does not pass), its rows are dropped, its traceback is stored in the row's ``errored`` column
    (and ``ComparisonResult.errors``), and the other comparators still run.

    comparator_runs: ``{comparator name: {role: run_id}}`` for a comparator whose evidence lives
    in other runs of the same prompts (module tensors captured apart from logits and KV); it sees
    those runs in its context and prompts, checked like the row's (complete, the same roles, the
    same tokens among themselves), and the row records them in ``comparator_runs``.

    ``client``: a ``dask.distributed.Client``: the per-prompt work runs as Dask tasks (workers
    read the captures from the store and return rows and partials; capturestore/distributed.py);
    this process writes the rows as they arrive, reduces the partials in prompt order and writes
    the ``comparisons`` row last. The stored results are the same as without a client, bit for bit.
    A comparator's own runs (``comparator_runs``) are compared in this process only, and under a
    client a comparator raising in ``compare`` on a worker fails the comparison rather than being
    recorded as errored.
    """
    from capturestore.comparators import (
        ComparisonContext,
        Verdict,
        comparator_class,
        comparisons_schema,
        localise,
        overall_passed,
    )
    from capturestore.comparators.base import COMPARISONS_SCHEMA_VERSION, TableSpec, to_arrow
    from capturestore.comparators.kv import KVComparator
    from capturestore.comparators.logits import LogitsComparator
    from capturestore.errors import StoreError
    from capturestore.integrity import PendingComparison

    if label is not None:
        from capturestore.writer import check_label

        if not isinstance(label, str):
            raise ValueError(f"compare_runs: label must be text, got {label!r}")
        check_label(label, "compare_runs: label")  # printed on one line wherever it is shown
    runs = {"expected": expected_run, "actual": actual_run}
    if baseline_run is not None:
        runs = {"baseline": baseline_run, **runs}
    known = _committed_runs(store)
    for role, rid in runs.items():
        if rid not in known:
            raise ValueError(f"compare_runs: {role} run {rid!r} is not a complete run of {store.root}")
    if len(set(runs.values())) < len(runs):
        same = [role for role, rid in runs.items() if list(runs.values()).count(rid) > 1]
        raise ValueError(f"compare_runs: run {runs[same[0]]} fills the roles {', '.join(same)}: a run compared with "
                         f"itself measures nothing (its errors are zero by construction)")
    three_way = baseline_run is not None
    models_differ = _check_models(known, runs, allow_different_models)
    prompt_ids = _common_prompts(store, runs)
    cid = f"cmp-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"

    active = ([LogitsComparator(tol_map)] if logits else []) + ([KVComparator(kv_verdict_config)] if kv else [])
    asked = [comparator_class(c)() if isinstance(c, str) else c for c in comparators]
    active += asked
    names = [c.name for c in active]
    if len(set(names)) < len(names):
        raise ValueError(f"compare_runs: comparators {names} name one twice (logits and kv run unless "
                         f"logits=False / kv=False)")
    context = ComparisonContext(store, cid, runs, prompt_ids, label)
    contexts = {c.name: context for c in active}
    for name, own in (comparator_runs or {}).items():
        contexts[name] = _comparator_context(store, known, context, name, own, names)
        models_differ = _check_models(known, {**runs, **{f"{name} {r}": rid for r, rid in own.items()}},
                                      allow_different_models) or models_differ
    errors: dict = {}  # comparator name -> traceback of what it raised

    def guarded(c, call, *args):
        """``call(*args)`` of comparator ``c``; anything but ValueError (bad input) marks it errored."""
        if c.name in errors:
            return None
        try:
            return call(*args)
        except (ValueError, StoreError):  # bad input or a damaged store: refused, nothing stored
            raise
        except Exception:  # noqa: BLE001 - recorded with the comparison, the others still run
            errors[c.name] = traceback.format_exc()
            return None

    for c in active:
        guarded(c, c.prepare, contexts[c.name])  # may refuse (ValueError) before anything is computed or stored

    if client is not None and comparator_runs:
        raise ValueError("compare_runs: comparator_runs are compared in one process; drop client= (CLI: "
                         "--scheduler) for this comparison")
    with PendingComparison(store, cid) as pending:  # rows written as they come, invisible until the row
        rows = HeldRows(pending, errors)
        partials: dict = {c.name: [None] * len(prompt_ids) for c in active}  # per prompt, in prompt order
        if client is not None:
            from capturestore.distributed import compare_prompts

            live = [c for c in active if c.name not in errors]  # those whose prepare() raised judge nothing
            results = ((i, pid, dict(zip((c.name for c in live), out)))
                       for i, pid, out in compare_prompts(client, context, live, prompt_ids, progress))
        else:
            results = _in_process(context, active, prompt_ids, contexts, guarded, progress)
        for i, pid, out in results:
            for c in active:
                res = out.get(c.name)
                if res is not None and c.name not in errors:
                    partials[c.name][i] = res.partial
                    rows.add(c, pid, res.rows)
            rows.prompt_done()
        for c in active:  # reduce after the last prompt: the comparators' partials, in prompt order
            rows.add(c, None, guarded(c, c.reduce, partials.pop(c.name)) or {})
        rows.flush()
        verdicts = {c.name: guarded(c, c.verdict) for c in active}

        def errored_verdicts():  # an errored comparator judged nothing: never a pass
            for c in active:
                if c.name in errors:
                    last = errors[c.name].strip().splitlines()[-1]
                    verdicts[c.name] = Verdict(c.name, None, f"errored: {last} (traceback stored with the comparison)",
                                               None, None, c.localisation_rank)

        errored_verdicts()
        for c in active:  # asked for (kv=True included) and judged nothing: not a pass (unless it only stores evidence)
            if verdicts[c.name] is None and getattr(c, "judges", True):
                verdicts[c.name] = Verdict(c.name, None, "judged nothing (its verdict is None)", None, None,
                                           c.localisation_rank)

        passed = overall_passed(verdicts.values())  # nothing judged is not a pass
        cells: dict = {}
        for c in active:  # each comparator's cells of the row; one raising here errors like anywhere else
            if c.name not in errors:
                cells[c.name] = guarded(c, c.comparison_columns, verdicts[c.name], passed) or {}
        if any(name in errors for name in cells):
            errored_verdicts()  # raised while filling its cells: no pass, and its verdict says so
            passed = False
            for c in active:  # the others' cells were filled for a pass that no longer holds
                if c.name in cells and c.name not in errors:
                    cells[c.name] = guarded(c, c.comparison_columns, verdicts[c.name], passed) or {}
            errored_verdicts()
        # an errored comparator's rows are partial: none are stored
        pending.discard(t for c in active if c.name in errors for t in c.tables)
        loc = None if passed else localise(verdicts.values())
        row = {
            "comparison_id": cid, "label": label, "created_at": datetime.now(timezone.utc),
            "baseline_run": baseline_run, "expected_run": expected_run, "actual_run": actual_run,
            "three_way": three_way, "n_prompts": len(prompt_ids), "models_differ": models_differ,
            "passed": passed,
        }
        for c in (*_default_comparators(), *active):  # the built-in columns exist (NULL) when their comparator did not run
            if c.name not in verdicts or c.name in errors:
                row.update(dict.fromkeys(f.name for f in c.comparison_fields))
        for c in active:
            if c.name not in errors:
                row.update(cells[c.name])
        row.update({
            "failure_phase": None if loc is None else loc.phase,
            "localisation": None if loc is None else json.dumps(loc.as_dict()),
            "failure_layer": None if loc is None else loc.layer,
            "failure_module": None if loc is None else loc.module,
            "failure_token": None if loc is None else loc.token,
            "errored": json.dumps(errors) if errors else None,
            "comparator_runs": json.dumps(comparator_runs) if comparator_runs else None,
            "judged": [name for name, v in verdicts.items() if v is not None and v.passed is not None],
        })
        spec = TableSpec(comparisons_schema([*_default_comparators(), *active]), COMPARISONS_SCHEMA_VERSION)
        pending.commit(to_arrow([[row]], spec, "comparisons"))

    logit = next((c for c in active if isinstance(c, LogitsComparator)), None)
    kvc = next((c for c in active if isinstance(c, KVComparator)), None)
    detail = lambda name: None if verdicts.get(name) is None else verdicts[name].detail  # noqa: E731
    return ComparisonResult(
        cid, runs, tuple(prompt_ids), detail("logits"), detail("kv"), tuple(kvc.layer_rows) if kvc else (),
        None if passed or logit is None else logit.first_failing_token(), None if loc is None else loc.phase,
        models_differ, verdicts=verdicts, localisation=None if loc is None else loc.as_dict(), errors=errors,
    )


def _comparator_context(store, known: dict, context, name: str, own: dict, names: list):
    """The context of comparator ``name`` reading its own runs ``own`` ({role: run_id}) of the comparison's
    prompts (``compare_runs``' comparator_runs): the same roles, complete runs holding every prompt."""
    from capturestore.comparators import ComparisonContext

    if name not in names:
        raise ValueError(f"compare_runs: comparator_runs names {name!r}, which is not among the comparators run "
                         f"({', '.join(names)})")
    if set(own) != set(context.runs):
        raise ValueError(f"compare_runs: comparator_runs[{name!r}] has roles {sorted(own)}, the comparison "
                         f"{sorted(context.runs)}")
    for role, rid in own.items():
        if rid not in known:
            raise ValueError(f"compare_runs: comparator_runs[{name!r}]: {role} run {rid!r} is not a complete run "
                             f"of {store.root}")
        have = {p["prompt_id"] for p in store.prompts(rid).to_pylist()}
        missing = [p for p in context.prompt_ids if p not in have]
        if missing:
            raise ValueError(f"compare_runs: comparator_runs[{name!r}]: {role} run {rid} lacks {len(missing)} of the "
                             f"compared prompts (first: {missing[:3]})")
    return ComparisonContext(store, context.comparison_id, {r: own[r] for r in context.runs}, context.prompt_ids,
                             context.label)


ROWS_HELD_PROMPTS = 16  # compare_runs writes the rows it holds once this many prompts' are held


class HeldRows:
    """The rows of a comparison not written yet: at most ``limit`` prompts' (``ROWS_HELD_PROMPTS``),
    then written as one segment per table through ``pending`` (an ``integrity.PendingComparison``:
    invisible until the comparison commits). Within a segment the rows are ordered by prompt id
    (a selection of prompts reads few row groups), the rows of ``reduce`` last. The rows of a
    comparator named in ``errors`` are never written."""

    def __init__(self, pending, errors: dict, limit: int | None = None):
        self.pending, self.errors = pending, errors
        self.limit = ROWS_HELD_PROMPTS if limit is None else limit
        self.parts: dict = {}  # (comparator, table) -> [(prompt id or None for reduce's, rows)]
        self.held = 0

    def add(self, c, pid: str | None, rows: dict) -> None:
        for table, part in rows.items():
            self.parts.setdefault((c, table), []).append((pid, part))

    def prompt_done(self) -> None:
        self.held += 1
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        from capturestore.comparators.base import to_arrow

        parts, self.parts, self.held = self.parts, {}, 0
        for (c, table), rows in parts.items():
            if c.name not in self.errors:
                rows.sort(key=lambda r: (r[0] is None, r[0] or ""))
                self.pending.append(table, to_arrow([part for _, part in rows], c.table_spec(table), table))


def _in_process(context, active, prompt_ids, contexts, guarded, progress):
    """(index, prompt id, {comparator name: PromptResult or None}) of each prompt, computed here."""
    for i, pid in enumerate(prompt_ids):
        if progress:
            progress(f"comparing prompt {i + 1}/{len(prompt_ids)} ({pid})")
        yield i, pid, dict(zip((c.name for c in active), compare_prompt(context, active, pid, contexts, guarded)))


def compare_prompt(context, active, pid: str, contexts: dict | None = None, guarded=None) -> list:
    """Every comparator's ``PromptResult`` of one prompt (rows and partial, in ``active``'s order;
    None for one ``guarded`` found errored). A comparator with its own runs (``contexts[name]``,
    compare_runs' comparator_runs) gets the prompt from them; ``guarded(c, call, arg)`` wraps each
    call (compare_runs' errored comparators)."""
    from capturestore.comparators import PromptCaptures

    store, runs = context.store, context.runs
    tokens, plen = prompt_split(store, runs["expected"], pid)
    _check_tokens(store, runs, pid, tokens)
    prompt = PromptCaptures(context, pid, tokens, plen)
    prompts = {}
    for name, ctx in (contexts or {}).items():
        if ctx is not context:
            own_tokens, own_plen = prompt_split(store, ctx.runs["expected"], pid)
            _check_tokens(store, ctx.runs, pid, own_tokens)
            prompts[name] = PromptCaptures(ctx, pid, own_tokens, own_plen)
    if guarded is None:
        return [c.map(prompts.get(c.name, prompt)) for c in active]
    return [guarded(c, c.map, prompts.get(c.name, prompt)) for c in active]


def _default_comparators():
    from capturestore.comparators.kv import KVComparator
    from capturestore.comparators.logits import LogitsComparator

    return (LogitsComparator, KVComparator)


def _check_tokens(store, runs: dict, pid: str, tokens) -> None:
    """Every run captured ``tokens`` for prompt ``pid`` (teacher forcing), else ValueError naming where."""
    for role, rid in runs.items():
        other = store.read_tokens(rid, pid)
        if other.shape != tokens.shape or not np.array_equal(other, tokens):
            diff = next((i for i, (a, b) in enumerate(zip(other, tokens)) if a != b), min(len(other), len(tokens)))
            raise ValueError(
                f"compare_runs: prompt {pid}: {role} run {rid} captured other tokens than expected run "
                f"{runs['expected']} ({len(other)} vs {len(tokens)} tokens, first difference at position {diff}); "
                f"runs must be teacher-forced on the same tokens"
            )
