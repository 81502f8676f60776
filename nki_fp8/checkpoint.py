"""KV scales in the llm-compressor / compressed-tensors checkpoint layout: write and load.

On disk (per-tensor, per-layer, checkpoint convention `x_fp8 = x / c`):
    model.layers.{i}.self_attn.k_scale   float32 [1]
    model.layers.{i}.self_attn.v_scale   float32 [1]
    model.layers.{i}.self_attn.kv_scale  (legacy: one scale for both K and V)
and in `config.json` (or the `quantization_config.json` snippet written here)
    "quantization_config": {"quant_method": "compressed-tensors",
                            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                "dynamic": false, "symmetric": true}, ...}

Loading returns kernel scales (multipliers), `s = 1 / c`, as vLLM Neuron's
`_load_kv_cache_scales` does (`val = 1.0 / checkpoint[key].to(bfloat16)`): pass
`scale_dtype="bfloat16"` to reproduce its bf16 reciprocal exactly, "float32" (default) for the
float32 reciprocal. A layer with no scale gets 1.0 and one warning names every such layer.
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)
KV_SCALES_FILE = "kv_scales.safetensors"
QUANT_CONFIG_FILE = "quantization_config.json"
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def k_scale_name(layer: int) -> str:
    return f"model.layers.{int(layer)}.self_attn.k_scale"


def v_scale_name(layer: int) -> str:
    return f"model.layers.{int(layer)}.self_attn.v_scale"


def kv_scale_name(layer: int) -> str:
    return f"model.layers.{int(layer)}.self_attn.kv_scale"


def quantization_config_snippet(extra: dict | None = None) -> dict:
    """The `quantization_config` of an FP8-KV-cache-only compressed-tensors checkpoint."""
    qc = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": dict(KV_CACHE_SCHEME),
    }
    if extra:
        qc["capturestore"] = extra  # provenance: platform, fp8 max, method, run
    return qc


def validate_quantization_config(qc: dict, where: str = "quantization_config") -> None:
    """Accept only FP8 KV-cache-only compressed-tensors configs, as vLLM Neuron does."""
    method = qc.get("quant_method")
    if method not in (None, "compressed-tensors"):
        raise ValueError(f"{where}: quant_method {method!r} is not 'compressed-tensors'")
    for name, group in (qc.get("config_groups") or {}).items():
        for part in ("weights", "input_activations", "output_activations"):
            if (group or {}).get(part):
                raise ValueError(
                    f"{where}: config_groups.{name}.{part} requests {part.replace('_', ' ')} quantization; "
                    "only KV cache quantization (kv_cache_scheme) is supported"
                )
    scheme = qc.get("kv_cache_scheme")
    if scheme is not None:
        if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
            raise ValueError(f"{where}: kv_cache_scheme {scheme} is not an 8-bit float (FP8) scheme")
        if scheme.get("strategy", "tensor") != "tensor":
            raise ValueError(f"{where}: kv_cache_scheme strategy {scheme.get('strategy')!r}; only per-tensor scales are supported")
        if scheme.get("dynamic"):
            raise ValueError(f"{where}: kv_cache_scheme is dynamic; static checkpoint scales are required")


def save_kv_scales(out_dir, k_scale, v_scale, *, extra: dict | None = None, dtype=np.float32) -> tuple[Path, Path]:
    """Write checkpoint scales (`c = absmax / max`), k_scale, v_scale: [layer], and the config snippet.

    Returns (safetensors path, quantization_config.json path).
    """
    from safetensors.numpy import save_file

    k = np.asarray(k_scale, np.float64).reshape(-1)
    v = np.asarray(v_scale, np.float64).reshape(-1)
    if k.shape != v.shape:
        raise ValueError(f"save_kv_scales: k_scale {k.shape} and v_scale {v.shape} differ in layers")
    bad = [(n, i, x) for n, a in (("k_scale", k), ("v_scale", v)) for i, x in enumerate(a) if not (np.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"save_kv_scales: scales must be finite and > 0; got {bad[:5]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(k.size):
        tensors[k_scale_name(i)] = np.asarray([k[i]], dtype=dtype)
        tensors[v_scale_name(i)] = np.asarray([v[i]], dtype=dtype)
    st = out / KV_SCALES_FILE
    save_file(tensors, str(st), metadata={"format": "pt"})
    cfg = out / QUANT_CONFIG_FILE
    cfg.write_text(json.dumps({"num_hidden_layers": int(k.size), "quantization_config": quantization_config_snippet(extra)}, indent=2) + "\n")
    return st, cfg


@dataclass(frozen=True)
class KVScales:
    """Per-layer KV scales as loaded. k_scale, v_scale: kernel scales [layer] (float32).

    checkpoint_k_scale / checkpoint_v_scale: the stored divisors (NaN where missing).
    """

    k_scale: np.ndarray
    v_scale: np.ndarray
    checkpoint_k_scale: np.ndarray
    checkpoint_v_scale: np.ndarray
    missing_layers: tuple[int, ...] = ()
    legacy_layers: tuple[int, ...] = ()
    quantization_config: dict | None = None
    source: str = ""
    provenance: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.k_scale.size)

    @classmethod
    def unit(cls, num_layers: int) -> KVScales:
        """All scales 1.0 (what a checkpoint without scales gets)."""
        one = np.ones(num_layers, np.float32)
        return cls(one, one.copy(), one.copy(), one.copy(), source="unit")


def _read_config(d: Path) -> dict | None:
    for name in ("config.json", QUANT_CONFIG_FILE):
        p = d / name
        if p.exists():
            return json.loads(p.read_text())
    return None


def _reciprocal(c: np.ndarray, scale_dtype: str) -> np.ndarray:
    if scale_dtype == "float32":
        return (np.float32(1.0) / c.astype(np.float32)).astype(np.float32)
    if scale_dtype == "bfloat16":
        # torch: 1.0 / bf16_tensor -> bf16 (computed in float32, rounded to bf16 once)
        cb = c.astype(np.float32).astype(_BF16).astype(np.float32)
        return (np.float32(1.0) / cb).astype(_BF16).astype(np.float32)
    raise ValueError(f"scale_dtype must be 'float32' or 'bfloat16', got {scale_dtype!r}")


def load_kv_scales(path, num_layers: int | None = None, *, scale_dtype: str = "float32") -> KVScales:
    """Load per-layer KV scales from a checkpoint directory or a .safetensors file.

    num_layers: default `num_hidden_layers` of the config, else the highest layer found + 1.
    Missing layers fall back to 1.0 with a warning; `kv_scale` (legacy) sets both K and V.
    """
    from safetensors import safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if p.is_dir() and not files:
        raise FileNotFoundError(f"load_kv_scales: no .safetensors files in {p}")
    cfg = _read_config(p if p.is_dir() else p.parent) or {}
    qc = cfg.get("quantization_config")
    if qc is not None:
        validate_quantization_config(qc, f"{p}: quantization_config")
    found: dict[tuple[int, str], float] = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as sf:
            for key in sf.keys():
                m = _NAME.match(key)
                if not m:
                    continue
                val = np.asarray(sf.get_tensor(key), np.float64).reshape(-1)
                if val.size != 1 or not np.isfinite(val[0]) or val[0] <= 0:
                    raise ValueError(f"{f}: {key} = {val.tolist()} is not one finite positive per-tensor scale")
                found[(int(m.group(1)), m.group(2))] = float(val[0])
    if num_layers is None:
        num_layers = cfg.get("num_hidden_layers") or (max((i for i, _ in found), default=-1) + 1)
    if num_layers <= 0:
        raise ValueError(f"load_kv_scales: {p} holds no KV scales and no num_hidden_layers; pass num_layers")
    ck = np.full(num_layers, np.nan)
    cv = np.full(num_layers, np.nan)
    missing, legacy = [], []
    for i in range(num_layers):
        if (i, "kv_scale") in found:
            legacy.append(i)
            ck[i] = cv[i] = found[(i, "kv_scale")]
        if (i, "k_scale") in found:
            ck[i] = found[(i, "k_scale")]
        if (i, "v_scale") in found:
            cv[i] = found[(i, "v_scale")]
        if np.isnan(ck[i]) or np.isnan(cv[i]):
            missing.append(i)
    if missing:
        warnings.warn(
            f"{p}: no k_scale/v_scale for layers {missing} of {num_layers}; those scales default to 1.0 "
            "(absmax-free FP8, rarely accurate enough)",
            stacklevel=2,
        )
    ks = np.where(np.isnan(ck), 1.0, ck)
    vs = np.where(np.isnan(cv), 1.0, cv)
    prov = (qc or {}).get("capturestore", {}) if isinstance(qc, dict) else {}
    return KVScales(
        _reciprocal(ks, scale_dtype),
        _reciprocal(vs, scale_dtype),
        ck,
        cv,
        tuple(missing),
        tuple(legacy),
        qc,
        str(p),
        prov,
    )
