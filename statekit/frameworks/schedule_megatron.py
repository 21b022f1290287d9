"""A Megatron checkpoint's ``opt_param_scheduler`` as a schedule (:mod:`statekit.schedule.megatron_lr`).

Read beside the optimizer by both Megatron readers (``megatron/dist.py``: the common state;
``megatron/legacy.py``: rank 0's ``model_optim_rng.pt``). What it uses:

* ``opt_param_scheduler`` (or the legacy ``lr_scheduler``): max/min lr, warm-up and decay in samples,
  decay style, ``num_steps`` (samples the stepped updates consumed), the weight-decay ramp;
* ``args``: ``lr_warmup_init`` (the warm-up's start), ``global_batch_size`` (samples per update, unless
  ``rampup_batch_size`` makes it vary), WSD's ``lr_wsd_decay_iters`` / ``lr_wsd_decay_samples`` and
  ``lr_wsd_decay_style``, ``consumed_train_samples``, ``train_iters`` / ``train_samples`` (which of the
  two the WSD length follows);
* the optimizer's param groups: ``max_lr`` / ``min_lr`` / ``wd_mult`` per group, and ``lr`` as saved.
"""

from __future__ import annotations

from statekit.schedule import megatron_lr, model

GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "lr_mult", "wd_mult", "start_wd", "end_wd", "weight_decay",
              "step")


def _num(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(sd: dict, args: dict, groups: list[dict] | None, iteration, source: str) -> model.ScheduleState:
    """The schedule (kind ``megatron:<lr_decay_style>``, counted in samples) and the counters."""
    ss = model.ScheduleState(None, files={"scheduler": f"{source}: opt_param_scheduler"})
    ss.groups = [{k: g[k] for k in GROUP_KEYS if k in g} for g in groups or [] if isinstance(g, dict)]
    steps = {float(g["step"]) for g in ss.groups if _num(g.get("step"))}
    ss.optimizer_step = max(steps) if steps else None
    c = ss.counters
    c.source = source
    c.global_step = _int(iteration)
    c.consumed_samples = _int(args.get("consumed_train_samples"))
    ss.fp16 = args.get("fp16") is True
    try:
        p = megatron_lr.resolve(sd)
    except megatron_lr.NotMegatron as exc:
        ss.notes.append(f"{exc} (not read as a schedule)")
        return ss
    style = p["lr_decay_style"]
    sched = model.Schedule(f"megatron:{style}", state=dict(sd), unit="samples", position=p["num_steps"],
                           base_lrs=[float(p["max_lr"])])
    ss.schedule = sched
    p["init_lr"] = args.get("lr_warmup_init")
    p.update(_wsd(args))
    p["groups"] = megatron_lr.group_values(p, ss.groups)
    sched.params = p
    sched.base_lrs = [g["max_lr"] for g in p["groups"]]
    sched.warmup = p["lr_warmup_steps"] if _num(p["lr_warmup_steps"]) and p["lr_warmup_steps"] > 0 else 0
    sched.horizon = None if style == "constant" else p["lr_decay_steps"]
    gbs = _int(args.get("global_batch_size"))
    if args.get("rampup_batch_size") is not None:
        sched.notes.append(f"rampup_batch_size {args['rampup_batch_size']}: the samples per update vary, so the "
                           "position is not converted to iterations")
    elif gbs:
        sched.per_update = gbs
    sched.unknown = _why_not(p, style, args, ss.groups)
    if sched.unknown is None:
        sched.lr_now = megatron_lr.lr_at(sched, sched.position)
    sched.notes.append("Megatron counts in samples: num_steps is the samples of the updates the scheduler stepped "
                       "(not the skipped ones); a resume's load_state_dict writes the scheduler's lr into every "
                       "group, so lr now is computed, not the group lr as saved")
    if args.get("override_opt_param_scheduler") or args.get("use_checkpoint_opt_param_scheduler") is False:
        sched.notes.append("the run's args override the saved scheduler values with the command line's on resume")
    return ss


def _wsd(args: dict) -> dict:
    samples, iters, gbs = args.get("lr_wsd_decay_samples"), args.get("lr_wsd_decay_iters"), args.get("global_batch_size")
    out = {"lr_wsd_decay_style": args.get("lr_wsd_decay_style")}
    if args.get("train_iters"):
        out["wsd_decay_steps"] = iters * gbs if _int(iters) is not None and _int(gbs) else None
    elif args.get("train_samples"):
        out["wsd_decay_steps"] = samples
    else:
        out["wsd_decay_steps"] = None
    return out


def attach(ckpt, sd: dict, args: dict, iteration, source: str) -> None:
    """``ckpt.schedule`` from the scheduler state beside its optimizer (a warning when it cannot be read)."""
    from statekit.errors import StatekitError

    groups = [dict(g.hyperparams) for g in ckpt.optimizer.groups] if ckpt.optimizer is not None else None
    try:
        ckpt.schedule = read(sd, args, groups, iteration, source)
    except (StatekitError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        ckpt.warnings.append(f"LR schedule not read: {getattr(exc, 'message', None) or exc}")


def _why_not(p: dict, style: str, args: dict, groups: list[dict]) -> str | None:
    if style not in megatron_lr.STYLES:
        return f"lr_decay_style {style!r} is not one megatron-core 0.19.2 computes"
    if not all(_num(p[k]) for k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "num_steps")):
        return "opt_param_scheduler holds a non-numeric lr, step count or horizon"
    if not _num(p["init_lr"]):
        if not args:
            return "the checkpoint keeps no args: the warm-up's start (--lr-warmup-init) is not known"
        return "args has no lr_warmup_init: the warm-up's start lr is not known"
    if style == "WSD" and (not _num(p.get("wsd_decay_steps")) or p.get("lr_wsd_decay_style") not in
                           megatron_lr.WSD_STYLES):
        return "WSD needs args' lr_wsd_decay_iters/_samples and lr_wsd_decay_style (not in the scheduler's state)"
    if any(g.get("lr_mult", 1.0) != 1.0 for g in groups):
        return ("a param group has lr_mult != 1: older megatron-core releases multiplied the lr by it, 0.19.2 "
                "does not, and the release that wrote the checkpoint is not recorded")
    if not all(_num(g["max_lr"]) and _num(g["min_lr"]) for g in p["groups"]):
        return "a param group's max_lr / min_lr is not a number"
    return None
