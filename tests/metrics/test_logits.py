"""Logit validation on synthetic logits: per-token checks by hand, and the teacher-forcing loop
driven by a fake greedy engine whose every call is recorded."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metrics.logits import (
    ValidationStatus,
    logit_validation,
    remove_shift,
    topk_error_map,
    ulp,
    validate_logits,
    validate_token_logits,
)

V, T = 64, 6
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25]]


def make_expected(seed=0, batch=1):
    """[T, batch, V] logits with a clear greedy winner (margin >= 1) at every token."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, batch, V)) * 2.0
    for t in range(T):
        for b in range(batch):
            w = rng.integers(V)
            x[t, b, w] = x[t, b].max() + 1.0 + rng.random()
    return x.astype(np.float32)


class FakeEngine:
    """Greedy engine: at generation index g (prefix == teacher) it emits ``target[g]``; once its
    own token left the teacher path it emits noise. Records inputs; keeps a KV whose value at a
    position is the token id fed there."""

    def __init__(self, target, teacher, prompts, extra=0):
        self.target, self.teacher, self.prompts = target, teacher, [list(p) for p in prompts]
        self.calls, self.kv_calls, self.extra = [], [], extra
        self.rng = np.random.default_rng(99)

    def __call__(self, ids):
        self.calls.append([list(r) for r in ids])
        B = len(ids)
        start = len(ids[0]) - len(self.prompts[0])
        n = T - start + self.extra
        out = np.empty((n, B, V), np.float32)
        self.seqs = [list(r) for r in ids]
        on_path = [True] * B
        for j in range(n):
            g = start + j
            for b in range(B):
                if on_path[b] and g < T:
                    out[j, b] = self.target[g, b]
                else:
                    out[j, b] = self.rng.normal(size=V)
            for b in range(B):
                tok = int(np.argmax(out[j, b]))
                self.seqs[b].append(tok)
                if g >= T or tok != self.teacher[b, g]:
                    on_path[b] = False
        self.n_last = n
        return out

    def kv(self, seq_len):
        self.kv_calls.append(seq_len)
        B = len(self.seqs)
        k = np.full((B, 1, seq_len, 2), -1.0, np.float32)  # -1: never written
        for b, s in enumerate(self.seqs):
            fed = s[:-1]  # the last sampled token is never fed back
            m = min(len(fed), seq_len)
            k[b, 0, :m, :] = np.asarray(fed[:m], np.float32)[:, None]
        return {"layers.0": (k, k * 10)}


def teacher_of(x):
    return np.argmax(x, axis=-1).T


# ----------------------------------------------------------------------------- per token

def test_ulp_of_bf16():
    assert ulp(10.0) == 2 ** (3 - 7)
    assert ulp(1.0) == 2**-7
    assert ulp(-0.75) == 2 ** (-1 - 7)
    assert ulp(0.0) == 0.0
    assert math.isnan(ulp(float("inf")))
    np.testing.assert_array_equal(ulp(np.array([2.0, 3.0])), [2**-6, 2**-6])


def test_remove_shift_matches_lstsq_including_constant_expected():
    rng = np.random.default_rng(0)
    e = rng.normal(size=100)
    a = 1.1 * e - 3.0 + rng.normal(size=100) * 0.01
    A = np.vstack([e, np.ones_like(e)]).T
    want_slope, want_shift = np.linalg.lstsq(A, a, rcond=None)[0]
    shift, slope = remove_shift(e, a)
    assert shift == pytest.approx(want_shift, rel=1e-10) and slope == pytest.approx(want_slope, rel=1e-10)
    c = np.full(10, 2.0)
    want = np.linalg.lstsq(np.vstack([c, np.ones(10)]).T, a[:10], rcond=None)[0]
    got = remove_shift(c, a[:10])
    assert got[0] == pytest.approx(want[1], rel=1e-10) and got[1] == pytest.approx(want[0], rel=1e-10)


