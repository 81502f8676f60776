"""Grouped module tensors (store format 6, ``RunWriter.write_tensor_group``): a prompt's module
tensors of one phase, dtype, step list and shape in one array ``tensor_groups/<phase>_<k>``
[module, step, ...]. The oracle is the layout before it: the same tensors written one array per
module (``write_tensor_steps``, which every store still writes) read back bit for bit alike and
catalogue the same rows but for where they live; plain zarr reads the group without this library."""
import json

import ml_dtypes
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capturestore import Store
from capturestore.integrity import verify
from capturestore.layout import ARRAYS_DIR, FORMAT_FILE, TENSOR_GROUPS
from tests.capturestore.chunks import chunk_files



def _format5(root) -> Store:
    """A store of format 5: what a store made before format 6 is (its writers keep one array per module)."""
    Store.open(root)
    info = json.loads((root / FORMAT_FILE).read_text())
    (root / FORMAT_FILE).write_text(json.dumps({**info, "format_version": 5}))
    return Store.open(root, create=False)


def _tensors(rng, n_modules, n_steps, shape, dtype):
    out = {}
    for i in range(n_modules):
        x = rng.standard_normal((n_steps, *shape)).astype(np.float32)
        out[f"model.layers.{i}.mlp"] = x.astype(dtype)
    return out


def _write_both(tmp_path, tensors, steps, phase="decode", name="s"):
    grouped, flat = Store.open(tmp_path / f"{name}6"), _format5(tmp_path / f"{name}5")
    ids = {}
    for store, how in ((grouped, "group"), (flat, "flat")):
        with store.begin_run("hf", "m", model_hash="h", dtype="float32") as w:
            pid = w.add_prompt([1, 2, 3])
            if how == "group":
                w.write_tensor_group(pid, phase, list(tensors), list(tensors.values()), steps)
            else:
                for m, x in tensors.items():
                    w.write_tensor_steps(pid, m, x, steps, phase=phase,
                                         dims=[f"dim{i}" for i in range(x.ndim - 1)])
        ids[how] = (store, w.run_id, pid)
    return ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_modules=st.integers(1, 5), n_steps=st.integers(1, 6), shape=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), seed=st.integers(0, 2**31 - 1))
def test_group_reads_as_one_array_per_module(tmp_path_factory, n_modules, n_steps, shape, dtype, seed):
    tmp = tmp_path_factory.mktemp("g")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    tensors = _tensors(rng, n_modules, n_steps, shape, np_dtype)
    steps = sorted(rng.choice(100, size=n_steps, replace=False).tolist())
    ids = _write_both(tmp, tensors, steps)
    (gs, grun, gpid), (fs, frun, fpid) = ids["group"], ids["flat"]
    assert gpid == fpid
    for m, x in tensors.items():
        got, want = gs.read_tensor(grun, gpid, m, phase="decode"), fs.read_tensor(frun, fpid, m, phase="decode")
        assert got.dtype == want.dtype == x.dtype and got.shape == x.shape
        assert got.tobytes() == want.tobytes() == x.tobytes()
        for j, s in enumerate(steps):  # one step alone, numpy and torch
            assert gs.read_tensor(grun, gpid, m, step=s).tobytes() == x[j].tobytes()
        t = gs.read_tensor(grun, gpid, m, phase="decode", as_torch=True)
        assert tuple(t.shape) == x.shape and t.view(-1).view(dtype=_int_of(t)).numpy().tobytes() == x.tobytes()
    # several at once (read_tensors, as the modules comparator reads a prompt): every module, and a
    # drawn subset (a span of the group's module axis, read alone), bit for bit as read_tensor
    names = list(tensors)
    for keys in ([(m, "decode") for m in names], [(m, "decode") for m in names if rng.random() < 0.5]):
        got = gs.read_tensors(grun, gpid, keys)
        assert list(got) == keys
        for (m, _), a in got.items():
            assert a.dtype == tensors[m].dtype and a.tobytes() == tensors[m].tobytes()
        assert {k: a.tobytes() for k, a in fs.read_tensors(frun, fpid, keys).items()} == \
            {k: a.tobytes() for k, a in got.items()}
    # the catalogue: the same rows, but for the array they live in and the index there
    g = {r["array_name"]: r for r in gs.captures(grun).to_pylist()}
    f = {r["array_name"]: r for r in fs.captures(frun).to_pylist()}
    assert set(g) == set(f)
    for name, row in f.items():
        other = g[name]
        if row["kind"] != "tensor":
            continue
        i = list(tensors).index(row["module"])
        assert other["group_index"] == i and row["group_index"] is None
        assert other["path"] == f"{ARRAYS_DIR}/{grun}/{gpid}/{TENSOR_GROUPS}/decode_0"
        for col in ("kind", "module", "phase", "steps", "shape", "dimension_names", "chunks", "dtype",
                    "storage_dtype", "codec", "nbytes", "stored_bytes"):
            assert other[col] == row[col], col
    # plain zarr, no capturestore: the group's index i is module i's bits
    arr = zarr.open_array(store=str(gs.root / ARRAYS_DIR), path=f"{grun}/{gpid}/{TENSOR_GROUPS}/decode_0", mode="r")
    assert arr.attrs["modules"] == list(tensors) and arr.attrs["steps"] == steps
    for i, x in enumerate(tensors.values()):
        assert np.asarray(arr[i]).tobytes() == x.tobytes()
    assert verify(gs).ok


