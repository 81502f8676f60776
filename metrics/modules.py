"""Module tensors, three-way: per module and phase, is the target's error beyond BF16 noise, and
which module is the first where it is.

Roles as everywhere (DESIGN.md): baseline = FP32 reference, expected = BF16 reference, actual =
the target. Per prompt, module and phase (``prefill`` / ``decode``) the tensors are
``[token, ...]`` (trailing dims flattened to one width); per token:
- ``base_*``: expected vs baseline, ``tgt_*``: actual vs baseline; ``linf`` / ``l2`` are the
  relative errors of ``metrics.errors`` and ``cos`` the cosine, ``*_ratio = tgt / base``
  (reference/002's L-inf and L2 ratios), ``bc``: BC of the token's target vs BF16 absolute errors.

Verdict (``judge_modules``): the KV verdict's noise-relative rule, unchanged
(``metrics.verdict._tensor_verdict``, see its docstring): the absolute errors of every token of
every prompt of one module and phase are pooled before thresholding; sigma-ratio, pooled BC
against the BF16 noise's own BC (even vs odd positions), 0.75-quantile per-position L-inf ratio
against the noise's own spread, loose max L-inf ratio. With ``rule="max_l2_ratio"`` the static
fallback of reference/002 decides instead: every token's L2 ratio ``< max_l2_ratio`` (3.0).
Either way a module fails on
- a shape that differs between the roles (named with the shapes),
- a non-finite target value where both references are finite (NaN in the target),
and is unjudged (``passed`` None: never a pass) when no value is finite in all three.

Positions the target never computed (prompt positions a vLLM engine served from its prefix cache,
``extractors.vllm_modules.NOT_COMPUTED``) are left out before anything is measured and counted
(``ModuleJudge.add_not_computed``, ``ModuleVerdict.n_not_computed``): they are never judged equal,
and a module and phase with nothing but them is unjudged (never a pass).

Localisation: ``first_failing_module`` in execution order: phases in time order (prefill,
then decode), modules within a phase in the order they finish (the capture's ``module_order``).
``layer`` is the decoder-layer index from the name (``model.layers.3.mlp`` -> 3), None for
modules outside the decoder layers (embedding, final norm, LM head); ``position`` the first
position (smallest over prompts) whose target L2 error exceeds every BF16 L2 error of that
module and phase, else the position of the largest L2 ratio; ``token`` the same as a generation
token index, ``position - prompt_len`` (negative in the prompt; decode step n is token n), as
the KV tables count it.

numpy only; no store, no engine.
"""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .bc import DEFAULT_BINS, bhattacharyya_batched, numba_available
from .errors import COS_EPS, EPS, as_float, cosine, rel_l2, rel_linf
from .verdict import (KVTensorVerdict, KVVerdictConfig, _all_finite, _tensor_verdict, fused_tensor_numbers_many,
                      start_fused_tensor_numbers_at)

__all__ = [
    "PHASE_ORDER",
    "MODULE_KV_CONFIG",
    "ModuleVerdictConfig",
    "ModuleTokenMetrics",
    "ModuleVerdict",
    "ModulesVerdict",
    "module_layer",
    "compare_module_tensors",
    "compare_module_tensors_many",
    "align_decode_captures",
    "ModuleJudge",
    "judge_modules",
    "first_failing_module",
    "compare_captures_three_way",
]

PHASE_ORDER = ("prefill", "decode")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|:|$)")


def module_layer(module: str) -> int | None:
    """Decoder-layer index in a module name (``model.layers.3.mlp`` -> 3); None outside the layers."""
    m = _LAYER.search(module)
    return int(m.group(1)) if m else None


# The KV rule with a BC margin below the noise's own BC of 0.005, not 0.02: module outputs pool
# thousands of values per token, so two halves of BF16 noise agree to ~0.995 and a margin of 0.02
# let a 1% MLP-output error (BC 0.988, sigma-ratio 1.24 on the tiny Llama) pass; correct BF16
# engines measured 0.997-0.998 (HF eager vs SDPA attention).
MODULE_KV_CONFIG = KVVerdictConfig(bc_noise_margin=0.005)


@dataclass(frozen=True)
class ModuleVerdictConfig:
    kv: KVVerdictConfig = MODULE_KV_CONFIG
    rule: str = "noise"  # "noise" (the KV rule) | "max_l2_ratio" (reference/002's static fallback)
    max_l2_ratio: float = 3.0
    bins: int = DEFAULT_BINS

    def __post_init__(self):
        if self.rule not in ("noise", "max_l2_ratio"):
            raise ValueError(f"module verdict rule must be 'noise' or 'max_l2_ratio', got {self.rule!r}")


@dataclass(frozen=True)
class ModuleTokenMetrics:
    """One prompt x module x phase; every array ``[token]`` except the errors ``[token, width]``."""

    module: str
    phase: str
    positions: np.ndarray
    base_linf: np.ndarray
    tgt_linf: np.ndarray
    linf_ratio: np.ndarray
    base_l2: np.ndarray
    tgt_l2: np.ndarray
    l2_ratio: np.ndarray
    base_cos: np.ndarray
    tgt_cos: np.ndarray
    bc: np.ndarray
    base_err: np.ndarray  # |expected - baseline| float32
    tgt_err: np.ndarray  # |actual - baseline| float32

    def to_columns(self) -> dict:
        return {"position": self.positions.astype(np.int64), **{
            k: getattr(self, k).astype(np.float64) for k in
            ("base_linf", "tgt_linf", "linf_ratio", "base_l2", "tgt_l2", "l2_ratio", "base_cos", "tgt_cos", "bc")}}


