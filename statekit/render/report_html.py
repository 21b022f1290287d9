"""``report -o PAGE.html``: one self-contained page, findings first, then the panels.

Drawn with plotly's offline bundle: plotly.js is inlined once in the page, each panel is a
plotly figure (hover names the tensor; drag to zoom on models with thousands of tensors); styles
are inline, fonts are the system's. Nothing is fetched when the page opens. plotly is imported
here only, so no other command pays for it (``pip install 'statekit[report]'``).
"""

from __future__ import annotations

import html
import json
import math

from statekit.errors import UsageError
from statekit.render.report import schedule_line

CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}
BAND = (0.2, 0.3)  # the update RMS Adam settles at after warm-up
APART = 6  # rows of the √v̂ distribution between a tensor off the layer pattern and its neighbours
KARPATHY = -3.0  # log10 of the update:weight ratio "should be ~1e-3"
COLORWAY = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd", "#e6550d", "#31a354",
            "#756bb1", "#636363"]  # one colour per module kind, for models of up to 20 kinds
COLORS = {"error": "#b00020", "warning": "#b36b00", "info": "#2a5db0"}


def check_available() -> None:
    """Refuse ``-o`` before any reading when plotly is not installed."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise UsageError("-o writes an HTML page drawn with plotly, which is not installed: "
                         "pip install 'statekit[report]'") from None


def _hover(t: dict, extra: str = "") -> str:
    shape = "×".join(map(str, t["shape"])) if t["shape"] else "-"
    step = "-" if t["step"] is None else f"{t['step']:g}"
    return f"<b>{html.escape(t['path'])}</b><br>{shape} · {t['family']} · step {step}{extra}"


def _g(x: float) -> str:
    return f"{x:.3g}"


class Depth:
    """Where the page draws each tensor, from the report's own placing (``stack``, ``layer``,
    ``kind``, ``depth``: :mod:`statekit.ops.report.depth`; nothing is read from names here):
    the kinds of the layer pattern as rows, the layer indices as columns, the others apart."""

    def __init__(self, tensors: list[dict]) -> None:
        ordered = sorted(tensors, key=lambda t: t["depth"])
        self.layered = [t for t in ordered if t.get("layer") is not None]
        self.apart = [t for t in ordered if t.get("layer") is None]
        stacks = list(dict.fromkeys(t["stack"] for t in self.layered))
        self.kinds = list(dict.fromkeys((t["stack"], t["kind"]) for t in self.layered))
        self.label = {k: (k[1] or "(the layer's own)") if len(stacks) == 1 else f"{k[0]}: {k[1]}"
                      for k in self.kinds}
        self.layers = sorted({t["layer"] for t in self.layered})
        # the heat map's columns: every index from the first layer to the last (a Sequential's
        # 0, 2, 4 keeps cells of one width), unless the indices are too sparse for it
        span = self.layers[-1] - self.layers[0] + 1 if self.layers else 0
        self.columns = list(range(self.layers[0], self.layers[-1] + 1)) if self.layers \
            and span <= 4 * len(self.layers) else self.layers


def _depth_panel(d: Depth, title: str, value, hover, *, unit: str, colorscale: str = "Viridis",
                 zmid: float | None = None, zrange: tuple | None = None, guide: dict | None = None,
                 special=None) -> dict | None:
    """One quantity along depth: a heat map of kinds × layers, a line per kind along the layers,
    and the tensors off the layer pattern apart (right). ``value(t)``: the number or None;
    ``hover(t)``: the line under the tensor's name; ``special(t)``: a value to draw at the floor
    with its own word (a ratio against 0), or None; ``guide``: ``{"band": (lo, hi)}`` or
    ``{"line": y}`` drawn on the lines and the apart points."""
    vals = {id(t): value(t) for t in d.layered + d.apart}
    flagged = {id(t) for t in d.layered + d.apart if special is not None and special(t)}
    finite = [v for v in vals.values() if v is not None and math.isfinite(v)]
    if not finite and not flagged:
        return None
    floor = (min(finite) if finite else 0.0) - 1.0

    def y_of(t):
        return floor if id(t) in flagged else vals[id(t)]

    def text_of(t):
        word = special(t) if id(t) in flagged else None
        v = vals[id(t)]
        return _hover(t, f"<br>{word or hover(t)}") if (v is not None or word) else None

    data = []
    has_layers = any(y_of(t) is not None for t in d.layered)
    kinds = [k for k in d.kinds if any(y_of(t) is not None for t in d.layered if (t["stack"], t["kind"]) == k)]
    heat_h = max(150, 18 * len(kinds) + 30) if has_layers else 0
    lines_h = 230 if has_layers else 0
    apart_only = not has_layers
    if has_layers:
        col = {layer: i for i, layer in enumerate(d.columns)}
        row = {k: i for i, k in enumerate(kinds)}
        z = [[None] * len(d.columns) for _ in kinds]
        text = [[""] * len(d.columns) for _ in kinds]
        series: dict[tuple, list] = {k: [] for k in kinds}
        for t in d.layered:
            y = y_of(t)
            if y is None:
                continue
            k = (t["stack"], t["kind"])
            z[row[k]][col[t["layer"]]] = y
            text[row[k]][col[t["layer"]]] = text_of(t)
            series[k].append(t)
        heat = {"type": "heatmap", "x": d.columns, "y": [d.label[k] for k in kinds], "z": z, "text": text,
                "hovertemplate": "%{text}<extra></extra>", "colorscale": colorscale, "xgap": 1, "ygap": 1,
                "xaxis": "x", "yaxis": "y", "hoverongaps": False,
                "colorbar": {"title": {"text": unit, "side": "right"}, "x": 0.755, "xanchor": "left",
                             "thickness": 12, "len": heat_h / (heat_h + 55 + lines_h), "y": 1.0, "yanchor": "top"}}
        if zmid is not None:
            heat["zmid"] = zmid
        if zrange is not None:
            heat["zmin"], heat["zmax"] = zrange
        data.append(heat)
        for k in kinds:
            pts = series[k]
            if pts:
                data.append({"type": "scatter", "mode": "lines+markers", "x": [t["layer"] for t in pts],
                             "y": [y_of(t) for t in pts], "text": [text_of(t) for t in pts], "name": d.label[k],
                             "hovertemplate": "%{text}<extra></extra>", "xaxis": "x2", "yaxis": "y2",
                             "marker": {"size": 5, "symbol": ["x" if id(t) in flagged else "circle" for t in pts]},
                             "line": {"width": 1.3}})
    apart = [t for t in d.apart if y_of(t) is not None]
    if apart and not apart_only:
        data.append({"type": "scatter", "mode": "markers", "x": [y_of(t) for t in apart],
                     "y": [html.escape(t["path"]) for t in apart], "text": [text_of(t) for t in apart],
                     "hovertemplate": "%{text}<extra></extra>", "xaxis": "x3", "yaxis": "y3", "showlegend": False,
                     "marker": {"size": 8, "color": "#34495e",
                                "symbol": ["x" if id(t) in flagged else "diamond" for t in apart]}})
    elif apart_only:
        data.append({"type": "scatter", "mode": "markers", "x": [t["depth"] for t in apart],
                     "y": [y_of(t) for t in apart], "text": [text_of(t) for t in apart], "showlegend": False,
                     "hovertemplate": "%{text}<extra></extra>", "marker": {"size": 6, "color": "#34495e"}})
    return _depth_layout(d, title, unit, data, heat_h, lines_h, apart if not apart_only else [], guide, apart_only)


def _depth_layout(d: Depth, title: str, unit: str, data: list, heat_h: int, lines_h: int, apart: list,
                  guide: dict | None, apart_only: bool) -> dict:
    top, bottom, gap = 40, 45, 55
    shapes = []
    if apart_only:  # no tensor on the layer pattern: one chart along depth, hover names each tensor
        plot = 300
        layout = {"xaxis": {"title": {"text": "tensor, along depth (hover names it)"}, "zeroline": False},
                  "yaxis": {"title": {"text": unit}, "automargin": True}}
        if guide:
            shapes.append(_guide(guide, "paper", "y", (0, 1)))
    else:
        plot = heat_h + gap + lines_h
        heat_dom = [(lines_h + gap) / plot, 1.0]
        lines_dom = [0.0, lines_h / plot]
        span = [d.layers[0] - 0.5, d.layers[-1] + 0.5]
        layout = {
            "xaxis": {"domain": [0, 0.74], "anchor": "y", "showticklabels": True, "dtick": 1 if len(d.columns) <= 40
                      else None, "tickfont": {"size": 10}, "zeroline": False, "range": span},
            "yaxis": {"domain": heat_dom, "anchor": "x", "autorange": "reversed", "automargin": True,
                      "tickfont": {"size": 11}, "type": "category"},
            "xaxis2": {"domain": [0, 0.74], "anchor": "y2", "matches": "x", "title": {"text": "layer"},
                       "zeroline": False, "dtick": 1 if len(d.columns) <= 40 else None, "tickfont": {"size": 10}},
            "yaxis2": {"domain": lines_dom, "anchor": "x2", "title": {"text": unit}, "automargin": True},
            "legend": {"x": 0.86, "xanchor": "left", "y": lines_h / plot, "yanchor": "top", "font": {"size": 10},
                       "title": {"text": "per kind (click: hide)"}},
        }
        if apart:
            layout["xaxis3"] = {"domain": [0.86, 1.0], "anchor": "y3", "title": {"text": unit, "font": {"size": 11}},
                                "zeroline": False, "nticks": 4}
            layout["yaxis3"] = {"domain": heat_dom, "anchor": "x3", "side": "right", "automargin": True,
                                "type": "category", "autorange": "reversed", "tickfont": {"size": 10}}
            layout["annotations"] = [{"text": "off the layer pattern", "xref": "x3 domain", "yref": "y3 domain",
                                      "x": 0.5, "y": 1.0, "yanchor": "bottom", "showarrow": False,
                                      "font": {"size": 11, "color": "#555"}}]
        if guide:
            shapes.append(_guide(guide, "x2 domain", "y2", None))
            if apart:
                shapes.append(_guide(guide, "x3", "y3 domain", None, across=True))
    layout.update({"title": {"text": title, "x": 0, "font": {"size": 15}}, "height": plot + top + bottom,
                   "margin": {"l": 70, "r": 20, "t": top, "b": bottom}, "hovermode": "closest",
                   "plot_bgcolor": "#fbfbfb", "shapes": shapes, "colorway": COLORWAY})
    return {"data": data, "layout": layout}


def _guide(guide: dict, xref: str, yref: str, span, across: bool = False) -> dict:
    """The reference band or line of a quantity (``across``: on an axis of values drawn across)."""
    style = {"band": {"fillcolor": "#2ecc71", "opacity": 0.15, "line": {"width": 0}},
             "line": {"line": {"dash": "dash", "color": "#555"}}}
    lo, hi = guide.get("band", (guide.get("line"), guide.get("line")))
    kind = "rect" if "band" in guide else "line"
    if across:
        return {"type": kind, "xref": xref, "yref": yref, "x0": lo, "x1": hi, "y0": 0, "y1": 1, **style[
            "band" if kind == "rect" else "line"]}
    x0, x1 = span if span else (0, 1)
    return {"type": kind, "xref": xref, "yref": yref, "x0": x0, "x1": x1, "y0": lo, "y1": hi,
            **style["band" if kind == "rect" else "line"]}


def _log10(x) -> float | None:
    return math.log10(x) if x is not None and x > 0 and math.isfinite(x) else None


def _eff(d: Depth) -> dict | None:
    def value(t):
        e = t["eff_lr_log10"]
        return e["p50"] if e and e["p50"] is not None else None

    def hover(t):
        e = t["eff_lr_log10"]
        return "p5 {} · p50 {} · p95 {}".format(*(_g(e[k]) if e[k] is not None else "-" for k in ("p5", "p50", "p95")))

    return _depth_panel(d, "Effective step size: log10(lr / (√v̂ + ε)), the median coordinate (hover: p5, p95)",
                        value, hover, unit="log10 step")


def _eps(d: Depth) -> dict | None:
    return _depth_panel(d, "ε-domination: share of coordinates with √v̂ < ε",
                        lambda t: None if t["eps_fraction"] is None else 100 * t["eps_fraction"],
                        lambda t: f"{100 * t['eps_fraction']:.3g}% with √v̂ < ε", unit="% of coords",
                        colorscale=[[0, "#f3eff7"], [1, "#5b2a86"]], zrange=(0, 100))


def _update(d: Depth) -> dict | None:
    return _depth_panel(d, "Update RMS, RMS(u), against the 0.2–0.3 band", lambda t: t["update_rms"],
                        lambda t: f"RMS(u) {_g(t['update_rms'])}", unit="RMS(u)", guide={"band": BAND})


def _ratio(d: Depth) -> dict | None:
    return _depth_panel(d, "Update:weight ratio log10(lr·RMS(u + wd·w) / RMS(w)); the dashed line is 1e-3",
                        lambda t: _log10(t["update_weight_ratio"]),
                        lambda t: f"update:weight {_g(t['update_weight_ratio'])}", unit="log10 ratio",
                        guide={"line": KARPATHY})


def _hist(d: Depth) -> dict | None:
    rows = [t for t in d.layered + d.apart if t["v_hat_sqrt_log10_hist"] and t["v_hat_sqrt_log10_hist"]["counts"]]
    if not rows:
        return None
    rows.sort(key=lambda t: t["depth"])
    width = rows[0]["v_hat_sqrt_log10_hist"]["width"]
    lo = min(round(t["v_hat_sqrt_log10_hist"]["lo"] / width) for t in rows)
    hi = max(round(t["v_hat_sqrt_log10_hist"]["lo"] / width) + len(t["v_hat_sqrt_log10_hist"]["counts"])
             for t in rows)
    z = []
    for t in rows:
        h = t["v_hat_sqrt_log10_hist"]
        total = sum(h["counts"]) or 1
        row = [None] * (hi - lo)
        at = round(h["lo"] / width) - lo
        for i, c in enumerate(h["counts"]):
            row[at + i] = c / total if c else None
        z.append(row)
    centers = [(lo + i + 0.5) * width for i in range(hi - lo)]
    # rows along depth; a tensor off the layer pattern gets a band APART rows tall, so that its name
    # has room beside the layers' names
    ys, ticks, labels, seen, at = [], [], [], set(), 0
    every = max(1, math.ceil(len(d.layers) / 40))
    for i, t in enumerate(rows):
        alone = t["layer"] is None or (i and rows[i - 1]["layer"] is None)
        at += (APART if alone else 1) if i else 0
        ys.append(at)
        if t["layer"] is None:
            ticks.append(at)
            labels.append(html.escape(t["path"]))
        elif (t["stack"], t["layer"]) not in seen:
            seen.add((t["stack"], t["layer"]))
            if d.layers.index(t["layer"]) % every == 0:
                ticks.append(at)
                labels.append(html.escape(f"{t['stack']}.{t['layer']}" if t["stack"] else str(t["layer"])))
    trace = {"type": "heatmap", "x": centers, "y": ys, "z": z, "colorscale": "Viridis",
             "text": [[name if c is not None else "" for c in row] for name, row in
                      zip((f"<b>{html.escape(t['path'])}</b>" for t in rows), z, strict=True)], "hoverongaps": False,
             "hovertemplate": "%{text}<br>log10 √v̂ ≈ %{x:.2f}: %{z:.3p} of coordinates<extra></extra>",
             "colorbar": {"title": {"text": "share"}}}
    layout = {"title": {"text": "Distribution of log10 √v̂ per tensor, along depth (zeros left out)", "x": 0,
                        "font": {"size": 15}},
              "height": max(360, min(1100, 3 * (ys[-1] + 1) + 120)), "margin": {"l": 70, "r": 20, "t": 40, "b": 50},
              "hovermode": "closest", "plot_bgcolor": "#fbfbfb",
              "xaxis": {"title": {"text": "log10 √v̂"}},
              "yaxis": {"autorange": "reversed", "tickmode": "array", "tickvals": ticks, "ticktext": labels,
                        "automargin": True, "tickfont": {"size": 10}, "zeroline": False}}
    return {"data": [trace], "layout": layout}


def _resets(d: Depth, common) -> dict | None:
    if common is None:
        return None

    def zeros(t):
        return f"zeros: m {_pct(t['m_zero_fraction'])}, v {_pct(t['v_zero_fraction'])}"

    return _depth_panel(d, "Resets: each tensor's step against the most common step",
                        lambda t: None if t["step"] is None else t["step"] - common,
                        lambda t: f"step {t['step']:g} (most at {common:g}) · {zeros(t)}", unit="step − common",
                        colorscale="RdBu", zmid=0)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _zeros(d: Depth) -> dict | None:
    return _depth_panel(d, "Exact zeros in v (a reset or never-written state; hover: m too)",
                        lambda t: None if t["v_zero_fraction"] is None else 100 * t["v_zero_fraction"],
                        lambda t: f"zeros: v {_pct(t['v_zero_fraction'])}, m {_pct(t['m_zero_fraction'])}",
                        unit="% zeros in v", colorscale="Reds", zrange=(0, 100))


def _profile(key: str, name: str):
    def panel(d: Depth) -> dict | None:
        return _depth_panel(d, f"Depth profile: log10 {name}", lambda t: _log10(t[key]),
                            lambda t: f"{name} {_g(t[key])}", unit=f"log10 {name}")
    return panel


def _family(d: Depth) -> list[tuple[str, dict]]:
    out = []
    ts = d.layered + d.apart

    def view(t, *keys):
        x = t.get("family_view") or {}
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        return x

    for part in ("row", "col"):
        fig = _depth_panel(d, f"Adafactor {part} factor: log10 max/min", lambda t, p=part: view(t, "factors", p,
                                                                                                "spread_log10"),
                           lambda t, p=part: f"{p} factor spread {_g(view(t, 'factors', p, 'spread_log10'))} decades",
                           unit="decades")
        if fig:
            out.append((f"family-{part}", fig))
    slots = sorted({s for t in ts for s in (view(t, "quantization") or {})})
    for slot in slots:
        fig = _depth_panel(d, f"8-bit {html.escape(slot)}: share of codes at their block's absmax",
                           lambda t, s=slot: None if view(t, "quantization", s, "saturation") is None else
                           100 * view(t, "quantization", s, "saturation"),
                           lambda t, s=slot: f"{100 * view(t, 'quantization', s, 'saturation'):.3g}% saturated · "
                                             f"absmax max {_g(view(t, 'quantization', s, 'absmax_max') or 0)}",
                           unit="% saturated")
        if fig:
            out.append((f"family-8bit-{slot}", fig))
    fig = _depth_panel(d, "Momentum buffer: log10 RMS", lambda t: _log10(t["m_rms"]) if view(t, "buffer") else None,
                       lambda t: f"buffer RMS {_g(t['m_rms'])}", unit="log10 RMS")
    if fig:
        out.append(("family-buffer", fig))
    return out


def _short_name(path: str, most: int = 40) -> str:
    """A file's name for a panel's title: its last two parts, at most ``most`` characters (a title
    that holds the whole path is cut off by the panel where the checkout's path is long)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    name = "/".join(parts[-2:]) or path
    return name if len(name) <= most else "…" + name[-(most - 1):]


def _compare(r: dict, d: Depth) -> list[tuple[str, dict]]:
    rows = {c["path"]: c for c in r["compare"]}
    if not rows:
        return []

    def c(t, key):
        row = rows.get(t["path"])
        x = None if row is None else row[key]
        return float(x) if isinstance(x, str) else x  # the JSON's "-inf": v fell to 0

    against = html.escape(_short_name(str(r["against"])))
    out = []
    for key, name, title, scale, unit in (
            ("v_rms_log2_ratio", "log2 RMS(v̂) now/then", f"Against {against}: log2 RMS(v̂) now / then",
             "RdBu", "log2 now/then"),
            ("m_cosine", "cos(m then, m now)", f"Against {against}: cosine of m then and now", "RdBu", "cos m"),
            ("step_delta", "Δ step", f"Against {against}: step now − step then", "RdBu", "Δ step")):
        fig = _depth_panel(d, title, lambda t, k=key: (c(t, k) if c(t, k) is not None and math.isfinite(c(t, k))
                                                       else None),
                           lambda t, k=key, n=name: f"{n} {_g(c(t, k))}", unit=unit, colorscale=scale,
                           zmid=0 if key != "m_cosine" else None, zrange=(-1, 1) if key == "m_cosine" else None,
                           special=(lambda t, k=key: "v fell to 0" if c(t, k) == -math.inf else None)
                           if key == "v_rms_log2_ratio" else None)
        if fig:
            out.append((f"compare-{key.split('_')[0]}", fig))
    return out


PANELS = (
    ("eff", "Effective step size", _eff),
    ("eps", "ε-domination", _eps),
    ("update", "Update RMS", _update),
    ("ratio", "Update:weight ratio", _ratio),
    ("hist", "Distribution of √v̂", _hist),
    ("resets", "Resets", None),
    ("zeros", "Zeros in v", _zeros),
    ("profile-m", "Depth profile: RMS(m)", _profile("m_rms", "RMS(m)")),
    ("profile-v", "Depth profile: √mean(v)", _profile("v_sqrt_mean", "√mean(v)")),
    ("profile-w", "Depth profile: RMS(w)", _profile("w_rms", "RMS(w)")),
    ("family", "Family views", None),
    ("compare", "Comparison", None),
)

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin: 1.6em 0 .3em; }
.meta { color: #555; font-size: .9em; overflow-wrap: anywhere; } table { border-collapse: collapse; font-size: .9em; width: 100%; }
td, th { text-align: left; padding: .25em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
.sev { font-weight: 600; } .panel { border: 1px solid #e3e3e3; border-radius: 6px; padding: .4em; margin: .8em 0; }
code { background: #f3f3f3; padding: 0 .25em; }
"""


def _lr(r: dict) -> dict | None:
    """The learning rate per group along the schedule, the saved position marked."""
    s = r.get("schedule")
    if not s or not s["x"]:
        return None
    unit = s["unit"]
    data = [{"type": "scatter", "mode": "lines", "name": f"group {g}", "x": s["x"], "y": ys,
             "hovertemplate": f"group {g}<br>{unit} %{{x}}: lr %{{y:.6g}}<extra></extra>"}
            for g, ys in enumerate(s["lrs"])]
    pos = s["position"]
    if s["lr_now"]:
        data.append({"type": "scatter", "mode": "markers", "name": "saved: lr now (the next update)",
                     "x": [pos] * len(s["lr_now"]), "y": s["lr_now"], "marker": {"size": 10, "symbol": "diamond"},
                     "hovertemplate": f"saved at {pos:g} {unit}<br>lr now %{{y:.6g}}<extra></extra>"})
    if s["lr_next"]:
        data.append({"type": "scatter", "mode": "markers", "name": "lr next (the update after)",
                     "x": [pos + 1] * len(s["lr_next"]), "y": s["lr_next"], "marker": {"size": 8, "symbol": "circle-open"},
                     "hovertemplate": f"{unit} {pos + 1:g}<br>lr next %{{y:.6g}}<extra></extra>"})
    left = f", {s['steps_left']:g} {unit} left" if s["steps_left"] is not None else ""
    layout = {"title": {"text": html.escape(f"Learning rate per group: {s['kind']}, saved at {pos:g} {unit}{left}"),
                        "x": 0, "font": {"size": 15}},
              "height": 380, "margin": {"l": 70, "r": 20, "t": 40, "b": 45}, "hovermode": "closest",
              "plot_bgcolor": "#fbfbfb", "colorway": COLORWAY,
              "xaxis": {"title": {"text": unit}, "zeroline": False},
              "yaxis": {"title": {"text": "lr"}, "automargin": True, "exponentformat": "e"},
              "legend": {"font": {"size": 10}},
              "shapes": [{"type": "line", "xref": "x", "yref": "paper", "x0": pos, "x1": pos, "y0": 0, "y1": 1,
                          "line": {"dash": "dash", "width": 1, "color": "#555"}}]}
    return {"data": data, "layout": layout}


def _findings_html(r: dict) -> str:
    if not r["findings"]:
        return "<p id='findings-none'>No findings: no NaN/Inf, resets, ε-dominated tensors or outliers.</p>"
    rows = "".join(
        f"<tr class='finding {f['severity']}'><td class='sev' style='color:{COLORS[f['severity']]}'>{f['severity']}"
        f"</td><td>{html.escape(f['check'])}</td><td><code>{html.escape(f['path'])}</code></td>"
        f"<td>{html.escape(f['message'])}</td></tr>" for f in r["findings"])
    return ("<table id='findings'><thead><tr><th>severity</th><th>check</th><th>tensor</th><th>message</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>")


def _meta_html(r: dict) -> str:
    parts = [f"{html.escape(r['format'])} · {html.escape(str(r['family']))} · {len(r['tensors'])} tensors"]
    if r["common_step"] is not None:
        parts.append(f"most at step {r['common_step']:g}")
    hp = "".join(f"<li>{html.escape(h['family'])} ({h['tensors']} tensors): "
                 f"{html.escape(', '.join(f'{k}={v}' for k, v in h['values'].items()))}"
                 f"{' — assumed (the defaults): ' + html.escape(', '.join(h['assumed'])) if h['assumed'] else ''}</li>" for h in r["hyperparameters"])
    if r.get("against"):
        parts.append(f"compared against {html.escape(str(r['against']))}")
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in r["notes"])
    sched = (f"<p class='meta' id='schedule'>LR schedule: {html.escape(schedule_line(r['schedule']))}</p>"
             if r.get("schedule") else "")
    return (f"<p class='meta'>{' · '.join(parts)}</p>{sched}<ul class='meta'>{hp}{notes}</ul>")


def figures(r: dict) -> list[tuple[str, dict]]:
    """(panel id, plotly figure as a dict) for every panel the report has data for."""
    d = Depth(r["tensors"])
    out = []
    for key, _, fn in PANELS:
        if key == "resets":
            fig = _resets(d, r["common_step"])
        elif key == "family":
            out += _family(d)
            continue
        elif key == "compare":
            out += _compare(r, d)
            continue
        else:
            fig = fn(d)
        if fig is not None:
            out.append((key, fig))
    lr = _lr(r)
    if lr is not None:
        out.insert(0, ("lr", lr))
    return out


def page(result) -> str:
    """The whole page's text."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    r = result.to_json() if hasattr(result, "to_json") else result
    panels, figs = [], figures(r)
    for key, fig in figs:
        div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"panel-{key}", config=CONFIG,
                          validate=False, default_width="100%", default_height=f"{fig['layout']['height']}px")
        panels.append(f"<section class='panel' data-panel='{key}'>{div}</section>")
    title = f"statekit report: {html.escape(str(r['state']))}"
    data = html.escape(json.dumps({"panels": [k for k, _ in figs]}), quote=True)
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{title}</title>"
            f"<style>{STYLE}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body data-report='{data}'><h1>{title}</h1>{_meta_html(r)}<h2>Findings</h2>{_findings_html(r)}"
            f"<h2>Panels</h2>{''.join(panels)}"
            "<p class='meta'>Formulas per optimizer family: statekit's docs/report.md.</p></body></html>")


def write_page(result, path: str) -> int:
    """Write the page atomically; its size in bytes."""
    from statekit.atomic import atomic_write

    data = page(result).encode("utf-8")
    with atomic_write(path) as fh:
        fh.write(data)
    return len(data)
