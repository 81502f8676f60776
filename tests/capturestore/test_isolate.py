"""Isolation on real HF engines: a fault planted in an HF BF16 target, first proven to change the
target's module tensors (bit-identical before the faulted module, different at it), is found by
isolation at its module, layer and phase, from a failing comparison of stored runs; correct
engines fail no module locally; bad input is refused in one line (CLI exit 2), a passing
comparison has nothing to isolate (exit 0)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.isolate import IsolationError, isolate, module_tree
from extractors.hf import load_hf_model
from extractors.hf_faults import install_hf_fault
from extractors.modules import capture_hf_module_run, collect_hf_modules

ROOT = Path(__file__).resolve().parents[2]
N_PROMPTS, CONT = 4, 5


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 1000, size=int(rng.integers(6, 14))).tolist() for _ in range(N_PROMPTS)]
    return prompts, [rng.integers(4, 1000, size=CONT).tolist() for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """A store with the FP32 and BF16 module references of the tiny Llama (3 layers)."""
    from extractors.models import tiny_model

    path = tiny_model("llama-gqa")
    store = Store.open(tmp_path_factory.mktemp("iso") / "s")
    prompts, conts = _prompts()
    base = capture_hf_module_run(store, path, prompts, conts, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16")
    clean, order = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts, conts)
    return SimpleNamespace(path=path, store=store, prompts=prompts, conts=conts, base=base, exp=exp, clean=clean,
                           order=order)


def _faulty(refs, kind, layer=None, size=0.0):
    """The faulty target, its stored run, the comparison, and the proof that the fault took effect
    where it sits and nowhere before it in the same phase."""
    path, store, prompts, conts, clean = refs.path, refs.store, refs.prompts, refs.conts, refs.clean
    model = load_hf_model(path, "bfloat16")
    at = install_hf_fault(model, kind, layer, size)
    got, _ = collect_hf_modules(model, prompts, conts)
    diff = {k: max(float(np.abs(c[k] - g[k]).max()) for c, g in zip(clean, got)) for k in clean[0]}
    assert any(v > 0 for v in diff.values()), f"fault {kind} changed nothing"
    act = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", model=model)
    r = compare_runs(store, baseline_run=refs.base, expected_run=refs.exp, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    return model, at, diff, r


def _check_found(res, module, layer, phase):
    assert res.status == "found", res.summary()
    loc = res.localisation
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"]) == (module, layer, phase, True), loc
    assert res.engine_reruns == len(res.search) == 3 and res.reference_reruns == res.engine_reruns + 1


def test_module_tree_nests_by_dotted_prefix():
    order = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn", "model.layers.0.mlp",
             "model.layers.0", "model.layers.10", "model.norm", "lm_head"]
    t = module_tree(order)
    assert t[None] == ["model.embed_tokens", "model.layers.0", "model.layers.10", "model.norm", "lm_head"]
    assert t["model.layers.0"] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert t["model.layers.0.self_attn"] == ["model.layers.0.self_attn.q_proj"]


def test_one_percent_mlp_scale_in_the_last_layer_is_found_locally_and_stored(refs):
    store, prompts, order = refs.store, refs.prompts, refs.order
    model, _, diff, r = _faulty(refs, "mlp", 2, 0.01)
    assert diff[("model.layers.2.mlp", "prefill")] > 0
    assert all(diff[(m, "prefill")] == 0 for m in order[:order.index("model.layers.2.mlp")])
    # in place this fault may pass every verdict (it does on 4 prompts x 5 tokens here): judged locally all the same
    res = isolate(store, r.comparison_id, target=model, even_if_passed=True)
    _check_found(res, "model.layers.2.mlp", 2, "prefill")
    assert res.engine_reruns == 3  # top-level modules, their children, the projections: the depth of the tree
    # the local verdict sees the 1% against one MLP's BF16 rounding; in place it was against all upstream noise
    v = res.found
    ip = store.sql(f"SELECT sigma_ratio FROM module_verdicts WHERE comparison_id = '{r.comparison_id}' AND "
                   "module = 'model.layers.2.mlp' AND phase = 'prefill'").column(0)[0].as_py()
    assert v.tensor.sigma_ratio > 1.5 * ip, (v.tensor.sigma_ratio, ip)
    row = store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert not row["passed"] and row["failure_module"] == "model.layers.2.mlp" and row["failure_layer"] == 2
    assert json.loads(row["localisation"]) == {**res.localisation, "isolates": r.comparison_id}
    iso = store.sql(f"SELECT * FROM isolations WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert (iso["source_comparison_id"], iso["engine_reruns"], iso["module"]) == (r.comparison_id, 3,
                                                                                  "model.layers.2.mlp")
    lv = store.sql(f"SELECT module, level, passed, inplace_passed, sigma_ratio FROM module_local_verdicts WHERE "
                   f"comparison_id = '{res.comparison_id}' AND phase = 'prefill' ORDER BY level, exec_order").to_pylist()
    assert "model.layers.2.mlp" in [x["module"] for x in lv if x["passed"] is False]
    assert {x["level"] for x in lv} == {1, 2, 3} and len(lv) == len(order)
    # a stored per-token ratio against numpy over the re-run's tensors is checked in test_replace; here the
    # rows are there for every judged token of every prompt
    n = store.sql(f"SELECT count(*) FROM module_local_metrics WHERE comparison_id = '{res.comparison_id}' AND "
                  "module = 'model.layers.2.mlp'").column(0)[0].as_py()
    assert n == sum(len(p) + CONT - 1 for p in prompts)
    from capturestore.integrity import evidence_problems

    assert not evidence_problems(store, [res.comparison_id])  # the manifest covers the isolation's tables


@pytest.mark.parametrize("kind,layer,size,module,want_layer,phase", [
    ("softmax", 1, 0.10, "model.layers.1.self_attn", 1, "prefill"),
    ("decode_pos", None, 1, "model.layers.0.self_attn", 0, "decode"),
    ("norm_eps", None, 0.1, "model.norm", None, "prefill"),
    ("kv_slot", 1, 0.0, "model.layers.1.self_attn", 1, "decode"),
    ("v_head", 2, 0.05, "model.layers.2.self_attn.v_proj", 2, "prefill"),
])
def test_each_fault_is_named_at_its_module_layer_and_phase(refs, kind, layer, size, module, want_layer, phase):
    model, at, diff, r = _faulty(refs, kind, layer, size)
    assert at == module
    assert diff[(module, phase)] > 0  # it takes effect where it sits
    if phase == "decode":  # decode-only faults leave prefill alone
        assert all(v == 0 for (m, ph), v in diff.items() if ph == "prefill")
    res = isolate(refs.store, r.comparison_id, target=model, even_if_passed=True)
    _check_found(res, module, want_layer, phase)
    if phase == "decode":
        assert res.localisation["token"] >= 0


def test_the_expected_reference_is_rerun_with_the_kernel_rounding_its_run_records(refs):
    """An expected run captured rounding as vLLM-CPU's AVX2 kernels (``kernel_rounding``
    ``toward_zero``, extractors.kernel_rounding) is re-run the same way: isolation checks the
    re-run against the stored run bit for bit, which a round-to-nearest re-run does not give."""
    path, store, prompts, conts = refs.path, refs.store, refs.prompts, refs.conts
    exp_t = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", kernel_rounding="toward_zero")
    cfg = json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{exp_t}'").column(0)[0].as_py())
    assert cfg["kernel_rounding"] == "toward_zero"
    pid = store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{exp_t}'").column(0)[0].as_py()
    a, b = (np.asarray(store.read_tensor(r, pid, "model.layers.0.self_attn", phase="prefill"), np.float32)
            for r in (exp_t, refs.exp))
    assert float(np.mean(a != b)) > 0.2  # the recorded rounding is another reference: a re-run must apply it
    model, at, diff, _ = _faulty(refs, "mlp", 1, 0.2)
    act = capture_hf_module_run(store, path, prompts, conts, dtype="bfloat16", model=model)
    r = compare_runs(store, baseline_run=refs.base, expected_run=exp_t, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    res = isolate(store, r.comparison_id, target=model, even_if_passed=True)  # not "not reproduced"
    _check_found(res, at, 1, "prefill")


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["mlp", "softmax"]), layer=st.integers(0, 2), size=st.floats(0.02, 0.2),
       sign=st.sampled_from([-1.0, 1.0]))
def test_faults_of_any_layer_and_magnitude_are_isolated_at_their_layer(refs, kind, layer, size, sign):
    model, at, diff, r = _faulty(refs, kind, layer, sign * size)
    assert diff[(at, "prefill")] > 0
    res = isolate(refs.store, r.comparison_id, target=model, even_if_passed=True)
    _check_found(res, at, layer, "prefill")


def test_correct_engines_fail_no_module_locally(refs):
    """HF BF16 with SDPA attention (other kernels, other rounding than the eager reference) and HF
    FP32 with SDPA: judged locally all the same (even_if_passed), no module fails."""
    import transformers

    path, store, prompts, conts, base, exp, clean, order = (refs.path, refs.store, refs.prompts, refs.conts, refs.base,
                                                            refs.exp, refs.clean, refs.order)
    for dt in (torch.bfloat16, torch.float32):
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, attn_implementation="sdpa").eval()
        act = capture_hf_module_run(store, path, prompts, conts, dtype=str(dt).removeprefix("torch."), model=sdpa)
        got = [store.read_tensor(act, p, "model.layers.1.self_attn", phase="prefill") for p in
               store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{act}'").column(0).to_pylist()]
        assert any(not np.array_equal(np.asarray(g, np.float32)[0], c[("model.layers.1.self_attn", "prefill")])
                   for g, c in zip(got, clean))  # not the reference engine
        r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                         comparators=["modules"])
        res = isolate(store, r.comparison_id, target=sdpa, even_if_passed=True)
        assert res.status == "not_local", res.summary()
        assert res.engine_reruns == 3 and all(v.passed for v in res.verdicts)
        assert len(res.verdicts) == 2 * len(order)  # every module, prefill and decode


# ------------------------------------------------------------------------------ bad input


def _cli(store, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "capturestore.cli", "isolate", "--store", str(store.root), *args,
                           "--quiet"], check=False, capture_output=True, text=True, env=env, timeout=600)


def test_passing_comparison_has_nothing_to_isolate(refs):
    store, base, exp = refs.store, refs.base, refs.exp
    again = capture_hf_module_run(store, refs.path, refs.prompts, refs.conts, dtype="bfloat16")  # the same engine
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=again, logits=False, kv=False,
                     comparators=["modules"])
    assert r.passed
    n = store.sql("SELECT count(*) FROM comparisons").column(0)[0].as_py()
    assert isolate(store, r.comparison_id).status == "nothing_to_isolate"
    p = _cli(store, r.comparison_id)
    assert p.returncode == 0 and "nothing to isolate" in p.stdout, p.stderr
    assert store.sql("SELECT count(*) FROM comparisons").column(0)[0].as_py() == n  # nothing stored


def test_refusals_name_the_run_and_what_is_needed(refs, tmp_path):
    path, store, prompts, conts = refs.path, refs.store, refs.prompts, refs.conts
    model, _, _, r = _faulty(refs, "mlp", 1, 0.2)
    p = _cli(store, r.comparison_id)  # the target was a patched model: the CLI cannot rebuild it
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "model passed in" in p.stderr and "--rebuild" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    with pytest.raises(IsolationError, match="model passed in"):
        isolate(store, r.comparison_id)
    for n in (0, -3):  # were judged as 1 prompt (and the isolation stored)
        p = _cli(store, r.comparison_id, "--rebuild", "--max-prompts", str(n))
        assert p.returncode == 2 and f"max_prompts must be at least 1, got {n}" in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1
    assert _cli(store, "cmp-nope").returncode == 2
    # runs without module captures
    from extractors.hf import capture_hf_run

    lb = capture_hf_run(store, path, prompts, teacher_tokens=conts, dtype="float32")
    le = capture_hf_run(store, path, prompts, teacher_tokens=conts, dtype="bfloat16")
    la = capture_hf_run(store, path, prompts, teacher_tokens=conts, dtype="bfloat16", model=model)
    rl = compare_runs(store, baseline_run=lb, expected_run=le, actual_run=la, kv=False)
    assert not rl.passed
    p = _cli(store, rl.comparison_id)
    assert p.returncode == 2 and f"the expected run {le}" in p.stderr and "holds no module tensors" in p.stderr, p.stderr
    assert "--plugins" in p.stderr


def test_a_server_target_cannot_be_rerun_and_the_snapshot_path_is_offered(tmp_path):
    from extractors.vllm_server import ENGINE

    store = Store.open(tmp_path / "s")
    rng = np.random.default_rng(0)
    ids = {}
    for role, engine, noise in (("baseline", "hf", 0.0), ("expected", "hf", 1e-3), ("actual", ENGINE, 5e-2)):
        run = store.begin_run(engine=engine, model_path="m", model_hash="h", dtype="float32",
                              config={"module_order": ["model.norm"]})
        with run:
            for p in range(2):
                pid = run.add_prompt([5 + p, 6, 7, 8], continuation=[9, 10])
                x = np.random.default_rng(p).standard_normal((4, 16)).astype(np.float32)
                run.write_tensor(pid, "model.norm", x * (1 + noise * rng.standard_normal(x.shape)).astype(np.float32),
                                 step=0, phase="prefill")
        ids[role] = run.run_id
    r = compare_runs(store, baseline_run=ids["baseline"], expected_run=ids["expected"], actual_run=ids["actual"],
                     logits=False, kv=False, comparators=["modules"])
    assert not r.passed
    p = _cli(store, r.comparison_id)
    assert p.returncode == 2 and "server target" in p.stderr and "cannot be re-run" in p.stderr, p.stderr
    assert "input snapshot" in p.stderr and "Traceback" not in p.stderr


def test_the_tp_emulation_applies_to_low_precision_tp_engines_and_a_target_at_another_tp_is_refused():
    """The expected outputs emulate TP partial sums only for a BF16 / FP16 vLLM run at TP > 1 (an FP32
    engine rounds no partial sum: emulating it would inflate the noise and let faults pass); a vLLM
    engine passed in at another TP than its run's is refused in one line (its noise is another's)."""
    from types import SimpleNamespace

    from capturestore.isolate import IsolationError, _row_parallel, _vllm_target

    rows = ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    rec = {"engine": "vllm", "tp_degree": 2, "dtype": "bfloat16", "config": {"row_parallel_modules": rows}}
    said = []
    assert _row_parallel(rec, None, said.append) == (rows, 2) and "2 row-parallel layers" in said[0]
    assert _row_parallel({**rec, "dtype": "float32"}, None, said.append) == ([], 2)
    assert _row_parallel({**rec, "tp_degree": 1}, None, said.append) == ([], 1)
    assert _row_parallel({**rec, "engine": "hf"}, None, said.append) == ([], 2)
    engine = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2))))
    assert _vllm_target(rec, "run-x", engine, [])[0] is engine
    with pytest.raises(IsolationError, match=r"run-x was captured at tensor parallelism 1 but the target passed in "
                                             r"runs at 2"):
        _vllm_target({**rec, "tp_degree": 1}, "run-x", engine, [])


def test_a_vllm_target_under_tensor_parallelism_is_rebuilt_at_its_tp():
    """A vLLM run at TP 2 is re-run (replacement cuts each rank's part of the sources,
    tests/extractors/test_vllm_modules_tp.py): its engine is rebuilt with the same tensor
    parallelism, workers in their own processes; a server target still cannot be re-run."""
    from capturestore.isolate import cannot_rerun, rebuild_options

    rec = {"engine": "vllm", "tp_degree": 2, "dtype": "bfloat16", "config": {"engine_options": {"block_size": 32}}}
    assert cannot_rerun(rec) is None
    opts = rebuild_options(rec, [("p", [1, 2, 3], [4, 5])])
    assert opts == {"block_size": 32, "max_model_len": 256, "tensor_parallel_size": 2,
                    "distributed_executor_backend": "mp", "dtype": "bfloat16", "enable_prefix_caching": False}, opts
    assert "tensor_parallel_size" not in rebuild_options({**rec, "tp_degree": 1}, [("p", [1], [2])])
    assert "server target" in cannot_rerun({**rec, "engine": "vllm-server"})


# ------------------------------------------------------------------------------ input snapshot


def _snapshot_target(refs, model):
    """``model``'s module run with inputs (its input snapshot) compared in place with the references."""
    act = capture_hf_module_run(refs.store, refs.path, refs.prompts, refs.conts, dtype="bfloat16", model=model,
                                inputs=True)
    return act, compare_runs(refs.store, baseline_run=refs.base, expected_run=refs.exp, actual_run=act, logits=False,
                             kv=False, comparators=["modules"])