def _ratio(t, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(b > 0, t / np.where(b > 0, b, 1.0), np.where(t == 0, 0.0, np.inf))
    return np.where(np.isnan(t) | np.isnan(b), np.nan, r)


def _as_tokens(x, what: str) -> np.ndarray:
    a = as_float(x, np.float32)
    if a.ndim == 0:
        raise ValueError(f"{what}: a module tensor needs a token axis, got a scalar")
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))  # not -1: a tensor of no token has a width too


def _fast_token_metrics(b, e, a, base_err, tgt_err, row_max=None):
    """Per-row rel L-inf, rel L2 (float32 pairwise sums) and cosine (float64 dot products) of e and a
    against b, NaN-free: the definitions of metrics.errors. An infinite target value gives inf / NaN
    metrics (judged by the verdict), not a numpy RuntimeWarning, as metrics.errors does. row_max:
    the row maxima of ``|b|``, base_err and tgt_err when the caller has them."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _fast_token_metrics_(b, e, a, base_err, tgt_err, row_max)


def _fast_token_metrics_(b, e, a, base_err, tgt_err, row_max):
    b_max, be_max, te_max = row_max or (np.abs(b).max(axis=1), base_err.max(axis=1), tgt_err.max(axis=1))

    def dot(x, y):
        return np.einsum("ij,ij->i", x, y, dtype=np.float64)

    return _metrics_from_sums(b_max, be_max, te_max, dot(b, b), dot(base_err, base_err), dot(tgt_err, tgt_err),
                              dot(b, e), dot(e, e), dot(b, a), dot(a, a))


def _metrics_from_sums(b_max, be_max, te_max, nb2, be2, te2, b_e, e_e, b_a, a_a):
    """The six per-row metrics from the row maxima (float32) and the float64 row sums
    (``b.b, be.be, te.te, b.e, e.e, b.a, a.a``), however they were summed."""
    ref_max = np.maximum(b_max.astype(np.float64), EPS)
    bl = be_max / ref_max
    tl = te_max / ref_max
    ref_l2 = np.maximum(np.sqrt(nb2), EPS)
    b2 = np.sqrt(be2) / ref_l2
    t2 = np.sqrt(te2) / ref_l2
    nb = np.maximum(np.sqrt(nb2), COS_EPS)

    def cos(bx, xx):
        return bx / (nb * np.maximum(np.sqrt(xx), COS_EPS))

    return bl, tl, b2, t2, cos(b_e, e_e), cos(b_a, a_a)


_FLOAT32 = np.dtype(np.float32)
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _checked(baseline, expected, actual, module, phase, positions, keep_bf16=False):
    """The three tensors as float32 ``[token, width]`` and the positions ``[token]``; ``ValueError``
    naming the module when the shapes differ or the positions do not fit. keep_bf16: a bfloat16
    numpy tensor is kept as it is (``[token, width]``, not widened): for the fused kernel, which
    reads its bits and widens them as it reads (``_widen_parts`` widens it for anything else)."""
    if (type(baseline) is np.ndarray and type(expected) is np.ndarray and type(actual) is np.ndarray
            and baseline.ndim and baseline.shape == expected.shape == actual.shape
            and (baseline.dtype == _FLOAT32 or keep_bf16 and baseline.dtype == _BFLOAT16)
            and (expected.dtype == _FLOAT32 or keep_bf16 and expected.dtype == _BFLOAT16)
            and (actual.dtype == _FLOAT32 or keep_bf16 and actual.dtype == _BFLOAT16)):
        # float32 (or kept bfloat16) numpy tensors (a capture read back, positions given or not):
        # what the general path below gives, without its per-tensor conversions (~10 us a tensor,
        # 142 tensors a prompt; the store comparator, which passes positions, took the general path)
        n = baseline.shape[0]
        if baseline.ndim == 2:  # already [token, width] (most module outputs): no views to make
            b, e, a = baseline, expected, actual
        else:
            w = math.prod(baseline.shape[1:])
            b, e, a = baseline.reshape(n, w), expected.reshape(n, w), actual.reshape(n, w)
    else:
        shapes = [tuple(np.shape(x)) for x in (baseline, expected, actual)]
        if len(set(shapes)) != 1:
            raise ValueError(f"module {module} ({phase}): shapes differ: baseline {shapes[0]}, expected "
                             f"{shapes[1]}, actual {shapes[2]}")
        b, e, a = (_as_tokens(x, f"module {module} ({phase})") for x in (baseline, expected, actual))
    pos = np.arange(b.shape[0]) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos.shape != (b.shape[0],):
        raise ValueError(f"module {module} ({phase}): {pos.size} positions for {b.shape[0]} tokens")
    return b, e, a, pos


def _c_order(x: np.ndarray) -> np.ndarray:
    """x in C order (itself where it is): numpy's row sums (einsum) and reductions add in memory
    order, so a Fortran-ordered or strided tensor gave an L2 or cosine one ulp from the same
    values in C order, and from the fused kernel, which reads every tensor as C-ordered rows."""
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _nan_aware_metrics(b, e, a):
    """The six per-row metrics (L-inf, L2, cosine of e and of a against b) by the NaN-aware
    reductions of ``metrics.errors``: a tensor holding a NaN error or an infinite baseline value."""
    b, e, a = _c_order(as_float(b)), _c_order(as_float(e)), _c_order(as_float(a))
    return rel_linf(b, e), rel_linf(b, a), rel_l2(b, e), rel_l2(b, a), cosine(b, e), cosine(b, a)


def compare_module_tensors(baseline, expected, actual, module: str = "", phase: str = "",
                           positions=None, bins: int = DEFAULT_BINS) -> ModuleTokenMetrics:
    """Per-token three-way metrics of one module output. baseline, expected, actual:
    ``[token, ...]`` (same shape; ``ValueError`` naming the module and the three shapes if not).
    positions: ``[token]`` sequence positions of the rows (default ``0 .. token-1``)."""
    b, e, a, pos = _checked(baseline, expected, actual, module, phase, positions)
    b, e, a = _c_order(b), _c_order(e), _c_order(a)
    with np.errstate(invalid="ignore", over="ignore"):
        base_err, tgt_err = np.abs(e - b), np.abs(a - b)
        clean = not (np.isnan(base_err).any() or np.isnan(tgt_err).any() or np.isinf(b).any())
    if clean:  # one float32 pass per quantity (the reductions of metrics.errors, without its NaN handling)
        bl, tl, b2, t2, bcos, tcos = _fast_token_metrics(b, e, a, base_err, tgt_err)
    else:
        bl, tl, b2, t2, bcos, tcos = _nan_aware_metrics(b, e, a)
    bc = bhattacharyya_batched(base_err, tgt_err, bins=bins)
    return ModuleTokenMetrics(module, phase, pos, bl, tl, _ratio(tl, bl), b2, t2, _ratio(t2, b2), bcos, tcos, bc,
                              base_err, tgt_err)


# Tensors narrower than this are compared one by one: batching them would put more rows in one BC
# step than the numpy histogram's float32 bin offsets hold exactly (metrics.bc, nrows * bins < 2**24).
_MIN_BATCH_WIDTH = 4


def compare_module_tensors_many(items, bins: int = DEFAULT_BINS) -> list:
    """``compare_module_tensors`` of many tensors at once, with the same results bit for bit.

    items: ``(baseline, expected, actual, module, phase, positions)`` tuples; returns one
    ``ModuleTokenMetrics`` per item, in order (a bad item raises its ``ValueError`` as the single
    form does). Every metric is a function of one token row, so the rows of all tensors are
    computed together: with numba, one fused pass over every row of every width
    (``_fused_rows``) and each metric column once over all rows; without it, each quantity once
    over the stacked rows of each width (a tiny model's module tensors are a few rows each,
    where per-call overhead, not arithmetic, took the time). A tensor holding a non-finite value
    takes the NaN-aware reductions of ``metrics.errors`` for its own rows, as the single form
    does; its BC is computed per row either way (NaN excluded)."""
    return _compare_many(items, bins)[0]


def _compare_many(items, bins):
    """``compare_module_tensors_many``, and where each result's errors lie: per item
    ``(base_err address, tgt_err address, rows, width)`` where the fused kernel wrote them
    (float32 ``[rows, width]`` C-contiguous, in memory the result's arrays keep alive), else None. The judge hands
    the addresses to the pooled kernel (``metrics._fused.pooled_verdict_numbers_at``)."""
    return _start_many(items, bins)()


def _start_many(items, bins):
    """``_compare_many`` begun: the items are checked (a bad one raises here, nothing started),
    the fused kernels started on the threads and the results made as views of what they will
    write; returns ``finish()``, which waits for the kernels (the calling thread takes its share),
    fills the metric columns and returns ``(out, where)``. Until ``finish()`` returns, the results'
    numbers are not final; the caller calls it exactly once (``ModuleJudge.add_prompts`` prepares
    the next prompt in between, while the threads compute this one's)."""
    where: list = [None] * len(items)
    checked = [(_checked(b, e, a, m, ph, pos, keep_bf16=True), m, ph) for b, e, a, m, ph, pos in items]
    out: list = [None] * len(checked)
    batch = []
    for i, ((b, _, _, _), _, _) in enumerate(checked):
        if b.shape[1] >= _MIN_BATCH_WIDTH and b.shape[0]:
            batch.append(i)
        else:
            (b, e, a, pos), m, ph = checked[i]
            out[i] = compare_module_tensors(b, e, a, m, ph, pos, bins=bins)
    if not batch:
        return lambda: (out, where)
    job = _fused_rows([checked[i][0][:3] for i in batch], bins)
    if job is None:
        groups: dict[int, list[int]] = {}
        for i in batch:
            groups.setdefault(checked[i][0][0].shape[1], []).append(i)
        for idx in groups.values():
            _many_numpy(checked, idx, bins, out)
        return lambda: (out, where)
    # The results are views of the job's outputs and of the columns filled in finish(): made while
    # the kernels run (this thread's Python beside the threads' kernels). Should making them fail,
    # the job is waited for here (the threads never left with tasks of a job nobody waits for).
    try:
        parts = [checked[i][0] for i in batch]
        bounds = list(itertools.accumulate((p[0].shape[0] for p in parts), initial=0))
        cols = np.empty((8, job.rows))  # bl, tl, lr, b2, t2, l2r, bcos, tcos
        bl, tl, lr, b2, t2, l2r, bcos, tcos = cols
        v0 = 0
        at_b, at_t = job.be.ctypes.data, job.te.ctypes.data
        for k, i in enumerate(batch):  # ~4 us a tensor: 1,136 a tiny model's 8 prompts
            b, _, _, pos = parts[k]
            m, n = b.shape
            r = slice(bounds[k], bounds[k + 1])
            v1 = v0 + b.size
            out[i] = _token_metrics(checked[i][1], checked[i][2], pos, bl[r], tl[r], lr[r], b2[r], t2[r], l2r[r],
                                    bcos[r], tcos[r], job.bc[r], job.be[v0:v1].reshape(m, n),
                                    job.te[v0:v1].reshape(m, n))
            where[i] = (at_b + 4 * v0, at_t + 4 * v0, m, n)
            v0 = v1
    except BaseException:
        job.finish()
        raise

    def finish():
        _, _, sums, maxes, _, bad = job.finish()
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            cols[[0, 1, 3, 4, 6, 7]] = _metrics_from_sums(*maxes.T, *sums.T)
        row_bad = bad == 1
        if row_bad.any():  # a NaN error or an infinite baseline value: the single form's NaN-aware path
            bad_before = np.concatenate([[0], np.cumsum(row_bad)])
            for k in np.flatnonzero(bad_before[bounds[1:]] != bad_before[bounds[:-1]]):
                r0, r1 = bounds[k], bounds[k + 1]
                for c, f in zip((bl, tl, b2, t2, bcos, tcos), _nan_aware_metrics(*parts[k][:3])):
                    c[r0:r1] = f
                m = out[batch[k]]  # a NaN error: the row's BC excludes it (metrics.bc), row by row
                rb = row_bad[r0:r1]
                if rb.any():
                    m.bc[rb] = bhattacharyya_batched(m.base_err[rb], m.tgt_err[rb], bins=bins)
        lr[:] = _ratio(tl, bl)
        l2r[:] = _ratio(t2, b2)
        return out, where
    return finish


_TOKEN_FIELDS = tuple(ModuleTokenMetrics.__dataclass_fields__)


def _token_metrics(*values) -> ModuleTokenMetrics:
    """``ModuleTokenMetrics(*values)`` without the frozen dataclass's ``__init__`` (an
    ``object.__setattr__`` per field: 1.6 us against 0.8, 1,136 results in a tiny model's
    8-prompt compare); the same object (no ``__post_init__`` to run)."""
    m = object.__new__(ModuleTokenMetrics)
    m.__dict__.update(zip(_TOKEN_FIELDS, values))
    return m


def _many_numpy(checked, idx, bins, out):
    """The tensors ``checked[idx]`` (one width) by numpy over their rows stacked, in float32,
    into ``out[idx]``: the path where the fused kernel does not apply."""
    parts = _widen_parts([checked[i][0] for i in idx])
    bounds = np.cumsum([0] + [p[0].shape[0] for p in parts])
    # C order whatever the parts' (np.concatenate keeps Fortran order): as the fused kernel reads them
    b = _c_order(np.concatenate([p[0] for p in parts]))
    e = _c_order(np.concatenate([p[1] for p in parts]))
    a = _c_order(np.concatenate([p[2] for p in parts]))
    with np.errstate(invalid="ignore", over="ignore"):
        base_err, tgt_err = np.abs(e - b), np.abs(a - b)
        # the row maxima the L-inf needs also find the rows the single form would not call clean:
        # a NaN error propagates through max, an infinite baseline value makes max |b| infinite
        row_max = (np.abs(b).max(axis=1), base_err.max(axis=1), tgt_err.max(axis=1))
        row_bad = np.isnan(row_max[1]) | np.isnan(row_max[2]) | np.isinf(row_max[0])
    bad_before = np.concatenate([[0], np.cumsum(row_bad)])
    clean = bad_before[bounds[1:]] == bad_before[bounds[:-1]]  # per tensor
    if clean.all():
        cols = list(_fast_token_metrics(b, e, a, base_err, tgt_err, row_max))
    else:
        cols = [np.empty(b.shape[0]) for _ in range(6)]
        rows = np.repeat(clean, np.diff(bounds))
        if rows.any():
            fast = _fast_token_metrics(b[rows], e[rows], a[rows], base_err[rows], tgt_err[rows])
            for c, f in zip(cols, fast):
                c[rows] = f
        for k in np.flatnonzero(~clean):
            r0, r1 = bounds[k], bounds[k + 1]
            for c, f in zip(cols, _nan_aware_metrics(*parts[k][:3])):
                c[r0:r1] = f
    bl, tl, b2, t2, bcos, tcos = cols
    bc = bhattacharyya_batched(base_err, tgt_err, bins=bins)
    lr, l2r = _ratio(tl, bl), _ratio(t2, b2)
    for k, i in enumerate(idx):
        r = slice(bounds[k], bounds[k + 1])
        _, m, ph = checked[i]
        out[i] = ModuleTokenMetrics(m, ph, parts[k][3], bl[r], tl[r], lr[r], b2[r], t2[r], l2r[r], bcos[r], tcos[r],
                                    bc[r], base_err[r], tgt_err[r])


def _widen_parts(parts):
    """parts (``(b, e, a, positions)``) with every bfloat16 tensor widened to float32 (exact)."""
    return [(*(as_float(x) for x in p[:3]), p[3]) for p in parts]


def _fused_rows(parts, bins):
    """``metrics._fused.RowMetricsJob`` of the rows of parts (``(b, e, a)`` float32 or bfloat16
    ``[rows, width]``, widths free, stacked in order, each read in place), started; or None
    where it does not apply: no numba, or a numpy whose einsum sums in another order than the
    kernel replays (checked once; rows wider than einsum's buffer in its pieces too). Its
    ``finish()`` returns ``(base_err, tgt_err, sums, maxes, bc, bad)``: the errors 1-D (each
    part's ``[rows, width]`` values in turn), sums ``[rows, 7]`` the float64 row sums of
    ``_metrics_from_sums``, maxes ``[rows, 3]`` its float32 row maxima, bc the row BCs; a row
    where bad is 1 (a NaN error, or an infinite baseline value) is left to the numpy path, as
    is the BC of one where it is 2 (an infinite error)."""
    if not sum(p[0].shape[0] for p in parts) or not numba_available():
        return None
    from . import _fused

    if not _fused.einsum_order_holds():
        return None
    return _fused.RowMetricsJob(parts, bins)


def align_decode_captures(ref_positions, target_positions):
    """Index pairs that line up decode steps of two captures by position (reference/002: HF and the
    engine may hold different or differently numbered steps). Returns ``(ref_idx, target_idx,
    missing)``: the indices of the positions both hold, in position order, and the positions only
    the reference holds (a target that skipped a step)."""
    rp = np.asarray(ref_positions, dtype=np.int64)
    tp = np.asarray(target_positions, dtype=np.int64)
    common, ri, ti = np.intersect1d(rp, tp, assume_unique=False, return_indices=True)
    missing = np.setdiff1d(rp, tp)
    return ri, ti, missing


@dataclass(frozen=True)
class ModuleVerdict:
    """One module and phase, pooled over tokens and prompts."""

    module: str
    phase: str
    layer: int | None
    passed: bool | None
    decided_by: str | None  # "sigma_ratio" | "bc_and_linf" | "max_l2_ratio" | None
    tensor: KVTensorVerdict | None  # the noise-relative numbers (None when no tensor was compared)
    max_l2_ratio: float  # largest per-token L2 ratio
    static_passed: bool | None  # max_l2_ratio < config.max_l2_ratio
    n_prompts: int
    n_tokens: int
    position: int | None  # first position with target error beyond every BF16 error (module docstring)
    token: int | None  # that position as a generation token index (position - prompt_len)
    token_prompt: str | None
    problem: str | None = None  # shape mismatch / non-finite target, in words
    n_not_computed: int = 0  # positions left out: the target never computed them (prefix cache)

    def summary(self) -> str:
        head = {True: "PASS", False: "FAIL", None: "NOT JUDGED"}[self.passed]
        where = f"{self.module} ({self.phase}, layer {self.layer})"
        skipped = f"; {self.n_not_computed} positions not computed (left out)" if self.n_not_computed else ""
        if self.problem:
            return f"{head}: {where}: {self.problem}{skipped}"
        t = self.tensor
        return (f"{head}: {where}: sigma-ratio {t.sigma_ratio:.3f}, BC {t.bc:.4f} vs bar {t.bc_threshold_used:.4f}, "
                f"L-inf ratio {t.linf_ratio:.2f} vs bar {t.linf_threshold_used:.2f}, max L2 ratio "
                f"{self.max_l2_ratio:.2f} over {self.n_tokens} tokens of {self.n_prompts} prompts{skipped}")


@dataclass(frozen=True)
class ModulesVerdict:
    passed: bool
    modules: tuple  # ModuleVerdict, in execution order (phase, then module order)
    first_failing: ModuleVerdict | None
    config: ModuleVerdictConfig = field(default_factory=ModuleVerdictConfig)

    @property
    def localisation(self) -> dict | None:
        """``{"phase", "layer", "module", "token"}`` of the first failing module, None if none failed."""
        f = self.first_failing
        if f is None:
            return None
        return {"phase": f.phase, "layer": f.layer, "module": f.module, "token": f.token}

    @property
    def unjudged(self) -> tuple:
        return tuple(v for v in self.modules if v.passed is None)

    @property
    def n_not_computed(self) -> int:
        """Positions left out of every module and phase because the target never computed them."""
        return sum(v.n_not_computed for v in self.modules)

    def summary(self) -> str:
        if not self.modules:
            return "not compared: no module tensors held by all roles"
        n_nc = self.n_not_computed
        skipped = (f"; {n_nc} module positions not computed by the target (prefix cache), left out of "
                   f"{sum(v.n_not_computed > 0 for v in self.modules)} module x phase outputs") if n_nc else ""
        if self.passed:
            return f"PASS: {len(self.modules)} module x phase outputs within BF16 noise{skipped}"
        if self.first_failing is not None:
            n = sum(v.passed is False for v in self.modules)
            return (f"FAIL: first failing module {self.first_failing.summary()[6:]}; {n} module x phase outputs "
                    f"fail{skipped}")
        return (f"FAIL: {len(self.unjudged)} module x phase outputs not judged (no value finite in all three roles, "
                f"or no position computed){skipped}")


class ModuleJudge:
    """Accumulates per-prompt module metrics, then judges every module and phase.

    ``add`` takes one prompt's tensors of one module and phase and returns its per-token metrics
    (rows for a table); ``verdict`` pools what was added. Memory: the absolute errors of every
    module added (two float32 copies of the captured tensors)."""

    def __init__(self, config: ModuleVerdictConfig | None = None):
        self.config = config or ModuleVerdictConfig()
        self._acc: dict[tuple[str, str], dict] = {}

    def _slot(self, module, phase):
        slot = self._acc.get((module, phase))
        if slot is None:  # not setdefault: its new dict of six lists on every call was ~1 us a tensor
            # "where": per metrics entry, the addresses of its errors where add_many's fused kernel
            # wrote them (memory the entry's arrays keep alive), else None: the verdict's pooled
            # kernel reads them there (metrics._fused.pooled_verdict_numbers_at)
            slot = self._acc[(module, phase)] = {"metrics": [], "prompts": [], "plens": [], "where": [],
                                                 "problems": [], "not_computed": 0}
        return slot

    def __getstate__(self):
        """A pickled judge (a prompt's partial, sent back from a Dask worker) carries no addresses:
        they mean nothing in another process, and its verdict takes the per-pool path."""
        state = dict(self.__dict__)
        # the lists copied too: a copy.copy of a judge (which pickles through here) shares none of them
        state["_acc"] = {k: {**{name: list(v) if isinstance(v, list) else v for name, v in slot.items()},
                             "where": [None] * len(slot["metrics"])} for k, slot in self._acc.items()}
        return state

    def __setstate__(self, state):
        for slot in state["_acc"].values():  # a judge pickled before "where" existed
            slot.setdefault("where", [None] * len(slot["metrics"]))
        self.__dict__.update(state)

    def add(self, prompt: str, module: str, phase: str, baseline, expected, actual, positions=None,
            prompt_len: int | None = None):
        """One prompt's ``[token, ...]`` tensors of one module and phase; positions ``[token]`` (default
        0..); prompt_len turns the failing position into a generation token index."""
        slot = self._slot(module, phase)
        shapes = [tuple(np.shape(x)) for x in (baseline, expected, actual)]
        if len(set(shapes)) != 1:
            slot["problems"].append(f"prompt {prompt}: shapes differ: baseline {shapes[0]}, expected {shapes[1]}, "
                                    f"actual {shapes[2]}")
            return None
        m = compare_module_tensors(baseline, expected, actual, module, phase, positions, bins=self.config.bins)
        slot["metrics"].append(m)
        slot["prompts"].append(prompt)
        slot["plens"].append(prompt_len)
        slot["where"].append(None)
        return m

    def add_many(self, prompt: str, items, prompt_len: int | None = None) -> list:
        """``add`` of one prompt's tensors of many modules and phases, with the per-token metrics
        computed together (``compare_module_tensors_many``: same numbers, a fraction of the
        per-call overhead). items: ``(module, phase, baseline, expected, actual, positions)``
        tuples; returns their metrics in order (None where the shapes differ)."""
        return self._start_many(prompt, items, prompt_len)()

    def add_prompts(self, prompts: Iterable, ahead: bool = True) -> list:
        """``add_many`` of each prompt in turn, pipelined: a prompt's Python (its checks, its
        results, the kernels' start) runs while the threads compute the prompt before it, where
        a loop of ``add_many`` leaves the threads idle during it. prompts: ``(prompt, items,
        prompt_len)`` tuples, or ``(prompt, items, prompt_len, problems)`` with problems
        ``(module, phase, text)`` recorded as ``add_problem`` would, in the prompt's turn;
        returns one list of metrics per prompt, as ``add_many`` returns them. The judge ends as
        after the same loop of ``add_many``, also when a prompt raises (its ``ValueError``):
        every prompt before it added, none after.

        A prompt's arrays are read until the next prompt has been taken from ``prompts`` and
        started, so an iterable that reuses or changes a prompt's arrays when it makes the next
        (a reader filling the same buffers) would have the earlier prompt judged on the later
        values: pass ``ahead=False`` for it (each prompt finished before the next is taken, a
        loop of ``add_many``). A list, or a generator that makes new arrays each time (a store
        read), may go ahead: its reading then runs beside the kernels too."""
        done: list = []
        pending = None  # the previous prompt's finish(), its kernels running
        try:
            for prompt, items, prompt_len, *problems in prompts:
                nxt = self._start_many(prompt, items, prompt_len, *problems)
                if not ahead:  # finished before the next is taken
                    done.append(nxt())
                    continue
                if pending is not None:
                    fin, pending = pending, None
                    try:
                        done.append(fin())
                    except BaseException:
                        nxt(add=False)  # started: waited for, never added
                        raise
                pending = nxt
            if pending is not None:
                fin, pending = pending, None
                done.append(fin())
        finally:
            if pending is not None:  # the loop raised while a prompt was started: it is added first
                pending()
        return done

    def _start_many(self, prompt, items, prompt_len, problems=()):
        """``add_many`` begun (``metrics.modules._start_many``); returns ``finish(add=True)``, which
        waits for the kernels and, with add, records the prompt in the judge (its metrics and its
        problems: a prompt that raises adds nothing) and returns the metrics."""
        items = list(items)
        out: list = [None] * len(items)
        todo, problems = [], [(module, phase, f"prompt {prompt}: {text}") for module, phase, text in problems]
        for i, (module, phase, baseline, expected, actual, positions) in enumerate(items):
            if (type(baseline) is np.ndarray and type(expected) is np.ndarray and type(actual) is np.ndarray
                    and baseline.shape == expected.shape == actual.shape):
                todo.append(i)
                continue
            shapes = [tuple(np.shape(x)) for x in (baseline, expected, actual)]
            if len(set(shapes)) != 1:
                problems.append((module, phase, f"prompt {prompt}: shapes differ: baseline {shapes[0]}, expected "
                                                f"{shapes[1]}, actual {shapes[2]}"))
            else:
                todo.append(i)
        started = _start_many([(*items[i][2:5], *items[i][:2], items[i][5]) for i in todo], self.config.bins)

        def finish(add=True):
            ms, where = started()
            if not add:
                return None
            for module, phase, problem in problems:
                self._slot(module, phase)["problems"].append(problem)
            for i, m, at in zip(todo, ms, where):
                slot = self._slot(m.module, m.phase)
                slot["metrics"].append(m)
                slot["prompts"].append(prompt)
                slot["plens"].append(prompt_len)
                slot["where"].append(at)
                out[i] = m
            return out
        return finish

    def add_not_computed(self, prompt: str, module: str, phase: str, n: int) -> None:
        """Record ``n`` positions of a prompt's module and phase that the target never computed
        (served from its prefix cache): left out of the tensors added, counted in the verdict,
        never judged equal; a module and phase with nothing else is unjudged."""
        if n < 0:
            raise ValueError(f"add_not_computed: prompt {prompt}, {module} ({phase}): n must be >= 0, got {n}")
        self._slot(module, phase)["not_computed"] += int(n)

    def add_problem(self, prompt: str, module: str, phase: str, problem: str) -> None:
        """Record that a module could not be compared for a prompt (it fails)."""
        self._slot(module, phase)["problems"].append(f"prompt {prompt}: {problem}")

    def merge(self, other: ModuleJudge) -> None:
        """Add what ``other`` accumulated (prompts after this judge's), as if added here: the
        reduce of per-prompt judges (``capturestore.comparators.modules``)."""
        for key, theirs in other._acc.items():
            slot = self._slot(*key)
            for name, items in theirs.items():
                if isinstance(items, int):  # counts (positions not computed) add; lists extend
                    slot[name] += items
                else:
                    slot[name].extend(items)

    @staticmethod
    def _tokens_and_max_l2(slot) -> tuple[int, float]:
        """A pool's token count and largest L2 ratio: what its verdict needs besides the pooled
        kernel's numbers (computed while that kernel runs)."""
        ms = slot["metrics"]
        if not ms:
            return 0, math.nan
        l2r = np.concatenate([m.l2_ratio for m in ms])
        max_l2 = float(np.nanmax(l2r)) if np.isfinite(l2r).any() or np.isinf(l2r).any() else math.nan
        return sum(m.positions.size for m in ms), max_l2

    def _judge(self, module, phase, slot, fused, pre=None) -> ModuleVerdict:
        """fused: the pool's fused_tensor_numbers (verdict() computes every pool's on the
        threads first); None where the fused pass declined it or nothing was added. pre: the
        pool's ``_tokens_and_max_l2`` where verdict() has it."""
        cfg = self.config
        ms, prompts = slot["metrics"], slot["prompts"]
        n_tok, max_l2 = pre if pre is not None else self._tokens_and_max_l2(slot)
        layer = module_layer(module)
        n_nc = slot["not_computed"]
        if not ms:
            if n_nc and not slot["problems"]:  # only positions the target never computed: nothing judged
                return ModuleVerdict(module, phase, layer, None, None, None, math.nan, None, 0, 0, None, None, None,
                                     "no position computed by the target", n_nc)
            return ModuleVerdict(module, phase, layer, False, None, None, math.nan, None, 0, 0, None, None, None,
                                 "; ".join(slot["problems"]), n_nc)
        # a correct engine (every error finite): nothing to count or mask, one kernel pass
        tv = fused
        if tv is not None:
            bad = [0] * len(ms)
        else:
            if all(_all_finite(m.tgt_err) for m in ms):
                bad, tgt = [0] * len(ms), [m.tgt_err for m in ms]
            else:
                with np.errstate(invalid="ignore"):
                    bad = [int(np.count_nonzero(~np.isfinite(m.tgt_err) & np.isfinite(m.base_err))) for m in ms]
                tgt = [np.where(np.isfinite(m.tgt_err), m.tgt_err, np.nan) for m in ms]
            # NaN where a reference is NaN too is excluded by the rule; a non-finite target error counts.
            # The fused pass declined these chunks above, and would again: numpy decides.
            tv = _tensor_verdict([m.base_err for m in ms], tgt, cfg.kv, sum(bad), fused=False)
        static = None if math.isnan(max_l2) else bool(max_l2 < cfg.max_l2_ratio)
        if cfg.rule == "noise" or tv.passed is None:
            passed, why = tv.passed, tv.decided_by
        else:
            passed, why = static, ("max_l2_ratio" if static else None)
        problems = list(slot["problems"])
        if sum(bad):
            first = next(p for p, b in zip(prompts, bad) if b)
            problems.append(f"{sum(bad)} non-finite target values where the references are finite (first in "
                            f"prompt {first})")
            passed, why = False, None
        if slot["problems"]:
            passed, why = False, None
        # where: first position whose target L2 exceeds every BF16 L2 of this module and phase
        position = token = token_prompt = None
        if passed is False and not slot["problems"]:  # a shape / missing-capture failure has no position
            noise = max((float(np.nanmax(m.base_l2)) for m in ms if np.isfinite(m.base_l2).any()), default=0.0)
            cands = []
            for p, m, plen, nb in zip(prompts, ms, slot["plens"], bad):
                with np.errstate(invalid="ignore"):
                    if nb:  # a non-finite target is the failure: place it there
                        over = np.flatnonzero((~np.isfinite(m.tgt_err) & np.isfinite(m.base_err)).any(axis=1))
                    elif sum(bad):
                        continue
                    else:
                        over = np.flatnonzero(~(m.tgt_l2 <= noise))
                if over.size:
                    cands.append((int(m.positions[over[0]]), p, plen))
            if not cands:
                best = max(((float(np.nanmax(m.l2_ratio)), int(m.positions[int(np.nanargmax(m.l2_ratio))]), p, plen)
                            for p, m, plen in zip(prompts, ms, slot["plens"]) if not np.all(np.isnan(m.l2_ratio))),
                           default=None)
                cands = [best[1:]] if best else []
            if cands:
                position, token_prompt, plen = min(cands, key=lambda c: (c[0] - (c[2] or 0), c[1]))
                token = position - plen if plen is not None else position
        return ModuleVerdict(module, phase, layer, passed, why, tv, max_l2, static, len(ms), n_tok, position, token,
                             token_prompt, "; ".join(problems) or None, n_nc)

    def verdict(self, order: Sequence[str] | None = None) -> ModulesVerdict:
        """Judge every module and phase added. order: module names in execution order (modules
        missing from it go last, by name)."""
        rank = {m: i for i, m in enumerate(order or ())}
        keys = sorted(self._acc, key=lambda k: (_phase_rank(k[1]), rank.get(k[0], len(rank)), k[0]))
        # the pools' kernel passes first, shared across threads; then each verdict in order. A pool
        # whose errors add_many's fused kernel wrote is read where they lie, many pools a kernel
        # call; any other (errors of add, of the numpy path, of a judge that was pickled) by
        # fused_tensor_numbers_many, a call per pool
        pools = [k for k in keys if self._acc[k]["metrics"]]
        at = [k for k in pools if len(self._acc[k]["where"]) == len(self._acc[k]["metrics"])
              and None not in self._acc[k]["where"]]
        wait = start_fused_tensor_numbers_at([self._acc[k]["where"] for k in at], self.config.kv)
        try:  # each pool's own numbers beside the kernels
            pre = {k: self._tokens_and_max_l2(self._acc[k]) for k in keys}
        finally:
            fused = dict(zip(at, wait()))
        rest = [k for k in pools if k not in fused]
        fused.update(zip(rest, fused_tensor_numbers_many(
            [([m.base_err for m in self._acc[k]["metrics"]], [m.tgt_err for m in self._acc[k]["metrics"]])
             for k in rest], self.config.kv)))
        vs = tuple(self._judge(m, ph, self._acc[(m, ph)], fused.get((m, ph)), pre[(m, ph)]) for m, ph in keys)
        first = first_failing_module(vs)
        passed = bool(vs) and all(v.passed is True for v in vs)
        return ModulesVerdict(passed, vs, first, self.config)


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)


def first_failing_module(verdicts: Iterable[ModuleVerdict], order: Sequence[str] | None = None) -> ModuleVerdict | None:
    """The first failing module in execution order: phases in time order, then ``order`` (module
    names as they finish; default: the order given)."""
    vs = list(verdicts)
    if order is not None:
        rank = {m: i for i, m in enumerate(order)}
        vs.sort(key=lambda v: (_phase_rank(v.phase), rank.get(v.module, len(rank))))
    else:
        vs.sort(key=lambda v: _phase_rank(v.phase))  # stable: the given order within a phase
    return next((v for v in vs if v.passed is False), None)


def judge_modules(per_prompt, order: Sequence[str] | None = None, prompt_lens: Sequence[int] | None = None,
                  config: ModuleVerdictConfig | None = None) -> ModulesVerdict:
    """Verdict over prompts. per_prompt: one dict per prompt ``{(module, phase): (baseline, expected,
    actual)}`` of ``[token, ...]`` arrays. order: modules in execution order. prompt_lens: one per
    prompt; then prefill rows are positions ``0..``, decode rows ``prompt_len + step`` (the capture
    layout of ``extractors.modules``) and failures are placed as generation token indices."""
    judge = ModuleJudge(config)
    # a sequence's arrays are all made before the first is judged: the next prompt may be started
    # beside this one's kernels. An iterator may be a reader refilling its buffers: one at a time.
    ahead = isinstance(per_prompt, Sequence)
    if prompt_lens is not None and len(prompt_lens) != len(per_prompt):
        raise ValueError(f"judge_modules: {len(per_prompt)} prompts but {len(prompt_lens)} prompt lengths")

    def prompts():  # each prompt's tensors at once, the next prompt's prepared beside this one's kernels
        for i, caps in enumerate(per_prompt):
            plen = None if prompt_lens is None else int(prompt_lens[i])
            items = []
            for (module, phase), (b, e, a) in caps.items():
                pos = None
                if plen is not None:
                    pos = np.arange(np.shape(b)[0]) + (plen if phase == "decode" else 0)
                items.append((module, phase, b, e, a, pos))
            yield str(i), items, plen
    judge.add_prompts(prompts(), ahead=ahead)
    return judge.verdict(order)


def compare_captures_three_way(baseline, expected, actual, order: Sequence[str] | None = None,
                               max_l2_ratio: float = 3.0, rule: str = "noise") -> ModulesVerdict:
    """reference/002's entry point: three captures, each one dict per prompt (or a single dict)
    ``{module: {phase: [token, ...]}}``; every (module, phase) of the baseline is compared. A
    module or phase the expected or actual capture lacks fails, named."""
    cfg = ModuleVerdictConfig(rule=rule, max_l2_ratio=max_l2_ratio)
    if isinstance(baseline, dict):
        baseline, expected, actual = [baseline], [expected], [actual]
    if not len(baseline) == len(expected) == len(actual):
        raise ValueError(f"compare_captures_three_way: {len(baseline)} baseline, {len(expected)} expected, "
                         f"{len(actual)} actual prompts")
    judge = ModuleJudge(cfg)

    def prompts():  # each prompt's tensors at once (ModuleJudge.add_prompts)
        for i, (b, e, a) in enumerate(zip(baseline, expected, actual)):
            items, problems = [], []
            for module, phases in b.items():
                for phase, bt in phases.items():
                    et, at = e.get(module, {}).get(phase), a.get(module, {}).get(phase)
                    if et is None or at is None:
                        who = "expected" if et is None else "actual"
                        problems.append((module, phase, f"the {who} capture has no {module} ({phase})"))
                        continue
                    items.append((module, phase, bt, et, at, None))
            yield str(i), items, None, problems
    judge.add_prompts(prompts())
    return judge.verdict(order)