def _int_of(t):
    import torch

    return {2: torch.int16, 4: torch.int32}[t.element_size()]


def test_one_chunk_file_per_module_and_no_array_of_its_own(tmp_path):
    rng = np.random.default_rng(0)
    tensors = _tensors(rng, 4, 3, [2, 8], np.float32)
    (gs, grun, gpid), (fs, frun, _) = _write_both(tmp_path, tensors, [0, 1, 2]).values()
    group = gs.root / ARRAYS_DIR / grun / gpid / TENSOR_GROUPS / "decode_0"
    assert len(chunk_files(group)) == 4
    assert not (gs.root / ARRAYS_DIR / grun / gpid / "tensors").exists()
    flat = fs.root / ARRAYS_DIR / frun / gpid / "tensors"
    assert len([d for d in flat.iterdir() if d.is_dir()]) == 4  # the layout before: a group per module
    assert gs.runs().to_pylist()[0]["format_version"] == 6
    assert fs.runs().to_pylist()[0]["format_version"] == 4


def test_verify_names_the_module_whose_chunk_is_damaged(tmp_path):
    rng = np.random.default_rng(1)
    tensors = _tensors(rng, 3, 2, [4], np.float32)
    gs, grun, gpid = _write_both(tmp_path, tensors, [0, 1])["group"]
    group = gs.root / ARRAYS_DIR / grun / gpid / TENSOR_GROUPS / "decode_0"
    victim = [f for f in chunk_files(group) if f.name.split(".")[1] == "1"]
    assert len(victim) == 1
    raw = bytearray(victim[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim[0].write_bytes(bytes(raw))
    report = verify(Store.open(gs.root, create=False))
    bad = [(p.kind, p.array) for p in report]
    assert bad == [("corrupt-chunk", "tensors/model.layers.1.mlp/decode")], report
    (group / "zarr.json").unlink()
    report = verify(Store.open(gs.root, create=False))
    assert sorted((p.kind, p.array) for p in report) == \
        [("missing-array", f"tensors/{m}/decode") for m in tensors]


def test_verify_refuses_a_row_that_names_another_module(tmp_path):
    """A captures row whose index points at another module's slice is no capture of its module."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(2)
    tensors = _tensors(rng, 2, 1, [3], np.float32)
    gs, grun, gpid = _write_both(tmp_path, tensors, [0])["group"]
    seg = gs.root / "tables" / "captures" / f"{grun}.parquet"
    t = pq.read_table(seg)
    rows = t.to_pylist()
    for r in rows:
        if r["group_index"] is not None:
            r["group_index"] = 1 - r["group_index"]
    pq.write_table(type(t).from_pylist(rows, schema=t.schema), seg)
    report = verify(Store.open(gs.root, create=False))
    assert sorted(p.kind for p in report) == ["missing-array", "missing-array"], report
    assert all("holds no module" in p.message for p in report)


def test_bad_groups_are_refused_before_anything_is_written(tmp_path):
    store = Store.open(tmp_path / "s")
    a = np.zeros((2, 3), np.float32)
    with store.begin_run("hf", "m", model_hash="h", dtype="float32") as w:
        pid = w.add_prompt([5, 6])
        with pytest.raises(ValueError, match="disagrees with module a"):
            w.write_tensor_group(pid, "prefill", ["a", "b"], [a, np.zeros((2, 4), np.float32)], [0, 1])
        with pytest.raises(ValueError, match="disagrees with module a"):
            w.write_tensor_group(pid, "prefill", ["a", "b"], [a, a.astype(np.float16)], [0, 1])
        with pytest.raises(ValueError, match="repeat"):
            w.write_tensor_group(pid, "prefill", ["a", "a"], [a, a], [0, 1])
        with pytest.raises(ValueError, match="2 steps for an array of shape"):
            w.write_tensor_group(pid, "prefill", ["a"], [np.zeros((3, 3), np.float32)], [0, 1])
        with pytest.raises(ValueError, match="none repeated"):
            w.write_tensor_group(pid, "prefill", ["a"], [a], [1, 1])
        with pytest.raises(ValueError, match="module name"):
            w.write_tensor_group(pid, "prefill", ["a/b"], [a], [0, 1])
        assert not (store.root / ARRAYS_DIR / w.run_id / pid / TENSOR_GROUPS).exists()
        w.write_tensor_steps(pid, "a", a, [0, 1], phase="prefill")
        with pytest.raises(ValueError, match="already written"):
            w.write_tensor_group(pid, "prefill", ["b", "a"], [a, a], [0, 1])
        w.write_tensor_group(pid, "decode", ["a", "b"], [a, a], [0, 1])
        with pytest.raises(ValueError, match="already written in a tensor group"):
            w.write_tensor_steps(pid, "b", a, [2, 3], phase="decode")
        w.write_tensor_group(pid, "decode", ["c"], [a[:, :1]], [0, 1])  # another shape: the phase's second group
    names = sorted(r["array_name"] for r in store.captures(w.run_id).to_pylist() if r["kind"] == "tensor")
    assert names == ["tensors/a/decode", "tensors/a/prefill", "tensors/b/decode", "tensors/c/decode"]
    assert store.read_tensor(w.run_id, pid, "c", phase="decode").shape == (2, 1)
    assert sorted(p.name for p in (store.root / ARRAYS_DIR / w.run_id / pid / TENSOR_GROUPS).iterdir()) == \
        ["decode_0", "decode_1", "zarr.json"]
    # a module in a group and in its own array, one phase each: read from where each is
    assert store.read_tensor(w.run_id, pid, "a", phase="prefill").tobytes() == a.tobytes()
    assert store.read_tensor(w.run_id, pid, "a", phase="decode").tobytes() == a.tobytes()
    with pytest.raises(ValueError, match=r"several phases \['decode', 'prefill'\]"):
        store.read_tensor(w.run_id, pid, "a")
    with pytest.raises(ValueError, match=r"no phase 'x'; it has \['decode', 'prefill'\]"):
        store.read_tensor(w.run_id, pid, "a", phase="x")
    with pytest.raises(ValueError, match="no tensor for module 'zz'"):
        store.read_tensor(w.run_id, pid, "zz")
    with pytest.raises(ValueError, match="no step 7"):
        store.read_tensor(w.run_id, pid, "b", step=7)
    # several at once from wherever each lies: two groups, one own array, in the order asked
    keys = [("c", "decode"), ("a", "prefill"), ("b", "decode"), ("a", "decode")]
    got = store.read_tensors(w.run_id, pid, keys)
    assert list(got) == keys
    for m, ph in keys:
        assert got[(m, ph)].tobytes() == store.read_tensor(w.run_id, pid, m, phase=ph).tobytes()
    t = store.read_tensors(w.run_id, pid, [("b", "decode")], as_torch=True)[("b", "decode")]
    assert tuple(t.shape) == (2, 3) and t.numpy().tobytes() == a.tobytes()
    with pytest.raises(ValueError, match="no tensor for module 'zz'"):
        store.read_tensors(w.run_id, pid, [("a", "decode"), ("zz", "decode")])
    with pytest.raises(ValueError, match="no phase 'x'"):
        store.read_tensors(w.run_id, pid, [("a", "x")])
    with pytest.raises(ValueError, match="phase None is not a name"):
        store.read_tensors(w.run_id, pid, [("a", None)])


def test_a_comparison_over_a_damaged_group_stops_naming_its_chunk(tmp_path):
    """The modules comparator reads a prompt's groups whole (read_tensors); a damaged chunk still
    stops the comparison with read_tensor's own message, naming the group array and the chunk, and
    stores nothing."""
    from capturestore.analysis import compare_runs
    from capturestore.errors import CorruptChunkError

    store = Store.open(tmp_path / "s")
    rng = np.random.default_rng(4)
    signal = _tensors(rng, 3, 2, [1, 5], np.float32)  # decode steps of [1, hidden]
    runs = []
    for role in ("baseline", "expected", "actual"):
        with store.begin_run("hf", "m", model_hash="h", dtype="float32") as w:
            pid = w.add_prompt([1, 2, 3], continuation=[4, 5])
            noisy = [x * np.float32(1 + 1e-3 * len(runs)) for x in signal.values()]
            w.write_tensor_group(pid, "decode", list(signal), noisy, [0, 1])
        runs.append(w.run_id)
    kw = dict(baseline_run=runs[0], expected_run=runs[1], actual_run=runs[2], logits=False, kv=False,
              comparators=["modules"])
    whole = compare_runs(store, **kw)  # whole, it compares every module's steps
    assert store.sql(f"SELECT count(*) AS n FROM module_metrics WHERE comparison_id = '{whole.comparison_id}'"
                     ).to_pylist() == [{"n": 3 * 2}]
    group = store.root / ARRAYS_DIR / runs[2] / pid / TENSOR_GROUPS / "decode_0"
    victim = [f for f in chunk_files(group) if f.name.split(".")[1] == "1"][0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    fresh = Store.open(store.root, create=False)
    with pytest.raises(CorruptChunkError) as one:
        fresh.read_tensor(runs[2], pid, "model.layers.1.mlp", phase="decode")
    n = len(fresh.sql("SELECT * FROM comparisons").to_pylist())
    with pytest.raises(CorruptChunkError) as e:
        compare_runs(fresh, **kw)
    assert str(e.value) == str(one.value) and "checksum mismatch" in str(e.value)
    assert f"{TENSOR_GROUPS}/decode_0" in str(e.value) and "chunk c.1." in str(e.value)
    assert len(fresh.sql("SELECT * FROM comparisons").to_pylist()) == n


def test_a_store_before_format_6_keeps_one_array_per_module(tmp_path):
    import pyarrow.parquet as pq

    from capturestore.tables import CAPTURES_SCHEMA, SCHEMA_SEGMENT

    store = _format5(tmp_path / "s")
    before = CAPTURES_SCHEMA.remove(CAPTURES_SCHEMA.get_field_index("group_index"))
    pq.write_table(before.empty_table(), tmp_path / "s" / "tables" / "captures" / SCHEMA_SEGMENT)  # as format 5 made it
    # no segment holds the column yet: the view shows it all the same, as in every store of any format
    assert store.sql("SELECT count(group_index) AS g FROM captures").to_pylist() == [{"g": 0}]
    assert store.sql("DESCRIBE captures").column("column_name").to_pylist() == CAPTURES_SCHEMA.names
    assert not store.grouped_tensors
    with store.begin_run("hf", "m", model_hash="h", dtype="float32") as w:
        pid = w.add_prompt([5, 6])
        with pytest.raises(ValueError, match="capturestore upgrade"):
            w.write_tensor_group(pid, "prefill", ["a"], [np.zeros((1, 2), np.float32)], [0])
        w.write_tensor_steps(pid, "a", np.zeros((1, 2), np.float32), [0], phase="prefill")
    assert store.upgrade_format() == (5, 7) and store.grouped_tensors
    again = Store.open(tmp_path / "s", create=False)
    assert again.grouped_tensors
    assert pq.read_schema(tmp_path / "s" / "tables" / "captures" / SCHEMA_SEGMENT).names == CAPTURES_SCHEMA.names
    assert again.sql("SELECT array_name, group_index FROM captures ORDER BY 1").to_pylist() == \
        [{"array_name": "tensors/a/prefill", "group_index": None}, {"array_name": "tokens", "group_index": None}]


@pytest.mark.parametrize("shard", [None, 600])
def test_a_group_on_object_storage_reads_back_per_module(shard):
    """Without a directory zarr writes the chunks; with shards (object storage's default) a shard
    holds several modules' chunks: each module still reads back alone, the catalogue's stored bytes
    add up to the group's objects, and verify reads each shard once."""
    import uuid

    from capturestore.store import chunk_objects

    store = Store.open(f"memory://groups-{uuid.uuid4().hex[:12]}")
    store.shard_bytes = shard  # bytes a shard: 600 holds 2 of these modules' 256-byte chunks
    rng = np.random.default_rng(4)
    tensors = _tensors(rng, 5, 2, [32], np.float32)
    with store.begin_run("hf", "m", model_hash="h", dtype="float32") as w:
        pid = w.add_prompt([1, 2])
        w.write_tensor_group(pid, "decode", list(tensors), list(tensors.values()), [0, 1])
    for m, x in tensors.items():
        assert store.read_tensor(w.run_id, pid, m, phase="decode").tobytes() == x.tobytes()
        assert store.read_tensor(w.run_id, pid, m, step=1).tobytes() == x[1].tobytes()
    rows = [r for r in store.captures(w.run_id).to_pylist() if r["kind"] == "tensor"]
    base = f"{ARRAYS_DIR}/{w.run_id}/{pid}/{TENSOR_GROUPS}/decode_0"
    objects = chunk_objects(store.backend, base, ".")
    assert len(objects) == (3 if shard else 5)
    assert sum(r["stored_bytes"] for r in rows) == sum(objects.values())
    if not shard:  # one object a module: each row its own
        assert sorted(r["stored_bytes"] for r in rows) == sorted(objects.values())
    report = verify(store)
    assert report.ok and report.checked_arrays == 6, report  # 5 modules + tokens
