"""``inspect`` as a table that fits the terminal, and as TSV."""

from __future__ import annotations

from itertools import islice
from operator import itemgetter

from statekit.render import human_bytes
from statekit.render.boxes import Column, Grid, Line
from statekit.state import format_shape

# Dropped in this order when the table would not fit the width: path, shape, dtype, step and
# fields always stay (the burn id is still there in its short display form until last).
OPTIONAL = ("id", "rank", "display id")
FIELDS_MIN = 24  # the fields column wraps, but not narrower than this


def summary_line(d: dict) -> str:
    return " · ".join(summary_items(d))


def summary_items(d: dict) -> list[str]:
    version = f" v{d['version']}" if d.get("version") is not None else ""
    kind = d["kind"]
    if d.get("family") and d["family"].startswith("unknown"):
        kind = f"{kind} (unknown family)"  # the reason is long: it follows the table, as a note
    elif d.get("family_label") and d["family_label"] != d.get("family") and not d["family_label"].startswith("unknown"):
        kind = f"{kind} ({d['family_label']})"  # a family of its own, by its people's name (transformers Adafactor)
    elif d.get("family"):
        fam = "/".join(d["family_candidates"]) if len(d.get("family_candidates", [])) > 1 else d["family"]
        if fam == "mixed" and any(g.get("family") for g in d.get("groups", [])):
            fam = "mixed: " + " + ".join(_family_label(g) for g in d["groups"])
        kind = f"{kind} ({d['library'] + ' ' if d.get('library') else ''}{fam})"
    size = human_bytes(d["bytes"])
    if d.get("file_bytes") is not None:  # the file's size, and how much of it is tensor data
        size = f"{human_bytes(d['file_bytes'])} ({human_bytes(d['bytes'])} in tensors)"
    if d.get("dequantized_bytes"):  # quantized moments (torchao): what they take once read as float32
        size = f"{size[:-1]}; quantized moments: {human_bytes(d['dequantized_bytes'])} dequantized)" \
            if size.endswith(")") else f"{size} ({human_bytes(d['dequantized_bytes'])} dequantized)"
    return [f"{d['format']}{version}", kind, f"{len(d['params'])} params", f"{d['tensors']} tensors, {d['scalars']} scalars",
            size]


def wrapped(head: str, items: list[str], sep: str, width: int | None, style: str = "",
            head_style: str = "") -> list[Line]:
    """``head`` then ``items`` joined by ``sep``: one line when it fits ``width`` (or no width is
    known), else as many as it takes, none wider than ``width``: a line ends after a separator
    (``sep`` without its spaces), the next starts two spaces in; a word wider than a line is cut
    into pieces that fit."""
    whole = head + sep.join(items)
    if width is None or len(whole) <= width:
        return [Line(((head, head_style), (sep.join(items), style))) if head else Line.of(whole, style)]
    indent = "  "
    room = max(1, width - len(indent) - len(sep.rstrip()))

    def cut(text: str) -> list[str]:
        return [text[i : i + room] for i in range(0, max(len(text), 1), room)]

    # (glue before it when on the same line, text, style)
    tokens = [("", piece, head_style) for piece in cut(head.rstrip())] if head.strip() else []
    for k, item in enumerate(items):
        glue = sep if k else (head[len(head.rstrip()):] if tokens else "")
        tokens += [(glue if i == 0 else "", piece, style) for i, piece in enumerate(cut(item))]
    lines: list[Line] = []
    parts: list[tuple[str, str]] = []
    used = 0
    for n, (glue, text, token_style) in enumerate(tokens):
        last = n == len(tokens) - 1
        tail = "" if last else tokens[n + 1][0].rstrip()  # what ends this line if the next token breaks
        if parts and used + len(glue) + len(text) + len(tail) > width:
            if glue.strip():
                parts.append((glue.rstrip(), style))
            lines.append(_line(parts))
            parts, used, glue, text = [(indent, "")], len(indent), "", text.lstrip() or text
        if glue:
            parts.append((glue, style))
        parts.append((text, token_style))
        used += len(glue) + len(text)
    lines.append(_line(parts))
    return lines


