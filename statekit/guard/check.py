"""The live optimizer (and scheduler) compared with the fingerprint saved at save time."""

from __future__ import annotations

import math
import os
import warnings

from statekit.errors import UsageError
from statekit.guard.fingerprint import VERSION, fingerprint, load_fingerprint
from statekit.guard.report import KINDS, Problem, Report, ResumeError, ResumeWarning

EXPECTS = ("state", "fresh")


def _has_state(entry: dict) -> bool:
    st = entry.get("state")
    if not st:
        return False
    if st.get("step"):
        return True
    return any(f.get("sampled") and f.get("zeros", 0) < f["sampled"] for f in st["fields"].values())


def _all_zero(f: dict) -> bool:
    return bool(f.get("sampled")) and f.get("zeros") == f["sampled"]


def _by_name(params: list[dict]) -> dict[str, dict]:
    return {p["name"]: p for p in params}


def _positional(params: list[dict]) -> bool:
    return any(p["name"].startswith("#") for p in params)


def _step(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


def _compare_optimizer(saved: dict, live: dict, expect: str, label: str) -> list[Problem]:
    problems: list[Problem] = []
    positional = _positional(saved["params"]) or _positional(live["params"])
    key = (lambda p: f"#{p['index']}") if positional else (lambda p: p["name"])
    s_by = {key(p): p for p in saved["params"]}
    l_by = {key(p): p for p in live["params"]}
    gone = [k for k in s_by if k not in l_by]
    new = [k for k in l_by if k not in s_by]
    if gone:
        problems.append(Problem("layout", gone, f"{label}saved for parameters the live optimizer does not hold"))
    if new:
        problems.append(Problem("layout", new, f"{label}the live optimizer holds parameters nothing was saved for"))
    shaped = [k for k in s_by if k in l_by and s_by[k]["shape"] != l_by[k]["shape"]]
    if shaped:
        problems.append(Problem("layout", shaped, f"{label}shapes differ from those saved"))
    both = [k for k in s_by if k in l_by]
    if expect == "fresh":
        restored = [k for k in both if _has_state(l_by[k])] + [k for k in new if _has_state(l_by[k])]
        if restored:
            same = [k for k in restored if k in s_by and _same_state(s_by[k], l_by[k])]
            detail = f"{label}{KINDS['restored']}"
            if same:
                detail += f" ({len(same)} of them exactly the state saved)"
            problems.append(Problem("restored", restored, detail))
        return problems
    # digests that name one saved parameter (all-zero or constant samples name none)
    owners: dict[tuple[str, str], list[str]] = {}
    for k, p in s_by.items():
        for f, facts in ((p.get("state") or {}).get("fields") or {}).items():
            if facts.get("digest") and not _all_zero(facts):
                owners.setdefault((f, facts["digest"]), []).append(k)
    empty, zero, moved, values, steps = [], [], [], [], []
    for k in both:
        came: dict[str, str] = {}  # field → the saved parameter whose state it holds
        s, lv = s_by[k].get("state"), l_by[k].get("state")
        if not s:
            if lv and _has_state(l_by[k]):  # nothing was saved for it, yet it holds state: whose?
                srcs = {o for f, lf in lv["fields"].items() for o in owners.get((f, lf.get("digest")), [])} - {k}
                if len(srcs) == 1:
                    moved.append(f"{k} ← {srcs.pop()}")
                else:
                    values.append(f"{k} (no state was saved for it)")
            continue
        if not lv or not lv["fields"] and s["fields"]:
            empty.append(k)
            continue
        if s.get("step") != lv.get("step"):
            steps.append(f"{k} ({_step(s.get('step'))} → {_step(lv.get('step'))})")
        for f, sf in s["fields"].items():
            lf = lv["fields"].get(f)
            if lf is None:
                empty.append(f"{k}.{f}")
                continue
            if "value" in sf or sf.get("digest") == lf.get("digest"):
                if "value" in sf and sf["value"] != lf.get("value"):
                    values.append(f"{k}.{f}")
                continue
            if _all_zero(lf) and not _all_zero(sf):
                zero.append(f"{k}.{f}")
                continue
            other = [o for o in owners.get((f, lf.get("digest")), []) if o != k]
            if len(other) == 1:
                came[f] = other[0]
            else:
                cast = f" as {lf['dtype']} (saved {sf['dtype']})" if lf.get("dtype") != sf.get("dtype") else ""
                values.append(f"{k}.{f}{cast}")
        if came and len(set(came.values())) == 1 and set(came) == set(s["fields"]):
            moved.append(f"{k} ← {next(iter(came.values()))}")
        else:
            moved += [f"{k}.{f} ← {src}" for f, src in came.items()]
    for kind, who in (("empty", empty), ("zero", zero), ("moved", moved), ("values", values)):
        if who:
            problems.append(Problem(kind, who, f"{label}{KINDS[kind]}"))
    if steps:
        problems.append(Problem("step", steps, f"{label}{KINDS['step']} (saved → live)"))
    problems += _compare_groups(saved["groups"], live["groups"], positional, label)
    return problems


def _same_state(s: dict, lv: dict) -> bool:
    a, b = s.get("state"), lv.get("state")
    if not a or not b or a.get("step") != b.get("step"):
        return False
    return all(b["fields"].get(f, {}).get("digest") == sf.get("digest") for f, sf in a["fields"].items())


def _compare_groups(saved: list[dict], live: list[dict], positional: bool, label: str) -> list[Problem]:
    problems = []
    if len(saved) != len(live):
        return [Problem("groups", [], f"{label}{len(saved)} param groups saved, {len(live)} live")]
    if not positional:
        s_sets = [set(g["params"]) for g in saved]
        l_sets = [set(g["params"]) for g in live]
        if s_sets != l_sets:
            if sorted(map(sorted, s_sets)) == sorted(map(sorted, l_sets)):
                order = [s_sets.index(ls) for ls in l_sets]
                problems.append(Problem("groups", [], f"{label}param groups reordered: live groups "
                                                      f"{list(range(len(live)))} are the saved groups {order}"))
            else:
                moved = sorted({n for s, lv in zip(s_sets, l_sets, strict=True) for n in s ^ lv})
                problems.append(Problem("groups", moved, f"{label}parameters in another param group than saved"))
        elif [g["params"] for g in saved] != [g["params"] for g in live]:
            moved = [n for s, lv in zip(saved, live, strict=True) for n, m in zip(s["params"], lv["params"],
                                                                                  strict=False) if n != m]
            problems.append(Problem("groups", moved, f"{label}parameters in another order within their group"))
    changes = []
    for g, (s, lv) in enumerate(zip(saved, live, strict=True)):
        for k in sorted(set(s["hyper"]) | set(lv["hyper"])):
            a, b = s["hyper"].get(k), lv["hyper"].get(k)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-12)):
                changes.append(f"group {g} {k} {a!r} → {b!r}")
    if changes:
        problems.append(Problem("hyper", [], f"{label}{KINDS['hyper']}: {', '.join(changes)}"))
    return problems


