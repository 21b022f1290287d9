"""The resume guard: catch optimizer state lost or misplaced at the moment a run resumes.

At save, :func:`save_fingerprint` writes a small JSON file beside the checkpoint: per parameter
its name, shape, step and, for every state tensor, a few statistics and a digest of
:data:`SAMPLE` elements taken at fixed positions; each param group's hyperparameters and members;
the LR scheduler's position. Right after the load, :func:`check_resume` fingerprints the live
optimizer (and scheduler) the same way and compares: state that is empty or all zero where it
was not, steps reset or changed, groups reordered or with another lr, and a parameter holding
the state saved for another one (its digest is the other's). It raises :class:`ResumeError`
naming the parameters (or warns, ``on_problem="warn"``). ``expect="fresh"`` checks the opposite
intent: a weights-only resume after which the optimizer holds state anyway.

Parameters are named from ``model`` (``named_parameters()``), else from the groups'
``param_names`` (torch >= 2.6 with named parameters), else by position (``#3``): without names,
a changed order cannot be seen, only lost or reset state.

Ready-made: :mod:`statekit.guard.hf` (a transformers ``TrainerCallback``),
:mod:`statekit.guard.accelerate` (Accelerate's save/load state hooks),
:mod:`statekit.guard.lightning` (a Lightning ``Callback``). torch is imported here only when a
function runs, and statekit never imports this package at start-up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field

from statekit.errors import StatekitError, UsageError

FILE = "statekit-guard.json"
VERSION = 1
SAMPLE = 16  # elements sampled per state tensor, at fixed evenly spaced positions
MAX_NAMED = 8
EXPECTS = ("state", "fresh")
# prefixes wrappers add to parameter names (DDP's module., torch.compile's _orig_mod.)
WRAPPERS = ("module.", "_orig_mod.")

KINDS = {
    "empty": "no optimizer state after the load: moments and step restart from zero",
    "zero": "moments all zero after the load (the sampled elements were not at save)",
    "step": "step counter differs from the one saved",
    "moved": "holds the state saved for another parameter (a changed order)",
    "values": "moments differ from those saved",
    "layout": "parameters differ from those saved",
    "groups": "param groups differ from those saved",
    "hyper": "param group hyperparameters differ from those saved",
    "scheduler": "LR scheduler position differs from the one saved",
    "restored": "a weights-only resume, but the optimizer holds state",
}


class ResumeError(StatekitError):
    """The live optimizer (or scheduler) does not hold what was saved: ``problems`` name the parameters."""

    def __init__(self, message: str, path: str | None = None, problems: list[Problem] | None = None):
        super().__init__(message, path)
        self.problems = problems or []


class ResumeWarning(UserWarning):
    """What :class:`ResumeError` says, as a warning (``on_problem="warn"``)."""


@dataclass
class Problem:
    kind: str
    params: list[str] = field(default_factory=list)
    detail: str = ""

    def line(self) -> str:
        who = ""
        if self.params:
            more = f" (+{len(self.params) - MAX_NAMED} more)" if len(self.params) > MAX_NAMED else ""
            who = f" [{', '.join(self.params[:MAX_NAMED])}{more}]"
        return f"{self.kind}: {self.detail or KINDS[self.kind]}{who}"


@dataclass
class Report:
    """What :func:`check_resume` found; ``ok`` when nothing (or only what ``allow`` lets through)."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    allowed: list[Problem] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        n = len(self.problems)
        return (f"the resume does not hold the optimizer state saved beside it ({n} problem{'s' if n > 1 else ''}): "
                + "; ".join(p.line() for p in self.problems))


# ----------------------------------------------------------------------------- fingerprints

