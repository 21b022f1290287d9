"""A convert / remap plan: a table before anything is written, and TSV."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from statekit.render import shape

EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _changes(a) -> str:
    changes = []
    if a.transpose:
        changes.append("transpose")
    if a.resize:
        changes.append("resize")
    if a.cast:
        changes.append(f"cast {a.cast}")
    changes += [n for n in a.notes if not n.startswith(("transposed", "resized"))]
    return ", ".join(changes)


def _row(a) -> list[str]:
    ident = a.dst_id if a.dst_id is not None else (f"#{a.dst_index}" if a.dst_index is not None else "-")
    dims = shape(a.dst_shape) if a.dst_shape is not None else shape(a.src_shape) if a.src_shape else "-"
    return [a.action, a.src_path or (f"#{a.src_key}" if a.src_key else "-"), a.dst_path or "-", ident, dims,
            _changes(a)]


def plan_view(plan) -> list:
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
        table.add_row(*_row(a), style=styles.get(a.action))
    items.append(table)
    for i, g in enumerate(plan.hyperparams):
        shown = ", ".join(f"{k}={v}{'*' if k in plan.assumed else ''}" for k, v in g.items()
                          if k not in EXECUTION_FLAGS)
        items.append(Text(f"group {i}: {shown}"))
    if plan.hyperparams and plan.assumed:
        items.append(Text("* assumed: not stored in the source, filled with its framework's defaults", style="dim"))
    for r in plan.rules:
        items.append(Text(f"rule ({r['origin']}) {r['pattern']} → {r['replacement']}: {r['matches']} matched",
                          style="dim"))
    return items


def plan_tsv(plan) -> tuple[list[str], list[list[str]]]:
    return ["action", "source", "target", "id_or_index", "shape", "changes"], [_row(a) for a in plan.params]
