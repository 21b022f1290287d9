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
    return checkpoint_from_object(torch_pt.load_pt(path), path, key, FORMAT)


def checkpoint_from_object(obj: object, path: str, key: str | None, fmt: str) -> Checkpoint:
    """A Checkpoint for the object a torch file (or DCP directory) holds."""
    from statekit.frameworks import torch_fqn

    obj, fqn_notes = torch_fqn.normalize(obj, path)
    sd, where = torch_state.find_optimizer(obj, key, path)
    model_sd = torch_state.find_model(obj)
    ckpt = Checkpoint(path=path, format=fmt, kind="tensors")
    if sd is not None:
        ckpt.kind = "optimizer"
        ckpt.optimizer = torch_state.read_optimizer(sd, path)
        ckpt.optimizer.notes.extend(fqn_notes)
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


def save_optimizer(state: OptimizerState, path: str, *, family: str, groups: list[dict],
                   metadata: dict[str, str] | None = None, progress=None) -> int:
    sd = torch_state.to_state_dict(state, family, groups)
    torch_pt.save_pt(sd, path)
    import os

    return os.path.getsize(path)
