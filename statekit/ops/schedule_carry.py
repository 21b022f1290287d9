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
TORCH_OPTIM = {"optimizer.pt": "scheduler.pt", "optimizer.bin": "scheduler.bin"}
SCHEDULE_KEY = "statekit.schedule"  # a burn scheduler record's metadata: the source schedule, as JSON
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
    cross = registry.framework_of(fmt) != registry.framework_of(ckpt.format)
    try:
        ss, label = source_schedule(ckpt)
        unread = [w for w in ckpt.warnings if w.startswith("LR schedule not read")]
        if ss is None and unread:  # a scheduler file the reader could not read is still a schedule
            raise MappingError(f"{unread[0]}; {DROP_HINT}", src)
    except MappingError as exc:
        if no_schedule or not cross:  # (the same framework: the source's file applies as it is)
            why = exc.message.split("; " + DROP_HINT)[0]
            return Carry(warnings=[f"{why}: {'dropped (--no-schedule)' if no_schedule else 'not written'}"])
        return Carry(refusal=exc)
    if ss is None:
        return Carry()
    sched = ss.schedule
    target_fw = registry.framework_of(fmt)
    if no_schedule:
        return Carry(ss, warnings=[f"the LR schedule ({label}) is dropped (--no-schedule): a resume from the "
                                   "output starts its schedule anew"])
    try:
        if target_fw == schedule_framework(sched):
            return _same_framework(ckpt, ss, label, dst, target_fw)
        if target_fw == "burn" and sched.framework in ("torch", "hf"):
            return _to_burn(ckpt, ss, label, dst)
        if target_fw == "torch" and sched.framework == "burn":
            return _from_burn(ss, label, dst)
        raise MappingError(_why_not(sched, fmt))
    except MappingError as exc:
        return Carry(ss, refusal=MappingError(f"the LR schedule ({label}) is not carried to {fmt}: {exc.message}; "
                                              f"{DROP_HINT}", src))


def _why_not(sched, fmt: str) -> str:
    fw = registry.framework_of(fmt)
    if fw == "neutral" or fmt in ("candle", "safetensors"):
        return f"a {fmt} file keeps no LR schedule"
    return f"statekit writes no {sched.kind} schedule for {fw}"


def _folder(ckpt) -> str:
    path = os.path.abspath(os.fspath(ckpt.path))
    return path if os.path.isdir(path) else os.path.dirname(path)


def _same_framework(ckpt, ss, label: str, dst: str, fw: str) -> Carry:
    """The source's schedule files apply unchanged: copied beside an output named as the framework names it."""
    from statekit.frameworks import schedule_write

    folder, out_dir, base = _folder(ckpt), os.path.dirname(os.path.abspath(dst)), os.path.basename(dst)
    files = []
    if fw == "torch" and base in TORCH_OPTIM and ss.files.get("scheduler") in TORCH_OPTIM.values():
        files = [(os.path.join(out_dir, TORCH_OPTIM[base]), ss.files["scheduler"])]
        files += [(os.path.join(out_dir, ss.files[k]), ss.files[k]) for k in ("trainer_state",) if k in ss.files]
    elif fw == "burn" and BURN_OPTIM.match(base) and ss.files.get("scheduler"):
        files = [(os.path.join(out_dir, f"scheduler-{BURN_OPTIM.match(base).group(1)}.bpk"), ss.files["scheduler"])]
    if not files or not all(os.path.isfile(os.path.join(folder, n)) for _, n in files):
        where = "scheduler.pt beside optimizer.pt" if fw == "torch" else "scheduler-N.bpk beside optim-N.bpk"
        return Carry(ss, warnings=[f"the LR schedule ({label}) is not written: the output is {fw} as the source, so "
                                   f"the source's scheduler file applies to it unchanged ({fw} reads it from "
                                   f"{where}: name the output so to have it written)"])
    return Carry(ss, files=[(out, _copier(os.path.join(folder, n), schedule_write)) for out, n in files],
                 warnings=[f"the LR schedule ({label}) is copied beside the output unchanged (same framework)"])


def _copier(path: str, schedule_write):
    return lambda out: schedule_write.copy_file(path, out)


