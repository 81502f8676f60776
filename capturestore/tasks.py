"""lm-eval task analysis: scores against thresholds or a reference run, and the deviated prompts.

Reads real lm-eval 0.4.x output directories (``--output_path OUT --log_samples``: one
``results_<timestamp>.json`` per evaluation and ``samples_<task>_<timestamp>.jsonl`` per task,
usually under ``OUT/<model name with / as __>/``), pairs tasks by name (timestamps stripped) and
samples by ``(doc_id, filter)``, and stores two tables (docs/tasks.md, docs/tables.md):

- ``task_scores``: one row per task (subtasks and group rows) x metric: the target's score and
  stderr, the reference's, the threshold it is judged against and whether it passed;
- ``task_samples``: one row per task x doc x filter: prompt, expected answer, both responses,
  both metric values, and whether the sample deviated.

Two modes.
- Target only (``analyse_tasks(results)``): scores are judged against ``thresholds``
  (``{"acc": 0.5, "exact_match,strict-match": 0.4}``: a bare metric name matches every filter;
  a score passes when it is at least the value, or at most it where lm-eval says lower is
  better); no threshold: not judged. A sample deviated when it was answered incorrectly: a
  metric with only 0 / 1 values holds the bad one (other metrics do not judge samples).
- Reference vs target (``analyse_tasks(results, reference)``): scores are also judged against
  the reference's with ``tolerance`` ``"mean"`` (no worse than the reference's score) or ``"std"``
  (the default: no worse than the reference's score minus ``STD_Z`` combined standard errors,
  ``sqrt(se_ref**2 + se_target**2)``); a metric a threshold names is judged by the threshold
  instead. A sample deviated
  when the target's response differs from the reference's (generated text; the chosen answer of
  a multiple-choice task; the is-greedy flag of a loglikelihood task) or any of its metric
  values differs (floats compared to a relative 1e-9).

Group tasks (``group:`` yaml with subtasks, mmlu_pro-style) give a row per subtask (with
``group_name``) and one for the group's aggregate (``is_group``); groups have no samples.

``deviated_prompts(...)`` returns the deviated samples' prompts (one per task x doc, in task then
doc order) as ``{"id", "prompt", "task", "doc_id", "target"}`` dicts, the form of a ``.jsonl``
prompt file's lines, for ``capturestore run --from-task``.

Bad input is one ``ValueError`` line naming the directory or file (and line) before anything is
stored: a missing directory, no ``results_*.json``, malformed JSON / JSONL, a file that is not
lm-eval's, results of several models in one directory, a reference sharing no task with the
target, tolerance without a reference, a threshold naming no metric of any task.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

from capturestore.comparators.base import TableSpec, finite_or_null, to_arrow

__all__ = ["STD_Z", "TASK_SAMPLES", "TASK_SCORES", "TASK_TABLES", "TaskAnalysis", "TaskRun", "analyse_tasks",
           "deviated_prompts", "load_task_results", "run_task_analysis", "store_task_analysis"]

STD_Z = 2.0  # --tolerance std: a target score may be this many combined standard errors worse
TOLERANCES = ("mean", "std")

_S, _D, _I, _B, _TS = pa.string(), pa.float64(), pa.int64(), pa.bool_(), pa.timestamp("us", tz="UTC")

TASK_SCORES = TableSpec(pa.schema([
    ("analysis_id", _S), ("label", _S), ("created_at", _TS), ("task", _S), ("group_name", _S), ("is_group", _B),
    ("metric", _S), ("filter", _S), ("higher_is_better", _B), ("score", _D), ("stderr", _D),
    ("reference_score", _D), ("reference_stderr", _D), ("delta", _D), ("threshold", _D), ("threshold_kind", _S),
    ("passed", _B), ("n_samples", _I), ("n_deviated", _I), ("results_file", _S), ("reference_file", _S),
]), 1)
TASK_SAMPLES = TableSpec(pa.schema([
    ("analysis_id", _S), ("task", _S), ("doc_id", _I), ("filter", _S), ("prompt_hash", _S), ("prompt", _S),
    ("target", _S), ("response", _S), ("reference_response", _S), ("metrics", _S), ("reference_metrics", _S),
    ("deviated", _B), ("worse", _B), ("response_differs", _B), ("metrics_differ", _B),
    ("deviated_metrics", pa.list_(_S)),
]), 1)
TASK_TABLES = {"task_scores": TASK_SCORES, "task_samples": TASK_SAMPLES}

_RESULTS_RE = re.compile(r"^results_(?P<ts>.+)\.json$")
_SAMPLES_RE = re.compile(r"^samples_(?P<task>.+)_(?P<ts>\d{4}-\d{2}-\d{2}T[0-9.:\-]+)\.jsonl$")
_NOT_METRICS = {"alias", "name", "sample_len", "sample_count", " "}


# --------------------------------------------------------------------------------- reading


@dataclass
class TaskRun:
    """One task (or group) of an lm-eval output directory."""

    name: str
    scores: dict  # "metric,filter" -> float | None
    stderrs: dict  # "metric,filter" -> float | None
    higher_is_better: dict  # metric -> bool
    results_file: str
    is_group: bool = False
    group_name: str | None = None
    output_type: str | None = None
    n_samples: int | None = None
    samples: dict | None = None  # (doc_id, filter) -> sample dict; None: no samples file
    samples_file: str | None = None


def _read_json(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(f"{path} has no 'results' object: not an lm-eval results file")
    return data


def _read_samples(path: Path, task: str) -> dict:
    out = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(s, dict) or not isinstance(s.get("doc_id"), int) or "filtered_resps" not in s:
            raise ValueError(f"{path}:{n}: not an lm-eval sample (needs doc_id and filtered_resps)")
        key = (s["doc_id"], str(s.get("filter", "none")))
        if key in out:
            raise ValueError(f"{path}:{n}: doc_id {key[0]} filter {key[1]!r} appears twice in task {task}")
        out[key] = s
    return out


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def load_task_results(path, role: str = "task results") -> dict[str, TaskRun]:
    """{task name: TaskRun} of an lm-eval output directory (``--output_path``; searched
    recursively). Several results files (re-runs, task sets) merge by task, the newest timestamp
    winning; a task's samples come from the file of the same timestamp. role: what the directory
    is to the caller, named in the errors ("--reference", "reference task results")."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"{role} directory {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"{role} {root} is not a directory (give lm-eval's --output_path)")
    files = sorted(p for p in root.rglob("results_*.json") if _RESULTS_RE.match(p.name))
    if not files:
        raise ValueError(f"{root} holds no results_*.json: not an lm-eval --output_path directory")
    dirs = sorted({p.parent for p in files})
    if len(dirs) > 1:
        names = ", ".join(str(d.relative_to(root)) for d in dirs)
        raise ValueError(f"{root} holds results of {len(dirs)} directories ({names}); give one model's directory")
    tasks: dict[str, TaskRun] = {}
    for f in sorted(files, key=lambda p: _RESULTS_RE.match(p.name)["ts"]):  # newest last: it wins
        ts = _RESULTS_RE.match(f.name)["ts"]
        data = _read_json(f)
        groups = data.get("group_subtasks") or {}
        parent = {sub: g for g, subs in groups.items() for sub in (subs or [])}
        hib_all = data.get("higher_is_better") or {}
        configs = data.get("configs") or {}
        n_samples = data.get("n-samples") or {}
        for name, row in data["results"].items():
            if not isinstance(row, dict):
                raise ValueError(f"{f}: results[{name!r}] is not an object")
            scores, stderrs = {}, {}
            for k, v in row.items():
                if k in _NOT_METRICS or "," not in k:
                    continue
                metric, _, filt = k.partition(",")
                if metric.endswith("_stderr"):
                    stderrs[f"{metric[:-7]},{filt}"] = _number(v)
                else:
                    scores[k] = _number(v)
            ns = (n_samples.get(name) or {}).get("effective") if isinstance(n_samples.get(name), dict) else None
            tasks[name] = TaskRun(
                name=name, scores=scores, stderrs=stderrs, results_file=str(f),
                higher_is_better={m: bool(b) for m, b in (hib_all.get(name) or {}).items()},
                is_group=name in groups, group_name=parent.get(name),
                output_type=(configs.get(name) or {}).get("output_type"),
                n_samples=ns if isinstance(ns, int) else row.get("sample_len"),
            )
            sample_files = [p for p in f.parent.glob(f"samples_{name}_*.jsonl")
                            if (m := _SAMPLES_RE.match(p.name)) and m["task"] == name and m["ts"] == ts]
            if sample_files:
                tasks[name].samples = _read_samples(sample_files[0], name)
                tasks[name].samples_file = str(sample_files[0])
    return tasks


