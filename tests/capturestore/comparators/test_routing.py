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
    # ... and BF16 explains each: the margin the chosen experts needed (at least FP32's top-k margin)
    assert all(f["explained"] and f["margin"] <= f["needed_margin"] <= f["threshold"] for f in flips)
    assert all(f["base_experts"] != f["actual_experts"] for f in flips)
    v = _verdict(res, "routing")
    assert v.passed is True and res.passed is True


def test_routing_rows_match_an_independent_top_k_of_the_stored_router_logits(moe_run):
    """Oracle: recount the flips of one layer from the raw stored router logits, one token at a time,
    by transformers' Mixtral router line (``torch.topk(softmax(logits.float()))``), the rule the
    HF engine chose its experts by. A rule that breaks exact BF16 ties otherwise (``np.argpartition``,
    the lower expert id) counts 2 here, one of them a tie the engine broke toward FP32's expert."""
    import torch

    st, runs = moe_run["store"], moe_run["runs"]
    layer, n, n_other = 2, 0, 0
    for pid in moe_run["pids"]:
        def logits(role, pid=pid):
            parts = [np.asarray(st.read_tensor(runs[role], pid, ROUTER.format(layer), phase=ph), np.float32)
                     for ph in ("prefill", "decode")]
            return np.concatenate([p.reshape(-1, 8) for p in parts])

        def router(row):
            return set(torch.topk(torch.softmax(torch.from_numpy(row).float(), -1), 2).indices.tolist())
        b, a = logits("baseline"), logits("actual")
        n += sum(router(x) != router(y) for x, y in zip(b, a))
        n_other += sum(set(np.argpartition(-x, 2)[:2]) != set(np.argpartition(-y, 2)[:2]) for x, y in zip(b, a))
    got = st.sql(f"SELECT n_flips FROM routing_layers WHERE layer = {layer} AND comparison_id = "
                 f"'{moe_run['result'].comparison_id}'").column(0).to_pylist()[0]
    assert got == n
    print(f"layer {layer}: {n} flips as the router chose, {n_other} by np.argpartition")


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
    # the earliest unexplained flip by (layer, prefill before decode, position or decode step), any prompt
    rows = st.sql(f"SELECT layer, phase, position, gen_token_idx FROM routing_flips WHERE comparison_id = "
                  f"'{res.comparison_id}' AND NOT explained").to_pylist()
    key = [(r["layer"], r["phase"] == "decode", r["gen_token_idx"] if r["phase"] == "decode" else r["position"])
           for r in rows]
    firsts = [r for r, k in zip(rows, key) if k == min(key)]
    assert any((v.localisation.layer, v.localisation.token) == (f["layer"], f["gen_token_idx"])
               and f"position {f['position']} " in v.text for f in firsts)


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


# ---------------------------------------------------------------- evidence the routing verdict must not misread


