"""Optional fused KV-metrics kernels compiled with numba: one read of each source per position.

``compare_kv_caches`` (``metrics.kv``) uses them when numba imports ("auto"); without numba
the numpy path runs, and it stays the reference. Per batch row, a block of 16 positions is
walked head-major (each source read as contiguous runs of positions x head_dim, the next
block's runs prefetched meanwhile: each run starts a new 4 KiB page, where the hardware
prefetchers stop; 21% of one thread's time on an 80-layer cache); per head vector
``[head_dim]`` the baseline, actual and expected values are read once (bf16 as uint16, widened
by a shift in registers, so no float32 copy of the cache is made) and give:

- the sums ``|r|^2, r.d, |d|^2, |db|^2`` in float32 (as the numpy path's einsum), each over 8
  explicit lanes combined in a fixed order, so the bits do not depend on how the compiler
  vectorises; L2 / cosine agree with the numpy path to float32 rounding of these sums (for
  head_dim a multiple of 8 the lanes are those of one LLVM ``<8 x float>`` vector,
  ``_head_sums_simd``: the same adds in the same order; the three-way kernel 3.7 -> ~2 ms per
  8 x 1024 x 128 bf16 tensor, one thread: numba does not vectorise the scalar lane loop);
- ``max|r|``, ``max|d|``, ``min|d|``, ``max|db|``, ``min|db|`` as integer max/min over the
  float bits with the sign cleared (exact in any order; bits >= 0x7F800000 flag a NaN or an
  infinity), so relative L-inf is bit-identical to the numpy path;
- three-way: per position, the 100-bin histograms of both absolute-error samples over all heads
  with ``metrics.bc``'s bin rule exactly: edges ``k * step + lo`` in float32 (``np.linspace``),
  bin = the last edge <= x (last bin closed), every value in the last bin when ``step == 0``.
  A SIMD estimate, checked against its two edges; a row where any value disagrees is binned
  by the scalar loop (moved by at most one bin, checked again, falling back to an exact
  per-value walk), so counts are the rule's; ``sqrt(p * q)`` per
  bin (p, q from a per-tensor table of k / (n + 1e-10): the same divisions) summed in numpy's
  pairwise order (``_np_sum``, checked against the installed numpy once; else the terms are
  written out for numpy to sum): BC is bit-identical to ``metrics.bc``. (Both differ
  from np.histogram in one corner inherited from the numpy path: a range of one or two
  subnormals, where ``width / bins`` underflows to 0, is binned as a flat range.)

A position whose inputs hold any NaN or infinity is flagged instead of measured; the caller
recomputes it with the numpy path (NaN exclusion and the NaN / 0.0 BC rules live in one place).
Positions are split across threads (``num_threads``; the kernels release the GIL); one
layer's K and V parts share the threads, and the results are written straight into the
caller's arrays (``compare_kv_caches``' per-layer slices), with no per-tensor copy. Compiled code
is cached on disk where numba finds a writable place, else compiled once per process.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._numba import import_numba

numba = import_numba()  # guarded: a vLLM engine still starts in this process (see _numba)
from numba.core import types  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

__all__ = ["kv_tensors_metrics", "hist_counts", "takes", "num_threads"]

_F32 = np.float32
_U32 = np.uint32
_U64 = np.uint64
_FLOAT32 = np.dtype(np.float32)
_ABS = np.uint32(0x7FFFFFFF)
_NONFINITE = np.uint32(0x7F800000)
# per-head outputs: target L-inf, L2, cosine, base L-inf, base L2
_OUT_FIELDS = ("linf", "l2", "cos", "base_linf", "base_l2")
_MIN_SPLIT = 1 << 18  # values per tensor below which one thread does it all
_BLOCK = 16  # positions per block: its errors (2 x 16 x heads x head_dim float32) stay in L2


def _njit(**kw):
    """numba.njit with a compile cache where one can be written; without a writable cache
    location (read-only install, no home) numba refuses cache=True: compile per process."""
    def deco(f):
        try:
            return numba.njit(cache=True, nogil=True, boundscheck=False, **kw)(f)
        except Exception:  # noqa: BLE001 - numba raises RuntimeError for "no locator"
            return numba.njit(cache=False, nogil=True, boundscheck=False, **kw)(f)
    return deco


def _widen(x):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(x):
    if isinstance(x, types.Integer):  # bf16 bits: exact widening by a shift
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


@intrinsic
def _sqrt(typingctx, x):  # pragma: no cover - compiled
    """The square root of a float64 as ``llvm.sqrt.f64`` (one sqrtsd, or a vector one in a
    vectorised loop): IEEE's correctly rounded root, as numpy's and libm's. numba lowers
    ``np.sqrt`` of a float64 to a call of its C helper ``numba_sqrt``, which no loop vectorises:
    9% of the KV compare's time was that call."""
    if x != types.float64:
        return None
    sig = types.float64(types.float64)

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64]), "llvm.sqrt.f64")
        return builder.call(fn, args)

    return sig, codegen


@_njit()
def _lanes_total(acc, j):  # pragma: no cover - compiled
    """acc[j, 0..7] summed in a fixed tree order."""
    return ((acc[j, 0] + acc[j, 1]) + (acc[j, 2] + acc[j, 3])) + ((acc[j, 4] + acc[j, 5]) + (acc[j, 6] + acc[j, 7]))


@_njit()
def _head_sums(rf, af, ef, three, base, D, td, bd, tb, acc):  # pragma: no cover - compiled
    """Sums and extrema of one head vector: rf[base:base + D] (flat views of the sources,
    base unsigned so numba emits no negative-index wraparound: ~1.7x on this loop); in
    three-way its absolute errors go to td[tb:tb + D] (target) and bd[...] (base).

    Float sums go to 8 explicit lanes (element i to lane i % 8, acc: float32 [4, 8]) and are
    combined in a fixed order: the same bits whatever the compiler inlines or vectorises (a
    reassociating reduction gave different bits after a fresh and a cached compile).
    Max/min are integer reductions over the float bits with the sign cleared: exact in any order.
    """
    acc[:, :] = 0
    rmax = _U32(0)
    dmax = _U32(0)
    dmin = _U32(0xFFFFFFFF)
    bmax = _U32(0)
    bmin = _U32(0xFFFFFFFF)
    i = _U64(0)
    n = _U64(D)
    while i < n:
        j = i & _U64(7)
        k = base + i
        rv = _F32(_widen(rf[k]))
        d = _F32(_widen(af[k]) - rv)
        acc[0, j] += rv * rv
        acc[1, j] += rv * d
        acc[2, j] += d * d
        rb = _U32(rv.view(np.uint32) & _ABS)
        du = _U32(d.view(np.uint32) & _ABS)
        rmax = rb if rb > rmax else rmax
        dmax = du if du > dmax else dmax
        if three:
            db = _F32(_widen(ef[k]) - rv)
            acc[3, j] += db * db
            bu = _U32(db.view(np.uint32) & _ABS)
            td[tb + i] = _U32(du).view(np.float32)
            bd[tb + i] = _U32(bu).view(np.float32)
            dmin = du if du < dmin else dmin
            bmax = bu if bu > bmax else bmax
            bmin = bu if bu < bmin else bmin
        i += _U64(1)
    return (_lanes_total(acc, 0), _lanes_total(acc, 1), _lanes_total(acc, 2), _lanes_total(acc, 3),
            rmax, dmax, dmin, bmax, bmin)


_LANES = 8
_LINE = 64  # bytes per cache line


@intrinsic
def _prefetch(typingctx, x, at, n):  # pragma: no cover - compiled
    """Hint the CPU to bring x[at:at + n] (a C-contiguous array's flat elements) into its
    caches: one ``llvm.prefetch`` (read, high locality) per cache line. A hint only: nothing
    is read and no value changes (the kernel only names addresses inside the array)."""
    sig = types.void(x, at, n)

    def codegen(context, builder, signature, args):
        x_v, at_v, n_v = args
        tys = signature.args
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        data = context.make_array(tys[0])(context, builder, x_v).data
        first = builder.bitcast(builder.gep(data, [context.cast(builder, at_v, tys[1], types.int64)]), i8p)
        nbytes = builder.mul(context.cast(builder, n_v, tys[2], types.int64),
                             ir.Constant(i64, context.get_abi_sizeof(context.get_data_type(tys[0].dtype))))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, _LINE), i64) as (off, _):
            builder.call(fn, [builder.gep(first, [off]), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _ir_types(lanes):
    """i64, i32, float and the <lanes x float>, <lanes x i32> vector types of an intrinsic."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    return ir.IntType(64), i32, f32, ir.VectorType(f32, lanes), ir.VectorType(i32, lanes)


@intrinsic
def _head_sums_simd(typingctx, rf, af, ef, three, base, D, td, bd, tb):  # pragma: no cover - compiled
    """``_head_sums`` for D a multiple of 8, written as LLVM vector code: each float lane sum
    is one lane of an ``<8 x float>`` accumulator (element i to lane i % 8, added in order from
    0.0, then the same fixed tree), so the bits are ``_head_sums``'s; max/min are unsigned
    integer vector max/min over the float bits, as there. numba compiles with LLVM's SLP
    vectoriser off and the loop vectoriser does not reorder float sums, so without this the
    lane sums run scalar (~2x the time of the whole three-way kernel's other work)."""
    sig = types.Tuple([types.float32] * 4 + [types.uint32] * 5)(rf, af, ef, three, base, D, td, bd, tb)

    def codegen(context, builder, signature, args):
        rf_v, af_v, ef_v, three_v, base_v, d_v, td_v, bd_v, tb_v = args
        tys = signature.args
        i64, i32, f32, v8f, v8i = _ir_types(_LANES)

        def ptr_of(ty, val):
            return context.make_array(ty)(context, builder, val).data

        def idx(ty, val):
            return context.cast(builder, val, ty, types.int64)

        def load8(ty, ptr, at):
            p = builder.gep(ptr, [at])
            if ty.dtype == types.uint16:  # bf16 bits: widen by a shift (exact)
                v = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2)
                v = builder.shl(builder.zext(v, v8i), ir.Constant(v8i, [16] * _LANES))
                return builder.bitcast(v, v8f)
            return builder.load(builder.bitcast(p, v8f.as_pointer()), align=4)

        def store8(ptr, at, vi):
            p = builder.gep(ptr, [at])
            builder.store(builder.bitcast(vi, v8f), builder.bitcast(p, v8f.as_pointer()), align=4)

        def umax(x, y):
            return builder.select(builder.icmp_unsigned(">", x, y), x, y)

        def umin(x, y):
            return builder.select(builder.icmp_unsigned("<", x, y), x, y)

        rp, ap_, ep = ptr_of(tys[0], rf_v), ptr_of(tys[1], af_v), ptr_of(tys[2], ef_v)
        tdp, bdp = ptr_of(tys[6], td_v), ptr_of(tys[7], bd_v)
        b0, n, t0 = idx(tys[4], base_v), idx(tys[5], d_v), idx(tys[8], tb_v)
        is3 = context.cast(builder, three_v, tys[3], types.boolean)
        zf = ir.Constant(v8f, [0.0] * _LANES)
        z = ir.Constant(v8i, [0] * _LANES)
        ones = ir.Constant(v8i, [0xFFFFFFFF] * _LANES)
        absmask = ir.Constant(v8i, [0x7FFFFFFF] * _LANES)
        acc = [cgutils.alloca_once_value(builder, zf) for _ in range(4)]
        rmax, dmax, bmax = (cgutils.alloca_once_value(builder, z) for _ in range(3))
        dmin, bmin = (cgutils.alloca_once_value(builder, ones) for _ in range(2))

        def add(slot, x):
            builder.store(builder.fadd(builder.load(slot), x), slot)

        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n, ir.Constant(i64, _LANES), i64) as (i, _):
            at = builder.add(b0, i)
            r = load8(tys[0], rp, at)
            d = builder.fsub(load8(tys[1], ap_, at), r)
            add(acc[0], builder.fmul(r, r))
            add(acc[1], builder.fmul(r, d))
            add(acc[2], builder.fmul(d, d))
            ru = builder.and_(builder.bitcast(r, v8i), absmask)
            du = builder.and_(builder.bitcast(d, v8i), absmask)
            builder.store(umax(ru, builder.load(rmax)), rmax)
            builder.store(umax(du, builder.load(dmax)), dmax)
            with builder.if_then(is3, likely=True):
                db = builder.fsub(load8(tys[2], ep, at), r)
                add(acc[3], builder.fmul(db, db))
                bu = builder.and_(builder.bitcast(db, v8i), absmask)
                out_at = builder.add(t0, i)
                store8(tdp, out_at, du)
                store8(bdp, out_at, bu)
                builder.store(umin(du, builder.load(dmin)), dmin)
                builder.store(umax(bu, builder.load(bmax)), bmax)
                builder.store(umin(bu, builder.load(bmin)), bmin)

        def tree(slot):  # ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as _lanes_total
            v = builder.load(slot)
            e = [builder.extract_element(v, ir.Constant(i32, j)) for j in range(_LANES)]
            return builder.fadd(builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3])),
                                builder.fadd(builder.fadd(e[4], e[5]), builder.fadd(e[6], e[7])))

        def reduce(slot, op):  # exact in any order
            v = builder.load(slot)
            out = builder.extract_element(v, ir.Constant(i32, 0))
            for j in range(1, _LANES):
                out = op(out, builder.extract_element(v, ir.Constant(i32, j)))
            return out

        vals = [tree(a) for a in acc] + [reduce(rmax, umax), reduce(dmax, umax), reduce(dmin, umin),
                                        reduce(bmax, umax), reduce(bmin, umin)]
        return context.make_tuple(builder, signature.return_type, vals)

    return sig, codegen


@_njit()
def _bin_of(x, lo, step, scale, last, zero, one):  # pragma: no cover - compiled
    """np.histogram's bin of x over edges k * step + lo (computed in x's float type, no FMA),
    k in [0, last]: the last edge <= x. last, zero, one: bins - 1, 0, 1 in that type."""
    k = np.floor((x - lo) * scale)
    if not k >= zero:  # also NaN (scale overflowed to inf at x == lo)
        k = zero
    if k > last:
        k = last
    while k > zero and x < k * step + lo:
        k = k - one
    while k < last and x >= (k + one) * step + lo:
        k = k + one
    return np.int32(k)


