"""verify (checksums, catalog-vs-array consistency) and gc (what dead writers left behind).

A writer is alive while it holds the flock on its ``pending/<id>.json``; the kernel drops
the lock when the process dies (SIGKILL included), so liveness needs no pid guessing. Runs
(writer.py) and comparisons (``commit_comparison``) share that protocol: the pending file is
created locked before anything is written, the commit marker (a ``runs`` segment, a
``comparisons`` row) is written last, and the pending file goes after it. What a dead writer
left without a marker is invisible in the views, reported by ``verify`` and removed by ``gc``.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from capturestore.arrays import bad_chunks
from capturestore.layout import ARRAYS_DIR, COMPARISON_ID_PREFIX, PENDING_DIR, TABLES_DIR, TMP_SUFFIX
from capturestore.tables import (
    RUN_TABLES,
    rows_to_table,
    SCHEMA_SEGMENT,
    committed_comparison_ids,
    committed_run_ids,
    comparison_tables,
    segment_comparison_ids,
    segment_files,
    table_dir,
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

    @property
    def ok(self) -> bool:
        return len(self) == 0

    def summary(self) -> str:
        head = f"{self.checked_arrays} arrays, {self.checked_chunks} chunks checked: "
        return head + ("OK" if self.ok else f"{len(self)} problem(s)\n" + "\n".join(str(p) for p in self))


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


class PendingLock:
    """``pending/<id>.json``, created already locked (written under a temp name, locked, renamed),
    so from the moment anyone can see it ``writer_is_alive`` says True until ``release``."""

    def __init__(self, root: Path, writer_id: str, info: dict[str, Any]):
        self.path = root / PENDING_DIR / f"{writer_id}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # locked before anyone can see the file
            os.write(fd, json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(),
                                     "started_at": datetime.now(timezone.utc).isoformat(), **info}).encode())
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
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


def check_comparison_rows(root: Path, table: str, comparison_ids) -> None:
    """Refuse rows of ``table`` whose ``comparison_id`` is NULL or names a comparison that is neither
    committed nor being written (a live pending lock, as ``commit_comparison`` holds): such rows
    would be invisible in every view and removed by ``gc``, i.e. lost."""
    ids = set(comparison_ids)
    if None in ids:
        raise ValueError(f"append_table {table}: a comparison_id is NULL; rows with a comparison_id column belong to "
                         f"a comparison (see docs/tables.md) - name the column otherwise for rows of no comparison")
    open_ids = [c for c in ids if not writer_is_alive(root / PENDING_DIR / f"{c}.json")]
    if open_ids:
        committed = committed_comparison_ids(root) or set()
        orphans = sorted(c for c in open_ids if c not in committed)
        if orphans:
            raise ValueError(f"append_table {table}: comparison_id {orphans[0]!r} is no committed comparison and none is "
                             f"being written; its rows would be invisible and removed by gc (write them through "
                             f"integrity.commit_comparison, or name the column otherwise)")


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
    one leaves rows that verify reports and gc removes.
    """
    if not is_comparison_id(comparison_id):
        raise ValueError(f"comparison id {comparison_id!r} must start with {COMPARISON_ID_PREFIX!r}")
    lock = store._pending_lock(comparison_id, {"comparison_id": comparison_id, "status": "running"})
    written: list = []
    try:
        entries = []
        for name, rows in tables.items():
            data = rows_to_table(rows, f"append_table {name}")
            seg = store.append_table(name, data)
            written.append(seg)
            entries.append(_manifest_entry(store, name, seg, data.num_rows))
        store.append_table("comparisons", with_manifest(rows_to_table(comparisons_rows, "comparisons"), entries))
    except BaseException:
        committed = store._committed_comparison_ids()  # None: unreadable, so the marker may be there
        if written and committed is not None and comparison_id not in committed:
            for seg in written:
                store._remove_written(seg)
            try:  # a table that got its first segment here has none again: its catalog view goes
                store._refresh_catalog()
            except Exception:  # noqa: BLE001 - the next open catches up; the first error is the one to raise
                pass
        raise
    finally:
        lock.release()


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
            t = pq.read_table(pa.BufferReader(store.read_segment("comparisons", name)))
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
    for cid, entries in sorted(checked.items()):
        for e in entries:
            t, seg = e["table"], e["segment"]
            names = names_cache.setdefault(t, set(store.segment_names(t)))
            where = f"comparison {cid}: table {t} segment {seg}"
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
        for seg in sorted(names_cache.setdefault(t, set(store.segment_names(t))) - listed.get(t, set())):
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
    try:
        views = set(store.sql("SELECT table_name FROM information_schema.tables").column(0).to_pylist())
        if "comparisons" not in views or "manifest_tables" not in set(
                store.sql("SELECT column_name FROM (DESCRIBE comparisons)").column(0).to_pylist()):
            return  # a store written before manifests: nothing to check against
        rows = store.sql("SELECT comparison_id, manifest_tables, manifest_segments, manifest_rows, manifest_sha256 "
                         "FROM comparisons WHERE list_contains($ids, comparison_id)", params={"ids": ids}).to_pylist()
        for table in sorted({t for r in rows for t in r["manifest_tables"] or ()}):
            store.sql(f'SELECT count(*) FROM "{table}" WHERE list_contains($ids, comparison_id)', params={"ids": ids})
    except QueryError as e:
        raise StoreError(f"{command}: evidence incomplete: {_guard_message(str(e))}") from None
    for r in rows:
        if r["manifest_tables"] is None:
            continue
        entries = [dict(zip((k for _, k in MANIFEST_FIELDS), e)) for e in
                   zip(*(r[f] for f, _ in MANIFEST_FIELDS))]
        for e in entries:
            if hashlib.sha256(store.read_segment(e["table"], e["segment"])).hexdigest() != e["sha256"]:
                raise StoreError(f"{command}: evidence incomplete: comparison {r['comparison_id']}: table "
                                 f"{e['table']} segment {e['segment']} differs from what the comparison wrote "
                                 f"(SHA-256; run `capturestore verify`)")


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


