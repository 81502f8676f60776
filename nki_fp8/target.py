"""FP8 KV cache as an engine under test: an HF model whose cache quantizes on write.

`make_fp8_kv_cache` builds a transformers `DynamicCache` whose layers quantize every incoming K/V with the
layer's kernel scale (`clamp(x * s, +-max)` -> FP8, torch `float8_e4m3fn` as vLLM Neuron does;
on trn2 the 240 clamp makes its bits the E4M3 ones) and hold / return the dequantized values
`q / s` in the model dtype. Attention therefore reads quantized K/V at every position,
including the token being processed — the decode-path numerics of reference/001 (the Neuron
prefill kernels read fresh BF16 K/V instead; a teacher-forced single pass models decode).

`analyze_fp8_kv_target` runs the three-way analysis: FP32 baseline, BF16 expected, BF16 model
with the FP8 cache as actual. It gives two verdicts (metrics.verdict.aggregate_kv_verdict):

- against BF16 noise: FP8 keeps 4 significant bits to BF16's 8, so even perfect FP8 fails here;
  it says "this is not BF16-equivalent", nothing more;
- against the FP8 rounding floor: the "expected" role is taken by the BF16 KV rounded through
  FP8 with ideal per-layer absmax scales (the error FP8 per-tensor quantization cannot avoid).
  Calibrated scales pass it; wrong scales (1.0 on K/V outside FP8's range) fail it, and the
  worst layers are named.

`analyze_fp8_kv_target` captures the three runs into a store and compares them as an ordinary
comparison (`capturestore.analysis.compare_runs`), the FP8-cache run as its actual run;
`Fp8KVFloorComparator` (registered as `fp8_kv_floor`) gives the floor verdict and writes the
per-layer numbers to `fp8_kv_layer_metrics` under the comparison's id.

torch / transformers are imported lazily; `extractors.hf` provides the teacher-forced pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from capturestore.comparators import Comparator, Localisation, PromptResult, TableSpec, Verdict, decoder_layer_index

from .formats import resolve_platform
from .quant import dequantize_torch, quantize_torch
from .scales import absmax, kernel_scale_from_absmax


def fake_quantize_torch(x, scale: float, platform: str | None = None):
    """`dequantize(quantize(x, s), s)` in torch, returned in x's dtype. x: any shape."""
    return dequantize_torch(quantize_torch(x, scale, platform=platform), scale, out_dtype=x.dtype)


def _fp8_update(layer, base_update):
    """An `update` for one cache layer: quantize-on-write with the layer's scales, then the base update."""

    def update(key_states, value_states, *args, **kwargs):
        k = fake_quantize_torch(key_states, layer.fp8_k_scale, layer.fp8_platform)
        v = fake_quantize_torch(value_states, layer.fp8_v_scale, layer.fp8_platform)
        return base_update(k, v, *args, **kwargs)

    update.fp8 = True
    return update


def convert_cache_to_fp8(cache, k_scales, v_scales, platform: str | None = None):
    """Make every layer of a transformers Cache (built with a config) quantize on write.

    k_scales, v_scales: kernel scales [layer] (e.g. `load_kv_scales(...).k_scale`). The layer
    keeps its class (full or sliding window); only its `update` is wrapped.
    """
    plat = resolve_platform(platform)
    ks = [float(s) for s in np.asarray(k_scales, np.float64).reshape(-1)]
    vs = [float(s) for s in np.asarray(v_scales, np.float64).reshape(-1)]
    if len(cache.layers) != len(ks) or len(vs) != len(ks):
        raise ValueError(
            f"FP8 KV cache: the model has {len(cache.layers)} cache layers but {len(ks)} k_scales and "
            f"{len(vs)} v_scales were given"
        )
    for i, layer in enumerate(cache.layers):
        layer.fp8_k_scale, layer.fp8_v_scale, layer.fp8_platform = ks[i], vs[i], plat
        if not getattr(layer.update, "fp8", False):
            layer.update = _fp8_update(layer, layer.update)
    return cache


