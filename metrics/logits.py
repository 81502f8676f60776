"""Logit validation with teacher forcing: per-token top-k error maps, ULP-aware divergence,
three-way (FP32 / BF16 / target) metrics, and the re-feeding loop with incremental KV merge.

Conventions follow the upstream ``logit_validation`` (vllm-neuron / NxDI accuracy tooling):
``input_ids`` is a list of token-id lists (one per batch row), logits are
``[gen_token, batch, vocab]``, per-token results are grouped per batch row.

Per teacher-forced token (``validate_token_logits``):
1. drop every vocab position where the expected logit is -inf (baseline follows the same mask).
   Upstream also drops positions where only the *actual* is -inf; here those count as broken
   evidence (NaN: the token fails, ``num_actual_masked`` says how many), else an engine that
   masks its top tokens to -inf would pass. Positions -inf in both are dropped as upstream;
2. remove the constant shift: least squares ``actual ~ a*expected + b`` over the kept positions,
   subtract ``b`` from actual (slope is not applied). A per-token constant (log-softmax vs raw
   logits) is absorbed entirely, so log-softmax targets validate like raw logits;
3. top-k error for each k of the tolerance map: ``max((|a - e| - atol) / max|e|)`` over the
   expected top-k (``max|e|`` over that top-k); fails when ``> rtol``. A k larger than the kept
   vocabulary uses all of it (upstream raises);
4. divergence: greedy tokens differ. Acceptable when the actual logit gap between the two
   tokens is within ``n`` ULPs of bf16 at the larger of the two (``ULP(x) = 2**(floor(log2|x|)
   - mantissa_bits)``), or within a fixed ``divergence_difference_tol`` when one is given.
   (Upstream ignores an explicit ``divergence_difference_tol`` unless ``divergence_n_ulps`` is
   set to None; here an explicit value always wins.)
5. status: MATCHED, TOPK_ERRORS, ACCEPTABLE_DIVERGENCE(_WITH_TOPK_ERRORS),
   DIVERGED(_WITH_TOPK_ERRORS); passing = MATCHED or ACCEPTABLE_DIVERGENCE.
A NaN error counts as a failure (upstream's classifier lets a NaN error through as "no top-k
error" while still failing the token; here both say failed).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .bc import bhattacharyya_coefficient
from .errors import EPS, as_float, to_numpy

__all__ = [
    "DEFAULT_TOLERANCE_MAP",
    "DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE",
    "DEFAULT_DYNAMIC_THRESHOLD_CONFIG",
    "ValidationStatus",
    "ThreeWayTokenMetrics",
    "TokenLogitResult",
    "LogitValidationResult",
    "ulp",
    "remove_shift",
    "topk_error_map",
    "validate_token_logits",
    "validate_logits",
    "logit_validation",
]

DEFAULT_TOLERANCE_MAP = {5: (1e-5, 0.01), 50: (1e-5, 0.02), 1000: (1e-5, 0.03), "all": (1e-5, 0.05)}
DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE = 0.001
DEFAULT_DYNAMIC_THRESHOLD_CONFIG = {"linf_multiplier": 1.5, "l2_multiplier": 1.5}


class ValidationStatus(Enum):
    MATCHED = "matched"
    TOPK_ERRORS = "topk_errors"
    ACCEPTABLE_DIVERGENCE = "acceptable_divergence"
    ACCEPTABLE_DIVERGENCE_WITH_TOPK_ERRORS = "acceptable_divergence_with_topk_errors"
    DIVERGED = "diverged"
    DIVERGED_WITH_TOPK_ERRORS = "diverged_with_topk_errors"

    def is_passing(self) -> bool:
        return self in (ValidationStatus.MATCHED, ValidationStatus.ACCEPTABLE_DIVERGENCE)


# ----------------------------------------------------------------------------- small pieces


def ulp(x, mantissa_bits: int = 7):
    """Spacing of a float with ``mantissa_bits`` explicit mantissa bits at ``|x|`` (bf16: 7):
    ``2**(floor(log2|x|) - mantissa_bits)``; 0 below 1e-30, NaN for NaN/inf. Vectorised."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.exp2(np.floor(np.log2(np.where(a < 1e-30, 1.0, a))) - mantissa_bits)
    out = np.where(a < 1e-30, 0.0, out)
    out = np.where(np.isfinite(a), out, np.nan)
    return float(out) if out.ndim == 0 else out


