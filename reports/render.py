"""Render a comparison (or two) as a static HTML report from store queries alone.

Output directory::

    index.html           Overview, Prompts, KV, Modules, Tasks, Queries tabs
    prompts/pNNNN.html   one page per prompt (logits + KV figures), loaded into the Prompts
                         tab's frame only when the prompt is opened
    plotly.min.js        the installed plotly package's copy, written once; no page loads
                         anything from the network, so the report opens offline from file://
    assets/report.css, assets/report.js
    queries.sql          every query the report ran, with the comparison id filled in

Every number comes from ``reports.queries`` (SQL over the catalog views); nothing is recomputed
here. Jinja2 autoescapes every template: prompt text, labels, run metadata and sample text show as
text, never as markup. Figure data is embedded with ``tojson`` (``<``, ``>``, ``&`` escaped).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reports import figures
from reports.queries import Queries, quote

__all__ = ["render_comparison", "render_diff"]

TEMPLATES = Path(__file__).parent / "templates"
ROLE_ORDER = ("baseline", "expected", "actual")
SIGMA_THRESHOLD, BC_THRESHOLD, RATIO_GUIDE = 1.0, 0.99, 1.5  # reference/002 check thresholds (guides only)
# the per-token table of a prompt page (every column is in the logit_tokens query and its figures)
TOKEN_TABLE_COLUMNS = ("gen_token_idx", "position", "status", "divergence", "teacher_token", "expected_token",
                       "actual_token", "topk_5_error", "topk_all_error", "linf_ratio", "l2_ratio", "bc")
TABLE_ROWS = 500  # rows of a module / task view shown; the query shown with it returns all


def _natural_key(s: str):
    """'layers.10' after 'layers.9'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(s))]


def _num(x, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{digits}g}"
    return str(x)


def _env():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _num
    return env


def _open_store(store):
    if isinstance(store, (str, os.PathLike)):
        from capturestore.store import Store

        return Store.open(store, create=False)
    return store


def check_out_dir(out_dir) -> Path:
    """The output directory, checked before any query runs by writing a probe file into it
    (permission bits say nothing to root; a read-only mount or /proc says it only on write).
    A directory made for the check is removed again. ValueError in one line when it is a file or
    cannot be created or written."""
    if out_dir is None or not str(out_dir).strip():
        raise ValueError("the output directory is empty; give one (--out DIR)")
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; give a directory (--out DIR)")
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".report-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"output directory {out} cannot be written ({e.strerror or e})") from None
    finally:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    return out


# ---- splitting whole-comparison query results by prompt -----------------------------------------
def _by_prompt(t: pa.Table | None) -> dict[str, pa.Table]:
    """{prompt_id: its rows} of a table ordered by prompt_id (one pass, no per-prompt query)."""
    if t is None or t.num_rows == 0:
        return {}
    ids = t.column("prompt_id").combine_chunks()
    n = len(ids)
    starts = [0]
    if n > 1:
        change = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
        starts += (np.flatnonzero(change) + 1).tolist()
    ends = starts[1:] + [n]
    return {ids[s].as_py(): t.slice(s, e - s) for s, e in zip(starts, ends)}