# --------------------------------------------------------------------------------- judging


def _threshold_for(thresholds: dict, key: str):
    metric = key.partition(",")[0]
    if key in thresholds:
        return thresholds[key]
    return thresholds.get(metric)


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _response(sample: dict, output_type: str | None):
    """The sample's answer as a comparable value (see the module docstring), or None."""
    fr = sample.get("filtered_resps")
    try:
        if output_type == "multiple_choice":
            lls = [float(r[0]) for r in fr]
            return max(range(len(lls)), key=lls.__getitem__) if lls else None
        if output_type == "loglikelihood":
            return str(fr[0][1])
        if output_type == "loglikelihood_rolling":
            return None
        if output_type == "generate_until" or (isinstance(fr, list) and fr and isinstance(fr[0], str)):
            return fr
    except (TypeError, ValueError, IndexError):
        return None
    return None


def _prompt_text(sample: dict) -> str | None:
    args = sample.get("arguments")
    if isinstance(args, dict):
        first = args.get("gen_args_0")
        if isinstance(first, dict) and isinstance(first.get("arg_0"), str):
            return first["arg_0"]
    if isinstance(args, list) and args and isinstance(args[0], list) and args[0] and isinstance(args[0][0], str):
        return args[0][0]  # older lm-eval: [[context, continuation], ...]
    return None


