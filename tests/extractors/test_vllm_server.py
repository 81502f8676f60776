"""extractors.vllm_server against a real ``vllm serve`` on 127.0.0.1 (tests/vllm_serve.py).

Oracles: the in-process vLLM capture of the same weights (raw logits, log-softmaxed here) and HF
FP32 (log_softmax of its logits), both within 1e-4 in FP32; the model check against another tiny
model and against a copy of the same weights; an unreachable URL.
"""
import shutil

import numpy as np
import pytest
import torch

from capturestore import Store
from capturestore.analysis import compare_runs
from extractors.vllm_server import capture_vllm_server_run, check_server
from tests.vllm_serve import free_port, vllm_server

ARCH, SEED = "llama-mha", 3  # not the demo's model (llama-gqa, seed 0)
TOL = 1e-4


def _inputs():
    rng = np.random.default_rng(11)
    lens = (5, 17, 40)
    prompts = [[1] + rng.integers(4, 1024, n - 1).tolist() for n in lens]
    teacher = [rng.integers(4, 1024, 8).tolist() for _ in lens]
    return prompts, teacher


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    path = tiny_model(ARCH, SEED)
    with vllm_server(path, log_dir=tmp_path_factory.mktemp("serve-log")) as url:
        yield url, path


def _runs_count(store) -> int:
    return store.runs().num_rows


@pytest.mark.vllm
@pytest.mark.slow
def test_server_logprobs_agree_with_in_process_vllm_and_hf_fp32(served, tmp_path):
    from extractors.hf import capture_hf_run
    from extractors.vllm_rpc import capture_vllm_run, close_llm, make_llm

    url, path = served
    prompts, teacher = _inputs()
    store = Store.open(tmp_path / "s")
    hf = capture_hf_run(store, path, prompts, teacher_tokens=teacher, dtype="float32")
    llm = make_llm(path, dtype="float32", max_model_len=256)
    try:
        local = capture_vllm_run(store, llm, path, prompts, teacher, mode="prefill", kv=False)
    finally:
        close_llm(llm)
    report = {}
    run = capture_vllm_server_run(store, url, path, prompts, teacher, dtype="float32", report=report)
    show = store.show(run)
    assert show["run"]["engine"] == "vllm-server" and '"logits_kind": "log_softmax"' in show["run"]["config"]
    assert report["bytes"] > 0 and not any(c["kind"].startswith("kv") for c in show["captures"])
    worst = {"in-process vLLM": 0.0, "HF FP32": 0.0}
    for pid in store.prompts(run).column("prompt_id").to_pylist():
        got = store.read_logits(run, pid)
        assert got.shape == (8, 1024) and np.isfinite(got).all()
        for name, other in (("in-process vLLM", local), ("HF FP32", hf)):
            want = torch.log_softmax(torch.from_numpy(store.read_logits(other, pid)).double(), -1).numpy()
            diff = float(np.abs(got - want).max())
            assert diff <= TOL, f"prompt {pid}: max |server - log_softmax({name})| = {diff:.3g} > {TOL}"
            worst[name] = max(worst[name], diff)
    print(f"max |server logprobs - log_softmax(other)|: {worst}")  # shown with pytest -s
    result = compare_runs(store, expected_run=hf, actual_run=run, kv=False)
    assert result.passed, result.logit_verdict.summary()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_served_model_is_checked_and_a_refused_capture_stores_nothing(served, tiny_model, tmp_path):
    url, path = served
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # same weights and config elsewhere: the same model
    assert check_server(url, copy)["served_model_name"] == str(path)
    store = Store.open(tmp_path / "s")
    other = tiny_model("llama-gqa", 0)
    with pytest.raises(ValueError, match=r"serves .* not the model .*llama-gqa") as e:
        capture_vllm_server_run(store, url, other, [[1, 2, 3]], [[4, 5]])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"prompt 0: 300 prompt \+ 2 teacher tokens = 302 > max_model_len 256"):
        capture_vllm_server_run(store, url, path, [[1] * 300], [[4, 5]])
    assert _runs_count(store) == 0 and not store.pending()


def test_an_unreachable_url_is_one_line_naming_it(tmp_path, tiny_model):
    port = free_port()  # nothing listens there
    store = Store.open(tmp_path / "s")
    with pytest.raises(ValueError, match=rf"vLLM server http://127.0.0.1:{port} is unreachable") as e:
        capture_vllm_server_run(store, f"127.0.0.1:{port}", tiny_model(ARCH, SEED), [[1, 2]], [[3]])
    assert "\n" not in str(e.value) and _runs_count(store) == 0
