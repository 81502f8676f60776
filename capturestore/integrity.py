"""verify (checksums, catalog-vs-array consistency) and gc (what dead writers left behind).

A writer is alive while it holds the flock on its ``pending/<id>.json``; the kernel drops
the lock when the process dies (SIGKILL included), so liveness needs no pid guessing. Runs
(writer.py) and comparisons (``commit_comparison``) share that protocol: the pending file is
created locked before anything is written, the commit marker (a ``runs`` segment, a
``comparisons`` row) is written last, and the pending file goes after it. What a dead writer
left without a marker is invisible in the views, reported by ``verify`` and removed by ``gc``.
"""
from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from capturestore.layout import (
    ARRAYS_DIR,
    COMPARISON_ID_PREFIX,
    PENDING_DIR,
    TABLES_DIR,
    TENSOR_GROUPS,
    TMP_SUFFIX,
)
from capturestore.compaction import (
    coverage,
    grace_seconds,
    is_merged,
    merged_segments,
    plain_segment_rows,
    read_source,
    remove_finished_sources,
)
from capturestore.tables import (
    RUN_TABLES,
    SCHEMA_SEGMENT,
    read_checked,
    rows_to_table,
    segment_comparison_ids,
)


@dataclass(frozen=True)
class Problem:
    """One thing verify found wrong; fields name where, ``message`` says what."""

    kind: str  # corrupt-chunk | missing-array | missing-group | shape-mismatch | dtype-mismatch | bad-segment |
    #       bad-marker | orphan | missing-tokens | tokens-mismatch | catalog
    message: str
    run_id: str | None = None
    prompt_id: str | None = None
    array: str | None = None
    chunk: str | None = None

    def __str__(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in (("run", self.run_id), ("prompt", self.prompt_id),
                                                  ("array", self.array), ("chunk", self.chunk)) if v)
        return f"[{self.kind}] {where + ': ' if where else ''}{self.message}"


class VerifyReport(list):
    """A list of Problem; ``ok`` when empty. ``checked_chunks``: how many chunk CRCs were checked."""

    checked_chunks: int = 0
    checked_arrays: int = 0
    notes: list[str]  # not problems: e.g. a compaction whose sources are still to be removed

    def __init__(self, *args):
        super().__init__(*args)
        self.notes = []

    @property
    def ok(self) -> bool:
        return len(self) == 0

    def summary(self) -> str:
        head = f"{self.checked_arrays} arrays, {self.checked_chunks} chunks checked: "
        return head + ("OK" if self.ok else f"{len(self)} problem(s)\n" + "\n".join(str(p) for p in self)) + \
            "".join(f"\nnote: {n}" for n in self.notes)


