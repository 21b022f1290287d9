"""Plain named-tensor files (parameters, gradients): read any supported format, write by extension.

A parameters or gradients file is a model-kind checkpoint: a safetensors file, a torch state_dict
``.pt`` or a burn model ``.bpk``, keyed by parameter path (or torch name).
"""

from __future__ import annotations

import os

import numpy as np

from statekit import io
from statekit.errors import UsageError
from statekit.state import ModelInfo, ModelParam
from statekit.tensor import TensorRef


def read_tensors(path: str) -> dict[str, TensorRef]:
    """Name → tensor of a parameters/gradients file (lazy; the file stays open while used)."""
    ckpt = io.open_checkpoint(path)
    if ckpt.model is None:
        raise UsageError(f"{path}: expected a file of named tensors, found {ckpt.format} {ckpt.kind} data")
    return {m.path: m.tensor for m in ckpt.model.params}


def write_tensors(path: str, tensors: dict[str, np.ndarray], ids: dict[str, int] | None = None) -> int:
    """Write name → array as safetensors, a torch state_dict (.pt) or a burn model (.bpk), atomically."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".safetensors":
        from statekit.frameworks import safetensors_io

        model = ModelInfo([ModelParam(n, tuple(a.shape), TensorRef.from_array(a).dtype, tensor=TensorRef.from_array(a))
                           for n, a in tensors.items()])
        return safetensors_io.save_model(model, path)
    if ext in (".pt", ".pth"):
        from statekit.formats import torch_pt

        torch_pt.save_pt({n: TensorRef.from_array(a) for n, a in tensors.items()}, path)
        return os.path.getsize(path)
    if ext == ".bpk":
        from statekit.formats.burnpack import PackTensor, write_burnpack
        from statekit.ops.build import generated_id

        ids = ids or {}
        return write_burnpack(path, [PackTensor(n, TensorRef.from_array(a), param_id=ids.get(n, generated_id(n)))
                                     for n, a in tensors.items()])
    raise UsageError(f"cannot tell the format of {path!r} from its extension (.safetensors, .pt or .bpk)")
