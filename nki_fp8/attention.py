"""Decode attention references over an FP8 KV cache (CPU numpy; no kernel is pretended here).

Scales are kernel scales (multipliers, see `scales`): the cache holds `q(x * s)`, values `x ~= q / s`.

- `decode_attention`: plain single-token GQA attention + output projection.
- `decode_attention_explicit_dequant`: dequantize K, V (`/ s`) then attend.
- `decode_attention_scale_folded`: attend over the raw FP8 values with `softmax_scale =
  scaling / k_scale` and `W_out / v_scale` — the vLLM Neuron decode path. Equal to the explicit
  path in exact arithmetic (the scale commutes out of both reductions); in float32 they differ
  by rounding only (tested against a forward error bound).
- `attention_decode_reference`: the `NF.attention_decode` contract: the cache is FP8, the active
  token's K/V arrive in BF16 and are quantized with `k_scale` / `v_scale` (clamp to the
  platform max) before being attended to; softmax_scale and W_out arrive already folded.
- `fp8_attention_decode`: Q also in FP8, `bmm1_scale = 1 / (q_s * k_s * sqrt(d))` and
  `bmm2_scale = 1 / v_s`. reference/001 writes these as `q_scale * k_scale / sqrt(d)` and
  `v_scale` in the checkpoint (divisor) convention — the same numbers.
- `check_kernel`: any candidate implementation of either reference on a grid of shapes, scales
  and platforms, with its max error.

Dims: q: [q_head, head_dim] (one decode token); k, v: [kv_head, seq, head_dim];
w_out: [hidden, q_head * head_dim]; out: [hidden] (or [q_head, head_dim] without w_out).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .formats import fp8_format
from .quant import quantize

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_probs(q, k, *, scaling: float, dtype=np.float32) -> np.ndarray:
    """Softmax probabilities `[kv_head, group, seq]` of one decode token (GQA groups of q heads)."""
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(k, dtype=dtype)
    hq, d = q.shape
    hkv, seq, dk = k.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} and k {k.shape}: head_dim must match and q_head must be a multiple of kv_head")
    qg = q.reshape(hkv, hq // hkv, d)
    scores = np.einsum("hgd,hsd->hgs", qg, k) * dtype(scaling)
    return _softmax(scores)


def decode_attention(q, k, v, *, scaling: float, w_out=None, dtype=np.float32) -> np.ndarray:
    """softmax(q k^T * scaling) v, heads flattened, then `w_out @`; all in `dtype`."""
    p = attention_probs(q, k, scaling=scaling, dtype=dtype)
    v = np.asarray(v, dtype=dtype)
    o = np.einsum("hgs,hsd->hgd", p, v).reshape(np.shape(q))
    if w_out is None:
        return o
    return np.asarray(w_out, dtype=dtype) @ o.reshape(-1)


def decode_attention_explicit_dequant(q, k_fp8, v_fp8, *, k_scale, v_scale, scaling, w_out=None, dtype=np.float32):
    """Dequantize the FP8 cache (`codes / s`, in `dtype`) then `decode_attention`."""
    k = np.asarray(k_fp8).astype(dtype) / dtype(k_scale)
    v = np.asarray(v_fp8).astype(dtype) / dtype(v_scale)
    return decode_attention(q, k, v, scaling=scaling, w_out=w_out, dtype=dtype)


def folded_softmax_scale(scaling: float, k_scale: float) -> float:
    """`scaling / k_scale`: the K dequant folded into the softmax scale."""
    return float(scaling) / float(k_scale)


def folded_w_out(w_out, v_scale: float, dtype=np.float32) -> np.ndarray:
    """`W_out / v_scale`: the V dequant folded into the output projection."""
    return np.asarray(w_out, dtype=dtype) / dtype(v_scale)


def decode_attention_scale_folded(q, k_fp8, v_fp8, *, k_scale, v_scale, scaling, w_out=None, dtype=np.float32):
    """Attend over raw FP8 values; 1/k_scale in the softmax scale, 1/v_scale in W_out (or the output)."""
    k = np.asarray(k_fp8).astype(dtype)
    v = np.asarray(v_fp8).astype(dtype)
    ss = folded_softmax_scale(scaling, k_scale)
    if w_out is None:
        return decode_attention(q, k, v, scaling=ss, dtype=dtype) / dtype(v_scale)
    return decode_attention(q, k, v, scaling=ss, w_out=folded_w_out(w_out, v_scale, dtype), dtype=dtype)


def attention_decode_reference(
    q, k_cache, v_cache, k_active, v_active, *, softmax_scale, w_out, k_scale, v_scale, platform=None
) -> np.ndarray:
    """The reference for an `attention_decode` kernel over an FP8 cache (folded-scale contract).

    q: [q_head, head_dim]; k_cache, v_cache: FP8 codes [kv_head, seq_prev, head_dim];
    k_active, v_active: [kv_head, head_dim] (bf16 values) of the token being decoded, quantized
    here with k_scale / v_scale and the platform clamp; softmax_scale = scaling / k_scale and
    w_out = o_proj / v_scale arrive folded. Returns out: [hidden] in float32.
    """
    k8 = quantize(np.asarray(k_active)[:, None, :], k_scale, platform=platform)
    v8 = quantize(np.asarray(v_active)[:, None, :], v_scale, platform=platform)
    k = np.concatenate([np.asarray(k_cache).astype(np.float32), k8.astype(np.float32)], axis=1)
    v = np.concatenate([np.asarray(v_cache).astype(np.float32), v8.astype(np.float32)], axis=1)
    return decode_attention(q, k, v, scaling=softmax_scale, w_out=w_out)


def fp8_attention_decode(
    q, k_fp8, v_fp8, *, q_scale, k_scale, v_scale, w_out=None, platform=None, quantize_probs: bool = True
) -> np.ndarray:
    """FP8 attention: Q quantized too, matmuls on FP8 values with float32 accumulation.

    scores = (q8 @ k8^T) * bmm1_scale, bmm1_scale = 1 / (q_scale * k_scale * sqrt(d));
    P = softmax(scores), cast to FP8 without a scale (it lies in [0, 1]) when `quantize_probs`;
    out = (P8 @ v8) * bmm2_scale, bmm2_scale = 1 / v_scale; then `w_out @` in float32.
    """
    q8 = quantize(q, q_scale, platform=platform).astype(np.float32)
    d = q8.shape[-1]
    bmm1 = 1.0 / (float(q_scale) * float(k_scale) * np.sqrt(d))
    p = attention_probs(q8, np.asarray(k_fp8).astype(np.float32), scaling=bmm1)
    if quantize_probs:
        p = quantize(p, 1.0, platform=platform).astype(np.float32)
    o = np.einsum("hgs,hsd->hgd", p, np.asarray(v_fp8).astype(np.float32)) * np.float32(1.0 / float(v_scale))
    o = o.reshape(np.shape(q))
    return o if w_out is None else np.asarray(w_out, np.float32) @ o.reshape(-1)


@dataclass(frozen=True)
class AttentionErrors:
    """Errors of three attention variants against a float64 attention on the same inputs.

    rel_l2 = ||y - y64|| / ||y64||, rel_linf = max|y - y64| / max|y64|.
    """

    bf16_rel_l2: float  # BF16 inputs/outputs, float32 accumulation
    bf16_rel_linf: float
    fp8_kv_rel_l2: float  # FP8 KV cache, BF16 attention (scale-folded)
    fp8_kv_rel_linf: float
    fp8_attn_rel_l2: float  # FP8 Q/K/V/P, float32 accumulation
    fp8_attn_rel_linf: float


def _rel(y, ref) -> tuple[float, float]:
    """(relative L2, relative L-inf) of ``y`` against ``ref`` over every element."""
    from metrics.errors import rel_l2, rel_linf

    y = np.asarray(y, np.float64)
    return float(rel_l2(ref, y, axis=None)), float(rel_linf(ref, y, axis=None))


def fp8_attention_error_vs_bf16(q, k, v, *, q_scale, k_scale, v_scale, w_out=None, platform=None) -> AttentionErrors:
    """Measure BF16, FP8-KV and FP8 attention against float64 truth on the same float inputs."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    d = q.shape[-1]
    scaling = 1.0 / np.sqrt(d)
    w64 = None if w_out is None else np.asarray(w_out, np.float64)
    truth = decode_attention(q, k, v, scaling=scaling, w_out=w64, dtype=np.float64)
    rb = lambda a: np.asarray(a).astype(_BF16).astype(np.float32)  # noqa: E731 - round to bf16
    wb = None if w_out is None else rb(w_out)
    y_bf16 = rb(decode_attention(rb(q), rb(k), rb(v), scaling=scaling, w_out=wb))
    k8 = quantize(rb(k), k_scale, platform=platform)
    v8 = quantize(rb(v), v_scale, platform=platform)
    y_kv = decode_attention_scale_folded(rb(q), k8, v8, k_scale=k_scale, v_scale=v_scale, scaling=scaling, w_out=wb)
    y_fp8 = fp8_attention_decode(rb(q), k8, v8, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, w_out=wb, platform=platform)
    return AttentionErrors(*_rel(y_bf16, truth), *_rel(rb(y_kv), truth), *_rel(rb(y_fp8), truth))


