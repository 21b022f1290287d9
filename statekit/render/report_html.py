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

CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}
BAND = (0.2, 0.3)  # the update RMS Adam settles at after warm-up
KARPATHY = -3.0  # log10 of the update:weight ratio "should be ~1e-3"
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
    return f"{html.escape(t['path'])}<br>{shape} · {t['family']} · step {t['step']}{extra}"


def _layout(title: str, ytitle: str, height: int = 360, **more) -> dict:
    out = {"title": {"text": title, "x": 0, "font": {"size": 15}}, "height": height,
           "margin": {"l": 70, "r": 20, "t": 40, "b": 50}, "hovermode": "closest",
           "xaxis": {"title": {"text": "tensor, along depth"}, "zeroline": False},
           "yaxis": {"title": {"text": ytitle}}, "legend": {"orientation": "h", "y": -0.2},
           "plot_bgcolor": "#fbfbfb"}
    out.update(more)
    return out


def _ticks(tensors: list[dict]) -> dict:
    """The x axis: tensors by name when they are few, by position along depth otherwise."""
    axis = {"title": {"text": "tensor, along depth"}, "zeroline": False}
    if len(tensors) <= 40:
        axis.update(tickmode="array", tickvals=[t["depth"] for t in tensors],
                    ticktext=[html.escape(t["path"]) for t in tensors], tickangle=-35, title={"text": ""})
    return axis


def _xs(tensors: list[dict]) -> list[int]:
    return [t["depth"] for t in tensors]


def _eff(ts: list[dict]) -> dict | None:
    rows = [t for t in ts if t["eff_lr_log10"] and t["eff_lr_log10"]["p50"] is not None]
    if not rows:
        return None
    mid = [t["eff_lr_log10"]["p50"] for t in rows]
    up = [(t["eff_lr_log10"]["p95"] or m) - m for t, m in zip(rows, mid, strict=True)]
    down = [m - (t["eff_lr_log10"]["p5"] or m) for t, m in zip(rows, mid, strict=True)]
    text = [_hover(t, "<br>p5 {p5:.3g} · p50 {p50:.3g} · p95 {p95:.3g}".format(**t["eff_lr_log10"])) for t in rows]
    trace = {"type": "scatter", "mode": "markers", "x": _xs(rows), "y": mid, "text": text, "hoverinfo": "text",
             "error_y": {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "thickness": 1},
             "marker": {"size": 6}, "name": "p50 (bars: p5–p95)"}
    return {"data": [trace], "layout": _layout("Effective step size: log10(lr / (√v̂ + ε)), p5–p50–p95",
                                               "log10 step size")}


def _eps(ts: list[dict]) -> dict | None:
    rows = [t for t in ts if t["eps_fraction"] is not None]
    if not rows:
        return None
    trace = {"type": "bar", "x": _xs(rows), "y": [100 * t["eps_fraction"] for t in rows],
             "text": [_hover(t, f"<br>{100 * t['eps_fraction']:.3g}% with √v̂ < ε") for t in rows],
             "hoverinfo": "text", "textposition": "none", "marker": {"color": "#8e44ad"}}
    return {"data": [trace], "layout": _layout("ε-domination: share of coordinates with √v̂ < ε", "% of coordinates",
                                               yaxis={"title": {"text": "% of coordinates"}, "range": [0, 100]})}


def _update(ts: list[dict]) -> dict | None:
    rows = [t for t in ts if t["update_rms"] is not None]
    if not rows:
        return None
    trace = {"type": "scatter", "mode": "markers", "x": _xs(rows), "y": [t["update_rms"] for t in rows],
             "text": [_hover(t, f"<br>RMS(u) {t['update_rms']:.3g}") for t in rows], "hoverinfo": "text",
             "marker": {"size": 6, "color": "#16a085"}, "name": "RMS(u)"}
    band = {"type": "rect", "xref": "paper", "x0": 0, "x1": 1, "y0": BAND[0], "y1": BAND[1],
            "fillcolor": "#2ecc71", "opacity": 0.15, "line": {"width": 0}}
    return {"data": [trace], "layout": _layout("Update RMS, RMS(u), against the 0.2–0.3 band", "RMS(u)",
                                               shapes=[band])}


def _ratio(ts: list[dict]) -> dict | None:
    rows = [t for t in ts if t["update_weight_ratio"]]
    if not rows:
        return None
    trace = {"type": "scatter", "mode": "markers", "x": _xs(rows),
             "y": [math.log10(t["update_weight_ratio"]) for t in rows],
             "text": [_hover(t, f"<br>update:weight {t['update_weight_ratio']:.3g}") for t in rows],
             "hoverinfo": "text", "marker": {"size": 6, "color": "#d35400"}, "name": "log10 ratio"}
    line = {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": KARPATHY, "y1": KARPATHY,
            "line": {"dash": "dash", "color": "#555"}}
    return {"data": [trace], "layout": _layout("Update:weight ratio log10(lr·RMS(u + wd·w) / RMS(w)); "
                                               "the dashed line is 1e-3", "log10 ratio", shapes=[line])}