def writer_is_alive(pending: Path) -> bool:
    """True while the writer that created ``pending`` still holds its lock."""
    try:
        fd = os.open(pending, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # closing drops our lock if we got it
    return False


def _take_over(path: Path, body: bytes) -> int | None:
    """Lock the pending file at ``path`` left by a dead writer and write ``body`` into it: its fd
    (locked); None when a live writer holds it; -1 when it went (or was replaced) meanwhile."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return -1
    os.ftruncate(fd, 0)
    os.write(fd, body)
    return fd


class PendingLock:
    """``pending/<id>.json``, created already locked (written under a temp name, locked, then
    linked to its name, which fails when the name exists), so from the moment anyone can see it
    ``writer_is_alive`` says True until ``release``. A file left by a dead writer (no one holds
    its flock) is taken over: locked and rewritten in place; one held by a live writer is
    WriterIdTaken. Two writers of one id never both hold it (``os.replace`` would let the second
    replace the first's file)."""

    def __init__(self, root: Path, writer_id: str, info: dict[str, Any]):
        from capturestore.errors import StoreError, WriterIdTaken

        self.path = root / PENDING_DIR / f"{writer_id}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(),
                           "started_at": datetime.now(timezone.utc).isoformat(), **info}).encode()
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # locked before anyone can see the file
            os.write(fd, body)
            for _ in range(100):  # a dead writer's file removed (gc) while we took it over: again
                try:
                    os.link(tmp, self.path)  # fails, replacing nothing, when the name exists
                    break
                except FileExistsError:
                    pass
                taken = _take_over(self.path, body)
                if taken is None:
                    raise WriterIdTaken(f"{root}: writer id {writer_id} is already taken by another writer")
                if taken >= 0:
                    os.close(fd)
                    fd = taken
                    break
            else:
                raise StoreError(f"{self.path}: cannot take this pending lock (it keeps changing)")
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self._fd: int | None = fd

    def rewrite(self, info: dict[str, Any]) -> None:
        """Replace what the file says (``Store.pending`` shows it), keeping the lock."""
        if self._fd is not None:
            os.lseek(self._fd, 0, os.SEEK_SET)
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps(info).encode())

    def release(self) -> None:
        """Remove the file, then drop the lock (a reader never sees it unlocked before it goes)."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def is_comparison_id(writer_id: str) -> bool:
    return writer_id.startswith(COMPARISON_ID_PREFIX)


def commit_comparison(store, comparison_id: str, tables: dict[str, Any], comparisons_rows: Any) -> None:
    """Append a comparison's tables, then its ``comparisons`` row last: the commit marker.

    The row carries the comparison's manifest (``manifest_tables``/``_segments``/``_rows``/
    ``_sha256``: one entry per segment written here), so a segment that later goes missing, is cut
    short, altered, copied twice or joined by foreign rows is found (``evidence_problems``, the
    views' guard in catalog.py) instead of its comparison reading as if it had fewer rows.

    ``tables``: {table name: rows} (anything ``Store.append_table`` takes), every row with
    ``comparison_id``. Until the marker is written the rows are invisible in the views; a
    pending lock keeps ``gc`` away meanwhile. On an exception the segments written so far are
    removed again (unless the marker made it), so a failed comparison leaves nothing; a killed
    one leaves rows that verify reports and gc removes. ``PendingComparison`` is the same in
    steps (tables written as their rows come).
    """
    with PendingComparison(store, comparison_id) as pending:
        for name, rows in tables.items():
            pending.append(name, rows)
        pending.commit(comparisons_rows)


class PendingComparison:
    """A comparison being written: ``commit_comparison``'s protocol in steps, so its rows can be
    written as they come rather than held until the end (``analysis.compare_runs``).

    Opening takes the pending lock (``gc`` keeps away); ``append(table, rows)`` writes one segment
    and notes it for the manifest; ``discard(tables)`` removes what was written of tables whose
    rows must not be stored after all (an errored comparator); ``commit(row)`` writes the
    ``comparisons`` row with the manifest last: the marker. Leaving the ``with`` block without
    the marker (an exception, ``KeyboardInterrupt``) removes every segment written; a killed
    process leaves them invisible (no marker), reported by ``verify`` and removed by ``gc``."""

    def __init__(self, store, comparison_id: str):
        if not is_comparison_id(comparison_id):
            raise ValueError(f"comparison id {comparison_id!r} must start with {COMPARISON_ID_PREFIX!r}")
        self.store, self.comparison_id = store, comparison_id
        self.written: list[tuple[Any, dict]] = []  # (segment, manifest entry) in write order
        self.committed = False
        self._lock = store._pending_lock(comparison_id, {"comparison_id": comparison_id, "status": "running"})

    def __enter__(self) -> PendingComparison:
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is not None and not self.committed:
                self._remove(self.written)
        finally:
            self._lock.release()
        if self.committed:  # its tables compacted when due (Store._after_commit), the lock released first
            self.store._after_commit([*dict.fromkeys(e["table"] for _, e in self.written), "comparisons"])

    def append(self, table: str, rows: Any) -> None:
        """Write ``rows`` of ``table`` as one segment (nothing for no rows)."""
        data = rows_to_table(rows, f"append_table {table}")
        if data.num_rows:
            seg = self.store.append_table(table, data)
            self.written.append((seg, _manifest_entry(self.store, table, seg, data.num_rows)))

    def discard(self, tables) -> None:
        """Remove the segments written of ``tables``; they leave the manifest."""
        tables = set(tables)
        drop = [(seg, entry) for seg, entry in self.written if entry["table"] in tables]
        self.written = [(seg, entry) for seg, entry in self.written if entry["table"] not in tables]
        self._remove(drop, committed=set())

    def commit(self, comparisons_rows: Any) -> None:
        """The ``comparisons`` row with the manifest of every segment written: the marker."""
        entries = [entry for _, entry in self.written]
        self.store.append_table("comparisons", with_manifest(rows_to_table(comparisons_rows, "comparisons"), entries))
        self.committed = True

    def _remove(self, written: list, committed: set | None = None) -> None:
        """Remove the ``written`` segments unless the marker made it (``committed``: the ids known
        committed; None: read them, and keep everything when they cannot be read), and the
        directory of a table left without segments."""
        if committed is None:
            committed = self.store._committed_comparison_ids()  # None: unreadable, so the marker may be there
        if not written or committed is None or self.comparison_id in committed:
            return
        for seg, _ in written:
            self.store.remove_written(seg)
        root = self.store.backend.path  # None on object storage, which has no directories
        for table in {entry["table"] for _, entry in written}:
            try:
                if root is not None:
                    (root / TABLES_DIR / table).rmdir()  # only when empty: another writer's segment stays
            except OSError:
                pass
        try:  # a table that got its first segment here has none again: its catalog view goes
            self.store._refresh_catalog()
        except Exception:  # noqa: BLE001 - the next open catches up; the first error is the one to raise
            pass


# ---- comparison manifests ------------------------------------------------------------------------
# Each committed comparison lists the segments it wrote in its ``comparisons`` row (parallel lists,
# one entry per segment), so its evidence can be checked whole: nothing missing, cut short or
# altered, nothing added (a copied segment counts every row twice). Comparisons committed before
# manifests existed (NULL lists) cannot be checked and are read as before.
MANIFEST_FIELDS = (("manifest_tables", "table"), ("manifest_segments", "segment"), ("manifest_rows", "rows"),
                   ("manifest_sha256", "sha256"))


def _segment_name(seg: Any) -> str:
    """The file name of a segment ``append_table`` returned (a local Path or an object key)."""
    return str(seg).replace(os.sep, "/").rsplit("/", 1)[-1]


def _manifest_entry(store, table: str, seg: Any, rows: int) -> dict[str, Any]:
    name = _segment_name(seg)
    return {"table": table, "segment": name, "rows": int(rows),
            "sha256": hashlib.sha256(store.read_segment(table, name)).hexdigest()}


def with_manifest(rows, entries: list[dict[str, Any]]):
    """``rows`` (the comparisons row) with its manifest columns set to ``entries``."""
    for col, key in MANIFEST_FIELDS:
        typ = pa.list_(pa.int64() if key == "rows" else pa.string())
        values = pa.array([[e[key] for e in entries]] * rows.num_rows, typ)
        i = rows.schema.get_field_index(col)
        rows = rows.append_column(col, values) if i < 0 else rows.set_column(i, pa.field(col, typ), values)
    return rows


def comparison_manifests(store) -> dict[str, list[dict[str, Any]] | None] | None:
    """{comparison_id: manifest entries, or None for a comparison committed without one} of every
    committed comparison; None when a ``comparisons`` segment is unreadable."""
    out: dict[str, list[dict[str, Any]] | None] = {}
    for name in store.segment_names("comparisons"):
        try:
            t = read_checked(pa.BufferReader(store.read_segment("comparisons", name)))
        except Exception:  # noqa: BLE001 - verify reports unreadable segments
            return None
        cols = {c: t.column(c).to_pylist() if c in t.column_names else [None] * t.num_rows
                for c in ("comparison_id", *(f for f, _ in MANIFEST_FIELDS))}
        for i, cid in enumerate(cols["comparison_id"]):
            if cid is None:
                continue
            lists = [cols[f][i] for f, _ in MANIFEST_FIELDS]
            if any(x is None for x in lists):
                out.setdefault(cid, None)
                continue
            out[cid] = [dict(zip((k for _, k in MANIFEST_FIELDS), e)) for e in zip(*lists)]
    return out


def evidence_problems(store, comparison_ids=None) -> list[Problem]:
    """What is wrong with the evidence of committed comparisons (all, or ``comparison_ids``)
    against their manifests: a listed segment missing, altered or cut short (its SHA-256), and a
    segment no manifest lists that holds rows of a manifested comparison (a copy or foreign rows).
    The same on every backend: only the store's segment listing and bytes are read."""
    manifests = comparison_manifests(store)
    if manifests is None and comparison_ids is None:
        return []  # verify reports the unreadable segment itself
    if manifests is None:
        return [Problem("bad-segment", "a comparisons segment is unreadable: no comparison's evidence can be "
                                       "checked (run `capturestore verify`)")]
    wanted = set(manifests) if comparison_ids is None else set(comparison_ids)
    checked = {cid: m for cid, m in manifests.items() if cid in wanted and m is not None}
    out: list[Problem] = []
    listed: dict[str, set[str]] = {}  # table -> segments a manifest lists
    for cid, entries in manifests.items():
        for e in entries or ():
            listed.setdefault(e["table"], set()).add(e["segment"])
    names_cache: dict[str, set[str]] = {}
    merged_cache: dict[str, dict[str, Any]] = {}  # table -> {source: (merged name, its footer entry)}
    replaced: dict[str, set[str]] = {}  # table -> merged segments merged again (hidden, as sources are)

    def merged_of(t: str) -> dict[str, Any]:
        if t not in merged_cache:
            ms, _ = merged_segments(store.backend, t, sorted(names_cache.setdefault(t, set(store.segment_names(t)))))
            merged_cache[t] = {src: (m.name, info) for m in ms for src, info in m.sources.items()}
            replaced[t] = {r for m in ms for r in m.replaces}
        return merged_cache[t]

    for cid, entries in sorted(checked.items()):
        for e in entries:
            t, seg = e["table"], e["segment"]
            names = names_cache.setdefault(t, set(store.segment_names(t)))
            where = f"comparison {cid}: table {t} segment {seg}"
            if seg in merged_of(t):
                # merged by compact (the views read the merged rows, the source file if still there is
                # hidden), which checked the bytes against this manifest before merging; verify checks
                # the merged rows against the footer (row count, row hash)
                mname, info = merged_of(t)[seg]
                if info.get("sha256") != e["sha256"] or info.get("rows") != e["rows"]:
                    out.append(Problem("altered-segment", f"{where}: merged into {mname} from bytes other than its "
                                                          f"manifest lists (SHA-256 or row count)"))
                continue
            if seg not in names:
                out.append(Problem("missing-segment", f"{where} is missing (its manifest lists {e['rows']} rows)"))
                continue
            data = store.read_segment(t, seg)
            if hashlib.sha256(data).hexdigest() == e["sha256"]:
                continue
            try:
                n = pq.read_metadata(pa.BufferReader(data)).num_rows
                what = f"holds {n} rows where its manifest lists {e['rows']}" if n != e["rows"] else \
                    "differs from what the comparison wrote (SHA-256)"
            except Exception:  # noqa: BLE001
                what = f"is unreadable (truncated or damaged; its manifest lists {e['rows']} rows)"
            out.append(Problem("altered-segment", f"{where} {what}"))
    # segments no manifest lists, holding rows of a checked comparison
    for t in sorted({e["table"] for m in checked.values() for e in m}):
        merged_names = {m for m, _ in merged_of(t).values()}
        for src, (mname, _) in sorted(merged_of(t).items()):
            if src in listed.get(t, set()):
                continue
            try:
                ids = set(read_source(store.backend, t, src, {src: mname}).column("comparison_id").to_pylist())
            except Exception:  # noqa: BLE001 - verify reports it
                continue
            for cid in sorted(ids & set(checked)):
                out.append(Problem("foreign-segment", f"comparison {cid}: table {t} segment {src} (merged into {mname}) "
                                                      f"holds rows of the comparison but is not in its manifest"))
        for seg in sorted(names_cache.setdefault(t, set(store.segment_names(t))) - listed.get(t, set()) - merged_names
                          - replaced[t]):
            try:
                ids = store.segment_comparison_ids(t, seg)
            except Exception:  # noqa: BLE001 - an unreadable segment: verify's bad-segment
                continue
            for cid in sorted((ids or set()) & set(checked)):
                out.append(Problem("foreign-segment", f"comparison {cid}: table {t} segment {seg} holds rows of "
                                                      f"the comparison but is not in its manifest (a copy of a "
                                                      f"segment, or rows appended later); its rows would count twice"))
    return out


def check_evidence(store, comparison_ids, command: str) -> None:
    """Refuse (StoreError naming comparison, table and segment) when the evidence of any of
    ``comparison_ids`` is incomplete: a verdict must never be read off the rows that are left.

    Cheaper than ``evidence_problems`` on a large store, and what ``diff``/``report``/``aggregate``
    call: the manifests of these comparisons come from one query, each table they list is counted
    through its view (whose guard names a missing, cut short, copied or foreign segment), and only
    these comparisons' own segments are hashed (content altered at the same row count)."""
    from capturestore.errors import QueryError, StoreError

    ids = sorted({str(c) for c in comparison_ids})
    if not ids:
        return
    # queries of this function's own text: run without sql()'s refusals of writing statements and
    # planned once (Store._own_rows)
    try:
        if not store.backend.segment_names("comparisons"):
            return  # no comparison committed: nothing to check against
        # the declared view has the manifest columns, NULL in a store written before manifests (nothing
        # to check against); only these columns: another one (created_at, a timestamp with time zone)
        # would need pytz to become Python with duckdb 1.x
        rows = [r for r in store._own_rows(f"SELECT comparison_id, {', '.join(f for f, _ in MANIFEST_FIELDS)} "
                                           f"FROM comparisons WHERE list_contains($ids, comparison_id)", {"ids": ids})
                if r["manifest_tables"] is not None]
    except QueryError as e:
        raise StoreError(f"{command}: evidence incomplete: {_guard_message(str(e))}") from None
    tables = sorted({t for r in rows for t in r["manifest_tables"] or ()})
    if not tables:
        return
    # the segments' bytes are hashed on a thread while DuckDB counts through the guards (it works
    # with the GIL released, as pyarrow's reads and hashlib do): a merged segment's check is about
    # as long as the count. The guard's finding, naming a missing or foreign segment, is said first,
    # and stops the hashing at the next segment.
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="check-evidence") as pool:
        altered = pool.submit(_first_altered, store, rows, stop)
        try:  # every table's guard in one query
            store._own_rows(" UNION ALL ".join(f'SELECT count(*) FROM "{t.replace(chr(34), chr(34) * 2)}" '
                                               f"WHERE list_contains($ids, comparison_id)" for t in tables), {"ids": ids})
        except BaseException as e:  # a refusal, or an interrupt: the hashing stops either way
            stop.set()
            if isinstance(e, QueryError):
                raise StoreError(f"{command}: evidence incomplete: {_guard_message(str(e))}") from None
            raise
        why = altered.result()
    if why is not None:
        raise StoreError(f"{command}: evidence incomplete: {why} differs from what the comparison wrote "
                         f"(SHA-256; run `capturestore verify`)")