def _compare_schedulers(saved: list[dict], live: list[dict]) -> list[Problem]:
    if not saved or not live:
        return []
    if len(saved) != len(live):
        return [Problem("scheduler", [], f"{len(saved)} schedulers saved, {len(live)} live")]
    changes = []
    for i, (s, lv) in enumerate(zip(saved, live, strict=True)):
        label = f"scheduler {i} " if len(saved) > 1 else ""
        for k, a in s["state"].items():
            b = lv["state"].get(k)
            if a != b:
                changes.append(f"{label}{k} {a!r} → {b!r}")
    return [Problem("scheduler", [], f"{KINDS['scheduler']}: {', '.join(changes)}")] if changes else []


def compare(saved: dict, live: dict, *, expect: str = "state") -> list[Problem]:
    """The problems of ``live`` against ``saved`` (two :func:`fingerprint` results)."""
    if expect not in EXPECTS:
        raise UsageError(f"expect={expect!r}: say 'state' (a full resume) or 'fresh' (weights only)")
    problems = []
    so, lo = saved["optimizers"], live["optimizers"]
    if len(so) != len(lo):
        return [Problem("layout", [], f"{len(so)} optimizers saved, {len(lo)} live")]
    for i, (s, lv) in enumerate(zip(so, lo, strict=True)):
        problems += _compare_optimizer(s, lv, expect, f"optimizer {i}: " if len(so) > 1 else "")
    if expect == "state":
        problems += _compare_schedulers(saved.get("schedulers") or [], live["schedulers"])
    return problems


def check_resume(optimizer, where: str | os.PathLike, *, scheduler=None, model=None, expect: str = "state",
                 on_problem: str = "raise", allow: tuple[str, ...] | list[str] = ()) -> Report:
    """Compare the live ``optimizer`` (and ``scheduler``) with the fingerprint saved for ``where``.

    ``expect="state"``: a full resume, everything must be as saved; ``"fresh"``: a weights-only
    resume, the optimizer must hold no state. ``allow``: problem kinds to let through (for a
    deliberate change, such as ``("hyper",)`` after setting a new lr). ``on_problem``: ``"raise"``
    (:class:`ResumeError`) or ``"warn"`` (:class:`ResumeWarning`)."""
    _options(on_problem, allow)
    saved, path = load_fingerprint(where)
    return check_fingerprint(saved, optimizer, scheduler=scheduler, model=model, expect=expect,
                             on_problem=on_problem, allow=allow, where=path)


def _options(on_problem: str, allow) -> None:
    if on_problem not in ("raise", "warn"):
        raise UsageError(f"on_problem={on_problem!r}: say 'raise' or 'warn'")
    unknown = sorted(set(allow) - set(KINDS))
    if unknown:
        raise UsageError(f"allow={unknown}: not problem kinds (known: {', '.join(KINDS)})")


def check_fingerprint(saved: dict, optimizer, *, scheduler=None, model=None, expect: str = "state",
                      on_problem: str = "raise", allow: tuple[str, ...] | list[str] = (),
                      where: str = "the checkpoint") -> Report:
    """:func:`check_resume` against a fingerprint already in hand (Lightning keeps it in the checkpoint)."""
    _options(on_problem, allow)
    if not isinstance(saved, dict) or saved.get("statekit_guard") != VERSION:
        raise ResumeError(f"not a statekit guard fingerprint of version {VERSION}", where)
    live = fingerprint(optimizer, scheduler=scheduler, model=model)
    found = compare(saved, live, expect=expect)
    report = Report(where, [p for p in found if p.kind not in allow], [p for p in found if p.kind in allow],
                    checked=sum(len(o["params"]) for o in live["optimizers"]))
    if report.problems:
        if on_problem == "raise":
            raise ResumeError(report.message(), where, report.problems)
        warnings.warn(f"{where}: {report.message()}", ResumeWarning, stacklevel=3)
    return report
