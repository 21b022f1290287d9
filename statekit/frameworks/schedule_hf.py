"""An HF Trainer ``checkpoint-N/`` folder's schedule: ``scheduler.pt`` + ``training_args.bin`` +
``trainer_state.json`` (+ ``optimizer.pt``, ``scaler.pt``), read without torch or transformers.

``scheduler.pt`` is a torch LambdaLR's state_dict (ReduceLROnPlateau's for ``reduce_lr_on_plateau``)
and holds no warm-up or horizon: the λ is rebuilt as ``Trainer.create_scheduler`` builds it, from
``lr_scheduler_type`` / ``lr_scheduler_kwargs`` / ``warmup_steps`` (``training_args.bin``) and the
run's ``max_steps`` (``trainer_state.json``; a resume recomputes it from its own arguments and data).
Counters: ``global_step`` and ``epoch`` from ``trainer_state.json``; the micro-batches a resume skips,
``(global_step % updates_per_epoch) · gradient_accumulation_steps``, where the epoch fraction
Trainer saved settles the dataloader's length (which is not saved) to one value.

Facts and sources: ``../shared/docs/schedules-and-resume.md`` §2.
"""

from __future__ import annotations

import json
import math
import os

from statekit.errors import FormatError, MappingError, StatekitError
from statekit.frameworks import hf_args, schedule_torch
from statekit.schedule import hf_lr, model, torch_lr

SCHEDULER, OPTIMIZER, STATE, SCALER = "scheduler.pt", "optimizer.pt", "trainer_state.json", "scaler.pt"


def is_trainer_folder(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n)) for n in (OPTIMIZER, SCHEDULER, STATE))


