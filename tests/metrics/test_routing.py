"""metrics.routing against hand-computed cases and a slow per-token oracle."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metrics.routing import routing_flips, top_k_experts, top_k_margin


def test_top_k_and_margin_by_hand():
    z = np.array([[0.1, 2.0, -1.0, 1.5], [3.0, 3.0, 0.0, -2.0]])
    assert top_k_experts(z, 2).tolist() == [[1, 3], [0, 1]]
    assert np.allclose(top_k_margin(z, 2), [1.5 - 0.1, 3.0 - 0.0])


def test_a_flip_within_twice_the_noise_is_explained_one_beyond_is_not():
    base = np.array([[1.0, 0.98, 0.0, -1.0], [1.0, 0.5, 0.0, -1.0]])  # margins 0.98 and 0.5 (k=1)
    exp = base + np.array([[0.01, -0.01, 0.0, 0.0], [0.01, -0.01, 0.0, 0.0]])  # noise 0.01 per token
    act = np.array([[0.97, 0.99, 0.0, -1.0], [0.4, 0.6, 0.0, -1.0]])  # both choose expert 1
    r = routing_flips(base, exp, act, 1)
    assert r["flip"].tolist() == [True, True]
    assert np.allclose(r["margin"], [0.02, 0.5]) and np.allclose(r["threshold"], [0.02, 0.02])
    assert r["explained"].tolist() == [True, False]
    assert r["noise_flip"].tolist() == [False, False]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_flips_match_a_slow_per_token_oracle(seed, k):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal((20, 6))
    e = b + 0.05 * rng.standard_normal(b.shape)
    a = b + 0.2 * rng.standard_normal(b.shape)
    r = routing_flips(b, e, a, k, layer_noise=0.03)
    for t in range(20):
        sb, sa = set(np.argsort(-b[t])[:k]), set(np.argsort(-a[t])[:k])
        zs = sorted(b[t], reverse=True)
        thr = 2 * max(np.abs(e[t] - b[t]).max(), 0.03)
        assert r["flip"][t] == (sb != sa)
        assert r["explained"][t] == ((sb != sa) and zs[k - 1] - zs[k] <= thr)
