"""Reduction of a failing module comparison to a minimal bundle, on real HF engines.

The engine under test is ``reduce_engines.faulty`` (HF BF16, layer 1's MLP output x 1.10), first
proven to change that module and nothing before it; the 8-prompt x 16-token comparison of the
tiny Llama (3 layers) fails at ``model.layers.1.mlp`` in prefill. Reduced: one prompt, the
fewest tokens, the two layers the failure needs; the bundle's command fails on the faulty engine
and passes on a correct one (HF SDPA), run as a user would (a fresh interpreter)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.cli import main
from capturestore.reduce import ReductionError, reduce, reduced_checkpoint
from extractors.hf import load_hf_model
from extractors.modules import capture_hf_module_run, collect_hf_modules
from metrics.modules import judge_modules
from tests.capturestore import reduce_engines

ROOT = Path(__file__).resolve().parents[2]
FAULTY, CORRECT = "tests.capturestore.reduce_engines:faulty", "tests.capturestore.reduce_engines:correct"
MODULES = ["model.layers.*.mlp", "model.norm"]
N_PROMPTS, CONT = 8, 16


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from extractors.models import tiny_model

    path = tiny_model("llama-gqa")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 1000, size=int(rng.integers(6, 14))).tolist() for _ in range(N_PROMPTS)]
    conts = [rng.integers(4, 1000, size=CONT).tolist() for _ in range(N_PROMPTS)]
    # the fault takes effect where it sits and nowhere before it (one prompt is proof enough)
    clean, _ = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts[:1], conts[:1], MODULES)
    got, _ = collect_hf_modules(reduce_engines.faulty(path), prompts[:1], conts[:1], MODULES)
    assert np.array_equal(clean[0][("model.layers.0.mlp", "prefill")], got[0][("model.layers.0.mlp", "prefill")])
    assert not np.array_equal(clean[0][("model.layers.1.mlp", "prefill")], got[0][("model.layers.1.mlp", "prefill")])
    store = Store.open(tmp_path_factory.mktemp("reduce") / "s")
    base = capture_hf_module_run(store, path, prompts, conts, MODULES, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, conts, MODULES, dtype="bfloat16")
    act = capture_hf_module_run(store, path, prompts, conts, MODULES, dtype="bfloat16",
                                model=reduce_engines.faulty(path))
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    assert not r.passed
    row = store.sql(f"SELECT failure_module, failure_phase FROM comparisons WHERE comparison_id = '{r.comparison_id}'"
                    ).to_pylist()[0]
    assert (row["failure_module"], row["failure_phase"]) == ("model.layers.1.mlp", "prefill")
    return SimpleNamespace(path=path, store=store, prompts=prompts, conts=conts, cid=r.comparison_id, base=base,
                           exp=exp)


def _judge(model_dir, engine, prompts, conts):
    """The module verdict of ``engine`` on ``prompts`` against the FP32 / BF16 references of
    ``model_dir`` computed here (the oracle the reduction's own trials are checked against)."""
    b, order = collect_hf_modules(load_hf_model(model_dir, "float32"), prompts, conts, MODULES)
    e, _ = collect_hf_modules(load_hf_model(model_dir, "bfloat16"), prompts, conts, MODULES)
    a, _ = collect_hf_modules(engine(str(model_dir)), prompts, conts, MODULES)
    per = [{k: (bb[k], ee[k], aa[k]) for k in ee} for bb, ee, aa in zip(b, e, a)]
    return judge_modules(per, order, prompt_lens=[len(p) for p in prompts])


def test_a_failing_comparison_reduces_to_one_prompt_few_tokens_and_the_layers_needed(case, tmp_path, capsys):
    out = tmp_path / "bundle"
    res = reduce(case.store, case.cid, FAULTY, out, correct=CORRECT)
    assert res.status == "reduced" and res.failure == {"module": "model.layers.1.mlp", "phase": "prefill", "layer": 1}
    assert res.start == {"prompts": 8, "prompt_tokens": sum(map(len, case.prompts)), "continuation_tokens": 8 * 16,
                         "layers": 3}
    end = res.end
    # layer 1's fault needs layers 0 and 1, not layer 2; one prompt
    assert end["prompts"] == 1 and end["layers"] == 2
    assert (res.faulty_exit, res.correct_exit) == (1, 0)
    info = json.loads((out / "case.json").read_text())
    (p,), (c,) = info["prompts"], info["continuations"]
    assert (len(p), len(c)) == (end["prompt_tokens"], end["continuation_tokens"])
    assert end["prompt_tokens"] < min(map(len, case.prompts)) and end["continuation_tokens"] < CONT
    # the bundle's case is a prefix of one of the source's prompts and continuations
    i = next(i for i, q in enumerate(case.prompts) if q[:len(p)] == p and case.conts[i][:len(c)] == c)
    assert i is not None
    # minimal, judged independently: it fails; one token less of the prompt or continuation does not
    v = _judge(out / "model", reduce_engines.faulty, [p], [c])
    assert (v.first_failing.module, v.first_failing.phase) == ("model.layers.1.mlp", "prefill")
    for q, d in ((p[:-1], c), (p, c[:-1])):
        if q and d:
            w = _judge(out / "model", reduce_engines.faulty, [q], [d]).first_failing
            assert w is None or (w.module, w.phase) != ("model.layers.1.mlp", "prefill")
    # the reduced checkpoint is the original's first two layers bit for bit
    full, _ = collect_hf_modules(load_hf_model(case.path, "float32"), [p], [c], ["model.layers.0-1"])
    red, _ = collect_hf_modules(load_hf_model(out / "model", "float32"), [p], [c], ["model.layers.0-1"])
    assert full[0].keys() == red[0].keys() and all(np.array_equal(full[0][k], red[0][k]) for k in full[0])
    assert json.loads((out / "model" / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "model" / "tokenizer.json").exists()
    # the bundle's store holds the references of exactly that case
    bstore = Store.open(out / "store")
    assert bstore.sql("SELECT count(*) FROM runs").column(0)[0].as_py() == 2
    assert sorted(info["runs"]) == ["baseline", "expected"] and info["modules"] == [
        "model.layers.0.mlp", "model.layers.1.mlp", "model.norm"]
    # its one command, as a user runs it (a fresh interpreter): fails on the faulty engine
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sh = str(out / "reproduce.sh")
    bad = subprocess.run([sh, "--quiet"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert bad.returncode == 1 and "FAIL at model.layers.1.mlp (prefill" in bad.stdout, (bad.stdout, bad.stderr)
    # the correct engine through the same command in this interpreter (a second fresh one costs ~15 s of imports)
    assert main(["reproduce", str(out), "--quiet", "--engine", CORRECT]) == 0
    assert "PASS" in capsys.readouterr().out
    # a damaged bundle is never a pass: evidence it lost is named, exit 2, and the bundle is not written to
    for damage, said in (("baseline run", "holds no model.layers.0.mlp (prefill)"), ("modules key", "lacks modules"),
                         ("store", "not a capture store")):
        copy = tmp_path / f"damaged-{damage.split()[0]}"
        shutil.copytree(out, copy)
        info2 = dict(info)
        if damage == "baseline run":
            info2["runs"] = {**info["runs"], "baseline": "20000101T000000-00000000"}
        elif damage == "modules key":
            del info2["modules"]
        else:
            shutil.rmtree(copy / "store")
        (copy / "case.json").write_text(json.dumps(info2))
        assert main(["reproduce", str(copy), "--quiet", "--engine", CORRECT]) == 2, damage
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (damage, err)
        assert damage != "store" or not (copy / "store").exists()


def test_reduced_checkpoint_refuses_a_layer_count_it_does_not_have(case, tmp_path):
    with pytest.raises(ReductionError, match="cannot keep 4 of its 3 decoder layers"):
        reduced_checkpoint(case.path, tmp_path / "m", 4)


def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    store = case.store
    root = str(store.root)
    # the target was a patched model: the checkpoint cannot rebuild it
    assert main(["reduce", case.cid, "--store", root, "--out", str(tmp_path / "b1"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model passed in" in err and "--engine" in err and err.count("\n") == 1, err
    assert main(["reduce", case.cid, "--store", root, "--out", str(tmp_path / "b2"), "--engine", "nope",
                 "--quiet"]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err
    (tmp_path / "b3").mkdir()
    (tmp_path / "b3" / "x").write_text("keep me")
    assert main(["reduce", case.cid, "--store", root, "--out", str(tmp_path / "b3"), "--engine", FAULTY,
                 "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "b3" / "x").read_text() == "keep me"
    assert main(["reduce", "cmp-nope", "--store", root, "--out", str(tmp_path / "b4"), "--quiet"]) == 2
    assert "cmp-nope not found" in capsys.readouterr().err
    assert main(["reproduce", str(tmp_path), "--quiet"]) == 2
    assert "not a reduction bundle" in capsys.readouterr().err
    # an importable engine that cannot take the model directory alone: one line, never called
    bad = "tests.capturestore.reduce_engines:wrong_signature"
    assert main(["reduce", case.cid, "--store", root, "--out", str(tmp_path / "b5"), "--engine", bad, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot be called with the model directory alone" in err and err.count("\n") == 1, err
    with pytest.raises(ReductionError, match="model directory alone"):
        reduce(store, case.cid, reduce_engines.wrong_signature, tmp_path / "b6")


def test_a_layer_count_under_text_config_is_read_and_an_unloadable_checkpoint_is_one_line(tmp_path, capsys):
    """A multimodal-style config.json keeps num_hidden_layers under text_config: read from there;
    the checkpoint (a config without weights) then cannot be loaded: one line, exit 2."""
    from capturestore.reduce import checkpoint_layers

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"num_hidden_layers": 5}}))
    assert checkpoint_layers(model) == 5
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ReductionError, match="no decoder layer count"):
        checkpoint_layers(tmp_path / "empty")
    store = Store.open(tmp_path / "s")
    ids = {}
    for role, noise in (("baseline", 0.0), ("expected", 1e-3), ("actual", 5e-2)):
        run = store.begin_run(engine="hf", model_path=str(model), model_hash="h", dtype="float32",
                              config={"module_order": ["model.norm"]})
        with run:
            for p in range(2):
                pid = run.add_prompt([5 + p, 6, 7, 8], continuation=[9, 10])
                x = np.random.default_rng(p).standard_normal((4, 16)).astype(np.float32)
                e = np.random.default_rng(10 + p).standard_normal(x.shape).astype(np.float32)
                run.write_tensor(pid, "model.norm", x * (1 + noise * e), step=0, phase="prefill")
        ids[role] = run.run_id
    r = compare_runs(store, baseline_run=ids["baseline"], expected_run=ids["expected"], actual_run=ids["actual"],
                     logits=False, kv=False, comparators=["modules"])
    assert not r.passed
    assert main(["reduce", r.comparison_id, "--store", str(store.root), "--out", str(tmp_path / "b"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the reference checkpoint" in err and str(model) in err and err.count("\n") == 1, err


def test_a_passing_comparison_has_nothing_to_reduce(tmp_path, capsys):
    """Synthetic module runs (the target's tensors are the expected run's): the comparison passes."""
    store = Store.open(tmp_path / "s")
    ids = {}
    for role, noise in (("baseline", 0.0), ("expected", 1e-3), ("actual", 1e-3)):
        run = store.begin_run(engine="hf", model_path="m", model_hash="h", dtype="float32",
                              config={"module_order": ["model.norm"]})
        with run:
            for p in range(2):
                pid = run.add_prompt([5 + p, 6, 7, 8], continuation=[9, 10])
                x = np.random.default_rng(p).standard_normal((4, 16)).astype(np.float32)
                e = np.random.default_rng(10 + p).standard_normal(x.shape).astype(np.float32)
                run.write_tensor(pid, "model.norm", x * (1 + noise * e), step=0, phase="prefill")
        ids[role] = run.run_id
    r = compare_runs(store, baseline_run=ids["baseline"], expected_run=ids["expected"], actual_run=ids["actual"],
                     logits=False, kv=False, comparators=["modules"])
    assert r.passed
    assert reduce(store, r.comparison_id, FAULTY, tmp_path / "b").status == "nothing_to_reduce"
    assert main(["reduce", r.comparison_id, "--store", str(store.root), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert "nothing to reduce" in capsys.readouterr().out and not (tmp_path / "b").exists()
