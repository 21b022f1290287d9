"""``doctor``'s schedule checks: the LR schedule beside an optimizer state, and the counters.

* ``schedule-lr``: a param group's ``lr`` is not the scheduler's lr at its position (``_last_lr``,
  and the closed form where the kind has one);
* ``schedule-args``: an HF schedule rebuilt from ``training_args.bin`` does not give the saved lr;
* ``initial-lr``: a group without ``initial_lr`` beside a scheduler;
* ``no-scheduler``: ``optimizer.pt`` in a Trainer folder without ``scheduler.pt``;
* (Megatron: the scheduler counts samples; positions are compared in iterations, through the global
  batch size)
* ``counters``: global step, scheduler position and optimizer step disagreeing (updates the fp16
  loss scaler skipped are counted by the global step only: explained, an info);
* ``warmup-again``: a position inside the warm-up while more updates than the warm-up were taken.
"""

from __future__ import annotations

import os

from statekit.errors import StatekitError
from statekit.schedule import model


def schedule_of(ckpt) -> tuple[model.ScheduleState | None, str | None]:
    """The schedule beside an optimizer checkpoint: read with it (a folder), else from the folder of its
    ``optimizer.pt`` / ``optimizer.bin``; ``(None, why)`` when it cannot be read."""
    if ckpt.schedule is not None:
        return ckpt.schedule, None
    path = os.fspath(ckpt.path)
    if os.path.isdir(path) or os.path.basename(path) not in ("optimizer.pt", "optimizer.bin"):
        return None, None
    folder = os.path.dirname(os.path.abspath(path))
    from statekit.frameworks import schedule_hf, schedule_torch

    try:
        if os.path.basename(path) == "optimizer.pt" and any(
                os.path.isfile(os.path.join(folder, n)) for n in ("trainer_state.json", "training_args.bin")):
            return schedule_hf.read_folder(folder), None
        sched = os.path.join(folder, "scheduler" + os.path.splitext(path)[1])
        if os.path.isfile(sched):
            return schedule_torch.read_file(sched, optimizer=path), None
    except StatekitError as exc:
        return None, f"LR schedule not read: {exc.message}"
    return None, None


def check(ckpt, finding, findings: list[dict], notes: list[str]) -> None:
    ss, why = schedule_of(ckpt)
    if why:
        notes.append(why)
    if ss is None:
        return
    sched = ss.schedule
    if sched is None:
        if "optimizer" in ss.files and ("trainer_state" in ss.files or "training_args" in ss.files):
            findings.append(finding("error", "no-scheduler", None, "optimizer.pt has no scheduler.pt beside it"))
        return
    _lr(ss, sched, finding, findings)
    _initial_lr(ss, sched, finding, findings)
    _counters(ss, sched, finding, findings, notes)
    _warmup(ss, sched, finding, findings)


def _lr(ss, sched, finding, findings) -> None:
    if sched.disagrees:
        findings.append(finding("warning", "schedule-args", None, sched.disagrees))
    if not ss.groups or sched.lr_now is None or sched.position is None:
        return
    # (an HF λ that disagrees is schedule-args' finding)
    closed = model.lr_at(sched, sched.position, ss.groups) if sched.position >= 0 and sched.framework == "torch" \
        else None
    for g, group in enumerate(ss.groups):
        if g >= len(sched.lr_now) or not isinstance(group.get("lr"), int | float):
            continue
        want = sched.lr_now[g]
        if closed is not None and g < len(closed) and not model.same_lr(closed[g], want):
            findings.append(finding("warning", "schedule-lr", f"group {g}",
                                    f"the scheduler's last lr {want!r} is not its schedule's {closed[g]!r} at "
                                    f"position {sched.position} (its chainable form drifted from the closed form)"))
        if not model.same_lr(group["lr"], want) and sched.framework == "megatron":
            findings.append(finding("warning", "schedule-lr", f"group {g}",
                                    f"param group lr {group['lr']!r}, Megatron's scheduler at num_steps "
                                    f"{sched.position} samples gives {want!r}: the optimizer and the scheduler "
                                    f"were not saved by one step (a resume sets {want!r})"))
        elif not model.same_lr(group["lr"], want):
            factor = group["lr"] / want if want else float("inf")
            later = (f"every later lr is off by x{factor:.6g}" if sched.recursive
                     else "the updates after it follow the schedule again")
            findings.append(finding("warning", "schedule-lr", f"group {g}",
                                    f"param group lr {group['lr']!r}, the scheduler's lr at position "
                                    f"{sched.position} is {want!r}: the next update uses {group['lr']!r}; {later}"))


