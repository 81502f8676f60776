"""Isolation: from a failing comparison, the first module whose *local* error exceeds BF16 noise.

A module judged in place (``comparators.modules``) carries every error made upstream of it; a
small fault late in the model drowns in what the layers before it inherited, and a module that
fails in place may only have been handed a bad input. Isolation re-runs the engine under test
with modules' inputs replaced by the expected (BF16) reference's inputs at the same positions
(``extractors.replace``) and judges each module on its own:

- actual: the target's module on the expected reference's input;
- expected: the BF16 module on that same input (the expected run's own output there);
- baseline: the FP32 module on that same input (exact in FP32: a BF16 value upcast);
judged by the module verdict's noise-relative rule (``metrics.modules``, unchanged). So the
noise is one module's BF16 rounding, not the rounding of everything before it. (The FP32 module
runs on the BF16 reference's input, not on the FP32 reference's own input: with the FP32 input
the noise would carry every upstream difference again, and a faithful upstream would make the
local verdict the in-place one.)

Search: modules nest (a decoder layer holds its attention, which holds its projections), and
replacing a module's input and its child's in the same forward would hide the child's error from
the parent. Modules of the same depth in the tree of captured modules never nest, so one engine
re-run judges all of them at once: level 1 the top-level modules (embedding, every decoder layer,
final norm, LM head), level 2 all their children (every layer's norms, attention, MLP), level 3
theirs (projections). Every module is judged locally, and the one named is the first failing in
execution order (phases in time order, then the order modules finish: a child before its
parent, so the most specific module of the earliest failure; a parent failing with every child
passing holds the fault in its own arithmetic: a residual add, the softmax, RoPE, a cache write).
Judging every depth, not only below a failing parent, matters: a parent's output can hide a
child's error (a 1% MLP scale is small next to the residual stream it is added to; Gemma3's norm
after the MLP takes a wrong scale back out). Re-runs of the engine: the depth of the module tree
(``engine_reruns``; 3 for the default modules of a Llama model, whatever its number of layers),
as many of the FP32 reference, and one of the BF16 reference capturing every module's input
(its first prompt checked bit for bit against the stored expected run: the inputs fed are those
of the reference the comparison judged).

Stored as a comparison of its own (``integrity.commit_comparison``: the manifest covers it):
``module_local_metrics`` (per token), ``module_local_verdicts`` (per module and phase: the local
verdict beside the source comparison's in-place verdict) and ``isolations`` (one row: the
source comparison, what was found, the re-runs); the ``comparisons`` row's localisation is the
local one, with ``"local": true`` and ``"isolates"``: the source comparison. The source
comparison's row is never rewritten (its manifest covers it).

Level 3 (``level3=True``, ``capturestore isolate --level3``; reference/002's module tests on
real captures): the same re-runs, judging every module even when the comparison passed, with
RoPE on q/k added as a module of its own (``<attention>.rope``, ``extractors.replace``: HF
Llama has no rotary module), and the verdicts also written one table per module kind
(``LEVEL3_KINDS``: ``level3_embedding``, ``level3_rmsnorm``, ``level3_attention``,
``level3_rope``, ``level3_mlp``, ``level3_decoder_layer``, ``level3_final_norm``,
``level3_lm_head``; ``module_kind`` names a module's kind from its name). A kind's row is
``flagged`` when it fails locally and no failing module inside it is of a Level-3 kind: a fault
in a layer's MLP fails the MLP and may fail its decoder layer too (the layer holds the MLP), but
is flagged in ``level3_mlp`` only; a fault in a projection is its attention's (or MLP's) own.

The engine re-run is HF (a ``transformers`` model: the target passed in, or rebuilt from the
actual run's checkpoint, dtype and attention implementation) or vLLM at any TP (one engine, passed
in or built from the run's checkpoint and dtype, re-run with replacement through the worker
extension: ``extractors.vllm_replace``; the modules judged are those the vLLM run holds). Level 3
on a vLLM target judges its RoPE at each attention's ``rotary_emb`` call, mapped to HF's q/k layout
(``extractors.vllm_modules.rope_hf_modules``), under the same ``<attention>.rope`` names; its LM
head is listed unchecked with the reason (``VLLM_LM_HEAD``: vLLM computes logits on the sampled
rows only), never passed.

Input snapshot (``snapshot=True``; by itself for a target that cannot be re-run, ``cannot_rerun``:
a server target, vLLM under tensor parallelism, another engine): the target is not re-run; its
module run's stored inputs (``module:input``, captured in place with ``inputs=True``) are replayed
through the HF modules off the engine, the FP32 module on the target's input the truth, the BF16
module (the expected run's kernel rounding) on it the noise, and the target's stored output
judged against them by ``judge_local``, the same search by depth (two replays per depth, no
engine re-run). Stored alike, ``method`` "snapshot" in the localisation and ``isolations``. A vLLM
snapshot holds the residual sum ``hidden + residual`` of a norm or decoder layer in FP32, as vLLM's
fused add + RMSNorm normalises it (``extractors.vllm_modules.residual_sum``; the run config's
``module_input_residual_sum``); a BF16 / FP16 vLLM run captured without it (before it was kept) is
refused (``VLLM_SNAPSHOT_NORM``: a correct engine's norm failed on the rounded sum). Level 3 from a
vLLM snapshot lists RoPE (no q/k in a module snapshot) and the LM head (``VLLM_LM_HEAD``) unchecked.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from capturestore.comparators.base import (
    Comparator,
    ComparisonContext,
    TableSpec,
    finite_or_null,
)

__all__ = [
    "ISOLATIONS",
    "LEVEL3",
    "LEVEL3_KINDS",
    "MODULE_LOCAL_METRICS",
    "MODULE_LOCAL_VERDICTS",
    "IsolationError",
    "IsolationResult",
    "cannot_rerun",
    "changed_after_load",
    "checked_runs",
    "held_prompts",
    "isolate",
    "judge_local",
    "level3",
    "local_inputs",
    "module_kind",
    "module_tree",
    "on_reference_inputs",
    "rebuild_options",
    "snapshot_inputs",
    "stored_caps",
]

_D, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()

MODULE_LOCAL_METRICS = TableSpec(pa.schema([
    ("comparison_id", _S), ("prompt_id", _S), ("module", _S), ("phase", _S), ("layer", _I), ("level", _I),
    ("position", _I), ("gen_token_idx", _I), ("base_linf", _D), ("tgt_linf", _D), ("linf_ratio", _D),
    ("base_l2", _D), ("tgt_l2", _D), ("l2_ratio", _D), ("base_cos", _D), ("tgt_cos", _D), ("bc", _D),
]), 1)
MODULE_LOCAL_VERDICTS = TableSpec(pa.schema([
    ("comparison_id", _S), ("source_comparison_id", _S), ("module", _S), ("phase", _S), ("layer", _I),
    ("level", _I), ("exec_order", _I), ("passed", _B), ("decided_by", _S), ("sigma_ratio", _D), ("bc", _D),
    ("noise_bc", _D), ("bc_threshold", _D), ("linf_ratio", _D), ("linf_threshold", _D), ("max_l2_ratio", _D),
    ("n_prompts", _I), ("n_tokens", _I), ("first_position", _I), ("first_token", _I), ("first_prompt_id", _S),
    ("problem", _S), ("inplace_passed", _B), ("inplace_sigma_ratio", _D),
]), 1)
ISOLATIONS = TableSpec(pa.schema([
    ("comparison_id", _S), ("source_comparison_id", _S), ("status", _S), ("phase", _S), ("layer", _I),
    ("module", _S), ("token", _I), ("engine_reruns", _I), ("reference_reruns", _I), ("levels", _I),
    ("search", _S), ("wall_s", _D), ("method", _S),
]), 2)
LEVEL3_KINDS = ("embedding", "rmsnorm", "attention", "rope", "mlp", "decoder_layer", "final_norm", "lm_head")
LEVEL3 = TableSpec(pa.schema([
    ("comparison_id", _S), ("source_comparison_id", _S), ("module", _S), ("phase", _S), ("layer", _I),
    ("passed", _B), ("flagged", _B), ("failing_inside", _S), ("decided_by", _S), ("sigma_ratio", _D), ("bc", _D),
    ("bc_threshold", _D), ("linf_ratio", _D), ("linf_threshold", _D), ("n_tokens", _I), ("first_token", _I),
    ("problem", _S), ("inplace_passed", _B),
]), 1)
# Level 3's LM head on a vLLM target: not judged, and said so in its table's place (never a pass).
VLLM_LM_HEAD = ("vLLM never calls its lm_head module: its logits processor computes logits from the lm_head "
                "weight on the sampled rows only (the last prompt position, then each decode step), not on every "
                "prefill position as HF's lm_head does, so no HF-shaped LM head output exists to replace or judge "
                "(the logits comparator judges the engine's logits)")
VLLM_SNAPSHOT_NORM = ("its input snapshot holds the residual sum hidden + residual rounded to the engine's dtype "
                      "(captured before the sum was kept in FP32), which vLLM's fused add + RMSNorm never rounds "
                      "before normalising (it adds in FP32), so every norm taking a residual would be judged on "
                      "another input than its own (a correct BF16 engine's model.layers.2.post_attention_layernorm "
                      "measured at local sigma-ratio 1.21); capture the run again with inputs (the sum is now kept "
                      "in FP32) or isolate by re-running the engine (without --snapshot)")
TABLES = {"module_local_metrics": MODULE_LOCAL_METRICS, "module_local_verdicts": MODULE_LOCAL_VERDICTS,
          "isolations": ISOLATIONS, **{f"level3_{k}": LEVEL3 for k in LEVEL3_KINDS}}

_L = r"(?:^|\.)layers\.\d+\."
_KIND_PATTERNS = (  # first match wins; HF decoder names (Llama, Mistral, Qwen, Gemma, MoE blocks)
    ("rope", re.compile(_L + r"self_attn\.rope$")),
    ("rmsnorm", re.compile(_L + r"(?:self_attn\.)?[a-z_]*norm$")),
    ("attention", re.compile(_L + r"self_attn$")),
    ("mlp", re.compile(_L + r"(?:mlp|block_sparse_moe|feed_forward)$")),
    ("decoder_layer", re.compile(r"(?:^|\.)layers\.\d+$")),
    ("embedding", re.compile(r"(?:^|\.)embed_tokens$")),
    ("final_norm", re.compile(r"^(?:model\.)?(?:language_model\.)?norm$")),
    ("lm_head", re.compile(r"(?:^|\.)lm_head$")),
)


def module_kind(module: str) -> str | None:
    """The Level-3 kind (``LEVEL3_KINDS``) of an HF module name, None for what is no kind of its
    own (projections, activations, routers: parts of an attention or MLP)."""
    return next((k for k, pat in _KIND_PATTERNS if pat.search(module)), None)


class IsolationTables(Comparator):
    """Declares isolation's tables (module docstring); not a comparator of stored runs."""

    name = "isolation"
    tables = TABLES

    def prepare(self, context: ComparisonContext) -> None:
        raise ValueError("isolation is not a comparator of stored runs: run `capturestore isolate COMPARISON` "
                         "(capturestore.isolate.isolate)")


