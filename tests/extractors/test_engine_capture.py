"""The user's own engine captured where it runs (``extractors.engine_capture``): hooks on its model
track prefill / decode step n themselves, pick the request's batch row and unpadded columns (left
or right padding, two requests batched), lay tensors out as ``capture_hf_modules`` does, and write
a run that the ``modules`` comparator judges against HF references. Every fault of the hand-written
engine (``own_engine.py``: in its loop and cache, not in its model) is first shown to change its
logits, is then named at its module and phase through the capture API, and is missed by
re-running the engine's model through capturestore's own loop (``capture_hf_module_run(model=...)``).
The engine's KV cache contents, handed to the capture (``EngineCapture(kv=...)``), compare with HF
runs' KV like any run: the correct engine passes, each cache fault is named at its layer."""
import numpy as np
import pytest
import torch

from capturestore import Store
from capturestore.analysis import compare_runs
from extractors.engine_capture import EngineCapture, write_module_run
from extractors.modules import capture_hf_module_run, capture_hf_modules
from tests.extractors.own_engine import FAULTS, OwnEngine

MODULES = ["model.layers.*.self_attn", "model.layers.*.mlp", "model.layers.*", "model.norm"]
EARLIER = list(range(10, 40))  # an earlier, longer request (30 tokens) served before the one under test
PROMPT, CONT = list(range(50, 63)), [9, 11, 12, 13, 14]  # the request under test: 13 tokens, 5 teacher tokens
OTHER, OTHER_CONT = list(range(100, 121)), [3, 4, 5, 6, 7]  # batched beside it (21 tokens: padding either side)


@pytest.fixture(scope="module")
def path():
    from extractors.models import tiny_model

    return tiny_model("llama-gqa", seed=0)


def _model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(path):
    return {"float32": _model(path, torch.float32), "bfloat16": _model(path, torch.bfloat16)}


def _serve(model, row, padding="left", fault=None, batched=True, fault_layers=None):
    """The engine serves EARLIER alone, then PROMPT (in batch ``row``, beside OTHER when batched),
    capturing PROMPT's modules and cache contents. Returns ``(logits of PROMPT, RequestCapture)``."""
    eng = OwnEngine(model, fault=fault, padding=padding, fault_layers=fault_layers)
    eng.run([EARLIER], [CONT])
    reqs = [OTHER, PROMPT] if row == 1 else [PROMPT, OTHER]
    conts = [OTHER_CONT, CONT] if row == 1 else [CONT, OTHER_CONT]
    if not batched:
        reqs, conts = [PROMPT], [CONT]
    b = row if batched else 0
    with EngineCapture(model, MODULES, prompt_len=len(PROMPT), row=b, kv=lambda: eng.cache_of(b)) as cap:
        logits = eng.run(reqs, conts)
    return logits[row if batched else 0], cap.result()


@pytest.mark.parametrize("padding, row", [("left", 1), ("right", 0)])
def test_a_padded_batched_request_is_captured_in_the_layout_of_capturestores_own_loop(models, padding, row):
    model = models["float32"]
    logits, got = _serve(model, row, padding)
    # independent oracle: the same request through capture_hf_modules (HF's cache, batch 1, no padding)
    want = {}
    ref_logits, order = capture_hf_modules(model, PROMPT, CONT, lambda m, ph, s, t: want.setdefault((m, ph), [])
                                           .append(t), MODULES)
    assert got.prompt_len == len(PROMPT) and got.order == order and got.fed == len(PROMPT) + len(CONT) - 1
    for m in order:
        assert got.prefill[m].shape == want[(m, "prefill")][0].shape == (len(PROMPT), 128)
        torch.testing.assert_close(got.prefill[m], want[(m, "prefill")][0], atol=2e-5, rtol=0)
        assert len(got.decode[m]) == len(CONT) - 1
        for n, t in enumerate(got.decode[m]):
            assert t.shape == (1, 128)
            torch.testing.assert_close(t, want[(m, "decode")][n], atol=2e-5, rtol=0)
    torch.testing.assert_close(got.logits, ref_logits, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.logits, logits, atol=0, rtol=0)  # the engine's own output rows, taken as is
    # its cache contents: the positions fed (prompt + all but the last continuation token), equal to HF's cache
    from extractors.hf import extract_hf_kv_caches_teacher_forced, hf_layer_names

    ref_kv = extract_hf_kv_caches_teacher_forced(model, [PROMPT], [CONT])
    fed = len(PROMPT) + len(CONT) - 1
    assert list(got.kv) == hf_layer_names(model)
    for name, (k, v) in got.kv.items():
        assert k.shape == (2, fed, 32)
        torch.testing.assert_close(k, ref_kv[name][0][0, :, :fed], atol=2e-5, rtol=0)
        torch.testing.assert_close(v, ref_kv[name][1][0, :, :fed], atol=2e-5, rtol=0)


