"""torch.optim.lr_scheduler (2.13) as pure functions of a scheduler's state_dict: no torch.

Each class's ``step()`` is reproduced operation for operation (the same float expressions in the
same order, so the lrs are bit-identical to torch's), including the chainable ``get_lr`` forms
that compute the next lr from the param group's current lr: :func:`step` takes a copy of the
state_dict and of the param groups (dicts with ``lr`` and, for OneCycleLR, ``initial_lr`` /
``max_lr`` / ``min_lr``) and returns both as torch leaves them. :func:`closed_form` is the lr at a
given ``last_epoch`` from ``base_lrs`` alone, for the classes that have one (torch's
``_get_closed_form_lr``, CyclicLR's and CosineAnnealingWarmRestarts' formulas); it differs from
the chainable form where the group lr was changed by anything else (pytorch#29697).

Facts and sources: ``../shared/docs/schedules-and-resume.md`` §1.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from statekit.errors import MappingError

# the classes whose ``_update_lr(epoch)`` (SequentialLR at a milestone) uses the closed form
CLOSED_FORM = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
               "CosineAnnealingLR")
CLASSES = ("LambdaLR", "MultiplicativeLR", *CLOSED_FORM, "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
           "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau")
# chainable: the next lr is computed from the group's current lr (a wrong group lr scales every later one)
RECURSIVE = ("MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
             "CosineAnnealingLR", "ReduceLROnPlateau")


class NotComputable(MappingError):
    """The lr cannot be computed from the saved state (a lambda, a custom scale function, a metric)."""


def _lrs(groups: list[dict]) -> list:
    return [g["lr"] for g in groups]


def get_lr(cls: str, st: dict, groups: list[dict], lambdas=None) -> list:
    """torch's ``get_lr()`` of class ``cls`` with ``st['last_epoch']`` already advanced."""
    t = st["last_epoch"]
    initial = st.get("_is_initial", False)
    if cls == "LambdaLR":
        if lambdas is None:
            raise NotComputable("LambdaLR's functions are not saved (state_dict keeps only a callable object's "
                                "__dict__): the lr depends on code statekit does not have")
        return [base * lam(t) for lam, base in zip(lambdas, st["base_lrs"], strict=True)]
    if cls == "MultiplicativeLR":
        if initial:
            return _lrs(groups)
        if lambdas is None:
            raise NotComputable("MultiplicativeLR's functions are not saved (state_dict keeps only a callable "
                                "object's __dict__): the lr depends on code statekit does not have")
        return [g["lr"] * lam(t) for lam, g in zip(lambdas, groups, strict=True)]
    if cls == "StepLR":
        if t == 0 or t % st["step_size"] != 0:
            return _lrs(groups)
        return [g["lr"] * st["gamma"] for g in groups]
    if cls == "MultiStepLR":
        milestones = st["milestones"]
        if t not in milestones:
            return _lrs(groups)
        return [g["lr"] * st["gamma"] ** milestones[t] for g in groups]
    if cls == "ConstantLR":
        if t == 0:
            return [g["lr"] * st["factor"] for g in groups]
        if t != st["total_iters"]:
            return _lrs(groups)
        return [g["lr"] * (1.0 / st["factor"]) for g in groups]
    if cls == "LinearLR":
        s, e, n = st["start_factor"], st["end_factor"], st["total_iters"]
        if t == 0:
            return [g["lr"] * s for g in groups]
        if initial or t > n:
            return _lrs(groups)
        return [g["lr"] * (1.0 + (e - s) / (n * s + (t - 1) * (e - s))) for g in groups]
    if cls == "ExponentialLR":
        return _lrs(groups) if initial else [g["lr"] * st["gamma"] for g in groups]
    if cls == "PolynomialLR":
        n = st["total_iters"]
        if initial or t > n:
            return _lrs(groups)
        decay = ((1.0 - t / n) / (1.0 - (t - 1) / n)) ** st["power"]
        return [g["lr"] * decay for g in groups]
    if cls == "CosineAnnealingLR":
        return _cosine_get_lr(st, groups)
    if cls == "CosineAnnealingWarmRestarts":
        return [st["eta_min"] + (base - st["eta_min"]) * (1 + math.cos(math.pi * st["T_cur"] / st["T_i"])) / 2
                for base in st["base_lrs"]]
    if cls == "CyclicLR":
        return _cyclic(st, t)
    if cls == "OneCycleLR":
        return _one_cycle(st, groups, t)
    raise MappingError(f"no get_lr for torch scheduler {cls}")


