"""Store.sql reads each table as two explicit file lists decided on one listing (the merged
segments, and the segments no merged segment of that listing covers), with no window; catalog.duckdb
keeps the window form of the reader rule (docs/compact.md). The oracle: the window form over the
same store, on a connection of its own, and the store as read before any compaction."""
from __future__ import annotations

import pytest

from capturestore import Store, catalog
from capturestore.compaction import is_merged
from capturestore.errors import QueryError
from tests.capturestore.test_compact import _fill, _seen, url  # noqa: F401 - url: the local and memory fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _window_rows(store: Store, query: str) -> list[str]:
    """``query`` over views of the window form (catalog.duckdb's), on a fresh connection."""
    root = store.backend.catalog_root()
    con = catalog.connect_memory(root)
    try:
        names = catalog.table_names(root)
        assert not catalog.add_views(con, root, names)
        view = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'runs'").fetchall()[0][0]
        assert "OVER (PARTITION BY" in view  # the oracle is the window form
        return sorted(map(repr, catalog.run_query(con, query, names).to_pylist()))
    finally:
        con.close()


def _queries(store: Store) -> list[str]:
    """Every view whole, and filtered on the columns a filter is pushed down on."""
    cid = store.sql("SELECT min(comparison_id) AS c FROM comparisons").column("c")[0].as_py()
    rid = store.sql("SELECT max(run_id) AS r FROM runs").column("r")[0].as_py()
    return [*(f'SELECT * FROM "{t}"' for t in store.backend.table_names()),
            f"SELECT * FROM kv_head_metrics WHERE comparison_id = '{cid}'",
            f"SELECT * FROM prompts WHERE run_id = '{rid}'",
            f"SELECT count(*) FROM kv_head_metrics WHERE comparison_id <> '{cid}'"]


def _explicit(store: Store) -> Store:
    s = Store.open(str(store.root), create=False)
    s.sql("SELECT 1")
    for t in s.backend.table_names():  # the path under test is the explicit one: no window in any view
        view = s.sql(f"SELECT sql FROM duckdb_views() WHERE view_name = '{t}'").column(0)[0].as_py()
        assert "OVER (PARTITION BY" not in view and "read_parquet(list_value(" in view, view[:300]
    return s


def test_explicit_lists_and_the_window_read_the_same_rows_before_during_and_after_compaction(url):
    store = Store.open(url)
    _fill(store)
    before = _seen(store)
    for stage in ("before", "middle", "after"):
        if stage == "middle":
            store.compact(grace_s=3600)  # merged, its sources still there (hidden)
        elif stage == "after":
            store.compact(grace_s=0)  # the sources removed
        s = _explicit(store)
        for q in _queries(s):
            got = sorted(map(repr, s.sql(q).to_pylist()))
            assert got == _window_rows(s, q), (stage, q)
        assert _seen(store) == before, stage


def test_explicit_lists_show_no_row_twice_in_the_middle_state(url):
    """Merged segments beside their sources: a source read beside the merged segment covering it
    counts its rows twice (seen failing with the covered sources planted into the uncovered list)."""
    store = Store.open(url)
    _fill(store)
    counts = {t: store.sql(f'SELECT count(*) AS n FROM "{t}"').column("n")[0].as_py() for t in store.backend.table_names()}
    assert counts["runs"] == 3 and counts["kv_head_metrics"] > 0
    store.compact(grace_s=3600)
    s = _explicit(store)
    for t, n in counts.items():
        names = s.backend.segment_names(t)  # the middle state: a merged segment and plain segments beside it
        assert any(is_merged(m) for m in names) and len(names) > 2, t
        assert s.sql(f'SELECT count(*) AS n FROM "{t}"').column("n")[0].as_py() == n, t
    ids = s.sql("SELECT run_id FROM runs").column(0).to_pylist()
    assert len(ids) == len(set(ids)) == 3


def test_a_merged_segment_written_after_the_listing_doubles_no_row(url, monkeypatch):
    """The listing is one snapshot: a compaction between it and the read adds a merged segment
    the query does not read, and the sources it does read are all still there."""
    store = Store.open(url)
    _fill(store)
    before = _seen(store)
    reader = Store.open(url, create=False)
    listing = catalog.segment_files
    calls = []

    def then_compact(root, footers=None):
        files = listing(root, footers)
        if not calls:
            Store.open(url, create=False).compact(grace_s=3600)
        calls.append(files)
        return files

    monkeypatch.setattr(catalog, "segment_files", then_compact)
    got = {t: sorted(map(repr, reader.sql(f'SELECT * FROM "{t}"').to_pylist())) for t in ("runs", "kv_head_metrics")}
    assert not any(f.merged for f in calls[0].values())  # read from before the compaction
    assert got == {t: before[t] for t in got}
    monkeypatch.undo()
    assert _seen(store) == before


def test_a_source_removed_after_the_listing_is_listed_and_read_again(url, monkeypatch):
    store = Store.open(url)
    _fill(store)
    before = _seen(store)
    reader = Store.open(url, create=False)
    listing = catalog.segment_files
    calls = []

    def then_compact_and_remove(root, footers=None):
        files = listing(root, footers)
        if not calls:  # merged and its sources removed at once (grace 0): the listed sources are gone
            Store.open(url, create=False).compact(grace_s=0)
        calls.append(files)
        return files

    monkeypatch.setattr(catalog, "segment_files", then_compact_and_remove)
    got = sorted(map(repr, reader.sql("SELECT * FROM runs").to_pylist()))
    assert got == before["runs"]
    assert len(calls) == 2 and not calls[0]["runs"].merged and calls[1]["runs"].merged


def test_a_source_removed_after_every_listing_fails_naming_it(tmp_path, monkeypatch):
    """A query that never finds its listed segments (removed each time before the read) fails in
    one line naming the segment; it never answers with rows missing."""
    store = Store.open(tmp_path / "store")
    _fill(store)
    reader = Store.open(tmp_path / "store", create=False)
    listing = catalog.segment_files

    def then_hide(root, footers=None):
        files = listing(root, footers)
        run = sorted(n for n in files["runs"].uncovered if not n.startswith("_"))[0]
        (tmp_path / "store" / "tables" / "runs" / run).rename(tmp_path / run)
        return files

    def put_back(*_):
        for p in tmp_path.glob("*.parquet"):
            p.rename(tmp_path / "store" / "tables" / "runs" / p.name)
        return []

    monkeypatch.setattr(catalog, "segment_files", then_hide)
    gone = catalog.listed_files_gone
    monkeypatch.setattr(catalog, "listed_files_gone", lambda root, files: (gone(root, files), put_back())[0])
    with pytest.raises(QueryError, match=r"segment runs/\S+\.parquet was listed and then removed .* 4 times"):
        reader.sql("SELECT * FROM runs")