def _vector_lanes() -> int:
    """float32 lanes of the host's widest vector register numba compiles for: 16 with AVX-512,
    else 8. A 16-lane loop on an AVX2 machine is split by LLVM into two 8-lane halves whose
    masks it packs to bytes and back (~75 instructions per 16 values, registers spilled: the
    binning's estimate 0.41 ns a value against 0.27 with 8 lanes, 2-core EPYC)."""
    try:
        from llvmlite import binding

        return 16 if binding.get_host_cpu_features().get("avx512f") else 8
    except Exception:  # noqa: BLE001 - no feature query on this build: the portable width
        return 8


_BIN_LANES = _vector_lanes()


@intrinsic
def _bin_est_simd(typingctx, x, m, lo, step, scale, last, zero, one, idx):  # pragma: no cover - compiled
    """The estimate of ``_bin_row`` over x[:m] (m a multiple of _BIN_LANES; x float32 and idx
    uint32, both C-contiguous) as LLVM vector code: idx[i] = floor((x - lo) * scale) clamped to
    last, and whether any of them is not the bin its two edges say (x below edge k, or at or
    above edge k + 1 with k < last), the same float32 operations as the scalar loop (fmul then
    fadd, never contracted; floor; ordered compares). Nothing is corrected here: a wrong estimate
    is rare (a value within rounding of an edge), and where one is, ``_bin_row`` bins the row
    again with the scalar loop. The flags are combined as 32-bit lane masks, not as i1 vectors
    (which LLVM packs to bytes and back on AVX2), and the bin is converted signed (k is 0 ..
    last: the same integer; AVX2 has no unsigned conversion): 0.52 -> 0.27 ns a value, 2-core
    EPYC. Returns whether any value would move."""
    sig = types.boolean(x, m, lo, step, scale, last, zero, one, idx)

    def codegen(context, builder, signature, args):
        x_v, m_v, lo_v, step_v, scale_v, last_v, zero_v, one_v, idx_v = args
        tys = signature.args
        i64, i32, f32, vf, vi = _ir_types(_BIN_LANES)

        def splat(val):
            v = ir.Constant(vf, ir.Undefined)
            for j in range(_BIN_LANES):
                v = builder.insert_element(v, val, ir.Constant(i32, j))
            return v

        lo, step, scale, last, one = (splat(v) for v in (lo_v, step_v, scale_v, last_v, one_v))
        inf = splat(ir.Constant(f32, float("inf")))
        xp = context.make_array(tys[0])(context, builder, x_v).data
        ip = context.make_array(tys[8])(context, builder, idx_v).data
        m = context.cast(builder, m_v, tys[1], types.int64)
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{_BIN_LANES}f32")
        moved = cgutils.alloca_once_value(builder, ir.Constant(vi, [0] * _BIN_LANES))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), m, ir.Constant(i64, _BIN_LANES), i64) as (i, _):
            v = builder.load(builder.bitcast(builder.gep(xp, [i]), vf.as_pointer()), align=4)
            t = builder.fmul(builder.fsub(v, lo), scale)
            k = builder.call(floor, [builder.select(builder.fcmp_ordered("<", t, last), t, last)])
            # x < edge k: at k = 0 the edge is lo, which no value is below (lo is their minimum)
            dn = builder.fcmp_ordered("<", v, builder.fadd(builder.fmul(k, step), lo))
            # x >= edge k + 1 where k < last (the last bin is closed: no edge above it)
            above = builder.select(builder.fcmp_ordered("<", k, last),
                                   builder.fadd(builder.fmul(builder.fadd(k, one), step), lo), inf)
            up = builder.fcmp_ordered(">=", v, above)
            builder.store(builder.fptosi(k, vi), builder.bitcast(builder.gep(ip, [i]), vi.as_pointer()), align=4)
            builder.store(builder.or_(builder.load(moved), builder.sext(builder.or_(dn, up), vi)), moved)
        ne = builder.icmp_unsigned("!=", builder.load(moved), ir.Constant(vi, [0] * _BIN_LANES))
        any_moved = builder.icmp_unsigned("!=", builder.bitcast(ne, ir.IntType(_BIN_LANES)),
                                          ir.Constant(ir.IntType(_BIN_LANES), 0))
        return builder.zext(any_moved, context.get_value_type(types.boolean))

    return sig, codegen


def _bin_est(x, n, lo, step, scale, last, zero, one, idx):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError


@overload(_bin_est, inline="always")
def _bin_est_impl(x, n, lo, step, scale, last, zero, one, idx):
    """(m, moved): _bin_est_simd over the first m = n - n % _BIN_LANES values where x is C-contiguous
    float32 and every edge parameter float32 (m = 0, nothing done, for anything else: the scalar
    loop's arithmetic would be another type's)."""
    if (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"
            and isinstance(idx, types.Array) and idx.dtype == types.uint32 and idx.layout == "C"
            and all(t == types.float32 for t in (lo, step, scale, last, zero, one))):
        def impl(x, n, lo, step, scale, last, zero, one, idx):
            m = n - n % _BIN_LANES
            if m == 0:
                return 0, False
            return m, _bin_est_simd(x, m, lo, step, scale, last, zero, one, idx)
        return impl
    return lambda x, n, lo, step, scale, last, zero, one, idx: (0, False)


@_njit()
def _bin_row(x, n, lo, step, scale, last, zero, one, idx):  # pragma: no cover - compiled
    """idx[:n] = _bin_of(x[:n]) for lo <= x <= hi, no NaN, finite scale, step > 0.

    A branch-free estimate floor((x - lo) * scale) (SIMD: ``_bin_est_simd`` for float32 rows,
    which only flags a value its edges disagree with); where any value disagrees, the row is
    binned by the scalar loop, which moves such a value by one bin; only then is the row checked
    against its edges, and a value that fails is binned by the exact loop (edges that collapse
    under rounding)."""
    # float lanes and bools only: numba widens int32 arithmetic to int64, halving SIMD width
    m, moved = _bin_est(x, n, lo, step, scale, last, zero, one, idx)
    for i in range(0 if moved else m, n):
        v = x[i]
        t = (v - lo) * scale
        k = np.floor(t if t < last else last)
        dn = (v < k * step + lo) & (k > zero)
        up = (v >= (k + one) * step + lo) & (k < last)
        k = k - one if dn else k
        k = k + one if up else k
        moved |= dn | up
        idx[i] = np.uint32(k)
    if not moved:
        return
    wrong = False
    for i in range(n):
        v = x[i]
        k = type(lo)(idx[i])
        wrong |= ((v < k * step + lo) & (k > zero)) | ((v >= (k + one) * step + lo) & (k < last))
    if not wrong:
        return
    for i in range(n):
        idx[i] = _bin_of(x[i], lo, step, scale, last, zero, one)


@_njit()
def _scatter(idx, n, hist4):  # pragma: no cover - compiled
    """hist4[j % 4, idx[j]] += 1: four interleaved histograms break the store->load chain on
    runs of one bin."""
    m = n - n % 4
    for i in range(0, m, 4):
        hist4[0, idx[i]] += 1
        hist4[1, idx[i + 1]] += 1
        hist4[2, idx[i + 2]] += 1
        hist4[3, idx[i + 3]] += 1
    for i in range(m, n):
        hist4[0, idx[i]] += 1


@_njit()
def _bin_params(lo, hi, bins):  # pragma: no cover - compiled
    """step and estimate scale exactly as metrics.bc computes them (float32)."""
    width = _F32(hi - lo)
    step = _F32(width / _F32(bins))
    if step == _F32(0.0):
        return step, _F32(0.0)
    return step, _F32(_F32(bins) / width)


@_njit()
def _scatter2(ia, ib, n, h, st):  # pragma: no cover - compiled
    """Both samples' counts: h[j % 2 * st + ia[j]] += 1 and h[(2 + j % 2) * st + ib[j]] += 1.
    Unsigned indices (no wraparound code) and four interleaved histograms, so a run of one bin
    does not serialise on store->load forwarding: ~2.4x over one histogram per sample."""
    m = _U64(n - n % 2)
    s1 = _U64(st)
    s2 = _U64(2 * st)
    s3 = _U64(3 * st)
    i = _U64(0)
    while i < m:
        h[_U64(ia[i])] += 1
        h[s1 + _U64(ia[i + _U64(1)])] += 1
        h[s2 + _U64(ib[i])] += 1
        h[s3 + _U64(ib[i + _U64(1)])] += 1
        i += _U64(2)
    if n % 2:
        h[_U64(ia[m])] += 1
        h[s2 + _U64(ib[m])] += 1


@_njit()
def _np_sum(x, n):  # pragma: no cover - compiled
    """x[:n] (float64, n <= 128) summed in the order of numpy's pairwise summation, which
    ``np.add.reduce`` uses along a contiguous axis: fewer than 8 values one by one from -0.0;
    else 8 accumulators fed in blocks of 8, combined as a fixed tree, then the rest one by one
    (more than 128 values would be split in halves: not done here, and no recursion, which
    numba's cache does not survive). ``np_sum_order_holds`` checks the order against the
    installed numpy before it is relied on."""
    return _pw_leaf(x, 0, n, False)  # the pooled verdict's block sum, the same adds


NP_SUM_MAX = 128  # BC bins up to which the kernel sums its terms itself


@_njit()
def _bc_terms_frac(h, st, frac, out):  # pragma: no cover - compiled
    """out[j] = sqrt(p_j * q_j) of the two samples of n values each that ``_scatter2`` counted
    into h (p = count / (n + 1e-10), as metrics.bc), with frac[k] = k / (n + 1e-10) for k in
    0..n: the same divisions, made once per tensor instead of twice per bin. The products
    first, then their roots in a loop of their own, which LLVM vectorises (the table lookups
    kept it scalar: half this function's time)."""
    for j in range(out.size):
        out[j] = frac[h[j] + h[st + j]] * frac[h[2 * st + j] + h[3 * st + j]]
    for j in range(out.size):
        out[j] = _sqrt(out[j])


@_njit()
def _kv_kernel(r, a, e, three, want_raw, bins, s0, s1, o_linf, o_l2, o_cos, o_blinf, o_bl2, bc, sq, sum_bc,
               bad, raw_t, raw_b):  # pragma: no cover
    """Positions [s0, s1) of one K or V tensor.

    r, a, e: [batch, kv_head, seq, head_dim] (float32 or bf16 bits as uint16; e == r unused
    when not three-way). o_*: float64 [batch, seq, kv_head] outputs (_OUT_FIELDS; any strides,
    e.g. one layer's slice of compare_kv_caches' result arrays; o_blinf, o_bl2 unused when not
    three-way); three-way BC: with sum_bc, bc [batch, seq] = the clipped sum of the sqrt(p q)
    terms in numpy's order (``_np_sum``), else sq [batch, seq, bins] = the terms for numpy to
    sum; bad: uint8 [batch, seq] set to 1 where an input is NaN/inf (nothing else written
    there); raw_t, raw_b: float32 [batch, seq, kv_head * head_dim] absolute errors when
    want_raw (any strides).
    """
    B, H, S, D = r.shape
    n = H * D
    T = _BLOCK
    eps = _F32(1e-10)
    td = np.empty(T * n, np.float32)  # absolute errors of a block of positions, all heads
    bd = np.empty(T * n, np.float32)
    rf = r.reshape(-1)
    af = a.reshape(-1)
    ef = e.reshape(-1)
    ext = np.empty((T, 4), np.uint32)  # per position: target min, max, base min, max (bits)
    nonfinite = np.zeros(T, np.bool_)
    ti = np.empty(n, np.uint32)
    bi_ = np.empty(n, np.uint32)
    hist = np.zeros(4 * bins, np.int32)  # base-sample lanes 0, 1; target lanes 2, 3
    acc = np.zeros((4, 8), np.float32)
    terms = np.empty(bins)
    frac = np.empty(n + 1)  # k / (n + 1e-10): p and q of a bin holding k of a sample's n values
    dn = np.float64(n) + 1e-10
    for k in range(n + 1):
        frac[k] = np.float64(k) / dn
    last = _F32(bins - 1)
    zero = _F32(0.0)
    one = _F32(1.0)
    for b in range(B):
        for sb in range(s0, s1, T):
            nt = min(T, s1 - sb)
            for t in range(nt):
                ext[t, 0] = _U32(0xFFFFFFFF)
                ext[t, 1] = _U32(0)
                ext[t, 2] = _U32(0xFFFFFFFF)
                ext[t, 3] = _U32(0)
                nonfinite[t] = False
            # head-major over the block: each source is read as H contiguous runs of nt * D
            # values (a position-major walk would keep 3 * H strided streams open)
            # positions s + T of this part's next block, where it has one (prefetched while this
            # block is read: the hardware prefetchers stop at each 4 KiB page a head's run starts);
            # t < s1 - sb - T keeps s + T below s1, so a partial or last block prefetches nothing
            # past the part (nor past the array)
            ahead = min(nt, s1 - sb - T)
            for h in range(H):
                for t in range(nt):
                    s = sb + t
                    if t < ahead:  # the same head, one block on: read after this block
                        at = ((b * H + h) * S + s + T) * D
                        _prefetch(rf, at, D)
                        _prefetch(af, at, D)
                        if three:
                            _prefetch(ef, at, D)
                    if D % _LANES == 0:
                        R, P, Q, QB, rmax, dmax, dmin, b_max, b_min = _head_sums_simd(
                            rf, af, ef, three, _U64(((b * H + h) * S + s) * D), D, td, bd, _U64(t * n + h * D)
                        )
                    else:
                        R, P, Q, QB, rmax, dmax, dmin, b_max, b_min = _head_sums(
                            rf, af, ef, three, _U64(((b * H + h) * S + s) * D), D, td, bd, _U64(t * n + h * D), acc
                        )
                    if rmax >= _NONFINITE or dmax >= _NONFINITE or b_max >= _NONFINITE:
                        nonfinite[t] = True
                        continue
                    den_inf = _U32(rmax).view(np.float32)
                    den_inf = den_inf if den_inf > eps else eps
                    Rd = np.float64(R)
                    Pd = np.float64(P)
                    nr = _sqrt(Rd)
                    na = _sqrt(max(Rd + 2 * Pd + np.float64(Q), 0.0))
                    den_l2 = max(nr, 1e-10)
                    o_linf[b, s, h] = np.float64(_F32(_U32(dmax).view(np.float32) / den_inf))
                    o_l2[b, s, h] = _sqrt(np.float64(Q)) / den_l2
                    o_cos[b, s, h] = (Rd + Pd) / (max(nr, 1e-8) * max(na, 1e-8))
                    if three:
                        o_blinf[b, s, h] = np.float64(_F32(_U32(b_max).view(np.float32) / den_inf))
                        o_bl2[b, s, h] = np.float64(np.sqrt(QB)) / den_l2
                        ext[t, 0] = dmin if dmin < ext[t, 0] else ext[t, 0]
                        ext[t, 1] = dmax if dmax > ext[t, 1] else ext[t, 1]
                        ext[t, 2] = b_min if b_min < ext[t, 2] else ext[t, 2]
                        ext[t, 3] = b_max if b_max > ext[t, 3] else ext[t, 3]
            for t in range(nt):
                s = sb + t
                if nonfinite[t]:
                    bad[b, s] = 1
                    continue
                if not three:
                    continue
                tdt = td[t * n : (t + 1) * n]
                bdt = bd[t * n : (t + 1) * n]
                if want_raw:
                    raw_t[b, s, :] = tdt
                    raw_b[b, s, :] = bdt
                lo = _U32(ext[t, 2] if ext[t, 2] < ext[t, 0] else ext[t, 0]).view(np.float32)
                hi = _U32(ext[t, 3] if ext[t, 3] > ext[t, 1] else ext[t, 1]).view(np.float32)
                step, scale = _bin_params(lo, hi, bins)
                hist[:] = 0
                if step == zero:  # lo == hi: np.histogram puts every value in the last bin
                    hist[bins - 1] = n
                    hist[3 * bins - 1] = n
                elif scale < np.inf:
                    _bin_row(bdt, n, lo, step, scale, last, zero, one, bi_)
                    _bin_row(tdt, n, lo, step, scale, last, zero, one, ti)
                    _scatter2(bi_, ti, n, hist, bins)
                else:  # a range so narrow that bins / width overflows: exact loop only
                    for i in range(n):
                        hist[_bin_of(bdt[i], lo, step, scale, last, zero, one)] += 1
                        hist[2 * bins + _bin_of(tdt[i], lo, step, scale, last, zero, one)] += 1
                if sum_bc:
                    _bc_terms_frac(hist, bins, frac, terms)
                    v = 0.0 + _np_sum(terms, bins)
                    bc[b, s] = 0.0 if v < 0.0 else (1.0 if v > 1.0 else v)
                else:
                    _bc_terms_frac(hist, bins, frac, sq[b, s])


