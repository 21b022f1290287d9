"""A convert / remap plan: a table before anything is written, and TSV."""

from __future__ import annotations

from statekit.render import shape
from statekit.render.boxes import Column, Grid, Line

EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _changes(a) -> str:
    changes = []
    if a.transpose:
        changes.append("transpose")
    if a.resize:
        changes.append("resize")
    if a.cast:
        changes.append(f"cast {a.cast}")
    changes += [n for n in a.notes if not n.startswith(("transposed", "resized")) or a.structure]
    return ("; " if a.structure else ", ").join(changes)


def _row(a) -> list[str]:
    ident = a.dst_id if a.dst_id is not None else (f"#{a.dst_index}" if a.dst_index is not None else "-")
    dims = shape(a.dst_shape) if a.dst_shape is not None else shape(a.src_shape) if a.src_shape else "-"
    source = a.src_path or (f"#{a.src_key}" if a.src_key else "-")
    if a.sources:
        source = braced([s.get("path") or f"#{s.get('key')}" for s in a.sources])
    return [a.action, source, a.dst_path or "-", ident, dims, _changes(a)]


def braced(paths: list[str], most: int = 6) -> str:
    """Several paths in one: ``layers.0.attn.{q,k,v}_proj.weight`` (the part they share, once)."""
    if len(paths) == 1:
        return paths[0]
    head = paths[0]
    for p in paths[1:]:
        while not p.startswith(head):
            head = head[:-1]
    head = head[: head.rfind(".") + 1] if "." in head else ""
    tail = paths[0][len(head):]
    for p in paths[1:]:
        while not p.endswith(tail) or len(p) - len(tail) < len(head):
            tail = tail[1:]
    middles = [p[len(head) : len(p) - len(tail)] for p in paths]
    if not all(middles):
        return ", ".join(paths)
    shown = middles[:most] + ([f"… +{len(middles) - most}"] if len(middles) > most else [])
    return f"{head}{{{','.join(shown)}}}{tail}"


#: A plan of more rows than this shows its first and last rows and every drop and new parameter
#: (the counts of every kind are in its summary line); ``--dry-run``, ``--format tsv`` and
#: ``--plan-out`` show every row. A terminal's table of hundreds of rows costs rich ~0.5 s.
PLAN_ROWS = 40
HEAD_ROWS, TAIL_ROWS = 15, 5


def shown_rows(params: list, full: bool) -> list[int | tuple[int, int]]:
    """Indexes of the rows to show, with ``(first, count)`` for a run of rows left out."""
    n = len(params)
    if full or n <= PLAN_ROWS:
        return list(range(n))
    keep = set(range(HEAD_ROWS)) | set(range(n - TAIL_ROWS, n))
    keep |= {i for i, a in enumerate(params) if a.action in ("drop", "new")}
    out: list[int | tuple[int, int]] = []
    gap = None
    for i in range(n):
        if i in keep:
            if gap is not None:
                out.append((gap, i - gap))
                gap = None
            out.append(i)
        elif gap is None:
            gap = i
    if gap is not None:
        out.append((gap, n - gap))
    return out


def plan_view(plan, full: bool = False) -> list:
    """Renderables for a convert/remap plan: a header line, the rows (all of them when ``full`` or
    few; else see :data:`PLAN_ROWS`), rules. Drawn without rich where stdout is not a terminal."""
    head = Line.of(f"{plan.operation}: {plan.source} ({plan.source_format}) → {plan.target} ({plan.target_format})",
                   "bold")
    items: list = [head, Line.of(f"optimizer {plan.family} · {plan.summary()}")]
    if getattr(plan, "names_from", None):
        items.append(Line.of(plan.names_from, "dim"))
    if getattr(plan, "layouts_from", None):
        items.append(Line.of(plan.layouts_from, "dim"))
    structure = getattr(plan, "structure", None)
    if structure:
        origin = structure.get("origin")
        how = ("learned from the old and new weights and proved on them, bit for bit" if origin == "weights" else
               ("by rule, proved on the weights (" if origin == "rules, proved" else "by rule (")
               + ", ".join(structure.get("notes", [])) + ")")
        items.append(Line.of(f"structure: {how}", "dim"))
        if structure.get("origin") == "weights":
            items += [Line.of(n, "dim") for n in structure.get("notes", [])]
    if getattr(plan, "training_args", None):
        items.append(Line.of("hyperparameters from the param groups; training_args.bin: " + ", ".join(
            f"{k}={v}" for k, v in plan.training_args.items()), "dim"))
    table = Grid([Column(col, wrap=True)
                  for col in ("action", "source", "target", "id / index", "shape", "changes")])
    styles = {"drop": "red", "new": "green", "rename": "cyan", "assemble": "magenta"}
    left_out = 0
    rows = [a for a in plan.params if a.action != "into"]  # an assembled row names its sources already
    for i in shown_rows(rows, full):
        if isinstance(i, tuple):
            left_out += i[1]
            table.add_row(["...", f"{i[1]} more rows", "", "", "", ""], style="dim")
            continue
        a = rows[i]
        table.add_row(_row(a), style=styles.get(a.action, ""))
    items.append(table)
    if left_out:
        items.append(Line.of(f"{left_out} of {len(rows)} rows not shown: --dry-run shows every row, "
                             "--plan-out FILE saves them as JSON", "dim"))
    read_into = len(plan.params) - len(rows)
    if read_into:
        items.append(Line.of(f"{read_into} source parameters are read into the assembled ones (each listed with "
                             "its targets by --format json and --plan-out)", "dim"))
    families = getattr(plan, "group_families", None) or []
    for i, g in enumerate(plan.hyperparams):
        shown = ", ".join(f"{k}={v}{'*' if k in plan.assumed else ''}" for k, v in g.items()
                          if k not in EXECUTION_FLAGS)
        which = f" ({families[i]})" if i < len(families) else ""
        items.append(Line.of(f"group {i}{which}: {shown}"))
    for t in getattr(plan, "transforms", None) or []:
        where = "state" if t.get("slot") == "(global)" else f"transform (group {t['group']})"
        items.append(Line.of(f"{where}: {t['text']}"))
    if getattr(plan, "exactness", None):
        items.append(Line.of(f"resume: {plan.exactness}"))
    if plan.hyperparams and plan.assumed:
        items.append(Line.of("* assumed: not stored in the source, filled with its framework's defaults", "dim"))
    for r in plan.rules:
        items.append(Line.of(f"rule ({r['origin']}) {r['pattern']} → {r['replacement']}: {r['matches']} matched",
                             "dim"))
    return items


def plan_tsv(plan) -> tuple[list[str], list[list[str]]]:
    return ["action", "source", "target", "id_or_index", "shape", "changes"], [_row(a) for a in plan.params]
