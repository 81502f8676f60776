"""``capturestore`` command line: each subcommand is a thin wrapper over one Store method.

    capturestore runs                      Store.runs()
    capturestore show RUN                  Store.show(RUN)
    capturestore sql "SELECT ..."          Store.sql(...)   --format table|csv|json|parquet
    capturestore verify                    Store.verify()   exit status 1 on problems
    capturestore gc                        Store.gc()
    capturestore rebuild-catalog           Store.rebuild_catalog()
    capturestore compare --expected RUN --actual RUN [--baseline RUN]
                                           capturestore.analysis.compare_runs(...)
    capturestore run --model DIR --prompts FILE --target TARGET
                                           capturestore.pipeline.run(...)  exit status 1 on FAIL
    capturestore demo                      capturestore.demo.run_demo(...)  exit status 1 on FAIL
    capturestore calibrate RUN --out DIR   nki_fp8.calibration.calibrate_kv_scales(...)
    capturestore report COMPARISON --out DIR
                                           reports.render_comparison(...)
    capturestore tasks --results DIR [--reference DIR]
                                           capturestore.tasks.run_task_analysis(...)  exit 1 unless PASS
    capturestore eval --model DIR --tasks T --out DIR
                                           capturestore.evaluate.eval(...)  exit 1 unless PASS
    capturestore aggregate COMPARISON --where "..."
                                           capturestore.aggregate.aggregate_bc(...)
    capturestore diff BASE HEAD            capturestore.diff.diff(...)  exit status 1 on regression
    capturestore history --model M         capturestore.diff.history(...)
    capturestore cachecheck --model DIR --engine hf|paged|pkg.mod:Class
                                           capturestore.cachecheck.cachecheck(...)  exit 1 unless PASS

Every command takes ``--store PATH`` (default: $CAPTURESTORE, else ./capturestore-store).

Errors: a user error (bad input, a refused or failing query, a missing or read-only store, a
path that cannot be written) is one line on stderr, ``capturestore CMD: error: ...``, exit
status 2, and nothing is left half-written: commands that write check first that they can.
``--debug`` adds the Python traceback. Any other exception is a bug in capturestore and
propagates with its traceback (exit status 1).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

DEFAULT_STORE = "capturestore-store"


def default_store() -> str:
    return os.environ.get("CAPTURESTORE") or DEFAULT_STORE  # an empty $CAPTURESTORE counts as unset


def _open(path: str, create: bool = False):
    from capturestore.store import open_store_path

    return open_store_path(path, create=create)


def _require_writable(store, command: str) -> None:
    from capturestore.store import require_writable

    require_writable(store, command)


def _why_unwritable(d: Path) -> str:
    try:
        return "read-only file system" if os.statvfs(d).f_flag & os.ST_RDONLY else "permission denied"
    except OSError as e:
        return e.strerror or str(e)


def _json_safe(v: Any) -> Any:
    """NaN and infinities as null: JSON has no such numbers (``json.dumps`` would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _output_path(output: str | None, fmt: str, flag: str = "--output") -> Path | None:
    """The output file option (``flag``: ``--output``, or ``--out`` of diff and history) checked
    before any work: a writable file path (None: stdout)."""
    if fmt == "parquet" and not output:
        raise ValueError(f"--format parquet needs {flag} FILE")
    if output is None:
        return None
    if not output.strip():
        raise ValueError(f"{flag} is empty; give a file path")
    from capturestore.store import expand_path

    out = expand_path(output, flag)
    if out.is_dir():
        raise ValueError(f"{flag} {output} is a directory; give a file path")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {output}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {output}: directory {parent} is not writable ({_why_unwritable(parent)})")
    return out


def _write_file(out: Path, write: Callable[[str], None], flag: str = "--output") -> None:
    """``write(path)`` into a temporary file next to ``out``, renamed into place: never half a file.
    A failure names ``out`` as the user gave it (``flag``), not the temporary file."""
    tmp = out.absolute().parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        write(str(tmp))
        os.replace(tmp, out)
    except OSError as e:
        why = e.strerror or " ".join(str(e).replace(str(tmp), str(out)).split()) or type(e).__name__
        raise ValueError(f"{flag} {out}: cannot be written ({why})") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. a directory (/proc) where nothing could be made
            pass


# ---- output formatting ------------------------------------------------------------------------
def printable(s: str) -> str:
    """``s`` with line breaks and other control characters escaped (``\\n``, ``\\x1b``, ``\\u2028``):
    a stored label can never print a line of its own (``FAKE overall: PASS``) or move the cursor."""
    import unicodedata

    if not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in s):
        return s
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in s)


