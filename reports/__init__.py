"""HTML reports rendered from store queries (Jinja2 + Plotly). Never recomputes metrics.

``render_comparison(store, comparison_id, out_dir)`` writes an offline report (docs/reports.md);
``render_diff(store, base_id, head_id, out_dir)`` writes the diff page of two comparisons;
``report(store, comparison_id, out_dir, diff_base=None)`` is ``capturestore report`` (one or the other);
``history_html(table)`` is the page of ``capturestore history --format html``.
"""
from reports.history import history_html
from reports.render import check_out_dir, render_comparison, render_diff, report

__all__ = ["check_out_dir", "history_html", "render_comparison", "render_diff", "report"]
