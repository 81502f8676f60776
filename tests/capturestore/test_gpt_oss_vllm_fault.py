"""A planted GPT-OSS fault on vLLM-CPU: the attention sinks of layer 2 ignored (its CPU attention
impl's ``sinks`` set to None after load; the kernel then normalises over the scores alone). The
fault is first proven to change the engine's logits, then ``capturestore run`` (FP32 target,
logits + KV + modules) must FAIL and localise it to layer 2's attention. One engine here."""
import numpy as np
import pytest

from tests.capturestore.gpt_oss_checks import PROMPTS, run_fp32, target_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LAYER = 2  # a sliding layer; its K/V (computed before attention) stay right, its output does not


def _drop_sinks(worker, layer):
    impl = worker.model_runner.model.model.layers[layer].attn.attn.impl
    had = impl.sinks is not None
    impl.sinks = None
    return had


def _ignore_sinks_proven(llm, rows, say):
    from extractors.vllm_logits import vllm_teacher_forced_logits

    probe, teacher = [PROMPTS[1]], [[50, 51, 52, 53]]
    clean = vllm_teacher_forced_logits(llm, probe, teacher).logits[0].float().numpy()
    assert llm.collective_rpc(_drop_sinks, args=(LAYER,)) == [True]
    faulty = vllm_teacher_forced_logits(llm, probe, teacher).logits[0].float().numpy()
    change = float(np.abs(faulty - clean).max())
    say(f"fault: sinks of layer {LAYER} ignored; probe logits moved by {change:.3g}")
    return {"fault": f"sinks ignored in layer {LAYER}", "fault_probe_change": change}


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    return run_fp32(tmp_path_factory.mktemp("gpt-oss-fault"), engine_hook=_ignore_sinks_proven)


def test_ignoring_one_layers_sinks_changes_the_output_and_fails_localised_to_that_layer(faulty_run):
    result, st, text = faulty_run
    cfg = target_config(st, result)
    assert cfg["fault"] == f"sinks ignored in layer {LAYER}" and cfg["fault_probe_change"] > 1e-2, cfg
    assert not result.passed, text
    loc = result.localisation
    assert loc.layer == LAYER and loc.module.startswith(f"model.layers.{LAYER}.self_attn"), text
    assert not result.verdicts["logits"].passed and not result.verdicts["modules"].passed
