"""Targets as plugins (``capturestore.targets``): the built-ins resolve with or without their
entry points in the installed metadata, a target from another package runs end to end through
``capturestore run --target NAME`` in a fresh interpreter (passing clean, failing with a planted
fault that is first shown to change its logits), an unknown or broken target is one line, exit 2,
and ``--dtype`` picks the vLLM target's dtype and its expected reference."""
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from capturestore import Store
from capturestore.pipeline import parse_target
from capturestore.targets import BUILTIN, ENTRY_POINT_GROUP, EngineTarget, engine_target, target_names

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Numbers: 3 1 4 1 5 9 2 6"]


@pytest.fixture(scope="module")
def model():
    from extractors.models import tiny_model

    return tiny_model("llama-mha", seed=5)


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(TEXTS) + "\n")
    return p


def test_the_built_in_targets_are_declared_in_pyproject_exactly_as_the_fallback_table_resolves_them():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert declared == BUILTIN
    for name in BUILTIN:
        eng = engine_target(name)
        assert isinstance(eng, EngineTarget) and eng.name == name and eng.dtypes
        assert set(eng.gives) <= {"logits", "kv", "tensors", "routing"}
    assert {"vllm", "vllm-server", "hf", "hf-fp8-kv"} <= set(target_names())


@pytest.mark.parametrize("spec, dtype, want", [
    ("vllm", None, ("vllm", "bfloat16", "bfloat16", "vllm")),
    ("vllm", "float16", ("vllm", "float16", "float16", "vllm:float16")),
    ("vllm:float32", None, ("vllm", "float32", "bfloat16", "vllm:float32")),  # FP32 judged against BF16 noise
    ("hf:float16", None, ("hf", "float16", "float16", "hf:float16")),
    ("hf", None, ("hf", "bfloat16", "bfloat16", "hf:bfloat16")),
    ("hf-fp8-kv", None, ("hf-fp8-kv", "bfloat16", "bfloat16", "hf-fp8-kv")),
    ("vllm-server=http://127.0.0.1:8000/", None, ("vllm-server", "bfloat16", "bfloat16",
                                                  "vllm-server=http://127.0.0.1:8000")),
])
def test_a_target_spec_gives_its_dtype_and_the_dtype_of_its_expected_reference(spec, dtype, want):
    t = parse_target(spec, dtype)
    assert (t.kind, t.dtype, t.reference_dtype, str(t)) == want


@pytest.mark.parametrize("spec, dtype, says", [
    ("tpu", None, r"unknown target 'tpu'; installed: hf, hf-fp8-kv, vllm, vllm-server"),
    ("hf:float32", None, r"the hf target's dtype must be one of bfloat16, float16, not 'float32'"),
    ("hf:float16", "bfloat16", r"--target hf:float16 and --dtype bfloat16 disagree"),
    ("hf-fp8-kv:float16", None, r"target hf-fp8-kv takes no dtype"),
    ("vllm-server", None, r"give the server, vllm-server=http://HOST:PORT"),
    ("vllm-server=ftp://x", None, r"the server URL must be http\(s\)://HOST:PORT"),
    ("vllm=http://x:1", None, r"target vllm takes no URL"),
])
def test_a_bad_target_spec_is_refused_in_one_line(spec, dtype, says):
    with pytest.raises(ValueError, match=says):
        parse_target(spec, dtype)


# ------------------------------------------------------------------------------------ a target of another package

TOY_TARGET = '''
import os

import torch

from capturestore.targets import EngineTarget, TargetRuns


class ToyTarget(EngineTarget):
    """HF BF16 with SDPA attention, driven by this package: its own load, its own planted fault."""

    name = "toy-hf"
    gives = frozenset({"logits"})
    dtypes = ("bfloat16",)
    default_plugins = ("logits",)

    def check(self, ctx):
        if os.environ.get("TOY_REFUSE"):
            raise ValueError("target toy-hf: refused by its check")

    def capture(self, ctx):
        from transformers import AutoModelForCausalLM

        from extractors.hf import capture_hf_run

        model = AutoModelForCausalLM.from_pretrained(str(ctx.model_path), dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").eval()
        scale = float(os.environ.get("TOY_FAULT_SCALE", "1"))
        if scale != 1:  # planted: layer 1's attention output projection scaled
            with torch.no_grad():
                model.model.layers[1].self_attn.o_proj.weight.mul_(scale)
        ctx.say("toy-hf: capturing")
        rid = capture_hf_run(ctx.store, ctx.model_path, ctx.rows, teacher_tokens=ctx.teacher_rows, dtype="bfloat16",
                             release=ctx.release, model=model, config={**ctx.config, "toy_fault_scale": scale})
        return TargetRuns(rid)
'''


