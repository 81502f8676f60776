"""compare_kv_caches against a slow, obvious per-row/token/layer/head loop (float64 oracle),
plus the upstream BC definition written out with np.histogram."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metrics.kv import (
    HeadMetrics,
    TokenKVMetrics,
    aggregate_kv_bc_across_prompts,
    aggregate_kv_bc_arrays,
    compare_kv_caches,
    compute_combined_bc_per_layer,
)


# ----------------------------------------------------------------------------- oracles

def upstream_bc(e1, e2, num_bins=100):
    """reference/000 BC, as the upstream writes it (np.histogram over linspace edges)."""
    e1 = e1[~np.isnan(e1)]
    e2 = e2[~np.isnan(e2)]
    if len(e1) == 0 or len(e2) == 0:
        return 0.0
    lo, hi = min(e1.min(), e2.min()), max(e1.max(), e2.max())
    edges = np.linspace(lo, hi, num_bins + 1)
    h1, _ = np.histogram(e1, bins=edges)
    h2, _ = np.histogram(e2, bins=edges)
    p1, p2 = h1 / (h1.sum() + 1e-10), h2 / (h2.sum() + 1e-10)
    return float(np.clip(np.sum(np.sqrt(p1 * p2)), 0.0, 1.0))


def f64(x):
    return np.asarray(x).astype(np.float32).astype(np.float64)


def head_oracle(ref, x):
    """rel L-inf, rel L2, cosine of one head vector, NaN positions dropped, in float64."""
    ok = ~(np.isnan(ref) | np.isnan(x))
    if not ok.any():
        return math.nan, math.nan, math.nan
    r, a = ref[ok], x[ok]
    d = a - r
    linf = np.max(np.abs(d)) / max(np.max(np.abs(r)), 1e-10)
    l2 = math.sqrt(np.sum(d * d)) / max(math.sqrt(np.sum(r * r)), 1e-10)
    cos = np.sum(r * a) / (max(math.sqrt(np.sum(r * r)), 1e-8) * max(math.sqrt(np.sum(a * a)), 1e-8))
    return linf, l2, cos


def loop_oracle(expected, actual, baseline=None):
    """{(b, t, layer, h): HeadMetrics-like dict}, {(b, t, layer): (k_bc, v_bc)} by plain loops."""
    heads, bcs = {}, {}
    layers = sorted(expected)
    for layer in layers:
        ek, ev = (f64(x) for x in expected[layer])
        ak, av = (f64(x) for x in actual[layer])
        rk, rv = (f64(x) for x in baseline[layer]) if baseline else (ek, ev)
        B, H, S, D = ek.shape
        for b in range(B):
            for t in range(S):
                base_k_err, tgt_k_err, base_v_err, tgt_v_err = [], [], [], []
                for h in range(H):
                    m = {}
                    for kv, r, a, e in (("k", rk, ak, ek), ("v", rv, av, ev)):
                        linf, l2, cos = head_oracle(r[b, h, t], a[b, h, t])
                        m[f"{kv}_linf"], m[f"{kv}_l2"], m[f"{kv}_cos"] = linf, l2, cos
                        if baseline:
                            bl, b2, _ = head_oracle(r[b, h, t], e[b, h, t])
                            m[f"base_{kv}_linf"], m[f"base_{kv}_l2"] = bl, b2
                        else:
                            m[f"base_{kv}_linf"] = m[f"base_{kv}_l2"] = math.nan
                    heads[(b, t, layer, h)] = m
                    if baseline:
                        # errors in float32 as the upstream computes them
                        for lst, x, r in ((base_k_err, ek, rk), (tgt_k_err, ak, rk), (base_v_err, ev, rv), (tgt_v_err, av, rv)):
                            lst.append(np.abs(x[b, h, t].astype(np.float32) - r[b, h, t].astype(np.float32)))
                if baseline:
                    bk, tk = np.concatenate(base_k_err), np.concatenate(tgt_k_err)
                    bv, tv = np.concatenate(base_v_err), np.concatenate(tgt_v_err)
                    def bc(x, y):
                        if np.all(np.isnan(x) | np.isnan(y)):
                            return math.nan
                        return upstream_bc(x, y)
                    bcs[(b, t, layer)] = (bc(bk, tk), bc(bv, tv))
    return heads, bcs


def assert_matches_oracle(res, expected, actual, baseline=None, rtol=2e-5):
    heads, bcs = loop_oracle(expected, actual, baseline)
    for (b, t, layer, h), m in heads.items():
        got = res.row(b)[t][layer][h]
        assert isinstance(got, HeadMetrics)
        for name, want in m.items():
            g = getattr(got, name)
            if math.isnan(want):
                assert math.isnan(g), (b, t, layer, h, name, g)
            else:
                assert g == pytest.approx(want, rel=rtol, abs=1e-6), (b, t, layer, h, name, g, want)
    for (b, t, layer), (kb, vb) in bcs.items():
        got = res.row(b)[t][f"{layer}._bc"]
        assert isinstance(got, TokenKVMetrics)
        for g, want in ((got.k_bc, kb), (got.v_bc, vb)):
            if math.isnan(want):
                assert math.isnan(g)
            else:
                assert g == pytest.approx(want, abs=1e-12), (b, t, layer, g, want)


def make_kv(rng, layers, B, H, S, D, dtype=np.float32, scale=1.0):
    return {
        f"model.layers.{i}.self_attn": (
            (rng.normal(size=(B, H, S, D)) * scale).astype(dtype),
            (rng.normal(size=(B, H, S, D)) * scale).astype(dtype),
        )
        for i in range(layers)
    }


def perturb(kv, rng, rel, dtype):
    out = {}
    for name, (k, v) in kv.items():
        out[name] = tuple(
            (f64(x) * (1 + rel * rng.normal(size=x.shape))).astype(dtype) for x in (k, v)
        )
    return out


# ----------------------------------------------------------------------------- tests

def test_two_way_matches_loop_oracle_on_every_position_and_row():
    rng = np.random.default_rng(1)
    exp = make_kv(rng, 3, B=2, H=2, S=5, D=8)
    act = perturb(exp, rng, 1e-2, np.float32)
    res = compare_kv_caches(exp, act)
    assert res.shape == (2, 5, 3, 2)  # every position including the last, every row
    assert_matches_oracle(res, exp, act)
    assert not res.three_way and "model.layers.0.self_attn._bc" not in res[0]


def test_three_way_matches_loop_oracle_with_bf16_sources():
    rng = np.random.default_rng(2)
    base = make_kv(rng, 2, B=1, H=4, S=6, D=16)
    exp = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    act = perturb(base, rng, 5e-3, ml_dtypes.bfloat16)
    res, raw = compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)
    assert_matches_oracle(res, exp, act, base)
    # raw errors are |x - baseline| of all heads of the token, [H*D]
    e = raw[3]["model.layers.1.self_attn"]
    want = np.abs(f64(act["model.layers.1.self_attn"][0])[0, :, 3, :] - base["model.layers.1.self_attn"][0][0, :, 3, :]).ravel()
    np.testing.assert_allclose(e.tgt_k, want, rtol=1e-6)
    assert e.base_k.shape == (4 * 16,)


def test_identical_three_way_sources_give_bc_one_and_zero_errors():
    rng = np.random.default_rng(3)
    base = make_kv(rng, 1, B=1, H=2, S=3, D=8)
    exp = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    res = compare_kv_caches(exp, exp, baseline_kv=base)
    assert np.allclose(res.k_bc, 1.0) and np.allclose(res.v_bc, 1.0)
    np.testing.assert_array_equal(res.k_linf, res.base_k_linf)
    assert np.all(res.k_linf > 0) and np.all(res.k_linf < 2**-8)  # bf16 rounding, half an ulp


def test_torch_inputs_give_the_same_numbers_as_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    base = make_kv(rng, 2, B=1, H=2, S=4, D=8)
    act = perturb(base, rng, 1e-2, np.float32)
    exp = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    t = lambda kv, dt: {n: tuple(torch.tensor(x.astype(np.float32)).to(dt) for x in p) for n, p in kv.items()}
    r_np = compare_kv_caches(exp, act, baseline_kv=base)
    r_t = compare_kv_caches(t(exp, torch.bfloat16), t(act, torch.float32), baseline_kv=t(base, torch.float32))
    for name in ("k_linf", "v_l2", "k_cos", "base_k_linf"):
        np.testing.assert_array_equal(getattr(r_np, name), getattr(r_t, name))
    np.testing.assert_array_equal(r_np.k_bc, r_t.k_bc)


def test_nan_positions_excluded_and_all_nan_token_is_nan_not_zero():
    rng = np.random.default_rng(5)
    base = make_kv(rng, 2, B=1, H=2, S=6, D=8)
    exp = perturb(base, rng, 1e-3, np.float32)
    act = perturb(base, rng, 1e-3, np.float32)
    # sliding-window fill: positions 0..2 of layer 0 are NaN in every source
    for kv in (base, exp, act):
        k, v = kv["model.layers.0.self_attn"]
        k[:, :, :3] = np.nan
        v[:, :, :3] = np.nan
    # one partial NaN element in actual only
    act["model.layers.1.self_attn"][0][0, 1, 4, 2] = np.nan
    res = compare_kv_caches(exp, act, baseline_kv=base)
    assert np.isnan(res.k_linf[0, :3, 0]).all() and np.isnan(res.k_bc[0, :3, 0]).all()
    assert np.isfinite(res.k_linf[0, 3:, 0]).all() and np.isfinite(res.k_bc[0, 3:, 0]).all()
    assert np.isfinite(res.k_linf[0, 4, 1, 1])
    assert_matches_oracle(res, exp, act, base)


def test_shape_mismatch_names_layer_and_both_shapes():
    rng = np.random.default_rng(6)
    exp = make_kv(rng, 2, B=1, H=2, S=6, D=8)
    act = make_kv(rng, 2, B=1, H=2, S=5, D=8)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.*\(1, 2, 6, 8\).*\(1, 2, 5, 8\)"):
        compare_kv_caches(exp, act)


def test_layers_in_natural_order_and_selectable():
    rng = np.random.default_rng(7)
    exp = make_kv(rng, 11, B=1, H=1, S=2, D=4)
    res = compare_kv_caches(exp, exp)
    assert res.layers[-2:] == ("model.layers.9.self_attn", "model.layers.10.self_attn")
    res = compare_kv_caches(exp, exp, layers=["model.layers.3.self_attn"])
    assert list(res[0]) == ["model.layers.3.self_attn"]
    assert res[1]["model.layers.3.self_attn"][0].k_linf == 0.0


def test_two_way_base_fields_are_nan_and_raw_errors_need_baseline():
    rng = np.random.default_rng(8)
    exp = make_kv(rng, 1, B=1, H=1, S=2, D=4)
    res = compare_kv_caches(exp, exp)
    assert math.isnan(res[0]["model.layers.0.self_attn"][0].base_k_linf)
    with pytest.raises(ValueError, match="baseline"):
        compare_kv_caches(exp, exp, return_raw_errors=True)


def test_lazy_mapping_is_read_one_layer_at_a_time():
    rng = np.random.default_rng(9)
    data = make_kv(rng, 4, B=1, H=1, S=2, D=4)
    reads = []

    class Lazy(dict):
        def __getitem__(self, k):
            reads.append(k)
            return super().__getitem__(k)

    compare_kv_caches(Lazy(data), Lazy(data))
    assert reads == [n for n in sorted(data, key=lambda s: int(s.split(".")[2])) for _ in range(2)]


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), kv_heads=st.integers(1, 3), S=st.integers(1, 5), D=st.sampled_from([1, 4, 8]),
    L=st.integers(1, 2), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    three=st.booleans(), nan_frac=st.sampled_from([0.0, 0.0, 0.2]), seed=st.integers(0, 2**31),
)
def test_hypothesis_matches_loop_oracle(B, kv_heads, S, D, L, dtype, three, nan_frac, seed):
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    base = make_kv(rng, L, B, kv_heads, S, D)
    exp = {n: tuple(x.astype(dt) for x in kv) for n, kv in base.items()}
    act = perturb(base, rng, 1e-2, dt)
    if nan_frac:
        for kv in (act, base):
            for k, v in kv.values():
                k[rng.random(k.shape) < nan_frac] = np.nan
    res = compare_kv_caches(exp, act, baseline_kv=base if three else None)
    assert_matches_oracle(res, exp, act, base if three else None)


def test_cross_prompt_aggregation_aligns_by_generation_index():
    rng = np.random.default_rng(10)
    raws, lens = [], [3, 5]
    for plen in lens:
        base = make_kv(rng, 2, B=1, H=2, S=plen + 4, D=8)
        exp = perturb(base, rng, 1e-2, np.float32)
        act = perturb(base, rng, 1e-2, np.float32)
        raws.append(compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)[1])
    agg = aggregate_kv_bc_across_prompts(raws, lens)
    assert sorted(agg) == [0, 1, 2, 3]
    for g in range(4):
        for layer in raws[0].layers:
            bk = np.concatenate([raws[p][lens[p] + g][layer].base_k for p in range(2)])
            tk = np.concatenate([raws[p][lens[p] + g][layer].tgt_k for p in range(2)])
            assert agg[g][layer].k_bc == pytest.approx(upstream_bc(bk, tk), abs=1e-12)
    # upstream-shaped input (list over tokens of {layer: TokenKVErrors}) gives the same
    as_lists = [[r[t] for t in range(len(r))] for r in raws]
    as_lists = [[{k: tok[k] for k in tok} for tok in r] for r in as_lists]
    agg2 = aggregate_kv_bc_across_prompts(as_lists, lens)
    assert agg2[2][raws[0].layers[1]] == agg[2][raws[0].layers[1]]
    comb = compute_combined_bc_per_layer(raws)
    layer = raws[0].layers[0]
    bv = np.concatenate([raws[p][t][layer].base_v for p in range(2) for t in range(len(raws[p]))])
    tv = np.concatenate([raws[p][t][layer].tgt_v for p in range(2) for t in range(len(raws[p]))])
    assert comb[layer].v_bc == pytest.approx(upstream_bc(bv, tv), abs=1e-12)


def test_cross_prompt_bc_of_a_generation_index_nobody_measured_is_nan_not_zero():
    # Engines never feed the last teacher token back, so its KV is NaN in every prompt.
    rng = np.random.default_rng(13)
    raws, lens = [], [3, 4]
    for plen in lens:
        base = make_kv(rng, 2, B=1, H=2, S=plen + 3, D=8)
        exp = perturb(base, rng, 1e-2, np.float32)
        act = perturb(base, rng, 1e-2, np.float32)
        for k, v in act.values():
            k[:, :, -1] = np.nan
            v[:, :, -1] = np.nan
        raws.append(compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)[1])
    layers, k_bc, v_bc = aggregate_kv_bc_arrays(raws, lens)
    assert k_bc.shape == (3, 2)
    assert np.isnan(k_bc[2]).all() and np.isnan(v_bc[2]).all()
    assert np.isfinite(k_bc[:2]).all() and (k_bc[:2] > 0).all()


def test_to_columns_long_format():
    rng = np.random.default_rng(11)
    exp = make_kv(rng, 2, B=1, H=2, S=3, D=4)
    res = compare_kv_caches(exp, perturb(exp, rng, 1e-2, np.float32))
    cols = res.to_columns()
    assert len(cols["head"]) == 1 * 3 * 2 * 2
    i = np.nonzero((cols["token"] == 2) & (cols["layer"] == "model.layers.1.self_attn") & (cols["head"] == 1))[0][0]
    assert cols["k_linf"][i] == res[2]["model.layers.1.self_attn"][1].k_linf


def test_layers_with_different_kv_head_counts_are_nan_padded():
    rng = np.random.default_rng(12)
    a = make_kv(rng, 1, B=1, H=2, S=3, D=4)
    b = make_kv(rng, 1, B=1, H=4, S=3, D=4)
    exp = {"l0": a["model.layers.0.self_attn"], "l1": b["model.layers.0.self_attn"]}
    act = perturb(exp, rng, 1e-2, np.float32)
    res = compare_kv_caches(exp, act)
    assert res.shape == (1, 3, 2, 4) and list(res.num_heads) == [2, 4]
    assert np.isnan(res.k_linf[0, :, 0, 2:]).all() and np.isfinite(res.k_linf[0, :, 1]).all()
    assert len(res[0]["l0"]) == 2 and len(res[0]["l1"]) == 4
    assert len(res.to_columns()["head"]) == 3 * (2 + 4)
    assert_matches_oracle(res, exp, act)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("three", [True, False])
@pytest.mark.parametrize("heads", [(2, 4, 1, 4), (4, 2, 4, 3), (3, 3, 3, 3)])
def test_every_result_element_is_written_or_nan_padded_without_a_nan_fill(monkeypatch, backend, three, heads):
    """The result arrays are made uninitialised (``kv._uninit``): poisoned here with a value no
    metric gives, every layout (a narrower layer after a wider one, widening, K and V of other
    widths, NaN and inf positions) must give the numbers of arrays NaN-filled first."""
    import metrics.kv as kv
    from metrics.bc import numba_available

    if backend == "numba" and not numba_available():
        pytest.skip("numba does not import here")
    rng = np.random.default_rng(sum(heads) + 10 * three)
    base = {}
    for i, h in enumerate(heads):
        k = rng.standard_normal((2, h, 5, 4)).astype(np.float32)
        v = rng.standard_normal((2, h, 5, 6 if i == 2 else 4)).astype(np.float32)
        base[f"model.layers.{i}.self_attn"] = (k, v)
    exp, act = perturb(base, rng, 1e-2, np.float32), perturb(base, rng, 3e-2, np.float32)
    act["model.layers.1.self_attn"][0][1, 0, 2, 1] = np.nan  # a position the kernel leaves to numpy
    act["model.layers.3.self_attn"][1][0, -1, 4, 0] = np.inf
    kw = dict(baseline_kv=base, return_raw_errors=True) if three else {}

    def run(fill):
        monkeypatch.setattr(kv, "_uninit", lambda shape, dtype=np.float64: np.full(shape, fill, dtype))
        out = compare_kv_caches(exp, act, backend=backend, **kw)
        res, raw = out if three else (out, None)
        arrays = {n: getattr(res, n) for n in (*kv.HEAD_METRIC_NAMES, "k_bc", "v_bc")}
        if raw is not None:
            arrays.update({f: getattr(raw, f) for f in ("base_k", "base_v", "tgt_k", "tgt_v")})
        return arrays

    want, got = run(np.nan), run(-7777.0)
    for n, arr in got.items():
        assert not (arr == -7777.0).any(), f"{n}: elements never written"
        np.testing.assert_array_equal(arr, want[n], err_msg=n)
    assert np.isnan(want["k_linf"][:, :, 2, heads[2]:]).all() and np.isfinite(want["k_linf"][0, :, 0, :heads[0]]).all()
    assert np.isnan(want["base_k_linf"]).all() != three


def test_raw_errors_of_a_wider_later_layer_and_of_k_v_with_other_head_dims():
    rng = np.random.default_rng(14)
    narrow = make_kv(rng, 1, B=1, H=2, S=3, D=4)["model.layers.0.self_attn"]
    wide = make_kv(rng, 1, B=1, H=4, S=3, D=4)["model.layers.0.self_attn"]
    v_other = rng.standard_normal((1, 2, 3, 6)).astype(np.float32)  # V head_dim 6, K head_dim 4
    base = {"l0": narrow, "l1": wide, "l2": (narrow[0], v_other)}
    exp = perturb(base, rng, 1e-2, np.float32)
    act = perturb(base, rng, 1e-2, np.float32)
    _, raw = compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True)
    for t in range(3):
        for name, (bk, bv) in base.items():
            got = raw[t][name]
            want_k = np.abs(act[name][0][0, :, t] - bk[0, :, t]).ravel()
            want_v = np.abs(act[name][1][0, :, t] - bv[0, :, t]).ravel()
            np.testing.assert_array_equal(got.tgt_k, want_k.astype(np.float32))
            np.testing.assert_array_equal(got.tgt_v, want_v.astype(np.float32))


def test_one_minus_cos_is_accurate_at_bf16_noise_level():
    """1 - cos ~ 1e-6 for bf16 rounding; a float32 r.a/(|r||a|) gets it wrong by ~4 %."""
    rng = np.random.default_rng(13)
    base = make_kv(rng, 1, B=1, H=4, S=64, D=128)
    act = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    res = compare_kv_caches(act, act, baseline_kv=base)
    r = base["model.layers.0.self_attn"][0][0].astype(np.float64)  # [H, S, D]
    a = f64(act["model.layers.0.self_attn"][0][0])
    want = 1 - np.sum(r * a, -1) / np.sqrt(np.sum(r * r, -1) * np.sum(a * a, -1))  # [H, S]
    got = 1 - res.k_cos[0, :, 0, :].T
    assert np.median(want) < 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-3)