def test_snapshot_names_the_last_layers_one_percent_mlp_fault_that_passes_in_place(refs):
    """The last layer's MLP output x 1.01 (proven to take effect there and nowhere before it) passes
    every in-place module verdict; judged from the target's input snapshot alone (no engine re-run:
    the HF modules replayed on its stored inputs) isolation names model.layers.2.mlp in prefill, as
    the re-run isolation of the same comparison does. Independent oracle: the stored MLP output
    against the FP32 MLP called directly on the stored input is 1.01 x (least squares, 1e-3)."""
    store, order = refs.store, refs.order
    model, at, diff, _ = _faulty(refs, "mlp", 2, 0.01)
    assert at == "model.layers.2.mlp" and diff[(at, "prefill")] > 0
    assert all(diff[(m, "prefill")] == 0 for m in order[:order.index(at)])
    act, r = _snapshot_target(refs, model)
    assert r.passed  # in place: drowned in the noise inherited from the layers before
    pid = store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{act}' ORDER BY prompt_idx").column(0)[0].as_py()
    x = np.asarray(store.read_tensor(act, pid, at + ":input", phase="prefill"), np.float32)[0]
    y = np.asarray(store.read_tensor(act, pid, at, phase="prefill"), np.float64)[0]
    with torch.no_grad():
        f = load_hf_model(refs.path, "float32").model.layers[2].mlp(torch.from_numpy(x)[None])[0].double().numpy()
    assert abs(float((y * f).sum() / (f * f).sum()) - 1.01) < 1e-3
    snap = isolate(store, r.comparison_id, snapshot=True, even_if_passed=True)
    assert snap.method == "snapshot" and snap.status == "found", snap.summary()
    loc = snap.localisation
    assert (loc["module"], loc["layer"], loc["phase"], loc["local"], loc["method"]) == (at, 2, "prefill", True,
                                                                                      "snapshot"), loc
    assert snap.engine_reruns == 0 and snap.reference_reruns == 2 * len(snap.search) == 6
    assert "input snapshot" in snap.summary() and snap.inplace[(at, "prefill")] is True
    assert len(snap.verdicts) == 2 * len(order)  # every module the run holds, prefill and decode
    rerun = isolate(store, r.comparison_id, target=model, even_if_passed=True)
    assert rerun.method == "rerun" and rerun.localisation["method"] == "rerun"
    assert {k: rerun.localisation[k] for k in ("module", "layer", "phase")} == {k: loc[k] for k in
                                                                               ("module", "layer", "phase")}
    assert snap.found.tensor.sigma_ratio > 1.5  # locally several times one MLP's BF16 rounding
    row = store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{snap.comparison_id}'").to_pylist()[0]
    assert json.loads(row["localisation"])["method"] == "snapshot" and row["failure_module"] == at
    iso = store.sql(f"SELECT method, engine_reruns, reference_reruns FROM isolations WHERE comparison_id = "
                    f"'{snap.comparison_id}'").to_pylist()
    assert iso == [{"method": "snapshot", "engine_reruns": 0, "reference_reruns": 6}]
    from capturestore.integrity import evidence_problems

    assert not evidence_problems(store, [snap.comparison_id])