def _copy_run(moe_run, rid, *, nan_prefill=(), not_computed=(), drop_decode=False, extra=(), model_path=None,
              config=None):
    """A copy of module run ``rid`` written through the public write path (``Store.begin_run`` +
    ``extractors.modules.write_prompt_modules``), per prompt: the prefill rows at ``nan_prefill``
    NaN in every module (as a vLLM prefix-cache hit leaves them), ``not_computed`` listed in
    ``tensors/not_computed/prefill`` (both clipped to the prompt; ``extractors.vllm_modules.NOT_COMPUTED``, as
    ``capture_vllm_module_run`` writes it), no decode steps if ``drop_decode``, the extra
    ``(module, source module)`` tensors; the run config replaced by ``config(old)`` if given."""
    import torch

    from capturestore.comparators.modules import tensor_index
    from extractors.modules import write_prompt_modules
    from extractors.vllm_modules import NOT_COMPUTED

    st = moe_run["store"]
    meta = st.sql(f"SELECT engine, model_path, model_hash, dtype, device, config FROM runs "
                  f"WHERE run_id = '{rid}'").to_pylist()[0]
    cfg = json.loads(meta["config"])
    run = st.begin_run(engine=meta["engine"], model_path=str(model_path or meta["model_path"]),
                       model_hash=meta["model_hash"], dtype=meta["dtype"], device=meta["device"],
                       config=config(cfg) if config else cfg)
    held = tensor_index(st, {"r": rid})
    with run:
        for pid, prompt, cont in zip(moe_run["pids"], moe_run["prompts"], moe_run["teacher"]):
            mods = held[(rid, pid)]
            prefill, decode = [], {}
            for (m, phase) in mods:
                t = np.asarray(st.read_tensor(rid, pid, m, phase=phase), np.float32)
                if phase == "prefill":
                    t = t[0].copy()
                    t[[i for i in nan_prefill if i < len(prompt)]] = np.nan
                    prefill.append((m, 0, torch.from_numpy(t)))
                elif not drop_decode:
                    decode[m] = [torch.from_numpy(s) for s in t]
            for name, src in extra:
                prefill.append((name, 0, torch.from_numpy(np.asarray(st.read_tensor(rid, pid, src, phase="prefill"),
                                                                     np.float32)[0])))
                if not drop_decode:
                    decode[name] = [torch.from_numpy(s) for s in np.asarray(
                        st.read_tensor(rid, pid, src, phase="decode"), np.float32)]
            logits = torch.from_numpy(np.asarray(st.read_logits(rid, pid), np.float32))
            new = write_prompt_modules(run, prompt, cont[:1] if drop_decode else cont, prefill, decode,
                                       logits[:1] if drop_decode else logits)
            if len(not_computed):
                nc = [i for i in not_computed if i < len(prompt)]
                run.write_tensor(new, NOT_COMPUTED, np.asarray(nc, np.int64), phase="prefill",
                                 dims=["index"])
    return run.run_id


def _routing(moe_run, runs, modules=False):
    st = moe_run["store"]
    names = ["routing", "modules"] if modules else ["routing"]
    res = compare_runs(st, expected_run=runs["expected"], actual_run=runs["actual"], baseline_run=runs["baseline"],
                       kv=False, comparators=names, comparator_runs={n: runs for n in names},
                       allow_different_models=True)
    layers = st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = '{res.comparison_id}' "
                    f"ORDER BY layer").to_pylist()
    return (res.verdicts["routing"], layers) + ((res,) if modules else ())


SKIPPED = [0, 1, 2, 3]  # prompt positions a prefix cache served (NaN rows)


def test_prefix_cache_positions_are_left_out_of_routing_and_counted(moe_run):
    runs = moe_run["runs"]
    act = _copy_run(moe_run, runs["actual"], nan_prefill=SKIPPED, not_computed=SKIPPED)
    st, pid = moe_run["store"], moe_run["pids"][0]
    assert np.isnan(np.asarray(st.read_tensor(act, pid, ROUTER.format(1), phase="prefill"))[0, SKIPPED]).all()
    v, layers, res = _routing(moe_run, {**runs, "actual": act}, modules=True)
    full = st.sql("SELECT layer, n_tokens FROM routing_layers WHERE comparison_id = "
                  f"'{moe_run['result'].comparison_id}' ORDER BY layer").to_pylist()
    n_skip = len(SKIPPED) * len(moe_run["pids"])
    assert v.passed is True, v.text  # NaN rows that no run computed are no evidence of a bad router
    assert [r["not_computed"] for r in layers] == [n_skip] * 3
    assert [r["n_tokens"] for r in layers] == [r["n_tokens"] - n_skip for r in full]
    assert all(r["problem"] is None and r["passed"] is True for r in layers)
    assert v.passed is True and f"{3 * n_skip} token-layer positions not computed" in v.text
    # the modules comparator leaves out the same positions (one helper): every prefill module row counts them
    mods = st.sql(f"SELECT module, phase, not_computed, passed FROM module_verdicts WHERE comparison_id = "
                  f"'{res.comparison_id}'").to_pylist()
    assert mods and all(r["not_computed"] == (n_skip if r["phase"] == "prefill" else 0) for r in mods)
    assert res.verdicts["modules"].passed is True


