"""The pickle inside PyTorch's ``.pt`` files: an allow-listing reader and a minimal writer.

``torch.save`` pickles the saved object (protocol 2) and replaces each tensor by a call::

    torch._utils._rebuild_tensor_v2(
        <persistent id ('storage', torch.FloatStorage, key, location, numel)>,
        storage_offset, size, stride, requires_grad, collections.OrderedDict())

(``_rebuild_tensor_v3`` with a ``torch.storage.UntypedStorage`` id, whose numel counts bytes, and
a trailing dtype global such as ``torch.uint16`` for dtypes without a legacy storage class;
``_rebuild_parameter(tensor, requires_grad, OrderedDict())`` around it for an ``nn.Parameter``).
The persistent id names the storage's bytes, which the container (``torch_pt``) supplies.

Reading never imports anything. :class:`_Unpickler` is a small opcode interpreter; every GLOBAL
is looked up in :data:`_ALLOWED`, which holds statekit's own stand-ins for exactly the globals
``torch.load(weights_only=True)`` needs for state dicts and checkpoints. Any other global raises
:class:`~statekit.errors.UnsafePickleError` before anything runs, and REDUCE calls only those
stand-ins. Tensors come back as lazy :class:`~statekit.tensor.TensorRef` objects;
``OrderedDict`` becomes ``dict`` (order kept), ``torch.Size`` a tuple, a torch dtype a
:class:`TorchDtype`.

Writing (:func:`dumps`) emits protocol-2 opcodes that torch's ``weights_only`` unpickler
accepts, and only globals on its allow-list.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import operator
import pickle
import re
import struct
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from statekit import dtypes
from statekit.errors import FormatError, MappingError, UnsafePickleError
from statekit.formats import limits
from statekit.tensor import FileSpan, TensorRef

# --------------------------------------------------------------------------------------------
# dtypes

# torch dtype name -> statekit dtype name, for the dtypes statekit can hold.
TORCH_TO_STATEKIT = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "Bool",
}
STATEKIT_TO_TORCH = {v: k for k, v in TORCH_TO_STATEKIT.items()} | {"Flex32": "float32"}

# Legacy storage classes (the persistent-id type torch writes) -> torch dtype name.
_STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
_STORAGE_CLASS_FOR = {v: k for k, v in _STORAGE_CLASSES.items()}

# Every other torch dtype a pickle may name (as a value, or as _rebuild_tensor_v3's dtype).
_OTHER_TORCH_DTYPES = (
    "complex32 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu "
    "float4_e2m1fn_x2 bits1x8 bits2x4 bits4x2 bits8 bits16 "
    + " ".join(f"uint{i} int{i}" for i in range(1, 8))
).split()
TORCH_DTYPE_NAMES = (
    frozenset(TORCH_TO_STATEKIT) | frozenset(_STORAGE_CLASSES.values()) | frozenset(_OTHER_TORCH_DTYPES)
)


@dataclass(frozen=True)
class TorchDtype:
    """A ``torch.dtype`` value found in a pickle (``torch.float32`` → ``TorchDtype("float32")``)."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def statekit_dtype(torch_dtype: str) -> str:
    """statekit's dtype name for a torch dtype name; FormatError naming it when unsupported."""
    try:
        return TORCH_TO_STATEKIT[torch_dtype]
    except KeyError:
        pass
    if torch_dtype.startswith("complex"):
        kind = "complex tensors are"
    elif torch_dtype.startswith(("qint", "quint")):
        kind = "quantized tensors are"
    else:
        kind = "this dtype is"
    raise FormatError(f"tensor dtype torch.{torch_dtype} is not supported: {kind} not handled by statekit")


# --------------------------------------------------------------------------------------------
# storages and tensors


class StorageId(NamedTuple):
    """A storage reference parsed from a persistent id: what the container must supply."""

    key: str
    dtype: str  # torch dtype name of the storage class ("uint8" for UntypedStorage)
    numel: int  # elements of ``dtype``
    location: str  # "cpu", "cuda:0", ...
    view: tuple | None  # legacy format only: (view_key, offset, numel) of a storage view

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(TORCH_TO_STATEKIT[self.dtype])

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class Storage:
    """The bytes of one storage, resolved lazily (``resolve()`` returns a buffer of ``nbytes``)."""

    def __init__(self, sid: StorageId, resolve: Callable[[], memoryview], big_endian: bool = False):
        self.key = sid.key
        self.dtype = sid.dtype
        self.nbytes = sid.nbytes
        self.location = sid.location
        self.resolve = resolve
        self.big_endian = big_endian
        self.span = None  # a FileSpan of the storage's bytes, when the container can pread them

    def array(self, dtype: np.dtype) -> np.ndarray:
        """The whole storage as a 1-D little-endian array of ``dtype`` (read-only unless swapped)."""
        count = self.nbytes // dtype.itemsize
        if not self.big_endian or dtype.itemsize == 1:
            return np.frombuffer(self.resolve(), dtype=dtype, count=count)
        swapped = np.frombuffer(self.resolve(), dtype=f">u{dtype.itemsize}", count=count)
        return swapped.astype(f"<u{dtype.itemsize}").view(dtype)


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise FormatError(f"tensor {what} {limits.short(value)} is not a tuple of non-negative integers")
    return tuple(value)


_DTYPE_CACHE: dict[str, tuple[str, np.dtype, int]] = {}
_SMALL = 1 << 28  # a dimension and stride up to this, times each other and any item size, fit in 63 bits


def _dtype_entry(torch_dtype: str) -> tuple[str, np.dtype, int]:
    name = statekit_dtype(torch_dtype)
    np_dtype = dtypes.numpy_dtype(name)
    _DTYPE_CACHE[torch_dtype] = entry = (name, np_dtype, np_dtype.itemsize)
    return entry


def _geometry(size: tuple, stride: tuple, itemsize: int, key: str) -> tuple[int, int, bool]:
    """(element count, furthest element offset, C-contiguous) of a view; one pass that also checks
    the dimensions (non-negative ints, rank, byte counts within 63 bits even beside a zero-size
    dimension) and the strides (non-negative ints whose byte offsets fit in 63 bits)."""
    if len(size) > limits.MAX_RANK:
        raise FormatError(f"tensor of storage '{key}': rank {len(size)} exceeds the limit of {limits.MAX_RANK}")
    numel, nonzero, extent, expected, contiguous = 1, itemsize, 0, 1, True
    for i in range(len(size) - 1, -1, -1):
        n, s = size[i], stride[i]
        if type(n) is not int or type(s) is not int or n < 0 or s < 0:
            raise FormatError(f"tensor size {limits.short(size)} or stride {limits.short(stride)} is not a tuple of non-negative integers")
        numel *= n
        nonzero *= n or 1
        extent += (n - 1) * s if n else 0
        if nonzero > limits.MAX_ELEMENTS or s * itemsize > limits.MAX_ELEMENTS or extent * itemsize > limits.MAX_ELEMENTS:
            problem = limits.shape_problem(size, itemsize) or limits.stride_problem(size, stride, itemsize)
            raise FormatError(f"tensor of storage '{key}': {problem or 'byte offsets beyond 2^63'}")
        if n != 1 and s != expected:
            contiguous = False
        expected *= n
    return numel, extent, contiguous


