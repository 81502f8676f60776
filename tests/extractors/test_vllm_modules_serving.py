"""vLLM module capture in a serving configuration: a chunked prefill is stitched back into the
prompt's ``[P, ...]`` (equal, FP32, to the same prompts captured without chunking), and a prefix-
cache hit is refused naming the right prompt and the prefix cache (never reported as computed).
The grouping rules themselves are checked on hand-made records (no engine)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from extractors.vllm_modules import _group


def _recs(spans, width=4):
    """Records of one module: a forward per span of positions, each row = its position."""
    return [("m", list(s), torch.tensor([[float(p)] * width for p in s])) for s in spans]


def test_prefill_chunks_are_stitched_in_position_order_and_decode_steps_follow():
    got = _group(_recs([range(16, 23), range(0, 16), [23], [24]]), 23, "here")
    assert got[("m", "prefill")][:, 0].tolist() == list(range(23))
    assert got[("m", "decode")][:, 0].tolist() == [23, 24]


@pytest.mark.parametrize("spans, says", [
    ([range(32, 40)], r"prefill starts at position 32 of a prompt of 40: positions 0..31 were served from the "
                      r"prefix cache, not computed \(build the engine with enable_prefix_caching=False\)"),
    ([range(0, 16), range(20, 40)], r"prefill chunks leave positions 16..19 uncovered"),
    ([range(0, 16)], r"the prefill chunks cover positions 0..15 of a prompt of 40"),
    ([range(30, 42)], r"mixes the prompt of 40 tokens with other positions"),
])
def test_a_prefill_that_is_not_the_whole_prompt_computed_here_is_refused_saying_why(spans, says):
    with pytest.raises(ValueError, match=says):
        _group(_recs(spans), 40, "here")


@pytest.mark.vllm
@pytest.mark.slow
def test_chunked_prefill_captures_equal_the_unchunked_and_a_prefix_hit_names_its_prompt():
    from extractors.models import tiny_model
    from extractors.vllm_modules import collect_vllm_modules
    from extractors.vllm_rpc import close_llm, make_llm

    path = tiny_model("llama-gqa")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 1000, size=n).tolist() for n in (40, 23)]
    llm = make_llm(path, dtype="float32", max_model_len=128, block_size=32, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=2)
    try:
        sched = llm.llm_engine.vllm_config.scheduler_config
        assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == 16  # chunks of 16, as asked
        chunked, toks, names = collect_vllm_modules(llm, prompts, 3)
        shared = rng.integers(4, 1000, size=32).tolist()  # a 32-token block both prompts share
        with pytest.raises(ValueError, match=r"prompt 1: .*positions 0\.\.31 were served from the prefix cache"):
            collect_vllm_modules(llm, [shared + [5, 6, 7], shared + [8, 9, 10, 11]], 2)
    finally:
        close_llm(llm)
    llm = make_llm(path, dtype="float32", max_model_len=128, block_size=32, enable_prefix_caching=False)
    try:
        whole, toks2, _ = collect_vllm_modules(llm, prompts, 3)
    finally:
        close_llm(llm)
    assert toks == toks2
    for c, w, p in zip(chunked, whole, prompts):
        assert set(c) == set(w) and c[(names[0], "prefill")].shape[0] == len(p)
        for k in w:
            np.testing.assert_allclose(c[k], w[k], rtol=0, atol=2e-5, err_msg=str(k))