def test_topk_error_by_hand():
    e = np.array([10.0, 9.0, 8.0, 1.0, 0.5, 0.0])
    a = e.copy()
    a[2] += 0.2  # third ranked token
    a[5] += 1.0  # outside the top-3
    got = topk_error_map(e, a, {3: (1e-5, 0.01), "all": (1e-5, 0.05)})
    assert got[3] == pytest.approx((0.2 - 1e-5) / 10.0)
    assert got["all"] == pytest.approx((1.0 - 1e-5) / 10.0)


def test_vocab_smaller_than_k_uses_whole_vocab():
    e = np.linspace(-1, 1, 20)
    a = e + 0.01
    r = validate_token_logits(e, a + np.sin(np.arange(20)) * 1e-3)
    assert r.error_map[50] == r.error_map[1000] == r.error_map["all"]


def test_minus_inf_positions_dropped_and_tokens_reported_in_original_ids():
    e = np.array([1.0, -np.inf, 3.0, -np.inf, 2.0])
    a = np.array([1.0, 5.0, 3.0, -np.inf, 2.0])  # -inf in the reference (index 1) or in both (3): dropped
    r = validate_token_logits(e, a)
    assert r.num_removed == 2 and r.num_actual_masked == 0
    assert r.expected_token == 2 and r.actual_token == 2 and r.passed


def test_actual_masking_tokens_the_reference_has_fails_instead_of_being_dropped():
    # An engine that sets the reference's 5 most likely tokens to -inf (upstream drops them, and passes)
    rng = np.random.default_rng(3)
    e = rng.normal(size=V)
    a = e.copy()
    top5 = np.argsort(e)[-5:]
    a[top5] = -np.inf
    r = validate_token_logits(e, a, baseline=e)
    assert r.num_actual_masked == 5 and not r.passed
    assert all(math.isnan(err) for err in r.error_map.values())
    one = e.copy()
    one[np.argmin(e)] = -np.inf  # even the least likely token: the engine has no value where the reference has one
    assert not validate_token_logits(e, one).passed


def test_near_tie_flip_within_one_ulp_is_acceptable_and_beyond_one_ulp_is_not():
    e = np.zeros(V)
    e[3], e[7] = 10.0, 9.98
    a = e.copy()
    a[3], a[7] = 9.98, 10.0  # greedy flip, gap 0.02 < ulp(10) = 0.0625
    r = validate_token_logits(e, a, tol_map={"all": (1e-5, 0.05)})
    assert r.divergence and r.divergence_in_bounds and r.status is ValidationStatus.ACCEPTABLE_DIVERGENCE and r.passed
    assert r.divergence_threshold == 0.0625
    a[7] = 10.0 + 0.05  # gap 0.07: just beyond one ulp (0.0625)
    r = validate_token_logits(e, a, tol_map={"all": (1e-5, 0.05)})
    assert r.divergence_difference > 0.0625 and r.status is ValidationStatus.DIVERGED and not r.passed
    a[7] = 10.0 + 0.13  # gap 0.15
    r = validate_token_logits(e, a, tol_map={"all": (1e-5, 0.05)})
    assert r.status is ValidationStatus.DIVERGED and not r.passed
    # a fixed tolerance overrides the ULP rule
    r = validate_token_logits(e, a, tol_map={"all": (1e-5, 0.05)}, divergence_difference_tol=0.2)
    assert r.status is ValidationStatus.ACCEPTABLE_DIVERGENCE and r.divergence_threshold == 0.2


def test_log_softmax_validates_like_raw_logits():
    torch = pytest.importorskip("torch")
    x = make_expected(3)[:, 0]
    rng = np.random.default_rng(1)
    noisy = x + rng.normal(size=x.shape).astype(np.float32) * 1e-3
    lsm = torch.log_softmax(torch.tensor(noisy, dtype=torch.float64), dim=-1).numpy()
    for t in range(T):
        raw = validate_token_logits(x[t], noisy[t])
        ls = validate_token_logits(x[t], lsm[t])
        for k in raw.error_map:
            assert ls.error_map[k] == pytest.approx(raw.error_map[k], abs=1e-9)
        assert ls.status == raw.status and ls.passed == raw.passed
        assert ls.shift < -1.0  # the log-normaliser was removed


