"""capturestore.chunkio: a writer makes each directory of its arrays once (MadeDirs), and still
writes a file whose directory another writer (gc, an abort) removed behind its back; read_region
returns exactly the slice written, and a chunk that decodes short is corrupt."""
from __future__ import annotations

import os
import shutil
import struct

import crc32c
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capturestore import chunkio
from capturestore.arrays import ArrayRef, create_array
from capturestore.chunkio import MadeDirs, read_region, write_block
from capturestore.errors import CorruptChunkError
from tests.forked import result_in_forked_child


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


def test_a_group_this_writer_made_keeps_its_attributes_and_its_new_groups_are_written_without_a_stat(
        tmp_path, monkeypatch):
    """A directory the writer's own mkdir made holds no zarr.json, so a module's group below a
    prompt is written without looking for one (a stat each, ~70 a prompt); a group the writer
    wrote itself (a prompt's, with its attributes) is not taken for such an empty directory."""
    from capturestore.arrays import create_group

    zs = zarr.storage.LocalStore(str(tmp_path))
    dirs = MadeDirs(tmp_path)
    create_group(zs, "run", {"run_id": "run"}, dirs)
    create_group(zs, "run/p", {"prompt_id": "p"}, dirs)
    looked: list[str] = []
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: looked.append(os.fspath(p)) or real(p))
    for name in ("logits", "tensors/a/prefill", "tensors/a/decode", "tensors/b/prefill"):
        create_array(zs, ArrayRef("run", "p", name), (1, 2), np.dtype("float32"), (1, 2), ["s", "d"], {}, dirs=dirs)
    monkeypatch.setattr(os.path, "exists", real)
    assert dict(zarr.open_group(store=zs, path="run/p", mode="r").attrs) == {"prompt_id": "p"}
    assert dict(zarr.open_group(store=zs, path="run", mode="r").attrs) == {"run_id": "run"}
    for group in ("run/p/tensors", "run/p/tensors/a", "run/p/tensors/b"):
        assert zarr.open_group(store=zs, path=group, mode="r").attrs == {}
    assert not [p for p in looked if "/tensors" in p]  # the groups below the prompt: made here, no stat
    assert zarr.open_array(store=zs, path="run/p/tensors/b/prefill", mode="r").shape == (1, 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_region_is_numpys_slice_of_what_was_written(tmp_path_factory, data):
    """Oracle: numpy's slice of the array written. Whole chunks whose part of the result is
    contiguous decode in place, the others through a chunk copy; both, compressed or not, serial
    or on the pool (_THREADED_READ_BYTES set to 0 or not), read through the kept buffers or not,
    over shapes with edge chunks."""
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    chunks = tuple(data.draw(st.integers(1, n + 1)) for n in shape)
    dtype = np.dtype(data.draw(st.sampled_from(["float32", "uint16", "int32", "float64"])))
    compressed = data.draw(st.booleans())
    region = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        region.append(slice(a, data.draw(st.integers(a + 1, n))))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x = rng.integers(0, 2**16, shape).astype(dtype)
    d = tmp_path_factory.mktemp("a")
    assert write_block(d, shape, chunks, x, (0,) * ndim, compressed=compressed)
    threaded, buffered = data.draw(st.booleans()), data.draw(st.booleans())
    old = chunkio._THREADED_READ_BYTES, chunkio._BUFFERED_READ_BYTES
    chunkio._THREADED_READ_BYTES = 0 if threaded else 1 << 40
    chunkio._BUFFERED_READ_BYTES = 0 if buffered else 1 << 40  # every file through a kept buffer, or none
    try:
        got = read_region(d, shape, chunks, dtype, tuple(region), "x", compressed=compressed)
    finally:
        chunkio._THREADED_READ_BYTES, chunkio._BUFFERED_READ_BYTES = old
    want = x[tuple(region)]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("compressed", [True, False])
def test_a_chunk_holding_fewer_bytes_than_its_shape_is_corrupt_not_padded(tmp_path, compressed):
    """A chunk file whose CRC is right but whose payload decodes to fewer bytes than the chunk
    (blosc decodes such a frame into a larger destination and leaves the rest as it was: here,
    the result's uninitialised memory) is named as corrupt. A frame cut short: the test below."""
    shape = chunks = (4, 64)
    x = np.arange(256, dtype=np.float32).reshape(shape)
    assert write_block(tmp_path, shape, chunks, x, (0, 0), compressed=compressed)
    short = x.reshape(-1)[:200]
    payload = (chunkio._blosc(4).encode(short) if compressed else short.tobytes())
    (tmp_path / "c/0/0").write_bytes(payload + struct.pack("<I", crc32c.crc32c(payload)))
    with pytest.raises(CorruptChunkError, match=r"x, chunk c/0/0: (blosc frame of )?800 bytes where 1024 were expected"):
        read_region(tmp_path, shape, chunks, np.dtype("float32"), (slice(0, 4), slice(0, 64)), "x",
                    compressed=compressed)


def test_a_chunk_file_longer_than_its_size_said_is_read_whole(tmp_path, monkeypatch):
    """A kept buffer is taken for the size fstat gave; a file that grew since (fstat reporting
    half) is read on to its end, not cut at that size (whose CRC would then fail)."""
    shape = chunks = (256, 1024)  # 1 MiB of random bits: half of it is still a buffered read
    x = np.random.default_rng(3).integers(0, 2**32, shape, dtype=np.uint32).view(np.float32)
    assert write_block(tmp_path, shape, chunks, x, (0, 0))
    assert (tmp_path / "c/0/0").stat().st_size // 2 >= chunkio._BUFFERED_READ_BYTES
    real = os.fstat

    class Half:
        def __init__(self, st):
            self.st_size = st.st_size // 2

    monkeypatch.setattr(chunkio.os, "fstat", lambda fd: Half(real(fd)))
    got = read_region(tmp_path, shape, chunks, np.dtype("float32"), (slice(0, 256), slice(0, 1024)), "x")
    assert got.tobytes() == x.tobytes()


def test_read_buffers_kept_are_the_largest_within_their_bounds(monkeypatch):
    """However many threads read, at most _KEPT_READ_BUFFERS buffers and _KEPT_READ_BYTES in all
    stay kept between reads, the largest first; a buffer taken is one at least the size asked."""
    monkeypatch.setattr(chunkio, "_read_buffers", [])
    mib = 1 << 20
    for n in range(1, 11):
        chunkio._give_buffer(bytearray(n * mib))
    assert [len(b) // mib for b in chunkio._read_buffers] == [10, 9, 8, 7, 6, 5, 4, 3]  # 8 buffers, 52 MiB
    monkeypatch.setattr(chunkio, "_KEPT_READ_BYTES", 20 * mib)
    chunkio._give_buffer(bytearray(mib))
    assert [len(b) // mib for b in chunkio._read_buffers] == [10, 9, 1]
    got = chunkio._take_buffer(2 * mib)
    assert len(got) >= 2 * mib and [len(b) // mib for b in chunkio._read_buffers] in ([9, 1], [10, 1])
    assert len(chunkio._take_buffer(11 * mib)) == 11 * mib  # none large enough: a new one


def test_a_blosc_frame_cut_short_under_a_valid_checksum_is_corrupt_not_read_on(tmp_path):
    """blosc 1.x is given no input length: a memcpy'd frame (random bits do not compress) cut
    short, its CRC32C taken after the cut, decoded without an error, reading on past the file's
    bytes into what the kept read buffer held: the bytes of the chunk read before it (review of
    5933fe0: every byte past the cut matched that chunk). The header's own length must be the
    file's; a frame shorter than its 16-byte header is corrupt too."""
    n = 1 << 20
    a = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    assert write_block(tmp_path / "A", (n,), (n,), a, (0,))
    got = read_region(tmp_path / "A", (n,), (n,), np.dtype("u1"), (slice(0, n),), "A")
    assert np.array_equal(got, a)  # a ~1 MiB buffer now holds A's frame
    header = chunkio._blosc(1).encode(a)[:16]
    assert struct.unpack_from("<I", header, 12)[0] == n + 16  # memcpy'd: the header and the bytes as they are
    body = header + b"\x11" * (300 << 10)
    (tmp_path / "B/c").mkdir(parents=True)
    (tmp_path / "B/c/0").write_bytes(body + struct.pack("<I", crc32c.crc32c(body)))
    with pytest.raises(CorruptChunkError, match=rf"B, chunk c/0: blosc frame says it is {n + 16} bytes long, "
                                                rf"the chunk holds {len(body)} before its checksum"):
        read_region(tmp_path / "B", (n,), (n,), np.dtype("u1"), (slice(0, n),), "B")
    tiny = header[:10]
    (tmp_path / "B/c/0").write_bytes(tiny + struct.pack("<I", crc32c.crc32c(tiny)))
    with pytest.raises(CorruptChunkError, match="blosc frame of 10 bytes, shorter than its header"):
        read_region(tmp_path / "B", (n,), (n,), np.dtype("u1"), (slice(0, n),), "B")


@settings(max_examples=120, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1),
       runs=st.booleans())
def test_compress_gives_the_bytes_of_the_blosc_codec_the_arrays_name(itemsize, n, seed, runs):
    """chunkio._compress calls numcodecs' compress itself; its bytes must be those of the codec
    object the arrays' zarr.json names (``_blosc``), and decode back through Blosc()."""
    from numcodecs import Blosc

    rng = np.random.default_rng(seed)
    raw = (np.resize(np.repeat(rng.integers(0, 4, n // 7 + 1, dtype=np.uint8), 7), n * itemsize) if runs
           else rng.integers(0, 256, n * itemsize, dtype=np.uint8))
    enc = chunkio._compress(raw, itemsize)
    assert enc == chunkio._blosc(itemsize).encode(raw)
    assert bytes(Blosc().decode(enc)) == raw.tobytes()


def test_a_directory_where_a_chunk_file_should_be_is_named(tmp_path):
    shape = chunks = (4, 8)
    assert write_block(tmp_path, shape, chunks, np.ones(shape, np.float32), (0, 0))
    (tmp_path / "c/0/0").unlink()
    (tmp_path / "c/0/0").mkdir()
    with pytest.raises(IsADirectoryError, match=str(tmp_path / "c/0/0")):
        read_region(tmp_path, shape, chunks, np.dtype("float32"), (slice(0, 4), slice(0, 8)), "x")


def _read_in_child(q, d, shape, chunks):
    got = read_region(d, shape, chunks, np.dtype("float32"), tuple(slice(0, n) for n in shape), "x")
    q.put(got.tobytes())


def test_a_forked_child_reads_on_a_pool_of_its_own(tmp_path):
    """A process forked after its parent read chunks on the I/O pool inherits the pool object but
    not its threads: a read there waited for ever (seen: the child's read never returned). The
    pool is made again in the child; its multi-chunk read (each chunk above the threaded-read
    size) returns the bytes written."""
    shape, chunks = (8, 8192), (2, 8192)  # four chunks of 64 KiB: read on the pool
    assert chunks[0] * chunks[1] * 4 >= chunkio._THREADED_READ_BYTES
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    assert write_block(tmp_path, shape, chunks, x, (0, 0))
    region = (slice(0, 8), slice(0, 8192))
    assert read_region(tmp_path, shape, chunks, np.dtype("float32"), region, "x").tobytes() == x.tobytes()
    assert result_in_forked_child(_read_in_child, tmp_path, shape, chunks) == x.tobytes()


def test_the_io_pool_has_a_thread_per_cpu_this_process_may_use(monkeypatch):
    """Sized by the process's CPU affinity (a container's or taskset's share), not the machine's
    CPU count: on a 64-CPU host a process given 3 CPUs had 64 threads, each decoding a chunk."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(chunkio, "_POOL", None)
    pool = chunkio._pool()
    try:
        assert pool._max_workers == 3
    finally:
        pool.shutdown()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(chunkio, "_POOL", None)
    pool = chunkio._pool()
    try:
        assert pool._max_workers == 2  # never fewer than 2: file reads overlap decoding
    finally:
        pool.shutdown()
