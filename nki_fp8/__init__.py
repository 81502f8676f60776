"""FP8 KV cache numerics: formats, scales, calibration, scale-folded attention references.

The numerical reference an NKI / Neuron FP8 KV kernel is checked against, runnable on CPU
(numpy + ml_dtypes; torch / transformers only where a function says so). Modules:

- `formats`: TRN2 E4M3 (240) / TRN3 E4M3FN (448), `FP8_CLAMP_MAX`, `kv_cache_dtype` strings
- `scales`: absmax scales per tensor / channel / token / group (kernel vs checkpoint convention)
- `quant`: quantize `clamp(x * s)` -> FP8, dequantize `/ s`, torch twins, `Fp8Codec` fast path
- `fastpath`: optional fused numba round trip used by `Fp8Codec` (bit-identical, tested)
- `attention`: scale-folded decode attention, FP8 attention, `check_kernel`
- `checkpoint`: llm-compressor KV scale layout (save / load as reciprocals)
- `calibration`: per-layer scales from KV captures in a store
- `target`: an HF model whose KV cache quantizes on write, and its three-way analysis
- `capacity`: KV cache bytes per token and capacity tables
"""
from .attention import (
    attention_decode_reference,
    check_kernel,
    decode_attention,
    decode_attention_explicit_dequant,
    decode_attention_scale_folded,
    fp8_attention_decode,
    fp8_attention_error_vs_bf16,
)
from .calibration import calibrate_kv_scales
from .capacity import capacity_table, kv_cache_bytes_per_token
from .checkpoint import KVScales, load_kv_scales, save_kv_scales
from .formats import (
    E4M3,
    E4M3FN,
    VALID_KV_CACHE_DTYPES,
    fp8_clamp_max,
    fp8_format,
    kv_cache_dtype_str_to_dtype,
    resolve_platform,
)
from .quant import Fp8Codec, dequantize, fake_quantize, quantize
from .scales import absmax, absmax_scale

__all__ = [
    "E4M3", "E4M3FN", "FP8_CLAMP_MAX", "VALID_KV_CACHE_DTYPES", "fp8_clamp_max", "fp8_format",
    "kv_cache_dtype_str_to_dtype", "resolve_platform", "absmax", "absmax_scale", "quantize", "dequantize",
    "fake_quantize", "Fp8Codec", "decode_attention", "decode_attention_explicit_dequant",
    "decode_attention_scale_folded", "attention_decode_reference", "fp8_attention_decode",
    "fp8_attention_error_vs_bf16", "check_kernel", "KVScales", "load_kv_scales", "save_kv_scales",
    "calibrate_kv_scales", "kv_cache_bytes_per_token", "capacity_table",
]


def __getattr__(name: str):
    if name == "FP8_CLAMP_MAX":  # read from $NKI_FP8_PLATFORM when used, never at import
        from . import formats

        return formats.FP8_CLAMP_MAX
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
