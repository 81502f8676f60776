"""Pieces the Dask tests ship to worker processes (importable there: spawned workers get the
test process's sys.path)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from capturestore.comparators import Comparator


class StallOnceComparator(Comparator):
    """Writes no table. The first time it meets ``prompt_id`` it records its worker's pid in
    ``marker`` and stalls, so a test can kill that worker mid-task; later attempts run through."""

    name = "stall_once"

    def __init__(self, marker: str, prompt_id: str):
        self.marker, self.prompt_id = marker, prompt_id

    def compare(self, prompt):
        if prompt.prompt_id == self.prompt_id and not Path(self.marker).exists():
            Path(self.marker).write_text(str(os.getpid()))
            time.sleep(300)
        return {}
