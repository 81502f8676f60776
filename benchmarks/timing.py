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