def make_fp8_kv_cache(config, k_scales, v_scales, platform: str | None = None):
    """A `DynamicCache(config=config)` whose layers quantize on write (see module docstring)."""
    from transformers import DynamicCache

    return convert_cache_to_fp8(DynamicCache(config=config), k_scales, v_scales, platform)


def extract_fp8_kv_teacher_forced(model, input_ids, teacher_tokens, k_scales, v_scales, *,
                                  platform: str | None = None, return_logits: bool = False):
    """`extractors.hf.extract_hf_kv_caches_teacher_forced` with the FP8 cache as the model's cache.

    Same inputs and outputs (kv: {layer: (k, v)} [batch, kv_head, seq, head_dim], dequantized
    values in the model dtype; logits [gen_token, batch, vocab] with return_logits).
    """
    from extractors.hf import extract_hf_kv_caches_teacher_forced as extract

    factory = lambda config: make_fp8_kv_cache(config, k_scales, v_scales, platform)  # noqa: E731
    return extract(model, input_ids, teacher_tokens, return_logits=return_logits, cache_factory=factory)


def rescale_kv_magnitudes(model, k_factors, v_factors):
    """Function-preserving reparametrisation that sets each layer's K and V range (in place).

    Layer i: q_proj / kf, k_proj * kf (scores unchanged), v_proj * vf, o_proj / vf (output
    unchanged). With powers of two the change is exact in every dtype, so the model computes
    bit-identical logits while its cache holds K/V of the chosen magnitude — e.g. K beyond 240
    or V below FP8's normal range, as real checkpoints have. Llama-style attention only.
    """
    import torch

    layers = model.model.layers
    if len(k_factors) != len(layers) or len(v_factors) != len(layers):
        raise ValueError(f"rescale_kv_magnitudes: {len(layers)} layers, got {len(k_factors)} k and {len(v_factors)} v factors")
    with torch.no_grad():
        for layer, kf, vf in zip(layers, k_factors, v_factors):
            at = layer.self_attn
            for lin, f in ((at.q_proj, 1.0 / kf), (at.k_proj, kf), (at.v_proj, vf)):
                lin.weight.mul_(f)
                if lin.bias is not None:
                    lin.bias.mul_(f)
            at.o_proj.weight.mul_(1.0 / vf)
    return model


def capture_fp8_kv_run(store, model_path, prompts, teacher_tokens, k_scales, v_scales, *,
                       platform: str | None = None, model=None, release: str | None = None) -> str:
    """Capture the FP8-cache target into `store` as a run (engine "hf-fp8kv"); returns its run id.

    Same layout as `extractors.hf.capture_hf_run` (teacher-forced, one prompt at a time, KV
    `[layer, kv_head, seq, head_dim]` in bf16 holding the dequantized cache, logits
    `[gen_token, vocab]`), so the run can be the `actual` of any stored comparison. The run's
    config records platform, FP8 max and the per-layer kernel scales.
    model: the BF16 model already loaded (and transformed), else loaded from model_path.
    """
    import transformers

    from capturestore.capture import begin_capture_run, write_prompt_capture
    from extractors.hf import hf_layer_names, load_hf_model
    from extractors.models import model_content_hash

    from .formats import fp8_clamp_max

    plat = resolve_platform(platform)
    if model is None:
        model = load_hf_model(model_path, "bfloat16")
    names = hf_layer_names(model)
    rows = [list(map(int, p)) for p in prompts]
    teach = [list(map(int, t)) for t in teacher_tokens]
    if len(rows) != len(teach):
        raise ValueError(f"capture_fp8_kv_run: {len(teach)} teacher rows for {len(rows)} prompts")
    config = {
        "mode": "teacher_forced",
        "kv_cache_dtype": "fp8",
        "platform": plat,
        "fp8_max": fp8_clamp_max(plat),
        "k_scale": [float(x) for x in np.asarray(k_scales, np.float64).reshape(-1)],
        "v_scale": [float(x) for x in np.asarray(v_scales, np.float64).reshape(-1)],
        "scale_convention": "kernel (x_fp8 = clamp(x * s)); checkpoint scale = 1 / s",
        "layer_names": names,
        "prompt_lens": [len(p) for p in rows],
        "kv_layout": "[layer, kv_head, seq, head_dim]; dequantized FP8 cache values in bfloat16",
        "logits_layout": "[gen_token, vocab]; gen_token j from position prompt_len - 1 + j",
    }
    run = begin_capture_run(store, engine="hf-fp8kv", capture="teacher_forced_prefill", prompts=rows, layer_names=names,
                            logits_kind="logits", config=config, model_path=str(model_path),
                            model_hash=model_content_hash(model_path), dtype="bfloat16", device="cpu",
                            engine_version=transformers.__version__, release=release)
    with run:
        for prompt, t in zip(rows, teach):
            logits, kv = extract_fp8_kv_teacher_forced(model, [prompt], [t], k_scales, v_scales,
                                                       platform=plat, return_logits=True)
            write_prompt_capture(run, prompt, t, logits[:, 0], {n: (kv[n][0][0], kv[n][1][0]) for n in names}, names)
    return run.run_id


