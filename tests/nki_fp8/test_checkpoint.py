"""llm-compressor scale layout: reciprocal loading, fallbacks, legacy kv_scale, config validation."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nki_fp8.checkpoint import load_kv_scales, quantization_config_snippet, save_kv_scales, validate_quantization_config


def _write_llm_compressor_style(d, tensors, num_layers, qc=None):
    """A checkpoint as llm-compressor leaves it: bf16 [1] tensors next to the weights, config.json."""
    d.mkdir(parents=True, exist_ok=True)
    t = {k: torch.tensor([v], dtype=torch.bfloat16) for k, v in tensors.items()}
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(t, str(d / "model.safetensors"))
    cfg = {"num_hidden_layers": num_layers, "model_type": "llama"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))


def test_scales_load_as_reciprocals_of_the_checkpoint(tmp_path):
    c_k = np.array([0.5, 0.01, 3.0], np.float32)
    c_v = np.array([0.25, 1.0, 0.125], np.float32)
    save_kv_scales(tmp_path, c_k, c_v)
    s = load_kv_scales(tmp_path)
    assert s.num_layers == 3 and s.missing_layers == ()
    assert s.k_scale.tolist() == [2.0, float(np.float32(1) / np.float32(0.01)), float(np.float32(1) / np.float32(3.0))]
    assert s.v_scale.tolist() == [4.0, 1.0, 8.0]
    np.testing.assert_array_equal(s.checkpoint_k_scale, c_k.astype(np.float64))
    qc = json.loads((tmp_path / "quantization_config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_bfloat16_reciprocal_matches_vllm_neuron_exactly(tmp_path):
    _write_llm_compressor_style(tmp_path, {"model.layers.0.self_attn.k_scale": 0.3, "model.layers.0.self_attn.v_scale": 0.07}, 1)
    s = load_kv_scales(tmp_path, scale_dtype="bfloat16")
    # vllm_neuron: val = 1.0 / checkpoint[key].to(dtype=torch.bfloat16)
    want_k = (1.0 / torch.tensor([0.3], dtype=torch.bfloat16).to(torch.bfloat16)).item()
    want_v = (1.0 / torch.tensor([0.07], dtype=torch.bfloat16).to(torch.bfloat16)).item()
    assert s.k_scale.tolist() == [want_k] and s.v_scale.tolist() == [want_v]
    assert want_k == 3.328125  # bf16(0.3) = 0.30078125, 1/that = 3.3247 -> bf16 3.328125 (hand)


def test_missing_layers_fall_back_to_one_with_a_warning_naming_them(tmp_path):
    _write_llm_compressor_style(
        tmp_path,
        {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.5, "model.layers.2.self_attn.k_scale": 0.25},
        num_layers=4,
        qc=quantization_config_snippet(),
    )
    with pytest.warns(UserWarning, match=r"layers \[1, 2, 3\] of 4.*1\.0"):
        s = load_kv_scales(tmp_path)
    assert s.k_scale.tolist() == [2.0, 1.0, 4.0, 1.0]
    assert s.v_scale.tolist() == [2.0, 1.0, 1.0, 1.0]
    assert s.missing_layers == (1, 2, 3)


def test_legacy_kv_scale_applies_to_both_k_and_v(tmp_path):
    _write_llm_compressor_style(tmp_path, {"model.layers.0.self_attn.kv_scale": 0.125, "model.layers.1.self_attn.kv_scale": 2.0}, 2)
    s = load_kv_scales(tmp_path)
    assert s.k_scale.tolist() == [8.0, 0.5] and s.v_scale.tolist() == [8.0, 0.5]
    assert s.legacy_layers == (0, 1) and s.missing_layers == ()


def test_bad_scale_values_are_refused_naming_the_tensor(tmp_path):
    _write_llm_compressor_style(tmp_path, {"model.layers.0.self_attn.k_scale": 0.0}, 1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale"):
        load_kv_scales(tmp_path)
    with pytest.raises(ValueError, match="finite and > 0"):
        save_kv_scales(tmp_path / "x", [1.0, np.nan], [1.0, 1.0])


def test_only_fp8_kv_cache_only_configs_are_accepted():
    validate_quantization_config(quantization_config_snippet())
    with pytest.raises(ValueError, match="weights quantization"):
        validate_quantization_config({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8}}}})
    with pytest.raises(ValueError, match="8-bit float"):
        validate_quantization_config({"kv_cache_scheme": {"num_bits": 8, "type": "int"}})
    with pytest.raises(ValueError, match="dynamic"):
        validate_quantization_config({"kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": True}})