def _line(parts: list[tuple[str, str]]) -> Line:
    """A Line of ``parts`` without trailing spaces (a word cut where the text had a space)."""
    while len(parts) > 1 and not parts[-1][0].rstrip():
        parts = parts[:-1]
    return Line((*parts[:-1], (parts[-1][0].rstrip(), parts[-1][1])))


def _family_label(item: dict) -> str:
    """A parameter's or group's family: ``sgd/muon`` where its state fits several."""
    cands = item.get("family_candidates") or []
    return "/".join(cands) if len(cands) > 1 else (item.get("family") or "unknown")


def _per_row_family(d: dict) -> bool:
    """Whether the parameters hold different families (burn optimizer groups): a family column."""
    return d["kind"] == "optimizer" and d.get("family") == "mixed"


def _names(d: dict) -> list[str]:
    optimizer = d["kind"] == "optimizer"
    return (["path", "id", "display id", "rank", "shape", "dtype"] + (["family"] if _per_row_family(d) else [])
            + (["step", "fields"] if optimizer else []))


def _prefix(path: str | None) -> str:
    if not path:
        return "(no path)"
    return path.rsplit(".", 1)[0] if "." in path else path


def _ident(p: dict) -> str:
    if p["id"] is not None:
        return p["id"]
    return f"#{p['index']}" if p.get("index") is not None else "-"


def _cells(p: dict, optimizer: bool, family: bool = False) -> dict[str, str]:
    names = ["path", "id", "display id", "rank", "shape", "dtype"] + (["family"] if family else []) \
        + (["step", "fields"] if optimizer else [])
    return dict(zip(names, _cell_values(p, optimizer, family), strict=True))


def _cell_values(p: dict, optimizer: bool, family: bool = False) -> tuple[str, ...]:
    """A row's cells in :func:`_names` order (path, id, display id, rank, shape, dtype, family,
    step, fields)."""
    shape = p["shape"]
    cells = (p["path"] or "-", _ident(p), p["display_id"] or "-", str(p["rank"]) if p["rank"] is not None else "-",
             str(shape[0]) if shape is not None and len(shape) == 1 else format_shape(shape),  # (the same text)
             p["dtype"] or "-")
    if family:
        cells += (_family_label(p),)
    if optimizer:
        cells += ("-" if p["step"] is None else f"{p['step']:g}",
                  ", ".join(_field_text(n, f) for n, f in p["fields"].items()) or "(no state)")
    return cells


def _field_text(name: str, f: dict) -> str:
    """A field's name; one statekit does not understand also says what it is (a dict's keys)."""
    if "encoding" in f:  # a library's own storage: what it holds, and how
        enc = f["encoding"]
        how = f"8-bit/{enc['block']}" if enc["bits"] == 8 else "32-bit"
        return f"{name}={f['slot']} ({how})" if f["slot"] != name else f"{name} ({how})"  # family open: no name yet
    if "stored_label" in f:  # decoded from codes as it was read (torchao): how the file stores it
        return f"{name} ({f['stored_label']})"
    if "role" in f:
        return name
    if f.get("understood", True):
        return name
    inner = f" {{{', '.join(f['keys'])}}}" if "keys" in f else f" ({f['type']})"
    return f"{name}{inner} (not understood)"


def _itemsize(dtype: str | None) -> int:
    from statekit import dtypes

    try:
        return dtypes.itemsize(dtype) if dtype else 0
    except ValueError:
        return 0


def _totals(params, optimizer: bool) -> tuple[int, int]:
    """Elements and bytes of a group of parameters (their state fields, for optimizer files)."""
    elements = nbytes = 0
    for p in params:
        n, b = _row_totals(p, optimizer)
        elements += n
        nbytes += b
    return elements, nbytes


