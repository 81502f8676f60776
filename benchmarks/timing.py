"""Timing (and peak-memory) helpers shared by the benchmark scripts (run as
`python benchmarks/bench_*.py`, so this folder is on sys.path)."""
import ctypes
import resource
import sys
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


def keep_freed_memory() -> str:
    """Keep the memory this process frees for its own later allocations (glibc: no ``mmap`` for
    large blocks, ``M_MMAP_MAX`` 0; no trimming of the heap, ``M_TRIM_THRESHOLD`` 2 GiB), and
    return one line saying so for the benchmark's output ("" where it could not be set).

    Why: this machine is a VM with free page reporting (Firecracker, virtio-balloon; the kernel
    log says "Free page reporting enabled"): memory a process returns to the kernel is handed
    back to the host within seconds, and the next first touch of such a page faults out to the
    host. 3 GiB touched by a fresh process: 19.2 s (0.17 GB/s); the same right after: 0.20 s;
    12 fresh 5 MB result arrays: 0.19 s, 0.01 s once the process had freed such memory before.
    A timing that allocates then measures the host's paging, not the code (``np.fromfile`` of
    256 MiB read at 0.22 GB/s, a store write at 0.20x instead of 0.44x), and which side of a
    ratio pays depends on what ran seconds before. With this set both sides of every ratio
    reuse the process's memory after their first round. What it covers: the main arena (the
    main thread's allocations, and every block once a thread's arena is full); a worker
    thread's own arena still gives back a heap it has emptied whatever the trim threshold
    (glibc's ``heap_trim``), so memory freed by pool threads may still go back. Not for
    processes whose peak RSS is measured: a heap that is never trimmed keeps its high-water mark."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**31 - 1) == 1  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return ""
    return "allocator: freed memory kept in the process (timing.keep_freed_memory)" if ok else ""
