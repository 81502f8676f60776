"""docs/tables.md against the schemas declared in code: every declared table is documented with
its columns in order (and its schema version), and the docs name no column the code lacks."""
import re
from pathlib import Path

import pytest

from capturestore.comparators import declared_tables
from capturestore.tables import SCHEMAS

DOC = Path(__file__).resolve().parents[1] / "docs" / "tables.md"


def _outside_parentheses(cell: str) -> str:
    out, depth = [], 0
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def documented_tables(text: str) -> dict[str, dict]:
    """{view: {"version": int | None, "columns": [...]}} from the markdown tables' rows: column
    names are the backticked names outside parentheses of the last cell (notes go in parentheses)."""
    out = {}
    for line in text.splitlines():
        # one row may document several tables of one schema: | `a`, `b` | version | ... | columns |
        m = re.match(r"^\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)*) \|(.*)\|\s*$", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split(" | ")]
        version = int(cells[0]) if len(cells) == 3 and cells[0].isdigit() else None
        cols = re.findall(r"`([a-z_][a-z_0-9]*)`", _outside_parentheses(cells[-1]))
        for name in re.findall(r"`([a-z_0-9]+)`", m.group(1)):
            out[name] = {"version": version, "columns": cols}
    return out


DOCUMENTED = documented_tables(DOC.read_text())
DECLARED = declared_tables()


@pytest.mark.parametrize("table", sorted(DECLARED))
def test_every_declared_comparison_table_is_documented_with_its_columns_and_version(table):
    spec = DECLARED[table]
    assert table in DOCUMENTED, f"docs/tables.md has no row for the declared table {table}"
    doc = DOCUMENTED[table]
    assert doc["columns"] == spec.schema.names, (
        f"{table}: docs list {doc['columns']}, code declares {spec.schema.names}")
    assert doc["version"] == spec.version, f"{table}: docs say version {doc['version']}, code declares {spec.version}"


@pytest.mark.parametrize("table", sorted(SCHEMAS))
def test_run_tables_are_documented_with_their_columns(table):
    assert DOCUMENTED[table]["columns"] == SCHEMAS[table].names


def test_the_parser_sees_a_column_missing_from_the_docs():
    """The check can fail: a row without one declared column differs from the schema."""
    row = DOC.read_text().splitlines()
    line = next(ln for ln in row if ln.startswith("| `kv_gen_bc` |"))
    broken = documented_tables(line.replace("`n_prompts`, ", "").replace(", `n_prompts`", ""))
    assert broken["kv_gen_bc"]["columns"] != DECLARED["kv_gen_bc"].schema.names
    assert documented_tables(line)["kv_gen_bc"]["columns"] == DECLARED["kv_gen_bc"].schema.names