class IsolationError(ValueError):
    """Isolation refused: the comparison or its runs cannot be isolated (one line saying why)."""


@dataclass(frozen=True)
class IsolationResult:
    source: str  # the comparison isolated
    status: str  # "nothing_to_isolate" | "found" | "not_local" (no module fails on the reference's inputs)
    comparison_id: str | None = None  # the isolation's own comparison (None: nothing stored)
    localisation: dict | None = None  # {"phase", "layer", "module", "token", "local": True, "isolates"}
    engine_reruns: int = 0
    reference_reruns: int = 0
    search: tuple = ()  # per level: {"parent", "modules", "first_failing"}
    verdicts: tuple = ()  # metrics.modules.ModuleVerdict of every level, local
    inplace: dict = field(default_factory=dict)  # (module, phase) -> in-place passed (source comparison)
    wall_s: float = 0.0
    level3: dict | None = None  # kind -> tuple of rows (LEVEL3's columns but the ids); None: not a Level-3 run
    unchecked: dict = field(default_factory=dict)  # kind -> why it was not checked (Level 3)
    method: str = "rerun"  # "rerun": re-run on the reference's inputs; "snapshot": its captured inputs replayed

    def flagged(self) -> dict:
        """Level 3: ``{kind: [(module, phase, layer)]}`` of the rows flagged (their own local failure)."""
        return {k: [(r["module"], r["phase"], r["layer"]) for r in rows if r["flagged"]]
                for k, rows in (self.level3 or {}).items() if any(r["flagged"] for r in rows)}

    def level3_passed(self) -> bool:
        """Level 3: every kind judged and no module of any kind fails locally."""
        return self.level3 is not None and not self.unchecked and all(
            r["passed"] is True for rows in self.level3.values() for r in rows)

    @property
    def found(self):
        """The local verdict of the module isolation names (None unless ``status == "found"``)."""
        if self.localisation is None:
            return None
        return next((v for v in self.verdicts if v.module == self.localisation["module"]
                     and v.phase == self.localisation["phase"]), None)

    def level3_summary(self) -> list[str]:
        """Level 3: one line per kind (modules judged, failing, flagged at which layers)."""
        out = []
        for k in LEVEL3_KINDS:
            if k in self.unchecked:
                out.append(f"{k}: not checked ({self.unchecked[k]})")
                continue
            rows = (self.level3 or {}).get(k, ())
            if not rows:
                out.append(f"{k}: no module of this kind captured")
                continue
            bad = [r for r in rows if r["passed"] is not True]
            flag = [r for r in rows if r["flagged"]]
            text = f"{k}: {len(rows)} module-phase(s) judged, {len(bad)} failing locally"
            if flag:
                text += "; flagged: " + ", ".join(
                    f"{r['module']} ({r['phase']}, layer {r['layer']}, sigma-ratio "
                    f"{'-' if r['sigma_ratio'] is None else format(r['sigma_ratio'], '.3f')})" for r in flag)
            out.append(("FAIL " if bad else "PASS ") + text)
        return out

    def summary(self) -> str:
        if self.status == "nothing_to_isolate":
            return f"nothing to isolate: comparison {self.source} passed"
        snap = self.method == "snapshot"
        runs = (f"{self.engine_reruns} engine re-run(s), {self.reference_reruns} reference "
                f"{'replay' if snap else 're-run'}(s), {len(self.search)} level(s)")
        on = ("input snapshot: the target's captured output against the HF module on the target's captured input"
              if snap else "module on the expected reference's inputs")
        if self.status == "not_local":
            return (f"no module fails locally ({on}) in comparison {self.source}; "
                    f"the failure is not a module's own error ({runs})")
        v, loc = self.found, self.localisation
        ip = self.inplace.get((loc["module"], loc["phase"]))
        ip_text = {True: "PASS", False: "FAIL", None: "not judged in place"}[ip]
        return (f"local verdict ({on}): FAIL at {loc['module']} ({loc['phase']}, "
                f"layer {loc['layer']}, token {loc['token']}): sigma-ratio {v.tensor.sigma_ratio:.3f}, BC "
                f"{v.tensor.bc:.4f} vs bar {v.tensor.bc_threshold_used:.4f}, L-inf ratio {v.tensor.linf_ratio:.2f} "
                f"vs bar {v.tensor.linf_threshold_used:.2f}; in-place verdict of that module: {ip_text} ({runs})")