def _cosine_get_lr(st: dict, groups: list[dict]) -> list:
    t, T, eta = st["last_epoch"], st["T_max"], st["eta_min"]
    if st.get("_is_initial", False):
        return _lrs(groups)
    if st["_step_count"] == 1 and t > 0:
        return [eta + (base - eta) * (1 + math.cos(t * math.pi / T)) / 2 for base in st["base_lrs"]]
    if (t - 1 - T) % (2 * T) == 0:
        return [g["lr"] + (base - eta) * (1 - math.cos(math.pi / T)) / 2
                for base, g in zip(st["base_lrs"], groups, strict=True)]
    return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (g["lr"] - eta) + eta
            for g in groups]


def _cyclic(st: dict, t: int) -> list:
    if st.get("_scale_fn_custom") is not None:
        raise NotComputable("CyclicLR's custom scale_fn is not saved: the lr depends on code statekit does not have")
    mode, gamma = st["mode"], st["gamma"]
    scale_mode = "iterations" if mode == "exp_range" else "cycle"

    def scale_fn(x):
        if mode == "triangular":
            return 1.0
        if mode == "triangular2":
            return 1 / 2.0 ** (x - 1)
        return gamma ** x

    cycle = math.floor(1 + t / st["total_size"])
    x = 1.0 + t / st["total_size"] - cycle
    ratio = st["step_ratio"]
    scale_factor = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
    out = []
    for base, top in zip(st["base_lrs"], st["max_lrs"], strict=True):
        height = (top - base) * scale_factor
        out.append(base + height * scale_fn(cycle if scale_mode == "cycle" else t))
    return out


def _anneal(kind: str, start, end, pct):
    if kind == "cos":
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (end - start) * pct + start


def _one_cycle(st: dict, groups: list[dict], t: int) -> list:
    if t > st["total_steps"]:
        raise NotComputable(f"OneCycleLR ends after {st['total_steps']} steps: torch raises ValueError "
                            f"('Tried to step {t} times') at this step")
    phases = st["_schedule_phases"]
    out = []
    for g in groups:
        missing = [k for ph in phases for k in (ph["start_lr"], ph["end_lr"]) if k not in g]
        if missing:
            raise NotComputable(f"OneCycleLR computes its lr from the param groups' {', '.join(dict.fromkeys(missing))}"
                                ", which are in the optimizer's file, not the scheduler's")
        start = 0.0
        for i, ph in enumerate(phases):
            end = ph["end_step"]
            if t <= end or i == len(phases) - 1:
                out.append(_anneal(st["_anneal_func_type"], g[ph["start_lr"]], g[ph["end_lr"]],
                                   (t - start) / (end - start)))
                break
            start = ph["end_step"]
    return out