def test_snapshot_of_a_correct_engine_fails_no_module_locally(refs):
    """HF BF16 with SDPA attention (not the eager reference's kernels: proven by its attention output
    differing) judged from its input snapshot: no module fails locally, every module judged."""
    import transformers

    sdpa = transformers.AutoModelForCausalLM.from_pretrained(str(refs.path), dtype=torch.bfloat16,
                                                             attn_implementation="sdpa").eval()
    got, _ = collect_hf_modules(sdpa, refs.prompts, refs.conts)
    k = ("model.layers.1.self_attn", "prefill")
    assert any(not np.array_equal(g[k], c[k]) for g, c in zip(got, refs.clean))
    _, r = _snapshot_target(refs, sdpa)
    res = isolate(refs.store, r.comparison_id, snapshot=True, even_if_passed=True)
    assert res.status == "not_local", res.summary()
    assert all(v.passed is True for v in res.verdicts) and len(res.verdicts) == 2 * len(refs.order)
    assert max(v.tensor.sigma_ratio for v in res.verdicts) < 1.5


def _copy_run(store, src, engine):
    """``src``'s prompts and module tensors (inputs too) in a run of ``engine`` (e.g. a server
    target whose module snapshot came from elsewhere)."""
    cfg = json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{src}'").column(0)[0].as_py())
    src_row = store.sql(f"SELECT model_path, model_hash FROM runs WHERE run_id = '{src}'").to_pylist()[0]
    path, model_hash = src_row["model_path"], src_row["model_hash"]
    run = store.begin_run(engine=engine, model_path=path, model_hash=model_hash, dtype="bfloat16",
                          config={"module_order": cfg["module_order"], "module_inputs": True})
    from capturestore.analysis import prompt_split

    names = [*cfg["module_order"], *(m + ":input" for m in cfg["module_order"] if m != "model.embed_tokens")]
    with run:
        for p in store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{src}' ORDER BY prompt_idx").column(0):
            p = p.as_py()
            tokens, plen = prompt_split(store, src, p)
            pid = run.add_prompt(tokens[:plen].tolist(), continuation=tokens[plen:].tolist())
            for m in names:
                for phase in ("prefill", "decode"):
                    t = np.asarray(store.read_tensor(src, p, m, phase=phase), np.float32)
                    for step in range(t.shape[0]):
                        run.write_tensor(pid, m, t[step], step=step, phase=phase)
    return run.run_id