def module_tree(order) -> dict:
    """``{parent or None: [children in order]}`` of dotted module names: a module's parent is the
    longest other name in ``order`` that is a dotted prefix of it."""
    names = set(order)
    tree: dict = {}
    for m in order:
        parts = m.split(".")
        parent = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1) if ".".join(parts[:k]) in names),
                      None)
        tree.setdefault(parent, []).append(m)
    return tree


def _row(store, cid: str) -> dict:
    from capturestore.errors import QueryError

    try:
        rows = store.sql("SELECT * FROM comparisons WHERE comparison_id = ?", [cid]).to_pylist()
    except QueryError as e:  # no comparisons view: nothing was ever compared in this store
        if "comparisons" not in str(e) or "does not exist" not in str(e):
            raise
        raise IsolationError(f"comparison {cid!r} not found: the store holds no comparisons (compare its runs first: "
                             f"capturestore compare / capturestore run)") from None
    if not rows:
        raise IsolationError(f"comparison {cid!r} not found in the store")
    return rows[0]


def _run(store, rid: str) -> dict:
    rows = store.sql("SELECT * FROM runs WHERE run_id = ?", [rid]).to_pylist()
    if not rows:
        raise IsolationError(f"run {rid} not found in the store")
    r = rows[0]
    r["config"] = json.loads(r.get("config") or "{}")
    return r


def _module_runs(row: dict) -> dict:
    own = json.loads(row.get("comparator_runs") or "null") or {}
    if "modules" in own:
        return dict(own["modules"])
    return {role: row[f"{role}_run"] for role in ("baseline", "expected", "actual") if row.get(f"{role}_run")}


def _has_tensors(store, rid: str) -> bool:
    return bool(store.sql("SELECT count(*) FROM captures WHERE run_id = ? AND kind = 'tensor'", [rid]).column(0)[0]
                .as_py())


def cannot_rerun(rec: dict) -> str | None:
    """Why the engine of run record ``rec`` cannot be re-run with replaced tensors (None: it can:
    HF, vLLM at any TP); such a target is judged from its input snapshot (``isolate(..., snapshot=True)``)."""
    from extractors.vllm_server import ENGINE as SERVER

    if rec["engine"] == SERVER:
        return f"a server target ({SERVER}): it cannot be re-run with replaced tensors"
    if rec["engine"] not in ("hf", "vllm"):
        return f"a {rec['engine']} engine: isolation re-runs HF and vLLM engines only"
    return None


def checked_runs(store, cid: str, row: dict, snapshot: bool = False) -> tuple[dict, dict]:
    """The runs by role (module runs when the comparison has its own) and their records; refuses
    what cannot be re-run on the reference's inputs (``IsolationError``), naming the run and the
    capture it needs. Also ``capturestore.reduce``'s check. ``snapshot``: the target is not re-run
    (its captured inputs are replayed, ``snapshot_inputs`` checks them), so any engine will do."""
    runs = _module_runs(row)
    recs = {role: _run(store, rid) for role, rid in runs.items()}
    act = recs.get("actual")
    why = None if act is None or snapshot else cannot_rerun(act)
    if why is not None:
        raise IsolationError(f"the actual run {runs['actual']} of comparison {cid} is {why}; judge it from its input "
                             f"snapshot instead (its module inputs captured at the engine boundary, replayed through "
                             f"the HF module off the engine: capturestore isolate --snapshot, docs/isolate.md)")
    if "baseline" not in runs:
        raise IsolationError(f"comparison {cid} is two-way: a module's local error is judged against the BF16 "
                             f"module's on the same input, relative to FP32; compare with a baseline (FP32) run")
    for role in ("expected", "actual", "baseline"):
        if not _has_tensors(store, runs[role]):
            raise IsolationError(f"the {role} run {runs[role]} of comparison {cid} holds no module tensors: isolation "
                                 f"needs module captures of all three runs (capturestore run --plugins ...,modules, "
                                 f"or extractors.modules.capture_hf_module_run)")
    for role in ("expected", "baseline"):
        r = recs[role]
        if r["engine"] != "hf" or r["config"].get("model_given"):
            raise IsolationError(f"the {role} run {runs[role]} is not an HF reference rebuilt from its checkpoint "
                                 f"(engine {r['engine']}, model given: {bool(r['config'].get('model_given'))}); "
                                 f"isolation re-runs the references")
    if recs["baseline"]["dtype"] != "float32":
        raise IsolationError(f"the baseline run {runs['baseline']} is {recs['baseline']['dtype']}, not float32")
    return runs, recs


def stored_caps(store, rid: str, pid: str, names) -> dict:
    """``{(name, phase): float32 [token, ...]}`` of a module run's stored tensors ``names`` (inputs
    as ``module:input``), the phases it holds: the layout ``extractors.replace`` gives."""
    got = {}
    for m in names:
        for phase in ("prefill", "decode"):
            try:
                t = store.read_tensor(rid, pid, m, phase=phase)
            except ValueError:
                continue
            t = np.asarray(t, dtype=np.float32)  # [step, token, ...]: prefill one step, decode one token per step
            got[(m, phase)] = t.reshape(-1, *t.shape[2:]) if t.ndim > 2 else t
    return got


def _capture_with_inputs(rec: dict) -> str:
    if rec["engine"] == "hf":
        return ("capturestore run --plugins ...,modules --module-inputs, or "
                "extractors.modules.capture_hf_module_run(..., inputs=True)")
    if rec["engine"] == "vllm":
        return ("capturestore run --plugins ...,modules --module-inputs, or "
                "extractors.vllm_modules.capture_vllm_module_run(..., inputs=True)")
    return ("its module inputs captured at the engine boundary under <module>:input, as "
            "capture_hf_module_run(inputs=True) lays them out")


