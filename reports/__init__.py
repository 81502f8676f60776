"""HTML reports rendered from store queries (Jinja2 + Plotly). Never recomputes metrics."""