def _run_is_live(root: Path, run_id: str) -> bool:
    return writer_is_alive(root / PENDING_DIR / f"{run_id}.json")


def _pending_ids(root: Path) -> set[str]:
    pending = root / PENDING_DIR
    return {p.name.removesuffix(".json") for p in pending.iterdir() if p.name.endswith(".json")} if pending.is_dir() else set()


def _uncommitted_runs(root: Path) -> list[str]:
    """Run ids with arrays or segments but no runs segment, whose writer is dead."""
    committed = committed_run_ids(root)
    seen: set[str] = set()
    arrays = root / ARRAYS_DIR
    if arrays.is_dir():
        seen |= {p.name for p in arrays.iterdir() if p.is_dir()}
    for t in ("prompts", "captures"):
        seen |= {p.name.removesuffix(".parquet") for p in segment_files(root, t) if p.name != SCHEMA_SEGMENT}
    seen |= {i for i in _pending_ids(root) if not is_comparison_id(i)}
    out = []
    for run_id in sorted(seen - committed):
        if _run_is_live(root, run_id):
            continue
        if run_id in committed_run_ids(root):  # committed while we looked
            continue
        out.append(run_id)
    return out


def _uncommitted_comparisons(root: Path) -> tuple[dict[str, list[Path]], list[Path]]:
    """({comparison_id: its segments}, pending files) of comparisons without a ``comparisons``
    row whose writer is dead, and pending files of dead comparison writers that did commit.

    A segment counts when every row belongs to such a comparison (compare_runs writes one
    comparison per segment); rows of a live writer are never counted, and nothing counts while
    a ``comparisons`` segment is unreadable (verify reports that segment)."""
    segments: dict[str, list[Path]] = {}
    for t in comparison_tables(root):
        for seg in segment_files(root, t):
            try:
                ids = segment_comparison_ids(seg)
            except Exception:  # noqa: BLE001 - reported as a bad segment
                continue
            if ids and len(ids) == 1:
                segments.setdefault(next(iter(ids)), []).append(seg)
    pending = {i for i in _pending_ids(root) if is_comparison_id(i)}
    committed = committed_comparison_ids(root)
    if committed is None:
        return {}, []
    dead = {}
    for cid in sorted((set(segments) | pending) - committed):
        if writer_is_alive(root / PENDING_DIR / f"{cid}.json"):
            continue
        dead[cid] = segments.get(cid, [])
    committed = committed_comparison_ids(root)  # committed while we looked: not an orphan
    if committed is None:
        return {}, []
    dead = {cid: segs for cid, segs in dead.items() if cid not in committed}
    stale = [root / PENDING_DIR / f"{cid}.json" for cid in sorted(pending) if cid in dead
             or (cid in committed and not writer_is_alive(root / PENDING_DIR / f"{cid}.json"))]
    return dead, stale


