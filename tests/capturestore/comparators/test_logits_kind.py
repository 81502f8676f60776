"""The logits comparator compares like with like: an actual run holding log-probabilities
(``logits_kind: "log_softmax"``, e.g. a vLLM server's prompt logprobs) is judged against the
log-softmax of the references: the rows equal those of a comparison whose references were stored
as log-softmax already (computed independently, torch float64). Without the recorded kind the
same data is judged against the raw references (whose BF16-vs-FP32 errors then differ from the
log-softmax ones by each row's change of the log partition function)."""
import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.capture import begin_capture_run, write_prompt_capture
from capturestore.comparators.logits import log_softmax_rows

T, V, PLEN = 6, 64, 4
COLS = ("status", "passed", "expected_token", "actual_token", "topk_5_error", "topk_all_error", "tgt_linf",
        "base_linf", "linf_ratio", "l2_ratio", "bc")


def _run(store, kind, rows, prompts, teachers, engine):
    run = begin_capture_run(store, engine=engine, capture="teacher_forced_prefill", prompts=prompts,
                            layer_names=None, logits_kind=kind, model_path="/m", model_hash="h", dtype="float32")
    with run:
        for p, t, x in zip(prompts, teachers, rows):
            write_prompt_capture(run, p, t, x)
    return run.run_id


def _rows(store, cid):
    t = store.sql(f"SELECT * FROM logit_token_metrics WHERE comparison_id = '{cid}' ORDER BY prompt_id, gen_token_idx")
    return {c: t.column(c).to_pylist() for c in COLS}


def test_log_softmax_rows_is_the_float64_log_softmax():
    x = np.array([[1.0, 2.0, 3.0, -np.inf], [1000.0, 1000.0, -1000.0, 0.0]], dtype=np.float32)
    want = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64) - x.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - x.max(1, keepdims=True)
    got = log_softmax_rows(x)
    assert got[0, 3] == -np.inf
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=0, atol=1e-6)
    assert np.isnan(log_softmax_rows(np.array([[np.nan, 1.0]]))).all()


def test_log_softmax_actual_is_judged_against_log_softmaxed_references(tmp_path):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, PLEN).tolist() for _ in range(3)]
    fp32 = [rng.standard_normal((T, V)).astype(np.float32) * 3 for _ in prompts]
    teachers = [x.argmax(-1).tolist() for x in fp32]
    bf16 = [x + rng.standard_normal(x.shape).astype(np.float32) * 0.01 for x in fp32]
    tgt = [x + rng.standard_normal(x.shape).astype(np.float32) * 0.004 for x in fp32]
    store = Store.open(tmp_path / "s")
    base = _run(store, "logits", fp32, prompts, teachers, "hf")
    exp = _run(store, "logits", bf16, prompts, teachers, "hf")
    raw = _run(store, "raw_logits", tgt, prompts, teachers, "vllm")
    lsm = [log_softmax_rows(x) for x in tgt]
    served = _run(store, "log_softmax", lsm, prompts, teachers, "vllm-server")
    unsaid = _run(store, None, lsm, prompts, teachers, "vllm-server")

    import torch

    def lsm64(xs):
        return [torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1).float().numpy() for x in xs]

    base_l = _run(store, "log_softmax", lsm64(fp32), prompts, teachers, "hf")
    exp_l = _run(store, "log_softmax", lsm64(bf16), prompts, teachers, "hf")

    r_raw = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=raw, kv=False)
    r_lsm = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=served, kv=False)
    r_all = compare_runs(store, baseline_run=base_l, expected_run=exp_l, actual_run=served, kv=False)
    assert r_raw.passed and r_lsm.passed and r_all.passed
    a, b = _rows(store, r_all.comparison_id), _rows(store, r_lsm.comparison_id)
    for c in ("status", "passed", "expected_token", "actual_token"):
        assert a[c] == b[c], c
    for c in ("topk_5_error", "topk_all_error", "tgt_linf", "base_linf", "linf_ratio", "l2_ratio", "bc"):
        np.testing.assert_allclose(b[c], a[c], rtol=1e-4, atol=1e-6, err_msg=c)
    assert max(b["tgt_linf"]) < 0.1  # log-probabilities against log-probabilities

    r_unsaid = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=unsaid, kv=False)
    # kind not said: the references are read raw, so their own errors are those of the raw comparison
    u, raw_rows = _rows(store, r_unsaid.comparison_id), _rows(store, r_raw.comparison_id)
    assert u["base_linf"] == raw_rows["base_linf"]
    assert not np.allclose(u["base_linf"], b["base_linf"], rtol=1e-2, atol=0)


def test_raw_logit_comparisons_are_untouched(tmp_path, monkeypatch):
    """No run says log_softmax: the rows are the comparator's on the stored values (no log-softmax call)."""
    import capturestore.comparators.logits as lg

    def boom(x):
        raise AssertionError("log_softmax_rows called for raw logits")

    monkeypatch.setattr(lg, "log_softmax_rows", boom)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, V, PLEN).tolist()]
    x = [rng.standard_normal((T, V)).astype(np.float32)]
    t = [x[0].argmax(-1).tolist()]
    store = Store.open(tmp_path / "s")
    e = _run(store, "logits", x, prompts, t, "hf")
    a = _run(store, "raw_logits", [x[0] + np.float32(0.001)], prompts, t, "vllm")
    res = compare_runs(store, expected_run=e, actual_run=a, kv=False)
    assert _rows(store, res.comparison_id)["topk_all_error"] == pytest.approx([0.0] * T, abs=2e-5)
