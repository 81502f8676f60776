"""The FP8 KV cache target on tiny local models: quantize-on-write and the three-way verdicts."""
import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from capturestore import Store  # noqa: E402
from extractors import hf  # noqa: E402
from extractors.models import tiny_model  # noqa: E402
from nki_fp8.calibration import calibrate_kv_scales  # noqa: E402
from nki_fp8.checkpoint import load_kv_scales  # noqa: E402
from nki_fp8.quant import dequantize, quantize  # noqa: E402
from nki_fp8.target import (  # noqa: E402
    analyze_fp8_kv_target,
    capture_fp8_kv_run,
    extract_fp8_kv_teacher_forced,
    make_fp8_kv_cache,
    rescale_kv_magnitudes,
)

BF16 = ml_dtypes.bfloat16
# Layer 1: K x 256 (max ~1000, beyond TRN2's 240); layer 2: V x 2^-10 (max ~3e-3, FP8 subnormal).
K_FACTORS, V_FACTORS = [1.0, 256.0, 1.0], [1.0, 1.0, 2.0**-10]


def _bits(t):
    return t.contiguous().view(torch.int16).numpy()


@pytest.fixture(scope="module")
def gqa():
    path = tiny_model("llama-gqa")
    tr = lambda m: rescale_kv_magnitudes(m, K_FACTORS, V_FACTORS)  # noqa: E731
    return path, tr(hf.load_hf_model(path, "float32")), tr(hf.load_hf_model(path, "bfloat16"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    p = [rng.integers(4, 1000, n).tolist() for n in (12, 20, 7)]
    t = [rng.integers(4, 1000, 8).tolist() for _ in p]
    return p, t


def test_cache_layer_quantizes_on_write_bit_exactly_like_the_numpy_reference(gqa):
    _, _, m16 = gqa
    cache = make_fp8_kv_cache(m16.config, [3.0, 0.25, 100.0], [1.0, 7.5, 2.0], platform="trn2")
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(1, 2, 5, 32, generator=g) * 300).to(torch.bfloat16)  # beyond 240 after scaling
    v = (torch.randn(1, 2, 5, 32, generator=g) * 0.01).to(torch.bfloat16)
    keys, values = cache.update(k, v, 1)
    kn = k.float().numpy().astype(BF16)
    vn = v.float().numpy().astype(BF16)
    want_k = dequantize(quantize(kn, 0.25, platform="trn2"), 0.25, out_dtype=BF16)
    want_v = dequantize(quantize(vn, 7.5, platform="trn2"), 7.5, out_dtype=BF16)
    np.testing.assert_array_equal(_bits(keys), want_k.view(np.int16))
    np.testing.assert_array_equal(_bits(values), want_v.view(np.int16))
    assert keys.float().abs().max().item() == 240 / 0.25  # clamped at the TRN2 max
    keys2, _ = cache.update(k, v, 1)  # a second write appends, quantized the same way
    assert keys2.shape[2] == 10 and torch.equal(keys2[:, :, 5:], keys)


def test_power_of_two_rescaling_keeps_logits_bit_identical(gqa, prompts):
    path, _, m16 = gqa
    plain = hf.load_hf_model(path, "bfloat16")
    a, _ = hf.extract_hf_kv_caches_teacher_forced(plain, *prompts, return_logits=True)
    b, kv = hf.extract_hf_kv_caches_teacher_forced(m16, *prompts, return_logits=True)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    k1 = kv["model.layers.1.self_attn.attn"][0].float().nan_to_num().abs().max().item()
    v2 = kv["model.layers.2.self_attn.attn"][1].float().nan_to_num().abs().max().item()
    assert k1 > 240 and v2 < 2.0**-6  # outside FP8's range at scale 1.0, as intended


def test_captured_fp8_kv_is_on_the_fp8_grid_of_each_layer_scale(gqa, prompts):
    _, _, m16 = gqa
    ks, vs = [2.0, 0.125, 4.0], [8.0, 16.0, 4096.0]
    kv = extract_fp8_kv_teacher_forced(m16, *prompts, ks, vs, platform="trn3")
    for i, (k, v) in enumerate(kv.values()):
        for x, s in ((k, ks[i]), (v, vs[i])):
            xn = x.float().numpy()
            fin = np.isfinite(xn)
            codes = xn[fin] * s  # exact: power-of-two scale
            again = quantize(codes, 1.0, platform="trn3").astype(np.float32)
            np.testing.assert_array_equal(again, codes)


def test_three_way_analysis_fails_unit_scales_and_passes_calibrated_ones(gqa, prompts, tmp_path):
    path, m32, m16 = gqa
    store = Store.open(tmp_path / "store")
    run = hf.capture_hf_run(store, path, prompts[0], teacher_tokens=prompts[1], dtype="bfloat16", model=m16)
    calibrate_kv_scales(store, run, method="absmax", platform="trn2", out_dir=tmp_path / "scales")
    cal = load_kv_scales(tmp_path / "scales")

    unit = analyze_fp8_kv_target(path, *prompts, [1.0] * 3, [1.0] * 3, platform="trn2", label="unit",
                                 store=store, models=(m32, m16))
    good = analyze_fp8_kv_target(path, *prompts, cal.k_scale, cal.v_scale, platform="trn2", label="calibrated",
                                 store=store, models=(m32, m16))
    # Unit scales: K of layer 1 clipped at 240, V of layer 2 flushed to subnormals.
    assert not unit.passed
    assert unit.floor_verdict.first_failing_layer == "model.layers.1.self_attn.attn"
    assert set(unit.worst_layers) == {"model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"}
    l0, l1, l2 = unit.layers
    assert l1.k_vs_floor > 5 and l2.v_vs_floor > 5
    assert l0.k_vs_floor < 1.5 and l0.v_vs_floor < 1.5  # layer 0's K/V are O(1): scale 1.0 is fine there
    # Calibrated scales: every layer within a small factor of pure FP8 rounding.
    assert good.passed and good.worst_layers == ()
    assert max(r.worst_vs_floor for r in good.layers) < 1.6
    assert all(r.k_rel_l2 < 0.06 and r.v_rel_l2 < 0.06 for r in good.layers)
    # FP8 is not BF16: both runs fail the BF16-noise verdict; the floor verdict is what separates them.
    assert not unit.bf16_verdict.passed and not good.bf16_verdict.passed
    rows = store.sql(
        "select label, layer, k_vs_floor, v_vs_floor, passed_floor from fp8_kv_layer_metrics order by label, layer"
    ).to_pylist()
    assert [(r["label"], r["passed_floor"]) for r in rows] == [
        ("calibrated", True), ("calibrated", True), ("calibrated", True), ("unit", True), ("unit", False), ("unit", False)
    ]
    assert rows[4]["k_vs_floor"] == pytest.approx(l1.k_vs_floor)
    assert "worst layers model.layers.2.self_attn.attn, model.layers.1.self_attn.attn" in unit.summary()


def test_sliding_window_layers_quantize_too():
    path = tiny_model("mistral-sliding")
    m16 = hf.load_hf_model(path, "bfloat16")
    p = [list(range(4, 30))]
    t = [list(range(40, 48))]
    plain = hf.extract_hf_kv_caches_teacher_forced(m16, p, t)
    fp8 = extract_fp8_kv_teacher_forced(m16, p, t, [1.0] * 3, [1.0] * 3, platform="trn2")
    for name in plain:
        a, b = plain[name][0].float().numpy(), fp8[name][0].float().numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b))  # same window: dropped positions NaN in both
        fin = np.isfinite(b)
        np.testing.assert_array_equal(quantize(b[fin], 1.0).astype(np.float32), b[fin])
        assert not np.array_equal(a[fin], b[fin])