# ----------------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class Fp8LayerResult:
    """One layer. *_vs_floor: sigma-ratio RMS|actual - base| / RMS|floor - base|; *_vs_bf16: the same over BF16 errors."""

    layer: str
    k_scale: float
    v_scale: float
    k_vs_floor: float
    v_vs_floor: float
    k_vs_bf16: float
    v_vs_bf16: float
    k_rel_l2: float  # ||actual - baseline|| / ||baseline|| over all finite values
    v_rel_l2: float
    floor_k_rel_l2: float
    floor_v_rel_l2: float
    passed_floor: bool | None
    passed_bf16: bool | None

    @property
    def worst_vs_floor(self) -> float:
        return max(self.k_vs_floor, self.v_vs_floor)


@dataclass(frozen=True)
class Fp8KVAnalysis:
    label: str
    platform: str
    layers: tuple[Fp8LayerResult, ...]
    floor_verdict: object  # metrics.verdict.KVVerdict, actual judged against the FP8 floor
    bf16_verdict: object  # metrics.verdict.KVVerdict, actual judged against BF16 noise

    @property
    def passed(self) -> bool:
        """Within the FP8 rounding floor (the verdict that can pass for FP8)."""
        return bool(self.floor_verdict.passed)

    @property
    def worst_layers(self) -> tuple[str, ...]:
        """Layers failing the floor verdict, worst sigma-ratio first."""
        bad = [r for r in self.layers if r.passed_floor is False]
        return tuple(r.layer for r in sorted(bad, key=lambda r: -r.worst_vs_floor))

    def rows(self) -> list[dict]:
        return [dict(label=self.label, platform=self.platform, **r.__dict__) for r in self.layers]

    def summary(self) -> str:
        head = (
            f"FP8 KV target '{self.label}' ({self.platform}): vs FP8 floor "
            f"{'PASS' if self.passed else 'FAIL, worst layers ' + ', '.join(self.worst_layers)}; "
            f"vs BF16 noise {'PASS' if self.bf16_verdict.passed else 'FAIL'}"
        )
        lines = [head, f"{'layer':<32} {'k_scale':>10} {'v_scale':>10} {'k/floor':>8} {'v/floor':>8} {'k/bf16':>8} {'v/bf16':>8} {'k_relL2':>9} {'v_relL2':>9}"]
        for r in self.layers:
            lines.append(
                f"{r.layer:<32} {r.k_scale:>10.4g} {r.v_scale:>10.4g} {r.k_vs_floor:>8.2f} {r.v_vs_floor:>8.2f} "
                f"{r.k_vs_bf16:>8.1f} {r.v_vs_bf16:>8.1f} {r.k_rel_l2:>9.2e} {r.v_rel_l2:>9.2e}"
            )
        return "\n".join(lines)


