"""compare_runs on synthetic captures written to a real store: metrics match a hand oracle,
verdicts localise injected bugs (layer, phase), bad input is refused before anything is stored."""
import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs, find_reference_run, prompt_split

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
H, D, V = 2, 32, 300


def _prompts(rng):
    """Two prompts of different lengths, each with 6 continuation tokens."""
    return [(rng.integers(4, V, n).tolist(), rng.integers(4, V, 6).tolist()) for n in (9, 14)]


def _bf16(x):
    return x.astype(ml_dtypes.bfloat16)


def _segments(store, table):
    """The Parquet segments holding rows of ``table`` (none: nothing of it was stored); the
    empty ``_schema`` segment a store may create up front holds no rows."""
    return sorted(p for p in (store.root / "tables" / table).glob("*.parquet") if not p.name.startswith("_"))


def _write_run(store, dtype, prompts, kv_fn, logit_fn):
    with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype=dtype) as run:
        for i, (p, c) in enumerate(prompts):
            pid = run.add_prompt(p, continuation=c)
            k, v = kv_fn(i, len(p) + len(c))
            run.write_kv(pid, k, v, layer_names=LAYERS)
            run.write_logits(pid, logit_fn(i, len(c)))
    return run.run_id


@pytest.fixture
def synthetic(tmp_path):
    """An FP32 baseline, its BF16 rounding as expected, and a factory for actual runs."""
    rng = np.random.default_rng(0)
    prompts = _prompts(rng)
    kv = [
        (rng.standard_normal((3, H, len(p) + len(c), D)).astype(np.float32),
         rng.standard_normal((3, H, len(p) + len(c), D)).astype(np.float32))
        for p, c in prompts
    ]
    logits = [rng.standard_normal((len(c), V)).astype(np.float32) * 3 for _, c in prompts]
    store = Store.open(tmp_path / "s")
    base = _write_run(store, "float32", prompts, lambda i, s: kv[i], lambda i, n: logits[i])
    exp = _write_run(store, "bfloat16", prompts, lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1])),
                     lambda i, n: _bf16(logits[i]))

    def actual(kv_fn=None, logit_fn=None):
        return _write_run(
            store, "bfloat16", prompts,
            kv_fn or (lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1]))),
            logit_fn or (lambda i, n: _bf16(logits[i])),
        )

    return store, prompts, kv, logits, base, exp, actual


def test_metrics_match_a_hand_oracle_and_reach_sql(synthetic):
    store, prompts, kv, logits, base, exp, actual = synthetic
    rng = np.random.default_rng(1)
    noise = [(k + rng.standard_normal(k.shape).astype(np.float32) * 0.01, v) for k, v in kv]
    act = actual(kv_fn=lambda i, s: (_bf16(noise[i][0]), _bf16(noise[i][1])))
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)

    # Oracle: relative L-inf of K per (prompt, position, layer, head), computed directly.
    got = store.sql(
        f"SELECT prompt_id, position, layer, head, k_linf, base_k_linf, phase, gen_token_idx FROM kv_head_metrics "
        f"WHERE comparison_id = '{res.comparison_id}'"
    ).to_pylist()
    assert len(got) == sum(3 * H * (len(p) + len(c)) for p, c in prompts)
    pids = list(res.prompt_ids)
    for row in got[:: 7]:
        i = pids.index(row["prompt_id"])
        li = LAYERS.index(row["layer"])
        ref = kv[i][0][li, row["head"], row["position"]].astype(np.float64)
        tgt = _bf16(noise[i][0])[li, row["head"], row["position"]].astype(np.float64)
        bf = _bf16(kv[i][0])[li, row["head"], row["position"]].astype(np.float64)
        assert row["k_linf"] == pytest.approx(np.max(np.abs(tgt - ref)) / np.max(np.abs(ref)), rel=1e-5)
        assert row["base_k_linf"] == pytest.approx(np.max(np.abs(bf - ref)) / np.max(np.abs(ref)), rel=1e-5)
        plen = len(prompts[i][0])
        assert row["gen_token_idx"] == row["position"] - plen
        assert row["phase"] == ("prefill" if row["position"] < plen else "decode")

    n_logit_rows = store.sql(
        f"SELECT count(*) AS n FROM logit_token_metrics WHERE comparison_id = '{res.comparison_id}'"
    ).to_pylist()[0]["n"]
    assert n_logit_rows == sum(len(c) for _, c in prompts)
    cmp = store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert (cmp["baseline_run"], cmp["expected_run"], cmp["actual_run"]) == (base, exp, act)
    assert cmp["three_way"] and cmp["n_prompts"] == 2


