"""The pooled verdict's fused kernel (``metrics._fused.pooled_verdict_numbers``, taken by
``metrics.verdict._tensor_numbers`` and ``ModuleJudge``) against the numpy path it replaces
(``_tensor_numbers_numpy``), to the last bit: every number of the verdict on hypothesis-drawn
chunks of absolute errors (one to many chunks of different widths and row counts, runs longer
than numpy's 128-value summation blocks and not a multiple of 8, bf16 rounding errors, ties,
zeros, subnormals, values near float32's largest), and the two numpy rules it replays (the
pairwise summation of ``np.mean``, ``np.quantile``'s interpolation) on their own. The checks
that gate the kernel refuse a kernel one ulp off."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrics.verdict as verdict
from metrics.verdict import KVVerdictConfig, _tensor_numbers, _tensor_numbers_numpy

pytest.importorskip("numba")
from metrics import _fused  # noqa: E402 - after the importorskip

WIDTHS = (1, 3, 7, 8, 9, 64, 100, 127, 128, 129, 200, 1000, 4099)
KINDS = ("normal", "bf16", "ties", "zeros", "subnormal", "huge", "same")


def _errors(rng, kind, shape, scale):
    """Absolute errors (float32 >= +0) of one kind."""
    if kind == "bf16":  # what |bf16(x) - x| looks like: a few ulps of bf16 at each magnitude
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        return np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float32) - x)
    if kind == "ties":  # few distinct values: equal order statistics, equal bins
        return (rng.integers(0, 4, shape) * np.float32(scale)).astype(np.float32)
    if kind == "zeros":  # mostly exact: zero errors, a flat range in some pools
        x = np.abs(rng.standard_normal(shape) * scale).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0
        return x
    if kind == "subnormal":  # a range of subnormals: bins / width overflows
        return (rng.integers(0, 50, shape) * np.float32(1e-44)).astype(np.float32)
    if kind == "huge":  # squares far beyond float32, still exact in float64
        return (np.abs(rng.standard_normal(shape)) * 1e37 * scale).clip(0, 3e38).astype(np.float32)
    return np.abs(rng.standard_normal(shape) * scale).astype(np.float32)


@st.composite
def _pools(draw, max_chunks=6):
    """(base_chunks, tgt_chunks): one prompt x row per chunk, as the verdicts pool them."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    one_width = draw(st.booleans())
    width = draw(st.sampled_from(WIDTHS))
    kind = draw(st.sampled_from(KINDS))
    base, tgt = [], []
    for _ in range(draw(st.integers(1, max_chunks))):
        w = width if one_width else draw(st.sampled_from(WIDTHS))
        rows = draw(st.integers(0 if draw(st.integers(0, 9)) == 0 else 1, 2 if w > 1000 else 40))
        shape = (rows, w) if w % 2 or not draw(st.booleans()) else (rows, 2, w // 2)
        b = _errors(rng, kind if kind != "same" else "normal", shape, draw(st.sampled_from([1e-3, 1.0])))
        if kind == "same":  # a target exactly as far off as BF16: sigma-ratio 1, one range
            t = b.copy()
        elif draw(st.integers(0, 9)) == 0:  # an exact target: all its errors zero
            t = np.zeros(shape, np.float32)
        else:
            t = _errors(rng, kind, shape, draw(st.sampled_from([5e-4, 1e-3, 1.0, 30.0])))
        base.append(b)
        tgt.append(t)
    return base, tgt



@settings(max_examples=400, deadline=None)
@given(pool=_pools(), q=st.sampled_from([0.75, 0.0, 0.5, 0.99, 1.0]), margin=st.sampled_from([0.02, 0.005]),
       bins=st.sampled_from([100, 7]))
def test_fused_verdict_numbers_equal_the_numpy_path(pool, q, margin, bins):
    base, tgt = pool
    cfg = KVVerdictConfig(bc_noise_margin=margin, linf_quantile=q, bins=bins)
    got = verdict.fused_tensor_numbers(base, tgt, cfg)
    want = _tensor_numbers_numpy(base, tgt, cfg)
    if want.n_values == 0:  # nothing to judge: left to numpy
        assert got is None
        return
    assert got is not None  # every value finite and >= 0: the kernel ran
    assert repr(got) == repr(want)  # repr: every float to the last bit, NaN too
    assert repr(_tensor_numbers(base, tgt, cfg)) == repr(want)


@settings(max_examples=30, deadline=None)
@given(pool=_pools(max_chunks=1), n_chunks=st.sampled_from([65, 70, 130, 300]))
def test_more_chunks_than_a_compiled_tuple_equal_the_numpy_path(pool, n_chunks):
    """Beyond 64 chunks (prompts) runs of one width are joined; the chunks' own rows still split
    the noise halves."""
    (b,), (t,) = pool
    rng = np.random.default_rng(n_chunks)
    base, tgt = [], []
    for _ in range(n_chunks):
        rows = int(rng.integers(1, 4))
        idx = rng.integers(0, max(1, b.shape[0]), rows)
        base.append(b[idx] if b.shape[0] else b)
        tgt.append(t[idx] if t.shape[0] else t)
    cfg = KVVerdictConfig()
    want = _tensor_numbers_numpy(base, tgt, cfg)
    got = verdict.fused_tensor_numbers(base, tgt, cfg)
    assert (got is None) == (want.n_values == 0)
    if got is not None:
        assert repr(got) == repr(want)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pools=st.lists(_pools(), min_size=1, max_size=12), nan_at=st.integers(-1, 11),
       threads=st.sampled_from(["1", "2", "5"]))
