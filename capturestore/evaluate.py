"""Level 1 in one command: evaluate tasks on a served engine, judge them, analyse the deviated prompts.

``eval(model, tasks, out=DIR, ...)`` (the CLI's ``capturestore eval``; docs/eval.md) runs the
Accuracy Debugger's pipeline (reference 002):

1. **Evaluation** (``evaluate_tasks``): starts ``vllm serve`` for the model on 127.0.0.1 (a free
   port, or ``port``; ``extractors.vllm_launch``), or uses a running one (``server=URL``), runs
   lm-eval's ``local-completions`` model against it on the tasks given (lm-eval's own names and
   local task files under ``include_path``; ``limit`` docs per task) and **stops the server it
   started** before anything else runs, so the prompt analysis has the cores. lm-eval's output
   (``results_*.json``, ``samples_*.jsonl``) is written to a temporary directory and renamed to
   ``DIR/eval_results`` when whole.
2. **Task analysis** (``capturestore.tasks``, as ``capturestore tasks``): scores against
   ``thresholds`` (minimums) or against ``reference`` (another lm-eval output directory of the
   same tasks; ``tolerance`` mean or std), the deviated samples.
3. **Prompt analysis** of the deviated samples' prompts (``capturestore run --from-task``:
   ``capturestore.pipeline.run``), which stores the task analysis with the comparison.
4. **Report**: ``DIR/report/index.html`` (``reports.render_comparison``), whose Tasks tab shows
   the scores, thresholds and deviated samples.

Resumable: ``DIR/eval.json`` records what was evaluated (model content hash, tasks, limit, task
files' hashes) and what was done; a second call with the same inputs reuses a whole
``DIR/eval_results`` (no server is started) and a stored comparison, and the prompt analysis
reuses its stored HF references (``run``). Inputs that differ from what ``DIR`` holds are refused.

Every input is checked before a server starts (one-line ``ValueError``): the model directory,
the tasks (lm-eval loads them: a task that fails to load is named), each threshold's metric
against the metrics the tasks report, the reference directory, the port, the store and ``DIR``.
A server that dies during the evaluation is one line naming it and its log; its whole process
group is ended on every path. Nothing is stored until the evaluation is whole.

``write_eval_tasks(DIR)`` writes deterministic local tasks (no download): ``cs_choice``
(multiple choice, ``acc``), ``cs_gen`` (generation, ``exact_match``) and ``cs_long``
(LongBench-style single-document QA over documents of thousands of tokens, ``qa_f1``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EVAL_TASKS", "EvalResult", "check_tasks", "eval", "evaluate_tasks", "write_eval_tasks"]

EVAL_TASKS = ("cs_choice", "cs_gen", "cs_long")
STATE_FILE = "eval.json"
RESULTS_DIR = "eval_results"
REPORT_DIR = "report"

# ------------------------------------------------------------------------------------ local tasks

_WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "candle", "forest",
          "silver", "garden", "rocket", "pepper", "window", "meadow", "harbor", "copper", "violet", "falcon",
          "marble", "willow", "thunder", "saddle", "lantern", "orchid", "glacier", "cobalt", "ember", "quartz",
          "bramble"]

_LONGBENCH_METRICS = '''"""LongBench-style scoring of cs_long (written by capturestore.evaluate.write_eval_tasks).