# --- check_kernel ---------------------------------------------------------------------------
DEFAULT_SHAPES = ((4, 4, 7, 64), (8, 2, 33, 64), (4, 1, 128, 128))  # (q_head, kv_head, seq_prev, head_dim)
DEFAULT_SCALES = ("calibrated", "unit", "active_outlier")
DEFAULT_PLATFORMS = ("trn2", "trn3")


@dataclass(frozen=True)
class KernelCheckRow:
    q_heads: int
    kv_heads: int
    seq_prev: int
    head_dim: int
    scales: str
    platform: str
    k_scale: float
    v_scale: float
    max_abs_err: float
    max_rel_err: float  # max|candidate - reference| / max|reference|
    passed: bool
    error: str = ""  # exception text when the candidate raised
    variant: str = "fp8_kv_decode"


@dataclass(frozen=True)
class KernelCheckReport:
    rows: tuple[KernelCheckRow, ...]
    rtol: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def max_abs_err(self) -> float:
        return max(r.max_abs_err for r in self.rows)

    @property
    def max_rel_err(self) -> float:
        return max(r.max_rel_err for r in self.rows)

    @property
    def failures(self) -> tuple[KernelCheckRow, ...]:
        return tuple(r for r in self.rows if not r.passed)

    def table(self) -> str:
        head = f"{'q_h':>4} {'kv_h':>4} {'seq':>5} {'d':>4} {'scales':<15} {'plat':<5} {'max_abs':>10} {'max_rel':>10} ok"
        out = [head]
        for r in self.rows:
            out.append(
                f"{r.q_heads:>4} {r.kv_heads:>4} {r.seq_prev:>5} {r.head_dim:>4} {r.scales:<15} {r.platform:<5} "
                f"{r.max_abs_err:>10.3g} {r.max_rel_err:>10.3g} {'yes' if r.passed else 'NO ' + r.error}"
            )
        out.append(f"max_rel_err={self.max_rel_err:.3g} (rtol {self.rtol:g}); {len(self.failures)} of {len(self.rows)} cases fail")
        return "\n".join(out)