def _first_altered(store, rows: list[dict[str, Any]], stop: threading.Event | None = None) -> str | None:
    """``comparison C: table T segment S`` of the first manifest entry of ``rows`` (comparisons rows
    with their manifests) whose rows are not what its manifest lists (``_segment_matches``); None
    when all are, or when ``stop`` is set (checked before each entry)."""
    merged_cache: dict[str, dict[str, Any]] = {}
    footers = getattr(store, "_footers", None)  # merged segments' footers the store has read (never rewritten)
    for r in rows:
        for e in (dict(zip((k for _, k in MANIFEST_FIELDS), e)) for e in zip(*(r[f] for f, _ in MANIFEST_FIELDS))):
            if stop is not None and stop.is_set():
                return None
            if not _segment_matches(store, e["table"], e["segment"], e["sha256"], e["rows"], merged_cache, footers):
                return f"comparison {r['comparison_id']}: table {e['table']} segment {e['segment']}"
    return None


def _segment_matches(store, table: str, name: str, sha256: str, rows: int,
                     cache: dict[str, dict[str, Any]] | None = None, footers: dict | None = None) -> bool:
    """The rows the views read as segment ``name`` of ``table`` are what a manifest lists. When a
    merged segment of the listing names it (the reader rule hides the source file, which may
    still exist until its grace is over), the merged segment's footer must record those bytes
    and row count and its rows of ``name`` must match the footer (count and canonical row hash;
    read from the row groups holding them, ``compaction.merged_problems(only=name)``). The hidden
    file is never what is checked. Otherwise the file's bytes' SHA-256.
    ``cache``: {table: {source: merged segment}}, shared by one check; ``footers``: as
    compaction.merged_segments (the footers of merged segments read before)."""
    from capturestore.compaction import merged_problems

    cache = {} if cache is None else cache
    for fresh in (False, True):
        if fresh or table not in cache:
            ms, _ = merged_segments(store.backend, table, footers=footers)
            cache[table] = {s: m for m in ms for s in m.sources}
        m = cache[table].get(name)
        if m is not None:
            info = m.sources[name]
            return info["sha256"] == sha256 and info["rows"] == rows and not merged_problems(
                store.backend, table, m, only=name)
        try:
            return hashlib.sha256(store.read_segment(table, name)).hexdigest() == sha256
        except FileNotFoundError:
            continue  # merged and removed since the listing: list again
    return False