def snapshot_inputs(store, cid: str, runs: dict, recs: dict, order, prompts, why: str | None = None) -> list[dict]:
    """The target's input snapshot: per prompt ``{(module[:input], phase): [token, ...]}`` of the
    actual run's stored outputs and inputs of ``order``. Refuses (``IsolationError``) a module
    whose input the run does not hold (naming the module and the capture that gives it), a vLLM
    module whose captured input is not the HF module's (the run says why:
    ``module_inputs_not_hf``), and prefill positions never computed (served from the prefix cache:
    no input to replay). The embedding needs none: its input is the run's tokens. ``why``: why the
    target is judged from its snapshot (``cannot_rerun``), said in every refusal."""
    from extractors.modules import INPUT_SUFFIX
    from extractors.vllm_modules import NOT_COMPUTED

    rid, act = runs["actual"], recs["actual"]
    run = f"the actual run {rid} of comparison {cid} ({why + ', so ' if why else ''}judged from its input snapshot)"
    not_hf = act["config"].get("module_inputs_not_hf") or {}
    for m in order:
        if m in not_hf:
            raise IsolationError(f"{run}: its captured input of {m} is not the HF module's input: {not_hf[m]}")
    caps = []
    for pid, _, _ in prompts:
        got = stored_caps(store, rid, pid, [*order, *(m + INPUT_SUFFIX for m in order), NOT_COMPUTED])
        if (NOT_COMPUTED, "prefill") in got and got[(NOT_COMPUTED, "prefill")].size:
            raise IsolationError(f"{run} served prompt {pid}'s first positions from the prefix cache: never "
                                 f"computed, they have no input to replay (capture the target with "
                                 f"enable_prefix_caching=False)")
        lacking = [m for m in order if module_kind(m) != "embedding" and (m + INPUT_SUFFIX, "prefill") not in got]
        if lacking:
            more = f" (and {len(lacking) - 1} more modules)" if len(lacking) > 1 else ""
            raise IsolationError(f"{run} holds no input of module {lacking[0]}{more} for prompt {pid}: an input "
                                 f"snapshot replays the target's captured module inputs; capture them with "
                                 f"{_capture_with_inputs(act)}")
        caps.append(got)
    return caps


def _target_model(rec: dict, rid: str, target, rebuild: bool):
    if target is not None:
        return target
    cfg = rec["config"]
    if cfg.get("model_given") and not rebuild:
        raise IsolationError(f"the actual run {rid} was captured from a model passed in (model_given: a patched "
                             f"engine the checkpoint does not hold); pass that engine (isolate(..., target=model)) or "
                             f"rebuild it from {rec['model_path']} (CLI: --rebuild)")
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return AutoModelForCausalLM.from_pretrained(str(rec["model_path"]), dtype=dtypes[rec["dtype"]],
                                                attn_implementation=cfg.get("attn_implementation") or "eager",
                                                device_map=None).to("cpu").eval()


def held_prompts(store, runs: dict, max_prompts: int | None = None) -> list:
    """``[(prompt_id, prompt tokens, continuation tokens)]`` of the expected run's prompts every
    run of ``runs`` holds, in prompt order (the first ``max_prompts``)."""
    from capturestore.analysis import prompt_split

    rows = store.sql("SELECT prompt_id FROM prompts WHERE run_id = ? ORDER BY prompt_idx",
                     [runs["expected"]]).column(0).to_pylist()
    held = {r: set(store.sql("SELECT prompt_id FROM prompts WHERE run_id = ?", [rid]).column(0).to_pylist())
            for r, rid in runs.items()}
    pids = [p for p in rows if all(p in h for h in held.values())]
    if max_prompts is not None:
        pids = pids[:max(1, int(max_prompts))]
    out = []
    for pid in pids:
        tokens, plen = prompt_split(store, runs["expected"], pid)
        out.append((pid, tokens[:plen].tolist(), tokens[plen:].tolist()))
    return out


def _inplace(store, cid: str) -> dict:
    try:
        rows = store.sql("SELECT module, phase, passed, sigma_ratio FROM module_verdicts WHERE comparison_id = ?",
                         [cid]).to_pylist()
    except Exception:  # noqa: BLE001 - no module_verdicts view in this store: nothing judged in place
        return {}
    return {(r["module"], r["phase"]): (r["passed"], r["sigma_ratio"]) for r in rows}


def _levels(tree) -> list[list[str]]:
    """The captured modules by depth in their tree: level 1 the top-level ones, level 2 their
    children, ...; no module of a level nests in another of the same level."""
    out, frontier = [], list(tree.get(None, []))
    while frontier:
        out.append(frontier)
        frontier = [c for m in frontier for c in tree.get(m, [])]
    return out


def _check_reproduced(store, runs, prompts, exp_caps, modules):
    """The BF16 reference re-run gives the stored expected tensors bit for bit (else the inputs fed
    would not be those of the reference the comparison judged)."""
    for (pid, _, _), caps in zip(prompts, exp_caps):
        for m in modules:
            for phase in ("prefill", "decode"):
                if (m, phase) not in caps:
                    continue
                try:
                    held = store.read_tensor(runs["expected"], pid, m, phase=phase)
                except ValueError:
                    continue  # not stored for this phase: judged from the re-run only
                held = np.asarray(held, dtype=np.float32).reshape(-1, *caps[(m, phase)].shape[1:])
                if held.shape != caps[(m, phase)].shape or not np.array_equal(held, caps[(m, phase)], equal_nan=True):
                    raise IsolationError(f"the expected run {runs['expected']} is not reproduced by re-running its "
                                         f"HF reference: {m} ({phase}) of prompt {pid} differs; isolation feeds the "
                                         f"inputs of the reference the comparison judged")


