"""A vLLM v1 logits processor that makes the engine sample given (teacher) tokens.

Loaded by vLLM from ``LLM(logits_processors=["extractors.vllm_teacher:TeacherForcingLogitsProcessor"])``
(``extractors.vllm_rpc.make_llm`` adds it). A request opts in through
``SamplingParams(extra_args={"capturestore": {"teacher": [t0, t1, ...]}})``: at its k-th sampling
step every logit but ``teacher[k]`` is set to -inf, so greedy (and any) sampling picks the teacher
token and the next decode step runs on it. Requests without teacher tokens are left alone.

It runs inside the sampler, after the worker extension recorded the raw logits
(``extractors.vllm_logits``), so the recorded logits are the model's own. Imports vLLM.
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from extractors.vllm_logits import CAPTURE_KEY, teacher_tokens_of


class TeacherForcingLogitsProcessor(LogitsProcessor):
    """Per batch row: (teacher tokens, the request's live output token list)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        teacher_tokens_of(sampling_params)  # raises ValueError on a malformed request

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}
        self.device = device

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the greedy token: applied before greedy sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params, _prompt_ids, output_ids):
            teacher = teacher_tokens_of(params)
            return (teacher, output_ids) if teacher else None

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows, tokens = [], []
        for row, (teacher, output_ids) in self.rows.items():
            step = len(output_ids)  # tokens sampled so far; a partial prefill's sample is discarded
            if step < len(teacher):
                rows.append(row)
                tokens.append(teacher[step])
        if rows:
            r = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            t = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits


__all__ = ["TeacherForcingLogitsProcessor", "CAPTURE_KEY"]