def _initial_lr(ss, sched, finding, findings) -> None:
    if not ss.groups or sched.framework not in ("torch", "hf") or sched.name in ("ReduceLROnPlateau",
                                                                                  "reduce_lr_on_plateau"):
        return
    missing = [g for g, group in enumerate(ss.groups) if "initial_lr" not in group]
    if missing:
        severity = "error" if sched.name == "OneCycleLR" else "warning"
        findings.append(finding(severity, "initial-lr", None,
                                f"param group{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                                f"{'have' if len(missing) > 1 else 'has'} no initial_lr beside a {sched.name} "
                                f"at position {sched.position}"))


def _counters(ss, sched, finding, findings, notes) -> None:
    if sched.name in ("ReduceLROnPlateau", "reduce_lr_on_plateau") or sched.position is None:
        return  # (it counts evaluations, not updates)
    pos, step, glob = _updates(sched, sched.position), ss.optimizer_step, ss.counters.global_step
    if pos is None:
        return
    if sched.framework == "deepspeed":  # its index is one behind: updates stepped - 1
        pos += 1
    if ss.deepspeed_skipped and glob is not None:
        notes.append(f"DeepSpeed: global_steps {glob}, of which {ss.deepspeed_skipped} skipped by the fp16 loss "
                     "scaler (the scheduler and the optimizer did not step on them)")
        glob -= ss.deepspeed_skipped
    if sched.interval == "epoch":
        notes.append(f"the scheduler's position {pos} is the epochs Lightning stepped it: interval='epoch'")
        return
    if "lightning" in ss.files and ss.counters.epoch is not None and pos == ss.counters.epoch != glob:
        notes.append(f"the scheduler's position {pos} is the epochs completed: an interval='epoch' scheduler")
        return
    if step is not None and step != pos:
        findings.append(finding("warning", "counters", None,
                                f"the scheduler stands at position {pos}, the optimizer took {step:g} updates"))
    if glob is None:
        return
    if glob == pos:
        return
    if glob > pos and ss.fp16 and (step is None or step == pos):
        notes.append(f"global step {glob}, scheduler position {pos}: {glob - pos} updates skipped by the fp16 loss "
                     "scaler (Trainer does not step the scheduler on them; the optimizer did not step either)")
        return
    what = "the iteration" if sched.framework == "megatron" else "trainer_state.json's global step"
    findings.append(finding("warning", "counters", None,
                            f"{what} is {glob}, the scheduler's position {pos}"
                            + ("" if step is None else f", the optimizer's step {step:g}")))


def _updates(sched, x):
    """A position / length in updates (a schedule counted in samples: divided by the samples per update;
    None when that is not known or does not divide it)."""
    if x is None or sched.unit == "updates":
        return x
    if not sched.per_update or x % sched.per_update:
        return None
    return int(x // sched.per_update)


def _warmup(ss, sched, finding, findings) -> None:
    position, warmup = _updates(sched, sched.position), _updates(sched, sched.warmup)
    if not warmup or position is None:
        return
    done = max(x for x in (ss.optimizer_step, ss.counters.global_step, 0) if x is not None)
    if position < warmup <= done or (position == 0 and done > 0 and warmup):
        findings.append(finding("warning", "warmup-again", None,
                                f"the scheduler is at position {position} of a {warmup}-update warm-up, "
                                f"after {done:g} updates"))