def test_phases_stated_with_step_and_a_row_outside_the_batch_capture_nothing(models):
    model = models["float32"]
    eng = OwnEngine(model)
    with EngineCapture(model, ["model.norm"], row=3) as cap:  # no row 3 in a batch of one
        eng.run([PROMPT], [CONT])
    with pytest.raises(ValueError, match=r"nothing of the request was captured: batch row 3 was in no forward"):
        cap.result()
    # prompt_len not given: the first forward is the prefill; step() states a phase explicitly
    eng = OwnEngine(model)
    with EngineCapture(model, ["model.norm"]) as cap, cap.step("decode", 7):
        with pytest.raises(ValueError, match="a decode step feeds one token of the request, this forward 13"):
            eng.run([PROMPT], [CONT])


def _references(store, path):
    base = capture_hf_module_run(store, path, [PROMPT], [CONT], MODULES, dtype="float32")
    exp = capture_hf_module_run(store, path, [PROMPT], [CONT], MODULES, dtype="bfloat16")
    return base, exp


def _judge(store, base, exp, act):
    return compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                        comparators=["modules"])


@pytest.fixture(scope="module")
def judged(path, models, tmp_path_factory):
    """The references, and the correct engine's capture in a batch (row 1, left padding)."""
    store = Store.open(tmp_path_factory.mktemp("own") / "s")
    base, exp = _references(store, path)
    clean_logits, clean = _serve(models["bfloat16"], row=1)
    act = write_module_run(store, path, [(PROMPT, CONT, clean)], "bfloat16", release="clean")
    return store, base, exp, act, clean_logits


@pytest.fixture(scope="module")
def kv_references(judged, path, models):
    """HF FP32 / BF16 runs with KV (and logits) of the request under test, teacher-forced."""
    from extractors.hf import capture_hf_run

    store = judged[0]
    return tuple(capture_hf_run(store, path, [PROMPT], [CONT], dtype=dt, model=models[dt])
                 for dt in ("float32", "bfloat16"))


def test_the_correct_engine_captured_in_a_batch_passes_against_the_hf_references(judged):
    store, base, exp, act, _ = judged
    r = _judge(store, base, exp, act)
    assert r.passed and r.localisation is None, r.verdicts["modules"].summary()
    # the run holds what the store's module layout says: prefill [P, hidden], decode steps [1, hidden]
    pid = store.prompts(act).column("prompt_id").to_pylist()[0]
    assert store.read_tensor(act, pid, "model.norm", phase="prefill").shape[-2:] == (len(PROMPT), 128)
    assert store.read_logits(act, pid).shape == (len(CONT), 1024)


