"""vLLM module capture in a serving configuration, on one FP32 engine with chunked prefill (chunks of
16), prefix caching (32-token blocks) and up to three requests per step:

- requests batched into one forward are captured by request, each equal to the same request
  captured alone (and to HF FP32 on the same tokens);
- prompt positions served from the prefix cache are stored as not computed (NaN rows, listed in
  ``tensors/not_computed/prefill``), the computed rest equal to the request computed in full; the
  module comparator leaves them out, counts them and never passes on them;
- a fault that acts only in a later prefill chunk is proven to change the output, then named at
  its module and phase by the module verdict.

The grouping and segment rules themselves are checked on hand-made records (no engine)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from extractors.vllm_modules import group_request_records
from tests.extractors.forward_layout import unwatch_layout, watch_layout

CHUNK, BLOCK = 16, 32


def _recs(spans, width=4):
    """Records of one module: a forward per span of positions, each row = its position."""
    return [("m", list(s), torch.tensor([[float(p)] * width for p in s])) for s in spans]


def test_prefill_chunks_are_stitched_in_position_order_and_decode_steps_follow():
    got, skipped = group_request_records(_recs([range(16, 23), range(0, 16), [23], [24]]), 23, "here")
    assert got[("m", "prefill")][:, 0].tolist() == list(range(23)) and skipped == []
    assert got[("m", "decode")][:, 0].tolist() == [23, 24]


def test_positions_served_from_the_prefix_cache_are_nan_rows_and_listed():
    got, skipped = group_request_records(_recs([range(32, 40), [40]]), 40, "here")
    pre = got[("m", "prefill")]
    assert pre.shape == (40, 4) and skipped == list(range(32))
    assert torch.isnan(pre[:32]).all() and pre[32:, 0].tolist() == list(range(32, 40))


@pytest.mark.parametrize("spans, says", [
    ([range(0, 16), range(20, 40)], r"prefill chunks leave positions 16..19 uncovered"),
    ([range(0, 16)], r"the prefill chunks cover positions 0..15 of a prompt of 40"),
    ([range(30, 42)], r"mixes the prompt of 40 tokens with other positions"),
    ([range(0, 40), [41], [43]], r"decode steps \[1, 3\] are not 0..1"),
])
def test_a_prefill_that_is_not_the_whole_prompt_is_refused_saying_why(spans, says):
    with pytest.raises(ValueError, match=says):
        group_request_records(_recs(spans), 40, "here")


def test_modules_disagreeing_on_the_cached_prefix_are_refused():
    recs = _recs([range(32, 40)]) + [("n", list(range(16, 40)), torch.zeros(24, 4))]
    with pytest.raises(ValueError, match=r"modules disagree on where the prefill starts"):
        group_request_records(recs, 40, "here")


def test_the_judge_leaves_not_computed_positions_out_and_never_passes_on_them():
    from metrics.modules import ModuleJudge

    rng = np.random.default_rng(0)
    b = rng.standard_normal((8, 64)).astype(np.float32)
    e = (b + rng.standard_normal(b.shape) * 4e-3).astype(np.float32)
    a = (b + rng.standard_normal(b.shape) * 3e-3).astype(np.float32)
    judge = ModuleJudge()
    judge.add("0", "m", "prefill", b[4:], e[4:], a[4:], positions=np.arange(4, 8))
    judge.add_not_computed("0", "m", "prefill", 4)
    judge.add_not_computed("0", "only_cached", "prefill", 8)  # nothing of it was computed
    v = judge.verdict(["m", "only_cached"])
    m, c = v.modules
    assert m.passed is True and m.n_not_computed == 4 and m.n_tokens == 4
    assert c.passed is None and c.n_not_computed == 8 and "no position computed" in c.problem
    assert not v.passed and v.n_not_computed == 12
    assert "12 module positions not computed by the target" in v.summary()


@pytest.fixture(scope="module")
def engine():
    from extractors.models import tiny_model
    from extractors.vllm_rpc import close_llm, make_llm

    path = tiny_model("llama-gqa")
    llm = make_llm(path, dtype="float32", max_model_len=128, block_size=BLOCK, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=CHUNK, max_num_seqs=3)
    sched = llm.llm_engine.vllm_config.scheduler_config
    assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == CHUNK  # chunks of 16, as asked
    yield path, llm
    close_llm(llm)


@pytest.fixture(scope="module")
def hf32(engine):
    from extractors.hf import load_hf_model

    return load_hf_model(engine[0], "float32")


# ---------------------------------------------------------------- worker-side helpers (collective_rpc)


def _install_later_chunk_scale(worker, name, factor):
    """Scale ``name``'s output on the rows of every prefill chunk that starts past position 0 (the
    second chunk on, a chunk of one token too), of any request of the forward; first chunks and
    decode steps untouched."""
    from extractors.vllm_modules import forward_segments

    runner = worker.model_runner
    model = runner.model
    rows, calls = [], []

    def pre(module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        rows[:] = [(lo, hi) for rid, lo, hi in forward_segments(runner, pos.numel())
                   if 0 < int(pos[lo]) < len(runner.requests[rid].prompt_token_ids)]

    def hook(module, args, output):
        if not rows:
            return None
        out = output[0] if isinstance(output, tuple) else output
        out = out.clone()
        for lo, hi in rows:
            out[lo:hi] *= factor
        calls.append(len(rows))
        return (out, *output[1:]) if isinstance(output, tuple) else out

    worker._p21_fault = ([model.register_forward_pre_hook(pre, with_kwargs=True),
                          model.get_submodule(name).register_forward_hook(hook)], calls)
    return True


def _remove_later_chunk_scale(worker):
    handles, calls = worker.__dict__.pop("_p21_fault")
    for h in handles:
        h.remove()
    return len(calls)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 1000, size=n).tolist() for n in lengths]


def _assert_same(got, want, what, atol=2e-5):
    assert set(got) == set(want), what
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=f"{what}: {k}")


# ---------------------------------------------------------------- with the engine

@pytest.mark.vllm
@pytest.mark.slow
def test_batched_requests_are_captured_by_request_equal_to_each_alone(engine, hf32):
    from extractors.modules import collect_hf_modules
    from extractors.vllm_modules import collect_vllm_modules

    _, llm = engine
    prompts = _prompts(3, (40, 23, 31))
    llm.reset_prefix_cache()
    alone, toks, names = collect_vllm_modules(llm, prompts, 3)
    llm.reset_prefix_cache()  # the batched requests compute every position again
    llm.collective_rpc(watch_layout)
    try:
        batched, toks_b, _ = collect_vllm_modules(llm, prompts, 3, batch_size=3)
    finally:
        layout = llm.collective_rpc(unwatch_layout)[0]
    assert toks_b == toks
    # the scheduler did batch them: forwards held several requests, prefills went in chunks of 16
    assert max(len(f) for f in layout) >= 2
    assert any(len(f) >= 2 and any(len(p) > 1 for _, p in f) and any(len(p) == 1 for _, p in f) for f in layout), \
        "no forward mixed one request's decode with another's prefill"
    assert max(len(p) for f in layout for _, p in f) == CHUNK
    assert len(names) == 38
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b[(names[0], "prefill")].shape[0] == len(prompts[i]) and b[(names[0], "decode")].shape[0] == 2
        _assert_same(b, a, f"prompt {i} batched vs alone")
    # an independent oracle: HF FP32 on the same tokens (the TP test's bound for vLLM vs HF in FP32)
    ref, _ = collect_hf_modules(hf32, prompts, toks, names)
    for i, (b, r) in enumerate(zip(batched, ref)):
        _assert_same(b, r, f"prompt {i} batched vs HF FP32", atol=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_prefix_cache_hits_are_stored_not_computed_and_never_judged(engine, tmp_path):
    from capturestore import Store
    from capturestore.analysis import compare_runs
    from extractors.modules import capture_hf_module_run
    from extractors.vllm_modules import NOT_COMPUTED, capture_vllm_module_run, collect_vllm_modules

    path, llm = engine
    shared = _prompts(5, (BLOCK,))[0]  # one full 32-token block both prompts share
    prompts = [shared + [5, 6, 7, 8, 9], shared + [10, 11, 12, 13, 14, 15, 16, 17]]
    llm.reset_prefix_cache()
    skipped: list = []
    full, toks, names = collect_vllm_modules(llm, prompts[1:], 3, not_computed=skipped)  # computes every position
    assert skipped == [[]]
    store = Store.open(tmp_path / "s")
    mods = ["model.layers.*.self_attn", "model.layers.*.mlp", "model.norm"]
    act = capture_vllm_module_run(store, llm, path, prompts, None, modules=mods,
                                  teacher_tokens=[toks[0], toks[0]])  # both now hit the cached block
    pids = [r["prompt_id"] for r in store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{act}' "
                                              "ORDER BY prompt_idx").to_pylist()]
    for pid in pids:
        assert store.read_tensor(act, pid, NOT_COMPUTED, phase="prefill").tolist() == [list(range(BLOCK))]
    for m in mods[2:] + ["model.layers.1.mlp"]:
        got = store.read_tensor(act, pids[1], m, phase="prefill")[0]
        assert got.shape[0] == len(prompts[1]) and np.isnan(got[:BLOCK]).all()  # never computed, never "equal"
        np.testing.assert_allclose(got[BLOCK:], full[0][(m, "prefill")][BLOCK:], rtol=0, atol=2e-5, err_msg=m)
        np.testing.assert_allclose(store.read_tensor(act, pids[1], m, phase="decode")[:, 0],
                                   full[0][(m, "decode")], rtol=0, atol=2e-5, err_msg=m)
    base = capture_hf_module_run(store, path, prompts, [toks[0]] * 2, mods, dtype="float32")
    exp = capture_hf_module_run(store, path, prompts, [toks[0]] * 2, mods, dtype="bfloat16")
    r = compare_runs(store, baseline_run=base, expected_run=exp, actual_run=act, logits=False, kv=False,
                     comparators=["modules"])
    v = r.verdicts["modules"]
    assert r.passed, v.text  # the computed positions pass; the cached ones were left out, not judged equal
    n_mod = len(v.detail.modules) // 2
    assert v.detail.n_not_computed == 2 * BLOCK * n_mod
    assert f"{2 * BLOCK * n_mod} module positions not computed by the target" in v.text
    rows = store.sql(f"SELECT phase, not_computed, n_tokens FROM module_verdicts WHERE comparison_id = "
                     f"'{r.comparison_id}'").to_pylist()
    assert {(x["phase"], x["not_computed"]) for x in rows} == {("prefill", 2 * BLOCK), ("decode", 0)}
    assert {x["n_tokens"] for x in rows if x["phase"] == "prefill"} == {5 + 8}
    n_rows = store.sql(f"SELECT count(*) FROM module_metrics WHERE comparison_id = '{r.comparison_id}' AND phase = "
                       f"'prefill' AND position < {BLOCK}").column(0)[0].as_py()
    assert n_rows == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_a_fault_in_a_later_prefill_chunk_is_named_at_its_module(engine, hf32):
    from extractors.hf import load_hf_model
    from extractors.modules import collect_hf_modules
    from extractors.vllm_modules import collect_vllm_modules
    from metrics.modules import judge_modules
    from vllm import SamplingParams

    path, llm = engine
    prompts = _prompts(7, (40, 23, 35, 29))
    target = "model.layers.1.mlp.down_proj"
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=50, detokenize=False)

    def last_logprobs():
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    clean = [last_logprobs(), last_logprobs()]
    llm.collective_rpc(_install_later_chunk_scale, args=(target, 1.05))
    try:
        faulty = last_logprobs()
        llm.reset_prefix_cache()
        act, toks, names = collect_vllm_modules(llm, prompts, 4, batch_size=2)
    finally:
        calls = llm.collective_rpc(_remove_later_chunk_scale)[0]
    assert calls > 0

    def spread(a, b):
        return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys())
    # proven to change the output: the logprobs of the last prompt position (in a later chunk) moved
    assert spread(clean[0], faulty) > 10 * spread(clean[0], clean[1]) + 1e-4
    # and only from the second chunk on: each prompt's first chunk (up to 16 positions: a batched
    # request may get fewer) of the target module is untouched, every later position moved
    llm.reset_prefix_cache()
    ok, _, _ = collect_vllm_modules(llm, prompts, 4, target, batch_size=2)
    first_chunk = []
    for a, o in zip(act, ok):
        d = np.abs(a[(target, "prefill")] - o[(target, "prefill")]).max(axis=1)
        first_chunk.append(int(np.argmax(d > 0)))
        assert 0 < first_chunk[-1] <= CHUNK and d[:first_chunk[-1]].max() == 0 and d[first_chunk[-1]:].min() > 0
    base, order = collect_hf_modules(hf32, prompts, toks, names)
    exp, _ = collect_hf_modules(load_hf_model(path, "bfloat16"), prompts, toks, names)
    v = judge_modules([{k: (b[k], e[k], a[k]) for k in b} for b, e, a in zip(base, exp, act)], order,
                      prompt_lens=[len(p) for p in prompts])
    assert v.localisation["module"] == target and v.localisation["phase"] == "prefill", v.summary()
    assert v.localisation["layer"] == 1
    first = v.first_failing
    assert first.position >= first_chunk[int(first.token_prompt)]  # placed in a later chunk, where the fault acts
    assert all(m.passed for m in v.modules if m.phase == "prefill" and names.index(m.module) < names.index(target))


def test_auto_batches_fill_the_byte_budget_and_the_kv_cache_at_the_first_prompts_bytes_a_token():
    from extractors.vllm_modules import AUTO_BATCH_PROMPTS, _auto_batch

    assert _auto_batch([30, 40, 50], 1.0, 100, 16, 1000) == 2  # 30 + 40 fit 100 bytes, + 50 does not
    assert _auto_batch([30, 70, 1], 1.0, 100, 16, 1000) == 2  # exactly the budget fits
    assert _auto_batch([150, 10], 1.0, 100, 16, 1000) == 1  # one prompt over the budget still goes, alone
    assert _auto_batch([1] * 40, 1.0, 100, 16, 1000) == AUTO_BATCH_PROMPTS  # never more than a capture_vllm_run batch
    assert _auto_batch([10], 2.5, 100, 16, 1000) == 1
    # KV blocks: 33 tokens take 3 blocks of 16, 16 tokens 1; a cache of 7 blocks holds 3 + 3 + 1, not 3 + 3 + 3
    assert _auto_batch([33, 33, 16, 1], 0.0, 100, 16, 7) == 3
    assert _auto_batch([33, 33, 33], 0.0, 100, 16, 7) == 2
    assert _auto_batch([33, 33], 0.0, 100, 16, None) == 1  # the cache's size unknown: one at a time


@pytest.mark.parametrize("bad", ["Auto", 0, True, 2.0, None])
def test_a_bad_batch_size_is_refused_in_one_line_before_the_engine_is_asked_anything(bad):
    from extractors.vllm_modules import capture_vllm_module_run

    with pytest.raises(ValueError, match=r"^capture_vllm_module_run: batch_size must be an integer >= 1 or 'auto', "
                                         r"got " + re.escape(repr(bad)) + "$"):
        capture_vllm_module_run(None, None, "unused", [[1, 2, 3]], 2, batch_size=bad)


def test_a_config_that_sets_the_recorded_batches_is_refused_before_the_engine_is_asked_anything():
    from extractors.vllm_modules import capture_vllm_module_run

    with pytest.raises(ValueError, match=r"^capture_vllm_module_run: config must not set 'module_batches' "
                                         r"\(the capture records the batches it sends\)$"):
        capture_vllm_module_run(None, None, "unused", [[1, 2, 3]], 2, config={"module_batches": [1]})


@pytest.mark.vllm
@pytest.mark.slow
def test_auto_batches_store_what_a_prompt_at_a_time_stores_and_hold_the_byte_budget(engine, tmp_path, monkeypatch):
    import extractors.vllm_modules as vm
    from capturestore import Store

    path, llm = engine
    prompts, teacher = _prompts(7, (40, 23, 31, 19)), [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
    st = Store.open(tmp_path / "s")
    llm.reset_prefix_cache()
    alone = vm.capture_vllm_module_run(st, llm, path, prompts, None, teacher_tokens=teacher)
    batches, real = [], vm.collect_vllm_modules

    def counting(llm_, part, *a, **k):
        batches.append(len(part))
        return real(llm_, part, *a, **k)

    monkeypatch.setattr(vm, "collect_vllm_modules", counting)
    llm.reset_prefix_cache()
    llm.collective_rpc(watch_layout)
    try:
        auto = vm.capture_vllm_module_run(st, llm, path, prompts, None, teacher_tokens=teacher, batch_size="auto")
    finally:
        layout = llm.collective_rpc(unwatch_layout)[0]
    assert batches == [1, 3]  # the first prompt alone, the other three together (well inside 512 MiB)
    config = {r["run_id"]: json.loads(r["config"]) for r in st.runs().to_pylist()}
    assert config[auto]["module_batches"] == [1, 3] and config[auto]["batch_size"] == "auto"
    assert config[alone]["module_batches"] == [1, 1, 1, 1] and config[alone]["batch_size"] == 1
    cache = llm.llm_engine.vllm_config.cache_config
    assert config[auto]["auto_batch_limits"] == {
        "bytes": 512 << 20, "bytes_counted_times": 2, "max_prompts": 16, "kv_block_size": cache.block_size,
        "kv_blocks": cache.num_gpu_blocks} and cache.block_size >= 1 and cache.num_gpu_blocks >= 1
    assert "auto_batch_limits" not in config[alone]
    assert max(len(f) for f in layout) >= 2  # the engine did serve them in one forward
    caps = {r: st.captures(r).to_pylist() for r in (alone, auto)}
    pid = {r: {p["prompt_idx"]: p["prompt_id"] for p in st.prompts(r).to_pylist()} for r in (alone, auto)}
    names = sorted({c["array_name"] for c in caps[alone] if c["kind"] == "tensor"})
    assert len(names) == 2 * 38 and names == sorted({c["array_name"] for c in caps[auto] if c["kind"] == "tensor"})
    for i in range(4):
        assert pid[alone][i] == pid[auto][i]
        for n in names:
            module, phase = n.removeprefix("tensors/").rsplit("/", 1)
            a = st.read_tensor(alone, pid[alone][i], module, phase=phase)
            b = st.read_tensor(auto, pid[auto][i], module, phase=phase)
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-5, err_msg=f"prompt {i}, {n}")
    # the budget holds: at the first prompt's bytes a token (its 43 tokens: 40 + 3 teacher), counted
    # twice at TP 1 (records and their stitched copies), room for prompts 1 and 2 (26 + 34 tokens) and
    # not 3 with them; a byte less, prompt 1 alone and 2 with 3 (34 + 22)
    first = sum(c["nbytes"] for c in caps[auto] if c["kind"] == "tensor" and c["prompt_id"] == pid[auto][0])
    per_token = first / (40 + 3)
    for budget, want in ((2 * per_token * (26 + 34) + 2, [1, 2, 1]), (2 * per_token * (26 + 34) - 2, [1, 1, 2])):
        monkeypatch.setattr(vm, "AUTO_BATCH_BYTES", budget)
        batches.clear()
        llm.reset_prefix_cache()
        vm.capture_vllm_module_run(st, llm, path, prompts, None, teacher_tokens=teacher, batch_size="auto")
        assert batches == want, budget
