"""Writing rewritten schedules back in each program's own files, atomically (``statekit schedule``).

* :func:`write_torch_scheduler_state` — a torch scheduler's ``state_dict`` as ``torch.save`` writes
  it (``scheduler.pt``, Accelerate's ``scheduler.bin``): plain numbers, lists and dicts, loadable
  with ``torch.load(weights_only=True)`` and ``scheduler.load_state_dict``.
* :func:`write_torch_optimizer_group_lrs` — an ``optimizer.pt`` copied with new param-group keys
  (``lr``, a momentum); its tensors stream through (bounded memory), its other entries as read.
* :func:`write_trainer_state_max_steps` — an HF ``trainer_state.json`` with a new ``max_steps``,
  written as ``TrainerState.save_to_json`` does (indent 2, sorted keys).
* :func:`write_burn_scheduler_record` — a burn ``scheduler-N.bpk`` (scalars only).
"""

from __future__ import annotations

import json
import os

from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.formats import burnpack, torch_pt
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


def write_torch_scheduler_state(state: dict, path: str) -> None:
    """``torch.save(scheduler.state_dict(), path)``, atomically, for a state of plain values."""
    _plain_only(state, "state")
    torch_pt.save_pt(state, path)


def write_torch_optimizer_group_lrs(src: str, dst: str, group_keys: list[dict]) -> None:
    """``src`` (an optimizer ``state_dict`` file) written to ``dst`` with ``group_keys[i]`` set in param
    group i (``betas0``: the first of ``betas``). Tensors are streamed, never held whole."""
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


def write_trainer_state_max_steps(src: str, dst: str, max_steps: int) -> dict:
    """``trainer_state.json`` with ``max_steps`` set; returns the state written."""
    try:
        with open(src, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        raise FormatError(f"not a readable trainer_state.json ({exc})", src) from None
    if not isinstance(state, dict):
        raise FormatError("trainer_state.json is not a JSON object", src)
    state["max_steps"] = int(max_steps)
    text = json.dumps(state, indent=2, sort_keys=True) + "\n"
    with atomic_write(dst) as fh:
        fh.write(text.encode("utf-8"))
    return state


def write_burn_scheduler_record(scalars: dict, path: str) -> int:
    """A burn scheduler record (``scheduler-N.bpk``): ``{key: burnpack.Scalar}``, no tensors."""
    if not all(isinstance(v, burnpack.Scalar) for v in scalars.values()):
        raise MappingError("a burn scheduler record holds scalars only")
    return burnpack.write_burnpack(os.fspath(path), [], {}, dict(scalars))
