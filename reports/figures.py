"""Plotly.js figure specs (plain dicts: data + layout) built from query results.

Figures are specs, not ``plotly.graph_objects``: a report of 200 prompts holds thousands of
them, and plotly.py's validation costs tens of milliseconds per figure. Heatmap values travel
as Plotly.js typed arrays (``{"dtype": "f4", "bdata": base64, "shape": "rows, cols"}``): float32
is what a colour scale can show, and base64 is a third of the size of JSON decimals. NaN (a
metric stored as NULL) is a gap in the heatmap.

Colour scales and annotations follow reference/000 (KV cache visualisation):
- L-inf: yellow = low, red = high, 0 to 0.2 (20 % relative error).
- target/BF16 error ratio: green = low, red = high (RdYlGn reversed), 0 to 3.0x.
- BC: 0-0.8 flat red (irrelevant below), 0.8-0.85 orange, 0.85-0.90 yellow, 0.90-0.95 light
  green, 0.95-1.0 green.
- a red vertical line at the prefill/decode boundary, orange dashed lines at divergence points.
Text from the store (layer names, statuses) is HTML-escaped before it goes into a figure:
Plotly.js renders a subset of HTML in labels and decodes entities.
"""
from __future__ import annotations

import base64
import html

import numpy as np

__all__ = ["LINF_SCALE", "RATIO_SCALE", "BC_SCALE", "heatmap", "lines", "typed"]

LINF_SCALE = [[0.0, "#ffffcc"], [0.25, "#fed976"], [0.5, "#fd8d3c"], [0.75, "#e31a1c"], [1.0, "#800026"]]
RATIO_SCALE = [[0.0, "#1a9850"], [0.2, "#91cf60"], [0.333, "#d9ef8b"], [0.5, "#fee08b"], [0.7, "#fc8d59"],
               [1.0, "#d73027"]]
BC_SCALE = [[0.0, "#d73027"], [0.8, "#d73027"], [0.8, "#fc8d59"], [0.85, "#fc8d59"], [0.85, "#fee08b"],
            [0.9, "#fee08b"], [0.9, "#a6d96a"], [0.95, "#a6d96a"], [0.95, "#1a9850"], [1.0, "#1a9850"]]
# head - base of a BC (diff page): red where head lost overlap with the BF16 noise, green where it gained
DELTA_SCALE = [[0.0, "#d73027"], [0.4, "#fc8d59"], [0.5, "#f7f7f7"], [0.6, "#91cf60"], [1.0, "#1a9850"]]
SCALES = {"linf": (LINF_SCALE, 0.0, 0.2), "ratio": (RATIO_SCALE, 0.0, 3.0), "bc": (BC_SCALE, 0.0, 1.0),
          "delta": (DELTA_SCALE, -0.2, 0.2)}

BOUNDARY_COLOUR = "#d62728"  # prefill/decode boundary
DIVERGENCE_COLOUR = "#ff7f0e"


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def typed(a: np.ndarray) -> dict:
    """A float32 Plotly.js typed array (1-D or 2-D) of ``a``."""
    a = np.ascontiguousarray(a, dtype="<f4")
    out = {"dtype": "f4", "bdata": base64.b64encode(a.tobytes()).decode("ascii")}
    if a.ndim == 2:
        out["shape"] = f"{a.shape[0]}, {a.shape[1]}"
    return out


def _vlines(xs, colour: str, dash: str, y_ref: str = "paper") -> list[dict]:
    return [{"type": "line", "xref": "x", "yref": y_ref, "x0": x, "x1": x, "y0": 0, "y1": 1,
             "line": {"color": colour, "width": 1.5, "dash": dash}} for x in xs]


def heatmap(z: np.ndarray, x, y_labels, title: str, scale: str, *, x_title: str, y_title: str = "layer",
            boundary: float | None = None, divergences=(), hover_label: str = "value") -> dict:
    """A heatmap spec, ``z: [len(y_labels), len(x)]``, with reference/000's scale ``scale``.

    ``boundary``: x of the prefill/decode boundary (red line); ``divergences``: x of divergence points."""
    colours, zmin, zmax = SCALES[scale]
    shapes = []
    if boundary is not None:
        shapes += _vlines([boundary], BOUNDARY_COLOUR, "solid")
    shapes += _vlines(list(divergences), DIVERGENCE_COLOUR, "dash")
    labels = [esc(n) for n in y_labels]
    return {
        "data": [{
            "type": "heatmap", "z": typed(z), "x": list(x), "y": labels, "colorscale": colours,
            "zmin": zmin, "zmax": zmax, "hoverongaps": False,
            "hovertemplate": f"{esc(y_title)} %{{y}}<br>{esc(x_title)} %{{x}}<br>{esc(hover_label)} %{{z:.4g}}<extra></extra>",
        }],
        "layout": {
            "title": {"text": esc(title), "font": {"size": 13}}, "shapes": shapes,
            "xaxis": {"title": {"text": esc(x_title)}, "dtick": 1 if len(x) <= 16 else None}, "yaxis": {"title": {"text": esc(y_title)}, "type": "category",
                                                                  "automargin": True},
            "height": max(220, 60 + 16 * len(labels)), "margin": {"t": 36, "r": 10, "b": 40},
        },
    }


def lines(x, series: dict, title: str, *, y_title: str, x_title: str = "generation token",
          guides: dict | None = None, divergences=(), log_y: bool = False) -> dict:
    """Line chart of ``series`` ({name: values}) over ``x``; ``guides``: {label: y} horizontal lines;
    divergence points as orange dashed lines."""
    data = [{"type": "scatter", "mode": "lines+markers", "name": esc(name), "x": list(x),
             "y": [None if v is None or not np.isfinite(v) else float(v) for v in ys]}
            for name, ys in series.items()]
    shapes = _vlines(list(divergences), DIVERGENCE_COLOUR, "dash")
    annotations = []
    for label, yv in (guides or {}).items():
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": yv, "y1": yv,
                       "line": {"color": "#888", "width": 1, "dash": "dot"}})
        annotations.append({"xref": "paper", "yref": "y", "x": 1, "y": yv, "text": esc(label), "showarrow": False,
                            "xanchor": "right", "yanchor": "bottom", "font": {"size": 10, "color": "#666"}})
    return {
        "data": data,
        "layout": {
            "title": {"text": esc(title), "font": {"size": 13}}, "shapes": shapes, "annotations": annotations,
            "xaxis": {"title": {"text": esc(x_title)}, "dtick": 1 if len(x) <= 20 else None},
            "yaxis": {"title": {"text": esc(y_title)}, "type": "log" if log_y else "linear"},
            "height": 300, "margin": {"t": 36, "r": 10, "b": 80}, "legend": {"orientation": "h", "y": -0.38},
        },
    }
