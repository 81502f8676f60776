"""The tiny GPT-OSS (alternating sliding/full attention, sinks, MoE) through ``capturestore run
--target vllm`` in FP32 with vLLM's hybrid KV cache manager on (its CPU default): two KV cache
groups, the sliding layers' blocks freed outside the window; verdicts pass and every capture
equals HF FP32 (``gpt_oss_checks``). One engine in this module."""
import pytest

from tests.capturestore import gpt_oss_checks as oss

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    return oss.run_fp32(tmp_path_factory.mktemp("gpt-oss-hybrid"))


def test_verdicts_pass_on_the_correct_engine(hybrid_run):
    result, _, text = hybrid_run
    assert result.passed, text
    assert set(result.verdicts) == {"logits", "kv", "modules"} and all(v.passed for v in result.verdicts.values())


def test_two_kv_cache_groups_sliding_positions_freed_outside_the_window_and_kv_equals_hf(hybrid_run):
    result, st, _ = hybrid_run
    oss.check_groups(oss.target_config(st, result), hybrid=True)
    oss.check_kv(st, result, hybrid=True)


def test_logits_and_every_mapped_module_equal_hf_fp32(hybrid_run):
    result, st, _ = hybrid_run
    oss.check_logits_equal_hf_fp32(st, result)
    oss.check_modules_equal_hf_fp32(st, result)
