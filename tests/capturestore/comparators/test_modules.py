"""The ``modules`` comparator in compare_runs: module tensors of stored runs judged three-way, the
first failing module as the comparison's localisation, module_metrics / module_verdicts views,
and bad input (missing module, different shapes, NaN, two-way) that never passes."""
import json

import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs

P, T, W = 6, 3, 32  # prompt tokens, continuation tokens, module width
MODULES = ["model.layers.0.mlp", "model.layers.1.mlp", "model.norm"]


def _bf16(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _run(store, seed_noise, fault=None, size=0.0, shapes=None, nan=None, modules=MODULES, dtype="float32",
         decode_steps=None):
    """A hand-written run of 3 prompts: tensors = a fixed signal (the same in every run) plus this
    run's own noise; fault scales one module's output (and every later one's); decode_steps:
    ``{module: [step, ...]}``, the decode steps written for it, in that order (default all, in order)."""
    sig = np.random.default_rng(0)
    rng = np.random.default_rng(seed_noise)
    run = store.begin_run(engine="hf", model_path="m", model_hash="h", dtype=dtype,
                          config={"module_order": MODULES})
    with run:
        for p in range(3):
            pid = run.add_prompt(list(range(10 + p, 10 + p + P)), continuation=[1, 2, 3])
            hit = False
            for m in MODULES:
                order = (decode_steps or {}).get(m, list(range(T - 1)))
                for phase, n_steps, rows in (("prefill", 1, P), ("decode", T - 1, 1)):
                    written = []
                    for s in range(n_steps):
                        x = sig.standard_normal((rows, W)).astype(np.float32)
                        if seed_noise is not None:
                            x = _bf16(x * (1 + 2e-3 * rng.standard_normal(x.shape).astype(np.float32)))
                        if m not in modules:
                            continue
                        hit_now = hit or m == fault
                        if hit_now:
                            x = x * (1 + size)
                        if shapes and (m, phase) in shapes and p == 1:
                            x = x[:, :shapes[(m, phase)]]
                        if nan and (m, phase, p, s) == nan:
                            x = x.copy()
                            x[0, 3] = np.nan
                        written.append((s, phase, x))
                    for s, ph, x in sorted(written, key=lambda w: order.index(w[0]) if w[0] in order else -1):
                        if ph == "prefill" or s in order:
                            run.write_tensor(pid, m, x, step=s, phase=ph)
                hit = hit or m == fault
    return run.run_id


@pytest.fixture
def store(tmp_path):
    return Store.open(tmp_path / "s")


def _cmp(store, base, exp, act, **kw):
    return compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                        comparators=["modules"], **kw)


def test_clean_target_passes_and_the_views_hold_every_token(store):
    base, exp, act = _run(store, None), _run(store, 1), _run(store, 2)
    r = _cmp(store, base, exp, act)
    assert r.passed and r.localisation is None
    n = store.sql(f"SELECT count(*) FROM module_metrics WHERE comparison_id = '{r.comparison_id}'").column(0)[0].as_py()
    assert n == 3 * len(MODULES) * (P + T - 1)
    v = store.sql(f"SELECT module, phase, exec_order, passed FROM module_verdicts WHERE comparison_id = "
                  f"'{r.comparison_id}' ORDER BY phase DESC, exec_order").to_pylist()
    assert [(x["module"], x["phase"], x["passed"]) for x in v][:3] == [(m, "prefill", True) for m in MODULES]
    # a stored ratio against a numpy oracle over the stored tensors
    pid = store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{exp}' ORDER BY prompt_idx").column(0)[0].as_py()
    row = store.sql(f"SELECT l2_ratio, gen_token_idx FROM module_metrics WHERE comparison_id = '{r.comparison_id}' "
                    f"AND prompt_id = '{pid}' AND module = 'model.norm' AND phase = 'decode' AND position = {P + 1}"
                    ).to_pylist()[0]
    b, e, a = (store.read_tensor(x, pid, "model.norm", step=1, phase="decode")[0].astype(np.float64)
               for x in (base, exp, act))
    assert row["l2_ratio"] == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(e - b), rel=1e-9)
    assert row["gen_token_idx"] == 1


def test_a_faulty_module_is_the_comparisons_localisation(store):
    base, exp, act = _run(store, None), _run(store, 1), _run(store, 2, fault="model.layers.1.mlp", size=0.05)
    r = _cmp(store, base, exp, act)
    assert not r.passed
    assert r.localisation == {"phase": "prefill", "layer": 1, "module": "model.layers.1.mlp", "token": -P}
    row = store.sql(f"SELECT failure_module, failure_layer, failure_phase, localisation FROM comparisons "
                    f"WHERE comparison_id = '{r.comparison_id}'").to_pylist()[0]
    assert (row["failure_module"], row["failure_layer"], row["failure_phase"]) == ("model.layers.1.mlp", 1, "prefill")
    assert json.loads(row["localisation"]) == r.localisation
    failed = store.sql(f"SELECT module FROM module_verdicts WHERE comparison_id = '{r.comparison_id}' AND NOT passed "
                       f"AND phase = 'prefill' ORDER BY exec_order").column(0).to_pylist()
    assert failed == ["model.layers.1.mlp", "model.norm"]


