"""The plain values a pickle builds besides tensors: dict keys and set members, records of
allowed classes (DCP metadata; never the classes themselves), and pickled attribute state."""

from __future__ import annotations

from dataclasses import dataclass, field

from statekit.errors import FormatError
from statekit.formats import limits
from statekit.formats.torch_pickle.dtype_table import TorchDtype
from statekit.tensor import TensorRef


def _text(raw: bytes) -> str:
    """A pickled unicode string: strict UTF-8, or refused when it holds a lone surrogate (torch
    reads it, but no name holding it can be written to any output)."""
    try:
        return raw.decode()  # strict UTF-8 decodes no surrogate, so nothing more to check
    except UnicodeDecodeError:
        pass
    text = raw.decode("utf-8", "surrogatepass")
    problem = limits.text_problem(text)
    if problem:
        raise FormatError(f"pickled string {problem}")
    return text


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


@dataclass(eq=False)
class WrapperTensor:
    """A wrapper tensor subclass allowed by name (torchao's low-bit optimizer states), as the
    pickle describes it and never constructed: its class's full name, its outer dtype (a torch
    dtype name), shape, stride and device, and the attributes it pickled (``state``: tensors as
    TensorRefs, numbers, a ``torch.Size`` as a tuple)."""

    cls: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    state: dict


@dataclass(eq=False)
class Float8Codes:
    """A float8 tensor (``torch.float8_e4m3fn`` …), which statekit holds only as a wrapper
    subclass's codes (torchao's OptimStateFp8): the bytes as a U8 TensorRef and the torch dtype
    name. Anywhere else in a pickle it is refused by :func:`statekit.formats.torch_pickle.structure.check_structure`."""

    raw: TensorRef
    torch_dtype: str

    @property
    def refusal(self) -> str:
        return f"tensor dtype torch.{self.torch_dtype} is not supported: this dtype is not handled by statekit"


@dataclass(eq=False)  # hashed by identity, as torch hashes a tensor used as a dict key
class TensorKey:
    """A tensor used as a dict key (GrokAdamW keys its state by the parameters themselves)."""

    tensor: object


# dict keys and set members: hashed in constant time (a Record, a TensorKey by identity)
_FLAT_KEYS = (str, int, float, bool, type(None), bytes, complex, TorchDtype, Record, TensorKey)
_FLAT_KEY_TYPES = frozenset(_FLAT_KEYS)


def _key(key: object) -> object:
    """A dict key or set member: a scalar, or a short flat tuple of scalars (hashing nested
    shared tuples takes exponential time, so those are refused)."""
    if isinstance(key, _FLAT_KEYS):
        return key
    if isinstance(key, tuple) and len(key) <= 64 and all(isinstance(k, _FLAT_KEYS) for k in key):
        return key
    if isinstance(key, TensorRef):
        return TensorKey(key)
    raise FormatError(f"malformed pickle: a {type(key).__name__} as a dict key or set member is not supported")


def _keys(keys) -> list:
    if set(map(type, keys)) <= _FLAT_KEY_TYPES:  # (all of one plain type, usually: no loop in Python)
        return keys
    return [_key(k) for k in keys]


def _build_record(record: Record, rclass: RecordClass, state: object) -> None:
    if isinstance(state, tuple) and rclass.state_fields and len(state) == len(rclass.state_fields):
        record.fields.update(zip(rclass.state_fields, state, strict=True))
        return
    merged = _python_state(state)
    if not all(isinstance(k, str) for k in merged):
        raise FormatError(f"state of a {rclass.name} has non-string field names")
    record.fields.update(merged)
