"""statekit's dtype names (burn's ``DType`` spellings) and their numpy equivalents.

All containers translate their own dtype spelling into these names, so the state model and the
operations speak one vocabulary: ``F64 F32 Flex32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 Bool``
plus ``QFloat`` (opaque bytes). Bool has three storage forms in burnpack (``Native``/``U8``/``U32``);
they are kept as the dtype name ``Bool`` with the store recorded separately by the container.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# name -> little-endian numpy dtype
_NUMPY: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "Flex32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "Bool": np.dtype("?"),
}

FLOAT_DTYPES = frozenset({"F64", "F32", "Flex32", "F16", "BF16"})
DTYPE_NAMES = frozenset(_NUMPY) | {"QFloat"}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds elements of statekit dtype ``name`` (little-endian)."""
    try:
        return _NUMPY[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} has no numpy equivalent") from None


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def from_numpy(dtype: np.dtype) -> str:
    """The statekit dtype name of a numpy dtype (Flex32 is never chosen: F32 is)."""
    dtype = np.dtype(dtype)
    if dtype == ml_dtypes.bfloat16:
        return "BF16"
    for name, dt in _NUMPY.items():
        if name == "Flex32":
            continue
        if dt == dtype.newbyteorder("<") or dt == dtype:
            return name
    raise ValueError(f"numpy dtype {dtype} is not supported")


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES
