"""torch LR-scheduler files (``scheduler.pt``, Accelerate's ``scheduler.bin``) read as a schedule, no torch.

A scheduler's ``state_dict()`` is its ``__dict__`` less the optimizer: plain numbers and lists, a
``collections.Counter`` (MultiStepLR's milestones: the one global beyond a state dict's, allowed
here as a dict and for these files only), children's dicts (SequentialLR, ChainedScheduler). The
class is not saved; it is told by its keys (:func:`statekit.schedule.torch_lr.class_of`). The
optimizer file beside it gives the groups' ``lr`` (where a chainable scheduler steps from),
``initial_lr`` and OneCycleLR's ``max_lr`` / ``min_lr``.
"""

from __future__ import annotations

import math
import os

from statekit.errors import FormatError, StatekitError
from statekit.formats import torch_pickle, torch_pt
from statekit.schedule import model, torch_lr
from statekit.tensor import TensorRef

GLOBALS = {"collections.Counter": torch_pickle.allowed_callable(
    "collections.Counter", lambda counts=None: dict(counts or {}))}
OPTIMIZER_FILES = {"scheduler.pt": "optimizer.pt", "scheduler.bin": "optimizer.bin"}
GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum")


def _plain(value, depth: int = 0):
    """Tensor lrs (a 0-dim tensor) as floats; containers walked."""
    if isinstance(value, TensorRef):
        if value.numel == 1 and value.dtype != "QFloat":
            return float(value.numpy().reshape(-1)[0])
        raise FormatError(f"holds a tensor of shape {list(value.shape)} where a scheduler keeps a number")
    if isinstance(value, dict) and depth < 8:
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple) and depth < 8:
        return [_plain(v, depth + 1) for v in value]
    return value


def load(path: str) -> object:
    """The object a scheduler file holds (globals: a state dict's, and Counter)."""
    return torch_pt.load_pt(path, extra_globals=GLOBALS)


def schedule_of(sd: object, path: str) -> model.Schedule:
    """A scheduler state_dict as a Schedule (FormatError: it is none)."""
    cls = torch_lr.class_of(sd)
    if cls is None:
        raise FormatError("holds no torch LR-scheduler state_dict (no scheduler's keys)", path)
    _check(sd, path, cls)
    try:
        return model.build_torch(cls, _plain(sd))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise FormatError(f"a {cls} state_dict with a malformed entry ({type(exc).__name__}: {exc})", path) from None


def _check(sd: dict, path: str, cls: str, depth: int = 0) -> None:
    """The entries every step reads have the types torch gives them (a child's too)."""
    def bad(key, want):
        raise FormatError(f"a {cls} state_dict whose {key!r} is {type(sd[key]).__name__}, not {want}", path)

    if "last_epoch" in sd and (isinstance(sd["last_epoch"], bool) or not isinstance(sd["last_epoch"], int)):
        bad("last_epoch", "an int")
    for key in ("base_lrs", "_last_lr", "_milestones", "_schedulers", "min_lrs", "max_lrs"):
        if key in sd and not isinstance(sd[key], list):
            bad(key, "a list")
    if "milestones" in sd and not isinstance(sd["milestones"], dict):
        bad("milestones", "a Counter")
    for child in sd.get("_schedulers", ()):
        child_cls = torch_lr.class_of(child)
        if child_cls is None or depth > 4:
            raise FormatError(f"a {cls} whose child is no torch scheduler's state_dict", path)
        _check(child, path, child_cls, depth + 1)


def optimizer_groups(path: str) -> tuple[list[dict] | None, float | None]:
    """The saved param groups (their lr keys only) and the optimizer's step count, from an optimizer file."""
    obj = torch_pt.load_pt(path)
    if isinstance(obj, dict) and "optimizer" in obj and isinstance(obj["optimizer"], dict):
        obj = obj["optimizer"]
    return _optimizer_sd_groups(obj)


def read_file(path: str, optimizer: str | None = None) -> model.ScheduleState:
    """A scheduler file, with the optimizer file beside it (``optimizer.pt`` for ``scheduler.pt``) when there."""
    sched = schedule_of(load(path), path)
    ss = model.ScheduleState(sched, files={"scheduler": os.path.basename(path)})
    if optimizer is None:
        candidate = os.path.join(os.path.dirname(os.path.abspath(path)),
                                 OPTIMIZER_FILES.get(os.path.basename(path), "optimizer.pt"))
        optimizer = candidate if os.path.isfile(candidate) else None
    if optimizer is not None:
        try:
            ss.groups, ss.optimizer_step = optimizer_groups(optimizer)
            ss.files["optimizer"] = os.path.basename(optimizer)
        except StatekitError as exc:
            ss.notes.append(f"{os.path.basename(optimizer)} not read ({exc.message}): lrs from the scheduler alone")
    if ss.groups is not None and sched.lr_now is not None and len(ss.groups) != len(sched.lr_now):
        ss.notes.append(f"the optimizer has {len(ss.groups)} param groups, the scheduler {len(sched.lr_now)}: "
                        "they are not one run's")
        ss.groups = None
    return ss


