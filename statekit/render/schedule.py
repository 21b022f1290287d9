"""``statekit schedule``'s result as lines of text and TSV rows (the re-horizoned schedule)."""

from __future__ import annotations

from rich.text import Text


def _lrs(values) -> str:
    if values is None:
        return "not known"
    if values and all(v == values[0] for v in values):
        return f"{values[0]!r}" + (f" (all {len(values)} groups)" if len(values) > 1 else "")
    return ", ".join(repr(v) for v in values)


def schedule_view(d: dict) -> list:
    out: list = [Text(f"{d['input']}: {d['kind']} · position {d['position']} · horizon {d['old_horizon']} → "
                      f"{d['new_horizon']} · steps left {d['steps_left']} · rule {d['rule']}")]
    out.append(Text(f"  {d['formula']}"))
    if d["lr_now"] is not None:
        line = f"  lr now (next update): {_lrs(d['lr_now'])}"
        if d["jump"] is not None:
            line += f" (was {_lrs(d['lr_before'])}: × {_lrs(d['jump'])})"
        out.append(Text(line))
    if d["lr_next"]:
        for k, lrs in enumerate(d["lr_next"], 1):
            out.append(Text(f"  lr at position {d['position'] + k}: {_lrs(lrs)}"))
    elif d.get("lr_next_why"):
        out.append(Text(f"  lrs after: {d['lr_next_why']}"))
    if d["end_lr"] is not None:
        out.append(Text(f"  lr at the horizon ({d['new_horizon']}): {_lrs(d['end_lr'])}"))
    for note in d["notes"]:
        out.append(Text(f"  note: {note}"))
    for must in d["must"]:
        out.append(Text(f"  you must: {must}", style="yellow"))
    files = ", ".join(f"{name} ({role})" for name, role in d["files"].items())
    if d["written"]:
        out.append(Text(f"wrote {d['output']}: {files}" + (f" + {len(d['copy'])} files copied" if d["copy"] else ""),
                        style="bold"))
    else:
        out.append(Text(f"would write {d['output'] or '(no -o)'}: {files} (dry run, nothing written)", style="bold"))
    return out


def schedule_tsv(d: dict) -> tuple[list[str], list[list]]:
    rows = [[d["position"], "now", i, lr] for i, lr in enumerate(d["lr_now"] or [])]
    rows += [[d["position"] + k, "next", i, lr] for k, lrs in enumerate(d["lr_next"], 1) for i, lr in enumerate(lrs)]
    return ["position", "which", "group", "lr"], rows