# ----------------------------------------------------------------------------- the loop

def test_exact_match_passes_with_a_plain_bool_and_one_call():
    x = make_expected(0)
    eng = FakeEngine(x, teacher_of(x), PROMPTS[:1])
    passed = logit_validation([list(PROMPTS[0])], eng, x)
    assert passed is True
    assert len(eng.calls) == 1


def test_constant_shift_per_token_passes():
    x = make_expected(1)
    shifted = x + np.arange(T, dtype=np.float32)[:, None, None] * 3.5 + 7.0
    eng = FakeEngine(shifted, teacher_of(x), PROMPTS[:1])
    r = validate_logits([list(PROMPTS[0])], eng, x)
    assert r.passed
    assert [res.shift for res in r.results[0]] == pytest.approx([7.0 + 3.5 * t for t in range(T)], abs=1e-4)


def test_top5_break_fails_at_that_token_only():
    x = make_expected(2)
    broken = x.copy()
    order = np.argsort(-x[3, 0])
    broken[3, 0, order[2]] -= 0.5  # third-ranked logit: top-5 broken, greedy unchanged
    eng = FakeEngine(broken, teacher_of(x), PROMPTS[:1])
    r = validate_logits([list(PROMPTS[0])], eng, x)
    assert not r.passed
    statuses = [res.status for res in r.results[0]]
    assert statuses[3] is ValidationStatus.TOPK_ERRORS
    assert all(s is ValidationStatus.MATCHED for i, s in enumerate(statuses) if i != 3)
    # shift is fitted over the whole vocab, so recompute it to check the error by hand
    e, a = x[3, 0].astype(np.float64), broken[3, 0].astype(np.float64)
    shift, _ = remove_shift(e, a)
    top5 = order[:5]
    want = np.max((np.abs(a[top5] - shift - e[top5]) - 1e-5) / np.max(np.abs(e[top5])))
    assert r.results[0][3].error_map[5] == pytest.approx(want, rel=1e-6)
    assert len(eng.calls) == 1


def test_near_tie_greedy_flip_is_acceptable_and_loop_refeeds_teacher_tokens():
    x = make_expected(4)
    teacher = teacher_of(x)
    tgt = x.copy()
    w = teacher[0, 2]
    runner = np.argsort(-x[2, 0])[1]
    x[2, 0, w], x[2, 0, runner] = 10.0, 9.98
    tgt[2, 0, w], tgt[2, 0, runner] = 9.98, 10.0
    tgt[2, 0, np.argsort(-tgt[2, 0])[2:]] = np.minimum(tgt[2, 0, np.argsort(-tgt[2, 0])[2:]], 9.0)
    x[2, 0] = np.where(np.isin(np.arange(V), [w, runner]), x[2, 0], tgt[2, 0])
    teacher = teacher_of(x)
    eng = FakeEngine(tgt, teacher, PROMPTS[:1])
    r = validate_logits([list(PROMPTS[0])], eng, x, tol_map={"all": (1e-5, 0.05)})
    assert r.results[0][2].status is ValidationStatus.ACCEPTABLE_DIVERGENCE
    assert r.passed
    assert eng.calls[1] == [PROMPTS[0] + [int(t) for t in teacher[0, :3]]]
    assert len(r.results[0]) == T


def test_hard_divergence_fails_and_resumes_after_refeeding():
    x = make_expected(5, batch=2)
    teacher = teacher_of(x)
    tgt = x.copy()
    wrong = (teacher[1, 2] + 1) % V
    tgt[2, 1, wrong] = x[2, 1].max() + 2.0  # row 1 diverges hard at generation index 2
    eng = FakeEngine(tgt, teacher, PROMPTS)
    ids = [list(p) for p in PROMPTS]
    passed, results = logit_validation(ids, eng, x, baseline_logits=x)
    assert passed is False
    assert ids == PROMPTS  # the caller's lists are not modified
    r12 = results[1][2]
    # the wrong token's logit jumped by > 2, which is also a top-k ("all") error
    assert r12.status is ValidationStatus.DIVERGED_WITH_TOPK_ERRORS and not r12.divergence_in_bounds
    assert r12.divergence_difference > 1.0 and r12.actual_token == wrong
    assert all(res.passed for i, res in enumerate(results[1]) if i != 2)
    assert len(eng.calls) == 2
    assert eng.calls[0] == PROMPTS
    # both rows re-fed with their own teacher tokens up to and including the divergent one
    assert eng.calls[1] == [PROMPTS[b] + [int(t) for t in teacher[b, :3]] for b in range(2)]
    assert [len(r) for r in results] == [T, T]
    assert [res.gen_idx for res in results[0]] == list(range(T))


