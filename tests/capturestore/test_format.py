"""Store format versions: the shared position axis (format 2) and reading format-1 stores.

tests/fixtures/format1_store was written by the capturestore of commit 9cce80c (format 1:
KV [layer, kv_head, seq, head_dim], tokens [token]); tests/fixtures/make_format1_store.py
says how. Its arrays are regenerated here by tests/fixtures/format1_data.py."""
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from capturestore import Store
from capturestore.errors import StoreError
from capturestore.layout import ARRAYS_DIR, FORMAT_FILE, FORMAT_VERSION

from tests.fixtures import format1_data as F1

FIXTURES = Path(__file__).parents[1] / "fixtures"
xr = pytest.importorskip("xarray")


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


@pytest.fixture
def format1_store(tmp_path):
    """A copy of the committed format-1 store, as the old code left it on disk."""
    root = tmp_path / "old-store"
    shutil.copytree(FIXTURES / "format1_store", root)
    (root / "pending").mkdir()  # git keeps no empty directory; the old code made it
    return root


def _runs(store):
    return {r["release"]: r for r in store.runs().to_pylist()}


def test_new_runs_name_the_shared_axis_position_so_plain_xarray_aligns_kv_and_tokens(tmp_path):
    store = Store.open(tmp_path / "s")
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 2, 7, 32)).astype(ml_dtypes.bfloat16)
    with store.begin_run("hf", "m") as run:
        pid = run.add_prompt([4, 5, 6, 7], continuation=[1, 2, 3])
        run.write_kv(pid, k, k)
        run.write_logits(pid, rng.normal(size=(3, 11)).astype(np.float32))
    assert FORMAT_VERSION == 7  # 6: grouped module tensors, 7: binary row hashes; a run without module tensors as in 4
    assert json.loads((store.root / FORMAT_FILE).read_text())["format_version"] == 7
    assert store.runs().column("format_version").to_pylist() == [4]
    # format 4: "." chunk keys, every chunk a file beside its array's zarr.json (no c/ directories)
    kv_dir = store.root / ARRAYS_DIR / run.run_id / pid / "kv_k"
    assert sorted(p.name for p in kv_dir.iterdir() if p.is_file()) == ["c.0.0.0.0", "c.1.0.0.0", "zarr.json"]
    assert not [p for p in kv_dir.iterdir() if p.is_dir()]
    caps = {r["array_name"]: r["dimension_names"] for r in store.captures().to_pylist()}
    assert caps == {"tokens": ["position"], "kv_k": ["layer", "kv_head", "position", "head_dim"],
                    "kv_v": ["layer", "kv_head", "position", "head_dim"], "logits": ["gen_token", "vocab"]}
    ds = xr.open_zarr(store.root / ARRAYS_DIR / run.run_id / pid, consolidated=False, zarr_format=3)
    assert ds.sizes["position"] == 7 and "seq" not in ds.dims and "token" not in ds.dims
    # one axis: the KV of the position where token 6 was fed, selected through the tokens array
    at = ds["kv_k"].where((ds["tokens"] == 6).compute(), drop=True)  # computed: xarray opens lazily (dask) when dask is installed
    assert at.sizes["position"] == 1
    assert np.array_equal(at.values.astype(np.uint16)[:, :, 0], k[:, :, 2].view(np.uint16))


def test_format1_store_written_by_the_old_code_reads_bit_exactly(format1_store):
    store = Store.open(format1_store, create=False)
    assert json.loads((format1_store / FORMAT_FILE).read_text())["format_version"] == 1  # not rewritten
    runs = _runs(store)
    assert {r["format_version"] for r in runs.values()} == {1}
    pid = store.prompts().column("prompt_id").to_pylist()[0]
    for role in ("expected", "actual"):
        rid, want = runs[role]["run_id"], F1.run_arrays(role)
        k, v = store.read_kv(rid, pid)
        assert k.dtype == ml_dtypes.bfloat16 and np.array_equal(bits(k), bits(want["kv_k"]))
        assert np.array_equal(bits(v), bits(want["kv_v"]))
        assert np.array_equal(bits(store.read_logits(rid, pid)), bits(want["logits"]))
        assert store.read_tokens(rid, pid).tolist() == F1.PROMPT + F1.CONTINUATION
        fp8 = store.read_tensor(rid, pid, F1.FP8_MODULE)[0]
        assert fp8.dtype == ml_dtypes.float8_e4m3fn and np.array_equal(bits(fp8), bits(want["fp8"]))
        # a plain reader sees the old names; open_xarray gives the shared axis its one name
        plain = xr.open_zarr(format1_store / ARRAYS_DIR / rid / pid, consolidated=False, zarr_format=3)
        assert plain["kv_k"].dims == ("layer", "kv_head", "seq", "head_dim") and plain["tokens"].dims == ("token",)
        ds = store.open_xarray(rid, pid)
        assert ds["kv_k"].dims == ("layer", "kv_head", "position", "head_dim") and ds["tokens"].dims == ("position",)
        assert ds["logits"].dims == ("gen_token", "vocab") and ds.sizes["position"] == 8
        assert np.array_equal(bits(ds["kv_v"].values), bits(want["kv_v"]))
    assert store.sql("SELECT count(*) AS n FROM captures").to_pylist() == [{"n": 10}]
    report = store.verify()
    assert report.ok and report.checked_arrays == 10, report.summary()


