"""``capturestore`` command line: each subcommand is a thin wrapper over one Store method.

    capturestore runs                      Store.runs()
    capturestore show RUN                  Store.show(RUN)
    capturestore sql "SELECT ..."          Store.sql(...)   --format table|csv|json|parquet
    capturestore verify                    Store.verify()   exit status 1 on problems
    capturestore gc                        Store.gc()
    capturestore rebuild-catalog           Store.rebuild_catalog()
    capturestore compare --expected RUN --actual RUN [--baseline RUN]
                                           capturestore.analysis.compare_runs(...)
    capturestore demo                      capturestore.demo.run_demo(...)  exit status 1 on FAIL
    capturestore calibrate RUN --out DIR   nki_fp8.calibration.calibrate_kv_scales(...)
    capturestore report COMPARISON --out DIR
                                           reports.render_comparison(...)

Every command takes ``--store PATH`` (default: $CAPTURESTORE, else ./capturestore-store).

Errors: a user error (bad input, a refused or failing query, a missing or read-only store, a
path that cannot be written) is one line on stderr, ``capturestore CMD: error: ...``, exit
status 2, and nothing is left half-written: commands that write check first that they can.
``--debug`` adds the Python traceback. Any other exception is a bug in capturestore and
propagates with its traceback (exit status 1).
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa

DEFAULT_STORE = "capturestore-store"


def default_store() -> str:
    return os.environ.get("CAPTURESTORE") or DEFAULT_STORE  # an empty $CAPTURESTORE counts as unset


def _open(path: str, create: bool = False):
    from capturestore.errors import StoreError
    from capturestore.layout import FORMAT_FILE
    from capturestore.objectstore import is_url
    from capturestore.store import Store, store_root

    if is_url(path):  # s3://bucket/prefix: Store.open says what is wrong in one line
        return Store.open(path, create=create)
    root = store_root(path.removeprefix("file://"))
    if not create and not (root / FORMAT_FILE).exists():
        raise StoreError(f"{root} is not a capture store (no {FORMAT_FILE}); name an existing store with "
                         f"--store PATH or $CAPTURESTORE (`capturestore demo --store PATH` makes one)")
    return Store.open(root, create=create)


def _require_writable(store, command: str) -> None:
    """Refuse before any work when the store cannot be written (a read-only mount, a directory
    without write permission): the command would otherwise fail at its first write, midway."""
    from capturestore.errors import StoreError
    from capturestore.layout import ARRAYS_DIR, PENDING_DIR, TABLES_DIR

    if not isinstance(store.root, Path):  # object storage: a refused PUT says so at the first write
        return
    tables = store.root / TABLES_DIR
    dirs = [store.root, tables, store.root / PENDING_DIR, store.root / ARRAYS_DIR]
    dirs += sorted(p for p in tables.iterdir() if p.is_dir()) if tables.is_dir() else []
    for d in dirs:
        if d.exists() and not os.access(d, os.W_OK | os.X_OK):
            raise StoreError(f"store {store.root} is not writable ({d}: {_why_unwritable(d)}); "
                             f"`capturestore {command}` writes to the store")


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


def _output_path(output: str | None, fmt: str) -> Path | None:
    """``--output`` checked before any work: a writable file path (None: stdout)."""
    if fmt == "parquet" and not output:
        raise ValueError("--format parquet needs --output FILE")
    if output is None:
        return None
    if not output.strip():
        raise ValueError("--output is empty; give a file path")
    from capturestore.store import expand_path

    out = expand_path(output, "--output")
    if out.is_dir():
        raise ValueError(f"--output {output} is a directory; give a file path")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"--output {output}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output {output}: directory {parent} is not writable ({_why_unwritable(parent)})")
    return out


def _write_file(out: Path, write: Callable[[str], None]) -> None:
    """``write(path)`` into a temporary file next to ``out``, renamed into place: never half a file."""
    tmp = out.absolute().parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        write(str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


# ---- output formatting ------------------------------------------------------------------------
def _cell(v: Any, width: int = 40) -> str:
    s = "NULL" if v is None else (json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v))
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


def write_result(t: pa.Table, fmt: str, output: str | None) -> None:
    out = _output_path(output, fmt)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        _write_file(out, lambda p: pq.write_table(t, p))
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
        _write_file(out, lambda p: Path(p).write_text(text))
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
        print(f"{k:>15}: {v}")
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
                              allow_different_models=args.allow_different_models, client=client)
    finally:
        if client is not None:
            client.close()
    print(f"comparison {result.comparison_id} over {len(result.prompt_ids)} prompts")
    for name, verdict in (("logit verdict", result.logit_verdict), ("KV verdict", result.kv_verdict)):
        if verdict is not None:
            print(f"{name}: {verdict.summary()}")
    print(f"overall: {'PASS' if result.passed else 'FAIL'}" + (f" (first failure in {result.phase})" if result.phase else ""))
    return 0 if result.passed else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from capturestore.demo import run_demo

    result = run_demo(store_path=args.store, arch=args.arch, num_tokens=args.num_tokens, seed=args.seed,
                      release=args.release, inject_bug_layer=args.inject_bug_layer)
    return 0 if result.passed else 1


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
    sp.add_argument("--scheduler", metavar="ADDRESS",
                    help="run the per-prompt work on this Dask scheduler's workers (tcp://HOST:PORT; docs/scale.md)")
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
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause and fix: bad input, store problems, files that cannot be read or written."""
    from capturestore.errors import StoreError

    errors: tuple[type[BaseException], ...] = (StoreError, ValueError, OSError)
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
        print(f"capturestore {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
