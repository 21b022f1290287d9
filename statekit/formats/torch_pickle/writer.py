"""The writer: protocol-2 pickles that torch's ``weights_only`` unpickler accepts, naming only
globals on its allow-list (:func:`dumps`)."""

from __future__ import annotations

import pickle
import struct

import numpy as np

from statekit import dtypes
from statekit.errors import MappingError
from statekit.formats import limits
from statekit.formats.torch_pickle.dtype_table import _STORAGE_CLASS_FOR, STATEKIT_TO_TORCH, TorchDtype
from statekit.formats.torch_pickle.values import Record, RecordClass
from statekit.tensor import TensorRef

_TUPLE_OPS = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)


class _Pickler:
    """Protocol-2 writer for torch.save-style pickles (see :func:`dumps`)."""

    def __init__(self) -> None:
        self.out: list[bytes] = [pickle.PROTO + b"\x02"]
        self.globals: dict[str, int] = {}
        self.tensors: list[TensorRef] = []
        self.keys: dict[int, str] = {}
        self.active: set[int] = set()

    def emit(self, *parts: bytes) -> None:
        self.out.extend(parts)

    def global_(self, module: str, name: str) -> None:
        """GLOBAL once, memoized (BINPUT) and fetched with BINGET after; fewer than 256 exist."""
        full = f"{module}.{name}"
        if full in self.globals:
            self.emit(pickle.BINGET, bytes([self.globals[full]]))
            return
        index = len(self.globals)
        self.globals[full] = index
        self.emit(pickle.GLOBAL, f"{module}\n{name}\n".encode(), pickle.BINPUT, bytes([index]))

    def save(self, obj: object, where: str) -> None:
        if obj is None:
            self.emit(pickle.NONE)
        elif obj is True or obj is False:
            self.emit(pickle.NEWTRUE if obj else pickle.NEWFALSE)
        elif type(obj) is int:
            self.save_int(obj, where)
        elif type(obj) is float:
            self.emit(pickle.BINFLOAT, struct.pack(">d", obj))
        elif type(obj) is str:
            self.save_str(obj)
        elif isinstance(obj, np.generic):
            self.save(obj.item(), where)
        elif isinstance(obj, np.ndarray):
            self.save_tensor(TensorRef.from_array(obj), where)
        elif isinstance(obj, TensorRef):
            self.save_tensor(obj, where)
        elif isinstance(obj, TorchDtype):
            self.global_("torch", obj.name)
        elif type(obj) in (bytes, bytearray):
            self.call("_codecs", "encode", (bytes(obj).decode("latin1"), "latin1"), where)
        elif type(obj) is complex:
            self.call("builtins", "complex", (obj.real, obj.imag), where)
        elif isinstance(obj, tuple | list | dict | set):
            self.save_container(obj, where)
        elif isinstance(obj, RecordClass):
            self.global_(*obj.name.rsplit(".", 1))
        elif isinstance(obj, Record):
            self.save_record(obj, where)
        else:
            raise MappingError(f"cannot write a {type(obj).__name__} to a .pt file (at {where})")

    def save_int(self, value: int, where: str) -> None:
        if 0 <= value < 1 << 8:
            self.emit(pickle.BININT1, bytes([value]))
        elif 0 <= value < 1 << 16:
            self.emit(pickle.BININT2, struct.pack("<H", value))
        elif -(1 << 31) <= value < 1 << 31:
            self.emit(pickle.BININT, struct.pack("<i", value))
        else:
            raw = pickle.encode_long(value)
            if len(raw) > 255:
                raise MappingError(f"integer at {where} is too large for a .pt file")
            self.emit(pickle.LONG1, bytes([len(raw)]), raw)

    def save_str(self, text: str) -> None:
        raw = limits.utf8(text)  # a lone surrogate is refused: the reader would refuse it
        self.emit(pickle.BINUNICODE, struct.pack("<I", len(raw)), raw)

    def save_tuple(self, items: tuple, where: str) -> None:
        if len(items) > 3:
            self.emit(pickle.MARK)
        for i, item in enumerate(items):
            self.save(item, f"{where}[{i}]")
        self.emit(_TUPLE_OPS[len(items)] if len(items) <= 3 else pickle.TUPLE)

    def call(self, module: str, name: str, args: tuple, where: str) -> None:
        self.global_(module, name)
        self.save_tuple(args, where)
        self.emit(pickle.REDUCE)

    def save_record(self, record: Record, where: str) -> None:
        """A :class:`Record` as read back: ``NEWOBJ(cls, ()) + BUILD(fields)`` for a class record
        (``argparse.Namespace``: its ``__dict__``), ``cls(*args)`` (+ ``BUILD(state)``) for the
        records an allowed callable made (numpy's ``_reconstruct``, a ``torch.Generator``: their
        pickled arguments and state kept as read). The names written are the record's own."""
        module, _, name = record.cls.rpartition(".")
        if not module:
            raise MappingError(f"cannot write a record of class {record.cls!r} (at {where})")
        fields = record.fields
        if set(fields) <= {"args", "state"} and "args" in fields and isinstance(fields["args"], tuple):
            self.call(module, name, fields["args"], where)
            if "state" in fields:
                self.save(fields["state"], f"{where} state")
                self.emit(pickle.BUILD)
            return
        if record.cls in ("_io.BytesIO", "io.BytesIO"):
            self.global_(module, name)
            self.emit(pickle.EMPTY_TUPLE, pickle.NEWOBJ)
            self.save(tuple(fields.get(k) for k in ("value", "position", "attributes")), f"{where} state")
            self.emit(pickle.BUILD)
            return
        if record.cls == "types.SimpleNamespace":
            self.call(module, name, (dict(fields),), where)
            return
        self.global_(module, name)
        self.emit(pickle.EMPTY_TUPLE, pickle.NEWOBJ)
        if fields:
            self.save(dict(fields), f"{where} fields")
            self.emit(pickle.BUILD)

    def save_container(self, obj: tuple | list | dict | set, where: str) -> None:
        if id(obj) in self.active:
            raise MappingError(f"cannot write a self-referencing structure to a .pt file (at {where})")
        self.active.add(id(obj))
        if isinstance(obj, tuple):
            self.save_tuple(obj, where)
        elif isinstance(obj, set):
            self.call("builtins", "set", (list(obj),), where)
        elif isinstance(obj, list):
            self.emit(pickle.EMPTY_LIST)
            if obj:
                self.emit(pickle.MARK)
                for i, item in enumerate(obj):
                    self.save(item, f"{where}[{i}]")
                self.emit(pickle.APPENDS)
        else:
            self.emit(pickle.EMPTY_DICT)
            if obj:
                self.emit(pickle.MARK)
                for key, value in obj.items():
                    self.save(key, f"{where} key")
                    self.save(value, f"{where}[{key!r}]")
                self.emit(pickle.SETITEMS)
        self.active.discard(id(obj))

    def save_tensor(self, tensor: TensorRef, where: str) -> None:
        torch_dtype = STATEKIT_TO_TORCH.get(tensor.dtype)
        if torch_dtype is None:
            raise MappingError(f"cannot write a {tensor.dtype} tensor to a .pt file (at {where})")
        key = self.keys.get(id(tensor))
        if key is None:  # self.tensors keeps the object alive, so its id stays unique
            key = self.keys[id(tensor)] = str(len(self.tensors))
            self.tensors.append(tensor)
        parameter = bool(tensor.info.get("parameter", False))
        requires_grad = bool(tensor.info.get("requires_grad", False))
        if parameter:  # _rebuild_parameter(<tensor without grad>, requires_grad, OrderedDict())
            self.global_("torch._utils", "_rebuild_parameter")
            self.emit(pickle.MARK)
        storage_class = _STORAGE_CLASS_FOR.get(torch_dtype)
        self.global_("torch._utils", "_rebuild_tensor_v2" if storage_class else "_rebuild_tensor_v3")
        self.emit(pickle.MARK, pickle.MARK)
        self.save_str("storage")
        if storage_class:
            self.global_("torch", storage_class)
            numel = tensor.numel
        else:
            self.global_("torch.storage", "UntypedStorage")
            numel = tensor.numel * dtypes.itemsize(tensor.dtype)
        self.save_str(key)
        self.save_str("cpu")
        self.save_int(numel, where)
        self.emit(pickle.TUPLE, pickle.BINPERSID)
        self.save_int(0, where)
        self.save_tuple(tensor.shape, where)
        self.save_tuple(_contiguous_strides(tensor.shape), where)
        self.emit(pickle.NEWTRUE if requires_grad and not parameter else pickle.NEWFALSE)
        self.call("collections", "OrderedDict", (), where)
        if not storage_class:
            self.global_("torch", torch_dtype)
        self.emit(pickle.TUPLE, pickle.REDUCE)
        if parameter:
            self.emit(pickle.NEWTRUE if requires_grad else pickle.NEWFALSE)
            self.call("collections", "OrderedDict", (), where)
            self.emit(pickle.TUPLE, pickle.REDUCE)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def dumps(obj: object) -> tuple[bytes, list[TensorRef]]:
    """Pickle ``obj`` like ``torch.save`` does; returns the pickle and the tensors to store.

    ``obj`` may nest dict/list/tuple/set, None/bool/int/float/str/bytes/complex, numpy scalars
    (written as Python numbers), :class:`TorchDtype`, numpy arrays and TensorRefs. Tensor ``i`` of
    the returned list is storage key ``str(i)`` (one storage per tensor object, C-contiguous,
    location ``cpu``); a TensorRef whose ``info`` says ``parameter`` becomes an ``nn.Parameter``.
    Anything else raises MappingError naming where it is.
    """
    pickler = _Pickler()
    pickler.save(obj, "top level")
    pickler.emit(pickle.STOP)
    return b"".join(pickler.out), pickler.tensors