class TensorInfo(MutableMapping):
    """A loaded tensor's ``info``: ``{torch_dtype, parameter, requires_grad, device, storage_key,
    storage_offset, stride}``, as a mapping that holds only what is the view's own.

    The four fields most views share live in one dict for all of them (see :func:`_shared_info`),
    so a file of 10^6 views carries no dict per view. Writing to it (``info[k] = v``,
    ``update``) first copies the fields into a dict of this view's own.
    """

    __slots__ = ("shared", "key", "offset", "stride", "own")
    _FIELDS = ("torch_dtype", "parameter", "requires_grad", "device", "storage_key", "storage_offset", "stride")

    def __init__(self, shared: dict, key: str, offset: int, stride: tuple):
        self.shared, self.key, self.offset, self.stride, self.own = shared, key, offset, stride, None

    def as_dict(self) -> dict:
        if self.own is not None:
            return self.own
        shared = self.shared
        return {"torch_dtype": shared["torch_dtype"], "parameter": shared["parameter"],
                "requires_grad": shared["requires_grad"], "device": shared["device"],
                "storage_key": self.key, "storage_offset": self.offset, "stride": self.stride}

    def __getitem__(self, name: str) -> object:
        if self.own is not None:
            return self.own[name]
        if name == "storage_key":
            return self.key
        if name == "storage_offset":
            return self.offset
        if name == "stride":
            return self.stride
        return self.shared[name]

    def get(self, name: str, default: object = None) -> object:
        if self.own is not None:
            return self.own.get(name, default)
        return self[name] if name in self._FIELDS else default

    def __contains__(self, name: object) -> bool:
        return name in self.own if self.own is not None else name in self._FIELDS

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.own) if self.own is not None else len(self._FIELDS)

    def __setitem__(self, name: str, value: object) -> None:
        self.own = self.as_dict()
        self.own[name] = value

    def __delitem__(self, name: str) -> None:
        self.own = self.as_dict()
        del self.own[name]

    def __eq__(self, other: object) -> bool:
        return self.as_dict() == (other.as_dict() if isinstance(other, TensorInfo) else other)

    def __repr__(self) -> str:
        return repr(self.as_dict())

    def copy(self) -> dict:
        return dict(self.as_dict())


_SHARED_INFO: dict[tuple, dict] = {}


def _shared_info(torch_dtype: str, requires_grad: bool, device: str) -> dict:
    """The fields many views share, one dict per combination (a bounded cache; never mutated)."""
    key = (torch_dtype, requires_grad, device)
    shared = _SHARED_INFO.get(key)
    if shared is None:
        shared = {"torch_dtype": torch_dtype, "parameter": False, "requires_grad": requires_grad, "device": device}
        if len(_SHARED_INFO) < 4096:
            _SHARED_INFO[key] = shared
    return shared


def _tensor(
    storage: object, offset: object, size: object, stride: object, torch_dtype: str | None = None,
    requires_grad: bool = False,
) -> TensorRef:
    """A TensorRef viewing ``storage`` like ``torch.Tensor.set_(storage, offset, size, stride)``.

    The tensor's dtype is the storage's unless ``torch_dtype`` says otherwise (untyped storages).
    """
    if type(storage) is not Storage and not isinstance(storage, Storage):
        raise FormatError(f"tensor storage is {type(storage).__name__}, not a storage reference")
    torch_dtype = torch_dtype or storage.dtype
    name, np_dtype, itemsize = _DTYPE_CACHE.get(torch_dtype) or _dtype_entry(torch_dtype)
    if type(size) is not tuple or type(stride) is not tuple:  # torch.Size arrives as a tuple already
        size, stride = _int_tuple(size, "size"), _int_tuple(stride, "stride")
    if len(size) != len(stride) or type(offset) is not int or offset < 0:
        raise FormatError(f"bad tensor geometry: offset {limits.short(offset)}, size {limits.short(size)}, stride {limits.short(stride)}")
    if len(size) == 1 and type(size[0]) is int and type(stride[0]) is int and 0 <= size[0] <= _SMALL >= stride[0] >= 0:
        numel, step = size[0], stride[0]  # one dimension of a plausible size: nothing can overflow
        extent, contiguous = (numel - 1) * step if numel else 0, numel == 1 or step == 1
    else:
        numel, extent, contiguous = _geometry(size, stride, itemsize, storage.key)
    capacity = storage.nbytes // itemsize
    if numel:
        needed = offset + extent + 1
        if needed > capacity:
            raise FormatError(
                f"a tensor of size {list(size)} needs {needed} elements of storage '{storage.key}', "
                f"which holds {capacity}"
            )
    if numel > capacity and numel * itemsize > limits.MAX_INFLATE:  # stride-0 / overlapping view
        raise FormatError(
            f"a view of size {list(size)} repeats storage '{storage.key}' ({capacity} elements) into "
            f"{numel * itemsize} bytes; statekit refuses views that outgrow their storage past "
            f"{limits.MAX_INFLATE >> 20} MiB")
    shared = _SHARED_INFO.get((torch_dtype, requires_grad, storage.location)) or _shared_info(
        torch_dtype, requires_grad, storage.location)
    info = TensorInfo(shared, storage.key, offset, stride)
    if numel == 0 or (contiguous and not storage.big_endian):
        start, stop = offset * itemsize, (offset + numel) * itemsize
        span = storage.span
        if span is not None:
            return TensorRef(name, size, info=info, span=FileSpan(span.file, span.offset + start, stop - start))
        return TensorRef(name, size, loader=lambda: storage.resolve()[start:stop], info=info)

    def strided() -> np.ndarray:
        base = storage.array(np_dtype)[offset:]
        strides = tuple(s * itemsize for s in stride)
        return np.lib.stride_tricks.as_strided(base, size, strides, writeable=False)

    return TensorRef(name, size, array_loader=strided, info=info)


def _python_state(state: object) -> dict:
    """A tensor's Python attributes from pickled object state: a dict or (dict, slots dict)."""
    if isinstance(state, tuple) and len(state) == 2:
        parts = state
    else:
        parts = (state,)
    merged: dict = {}
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict):
            raise FormatError(f"tensor state {limits.short(state)} is not a dict of attributes")
        merged.update(part)
    return merged


def _with_info(tensor: object, **info: object) -> TensorRef:
    if not isinstance(tensor, TensorRef):
        raise FormatError(f"expected a tensor, got {type(tensor).__name__}")
    return replace(tensor, info={**tensor.info, **info})


def _check_hooks(hooks: object) -> None:
    if hooks is not None and not isinstance(hooks, dict):
        raise FormatError(f"tensor backward hooks {limits.short(hooks)} are not a dict")