def _guard_message(msg: str) -> str:
    """The guard's own words out of DuckDB's error text."""
    m = re.search(r"(table \w+, comparison .*?\(run capturestore verify\))", msg)
    return m.group(1) if m else msg


def check_sealed(store, table: str, comparison_ids) -> None:
    """Refuse rows for a committed comparison that has a manifest: its evidence is sealed."""
    if not comparison_ids:
        return
    manifests = comparison_manifests(store) or {}
    sealed = sorted(c for c in set(comparison_ids) if manifests.get(c))
    if sealed:
        raise ValueError(f"append_table {table}: comparison {sealed[0]} is committed and its evidence is sealed by "
                         f"its manifest; rows added now would read as evidence it never judged (write a new "
                         f"comparison)")


def pid_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- verify and gc: written once over backends.Backend --------------------------------------------
# Everything below reads and removes through the backend's public interface (keys relative to the
# store root), so each check runs on a directory, a bucket and in memory alike; liveness is the
# backend's (a flock, a lease by the server's clock, a held lock object).

def _as_backend(store_or_root: Any):
    from capturestore.backends import Backend, LocalBackend

    if isinstance(store_or_root, Backend):
        return store_or_root
    if isinstance(store_or_root, Path):
        return LocalBackend(store_or_root)
    return store_or_root.backend


def _segment_ids(b, table: str) -> set[str]:
    """Names (without .parquet) of the segments writers wrote, whether a file or merged by compact."""
    from capturestore.compaction import logical_names

    return {n.removesuffix(".parquet") for n in logical_names(b, table)}


def _is_compaction_lock(writer_id: str) -> bool:
    from capturestore.compaction import LOCK_PREFIX

    return writer_id.startswith(LOCK_PREFIX)


def committed_comparisons(b) -> set[str] | None:
    out: set[str] = set()
    for name in b.segment_names("comparisons"):
        try:
            out |= set(b.read_parquet(f"{TABLES_DIR}/comparisons/{name}", ["comparison_id"]).column(0).to_pylist())
        except Exception:  # noqa: BLE001 - verify reports unreadable segments
            return None
    out.discard(None)
    return out


def _runs_compared(b) -> dict[str, str] | None:
    """{run id: a committed comparison that compared it} over every ``comparisons`` segment (the
    row's three roles and its per-comparator runs), or None when one cannot be read. A run missing
    its commit marker that a committed comparison used was committed once: its marker was lost
    (damage, a merged runs segment gone), and ``gc`` must not take its captures for a dead
    writer's leftovers (before, it removed them with the arrays)."""
    out: dict[str, str] = {}
    for name in b.segment_names("comparisons"):
        try:
            t = b.read_parquet(f"{TABLES_DIR}/comparisons/{name}")
        except Exception:  # noqa: BLE001 - verify reports unreadable segments
            return None
        cols = {c: t.column(c).to_pylist() for c in ("comparison_id", "baseline_run", "expected_run", "actual_run",
                                                      "comparator_runs") if c in t.column_names}
        for i, cid in enumerate(cols.get("comparison_id", [])):
            runs = [cols[c][i] for c in ("baseline_run", "expected_run", "actual_run") if c in cols]
            raw = cols.get("comparator_runs", [None] * (i + 1))[i]
            if raw:
                try:
                    runs += [r for roles in json.loads(raw).values() for r in roles.values()]
                except (ValueError, AttributeError, TypeError):
                    return None  # unreadable: undecided, so nothing counts as a dead writer's
            for r in runs:
                if isinstance(r, str) and cid is not None:
                    out.setdefault(r, cid)
    return out


def _comparison_tables(b) -> list[str]:
    """Tables whose rows belong to comparisons: a ``comparison_id`` column, other than ``comparisons``."""
    return [t for t in b.listdir(TABLES_DIR) if t not in (*RUN_TABLES, "comparisons") and b.has_column(t, "comparison_id")]


