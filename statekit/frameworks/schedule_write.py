"""Schedule files written in each program's own form, atomically: beside a converted optimizer
(``convert``, :mod:`statekit.ops.schedule_carry`) and re-horizoned (``statekit schedule``,
:mod:`statekit.ops.schedule_edit`).

* :func:`write_torch_scheduler`: a torch LR scheduler's ``state_dict()`` as ``torch.save`` writes it
  (``scheduler.pt``, Accelerate's ``scheduler.bin``): plain numbers, lists and dicts, loadable with
  ``torch.load(weights_only=True)`` and ``scheduler.load_state_dict``; :func:`lambda_lr_state` is
  the LambdaLR state HF Trainer saves and loads, keys in torch's order.
* :func:`write_torch_optimizer_group_lrs`: an ``optimizer.pt`` copied with new param-group keys
  (``lr``, a momentum); its tensors stream through (bounded memory), its other entries as read.
* :func:`write_trainer_state` (and :func:`write_trainer_state_max_steps`): ``trainer_state.json``
  as ``TrainerState.save_to_json`` writes it (``indent=2, sort_keys=True``).
* :func:`write_burn_scheduler` / :func:`write_burn_scalars`: a burn 0.22 scheduler record
  (``scheduler-N.bpk``: a burnpack of scalars only, the Learner's group 0 under ``0.``), with
  statekit's string metadata (burn ignores it).
* :func:`copy_file`: a schedule file that applies unchanged, byte for byte.

Each write returns the bytes written.
"""

from __future__ import annotations

import json
import os

from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.tensor import TensorRef


def _plain_only(value, where: str, depth: int = 0) -> None:
    """A scheduler state holds no tensor and no other object (torch's weights_only load of it)."""
    if isinstance(value, dict) and depth < 8:
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise MappingError(f"a scheduler state key {k!r} at {where} is no str or int")
            _plain_only(v, f"{where}[{k!r}]", depth + 1)
    elif isinstance(value, list | tuple) and depth < 8:
        for i, v in enumerate(value):
            _plain_only(v, f"{where}[{i}]", depth + 1)
    elif not (value is None or isinstance(value, bool | int | float | str)):
        raise MappingError(f"a scheduler state holds a {type(value).__name__} at {where}: statekit writes plain "
                           "numbers, lists and dicts only")


def lambda_lr_state(base_lrs: list[float], position: int, lrs: list[float], plain_function: bool = False) -> dict:
    """A LambdaLR's ``state_dict()`` standing at ``position`` (the next update uses ``lrs``).

    ``lr_lambdas``: ``None`` per group for a plain function (HF ``constant``), ``{}`` for a
    ``functools.partial`` (every other HF schedule): what ``state_dict()`` keeps of each."""
    return {"base_lrs": [float(b) for b in base_lrs], "last_epoch": int(position), "_step_count": int(position) + 1,
            "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [float(x) for x in lrs],
            "lr_lambdas": [None if plain_function else {} for _ in base_lrs]}


def write_torch_scheduler(path: str, state: dict) -> int:
    """``torch.save(scheduler.state_dict(), path)``, atomically, for a state of plain values."""
    from statekit.formats import torch_pt

    _plain_only(state, "state")
    torch_pt.save_pt(state, path)
    return os.path.getsize(path)


def write_torch_optimizer_group_lrs(src: str, dst: str, group_keys: list[dict]) -> None:
    """``src`` (an optimizer ``state_dict`` file) written to ``dst`` with ``group_keys[i]`` set in param
    group i (``betas0``: the first of ``betas``). Tensors are streamed, never held whole."""
    from statekit.formats import torch_pt

    obj = torch_pt.load_pt(src)
    sd = obj["optimizer"] if isinstance(obj, dict) and isinstance(obj.get("optimizer"), dict) else obj
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list):
        raise FormatError("holds no optimizer state_dict (no param_groups)", src)
    groups = sd["param_groups"]
    if len(groups) != len(group_keys):
        raise MappingError(f"the optimizer has {len(groups)} param groups, the schedule {len(group_keys)}", src)
    for group, keys in zip(groups, group_keys, strict=True):
        for key, value in keys.items():
            if key == "betas0":
                if not isinstance(group.get("betas"), tuple | list):
                    raise MappingError("OneCycleLR cycles beta1, but a group holds no betas", src)
                group["betas"] = type(group["betas"])([value, *group["betas"][1:]])
                continue
            if isinstance(group.get(key), TensorRef):
                raise MappingError(f"a param group's {key} is a tensor: statekit does not rewrite tensor lrs", src)
            group[key] = float(value)
    torch_pt.save_pt(obj, dst)


def write_trainer_state(path: str, state: dict) -> int:
    data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    with atomic_write(path) as fh:
        fh.write(data)
    return len(data)


def write_trainer_state_max_steps(src: str, dst: str, max_steps: int) -> dict:
    """``trainer_state.json`` with ``max_steps`` set; returns the state written."""
    from statekit.frameworks.schedule_hf import trainer_state

    state = trainer_state(src)
    state["max_steps"] = int(max_steps)
    write_trainer_state(dst, state)
    return state


def write_burn_scalars(path: str, scalars: dict, metadata: dict[str, str] | None = None) -> int:
    """A burn scheduler record (``scheduler-N.bpk``): ``{key: burnpack.Scalar}``, no tensors."""
    from statekit.formats import burnpack

    if not all(isinstance(v, burnpack.Scalar) for v in scalars.values()):
        raise MappingError("a burn scheduler record holds scalars only")
    return burnpack.write_burnpack(os.fspath(path), [], metadata or {}, dict(scalars))


def write_burn_scheduler(path: str, counters: dict, metadata: dict[str, str] | None = None) -> int:
    """``counters``: record key → ``(variant, value)`` (``{"0.current_iter": ("UInt", 4)}``)."""
    from statekit.formats.burnpack import Scalar

    return write_burn_scalars(path, {key: Scalar(kind, value) for key, (kind, value) in counters.items()}, metadata)


def copy_file(src: str, dst: str) -> int:
    """A schedule file that applies unchanged (same framework), copied byte for byte."""
    with open(src, "rb") as fh, atomic_write(dst) as out:
        while chunk := fh.read(1 << 20):
            out.write(chunk)
    return os.path.getsize(dst)
