"""Timing (and peak-memory) helpers shared by the benchmark scripts (run as
`python benchmarks/bench_*.py`, so this folder is on sys.path)."""
import resource
import time


def peak_rss_mib() -> float:
    """This process image's peak RSS (VmHWM), MiB. Not getrusage's ru_maxrss: it survives exec,
    so a child started by a parent holding 9 GiB reads 9 GiB before and after its own work."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc: the lifetime peak


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