def test_positions_outside_a_sliding_window_are_null_in_sql_not_nan(synthetic):
    store, prompts, kv, logits, base, exp, actual = synthetic

    def windowed(i, s):  # layer 0 keeps only its last 4 positions, as HF's sliding layers do
        k, v = _bf16(kv[i][0]), _bf16(kv[i][1])
        k[0, :, : s - 4] = np.nan
        v[0, :, : s - 4] = np.nan
        return k, v

    res = compare_runs(store, expected_run=exp, actual_run=actual(kv_fn=windowed), baseline_run=base)
    rows = store.sql(
        f"SELECT count(*) AS n, count(k_linf) AS measured, max(k_linf) AS worst FROM kv_head_metrics "
        f"WHERE comparison_id = '{res.comparison_id}' AND layer = '{LAYERS[0]}'"
    ).to_pylist()[0]
    assert rows["n"] == sum(H * (len(p) + len(c)) for p, c in prompts)
    assert rows["measured"] == H * 4 * len(prompts)
    assert np.isfinite(rows["worst"])
    n_bc = store.sql(f"SELECT count(k_bc) AS n FROM kv_token_bc WHERE comparison_id = '{res.comparison_id}' "
                     f"AND layer = '{LAYERS[0]}'").to_pylist()[0]["n"]
    assert n_bc == 4 * len(prompts)


def test_a_target_identical_to_bf16_passes_quietly(synthetic):
    store, *_, base, exp, actual = synthetic
    res = compare_runs(store, expected_run=exp, actual_run=actual(), baseline_run=base)
    assert res.passed and res.phase is None and res.first_failing_token is None
    assert res.kv_verdict.passed and res.logit_verdict.passed
    # Identical errors: every pooled BC is 1 and every sigma-ratio exactly 1.
    for layer in res.kv_layers:
        assert layer["k_bc"] == pytest.approx(1.0, abs=1e-9) and layer["k_sigma_ratio"] == pytest.approx(1.0)


def test_a_kv_bug_in_one_layer_is_named_as_the_first_deviating_layer(synthetic):
    store, prompts, kv, logits, base, exp, actual = synthetic

    def broken(i, s):
        k = kv[i][0].copy()
        k[1] *= 1.05  # a 5% scale error in layer 1's K: far beyond bf16 rounding (~0.4%)
        return _bf16(k), _bf16(kv[i][1])

    res = compare_runs(store, expected_run=exp, actual_run=actual(kv_fn=broken), baseline_run=base)
    assert not res.kv_verdict.passed
    assert res.kv_verdict.first_failing_layer == LAYERS[1]
    by_layer = {r["layer"]: r for r in res.kv_layers}
    assert by_layer[LAYERS[0]]["passed"] and by_layer[LAYERS[2]]["passed"]
    assert by_layer[LAYERS[1]]["k_passed"] is False and by_layer[LAYERS[1]]["v_passed"] is True
    row = store.sql(
        f"SELECT kv_passed, kv_first_failing_layer FROM comparisons WHERE comparison_id = '{res.comparison_id}'"
    ).to_pylist()[0]
    assert row == {"kv_passed": False, "kv_first_failing_layer": LAYERS[1]}


@pytest.mark.parametrize("bad_token, phase", [(0, "prefill"), (3, "decode")])
def test_a_logit_bug_names_its_token_and_phase(synthetic, bad_token, phase):
    store, prompts, kv, logits, base, exp, actual = synthetic

    def broken(i, n):
        x = logits[i].copy()
        if i == 1:
            x[bad_token:] = np.random.default_rng(5).standard_normal(x[bad_token:].shape) * 3
        return _bf16(x)

    res = compare_runs(store, expected_run=exp, actual_run=actual(logit_fn=broken), baseline_run=base)
    assert not res.logit_verdict.passed and not res.passed
    assert res.first_failing_token["gen_token_idx"] == bad_token
    assert res.first_failing_token["prompt_id"] == res.prompt_ids[1]
    assert res.phase == phase


