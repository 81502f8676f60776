"""Bhattacharyya coefficient: hand-derived cases and agreement with the upstream np.histogram form."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metrics.bc import bhattacharyya_batched, bhattacharyya_coefficient
from tests.metrics.test_kv import upstream_bc


def test_identical_samples_give_one():
    x = np.array([0.1, 0.2, 0.3, 0.4])
    # p == q, sum sqrt(p*p) = sum p = 4 / (4 + 1e-10)
    assert bhattacharyya_coefficient(x, x) == pytest.approx(4 / (4 + 1e-10), abs=1e-15)


def test_disjoint_samples_give_zero():
    assert bhattacharyya_coefficient([0.0, 0.1], [0.9, 1.0]) == 0.0


def test_empty_side_gives_zero():
    assert bhattacharyya_coefficient([], [1.0, 2.0]) == 0.0
    assert bhattacharyya_coefficient([1.0], []) == 0.0


def test_all_zero_samples_fall_in_one_bin_and_give_one():
    # lo == hi: np.histogram puts everything in the last bin, so p == q == e_last
    assert bhattacharyya_coefficient(np.zeros(5), np.zeros(7)) == pytest.approx(1.0, abs=1e-9)


def test_half_overlap_by_hand():
    # range [0, 1], 100 bins. a: two values in bin 0 and bin 99; b: both in bin 0.
    # p = (.5, .5), q = (1, 0) -> BC = sqrt(.5) (less the 1e-10 guards)
    got = bhattacharyya_coefficient([0.0, 1.0], [0.0, 0.001])
    assert got == pytest.approx(np.sqrt(0.5), abs=1e-9)


def test_two_bins_by_hand():
    # edges of [0, 1] with 2 bins: [0, .5), [.5, 1]. a = 3 low 1 high, b = 1 low 3 high
    got = bhattacharyya_coefficient([0.0, 0.1, 0.2, 1.0], [0.0, 0.7, 0.8, 1.0], bins=2)
    assert got == pytest.approx(2 * np.sqrt(3 / 16), abs=1e-9)


def test_nan_values_are_excluded():
    a = np.array([0.1, np.nan, 0.3])
    assert bhattacharyya_coefficient(a, [0.1, 0.3]) == pytest.approx(bhattacharyya_coefficient([0.1, 0.3], [0.1, 0.3]))
    assert bhattacharyya_coefficient([np.nan], [0.1]) == 0.0


def test_torch_and_bf16_inputs():
    torch = pytest.importorskip("torch")
    x = np.abs(np.random.default_rng(0).normal(size=50)).astype(np.float32)
    y = x * 1.1
    want = upstream_bc(x, y.astype(np.float32))
    assert bhattacharyya_coefficient(torch.tensor(x), torch.tensor(y)) == pytest.approx(want, abs=1e-12)
    xb = x.astype(ml_dtypes.bfloat16)
    assert bhattacharyya_coefficient(xb, y) == pytest.approx(upstream_bc(xb.astype(np.float32), y), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6), n=st.integers(1, 200), m=st.integers(1, 200),
    quantum=st.sampled_from([0.0, 1 / 8, 1 / 64, 2**-20]), dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**31),
)
def test_batched_equals_upstream_histogram_exactly(rows, n, m, quantum, dtype, seed):
    """Quantised samples (bf16-like errors) put values right on bin edges: must still agree."""
    rng = np.random.default_rng(seed)
    a = np.abs(rng.normal(size=(rows, n)))
    b = np.abs(rng.normal(size=(rows, m))) * rng.uniform(0.3, 3)
    if quantum:
        a, b = np.round(a / quantum) * quantum, np.round(b / quantum) * quantum
    a, b = a.astype(dtype), b.astype(dtype)
    if n == m:
        got = bhattacharyya_batched(a, b)
    else:
        got = np.array([bhattacharyya_coefficient(a[i], b[i]) for i in range(rows)])
    want = np.array([upstream_bc(a[i], b[i]) for i in range(rows)])
    np.testing.assert_array_equal(got, want)


def test_batched_keeps_leading_shape():
    rng = np.random.default_rng(1)
    a = np.abs(rng.normal(size=(3, 4, 20))).astype(np.float32)
    got = bhattacharyya_batched(a, a * 2)
    assert got.shape == (3, 4)
    assert got[2, 1] == pytest.approx(upstream_bc(a[2, 1], a[2, 1] * 2), abs=1e-12)
