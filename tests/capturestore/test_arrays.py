"""capturestore.arrays: an array created in a directory writes its zarr.json itself (zarr's own
creation cost ~10 ms an array); the bytes must be those zarr.create_array writes, for every
storage dtype and codec chain the store uses, and the parent groups zarr would create."""
import json
import re
import struct

import crc32c
import ml_dtypes
import numpy as np
import pytest
import zarr

from capturestore.arrays import ArrayRef, compressors_for, create_array, open_zarr_store
from tests.capturestore.chunks import chunk_files, chunk_name


@pytest.mark.parametrize("sep", ["/", "."])
@pytest.mark.parametrize("compression", ["lz4", None])
@pytest.mark.parametrize("dtype", ["float32", "float16", "uint16", "uint8", "int32", "int64", "bool"])
def test_create_array_writes_the_bytes_zarr_writes(tmp_path, dtype, compression, sep):
    zs = open_zarr_store(tmp_path)
    zarr.create_group(store=zs, path="run")
    shape, chunks, dims, attrs = (3, 1, 5), (3, 1, 5), ["step", "position", "dim1"], {"steps": [0, 1, 2], "m": "a.b"}
    zarr.create_array(store=zs, name="run/zarr_made/tensors/a.b/decode", shape=shape, dtype=np.dtype(dtype),
                      chunks=chunks, compressors=compressors_for(np.dtype(dtype).itemsize, compression),
                      fill_value=0, dimension_names=dims, attributes=attrs, config={"write_empty_chunks": True},
                      chunk_key_encoding={"name": "default", "separator": sep})
    arr = create_array(zs, ArrayRef("run", "ours", "tensors/a.b/decode"), shape, np.dtype(dtype), chunks, dims, attrs,
                       compression=compression, separator=sep)
    for rel in ("zarr.json", "tensors/zarr.json", "tensors/a.b/zarr.json", "tensors/a.b/decode/zarr.json"):
        assert (tmp_path / "run/ours" / rel).read_bytes() == (tmp_path / "run/zarr_made" / rel).read_bytes(), rel
    assert arr.shape == shape and arr.chunks == chunks
    arr.resize((4, 1, 5))  # through zarr from here on
    arr[:] = np.ones((4, 1, 5), dtype)
    back = zarr.open_array(store=zs, path="run/ours/tensors/a.b/decode", mode="r")
    assert back.shape == (4, 1, 5) and (back[:] == 1).all() and back.attrs["steps"] == [0, 1, 2]


def test_create_array_refuses_an_array_that_exists(tmp_path):
    zs = open_zarr_store(tmp_path)
    ref = ArrayRef("run", "p", "tokens")
    create_array(zs, ref, (2,), np.dtype("int32"), (2,), ["position"], {})
    with pytest.raises(FileExistsError):
        create_array(zs, ref, (2,), np.dtype("int32"), (2,), ["position"], {})


def _shard_parts(shard: bytes, n_inner: int) -> list[bytes]:
    """The inner chunks' stored bytes (frame + CRC32C) of a shard whose index is at its end."""
    index = np.frombuffer(shard[-(16 * n_inner + 4):-4], "<u8").reshape(n_inner, 2)  # (offset, nbytes)
    return [shard[o:o + n] for o, n in index]


def _shard_of(parts: list[bytes]) -> bytes:
    """A shard of these inner chunks in order, its index and the index's CRC32C after them."""
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
    index = np.stack([offsets, [len(p) for p in parts]], axis=1).astype("<u8").tobytes()
    return b"".join(parts) + index + struct.pack("<I", crc32c.crc32c(index))