def test_a_format1_array_whose_length_is_not_the_tokens_keeps_its_old_dim_name(format1_store):
    """Format 1 did not check KV lengths: an array of another length than ``tokens`` cannot share
    its axis, so open_xarray leaves that array's name (the others still get ``position``)."""
    import zarr

    store = Store.open(format1_store, create=False)
    rid = _runs(store)["expected"]["run_id"]
    pid = store.prompts(rid).column("prompt_id").to_pylist()[0]
    for name in ("kv_k", "kv_v"):  # this prompt's KV becomes 5 positions long, its tokens 8
        shutil.rmtree(format1_store / ARRAYS_DIR / rid / pid / name)
        zarr.open_group(format1_store / ARRAYS_DIR / rid / pid, mode="a").create_array(
            name, shape=(2, 2, 5, 32), dtype=np.uint16, fill_value=0,
            dimension_names=["layer", "kv_head", "seq", "head_dim"], attributes={"logical_dtype": "bfloat16"})
    ds = store.open_xarray(rid, pid)
    assert ds["kv_k"].dims == ("layer", "kv_head", "seq", "head_dim") and ds.sizes["seq"] == 5
    assert ds["tokens"].dims == ("position",) and ds.sizes["position"] == 8
    assert ds["kv_v"].dtype == ml_dtypes.bfloat16


def test_a_new_run_in_a_format1_store_is_written_in_format2_beside_the_old_ones(format1_store):
    store = Store.open(format1_store, create=False)
    a = F1.run_arrays("expected")
    with store.begin_run("hf", "tiny-model", model_hash="fixture", release="new") as run:
        pid = run.add_prompt(F1.PROMPT, continuation=F1.CONTINUATION)
        run.write_kv(pid, a["kv_k"], a["kv_v"], layer_names=F1.LAYER_NAMES)
    runs = _runs(store)
    assert {role: r["format_version"] for role, r in runs.items()} == {"expected": 1, "actual": 1, "new": 2}
    new = store.open_xarray(run.run_id, pid)
    old = store.open_xarray(runs["expected"]["run_id"], pid)
    assert new["kv_k"].dims == old["kv_k"].dims == ("layer", "kv_head", "position", "head_dim")
    assert np.array_equal(bits(new["kv_k"].values), bits(old["kv_k"].values))


def test_format1_runs_compare_with_todays_code(format1_store):
    from capturestore.analysis import compare_runs

    store = Store.open(format1_store, create=False)
    runs = _runs(store)
    compare_runs(store, expected_run=runs["expected"]["run_id"], actual_run=runs["actual"]["run_id"])
    rows = store.sql("SELECT DISTINCT layer FROM kv_head_metrics ORDER BY layer").to_pylist()
    assert [r["layer"] for r in rows] == F1.LAYER_NAMES
    n = store.sql("SELECT count(*) AS n FROM kv_head_metrics").to_pylist()[0]["n"]
    assert n == F1.LAYERS * F1.KV_HEADS * (len(F1.PROMPT) + len(F1.CONTINUATION))


@pytest.mark.parametrize("version", [0, -1, "2", True, None])
def test_a_format_file_without_a_positive_integer_version_is_refused(tmp_path, version):
    root = tmp_path / "s"
    Store.open(root)
    (root / FORMAT_FILE).write_text(json.dumps({"format": "capturestore", "format_version": version}))
    with pytest.raises(StoreError, match="not a capturestore format file"):
        Store.open(root, create=False)
