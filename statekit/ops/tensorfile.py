"""Plain named-tensor files (parameters, gradients): read any supported format, write by extension.

A parameters or gradients file is a model-kind checkpoint: a safetensors file, a torch state_dict
``.pt`` or a burn model ``.bpk``, keyed by parameter path (or torch name).
"""

from __future__ import annotations

import numpy as np

from statekit import io, paramid
from statekit.errors import UsageError
from statekit.formats import registry
from statekit.state import ModelInfo, ModelParam
from statekit.tensor import TensorRef


def read_tensors(path: str) -> dict[str, TensorRef]:
    """Name → tensor of a parameters/gradients file (lazy; the file stays open while used)."""
    ckpt = io.open_checkpoint(path)
    if ckpt.model is None:
        raise UsageError(f"{path}: expected a file of named tensors, found {ckpt.format} {ckpt.kind} data")
    return {m.path: m.tensor for m in ckpt.model.params}


def write_tensors(path: str, tensors: dict[str, np.ndarray], ids: dict[str, int] | None = None) -> int:
    """Write name → array in the format ``path``'s extension names (safetensors, a torch state_dict
    ``.pt``, a burn model ``.bpk`` with ``ids`` or ids generated from the names), atomically."""
    fmt = registry.from_extension(path)
    ids = ids or {}
    model = ModelInfo([ModelParam(n, tuple(a.shape), ref.dtype, id=ids.get(n, paramid.generated(n)), tensor=ref)
                       for n, a in tensors.items() for ref in [TensorRef.from_array(a)]])
    return registry.model_writer(fmt)(model, path)
