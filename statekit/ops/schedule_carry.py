"""``convert`` and the LR schedule beside the optimizer: carried, or refused, never dropped in silence.

A source's schedule is the one its readers find beside the optimizer: a Trainer folder's
``scheduler.pt`` (+ ``trainer_state.json``), an ``optimizer.pt`` / ``optimizer.bin`` with its
scheduler file beside it, a Lightning ``.ckpt``'s ``lr_schedulers``, a DeepSpeed checkpoint's
``lr_scheduler``, a burn ``optim-N.bpk`` with ``scheduler-N.bpk`` beside it.

* Same framework (torch → torch, burn → burn): the source's scheduler file applies to the output
  unchanged (the position does not move); written beside the output where the output's name is
  the framework's (``optimizer.pt``, ``optim-N.bpk``), else the plan says it is not written.
* Another framework: carried when the target can express the schedule
  (:mod:`statekit.schedule.carry` says what can express what), else refused in one line naming
  the schedule and what cannot be expressed — unless ``--no-schedule`` drops it (the plan then
  says so).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from statekit.errors import MappingError, StatekitError
from statekit.formats import registry

BURN_OPTIM = re.compile(r"^optim-(\d+)\.bpk$")
DROP_HINT = "give --no-schedule to convert the optimizer without it"


@dataclass
class Carry:
    """What convert does with the source's schedule: ``files`` to write beside the target
    (``[(path, writer)]``, ``writer(path) -> bytes written``), warnings for the plan, and the
    group lrs / initial lrs the target's optimizer groups must hold (None: as they are)."""

    source: object = None  # the ScheduleState read beside the source (None: it has no schedule)
    files: list = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    group_lrs: dict | None = None  # hyperparameters every target group gets (lr, initial_lr)
    refusal: MappingError | None = None  # raised once the plan is built (the plan's own refusals go first)

    def refuse(self) -> None:
        if self.refusal is not None:
            raise self.refusal


def source_schedule(ckpt) -> tuple[object, str | None]:
    """The ScheduleState beside ``ckpt``'s optimizer and the file it was read from (None, None: none)."""
    from statekit.ops import doctor_schedule

    ss, why = doctor_schedule.schedule_of(ckpt)
    if why:  # a scheduler file is there but unreadable: not droppable in silence either
        raise MappingError(f"{why}; {DROP_HINT}", ckpt.path)
    if ss is None:
        ss = _burn_beside(ckpt)
    if ss is None or ss.schedule is None:
        return None, None
    return ss, _label(ss)


def _burn_beside(ckpt):
    path = os.fspath(ckpt.path)
    match = BURN_OPTIM.match(os.path.basename(path)) if ckpt.format == "burnpack" else None
    if match is None:
        return None
    sched = os.path.join(os.path.dirname(os.path.abspath(path)), f"scheduler-{match.group(1)}.bpk")
    if not os.path.isfile(sched):
        return None
    from statekit.formats.burnpack import BurnpackFile
    from statekit.frameworks import schedule_burn

    try:
        return schedule_burn.read_pack(BurnpackFile(sched))
    except StatekitError as exc:
        raise MappingError(f"{os.path.basename(sched)} beside it is no LR scheduler record statekit reads "
                           f"({exc.message}); {DROP_HINT}", ckpt.path) from None


def _label(ss) -> str:
    sched, files = ss.schedule, ss.files
    name = files.get("scheduler") or "the scheduler"
    extra = [files[k] for k in ("trainer_state",) if k in files]
    return f"{sched.kind} in {' + '.join([name, *extra])}"


def schedule_framework(sched) -> str:
    return "torch" if sched.framework in ("torch", "hf") else sched.framework


def decide(ckpt, src: str, dst: str, fmt: str, *, no_schedule: bool = False) -> Carry:
    """What becomes of the source's schedule (``refusal``: it cannot be carried and was not dropped)."""
    ss, label = source_schedule(ckpt)
    if ss is None:
        return Carry()
    sched = ss.schedule
    target_fw = registry.framework_of(fmt)
    if no_schedule:
        return Carry(ss, warnings=[f"the LR schedule ({label}) is dropped (--no-schedule): a resume from the "
                                   "output starts its schedule anew"])
    if target_fw == schedule_framework(sched):
        return Carry(ss, warnings=[f"the LR schedule ({label}) is not written: the output is {target_fw} as the "
                                   "source, so the source's scheduler file applies to it unchanged"])
    return Carry(ss, refusal=MappingError(f"the LR schedule ({label}) is not carried to {fmt}: "
                                          f"{_why_not(sched, fmt, dst)}; {DROP_HINT}", src))


def _why_not(sched, fmt: str, dst: str) -> str:
    fw = registry.framework_of(fmt)
    if fw == "neutral" or fmt in ("candle", "safetensors"):
        return f"a {fmt} file keeps no LR schedule"
    return f"statekit writes no {sched.kind} schedule for {fw}"


def refuse_uncarried(ckpt, src: str, dst: str, fmt: str, *, no_schedule: bool = False) -> None:
    """Two optimizers (``--also`` / ``--also-out``): the schedule is not carried; refused unless dropped."""
    carry = decide(ckpt, src, dst, fmt, no_schedule=no_schedule)
    carry.refuse()
    if carry.files:
        raise MappingError(f"the LR schedule ({_label(carry.source)}) is not carried with --also / --also-out; "
                           f"{DROP_HINT}", src)


def carried(ckpt, src: str, dst: str, fmt: str, opts, *, no_schedule: bool = False):
    """``(options, Carry)``: the decision, and the options with the groups' lrs it sets."""
    carry = decide(ckpt, src, dst, fmt, no_schedule=no_schedule)
    return with_group_lrs(opts, carry), carry


def with_group_lrs(opts, carry: Carry):
    """The options with the hyperparameters the carried schedule sets in every group (lr, initial_lr)."""
    if not carry.group_lrs:
        return opts
    from dataclasses import replace

    given = [k for k in carry.group_lrs if k in opts.hyperparams]
    if given:
        raise MappingError(f"--{given[0].replace('_', '-')} and the carried LR schedule both set the groups' "
                           f"{given[0]}: the schedule's position decides it; {DROP_HINT} to set it by hand")
    return replace(opts, hyperparams={**opts.hyperparams, **carry.group_lrs})


def write_files(carry: Carry, result, dst: str, dry_run: bool):
    """Write the schedule's files beside the written optimizer (all or nothing: the optimizer output
    goes when one of them cannot be written)."""
    if not carry.files:
        return result
    if dry_run:
        result.messages.extend(f"would write {path}" for path, _ in carry.files)
        return result
    done: list[str] = []
    try:
        for path, writer in carry.files:
            size = writer(path)
            done.append(path)
            result.messages.append(f"wrote {path} ({size} bytes)")
    except BaseException:
        for path in [dst, *done]:
            if os.path.isfile(path):
                os.unlink(path)
        raise
    return result
