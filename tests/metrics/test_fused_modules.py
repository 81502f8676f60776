"""The fused module-compare kernels of metrics._fused against the numpy path they replace.

``compare_module_tensors_many`` takes ``module_row_metrics`` (one pass per row: errors, maxima,
the seven einsum row sums in einsum's own order, BC) when numba imports and the installed
numpy's einsum sums in the order the kernel replays; the verdict's pooled BCs take
``pooled_bc``. The oracle is the numpy path of the same functions (``_fused_rows`` forced to
None, numba reported absent): every per-token metric, error array and verdict identical to the
last bit, on random tensors with NaN / inf / -inf in any role, float32 / float16 / bfloat16
captures, hypothesis-drawn shapes."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrics.bc as bc_mod
import metrics.modules as mod
from metrics.bc import bhattacharyya_coefficient
from metrics.modules import ModuleJudge, compare_module_tensors_many

numba = pytest.importorskip("numba")
from metrics import _fused  # noqa: E402 - after the importorskip

FIELDS = ("positions", "base_linf", "tgt_linf", "linf_ratio", "base_l2", "tgt_l2", "l2_ratio", "base_cos",
          "tgt_cos", "bc", "base_err", "tgt_err")
DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)


def _same_bits(x, y, what):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (what, x.dtype, y.dtype, x.shape, y.shape)
    assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), what


@st.composite
def _tensor(draw, module):
    width = draw(st.one_of(st.integers(4, 40), st.sampled_from([64, 100, 127, 128, 1000, 8192, 8193, 8200, 20001])))
    rows = draw(st.integers(1, 12 if width < 1000 else 2))
    trailing = (width,) if width % 2 or not draw(st.booleans()) else (2, width // 2)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    b = (scale * rng.standard_normal((rows, width))).astype(np.float32)
    e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float32)
    a = (b * (1 + draw(st.sampled_from([4e-3, 5e-2])) * rng.standard_normal(b.shape))).astype(np.float32)
    for _ in range(draw(st.integers(0, 3))):  # non-finite values anywhere, in any role
        arr = draw(st.sampled_from([b, e, a]))
        arr[rng.integers(rows), rng.integers(width)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    row = draw(st.sampled_from(["", "zero", "exact", "flat"]))
    r = rng.integers(rows)
    if row == "zero":  # a zero baseline row: the EPS guards
        b[r] = 0
    elif row == "exact":  # both errors zero: one BC bin (lo == hi)
        e[r] = a[r] = b[r]
    elif row == "flat":  # every error 1 (lo == hi again)
        b[r] = np.round(b[r])
        e[r], a[r] = b[r] + 1, b[r] - 1
    dt = draw(st.sampled_from(DTYPES))
    b = b.reshape(rows, *trailing)
    e, a = (x.reshape(rows, *trailing).astype(dt) for x in (e, a))
    if draw(st.booleans()):
        b = b.astype(dt)
    pos = None if draw(st.booleans()) else np.arange(rows) + draw(st.integers(0, 50))
    # any memory layout: Fortran order, or a strided view of a larger array (the same values)
    layout = draw(st.sampled_from(["C", "C", "F", "strided"]))
    if layout == "F":
        b, e, a = np.asfortranarray(b), np.asfortranarray(e), np.asfortranarray(a)
    elif layout == "strided":
        b, e, a = (np.repeat(x, 2, axis=-1)[..., ::2] for x in (b, e, a))
    return b, e, a, module, draw(st.sampled_from(["prefill", "decode"])), pos


_ITEMS = st.lists(st.integers(0, 20), min_size=1, max_size=8).flatmap(
    lambda ids: st.tuples(*[_tensor(f"model.layers.{i % 3}.m{i}") for i in ids]))


def _numpy_path(monkeypatch):
    monkeypatch.setattr(mod, "_fused_rows", lambda *a: None)
    monkeypatch.setattr(bc_mod, "_NUMBA_OK", False)


def test_the_einsum_order_is_replayed_or_the_kernel_is_not_used():
    """On this numpy the kernel's row sums are einsum's bit for bit (then the fused path runs);
    where they are not, ``_fused_rows`` declines and the numpy path runs."""
    rng = np.random.default_rng(7)
    for n in (1, 5, 8, 9, 17, 128, 1000, 8192, 8193, 8200, 2 * 8192, 3 * 8192 + 5, 128256):
        x, y, z = ((rng.standard_normal((4, n)) * np.exp2(rng.integers(-30, 30, (4, n)))).astype(np.float32)
                   for _ in range(3))
        be, te, sums, maxes, _, bad = _fused.module_row_metrics(x, y, z, 100)
        _same_bits(be, np.abs(y - x), "base_err")
        _same_bits(te, np.abs(z - x), "tgt_err")
        assert not bad.any()
        want = np.stack([np.einsum("ij,ij->i", p, q, dtype=np.float64) for p, q in
                         ((x, x), (be, be), (te, te), (x, y), (y, y), (x, z), (z, z))], axis=1)
        if _fused.einsum_order_holds():
            _same_bits(sums, want, f"sums width {n}")
            _same_bits(maxes, np.stack([np.abs(x).max(1), be.max(1), te.max(1)], axis=1), "maxima")
            assert mod._fused_rows([(x, y, z)], 100) is not None
        else:
            assert mod._fused_rows([(x, y, z)], 100) is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(4, 13), width=st.sampled_from([8, 16, 24, 40, 64, 128, 1000, 2048, 8192, 8200, 16392]),
       seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([0, 30, 60]), nans=st.integers(0, 2))
def test_row_sums_of_four_rows_at_once_are_each_rows_own(rows, width, seed, spread, nans):
    """``_row_sums_simd`` (blocks of four rows of a width that is a multiple of 8) gives each row
    the sums the scalar ``_row_sums`` gives it alone (a one-row call takes the scalar loop), bit
    for bit, whatever the row's place in the block, with NaN rows beside it; and einsum's sums
    where this numpy sums in that order (rows wider than einsum's buffer, multiples of 8 too,
    summed in its pieces, never by the four-row block). Values over up to 2**60 binades: any other order of
    adds shows."""
    rng = np.random.default_rng(seed)
    x, y, z = ((rng.standard_normal((rows, width)) * np.exp2(rng.integers(-spread, spread + 1, (rows, width))))
               .astype(np.float32) for _ in range(3))
    for _ in range(nans):
        y[rng.integers(rows), rng.integers(width)] = np.nan
    be, te, sums, maxes, bc, bad = _fused.module_row_metrics(x, y, z, 100)
    for r in np.flatnonzero(bad == 0):
        one = _fused.module_row_metrics(x[r:r + 1].copy(), y[r:r + 1].copy(), z[r:r + 1].copy(), 100)
        _same_bits(sums[r], one[2][0], f"row {r} of {rows} x {width}: sums")
        _same_bits(bc[r], one[4][0], f"row {r}: bc")
    if _fused.einsum_order_holds():
        want = np.stack([np.einsum("ij,ij->i", p, q, dtype=np.float64) for p, q in
                         ((x, x), (be, be), (te, te), (x, y), (y, y), (x, z), (z, z))], axis=1)
        _same_bits(sums[bad == 0], want[bad == 0], "sums against einsum")


def test_the_order_check_rejects_sums_one_ulp_off(monkeypatch):
    """einsum_order_holds compares bits: a kernel whose sums differ by one ulp anywhere is refused."""
    real = _fused.module_row_metrics

    def off(*a, **k):
        be, te, sums, maxes, bc, bad = real(*a, **k)
        sums[-1, 3] = np.nextafter(sums[-1, 3], np.inf)
        return be, te, sums, maxes, bc, bad

    monkeypatch.setattr(_fused, "module_row_metrics", off)
    monkeypatch.setattr(_fused, "_EINSUM_OK", None)
    assert _fused.einsum_order_holds() is False
    monkeypatch.setattr(_fused, "module_row_metrics", real)
    monkeypatch.setattr(_fused, "_EINSUM_OK", None)
    assert _fused.einsum_order_holds() is bool(_fused.einsum_order_holds())


def test_rows_wider_than_one_einsum_buffer_are_summed_in_its_pieces():
    """einsum sums a row wider than its 8192-element buffer piece by piece (whatever
    np.setbufsize says) and adds the pieces' sums to the output in turn; the kernel replays that
    (an LM head's 128,256-wide rows took the numpy path, ~5x the time a byte of the fused one):
    its sums of a wide row are the fold of its own sums of the 8192-wide pieces, which pieces of
    another size or one piece over the whole row are not, and einsum's where this numpy sums in
    the order the kernel replays (else the numpy path runs)."""
    rng = np.random.default_rng(11)
    n = 3 * 8192 + 5
    x, y = ((rng.standard_normal((3, n)) * np.exp2(rng.integers(-20, 20, (3, n)))).astype(np.float32)
            for _ in range(2))
    sums = _fused.module_row_metrics(x, y, y, 100)[2][:, 3]

    def pieces(size):
        out = np.zeros(3)
        for p0 in range(0, n, size):
            out = out + _fused.module_row_metrics(x[:, p0:p0 + size].copy(), y[:, p0:p0 + size].copy(),
                                                  y[:, p0:p0 + size].copy(), 100)[2][:, 3]
        return out

    def one_piece():  # the order of a row up to 8192 wide, over the whole row
        out, part, zeros = np.empty(3), np.empty(7), np.zeros(n, np.float32)
        for r in range(3):
            _fused._row_sums(x[r], y[r], y[r], zeros, zeros, np.zeros((7, 2)), part)
            out[r] = part[3]
        return out

    assert sums.tobytes() == pieces(8192).tobytes()
    assert not np.array_equal(pieces(4096), sums) and not np.array_equal(one_piece(), sums)
    want = np.einsum("ij,ij->i", x, y, dtype=np.float64)
    old = np.setbufsize(4096)
    try:
        assert np.einsum("ij,ij->i", x, y, dtype=np.float64).tobytes() == want.tobytes()
    finally:
        np.setbufsize(old)
    if _fused.einsum_order_holds():
        assert sums.tobytes() == want.tobytes()
        assert mod._fused_rows([(x, y, y)], 100) is not None
    else:
        assert mod._fused_rows([(x, y, y)], 100) is None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=_ITEMS)
def test_fused_rows_equal_the_numpy_path_bit_for_bit(monkeypatch, items):
    taken = []
    real = mod._fused_rows
    with monkeypatch.context() as m:
        m.setattr(mod, "_fused_rows", lambda *a: taken.append(real(*a)) or taken[-1])
        got = compare_module_tensors_many(items)
    # the kernel ran wherever it applies (numba here; einsum's order replayed on this numpy)
    assert all(t is not None for t in taken) or not _fused.einsum_order_holds()
    with monkeypatch.context() as m:
        _numpy_path(m)
        want = compare_module_tensors_many(items)
    for g, w in zip(got, want):
        for f in FIELDS:
            _same_bits(getattr(g, f), getattr(w, f), f"{g.module} {g.phase} {f} {g.base_err.shape}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(_ITEMS, min_size=1, max_size=3))
def test_fused_verdict_equals_the_numpy_verdict(monkeypatch, prompts):
    def judge():
        j = ModuleJudge()
        for p, items in enumerate(prompts):
            j.add_many(str(p), [(m, ph, b, e, a, pos) for b, e, a, m, ph, pos in items], prompt_len=5)
        return j.verdict()

    got = judge()
    with monkeypatch.context() as m:
        _numpy_path(m)
        want = judge()
    assert repr(got) == repr(want)


def _pooled_cases():
    rng = np.random.default_rng(11)
    x = np.abs(rng.standard_normal(5000)).astype(np.float32)
    edges = np.linspace(np.float32(0), np.float32(3), 101, dtype=np.float32)
    on_edges = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(9))])
    sub = np.array([0, 1e-45, 3e-45, 4e-45], np.float32)  # a subnormal-wide range: bins / width overflows
    return [
        (x, np.abs(rng.standard_normal(3001)).astype(np.float32) * 2),
        (on_edges, x * 3),
        (np.full(10, 0.5, np.float32), np.full(7, 0.5, np.float32)),  # lo == hi: all in the last bin
        (np.zeros(4, np.float32), np.ones(1, np.float32)),
        (sub, sub[::-1].copy()),
        (np.array([1.0, 1.0000001], np.float32), np.array([1.0000001], np.float32)),  # edges collapse
    ]


@pytest.mark.parametrize("case", range(6))
def test_pooled_bc_equals_bhattacharyya_coefficient(monkeypatch, case):
    x, y = _pooled_cases()[case]
    got = _fused.pooled_bc(x, y, 100)
    monkeypatch.setattr(bc_mod, "_NUMBA_OK", False)
    want = bhattacharyya_coefficient(x, y, bins=100)
    assert np.float64(got).tobytes() == np.float64(want).tobytes(), (got, want)


@pytest.mark.parametrize("bins", [100, 128, 129, 300, 7])
def test_row_bcs_summed_in_the_kernel_or_by_numpy_equal_the_numpy_path(monkeypatch, bins):
    """Up to 128 bins the kernel sums each row's sqrt(p q) terms itself (numpy's pairwise order,
    gated by np_sum_order_holds); above, numpy sums them: the BC bits are the same either way."""
    rng = np.random.default_rng(bins)
    b = rng.standard_normal((40, 96)).astype(np.float32)
    e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float32)
    a = (b * (1 + 2e-2 * rng.standard_normal(b.shape))).astype(np.float32)
    got = _fused.module_row_metrics(b, e, a, bins)[4]
    monkeypatch.setattr(bc_mod, "_NUMBA_OK", False)
    want = bc_mod.bhattacharyya_batched(np.abs(e - b), np.abs(a - b), bins=bins)
    _same_bits(got, want, f"row BCs, {bins} bins")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 13), width=st.sampled_from([4, 8, 37, 64, 128, 2048, 8192, 8200, 16392]),
       seed=st.integers(0, 2**32 - 1), base_bf16=st.booleans(), bad=st.sampled_from([None, np.nan, np.inf, -np.inf]),
       offset=st.one_of(st.none(), st.integers(0, 50)))
def test_bf16_captures_reach_the_kernel_as_their_bits_with_the_widened_results(monkeypatch, rows, width, seed,
                                                                                base_bf16, bad, offset):
    """A bfloat16 capture (the expected and actual roles of a store comparison; the baseline too
    when it is one) goes to the kernel as its uint16 bits, never as a widened float32 copy, and
    the kernel widens each value as it reads it: every output (errors, the seven row sums through
    the four-row vector blocks and the scalar rows, maxima, BCs, flags) the same bits as the
    kernel's on float32 copies, and every per-token metric of compare_module_tensors_many the
    numpy path's, with the positions the store comparator passes or none."""
    rng = np.random.default_rng(seed)
    pos = None if offset is None else np.arange(rows) + offset
    b = (rng.standard_normal((rows, width)) * np.exp2(rng.integers(-20, 21, (rows, width)))).astype(np.float32)
    e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(ml_dtypes.bfloat16)
    a = (b * (1 + 5e-2 * rng.standard_normal(b.shape))).astype(ml_dtypes.bfloat16)
    if bad is not None:
        a[rng.integers(rows), rng.integers(width)] = bad
    if base_bf16:
        b = b.astype(ml_dtypes.bfloat16)
    wide = [x.astype(np.float32) for x in (b, e, a)]
    got, want = _fused.module_row_metrics(b, e, a, 100), _fused.module_row_metrics(*wide, 100)
    where = f"{rows} x {width}, baseline {b.dtype}"
    _same_bits(got[5], want[5], f"{where}: flags")
    ok, finite = want[5] != 1, want[5] == 0  # a flagged row's sums, maxima (NaN error) or BC (inf) are not written
    for k, rows_ in ((0, ...), (1, ...), (2, ok), (3, ok), (4, finite)):
        _same_bits(got[k][rows_], want[k][rows_], f"{where}: output {k}")
    order_holds = _fused.einsum_order_holds() and _fused.np_sum_order_holds()  # checked (on float32) before the spy
    seen = []
    real = _fused._module_rows_stealing

    def spy(*args):  # the roles' dtypes: how the kernel reads the addresses in its table
        seen.append(tuple(x.dtype for x in args[:3]))
        return real(*args)

    monkeypatch.setattr(_fused, "_module_rows_stealing", spy)
    got = compare_module_tensors_many([(b, e, a, "m", "decode", pos)])[0]
    monkeypatch.undo()
    if order_holds:
        assert seen and all(s == (b.view(np.uint16).dtype if base_bf16 else np.float32, np.uint16, np.uint16)
                            for s in seen), seen
    with monkeypatch.context() as m:
        _numpy_path(m)
        want = compare_module_tensors_many([(b, e, a, "m", "decode", pos)])[0]
    for f in FIELDS:
        _same_bits(getattr(got, f), getattr(want, f), f"{rows} x {width} {f}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([70, 150]))
def test_many_small_tensors_go_as_a_table_of_tasks_with_each_tensors_own_results(monkeypatch, seed, n):
    """A prompt's many small tensors (a tiny model's: 142, a few rows each) reach the kernel as
    rows of a table (addresses, shapes, offsets), runs of them a task, beside a tensor large
    enough to be split across the threads: widths 4 to 256 in one stack, bfloat16 and float32
    mixed in one role (two dtype groups: a table each), read-only captures, rows with NaN and inf,
    zero-row tensors. Each group is one kernel call per thread at most (the threads take its
    tasks from a shared counter), every row of every part is in exactly one task, and every field
    of every result is the single form's (``compare_module_tensors``, numpy) bit for bit, so no
    part is written to another's rows or values."""
    rng = np.random.default_rng(seed)
    items = []
    for k in range(n):
        width = int(rng.choice([4, 8, 64, 100, 128, 256]))
        rows = 2100 if k == n // 2 else int(rng.integers(0, 40))  # 2100 x 128: split, not a run's part
        if k == n // 2:
            width = 128
        b = rng.standard_normal((rows, width)).astype(np.float32)
        e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float32)
        a = (b * (1 + 5e-2 * rng.standard_normal(b.shape))).astype(np.float32)
        if rows and rng.random() < 0.1:
            rng.choice([b, e, a])[rng.integers(rows), rng.integers(width)] = rng.choice([np.nan, np.inf])
        if rng.random() < 0.5:
            e, a = e.astype(ml_dtypes.bfloat16), a.astype(ml_dtypes.bfloat16)
        for x in (b, e, a):
            x.flags.writeable = bool(rng.random() < 0.8)
        pos = None if rng.random() < 0.5 else np.arange(rows) + int(rng.integers(0, 9))
        items.append((b, e, a, f"model.layers.{k}.mlp", "decode", pos))
    order_holds = _fused.einsum_order_holds() and _fused.np_sum_order_holds()  # their checks run before the spy
    calls = []
    real = _fused._module_rows_stealing

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_fused, "_module_rows_stealing", spy)
    got = compare_module_tensors_many(items)
    monkeypatch.undo()
    if order_holds:
        groups = {id(c[4]): c for c in calls}  # the parts' table, and a task list per dtype group
        per_group = [sum(1 for c in calls if c[4] is g[4]) for g in groups.values()]
        assert len(groups) == len({(b.dtype, e.dtype) for b, e, *_ in items if b.shape[0]}), len(groups)
        assert all(1 <= k <= _fused.num_threads() for k in per_group), per_group
        covered = {}
        n_tasks = 0
        for g in groups.values():
            table, entries, bounds = g[3], g[4], g[5]
            n_tasks += len(bounds) - 1
            assert bounds[0] == 0 and bounds[-1] == len(entries) and (np.diff(bounds) > 0).all()
            for k, r0, r1 in entries.tolist():
                covered.setdefault(k, []).extend(range(r0, r1))
        batched = [k for k, (b, *_) in enumerate(items) if b.shape[0] and b.shape[1] >= 4]
        assert sorted(covered) == list(range(len(batched)))  # the table's rows: the batched tensors in order
        assert all(sorted(r) == list(range(items[batched[k]][0].shape[0])) for k, r in covered.items())  # once each
        assert n_tasks < len(batched) / 4 + _fused.num_threads()  # runs of parts, not a task a part
    with monkeypatch.context() as m:
        _numpy_path(m)
        want = [mod.compare_module_tensors(b, e, a, mm, ph, pos) for b, e, a, mm, ph, pos in items]
    for g, w in zip(got, want):
        for f in FIELDS:
            _same_bits(getattr(g, f), getattr(w, f), f"{g.module} {f} {g.base_err.shape}")