def remove_shift(expected, actual):
    """Least-squares ``actual ~ slope*expected + shift`` along the last axis.

    expected, actual: ``[..., vocab]`` (finite values only; drop -inf first).
    Returns ``(shift, slope)`` of shape ``[...]`` (float64). Same answer as the upstream
    ``np.linalg.lstsq`` on ``[expected | 1]``, including its minimum-norm solution when
    expected is constant.
    """
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # +inf in an input: inf - inf, a NaN fit (the token fails)
        em = e.mean(axis=-1, keepdims=True)
        am = a.mean(axis=-1, keepdims=True)
        de = e - em
        var = np.sum(de * de, axis=-1)
        cov = np.sum(de * (a - am), axis=-1)
        em, am = em[..., 0], am[..., 0]
        slope = np.where(var > 0, cov / np.where(var > 0, var, 1.0), em * am / (em * em + 1.0))
        shift = np.where(var > 0, am - slope * em, am / (em * em + 1.0))
    if np.ndim(shift) == 0:
        return float(shift), float(slope)
    return shift, slope


def _norm_key(k):
    if isinstance(k, str) and k.lower() == "all":
        return None
    return int(k)


def topk_error_map(expected, actual, tol_map=None) -> dict:
    """Top-k errors of one token: ``{k: max((|a - e| - atol) / max|e_topk|)}`` over expected's
    top-k (k = "all": every position). expected, actual: ``[vocab]`` finite, shift removed.
    Keys are returned exactly as given in ``tol_map``."""
    tol_map = DEFAULT_TOLERANCE_MAP if tol_map is None else tol_map
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    n = e.shape[-1]
    ks = [_norm_key(key) for key in tol_map]
    kmax = max([k for k in ks if k is not None and k < n], default=0)
    top = None
    if kmax:
        top = np.argpartition(-e, kmax - 1)[:kmax] if kmax < n else np.arange(n)
        top = top[np.argsort(-e[top], kind="stable")]  # descending: top[:k] is the top-k
    out = {}
    for key, k in zip(tol_map, ks):
        atol = tol_map[key][0]
        idx = slice(None) if k is None or k >= n else top[:k]
        es, as_ = e[idx], a[idx]
        if es.size == 0:
            out[key] = math.inf
            continue
        emax = np.max(np.abs(es))
        with np.errstate(invalid="ignore"):
            err = np.max((np.abs(as_ - es) - atol) / emax) if emax > 0 else math.inf
        out[key] = float(err)
    return out


# ----------------------------------------------------------------------------- per token


@dataclass(frozen=True)
class ThreeWayTokenMetrics:
    """One token, three-way. ``base`` = expected (BF16 reference) vs baseline (FP32),
    ``tgt`` = actual (target) vs baseline. Errors are absolute, float32, over the kept vocab."""

    base_linf: float
    tgt_linf: float
    base_l2: float
    tgt_l2: float
    bc: float
    base_errors: np.ndarray | None = field(default=None, repr=False)
    tgt_errors: np.ndarray | None = field(default=None, repr=False)
    passed: bool | None = None  # dynamic per-token check tgt < multiplier * base (informational)

    @property
    def linf_ratio(self) -> float:
        return self.tgt_linf / self.base_linf if self.base_linf > 0 else math.inf

    @property
    def l2_ratio(self) -> float:
        return self.tgt_l2 / self.base_l2 if self.base_l2 > 0 else math.inf

    def as_dict(self) -> dict:
        return {
            "base_linf": self.base_linf, "tgt_linf": self.tgt_linf, "base_l2": self.base_l2,
            "tgt_l2": self.tgt_l2, "bc": self.bc, "base_errors": self.base_errors,
            "tgt_errors": self.tgt_errors, "passed": self.passed,
        }


@dataclass(frozen=True)
class TokenLogitResult:
    """Validation of one generation token of one batch row.

    Attribute access, or upstream-style ``r["error_map"]``, ``r["three_way_metrics"]["bc"]``.
    """

    gen_idx: int
    batch_row: int
    passed: bool
    status: ValidationStatus
    divergence: bool
    divergence_difference: float
    divergence_in_bounds: bool
    divergence_threshold: float
    error_map: dict
    shift: float
    expected_token: int
    actual_token: int
    expected_top2_values: tuple
    actual_top2_values: tuple
    num_removed: int = 0
    num_actual_masked: int = 0  # positions -inf in actual but finite in expected (they fail the token)
    three_way: ThreeWayTokenMetrics | None = None

    def __getitem__(self, key):
        if key == "three_way_metrics":
            if self.three_way is None:
                raise KeyError("three_way_metrics (not a three-way validation)")
            return self.three_way.as_dict()
        if key == "status":
            return self.status
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __contains__(self, key):
        return (key == "three_way_metrics" and self.three_way is not None) or (
            key != "three_way_metrics" and hasattr(self, key)
        )

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default