def _site(tmp_path):
    site = tmp_path / "site"
    (site / "toytarget").mkdir(parents=True)
    (site / "toytarget" / "__init__.py").write_text(TOY_TARGET)
    dist = site / "toytarget-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toytarget\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy-hf = toytarget:ToyTarget\n"
                                           f"broken = toytarget_gone:Missing\n")
    return site


def _cli(site, *args, **env):
    # a fresh interpreter whose installed capturestore metadata (the editable install) may lack the
    # capturestore.targets group: the built-ins then come from the fallback table, the toy from its entry point
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "capturestore.cli", "run", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)


def test_a_target_of_another_package_runs_end_to_end_and_fails_with_its_planted_fault(model, prompt_file, tmp_path):
    site = _site(tmp_path)
    store = tmp_path / "s"
    common = ["--model", model, "--prompts", prompt_file, "--num-tokens", 3, "--store", store]
    ok = _cli(site, *common, "--target", "toy-hf", "--release", "clean")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "toy-hf: capturing" in ok.stdout and "overall:       PASS" in ok.stdout
    bad = _cli(site, *common, "--target", "toy-hf", "--release", "faulty", TOY_FAULT_SCALE="1.5")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "overall:       FAIL" in bad.stdout
    s = Store.open(store)
    runs = {r["release"]: r for r in s.sql("SELECT run_id, release, config FROM runs WHERE release IS NOT NULL")
            .to_pylist()}
    assert json.loads(runs["faulty"]["config"])["toy_fault_scale"] == 1.5
    # the fault is real: the faulty engine's logits differ from the clean engine's, on every prompt
    for pid in s.prompts(runs["clean"]["run_id"]).column("prompt_id").to_pylist():
        a, b = (s.read_logits(runs[k]["run_id"], pid).astype(np.float64) for k in ("clean", "faulty"))
        assert np.max(np.abs(a - b)) > 0.1
    cmps = s.sql("SELECT label, passed FROM comparisons ORDER BY created_at").to_pylist()
    assert [(c["label"], c["passed"]) for c in cmps] == [("toy-hf clean", True), ("toy-hf faulty", False)]