def _col(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def _grid(t: pa.Table, row_col: str, row_order: list, x_col: str, n_x: int, value: str, x_offset: int = 0) -> np.ndarray:
    """[len(row_order), n_x] of ``value``; cells without a row are NaN."""
    z = np.full((len(row_order), n_x), np.nan)
    if value not in t.column_names:
        return z
    ri = pc.index_in(t.column(row_col), value_set=pa.array(row_order, t.schema.field(row_col).type)).to_numpy(
        zero_copy_only=False)
    xi = t.column(x_col).to_numpy(zero_copy_only=False).astype(np.int64) - x_offset
    ok = ~np.isnan(ri.astype(np.float64)) & (xi >= 0) & (xi < n_x)
    z[ri[ok].astype(np.int64), xi[ok]] = _col(t, value)[ok]
    return z


# ---- the overview --------------------------------------------------------------------------------
def _status(row: dict, totals: dict) -> tuple[str, str]:
    """(css class, headline) of the banner: green all passed, yellow passed with deviations or
    not judged, red a verdict failed (reference/002 status banner)."""
    verdicts = [row.get("logit_passed"), row.get("kv_passed")]
    if any(v is False for v in verdicts):
        return "fail", "FAIL"
    if not row.get("passed"):
        return "warn", "NOT JUDGED"
    deviations = (totals.get("n_failed_tokens") or 0) + (totals.get("n_divergent") or 0)
    return ("warn", "PASS with deviations") if deviations else ("pass", "PASS")


def _json_field(v):
    if v is None:
        return None
    if isinstance(v, (dict, list)):
        return v
    try:
        return json.loads(v)
    except (TypeError, ValueError):
        return v


def _checks(row: dict, totals: dict) -> list[dict]:
    """The logit checks of reference/002 in priority order with their numbers; ``decided`` marks
    the one the comparisons row names."""
    decided = row.get("logit_decided_by")
    n_tok, n_fail = totals.get("n_tokens") or 0, totals.get("n_failed_tokens") or 0
    topk = {m.group(1): v for k, v in totals.items() if (m := re.fullmatch(r"max_topk_(\w+)_error", k))}
    sigma, bc = row.get("logit_sigma_ratio"), row.get("logit_min_bc")
    return [
        {"name": "σ-ratio", "key": "sigma_ratio", "value": _num(sigma), "rule": f"≤ {SIGMA_THRESHOLD}",
         "ok": None if sigma is None else sigma <= SIGMA_THRESHOLD, "decided": decided == "sigma_ratio"},
        {"name": "aggregate BC (min over generation tokens)", "key": "aggregate_bc", "value": _num(bc),
         "rule": f"≥ {BC_THRESHOLD}", "ok": None if bc is None else bc >= BC_THRESHOLD,
         "decided": decided == "aggregate_bc"},
        {"name": "static top-k", "key": "static_topk",
         "value": f"{n_fail}/{n_tok} tokens fail; max error " + ", ".join(f"K{k} {_num(v)}" for k, v in topk.items()),
         "rule": "every token within the top-k map", "ok": None if not n_tok else n_fail == 0,
         "decided": decided == "static_topk"},
    ]


def _triage(row: dict, totals: dict) -> list[dict]:
    """The triage flowchart of reference/002, each node with why it is (not) the branch taken."""
    phase = row.get("failure_phase")
    lp, kvp = row.get("logit_passed"), row.get("kv_passed")
    sigma, bc = row.get("logit_sigma_ratio"), row.get("logit_min_bc")
    three = bool(row.get("three_way"))
    max_ratio = totals.get("max_linf_ratio")
    noise = three and ((sigma is not None and sigma <= SIGMA_THRESHOLD) or (bc is not None and bc >= BC_THRESHOLD))
    bug = three and lp is False and not noise
    nodes = [
        {"id": "logits", "depth": 0, "text": "Logit validation " + ("passes" if lp else "fails" if lp is False else "not run"),
         "on": lp is not None, "why": f"logit_passed = {_num(lp)}"},
        {"id": "prefill", "depth": 1, "text": "Token 0 fails", "on": phase == "prefill",
         "why": "failure_phase = prefill" if phase == "prefill" else ""},
        {"id": "prefill-bug", "depth": 2, "text": "Prefill bug → check Tensor Compare (Modules) for the first divergent module",
         "on": phase == "prefill", "why": ""},
        {"id": "decode", "depth": 1, "text": "Tokens 1+ fail, token 0 passes", "on": phase == "decode",
         "why": "failure_phase = decode" if phase == "decode" else ""},
        {"id": "kv-write", "depth": 2, "text": "KV Cache → high error at early tokens = KV write bug",
         "on": kvp is False, "why": f"kv_passed = false, first deviating KV layer {row.get('kv_first_failing_layer')}"
         if kvp is False else ""},
        {"id": "decode-modules", "depth": 2, "text": "Tensor Compare on decode steps", "on": phase == "decode", "why": ""},
        {"id": "noise", "depth": 1, "text": "Three-way ratio ≈ 1.0x, BC ≥ 0.99", "on": noise,
         "why": f"σ-ratio {_num(sigma)}, aggregate BC min {_num(bc)}" if noise else ""},
        {"id": "noise-leaf", "depth": 2, "text": "Dtype-inherent error (BF16 noise), not an engine bug", "on": noise, "why": ""},
        {"id": "bug", "depth": 1, "text": "Three-way ratio >> 1.0x", "on": bug,
         "why": f"σ-ratio {_num(sigma)}, worst per-token L-inf ratio {_num(max_ratio)}" if bug else ""},
        {"id": "bug-leaf", "depth": 2, "text": "Engine-specific bug → Tensor Compare to isolate the layer", "on": bug, "why": ""},
    ]
    return nodes


def _prompt_status(p: dict, logit_passed) -> str:
    if p.get("n_failed_tokens"):
        return "fail" if logit_passed is False else "warn"
    return "pass"


def _short(text, n: int = 60) -> str:
    if text is None:
        return ""
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 1] + "…"


