"""Storages and the tensors viewing them: a view's geometry checked (sizes, strides, extent,
overflow) and its lazy :class:`~statekit.tensor.TensorRef` built, as ``torch.Tensor.set_`` would."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import NamedTuple

import numpy as np

from statekit import dtypes
from statekit.errors import FormatError
from statekit.formats import limits
from statekit.formats.torch_pickle.dtype_table import TORCH_TO_STATEKIT, statekit_dtype
from statekit.tensor import FileSpan, TensorRef, spanned_ref


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


_DTYPE_CACHE: dict[str, tuple[str, np.dtype | None, int]] = {}
_SMALL = 1 << 28  # a dimension and stride up to this, times each other and any item size, fit in 63 bits


def _dtype_entry(torch_dtype: str) -> tuple[str, np.dtype | None, int]:
    """(statekit name, numpy dtype, item size); the numpy dtype is None for BF16 (ml_dtypes',
    imported only when a strided BF16 view is read: a file span needs no numpy dtype)."""
    name = statekit_dtype(torch_dtype)
    np_dtype = None if name == "BF16" else dtypes.numpy_dtype(name)
    _DTYPE_CACHE[torch_dtype] = entry = (name, np_dtype, dtypes.itemsize(name))
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

    def __init__(self, shared: dict, key: str, offset: int, stride: tuple):  # (written out in _view_maker)
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


_new_object = object.__new__
_set_file, _set_offset, _set_length = (getattr(FileSpan, name).__set__ for name in ("file", "offset", "length"))


def _view_maker(storage: Storage, size: tuple, stride: tuple, name: str, np_dtype: np.dtype | None, itemsize: int,
                numel: int, extent: int, flat: bool, shared: dict) -> Callable[[object], TensorRef]:
    """The views of ``storage`` with this geometry, as a function of the offset (see view_plan)."""
    key, capacity, length, span = storage.key, storage.nbytes // itemsize, numel * itemsize, storage.span

    def check(offset: object) -> None:
        if type(offset) is not int or not 0 <= offset <= limits.MAX_ELEMENTS:  # int64, as torch
            raise FormatError(f"bad tensor geometry: offset {limits.short(offset)}, size {limits.short(size)}, "
                              f"stride {limits.short(stride)}")
        raise FormatError(f"a tensor of size {list(size)} needs {offset + extent + 1} elements of storage "
                          f"'{key}', which holds {capacity}")

    limit = capacity - extent if numel else limits.MAX_ELEMENTS + 1  # offsets below it fit
    scale = itemsize if numel else 0  # an empty tensor reads nothing, wherever its offset points
    if flat and span is not None:
        file, base = span.file, span.offset

        def at(offset: object) -> TensorRef:  # (TensorInfo(...) and FileSpan.at(...) written out)
            if type(offset) is not int or offset < 0 or offset >= limit:
                check(offset)
            info = _new_object(TensorInfo)
            info.shared = shared
            info.key = key
            info.offset = offset
            info.stride = stride
            info.own = None
            span = _new_object(FileSpan)
            _set_file(span, file)
            _set_offset(span, base + offset * scale)
            _set_length(span, length)
            return spanned_ref(name, size, info, span)
    elif flat:
        def at(offset: object) -> TensorRef:
            if type(offset) is not int or offset < 0 or offset >= limit:
                check(offset)
            start = offset * scale
            return TensorRef(name, size, loader=lambda: storage.resolve()[start : start + length],
                             info=TensorInfo(shared, key, offset, stride))
    else:
        def at(offset: object) -> TensorRef:
            if type(offset) is not int or offset < 0 or offset >= limit:
                check(offset)

            def strided() -> np.ndarray:
                base = storage.array(np_dtype or dtypes.numpy_dtype(name))[offset:]
                strides = tuple(s * itemsize for s in stride)
                return np.lib.stride_tricks.as_strided(base, size, strides, writeable=False)

            return TensorRef(name, size, array_loader=strided, info=TensorInfo(shared, key, offset, stride))
    return at


def view_plan(
    storage: object, offset: object, size: object, stride: object, torch_dtype: str | None = None,
    requires_grad: bool = False,
) -> Callable[[object], TensorRef]:
    """``_tensor(storage, offset, size, stride, ...)`` as a function of the offset, after every
    check ``_tensor`` makes (for this offset too, so that a refusal names the same culprit
    first): called with any offset, it returns that view, or raises what ``_tensor`` raises for
    it, word for word. A template's tensor calls make 10^6 views from one."""
    if type(storage) is not Storage and not isinstance(storage, Storage):
        raise FormatError(f"tensor storage is {type(storage).__name__}, not a storage reference")
    torch_dtype = torch_dtype or storage.dtype
    name, np_dtype, itemsize = _DTYPE_CACHE.get(torch_dtype) or _dtype_entry(torch_dtype)
    if type(size) is not tuple or type(stride) is not tuple:  # torch.Size arrives as a tuple already
        size, stride = _int_tuple(size, "size"), _int_tuple(stride, "stride")
    if len(size) != len(stride) or type(offset) is not int or not 0 <= offset <= limits.MAX_ELEMENTS:  # int64
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
    return _view_maker(storage, size, stride, name, np_dtype, itemsize, numel, extent,
                       numel == 0 or (contiguous and not storage.big_endian), shared)


def _tensor(
    storage: object, offset: object, size: object, stride: object, torch_dtype: str | None = None,
    requires_grad: bool = False,
) -> TensorRef:
    """A TensorRef viewing ``storage`` like ``torch.Tensor.set_(storage, offset, size, stride)``.

    The tensor's dtype is the storage's unless ``torch_dtype`` says otherwise (untyped storages).
    """
    return view_plan(storage, offset, size, stride, torch_dtype, requires_grad)(offset)