def _check_metadata(metadata: object) -> None:
    """``get_tensor_metadata``: only ``{}`` or all-False flags (no conjugate/negative bit)."""
    if metadata is None or (isinstance(metadata, dict) and not any(metadata.values())):
        return
    raise FormatError(f"tensor metadata {limits.short(metadata)} (conjugate/negative bit) is not supported")


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if backward_hooks is not None and type(backward_hooks) is not dict:
        _check_hooks(backward_hooks)
    if metadata is not None:
        _check_metadata(metadata)
    return _tensor(storage, storage_offset, size, stride, None, bool(requires_grad))


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None
):
    _check_hooks(backward_hooks)
    _check_metadata(metadata)
    if not isinstance(dtype, TorchDtype):
        raise FormatError(f"_rebuild_tensor_v3 dtype {limits.short(dtype)} is not a torch dtype")
    return _tensor(storage, storage_offset, size, stride, dtype.name, bool(requires_grad))


def _rebuild_parameter(data, requires_grad, backward_hooks):
    _check_hooks(backward_hooks)
    return _with_info(data, parameter=True, requires_grad=bool(requires_grad))


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    param = _rebuild_parameter(data, requires_grad, backward_hooks)
    attributes = _python_state(state)
    return _with_info(param, python_state=attributes) if attributes else param


def _rebuild_from_type_v2(func, new_type, args, state):
    """A tensor (sub)class with Python attributes: ``func(*args)`` then the attributes."""
    if (
        not isinstance(func, _Callable)
        or not isinstance(new_type, _TensorType)
        or not isinstance(args, tuple)
    ):
        raise FormatError(f"unsupported _rebuild_from_type_v2 call for {limits.short(new_type)}")
    tensor = _with_info(func.fn(*args), **({"parameter": True} if new_type.name == "Parameter" else {}))
    attributes = _python_state(state)
    return _with_info(tensor, python_state=attributes) if attributes else tensor


def _rebuild_qtensor(*_args):
    """Allowed only so that a quantized tensor is refused by its storage's dtype, read first."""
    raise FormatError("quantized tensors are not supported by statekit")


# --------------------------------------------------------------------------------------------
# the allow-list


@dataclass(frozen=True)
class _Callable:
    """An allowed global that REDUCE may call: statekit's stand-in ``fn`` for ``name``."""

    name: str
    fn: Callable


@dataclass(frozen=True, eq=False)  # one object per class: hashed by identity (persistent ids are cached)
class _StorageType:
    """A ``torch.*Storage`` class named in a persistent id; ``dtype`` is a torch dtype name."""

    dtype: str


@dataclass(frozen=True)
class _TensorType:
    """``torch.Tensor`` or ``torch.nn.parameter.Parameter`` as ``_rebuild_from_type_v2``'s type."""

    name: str


def _ordered_dict(items=()):
    if items == ():
        return {}
    if isinstance(items, dict):
        return dict(items)
    if not isinstance(items, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in items
    ):
        raise FormatError("OrderedDict arguments are not a list of pairs")
    return dict((_key(k), v) for k, v in items)


def _key(key: object) -> object:
    """A dict key or set member: a scalar, or a short flat tuple of scalars (hashing nested
    shared tuples takes exponential time, so those are refused)."""
    if isinstance(key, _FLAT_KEYS):
        return key
    if isinstance(key, tuple) and len(key) <= 64 and all(isinstance(k, _FLAT_KEYS) for k in key):
        return key
    raise FormatError(f"malformed pickle: a {type(key).__name__} as a dict key or set member is not supported")


def _keys(keys) -> list:
    if set(map(type, keys)) <= _FLAT_KEY_TYPES:  # (all of one plain type, usually: no loop in Python)
        return keys
    return [_key(k) for k in keys]


def _size(dims=()):
    return _int_tuple(dims, "torch.Size")


def _set(items=()):
    if not isinstance(items, list | tuple | set | frozenset):
        raise FormatError(f"set() argument is {type(items).__name__}, not a list")
    return set(_keys(items))


def _complex(real=0.0, imag=0.0):
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise FormatError("complex() arguments are not numbers")
    return complex(real, imag)


