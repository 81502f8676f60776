"""capturestore.chunkio.MadeDirs: a writer makes each directory of its arrays once, and still
writes a file whose directory another writer (gc, an abort) removed behind its back."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import zarr

from capturestore.arrays import ArrayRef, create_array
from capturestore.chunkio import MadeDirs, write_block


def test_each_directory_is_made_once_however_many_files_go_into_it(tmp_path, mkdirs):
    dirs = MadeDirs(tmp_path)
    for name in ("a/b/c/x", "a/b/c/y", "a/b/z", "a/d/w"):
        os.close(dirs.open(str(tmp_path / name), os.O_WRONLY | os.O_CREAT))
    assert sorted(mkdirs) == sorted(str(tmp_path / d) for d in ("a", "a/b", "a/b/c", "a/d"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "a/b/c/x", "a/b/c/y", "a/b/z", "a/d/w"]


def test_a_directory_removed_behind_its_back_is_made_again(tmp_path):
    dirs = MadeDirs(tmp_path)
    os.close(dirs.open(str(tmp_path / "run/p/x"), os.O_WRONLY | os.O_CREAT))
    dirs.groups.add(str(tmp_path / "run"))
    shutil.rmtree(tmp_path / "run")  # another writer's gc, say
    os.close(dirs.open(str(tmp_path / "run/p/y"), os.O_WRONLY | os.O_CREAT))
    assert (tmp_path / "run/p/y").is_file()
    assert dirs.groups == set()  # nothing it knew is trusted any more
    os.close(dirs.open(str(tmp_path / "run/q/z"), os.O_WRONLY | os.O_CREAT))  # and the rest is made again too
    assert (tmp_path / "run/q/z").is_file()


def test_an_arrays_directories_are_made_once_and_its_chunks_read_back_through_zarr(tmp_path, mkdirs):
    zs = zarr.storage.LocalStore(str(tmp_path))
    dirs = MadeDirs(tmp_path)
    create_array(zs, ArrayRef("run", "p", "x"), (6, 4), np.dtype("float32"), (2, 4), ["a", "b"], {}, dirs=dirs)
    assert mkdirs == [str(tmp_path / d) for d in ("run", "run/p", "run/p/x")]
    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    assert write_block(tmp_path / "run/p/x", (6, 4), (2, 4), data, (0, 0), dirs=dirs)
    assert mkdirs[3:] == [str(tmp_path / d) for d in ("run/p/x/c", "run/p/x/c/0", "run/p/x/c/1", "run/p/x/c/2")]
    assert np.array_equal(zarr.open_array(store=zs, path="run/p/x", mode="r")[:], data)


def test_a_group_removed_behind_its_back_gets_its_zarr_json_again(tmp_path):
    zs = zarr.storage.LocalStore(str(tmp_path))
    dirs = MadeDirs(tmp_path)
    create_array(zs, ArrayRef("run", "p", "tensors/a/prefill"), (1, 2), np.dtype("float32"), (1, 2), ["s", "d"], {},
                 dirs=dirs)
    shutil.rmtree(tmp_path / "run/p/tensors")
    create_array(zs, ArrayRef("run", "p", "tensors/a/decode"), (1, 2), np.dtype("float32"), (1, 2), ["s", "d"], {},
                 dirs=dirs)
    assert (tmp_path / "run/p/tensors/zarr.json").is_file() and (tmp_path / "run/p/tensors/a/zarr.json").is_file()
    assert zarr.open_array(store=zs, path="run/p/tensors/a/decode", mode="r").shape == (1, 2)
