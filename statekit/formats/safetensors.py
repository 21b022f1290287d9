"""The safetensors container: ``u64 LE header size N``, ``N`` bytes of JSON ``{name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}`` (padded with spaces to a multiple of 8), then the
tensor bytes back to back.

Reading uses the ``safetensors`` package (``safe_open(..., framework="np")``; bf16 through
ml_dtypes), one tensor at a time and only when asked. Writing is done here, streaming tensor by
tensor into an atomic temporary file, with the ordering the safetensors writer uses (dtype
alignment, then name), so ``safetensors.numpy.load_file`` and candle's ``safetensors::load``
read the result. What a file *means* (a model, candle AdamW state, statekit's generic layout) is
decided above this floor, in :mod:`statekit.frameworks.safetensors_io`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import numpy as np
from safetensors import SafetensorError, safe_open

from statekit import dtypes
from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.formats import limits
from statekit.stream import write_all
from statekit.tensor import FileSpan, SourceFile, TensorRef

MAX_HEADER = 100 * 1024 * 1024


# statekit dtype ⇄ safetensors dtype
TO_SAFETENSORS = {
    "F64": "F64", "F32": "F32", "Flex32": "F32", "F16": "F16", "BF16": "BF16", "I64": "I64",
    "I32": "I32", "I16": "I16", "I8": "I8", "U64": "U64", "U32": "U32", "U16": "U16", "U8": "U8",
    "Bool": "BOOL",
}
FROM_SAFETENSORS = {v: k for k, v in TO_SAFETENSORS.items() if k != "Flex32"}
# The safetensors writer orders tensors by dtype, largest alignment first (its Dtype enum order
# reversed), then by name; so does :func:`write_safetensors`.
_DTYPE_RANK = {name: i for i, name in enumerate(
    ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"))}


# ----------------------------------------------------------------------------- container


class SafetensorsFile:
    """An opened safetensors file: names in file order, shapes, dtypes, metadata; lazy tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._handle = safe_open(self.path, framework="np")
            names = list(self._handle.offset_keys())
            self.metadata: dict[str, str] = dict(self._handle.metadata() or {})
            self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}
            for name in names:
                view = self._handle.get_slice(name)
                raw_dtype = view.get_dtype()
                if raw_dtype not in FROM_SAFETENSORS:
                    raise FormatError(f"tensor {name!r} has dtype {raw_dtype}, which statekit does not handle")
                shape = [int(d) for d in view.get_shape()]
                problem = limits.shape_problem(shape, dtypes.itemsize(FROM_SAFETENSORS[raw_dtype]))
                if problem:  # numpy could not hold it either (a zero-size dimension beside huge ones)
                    raise FormatError(f"tensor {name!r}: {problem}")
                self.entries[name] = (FROM_SAFETENSORS[raw_dtype], tuple(shape))
            self._spans = self._locate()
        except SafetensorError as exc:
            raise FormatError(f"not a valid safetensors file: {exc}", self.path) from None
        except FormatError as exc:
            raise FormatError(exc.message, self.path) from None
        except OSError as exc:
            raise FormatError(f"cannot open: {exc.strerror or exc}", self.path) from None

    def _locate(self) -> dict[str, FileSpan]:
        """Each tensor's byte range in the file (the header the safetensors package validated),
        so that its bytes are read with ``pread`` in pieces, never the whole file mapped."""
        source = SourceFile.open(self.path)
        (size,) = struct.unpack("<Q", source.pread(0, 8))
        header = json.loads(source.pread(8, size))
        base = 8 + size
        spans = {}
        for name in self.entries:
            lo, hi = header[name]["data_offsets"]
            spans[name] = FileSpan(source, base + lo, hi - lo)
        return spans

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> TensorRef:
        dtype, shape = self.entries[name]
        span = self._spans.get(name)
        if span is not None and span.length == math.prod(shape) * dtypes.itemsize(dtype):
            return TensorRef(dtype=dtype, shape=shape, span=span)
        return TensorRef(dtype=dtype, shape=shape, array_loader=lambda: self._load(name))

    def _load(self, name: str) -> np.ndarray:
        if self._handle is None:
            raise FormatError(f"file was closed before tensor {name!r} was read", self.path)
        try:
            arr = self._handle.get_tensor(name)
        except SafetensorError as exc:
            raise FormatError(f"tensor {name!r}: {exc}", self.path) from None
        want = dtypes.numpy_dtype(self.entries[name][0])
        return arr if arr.dtype == want else arr.view(want)

    def scalar(self, name: str) -> int | float | bool:
        arr = self._load(name)
        if arr.size != 1:
            raise FormatError(f"{name!r} has shape {list(arr.shape)}, expected a single value", self.path)
        return arr.reshape(-1)[0].item()

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtypes.itemsize(dt) for dt, shape in self.entries.values())

    def close(self) -> None:
        self._handle = None
        for span in getattr(self, "_spans", {}).values():
            span.file.close()
            break

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, TensorRef]],
                      metadata: dict[str, str] | None = None, progress: Callable[[int], None] | None = None) -> int:
    """Write ``tensors`` as a safetensors file, atomically and one tensor at a time.

    Entries are ordered as the safetensors writer orders them (dtype alignment, then name); the
    ``__metadata__`` keys are sorted. Returns the file size.
    """
    seen: set[str] = set()
    items = []
    for name, ref in tensors:
        if name in seen:
            raise MappingError(f"two tensors would be named {name!r}")
        if name == "__metadata__":
            raise MappingError("a tensor cannot be named '__metadata__'")
        seen.add(name)
        if ref.dtype not in TO_SAFETENSORS:
            raise MappingError(f"tensor {name!r}: dtype {ref.dtype} has no safetensors equivalent")
        items.append((name, TO_SAFETENSORS[ref.dtype], ref))
    items.sort(key=lambda item: (-_DTYPE_RANK[item[1]], limits.utf8(item[0])))
    header: dict[str, object] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise MappingError(f"safetensors metadata must map strings to strings ({key!r})")
            limits.utf8(key), limits.utf8(value)  # JSON text holding a lone surrogate: refused, named
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, st_dtype, ref in items:
        size = ref.numel * dtypes.itemsize(ref.dtype)
        header[name] = {"dtype": st_dtype, "shape": list(ref.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise MappingError(f"safetensors header would be {len(text)} bytes (readers accept at most 100 MiB)")
    def done(i: int, _ref: TensorRef, stream) -> None:
        name = items[i][0]
        want = header[name]["data_offsets"]
        if stream.nbytes != want[1] - want[0]:
            raise ValueError(f"tensor {name!r} produced {stream.nbytes} bytes, expected {want[1] - want[0]}")
        if progress is not None:
            progress(stream.nbytes)

    with atomic_write(path) as out:
        out.write(len(text).to_bytes(8, "little") + text)
        write_all(out, [ref for _, _, ref in items], after=done)
    return 8 + len(text) + offset



def claims(head: bytes, path: str) -> bool:
    """Sniffer: a little-endian header size below 100 MiB followed by the JSON header's ``{``."""
    return len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < MAX_HEADER