def floor_kv(expected_kv: dict, platform: str | None = None) -> tuple[dict, dict]:
    """The FP8 rounding floor: expected K/V fake-quantized with ideal per-layer absmax scales.

    expected_kv: {layer: (k, v)} [batch, kv_head, seq, head_dim]. Returns (floor_kv, scales)
    with scales {layer: (k_scale, v_scale)} (kernel convention).
    """
    out, scales = {}, {}
    for name, (k, v) in expected_kv.items():
        sk = float(kernel_scale_from_absmax(absmax(k.float().numpy()), platform).item())
        sv = float(kernel_scale_from_absmax(absmax(v.float().numpy()), platform).item())
        out[name] = (fake_quantize_torch(k, sk, platform), fake_quantize_torch(v, sv, platform))
        scales[name] = (sk, sv)
    return out, scales


def _rel_l2_parts(x, ref) -> tuple[float, float]:
    """(sum (x - ref)^2, sum ref^2) over the positions finite in both (metrics.errors.rel_l2's
    terms, so prompts pool by adding them)."""
    r, a = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    ok = ~(np.isnan(r) | np.isnan(a))
    d = np.where(ok, a - r, 0.0)
    r = np.where(ok, r, 0.0)
    return float(np.sum(d * d)), float(np.sum(r * r)) if ok.any() else math.nan


def _rel_l2(parts: list) -> float:
    """||x - ref|| / max(||ref||, 1e-10) from the per-prompt terms of ``_rel_l2_parts``; NaN when
    no position was finite in both."""
    from metrics.errors import EPS

    num = sum(p[0] for p in parts if not math.isnan(p[1]))
    den = [p[1] for p in parts if not math.isnan(p[1])]
    if not den:
        return math.nan
    return math.sqrt(num) / max(math.sqrt(sum(den)), EPS)


_D, _S, _B = pa.float64(), pa.string(), pa.bool_()
FP8_KV_LAYER_METRICS = TableSpec(pa.schema([
    ("comparison_id", _S), ("label", _S), ("platform", _S), ("layer", _S), ("k_scale", _D), ("v_scale", _D),
    ("k_vs_floor", _D), ("v_vs_floor", _D), ("k_vs_bf16", _D), ("v_vs_bf16", _D), ("k_rel_l2", _D),
    ("v_rel_l2", _D), ("floor_k_rel_l2", _D), ("floor_v_rel_l2", _D), ("passed_floor", _B), ("passed_bf16", _B),
]), 2)  # 2: comparison_id (1: written by analyze_fp8_kv_target outside any comparison)


