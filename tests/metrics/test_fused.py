"""The fused numba path of compare_kv_caches against the numpy path and np.histogram.

BC, relative L-inf and raw errors must be bit-identical between the two backends (same bins,
same float32 errors); L2 / cosine agree to float32 rounding of the sums. Adversarial data puts
errors exactly on, just below and just above np.linspace bin edges, on edges that collapse
under rounding, and on subnormal-wide ranges."""
import math
import os
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metrics.bc import bhattacharyya_batched
from metrics.kv import compare_kv_caches, resolve_backend
from tests.metrics.test_kv import assert_matches_oracle, make_kv, perturb, upstream_bc

numba = pytest.importorskip("numba")
from metrics import _fused  # noqa: E402

EXACT = ("k_linf", "v_linf", "base_k_linf", "base_v_linf")
CLOSE = ("k_l2", "v_l2", "base_k_l2", "base_v_l2", "k_cos", "v_cos")


def assert_backends_agree(exp, act, base):
    three = base is not None
    out = {}
    for be in ("numba", "numpy"):
        out[be] = compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=three, backend=be)
    if three:
        (f, fraw), (n, nraw) = out["numba"], out["numpy"]
        np.testing.assert_array_equal(f.k_bc, n.k_bc)
        np.testing.assert_array_equal(f.v_bc, n.v_bc)
        for name in ("base_k", "tgt_k", "base_v", "tgt_v"):
            np.testing.assert_array_equal(getattr(fraw, name), getattr(nraw, name))
    else:
        f, n = out["numba"], out["numpy"]
    for name in EXACT[: 4 if three else 2]:
        np.testing.assert_array_equal(getattr(f, name), getattr(n, name), err_msg=name)
    for name in CLOSE:
        if three or not name.startswith("base"):
            np.testing.assert_allclose(getattr(f, name), getattr(n, name), rtol=2e-6, atol=1e-7, err_msg=name)
    return f


# ----------------------------------------------------------------------------- adversarial rows


def edge_rows(rng, n):
    """Pairs of error samples (base, target), each [n] float32 >= 0, that sit on bin edges."""
    f32 = np.float32
    rows = []

    def on_edges(lo, hi):
        edges = np.linspace(f32(lo), f32(hi), 101).astype(f32)
        cand = np.concatenate([edges, np.nextafter(edges, f32(-np.inf)), np.nextafter(edges, f32(np.inf))])
        cand = cand[(cand >= edges[0]) & (cand <= edges[-1])]
        x, y = rng.choice(cand, n), rng.choice(cand, n)
        x[0], y[-1] = edges[0], edges[-1]  # the joint range is exactly [lo, hi]
        return x, y

    for lo, hi in ((0.0, 1.0), (0.0, 0.3), (0.125, 0.7), (0.0, 2.0**-9), (3e-5, 7.1e-3), (0.0, 100 * 2.0**-10)):
        rows.append(on_edges(lo, hi))
    lo, hi = f32(rng.uniform(0, 0.01)), f32(rng.uniform(0.02, 5))
    rows.append(on_edges(lo, hi))
    for m in (1, 3, 50, 99, 101, 150, 1000):  # edges closer than an ulp collapse
        base = f32(1.0)
        grid = base + np.arange(m + 1, dtype=f32) * np.spacing(base)
        x, y = rng.choice(grid, n), rng.choice(grid, n)
        x[0], y[-1] = grid[0], grid[-1]
        rows.append((x, y))
    for k in (1, 2, 60, 143, 700, 5000):  # subnormal-wide ranges: bins / width overflows
        tiny = np.float32(1e-45)
        grid = (np.arange(k + 1) * tiny).astype(f32)
        x, y = rng.choice(grid, n), rng.choice(grid, n)
        x[0], y[-1] = grid[0], grid[-1]
        rows.append((x, y))
    rows.append((np.full(n, f32(0.25)), np.full(n, f32(0.25))))  # lo == hi
    rows.append((np.zeros(n, f32), np.zeros(n, f32)))
    z = np.zeros(n, f32)
    z[n // 2] = f32(3.0)
    rows.append((z, np.zeros(n, f32)))
    for q in (1 / 8, 1 / 64, 2**-20):  # bf16-like quantised errors
        x = (np.round(np.abs(rng.normal(size=n)) / q) * q).astype(f32)
        y = (np.round(np.abs(rng.normal(size=n)) * rng.uniform(0.3, 3) / q) * q).astype(f32)
        rows.append((x, y))
    return rows


def test_fused_bc_identical_on_edge_valued_errors():
    """Errors placed on linspace edges (and one float either side), collapsing edges,
    subnormal ranges, flat ranges: fused == numpy == np.histogram, bit for bit."""
    rng = np.random.default_rng(20)
    H, D = 2, 40
    rows = edge_rows(rng, H * D)
    S = len(rows)
    base_err = np.stack([r[0] for r in rows]).reshape(S, H, D).transpose(1, 0, 2)[None]  # [1, H, S, D]
    tgt_err = np.stack([r[1] for r in rows]).reshape(S, H, D).transpose(1, 0, 2)[None]
    zero = np.zeros_like(base_err)
    # baseline 0, expected +base_err, actual -tgt_err: |x - baseline| are the samples exactly
    base = {"l0": (zero, zero.copy())}
    exp = {"l0": (base_err, tgt_err)}
    act = {"l0": (-tgt_err, -base_err)}
    res = assert_backends_agree(exp, act, base)
    # np.histogram refuses edges that decrease (a subnormal step rounded up: 99 * step > hi),
    # and when width / 100 underflows to 0 with width > 0 (a range of 1-2 subnormals) linspace
    # spreads its edges where metrics.bc puts every value in the last bin; elsewhere all agree
    ok = [i for i, (b, t) in enumerate(rows) if monotonic_edges(b, t) and not underflowing_step(b, t)]
    assert len(ok) >= len(rows) - 4
    want_k = [upstream_bc(*rows[i]) for i in ok]
    want_v = [upstream_bc(*rows[i][::-1]) for i in ok]
    np.testing.assert_array_equal(res.k_bc[0, ok, 0], want_k)
    np.testing.assert_array_equal(res.v_bc[0, ok, 0], want_v)
    # the BC on its own (2-D batched form, both counting backends) agrees too
    for be in ("numpy", "numba"):
        got = bhattacharyya_batched(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), backend=be)
        np.testing.assert_array_equal(got, res.k_bc[0, :, 0])