def _leftovers(b) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(run ids, {comparison id: its segments}, stale pending keys) that dead writers left.

    Runs: arrays or segments but no runs segment. Comparisons: no ``comparisons`` row; a segment
    counts when every row belongs to one such comparison (compare_runs writes one comparison per
    segment); nothing counts while a ``comparisons`` segment is unreadable (verify reports it).
    Stale: pending objects of dead writers that did commit. A live writer's are never listed."""
    alive = b.liveness()
    committed = _segment_ids(b, "runs")
    pending = {n.removesuffix(".json") for n in b.listdir(PENDING_DIR) if n.endswith(".json")}
    # zarr's atomic writes leave "zarr.<uuid>.partial" beside the key while they run (or for good when the
    # writer was killed mid-write, e.g. of arrays/zarr.json): a temporary file, never a run
    seen = {n for n in b.listdir(ARRAYS_DIR)
            if n != "zarr.json" and not n.startswith(".") and not (n.startswith("zarr.") and n.endswith(".partial"))}
    for t in ("prompts", "captures"):
        seen |= _segment_ids(b, t)
    seen |= {i for i in pending if not is_comparison_id(i) and not _is_compaction_lock(i)}
    runs = [r for r in sorted(seen - committed) if not alive(r)]
    committed = _segment_ids(b, "runs")  # committed while we looked: not an orphan
    runs = [r for r in runs if r not in committed]
    segments: dict[str, list[str]] = {}
    for t in _comparison_tables(b):
        for name in b.segment_names(t):
            if name.startswith("compacted-"):  # committed rows only (compaction.is_merged)
                continue
            rel = f"{TABLES_DIR}/{t}/{name}"
            try:
                ids = segment_comparison_ids(b.read(rel))
            except Exception:  # noqa: BLE001 - reported as a bad segment
                continue
            if ids and len(ids) == 1:
                segments.setdefault(next(iter(ids)), []).append(rel)
    stale = [f"{PENDING_DIR}/{i}.json" for i in sorted(pending)
             if not is_comparison_id(i) and i in committed and not alive(i)]
    stale += [f"{PENDING_DIR}/{i}.json" for i in sorted(pending) if _is_compaction_lock(i) and not alive(i)]
    ccommitted = committed_comparisons(b)
    if ccommitted is None:
        return runs, {}, stale
    cpending = {i for i in pending if is_comparison_id(i)}
    dead = {c: segments.get(c, []) for c in sorted((set(segments) | cpending) - ccommitted) if not alive(c)}
    ccommitted = committed_comparisons(b)
    if ccommitted is None:
        return runs, {}, stale
    dead = {c: segs for c, segs in dead.items() if c not in ccommitted}
    stale += [f"{PENDING_DIR}/{c}.json" for c in sorted(cpending) if c in dead or (c in ccommitted and not alive(c))]
    return runs, dead, stale


def verify(store_or_root: Any) -> VerifyReport:
    """Every check that needs no catalog: segments readable, each committed run's marker, group
    metadata, every catalogued array present with the catalogued shape and dtype and every
    chunk's CRC32C, tokens as catalogued, leftovers of dead writers, and (where the backend keeps
    one) catalog.duckdb against a rebuild. ``store_or_root``: a Store, a Backend or a directory."""
    b = _as_backend(store_or_root)
    report = VerifyReport()
    # 1. every segment must be readable Parquet; a segment a writer wrote is read whole, each page
    # against its CRC and the rows checked by Arrow (UTF-8 strings): a damaged page read back as
    # other values with no error, which only such a read finds (a merged segment's rows are checked
    # against its footer's row hashes below, _verify_compacted)
    # A committed run's own segments of the run tables are checked where step 2 reads its rows (one
    # read of each, not two: the second read was 37% of a verify of 300 runs); any step 2 does not
    # reach is checked after it.
    covers = {t: coverage(b, t) for t in RUN_TABLES}
    runs_now = _segment_ids(b, "runs")
    deferred: set[tuple[str, str]] = set()
    for t in b.listdir(TABLES_DIR):
        for name in b.segment_names(t):
            if t in RUN_TABLES and not is_merged(name) and name not in covers[t] \
                    and name.removesuffix(".parquet") in runs_now:
                deferred.add((t, name))
                continue
            _check_segment(b, t, name, report)
        _verify_compacted(b, t, report)
    # 2. every capture of a committed run: array present, shape and dtype as catalogued, every chunk's CRC
    _verify_group(b, "", report)
    rows_of = _SourceRows(b, deferred)
    for run_id in sorted(_segment_ids(b, "runs")):
        if not _verify_run_marker(run_id, report, covers["runs"], rows_of):
            continue
        caps = _run_rows(rows_of, "captures", run_id, covers["captures"], report)
        prompts = _run_rows(rows_of, "prompts", run_id, covers["prompts"], report)
        if caps is None or prompts is None:
            continue
        foreign = False
        for what, rows in (("prompts", prompts), ("captures", caps)):
            other = sorted({repr(r.get("run_id")) for r in rows if r.get("run_id") != run_id})
            if other:  # damaged, or written by another tool: the arrays would be looked up under another run
                report.append(Problem("bad-segment", f"table {what} segment {run_id}.parquet holds rows of run "
                                                     f"{other[0]}", run_id=run_id))
                foreign = True
        if foreign:
            continue
        have_tokens = {c["prompt_id"] for c in caps if c["array_name"] == "tokens"}
        for p in prompts:
            if p["prompt_id"] not in have_tokens:
                report.append(Problem("missing-tokens", "prompt has no tokens capture", run_id=run_id,
                                      prompt_id=p["prompt_id"]))
        n_before = len(report)
        groups = {run_id} | {f"{run_id}/{p['prompt_id']}" for p in prompts}
        for c in caps:  # every group from the run down to each array: plain zarr needs their zarr.json
            parts = f"{run_id}/{c['prompt_id']}/{_array_of(c)}".split("/")
            groups |= {"/".join(parts[:i]) for i in range(1, len(parts))}
        for g in sorted(groups):
            _verify_group(b, g, report)
        metas = b.read_many(sorted({f"{ARRAYS_DIR}/{run_id}/{c['prompt_id']}/{_array_of(c)}/zarr.json" for c in caps}))
        whole: set[str] = set()  # sharded group arrays already read whole
        for c in caps:
            _verify_capture(b, c, metas, report, whole)
        if len(report) == n_before:  # arrays sound: do the tokens agree with the catalog?
            for p in prompts:
                _verify_prompt_tokens(b, p, report)
        if len(report) > n_before and _gone_since_listing(b, "runs", f"{run_id}.parquet") == "removed":
            del report[n_before:]  # removed while its arrays were read (remove_run deletes its marker first)
    for t, name in sorted(deferred - rows_of.checked):  # e.g. the prompts of a run whose marker is bad
        _check_segment(b, t, name, report)
    # 3. leftovers of dead writers (gc removes them)
    runs, dead, stale = _leftovers(b)
    used = _runs_compared(b) if runs else {}
    for run_id in runs:
        if used is None:  # which comparisons used it is unknown: gc leaves it
            report.append(Problem("orphan", "uncommitted run, left by a dead writer or its marker lost: a comparisons "
                                            "segment is unreadable, so whether a committed comparison used it is "
                                            "unknown; `capturestore gc` leaves it until that segment is mended",
                                  run_id=run_id))
            continue
        if run_id in used:  # committed once: its marker was lost, it is no dead writer's
            report.append(Problem("bad-marker", f"run has captures but no commit marker (its runs segment is gone) "
                                                f"while comparison {used[run_id]} compared it: its marker was lost, "
                                                f"these are no leftovers of a dead writer; `capturestore gc` leaves "
                                                f"them", run_id=run_id))
            continue
        report.append(Problem("orphan", "uncommitted run left by a dead writer (run `capturestore gc`)", run_id=run_id))
    for cid, segs in dead.items():
        report.append(Problem("orphan", f"comparison {cid} never committed (no comparisons row), its writer is "
                                        f"dead; its rows are hidden: {', '.join(segs) or 'no segment'} "
                                        f"(run `capturestore gc`)"))
    for rel in stale:
        if _is_compaction_lock(rel.rsplit("/", 1)[-1]):  # every state of a compaction is a consistent store
            report.notes.append(f"a compaction was stopped midway ({rel} of a dead process); the store is "
                                f"consistent: `capturestore gc` removes the file and `capturestore compact` "
                                f"finishes the job (on a directory or in memory compact also takes the file over)")
            continue
        if rel.rsplit("/", 1)[-1].removesuffix(".json") not in dead:
            who = "comparison writer" if is_comparison_id(rel.rsplit("/", 1)[-1]) else "writer"
            report.append(Problem("orphan", f"pending file {rel} of a dead {who} (run `capturestore gc`)"))
    for rel in b.dead_temp_files():
        report.append(Problem("orphan", f"temp file {rel} left by a dead writer (run `capturestore gc`)"))
    # 4. catalog.duckdb holds exactly what rebuild-catalog would write
    try:
        msgs = b.catalog_problems()
    except Exception as e:  # noqa: BLE001 - e.g. no room for the copy it reads: say so, keep the rest
        msgs = [f"catalog.duckdb could not be checked: {e}"]
    for msg in msgs:
        report.append(Problem("catalog", msg))
    return report


