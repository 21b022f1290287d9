"""Re-horizoning a saved schedule (``statekit schedule --max-steps N``) as pure functions: the new
scheduler state and the lr the param groups must hold, for one of two rules.

t is the saved position (the index of the lr the next update uses), N the new horizon (N > t),
lr_t that lr as saved (the optimizer's groups), g_N the schedule's shape with horizon N.

* ``continue`` — no jump: lr(t) stays lr_t and the decay goes on over the new horizon, through the
  same class with horizon N and its base lr scaled so that its curve passes through lr_t at t:
  ``lr(s) = end + (lr_t − end) · g_N(s) / g_N(t)``, for t ≤ s ≤ N. Per class:

  - CosineAnnealingLR: ``T_max = N``, ``base_lrs = η + (lr_t − η)·2/(1 + cos(π t/N))``, so
    ``lr(s) = η + (lr_t − η)·(1 + cos(π s/N))/(1 + cos(π t/N))``;
  - LinearLR (a decay, start_factor > end_factor): ``total_iters = N`` and
    ``start_factor = (lr_t/b − e·t/N)/(1 − t/N)`` (b the base lr, e the end factor, kept), so
    ``lr(s) = lr_t + (b·e − lr_t)·(s − t)/(N − t)``: a straight line from lr_t to the same end lr;
  - PolynomialLR: ``total_iters = N``, ``base_lrs = lr_t/(1 − t/N)^p``, so
    ``lr(s) = lr_t·((1 − s/N)/(1 − t/N))^p``;
  - an HF Trainer λ: ``base_lrs = lr_t/λ_N(t)``, so ``lr(s) = lr_t·λ_N(s)/λ_N(t)`` (λ_N: the
    SchedulerType rebuilt with max_steps N and the warm-up the arguments give for N).

* ``fresh`` — the schedule a run started with horizon N would be at, at the same position t: the
  horizon is set and the groups' lr becomes that run's lr at t (torch's recursive forms are stepped
  from step 0 exactly as torch steps them, so the float is the one such a run holds); the lr jumps
  from lr_t to it.

Classes without a horizon (StepLR, MultiStepLR, ExponentialLR, ConstantLR, the warm restarts,
CyclicLR, Lambda/MultiplicativeLR, ReduceLROnPlateau, ChainedScheduler) are refused with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from statekit.errors import MappingError
from statekit.schedule import hf_lr, torch_lr

RULES = ("continue", "fresh")
TORCH_CLASSES = ("CosineAnnealingLR", "LinearLR", "PolynomialLR", "OneCycleLR", "SequentialLR")
_HORIZON_KEY = {"CosineAnnealingLR": "T_max", "LinearLR": "total_iters", "PolynomialLR": "total_iters",
                "OneCycleLR": "total_steps"}
_NO_HORIZON = {
    "StepLR": "decays by gamma every step_size steps for ever",
    "MultiStepLR": "decays at its milestones and has no end",
    "ExponentialLR": "decays by gamma every step for ever",
    "ConstantLR": "its total_iters ends a constant factor (a warm-up), not a decay",
    "CosineAnnealingWarmRestarts": "restarts every T_i steps and has no end",
    "CyclicLR": "cycles and has no end",
    "ReduceLROnPlateau": "follows a metric and has no end",
    "ChainedScheduler": "multiplies its children's factors: no one horizon",
    "LambdaLR|MultiplicativeLR": "its function is not saved",
    "LambdaLR": "its function is not saved",
    "MultiplicativeLR": "its function is not saved",
}


@dataclass
class Rehorizoned:
    state: dict  # the scheduler's new state_dict
    group_lrs: list[float] | None  # the lr the optimizer's groups must hold (None: they keep theirs)
    lr_before: list[float]  # the lr the next update used before the rewrite
    lr_now: list[float]  # the lr the next update uses after it
    end_lr: list[float] | None  # the lr at the new horizon
    old_horizon: int | None
    formula: str
    group_keys: list[dict] = field(default_factory=list)  # other group keys to set (OneCycleLR's momentum)
    notes: list[str] = field(default_factory=list)


def _check(t, n: int) -> None:
    if not isinstance(t, int) or t < 0:
        raise MappingError(f"the saved position {t!r} is no step count")
    if n <= t:
        raise MappingError(f"the new horizon {n} is not past the saved position {t}: nothing is left to decay over")


def torch_state(cls: str, st: dict, groups: list[dict], n: int, rule: str) -> Rehorizoned:
    """A torch scheduler's state_dict (class ``cls``) re-horizoned to ``n`` (MappingError: it cannot be)."""
    if cls in _NO_HORIZON:
        raise MappingError(f"a {cls} {_NO_HORIZON[cls]}: there is no horizon to move")
    if cls not in TORCH_CLASSES:
        raise MappingError(f"no re-horizoning rule for torch's {cls}")
    if "milestones" in st or any("milestones" in c for c in st.get("_schedulers", ())):
        raise MappingError("a MultiStepLR's milestones (a collections.Counter) are not written back by statekit")
    lrs = [float(g["lr"]) for g in groups]
    if cls == "SequentialLR":
        return _sequential(st, groups, n, rule)
    t = st["last_epoch"]
    _check(t, n)
    new = {k: (list(v) if isinstance(v, list) else v) for k, v in st.items()}
    old = st[_HORIZON_KEY[cls]]
    new[_HORIZON_KEY[cls]] = n
    if cls == "OneCycleLR":
        if rule == "continue":
            raise MappingError("OneCycleLR's phases are fractions of total_steps and its lrs come from the groups' "
                               "max_lr / min_lr: no continuation keeps them (--rule fresh builds the new cycle)")
        return _one_cycle_fresh(st, new, groups, n, lrs)
    if cls == "LinearLR" and st["start_factor"] < st["end_factor"]:
        raise MappingError(f"this LinearLR rises (a warm-up over {st['total_iters']} steps): it has no decay to "
                           "re-horizon")
    if rule == "fresh":
        fresh = fresh_lrs(cls, new, [float(b) for b in st["base_lrs"]], t)
        new["_last_lr"] = list(fresh)
        return Rehorizoned(new, fresh, lrs, fresh, _end(cls, new), old,
                           f"fresh: {cls}({_HORIZON_KEY[cls]}={n}) stepped from step 0 to step {t}, as torch steps it")
    formula = _continue(cls, st, new, lrs, t, n)
    return Rehorizoned(new, None, lrs, lrs, _end(cls, new), old, formula)