def test_an_unknown_a_broken_or_a_refusing_target_is_one_line_exit_2_and_nothing_is_written(model, prompt_file,
                                                                                             tmp_path):
    site = _site(tmp_path)
    store = tmp_path / "never-made"
    common = ["--model", model, "--prompts", prompt_file, "--num-tokens", 3, "--store", store]
    for args, env, says in (
            (["--target", "tpu"], {}, "unknown target 'tpu'; installed: broken, hf, hf-fp8-kv, toy-hf, vllm, "
                                      "vllm-server"),
            (["--target", "broken"], {}, "target 'broken' (toytarget_gone:Missing) cannot be loaded: No module named "
                                         "'toytarget_gone'"),
            (["--target", "toy-hf"], {"TOY_REFUSE": "1"}, "target toy-hf: refused by its check"),
            (["--target", "toy-hf", "--plugins", "logits,kv"], {}, "plugin 'kv' needs kv captures, which target "
                                                                    "toy-hf does not give (it gives logits)")):
        out = _cli(site, *common, *args, **env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and out.stdout == "" and len(lines) == 1, out.stderr
        assert says in lines[0], lines[0]
        assert not store.exists()


# ------------------------------------------------------------------------------------ --dtype of the vLLM target


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_target_runs_in_float16_and_float32_each_against_its_expected_reference(model, prompt_file,
                                                                                         tmp_path):
    from capturestore import pipeline

    store = tmp_path / "s"
    got = {}
    for dtype in ("float16", "float32"):
        lines = []
        got[dtype] = r = pipeline.run(model, prompt_file, target="vllm", dtype=dtype, num_tokens=3, store=store,
                                      out=lines.append)
        assert r.passed, "\n".join(lines)
        assert f"starting vLLM ({dtype})" in "\n".join(lines)
    s = Store.open(store)
    rows = {r["run_id"]: r for r in s.sql("SELECT run_id, engine, dtype FROM runs").to_pylist()}
    fp16, fp32 = got["float16"], got["float32"]
    assert rows[fp16.runs["actual"]]["dtype"] == rows[fp16.runs["expected"]]["dtype"] == "float16"
    assert rows[fp32.runs["actual"]]["dtype"] == "float32" and rows[fp32.runs["expected"]]["dtype"] == "bfloat16"
    assert fp32.runs["baseline"] == fp16.runs["baseline"]
    # FP32 vLLM is far inside the BF16 noise it is judged against: its logits sit within FP32 rounding of the
    # FP32 baseline, while the BF16 expected run does not (an independent reading of the stored logits)
    for pid in s.prompts(fp32.runs["actual"]).column("prompt_id").to_pylist():
        base, act, exp = (s.read_logits(fp32.runs[k], pid).astype(np.float64) for k in ("baseline", "actual",
                                                                                          "expected"))
        act_err = np.max(np.abs((act - act.mean(-1, keepdims=True)) - (base - base.mean(-1, keepdims=True))))
        exp_err = np.max(np.abs((exp - exp.mean(-1, keepdims=True)) - (base - base.mean(-1, keepdims=True))))
        assert act_err < 1e-3 < exp_err, (pid, act_err, exp_err)


def test_the_fp8_kv_target_refuses_a_task_analysis_in_its_check():
    from capturestore.targets import TargetCheck

    t = parse_target("hf-fp8-kv")
    check = TargetCheck(t, "m", {}, [[1, 2]], 3, 1, frozenset({"logits", "kv"}), from_task=True)
    with pytest.raises(ValueError, match="--from-task: the hf-fp8-kv target's run cannot name the task analysis"):
        engine_target("hf-fp8-kv").check(check)
    engine_target("hf-fp8-kv").check(TargetCheck(t, "m", {}, [[1, 2]], 3, 1, frozenset(), from_task=False))


# ----------------------------------------------------------------------------------------------
# the kernel rounding of a served engine


class _Version:
    """An HTTP server on 127.0.0.1 answering ``/version`` with ``version`` (what vLLM's does)."""

    def __init__(self, version):
        import http.server
        import threading

        body = json.dumps({"version": version}).encode()

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                self.send_response(200 if self.path == "/version" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body if self.path == "/version" else b"{}")

            def log_message(self, *a):
                pass

        self.srv = http.server.HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def test_a_loopback_server_of_this_vllm_build_is_probed_here_and_any_other_server_is_not(monkeypatch):
    """A ``vllm-server`` target on this machine shares its CPU kernels: its BF16 expected reference
    rounds as the local probe says (before: never probed, so a truncating server was judged against
    round-to-nearest, the false FAIL docs/vllm-modules.md measured in-process). A remote server, or
    one of another vLLM version, is not probed at all."""
    vllm = pytest.importorskip("vllm")
    import extractors.kernel_rounding as kr
    from capturestore.targets import server_kernel_rounding

    calls = []
    monkeypatch.setattr(kr, "probe_vllm_cpu_rounding", lambda: calls.append(1) or "toward_zero")
    same, other = _Version(vllm.__version__), _Version("0.0.1-elsewhere")
    try:
        eng = engine_target("vllm-server")
        tgt = parse_target(f"vllm-server={same.url}")
        assert eng.kernel_rounding("bfloat16", target=tgt) == "toward_zero" and len(calls) == 1
        from capturestore.pipeline import _kernel_rounding

        assert _kernel_rounding(eng, tgt) == "toward_zero"  # the pipeline passes the target
        assert eng.kernel_rounding("float16", target=tgt) is None
        assert server_kernel_rounding(other.url) is None  # another build: its kernels are not ours
        assert server_kernel_rounding("http://192.0.2.7:8000") is None  # TEST-NET: elsewhere, never asked
        assert len(calls) == 2  # the two loopback asks of this build; no other server was probed
    finally:
        same.close()
        other.close()


def test_a_plugin_s_kernel_rounding_without_the_target_argument_still_works():
    from capturestore.pipeline import _kernel_rounding

    class Old(EngineTarget):
        name = "old"

        def kernel_rounding(self, dtype):
            return "toward_zero" if dtype == "bfloat16" else None

    assert _kernel_rounding(Old(), parse_target("hf:bfloat16")) == "toward_zero"