def _row_totals(p: dict, optimizer: bool) -> tuple[int, int]:
    """Elements and bytes of one parameter (its state fields, for optimizer files)."""
    elements = nbytes = 0
    items = [(f["shape"], f["dtype"]) for f in p["fields"].values() if "shape" in f] if optimizer \
        else [(p["shape"] or [], p["dtype"])]
    for dims, dtype in items:
        n = 1
        for s in dims:
            n *= s
        elements += n
        nbytes += n * _itemsize(dtype)
    return elements, nbytes


def _widths(rows: list[dict[str, str]], names: list[str]) -> dict[str, int]:
    """Each column's widest cell (its name included)."""
    return {c: max(len(c), max(map(len, map(itemgetter(c), rows)), default=0)) for c in names}


def _columns(rows: list[dict[str, str]], names: list[str], width: int | None,
             widths: dict[str, int] | None = None) -> list[str]:
    """The columns that fit ``width``: optional ones dropped in :data:`OPTIONAL` order."""
    if width is None:
        return names
    widths = widths or _widths(rows, names)

    def needed(cols: list[str]) -> int:
        return 1 + sum((min(widths[c], FIELDS_MIN) if c == "fields" else widths[c]) + 3 for c in cols)

    cols = list(names)
    for drop in OPTIONAL:
        if needed(cols) <= width:
            break
        cols.remove(drop)
    return cols


#: Above this many parameters the table is plain aligned text (same columns, same group totals)
#: that the output writes as it is: rich lays out every cell, measured 12 s for 10,000 rows.
PLAIN_ROWS = 500


class PlainLines(str):
    """Pre-formatted lines: :class:`statekit.output.Output` writes them to stdout unchanged."""


CHUNK_LINES = 4096


def params_table(d: dict, width: int | None = None) -> Grid | list[PlainLines]:
    """The parameters grouped by module prefix. The cells are made twice (once for the column
    widths, once for the rows) rather than kept: 10^6 rows of cells held at once took ~0.5 GB."""
    optimizer = d["kind"] == "optimizer"
    family = _per_row_family(d)
    names = _names(d)
    # positions: the rows are read again by position (they may be made on reading); a group of one
    # as its position alone (10^6 paths without a dot: a list each took ~90 MB)
    groups: dict[str, int | list[int]] = {}
    widths = {c: len(c) for c in names}
    batch: list[tuple[str, ...]] = []

    def measure() -> None:  # each column's widest cell in the batch, column by column
        for c, column in zip(names, zip(*batch, strict=True), strict=True):
            w = max(map(len, column))
            if w > widths[c]:
                widths[c] = w
        batch.clear()

    rows = 0
    in_order = True  # each group's rows together, the groups in order: the rows can be read again in order
    last = None
    params = _without_stats(d["params"])
    for p in params:
        key = _prefix(p["path"])
        at = groups.get(key)
        if at is None:
            groups[key] = rows
        else:
            in_order = in_order and key == last
            if type(at) is int:
                groups[key] = [at, rows]
            else:
                at.append(rows)
        last = key
        batch.append(_cell_values(p, optimizer, family))
        if len(batch) >= CHUNK_LINES:
            measure()
        rows += 1
    if batch:
        measure()
    cols = _columns([], names, width, widths)
    if rows > PLAIN_ROWS:
        return _plain_table(params, groups, names, cols, optimizer, widths, family, in_order)
    table = Grid([Column(c, "right" if c in ("rank", "step") else "left", c in ("fields", "path")) for c in cols])
    last = cols[-1]
    for prefix, at in groups.items():
        positions = [at] if type(at) is int else at
        for i in positions:
            cells = _cells(params[i], optimizer, family)
            table.add_row([cells[c] for c in cols])
        if len(positions) > 1:
            elements, nbytes = _totals(map(params.__getitem__, positions), optimizer)
            total = {c: "" for c in cols}
            total[last] = f"{prefix}: {elements:,} elements, {human_bytes(nbytes)}"
            table.add_row([total[c] for c in cols], style="dim", end_section=True)
    return table