def isolate(store, comparison_id: str, target=None, *, rebuild: bool = False, max_prompts: int | None = None,
            config=None, progress=None, even_if_passed: bool = False, level3: bool = False,
            snapshot: bool | None = None) -> IsolationResult:
    """Isolate the failure of ``comparison_id`` (module docstring). target: the engine under test
    (a transformers model; default: rebuilt from the actual run's checkpoint, which a run of a
    model passed in refuses unless ``rebuild``). max_prompts: judge the first N prompts only.
    config: ``metrics.modules.ModuleVerdictConfig``. Raises ``IsolationError`` (a ValueError) on
    what cannot be isolated; a passing comparison returns ``status="nothing_to_isolate"`` and
    stores nothing, unless ``even_if_passed`` (judge every module locally all the same: a
    correct engine's check that no module fails on the reference's inputs). level3: Level 3
    (module docstring; implies ``even_if_passed``): RoPE on q/k judged too, tables per kind.
    A vLLM target (the actual run's engine "vllm", any TP): ``target`` is the engine (``make_llm``; e.g.
    carrying a fault installed through the worker extension), default one engine built from the run's
    checkpoint and dtype for every re-run; only the modules the vLLM run holds are judged.
    snapshot: judge the target from its input snapshot (``_snapshot``: its stored module outputs
    against the HF modules replayed on its stored module inputs; no engine re-run); None (default):
    when the target cannot be re-run (``cannot_rerun``: a server target, another
    engine), else the re-run. ``store``: a ``Store`` or its path / URL, refused before any work
    when it cannot be written (``capturestore isolate`` calls this alone)."""
    from capturestore.store import as_store, require_writable

    if max_prompts is not None and max_prompts < 1:  # was judged as 1 prompt
        raise IsolationError(f"isolate: max_prompts must be at least 1, got {max_prompts}")
    store = as_store(store)
    require_writable(store, "isolate")
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    row = _row(store, comparison_id)
    if row["passed"] and not (even_if_passed or level3):
        return IsolationResult(comparison_id, "nothing_to_isolate")
    why = None
    if snapshot is None:
        act_id = _module_runs(row).get("actual")
        why = None if act_id is None else cannot_rerun(_run(store, act_id))
        snapshot = why is not None
    runs, recs = checked_runs(store, comparison_id, row, snapshot=snapshot)
    order = recs["expected"]["config"].get("module_order") or recs["actual"]["config"].get("module_order")
    if not order:
        raise IsolationError(f"the expected run {runs['expected']} records no module_order")
    prompts = held_prompts(store, runs, max_prompts)
    if not prompts:
        raise IsolationError(f"comparison {comparison_id}: no prompt is held by all three runs")
    if snapshot:
        if target is not None:
            raise IsolationError(f"comparison {comparison_id}: an input snapshot replays the actual run's stored "
                                 f"inputs and re-runs no target; do not pass one (or isolate without snapshot)")
        return _snapshot(store, comparison_id, row, runs, recs, order, max_prompts, config, say, t0, level3, why)
    vllm_target = recs["actual"]["engine"] == "vllm"
    if vllm_target:  # the modules vLLM can give under HF names (no lm_head, no act_fn): the actual run's
        held = set(recs["actual"]["config"].get("module_order") or [])
        order = [m for m in order if m in held]
        if not order:
            raise IsolationError(f"the actual run {runs['actual']} holds none of the expected run's modules")
    close = None
    if vllm_target:
        tgt, close = _vllm_target(recs["actual"], runs["actual"], target, prompts)
    else:
        tgt = _target_model(recs["actual"], runs["actual"], target, rebuild)
    unchecked = {}
    if level3:
        from extractors.replace import ROPE_SUFFIX, rope_modules
        from extractors.vllm_modules import vllm_rope_modules

        attns = [m for m in order if module_kind(m) == "attention"]
        tp = int(recs["actual"].get("tp_degree") or 1)
        if vllm_target and tp > 1:
            unchecked["rope"] = (f"RoPE q/k of a vLLM engine at tensor parallelism {tp} are not replaced (each rank "
                                 f"rotates its own heads): judged inside each attention only")
        else:
            order = _with_rope(order, vllm_rope_modules(tgt, attns) if vllm_target else rope_modules(tgt, attns))
        if "rope" not in unchecked and not any(m.endswith(ROPE_SUFFIX) for m in order):
            unchecked["rope"] = (f"the target ({type(tgt).__name__}) has no captured attention calling "
                                 + ("a rotary_emb module vLLM's name map gives" if vllm_target
                                    else "apply_rotary_pos_emb"))
        if vllm_target:
            unchecked["lm_head"] = VLLM_LM_HEAD
    try:
        return _isolate(store, comparison_id, row, runs, recs, order, prompts, tgt, vllm_target, config, say, t0,
                        level3, unchecked)
    finally:
        if close is not None:
            close()


def _snapshot(store, comparison_id, row, runs, recs, order, max_prompts, config, say, t0, level3, why):
    """Isolation from the target's input snapshot: per depth of the module tree, the FP32 HF
    modules (the truth) and the BF16 HF modules with the expected run's kernel rounding (the noise)
    replayed on the target's stored inputs of that depth's modules (``on_reference_inputs``), and
    the target's stored outputs judged against them by ``judge_local``: the same rule, roles
    actual = the target's output, expected = BF16 HF on the target's input, baseline = FP32 HF on
    it. No engine re-run; two reference replays per depth."""
    from extractors.hf import load_hf_model

    act = recs["actual"]
    vllm_target = act["engine"] == "vllm"
    if vllm_target and act["dtype"] not in ("float32", "float64") and \
            not act["config"].get("module_input_residual_sum"):
        raise IsolationError(f"the actual run {runs['actual']} is a {act['dtype']} vLLM run"
                             f"{' (' + why + ')' if why else ''}: {VLLM_SNAPSHOT_NORM}")
    held = set(recs["actual"]["config"].get("module_order") or [])
    order = [m for m in order if m in held]  # the modules the target's run holds (vLLM gives no lm_head, ...)
    if not order:
        raise IsolationError(f"the actual run {runs['actual']} holds none of the expected run's modules")
    prompts = held_prompts(store, {"expected": runs["actual"]}, max_prompts)  # the target's tokens: its inputs'
    act_caps = snapshot_inputs(store, comparison_id, runs, recs, order, prompts, why)
    unchecked = {}
    if level3:
        unchecked["rope"] = ("an input snapshot holds no RoPE q/k: the module capture hooks modules, and "
                             "apply_rotary_pos_emb is a function (judged by --level3 on a re-run target)")
        if vllm_target:
            unchecked["lm_head"] = VLLM_LM_HEAD
    rounding = recs["expected"]["config"].get("kernel_rounding")
    tp = int(act.get("tp_degree") or 1)
    if tp > 1 and act["dtype"] not in ("float32", "float64") and "row_parallel_modules" not in act["config"]:
        raise IsolationError(f"the actual run {runs['actual']} is a {act['dtype']} engine at tensor parallelism {tp} "
                             f"whose run records no row_parallel_modules (captured before they were recorded): its "
                             f"row-parallel layers round each rank's partial sum, and replayed as one full-width "
                             f"linear a correct engine fails there (measured: sigma-ratio 1.47-1.54); capture the run "
                             f"again with inputs")
    rows, _ = _row_parallel(act, None, lambda m: None)  # an FP32 engine rounds no partial sum: none
    say(f"input snapshot of run {runs['actual']} ({recs['actual']['engine']}): {len(order)} modules, "
        f"{len(prompts)} prompts; replaying them through the FP32 {recs['baseline']['model_path']} and the "
        f"{recs['expected']['dtype']} {recs['expected']['model_path']}"
        + (f" (rounding FP32 -> BF16 {rounding.replace('_', ' ')}, as its run records)" if rounding else "")
        + (f"; its {len(rows)} row-parallel layers as the engine's TP={tp} computes them (per-rank partial "
           f"sums, all-reduced)" if rows else ""))
    base_model = load_hf_model(recs["baseline"]["model_path"], "float32")
    exp_model = load_hf_model(recs["expected"]["model_path"], recs["expected"]["dtype"])
    tree = module_tree(order)
    rank = {m: i for i, m in enumerate(order)}
    inplace = _inplace(store, comparison_id)
    P = [p for _, p, _ in prompts]
    C = [c for _, _, c in prompts]
    search, verdicts, metric_rows = [], [], []
    replays = 0
    for level, mods in enumerate(_levels(tree), start=1):
        say(f"level {level}: {len(mods)} module(s) replayed on the target's inputs")
        try:
            base = on_reference_inputs(base_model, P, C, mods, act_caps, what="target's input snapshot")
            exp = on_reference_inputs(exp_model, P, C, mods, act_caps, rounding, what="target's input snapshot",
                                      row_parallel=(rows, tp))  # inside a judged module too
        except ValueError as e:
            raise IsolationError(f"replaying the input snapshot of run {runs['actual']} through the HF modules: "
                                 f"{e}") from None
        replays += 2

        _judge_level(level, prompts, mods, exp, act_caps, base, order, config, verdicts, search, metric_rows)
    status, loc = _located(verdicts, order, comparison_id, "snapshot")
    wall = time.perf_counter() - t0
    kinds = _level3_rows([v for _, v in verdicts], tree, inplace) if level3 else None
    for kind in (k for k in LEVEL3_KINDS if kinds is not None and not kinds[k] and k not in unchecked):
        unchecked[kind] = "the target's run holds no module of this kind"
    cid = _store(store, comparison_id, row, runs, prompts, status, loc, search, verdicts, metric_rows, inplace, rank,
                 0, replays, wall, kinds, method="snapshot", unchecked=unchecked)
    return IsolationResult(comparison_id, status, cid, loc, 0, replays, tuple(search), tuple(v for _, v in verdicts),
                           {k: v[0] for k, v in inplace.items()}, wall,
                           None if kinds is None else {k: tuple(r) for k, r in kinds.items()}, unchecked, "snapshot")


