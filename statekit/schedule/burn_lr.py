"""burn's LR schedulers (burn-optim 0.22 ``lr_scheduler/``): their records read back to positions,
and their lr as a function of the position (given the config, which burn does not save).

burn's ``step()`` advances first and returns the lr of the call, so the n-th call (1-based) uses
``f(n-1)``; position j = calls made = the index of the lr the next call uses.

| kind | record key | position j |
|---|---|---|
| cosine | ``current_iter`` (UInt, ``u64::MAX`` before the first call) | current_iter + 1 (wrapping) |
| step | ``iter_idx`` (Int, −1 before the first call) | iter_idx + 1 |
| linear | ``remaining_iters`` (UInt, N+1 at first) | N + 1 − remaining (needs N) |
| exponential | ``previous_lr`` (Float, initial/γ at first) | 1 + log_γ(previous/initial) (needs the config) |
| noam | ``step`` (Float) | step |
| sequential | ``step`` (UInt) and the children under ``{i}.`` | step |

Facts and sources: ``../shared/docs/schedules-and-resume.md`` §3.
"""

from __future__ import annotations

import math

U64 = 1 << 64
KEYS = {"current_iter": "cosine", "iter_idx": "step", "remaining_iters": "linear", "previous_lr": "exponential"}
NO_CONFIG = ("burn saves no scheduler config (LrSchedulerConfig: initial lr, iterations, milestones): "
             "the lr needs the config the program was built with")


def kind_of(key: str, scalar_kind: str, has_children: bool) -> str | None:
    if key in KEYS:
        return KEYS[key]
    if key == "step":
        return "sequential" if scalar_kind in ("UInt", "Int") and has_children else "noam"
    return None


def position(kind: str, value, params: dict) -> int | None:
    """The position a record's counter stands for (None: it needs the config, or the value is no count)."""
    try:
        return _position(kind, value, params)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None


def _position(kind: str, value, params: dict) -> int | None:
    if isinstance(value, float) and not value.is_integer() and kind in ("noam", "sequential"):
        return None
    if kind == "cosine":
        return (int(value) + 1) % U64
    if kind == "step":
        return int(value) + 1
    if kind in ("noam", "sequential"):
        return int(value)
    if kind == "linear" and "num_iters" in params:
        return params["num_iters"] + 1 - int(value)
    if kind == "exponential" and {"initial_lr", "gamma"} <= set(params):
        return round(1 + math.log(float(value) / params["initial_lr"], params["gamma"]))
    return None


def lr(kind: str, p: dict, j: int) -> float:
    """The lr of position ``j`` (the call j+1) for a burn config ``p``."""
    if kind == "constant":
        return p["lr"]
    if kind == "linear":
        step_size = (p["final_lr"] - p["initial_lr"]) / p["num_iters"]
        remaining = max(p["num_iters"] + 1 - (j + 1), 0)
        return p["final_lr"] - step_size * remaining
    if kind == "cosine":
        lo, hi, n = p.get("min_lr", 0.0), p["initial_lr"], p["num_iters"]
        return lo + 0.5 * (hi - lo) * (1 + math.cos(j * math.pi / n))
    if kind == "exponential":
        return p["initial_lr"] * p["gamma"] ** j
    if kind == "step":
        return p["initial_lr"] * p.get("gamma", 0.1) ** (j // p["step_size"])
    if kind == "noam":
        n = j + 1
        return p["factor"] * p.get("model_size", 512) ** -0.5 * min(n ** -0.5, n * p.get("warmup_steps", 4000) ** -1.5)
    raise KeyError(kind)


def lr_at(sched, t: int) -> list[float] | None:
    """A burn Schedule's lr per group at position ``t`` (None without its config)."""
    if sched.unknown or not sched.params.get("config"):
        return None
    return [lr(sched.name, sched.params["config"], t)]