def _sample_metrics(sample: dict) -> dict:
    return {m: sample.get(m) for m in (sample.get("metrics") or []) if m in sample}


@dataclass
class TaskAnalysis:
    """What ``analyse_tasks`` found: rows of both tables (without ids), the verdict and the
    deviated prompts. ``passed``: every judged score passed (None: nothing judged)."""

    results_dir: str
    reference_dir: str | None
    thresholds: dict
    tolerance: str | None
    score_rows: list = field(default_factory=list)
    sample_rows: list = field(default_factory=list)
    missing_in_target: list = field(default_factory=list)  # reference tasks the target lacks
    analysis_id: str | None = None

    @property
    def passed(self) -> bool | None:
        judged = [r["passed"] for r in self.score_rows if r["passed"] is not None]
        return None if not judged else all(judged)

    @property
    def deviated(self) -> list[dict]:
        return [r for r in self.sample_rows if r["deviated"]]

    def summary_lines(self, max_prompts: int = 20) -> list[str]:
        """The lines ``capturestore tasks`` prints (``summary_lines``)."""
        return summary_lines(self, max_prompts)

    def deviated_prompts(self) -> list[dict]:
        seen, out = set(), []
        for r in self.deviated:
            key = (r["task"], r["doc_id"])
            if key in seen or r["prompt"] is None:
                continue
            seen.add(key)
            out.append({"id": f"{r['task']}/{r['doc_id']}", "prompt": r["prompt"], "task": r["task"],
                        "doc_id": r["doc_id"], "target": r["target"]})
        return out


