"""What can express what: a torch / HF schedule at its position as one of burn's built-in schedulers
(burn-optim 0.22 ``lr_scheduler/``), and back.

Only the schedule from the position on matters to a resume, so a warm-up already done is not
written: the rest of the schedule is one burn scheduler standing at ``local = position - offset``
(``offset``: the warm-up's updates), which gives, call for call, the lr the source gives at
``local + offset`` (:data:`TABLE`). What burn cannot start is said, e.g. an HF warm-up from lr 0:
burn's ``LinearLrScheduler`` needs ``initial_lr > 0``.

burn's ``step()`` advances first and returns the lr of the call, so position j (calls made) is the
index of the lr the next call uses; the record's counter for position j
(:func:`burn_counter`): cosine ``current_iter = j - 1`` (``u64::MAX`` for 0), linear
``remaining_iters = max(N + 1 - j, 0)``, step ``iter_idx = j - 1``, exponential ``previous_lr`` (the
product burn's own steps give). Facts: ``../shared/docs/schedules-and-resume.md`` §3, §5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from statekit.errors import MappingError

U64 = 1 << 64

# source kind → (burn kind, condition) — the table the docs show
TABLE = {
    "hf:linear": "linear (initial_lr = base lr, final_lr = 0, num_iters = max_steps - warm-up), after the warm-up",
    "hf:cosine": "cosine (initial_lr = base lr, min_lr = 0, num_iters = max_steps - warm-up), after the warm-up; "
                 "num_cycles 0.5",
    "hf:cosine_with_min_lr": "cosine (min_lr = base lr · min_lr_rate), after the warm-up; num_cycles 0.5",
    "hf:constant": "constant (base lr)",
    "hf:constant_with_warmup": "constant (base lr), after the warm-up",
    "hf:inverse_sqrt": "noam (factor = base lr · √warm-up, model_size = 1, warmup_steps = warm-up), one call behind "
                       "(Noam's call n gives HF's λ(n)); timescale = warm-up",
    "torch:StepLR": "step (initial_lr, step_size, gamma)",
    "torch:ExponentialLR": "exponential (initial_lr, gamma)",
    "torch:CosineAnnealingLR": "cosine (initial_lr, min_lr = eta_min, num_iters = T_max)",
    "torch:LinearLR": "linear (initial_lr = base · start_factor, final_lr = base · end_factor, num_iters = total_iters)",
}


class NotExpressible(MappingError):
    """The schedule (at its position) has no burn built-in that gives its lrs."""


@dataclass
class BurnForm:
    kind: str  # burn scheduler: constant, linear, cosine, step, exponential
    config: dict  # its LrSchedulerConfig's arguments
    local: int  # its position: calls made
    offset: int  # the source's position minus ``local`` (the warm-up not written)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.kind}({args}) at position {self.local}"


def to_burn(sched) -> BurnForm:
    """The burn scheduler that continues ``sched`` (a Schedule of one base lr) from its position."""
    if sched.unknown:
        raise NotExpressible(sched.unknown)
    if sched.position is None or sched.position < 0:
        raise NotExpressible("the position is not known")
    bases = set(sched.base_lrs)
    if len(bases) != 1:
        raise NotExpressible(f"its param groups have base lrs {sched.base_lrs}: burn's Learner schedules one lr "
                             "per ParamGroup, which the optimizer record does not name")
    base, pos = float(next(iter(bases))), sched.position
    if sched.kind not in TABLE:
        raise NotExpressible(f"burn has no built-in scheduler for {sched.kind}")
    form = (_hf if sched.framework == "hf" else _torch)(sched, base, pos)
    _check_config(form)
    return form


def _hf(sched, base: float, pos: int) -> BurnForm:
    p, name = sched.params, sched.name
    warm = int(p.get("num_warmup_steps") or 0)
    if name == "constant":
        return BurnForm("constant", {"lr": base}, pos, 0)
    if name == "inverse_sqrt":
        return _noam(p, base, pos, warm)
    if pos < warm:
        raise NotExpressible(f"it stands at update {pos} of its {warm}-update warm-up, which starts from lr 0: "
                             "burn's LinearLrScheduler needs initial_lr > 0, so no built-in gives the rest of it")
    if name == "constant_with_warmup":
        return BurnForm("constant", {"lr": base}, pos - warm, warm)
    horizon = int(p["num_training_steps"]) - warm
    if horizon < 1:
        raise NotExpressible(f"max_steps {p['num_training_steps']} leaves no decay after the warm-up")
    if name == "linear":
        return BurnForm("linear", {"initial_lr": base, "final_lr": 0.0, "num_iters": horizon}, pos - warm, warm)
    if float(p.get("num_cycles", 0.5)) != 0.5:
        raise NotExpressible(f"num_cycles={p['num_cycles']}: burn's cosine is half a period (num_cycles 0.5)")
    low = base * float(p.get("min_lr_rate", 0.0))
    return BurnForm("cosine", {"initial_lr": base, "min_lr": low, "num_iters": horizon}, pos - warm, warm)


def _noam(p: dict, base: float, pos: int, warm: int) -> BurnForm:
    """HF inverse_sqrt with timescale W: λ(t) = min(t/W, √(W/t)); burn's Noam call n gives
    factor·d^-½·min(n^-½, n·W^-1.5), so factor = base·√W, d = 1 gives b·λ(n): the record stands one
    call behind the position (step = t - 1), and λ(0) = 0 is no Noam lr."""
    if warm < 1 or p.get("timescale") != warm:
        raise NotExpressible(f"inverse_sqrt with timescale {p.get('timescale')} and warm-up {warm}: burn's Noam "
                             "matches it only with the timescale equal to a warm-up of at least 1")
    if pos < 1:
        raise NotExpressible("it stands at update 0, whose lr is 0: burn's Noam gives no 0 lr")
    return BurnForm("noam", {"factor": base * math.sqrt(warm), "warmup_steps": warm, "model_size": 1}, pos - 1, 1)


def _torch(sched, base: float, pos: int) -> BurnForm:
    s, name = sched.state, sched.name
    if name == "StepLR":
        return BurnForm("step", {"initial_lr": base, "step_size": int(s["step_size"]), "gamma": float(s["gamma"])},
                        pos, 0)
    if name == "ExponentialLR":
        return BurnForm("exponential", {"initial_lr": base, "gamma": float(s["gamma"])}, pos, 0)
    if name == "CosineAnnealingLR":
        return BurnForm("cosine", {"initial_lr": base, "min_lr": float(s["eta_min"]), "num_iters": int(s["T_max"])},
                        pos, 0)
    return BurnForm("linear", {"initial_lr": base * float(s["start_factor"]), "final_lr": base * float(s["end_factor"]),
                               "num_iters": int(s["total_iters"])}, pos, 0)


def _check_config(form: BurnForm) -> None:
    """burn's config validation (its ``init()`` refuses these)."""
    c = form.config
    if "initial_lr" in c and not 0 < c["initial_lr"] <= 1:
        raise NotExpressible(f"initial lr {c['initial_lr']!r}: burn's {form.kind} scheduler needs 0 < initial_lr <= 1")
    if form.kind == "linear" and not 0 <= c["final_lr"] <= 1:
        raise NotExpressible(f"final lr {c['final_lr']!r}: burn's linear scheduler needs 0 <= final_lr <= 1")
    if form.kind == "cosine" and not 0 <= c["min_lr"] <= c["initial_lr"]:
        raise NotExpressible(f"min lr {c['min_lr']!r}: burn's cosine scheduler needs 0 <= min_lr <= initial_lr")
    if form.kind == "exponential" and not 0 < c["gamma"] <= 1:
        raise NotExpressible(f"gamma {c['gamma']!r}: burn's exponential scheduler needs 0 < gamma <= 1")
    if c.get("num_iters", 1) < 1 or c.get("step_size", 1) < 1:
        raise NotExpressible("burn's schedulers need num_iters and step_size of at least 1")