@_njit()
def _hist_kernel(x, lo, step, scale, last, zero, one, r0, r1, counts):  # pragma: no cover - compiled
    """counts[i] = histogram of row i of x [rows, n] (rows r0..r1; NaN skipped), metrics.bc's
    bin rule; lo, step, scale: [rows], last, zero, one: bins - 1, 0, 1, all of x's dtype
    (step 0: every value in the last bin)."""
    bins = counts.shape[1]
    n = x.shape[1]
    idx = np.empty(n, np.uint32)
    h4 = np.zeros((4, bins), np.int64)
    for i in range(r0, r1):
        row = x[i]
        st = step[i]
        nnan = 0
        for j in range(n):
            nnan += np.int64(row[j] != row[j])
        if st == zero:
            counts[i, bins - 1] += n - nnan
            continue
        lo_i = lo[i]
        sc = scale[i]
        if nnan == 0 and sc < np.inf:
            _bin_row(row, n, lo_i, st, sc, last, zero, one, idx)
            h4[:] = 0
            _scatter(idx, n, h4)
            for j in range(bins):
                counts[i, j] += h4[0, j] + h4[1, j] + h4[2, j] + h4[3, j]
        else:
            for j in range(n):
                v = row[j]
                if v == v:
                    counts[i, _bin_of(v, lo_i, st, sc, last, zero, one)] += 1


def takes(x) -> bool:
    """Whether the kernel reads ``x`` (numpy) as it is: float32 or bf16 bits."""
    return x.dtype == np.float32 or x.dtype.name == "bfloat16"


def _kernel_view(x):
    """float32 as is, bf16 as its uint16 bits, anything else widened to float32 (as the numpy
    path computes); C-contiguous."""
    if x.dtype == _FLOAT32:  # first: dtype.name is a string built per call, ~0.3 us a tensor
        return np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
    else:
        x = x.astype(np.float32)
    return np.ascontiguousarray(x)


_POOL = None


def num_threads() -> int:
    """Threads the kernel splits a tensor over: the CPUs this process may use, at most 8
    (``CAPTURESTORE_METRICS_THREADS`` overrides)."""
    env = os.environ.get("CAPTURESTORE_METRICS_THREADS")
    if env:
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _split_bounds(n_items, work):
    """Contiguous parts [(i0, i1), ...] of [0, n_items) for up to num_threads() threads."""
    most = min(n_items, max(1, work // _MIN_SPLIT))  # the parts the work allows
    if most <= 1:  # none or one whatever the threads: no need to ask (a syscall, ~2 us)
        return [(0, n_items)] if n_items > 0 else []
    parts = min(num_threads(), most)
    if parts == 1:  # most calls (a module tensor's rows): no linspace (~10 us)
        return [(0, n_items)]
    bounds = np.linspace(0, n_items, parts + 1).astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _run_tasks(tasks):
    """Call every task (no argument) on up to num_threads() threads, the calling thread one of
    them; each thread takes the next task when it finishes one. The pool is made once per
    process (a forked child inherits the pool object but not its threads: it makes its own)."""
    _start_tasks(tasks)()


def _start_tasks(tasks):
    """``_run_tasks`` begun: the pool's threads start on the tasks now; returns ``finish()``,
    which the calling thread calls (exactly once, also on an error of its own) to take the tasks
    still left and wait for all of them. What the caller does in between runs while the threads
    compute (its Python, under the GIL, beside kernels that release it)."""
    global _POOL
    n = min(num_threads(), len(tasks))
    if n <= 1:
        def run_all():
            for t in tasks:
                t()
        return run_all
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers < n - 1:
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="metrics-fused"))
    todo = iter(tasks)
    lock = threading.Lock()

    def drain():
        while True:
            with lock:
                t = next(todo, None)
            if t is None:
                return
            t()

    futs = [_POOL[1].submit(drain) for _ in range(n - 1)]

    def finish():
        try:
            drain()
        finally:
            for f in futs:  # every thread done before a result (or an error) is returned
                f.exception()
        for f in futs:
            f.result()
    return finish


def _run_split(fn, n_items, work):
    """fn(i0, i1) over [0, n_items) in up to num_threads() contiguous parts."""
    _run_tasks([functools.partial(fn, i0, i1) for i0, i1 in _split_bounds(n_items, work)])


_NP_SUM_OK = None


def np_sum_order_holds() -> bool:
    """Whether the installed numpy's ``x.sum(axis=-1)`` of float64 rows adds in ``_np_sum``'s
    order (checked once, on rows of 1..NP_SUM_MAX values spread over many binades, with zeros
    among them as BC terms have)."""
    global _NP_SUM_OK
    if _NP_SUM_OK is None:
        rng = np.random.default_rng(20261203)
        ok = True
        for n in range(1, NP_SUM_MAX + 1):
            x = rng.random((4, n)) * np.exp2(rng.integers(-30, 2, (4, n)))
            x[rng.random((4, n)) < 0.3] = 0.0
            want = x.sum(axis=-1)
            ok &= all(_np_sum_py(row) == w for row, w in zip(x, want))
        _NP_SUM_OK = bool(ok)
    return _NP_SUM_OK


def _np_sum_py(row):
    return 0.0 + _np_sum(np.ascontiguousarray(row, np.float64), row.size)


class _KVTensorJob:
    """One K or V tensor for ``_kv_kernel``: its inputs prepared, outputs either the caller's
    (``dest``: arrays of the right shape, any strides) or made here, and its parts."""

    def __init__(self, ref, act, exp, want_raw, bins, dest=None):
        self.three = three = exp is not None
        self.r = _kernel_view(ref)
        self.a = _kernel_view(act)
        self.e = _kernel_view(exp) if three else self.r
        B, H, S, D = self.r.shape
        self.shape, self.want_raw, self.bins = (B, H, S, D), want_raw, bins
        names = _OUT_FIELDS[: 5 if three else 3]
        dest = dict(dest or {})
        for n in names:
            if n not in dest:
                dest[n] = np.empty((B, S, H))
        if three and "bc" not in dest:
            dest["bc"] = np.empty((B, S))
        if want_raw:
            for n in ("tgt_err", "base_err"):
                if n not in dest:
                    dest[n] = np.empty((B, S, H * D), np.float32)
        self.dest = dest
        dummy3 = np.empty((0, 0, 0))
        self.outs = [dest[n] for n in names] + [dummy3] * (5 - len(names))
        self.sum_bc = bool(three and bins <= NP_SUM_MAX and np_sum_order_holds())
        self.bc = dest["bc"] if three and self.sum_bc else np.empty((0, 0))
        self.sq = np.empty((B, S, bins)) if three and not self.sum_bc else np.empty((0, 0, 0))
        self.bad = np.zeros((B, S), np.uint8)
        none = np.empty((0, 0, 0), np.float32)
        self.raw_t = dest["tgt_err"] if want_raw else none
        self.raw_b = dest["base_err"] if want_raw else none

    def parts(self):
        B, H, S, D = self.shape
        if B * H * S * D == 0:
            return []
        return [functools.partial(self._part, s0, s1) for s0, s1 in _split_bounds(S, B * H * S * D)]

    def _part(self, s0, s1):
        _kv_kernel(self.r, self.a, self.e, self.three, self.want_raw, self.bins, s0, s1, *self.outs, self.bc,
                   self.sq, self.sum_bc, self.bad, self.raw_t, self.raw_b)

    def finish(self):
        dest = self.dest
        if self.three and not self.sum_bc:
            dest["bc"][...] = np.clip(self.sq.sum(axis=-1), 0.0, 1.0)
        flagged = self.bad.view(np.bool_)
        if flagged.any():  # the kernel wrote nothing there: keep uninitialised memory out of the sums
            for n in _OUT_FIELDS[: 5 if self.three else 3]:
                dest[n][flagged] = np.nan
            if self.three:
                dest["bc"][flagged] = 0.0
            if self.want_raw:
                dest["tgt_err"][flagged] = np.nan
                dest["base_err"][flagged] = np.nan
        return dest, np.flatnonzero(flagged.any(axis=0))


def kv_tensors_metrics(items, want_raw: bool, bins: int):
    """Metrics of several K / V tensors (``items``: ``(ref, act, exp, dest)``, e.g. one layer's
    K and V; ref, act, exp numpy ``[batch, kv_head, seq, head_dim]``, exp None in two-way), their
    parts run on the threads together: one wait for all of them, not one per tensor.

    Returns ``[(res, bad_positions)]``: ``res`` as ``metrics.kv._one_tensor`` (``[batch, seq,
    kv_head]`` arrays linf, l2, cos, base_linf, base_l2; ``bc [batch, seq]``; raw errors
    ``[batch, seq, kv_head * head_dim]``), written into ``dest`` (arrays of those names and
    shapes, any strides) where given; and the sorted positions (seq indices) the kernel left to
    the numpy path because an input there is NaN or infinite (their values are NaN, BC 0, until
    the caller redoes them)."""
    jobs = [_KVTensorJob(r, a, e, want_raw, bins, d) for r, a, e, d in items]
    _run_tasks([t for j in jobs for t in j.parts()])
    return [j.finish() for j in jobs]


def hist_counts(x, lo, step, scale, bins):
    """Counts ``[rows, bins]`` int64 of each row of ``x: [rows, n]`` (float32/float64, NaN
    skipped) with metrics.bc's bin rule; lo, step, scale: ``[rows]`` of x's dtype."""
    x = np.ascontiguousarray(x)
    rows = x.shape[0]
    counts = np.zeros((rows, bins), np.int64)
    dt = x.dtype
    t = dt.type
    lo, step, scale = (np.ascontiguousarray(v, dtype=dt).reshape(rows) for v in (lo, step, scale))

    def part(r0, r1):
        _hist_kernel(x, lo, step, scale, t(bins - 1), t(0), t(1), r0, r1, counts)

    _run_split(part, rows, x.size)
    return counts


# ---- module tensors: per-row metrics of [row, width] float32 tensors (metrics.modules) ----
#
# Every sum here is the one ``np.einsum("ij,ij->i", x, y, dtype=np.float64)`` forms, in its order:
# per row, two float64 lanes (element i to lane i % 2) fed in blocks of 8 elements, the block's
# last pair first (its SIMD loop unrolled four times), the row's tail pair by pair, then lane 0 +
# lane 1 added to 0. A product of two float32 values is exact in float64, so a fused multiply-add
# gives the same bits. ``einsum_order_holds`` checks this order against the installed numpy
# before the kernel is used (another numpy build may sum differently: then numpy runs).
# A row wider than einsum's buffer (NPY_BUFSIZE, 8192 elements, whatever np.setbufsize says) is
# summed piece by piece: each piece of 8192 as a row of its own, in the order above, and the
# pieces' sums added to the output in turn (``_row_sums_wide``; an LM head's 128,256-wide rows).
_MOD_SUMS = 7  # b.b, be.be, te.te, b.e, e.e, b.a, a.a
EINSUM_MAX_WIDTH = 8192  # rows up to this width einsum sums in one piece