def underflowing_step(*samples):
    lo = min(x.min() for x in samples)
    hi = max(x.max() for x in samples)
    return hi > lo and (hi - lo) / np.float32(100) == 0


def monotonic_edges(*samples):
    lo = min(x.min() for x in samples)
    hi = max(x.max() for x in samples)
    return bool(np.all(np.diff(np.linspace(lo, hi, 101)) >= 0))


def test_fused_histogram_rows_match_np_histogram():
    """metrics._fused.hist_counts (the kernel's bin rule on its own) == np.histogram counts."""
    rng = np.random.default_rng(21)
    rows = edge_rows(rng, 64)
    x = np.stack([r[0] for r in rows] + [r[1] for r in rows])
    lo, hi = x.min(axis=1), x.max(axis=1)
    f32 = np.float32
    step = ((hi - lo) / f32(100)).astype(f32)
    with np.errstate(divide="ignore", over="ignore"):
        scale = np.where(step == 0, 0, f32(100) / np.where(step == 0, 1, hi - lo)).astype(f32)
    got = _fused.hist_counts(x, lo, step, scale, 100)
    for i in range(len(x)):
        if not monotonic_edges(x[i]) or underflowing_step(x[i]):
            continue
        want, _ = np.histogram(x[i], bins=np.linspace(lo[i], hi[i], 101))
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5), n=st.integers(0, 300), dtype=st.sampled_from(["float32", "float64"]),
    nan_frac=st.sampled_from([0.0, 0.0, 0.3, 1.0]), inf=st.booleans(), quantum=st.sampled_from([0.0, 1 / 64, 2**-20]),
    seed=st.integers(0, 2**31),
)
def test_batched_bc_fused_counts_equal_numpy(rows, n, dtype, nan_frac, inf, quantum, seed):
    """bhattacharyya_batched (cross-prompt aggregation) counting with the kernel == numpy."""
    rng = np.random.default_rng(seed)
    a = np.abs(rng.normal(size=(rows, n)))
    b = np.abs(rng.normal(size=(rows, n))) * rng.uniform(0.3, 3)
    if quantum:
        a, b = np.round(a / quantum) * quantum, np.round(b / quantum) * quantum
    a, b = a.astype(dtype), b.astype(dtype)
    a[rng.random(a.shape) < nan_frac] = np.nan
    if inf and n:
        b[0, 0] = np.inf
    with np.errstate(invalid="ignore"):
        got = bhattacharyya_batched(a, b, backend="numba")
        want = bhattacharyya_batched(a, b, backend="numpy")
    np.testing.assert_array_equal(got, want)
    for i in range(rows):
        if not (inf and i == 0) and not np.isnan(a[i]).all() and n:
            assert got[i] == upstream_bc(a[i], b[i])


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), kv_heads=st.integers(1, 3), S=st.integers(1, 6), D=st.sampled_from([1, 3, 8, 64]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]), three=st.booleans(),
    nan_frac=st.sampled_from([0.0, 0.0, 0.1]), inf=st.booleans(), rel=st.sampled_from([1e-2, 1e-5, 0.0]),
    seed=st.integers(0, 2**31),
)
def test_fused_equals_numpy_backend(B, kv_heads, S, D, dtype, three, nan_frac, inf, rel, seed):
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    base = make_kv(rng, 2, B, kv_heads, S, D)
    exp = {n: tuple(x.astype(dt) for x in kv) for n, kv in base.items()}
    act = perturb(base, rng, rel, dt)
    for kv in (act, base):
        for k, v in kv.values():
            if nan_frac:
                k[rng.random(k.shape) < nan_frac] = np.nan
            if inf:
                v[rng.random(v.shape) < 0.05] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        assert_backends_agree(exp, act, base if three else None)


