"""Human rendering of ``verify-resume`` reports."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def verify_table(report: dict) -> list:
    verdict = Text("TRACKS", style="bold green") if report["tracks"] else Text("DIVERGES", style="bold red")
    head = Text(f"{report['migrated']} vs {report['original']}: ") + verdict
    fl = report["flavors"]
    kn = report.get("kernels", {})
    kernels = f" ({kn['original']} → {kn['migrated']} kernel)" if kn else ""
    sub = Text(f"{report['optimizer']}, {report['steps']} steps, seed {report['seed']}; arithmetic "
               f"{fl['original']} → {fl['migrated']}{kernels}; criterion {report['criterion']}", style="dim")
    table = Table(header_style="bold", pad_edge=False)
    for col in ("parameter", "state", "layout", "result", "max |Δp|", "Δ / tolerance", "cold Δ / tolerance"):
        table.add_column(col, justify="right" if "Δ" in col else "left")
    for r in report["params"]:
        result = "bit-exact" if r["bit_exact"] else ("within tolerance" if r["tracks"] else "DIVERGES")
        table.add_row(r["path"], "yes" if r["has_state"] else "MISSING", "transposed" if r["transposed"] else "same",
                      result, f"{r['max_abs_diff']:.3g}", f"{r['tolerance_ratio']:.3g}", f"{r['cold_ratio']:.3g}",
                      style=None if r["tracks"] else "red")
    items = [head, sub, table]
    a, b = report["hyperparams"]["original"], report["hyperparams"]["migrated"]
    differ = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if differ:
        items.append(Text("hyperparameters differ: " + "; ".join(differ), style="yellow"))
    for note in report.get("notes", []):
        items.append(Text(f"note: {note}", style="cyan"))
    return items