def test_two_way_comparison_stores_no_three_way_columns(synthetic):
    store, *_, base, exp, actual = synthetic
    act = actual()
    res = compare_runs(store, expected_run=exp, actual_run=act)
    # a KV verdict needs the baseline's noise: the KV metrics are stored but not judged, so the
    # comparison does not pass on its logits alone (it used to: PASS with the KV unjudged)
    assert res.kv_verdict.summary().startswith("not judged: two-way comparison") and not res.kv_verdict.passed
    assert res.logit_verdict.passed and not res.passed and res.phase is None
    row = store.sql(f"SELECT three_way, baseline_run, passed, kv_passed FROM comparisons "
                    f"WHERE comparison_id = '{res.comparison_id}'")
    assert row.to_pylist() == [{"three_way": False, "baseline_run": None, "passed": False, "kv_passed": None}]
    assert compare_runs(store, expected_run=exp, actual_run=act, kv=False).passed  # logits only, as asked
    n = store.sql(f"SELECT count(*) AS n FROM kv_head_metrics WHERE comparison_id = '{res.comparison_id}' "
                  f"AND base_k_linf IS NOT NULL AND NOT isnan(base_k_linf)").to_pylist()[0]["n"]
    assert n == 0


def test_runs_captured_on_other_tokens_are_refused_before_anything_is_stored(synthetic):
    store, prompts, kv, logits, base, exp, _ = synthetic
    other = [(p, [c[0] + 1] + c[1:]) for p, c in prompts]
    odd = _write_run(store, "bfloat16", other, lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1])),
                     lambda i, n: _bf16(logits[i]))
    with pytest.raises(ValueError, match=r"captured other tokens.*first difference at position 9"):
        compare_runs(store, expected_run=exp, actual_run=odd, baseline_run=base)
    for table in ("comparisons", "kv_head_metrics", "logit_token_metrics", "kv_token_bc"):
        assert not _segments(store, table), table


def test_unknown_run_is_named(synthetic):
    store, *_, base, exp, actual = synthetic
    with pytest.raises(ValueError, match="actual run 'nope'"):
        compare_runs(store, expected_run=exp, actual_run="nope")


def test_reference_runs_are_found_for_reuse_only_when_model_dtype_and_tokens_agree(synthetic):
    from capturestore.writer import prompt_id

    store, prompts, kv, logits, base, exp, _ = synthetic
    pids = [prompt_id(p) for p, _ in prompts]
    kw = dict(model_hash="h0", prompt_ids=pids, engine="synthetic")
    assert find_reference_run(store, dtype="float32", **kw) == base
    assert find_reference_run(store, dtype="float16", **kw) is None
    assert find_reference_run(store, dtype="float32", **{**kw, "model_hash": "h1"}) is None
    teacher = {pid: np.asarray(p + c) for pid, (p, c) in zip(pids, prompts)}
    assert find_reference_run(store, dtype="bfloat16", teacher_tokens=teacher, **kw) == exp
    teacher[pids[0]] = teacher[pids[0]] + 1
    assert find_reference_run(store, dtype="bfloat16", teacher_tokens=teacher, **kw) is None
    tokens, plen = prompt_split(store, base, pids[1])
    assert plen == len(prompts[1][0]) and tokens.tolist() == prompts[1][0] + prompts[1][1]


def test_cli_compare_mirrors_compare_runs_with_exit_status(synthetic, capsys):
    from capturestore.cli import main

    store, prompts, kv, logits, base, exp, actual = synthetic
    good = actual()

    def broken(i, s):
        k = kv[i][0].copy()
        k[2] *= 1.05
        return _bf16(k), _bf16(kv[i][1])

    bad = actual(kv_fn=broken)
    args = ["compare", "--store", str(store.root), "--expected", exp, "--baseline", base]
    assert main([*args, "--actual", good]) == 0
    assert "overall: PASS" in capsys.readouterr().out
    assert main([*args, "--actual", bad, "--label", "broken"]) == 1
    assert f"first deviating KV layer {LAYERS[2]}" in capsys.readouterr().out
    assert main([*args, "--actual", "missing"]) == 2
    assert "actual run 'missing'" in capsys.readouterr().err
    labels = store.sql("SELECT label, passed FROM comparisons ORDER BY created_at").to_pylist()
    assert labels == [{"label": None, "passed": True}, {"label": "broken", "passed": False}]