def make_decode_case(q_heads, kv_heads, seq_prev, head_dim, scales: str, platform: str, seed: int = 0) -> dict:
    """Inputs of one `attention_decode` case (the keyword arguments of the reference).

    scales: "calibrated" (absmax of cache + active token), "unit" (all 1.0), "active_outlier"
    (calibrated on the cache only, while the active token is 4x larger: the clamp engages).
    """
    rng = np.random.default_rng(seed)
    hidden = q_heads * head_dim
    bf = lambda a: np.asarray(a, np.float32).astype(_BF16).astype(np.float32)  # noqa: E731
    q = bf(rng.standard_normal((q_heads, head_dim)))
    k = bf(rng.standard_normal((kv_heads, seq_prev, head_dim)) * 3.0)
    v = bf(rng.standard_normal((kv_heads, seq_prev, head_dim)) * 0.5)
    k_act = bf(rng.standard_normal((kv_heads, head_dim)) * 3.0)
    v_act = bf(rng.standard_normal((kv_heads, head_dim)) * 0.5)
    w = bf(rng.standard_normal((hidden, q_heads * head_dim)) / np.sqrt(hidden))
    m = fp8_format(platform).max_finite
    if scales == "unit":
        ks = vs = 1.0
    elif scales == "calibrated":
        ks = m / max(np.abs(k).max(), np.abs(k_act).max())
        vs = m / max(np.abs(v).max(), np.abs(v_act).max())
    elif scales == "active_outlier":
        ks, vs = m / np.abs(k).max(), m / np.abs(v).max()
        k_act, v_act = bf(k_act * 4 / np.abs(k_act).max() * np.abs(k).max()), bf(v_act * 4 / np.abs(v_act).max() * np.abs(v).max())
    else:
        raise ValueError(f"unknown scales {scales!r}; valid: {list(DEFAULT_SCALES)}")
    ks, vs = float(np.float32(ks)), float(np.float32(vs))
    scaling = 1.0 / np.sqrt(head_dim)
    return dict(
        q=q,
        k_cache=quantize(k, ks, platform=platform),
        v_cache=quantize(v, vs, platform=platform),
        k_active=k_act,
        v_active=v_act,
        softmax_scale=folded_softmax_scale(scaling, ks),
        w_out=folded_w_out(w, vs),
        k_scale=ks,
        v_scale=vs,
        platform=platform,
    )


