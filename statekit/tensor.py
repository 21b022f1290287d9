"""Lazy tensors: a name, a dtype, a shape, and bytes that are read only when asked for.

Containers hand out :class:`TensorRef` objects; operations call :meth:`TensorRef.numpy` (or
:meth:`TensorRef.raw`) only when they need values, so memory stays bounded by one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from statekit import dtypes


@dataclass
class TensorRef:
    """A tensor whose bytes live somewhere else (a memory map, a zip entry, an array).

    ``dtype`` is a statekit dtype name (see :mod:`statekit.dtypes`). ``loader`` returns the raw
    little-endian bytes (a ``bytes``/``memoryview``/array buffer) of exactly ``nbytes`` length;
    ``array_loader``, when given, returns the numpy array directly (used for strided views).
    """

    dtype: str
    shape: tuple[int, ...]
    loader: Callable[[], object] | None = None
    array_loader: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    nbytes_hint: int | None = None
    info: dict = field(default_factory=dict)
    chunk_reader: Callable[[int], Iterator[bytes]] | None = field(default=None, repr=False)

    @classmethod
    def from_array(cls, array: np.ndarray, dtype: str | None = None) -> TensorRef:
        arr = np.asarray(array)
        name = dtype or dtypes.from_numpy(arr.dtype)
        if name not in ("QFloat",):
            want = dtypes.numpy_dtype(name)
            if arr.dtype != want:
                arr = arr.astype(want)
        return cls(dtype=name, shape=tuple(int(d) for d in arr.shape), array_loader=lambda: arr)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.nbytes_hint is not None:
            return self.nbytes_hint
        return self.numel * dtypes.itemsize(self.dtype)

    def raw(self) -> memoryview:
        """The tensor's bytes, little-endian, C order."""
        if self.loader is not None:
            return memoryview(self.loader()).cast("B")
        arr = np.ascontiguousarray(self.numpy())
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")

    def iter_bytes(self, chunk: int = 16 << 20) -> Iterator[bytes | memoryview]:
        """The raw bytes in pieces of at most ``chunk`` bytes (bounded memory for copies)."""
        if self.chunk_reader is not None:
            yield from self.chunk_reader(chunk)
            return
        data = self.raw()
        for lo in range(0, len(data), chunk):
            yield data[lo : lo + chunk]

    def numpy(self) -> np.ndarray:
        """The values as a numpy array of the statekit dtype (read-only when memory mapped)."""
        if self.array_loader is not None:
            return self.array_loader()
        if self.dtype == "QFloat":
            raise ValueError("QFloat tensors are opaque bytes; use raw()")
        buf = self.raw()
        arr = np.frombuffer(buf, dtype=dtypes.numpy_dtype(self.dtype))
        return arr.reshape(self.shape)

    def cast(self, dtype: str) -> TensorRef:
        """A lazy value cast (``F16`` → ``F32`` widens exactly); ``self`` when already ``dtype``."""
        if dtype == self.dtype:
            return self
        want = dtypes.numpy_dtype(dtype)
        source = self

        def load() -> np.ndarray:
            return np.ascontiguousarray(source.numpy().astype(want))

        return TensorRef(dtype=dtype, shape=tuple(self.shape), array_loader=load)