def test_a_comparison_that_judged_nothing_is_not_stored_as_passed(synthetic):
    store, *_, base, exp, actual = synthetic
    res = compare_runs(store, expected_run=exp, actual_run=actual(), baseline_run=base, logits=False, kv=False)
    assert res.logit_verdict is None and res.kv_verdict is None and not res.passed
    row = store.sql(f"SELECT passed FROM comparisons WHERE comparison_id = '{res.comparison_id}'").to_pylist()
    assert row == [{"passed": False}]


# ----------------------------------------------------------------------------- broken evidence


def _write_run_as(store, prompts, kv_fn, logit_fn, layers=LAYERS, model_hash="h0", with_kv=True, config=None):
    with store.begin_run(engine="synthetic", model_path="/m", model_hash=model_hash, dtype="bfloat16",
                         config=config) as run:
        for i, (p, c) in enumerate(prompts):
            pid = run.add_prompt(p, continuation=c)
            if with_kv:
                k, v = kv_fn(i, len(p) + len(c))
                run.write_kv(pid, k, v, layer_names=layers)
            run.write_logits(pid, logit_fn(i, len(c)))
    return run.run_id


def _stored(store, cid):
    return {t: store.sql(f"SELECT * FROM {t} WHERE comparison_id = '{cid}'").to_pylist() if _segments(store, t) else []
            for t in ("comparisons", "kv_layer_verdicts")}


def test_actual_nan_where_the_references_are_finite_fails_and_is_named(synthetic):
    store, prompts, kv, logits, base, exp, actual = synthetic

    def nan_k1(i, s):  # the actual run's K of layer 1 all NaN (the case: was PASS)
        k = _bf16(kv[i][0])
        k[1] = np.nan
        return k, _bf16(kv[i][1])

    act = actual(kv_fn=nan_k1)
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    assert not res.passed and not res.kv_verdict.passed
    assert res.kv_verdict.first_failing_layer == LAYERS[1]
    pid0 = res.prompt_ids[0]
    n0 = H * D * (len(prompts[0][0]) + len(prompts[0][1]))  # every position: this run declares no unfed last one
    summary = res.kv_verdict.summary()
    assert f"actual run {act}, prompt {pid0}, layer {LAYERS[1]} K: {n0} non-finite values" in summary
    rows = {r["layer"]: r for r in _stored(store, res.comparison_id)["kv_layer_verdicts"]}
    assert rows[LAYERS[1]]["k_passed"] is False and rows[LAYERS[1]]["passed"] is False
    assert rows[LAYERS[1]]["k_nonfinite"] == sum(H * D * (len(p) + len(c)) for p, c in prompts)
    assert rows[LAYERS[0]]["passed"] is True and rows[LAYERS[0]]["k_nonfinite"] == 0
    cmp = _stored(store, res.comparison_id)["comparisons"][0]
    assert cmp["passed"] is False and cmp["kv_passed"] is False and cmp["kv_first_failing_layer"] == LAYERS[1]
    assert "non-finite" in cmp["kv_summary"]


def test_an_unwritten_last_position_passes_only_for_a_run_that_declares_it_never_feeds_it(synthetic):
    """A decode-path capture samples the last teacher token and never feeds it back: its KV there
    is NaN and exempt. A run that writes that position (a prefill over prompt + teacher tokens, or
    one that says nothing) with NaN at every prompt's last position fails: issue 17 (it passed)."""
    store, prompts, kv, logits, base, exp, actual = synthetic

    def never_fed(i, s):
        k, v = _bf16(kv[i][0]), _bf16(kv[i][1])
        k[:, :, -1] = np.nan
        v[:, :, -1] = np.nan
        return k, v

    logit_fn = lambda i, n: _bf16(logits[i])  # noqa: E731
    decode = _write_run_as(store, prompts, never_fed, logit_fn, config={"capture": "teacher_forced_decode"})
    res = compare_runs(store, expected_run=exp, actual_run=decode, baseline_run=base)
    assert res.passed, res.kv_verdict.summary()
    for config in ({"capture": "teacher_forced_prefill"}, None):
        act = _write_run_as(store, prompts, never_fed, logit_fn, config=config)
        res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
        assert not res.passed and res.kv_verdict.passed is False, config
        assert res.kv_verdict.first_failing_layer == LAYERS[0]
        rows = {r["layer"]: r for r in _stored(store, res.comparison_id)["kv_layer_verdicts"]}
        assert [rows[n]["k_nonfinite"] for n in LAYERS] == [len(prompts) * H * D] * 3
        assert f"actual run {act}, prompt {res.prompt_ids[0]}, layer {LAYERS[0]} K: {H * D} non-finite" in \
            res.kv_verdict.summary()