def _classify(error_map, tol_map, divergence, in_bounds) -> ValidationStatus:
    topk_err = any(not (err <= tol_map[k][1]) for k, err in error_map.items())
    if not divergence:
        return ValidationStatus.TOPK_ERRORS if topk_err else ValidationStatus.MATCHED
    if in_bounds:
        return (
            ValidationStatus.ACCEPTABLE_DIVERGENCE_WITH_TOPK_ERRORS if topk_err else ValidationStatus.ACCEPTABLE_DIVERGENCE
        )
    return ValidationStatus.DIVERGED_WITH_TOPK_ERRORS if topk_err else ValidationStatus.DIVERGED


def _three_way(baseline, expected, actual, config):
    fp32 = baseline.astype(np.float32)
    base = expected.astype(np.float32)
    tgt = actual.astype(np.float32)
    ok = np.isfinite(fp32) & np.isfinite(base) & np.isfinite(tgt)
    if not ok.any():
        return ThreeWayTokenMetrics(math.inf, math.inf, math.inf, math.inf, 0.0, None, None, False)
    fp32, base, tgt = fp32[ok], base[ok], tgt[ok]
    base_err = np.abs(base - fp32)
    tgt_err = np.abs(tgt - fp32)
    f64 = fp32.astype(np.float64)
    ref_max = max(float(np.max(np.abs(f64))), EPS)
    ref_norm = max(float(np.sqrt(np.sum(f64 * f64))), EPS)
    be, te = base_err.astype(np.float64), tgt_err.astype(np.float64)
    m = dict(
        base_linf=float(be.max()) / ref_max,
        tgt_linf=float(te.max()) / ref_max,
        base_l2=float(np.sqrt(np.sum(be * be))) / ref_norm,
        tgt_l2=float(np.sqrt(np.sum(te * te))) / ref_norm,
    )
    passed = None
    if config is not None:
        passed = bool(
            m["tgt_linf"] < config.get("linf_multiplier", 1.5) * m["base_linf"]
            and m["tgt_l2"] < config.get("l2_multiplier", 1.5) * m["base_l2"]
        )
    return ThreeWayTokenMetrics(
        bc=bhattacharyya_coefficient(base_err, tgt_err), base_errors=base_err, tgt_errors=tgt_err, passed=passed, **m
    )


def _top2(x):
    if x.size == 0:
        return ()
    if x.size == 1:
        return (float(x[0]),)
    i = np.argpartition(-x, 1)[:2]
    v = np.sort(x[i])[::-1]
    return (float(v[0]), float(v[1]))