def test_a_server_target_with_an_input_snapshot_is_judged_from_it_at_the_cli(refs):
    """A server target cannot be re-run: `capturestore isolate` judges it from its input snapshot
    without being asked (exit 0, the fault named, `snapshot` in the stored localisation)."""
    from extractors.vllm_server import ENGINE

    store = refs.store
    model, at, _, _ = _faulty(refs, "mlp", 2, 0.05)
    act, _ = _snapshot_target(refs, model)
    srv = _copy_run(store, act, ENGINE)
    r = compare_runs(store, baseline_run=refs.base, expected_run=refs.exp, actual_run=srv, logits=False, kv=False,
                     comparators=["modules"])
    p = _cli(store, r.comparison_id, "--even-if-passed")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "input snapshot (the target not re-run)" in p.stdout and f"module {at}" in p.stdout, p.stdout
    loc = json.loads(store.sql(f"SELECT localisation FROM comparisons WHERE label = 'isolate --snapshot "
                               f"{r.comparison_id}'").column(0)[0].as_py())
    assert (loc["module"], loc["method"]) == (at, "snapshot")


def test_snapshot_refusals_name_the_module_and_the_capture_needed(refs, tmp_path):
    store = refs.store
    model, _, _, r = _faulty(refs, "mlp", 1, 0.2)  # captured without inputs
    act = store.sql(f"SELECT actual_run FROM comparisons WHERE comparison_id = '{r.comparison_id}'").column(0)[0]
    act = act.as_py()
    p = _cli(store, r.comparison_id, "--snapshot")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert f"actual run {act}" in p.stderr and "holds no input of module model.layers.0.input_layernorm" in p.stderr
    assert "capture_hf_module_run(..., inputs=True)" in p.stderr, p.stderr
    with pytest.raises(IsolationError, match="do not pass one"):
        isolate(store, r.comparison_id, target=model, snapshot=True)
    # a store that never compared anything: the comparison named, one line
    empty = Store.open(tmp_path / "empty")
    p = _cli(empty, "cmp-nope")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "comparison 'cmp-nope' not found" in p.stderr, p.stderr
    assert "Table with name" not in p.stderr


