"""Offline per-layer KV scale calibration from BF16 KV captures already in a store.

This is the "warmup-based calibration" reference/001 says Neuron lacks, done offline: read every
prompt's K and V of one run (`[layer, kv_head, seq, head_dim]`), take per layer either the
absmax or a percentile of |x| over all finite values (sliding-window NaN padding is skipped),
and turn it into checkpoint scales `c = statistic / FP8_MAX(platform)`.

The platform matters: llm-compressor divides by 448 (OCP E4M3FN). A checkpoint calibrated that
way and served on TRN2 puts values up to 448 into a 240 clamp, i.e. it saturates everything
above 240/448 = 54% of the calibrated absmax. Calibrate with the platform you serve on.

Results are appended to the store table `kv_scales` (one row per layer) and, with `out_dir`,
written as an llm-compressor-layout safetensors file plus its quantization_config snippet,
which `checkpoint.load_kv_scales` reads back.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import KV_SCALES_FILE, save_kv_scales
from .formats import fp8_clamp_max, resolve_platform
from .scales import checkpoint_scale_from_absmax

METHODS = ("absmax", "percentile")


@dataclass(frozen=True)
class CalibrationResult:
    """Per-layer calibration of one run. Arrays are [layer]; scales in checkpoint convention."""

    run_id: str
    method: str
    percentile: float | None
    platform: str
    fp8_max: float
    k_stat: np.ndarray  # absmax or percentile of |k|
    v_stat: np.ndarray
    k_scale: np.ndarray  # checkpoint scale k_stat / fp8_max (1.0 where the stat is 0)
    v_scale: np.ndarray
    num_prompts: int
    num_tokens: int
    nonfinite_values: int  # NaN/inf skipped (sliding-window padding)
    safetensors_path: Path | None = None
    config_path: Path | None = None

    @property
    def kernel_k_scale(self) -> np.ndarray:
        return (1.0 / self.k_scale).astype(np.float32)

    @property
    def kernel_v_scale(self) -> np.ndarray:
        return (1.0 / self.v_scale).astype(np.float32)

    def rows(self) -> list[dict]:
        """One row per layer for the store table `kv_scales`."""
        return [
            dict(
                run_id=self.run_id, layer=i, method=self.method, percentile=self.percentile, platform=self.platform,
                fp8_max=self.fp8_max, k_stat=float(self.k_stat[i]), v_stat=float(self.v_stat[i]),
                k_scale=float(self.k_scale[i]), v_scale=float(self.v_scale[i]),
                num_prompts=self.num_prompts, num_tokens=self.num_tokens,
            )
            for i in range(self.k_scale.size)
        ]

    def __str__(self) -> str:
        stat = "absmax" if self.method == "absmax" else f"p{self.percentile:g}"
        lines = [
            f"KV scales of run {self.run_id}: {self.method}, platform {self.platform} (FP8 max {self.fp8_max:g}), "
            f"{self.num_prompts} prompts, {self.num_tokens} tokens, {self.nonfinite_values} non-finite values skipped",
            f"{'layer':>5} {'k ' + stat:>12} {'v ' + stat:>12} {'k_scale':>12} {'v_scale':>12}",
        ]
        for i in range(self.k_scale.size):
            lines.append(f"{i:>5} {self.k_stat[i]:>12.5g} {self.v_stat[i]:>12.5g} {self.k_scale[i]:>12.5g} {self.v_scale[i]:>12.5g}")
        if self.safetensors_path:
            lines.append(f"wrote {self.safetensors_path} and {self.config_path}")
        return "\n".join(lines)


class LayerStatistic:
    """Running per-layer statistic of |x| over `[layer, kv_head, seq, head_dim]` arrays.

    absmax keeps one running max per layer; percentile keeps the finite |x| of each layer in
    memory (float32) and uses numpy's linear interpolation. NaN/inf are skipped and counted.
    """

    def __init__(self, method: str = "absmax", percentile: float = 99.99):
        if method not in METHODS:
            raise ValueError(f"unknown calibration method {method!r}; valid: {list(METHODS)}")
        if method == "percentile" and not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.method, self.percentile = method, percentile
        self.running: np.ndarray | None = None
        self.values: list[list[np.ndarray]] | None = None
        self.nonfinite = 0

    def add(self, x) -> None:
        a = np.abs(np.asarray(x, dtype=np.float32))
        a = a.reshape(a.shape[0], -1)
        fin = np.isfinite(a)
        self.nonfinite += int(a.size - fin.sum())
        n = a.shape[0]
        have = self.running.size if self.running is not None else len(self.values) if self.values else n
        if have != n:
            raise ValueError(f"layer count changed between arrays: {have} vs {n}")
        if self.method == "absmax":
            m = np.where(fin, a, 0).max(axis=1)
            self.running = m if self.running is None else np.maximum(self.running, m)
        else:
            self.values = self.values or [[] for _ in range(n)]
            for i in range(n):
                self.values[i].append(a[i][fin[i]])

    def result(self) -> np.ndarray:
        """stat: [layer] (float64); 0.0 for a layer with no finite value."""
        if self.method == "absmax":
            if self.running is None:
                raise ValueError("no KV arrays to calibrate on")
            return self.running.astype(np.float64)
        if not self.values:
            raise ValueError("no KV arrays to calibrate on")
        return np.array([
            np.percentile(np.concatenate(v), self.percentile) if sum(x.size for x in v) else 0.0 for v in self.values
        ])


def per_layer_statistic(kv_arrays, method: str = "absmax", percentile: float = 99.99) -> tuple[np.ndarray, int]:
    """(stat: [layer], non-finite values skipped) of |x| over several [layer, ...] arrays."""
    acc = LayerStatistic(method, percentile)
    for x in kv_arrays:
        acc.add(x)
    return acc.result(), acc.nonfinite


def check_out_dir(out_dir, name: str = "out_dir") -> Path:
    """``out_dir`` as a Path, after checking it can be written: an existing directory, or one
    that can be created (its nearest existing parent is a writable directory). ValueError names
    ``name`` (the CLI passes ``--out``) and the reason, before anything is computed or written."""
    from capturestore.store import expand_path

    out = expand_path(out_dir, name)
    if not str(out_dir).strip():
        raise ValueError(f"{name} is empty; give the directory to write the scales to")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name} {out} exists and is not a directory; give a directory for {KV_SCALES_FILE}")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{name} {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {out}: {existing} is not writable")
    return out


def calibrate(store, run_id: str, out, *, method: str = "absmax", percentile: float = 99.99,
              platform: str | None = None) -> CalibrationResult:
    """``capturestore calibrate``: ``calibrate_kv_scales`` of ``run_id`` into the directory ``out``,
    recorded in ``store`` (a ``Store`` or its path / URL). ``out`` is checked first (errors name it
    ``--out``), then the store is opened and refused when it cannot be written: nothing is read
    or written before."""
    from capturestore.store import as_store, require_writable

    check_out_dir(out, "--out")
    store = as_store(store)
    require_writable(store, "calibrate")
    return calibrate_kv_scales(store, run_id, method=method, percentile=percentile, platform=platform, out_dir=out)


def calibrate_kv_scales(
    store,
    run_id: str,
    method: str = "absmax",
    percentile: float = 99.99,
    platform: str | None = None,
    out_dir=None,
    record: bool = True,
) -> CalibrationResult:
    """Per-layer k_scale / v_scale (checkpoint convention) from the KV captures of `run_id`.

    Reads `store.read_kv(run_id, prompt)` for every prompt of the run; with `out_dir`, writes
    `kv_scales.safetensors` + `quantization_config.json` there; with `record`, appends one row per
    layer to the store table `kv_scales`. Both destinations are checked before any KV is read, so
    an unwritable one fails with nothing written.
    """
    plat = resolve_platform(platform)
    if out_dir is not None:
        out_dir = check_out_dir(out_dir)
    if record:
        from capturestore.layout import TABLES_DIR

        bad = store.backend.unwritable([TABLES_DIR, f"{TABLES_DIR}/kv_scales"])  # a bucket: one probe PUT
        if bad:
            raise ValueError(f"store {store.root} is not writable ({bad[0]}); pass record=False to calibrate "
                             f"without recording the kv_scales rows")
    m = fp8_clamp_max(plat)
    pids = store.prompts(run_id).column("prompt_id").to_pylist()
    if not pids:
        raise ValueError(f"run {run_id} has no prompts to calibrate on")
    k_acc, v_acc = LayerStatistic(method, percentile), LayerStatistic(method, percentile)
    n_tok = 0
    for pid in pids:
        k, v = store.read_kv(run_id, pid)
        k_acc.add(k)
        v_acc.add(v)
        n_tok += int(np.shape(k)[2])
    k_stat, v_stat = k_acc.result(), v_acc.result()
    pct = float(percentile) if method == "percentile" else None
    prov = dict(platform=plat, fp8_max=m, method=method, percentile=pct, run_id=run_id, num_prompts=len(pids), num_tokens=n_tok)
    res = CalibrationResult(
        run_id, method, pct, plat, m, k_stat, v_stat,
        checkpoint_scale_from_absmax(k_stat, plat).astype(np.float64),
        checkpoint_scale_from_absmax(v_stat, plat).astype(np.float64),
        len(pids), n_tok, k_acc.nonfinite + v_acc.nonfinite,
    )
    if out_dir is not None:
        st, cfg = save_kv_scales(out_dir, res.k_scale, res.v_scale, extra=prov)
        res = CalibrationResult(**{**res.__dict__, "safetensors_path": st, "config_path": cfg})
    if record:
        store.append_table("kv_scales", res.rows())
    return res
