"""Write/read paths of Store and RunWriter on a real store directory."""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

from capturestore import Store, prompt_id
from capturestore.layout import ARRAYS_DIR
from tests.capturestore.chunks import chunk_path


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of an array as unsigned ints of the same width: the bit-exactness oracle."""
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def bf16(rng, shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def test_prompt_id_is_a_hash_of_token_ids_only(store):
    # same tokens => same id, in any container and across runs; different tokens => different id
    assert prompt_id([1, 2, 3]) == prompt_id(np.array([1, 2, 3], np.int64)) == prompt_id(np.array([1, 2, 3], np.uint16))
    assert prompt_id([1, 2, 3]) != prompt_id([1, 2, 3, 0]) != prompt_id([3, 2, 1])
    ids = []
    for _ in range(2):
        with store.begin_run(engine="hf", model_path="m") as run:
            ids.append(run.add_prompt([5, 6, 7], text="x"))
    assert ids[0] == ids[1] == prompt_id([5, 6, 7])
    assert len(store.sql("SELECT DISTINCT prompt_id FROM prompts")) == 1
    assert len(store.runs()) == 2


def test_one_shot_write_reads_back_bit_exact_with_metadata(store):
    rng = np.random.default_rng(1)
    k, v = bf16(rng, (2, 4, 9, 32)), bf16(rng, (2, 4, 9, 32))
    logits = rng.standard_normal((6, 50)).astype(np.float32)  # one row per continuation token
    with store.begin_run(engine="vllm", model_path="/m", model_hash="abc", dtype="bfloat16", device="cpu",
                         engine_version="0.32.0", tp_degree=2, release="r1", config={"a": [1, 2]}) as run:
        pid = run.add_prompt(np.arange(3), text="hello", continuation=np.arange(3, 9))
        run.write_logits(pid, logits)
        run.write_kv(pid, k, v, layer_names=["model.layers.0", "model.layers.1"])
    rid = run.run_id
    np.testing.assert_array_equal(store.read_tokens(rid, pid), np.arange(9, dtype=np.int32))
    assert store.read_tokens(rid, pid).dtype == np.int32
    got = store.read_logits(rid, pid)
    assert got.dtype == np.float32 and np.array_equal(bits(got), bits(logits))
    k2, v2 = store.read_kv(rid, pid)
    assert k2.dtype == ml_dtypes.bfloat16 and k2.shape == (2, 4, 9, 32)
    assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
    k1, v1 = store.read_kv(rid, pid, layers=["model.layers.1"])
    assert np.array_equal(bits(k1), bits(k[1:2])) and np.array_equal(bits(v1), bits(v[1:2]))
    k10, _ = store.read_kv(rid, pid, layers=[1, 0])
    assert np.array_equal(bits(k10), bits(k[[1, 0]]))

    run_row = store.runs().to_pylist()[0]
    assert (run_row["engine"], run_row["engine_version"], run_row["tp_degree"], run_row["release"]) == ("vllm", "0.32.0", 2, "r1")
    assert run_row["status"] == "complete" and run_row["n_prompts"] == 1 and json.loads(run_row["config"]) == {"a": [1, 2]}
    caps = {r["array_name"]: r for r in store.captures(rid).to_pylist()}
    assert set(caps) == {"tokens", "logits", "kv_k", "kv_v"}
    assert caps["kv_k"]["shape"] == [2, 4, 9, 32] and caps["kv_k"]["dtype"] == "bfloat16"
    assert caps["kv_k"]["storage_dtype"] == "uint16" and caps["kv_k"]["nbytes"] == 2 * 4 * 9 * 32 * 2
    assert caps["kv_k"]["dimension_names"] == ["layer", "kv_head", "position", "head_dim"]
    assert caps["kv_k"]["chunks"][0] == 1  # one layer per chunk
    assert caps["kv_k"]["layer_names"] == ["model.layers.0", "model.layers.1"]
    assert caps["logits"]["dimension_names"] == ["gen_token", "vocab"]
    assert store.prompts(rid).to_pylist()[0]["text"] == "hello"


def test_as_torch_returns_the_same_torch_dtype_bit_exact(store):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 5, 32, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 5, 32, generator=g).to(torch.float8_e4m3fn)
    logits = torch.randn(3, 40, generator=g, dtype=torch.float16)  # one row per continuation token
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt(torch.tensor([3, 1]), continuation=torch.tensor([4, 1, 5]))
        run.write_kv(pid, k, k.clone())
        run.write_logits(pid, logits)
        run.write_tensor(pid, "model.layers.0.self_attn.k_proj", v[0])
    kk, vv = store.read_kv(run.run_id, pid, as_torch=True)
    assert kk.dtype == torch.bfloat16 and torch.equal(kk.view(torch.int16), k.view(torch.int16))
    lg = store.read_logits(run.run_id, pid, as_torch=True)
    assert lg.dtype == torch.float16 and torch.equal(lg.view(torch.int16), logits.view(torch.int16))
    t = store.read_tensor(run.run_id, pid, "model.layers.0.self_attn.k_proj", step=0, as_torch=True)
    assert t.dtype == torch.float8_e4m3fn and torch.equal(t.view(torch.uint8), v[0].view(torch.uint8))
    # numpy path gives the ml_dtypes dtype with the same bits
    tn = store.read_tensor(run.run_id, pid, "model.layers.0.self_attn.k_proj", step=0)
    assert tn.dtype == ml_dtypes.float8_e4m3fn and np.array_equal(bits(tn), v[0].view(torch.uint8).numpy())


def test_e4m3_round_trips_in_numpy_and_refuses_torch_with_a_reason(store):
    x = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3).reshape(1, 1, 8, 32)  # every bit pattern
    with store.begin_run(engine="sim", model_path="m") as run:
        pid = run.add_prompt([1] * 8)
        run.write_kv(pid, x, x)
    k, _ = store.read_kv(run.run_id, pid)
    assert k.dtype == ml_dtypes.float8_e4m3 and np.array_equal(bits(k), bits(x))
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="float8_e4m3 has no torch equivalent"):
        store.read_kv(run.run_id, pid, as_torch=True)


@pytest.mark.parametrize("chunk_tokens", [None, 1, 3, 8])
def test_streaming_append_equals_one_shot_write(store, chunk_tokens):
    rng = np.random.default_rng(2)
    k, v = bf16(rng, (3, 2, 21, 32)), bf16(rng, (3, 2, 21, 32))
    logits = rng.standard_normal((20, 30)).astype(np.float32)  # one row per continuation token
    steps = [0, 1, 2, 5, 6, 13, 21]  # uneven step sizes, including 1-token and many-token steps
    with store.begin_run(engine="hf", model_path="m", chunk_tokens=chunk_tokens) as run:
        one = run.add_prompt([1], continuation=[2] * 20)  # 21 tokens: one per KV position
        run.write_kv(one, k, v)
        run.write_logits(one, logits)
        streamed = run.add_prompt([3], continuation=[2] * 20)  # the last logits slice ends at row 20
        for a, b in zip(steps[:-1], steps[1:]):
            if b - a == 1:  # single decode step in its squeezed form
                run.append_kv(streamed, k[:, :, a], v[:, :, a])
                run.append_logits(streamed, logits[a])
            else:
                run.append_kv(streamed, k[:, :, a:b], v[:, :, a:b])
                run.append_logits(streamed, logits[a:b])
    for pid in (one, streamed):
        k2, v2 = store.read_kv(run.run_id, pid)
        assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
        assert np.array_equal(bits(store.read_logits(run.run_id, pid)), bits(logits))
    assert store.verify().ok


def test_layer_by_layer_write_equals_one_shot(store):
    rng = np.random.default_rng(3)
    k, v = bf16(rng, (4, 2, 7, 32)), bf16(rng, (4, 2, 7, 32))
    names = [f"model.layers.{i}" for i in range(4)]
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([9] * 7)  # one token per KV position
        run.create_kv(pid, names, num_kv_heads=2, seq_len=7, head_dim=32, dtype="bfloat16")
        for i in (2, 0, 3):
            run.write_kv_layer(pid, i, k[i], v[i])
        run.write_kv_layer(pid, "model.layers.1", k[1], v[1])
    k2, v2 = store.read_kv(run.run_id, pid)
    assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))


def test_kv_groups_hold_layers_of_different_shapes(store):
    rng = np.random.default_rng(4)
    full, sliding = bf16(rng, (2, 4, 6, 32)), bf16(rng, (1, 2, 6, 64))
    with store.begin_run(engine="vllm", model_path="m") as run:
        pid = run.add_prompt([1, 2, 3, 4, 5, 6])  # one token per KV position
        run.write_kv(pid, full, full, layer_names=["l0", "l2"])
        run.write_kv(pid, sliding, sliding, layer_names=["l1"], group="sliding")
    assert np.array_equal(bits(store.read_kv(run.run_id, pid)[0]), bits(full))
    assert np.array_equal(bits(store.read_kv(run.run_id, pid, group="sliding")[1]), bits(sliding))


def test_module_tensors_by_step_and_phase(store):
    rng = np.random.default_rng(5)
    prefill = rng.standard_normal((6, 16)).astype(np.float32)
    decode = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(3)]
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1, 2, 3, 4, 5, 6])
        run.write_tensor(pid, "model.layers.0.mlp", prefill, step=0, phase="prefill")
        for s, d in enumerate(decode, start=1):
            run.write_tensor(pid, "model.layers.0.mlp", d, step=s, phase="decode")
    rid = run.run_id
    np.testing.assert_array_equal(store.read_tensor(rid, pid, "model.layers.0.mlp", step=0), prefill)
    np.testing.assert_array_equal(store.read_tensor(rid, pid, "model.layers.0.mlp", step=2), decode[1])
    np.testing.assert_array_equal(store.read_tensor(rid, pid, "model.layers.0.mlp", phase="decode"), np.stack(decode))
    with pytest.raises(ValueError, match="several phases"):
        store.read_tensor(rid, pid, "model.layers.0.mlp")
    row = store.sql("SELECT steps, phase FROM captures WHERE module = 'model.layers.0.mlp' AND phase = 'decode'").to_pylist()
    assert row == [{"steps": [1, 2, 3], "phase": "decode"}]


def test_append_table_segments_union_by_name_in_sql(store):
    store.append_table("kv_head_metrics", [{"comparison": "c1", "layer": 0, "k_linf": 0.5}])
    store.append_table("kv_head_metrics", pa.table({"comparison": ["c2", "c2"], "layer": [0, 1], "k_linf": [0.25, 1.0],
                                                   "k_bc": [0.9, 0.8]}))
    t = store.sql("SELECT comparison, layer, k_linf, k_bc FROM kv_head_metrics ORDER BY comparison, layer").to_pylist()
    assert t == [{"comparison": "c1", "layer": 0, "k_linf": 0.5, "k_bc": None},
                 {"comparison": "c2", "layer": 0, "k_linf": 0.25, "k_bc": 0.9},
                 {"comparison": "c2", "layer": 1, "k_linf": 1.0, "k_bc": 0.8}]
    assert len(list((store.root / "tables" / "kv_head_metrics").glob("*.parquet"))) == 2


def test_catalog_file_opens_in_plain_duckdb_and_is_rebuilt_from_segments_alone(store):
    import duckdb

    with store.begin_run(engine="hf", model_path="m") as run:
        run.add_prompt([1, 2, 3])
    store.append_table("logit_token_metrics", [{"run_id": run.run_id, "gen_token_idx": 0, "top5": 0.1}])
    (store.root / "catalog.duckdb").unlink()
    (store.root / "catalog.stamp").unlink()
    store.rebuild_catalog()
    con = duckdb.connect(str(store.root / "catalog.duckdb"), read_only=True)
    try:
        assert con.sql("SELECT count(*) FROM runs").fetchall() == [(1,)]
        assert con.sql("SELECT prompt_id FROM prompts").fetchall() == [(prompt_id([1, 2, 3]),)]
        assert con.sql("SELECT top5 FROM logit_token_metrics").fetchall() == [(0.1,)]
    finally:
        con.close()


def test_empty_store_has_queryable_views(store):
    for t in ("runs", "prompts", "captures"):
        assert store.sql(f"SELECT count(*) AS n FROM {t}").to_pylist() == [{"n": 0}]
    assert store.runs().num_rows == 0
    assert "run_id" in store.captures().column_names


def test_reopening_sees_runs_committed_by_another_store_object(tmp_path):
    a = Store.open(tmp_path / "s")
    b = Store.open(tmp_path / "s", create=False)
    with a.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([4, 2])
    np.testing.assert_array_equal(b.read_tokens(run.run_id, pid), [4, 2])


def test_xarray_opens_a_prompt_group_with_named_dims(store):
    xr = pytest.importorskip("xarray")
    rng = np.random.default_rng(6)
    k = bf16(rng, (2, 2, 5, 32))
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1, 2], continuation=[3, 4, 5])
        run.write_kv(pid, k, k)
        run.write_logits(pid, rng.standard_normal((3, 11)).astype(np.float32))
    ds = xr.open_zarr(store.root / ARRAYS_DIR / run.run_id / pid, consolidated=False, zarr_format=3)
    assert ds["kv_k"].dims == ("layer", "kv_head", "position", "head_dim") and ds["tokens"].dims == ("position",)
    assert ds["logits"].dims == ("gen_token", "vocab")
    assert ds["kv_k"].attrs["logical_dtype"] == "bfloat16"
    assert np.array_equal(ds["kv_k"].values, bits(k))  # bf16 bits; view with the logical dtype
    decoded = store.open_xarray(run.run_id, pid)
    assert decoded["kv_k"].dtype == ml_dtypes.bfloat16 and decoded["kv_k"].dims == ("layer", "kv_head", "position", "head_dim")
    assert np.array_equal(bits(decoded["kv_k"].values), bits(k))
    assert decoded["logits"].dtype == np.float32


@pytest.mark.parametrize("compression", ["lz4", None])
def test_chunks_written_by_the_fast_path_read_back_through_zarr_python(store, compression):
    """chunkio writes chunk files itself; zarr must decode them to the same bits (edge chunks
    padded, streamed arrays, layer-by-layer writes)."""
    import zarr

    rng = np.random.default_rng(7)
    k = bf16(rng, (2, 3, 13, 32))
    logits = rng.standard_normal((12, 13)).astype(np.float32)  # one row per continuation token, vocab > ids
    with store.begin_run(engine="hf", model_path="m", chunk_tokens=4, compression=compression) as run:
        pid = run.add_prompt(np.arange(1), continuation=np.arange(1, 13))
        run.write_kv(pid, k, k)
        for t in range(12):
            run.append_logits(pid, logits[t])
        other = run.add_prompt([1] * 13)
        run.create_kv(other, 2, num_kv_heads=3, seq_len=13, head_dim=32, dtype="bfloat16")
        run.write_kv_layer(other, 1, k[1], k[1])
        run.write_kv_layer(other, 0, k[0], k[0])
    zroot = zarr.storage.LocalStore(str(store.root / ARRAYS_DIR))
    for p, name, want in ((pid, "kv_k", bits(k)), (pid, "logits", bits(logits)), (other, "kv_v", bits(k)),
                          (pid, "tokens", np.arange(13, dtype=np.int32))):
        arr = zarr.open_array(store=zroot, path=f"{run.run_id}/{p}/{name}", mode="r")
        assert np.array_equal(np.ascontiguousarray(arr[...]).view(want.dtype), want), name
        assert [c["name"] for c in arr.metadata.to_dict()["codecs"]] == (
            ["bytes", "blosc", "crc32c"] if compression else ["bytes", "crc32c"])
    k2, _ = store.read_kv(run.run_id, other)
    assert np.array_equal(bits(k2), bits(k))
    codecs = set(store.captures(run.run_id).column("codec").to_pylist())
    assert codecs == {"blosc-lz4-bitshuffle-clevel5+crc32c" if compression else "crc32c"}


def test_durable_commit_and_pending_runs(store):
    run = store.begin_run(engine="hf", model_path="m", durable=True)
    pid = run.add_prompt([1, 2])
    pend = store.pending()
    assert [(p["run_id"], p["alive"], p["pid"]) for p in pend] == [(run.run_id, True, os.getpid())]
    run.commit()
    assert store.pending() == []
    np.testing.assert_array_equal(store.read_tokens(run.run_id, pid), [1, 2])


def test_continuation_is_stored_after_the_prompt_but_not_hashed(store):
    ids = {}
    for cont in ([7, 8], [9]):
        with store.begin_run(engine="hf", model_path="m") as run:
            pid = run.add_prompt([1, 2, 3], continuation=cont)
            with pytest.raises(ValueError, match="already added with another continuation"):
                run.add_prompt([1, 2, 3], continuation=[0])
        ids[run.run_id] = pid
        np.testing.assert_array_equal(store.read_tokens(run.run_id, pid), [1, 2, 3, *cont])
    assert set(ids.values()) == {prompt_id([1, 2, 3])}
    rows = store.sql("SELECT n_tokens, n_prompt_tokens FROM prompts ORDER BY n_tokens").to_pylist()
    assert rows == [{"n_tokens": 4, "n_prompt_tokens": 3}, {"n_tokens": 5, "n_prompt_tokens": 3}]


def test_streamed_kv_staging_is_bounded_for_deep_models(store):
    from capturestore.writer import STREAM_BUFFER_BYTES

    L, H, D = 80, 8, 128  # 320 KiB of K+V per token: 1 MiB chunks would stage 160 MiB
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1])
        step = np.ones((L, H, 1, D), ml_dtypes.bfloat16)
        run.append_kv(pid, step, step)
        staged = sum(st.buffer.data.nbytes for st in run._arrays.values() if st.buffer is not None)
        assert staged <= STREAM_BUFFER_BYTES
    (chunks,) = store.sql("SELECT chunks FROM captures WHERE array_name = 'kv_k'").column("chunks").to_pylist()
    assert chunks == [1, H, 128, D]  # 2 * 80 * 8 * 128 * 2 B * 128 tokens = 40 MiB staged


def test_store_pickles_by_path(store):
    import pickle

    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([3, 4])
    other = pickle.loads(pickle.dumps(store))
    assert other.root == store.root
    np.testing.assert_array_equal(other.read_tokens(run.run_id, pid), [3, 4])


def test_token_slices_read_only_what_they_ask_for(store):
    rng = np.random.default_rng(8)
    k = bf16(rng, (3, 2, 20, 32))
    logits = rng.standard_normal((19, 9)).astype(np.float32)  # one row per continuation token
    with store.begin_run(engine="hf", model_path="m", chunk_tokens=4) as run:
        pid = run.add_prompt([1], continuation=[1] * 19)
        run.write_kv(pid, k, k)
        run.write_logits(pid, logits)
    k2, _ = store.read_kv(run.run_id, pid, tokens=slice(5, 13))
    assert np.array_equal(bits(k2), bits(k[:, :, 5:13]))
    k3, _ = store.read_kv(run.run_id, pid, layers=[2], tokens=(18, 20))
    assert np.array_equal(bits(k3), bits(k[2:3, :, 18:20]))
    assert np.array_equal(store.read_logits(run.run_id, pid, tokens=slice(-3, None)), logits[-3:])
    # a corrupt chunk outside the slice does not stop it
    chunk_path(store.root / ARRAYS_DIR / run.run_id / pid / "kv_k", 0, 0, 0, 0).write_bytes(b"garbage!")
    k4, _ = store.read_kv(run.run_id, pid, tokens=slice(4, 8))
    assert np.array_equal(bits(k4), bits(k[:, :, 4:8]))
    with pytest.raises(ValueError, match="step-1 slice"):
        store.read_logits(run.run_id, pid, tokens=slice(0, 10, 2))


def test_show_of_a_run_whose_commit_marker_holds_no_row_names_the_file(store):
    # a runs segment emptied behind the store's back (the issue-8 COPY attack, a bad copy): the run
    # is "committed" by its file name, but has no row to show; show said IndexError with a traceback
    import pyarrow.parquet as pq

    from capturestore.errors import StoreError
    from capturestore.tables import RUNS_SCHEMA

    with store.begin_run(engine="hf", model_path="/m", dtype="float32") as run:
        run.add_prompt([1, 2, 3])
    marker = store.root / "tables" / "runs" / f"{run.run_id}.parquet"
    pq.write_table(RUNS_SCHEMA.empty_table(), marker)
    with pytest.raises(StoreError) as e:
        Store.open(store.root, create=False).show(run.run_id)
    msg = str(e.value)
    assert run.run_id in msg and str(marker) in msg and "verify" in msg and "\n" not in msg, msg


def test_remove_run_uncommits_and_deletes_a_run_but_never_one_a_comparison_uses(store):
    """``capturestore run`` rolls back the runs a failed invocation committed with it (issue 17)."""
    from capturestore.analysis import compare_runs
    from capturestore.errors import StoreError

    rng = np.random.default_rng(0)

    def run():
        with store.begin_run(engine="hf", model_path="m", model_hash="h", dtype="float32") as w:
            w.write_logits(w.add_prompt([1, 2, 3], continuation=[4, 5]), rng.standard_normal((2, 16)).astype(np.float32))
        return w.run_id

    exp, act, extra = run(), run(), run()
    cid = compare_runs(store, expected_run=exp, actual_run=act, kv=False).comparison_id
    for rid in (exp, act):
        with pytest.raises(StoreError, match=rf"run {rid} is used by comparison\(s\) {cid}; it stays"):
            store.remove_run(rid)
    store.remove_run(extra)
    assert {r["run_id"] for r in store.runs().to_pylist()} == {exp, act}
    assert store.sql(f"SELECT count(*) AS n FROM prompts WHERE run_id = '{extra}'").to_pylist()[0]["n"] == 0
    assert not (store.root / ARRAYS_DIR / extra).exists()
    assert not any((store.root / "tables" / t / f"{extra}.parquet").exists() for t in ("runs", "prompts", "captures"))
    with pytest.raises(StoreError, match="is not a committed run"):
        store.remove_run(extra)
    report = store.verify()
    assert report.ok, report.summary()
    assert Store.open(store.root).sql("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == 2


def test_open_that_raced_a_finished_creation_opens_the_store_it_made(tmp_path, monkeypatch):
    """A creation that found no format file, while another process finished creating the store
    before the listing: the format file then in the directory is not a stranger's file (it was
    refused as "a non-empty directory"), and the store opens with the format that process wrote."""
    import capturestore.store as store_mod

    Store.open(tmp_path / "s")  # the other process, done
    (tmp_path / "s" / "capturestore.json").write_text('{"format": "capturestore", "format_version": 2}')
    real, calls = store_mod._read_format, []

    def first_read_missed(b):
        calls.append(b)
        return None if len(calls) == 1 else real(b)

    monkeypatch.setattr(store_mod, "_read_format", first_read_missed)
    store = Store.open(tmp_path / "s")
    assert len(calls) == 2 and store._chunk_separator == "/"  # the format it found: 2 keeps "/" keys
    assert (tmp_path / "s" / "capturestore.json").read_text() == '{"format": "capturestore", "format_version": 2}'