qa_f1: token-level F1 between the normalised prediction and answer (LongBench's qa_f1_score:
lower case, punctuation and articles removed, whitespace collapsed).
"""
import re
import string
from collections import Counter


def normalize_answer(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\\b(a|an|the)\\b", " ", s)
    return " ".join(s.split())


def qa_f1_score(prediction, ground_truth):
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def process_results(doc, results):
    return {"qa_f1": max(qa_f1_score(results[0], a) for a in doc["answers"])}
'''


def _long_doc(i: int, words: int) -> dict:
    """A deterministic document of ``words`` filler words with one fact (the needle) inside."""
    import random

    rng = random.Random(1000 + i)
    key, answer = _WORDS[(3 * i) % len(_WORDS)], _WORDS[(7 * i + 5) % len(_WORDS)]
    filler = [rng.choice(_WORDS) for _ in range(words)]
    sentences = [" ".join(filler[j:j + 12]).capitalize() + "." for j in range(0, words, 12)]
    at = rng.randrange(len(sentences))
    sentences.insert(at, f"The password of the {key} vault is {answer}.")
    return {"context": " ".join(sentences), "input": f"What is the password of the {key} vault?",
            "answers": [answer], "needle_sentence": at}


def write_eval_tasks(task_dir, *, n_choice: int = 12, n_gen: int = 8, n_long: int = 2, long_words: int = 500) -> Path:
    """Write the local tasks ``cs_choice``, ``cs_gen`` and ``cs_long`` (module docstring) into
    ``task_dir`` (created): JSONL data, lm-eval YAML (``dataset_path: json`` over the local files,
    nothing downloaded) and ``cs_longbench.py`` (the long task's scoring). Deterministic: the same
    arguments give the same bytes. Returns ``task_dir``."""
    d = Path(task_dir)
    d.mkdir(parents=True, exist_ok=True)
    n = len(_WORDS)
    data = {
        "cs_choice": [{"question": f"Which word follows {_WORDS[i % n]}?",
                       "choices": [_WORDS[(i + k) % n] for k in (1, 3, 5, 7)], "answer": i % 4}
                      for i in range(n_choice)],
        "cs_gen": [{"question": f"Repeat the word: {_WORDS[i % n]}\nAnswer:", "answer": f" {_WORDS[i % n]}"}
                   for i in range(n_gen)],
        "cs_long": [_long_doc(i, long_words) for i in range(n_long)],
    }
    for name, docs in data.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "cs_longbench.py").write_text(_LONGBENCH_METRICS)

    def head(name):
        return (f"task: {name}\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
                f"    test: {(d / (name + '.jsonl')).resolve()}\n")

    (d / "cs_choice.yaml").write_text(
        head("cs_choice") + "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "cs_gen.yaml").write_text(
        head("cs_gen") + "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "cs_long.yaml").write_text(
        head("cs_long") + "output_type: generate_until\n"
        "doc_to_text: \"Read the text and answer the question.\\n\\n{{context}}\\n\\nQuestion: {{input}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answers[0]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "process_results: !function cs_longbench.process_results\n"
        "metric_list:\n  - metric: qa_f1\n    aggregation: mean\n    higher_is_better: true\n")
    return d


# ------------------------------------------------------------------------------------ checks


def _quiet_lm_eval():
    import logging

    for name in ("lm_eval", "lm-eval", "datasets", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _task_list(tasks) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks or ()) if str(t).strip()]
    if not names:
        raise ValueError("--tasks is empty; give lm-eval task names, e.g. --tasks cs_choice,cs_gen")
    if len(set(names)) != len(names):
        raise ValueError(f"--tasks names a task twice: {','.join(names)}")
    return names


_MANAGERS: dict = {}


def _task_manager(include_path, names=()):
    """lm-eval's TaskManager: the local tasks alone when they hold every name (indexing lm-eval's
    thousands of built-in YAML files takes a minute on a loaded machine), else with the built-ins."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"--include-path {include_path} is not a directory of lm-eval task YAML files")
    inc = None if include_path is None else str(Path(include_path).resolve())
    if inc is not None:
        if (inc, False) not in _MANAGERS:
            _MANAGERS[(inc, False)] = TaskManager(include_path=inc, include_defaults=False)
        if all(n in _MANAGERS[(inc, False)].all_tasks for n in names):
            return _MANAGERS[(inc, False)]
    if (inc, True) not in _MANAGERS:
        _MANAGERS[(inc, True)] = TaskManager(include_path=inc)
    return _MANAGERS[(inc, True)]