def _encode(text, encoding="utf-8"):
    """``_codecs.encode``: how protocol 2 pickles bytes (``encode(str, 'latin1')``)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise FormatError(f"_codecs.encode is allowed only for str with 'latin1', not {limits.short(encoding)}")
    return text.encode("latin1")


def _bytearray(data=b"", encoding=None):
    if isinstance(data, str) and encoding is not None:
        return bytearray(_encode(data, encoding))
    if isinstance(data, bytes | bytearray) and encoding is None:
        return bytearray(data)
    raise FormatError("bytearray() is allowed only from bytes or a latin1 str")


def _allowed_globals() -> dict[str, object]:
    allowed: dict[str, object] = {}
    for fn in (
        _rebuild_tensor,
        _rebuild_tensor_v2,
        _rebuild_tensor_v3,
        _rebuild_parameter,
        _rebuild_parameter_with_state,
        _rebuild_qtensor,
    ):
        allowed[f"torch._utils.{fn.__name__}"] = _Callable(fn.__name__, fn)
    allowed["torch._tensor._rebuild_from_type_v2"] = _Callable("_rebuild_from_type_v2", _rebuild_from_type_v2)
    for full, fn in {
        "collections.OrderedDict": _ordered_dict,
        "torch.Size": _size,
        "builtins.set": _set,
        "builtins.complex": _complex,
        "builtins.bytearray": _bytearray,
        "_codecs.encode": _encode,
    }.items():
        allowed[full] = _Callable(full, fn)
    allowed["torch.Tensor"] = _TensorType("Tensor")
    allowed["torch.nn.parameter.Parameter"] = _TensorType("Parameter")
    for cls, dtype in _STORAGE_CLASSES.items():
        allowed[f"torch.{cls}"] = allowed[f"torch.cuda.{cls}"] = _StorageType(dtype)
    allowed["torch.UntypedStorage"] = allowed["torch.storage.UntypedStorage"] = _StorageType("uint8")
    for name in TORCH_DTYPE_NAMES:
        allowed[f"torch.{name}"] = TorchDtype(name)
    return allowed


_ALLOWED = _allowed_globals()
_ORDERED_DICT, _REBUILD_TENSOR_V2 = _ALLOWED["collections.OrderedDict"], _ALLOWED["torch._utils._rebuild_tensor_v2"]
_MODULE_RENAMES = {"__builtin__": "builtins"}  # Python 2 spellings that protocol 2 still writes


def find_global(module: str, name: str, extra: Mapping[str, object] | None = None) -> object:
    """statekit's stand-in for global ``module.name``; UnsafePickleError when not allowed.

    ``extra`` adds globals allowed for one kind of pickle only (DCP's ``.metadata`` classes).
    """
    full = f"{_MODULE_RENAMES.get(module, module)}.{name}"
    found = _ALLOWED.get(full)
    if found is None and extra is not None:
        found = extra.get(full)
    if found is None:
        raise UnsafePickleError(f"refusing to load global '{full}' from pickle: not on statekit's allow-list")
    return found


# --------------------------------------------------------------------------------------------
# plain records: instances of allowed classes (DCP metadata), never the classes themselves


@dataclass(frozen=True)
class RecordClass:
    """An allowed class that pickles as ``NEWOBJ(cls, ()) + BUILD(state)``.

    Unpickling builds a :class:`Record` instead of an instance: nothing of the class runs.
    ``state_fields`` names the items of a tuple state (what a custom ``__getstate__`` returns,
    e.g. DCP's ``TensorProperties``); a dict state (or ``(dict, slots dict)``) sets fields by name.
    """

    name: str
    state_fields: tuple[str, ...] = ()


@dataclass(eq=False)  # hashed by identity: records serve as dict keys (DCP's MetadataIndex)
class Record:
    """A plain stand-in for one instance of a :class:`RecordClass`: its class name and fields."""

    cls: str
    fields: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> object:
        return self.fields[name]

    def get(self, name: str, default: object = None) -> object:
        return self.fields.get(name, default)

    @property
    def kind(self) -> str:
        """The class name without its module (``TensorStorageMetadata``)."""
        return self.cls.rsplit(".", 1)[-1]


# dict keys and set members: hashed in constant time (a Record by identity)
_FLAT_KEYS = (str, int, float, bool, type(None), bytes, complex, TorchDtype, Record)
_FLAT_KEY_TYPES = frozenset(_FLAT_KEYS)


def allowed_callable(name: str, fn: Callable) -> object:
    """A stand-in that REDUCE may call, for ``extra_globals`` (``fn`` gets the pickled arguments)."""
    return _Callable(name, fn)


def _build_record(record: Record, rclass: RecordClass, state: object) -> None:
    if isinstance(state, tuple) and rclass.state_fields and len(state) == len(rclass.state_fields):
        record.fields.update(zip(rclass.state_fields, state, strict=True))
        return
    merged = _python_state(state)
    if not all(isinstance(k, str) for k in merged):
        raise FormatError(f"state of a {rclass.name} has non-string field names")
    record.fields.update(merged)


# --------------------------------------------------------------------------------------------
# reading

StorageLoader = Callable[[StorageId], Storage]
MAX_DEPTH = 100  # container nesting; torch's checkpoints nest a handful of levels
MAX_STEPS = 200_000_000  # opcodes in one pickle (a torch.save pickle runs ~40 a tensor)
MAX_EXPANSION = 1_000_000  # objects by reference beyond 16 per opcode (shared objects counted per use)
_MAX_LONG_BYTES = 1024
_OPS: dict[int, Callable[[_Unpickler], None]] = {}
_STOP = pickle.STOP[0]
_I32, _U16, _U32, _U64, _F64 = (struct.Struct(f) for f in ("<i", "<H", "<I", "<Q", ">d"))


def _op(*codes: bytes):
    def register(fn):
        for code in codes:
            _OPS[code[0]] = fn
        return fn

    return register


class _Unpickler:
    """Interprets one pickle from ``data[pos:]`` using only the opcodes registered in ``_OPS``."""

    def __init__(
        self,
        data: bytes | mmap.mmap,
        pos: int,
        storage_loader: StorageLoader | None,
        extra_globals: Mapping[str, object] | None = None,
    ):
        self.data = data
        self.extra_globals = extra_globals
        self.records: dict[int, RecordClass] = {}  # id(Record) -> its class, for BUILD
        self.pos = pos
        self.code = 0  # the opcode being interpreted
        self.storage_loader = storage_loader
        self.stack: list = []
        self.metastack: list[list] = []
        # the memo: a list while the indices come in order (0, 1, 2, ... as every pickler writes
        # them: 8 bytes an entry, no int objects kept), a dict once one does not
        self.memo: list | dict[int, object] = []
        self.depths: dict[int, int] = {}  # id → nesting depth of the containers built so far
        self.built: list = []  # keeps them alive, so that ids stay unique
        self.steps = 0
        self.sids: dict[tuple, StorageId] = {}  # persistent ids parsed so far
        self.last_sid: StorageId | None = None
        self.overwrites = 0  # memo entries replaced so far (tensor_call reuses what it read only if none was)
        self.last_call: tuple = ((), 0, None, None)  # tensor_call: (its memo reads, overwrites, pid, storage)

    def truncated(self, n: int) -> FormatError:
        return FormatError(
            f"pickle is truncated: needs {n} bytes at offset {self.pos}, data ends at {len(self.data)}"
        )

    def truncated_at(self, pos: int, n: int) -> FormatError:
        self.pos = pos
        return self.truncated(n)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self.truncated(1)
        self.pos += 1
        return self.data[self.pos - 1]

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.truncated(n)
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def unpack(self, fmt: struct.Struct) -> int | float:
        if self.pos + fmt.size > len(self.data):
            raise self.truncated(fmt.size)
        self.pos += fmt.size
        return fmt.unpack_from(self.data, self.pos - fmt.size)[0]

    def readline(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 1024)
        if end < 0 and self.pos + 1024 >= len(self.data):
            raise self.truncated(len(self.data) - self.pos + 1)
        if end < 0:
            raise FormatError(f"pickle GLOBAL name at offset {self.pos} is unterminated")
        line, self.pos = self.data[self.pos : end], end + 1
        return line.decode("utf-8")

    def nest(self, container: object, items) -> object:
        """Record ``container``'s depth from ``items`` (refused past the limit, as it is built).

        Containers of depth 1 (a tuple of ints) are not recorded — a container with no record
        counts as depth 1 — so the many small tuples of a large pickle are not kept alive; those
        recorded are, so that their ids stay unique."""
        if not any(issubclass(kind, _CONTAINERS) for kind in set(map(type, items))):
            return container  # no container among the items (the values of a state_dict): no deeper
        depths = self.depths
        depth = depths.get(id(container), 1)
        for item in items:
            inner = depths.get(id(item))
            if inner is None:
                if depth < 2 and isinstance(item, _CONTAINERS):
                    depth = 2
            elif inner >= depth:
                depth = inner + 1
        if depth > 1:
            if depth > MAX_DEPTH:
                raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
            if id(container) not in depths:
                self.built.append(container)
            depths[id(container)] = depth
        return container

    def put(self, index: int, value: object) -> None:
        """memo[index] = value."""
        memo = self.memo
        if index == len(memo) and type(memo) is list:
            memo.append(value)
            return
        self.overwrites += 1  # (or a new sparse index: counted alike)
        if type(memo) is list:
            if index < len(memo):
                memo[index] = value
                return
            self.memo = memo = dict(enumerate(memo))
        memo[index] = value

    def pop_mark(self) -> list:
        if not self.metastack:
            raise FormatError("malformed pickle: no MARK on the stack")
        items, self.stack = self.stack, self.metastack.pop()
        return items

    def target(self, kind: type) -> object:
        top = self.stack[-1]
        if not isinstance(top, kind):
            raise FormatError(f"malformed pickle: cannot add items to a {type(top).__name__}")
        return top

    def dispatch(self, code: int, start: int) -> None:
        """Run one opcode through its handler in ``_OPS`` (those not inlined in :meth:`load`)."""
        if self.steps > MAX_STEPS:
            raise FormatError(f"pickle runs more than {MAX_STEPS} opcodes: refused")
        handler = _OPS.get(code)
        if handler is None:
            raise FormatError(f"unsupported pickle opcode {bytes([code])!r} at offset {start}")
        handler(self)

    def load(self) -> object:
        """The interpreter loop: torch.save's opcodes inline (checked like their ``_OPS`` handlers,
        which run the rest), a tensor's whole ``_rebuild_tensor_v2`` call at once (:meth:`tensor_call`)."""
        data, end, u32 = self.data, len(self.data), _U32.unpack_from
        pos, start, steps = self.pos, self.pos, self.steps
        stack, metastack, memo = self.stack, self.metastack, self.memo
        try:
            while True:
                start = pos
                if pos >= end:
                    raise self.truncated_at(pos, 1)
                code = data[pos]
                pos += 1
                steps += 1
                if code == _BINGET or code == _LONG_BINGET:
                    width = 1 if code == _BINGET else 4
                    if pos + width > end:
                        raise self.truncated_at(pos, width)
                    stack.append(memo[data[pos] if width == 1 else u32(data, pos)[0]])
                    pos += width
                elif code == _LONG_BINPUT or code == _BINPUT:
                    width = 1 if code == _BINPUT else 4
                    if pos + width > end:
                        raise self.truncated_at(pos, width)
                    self.put(data[pos] if width == 1 else u32(data, pos)[0], stack[-1])
                    memo = self.memo
                    pos += width
                elif code == _MARK:
                    if len(metastack) >= MAX_DEPTH:
                        raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
                    fast = data[pos : pos + 1] == b"(" and type(stack[-1] if stack else None) is _Callable
                    if fast and (match := _TENSOR_CALL.match(data, start)) and self.tensor_call(match.groups(), stack):
                        pos, steps, memo = match.end(), steps + _TENSOR_CALL_OPS, self.memo
                        continue
                    metastack.append(stack)
                    stack = []
                elif code == _TUPLE:
                    if not metastack:
                        raise FormatError("malformed pickle: no MARK on the stack")
                    items = tuple(stack)
                    stack = metastack.pop()
                    stack.append(self.nest(items, items) if any(map(_is_container, items)) else items)
                elif code in _INTS:
                    width = _INTS[code]
                    if pos + width > end:
                        raise self.truncated_at(pos, width)
                    stack.append(data[pos] if width == 1 else _INT_FORMATS[width].unpack_from(data, pos)[0])
                    pos += width
                elif code == _REDUCE:
                    args = stack.pop()
                    stack[-1] = _call(stack[-1], args)
                elif _TUPLE1 <= code <= _TUPLE3:
                    n = code - _TUPLE1 + 1
                    if len(stack) < n:
                        raise FormatError("malformed pickle: stack underflow in TUPLE")
                    items = tuple(stack[-n:])
                    del stack[-n:]
                    stack.append(self.nest(items, items) if any(map(_is_container, items)) else items)
                elif code == _BINUNICODE:
                    n = u32(data, pos)[0] if pos + 4 <= end else -1
                    if n < 0 or pos + 4 + n > end:
                        raise self.truncated_at(pos, 4 if n < 0 else 4 + n)
                    stack.append(_text(data[pos + 4 : pos + 4 + n]))
                    pos += 4 + n
                    fast = data[pos : pos + 1] in _PUTS  # a name, then its tensor?
                    if fast and (match := _KEYED_CALL.match(data, pos)) and self.keyed_call(match.groups(), stack):
                        pos, steps, memo = match.end(), steps + _TENSOR_CALL_OPS + 3, self.memo
                elif code in _INLINE_CONSTANTS:
                    stack.append(_INLINE_CONSTANTS[code])
                elif code == _STOP:
                    return stack.pop() if stack else _fail("malformed pickle: empty stack at STOP")
                else:
                    self.pos, self.code, self.steps, self.stack = pos, code, steps, stack
                    self.dispatch(code, start)
                    pos, stack, memo = self.pos, self.stack, self.memo
        except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError, struct.error) as exc:
            raise FormatError(f"malformed pickle at offset {start}: {type(exc).__name__}: {exc}") from None
        finally:
            self.pos, self.steps = pos, steps

    def keyed_call(self, groups: tuple, stack: list) -> bool:
        """:meth:`tensor_call` after the BINPUT of the string on top (a dict key) and the BINGET of
        the callable, as :data:`_KEYED_CALL` matched them; False — nothing done — if not quite."""
        memo, get = self.memo, int.from_bytes(groups[1][1:], "little")
        func = memo[get] if type(memo) is list and get < len(memo) else None
        return type(func) is _Callable and self.tensor_call(groups[2:], stack, (groups[0], func))

    def tensor_call(self, groups: tuple, stack: list, keyed: tuple | None = None) -> bool:
        """Run a whole ``_rebuild_tensor_v2`` call that :data:`_TENSOR_CALL` matched (MARK to the
        REDUCE's BINPUT) as its ~25 opcodes would, with the same checks, in the canonical case only:
        every BINGET reads an entry that exists, the BINPUTs append to the memo in order. False —
        nothing done — otherwise (the loop then runs the opcodes). ``keyed``: the BINPUT of the
        string on top and the callable a BINGET pushes, which come first."""
        (storage_name, stype, key_get, key_len, key, key_put, location, numel, pid_put, offset,
         size_get, size_ints, size_op, size_put, stride_get, stride_ints, stride_op, stride_put, grad,
         od_get, od_put, args_put, out_put) = groups
        memo, index = self.memo, int.from_bytes
        if type(memo) is not list or len(self.metastack) + 2 > MAX_DEPTH:
            return False
        puts = b"".join(filter(None, (keyed and keyed[0], key_put, pid_put, size_put, stride_put, od_put, args_put,
                                      out_put)))
        k = 4 + (keyed is not None) + (key_put is not None) + (size_put is not None) + (stride_put is not None)
        if len(puts) != 5 * k or _PUT_RUNS[k].unpack(puts) != tuple(range(len(memo), len(memo) + k)):
            return False  # (LONG_BINPUTs appending in order; anything else runs opcode by opcode)
        try:
            same, reads = self.last_call, groups[:8]
            reuse = key is None and same[0] == reads and same[1] == self.overwrites
            if not reuse:
                storage_name, stype = memo[index(storage_name[1:], "little")], memo[index(stype[1:], "little")]
                location = memo[index(location[1:], "little")]
                key = memo[index(key_get[1:], "little")] if key is None else key.decode()
            size = memo[index(size_get[1:], "little")] if size_get else _small_tuple(size_ints, size_op)
            stride = memo[index(stride_get[1:], "little")] if stride_get else _small_tuple(stride_ints, stride_op)
            od_func = memo[index(od_get[1:], "little")]
        except IndexError:  # an entry not yet (or never) made
            return False
        if size is False or stride is False or (key_len is not None and len(key) != key_len[0]):
            return False
        # from here on, exactly what the opcodes do
        new = [stack[-1]] if keyed else []
        if keyed:
            stack.append(keyed[1])
        if reuse:
            pid, storage = same[2], same[3]  # the previous call's id, from the same memo entries: equal
        else:
            if key_put:
                new.append(key)
            pid = (storage_name, stype, key, location, _int_op(numel))
            if not (type(storage_name) is str and type(key) is str and type(location) is str):
                pid = self.nest(pid, pid)  # (a _StorageType is no container)
            storage = self.persistent_load(pid)
            self.last_call = (reads, self.overwrites, pid, storage)
        new.append(pid)
        if size_put:
            new.append(size)
        if stride_put:
            new.append(stride)
        backward_hooks = {} if od_func is _ORDERED_DICT else _call(od_func, ())
        args = (storage, _int_op(offset), size, stride, grad == b"\x88", backward_hooks)
        depths = self.depths
        if not (type(size) is tuple and type(stride) is tuple and id(size) not in depths and id(stride) not in depths
                and id(backward_hooks) not in depths):
            self.nest(args, args)
        # else depth 2 (flat size and stride), not recorded: one entry per tensor saved; should a later
        # BINGET nest the tuple, check_structure still bounds the depth of what the pickle returns
        if stack[-1] is _REBUILD_TENSOR_V2 and type(backward_hooks) is dict:  # what its stand-in does
            stack[-1] = _tensor(storage, args[1], size, stride, None, args[4])
        else:
            stack[-1] = _call(stack[-1], args)
        new += (backward_hooks, args, stack[-1])
        memo += new
        return True

    def persistent_load(self, pid: object) -> Storage:
        """The storage a persistent id names (its parsing cached: 10^6 views of one storage
        repeat one id); the container is asked for each, as :func:`_persistent_load` does."""
        if type(pid) is tuple and len(pid) == 5 and type(pid[1]) is _StorageType:
            # hashable in constant time: only str/int/identity-hashed members are looked up
            _, _, key, location, numel = pid
            if type(key) is str and type(location) is str and type(numel) is int and type(pid[0]) is str:
                sid = self.sids.get(pid)
                if sid is not None and self.storage_loader is not None:
                    return self.storage_loader(sid)
                storage = _persistent_load(self, pid)
                self.sids[pid] = self.last_sid
                return storage
        return _persistent_load(self, pid)