def test_pools_judged_on_threads_equal_each_pool_judged_alone(monkeypatch, pools, nan_at, threads):
    """fused_tensor_numbers_many (ModuleJudge.verdict's pass over every module and phase, on the
    kernel's threads) gives each pool what fused_tensor_numbers gives it alone, in order; a pool
    holding a NaN gets None there as alone."""
    if 0 <= nan_at < len(pools) and pools[nan_at][1][0].size:
        pools[nan_at][1][0].reshape(-1)[0] = np.nan
    monkeypatch.setenv("CAPTURESTORE_METRICS_THREADS", threads)
    cfg = KVVerdictConfig()
    got = verdict.fused_tensor_numbers_many(pools, cfg)
    want = [verdict.fused_tensor_numbers(b, t, cfg) for b, t in pools]
    assert [repr(g) for g in got] == [repr(w) for w in want]
    if 0 <= nan_at < len(pools) and pools[nan_at][1][0].size:
        assert got[nan_at] is None


def test_chunks_of_alternating_widths_beyond_a_compiled_tuple_are_left_to_numpy():
    rng = np.random.default_rng(3)
    base = [np.abs(rng.standard_normal((2, 3 + i % 2))).astype(np.float32) for i in range(200)]
    assert _fused.pooled_verdict_numbers(base, base, 100, 0.75) is None
    assert repr(_tensor_numbers(base, base, KVVerdictConfig())) == repr(
        _tensor_numbers_numpy(base, base, KVVerdictConfig()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1e-3, -0.0])
def test_a_value_not_finite_or_below_zero_leaves_the_tensor_to_numpy(bad):
    rng = np.random.default_rng(1)
    base = [np.abs(rng.standard_normal((5, 16))).astype(np.float32) for _ in range(3)]
    tgt = [x * 1.1 for x in base]
    assert _fused.pooled_verdict_numbers(base, tgt, 100, 0.75) is not None
    tgt[2][4, 15] = bad
    assert _fused.pooled_verdict_numbers(base, tgt, 100, 0.75) is None
    assert repr(_tensor_numbers(base, tgt, KVVerdictConfig())) == repr(
        _tensor_numbers_numpy(base, tgt, KVVerdictConfig()))


