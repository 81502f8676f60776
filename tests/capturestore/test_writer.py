"""RunWriter chunk geometry: which KV chunks a one-shot write gets, and that they round-trip."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from capturestore.layout import ARRAYS_DIR
from tests.capturestore.chunks import chunk_files


def _bf16(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)


# [layer, kv_head, seq, head_dim] bf16 = 2 KiB per token per layer (kv_head 8, head_dim 128):
# 3072 tokens = 6 MiB per layer (<= 8 MiB: one chunk), 4097 tokens = 8 MiB + 2 KiB (too big:
# power-of-two token blocks of 4 MiB / 2 KiB = 2048 tokens, the last one an edge chunk).
@pytest.mark.parametrize("seq, want_tokens", [(3072, 3072), (4096, 4096), (4097, 2048), (5, 5)])
def test_one_shot_kv_layer_up_to_8_mib_is_one_chunk(store, seq, want_tokens):
    rng = np.random.default_rng(seq)
    k = _bf16(rng, (2, 8, seq, 128))
    v = _bf16(rng, (2, 8, seq, 128))
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1] * seq)  # one token per KV position
        run.write_kv(pid, k, v)
    chunks = {r["array_name"]: r["chunks"] for r in store.captures(run.run_id).to_pylist()}
    assert chunks["kv_k"] == chunks["kv_v"] == [1, 8, want_tokens, 128]
    n_files = len(chunk_files(store.root / ARRAYS_DIR / run.run_id / pid / "kv_k"))
    assert n_files == 2 * -(-seq // want_tokens)  # layers x token blocks, every chunk on disk
    rk, rv = store.read_kv(run.run_id, pid)
    assert np.array_equal(rk.view(np.uint16), k.view(np.uint16))
    assert np.array_equal(rv.view(np.uint16), v.view(np.uint16))


def test_chunk_tokens_override_still_wins_over_whole_layer_chunks(store):
    rng = np.random.default_rng(0)
    k = _bf16(rng, (1, 2, 10, 32))
    with store.begin_run(engine="hf", model_path="m", chunk_tokens=4) as run:
        pid = run.add_prompt([1] * 10)  # one token per KV position
        run.write_kv(pid, k, k)
        other = run.add_prompt([2] * 10)
        run.create_kv(other, 1, num_kv_heads=2, seq_len=10, head_dim=32, dtype="bfloat16")
        run.write_kv_layer(other, 0, k[0], k[0])
    rows = store.captures(run.run_id).to_pylist()
    assert {tuple(r["chunks"]) for r in rows if r["kind"] in ("kv_k", "kv_v")} == {(1, 2, 4, 32)}


def test_layer_by_layer_kv_gets_whole_layer_chunks_too(store):
    rng = np.random.default_rng(1)
    k = _bf16(rng, (3, 2, 100, 32))
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1] * 100)  # one token per KV position
        run.create_kv(pid, 3, num_kv_heads=2, seq_len=100, head_dim=32, dtype="bfloat16")
        for layer in (2, 0, 1):
            run.write_kv_layer(pid, layer, k[layer], k[layer])
    (row,) = [r for r in store.captures(run.run_id).to_pylist() if r["array_name"] == "kv_k"]
    assert row["chunks"] == [1, 2, 100, 32]
    rk, _ = store.read_kv(run.run_id, pid)
    assert np.array_equal(rk.view(np.uint16), k.view(np.uint16))


def test_a_failure_after_the_commit_marker_is_in_place_does_not_delete_the_committed_run(store, monkeypatch):
    import capturestore.tables as tables

    real = tables.fsync_path
    runs_dir = store.root / "tables" / "runs"

    def failing_dir_fsync(path):  # the directory fsync that follows the marker's rename
        if str(path) == str(runs_dir):
            raise OSError("simulated fsync failure on the runs directory")
        return real(path)

    monkeypatch.setattr(tables, "fsync_path", failing_dir_fsync)
    k = np.arange(2 * 1 * 5 * 4, dtype=np.float32).reshape(2, 1, 5, 4)
    with pytest.raises(OSError, match="simulated"):
        with store.begin_run(engine="hf", model_path="/m", dtype="float32", durable=True) as run:
            pid = run.add_prompt([1, 2, 3, 4, 5])
            run.write_kv(pid, k, k + 1)
    monkeypatch.setattr(tables, "fsync_path", real)
    from capturestore import Store

    again = Store.open(store.root)
    assert [r["run_id"] for r in again.runs().to_pylist()] == [run.run_id]
    got_k, got_v = again.read_kv(run.run_id, pid)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, k + 1)
    assert again.verify().ok


def test_record_config_adds_what_a_capture_learns_as_it_runs_and_never_rewrites_the_begun_config(store):
    import json

    with store.begin_run(engine="hf", model_path="m", config={"batch_size": "auto"}) as run:
        run.add_prompt([1, 2, 3])
        run.record_config(module_batches=[1, 3])
        with pytest.raises(ValueError, match=rf"^run {run.run_id}: record_config: the run config already has "
                                             r"\['batch_size', 'module_batches'\]$"):
            run.record_config(batch_size=4, module_batches=[4])
        with pytest.raises(ValueError, match=rf"^run {run.run_id}: record_config: entries must be JSON-serialisable"):
            run.record_config(when=object())
    config = json.loads(store.runs().to_pylist()[0]["config"])
    assert config["batch_size"] == "auto" and config["module_batches"] == [1, 3] and "when" not in config
    with pytest.raises(ValueError, match=rf"^run {run.run_id} is already committed or aborted$"):
        run.record_config(later=1)
