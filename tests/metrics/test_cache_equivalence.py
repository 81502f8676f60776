"""metrics.cache_equivalence: tokens and logits judged apart, ties, NaN, KV localisation, diagnosis."""
import numpy as np
import pytest

from metrics.cache_equivalence import (
    BATCH,
    BF16_FLOOR,
    CHUNK,
    LATE,
    STALE,
    SYSTEMATIC,
    diagnose,
    first_kv_difference,
    judge_request,
    relative_linf,
    tolerance,
)


def _logits(n=6, v=50, seed=0):
    return np.random.default_rng(seed).normal(0, 3, (n, v)).astype(np.float32)


def test_identical_logits_pass_with_zero_error():
    ref = _logits()
    j = judge_request(ref.copy(), ref, np.arange(10, 16), 1e-5)
    assert j.passed and j.first_diff is None and j.max_err == 0.0
    assert j.token_match.all() and j.positions.tolist() == list(range(10, 16))


def test_a_logit_error_beyond_tolerance_fails_at_its_position_with_tokens_still_equal():
    ref = _logits()
    cached = ref.copy()
    scale = np.abs(ref[3]).max()
    top = ref[3].argmax()
    low = ref[3].argmin()
    cached[3, low] += 1e-3 * scale  # the argmax unchanged: a logits-only failure
    j = judge_request(cached, ref, np.arange(6), 1e-5)
    assert not j.passed
    assert j.first_diff == 3 and j.first_logit_diff == 3 and j.first_token_diff is None
    assert j.max_err == pytest.approx(1e-3, rel=1e-3)
    assert j.cached_token[3] == top


def test_a_flipped_clear_winner_is_a_token_failure_but_a_near_tie_is_not():
    ref = np.zeros((2, 4), np.float32)
    ref[:, 0], ref[:, 1] = 10.0, 9.0  # gap 1.0 / 10 = 0.1 relative: a clear winner
    cached = ref.copy()
    cached[0, 1] = 10.5  # flips a clear winner
    j = judge_request(cached, ref, [0, 1], 1e-5)
    assert j.first_token_diff == 0 and not j.token_ok[0]
    tie = np.zeros((1, 4), np.float32)
    tie[0, 0], tie[0, 1] = 10.0, 10.0 - 5e-6  # a tie within 1e-5 relative
    c2 = tie.copy()
    c2[0, 1] = 10.0 + 5e-6
    j2 = judge_request(c2, tie, [0], 1e-5)
    assert not j2.token_match[0] and j2.token_ok[0] and j2.passed


def test_non_finite_cached_logits_fail_never_pass_quietly():
    ref = _logits(2)
    cached = ref.copy()
    cached[1, 5] = np.nan
    j = judge_request(cached, ref, [0, 1], 1e-5)
    assert not j.passed and j.first_diff == 1 and np.isnan(j.logit_err[1]) and not j.token_ok[1]


def test_no_positions_is_no_pass():
    j = judge_request(np.zeros((0, 4)), np.zeros((0, 4)), [], 1e-5)
    assert not j.passed


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="cached logits"):
        judge_request(np.zeros((2, 4)), np.zeros((3, 4)), [0, 1], 1e-5)


def test_tolerance_is_the_dtype_floor_or_four_times_the_measured_noise():
    assert tolerance("float32", 0.0) == 1e-5
    assert tolerance("float32", 1e-5) == pytest.approx(4e-5)
    assert tolerance("bfloat16", 0.0) == BF16_FLOOR
    assert tolerance("bfloat16", 0.01) == pytest.approx(0.04)


def test_relative_linf_is_max_abs_difference_over_max_abs_reference():
    a = np.array([[1.0, 2.0, 3.0]])
    b = np.array([[1.0, 2.5, -4.0]])
    assert relative_linf(a, b)[0] == pytest.approx(7.0 / 4.0)


def test_first_kv_difference_names_the_first_layer_and_position_and_skips_nan():
    rng = np.random.default_rng(1)
    k = rng.normal(size=(3, 2, 8, 4))
    v = rng.normal(size=(3, 2, 8, 4))
    assert first_kv_difference(k, v, k.copy(), v.copy(), 1e-5) is None
    k2 = k.copy()
    k2[1, 0, 5, 2] += 1.0
    k2[2, 1, 2, 0] += 1.0
    layer, pos, err = first_kv_difference(k2, v, k, v, 1e-5)
    assert (layer, pos) == (1, 5) and err > 0.1
    held = k.copy()
    held[:, :, :3] = np.nan  # a sliding window holds nothing there, in both
    ref = k.copy()
    ref[:, :, :3] = np.nan
    assert first_kv_difference(held, v, ref, v, 1e-5) is None
    lost = k.copy()
    lost[0, :, 6] = np.nan  # the engine lost a position the reference holds
    assert first_kv_difference(lost, v, k, v, 1e-5)[:2] == (0, 6)


@pytest.mark.parametrize("kind,baseline,expected", [
    ("reuse", "clean", STALE), ("fork", "clean", STALE), ("cancel", "clean", STALE),
    ("batch", "clean", BATCH), ("compaction", "clean", BATCH), ("invariance", "clean", BATCH),
    ("chunk", "clean", CHUNK), ("offset", "clean", CHUNK), ("truncate", "clean", LATE), ("single", "clean", LATE),
    ("reuse", "from_start", SYSTEMATIC), ("batch", "late", LATE),
])
def test_diagnosis_follows_the_history_kind_unless_the_baseline_fails(kind, baseline, expected):
    assert diagnose(kind, baseline) == expected


def test_a_failure_after_freed_blocks_is_stale_when_a_request_in_freed_blocks_fails_too():
    assert diagnose("compaction", "clean", stale_seen=True) == STALE
    assert diagnose("truncate", "clean", stale_seen=True) == STALE
    assert diagnose("compaction", "clean", stale_seen=False) == BATCH
    assert diagnose("chunk", "clean", stale_seen=True) == CHUNK
