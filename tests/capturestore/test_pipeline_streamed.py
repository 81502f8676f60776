"""``capturestore run --reference-memory / --reference-device``: references streamed layer by layer
when the weights do not fit the budget, said so, reused like whole-model ones; a budget below one
layer, a bad device and a checkpoint whose shards disagree are one line, exit 2, nothing written."""
import json
import re
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from capturestore import Store  # noqa: E402
from capturestore.cli import main  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time", "Numbers: 3 1 4 1 5 9 2 6 5 3 5"]
# the tiny llama-gqa in FP32 is 2.7 MiB of weights, its largest layer 0.56 MiB (BF16: half): 1 MiB streams
BUDGET = str(1 / 1024)


@pytest.fixture(scope="module")
def model():
    from extractors.models import tiny_model

    return tiny_model("llama-gqa", seed=3)


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(TEXTS) + "\n")
    return p


def _cli(capsys, *args):
    rc = main(["run", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _runs(store):
    return Store.open(store).sql("SELECT run_id, dtype, device, release, config FROM runs "
                                 "ORDER BY committed_at").to_pylist()


def test_references_stream_under_a_small_budget_say_so_and_are_reused_by_the_whole_path(model, prompt_file,
                                                                                        tmp_path, capsys):
    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 4, "--store", store, "--reference-memory", BUDGET, "--release", "r1")
    assert rc == 0, out + err
    assert "overall:       PASS" in out
    said = [line for line in (out + err).splitlines() if ": streamed (" in line]
    assert len(said) == 2, out + err  # baseline and expected, each with its plan and peak
    for line in said:
        assert re.search(r"budget 1\.00 MiB, largest unit model\.layers\.0 0\.(56|28) MiB; \d+ group\(s\) of [\d, ]+ "
                         r"prompt\(s\); (no )?prefetch[: ][^()]*\([^()]*\)\); peak RSS \d+\.\d\d [MG]iB", line), line
    # FP32: two layers (1.12 MiB) never fit 1 MiB; BF16: two layers (0.56 MiB) do, but not beside
    # the group of 3 prompts' activations, which would take 2 groups (passes) to fit: said so
    for line in said:
        assert "no prefetch: two neighbouring units do not fit the budget (model.layers.0 -> model.layers.1" in line
    runs = _runs(store)
    cfgs = [json.loads(r["config"]) for r in runs]
    assert [c["reference_path"] for c in cfgs[:2]] == ["streamed", "streamed"]
    assert all(c["reference_device"] == "cpu" and r["device"] == "cpu" for c, r in zip(cfgs[:2], runs[:2]))
    assert sum(cfgs[0]["reference_groups"]) == len(TEXTS) and len(cfgs[0]["reference_groups"]) > 1

    # no budget: the weights fit, the whole path would run, but the streamed references are reused
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 4, "--store", store, "--release", "r2", "--quiet")
    assert rc == 0 and f"baseline {runs[0]['run_id']} (reused); expected {runs[1]['run_id']} (reused)" in out, out


def test_whole_and_streamed_references_store_the_same_bits(model, prompt_file, tmp_path):
    import numpy as np

    from capturestore import pipeline

    stores = {}
    for name, mem in (("whole", None), ("streamed", float(BUDGET))):
        stores[name] = tmp_path / name
        r = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=stores[name], quiet=True,
                         reference_memory=mem, out=lambda s: None)
        assert r.passed
    a, b = Store.open(stores["whole"]), Store.open(stores["streamed"])
    ra, rb = _runs(stores["whole"]), _runs(stores["streamed"])
    for x, y in zip(ra[:2], rb[:2]):
        assert json.loads(y["config"])["reference_path"] == "streamed"
        assert json.loads(x["config"])["reference_path"] == "whole"
        for p in a.prompts(x["run_id"]).to_pylist():
            pid = p["prompt_id"]
            assert np.array_equal(a.read_tokens(x["run_id"], pid), b.read_tokens(y["run_id"], pid))
            assert np.array_equal(a.read_logits(x["run_id"], pid), b.read_logits(y["run_id"], pid), equal_nan=True)
            for u, v in zip(a.read_kv(x["run_id"], pid), b.read_kv(y["run_id"], pid)):
                assert np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def test_module_references_stream_too(model, prompt_file, tmp_path):
    from capturestore import pipeline

    lines = []
    r = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=tmp_path / "s",
                     plugins="logits,modules", modules="model.layers.*.mlp", out=lines.append,
                     reference_memory=float(BUDGET))
    assert r.passed, "\n".join(lines)
    assert sum("modules: streamed (" in line for line in lines) == 2, lines
    s = Store.open(tmp_path / "s")
    own = json.loads(s.sql("SELECT comparator_runs FROM comparisons").to_pylist()[0]["comparator_runs"])["modules"]
    cfgs = {role: json.loads(s.show(rid)["run"]["config"]) for role, rid in own.items()}
    assert cfgs["baseline"]["reference_path"] == cfgs["expected"]["reference_path"] == "streamed"
    assert all(c["module_order"] == [f"model.layers.{i}.mlp" for i in range(3)] for c in cfgs.values())


def _broken(model, tmp_path):
    """The model in two shards + index, the index naming a tensor shard 1 lacks."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    d.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    t = load_file(str(model / "model.safetensors"))
    names = sorted(t)
    wm = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: t[k] for k in part if k != "model.layers.1.mlp.up_proj.weight"}, str(d / fn))
        wm.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d, d / wm["model.layers.1.mlp.up_proj.weight"]


def test_bad_reference_options_and_checkpoints_are_one_line_exit_2_and_nothing_is_written(model, prompt_file,
                                                                                          tmp_path, capsys):
    import torch

    broken, shard = _broken(model, tmp_path)
    cases = {
        "budget below one layer": (["--reference-memory", str(0.25 / 1024)],
                                   r"budget 0\.25 MiB is smaller than one layer of the model: model\.layers\.0 "
                                   r"needs 0\.56 MiB \(590848 bytes\); give at least 0\.\d+ GiB"),
        "budget not positive": (["--reference-memory", "-1"], r"--reference-memory must be a number of GiB > 0"),
        "unknown device": (["--reference-device", "tpu"], r"--reference-device: reference device 'tpu': give cpu or "
                                                          r"cuda\[:N\]"),
        "shards and index disagree": (["--model", str(broken)], re.escape(f"{shard}: lacks tensor "
                                                                           f"model.layers.1.mlp.up_proj.weight")),
    }
    if not torch.cuda.is_available():
        cases["no CUDA"] = (["--reference-device", "cuda:0"], r"torch sees no CUDA device here")
    for name, (extra, pattern) in cases.items():
        store = tmp_path / f"never-{len(name)}"
        args = ["--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16", "--num-tokens", 2,
                "--store", store]
        if "--model" in extra:
            args[1] = extra[1]
            extra = []
        rc, out, err = _cli(capsys, *args, *extra)
        assert rc == 2, (name, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("capturestore run: error: "), (name, err)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert not store.exists(), name