def check_tasks(tasks, include_path=None, thresholds: dict | None = None) -> dict[str, set]:
    """Load the tasks as lm-eval will (their local data included) and return {task: {"metric,filter"}}
    (groups' subtasks included); one-line ValueError naming a task that fails to load, or a
    threshold whose metric no task reports."""
    _quiet_lm_eval()
    names = _task_list(tasks)
    tm = _task_manager(include_path, names)
    metrics: dict[str, set] = {}
    for name in names:
        if name not in tm.all_tasks:
            where = f" (nor under --include-path {include_path})" if include_path else " (give --include-path DIR)"
            raise ValueError(f"--tasks {name}: lm-eval knows no task of that name{where}")
        try:
            loaded = tm.load([name])
        except Exception as e:  # noqa: BLE001 - whatever lm-eval or datasets raised, in one line
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise ValueError(f"--tasks {name}: lm-eval cannot load it ({type(e).__name__}: {msg})") from None
        _collect_metrics(loaded, metrics)
    unknown = sorted(set(thresholds or ()) - {k for ks in metrics.values() for k in ks}
                     - {k.partition(",")[0] for ks in metrics.values() for k in ks})
    if unknown:
        have = sorted({k for ks in metrics.values() for k in ks})
        raise ValueError(f"--threshold {unknown[0]}: no task of {','.join(names)} reports that metric "
                         f"(metrics: {', '.join(have)})")
    return metrics


def _collect_metrics(loaded: dict, out: dict) -> None:
    """{task or group: {"metric,filter"}} of ``TaskManager.load``'s result."""
    for name, task in (loaded.get("tasks") or {}).items():
        filters = [f.name for f in getattr(task, "_filters", [])] or ["none"]
        out[name] = {f"{m},{f}" for m in task._metric_fn_list for f in filters}
    for name, group in (loaded.get("groups") or {}).items():
        agg = getattr(getattr(group, "config", None), "aggregate_metric_list", None) or []
        out[name] = {f"{_field(m, 'metric')},{f}" for m in agg for f in (_field(m, "filter_list") or ["none"])}


def _field(obj, key):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


# ------------------------------------------------------------------------------------ step 1


def _save_lm_eval(results: dict, out_dir: Path) -> None:
    """Write lm-eval's results as its CLI does (``EvaluationTracker``, ``--log_samples``)."""
    from lm_eval.loggers import EvaluationTracker

    samples = results.pop("samples")
    tracker = EvaluationTracker(output_path=str(out_dir))
    tracker.general_config_tracker.model_name = results.get("config", {}).get("model_name") or "model"
    tracker.general_config_tracker.model_name_sanitized = "model"
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])


