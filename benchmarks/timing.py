"""Timing helper shared by the benchmark scripts (run as `python benchmarks/bench_*.py`, so this
folder is on sys.path)."""
import time


def best_of(fn, repeat: int) -> float:
    """Fastest of ``repeat`` calls of ``fn``, in seconds: the least disturbed by other load."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_of_interleaved(fns: dict, repeat: int) -> dict:
    """Fastest of ``repeat`` calls of each of ``fns`` ({name: fn}), called in turn (a, b, c, a, b,
    c, ...), in seconds: a burst of other load hits all of them alike, not one best_of series."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best
