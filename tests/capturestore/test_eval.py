"""``capturestore eval`` (capturestore.evaluate): lm-eval on a served engine, judged, deviated prompts analysed.

Oracles: hand-computed LongBench F1 values; the tiny tokenizer counting the long documents'
tokens; the refused inputs' lines and an untouched store; ``/proc`` for the server's process
group after it was killed; in the slow test, a reference lm-eval run of the same tasks by HF in
BF16 (another engine on the same weights), a fault proven on the served engine's logprobs
before any sample is judged, and the prompt analysis's own FAIL verdict on the faulted engine.
"""
import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from capturestore import cli
from capturestore.evaluate import EVAL_TASKS, check_tasks, eval as run_eval, evaluate_tasks, write_eval_tasks
from extractors.models import tiny_model
from extractors.vllm_launch import group_alive

ARCH, SEED = "llama-gqa", 0


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_eval_tasks(tmp_path_factory.mktemp("eval-tasks"), n_choice=6, n_gen=4, n_long=2, long_words=500)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with a 4096-token context (RoPE positions; the weights are the same)."""
    m = tmp_path_factory.mktemp("long-model") / "model"
    shutil.copytree(tiny_model(ARCH, SEED), m)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((m / name).read_text())
        cfg[key] = 4096
        (m / name).write_text(json.dumps(cfg))
    return m


def test_local_tasks_deterministic_and_long(tmp_path, tasks_dir, long_model):
    again = write_eval_tasks(tmp_path / "again", n_choice=6, n_gen=4, n_long=2, long_words=500)
    for name in ("cs_choice.jsonl", "cs_gen.jsonl", "cs_long.jsonl", "cs_longbench.py"):
        assert (again / name).read_bytes() == (tasks_dir / name).read_bytes()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(long_model))
    docs = [json.loads(x) for x in (tasks_dir / "cs_long.jsonl").read_text().splitlines()]
    for d in docs:
        n = len(tok(d["context"])["input_ids"])
        assert 2000 <= n <= 3800, n  # thousands of tokens, within the 4096 context with the question
        assert f"vault is {d['answers'][0]}." in d["context"]  # the needle the question asks for


def test_longbench_f1_by_hand(tasks_dir):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cs_longbench", tasks_dir / "cs_longbench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.qa_f1_score("The Tiger.", "tiger") == 1.0  # article, case and punctuation normalised away
    assert mod.qa_f1_score("tiger river", "tiger") == pytest.approx(2 * 0.5 * 1.0 / 1.5)  # P 1/2, R 1
    assert mod.qa_f1_score("river", "tiger") == 0.0
    assert mod.process_results({"answers": ["x", "tiger"]}, ["a tiger"]) == {"qa_f1": 1.0}


def test_check_tasks_metrics_and_refusals(tmp_path, tasks_dir):
    assert check_tasks(list(EVAL_TASKS), tasks_dir) == {"cs_choice": {"acc,none"}, "cs_gen": {"exact_match,none"},
                                                        "cs_long": {"qa_f1,none"}}
    with pytest.raises(ValueError, match=r"^--threshold exact_match: no task of cs_choice reports that metric "
                                         r"\(metrics: acc,none\)$"):
        check_tasks(["cs_choice"], tasks_dir, {"exact_match": 0.1})
    with pytest.raises(ValueError, match=r"^--tasks nope: lm-eval knows no task of that name"):
        check_tasks(["nope"], tasks_dir)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text(f"task: broken\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n"
                                     f"  data_files:\n    test: {bad / 'missing.jsonl'}\noutput_type: multiple_choice\n"
                                     "doc_to_text: q\ndoc_to_choice: [a, b]\ndoc_to_target: 0\n")
    with pytest.raises(ValueError, match=r"^--tasks broken: lm-eval cannot load it \(") as e:
        check_tasks(["broken"], bad)
    assert "\n" not in str(e.value)


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("case", ["threshold", "task", "port", "out-mismatch"])
def test_cli_refusals_before_any_server(case, tmp_path, tasks_dir, long_model, capsys):
    """One line, exit 2, no server started (no log in --out), the store not created."""
    out, store = tmp_path / "ev", tmp_path / "store"
    args = ["eval", "--store", str(store), "--model", str(long_model), "--tasks", "cs_choice", "--include-path",
            str(tasks_dir), "--out", str(out)]
    sock = None
    if case == "threshold":
        args += ["--threshold", "qa_f1=0.5"]
        want = "--threshold qa_f1: no task of cs_choice reports that metric (metrics: acc,none)"
    elif case == "task":
        args[args.index("cs_choice")] = "cs_choice,cs_nope"
        want = "--tasks cs_nope: lm-eval knows no task of that name"
    elif case == "port":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        args += ["--port", str(port)]
        want = f"--port {port}: 127.0.0.1:{port} is already in use (another server?)"
    else:
        out.mkdir()
        (out / "eval.json").write_text(json.dumps({"eval": {"tasks": ["cs_gen"], "limit": 3}, "eval_done": True}))
        want = f"--out {out} holds the evaluation of other inputs (eval.json: tasks cs_gen, limit 3)"
    try:
        rc, _, err = _cli(capsys, *args)
    finally:
        if sock is not None:
            sock.close()
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("capturestore eval: error: ") and want in lines[0], err
    assert not store.exists()
    assert not list(out.glob("vllm-serve-*.log")) if out.exists() else True
    assert not (out / "eval_results").exists()


class _ServerStarted(Exception):
    """Raised by the stand-in for ``start_vllm_serve``: the refusal came after the server's start."""


