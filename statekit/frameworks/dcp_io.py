"""torch.distributed.checkpoint directories as Checkpoints, and optimizer state written as DCP.

Reading rebuilds the nested state_dict that was saved (:class:`statekit.formats.dcp.DcpReader`,
tensors lazy) and reads it like a torch file: the optimizer state_dict found in it (FQN-keyed,
from ``get_optimizer_state_dict``; Accelerate's ``optimizer`` entry; torchtitan's flat form) has
its parameters named, and a model state_dict beside it is kept as the model.

Writing (``save_optimizer``) stores the FQN-keyed form ``set_optimizer_state_dict`` takes, under
the top-level key ``optimizer`` (``dcp.load({"optimizer": osd}, checkpoint_id=...)``).
"""

from __future__ import annotations

import os

from statekit.errors import MappingError
from statekit.formats import dcp
from statekit.frameworks import base, torch_fqn, torch_io, torch_state
from statekit.state import Checkpoint, OptimizerState

FORMAT = "dcp"
OPTIMIZER_KEY = "optimizer"
SHARDS_KEY = "dcp.shards"


def open_checkpoint(path: str, key: str | None = None, **options) -> Checkpoint:
    reader = dcp.DcpReader(path)
    sd = reader.state_dict()
    ckpt = torch_io.checkpoint_from_object(sd, path, key, FORMAT)
    _torchtitan_schedule(ckpt, sd, path)
    ckpt.container = reader
    ckpt.metadata["dcp_files"] = str(len(reader.meta.files))
    if reader.meta.version:
        ckpt.metadata["dcp_version"] = reader.meta.version
    return ckpt


def _torchtitan_schedule(ckpt: Checkpoint, sd: object, path: str) -> None:
    """torchtitan's ``lr_scheduler`` / ``train_state`` entries as the schedule (:mod:`.schedule_torchtitan`)."""
    from statekit.frameworks import schedule_torchtitan

    if ckpt.schedule is not None or not schedule_torchtitan.is_torchtitan(sd):
        return
    groups = [dict(g.hyperparams) for g in ckpt.optimizer.groups] if ckpt.optimizer is not None else None
    try:
        ckpt.schedule = schedule_torchtitan.read(sd, groups, path)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as exc:
        ckpt.warnings.append(f"LR schedule not read: {exc}")


def fqn_state_dict(state: OptimizerState, family: str, groups: list[dict]) -> dict:
    """The FQN-keyed optimizer state_dict for ``state`` (every parameter must be named)."""
    unnamed = [p.label() for p in state.params if not p.path]
    if unnamed:
        raise MappingError(f"parameter {unnamed[0]} has no name; torch.distributed keys optimizer state by "
                           "parameter name (give --names)")
    return torch_fqn.from_positional(torch_state.to_state_dict(state, family, groups))


@base.optimizer_writer
def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write the FQN-keyed optimizer state as a DCP directory; ``metadata["dcp.shards"]`` (from the
    plan) is the number of data files (default 1, or one per process when sharing)."""
    family = family or state.family
    groups = groups if groups is not None else [g.hyperparams for g in state.groups]
    given = (metadata or {}).get(SHARDS_KEY)
    shards = None if given is None else _shards(given)
    sd = {OPTIMIZER_KEY: fqn_state_dict(state, family, groups)}
    return dcp.save(os.fspath(path), sd, shards=shards, progress=progress)


def _shards(text: str) -> int:
    try:
        shards = int(text)
    except ValueError:
        shards = 0
    if shards < 1:
        raise MappingError(f"{SHARDS_KEY} is {text!r}: the number of DCP data files must be a positive integer")
    return shards
