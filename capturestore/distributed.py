"""Comparisons on a Dask cluster: ``compare_runs(..., client=...)``, ``capturestore compare --scheduler``.

The per-prompt work of a comparison (read one prompt's captures of every run, run every
comparator's ``map``) becomes one Dask task per prompt. A worker opens the store itself (a
Store pickles as its path or URL), reads the arrays straight from it and returns each
comparator's ``PromptResult``: the prompt's rows and its partial state. Comparators are a
map/reduce (``capturestore.comparators.base``): ``map`` leaves ``self`` as prepared, so a worker
runs every prompt through the same prepared comparators and the client hands the partials to
``reduce`` in prompt order, exactly as the single-process loop does; the stored results are the
same. A worker checks after each task that ``map`` changed nothing of its comparators (the
pickled state, the comparison context aside): a comparator keeping evidence in ``self`` (one
written before map/reduce, overriding ``compare``) is refused in one line naming it, since
its evidence would stay on the worker.

Only the client writes, as results arrive (``analysis.HeldRows``: the rows of at most
``analysis.ROWS_HELD_PROMPTS`` prompts are held, then written; the comparison is invisible
until its ``comparisons`` row commits it). Each prompt's result arrives once (a task that ran
twice, after its worker died, is one future with one result).
"""
from __future__ import annotations

import pickle
from typing import Callable, Iterator

_WORKER_STATE: dict[str, tuple] = {}  # comparison id -> (context, comparators, their states) as prepared, per worker
SCHEDULER_TIMEOUT_S = 10


def connect(address: str, timeout: float = SCHEDULER_TIMEOUT_S):
    """A ``dask.distributed.Client`` of the scheduler at ``address``; ValueError in one line when
    nothing answers there within ``timeout`` seconds."""
    try:
        from dask.distributed import Client
    except ImportError:
        raise ValueError("--scheduler needs dask.distributed: pip install 'capturestore[dask]'") from None
    from distributed.comm import get_address_host_port

    try:  # a malformed address is said at once (Client would wait, then complain from __del__)
        get_address_host_port(address)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--scheduler {address!r} is not a scheduler address (tcp://HOST:PORT): "
                         f"{' '.join(str(e).split())}") from None
    try:
        return Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"Dask scheduler {address} does not answer within {timeout:g} s ({why})") from None


def compare_prompts(client, context, active: list, prompt_ids: list,
                    progress: Callable | None = None) -> Iterator[tuple[int, str, list]]:
    """(index, prompt id, every comparator's ``PromptResult``) of each prompt as its Dask task
    finishes (in the order they finish, not prompt order)."""
    with client.as_current():  # the given client, whether or not it is the default one
        yield from _compare_prompts(client, context, active, prompt_ids, progress)


def _compare_prompts(client, context, active: list, prompt_ids: list,
                     progress: Callable | None) -> Iterator[tuple[int, str, list]]:
    from dask.distributed import as_completed

    blob = pickle.dumps((context, active))  # the prepared state, the same starting point for every task
    # a task, not scattered data: should the worker holding it die, the scheduler recomputes it
    # from the graph (scattered data would be lost, and every prompt task with it)
    state = client.submit(_prepared, blob, key=f"{context.comparison_id}-prepared", pure=False)
    futures = [client.submit(_prompt_task, context.comparison_id, state, pid, key=f"{context.comparison_id}-{i}",
                             pure=False, retries=2) for i, pid in enumerate(prompt_ids)]
    index = {f.key: i for i, f in enumerate(futures)}
    try:
        for n, fut in enumerate(as_completed(futures), 1):
            i = index[fut.key]
            results = fut.result()
            fut.release()
            if progress:
                progress(f"compared prompt {n}/{len(prompt_ids)} ({prompt_ids[i]}) on the cluster")
            yield i, prompt_ids[i], results
    finally:
        for f in futures:
            f.cancel()


def _prepared(blob: bytes) -> bytes:
    return blob


def _prompt_task(cid: str, blob: bytes, pid: str) -> list:
    """On a worker: one prompt through the prepared comparators, which it must leave as they were."""
    from capturestore.analysis import compare_prompt

    if cid not in _WORKER_STATE:
        _WORKER_STATE.clear()  # one comparison at a time per worker process keeps memory bounded
        context, prepared = pickle.loads(blob)
        _WORKER_STATE[cid] = (context, prepared, [comparator_state(c) for c in prepared])
    context, prepared, states = _WORKER_STATE[cid]
    results = compare_prompt(context, prepared, pid)
    for c, before in zip(prepared, states):
        if comparator_state(c) != before:
            _WORKER_STATE.clear()  # its state is spoilt for the next prompt too
            raise ValueError(f"comparator {c.name} changed its own state while comparing prompt {pid}: it keeps "
                             f"evidence in self, which stays on the Dask worker; return it as the partial of "
                             f"map() and combine it in reduce() (capturestore.comparators.base) to run it on Dask")
    return results


def comparator_state(c) -> bytes:
    """The pickled state of comparator ``c`` but its comparison context (which holds the store)."""
    return pickle.dumps({k: v for k, v in vars(c).items() if k != "context"})