def analyse_tasks(results, reference=None, *, thresholds: dict | None = None,
                  tolerance: str | None = None) -> TaskAnalysis:
    """Judge the lm-eval output directory ``results`` (the target) alone or against ``reference``
    (see the module docstring); nothing is stored. Raises one-line ValueError on bad input."""
    thresholds = dict(thresholds or {})
    if tolerance is not None and tolerance not in TOLERANCES:
        raise ValueError(f"--tolerance must be one of {', '.join(TOLERANCES)}, got {tolerance!r}")
    if tolerance is not None and reference is None:
        raise ValueError(f"--tolerance {tolerance} judges the target against a reference: give --reference DIR")
    if reference is not None and Path(results).expanduser().resolve() == Path(reference).expanduser().resolve():
        raise ValueError(f"the reference {reference} is the results directory itself: a run judged against itself "
                         f"measures nothing")
    target = load_task_results(results)
    ref = load_task_results(reference, "reference task results") if reference is not None else None
    if ref is not None:
        common = set(target) & set(ref)
        if not common:
            raise ValueError(f"reference {reference} shares no task with {results} (reference: "
                             f"{', '.join(sorted(ref))}; target: {', '.join(sorted(target))})")
        tolerance = tolerance or "std"
    if thresholds:
        keys = {k for t in target.values() for k in t.scores}
        known = keys | {k.partition(",")[0] for k in keys}
        unknown = sorted(set(thresholds) - known)
        if unknown:
            raise ValueError(f"--threshold {unknown[0]}: no task of {results} has that metric "
                             f"(metrics: {', '.join(sorted(keys))})")
    for name in sorted(set(target) & set(ref or {})):  # samples paired by (doc_id, filter): none pairing is no check
        ts, rs = target[name].samples, ref[name].samples
        if ts and rs and not set(ts) & set(rs):
            def span(keys):
                docs = sorted({d for d, _ in keys})
                return f"doc_id {docs[0]}-{docs[-1]}, filter {', '.join(sorted({f for _, f in keys}))}"
            raise ValueError(f"reference {reference}: task {name}: none of its {len(rs)} samples pairs with one of "
                             f"the target's {len(ts)} by (doc_id, filter) (reference {span(rs)}; target {span(ts)}); "
                             f"it is a run of other documents, so no sample could be compared")
    out = TaskAnalysis(str(results), None if reference is None else str(reference), thresholds, tolerance)
    out.missing_in_target = sorted(set(ref) - set(target)) if ref is not None else []
    for name in sorted(target, key=lambda n: (target[n].is_group, target[n].group_name or n, n)):
        t = target[name]
        r = ref.get(name) if ref is not None else None
        samples, n_dev = _sample_rows(t, r, thresholds)
        out.sample_rows += samples
        for key in sorted(t.scores):
            metric, _, filt = key.partition(",")
            hib = t.higher_is_better.get(metric, True)
            score, se = t.scores[key], t.stderrs.get(key)
            rs = r.scores.get(key) if r is not None else None
            rse = r.stderrs.get(key) if r is not None else None
            thr, kind = _threshold_for(thresholds, key), "min" if _threshold_for(thresholds, key) is not None else None
            if thr is None and rs is not None and tolerance is not None:
                kind = tolerance
                slack = 0.0 if tolerance == "mean" else STD_Z * math.sqrt((rse or 0.0) ** 2 + (se or 0.0) ** 2)
                thr = rs - slack if hib else rs + slack
            passed = None
            if thr is not None:
                passed = score is not None and math.isfinite(score) and (score >= thr if hib else score <= thr)
            out.score_rows.append({
                "task": name, "group_name": t.group_name, "is_group": t.is_group, "metric": metric, "filter": filt,
                "higher_is_better": hib, "score": score, "stderr": se, "reference_score": rs,
                "reference_stderr": rse, "delta": None if score is None or rs is None else score - rs,
                "threshold": thr, "threshold_kind": kind, "passed": passed, "n_samples": t.n_samples,
                "n_deviated": n_dev, "results_file": t.results_file,
                "reference_file": None if r is None else r.results_file,
            })
    return out


def _binary(values) -> bool:
    vals = [v for v in values if v is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v in (0, 1) for v in vals)


def _sample_rows(t: TaskRun, r: TaskRun | None, thresholds: dict) -> tuple[list, int | None]:
    if t.samples is None:
        return [], None
    rows, n_dev = [], 0
    binary = {}
    for (doc, filt), s in sorted(t.samples.items()):
        mets = _sample_metrics(s)
        rsample = r.samples.get((doc, filt)) if r is not None and r.samples is not None else None
        resp = _response(s, t.output_type)
        row = {"task": t.name, "doc_id": doc, "filter": filt, "prompt_hash": s.get("prompt_hash"),
               "prompt": _prompt_text(s), "target": None if s.get("target") is None else str(s.get("target")),
               "response": json.dumps(resp), "metrics": json.dumps(mets), "reference_response": None,
               "reference_metrics": None, "deviated": None, "worse": None, "response_differs": None,
               "metrics_differ": None, "deviated_metrics": None}
        if r is not None:
            if rsample is not None:
                rmets = _sample_metrics(rsample)
                rresp = _response(rsample, r.output_type or t.output_type)
                differ = sorted(m for m in set(mets) | set(rmets) if not _close(mets.get(m), rmets.get(m)))
                num = [m for m in differ if all(isinstance(x.get(m), (int, float)) for x in (mets, rmets))]
                worse = [m for m in num
                         if (mets[m] < rmets[m] if t.higher_is_better.get(m, True) else mets[m] > rmets[m])]
                row.update(reference_response=json.dumps(rresp), reference_metrics=json.dumps(rmets),
                           response_differs=resp is not None and rresp is not None and resp != rresp,
                           metrics_differ=bool(differ), deviated_metrics=differ, worse=bool(worse))
                row["deviated"] = bool(row["response_differs"] or differ)
        else:
            bad = []
            for m, v in mets.items():
                if m not in binary:
                    binary[m] = _binary(_sample_metrics(x).get(m) for x in t.samples.values())
                if binary[m] and v is not None:
                    hib = t.higher_is_better.get(m, True)
                    if (v == 0 if hib else v == 1):
                        bad.append(m)
            if any(binary.get(m) for m in mets):
                row.update(deviated=bool(bad), deviated_metrics=sorted(bad), worse=bool(bad))
        n_dev += bool(row["deviated"])
        rows.append(row)
    judged = any(row["deviated"] is not None for row in rows)
    return rows, n_dev if judged else None  # None: no sample of the task could be judged