def _prompt_items(rng, n_modules, bad=False):
    items = []
    for k in range(n_modules):
        rows, width = int(rng.integers(1, 9)), int(rng.choice([8, 64, 128]))
        b = rng.standard_normal((rows, width)).astype(np.float32)
        e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float32)
        a = (b * (1 + 6e-3 * rng.standard_normal(b.shape))).astype(np.float32)
        if bad and k == 3:  # a NaN target error: that pool's kernel declines, numpy judges it
            a[0, 0] = np.nan
        items.append((f"model.layers.{k}.mlp", "decode" if k % 2 else "prefill", b, e, a, None))
    return items


@pytest.mark.parametrize("bad", [False, True])
def test_pools_read_where_add_many_wrote_them_equal_every_other_path(monkeypatch, bad):
    """The verdict reads the errors add_many's kernel wrote where they lie (addresses, many
    pools a kernel call): the same verdict, repr for repr, as the per-pool path (the judge
    pickled: no addresses cross processes), as per-prompt judges merged (addresses of several
    judges' errors), as a judge where one prompt came through ``add`` (its pools per pool), and
    as the numpy path. The address path is taken for every pool add_many alone filled."""
    import pickle

    rng = np.random.default_rng(5)
    prompts = [_prompt_items(rng, 90, bad=bad and p == 1) for p in range(4)]
    # where this numpy sums or interpolates otherwise than the pooled kernel, no pool is read by
    # address (nor by the per-pool kernel): numpy judges, and every path still agrees
    by_address = [90] if _fused.pairwise_order_holds() and _fused.quantile_rule_holds(0.75) else []
    seen = []
    real = _fused.start_pooled_verdict_numbers_at

    def spy(pools, *a):
        seen.append(len(pools))
        return real(pools, *a)

    def judge(one_by_add=False):
        j = ModuleJudge()
        for p, items in enumerate(prompts):
            if one_by_add and p == 2:
                for m, ph, b, e, a, pos in items:
                    j.add(str(p), m, ph, b, e, a, pos, prompt_len=5)
            else:
                j.add_many(str(p), items, prompt_len=5)
        return j

    monkeypatch.setattr(_fused, "start_pooled_verdict_numbers_at", spy)
    got = judge().verdict()
    assert seen == by_address, seen  # every module x phase pool through the address path
    seen.clear()
    merged = ModuleJudge()
    for p, items in enumerate(prompts):
        one = ModuleJudge()
        one.add_many(str(p), items, prompt_len=5)
        merged.merge(one)
    assert repr(merged.verdict()) == repr(got) and seen == by_address
    seen.clear()
    assert repr(pickle.loads(pickle.dumps(judge())).verdict()) == repr(got) and seen in ([], [0])
    seen.clear()
    assert repr(judge(one_by_add=True).verdict()) == repr(got) and seen in ([], [0])
    monkeypatch.undo()
    with monkeypatch.context() as m:
        _numpy_path(m)
        assert repr(judge().verdict()) == repr(got)
    three = next(v for v in got.modules if v.module == "model.layers.3.mlp")
    assert three.passed is (False if bad else three.passed)
    assert ("non-finite target values" in (three.problem or "")) is bad


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_pools=st.integers(1, 12), n_chunks=st.integers(1, 80))
def test_pooled_numbers_at_addresses_equal_the_numbers_of_the_arrays(seed, n_pools, n_chunks):
    """``pooled_verdict_numbers_at`` (chunks by address, many pools a call, split across
    threads) gives each pool exactly ``pooled_verdict_numbers`` of the same chunks as arrays:
    pools of 1 to 80 chunks (beyond any compiled tuple), empty chunks, a pool with no value (None),
    a pool holding a NaN (None)."""
    rng = np.random.default_rng(seed)
    pools, arrays = [], []
    for p in range(n_pools):
        chunks = []
        for _ in range(int(rng.integers(1, n_chunks + 1))):
            rows, width = int(rng.integers(0, 6)), int(rng.choice([1, 3, 8, 64]))
            b = np.abs(rng.standard_normal((rows, width)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
            t = np.abs(rng.standard_normal((rows, width)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
            chunks.append((b, t))
        if p == 1 and chunks[0][0].size:
            chunks[0][1][0, 0] = np.nan
        if p == 2:
            chunks = [(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32))]
        arrays.append(chunks)
        pools.append([(b.ctypes.data, t.ctypes.data, *b.shape) for b, t in chunks])
    got = _fused.pooled_verdict_numbers_at(pools, 100, 0.75)
    for p, chunks in enumerate(arrays):
        want = _fused.pooled_verdict_numbers([b for b, _ in chunks], [t for _, t in chunks], 100, 0.75)
        assert (got[p] is None) == (want is None), p
        if want is not None:
            assert got[p].keys() == want.keys()
            for k in want:
                assert np.array_equal(np.float64(got[p][k] if got[p][k] is not None else np.nan),
                                      np.float64(want[k] if want[k] is not None else np.nan), equal_nan=True), (p, k)
                assert repr(got[p][k]) == repr(want[k]), (p, k)


def test_parts_of_no_width_get_their_rows_written():
    """A part of rows but no width (review helper-74: its rows were skipped, their outputs left
    as uninitialised memory): every output of its rows is what the kernel writes for an empty
    row, zeros, beside a part with values, and the one-width form keeps its [rows, 0] shapes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    z = np.zeros((3, 0), np.float32)
    be, te, sums, maxes, bc, bad = _fused.module_row_metrics_ragged([(x, x * 2, x * 3), (z, z, z)], 100)
    assert be.shape == te.shape == (32,) and sums.shape == (5, 7) and maxes.shape == (5, 3)
    assert not sums[2:].any() and not maxes[2:].any() and not bc[2:].any() and not bad.any()
    alone = _fused.module_row_metrics(x, x * 2, x * 3, 100)
    _same_bits(sums[:2], alone[2], "sums of the part with values")
    got = _fused.module_row_metrics(z, z, z, 100)
    assert got[0].shape == got[1].shape == (3, 0) and not got[2].any() and not got[4].any()


def test_a_copied_judge_shares_no_list_with_the_original():
    """``copy.copy`` of a judge goes through ``__getstate__`` (which drops the error addresses):
    its lists are its own, so what either adds later is not half-seen by the other (review
    helper-74), and both verdicts are the original's."""
    import copy

    rng = np.random.default_rng(4)
    items = _prompt_items(rng, 6)
    j = ModuleJudge()
    j.add_many("0", items, prompt_len=5)
    want = repr(j.verdict())
    c = copy.copy(j)
    c.add_many("1", _prompt_items(rng, 6), prompt_len=5)
    assert repr(j.verdict()) == want
    assert all(len(s["metrics"]) == len(s["where"]) == 1 for s in j._acc.values())
    assert all(len(s["metrics"]) == len(s["where"]) == 2 for s in c._acc.values())


@pytest.mark.parametrize("path", ["fused", "numpy"])
@pytest.mark.parametrize("width", [4, 37, 128])
def test_a_tensors_metrics_do_not_depend_on_its_memory_layout(monkeypatch, path, width):
    """The same values in C order, Fortran order and as a strided view give the same metrics to
    the bit, by either path, one at a time or many (numpy's einsum and reductions add in memory
    order: a Fortran-ordered tensor's L2 and cosine were one ulp off, a review's finding)."""
    rng = np.random.default_rng(width)
    b = rng.standard_normal((6, width)).astype(np.float32)
    e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float32)
    a = (b * (1 + 5e-2 * rng.standard_normal(b.shape))).astype(np.float32)
    layouts = {"C": (b, e, a), "F": tuple(np.asfortranarray(x) for x in (b, e, a)),
               "strided": tuple(np.repeat(x, 2, axis=1)[:, ::2] for x in (b, e, a))}
    assert not layouts["F"][0].flags.c_contiguous and not layouts["strided"][0].flags.c_contiguous
    if path == "numpy":
        _numpy_path(monkeypatch)
    got = {k: (compare_module_tensors_many([(*v, "m", "decode", None)])[0],
               mod.compare_module_tensors(*v, "m", "decode")) for k, v in layouts.items()}
    for k, (many, one) in got.items():
        for f in FIELDS:
            _same_bits(getattr(many, f), getattr(got["C"][0], f), f"{path} {k} many {f}")
            _same_bits(getattr(one, f), getattr(got["C"][0], f), f"{path} {k} one {f}")


def test_data_addresses_are_ctypes_data_and_a_wrong_field_is_refused(monkeypatch):
    """``data_addresses`` (the row kernel's table of parts) equals ``x.ctypes.data`` for views
    at offsets, Fortran order, bfloat16, read-only and empty arrays; where the array object's
    field is not where it is read (planted: another offset), the once-per-process check refuses
    it and ``ctypes.data`` is used."""
    base = np.arange(600, dtype=np.float32).reshape(20, 30)
    ro = base[3:, 5:].copy()
    ro.flags.writeable = False
    arrays = [base, base[7:], base[2:, 11:], np.asfortranarray(base), base.T, ro, np.empty(0, np.float32),
              base.astype(ml_dtypes.bfloat16), base.astype(ml_dtypes.bfloat16).view(np.uint16)[1:]]
    want = [x.ctypes.data for x in arrays]
    assert _fused.data_addresses(arrays).tolist() == want
    monkeypatch.setattr(_fused, "_DATA_FIELD", None)
    monkeypatch.setattr(_fused, "_DATA_OFFSET", _fused._DATA_OFFSET + 8)
    assert _fused.data_addresses(arrays).tolist() == want and _fused._DATA_FIELD is False


def test_a_running_jobs_inputs_stay_alive_with_its_tasks():
    """The kernel reads its parts by address; the copies ``_kernel_view`` makes (a Fortran-ordered
    or float16 input) are held by the tasks' calls alone, so they stay alive until the kernels
    are done, whatever happens to the job (review helper-76: a job dropped while waited for let
    its tasks read what other allocations wrote there)."""
    import gc

    rng = np.random.default_rng(2)
    b = np.asfortranarray(rng.standard_normal((400, 700)).astype(np.float32))  # copied to C order for the kernel
    e = (b * (1 + 4e-3 * rng.standard_normal(b.shape))).astype(np.float16)  # widened: another copy
    a = np.asfortranarray((b * (1 + 5e-2 * rng.standard_normal(b.shape))).astype(np.float32))
    want = _fused.module_row_metrics(np.ascontiguousarray(b), e.astype(np.float32), np.ascontiguousarray(a), 100)
    job = _fused.RowMetricsJob([(b, e, a)], 100)
    gc.collect()
    filler = [np.full((400, 700), 7.0, np.float32) for _ in range(8)]  # what freed memory would hold
    got = job.finish()
    del filler
    for k in range(6):
        _same_bits(got[k].reshape(want[k].shape), want[k], f"output {k}")
