"""``diff``, ``merge``, ``doctor``, ``verify-resume`` and ``replay`` results: tables and TSV."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from statekit.ops.diff import METHOD_WORDS
from statekit.render import shape


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.4g}"
    return str(v)


def _value(v) -> str:
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return shape(v)
    if isinstance(v, float):
        return f"{v:.9g}"
    return "-" if v is None else str(v)


# ----------------------------------------------------------------------------- diff


def _ulp(f: dict) -> str:
    if f.get("max_ulp") is None:
        return "-"
    suffix = f" ({f['ulp_dtype']})" if f.get("dtype_a") != f.get("dtype_b") else ""
    return f"{f['max_ulp']}{suffix}"


def diff_rows(d: dict) -> list[list[str]]:
    rows: list[list[str]] = []
    for p in d["only_in_a"]:
        rows.append([p["label"], "", "only in A", shape(p["shape"]), "", "", "", "", ""])
    for p in d["only_in_b"]:
        rows.append([p["label"], "", "only in B", "", shape(p["shape"]), "", "", "", ""])
    for item in d["differences"]:
        rows.append(["(file)", "", item["what"], _value(item["a"]), _value(item["b"]), "", "", "", ""])
    for h in d["hyperparameters"]:
        where = "(groups)" if h["group"] is None else f"group {h['group']}"
        rows.append([where, h["name"], "hyperparameter", _value(h["a"]), _value(h["b"]), "", "", "", ""])
    for p in d["params"]:
        if p["equal"]:
            continue
        for item in p["differences"]:
            rows.append([p["label"], "", item["what"], _value(item["a"]), _value(item["b"]), "", "", "", ""])
        for f in p["fields"]:
            if f["equal"]:
                continue
            if f.get("only"):
                which = "A" if f["only"] == "a" else "B"
                rows.append([p["label"], f["name"], f"only in {which}", "", "", "", "", "", ""])
                continue
            if not f.get("compared"):
                if f.get("reason") == "shape" and any(x["what"] == "shape" for x in p["differences"]):
                    continue  # already said on the parameter's row
                rows.append([p["label"], f["name"], f.get("reason", "differs"), shape(f["shape_a"]),
                             shape(f["shape_b"]), "", "", "", ""])
                continue
            if f["dtype_a"] != f["dtype_b"] and not any(x["what"] == "dtype" for x in p["differences"]):
                rows.append([p["label"], f["name"], "dtype", f["dtype_a"], f["dtype_b"], "", "", "", ""])
            if not f["differing"]:
                continue
            worst = f.get("worst") or {}
            at = "[" + ",".join(map(str, worst.get("index", []))) + "]" if worst else ""
            count = f"{f['differing']}/{f['elements']}"
            if f["nan_mismatch"]:
                count += f" ({f['nan_mismatch']} NaN vs number)"
            rows.append([p["label"], f["name"], f"values {at}".strip(), _value(worst.get("a")),
                         _value(worst.get("b")), _num(f["max_abs"]), _num(f["max_rel"]), _ulp(f), count])
    return rows


def diff_summary(d: dict) -> str:
    s = d["summary"]
    how = METHOD_WORDS.get(d["matched_by"], d["matched_by"])
    what = "models" if d["kind"] == "model" else "states" if d["kind"] == "optimizer" else "files"
    numbers = []
    if s["max_abs"] is not None:
        numbers.append(f"max |Δ| {_num(s['max_abs'])}")
        if s["max_abs"]:
            numbers.append(f"max rel {_num(s['max_rel'])}")
    if s["max_ulp"] is not None and s["max_abs"]:
        mixed = sorted({f["ulp_dtype"] for p in d["params"] for f in p["fields"]
                        if f.get("ulp_dtype") and f.get("dtype_a") != f.get("dtype_b")})
        numbers.append(f"max {s['max_ulp']} ulp" + (f" (in {', '.join(mixed)})" if mixed else ""))
    tail = f"; {', '.join(numbers)}" if numbers else ""
    tol = f" within atol={d['atol']:g} rtol={d['rtol']:g}" if d["atol"] or d["rtol"] else ""
    if d["equal"]:
        return (f"equal{tol}: {s['params_compared']} parameters, {s['fields_compared']} fields "
                f"(matched by {how}){tail}")
    parts = []
    if s["params_compared"]:
        parts.append(f"{s['params_differing']} of {s['params_compared']} matched parameters differ "
                     f"({s['fields_differing']} of {s['fields_compared']} fields)")
    else:
        parts.append("no parameters in common")
    if s["only_in_a"] or s["only_in_b"]:
        parts.append(f"{s['only_in_a']} only in A, {s['only_in_b']} only in B")
    if d["differences"] or d["hyperparameters"]:
        n = len(d["differences"]) + len(d["hyperparameters"])
        parts.append(f"{n} file-level difference{'s' if n != 1 else ''}")
    return f"{what} differ{tol}: {', '.join(parts)} (matched by {how}){tail}"


def diff_view(d: dict) -> list:
    out: list = [Text(f"A = {d['a']['path']} ({d['a']['format']} {d['a']['kind']}), "
                      f"B = {d['b']['path']} ({d['b']['format']} {d['b']['kind']})", style="dim")]
    rows = diff_rows(d)
    if rows:
        table = Table(header_style="bold", pad_edge=False)
        for col in ("parameter", "field", "difference", "A", "B", "max |Δ|", "max rel", "max ulp", "elements"):
            table.add_column(col, justify="right" if col.startswith("max") else "left",
                             no_wrap=col in ("parameter", "field"))
        for row in rows:
            table.add_row(*row)
        out.append(table)
    for note in d["notes"]:
        out.append(Text(f"note: {note}", style="cyan"))
    out.append(Text(diff_summary(d), style="bold green" if d["equal"] else "bold red"))
    return out


# ----------------------------------------------------------------------------- merge


def merge_view(d: dict) -> list:
    out: list = []
    inputs = Table(header_style="bold", pad_edge=False)
    for col in ("input", "format", "family", "params", "taken"):
        inputs.add_column(col, justify="right" if col in ("params", "taken") else "left")
    for item in d["inputs"]:
        inputs.add_row(item["path"], item["format"], item["family"] or "-", str(item["params"]), str(item["taken"]))
    out.append(inputs)
    if d["conflicts"]:
        table = Table(header_style="bold", pad_edge=False, title="conflicts")
        for col in ("parameter", "in", "resolution", "steps", "step"):
            table.add_column(col)
        for c in d["conflicts"]:
            steps = ", ".join("-" if s is None else f"{s:g}" for s in c["steps"])
            table.add_row(c["name"], ", ".join(c["inputs"]), c["resolution"], steps,
                          "-" if c["step"] is None else f"{c['step']:g}")
        out.append(table)
    for note in d["notes"]:
        out.append(Text(f"note: {note}", style="cyan"))
    for w in d["warnings"]:
        out.append(Text(f"warning: {w}", style="yellow"))
    out.append(Text(merge_summary(d), style="bold"))
    return out


def merge_summary(d: dict) -> str:
    n_in = len(d["inputs"])
    conflicts = len(d["conflicts"])
    how = METHOD_WORDS.get(d["matched_by"], d["matched_by"])
    text = f"{d['params']} parameters from {n_in} inputs (matched by {how})"
    if conflicts:
        text += f", {conflicts} conflicts resolved by {d['on_conflict']}"
        if d["on_conflict"] == "mean":
            text += " (moments averaged elementwise, largest step kept)"
    else:
        text += ", no conflicts"
    if d["written"]:
        return f"wrote {d['output']} ({d['bytes']} bytes): {text}"
    return f"would write {d['output']} ({d['format']}): {text} (dry run, nothing written)"


# ----------------------------------------------------------------------------- split


def split_view(d: dict) -> list:
    out: list = []
    table = Table(header_style="bold", pad_edge=False)
    for col in ("part", "patterns", "params", "groups", "tensor bytes", "output"):
        table.add_column(col, justify="right" if col in ("params", "groups", "tensor bytes") else "left")
    for part in d["parts"]:
        table.add_row(part["name"], ", ".join(part["patterns"]), str(part["params"]), str(part["groups"]),
                      str(part["tensor_bytes"]), part["output"])
    out.append(table)
    for w in d["warnings"]:
        out.append(Text(f"warning: {w}", style="yellow"))
    out.append(Text(split_summary(d), style="bold"))
    return out


def split_summary(d: dict) -> str:
    text = f"{d['params']} {d['family']} parameters of {d['input']} into {len(d['parts'])} parts ({d['format']})"
    if d["written"]:
        return f"wrote {len(d['parts'])} files in {d['output_dir']} ({d['bytes']} bytes): {text}"
    if d["dry_run"]:
        return f"would write {text} (dry run, nothing written)"
    return f"writing {text}"


def split_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    return (["part", "parameter", "selected_by", "output"],
            [[part["name"], m["name"], m["by"], part["output"]] for part in d["parts"] for m in part["members"]])


# ----------------------------------------------------------------------------- fit


def _fit_rows(d: dict) -> list[tuple[str, str, str, str, str]]:
    """(parameter, action, position, old position, group), in the new optimizer's order, dropped last."""
    rows = [(k["name"], "kept", str(k["position"]), str(k["old_position"]), k["group"]) for k in d["kept"]]
    rows += [(n["name"], "new", str(n["position"]), "-", n["group"]) for n in d["new"]]
    rows.sort(key=lambda r: int(r[2]))
    return rows + [(name, "dropped", "-", "-", "-") for name in d["dropped"]]