def _without_stats(params):
    """The rows as the parameters table reads them: a streamed description's without statistics
    (:meth:`statekit.ops.inspect.Rows.without_stats`: the table shows none, and they cost)."""
    return params.without_stats() if hasattr(params, "without_stats") else params


def _plain_table(params, groups: dict[str, int | list[int]], names: list[str], cols: list[str], optimizer: bool,
                 widths: dict[str, int], family, in_order: bool = False) -> list[PlainLines]:
    """The table as aligned text: a header, a rule, the rows, a total line under each group
    (in pieces of :data:`CHUNK_LINES` lines, written one after the other). ``in_order``: the
    groups' rows are the rows in order (read again in order, not by position)."""
    right = {"rank", "step"}

    # each column padded to its width (right-justified: rank, step), the last one not padded
    template = " ".join([f"{{{i}:{'>' if c in right else '<'}{widths[c]}}}" for i, c in enumerate(cols[:-1])]
                        + [f"{{{len(cols) - 1}}}"]).format
    if cols == names:
        def line(cells: tuple[str, ...]) -> str:
            return template(*cells).rstrip()
    else:
        at = [names.index(c) for c in cols]
        pick = itemgetter(*at) if len(at) > 1 else (lambda cells: (cells[at[0]],))

        def line(cells: tuple[str, ...]) -> str:
            return template(*pick(cells)).rstrip()

    chunks: list[PlainLines] = []
    out = [template(*cols).rstrip(), " ".join("-" * widths[c] for c in cols)]

    def add(text: str) -> None:  # (joined every CHUNK_LINES lines: 10^6 line objects held took ~0.1 GB)
        out.append(text)
        if len(out) >= CHUNK_LINES:
            chunks.append(PlainLines("\n".join(out) + "\n"))
            out.clear()

    indent = sum(widths[c] + 1 for c in cols[:-1])
    rows = iter(params) if in_order else None
    for prefix, at in groups.items():
        positions = [at] if type(at) is int else at
        # the group's total from the same rows (a group of one has none)
        elements = nbytes = 0
        for p in islice(rows, len(positions)) if in_order else map(params.__getitem__, positions):
            add(line(_cell_values(p, optimizer, family)))
            if len(positions) > 1:
                n, b = _row_totals(p, optimizer)
                elements += n
                nbytes += b
        if len(positions) > 1:
            add(" " * indent + f"{prefix}: {elements:,} elements, {human_bytes(nbytes)}")
    if out:
        chunks.append(PlainLines("\n".join(out) + "\n"))
    return chunks


def _lrs(values) -> str:
    """Per-group lrs, each in full (repr: the exact float the program uses), one value if all agree."""
    if not values:
        return "?"
    if len(set(values)) == 1:
        return repr(values[0]) + (f" (all {len(values)} groups)" if len(values) > 1 else "")
    return ", ".join(repr(v) for v in values)


def _in_updates(s: dict, key: str) -> str:
    """A schedule counted in samples (Megatron): the unit, and the count in iterations."""
    unit = s.get("unit")
    if not unit or unit == "updates":
        return ""
    it = (s.get("updates") or {}).get(key)
    return f" {unit}" + (f" ({it:g} iterations)" if it is not None else "")


