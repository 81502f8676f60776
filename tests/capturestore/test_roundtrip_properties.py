"""Property tests: every bit pattern of every supported dtype survives the store, for any shape,
chunking and way of writing (one shot, streamed in uneven steps, layer by layer)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from capturestore import Store
from capturestore.dtypes import FLOAT_DTYPES, LOGICAL_DTYPES

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    return Store.open(tmp_path_factory.mktemp("prop") / "store")


def _as_dtype(raw_bits: np.ndarray, name: str) -> np.ndarray:
    return raw_bits.view(LOGICAL_DTYPES[name].numpy)


@st.composite
def kv_cases(draw):
    """(dtype name, k bits, v bits, chunk_tokens, step sizes): any bit patterns, NaN/inf included."""
    name = draw(st.sampled_from(FLOAT_DTYPES))
    itemsize = LOGICAL_DTYPES[name].numpy.itemsize
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 17)), draw(st.sampled_from([1, 8, 32])))
    raw = hnp.arrays(np.dtype(f"u{itemsize}"), shape, elements=st.integers(0, 2 ** (8 * itemsize) - 1))
    k, v = draw(raw), draw(raw)
    chunk = draw(st.one_of(st.none(), st.integers(1, 9)))
    steps = draw(st.lists(st.integers(1, 5), min_size=1, max_size=8))
    compression = draw(st.sampled_from(["lz4", None]))
    return name, k, v, chunk, steps, compression


@SETTINGS
@given(case=kv_cases())
def test_kv_round_trips_bit_exact_for_every_write_path(shared_store, case):
    name, kb, vb, chunk, steps, compression = case
    k, v = _as_dtype(kb, name), _as_dtype(vb, name)
    L, H, S, D = k.shape
    with shared_store.begin_run(engine="prop", model_path="m", chunk_tokens=chunk, compression=compression) as run:
        one = run.add_prompt([1] * S)  # one token per KV position
        run.write_kv(one, k, v)
        streamed = run.add_prompt([2] * S)
        t = 0
        for n in steps * (S // sum(steps) + 1):  # repeat the step pattern until seq is covered
            if t >= S:
                break
            run.append_kv(streamed, k[:, :, t : t + n], v[:, :, t : t + n])
            t += n
        layered = run.add_prompt([3] * S)
        run.create_kv(layered, L, num_kv_heads=H, seq_len=S, head_dim=D, dtype=name)
        for i in reversed(range(L)):
            run.write_kv_layer(layered, i, k[i], v[i])
    for pid in (one, streamed, layered):
        k2, v2 = shared_store.read_kv(run.run_id, pid)
        assert k2.dtype == k.dtype and k2.shape == k.shape
        assert np.array_equal(k2.view(kb.dtype), kb) and np.array_equal(v2.view(vb.dtype), vb)


@SETTINGS
@given(
    name=st.sampled_from(FLOAT_DTYPES),
    gen=st.integers(1, 20),
    vocab=st.integers(1, 70),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    split=st.integers(1, 6),
    data=st.data(),
)
def test_logits_round_trip_bit_exact_one_shot_and_streamed(shared_store, name, gen, vocab, chunk, split, data):
    itemsize = LOGICAL_DTYPES[name].numpy.itemsize
    raw = data.draw(hnp.arrays(np.dtype(f"u{itemsize}"), (gen, vocab), elements=st.integers(0, 2 ** (8 * itemsize) - 1)))
    logits = _as_dtype(raw, name)
    with shared_store.begin_run(engine="prop", model_path="m", chunk_tokens=chunk) as run:
        a = run.add_prompt([0], continuation=[0] * gen)  # one logits row per continuation token
        run.write_logits(a, logits)
        b = run.add_prompt([0, 0], continuation=[0] * gen)
        for t in range(0, gen, split):
            run.append_logits(b, logits[t : t + split])
    for pid in (a, b):
        got = shared_store.read_logits(run.run_id, pid)
        assert got.dtype == logits.dtype and np.array_equal(got.view(raw.dtype), raw)


@SETTINGS
@given(
    name=st.sampled_from(sorted(LOGICAL_DTYPES)),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=6),
    nsteps=st.integers(1, 3),
    data=st.data(),
)
def test_module_tensors_round_trip_for_every_dtype(shared_store, name, shape, nsteps, data):
    ld = LOGICAL_DTYPES[name]
    if ld.numpy == np.bool_:
        arrays = [data.draw(hnp.arrays(np.bool_, shape)) for _ in range(nsteps)]
    else:
        arrays = [data.draw(hnp.arrays(ld.storage, shape)).view(ld.numpy) for _ in range(nsteps)]
    with shared_store.begin_run(engine="prop", model_path="m") as run:
        pid = run.add_prompt([1])
        for s, a in enumerate(arrays):
            run.write_tensor(pid, "model.x", a, step=10 + s)
    for s, a in enumerate(arrays):
        got = shared_store.read_tensor(run.run_id, pid, "model.x", step=10 + s)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(a).view(np.uint8))


def test_float_dtypes_cover_the_issue_list():
    assert {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3"} <= set(FLOAT_DTYPES)
    assert LOGICAL_DTYPES["float8_e4m3"].numpy == np.dtype(ml_dtypes.float8_e4m3)
