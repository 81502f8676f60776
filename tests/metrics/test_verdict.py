"""Verdicts: quiet on a simulated correct BF16 engine, loud (and localised) on injected bugs."""
import math

import ml_dtypes
import numpy as np

from metrics.kv import compare_kv_caches
from metrics.logits import logit_validation
from metrics.verdict import KVVerdictConfig, aggregate_kv_verdict, aggregate_logit_verdict

BF16 = ml_dtypes.bfloat16


def bf16(x):
    return np.asarray(x, np.float32).astype(BF16)


def bf16_engine(x, rng):
    """A correct BF16 engine: its own accumulated bf16 noise (~1 ulp), then bf16 storage.
    Expected (HF BF16) and actual are two independent draws of the same noise."""
    return bf16(x * (1 + rng.normal(size=x.shape) * 2e-3))


def kv_prompt(rng, layers=4, H=2, S=12, D=32, bug=None):
    base = {f"layers.{i}": (rng.normal(size=(1, H, S, D)).astype(np.float32), rng.normal(size=(1, H, S, D)).astype(np.float32)) for i in range(layers)}
    exp = {n: (bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()}
    act = {n: (bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()}
    if bug:
        act = bug(base, act)
    return compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)


def test_kv_verdict_quiet_on_correct_engine_where_per_token_bc_rule_is_not():
    rng = np.random.default_rng(0)
    outs = [kv_prompt(rng) for _ in range(6)]
    # the naive rule: every token x layer BC >= 0.90 (64 values per histogram here)
    naive_fail = np.mean([np.mean(res.k_bc < 0.90) for res, _ in outs])
    assert naive_fail > 0.3
    v = aggregate_kv_verdict([raw for _, raw in outs], prompt_lens=[8] * 6)
    assert v.passed, v.summary()
    assert v.first_failing_layer is None and v.prefill.passed and v.decode.passed
    lk = v.layers[0].k
    assert lk.n_values == 6 * 12 * 64 and 0.8 < lk.sigma_ratio < 1.25 and lk.noise_bc > 0.9


def test_kv_verdict_names_first_deviating_layer():
    rng = np.random.default_rng(1)

    def bug(base, act):  # layers 2 and 3 carry 4 % excess error in V
        for i in (2, 3):
            k, _ = act[f"layers.{i}"]
            act[f"layers.{i}"] = (k, bf16(base[f"layers.{i}"][1] * 1.04))
        return act

    v = aggregate_kv_verdict([kv_prompt(rng, bug=bug)[1] for _ in range(4)])
    assert not v.passed and v.first_failing_layer == "layers.2"
    lv = v.layers[2]
    assert lv.k.passed and lv.v.passed is False and lv.v.sigma_ratio > 3
    assert "layers.2 (V)" in v.summary()
    assert all(v.layers[i].passed for i in (0, 1))


def test_kv_verdict_fp32_target_passes_on_sigma_ratio():
    rng = np.random.default_rng(2)
    v = aggregate_kv_verdict([kv_prompt(rng, bug=lambda base, act: base)[1] for _ in range(2)])
    assert v.passed and all(lv.k.decided_by == "sigma_ratio" and lv.k.sigma_ratio == 0 for lv in v.layers)


def test_kv_verdict_decode_only_bug_splits_by_phase():
    rng = np.random.default_rng(3)

    def stale_decode(base, act):  # positions >= 8 hold garbage in layer 1 K
        k, vv = act["layers.1"]
        k = k.copy()
        k[:, :, 8:] = bf16(rng.normal(size=k[:, :, 8:].shape))
        act["layers.1"] = (k, vv)
        return act

    v = aggregate_kv_verdict([kv_prompt(rng, bug=stale_decode)[1] for _ in range(3)], prompt_lens=[8, 8, 8])
    assert not v.passed and v.first_failing_layer == "layers.1"
    assert v.prefill.passed and not v.decode.passed


def test_kv_thresholds_are_configurable():
    rng = np.random.default_rng(4)
    raws = [kv_prompt(rng)[1] for _ in range(3)]
    strict = KVVerdictConfig(bc_threshold=1.0, bc_noise_margin=-1.0, linf_ratio_threshold=0.5, sigma_ratio_threshold=0.0)
    v = aggregate_kv_verdict(raws, config=strict)
    assert not v.passed and v.layers[0].k.bc_threshold_used == 1.0


# ----------------------------------------------------------------------------- logits

V, T = 4096, 4


def run_prompt(rng, scale_err=1.0):
    base = (rng.normal(size=(T, 1, V)) * 3).astype(np.float32)
    exp = bf16(base).astype(np.float32)
    noise = rng.normal(size=base.shape) * 2e-4
    tgt = (base * (1 + noise * scale_err)).astype(np.float32)
    tgt = bf16(tgt).astype(np.float32) if scale_err <= 1 else tgt + (rng.normal(size=base.shape) * 0.05 * scale_err).astype(np.float32)

    def gen(ids):
        start = len(ids[0]) - 3
        return tgt[start:]

    return logit_validation([[1, 2, 3]], gen, exp, baseline_logits=base)


def test_logit_verdict_passes_bf16_like_target_and_says_why():
    rng = np.random.default_rng(5)
    prompts = [run_prompt(rng) for _ in range(6)]
    v = aggregate_logit_verdict(prompts)
    assert v.passed and v.decided_by in ("sigma_ratio", "aggregate_bc")
    assert v.three_way and len(v.per_token_bc) == T and v.min_bc > 0.95
    assert 0.7 < v.sigma_ratio < 1.4
    assert v.summary().startswith("PASS")


def test_logit_verdict_fails_with_numbers_when_target_is_noisier():
    rng = np.random.default_rng(6)
    v = aggregate_logit_verdict([run_prompt(rng, scale_err=5.0) for _ in range(3)])
    assert not v.passed and v.decided_by is None and v.sigma_ratio > 3
    assert v.first_failed is not None and "sigma-ratio" in v.summary()


def test_logit_verdict_two_way_falls_back_to_static_thresholds():
    x = np.random.default_rng(7).normal(size=(3, 1, 50)).astype(np.float32)
    passed = logit_validation([[1]], lambda ids: x[len(ids[0]) - 1 :], x, kv_extract_fn=lambda n: {})
    v = aggregate_logit_verdict([passed])
    assert v.passed and v.decided_by == "static_topk" and not v.three_way and math.isinf(v.sigma_ratio)


def test_kv_verdict_catches_one_stale_position_among_many():
    rng = np.random.default_rng(8)

    def one_stale(base, act):
        k, vv = act["layers.3"]
        k = k.copy()
        k[:, :, 5] = bf16(rng.normal(size=k[:, :, 5].shape))  # one slot of another request
        act["layers.3"] = (k, vv)
        return act

    raws = [kv_prompt(rng)[1] for _ in range(5)] + [kv_prompt(rng, bug=one_stale)[1]]
    v = aggregate_kv_verdict(raws)
    assert not v.passed and v.first_failing_layer == "layers.3"
    t = v.layers[3].k
    assert t.linf_ratio < t.linf_threshold_used and t.max_linf_ratio > 10  # caught by the max bar


def test_logit_verdict_static_check_can_rejudge_with_another_map():
    x = np.random.default_rng(9).normal(size=(3, 1, 50)).astype(np.float32)
    y = x.copy()
    y[1, 0, np.argsort(-x[1, 0])[1]] += 0.02 * np.abs(x[1, 0]).max()  # a 2 % top-5 error
    res = logit_validation([[1]], lambda ids: y[len(ids[0]) - 1 :], x, kv_extract_fn=lambda n: {})
    assert not aggregate_logit_verdict([res]).passed  # default K5 rtol 0.01
    v = aggregate_logit_verdict([res], tol_map={5: (1e-5, 0.03), "all": (1e-5, 0.05)})
    assert v.passed and v.decided_by == "static_topk"


def test_logit_verdict_phase_points_at_prefill_or_decode():
    x = np.random.default_rng(10).normal(size=(3, 1, 50)).astype(np.float32)
    for bad_token, phase in ((0, "prefill"), (2, "decode")):
        y = x.copy()
        y[bad_token, 0, np.argsort(-x[bad_token, 0])[1]] += 0.2 * np.abs(x[bad_token, 0]).max()
        res = logit_validation([[1]], lambda ids, y=y: y[len(ids[0]) - 1 :], x, kv_extract_fn=lambda n: {})
        v = aggregate_logit_verdict([res])
        assert not v.passed and v.first_failed == (0, 0, bad_token) and v.phase == phase


# ----------------------------------------------------------------------------- broken evidence


def _nan_layer(name, which, positions=slice(None)):
    """A bug that leaves ``which`` ("k"/"v") of layer ``name`` NaN at ``positions`` in the actual run."""
    def bug(base, act):
        k, v = (x.copy() for x in act[name])
        (k if which == "k" else v)[:, :, positions] = np.nan
        act[name] = (k, v)
        return act
    return bug


def test_kv_verdict_fails_when_the_actual_is_nan_where_the_references_are_finite():
    rng = np.random.default_rng(11)
    raws = [kv_prompt(rng, bug=_nan_layer("layers.1", "k"))[1] for _ in range(3)]
    v = aggregate_kv_verdict(raws, prompt_lens=[8] * 3, prompt_ids=["p0", "p1", "p2"], run="RUN-A",
                             last_never_fed=True)
    assert not v.passed and v.first_failing_layer == "layers.1"
    lk = v.layers[1].k
    # 2 heads x 32 values at 11 of each prompt's 12 positions: the wholly NaN last position is
    # exempt (an engine never writes the last teacher token's KV), nothing else is.
    assert lk.passed is False and lk.n_nonfinite == 3 * 2 * 11 * 32 and lk.n_values == 0
    assert v.layers[1].v.passed and v.layers[1].passed is False
    assert [(r["prompt"], r["layer"], r["tensor"], r["n"]) for r in v.nonfinite] == [
        (p, "layers.1", "K", 2 * 11 * 32) for p in ("p0", "p1", "p2")]
    s = v.summary()
    assert s.startswith("FAIL") and "RUN-A" in s and "p0" in s and "layers.1" in s and " K" in s and "704" in s


def test_kv_verdict_exempts_only_a_wholly_unwritten_last_position():
    rng = np.random.default_rng(12)

    def last_never_fed(base, act):  # an engine never writes the last teacher token's KV
        for name in act:
            act = _nan_layer(name, "k", -1)(base, act)
            act = _nan_layer(name, "v", -1)(base, act)
        return act

    raws = [kv_prompt(rng, bug=last_never_fed)[1] for _ in range(4)]
    v = aggregate_kv_verdict(raws, prompt_lens=[8] * 4, last_never_fed=True)
    assert v.passed, v.summary()
    assert all(lv.k.n_nonfinite == 0 and lv.k.n_values == 4 * 11 * 64 for lv in v.layers)
    # a run that writes the last position (a prefill over prompt + teacher tokens) gets no exemption
    v = aggregate_kv_verdict(raws, prompt_lens=[8] * 4)
    assert not v.passed and v.first_failing_layer == "layers.0"
    assert all(lv.k.n_nonfinite == 4 * 64 and lv.v.n_nonfinite == 4 * 64 for lv in v.layers)

    def one_value_more(base, act):  # the same plus one NaN value at position 3 of layer 2's V
        act = last_never_fed(base, act)
        k, vv = act["layers.2"]
        vv = vv.copy()
        vv[0, 1, 3, 7] = np.nan
        act["layers.2"] = (k, vv)
        return act

    v = aggregate_kv_verdict([kv_prompt(rng, bug=one_value_more)[1]], prompt_lens=[8], last_never_fed=True)
    assert not v.passed and v.first_failing_layer == "layers.2"
    assert v.layers[2].v.n_nonfinite == 1 and v.nonfinite[0]["first_position"] == 3
    assert not v.prefill.passed and v.decode.passed  # position 3 is prefill

    def partly_written_last(base, act):  # half the last position's values: not "never fed"
        k, vv = act["layers.0"]
        k = k.copy()
        k[:, 0, -1] = np.inf
        act["layers.0"] = (k, vv)
        return act

    v = aggregate_kv_verdict([kv_prompt(rng, bug=partly_written_last)[1]], last_never_fed=True)
    assert not v.passed and v.layers[0].k.n_nonfinite == 32


def test_kv_verdict_nan_where_the_references_are_nan_too_is_excluded_not_failed():
    rng = np.random.default_rng(13)

    def window(kv):  # sliding-window fill: the first 6 positions of layer 0 are NaN
        k, v = (x.copy() for x in kv["layers.0"])
        k[:, :, :6] = np.nan
        v[:, :, :6] = np.nan
        kv["layers.0"] = (k, v)
        return kv

    raws = []
    for _ in range(3):
        base = {f"layers.{i}": (rng.normal(size=(1, 2, 12, 32)).astype(np.float32),
                                rng.normal(size=(1, 2, 12, 32)).astype(np.float32)) for i in range(2)}
        exp = window({n: (bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()})
        act = window({n: (bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()})
        raws.append(compare_kv_caches(exp, act, baseline_kv=window(dict(base)), return_raw_errors=True)[1])
    v = aggregate_kv_verdict(raws)
    assert v.passed, v.summary()
    assert v.layers[0].k.n_nonfinite == 0 and v.layers[0].k.n_values == 3 * 6 * 64


def test_a_layer_or_verdict_with_an_unjudged_part_never_passes():
    rng = np.random.default_rng(14)

    def refs_nan_too(base, act):  # nothing finite in all three runs for layer 3's V: unjudged
        for d in (base, act):
            k, vv = d["layers.3"]
            d["layers.3"] = (k, np.full_like(vv, np.nan))
        return act

    v = aggregate_kv_verdict([kv_prompt(rng, bug=refs_nan_too)[1]])
    lv = v.layers[3]
    assert lv.k.passed is True and lv.v.passed is None and lv.v.n_nonfinite == 0
    assert lv.passed is None and not v.passed and v.first_failing_layer is None
    assert "not judged" in v.summary() and "layers.3" in v.summary()


def test_an_infinite_reference_value_neither_hides_a_bug_nor_fails_a_correct_engine():
    # an inf in the expected (BF16) run makes that BF16 error inf: counted as noise it made the
    # RMS noise infinite, the sigma-ratio 0 and every layer PASS, a 4 % bug included. The judged
    # values are those finite in all three runs (module docstring).
    def raws(bug: bool):
        rng = np.random.default_rng(15)
        out = []
        for p in range(3):
            base = {f"layers.{i}": (rng.normal(size=(1, 2, 12, 32)).astype(np.float32),
                                    rng.normal(size=(1, 2, 12, 32)).astype(np.float32)) for i in range(2)}
            exp = {n: (bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()}
            act = {n: (bf16(k * 1.04) if bug else bf16_engine(k, rng), bf16_engine(v, rng)) for n, (k, v) in base.items()}
            if p == 0:
                k, v = exp["layers.0"]
                k = k.copy()
                k[0, 1, 5, 3] = np.inf
                exp["layers.0"] = (k, v)
            out.append(compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)[1])
        return out

    v = aggregate_kv_verdict(raws(bug=True))
    assert not v.passed and v.first_failing_layer == "layers.0", v.summary()
    assert v.layers[0].k.passed is False and v.layers[1].k.passed is False
    v = aggregate_kv_verdict(raws(bug=False))
    assert v.passed, v.summary()
    assert v.layers[0].k.n_values == 3 * 12 * 64 - 1 and v.layers[0].v.n_values == 3 * 12 * 64


def test_kv_verdict_on_the_threads_is_the_one_thread_verdict_and_numpys(monkeypatch):
    """Every layer's K and V pools go through the fused pass on the threads
    (fused_tensor_numbers_many): the verdict is the one-thread verdict and the numpy path's, to
    the last bit (repr), with a NaN layer (numpy's masking path for that pool) and a bug beside
    correct layers."""
    import metrics.bc as bc_mod

    rng = np.random.default_rng(12)

    def bug(base, act):
        act = _nan_layer("layers.1", "k")(base, act)
        k, v = act["layers.3"]
        act["layers.3"] = (k, bf16(np.asarray(v, np.float32) * 1.05))
        return act

    raws = [kv_prompt(rng, layers=6, bug=bug)[1] for _ in range(5)]
    got = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("CAPTURESTORE_METRICS_THREADS", threads)
        got[threads] = repr(aggregate_kv_verdict(raws, prompt_lens=[8] * 5))
    monkeypatch.setattr(bc_mod, "_NUMBA_OK", False)
    v = aggregate_kv_verdict(raws, prompt_lens=[8] * 5)
    assert got["1"] == got["3"] == repr(v)
    assert not v.passed and v.first_failing_layer == "layers.1"
    assert [lv.passed for lv in v.layers] == [True, False, True, False, True, True]
