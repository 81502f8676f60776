"""Module tensors' chunks: today's writer puts a prompt's decode steps of one module into one
chunk (``RunWriter.write_tensor_steps``, ``layout.tensor_chunks``), where the writer before
2026-12 wrote one chunk file per step; stores of both layouts read alike and compare to the same
metrics bit for bit. The old layout is a committed store written by that code
(tests/fixtures/modules_v1_store, tests/fixtures/make_modules_v1_store.py)."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.layout import ARRAYS_DIR, TARGET_CHUNK_BYTES
from extractors.modules import write_prompt_modules

from tests.capturestore.chunks import chunk_files, separator
from tests.fixtures import modules_v1_data as D

FIXTURE = Path(__file__).parents[2] / "tests" / "fixtures" / "modules_v1_store"


def _chunk_files(store, run_id: str, module: str, phase: str) -> list[Path]:
    """The chunk files of one module's phase of every prompt of a run ("/" or "." chunk keys), in its
    own array or, grouped (format 6), its chunks of its prompt's group array (by the module index)."""
    rows = [r for r in store.captures(run_id).to_pylist() if (r["module"], r["phase"]) == (module, phase)]
    out = []
    for r in rows:  # the fixture's store (format 1) has no group_index column
        d, i = Path(store.root) / r["path"], r.get("group_index")
        out += [f for f in chunk_files(d) if i is None or int(f.relative_to(d).as_posix().split(separator(d))[1]) == i]
    return out


def _runs(store) -> dict:
    by_dtype = {}
    for r in sorted(store.runs().to_pylist(), key=lambda r: r["created_at"]):
        by_dtype.setdefault(r["dtype"], []).append(r["run_id"])
    return {"baseline": by_dtype["float32"][0], "expected": by_dtype["bfloat16"][0], "actual": by_dtype["bfloat16"][1]}


@pytest.fixture(scope="module")
def old_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mv1") / "store"
    shutil.copytree(FIXTURE, root)
    (root / "pending").mkdir()  # git keeps no empty directory
    return Store.open(root, create=False)


@pytest.fixture(scope="module")
def new_store(tmp_path_factory):
    """The fixture's data written by today's capture path (extractors.modules.write_prompt_modules)."""
    import torch

    store = Store.open(tmp_path_factory.mktemp("mv2") / "store")
    for role, dtype in D.ROLES.items():
        with store.begin_run("hf", "tiny-model", model_hash="fixture", dtype=dtype,
                             config={"module_order": D.ORDER, "mode": "teacher_forced_stepwise"}) as w:
            for i, (p, c) in enumerate(D.PROMPTS):
                pre, dec = D.module_tensors(role, i)
                as_t = (lambda a: torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)) \
                    if dtype == "bfloat16" else torch.from_numpy
                write_prompt_modules(w, p, c, [(m, 0, as_t(pre[m])) for m in D.ORDER],
                                     {m: [as_t(t) for t in dec[m]] for m in D.ORDER}, None)
    return store


def test_the_fixture_holds_the_old_layout_one_chunk_per_decode_step(old_store):
    runs = _runs(old_store)
    for role, rid in runs.items():
        for m in D.ORDER:
            files = _chunk_files(old_store, rid, m, "decode")
            assert len(files) == len(D.PROMPTS) * D.DECODE_STEPS, (role, m, files)
        meta = json.loads(next((old_store.root / ARRAYS_DIR / rid).glob("*/tensors/lm_head/decode/zarr.json"))
                          .read_text())
        assert meta["chunk_grid"]["configuration"]["chunk_shape"][0] == 1


def test_todays_capture_writes_a_modules_decode_steps_of_a_prompt_as_one_chunk(new_store):
    for role, rid in _runs(new_store).items():
        rows = [r for r in new_store.captures(rid).to_pylist() if r["kind"] == "tensor"]
        shapes = {(r["prompt_id"], r["phase"], tuple(r["shape"])) for r in rows}  # a group array for each
        assert len({r["path"] for r in rows}) == len(shapes) < len(rows)
        for m in D.ORDER:
            assert len(_chunk_files(new_store, rid, m, "decode")) == len(D.PROMPTS), (role, m)
            assert len(_chunk_files(new_store, rid, m, "prefill")) == len(D.PROMPTS), (role, m)