def _cell(v: Any, width: int = 40) -> str:
    s = "NULL" if v is None else (json.dumps(v, default=str) if isinstance(v, (list, dict)) else printable(str(v)))
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(t: pa.Table, max_rows: int | None = None) -> str:
    """A plain-text table of ``t`` (all rows unless ``max_rows``)."""
    rows = t.to_pylist()
    shown = rows if max_rows is None else rows[:max_rows]
    cols = t.column_names
    cells = [[_cell(r[c]) for c in cols] for r in shown]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    more = len(rows) - len(shown)
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{f', {more} not shown' if more else ''})")
    return "\n".join(out)


def write_result(t: pa.Table, fmt: str, output: str | None, flag: str = "--output") -> None:
    out = _output_path(output, fmt, flag)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        _write_file(out, lambda p: pq.write_table(t, p), flag)
        return
    if fmt == "csv":
        import pyarrow.csv as pcsv

        flat = t
        for i, f in enumerate(t.schema):  # nested columns (lists) are written as JSON text
            if pa.types.is_nested(f.type):
                flat = flat.set_column(i, f.name, pa.array([json.dumps(v, default=str) if v is not None else None
                                                            for v in t.column(i).to_pylist()], pa.string()))
        buf = io.BytesIO()
        pcsv.write_csv(flat, buf)
        text = buf.getvalue().decode()
    elif fmt == "json":
        text = json.dumps(_json_safe(t.to_pylist()), default=str, indent=1, allow_nan=False) + "\n"
    else:
        text = format_table(t) + "\n"
    if out is not None:
        _write_file(out, lambda p: Path(p).write_text(text), flag)
    else:
        sys.stdout.write(text)


