"""Relative errors and cosine: hand-computed values, NaN exclusion, guards, vectorised axes."""
import math

import ml_dtypes
import numpy as np
import pytest

from metrics.errors import as_float, cosine, rel_l2, rel_linf, to_numpy


def test_hand_computed_values():
    ref = np.array([3.0, -4.0])
    x = np.array([3.0, -3.0])
    assert rel_linf(ref, x) == pytest.approx(1 / 4)
    assert rel_l2(ref, x) == pytest.approx(1 / 5)
    assert cosine(ref, x) == pytest.approx((9 + 12) / (5 * math.sqrt(18)))


def test_nan_positions_excluded_not_propagated():
    ref = np.array([1.0, np.nan, 2.0])
    x = np.array([1.5, 7.0, 2.0])
    assert rel_linf(ref, x) == pytest.approx(0.5 / 2.0)
    assert math.isnan(rel_linf(np.array([np.nan]), np.array([1.0])))


def test_zero_reference_is_guarded():
    assert rel_linf(np.zeros(3), np.full(3, 1e-12)) == pytest.approx(1e-12 / 1e-10)
    assert cosine(np.zeros(3), np.ones(3)) == 0.0


def test_vectorised_over_axes():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 5, 6))
    x = ref + rng.normal(size=ref.shape) * 0.01
    got = rel_l2(ref, x, axis=(1, 2))
    for i in range(4):
        assert got[i] == pytest.approx(np.linalg.norm(x[i] - ref[i]) / np.linalg.norm(ref[i]))
    assert rel_linf(ref, x, axis=None).shape == ()


def test_bf16_widening_is_exact_and_torch_is_duck_typed():
    x = np.array([1.0, -2.5, 3.140625, 1e-20, np.inf], dtype=np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(as_float(x), x.astype(np.float32))
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.0, 2.0, 3.5], dtype=torch.bfloat16)
    a = to_numpy(t)
    assert a.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(as_float(t), np.array([1.0, 2.0, 3.5], np.float32))