# ---- per-prompt figures ------------------------------------------------------------------------
def _logit_figures(t: pa.Table) -> list[dict]:
    g = t.column("gen_token_idx").to_pylist()
    div = [x for x, d in zip(g, t.column("divergence").to_pylist()) if d] if "divergence" in t.column_names else []
    figs = []
    topk = {f"top-{m.group(1)}": _col(t, c) for c in t.column_names if (m := re.fullmatch(r"topk_(\w+)_error", c))}
    if topk:
        figs.append(("topk", figures.lines(g, topk, "Top-k error per token (orange dashed: divergence)",
                                           y_title="top-k error", divergences=div)))
    ratios = {n: _col(t, c) for n, c in (("L-inf ratio", "linf_ratio"), ("L2 ratio", "l2_ratio")) if c in t.column_names}
    if ratios and any(np.isfinite(v).any() for v in ratios.values()):
        figs.append(("ratios", figures.lines(g, ratios, "Three-way ratio target/BF16 error vs FP32", y_title="ratio",
                                             guides={"1.0x": 1.0, f"{RATIO_GUIDE}x": RATIO_GUIDE}, divergences=div)))
    if "bc" in t.column_names and np.isfinite(_col(t, "bc")).any():
        figs.append(("bc", figures.lines(g, {"BC": _col(t, "bc")}, "BC of target vs BF16 logit errors",
                                         y_title="BC", guides={str(BC_THRESHOLD): BC_THRESHOLD}, divergences=div)))
    return figs


def _kv_figures(pos: pa.Table | None, bc: pa.Table | None, heads: pa.Table | None, layers: list, n_pos: int,
                plen: int | None, div_pos: list) -> list[tuple]:
    figs = []
    boundary = None if plen is None else plen - 0.5
    x = list(range(n_pos))
    kw = dict(x_title="position", boundary=boundary, divergences=div_pos)
    if pos is not None and pos.num_rows:
        for kv in ("k", "v"):
            figs.append((f"{kv}-linf", figures.heatmap(_grid(pos, "layer", layers, "position", n_pos, f"{kv}_linf"), x, layers,
                                                     f"{kv.upper()} L-inf (max over heads), target", "linf",
                                                     hover_label="L-inf", **kw)))
        for kv in ("k", "v"):
            z = _grid(pos, "layer", layers, "position", n_pos, f"{kv}_ratio")
            if np.isfinite(z).any():
                figs.append((f"{kv}-ratio", figures.heatmap(z, x, layers, f"{kv.upper()} L-inf ratio target/BF16", "ratio",
                                                          hover_label="ratio", **kw)))
    if bc is not None and bc.num_rows:
        for kv in ("k", "v"):
            figs.append((f"{kv}-bc", figures.heatmap(_grid(bc, "layer", layers, "position", n_pos, f"{kv}_bc"), x, layers,
                                                   f"{kv.upper()} BC target vs BF16 errors", "bc", hover_label="BC", **kw)))
    if heads is not None and heads.num_rows:
        n_heads = int(pc.max(heads.column("head")).as_py()) + 1
        hx = list(range(n_heads))
        for kv in ("k", "v"):
            figs.append((f"{kv}-heads", figures.heatmap(_grid(heads, "layer", layers, "head", n_heads, f"{kv}_linf"), hx,
                                                      layers, f"{kv.upper()} L-inf per KV head (max over positions)",
                                                      "linf", x_title="KV head", hover_label="L-inf")))
    return figs


