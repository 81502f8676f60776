"""A function run in a child forked from the test's process, its result put on a queue: for
what a forked child inherits (a thread pool object without its threads)."""
from __future__ import annotations

import multiprocessing


def result_in_forked_child(target, *args, timeout: float = 60):
    """What ``target(queue, *args)``, run in a forked child, puts on ``queue``; ``queue.Empty``
    when nothing comes within ``timeout`` seconds (a child that hangs is killed)."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    try:
        return q.get(timeout=timeout)
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