def test_chunks_the_kernel_does_not_read_are_left_to_numpy():
    b = np.ones((4, 8), np.float32)
    assert _fused.pooled_verdict_numbers([b.astype(np.float64)], [b.astype(np.float64)], 100, 0.75) is None
    assert _fused.pooled_verdict_numbers([b], [b.reshape(8, 4)], 100, 0.75) is None  # shapes differ
    assert _fused.pooled_verdict_numbers([b], [b, b], 100, 0.75) is None  # chunk counts differ
    assert _fused.pooled_verdict_numbers([b[:0]], [b[:0]], 100, 0.75) is None  # nothing to judge
    got = _fused.pooled_verdict_numbers([b[:, ::2], b.T], [b[:, 1::2], b.T], 100, 0.75)  # strided views
    assert got is not None and got["n"] == 16 + 32


# ---- the two numpy rules the kernel replays, on their own ----

@st.composite
def _samples(draw, max_size=5000):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.one_of(st.integers(1, 300), st.integers(1, max_size)))
    kind = draw(st.sampled_from(KINDS + ("binades",)))
    if kind == "binades":  # any other order of additions shows in the last bits
        return (rng.random(n) * np.exp2(rng.integers(-40, 40, n))).astype(np.float32)
    return _errors(rng, kind if kind != "same" else "normal", (n,), draw(st.sampled_from([1e-3, 1.0])))


@settings(max_examples=300, deadline=None)
@given(x=_samples(), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_the_kernel_sums_squares_as_np_mean_does(x, cuts):
    """Over the values of several parts read as one sequence, in numpy's pairwise order."""
    sq = x.astype(np.float64) ** 2
    parts = tuple(np.split(x, sorted(c % (x.size + 1) for c in cuts)))
    k = next(p for p in _fused.POOL_PARTS if p >= len(parts))
    parts += (_fused._EMPTY_PART,) * (k - len(parts))
    got = _fused._pw_sum_parts(parts, len(parts), x.size, True)
    assert got == np.add.reduce(sq) and got / x.size == np.mean(sq)
    assert _fused._pw_sum(sq) == sq.reshape(1, -1).sum(axis=1)[0]  # how metrics.bc sums sqrt(p q)


@settings(max_examples=300, deadline=None)
@given(x=_samples(), cuts=st.lists(st.integers(0, 5000), max_size=6), pieces=st.lists(st.integers(0, 5000), max_size=8))
def test_a_sum_fed_in_pieces_is_the_sum_of_its_parts(x, cuts, pieces):
    """_pw_feed, as the pooled kernel's first pass feeds it: each part in pieces that end at
    arbitrary offsets (a run that does not fit in a piece waits for the next), the part's end
    final: np.add.reduce's bits, as _pw_sum_parts over whole parts."""
    sq = x.astype(np.float64) ** 2
    lens, nruns, sums, buf, st_ = _fused._pw_state(x.size)
    for part in np.split(x, sorted(c % (x.size + 1) for c in cuts)):
        fed = 0
        for end in sorted(p % (part.size + 1) for p in pieces):
            fed = _fused._pw_feed(part, fed, max(end, fed), False, lens, nruns, sums, buf, st_, True)
        _fused._pw_feed(part, fed, part.size, True, lens, nruns, sums, buf, st_, True)
    assert _fused._pw_total(x.size, sums) == np.add.reduce(sq)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), width=st.sampled_from([1, 7, 64, 129, 1000, 4099]),
       rows=st.integers(1, 12), wider=st.sampled_from([1.5, 2.0, 3.0, 1000.0]))
def test_bf16_errors_on_the_edges_of_both_ranges_equal_the_numpy_path(seed, width, rows, wider):
    """BF16 errors binned over their own range and over the joint one (the target's wider on both
    sides), counted as one cell per value (the sum of its two bins, decoded on the staircase of
    both edge lists): values on every edge of both linspaces and one float either side, where a
    bin off by one changes the counts."""
    rng = np.random.default_rng(seed)
    lo2, hi2 = np.float32(1e-3), np.float32(1e-3 + rng.random() * 0.05 + 1e-4)
    lo1, hi1 = np.float32(lo2 / wider), np.float32(hi2 * wider)
    edges = np.concatenate([np.linspace(lo2, hi2, 101, dtype=np.float32), np.linspace(lo1, hi1, 101, dtype=np.float32)])
    cand = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))])
    cand = cand[(cand >= lo2) & (cand <= hi2)].astype(np.float32)
    b = rng.choice(cand, (rows, width)).astype(np.float32)
    b.flat[0], b.flat[-1] = lo2, hi2  # BF16's own range exactly [lo2, hi2]
    t = (lo1 + rng.random((rows, width)) * (hi1 - lo1)).astype(np.float32)
    t.flat[0], t.flat[-1] = lo1, hi1  # the joint range [lo1, hi1]: not BF16's
    assert _fused._edges_rise(lo1, (hi1 - lo1) / np.float32(100), 100)  # the staircase applies
    cfg = KVVerdictConfig(bins=100)
    chunks = np.array_split(np.arange(rows), min(rows, 3))
    base, tgt = [b[c] for c in chunks if c.size], [t[c] for c in chunks if c.size]
    got = verdict.fused_tensor_numbers(base, tgt, cfg)
    assert got is not None
    assert repr(got) == repr(_tensor_numbers_numpy(base, tgt, cfg))


