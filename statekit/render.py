"""Human renderings of operation results (rich tables). Kept apart from the operations."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _prefix(path: str | None) -> str:
    if not path:
        return "(no path)"
    return path.rsplit(".", 1)[0] if "." in path else path


def _shape(shape) -> str:
    return "×".join(str(d) for d in shape) if shape else "scalar" if shape == [] else "-"


def summary_line(d: dict) -> str:
    version = f" v{d['version']}" if d.get("version") is not None else ""
    kind = d["kind"]
    if d.get("family"):
        fam = "/".join(d["family_candidates"]) if len(d.get("family_candidates", [])) > 1 else d["family"]
        kind = f"{kind} ({fam})"
    parts = [f"{d['format']}{version}", kind]
    parts.append(f"{len(d['params'])} params")
    parts.append(f"{d['tensors']} tensors, {d['scalars']} scalars")
    parts.append(human_bytes(d["bytes"]))
    return " · ".join(parts)


def inspect_table(d: dict, stats: bool = False) -> list:
    """Renderables for ``statekit inspect``: summary, grouped table, notes."""
    out: list = [Text(f"{d['path']}: ", style="bold") + Text(summary_line(d))]
    if d["params"]:
        optimizer = d["kind"] == "optimizer"
        table = Table(show_lines=False, header_style="bold", pad_edge=False)
        table.add_column("path", no_wrap=True)
        table.add_column("id", no_wrap=True)
        table.add_column("display id", no_wrap=True)
        table.add_column("rank", justify="right")
        table.add_column("shape")
        table.add_column("dtype")
        if optimizer:
            table.add_column("step", justify="right")
            table.add_column("fields")
        groups: dict[str, list[dict]] = {}
        for p in d["params"]:
            groups.setdefault(_prefix(p["path"]), []).append(p)
        for prefix, params in groups.items():
            elements = nbytes = 0
            for p in params:
                row = [
                    p["path"] or "-",
                    p["id"] if p["id"] is not None else (f"#{p['index']}" if p.get("index") is not None else "-"),
                    p["display_id"] or "-",
                    str(p["rank"]) if p["rank"] is not None else "-",
                    _shape(p["shape"]),
                    p["dtype"] or "-",
                ]
                count = 1
                for s in p["shape"] or []:
                    count *= s
                if optimizer:
                    row.append("-" if p["step"] is None else f"{p['step']:g}")
                    row.append(", ".join(p["fields"]) or "(no state)")
                    for f in p["fields"].values():
                        n = 1
                        for s in f["shape"]:
                            n *= s
                        elements += n
                        nbytes += n * _itemsize(f["dtype"])
                else:
                    elements += count
                    nbytes += count * _itemsize(p["dtype"])
                table.add_row(*row)
            if len(params) > 1:
                total = Text(f"{prefix}: {elements:,} elements, {human_bytes(nbytes)}", style="dim")
                table.add_row(total, *[""] * (len(table.columns) - 1), end_section=True)
        out.append(table)
    if stats:
        out.append(stats_table(d))
    if d.get("global"):
        g = d["global"]
        out.append(Text(f"global state: {len(g['tensors'])} tensors, scalars {g['scalars']}"))
    if d.get("scalar_values"):
        table = Table(header_style="bold")
        table.add_column("scalar")
        table.add_column("value", justify="right")
        for k, v in d["scalar_values"].items():
            table.add_row(k, str(v))
        out.append(table)
    for i, sched in enumerate(d.get("schedulers", [])):
        shown = ", ".join(f"{k}={v}" for k, v in sched.items() if k != "lr_lambdas")
        out.append(Text(f"lr scheduler {i}: {shown}"))
    for g in d.get("groups", []):
        if g["hyperparameters"]:
            hp = ", ".join(f"{k}={v}" for k, v in g["hyperparameters"].items() if k != "params")
            out.append(Text(f"group ({g['params']} params): {hp}"))
    for note in d.get("notes", []):
        out.append(Text(f"note: {note}", style="cyan"))
    for w in d.get("warnings", []):
        out.append(Text(f"warning: {w}", style="yellow"))
    return out


def stats_table(d: dict) -> Table:
    table = Table(header_style="bold", title="field statistics")
    for col in ("path", "field", "min", "max", "mean", "rms", "nan", "inf"):
        table.add_column(col, justify="left" if col in ("path", "field") else "right")

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    for p in d["params"]:
        items = p.get("fields", {}).items() if "fields" in p else [("(value)", p)]
        for name, f in items:
            s = f.get("stats") or {}
            if not s:
                continue
            style = "red" if s.get("nan") or s.get("inf") else None
            table.add_row(p["path"] or p["id"] or "-", name, *(fmt(s[k]) for k in ("min", "max", "mean", "rms")),
                          str(s["nan"]), str(s["inf"]), style=style)
    return table


def _itemsize(dtype: str | None) -> int:
    from statekit import dtypes

    try:
        return dtypes.itemsize(dtype) if dtype else 0
    except ValueError:
        return 0


def plan_table(plan) -> list:
    """Renderables for a convert/remap plan: a header line, one row per parameter, rules."""
    head = Text(f"{plan.operation}: {plan.source} ({plan.source_format}) → {plan.target} ({plan.target_format})",
                style="bold")
    items: list = [head, Text(f"optimizer {plan.family} · {plan.summary()}")]
    if getattr(plan, "names_from", None):
        items.append(Text(plan.names_from, style="dim"))
    table = Table(header_style="bold", pad_edge=False)
    for col in ("action", "source", "target", "id / index", "shape", "changes"):
        table.add_column(col, no_wrap=col in ("source", "target"))
    styles = {"drop": "red", "new": "green", "rename": "cyan"}
    for a in plan.params:
        changes = []
        if a.transpose:
            changes.append("transpose")
        if a.resize:
            changes.append("resize")
        if a.cast:
            changes.append(f"cast {a.cast}")
        changes += [n for n in a.notes if not n.startswith(("transposed", "resized"))]
        ident = a.dst_id if a.dst_id is not None else (f"#{a.dst_index}" if a.dst_index is not None else "-")
        shape = _shape(a.dst_shape) if a.dst_shape is not None else _shape(a.src_shape) if a.src_shape else "-"
        table.add_row(a.action, a.src_path or (f"#{a.src_key}" if a.src_key else "-"), a.dst_path or "-", ident,
                      shape, ", ".join(changes), style=styles.get(a.action))
    items.append(table)
    if plan.hyperparams:
        for i, g in enumerate(plan.hyperparams):
            shown = ", ".join(f"{k}={v}{'*' if k in plan.assumed else ''}" for k, v in g.items()
                              if k not in ("foreach", "fused", "capturable", "differentiable"))
            items.append(Text(f"group {i}: {shown}"))
        if plan.assumed:
            items.append(Text("* assumed: not stored in the source, filled with its framework's defaults", style="dim"))
    for r in plan.rules:
        items.append(Text(f"rule ({r['origin']}) {r['pattern']} → {r['replacement']}: {r['matches']} matched",
                          style="dim"))
    return items