# ---- subcommands ------------------------------------------------------------------------------
def cmd_runs(args: argparse.Namespace) -> int:
    _output_path(args.output, args.format)
    store = _open(args.store)
    t = store.runs()
    cols = [c for c in ("run_id", "status", "engine", "engine_version", "dtype", "device", "tp_degree", "release",
                        "n_prompts", "model_path", "committed_at") if c in t.column_names]
    write_result(t.select(cols) if args.format == "table" else t, args.format, args.output)
    if args.format == "table":
        for p in store.pending():
            state = "writing" if p["alive"] else "dead writer, not committed (capturestore gc removes it)"
            print(f"pending {p['run_id']}: pid {p['pid']} on {p['hostname']} since {p['started_at']}: {state}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    info = _open(args.store).show(args.run)
    if args.format == "json":
        sys.stdout.write(json.dumps(_json_safe(info), default=str, indent=1, allow_nan=False) + "\n")
        return 0
    for k, v in info["run"].items():
        print(f"{k:>15}: {printable(str(v))}")
    print()
    caps = pa.Table.from_pylist(info["captures"])
    if caps.num_rows:
        print(format_table(caps.select(["prompt_id", "array_name", "shape", "dtype", "nbytes", "stored_bytes"])))
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    _output_path(args.output, args.format)  # before the query: a bad --output fails at once
    write_result(_open(args.store).sql(args.query), args.format, args.output)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    report = _open(args.store).verify()
    print(report.summary())
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open(args.store)
    if not args.dry_run:
        _require_writable(store, "gc")
    removed = store.gc(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        print(f"{verb} {r}")
    print(f"{verb} {len(removed)} item(s)")
    return 0


def cmd_rebuild_catalog(args: argparse.Namespace) -> int:
    store = _open(args.store)
    _require_writable(store, "rebuild-catalog")
    path = store.rebuild_catalog()
    print(f"rebuilt {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from capturestore.analysis import compare_runs

    store = _open(args.store)
    _require_writable(store, "compare")
    client = None
    if args.scheduler:
        from capturestore.distributed import connect

        client = connect(args.scheduler)
    try:
        result = compare_runs(store, expected_run=args.expected, actual_run=args.actual,
                              baseline_run=args.baseline, label=args.label, kv=not args.no_kv,
                              allow_different_models=args.allow_different_models,
                              comparators=["raw_errors"] if args.raw_errors else (), client=client)
    finally:
        if client is not None:
            client.close()
    print(f"comparison {result.comparison_id} over {len(result.prompt_ids)} prompts")
    for name, verdict in (("logit verdict", result.logit_verdict), ("KV verdict", result.kv_verdict)):
        if verdict is not None:
            print(f"{name}: {verdict.summary()}")
    if args.raw_errors:
        from capturestore.aggregate import raw_errors_storage

        raw, kv = raw_errors_storage(store, result.comparison_id)
        if raw is None:
            print("raw_errors: stored (its size is measured on a local store only)")
        else:
            print(f"raw_errors: {raw / 1e6:.2f} MB stored" + (f" ({raw / kv:.2f} x the stored KV of the compared runs)"
                                                              if kv else ""))
    print(f"overall: {'PASS' if result.passed else 'FAIL'}" + (f" (first failure in {result.phase})" if result.phase else ""))
    return 0 if result.passed else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from capturestore.demo import run_demo

    result = run_demo(store_path=args.store, arch=args.arch, num_tokens=args.num_tokens, seed=args.seed,
                      release=args.release, inject_bug_layer=args.inject_bug_layer)
    return 0 if result.passed else 1


def cmd_run(args: argparse.Namespace) -> int:
    from capturestore import pipeline
    from capturestore.layout import FORMAT_FILE
    from capturestore.store import store_root

    store = args.store
    if (store_root(store) / FORMAT_FILE).exists():  # an existing store must be writable before any capture
        _require_writable(_open(store), "run")
    with _sigterm_as_interrupt():  # a terminated run rolls back like an interrupted one (docs/run.md)
        return _run(args, pipeline, store)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a CI cancel, ``timeout``) raises KeyboardInterrupt while ``run`` works, so it keeps
    its complete references and rolls back the rest instead of dying midway."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(args: argparse.Namespace, pipeline, store: str) -> int:
    kwargs = dict(target=args.target, num_tokens=args.num_tokens, release=args.release, store=store,
                  plugins=args.plugins, modules=args.modules, tp=args.tp, quiet=args.quiet, label=args.label,
                  fp8_scales=args.fp8_scales, from_task=args.from_task, task_reference=args.task_reference,
                  reference_device=args.reference_device, reference_memory=args.reference_memory, dtype=args.dtype,
                  engine_options={"kv_cache_dtype": args.kv_cache_dtype, "fp8_emulate": args.fp8_emulate})
    if args.debug:  # the engines' and libraries' own output as it comes
        result = pipeline.run(args.model, args.prompts, **kwargs)
        return 0 if result.passed else 1
    with _library_output_to_log() as (log, out, tty, bars):
        result = pipeline.run(args.model, args.prompts, out=out, progress_bar=tty, bar_file=bars, **kwargs)
    return 0 if result.passed else 1


@contextlib.contextmanager
def _library_output_to_log():
    """Engine and library output (vLLM's and transformers' log lines, warnings, C++ messages,
    weight-loading bars) into a log file for the duration: the file descriptors 2 (and 1, where
    ``sys.stdout`` is it) point at the log, while ``run``'s own lines go to the original stdout and
    its progress bars to the original stderr. The log
    is kept (named in the error line) when the run fails and writes something there. Yields
    ``(log path, out(line), whether stdout is a terminal, bar stream)``."""
    import tempfile

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM logs to stdout by default
    fd, name = tempfile.mkstemp(prefix="capturestore-run-", suffix=".log")
    redirect = [2]
    try:
        if sys.stdout.fileno() == 1:
            redirect.append(1)
    except (AttributeError, OSError, ValueError):  # a replaced sys.stdout (tests): leave it be
        pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {n: os.dup(n) for n in redirect}
    real_out = os.fdopen(os.dup(saved[1]), "w", buffering=1) if 1 in saved else sys.stdout
    bars = os.fdopen(os.dup(saved[2]), "w", buffering=1)

    def out(line: str) -> None:
        print(line, file=real_out, flush=True)

    failed = None
    try:
        for n in redirect:
            os.dup2(fd, n)
        yield Path(name), out, real_out.isatty(), bars
    except BaseException as e:
        failed = e
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for n, old in saved.items():
            os.dup2(old, n)
            os.close(old)
        os.close(fd)
        bars.close()
        if real_out is not sys.stdout:
            real_out.close()
        if failed is not None and os.path.getsize(name):  # the one error line names where the engine's words went
            failed.capturestore_log = name
        else:
            os.unlink(name)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from nki_fp8.calibration import calibrate_kv_scales, check_out_dir

    check_out_dir(args.out, "--out")
    store = _open(args.store)
    _require_writable(store, "calibrate")
    result = calibrate_kv_scales(store, args.run, method=args.method, percentile=args.percentile,
                                 platform=args.platform, out_dir=args.out)
    if result is not None:
        print(result)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports import check_out_dir, render_comparison, render_diff

    check_out_dir(args.out)  # before opening the store: a bad --out fails at once
    store = _open(args.store)
    if args.diff_base:
        print(render_diff(store, args.diff_base, args.comparison, args.out))
    else:
        print(render_comparison(store, args.comparison, args.out))
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from capturestore.tasks import (
        analyse_tasks,
        parse_thresholds,
        store_task_analysis,
        summary_lines,
    )

    analysis = analyse_tasks(args.results, args.reference, thresholds=parse_thresholds(args.threshold),
                             tolerance=args.tolerance)  # every input check before the store is touched
    store = _open(args.store, create=True)
    _require_writable(store, "tasks")
    store_task_analysis(store, analysis, args.label)
    print("\n".join(summary_lines(analysis)))
    return 0 if analysis.passed else 1


def cmd_eval(args: argparse.Namespace) -> int:
    from capturestore import evaluate
    from capturestore.tasks import parse_thresholds

    kwargs = dict(out=args.out, store=args.store, include_path=args.include_path, limit=args.limit,
                  server=args.server, port=args.port, thresholds=parse_thresholds(args.threshold),
                  reference=args.reference, tolerance=args.tolerance, target=args.target, num_tokens=args.num_tokens,
                  dtype=args.dtype, label=args.label, analyse=not args.eval_only,
                  inject_bug_layer=args.inject_bug_layer, inject_bug_factor=args.inject_bug_factor, quiet=args.quiet)
    with _sigterm_as_interrupt():  # a terminated eval stops its server and rolls back like an interrupted run
        if args.debug:
            result = evaluate.eval(args.model, args.tasks, **kwargs)
        else:
            with _library_output_to_log() as (log, out, tty, bars):
                result = evaluate.eval(args.model, args.tasks, say=out, progress_bar=tty, bar_file=bars, **kwargs)
    return 0 if result.passed else 1


def cmd_aggregate(args: argparse.Namespace) -> int:
    from capturestore.aggregate import aggregate_bc, where_prompts

    _output_path(args.output, args.format)
    if (args.where is None) == (args.sql is None):
        raise ValueError("give exactly one of --where CONDITION and --sql QUERY")
    store = _open(args.store)
    query = args.sql if args.sql is not None else where_prompts(store, args.comparison, args.where)
    result = aggregate_bc(store, args.comparison, query)
    write_result(result.to_table(), args.format, args.output)
    return 0


def write_diff(store, r, fmt: str, out: str | None) -> None:
    """table (stdout), json (``out`` or stdout), html (the reports diff page in directory ``out``)."""
    from capturestore.diff import format_diff, to_json

    if fmt == "html":
        if not out:
            raise ValueError("diff --format html needs --out DIR")
        from reports import render_diff

        print(render_diff(store, r.base_id, r.head_id, out, result=r))
        return
    target = _output_path(out, "json", "--out")
    text = format_diff(r) + "\n" if fmt == "table" else json.dumps(to_json(r.to_dict()), default=str, indent=1,
                                                                     allow_nan=False) + "\n"
    if target is not None:
        _write_file(target, lambda p: Path(p).write_text(text), "--out")
    else:
        sys.stdout.write(text)


def write_history(t: pa.Table, fmt: str, out: str | None) -> None:
    """table / csv / json (``out`` or stdout), html (the reports history page written to file ``out``)."""
    if fmt == "html":
        if not out:
            raise ValueError("history --format html needs --out FILE")
        from reports import history_html

        html = history_html(t)
        target = _output_path(out, "html", "--out")
        _write_file(target, lambda p: Path(p).write_text(html), "--out")
        print(target)
        return
    write_result(t, fmt, out, "--out")


def cmd_diff(args: argparse.Namespace) -> int:
    from capturestore.diff import diff

    store = _open(args.store)
    if _cachecheck_diff_wanted(store, args):
        return _cmd_diff_cachecheck(store, args)
    result = diff(store, args.base, args.head, common_prompts=args.common_prompts, seed=args.seed,
                  n_boot=args.n_boot)
    write_diff(store, result, args.format, args.out)
    return 1 if result.regression else 0


def _cachecheck_diff_wanted(store, args) -> bool:
    from capturestore.cachecheck_diff import is_cachecheck
    from capturestore.diff import comparison_rows

    kinds = [is_cachecheck(store, x) for x in (args.base, args.head)]
    if any(kinds) and not all(kinds):
        other = args.head if kinds[0] else args.base
        if any(other in (r["comparison_id"], r["release"]) for r in comparison_rows(store)):
            raise ValueError(f"diff: {other!r} is a comparison of runs and the other a cache check; diff a cache "
                             "check against another cache check")
    return any(kinds)


def _cmd_diff_cachecheck(store, args) -> int:
    """``diff`` of two cache checks (capturestore.cachecheck_diff): exit 1 on a regression."""

    from capturestore.cachecheck_diff import (
        diff_cachecheck,
        format_cachecheck_diff,
        to_dict,
    )

    d = diff_cachecheck(store, args.base, args.head)
    if args.format == "html":
        raise ValueError("diff: --format html is for comparisons of runs; a cache-check diff is table or json")
    text = json.dumps(to_dict(d), indent=1, default=str) if args.format == "json" else format_cachecheck_diff(d)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 1 if d.regression else 0


def cmd_history(args: argparse.Namespace) -> int:
    from capturestore.diff import history

    store = _open(args.store)
    write_history(history(store, args.model, args.metric), args.format, args.out)
    return 0


def _engine_options(items) -> dict:
    """``KEY=VALUE`` pairs of ``--engine-option``: integers, on/off/true/false, none, else text."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"cachecheck: --engine-option {item!r} is not KEY=VALUE")
        low = value.lower()
        out[key.replace("-", "_")] = (int(value) if value.lstrip("-").isdigit() else True if low in ("on", "true")
                                      else False if low in ("off", "false") else None if low == "none" else value)
    return out


def cmd_cachecheck(args: argparse.Namespace) -> int:
    from capturestore.cachecheck import cachecheck, validate_inputs

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else None
    bugs = tuple(b.strip() for b in args.bug.split(",") if b.strip()) if args.bug else ()
    validate_inputs(args.model, args.engine, args.dtype, scenarios, bugs)  # before the store is created
    options = _engine_options(args.engine_option)
    store = _open(args.store, create=True)
    _require_writable(store, "cachecheck")
    result = cachecheck(args.model, engine=args.engine, dtype=args.dtype, store=store, scenarios=scenarios,
                        label=args.label, seed=args.seed, max_context=args.max_context, block_size=args.block_size,
                        bugs=bugs, hf_reference=args.hf_reference, engine_options=options,
                        progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    print(f"cache check {result.comparison_id}: engine {result.engine} on {args.model}")
    print(result.summary())
    return 0 if result.passed else 1

def cmd_isolate(args: argparse.Namespace) -> int:
    from capturestore.isolate import isolate

    store = _open(args.store)
    _require_writable(store, "isolate")
    r = isolate(store, args.comparison, rebuild=args.rebuild, max_prompts=args.max_prompts,
                even_if_passed=args.even_if_passed, progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    if r.comparison_id is not None:
        print(f"isolation {r.comparison_id} of comparison {r.source}")
    print(r.summary())
    if r.localisation is not None:
        loc = r.localisation
        print(f"localisation (local): phase {loc['phase']}, layer {loc['layer']}, module {loc['module']}, "
              f"token {loc['token']}")
    return 1 if r.status == "not_local" else 0


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (the usage itself is in --help), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="capturestore", description="Inspect and query a capture store.")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--store", default=default_store(),
                        help="store directory (default: $CAPTURESTORE or ./capturestore-store)")
        sp.add_argument("--debug", action="store_true", help="on an error, also print the Python traceback")
        sp.set_defaults(func=func)
        return sp

    sp = add("runs", cmd_runs, "list committed runs")
    sp.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    sp.add_argument("--output", help="write to this file instead of stdout")
    sp = add("show", cmd_show, "show one run: metadata and the arrays of each prompt")
    sp.add_argument("run")
    sp.add_argument("--format", choices=["table", "json"], default="table")
    sp = add("sql", cmd_sql, "run SQL over the catalog views (runs, prompts, captures, metric tables)")
    sp.add_argument("query")
    sp.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    sp.add_argument("--output", help="write to this file instead of stdout (required for parquet)")
    add("verify", cmd_verify, "check every chunk's checksum and catalog-vs-array consistency")
    sp = add("gc", cmd_gc, "remove arrays and segments left by writers that died")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed")
    add("rebuild-catalog", cmd_rebuild_catalog, "rebuild catalog.duckdb from the Parquet segments alone")
    sp = add("compare", cmd_compare, "compare stored runs (two-way, or three-way with --baseline) and store the metrics")
    sp.add_argument("--expected", required=True, help="reference run in the engine's dtype (e.g. HF BF16)")
    sp.add_argument("--actual", required=True, help="run of the engine under test")
    sp.add_argument("--baseline", help="ground-truth run (HF FP32): enables three-way mode")
    sp.add_argument("--label", help="free-form label stored with the comparison")
    sp.add_argument("--no-kv", action="store_true", help="compare logits only")
    sp.add_argument("--allow-different-models", action="store_true",
                    help="compare runs whose model_hash differ (refused otherwise; recorded as models_differ)")
    sp.add_argument("--raw-errors", action="store_true",
                    help="also store the KV raw errors (three-way) that `capturestore aggregate` reads")
    sp.add_argument("--scheduler", metavar="ADDRESS",
                    help="run the per-prompt work on this Dask scheduler's workers (tcp://HOST:PORT; docs/scale.md)")
    sp = add("isolate", cmd_isolate, "from a failing comparison, the first module whose local error (on the expected "
             "reference's inputs) exceeds BF16 noise; stored as a comparison of its own (docs/isolate.md)")
    sp.add_argument("comparison", help="the failing comparison's id")
    sp.add_argument("--rebuild", action="store_true", help="re-run the target rebuilt from the actual run's checkpoint "
                    "even though it was captured from a model passed in (a patched engine the checkpoint lacks)")
    sp.add_argument("--max-prompts", type=int, help="judge the first N prompts only")
    sp.add_argument("--even-if-passed", action="store_true", help="judge every module locally even when the "
                    "comparison passed (a small fault late in the model can pass every in-place verdict)")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    from capturestore.reduce import add_arguments as add_reduce_arguments

    add_reduce_arguments(add)  # reduce, reproduce (capturestore/reduce.py)
    sp = add("run", cmd_run, "the main job on your model: HF FP32 + expected references (reused when stored), the "
             "target teacher-forced, the plugins' comparison, verdict and localisation (docs/run.md)")
    sp.add_argument("--model", required=True, help="Hugging Face model directory (config.json + weights)")
    src = sp.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help=".txt (one prompt per line) or .jsonl "
                     "({\"prompt\": ...} or {\"token_ids\": [...]}, optional \"id\")")
    src.add_argument("--from-task", metavar="DIR", help="an lm-eval output directory: analyse its deviated samples' "
                     "prompts (capturestore tasks)")
    sp.add_argument("--task-reference", metavar="DIR", help="the reference lm-eval output directory of --from-task")
    sp.add_argument("--target", default="vllm", help="vllm | vllm-server=URL | hf:bfloat16 | hf:float16 | hf-fp8-kv "
                    "| an installed plugin target (entry-point group capturestore.targets; default vllm)")
    sp.add_argument("--dtype", help="the target's dtype where it takes one: vllm bfloat16 (default) | float16 | "
                    "float32 (FP32 is judged against the BF16 noise; docs/run.md)")
    sp.add_argument("--num-tokens", type=int, default=8, help="teacher tokens per prompt (default 8)")
    sp.add_argument("--release", help="release label of the target run")
    sp.add_argument("--plugins", help="comma-separated: logits, kv, modules, fp8-kv or a registered plugin "
                    "(default per target: vllm and hf logits,kv; vllm-server logits; hf-fp8-kv fp8-kv)")
    sp.add_argument("--modules", help="module patterns for the modules plugin, comma-separated "
                    "(default model.layers.*.self_attn,model.layers.*.mlp,model.layers.*,model.norm)")
    sp.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the vllm target")
    sp.add_argument("--reference-device", default="cpu", metavar="DEVICE",
                    help="where the HF references run: cpu or cuda[:N] (FP32 without TF32; default cpu)")
    sp.add_argument("--reference-memory", type=float, metavar="GiB",
                    help="memory budget of the HF references (default: the device's available memory); weights "
                    "that do not fit are streamed layer by layer, bit-identically (docs/references.md)")
    sp.add_argument("--label", help="label stored with the comparison")
    sp.add_argument("--fp8-scales", metavar="PATH", help="KV scales (checkpoint dir or .safetensors) of the "
                    "hf-fp8-kv target (default: absmax calibration on the expected run), or of the vllm target's "
                    "--kv-cache-dtype fp8 (default: vLLM's 1.0)")
    sp.add_argument("--kv-cache-dtype", default="auto", help="vllm target's KV cache: auto | fp8 | fp8_e4m3 | "
                    "fp8_e5m2; FP8 is judged against an FP8-aware expected run (docs/fp8.md)")
    sp.add_argument("--fp8-emulate", action="store_true", help="FP8 KV cache on a CPU without AVX-512/AMX: a BF16 "
                    "cache whose writes capturestore rounds through FP8 (not vLLM's FP8 kernels)")
    sp.add_argument("--quiet", action="store_true", help="no progress; print the verdict only")
    sp = add("demo", cmd_demo, "tiny local model: HF FP32 + BF16 references vs vLLM-CPU BF16, three-way verdict")
    sp.set_defaults(store=os.environ.get("CAPTURESTORE") or "demo-store")
    sp.add_argument("--arch", default="llama-gqa", help="tiny model architecture (llama-mha, llama-gqa, ...)")
    sp.add_argument("--num-tokens", type=int, default=8, help="teacher-forced tokens per prompt")
    sp.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    sp.add_argument("--release", help="release label recorded on the runs")
    sp.add_argument("--inject-bug-layer", type=int, default=None, metavar="L",
                    help="scale layer L's attention output by 1.1 inside vLLM, to watch the verdict fail")
    sp = add("calibrate", cmd_calibrate, "calibrate FP8 KV cache scales from a run's KV captures")
    sp.add_argument("run")
    sp.add_argument("--out", required=True, help="output directory for the scales")
    sp.add_argument("--method", choices=["absmax", "percentile"], default="absmax")
    sp.add_argument("--percentile", type=float, default=99.99, help="for --method percentile (default 99.99)")
    sp.add_argument("--platform", choices=["trn2", "trn3"], default=None,
                    help="FP8 clamp of the target (default: $NKI_FP8_PLATFORM or trn2)")
    sp = add("report", cmd_report, "write the HTML report of a comparison (offline, from store queries alone)")
    sp.add_argument("comparison", help="comparison id (capturestore sql \"SELECT comparison_id FROM comparisons\")")
    sp.add_argument("--out", required=True, help="output directory (created; its index.html is printed)")
    sp.add_argument("--diff-base", metavar="COMPARISON",
                    help="write diff.html: COMPARISON (the base) against the positional one (the head)")
    sp = add("tasks", cmd_tasks, "lm-eval task analysis: scores vs thresholds or a reference run, deviated prompts")
    sp.add_argument("--results", required=True, help="lm-eval --output_path directory of the target")
    sp.add_argument("--reference", help="lm-eval --output_path directory of the reference (pairs tasks and samples)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--threshold", action="append", metavar="METRIC=VALUE",
                   help="minimum score, e.g. acc=0.5 or 'exact_match,strict-match=0.4' (repeatable)")
    g.add_argument("--tolerance", choices=["mean", "std"],
                   help="with --reference: no worse than its score (mean) or than it minus 2 standard errors (std, "
                        "the default)")
    sp.add_argument("--label", help="free-form label stored with the analysis")
    sp = add("eval", cmd_eval, "Level 1 in one command: lm-eval tasks on a served vLLM engine, scores vs thresholds, "
             "the deviated prompts analysed (run --from-task), one report (docs/eval.md)")
    sp.add_argument("--model", required=True, help="Hugging Face model directory (config.json + weights)")
    sp.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    sp.add_argument("--out", required=True, metavar="DIR", help="the evaluation's directory: lm-eval output "
                    "(eval_results/), eval.json (what was done: a second eval resumes), report/")
    sp.add_argument("--include-path", metavar="DIR", help="a directory of local lm-eval task YAML files")
    sp.add_argument("--limit", type=int, help="docs per task")
    sp.add_argument("--server", metavar="URL", help="a running vllm serve of the model (default: start one)")
    sp.add_argument("--port", type=int, help="port of the server eval starts on 127.0.0.1 (default: a free one)")
    sp.add_argument("--dtype", default="bfloat16", help="dtype of the server eval starts (default bfloat16)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--threshold", action="append", metavar="METRIC=VALUE", help="minimum score (repeatable)")
    g.add_argument("--tolerance", choices=["mean", "std"], help="with --reference: mean or std (the default)")
    sp.add_argument("--reference", metavar="DIR", help="lm-eval output directory of a reference run of the tasks")
    sp.add_argument("--target", default="vllm", help="target of the prompt analysis (capturestore run; default vllm)")
    sp.add_argument("--num-tokens", type=int, default=8, help="teacher tokens per analysed prompt (default 8)")
    sp.add_argument("--label", help="label stored with the task analysis and the comparison")
    sp.add_argument("--eval-only", action="store_true", help="stop after the evaluation and the task analysis "
                    "(nothing stored; e.g. a reference run)")
    sp.add_argument("--inject-bug-layer", type=int, metavar="L", help="degrade the engine on purpose: layer L's "
                    "attention output scaled (served and analysed engine), each proven to change the output")
    sp.add_argument("--inject-bug-factor", type=float, default=1.1, help="factor of --inject-bug-layer (default 1.1)")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp = add("aggregate", cmd_aggregate, "cross-prompt KV BC per generation token x layer over a SQL selection of "
                                         "a comparison's prompts (from its stored raw errors)")
    sp.add_argument("comparison", help="comparison id (stored with --raw-errors)")
    sp.add_argument("--where", help="condition on the prompts view, e.g. \"n_tokens > 512\"")
    sp.add_argument("--sql", help="a query returning prompt_id (instead of --where)")
    sp.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    sp.add_argument("--output", help="write to this file instead of stdout (required for parquet)")
    sp = add("diff", cmd_diff, "diff two comparisons (ids or release labels); exit status 1 on a regression")
    sp.add_argument("base", help="comparison id or release label of the base (the older release)")
    sp.add_argument("head", help="comparison id or release label of the head (under review)")
    sp.add_argument("--format", choices=["table", "json", "html"], default="table")
    sp.add_argument("--out", help="json: file (default stdout); html: output directory (required)")
    sp.add_argument("--common-prompts", action="store_true",
                    help="compare the prompts both comparisons share when their prompt sets differ")
    sp.add_argument("--seed", type=int, default=0, help="seed of the bootstrap over prompts (default 0)")
    sp.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    sp = add("history", cmd_history, "one metric across releases for one model: table, or a Plotly chart (html)")
    sp.add_argument("--model", required=True, help="model path or model_hash of the actual runs")
    sp.add_argument("--metric", default="logit_sigma_ratio",
                    help="a comparisons column (logit_sigma_ratio, passed, ...) or kv_sigma_ratio / kv_bc "
                         "(worst layer)")
    sp.add_argument("--format", choices=["table", "json", "html"], default="table")
    sp.add_argument("--out", help="html: the file to write (required); json: file (default stdout)")
    sp = add("cachecheck", cmd_cachecheck, "prove an engine's KV cache equivalent to its full-prefix recomputation over a "
             "scenario matrix (docs/cachecheck.md); exit status 1 unless every scenario ran and passed")
    sp.add_argument("--model", required=True, help="model directory (config.json + weights)")
    sp.add_argument("--engine", default="hf", help="hf | paged (the reference paged engine) | vllm (in-process) | "
                    "package.module:Class (your own adapter; default hf)")
    sp.add_argument("--engine-option", action="append", metavar="KEY=VALUE",
                    help="a keyword of the engine's adapter, repeatable (vllm: prefix_caching=on|off, chunk=N, "
                         "num_blocks=N)")
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sp.add_argument("--scenarios", help="comma-separated scenario names (default all: single, offset, batch_2, ...)")
    sp.add_argument("--max-context", type=int, help="context of the engine (default: the model's, 128 for paged)")
    sp.add_argument("--block-size", type=int, help="block size of a paged engine")
    sp.add_argument("--bug", help="plant these bugs in the paged engine (comma-separated; extractors.cache_engine.BUGS)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    sp.add_argument("--hf-reference", action="store_true", help="also check the engine's full-prefix forward "
                    "against HF's plain forward of the model (scenario oracle: the second oracle)")
    sp.add_argument("--label", help="label stored with the check")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause and fix: bad input, store problems, files that cannot be read or written."""
    from capturestore.errors import StoreError
    from capturestore.pipeline import EngineStartError

    errors: tuple[type[BaseException], ...] = (StoreError, ValueError, OSError, EngineStartError)
    if "duckdb" in sys.modules:  # a DuckDB file the user pointed at (catalog, output) cannot be opened
        import duckdb

        errors += (duckdb.IOException, duckdb.PermissionException)
    return errors


def error_line(e: BaseException) -> str:
    """The one line a user error is reported in."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        msg = f"{e.strerror}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    else:
        msg = str(e) or type(e).__name__
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.store.strip():
            raise ValueError("--store is empty; give the store directory (--store PATH or $CAPTURESTORE)")
        return args.func(args)
    except KeyboardInterrupt:
        print(f"capturestore {args.command}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if args.debug:
            traceback.print_exc()
        log = getattr(e, "capturestore_log", None)
        print(f"capturestore {args.command}: error: {error_line(e)}"
              + (f" (engine and library output: {log})" if log else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