def fit_view(d: dict) -> list:
    out: list = []
    table = Table(header_style="bold", pad_edge=False)
    for col in ("parameter", "action", "position", "was", "group"):
        table.add_column(col, justify="right" if col in ("position", "was") else "left")
    for row in _fit_rows(d):
        table.add_row(*row)
    out.append(table)
    for g in d["groups"]:
        shown = ", ".join(f"{k}={v}" for k, v in g["hyperparams"].items() if k in ("lr", "betas", "weight_decay",
                                                                                  "momentum", "eps", "nesterov"))
        out.append(Text(f"group {g['name']}: {g['params']} parameters ({shown})"))
    for w in d["warnings"]:
        out.append(Text(f"warning: {w}", style="yellow"))
    out.append(Text(fit_summary(d), style="bold"))
    return out


def fit_summary(d: dict) -> str:
    groups = len(d["groups"])
    text = (f"{len(d['kept'])} kept, {len(d['new'])} new, {len(d['dropped'])} dropped: {d['params']} {d['family']} "
            f"parameter{'s' if d['params'] != 1 else ''} in {groups} group{'s' if groups != 1 else ''}")
    if d["written"]:
        return f"wrote {d['output']} ({d['bytes']} bytes): {text}"
    if d["dry_run"]:
        return f"would write {d['output']}: {text} (dry run, nothing written)"
    return f"writing {d['output']}: {text}"


