"""Verdicts over prompts: one pass/fail record that says which check decided, with its numbers.

Why aggregate (DESIGN.md, "Verdicts and localisation"): one token x one layer of a small model
is ~100 error values in 100 bins, so a per-token ``BC >= 0.90`` rule fails most checks on a
correct BF16 engine. Both verdicts pool errors over tokens and prompts before thresholding, and
the KV verdict also measures how far the BF16-vs-FP32 noise agrees *with itself* at that sample
size, so the bar is never stricter than the noise allows.

Logits (``aggregate_logit_verdict``, rules as reference/002, in priority order):
1. sigma-ratio ``RMS(target errors) / RMS(BF16 errors)`` over every token of every prompt
   ``<= 1.0``: the target is at least as accurate as BF16 on CPU;
2. aggregate BC per generation index (errors of all prompts and rows at that index
   concatenated) ``>= 0.99`` at every index;
3. every token meets the static top-k thresholds and divergence rule (two-way).
Passes if any holds. (Upstream pools only batch row 0 and the first prompt's token count; here
every row and every generation index any prompt reached.)

KV (``aggregate_kv_verdict``), per layer and per K / V, over every token of every prompt:
- ``sigma_ratio = RMS(|actual - baseline|) / RMS(|expected - baseline|)``;
- ``bc`` between the pooled target and BF16 absolute errors;
- ``noise_bc``: BC between two halves (even / odd positions) of the BF16 errors themselves:
  what two samples of pure dtype noise reach at this size;
- ``linf_ratio``: per position (token x prompt) take the L-inf, the max absolute error over the
  layer's heads x head_dim; the ratio of the ``linf_quantile`` (0.75) quantile of the target's
  to the BF16's. ``noise_linf_spread``: the same ratio between the two BF16 halves (>= 1).
  A quantile, not the single largest error: the max of thousands of values is itself so noisy
  that a 1.5x max-ratio rule failed a third of simulated correct engines. The largest
  per-position L-inf still has a loose bar, ``max_linf_ratio`` <= ``max_linf_ratio_threshold``
  (4x), so one broken position among many (stale cache slot) cannot hide behind the quantile.
A tensor passes if ``sigma_ratio <= sigma_ratio_threshold`` or (``bc >= min(bc_threshold,
noise_bc - bc_noise_margin)`` and ``linf_ratio <= max(linf_ratio_threshold,
noise_linf_spread)`` and ``max_linf_ratio <= max_linf_ratio_threshold``). A layer passes if K and V pass; the verdict names the first failing
layer (a bug inside layer L first shows in the KV of layer L+1, since K/V come from its input).
With ``prompt_lens`` the same verdict is also given for prefill and decode positions apart.

Broken evidence never passes:
- a value that is non-finite in the actual run where both references are finite (a finite BF16
  error, a non-finite target error) fails its tensor, counted in ``n_nonfinite`` and named in
  ``KVVerdict.nonfinite``; the one exemption, for an actual run that declares it never feeds the
  last token back (``last_never_fed=True``: a decode-path or greedy capture samples the last
  teacher token, so never writes its KV), is a prompt's last position where the actual holds no
  finite value. A run that does write that position (a prefill over prompt + teacher tokens)
  gets no exemption: NaN there is broken evidence like anywhere else. NaN where the references are NaN too (sliding-window fill) is excluded, not failed, and so
  is any value where a reference is not finite (an inf there would count as infinite noise);
- a tensor with no value finite in all three runs is unjudged (``passed`` None); a layer with
  an unjudged or failing part does not pass, and neither does a verdict with such a layer.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from .bc import DEFAULT_BINS, bhattacharyya_coefficient, numba_available
from .kv import KVRawErrors, _layers_of, _raw_arrays, natural_sort_key
from .logits import LogitValidationResult

__all__ = [
    "LogitVerdict",
    "aggregate_logit_verdict",
    "KVVerdictConfig",
    "KVTensorVerdict",
    "KVLayerVerdict",
    "KVVerdict",
    "aggregate_kv_verdict",
]


# ----------------------------------------------------------------------------- logits


@dataclass(frozen=True)
class LogitVerdict:
    passed: bool
    decided_by: str | None  # "sigma_ratio" | "aggregate_bc" | "static_topk" | None (failed)
    three_way: bool
    sigma_ratio: float
    sigma_ratio_threshold: float
    per_token_bc: tuple  # aggregate BC per generation index
    min_bc: float
    min_bc_gen_idx: int | None
    bc_threshold: float
    static_passed: bool
    n_prompts: int
    n_tokens: int
    n_failed_tokens: int
    first_failed: tuple | None  # (prompt, batch_row, gen_idx) of the first failing token
    max_topk_errors: dict = field(default_factory=dict)
    per_token_max_linf_ratio: tuple = ()
    per_token_max_l2_ratio: tuple = ()

    @property
    def phase(self) -> str | None:
        """Where a failure starts (reference/002 triage): "prefill" when generation token 0
        fails a static check, else "decode"; None when passed or no token failed."""
        if self.passed or self.first_failed is None:
            return None
        return "prefill" if self.first_failed[2] == 0 else "decode"

    def summary(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        why = {
            "sigma_ratio": f"sigma-ratio {self.sigma_ratio:.4f} <= {self.sigma_ratio_threshold}",
            "aggregate_bc": f"aggregate BC min {self.min_bc:.4f} >= {self.bc_threshold}",
            "static_topk": "every token met the static top-k thresholds",
            None: (
                f"sigma-ratio {self.sigma_ratio:.4f} > {self.sigma_ratio_threshold}, aggregate BC min "
                f"{self.min_bc:.4f} < {self.bc_threshold} at gen token {self.min_bc_gen_idx}, "
                f"{self.n_failed_tokens}/{self.n_tokens} tokens failed static checks (first: {self.first_failed})"
            ),
        }[self.decided_by]
        return f"{head}: {why}"


def _prompt_rows(p):
    if isinstance(p, LogitValidationResult):
        return p.results
    if isinstance(p, tuple):  # (passed, results[, merged_kv]) as logit_validation returns
        return p[1]
    if isinstance(p, bool):
        raise ValueError(
            "a bare bool has no per-token results (two-way logit_validation without KV returns only "
            "passed); pass validate_logits(...) results instead"
        )
    return p


def aggregate_logit_verdict(
    per_prompt_results,
    tol_map=None,
    sigma_ratio_threshold: float = 1.0,
    bc_threshold: float = 0.99,
    bins: int = DEFAULT_BINS,
) -> LogitVerdict:
    """Verdict over prompts. per_prompt_results: one entry per prompt, each the
    ``results[batch_row][gen_token]`` of ``logit_validation`` (or its return tuple, or a
    ``LogitValidationResult``). Three-way checks run when every token carries three-way metrics.
    tol_map: None keeps each token's own pass/fail from validation; a map re-judges the stored
    top-k errors (keys as validated) for the static check."""
    prompts = [_prompt_rows(p) for p in per_prompt_results]
    tokens = [(pi, r.batch_row, r.gen_idx, r) for pi, rows in enumerate(prompts) for row in rows for r in row]
    n_tokens = len(tokens)

    def static_ok(r):
        if tol_map is None:  # as validated
            return r.passed
        # re-judge the stored errors against another map (e.g. reference/002's K5 < 0.011)
        return r.divergence_in_bounds and all(
            err <= tol_map[k][1] for k, err in r.error_map.items() if k in tol_map
        )

    failed = [(pi, b, g) for pi, b, g, r in tokens if not static_ok(r)]
    static_passed = n_tokens > 0 and not failed
    max_topk = {}
    for _, _, _, r in tokens:
        for k, err in r.error_map.items():
            max_topk[k] = max(max_topk.get(k, -math.inf), err) if not math.isnan(err) else math.nan
    three_way = n_tokens > 0 and all(r.three_way is not None and r.three_way.base_errors is not None for *_, r in tokens)

    sigma = math.inf
    per_bc, lr, l2r = [], [], []
    if three_way:
        sq_b = sum(float(np.sum(np.square(r.three_way.base_errors, dtype=np.float64))) for *_, r in tokens)
        sq_t = sum(float(np.sum(np.square(r.three_way.tgt_errors, dtype=np.float64))) for *_, r in tokens)
        n_b = sum(r.three_way.base_errors.size for *_, r in tokens)
        n_t = sum(r.three_way.tgt_errors.size for *_, r in tokens)
        base_rms, tgt_rms = math.sqrt(sq_b / max(n_b, 1)), math.sqrt(sq_t / max(n_t, 1))
        sigma = tgt_rms / base_rms if base_rms > 0 else (0.0 if tgt_rms == 0 else math.inf)
        n_gen = max(g for _, _, g, _ in tokens) + 1
        by_g = [[] for _ in range(n_gen)]
        for _, _, g, r in tokens:
            by_g[g].append(r.three_way)
        for ms in by_g:
            if not ms:
                per_bc.append(math.nan)
                lr.append(math.nan)
                l2r.append(math.nan)
                continue
            per_bc.append(
                bhattacharyya_coefficient(
                    np.concatenate([m.base_errors for m in ms]), np.concatenate([m.tgt_errors for m in ms]), bins=bins
                )
            )
            mb, mt = max(m.base_linf for m in ms), max(m.tgt_linf for m in ms)
            lr.append(mt / mb if mb > 0 else math.inf)
            mb, mt = max(m.base_l2 for m in ms), max(m.tgt_l2 for m in ms)
            l2r.append(mt / mb if mb > 0 else math.inf)
    valid_bc = [(b, g) for g, b in enumerate(per_bc) if not math.isnan(b)]
    min_bc, min_g = min(valid_bc) if valid_bc else (math.nan, None)
    sigma_ok = three_way and sigma <= sigma_ratio_threshold
    bc_ok = three_way and bool(valid_bc) and min_bc >= bc_threshold
    decided = "sigma_ratio" if sigma_ok else "aggregate_bc" if bc_ok else "static_topk" if static_passed else None
    return LogitVerdict(
        passed=decided is not None,
        decided_by=decided,
        three_way=three_way,
        sigma_ratio=sigma,
        sigma_ratio_threshold=sigma_ratio_threshold,
        per_token_bc=tuple(per_bc),
        min_bc=min_bc,
        min_bc_gen_idx=min_g,
        bc_threshold=bc_threshold,
        static_passed=static_passed,
        n_prompts=len(prompts),
        n_tokens=n_tokens,
        n_failed_tokens=len(failed),
        first_failed=min(failed, key=lambda f: (f[2], f[0], f[1])) if failed else None,
        max_topk_errors=max_topk,
        per_token_max_linf_ratio=tuple(lr),
        per_token_max_l2_ratio=tuple(l2r),
    )


# ----------------------------------------------------------------------------- KV


@dataclass(frozen=True)
class KVVerdictConfig:
    bc_threshold: float = 0.99
    bc_noise_margin: float = 0.02
    linf_ratio_threshold: float = 1.5
    sigma_ratio_threshold: float = 1.0
    linf_quantile: float = 0.75
    max_linf_ratio_threshold: float = 4.0
    bins: int = DEFAULT_BINS


@dataclass(frozen=True)
class KVTensorVerdict:
    """K or V of one layer, pooled over tokens and prompts."""

    passed: bool | None  # None: no valid error at all
    decided_by: str | None  # "sigma_ratio" | "bc_and_linf" | None
    n_values: int
    sigma_ratio: float
    bc: float
    noise_bc: float
    bc_threshold_used: float
    linf_ratio: float
    noise_linf_spread: float
    linf_threshold_used: float
    max_linf_ratio: float = math.nan
    n_nonfinite: int = 0  # values non-finite in the actual where both references are finite


@dataclass(frozen=True)
class KVLayerVerdict:
    layer: str
    passed: bool | None
    k: KVTensorVerdict
    v: KVTensorVerdict


@dataclass(frozen=True)
class KVVerdict:
    passed: bool
    first_failing_layer: str | None
    layers: tuple
    config: KVVerdictConfig
    n_prompts: int
    n_positions: int
    prefill: "KVVerdict | None" = None
    decode: "KVVerdict | None" = None
    # one dict per prompt x layer x K/V holding non-finite actual values where the references are
    # finite: prompt (id or index), layer, tensor ("K"/"V"), n (values), first_position
    nonfinite: tuple = ()
    run: str | None = None  # the actual run, for messages
    # the summary of a verdict that judged nothing ("not compared: ..." / "not judged: ..."); it
    # never passes and has no layers
    unjudged: str | None = None

    @classmethod
    def not_compared_because(cls, reason: str, config: KVVerdictConfig | None = None) -> "KVVerdict":
        """No KV was compared (e.g. the actual run lacks the references' KV)."""
        return cls(False, None, (), config or KVVerdictConfig(), 0, 0, unjudged=f"not compared: {reason}")

    @classmethod
    def not_judged_because(cls, reason: str, config: KVVerdictConfig | None = None) -> "KVVerdict":
        """KV was compared (its metrics exist) but there is nothing to judge it against."""
        return cls(False, None, (), config or KVVerdictConfig(), 0, 0, unjudged=f"not judged: {reason}")

    @property
    def unjudged_layers(self) -> tuple:
        return tuple(lv.layer for lv in self.layers if lv.passed is None)

    def summary(self) -> str:
        if self.unjudged is not None:
            return self.unjudged
        if self.passed:
            return f"PASS: {len(self.layers)} layers within the expected source's noise (BF16 vs FP32 in three-way mode) over {self.n_positions} positions"
        if self.nonfinite:
            r = self.nonfinite[0]
            more = len(self.nonfinite) - 1
            run = f"actual run {self.run}, " if self.run else "actual run, "
            return (
                f"FAIL: {run}prompt {r['prompt']}, layer {r['layer']} {r['tensor']}: {r['n']} non-finite values where "
                f"the references are finite (first at position {r['first_position']})"
                + (f"; {more} more prompt x layer x K/V like it" if more else "")
            )
        if self.first_failing_layer is None:
            return (f"FAIL: layers {list(self.unjudged_layers)} not judged: no value is finite in all three runs "
                    f"(actual, expected and baseline)")
        lv = next(v for v in self.layers if v.layer == self.first_failing_layer)
        t = lv.k if lv.k.passed is False else lv.v
        which = "K" if t is lv.k else "V"
        return (
            f"FAIL: first deviating KV layer {lv.layer} ({which}): BC {t.bc:.4f} vs bar {t.bc_threshold_used:.4f} "
            f"(noise BC {t.noise_bc:.4f}), L-inf ratio {t.linf_ratio:.2f} vs bar {t.linf_threshold_used:.2f}, "
            f"sigma-ratio {t.sigma_ratio:.3f}"
        )


def _tensor_verdict(base_chunks, tgt_chunks, cfg: KVVerdictConfig, n_nonfinite: int = 0,
                    fused: bool = True, numbers: KVTensorVerdict | None = None) -> KVTensorVerdict:
    """base_chunks/tgt_chunks: lists of [positions, width] arrays (one per prompt/row).
    n_nonfinite: values non-finite in the actual where the references are finite (any fails).
    fused=False: the numpy path only (a caller whose fused_tensor_numbers already declined);
    numbers: what the caller's fused_tensor_numbers(_many) gave for these chunks, if not None."""
    t = numbers if numbers is not None else \
        (_tensor_numbers if fused else _tensor_numbers_numpy)(base_chunks, tgt_chunks, cfg)
    if n_nonfinite:
        return dataclasses.replace(t, passed=False, decided_by=None, n_nonfinite=int(n_nonfinite))
    return t


def _finite_in_all_three(base_chunks, tgt_chunks):
    """The chunks with NaN wherever a BF16 or target error is not finite: only values finite in
    all three runs are judged. An inf reference value would count as infinite noise (sigma-ratio
    0: any bug passes); a non-finite actual value is counted apart (n_nonfinite) and fails."""
    pairs = [(b, t, np.isfinite(b) & np.isfinite(t)) for b, t in zip(base_chunks, tgt_chunks)]
    return ([np.where(ok, b, np.nan) for b, _, ok in pairs], [np.where(ok, t, np.nan) for _, t, ok in pairs])


def _all_finite(x) -> bool:
    """Whether every value of x is finite (two SIMD reductions; NaN propagates through them)."""
    with np.errstate(invalid="ignore"):
        return x.size == 0 or bool(np.isfinite(x.min()) and np.isfinite(x.max()))


def _pooled_bc(x, y, bins: int, finite: bool) -> float:
    """``bhattacharyya_coefficient(x, y)``; of two float32 samples known to be all finite in one
    call of the fused kernel when numba imports (same bins and counts, so the same bits: the
    numpy path's per-call overhead was most of a small module's verdict)."""
    if finite and x.size and y.size and x.dtype == y.dtype == np.float32 and numba_available():
        from . import _fused

        return _fused.pooled_bc(x, y, bins)
    return bhattacharyya_coefficient(x, y, bins=bins)


def _ratio(x: float, y: float) -> float:
    """x / y of two non-negative numbers, 0.0 for 0 / 0 and inf for x / 0."""
    return x / y if y > 0 else (0.0 if x == 0 else math.inf)


def _numbers_verdict(n, b_ms, t_ms, bc, noise_bc, q_b, q_t, q_even, q_odd, max_b, max_t,
                     cfg: KVVerdictConfig) -> KVTensorVerdict:
    """The rule over the pooled numbers: n values, mean squares of the BF16 (b_ms) and target
    (t_ms) errors, the two BCs, the linf_quantile quantiles of the per-position L-inf of the BF16
    errors, the target's and the even / odd BF16 positions, and the largest L-inf of each; a
    quantile or maximum is None where there is no position."""
    sigma = _ratio(math.sqrt(t_ms), math.sqrt(b_ms))
    nan = math.nan
    linf_ratio = nan if q_t is None or q_b is None else _ratio(q_t, q_b)
    max_ratio = nan if max_t is None or max_b is None else _ratio(max_t, max_b)
    r = nan if q_even is None or q_odd is None else _ratio(q_even, q_odd)
    spread = 1.0 if math.isnan(r) or r == 0 else max(r, 1.0 / r)
    bc_bar = cfg.bc_threshold if math.isnan(noise_bc) else min(cfg.bc_threshold, noise_bc - cfg.bc_noise_margin)
    linf_bar = max(cfg.linf_ratio_threshold, spread)
    if sigma <= cfg.sigma_ratio_threshold:
        passed, why = True, "sigma_ratio"
    elif bc >= bc_bar and linf_ratio <= linf_bar and max_ratio <= cfg.max_linf_ratio_threshold:
        passed, why = True, "bc_and_linf"
    else:
        passed, why = False, None
    return KVTensorVerdict(passed, why, n, sigma, bc, noise_bc, bc_bar, linf_ratio, spread, linf_bar, max_ratio)


def _pooled_kernels(cfg: KVVerdictConfig):
    """``metrics._fused`` where its pooled kernel may judge under cfg, else None: no numba, a
    quantile that is not a number in [0, 1], or a numpy that sums or interpolates quantiles
    otherwise than the kernel replays (checked once per process, here)."""
    q = cfg.linf_quantile
    if not (numba_available() and isinstance(q, (int, float)) and 0 <= q <= 1):
        return None
    from . import _fused

    return _fused if _fused.pairwise_order_holds() and _fused.quantile_rule_holds(q) else None


def _kernel_verdict(r, cfg: KVVerdictConfig) -> KVTensorVerdict | None:
    """The rule over the pooled kernel's numbers (a dict of ``pooled_verdict_numbers``), None
    where the kernel declined."""
    if r is None:
        return None
    n = r["n"]
    return _numbers_verdict(n, r["ss_b"] / n, r["ss_t"] / n, r["bc"], r["noise_bc"], r["q_b"], r["q_t"], r["q_even"],
                            r["q_odd"], r["max_b"], r["max_t"], cfg)


def fused_tensor_numbers(base_chunks, tgt_chunks, cfg: KVVerdictConfig) -> KVTensorVerdict | None:
    """``_tensor_numbers`` in one pass of ``metrics._fused.pooled_verdict_numbers`` over the
    chunks as they lie, or None where it does not apply: no numba, a numpy that sums or
    interpolates quantiles otherwise than the kernel replays (checked once), a chunk that is not
    float32, a value that is not finite or below +0 (absolute errors of a correct engine are
    neither)."""
    fused = _pooled_kernels(cfg)
    if fused is None:
        return None
    return _kernel_verdict(fused.pooled_verdict_numbers(base_chunks, tgt_chunks, cfg.bins, cfg.linf_quantile), cfg)


def start_fused_tensor_numbers_at(pools, cfg: KVVerdictConfig):
    """``fused_tensor_numbers`` of pools whose chunks are given by where they lie: per pool
    ``[(base_address, target_address, rows, width), ...]``, float32 ``[rows, width]``
    C-contiguous errors the caller keeps alive (``metrics.modules.ModuleJudge``'s, written by
    its fused kernel). Many pools a kernel call, on the threads
    (``metrics._fused.pooled_verdict_numbers_at``); the same numbers as
    ``fused_tensor_numbers`` of the arrays there. A pool gets None where that would (no numba,
    the order checks, a value not finite). Started: returns ``finish()`` (called exactly once),
    which waits for the kernels and returns that list; the caller's Python in between runs
    beside them."""
    fused = _pooled_kernels(cfg) if pools else None
    if fused is None:
        return lambda: [None] * len(pools)
    wait = fused.start_pooled_verdict_numbers_at(pools, cfg.bins, cfg.linf_quantile)
    return lambda: [_kernel_verdict(r, cfg) for r in wait()]


def fused_tensor_numbers_many(pools, cfg: KVVerdictConfig) -> list:
    """``fused_tensor_numbers`` of each ``(base_chunks, tgt_chunks)`` pool, in order: the first
    here (the once-per-process order checks run in it), the rest shared across
    ``metrics._fused``'s threads (the kernel releases the GIL; each pool's numbers are its own,
    so the same bits whichever thread computes them)."""
    out: list = [None] * len(pools)
    if not pools:
        return out
    out[0] = fused_tensor_numbers(*pools[0], cfg)
    if len(pools) > 1 and numba_available():
        from . import _fused

        def one(i):
            out[i] = fused_tensor_numbers(*pools[i], cfg)

        _fused._run_tasks([functools.partial(one, i) for i in range(1, len(pools))])
    else:
        out[1:] = [fused_tensor_numbers(*p, cfg) for p in pools[1:]]
    return out


def _tensor_numbers(base_chunks, tgt_chunks, cfg: KVVerdictConfig) -> KVTensorVerdict:
    """The pooled numbers and pass / fail of one tensor (see the module docstring): in one pass of
    the fused kernel where it applies, else by numpy; the same numbers either way, bit for bit
    (tests/metrics/test_verdict_fused.py)."""
    fused = fused_tensor_numbers(base_chunks, tgt_chunks, cfg)
    return fused if fused is not None else _tensor_numbers_numpy(base_chunks, tgt_chunks, cfg)


def _tensor_numbers_numpy(base_chunks, tgt_chunks, cfg: KVVerdictConfig) -> KVTensorVerdict:
    """``_tensor_numbers`` by numpy: any dtype, NaN and inf masked (the reference path)."""
    def cat(chunks):
        return np.concatenate([c.ravel() for c in chunks]) if chunks else np.zeros(0, np.float32)

    base, tgt = cat(base_chunks), cat(tgt_chunks)
    # Every value finite (a correct engine): nothing to mask, so the masking copies are skipped;
    # the arrays below hold the same values either way.
    finite = _all_finite(base) and _all_finite(tgt)
    if finite:
        n = base.size
    else:
        base_chunks, tgt_chunks = _finite_in_all_three(base_chunks, tgt_chunks)
        base, tgt = cat(base_chunks), cat(tgt_chunks)
        ok = ~(np.isnan(base) | np.isnan(tgt))
        n = int(np.count_nonzero(ok))
        base, tgt = base[ok], tgt[ok]
    if n == 0:
        nan = math.nan
        return KVTensorVerdict(None, None, 0, nan, nan, nan, nan, nan, nan, nan)
    b, t = base.astype(np.float64), tgt.astype(np.float64)
    b_ms, t_ms = float(np.mean(b * b)), float(np.mean(t * t))
    bc = _pooled_bc(base, tgt, cfg.bins, finite)
    # Per-position L-inf (max over width), pooled over chunks; positions with no value dropped.
    def pos_linf(chunks):
        out = [np.fmax.reduce(c.reshape(c.shape[0], -1), axis=1) for c in chunks if c.size]
        out = np.concatenate(out) if out else np.zeros(0)
        return out[~np.isnan(out)]

    def quantile(x):
        return float(np.quantile(x, cfg.linf_quantile)) if x.size else None

    with np.errstate(invalid="ignore"):
        base_pos, tgt_pos = pos_linf(base_chunks), pos_linf(tgt_chunks)
        q_b, q_t = quantile(base_pos), quantile(tgt_pos)
        max_b = float(base_pos.max()) if base_pos.size else None
        max_t = float(tgt_pos.max()) if tgt_pos.size else None
        # The BF16 noise against itself: even vs odd positions of every chunk.
        even_pos, odd_pos = pos_linf([c[0::2] for c in base_chunks]), pos_linf([c[1::2] for c in base_chunks])
    even = np.concatenate([c[0::2].ravel() for c in base_chunks]) if base_chunks else np.zeros(0)
    odd = np.concatenate([c[1::2].ravel() for c in base_chunks]) if base_chunks else np.zeros(0)
    if not finite:
        even, odd = even[~np.isnan(even)], odd[~np.isnan(odd)]
    noise_bc = _pooled_bc(even, odd, cfg.bins, finite) if even.size and odd.size else math.nan
    return _numbers_verdict(n, b_ms, t_ms, bc, noise_bc, q_b, q_t, quantile(even_pos), quantile(odd_pos), max_b,
                            max_t, cfg)


def _both(a, b):
    """Pass state of a whole from two parts: False if either failed, None (unjudged) if either
    is unjudged, else True: a NULL part never reads as a pass."""
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def _nonfinite_counts(base, tgt, last_never_fed: bool = False):
    """[positions, layer] counts of non-finite target errors where the BF16 error is finite, i.e.
    actual non-finite where expected and baseline are finite. With ``last_never_fed`` a last
    position where the actual holds no finite value is exempt (never fed back, so never written)."""
    with np.errstate(invalid="ignore"):
        counts = np.count_nonzero(~np.isfinite(tgt) & np.isfinite(base), axis=-1)
    if last_never_fed and counts.shape[0]:
        unwritten = np.all(np.isnan(tgt[-1]), axis=-1)  # [layer]
        counts[-1, unwritten] = 0
    return counts


def _kv_verdict_over(chunks, layers, cfg, n_prompts, n_positions) -> KVVerdict:
    """chunks: list of (base_k, base_v, tgt_k, tgt_v, bad_k, bad_v), the first four
    [positions, layer, width], the non-finite counts [positions, layer]."""
    # every layer's K and V pools through the fused pass first, on the threads; numpy for the rest
    pools = [([c[kv][:, li] for c in chunks], [c[kv + 2][:, li] for c in chunks])
             for li in range(len(layers)) for kv in (0, 1)]
    numbers = fused_tensor_numbers_many(pools, cfg)
    lvs = []
    for li, name in enumerate(layers):
        k, v = (_tensor_verdict(*pools[2 * li + kv], cfg, sum(int(c[kv + 4][:, li].sum()) for c in chunks),
                                fused=False, numbers=numbers[2 * li + kv]) for kv in (0, 1))
        lvs.append(KVLayerVerdict(name, _both(k.passed, v.passed), k, v))
    first = next((lv.layer for lv in lvs if lv.passed is False), None)
    passed = bool(lvs) and all(lv.passed is True for lv in lvs)
    return KVVerdict(passed, first, tuple(lvs), cfg, n_prompts, n_positions)


def aggregate_kv_verdict(
    all_raw_errors,
    prompt_lens=None,
    layers=None,
    config: KVVerdictConfig | None = None,
    rows=None,
    prompt_ids=None,
    run: str | None = None,
    last_never_fed: bool = False,
) -> KVVerdict:
    """KV verdict over prompts (see module docstring for the rule).

    all_raw_errors: one entry per prompt from ``compare_kv_caches(..., return_raw_errors=True)``
    (``KVRawErrors`` or the upstream list over tokens of ``{layer: TokenKVErrors}``), or a single
    ``KVRawErrors``. prompt_lens: optional, one per prompt; adds ``.prefill`` (positions before
    the prompt end) and ``.decode`` verdicts. rows: batch rows of ``KVRawErrors`` to pool
    (default: all; upstream-shaped lists have one). prompt_ids (one per entry) and run (the
    actual run) only name where non-finite values were found. last_never_fed: the actual run
    never feeds each prompt's last token back (its KV there is exempt when wholly unwritten);
    False (default) for a run that writes every position.
    """
    cfg = config or KVVerdictConfig()
    if isinstance(all_raw_errors, KVRawErrors):
        all_raw_errors = [all_raw_errors]
    if not all_raw_errors:
        raise ValueError("no raw errors to judge")
    if prompt_lens is not None and len(prompt_lens) != len(all_raw_errors):
        raise ValueError(f"{len(all_raw_errors)} raw-error entries but {len(prompt_lens)} prompt lengths")
    if layers is None:
        layers = _layers_of(all_raw_errors[0])
    layers = list(layers)
    if prompt_ids is not None and len(prompt_ids) != len(all_raw_errors):
        raise ValueError(f"{len(all_raw_errors)} raw-error entries but {len(prompt_ids)} prompt ids")
    chunks, plens, nonfinite = [], [], []
    for pi, raw in enumerate(all_raw_errors):
        use_rows = (rows if rows is not None else range(raw.base_k.shape[0])) if isinstance(raw, KVRawErrors) else [0]
        for r in use_rows:
            arrs = _raw_arrays(raw, layers, r)
            bad = (_nonfinite_counts(arrs[0], arrs[2], last_never_fed), _nonfinite_counts(arrs[1], arrs[3], last_never_fed))
            chunks.append((*arrs, *bad))
            plens.append(None if prompt_lens is None else int(prompt_lens[pi]))
            label = prompt_ids[pi] if prompt_ids is not None else pi
            if len(use_rows) > 1:
                label = f"{label} row {r}"
            for li, name in enumerate(layers):
                for which, counts in zip("KV", bad):
                    col = counts[:, li]
                    if col.any():
                        nonfinite.append({"prompt": label, "layer": name, "tensor": which, "n": int(col.sum()),
                                          "first_position": int(np.flatnonzero(col)[0])})
    nonfinite.sort(key=lambda f: (natural_sort_key(f["layer"]), f["tensor"]))  # first layer first: a bug's origin
    n_pos = sum(c[0].shape[0] for c in chunks)
    verdict = dataclasses.replace(_kv_verdict_over(chunks, layers, cfg, len(all_raw_errors), n_pos),
                                  nonfinite=tuple(nonfinite), run=run)
    if prompt_lens is None:
        return verdict
    pre = [tuple(a[:p] for a in c) for c, p in zip(chunks, plens)]
    dec = [tuple(a[p:] for a in c) for c, p in zip(chunks, plens)]
    prefill = _kv_verdict_over(pre, layers, cfg, len(all_raw_errors), sum(c[0].shape[0] for c in pre))
    decode = _kv_verdict_over(dec, layers, cfg, len(all_raw_errors), sum(c[0].shape[0] for c in dec))
    return dataclasses.replace(verdict, prefill=prefill, decode=decode)
