"""burn's burnpack files (burn ≥ 0.22): open as a Checkpoint, write optimizer state and models.

Implements :class:`statekit.frameworks.base.Framework` for the registry's ``burnpack`` entry.
"""

from __future__ import annotations

from statekit import dtypes
from statekit.errors import MappingError
from statekit.formats.burnpack import BurnpackFile, PackTensor, copy_burnpack, write_burnpack
from statekit.frameworks import burn
from statekit.state import Checkpoint, ModelInfo, OptimizerState

FORMAT = "burnpack"


def open_checkpoint(path: str, **options) -> Checkpoint:
    return burn.read(BurnpackFile(path))


def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write ``state`` as a burn 0.22 optimizer record. burn keeps no hyperparameters or groups
    (``groups`` is not stored); ``metadata`` (e.g. statekit.* keys) is stored as extra string
    metadata, which burn ignores. Every parameter has its own step, so ``step_policy`` has
    nothing to decide."""
    if family is not None and state.family != family:
        state.family = family
    tensors, strings, scalars = burn.to_pack(state, metadata)
    return write_burnpack(path, tensors, strings, scalars, progress=progress)


def save_model(model: ModelInfo, path: str, *, dtype: str | None = None, metadata: dict[str, str] | None = None,
               progress=None) -> int:
    """Write a model as a burn 0.22 burnpack model record: one tensor per module path with its
    ``param_id``, in record order. ``dtype`` casts float tensors (``"F32"`` for half-precision
    records); integer and bool tensors are kept. Returns the file size."""
    if dtype is not None and not dtypes.is_float(dtype):
        raise MappingError(f"cannot cast model tensors to {dtype}: not a float dtype")
    tensors: list[PackTensor] = []
    for p in model.params:
        if p.tensor is None:
            raise MappingError(f"model parameter {p.path} has no tensor data")
        if p.id is None:
            raise MappingError(f"model parameter {p.path} has no burn ParamId")
        ref = p.tensor
        if dtype is not None and dtypes.is_float(ref.dtype):
            ref = ref.cast(dtype)
        tensors.append(PackTensor(p.path, ref, param_id=p.id))
    return write_burnpack(path, tensors, dict(metadata or {}), {}, progress=progress)


def save_checkpoint(ckpt: Checkpoint, path: str, progress=None) -> int:
    """Write a checkpoint as burnpack; a burnpack source is copied exactly as burn wrote it."""
    if isinstance(ckpt.container, BurnpackFile):
        return copy_burnpack(ckpt.container, path, progress=progress)
    if ckpt.kind == "optimizer" and ckpt.optimizer is not None:
        return save_optimizer(ckpt.optimizer, path, metadata=ckpt.metadata, progress=progress)
    raise MappingError(f"cannot write a {ckpt.format} {ckpt.kind} file as burnpack yet", ckpt.path)
