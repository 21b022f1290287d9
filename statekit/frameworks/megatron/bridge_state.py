"""Megatron-Bridge's ``train_state.pt``: the run's position, read torch-free, and checked against the rest.

Bridge (0.6.2 checked, ``training/checkpointing.py`` ``save_checkpoint``) writes, on rank 0, ``torch.save`` of
``TrainState.state_dict()`` (``training/state.py``) into the iteration folder as ``train_state.pt`` and copies it
to the save root as ``latest_train_state.pt``: eight 0-d tensors (``step``, ``consumed_train_samples``,
``skipped_train_samples``, ``consumed_valid_samples``: int64, int32 before 0.5; ``floating_point_operations_so_far``:
float32 as the save's finalize step writes it, float64 in ``state_dict`` itself; ``do_train``, ``do_valid``,
``do_test``: bool). The pickle is read by :mod:`statekit.formats.torch_pickle` (its allow-list already holds the
tensor rebuild and the storages; nothing is added). :data:`.bridge_config.TRAIN_STATE` names each key as
Megatron-LM calls the same counter.

What the position is checked against, each disagreement said, never one value picked silently:

- the common state's ``iteration`` (Bridge saves ``iteration=train_state.step``);
- on a save root, ``latest_train_state.pt``: Bridge's load takes the iteration from it before the Megatron-LM
  tracker ``latest_checkpointed_iteration.txt`` (which statekit follows), so a step that is not the tracked
  folder's means Bridge would resume elsewhere; and its counters against the folder's own file;
- the ``opt_param_scheduler``'s ``num_steps`` (samples): Bridge steps the scheduler by the global batch only on a
  successful update, and counts every iteration's batch in ``consumed_train_samples`` (those of
  ``iterations_to_skip`` also in ``skipped_train_samples``), so ``num_steps`` equals consumed − skipped when every
  update succeeded, is less when some did not (an fp16 overflow), and more is not possible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from statekit.errors import FormatError
from statekit.formats import torch_pt
from statekit.frameworks.megatron.bridge_config import TRAIN_STATE

FILE = "train_state.pt"
LATEST = "latest_train_state.pt"
_DTYPES = {"I64": int, "I32": int, "F32": float, "F64": float, "Bool": bool}
_COUNTERS = ("step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


@dataclass
class TrainState:
    """One ``train_state.pt``: its values (Python numbers) in the file's key order, and where it is."""

    path: str
    values: dict[str, int | float | bool]

    @property
    def step(self) -> int:
        return self.values["step"]


@dataclass
class Position:
    """What the folder says of the run's position: the train state shown, and what disagrees with it."""

    state: TrainState
    latest: TrainState | None = None
    notes: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)


def read(path: str) -> TrainState:
    """A ``train_state.pt``; refused naming the file and the key that is missing, not a scalar, or of a kind
    Bridge does not write."""
    obj = torch_pt.load_pt(path)
    if not isinstance(obj, dict):
        raise FormatError(f"holds a {type(obj).__name__}, not Megatron-Bridge's TrainState dict", path)
    values: dict[str, int | float | bool] = {}
    for key, tensor in obj.items():
        dtype = getattr(tensor, "dtype", None)
        if dtype not in _DTYPES or tuple(getattr(tensor, "shape", (0,))) != ():
            raise FormatError(f"{key!r} is {_what(tensor)}, not a 0-d tensor of an integer, float or bool", path)
        value = tensor.numpy().reshape(()).item()
        values[key] = _DTYPES[dtype](value)
    for key, _ in TRAIN_STATE:
        if key not in values:
            raise FormatError(f"no {key!r}: not Megatron-Bridge's TrainState (which saves {_names()})", path)
    for key in _COUNTERS:
        if _DTYPES[obj[key].dtype] is not int:
            raise FormatError(f"{key!r} is a {obj[key].dtype} tensor: Bridge saves it as an integer", path)
        if values[key] < 0:
            raise FormatError(f"{key!r} is {values[key]}, a negative count", path)
    for key in ("do_train", "do_valid", "do_test"):
        if obj[key].dtype != "Bool":
            raise FormatError(f"{key!r} is a {obj[key].dtype} tensor: Bridge saves it as a bool", path)
    return TrainState(path, values)


def _what(tensor: object) -> str:
    if hasattr(tensor, "dtype") and hasattr(tensor, "shape"):
        return f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
    return f"a {type(tensor).__name__}"


def _names() -> str:
    return ", ".join(k for k, _ in TRAIN_STATE)