@_njit()
def _row_sums(b, e, a, be, te, acc, sums):  # pragma: no cover - compiled
    """sums[0:7] of one row (einsum's order, see above); be, te: its absolute errors. The 14
    lane accumulators are scalars (registers), not acc's memory; acc is unused (kept for the
    signature)."""
    n = b.size
    s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = s40 = s41 = s50 = s51 = s60 = s61 = 0.0
    i = 0
    while n - i >= 8:
        for u in range(3, -1, -1):
            k = i + 2 * u
            bv = np.float64(_widen(b[k]))
            ev = np.float64(_widen(e[k]))
            av = np.float64(_widen(a[k]))
            x = np.float64(be[k])
            y = np.float64(te[k])
            bw = np.float64(_widen(b[k + 1]))
            ew = np.float64(_widen(e[k + 1]))
            aw = np.float64(_widen(a[k + 1]))
            xw = np.float64(be[k + 1])
            yw = np.float64(te[k + 1])
            s00 = s00 + bv * bv
            s01 = s01 + bw * bw
            s10 = s10 + x * x
            s11 = s11 + xw * xw
            s20 = s20 + y * y
            s21 = s21 + yw * yw
            s30 = s30 + bv * ev
            s31 = s31 + bw * ew
            s40 = s40 + ev * ev
            s41 = s41 + ew * ew
            s50 = s50 + bv * av
            s51 = s51 + bw * aw
            s60 = s60 + av * av
            s61 = s61 + aw * aw
        i += 8
    while i < n:
        bv = np.float64(_widen(b[i]))
        ev = np.float64(_widen(e[i]))
        av = np.float64(_widen(a[i]))
        x = np.float64(be[i])
        y = np.float64(te[i])
        s00 = s00 + bv * bv
        s10 = s10 + x * x
        s20 = s20 + y * y
        s30 = s30 + bv * ev
        s40 = s40 + ev * ev
        s50 = s50 + bv * av
        s60 = s60 + av * av
        if i + 1 < n:
            bw = np.float64(_widen(b[i + 1]))
            ew = np.float64(_widen(e[i + 1]))
            aw = np.float64(_widen(a[i + 1]))
            xw = np.float64(be[i + 1])
            yw = np.float64(te[i + 1])
            s01 = s01 + bw * bw
            s11 = s11 + xw * xw
            s21 = s21 + yw * yw
            s31 = s31 + bw * ew
            s41 = s41 + ew * ew
            s51 = s51 + bw * aw
            s61 = s61 + aw * aw
        i += 2
    sums[0] = 0.0 + (s00 + s01)
    sums[1] = 0.0 + (s10 + s11)
    sums[2] = 0.0 + (s20 + s21)
    sums[3] = 0.0 + (s30 + s31)
    sums[4] = 0.0 + (s40 + s41)
    sums[5] = 0.0 + (s50 + s51)
    sums[6] = 0.0 + (s60 + s61)


@_njit()
def _row_sums_wide(b, e, a, be, te, acc, sums, part):  # pragma: no cover - compiled
    """``_row_sums`` of a row wider than EINSUM_MAX_WIDTH in einsum's order: each piece of
    EINSUM_MAX_WIDTH elements summed as ``_row_sums`` sums a row (into part, float64 [7]), the
    piece sums added to sums in turn, from 0."""
    n = b.size
    for k in range(_MOD_SUMS):
        sums[k] = 0.0
    for p0 in range(0, n, EINSUM_MAX_WIDTH):
        p1 = min(n, p0 + EINSUM_MAX_WIDTH)
        _row_sums(b[p0:p1], e[p0:p1], a[p0:p1], be[p0:p1], te[p0:p1], acc, part)
        for k in range(_MOD_SUMS):
            sums[k] = sums[k] + part[k]


_SUM_ROWS = 4  # rows per block of _row_sums_simd


@intrinsic
def _row_sums_simd(typingctx, b, e, a, r, n, sums):  # pragma: no cover - compiled
    """``_row_sums`` of rows r .. r + 3 of C-contiguous [rows, n] b, e, a at once (each float32,
    or bf16 bits as uint16, widened by the shift of ``_widen``), for n a multiple of 8, as LLVM ``<8 x double>`` vector code: sums[r + j, 0:7] (float64 [rows, 7],
    C-contiguous). Each vector holds the two einsum lanes of four rows (row j's lane 0 and 1 in
    elements 2j, 2j + 1); a block of 8 columns is loaded row by row and its column pairs gathered
    across the rows (a 4 x 4 transpose of 64-bit pairs), then fed last pair first, as in
    ``_row_sums``: every lane sees the same float64 products added in the same order, so the
    bits are the scalar loop's. The errors |e - b|, |a - b| are formed in float32 as the kernel
    forms them. numba compiles the scalar loop's 14 lane chains as scalar code (its loop
    vectoriser does not reorder float sums, the SLP vectoriser is off): with this, the whole
    per-row kernel on 2048-wide rows went from 2.83 to ~1.5 ns a value, one thread."""
    sig = types.void(b, e, a, r, n, sums)

    def codegen(context, builder, signature, args):
        b_v, e_v, a_v, r_v, n_v, s_v = args
        tys = signature.args
        i64, i32, f32, v8f, v8i = _ir_types(8)
        f64 = ir.DoubleType()
        v8d, v4q = ir.VectorType(f64, 8), ir.VectorType(i64, 4)
        bp, ep, ap = (context.make_array(tys[k])(context, builder, v).data for k, v in enumerate((b_v, e_v, a_v)))
        sp = context.make_array(tys[5])(context, builder, s_v).data
        r = context.cast(builder, r_v, tys[3], types.int64)
        n = context.cast(builder, n_v, tys[4], types.int64)
        starts = [builder.mul(builder.add(r, ir.Constant(i64, j)), n) for j in range(_SUM_ROWS)]
        absmask = ir.Constant(v8i, [0x7FFFFFFF] * 8)
        acc = [cgutils.alloca_once_value(builder, ir.Constant(v8d, [0.0] * 8)) for _ in range(_MOD_SUMS)]

        def mask(m):
            return ir.Constant(ir.VectorType(i32, len(m)), m)

        v8h = ir.VectorType(ir.IntType(16), 8)
        shift = ir.Constant(v8i, [16] * 8)

        def load8(p, bits, at):  # 8 float32 values: as stored, or bf16 bits widened (the shift of _widen)
            if not bits:
                return builder.load(builder.bitcast(builder.gep(p, [at]), v8f.as_pointer()), align=4)
            h = builder.load(builder.bitcast(builder.gep(p, [at]), v8h.as_pointer()), align=2)
            return builder.bitcast(builder.shl(builder.zext(h, v8i), shift), v8f)

        def pairs(p, bits, i):  # [pair 0, .., pair 3] of columns i .. i + 7: <row 0 x2u, x2u+1, row 1 .., .., row 3 ..>
            rows = [builder.bitcast(load8(p, bits, builder.add(st, i)), v4q) for st in starts]
            t0 = builder.shuffle_vector(rows[0], rows[1], mask([0, 4, 2, 6]))  # r0p0 r1p0 r0p2 r1p2
            t1 = builder.shuffle_vector(rows[0], rows[1], mask([1, 5, 3, 7]))  # r0p1 r1p1 r0p3 r1p3
            t2 = builder.shuffle_vector(rows[2], rows[3], mask([0, 4, 2, 6]))
            t3 = builder.shuffle_vector(rows[2], rows[3], mask([1, 5, 3, 7]))
            c = [builder.shuffle_vector(t0, t2, mask([0, 1, 4, 5])), builder.shuffle_vector(t1, t3, mask([0, 1, 4, 5])),
                 builder.shuffle_vector(t0, t2, mask([2, 3, 6, 7])), builder.shuffle_vector(t1, t3, mask([2, 3, 6, 7]))]
            return [builder.bitcast(x, v8f) for x in c]

        def absdiff(x, y):
            return builder.bitcast(builder.and_(builder.bitcast(builder.fsub(x, y), v8i), absmask), v8f)

        def add(k, x, y):
            builder.store(builder.fadd(builder.load(acc[k]), builder.fmul(x, y)), acc[k])

        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n, ir.Constant(i64, 8), i64) as (i, _):
            bs, es, as_ = (pairs(p, tys[k].dtype == types.uint16, i) for k, p in enumerate((bp, ep, ap)))
            for u in (3, 2, 1, 0):
                x, y = absdiff(es[u], bs[u]), absdiff(as_[u], bs[u])
                bd, ed, ad, xd, yd = (builder.fpext(v, v8d) for v in (bs[u], es[u], as_[u], x, y))
                for k, (p, q) in enumerate(((bd, bd), (xd, xd), (yd, yd), (bd, ed), (ed, ed), (bd, ad), (ad, ad))):
                    add(k, p, q)
        zero = ir.Constant(f64, 0.0)
        for k in range(_MOD_SUMS):
            v = builder.load(acc[k])
            for j in range(_SUM_ROWS):
                lane = builder.fadd(builder.extract_element(v, ir.Constant(i32, 2 * j)),
                                    builder.extract_element(v, ir.Constant(i32, 2 * j + 1)))
                at = builder.add(builder.mul(builder.add(r, ir.Constant(i64, j)), ir.Constant(i64, _MOD_SUMS)),
                                 ir.Constant(i64, k))
                builder.store(builder.fadd(zero, lane), builder.gep(sp, [at]))
        return context.get_dummy_value()

    return sig, codegen


def _row_sums_block(b, e, a, r, n, sums):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError


@overload(_row_sums_block, inline="always")
def _row_sums_block_impl(b, e, a, r, n, sums):
    """Whether rows r .. r + 3 got their sums from _row_sums_simd (n a multiple of 8, b, e, a
    float32 or bf16 bits (uint16) and sums float64, all 2-D C-contiguous); False, nothing done,
    for anything else."""
    def fits(t, dt):
        return isinstance(t, types.Array) and t.dtype == dt and t.ndim == 2 and t.layout == "C"

    if all(fits(t, types.float32) or fits(t, types.uint16) for t in (b, e, a)) and fits(sums, types.float64):
        def impl(b, e, a, r, n, sums):
            if n % 8 != 0 or n == 0:
                return False
            _row_sums_simd(b, e, a, r, n, sums)
            return True
        return impl
    return lambda b, e, a, r, n, sums: False


@_njit()
def _module_rows_kernel(b, e, a, bins, r0, r1, be_flat, te_flat, sums_all, maxes_all, sq_all, fold, bc_all, bad_all,
                        o, eo):  # pragma: no cover
    """Rows [r0, r1) of [rows, width] b (baseline), e (expected), a (actual), each float32 or bf16
    bits (uint16, widened as read: ``_widen``), written to rows o + r of the per-row outputs
    (``*_all``: a stack of several tensors' rows, of any widths) and to the errors from value eo
    of be_flat / te_flat on (1-D: the errors of several tensors, each ``[rows, width]`` in turn;
    the outputs below are their part, sliced here: ~2 us a tensor less than slicing in Python).

    Writes be = |e - b|, te = |a - b| (float32, as numpy), sums [rows, 7] (einsum order),
    maxes [rows, 3] float32: max |b|, max be, max te; the row's BC of be vs te (metrics.bc's
    bins): with fold, bcv[row] = numpy's clipped sum of its sqrt(p q) terms (``_np_sum``, bins
    <= NP_SUM_MAX), else the terms into sq [rows, bins] for numpy to sum. bad[row] = 1 where be or te holds a NaN or b
    an infinity (the numpy path's test for its NaN-aware reductions), 2 where only the BC is
    left to numpy (an infinite error: np.histogram has no finite range); nothing else is
    meaningful in a flagged row.
    """
    n = b.shape[1]
    be = be_flat[eo:eo + b.shape[0] * n].reshape((b.shape[0], n))
    te = te_flat[eo:eo + b.shape[0] * n].reshape((b.shape[0], n))
    sums = sums_all[o:]
    maxes = maxes_all[o:]
    sq = sq_all if fold else sq_all[o:]
    bcv = bc_all[o:]
    bad = bad_all[o:]
    acc = np.zeros((_MOD_SUMS, 2), np.float64)
    part = np.empty(_MOD_SUMS, np.float64)
    terms = np.empty(bins, np.float64)
    ti = np.empty(n, np.uint32)
    bi_ = np.empty(n, np.uint32)
    hist = np.zeros(4 * bins, np.int32)
    last = _F32(bins - 1)
    zero = _F32(0.0)
    one = _F32(1.0)
    wide = n > EINSUM_MAX_WIDTH  # summed piece by piece (_row_sums_wide), never by _row_sums_simd
    vec_to = r0  # rows below this have their sums from _row_sums_simd
    for r in range(r0, r1):
        if not wide and r >= vec_to and r + _SUM_ROWS <= r1 and _row_sums_block(b, e, a, r, n, sums):
            vec_to = r + _SUM_ROWS
        br = b[r]
        er = e[r]
        ar = a[r]
        ber = be[r]
        ter = te[r]
        bmax = _U32(0)
        dmax = _U32(0)
        dmin = _U32(0xFFFFFFFF)
        emax = _U32(0)
        emin = _U32(0xFFFFFFFF)
        for k in range(n):
            bv = _F32(_widen(br[k]))
            bu = _U32(bv.view(np.uint32) & _ABS)
            eu = _U32(_F32(_widen(er[k]) - bv).view(np.uint32) & _ABS)
            du = _U32(_F32(_widen(ar[k]) - bv).view(np.uint32) & _ABS)
            ber[k] = _U32(eu).view(np.float32)
            ter[k] = _U32(du).view(np.float32)
            bmax = bu if bu > bmax else bmax
            emax = eu if eu > emax else emax
            emin = eu if eu < emin else emin
            dmax = du if du > dmax else dmax
            dmin = du if du < dmin else dmin
        if emax > _NONFINITE or dmax > _NONFINITE or bmax >= _NONFINITE:  # NaN error / infinite baseline
            bad[r] = 1
            continue
        if wide:
            _row_sums_wide(br, er, ar, ber, ter, acc, sums[r], part)
        elif r >= vec_to:
            _row_sums(br, er, ar, ber, ter, acc, sums[r])
        maxes[r, 0] = _U32(bmax).view(np.float32)
        maxes[r, 1] = _U32(emax).view(np.float32)
        maxes[r, 2] = _U32(dmax).view(np.float32)
        if emax == _NONFINITE or dmax == _NONFINITE:  # an infinite error: BC by numpy (NaN)
            bad[r] = 2
            continue
        lo = _U32(emin if emin < dmin else dmin).view(np.float32)
        hi = _U32(emax if emax > dmax else dmax).view(np.float32)
        step, scale = _bin_params(lo, hi, bins)
        hist[:] = 0
        if step == zero:
            hist[bins - 1] = n
            hist[3 * bins - 1] = n
        elif scale < np.inf:
            _bin_row(ber, n, lo, step, scale, last, zero, one, bi_)
            _bin_row(ter, n, lo, step, scale, last, zero, one, ti)
            _scatter2(bi_, ti, n, hist, bins)
        else:
            for i in range(n):
                hist[_bin_of(ber[i], lo, step, scale, last, zero, one)] += 1
                hist[2 * bins + _bin_of(ter[i], lo, step, scale, last, zero, one)] += 1
        # every bin's sqrt(p q), branch-free: where either count is 0 it is sqrt(+0.0) = +0.0,
        # what skipping the bin left (a test on every bin mispredicted: 1.7x the kernel's time
        # on 128-wide rows)
        da = np.float64(n) + 1e-10
        sqr = terms if fold else sq[r]
        for jb in range(bins):
            ha = hist[jb] + hist[bins + jb]
            hb = hist[2 * bins + jb] + hist[3 * bins + jb]
            sqr[jb] = _sqrt((np.float64(ha) / da) * (np.float64(hb) / da))
        if fold:
            bcv[r] = min(max(0.0 + _np_sum(terms, bins), 0.0), 1.0)