def _layer_order(*tables) -> list:
    names = set()
    for t in tables:
        if t is not None and t.num_rows:
            names.update(pc.unique(t.column("layer")).to_pylist())
    return sorted(names, key=_natural_key)


# ---- writing ---------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_assets(out: Path) -> None:
    import plotly

    src = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    dst = out / "plotly.min.js"
    if not (dst.is_file() and dst.stat().st_size == src.stat().st_size):
        tmp = out / f".plotly.min.js.{os.getpid()}.tmp"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    for name in ("report.css", "report.js"):
        _write(out / "assets" / name, (TEMPLATES / name).read_text(encoding="utf-8"))


def _queries_context(q: Queries, store_root) -> list[dict]:
    return [{"name": n, "purpose": p, "sql": s,
             "shell": f"capturestore sql --store {store_root} \"{' '.join(s.split())}\""} for n, p, s in q.ran]


def _write_queries(out: Path, q: Queries, header: str) -> None:
    parts = [f"-- {header}\n-- every query this report ran, in order; run one with capturestore sql --store STORE \"...\"\n"]
    parts += [f"\n-- {n}: {p}\n{s};\n" for n, p, s in q.ran]
    _write(out / "queries.sql", "".join(parts))


def _unknown_comparison(q: Queries, cid: str) -> ValueError:
    latest = q.latest_comparisons()
    said = ", ".join(f"{r['comparison_id']}" + (f" ({r['label']})" if r.get("label") else "") for r in latest)
    return ValueError(f"no comparison {cid!r} in {q.store.root}; "
                      + (f"the latest: {said}" if latest else "the store holds no comparison (capturestore compare makes one)"))


def _load(q: Queries, cid: str) -> tuple[dict, list[dict]]:
    if not isinstance(cid, str) or not cid.strip():
        raise ValueError("no comparison id given")
    row = q.comparison(cid) if q.has("comparisons", "comparison_id") else None
    if row is None:
        raise _unknown_comparison(q, cid)
    q.store.check_evidence([cid], "report")  # never a page drawn from the rows that are left
    runs = q.runs(cid)
    gone = [f"{r['role']} run {r['run_id']}" for r in runs if not r["present"]]
    if gone:
        raise ValueError(f"comparison {cid} compares runs that are no longer in {q.store.root}: "
                         f"{', '.join(gone)}; its metrics cannot be shown against their runs")
    return row, runs


def report(store, comparison_id: str, out_dir, *, diff_base: str | None = None) -> Path:
    """``capturestore report``: ``render_comparison`` of ``comparison_id`` into ``out_dir``, or with
    ``diff_base`` the diff page of ``comparison_id`` (the head) against it (``render_diff``).
    ``out_dir`` is checked before the store (a ``Store`` or its path / URL) is opened. -> the page."""
    from capturestore.store import as_store

    if diff_base is not None and not str(diff_base).strip():  # was read as no --diff-base at all
        raise ValueError("report: --diff-base is empty; give the base comparison's id")
    if diff_base is not None and diff_base == comparison_id:  # diff refuses it; the page was written
        raise ValueError(f"report: --diff-base {diff_base} is the comparison itself: nothing to diff")
    check_out_dir(out_dir)  # before opening the store: a bad --out fails at once
    store = as_store(store)
    if diff_base is not None:
        return render_diff(store, diff_base, comparison_id, out_dir)
    return render_comparison(store, comparison_id, out_dir)


