"""Worker-side helpers (``llm.collective_rpc``) that record the request layout of every forward an
engine's worker runs: which requests, and which of their positions, each forward held
(``extractors.vllm_modules.forward_segments``). Importable by a worker process (the TP tests'
engine subprocesses put the repository on ``PYTHONPATH``), so a multiprocess executor pickles
them by reference."""
from __future__ import annotations


def watch_layout(worker):
    """Record every forward's request layout (``forward_segments``) with its positions."""
    from extractors.vllm_modules import forward_segments

    seen = []

    def pre(module, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        seen.append([(r, pos[lo:hi].tolist()) for r, lo, hi in forward_segments(worker.model_runner, pos.numel())])

    worker._layout_watch = (worker.model_runner.model.register_forward_pre_hook(pre, with_kwargs=True), seen)
    return True


def unwatch_layout(worker):
    """Stop recording; ``[[(request id, [positions])] per forward]`` since ``watch_layout``."""
    handle, seen = worker.__dict__.pop("_layout_watch")
    handle.remove()
    return seen