def closed_form(cls: str, st: dict, t: int, groups: list[dict] | None = None) -> list | None:
    """The lr at ``last_epoch == t`` from the saved parameters alone (None: the class has none)."""
    b = st.get("base_lrs")
    if cls == "StepLR":
        return [base * st["gamma"] ** (t // st["step_size"]) for base in b]
    if cls == "MultiStepLR":
        milestones = sorted(k for k, n in st["milestones"].items() for _ in range(n))
        return [base * st["gamma"] ** bisect_right(milestones, t) for base in b]
    if cls == "ConstantLR":
        return [base * (st["factor"] + (t >= st["total_iters"]) * (1 - st["factor"])) for base in b]
    if cls == "LinearLR":
        s, e, n = st["start_factor"], st["end_factor"], st["total_iters"]
        return [base * (s + (e - s) * min(n, t) / n) for base in b]
    if cls == "ExponentialLR":
        return [base * st["gamma"] ** t for base in b]
    if cls == "PolynomialLR":
        return [base * (1.0 - min(st["total_iters"], t) / st["total_iters"]) ** st["power"] for base in b]
    if cls == "CosineAnnealingLR":
        eta = st["eta_min"]
        return [eta + (base - eta) * (1 + math.cos(math.pi * t / st["T_max"])) / 2 for base in b]
    if cls == "CyclicLR":
        return _cyclic(st, t)
    if cls == "OneCycleLR" and groups is not None:
        return _one_cycle(st, groups, t)
    if cls == "CosineAnnealingWarmRestarts":
        t_cur, t_i = _warm_restart_position(st, t)
        eta = st["eta_min"]
        return [eta + (base - eta) * (1 + math.cos(math.pi * t_cur / t_i)) / 2 for base in b]
    return None


def _warm_restart_position(st: dict, epoch: int) -> tuple[float, float]:
    """``(T_cur, T_i)`` at ``epoch`` (torch's ``step(epoch)``)."""
    t0, mult = st["T_0"], st["T_mult"]
    if epoch < t0:
        return epoch, t0
    if mult == 1:
        return epoch % t0, t0
    n = int(math.log(epoch / t0 * (mult - 1) + 1, mult))
    return epoch - t0 * (mult ** n - 1) / (mult - 1), t0 * mult ** n


def step(cls: str, st: dict, groups: list[dict], lambdas=None) -> tuple[dict, list[dict]]:
    """One ``scheduler.step()``: the new state_dict and param groups (copies; ``_last_lr`` is the lr
    the update after it uses). ReduceLROnPlateau needs a metric: :func:`plateau_step`."""
    st = {k: (list(v) if isinstance(v, list) else v) for k, v in st.items()}
    groups = [dict(g) for g in groups]
    if cls == "SequentialLR":
        return _sequential(st, groups)
    if cls == "ChainedScheduler":
        children = []
        for child in st["_schedulers"]:
            child_st, groups = step(_class_of(child), child, groups)
            children.append(child_st)
        st["_schedulers"], st["_last_lr"] = children, _lrs(groups)
        return st, groups
    if cls == "ReduceLROnPlateau":
        raise NotComputable("ReduceLROnPlateau steps on a metric: its next lr depends on the next evaluation")
    if cls == "CosineAnnealingWarmRestarts":
        st["_step_count"] = st.get("_step_count", 0)  # (its step() never counts)
        if st["last_epoch"] < 0:
            st["T_i"], st["T_cur"], epoch = st["T_0"], 0, 0
        else:
            epoch = st["last_epoch"] + 1
            st["T_cur"] = st["T_cur"] + 1
            if st["T_cur"] >= st["T_i"]:
                st["T_cur"] = st["T_cur"] % st["T_i"]
                st["T_i"] = st["T_i"] * st["T_mult"]
        st["last_epoch"] = math.floor(epoch)
        return _apply(st, groups, get_lr(cls, st, groups))
    st["_step_count"] = st.get("_step_count", 0) + 1
    st["last_epoch"] += 1
    st["_is_initial"] = False
    return _apply(st, groups, get_lr(cls, st, groups, lambdas))


def _apply(st: dict, groups: list[dict], lrs: list) -> tuple[dict, list[dict]]:
    for g, lr in zip(groups, lrs, strict=True):
        g["lr"] = lr
    st["_last_lr"] = _lrs(groups)
    return st, groups


def _update_lr_at(cls: str, st: dict, groups: list[dict], epoch: int) -> tuple[dict, list[dict]]:
    """torch's ``_update_lr(epoch)`` (SequentialLR at a milestone): closed form where the class has one."""
    st = dict(st)
    st["last_epoch"] = epoch
    lrs = closed_form(cls, st, epoch) if cls in CLOSED_FORM else get_lr(cls, st, groups)
    return _apply(st, [dict(g) for g in groups], lrs)


def _sequential(st: dict, groups: list[dict]) -> tuple[dict, list[dict]]:
    st["last_epoch"] += 1
    milestones = st["_milestones"]
    idx = bisect_right(milestones, st["last_epoch"])
    children = list(st["_schedulers"])
    child = children[idx]
    if idx > 0 and milestones[idx - 1] == st["last_epoch"]:
        children[idx], groups = _update_lr_at(_class_of(child), child, groups, 0)
    else:
        children[idx], groups = step(_class_of(child), child, groups)
    st["_schedulers"], st["_last_lr"] = children, list(children[idx]["_last_lr"])
    return st, groups


def plateau_step(st: dict, groups: list[dict], better: bool) -> tuple[dict, list[dict]]:
    """ReduceLROnPlateau's ``step(metric)`` with a metric that is (``better``) or is not an improvement."""
    st, groups = dict(st), [dict(g) for g in groups]
    st["last_epoch"] += 1
    if better:
        st["num_bad_epochs"] = 0  # (best becomes the metric: not known here)
    else:
        st["num_bad_epochs"] += 1
    if st["cooldown_counter"] > 0:
        st["cooldown_counter"] -= 1
        st["num_bad_epochs"] = 0
    if st["num_bad_epochs"] > st["patience"]:
        min_lrs = st["min_lrs"]
        if len(min_lrs) != len(groups):
            min_lrs = [st["default_min_lr"]] * len(groups)
        for i, g in enumerate(groups):
            old = float(g["lr"])
            new = max(old * st["factor"], min_lrs[i])
            if old - new > st["eps"]:
                g["lr"] = new
        st["cooldown_counter"], st["num_bad_epochs"] = st["cooldown"], 0
    st["_last_lr"] = _lrs(groups)
    return st, groups


# keys only one class's state_dict has (a child of SequentialLR / ChainedScheduler is saved without its class)
SIGNATURES = (
    ("SequentialLR", ("_milestones", "_schedulers")),
    ("ChainedScheduler", ("_schedulers",)),
    ("ReduceLROnPlateau", ("patience", "num_bad_epochs", "min_lrs")),
    ("OneCycleLR", ("total_steps", "_schedule_phases")),
    ("CyclicLR", ("max_lrs", "total_size", "step_ratio")),
    ("CosineAnnealingWarmRestarts", ("T_0", "T_i", "T_mult", "T_cur")),
    ("CosineAnnealingLR", ("T_max", "eta_min")),
    ("PolynomialLR", ("total_iters", "power")),
    ("LinearLR", ("start_factor", "end_factor", "total_iters")),
    ("ConstantLR", ("factor", "total_iters")),
    ("MultiStepLR", ("milestones", "gamma")),
    ("StepLR", ("step_size", "gamma")),
    ("ExponentialLR", ("gamma",)),
    ("LambdaLR", ("lr_lambdas",)),  # (MultiplicativeLR saves the same keys: see class_of)
)


def _class_of(st: dict) -> str:
    found = class_of(st)
    if found is None or found == "LambdaLR|MultiplicativeLR":
        raise NotComputable("a chained scheduler's child is a LambdaLR or MultiplicativeLR: its functions are not saved")
    return found


def class_of(st: dict) -> str | None:
    """The class a scheduler state_dict comes from, by its keys (torch saves no class name);
    ``"LambdaLR|MultiplicativeLR"`` where the two are alike, None for no torch scheduler."""
    if not isinstance(st, dict):
        return None
    for cls, keys in SIGNATURES:
        if all(k in st for k in keys):
            return "LambdaLR|MultiplicativeLR" if cls == "LambdaLR" else cls
    return None
