"""Engines for the reduction tests, named ``MODULE:FUNCTION`` so a bundle's command rebuilds them:
each takes a model directory and returns the engine under test."""
from __future__ import annotations

FAULT = ("mlp", 1, 0.10)  # layer 1's MLP output x 1.10, of the tiny Llama's 3 layers
LOCAL_FAULT = ("mlp", 2, 0.01)  # the last layer's MLP output x 1.01: passes in place, fails locally


def faulty(model_dir):
    """HF BF16 (eager) with ``FAULT`` installed."""
    from extractors.hf import load_hf_model
    from extractors.hf_faults import install_hf_fault

    model = load_hf_model(model_dir, "bfloat16")
    install_hf_fault(model, *FAULT)
    return model


def faulty_last_mlp(model_dir):
    """HF BF16 (eager) with ``LOCAL_FAULT`` installed (issue 22's acceptance case)."""
    from extractors.hf import load_hf_model
    from extractors.hf_faults import install_hf_fault

    model = load_hf_model(model_dir, "bfloat16")
    install_hf_fault(model, *LOCAL_FAULT)
    return model


def correct(model_dir):
    """HF BF16 with SDPA attention: other kernels than the eager reference, no fault."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16,
                                                attn_implementation="sdpa").eval()


def wrong_signature(model_dir, dtype):
    """Takes two arguments where reduce gives one (a bad --engine: refused in one line)."""
    raise AssertionError("never called")
