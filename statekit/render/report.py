"""``report`` in the terminal: findings, then compact per-layer charts that fit the width; and TSV.

Every line is drawn here to at most the width (80 columns included), in plain characters: a
range bar per row on one shared axis (``├──┼──┤``: p5, p50, p95 of the effective step size), the
share of ε-dominated coordinates, RMS(u) against the 0.2–0.3 band, zero shares and steps, and a
sparkline of each row's ``log10 √v̂`` distribution.
"""

from __future__ import annotations

import math
import textwrap

from statekit.render.inspect import PlainLines

MAX_ROWS = 40  # more tensors than this are shown a layer at a time
SPARK = " ▁▂▃▄▅▆▇█"
MIN_WIDTH = 40


def _fmt(x: float | None, spec: str = ".2g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, the middle elided."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _layer(t: dict) -> str:
    """The layer a tensor belongs to, as the report placed it (``model.layers.3``), else its module."""
    if t.get("layer") is not None:
        return f"{t['stack']}.{t['layer']}" if t["stack"] else str(t["layer"])
    return t["path"].rpartition(".")[0] or t["path"]


def _mean(items: list[tuple[float | None, int]]) -> float | None:
    pairs = [(x, n) for x, n in items if x is not None]
    total = sum(n for _, n in pairs)
    return sum(x * n for x, n in pairs) / total if total else None


def _rows(tensors: list[dict]) -> tuple[list[dict], bool]:
    """One row per tensor along depth, or per layer when there are more than :data:`MAX_ROWS` tensors."""
    tensors = sorted(tensors, key=lambda t: t.get("depth", 0))
    if len(tensors) <= MAX_ROWS:
        return tensors, False
    groups: dict[str, list[dict]] = {}
    for t in tensors:
        groups.setdefault(_layer(t), []).append(t)
    rows = []
    for name, members in groups.items():
        effs = [t["eff_lr_log10"] for t in members if t["eff_lr_log10"] and t["eff_lr_log10"]["p50"] is not None]
        mids = sorted(e["p50"] for e in effs)
        eff = {"p5": min((e["p5"] for e in effs if e["p5"] is not None), default=None),
               "p50": mids[len(mids) // 2] if mids else None,
               "p95": max((e["p95"] for e in effs if e["p95"] is not None), default=None)} if effs else None
        sq = _mean([(t["update_rms"] ** 2 if t["update_rms"] is not None else None, t["numel"]) for t in members])
        steps = {t["step"] for t in members}
        rows.append({"path": f"{name} ({len(members)})", "eff_lr_log10": eff,
                     "eps_fraction": _mean([(t["eps_fraction"], t["numel"]) for t in members]),
                     "update_rms": math.sqrt(sq) if sq is not None else None,
                     "m_zero_fraction": _mean([(t["m_zero_fraction"], t["numel"]) for t in members]),
                     "v_zero_fraction": _mean([(t["v_zero_fraction"], t["numel"]) for t in members]),
                     "step": steps.pop() if len(steps) == 1 else None,
                     "update_weight_ratio": math.sqrt(r2) if (r2 := _mean([(t["update_weight_ratio"] ** 2 if t[
                         "update_weight_ratio"] is not None else None, t["numel"]) for t in members])) else None,
                     "v_hat_sqrt_log10_hist": _merged([t["v_hat_sqrt_log10_hist"] for t in members])})
    return rows, True


def _merged(hists: list[dict | None]) -> dict | None:
    hists = [h for h in hists if h and h["counts"]]
    if not hists:
        return None
    width = hists[0]["width"]
    lo = min(round(h["lo"] / width) for h in hists)
    hi = max(round(h["lo"] / width) + len(h["counts"]) for h in hists)
    counts = [0] * (hi - lo)
    for h in hists:
        at = round(h["lo"] / width) - lo
        for i, c in enumerate(h["counts"]):
            counts[at + i] += c
    return {"lo": lo * width, "width": width, "counts": counts, "zeros": 0}


def _bar(eff: dict | None, lo: float, hi: float, width: int) -> str:
    """p5 ├──┼──┤ p95 on the axis [lo, hi] in ``width`` cells."""
    cells = ["·"] * width
    if not eff or eff.get("p50") is None or width < 3:
        return "".join(cells) if width else ""

    def at(x: float) -> int:
        if hi <= lo:
            return width // 2
        return min(width - 1, max(0, round((x - lo) / (hi - lo) * (width - 1))))

    a, b, c = at(eff["p5"]), at(eff["p50"]), at(eff["p95"])
    a, c = min(a, c), max(a, c)
    for i in range(a, c + 1):
        cells[i] = "─"
    cells[a], cells[c] = "├", "┤"
    cells[b] = "┼"
    return "".join(cells)


def _spark(hist: dict | None, lo: float, hi: float, width: int) -> str:
    """A row's ``log10 √v̂`` counts on the shared axis [lo, hi] as block characters."""
    if not hist or not hist["counts"] or width < 1 or hi <= lo:
        return " " * width
    cells = [0.0] * width
    for i, c in enumerate(hist["counts"]):
        x = hist["lo"] + (i + 0.5) * hist["width"]
        k = min(width - 1, max(0, int((x - lo) / (hi - lo) * width)))
        cells[k] += c
    top = max(cells) or 1.0
    return "".join(SPARK[0] if c == 0 else SPARK[max(1, round(c / top * (len(SPARK) - 1)))] for c in cells)


def _axis(rows: list[dict]) -> tuple[float, float] | None:
    xs = [x for r in rows if r.get("eff_lr_log10") for x in r["eff_lr_log10"].values() if x is not None]
    if not xs:
        return None
    lo, hi = math.floor(min(xs) * 2) / 2, math.ceil(max(xs) * 2) / 2
    return (lo - 0.5, hi + 0.5) if hi - lo < 0.5 else (lo, hi)


def _hist_axis(rows: list[dict]) -> tuple[float, float] | None:
    spans = [(r["v_hat_sqrt_log10_hist"]["lo"], r["v_hat_sqrt_log10_hist"]["lo"]
              + len(r["v_hat_sqrt_log10_hist"]["counts"]) * r["v_hat_sqrt_log10_hist"]["width"])
             for r in rows if r.get("v_hat_sqrt_log10_hist") and r["v_hat_sqrt_log10_hist"]["counts"]]
    if not spans:
        return None
    return math.floor(min(a for a, _ in spans)), math.ceil(max(b for _, b in spans))


def _header(r: dict, width: int) -> list[str]:
    steps = f" · most at step {r['common_step']:g}" if r["common_step"] is not None else ""
    head = f"{r['state']}: {r['format']} · {r['family']} · {len(r['tensors'])} tensors{steps}"
    lines = textwrap.wrap(head, width, subsequent_indent="  ", break_on_hyphens=False) or [""]
    for h in r["hyperparameters"][:4]:
        vals = ", ".join(f"{k} {_hp(v)}" for k, v in h["values"].items()
                         if k in ("lr", "betas", "eps", "weight_decay", "momentum", "alpha", "beta2_decay"))
        text = f"{h['family']} ({h['tensors']} tensors): {vals}" + (f" (assumed: {', '.join(h['assumed'])})" if h["assumed"] else "")
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    return lines


def _hp(v) -> str:
    if isinstance(v, list):
        return ",".join(_hp(x) for x in v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _findings(r: dict, width: int) -> list[str]:
    items = r["findings"]
    if not items:
        return ["findings: none"]
    counts = {s: sum(1 for f in items if f["severity"] == s) for s in ("error", "warning", "info")}
    lines = ["findings: " + ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)]
    for f in items:
        text = f"{f['severity']:<7} {f['check']:<12} {f['path']}: {f['message']}"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent=" " * 23,
                               break_on_hyphens=False, break_long_words=True)
    return lines


def _table(r: dict, width: int) -> list[str]:
    rows, grouped = _rows(r["tensors"])
    if not rows:
        return []
    # columns: name │ bar │ ε% │ RMS(u) │ zeros m/v │ step
    ratios = any(x.get("update_weight_ratio") for x in rows)
    fixed = 1 + 1 + 5 + 1 + 6 + 1 + 9 + 1 + 6 + (6 if ratios else 0)  # the spaces and columns beside name and bar
    name_w = max(10, min(max(len(x["path"]) for x in rows), (width - fixed) // 2))
    bar_w = max(8, min(48, width - fixed - name_w))
    axis = _axis(rows)
    lo, hi = axis if axis else (0.0, 1.0)
    title = "per layer" if grouped else "per tensor"
    lines = ["", _cut(f"{title}, along depth: effective step size log10(lr/(√v̂+ε)) p5 ├─┼─┤ p95", width)]
    left, right = f"{lo:g}", f"{hi:g}"
    scale = left + " " * max(1, bar_w - len(left) - len(right)) + right
    extra = f" {'u:w':>5}" if ratios else ""
    lines.append(f"{'':<{name_w}} {scale:<{bar_w}} {'ε%':>5} {'RMS(u)':>6}{extra} {'zero m/v':>9} {'step':>6}"[:width])
    for x in rows:
        zeros = f"{_pct(x.get('m_zero_fraction'))}/{_pct(x.get('v_zero_fraction'))}"
        ratio = x.get("update_weight_ratio")
        extra = f" {_fmt(math.log10(ratio) if ratio else None, '.1f'):>5}" if ratios else ""
        line = (f"{_cut(x['path'], name_w):<{name_w}} {_bar(x.get('eff_lr_log10'), lo, hi, bar_w)} "
                f"{_pct(x.get('eps_fraction')):>5} {_short(x.get('update_rms')):>6}{extra} {zeros:>9} "
                f"{_fmt(x.get('step'), 'g'):>6}")
        lines.append(line[:width])
    legend = "ε%: share of coordinates with √v̂ < ε; RMS(u) settles at 0.2–0.3 for Adam after warm-up"
    if ratios:
        legend += "; u:w: log10 update:weight ratio (Karpathy's line: -3)"
    lines += textwrap.wrap(legend, width, break_on_hyphens=False)
    lines += _sparks(rows, name_w, width)
    return lines


def _sparks(rows: list[dict], name_w: int, width: int) -> list[str]:
    axis = _hist_axis(rows)
    if axis is None:
        return []
    lo, hi = axis
    spark_w = max(8, min(64, width - name_w - 1))
    left, right = f"{lo:g}", f"{hi:g}"
    lines = ["", _cut("distribution of log10 √v̂ (each row scaled to its largest bin)", width),
             (" " * (name_w + 1) + left + " " * max(1, spark_w - len(left) - len(right)) + right)[:width]]
    for x in rows:
        lines.append(f"{_cut(x['path'], name_w):<{name_w}} {_spark(x.get('v_hat_sqrt_log10_hist'), lo, hi, spark_w)}"
                     [:width])
    return lines


def _short(x: float | None) -> str:
    """A number in at most 6 characters."""
    if x is None:
        return "-"
    return f"{x:.2g}" if 0.01 <= abs(x) < 1000 or x == 0 else f"{x:.0e}"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{100 * x:.0f}" if x >= 0.01 else "<1"


def _compare(r: dict, width: int) -> list[str]:
    if not r["compare"]:
        return []
    name_w = max(10, min(max(len(c["path"]) for c in r["compare"]), width - 30))
    lines = ["", _cut(f"against {r['against']}: log2 RMS(v̂) now/then, cosine of m, step change", width),
             f"{'':<{name_w}} {'log2 v̂':>8} {'cos m':>7} {'Δstep':>8}"[:width]]
    depth = {t["path"]: t.get("depth", 0) for t in r["tensors"]}
    for c in sorted(r["compare"], key=lambda c: depth.get(c["path"], 0)):
        ratio = c["v_rms_log2_ratio"]
        ratio = "to 0" if ratio in (-math.inf, "-inf") else _fmt(ratio, "+.2f")  # v fell to 0: no factor
        lines.append(f"{_cut(c['path'], name_w):<{name_w}} {ratio:>8} "
                     f"{_fmt(c['m_cosine'], '.3f'):>7} {_fmt(c['step_delta'], '+g'):>8}"[:width])
    return lines


def _lrs_text(values) -> str:
    if not values:
        return "?"
    return f"{values[0]:.6g}" + (f" (all {len(values)} groups)" if len(set(values)) == 1 and len(values) > 1 else
                            "".join(f", {v:.6g}" for v in values[1:]))


def schedule_line(s: dict) -> str:
    """The schedule in one line: kind, position, lr now / next, steps left (or why no lr is known)."""
    parts = [s["kind"]]
    if s["position"] is not None:
        samples = f" ({s['position'] * s['samples_per_update']:g} samples)" if s.get("samples_per_update") else ""
        parts.append(f"position {s['position']:g} {s['unit']}{samples}")
    parts.append(f"lr now {_lrs_text(s['lr_now'])}")
    if s["lr_next"] is not None:
        parts.append(f"next {_lrs_text(s['lr_next'])}")
    if s["steps_left"] is not None:
        parts.append(f"{s['steps_left']:g} {s['unit']} left")
    if s["why"] and s["lr_next"] is None:
        parts.append(f"lr next not known: {s['why']}")
    return " · ".join(parts)


def report_view(result, width: int | None = None) -> list:
    r = result.to_json() if hasattr(result, "to_json") else result
    width = max(MIN_WIDTH, width or 80)
    lines = _header(r, width) + [""] + _findings(r, width) + _table(r, width) + _compare(r, width)
    if r.get("schedule"):
        lines += textwrap.wrap("lr schedule: " + schedule_line(r["schedule"]), width, subsequent_indent="  ",
                               break_on_hyphens=False)
    for note in r["notes"]:
        lines += textwrap.wrap("note: " + note, width, subsequent_indent="  ", break_on_hyphens=False)
    return [PlainLines("\n".join(lines) + "\n")]


TSV_HEADER = ["path", "family", "step", "numel", "eff_lr_log10_p5", "eff_lr_log10_p50", "eff_lr_log10_p95",
              "eps_fraction", "update_rms", "update_weight_ratio", "m_zero_fraction", "v_zero_fraction", "nonfinite",
              "m_rms", "v_sqrt_mean", "w_rms"]


def report_tsv(result):
    r = result.to_json() if hasattr(result, "to_json") else result
    rows = []
    for t in r["tensors"]:
        eff = t["eff_lr_log10"] or {}
        rows.append([t["path"], t["family"], t["step"], t["numel"], eff.get("p5"), eff.get("p50"), eff.get("p95"),
                     t["eps_fraction"], t["update_rms"], t["update_weight_ratio"], t["m_zero_fraction"],
                     t["v_zero_fraction"], t["nonfinite"], t["m_rms"], t["v_sqrt_mean"], t["w_rms"]])
    return TSV_HEADER, rows