def _to_burn(ckpt, ss, label: str, dst: str) -> Carry:
    """A torch / HF schedule as burn's built-in scheduler in ``scheduler-N.bpk`` beside ``optim-N.bpk``."""
    import json

    from statekit.frameworks import schedule_write
    from statekit.schedule import carry

    match = BURN_OPTIM.match(os.path.basename(dst))
    if match is None:
        raise MappingError("burn's Learner reads it from scheduler-N.bpk beside optim-N.bpk: name the output "
                           "optim-N.bpk to have it written there")
    sched = ss.schedule
    form = carry.to_burn(sched)
    _lr_as_scheduled(ss)
    if "lightning" in ss.files and ss.counters.global_step is not None and sched.position != ss.counters.global_step:
        raise MappingError(f"its position {sched.position} is not the {ss.counters.global_step} optimizer steps "
                           "taken: a Lightning interval='epoch' scheduler, which counts epochs, while burn's Learner "
                           "steps its scheduler every batch")
    counter = carry.burn_counter(form)
    record = {} if counter is None else {f"0.{counter[0]}": counter[1:]}
    meta = {"source": sched.kind, "params": sched.params, "base_lrs": sched.base_lrs, "position": sched.position,
            "offset": form.offset, "burn": {"kind": form.kind, "config": form.config, "position": form.local},
            "torch_state": sched.state if sched.framework == "torch" else None,
            "trainer_state": _trainer_state(ckpt, ss), "counters": _counters(ss)}
    path = os.path.join(os.path.dirname(os.path.abspath(dst)), f"scheduler-{match.group(1)}.bpk")
    text = json.dumps(meta, default=str)  # (insertion order: torch's state_dict order comes back)
    warnings = [f"the LR schedule ({label}, position {sched.position}) goes to {os.path.basename(path)} as burn's "
                f"{form.describe()}{_offset_words(form)}: build the Learner's scheduler with that config (burn saves "
                "none)",
                "burn's Learner steps its scheduler once per batch: the record counts updates, as the source did "
                "(with grads_accumulation(k) burn would advance it k times per update)"]
    if ss.counters.skip_batches:
        warnings.append(f"the source stood {ss.counters.skip_batches} micro-batches into an epoch: burn resumes at "
                        "the start of the epoch after its checkpoint's (it saves at epoch ends only)")
    return Carry(ss, files=[(path, lambda out: schedule_write.write_burn_scheduler(
        out, record, {SCHEDULE_KEY: text}))], warnings=warnings)


def _lr_as_scheduled(ss) -> None:
    """burn takes every lr from its scheduler: a group lr that is not the schedule's (set by hand), or a
    rebuilt HF schedule that does not give the saved lr, would be lost or wrong there."""
    from statekit.schedule import model

    sched = ss.schedule
    if sched.disagrees:
        raise MappingError(sched.disagrees)
    for g, group in enumerate(ss.groups or []):
        lr = group.get("lr")
        if sched.lr_now and g < len(sched.lr_now) and isinstance(lr, int | float) \
                and not model.same_lr(lr, sched.lr_now[g]):
            raise MappingError(f"param group {g}'s lr {lr!r} is not the scheduler's {sched.lr_now[g]!r} at position "
                               f"{sched.position} (statekit doctor: schedule-lr), and burn takes every lr from its "
                               "scheduler")


def _offset_words(form) -> str:
    return f" (the source's warm-up of {form.offset} updates is done and not written)" if form.offset else ""


def _trainer_state(ckpt, ss) -> dict | None:
    name = ss.files.get("trainer_state")
    if not name:
        return None
    from statekit.frameworks import schedule_hf

    return schedule_hf.trainer_state(os.path.join(_folder(ckpt), name))


def _counters(ss) -> dict:
    c = ss.counters
    return {"global_step": c.global_step, "epoch": c.epoch, "updates_per_epoch": c.updates_per_epoch}


def _from_burn(ss, label: str, dst: str) -> Carry:
    """burn → torch: only a record statekit wrote (its metadata keeps the source schedule burn does not)."""
    from statekit.frameworks import schedule_write

    meta = _recorded(ss)
    base = os.path.basename(dst)
    if base not in TORCH_OPTIM:
        raise MappingError("torch keeps it in scheduler.pt beside optimizer.pt: name the output optimizer.pt to have "
                           "it written there")
    position = _burn_now(ss, meta)
    out_dir = os.path.dirname(os.path.abspath(dst))
    if meta["source"].startswith("hf:"):
        state, lrs = _hf_state(meta, position)
    else:
        state = _torch_state(meta, position)
        lrs = state["_last_lr"]
    files = [(os.path.join(out_dir, TORCH_OPTIM[base]), lambda out: schedule_write.write_torch_scheduler(out, state))]
    warnings = [f"the LR schedule ({label}: {meta['source']} as recorded when converted to burn) goes to "
                f"{TORCH_OPTIM[base]} at position {position}; the groups' lr set to its lr there ({lrs[0]!r})"]
    trainer = _trainer_counters(meta, position)
    if trainer is not None:
        files.append((os.path.join(out_dir, "trainer_state.json"),
                      lambda out: schedule_write.write_trainer_state(out, trainer)))
        warnings.append(f"trainer_state.json: global step {trainer['global_step']}, epoch {trainer['epoch']!r}")
    return Carry(ss, files=files, warnings=warnings, group_lrs={"lr": lrs[0], "initial_lr": meta["base_lrs"][0]}
                 if len(set(lrs)) == 1 and len(set(meta["base_lrs"])) == 1 else None)


def _recorded(ss) -> dict:
    import json

    text = ss.metadata.get(SCHEDULE_KEY)
    if not text:
        raise MappingError("burn saves no scheduler config (initial lr, iterations), so the lr of a torch schedule "
                           "cannot be told from the record; only a record statekit wrote keeps it")
    try:
        return json.loads(text)
    except ValueError:
        raise MappingError(f"its {SCHEDULE_KEY} metadata is not JSON") from None