def find(directory: str, given: str) -> Position | None:
    """The position of the Bridge folder ``directory`` (the iteration folder read; ``given`` the path the user
    named: the save root when they differ). None where no train state is there."""
    own = os.path.join(directory, FILE)
    root = os.path.dirname(os.path.abspath(directory))
    latest_path = os.path.join(root, LATEST)
    on_root = os.path.abspath(given) != os.path.abspath(directory)
    latest = read(latest_path) if on_root and os.path.isfile(latest_path) else None
    if os.path.isfile(own):
        position = Position(read(own), latest)
    elif latest is not None:
        position = Position(latest, latest)
        position.notes.append(f"no {FILE} in {os.path.basename(directory)}: the position is {LATEST}'s")
    else:
        return None
    if latest is not None and latest is not position.state:
        _against_latest(position, os.path.basename(directory))
    return position


def _against_latest(position: Position, folder: str) -> None:
    own, latest = position.state, position.latest
    if latest.step != own.step:
        position.disagreements.append(
            f"{LATEST} is at step {latest.step}, the folder the tracker names ({folder}) at step {own.step}: "
            f"Megatron-Bridge resumes from {LATEST}'s step, statekit read the tracked folder")
        return
    differ = [k for k in own.values if own.values[k] != latest.values.get(k)]
    differ += [k for k in latest.values if k not in own.values]
    if differ:
        position.disagreements.append(
            f"{LATEST} and {folder}/{FILE} are both at step {own.step} but differ in "
            + ", ".join(f"{k} ({latest.values.get(k)} vs {own.values.get(k)})" for k in differ))
    else:
        position.notes.append(f"{LATEST} == {folder}/{FILE} (every value)")


def check(position: Position, iteration: object, scheduler: object, flops: object) -> None:
    """The position against the common state's ``iteration`` and ``num_floating_point_operations_so_far``
    (where it has them) and the ``opt_param_scheduler``'s ``num_steps``."""
    v = position.state.values
    name = os.path.basename(position.state.path)
    if isinstance(iteration, int) and not isinstance(iteration, bool):
        if iteration != v["step"]:
            position.disagreements.append(
                f"{name} is at step {v['step']}, the common state's iteration is {iteration}")
        else:
            position.notes.append(f"{name}'s step {v['step']} == the common state's iteration")
    if isinstance(flops, int | float) and not isinstance(flops, bool) and float(flops) != float(
            v["floating_point_operations_so_far"]):
        position.disagreements.append(f"{name} holds {v['floating_point_operations_so_far']!r} floating point "
                                      f"operations so far, the common state {flops!r}")
    steps = scheduler.get("num_steps") if isinstance(scheduler, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool):
        return
    consumed, skipped = v["consumed_train_samples"], v["skipped_train_samples"]
    stepped = consumed - skipped
    if steps == stepped:
        position.notes.append(f"opt_param_scheduler num_steps {steps} == {name}'s consumed_train_samples "
                              f"{consumed} - skipped_train_samples {skipped} (every update stepped the schedule)")
    elif steps > consumed:
        position.disagreements.append(
            f"the opt_param_scheduler has stepped {steps} samples, more than the {consumed} {name} says were "
            "consumed")
    else:
        position.disagreements.append(
            f"the opt_param_scheduler has stepped {steps} samples, {name} counts {consumed} consumed - {skipped} "
            f"skipped = {stepped}: {abs(stepped - steps)} samples apart (updates that did not succeed, e.g. fp16 "
            "overflows, do not step the schedule; or the counters come from different runs)")


def attach(ckpt, position: Position, args: dict) -> None:
    """The position into a Checkpoint: ``train_state.<key>`` scalars (shown by ``inspect`` and its JSON),
    ``megatron.train_state.*`` metadata with each key's Megatron-LM name, the checks as notes, each
    disagreement as a warning; the sample counters into ``args`` as Megatron-LM keeps them (the schedule's
    consumed samples)."""
    v = position.state.values
    source = os.path.relpath(position.state.path, ckpt.path) if ckpt.path else position.state.path
    ckpt.metadata["megatron.train_state.source"] = source
    for key, value in v.items():
        ckpt.scalars[f"train_state.{key}"] = value
        ckpt.metadata[f"megatron.train_state.{key}"] = repr(value) if isinstance(value, float) else str(value)
    megatron = dict(TRAIN_STATE)
    for key in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        args.setdefault(megatron[key], v[key])
    if "megatron.flops_so_far" not in ckpt.metadata:
        ckpt.metadata["megatron.flops_so_far"] = repr(float(v["floating_point_operations_so_far"]))
    ckpt.optimizer.notes.append(
        f"run position ({source}): step {v['step']}, {v['consumed_train_samples']} train samples consumed, "
        f"{v['skipped_train_samples']} skipped, {v['consumed_valid_samples']} valid samples, "
        f"{v['floating_point_operations_so_far']!r} floating point operations; do_train={v['do_train']}, "
        f"do_valid={v['do_valid']}, do_test={v['do_test']}")
    ckpt.optimizer.notes.extend(position.notes)
    if position.disagreements:
        ckpt.metadata["megatron.train_state.disagrees"] = "; ".join(position.disagreements)
    ckpt.warnings.extend(f"the run's position disagrees: {d}" for d in position.disagreements)