def test_numpy_backend_still_matches_loop_oracle():
    """With numba installed, "auto" takes the fused path: pin the numpy path to the oracle too."""
    rng = np.random.default_rng(22)
    base = make_kv(rng, 2, B=2, H=3, S=5, D=16)
    exp = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    act = perturb(base, rng, 5e-3, ml_dtypes.bfloat16)
    act["model.layers.1.self_attn"][0][1, 2, 3, :] = np.nan
    for be in ("numpy", "numba"):
        res = compare_kv_caches(exp, act, baseline_kv=base, backend=be)
        assert_matches_oracle(res, exp, act, base)


def _bf16_kv(seed, B, H, S, D, nan_at=()):
    """(expected, actual, baseline) one-layer KV, bf16 vs fp32 baseline; NaN written into the
    actual K of batch row 0, head 1 at ``nan_at`` (positions the kernel leaves to numpy)."""
    rng = np.random.default_rng(seed)
    base = make_kv(rng, 1, B=B, H=H, S=S, D=D)
    exp = {n: tuple(x.astype(ml_dtypes.bfloat16) for x in kv) for n, kv in base.items()}
    act = perturb(base, rng, 1e-2, ml_dtypes.bfloat16)
    for s in nan_at:
        act["model.layers.0.self_attn"][0][0, 1, s, :3] = np.nan
    return exp, act, base