def validate_token_logits(
    expected,
    actual,
    tol_map=None,
    divergence_difference_tol: float | None = None,
    actual_token_id: int | None = None,
    baseline=None,
    dynamic_threshold_config: dict | None = None,
    divergence_n_ulps: int | None = 1,
    mantissa_bits: int = 7,
    gen_idx: int = 0,
    batch_row: int = 0,
) -> TokenLogitResult:
    """Validate one token. expected, actual, baseline: ``[vocab]`` (see module docstring)."""
    tol_map = DEFAULT_TOLERANCE_MAP if tol_map is None else tol_map
    e = as_float(expected, np.float64).reshape(-1)
    a = as_float(actual, np.float64).reshape(-1)
    if e.shape != a.shape:
        raise ValueError(f"token {gen_idx} row {batch_row}: expected vocab {e.shape[0]} != actual vocab {a.shape[0]}")
    masked_by_actual = (a == -np.inf) & (e != -np.inf)  # the reference has a value there: evidence broken
    n_actual_masked = int(np.count_nonzero(masked_by_actual))
    if n_actual_masked:
        a = np.where(masked_by_actual, np.nan, a)  # the NaN path fails the token (and the sigma-ratio)
    keep = ~((e == -np.inf) | (a == -np.inf))
    n_removed = int(keep.size - np.count_nonzero(keep))
    if n_removed:
        kept_idx = np.nonzero(keep)[0]
        e, a = e[keep], a[keep]
    else:
        kept_idx = None
    if e.size == 0:
        raise ValueError(f"token {gen_idx} row {batch_row}: every logit is -inf")

    # NaN in actual propagates into the fit; the token then fails (errors NaN) as upstream.
    shift, _slope = remove_shift(e, a)
    a = a - shift
    error_map = topk_error_map(e, a, tol_map)
    tol_ok = all(err <= tol_map[k][1] for k, err in error_map.items())

    exp_tok = int(np.argmax(e))
    if actual_token_id is None:
        act_tok = int(np.argmax(a))
    else:
        act_tok = int(actual_token_id)
        if kept_idx is not None:
            pos = np.searchsorted(kept_idx, act_tok)
            if pos >= kept_idx.size or kept_idx[pos] != act_tok:
                raise ValueError(f"token {gen_idx} row {batch_row}: sampled token {act_tok} has a -inf logit")
            act_tok = int(pos)
    if divergence_difference_tol is not None:
        threshold = float(divergence_difference_tol)
    elif divergence_n_ulps is not None:
        threshold = divergence_n_ulps * ulp(max(abs(a[act_tok]), abs(a[exp_tok])), mantissa_bits)
    else:
        threshold = DEFAULT_DIVERGENCE_DIFFERENCE_TOLERANCE
    divergence = act_tok != exp_tok
    if divergence:
        diff = float(abs(a[act_tok] - a[exp_tok]))
        in_bounds = bool(diff <= threshold)
    else:
        diff, in_bounds = 0.0, True

    three = None
    if baseline is not None:
        b = as_float(baseline, np.float64).reshape(-1)
        if b.shape[0] != keep.shape[0]:
            raise ValueError(f"token {gen_idx} row {batch_row}: baseline vocab {b.shape[0]} != {keep.shape[0]}")
        three = _three_way(b[keep] if n_removed else b, e, a, dynamic_threshold_config)

    status = _classify(error_map, tol_map, divergence, in_bounds)
    to_orig = (lambda i: int(kept_idx[i])) if kept_idx is not None else int
    return TokenLogitResult(
        gen_idx=gen_idx,
        batch_row=batch_row,
        passed=bool(tol_ok and in_bounds),
        status=status,
        divergence=bool(divergence),
        divergence_difference=diff,
        divergence_in_bounds=in_bounds,
        divergence_threshold=float(threshold),
        error_map=error_map,
        shift=float(shift),
        expected_token=to_orig(exp_tok),
        actual_token=to_orig(act_tok),
        expected_top2_values=_top2(e),
        actual_top2_values=_top2(a),
        num_removed=n_removed,
        num_actual_masked=n_actual_masked,
        three_way=three,
    )


# ----------------------------------------------------------------------------- the loop


@dataclass
class LogitValidationResult:
    """Everything ``validate_logits`` found.

    results: ``[batch_row][gen_token] -> TokenLogitResult``; merged_kv: ``{layer: (k, v)}``,
    ``[batch, kv_head, max_prompt_len + gen_tokens, head_dim]`` or None; calls: one record per
    ``generate_fn`` call (``start``, ``input_lens``, ``returned``, ``validated``, ``diverged_at``).
    """

    passed: bool
    results: list
    merged_kv: dict | None
    calls: list
    three_way: bool


def _logits_array(x, what):
    a = as_float(x, np.float32)
    if a.ndim != 3:
        raise ValueError(f"{what} must be [gen_token, batch, vocab], got shape {a.shape}")
    return a


def _is_torch(x):
    return hasattr(x, "detach") and hasattr(x, "numpy")


def _nan_like(x, shape):
    if _is_torch(x):
        import torch

        return torch.full(shape, float("nan"), dtype=x.dtype)
    return np.full(shape, np.nan, dtype=to_numpy(x).dtype)