_CONTAINERS = (list, tuple, dict, set)


def _fail(message: str) -> None:
    raise FormatError(message)


def _is_container(item: object) -> bool:
    return isinstance(item, _CONTAINERS)


def _call(func: object, args: object) -> object:
    """REDUCE: an allowed stand-in called with the pickled arguments."""
    if type(func) is not _Callable:
        raise UnsafePickleError(f"refusing to call {limits.short(func)} from pickle: not an allowed callable")
    if type(args) is not tuple:
        raise FormatError(f"malformed pickle: arguments of {func.name} are not a tuple")
    try:
        return func.fn(*args)
    except TypeError as exc:
        raise FormatError(f"bad arguments to {func.name}: {exc}") from None


def _int_op(raw: bytes) -> int:
    """The value of one BININT1 / BININT2 / BININT opcode with its argument."""
    return raw[1] if raw[0] == _BININT1 else _INT_FORMATS[len(raw) - 1].unpack_from(raw, 1)[0]


def _small_tuple(ints: bytes | None, op: bytes | None) -> tuple | bool:
    """The size or stride tuple a tensor call builds from ints (BININT* then TUPLE1/2/3), or from
    nothing (EMPTY_TUPLE); False when the opcodes do not build what they seem to."""
    if ints is None:
        return ()
    values, i = [], 0
    while i < len(ints):
        width = _INTS[ints[i]]
        values.append(_int_op(ints[i : i + 1 + width]))
        i += 1 + width
    return tuple(values) if len(values) == op[0] - _TUPLE1 + 1 else False