def make_fp8_attention_case(q_heads, kv_heads, seq, head_dim, scales: str, platform: str, seed: int = 0) -> dict:
    """Inputs of one FP8-attention case (the keyword arguments of `fp8_attention_decode`).

    scales: "calibrated" (absmax of q, k, v), "unit" (all 1.0), "active_outlier" (q_scale 4x
    too large: the Q clamp engages, where a wrong platform max shows).
    """
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(a, np.float32).astype(_BF16).astype(np.float32)  # noqa: E731
    q = bf(rng.standard_normal((q_heads, head_dim)))
    k = bf(rng.standard_normal((kv_heads, seq, head_dim)) * 3.0)
    v = bf(rng.standard_normal((kv_heads, seq, head_dim)) * 0.5)
    w = bf(rng.standard_normal((q_heads * head_dim, q_heads * head_dim)) / np.sqrt(q_heads * head_dim))
    m = fp8_format(platform).max_finite
    if scales == "unit":
        qs = ks = vs = 1.0
    elif scales in ("calibrated", "active_outlier"):
        qs, ks, vs = (m / float(np.abs(a).max()) for a in (q, k, v))
        qs = qs * 4 if scales == "active_outlier" else qs
    else:
        raise ValueError(f"unknown scales {scales!r}; valid: {list(DEFAULT_SCALES)}")
    qs, ks, vs = (float(np.float32(x)) for x in (qs, ks, vs))
    return dict(q=q, k_fp8=quantize(k, ks, platform=platform), v_fp8=quantize(v, vs, platform=platform),
                q_scale=qs, k_scale=ks, v_scale=vs, w_out=w, platform=platform)


VARIANTS = {
    # name: (case maker, reference, default rtol)
    "fp8_kv_decode": (make_decode_case, attention_decode_reference, 1e-5),
    # float32 reassociation can flip the FP8 rounding of a probability near a midpoint
    # (one FP8 step, 2^-4 relative, on one P entry): hence the looser default.
    "fp8_attention": (make_fp8_attention_case, fp8_attention_decode, 2e-2),
}


def check_kernel(
    candidate_fn,
    *,
    variant: str = "fp8_kv_decode",
    shapes=DEFAULT_SHAPES,
    scales=DEFAULT_SCALES,
    platforms=DEFAULT_PLATFORMS,
    rtol: float | None = None,
    seed: int = 0,
) -> KernelCheckReport:
    """Run `candidate_fn(**case)` on every shape x scales x platform; compare to the reference.

    variant "fp8_kv_decode": candidate_fn takes the keyword arguments of
    `attention_decode_reference` (q, k_cache, v_cache, k_active, v_active, softmax_scale, w_out,
    k_scale, v_scale, platform); default rtol 1e-5 (float32 reassociation only — one FP8 step is
    ~6e-2 relative). variant "fp8_attention": those of `fp8_attention_decode` (q, k_fp8, v_fp8,
    q_scale, k_scale, v_scale, w_out, platform); default rtol 2e-2. Both return out: [hidden].
    A case passes when max|cand - ref| <= rtol * max|ref|; a candidate that raises fails that
    case with the exception text.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid: {list(VARIANTS)}")
    make_case, reference, default_rtol = VARIANTS[variant]
    rtol = default_rtol if rtol is None else rtol
    rows = []
    for i, (hq, hkv, seq, d) in enumerate(shapes):
        for sc in scales:
            for plat in platforms:
                case = make_case(hq, hkv, seq, d, sc, plat, seed=seed + i)
                ref = reference(**case)
                err, abs_e, rel_e = "", float("inf"), float("inf")
                try:
                    got = np.asarray(candidate_fn(**case), np.float64)
                    if got.shape != ref.shape:
                        err = f"shape {got.shape} != {ref.shape}"
                    else:
                        diff = np.abs(got - ref)
                        abs_e = float(np.nanmax(diff)) if not np.isnan(diff).any() else float("nan")
                        rel_e = abs_e / max(float(np.abs(ref).max()), 1e-30)
                except Exception as e:  # noqa: BLE001 - a crashing candidate is a failing case
                    err = f"{type(e).__name__}: {e}"
                ok = not err and np.isfinite(rel_e) and rel_e <= rtol
                rows.append(KernelCheckRow(hq, hkv, seq, d, sc, plat, case["k_scale"], case["v_scale"], abs_e, rel_e,
                                           bool(ok), err, variant))
    return KernelCheckReport(tuple(rows), rtol)
