"""The ``capturestore`` subcommands: each parses its arguments, calls the library and formats."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

import pyarrow as pa

from capturestore.cli.output import (
    format_table,
    json_text,
    output_path,
    printable,
    write_result,
    write_text,
)
from capturestore.store import open_store_path as open_store
from capturestore.store import require_writable


# ---- subcommands ------------------------------------------------------------------------------
def cmd_runs(args: argparse.Namespace) -> int:
    output_path(args.output, args.format)
    store = open_store(args.store)
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
    info = open_store(args.store).show(args.run)
    if args.format == "json":
        sys.stdout.write(json_text(info))
        return 0
    for k, v in info["run"].items():
        print(f"{k:>15}: {printable(str(v))}")
    print()
    caps = pa.Table.from_pylist(info["captures"])
    if caps.num_rows:
        print(format_table(caps.select(["prompt_id", "array_name", "shape", "dtype", "nbytes", "stored_bytes"])))
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    output_path(args.output, args.format)  # before the query: a bad --output fails at once
    write_result(open_store(args.store).sql(args.query), args.format, args.output)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    report = open_store(args.store).verify()
    print(report.summary())
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    if not args.dry_run:
        require_writable(store, "gc")
    removed = store.gc(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        print(f"{verb} {r}")
    print(f"{verb} {len(removed)} item(s)")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    result = store.compact(tables=args.table, grace_s=args.grace)
    rows = [{"table": t.table, "segments_before": t.segments_before, "segments_after": t.segments_after,
             "rows_merged": t.rows, "bytes_before": t.bytes_before, "bytes_after": t.bytes_after,
             "sources_removed": len(t.sources_removed), "merged": t.merged or "",
             "merged_again": len(t.remerged),
             "left": "; ".join(t.skipped)} for t in result.tables]
    if rows:
        print(format_table(pa.Table.from_pylist(rows)))
    print(f"merged {result.rows} row(s) in {sum(1 for t in result.tables if t.merged)} table(s)")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    before, after = store.upgrade_format()
    if before == after:
        print(f"store {store.root} is format {after}: nothing to do")
    else:
        now = (["runs written from now on store each chunk as a file beside its array's zarr.json (\".\" chunk "
                "keys; the runs already there keep their \"/\" keys and read as before)"] if before < 4 else []) + \
              (["compactions from now on name each column list once in their footers (merged segments already "
                "there read as before)"] if before < 5 else []) + \
              (["module captures from now on write a prompt's module tensors of one phase and shape as one array "
                "(tensor_groups/; the module runs already there keep an array per module and read as before)"]
               if before < 6 else []) + \
              ["compactions from now on check and record each source's rows by the binary row hash alone where "
               "it has one, not the JSON one too (merged segments already there keep both and read as before)"]
        print(f"store {store.root}: format {before} -> {after}; {'; '.join(now)}; a capturestore older than format "
              f"{after} no longer opens this store")
    return 0


def cmd_rebuild_catalog(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    require_writable(store, "rebuild-catalog")
    path = store.rebuild_catalog()
    print(f"rebuilt {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from capturestore.analysis import compare

    r = compare(args.store, args.expected, args.actual, args.baseline, label=args.label, kv=not args.no_kv,
                allow_different_models=args.allow_different_models, raw_errors=args.raw_errors,
                scheduler=args.scheduler)
    result = r.comparison
    print(f"comparison {result.comparison_id} over {len(result.prompt_ids)} prompts")
    for name, verdict in (("logit verdict", result.logit_verdict), ("KV verdict", result.kv_verdict)):
        if verdict is not None:
            print(f"{name}: {verdict.summary()}")
    if args.raw_errors:
        raw, kv = r.raw_errors_bytes, r.kv_bytes
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
                      release=args.release, inject_bug_layer=args.inject_bug_layer, out=print)
    return 0 if result.passed else 1


def cmd_run(args: argparse.Namespace) -> int:
    from capturestore.pipeline import run

    kwargs = dict(target=args.target, num_tokens=args.num_tokens, release=args.release, store=args.store,
                  plugins=args.plugins, modules=args.modules, tp=args.tp, quiet=args.quiet, label=args.label,
                  fp8_scales=args.fp8_scales, from_task=args.from_task, task_reference=args.task_reference,
                  reference_device=args.reference_device, reference_memory=args.reference_memory, dtype=args.dtype,
                  module_inputs=args.module_inputs,
                  engine_options={"kv_cache_dtype": args.kv_cache_dtype, "fp8_emulate": args.fp8_emulate})
    with _sigterm_as_interrupt():  # a terminated run rolls back like an interrupted one (docs/run.md)
        if args.debug:  # the engines' and libraries' own output as it comes
            result = run(args.model, args.prompts, out=print, **kwargs)
        else:
            with _library_output_to_log() as (log, out, tty, bars):
                result = run(args.model, args.prompts, out=out, progress_bar=tty, bar_file=bars, **kwargs)
    return 0 if result.passed else 1


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
    from nki_fp8.calibration import calibrate

    print(calibrate(args.store, args.run, args.out, method=args.method, percentile=args.percentile,
                    platform=args.platform))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports import report

    print(report(args.store, args.comparison, args.out, diff_base=args.diff_base))
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from capturestore.tasks import tasks

    analysis = tasks(args.store, args.results, args.reference, thresholds=parse_thresholds(args.threshold),
                     tolerance=args.tolerance, label=args.label)
    print("\n".join(analysis.summary_lines()))
    return 0 if analysis.passed else 1


def parse_thresholds(specs) -> dict[str, float]:
    """``["acc=0.5", "exact_match,strict-match=0.4"]`` -> {metric: value}; one-line ValueError."""
    out = {}
    for s in specs or ():
        metric, eq, value = str(s).rpartition("=")
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if not eq or not metric.strip() or not math.isfinite(v):
            raise ValueError(f"--threshold {s!r}: expected METRIC=VALUE with a finite number, e.g. acc=0.5 or "
                             f"'exact_match,strict-match=0.4'")
        out[metric.strip()] = v
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from capturestore import evaluate

    kwargs = dict(out=args.out, store=args.store, include_path=args.include_path, limit=args.limit,
                  server=args.server, port=args.port, thresholds=parse_thresholds(args.threshold),
                  reference=args.reference, tolerance=args.tolerance, target=args.target, num_tokens=args.num_tokens,
                  dtype=args.dtype, label=args.label, analyse=not args.eval_only,
                  inject_bug_layer=args.inject_bug_layer, inject_bug_factor=args.inject_bug_factor, quiet=args.quiet)
    with _sigterm_as_interrupt():  # a terminated eval stops its server and rolls back like an interrupted run
        if args.debug:
            result = evaluate.eval(args.model, args.tasks, say=print, **kwargs)
        else:
            with _library_output_to_log() as (log, out, tty, bars):
                result = evaluate.eval(args.model, args.tasks, say=out, progress_bar=tty, bar_file=bars, **kwargs)
    return 0 if result.passed else 1


def cmd_aggregate(args: argparse.Namespace) -> int:
    from capturestore.aggregate import aggregate

    output_path(args.output, args.format)
    result = aggregate(args.store, args.comparison, where=args.where, sql=args.sql)
    write_result(result.to_table(), args.format, args.output)
    return 0


def format_diff(r) -> str:
    """A ``capturestore.diff.DiffResult`` as text: the verdict, what changed, where."""
    import math

    from capturestore.diff import BC_MARGIN, CI_LEVEL

    lines = [f"diff {r.base_id} (base) -> {r.head_id} (head): {len(r.prompt_ids)} prompts, model {r.model_hash}"]
    if r.note:
        lines.append(f"note: {r.note}")
    where = ", ".join(f"{k} {v}" for k, v in (r.localisation or {}).items() if v is not None)
    lines.append(("REGRESSION" + (f" at {where}" if where else "")) if r.regression else "no regression")
    if r.verdict_changes:
        lines += ["", "verdict changes:"]
        for c in r.verdict_changes:
            where = ", ".join(f"{k} {getattr(c, k)}" for k in ("layer", "module", "phase") if getattr(c, k) is not None)
            lines.append(f"  {'REGRESSION ' if c.regression else ''}{c.check}{f' ({where})' if where else ''}: "
                         f"{c.base} -> {c.head}")
    if r.stat_changes:
        lines += ["", f"σ-ratio and aggregate BC changes (head - base, {int(CI_LEVEL * 100)}% bootstrap interval "
                      f"over prompts, "
                      f"seed {r.seed}, {r.n_boot} resamples; regression: a σ-ratio interval above +{r.margin}, "
                      f"an aggregate-BC interval below -{BC_MARGIN}):"]
        hdr = f"  {'metric':<19}{'layer/module':<34}{'kv':<3}{'phase':<8}{'base':>9}{'head':>9}{'delta':>9}  interval"
        lines.append(hdr)
        def rank(c):
            return not c.regression, -abs(c.delta) if math.isfinite(c.delta) else 0.0

        for c in sorted(r.stat_changes, key=rank):
            where = c.module or c.layer or ""
            lines.append(f"  {c.metric:<19}{where[-33:]:<34}{c.kv or '':<3}{c.phase or '':<8}{c.base:>9.4g}"
                         f"{c.head:>9.4g}{c.delta:>+9.4g}  [{c.ci_low:+.4g}, {c.ci_high:+.4g}]"
                         f"{'  REGRESSION' if c.regression else ''}")
    if r.divergences:
        lines += ["", "divergences (per prompt, generation tokens):"]
        lines += [f"  {d['prompt_id']}: new {d['new']}, resolved {d['resolved']}" for d in r.divergences]
    return "\n".join(lines)


def write_diff(store, r, fmt: str, out: str | None) -> None:
    """table (stdout), json (``out`` or stdout), html (the reports diff page in directory ``out``)."""
    if fmt == "html":
        if not out:
            raise ValueError("diff --format html needs --out DIR")
        from reports import render_diff

        print(render_diff(store, r.base_id, r.head_id, out, result=r))
        return
    target = output_path(out, "json", "--out")
    write_text(format_diff(r) + "\n" if fmt == "table" else json_text(r.to_dict()), target, "--out")


def write_history(t: pa.Table, fmt: str, out: str | None) -> None:
    """table / csv / json (``out`` or stdout), html (the reports history page written to file ``out``)."""
    if fmt == "html":
        if not out:
            raise ValueError("history --format html needs --out FILE")
        from reports import history_html

        html = history_html(t)
        target = output_path(out, "html", "--out")
        write_text(html, target, "--out")
        print(target)
        return
    write_result(t, fmt, out, "--out")


def cmd_diff(args: argparse.Namespace) -> int:
    from capturestore.cachecheck_diff import CacheCheckDiff
    from capturestore.diff import diff

    result = diff(args.store, args.base, args.head, common_prompts=args.common_prompts, seed=args.seed,
                  n_boot=args.n_boot)
    if isinstance(result, CacheCheckDiff):  # two cache checks
        if args.format == "html":
            raise ValueError("diff: --format html is for comparisons of runs; a cache-check diff is table or json")
        target = output_path(args.out, "json", "--out")
        write_text(json_text(result.to_dict()) if args.format == "json" else format_cachecheck_diff(result) + "\n",
                   target, "--out")
    else:
        write_diff(args.store, result, args.format, args.out)
    return 1 if result.regression else 0


def _sci(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2e}"


def _first(t) -> str:
    return "-" if t is None else f"{t[0]}@{t[1]}"


def format_cachecheck_diff(d) -> str:
    """A ``capturestore.cachecheck_diff.CacheCheckDiff`` as a text table, regressions first, then a verdict line."""
    head = (f"cache check diff: base {d.base['comparison_id']} ({d.base['engine']}, {d.base['verdict']}) -> "
            f"head {d.head['comparison_id']} ({d.head['engine']}, {d.head['verdict']})")
    rows = [("scenario", "change", "base", "head", "first diff base", "first diff head", "max err base", "max err head",
             "diagnosis head")]
    order = {"regressed": 0, "still failing": 1, "fixed": 2, "new": 3, "unchanged": 4}
    for s in sorted(d.scenarios, key=lambda s: (not s.regression, order[s.change])):
        change = s.change if not (s.requests_regressed and s.change != "regressed") else f"{s.change} (requests regressed)"
        rows.append((s.scenario, change, s.base_status or "missing", s.head_status or "missing", _first(s.base_first),
                     _first(s.head_first), _sci(s.base_err), _sci(s.head_err), s.head_diagnosis or "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [head, *("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)]
    for s in d.regressions:
        if s.requests_regressed:
            lines.append(f"  {s.scenario}: requests passing in base, failing in head: {', '.join(s.requests_regressed)}")
    n = len(d.regressions)
    lines.append(f"verdict: {'REGRESSION' if n else 'no regression'} ({n} scenario(s) regressed, "
                 f"{sum(s.change == 'fixed' for s in d.scenarios)} fixed)")
    return "\n".join(lines)


def cmd_history(args: argparse.Namespace) -> int:
    from capturestore.diff import history

    write_history(history(args.store, args.model, args.metric), args.format, args.out)
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
    from capturestore.cachecheck import cachecheck

    # "--scenarios ," names none: refused (an empty list), never read as every scenario
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios is not None else None
    bugs = tuple(b.strip() for b in args.bug.split(",") if b.strip()) if args.bug else ()
    options = _engine_options(args.engine_option)  # the inputs, then the store, are checked before anything runs
    result = cachecheck(args.model, engine=args.engine, dtype=args.dtype, store=args.store, scenarios=scenarios,
                        label=args.label, seed=args.seed, max_context=args.max_context, block_size=args.block_size,
                        bugs=bugs, hf_reference=args.hf_reference, engine_options=options,
                        progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    print(f"cache check {result.comparison_id}: engine {result.engine} on {args.model}")
    print(result.summary())
    return 0 if result.passed else 1

def _print_level3(r) -> int:
    """Level 3: one table per module kind (its local verdicts), then one line per kind."""
    from capturestore.isolate import LEVEL3_KINDS

    cols = ["module", "phase", "layer", "passed", "flagged", "sigma_ratio", "bc", "bc_threshold", "linf_ratio",
            "failing_inside"]
    for kind in LEVEL3_KINDS:
        rows = r.level3.get(kind, ())
        print(f"\nlevel3_{kind} ({len(rows)} module-phase(s)"
              + (f"; not checked: {r.unchecked[kind]}" if kind in r.unchecked else "") + ")")
        if rows:
            cells = [[_cell(x.get(c)) for c in cols] for x in rows]
            w = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
            print("  ".join(c.ljust(w[i]) for i, c in enumerate(cols)))
            for row in cells:
                print("  ".join(v.ljust(w[i]) for i, v in enumerate(row)))
    print()
    for line in r.level3_summary():
        print(line)
    ok = r.level3_passed()
    print(f"level 3 (modules on the expected reference's inputs): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _stderr_progress(args):
    return None if args.quiet else (lambda m: print(m, file=sys.stderr))


def cmd_reduce(args: argparse.Namespace) -> int:
    from capturestore.reduce import reduce

    r = reduce(args.store, args.comparison, args.engine, args.out, correct=args.correct, local=args.local,
               progress=_stderr_progress(args))
    print(r.summary())
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from capturestore.reduce import reproduce

    code, text = reproduce(args.bundle, args.engine, progress=_stderr_progress(args))
    print(text)
    return code


def cmd_isolate(args: argparse.Namespace) -> int:
    from capturestore.isolate import isolate

    r = isolate(args.store, args.comparison, rebuild=args.rebuild, max_prompts=args.max_prompts,
                even_if_passed=args.even_if_passed, level3=args.level3, snapshot=True if args.snapshot else None,
                progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    if r.comparison_id is not None:
        how = "input snapshot (the target not re-run)" if r.method == "snapshot" else "the target re-run"
        print(f"isolation {r.comparison_id} of comparison {r.source}: {how}")
    if r.level3 is not None:
        return _print_level3(r)
    print(r.summary())
    if r.localisation is not None:
        loc = r.localisation
        print(f"localisation (local, {r.method}): phase {loc['phase']}, layer {loc['layer']}, module {loc['module']}, "
              f"token {loc['token']}")
    return 1 if r.status == "not_local" else 0