def render_comparison(store, comparison_id: str, out_dir) -> Path:
    """Write the HTML report of comparison ``comparison_id`` of ``store`` (a Store or its path)
    into ``out_dir``; returns the path of ``index.html``.

    ValueError (one line) for an unknown comparison (naming the latest ones), a comparison whose
    runs were removed, one that holds no metrics, or an output path that is a file or cannot be
    written; nothing is written then.
    """
    out = check_out_dir(out_dir)
    store = _open_store(store)
    q = Queries(store)
    cid = comparison_id
    if isinstance(cid, str) and cid.strip():
        from reports.cachecheck import is_cachecheck, render_cachecheck

        if is_cachecheck(store, cid):  # a cache check (capturestore cachecheck) has no runs: its own page
            return render_cachecheck(store, cid, out)
    row, runs = _load(q, cid)
    expected = next((r["run_id"] for r in runs if r["role"] == "expected"), None)
    summary = q.prompt_summary(cid, expected or "")
    if summary.num_rows == 0:
        raise ValueError(f"comparison {cid} holds no metrics (no logit_token_metrics or kv_head_metrics rows): "
                         f"nothing to report")
    prompts = summary.to_pylist()
    totals, logit_tokens = q.logit_totals(cid), q.logit_tokens(cid)
    kv_pos, kv_bc, kv_heads = q.kv_positions(cid), q.kv_token_bc(cid), q.kv_heads(cid)
    gen_bc, div_counts = q.kv_gen_bc(cid), q.divergences_per_gen_token(cid)
    layer_verdicts = q.kv_layer_verdicts(cid)
    run_ids = [r["run_id"] for r in runs]
    views = q.views()
    module_views = [v for v in sorted(views) if v.startswith(("module", "tensor_module"))]
    task_views = [v for v in sorted(views) if v.startswith(("task", "lm_eval"))]
    extra = {v: q.optional_table(v, cid, run_ids, TABLE_ROWS) for v in module_views + task_views}
    module_figs = _module_figures(q, cid, module_views)

    # every query has run: only now is anything written
    out.mkdir(parents=True, exist_ok=True)
    _copy_assets(out)
    env = _env()
    layers = _layer_order(kv_pos, kv_bc)
    logit_by, pos_by, bc_by, heads_by = (_by_prompt(t) for t in (logit_tokens, kv_pos, kv_bc, kv_heads))
    status, headline = _status(row, totals)
    for n, p in enumerate(prompts):
        p["page"] = f"p{n:04d}"
        p["status"] = _prompt_status(p, row.get("logit_passed"))
        p["short"] = _short(p.get("text")) or f"prompt {p['prompt_id']}"

    prompt_tpl = env.get_template("prompt.html")
    keep = set()
    for p in prompts:
        pid = p["prompt_id"]
        lt = logit_by.get(pid)
        plen = p.get("n_prompt_tokens")
        div_pos = []
        if lt is not None and "divergence" in lt.column_names:
            div_pos = [x for x, d in zip(lt.column("position").to_pylist(), lt.column("divergence").to_pylist()) if d]
        n_pos = int(p.get("n_tokens") or 0)
        for t in (pos_by.get(pid), bc_by.get(pid)):
            if t is not None and t.num_rows:
                n_pos = max(n_pos, int(pc.max(t.column("position")).as_py()) + 1)
        figs = _logit_figures(lt) if lt is not None else []
        kv_figs = _kv_figures(pos_by.get(pid), bc_by.get(pid), heads_by.get(pid), layers, n_pos, plen, div_pos)
        token_rows = lt.to_pylist() if lt is not None else []
        _write(out / "prompts" / f"{p['page']}.html", prompt_tpl.render(
            prompt=p, comparison=row, logit_figs=figs, kv_figs=kv_figs, tokens=token_rows,
            token_cols=[c for c in (lt.column_names if lt is not None else []) if c in TOKEN_TABLE_COLUMNS],
            status=status, headline=headline))
        keep.add(f"{p['page']}.html")
    for f in (out / "prompts").glob("p*.html"):  # pages of an earlier render of another comparison
        if f.name not in keep:
            f.unlink()

    kv_figs = _aggregate_figures(gen_bc, div_counts)
    _write(out / "index.html", env.get_template("index.html").render(
        comparison=row, cid=cid, runs=runs, prompts=prompts, status=status, headline=headline,
        checks=_checks(row, totals), triage=_triage(row, totals),
        localisation=_localisation(row, extra), layer_verdicts=layer_verdicts,
        layer_cols=list(layer_verdicts[0].keys()) if layer_verdicts else [], kv_figs=kv_figs,
        module_views=module_views, task_views=task_views, extra=extra, module_figs=module_figs,
        queries=_queries_context(q, store.root), store_root=str(store.root), table_rows=TABLE_ROWS))
    _write_queries(out, q, f"report of comparison {cid} of store {store.root}")
    return out / "index.html"