def test_a_layer_the_actual_run_lacks_is_refused_by_name_before_anything_is_stored(synthetic):
    store, prompts, kv, logits, base, exp, _ = synthetic
    short = _write_run_as(store, prompts, lambda i, s: (_bf16(kv[i][0][:2]), _bf16(kv[i][1][:2])),
                          lambda i, n: _bf16(logits[i]), layers=LAYERS[:2])
    with pytest.raises(ValueError, match=rf"actual run {short}, prompt \w+ lacks KV layer.*{LAYERS[2]}.* the references hold"):
        compare_runs(store, expected_run=exp, actual_run=short, baseline_run=base)
    for table in ("comparisons", "kv_head_metrics", "kv_layer_verdicts", "logit_token_metrics"):
        assert not _segments(store, table), table


def test_an_actual_run_without_kv_is_not_compared_and_does_not_pass(synthetic, capsys):
    from capturestore.cli import main

    store, prompts, kv, logits, base, exp, _ = synthetic
    no_kv = _write_run_as(store, prompts, None, lambda i, n: _bf16(logits[i]), with_kv=False)
    res = compare_runs(store, expected_run=exp, actual_run=no_kv, baseline_run=base)
    assert res.logit_verdict.passed and not res.passed
    assert res.kv_verdict.summary().startswith("not compared") and no_kv in res.kv_verdict.summary()
    cmp = _stored(store, res.comparison_id)["comparisons"][0]
    assert cmp["passed"] is False and cmp["kv_passed"] is None and cmp["kv_summary"].startswith("not compared")
    assert res.phase is None
    args = ["compare", "--store", str(store.root), "--expected", exp, "--baseline", base, "--actual", no_kv]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "KV verdict: not compared" in out and "overall: FAIL" in out
    assert main([*args, "--no-kv"]) == 0  # logits only, as asked
    assert "overall: PASS" in capsys.readouterr().out
    assert compare_runs(store, expected_run=exp, actual_run=no_kv, baseline_run=base, kv=False).passed