class Fp8KVFloorComparator(Comparator):
    """The FP8 KV cache judged against the FP8 rounding floor (module docstring), three-way.

    The actual run is an FP8-cache run (``capture_fp8_kv_run``): its config names the platform
    and the per-layer kernel scales. The floor is the expected (BF16) KV fake-quantized with ideal
    per-layer absmax scales over every prompt; the verdict is ``aggregate_kv_verdict`` of the
    actual's errors against the floor's. The same against the BF16 reference (``passed_bf16``)
    says whether the cache is BF16-equivalent (FP8 is not). Writes ``fp8_kv_layer_metrics``."""

    name = "fp8_kv_floor"
    tables = {"fp8_kv_layer_metrics": FP8_KV_LAYER_METRICS}
    needs = ("kv",)
    localisation_rank = 15  # judged against the floor this target can reach: its layer before the BF16 KV verdict's
    comparison_fields = (pa.field("fp8_floor_passed", _B), pa.field("fp8_floor_summary", _S))

    def prepare(self, context) -> None:
        import json

        from capturestore.comparators.kv import kv_layer_names

        super().prepare(context)
        store, runs = context.store, context.runs
        if not context.three_way:
            raise ValueError("fp8_kv_floor: the FP8 floor is judged three-way; pass baseline_run (the FP32 run)")
        run = store.sql(f"SELECT config FROM runs WHERE run_id = '{runs['actual']}'").to_pylist()[0]
        cfg = json.loads(run["config"] or "{}")
        if "k_scale" not in cfg or "v_scale" not in cfg:
            raise ValueError(f"fp8_kv_floor: actual run {runs['actual']} records no k_scale / v_scale in its config "
                             f"(not an FP8-cache run: capture it with nki_fp8.target.capture_fp8_kv_run)")
        self.platform = resolve_platform(cfg.get("platform"))
        self.names = kv_layer_names(store, runs)
        layers = None
        for pid in context.prompt_ids:
            for rid in runs.values():
                groups = self.names.get((rid, pid))
                if groups is None or len(groups) != 1 or None not in groups:
                    raise ValueError(f"fp8_kv_floor: run {rid}, prompt {pid} holds no single KV array to judge")
            layers = layers or list(self.names[(runs["expected"], pid)][None])
        self.layers = layers
        if len(cfg["k_scale"]) != len(layers) or len(cfg["v_scale"]) != len(layers):
            raise ValueError(f"fp8_kv_floor: actual run {runs['actual']} records {len(cfg['k_scale'])} k_scale / "
                             f"{len(cfg['v_scale'])} v_scale for {len(layers)} KV layers")
        self.k_scales, self.v_scales = cfg["k_scale"], cfg["v_scale"]
        # ideal per-layer floor scales: absmax of the expected KV over every prompt (one prompt in memory)
        amax = np.zeros((len(layers), 2))
        for pid in context.prompt_ids:
            k, v = store.read_kv(runs["expected"], pid, as_torch=True)
            for i in range(len(layers)):
                here = [absmax(k[i].float().numpy()).item(), absmax(v[i].float().numpy()).item()]
                amax[i] = np.maximum(amax[i], here)
        self.floor_scales = [(float(kernel_scale_from_absmax(np.float64(a), self.platform).item()),
                              float(kernel_scale_from_absmax(np.float64(b), self.platform).item())) for a, b in amax]

    def map(self, prompt) -> PromptResult:
        """No rows; partial: the prompt's raw errors against BF16 and against the floor, and its
        relative-L2 parts per layer."""
        from metrics.kv import compare_kv_caches

        store, runs, pid = prompt.context.store, prompt.runs, prompt.prompt_id
        kv = {}
        for role, rid in runs.items():
            k, v = prompt.cached(("kv_torch", role), lambda rid=rid: store.read_kv(rid, pid, as_torch=True))
            kv[role] = {n: (k[i][None], v[i][None]) for i, n in enumerate(self.layers)}
        floor = {n: (fake_quantize_torch(k, sk, self.platform), fake_quantize_torch(v, sv, self.platform))
                 for (n, (k, v)), (sk, sv) in zip(kv["expected"].items(), self.floor_scales)}
        _, raw_bf16 = compare_kv_caches(kv["expected"], kv["actual"], layers=self.layers, baseline_kv=kv["baseline"],
                                        return_raw_errors=True)
        _, raw_floor = compare_kv_caches(floor, kv["actual"], layers=self.layers, baseline_kv=kv["baseline"],
                                         return_raw_errors=True)
        l2 = {key: [] for key in ("k", "v", "floor_k", "floor_v")}
        for i, n in enumerate(self.layers):
            b, a, f = kv["baseline"][n], kv["actual"][n], floor[n]
            l2["k"].append((i, _rel_l2_parts(a[0].float(), b[0].float())))
            l2["v"].append((i, _rel_l2_parts(a[1].float(), b[1].float())))
            l2["floor_k"].append((i, _rel_l2_parts(f[0].float(), b[0].float())))
            l2["floor_v"].append((i, _rel_l2_parts(f[1].float(), b[1].float())))
        return PromptResult({}, (raw_bf16, raw_floor, l2))

    def reduce(self, partials: list) -> dict:
        from metrics.verdict import aggregate_kv_verdict

        self.raw_bf16 = [p[0] for p in partials]
        self.raw_floor = [p[1] for p in partials]
        self.l2 = {key: [part for p in partials for part in p[2][key]] for key in ("k", "v", "floor_k", "floor_v")}
        self.floor_verdict = aggregate_kv_verdict(self.raw_floor, layers=self.layers)
        self.bf16_verdict = aggregate_kv_verdict(self.raw_bf16, layers=self.layers)
        rel = {key: [_rel_l2([p for j, p in parts if j == i]) for i in range(len(self.layers))]
               for key, parts in self.l2.items()}
        self.results = tuple(
            Fp8LayerResult(
                name, float(self.k_scales[i]), float(self.v_scales[i]),
                lf.k.sigma_ratio, lf.v.sigma_ratio, lb.k.sigma_ratio, lb.v.sigma_ratio,
                rel["k"][i], rel["v"][i], rel["floor_k"][i], rel["floor_v"][i], lf.passed, lb.passed,
            )
            for i, (name, lf, lb) in enumerate(zip(self.layers, self.floor_verdict.layers, self.bf16_verdict.layers))
        )
        cid, label = self.context.comparison_id, self.context.label
        return {"fp8_kv_layer_metrics": [
            {"comparison_id": cid, "label": label, "platform": self.platform, **r.__dict__} for r in self.results
        ]}

    def analysis(self) -> Fp8KVAnalysis:
        return Fp8KVAnalysis(self.context.label, self.platform, self.results, self.floor_verdict, self.bf16_verdict)

    def verdict(self) -> Verdict:
        v = self.floor_verdict
        loc = None
        if not v.passed:
            loc = Localisation(layer=decoder_layer_index(v.first_failing_layer))
        text = self.analysis().summary().splitlines()[0]
        return Verdict(self.name, bool(v.passed) if v.unjudged is None else None, text, loc, self.analysis(),
                       self.localisation_rank)

    def comparison_columns(self, verdict, passed: bool) -> dict:
        return {"fp8_floor_passed": None if verdict is None else verdict.passed,
                "fp8_floor_summary": None if verdict is None else verdict.summary()}