def test_surplus_tokens_from_generate_fn_are_ignored():
    x = make_expected(6)
    eng = FakeEngine(x, teacher_of(x), PROMPTS[:1], extra=4)
    r = validate_logits([list(PROMPTS[0])], eng, x)
    assert r.passed and len(r.results[0]) == T and r.calls[0]["returned"] == T + 4


def test_nan_logits_fail_and_stop_the_loop():
    x = make_expected(7)
    tgt = x.copy()
    tgt[1, 0, 5] = np.nan
    eng = FakeEngine(tgt, teacher_of(x), PROMPTS[:1])
    r = validate_logits([list(PROMPTS[0])], eng, x)
    assert not r.passed and len(eng.calls) == 1 and not r.results[0][1].passed


def test_three_way_metrics_by_hand():
    x = make_expected(8)
    base = x.astype(np.float64)
    exp = (x + 0.01).astype(np.float32)
    tgt = (x + 0.02 * np.sign(x)).astype(np.float32)
    eng = FakeEngine(tgt, teacher_of(x), PROMPTS[:1])
    passed, results = logit_validation([list(PROMPTS[0])], eng, exp, baseline_logits=base)
    m = results[0][0].three_way
    # expected = baseline + 0.01 everywhere: rel L-inf = 0.01 / max|baseline|
    assert m.base_linf == pytest.approx(0.01 / np.max(np.abs(x[0, 0])), rel=1e-4)
    assert results[0][0]["three_way_metrics"]["bc"] == m.bc
    assert m.linf_ratio == m.tgt_linf / m.base_linf
    assert m.base_errors.dtype == np.float32 and m.base_errors.shape == (V,)


def test_kv_merge_takes_only_teacher_positions_and_passes_written_length():
    x = make_expected(9, batch=2)
    teacher = teacher_of(x)
    tgt = x.copy()
    wrong = (teacher[0, 3] + 1) % V
    tgt[3, 0, wrong] = x[3, 0].max() + 2.0  # row 0 diverges at generation index 3
    eng = FakeEngine(tgt, teacher, PROMPTS)
    passed, results, merged = logit_validation([list(p) for p in PROMPTS], eng, x, kv_extract_fn=eng.kv)
    assert passed is False and len(eng.calls) == 2
    # call 1: inputs 3 and 5 long, 6 tokens back -> longest row wrote 5 + 6 - 1 positions
    assert eng.kv_calls[0] == 5 + T - 1
    assert eng.kv_calls[1] == 5 + 4 + (T - 4) - 1
    k, v = merged["layers.0"]
    assert k.shape == (2, 1, 5 + T, 2)
    for b in range(2):
        want = PROMPTS[b] + [int(t) for t in teacher[b]]
        got = k[b, 0, :, 0]
        n_written = len(PROMPTS[b]) + T - 1  # the last teacher token is never fed
        np.testing.assert_array_equal(got[:n_written], np.asarray(want[:n_written], np.float32))
        assert np.isnan(got[n_written:]).all()
        np.testing.assert_array_equal(v[b, 0, :n_written, 0], got[:n_written] * 10)


