"""compare_runs run as its own process by tests/capturestore/test_atomic_compare.py.

    compare_proc.py STORE EXPECTED ACTUAL BASELINE kill N   SIGKILL itself once N table segments are written
    compare_proc.py STORE EXPECTED ACTUAL BASELINE hold N    once N are written print "paused", wait for stdin

Every segment write goes through Store.append_table; the wrapper counts them and prints
"wrote <table>" after each, so the parent knows where the process stopped.
"""
from __future__ import annotations

import os
import signal
import sys


def main(store_path: str, expected: str, actual: str, baseline: str, mode: str, n: int) -> None:
    from capturestore import Store
    from capturestore.analysis import compare_runs

    real = Store.append_table
    written = []

    def stop_here():
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("paused", flush=True)
        sys.stdin.readline()

    def append_table(self, name, rows):
        if not written and n == 0:  # the pending lock is taken, nothing written yet
            stop_here()
        path = real(self, name, rows)
        written.append(name)
        print("wrote", name, flush=True)
        if len(written) == n:  # n = all of them: after the comparisons row, before the pending file goes
            stop_here()
        return path

    Store.append_table = append_table
    res = compare_runs(Store.open(store_path), expected_run=expected, actual_run=actual, baseline_run=baseline)
    print("committed", res.comparison_id, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6], int(sys.argv[6]))