def analyze_fp8_kv_target(
    model_path,
    prompts,
    teacher_tokens,
    k_scales,
    v_scales,
    *,
    platform: str | None = None,
    label: str = "fp8_kv",
    store=None,
    model_transform=None,
    models=None,
) -> Fp8KVAnalysis:
    """Three-way KV analysis of the FP8-cache target (module docstring), as an ordinary comparison.

    prompts, teacher_tokens: token-id lists, one per prompt. k_scales, v_scales: kernel scales
    [layer]. model_transform: applied to both loaded models (e.g. `rescale_kv_magnitudes`).
    models: (fp32_model, bf16_model) already loaded (and transformed). The FP32 and BF16 runs
    and the FP8-cache run are captured teacher-forced into ``store`` (a temporary store when
    None) and compared with ``compare_runs`` (KV and the ``fp8_kv_floor`` comparator; the
    comparison's ``label`` is ``label``): the per-layer rows are in ``fp8_kv_layer_metrics``
    under its ``comparison_id``. The FP8 run fails the BF16 KV verdict by design, so the
    comparison's ``passed`` is False; its ``fp8_floor_passed`` is this analysis' ``passed``.
    """
    import tempfile

    from capturestore import Store
    from capturestore.analysis import compare_runs
    from extractors.hf import capture_hf_run, load_hf_model

    plat = resolve_platform(platform)
    if models is None:
        models = (load_hf_model(model_path, "float32"), load_hf_model(model_path, "bfloat16"))
        if model_transform is not None:
            models = tuple(model_transform(m) for m in models)
    m32, m16 = models
    with tempfile.TemporaryDirectory(prefix="fp8-kv-target-") as tmp:
        if store is None:
            store = Store.open(tmp)
        base = capture_hf_run(store, model_path, prompts, teacher_tokens=teacher_tokens, dtype="float32", model=m32)
        exp = capture_hf_run(store, model_path, prompts, teacher_tokens=teacher_tokens, dtype="bfloat16", model=m16)
        act = capture_fp8_kv_run(store, model_path, prompts, teacher_tokens, k_scales, v_scales, platform=plat,
                                 model=m16)
        floor = Fp8KVFloorComparator()
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, label=label, logits=False,
                     comparators=[floor])
        return floor.analysis()