def schedule_view(s: dict, width: int | None) -> list:
    """The LR schedule: kind, warm-up, horizon, position, steps left; lr now and next; the counters."""
    out: list = []
    if s.get("kind"):
        items = [s["kind"]]
        for key, word in (("warmup", "warm-up"), ("horizon", "horizon"), ("position", "position"),
                          ("steps_left", "steps left")):
            if s.get(key) is not None:
                items.append(f"{word} {s[key]}" + _in_updates(s, key))
        out += wrapped("schedule: ", items, " · ", width, head_style="bold")
        if s.get("wd_now") is not None:
            out += wrapped("  weight decay now / next: ", [f"{_lrs(s['wd_now'])} / {_lrs(s.get('wd_next') or [])}"],
                           "", width)
        if s.get("lr_now") is not None:
            out += wrapped("  lr now (next update): ", [_lrs(s["lr_now"])], "", width)
        if s.get("lr_next") is not None:
            out += wrapped("  lr next (the update after): ", [_lrs(s["lr_next"])], "", width)
        elif s.get("lr_next_if"):
            out += wrapped("  lr next: ", [f"{_lrs(s['lr_next_if']['better'])} if the metric improves",
                                           f"{_lrs(s['lr_next_if']['worse'])} if not"], "; ", width)
        else:
            out += wrapped("  lr next: ", ("not known: " + str(s.get("lr_next_why") or s.get("unknown"))).split(" "),
                           " ", width, "yellow")
        for i, child in enumerate(s.get("children") or []):
            state = ", ".join(f"{k}={v}" for k, v in child["state"].items())
            out += wrapped(f"  {i}: ", [child["kind"], f"position {child['position']}" if child["position"] is not None
                                        else "position not known", state or "(no counter)"], " · ", width)
        params = ", ".join(f"{k}={v}" for k, v in (s.get("params") or {}).items())
        if params:
            out += wrapped("  parameters: ", params.split(", "), ", ", width)
    else:
        out += wrapped("schedule: ", ["none saved"], "", width, head_style="bold")
    counters = [f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                for k, v in (s.get("counters") or {}).items() if v is not None]
    if s.get("optimizer_step") is not None:
        counters.append(f"optimizer step {s['optimizer_step']:g}")
    if counters:
        out += wrapped("  counters: ", counters, " · ", width)
    for note in s.get("notes", []):
        out += wrapped("  note: ", note.split(" "), " ", width)
    return out


def inspect_view(d: dict, stats: bool = False, width: int | None = None) -> list:
    """Renderables for ``statekit inspect``: summary, grouped table, notes."""
    out: list = wrapped(f"{d['path']}: ", summary_items(d), " · ", width, head_style="bold")
    if d["kind"] == "optimizer" and str(d.get("family") or "").startswith("unknown"):
        out += wrapped("", f"family: {d['family']}".split(" "), " ", width, "yellow")
    if d["params"]:
        table = params_table(d, width)
        out += table if isinstance(table, list) else [table]
    if stats:
        table = stats_table(d)
        out += table if isinstance(table, list) else [table]
    if d.get("global"):
        out += global_view(d["global"], width)
    if d.get("scalar_values"):
        from rich.table import Table

        table = Table(header_style="bold")
        table.add_column("scalar")
        table.add_column("value", justify="right")
        for k, v in d["scalar_values"].items():
            table.add_row(k, str(v))
        out.append(table)
    if d.get("schedule"):
        out += schedule_view(d["schedule"], width)
    else:
        for i, sched in enumerate(d.get("schedulers", [])):
            shown = ", ".join(f"{k}={v}" for k, v in sched.items() if k != "lr_lambdas")
            out += wrapped(f"lr scheduler {i}: ", shown.split(", ") if shown else [], ", ", width)
    per_group = _per_row_family(d)
    for i, g in enumerate(d.get("groups", [])):
        fam = f"{_family_label(g)}, " if per_group and g.get("family") else ""
        if g["hyperparameters"]:
            hp = [f"{k}={v}" for k, v in g["hyperparameters"].items() if k != "params"]
            out += wrapped(f"group ({g['params']} params): ", [fam + hp[0], *hp[1:]] if hp else [fam[:-2]], ", ",
                           width)
        elif fam:
            out += wrapped(f"group {i} ({g['params']} params): ", [fam[:-2]], ", ", width)
    for n in d.get("notes", []):
        out += wrapped("", f"note: {n}".split(" "), " ", width, "cyan")
    for w in d.get("warnings", []):
        out += wrapped("", f"warning: {w}".split(" "), " ", width, "yellow")
    return out