@pytest.mark.parametrize("case", ["out-empty", "factor-nan", "factor-1", "dtype", "num-tokens", "port-negative",
                                  "port-too-big", "reference-missing"])
def test_cli_refuses_bad_options_before_the_server_starts(case, tmp_path, tasks_dir, long_model, capsys,
                                                          monkeypatch):
    """Each bad option is refused in one line naming it, exit 2, before vllm serve is started (the
    stand-in raises), nothing written to --out or the current directory, the store not created."""
    import extractors.vllm_launch

    def started(*a, **k):
        raise _ServerStarted(f"vllm serve started before {case} was refused")

    monkeypatch.setattr(extractors.vllm_launch, "start_vllm_serve", started)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out, store = tmp_path / "ev", tmp_path / "store"
    args = ["eval", "--store", str(store), "--model", str(long_model), "--tasks", "cs_choice", "--include-path",
            str(tasks_dir), "--out", str(out)]
    extra, want = {
        "out-empty": ([], "--out is empty; give the evaluation's directory"),
        "factor-nan": (["--inject-bug-layer", "0", "--inject-bug-factor", "nan"], "--inject-bug-factor must be a "
                       "finite number other than 1 (x 1 changes nothing), got nan"),
        "factor-1": (["--inject-bug-layer", "0", "--inject-bug-factor", "1"], "--inject-bug-factor must be a "
                     "finite number other than 1 (x 1 changes nothing), got 1.0"),
        "dtype": (["--dtype", "float8"], "--dtype 'float8': the vLLM server eval starts runs in bfloat16 | float16 "
                  "| float32"),
        "num-tokens": (["--num-tokens", "0"], "--num-tokens must be an integer >= 1, got 0"),
        "port-negative": (["--port", "-1"], "--port must be a TCP port (1-65535), got -1"),
        "port-too-big": (["--port", "70000"], "--port must be a TCP port (1-65535), got 70000"),
        # said "task results directory ... does not exist", naming no flag
        "reference-missing": (["--reference", str(tmp_path / "nope")], f"--reference directory {tmp_path / 'nope'} "
                              "does not exist"),
    }[case]
    if case == "out-empty":
        args[args.index(str(out))] = ""
    rc, stdout, err = _cli(capsys, *args, *extra)
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines == [f"capturestore eval: error: {want}"], err
    assert "starting vllm serve" not in stdout + err
    assert not out.exists() and not store.exists()
    assert not list(cwd.iterdir())


def test_a_factor_without_a_layer_makes_no_fault_and_is_not_judged(tmp_path, tasks_dir, long_model, capsys,
                                                                   monkeypatch):
    """--inject-bug-factor is read only with --inject-bug-layer: alone it is no refusal, the
    evaluation goes on to start its server (the stand-in raises there)."""
    import extractors.vllm_launch

    def started(*a, **k):
        raise _ServerStarted("vllm serve started")

    monkeypatch.setattr(extractors.vllm_launch, "start_vllm_serve", started)
    with pytest.raises(_ServerStarted):
        cli.main(["eval", "--store", str(tmp_path / "store"), "--model", str(long_model), "--tasks", "cs_choice",
              "--include-path", str(tasks_dir), "--out", str(tmp_path / "ev"), "--inject-bug-factor", "1", "--quiet"])