def _tensor_call_pattern() -> re.Pattern:
    """The opcodes of one ``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
    OrderedDict())`` call as torch.save (protocol 2) writes it, from the MARK after the callable:
    every argument but the ints comes from the memo (BINGET/LONG_BINGET), every object built is
    memoized (BINPUT/LONG_BINPUT)."""
    get, put = rb"(h.|j.{4})", rb"(q.|r.{4})"
    integer = rb"(K.|M.{2}|J.{4})"
    ints = rb"((?:K.|M.{2}|J.{4}){1,3})"
    small_tuple = rb"(?:" + get + rb"|" + ints + rb"([\x85-\x87])" + put + rb"|\))"
    pattern = (rb"\(\(" + get + get + rb"(?:" + get + rb"|X([\x01-\x14])\x00\x00\x00([0-9]+)" + put + rb")"
               + get + integer + rb"t" + put + rb"Q" + integer + small_tuple + small_tuple + rb"([\x88\x89])"
               + get + rb"\)R" + put + rb"t" + put + rb"R" + put)
    return re.compile(pattern, re.DOTALL)


_TENSOR_CALL = _tensor_call_pattern()
_KEYED_CALL = re.compile(rb"(q.|r.{4})(h.|j.{4})" + _TENSOR_CALL.pattern, re.DOTALL)  # after a BINUNICODE
_PUTS = (pickle.BINPUT, pickle.LONG_BINPUT)
_PUT_RUNS = {k: struct.Struct("<" + "xI" * k) for k in range(1, 9)}  # k LONG_BINPUTs -> their indices
_INTS = {pickle.BININT1[0]: 1, pickle.BININT2[0]: 2, pickle.BININT[0]: 4}  # opcode -> argument bytes
_INT_FORMATS = {2: _U16, 4: _I32}
_INLINE_CONSTANTS = {pickle.NONE[0]: None, pickle.NEWTRUE[0]: True, pickle.NEWFALSE[0]: False, pickle.EMPTY_TUPLE[0]: ()}
_TENSOR_CALL_OPS = 25  # opcodes one such call runs, counted toward MAX_STEPS (a few more or fewer)
(_BINGET, _LONG_BINPUT, _BININT1, _MARK, _TUPLE, _TUPLE1, _BINPUT, _BININT, _NEWFALSE, _EMPTY_TUPLE, _BININT2) = (
    op[0] for op in (pickle.BINGET, pickle.LONG_BINPUT, pickle.BININT1, pickle.MARK, pickle.TUPLE, pickle.TUPLE1,
                     pickle.BINPUT, pickle.BININT, pickle.NEWFALSE, pickle.EMPTY_TUPLE, pickle.BININT2))