def _verify_compacted(b, table: str, report: VerifyReport) -> None:
    """Each merged segment of ``table`` against its footer (every source's rows, count and hash),
    no source merged twice; sources still present beside their merged segment are a note."""
    from capturestore.compaction import merged_problems, merged_segments, visible_merged

    names = b.segment_names(table)
    every_merged, bad = merged_segments(b, table, names, include_replaced=True)  # each footer read once
    merged = visible_merged(every_merged)
    replaced = sorted({r for m in merged for r in m.replaces} & set(names))
    every = {m.name: m for m in every_merged}
    for m in merged:  # a replaced segment hides its rows: its replacer must hold every one of its sources
        for r in m.replaces:
            lost = sorted(set(every[r].sources) - set(m.sources)) if r in every else []
            if lost:
                report.append(Problem("bad-segment", f"table {table} merged segment {m.name} replaces {r} but lacks "
                                                     f"its source(s) {', '.join(lost[:3])}: their rows are hidden"))
    for n, why in bad.items():
        report.append(Problem("bad-segment", f"table {table} merged segment {n}: its compaction footer is unreadable: {why}"))
    seen: dict[str, str] = {}
    for m in merged:
        for msg in merged_problems(b, table, m):
            report.append(Problem("bad-segment", msg))
        for s in m.sources:
            if s in seen:
                report.append(Problem("bad-segment", f"table {table}: segment {s} is merged in both {seen[s]} and "
                                                     f"{m.name}; its rows count twice"))
            seen[s] = m.name
        left = sorted(set(m.sources) & set(names))
        if left:
            report.notes.append(f"table {table}: compaction to finish: {len(left)} source segment(s) of {m.name} "
                                f"still present (hidden; `capturestore compact` or `gc` removes them after the grace)")
    if replaced:
        report.notes.append(f"table {table}: compaction to finish: {len(replaced)} merged segment(s) merged again "
                            f"still present (hidden; `capturestore compact` or `gc` removes them after the grace)")


def _check_segment(b, t: str, name: str, report: VerifyReport) -> None:
    """Step 1 of verify for one segment: readable Parquet; a segment a writer wrote read whole and
    checked (``plain_segment_rows``), a merged one's footer read (its rows: _verify_compacted)."""
    try:
        data = b.read(f"{TABLES_DIR}/{t}/{name}")
        if is_merged(name):
            pq.read_metadata(pa.BufferReader(data))
        else:
            plain_segment_rows(data, t)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, FileNotFoundError) and _gone_since_listing(b, t, name) is not None:
            return  # its run removed, or the segment merged (then checked with its merged segment), since the listing
        run = name.removesuffix(".parquet") if t in RUN_TABLES else None
        report.append(Problem("bad-segment", f"table {t} segment {name} is unreadable: {e}", run_id=run))


class _SourceRows:
    """``read_source`` for one verify: each merged segment read once and split by source (verify
    reads every run's rows of runs, prompts and captures; a merged segment read per run made it
    quadratic in the runs: 200 runs, 1.4 s of a 2.0 s verify). ``deferred``: (table, name) of
    segments whose step-1 check is done here, as their rows are read (``plain_segment_rows``:
    its error is the caller's bad segment); ``checked`` says which were."""

    def __init__(self, b, deferred: set[tuple[str, str]] | None = None):
        self.b = b
        self._split: dict[tuple[str, str], tuple[dict[str, pa.Table], pa.Table]] = {}
        self.deferred = deferred or set()
        self.checked: set[tuple[str, str]] = set()
        self._failed: dict[tuple[str, str], Exception] = {}

    def __call__(self, table: str, name: str, cover: dict[str, str] | None) -> pa.Table:
        from capturestore.compaction import SOURCE_COLUMN, split_sources

        merged = (cover or {}).get(name)
        if merged is None:
            if (table, name) in self.deferred and (table, name) not in self.checked:
                self.checked.add((table, name))
                return plain_segment_rows(self.b.read(f"{TABLES_DIR}/{table}/{name}"), table)
            return read_source(self.b, table, name, cover)
        key = (table, merged)
        if key in self._failed:  # read once: a damaged merged segment is not read again for each run it holds
            raise self._failed[key]
        if key not in self._split:
            try:
                t = read_checked(pa.BufferReader(self.b.read(f"{TABLES_DIR}/{table}/{merged}")))
            except FileNotFoundError:
                raise
            except Exception as e:
                self._failed[key] = e
                raise
            empty = t.slice(0, 0).drop_columns([SOURCE_COLUMN]).replace_schema_metadata(None)
            self._split[key] = (split_sources(t), empty)
        by, empty = self._split[key]
        return by.get(name, empty)