def _hist(ts: list[dict]) -> dict | None:
    rows = [t for t in ts if t["v_hat_sqrt_log10_hist"] and t["v_hat_sqrt_log10_hist"]["counts"]]
    if not rows:
        return None
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
    trace = {"type": "heatmap", "x": centers, "y": _xs(rows), "z": z, "colorscale": "Viridis",
             "text": [[html.escape(t["path"])] * (hi - lo) for t in rows],
             "hovertemplate": "%{text}<br>log10 √v̂ ≈ %{x:.2f}: %{z:.3p} of coordinates<extra></extra>",
             "colorbar": {"title": {"text": "share"}}}
    lay = _layout("Distribution of log10 √v̂ per tensor (zeros left out)", "tensor, along depth",
                  height=max(360, min(900, 14 * len(rows) + 120)))
    lay["xaxis"] = {"title": {"text": "log10 √v̂"}}
    lay["yaxis"] = {"title": {"text": "tensor, along depth"}, "autorange": "reversed"}
    if len(rows) <= 40:
        lay["yaxis"].update(tickmode="array", tickvals=_xs(rows), ticktext=[html.escape(t["path"]) for t in rows],
                            title={"text": ""})
        lay["margin"] = {**lay["margin"], "l": 130}
    return {"data": [trace], "layout": lay}


def _resets(ts: list[dict], common) -> dict | None:
    data = []
    for key, name, color in (("m_zero_fraction", "zeros in m", "#c0392b"), ("v_zero_fraction", "zeros in v", "#e67e22")):
        rows = [t for t in ts if t[key] is not None]
        if rows:
            data.append({"type": "bar", "x": _xs(rows), "y": [100 * t[key] for t in rows], "name": name,
                         "text": [_hover(t, f"<br>{name}: {100 * t[key]:.3g}%") for t in rows], "hoverinfo": "text",
                         "textposition": "none", "marker": {"color": color}})
    stepped = [t for t in ts if t["step"] is not None]
    if stepped and common is not None:
        data.append({"type": "scatter", "mode": "markers", "x": _xs(stepped), "yaxis": "y2", "name": "step − common",
                     "y": [t["step"] - common for t in stepped], "marker": {"symbol": "diamond", "color": "#34495e"},
                     "text": [_hover(t, f"<br>step {t['step']:g} (common {common:g})") for t in stepped],
                     "hoverinfo": "text"})
    if not data:
        return None
    return {"data": data, "layout": _layout("Resets: exact zeros in m and v, and each step against the most common",
                                            "% zeros", barmode="group",
                                            yaxis2={"title": {"text": "step − common step"}, "overlaying": "y",
                                                    "side": "right", "zeroline": True})}


def _profile(ts: list[dict]) -> dict | None:
    data = []
    for key, name in (("m_rms", "RMS(m)"), ("v_sqrt_mean", "√mean(v)"), ("w_rms", "RMS(w)")):
        rows = [t for t in ts if t[key]]
        if rows:
            data.append({"type": "scatter", "mode": "lines+markers", "x": _xs(rows), "y": [t[key] for t in rows],
                         "name": name, "text": [_hover(t, f"<br>{name} {t[key]:.3g}") for t in rows],
                         "hoverinfo": "text"})
    if not data:
        return None
    return {"data": data, "layout": _layout("Depth profile: RMS(m), √mean(v), RMS(w)", "value (log scale)",
                                            yaxis={"type": "log", "title": {"text": "value (log scale)"}})}


