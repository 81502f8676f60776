"""Producers of captures: tiny local models, HF teacher-forced references, vLLM paged KV."""
