"""capturestore.dtypes: bf16 / fp8 on disk, and the decision not to register a Zarr bfloat16
data type (docs/reading.md, "Why bfloat16 is not a Zarr data type here")."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

from capturestore import Store
from capturestore.dtypes import LOGICAL_DTYPES, from_storage, to_storage

ROOT = Path(__file__).parents[2]
PLAIN = "import sys\nsys.modules['capturestore'] = None  # a reader without the library\n"

# zarr-python 3's registry takes a bfloat16 data type in ~20 lines (the evaluated option)
BF16_ZDTYPE = textwrap.dedent("""
    from dataclasses import dataclass
    from typing import ClassVar
    import ml_dtypes, numpy as np
    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.npy.float import BaseFloat

    @dataclass(frozen=True, kw_only=True)
    class BFloat16(BaseFloat):
        dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
        _zarr_v3_name: ClassVar[str] = "bfloat16"
        _zarr_v2_names: ClassVar[tuple] = ()

        @property
        def item_size(self):
            return 2

        @classmethod
        def _check_native_dtype(cls, dtype):
            return dtype == np.dtype(ml_dtypes.bfloat16)

        @classmethod
        def from_native_dtype(cls, dtype):
            return cls()

        def to_native_dtype(self):
            return np.dtype(ml_dtypes.bfloat16)

    data_type_registry.register("bfloat16", BFloat16)
""")


def run_plain(code, cwd):
    out = subprocess.run([sys.executable, "-c", PLAIN + textwrap.dedent(code)], cwd=cwd, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


@pytest.mark.parametrize("logical", ["bfloat16", "float8_e4m3fn", "float8_e4m3", "float8_e5m2"])
def test_storage_views_round_trip_every_bit_pattern(logical):
    ld = LOGICAL_DTYPES[logical]
    bits = np.arange(1 << (8 * ld.storage.itemsize), dtype=np.uint32).astype(ld.storage)
    values = bits.view(ld.numpy)
    assert np.array_equal(to_storage(values, ld), bits)
    assert np.array_equal(from_storage(bits, logical, False, "t").view(ld.storage), bits)


def test_a_plain_zarr_reader_gets_bits_plus_logical_dtype_and_decodes_them_exactly(tmp_path):
    """What a zarr process without capturestore sees of a bf16 KV and an fp8 tensor: uint16 /
    uint8 with attrs['logical_dtype'], which one .view turns into the captured values."""
    rng = np.random.default_rng(3)
    k = rng.normal(size=(2, 2, 5, 32)).astype(ml_dtypes.bfloat16)
    q = (rng.normal(size=(2, 5, 32)) * 8).astype(ml_dtypes.float8_e4m3fn)
    store = Store.open(tmp_path / "s")
    with store.begin_run("hf", "m") as run:
        pid = run.add_prompt([1, 2, 3, 4, 5])
        run.write_kv(pid, k, k)
        run.write_tensor(pid, "k_fp8", q)
    np.save(tmp_path / "k_bits.npy", k.view(np.uint16))
    np.save(tmp_path / "q_bits.npy", q.view(np.uint8))
    out = run_plain(f"""
        import ml_dtypes, numpy as np, zarr
        root = zarr.open_group("s/arrays.zarr", mode="r")
        kv = root["{run.run_id}/{pid}/kv_k"]
        t = root["{run.run_id}/{pid}/tensors/k_fp8/prefill"]
        print(kv.dtype, kv.attrs["logical_dtype"], t.dtype, t.attrs["logical_dtype"])
        k = kv[...].view(getattr(ml_dtypes, kv.attrs["logical_dtype"]))
        q = t[0].view(getattr(ml_dtypes, t.attrs["logical_dtype"]))
        assert k.dtype == ml_dtypes.bfloat16 and q.dtype == ml_dtypes.float8_e4m3fn
        assert np.array_equal(k.view(np.uint16), np.load("k_bits.npy"))
        assert np.array_equal(q.view(np.uint8), np.load("q_bits.npy"))
        print(kv[...].mean() > 1000, abs(k.astype(np.float32).mean()) < 1)
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["uint16", "bfloat16", "uint8", "float8_e4m3fn", "True", "True"]


def test_a_registered_bfloat16_zarr_dtype_round_trips_but_locks_out_plain_readers(tmp_path):
    """The evaluated alternative: with a registered bfloat16 data type the array round-trips in
    the writing process, but a process without the registration cannot open it at all — while
    today's uint16 arrays open in any zarr reader. Hence: not registered."""
    writer = BF16_ZDTYPE + textwrap.dedent("""
        import zarr
        x = (np.arange(-8, 8, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16).reshape(2, 8)
        a = zarr.create_array(store="bf16.zarr", shape=x.shape, dtype=x.dtype, chunks=x.shape, fill_value=0,
                              dimension_names=["a", "b"])
        a[...] = x
        back = zarr.open_array("bf16.zarr", mode="r")[...]
        assert back.dtype == ml_dtypes.bfloat16 and np.array_equal(back.view(np.uint16), x.view(np.uint16))
        print("round trip ok")
    """)
    out = run_plain(writer, tmp_path)
    assert out.returncode == 0 and "round trip ok" in out.stdout, out.stderr[-2000:]
    reader = run_plain("""
        import zarr
        zarr.open_array("bf16.zarr", mode="r")
    """, tmp_path)
    assert reader.returncode != 0
    assert "No Zarr data type found that matches 'bfloat16'" in reader.stderr, reader.stderr[-2000:]


def test_zarr_itself_has_no_bfloat16_yet():
    """When zarr-python ships a bfloat16 data type, storing bf16 natively stops locking plain
    readers out: this fails then, to have the decision in docs/reading.md revisited."""
    from zarr.core.dtype import data_type_registry

    data_type_registry._lazy_load()
    assert "bfloat16" not in data_type_registry.contents, zarr.__version__
    with pytest.raises(Exception, match="bfloat16"):  # noqa: PT011 - zarr's own wording varies
        zarr.create_array(store={}, shape=(2,), dtype=np.dtype(ml_dtypes.bfloat16))
