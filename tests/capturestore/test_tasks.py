"""lm-eval task analysis (capturestore.tasks, `capturestore tasks`).

Oracles: hand-made output directories whose scores, thresholds and deviations are computed by
hand; for the real lm-eval fixtures (tests/fixtures/lm_eval, made by make_lm_eval_fixtures.py
from the real lm-eval 0.4.13 on a tiny local model and its deliberately degraded copy) a plain
re-reading of the JSONL files (multiple-choice answer = argmax of the logged loglikelihoods,
generation answer = the logged text). One slow test runs lm-eval for real.
"""
import glob
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capturestore.cli import main
from capturestore.store import Store
from capturestore.tasks import (
    STD_Z,
    TASK_TABLES,
    analyse_tasks,
    deviated_prompts,
    load_task_results,
    run_task_analysis,
)
from tests.test_docs_tables import DOC, documented_tables

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "lm_eval"
REF, BAD = FIX / "reference", FIX / "degraded"


# ------------------------------------------------------------------------- hand-made directories


def _write_run(out: Path, ts: str, results: dict, samples: dict, groups=None, hib=None, configs=None) -> Path:
    d = out / "__model__dir"
    d.mkdir(parents=True, exist_ok=True)
    data = {"results": results, "groups": {g: results[g] for g in (groups or {})}, "group_subtasks": groups or {},
            "higher_is_better": hib or {t: {"acc": True} for t in results},
            "configs": configs or {t: {"output_type": "multiple_choice"} for t in samples},
            "n-samples": {t: {"original": len(s), "effective": len(s)} for t, s in samples.items()}}
    (d / f"results_{ts}.json").write_text(json.dumps(data))
    for task, rows in samples.items():
        (d / f"samples_{task}_{ts}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _mc(doc_id, lls, gold, text=None):
    acc = float(max(range(len(lls)), key=lls.__getitem__) == gold)
    return {"doc_id": doc_id, "target": str(gold), "filter": "none", "metrics": ["acc"], "acc": acc,
            "arguments": {f"gen_args_{i}": {"arg_0": text or f"Q{doc_id}?", "arg_1": f" c{i}"}
                          for i in range(len(lls))},
            "resps": [[[str(x), "False"]] for x in lls], "filtered_resps": [[str(x), "False"] for x in lls],
            "prompt_hash": f"h{doc_id}"}


def _hand_dirs(tmp_path):
    """Reference and target with a group (g: s1, s2) and a standalone task t. Target differs:
    s1 doc 1 answered worse (acc 1 -> 0), s1 doc 2 picks another wrong answer (acc 0 both), s2 same."""
    ref_s1 = [_mc(0, [-1, -2], 0), _mc(1, [-1, -3], 0), _mc(2, [-3, -1, -2], 0)]
    tgt_s1 = [_mc(2, [-3, -2, -1], 0), _mc(0, [-1.1, -2], 0), _mc(1, [-3, -1], 0)]  # other order
    s2 = [_mc(0, [-2, -1], 1), _mc(1, [-1, -2], 1)]
    t = [_mc(5, [-1, -2], 0, "the prompt of t")]

    def res(s1_acc, s1_se, s2_acc, t_acc):
        return {"s1": {"acc,none": s1_acc, "acc_stderr,none": s1_se, "alias": " - s1"},
                "s2": {"acc,none": s2_acc, "acc_stderr,none": 0.5, "alias": " - s2"},
                "t": {"acc,none": t_acc, "acc_stderr,none": "N/A"},
                "g": {"acc,none": (3 * s1_acc + 2 * s2_acc) / 5, "acc_stderr,none": 0.2, "alias": "g"}}

    ref = _write_run(tmp_path / "ref", "2026-01-01T00-00-00.000001", res(2 / 3, 0.1, 0.5, 1.0),
                     {"s1": ref_s1, "s2": s2, "t": t}, groups={"g": ["s1", "s2"]})
    tgt = _write_run(tmp_path / "tgt", "2026-02-02T11-22-33.444444", res(1 / 3, 0.2, 0.5, 1.0),
                     {"s1": tgt_s1, "s2": s2, "t": t}, groups={"g": ["s1", "s2"]})
    return ref, tgt


def _row(a, task):
    return next(r for r in a.score_rows if r["task"] == task)


def test_hand_made_reference_vs_target_pairs_tasks_and_samples_and_judges_by_hand(tmp_path):
    ref, tgt = _hand_dirs(tmp_path)
    a = analyse_tasks(tgt, ref)  # tolerance std by default
    assert a.tolerance == "std"
    s1 = _row(a, "s1")
    assert s1["group_name"] == "g" and not s1["is_group"] and s1["reference_score"] == pytest.approx(2 / 3)
    # std: 2/3 - 2 * sqrt(0.1^2 + 0.2^2) = 0.21946...; 1/3 >= that: pass
    assert s1["threshold"] == pytest.approx(2 / 3 - STD_Z * math.sqrt(0.01 + 0.04)) and s1["passed"] is True
    assert s1["delta"] == pytest.approx(-1 / 3) and s1["n_deviated"] == 2
    g = _row(a, "g")
    assert g["is_group"] and g["group_name"] is None and g["n_deviated"] is None
    assert _row(a, "t")["stderr"] is None  # "N/A" in lm-eval's file
    dev = {(r["task"], r["doc_id"]): r for r in a.sample_rows if r["deviated"]}
    assert set(dev) == {("s1", 1), ("s1", 2)}
    assert dev[("s1", 1)]["worse"] and dev[("s1", 1)]["deviated_metrics"] == ["acc"]
    assert dev[("s1", 2)]["response_differs"] and not dev[("s1", 2)]["metrics_differ"] and not dev[("s1", 2)]["worse"]
    # doc 0 of s1: loglikelihood -1.1 vs -1, same answer and acc: not deviated
    assert next(r for r in a.sample_rows if (r["task"], r["doc_id"]) == ("s1", 0))["deviated"] is False
    assert a.passed is True
    assert deviated_prompts(tgt, ref) == [{"id": "s1/1", "prompt": "Q1?", "task": "s1", "doc_id": 1, "target": "0"},
                                          {"id": "s1/2", "prompt": "Q2?", "task": "s1", "doc_id": 2, "target": "0"}]

    m = analyse_tasks(tgt, ref, tolerance="mean")  # 1/3 < 2/3: fails; s2, t, equal: pass
    assert _row(m, "s1")["passed"] is False and _row(m, "s2")["passed"] is True and m.passed is False
    assert _row(m, "g")["threshold"] == pytest.approx((3 * 2 / 3 + 1) / 5) and _row(m, "g")["passed"] is False


def test_hand_made_target_only_thresholds_and_incorrect_samples(tmp_path):
    _, tgt = _hand_dirs(tmp_path)
    a = analyse_tasks(tgt, thresholds={"acc": 0.4, "acc,none": 0.3})  # the full key wins over the bare name
    assert all(r["threshold"] == 0.3 and r["threshold_kind"] == "min" for r in a.score_rows)
    assert {r["task"]: r["passed"] for r in a.score_rows} == {"s1": True, "s2": True, "t": True, "g": True}
    b = analyse_tasks(tgt, thresholds={"acc": 0.4})
    assert _row(b, "s1")["passed"] is False and b.passed is False
    # target only: a sample deviated when its 0/1 metric is 0 (answered incorrectly)
    wrong = {(r["task"], r["doc_id"]) for r in b.sample_rows if r["deviated"]}
    assert wrong == {("s1", 1), ("s1", 2), ("s2", 1)}  # s2 doc 1: argmax 0, gold 1
    assert analyse_tasks(tgt).passed is None  # nothing judged is not a pass


def test_samples_that_cannot_be_judged_count_no_deviation(tmp_path):
    """Target only with a continuous metric, and a reference without samples: deviated and
    n_deviated are NULL, not False / 0."""
    rows = [{**_mc(0, [-1, -2], 0), "metrics": ["bleu"], "bleu": 0.37}]
    cont = _write_run(tmp_path / "c", "2026-01-01T00-00-00.1", {"s": {"bleu,none": 0.37}}, {"s": rows},
                      hib={"s": {"bleu": True}})
    a = analyse_tasks(cont)
    assert a.sample_rows[0]["deviated"] is None and a.score_rows[0]["n_deviated"] is None
    bare = _write_run(tmp_path / "b", "2026-01-01T00-00-00.1", {"s": {"bleu,none": 0.37}}, {})
    b = analyse_tasks(cont, bare)
    assert b.sample_rows[0]["deviated"] is None and b.score_rows[0]["n_deviated"] is None
    assert b.score_rows[0]["passed"] is True  # equal scores, tolerance std


def test_newest_results_file_wins_and_samples_come_from_the_same_timestamp(tmp_path):
    ref, _ = _hand_dirs(tmp_path)
    later = "2026-03-03T00-00-00.000000"
    _write_run(ref, later, {"s2": {"acc,none": 0.0, "acc_stderr,none": 0.0}}, {"s2": [_mc(0, [-1, -2], 1)]})
    tasks = load_task_results(ref)
    assert tasks["s2"].scores == {"acc,none": 0.0} and later in tasks["s2"].results_file
    assert list(tasks["s2"].samples) == [(0, "none")] and later in tasks["s2"].samples_file
    assert tasks["s1"].scores["acc,none"] == pytest.approx(2 / 3) and len(tasks["s1"].samples) == 3


# ------------------------------------------------------------------------- the real lm-eval fixtures


def _oracle_deviated(target: Path, reference: Path) -> set:
    """Independent of capturestore.tasks: per task, the docs whose answer or metric differs."""
    out = set()
    for f in glob.glob(str(target / "*" / "samples_*.jsonl")):
        task = Path(f).name[len("samples_"):].rsplit("_", 1)[0]
        rf = glob.glob(str(reference / "*" / f"samples_{task}_*.jsonl"))[0]
        ref = {json.loads(x)["doc_id"]: json.loads(x) for x in Path(rf).read_text().splitlines()}
        for line in Path(f).read_text().splitlines():
            s = json.loads(line)
            r = ref[s["doc_id"]]
            if isinstance(s["filtered_resps"][0], str):
                differs = s["filtered_resps"] != r["filtered_resps"]
            else:
                lls = lambda x: [float(c[0]) for c in x["filtered_resps"]]  # noqa: E731
                differs = int(np.argmax(lls(s))) != int(np.argmax(lls(r)))
            if differs or any(s[m] != r[m] for m in s["metrics"]):
                out.add(f"{task}/{s['doc_id']}")
    return out


def test_real_fixtures_degraded_target_deviates_where_the_oracle_says(tmp_path):
    want = _oracle_deviated(BAD, REF)
    assert want, "the degraded model's fixture must differ from the reference's"
    got = deviated_prompts(BAD, REF)
    assert {p["id"] for p in got} == want
    assert all(p["prompt"].startswith(("Question:", "Repeat")) for p in got)
    a = analyse_tasks(BAD, REF)
    assert {r["task"] for r in a.score_rows} == {"tinyqa", "tinyqa_a", "tinyqa_b", "tinygen"}
    assert _row(a, "tinyqa")["is_group"] and _row(a, "tinyqa_a")["group_name"] == "tinyqa"
    import shutil

    same = shutil.copytree(REF, tmp_path / "same")  # the directory itself is refused as its own reference
    assert analyse_tasks(same, REF).deviated == []  # a run against an identical one deviates nowhere


def test_stored_tables_match_the_declared_schemas_and_docs(tmp_path):
    store = Store.open(tmp_path / "s")
    a = run_task_analysis(store, BAD, REF, label="nightly")
    for name, spec in TASK_TABLES.items():
        t = store.sql(f"SELECT * FROM {name} WHERE analysis_id = '{a.analysis_id}'")
        assert t.column_names == spec.schema.names
    n = store.sql("SELECT count(*) AS n FROM task_samples WHERE deviated").column("n")[0].as_py()
    assert n == len(a.deviated) == len(_oracle_deviated(BAD, REF))
    docs = documented_tables(DOC.read_text())
    for name, spec in TASK_TABLES.items():
        assert docs[name]["columns"] == spec.schema.names and docs[name]["version"] == spec.version


# ------------------------------------------------------------------------- CLI and bad input


def test_cli_tasks_prints_verdict_and_deviated_prompts(tmp_path, capsys):
    rc = main(["tasks", "--store", str(tmp_path / "s"), "--results", str(BAD), "--threshold", "acc=0.26"])
    out = capsys.readouterr().out
    assert rc == 1 and "overall: FAIL" in out and "tinyqa_a      acc,none          0.25" in out
    rc = main(["tasks", "--store", str(tmp_path / "s"), "--results", str(BAD), "--reference", str(REF)])
    out = capsys.readouterr().out
    assert rc == 0 and "overall: PASS" in out and f"deviated samples: {len(_oracle_deviated(BAD, REF))} of 30" in out


def _bad_cases(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken" / "m"
    broken.mkdir(parents=True)
    (broken / "results_2026-01-01T00-00-00.json").write_text('{"results": {"t": ')
    badline = tmp_path / "badline"
    _write_run(badline, "2026-01-01T00-00-00.1", {"t": {"acc,none": 1.0}}, {"t": [_mc(0, [-1, -2], 0)]})
    with open(next(badline.rglob("samples_*.jsonl")), "a") as f:
        f.write("{not json\n")
    other = tmp_path / "other"
    _write_run(other, "2026-01-01T00-00-00.1", {"zzz": {"acc,none": 1.0}}, {"zzz": [_mc(0, [-1, -2], 0)]})
    shifted = tmp_path / "shifted"  # the reference's tinyqa_a samples are of other documents (doc_id + 1000)
    import shutil

    shutil.copytree(REF, shifted)
    qa = next(shifted.rglob("samples_tinyqa_a_*.jsonl"))
    qa.write_text("".join(json.dumps({**json.loads(line), "doc_id": json.loads(line)["doc_id"] + 1000}) + "\n"
                          for line in qa.read_text().splitlines() if line.strip()))
    return [
        # issue 17: accepted silently, the task's deviated samples vanished and the analysis passed
        (["--results", str(BAD), "--reference", str(shifted)],
         "task tinyqa_a: none of its 12 samples pairs with one of the target's 12 by (doc_id, filter) "
         "(reference doc_id 1000-1011, filter none; target doc_id 0-11, filter none)"),
        (["--results", str(tmp_path / "missing")], "does not exist"),
        # the flag's directory named: "task results directory ... does not exist" for either
        (["--results", str(BAD), "--reference", str(tmp_path / "missing")],
         f"reference task results directory {tmp_path / 'missing'} does not exist"),
        # a vacuous PASS, stored, where compare refuses a run compared with itself
        (["--results", str(BAD), "--reference", str(BAD) + "/"], "is the results directory itself"),
        (["--results", str(empty)], "holds no results_*.json"),
        (["--results", str(tmp_path / "broken")], "results_2026-01-01T00-00-00.json is not valid JSON"),
        (["--results", str(badline)], ".jsonl:2: not valid JSON"),
        (["--results", str(BAD), "--reference", str(other)], "shares no task"),
        (["--results", str(BAD), "--tolerance", "std"], "give --reference"),
        (["--results", str(BAD), "--threshold", "acc"], "expected METRIC=VALUE"),
        (["--results", str(BAD), "--threshold", "bleu=3"], "no task of"),
    ]


def test_bad_input_is_one_line_exit_2_and_stores_nothing(tmp_path, capsys):
    store = tmp_path / "store"
    for args, needle in _bad_cases(tmp_path):
        rc = main(["tasks", "--store", str(store), *args])
        err = capsys.readouterr().err
        assert rc == 2, args
        assert err.count("\n") == 1 and err.startswith("capturestore tasks: error: ") and needle in err, (args, err)
        assert not store.exists(), f"{args}: the store was created for a refused input"


# ------------------------------------------------------------------------- the real lm-eval, slow


@pytest.mark.slow
def test_real_lm_eval_run_of_the_degraded_model_is_found_deviated(tmp_path):
    """Runs make_lm_eval_fixtures.py (real lm-eval, HF backend, local model and tasks) for the
    degraded model and analyses it against the committed reference."""
    pytest.importorskip("lm_eval")
    script = FIX / "make_lm_eval_fixtures.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--which", "degraded"], check=True,
                   timeout=600, cwd=str(ROOT), capture_output=True)
    out = tmp_path / "degraded"
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["lm_eval_version"] == "0.4.13"
    want = _oracle_deviated(out, REF)
    assert want
    assert {p["id"] for p in deviated_prompts(out, REF)} == want