# --------------------------------------------------------------------------------- storing


def store_task_analysis(store, analysis: TaskAnalysis, label: str | None = None) -> str:
    """Append the analysis to ``task_samples`` then ``task_scores`` (one segment each, every row
    checked against the declared schema first); returns its ``analysis_id``."""
    aid = f"tasks-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    now = datetime.now(timezone.utc)
    scores = [{"analysis_id": aid, "label": label, "created_at": now, **r,
               "score": None if r["score"] is None else finite_or_null(r["score"]),
               "stderr": None if r["stderr"] is None else finite_or_null(r["stderr"])} for r in analysis.score_rows]
    samples = [{"analysis_id": aid, **r} for r in analysis.sample_rows]
    staged = {name: to_arrow([rows], TASK_TABLES[name], name) for name, rows in
              (("task_samples", samples), ("task_scores", scores)) if rows}
    for name, table in staged.items():  # task_scores last: an analysis with scores is whole
        store.append_table(name, table)
    analysis.analysis_id = aid
    return aid


def tasks(store, results, reference=None, *, thresholds: dict | None = None, tolerance: str | None = None,
          label: str | None = None) -> TaskAnalysis:
    """``capturestore tasks``: ``analyse_tasks`` then ``store_task_analysis`` into ``store`` (a
    ``Store``, or a path / URL where a store is created when there is none). Every input check
    comes before the store is touched: nothing is stored, nor a store created, when the input is
    refused; a store that cannot be written is refused before anything is written."""
    from capturestore.store import as_store, require_writable

    analysis = analyse_tasks(results, reference, thresholds=thresholds, tolerance=tolerance)
    store = as_store(store, create=True)
    require_writable(store, "tasks")
    store_task_analysis(store, analysis, label)
    return analysis


run_task_analysis = tasks  # its name before the command and its library function shared one


def deviated_prompts(results, reference=None, *, thresholds: dict | None = None,
                     tolerance: str | None = None) -> list[dict]:
    """The deviated prompts of an lm-eval output directory (against ``reference`` when given):
    ``[{"id": "task/doc_id", "prompt", "task", "doc_id", "target"}]``, one per task x doc. Also
    takes a ``TaskAnalysis``."""
    if isinstance(results, TaskAnalysis):
        return results.deviated_prompts()
    return analyse_tasks(results, reference, thresholds=thresholds, tolerance=tolerance).deviated_prompts()


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def summary_lines(analysis: TaskAnalysis, max_prompts: int = 20) -> list[str]:
    """The lines ``capturestore tasks`` prints: the scores table, the deviated prompts, the verdict."""
    what = (f"against {analysis.reference_dir} (tolerance {analysis.tolerance})" if analysis.reference_dir
            else "target only")
    out = [f"task analysis {analysis.analysis_id or '(not stored)'} of {analysis.results_dir}, {what}"]
    head = ("task", "metric", "score", "reference", "threshold", "pass", "deviated")
    rows = [head] + [(("  " if r["group_name"] else "") + r["task"] + (" (group)" if r["is_group"] else ""),
                      f"{r['metric']},{r['filter']}", _fmt(r["score"]), _fmt(r["reference_score"]),
                      "-" if r["threshold"] is None else f"{r['threshold']:.4g} ({r['threshold_kind']})",
                      {True: "PASS", False: "FAIL", None: "-"}[r["passed"]], _fmt(r["n_deviated"]))
                     for r in analysis.score_rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if analysis.missing_in_target:
        out.append(f"reference tasks the target lacks: {', '.join(analysis.missing_in_target)}")
    prompts = analysis.deviated_prompts()
    judged = [r for r in analysis.sample_rows if r["deviated"] is not None]
    out.append(f"deviated samples: {len(analysis.deviated)} of {len(judged)} judged ({len(prompts)} prompts)")
    for p in prompts[:max_prompts]:
        text = " ".join(p["prompt"].split())
        out.append(f"  {p['id']}: {text[:70] + '…' if len(text) > 70 else text}")
    if len(prompts) > max_prompts:
        out.append(f"  ... {len(prompts) - max_prompts} more (SELECT * FROM task_samples WHERE deviated)")
    verdict = {True: "PASS", False: "FAIL", None: "NOT JUDGED (no threshold or reference)"}[analysis.passed]
    out.append(f"overall: {verdict}")
    return out