def _vllm_target(rec: dict, rid: str, target, prompts):
    """(the vLLM engine to re-run, a closer or None): the engine passed in (a vllm ``LLM`` built
    with ``extractors.vllm_rpc.make_llm``, e.g. carrying a fault installed through the worker
    extension) or one built from the run's checkpoint and dtype, prefix caching off, closed after."""
    if target is not None:
        if not hasattr(target, "llm_engine"):
            raise IsolationError(f"the actual run {rid} is a vLLM engine but the target passed in is a "
                                 f"{type(target).__name__}, not a vllm LLM (extractors.vllm_rpc.make_llm)")
        tp = int(target.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
        if tp != int(rec.get("tp_degree") or 1):
            raise IsolationError(f"the actual run {rid} was captured at tensor parallelism {rec.get('tp_degree') or 1} "
                                 f"but the target passed in runs at {tp}: its row-parallel layers round other partial "
                                 f"sums, so its local errors would be judged against another engine's noise; pass an "
                                 f"engine at the run's TP")
        return target, None
    from extractors.vllm_rpc import close_llm, make_llm

    opts = rebuild_options(rec, prompts)
    changed = changed_after_load(rec)
    if changed:
        raise IsolationError(f"the actual run {rid}'s vLLM engine was changed after it loaded {rec['model_path']} "
                             f"({changed}): an engine rebuilt from the checkpoint is another engine; pass that engine "
                             f"as the target (isolate(..., target=llm)) or judge its input snapshot (--snapshot, "
                             f"a module run captured with --module-inputs)")
    llm = make_llm(rec["model_path"], **opts)
    return llm, lambda: close_llm(llm)


def changed_after_load(rec: dict) -> str | None:
    """What changed run record ``rec``'s vLLM engine after it was loaded, which a rebuild from the
    checkpoint cannot repeat (None: nothing): an engine hook (``run``'s ``engine_hook``: a planted
    fault, FP8 scales set through the worker, emulated FP8 writes; ``engine_hooked`` names the
    config keys it recorded) or, in a run recorded before hooks were, FP8 state in its config."""
    cfg = rec["config"]
    if cfg.get("engine_hooked") is not None:
        return "an engine hook" + (f" recording {', '.join(cfg['engine_hooked'])}" if cfg["engine_hooked"] else "")
    fp8 = sorted(k for k in cfg if k.startswith("fp8_") and cfg[k] not in (None, False))
    return f"FP8 state {', '.join(fp8)}" if fp8 else None


def rebuild_options(rec: dict, prompts) -> dict:
    """The ``make_llm`` keywords that rebuild the vLLM engine of run record ``rec``: its dtype and
    the engine options its run recorded (``extractors.vllm_modules.vllm_engine_options``: KV cache
    dtype, block size, token budget, chunked prefill; a run captured before they were recorded
    gets vLLM's defaults), prefix caching off (replacement needs every position computed), and a
    maximum length covering ``prompts`` (``[(prompt_id, prompt, continuation)]``)."""
    longest = max(len(p) + len(c) for _, p, c in prompts)
    opts = dict(rec["config"].get("engine_options") or {})
    opts["max_model_len"] = max(int(opts.get("max_model_len") or 256), longest + 16)
    tp = int(rec.get("tp_degree") or 1)
    par = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    return {**opts, **par, "dtype": rec["dtype"], "enable_prefix_caching": False}


def _isolate(store, comparison_id, row, runs, recs, order, prompts, tgt, vllm_target, config, say, t0,
             level3, unchecked):
    from extractors.hf import load_hf_model
    from extractors.replace import ROPE_SUFFIX, collect_hf_replaced

    if vllm_target:
        from extractors.vllm_replace import collect_vllm_replaced

        def rerun_target(P, C, mods, sources):
            try:
                return [(c,) for c, _ in collect_vllm_replaced(tgt, P, C, mods, replace_inputs=mods, sources=sources,
                                                               what="expected reference")]
            except ValueError as e:
                raise IsolationError(f"re-running the vLLM target of run {runs['actual']}: {e}") from None
    else:
        def rerun_target(P, C, mods, sources):
            return collect_hf_replaced(tgt, P, C, mods, replace_inputs=mods, sources=sources,
                                       what="expected reference")
    say(f"loading the references: FP32 {recs['baseline']['model_path']}, {recs['expected']['dtype']} "
        f"{recs['expected']['model_path']}")
    base_model = load_hf_model(recs["baseline"]["model_path"], "float32")
    exp_model = load_hf_model(recs["expected"]["model_path"], recs["expected"]["dtype"])
    tree = module_tree(order)
    rank = {m: i for i, m in enumerate(order)}
    inplace = _inplace(store, comparison_id)
    P = [p for _, p, _ in prompts]
    C = [c for _, _, c in prompts]
    levels = _levels(tree)
    search, verdicts, metric_rows = [], [], []
    engine_reruns = ref_reruns = 0
    rounding = recs["expected"]["config"].get("kernel_rounding")  # as the expected run was captured
    say(f"BF16 reference re-run capturing the inputs of {len(order)} modules"
        + (f" (rounding FP32 -> BF16 {rounding.replace('_', ' ')}, as its run records)" if rounding else ""))
    exp_caps = local_inputs(exp_model, P, C, order, rounding)
    ref_reruns += 1
    _check_reproduced(store, runs, prompts[:1], exp_caps[:1], [m for m in order if not m.endswith(ROPE_SUFFIX)])
    rows, tp = _row_parallel(recs["actual"], tgt if vllm_target else None, say)
    for level, mods in enumerate(levels, start=1):
        say(f"level {level}: {len(mods)} module(s) on the expected reference's inputs")
        act = rerun_target(P, C, mods, exp_caps)
        engine_reruns += 1
        base = on_reference_inputs(base_model, P, C, mods, exp_caps)
        ref_reruns += 1
        exp = exp_caps
        if rows:  # the BF16 noise of the target's own TP arithmetic, on the same inputs
            exp = on_reference_inputs(exp_model, P, C, mods, exp_caps, rounding, row_parallel=(rows, tp))
            ref_reruns += 1

        _judge_level(level, prompts, mods, exp, [a[0] for a in act], base, order, config, verdicts, search,
                     metric_rows)
    status, loc = _located(verdicts, order, comparison_id, "rerun")
    wall = time.perf_counter() - t0
    kinds = _level3_rows([v for _, v in verdicts], tree, inplace) if level3 else None
    from extractors.modules import DEFAULT_MODULES

    for kind in (k for k in LEVEL3_KINDS if kinds is not None and not kinds[k] and k not in unchecked):
        # a kind no module run holds is unjudged, never a pass (the module runs' patterns left it out)
        unchecked[kind] = (f"the module runs hold no module of this kind; capture them with every module "
                           f"(extractors.modules.DEFAULT_MODULES: {', '.join(DEFAULT_MODULES)})")
    cid = _store(store, comparison_id, row, runs, prompts, status, loc, search, verdicts, metric_rows, inplace, rank,
                 engine_reruns, ref_reruns, wall, kinds, unchecked=unchecked)
    return IsolationResult(comparison_id, status, cid, loc, engine_reruns, ref_reruns, tuple(search),
                           tuple(v for _, v in verdicts), {k: v[0] for k, v in inplace.items()}, wall,
                           None if kinds is None else {k: tuple(r) for k, r in kinds.items()}, unchecked)


def _row_parallel(act: dict, llm, say) -> tuple[list, int]:
    """``(row-parallel HF modules, tp)`` of a BF16 / FP16 vLLM target at TP > 1, whose expected
    outputs are then computed as its TP arithmetic computes them (``tp_row_parallel``): the run's
    ``row_parallel_modules``, else asked of the engine ``llm``; ``([], tp)`` otherwise."""
    tp = int(act.get("tp_degree") or 1)
    if act["engine"] != "vllm" or tp <= 1 or act["dtype"] in ("float32", "float64"):
        return [], tp
    rows = act["config"].get("row_parallel_modules")
    if rows is None and llm is not None:
        from extractors.vllm_modules import row_parallel_modules

        rows = row_parallel_modules(llm)
    say(f"the expected reference computes the target's {len(rows or [])} row-parallel layers as its TP={tp} does "
        f"(per-rank partial sums, all-reduced)")
    return list(rows or []), tp


def _judge_level(level, prompts, mods, exp_caps, act_caps, base_caps, order, config, verdicts, search, metric_rows):
    """Judge one depth's modules by the local rule (``judge_local``) and append its verdicts, its
    search step and its per-position metric rows (the isolation's tables) to the lists given."""
    from metrics.modules import module_layer

    def keep(pid, prompt, m, phase, tm):
        c = tm.to_columns()
        k = c["position"].size
        metric_rows.append({"prompt_id": [pid] * k, "module": [m] * k, "phase": [phase] * k,
                            "layer": [module_layer(m)] * k, "level": [level] * k, "position": c["position"],
                            "gen_token_idx": c["position"] - len(prompt),
                            **{x: c[x] for x in MODULE_LOCAL_METRICS.schema.names[8:]}})

    res = judge_local(prompts, mods, exp_caps, act_caps, base_caps, order, config, keep)
    verdicts += [(level, v) for v in res.modules]
    first = res.first_failing
    search.append({"level": level, "modules": len(mods),
                   "first_failing": None if first is None else f"{first.module} ({first.phase})"})


def _located(verdicts, order, comparison_id: str, method: str) -> tuple[str, dict | None]:
    """(status, localisation): the first module failing locally in execution order (children
    finish before their parents, so it is the most specific), found by ``method``."""
    from metrics.modules import first_failing_module

    found = first_failing_module([v for _, v in verdicts], order)
    if found is None:
        return "not_local", None
    return "found", {"phase": found.phase, "layer": found.layer, "module": found.module, "token": found.token,
                     "local": True, "isolates": comparison_id, "method": method}


def local_inputs(exp_model, prompts, continuations, modules, rounding=None) -> list[dict]:
    """One re-run of the expected (BF16) reference ``exp_model`` (rounding as its run records,
    ``extractors.kernel_rounding``): per prompt ``{(module, phase): [token, ...]}`` with the
    outputs of ``modules`` and their inputs (``module:input``), the inputs a local verdict feeds."""
    from extractors.kernel_rounding import kernel_rounding
    from extractors.replace import collect_hf_replaced

    with kernel_rounding(exp_model, rounding):
        return [c for c, _, _ in collect_hf_replaced(exp_model, prompts, continuations, modules, inputs=True)]


def on_reference_inputs(model, prompts, continuations, modules, exp_caps, rounding=None,
                        what: str = "expected reference", row_parallel=None) -> list[dict]:
    """One re-run of an HF ``model`` (the target, or the FP32 reference) with the inputs of
    ``modules`` (none nesting in another) replaced by ``exp_caps``' (``local_inputs``; or a
    target's input snapshot, ``snapshot_inputs``): per prompt ``{(module, phase): [token, ...]}``
    of their outputs. ``rounding``: the kernel rounding to run ``model`` with (``extractors.kernel_rounding``).
    ``row_parallel``: ``(modules, tp)``, linear layers computed as a tensor-parallel engine's
    row-parallel layers are (``extractors.kernel_rounding.tp_row_parallel``, all-reduce rounded as
    ``rounding``)."""
    from extractors.kernel_rounding import kernel_rounding, tp_row_parallel
    from extractors.replace import collect_hf_replaced

    rows, tp = row_parallel or ((), 1)
    with kernel_rounding(model, rounding), tp_row_parallel(model, rows, tp, rounding):
        return [c for c, _, _ in collect_hf_replaced(model, prompts, continuations, modules, replace_inputs=modules,
                                                     sources=exp_caps, what=what)]


def judge_local(prompts, modules, exp_caps, act_caps, base_caps, order=None, config=None, on_metrics=None):
    """The local verdict (``metrics.modules.ModulesVerdict``) of ``modules``: per prompt
    ``(prompt_id, prompt, continuation)`` the target's output on the expected reference's input
    (``act_caps``) against the FP32 module's on that input (``base_caps``), judged against the
    BF16 module's own output there (``exp_caps``) by the module verdict's noise-relative rule. A
    module and phase the expected reference holds and a re-run lacks is a problem (never a pass).
    ``on_metrics(prompt_id, prompt, module, phase, token_metrics)``: each judged tensor's per-token
    metrics. The one local rule: isolation and ``capturestore.reduce`` both judge through it."""
    from metrics.modules import ModuleJudge

    judge = ModuleJudge(config)
    for (pid, prompt, _), e, a, b in zip(prompts, exp_caps, act_caps, base_caps, strict=True):
        items = []
        for m in modules:
            for phase in ("prefill", "decode"):
                if (m, phase) not in e:
                    continue
                if (m, phase) not in a or (m, phase) not in b:
                    judge.add_problem(pid, m, phase, f"the re-run produced no {m} ({phase})")
                    continue
                n = e[(m, phase)].shape[0]
                pos = np.arange(n) + (len(prompt) if phase == "decode" else 0)
                items.append((m, phase, b[(m, phase)], e[(m, phase)], a[(m, phase)], pos))
        for (m, phase, *_), tm in zip(items, judge.add_many(pid, items, prompt_len=len(prompt))):
            if tm is not None and on_metrics is not None:
                on_metrics(pid, prompt, m, phase, tm)
    return judge.verdict(order if order is not None else list(modules))


def level3(store, comparison_id: str, target=None, **kwargs) -> IsolationResult:
    """Level 3 on real captures: ``isolate(..., level3=True)`` (module docstring)."""
    return isolate(store, comparison_id, target, level3=True, **kwargs)


def _with_rope(order, ropes) -> list:
    """``order`` with each ``<attention>.rope`` placed where it runs: before its attention's output
    projection (after q/k/v), else just before the attention."""
    out = list(order)
    for r in ropes:
        attn = r[:-len(".rope")]
        at = next((i for i, m in enumerate(out) if m.startswith(attn + ".") and m.rsplit(".", 1)[-1] in
                   ("o_proj", "out_proj", "dense")), out.index(attn))
        out.insert(at, r)
    return out


def _descendants(tree, m):
    for c in tree.get(m, []):
        yield c
        yield from _descendants(tree, c)


def _level3_rows(verdicts, tree, inplace) -> dict:
    """``{kind: [row]}``: every judged module of a Level-3 kind; ``flagged`` when it fails locally
    and no module inside it of a Level-3 kind fails in the same phase (``failing_inside``: the
    first that does)."""
    _f = finite_or_null
    by = {(v.module, v.phase): v for v in verdicts}
    out: dict = {k: [] for k in LEVEL3_KINDS}
    for v in verdicts:
        kind = module_kind(v.module)
        if kind is None:
            continue
        inside = next((d for d in _descendants(tree, v.module) if module_kind(d) is not None
                       and (d, v.phase) in by and by[(d, v.phase)].passed is not True), None)
        t = v.tensor
        out[kind].append({
            "module": v.module, "phase": v.phase, "layer": v.layer, "passed": v.passed,
            "flagged": v.passed is not True and inside is None, "failing_inside": inside,
            "decided_by": v.decided_by, "sigma_ratio": _f(t.sigma_ratio) if t else None, "bc": _f(t.bc) if t else None,
            "bc_threshold": _f(t.bc_threshold_used) if t else None, "linf_ratio": _f(t.linf_ratio) if t else None,
            "linf_threshold": _f(t.linf_threshold_used) if t else None, "n_tokens": v.n_tokens,
            "first_token": v.token, "problem": v.problem,
            "inplace_passed": inplace.get((v.module, v.phase), (None, None))[0],
        })
    return out


def _store(store, source, row, runs, prompts, status, loc, search, verdicts, metric_rows, inplace, rank,
           engine_reruns, ref_reruns, wall, kinds=None, method: str = "rerun", unchecked=None) -> str:
    """Commit an isolation as a comparison. Its ``passed`` is true only when no module fails locally,
    every module was judged (none ``passed`` None: a problem) and, for Level 3, no kind went
    unchecked; an unchecked kind is stored as a row of its table with ``passed`` NULL, ``module``
    NULL and the reason in ``problem`` (a query over the table never reads it as a pass)."""
    from capturestore.comparators import declared_tables
    from capturestore.comparators.base import COMPARISONS_SCHEMA_VERSION, to_arrow
    from capturestore.integrity import commit_comparison

    _f = finite_or_null
    cid = f"cmp-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    for r in metric_rows:
        n = len(r["prompt_id"])
        r["comparison_id"] = [cid] * n
        for k in MODULE_LOCAL_METRICS.schema.names[8:]:
            x = np.asarray(r[k], dtype=np.float64)
            r[k] = np.where(np.isfinite(x), x, np.nan)
    vrows = []
    for level, v in verdicts:
        t = v.tensor
        ip = inplace.get((v.module, v.phase), (None, None))
        vrows.append({
            "comparison_id": cid, "source_comparison_id": source, "module": v.module, "phase": v.phase,
            "layer": v.layer, "level": level, "exec_order": rank.get(v.module), "passed": v.passed,
            "decided_by": v.decided_by, "sigma_ratio": _f(t.sigma_ratio) if t else None,
            "bc": _f(t.bc) if t else None, "noise_bc": _f(t.noise_bc) if t else None,
            "bc_threshold": _f(t.bc_threshold_used) if t else None, "linf_ratio": _f(t.linf_ratio) if t else None,
            "linf_threshold": _f(t.linf_threshold_used) if t else None, "max_l2_ratio": _f(v.max_l2_ratio),
            "n_prompts": v.n_prompts, "n_tokens": v.n_tokens, "first_position": v.position, "first_token": v.token,
            "first_prompt_id": v.token_prompt, "problem": v.problem, "inplace_passed": ip[0],
            "inplace_sigma_ratio": None if ip[1] is None else _f(ip[1]),
        })
    iso = [{"comparison_id": cid, "source_comparison_id": source, "status": status,
            "phase": loc and loc["phase"], "layer": loc and loc["layer"], "module": loc and loc["module"],
            "token": loc and loc["token"], "engine_reruns": engine_reruns, "reference_reruns": ref_reruns,
            "levels": len(search), "search": json.dumps(search), "wall_s": wall, "method": method}]
    staged = {"module_local_metrics": to_arrow(metric_rows, MODULE_LOCAL_METRICS, "module_local_metrics"),
              "module_local_verdicts": to_arrow([vrows], MODULE_LOCAL_VERDICTS, "module_local_verdicts"),
              "isolations": to_arrow([iso], ISOLATIONS, "isolations")}
    unchecked = unchecked or {}
    for kind, rows in (kinds or {}).items():
        rows = list(rows) + ([{"module": None, "phase": None, "passed": None, "flagged": False,
                               "problem": f"not checked: {unchecked[kind]}"}] if kind in unchecked else [])
        staged[f"level3_{kind}"] = to_arrow([[{"comparison_id": cid, "source_comparison_id": source, **r}
                                              for r in rows]], LEVEL3, f"level3_{kind}")
    staged = {t: x for t, x in staged.items() if x.num_rows}
    spec = declared_tables()["comparisons"]
    crow = {"comparison_id": cid, "label": f"{'level3' if kinds is not None else 'isolate'}"
                                           f"{' --snapshot' if method == 'snapshot' else ''} {source}",
            "created_at": datetime.now(UTC),
            "baseline_run": runs["baseline"], "expected_run": runs["expected"], "actual_run": runs["actual"],
            "three_way": True, "n_prompts": len(prompts), "models_differ": bool(row.get("models_differ")),
            "passed": status != "found" and all(v.passed is True for _, v in verdicts)
                      and not (kinds is not None and unchecked),
            "failure_phase": loc and loc["phase"], "localisation": None if loc is None else json.dumps(loc),
            "failure_layer": loc and loc["layer"], "failure_module": loc and loc["module"],
            "failure_token": loc and loc["token"], "judged": ["isolation"]}
    commit_comparison(store, cid, staged, to_arrow([[crow]], TableSpec(spec.schema, COMPARISONS_SCHEMA_VERSION),
                                                   "comparisons"))
    return cid
