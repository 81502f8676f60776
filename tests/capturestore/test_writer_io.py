"""RunWriter file I/O on a directory store: what a capture costs in system calls (each directory
made once) and what the catalogue records from it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from capturestore import Store
from capturestore.layout import FORMAT_FILE
from extractors.modules import write_prompt_modules
from tests.capturestore.chunks import chunk_files


def _module_prompt(rng, modules=("model.embed_tokens", "model.layers.0", "model.layers.0.mlp", "lm_head"), steps=4):
    prefill = [(m, 0, rng.standard_normal((5, 8), dtype=np.float32)) for m in modules]
    import torch

    decode = {m: [torch.from_numpy(rng.standard_normal((1, 8), dtype=np.float32)) for _ in range(steps)]
              for m in modules}
    return prefill, decode, rng.standard_normal((steps + 1, 16), dtype=np.float32)


def test_a_module_runs_directories_are_each_made_once(store, mkdirs):
    made = mkdirs
    rng = np.random.default_rng(0)
    with store.begin_run(engine="hf", model_path="m", dtype="float32") as run:
        for p in range(2):
            prefill, decode, logits = _module_prompt(rng)
            write_prompt_modules(run, [1 + p, 2, 3, 4, 5], [6, 7, 8, 9, 10], prefill, decode, logits)
    twice = sorted({d for d in made if made.count(d) > 1})
    assert not twice, f"made more than once: {twice}"
    assert len(store.captures(run.run_id)) == 2 * (2 + 2 * 4)  # tokens, logits, 4 modules x 2 phases


def test_stored_bytes_are_the_chunk_files_on_disk_whichever_way_they_were_written(store):
    # one-shot (kept by the writer), appended (queued on the pool) and unaligned (through zarr) writes
    rng = np.random.default_rng(1)
    with store.begin_run(engine="hf", model_path="m", dtype="float32") as run:
        pid = run.add_prompt(list(range(1, 11)), continuation=[11, 12, 13, 14, 15, 16])
        k = rng.standard_normal((2, 1, 16, 8), dtype=np.float32)
        run.write_kv(pid, k, k)
        for n in range(6):
            run.append_logits(pid, rng.standard_normal(32, dtype=np.float32))
        for step in range(3):
            run.write_tensor(pid, "m.a", rng.standard_normal((1, 8), dtype=np.float32), step=step, phase="decode")
        run.write_tensor_steps(pid, "m.b", rng.standard_normal((3, 1, 8), dtype=np.float32), [0, 1, 2])
        run.write_tensor_steps(pid, "m.b", rng.standard_normal((1, 1, 8), dtype=np.float32), [3])  # chunk-aligned
        run.write_tensor_steps(pid, "m.b", rng.standard_normal((1, 1, 8), dtype=np.float32), [4])  # inside chunk 1: zarr
    assert run._arrays[(pid, "tensors/m.b/decode")].chunk_bytes is None  # so the store was asked
    rows = store.captures(run.run_id).to_pylist()
    assert len(rows) == 6
    for r in rows:
        on_disk = sum(f.stat().st_size for f in chunk_files(store.root / r["path"]))
        assert r["stored_bytes"] == on_disk > 0, r["array_name"]


@pytest.mark.parametrize("where", ["dir", "memory"])
def test_module_arrays_written_whole_are_parked_and_still_take_appended_steps(tmp_path, where):
    """A module run's writer keeps no open zarr.Array of an array written whole (each holds its
    metadata and codec objects, ~3 KB: ~150 module arrays a prompt made a run's memory grow ~0.4 MiB
    a prompt); the catalogue's shape and chunks are the array's, and a step appended later
    reopens it and lands where a never-parked array's would."""
    url = tmp_path / "s" if where == "dir" else f"memory://parked-{tmp_path.name}"
    store = Store.open(url)  # then made format 5, whose module runs write an array per module and phase
    store.backend.put(FORMAT_FILE, json.dumps({"format": "capturestore", "format_version": 5}).encode())
    store = Store.open(url, create=False)
    assert not store.grouped_tensors
    rng = np.random.default_rng(2)
    with store.begin_run(engine="hf", model_path="m", dtype="float32") as run:
        for p in range(2):
            prefill, decode, logits = _module_prompt(rng)
            write_prompt_modules(run, [1 + p, 2, 3, 4, 5], [6, 7, 8, 9, 10], prefill, decode, logits)
        tensors = {k: st for k, st in run._arrays.items() if st.kind == "tensor"}
        assert len(tensors) == 2 * 4 * 2 and all(st.live is None for st in tensors.values())
        pid, name = next(k for k in tensors if k[1].endswith("/decode"))
        module = name.split("/")[1]
        extra = rng.standard_normal((1, 8), dtype=np.float32)
        run.write_tensor(pid, module, extra, step=4, phase="decode")
        assert run._arrays[(pid, name)].live is not None  # reopened for the append
    got = store.read_tensor(run.run_id, pid, module, phase="decode")
    assert got.shape == (5, 1, 8) and np.array_equal(got[4], extra)
    rows = {(r["prompt_id"], r["array_name"]): r for r in store.captures(run.run_id).to_pylist()}
    for (p, n), st in tensors.items():
        meta = store.read_tensor(run.run_id, p, n.split("/")[1], phase=n.split("/")[2])
        assert rows[(p, n)]["shape"] == list(meta.shape), (p, n)
    assert rows[(pid, name)]["steps"] == [0, 1, 2, 3, 4]
    assert store.verify().ok


@pytest.mark.parametrize("where", ["dir", "memory"])
def test_grouped_module_arrays_are_parked_and_refuse_appended_steps(tmp_path, where):
    """Format 6: a module run's group arrays (``write_tensor_group``) are parked as they are written
    too, and a step appended to a module of a group is refused, naming it, before anything is written."""
    store = Store.open(tmp_path / "s" if where == "dir" else f"memory://grouped-{tmp_path.name}")
    rng = np.random.default_rng(3)
    with store.begin_run(engine="hf", model_path="m", dtype="float32") as run:
        for p in range(2):
            prefill, decode, logits = _module_prompt(rng)
            write_prompt_modules(run, [1 + p, 2, 3, 4, 5], [6, 7, 8, 9, 10], prefill, decode, logits)
        groups = {k: st for k, st in run._arrays.items() if st.kind == "tensor_group"}
        assert groups and all(st.live is None for st in groups.values())
        assert sum(len(st.modules) for st in groups.values()) == 2 * 4 * 2
        pid, module = next((k[0], m) for k, st in groups.items() if st.phase == "decode" for m in st.modules)
        with pytest.raises(ValueError, match=f"module {module} \\(decode\\) was already written in a tensor group"):
            run.write_tensor(pid, module, rng.standard_normal((1, 8), dtype=np.float32), step=4, phase="decode")
    assert store.read_tensor(run.run_id, pid, module, phase="decode").shape == (4, 1, 8)
    assert store.verify().ok