@pytest.mark.parametrize("layout", ["old", "new"])
def test_both_layouts_read_back_bit_exactly(layout, old_store, new_store):
    store = old_store if layout == "old" else new_store
    for role, rid in _runs(store).items():
        for i, (p, _) in enumerate(D.PROMPTS):
            pid = next(r["prompt_id"] for r in store.sql(f"SELECT prompt_id, n_prompt_tokens FROM prompts "
                                                         f"WHERE run_id = '{rid}' AND prompt_idx = {i}").to_pylist())
            pre, dec = D.module_tensors(role, i)
            for m in D.ORDER:
                got_pre = store.read_tensor(rid, pid, m, phase="prefill")
                got_dec = store.read_tensor(rid, pid, m, phase="decode")
                want_dec = np.stack(dec[m])
                assert got_pre.dtype == pre[m].dtype and got_dec.dtype == want_dec.dtype
                assert np.array_equal(got_pre.view(np.uint8), pre[m][None].view(np.uint8))
                assert np.array_equal(got_dec.view(np.uint8), want_dec.view(np.uint8))
                assert np.array_equal(store.read_tensor(rid, pid, m, step=3).view(np.uint8),
                                      dec[m][3].view(np.uint8))


def _rows(store, cid, table, order):
    rows = store.sql(f"SELECT * EXCLUDE (comparison_id) FROM {table} WHERE comparison_id = '{cid}'").to_pylist()
    return sorted(rows, key=lambda r: tuple(str(r[k]) for k in order))


def test_a_comparison_of_either_layout_gives_the_same_metrics_to_the_last_bit(old_store, new_store):
    got = {}
    for name, store in (("old", old_store), ("new", new_store)):
        runs = _runs(store)
        res = compare_runs(store, baseline_run=runs["baseline"], expected_run=runs["expected"],
                           actual_run=runs["actual"], logits=False, kv=False, comparators=["modules"])
        got[name] = (res.passed, _rows(store, res.comparison_id, "module_metrics", ("prompt_id", "module", "phase",
                                                                                     "position")),
                     _rows(store, res.comparison_id, "module_verdicts", ("module", "phase")))
    assert got["old"][1] and got["old"][2]
    assert not got["old"][0]  # the planted lm_head decode fault is found in both
    assert repr(got["old"]) == repr(got["new"])  # repr: NaN == NaN, floats to the last bit


def test_decode_chunks_are_bounded_by_the_target_chunk_size(tmp_path):
    store = Store.open(tmp_path / "s")
    width = TARGET_CHUNK_BYTES // 4 // 3 + 1  # float32: two steps fit in a chunk, a third does not
    steps = np.arange(5 * width, dtype=np.float32).reshape(5, 1, width)
    with store.begin_run("hf", "m", dtype="float32") as w:
        pid = w.add_prompt([1, 2], continuation=[3, 4, 5, 6, 7, 8])
        w.write_tensor_steps(pid, "m.a", steps, range(5), phase="decode")
        w.write_tensor(pid, "m.a", steps[0] + 1, step=5, phase="decode")  # appended after: an unaligned write
    meta = json.loads(next((store.root / ARRAYS_DIR / w.run_id).glob("*/tensors/m.a/decode/zarr.json")).read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [2, 1, width]
    assert meta["attributes"]["steps"] == [0, 1, 2, 3, 4, 5]
    got = store.read_tensor(w.run_id, pid, "m.a", phase="decode")
    assert np.array_equal(got, np.concatenate([steps, steps[:1] + 1]))
    assert store.verify().ok


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_a_named_phase_is_read_without_an_existence_request(tmp_path, monkeypatch, backend):
    """read_tensor(phase=...) reads the phase's zarr.json at once: no ``exists`` first (a stat on a
    disk, a HEAD request on object storage, per tensor of a module compare). A phase or a step
    that is not there still gets its one line naming what the module has."""
    import uuid

    url = str(tmp_path / "s") if backend == "local" else f"memory://chunks-{uuid.uuid4().hex[:12]}"
    store = Store.open(url)
    steps = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    with store.begin_run("hf", "m", dtype="float32") as w:
        pid = w.add_prompt([1, 2], continuation=[3, 4, 5])
        w.write_tensor_steps(pid, "m.a", steps, range(3), phase="decode")
        w.write_tensor(pid, "m.a", steps[0] + 100, step=0, phase="prefill")
    asked = []
    real_exists = type(store.backend).exists
    monkeypatch.setattr(type(store.backend), "exists", lambda self, rel: asked.append(rel) or real_exists(self, rel))
    assert np.array_equal(store.read_tensor(w.run_id, pid, "m.a", phase="decode"), steps)
    assert np.array_equal(store.read_tensor(w.run_id, pid, "m.a", phase="decode", step=2), steps[2])
    assert np.array_equal(store.read_tensor(w.run_id, pid, "m.a", phase="prefill"), (steps[0] + 100)[None])
    assert asked == []
    with pytest.raises(ValueError, match=r"module m.a: no phase 'verify'; it has \['decode', 'prefill'\]"):
        store.read_tensor(w.run_id, pid, "m.a", phase="verify")
    with pytest.raises(ValueError, match=r"module m.a: no step 7 in phases \['decode'\]"):
        store.read_tensor(w.run_id, pid, "m.a", phase="decode", step=7)
    with pytest.raises(ValueError, match=r"has no tensor for module 'm.b'"):
        store.read_tensor(w.run_id, pid, "m.b", phase="decode")
