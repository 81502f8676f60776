"""Calibration from KV captures in a real store, round trip through safetensors, and the CLI."""
import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.cli import main as cli_main
from nki_fp8.calibration import calibrate_kv_scales, per_layer_statistic
from nki_fp8.checkpoint import load_kv_scales
from nki_fp8.quant import quantize

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def captured(tmp_path):
    """A store with one BF16 run of two prompts; kv: [layer=3, kv_head=2, seq, head_dim=8].

    Layer l has K magnitudes ~ 10**l and V ~ 10**-l; prompt 1's layer 2 has its first 2 positions NaN-padded.
    """
    rng = np.random.default_rng(7)
    store = Store.open(tmp_path / "store")
    kvs = []
    with store.begin_run("hf", "tiny", dtype="bfloat16") as w:
        for p, seq in enumerate((5, 9)):
            k = np.stack([rng.standard_normal((2, seq, 8)) * 10.0**l for l in range(3)]).astype(BF16)
            v = np.stack([rng.standard_normal((2, seq, 8)) * 10.0**-l for l in range(3)]).astype(BF16)
            if p == 1:
                k[2, :, :2] = np.nan
                v[2, :, :2] = np.nan
            pid = w.add_prompt(list(range(p, p + seq)))
            w.write_kv(pid, k, v)
            kvs.append((k.astype(np.float32), v.astype(np.float32)))
    return store, w.run_id, kvs


def _loop_layer_absmax(arrays, layer):
    return max(float(np.nanmax(np.abs(a[layer]))) for a in arrays)


def test_absmax_calibration_matches_hand_maxima_and_round_trips_through_safetensors(captured, tmp_path):
    store, run, kvs = captured
    res = calibrate_kv_scales(store, run, method="absmax", platform="trn2", out_dir=tmp_path / "scales")
    for layer in range(3):
        assert res.k_stat[layer] == _loop_layer_absmax([k for k, _ in kvs], layer)
        assert res.v_stat[layer] == _loop_layer_absmax([v for _, v in kvs], layer)
    np.testing.assert_allclose(res.k_scale, res.k_stat / 240.0, rtol=1e-7)
    assert res.num_prompts == 2 and res.num_tokens == 14 and res.nonfinite_values == 2 * (2 * 2 * 8)  # K and V: 2 heads x 2 padded positions x 8
    loaded = load_kv_scales(tmp_path / "scales")
    assert loaded.num_layers == 3 and loaded.missing_layers == ()
    assert loaded.provenance["platform"] == "trn2" and loaded.provenance["fp8_max"] == 240.0
    np.testing.assert_array_equal(loaded.k_scale, (np.float32(1) / res.k_scale.astype(np.float32)))
    # The loaded kernel scale maps each layer's absmax onto the FP8 max: nothing clips, max is used.
    for layer in range(3):
        allk = np.concatenate([k[layer].ravel() for k, _ in kvs])
        q = quantize(allk[np.isfinite(allk)], loaded.k_scale[layer], platform="trn2").astype(np.float32)
        assert np.abs(q).max() == 240.0
    rows = store.sql("select layer, k_scale, v_scale, platform from kv_scales order by layer").to_pylist()
    assert [r["layer"] for r in rows] == [0, 1, 2] and rows[0]["platform"] == "trn2"
    assert rows[2]["k_scale"] == pytest.approx(res.k_scale[2])


def test_percentile_calibration_matches_numpy_over_finite_values(captured):
    store, run, kvs = captured
    res = calibrate_kv_scales(store, run, method="percentile", percentile=90.0, platform="trn3", record=False)
    for layer in range(3):
        vals = np.concatenate([np.abs(v[layer]).ravel() for _, v in kvs])
        want = np.percentile(vals[np.isfinite(vals)], 90.0)
        assert res.v_stat[layer] == pytest.approx(want, rel=1e-12)
        assert res.v_scale[layer] == pytest.approx(want / 448.0, rel=1e-6)
        assert res.v_stat[layer] < _loop_layer_absmax([v for _, v in kvs], layer)


def test_calibration_refuses_unknown_methods_and_empty_input(captured):
    store, run, _ = captured
    with pytest.raises(ValueError, match="unknown calibration method 'mse'"):
        calibrate_kv_scales(store, run, method="mse")
    with pytest.raises(ValueError, match="no KV arrays"):
        per_layer_statistic([])


def test_cli_calibrate_writes_loadable_scales(captured, tmp_path, capsys, monkeypatch):
    store, run, kvs = captured
    monkeypatch.setenv("NKI_FP8_PLATFORM", "trn3")
    assert cli_main(["calibrate", run, "--out", str(tmp_path / "cli"), "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "platform trn3" in out and "kv_scales.safetensors" in out
    loaded = load_kv_scales(tmp_path / "cli")
    want = _loop_layer_absmax([k for k, _ in kvs], 1) / 448.0
    assert loaded.checkpoint_k_scale[1] == pytest.approx(want, rel=1e-6)


def test_scales_calibrated_for_448_saturate_on_trn2_above_240_over_448_of_absmax(captured):
    # llm-compressor divides by 448; served on TRN2 the 240 clamp cuts everything above
    # 240/448 = 53.6% of the calibrated absmax.
    store, run, kvs = captured
    res = calibrate_kv_scales(store, run, platform="trn3", record=False)
    k0 = np.concatenate([k[0].ravel() for k, _ in kvs])
    k0 = k0[np.isfinite(k0)]
    s = float(res.kernel_k_scale[0])
    back = quantize(k0, s, platform="trn2").astype(np.float32) / s
    cut = np.abs(k0) > res.k_stat[0] * 240 / 448 * (1 + 2**-4)  # beyond the clamp by more than a rounding step
    assert cut.any()
    assert np.abs(back).max() == pytest.approx(res.k_stat[0] * 240 / 448, rel=1e-6)
    assert (np.abs(back[cut]) < np.abs(k0[cut])).all()