_TMP_PID = re.compile(r"\.(\d+)(?:\.[0-9a-f]+)?\.tmp$")


def _dead_temp_files(root: Path) -> list[Path]:
    """Temp files (segments, catalog, pending, format) whose writing process is gone."""
    out = []
    dirs = [root, root / PENDING_DIR]
    tables = root / TABLES_DIR
    if tables.is_dir():
        dirs += [p for p in tables.iterdir() if p.is_dir()]
    for d in dirs:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if not p.name.endswith(TMP_SUFFIX) and not p.name.endswith(".tmp.wal"):
                continue
            m = _TMP_PID.search(p.name.removesuffix(".wal"))
            if m is None or not pid_is_alive(int(m.group(1))):
                out.append(p)
    return out


def verify(root: Path) -> VerifyReport:
    report = VerifyReport()
    committed = committed_run_ids(root)
    # 1. every segment must be readable Parquet
    tables = root / TABLES_DIR
    for tdir in sorted(p for p in tables.iterdir() if p.is_dir()) if tables.is_dir() else []:
        for seg in segment_files(root, tdir.name):
            try:
                pq.read_metadata(seg)
            except Exception as e:  # noqa: BLE001
                run = seg.name.removesuffix(".parquet") if tdir.name in RUN_TABLES else None
                report.append(Problem("bad-segment", f"table {tdir.name} segment {seg.name} is unreadable: {e}", run_id=run))
    # 2. every capture of a committed run: array present, shape as catalogued, every chunk's CRC
    zroot = root / ARRAYS_DIR
    _verify_group(zroot, "", report)
    for run_id in sorted(committed):
        if not _verify_run_marker(root, run_id, report):
            continue
        cap_seg = table_dir(root, "captures") / f"{run_id}.parquet"
        pr_seg = table_dir(root, "prompts") / f"{run_id}.parquet"
        try:
            caps = pq.read_table(cap_seg).to_pylist()
            prompts = pq.read_table(pr_seg).to_pylist()
        except Exception as e:  # noqa: BLE001
            report.append(Problem("bad-segment", f"prompts/captures segment unreadable: {e}", run_id=run_id))
            continue
        have_tokens = {c["prompt_id"] for c in caps if c["array_name"] == "tokens"}
        for p in prompts:
            if p["prompt_id"] not in have_tokens:
                report.append(Problem("missing-tokens", "prompt has no tokens capture", run_id=run_id, prompt_id=p["prompt_id"]))
        n_before = len(report)
        groups = {run_id} | {f"{run_id}/{p['prompt_id']}" for p in prompts}
        for c in caps:  # every group from the run down to each array: plain zarr needs their zarr.json
            parts = f"{run_id}/{c['prompt_id']}/{c['array_name']}".split("/")
            groups |= {"/".join(parts[:i]) for i in range(1, len(parts))}
        for g in sorted(groups):
            _verify_group(zroot, g, report)
        for c in caps:
            _verify_capture(zroot, c, report)
        if len(report) == n_before:  # arrays sound: do the tokens agree with the catalog?
            for p in prompts:
                _verify_prompt_tokens(zroot, p, report)
    # 3. leftovers of dead writers (gc removes them)
    for run_id in _uncommitted_runs(root):
        report.append(Problem("orphan", "uncommitted run left by a dead writer (run `capturestore gc`)", run_id=run_id))
    dead, stale = _uncommitted_comparisons(root)
    for cid, segs in dead.items():
        where = ", ".join(str(s.relative_to(root)) for s in segs) or "no segment"
        report.append(Problem("orphan", f"comparison {cid} never committed (no comparisons row), its writer is "
                                        f"dead; its rows are hidden: {where} (run `capturestore gc`)"))
    for p in stale:
        if p.name.removesuffix(".json") not in dead:
            report.append(Problem("orphan", f"pending file {p.relative_to(root)} of a dead comparison writer "
                                            "(run `capturestore gc`)"))
    for p in _dead_temp_files(root):
        report.append(Problem("orphan", f"temp file {p.relative_to(root)} left by a dead writer (run `capturestore gc`)"))
    # 4. catalog.duckdb holds exactly what rebuild-catalog would write
    from capturestore.catalog import catalog_problems

    try:
        msgs = catalog_problems(root)
    except Exception as e:  # noqa: BLE001 - e.g. no room for the copy it reads: say so, keep the rest
        msgs = [f"catalog.duckdb could not be checked: {e}"]
    for msg in msgs:
        report.append(Problem("catalog", msg))
    return report