def _run_rows(rows_of: _SourceRows, table: str, run_id: str, cover: dict[str, str], report: VerifyReport,
              columns: list[str] | None = None) -> list[dict] | None:
    """A run's rows of a run table as dicts, or None where its segment (or the merged segment
    holding them) cannot be read: reported once, naming that segment (step 1 of verify has
    usually named it already; a read that fails only here, e.g. a merged segment removed since
    the listing, is reported here, never passed over in silence)."""
    name = f"{run_id}.parquet"
    for attempt in (0, 1):
        try:
            t = rows_of(table, name, cover)
            return (t.select(columns) if columns else t).to_pylist()
        except FileNotFoundError as e:  # removed or merged since the listing: not damage, unless neither
            gone = _gone_since_listing(rows_of.b, table, name)
            if gone == "removed":  # the run was removed (a roll-back, remove_run): nothing left to check
                return None
            if gone == "merged" and attempt == 0:  # read its rows where they are now
                cover = coverage(rows_of.b, table)
                continue
            err: Exception = e
        except Exception as e:  # noqa: BLE001 - any failure to read is a finding, not a crash of verify
            err = e
        seg = (cover or {}).get(name, name)
        if not any(p.kind == "bad-segment" and (f"table {table} segment {seg} " in p.message
                                                or f"table {table} merged segment {seg} " in p.message)
                   for p in report):
            report.append(Problem("bad-segment", f"table {table} segment {seg} is unreadable: {err}", run_id=run_id))
        return None
    return None


def _gone_since_listing(b, table: str, name: str) -> str | None:
    """Why a segment ``name`` of ``table`` listed earlier in this verify cannot be read now:
    "removed" (a run table's segment whose run is no longer committed: rolled back or removed by
    another process), "merged" (a merged segment covers it, or replaces it, now: compaction
    removes what it merged after the grace), or None (a finding: its rows are nowhere, or the
    listing itself failed)."""
    from capturestore.compaction import merged_segments

    try:
        if is_merged(name):  # merged again, and removed after its grace
            return "merged" if any(name in m.replaces for m in merged_segments(b, table)[0]) else None
        if table in RUN_TABLES and name.removesuffix(".parquet") not in _segment_ids(b, "runs"):
            return "removed"
        return "merged" if name in coverage(b, table) else None
    except Exception:  # noqa: BLE001 - a listing that fails now: undecided, so the failed read is the finding
        return None


def _verify_run_marker(run_id: str, report: VerifyReport, cover: dict[str, str], rows_of: _SourceRows) -> bool:
    """The runs segment of a run is its commit marker: exactly one complete row naming it."""
    rows = _run_rows(rows_of, "runs", run_id, cover, report, ["run_id", "status"])
    if rows is None:
        return False
    if rows != [{"run_id": run_id, "status": "complete"}]:
        what = "no row" if not rows else f"{len(rows)} rows {[r['run_id'] for r in rows][:3]}"
        report.append(Problem("bad-marker", f"runs segment {run_id}.parquet (the run's commit marker) holds {what}, "
                                            "not one complete row of this run", run_id=run_id))
        return False
    return True


def _verify_group(b, path: str, report: VerifyReport) -> None:
    """``arrays.zarr/<path>`` has group metadata; without it plain zarr/xarray cannot open the store."""
    rel = "/".join(p for p in (ARRAYS_DIR, path, "zarr.json") if p)
    parts = path.split("/") if path else []
    where = {"run_id": parts[0] if parts else None, "prompt_id": parts[1] if len(parts) > 1 else None}
    try:
        node = json.loads(b.read(rel)).get("node_type")
    except FileNotFoundError:
        report.append(Problem("missing-group", f"group metadata {rel} is missing; "
                                               "plain zarr/xarray cannot open this group", **where))
        return
    except (OSError, ValueError, AttributeError) as e:
        report.append(Problem("missing-group", f"group metadata {rel} is unreadable: {e}", **where))
        return
    if node != "group":
        report.append(Problem("missing-group", f"{rel} is a {node!r} node, not a group", **where))


_CHUNK_BATCH = 64  # chunks read at once: bounded memory on arrays of any size


def _array_of(c: dict) -> str:
    """The array below its prompt's group that holds capture row ``c``: its own (``array_name``), or
    for a grouped module tensor (format 6) the group array its ``path`` names. A ``path`` that does
    not name a group array of the row's own prompt gives a name no array has, so it reads as missing."""
    if c.get("group_index") is None:
        return c["array_name"]
    prefix = f"{ARRAYS_DIR}/{c['run_id']}/{c['prompt_id']}/{TENSOR_GROUPS}/"
    path = c.get("path") or ""
    rest = path[len(prefix):] if path.startswith(prefix) else ""
    if not rest or "/" in rest or rest in (".", ".."):
        return f"{TENSOR_GROUPS}/?"
    return f"{TENSOR_GROUPS}/{rest}"


