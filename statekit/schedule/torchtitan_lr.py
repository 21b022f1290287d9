"""torchtitan's LR schedule (``torchtitan/components/optimizer/lr_scheduler.py``, 0.3.0) as pure functions.

``LRSchedulersContainer.Config.build`` makes one torch ``LambdaLR`` per optimizer over the factor
``linear_warmup_stable_decay``: a linear warm-up (``(t + 1) / warmup_steps``), a stable phase at 1,
then a decay (``linear``, ``sqrt``: 1 - sqrt(progress), ``cosine``) scaled into [min_lr_factor, 1].
Its lengths: ``total_steps`` (the config's, else ``training.steps``), ``warmup_steps`` clamped to
it, ``decay_steps = round(total_steps * decay_ratio)`` (clamped so warm-up + decay fit) or all the
steps after the warm-up, and ``stable_steps = total_steps + 1 - warmup - decay`` (a virtual last step
keeps the lr above 0). The lr at position t (LambdaLR's ``last_epoch``) is ``base_lr * factor(t)``.

torchtitan saves only ``{"last_epoch": N}`` (0.3.0; older releases saved the LambdaLR's state_dict);
the config is the job's (``--debug.save_config_file`` writes it beside the checkpoints).
"""

from __future__ import annotations

import math

DECAY_TYPES = ("linear", "sqrt", "cosine")


def lengths(config: dict, training_steps: int) -> dict:
    """warmup / stable / decay steps as ``Config.build`` computes them."""
    total = config.get("total_steps")
    total = total if total is not None else training_steps
    warmup = int(config.get("warmup_steps", 200))
    if warmup > total:
        warmup = total
    ratio = config.get("decay_ratio")
    if ratio is not None:
        decay = round(total * ratio)
        if warmup + decay > total:
            decay = total - warmup
    else:
        decay = total - warmup
    return {"warmup_steps": warmup, "stable_steps": total + 1 - warmup - decay, "decay_steps": decay,
            "decay_type": config.get("decay_type", "linear"), "min_lr_factor": config.get("min_lr_factor", 0.0),
            "total_steps": total}


def factor(current_step: int, p: dict) -> float:
    """``linear_warmup_stable_decay`` (same operations, same order)."""
    warmup_steps, stable_steps, decay_steps = p["warmup_steps"], p["stable_steps"], p["decay_steps"]
    warmup_stable_steps = warmup_steps + stable_steps
    if current_step < warmup_steps:
        current_step += 1
        return float(current_step / warmup_steps)
    if current_step < warmup_stable_steps:
        return 1.0
    current_step += 1
    progress = float(current_step - warmup_stable_steps) / decay_steps
    kind = p["decay_type"]
    if kind == "linear":
        adj = 1 - progress
    elif kind == "sqrt":
        adj = 1 - math.sqrt(progress)
    elif kind == "cosine":
        adj = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise KeyError(f"decay_type {kind!r}")
    min_lr_factor = p["min_lr_factor"]
    return min_lr_factor + (1 - min_lr_factor) * adj


def lr_at(sched, t: int) -> list[float]:
    """LambdaLR's ``base_lr * lmbda(last_epoch)`` per group."""
    return [base * factor(t, sched.params) for base in sched.base_lrs]
