"""The report of a cache check (``capturestore cachecheck``): one offline page rendered from SQL.

A scenario x criterion grid (greedy tokens, logits, KV, engine checks) with the first differing
position in each failing cell, the failing requests with their diagnosis, and every query the
page ran (``queries.sql``): each number can be reproduced with ``capturestore sql``.
"""
from __future__ import annotations

import html
from pathlib import Path

from reports.queries import quote

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;font-size:14px}th{background:#f3f3f3}
.pass{background:#e3f5e1}.fail{background:#f9d6d5}.not_run{background:#eee;color:#666}code{font-size:13px}"""


def _cell(status: str, text: str) -> str:
    return f'<td class="{html.escape(status)}">{html.escape(text)}</td>'


def is_cachecheck(store, comparison_id: str) -> bool:
    """Whether ``comparison_id`` is a cache check (it has a ``cachecheck_engines`` row)."""
    if "cachecheck_engines" not in store.sql(
            "SELECT table_name FROM information_schema.tables").column("table_name").to_pylist():
        return False
    return store.sql(f"SELECT count(*) AS n FROM cachecheck_engines WHERE comparison_id = {quote(comparison_id)}"
                     ).to_pylist()[0]["n"] > 0


def render_cachecheck(store, comparison_id: str, out: Path) -> Path:
    """Write ``out/index.html`` and ``out/queries.sql`` of cache check ``comparison_id``."""
    cid = quote(comparison_id)
    queries = [
        ("engine", f"SELECT * FROM cachecheck_engines WHERE comparison_id = {cid}"),
        ("grid", "SELECT * FROM (SELECT s.scenario, s.kind, s.status, s.reason, s.diagnosis, s.first_request, s.first_position, "
                 "s.first_kv_layer, s.max_logit_err, s.tolerance, "
                 "min(CASE WHEN NOT p.token_ok THEN p.position END) AS first_token_position, "
                 "min(CASE WHEN NOT p.within_tolerance THEN p.position END) AS first_logit_position "
                 "FROM cachecheck_scenarios s LEFT JOIN cachecheck_positions p "
                 "ON p.comparison_id = s.comparison_id AND p.scenario = s.scenario "
                 f"WHERE s.comparison_id = {cid} GROUP BY ALL) ORDER BY status = 'pass', scenario"),
        ("failing requests", "SELECT scenario, request, kind, first_position, first_token_position, "
                             "first_logit_position, max_logit_err, tolerance, kv_layer, kv_position, diagnosis, detail "
                             f"FROM cachecheck_requests WHERE comparison_id = {cid} AND status = 'fail' "
                             "ORDER BY scenario, first_position"),
    ]
    engine, grid, failing = (store.sql(sql).to_pylist() for _, sql in queries)
    e = engine[0]
    rows = []
    for g in grid:
        if g["status"] == "not_run":
            rows.append(f"<tr><td>{html.escape(g['scenario'])}</td>" + _cell("not_run", f"not run: {g['reason']}") * 4
                        + "<td></td></tr>")
            continue
        tok = ("pass", "identical") if g["first_token_position"] is None else ("fail", f"from position {g['first_token_position']}")
        lg = ("pass", f"max {g['max_logit_err']:.1e}") if g["first_logit_position"] is None else \
            ("fail", f"from position {g['first_logit_position']} (max {g['max_logit_err']:.1e} vs {g['tolerance']:.0e})")
        kv = ("pass", "") if g["first_kv_layer"] is None else ("fail", f"layer {g['first_kv_layer']}")
        check = ("fail", "engine check failed") if g["status"] == "fail" and tok[0] == lg[0] == "pass" else ("pass", "")
        rows.append(f"<tr><td>{html.escape(g['scenario'])}</td>" + "".join(_cell(*c) for c in (tok, lg, kv, check))
                    + f"<td>{html.escape(g['diagnosis'] or '')}</td></tr>")
    fails = "".join("<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in r.values())
                    + "</tr>" for r in failing)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in (failing[0] if failing else {}))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>cache check {html.escape(comparison_id)}</title>
<style>{_CSS}</style></head><body>
<h1>Cache check {html.escape(comparison_id)}: {html.escape(e['verdict'])}</h1>
<p>engine <code>{html.escape(str(e['engine']))}</code> on <code>{html.escape(str(e['model_path']))}</code>,
{html.escape(str(e['dtype']))}, context {e['max_context']}, block size {e['block_size']}, window {e['window']},
padding {html.escape(str(e['padding_side']))}; tolerance {e['tolerance']:.1e} relative (noise {e['noise']:.1e});
{e['n_passed']} passed, {e['n_failed']} failed, {e['n_not_run']} not run, {e['wall_s']:.1f} s.</p>
<h2>Scenario x criterion</h2>
<table><tr><th>scenario</th><th>greedy tokens</th><th>logits</th><th>KV (first layer)</th><th>engine checks</th>
<th>diagnosis</th></tr>{''.join(rows)}</table>
<h2>Failing requests</h2>
{'<p>none</p>' if not failing else f'<table><tr>{head}</tr>{fails}</table>'}
<p>Every number here comes from <code>queries.sql</code> (run one with <code>capturestore sql</code>).</p>
</body></html>
"""
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(page, encoding="utf-8")
    (out / "queries.sql").write_text("".join(f"-- {n}\n{s};\n\n" for n, s in queries), encoding="utf-8")
    return out / "index.html"
