"""Megatron's ``OptimizerParamScheduler`` (megatron-core 0.19.2, ``megatron/core/optimizer_param_scheduler.py``)
as pure functions: its saved ``opt_param_scheduler`` state_dict resolved the way ``load_state_dict`` does, and
``get_lr`` / ``get_wd`` at a position, with the same arithmetic in the same order.

Megatron counts in SAMPLES: ``num_steps`` is the samples consumed by the updates the scheduler stepped
(``train_step`` calls ``step(increment=num_microbatches * micro_batch_size * data_parallel_size)``, the
global batch size, only when the update succeeded); ``lr_warmup_steps`` and ``lr_decay_steps`` are
samples too (``--lr-warmup-iters`` x global batch size, or ``--lr-warmup-samples``). After an update the
scheduler has already stepped, so the lr at ``num_steps`` is the one the next update uses; resuming,
``load_state_dict`` calls ``step(num_steps)``, which writes that lr into every param group (the group
``lr`` saved beside it is overwritten).

Per group: ``get_lr`` reads the group's ``max_lr`` / ``min_lr`` (default: the scheduler's), ``get_wd`` its
``start_wd`` / ``end_wd``, and the weight decay is multiplied by ``wd_mult``. 0.19.2 does not multiply the
lr by ``lr_mult`` (older releases did: ``param_group['lr'] = new_lr * lr_mult``), so a group with
``lr_mult`` != 1 is not computed (the release that wrote it is not recorded).

Not in the state_dict (from ``args`` when the checkpoint keeps them): ``init_lr`` (``--lr-warmup-init``),
WSD's ``wsd_decay_steps`` and ``lr_wsd_decay_style``.
"""

from __future__ import annotations

import math

STYLES = ("linear", "cosine", "inverse-square-root", "WSD", "constant")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


class NotMegatron(ValueError):
    """A state_dict that is not an ``opt_param_scheduler`` (one line: what is missing)."""


def resolve(sd: dict) -> dict:
    """The scheduler's values as ``load_state_dict`` resolves them (also the legacy key names)."""
    def pick(*names):
        for n in names:
            if n in sd:
                return sd[n]
        raise NotMegatron(f"opt_param_scheduler has no {names[-1]}")

    out = {"max_lr": pick("start_lr", "max_lr"), "min_lr": pick("min_lr"),
           "lr_warmup_steps": pick("warmup_iter", "warmup_steps", "lr_warmup_steps"),
           "lr_decay_steps": pick("end_iter", "decay_steps", "lr_decay_steps"),
           "lr_decay_style": pick("decay_style", "lr_decay_style"),
           "num_steps": pick("num_iters", "num_steps")}
    for k in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
        if k in sd:
            out[k] = sd[k]
    return out


def lr(p: dict, num_steps, max_lr: float, min_lr: float) -> float:
    """``OptimizerParamScheduler.get_lr`` at ``num_steps`` (samples) for a group's ``max_lr`` / ``min_lr``;
    ``p``: the resolved values plus ``init_lr`` (and, for WSD, ``wsd_decay_steps``, ``lr_wsd_decay_style``)."""
    warmup, decay, style = p["lr_warmup_steps"], p["lr_decay_steps"], p["lr_decay_style"]
    init_lr = p["init_lr"]
    if warmup > 0 and num_steps <= warmup:
        return init_lr + ((max_lr - init_lr) * float(num_steps) / float(warmup))
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        warmup_steps = max(warmup, 1)
        steps = max(num_steps, 1)
        return max(min_lr, max_lr * warmup_steps ** 0.5 / (steps ** 0.5))
    decay_ratio = float(num_steps - warmup) / float(decay - warmup)
    delta_lr = max_lr - min_lr
    if style == "linear":
        coeff = 1.0 - decay_ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    elif style == "WSD":
        wsd = p["wsd_decay_steps"]
        anneal_start = decay - wsd
        if num_steps <= anneal_start:
            coeff = 1.0
        else:
            ratio = float(num_steps - anneal_start) / float(wsd)
            wstyle = p["lr_wsd_decay_style"]
            if wstyle == "linear":
                coeff = 1.0 - ratio
            elif wstyle == "cosine":
                coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
            elif wstyle == "exponential":
                coeff = (2.0 * math.pow(0.5, ratio)) - 1.0
            elif wstyle == "minus_sqrt":
                coeff = 1.0 - math.sqrt(ratio)
            else:
                raise KeyError(f"lr_wsd_decay_style {wstyle!r}")
    else:
        raise KeyError(f"lr_decay_style {style!r}")
    return min_lr + coeff * delta_lr


def wd(p: dict, num_steps, start_wd: float, end_wd: float) -> float:
    """``OptimizerParamScheduler.get_wd`` at ``num_steps`` (before the group's ``wd_mult``)."""
    if num_steps > p["wd_incr_steps"]:
        return end_wd
    style = p["wd_incr_style"]
    if style == "constant":
        return end_wd
    ratio = float(num_steps) / float(p["wd_incr_steps"])
    delta = end_wd - start_wd
    if style == "linear":
        coeff = ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    else:
        raise KeyError(f"wd_incr_style {style!r}")
    return start_wd + coeff * delta


def group_values(p: dict, groups: list[dict] | None) -> list[dict]:
    """Per param group: the max_lr / min_lr / start_wd / end_wd / wd_mult ``get_lr`` and ``get_wd`` use."""
    out = []
    for g in groups or [{}]:
        out.append({"max_lr": g.get("max_lr", p["max_lr"]), "min_lr": g.get("min_lr", p["min_lr"]),
                    "start_wd": g.get("start_wd", p.get("start_wd")), "end_wd": g.get("end_wd", p.get("end_wd")),
                    "wd_mult": g.get("wd_mult", 1.0)})
    return out


def lr_at(sched, t) -> list[float]:
    """A Megatron Schedule's lr per group at ``t`` samples."""
    p = sched.params
    return [lr(p, t, g["max_lr"], g["min_lr"]) for g in p["groups"]]


def wd_at(sched, t) -> list[float] | None:
    """A Megatron Schedule's weight decay per group at ``t`` samples (``get_wd`` x ``wd_mult``)."""
    p = sched.params
    if "wd_incr_style" not in p:
        return None
    return [wd(p, t, g["start_wd"], g["end_wd"]) * g["wd_mult"] for g in p["groups"]]