WHERE = {  # fault -> (phase, module) where it first shows
    "rope_decode_offset": ("decode", "model.layers.0.self_attn"),
    "kv_write_prev_slot": ("decode", "model.layers.0.self_attn"),
    "stale_read": ("decode", "model.layers.0.self_attn"),
    "fp8_cache_writes": ("prefill", "model.layers.0.self_attn"),
    "v_head_scale": ("prefill", "model.layers.0.self_attn"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_the_engines_loop_or_cache_is_named_at_its_module_and_phase_where_our_loop_misses_it(
        judged, path, models, fault):
    store, base, exp, _, clean_logits = judged
    model = models["bfloat16"]
    logits, cap = _serve(model, row=1, fault=fault)
    changed = (logits - clean_logits).abs().amax(dim=-1)
    decode_only = WHERE[fault][0] == "decode"
    assert (changed[1:] > 0.1).all() and (changed[0] == 0 if decode_only else changed[0] > 0.1), changed
    act = write_module_run(store, path, [(PROMPT, CONT, cap)], "bfloat16", release=fault)
    r = _judge(store, base, exp, act)
    assert not r.passed
    phase, module = WHERE[fault]
    assert r.localisation["phase"] == phase and r.localisation["module"] == module, r.localisation
    assert r.localisation["layer"] == 0
    # capturestore's own loop on the engine's model: the model holds no fault, so nothing is found
    ours = capture_hf_module_run(store, path, [PROMPT], [CONT], MODULES, dtype="bfloat16", model=model)
    missed = _judge(store, base, exp, ours)
    assert missed.passed, missed.verdicts["modules"].summary()


def test_write_module_run_refuses_a_capture_that_does_not_fit_its_prompt(judged, path):
    from extractors.engine_capture import RequestCapture

    store = judged[0]

    short = RequestCapture(prompt_len=len(PROMPT), prefill={}, decode={"model.norm": [torch.zeros(1, 128)]})
    with pytest.raises(ValueError, match=r"requests\[0\]: 1 decode steps captured for 5 continuation tokens"):
        write_module_run(store, path, [(PROMPT, CONT, short)], "bfloat16")
    wrong = RequestCapture(prompt_len=4)
    with pytest.raises(ValueError, match=r"requests\[0\]: the capture's prefill is 4 tokens, the prompt 13"):
        write_module_run(store, path, [(PROMPT, CONT, wrong)], "bfloat16")


def _judge_kv(store, refs, act):
    return compare_runs(store, baseline_run=refs[0], expected_run=refs[1], actual_run=act, logits=False, kv=True)


def test_the_correct_engines_cache_contents_pass_the_kv_verdict(judged, kv_references):
    store, _, _, act, _ = judged
    pid = store.prompts(act).column("prompt_id").to_pylist()[0]
    k, v = store.read_kv(act, pid)
    assert k.shape == (3, 2, len(PROMPT) + len(CONT), 32)  # [layer, kv_head, seq, head_dim], the built-in layout
    assert np.isnan(k[:, :, -1]).all() and not np.isnan(k[:, :, :-1]).any()  # the last token is never fed
    r = _judge_kv(store, kv_references, act)
    assert r.passed and r.verdicts["kv"].passed is True, r.verdicts["kv"].text


KV_WHERE = {  # fault (cache faults in layer 1 only; RoPE in every layer) -> (phase, layer) the KV verdict names
    "rope_decode_offset": ("decode", 0),
    "kv_write_prev_slot": ("prefill", 1),  # decode step 0 overwrites the last prompt position's slot
    "fp8_cache_writes": ("prefill", 1),
    "v_head_scale": ("prefill", 1),
}


@pytest.mark.parametrize("fault", sorted(KV_WHERE))
def test_a_cache_fault_is_named_at_its_layer_by_the_kv_verdict(judged, kv_references, path, models, fault):
    store, _, _, _, clean_logits = judged
    logits, cap = _serve(models["bfloat16"], row=1, fault=fault, fault_layers={1})
    changed = (logits - clean_logits).abs().amax(dim=-1)
    assert (changed[1:] > 0.01).all(), changed  # proven to change the output
    act = write_module_run(store, path, [(PROMPT, CONT, cap)], "bfloat16", release=f"kv {fault}")
    r = _judge_kv(store, kv_references, act)
    phase, layer = KV_WHERE[fault]
    assert not r.passed and r.verdicts["kv"].passed is False
    assert r.localisation["phase"] == phase and r.localisation["layer"] == layer, r.verdicts["kv"].text


def test_a_read_fault_leaves_the_cache_contents_right(judged, kv_references, path, models):
    """A stale read is in the attention, not the cache: the KV evidence passes (the module verdict
    names it, above); the cache holds what was written."""
    store, _, _, _, clean_logits = judged
    logits, cap = _serve(models["bfloat16"], row=1, fault="stale_read")
    assert ((logits - clean_logits).abs().amax(dim=-1)[1:] > 0.1).all()
    act = write_module_run(store, path, [(PROMPT, CONT, cap)], "bfloat16", release="kv stale_read")
    r = _judge_kv(store, kv_references, act)
    assert r.verdicts["kv"].passed is True, r.verdicts["kv"].text


def test_kv_handed_in_a_wrong_shape_or_to_some_requests_only_is_refused(judged, path, models):
    store = judged[0]
    cap = EngineCapture(models["float32"], ["model.norm"])
    with pytest.raises(ValueError, match=r"set_kv: 2 layers of K/V for 3 layer names"):
        cap.set_kv([(torch.zeros(2, 4, 32), torch.zeros(2, 4, 32))] * 2)
    with pytest.raises(ValueError, match=r"layer model.layers.0.self_attn.attn: k of shape \(4, 32\), expected"):
        cap.set_kv([(torch.zeros(4, 32), torch.zeros(4, 32))] * 3)
    with pytest.raises(ValueError, match=r"kv must be a callable"):
        EngineCapture(models["float32"], ["model.norm"], kv=[1])
    _, with_kv = _serve(models["bfloat16"], row=1)
    from dataclasses import replace

    without = replace(with_kv, kv=None)
    n_runs = store.sql("SELECT count(*) FROM runs").column(0)[0].as_py()
    with pytest.raises(ValueError, match=r"requests\[1\]: KV layers \[\] where requests\[0\] holds"):
        write_module_run(store, path, [(PROMPT, CONT, with_kv), (PROMPT, CONT, without)], "bfloat16")
    assert store.sql("SELECT count(*) FROM runs").column(0)[0].as_py() == n_runs
