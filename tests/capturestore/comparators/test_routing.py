"""The routing comparator on real HF engines and a tiny random Mixtral (docs/moe.md).

One ``capturestore run`` of a correct BF16 engine (HF SDPA against the eager references) is shared
by the module: its comparison must pass with flips that BF16 explains (and flips must occur).
Planted faults (``extractors.moe_faults``, written into a copy of the checkpoint) are captured as
the actual run against the same references, each first proven to change what the engine does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capturestore import Store, pipeline
from capturestore.analysis import compare_runs
from extractors.models import tiny_model
from extractors.modules import capture_hf_module_run
from extractors.moe_faults import write_moe_fault
from metrics.routing import top_k_experts

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Sta trou plai chean mou dou ser stan rai, and more",
           "In 2024 the numbers were 17 and 42 while", "Hello world this is a longer prompt to have many tokens routed"]
ROUTER = "model.layers.{}.mlp.gate"
FAULT_LAYER = 1


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A correct BF16 HF engine's routing + module comparison, and the runs it used."""
    model = tiny_model("mixtral-moe")
    path = tmp_path_factory.mktemp("routing") / "store"
    result = pipeline.run(model, PROMPTS, target="hf:bfloat16", num_tokens=8, store=path, quiet=True,
                          plugins="logits,routing,modules", modules="model.layers.*.mlp", out=lambda s: None)
    st = Store.open(path)
    row = st.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{result.comparison_id}'").to_pylist()
    runs = json.loads(row[0]["comparator_runs"])["routing"]
    got = st.sql(f"SELECT prompt_id, n_prompt_tokens FROM prompts WHERE run_id = '{runs['expected']}' "
                 f"ORDER BY prompt_idx").to_pylist()
    pids, plen = [r["prompt_id"] for r in got], [int(r["n_prompt_tokens"]) for r in got]
    rows = [st.read_tokens(runs["expected"], p) for p in pids]
    return {"model": model, "store": st, "path": path, "result": result, "runs": runs, "pids": pids,
            "prompts": [r[:n].tolist() for r, n in zip(rows, plen)], "teacher": [r[n:].tolist() for r, n in zip(rows, plen)]}


def _faulty_actual(moe_run, fault, tmp_path):
    """The actual module run (router + MoE block tensors, logits) of HF BF16 on a faulty checkpoint."""
    bad = write_moe_fault(moe_run["model"], tmp_path / fault, fault, FAULT_LAYER)
    return capture_hf_module_run(moe_run["store"], bad, moe_run["prompts"], moe_run["teacher"],
                                 modules=["model.layers.*.mlp", "model.layers.*.mlp.gate"], dtype="bfloat16")


def _compare(moe_run, actual):
    runs = moe_run["runs"]
    own = {"baseline": runs["baseline"], "expected": runs["expected"], "actual": actual}
    return compare_runs(moe_run["store"], expected_run=runs["expected"], actual_run=actual,
                        baseline_run=runs["baseline"], kv=False, comparators=["routing", "modules"],
                        comparator_runs={"routing": own, "modules": own}, allow_different_models=True)


def _verdict(result, name):
    return result.verdicts[name]


def test_correct_bf16_engine_passes_with_flips_bf16_explains(moe_run):
    st, res = moe_run["store"], moe_run["result"]
    layers = st.sql("SELECT * FROM routing_layers ORDER BY layer").to_pylist()
    assert [r["layer"] for r in layers] == [0, 1, 2]
    assert all(r["n_tokens"] > 0 and r["problem"] is None for r in layers)
    flips = st.sql("SELECT * FROM routing_flips").to_pylist()
    assert len(flips) == sum(r["n_flips"] for r in layers) > 0  # flips occurred ...
    assert all(f["explained"] and f["margin"] <= f["threshold"] for f in flips)  # ... and BF16 explains each
    assert all(f["base_experts"] != f["actual_experts"] for f in flips)
    v = _verdict(res, "routing")
    assert v.passed is True and res.passed is True


def test_routing_rows_match_an_independent_top_k_of_the_stored_router_logits(moe_run):
    """Oracle: recount the flips of one layer from the raw stored router logits with np.argpartition."""
    st, runs = moe_run["store"], moe_run["runs"]
    layer, n = 2, 0
    for pid in moe_run["pids"]:
        def logits(role, pid=pid):
            parts = [np.asarray(st.read_tensor(runs[role], pid, ROUTER.format(layer), phase=ph), np.float64)
                     for ph in ("prefill", "decode")]
            return np.concatenate([p.reshape(-1, 8) for p in parts])
        b, a = logits("baseline"), logits("actual")
        sb = [set(np.argpartition(-row, 2)[:2]) for row in b]
        sa = [set(np.argpartition(-row, 2)[:2]) for row in a]
        n += sum(x != y for x, y in zip(sb, sa))
    got = st.sql(f"SELECT n_flips FROM routing_layers WHERE layer = {layer}").column(0).to_pylist()[0]
    assert got == n