(_REDUCE, _TUPLE2, _TUPLE3, _BINUNICODE, _BINPERSID, _LONG_BINGET) = (
    op[0] for op in (pickle.REDUCE, pickle.TUPLE2, pickle.TUPLE3, pickle.BINUNICODE, pickle.BINPERSID,
                     pickle.LONG_BINGET))


def loads(
    data: bytes | mmap.mmap,
    pos: int = 0,
    storage_loader: StorageLoader | None = None,
    extra_globals: Mapping[str, object] | None = None,
) -> tuple[object, int]:
    """Read one pickle from ``data`` at ``pos``; returns ``(object, offset after its STOP)``.

    ``storage_loader`` supplies the storage for each persistent id; a pickle with persistent ids
    and no loader is a FormatError. ``extra_globals`` allows more globals for this pickle only
    (stand-ins: :class:`_Callable` for REDUCE, :class:`RecordClass` for NEWOBJ, or constants).
    """
    unpickler = _Unpickler(data, pos, storage_loader, extra_globals)
    with no_gc():  # building 10^6 objects that all stay alive: collections would only rescan them
        try:
            obj = unpickler.load()
        except RecursionError:
            raise FormatError("malformed pickle: nesting too deep") from None
        check_structure(obj, max_nodes=MAX_EXPANSION + 16 * unpickler.steps)
    return obj, unpickler.pos


@contextlib.contextmanager
def no_gc():
    """Pause Python's cyclic garbage collector (reference counting still frees everything).

    A loaded pickle is a tree of new objects that all live on; every automatic collection would
    traverse all of them again, which made reading 10^6 tensors a third slower. Whatever a
    refused pickle leaves in cycles is collected once the collector runs again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SCALARS = frozenset((str, int, float, bool, type(None), bytes))
_INFO, _OWN = operator.attrgetter("info"), operator.attrgetter("own")


def _leaves_only(children) -> bool:
    """Whether every child is a plain value or a tensor without Python attributes (checked by the
    types present, in C-level passes)."""
    kinds = set(map(type, children))
    if kinds <= _SCALARS:
        return True
    return (kinds == {TensorRef} and set(map(type, map(_INFO, children))) == {TensorInfo}
            and not any(map(_OWN, map(_INFO, children))))  # (python_state lives only in an own dict)


def _children(node: object):
    if isinstance(node, list | tuple | set):
        return node
    if isinstance(node, dict):
        return node.values()
    if isinstance(node, TensorRef):
        state = node.info.get("python_state")
        return state.values() if state else None
    if isinstance(node, Record):
        return node.fields.values()
    return None


def check_structure(root: object, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_EXPANSION) -> None:
    """Refuse a loaded object that contains itself, nests deeper than ``max_depth`` or — counting
    shared objects once per reference, as every walk over it will — holds more than ``max_nodes``
    (a memo "billion laughs"). Iterative, and linear in the distinct objects."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    active: set[int] = set()
    flat: set[int] = set()  # nodes whose children are all leaves
    stack: list = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = _children(node)
        if children is None:
            continue
        key = id(node)
        if done:
            active.discard(key)
            size, depth = 1, 1
            if key in flat:
                size += len(children)
                children = ()
            for child in children:
                inner = sizes.get(id(child))
                if inner is None:
                    size += 1
                else:
                    size += inner
                    depth = max(depth, depths[id(child)] + 1)
            if size > max_nodes:
                raise FormatError(f"pickle expands to more than {max_nodes} objects by reference (a memo bomb)")
            if depth > max_depth:
                raise FormatError(f"pickle nests containers deeper than {max_depth} levels")
            sizes[key], depths[key] = size, depth
            continue
        if key in sizes:
            continue
        if key in active:
            raise FormatError("pickle builds a container that contains itself")
        active.add(key)
        stack.append((node, True))
        if _leaves_only(children):  # (a state_dict's tensors: no loop in Python)
            flat.add(key)
            continue
        for child in children:
            kind = type(child)
            if kind in _SCALARS or (kind is TensorRef and child.info.get("python_state") is None):
                continue  # leaves: most children of a large state_dict
            if _children(child) is not None:
                stack.append((child, False))


@_op(pickle.PROTO)
def _proto(u: _Unpickler) -> None:
    if u.byte() > pickle.HIGHEST_PROTOCOL:
        raise FormatError("unsupported pickle protocol")


@_op(pickle.FRAME)
def _frame(u: _Unpickler) -> None:
    u.read(8)  # frames only group opcodes; their contents follow inline


@_op(pickle.MARK)
def _mark(u: _Unpickler) -> None:
    if len(u.metastack) >= MAX_DEPTH:
        raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
    u.metastack.append(u.stack)
    u.stack = []


@_op(pickle.POP)
def _pop(u: _Unpickler) -> None:
    if u.stack:
        u.stack.pop()
    else:
        u.pop_mark()


@_op(pickle.POP_MARK)
def _pop_mark(u: _Unpickler) -> None:
    u.pop_mark()


@_op(pickle.DUP)
def _dup(u: _Unpickler) -> None:
    u.stack.append(u.stack[-1])


_CONSTANTS = {pickle.NONE[0]: None, pickle.NEWTRUE[0]: True, pickle.NEWFALSE[0]: False}


@_op(pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE)
def _constant(u: _Unpickler) -> None:
    u.stack.append(_CONSTANTS[u.code])


@_op(pickle.BININT)
def _binint(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_I32))


@_op(pickle.BININT1)
def _binint1(u: _Unpickler) -> None:
    u.stack.append(u.byte())


@_op(pickle.BININT2)
def _binint2(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_U16))


@_op(pickle.LONG1)
def _long1(u: _Unpickler) -> None:
    u.stack.append(int.from_bytes(u.read(u.byte()), "little", signed=True))


@_op(pickle.LONG4)
def _long4(u: _Unpickler) -> None:
    n = u.unpack(_I32)
    if n < 0:
        raise FormatError("malformed pickle: negative LONG4 length")
    if n > _MAX_LONG_BYTES:
        raise FormatError(f"pickled integer of {n} bytes is too large (limit {_MAX_LONG_BYTES})")
    u.stack.append(int.from_bytes(u.read(n), "little", signed=True))


@_op(pickle.BINFLOAT)
def _binfloat(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_F64))


def _text(raw: bytes) -> str:
    try:
        return raw.decode()  # strict UTF-8 decodes no surrogate, so nothing more to check
    except UnicodeDecodeError:
        pass
    text = raw.decode("utf-8", "surrogatepass")
    problem = limits.text_problem(text)
    if problem:  # torch reads it, but no name holding it can be written to any output
        raise FormatError(f"pickled string {problem}")
    return text


@_op(pickle.SHORT_BINUNICODE)
def _short_binunicode(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.byte())))


@_op(pickle.BINUNICODE)
def _binunicode(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.unpack(_U32))))


