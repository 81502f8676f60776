"""Raw logits of vLLM requests, recorded inside the worker; teacher forcing through the decode path.

Why not logprobs: full-vocabulary logprobs come back from vLLM as Python objects, one list append
per (position, vocab entry): at a 32k vocabulary that is most of the capture time and GiBs of
RSS per prompt, at 128k it does not fit. Here nothing is asked of vLLM's logprobs machinery:

- ``LogitsCaptureMixin`` (part of ``extractors.vllm_rpc.KVCaptureWorkerExtension``) wraps the
  model runner's ``_sample`` and records, for the requests being captured, their rows of the raw
  logits ``[vocab]`` (the lm_head output after the TP gather, in the model dtype) before the
  sampler converts, masks or processes them, plus the engine's own greedy token of each row (the
  sampler's greedy op on the raw row). Rows are keyed by the index of the token they predict.
- ``extractors.vllm_teacher.TeacherForcingLogitsProcessor`` then makes the sampler pick the
  teacher token, so one ``generate`` per batch runs every decode step on the teacher's tokens:
  no re-asks after a divergence, and divergences are still known from the recorded greedy tokens.
- Prefill mode (prompt + teacher tokens fed as one prompt, for prefill-only checks) asks for
  ``prompt_logprobs=0`` only to make vLLM hand the hidden states of every prompt position to the
  runner's ``_get_prompt_logprobs_dict``; the wrapper takes captured requests out of vLLM's
  prompt-logprobs work and runs the lm_head on the wanted positions alone.

A request is captured when its ``SamplingParams.extra_args`` holds
``{"capturestore": {"from": i, "to": j, "teacher": [...] (optional)}}``: rows predicting tokens
``i <= index < j`` are kept. The caller takes them with one RPC per batch
(``take_request_logits``), as one ``[rows, vocab]`` tensor (bytes + dtype + shape across
processes, see ``extractors.vllm_transport``); taking frees them on the worker.

vLLM is imported lazily: this module imports without it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from extractors.vllm_transport import (
    TEACHER_FORCING_QUALNAME,
    call_workers,
    decode_tensor,
    encode_tensor,
    rpc_transport,
)

CAPTURE_KEY = "capturestore"
DEFAULT_MAX_CAPTURED = 256  # requests whose rows a worker holds (untaken) before dropping the oldest

__all__ = ["CAPTURE_KEY", "LogitsCaptureMixin", "VllmForcedLogits", "capture_sampling_params",
           "check_forcing_inputs", "take_vllm_request_logits", "vllm_teacher_forced_logits"]


def _capture_spec(params) -> dict | None:
    extra = getattr(params, "extra_args", None) if params is not None else None
    spec = extra.get(CAPTURE_KEY) if isinstance(extra, dict) else None
    return spec if isinstance(spec, dict) else None


def teacher_tokens_of(params) -> list[int] | None:
    """The teacher tokens a request asks to be forced, or None; malformed ones raise ValueError."""
    spec = _capture_spec(params)
    if spec is None or spec.get("teacher") is None:
        return None
    teacher = spec["teacher"]
    if not isinstance(teacher, (list, tuple)) or not all(isinstance(t, int) and t >= 0 for t in teacher):
        raise ValueError(f"extra_args[{CAPTURE_KEY!r}]['teacher'] must be a list of non-negative token ids, "
                         f"got {str(teacher)[:80]}")
    return list(teacher)


# ---------------------------------------------------------------------------------- worker side


class LogitsCaptureMixin:
    """Worker-side recording of raw logits rows (mixed into the vLLM worker; ``self`` is it).

    RPC methods (``llm.collective_rpc(name, kwargs=...)``, one answer per rank):
      enable_logits_capture(max_requests)  -> info: start recording (no cost before)
      get_logits_capture_info()            -> {"teacher_forcing", "vocab_size", "rank", ...}
      take_request_logits(request_ids)     -> rows of those requests, removed from the worker
    State lives in ``self._lcap``.
    """

    def _lcap_state(self) -> dict:
        state = getattr(self, "_lcap", None)
        return state if state is not None else self._lcap_enable()

    def _lcap_enable(self, max_requests: int = DEFAULT_MAX_CAPTURED) -> dict:
        runner = self.model_runner
        state = {"requests": OrderedDict(), "max_requests": max_requests}
        self._lcap = state
        sample, prompt_logprobs = runner._sample, runner._get_prompt_logprobs_dict

        def sample_with_capture(logits, spec_decode_metadata, *args, **kwargs):
            if logits is not None and spec_decode_metadata is None:
                self._lcap_record_sampled(logits)
            return sample(logits, spec_decode_metadata, *args, **kwargs)

        def prompt_logprobs_with_capture(hidden_states, num_scheduled_tokens, *args, **kwargs):
            ours = self._lcap_take_prompt_requests()
            try:
                result = prompt_logprobs(hidden_states, num_scheduled_tokens, *args, **kwargs)
            finally:
                runner.num_prompt_logprobs.update(ours)
            if ours:
                self._lcap_record_prompt(hidden_states, num_scheduled_tokens, ours)
            return result

        runner._sample = sample_with_capture
        runner._get_prompt_logprobs_dict = prompt_logprobs_with_capture
        return state

    def _lcap_store(self, req_id: str, spec: dict, first: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` (predicting token indices ``first, first + 1, ...``) into the request's
        buffer ``[to - from, vocab]``, allocated on its first row: one copy per row, none later."""
        reqs = self._lcap["requests"]
        rec = reqs.get(req_id)
        if rec is None:
            n = int(spec["to"]) - int(spec["from"])
            rec = reqs[req_id] = {"from": int(spec["from"]), "rows": torch.empty((n, rows.shape[-1]), dtype=rows.dtype),
                                  "greedy": torch.full((n,), -1, dtype=torch.int64),
                                  "filled": torch.zeros(n, dtype=torch.bool)}
            while len(reqs) > self._lcap["max_requests"]:
                reqs.popitem(last=False)
        k = first - rec["from"]
        dst = rec["rows"][k:k + len(rows)]
        dst.copy_(rows)  # a recomputed position (preemption) overwrites the old row
        rec["greedy"][k:k + len(rows)] = self.model_runner.sampler.greedy_sample(dst.to(torch.float32)).view(-1)
        rec["filled"][k:k + len(rows)] = True

    def _lcap_record_sampled(self, logits: torch.Tensor) -> None:
        """Rows of ``logits [num_reqs, vocab]`` (input-batch order) of captured requests whose
        prefill is complete; row i predicts the token at index ``computed + scheduled``. Copied
        before the sampler's processors, which write in place."""
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        discard = runner.discard_request_mask.np[:n]  # partial prefills: their sample is thrown away
        seq_lens = runner.optimistic_seq_lens_cpu[:n].tolist()
        for i, req_id in enumerate(batch.req_ids[:n]):
            if discard[i]:
                continue
            req = runner.requests.get(req_id)
            spec = _capture_spec(getattr(req, "sampling_params", None))
            if spec is not None and spec["from"] <= seq_lens[i] < spec["to"]:
                self._lcap_store(req_id, spec, seq_lens[i], logits[i:i + 1])

    def _lcap_take_prompt_requests(self) -> dict[str, int]:
        """Captured requests out of vLLM's prompt-logprobs work for this step (put back after)."""
        runner = self.model_runner
        ours = {}
        for req_id in list(runner.num_prompt_logprobs):
            if _capture_spec(getattr(runner.requests.get(req_id), "sampling_params", None)) is not None:
                ours[req_id] = runner.num_prompt_logprobs.pop(req_id)
        return ours

    def _lcap_record_prompt(self, hidden_states: torch.Tensor, num_scheduled_tokens: dict, ours: dict) -> None:
        """For each captured request in prefill: lm_head on the wanted positions of this chunk.

        Hidden state at position p predicts token p + 1 (vLLM's prompt-logprobs convention);
        this chunk covers positions ``computed .. computed + scheduled - 1`` of the prompt."""
        runner = self.model_runner
        for req_id in list(ours):
            n = num_scheduled_tokens.get(req_id)
            req = runner.requests.get(req_id)
            if n is None or req is None or req.prompt_token_ids is None:
                continue  # preempted in prefill: computed again later
            spec = _capture_spec(req.sampling_params)
            start, n_prompt = int(req.num_computed_tokens), len(req.prompt_token_ids)
            n_pos = min(n, n_prompt - 1 - start)  # positions whose next token is a prompt token
            if n >= n_prompt - start:
                del ours[req_id]  # prompt complete: nothing more to take from this request
            lo, hi = max(start, spec["from"] - 1), min(start + n_pos, spec["to"] - 1)
            if lo >= hi:
                continue
            offset = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
            logits = runner.model.compute_logits(hidden_states[offset + lo - start: offset + hi - start])
            if logits is None:  # a rank that does not receive the gathered logits
                continue
            self._lcap_store(req_id, spec, lo + 1, logits)

    # -------------------------------------------------------------- RPC methods

    def enable_logits_capture(self, max_requests: int = DEFAULT_MAX_CAPTURED) -> dict:
        self._lcap_state()["max_requests"] = int(max_requests)
        return self.get_logits_capture_info()

    def get_logits_capture_info(self) -> dict:
        from extractors.vllm_teacher import TeacherForcingLogitsProcessor

        procs = getattr(self.model_runner.input_batch, "logitsprocs", None)
        forcing = any(isinstance(p, TeacherForcingLogitsProcessor) for p in getattr(procs, "all", ()))
        mc = self.vllm_config.model_config
        return {"teacher_forcing": forcing, "vocab_size": int(mc.get_vocab_size()),
                "max_model_len": int(mc.max_model_len), "rank": int(getattr(self, "rank", 0)),
                "held": list(getattr(self, "_lcap", {}).get("requests", {}))}

    def take_request_logits(self, request_ids: Sequence[str], transport: str = "bytes",
                            with_rows: bool | None = None, keep: bool = False) -> dict:
        """The recorded rows of ``request_ids`` (user ids or engine ids), in one piece.

        Returns ``{"request_ids": engine ids, "positions": [[index predicted, ...] per request],
        "greedy": [[token, ...]], "logits": [sum of rows, vocab] encoded}``. ``with_rows`` None:
        rows from rank 0 only (after the TP gather every rank holds the same rows), ``logits``
        None elsewhere. Removes them from the worker unless ``keep``."""
        if with_rows is None:
            with_rows = int(getattr(self, "rank", 0)) == 0
        reqs = self._lcap_state()["requests"]
        resolved = [self._lcap_resolve(str(r)) for r in request_ids]
        positions, greedy, parts = [], [], []
        for req_id in resolved:
            rec = reqs[req_id] if keep else reqs.pop(req_id)
            filled = rec["filled"]
            whole = bool(filled.all())
            positions.append((torch.nonzero(filled).view(-1) + rec["from"]).tolist())
            greedy.append(rec["greedy"][filled].tolist())
            parts.append(rec["rows"] if whole and not keep else rec["rows"][filled])  # no copy when complete
        logits = None
        if with_rows and parts:
            # in-process: the buffers themselves; across processes: one piece of bytes
            logits = parts if transport == "tensor" else encode_tensor(torch.cat(parts), transport)
        return {"request_ids": resolved, "positions": positions, "greedy": greedy, "logits": logits}

    def _lcap_resolve(self, request_id: str) -> str:
        known = list(self._lcap["requests"])
        if request_id in self._lcap["requests"]:
            return request_id
        matches = [r for r in known if r.startswith(f"{request_id}-")]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ValueError(f"request {request_id!r}: no logits were captured for it on this worker (held: "
                             f"{known[:8]}{'...' if len(known) > 8 else ''}); capture needs "
                             f"SamplingParams.extra_args[{CAPTURE_KEY!r}] (see vllm_teacher_forced_logits), "
                             "and rows can be taken once")
        raise ValueError(f"request id {request_id!r} is ambiguous: {matches}")


