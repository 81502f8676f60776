"""Bad input raises ValueError naming what and where, and commits nothing partial."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

from capturestore import Store
from capturestore.layout import ARRAYS_DIR


def kv(shape, dtype=ml_dtypes.bfloat16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_non_integer_token_ids_are_refused(store):
    run = store.begin_run(engine="hf", model_path="m")
    with pytest.raises(ValueError, match=f"run {run.run_id}: add_prompt: token ids must be integers, got dtype float64"):
        run.add_prompt([1.0, 2.0])
    with pytest.raises(ValueError, match="token ids must be integers"):
        run.add_prompt(np.array(["a", "b"]))
    with pytest.raises(ValueError, match=r"non-empty 1-d sequence \[token\], got shape \(2, 2\)"):
        run.add_prompt([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*31\)"):
        run.add_prompt([-1, 2])
    assert run.prompt_ids == []
    run.abort()


@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.int32])
def test_unsupported_logits_dtype_names_dtype_run_and_prompt(store, dtype):
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1, 2, 3])
        with pytest.raises(ValueError) as e:
            run.write_logits(pid, np.zeros((3, 8), dtype))
        msg = str(e.value)
        assert run.run_id in msg and pid in msg and np.dtype(dtype).name in msg and "not supported" in msg
        assert not (store.root / ARRAYS_DIR / run.run_id / pid / "logits").exists()  # nothing written
    assert store.captures(run.run_id).column("array_name").to_pylist() == ["tokens"]


def test_float64_hint_says_cast_to_float32(store):
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1])
        with pytest.raises(ValueError, match="cast float64 to float32"):
            run.write_kv(pid, np.zeros((1, 1, 1, 32)), np.zeros((1, 1, 1, 32)))


def test_kv_shape_disagreeing_with_the_run_is_refused_and_nothing_committed(store):
    with pytest.raises(ValueError) as e:
        with store.begin_run(engine="hf", model_path="m") as run:
            a = run.add_prompt([1, 2, 3])
            run.write_kv(a, kv((2, 2, 3, 32)), kv((2, 2, 3, 32)))
            b = run.add_prompt([4, 5])
            run.write_kv(b, kv((2, 4, 2, 32)), kv((2, 4, 2, 32)))  # 4 kv heads where the run holds 2
    msg = str(e.value)
    assert f"run {run.run_id}, prompt {b}" in msg and "kv_head=4" in msg and "kv_head=2" in msg
    # the with-block aborted: nothing of the run is catalogued or left on disk
    assert store.runs().num_rows == 0 and store.captures().num_rows == 0
    assert not (store.root / ARRAYS_DIR / run.run_id).exists()
    assert store.verify().ok


def test_bad_calls_outside_a_with_block_leave_the_run_usable(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2], continuation=[3, 4])
    run.write_logits(pid, np.zeros((2, 10), np.float32))
    other = run.add_prompt([3])
    with pytest.raises(ValueError, match=r"vocab=12\] float32 disagree with what run .* holds \(vocab=10, float32\)"):
        run.write_logits(other, np.zeros((1, 12), np.float32))
    with pytest.raises(ValueError, match="array logits was already written"):
        run.write_logits(pid, np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match=r"k \(1, 1, 2, 32\) and v \(1, 1, 3, 32\) differ in shape"):
        run.write_kv(pid, kv((1, 1, 2, 32)), kv((1, 1, 3, 32)))
    with pytest.raises(ValueError, match=r"k and v must be \[layer, kv_head, seq, head_dim\]"):
        run.write_kv(pid, kv((2, 32)), kv((2, 32)))
    with pytest.raises(ValueError, match="k is bfloat16 but v is float32"):
        run.write_kv(pid, kv((1, 1, 2, 32)), kv((1, 1, 2, 32), np.float32))
    with pytest.raises(ValueError, match="prompt 'nope' was not added to this run"):
        run.write_logits("nope", np.zeros((2, 10), np.float32))
    run.commit()
    caps = store.captures(run.run_id).to_pylist()
    assert sorted((c["prompt_id"], c["array_name"]) for c in caps) == sorted([(pid, "tokens"), (pid, "logits"), (other, "tokens")])
    with pytest.raises(ValueError, match="already committed or aborted"):
        run.add_prompt([7])


def test_streaming_append_with_changed_geometry_is_refused(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1])
    run.append_kv(pid, kv((2, 2, 1, 32)), kv((2, 2, 1, 32)))
    with pytest.raises(ValueError, match=r"step \[layer=3, kv_head=2, head_dim=32\] bfloat16 disagrees .* \[layer=2"):
        run.append_kv(pid, kv((3, 2, 1, 32)), kv((3, 2, 1, 32)))
    with pytest.raises(ValueError, match="not appendable"):
        run2 = run.add_prompt([5])
        run.write_kv(run2, kv((2, 2, 1, 32)), kv((2, 2, 1, 32)))
        run.append_kv(run2, kv((2, 2, 1, 32)), kv((2, 2, 1, 32)))
    run.commit()
    k, _ = store.read_kv(run.run_id, pid)
    assert k.shape == (2, 2, 1, 32)


def test_create_kv_with_unwritten_layers_does_not_commit(store):
    with pytest.raises(ValueError, match=r"layers \[1\] were created with create_kv but never written"):
        with store.begin_run(engine="hf", model_path="m") as run:
            pid = run.add_prompt([1, 2])
            run.create_kv(pid, ["a", "b"], num_kv_heads=1, seq_len=2, head_dim=32, dtype="bfloat16")
            run.write_kv_layer(pid, "a", kv((1, 2, 32)), kv((1, 2, 32)))
    assert store.runs().num_rows == 0


def test_write_kv_layer_checks_layer_and_shape(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2])
    with pytest.raises(ValueError, match="call create_kv for this prompt first"):
        run.write_kv_layer(pid, 0, kv((1, 2, 32)), kv((1, 2, 32)))
    run.create_kv(pid, ["a", "b"], num_kv_heads=1, seq_len=2, head_dim=32, dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown layer; layers are"):
        run.write_kv_layer(pid, "c", kv((1, 2, 32)), kv((1, 2, 32)))
    with pytest.raises(ValueError, match=r"got \[kv_head, seq, head_dim\] \(1, 3, 32\) bfloat16, the run holds \(1, 2, 32\)"):
        run.write_kv_layer(pid, 0, kv((1, 3, 32)), kv((1, 3, 32)))
    with pytest.raises(ValueError, match="dtype float64 is not supported"):
        run.create_kv(run.add_prompt([3, 4]), ["a", "b"], 1, 2, 32, dtype="float64")
    run.abort()
    assert not (store.root / ARRAYS_DIR / run.run_id).exists()


def test_unknown_run_prompt_and_array_on_read(store):
    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1, 2])
    with pytest.raises(ValueError, match="unknown run id 'nope'"):
        store.read_logits("nope", pid)
    with pytest.raises(ValueError, match=f"run {run.run_id} has no prompt 'ffff'"):
        store.read_tokens(run.run_id, "ffff")
    with pytest.raises(ValueError, match=r"has no array 'logits'; it has \['tokens'\]"):
        store.read_logits(run.run_id, pid)
    with pytest.raises(ValueError, match="unknown run id"):
        store.captures("nope")


def test_an_uncommitted_run_is_not_readable(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2])
    with pytest.raises(ValueError, match="unknown run id"):
        store.read_tokens(run.run_id, pid)
    run.commit()
    np.testing.assert_array_equal(store.read_tokens(run.run_id, pid), [1, 2])


def test_bad_run_metadata_and_table_names(store):
    with pytest.raises(ValueError, match="tp_degree must be a positive integer"):
        store.begin_run(engine="hf", model_path="m", tp_degree=0)
    with pytest.raises(ValueError, match="engine must be a non-empty string"):
        store.begin_run(engine="", model_path="m")
    with pytest.raises(ValueError, match="compression must be one of"):
        store.begin_run(engine="hf", model_path="m", compression="gzip")
    with pytest.raises(ValueError, match="config must be JSON-serialisable"):
        store.begin_run(engine="hf", model_path="m", config={"x": object()})
    for label in ("r2\nFAKE overall: PASS", "r2\rx", "r2\x1b[2K", "r2\u2028x"):  # issue 17: it printed a line of its own
        with pytest.raises(ValueError, match=r"begin_run: release .* holds a control character or line break"):
            store.begin_run(engine="hf", model_path="m", release=label)
    store.begin_run(engine="hf", model_path="m", release="v0.32 (rc1) · ünïcode").abort()  # printable: fine
    with pytest.raises(ValueError, match="is written by runs only"):
        store.append_table("runs", [{"a": 1}])
    with pytest.raises(ValueError, match="must be an identifier"):
        store.append_table("bad name;", [{"a": 1}])
    with pytest.raises(ValueError, match="no rows"):
        store.append_table("m", [])
    assert not (store.root / "pending").exists() or list((store.root / "pending").iterdir()) == []
    assert not (store.root / "tables" / "m").exists()


def test_bad_module_names_and_tensor_shape_changes(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2])
    with pytest.raises(ValueError, match="module name '../x'"):
        run.write_tensor(pid, "../x", np.zeros(3, np.float32))
    run.write_tensor(pid, "m.a", np.zeros((2, 3), np.float32), step=0)
    with pytest.raises(ValueError, match=r"shape \(2, 4\) float32 disagrees with earlier steps .*\(2, 3\) float32"):
        run.write_tensor(pid, "m.a", np.zeros((2, 4), np.float32), step=1)
    with pytest.raises(ValueError, match="step 0 was already written"):
        run.write_tensor(pid, "m.a", np.zeros((2, 3), np.float32), step=0)
    run.abort()


# ---------------------------------------------------------------- the documented conventions
# tokens = prompt + continuation; logits: one row per continuation token; KV: one position per
# token (docs/tables.md). Anything else is refused before it is written.


def _arrays_of(store, run, pid):
    d = store.root / ARRAYS_DIR / run.run_id / pid
    return sorted(p.name for p in d.iterdir() if (p / "zarr.json").exists()) if d.is_dir() else []


def test_kv_positions_must_match_the_prompts_tokens(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2, 3], continuation=[4, 5])  # 5 tokens
    for bad in (4, 6):
        with pytest.raises(ValueError, match=rf"run {run.run_id}, prompt {pid}: write_kv: KV seq {bad} but the prompt "
                                             r"holds 5 tokens = prompt 3 \+ continuation 2"):
            run.write_kv(pid, kv((2, 1, bad, 32)), kv((2, 1, bad, 32)))
    with pytest.raises(ValueError, match=r"create_kv: KV seq 7 but the prompt holds 5 tokens"):
        run.create_kv(pid, ["a", "b"], num_kv_heads=1, seq_len=7, head_dim=32, dtype="bfloat16")
    assert _arrays_of(store, run, pid) == ["tokens"]  # nothing of the refused KV was written
    run.append_kv(pid, kv((2, 1, 3, 32)), kv((2, 1, 3, 32)))
    with pytest.raises(ValueError, match=r"append_kv: KV seq 6 so far but the prompt holds 5 tokens"):
        run.append_kv(pid, kv((2, 1, 3, 32)), kv((2, 1, 3, 32)))
    with pytest.raises(ValueError, match=rf"prompt {pid}, array kv_k: commit: KV seq 3 but the prompt holds 5 tokens"):
        run.commit()  # 3 of 5 positions streamed: refused before any table row
    run.abort()
    assert store.runs().num_rows == 0 and not (store.root / ARRAYS_DIR / run.run_id).exists()
    with store.begin_run(engine="hf", model_path="m") as ok:
        pid = ok.add_prompt([1, 2, 3], continuation=[4, 5])
        ok.append_kv(pid, kv((2, 1, 3, 32)), kv((2, 1, 3, 32)))
        ok.append_kv(pid, kv((2, 1, 2, 32)), kv((2, 1, 2, 32)))
    assert store.read_kv(ok.run_id, pid)[0].shape == (2, 1, 5, 32)


def test_logits_rows_must_match_the_continuation(store):
    run = store.begin_run(engine="hf", model_path="m")
    pid = run.add_prompt([1, 2, 3], continuation=[4, 5])
    for rows in (1, 3, 5):
        with pytest.raises(ValueError, match=rf"run {run.run_id}, prompt {pid}: write_logits: {rows} logits rows but the "
                                             r"prompt holds 5 tokens = prompt 3 \+ continuation 2; .*one row per continuation"):
            run.write_logits(pid, np.zeros((rows, 10), np.float32))
    assert _arrays_of(store, run, pid) == ["tokens"]
    no_cont = run.add_prompt([7, 8])
    with pytest.raises(ValueError, match=r"2 logits rows but the prompt holds 2 tokens = prompt 2 \+ continuation 0"):
        run.write_logits(no_cont, np.zeros((2, 10), np.float32))  # prefill logits without their tokens
    run.append_logits(pid, np.zeros((1, 10), np.float32))
    with pytest.raises(ValueError, match=r"append_logits: 3 logits rows so far but .* continuation 2"):
        run.append_logits(pid, np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match=r"array logits: commit: 1 logits rows but .* continuation 2"):
        run.commit()
    run.append_logits(pid, np.zeros(10, np.float32))
    run.commit()
    assert store.read_logits(run.run_id, pid).shape == (2, 10)


def test_token_ids_must_lie_below_the_vocab_once_it_is_known(store):
    run = store.begin_run(engine="hf", model_path="m")
    early = run.add_prompt([1, 2, 30], continuation=[4])  # added before any logits: vocab unknown
    pid = run.add_prompt([1, 2, 3], continuation=[4, 9])
    with pytest.raises(ValueError, match=rf"write_logits: token id 30 at position 2 of prompt {early} is >= the vocab "
                                         r"size 10 \(the logits width\); 1 token\(s\) out of range"):
        run.write_logits(pid, np.zeros((2, 10), np.float32))
    assert _arrays_of(store, run, pid) == ["tokens"]
    run.abort()

    with store.begin_run(engine="hf", model_path="m") as run:
        pid = run.add_prompt([1, 2, 3], continuation=[4, 9])
        run.write_logits(pid, np.zeros((2, 10), np.float32))  # 9 < 10: fine
        with pytest.raises(ValueError, match=r"add_prompt: token id 10 at position 3 of prompt \w+ is >= the vocab size 10"):
            run.add_prompt([5, 6], continuation=[7, 10])
        with pytest.raises(ValueError, match=r"token id 12 at position 0 .* 2 token\(s\) out of range"):
            run.add_prompt([12, 11])
        assert run.prompt_ids == [pid]  # the refused prompts were not added
    assert store.prompts(run.run_id).num_rows == 1
    assert sorted(p.name for p in (store.root / ARRAYS_DIR / run.run_id).iterdir() if p.is_dir()) == [pid]


def test_append_table_refuses_a_column_type_no_reader_can_unify_and_the_table_stays_readable(tmp_path):
    # list then struct in one column: DuckDB's union_by_name cannot read the two segments together,
    # so every query on the table failed once the second segment landed
    store = Store.open(tmp_path / "s")
    store.append_table("t", [{"x": [1, 2], "n": 1}])
    with pytest.raises(ValueError, match=r"column 'x' is struct<a: int64> here but list<.*: int64> in segment t/"):
        store.append_table("t", [{"x": {"a": 1}, "n": 2}])
    assert len(list((tmp_path / "s" / "tables" / "t").glob("*.parquet"))) == 1  # nothing written
    assert Store.open(tmp_path / "s").sql("SELECT count(*) AS n FROM t").to_pylist() == [{"n": 1}]
    # what DuckDB does unify stays allowed: a wider integer, a float, an all-NULL column, a new column
    store.append_table("t", {"x": pa.array([[3]]), "n": pa.array([2], pa.int64())})
    store.append_table("t", [{"x": None, "n": 2.5, "extra": "new"}])
    assert store.sql("SELECT sum(n) AS s, count(extra) AS e FROM t").to_pylist() == [{"s": 5.5, "e": 1}]