def test_a_sharded_arrays_cut_short_blosc_frame_is_refused_by_read_and_verify(tmp_path):
    """A sharded array is read through zarr, which gives blosc an inner chunk's frame with no
    length, as chunkio did before 6927ba3: a frame cut short under a valid CRC (a writer's bug, not
    a flipped bit) read on into the next chunk's bytes. Read and verify must refuse it by name."""
    from numcodecs import Blosc
    from zarr.core.array import Array, AsyncArray
    from zarr.storage import StorePath

    from capturestore import Store
    from capturestore.errors import CorruptChunkError

    store = Store.open(tmp_path / "s")
    store.shard_bytes = 1 << 20  # as on object storage: arrays written whole go into shards
    rng = np.random.default_rng(7)
    k = rng.standard_normal((3, 2, 24, 32)).astype(ml_dtypes.bfloat16)
    with store.begin_run(engine="test", model_path="m") as run:
        pid = run.add_prompt(list(range(16)), continuation=list(range(8)))
        run.write_kv(pid, k, k)
    base = tmp_path / "s/arrays.zarr" / run.run_id / pid / "kv_k"
    meta = json.loads((base / "zarr.json").read_bytes())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    inner = tuple(meta["codecs"][0]["configuration"]["chunk_shape"])
    shards = chunk_files(base)
    n_inner = int(np.prod(meta["chunk_grid"]["configuration"]["chunk_shape"]) // np.prod(inner))
    shard = chunk_name(base, 0, 0, 0, 0)
    assert [p.relative_to(base).as_posix() for p in shards] == [shard] and n_inner == 3, (shards, inner)
    got_k, got_v = store.read_kv(run.run_id, pid)  # written by zarr, shard and index, not as chunk files
    assert got_k.view(np.uint16).tobytes() == got_v.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()
    parts = _shard_parts(shards[0].read_bytes(), n_inner)
    raw = Blosc().decode(parts[0][:-4])
    memcpyd = Blosc(cname="lz4", clevel=0).encode(raw)  # a frame blosc copies as it is
    assert struct.unpack_from("<I", memcpyd, 12)[0] == len(memcpyd) and len(raw) == np.prod(inner) * 2
    cut = memcpyd[:-64]
    shards[0].write_bytes(_shard_of([cut + struct.pack("<I", crc32c.crc32c(cut))] + parts[1:]))

    # the fault is real: zarr with its own blosc codec reads the cut frame without a word
    plain = Array(AsyncArray(metadata=meta, store_path=StorePath(open_zarr_store(tmp_path / "s/arrays.zarr"),
                                                                 f"{run.run_id}/{pid}/kv_k")))[...]
    assert not np.array_equal(plain, k.view(np.uint16))
    assert np.array_equal(plain.reshape(-1)[:len(raw) // 2 - 32], k.view(np.uint16).reshape(-1)[:len(raw) // 2 - 32])

    fresh = Store.open(tmp_path / "s", create=False)
    with pytest.raises(CorruptChunkError, match=rf"run {run.run_id}, prompt {pid}, array kv_k, shard {re.escape(shard)}: "
                                                rf"blosc frame says it is {len(memcpyd)} bytes long, the chunk holds "
                                                rf"{len(cut)} before its checksum"):
        fresh.read_kv(run.run_id, pid)
    report = fresh.verify()
    assert [(p.kind, p.array) for p in report] == [("corrupt-chunk", "kv_k")], report.summary()
    assert "blosc frame says it is" in list(report)[0].message


@pytest.mark.parametrize("dtype", ["float32", "uint16", "uint8", "int32", "bool"])
@pytest.mark.parametrize("shape", [(5, 7), (8, 8), (1, 3), (9, 2)])
def test_checked_blosc_reads_every_valid_sharded_array_as_zarr_does(tmp_path, dtype, shape):
    """The frame check refuses no valid frame: shards and inner chunks cut by the array's edges
    (zarr pads an edge chunk to its full shape), compressible and incompressible data, every
    storage dtype, read through ``read_metadata`` equal to what was written."""
    from zarr.core.array import Array, AsyncArray
    from zarr.storage import StorePath

    from capturestore.arrays import CheckedBloscCodec, read_metadata

    rng = np.random.default_rng(list(shape))
    x = (rng.integers(0, 2 ** 31, shape) % (2 if dtype == "bool" else 2 ** 31)).astype(dtype)
    x[0] = 0  # a compressible row beside random ones
    zs = open_zarr_store(tmp_path)
    zarr.create_array(store=zs, name="a", shape=shape, dtype=np.dtype(dtype), chunks=(2, 3), shards=(4, 6),
                      compressors=compressors_for(np.dtype(dtype).itemsize), fill_value=0)[...] = x
    meta = read_metadata(json.loads((tmp_path / "a/zarr.json").read_bytes()))
    assert [type(c) for c in meta.codecs[0].codecs][1] is CheckedBloscCodec
    got = Array(AsyncArray(metadata=meta, store_path=StorePath(zs, "a")))[...]
    assert got.dtype == x.dtype and np.array_equal(got, x)