def _merge_kv(merged, snapshot, merged_upto, ends, total_len):
    """Copy positions ``[merged_upto[b], ends[b])`` of each row from this call's KV snapshot.
    Returns ``(merged, new merged_upto)``; a snapshot shorter than asked copies what it has
    and the rest is taken from a later call."""
    for name, (k, v) in snapshot.items():
        if merged is not None and name not in merged:
            raise ValueError(f"kv_extract_fn returned new layer {name!r} after the first call")
        if k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"kv_extract_fn layer {name!r}: k and v must be [batch, kv_head, seq, head_dim], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[0] != len(ends):
            raise ValueError(f"kv_extract_fn layer {name!r}: batch {k.shape[0]} but input_ids has {len(ends)} rows")
    if not snapshot:
        return merged, merged_upto
    if merged is None:
        merged = {}
        for name, (k, v) in snapshot.items():
            B, H, _, D = k.shape
            merged[name] = (_nan_like(k, (B, H, total_len, D)), _nan_like(v, (B, v.shape[1], total_len, v.shape[3])))
    seq = min(min(k.shape[2], v.shape[2]) for k, v in snapshot.values())
    his = [min(e, seq, total_len) for e in ends]
    for name, (k, v) in snapshot.items():
        mk, mv = merged[name]
        for b, hi in enumerate(his):
            lo = merged_upto[b]
            if hi > lo:
                mk[b, :, lo:hi] = k[b, :, lo:hi]
                mv[b, :, lo:hi] = v[b, :, lo:hi]
    return merged, [max(u, hi) for u, hi in zip(merged_upto, his)]


