"""The history page: one metric of a model's comparisons across releases, as a self-contained
Plotly page (``capturestore history --format html``)."""
from __future__ import annotations

import pyarrow as pa


def history_html(t: pa.Table) -> str:
    """The page of ``capturestore.diff.history``'s table (its last column is the metric): one point
    per comparison, green where it passed, red where not; plotly.js inlined, so it opens offline."""
    import plotly.graph_objects as go

    metric = t.column_names[-1]
    rows = t.to_pylist()
    x = [f"{r['release'] or '?'} · {r['comparison_id'][-8:]}" for r in rows]
    y = [None if r[metric] is None else float(r[metric]) for r in rows]
    fig = go.Figure(go.Scatter(x=x, y=y, mode="lines+markers", marker={
        "color": ["#2a9d3a" if r["passed"] else "#c0392b" for r in rows], "size": 10}))
    fig.update_layout(title=f"{metric} across releases", xaxis_title="release · comparison", yaxis_title=metric)
    return fig.to_html(include_plotlyjs=True, full_html=True)