def fit_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    return (["parameter", "action", "position", "old_position", "group"], [list(r) for r in _fit_rows(d)])


# ----------------------------------------------------------------------------- doctor

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def doctor_view(d: dict) -> list:
    out: list = []
    if d["findings"]:
        table = Table(header_style="bold", pad_edge=False)
        table.add_column("severity", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("parameter", no_wrap=True)
        table.add_column("finding")
        why: dict[str, str] = {}
        for f in d["findings"]:
            table.add_row(Text(f["severity"], style=_SEVERITY_STYLE.get(f["severity"], "")), f["check"],
                          f["param"] or "-", f["message"])
            why.setdefault(f["check"], f["why"])
        out.append(table)
        out.append(Text("why it matters at resume:", style="bold"))
        for check, reason in why.items():
            out.append(Text(f"  {check}: {reason}"))
    for note in d["notes"]:
        out.append(Text(f"note: {note}", style="cyan"))
    out.append(Text(doctor_summary(d), style="bold green" if d["clean"] else "bold red"))
    return out


def doctor_summary(d: dict) -> str:
    c = d["counts"]
    against = ""
    if d["model"]:
        how = METHOD_WORDS.get(d["matched_by"], d["matched_by"])
        against = f" against {d['model']} ({d['model_params']} model parameters, matched by {how})"
    checked = f"{d['params']} parameters{against}"
    if d["clean"]:
        info = f"; {c['info']} note{'s' if c['info'] != 1 else ''}" if c["info"] else ""
        return f"{d['state']}: no problems found in {checked}{info}"
    parts = [f"{c[k]} {k}{'s' if c[k] != 1 else ''}" for k in ("error", "warning", "info") if c[k]]
    problems = c["error"] + c["warning"]
    return f"{d['state']}: {problems} problem{'s' if problems != 1 else ''} ({', '.join(parts)}) in {checked}"


# ----------------------------------------------------------------------------- verify-resume


def verify_view(report: dict) -> list:
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
        if r.get("state_bit_exact") is False:
            # the parameter agrees, the state the steps left does not: a divergence, unless the
            # migration itself was lossy and the state is within tolerance
            result = "state within tolerance" if r["tracks"] else "DIVERGES (state)"
        if r.get("reset"):
            result += " (cold start)"
        if "kept" in r:
            result += f" on {'×'.join(map(str, r['kept']))}; new {'fresh' if r['new_elements_fresh'] else 'NOT FRESH'}"
        path = r["path"] + (f" → {r['migrated_path']}" if r.get("migrated_path") else "")
        table.add_row(path, "yes" if r["has_state"] else "MISSING", "transposed" if r["transposed"] else "same",
                      result, f"{r['max_abs_diff']:.3g}", f"{r['tolerance_ratio']:.3g}", f"{r['cold_ratio']:.3g}",
                      style=None if r["tracks"] else "red")
    items = [head, sub, table]
    first = next((r for r in report["params"] if not r["tracks"] and "first_difference" in r), None)
    if first is not None:  # where the first diverging parameter parts from the original run
        d = first["first_difference"]
        items.append(Text(f"first divergence: {first['path']} element {d['element']}"
                          + (f" (from {d['from']})" if d.get("from") else "")
                          + f": {d['original']!r} in the original run, {d['migrated']!r} resumed", style="red"))
    a, b = report["hyperparams"]["original"], report["hyperparams"]["migrated"]
    differ = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if differ:
        items.append(Text("hyperparameters differ: " + "; ".join(differ), style="yellow"))
    for note in report.get("notes", []):
        items.append(Text(f"note: {note}", style="cyan"))
    return items


# ----------------------------------------------------------------------------- replay


def replay_view(result: dict) -> list:
    shown = ", ".join(f"{k}={v}" for k, v in result["hyperparams"].items())
    wrote = f"wrote {result['out_params']}" + (f" and {result['out_state']}" if result["out_state"] else "")
    kernel = f", {result['kernel']} kernel" if result.get("kernel") else ""
    return [f"replayed {result['steps']} steps of {result['optimizer']} ({result['flavor']} arithmetic, "
            f"{result['exactness']}{kernel}): {shown}", wrote]


# ----------------------------------------------------------------------------- TSV


def diff_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    return (["parameter", "field", "difference", "a", "b", "max_abs", "max_rel", "max_ulp", "elements"],
            diff_rows(d))


def merge_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    return (["input", "format", "family", "params", "taken"],
            [[i["path"], i["format"], i["family"] or "-", i["params"], i["taken"]] for i in d["inputs"]])


def doctor_tsv(d: dict) -> tuple[list[str], list[list[str]]]:
    return (["severity", "check", "parameter", "finding"],
            [[f["severity"], f["check"], f["param"] or "-", f["message"]] for f in d["findings"]])


def verify_tsv(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["parameter", "has_state", "transposed", "tracks", "bit_exact", "max_abs_diff", "tolerance_ratio",
              "cold_ratio"]
    return header, [[r["path"], r["has_state"], r["transposed"], r["tracks"], r["bit_exact"],
                     f"{r['max_abs_diff']:.6g}", f"{r['tolerance_ratio']:.6g}", f"{r['cold_ratio']:.6g}"]
                    for r in report["params"]]


def replay_tsv(result: dict) -> tuple[list[str], list[list[str]]]:
    return ["parameter", "steps"], [[name, n] for name, n in result["step_counts"].items()]
