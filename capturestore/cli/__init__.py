"""``capturestore`` command line: each subcommand is a thin wrapper over one library function (a
Store method for the store commands).

    capturestore runs                      Store.runs()
    capturestore show RUN                  Store.show(RUN)
    capturestore sql "SELECT ..."          Store.sql(...)   --format table|csv|json|parquet
    capturestore verify                    Store.verify()   exit status 1 on problems
    capturestore gc                        Store.gc()
    capturestore compact                   Store.compact()
    capturestore rebuild-catalog           Store.rebuild_catalog()
    capturestore compare --expected RUN --actual RUN [--baseline RUN]
                                           capturestore.analysis.compare(...)  exit status 1 on FAIL
    capturestore run --model DIR --prompts FILE --target TARGET
                                           capturestore.pipeline.run(...)  exit status 1 on FAIL
    capturestore demo                      capturestore.demo.run_demo(...)  exit status 1 on FAIL
    capturestore calibrate RUN --out DIR   nki_fp8.calibration.calibrate(...)
    capturestore report COMPARISON --out DIR
                                           reports.report(...)
    capturestore tasks --results DIR [--reference DIR]
                                           capturestore.tasks.tasks(...)  exit 1 unless PASS
    capturestore eval --model DIR --tasks T --out DIR
                                           capturestore.evaluate.eval(...)  exit 1 unless PASS
    capturestore aggregate COMPARISON --where "..."
                                           capturestore.aggregate.aggregate(...)
    capturestore diff BASE HEAD            capturestore.diff.diff(...)  exit status 1 on regression
                                           (of two comparisons, or of two cache checks)
    capturestore history --model M         capturestore.diff.history(...)
    capturestore cachecheck --model DIR --engine hf|paged|pkg.mod:Class
                                           capturestore.cachecheck.cachecheck(...)  exit 1 unless PASS
    capturestore isolate COMPARISON [--snapshot]
                                           capturestore.isolate.isolate(...)  exit 1 when not local
    capturestore reduce COMPARISON --out DIR [--local]
                                           capturestore.reduce.reduce(...)
    capturestore reproduce BUNDLE          capturestore.reduce.reproduce(...)  exit 1 when the bug reproduces

Every command takes ``--store PATH`` (default: $CAPTURESTORE, else ./capturestore-store).

Here: the parser (``build_parser``: every command and its flags) and ``main``. Each handler
(``cmd_<command>`` in capturestore.cli.commands) parses its arguments, calls one library function
(above; it opens the store and checks it can be written where the command writes), which returns
results and prints nothing (tests/capturestore/test_cli_thin.py holds this), and formats them with the helpers of capturestore.cli.output
(tables, JSON, output-file checks, atomic writes). The library never imports this package.

Errors: a user error (bad input, a refused or failing query, a missing or read-only store, a
path that cannot be written) is one line on stderr, ``capturestore CMD: error: ...``, exit
status 2, and nothing is left half-written: commands that write check first that they can.
``--debug`` adds the Python traceback. Any other exception is a bug in capturestore and
propagates with its traceback (exit status 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from capturestore.cli.commands import (
    cmd_aggregate,
    cmd_cachecheck,
    cmd_calibrate,
    cmd_compare,
    cmd_demo,
    cmd_diff,
    cmd_eval,
    cmd_compact,
    cmd_gc,
    cmd_history,
    cmd_isolate,
    cmd_rebuild_catalog,
    cmd_reduce,
    cmd_report,
    cmd_reproduce,
    cmd_run,
    cmd_runs,
    cmd_show,
    cmd_sql,
    cmd_tasks,
    cmd_upgrade,
    cmd_verify,
)
from capturestore.cli.output import default_store, format_table, printable, write_result

__all__ = ["build_parser", "default_store", "error_line", "format_table", "main", "printable", "write_result"]


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
    sp = add("compact", cmd_compact, "merge each table's small Parquet segments into one (docs/compact.md)")
    sp.add_argument("--table", action="append", help="compact only this table (repeatable; default: all)")
    sp.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                    help="remove sources of merged segments older than this (default: $CAPTURESTORE_LEASE_S or 120)")
    add("rebuild-catalog", cmd_rebuild_catalog, "rebuild catalog.duckdb from the Parquet segments alone")
    add("upgrade", cmd_upgrade, "raise the store to the current format (4: one file per chunk, \".\" chunk keys, for runs "
        "written from now on; docs/reading.md)")
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
    sp.add_argument("--level3", action="store_true", help="Level 3: every module kind (embedding, RMSNorm, attention, "
                    "RoPE on q/k, MLP, decoder layer, final norm, LM head) judged on the reference's inputs, one table "
                    "per kind (level3_<kind>); implies --even-if-passed; exit 1 when a kind fails")
    sp.add_argument("--snapshot", action="store_true", help="judge the target from its input snapshot: its stored "
                    "module outputs against the HF modules replayed on its stored module inputs, no engine re-run "
                    "(the default for a target that cannot be re-run: a server, vLLM under TP > 1); needs the "
                    "target's module capture with inputs")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp = add("reduce", cmd_reduce, "shrink a failing module comparison to the fewest prompts, tokens and decoder "
             "layers that still fail, into a self-contained bundle with one command (docs/reduce.md); --local: "
             "kept failing by its isolation's local verdict")
    sp.add_argument("comparison", help="the failing comparison's id")
    sp.add_argument("--out", required=True, help="the bundle's directory (new or empty)")
    sp.add_argument("--engine", metavar="MODULE:FUNCTION", help="the engine under test: a function taking the model "
                    "directory and returning the model (default: the actual run's HF engine from its checkpoint)")
    sp.add_argument("--correct", metavar="MODULE:FUNCTION", help="a correct engine the bundle must pass on")
    sp.add_argument("--local", action="store_true", help="keep the local failure of the comparison's isolation "
                    "(capturestore isolate COMPARISON first): the module judged on the expected reference's input; "
                    "an isolation's own comparison is reduced locally without it")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp = add("reproduce", cmd_reproduce, "judge an engine on a bundle written by `capturestore reduce`: exit 1 when "
             "a module fails (the bug reproduces), 0 when every module passes")
    sp.add_argument("bundle", help="the bundle's directory")
    sp.add_argument("--engine", metavar="MODULE:FUNCTION", help="the engine to judge (default: the bundle's)")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
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
    sp.add_argument("--module-inputs", action="store_true", help="the target's module run records each module's "
                    "input too: its input snapshot, which `capturestore isolate --snapshot` replays through the HF "
                    "modules (HF and vLLM targets; docs/isolate.md)")
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
    sp.add_argument("--out", required=True, help="output directory (created; the page written is printed: "
                    "index.html, or diff.html with --diff-base)")
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


EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader closed the pipe


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a reader that left is dropped, not
    raised again at the final flush."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a captured stdout): nothing to redirect
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.store.strip():
            raise ValueError("--store is empty; give the store directory (--store PATH or $CAPTURESTORE)")
        return args.func(args)
    except KeyboardInterrupt:
        print(f"capturestore {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`capturestore show ... | head`): no error, as a tool on SIGPIPE
        _drop_stdout()
        return EXIT_PIPE_CLOSED
    except _user_errors() as e:
        if args.debug:
            traceback.print_exc()
        log = getattr(e, "capturestore_log", None)
        print(f"capturestore {args.command}: error: {error_line(e)}"
              + (f" (engine and library output: {log})" if log else ""), file=sys.stderr)
        return 2


def console_main() -> None:
    """The ``capturestore`` script and ``python -m capturestore.cli``: :func:`main`, then exit without
    the native teardown that can abort a finished command.

    Arrow's thread pools (std::thread) are destroyed by C++ static destructors after the interpreter
    finalises; now and then one is still joinable and the process dies by SIGABRT ("terminate called
    without an active exception", apache/arrow#34314) after printing its whole output: a command that
    succeeded exits -6. Measured here: `capturestore runs` on a read-only store, 2 aborts in 100 runs
    at load 10. So Python's own shutdown steps run in its order (non-daemon threads joined, atexit
    and weakref.finalize callbacks: engine shutdown, temporary directories, logging), the standard
    streams are flushed, and the process leaves with the command's status by ``os._exit``. Everything
    a command writes is committed before :func:`main` returns (the writer's protocol), so nothing
    waits for finalisation. An exception that escapes :func:`main` (a bug) keeps the normal exit and
    its traceback."""
    import atexit
    import threading

    status = main()
    threading._shutdown()  # what Py_FinalizeEx does first: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader left before the last buffer: as main() says for one that left earlier
            status = status or EXIT_PIPE_CLOSED
        except (OSError, ValueError):  # another closed stream: nothing more can reach the reader
            status = status or 1
    os._exit(status)