@_op(pickle.BINUNICODE8)
def _binunicode8(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.unpack(_U64))))


@_op(pickle.SHORT_BINSTRING)
def _short_binstring(u: _Unpickler) -> None:
    u.stack.append(u.read(u.byte()).decode("utf-8"))  # Python 2 str, as torch.load decodes it


@_op(pickle.BINSTRING)
def _binstring(u: _Unpickler) -> None:
    n = u.unpack(_I32)
    if n < 0:
        raise FormatError("malformed pickle: negative BINSTRING length")
    u.stack.append(u.read(n).decode("utf-8"))


@_op(pickle.SHORT_BINBYTES)
def _short_binbytes(u: _Unpickler) -> None:
    u.stack.append(u.read(u.byte()))


@_op(pickle.BINBYTES)
def _binbytes(u: _Unpickler) -> None:
    u.stack.append(u.read(u.unpack(_U32)))


@_op(pickle.BINBYTES8)
def _binbytes8(u: _Unpickler) -> None:
    u.stack.append(u.read(u.unpack(_U64)))


_EMPTY = {
    pickle.EMPTY_TUPLE[0]: tuple,
    pickle.EMPTY_LIST[0]: list,
    pickle.EMPTY_DICT[0]: dict,
    pickle.EMPTY_SET[0]: set,
}


@_op(pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET)
def _empty(u: _Unpickler) -> None:
    u.stack.append(_EMPTY[u.code]())


@_op(pickle.TUPLE)
def _tuple(u: _Unpickler) -> None:
    items = u.pop_mark()  # before touching u.stack: pop_mark replaces it
    u.stack.append(u.nest(tuple(items), items))


@_op(pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
def _tuple_n(u: _Unpickler) -> None:
    n = u.code - pickle.TUPLE1[0] + 1
    if len(u.stack) < n:
        raise FormatError("malformed pickle: stack underflow in TUPLE")
    items = tuple(u.stack[-n:])
    u.stack[-n:] = [u.nest(items, items)]


@_op(pickle.LIST)
def _list(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.stack.append(u.nest(items, items))


@_op(pickle.DICT)
def _dict(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.stack.append(u.nest(dict(zip(_keys(items[::2]), items[1::2], strict=True)), items[1::2]))


@_op(pickle.APPEND)
def _append(u: _Unpickler) -> None:
    item = u.stack.pop()
    u.nest(u.target(list), (item,)).append(item)


@_op(pickle.APPENDS)
def _appends(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.nest(u.target(list), items).extend(items)


@_op(pickle.SETITEM)
def _setitem(u: _Unpickler) -> None:
    value, key = u.stack.pop(), u.stack.pop()
    u.nest(u.target(dict), (value,))[_key(key)] = value


@_op(pickle.SETITEMS)
def _setitems(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.nest(u.target(dict), items[1::2]).update(zip(_keys(items[::2]), items[1::2], strict=True))


@_op(pickle.ADDITEMS)
def _additems(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.target(set).update(_keys(items))


@_op(pickle.BINGET)
def _binget(u: _Unpickler) -> None:
    u.stack.append(u.memo[u.byte()])


@_op(pickle.LONG_BINGET)
def _long_binget(u: _Unpickler) -> None:
    u.stack.append(u.memo[u.unpack(_U32)])


@_op(pickle.BINPUT)
def _binput(u: _Unpickler) -> None:
    u.put(u.byte(), u.stack[-1])


@_op(pickle.LONG_BINPUT)
def _long_binput(u: _Unpickler) -> None:
    u.put(u.unpack(_U32), u.stack[-1])


@_op(pickle.MEMOIZE)
def _memoize(u: _Unpickler) -> None:
    u.put(len(u.memo), u.stack[-1])


@_op(pickle.GLOBAL)
def _global(u: _Unpickler) -> None:
    module = u.readline()
    u.stack.append(find_global(module, u.readline(), u.extra_globals))


@_op(pickle.STACK_GLOBAL)
def _stack_global(u: _Unpickler) -> None:
    name, module = u.stack.pop(), u.stack.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        raise FormatError("malformed pickle: STACK_GLOBAL names are not strings")
    u.stack.append(find_global(module, name, u.extra_globals))


@_op(pickle.REDUCE)
def _reduce(u: _Unpickler) -> None:
    args = u.stack.pop()
    u.stack[-1] = _call(u.stack[-1], args)


@_op(pickle.NEWOBJ)
def _newobj(u: _Unpickler) -> None:
    if u.extra_globals is None:  # torch.save pickles never create objects this way
        raise FormatError(f"unsupported pickle opcode {pickle.NEWOBJ!r} at offset {u.pos - 1}")
    args = u.stack.pop()
    cls = u.stack[-1]
    if not isinstance(cls, RecordClass):
        raise UnsafePickleError(f"refusing to instantiate {limits.short(cls)} from pickle: not an allowed class")
    if args != ():
        raise FormatError(f"malformed pickle: {cls.name} is created with arguments {limits.short(args)}")
    record = Record(cls.name)
    u.records[id(record)] = cls
    u.stack[-1] = record


@_op(pickle.BUILD)
def _build(u: _Unpickler) -> None:
    state = u.stack.pop()
    inst = u.stack[-1]
    if isinstance(inst, Record):
        _build_record(inst, u.records[id(inst)], state)
    elif isinstance(inst, TensorRef):
        attributes = _python_state(state)
        if attributes:
            u.stack[-1] = _with_info(inst, python_state={**inst.info.get("python_state", {}), **attributes})
    elif isinstance(inst, dict):
        _python_state(state)  # OrderedDict instance attributes: validated, not kept
    else:
        raise FormatError(f"malformed pickle: BUILD on a {type(inst).__name__}")


@_op(pickle.BINPERSID)
def _binpersid(u: _Unpickler) -> None:
    u.stack.append(u.persistent_load(u.stack.pop()))


def _persistent_load(u: _Unpickler, pid: object) -> Storage:
    """Parse ``('storage', type, key, location, numel[, view])`` and ask the container for it."""
    if not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] not in ("storage", b"storage"):
        raise FormatError(f"unsupported persistent id {limits.short(pid)}: only tensor storages are allowed")
    if u.storage_loader is None:
        raise FormatError("pickle refers to a tensor storage, but this part of the file has none")
    _, stype, key, location, numel, *view = pid
    if not isinstance(stype, _StorageType):
        raise FormatError(f"persistent id storage type {limits.short(stype)} is not a torch storage class")
    statekit_dtype(stype.dtype)
    key, location = (v.decode("ascii") if isinstance(v, bytes) else v for v in (key, location))
    if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
        raise FormatError(f"malformed storage persistent id {limits.short(pid)}")
    u.last_sid = sid = StorageId(key, stype.dtype, numel, location, view[0] if view else None)
    return u.storage_loader(sid)


# --------------------------------------------------------------------------------------------
# writing


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
        raw = text.encode("utf-8", "surrogatepass")
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
