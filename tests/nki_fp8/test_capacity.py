"""KV cache capacity arithmetic against reference/001's GPT-OSS 120B example."""
import pytest

from nki_fp8.capacity import capacity_table, format_capacity_table, kv_cache_bytes_per_token


def test_gpt_oss_120b_131k_tokens_is_9_66_gb_bf16_and_4_83_gb_fp8():
    # 2 (K,V) * 36 layers * 8 kv heads * 64 dims = 36864 values per token.
    assert kv_cache_bytes_per_token(36, 8, 64, "bfloat16") == 73728
    assert kv_cache_bytes_per_token(36, 8, 64, "fp8") == 36864
    bf16, fp8 = capacity_table(36, 8, 64, seq_len=131072, budget_bytes=96e9)
    assert bf16.bytes_per_sequence == 9_663_676_416 and round(bf16.gb_per_sequence, 2) == 9.66
    assert fp8.bytes_per_sequence == 4_831_838_208 and round(fp8.gb_per_sequence, 2) == 4.83
    # 96 GB budget: 9 BF16 sequences of 131072 tokens, 19 FP8 ones (96e9 / 4.83e9 = 19.87).
    assert (bf16.max_sequences, fp8.max_sequences) == (9, 19)
    assert fp8.max_tokens == 96_000_000_000 // 36864
    assert "4.83" in format_capacity_table([bf16, fp8])


def test_float32_auto_and_refusals():
    assert kv_cache_bytes_per_token(1, 1, 1, "float32") == 8
    with pytest.raises(ValueError, match="valid values"):
        kv_cache_bytes_per_token(1, 1, 1, "int4")
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_bytes_per_token(2, 0, 64)