def _verify_capture(b, c: dict, metas: dict[str, bytes | None], report: VerifyReport, whole: set[str]) -> None:
    from capturestore.arrays import crc_problem
    from capturestore.layout import chunk_keys, key_separator
    from capturestore.store import chunk_objects

    run_id, pid, name = c["run_id"], c["prompt_id"], c["array_name"]
    where = {"run_id": run_id, "prompt_id": pid, "array": name}
    gi = c.get("group_index")
    base = f"{ARRAYS_DIR}/{run_id}/{pid}/{_array_of(c)}"
    raw = metas.get(f"{base}/zarr.json")
    if raw is None:
        report.append(Problem("missing-array", "array is catalogued but missing from arrays.zarr"
                              + ("" if gi is None else f" (its group array {c.get('path')!r})"), **where))
        return
    try:
        meta = json.loads(raw)
        shape = tuple(meta["shape"])
        chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        sep = key_separator(meta)
        attrs = meta.get("attributes", {})
        if gi is not None:
            modules = list(attrs.get("modules") or [])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        report.append(Problem("missing-array", f"array metadata unreadable: {e}", **where))
        return
    own = shape
    if gi is not None:  # a module of a group array [module, step, ...]: its index names it, the rest is its shape
        if not 0 <= gi < len(modules) or modules[gi] != c["module"] or attrs.get("phase") != c["phase"] \
                or len(modules) != (shape[0] if shape else -1):
            report.append(Problem("missing-array", f"group array {c.get('path')} holds no module {c['module']!r} "
                                                   f"({c['phase']}) at index {gi}", **where))
            return
        own = shape[1:]
    if list(own) != list(c["shape"]):
        report.append(Problem("shape-mismatch", f"catalog says shape {c['shape']}, array has {list(own)}", **where))
        return
    if attrs.get("logical_dtype") != c["dtype"] or meta.get("data_type") != c["storage_dtype"]:
        report.append(Problem("dtype-mismatch",
                              f"catalog says {c['dtype']} stored as {c['storage_dtype']}, array has "
                              f"{attrs.get('logical_dtype')} stored as {meta.get('data_type')}", **where))
        return
    report.checked_arrays += 1
    codecs = [x.get("name") for x in meta.get("codecs", [])]
    if not codecs or codecs[-1] == "crc32c":  # the CRC sits in each chunk object: checked without decoding
        # a grouped module's own chunks: one module per chunk along the module axis (write_tensor_group)
        keys = [k for idx, k in chunk_keys(shape, chunks, sep)
                if gi is None or idx[0] * chunks[0] <= gi < (idx[0] + 1) * chunks[0]]
        report.checked_chunks += len(keys)
        for i in range(0, len(keys), _CHUNK_BATCH):
            batch = keys[i:i + _CHUNK_BATCH]
            got = b.read_many([f"{base}/{k}" for k in batch])
            for k in batch:
                why = crc_problem(got[f"{base}/{k}"])
                if why:
                    report.append(Problem("corrupt-chunk", why, chunk=k, **where))
        return
    if base in whole:  # sharded: a group's shards, read whole once for all its modules
        return
    whole.add(base)
    keys = [k for _, k in chunk_keys(shape, chunks, sep)]
    report.checked_chunks += len(keys)
    present = chunk_objects(b, base, sep)  # sharded: each shard's index and inner chunks carry their CRCs
    for k in keys:
        if f"{base}/{k}" not in present:
            report.append(Problem("corrupt-chunk", "chunk file is missing", chunk=k, **where))
    from zarr.core.array import Array, AsyncArray
    from zarr.storage import StorePath

    from capturestore.arrays import read_metadata

    try:
        Array(AsyncArray(metadata=read_metadata(meta), store_path=StorePath(b.zarr_store(base))))[...]
    except Exception as e:  # noqa: BLE001
        report.append(Problem("corrupt-chunk", f"shard unreadable: {' '.join(str(e).split())}", **where))


def _verify_prompt_tokens(b, p: dict, report: VerifyReport) -> None:
    """The tokens array equals the prompts row's token_ids, and prompt_id hashes its prompt part."""
    from capturestore.chunkio import read_region
    from capturestore.layout import key_separator
    from capturestore.writer import prompt_id

    run_id, pid = p["run_id"], p["prompt_id"]
    base = f"{ARRAYS_DIR}/{run_id}/{pid}/tokens"
    meta = json.loads(b.read(f"{base}/zarr.json"))
    shape = tuple(meta["shape"])
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    codecs = [c["name"] for c in meta["codecs"]]

    def fetch(keys: list[str]) -> dict[str, bytes | None]:
        got = b.read_many([f"{base}/{k}" for k in keys])
        return {k: got[f"{base}/{k}"] for k in keys}

    tokens = read_region(None, shape, chunks, np.dtype(meta["data_type"]), (slice(0, shape[0]),),
                         f"run {run_id}, prompt {pid}, array tokens", compressed="blosc" in codecs, fetch=fetch,
                         sep=key_separator(meta))
    want = p.get("token_ids")
    if want is not None and list(tokens) != list(want):
        report.append(Problem("tokens-mismatch", "tokens array differs from the prompts row's token_ids",
                              run_id=run_id, prompt_id=pid, array="tokens"))
        return
    n_prompt = p.get("n_prompt_tokens") or len(tokens)
    if prompt_id(tokens[:n_prompt]) != pid:
        report.append(Problem("tokens-mismatch", f"prompt_id is not the hash of the first {n_prompt} tokens",
                              run_id=run_id, prompt_id=pid, array="tokens"))


def gc(store_or_root: Any, dry_run: bool = False) -> list[str]:
    """Remove arrays, segments and pending objects of uncommitted runs and comparisons whose writer
    is dead, and temp files of dead processes; returns the keys removed. A live writer is never
    touched. Arrays and segments go before their pending object: a gc cut short is resumed."""
    b = _as_backend(store_or_root)
    removed: list[str] = []
    runs, dead, stale = _leftovers(b)
    used = _runs_compared(b) if runs else {}
    for run_id in runs:
        if used is None or run_id in used:  # a committed comparison used it: its marker was lost (verify says so)
            continue
        arrays = f"{ARRAYS_DIR}/{run_id}"
        segs = [r for t in ("prompts", "captures") for r in [f"{TABLES_DIR}/{t}/{run_id}.parquet"] if b.exists(r)]
        lease = [r for r in [f"{PENDING_DIR}/{run_id}.json"] if b.exists(r)]
        if b.exists(arrays) or b.find(arrays):
            removed.append(arrays)
            if not dry_run:
                b.remove_tree(arrays)
        removed += segs + lease
        if not dry_run:
            b.remove(segs)
            b.remove(lease)
    for rel in [s for segs in dead.values() for s in segs] + stale + b.dead_temp_files():
        removed.append(rel)
        if not dry_run:
            b.remove([rel])
    for t in b.listdir(TABLES_DIR):  # sources of merged segments older than the grace
        removed += remove_finished_sources(b, t, grace_seconds(), dry_run=dry_run)
    if removed and not dry_run:  # a table may have lost its last segment: its view goes too
        b.refresh_catalog()
    return removed