def module_row_metrics(b, e, a, bins: int):
    """The per-row quantities of ``metrics.modules`` for float32 (or bfloat16) ``[rows, width]``
    b, e, a (any width): ``(base_err, tgt_err, sums [rows, 7], maxes
    [rows, 3], bc [rows], bad [rows])``; see ``_module_rows_kernel``. bc is NaN where bad."""
    return module_row_metrics_parts([(b, e, a)], bins)


def module_row_metrics_parts(parts, bins: int):
    """``module_row_metrics`` of the rows of every ``(b, e, a)`` of parts (``[rows_k, width]``,
    one width) stacked in order: base_err and tgt_err ``[rows, width]``, the rest as there."""
    be, te, sums, maxes, bc, bad = module_row_metrics_ragged(parts, bins)
    n = parts[0][0].shape[1]
    return be.reshape(sums.shape[0], n), te.reshape(sums.shape[0], n), sums, maxes, bc, bad  # not -1: width 0


def module_row_metrics_ragged(parts, bins: int):
    """``module_row_metrics`` of the rows of every ``(b, e, a)`` of parts (``[rows_k, width_k]``,
    float32 or bfloat16, widths free) stacked in order, each part read where it lies. Returns
    ``(base_err, tgt_err, sums, maxes, bc, bad)``: the errors 1-D float32, every part's
    ``[rows_k, width_k]`` values in turn; the rest one row per row of every part, in order.
    ``RowMetricsJob`` starts it and returns before it is done."""
    return RowMetricsJob(parts, bins).finish()


