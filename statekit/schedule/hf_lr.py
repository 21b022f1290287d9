"""transformers' ``SchedulerType`` schedules (5.x ``optimization.py``) as pure functions.

Every Trainer schedule but ``reduce_lr_on_plateau`` (and 5.x's ``greedy``) is a torch ``LambdaLR``
over ``functools.partial(f, **arguments)``; ``scheduler.pt`` saves neither the function nor its
arguments, so the schedule is rebuilt from ``training_args.bin`` (type, kwargs, warm-up) and
``trainer_state.json`` (``max_steps``, the horizon), as Trainer itself rebuilds it on resume.
Each λ below is transformers' own expression, so ``base_lr * λ(t)`` is bit-identical.

Facts and sources: ``../shared/docs/schedules-and-resume.md`` §2.
"""

from __future__ import annotations

import math
from functools import partial

from statekit.errors import MappingError

TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
         "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
         "warmup_stable_decay")
WARMUP_FROM_ZERO = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup", "inverse_sqrt",
                    "cosine_with_min_lr")


def _warm(t, w):
    return float(t) / float(max(1, w))


def linear(t, *, num_warmup_steps, num_training_steps):
    if t < num_warmup_steps:
        return _warm(t, num_warmup_steps)
    return max(0.0, float(num_training_steps - t) / float(max(1, num_training_steps - num_warmup_steps)))


def cosine(t, *, num_warmup_steps, num_training_steps, num_cycles, min_lr_rate=0.0):
    """``cosine`` and ``cosine_with_min_lr`` (transformers' second, shadowing, definition)."""
    if t < num_warmup_steps:
        return _warm(t, num_warmup_steps)
    progress = float(t - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0, factor)


def cosine_with_restarts(t, *, num_warmup_steps, num_training_steps, num_cycles):
    if t < num_warmup_steps:
        return _warm(t, num_warmup_steps)
    progress = float(t - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (float(num_cycles) * progress % 1.0))))


def polynomial(t, *, num_warmup_steps, num_training_steps, lr_end, power, lr_init):
    if t < num_warmup_steps:
        return _warm(t, num_warmup_steps)
    if t > num_training_steps:
        return lr_end / lr_init
    lr_range = lr_init - lr_end
    decay_steps = num_training_steps - num_warmup_steps
    pct_remaining = 1 - (t - num_warmup_steps) / decay_steps
    return (lr_range * pct_remaining ** power + lr_end) / lr_init


def constant(_t=None):
    return 1


def constant_with_warmup(t, *, num_warmup_steps):
    if t < num_warmup_steps:
        return float(t) / float(max(1.0, num_warmup_steps))
    return 1.0


