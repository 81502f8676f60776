"""capturestore.arrays.create_group: a group created in a directory writes its zarr.json itself
(zarr's own creation cost ~3 ms a group, two a prompt); the bytes must be those
zarr.create_group writes, parent groups included."""
import pytest
import zarr

from capturestore.arrays import create_group, open_zarr_store


@pytest.mark.parametrize("attributes", [{}, {"run_id": "20261203T084203-62d18118"}, {"prompt_id": "6b6a3e1a", "n": [1, 2]}])
def test_create_group_writes_the_bytes_zarr_writes(tmp_path, attributes):
    zs = open_zarr_store(tmp_path)
    zarr.create_group(store=zs, path="")
    zarr.create_group(store=zs, path="zarr_made/a/b", attributes=attributes)
    create_group(zs, "ours/a/b", attributes)
    for rel in ("zarr.json", "a/zarr.json", "a/b/zarr.json"):
        assert (tmp_path / "ours" / rel).read_bytes() == (tmp_path / "zarr_made" / rel).read_bytes(), rel
    assert dict(zarr.open_group(store=zs, path="ours/a/b", mode="r").attrs) == attributes


def test_create_group_refuses_a_node_that_exists(tmp_path):
    zs = open_zarr_store(tmp_path)
    create_group(zs, "run", {"run_id": "run"})
    with pytest.raises(FileExistsError):
        create_group(zs, "run", {"run_id": "run"})
