"""Cached-versus-full-prefix equivalence: per-position judgement of one request, the tolerance,
and the bug class a failure points to (reference/004).

Tokens and logits are judged apart. ``cached, reference: [position, vocab]`` float logits of the
same positions of the same token sequence (the cached engine's output and the same engine's
full-prefix recomputation).

- token: the greedy token (argmax) of the cached logits equals the reference's, or the two are a
  tie within the tolerance (the reference's own gap between them is at most ``tol`` relative to
  ``max|reference|``: different matmul shapes may flip a near-tie, a bug flips clear winners);
- logits: ``max|cached - reference| / max|reference|`` (relative L-inf) within ``tol``;
- ``tol``: ``max(floor, NOISE_FACTOR * noise)``, ``floor`` 1e-5 in FP32 (different matmul shapes
  round differently) and ``BF16_FLOOR`` in BF16, ``noise`` the engine's own measured spread of the
  same request's logits across batch compositions (the spread between its own batch sizes is
  noise; a difference beyond it is not), and of the same positions computed within a longer
  sequence (another matmul shape, no cache involved);
- non-finite cached logits where the reference is finite fail; a position never fails quietly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32_FLOOR = 1e-5
BF16_FLOOR = 2.0 ** -7  # one BF16 ulp relative to the largest logit: matmul-shape rounding in BF16
NOISE_FACTOR = 4.0

# bug classes, in the reference note's terms
SYSTEMATIC = "systematic"
LATE = "windows or truncation"
BATCH = "batch composition or padding"
STALE = "stale or shared cache"
CHUNK = "chunk positions or block sharing"
CONTEXT = "context limit"

CLASS_TEXT = {
    SYSTEMATIC: "differs from the first position alone and unbatched: weights, prompt, stale cache, mask or "
                "position base",
    LATE: "only late positions differ: sliding windows or truncation (positions after a cut)",
    BATCH: "only batched runs differ: batch composition, compaction or padding (a padded tail read)",
    STALE: "only after reuse, abort or fork: a stale slot or a shared block written without copy",
    CHUNK: "only with chunked prefill or a continued prefix: chunk positions or block sharing",
    CONTEXT: "at the context limit: a silent wrap of positions or an off-by-one refusal",
}

# scenario kind -> the class a failure of a scenario of that kind points to when the baseline is clean
KIND_CLASS = {
    "single": LATE,  # a clean first position but a later failure alone: windows
    "long": LATE,
    "truncate": LATE,
    "batch": BATCH,
    "invariance": BATCH,
    "compaction": BATCH,
    "reuse": STALE,
    "cancel": STALE,
    "fork": STALE,
    "chunk": CHUNK,
    "offset": CHUNK,
    "overflow": CONTEXT,
    "preempt": STALE,  # recomputed after a preemption (vLLM): its blocks were freed and taken again
    "oracle": SYSTEMATIC,  # the engine's own full prefix differs from a second oracle (HF)
}


def tolerance(dtype: str, noise: float = 0.0) -> float:
    """The relative logit tolerance of ``dtype`` given the engine's measured noise (module docstring)."""
    floor = FP32_FLOOR if dtype in ("float32", "fp32") else BF16_FLOOR
    return float(max(floor, NOISE_FACTOR * float(noise)))