LOCALISATION_LABELS = {"phase": "phase", "layer": "decoder layer", "module": "module", "token": "generation token"}


def _localisation(row: dict, extra: dict) -> list[tuple[str, str]]:
    """(what, where) pairs: the comparisons row's ``localisation`` (phase, decoder layer, module,
    generation token) where the store has that column, else what the older columns say; plus the
    first deviating KV layer, which is a different claim (see its note)."""
    out = []
    loc = _json_field(row.get("localisation"))
    if isinstance(loc, dict):
        out += [(LOCALISATION_LABELS.get(k, str(k)), json.dumps(v) if isinstance(v, (dict, list)) else _num(v))
                for k, v in loc.items() if v is not None]
    elif loc is not None:
        out.append(("localisation", str(loc)))
    have = set(loc) if isinstance(loc, dict) else set()
    if row.get("failure_phase") and not (have & {"phase"} and loc.get("phase")):
        out.append(("phase", row["failure_phase"]))
    ft = _json_field(row.get("first_failing_token"))
    if ft:
        out.append(("first failing logit token", ", ".join(f"{k} {v}" for k, v in ft.items()) if isinstance(ft, dict) else str(ft)))
    if row.get("kv_first_failing_layer"):
        out.append(("first deviating KV layer", f"{row['kv_first_failing_layer']} (a bug inside layer L first shows "
                                                f"in the KV of layer L+1: the KV of a layer comes from its input)"))
    if not (isinstance(loc, dict) and loc.get("module")):
        for v, (cols, rows, _) in extra.items():
            if v.startswith("module") and "verdict" in v and "module" in cols and "passed" in cols:
                bad = [r for r in rows if r.get("passed") is False]
                if bad:
                    out.append(("first failing module", f"{bad[0]['module']}"
                                + (f" ({bad[0]['phase']})" if bad[0].get("phase") else "")))
                    break
    return out