def test_a_comparison_label_of_two_lines_is_refused_before_anything_is_stored(synthetic, capsys):
    from capturestore.cli import main

    store, *_, base, exp, actual = synthetic
    act = actual()
    with pytest.raises(ValueError, match=r"compare_runs: label 'x\\nFAKE overall: PASS' holds a control character"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, label="x\nFAKE overall: PASS")
    assert main(["compare", "--store", str(store.root), "--expected", exp, "--actual", act, "--label", "a\rb"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not _segments(store, "comparisons")


@pytest.mark.parametrize("lacking", ["expected", "baseline"])
def test_kv_asked_for_and_absent_from_a_reference_is_not_compared_and_holds_the_comparison_back(synthetic, capsys,
                                                                                               lacking):
    """Issue 17: a reference without KV (e.g. a module-capture run found as the reference) gave KV
    verdict None and a PASS on logits alone. Now KV is "not compared", the row's ``judged`` says
    only logits were judged, and --no-kv (KV not asked for) still passes."""
    from capturestore.cli import main

    store, prompts, kv, logits, base, exp, actual = synthetic
    dtype_logits = (lambda i, n: logits[i]) if lacking == "baseline" else (lambda i, n: _bf16(logits[i]))
    ref = _write_run_as(store, prompts, None, dtype_logits, with_kv=False)
    roles = {"baseline_run": base, "expected_run": exp, **{f"{lacking}_run": ref}}
    act = actual()
    res = compare_runs(store, actual_run=act, **roles)
    assert res.verdicts["logits"].passed is True and res.verdicts["kv"].passed is None and not res.passed
    summary = res.kv_verdict.summary()
    assert summary.startswith("not compared") and f"{lacking} run {ref} holds no KV for 2 of the 2" in summary
    cmp = _stored(store, res.comparison_id)["comparisons"][0]
    assert cmp["passed"] is False and cmp["kv_passed"] is None and cmp["judged"] == ["logits"]
    args = ["compare", "--store", str(store.root), "--expected", roles["expected_run"], "--baseline",
            roles["baseline_run"], "--actual", act]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "KV verdict: not compared" in out and "overall: FAIL" in out
    assert main([*args, "--no-kv"]) == 0  # logits only, as asked
    assert "overall: PASS" in capsys.readouterr().out
    ok = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    assert ok.passed
    assert _stored(store, ok.comparison_id)["comparisons"][0]["judged"] == ["logits", "kv"]


def test_a_stored_pass_never_summarises_an_unjudged_part(synthetic):
    store, prompts, kv, logits, base, exp, _ = synthetic

    def v2_nan(i, s):  # V of layer 2 NaN in every run: nothing finite to judge there
        k, v = kv[i][0], kv[i][1].copy()
        v[2] = np.nan
        return k, v

    base2 = _write_run_as(store, prompts, v2_nan, lambda i, n: logits[i])
    exp2 = _write_run_as(store, prompts, lambda i, s: tuple(_bf16(x) for x in v2_nan(i, s)), lambda i, n: _bf16(logits[i]))
    act2 = _write_run_as(store, prompts, lambda i, s: tuple(_bf16(x) for x in v2_nan(i, s)), lambda i, n: _bf16(logits[i]))
    res = compare_runs(store, expected_run=exp2, actual_run=act2, baseline_run=base2)
    assert not res.passed and not res.kv_verdict.passed and res.kv_verdict.first_failing_layer is None
    assert "not judged" in res.kv_verdict.summary()
    rows = {r["layer"]: r for r in _stored(store, res.comparison_id)["kv_layer_verdicts"]}
    assert rows[LAYERS[2]]["k_passed"] is True and rows[LAYERS[2]]["v_passed"] is None
    assert rows[LAYERS[2]]["passed"] is None
    bad = store.sql("SELECT count(*) AS n FROM kv_layer_verdicts WHERE passed AND (k_passed IS NULL OR v_passed IS NULL "
                    "OR NOT k_passed OR NOT v_passed)").to_pylist()[0]["n"]
    assert bad == 0


def test_runs_of_different_models_are_refused_unless_asked_and_recorded(synthetic, capsys):
    from capturestore.cli import main

    store, prompts, kv, logits, base, exp, _ = synthetic
    other = _write_run_as(store, prompts, lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1])),
                          lambda i, n: _bf16(logits[i]), model_hash="h1")
    with pytest.raises(ValueError, match=rf"model_hash.*actual run {other}: h1.*allow_different_models=True"):
        compare_runs(store, expected_run=exp, actual_run=other, baseline_run=base)
    assert not _segments(store, "comparisons")
    args = ["compare", "--store", str(store.root), "--expected", exp, "--baseline", base, "--actual", other]
    assert main(args) == 2
    assert "--allow-different-models" in capsys.readouterr().err
    assert main([*args, "--allow-different-models"]) == 0
    res = compare_runs(store, expected_run=exp, actual_run=other, baseline_run=base, allow_different_models=True)
    assert res.passed and res.models_differ
    twin = _write_run_as(store, prompts, lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1])),
                         lambda i, n: _bf16(logits[i]), model_hash="h0")
    same = compare_runs(store, expected_run=exp, actual_run=twin, baseline_run=base)
    rows = store.sql("SELECT comparison_id, models_differ FROM comparisons").to_pylist()
    got = {r["comparison_id"]: r["models_differ"] for r in rows}
    assert got[res.comparison_id] is True and got[same.comparison_id] is False and sum(got.values()) == 2


