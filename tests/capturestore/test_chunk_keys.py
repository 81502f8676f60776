"""Chunk key separators (store format 4): a new store writes Zarr v3 "." keys (``c.0.1``, a file
beside the array's zarr.json), a store of an earlier version keeps "/" keys (``c/0/1``, a directory
per leading chunk index), and every reader takes each array's separator from its zarr.json, so one
store may hold both and reads, verifies and refuses damage alike in either."""
from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
import zarr

from capturestore import CorruptChunkError, FormatVersionError, Store
from capturestore.layout import ARRAYS_DIR, FORMAT_FILE
from tests.capturestore.chunks import chunk_files, chunk_name, chunk_path


def _at_version(root, version: int) -> Store:
    """The store at ``root`` (made if absent) with its format file saying ``version``, reopened."""
    Store.open(root)
    (root / FORMAT_FILE).write_text(json.dumps({"format": "capturestore", "format_version": version}))
    return Store.open(root, create=False)


def _capture(store: Store, seed: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((3, 2, 24, 32)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((3, 2, 24, 32)).astype(ml_dtypes.bfloat16)
    logits = rng.standard_normal((8, 50)).astype(np.float32)
    steps = rng.standard_normal((5, 1, 16)).astype(np.float32)
    with store.begin_run(engine="hf", model_path="m", chunk_tokens=8) as run:  # 3 token chunks a layer
        pid = run.add_prompt(list(range(16)), continuation=list(range(8)))
        run.write_kv(pid, k, v)
        run.write_logits(pid, logits)
        run.write_tensor_steps(pid, "model.norm", steps, list(range(5)))
    return run.run_id, pid, (k, v, logits, steps)


def _reads_back(store: Store, rid: str, pid: str, want, plain_zarr: bool = True) -> None:
    k, v, logits, steps = want
    rk, rv = store.read_kv(rid, pid)
    assert rk.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()
    assert rv.view(np.uint16).tobytes() == v.view(np.uint16).tobytes()
    assert store.read_logits(rid, pid).tobytes() == logits.tobytes()
    assert store.read_tensor(rid, pid, "model.norm", phase="decode").tobytes() == steps.tobytes()
    if not plain_zarr:  # a bucket or memory: no directory for zarr to open
        return
    # plain zarr reads the same bits through the separator its zarr.json names
    plain = zarr.open_array(store=str(store.root / ARRAYS_DIR), path=f"{rid}/{pid}/kv_k", mode="r")[...]
    assert plain.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()


def test_a_new_store_writes_dot_keys_an_older_one_keeps_slash_keys_and_one_store_reads_both(tmp_path):
    root = tmp_path / "s"
    old = _at_version(root, 2)
    rid2, pid2, want2 = _capture(old, 2)
    kv2 = root / ARRAYS_DIR / rid2 / pid2 / "kv_k"
    assert (kv2 / "c").is_dir() and chunk_name(kv2, 1, 0, 2, 0) == "c/1/0/2/0"
    assert json.loads((root / FORMAT_FILE).read_text())["format_version"] == 2  # writing never bumps it
    assert old.runs().column("format_version").to_pylist() == [2]

    new = _at_version(root, 4)  # what Store.open(create=True) writes now
    rid4, pid4, want4 = _capture(new, 4)
    kv4 = root / ARRAYS_DIR / rid4 / pid4 / "kv_k"
    assert chunk_name(kv4, 1, 0, 2, 0) == "c.1.0.2.0" and not [p for p in kv4.iterdir() if p.is_dir()]
    assert len(chunk_files(kv4)) == len(chunk_files(kv2)) == 9  # 3 layers x 3 token chunks, every one on disk
    runs = {r["run_id"]: r["format_version"] for r in new.runs().to_pylist()}
    assert runs == {rid2: 2, rid4: 4}
    fresh = Store.open(root, create=False)
    _reads_back(fresh, rid2, pid2, want2)
    _reads_back(fresh, rid4, pid4, want4)
    assert not list(fresh.verify())
    # stored_bytes: the chunk files on disk, in either layout
    for r in fresh.captures().to_pylist():
        assert r["stored_bytes"] == sum(f.stat().st_size for f in chunk_files(root / r["path"])) > 0, r


def test_directories_made_for_a_capture_drop_to_one_per_array(tmp_path, mkdirs):
    """The point of "." keys: a chunk index level is no longer a directory."""
    made = {}
    for version in (2, 4):
        store = _at_version(tmp_path / f"s{version}", version)
        mkdirs.clear()
        _capture(store, 0)
        made[version] = [m for m in mkdirs if ARRAYS_DIR in m]
    assert not [m for m in made[4] if re.search(r"/c(/|$)", m)]
    assert len([m for m in made[2] if re.search(r"/c(/|$)", m)]) >= 10  # kv_k, kv_v, logits, tokens, module's c/...
    assert len(made[4]) < len(made[2]) / 2, (len(made[4]), len(made[2]))


@pytest.mark.parametrize("version", [2, 4])
def test_a_flipped_byte_and_a_missing_chunk_are_named_in_either_layout(tmp_path, version):
    store = _at_version(tmp_path / "s", version)
    rid, pid, _ = _capture(store, 1)
    adir = store.root / ARRAYS_DIR / rid / pid / "kv_v"
    flipped = chunk_name(adir, 1, 0, 2, 0)
    data = bytearray(chunk_path(adir, 1, 0, 2, 0).read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk_path(adir, 1, 0, 2, 0).write_bytes(bytes(data))
    kdir = store.root / ARRAYS_DIR / rid / pid / "kv_k"
    gone = chunk_name(kdir, 2, 0, 1, 0)
    chunk_path(kdir, 2, 0, 1, 0).unlink()

    report = Store.open(store.root, create=False).verify()
    assert sorted((p.kind, p.array, p.chunk) for p in report) == [("corrupt-chunk", "kv_k", gone),
                                                                   ("corrupt-chunk", "kv_v", flipped)]
    with pytest.raises(CorruptChunkError, match=f"chunk {re.escape(gone)}: chunk file is missing"):
        store.read_kv(rid, pid, layers=[2])  # never the fill value's zeros
    with pytest.raises(CorruptChunkError, match=f"chunk {re.escape(flipped)}: checksum mismatch"):
        store.read_kv(rid, pid, layers=[1])
    k0, _ = store.read_kv(rid, pid, layers=[0])  # the layer left alone still reads
    assert k0.shape == (1, 2, 24, 32)


def test_a_capturestore_that_reads_up_to_format_3_refuses_a_dot_key_store(tmp_path, monkeypatch):
    from capturestore import store as store_mod

    Store.open(tmp_path / "s")
    monkeypatch.setattr(store_mod, "READABLE_FORMAT_VERSION", 3)  # the capturestore before "." keys
    with pytest.raises(FormatVersionError, match="format version 7, newer than the 3 this capturestore reads"):
        Store.open(tmp_path / "s", create=False)


def test_an_array_naming_another_chunk_key_encoding_is_refused_by_name(tmp_path):
    store = Store.open(tmp_path / "s")
    rid, pid, _ = _capture(store, 3)
    meta_path = store.root / ARRAYS_DIR / rid / pid / "logits" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["chunk_key_encoding"] = {"name": "v2", "configuration": {"separator": "."}}
    meta_path.write_text(json.dumps(meta))
    fresh = Store.open(store.root, create=False)
    with pytest.raises(CorruptChunkError, match=f"run {rid}, prompt {pid}, array logits: chunk key encoding"):
        fresh.read_logits(rid, pid)
    assert [(p.kind, p.array) for p in fresh.verify()] == [("missing-array", "logits")]


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_store_on_object_storage_writes_and_reads_dot_keys(where, request):
    url = "memory://dot-keys" if where == "memory" else request.getfixturevalue("s3_url")
    store = Store.open(url)
    rid, pid, want = _capture(store, 5)
    keys = store.backend.find(f"{ARRAYS_DIR}/{rid}/{pid}/kv_k")
    names = sorted(k.rsplit("/", 1)[-1] for k in keys)
    assert "zarr.json" in names and all(n == "zarr.json" or n.startswith("c.") for n in names), names
    fresh = Store.open(url, create=False)
    _reads_back(fresh, rid, pid, want, plain_zarr=False)
    assert not list(fresh.verify())


def test_upgrade_raises_an_older_store_to_dot_keys_for_new_runs_and_the_old_runs_read_as_before(tmp_path, capsys):
    from capturestore.cli import main

    root = tmp_path / "s"
    old = _at_version(root, 3)
    rid3, pid3, want3 = _capture(old, 3)
    assert main(["upgrade", "--store", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"store {root}: format 3 -> 7;" in out and "older than format 7 no longer opens" in out, out
    assert '"." chunk keys' in out and "name each column list once" in out and "tensor_groups/" in out, out
    assert "binary row hash alone" in out, out
    assert json.loads((root / FORMAT_FILE).read_text()) == {"format": "capturestore", "format_version": 7}
    new = Store.open(root, create=False)
    rid4, pid4, want4 = _capture(new, 4)
    assert chunk_name(root / ARRAYS_DIR / rid4 / pid4 / "kv_k", 0, 0, 0, 0) == "c.0.0.0.0"
    assert chunk_name(root / ARRAYS_DIR / rid3 / pid3 / "kv_k", 0, 0, 0, 0) == "c/0/0/0/0"
    _reads_back(new, rid3, pid3, want3)
    _reads_back(new, rid4, pid4, want4)
    assert not list(new.verify())
    # the store object that upgraded writes "." keys from then on too
    assert old.upgrade_format() == (7, 7) and old._chunk_separator == "."
    assert main(["upgrade", "--store", str(root)]) == 0
    assert capsys.readouterr().out.strip() == f"store {root} is format 7: nothing to do"
