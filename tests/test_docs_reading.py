"""docs/reading.md runs as written: its first block writes a store with capturestore, every
later block reads it (and a format-1 store) in a process where capturestore cannot be imported."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "reading.md"
BLOCK_LIBRARY = (
    "import sys\n"
    "for _name in ('capturestore', 'metrics', 'extractors', 'nki_fp8', 'reports'):\n"
    "    sys.modules[_name] = None  # import fails: a plain reader\n"
)


def python_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def run(code, cwd, name):
    path = cwd / name
    path.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(path)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_reading_doc_examples_run_without_the_library(tmp_path):
    pytest.importorskip("xarray")
    pytest.importorskip("torch")
    blocks = python_blocks()
    assert len(blocks) >= 6 and "from capturestore" in blocks[0]
    assert not any("capturestore import" in b or "import capturestore" in b for b in blocks[1:])
    shutil.copytree(ROOT / "tests" / "fixtures" / "format1_store", tmp_path / "old-store")
    setup = run(blocks[0], tmp_path, "setup.py")
    assert setup.returncode == 0, setup.stderr[-3000:]
    plain = run(BLOCK_LIBRARY + "\n".join(blocks[1:]), tmp_path, "plain_reader.py")
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = plain.stdout
    assert "uint16 ('layer', 'kv_head', 'position', 'head_dim') bfloat16" in out
    assert "('layer', 'kv_head', 'seq', 'head_dim') ('token',)" in out  # the format-1 names, renamed after
    assert re.search(r"model\.layers\.\d head \d position \d: k_linf \d", out), out


def test_the_library_blocker_really_blocks(tmp_path):
    """The plain-reader process cannot import capturestore, or the test above proves nothing."""
    res = run(BLOCK_LIBRARY + "import capturestore\n", tmp_path, "probe.py")
    assert res.returncode != 0 and ("ModuleNotFoundError" in res.stderr or "ImportError" in res.stderr), res.stderr