def inverse_sqrt(t, *, num_warmup_steps, timescale):
    if t < num_warmup_steps:
        return _warm(t, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((t + shift) / timescale)


def cosine_warmup_with_min_lr(t, *, num_warmup_steps, num_training_steps, num_cycles, min_lr_rate=0.0,
                              warmup_lr_rate=None):
    t, w, n = float(t), float(num_warmup_steps), float(num_training_steps)
    if t < w:
        if warmup_lr_rate is None:
            return (t + 1.0) / max(1.0, w)
        warmup_lr_rate = float(warmup_lr_rate)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * t / max(1, w - 1)
    progress = (t - w + 1.0) / max(1.0, n - w)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def warmup_stable_decay(t, *, num_warmup_steps, num_stable_steps, num_decay_steps, warmup_type, decay_type,
                        min_lr_ratio, num_cycles):
    if t < num_warmup_steps:
        progress = float(t) / float(max(1, num_warmup_steps))
        factor = {"linear": lambda p: p, "cosine": lambda p: 0.5 * (1.0 - math.cos(math.pi * p)),
                  "1-sqrt": lambda p: 1.0 - math.sqrt(1.0 - p)}[warmup_type](progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if t < num_warmup_steps + num_stable_steps:
        return 1.0
    if t < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(t - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        factor = {"linear": lambda p: 1.0 - p,
                  "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * p)),
                  "1-sqrt": lambda p: 1.0 - math.sqrt(p)}[decay_type](progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def warmup_steps(args: dict, max_steps: int) -> int:
    """``TrainingArguments.get_warmup_steps`` (5.x: a value below 1 is a ratio; 4.x: ``warmup_ratio``)."""
    w = args.get("warmup_steps", 0) or 0
    ratio = args.get("warmup_ratio")
    if w >= 1:
        return int(w)
    if w > 0:
        return math.ceil(max_steps * w)
    if isinstance(ratio, int | float) and ratio > 0:
        return math.ceil(max_steps * ratio)
    return 0


def rebuild(kind: str, kwargs: dict, warmup: int, max_steps: int, lr_init: float | None):
    """``(λ, parameters)`` as ``transformers.get_scheduler`` builds them (MappingError: an unknown type,
    an argument the factory would refuse)."""
    kw = dict(kwargs or {})
    common = {"num_warmup_steps": warmup, "num_training_steps": max_steps}
    try:
        if kind == "linear":
            params = common
            fn = linear
        elif kind in ("cosine", "cosine_with_min_lr"):
            params = {**common, "num_cycles": kw.pop("num_cycles", 0.5)}
            if kind == "cosine_with_min_lr":
                params["min_lr_rate"] = _min_rate(kw, lr_init)
            fn = cosine
        elif kind == "cosine_warmup_with_min_lr":
            params = {**common, "num_cycles": kw.pop("num_cycles", 0.5), "min_lr_rate": _min_rate(kw, lr_init),
                      "warmup_lr_rate": kw.pop("warmup_lr_rate", None)}
            fn = cosine_warmup_with_min_lr
        elif kind == "cosine_with_restarts":
            params, fn = {**common, "num_cycles": kw.pop("num_cycles", 1)}, cosine_with_restarts
        elif kind == "polynomial":
            if lr_init is None:
                raise MappingError("polynomial divides by the optimizer's default lr (TrainingArguments.learning_rate)"
                                   ", which is not known")
            params = {**common, "lr_end": kw.pop("lr_end", 1e-7), "power": kw.pop("power", 1.0), "lr_init": lr_init}
            fn = polynomial
        elif kind == "constant":
            return constant, {}
        elif kind == "constant_with_warmup":
            return partial(constant_with_warmup, num_warmup_steps=warmup), {"num_warmup_steps": warmup}
        elif kind == "inverse_sqrt":
            timescale = kw.pop("timescale", None)
            params = {"num_warmup_steps": warmup, "timescale": timescale if timescale is not None else warmup or 10000}
            fn = inverse_sqrt
        elif kind == "warmup_stable_decay":
            if "num_decay_steps" not in kw:
                raise MappingError("warmup_stable_decay needs num_decay_steps in lr_scheduler_kwargs")
            decay = kw.pop("num_decay_steps")
            stable = kw.pop("num_stable_steps", None)
            total = kw.pop("num_training_steps", max_steps)
            params = {"num_warmup_steps": warmup, "num_decay_steps": decay,
                      "num_stable_steps": stable if stable is not None else total - warmup - decay,
                      "warmup_type": kw.pop("warmup_type", "linear"), "decay_type": kw.pop("decay_type", "cosine"),
                      "min_lr_ratio": kw.pop("min_lr_ratio", 0), "num_cycles": kw.pop("num_cycles", 0.5)}
            fn = warmup_stable_decay
        else:
            raise MappingError(f"lr_scheduler_type {kind!r} is no schedule statekit rebuilds "
                               f"({', '.join(t for t in TYPES if t != 'reduce_lr_on_plateau')})")
    except KeyError as exc:
        raise MappingError(f"{kind}: {exc}") from None
    if kw:
        raise MappingError(f"lr_scheduler_kwargs {sorted(kw)} are not arguments of transformers' {kind} schedule")
    return partial(fn, **params), params


def _min_rate(kw: dict, lr_init: float | None) -> float:
    min_lr, rate = kw.pop("min_lr", None), kw.pop("min_lr_rate", None)
    if (min_lr is None) == (rate is None):
        raise MappingError("exactly one of min_lr and min_lr_rate must be in lr_scheduler_kwargs (transformers refuses "
                           "the schedule otherwise)")
    if min_lr is not None:
        if lr_init is None:
            raise MappingError("min_lr is divided by the optimizer's default lr, which is not known")
        return min_lr / lr_init
    return rate
