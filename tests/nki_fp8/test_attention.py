"""Scale folding, FP8 attention and check_kernel against loop oracles and error bounds."""
import math

import numpy as np
import pytest

from nki_fp8.attention import (
    attention_decode_reference,
    check_kernel,
    decode_attention,
    decode_attention_explicit_dequant,
    decode_attention_scale_folded,
    fp8_attention_decode,
    fp8_attention_error_vs_bf16,
    make_decode_case,
)
from nki_fp8.quant import dequantize, quantize
from nki_fp8.scales import absmax_scale

EPS32 = np.finfo(np.float32).eps


def loop_attention(q, k, v, scaling, w_out):
    """Obvious float64 loops: q [hq, d], k/v [hkv, s, d], w_out [hidden, hq*d]."""
    hq, d = q.shape
    hkv, s, _ = k.shape
    o = np.zeros(hq * d)
    for h in range(hq):
        kh = h // (hq // hkv)
        sc = [sum(float(q[h, j]) * float(k[kh, t, j]) for j in range(d)) * scaling for t in range(s)]
        mx = max(sc)
        e = [math.exp(x - mx) for x in sc]
        z = sum(e)
        for j in range(d):
            o[h * d + j] = sum(e[t] / z * float(v[kh, t, j]) for t in range(s))
    return np.asarray(w_out, np.float64) @ o


@pytest.fixture
def case():
    rng = np.random.default_rng(3)
    hq, hkv, s, d = 4, 2, 9, 16
    q = rng.standard_normal((hq, d)).astype(np.float32)
    k = (rng.standard_normal((hkv, s, d)) * 5).astype(np.float32)
    v = (rng.standard_normal((hkv, s, d)) * 0.1).astype(np.float32)
    w = (rng.standard_normal((24, hq * d)) / 8).astype(np.float32)
    ks = float(absmax_scale(k, platform="trn2").item())
    vs = float(absmax_scale(v, platform="trn2").item())
    return dict(q=q, k8=quantize(k, ks), v8=quantize(v, vs), ks=ks, vs=vs, w=w, scaling=1 / 4.0)


def test_decode_attention_matches_a_float64_loop(case):
    k = dequantize(case["k8"], case["ks"]).astype(np.float64)
    v = dequantize(case["v8"], case["vs"]).astype(np.float64)
    got = decode_attention(case["q"], k, v, scaling=case["scaling"], w_out=case["w"], dtype=np.float64)
    np.testing.assert_allclose(got, loop_attention(case["q"], k, v, case["scaling"], case["w"]), rtol=1e-12, atol=1e-14)


def test_scale_folding_equals_explicit_dequant_exactly_in_float64_and_within_fp32_rounding(case):
    kw = dict(k_scale=case["ks"], v_scale=case["vs"], scaling=case["scaling"], w_out=case["w"])
    f64 = decode_attention_scale_folded(case["q"], case["k8"], case["v8"], dtype=np.float64, **kw)
    e64 = decode_attention_explicit_dequant(case["q"], case["k8"], case["v8"], dtype=np.float64, **kw)
    # float64 differs from exact math only by float64 rounding: the folding is an identity.
    np.testing.assert_allclose(f64, e64, rtol=1e-12, atol=1e-15)
    f32 = decode_attention_scale_folded(case["q"], case["k8"], case["v8"], **kw)
    e32 = decode_attention_explicit_dequant(case["q"], case["k8"], case["v8"], **kw)
    # Forward error bound for float32: n * eps * (|W| @ |o|-magnitudes), n = seq + q_head*head_dim + 8.
    hq, d = case["q"].shape
    n = case["k8"].shape[1] + hq * d + 8
    vmax = np.abs(dequantize(case["v8"], case["vs"])).max()
    bound = n * EPS32 * (np.abs(case["w"]).sum(axis=1) * vmax)
    assert (np.abs(f32 - f64) <= bound).all() and (np.abs(e32 - e64) <= bound).all()
    assert (np.abs(f32 - e32) <= 2 * bound).all()


def test_attention_decode_reference_quantizes_the_active_token_with_the_platform_clamp():
    c = make_decode_case(4, 2, 5, 16, "active_outlier", "trn2", seed=1)
    got = attention_decode_reference(**c)
    # Oracle: clamp the active token by hand at 240, round via the oracle-tested cast, loop attention.
    ka = np.clip(c["k_active"] * c["k_scale"], -240, 240)
    va = np.clip(c["v_active"] * c["v_scale"], -240, 240)
    assert np.abs(ka).max() == 240  # the clamp engages in this case
    k = np.concatenate([c["k_cache"].astype(np.float64), quantize(ka, 1.0).astype(np.float64)[:, None]], axis=1)
    v = np.concatenate([c["v_cache"].astype(np.float64), quantize(va, 1.0).astype(np.float64)[:, None]], axis=1)
    want = loop_attention(c["q"], k, v, c["softmax_scale"], c["w_out"])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * np.abs(want).max())


def loop_fp8_attention(q, k8, v8, qs, ks, vs, w, platform):
    """FP8 attention written out: FP8 Q, scores * 1/(qs*ks*sqrt d), FP8 probabilities, * 1/vs."""
    d = q.shape[1]
    q8 = quantize(q, qs, platform=platform).astype(np.float64)
    hq, hkv = q.shape[0], k8.shape[0]
    o = np.zeros(hq * d)
    for h in range(hq):
        kh = h // (hq // hkv)
        sc = [float(q8[h] @ k8[kh, t].astype(np.float64)) / (qs * ks * math.sqrt(d)) for t in range(k8.shape[1])]
        mx = max(sc)
        e = np.array([math.exp(x - mx) for x in sc])
        p8 = quantize((e / e.sum()).astype(np.float32), 1.0, platform=platform).astype(np.float64)
        o[h * d : (h + 1) * d] = p8 @ v8[kh].astype(np.float64) / vs
    return w.astype(np.float64) @ o