# ---------------------------------------------------------------------------------- client side


@dataclass(frozen=True)
class VllmForcedLogits:
    """What one teacher-forced pass over a batch of prompts produced.

    logits: per prompt ``[teacher_token, vocab]`` raw logits (model dtype), row i predicting
    teacher token i (position ``len(prompt) + i - 1``). greedy: per prompt ``[teacher_token]``
    int64, the engine's own greedy token from each row. request_ids: vLLM's ids, for the KV
    (decode: the KV covers prompt + teacher - 1 tokens; prefill: prompt + teacher).
    num_cached_tokens: per prompt, the tokens vLLM served from its prefix cache.
    """

    logits: list
    greedy: list
    teacher: list
    request_ids: list
    mode: str
    num_cached_tokens: list

    @property
    def diverged_at(self) -> list:
        """Per prompt: the first teacher index where the engine's greedy token differs, or None."""
        out = []
        for g, t in zip(self.greedy, self.teacher):
            bad = (g != torch.as_tensor(t, dtype=g.dtype)).nonzero()
            out.append(int(bad[0, 0]) if len(bad) else None)
        return out


def check_forcing_inputs(prompts, teacher_tokens, vocab_size: int, max_model_len: int,
                         where: str = "teacher forcing") -> tuple[list[list[int]], list[list[int]]]:
    """Token-id lists of ``prompts`` and ``teacher_tokens`` after the checks that make a forced
    run meaningful; a violation raises ValueError naming the prompt, position and limit."""
    if len(prompts) != len(teacher_tokens):
        raise ValueError(f"{where}: {len(prompts)} prompts but {len(teacher_tokens)} teacher token lists")
    rows = []
    for i, (p, t) in enumerate(zip(prompts, teacher_tokens)):
        p = [int(x) for x in (p.tolist() if hasattr(p, "tolist") else p)]
        t = [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]
        if len(p) < 1 or len(t) < 1:
            raise ValueError(f"{where}, prompt {i}: needs >= 1 prompt token and >= 1 teacher token, "
                             f"got {len(p)} and {len(t)}")
        for what, ids in (("prompt", p), ("teacher", t)):
            bad = [(j, x) for j, x in enumerate(ids) if not 0 <= x < vocab_size]
            if bad:
                raise ValueError(f"{where}, prompt {i}: {what} token {bad[0][1]} at index {bad[0][0]} is outside "
                                 f"the vocabulary [0, {vocab_size}) ({len(bad)} such tokens)")
        if len(p) + len(t) > max_model_len:
            raise ValueError(f"{where}, prompt {i}: {len(p)} prompt + {len(t)} teacher tokens = {len(p) + len(t)} "
                             f"> max_model_len {max_model_len}; start the engine with a larger max_model_len "
                             "or shorten the prompt")
        rows.append((p, t))
    return [r[0] for r in rows], [r[1] for r in rows]