def test_layers_held_in_kv_groups_are_compared_and_judged_together(tmp_path):
    """A run whose layers differ in shape holds one KV array per group; every group's layers
    are compared (they used to be skipped or mixed up: one group's names for another's array)."""
    rng = np.random.default_rng(3)
    prompts = _prompts(rng)
    full = [rng.standard_normal((2, H, len(p) + len(c), D)).astype(np.float32) for p, c in prompts]
    wide = [rng.standard_normal((1, 1, len(p) + len(c), 2 * D)).astype(np.float32) for p, c in prompts]
    logits = [rng.standard_normal((len(c), V)).astype(np.float32) for _, c in prompts]
    store = Store.open(tmp_path / "s")

    def write(dtype, cast, nan_wide=False):
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype=dtype) as run:
            for i, (p, c) in enumerate(prompts):
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(full[i]), cast(full[i]), layer_names=["l0", "l2"])
                w = cast(wide[i])
                if nan_wide:
                    w[0, 0, 3] = np.nan
                run.write_kv(pid, w, cast(wide[i]), layer_names=["l1"], group="wide")
                run.write_logits(pid, cast(logits[i]))
        return run.run_id

    base, exp = write("float32", lambda x: x.copy()), write("bfloat16", _bf16)
    res = compare_runs(store, expected_run=exp, actual_run=write("bfloat16", _bf16), baseline_run=base)
    assert res.passed and [lv.layer for lv in res.kv_verdict.layers] == ["l0", "l1", "l2"]
    assert res.kv_verdict.layers[1].k.n_values == sum(2 * D * (len(p) + len(c)) for p, c in prompts)
    bad = compare_runs(store, expected_run=exp, actual_run=write("bfloat16", _bf16, nan_wide=True), baseline_run=base)
    assert not bad.passed and bad.kv_verdict.first_failing_layer == "l1"
    assert bad.kv_verdict.layers[1].k.n_nonfinite == 2 * 2 * D  # position 3 of both prompts


def test_one_run_in_two_roles_is_refused(synthetic):
    # baseline == actual gave sigma-ratio 1.0 and "KV within noise"; all three the same gave 0.0: PASS both
    store, prompts, kv, logits, base, exp, actual = synthetic
    act = actual()
    for roles, named in (({"expected_run": exp, "actual_run": act, "baseline_run": act}, "baseline, actual"),
                         ({"expected_run": exp, "actual_run": exp, "baseline_run": exp}, "baseline, expected, actual"),
                         ({"expected_run": act, "actual_run": act}, "expected, actual")):
        with pytest.raises(ValueError, match=f"fills the roles {named}: a run compared with itself"):
            compare_runs(store, **roles)
    assert _segments(store, "comparisons") == []


def test_an_actual_prompt_a_reference_lacks_is_refused_and_extra_reference_prompts_are_not(synthetic):
    store, prompts, kv, logits, base, exp, actual = synthetic
    rng = np.random.default_rng(5)
    extra = (rng.integers(4, V, 11).tolist(), rng.integers(4, V, 6).tolist())
    big_kv = [*kv, (rng.standard_normal((3, H, 17, D)).astype(np.float32),) * 2]
    big_logits = [*logits, rng.standard_normal((6, V)).astype(np.float32)]
    act = _write_run(store, "bfloat16", [*prompts, extra], lambda i, s: (_bf16(big_kv[i][0]), _bf16(big_kv[i][1])),
                     lambda i, n: _bf16(big_logits[i]))
    with pytest.raises(ValueError, match=r"baseline run \S+ lacks 1 of the actual run's 3 prompts"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    assert _segments(store, "comparisons") == []
    # references holding more prompts than the actual run: the actual's prompts are compared
    small = _write_run(store, "bfloat16", prompts[:1], lambda i, s: (_bf16(kv[i][0]), _bf16(kv[i][1])),
                       lambda i, n: _bf16(logits[i]))
    res = compare_runs(store, expected_run=exp, actual_run=small, baseline_run=base)
    assert len(res.prompt_ids) == 1 and res.passed


@pytest.mark.parametrize("role", ["baseline", "expected"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_reference_logits_are_refused_by_role_run_and_token(synthetic, role, value):
    # an all-NaN baseline passed through the static top-k fallback without a word about the baseline
    store, prompts, kv, logits, base, exp, actual = synthetic
    broken = [x.copy() for x in logits]
    broken[1][3, :40] = value
    dtype = "float32" if role == "baseline" else "bfloat16"
    cast = (lambda x: x) if role == "baseline" else _bf16
    bad = _write_run(store, dtype, prompts, lambda i, s: (cast(kv[i][0]), cast(kv[i][1])), lambda i, n: cast(broken[i]))
    roles = {"baseline_run": base, "expected_run": exp, f"{role}_run": bad, "actual_run": actual()}
    with pytest.raises(ValueError, match=rf"{role} run {bad} holds 40 NaN/\+inf logits \(first at gen token 3\)"):
        compare_runs(store, **roles)
    assert _segments(store, "comparisons") == []
