"""Entry points for PyTorch ``.pt`` files: open as a Checkpoint, save optimizer state.

``open_checkpoint`` finds the optimizer state_dict (the file itself, or an entry of a training
checkpoint; ``key=`` chooses when several), and a model state_dict when the checkpoint carries
one, whose parameter names (buffers excluded) name the optimizer's positions.
"""

from __future__ import annotations

from statekit.errors import FormatError, MappingError
from statekit.formats import torch_pt
from statekit.frameworks import torch_state
from statekit.state import Checkpoint, OptimizerState

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
    """Name positional optimizer parameters from the checkpoint's own model state_dict (solved, never
    assumed: see :mod:`statekit.frameworks.torch_names`)."""
    from statekit.frameworks import torch_names

    try:
        torch_names.name_state(ckpt.optimizer, torch_names.from_model_info(ckpt.model, "the checkpoint's model"),
                               ckpt.path)
    except MappingError as exc:
        ckpt.warnings.append(f"parameters left unnamed: {exc.message}")


def save_optimizer(state: OptimizerState, path: str, *, family: str, groups: list[dict],
                   metadata: dict[str, str] | None = None, progress=None) -> int:
    sd = torch_state.to_state_dict(state, family, groups)
    torch_pt.save_pt(sd, path)
    import os

    return os.path.getsize(path)
