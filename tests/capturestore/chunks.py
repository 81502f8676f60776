"""Where an array's chunk files are, whichever chunk key separator its zarr.json names (a store of
format 4 writes "." keys, ``c.0.1``, beside zarr.json; earlier ones "/" keys, ``c/0/1``)."""
from __future__ import annotations

import json
from pathlib import Path

from capturestore.layout import chunk_key, is_chunk_name, key_separator


def separator(array_dir: Path) -> str:
    return key_separator(json.loads((Path(array_dir) / "zarr.json").read_text()))


def chunk_name(array_dir: Path, *idx: int) -> str:
    """The key of chunk ``idx`` of the array (as errors and verify name it)."""
    return chunk_key(tuple(idx), separator(array_dir))


def chunk_path(array_dir: Path, *idx: int) -> Path:
    return Path(array_dir) / chunk_name(array_dir, *idx)


def chunk_files(array_dir: Path) -> list[Path]:
    """Every chunk (or shard) file of the array, sorted by path."""
    array_dir, sep = Path(array_dir), separator(array_dir)
    return sorted(p for p in array_dir.rglob("*")
                  if p.is_file() and is_chunk_name(p.relative_to(array_dir).as_posix(), sep))