def test_a_layer_with_nothing_but_not_computed_positions_is_not_judged(moe_run):
    """Every role prefill-only, every prompt position listed as not computed: nothing left to judge."""
    runs = moe_run["runs"]
    longest = max(len(p) for p in moe_run["prompts"])
    own = {role: _copy_run(moe_run, rid, drop_decode=True, nan_prefill=range(longest) if role == "actual" else (),
                           not_computed=range(longest) if role == "actual" else ())
           for role, rid in runs.items() if role in ("baseline", "expected", "actual")}
    v, layers = _routing(moe_run, own)
    assert v.passed is None, v.text
    assert [r["n_tokens"] for r in layers] == [0, 0, 0]
    assert [r["not_computed"] for r in layers] == [sum(len(p) for p in moe_run["prompts"])] * 3
    assert all(r["passed"] is None and r["problem"] is None for r in layers)
    assert v.passed is None and "NOT JUDGED" in v.text and "3 layer(s) not judged" in v.text


@pytest.mark.parametrize("role", ["actual", "baseline"])
def test_a_router_only_one_run_holds_fails_naming_the_run_and_router(moe_run, role):
    runs = moe_run["runs"]
    extra = "model.layers.3.mlp.gate"  # matches the router pattern; the expected run has no such layer
    own = {**runs, role: _copy_run(moe_run, runs[role], extra=[(extra, ROUTER.format(2))])}
    v, layers = _routing(moe_run, own)
    assert v.passed is False
    row = next(r for r in layers if r["module"] == extra)
    assert row["layer"] == 3 and row["passed"] is False
    assert f"only the {role} run {own[role]} holds this router" in row["problem"]
    assert f"the expected run {runs['expected']} does not" in row["problem"] or role == "actual"
    assert all(r["passed"] is True for r in layers if r["module"] != extra)
    assert extra in v.text and v.localisation.module == extra


def test_a_small_router_bias_beyond_bf16_noise_fails_although_no_flip_is_unexplained(moe_run, tmp_path):
    """One expert's router row x 1.1 in layer 1: its logit moves by 10 %, well beyond BF16 noise,
    yet flips no token BF16 noise cannot explain; counting flips alone passed it."""
    st, runs = moe_run["store"], moe_run["runs"]
    bad = write_moe_fault(moe_run["model"], tmp_path / "bias", "router_bias", FAULT_LAYER, expert=0, factor=1.1)
    act = capture_hf_module_run(st, bad, moe_run["prompts"], moe_run["teacher"], modules=[ROUTER.format("*")],
                                dtype="bfloat16")

    def logits(rid, layer):
        return np.concatenate([np.asarray(st.read_tensor(rid, p, ROUTER.format(layer), phase=ph), np.float64)
                               .reshape(-1, 8) for p in moe_run["pids"] for ph in ("prefill", "decode")])
    b, e, a = logits(runs["baseline"], FAULT_LAYER), logits(runs["expected"], FAULT_LAYER), logits(act, FAULT_LAYER)
    # the fault took effect, beyond noise: the typical (median) error of expert 0's logit is more than
    # twice the typical largest BF16 error of any expert at a token
    assert np.median(np.abs(a[:, 0] - b[:, 0])) > 2 * np.median(np.abs(e - b).max(axis=1))
    v, layers = _routing(moe_run, {**runs, "actual": act})
    by = {r["layer"]: r for r in layers}
    assert v.passed is False, v.text
    assert by[FAULT_LAYER]["n_unexplained"] == 0  # the flip rule alone passes it ...
    assert by[FAULT_LAYER]["logit_passed"] is False and by[FAULT_LAYER]["passed"] is False  # ... the logit rule not
    assert by[0]["logit_passed"] is True and by[0]["passed"] is True
    assert v.passed is False and v.localisation.layer == FAULT_LAYER
    assert v.localisation.module == ROUTER.format(FAULT_LAYER) and "router logits beyond BF16 noise" in v.text