def capture_sampling_params(prompt_len: int, teacher: Sequence[int], mode: str):
    """The SamplingParams of one captured request (``mode`` "decode" or "prefill")."""
    from vllm import SamplingParams

    n = len(teacher)
    if mode == "decode":
        spec = {"from": prompt_len, "to": prompt_len + n, "teacher": list(teacher)}
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                              extra_args={CAPTURE_KEY: spec})
    if mode == "prefill":  # the teacher tokens are part of the prompt
        spec = {"from": prompt_len, "to": prompt_len + n}
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                              prompt_logprobs=0, extra_args={CAPTURE_KEY: spec})
    raise ValueError(f"teacher forcing mode must be 'decode' or 'prefill', got {mode!r}")


def enable_vllm_logits_capture(llm, max_requests: int = DEFAULT_MAX_CAPTURED) -> dict:
    """Start recording on every worker; returns rank 0's capture info."""
    return call_workers(llm, "enable_logits_capture", max_requests=int(max_requests))[0]


def take_vllm_request_logits(llm, request_ids: Sequence[str], keep: bool = False) -> tuple[list, list, list]:
    """Rank 0's recorded rows of ``request_ids``: (logits per request ``[rows, vocab]``, greedy per
    request ``[rows]`` int64, positions per request: the token index each row predicts).

    One RPC for all requests; other ranks (TP) drop theirs and send positions only, which must
    agree with rank 0's."""
    answers = call_workers(llm, "take_request_logits", request_ids=[str(r) for r in request_ids],
                           transport=rpc_transport(llm), keep=keep)
    first = answers[0]
    for r, other in enumerate(answers[1:], start=1):
        if other["positions"] != first["positions"]:
            raise RuntimeError(f"rank {r} recorded logits rows at other positions than rank 0 for {request_ids}")
    greedy = [torch.tensor(g, dtype=torch.int64) for g in first["greedy"]]
    if isinstance(first["logits"], list):  # in-process: one tensor per request already
        return first["logits"], greedy, first["positions"]
    flat = decode_tensor(first["logits"]) if first["logits"] is not None else None
    logits, s = [], 0
    for pos in first["positions"]:
        logits.append(flat[s:s + len(pos)] if flat is not None else None)
        s += len(pos)
    return logits, greedy, first["positions"]


