"""Evidence that goes missing never reads as a pass (issue 17 §1).

A real store with a clean release and a release whose layer 2 K/V drift at decode (a KV
regression ``diff`` reports, exit 1). Then one of the head comparison's segments is deleted,
truncated, copied, or joined by a foreign segment, and every reader must refuse naming the table
and segment — filtered by a literal comparison id or not, through ``Store.sql``, the file catalog
opened by plain DuckDB, ``diff``, ``report`` and ``aggregate`` — and ``verify`` must report it.
Before the fix, a filtered count over a deleted segment returned 0 rows and ``diff`` exited 0.
"""
import shutil

import duckdb
import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.cli import main
from capturestore.errors import QueryError, StoreError

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
H, D, V, N_PROMPTS, N_GEN = 2, 16, 64, 8, 6


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("evidence") / "s"
    store = Store.open(root)
    prompts = [(rng.integers(0, V, 5 + i % 3).tolist(), rng.integers(0, V, N_GEN).tolist()) for i in range(N_PROMPTS)]
    data = []
    for p, c in prompts:
        S = len(p) + len(c)
        data.append((rng.standard_normal((4, H, S, D)).astype(np.float32),
                     rng.standard_normal((4, H, S, D)).astype(np.float32),
                     (3 * rng.standard_normal((len(c), V))).astype(np.float32)))

    def run(dtype, f, release=None):
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h", dtype=dtype, release=release) as w:
            for i, (p, c) in enumerate(prompts):
                pid = w.add_prompt(p, continuation=c)
                k, v, lg = f(i, len(p))
                w.write_kv(pid, k, v, layer_names=LAYERS)
                w.write_logits(pid, lg)
        return w.run_id

    def bug(i, plen):
        k, v, lg = (x.copy() for x in data[i])
        k[2, :, plen:] *= 1.05
        v[2, :, plen:] *= 1.05
        return _bf16(k), _bf16(v), _bf16(lg)

    base = run("float32", lambda i, plen: data[i])
    exp = run("bfloat16", lambda i, plen: tuple(_bf16(x) for x in data[i]))
    ids = {}
    for name, f in (("r1", lambda i, plen: tuple(_bf16(x) for x in data[i])), ("r2", bug)):
        ids[name] = compare_runs(store, expected_run=exp, actual_run=run("bfloat16", f, name), baseline_run=base,
                                 comparators=["raw_errors"]).comparison_id
    return root, ids


@pytest.fixture
def store_copy(built, tmp_path):
    root, ids = built
    shutil.copytree(root, tmp_path / "s")
    return tmp_path / "s", ids


def _segment_of(root, table, cid):
    """The one segment of ``table`` holding rows of comparison ``cid``."""
    import pyarrow.parquet as pq

    (seg,) = [p for p in (root / "tables" / table).glob("*.parquet")
              if "comparison_id" in pq.read_schema(p).names
              and cid in pq.read_table(p, columns=["comparison_id"]).column(0).to_pylist()]
    return seg


def _damage(root, cid, how):
    seg = _segment_of(root, "kv_head_metrics", cid)
    if how == "deleted":
        seg.unlink()
    elif how == "truncated":
        seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    elif how == "copied":  # a file manager's copy: every row counted twice
        shutil.copyfile(seg, seg.with_name(seg.stem + " (1).parquet"))
    return seg


def test_the_intact_store_shows_the_regression_and_verifies(store_copy, capsys):
    root, ids = store_copy
    store = Store.open(root)
    assert store.verify().ok
    row = store.sql(f"SELECT manifest_tables, manifest_rows FROM comparisons WHERE comparison_id = '{ids['r2']}'"
                    ).to_pylist()[0]
    n = store.sql(f"SELECT count(*) AS n FROM kv_head_metrics WHERE comparison_id = '{ids['r2']}'").column(0)[0]
    assert n.as_py() == row["manifest_rows"][row["manifest_tables"].index("kv_head_metrics")] > 0
    assert main(["diff", ids["r1"], ids["r2"], "--store", str(root)]) == 1
    assert "REGRESSION" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["deleted", "truncated", "copied"])