def test_compare_needs_no_model_folder_top_k_is_in_the_run_config(moe_run, tmp_path):
    import shutil

    runs, st = moe_run["runs"], moe_run["store"]
    moved = tmp_path / "model"
    shutil.copytree(moe_run["model"], moved)
    own = {role: _copy_run(moe_run, runs[role], model_path=moved) for role in ("baseline", "expected", "actual")}
    shutil.rmtree(moved)
    v, layers = _routing(moe_run, own)
    assert v.passed is True and [r["top_k"] for r in layers] == [2, 2, 2] and "model folder" not in v.text
    model_cfg = json.loads((Path(moe_run["model"]) / "config.json").read_text())
    for role in ("baseline", "expected", "actual"):
        got = json.loads(st.sql(f"SELECT config FROM runs WHERE run_id = '{runs[role]}'").column(0)[0].as_py())
        assert got["routing"]["top_k"] == model_cfg["num_experts_per_tok"] == 2
        assert got["routing"]["n_experts"] == model_cfg["num_local_experts"] == 8
    # an old store (no top_k recorded) falls back to the model folder, and says so
    old = {role: _copy_run(moe_run, runs[role], config=lambda c: {k: x for k, x in c.items() if k != "routing"})
           for role in ("baseline", "expected", "actual")}
    v, layers = _routing(moe_run, old)
    assert v.passed is True and [r["top_k"] for r in layers] == [2, 2, 2]
    assert f"top_k 2 read from the model folder {Path(moe_run['model'])}" in v.text
    # ... and without the folder either: one line naming the run
    gone = {role: _copy_run(moe_run, runs[role], model_path=moved,
                            config=lambda c: {k: x for k, x in c.items() if k != "routing"})
            for role in ("baseline", "expected", "actual")}
    with pytest.raises(ValueError, match=f"run {gone['expected']} records no top_k"):
        _routing(moe_run, gone)


def test_localisation_is_the_earliest_unexplained_flip_by_layer_then_position():
    """Hand-made rows: prompt order would pick prompt a's flip at position 9; the earliest is layer
    1, position 2 of prompt b (layer 2's earlier position and explained flips do not count)."""
    from capturestore.comparators.routing import first_unexplained_flip

    def row(pid, layer, pos, explained=False):  # every prompt 20 tokens long: prefill
        return {"prompt_id": pid, "layer": layer, "position": pos, "gen_token_idx": pos - 20, "phase": "prefill",
                "explained": explained}

    rows = [row("a", 1, 9), row("a", 2, 0), row("a", 1, 0, explained=True), row("b", 1, 2), row("c", 1, 2)]
    assert first_unexplained_flip(rows) is rows[3]
    assert first_unexplained_flip([row("a", 1, 0, explained=True)]) is None


def test_localisation_puts_a_long_prompts_prefill_before_a_short_prompts_decode():
    """Hand-made rows: prompt s (5 tokens) flips at decode step 1 (position 6), prompt l (30 tokens)
    at prefill position 10: the prefill flip comes first although its position is larger; among
    decode flips the decode step decides (l's step 0 at position 30 before s's step 1), not the
    position; equal steps go to the earlier prompt."""
    from capturestore.comparators.routing import first_unexplained_flip

    def row(pid, plen, pos, layer=1):
        return {"prompt_id": pid, "layer": layer, "position": pos, "gen_token_idx": pos - plen,
                "phase": "prefill" if pos < plen else "decode", "explained": False}

    s_dec, l_pre = row("s", 5, 6), row("l", 30, 10)
    assert first_unexplained_flip([s_dec, l_pre]) is l_pre
    l_dec0 = row("l", 30, 30)
    assert first_unexplained_flip([s_dec, l_dec0]) is l_dec0  # step 0 before step 1
    s_dec0 = row("s", 5, 5)
    assert first_unexplained_flip([row("l", 30, 30), s_dec0])["prompt_id"] == "l"  # same step: prompt order
    assert first_unexplained_flip([s_dec, row("l", 30, 10, layer=2)]) is s_dec  # the layer still comes first


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
        assert cfg(rid).get("routing_forced_layers") == [0, 1, 2]  # routing passes: every layer forced
    assert cfg(row["expected_run"]).get("routing_forced_from") == cfg(row["baseline_run"]).get("routing_forced_from")
    for role in ("baseline", "expected"):
        assert "routing_forced_from" not in cfg(runs["routing"][role])


# ---------------------------------------------------------------- exact BF16 ties: counted as the router broke them


TIE_TOKEN = 5
TIE_FP32 = [2.0, -1.0, -1.5, 0.7056, -0.703125, -2.0, 0.7030, 0.1015625]  # FP32 top-2 {0, 3}, margin 0.0026
TIE = [3, 6]  # in BF16 both 0.69921875 (the measured tiny-Mixtral tie's values): torch.topk takes 6 here
TIE_BF16 = 0.69921875