def validate_logits(
    input_ids,
    generate_fn: Callable,
    expected_logits,
    tol_map=None,
    divergence_difference_tol: float | None = None,
    baseline_logits=None,
    kv_extract_fn: Callable | None = None,
    *,
    dynamic_threshold_config: dict | None = None,
    divergence_n_ulps: int | None = 1,
    mantissa_bits: int = 7,
    multimodal_inputs=None,
    kv_includes_last_token: bool = False,
) -> LogitValidationResult:
    """The teacher-forcing loop; ``logit_validation`` wraps it with the upstream return types.

    input_ids: one token-id list per batch row (rows may differ in length; each row's teacher
    tokens are appended to its own list; the caller's lists are not modified).
    generate_fn(input_ids) -> logits ``[n_new, batch, vocab]`` of the target's greedy
    continuation (torch or numpy; raw logits or log-softmax), or ``(logits, sequences
    [batch, n_new])`` when it samples itself. It may return more tokens than still needed: the
    surplus is ignored. Teacher tokens are the argmax of baseline (three-way) or expected.
    On the first divergence (any row), tokens up to and including the divergent one are
    validated, the teacher tokens up to and including it are appended, and generate_fn is
    called again from there.
    kv_extract_fn(seq_len) -> ``{layer: (k, v)}`` ``[batch, kv_head, seq, head_dim]``, row b
    holding that row's positions from 0; called after every generate_fn call with the number
    of positions the engine has written for the longest row: ``max input length + n_new - 1``
    (the last sampled token is never fed back; pass ``kv_includes_last_token=True`` for an
    engine that does feed it). Upstream passes ``input length of row 0 + n_new``.
    Merge rule: a position is copied once, from the first call in which its input token is the
    teacher's: all unmerged input positions, plus decode positions before the first divergent
    token. The divergent token's own KV (the engine fed its own, wrong token there) is taken
    from the next call's prefill instead. Row b of merged_kv holds its prompt at
    ``[0, len(prompt_b))`` and generation token g at ``len(prompt_b) + g``; anything never
    written stays NaN (upstream: 0, and it copies the divergent position from the wrong token).
    """
    rows_src = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    ids = [[int(t) for t in (row.tolist() if hasattr(row, "tolist") else row)] for row in rows_src]
    batch = len(ids)
    if batch == 0:
        raise ValueError("input_ids is empty: need one token list per batch row")
    expected = _logits_array(expected_logits, "expected_logits")
    three_way = baseline_logits is not None
    baseline = _logits_array(baseline_logits, "baseline_logits") if three_way else None
    if three_way and baseline.shape != expected.shape:
        raise ValueError(f"baseline_logits shape {baseline.shape} must match expected_logits shape {expected.shape}")
    T, B, V = expected.shape
    if B != batch:
        raise ValueError(f"expected_logits has batch {B} but input_ids has {batch} rows")
    if dynamic_threshold_config is None and three_way:
        dynamic_threshold_config = DEFAULT_DYNAMIC_THRESHOLD_CONFIG
    teacher_src = baseline if three_way else expected
    if np.isnan(teacher_src).any():
        raise ValueError("teacher logits (baseline in three-way, else expected) contain NaN")
    teacher = np.argmax(teacher_src, axis=-1).T  # [batch, gen_token]

    prompt_lens = [len(r) for r in ids]
    total_kv_len = max(prompt_lens) + T
    merged = None
    merged_upto = [0] * batch
    results = [[] for _ in range(batch)]
    calls = []
    passed = True
    start = 0
    while start < T:
        out = generate_fn(ids, multimodal_inputs=multimodal_inputs) if multimodal_inputs is not None else generate_fn(ids)
        sampled = None
        if isinstance(out, tuple):
            out, sampled = out
            sampled = np.asarray(to_numpy(sampled)).astype(np.int64)
        actual = _logits_array(out, "generate_fn output")
        n_raw = actual.shape[0]
        if n_raw == 0:
            raise RuntimeError(f"generate_fn returned no tokens at generation index {start}; the loop cannot advance")
        if actual.shape[1:] != (batch, V):
            raise ValueError(
                f"generate_fn returned logits {actual.shape} at generation index {start}; "
                f"expected [n_new, {batch}, {V}]"
            )
        if sampled is not None and sampled.shape != (batch, n_raw):
            raise ValueError(f"generate_fn sequences {sampled.shape} do not match logits {actual.shape} (want [batch, n_new])")
        n = min(n_raw, T - start)  # surplus tokens beyond the reference are ignored
        actual = actual[:n]
        act_tokens = sampled[:, :n] if sampled is not None else np.argmax(actual, axis=-1).T
        has_nan = bool(np.isnan(actual).any())
        diff = act_tokens != teacher[:, start : start + n]
        cols = np.nonzero(diff.any(axis=0))[0]
        div_col = int(cols[0]) if cols.size else None
        first_div = None if has_nan else div_col
        n_val = n if first_div is None else first_div + 1  # NaN: validate the whole step

        if kv_extract_fn is not None:
            fed = n_raw if kv_includes_last_token else n_raw - 1
            input_lens = [len(r) for r in ids]
            snapshot = kv_extract_fn(max(input_lens) + fed)
            clean = div_col if div_col is not None else n
            ends = [il + min(clean, fed) for il in input_lens]
            merged, merged_upto = _merge_kv(merged, snapshot, merged_upto, ends, total_kv_len)

        for b in range(batch):
            for j in range(n_val):
                g = start + j
                r = validate_token_logits(
                    expected[g, b],
                    actual[j, b],
                    tol_map=tol_map,
                    divergence_difference_tol=divergence_difference_tol,
                    actual_token_id=int(sampled[b, j]) if sampled is not None else None,
                    baseline=baseline[g, b] if three_way else None,
                    dynamic_threshold_config=dynamic_threshold_config if three_way else None,
                    divergence_n_ulps=divergence_n_ulps,
                    mantissa_bits=mantissa_bits,
                    gen_idx=g,
                    batch_row=b,
                )
                results[b].append(r)
                passed = passed and r.passed
        calls.append(
            {"start": start, "input_lens": [len(r) for r in ids], "returned": n_raw, "validated": n_val, "diverged_at": None if first_div is None else start + first_div}
        )
        if has_nan:  # NaN logits argmax to garbage: record the step, then stop re-prompting
            passed = False
            break
        for b in range(batch):
            ids[b].extend(int(t) for t in teacher[b, start : start + n_val])
        start += n_val
    return LogitValidationResult(bool(passed), results, merged, calls, three_way)


def logit_validation(
    input_ids,
    generate_fn: Callable,
    expected_logits,
    tol_map=None,
    divergence_difference_tol: float | None = None,
    baseline_logits=None,
    kv_extract_fn: Callable | None = None,
    **kwargs,
):
    """Upstream-compatible entry point (see ``validate_logits`` for the semantics).

    Returns, with plain Python bools (upstream sometimes returns a 0-dim tensor):
    two-way, no KV: ``passed``; two-way + KV: ``(passed, results, merged_kv)``;
    three-way, no KV: ``(passed, results)``; three-way + KV: ``(passed, results, merged_kv)``.
    ``results[batch_row][gen_token]`` is a ``TokenLogitResult``.
    """
    r = validate_logits(
        input_ids, generate_fn, expected_logits, tol_map, divergence_difference_tol, baseline_logits, kv_extract_fn, **kwargs
    )
    if kv_extract_fn is not None:
        return r.passed, r.results, r.merged_kv
    if r.three_way:
        return r.passed, r.results
    return r.passed
