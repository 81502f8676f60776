"""metrics.verdict's pooled tensor numbers (the KV and module verdict rule): the path that skips
the masking copies when every value is finite gives the numbers of the masking path it
shortcuts, to the last bit (oracle: that path as it was, copied below), on chunks with and
without NaN / inf, empty and one-row chunks, float32 and float64; so does the fused kernel that
``_tensor_numbers`` takes for finite float32 chunks (tests/metrics/test_verdict_fused.py)."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metrics.bc import bhattacharyya_coefficient
from metrics.verdict import (KVTensorVerdict, KVVerdictConfig, _finite_in_all_three, _tensor_numbers,
                             _tensor_numbers_numpy)


def _oracle_tensor_numbers(base_chunks, tgt_chunks, cfg: KVVerdictConfig) -> KVTensorVerdict:
    base_chunks, tgt_chunks = _finite_in_all_three(base_chunks, tgt_chunks)
    base = np.concatenate([c.ravel() for c in base_chunks]) if base_chunks else np.zeros(0, np.float32)
    tgt = np.concatenate([c.ravel() for c in tgt_chunks]) if tgt_chunks else np.zeros(0, np.float32)
    ok = ~(np.isnan(base) | np.isnan(tgt))
    n = int(np.count_nonzero(ok))
    if n == 0:
        nan = math.nan
        return KVTensorVerdict(None, None, 0, nan, nan, nan, nan, nan, nan, nan)
    b, t = base[ok].astype(np.float64), tgt[ok].astype(np.float64)
    b_rms, t_rms = math.sqrt(float(np.mean(b * b))), math.sqrt(float(np.mean(t * t)))
    sigma = t_rms / b_rms if b_rms > 0 else (0.0 if t_rms == 0 else math.inf)
    bc = bhattacharyya_coefficient(base[ok], tgt[ok], bins=cfg.bins)
    # Per-position L-inf (max over width), pooled over chunks; positions with no value dropped.
    def pos_linf(chunks):
        out = [np.fmax.reduce(c.reshape(c.shape[0], -1), axis=1) for c in chunks if c.size]
        out = np.concatenate(out) if out else np.zeros(0)
        return out[~np.isnan(out)]

    def qratio(x, y):
        if x.size == 0 or y.size == 0:
            return math.nan
        qx, qy = float(np.quantile(x, cfg.linf_quantile)), float(np.quantile(y, cfg.linf_quantile))
        return qx / qy if qy > 0 else (0.0 if qx == 0 else math.inf)

    with np.errstate(invalid="ignore"):
        base_pos, tgt_pos = pos_linf(base_chunks), pos_linf(tgt_chunks)
        linf_ratio = qratio(tgt_pos, base_pos)
        max_ratio = math.nan
        if base_pos.size and tgt_pos.size:
            bm, tm = float(base_pos.max()), float(tgt_pos.max())
            max_ratio = tm / bm if bm > 0 else (0.0 if tm == 0 else math.inf)
        # The BF16 noise against itself: even vs odd positions of every chunk.
        even_pos, odd_pos = pos_linf([c[0::2] for c in base_chunks]), pos_linf([c[1::2] for c in base_chunks])
    r = qratio(even_pos, odd_pos)
    spread = 1.0 if math.isnan(r) or r == 0 else max(r, 1.0 / r)
    even = np.concatenate([c[0::2].ravel() for c in base_chunks]) if base_chunks else np.zeros(0)
    odd = np.concatenate([c[1::2].ravel() for c in base_chunks]) if base_chunks else np.zeros(0)
    even, odd = even[~np.isnan(even)], odd[~np.isnan(odd)]
    noise_bc = bhattacharyya_coefficient(even, odd, bins=cfg.bins) if even.size and odd.size else math.nan
    bc_bar = cfg.bc_threshold if math.isnan(noise_bc) else min(cfg.bc_threshold, noise_bc - cfg.bc_noise_margin)
    linf_bar = max(cfg.linf_ratio_threshold, spread)
    if sigma <= cfg.sigma_ratio_threshold:
        passed, why = True, "sigma_ratio"
    elif bc >= bc_bar and linf_ratio <= linf_bar and max_ratio <= cfg.max_linf_ratio_threshold:
        passed, why = True, "bc_and_linf"
    else:
        passed, why = False, None
    return KVTensorVerdict(passed, why, n, sigma, bc, noise_bc, bc_bar, linf_ratio, spread, linf_bar, max_ratio)


@st.composite
def _chunks(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    width = draw(st.sampled_from([1, 3, 32, 200]))
    base, tgt = [], []
    for _ in range(draw(st.integers(0, 5))):
        rows = draw(st.integers(0, 9))
        b = np.abs(rng.standard_normal((rows, width)) * 1e-3).astype(dtype)
        t = np.abs(rng.standard_normal((rows, width)) * draw(st.sampled_from([5e-4, 1e-3, 3e-3]))).astype(dtype)
        if rows and draw(st.integers(0, 3)) == 0:  # NaN / inf in either role (sliding window, broken target)
            x = b if draw(st.booleans()) else t
            x[rng.integers(rows), rng.integers(width)] = draw(st.sampled_from([np.nan, np.inf]))
        if rows and draw(st.integers(0, 5)) == 0:  # a row with no finite value at all
            t[rng.integers(rows)] = np.nan
        base.append(b)
        tgt.append(t)
    return base, tgt


@settings(max_examples=300, deadline=None)
@given(chunks=_chunks(), margin=st.sampled_from([0.02, 0.005]))
def test_tensor_numbers_equal_the_masking_path(chunks, margin):
    base, tgt = chunks
    cfg = KVVerdictConfig(bc_noise_margin=margin)
    with np.errstate(invalid="ignore"):
        want = _oracle_tensor_numbers(base, tgt, cfg)
    assert repr(_tensor_numbers(base, tgt, cfg)) == repr(want)  # repr: every float to the last bit, NaN too
    assert repr(_tensor_numbers_numpy(base, tgt, cfg)) == repr(want)  # the numpy path on its own (no fused kernel)


def test_a_clean_engine_takes_the_shortcut_and_a_nan_does_not(monkeypatch):
    import metrics.verdict as v

    calls = []
    real = v._finite_in_all_three
    monkeypatch.setattr(v, "_finite_in_all_three", lambda b, t: calls.append(1) or real(b, t))
    rng = np.random.default_rng(0)
    b = [np.abs(rng.standard_normal((6, 16))).astype(np.float32) for _ in range(3)]
    t = [x * 1.01 for x in b]
    clean = _tensor_numbers(b, t, KVVerdictConfig())
    assert calls == [] and clean.n_values == 3 * 6 * 16
    t[1][2, 5] = np.nan
    broken = _tensor_numbers(b, t, KVVerdictConfig())
    assert calls == [1] and broken.n_values == 3 * 6 * 16 - 1
