"""The capture driver: every engine's run records the same run config (CAPTURE_CONFIG_KEYS),
and the engine-agnostic teacher-forced decode capture stores what a (toy numpy) engine produced."""
import json

import numpy as np
import pytest

from capturestore import Store
from capturestore.capture import CAPTURE_CONFIG_KEYS, begin_capture_run, capture_teacher_forced_run

B, T, V, H, D, PLEN = 2, 4, 50, 2, 8, 5
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _config(store, run_id):
    return json.loads(store.show(run_id)["run"]["config"])


def test_teacher_forced_decode_capture_stores_the_engines_logits_and_merged_kv(tmp_path):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, PLEN).tolist() for _ in range(B)]
    expected = rng.standard_normal((T, B, V)).astype(np.float32)
    kv = {n: (rng.standard_normal((B, H, PLEN + T, D)).astype(np.float32),
              rng.standard_normal((B, H, PLEN + T, D)).astype(np.float32)) for n in LAYERS}
    calls = []

    def generate_fn(input_ids):  # a correct engine: the expected logits from the first token not yet fed
        fed = len(input_ids[0]) - PLEN
        calls.append(fed)
        return expected[fed:]

    def kv_extract_fn(seq_len):
        return {n: (k[:, :, :seq_len], v[:, :, :seq_len]) for n, (k, v) in kv.items()}

    store = Store.open(tmp_path / "s")
    run_id, loop = capture_teacher_forced_run(
        store, generate_fn=generate_fn, prompts=prompts, expected_logits=expected, kv_extract_fn=kv_extract_fn,
        layer_names=LAYERS, run_kwargs=dict(engine="toy", model_path="/m", model_hash="h", dtype="float32",
                                            config={"logits_kind": "logits", "engine_key": 7}))
    assert calls == [0] and len(loop.calls) == 1  # no divergence: one generate call
    cfg = _config(store, run_id)
    assert set(CAPTURE_CONFIG_KEYS) <= set(cfg)
    assert cfg["capture"] == "teacher_forced_decode" and cfg["prompt_lens"] == [PLEN] * B
    assert cfg["layer_names"] == LAYERS and cfg["logits_kind"] == "logits" and cfg["engine_key"] == 7
    assert cfg["generate_calls"] == 1 and cfg["diverged_at"] == []
    teacher = expected.argmax(-1).T
    for b, pid in enumerate(store.prompts(run_id).column("prompt_id").to_pylist()):
        np.testing.assert_array_equal(store.read_tokens(run_id, pid), np.r_[prompts[b], teacher[b]])
        np.testing.assert_array_equal(store.read_logits(run_id, pid), expected[:, b])
        k, v = store.read_kv(run_id, pid)
        for i, n in enumerate(LAYERS):  # every position but the last (never fed back) is the engine's
            np.testing.assert_array_equal(k[i][:, : PLEN + T - 1], kv[n][0][b][:, : PLEN + T - 1])
            np.testing.assert_array_equal(v[i][:, : PLEN + T - 1], kv[n][1][b][:, : PLEN + T - 1])
            assert np.isnan(k[i][:, PLEN + T - 1]).all()


def test_an_unknown_capture_mode_is_refused_before_a_run_begins(tmp_path):
    store = Store.open(tmp_path / "s")
    with pytest.raises(ValueError, match="capture must be one of"):
        begin_capture_run(store, engine="toy", capture="teacher-forced", prompts=[[1]], layer_names=None,
                          logits_kind=None, model_path="/m", model_hash="h", dtype="float32")
    assert store.pending() == [] and store.runs().num_rows == 0


def test_hf_and_fp8_runs_record_the_common_run_config(tmp_path):
    from extractors import hf
    from extractors.models import tiny_model
    from nki_fp8.target import capture_fp8_kv_run

    path = tiny_model("llama-gqa")
    m16 = hf.load_hf_model(path, "bfloat16")
    store = Store.open(tmp_path / "s")
    prompts, teach = [[5, 6, 7, 8], [9, 10, 11]], [[12, 13], [14, 15]]
    runs = {
        "hf teacher-forced": hf.capture_hf_run(store, path, prompts, teacher_tokens=teach, dtype="bfloat16", model=m16),
        "hf greedy": hf.capture_hf_run(store, path, prompts, num_tokens=2, dtype="bfloat16", model=m16),
        "fp8": capture_fp8_kv_run(store, path, prompts, teach, [1.0] * 3, [1.0] * 3, platform="trn2", model=m16),
    }
    names = hf.hf_layer_names(m16)
    modes = {}
    for what, rid in runs.items():
        cfg = _config(store, rid)
        assert set(CAPTURE_CONFIG_KEYS) <= set(cfg), what
        assert cfg["prompt_lens"] == [4, 3] and cfg["layer_names"] == names and cfg["logits_kind"] == "logits", what
        modes[what] = cfg["capture"]
    assert modes == {"hf teacher-forced": "teacher_forced_prefill", "hf greedy": "greedy",
                     "fp8": "teacher_forced_prefill"}