@pytest.mark.parametrize("platform", ["trn2", "trn3"])
def test_fp8_attention_matches_the_written_out_formula(case, platform):
    qs = float(absmax_scale(case["q"], platform=platform).item())
    k8 = quantize(dequantize(case["k8"], case["ks"]), case["ks"], platform=platform)
    v8 = quantize(dequantize(case["v8"], case["vs"]), case["vs"], platform=platform)
    got = fp8_attention_decode(case["q"], k8, v8, q_scale=qs, k_scale=case["ks"], v_scale=case["vs"], w_out=case["w"], platform=platform)
    want = loop_fp8_attention(case["q"], k8, v8, qs, case["ks"], case["vs"], case["w"], platform)
    # float32 vs float64 scores may flip a probability's FP8 rounding; allow one P step on a few terms.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_fp8_attention_error_is_fp8_sized_and_larger_than_bf16():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 64))
    k = rng.standard_normal((2, 256, 64)) * 4
    v = rng.standard_normal((2, 256, 64))
    s = lambda a: float(absmax_scale(a, platform="trn3").item())  # noqa: E731
    e = fp8_attention_error_vs_bf16(q, k, v, q_scale=s(q), k_scale=s(k), v_scale=s(v), platform="trn3")
    # BF16 keeps 8 significant bits, FP8 4: per element 2^-9 vs 2^-5 relative, i.e. 16x. The
    # softmax over scores of std ~4 amplifies both alike (score errors scale with |q||k|).
    assert e.bf16_rel_l2 < 2**-6
    assert 4 * e.bf16_rel_l2 < e.fp8_kv_rel_l2 < e.fp8_attn_rel_l2 < 2**-2
    assert e.fp8_attn_rel_linf < 2**-1


def _ref(**c):
    return attention_decode_reference(**c)


def test_check_kernel_passes_the_reference_and_the_explicit_dequant_path():
    rep = check_kernel(_ref)
    assert rep.passed and rep.max_abs_err == 0.0 and len(rep.rows) == 18

    def explicit(q, k_cache, v_cache, k_active, v_active, softmax_scale, w_out, k_scale, v_scale, platform):
        k8 = np.concatenate([k_cache, quantize(k_active[:, None], k_scale, platform=platform)], axis=1)
        v8 = np.concatenate([v_cache, quantize(v_active[:, None], v_scale, platform=platform)], axis=1)
        return decode_attention_explicit_dequant(
            q, k8, v8, k_scale=k_scale, v_scale=v_scale, scaling=softmax_scale * k_scale, w_out=w_out * v_scale
        )

    rep = check_kernel(explicit)
    assert rep.passed, rep.table()
    assert 0 < rep.max_rel_err < 1e-5


def test_check_kernel_catches_a_trn3_clamp_on_trn2_only_where_the_clamp_engages():
    def clamp448(**c):
        return attention_decode_reference(**{**c, "platform": "trn3"})  # wrong clamp and format

    rep = check_kernel(clamp448)
    bad = {(r.scales, r.platform) for r in rep.failures}
    assert bad == {("active_outlier", "trn2")}, rep.table()
    assert min(r.max_rel_err for r in rep.failures) > 1e-2


def test_check_kernel_reports_a_missing_active_quantization_and_a_crash():
    def no_quant(q, k_cache, v_cache, k_active, v_active, softmax_scale, w_out, k_scale, v_scale, platform):
        k = np.concatenate([k_cache.astype(np.float32), (k_active * k_scale)[:, None]], axis=1)
        v = np.concatenate([v_cache.astype(np.float32), (v_active * v_scale)[:, None]], axis=1)
        return decode_attention(q, k, v, scaling=softmax_scale, w_out=w_out)

    rep = check_kernel(no_quant, shapes=((4, 2, 8, 32),))
    assert not rep.passed and rep.max_rel_err > 1e-3
    assert "NO" in rep.table()

    def crash(**c):
        raise RuntimeError("kernel launch failed")

    rep = check_kernel(crash, shapes=((4, 2, 8, 32),), platforms=("trn2",))
    assert not rep.passed and all("kernel launch failed" in r.error for r in rep.rows)


def test_check_kernel_fp8_attention_variant_passes_the_loop_formula_and_catches_bugs():
    def loop(q, k_fp8, v_fp8, q_scale, k_scale, v_scale, w_out, platform):
        return loop_fp8_attention(q, k_fp8, v_fp8, q_scale, k_scale, v_scale, w_out, platform)

    shapes = ((4, 2, 9, 16), (2, 1, 20, 32))
    rep = check_kernel(loop, variant="fp8_attention", shapes=shapes)
    assert rep.passed, rep.table()
    assert rep.rows[0].variant == "fp8_attention" and len(rep.rows) == 12

    def no_bmm2_scale(**c):
        return fp8_attention_decode(**c) * c["v_scale"]  # forgot bmm2_scale = 1 / v_scale

    assert check_kernel(no_bmm2_scale, variant="fp8_attention", shapes=shapes, scales=("calibrated",)).max_rel_err > 1

    def clamp448(**c):
        return fp8_attention_decode(**{**c, "platform": "trn3"})

    rep = check_kernel(clamp448, variant="fp8_attention", shapes=shapes)
    assert {(r.scales, r.platform) for r in rep.failures} == {("active_outlier", "trn2")}, rep.table()
    with pytest.raises(ValueError, match="unknown variant"):
        check_kernel(loop, variant="mla")
