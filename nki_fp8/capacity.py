"""KV cache capacity arithmetic: bytes per token and tokens per memory budget.

`kv_cache_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * bytes_per_value`
(reference/001). Sizes are in decimal units (1 GB = 1e9 bytes), as the reference's GPT-OSS
120B example is: 2 * 36 * 8 * 64 * 2 B * 131072 tokens = 9.66e9 B ("~9.66 GB").
"""
from __future__ import annotations

from dataclasses import dataclass

from .formats import kv_cache_dtype_str_to_dtype

GB = 1e9


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "bfloat16") -> int:
    """Bytes the K and V of one token take across all layers; `dtype` is a kv_cache_dtype string."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if int(v) != v or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    bpv = kv_cache_dtype_str_to_dtype(dtype).bytes_per_value
    return 2 * int(num_layers) * int(num_kv_heads) * int(head_dim) * bpv


@dataclass(frozen=True)
class CapacityRow:
    dtype: str
    bytes_per_token: int
    bytes_per_sequence: int  # at seq_len tokens
    gb_per_sequence: float  # 1e9 bytes
    max_tokens: int  # whole tokens that fit the budget
    max_sequences: int  # whole sequences of seq_len that fit the budget


def capacity_table(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    budget_bytes: float,
    dtypes: tuple[str, ...] = ("bfloat16", "fp8"),
) -> list[CapacityRow]:
    """One row per dtype: cache size of one `seq_len` sequence and what fits in `budget_bytes`."""
    rows = []
    for dt in dtypes:
        bpt = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dt)
        per_seq = bpt * int(seq_len)
        rows.append(CapacityRow(dt, bpt, per_seq, per_seq / GB, int(budget_bytes // bpt), int(budget_bytes // per_seq)))
    return rows


def format_capacity_table(rows: list[CapacityRow]) -> str:
    """Plain-text table of `capacity_table` rows."""
    head = f"{'dtype':<10} {'B/token':>9} {'GB/seq':>8} {'max tokens':>12} {'max seqs':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.dtype:<10} {r.bytes_per_token:>9} {r.gb_per_sequence:>8.2f} {r.max_tokens:>12} {r.max_sequences:>9}")
    return "\n".join(lines)