def trainer_state(path: str) -> dict:
    """A Trainer folder's ``trainer_state.json`` as a dict (one line naming the file when it is not one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        raise FormatError(f"not a readable trainer_state.json ({exc})", path) from None
    if not isinstance(state, dict):
        raise FormatError("trainer_state.json is not a JSON object", path)
    return state


def _kwargs(value, path: str) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise FormatError(f"lr_scheduler_kwargs is no JSON object: {value[:60]!r}", path) from None
    if not isinstance(value, dict):
        raise FormatError(f"lr_scheduler_kwargs is a {type(value).__name__}, not a dict", path)
    return value


def data_position(global_step: int, epoch: float, ga: int, limit: int = 1 << 20) -> tuple[int | None, int | None, str]:
    """``(updates_per_epoch, micro-batches to skip, why not)`` from Trainer's epoch fraction.

    Trainer saves ``epoch = epochs_done + (micro-batches done in the epoch) / len(dataloader)``, with
    ``updates_per_epoch = ceil(len / ga)``; every updates-per-epoch count that leaves ``epochs_done``
    whole epochs is tried with the dataloader length its fraction implies, and the answer given only
    when all that fit agree."""
    if global_step <= 0:
        return None, 0, ""
    whole = math.floor(epoch + 1e-12)
    if whole < 0 or (whole == 0 and epoch <= 0):
        return None, None, f"epoch {epoch!r} at global step {global_step}: no position in the data"
    frac = epoch - whole
    # floor(global_step / per_epoch) == whole
    low = global_step // (whole + 1) + 1
    high = global_step // whole if whole else None
    if high is None:  # less than an epoch: global_step·ga micro-batches are frac of the dataloader
        n = round(global_step * ga / epoch)
        per_epoch = max(n // ga + (n % ga > 0), 1)
        if per_epoch > global_step and math.isclose(global_step * ga / n, epoch, rel_tol=1e-12):
            return per_epoch, global_step * ga, ""
        return None, None, f"no dataloader length gives epoch {epoch!r} at global step {global_step} with " \
                           f"gradient accumulation {ga}"
    if high - low > limit:
        return None, None, f"the dataloader length behind epoch {epoch!r} was not searched (over {limit} candidates)"
    answers = set()
    for per_epoch in range(max(low, 1), high + 1):
        micro = (global_step % per_epoch) * ga
        if micro == 0:
            if frac < 1e-12:
                answers.add((per_epoch, 0))
            continue
        if frac <= 0:
            continue
        n = round(micro / frac)
        if (per_epoch - 1) * ga < n <= per_epoch * ga and micro <= n and \
                math.isclose(whole + micro / n, epoch, rel_tol=1e-12, abs_tol=1e-12):
            answers.add((per_epoch, micro))
    if len(answers) == 1:
        return (*answers.pop(), "")
    if not answers:
        return None, None, (f"no dataloader length gives epoch {epoch!r} at global step {global_step} with "
                            f"gradient accumulation {ga}")
    return None, None, f"epoch {epoch!r} fits {len(answers)} dataloader lengths (it is not saved)"


def read_folder(path: str) -> model.ScheduleState:
    """The schedule of a Trainer folder (a ScheduleState whose schedule is None without ``scheduler.pt``)."""
    names = set(os.listdir(path))
    ss = model.ScheduleState(None, files={role: n for role, n in (("scheduler", SCHEDULER), ("optimizer", OPTIMIZER),
                                          ("trainer_state", STATE), ("training_args", hf_args.FILE),
                                          ("scaler", SCALER)) if n in names})
    args = None
    if hf_args.FILE in names:
        try:
            args = hf_args.read(os.path.join(path, hf_args.FILE), hf_args.SCHEDULE_FIELDS)
        except StatekitError as exc:
            ss.notes.append(f"{hf_args.FILE} not read ({exc.message})")
    state = trainer_state(os.path.join(path, STATE)) if STATE in names else {}
    _counters(ss, state, args)
    if OPTIMIZER in names:
        try:
            ss.groups, ss.optimizer_step = schedule_torch.optimizer_groups(os.path.join(path, OPTIMIZER))
        except StatekitError as exc:
            ss.notes.append(f"{OPTIMIZER} not read ({exc.message})")
    ss.fp16 = SCALER in names or bool(args and args.get("fp16"))
    if SCHEDULER not in names:
        return ss
    sched_path = os.path.join(path, SCHEDULER)
    sd = schedule_torch.load(sched_path)
    ss.schedule = _rebuild(sd, sched_path, args, state, ss)
    return ss


def _counters(ss: model.ScheduleState, state: dict, args: dict | None) -> None:
    c = ss.counters
    c.source = STATE if state else None
    if isinstance(state.get("global_step"), int):
        c.global_step = state["global_step"]
    if isinstance(state.get("epoch"), int | float):
        c.epoch = float(state["epoch"])
    ga = (args or {}).get("gradient_accumulation_steps")
    if c.global_step is not None and c.epoch is not None and isinstance(ga, int) and ga >= 1:
        c.updates_per_epoch, c.skip_batches, why = data_position(c.global_step, c.epoch, ga)
        if why:
            c.why["skip_batches"] = why
        elif (args or {}).get("ignore_data_skip"):
            c.skip_batches, c.why["skip_batches"] = 0, "ignore_data_skip: a resume starts the epoch's data again"
    elif c.global_step is not None:
        c.why["skip_batches"] = "needs gradient_accumulation_steps (training_args.bin) and the epoch"
    c.why["consumed_samples"] = "Trainer saves no world size: samples = updates · accumulation · batch · processes"


def _rebuild(sd: object, sched_path: str, args: dict | None, state: dict, ss: model.ScheduleState) -> model.Schedule:
    cls = torch_lr.class_of(sd)
    sched = schedule_torch.schedule_of(sd, sched_path)
    kind = (args or {}).get("lr_scheduler_type")
    if not isinstance(kind, str):
        if cls == "LambdaLR|MultiplicativeLR":
            sched.unknown = (f"a Trainer LambdaLR: its λ is rebuilt from {hf_args.FILE}, which "
                             f"{'is not there' if args is None else 'names no lr_scheduler_type'}")
        return sched
    expected = "ReduceLROnPlateau" if kind == "reduce_lr_on_plateau" else "LambdaLR|MultiplicativeLR"
    if cls != expected:
        sched.notes.append(f"{hf_args.FILE} says lr_scheduler_type={kind!r}, but scheduler.pt is a {cls}'s state: "
                           "shown as the torch scheduler it is")
        return sched
    max_steps = state.get("max_steps") if isinstance(state.get("max_steps"), int) and state["max_steps"] > 0 \
        else args.get("max_steps")
    if not isinstance(max_steps, int) or max_steps <= 0:
        if kind in ("constant", "reduce_lr_on_plateau"):
            max_steps = 0
        else:
            sched.unknown = f"{kind} needs the run's max_steps ({STATE} or {hf_args.FILE}), which neither holds"
            return sched
    warmup = hf_lr.warmup_steps(args, max_steps)
    lr_init = args.get("learning_rate") if isinstance(args.get("learning_rate"), int | float) else None
    try:
        built = model.build_hf(kind, _kwargs(args.get("lr_scheduler_kwargs"), sched_path), warmup, max_steps,
                               lr_init, schedule_torch._plain(sd))
    except MappingError as exc:
        sched.unknown = f"{kind} not rebuilt: {exc.message}"
        return sched
    built.notes.append(f"rebuilt from {hf_args.FILE} (lr_scheduler_type={kind!r}) and max_steps={max_steps}: "
                       "a resume with other arguments or data rebuilds another λ at the same position")
    _check_rebuilt(built)
    return built


def _check_rebuilt(sched: model.Schedule) -> None:
    """The rebuilt λ at the saved position must give the saved lr; else the arguments are not this run's."""
    if sched.lam is None or sched.position is None or sched.lr_now is None or sched.position < 0:
        return
    want = model.lr_at(sched, sched.position)
    if want is not None and not all(model.same_lr(a, b) for a, b in zip(want, sched.lr_now, strict=False)):
        sched.disagrees = (f"the rebuilt schedule gives lr {want[0]!r} at position {sched.position}, the file holds "
                           f"{sched.lr_now[0]!r}: the arguments are not the ones this scheduler was built with")
        sched.notes.append(sched.disagrees)