class RowMetricsJob:
    """``module_row_metrics_ragged`` of parts, started on the threads when made: its outputs
    (attributes be, te, sums, maxes, bc, bad; the errors 1-D) are allocated and final where they
    lie once ``finish()`` returns, so a caller can take views of them before (``metrics.modules``
    builds its per-tensor results while the kernels run).

    The inputs are never copied into one stack (a stacked copy of three roles cost as much as a
    fifth of the compare at a 1.5B shape), and a bfloat16 part is read as its bits and widened in
    the kernel (a widened copy of each bf16 capture, new memory every comparison, cost ~0.1 s of a
    store comparison at a 1.5B shape). Widths are free so that a prompt's tensors of every width
    are one stack and one start (the per-width groups' own numpy work after the kernels cost ~0.1
    ms a group).

    The work is a table of tasks: a run of small parts (a tiny model's module tensors, a few rows
    each), about an eighth of a thread's share of the values, or a thread's share of the rows of
    a part large enough to split. Each thread makes one kernel call per dtype group
    (``_module_rows_stealing``), which takes the next task from a counter shared by the threads
    (an atomic add) until none is left: the parts reach it as addresses in a table, so no thread
    needs the GIL between tasks. With a task a call (tuples of parts, as before), a pool thread
    needed the GIL for every call's dispatch, and while the calling thread ran Python (the
    results made beside the kernels, the next prompt prepared) it waited for it: ~1 ms for a
    0.2 ms task."""

    def __init__(self, parts, bins: int):
        # the parts as kernel views (C order; their memory is what the tables point at, held by
        # every task's call) and as a table: a row per part, (b, e, a addresses, rows, width, row
        # offset, value offset); numpy over the parts, not Python per part (1,136 parts in a tiny
        # model's 8 prompts, where ~3 us a part of Python was a tenth of the compare)
        held = [(_kernel_view(b), _kernel_view(e), _kernel_view(a)) for b, e, a in parts]
        n = len(held)
        m = np.fromiter((v[0].shape[0] for v in held), np.int64, n)
        w = np.fromiter((v[0].shape[1] for v in held), np.int64, n)
        size = m * w
        o = np.cumsum(m) - m
        eo = np.cumsum(size) - size
        self.rows = rows = int(m.sum())
        values = int(size.sum())
        self.be = be = np.empty(values, np.float32)
        self.te = te = np.empty(values, np.float32)
        self.sums = sums = np.empty((rows, _MOD_SUMS))
        self.maxes = maxes = np.empty((rows, 3), np.float32)
        # the BC terms summed in the kernel, in numpy's order (no [rows, bins] array to fill and sum)
        self.fold = fold = bins <= NP_SUM_MAX and np_sum_order_holds()
        self.sq = sq = np.zeros((0, 0) if fold else (rows, bins))
        self.bc = bc = np.empty(rows)
        self.bad = bad = np.zeros(rows, np.uint8)
        outs = (be, te, sums, maxes, sq, fold, bc, bad)
        table = np.column_stack([data_addresses([x for v in held for x in v]).reshape(n, 3), m, w, o, eo])
        keys = [(v[0].dtype, v[1].dtype, v[2].dtype) for v in held]
        groups = dict.fromkeys(keys)  # the dtype groups, in order
        per = max(_MIN_SPLIT // 8, values // (8 * num_threads()) + 1)
        calls = []
        for key in groups:
            mine = (m > 0) if len(groups) == 1 else (m > 0) & np.array([k == key for k in keys])
            split = mine & (size >= _MIN_SPLIT)
            small = np.flatnonzero(mine & ~split)
            # runs of small parts, each closed once its values reach per (contiguous, in order)
            run = (np.cumsum(size[small]) - size[small]) // per
            bounds = [0, *(np.flatnonzero(np.diff(run)) + 1).tolist(), small.size] if small.size else [0]
            entries = [np.column_stack([small, np.zeros_like(small), m[small]])]
            for k in np.flatnonzero(split).tolist():  # a thread's share of a large part's rows: a task each
                for r0, r1 in _split_bounds(int(m[k]), int(size[k])):
                    entries.append(np.array([[k, r0, r1]], np.int64))
                    bounds.append(bounds[-1] + 1)
            entries = np.concatenate(entries).astype(np.int64, copy=False)
            bounds = np.array(bounds, np.int64)
            counter = np.zeros(1, np.int64)
            protos = tuple(_proto(t) for t in key)
            # a call per thread even for one task: the pool's thread takes it while this one runs
            # Python (the results, the next prompt); the held views travel with the call, so a
            # task still running keeps its inputs alive whatever happens to the job
            call = functools.partial(_holding, held, _module_rows_stealing, *protos, table, entries, bounds, counter,
                                     bins, *outs)
            calls += [call] * (num_threads() if len(bounds) > 1 else 0)
        self._finish = _start_tasks(calls)

    def finish(self):
        """Wait for the kernels (the calling thread takes its share); returns ``(be, te, sums,
        maxes, bc, bad)``, bc NaN where bad."""
        self._finish()
        if not self.fold:
            np.clip(self.sq.sum(axis=1), 0.0, 1.0, out=self.bc)
        self.bc[self.bad != 0] = np.nan
        return self.be, self.te, self.sums, self.maxes, self.bc, self.bad


def data_addresses(arrays) -> np.ndarray:
    """The data addresses of numpy arrays (``x.ctypes.data`` of each, int64), read in bulk where
    this numpy's array objects hold the pointer where ``PyArray_DATA`` reads it (checked once
    per process against ``ctypes.data``): ~40 ns an array against ~1 us for ``x.ctypes.data``,
    which builds an object per call. The arrays are alive while this runs (the caller's list)."""
    arrays = list(arrays)
    if not _data_field_holds():
        return np.array([x.ctypes.data for x in arrays], np.int64).reshape(len(arrays))
    ids = np.fromiter(map(id, arrays), np.int64, len(arrays))
    return _load_data_fields(ids, _DATA_OFFSET)


_DATA_FIELD = None  # whether an array object's data pointer is read at id(x) + _DATA_OFFSET
_DATA_OFFSET = 16  # PyArrayObject_fields: PyObject_HEAD (refcount, type), then ``char *data``


def _data_field_holds() -> bool:
    global _DATA_FIELD
    if _DATA_FIELD is None:
        import sys
        ok = sys.implementation.name == "cpython" and not hasattr(sys, "gettotalrefcount")  # no debug build's header
        if ok:
            base = np.arange(64, dtype=np.float32).reshape(8, 8)
            ro = base[2:, 1:].copy()
            ro.flags.writeable = False
            probe = [base, base[3:], base[1:, 2:], base.view(np.uint16), ro, np.empty(0, np.float64),
                     np.asfortranarray(base), base.T]
            ok = _load_data_fields(np.fromiter(map(id, probe), np.int64, len(probe)), _DATA_OFFSET).tolist() == [
                x.ctypes.data for x in probe]
        _DATA_FIELD = bool(ok)
    return _DATA_FIELD


@intrinsic
def _load_i64(typingctx, addr):  # pragma: no cover - compiled
    """The int64 at the address ``addr``."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load(ptr)

    return types.int64(addr), codegen


@_njit()
def _load_data_fields(ids, offset):  # pragma: no cover - compiled
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        out[i] = _load_i64(ids[i] + offset)
    return out


def _holding(held, fn, *args):
    """fn(*args), held (memory the arguments point into) referenced while it runs."""
    return fn(*args)


_PROTOS: dict = {}  # dtype -> an empty array of it: tells the kernel how to read a role's addresses


def _proto(dtype):
    if dtype not in _PROTOS:
        _PROTOS[dtype] = np.empty((0, 0), dtype)
    return _PROTOS[dtype]


def _runs(work, per, most=None):
    """Contiguous runs ``(i, j)`` of items 0 .. len(work) - 1, in order: each closed once its
    work reaches per, or at ``most`` items; the last may hold less."""
    out, i, total = [], 0, 0
    for j, w in enumerate(work, 1):
        total += w
        if total >= per or j - i == most or j == len(work):
            out.append((i, j))
            i, total = j, 0
    return out


@intrinsic
def _ptr_like(typingctx, addr, proto):  # pragma: no cover - compiled
    """A pointer of proto's dtype to the address ``addr`` (an integer)."""
    if not isinstance(addr, types.Integer) or not isinstance(proto, types.Array):
        return None
    ptr = types.CPointer(proto.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, proto), codegen


@intrinsic
def _next_task(typingctx, counter):  # pragma: no cover - compiled
    """counter[0] += 1 as one atomic add (seq_cst), returning the value before: the threads of a
    job each take a different task."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(counter), codegen


@_njit()
def _module_rows_stealing(pb, pe, pa, table, entries, bounds, counter, bins, be, te, sums, maxes, sq, fold, bc,
                          bad):  # pragma: no cover - compiled
    """``_module_rows_kernel`` of tasks taken in turn from ``counter`` (shared by the threads)
    until none is left. Part k is table[k] = (b, e, a addresses, rows, width, row offset, value
    offset), each role C-contiguous ``[rows, width]`` of the dtype of pb, pe, pa (empty arrays:
    only their types are used), in memory the caller keeps alive; task t is entries[bounds[t]:
    bounds[t + 1]], each (part, r0, r1): rows [r0, r1) of the part."""
    ntasks = bounds.shape[0] - 1
    while True:
        t = _next_task(counter)
        if t >= ntasks:
            return
        for x in range(bounds[t], bounds[t + 1]):
            k = entries[x, 0]
            shape = (table[k, 3], table[k, 4])
            b = numba.carray(_ptr_like(table[k, 0], pb), shape)
            e = numba.carray(_ptr_like(table[k, 1], pe), shape)
            a = numba.carray(_ptr_like(table[k, 2], pa), shape)
            _module_rows_kernel(b, e, a, bins, entries[x, 1], entries[x, 2], be, te, sums, maxes, sq, fold, bc, bad,
                                table[k, 5], table[k, 6])


_EINSUM_OK = None


def einsum_order_holds() -> bool:
    """Whether the installed numpy's ``einsum("ij,ij->i", x, y, dtype=float64)`` sums float32
    rows in the order ``_row_sums`` replays (checked once, on rows of every length up to 40 and
    a few longer ones, values spread over many binades so that any other order shows; 5 rows:
    a block of four in ``_row_sums_simd`` where the width is a multiple of 8, one scalar), and
    rows wider than its buffer in the pieces ``_row_sums_wide`` replays."""
    global _EINSUM_OK
    if _EINSUM_OK is None:
        rng = np.random.default_rng(20261202)
        ok = True
        for n in [*range(1, 41), 127, 1000, 4099, 4096, 8192, 8193, 2 * 8192 + 8, 3 * 8192 + 5]:
            x = (rng.standard_normal((5, n)) * np.exp2(rng.integers(-20, 20, (5, n)))).astype(np.float32)
            y = (rng.standard_normal((5, n)) * np.exp2(rng.integers(-20, 20, (5, n)))).astype(np.float32)
            z = (rng.standard_normal((5, n)) * np.exp2(rng.integers(-20, 20, (5, n)))).astype(np.float32)
            _, _, sums, _, _, _ = module_row_metrics(x, y, z, 10)
            with np.errstate(all="ignore"):
                be, te = np.abs(y - x), np.abs(z - x)
            want = [np.einsum("ij,ij->i", p, q, dtype=np.float64)
                    for p, q in ((x, x), (be, be), (te, te), (x, y), (y, y), (x, z), (z, z))]
            ok &= bool(np.array_equal(sums, np.stack(want, axis=1)))
        _EINSUM_OK = ok
    return _EINSUM_OK


@_njit()
def _pooled_bc_kernel(x, y, bins, sq):  # pragma: no cover - compiled
    """sq[:] = the sqrt(p q) terms of the BC of two finite float32 samples x, y (metrics.bc's
    bins over their joint range)."""
    lo = np.inf
    hi = -np.inf
    for v in x:
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    for v in y:
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    lo = _F32(lo)
    hi = _F32(hi)
    nx = x.size
    ny = y.size
    hist = np.zeros(4 * bins, np.int64)
    last = _F32(bins - 1)
    zero = _F32(0.0)
    one = _F32(1.0)
    step, scale = _bin_params(lo, hi, bins)
    if step == zero:
        hist[bins - 1] = nx
        hist[3 * bins - 1] = ny
    elif scale < np.inf:
        ix = np.empty(nx, np.uint32)
        iy = np.empty(ny, np.uint32)
        _bin_row(x, nx, lo, step, scale, last, zero, one, ix)
        _bin_row(y, ny, lo, step, scale, last, zero, one, iy)
        for i in range(nx):
            hist[ix[i]] += 1
        for i in range(ny):
            hist[2 * bins + iy[i]] += 1
    else:
        for i in range(nx):
            hist[_bin_of(x[i], lo, step, scale, last, zero, one)] += 1
        for i in range(ny):
            hist[2 * bins + _bin_of(y[i], lo, step, scale, last, zero, one)] += 1
    da = np.float64(nx) + 1e-10
    db = np.float64(ny) + 1e-10
    for j in range(bins):
        sq[j] = _sqrt((np.float64(hist[j]) / da) * (np.float64(hist[2 * bins + j]) / db))


def pooled_bc(x, y, bins: int) -> float:
    """``metrics.bc.bhattacharyya_coefficient(x, y, bins)`` of two non-empty 1-D float32
    samples with every value finite, in one kernel call: the same bins and counts, hence the
    same bits."""
    sq = np.empty(bins)
    _pooled_bc_kernel(np.ascontiguousarray(x), np.ascontiguousarray(y), bins, sq)
    return float(np.clip(sq.reshape(1, bins).sum(axis=1), 0.0, 1.0)[0])


# ---- the pooled verdict of one tensor (metrics.verdict._tensor_numbers), every value finite ----
#
# The numbers of ``_tensor_numbers`` over chunks ``[rows, width]`` of absolute errors, read where
# they lie (no concatenation, no float64 copy), in one call per tensor:
# - the float64 sums of squares of the RMS in the order ``np.mean`` sums them: numpy's pairwise
#   summation over the concatenated values (a run of at most 128 summed with 8 accumulators, a
#   longer one split at half its length rounded down to a multiple of 8), then 0.0 + that;
# - the two pooled BCs with ``pooled_bc``'s bins and counts, and numpy's sum of sqrt(p q);
# - the per-position L-inf (row maxima) and ``np.quantile``'s linear interpolation of their order
#   statistics, in float32 as numpy computes it for float32 input.
# ``pairwise_order_holds`` and ``quantile_rule_holds`` check both rules against the installed
# numpy (where they do not hold numpy runs). Values are read as float32 bits: every value finite
# and >= +0 means bits < 0x7F800000, where integer order is float order; a value outside that
# (NaN, inf, a set sign bit) leaves the whole tensor to numpy.
_PW_BLOCK = 128
POOL_PARTS = (4, 16, 64)  # tuple lengths compiled for (padded with empty parts; each a compile, cached)
_EMPTY_PART = np.zeros(0, np.float32)
_MAX_POSITIONS = 1 << 24  # np.quantile's virtual index is float32: positions exact up to here
# out[] of _pooled_kernel
(_P_STATUS, _P_SSB, _P_SST, _P_BC, _P_NOISE_BC, _P_NEVEN, _P_NODD, _P_QB, _P_QT, _P_QE, _P_QO, _P_MAXB,
 _P_MAXT) = range(13)
_P_FIELDS = 13


@_njit()
def _pw_blocks_scalar(a, o, n, square):  # pragma: no cover - compiled
    """``_pw_leaf``'s 8 accumulators over the first n - n % 8 values of a[o:] (n >= 8; o, n
    unsigned), added ((0+1)+(2+3))+((4+5)+(6+7)); returns (that sum, n - n % 8)."""
    r0 = np.float64(a[o])
    r1 = np.float64(a[o + _U64(1)])
    r2 = np.float64(a[o + _U64(2)])
    r3 = np.float64(a[o + _U64(3)])
    r4 = np.float64(a[o + _U64(4)])
    r5 = np.float64(a[o + _U64(5)])
    r6 = np.float64(a[o + _U64(6)])
    r7 = np.float64(a[o + _U64(7)])
    if square:
        r0, r1, r2, r3, r4, r5, r6, r7 = r0 * r0, r1 * r1, r2 * r2, r3 * r3, r4 * r4, r5 * r5, r6 * r6, r7 * r7
    i = _U64(8)
    m = n - n % _U64(8)
    if square:
        while i < m:
            p = o + i
            v0 = np.float64(a[p])
            v1 = np.float64(a[p + _U64(1)])
            v2 = np.float64(a[p + _U64(2)])
            v3 = np.float64(a[p + _U64(3)])
            v4 = np.float64(a[p + _U64(4)])
            v5 = np.float64(a[p + _U64(5)])
            v6 = np.float64(a[p + _U64(6)])
            v7 = np.float64(a[p + _U64(7)])
            r0 += v0 * v0
            r1 += v1 * v1
            r2 += v2 * v2
            r3 += v3 * v3
            r4 += v4 * v4
            r5 += v5 * v5
            r6 += v6 * v6
            r7 += v7 * v7
            i += _U64(8)
    else:
        while i < m:
            p = o + i
            r0 += np.float64(a[p])
            r1 += np.float64(a[p + _U64(1)])
            r2 += np.float64(a[p + _U64(2)])
            r3 += np.float64(a[p + _U64(3)])
            r4 += np.float64(a[p + _U64(4)])
            r5 += np.float64(a[p + _U64(5)])
            r6 += np.float64(a[p + _U64(6)])
            r7 += np.float64(a[p + _U64(7)])
            i += _U64(8)
    return ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), m


@intrinsic
def _pw_blocks_simd(typingctx, a, o, m, square):  # pragma: no cover - compiled
    """``_pw_blocks_scalar`` for float32 C-contiguous 1-D a and m a multiple of 8 (>= 8), as LLVM
    ``<8 x double>`` vector code: accumulator j is lane j, started from the first block and added
    block by block in order, then the same tree: the same bits. numba leaves the 8 scalar
    accumulators scalar (~1 ns a value, two such sums per pooled verdict)."""
    sig = types.float64(a, o, m, square)

    def codegen(context, builder, signature, args):
        a_v, o_v, m_v, sq_v = args
        tys = signature.args
        i64, i32, f32, v8f, _ = _ir_types(8)
        v8d = ir.VectorType(ir.DoubleType(), 8)
        base = builder.gep(context.make_array(tys[0])(context, builder, a_v).data,
                           [context.cast(builder, o_v, tys[1], types.int64)])
        m = context.cast(builder, m_v, tys[2], types.int64)
        sq = context.cast(builder, sq_v, tys[3], types.boolean)

        def block(at):
            v = builder.fpext(builder.load(builder.bitcast(builder.gep(base, [at]), v8f.as_pointer()), align=4), v8d)
            return builder.select(sq, builder.fmul(v, v), v)

        acc = cgutils.alloca_once_value(builder, block(ir.Constant(i64, 0)))
        with cgutils.for_range_slice(builder, ir.Constant(i64, 8), m, ir.Constant(i64, 8), i64) as (i, _):
            builder.store(builder.fadd(builder.load(acc), block(i)), acc)
        v = builder.load(acc)
        e = [builder.extract_element(v, ir.Constant(i32, j)) for j in range(8)]
        return builder.fadd(builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3])),
                            builder.fadd(builder.fadd(e[4], e[5]), builder.fadd(e[6], e[7])))

    return sig, codegen


def _pw_blocks(a, o, n, square):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError


@overload(_pw_blocks, inline="always")
def _pw_blocks_impl(a, o, n, square):
    """_pw_blocks_simd where a is float32, 1-D and C-contiguous; _pw_blocks_scalar otherwise."""
    if isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 and a.layout == "C":
        def impl(a, o, n, square):
            m = n - n % _U64(8)
            return _pw_blocks_simd(a, o, m, square), m
        return impl
    return lambda a, o, n, square: _pw_blocks_scalar(a, o, n, square)


@_njit()
def _pw_leaf(a, o, n, square):  # pragma: no cover - compiled
    """numpy's pairwise_sum of the n <= 128 values a[o:o + n] as float64 (squared if square):
    below 8 values one running sum from -0.0, else 8 accumulators over blocks of 8, added as
    ((0+1)+(2+3))+((4+5)+(6+7)), then the rest in order. A float32 square is exact in float64.
    Unsigned indices: no negative-index wraparound code in the loop."""
    o = _U64(o)
    n = _U64(n)
    if n < _U64(8):
        res = -0.0
        for i in range(n):
            v = np.float64(a[o + _U64(i)])
            res += v * v if square else v
        return res
    res, i = _pw_blocks(a, o, n, square)
    while i < n:
        v = np.float64(a[o + i])
        res += v * v if square else v
        i += _U64(1)
    return res


@_njit()
def _pw_runs(n, lens):  # pragma: no cover - compiled
    """The runs numpy's pairwise_sum of n values sums with _pw_leaf, in order: their lengths into
    lens; returns how many (a run longer than 128 is split at half its length rounded down to a
    multiple of 8). An explicit stack: numba's cache cannot load a recursive function."""
    stack = np.empty(128, np.int64)  # right halves still to split (halving from 2**63: < 64 deep)
    top = 0
    stack[0] = n
    k = 0
    while top >= 0:
        m = stack[top]
        top -= 1
        while m > _PW_BLOCK:
            h = m // 2
            h -= h % 8
            top += 1
            stack[top] = m - h
            m = h
        lens[k] = m
        k += 1
    return k


@_njit()
def _pw_combine(n, sums):  # pragma: no cover - compiled
    """pairwise_sum(n) from the sums of its runs (``_pw_runs`` order): each split adds its left
    half's sum and its right half's, as numpy's recursion does; then 0.0 + that, as
    np.add.reduce starts from its identity."""
    size = np.empty(128, np.int64)
    state = np.empty(128, np.int64)  # 0: left half next, 1: right half next, 2: both summed
    vals = np.empty(128, np.float64)  # sums of finished halves, left below right
    top = 0
    nv = 0
    k = 0
    size[0] = n
    state[0] = 0
    while top >= 0:
        m = size[top]
        if m <= _PW_BLOCK:
            vals[nv] = sums[k]
            k += 1
            nv += 1
            top -= 1
            continue
        h = m // 2
        h -= h % 8
        if state[top] == 0:
            state[top] = 1
            top += 1
            size[top] = h
            state[top] = 0
        elif state[top] == 1:
            state[top] = 2
            top += 1
            size[top] = m - h
            state[top] = 0
        else:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
            top -= 1
    return 0.0 + vals[0]


@intrinsic
def _f32_at(typingctx, addr):  # pragma: no cover - compiled
    """A float32 pointer to the address ``addr`` (an integer)."""
    if not isinstance(addr, types.Integer):
        return None
    ptr = types.CPointer(types.float32)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr), codegen


def _part(parts, j):  # pragma: no cover - only its numba overload runs
    raise NotImplementedError


@overload(_part, inline="always")
def _part_impl(parts, j):
    """Part j of the pooled kernel's parts: a tuple of 1-D float32 arrays, or ``(addresses,
    sizes)`` (uint64 and int64 arrays: part j is sizes[j] float32 values at addresses[j], memory
    its caller keeps alive; ``pooled_verdict_numbers_at``)."""
    if (isinstance(parts, types.BaseTuple) and len(parts) == 2 and isinstance(parts[0], types.Array)
            and parts[0].dtype == types.uint64 and isinstance(parts[1], types.Array)
            and parts[1].dtype == types.int64):
        return lambda parts, j: numba.carray(_f32_at(parts[0][j]), parts[1][j])
    return lambda parts, j: parts[j]


@_njit()
def _pw_sum_parts(parts, nparts, n, square):  # pragma: no cover - compiled
    """``np.add.reduce`` of the n values of parts[:nparts] (1-D arrays taken in order as one
    sequence) as float64, squared if square: numpy's pairwise_sum over the sequence. Each part
    is taken from the tuple once (a tuple item at a runtime index is not cheap); a run across
    parts is gathered into a buffer first (``_pw_feed``)."""
    lens, nruns, sums, buf, st = _pw_state(n)
    for j in range(nparts):
        a = _part(parts, j)
        _pw_feed(a, 0, a.size, True, lens, nruns, sums, buf, st, square)
    return _pw_total(n, sums)


