"""capturestore.arrays: the zarr.json documents written without zarr. A group created in a
directory writes its zarr.json itself (zarr's own creation cost ~3 ms a group, two a prompt), the
bytes zarr.create_group writes, parent groups included; every document is encoded by
``document_bytes``, which must give json.dumps(doc, indent=2) (what zarr writes) for any document."""
import json

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from capturestore.arrays import create_group, document_bytes, open_zarr_store


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


_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(max_size=6))
_documents = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=5) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=5), inner, max_size=5)
                   | st.dictionaries(st.integers(-3, 3) | st.booleans() | st.none(), inner, max_size=3)),
    max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(doc=_documents)
def test_document_bytes_are_json_dumps_indent_2(doc):
    assert document_bytes(doc) == json.dumps(doc, indent=2).encode()


def test_document_bytes_of_lists_of_ints_strings_and_bools():
    for doc in ([0, 1, 2], ["a", "\u00e9", "\n"], [True, 1], [1, 1.5], {"steps": list(range(40)), "e": {}, "l": []}):
        assert document_bytes(doc) == json.dumps(doc, indent=2).encode()


_STORAGE_DTYPES = ["float32", "float16", "uint16", "uint8", "int8", "int16", "int32", "int64", "bool"]


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(_STORAGE_DTYPES), compression=st.sampled_from([None, "lz4"]),
       separator=st.sampled_from(["/", "."]), shape=st.lists(st.integers(0, 2**40), min_size=0, max_size=5),
       attributes=st.dictionaries(st.text(max_size=5), _documents, max_size=4),
       other=st.dictionaries(st.text(max_size=5), _documents, max_size=2))
def test_array_document_bytes_are_json_dumps_indent_2_whatever_was_rendered_before(dtype, compression, separator,
                                                                                    shape, attributes, other):
    """The constant entries' text is kept per (dtype, compression, separator): a document made
    after another of the same key (and one of another key) still encodes as json.dumps does."""
    from capturestore.arrays import array_document, array_document_bytes

    chunks = [max(1, n // 3) for n in shape]
    dims = [f"d{i}" for i in range(len(shape))]
    dt = np.dtype(dtype)
    key = (dt.str, compression, separator)
    first = array_document(shape[::-1], dt, chunks[::-1], dims, other, compression, separator)
    assert array_document_bytes(first, key) == json.dumps(first, indent=2).encode()
    doc = array_document(shape, dt, chunks, dims, attributes, compression, separator)
    assert array_document_bytes(doc, key) == json.dumps(doc, indent=2).encode()
    other_key = (np.dtype("float64").str, compression, separator)  # never used for real: fills its own entry
    wide = array_document(shape, np.dtype("float64"), chunks, dims, attributes, compression, separator)
    assert array_document_bytes(wide, other_key) == json.dumps(wide, indent=2).encode()
    assert array_document_bytes(doc, key) == json.dumps(doc, indent=2).encode()
