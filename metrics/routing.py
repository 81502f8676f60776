"""MoE routing numerics: top-k expert sets, their flips against FP32, and which flips BF16 explains.

A *flip* at a token of a layer: the target's top-k expert set differs from the FP32 baseline's.
Whether BF16 noise explains it (docs/moe.md): the baseline's top-k margin ``m = z_(k) - z_(k+1)``
(its k-th and (k+1)-th largest router logits) is the smallest error that can flip a token; a flip
itself needs the margin of the experts the target actually chose: ``needed = max over e in
actual minus base of (z_(k) - z_e)`` (every expert chosen outside the baseline's top-k must have been
lifted past the baseline's k-th; ``needed >= m``, equal when the target took the (k+1)-th). It is
judged against the BF16 router-logit noise measured on the expected run, ``N = max_e |expected -
baseline|`` at that token and layer. For the target to rank an expert outside the baseline's top-k
(logit ``z_j``) above one inside (``z_i >= z_(k)``) its errors must differ by at least
``z_i - z_j``: ``err_j - err_i >= z_(k) - z_j``. Errors of BF16 size are at most ``N`` each, so a
flip is explained when ``needed <= 2 * noise``, where ``noise``
is the larger of ``N`` at that token and ``N``'s 95th percentile over every token of the layer
(``noise_scale``: the target's error at a token need not match the expected run's error at that
same token, only its size). Everything is vectorised over tokens.

Which experts a router chose: at an exact tie of its logits (common in BF16 near a tie: 8
significant bits) a router picks by its top-k kernel's rule, not by the lower expert id
(``top_k_experts``, the default here). A caller that knows the engine's rule passes each role's
chosen sets (``routing_flips(..., experts=...)``; the routing comparator passes
``extractors.routing_force.chosen_experts``: ``torch.topk`` as the router computes it), so flips
are counted between what the routers did choose.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "NOISE_FACTOR",
    "NOISE_QUANTILE",
    "needed_margin",
    "noise_scale",
    "router_noise",
    "routing_flips",
    "top_k_experts",
    "top_k_margin",
]

NOISE_QUANTILE = 0.95
NOISE_FACTOR = 2.0


def top_k_experts(logits: np.ndarray, k: int) -> np.ndarray:
    """``[token, k]`` int64: the ``k`` largest logits' experts of ``logits [token, expert]``,
    sorted by expert id (a set; ties go to the lower expert id, as a stable sort gives)."""
    order = np.argsort(-np.asarray(logits, dtype=np.float64), axis=-1, kind="stable")[:, :k]
    return np.sort(order, axis=-1).astype(np.int64)


def top_k_margin(logits: np.ndarray, k: int) -> np.ndarray:
    """``[token]``: the k-th largest logit minus the (k+1)-th of ``logits [token, expert]``."""
    z = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
    return z[:, k - 1] - z[:, k]


def needed_margin(logits: np.ndarray, base_experts: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """``[token]``: the FP32 margin a flip needed: ``max over e in chosen minus base_experts of
    (z_(k) - z_e)``, ``z`` the baseline's router ``logits [token, expert]`` and ``z_(k)`` its k-th
    largest (``k = base_experts.shape[1]``); NaN at a token whose ``chosen [token, k]`` set equals
    ``base_experts``' (no flip)."""
    z = np.asarray(logits, np.float64)
    base, ch = np.asarray(base_experts), np.asarray(chosen)
    zk = -np.sort(-z, axis=-1)[:, base.shape[1] - 1]
    outside = ~(ch[:, :, None] == base[:, None, :]).any(axis=-1)  # [token, k]: chosen not in base's set
    gap = np.where(outside, zk[:, None] - np.take_along_axis(z, ch, axis=-1), -np.inf).max(axis=-1)
    return np.where(outside.any(axis=-1), gap, np.nan)


def router_noise(expected: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """``[token]``: ``max_e |expected - baseline|`` of router logits ``[token, expert]``."""
    return np.abs(np.asarray(expected, np.float64) - np.asarray(baseline, np.float64)).max(axis=-1)


def noise_scale(noise: np.ndarray) -> float:
    """The layer's noise scale: the ``NOISE_QUANTILE`` quantile of its per-token noise (NaN if empty)."""
    return float(np.quantile(noise, NOISE_QUANTILE)) if np.size(noise) else float("nan")


def routing_flips(baseline: np.ndarray, expected: np.ndarray, actual: np.ndarray, k: int,
                  layer_noise: float | None = None, experts: tuple | None = None) -> dict:
    """Flips of ``actual`` against ``baseline`` (router logits ``[token, expert]`` of one layer,
    the same tokens in each) and their classification (module docstring).

    Returns columns over tokens: ``base_experts``/``actual_experts``/``expected_experts``
    ``[token, k]``, ``flip`` (actual's set differs), ``noise_flip`` (expected's set differs),
    ``margin`` (the baseline's top-k margin), ``needed`` (``needed_margin``: the margin the actual
    run's flip needed; NaN where no flip), ``noise`` (per token), ``threshold`` (``NOISE_FACTOR *
    max(noise, layer_noise)``), ``explained`` (a flip whose needed margin is within the threshold;
    False where no flip).
    ``layer_noise``: the layer's ``noise_scale`` pooled over prompts (default: over these tokens).
    ``experts``: ``(baseline, expected, actual)`` int ``[token, k]`` sets each run's router chose
    (module docstring: tie-breaks); default ``top_k_experts`` of each (ties to the lower id)."""
    b, e, a = (np.asarray(x, np.float64) for x in (baseline, expected, actual))
    if not (b.shape == e.shape == a.shape and b.ndim == 2 and 0 < k < b.shape[1]):
        raise ValueError(f"routing_flips: router logits of shapes {b.shape}, {e.shape}, {a.shape} with top_k {k}: "
                         f"need three equal [token, expert] arrays and 0 < top_k < experts")
    if experts is None:
        be, ee, ae = top_k_experts(b, k), top_k_experts(e, k), top_k_experts(a, k)
    else:
        be, ee, ae = (np.sort(np.asarray(x, np.int64), axis=-1) for x in experts)
        if not be.shape == ee.shape == ae.shape == (b.shape[0], k):
            raise ValueError(f"routing_flips: chosen experts of shapes {be.shape}, {ee.shape}, {ae.shape} for "
                             f"{b.shape[0]} tokens and top_k {k}: need three [token, top_k] arrays")
    flip = (be != ae).any(axis=-1)
    noise = router_noise(e, b)
    scale = noise_scale(noise) if layer_noise is None else float(layer_noise)
    threshold = NOISE_FACTOR * np.maximum(noise, scale)
    needed = needed_margin(b, be, ae)
    return {"base_experts": be, "expected_experts": ee, "actual_experts": ae, "flip": flip,
            "noise_flip": (be != ee).any(axis=-1), "margin": top_k_margin(b, k), "needed": needed, "noise": noise,
            "threshold": threshold, "explained": flip & (needed <= threshold)}