# ------------------------------------------------------------------------- the report's Tasks tab


def test_report_tasks_tab_shows_the_analysis_a_run_names(tmp_path):
    """A run whose config names the analysis (task_analysis_id) brings its rows into the report."""
    import re

    import reports
    from capturestore.analysis import compare_runs
    from capturestore.capture import begin_capture_run, write_prompt_capture

    store = Store.open(tmp_path / "s")
    import shutil

    other = run_task_analysis(store, shutil.copytree(REF, tmp_path / "same"), REF)  # not linked: its rows stay out
    a = run_task_analysis(store, BAD, REF)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    runs = []
    for kind, noise, cfg in (("logits", 0.0, {}), ("logits", 0.001, {"task_analysis_id": a.analysis_id})):
        run = begin_capture_run(store, engine="t", capture="teacher_forced_prefill", prompts=[[1, 2]], layer_names=None,
                                logits_kind=kind, config=cfg, model_path="/m", model_hash="h", dtype="float32")
        with run:
            write_prompt_capture(run, [1, 2], x.argmax(-1).tolist(), x + np.float32(noise))
        runs.append(run.run_id)
    res = compare_runs(store, expected_run=runs[0], actual_run=runs[1], kv=False)
    index = reports.render_comparison(store, res.comparison_id, tmp_path / "rep").read_text()
    assert 'data-tab="tasks"' in index and a.analysis_id in index and other.analysis_id not in index
    samples = index[index.index("<h2>task_samples</h2>"):]
    assert re.search(rf"<details open><summary>deviating: {len(a.deviated)}</summary>", samples)
    assert re.search(rf"<details><summary>matching: {30 - len(a.deviated)}</summary>", samples)