def test_fused_kernel_splits_positions_across_threads(monkeypatch):
    """3 threads really split one tensor into 3 position ranges (recorded at the kernel), the
    ranges tile [0, S) without gaps or overlap, and the result equals 1 thread's bit for bit
    and the numpy path's; NaN positions on and next to part boundaries are redone correctly."""
    B, H, S, D = 2, 4, 1000, 128  # 1,024,000 values per tensor: 3 parts of >= _MIN_SPLIT
    assert B * H * S * D // _fused._MIN_SPLIT >= 3
    exp, act, base = _bf16_kv(23, B, H, S, D, nan_at=(0, 332, 333, 665, 999))
    calls = []
    kernel = _fused._kv_kernel

    def recording_kernel(*args):
        calls.append((args[6], args[7]))  # s0, s1
        return kernel(*args)

    monkeypatch.setattr(_fused, "_kv_kernel", recording_kernel)
    outs = {}
    for n in (1, 3):
        monkeypatch.setenv("CAPTURESTORE_METRICS_THREADS", str(n))
        calls.clear()
        outs[n] = compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True, backend="numba")
        parts = sorted(calls)
        want = [(0, 1000)] if n == 1 else [(0, 333), (333, 666), (666, 1000)]
        assert parts == sorted(want * 2), (n, parts)  # K and V, each split into n ranges
    (one, one_raw), (three, three_raw) = outs[1], outs[3]
    for name in ("k_bc", "v_bc", "k_linf", "v_linf", "k_l2", "k_cos", "base_k_linf", "base_v_l2"):
        np.testing.assert_array_equal(getattr(one, name), getattr(three, name), err_msg=name)
    for name in ("tgt_k", "base_v"):
        np.testing.assert_array_equal(getattr(one_raw, name), getattr(three_raw, name), err_msg=name)
    ref, ref_raw = compare_kv_caches(exp, act, baseline_kv=base, return_raw_errors=True, backend="numpy")
    for name in ("k_bc", "v_bc", "k_linf", "v_linf", "base_k_linf"):
        np.testing.assert_array_equal(getattr(three, name), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(three_raw.tgt_k, ref_raw.tgt_k)
    assert np.isfinite(three.k_linf[0, 333, 0, 1])  # NaN excluded, not propagated
    assert np.isfinite(three.k_bc[0, [0, 332, 333, 665, 999], 0]).all()


class _PoisonedNumpy:
    """numpy, except that np.empty hands out memory full of huge finite values (what a
    recycled allocation may hold): any read of an element nobody wrote overflows a sum."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float, **kw):
        x = np.empty(shape, dtype, **kw)
        if x.dtype.kind == "f":
            x.fill(np.finfo(x.dtype).max / 4)
        return x


def test_positions_left_to_numpy_read_no_uninitialised_memory(monkeypatch):
    """Positions holding NaN are skipped by the kernel and redone by the numpy path. Their
    unwritten output slots were summed (sqrt(p q) terms): garbage there raised 'overflow
    encountered in reduce'. With every np.empty buffer of the fused path full of huge values,
    no warning is raised and every position equals the numpy path's bits."""
    exp, act, base = _bf16_kv(24, 2, 3, 40, 32, nan_at=(5, 17, 39))
    kw = dict(baseline_kv=base, return_raw_errors=True)
    want, want_raw = compare_kv_caches(exp, act, backend="numpy", **kw)
    compare_kv_caches(exp, act, backend="numba", **kw)  # compiled before numpy is swapped
    monkeypatch.setattr(_fused, "np", _PoisonedNumpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, got_raw = compare_kv_caches(exp, act, backend="numba", **kw)
    for name in ("k_bc", "v_bc", "k_linf", "v_linf", "base_k_linf", "base_v_linf"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name in ("k_l2", "k_cos", "base_k_l2"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-6, atol=1e-7, err_msg=name)
    for name in ("tgt_k", "base_k", "tgt_v", "base_v"):
        np.testing.assert_array_equal(getattr(got_raw, name), getattr(want_raw, name), err_msg=name)
    assert np.isfinite(got.k_bc[:, [5, 17, 39]]).all()


@pytest.mark.parametrize("bins", [7, 100, 128, 129, 200])
def test_bc_summed_in_the_kernel_or_by_numpy_is_the_numpy_path_s(monkeypatch, bins):
    """Up to 128 bins the kernel sums each position's sqrt(p q) terms itself, in numpy's
    pairwise order (checked against the installed numpy once: ``np_sum_order_holds``); above,
    or where the check fails, it leaves the terms for numpy to sum. Every way gives the numpy
    path's BC bit for bit (a tree order one swap off fails test_fused_bc_identical_on_edge_valued_errors)."""
    exp, act, base = _bf16_kv(25, 2, 4, 64, 32, nan_at=(3,))
    r, a, e = base["model.layers.0.self_attn"][0], act["model.layers.0.self_attn"][0], exp["model.layers.0.self_attn"][0]
    want = compare_kv_caches(exp, act, baseline_kv=base, bins=bins, backend="numpy")
    assert _fused.np_sum_order_holds()
    assert _fused._KVTensorJob(r, a, e, False, bins).sum_bc == (bins <= 128)
    got = compare_kv_caches(exp, act, baseline_kv=base, bins=bins, backend="numba")
    monkeypatch.setattr(_fused, "_NP_SUM_OK", False)
    assert not _fused._KVTensorJob(r, a, e, False, bins).sum_bc
    by_numpy = compare_kv_caches(exp, act, baseline_kv=base, bins=bins, backend="numba")
    for name in ("k_bc", "v_bc"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        np.testing.assert_array_equal(getattr(by_numpy, name), getattr(want, name), err_msg=name)
    assert np.isfinite(got.k_bc).all() and 0 < got.k_bc.min() and got.k_bc.max() <= 1


def test_backend_names_and_missing_numba(monkeypatch):
    import metrics.kv as kv

    assert resolve_backend("numpy") == "numpy"
    assert resolve_backend("auto") == "numba"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda")
    import metrics.bc as bc

    monkeypatch.setattr(bc, "_NUMBA_OK", False)
    assert resolve_backend("auto") == "numpy"
    with pytest.raises(ValueError, match="numba"):
        resolve_backend("numba")


def test_without_numba_the_numpy_path_is_chosen():
    """A process where numba cannot be imported still compares (numpy path)."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np\n"
        "from metrics.kv import compare_kv_caches, resolve_backend\n"
        "x = np.random.default_rng(0).normal(size=(1, 2, 3, 4)).astype(np.float32)\n"
        "r = compare_kv_caches({'l': (x, x)}, {'l': (x * 1.01, x)}, baseline_kv={'l': (x, x)})\n"
        "assert resolve_backend('auto') == 'numpy' and r.k_bc.shape == (1, 3, 1)\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_no_cache_location_compiles_without_cache():
    """numba refuses cache=True when no cache directory can be written (here: a function with
    no source file); the kernels then compile per process instead of failing."""
    ns = {"np": np}
    exec(compile("def f(x):\n    return x + 1\n", "<no-such-file>", "exec"), ns)
    with pytest.raises(RuntimeError, match="cannot cache"):
        numba.njit(cache=True)(ns["f"])
    g = _fused._njit()(ns["f"])
    assert g(41) == 42 and not math.isnan(g(1.5))


@numba.njit(cache=False)
def _both_head_sums(r, a, e, three, D, simd):  # pragma: no cover - compiled
    """Every head vector of the flat r, a, e through the vector (simd) or the scalar head sums:
    (sums [vectors, 4] float32, extrema [vectors, 5] uint32, target / base errors)."""
    nv = r.size // D
    sums = np.zeros((nv, 4), np.float32)
    ext = np.zeros((nv, 5), np.uint32)
    td = np.zeros(r.size, np.float32)
    bd = np.zeros(r.size, np.float32)
    acc = np.zeros((4, 8), np.float32)
    for v in range(nv):
        at = np.uint64(v * D)
        if simd:
            s0, s1, s2, s3, x0, x1, x2, x3, x4 = _fused._head_sums_simd(r, a, e, three, at, D, td, bd, at)
        else:
            s0, s1, s2, s3, x0, x1, x2, x3, x4 = _fused._head_sums(r, a, e, three, at, D, td, bd, at, acc)
        sums[v, 0], sums[v, 1], sums[v, 2], sums[v, 3] = s0, s1, s2, s3
        ext[v, 0], ext[v, 1], ext[v, 2], ext[v, 3], ext[v, 4] = x0, x1, x2, x3, x4
    return sums, ext, td, bd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("three", [True, False])
def test_vector_head_sums_are_the_scalar_ones_bit_for_bit(dtype, three):
    """The <8 x float> head sums (head_dim a multiple of 8) against the scalar lane loop they
    replace: same float32 sums, extrema and absolute errors to the bit, on vectors spread over
    many binades, with ties, zeros of both signs, subnormals, NaN and infinities. (Fails with the
    vector's lanes combined in another tree order, or a lane fed out of order.)"""
    rng = np.random.default_rng(24)
    nv, D = 300, 128
    r = (rng.standard_normal(nv * D) * np.exp2(rng.integers(-30, 30, nv * D))).astype(np.float32)
    a = (r * (1 + rng.standard_normal(nv * D).astype(np.float32) * np.float32(1e-2))).astype(np.float32)
    e = (r * (1 + rng.standard_normal(nv * D).astype(np.float32) * np.float32(1e-3))).astype(np.float32)
    r[:D] = 0.0
    r[D : 2 * D] = -0.0
    a[2 * D : 3 * D] = r[2 * D : 3 * D]  # ties: zero error
    r[3 * D : 4 * D] = np.float32(1e-40) * rng.standard_normal(D).astype(np.float32)  # subnormals
    for x, bad in ((r, np.nan), (a, np.inf), (e, -np.inf)):
        x[rng.random(nv * D) < 2e-3] = bad
    if dtype == "bfloat16":
        r, a, e = (x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in (r, a, e))
    got = _both_head_sums(r, a, e, three, D, True)
    want = _both_head_sums(r, a, e, three, D, False)
    for g, w, what in zip(got, want, ("sums", "extrema", "target errors", "base errors")):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=what)


@_fused.numba.njit(cache=False)
def _roots(x, out):
    for i in range(x.size):
        out[i] = _fused._sqrt(x[i])


def test_the_kernels_root_is_numpys_bit_for_bit():
    """``_fused._sqrt`` (llvm.sqrt.f64, in place of numba's call of its C helper) against
    np.sqrt on float64s over every binade, subnormals, zeros of both signs, infinities, NaN and
    negatives (a NaN either way), and on the p q products the BC takes roots of. (Fails with a
    root not correctly rounded, exp(log(x) / 2): 24,587 values differ; and with x ** 0.5, whose
    root of -0.0 is +0.0.)"""
    rng = np.random.default_rng(5)
    x = np.concatenate([
        rng.random(20000) * np.exp2(rng.integers(-1074, 1023, 20000).astype(np.float64)),
        (rng.integers(0, 129, 20000) / (128 + 1e-10)) * (rng.integers(0, 129, 20000) / (128 + 1e-10)),
        [0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308],
    ])
    got = np.empty_like(x)
    _roots(x, got)
    with np.errstate(invalid="ignore"):
        want = np.sqrt(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint64), want[~nan].view(np.uint64))