def test_fp8_target_is_stored_as_a_run_with_its_scales(gqa, prompts, tmp_path):
    path, _, m16 = gqa
    store = Store.open(tmp_path / "store")
    ks, vs = [2.0, 0.125, 4.0], [8.0, 16.0, 4096.0]
    run = capture_fp8_kv_run(store, path, *prompts, ks, vs, platform="trn2", model=m16)
    info = store.show(run)
    assert info["run"]["engine"] == "hf-fp8kv"
    cfg = json.loads(info["run"]["config"])
    assert cfg["k_scale"] == ks and cfg["v_scale"] == vs and cfg["platform"] == "trn2" and cfg["fp8_max"] == 240.0
    direct = extract_fp8_kv_teacher_forced(m16, [prompts[0][1]], [prompts[1][1]], ks, vs, platform="trn2")
    pid = store.prompts(run).column("prompt_id").to_pylist()[1]
    k, v = store.read_kv(run, pid)
    names = list(direct)
    for i, n in enumerate(names):
        np.testing.assert_array_equal(np.asarray(k[i]).view(np.uint16), _bits(direct[n][0][0]).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(v[i]).view(np.uint16), _bits(direct[n][1][0]).view(np.uint16))


def test_the_fp8_target_is_an_ordinary_comparison_whose_rows_carry_its_id(gqa, prompts, tmp_path):
    path, m32, m16 = gqa
    store = Store.open(tmp_path / "store")
    res = analyze_fp8_kv_target(path, *prompts, [1.0] * 3, [1.0] * 3, platform="trn2", label="unit",
                                store=store, models=(m32, m16))
    cmp_row, = store.sql("SELECT c.*, r.engine FROM comparisons c JOIN runs r ON r.run_id = c.actual_run").to_pylist()
    assert cmp_row["engine"] == "hf-fp8kv" and cmp_row["three_way"] and cmp_row["label"] == "unit"
    assert cmp_row["fp8_floor_passed"] is False and cmp_row["passed"] is False  # FP8 with unit scales
    assert cmp_row["failure_layer"] == 1  # the floor's first failing layer, KV evidence the same
    rows = store.sql("SELECT * FROM fp8_kv_layer_metrics ORDER BY layer").to_pylist()
    assert {r["comparison_id"] for r in rows} == {cmp_row["comparison_id"]}
    # relative L2 of the stored FP8 K against the stored FP32 K, all prompts pooled (numpy oracle)
    base, act = cmp_row["baseline_run"], cmp_row["actual_run"]
    for i, r in enumerate(rows):
        num = den = 0.0
        for pid in store.prompts(base).column("prompt_id").to_pylist():
            b = np.asarray(store.read_kv(base, pid)[0][i], np.float64)
            a = np.asarray(store.read_kv(act, pid)[0][i], np.float64)
            ok = np.isfinite(a) & np.isfinite(b)
            num += float(((a - b)[ok] ** 2).sum())
            den += float((b[ok] ** 2).sum())
        assert r["k_rel_l2"] == pytest.approx(np.sqrt(num / den), rel=1e-12)
        assert r["k_vs_floor"] == pytest.approx(res.layers[i].k_vs_floor, rel=0, abs=0)


def test_the_floor_comparator_refuses_an_actual_run_without_fp8_scales(gqa, prompts, tmp_path):
    from capturestore.analysis import compare_runs

    path, m32, m16 = gqa
    store = Store.open(tmp_path / "store")
    base = hf.capture_hf_run(store, path, prompts[0], teacher_tokens=prompts[1], dtype="float32", model=m32)
    exp = hf.capture_hf_run(store, path, prompts[0], teacher_tokens=prompts[1], dtype="bfloat16", model=m16)
    act = hf.capture_hf_run(store, path, prompts[0], teacher_tokens=prompts[1], dtype="bfloat16", model=m16)
    with pytest.raises(ValueError, match=f"actual run {act} records no k_scale"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=["fp8_kv_floor"])
    assert not list((store.root / "tables").glob("comparisons/*.parquet")) or store.sql(
        "SELECT count(*) n FROM comparisons").column("n").to_pylist() == [0]