def global_view(g: dict, width: int | None = None) -> list:
    """An optimizer's global state (burn's and torch's L-BFGS): its tensors (name, shape, dtype) in
    a table, history lists folded to one row each, then its scalars."""
    rows: dict[str, list] = {}
    for name, t in g["tensors"].items():
        head, _, tail = name.rpartition(".")
        key = head if head and tail.isdigit() else name
        rows.setdefault(key, []).append(t)
    table = Grid([Column("global state"), Column("shape"), Column("dtype")])
    for key, items in rows.items():
        shapes = {format_shape(t["shape"]) for t in items}
        dtypes_ = {t["dtype"] for t in items}
        label = f"{key} ({len(items)} vectors)" if len(items) > 1 or key not in g["tensors"] else key
        table.add_row([label, ", ".join(sorted(shapes)), ", ".join(sorted(dtypes_))])
    out: list = [table] if rows else []
    if g["scalars"]:
        out += wrapped("global scalars: ", [f"{k}={v}" for k, v in g["scalars"].items()], ", ", width)
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _stats_rows(d: dict):
    """(cells, has NaN/Inf) of each field with statistics, in table order."""
    params = d["params"]
    values = params.stat_values() if hasattr(params, "stat_values") else None
    if values is not None:  # (a streamed model's: each tensor's numbers, its row not made)
        for path, ident, s in values:
            if s is None:
                continue
            lo, hi, mean, rms, nan, inf = s
            if lo is None:  # (then all four are: no finite value)
                yield [path or ident or "-", "(value)", "-", "-", "-", "-", str(nan), str(inf)], bool(nan or inf)
            else:
                yield ([path or ident or "-", "(value)", f"{lo:.4g}", f"{hi:.4g}", f"{mean:.4g}", f"{rms:.4g}",
                        str(nan), str(inf)], bool(nan or inf))
        return
    for p in params:
        items = p.get("fields", {}).items() if "fields" in p else [("(value)", p)]
        for name, f in items:
            s = f.get("stats") or {}
            if not s:
                continue
            yield ([p["path"] or p["id"] or "-", name, *(_fmt(s[k]) for k in ("min", "max", "mean", "rms")),
                    str(s["nan"]), str(s["inf"])], bool(s.get("nan") or s.get("inf")))


STATS_COLUMNS = ("path", "field", "min", "max", "mean", "rms", "nan", "inf")


def stats_table(d: dict):
    """A rich table (statistics read the tensors: rich's import is small beside that); above
    :data:`PLAIN_ROWS` rows aligned text (rich took ~1 ms a row: 10^6 rows, a quarter of an hour),
    in pieces of :data:`CHUNK_LINES` lines. The cells are made twice (widths, then lines), not kept."""
    params = d["params"]
    if hasattr(params, "stat_chunks") and params.stat_chunks() is not None:
        text = _plain_model_stats(params)  # (a streamed model's numbers: no cell made for the widths)
        if text is not None:
            return text
    widths = [len(c) for c in STATS_COLUMNS]
    count = 0
    batch: list[list[str]] = []

    def measure() -> None:  # each column's widest cell in the batch, column by column
        for i, column in enumerate(zip(*batch, strict=True)):
            widths[i] = max(widths[i], *map(len, column))
        batch.clear()

    for cells, _ in _stats_rows(d):
        batch.append(cells)
        count += 1
        if len(batch) >= CHUNK_LINES:
            measure()
    if batch:
        measure()
    if count > PLAIN_ROWS:
        # the first two columns left-justified, the others right-justified; no trailing spaces
        template = " ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))

        def line(cells: list[str]) -> str:
            return template.format(*cells).rstrip()

        out = ["field statistics", line(list(STATS_COLUMNS)), " ".join("-" * w for w in widths)]
        chunks: list[PlainLines] = []
        for cells, _ in _stats_rows(d):
            out.append(line(cells))
            if len(out) >= CHUNK_LINES:
                chunks.append(PlainLines("\n".join(out) + "\n"))
                out.clear()
        if out:
            chunks.append(PlainLines("\n".join(out) + "\n"))
        return chunks
    from rich.table import Table

    table = Table(header_style="bold", title="field statistics")
    for col in STATS_COLUMNS:
        table.add_column(col, justify="left" if col in ("path", "field") else "right")
    for cells, bad in _stats_rows(d):
        table.add_row(*cells, style="red" if bad else None)
    return table


