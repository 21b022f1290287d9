"""The pickle inside PyTorch's ``.pt`` files: an allow-listing reader and a minimal writer.

``torch.save`` pickles the saved object (protocol 2) and replaces each tensor by a call::

    torch._utils._rebuild_tensor_v2(
        <persistent id ('storage', torch.FloatStorage, key, location, numel)>,
        storage_offset, size, stride, requires_grad, collections.OrderedDict())

(``_rebuild_tensor_v3`` with a ``torch.storage.UntypedStorage`` id, whose numel counts bytes, and
a trailing dtype global such as ``torch.uint16`` for dtypes without a legacy storage class;
``_rebuild_parameter(tensor, requires_grad, OrderedDict())`` around it for an ``nn.Parameter``).
The persistent id names the storage's bytes, which the container (``torch_pt``) supplies.

Reading never imports anything. :class:`_Unpickler` is a small opcode interpreter, which runs a
container's repeating items through templates it learns from the pickle; every GLOBAL is looked
up in :data:`_ALLOWED`, which holds statekit's own stand-ins for exactly the globals
``torch.load(weights_only=True)`` needs for state dicts and checkpoints. Any other global raises
:class:`~statekit.errors.UnsafePickleError` before anything runs, and REDUCE calls only those
stand-ins. Tensors come back as lazy :class:`~statekit.tensor.TensorRef` objects;
``OrderedDict`` becomes ``dict`` (order kept), ``torch.Size`` a tuple, a torch dtype a
:class:`TorchDtype`.

Writing (:func:`dumps`) emits protocol-2 opcodes that torch's ``weights_only`` unpickler
accepts, and only globals on its allow-list.

The package, one module per job:

- ``dtype_table``: torch dtype names ⇄ statekit's, the legacy storage classes
- ``geometry``: storages, a view's geometry checked, the lazy tensor built
- ``values``: dict keys, records of allowed classes, attribute state
- ``allowlist``: the allowed globals and their stand-ins (the only module a new library touches)
- ``opcodes``, ``interpreter``: the opcode loop; ``objects``: what NEWOBJ and BUILD make
- ``segment``, ``template``, ``repeats``: a container's repeating items read at once (templates)
- ``structure``: the limits and the walk that checks what was built
- ``writer``: :func:`dumps`
"""

from __future__ import annotations

from statekit.formats.torch_pickle.allowlist import _ALLOWED, allowed_callable, find_global
from statekit.formats.torch_pickle.dtype_table import (
    STATEKIT_TO_TORCH,
    TORCH_DTYPE_NAMES,
    TORCH_TO_STATEKIT,
    TorchDtype,
    statekit_dtype,
)
from statekit.formats.torch_pickle.geometry import Storage, StorageId, TensorInfo
from statekit.formats.torch_pickle.interpreter import StorageLoader, _Unpickler, loads
from statekit.formats.torch_pickle.structure import (
    MAX_DEPTH,
    MAX_EXPANSION,
    MAX_STEPS,
    check_structure,
    no_gc,
)
from statekit.formats.torch_pickle.values import Record, RecordClass, TensorKey, WrapperTensor
from statekit.formats.torch_pickle.writer import _Pickler, dumps

__all__ = [
    "MAX_DEPTH", "MAX_EXPANSION", "MAX_STEPS", "STATEKIT_TO_TORCH", "TORCH_DTYPE_NAMES", "TORCH_TO_STATEKIT",
    "Record", "RecordClass", "Storage", "StorageId", "StorageLoader", "TensorInfo", "TensorKey", "TorchDtype",
    "WrapperTensor", "_ALLOWED",
    "_Pickler", "_Unpickler", "allowed_callable", "check_structure", "dumps", "find_global", "loads", "no_gc",
    "statekit_dtype",
]
