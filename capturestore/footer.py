"""The column statistics of a Parquet footer, decoded in Python (Thrift compact protocol).

pyarrow's statistics accessors abort the process on some damaged footers (single-bit flips of a
merged segment's footer: 64 of 8,063 aborted in ``ColumnChunkMetaData.statistics``, none in a read
of the rows), so a check of damaged files cannot use them: this decoder returns or raises
``FooterError``, in time and memory bounded by the footer's length (every value it decodes takes
at least one byte, a count larger than the bytes left is refused). It reads what a reader prunes
row groups and answers ``min`` / ``max`` by: per row group, per column chunk, its path, physical
type, null count and each bound as DuckDB picks it (``min_value``, else the deprecated ``min``;
``max_value``, else ``max``: each on its own), as the raw bytes the footer holds, with the
footer's exactness flags. Parquet's Thrift definitions: parquet-format, parquet.thrift.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

# physical types (parquet.thrift ``Type``)
BOOLEAN, INT32, INT64, INT96, FLOAT, DOUBLE, BYTE_ARRAY, FIXED_LEN_BYTE_ARRAY = range(8)

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_DEPTH = 64  # nested structs deeper than any Parquet footer holds are damage


@dataclass(frozen=True)
class ChunkStatistics:
    path: tuple[str, ...]
    physical_type: int | None
    null_count: int | None
    min: bytes | None  # raw, as the footer holds them (plain encoding of the physical type)
    max: bytes | None
    min_exact: bool | None = None  # the footer's is_min_value_exact / is_max_value_exact; None: not said
    max_exact: bool | None = None


class FooterError(ValueError):
    pass


class _Reader:
    def __init__(self, data: bytes):
        self.d, self.i = data, 0

    def byte(self) -> int:
        if self.i >= len(self.d):
            raise FooterError("the footer ends inside a value")
        self.i += 1
        return self.d[self.i - 1]

    def varint(self) -> int:
        out, self.i = _varint_at(self.d, self.i)
        return out

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.i + n > len(self.d):
            raise FooterError("a value runs past the footer's end")
        self.i += n
        return self.d[self.i - n:self.i]

    def binary(self) -> bytes:
        return self.take(self.varint())

    def count(self, n: int) -> int:
        """A container's element count: each element takes at least a byte."""
        if n > len(self.d) - self.i:
            raise FooterError(f"a container of {n} elements in {len(self.d) - self.i} bytes")
        return n

    def list_header(self) -> tuple[int, int]:
        b = self.byte()
        size, etype = b >> 4, b & 0x0F
        return self.count(self.varint() if size == 15 else size), etype

    def element(self, t: int, depth: int):
        """A container's element: booleans are a byte each there, not a field header's type."""
        return self.byte() == 1 if t in (_TRUE, _FALSE) else self.value(t, depth)

    def fields(self):
        """(field id, type) of a struct's fields, up to its STOP."""
        last = 0
        while True:
            b = self.byte()
            t = b & 0x0F
            if t == _STOP:
                return
            delta = b >> 4
            last = last + delta if delta else self.zigzag()
            yield last, t

    def value(self, t: int, depth: int = 0):
        """A value of type ``t`` (skipped values too: decoding is how they are skipped)."""
        if depth > _DEPTH:
            raise FooterError("values nested too deep")
        if t in (_TRUE, _FALSE):
            return t == _TRUE
        if t == _BYTE:
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if t == _BINARY:
            return self.binary()
        if t in (_LIST, _SET):
            n, et = self.list_header()
            return [self.element(et, depth + 1) for _ in range(n)]
        if t == _MAP:
            n = self.count(self.varint())
            if n == 0:
                return {}
            kv = self.byte()
            return [(self.element(kv >> 4, depth + 1), self.element(kv & 0x0F, depth + 1)) for _ in range(n)]
        if t == _STRUCT:
            return {fid: self.value(ft, depth + 1) for fid, ft in self.fields()}
        raise FooterError(f"unknown Thrift type {t}")

    def pruned(self, t: int, keep: dict | None, depth: int = 0):
        """``value(t)`` with only the struct fields ``keep`` names decoded (the others passed over by
        ``_skip``, with the same checks): keep maps a field id to what to keep of that field's value
        (None: all of it); for a list or set, to what to keep of each element. The result is
        ``value``'s with every other field left out, and the same footers raise."""
        if keep is None or t not in (_STRUCT, _LIST, _SET):
            return self.value(t, depth)
        if depth > _DEPTH:
            raise FooterError("values nested too deep")
        if t == _STRUCT:
            out = {}
            for fid, ft in self.fields():
                if fid in keep:
                    out[fid] = self.pruned(ft, keep[fid], depth + 1)
                else:
                    self.i = _skip(self.d, self.i, ft, depth + 1)
            return out
        n, et = self.list_header()
        if et in (_TRUE, _FALSE):
            return [self.byte() == 1 for _ in range(n)]
        return [self.pruned(et, keep, depth + 1) for _ in range(n)]


