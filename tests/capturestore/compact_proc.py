"""``capturestore compact`` run as its own process by test_compact: it SIGKILLs itself right after
the named step (compaction.compact's ``on_step``), as a crash there would stop it.

    compact_proc.py STORE KILL_STEP TABLE...     KILL_STEP '-' runs to the end; prints each step
"""
from __future__ import annotations

import os
import signal
import sys


def main(store_path: str, kill_at: str, tables: list[str]) -> None:
    from capturestore import Store

    def step(name: str) -> None:
        print(name, flush=True)
        if name == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    Store.open(store_path, create=False).compact(tables=tables or None, grace_s=0, on_step=step)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