def evaluate_tasks(model, tasks, out_dir, *, url=None, lm=None, model_args=None, include_path=None,
                   limit: int | None = None, batch_size: int = 4, max_length: int | None = None,
                   health: Callable[[], str | None] | None = None) -> Path:
    """Run lm-eval on ``tasks`` into the output directory ``out_dir`` (renamed into place when
    whole; returns it). Against the OpenAI-compatible server ``url`` (``local-completions``, the
    model's own tokenizer), or any lm-eval model ``lm`` with ``model_args`` (e.g. ``"hf"`` with
    ``{"pretrained": DIR, "dtype": "float32"}``, a reference run). ``health()`` (optional) returns
    a line when the server died; it is raised instead of lm-eval's own error."""
    _quiet_lm_eval()
    from lm_eval import simple_evaluate

    out_dir = Path(out_dir)
    if url is not None:
        lm = "local-completions"
        model_args = {"base_url": url.rstrip("/") + "/v1/completions", "model": str(model),
                      "tokenizer_backend": "huggingface", "tokenizer": str(model), "num_concurrent": 1,
                      "max_retries": 3, "tokenized_requests": True,
                      **({"max_length": int(max_length)} if max_length else {})}
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            results = simple_evaluate(model=lm, model_args=model_args, tasks=_task_list(tasks),
                                      task_manager=_task_manager(include_path, _task_list(tasks)), limit=limit, log_samples=True,
                                      batch_size=batch_size, bootstrap_iters=1000,
                                      random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
        except Exception as e:  # noqa: BLE001 - a dead server first; else lm-eval's error in one line
            dead = health() if health is not None else None
            if dead:
                raise ValueError(f"{dead}; the evaluation of {','.join(_task_list(tasks))} stopped, "
                                 f"nothing was stored") from None
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise ValueError(f"lm-eval failed on {','.join(_task_list(tasks))} ({type(e).__name__}: {msg}); "
                             f"nothing was stored") from None
        dead = health() if health is not None else None
        if dead:
            raise ValueError(f"{dead}; the evaluation is not whole, nothing was stored")
        if results is None:
            raise ValueError("lm-eval returned no results")
        _save_lm_eval(results, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------------------------------ the whole


@dataclass
class EvalResult:
    """What ``eval`` did: the lm-eval output directory, the task analysis, the comparison of the
    deviated prompts (None: none deviated, or ``analyse=False``), the report, the server's pid
    (None: a running server was used, or the evaluation was reused)."""

    results_dir: Path
    analysis: object
    comparison: object | None
    report: str | None
    server_pid: int | None
    reused_eval: bool

    @property
    def passed(self) -> bool:
        return bool(self.analysis.passed) and (self.comparison is None or bool(self.comparison.passed))


def _file_hash(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _eval_key(model_hash, tasks, include_path, limit, dtype, served) -> dict:
    files = sorted(Path(include_path).rglob("*")) if include_path is not None else []
    return {"model_hash": model_hash, "tasks": list(tasks), "limit": limit, "dtype": dtype, "served": served,
            "include_path": None if include_path is None else str(Path(include_path).resolve()),
            "task_files": _file_hash([f for f in files if f.is_file()]) if files else None}


def _read_state(out: Path) -> dict:
    try:
        return json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(out: Path, state: dict) -> None:
    tmp = out / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, out / STATE_FILE)


def eval(model, tasks, *, out, store="capturestore-store", include_path=None, limit: int | None = None,
         server: str | None = None, port: int | None = None, thresholds: dict | None = None, reference=None,
         tolerance: str | None = None, target: str = "vllm", num_tokens: int = 8, dtype: str = "bfloat16",
         label: str | None = None, analyse: bool = True, serve_args: Sequence[str] = (),
         serve_env: dict | None = None, server_hook: Callable | None = None, engine_hook: Callable | None = None,
         inject_bug_layer: int | None = None, inject_bug_factor: float = 1.1, quiet: bool = False,
         say: Callable[[str], None] | None = None, progress_bar: bool | None = None, bar_file=None,
         timeout: float = 900.0) -> EvalResult:
    """The whole pipeline (module docstring); returns an ``EvalResult``.

    model: a Hugging Face model directory. tasks: lm-eval task names (comma-separated or a list).
    out: the evaluation's directory (lm-eval output, state, report). store: the capture store.
    include_path: a directory of local lm-eval task YAML. limit: docs per task. server: the URL
    of a running ``vllm serve`` of the model (not stopped); else one is started on ``port`` (a
    free one when None) in ``dtype`` with ``serve_args`` / ``serve_env`` added. thresholds:
    {metric: minimum}; reference: an lm-eval output directory of the same tasks; tolerance:
    mean | std (``capturestore tasks``). target, num_tokens, label: the prompt analysis's
    (``capturestore run``). analyse: False stops after the evaluation (a reference run).
    server_hook(url, model_path, say) -> dict | None: called once the server answers, before the
    evaluation (e.g. a proven fault, ``extractors.faults.inject_server_output_scale``); its dict
    is recorded in ``DIR/eval.json``. engine_hook: ``run``'s (the in-process engine's fault).
    inject_bug_layer: a degraded engine on purpose: layer L's attention output scaled by
    ``inject_bug_factor`` in the served engine (``inject_server_output_scale``; the server gets
    the fault extension) and in the prompt analysis's vLLM engine, each proven to change the
    engine's output before anything is judged. say: where the progress and verdict lines go
    (default: nowhere; ``capturestore eval`` passes its own).
    """
    from capturestore.pipeline import check_model_dir, model_context, parse_target
    from capturestore.tasks import analyse_tasks, load_task_results, store_task_analysis, summary_lines

    say = say if say is not None else (lambda _line: None)

    def line(s: str) -> None:
        if not quiet:
            say(s)

    t0 = time.perf_counter()
    # every check before a server starts or anything is written
    if out is None or not str(out).strip():  # Path("") is the current directory: never evaluate into it unasked
        raise ValueError("--out is empty; give the evaluation's directory")
    from capturestore.store import expand_path

    out = expand_path(out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    names = _task_list(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be an integer >= 1, got {limit!r}")
    _check_serve_options(server, port, dtype, num_tokens, inject_bug_layer, inject_bug_factor)
    model_path, cfg = check_model_dir(model)
    if tolerance is not None and reference is None:
        raise ValueError(f"--tolerance {tolerance} judges against a reference run: give --reference DIR")
    if reference is not None:
        ref_tasks = load_task_results(reference, "--reference")
        missing = [n for n in names if n not in ref_tasks]
        if missing:
            raise ValueError(f"--reference {reference} has no task {missing[0]} (it holds {', '.join(sorted(ref_tasks))})")
    if analyse:
        parse_target(target)
    check_tasks(names, include_path, thresholds)
    if inject_bug_layer is not None:
        serve_args, serve_env, server_hook, engine_hook = _fault_hooks(
            model_path, cfg, inject_bug_layer, inject_bug_factor, serve_args, serve_env, server_hook, engine_hook)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")
    from capturestore.store import open_store_path, require_writable
    from capturestore.layout import FORMAT_FILE
    from capturestore.store import store_root
    from extractors.models import model_content_hash

    if (store_root(str(store)) / FORMAT_FILE).exists():
        require_writable(open_store_path(str(store)), "eval")
    model_hash = model_content_hash(model_path)
    key = _eval_key(model_hash, names, include_path, limit, dtype, "server" if server else "started")
    key["injected_bug"] = None if inject_bug_layer is None else [inject_bug_layer, float(inject_bug_factor)]
    state = _read_state(out)
    results_dir = out / RESULTS_DIR
    if state.get("eval") is not None and state["eval"] != {**key, "served": state["eval"].get("served")}:
        raise ValueError(f"--out {out} holds the evaluation of other inputs ({STATE_FILE}: tasks "
                         f"{','.join(state['eval'].get('tasks') or [])}, limit {state['eval'].get('limit')}); give "
                         f"another --out or remove it")
    reused = results_dir.is_dir() and state.get("eval") is not None and state.get("eval_done")
    context = model_context(cfg)
    server_pid = None

    # 1. evaluation
    if reused:
        line(f"reusing the evaluation in {results_dir} ({STATE_FILE}: same model, tasks and limit)")
    else:
        state = {"eval": key}
        started = None
        if server is None:
            from extractors.vllm_launch import start_vllm_serve

            line(f"starting vllm serve for {model_path} ({dtype}) on 127.0.0.1:{port or 'a free port'}")
            with _Ticker("waiting for vllm serve", progress_bar and not quiet, bar_file or sys.stderr):
                started = start_vllm_serve(model_path, port=port, dtype=dtype, max_model_len=context,
                                           extra=serve_args, env=serve_env, log_dir=out, timeout=timeout)
            url, server_pid = started.url, started.pid
            line(f"vllm serve answers at {url} after {time.perf_counter() - t0:.0f} s (pid {started.pid}, log "
                 f"{started.log})")
        else:
            from extractors.vllm_server import check_server

            url = check_server(server, model_path)["url"]
            line(f"using the running vLLM server {url}")
        try:
            if server_hook is not None:
                state["server_hook"] = server_hook(url, model_path, line) or {}

            def health():
                if started is not None:
                    return started.death()
                from extractors.vllm_server import request_json

                try:
                    request_json(url, "/v1/models", timeout=5)
                except ValueError:
                    return f"the vLLM server {url} stopped answering"
                return None

            line(f"evaluating {','.join(names)}" + (f" (limit {limit} docs per task)" if limit else "")
                 + f" against {url}")
            t1 = time.perf_counter()
            with _Ticker(f"evaluating {','.join(names)}", progress_bar and not quiet, bar_file or sys.stderr):
                evaluate_tasks(model_path, names, results_dir, url=url, include_path=include_path, limit=limit,
                               max_length=context, health=health)
            line(f"evaluation done in {time.perf_counter() - t1:.0f} s: {results_dir}")
        finally:
            if started is not None:
                started.stop()
                line(f"stopped vllm serve (pid {started.pid}): the cores are free for the prompt analysis")
        state["eval_done"] = True
        _write_state(out, state)

    # 2. task analysis
    analysis = analyse_tasks(results_dir, reference, thresholds=thresholds, tolerance=tolerance)
    for s in summary_lines(analysis)[1:]:
        line(s)
    comparison = report = None
    if not analyse:
        return EvalResult(results_dir, analysis, None, None, server_pid, bool(reused))
    prompts = analysis.deviated_prompts()
    from capturestore import Store

    if not prompts:
        st = Store.open(str(store), create=True)
        aid = store_task_analysis(st, analysis, label)
        line(f"task analysis {aid} stored; no deviated sample: no prompt to analyse, no report")
        return EvalResult(results_dir, analysis, None, None, server_pid, bool(reused))

    # 3. prompt analysis (resumed: a stored comparison of the same analysis is reused)
    akey = {"reference": None if reference is None else str(Path(reference).resolve()), "tolerance": tolerance,
            "thresholds": thresholds or {}, "target": target, "num_tokens": num_tokens, "label": label,
            "store": str(store)}
    cid = state.get("comparison_id") if state.get("analysis") == akey else None
    stored = _stored_verdict(store, cid) if cid else None
    if stored is not None:
        comparison = Comparison(cid, stored)
        line(f"reusing the prompt analysis {cid} ({STATE_FILE})")
    else:
        from capturestore import pipeline

        line(f"analysing the {len(prompts)} deviated prompts ({target})")
        result = pipeline.run(model_path, target=target, num_tokens=num_tokens, store=str(store), label=label,
                              from_task=analysis, quiet=quiet, out=say, progress_bar=progress_bar,
                              bar_file=bar_file, engine_hook=engine_hook)
        comparison = Comparison(result.comparison_id, bool(result.passed))
        state.update(comparison_id=comparison.comparison_id, analysis=akey)
        _write_state(out, state)

    # 4. report
    from reports import render_comparison

    report = render_comparison(Store.open(str(store)), comparison.comparison_id, str(out / REPORT_DIR))
    state["report"] = str(report)
    _write_state(out, state)
    line(f"report: {report}")
    line(f"eval done in {time.perf_counter() - t0:.0f} s: tasks {_verdict(analysis.passed)}, prompts "
         f"{'PASS' if comparison.passed else 'FAIL'}")
    return EvalResult(results_dir, analysis, comparison, str(report), server_pid, bool(reused))


@dataclass(frozen=True)
class Comparison:
    """The prompt analysis's stored comparison: its id and verdict."""

    comparison_id: str
    passed: bool


def _stored_verdict(store, cid: str) -> bool | None:
    """The verdict of comparison ``cid`` when the store holds it (None: it does not)."""
    from capturestore.layout import FORMAT_FILE
    from capturestore.store import store_root

    if not (store_root(str(store)) / FORMAT_FILE).exists():
        return None
    from capturestore import Store

    st = Store.open(str(store))
    try:
        rows = st.sql("SELECT passed FROM comparisons WHERE comparison_id = $cid", params={"cid": cid}).to_pylist()
    except Exception:  # noqa: BLE001 - no comparisons view yet
        return None
    return bool(rows[0]["passed"]) if rows else None


def _check_serve_options(server, port, dtype, num_tokens, inject_bug_layer, inject_bug_factor) -> None:
    """The options a later step would refuse only after the server started or the evaluation ran,
    checked by the same rules up front: ``--port`` (``start_vllm_serve``), ``--dtype`` (the vllm
    target's dtypes), ``--num-tokens`` (``capturestore run``), ``--inject-bug-factor`` with
    ``--inject-bug-layer`` (the fault's proof: finite, and a factor of 1 changes nothing, so its
    proof would fail; without a layer no fault is made and the factor is not read)."""
    from capturestore.pipeline import check_num_tokens
    from capturestore.targets import VllmTarget
    from extractors.vllm_launch import check_port

    if server is not None and port is not None:
        raise ValueError("--server URL uses a running server; --port is for the server eval starts: give one")
    if port is not None:
        check_port(port)
    if dtype not in VllmTarget.dtypes:
        raise ValueError(f"--dtype {dtype!r}: the vLLM server eval starts runs in {' | '.join(VllmTarget.dtypes)}")
    check_num_tokens(num_tokens)
    if inject_bug_layer is None:
        return
    try:
        factor = float(inject_bug_factor)
    except (TypeError, ValueError):
        factor = math.nan
    if not math.isfinite(factor) or factor == 1.0:
        raise ValueError(f"--inject-bug-factor must be a finite number other than 1 (x 1 changes nothing), "
                         f"got {inject_bug_factor!r}")


def _fault_hooks(model_path, cfg, layer, factor, serve_args, serve_env, server_hook, engine_hook):
    """The served and in-process engines' proven faults of ``inject_bug_layer`` (see ``eval``)."""
    from extractors.faults import SERVER_FAULT_ARGS, SERVER_FAULT_ENV, inject_server_output_scale, o_proj_module

    n_layers = cfg.get("num_hidden_layers")
    if isinstance(layer, bool) or not isinstance(layer, int) or not isinstance(n_layers, int) \
            or not 0 <= layer < n_layers:
        raise ValueError(f"--inject-bug-layer {layer!r} is outside the model's layers 0..{(n_layers or 1) - 1}")
    if server_hook is not None or engine_hook is not None:
        raise ValueError("--inject-bug-layer installs its own hooks; give it or server_hook/engine_hook, not both")
    from capturestore.pipeline import encode_prompts

    probe = encode_prompts(model_path, ["Question: Which word follows apple?\nAnswer: river"])[0]

    def on_server(url, model, say):
        say(f"injecting a bug into the served engine: layer {layer}'s attention output x {factor:g}")
        fault = inject_server_output_scale(url, model, o_proj_module(layer), factor, probe)
        say(f"the bug bites the served engine: {fault.summary()}")
        return {"injected_bug": fault.as_config()}

    def on_engine(llm, rows, say):
        from capturestore.demo import inject_o_proj_bug

        say(f"injecting the same bug into the analysed engine: layer {layer}'s attention output x {factor:g}")
        fault = inject_o_proj_bug(llm, layer, rows[0], factor)
        say(f"the bug bites: {fault.summary()}")
        return {"injected_bug": fault.as_config()}

    return (tuple(serve_args) + SERVER_FAULT_ARGS, {**(serve_env or {}), **SERVER_FAULT_ENV}, on_server, on_engine)


class _Ticker:
    """On a terminal (``progress_bar``), one self-rewriting line with the seconds a step has taken
    (lm-eval's and vLLM's own bars go to the log); elsewhere nothing: the step's plain lines say it."""

    def __init__(self, what: str, enabled: bool, stream):
        self.what, self.enabled, self.stream = what, bool(enabled) and stream is not None, stream

    def __enter__(self):
        if self.enabled:
            import threading

            self.done = threading.Event()
            self.t0 = time.perf_counter()
            self.thread = threading.Thread(target=self._tick, daemon=True)
            self.thread.start()
        return self

    def _tick(self):
        while not self.done.wait(1.0):
            self.stream.write(f"\r{self.what}: {time.perf_counter() - self.t0:.0f} s")
            self.stream.flush()

    def __exit__(self, *exc):
        if self.enabled:
            self.done.set()
            self.thread.join()
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        return False


def _verdict(passed) -> str:
    return {True: "PASS", False: "FAIL", None: "NOT JUDGED"}[passed]


if __name__ == "__main__":  # pragma: no cover - python -m capturestore.evaluate TASK_DIR writes the local tasks
    print(write_eval_tasks(sys.argv[1]))