def same(a, b) -> bool:
    return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-12)


def _optimizer_sd_groups(sd: object) -> tuple[list[dict] | None, float | None]:
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list):
        return None, None
    groups = [{k: _plain(g[k]) for k in GROUP_KEYS if k in g} for g in sd["param_groups"] if isinstance(g, dict)]
    steps = set()
    for entry in (sd.get("state") or {}).values():
        if isinstance(entry, dict) and "step" in entry:
            try:
                steps.add(float(_plain(entry["step"])))
            except (FormatError, TypeError, ValueError):
                continue
    return groups, (max(steps) if steps else None)


def _progress(loop: dict, key: str, *path: str):
    value = loop.get(key)
    for p in path:
        value = value.get(p) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lightning_interval(ss: model.ScheduleState, obj: dict) -> None:
    """The scheduler's interval, told by Lightning's loop counters (the interval itself is not saved):
    its steps (``scheduler_progress``) equal to the optimizer's (``optim_progress``): ``step``; equal to
    the epochs processed, at an epoch's last batch: ``epoch``, and the lr holds for the next epoch's
    updates (as many as this epoch took). Anything else: the lr after the next update is not said."""
    sched = ss.schedule
    loop = ((obj.get("loops") or {}).get("fit_loop")) or {}
    stepped = _progress(loop, "epoch_loop.scheduler_progress", "total", "completed")
    updates = _progress(loop, "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total",
                        "completed")
    in_epoch = _progress(loop, "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "current",
                         "completed")
    epochs = _progress(loop, "epoch_progress", "total", "processed")
    last = (loop.get("epoch_loop.batch_progress") or {}).get("is_last_batch") is True
    if sched is None or stepped is None or updates is None:
        ss.notes.append("Lightning does not save the scheduler's interval, and the loops' counters are not here: "
                        "the position counts optimizer steps for interval='step', epochs for 'epoch'")
        return
    if stepped == updates:
        sched.interval = "step"
        sched.notes.append(f"interval='step' (Lightning stepped it {stepped} times over {updates} optimizer steps)")
    elif stepped == epochs and last and in_epoch:
        sched.interval, sched.per_epoch = "epoch", in_epoch
        ss.counters.updates_per_epoch = in_epoch
        sched.notes.append(f"interval='epoch' (stepped {stepped} times, once per epoch; saved at an epoch's end): "
                           f"its lr holds for the next epoch's {in_epoch} updates, if it is as long as this one")
    else:
        sched.interval = "unknown"
        sched.notes.append(f"Lightning stepped the scheduler {stepped} times over {updates} optimizer steps and "
                           f"{epochs} epochs{'' if last else ', saved mid-epoch'}: its interval / frequency is not "
                           "saved, so the lr after the next update is not said")


def from_lightning(obj: dict, path: str) -> model.ScheduleState | None:
    """A Lightning ``.ckpt``'s first LR scheduler (``lr_schedulers[0]``) over ``optimizer_states[0]``, and
    its counters (``global_step``: optimizer steps; epochs completed from ``loops``). None without one."""
    schedulers = obj.get("lr_schedulers")
    if not isinstance(schedulers, list) or not schedulers:
        return None
    ss = model.ScheduleState(schedule_of(schedulers[0], path), files={
        "scheduler": "lr_schedulers[0]", "optimizer": "optimizer_states[0]", "lightning": os.path.basename(path)})
    states = obj.get("optimizer_states")
    if isinstance(states, list) and states:
        ss.groups, ss.optimizer_step = _optimizer_sd_groups(states[0])
    c = ss.counters
    c.source = os.path.basename(path)
    if isinstance(obj.get("global_step"), int):
        c.global_step = obj["global_step"]
    progress = ((obj.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress") or {}
    done = ((progress.get("current") or {}).get("completed"))
    c.epoch = float(done) if isinstance(done, int) else (float(obj["epoch"]) if isinstance(obj.get("epoch"), int)
                                                         else None)
    c.why["skip_batches"] = "Lightning resumes mid-epoch only with stateful dataloaders (their state is in loops)"
    _lightning_interval(ss, obj)
    if len(schedulers) > 1:
        ss.notes.append(f"{len(schedulers)} LR schedulers: the first is shown")
    return ss