def _varint_at(d: bytes, i: int) -> tuple[int, int]:
    """(the varint at d[i:], the index after it); FooterError past the end or beyond 10 bytes."""
    out = shift = 0
    n = len(d)
    while True:
        if i >= n:
            raise FooterError("the footer ends inside a value")
        b = d[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7
        if shift > 70:
            raise FooterError("a varint longer than 10 bytes")


def _skip(d: bytes, i: int, t: int, depth: int) -> int:
    """The index after the value of type ``t`` at d[i:], passed over with ``_Reader.value``'s checks
    (the same footers raise ``FooterError``) and nothing built: the byte loop inline, not a method
    call a byte (most of a footer is what ``row_group_statistics`` does not read: its decode of 903
    run-table footers 0.39 -> 0.19 s against decoding them whole)."""
    if depth > _DEPTH:
        raise FooterError("values nested too deep")
    n = len(d)
    if t == _STRUCT:
        while True:
            if i >= n:
                raise FooterError("the footer ends inside a value")
            b = d[i]
            i += 1
            ft = b & 0x0F
            if ft == _STOP:
                return i
            if not b >> 4:  # the field id as a zigzag varint
                _, i = _varint_at(d, i)
            if depth + 1 > _DEPTH:
                raise FooterError("values nested too deep")
            if _I16 <= ft <= _I64:
                shift = 0
                while True:
                    if i >= n:
                        raise FooterError("the footer ends inside a value")
                    b = d[i]
                    i += 1
                    if b < 0x80:
                        break
                    shift += 7
                    if shift > 70:
                        raise FooterError("a varint longer than 10 bytes")
            elif ft == _BINARY:
                m, i = _varint_at(d, i)
                if i + m > n:
                    raise FooterError("a value runs past the footer's end")
                i += m
            elif ft != _TRUE and ft != _FALSE:
                i = _skip(d, i, ft, depth + 1)
    if _I16 <= t <= _I64:
        _, i = _varint_at(d, i)
        return i
    if t == _BINARY:
        m, i = _varint_at(d, i)
        if i + m > n:
            raise FooterError("a value runs past the footer's end")
        return i + m
    if t == _LIST or t == _SET:
        if i >= n:
            raise FooterError("the footer ends inside a value")
        b = d[i]
        i += 1
        size, et = b >> 4, b & 0x0F
        if size == 15:
            size, i = _varint_at(d, i)
        if size > n - i:
            raise FooterError(f"a container of {size} elements in {n - i} bytes")
        if et == _TRUE or et == _FALSE:  # a byte each in a container
            return i + size
        for _ in range(size):
            i = _skip(d, i, et, depth + 1)
        return i
    if t == _TRUE or t == _FALSE:
        return i
    if t == _BYTE:
        if i >= n:
            raise FooterError("the footer ends inside a value")
        return i + 1
    if t == _DOUBLE:
        if i + 8 > n:
            raise FooterError("a value runs past the footer's end")
        return i + 8
    if t == _MAP:
        size, i = _varint_at(d, i)
        if size > n - i:
            raise FooterError(f"a container of {size} elements in {n - i} bytes")
        if not size:
            return i
        if i >= n:
            raise FooterError("the footer ends inside a value")
        kv = d[i]
        i += 1
        for _ in range(size):
            for et in (kv >> 4, kv & 0x0F):
                if et == _TRUE or et == _FALSE:
                    if i >= n:
                        raise FooterError("the footer ends inside a value")
                    i += 1
                else:
                    i = _skip(d, i, et, depth + 1)
        return i
    raise FooterError(f"unknown Thrift type {t}")


def footer_length(size: int, tail: bytes) -> int:
    """The length of the footer of a Parquet file of ``size`` bytes whose last 8 bytes are
    ``tail``; FooterError where they are no Parquet ending or the length exceeds the file."""
    if size < 12 or len(tail) != 8 or tail[4:] != b"PAR1":
        raise FooterError("not a Parquet file (no PAR1 at its end)")
    n = struct.unpack("<I", tail[:4])[0]
    if n > size - 12:
        raise FooterError(f"its footer length {n} exceeds the file")
    return n


def footer_bytes(data: bytes) -> bytes:
    """The Thrift-encoded footer of a whole Parquet file's bytes."""
    n = footer_length(len(data), bytes(data[-8:]))
    return data[len(data) - 8 - n:len(data) - 8]


# What row_group_statistics reads of FileMetaData: its row groups (4), their column chunks (1), each
# one's ColumnMetaData (3): physical type (1), path (3) and statistics (12). The rest of the
# footer (the schema, key-value metadata, offsets, sizes, encodings: most of its bytes) is
# passed over unbuilt, checked as it is when decoded: 0.43 ms a footer of a run table's segment
# decoded whole, most of verify's statistics check (docs/compact.md).
_STATISTICS_FIELDS = {4: {1: {3: {1: None, 3: None, 12: None}}}}


@functools.lru_cache(maxsize=16)
def row_group_statistics(footer: bytes) -> tuple[tuple[ChunkStatistics, ...], ...]:
    """Per row group, per column chunk: its statistics as the footer holds them. Kept for the
    last footers decoded (check_evidence reads the same merged segment's for each comparison)."""
    meta = _Reader(footer).pruned(_STRUCT, _STATISTICS_FIELDS)
    groups = meta.get(4)
    if not isinstance(groups, list):
        raise FooterError("no row group list")
    out = []
    for rg in groups:
        cols = rg.get(1) if isinstance(rg, dict) else None
        if not isinstance(cols, list):
            raise FooterError("a row group without its column list")
        chunks = []
        for cc in cols:
            md = cc.get(3) if isinstance(cc, dict) else None
            if not isinstance(md, dict):
                raise FooterError("a column chunk without its metadata")
            path = md.get(3)
            if not isinstance(path, list) or not all(isinstance(p, bytes) for p in path):
                raise FooterError("a column chunk without its path")
            st = md.get(12)
            st = st if isinstance(st, dict) else {}
            lo = st.get(6) if isinstance(st.get(6), bytes) else st.get(2)  # each bound as DuckDB picks it
            hi = st.get(5) if isinstance(st.get(5), bytes) else st.get(1)
            chunks.append(ChunkStatistics(
                path=tuple(p.decode("utf-8", "replace") for p in path),
                physical_type=md.get(1) if isinstance(md.get(1), int) else None,
                null_count=st.get(3) if isinstance(st.get(3), int) else None,
                min=lo if isinstance(lo, bytes) else None, max=hi if isinstance(hi, bytes) else None,
                min_exact=st.get(8) if isinstance(st.get(8), bool) else None,
                max_exact=st.get(7) if isinstance(st.get(7), bool) else None))
        out.append(tuple(chunks))
    return tuple(out)


def decode_value(raw: bytes, physical_type: int | None, unsigned: bool = False):
    """A min / max statistic's Python value: int, float, bool or bytes; None for types not read
    (INT96, fixed-length byte arrays) or bytes of the wrong length for their type."""
    fmt = {INT32: "<i", INT64: "<q", FLOAT: "<f", DOUBLE: "<d"}.get(physical_type)
    if fmt is not None:
        if len(raw) != struct.calcsize(fmt):
            return None
        v = struct.unpack(fmt, raw)[0]
        if unsigned and physical_type in (INT32, INT64):
            v &= (1 << (32 if physical_type == INT32 else 64)) - 1
        return v
    if physical_type == BOOLEAN:
        return bool(raw[0]) if len(raw) == 1 else None
    if physical_type == BYTE_ARRAY:
        return bytes(raw)
    return None