def _verify_run_marker(root: Path, run_id: str, report: VerifyReport) -> bool:
    """The runs segment of a run is its commit marker: exactly one complete row naming it."""
    seg = table_dir(root, "runs") / f"{run_id}.parquet"
    try:
        rows = pq.read_table(seg, columns=["run_id", "status"]).to_pylist()
    except Exception:  # noqa: BLE001 - already reported as a bad segment
        return False
    if rows != [{"run_id": run_id, "status": "complete"}]:
        what = "no row" if not rows else f"{len(rows)} rows {[r['run_id'] for r in rows][:3]}"
        report.append(Problem("bad-marker", f"runs segment {seg.name} (the run's commit marker) holds {what}, "
                                            "not one complete row of this run", run_id=run_id))
        return False
    return True


def _verify_group(zroot: Path, path: str, report: VerifyReport) -> None:
    """``arrays.zarr/<path>`` has group metadata; without it plain zarr/xarray cannot open the store."""
    meta = zroot / path / "zarr.json"
    parts = path.split("/") if path else []
    where = {"run_id": parts[0] if parts else None, "prompt_id": parts[1] if len(parts) > 1 else None}
    try:
        node = json.loads(meta.read_text()).get("node_type")
    except FileNotFoundError:
        report.append(Problem("missing-group", f"group metadata {meta.relative_to(zroot.parent)} is missing; "
                                               "plain zarr/xarray cannot open this group", **where))
        return
    except (OSError, ValueError) as e:
        report.append(Problem("missing-group", f"group metadata {meta.relative_to(zroot.parent)} is unreadable: {e}", **where))
        return
    if node != "group":
        report.append(Problem("missing-group", f"{meta.relative_to(zroot.parent)} is a {node!r} node, not a group", **where))


def _verify_capture(zroot: Path, c: dict, report: VerifyReport) -> None:
    run_id, pid, name = c["run_id"], c["prompt_id"], c["array_name"]
    adir = zroot / run_id / pid / name
    meta_path = adir / "zarr.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        report.append(Problem("missing-array", "array is catalogued but missing from arrays.zarr",
                              run_id=run_id, prompt_id=pid, array=name))
        return
    except (OSError, json.JSONDecodeError) as e:
        report.append(Problem("missing-array", f"array metadata unreadable: {e}", run_id=run_id, prompt_id=pid, array=name))
        return
    shape = tuple(meta["shape"])
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    if list(shape) != list(c["shape"]):
        report.append(Problem("shape-mismatch", f"catalog says shape {c['shape']}, array has {list(shape)}",
                              run_id=run_id, prompt_id=pid, array=name))
        return
    attrs = meta.get("attributes", {})
    if attrs.get("logical_dtype") != c["dtype"] or meta.get("data_type") != c["storage_dtype"]:
        report.append(Problem("dtype-mismatch",
                              f"catalog says {c['dtype']} stored as {c['storage_dtype']}, array has "
                              f"{attrs.get('logical_dtype')} stored as {meta.get('data_type')}",
                              run_id=run_id, prompt_id=pid, array=name))
        return
    report.checked_arrays += 1
    from capturestore.layout import chunk_keys

    report.checked_chunks += len(chunk_keys(shape, chunks))
    for key, why in bad_chunks(adir, shape, chunks):
        report.append(Problem("corrupt-chunk", why, run_id=run_id, prompt_id=pid, array=name, chunk=key))