@pytest.mark.vllm
@pytest.mark.slow
def test_server_killed_mid_eval_one_line_no_process_left(tmp_path, tasks_dir, long_model, monkeypatch):
    """The API server SIGKILLed once it answers (its engine-core process orphaned): one line naming
    the dead server and its log, no process of its group left, nothing stored or committed, and
    no IPC socket of it left in the temporary directory (the server's own directory, removed)."""
    import tempfile

    seen = {}
    tmp = Path(tempfile.mkdtemp(prefix="cs-ev-"))  # short: a socket's path must fit 107 bytes (tmp_path's do not)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)  # as a user runs it: the launcher's own directory

    def kill(url, model, say):
        port = int(url.rsplit(":", 1)[1])
        pid = int(next(p for p in os.listdir("/proc") if p.isdigit() and _listens(int(p), port)))
        seen["pgid"] = os.getpgid(pid)
        seen["group"] = group_alive(seen["pgid"])
        seen["ipc"] = [p for p in tmp.rglob("*") if p.is_socket()]  # while it serves
        os.kill(pid, signal.SIGKILL)  # the API server only: its engine core lives on unless eval ends it
        time.sleep(1.0)

    out, store = tmp_path / "ev", tmp_path / "store"
    with pytest.raises(ValueError) as e:
        run_eval(long_model, "cs_choice,cs_gen", out=out, store=store, include_path=tasks_dir, limit=2,
                 server_hook=kill, say=lambda s: None)
    msg = cli.error_line(e.value)
    assert "\n" not in str(e.value)
    assert msg.startswith("the vLLM server http://127.0.0.1:") and "died (killed by signal 9)" in msg, msg
    assert "nothing was stored" in msg and str(out) in msg  # the log lies in --out
    assert len(seen["group"]) >= 2, seen  # the API server and its engine core: both were ended
    assert group_alive(seen["pgid"]) == []
    assert seen["ipc"] and all(p.parent.parent == tmp and p.parent.name.startswith("vllm-") for p in seen["ipc"])
    assert not [p for p in tmp.rglob("*") if p.is_socket() or p.name.startswith("vllm-") and p.is_dir()]
    shutil.rmtree(tmp)  # (torch's inductor cache of this process may be there too)
    assert not store.exists()
    assert not (out / "eval_results").exists() and not list(out.glob(".eval_results.tmp-*"))
    assert not json.loads((out / "eval.json").read_text()).get("eval_done") if (out / "eval.json").exists() else True


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening socket on ``port`` (/proc/net/tcp, the inodes of its fds)."""
    try:
        fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return False
    inodes = {f.split("[")[1].rstrip("]") for f in fds if f.startswith("socket:[")}
    with open("/proc/net/tcp") as fh:
        for row in fh.read().splitlines()[1:]:
            cols = row.split()
            if int(cols[1].split(":")[1], 16) == port and cols[3] == "0A" and cols[9] in inodes:
                return True
    return False


@pytest.mark.vllm
@pytest.mark.slow
def test_eval_end_to_end_degraded_engine(tmp_path, tasks_dir, long_model):
    """A reference run by HF BF16; the served engine degraded by a proven fault (layer 1's attention
    output x 1.1): the scores pass the std tolerance, samples deviate, their prompts (the long
    ones among them) are analysed by the faulted in-process engine (FAIL), one report shows both;
    a second eval reuses everything."""
    tasks = "cs_choice,cs_gen,cs_long"
    ref = evaluate_tasks(long_model, tasks, tmp_path / "ref", lm="hf", include_path=tasks_dir, limit=4,
                         model_args={"pretrained": str(long_model), "dtype": "bfloat16", "device": "cpu"})
    out, store = tmp_path / "ev", tmp_path / "store"
    lines = []
    r = run_eval(long_model, tasks, out=out, store=store, include_path=tasks_dir, limit=4, reference=ref,
                 tolerance="std", inject_bug_layer=1, inject_bug_factor=1.1, say=lines.append)
    text = "\n".join(lines)
    assert group_alive(r.server_pid) == []  # stopped before the prompt analysis began
    assert text.index("stopped vllm serve") < text.index("analysing the")
    state = json.loads((out / "eval.json").read_text())
    bug = state["server_hook"]["injected_bug"]
    assert bug["hook_calls"] > 0 and bug["max_abs_dlogprob"] > bug["clean_spread"]  # proven before judged
    judged = [row for row in r.analysis.score_rows if row["passed"] is not None]
    assert {row["task"] for row in judged} == {"cs_choice", "cs_gen", "cs_long"}
    assert r.analysis.passed is True  # the scores cannot see the fault
    deviated = r.analysis.deviated
    assert deviated, "no sample deviated"
    assert r.comparison is not None and r.comparison.passed is False  # the analysed prompts show the fault
    from capturestore import Store

    st = Store.open(str(store))
    n_prompts = st.sql(f"SELECT count(*) AS n FROM prompts p JOIN runs r ON p.run_id = r.run_id "
                       f"WHERE r.run_id IN (SELECT actual_run FROM comparisons WHERE comparison_id = "
                       f"'{r.comparison.comparison_id}')").column("n")[0].as_py()
    assert n_prompts == len({d["prompt"] for d in r.analysis.deviated_prompts()})
    tasks_rows = st.sql("SELECT task, threshold_kind, passed FROM task_scores").to_pylist()
    assert {(x["task"], x["threshold_kind"], x["passed"]) for x in tasks_rows} == \
        {("cs_choice", "std", True), ("cs_gen", "std", True), ("cs_long", "std", True)}
    html = (out / "report" / "index.html").read_text()
    assert "cs_long" in html and "cs_choice" in html
    # resumed: the evaluation and the comparison are reused, no server is started
    lines.clear()
    again = run_eval(long_model, tasks, out=out, store=store, include_path=tasks_dir, limit=4, reference=ref,
                     tolerance="std", inject_bug_layer=1, inject_bug_factor=1.1, say=lines.append)
    assert again.reused_eval and again.server_pid is None
    assert again.comparison.comparison_id == r.comparison.comparison_id
    assert any("reusing the prompt analysis" in s for s in lines)


def test_ticker_only_on_a_terminal():
    import io

    from capturestore.evaluate import _Ticker

    bar = io.StringIO()
    with _Ticker("evaluating cs_gen", True, bar):
        deadline = time.monotonic() + 30  # a tick at ~1 s; a loaded machine may wake it later
        while bar.getvalue().count("\r") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert re.fullmatch(r"(\revaluating cs_gen: [1-9]\d* s){2,}\r\x1b\[K", bar.getvalue()), repr(bar.getvalue())
    plain = io.StringIO()
    with _Ticker("evaluating cs_gen", False, plain):
        time.sleep(1.2)
    assert plain.getvalue() == ""


@pytest.mark.parametrize("long_tmp", [False, True])
def test_the_servers_ipc_directory_fits_a_socket_address_or_is_vllms_default(long_tmp, monkeypatch):
    """start_vllm_serve gives the server a directory of its own for vLLM's IPC sockets when their
    paths fit a unix socket address (107 bytes), else leaves vLLM's default (a longer path made
    the server exit at start: "is longer than 107 characters"); a start that fails removes it.
    The stand-in for Popen records the environment and fails the start."""
    import subprocess as sp
    import tempfile

    import extractors.vllm_launch as vl

    base = Path(tempfile.mkdtemp(prefix="cs-ipc-"))
    tmp = base / ("d" * 80 if long_tmp else "t")
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    seen = {}

    def popen(cmd, **kw):
        seen["env"] = kw["env"]
        seen["dirs"] = sorted(p.name for p in tmp.iterdir())
        raise OSError("planted: the server did not start")

    monkeypatch.setattr(sp, "Popen", popen)
    try:
        with pytest.raises(OSError, match="planted"):
            vl.start_vllm_serve(Path("/nonexistent-model"), log_dir=base)
        ipc = seen["env"].get("VLLM_RPC_BASE_PATH")
        if long_tmp:
            assert ipc is None and seen["dirs"] == []
        else:
            assert Path(ipc).parent == tmp and Path(ipc).name in seen["dirs"]
            assert len(ipc) + 1 + 36 <= 107
        assert list(tmp.iterdir()) == []  # removed again
    finally:
        shutil.rmtree(base)
