"""capturestore.arrays: an array created in a directory writes its zarr.json itself (zarr's own
creation cost ~10 ms an array); the bytes must be those zarr.create_array writes, for every
storage dtype and codec chain the store uses, and the parent groups zarr would create."""
import numpy as np
import pytest
import zarr

from capturestore.arrays import ArrayRef, compressors_for, create_array, open_zarr_store


@pytest.mark.parametrize("compression", ["lz4", None])
@pytest.mark.parametrize("dtype", ["float32", "float16", "uint16", "uint8", "int32", "int64", "bool"])
def test_create_array_writes_the_bytes_zarr_writes(tmp_path, dtype, compression):
    zs = open_zarr_store(tmp_path)
    zarr.create_group(store=zs, path="run")
    shape, chunks, dims, attrs = (3, 1, 5), (3, 1, 5), ["step", "position", "dim1"], {"steps": [0, 1, 2], "m": "a.b"}
    zarr.create_array(store=zs, name="run/zarr_made/tensors/a.b/decode", shape=shape, dtype=np.dtype(dtype),
                      chunks=chunks, compressors=compressors_for(np.dtype(dtype).itemsize, compression),
                      fill_value=0, dimension_names=dims, attributes=attrs, config={"write_empty_chunks": True})
    arr = create_array(zs, ArrayRef("run", "ours", "tensors/a.b/decode"), shape, np.dtype(dtype), chunks, dims, attrs,
                       compression=compression)
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