@_njit()
def _pw_state(n):  # pragma: no cover - compiled
    """The state of a pairwise sum of n values fed in pieces (``_pw_feed``): the runs' lengths,
    their count, their sums, the buffer of a run across pieces, and (run, values of it gathered)."""
    lens = np.empty(n // 64 + 2, np.int64)  # runs are >= 64 long, but for n <= 128
    nruns = _pw_runs(n, lens)
    return lens, nruns, np.empty(nruns, np.float64), np.empty(_PW_BLOCK, np.float64), np.zeros(2, np.int64)


@_njit()
def _pw_total(n, sums):  # pragma: no cover - compiled
    """The pairwise sum from its runs' sums, every value fed (``_pw_combine``; 0.0 for n == 0)."""
    if n == 0:
        sums[0] = 0.0
    return _pw_combine(n, sums)


@_njit()
def _pw_feed(a, o, end, final, lens, nruns, sums, buf, st, square):  # pragma: no cover - compiled
    """The runs of a pairwise sum (``_pw_state``) that a[o:end] completes, summed: a run that
    lies whole in a[o:end] is summed where it lies; one begun in an earlier piece is completed
    from the buffer. A run that starts here and does not end by ``end`` is gathered into the
    buffer only where final (a[end:] is not the same sequence's); else this stops before it and
    returns its start, for a later call over a longer a[o:end] (the same part, read further) to
    sum where it lies. Returns the offset in a fed up to. The runs' sums are those of
    ``_pw_sum_parts`` over whole parts, whatever pieces the parts are fed in."""
    k = st[0]
    filled = st[1]
    while o < end and k < nruns:
        m = lens[k]
        if filled == 0:
            if o + m <= end:
                sums[k] = _pw_leaf(a, o, m, square)
                o += m
                k += 1
                continue
            if not final:
                break
        take = min(m - filled, end - o)
        for i in range(take):
            buf[filled + i] = np.float64(a[o + i])
        filled += take
        o += take
        if filled == m:
            sums[k] = _pw_leaf(buf, 0, m, square)
            filled = 0
            k += 1
    st[0] = k
    st[1] = filled
    return o


@_njit()
def _kth_u32(x, m, k):  # pragma: no cover - compiled
    """The k-th smallest of x[:m] (uint32), x reordered so that x[k + 1:m] >= it (quickselect,
    Hoare partition around a median of three)."""
    lo = 0
    hi = m - 1
    while hi > lo:
        a = x[lo]
        b = x[(lo + hi) >> 1]
        c = x[hi]
        piv = max(min(a, b), min(max(a, b), c))
        i = lo
        j = hi
        while i <= j:
            while x[i] < piv:
                i += 1
            while x[j] > piv:
                j -= 1
            if i <= j:
                t = x[i]
                x[i] = x[j]
                x[j] = t
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            break
    return x[k]


@_njit()
def _quantile_bits(x, m, q):  # pragma: no cover - compiled
    """np.quantile(v, q) (method "linear") of the m >= 1 float32 values v >= +0 whose bits are
    x[:m] (reordered), as numpy computes it for float32 input: q as float32, the virtual index
    (m - 1) * q in float32, its order statistics floor(index) and the next, and _lerp's formula
    in float32 (from the upper one where the fraction is >= 0.5). Returns float32."""
    v = _F32(_F32(m - 1) * q)
    if v >= _F32(m - 1):
        hi = x[0]
        for i in range(1, m):
            hi = x[i] if x[i] > hi else hi
        return _U32(hi).view(np.float32)
    k = np.int64(np.floor(v))
    g = _F32(v - _F32(k))
    lo = _U32(_kth_u32(x, m, k)).view(np.float32)
    nb = x[k + 1]
    for i in range(k + 2, m):
        nb = x[i] if x[i] < nb else nb
    nxt = _U32(nb).view(np.float32)
    d = _F32(nxt - lo)
    if g >= _F32(0.5):
        return _F32(nxt - _F32(d * _F32(_F32(1.0) - g)))
    return _F32(lo + _F32(d * g))


@_njit()
def _bc_of_counts(hx, hy, nx, ny, bins):  # pragma: no cover - compiled
    """BC from the counts of two samples, as pooled_bc / metrics.bc: p = h / (n + 1e-10), numpy's
    sum of sqrt(p q), clipped to [0, 1]."""
    da = np.float64(nx) + 1e-10
    db = np.float64(ny) + 1e-10
    sq = np.empty(bins)
    for j in range(bins):
        sq[j] = _sqrt((np.float64(hx[j]) / da) * (np.float64(hy[j]) / db))
    s = _pw_sum_parts((sq,), 1, bins, False)
    return min(max(s, 0.0), 1.0)


@_njit()
def _bins_of(x, lo, step, scale, bins, idx):  # pragma: no cover - compiled
    """idx[:x.size] = metrics.bc's bin of each value of x (1-D float32 in [lo, lo + bins * step],
    step > 0), as pooled_bc bins them."""
    last = _F32(bins - 1)
    zero = _F32(0.0)
    one = _F32(1.0)
    if scale < np.inf:
        _bin_row(x, x.size, lo, step, scale, last, zero, one, idx)
    else:
        for i in range(x.size):
            idx[i] = _bin_of(x[i], lo, step, scale, last, zero, one)


_COUNT_WAYS = 8  # interleaved histograms of _count
_BIN_CHUNK = 4096  # values the pooled kernel bins before it counts them


@_njit()
def _count(idx, o, n, h, bins):  # pragma: no cover - compiled
    """h[j * bins + k] (j < _COUNT_WAYS) += the counts of idx[o:o + n], value i into histogram
    (i - o) % 8: a run of one bin (a quarter of a pooled error sample can lie in its first bin)
    spreads over eight counters instead of waiting on one's store; 2.0x over two histograms
    (0.58 -> 0.29 ns a value, one thread, 2-core EPYC)."""
    m = n - n % 8
    i = _U64(o)
    end = _U64(o + m)
    while i < end:  # unsigned indices: no wraparound code for a negative one
        h[_U64(idx[i])] += 1
        h[_U64(bins) + _U64(idx[i + _U64(1)])] += 1
        h[_U64(2 * bins) + _U64(idx[i + _U64(2)])] += 1
        h[_U64(3 * bins) + _U64(idx[i + _U64(3)])] += 1
        h[_U64(4 * bins) + _U64(idx[i + _U64(4)])] += 1
        h[_U64(5 * bins) + _U64(idx[i + _U64(5)])] += 1
        h[_U64(6 * bins) + _U64(idx[i + _U64(6)])] += 1
        h[_U64(7 * bins) + _U64(idx[i + _U64(7)])] += 1
        i += _U64(8)
    while i < _U64(o + n):
        h[_U64(idx[i])] += 1
        i += _U64(1)


@_njit()
def _ways_total(h, bins, k):  # pragma: no cover - compiled
    """The count of bin k over _count's interleaved histograms of h."""
    c = h[k]
    for j in range(1, _COUNT_WAYS):
        c += h[j * bins + k]
    return c


@_njit()
def _pooled_kernel(bs, ts, nparts, widths, seg_rows, bins, q, out):  # pragma: no cover - compiled
    """The numbers of metrics.verdict._tensor_numbers for bs[:nparts] (BF16 errors) and
    ts[:nparts] (target errors; either a tuple of parts or ``(addresses, sizes)``: ``_part``):
    1-D float32, part j holding rows of widths[j] >= 1 values, the
    same sizes in both roles. The verdict's chunks are runs of rows, seg_rows[k] >= 1 rows each,
    in order (then a 0): their even and odd rows are the noise halves. out[_P_STATUS] = 1, and
    nothing else written, where a value is not finite or not >= +0."""
    n = 0
    rows = 0
    widest = 0
    for j in range(nparts):
        size = _part(bs, j).size
        n += size
        rows += size // widths[j]
        widest = max(widest, widths[j])
    pos_b = np.empty(rows, np.uint32)  # per-position L-inf, as float32 bits
    pos_t = np.empty(rows, np.uint32)
    pos_e = np.empty(rows, np.uint32)
    pos_o = np.empty(rows, np.uint32)
    odd = np.empty(rows, np.bool_)
    bmin = _U32(0xFFFFFFFF)
    bmax = _U32(0)
    tmin = _U32(0xFFFFFFFF)
    tmax = _U32(0)
    r = 0
    seg = 0
    in_seg = 0
    ne = 0
    no = 0
    ne_vals = 0
    no_vals = 0
    # the sums of squares fed as the rows are read, a few KiB behind them (still in L1): one read
    # of each part for both, where separate passes read every part twice more
    lens, nruns, sums_b, buf_b, st_b = _pw_state(n)
    sums_t = np.empty(nruns, np.float64)
    buf_t = np.empty(_PW_BLOCK, np.float64)
    st_t = np.zeros(2, np.int64)
    for j in range(nparts):
        bf = _part(bs, j)
        tf = _part(ts, j)
        b = bf.view(np.uint32)
        t = tf.view(np.uint32)
        w = widths[j]
        fed_b = 0
        fed_t = 0
        for i0 in range(0, b.size, w):
            rb_max = _U32(0)
            rb_min = _U32(0xFFFFFFFF)
            rt_max = _U32(0)
            rt_min = _U32(0xFFFFFFFF)
            # unsigned indices: with numba's wraparound of a negative index the loop was
            # vectorised as gathers (vpgatherqd), 40% of the kernel at a 1.5B model's shapes
            for k in range(_U64(i0), _U64(i0 + w)):
                u = b[k]
                rb_max = u if u > rb_max else rb_max
                rb_min = u if u < rb_min else rb_min
                u = t[k]
                rt_max = u if u > rt_max else rt_max
                rt_min = u if u < rt_min else rt_min
            if rb_max >= _NONFINITE or rt_max >= _NONFINITE:  # NaN, inf, or a sign bit set
                out[_P_STATUS] = 1
                return
            bmin = rb_min if rb_min < bmin else bmin
            bmax = rb_max if rb_max > bmax else bmax
            tmin = rt_min if rt_min < tmin else tmin
            tmax = rt_max if rt_max > tmax else tmax
            pos_b[r] = rb_max
            pos_t[r] = rt_max
            if in_seg == seg_rows[seg]:  # the next chunk
                seg += 1
                in_seg = 0
            is_odd = in_seg % 2 == 1
            odd[r] = is_odd
            if is_odd:
                pos_o[no] = rb_max
                no += 1
                no_vals += w
            else:
                pos_e[ne] = rb_max
                ne += 1
                ne_vals += w
            in_seg += 1
            r += 1
            if i0 + w - fed_b >= _BIN_CHUNK:
                fed_b = _pw_feed(bf, fed_b, i0 + w, False, lens, nruns, sums_b, buf_b, st_b, True)
                fed_t = _pw_feed(tf, fed_t, i0 + w, False, lens, nruns, sums_t, buf_t, st_t, True)
        _pw_feed(bf, fed_b, bf.size, True, lens, nruns, sums_b, buf_b, st_b, True)
        _pw_feed(tf, fed_t, tf.size, True, lens, nruns, sums_t, buf_t, st_t, True)
    out[_P_STATUS] = 0
    out[_P_NEVEN] = ne
    out[_P_NODD] = no
    out[_P_MAXB] = _U32(bmax).view(np.float32)
    out[_P_MAXT] = _U32(tmax).view(np.float32)
    out[_P_SSB] = _pw_total(n, sums_b)
    out[_P_SST] = _pw_total(n, sums_t)
    qf = _F32(q)
    out[_P_QB] = _quantile_bits(pos_b, rows, qf)
    out[_P_QT] = _quantile_bits(pos_t, rows, qf)
    if ne:
        out[_P_QE] = _quantile_bits(pos_e, ne, qf)
    if no:
        out[_P_QO] = _quantile_bits(pos_o, no, qf)
    # BC target vs BF16 over their joint range; BC of the BF16 errors' even vs odd rows over
    # theirs. Where the ranges are one, the even and odd counts together are the BF16 counts.
    lo1 = _U32(bmin if bmin < tmin else tmin).view(np.float32)
    hi1 = _U32(bmax if bmax > tmax else tmax).view(np.float32)
    lo2 = _U32(bmin).view(np.float32)
    hi2 = _U32(bmax).view(np.float32)
    step1, scale1 = _bin_params(lo1, hi1, bins)
    step2, scale2 = _bin_params(lo2, hi2, bins)
    one_range = lo1 == lo2 and hi1 == hi2
    # Two ranges: the BF16 errors are binned over both. Their two bins are counted as one cell,
    # their sum (_stair_counts), where both ranges' edges rise: one counter a value, not two
    stair = (not one_range and step1 != _F32(0.0) and step2 != _F32(0.0) and _edges_rise(lo1, step1, bins)
             and _edges_rise(lo2, step2, bins))
    cells = 2 * bins - 1 if stair else bins  # the even / odd histograms' bins (or cells)
    hb = np.zeros(_COUNT_WAYS * bins, np.int64)
    ht = np.zeros(_COUNT_WAYS * bins, np.int64)
    he = np.zeros(_COUNT_WAYS * cells, np.int64)
    ho = np.zeros(_COUNT_WAYS * cells, np.int64)
    # binned and counted a few rows at a time: the bins of ~4,096 values stay in L1 between the
    # binning and the count (a whole part's bins, up to MiBs, went through L2 or L3 three times)
    idx = np.empty(max(_BIN_CHUNK, widest), np.uint32)
    idx1 = np.empty(idx.size if stair else 0, np.uint32)
    r = 0
    for j in range(nparts):
        b = _part(bs, j)
        t = _part(ts, j)
        w = widths[j]
        per = max(1, _BIN_CHUNK // w) * w
        for c0 in range(0, b.size, per):
            c1 = min(c0 + per, b.size)
            m = c1 - c0
            if step2 == _F32(0.0):  # one value: np.histogram's last bin
                idx[:m] = bins - 1
            else:
                _bins_of(b[c0:c1], lo2, step2, scale2, bins, idx)
            if stair:
                _bins_of(b[c0:c1], lo1, step1, scale1, bins, idx1)
                for i in range(m):
                    idx[i] += idx1[i]
            for i0 in range(0, m, w):
                _count(idx, i0, w, ho if odd[r] else he, cells)
                r += 1
            if not one_range and not stair:
                if step1 == _F32(0.0):
                    idx[:m] = bins - 1
                else:
                    _bins_of(b[c0:c1], lo1, step1, scale1, bins, idx)
                _count(idx, 0, m, hb, bins)
            if step1 == _F32(0.0):
                idx[:m] = bins - 1
            else:
                _bins_of(t[c0:c1], lo1, step1, scale1, bins, idx)
            _count(idx, 0, m, ht, bins)
    cb = np.empty(bins, np.int64)
    ct = np.empty(bins, np.int64)
    ce = np.empty(bins, np.int64)
    co = np.empty(bins, np.int64)
    for k in range(bins):
        ct[k] = _ways_total(ht, bins, k)
        if not stair:
            ce[k] = _ways_total(he, bins, k)
            co[k] = _ways_total(ho, bins, k)
            cb[k] = ce[k] + co[k] if one_range else _ways_total(hb, bins, k)
    if stair and not _stair_counts(he, ho, lo1, step1, lo2, step2, bins, cb, ce, co):
        out[_P_STATUS] = 1  # a value in a cell off the staircase: cannot be, numpy decides if it is
        return
    out[_P_BC] = _bc_of_counts(cb, ct, n, n, bins)
    out[_P_NOISE_BC] = _bc_of_counts(ce, co, ne_vals, no_vals, bins) if ne_vals and no_vals else np.nan


@_njit()
def _edges_rise(lo, step, bins):  # pragma: no cover - compiled
    """Whether the edges k * step + lo (k = 0 .. bins - 1, float32 as _bin_of computes them) never
    decrease: then a value's bin is the number of edges k >= 1 at or below it."""
    prev = lo
    for k in range(1, bins):
        e = _F32(k) * step + lo
        if e < prev:
            return False
        prev = e
    return True


@_njit()
def _stair_counts(he, ho, lo1, step1, lo2, step2, bins, cb, ce, co):  # pragma: no cover - compiled
    """The counts of the BF16 errors over the joint range (cb) and over their own (ce even rows,
    co odd) from _pooled_kernel's cell counts he / ho (_COUNT_WAYS interleaved, 2 * bins - 1
    cells): a value's cell is i1 + i2, its bins over the two ranges. Both ranges' edges rise
    (_edges_rise), so each bin counts the edges at or below the value, and as a value grows
    (i1, i2) climbs a staircase on which i1 + i2 only grows: the cell names the pair. The stair
    is walked by merging the two edge lists (equal edges taken together, as a value on them
    counts both). Returns False, nothing else meant, if a cell off the stair holds a count."""
    cells = 2 * bins - 1
    map1 = np.full(cells, -1, np.int64)
    map2 = np.full(cells, -1, np.int64)
    last = bins - 1
    i1 = 0
    i2 = 0
    map1[0] = 0
    map2[0] = 0
    while i1 < last or i2 < last:
        n1 = _F32(i1 + 1) * step1 + lo1 if i1 < last else _F32(np.inf)
        n2 = _F32(i2 + 1) * step2 + lo2 if i2 < last else _F32(np.inf)
        v = n1 if n1 < n2 else n2
        if i1 < last and n1 == v:
            i1 += 1
        if i2 < last and n2 == v:
            i2 += 1
        map1[i1 + i2] = i1
        map2[i1 + i2] = i2
    cb[:] = 0
    ce[:] = 0
    co[:] = 0
    for c in range(cells):
        e = _ways_total(he, cells, c)
        o = _ways_total(ho, cells, c)
        if e == 0 and o == 0:
            continue
        if map1[c] < 0:
            return False
        ce[map2[c]] += e
        co[map2[c]] += o
        cb[map1[c]] += e + o
    return True


def pooled_verdict_numbers(base_chunks, tgt_chunks, bins: int, q: float):
    """The numbers of ``metrics.verdict._tensor_numbers`` in one kernel call, or None where the
    kernel does not apply (then numpy decides): a chunk not float32, shapes that differ between
    the roles, a value not finite or below +0, nothing to judge, chunks of more widths in a row
    than the largest compiled tuple holds. Returns a dict: n (values), ss_b / ss_t (float64 sums
    of squares, np.mean's order), bc, noise_bc (NaN with an empty half), the per-position L-inf
    of the BF16 errors, the target's, the even and odd BF16 positions: q_b, q_t, q_even, q_odd
    (np.quantile(..., q); the halves' None where empty), max_b, max_t."""
    if len(base_chunks) != len(tgt_chunks):
        return None
    bs, ts, widths, seg = [], [], [], []
    for b, t in zip(base_chunks, tgt_chunks):
        if b.dtype != np.float32 or t.dtype != np.float32 or b.shape != t.shape or b.ndim == 0:
            return None
        if b.size == 0:  # no value, no position: the numpy path skips it too
            continue
        bs.append(_flat(b))
        ts.append(_flat(t))
        widths.append(b.size // b.shape[0])
        seg.append(b.shape[0])
    if not bs or sum(seg) > _MAX_POSITIONS:
        return None
    if len(bs) > POOL_PARTS[-1]:
        merged = _merge_runs(bs, ts, widths)
        if merged is None:
            return None
        bs, ts, widths = merged
    k = next(p for p in POOL_PARTS if p >= len(bs))
    pad = (_EMPTY_PART,) * (k - len(bs))
    out = np.full(_P_FIELDS, np.nan)
    _pooled_kernel(tuple(bs) + pad, tuple(ts) + pad, len(bs), np.asarray(widths, np.int64),
                   np.asarray(seg + [0], np.int64), bins, float(q), out)
    if out[_P_STATUS] != 0:
        return None
    return _pooled_dict(out, sum(b.size for b in bs))


def pooled_verdict_numbers_at(pools, bins: int, q: float) -> list:
    """``start_pooled_verdict_numbers_at`` waited for."""
    return start_pooled_verdict_numbers_at(pools, bins, q)()


def start_pooled_verdict_numbers_at(pools, bins: int, q: float):
    """``pooled_verdict_numbers`` of many pools in a few kernel calls, each call many pools, on
    the threads. pools: per pool, its chunks as ``(base_address, target_address, rows, width)``:
    float32 ``[rows, width]`` C-contiguous at those addresses, in memory the caller keeps alive
    until this returns (``metrics.modules.ModuleJudge`` keeps the errors its ``add_many`` made,
    which it knows the addresses of: no per-chunk array crosses into the kernel, ~25 us a pool
    of Python that was a quarter of the verdict's time). Returns a list: the dict of
    ``pooled_verdict_numbers`` per pool, or None where it would return None (no value, too many
    positions, a value not finite or below +0). Started: the kernels run on the threads when this
    returns ``finish()``, which the caller calls exactly once (its Python in between runs beside
    them) and which returns that list."""
    out: list = [None] * len(pools)
    addr_b, addr_t, sizes, widths, seg, part_start, seg_start, which, pool_n = [], [], [], [], [], [0], [0], [], []
    for i, chunks in enumerate(pools):
        n_rows = 0
        k, k_seg = len(sizes), len(seg)  # seg holds a 0 after each pool: its own count
        for ab, at, rows, width in chunks:
            if rows * width == 0:  # no value, no position: the numpy path skips it too
                continue
            addr_b.append(ab)
            addr_t.append(at)
            sizes.append(rows * width)
            widths.append(width)
            seg.append(rows)
            n_rows += rows
        if len(sizes) == k or n_rows > _MAX_POSITIONS:  # nothing to judge, or positions np.quantile loses
            del addr_b[k:], addr_t[k:], sizes[k:], widths[k:], seg[k_seg:]
            continue
        seg.append(0)
        part_start.append(len(sizes))
        seg_start.append(len(seg))
        which.append(i)
        pool_n.append(sum(sizes[k:]))
    if not which:
        return lambda: out
    res = np.full((len(which), _P_FIELDS), np.nan)
    args = (np.array(addr_b, np.uint64), np.array(addr_t, np.uint64), np.array(sizes, np.int64),
            np.array(widths, np.int64), np.array(seg, np.int64), np.array(part_start, np.int64),
            np.array(seg_start, np.int64))
    # runs of pools of about an eighth of a thread's share of the values each
    wait = _start_tasks([functools.partial(_pooled_many_kernel, *args, p0, p1, bins, float(q), res)
                         for p0, p1 in _runs(pool_n, sum(pool_n) // (8 * num_threads()) + 1)])

    def finish():
        wait()
        for r, i, n in zip(res, which, pool_n):
            if r[_P_STATUS] == 0:
                out[i] = _pooled_dict(r, n)
        return out
    return finish


@_njit()
def _pooled_many_kernel(addr_b, addr_t, sizes, widths, seg, part_start, seg_start, p0, p1, bins, q,
                        res):  # pragma: no cover - compiled
    """``_pooled_kernel`` of pools p0 .. p1 - 1: pool p's parts are part_start[p] ..
    part_start[p + 1] - 1 (addresses and sizes), its chunks' rows from seg[seg_start[p]] on
    (each pool's ended by a 0); its numbers into res[p]."""
    for p in range(p0, p1):
        s0 = part_start[p]
        s1 = part_start[p + 1]
        _pooled_kernel((addr_b[s0:s1], sizes[s0:s1]), (addr_t[s0:s1], sizes[s0:s1]), s1 - s0, widths[s0:s1],
                       seg[seg_start[p]:], bins, q, res[p])


def _pooled_dict(out, n):
    """The dict of ``pooled_verdict_numbers`` from the kernel's out[] of a pool of n values."""
    return {"n": n, "ss_b": float(out[_P_SSB]), "ss_t": float(out[_P_SST]),
            "bc": float(out[_P_BC]), "noise_bc": float(out[_P_NOISE_BC]), "q_b": float(out[_P_QB]),
            "q_t": float(out[_P_QT]), "q_even": float(out[_P_QE]) if out[_P_NEVEN] else None,
            "q_odd": float(out[_P_QO]) if out[_P_NODD] else None, "max_b": float(out[_P_MAXB]),
            "max_t": float(out[_P_MAXT])}


def _flat(x):
    """x's values in order as a writable C-contiguous 1-D float32 array (a view where one is)."""
    f = x.reshape(-1)
    if not (f.flags.c_contiguous and f.flags.writeable):
        f = np.array(f)
    return f


def _merge_runs(bs, ts, widths):
    """bs, ts, widths with consecutive parts of one width concatenated, at most POOL_PARTS[-1]
    parts (the chunks' rows stay in seg_rows), or None where the width changes too often."""
    per = -(-len(bs) // POOL_PARTS[-1])
    groups, cur = [], []
    for i, w in enumerate(widths):
        if cur and (len(cur) == per or widths[cur[0]] != w):
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    if len(groups) > POOL_PARTS[-1]:
        return None
    return ([np.concatenate([bs[i] for i in g]) for g in groups], [np.concatenate([ts[i] for i in g]) for g in groups],
            [widths[g[0]] for g in groups])


@_njit()
def _pw_sum(a):  # pragma: no cover - compiled
    """np.add.reduce of a float64 1-D array, as the pooled kernel sums."""
    return _pw_sum_parts((a,), 1, a.size, False)


@_njit()
def _quantile_of(x, q):  # pragma: no cover - compiled
    """np.quantile(x, q) of float32 x >= +0, as the pooled kernel computes it."""
    return _quantile_bits(x.view(np.uint32).copy(), x.size, _F32(q))


_PAIRWISE_OK = None
_QUANTILE_OK: dict = {}


def pairwise_order_holds() -> bool:
    """Whether the installed numpy sums float64 values (``np.add.reduce``, ``np.mean``, and a
    ``[1, n].sum(axis=1)`` as ``metrics.bc`` sums its sqrt(p q) terms) in the pairwise order the
    pooled kernel replays: checked once, on every length up to 300 and some longer ones (across
    the 128-value runs and their halving), values spread over many binades so that any other
    order shows, and through the kernel on chunks split at random rows."""
    global _PAIRWISE_OK
    if _PAIRWISE_OK is None:
        rng = np.random.default_rng(20261203)
        ok = True
        for n in [*range(1, 301), 1000, 1024, 4099, 8191, 8192, 8193, 65543, 300007]:
            x = (rng.random(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
            sq = x.astype(np.float64) ** 2
            s = _pw_sum(sq)
            ok &= bool(s == np.add.reduce(sq) and s == sq.reshape(1, n).sum(axis=1)[0] and s / n == np.mean(sq))
            if n >= 3 and (n % 7 == 0 or n > 300):  # the kernel's own sums, chunks of a few rows of 3
                rows = x[: n - n % 3].reshape(-1, 3)
                chunks = np.split(rows, np.sort(rng.integers(0, rows.shape[0] + 1, 5)))
                got = pooled_verdict_numbers(chunks, chunks, 10, 0.75)
                flat = rows.astype(np.float64).ravel()
                ok &= got is not None and bool(got["ss_b"] / flat.size == np.mean(flat * flat))
        _PAIRWISE_OK = ok
    return _PAIRWISE_OK


def quantile_rule_holds(q) -> bool:
    """Whether ``np.quantile(x, q)`` of the installed numpy is, bit for bit, what the pooled
    kernel computes for float32 samples x >= +0 (checked once per q: lengths 1..40 and some
    longer, ties, zeros, values over many binades)."""
    key = float(q)
    if key not in _QUANTILE_OK:
        rng = np.random.default_rng(20261204)
        ok = True
        for n in [*range(1, 41), 64, 127, 128, 129, 255, 256, 1000]:
            for kind in ("spread", "ties", "zeros"):
                x = (rng.random(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
                if kind == "ties":
                    x = np.round(x * 4 % 3).astype(np.float32)
                elif kind == "zeros":
                    x[rng.random(n) < 0.5] = 0
                want = np.float32(np.quantile(x, q))
                ok &= bool(np.float32(_quantile_of(x, key)).view(np.uint32) == want.view(np.uint32))
        _QUANTILE_OK[key] = ok
    return _QUANTILE_OK[key]