def relative_linf(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row ``max|a - b| / max|b|`` over the last axis (guarded 1e-10); NaN where ``a`` is not finite."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.abs(a - b).max(-1) / np.maximum(np.abs(b).max(-1), 1e-10)
    return np.where(np.isfinite(a).all(-1), d, np.nan)


@dataclass(frozen=True)
class RequestJudgement:
    """One request's positions judged. Arrays over the compared positions."""

    positions: np.ndarray  # int [n]: position of the input token whose logits were compared
    cached_token: np.ndarray  # int [n]
    reference_token: np.ndarray  # int [n]
    token_match: np.ndarray  # bool [n]: greedy tokens equal
    token_ok: np.ndarray  # bool [n]: equal, or a tie within tol
    logit_err: np.ndarray  # float [n]: relative L-inf, NaN for non-finite cached logits
    tol: float

    @property
    def logit_ok(self) -> np.ndarray:
        return np.nan_to_num(self.logit_err, nan=np.inf) <= self.tol

    @property
    def ok(self) -> np.ndarray:
        return self.token_ok & self.logit_ok

    @property
    def passed(self) -> bool:
        return bool(len(self.positions)) and bool(self.ok.all())

    def _first(self, bad) -> int | None:
        idx = np.flatnonzero(bad)
        return int(self.positions[idx[0]]) if len(idx) else None

    @property
    def first_diff(self) -> int | None:
        """First position failing either criterion."""
        return self._first(~self.ok)

    @property
    def first_token_diff(self) -> int | None:
        return self._first(~self.token_ok)

    @property
    def first_logit_diff(self) -> int | None:
        return self._first(~self.logit_ok)

    @property
    def max_err(self) -> float:
        e = np.nan_to_num(self.logit_err, nan=np.inf)
        return float(e.max()) if len(e) else float("nan")


def judge_request(cached, reference, positions, tol: float) -> RequestJudgement:
    """Judge a request's cached logits against its reference at ``positions`` (module docstring)."""
    cached = np.asarray(cached, np.float64)
    reference = np.asarray(reference, np.float64)
    if cached.shape != reference.shape:
        raise ValueError(f"judge_request: cached logits {cached.shape} vs reference {reference.shape}")
    positions = np.asarray(positions, np.int64)
    err = relative_linf(cached, reference)
    ct = np.where(np.isfinite(cached).all(-1), np.nan_to_num(cached, nan=-np.inf).argmax(-1), -1)
    rt = reference.argmax(-1)
    match = ct == rt
    scale = np.maximum(np.abs(reference).max(-1), 1e-10)
    rows = np.arange(len(rt))
    gap = (reference[rows, rt] - reference[rows, np.maximum(ct, 0)]) / scale
    ok = match | ((ct >= 0) & (gap <= tol))
    return RequestJudgement(positions, ct.astype(np.int64), rt.astype(np.int64), match, ok, err, float(tol))


def first_kv_difference(k, v, k_ref, v_ref, tol: float):
    """Where cached KV first differs from the full-prefix KV: ``k, v, k_ref, v_ref``
    ``[layer, kv_head, seq, head_dim]`` (NaN where an engine holds nothing, skipped).
    -> ``(layer, position, rel_err)`` of the first layer with a position beyond ``tol``
    (relative to that layer's ``max|ref|``), or None when every held position agrees."""
    n = min(k.shape[2], k_ref.shape[2])
    for layer in range(min(k.shape[0], k_ref.shape[0])):
        errs = []
        for a, r in ((k, k_ref), (v, v_ref)):
            a, r = np.asarray(a[layer, :, :n], np.float64), np.asarray(r[layer, :, :n], np.float64)
            both = np.isfinite(a) & np.isfinite(r)
            scale = max(float(np.abs(np.where(both, r, 0)).max()), 1e-10)
            d = np.where(both, np.abs(a - r), 0).max(axis=(0, 2)) / scale  # [seq]
            missing = (~np.isfinite(a) & np.isfinite(r)).all(axis=(0, 2))  # a position the engine lost
            errs.append(np.where(missing, np.inf, d))
        e = np.maximum(*errs)
        bad = np.flatnonzero(e > tol)
        if len(bad):
            return layer, int(bad[0]), float(e[bad[0]])
    return None


# histories that follow a free of blocks (a finished row, a cut): a stale block can reach them
AFTER_FREE = ("compaction", "truncate")


def diagnose(kind: str, baseline: str, stale_seen: bool = False) -> str:
    """The bug class of a failing position whose history is ``kind``, given the baseline
    scenario's state (``"clean"``, ``"from_start"``: failed at its first position, ``"late"``:
    failed later) and whether a request in freed blocks failed anywhere (``stale_seen``).

    A baseline failing from the start makes every failure systematic, one failing only late makes
    them windows or truncation. Otherwise the history says it (``KIND_CLASS``), except that a
    failure after blocks were freed (compaction, truncation) is a stale cache when a new request
    in freed blocks fails too: the freed blocks reach the survivor or the cut sequence when it
    grows into a recycled block."""
    if baseline == "from_start":
        return SYSTEMATIC
    if baseline == "late":
        return LATE
    if stale_seen and kind in AFTER_FREE:
        return STALE
    return KIND_CLASS.get(kind, SYSTEMATIC)
