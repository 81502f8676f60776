"""metrics.modules: per-token three-way module metrics, the noise-relative module verdict and
first-failing-module localisation, on synthetic tensors with known errors (oracles: plain numpy)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrics.modules import (
    ModuleJudge,
    ModuleVerdictConfig,
    align_decode_captures,
    compare_captures_three_way,
    compare_module_tensors,
    first_failing_module,
    judge_modules,
    module_layer,
)

ORDER = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0",
         "model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1", "model.norm", "lm_head"]


def _bf16(x):
    """Round float32 to bfloat16 and back (round to nearest even): BF16 noise with the real profile."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def _captures(seed, n_prompts=4, tokens=12, width=256, fault=None, size=0.0, phase_of_fault=None):
    """Per prompt {(module, phase): (baseline, expected, actual)}: the baseline is float32 values,
    expected and actual its bf16 rounding after independent float32-sized perturbations (two
    engines with different accumulation orders). fault: module whose actual (and every later
    module's, as a real fault propagates) is scaled by 1 + size, in phase_of_fault (or both)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_prompts):
        caps = {}
        for phase, n in (("prefill", tokens), ("decode", 4)):
            hit = False
            for m in ORDER:
                b = rng.standard_normal((n, width)).astype(np.float32)
                e = _bf16(b * (1 + 1e-3 * rng.standard_normal(b.shape).astype(np.float32)))
                a = _bf16(b * (1 + 1e-3 * rng.standard_normal(b.shape).astype(np.float32)))
                hit = hit or (m == fault and phase_of_fault in (None, phase))
                if hit:
                    a = _bf16(a * (1 + size))
                caps[(m, phase)] = (b, e, a)
        out.append(caps)
    return out


def test_per_token_metrics_against_numpy_oracles():
    rng = np.random.default_rng(1)
    b = rng.standard_normal((5, 3, 8)).astype(np.float32)
    e = b + 0.01 * rng.standard_normal(b.shape).astype(np.float32)
    a = b + 0.03 * rng.standard_normal(b.shape).astype(np.float32)
    m = compare_module_tensors(b, e, a, "model.layers.0.mlp", "prefill", positions=[3, 4, 5, 6, 7])
    B, E, A = (x.reshape(5, -1).astype(np.float64) for x in (b, e, a))
    for t in range(5):
        base_linf = np.abs(E[t] - B[t]).max() / np.abs(B[t]).max()
        tgt_l2 = np.linalg.norm(A[t] - B[t]) / np.linalg.norm(B[t])
        base_l2 = np.linalg.norm(E[t] - B[t]) / np.linalg.norm(B[t])
        cos = A[t] @ B[t] / np.linalg.norm(A[t]) / np.linalg.norm(B[t])
        assert m.base_linf[t] == pytest.approx(base_linf, rel=1e-6)
        assert m.l2_ratio[t] == pytest.approx(tgt_l2 / base_l2, rel=1e-6)
        assert m.tgt_cos[t] == pytest.approx(cos, rel=1e-9)
    assert m.positions.tolist() == [3, 4, 5, 6, 7]
    assert np.all(m.l2_ratio > 1.5)  # 3x the noise
    assert m.base_err.shape == (5, 24)


def test_shapes_that_differ_raise_naming_module_and_shapes():
    z = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp \(decode\): shapes differ: baseline \(4, 8\), "
                                         r"expected \(4, 8\), actual \(4, 9\)"):
        compare_module_tensors(z, z, np.zeros((4, 9), np.float32), "model.layers.1.mlp", "decode")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_no_false_alarm_when_the_target_is_as_noisy_as_bf16(seed):
    v = judge_modules(_captures(seed), ORDER)
    assert v.passed, [m.summary() for m in v.modules if not m.passed]
    assert v.first_failing is None and v.localisation is None


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fault=st.sampled_from(ORDER), size=st.floats(0.01, 0.5),
       phase=st.sampled_from([None, "decode"]))
def test_the_first_failing_module_is_the_faulted_one_in_execution_order(seed, fault, size, phase):
    v = judge_modules(_captures(seed, fault=fault, size=size, phase_of_fault=phase), ORDER)
    assert not v.passed
    assert v.localisation["module"] == fault
    assert v.localisation["phase"] == (phase or "prefill")
    assert v.localisation["layer"] == module_layer(fault)
    before = ORDER[:ORDER.index(fault)]
    assert all(m.passed for m in v.modules if m.module in before or (phase == "decode" and m.phase == "prefill"))


def test_module_bc_bar_is_the_noise_bc_less_half_a_percent():
    """Same rule as the KV verdict, narrower BC margin (MODULE_KV_CONFIG): bar = min(0.99, noise BC - 0.005)."""
    v = judge_modules(_captures(7, fault="model.layers.1.mlp", size=0.01), ORDER)
    f = v.first_failing
    assert f.module == "model.layers.1.mlp", v.summary()
    t = f.tensor
    assert t.bc_threshold_used == pytest.approx(min(0.99, t.noise_bc - 0.005))
    assert t.sigma_ratio > 1.0 and f.decided_by is None


def test_nan_in_the_target_fails_and_nan_in_every_role_is_excluded():
    caps = _captures(3)
    b, e, a = caps[0][("model.layers.1.mlp", "prefill")]
    a = a.copy()
    a[2, 5] = np.nan
    caps[0][("model.layers.1.mlp", "prefill")] = (b, e, a)
    v = judge_modules(caps, ORDER)
    f = v.first_failing
    assert f.module == "model.layers.1.mlp" and f.tensor.n_nonfinite == 1
    assert "1 non-finite target values" in f.problem and f.position == 2
    # NaN in all three (e.g. a padded row) is excluded, not failed
    caps = _captures(3)
    b, e, a = (x.copy() for x in caps[1][("model.norm", "decode")])
    for x in (b, e, a):
        x[0, :] = np.nan
    caps[1][("model.norm", "decode")] = (b, e, a)
    assert judge_modules(caps, ORDER).passed


def test_roles_with_different_shapes_fail_naming_module_and_shapes():
    caps = _captures(4)
    b, e, a = caps[2][("model.layers.0.mlp", "decode")]
    caps[2][("model.layers.0.mlp", "decode")] = (b, e, a[:, :128])
    v = judge_modules(caps, ORDER)
    f = v.first_failing
    assert (f.module, f.phase, f.passed) == ("model.layers.0.mlp", "decode", False)
    assert "prompt 2: shapes differ: baseline (4, 256), expected (4, 256), actual (4, 128)" in f.problem
    assert "FAIL: model.layers.0.mlp (decode, layer 0): prompt 2: shapes differ" in f.summary()


def test_all_nan_module_is_unjudged_and_the_whole_does_not_pass():
    caps = _captures(5, n_prompts=1)
    caps[0][("lm_head", "decode")] = tuple(np.full((4, 256), np.nan, np.float32) for _ in range(3))
    v = judge_modules(caps, ORDER)
    assert not v.passed and v.first_failing is None
    assert [m.module for m in v.unjudged] == ["lm_head"]
    assert "not judged" in v.summary()


def test_static_max_l2_ratio_fallback():
    caps = _captures(6, fault="model.layers.0.mlp", size=0.004)  # ~1.4-2x the noise L2 per token
    noise = judge_modules(caps, ORDER)
    static = judge_modules(caps, ORDER, config=ModuleVerdictConfig(rule="max_l2_ratio", max_l2_ratio=3.0))
    f = next(m for m in static.modules if m.module == "model.layers.0.mlp" and m.phase == "prefill")
    assert f.static_passed is (f.max_l2_ratio < 3.0)
    assert f.passed is f.static_passed and f.decided_by == ("max_l2_ratio" if f.passed else None)
    strict = judge_modules(caps, ORDER, config=ModuleVerdictConfig(rule="max_l2_ratio", max_l2_ratio=1.01))
    assert strict.first_failing is not None
    assert noise.first_failing.module == "model.layers.0.mlp"
    with pytest.raises(ValueError, match="rule must be"):
        ModuleVerdictConfig(rule="bc")


def test_phases_are_ordered_in_time_then_by_execution_order():
    j = ModuleJudge()
    z = np.zeros((3, 4), np.float32)
    one = np.ones((3, 4), np.float32)
    j.add("p", "model.layers.1.mlp", "prefill", z, z + 1e-3, one)
    j.add("p", "model.layers.0.mlp", "decode", z, z + 1e-3, one)
    j.add("p", "model.norm", "prefill", z, z + 1e-3, z + 1e-3)
    v = j.verdict(["model.layers.0.mlp", "model.layers.1.mlp", "model.norm"])
    assert [(m.module, m.phase) for m in v.modules] == [
        ("model.layers.1.mlp", "prefill"), ("model.norm", "prefill"), ("model.layers.0.mlp", "decode")]
    assert v.localisation == {"phase": "prefill", "layer": 1, "module": "model.layers.1.mlp", "token": 0}
    assert first_failing_module(reversed(v.modules), ["model.layers.0.mlp", "model.layers.1.mlp"]).module == \
        "model.layers.1.mlp"


def test_module_layer_names_decoder_layers_only():
    assert module_layer("model.layers.12.self_attn.o_proj") == 12
    assert module_layer("model.layers.3") == 3
    assert module_layer("model.layers.3.mlp:input") == 3
    assert [module_layer(m) for m in ("model.embed_tokens", "model.norm", "lm_head", "model.layers")] == [None] * 4


def test_align_decode_captures_by_position():
    ri, ti, missing = align_decode_captures([10, 11, 12, 13], [11, 12, 13, 14])
    assert ri.tolist() == [1, 2, 3] and ti.tolist() == [0, 1, 2] and missing.tolist() == [10]


def test_compare_captures_three_way_reference_api():
    caps = _captures(8, n_prompts=2, fault="model.norm", size=0.05)
    split = [[{m: {} for m, _ in c} for _ in range(3)] for c in caps]
    for p, c in enumerate(caps):
        for (m, ph), arrs in c.items():
            for r in range(3):
                split[p][r][m][ph] = arrs[r]
    base, exp, act = ([s[r] for s in split] for r in range(3))
    v = compare_captures_three_way(base, exp, act, order=ORDER)
    assert v.localisation == {"phase": "prefill", "layer": None, "module": "model.norm", "token": 0}
    del act[1]["lm_head"]["decode"]
    v = compare_captures_three_way(base, exp, act, order=ORDER)
    bad = next(m for m in v.modules if (m.module, m.phase) == ("lm_head", "decode"))
    assert bad.passed is False and "the actual capture has no lm_head (decode)" in bad.problem
    assert math.isnan(bad.max_l2_ratio) or bad.n_prompts == 1