def test_a_damaged_segment_fails_every_reader_naming_it(store_copy, how, capsys, tmp_path):
    root, ids = store_copy
    seg = _damage(root, ids["r2"], how)
    store = Store.open(root)
    queries = [f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{ids['r2']}'",
               "SELECT count(*) FROM kv_head_metrics",
               f"SELECT max(k_l2) FROM kv_head_metrics WHERE comparison_id = '{ids['r2']}' AND layer = '{LAYERS[2]}'"]
    for q in queries:
        with pytest.raises(QueryError, match=r"kv_head_metrics") as e:
            store.sql(q)
        assert seg.name.split(".")[0] in str(e.value) or how == "copied"
    # the other comparison's rows still read: only the damaged evidence refuses
    if how == "deleted":
        assert store.sql(f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{ids['r1']}'").column(0)[0] \
            .as_py() > 0
    # diff: one line, exit 2, naming table and segment; never "no regression"
    assert main(["diff", ids["r1"], ids["r2"], "--store", str(root)]) == 2
    out = capsys.readouterr()
    assert "no regression" not in out.out and "kv_head_metrics" in out.err and len(out.err.strip().splitlines()) == 1
    assert seg.stem in out.err
    assert main(["report", ids["r2"], "--store", str(root), "--out", str(tmp_path / "rep")]) == 2
    assert "kv_head_metrics" in capsys.readouterr().err and not (tmp_path / "rep" / "index.html").exists()
    assert main(["aggregate", ids["r2"], "--where", "true", "--store", str(root)]) == 2
    assert "kv_head_metrics" in capsys.readouterr().err
    # verify names it on disk
    kinds = {p.kind for p in store.verify()}
    assert {"deleted": "missing-segment", "truncated": "altered-segment", "copied": "foreign-segment"}[how] in kinds


@pytest.mark.parametrize("how", ["deleted", "copied"])
def test_the_file_catalog_in_plain_duckdb_refuses_too(store_copy, how):
    root, ids = store_copy
    Store.open(root)  # catalog.duckdb built
    _damage(root, ids["r2"], how)
    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    try:
        with pytest.raises(duckdb.Error, match="kv_head_metrics, comparison " + ids["r2"]):
            con.execute(f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{ids['r2']}'").fetchall()
        with pytest.raises(duckdb.Error, match="evidence is incomplete"):
            con.execute("SELECT layer, max(k_l2) FROM kv_head_metrics GROUP BY layer").fetchall()
    finally:
        con.close()


def test_a_segment_unreadable_when_views_are_built_still_fails_a_filtered_query(store_copy):
    """The placeholder view of an unreadable table was folded to 'no rows' by a literal filter."""
    root, ids = store_copy
    _damage(root, ids["r2"], "truncated")
    store = Store.open(root)
    for q in (f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{ids['r1']}'",
              "SELECT count(*) FROM kv_head_metrics",
              f"SELECT layer FROM kv_head_metrics WHERE layer = '{LAYERS[1]}'"):
        with pytest.raises(QueryError, match="kv_head_metrics"):
            store.sql(q)


def test_rows_appended_to_a_sealed_comparison_are_refused(store_copy):
    root, ids = store_copy
    store = Store.open(root)
    before = sorted(p.name for p in (root / "tables" / "kv_head_metrics").iterdir())
    with pytest.raises(ValueError, match=f"comparison {ids['r2']} is committed and its evidence is sealed"):
        store.append_table("kv_head_metrics", [{"comparison_id": ids["r2"], "layer": "x"}])
    assert sorted(p.name for p in (root / "tables" / "kv_head_metrics").iterdir()) == before
    assert store.verify().ok


def test_check_evidence_names_the_missing_segment_and_altered_content(store_copy):
    root, ids = store_copy
    seg = _damage(root, ids["r2"], "deleted")
    store = Store.open(root)
    store.check_evidence([ids["r1"]])  # untouched
    with pytest.raises(StoreError, match=f"diff: evidence incomplete: table kv_head_metrics, comparison {ids['r2']}: "
                                         f"segment {seg.name} is missing"):
        store.check_evidence([ids["r2"]], "diff")


def test_a_store_path_with_glob_characters_reads_only_itself(built, tmp_path):
    """'st*ar' was a glob: a sibling 'st-old-ar' made its tables unreadable (or read twice)."""
    root, ids = built
    mine = tmp_path / "st*ar"
    shutil.copytree(root, mine)
    shutil.copytree(root, tmp_path / "st-old-ar")
    for sib in ("st?ar", "st[x]ar"):
        shutil.copytree(root, tmp_path / sib)
    for path in (mine, tmp_path / "st?ar", tmp_path / "st[x]ar"):
        store = Store.open(path)
        n = store.sql("SELECT count(*) FROM comparisons").column(0)[0].as_py()
        assert n == 2, path
        assert store.sql(f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id = '{ids['r2']}'").column(0)[0] \
            .as_py() > 0
    con = duckdb.connect(str(mine / "catalog.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM comparisons").fetchone()[0] == 2
    finally:
        con.close()


def test_content_altered_at_the_same_row_count_is_found_by_check_evidence_and_verify(store_copy):
    """A rewritten segment with as many rows (values changed) passes the views' row-count guard;
    its SHA-256 does not match the manifest."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    root, ids = store_copy
    seg = _segment_of(root, "kv_head_metrics", ids["r2"])
    t = pq.read_table(seg)
    i = t.schema.get_field_index("k_l2")
    pq.write_table(t.set_column(i, "k_l2", pc.multiply(t.column("k_l2"), 0.5)), seg)
    store = Store.open(root)
    with pytest.raises(StoreError, match=f"comparison {ids['r2']}: table kv_head_metrics segment {seg.name} "
                                         f"differs from what the comparison wrote"):
        store.check_evidence([ids["r2"]], "diff")
    assert [p.kind for p in store.verify()] == ["altered-segment"]


@pytest.mark.parametrize("how", [None, "deleted", "copied"])
def test_own_queries_answer_as_sql_does_without_its_refusals(store_copy, how):
    """check_evidence's queries run through Store._own_rows (no EXPLAIN for writing operators, one
    planning): the same rows as Store.sql, and the same one-line error where a guard fails."""
    from capturestore.errors import QueryError

    root, ids = store_copy
    if how:
        _damage(root, ids["r2"], how)
    store = Store.open(root)
    queries = [("SELECT * FROM comparisons WHERE list_contains($ids, comparison_id) ORDER BY comparison_id",
                {"ids": sorted(ids.values())}),
               ("SELECT count(*) AS n, sum(k_l2) AS s FROM kv_head_metrics WHERE comparison_id = $c", {"c": ids["r1"]}),
               ("SELECT count(*) AS n FROM kv_head_metrics WHERE comparison_id = $c", {"c": ids["r2"]})]
    failed = []
    for q, params in queries:
        try:
            want = store.sql(q, params=params).to_pylist()
        except QueryError as e:
            with pytest.raises(QueryError) as got:
                store._own_rows(q, params)
            assert str(got.value) == str(e) and "its evidence is incomplete" in str(e), q
            failed.append(q)
            continue
        assert store._own_rows(q, params) == want, q
    assert failed == ([queries[2][0]] if how else [])  # the damaged comparison's count, and only it
    # one SELECT only: anything else is refused before it runs, as Store.sql refuses it
    target = root / "tables" / "comparisons" / "x.csv"
    for q in ("COPY (SELECT 1) TO '" + str(target) + "'", "SELECT 1; SELECT 2", "CREATE VIEW v AS SELECT 1"):
        with pytest.raises(QueryError, match="refused"):
            store._own_rows(q)
    assert not target.exists()


def test_a_guard_refusal_stops_the_hashing_beside_it(store_copy, monkeypatch):
    """check_evidence hashes the segments on a thread while DuckDB counts through the guards;
    when the guard refuses, its finding is the error and the hashing stops at the next segment
    instead of running through every one (a slow object store, a Ctrl-C waiting on it)."""
    import threading

    from capturestore import integrity

    root, ids = store_copy
    store = Store.open(root)
    n = len(store.sql(f"SELECT manifest_segments FROM comparisons WHERE comparison_id = '{ids['r2']}'"
                      ).column(0)[0].as_py())
    assert n >= 3
    seg = _damage(root, ids["r2"], "deleted")
    real = integrity._segment_matches
    calls, released = [], threading.Event()

    def slow(*args, **kw):  # the first segment is hashed until the guard has refused
        calls.append(args[2])
        if len(calls) == 1:
            released.wait(30)
        return real(*args, **kw)

    real_rows = store._own_rows

    def own_rows(q, params=None):
        try:
            return real_rows(q, params)
        finally:
            if "count(*)" in q:
                threading.Timer(0.2, released.set).start()  # after the refusal is raised

    monkeypatch.setattr(integrity, "_segment_matches", slow)
    monkeypatch.setattr(store, "_own_rows", own_rows)
    with pytest.raises(StoreError, match=f"segment {seg.name} is missing"):
        store.check_evidence([ids["r2"]], "diff")
    # the other n - 1 segments were not read (none at all if the refusal came before the thread's
    # first look, which a loaded machine could make happen)
    assert len(calls) <= 1, calls