def _verify_prompt_tokens(zroot: Path, p: dict, report: VerifyReport) -> None:
    """The tokens array equals the prompts row's token_ids, and prompt_id hashes its prompt part."""
    from capturestore.chunkio import read_region
    from capturestore.writer import prompt_id

    run_id, pid = p["run_id"], p["prompt_id"]
    adir = zroot / run_id / pid / "tokens"
    meta = json.loads((adir / "zarr.json").read_text())
    shape = tuple(meta["shape"])
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    codecs = [c["name"] for c in meta["codecs"]]
    tokens = read_region(adir, shape, chunks, np.dtype(meta["data_type"]), (slice(0, shape[0]),),
                         f"run {run_id}, prompt {pid}, array tokens", compressed="blosc" in codecs)
    want = p.get("token_ids")
    if want is not None and list(tokens) != list(want):
        report.append(Problem("tokens-mismatch", "tokens array differs from the prompts row's token_ids",
                              run_id=run_id, prompt_id=pid, array="tokens"))
        return
    n_prompt = p.get("n_prompt_tokens") or len(tokens)
    if prompt_id(tokens[:n_prompt]) != pid:
        report.append(Problem("tokens-mismatch", f"prompt_id is not the hash of the first {n_prompt} tokens",
                              run_id=run_id, prompt_id=pid, array="tokens"))


def gc(root: Path, dry_run: bool = False) -> list[str]:
    """Remove arrays, segments and pending files of uncommitted runs and comparisons whose writer
    is dead, and temp files of dead processes. A live writer (lock held) is never touched."""
    removed: list[str] = []
    for run_id in _uncommitted_runs(root):
        targets = [root / ARRAYS_DIR / run_id]
        targets += [table_dir(root, t) / f"{run_id}.parquet" for t in ("prompts", "captures")]
        targets.append(root / PENDING_DIR / f"{run_id}.json")
        for t in targets:
            if t.exists():
                removed.append(str(t.relative_to(root)))
                if not dry_run:
                    shutil.rmtree(t) if t.is_dir() else t.unlink(missing_ok=True)
    # pending files of committed runs whose writer died between commit and cleanup
    committed = committed_run_ids(root)
    pdir = root / PENDING_DIR
    for p in sorted(pdir.iterdir()) if pdir.is_dir() else []:
        rid = p.name.removesuffix(".json")
        if p.name.endswith(".json") and rid in committed and not writer_is_alive(p):
            removed.append(str(p.relative_to(root)))
            if not dry_run:
                p.unlink(missing_ok=True)
    # comparisons without their comparisons row, then their pending files (segments first: a
    # gc killed in between leaves a pending file, not segments without one)
    dead, stale = _uncommitted_comparisons(root)
    for p in [s for segs in dead.values() for s in segs] + stale:
        removed.append(str(p.relative_to(root)))
        if not dry_run:
            p.unlink(missing_ok=True)
    for p in _dead_temp_files(root):
        removed.append(str(p.relative_to(root)))
        if not dry_run:
            p.unlink(missing_ok=True)
    if removed and not dry_run:  # a table may have lost its last segment: its view goes too
        from capturestore.catalog import ensure_catalog_file

        ensure_catalog_file(root)
    return removed