def _module_figures(q: Queries, cid: str, views: list[str]) -> list[tuple]:
    figs = []
    for v in views:
        ratio_cols = [c for c in ("l2_ratio", "linf_ratio") if q.has(v, c)]
        if not (q.has(v, "comparison_id", "module") and ratio_cols):
            continue
        t = q.run(f"{v}_per_module", f"worst ratio per module of {v}", f"""
            SELECT module, {', '.join(f'max({c}) AS max_{c}' for c in ratio_cols)} FROM {v}
            WHERE comparison_id = {quote(cid)} GROUP BY module""")
        if not t.num_rows:
            continue
        mods = sorted(t.column("module").to_pylist(), key=_natural_key)
        idx = {m: i for i, m in enumerate(t.column("module").to_pylist())}
        series = {f"max {c}": [t.column(f"max_{c}")[idx[m]].as_py() for m in mods] for c in ratio_cols}
        fig = figures.lines([figures.esc(m) for m in mods], series, f"{v}: worst ratio per module",
                            y_title="ratio", x_title="module", guides={"1.0x": 1.0})
        fig["layout"]["xaxis"].update({"type": "category", "dtick": None})
        figs.append((f"{v}-modules", fig))
    return figs


def _aggregate_figures(gen_bc: pa.Table | None, div_counts: pa.Table | None) -> list[tuple]:
    if gen_bc is None or not gen_bc.num_rows:
        return []
    layers = _layer_order(gen_bc)
    n_gen = int(pc.max(gen_bc.column("gen_token_idx")).as_py()) + 1
    x = list(range(n_gen))
    divs = {}
    if div_counts is not None:
        divs = dict(zip(div_counts.column("gen_token_idx").to_pylist(), div_counts.column("n_divergent").to_pylist()))
    n_prompts = gen_bc.column("n_prompts")[0].as_py() if "n_prompts" in gen_bc.column_names else None
    figs = []
    for kv in ("k", "v"):
        fig = figures.heatmap(_grid(gen_bc, "layer", layers, "gen_token_idx", n_gen, f"{kv}_bc"), x, layers,
                              f"{kv.upper()} BC across {n_prompts} prompts per generation token", "bc",
                              x_title="generation token", hover_label="BC")
        fig["layout"]["annotations"] = [
            {"x": g, "y": 1.0, "xref": "x", "yref": "paper", "yanchor": "bottom", "showarrow": False,
             "text": f"{n} div", "font": {"size": 9, "color": figures.DIVERGENCE_COLOUR}} for g, n in divs.items() if n]
        figs.append((f"agg-{kv}-bc", fig))
    return figs


