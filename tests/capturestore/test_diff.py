"""capturestore.diff on real comparisons (compare_runs over captures written to a real store):
a correct release against itself is no regression (exit 0), an injected KV bug is a regression
named at its layer and phase (exit 1), a change below BF16 noise is not one, the bootstrap
interval equals a slow independent computation, and bad input is one line (exit 2)."""
import json

import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.cli import main
from capturestore.diff import BC_MARGIN, SIGMA_MARGIN, bootstrap_indices, diff, history

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
H, D, V, N_PROMPTS, N_GEN = 2, 16, 64, 12, 6
BUG_LAYER = 2


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """FP32 baseline and BF16 reference of 12 prompts; actual runs of releases:
    r1 (twice: a correct engine, BF16 rounding of the FP32 values), r1-noise (the values perturbed
    by 7e-4 relative before rounding: below BF16's own 2^-8/sqrt(12) ~ 1.1e-3 RMS rounding noise),
    r2-bug (r1 with layer 2's K and V scaled by 1.02 at decode positions only), and a run of
    another model and one over other prompts."""
    rng = np.random.default_rng(7)
    store = Store.open(tmp_path_factory.mktemp("diff") / "s")
    prompts = [(rng.integers(0, V, 5 + i % 4).tolist(), rng.integers(0, V, N_GEN).tolist()) for i in range(N_PROMPTS)]
    data = []
    for p, c in prompts:
        S = len(p) + len(c)
        data.append((rng.standard_normal((4, H, S, D)).astype(np.float32),
                     rng.standard_normal((4, H, S, D)).astype(np.float32),
                     (3 * rng.standard_normal((len(c), V))).astype(np.float32)))

    def run(dtype, f, release=None, model_hash="h", which=range(N_PROMPTS)):
        with store.begin_run(engine="synthetic", model_path="/m", model_hash=model_hash, dtype=dtype,
                             release=release) as w:
            for i in which:
                p, c = prompts[i]
                pid = w.add_prompt(p, continuation=c)
                k, v, lg = f(i, len(p))
                w.write_kv(pid, k, v, layer_names=LAYERS)
                w.write_logits(pid, lg)
        return w.run_id

    ident = lambda i, plen: data[i]  # noqa: E731
    rounded = lambda i, plen: tuple(_bf16(x) for x in data[i])  # noqa: E731
    base = run("float32", ident)
    exp = run("bfloat16", rounded)

    def noisy(i, plen):
        r = np.random.default_rng(100 + i)
        return tuple(_bf16(x * (1 + 7e-4 * r.standard_normal(x.shape).astype(np.float32))) for x in data[i])

    def bug(i, plen):
        k, v, lg = (x.copy() for x in data[i])
        k[BUG_LAYER, :, plen:] *= 1.02
        v[BUG_LAYER, :, plen:] *= 1.02
        return _bf16(k), _bf16(v), _bf16(lg)

    def cmp(actual, **kw):
        return compare_runs(store, expected_run=exp, actual_run=actual, baseline_run=base,
                            comparators=["raw_errors"], **kw).comparison_id

    ids = {
        "r1a": cmp(run("bfloat16", rounded, "r1")),
        "r1b": cmp(run("bfloat16", rounded, "r1")),
        "noise": cmp(run("bfloat16", noisy, "r1-noise")),
        "bug": cmp(run("bfloat16", bug, "r2-bug")),
    }
    other_model = {
        "b": run("float32", ident, model_hash="h2"), "e": run("bfloat16", rounded, model_hash="h2"),
        "a": run("bfloat16", rounded, "r1-other-model", model_hash="h2")}
    ids["other_model"] = compare_runs(store, expected_run=other_model["e"], actual_run=other_model["a"],
                                      baseline_run=other_model["b"]).comparison_id
    ids["half"] = cmp(run("bfloat16", rounded, "r1-half", which=range(6)))
    ids["disjoint"] = compare_runs(store, expected_run=exp, actual_run=run("bfloat16", rounded, "r1-rest",
                                   which=range(6, 12)), baseline_run=base).comparison_id
    ids["half2"] = ids["half"]
    return store, ids


def test_a_correct_release_against_itself_is_no_regression_exit_0(releases, capsys):
    store, ids = releases
    r = diff(store, ids["r1a"], ids["r1b"])
    assert not r.regression and r.verdict_changes == () and r.divergences == ()
    assert len(r.prompt_ids) == N_PROMPTS and r.stat_changes
    assert all(c.delta == 0 and c.ci_low == 0 == c.ci_high for c in r.stat_changes)
    assert main(["diff", ids["r1a"], ids["r1b"], "--store", str(store.root)]) == 0
    assert "no regression" in capsys.readouterr().out