def vllm_teacher_forced_logits(llm, prompts: Sequence[Sequence[int]], teacher_tokens: Sequence[Sequence[int]],
                               mode: str = "decode") -> VllmForcedLogits:
    """Raw logits of vLLM teacher-forced on ``teacher_tokens``, one pass per prompt.

    mode "decode": each prompt is prefilled, then every decode step runs on the next teacher
    token (the engine is made to sample it); row i comes from the step that predicts teacher
    token i. mode "prefill": prompt + teacher tokens are fed as one prompt (prefill kernels
    only). Either way vLLM computes no logprobs, and the rows are the model's raw logits,
    comparable with HF logits directly. The engine needs the worker extension and, for
    "decode", the teacher-forcing logits processor (``make_llm`` adds both).
    """
    info = enable_vllm_logits_capture(llm, max(DEFAULT_MAX_CAPTURED, len(prompts)))
    prompts, teacher_tokens = check_forcing_inputs(prompts, teacher_tokens, info["vocab_size"],
                                                   info["max_model_len"], f"vLLM teacher forcing ({mode})")
    if mode == "decode" and not info["teacher_forcing"]:
        raise RuntimeError("vLLM engine has no teacher-forcing logits processor: start it with "
                           f"extractors.vllm_rpc.make_llm(model, ...) or LLM(..., logits_processors="
                           f"[{TEACHER_FORCING_QUALNAME!r}])")
    params = [capture_sampling_params(len(p), t, mode) for p, t in zip(prompts, teacher_tokens)]
    feed = [p + t if mode == "prefill" else p for p, t in zip(prompts, teacher_tokens)]
    outs = llm.generate([{"prompt_token_ids": x} for x in feed], params, use_tqdm=False)
    rids = [o.request_id for o in outs]
    logits, greedy, positions = take_vllm_request_logits(llm, rids)
    for i, (o, p, t) in enumerate(zip(outs, prompts, teacher_tokens)):
        want = list(range(len(p), len(p) + len(t)))
        if positions[i] != want:
            raise RuntimeError(f"vLLM teacher forcing ({mode}), prompt {i} (request {o.request_id}): rows recorded "
                               f"for token indices {positions[i][:4]}..({len(positions[i])}), expected "
                               f"{want[0]}..{want[-1]} ({len(want)})")
        if mode == "decode" and list(o.outputs[0].token_ids) != t:
            raise RuntimeError(f"vLLM teacher forcing, prompt {i} (request {o.request_id}): the engine sampled "
                               f"{list(o.outputs[0].token_ids)[:8]}, not the teacher tokens {t[:8]}; is the "
                               f"logits processor {TEACHER_FORCING_QUALNAME!r} loaded?")
    return VllmForcedLogits(logits=logits, greedy=greedy, teacher=teacher_tokens, request_ids=rids, mode=mode,
                            num_cached_tokens=[int(o.num_cached_tokens or 0) for o in outs])