# ---- two comparisons -----------------------------------------------------------------------------
def render_diff(store, base_id: str, head_id: str, out_dir, result=None) -> Path:
    """Write ``diff.html`` comparing comparison ``head_id`` against ``base_id`` into ``out_dir``
    (the layout of the regression diff; its numbers are SQL over both comparisons' rows).
    ``result``: the ``capturestore.diff.DiffResult`` of the two (computed here when None): its
    regression verdict, verdict changes and σ-ratio changes with their bootstrap intervals."""
    out = check_out_dir(out_dir)
    store = _open_store(store)
    if result is None:
        from capturestore.diff import DiffResult, diff

        try:
            result = diff(store, base_id, head_id, common_prompts=True)
        except ValueError:  # e.g. two models: the page shows both sides without a regression verdict
            result = None
        if not isinstance(result, DiffResult):  # two cache checks: no runs' diff to show
            result = None
    q = Queries(store)
    sides = {}
    for side, cid in (("base", base_id), ("head", head_id)):
        row, runs = _load(q, cid)
        q.ran = [(n if n.startswith(("base_", "head_")) else f"{side}_{n}", p, s) for n, p, s in q.ran]
        sides[side] = {"row": row, "runs": runs, "cid": cid}
    cols = ["passed", "logit_passed", "logit_decided_by", "logit_sigma_ratio", "logit_min_bc", "kv_passed",
            "kv_first_failing_layer", "failure_phase", "n_prompts"]
    checks = []
    for c in cols:
        b, h = sides["base"]["row"].get(c), sides["head"]["row"].get(c)
        delta = h - b if isinstance(b, float) and isinstance(h, float) else None
        checks.append({"name": c, "base": b, "head": h, "delta": delta, "changed": b != h})
    layers = []
    if q.has("kv_layer_verdicts", "layer"):
        t = q.run("layer_diff", "per layer: KV verdict and pooled numbers, base vs head", f"""
            SELECT coalesce(b.layer, h.layer) AS layer, b.passed AS base_passed, h.passed AS head_passed,
                   b.k_sigma_ratio AS base_k_sigma_ratio, h.k_sigma_ratio AS head_k_sigma_ratio,
                   b.v_sigma_ratio AS base_v_sigma_ratio, h.v_sigma_ratio AS head_v_sigma_ratio,
                   b.k_bc AS base_k_bc, h.k_bc AS head_k_bc, b.v_bc AS base_v_bc, h.v_bc AS head_v_bc
            FROM (SELECT * FROM kv_layer_verdicts WHERE comparison_id = {quote(base_id)}) b
            FULL JOIN (SELECT * FROM kv_layer_verdicts WHERE comparison_id = {quote(head_id)}) h
            USING (layer)""")
        layers = sorted(t.to_pylist(), key=lambda r: _natural_key(r["layer"]))
    prompt_rows = []
    if q.has("logit_token_metrics", "prompt_id"):
        t = q.run("prompt_diff", "per prompt: failing and diverging tokens, base vs head (new / resolved)", f"""
            WITH s AS (SELECT comparison_id, prompt_id, count(*) FILTER (WHERE NOT passed) AS n_failed,
                              list(gen_token_idx ORDER BY gen_token_idx) FILTER (WHERE divergence) AS divergent
                       FROM logit_token_metrics
                       WHERE comparison_id IN ({quote(base_id)}, {quote(head_id)})
                       GROUP BY ALL)
            SELECT prompt_id, b.n_failed AS base_failed, h.n_failed AS head_failed,
                   (SELECT list(x) FROM unnest(coalesce(h.divergent, [])) AS u(x)
                    WHERE NOT list_contains(coalesce(b.divergent, []), x)) AS new_divergences,
                   (SELECT list(x) FROM unnest(coalesce(b.divergent, [])) AS u(x)
                    WHERE NOT list_contains(coalesce(h.divergent, []), x)) AS resolved_divergences
            FROM (SELECT * FROM s WHERE comparison_id = {quote(base_id)}) b
            FULL JOIN (SELECT * FROM s WHERE comparison_id = {quote(head_id)}) h USING (prompt_id)
            ORDER BY prompt_id""")
        prompt_rows = t.to_pylist()
    delta_figs = []
    if q.has("kv_gen_bc", "gen_token_idx"):
        t = q.run("gen_bc_diff", "cross-prompt BC per generation token x layer: head - base", f"""
            SELECT gen_token_idx, layer, h.k_bc - b.k_bc AS d_k_bc, h.v_bc - b.v_bc AS d_v_bc
            FROM (SELECT * FROM kv_gen_bc WHERE comparison_id = {quote(base_id)}) b
            JOIN (SELECT * FROM kv_gen_bc WHERE comparison_id = {quote(head_id)}) h USING (gen_token_idx, layer)
            ORDER BY gen_token_idx""")
        if t.num_rows:
            gl = _layer_order(t)
            n_gen = int(pc.max(t.column("gen_token_idx")).as_py()) + 1
            for kv in ("k", "v"):
                delta_figs.append((f"delta-{kv}-bc", figures.heatmap(
                    _grid(t, "layer", gl, "gen_token_idx", n_gen, f"d_{kv}_bc"), list(range(n_gen)), gl,
                    f"{kv.upper()} BC across prompts: head − base", "delta", x_title="generation token",
                    hover_label="ΔBC")))
    out.mkdir(parents=True, exist_ok=True)
    _copy_assets(out)
    path = out / "diff.html"
    _write(path, _env().get_template("diff.html").render(
        base=sides["base"], head=sides["head"], checks=checks, layers=layers, prompt_rows=prompt_rows,
        delta_figs=delta_figs, result=result,
        queries=_queries_context(q, store.root)))
    return path
