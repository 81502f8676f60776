"""The tiny GPT-OSS (alternating sliding/full attention, sinks, MoE) through ``capturestore run
--target vllm`` in FP32 with vLLM's hybrid KV cache manager on (its CPU default): two KV cache
groups, the sliding layers' blocks freed outside the window; verdicts pass and every capture
equals HF FP32 (``gpt_oss_checks``). With ``routing``: GPT-OSS's router (``mlp.router``) judged on
vLLM, and the references of logits, KV and modules forced to the engine's expert choices when the
BF16 expected run flips (docs/moe.md "Forced routing"). One engine in this module."""
import pytest

from tests.capturestore import gpt_oss_checks as oss

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    return oss.run_fp32(tmp_path_factory.mktemp("gpt-oss-hybrid"), plugins=("logits", "kv", "modules", "routing"))


def test_verdicts_pass_on_the_correct_engine(hybrid_run):
    result, _, text = hybrid_run
    assert result.passed, text
    assert set(result.verdicts) == {"logits", "kv", "modules", "routing"}
    assert all(v.passed for v in result.verdicts.values())


def test_routing_judged_on_vllm_and_references_forced_to_the_engines_experts(hybrid_run):
    import json

    result, st, text = hybrid_run
    layers = st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = '{result.comparison_id}' "
                    "ORDER BY layer").to_pylist()
    assert [r["module"] for r in layers] == [f"model.layers.{i}.mlp.router" for i in range(4)]
    assert all(r["n_tokens"] > 0 and r["problem"] is None and r["n_unexplained"] == 0 for r in layers)
    row = st.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{result.comparison_id}'").to_pylist()
    act_mod = json.loads(row[0]["comparator_runs"])["routing"]["actual"]
    forced = "routing: forced" in text
    assert forced == (sum(r["n_flips"] + r["noise_flips"] for r in layers) > 0), text
    if forced:  # the FP32 engine's choices forced onto both references
        for role in ("baseline", "expected"):
            cfg = json.loads(st.show(result.runs[role])["run"]["config"])
            assert cfg["routing_forced_from"] == act_mod


def test_two_kv_cache_groups_sliding_positions_freed_outside_the_window_and_kv_equals_hf(hybrid_run):
    result, st, _ = hybrid_run
    oss.check_groups(oss.target_config(st, result), hybrid=True)
    oss.check_kv(st, result, hybrid=True)


def test_logits_and_every_mapped_module_equal_hf_fp32(hybrid_run):
    result, st, _ = hybrid_run
    oss.check_logits_equal_hf_fp32(st, result)
    oss.check_modules_equal_hf_fp32(st, result)
