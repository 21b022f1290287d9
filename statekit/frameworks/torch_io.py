"""PyTorch ``.pt`` files: open as a Checkpoint, write optimizer state and state_dicts.

Implements :class:`statekit.frameworks.base.Framework` for the registry's ``torch`` entry.

``open_checkpoint`` finds the optimizer state_dict (the file itself, or an entry of a training
checkpoint; ``key=`` chooses when several), and a model state_dict when the checkpoint carries
one, whose parameter names (buffers excluded) name the optimizer's positions.
"""

from __future__ import annotations

import os

from statekit import dtypes
from statekit.errors import FormatError, MappingError
from statekit.formats import torch_pt
from statekit.frameworks import torch_state
from statekit.state import Checkpoint, ModelInfo, OptimizerState

FORMAT = "torch"


def open_checkpoint(path: str, key: str | None = None, **options) -> Checkpoint:
    obj = torch_pt.load_pt(path)
    sd, where = torch_state.find_optimizer(obj, key, path)
    model_sd = torch_state.find_model(obj)
    ckpt = Checkpoint(path=path, format=FORMAT, kind="tensors")
    if sd is not None:
        ckpt.kind = "optimizer"
        ckpt.optimizer = torch_state.read_optimizer(sd, path)
        refs = [r for p in ckpt.optimizer.params for r in p.slots.values()]
        ckpt.n_tensors = len(refs) + sum(1 for p in ckpt.optimizer.params if "__step_dtype" in p.extra
                                         and p.extra["__step_dtype"] != "python")
        ckpt.nbytes = sum(r.nbytes for r in refs)
        if where:
            ckpt.metadata["key"] = where
            ckpt.optimizer.notes.append(f"optimizer state found under {where!r} in a training checkpoint")
        if isinstance(obj, dict):
            ckpt.scalars = {str(k): v for k, v in obj.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
    if model_sd is not None:
        ckpt.model = torch_state.read_model(model_sd)
        if ckpt.kind != "optimizer":
            ckpt.kind = "model"
            ckpt.n_tensors = len(model_sd)
            ckpt.nbytes = sum(r.nbytes for r in model_sd.values())
        elif not any(p.path for p in ckpt.optimizer.params):
            _name_from_model(ckpt)
    if ckpt.kind == "tensors" and not (isinstance(obj, dict) and obj):
        raise FormatError("holds neither an optimizer state_dict nor a model state_dict", path)
    return ckpt


def _name_from_model(ckpt: Checkpoint) -> None:
    """Name positional optimizer parameters from the checkpoint's own model state_dict."""
    params = [m for m in ckpt.model.params if not m.buffer]
    try:
        torch_state.apply_names(ckpt.optimizer, [m.path for m in params], {m.path: m.shape for m in params}, ckpt.path)
        ckpt.optimizer.notes.append("parameter names taken from the checkpoint's model state_dict")
    except MappingError as exc:
        ckpt.warnings.append(f"could not name parameters from the checkpoint's model: {exc.message}")


def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write ``state`` as a torch ``optimizer.state_dict()``. ``family`` defaults to the state's,
    ``groups`` (torch's param_group dicts) to the state's own groups; torch keeps no free-form
    metadata and a step per parameter, so ``metadata`` and ``step_policy`` are not used."""
    family = family or state.family
    if groups is None:
        groups = [dict(g.hyperparams) for g in state.groups] or [{}]
    torch_pt.save_pt(torch_state.to_state_dict(state, family, groups), path)
    return os.path.getsize(path)


def save_model(model: ModelInfo, path: str, *, dtype: str | None = None, metadata: dict[str, str] | None = None,
               progress=None) -> int:
    """Write named tensors as a torch ``state_dict`` (``{name: tensor}``, ``torch.save`` zip format)."""
    tensors = {}
    for p in model.params:
        if p.tensor is None:
            raise MappingError(f"model parameter {p.path} has no tensor data")
        tensors[p.path] = p.tensor.cast(dtype) if dtype and dtypes.is_float(p.tensor.dtype) else p.tensor
    torch_pt.save_pt(tensors, path)
    return os.path.getsize(path)
