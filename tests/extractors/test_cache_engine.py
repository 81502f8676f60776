"""extractors.cache_engine: the reference paged engine. Its full-prefix forward is checked against
HF's plain forward (an oracle independent of this engine), its cache against its full prefix, and
every planted bug is proven to change the output before any harness is trusted to catch it."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from extractors.cache_engine import (
    BUGS,
    ContextOverflowError,
    LlamaWeights,
    PagedEngine,
)

BS = 16


@pytest.fixture(scope="module", params=["llama-mha", "llama-gqa"])
def weights(request, tiny_model):
    return request.param, tiny_model(request.param), LlamaWeights(tiny_model(request.param))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(4, 1024, n).tolist()


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_full_prefix_forward_equals_hf_plain_forward_logits_and_kv(weights):
    from extractors.hf import load_hf_model

    _, path, w = weights
    model = load_hf_model(path)
    seq = _prompt(40)
    logits, k, v = w.forward_full([seq, seq[:17]])
    with torch.no_grad():
        out = model(torch.tensor([seq]), use_cache=True)
    ref = out.logits[0].numpy()
    assert _rel(logits[0], ref) <= 1e-6
    assert _rel(logits[1], ref[:17]) <= 1e-6  # a padded row of the batch: its tail never read
    for layer in range(len(model.model.layers)):
        hk = out.past_key_values.layers[layer].keys[0].numpy()
        hv = out.past_key_values.layers[layer].values[0].numpy()
        assert _rel(k[0][layer], hk) <= 1e-6 and _rel(v[0][layer], hv) <= 1e-6
    assert k[0].shape == (w.n_layers, w.n_kv, 40, w.head_dim)


def test_cached_prefill_and_steps_equal_the_full_prefix_within_1e5(weights):
    _, _, w = weights
    e = PagedEngine(w, block_size=BS, num_blocks=32, max_context=128)
    seq = _prompt(45, seed=1)
    full = w.forward_full([seq])[0][0]
    hs, pl = e.prefill([seq[:30], seq[:13]], chunk_size=7)
    assert _rel(pl[0], full[:30]) <= 1e-5 and _rel(pl[1], full[:13]) <= 1e-5
    for p in range(30, 45):
        out = e.step([hs[0]], [seq[p]])
        assert _rel(out[0], full[p]) <= 1e-5
    k, v = e.kv(hs[0])
    fk, fv = w.forward_full([seq])[1:]
    assert _rel(k, fk[0]) <= 1e-5 and _rel(v, fv[0]) <= 1e-5


def test_the_engine_refuses_a_position_past_its_context():
    from extractors.models import tiny_model

    w = LlamaWeights(tiny_model("llama-gqa"))
    e = PagedEngine(w, block_size=BS, num_blocks=8, max_context=32)
    hs, _ = e.prefill([_prompt(31)])
    e.step(hs, [5])  # position 31: the last one
    with pytest.raises(ContextOverflowError, match="position 32"):
        e.step(hs, [6])


# --------------------------------------------------------------------- planted bugs change the output


def _probe(bug, w, plant: bool):
    """What the engine returns on the operations ``bug`` touches (arrays), with the bug planted or not."""
    e = PagedEngine(w, block_size=BS, num_blocks=32, max_context=64, bugs=(bug,) if plant else ())
    out = []
    if bug in ("stale_slot", None):
        a, _ = e.prefill([_prompt(40, 1)])
        e.step(a, [7])
        e.free(a)
        b, lg = e.prefill([_prompt(5, 2)])  # in the freed blocks
        out += [lg, e.step(b, [9])]
        e.reset()
    if bug in ("truncate_keeps_pos", None):
        a, _ = e.prefill([_prompt(20, 3)])
        e.step(a, [7])
        e.truncate(a[0], 12)
        out.append(e.step(a, [8]))
        e.reset()
    if bug in ("fork_no_cow", None):
        a, _ = e.prefill([_prompt(21, 4)])
        (b,) = e.fork(a[0], 1)
        e.step([a[0], b], [10, 11])
        out.append(e.step([a[0], b], [12, 12]))
        e.reset()
    if bug in ("compaction_shift", None):
        hs = [e.prefill([_prompt(n, 5 + n)])[0][0] for n in (9, 14, 22)]
        e.step(hs, [5, 6, 7])
        e.free([hs[0]])
        out.append(e.step(hs[1:], [8, 9]))
        e.reset()
    if bug in ("chunk_pos_off_by_one", None):
        out.append(e.prefill([_prompt(23, 6)], chunk_size=7)[1][0])
        e.reset()
    if bug in ("pad_read", None):
        hs, _ = e.prefill([_prompt(19, 7), _prompt(6, 8)])
        out.append(e.step(hs, [3, 4]))
        e.reset()
    if bug in ("context_off_by_one", None):
        hs, _ = e.prefill([_prompt(63, 9)])
        out.append(e.step(hs, [5]))
        try:
            out.append(e.step(hs, [6]))  # position 64 = max_context
        except ContextOverflowError:
            out.append(np.zeros((1, w.vocab), np.float32))
        e.reset()
    return [np.asarray(o) for o in out]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_bug_changes_the_output(bug):
    """Proven first: a planted bug that changed nothing would make 'caught' meaningless."""
    from extractors.models import tiny_model

    w = LlamaWeights(tiny_model("llama-gqa"))
    clean, buggy = _probe(bug, w, plant=False), _probe(bug, w, plant=True)
    diff = max(float(np.abs(c - b).max()) for c, b in zip(clean, buggy))
    assert diff > 1e-2, f"{bug}: the planted bug changed the output by only {diff:.2e}"


def test_unknown_bug_is_refused():
    from extractors.models import tiny_model

    with pytest.raises(ValueError, match="unknown bug"):
        PagedEngine(LlamaWeights(tiny_model("llama-gqa")), bugs=("nope",))