def _plain_model_stats(params) -> list[PlainLines] | None:
    """:func:`stats_table`'s plain text for a streamed model (``params.stat_chunks()``), the same
    text, or None when it has no more than :data:`PLAIN_ROWS` rows. The widths come from the
    numbers: ``{:.4g}`` of each (a NaN, shown ``-``, measures 3: no wider than any header) and the
    largest count; each line is one ``format`` of the numbers themselves."""
    widths = [len(c) for c in STATS_COLUMNS]
    count = 0
    for paths, ids, values in params.stat_chunks():
        if not paths:
            continue
        count += len(paths)
        widths[0] = max(widths[0], *(len(p or i or "-") for p, i in zip(paths, ids, strict=True)))
        widths[1] = max(widths[1], len("(value)"))
        for c in range(4):
            widths[2 + c] = max(widths[2 + c], *map(len, map("{:.4g}".format, values[:, c].tolist())))
        for c in (4, 5):
            widths[2 + c] = max(widths[2 + c], len(str(int(values[:, c].max()))))
    if count <= PLAIN_ROWS:
        return None
    w = widths
    shown = f"{{:<{w[0]}}} {{:<{w[1]}}} {{:>{w[2]}.4g}} {{:>{w[3]}.4g}} {{:>{w[4]}.4g}} {{:>{w[5]}.4g}} " \
            f"{{:>{w[6]}}} {{:>{w[7]}}}"
    shown = shown.format
    blank = f"{{:<{w[0]}}} {{:<{w[1]}}} {'-':>{w[2]}} {'-':>{w[3]}} {'-':>{w[4]}} {'-':>{w[5]}} " \
            f"{{:>{w[6]}}} {{:>{w[7]}}}"
    blank = blank.format
    out = ["field statistics",
           " ".join(c.ljust(n) if i < 2 else c.rjust(n) for i, (c, n) in enumerate(zip(STATS_COLUMNS, w, strict=True))).rstrip(),
           " ".join("-" * n for n in w)]
    chunks: list[PlainLines] = []
    for paths, ids, values in params.stat_chunks():
        numbers = values[:, :4].tolist()
        counts = values[:, 4:].astype("int64").tolist()
        for p, i, (lo, hi, mean, rms), (nan, inf) in zip(paths, ids, numbers, counts, strict=True):
            label = p or i or "-"
            out.append((blank(label, "(value)", nan, inf) if lo != lo else
                        shown(label, "(value)", lo, hi, mean, rms, nan, inf)).rstrip())
        if len(out) >= CHUNK_LINES:
            chunks.append(PlainLines("\n".join(out) + "\n"))
            out.clear()
    if out:
        chunks.append(PlainLines("\n".join(out) + "\n"))
    return chunks


def inspect_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    """One header and one line per parameter."""
    optimizer = d["kind"] == "optimizer"
    family = _per_row_family(d)
    names = _names(d)
    rows = (_cell_values(p, optimizer, family) for p in _without_stats(d["params"]))  # in ``names`` order
    return [n.replace(" ", "_") for n in names], rows
