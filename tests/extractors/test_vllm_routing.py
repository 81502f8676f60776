"""MoE routing of a real vLLM-CPU engine (tiny random Mixtral) judged against HF FP32 / BF16
(docs/moe.md): the correct BF16 engine passes with flips BF16 explains (asserted to occur); a
router bias planted in a copy of the checkpoint before the engine loads it (ENGINES.md: weights
mutated after load may be a no-op) changes the chosen experts and fails at its layer; two experts
swapped in the running engine (``extractors.moe_faults.inject_vllm_moe_fault``, the fused-MoE
weights are read at every forward) change the MoE block's output from that layer on and fail the
modules verdict there, while that layer's routing is unchanged."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Sta trou plai chean mou dou ser stan rai, and more",
           "In 2024 the numbers were 17 and 42 while", "Hello world this is a longer prompt to have many tokens routed"]
ROUTER = "model.layers.{}.mlp.gate"
MLP = "model.layers.{}.mlp"
FAULT_LAYER = 1


@pytest.fixture(scope="module")
def vllm_moe(tmp_path_factory):
    from capturestore import Store, pipeline
    from extractors.models import tiny_model

    model = tiny_model("mixtral-moe")
    path = tmp_path_factory.mktemp("vllm-routing") / "store"
    result = pipeline.run(model, PROMPTS, target="vllm", num_tokens=8, store=path, quiet=True,
                          plugins="logits,routing,modules", modules=MLP.format("*"), out=lambda s: None)
    st = Store.open(path)
    row = st.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{result.comparison_id}'").to_pylist()
    all_runs = json.loads(row[0]["comparator_runs"])
    runs = all_runs["routing"]
    got = st.sql(f"SELECT prompt_id, n_prompt_tokens FROM prompts WHERE run_id = '{runs['expected']}' "
                 f"ORDER BY prompt_idx").to_pylist()
    pids = [r["prompt_id"] for r in got]
    toks = [st.read_tokens(runs["expected"], r["prompt_id"]) for r in got]
    n = [int(r["n_prompt_tokens"]) for r in got]
    return {"model": model, "store": st, "result": result, "runs": runs, "module_runs": all_runs["modules"], "pids": pids,
            "prompts": [t[:k].tolist() for t, k in zip(toks, n)], "teacher": [t[k:].tolist() for t, k in zip(toks, n)]}


def test_correct_vllm_bf16_engine_passes_with_explained_flips(vllm_moe):
    st, res = vllm_moe["store"], vllm_moe["result"]
    layers = st.sql("SELECT * FROM routing_layers ORDER BY layer").to_pylist()
    assert [r["layer"] for r in layers] == [0, 1, 2] and all(r["problem"] is None for r in layers)
    n_flips = sum(r["n_flips"] for r in layers)
    assert n_flips > 0 and sum(r["n_unexplained"] for r in layers) == 0
    assert res.verdicts["routing"].passed is True


def test_router_bias_planted_before_load_fails_at_its_layer(vllm_moe, tmp_path):
    from capturestore.analysis import compare_runs
    from extractors.moe_faults import write_moe_fault
    from extractors.vllm_modules import capture_vllm_module_run
    from extractors.vllm_rpc import close_llm, make_llm
    from metrics.routing import top_k_experts

    st, runs = vllm_moe["store"], vllm_moe["runs"]
    bad = write_moe_fault(vllm_moe["model"], tmp_path / "bad", "router_bias", FAULT_LAYER)
    llm = make_llm(bad, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)
    try:
        act = capture_vllm_module_run(st, llm, bad, vllm_moe["prompts"], None,
                                      modules=[ROUTER.format(i) for i in range(3)], teacher_tokens=vllm_moe["teacher"])
    finally:
        close_llm(llm)
    pid = vllm_moe["pids"][0]
    r_exp, r_act = (np.asarray(st.read_tensor(r, pid, ROUTER.format(FAULT_LAYER), phase="prefill"), np.float32)
                    .reshape(-1, 8) for r in (runs["expected"], act))
    assert (top_k_experts(r_exp, 2) != top_k_experts(r_act, 2)).any()  # the fault took effect in the engine
    own = {"baseline": runs["baseline"], "expected": runs["expected"], "actual": act}
    res = compare_runs(st, expected_run=runs["expected"], actual_run=act, baseline_run=runs["baseline"], kv=False, logits=False,
                       comparators=["routing"], comparator_runs={"routing": own}, allow_different_models=True)
    v = res.verdicts["routing"]
    assert v.passed is False and v.localisation.layer == FAULT_LAYER
    layers = {r["layer"]: r for r in st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = "
                                             f"'{res.comparison_id}'").to_pylist()}
    assert layers[0]["n_unexplained"] == 0 and layers[FAULT_LAYER]["n_unexplained"] > 0


def test_experts_swapped_in_the_running_engine_fail_modules_at_their_layer(vllm_moe, tmp_path):
    from capturestore.analysis import compare_runs
    from extractors.moe_faults import inject_vllm_moe_fault, remove_vllm_moe_faults
    from extractors.vllm_modules import capture_vllm_module_run
    from extractors.vllm_rpc import close_llm, make_llm, vllm_teacher_forced_logprobs

    st, runs, mods = vllm_moe["store"], vllm_moe["runs"], vllm_moe["module_runs"]
    probe = vllm_moe["prompts"][0] + vllm_moe["teacher"][0]
    llm = make_llm(vllm_moe["model"], dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)

    def logprobs():
        return vllm_teacher_forced_logprobs(llm, [probe[:1]], [probe[1:]])[0][0].numpy()

    try:
        before = logprobs()
        fault = inject_vllm_moe_fault(llm, "swap_experts", FAULT_LAYER, probe, expert=0, other=1)
        act = capture_vllm_module_run(st, llm, vllm_moe["model"], vllm_moe["prompts"], None,
                                      modules=[MLP.format("*"), ROUTER.format("*")], teacher_tokens=vllm_moe["teacher"])
        assert remove_vllm_moe_faults(llm) == 1
        after = logprobs()
    finally:
        close_llm(llm)
    assert fault.experts_module.startswith(f"model.layers.{FAULT_LAYER}.block_sparse_moe.experts")
    assert fault.router_module == f"model.layers.{FAULT_LAYER}.block_sparse_moe.gate"
    assert fault.max_abs_dlogprob > 0.1 > fault.clean_spread  # took effect
    np.testing.assert_array_equal(after, before)  # swapping back restores the engine exactly
    # against the correct engine's own capture: the layers before are bit-identical, the faulty layer's
    # router saw the same input (same logits), its MoE output moved
    pid, clean = vllm_moe["pids"][0], runs["actual"]

    def t(rid, name):
        return np.asarray(st.read_tensor(rid, pid, name, phase="prefill"), np.float32)
    assert np.array_equal(t(act, MLP.format(0)), t(clean, MLP.format(0)))
    assert np.array_equal(t(act, ROUTER.format(FAULT_LAYER)), t(clean, ROUTER.format(FAULT_LAYER)))
    assert np.abs(t(act, MLP.format(FAULT_LAYER)) - t(clean, MLP.format(FAULT_LAYER))).max() > 0.05
    # and it is the swap it says: the faulty layer's MoE output is HF BF16's on a checkpoint with
    # those two experts swapped (write_moe_fault), as close as the clean engine is to clean HF BF16
    from extractors.modules import capture_hf_module_run
    from extractors.moe_faults import write_moe_fault

    twin = write_moe_fault(vllm_moe["model"], tmp_path / "swapped", "swap_experts", FAULT_LAYER, expert=0, other=1)
    hf_twin = capture_hf_module_run(st, twin, vllm_moe["prompts"], vllm_moe["teacher"], modules=[MLP.format(FAULT_LAYER)],
                                    dtype="bfloat16")

    def token_err(x, y):  # per-token max |x - y| of the faulty layer's MoE output, every prompt's prefill
        return np.concatenate([np.abs(np.asarray(st.read_tensor(x, p, MLP.format(FAULT_LAYER), phase="prefill"),
                                                 np.float32)[0]
                                      - np.asarray(st.read_tensor(y, p, MLP.format(FAULT_LAYER), phase="prefill"),
                                                   np.float32)[0]).max(-1) for p in vllm_moe["pids"]])

    err = {"swap": token_err(act, hf_twin), "clean": token_err(clean, runs["expected"]), "fault": token_err(act, clean)}
    q = {k: (float(np.quantile(v, 0.5)), float(np.quantile(v, 0.9))) for k, v in err.items()}
    print("layer-1 MoE output, per-token max |diff| (median, p90):", q)
    assert q["swap"][0] <= 2 * q["clean"][0] + 1e-3 and q["fault"][1] > 5 * q["clean"][1]
    res = compare_runs(st, expected_run=mods["expected"], actual_run=act, baseline_run=mods["baseline"], kv=False,
                       logits=False, comparators=["routing", "modules"], allow_different_models=True,
                       comparator_runs={"routing": {**runs, "actual": act}, "modules": {**mods, "actual": act}})
    m = res.verdicts["modules"]
    assert m.passed is False and m.localisation.layer == FAULT_LAYER and m.localisation.module == MLP.format(FAULT_LAYER)
    layers = {r["layer"]: r for r in st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = "
                                             f"'{res.comparison_id}'").to_pylist()}
    assert layers[0]["n_unexplained"] == 0 and layers[FAULT_LAYER]["n_unexplained"] == 0
    assert res.passed is False and res.localisation["layer"] == FAULT_LAYER
