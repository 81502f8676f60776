"""How values cross from vLLM workers to the caller: tensors in-process, bytes + dtype + shape across.

``collective_rpc`` results from a separate engine process come back undecoded when they hold
tensors (ENGINES.md), so a worker method encodes what it returns with ``encode_tensor`` and the
caller decodes with ``decode_tensor``. In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
worker) the tensor itself is passed, no copy. vLLM is not imported here.
"""
from __future__ import annotations

import warnings

import torch

EXTENSION_QUALNAME = "extractors.vllm_rpc.KVCaptureWorkerExtension"
# vLLM loads custom logits processors as "<module>:<class>" (LLM(logits_processors=[...])).
TEACHER_FORCING_QUALNAME = "extractors.vllm_teacher:TeacherForcingLogitsProcessor"


def encode_tensor(t: torch.Tensor, transport: str):
    """A tensor as it crosses the RPC boundary: itself in-process, bytes + dtype + shape across."""
    if transport == "tensor":
        return t
    t = t.detach().contiguous()
    raw = t.view(torch.uint8) if t.dim() and t.element_size() > 1 else t
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": raw.numpy().tobytes()}


def decode_tensor(obj) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if not isinstance(obj, dict) or "data" not in obj:
        raise ValueError(f"RPC result is neither a tensor nor an encoded tensor: {type(obj).__name__}")
    dtype = getattr(torch, obj["dtype"])
    with warnings.catch_warnings():  # read-only bytes: we only ever gather from them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(obj["data"], dtype=torch.uint8) if obj["data"] else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(obj["shape"])


def rpc_transport(llm) -> str:
    """'tensor' when the worker lives in this process (no serialisation), else 'bytes'."""
    try:
        engine = llm.llm_engine
        inproc = type(engine.engine_core).__name__ == "InprocClient"
        backend = engine.vllm_config.parallel_config.distributed_executor_backend
        return "tensor" if inproc and backend in (None, "uni") else "bytes"
    except AttributeError:
        return "bytes"


def call_workers(llm, method: str, **kwargs) -> list:
    """``llm.collective_rpc(method, kwargs=...)``: one answer per rank. An engine built without
    the worker extension is refused in one line that says how to build it."""
    try:
        return llm.collective_rpc(method, kwargs=kwargs)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        # vLLM answers a method the worker lacks with NotImplementedError("Method 'x' is not
        # implemented."), re-raised as a RuntimeError carrying that text from a worker process.
        text = str(e)
        if repr(method) not in text and method not in text or not (
                isinstance(e, AttributeError) or "not implemented" in text):
            raise
        raise RuntimeError(f"vLLM worker has no {method!r}: start the engine with "
                           f"extractors.vllm_rpc.make_llm(model, ...) or LLM(..., "
                           f"worker_extension_cls={EXTENSION_QUALNAME!r}, "
                           f"logits_processors=[{TEACHER_FORCING_QUALNAME!r}])") from None
