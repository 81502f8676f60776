"""benchmarks/timing.py: the helpers every benchmark shares."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

KEEP = """
import sys
sys.path.insert(0, {bench!r})
import numpy as np
from timing import keep_freed_memory

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))

line = keep_freed_memory() if sys.argv[1] == "keep" else ""
before = rss_kib()
a = np.ones(64 * 2**20, np.uint8)  # 64 MiB: above glibc's largest mmap threshold (32 MiB)
held = rss_kib()
del a
print(held - before, rss_kib() - before)
print("said:" + line)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="keep_freed_memory sets glibc's malloc options (Linux with glibc only)")
def test_keep_freed_memory_keeps_a_freed_block_in_the_process(tmp_path):
    """glibc gives a freed 64 MiB block back to the kernel (RSS falls); after keep_freed_memory it
    stays the process's, for its next allocation (RSS stays), and the benchmark says so. The
    children run without allocator settings of this environment (another malloc preloaded, or
    glibc tunables), which would decide the outcome instead of the call."""
    script = tmp_path / "keep.py"
    script.write_text(KEEP.format(bench=str(BENCH)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    out = {}
    for mode in ("default", "keep"):
        res = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60,
                             check=True, env=env)
        nums, said = res.stdout.splitlines()
        held, after = map(int, nums.split())
        out[mode] = (said.removeprefix("said:"), held, after)
    mib = 2**10
    assert out["default"][1] >= 60 * mib and out["default"][2] < 8 * mib, out  # touched, then returned
    assert out["keep"][1] >= 60 * mib and out["keep"][2] >= 60 * mib, out  # touched, and kept
    assert out["keep"][0] == "allocator: freed memory kept in the process (timing.keep_freed_memory)"
    assert out["default"][0] == ""
