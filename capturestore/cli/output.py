"""Output of the ``capturestore`` commands, written once: the output file checks (before any
work), atomic file writes, JSON without NaN, and the table / CSV / JSON / Parquet forms of a table.
The library returns results; only the commands (capturestore.cli.commands) print them."""
from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

DEFAULT_STORE = "capturestore-store"


def default_store() -> str:
    return os.environ.get("CAPTURESTORE") or DEFAULT_STORE  # an empty $CAPTURESTORE counts as unset


def _why_unwritable(d: Path) -> str:
    try:
        return "read-only file system" if os.statvfs(d).f_flag & os.ST_RDONLY else "permission denied"
    except OSError as e:
        return e.strerror or str(e)


def json_safe(v: Any) -> Any:
    """NaN and infinities as null: JSON has no such numbers (``json.dumps`` would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def output_path(output: str | None, fmt: str, flag: str = "--output") -> Path | None:
    """The output file option (``flag``: ``--output``, or ``--out`` of diff and history) checked
    before any work: a writable file path (None: stdout)."""
    if fmt == "parquet" and not output:
        raise ValueError(f"--format parquet needs {flag} FILE")
    if output is None:
        return None
    if not output.strip():
        raise ValueError(f"{flag} is empty; give a file path")
    from capturestore.store import expand_path

    out = expand_path(output, flag)
    if out.is_dir():
        raise ValueError(f"{flag} {output} is a directory; give a file path")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {output}: " + (f"{parent} is a file, not a directory" if parent.exists()
                                                 else f"directory {parent} does not exist"))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {output}: directory {parent} is not writable ({_why_unwritable(parent)})")
    return out


def write_file(out: Path, write: Callable[[str], None], flag: str = "--output") -> None:
    """``write(path)`` into a temporary file next to ``out``, renamed into place: never half a file.
    A failure names ``out`` as the user gave it (``flag``), not the temporary file."""
    tmp = out.absolute().parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        write(str(tmp))
        os.replace(tmp, out)
    except OSError as e:
        why = e.strerror or " ".join(str(e).replace(str(tmp), str(out)).split()) or type(e).__name__
        raise ValueError(f"{flag} {out}: cannot be written ({why})") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. a directory (/proc) where nothing could be made
            pass


def json_text(v: Any) -> str:
    """``v`` as indented JSON text (NaN and infinities as null), one trailing newline."""
    return json.dumps(json_safe(v), default=str, indent=1, allow_nan=False) + "\n"


def write_text(text: str, out: Path | None, flag: str = "--output") -> None:
    """``text`` into the checked file ``out`` (``output_path``; atomically), or to stdout (None)."""
    if out is not None:
        write_file(out, lambda p: Path(p).write_text(text), flag)
    else:
        sys.stdout.write(text)


# ---- output formatting ------------------------------------------------------------------------
def printable(s: str) -> str:
    """``s`` with line breaks and other control characters escaped (``\\n``, ``\\x1b``, ``\\u2028``):
    a stored label can never print a line of its own (``FAKE overall: PASS``) or move the cursor."""
    import unicodedata

    if not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in s):
        return s
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in s)


def _cell(v: Any, width: int = 40) -> str:
    s = "NULL" if v is None else (json.dumps(v, default=str) if isinstance(v, (list, dict)) else printable(str(v)))
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(t: pa.Table, max_rows: int | None = None) -> str:
    """A plain-text table of ``t`` (all rows unless ``max_rows``)."""
    rows = t.to_pylist()
    shown = rows if max_rows is None else rows[:max_rows]
    cols = t.column_names
    cells = [[_cell(r[c]) for c in cols] for r in shown]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    more = len(rows) - len(shown)
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{f', {more} not shown' if more else ''})")
    return "\n".join(out)


def write_result(t: pa.Table, fmt: str, output: str | None, flag: str = "--output") -> None:
    out = output_path(output, fmt, flag)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        write_file(out, lambda p: pq.write_table(t, p), flag)
        return
    if fmt == "csv":
        import pyarrow.csv as pcsv

        flat = t
        for i, f in enumerate(t.schema):  # nested columns (lists) are written as JSON text
            if pa.types.is_nested(f.type):
                flat = flat.set_column(i, f.name, pa.array([json.dumps(v, default=str) if v is not None else None
                                                            for v in t.column(i).to_pylist()], pa.string()))
        buf = io.BytesIO()
        pcsv.write_csv(flat, buf)
        text = buf.getvalue().decode()
    elif fmt == "json":
        text = json_text(t.to_pylist())
    else:
        text = format_table(t) + "\n"
    write_text(text, out, flag)