def test_router_bias_in_one_layer_changes_the_experts_and_fails_there(moe_run, tmp_path):
    st, runs = moe_run["store"], moe_run["runs"]
    act = _faulty_actual(moe_run, "router_bias", tmp_path)
    pid = moe_run["pids"][0]
    r_exp, r_act = (np.asarray(st.read_tensor(r, pid, ROUTER.format(FAULT_LAYER), phase="prefill"), np.float32)
                    .reshape(-1, 8) for r in (runs["expected"], act))
    assert (top_k_experts(r_exp, 2) != top_k_experts(r_act, 2)).any()  # the fault took effect: other experts chosen
    res = _compare(moe_run, act)
    v = _verdict(res, "routing")
    assert v.passed is False
    assert v.localisation.layer == FAULT_LAYER and v.localisation.module == ROUTER.format(FAULT_LAYER)
    layers = {r["layer"]: r for r in st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = "
                                             f"'{res.comparison_id}'").to_pylist()}
    assert layers[0]["n_unexplained"] == 0 and layers[FAULT_LAYER]["n_unexplained"] > 0
    assert res.passed is False and res.localisation["layer"] == FAULT_LAYER


def test_permuted_experts_in_one_layer_fail_the_module_verdict_there(moe_run, tmp_path):
    st, runs = moe_run["store"], moe_run["runs"]
    act = _faulty_actual(moe_run, "permute_experts", tmp_path)
    pid = moe_run["pids"][0]
    lg_exp, lg_act = st.read_logits(runs["expected"], pid), st.read_logits(act, pid)
    assert np.abs(np.asarray(lg_exp, np.float32) - np.asarray(lg_act, np.float32)).max() > 1.0  # took effect
    res = _compare(moe_run, act)
    m = _verdict(res, "modules")
    assert m.passed is False and m.localisation.layer == FAULT_LAYER
    assert m.localisation.module == f"model.layers.{FAULT_LAYER}.mlp"
    # the router of the faulty layer saw the same input as the expected run's: no flip there is unexplained
    layers = {r["layer"]: r for r in st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = "
                                             f"'{res.comparison_id}'").to_pylist()}
    assert layers[0]["n_unexplained"] == 0 and layers[FAULT_LAYER]["n_unexplained"] == 0
    assert res.passed is False and res.localisation["layer"] == FAULT_LAYER


def test_routing_on_a_dense_model_is_one_line_exit_2_store_untouched(moe_run, tmp_path):
    dense = tiny_model("llama-gqa")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    before = sorted((p.relative_to(moe_run["path"]), p.stat().st_size) for p in moe_run["path"].rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "capturestore.cli", "run", "--model", str(dense), "--prompts",
                        str(prompts), "--target", "hf:bfloat16", "--plugins", "routing", "--store", str(moe_run["path"])],
                       check=False, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "not a mixture of experts" in lines[0] and "llama" in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert sorted((q.relative_to(moe_run["path"]), q.stat().st_size) for q in moe_run["path"].rglob("*")) == before


def test_pipeline_judges_modules_and_logits_against_forced_routing_references(moe_run):
    """docs/moe.md "Forced routing": the correct engine's flips are all explained, so ``run``
    captured module references with its expert choices forced and judged modules against them;
    routing itself against the unforced references. Logits and KV are forced only where the
    engine's logits run routed as its module run (here HF's one-forward logits run broke a BF16
    tie otherwise than its stepwise module run, so they keep the unforced references)."""
    st, res = moe_run["store"], moe_run["result"]
    row = st.sql(f"SELECT expected_run, baseline_run, comparator_runs FROM comparisons WHERE comparison_id = "
                 f"'{res.comparison_id}'").to_pylist()[0]
    runs = json.loads(row["comparator_runs"])

    def cfg(rid):
        return json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()[0]["config"])

    act_mod = runs["routing"]["actual"]
    for rid in (runs["modules"]["expected"], runs["modules"]["baseline"]):
        assert cfg(rid).get("routing_forced_from") == act_mod
    assert cfg(row["expected_run"]).get("routing_forced_from") == cfg(row["baseline_run"]).get("routing_forced_from")
    for role in ("baseline", "expected"):
        assert "routing_forced_from" not in cfg(runs["routing"][role])