def _hand_routing_store(tmp_path, engine):
    """Three module runs of hand-built router logits of one layer (32 tokens, 8 experts, top-2,
    clear margins everywhere but ``TIE_TOKEN``, where FP32 ranks expert 3 above 6 by 0.0026 and the
    BF16 expected and actual runs (``engine``) hold them exactly tied), written through the public
    module write path; returns ``(store, {role: run_id})``."""
    import torch

    from capturestore import Store
    from extractors.modules import write_prompt_modules

    rng = np.random.default_rng(0)
    z = np.stack([rng.permutation(np.linspace(-2, 2, 8)) for _ in range(32)]) + 0.01 * rng.standard_normal((32, 8))
    z[TIE_TOKEN] = TIE_FP32
    bf = torch.from_numpy(z.astype(np.float32)).bfloat16().float().numpy()
    bf[TIE_TOKEN, TIE] = TIE_BF16
    st = Store.open(tmp_path / "store")
    routing = {"routing": {"n_experts": 8, "top_k": 2, "router_pattern": "model.layers.*.mlp.gate",
                           "model_type": "mixtral"}}
    runs = {}
    for role, eng, dtype, x in (("baseline", "hf", "float32", z), ("expected", "hf", "bfloat16", bf),
                                ("actual", engine, "bfloat16", bf)):
        with st.begin_run(engine=eng, model_path=str(tmp_path), model_hash="h", dtype=dtype, config=routing) as run:
            write_prompt_modules(run, list(range(10, 40)), [40, 41], [(ROUTER.format(0), 0, torch.from_numpy(
                x[:30].astype(np.float32)))], {ROUTER.format(0): [torch.from_numpy(x[30:31].astype(np.float32))]},
                torch.zeros((2, 64)))
        runs[role] = run.run_id
    return st, runs


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_exact_bf16_tie_is_counted_as_the_router_broke_it_not_by_the_lower_expert_id(tmp_path, engine):
    """FP32 chooses {0, 3}; BF16 ties experts 3 and 6 exactly and the router's ``torch.topk`` (HF:
    of the float32 softmax; vLLM: of the BF16 logits) takes 6: a flip the engine made. The lower-id
    rule saw {0, 3} and counted none (the tiny Mixtral's 3 counted where 4 happened)."""
    import torch

    from extractors.routing_force import chosen_experts

    st, runs = _hand_routing_store(tmp_path, engine)
    tie = np.array([TIE_FP32], np.float32)
    tie[0, TIE] = TIE_BF16
    assert top_k_experts(tie, 2).tolist() == [[0, 3]]  # the lower id
    # the case is one torch breaks the other way, in both engines' rules (the oracle: torch itself)
    assert torch.topk(torch.softmax(torch.from_numpy(tie), -1), 2).indices.sort().values.tolist() == [[0, 6]]
    assert torch.topk(torch.from_numpy(tie).bfloat16(), 2, sorted=False).indices.sort().values.tolist() == [[0, 6]]
    assert chosen_experts(tie, 2, "mixtral", "bfloat16", engine).tolist() == [[0, 6]]
    res = compare_runs(st, expected_run=runs["expected"], actual_run=runs["actual"], baseline_run=runs["baseline"],
                       kv=False, logits=False, comparators=["routing"], comparator_runs={"routing": runs})
    layer = st.sql(f"SELECT * FROM routing_layers WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert (layer["n_tokens"], layer["n_flips"], layer["noise_flips"], layer["n_unexplained"]) == (31, 1, 1, 0)
    flips = st.sql(f"SELECT * FROM routing_flips WHERE comparison_id = '{res.comparison_id}'").to_pylist()
    (f,) = flips
    assert f["position"] == TIE_TOKEN and f["actual_experts"] == [0, 6] and f["base_experts"] == [0, 3]
    assert f["expected_experts"] == [0, 6]
    # the needed margin is FP32's 3-minus-6 gap, explained by the tie's own BF16 error (0.0064 x 2)
    assert np.isclose(f["needed_margin"], 0.7056 - 0.7030, atol=1e-6) and f["explained"]
    assert res.verdicts["routing"].passed is True