def test_an_empty_comparison_id_is_shown_as_empty(tmp_path, capsys):
    """`isolate ''` said 'comparison  not found': the id is quoted, so an empty one reads as ''.
    Both stores: one that never compared anything, one that holds another comparison."""
    from capturestore.cli import main
    from tests.capturestore.test_reduce import _synthetic_norm_comparison

    empty = Store.open(tmp_path / "empty")
    assert main(["isolate", "", "--store", str(empty.root), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("capturestore isolate: error: comparison '' not found: the store holds no comparisons") \
        and err.count("\n") == 1, err
    store = Store.open(tmp_path / "s")
    _synthetic_norm_comparison(store, "m", actual_noise=5e-2)
    assert main(["isolate", "", "--store", str(store.root), "--quiet"]) == 2
    assert capsys.readouterr().err == "capturestore isolate: error: comparison '' not found in the store\n"


def test_snapshot_refuses_a_vllm_module_whose_captured_input_is_not_hfs():
    """A vLLM run records the modules whose input it withheld and why (MoE experts: vLLM's fused
    MoE routes inside, HF's experts take the routing); a snapshot judging one says which and why."""
    from capturestore.isolate import snapshot_inputs
    from extractors.vllm_modules import input_not_hf

    why = input_not_hf("model.layers.3.mlp.experts")
    assert why and "routing" in why and input_not_hf("model.layers.3.mlp") is None
    assert input_not_hf("model.layers.3.self_attn.qkv_proj") is None
    recs = {"actual": {"engine": "vllm", "config": {"module_inputs_not_hf": {"model.layers.3.mlp.experts": why}}}}
    with pytest.raises(IsolationError, match=r"captured input of model\.layers\.3\.mlp\.experts is not the HF "
                                             r"module's input: HF's experts take the routing"):
        snapshot_inputs(None, "cmp-x", {"actual": "run-v"}, recs, ["model.layers.3.mlp", "model.layers.3.mlp.experts"],
                        [])


def test_a_vllm_target_is_rebuilt_with_the_engine_options_its_run_recorded():
    """The KV cache dtype, block size and scheduler options a vLLM module run records
    (``vllm_engine_options``) are what isolation rebuilds the engine with (the old rebuild passed
    the dtype alone: vLLM's default block size and cache dtype, another engine); prefix caching
    off and the length covering the prompts whatever was recorded; a run recording none gets the defaults."""
    from capturestore.isolate import rebuild_options

    rec = {"dtype": "bfloat16", "config": {"engine_options": {"kv_cache_dtype": "fp8_e4m3", "block_size": 32,
                                                             "max_model_len": 512, "max_num_batched_tokens": 64,
                                                             "enable_chunked_prefill": True}}}
    prompts = [("p0", list(range(20)), [1, 2, 3])]
    assert rebuild_options(rec, prompts) == {"kv_cache_dtype": "fp8_e4m3", "block_size": 32, "max_model_len": 512,
                                             "max_num_batched_tokens": 64, "enable_chunked_prefill": True,
                                             "dtype": "bfloat16", "enable_prefix_caching": False}
    long = [("p0", list(range(600)), [1, 2, 3])]
    assert rebuild_options(rec, long)["max_model_len"] == 619
    old = {"dtype": "float32", "config": {}}
    assert rebuild_options(old, prompts) == {"max_model_len": 256, "dtype": "float32", "enable_prefix_caching": False}


@pytest.mark.parametrize("config, named", [
    ({"engine_hooked": ["fp8_engine_k_scale", "fp8_emulated"], "fp8_emulated": True}, "fp8_engine_k_scale"),
    ({"engine_hooked": []}, "an engine hook"),
    ({"fp8_engine_k_scale": [0.02, 0.03], "fp8_emulated": True}, "FP8 state fp8_emulated, fp8_engine_k_scale")],
    ids=["hooked", "hook-recording-nothing", "fp8-before-hooks-were-recorded"])
def test_a_vllm_engine_changed_after_load_is_not_rebuilt_from_its_checkpoint(monkeypatch, config, named):
    """A run whose engine a hook changed after load (FP8 scales set through the worker, emulated
    FP8 writes, a planted fault) cannot be rebuilt from the checkpoint: the rebuild is another
    engine (the reviewer's case: an emulated FP8 run rebuilt with a plain BF16 cache), so isolate
    refuses in one line, naming the run and what changed, before any engine starts."""
    import extractors.vllm_rpc as rpc
    from capturestore.isolate import IsolationError, _vllm_target

    started = []
    monkeypatch.setattr(rpc, "make_llm", lambda *a, **k: started.append(a))
    rec = {"engine": "vllm", "dtype": "bfloat16", "model_path": "/m", "config": {"engine_options": {}, **config}}
    with pytest.raises(IsolationError) as e:
        _vllm_target(rec, "run-7", None, [("p0", [1, 2, 3], [4])])
    msg = str(e.value)
    assert "run-7" in msg and named in msg and "--snapshot" in msg and "\n" not in msg
    assert not started
    plain = {"engine": "vllm", "dtype": "bfloat16", "model_path": "/m", "config": {"engine_options": {}}}
    monkeypatch.setattr(rpc, "close_llm", lambda llm: None)
    _vllm_target(plain, "run-8", None, [("p0", [1, 2, 3], [4])])  # nothing changed: rebuilt
    assert started == [("/m",)]
