"""Comparisons on a Dask cluster: ``compare_runs(..., client=...)``, ``capturestore compare --scheduler``.

The per-prompt work of a comparison (read one prompt's captures of every run, run every
comparator's ``compare``) becomes one Dask task per prompt. A worker opens the store itself
(a Store pickles as its path or URL), reads the arrays straight from it and returns the rows.
Comparators keep evidence across prompts for their verdicts (lists of errors, per-module
accumulators), so the task also returns what ``compare`` added to its comparators' state,
measured against the prepared state it started from; the client merges those additions in
prompt order, exactly as if it had run the prompts itself, so ``finish`` and ``verdict`` see the
same state and the stored results are the same bit for bit. Additions are appended list items,
new dict keys and the same inside attribute objects; a comparator whose ``compare`` changes
anything else (a counter, an array in place) is refused in one line naming the attribute.

Only the client writes: results arrive as futures, each prompt's once (a task that ran twice,
after its worker died, is one future with one result), and the tables and the ``comparisons``
row are written after the last prompt, as in the single-process path.
"""
from __future__ import annotations

import copy
import pickle
from typing import Any, Callable, Iterator

_WORKER_STATE: dict[str, tuple] = {}  # comparison id -> (context, comparators) as prepared, per worker process
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
                    progress: Callable | None = None) -> Iterator[list]:
    """Each prompt's comparator outputs, in prompt order, computed by Dask tasks; the additions of
    every task to the comparators' state are merged into ``active`` before its outputs are yielded."""
    with client.as_current():  # the given client, whether or not it is the default one
        yield from _compare_prompts(client, context, active, prompt_ids, progress)


def _compare_prompts(client, context, active: list, prompt_ids: list, progress: Callable | None) -> Iterator[list]:
    from dask.distributed import as_completed

    blob = pickle.dumps((context, active))  # the prepared state, the same starting point for every task
    # a task, not scattered data: should the worker holding it die, the scheduler recomputes it
    # from the graph (scattered data would be lost, and every prompt task with it)
    state = client.submit(_prepared, blob, key=f"{context.comparison_id}-prepared", pure=False)
    futures = [client.submit(_prompt_task, context.comparison_id, state, pid, key=f"{context.comparison_id}-{i}",
                             pure=False, retries=2) for i, pid in enumerate(prompt_ids)]
    index = {f.key: i for i, f in enumerate(futures)}
    done: dict[int, tuple] = {}
    following = 0
    try:
        for n, fut in enumerate(as_completed(futures), 1):
            done[index[fut.key]] = fut.result()
            fut.release()
            if progress:
                progress(f"compared prompt {n}/{len(prompt_ids)} ({prompt_ids[index[fut.key]]}) on the cluster")
            while following in done:  # in prompt order, as the single-process loop
                outputs, additions = done.pop(following)
                for c, add in zip(active, additions):
                    _merge(c.__dict__, add, f"comparator {c.name}")
                yield outputs
                following += 1
    finally:
        for f in futures:
            f.cancel()


def _prepared(blob: bytes) -> bytes:
    return blob


def _prompt_task(cid: str, blob: bytes, pid: str) -> tuple[list, list]:
    """On a worker: one prompt through fresh copies of the prepared comparators."""
    from capturestore.analysis import compare_prompt

    if cid not in _WORKER_STATE:
        _WORKER_STATE.clear()  # one comparison at a time per worker process keeps memory bounded
        _WORKER_STATE[cid] = pickle.loads(blob)
    context, prepared = _WORKER_STATE[cid]
    store = context.store
    ctx, active = copy.deepcopy((context, prepared), memo={id(store): store})
    outputs = compare_prompt(ctx, active, pid)
    additions = [_additions(p.__dict__, c.__dict__, f"comparator {c.name}") for p, c in zip(prepared, active)]
    return outputs, additions


# ---- what compare() added, and merging it -------------------------------------------------------

_SKIP = ("context",)  # the comparison context (and the store in it) is the client's own


def _plain_object(x: Any) -> bool:
    return hasattr(x, "__dict__") and not isinstance(x, type) and type(x).__module__.split(".")[0] not in (
        "numpy", "torch", "pyarrow", "builtins")


def _additions(before: Any, after: Any, where: str) -> Any:
    """What ``after`` holds beyond ``before`` (None: nothing): ("extend", items), ("dict", {key: sub}),
    ("obj", sub), ("new", value) for keys ``before`` lacks. ValueError for any other change."""
    if isinstance(after, list) and isinstance(before, list) and len(after) >= len(before):
        for i, (b, a) in enumerate(zip(before, after)):
            if _additions(b, a, f"{where}[{i}]") is not None:
                raise ValueError(f"{where}[{i}] was changed in place by compare(); it cannot run on Dask")
        return ("extend", after[len(before):]) if len(after) > len(before) else None
    if isinstance(after, dict) and isinstance(before, dict):
        if set(before) - set(after):
            raise ValueError(f"{where}: compare() removed keys {sorted(map(str, set(before) - set(after)))[:3]}; "
                             f"it cannot run on Dask")
        out = {}
        for k, v in after.items():
            if isinstance(k, str) and k in _SKIP:
                continue
            if k not in before:
                out[k] = ("new", v)
            else:
                sub = _additions(before[k], v, f"{where}.{k}")
                if sub is not None:
                    out[k] = sub
        return ("dict", out) if out else None
    if _plain_object(after) and type(before) is type(after):
        sub = _additions(before.__dict__, after.__dict__, where)
        return None if sub is None else ("obj", sub)
    if before is after or _same(before, after):
        return None
    raise ValueError(f"{where} was changed by compare() (not by appending); this comparator cannot run on Dask")


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and pickle.dumps(a) == pickle.dumps(b)
    except Exception:  # noqa: BLE001 - unpicklable: it did not travel, so it cannot have changed
        return False


def _merge(target: Any, add: Any, where: str) -> None:
    """Apply ``_additions`` output to the client's ``target`` (a list, a dict or an object's __dict__)."""
    if add is None:
        return
    kind, what = add
    if kind == "extend":
        target.extend(what)
    elif kind == "obj":
        _merge(target.__dict__ if not isinstance(target, dict) else target, what, where)
    elif kind == "dict":
        for k, sub in what.items():
            if sub[0] == "new":
                if k in target:  # an earlier prompt added the key: merge what this one put under it
                    _merge_value(target[k], sub[1], f"{where}.{k}")
                else:
                    target[k] = sub[1]
            else:
                _merge(target[k], sub, f"{where}.{k}")


def _merge_value(target: Any, value: Any, where: str) -> None:
    """Merge a whole structure a task made afresh into what earlier prompts made under the same key."""
    if isinstance(target, list) and isinstance(value, list):
        target.extend(value)
    elif isinstance(target, dict) and isinstance(value, dict):
        for k, v in value.items():
            if k in target:
                _merge_value(target[k], v, f"{where}.{k}")
            else:
                target[k] = v
    elif _plain_object(target) and type(target) is type(value):
        _merge_value(target.__dict__, value.__dict__, where)
    elif not _same(target, value):
        raise ValueError(f"{where}: two prompts set different values; this comparator cannot run on Dask")
