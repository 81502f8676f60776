"""aggregate_bc: cross-prompt KV BC over a SQL selection of prompts, read from the raw_errors
table, identical to recomputing it from the KV arrays of exactly those prompts (metrics.kv on the
arrays read back from the store); the raw_errors comparator's rows are the errors the KV
comparator bins; bad selections are one line."""
import numpy as np
import pytest

from capturestore import Store
from capturestore.aggregate import aggregate_bc, where_prompts
from capturestore.analysis import compare_runs
from capturestore.cli import main

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
H, D = 2, 8


def _bf16(x):
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Six prompts of different prompt and continuation lengths; layer 2 has a sliding window
    (NaN before the last 6 positions in every run); the actual run has a bug in layer 1's V."""
    rng = np.random.default_rng(3)
    store = Store.open(tmp_path_factory.mktemp("agg") / "s")
    shapes = [(4 + 3 * i, 5 + (i % 3)) for i in range(6)]  # (prompt tokens, continuation tokens)
    prompts = [(rng.integers(0, 50, p).tolist(), rng.integers(0, 50, c).tolist()) for p, c in shapes]
    kv = []
    for p, c in prompts:
        k, v = (rng.standard_normal((3, H, len(p) + len(c), D)).astype(np.float32) for _ in range(2))
        k[2, :, : -6] = v[2, :, : -6] = np.nan
        kv.append((k, v))

    def run(dtype, f):
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h", dtype=dtype) as w:
            for i, (p, c) in enumerate(prompts):
                pid = w.add_prompt(p, continuation=c)
                w.write_kv(pid, *f(i), layer_names=LAYERS)
                w.write_logits(pid, np.zeros((len(c), 50), np.float32))
        return w.run_id

    base = run("float32", lambda i: kv[i])
    exp = run("bfloat16", lambda i: (_bf16(kv[i][0]), _bf16(kv[i][1])))

    def buggy(i):
        k, v = kv[i][0].copy(), kv[i][1].copy()
        v[1] *= 1.05
        return _bf16(k), _bf16(v)

    act = run("bfloat16", buggy)
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=["raw_errors"])
    return store, res, {"baseline": base, "expected": exp, "actual": act}


def oracle(store, runs, pids):
    """The cross-prompt BC recomputed from the KV arrays of ``pids`` (metrics.kv, no raw_errors table)."""
    from capturestore.analysis import prompt_split
    from metrics.kv import aggregate_kv_bc_arrays, compare_kv_caches

    raws, lens = [], []
    for pid in pids:
        kvs = {}
        for role, rid in runs.items():
            k, v = store.read_kv(rid, pid)
            kvs[role] = {n: (k[i][None], v[i][None]) for i, n in enumerate(LAYERS)}
        _, raw = compare_kv_caches(kvs["expected"], kvs["actual"], baseline_kv=kvs["baseline"], return_raw_errors=True)
        raws.append(raw)
        lens.append(prompt_split(store, runs["expected"], pid)[1])
    return aggregate_kv_bc_arrays(raws, lens)


