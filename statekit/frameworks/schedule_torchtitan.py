"""A torchtitan DCP checkpoint's LR schedule (:mod:`statekit.schedule.torchtitan_lr`) and counters.

torchtitan's ``CheckpointManager`` writes ``<dump_folder>/<checkpoint.folder>/step-N`` with the
top-level entries ``lr_scheduler`` (0.3.0: ``{"last_epoch": N}``; older releases: the LambdaLR's
state_dict) and ``train_state`` (``{"step", "ntokens_seen"}``) beside the model and ``optimizer``.
The position is ``last_epoch``; the lr needs the job's ``lr_scheduler`` and ``training.steps``
config, which is not in the checkpoint: it is given (``config=``) or recorded — the JSON
``--debug.save_config_file`` writes into the dump folder (used when exactly one JSON there has
``lr_scheduler`` and ``training`` sections). The base lr per group is the saved group's
``initial_lr`` (LambdaLR's), and the lr the next update uses is the saved group ``lr``.
"""

from __future__ import annotations

import json
import os

from statekit.schedule import model, torchtitan_lr


def is_torchtitan(sd: object) -> bool:
    return (isinstance(sd, dict) and isinstance(sd.get("lr_scheduler"), dict)
            and "last_epoch" in sd["lr_scheduler"] and isinstance(sd.get("train_state"), dict))


def recorded_config(path: str) -> tuple[dict | None, str]:
    """The job config recorded in the dump folder of checkpoint ``path`` (None: why not)."""
    step_dir = os.path.abspath(path)
    ckpt_dir = os.path.dirname(step_dir)
    dump = os.path.dirname(ckpt_dir)
    found = []
    for name in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
        if not name.endswith(".json") or not os.path.isfile(os.path.join(dump, name)):
            continue
        try:
            with open(os.path.join(dump, name)) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and isinstance(cfg.get("lr_scheduler"), dict) and isinstance(cfg.get("training"),
                                                                                            dict):
            folder = (cfg.get("checkpoint") or {}).get("folder") if isinstance(cfg.get("checkpoint"), dict) else None
            if folder is None or folder == os.path.basename(ckpt_dir):
                found.append((name, cfg))
    if len(found) == 1:
        return found[0][1], found[0][0]
    if found:
        return None, f"{len(found)} job configs in the dump folder ({', '.join(n for n, _ in found)}): none is used"
    return None, ("torchtitan saves only the scheduler's position; its lr_scheduler config (warmup_steps, "
                  "decay_ratio, decay_type, min_lr_factor, training.steps) is the job's, not recorded beside it "
                  "(torchtitan --debug.save_config_file records it)")


def read(sd: dict, groups: list[dict] | None, path: str, config: dict | None = None) -> model.ScheduleState:
    ls, train = sd["lr_scheduler"], sd["train_state"]
    ss = model.ScheduleState(None, files={"scheduler": "lr_scheduler", "trainer_state": "train_state",
                                          "optimizer": "optimizer"})
    ss.groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in groups or []]
    c = ss.counters
    c.source = "train_state"
    if isinstance(train.get("step"), int):
        c.global_step = train["step"]
    if isinstance(train.get("ntokens_seen"), int):
        ss.notes.append(f"tokens seen: {train['ntokens_seen']}")
    sched = model.Schedule("torchtitan:warmup_stable_decay", state=dict(ls), position=ls.get("last_epoch"))
    ss.schedule = sched
    lrs = [g.get("lr") for g in ss.groups]
    sched.lr_now = [float(x) for x in lrs] if lrs and all(isinstance(x, int | float) for x in lrs) else None
    if isinstance(ls.get("_last_lr"), list):  # an older torchtitan: LambdaLR's own state_dict
        sched.lr_now = [float(x) for x in ls["_last_lr"]]
    bases = ls.get("base_lrs") if isinstance(ls.get("base_lrs"), list) else [g.get("initial_lr") for g in ss.groups]
    if bases and all(isinstance(b, int | float) for b in bases):
        sched.base_lrs = [float(b) for b in bases]
    source = "given"
    if config is None:
        config, source = recorded_config(path)
        if config is None:
            sched.unknown = source
            return ss
    steps = (config.get("training") or {}).get("steps")
    cfg = config.get("lr_scheduler") or {}
    if not isinstance(steps, int) and cfg.get("total_steps") is None:
        sched.unknown = "the job config has no training.steps (the schedule's horizon)"
        return ss
    sched.params = torchtitan_lr.lengths(cfg, steps)
    sched.notes.append(f"lr_scheduler config: {source}" + ("" if source == "given" else " (the recorded job config)"))
    if sched.params["decay_type"] not in torchtitan_lr.DECAY_TYPES:
        sched.unknown = f"decay_type {sched.params['decay_type']!r} is not one torchtitan 0.3.0 computes"
    elif not sched.base_lrs:
        sched.unknown = "the saved param groups have no initial_lr (LambdaLR's base lr)"
    sched.warmup = sched.params["warmup_steps"]
    sched.horizon = sched.params["total_steps"]
    return ss