def _burn_now(ss, meta: dict) -> int:
    """The source position the burn record stands at now (the burn run may have gone on)."""
    from statekit.schedule import carry

    burn = meta["burn"]
    sched = ss.schedule
    node = sched.children[0] if sched.kind == "burn:groups" and len(sched.children) == 1 else sched
    if burn["kind"] == "constant":
        if node.kind != "burn:constant" and sched.kind != "burn:constant":
            raise MappingError(f"it holds a {node.kind} record where statekit wrote a constant one")
        return int(meta["position"])  # a constant record keeps no count: as written
    if node.kind != f"burn:{burn['kind']}":
        raise MappingError(f"it holds a {node.kind} record where statekit wrote a {burn['kind']} one")
    return carry.burn_position(burn["kind"], burn["config"], next(iter(node.state.values()))) + int(meta["offset"])


def _hf_state(meta: dict, position: int):
    from statekit.frameworks import schedule_write
    from statekit.schedule import hf_lr

    kind, p = meta["source"][3:], dict(meta["params"])
    warm = int(p.pop("num_warmup_steps", 0) or 0)
    steps = int(p.pop("num_training_steps", 0) or 0)
    lam, _ = hf_lr.rebuild(kind, p, warm, steps, None)
    lrs = [float(b) * lam(position) for b in meta["base_lrs"]]
    return schedule_write.lambda_lr_state(meta["base_lrs"], position, lrs, kind == "constant"), lrs


def _torch_state(meta: dict, position: int) -> dict:
    from statekit.schedule import torch_lr

    state = dict(meta["torch_state"])
    state.update(last_epoch=position, _step_count=position + 1)
    cls = meta["source"][6:]
    state["_last_lr"] = [float(x) for x in torch_lr.closed_form(cls, state, position, None)]
    return state


def _trainer_counters(meta: dict, position: int) -> dict | None:
    """The source's trainer_state.json, its counters moved on by the updates the burn run took."""
    state = meta.get("trainer_state")
    if state is None:
        return None
    moved = position - int(meta["position"])
    if moved == 0:
        return state
    per_epoch = (meta.get("counters") or {}).get("updates_per_epoch")
    if not per_epoch:
        raise MappingError(f"the burn run went on {moved} updates and the updates per epoch are not known: "
                           "trainer_state.json's epoch cannot be told")
    out = dict(state, global_step=int(state["global_step"]) + moved)
    out["epoch"] = out["global_step"] / per_epoch
    out["log_history"] = list(state.get("log_history") or [])
    return out


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

    given = [k for k in carry.group_lrs if opts.hyperparams.get(k) is not None]
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


# ----------------------------------------------------------------------------- verify-resume


def lr_sequence(ckpt, n: int) -> tuple[list[float] | None, str | None]:
    """The lr (first group's) of the next ``n`` updates the schedule beside ``ckpt`` gives:
    ``(lrs, None)``, ``(None, why)`` when it cannot be told, ``(None, None)`` with no schedule."""
    from statekit.schedule import burn_lr, model, torch_lr

    try:
        ss, _ = source_schedule(ckpt)
        if ss is None:
            return None, None
        sched = ss.schedule
        if sched.framework == "burn":
            meta = _recorded(ss)
            local = _burn_now(ss, meta) - int(meta["offset"])
            burn = meta["burn"]
            return [burn_lr.lr(burn["kind"], burn["config"], local + k) for k in range(n)], None
        if sched.lr_now is None:
            return None, "the scheduler holds no current lr"
        now = float((ss.groups or [{}])[0].get("lr", sched.lr_now[0]))
        return [now] + [lrs[0] for lrs in model.next_lrs(sched, ss.groups, n - 1)], None
    except (MappingError, torch_lr.NotComputable) as exc:
        return None, exc.message
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError, IndexError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def compare_lrs(original, migrated, n: int) -> dict | None:
    """Both sides' schedules over the next ``n`` updates (None: neither has one). ``same``: the lrs
    agree (bit for bit, or to 1e-12 relative where one side is burn's arithmetic)."""
    import math

    a, why_a = lr_sequence(original, n)
    b, why_b = lr_sequence(migrated, n)
    if a is None and b is None and why_a is None and why_b is None:
        return None
    out: dict = {"original": a, "migrated": b}
    if a is None or b is None:
        missing = [(side, why) for side, seq, why in (("original", a, why_a), ("migrated", b, why_b)) if seq is None]
        out["why"] = "; ".join(f"{side}: {why or 'no LR schedule beside it (a resume starts one anew)'}"
                               for side, why in missing)
        return out
    out["exact"] = a == b
    bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True))
           if not math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-18)]
    out["same"] = not bad
    if bad:
        out["first_difference"] = {"update": bad[0] + 1, "original": a[bad[0]], "migrated": b[bad[0]]}
    return out