def _family(ts: list[dict]) -> dict | None:
    data = []
    fac = [t for t in ts if t["family_view"] and "factors" in t["family_view"]]
    for part in ("row", "col"):
        rows = [t for t in fac if t["family_view"]["factors"][part]["spread_log10"] is not None]
        if rows:
            data.append({"type": "bar", "x": _xs(rows), "name": f"Adafactor {part} factor: log10 max/min",
                         "y": [t["family_view"]["factors"][part]["spread_log10"] for t in rows],
                         "text": [_hover(t) for t in rows], "hoverinfo": "text+y", "textposition": "none"})
    quant = [(t, slot, q) for t in ts if t["family_view"] and "quantization" in t["family_view"]
             for slot, q in t["family_view"]["quantization"].items()]
    for slot in sorted({s for _, s, _ in quant}):
        rows = [(t, q) for t, s, q in quant if s == slot and q["saturation"] is not None]
        if rows:
            data.append({"type": "bar", "x": [t["depth"] for t, _ in rows], "name": f"8-bit {slot}: % saturated codes",
                         "y": [100 * q["saturation"] for _, q in rows], "textposition": "none",
                         "text": [_hover(t, f"<br>absmax max {q['absmax_max']:.3g}") for t, q in rows],
                         "hoverinfo": "text+y"})
    buf = [t for t in ts if t["family_view"] and "buffer" in t["family_view"] and t["m_rms"]]
    if buf:
        data.append({"type": "scatter", "mode": "markers", "x": _xs(buf), "y": [t["m_rms"] for t in buf],
                     "name": "momentum buffer RMS", "text": [_hover(t) for t in buf], "hoverinfo": "text+y"})
    if not data:
        return None
    return {"data": data, "layout": _layout("Family views: Adafactor factors, 8-bit state, momentum buffers",
                                            "value", barmode="group")}


def _compare(r: dict) -> dict | None:
    rows = r["compare"]
    if not rows:
        return None
    depth = {t["path"]: t["depth"] for t in r["tensors"]}
    data = []
    for key, name, axis in (("v_rms_log2_ratio", "log2 RMS(v̂) now/then", "y"), ("m_cosine", "cosine of m", "y2"),
                            ("step_delta", "step change", "y3")):
        pts = [c for c in rows if c[key] is not None and math.isfinite(c[key])]
        if pts:
            data.append({"type": "bar" if axis == "y" else "scatter", "mode": "markers", "yaxis": axis, "name": name,
                         "x": [depth.get(c["path"], i) for i, c in enumerate(pts)], "y": [c[key] for c in pts],
                         "text": [html.escape(c["path"]) for c in pts], "hoverinfo": "text+y+name",
                         "textposition": "none"} if axis == "y" else
                        {"type": "scatter", "mode": "markers", "yaxis": axis, "name": name,
                         "x": [depth.get(c["path"], i) for i, c in enumerate(pts)], "y": [c[key] for c in pts],
                         "text": [html.escape(c["path"]) for c in pts], "hoverinfo": "text+y+name"})
    if not data:
        return None
    return {"data": data, "layout": _layout(f"Against {html.escape(str(r['against']))}: v̂, m and step per tensor",
                                            "log2 RMS(v̂) now/then", height=420,
                                            xaxis={"title": {"text": "tensor, along depth"}, "domain": [0, 0.86]},
                                            yaxis2={"title": {"text": "cos m"}, "overlaying": "y", "side": "right",
                                                    "range": [-1.05, 1.05]},
                                            yaxis3={"title": {"text": "Δ step"}, "overlaying": "y", "side": "right",
                                                    "anchor": "free", "position": 0.95})}


PANELS = (
    ("eff", "Effective step size", _eff),
    ("eps", "ε-domination", _eps),
    ("update", "Update RMS", _update),
    ("ratio", "Update:weight ratio", _ratio),
    ("hist", "Distribution of √v̂", _hist),
    ("resets", "Resets", None),
    ("profile", "Depth profile", _profile),
    ("family", "Family views", _family),
    ("compare", "Comparison", None),
)

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin: 1.6em 0 .3em; }
.meta { color: #555; font-size: .9em; } table { border-collapse: collapse; font-size: .9em; width: 100%; }
td, th { text-align: left; padding: .25em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
.sev { font-weight: 600; } .panel { border: 1px solid #e3e3e3; border-radius: 6px; padding: .4em; margin: .8em 0; }
code { background: #f3f3f3; padding: 0 .25em; }
"""


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
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in r["notes"])
    return (f"<p class='meta'>{' · '.join(parts)}</p><ul class='meta'>{hp}{notes}</ul>")


def figures(r: dict) -> list[tuple[str, dict]]:
    """(panel id, plotly figure as a dict) for every panel the report has data for."""
    ts = r["tensors"]
    out = []
    for key, _, fn in PANELS:
        if key == "resets":
            fig = _resets(ts, r["common_step"])
        elif key == "compare":
            fig = _compare(r)
        else:
            fig = fn(ts)
        if fig is not None:
            out.append((key, fig))
    return out


def page(result) -> str:
    """The whole page's text."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    r = result.to_json() if hasattr(result, "to_json") else result
    panels, figs = [], figures(r)
    for key, fig in figs:
        if key not in ("hist",) and "xaxis" in fig["layout"] and "domain" not in fig["layout"]["xaxis"]:
            fig["layout"]["xaxis"] = _ticks(r["tensors"])
            fig["layout"]["margin"]["b"] = 110 if len(r["tensors"]) <= 40 else 50
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