# ------------------------------------------------------------------------- property: pairing by doc_id

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pairing_by_doc_id_finds_exactly_the_changed_answers(tmp_path_factory, data):
    n = data.draw(st.integers(1, 12), label="docs")
    k = data.draw(st.integers(2, 4), label="choices")
    lls = st.lists(st.integers(-50, 0), min_size=k, max_size=k)
    ref_lls = [data.draw(lls) for _ in range(n)]
    tgt_lls = [data.draw(lls) for _ in range(n)]
    gold = [data.draw(st.integers(0, k - 1)) for _ in range(n)]
    order = data.draw(st.permutations(range(n)), label="target line order")
    tmp = tmp_path_factory.mktemp("prop")
    ref = [_mc(i, [float(x) for x in ref_lls[i]], gold[i]) for i in range(n)]
    tgt = [_mc(i, [float(x) for x in tgt_lls[i]], gold[i]) for i in order]
    res = lambda rows: {"s": {"acc,none": sum(r["acc"] for r in rows) / n, "acc_stderr,none": 0.1}}  # noqa: E731
    _write_run(tmp / "r", "2026-01-01T00-00-00.1", res(ref), {"s": ref})
    _write_run(tmp / "t", "2026-01-02T00-00-00.1", res(tgt), {"s": tgt})
    first_max = lambda xs: xs.index(max(xs))  # noqa: E731  (lm-eval's argmax keeps the first)
    want = {i for i in range(n) if first_max(ref_lls[i]) != first_max(tgt_lls[i])}
    assert {p["doc_id"] for p in deviated_prompts(tmp / "t", tmp / "r")} == want
    wrong = {i for i in range(n) if first_max(tgt_lls[i]) != gold[i]}
    assert {r["doc_id"] for r in analyse_tasks(tmp / "t").sample_rows if r["deviated"]} == wrong