def _continue(cls: str, st: dict, new: dict, lrs: list[float], t: int, n: int) -> str:
    """Set ``new``'s base / factors so that the class with horizon n passes through ``lrs`` at t."""
    if cls == "CosineAnnealingLR":
        eta = st["eta_min"]
        new["base_lrs"] = [eta + (lr - eta) * 2 / (1 + math.cos(math.pi * t / n)) for lr in lrs]
        return (f"continue: lr(s) = eta_min + (lr_t - eta_min)·(1 + cos(π·s/{n}))/(1 + cos(π·{t}/{n})) for "
                f"{t} ≤ s ≤ {n} (eta_min={eta!r}): CosineAnnealingLR(T_max={n}) over base lrs "
                f"{_short(new['base_lrs'])}")
    if cls == "LinearLR":
        e = st["end_factor"]
        bases = [float(b) for b in st["base_lrs"]]
        factors = {(lr / b - e * t / n) / (1 - t / n) for lr, b in zip(lrs, bases, strict=True)}
        if len(factors) != 1:
            spread = max(factors) - min(factors)
            if spread > 1e-12 * max(abs(f) for f in factors):
                raise MappingError("the groups stand at different fractions of their base lr: one LinearLR "
                                   "start_factor cannot continue them all")
        new["start_factor"] = sorted(factors)[len(factors) // 2]
        if new["start_factor"] <= 0:
            raise MappingError(f"continuing needs a start_factor of {new['start_factor']!r}: torch refuses one ≤ 0")
        return (f"continue: lr(s) = lr_t + (base·{e!r} - lr_t)·(s - {t})/({n} - {t}) for {t} ≤ s ≤ {n}: "
                f"LinearLR(start_factor={new['start_factor']!r}, end_factor={e!r}, total_iters={n})")
    if cls == "PolynomialLR":
        p = st["power"]
        new["base_lrs"] = [lr / (1.0 - t / n) ** p for lr in lrs]
        return (f"continue: lr(s) = lr_t·((1 - s/{n})/(1 - {t}/{n}))^{p!r} for {t} ≤ s ≤ {n}: "
                f"PolynomialLR(total_iters={n}, power={p!r}) over base lrs {_short(new['base_lrs'])}")
    raise MappingError(f"no continue rule for {cls}")


def _short(values) -> str:
    return "[" + ", ".join(repr(float(v)) for v in values) + "]"


def _end(cls: str, st: dict) -> list[float] | None:
    t = st.get(_HORIZON_KEY.get(cls, ""), None)
    if t is None:
        return None
    if cls == "LinearLR":  # the end lr is base · end_factor whatever the start factor
        return [float(b) * st["end_factor"] for b in st["base_lrs"]]
    found = torch_lr.closed_form(cls, st, t)
    return None if found is None else [float(x) for x in found]


def fresh_lrs(cls: str, st: dict, bases: list[float], t: int) -> list[float]:
    """The groups' lr at step t of a run that built ``cls`` with ``st``'s parameters: torch's constructor
    (its initial step) and t ``step()`` calls, replayed."""
    run = dict(st, last_epoch=0, _step_count=1, _is_initial=False, base_lrs=list(bases))
    start = [b * st["start_factor"] for b in bases] if cls == "LinearLR" else list(bases)
    gs = [{"lr": lr} for lr in start]
    for _ in range(t):
        run, gs = torch_lr.step(cls, run, gs)
    return [g["lr"] for g in gs]


def _one_cycle_fresh(st: dict, new: dict, groups: list[dict], n: int, lrs: list[float]) -> Rehorizoned:
    phases = st["_schedule_phases"]
    total = st["total_steps"]
    pct = (phases[0]["end_step"] + 1) / total
    if float(pct * total) - 1 != phases[0]["end_step"]:
        raise MappingError(f"OneCycleLR's pct_start is not recovered from its first phase's end "
                           f"({phases[0]['end_step']!r} of {total})")
    ends = [float(pct * n) - 1, float(2 * pct * n) - 2, n - 1] if len(phases) == 3 else [float(pct * n) - 1, n - 1]
    new["_schedule_phases"] = [dict(ph, end_step=end) for ph, end in zip(phases, ends, strict=True)]
    t = st["last_epoch"]
    fresh = [float(x) for x in torch_lr.closed_form("OneCycleLR", new, t, groups)]
    new["_last_lr"] = list(fresh)
    keys = []
    if st.get("cycle_momentum"):
        keys = [_one_cycle_momentum(new, g, t) for g in groups]
    end = torch_lr.closed_form("OneCycleLR", new, n - 1, groups)
    return Rehorizoned(new, fresh, lrs, fresh, [float(x) for x in end], total,
                       f"fresh: OneCycleLR(total_steps={n}, pct_start={pct!r}) at step {t} (its phases end at "
                       f"{ends}; the lrs come from the groups' initial_lr / max_lr / min_lr)", keys,
                       ["the lr at the last step of the cycle (step N-1) is the end lr; torch refuses a step past N"])


def _one_cycle_momentum(st: dict, group: dict, t: int) -> dict:
    start = 0.0
    phases = st["_schedule_phases"]
    for i, ph in enumerate(phases):
        end = ph["end_step"]
        if t <= end or i == len(phases) - 1:
            if ph["start_momentum"] not in group or ph["end_momentum"] not in group:
                raise MappingError("OneCycleLR cycles the momentum from the groups' base_momentum / max_momentum, "
                                   "which the optimizer file does not hold")
            m = torch_lr._anneal(st["_anneal_func_type"], group[ph["start_momentum"]], group[ph["end_momentum"]],
                                 (t - start) / (end - start))
            return {"betas0" if st.get("use_beta1") else "momentum": m}
        start = end
    return {}


def _sequential(st: dict, groups: list[dict], n: int, rule: str) -> Rehorizoned:
    t = st["last_epoch"]
    _check(t, n)
    milestones, children = list(st["_milestones"]), list(st["_schedulers"])
    m = milestones[-1] if milestones else 0
    last_cls = torch_lr.class_of(children[-1])
    if last_cls not in ("CosineAnnealingLR", "LinearLR", "PolynomialLR"):
        raise MappingError(f"SequentialLR's last scheduler is a {last_cls}: no horizon statekit moves")
    if n <= m:
        raise MappingError(f"the new horizon {n} does not reach SequentialLR's last milestone {m}")
    lrs = [float(g["lr"]) for g in groups]
    new = dict(st, _schedulers=children)
    key = _HORIZON_KEY[last_cls]
    old = m + children[-1][key]
    if t < m:  # before the last scheduler starts: only its horizon moves; both rules are one
        child = dict(children[-1])
        child[key] = n - m
        children[-1] = child
        return Rehorizoned(new, None, lrs, lrs, _end(last_cls, child), old,
                           f"{rule}: the last scheduler ({last_cls}, from step {m}) gets {key}={n - m}; it has not "
                           f"started, so the lr up to step {m} is unchanged (both rules agree)")
    inner = torch_state(last_cls, children[-1], groups, n - m, rule)
    children[-1] = inner.state
    new["_last_lr"] = list(inner.lr_now)
    return Rehorizoned(new, inner.group_lrs, lrs, inner.lr_now, inner.end_lr, old,
                       f"{inner.formula} — in the last scheduler's own steps (s counted from milestone {m}; "
                       f"its {key} = {n - m})")


def hf_lambda(kind: str, kwargs: dict, args: dict, lr_init: float | None, st: dict, lrs: list[float], n: int,
              rule: str) -> tuple[Rehorizoned, int]:
    """An HF Trainer LambdaLR state re-horizoned to max_steps ``n``; also the warm-up a Trainer with
    max_steps n computes (``warmup_steps`` below 1 is a ratio of it)."""
    t = st["last_epoch"]
    _check(t, n)
    warmup = hf_lr.warmup_steps(args, n)
    lam, _params = hf_lr.rebuild(kind, kwargs, warmup, n, lr_init)
    new = dict(st, base_lrs=list(st["base_lrs"]), _last_lr=list(st["_last_lr"]))
    if rule == "fresh":
        fresh = [float(b) * lam(t) for b in st["base_lrs"]]
        new["_last_lr"] = list(fresh)
        end = [float(b) * lam(n) for b in st["base_lrs"]]
        return Rehorizoned(new, fresh, lrs, fresh, end, None,
                           f"fresh: lr(s) = base_lr·λ(s), λ = transformers' {kind} with max_steps={n}, "
                           f"warm-up {warmup}"), warmup
    f = lam(t)
    if not f > 0:
        raise MappingError(f"transformers' {kind} with max_steps={n} is {f!r} at step {t}: no base lr makes it pass "
                           "through the lr now")
    new["base_lrs"] = [lr / f for lr in lrs]
    end = [b * lam(n) for b in new["base_lrs"]]
    edit = Rehorizoned(new, None, lrs, lrs, end, None,
                       f"continue: lr(s) = lr_t·λ(s)/λ({t}), λ = transformers' {kind} with max_steps={n}, warm-up "
                       f"{warmup} (λ({t}) = {f!r}): base lrs {_short(new['base_lrs'])}")
    fresh_end = [float(b) * lam(n) for b in st["base_lrs"]]
    if any(not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) for a, b in zip(end, fresh_end, strict=True)):
        edit.notes.append(f"the lr at the horizon scales with the base lr: {_short(end)} (a run started with "
                          f"max_steps={n}: {_short(fresh_end)})")
    return edit, warmup
