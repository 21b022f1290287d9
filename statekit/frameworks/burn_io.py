"""Entry points for burnpack files: open as a Checkpoint, save a Checkpoint's state."""

from __future__ import annotations

from statekit.errors import MappingError
from statekit.formats.burnpack import BurnpackFile, copy_burnpack, write_burnpack
from statekit.frameworks import burn
from statekit.state import Checkpoint, OptimizerState


def open_checkpoint(path: str, **options) -> Checkpoint:
    return burn.read(BurnpackFile(path))


def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None) -> int:
    """Write ``state`` as a burn 0.22 optimizer record. burn keeps no hyperparameters or groups:
    ``metadata`` (e.g. statekit.* keys) is stored as extra string metadata, which burn ignores."""
    if family is not None and state.family != family:
        state.family = family
    tensors, strings, scalars = burn.to_pack(state, metadata)
    return write_burnpack(path, tensors, strings, scalars, progress=progress)


def save_checkpoint(ckpt: Checkpoint, path: str, progress=None) -> int:
    """Write a checkpoint as burnpack; a burnpack source is copied exactly as burn wrote it."""
    if isinstance(ckpt.container, BurnpackFile):
        return copy_burnpack(ckpt.container, path, progress=progress)
    if ckpt.kind == "optimizer" and ckpt.optimizer is not None:
        return save_optimizer(ckpt.optimizer, path, metadata=ckpt.metadata, progress=progress)
    raise MappingError(f"cannot write a {ckpt.format} {ckpt.kind} file as burnpack yet", ckpt.path)