@settings(max_examples=500, deadline=None)
@given(x=_samples(max_size=600), q=st.one_of(st.sampled_from([0.0, 0.5, 0.75, 0.99, 1.0]),
                                             st.floats(0.0, 1.0)))
def test_the_kernel_interpolates_quantiles_as_np_quantile_does(x, q):
    want = np.float32(np.quantile(x, q))
    got = np.float32(_fused._quantile_of(x, q))
    assert got.view(np.uint32) == want.view(np.uint32), (x.size, q, got, want)


def test_quantiles_of_one_value_and_of_ties():
    for x in ([3.0], [0.0], [2.0, 2.0, 2.0], [0.0, 1.0], [1.0, 0.0, 1.0, 1.0, 0.0]):
        x = np.asarray(x, np.float32)
        for q in (0.0, 0.5, 0.75, 0.99, 1.0):
            assert np.float32(_fused._quantile_of(x, q)) == np.float32(np.quantile(x, q)), (x, q)


def test_the_order_checks_refuse_a_kernel_one_ulp_off(monkeypatch):
    """pairwise_order_holds / quantile_rule_holds compare bits: a sum or a quantile one ulp off
    anywhere makes the verdict take numpy (the kernel is not used)."""
    real_sum, real_q = _fused._pw_sum, _fused._quantile_of
    monkeypatch.setattr(_fused, "_pw_sum", lambda a: np.nextafter(real_sum(a), math.inf))
    monkeypatch.setattr(_fused, "_PAIRWISE_OK", None)
    assert _fused.pairwise_order_holds() is False
    rng = np.random.default_rng(0)
    base = [np.abs(rng.standard_normal((4, 16))).astype(np.float32)]
    assert verdict.fused_tensor_numbers(base, base, KVVerdictConfig()) is None
    monkeypatch.setattr(_fused, "_pw_sum", real_sum)
    monkeypatch.setattr(_fused, "_PAIRWISE_OK", None)
    assert _fused.pairwise_order_holds() is True
    monkeypatch.setattr(_fused, "_quantile_of", lambda x, q: np.nextafter(np.float32(real_q(x, q)), np.float32(9)))
    monkeypatch.setattr(_fused, "_QUANTILE_OK", {})
    assert _fused.quantile_rule_holds(0.75) is False
    assert verdict.fused_tensor_numbers(base, base, KVVerdictConfig()) is None
    monkeypatch.setattr(_fused, "_quantile_of", real_q)
    monkeypatch.setattr(_fused, "_QUANTILE_OK", {})
    assert _fused.quantile_rule_holds(0.75) is True


def test_without_numba_the_numpy_path_runs(monkeypatch):
    import metrics.bc as bc_mod

    monkeypatch.setattr(bc_mod, "_NUMBA_OK", False)
    monkeypatch.setattr(verdict, "numba_available", lambda: False)
    rng = np.random.default_rng(2)
    base = [np.abs(rng.standard_normal((6, 32))).astype(np.float32) for _ in range(3)]
    assert verdict.fused_tensor_numbers(base, base, KVVerdictConfig()) is None
    assert _tensor_numbers(base, base, KVVerdictConfig()).n_values == 3 * 6 * 32
