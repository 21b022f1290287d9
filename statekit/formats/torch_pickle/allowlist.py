"""The allow-list: every global a pickle may name, each mapped to statekit's own stand-in.

Every GLOBAL is looked up here (:func:`find_global`); any other raises
:class:`~statekit.errors.UnsafePickleError` before anything runs, and REDUCE calls only the
:class:`_Callable` stand-ins (:func:`_call`). Allowing a new library's classes touches this module
alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from statekit.errors import FormatError, UnsafePickleError
from statekit.formats import limits
from statekit.formats.torch_pickle.dtype_table import _STORAGE_CLASSES, TORCH_DTYPE_NAMES, TorchDtype
from statekit.formats.torch_pickle.geometry import _int_tuple, _tensor
from statekit.formats.torch_pickle.values import Float8Codes, WrapperTensor, _key, _keys, _python_state
from statekit.tensor import TensorRef


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
    if dtype.name in FLOAT8_DTYPES:  # one byte an element: the bytes, kept for a wrapper's codes
        return Float8Codes(_tensor(storage, storage_offset, size, stride, "uint8", bool(requires_grad)), dtype.name)
    return _tensor(storage, storage_offset, size, stride, dtype.name, bool(requires_grad))


def _rebuild_parameter(data, requires_grad, backward_hooks):
    _check_hooks(backward_hooks)
    return _with_info(data, parameter=True, requires_grad=bool(requires_grad))


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    param = _rebuild_parameter(data, requires_grad, backward_hooks)
    attributes = _python_state(state)
    return _with_info(param, python_state=attributes) if attributes else param


def _rebuild_from_type_v2(func, new_type, args, state):
    """A tensor (sub)class with Python attributes: ``func(*args)`` then the attributes.

    A wrapper subclass allowed by name (:data:`WRAPPER_CLASSES`) becomes a
    :class:`WrapperTensor` record of its class, geometry and pickled attributes: nothing of the
    class is imported or run."""
    if isinstance(func, _Callable) and func.fn is _rebuild_wrapper_subclass:
        return _wrapper_tensor(new_type, args, state)
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


FLOAT8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})

# Tensor subclasses that keep their data in attributes (``torch._utils._rebuild_wrapper_subclass``
# + ``_rebuild_from_type_v2``), allowed by their exact class names so that a reader can see those
# attributes as plain values. torchao's low-bit optimizer states (OptimState8bit/4bit/Fp8;
# ``torchao.prototype.low_bit_optim`` up to torchao 0.9, ``torchao.optim`` from 0.10).
WRAPPER_CLASSES = frozenset(
    f"{module}.subclass_{kind}.OptimState{cls}"
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim")
    for kind, cls in (("8bit", "8bit"), ("4bit", "4bit"), ("fp8", "Fp8"))
)


@dataclass(frozen=True)
class _WrapperClass:
    """An allowed wrapper subclass named as ``_rebuild_from_type_v2``'s type (a name, nothing more)."""

    name: str


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    """Allowed only inside ``_rebuild_from_type_v2`` (:func:`_wrapper_tensor`), never called alone."""
    raise FormatError("_rebuild_wrapper_subclass outside _rebuild_from_type_v2 is not supported")


def _wrapper_tensor(new_type, args, state) -> WrapperTensor:
    if not isinstance(new_type, _WrapperClass) or not isinstance(args, tuple) or len(args) != 8:
        raise FormatError(f"unsupported _rebuild_wrapper_subclass call for {limits.short(new_type)}")
    cls, dtype, size, stride, offset, layout, device, _requires_grad = args
    if cls != new_type or not isinstance(dtype, TorchDtype) or layout != "torch.strided" or offset != 0:
        raise FormatError(f"unsupported {new_type.name} geometry: {limits.short(args)}")
    attributes = _python_state(state)
    if not all(isinstance(k, str) for k in attributes):
        raise FormatError(f"{new_type.name} attributes have non-string names")
    for name, value in attributes.items():
        if isinstance(value, Float8Codes):  # a float8 tensor inside the wrapper: its bytes, dtype in info
            attributes[name] = _with_info(value.raw, float8=value.torch_dtype)
    return WrapperTensor(new_type.name, dtype.name, _int_tuple(size, "size"), _int_tuple(stride, "stride"),
                         str(device), attributes)


def _get_layout(name):
    """``torch.serialization._get_layout``: only the strided layout, as its name."""
    if name != "torch.strided":
        raise FormatError(f"tensor layout {limits.short(name)} is not supported")
    return name


def _device(kind, index=None):
    """``torch.device(type[, index])`` as its name (``cpu``, ``cuda:0``)."""
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise FormatError(f"torch.device({limits.short(kind)}, {limits.short(index)}) is not a device")
    return kind if index is None or ":" in kind else f"{kind}:{index}"


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
    allowed["torch._utils._rebuild_wrapper_subclass"] = _Callable("_rebuild_wrapper_subclass",
                                                                  _rebuild_wrapper_subclass)
    for name in WRAPPER_CLASSES:
        allowed[name] = _WrapperClass(name)
    for full, fn in {
        "torch.serialization._get_layout": _get_layout,
        "torch.device": _device,
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


def allowed_callable(name: str, fn: Callable) -> object:
    """A stand-in that REDUCE may call, for ``extra_globals`` (``fn`` gets the pickled arguments)."""
    return _Callable(name, fn)


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