@pytest.mark.parametrize("where", ["n_prompt_tokens > 8", "prompt_idx IN (0, 3, 5)", "prompt_idx = 4", "true"])
def test_aggregate_over_a_selection_equals_recomputing_from_the_kv_arrays_of_those_prompts(compared, where):
    store, res, runs = compared
    sql = where_prompts(store, res.comparison_id, where)
    pids = store.sql(sql).column("prompt_id").to_pylist()
    assert 0 < len(pids) <= 6
    got = aggregate_bc(store, res.comparison_id, sql)
    layers, k_bc, v_bc = oracle(store, runs, pids)
    assert list(got.layers) == layers and set(got.prompt_ids) == set(pids)
    ids = ", ".join(f"'{p}'" for p in pids)
    n_gen = store.sql(f"SELECT min(n_tokens - n_prompt_tokens) FROM prompts WHERE run_id = '{runs['expected']}' "
                      f"AND prompt_id IN ({ids})").column(0)[0].as_py()
    assert got.k_bc.shape == k_bc.shape == (n_gen, 3)
    np.testing.assert_allclose(got.k_bc, k_bc, rtol=0, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(got.v_bc, v_bc, rtol=0, atol=1e-12, equal_nan=True)
    # the bug in layer 1's V shows, the sliding-window layer has BC where its window holds errors
    assert np.nanmax(got.v_bc[:, 1]) < 0.5 < np.nanmin(got.k_bc[:, 1])
    assert np.isfinite(got.k_bc[:, 2]).any()


def test_all_prompts_reproduce_the_stored_kv_gen_bc(compared):
    store, res, runs = compared
    got = aggregate_bc(store, res.comparison_id, f"SELECT DISTINCT prompt_id FROM raw_errors")
    rows = store.sql(f"SELECT gen_token_idx, layer, k_bc, v_bc FROM kv_gen_bc WHERE comparison_id = "
                     f"'{res.comparison_id}'").to_pylist()
    assert len(rows) == got.k_bc.size
    for r in rows:
        li = got.layers.index(r["layer"])
        for kv in ("k", "v"):
            want = getattr(got, f"{kv}_bc")[r["gen_token_idx"], li]
            assert (r[f"{kv}_bc"] is None and np.isnan(want)) or r[f"{kv}_bc"] == want


def test_raw_errors_rows_are_the_absolute_errors_of_the_kv(compared):
    """Hand oracle: |bf16 - fp32| of the stored arrays, over heads x head_dim, at a generation position."""
    store, res, runs = compared
    r = store.sql(f"SELECT * FROM raw_errors WHERE comparison_id = '{res.comparison_id}' AND layer_idx = 1 "
                  f"ORDER BY prompt_id, position LIMIT 1").to_pylist()[0]
    k = {role: store.read_kv(rid, r["prompt_id"])[0] for role, rid in runs.items()}
    pos = r["position"]
    as32 = lambda x: np.asarray(x[1, :, pos, :], dtype=np.float32).ravel()  # noqa: E731
    np.testing.assert_array_equal(np.asarray(r["base_k"], np.float32),
                                  np.abs(as32(k["expected"]) - as32(k["baseline"])))
    np.testing.assert_array_equal(np.asarray(r["tgt_k"], np.float32), np.abs(as32(k["actual"]) - as32(k["baseline"])))
    plen = store.sql(f"SELECT n_prompt_tokens FROM prompts WHERE prompt_id = '{r['prompt_id']}' AND run_id = "
                     f"'{runs['expected']}'").column(0)[0].as_py()
    assert r["gen_token_idx"] == pos - plen >= 0


def test_a_selection_matching_nothing_or_an_unknown_comparison_is_one_line(compared, capsys):
    store, res, runs = compared
    with pytest.raises(ValueError, match="matches no prompt"):
        aggregate_bc(store, res.comparison_id, where_prompts(store, res.comparison_id, "n_tokens > 10000"))
    with pytest.raises(ValueError, match="matches no prompt"):
        aggregate_bc(store, res.comparison_id, "SELECT 'not-a-prompt' AS prompt_id")
    with pytest.raises(ValueError, match="no committed comparison"):
        aggregate_bc(store, "cmp-nope", "SELECT prompt_id FROM prompts")
    s = str(store.root)
    assert main(["aggregate", res.comparison_id, "--store", s, "--where", "n_tokens > 10000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matches no prompt" in err
    # the selection runs confined: a write inside it is refused, nothing is written
    assert main(["aggregate", res.comparison_id, "--store", s, "--where",
                 "true); COPY (SELECT 1) TO 'x.parquet'; SELECT prompt_id FROM prompts WHERE (true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused" in err


def test_cli_aggregate_prints_the_bc_table(compared, capsys):
    import json

    store, res, runs = compared
    assert main(["aggregate", res.comparison_id, "--store", str(store.root), "--where", "prompt_idx < 2",
                 "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    sql = where_prompts(store, res.comparison_id, "prompt_idx < 2")
    got = aggregate_bc(store, res.comparison_id, sql)
    assert len(rows) == got.k_bc.size and rows[0]["n_prompts"] == 2
    assert rows[-1]["k_bc"] == got.k_bc[-1, -1] or (rows[-1]["k_bc"] is None and np.isnan(got.k_bc[-1, -1]))


def test_a_comparison_without_raw_errors_says_how_to_store_them(tmp_path):
    from tests.reports.synthetic import make_comparison

    store = Store.open(tmp_path / "s")
    res = make_comparison(store)
    with pytest.raises(ValueError, match="stored no raw errors.*--raw-errors"):
        aggregate_bc(store, res.comparison_id, "SELECT prompt_id FROM prompts")


def test_raw_errors_in_a_two_way_comparison_is_refused_before_anything_is_stored(tmp_path):
    from tests.reports.synthetic import add_runs

    store = Store.open(tmp_path / "s")
    runs = add_runs(store)
    with pytest.raises(ValueError, match="raw_errors comparator needs a baseline"):
        compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"], comparators=["raw_errors"])
    assert "comparisons" not in store.sql("SELECT table_name FROM information_schema.tables").column(0).to_pylist()


def test_the_raw_errors_comparator_alone_stores_the_same_errors_as_with_the_kv_comparator(compared, tmp_path):
    """Without the KV comparator it computes the errors itself: the same rows."""
    store, res, runs = compared
    alone = compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"], baseline_run=runs["baseline"],
                         kv=False, logits=False, comparators=["raw_errors"])
    q = ("SELECT prompt_id, position, layer_idx, base_k, tgt_k, base_v, tgt_v FROM raw_errors WHERE comparison_id = "
         "'{}' ORDER BY ALL")
    a, b = store.sql(q.format(res.comparison_id)), store.sql(q.format(alone.comparison_id))
    assert a.num_rows == b.num_rows > 0
    for col in a.column_names:
        x, y = a.column(col).to_pylist(), b.column(col).to_pylist()
        if col.startswith(("base", "tgt")):
            np.testing.assert_array_equal(np.array(x, np.float32), np.array(y, np.float32))  # NaN == NaN here
        else:
            assert x == y


def test_cli_compare_raw_errors_prints_what_they_cost(compared, capsys):
    from capturestore.aggregate import raw_errors_storage

    store, res, runs = compared
    assert main(["compare", "--store", str(store.root), "--expected", runs["expected"], "--actual", runs["actual"],
                 "--baseline", runs["baseline"], "--raw-errors"]) == 1  # the actual run has a bug
    out = capsys.readouterr().out
    m = __import__("re").search(r"raw_errors: ([\d.]+) MB stored \(([\d.]+) x the stored KV", out)
    assert m, out
    raw, kv = raw_errors_storage(store, res.comparison_id)
    files = sorted((store.root / "tables" / "raw_errors").glob("*.parquet"))
    assert 0 < raw < sum(f.stat().st_size for f in files) and kv > 0  # one of the two comparisons' segments
    assert float(m.group(2)) == pytest.approx(raw / kv, abs=0.01)


def test_compare_and_aggregate_print_nothing_and_return_what_the_cli_prints(compared, capsys):
    """The library functions the commands call (analysis.compare, aggregate.aggregate) print
    nothing, and return what the CLI formats: the raw errors' size as raw_errors_storage measures
    it, and the same BC as aggregate_bc over where_prompts' selection."""
    from capturestore.aggregate import aggregate, raw_errors_storage
    from capturestore.analysis import CompareResult, compare

    store, res, runs = compared
    r = compare(str(store.root), runs["expected"], runs["actual"], runs["baseline"], raw_errors=True)
    a = aggregate(str(store.root), res.comparison_id, where="prompt_idx < 3")
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == ""
    assert isinstance(r, CompareResult) and not r.comparison.passed  # the actual run's layer-1 V bug
    assert (r.raw_errors_bytes, r.kv_bytes) == raw_errors_storage(store, r.comparison.comparison_id)
    assert r.raw_errors_bytes > 0 and r.kv_bytes > 0
    assert compare(store, runs["expected"], runs["actual"]).raw_errors_bytes is None  # not asked for
    want = aggregate_bc(store, res.comparison_id, where_prompts(store, res.comparison_id, "prompt_idx < 3"))
    assert a.prompt_ids == want.prompt_ids and len(a.prompt_ids) == 3
    np.testing.assert_array_equal(a.k_bc, want.k_bc)
    np.testing.assert_array_equal(a.v_bc, want.v_bc)


@pytest.mark.parametrize("kw", [{}, {"where": "n_tokens > 1", "sql": "SELECT prompt_id FROM prompts"}])
def test_aggregate_wants_exactly_one_selection_before_it_opens_the_store(kw, tmp_path):
    from capturestore.aggregate import aggregate

    with pytest.raises(ValueError, match="exactly one of --where CONDITION and --sql QUERY"):
        aggregate(str(tmp_path / "no-store"), "c", **kw)
    assert not (tmp_path / "no-store").exists()