def test_torch_generate_fn_and_client_sampled_tokens():
    torch = pytest.importorskip("torch")
    x = make_expected(10)
    teacher = teacher_of(x)

    def gen(ids):  # returns (logits, sequences [batch, n_new]) as a sampling client would
        start = len(ids[0]) - len(PROMPTS[0])
        logits = torch.tensor(x[start:]).to(torch.bfloat16)
        seqs = torch.tensor(teacher[:, start:])
        return logits, seqs

    r = validate_logits([list(PROMPTS[0])], gen, torch.tensor(x))
    assert r.passed and len(r.results[0]) == T and len(r.calls) == 1
    assert all(res.actual_token == teacher[0, i] for i, res in enumerate(r.results[0]))


def test_generate_fn_returning_nothing_raises_instead_of_looping():
    x = make_expected(11)
    with pytest.raises(RuntimeError, match="no tokens"):
        validate_logits([list(PROMPTS[0])], lambda ids: np.zeros((0, 1, V), np.float32), x)


def test_loop_with_log_softmax_target_validates_like_raw_logits():
    """The vLLM helper returns full-vocab log-softmax (prompt/sample logprobs), HF raw logits."""
    torch = pytest.importorskip("torch")
    x = make_expected(12, batch=2)
    noisy = x + np.random.default_rng(3).normal(size=x.shape).astype(np.float32) * 1e-3
    lsm = torch.log_softmax(torch.tensor(noisy), dim=-1)
    teacher = teacher_of(x)
    raw = validate_logits([list(p) for p in PROMPTS], FakeEngine(noisy, teacher, PROMPTS), x)
    ls = validate_logits([list(p) for p in PROMPTS], FakeEngine(lsm.numpy(), teacher, PROMPTS), x)
    assert raw.passed and ls.passed
    for b in range(2):
        for r1, r2 in zip(raw.results[b], ls.results[b]):
            assert r1.status == r2.status
            assert r2.error_map["all"] == pytest.approx(r1.error_map["all"], abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 300), shift=st.floats(-50, 50), seed=st.integers(0, 2**31))
def test_hypothesis_shift_is_absorbed_and_small_vocab_never_crashes(vocab, shift, seed):
    rng = np.random.default_rng(seed)
    e = rng.normal(size=vocab) * 3
    e[rng.integers(vocab)] += 4.0  # a clear greedy token
    r = validate_token_logits(e, e + shift)
    assert r.passed and r.status is ValidationStatus.MATCHED
    assert r.shift == pytest.approx(shift, abs=1e-9 * max(1, abs(shift)))
    for err in r.error_map.values():
        assert err <= 1e-9


def test_kv_positions_a_short_snapshot_missed_come_from_the_next_call():
    x = make_expected(13)
    teacher = teacher_of(x)
    tgt = x.copy()
    tgt[2, 0, (teacher[0, 2] + 1) % V] = x[2, 0].max() + 2.0  # diverge at generation index 2
    eng = FakeEngine(tgt, teacher, PROMPTS[:1])
    calls = []

    def short_first(seq_len):
        snap = eng.kv(seq_len)
        calls.append(seq_len)
        if len(calls) == 1:  # first snapshot holds only 2 positions
            return {n: (k[:, :, :2], v[:, :, :2]) for n, (k, v) in snap.items()}
        return snap

    _, _, merged = logit_validation([list(PROMPTS[0])], eng, x, kv_extract_fn=short_first)
    k = merged["layers.0"][0][0, 0, :, 0]
    want = PROMPTS[0] + [int(t) for t in teacher[0]]
    n_written = len(PROMPTS[0]) + T - 1
    np.testing.assert_array_equal(k[:n_written], np.asarray(want[:n_written], np.float32))



@pytest.mark.parametrize("where", ["actual", "expected"])
def test_a_positive_infinity_fails_the_token_without_a_floating_point_warning(where):
    # inf - inf in the least-squares shift raised "invalid value encountered in subtract" (an
    # error under this suite's warnings-as-errors, a stray multi-line warning at the CLI)
    e = np.array([1.0, 4.0, 2.0, 0.5])
    arrays = {"expected": e.copy(), "actual": e + 0.001}
    arrays[where][2] = np.inf
    r = validate_token_logits(arrays["expected"], arrays["actual"], baseline=e - 0.001)
    assert r.passed is False and r.status != ValidationStatus.MATCHED