def burn_counter(form: BurnForm) -> tuple[str, str, int | float] | None:
    """``(field, scalar variant, value)`` of the record that stands at ``form.local`` (None: constant)."""
    j, c = form.local, form.config
    if form.kind == "constant":
        return None
    if form.kind == "cosine":
        return "current_iter", "UInt", (j - 1) % U64
    if form.kind == "linear":
        return "remaining_iters", "UInt", max(c["num_iters"] + 1 - j, 0)
    if form.kind == "step":
        return "iter_idx", "Int", j - 1
    if form.kind == "noam":
        return "step", "Float", float(j)
    previous = c["initial_lr"] / c["gamma"]  # burn's init, then one multiplication per call
    for _ in range(j):
        previous *= c["gamma"]
    return "previous_lr", "Float", previous


def burn_position(kind: str, config: dict, value) -> int:
    """The position a burn record's counter stands for, with its config (burn_lr's, plus linear's N)."""
    from statekit.schedule import burn_lr

    if kind == "constant":
        raise MappingError("a constant scheduler's record keeps no position")
    pos = burn_lr.position(kind, value, config)
    if pos is None:
        raise MappingError(f"burn {kind} record value {value!r}: no position")
    return pos


def burn_lr_at(form: BurnForm, j: int) -> float:
    from statekit.schedule import burn_lr

    return burn_lr.lr(form.kind, form.config, j)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
