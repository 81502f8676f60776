"""capturestore.cachecheck: correct engines pass the whole matrix with no false alarm, each planted
bug is caught with its diagnosis (and, varied by hypothesis, wherever it is planted), a missing
operation is "not run" (never a pass), bad input is one line, results are committed atomically."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from capturestore.cachecheck import SCENARIOS, cachecheck, check_cache, make_adapter
from capturestore.cli import main
from extractors.cache_adapters import NotSupported, PagedEngineAdapter
from extractors.cache_engine import BUGS
from extractors.models import tiny_model
from metrics.cache_equivalence import BATCH, CHUNK, CONTEXT, LATE, STALE

# ------------------------------------------------------------------------ correct engines


@pytest.mark.slow
@pytest.mark.parametrize("engine,arch", [("hf", "llama-mha"), ("hf", "llama-gqa"), ("hf", "gemma3-sliding"),
                                         ("paged", "llama-gqa")])
def test_a_correct_engine_passes_the_whole_matrix_with_no_false_alarm(engine, arch):
    adapter = make_adapter(tiny_model(arch), engine, "float32", max_context=128 if engine == "paged" else None)
    r = check_cache(adapter)
    assert [s.name for s in r.scenarios] == list(SCENARIOS)
    assert r.passed, r.summary()
    assert r.tolerance == pytest.approx(1e-5)  # FP32: the floor, the measured noise is far below it
    assert 0 < r.noise < 2.5e-6
    errs = [q.judgement.max_err for s in r.scenarios for q in s.requests if q.judgement is not None]
    # real evidence: hundreds of positions, cached != full-prefix bit for bit, all within 1e-5
    assert sum(len(q.positions) for s in r.scenarios for q in s.requests) > 300
    assert 1e-8 < max(errs) <= 1e-5
    overflow = next(s for s in r.scenarios if s.name == "overflow")
    check = next(q for q in overflow.requests if q.request == "step-past-limit")
    assert check.status == "pass" and "refused" in check.detail


# ------------------------------------------------------------------------ planted bugs

# bug -> (the scenario that must fail, the diagnosis, the first differing position there)
EXPECTED = {
    "stale_slot": ("reuse", STALE, 0),  # the new request in the freed blocks, from its first position
    "truncate_keeps_pos": ("truncate", LATE, 33),  # the first token after the cut at 2 bs + 1
    "fork_no_cow": ("fork", STALE, 21),  # the first step after the fork of a 21-token prefix
    "compaction_shift": ("compaction", BATCH, None),
    "chunk_pos_off_by_one": ("chunk_7", CHUNK, 7),  # the first position of the second chunk
    "pad_read": ("batch_3", BATCH, None),
    "context_off_by_one": ("overflow", CONTEXT, 64),  # the step at max_context ran
}
SUBSET = ["single", "batch_3", "invariance", "compaction", "reuse", "cancel", "truncate", "fork", "chunk_7",
          "chunk_bs", "overflow"]


@pytest.fixture(scope="module")
def gqa():
    return tiny_model("llama-gqa")


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_bug_is_caught_with_its_diagnosis_and_nothing_else_is_blamed(bug, gqa):
    scenario, diagnosis, position = EXPECTED[bug]
    r = check_cache(PagedEngineAdapter(gqa, max_context=64, bugs=(bug,)), scenarios=SUBSET)
    assert not r.passed and r.verdict() == "FAIL"
    by = {s.name: s for s in r.scenarios}
    assert by["single"].status == "pass"  # the baseline is clean: no bug here is systematic
    assert by[scenario].status == "fail", by[scenario].summary()
    assert by[scenario].diagnosis == diagnosis
    # every failing scenario of the matrix points at the same class: no false attribution
    assert {s.diagnosis for s in r.failed} == {diagnosis}, r.summary()
    first = by[scenario].failed[0]
    if position is not None:
        assert first.first_position == position, by[scenario].summary()
    if first.judgement is not None:
        assert first.judgement.max_err > 100 * r.tolerance  # magnitude against the tolerance
        assert first.kv_diff is not None  # the paged engine gives KV: the first differing layer is named
    assert diagnosis in by[scenario].summary() and first.request in by[scenario].summary()


def test_pad_read_fails_the_short_row_at_its_first_decode_position(gqa):
    r = check_cache(PagedEngineAdapter(gqa, max_context=64, bugs=("pad_read",)), scenarios=["single", "batch_3"])
    batch = r.scenarios[1]
    short = min(batch.failed, key=lambda q: int(q.request.split("len")[1]))
    assert short.first_position == int(short.request.split("len")[1])  # its prompt length: the first decode step
    assert short.kv_diff[0] == 1  # the padded tail read in layer 0 first shows in the KV of layer 1


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(bug=st.sampled_from(sorted(BUGS)), arch=st.sampled_from(["llama-mha", "llama-gqa"]),
       block_size=st.sampled_from([16, 32]), seed=st.integers(0, 10_000))
def test_property_a_planted_bug_is_caught_with_its_diagnosis_wherever_it_sits(bug, arch, block_size, seed):
    """Prompts, lengths, block size and head grouping vary: the bug is still caught in its
    scenario with its diagnosis, and the baseline stays clean."""
    scenario, diagnosis, _ = EXPECTED[bug]
    adapter = PagedEngineAdapter(tiny_model(arch), block_size=block_size, max_context=128, bugs=(bug,))
    r = check_cache(adapter, scenarios=["single", scenario], seed=seed)
    assert r.scenarios[0].status == "pass", r.summary()
    assert r.scenarios[1].status == "fail", r.summary()
    assert r.scenarios[1].diagnosis == diagnosis


# ------------------------------------------------------------------------ missing operations


class _NoTruncateNoFork(PagedEngineAdapter):
    truncate = None
    fork = None

    def prefill(self, prompts, chunk_size=None):
        if chunk_size is not None:
            raise NotSupported("this engine prefills whole prompts only")
        return super().prefill(prompts)


def test_a_missing_operation_is_not_run_with_its_reason_never_passed(gqa):
    r = check_cache(_NoTruncateNoFork(gqa, max_context=64), scenarios=["single", "truncate", "fork", "chunk_7"])
    by = {s.name: s for s in r.scenarios}
    assert by["single"].status == "pass"
    assert by["truncate"].status == "not_run" and "lacks truncate" in by["truncate"].reason
    assert by["fork"].status == "not_run" and "lacks fork" in by["fork"].reason
    assert by["chunk_7"].status == "not_run" and "whole prompts only" in by["chunk_7"].reason
    assert not r.passed and r.verdict() == "NOT PASSED"
    assert "not run" in by["truncate"].summary()


def test_an_engine_raising_inside_a_scenario_fails_it(gqa):
    class Broken(PagedEngineAdapter):
        def fork(self, handle, n):
            raise RuntimeError("out of blocks")

    r = check_cache(Broken(gqa, max_context=64), scenarios=["single", "fork"])
    assert r.scenarios[1].status == "fail" and "out of blocks" in r.scenarios[1].summary()


def test_scenarios_beyond_the_context_are_refused_up_front(gqa):
    with pytest.raises(ValueError, match="scenario truncate needs 57 positions.*context of 32"):
        check_cache(PagedEngineAdapter(gqa, max_context=32), scenarios=["single", "truncate"])


# ------------------------------------------------------------------------ store and CLI


def test_cli_stores_a_passing_check_as_a_comparison_with_its_tables(tmp_path, gqa, capsys):
    from capturestore import Store

    store = tmp_path / "store"
    rc = main(["cachecheck", "--model", str(gqa), "--engine", "paged", "--max-context", "64",
               "--scenarios", "single,reuse", "--store", str(store), "--quiet", "--label", "r1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "overall: PASS (2 passed" in out
    s = Store.open(store)
    cmp = s.sql("SELECT comparison_id, passed, label, actual_run FROM comparisons").to_pylist()
    assert len(cmp) == 1 and cmp[0]["passed"] is True and cmp[0]["label"] == "r1" and cmp[0]["actual_run"] is None
    cid = cmp[0]["comparison_id"]
    rows = s.sql("SELECT scenario, status FROM cachecheck_scenarios ORDER BY scenario").to_pylist()
    assert rows == [{"scenario": "reuse", "status": "pass"}, {"scenario": "single", "status": "pass"}]
    eng = s.sql("SELECT engine, passed, verdict, n_scenarios, tolerance, block_size FROM cachecheck_engines").to_pylist()[0]
    assert eng == {"engine": "paged", "passed": True, "verdict": "PASS", "n_scenarios": 2, "tolerance": 1e-5,
                   "block_size": 16}
    n = s.sql("SELECT count(*) AS n, max(logit_err) AS e, bool_and(token_match) AS t FROM cachecheck_positions "
              f"WHERE comparison_id = '{cid}'").to_pylist()[0]
    # single: 11 prompt positions + 8 steps; reuse: long 34 + 4, companion 5 + 4 + 6, new 3 + 6, the same
    # new request on a fresh engine 3 + 6 and the reused one against it 3 + 6
    assert n["n"] == 19 + (34 + 4) + (5 + 4 + 6) + 3 * (3 + 6)
    assert 0 < n["e"] <= 1e-5 and n["t"] is True
    assert not s.verify()


def test_cli_exit_1_names_the_failing_scenario_and_its_diagnosis(tmp_path, gqa, capsys):
    from capturestore import Store

    store = tmp_path / "store"
    rc = main(["cachecheck", "--model", str(gqa), "--engine", "paged", "--max-context", "64", "--bug", "stale_slot",
               "--scenarios", "single,reuse", "--store", str(store), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "reuse: FAIL, stale or shared cache: request new-in-freed, first difference at position 0" in out
    row = Store.open(store).sql("SELECT status, diagnosis, first_request, first_position, first_kv_layer "
                                "FROM cachecheck_scenarios WHERE scenario = 'reuse'").to_pylist()[0]
    assert row == {"status": "fail", "diagnosis": STALE, "first_request": "new-in-freed", "first_position": 0,
                   "first_kv_layer": 1}


@pytest.mark.parametrize("argv,message", [
    (["--model", "{tmp}/nomodel"], "is not a model directory"),
    (["--model", "{gqa}", "--scenarios", "single,nope"], "unknown scenario"),
    (["--model", "{gqa}", "--engine", "paged", "--max-context", "32", "--scenarios", "truncate"],
     "needs 57 positions, beyond the engine's context of 32"),
    (["--model", "{gqa}", "--engine", "no_such_module:Adapter"], "engine no_such_module:Adapter cannot start"),
    (["--model", "{gqa}", "--engine", "tgi"], "unknown engine"),
    (["--model", "{gqa}", "--engine", "hf", "--bug", "stale_slot"], "paged test engine only"),
    (["--model", "{gqa}", "--engine", "vllm", "--bug", "stale_slot"], "unknown bug(s) ['stale_slot']; known: chunk_pos"),
    (["--model", "{gqa}", "--engine", "vllm", "--scenarios", "chunk_7"], "unknown scenario(s) ['chunk_7']"),
    (["--model", "{gqa}", "--engine", "paged", "--engine-option", "num_blocks"], "is not KEY=VALUE"),
    (["--model", "{gqa}", "--engine", "hf", "--max-context", "100000"], "exceeds the model's max_position_embeddings"),
    # each was read as "the engine's default" (0) or failed later, after loading, with another message
    (["--model", "{gqa}", "--engine", "paged", "--max-context", "0"], "max_context 0 must be at least 2 positions"),
    (["--model", "{gqa}", "--engine", "paged", "--max-context", "-5"], "max_context -5 must be at least 2 positions"),
    (["--model", "{gqa}", "--engine", "paged", "--block-size", "0"], "block_size 0 must be at least 1"),
    (["--model", "{gqa}", "--engine", "paged", "--block-size", "-1"], "block_size -1 must be at least 1"),
    (["--model", "{gqa}", "--engine", "hf", "--block-size", "16"], "block_size applies to the paged and vllm engines"),
    (["--model", "{gqa}", "--engine", "paged", "--scenarios", ","], "no scenario named"),
    (["--model", "{gqa}", "--engine", "paged", "--seed", "-1"], "seed -1 must be a non-negative integer"),
])
def test_cli_bad_input_is_one_line_exit_2_and_no_store_for_invalid_arguments(tmp_path, gqa, capsys, argv, message):
    store = tmp_path / "store"
    argv = [a.format(tmp=tmp_path, gqa=gqa) for a in argv]
    rc = main(["cachecheck", *argv, "--store", str(store), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("capturestore cachecheck: error: ") and message in err, err
    if "model directory" in message or "unknown" in message or "must be" in message or "scenario named" in message \
            or "applies to" in message:
        assert not store.exists()  # refused before the store is created


def test_a_check_that_fails_while_committing_leaves_no_visible_rows(tmp_path, gqa, monkeypatch):
    from capturestore import Store

    s = Store.open(tmp_path / "store")
    real = s.append_table

    def fail_on_marker(name, rows, *a, **k):
        if name == "comparisons":
            raise OSError("disk full")
        return real(name, rows, *a, **k)

    monkeypatch.setattr(s, "append_table", fail_on_marker)
    with pytest.raises(OSError, match="disk full"):
        cachecheck(gqa, engine="paged", max_context=64, scenarios=["single"], store=s)
    monkeypatch.undo()
    s2 = Store.open(tmp_path / "store")
    assert "cachecheck_scenarios" not in s2.sql(
        "SELECT table_name FROM information_schema.tables").column("table_name").to_pylist() or \
        s2.sql("SELECT count(*) AS n FROM cachecheck_scenarios").to_pylist()[0]["n"] == 0
    assert not s2.verify()


def test_cachecheck_is_not_a_comparator_of_stored_runs():
    from capturestore.comparators import comparator_class

    with pytest.raises(ValueError, match="capturestore cachecheck"):
        comparator_class("cachecheck")().prepare(None)


def test_hf_truncate_past_what_a_sliding_window_keeps_is_not_supported_never_wrong():
    a = make_adapter(tiny_model("gemma3-sliding"), "hf", "float32")
    p = np.random.default_rng(0).integers(4, 1000, 35).tolist()
    h, _ = a.prefill([p])
    a.step(h, [5])
    a.truncate(h[0], 30)  # within the window: fine
    a.step(h, [6])
    with pytest.raises(NotSupported, match="sliding-window cache holds"):
        a.truncate(h[0], 10)


def test_bf16_is_judged_against_its_noise_floor_and_still_catches_a_bug(gqa):
    """BF16 on this CPU: the cached logits equal the full prefix within the BF16 floor (the measured
    noise of the engine's own batch compositions and shapes is below it); a chunk bug is 30x it."""
    clean = check_cache(PagedEngineAdapter(gqa, "bfloat16", max_context=64), scenarios=["single", "chunk_7"])
    assert clean.passed, clean.summary()
    assert clean.tolerance == pytest.approx(2.0 ** -7) and clean.noise <= clean.tolerance / 4
    bad = check_cache(PagedEngineAdapter(gqa, "bfloat16", max_context=64, bugs=("chunk_pos_off_by_one",)),
                      scenarios=["single", "chunk_7"])
    chunk = bad.scenarios[1]
    assert chunk.status == "fail" and chunk.diagnosis == CHUNK and chunk.failed[0].first_position == 7
    assert chunk.failed[0].judgement.max_err > 10 * bad.tolerance


def test_cli_runs_your_own_adapter_class_and_a_missing_operation_is_exit_1_not_run(tmp_path, gqa, capsys):
    own = "tests.capturestore.test_cachecheck:_NoTruncateNoFork"
    rc = main(["cachecheck", "--model", str(gqa), "--engine", own, "--scenarios", "single,truncate",
               "--store", str(tmp_path / "s"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "truncate: not run (the adapter lacks truncate)" in out and "overall: NOT PASSED" in out
    rc = main(["cachecheck", "--model", str(gqa), "--engine", own, "--scenarios", "single",
               "--store", str(tmp_path / "s"), "--quiet"])
    assert rc == 0 and "overall: PASS" in capsys.readouterr().out


def test_the_second_oracle_catches_an_engine_equal_to_its_own_wrong_full_prefix(gqa):
    """A wrong weight makes cached and full prefix agree with each other: the matrix alone passes.
    HF's plain forward (the second oracle) fails it from position 0, systematic."""
    from extractors.cache_adapters import HFCacheAdapter
    from metrics.cache_equivalence import SYSTEMATIC

    hf = HFCacheAdapter(gqa, max_context=64)
    good = check_cache(PagedEngineAdapter(gqa, max_context=64), scenarios=["single"], oracle=hf)
    assert good.passed and good.scenarios[0].name == "oracle"
    assert max(q.judgement.max_err for q in good.scenarios[0].requests) <= 1e-6  # the paged Llama is HF's, bit for bit
    wrong = PagedEngineAdapter(gqa, max_context=64)
    wrong.weights.layers[1].o.mul_(1.01)
    alone = check_cache(wrong, scenarios=["single"])
    assert alone.passed  # equivalent to itself: the first oracle cannot see a wrong weight
    r = check_cache(wrong, scenarios=["single"], oracle=hf)
    oracle = r.scenarios[0]
    assert oracle.status == "fail" and oracle.diagnosis == SYSTEMATIC
    assert oracle.failed[0].first_position == 0 and not r.passed


def test_report_of_a_cache_check_is_a_scenario_by_criterion_grid_from_sql(tmp_path, gqa):
    from capturestore import Store
    from reports.render import render_comparison

    s = Store.open(tmp_path / "store")
    r = cachecheck(gqa, engine="paged", max_context=64, bugs=("stale_slot",), scenarios=["single", "reuse"], store=s)
    index = render_comparison(s, r.comparison_id, tmp_path / "report")
    page = index.read_text()
    assert f"Cache check {r.comparison_id}: FAIL" in page
    assert '<td class="fail">from position 0 (max' in page and "stale or shared cache" in page
    assert "new-in-freed" in page and '<td class="pass">identical</td>' in page  # single: tokens identical
    assert "FROM cachecheck_scenarios" in (tmp_path / "report" / "queries.sql").read_text()


# ------------------------------------------------------------------------ diff between two checks


def test_diff_of_two_cache_checks_shows_the_regression_and_exits_1(tmp_path, gqa, capsys):
    """Two releases of an engine: the second reuses a slot without clearing it. `diff` names the
    scenario that went from pass to fail, where it first differs and by how much; the reverse
    diff is a fix (exit 0); bad input is one line, exit 2."""
    import json

    from capturestore import Store
    from capturestore.cachecheck_diff import diff_cachecheck

    s = Store.open(tmp_path / "store")
    scen = ["single", "reuse", "chunk_7"]
    good = cachecheck(gqa, engine="paged", max_context=64, scenarios=scen, store=s, label="r1")
    bad = cachecheck(gqa, engine="paged", max_context=64, bugs=("stale_slot",), scenarios=scen, store=s, label="r2")
    assert good.passed and not bad.passed
    d = diff_cachecheck(s, "r1", "r2")
    by = {c.scenario: c for c in d.scenarios}
    assert d.regression and [c.scenario for c in d.regressions] == ["reuse"]
    reuse = by["reuse"]
    assert (reuse.base_status, reuse.head_status, reuse.change) == ("pass", "fail", "regressed")
    assert reuse.head_first == ("new-in-freed", 0) and reuse.base_first is None
    assert reuse.head_err > 100 * reuse.tolerance[1] and reuse.base_err <= 1e-5
    assert reuse.head_diagnosis == STALE and "new-in-freed" in reuse.requests_regressed
    assert by["single"].change == "unchanged" and not by["single"].regression

    rc = main(["diff", "r1", "r2", "--store", str(tmp_path / "store")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "reuse     regressed" in out and "new-in-freed@0" in out and "verdict: REGRESSION" in out
    rc = main(["diff", bad.comparison_id, good.comparison_id, "--store", str(tmp_path / "store"), "--format", "json"])
    js = json.loads(capsys.readouterr().out)
    assert rc == 0 and not js["regression"]
    assert {c["scenario"]: c["change"] for c in js["scenarios"]}["reuse"] == "fixed"
    for argv, message in ((["r1", "r1"], "same cache check"), (["r1", "nope"], "neither the id nor the label")):
        rc = main(["diff", *argv, "--store", str(tmp_path / "store")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and message in err, err