def test_an_injected_bug_is_a_regression_at_its_layer_and_phase_exit_1(releases, capsys):
    store, ids = releases
    r = diff(store, "r1", "r2-bug")  # release labels: the latest comparison of each
    assert (r.base_id, r.head_id) == (ids["r1b"], ids["bug"])
    assert r.regression
    v = {(c.check, c.layer): c for c in r.verdict_changes}
    assert v[("passed", str(BUG_LAYER))].regression and v[("kv_passed", None)].regression
    assert v[("kv_layer", LAYERS[BUG_LAYER])].base is True and v[("kv_layer", LAYERS[BUG_LAYER])].head is False
    assert r.localisation["layer"] == str(BUG_LAYER) and r.localisation["phase"] == "decode"
    stats = [c for c in r.stat_changes if c.regression]
    assert {(c.metric, c.layer, c.phase, c.kv) for c in stats} == {
        (m, LAYERS[BUG_LAYER], "decode", kv) for m in ("kv_sigma_ratio", "kv_aggregate_bc") for kv in "kv"}
    # the clean layers and the bug layer's prefill: no change at all
    clean = [c for c in r.stat_changes if c.metric == "kv_sigma_ratio" and (c.layer != LAYERS[BUG_LAYER] or
                                                                           c.phase == "prefill")]
    assert clean and all(c.delta == 0 for c in clean)
    assert main(["diff", "r1", "r2-bug", "--store", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION at layer 2" in out and "phase decode" in out
    assert main(["diff", "r1", "r2-bug", "--store", str(store.root), "--format", "json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert j["regression"] is True and j["localisation"]["layer"] == "2"


def test_a_change_below_bf16_noise_is_not_a_regression(releases):
    store, ids = releases
    r = diff(store, ids["r1a"], ids["noise"])
    kv = [c for c in r.stat_changes if c.metric == "kv_sigma_ratio"]
    # the change is real (every interval above zero) but smaller than the margin: reported, not flagged
    assert kv and all(0 < c.ci_low and c.delta < SIGMA_MARGIN for c in kv)
    bc = [c for c in r.stat_changes if c.metric == "kv_aggregate_bc"]
    assert len(bc) == 2 * len(LAYERS) and all(-BC_MARGIN < c.delta < 0 for c in bc)
    assert not any(c.regression for c in r.stat_changes)
    assert not [c for c in r.verdict_changes if c.regression], r.verdict_changes
    assert not r.regression


def _slow_interval(store, base_id, head_id, pids, layer, phase, kv, n_boot, seed):
    """The bootstrap of docs/diff.md written out: per resample, the σ-ratio of each comparison
    from its kv_head_metrics rows of the drawn prompts (repeats counted), head - base, then the
    2.5 / 97.5 % quantiles by sorting and interpolating."""
    rows = {}
    for cid in (base_id, head_id):
        t = store.sql(f"SELECT prompt_id, {kv}_l2 AS t, base_{kv}_l2 AS b FROM kv_head_metrics WHERE comparison_id = "
                      f"'{cid}' AND layer = '{layer}' AND phase = '{phase}'").to_pylist()
        rows[cid] = {p: [(r["t"], r["b"]) for r in t if r["prompt_id"] == p] for p in pids}
    draws = np.random.default_rng(seed).integers(0, len(pids), (n_boot, len(pids)))
    deltas = []
    for d in draws:
        sig = []
        for cid in (base_id, head_id):
            st = sb = 0.0
            for i in d:
                for t, b in rows[cid][pids[i]]:
                    st += t * t
                    sb += b * b
            sig.append((st / sb) ** 0.5)
        deltas.append(sig[1] - sig[0])
    deltas.sort()

    def quantile(q):
        pos = q * (len(deltas) - 1)
        lo = int(pos)
        return deltas[lo] + (deltas[min(lo + 1, len(deltas) - 1)] - deltas[lo]) * (pos - lo)

    return quantile(0.025), quantile(0.975)


def test_the_bootstrap_interval_equals_a_slow_independent_computation(releases):
    store, ids = releases
    r = diff(store, ids["noise"], ids["bug"], n_boot=300, seed=11)
    assert r.prompt_ids == tuple(sorted(r.prompt_ids))
    for layer, phase, kv in ((LAYERS[BUG_LAYER], "decode", "v"), (LAYERS[0], "prefill", "k")):
        c = next(c for c in r.stat_changes
                 if (c.metric, c.layer, c.phase, c.kv) == ("kv_sigma_ratio", layer, phase, kv))
        lo, hi = _slow_interval(store, ids["noise"], ids["bug"], list(r.prompt_ids), layer, phase, kv, 300, 11)
        assert c.ci_low == pytest.approx(lo, rel=1e-9, abs=1e-12)
        assert c.ci_high == pytest.approx(hi, rel=1e-9, abs=1e-12)
        assert c.ci_low < c.delta < c.ci_high or c.ci_low == c.ci_high
    assert bootstrap_indices(5, 3, 11).tolist() == np.random.default_rng(11).integers(0, 5, (3, 5)).tolist()
    other = diff(store, ids["noise"], ids["bug"], n_boot=300, seed=12)
    assert [c.ci_low for c in other.stat_changes] != [c.ci_low for c in r.stat_changes]  # the seed matters


def _slow_bc_interval(store, cid_b, cid_h, pids, layer_idx, kv, n_boot, seed):
    """The aggregate-BC bootstrap of docs/diff.md written out: per resample, each comparison's drawn
    prompts' raw errors concatenated (repeats included), binned with numpy.histogram over the full
    pool's joint range, BC = sum sqrt(p q); head - base; percentile interval."""
    def samples(cid):
        t = store.sql(f"SELECT prompt_id, base_{kv} AS b, tgt_{kv} AS t FROM raw_errors WHERE comparison_id = '{cid}' "
                      f"AND layer_idx = {layer_idx}").to_pylist()
        return {p: (np.array([x for r in t if r["prompt_id"] == p for x in r["b"]], np.float32),
                    np.array([x for r in t if r["prompt_id"] == p for x in r["t"]], np.float32)) for p in pids}

    def bc(e, t, lo, hi):
        he = np.histogram(e, np.linspace(lo, hi, 101, dtype=np.float32))[0]
        ht = np.histogram(t, np.linspace(lo, hi, 101, dtype=np.float32))[0]
        p, q = he / (he.sum() + 1e-10), ht / (ht.sum() + 1e-10)
        return min(1.0, max(0.0, float(np.sum(np.sqrt(p * q)))))

    draws = np.random.default_rng(seed).integers(0, len(pids), (n_boot, len(pids)))
    per = {cid: samples(cid) for cid in (cid_b, cid_h)}
    deltas = np.zeros(n_boot)
    for cid, sign in ((cid_b, -1), (cid_h, 1)):
        s = per[cid]
        e_all = np.concatenate([s[p][0] for p in pids])
        t_all = np.concatenate([s[p][1] for p in pids])
        lo, hi = min(e_all.min(), t_all.min()), max(e_all.max(), t_all.max())
        for i, d in enumerate(draws):
            deltas[i] += sign * bc(np.concatenate([s[pids[j]][0] for j in d]),
                                   np.concatenate([s[pids[j]][1] for j in d]), lo, hi)
    return tuple(np.quantile(deltas, [0.025, 0.975]))


def test_the_aggregate_bc_interval_equals_a_slow_independent_computation(releases):
    store, ids = releases
    r = diff(store, ids["noise"], ids["bug"], n_boot=200, seed=5)
    for li, kv in ((BUG_LAYER, "v"), (0, "k")):
        c = next(c for c in r.stat_changes if (c.metric, c.layer, c.kv) == ("kv_aggregate_bc", LAYERS[li], kv))
        lo, hi = _slow_bc_interval(store, ids["noise"], ids["bug"], list(r.prompt_ids), li, kv, 200, 5)
        assert c.ci_low == pytest.approx(lo, abs=1e-12) and c.ci_high == pytest.approx(hi, abs=1e-12)
    from metrics.bc import bhattacharyya_coefficient

    c = next(c for c in r.stat_changes if (c.metric, c.layer, c.kv) == ("kv_aggregate_bc", LAYERS[BUG_LAYER], "k"))
    t = store.sql(f"SELECT flatten(list(base_k)) AS b, flatten(list(tgt_k)) AS t FROM raw_errors WHERE comparison_id = "
                  f"'{ids['bug']}' AND layer_idx = {BUG_LAYER}").to_pylist()[0]
    assert c.head == bhattacharyya_coefficient(np.array(t["b"], np.float32), np.array(t["t"], np.float32))


def test_bad_input_is_one_line_exit_2(releases, capsys):
    store, ids = releases
    s = str(store.root)
    cases = [
        (["diff", "cmp-nope", ids["r1a"]], "neither a comparison id nor a release label"),
        (["diff", ids["r1a"], ids["other_model"]], "different models"),
        (["diff", ids["half"], ids["disjoint"]], "share no prompt"),
        (["diff", ids["r1a"], ids["half"]], "--common-prompts"),
        (["diff", "r1", ids["r1b"]], "same comparison"),
        (["history", "--model", "/nope"], "no comparison of model"),
        (["history", "--model", "h", "--metric", "nope"], "unknown metric"),
        (["history", "--model", "h", "--metric", "release"], "unknown metric"),  # a runs column, not a metric
        (["diff", "r1", "r2-bug", "--format", "html"], "needs --out DIR"),
        (["diff", "r1", "r2-bug", "--n-boot", "10"], "too few resamples"),
        # a traceback (numpy could not allocate 29 TiB of draws), and numpy's "expected non-negative integer"
        (["diff", "r1", "r2-bug", "--n-boot", "1000000000000"], "more resamples than a 95% interval needs"),
        (["diff", "r1", "r2-bug", "--seed", "-1"], "seed -1 must be a non-negative integer"),
    ]
    for argv, msg in cases:
        assert main([*argv, "--store", s]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, (argv, err)
    assert main(["diff", ids["r1a"], ids["half"], "--common-prompts", "--store", s]) == 0
    assert "6 prompts both hold" in capsys.readouterr().out
    r = diff(store, ids["r1a"], ids["half"], common_prompts=True)
    assert len(r.prompt_ids) == 6 and "6 prompts both hold" in r.note and not r.regression
    import capturestore.diff as diff_module

    with pytest.MonkeyPatch.context() as m:  # resamples x shared prompts past the bound (1 GiB an array; here smaller)
        m.setattr(diff_module, "MAX_BOOT_DRAWS", 6 * 300 - 1)
        with pytest.raises(ValueError, match="300 x 6 shared prompts is 1,800 bootstrap draws, over 1,799"):
            diff(store, ids["r1a"], ids["half"], common_prompts=True, n_boot=300)
        assert not diff(store, ids["r1a"], ids["half"], common_prompts=True, n_boot=299).regression


def test_html_diff_goes_through_the_reports_page(releases, tmp_path, capsys):
    store, ids = releases
    assert main(["diff", "r1", "r2-bug", "--store", str(store.root), "--format", "html", "--out",
                 str(tmp_path / "rep")]) == 1
    page = (tmp_path / "rep" / "diff.html").read_text()
    assert "REGRESSION" in page and 'id="diff-sigma-changes"' in page and LAYERS[BUG_LAYER] in page


def test_history_lists_the_metric_per_release_and_charts_it(releases, tmp_path, capsys):
    store, ids = releases
    t = history(store, "h", "kv_sigma_ratio")
    rows = t.to_pylist()
    rel = [r["release"] for r in rows]
    assert rel[:4] == ["r1", "r1", "r1-noise", "r2-bug"]
    by = {r["comparison_id"]: r for r in rows}
    assert by[ids["r1a"]]["kv_sigma_ratio"] == pytest.approx(1.0)
    worst = store.sql(f"SELECT max(greatest(k_sigma_ratio, v_sigma_ratio)) FROM kv_layer_verdicts WHERE "
                      f"comparison_id = '{ids['bug']}'").column(0)[0].as_py()
    assert by[ids["bug"]]["kv_sigma_ratio"] == worst > 1.5
    assert main(["history", "--model", "/m", "--metric", "passed", "--store", str(store.root)]) == 0
    assert "r2-bug" in capsys.readouterr().out
    out = tmp_path / "h.html"
    assert main(["history", "--model", "h", "--metric", "kv_sigma_ratio", "--format", "html", "--out", str(out),
                 "--store", str(store.root)]) == 0
    html = out.read_text()
    assert "plotly" in html.lower() and "r2-bug" in html


def test_real_hf_captures_a_faulty_release_regresses_at_the_next_kv_layer_in_prefill(tmp_path):
    """Real captures of a tiny HF Llama (extractors.models): FP32 baseline, BF16 reference, and two
    releases of a BF16 "engine": r1 (correct) and r2 (layer 1's o_proj output scaled by 1.1 by a
    forward hook, as extractors.faults does in vLLM; proven to change the logits first). A bug in
    layer 1 first shows in the KV of layer 2 (its input), from the prompt on: prefill."""
    from extractors import hf
    from extractors.models import tiny_model

    path = tiny_model("llama-gqa")
    store = Store.open(tmp_path / "s")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 200, 6 + i).tolist() for i in range(8)]
    teach = [rng.integers(5, 200, 5).tolist() for _ in prompts]
    m32, m16 = hf.load_hf_model(path, "float32"), hf.load_hf_model(path, "bfloat16")
    base = hf.capture_hf_run(store, path, prompts, teacher_tokens=teach, dtype="float32", model=m32)
    exp = hf.capture_hf_run(store, path, prompts, teacher_tokens=teach, dtype="bfloat16", model=m16)
    ok = hf.capture_hf_run(store, path, prompts, teacher_tokens=teach, dtype="bfloat16", model=m16, release="r1")
    handle = m16.get_submodule("model.layers.1.self_attn.o_proj").register_forward_hook(lambda m, i, o: o * 1.1)
    try:
        bad = hf.capture_hf_run(store, path, prompts, teacher_tokens=teach, dtype="bfloat16", model=m16, release="r2")
    finally:
        handle.remove()
    pid = store.prompts(ok).column("prompt_id")[0].as_py()
    moved = np.abs(store.read_logits(bad, pid, as_torch=True).float().numpy() -
                   store.read_logits(ok, pid, as_torch=True).float().numpy()).max()
    assert moved > 0.01, "the injected fault changed nothing: no verdict on it is meaningful"
    for actual in (ok, bad):
        compare_runs(store, expected_run=exp, actual_run=actual, baseline_run=base, comparators=["raw_errors"])
    r = diff(store, "r1", "r2")
    assert r.regression and r.localisation["layer"] == "2" and r.localisation["phase"] == "prefill", r.localisation
    from capturestore.comparators import decoder_layer_index

    kv = [c for c in r.stat_changes if c.metric == "kv_sigma_ratio"]
    worst = max(kv, key=lambda c: c.delta)
    assert decoder_layer_index(worst.layer) == 2 and worst.regression, worst
    before = [c for c in kv if decoder_layer_index(c.layer) in (0, 1)]
    assert len(before) == 8 and all(c.delta == 0 for c in before)  # layers 0 and 1's KV come before the fault
    assert main(["diff", "r1", "r2", "--store", str(store.root)]) == 1


def test_real_hf_module_captures_a_decode_only_fault_regresses_at_its_module_in_decode(tmp_path):
    """Module tensors of a tiny HF Llama captured in FP32, BF16 and two BF16 releases; r2's
    layer-1 o_proj output is scaled by 1.1 on decode steps only (a forward hook that fires when the
    step feeds one token), proven to change r2's decode logits and leave its prefill logit alone.
    The diff names that module and the decode phase; its prefill is no regression."""
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.modules import capture_hf_module_run

    path = tiny_model("llama-gqa")
    store = Store.open(tmp_path / "s")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, 6 + i).tolist() for i in range(6)]
    teach = [rng.integers(5, 200, 4).tolist() for _ in prompts]
    mods = ("model.layers.*", "model.layers.*.self_attn.o_proj", "model.layers.*.mlp")
    m32, m16 = load_hf_model(path, "float32"), load_hf_model(path, "bfloat16")
    cap = lambda m, dtype, rel=None: capture_hf_module_run(store, path, prompts, teach, modules=mods,  # noqa: E731
                                                            dtype=dtype, model=m, release=rel)
    base, exp, ok = cap(m32, "float32"), cap(m16, "bfloat16"), cap(m16, "bfloat16", "r1")
    target = "model.layers.1.self_attn.o_proj"
    handle = m16.get_submodule(target).register_forward_hook(
        lambda m, i, o: o * 1.1 if i[0].shape[-2] == 1 else o)  # decode steps feed one token
    try:
        bad = cap(m16, "bfloat16", "r2")
    finally:
        handle.remove()
    pid = store.prompts(ok).column("prompt_id")[0].as_py()
    lo, lb = (store.read_logits(r, pid, as_torch=True).float().numpy() for r in (ok, bad))
    assert np.array_equal(lo[0], lb[0]) and np.abs(lo[1:] - lb[1:]).max() > 0.01  # prefill untouched, decode moved
    for actual in (ok, bad):
        compare_runs(store, expected_run=exp, actual_run=actual, baseline_run=base, comparators=["modules"],
                     kv=False)  # module runs hold no KV: asked for, it would be "not compared" (no pass)
    r = diff(store, "r1", "r2")
    assert r.regression
    mv = {(c.module, c.phase): c for c in r.verdict_changes if c.check == "module"}
    assert mv[(target, "decode")].regression and (target, "prefill") not in mv
    assert r.localisation["module"] == target and r.localisation["phase"] == "decode", r.localisation
    sig = {(c.module, c.phase): c for c in r.stat_changes if c.metric == "module_sigma_ratio"}
    assert sig[(target, "decode")].regression and sig[(target, "prefill")].delta == 0
    assert not any(c.regression for (m, ph), c in sig.items() if ph == "prefill")