def _name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _unwrap(optimizer):
    """The torch optimizer inside a wrapper (Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def _index_cache():
    cache: dict = {}

    def index(torch, n: int, device):
        key = (n, str(device))
        if key not in cache:
            cache[key] = torch.linspace(0, n - 1, SAMPLE, dtype=torch.float64).round().long().to(device)
        return cache[key]

    return index


_INDEX = _index_cache()
_DTYPES: dict = {}


def _tensor_facts(torch, t, pending: list) -> dict:
    """A state tensor's facts; its sampled elements are queued on ``pending`` (:func:`_settle` fills in
    their statistics and digest, all tensors at once: a few torch calls per state, not per tensor)."""
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
        t = t.to_local()
    n = t.numel()
    dtype = _DTYPES.get(t.dtype) or _DTYPES.setdefault(t.dtype, str(t.dtype).removeprefix("torch."))
    facts = {"dtype": dtype, "shape": list(t.shape)}
    if n == 0:
        return facts | {"digest": "", "sampled": 0}
    # torch.take reads flat (row-major) positions of any layout: one call, no reshape
    pending.append((facts, torch.take(t, _INDEX(torch, n, t.device)) if n > SAMPLE else t.reshape(-1)))
    return facts


def _settle(torch, pending: list) -> None:
    """Statistics and digests of the queued samples, stacked by dtype and length."""
    batches: dict = {}
    for facts, sample in pending:
        batches.setdefault((sample.dtype, sample.numel(), sample.device), []).append((facts, sample))
    for (_dtype, k, _device), items in batches.items():
        stacked = torch.stack([s for _, s in items]).cpu()
        raw = stacked.view(torch.uint8).numpy()
        values = (stacked.abs() if stacked.is_complex() else stacked).double()
        finite = torch.isfinite(values)
        mags = torch.where(finite, values.abs(), torch.zeros((), dtype=torch.float64))
        counted = finite.sum(1)
        stats = torch.stack([(values == 0).sum(1).double(), k - counted.double(), mags.sum(1), mags.amax(1)], 1)
        for (facts, _), row, (zeros, nonfinite, total, top), finite_n in zip(items, raw, stats.tolist(),
                                                                             counted.tolist(), strict=True):
            facts.update(digest=hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest(), sampled=k,
                         zeros=int(zeros), nonfinite=int(nonfinite),
                         absmean=total / finite_n if finite_n else None, absmax=top if finite_n else None)


def _plain(value):
    """A hyperparameter as JSON keeps it (tensors as numbers, tuples as lists); None when it cannot."""
    if hasattr(value, "item") and hasattr(value, "numel"):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    return None


def _optimizer_fingerprint(torch, optimizer, names: dict[int, str], pending: list) -> dict:
    optimizer = _unwrap(optimizer)
    params, groups = [], []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        members = []
        for j, p in enumerate(group["params"]):
            name = names.get(id(p)) or (_name(given[j]) if given and j < len(given) else None) or f"#{index}"
            members.append(name)
            st = optimizer.state.get(p)
            entry = {"name": name, "index": index, "group": g, "shape": list(p.shape), "state": None}
            if st:
                step = st.get("step")
                fields = {}
                for k, v in st.items():
                    if k == "step":
                        continue
                    if torch.is_tensor(v):
                        fields[k] = _tensor_facts(torch, v, pending)
                    elif (pv := _plain(v)) is not None:
                        fields[k] = {"value": pv}
                entry["state"] = {"step": float(step) if step is not None else None, "fields": fields}
            params.append(entry)
            index += 1
        hyper = {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({"params": members, "hyper": {k: v for k, v in hyper.items() if v is not None}})
    return {"class": type(optimizer).__name__, "params": params, "groups": groups}


def _scheduler_fingerprint(scheduler) -> dict:
    sd = scheduler.state_dict() if hasattr(scheduler, "state_dict") else {}
    keep = {k: _plain(v) for k, v in sd.items() if k in ("last_epoch", "_step_count", "_last_lr", "base_lrs")}
    return {"class": type(scheduler).__name__, "state": {k: v for k, v in keep.items() if v is not None}}


def _listed(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def _names(models) -> dict[int, str]:
    out: dict[int, str] = {}
    for m in models:
        for name, p in m.named_parameters():
            out.setdefault(id(p), _name(name))
    return out


def fingerprint(optimizer, *, scheduler=None, model=None) -> dict:
    """The fingerprint of live optimizers (one, or a list) and schedulers, as :func:`save_fingerprint` writes it."""
    import torch

    names = _names(_listed(model))
    pending: list = []
    with torch.no_grad():
        optimizers = [_optimizer_fingerprint(torch, o, names, pending) for o in _listed(optimizer)]
        _settle(torch, pending)
    return {"statekit_guard": VERSION, "sample": SAMPLE, "optimizers": optimizers,
            "schedulers": [_scheduler_fingerprint(s) for s in _listed(scheduler)]}


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fingerprint_path(where: str | os.PathLike) -> str:
    """Where the fingerprint for ``where`` lives: inside a checkpoint folder, beside a checkpoint file
    (``ckpt.pt`` → ``ckpt.pt.statekit-guard.json``), or ``where`` itself when it ends in ``.json``; one
    file per rank when several ranks run."""
    where = os.fspath(where)
    if where.endswith(".json"):
        path = where
    elif os.path.isdir(where) or not os.path.splitext(where)[1]:
        path = os.path.join(where, FILE)
    else:
        path = f"{where}.{FILE}"
    rank, world = _rank()
    return path if world == 1 else f"{path[:-5]}-rank{rank}.json"


def save_fingerprint(optimizer, where: str | os.PathLike, *, scheduler=None, model=None) -> str:
    """Write the fingerprint of ``optimizer`` (and ``scheduler``, named through ``model``) for the
    checkpoint at ``where``; returns the file written."""
    path = fingerprint_path(where)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = json.dumps(fingerprint(optimizer, scheduler=scheduler, model=model), separators=(",", ":"))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data)
    os.replace(tmp, path)
    return path


def load_fingerprint(where: str | os.PathLike) -> tuple[dict, str]:
    path = fingerprint_path(where)
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except FileNotFoundError:
        raise ResumeError("no fingerprint to check the resume against (save_fingerprint writes it at save)",
                          path) from None
    except (OSError, ValueError) as exc:
        raise ResumeError(f"not a statekit guard fingerprint: {exc}", path) from None
    if not isinstance(saved, dict) or saved.get("statekit_guard") != VERSION:
        raise ResumeError(f"not a statekit guard fingerprint of version {VERSION}", path)
    return saved, path


# ----------------------------------------------------------------------------- comparing

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


__all__ = ["FILE", "KINDS", "Problem", "Report", "ResumeError", "ResumeWarning", "check_fingerprint", "check_resume",
           "compare", "fingerprint", "fingerprint_path", "load_fingerprint", "save_fingerprint"]