def test_a_module_the_actual_lacks_fails_named(store):
    base, exp = _run(store, None), _run(store, 1)
    act = _run(store, 2, modules=MODULES[:2])
    r = _cmp(store, base, exp, act)
    assert not r.passed and r.localisation["module"] == "model.norm"
    prob = store.sql(f"SELECT problem FROM module_verdicts WHERE comparison_id = '{r.comparison_id}' "
                     f"AND module = 'model.norm' AND phase = 'prefill'").column(0)[0].as_py()
    assert f"the actual run {act} holds no model.norm (prefill)" in prob


def test_different_shapes_fail_naming_module_and_shapes(store):
    base, exp = _run(store, None), _run(store, 1)
    act = _run(store, 2, shapes={("model.layers.0.mlp", "decode"): 16})
    r = _cmp(store, base, exp, act)
    assert not r.passed
    assert r.localisation == {"phase": "decode", "layer": 0, "module": "model.layers.0.mlp", "token": None}
    prob = r.verdicts["modules"].detail.first_failing.problem
    assert "shapes differ: baseline (2, 32), expected (2, 32), actual (2, 16)" in prob


def test_nan_in_the_target_fails(store):
    base, exp = _run(store, None), _run(store, 1)
    act = _run(store, 2, nan=("model.norm", "decode", 2, 1))
    r = _cmp(store, base, exp, act)
    assert not r.passed
    assert r.localisation == {"phase": "decode", "layer": None, "module": "model.norm", "token": 1}
    n = store.sql(f"SELECT nonfinite FROM module_verdicts WHERE comparison_id = '{r.comparison_id}' "
                  f"AND module = 'model.norm' AND phase = 'decode'").column(0)[0].as_py()
    assert n == 1


def test_two_way_and_no_tensors_never_pass(store):
    exp, act = _run(store, 1), _run(store, 2)
    r = compare_runs(store, expected_run=exp, actual_run=act, logits=False, kv=False, comparators=["modules"])
    assert not r.passed and r.verdicts["modules"].passed is None
    assert "not judged: two-way" in r.verdicts["modules"].text
    empty = [_run(store, s, modules=[]) for s in (None, 1, 2)]
    r = _cmp(store, *empty)
    assert not r.passed and "not compared: the expected run" in r.verdicts["modules"].text


def test_hf_runs_in_a_store_name_the_faulty_layer(store):
    """End to end on a real engine: FP32, BF16 and a BF16 with layer 1's MLP output 5% off,
    captured by capture_hf_module_run, compared with logits and modules."""
    pytest.importorskip("transformers")
    from extractors.hf import load_hf_model
    from extractors.models import tiny_model
    from extractors.modules import capture_hf_module_run

    path = tiny_model("llama-gqa")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 1000, size=8).tolist() for _ in range(4)]
    conts = [rng.integers(4, 1000, size=4).tolist() for _ in range(4)]
    mods = ["model.layers.*", "model.layers.*.mlp", "model.layers.*.self_attn", "model.norm", "lm_head"]
    base = capture_hf_module_run(store, path, prompts, conts, mods, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, conts, mods, dtype="bfloat16")
    bad = load_hf_model(path, "bfloat16")
    bad.model.layers[1].mlp.register_forward_hook(lambda mod, a, o: o * 1.05)
    act = capture_hf_module_run(store, path, prompts, conts, mods, dtype="bfloat16", model=bad)
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, kv=False, comparators=["modules"])
    assert not r.passed
    assert r.localisation["module"] == "model.layers.1.mlp" and r.localisation["layer"] == 1
    assert r.localisation["phase"] == "prefill"
    import torch
    import transformers

    sdpa = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16,
                                                            attn_implementation="sdpa").eval()
    other = capture_hf_module_run(store, path, prompts, conts, mods, dtype="bfloat16", model=sdpa)
    clean = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=other, kv=False,
                         comparators=["modules"])
    assert clean.verdicts["modules"].passed, clean.verdicts["modules"].text


def _rows(store, cid):
    return store.sql(f"SELECT prompt_id, module, phase, position, gen_token_idx, base_linf, tgt_linf, base_l2, tgt_l2, "
                     f"base_cos, tgt_cos, bc FROM module_metrics WHERE comparison_id = '{cid}' "
                     f"ORDER BY prompt_id, module, phase, position").to_pylist()


def test_decode_steps_stored_out_of_order_or_missing_are_lined_up_by_step_number(store):
    """The actual run's decode steps of a module written in another order are compared step for
    step: every metric row equal to the same run written in order (the comparator selects the
    steps; where every step is there in order it reads them without a copy). A step missing
    fails, named, and the steps there keep their rows."""
    base, exp = _run(store, None), _run(store, 1)
    in_order = _cmp(store, base, exp, _run(store, 2))
    assert in_order.passed
    want = _rows(store, in_order.comparison_id)
    shuffled = _cmp(store, base, exp, _run(store, 2, decode_steps={"model.layers.1.mlp": [1, 0]}))
    assert shuffled.passed and _rows(store, shuffled.comparison_id) == want
    missing = _cmp(store, base, exp, _run(store, 2, decode_steps={"model.norm": [1]}))
    assert not missing.passed
    prob = store.sql(f"SELECT problem FROM module_verdicts WHERE comparison_id = '{missing.comparison_id}' "
                     f"AND module = 'model.norm' AND phase = 'decode'").column(0)[0].as_py()
    assert "lacks step(s) [0]" in prob, prob
    got = _rows(store, missing.comparison_id)
    assert got == [r for r in want if not (r["module"] == "model.norm" and r["phase"] == "decode"
                                           and r["gen_token_idx"] == 0)]
