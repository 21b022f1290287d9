"""statekit's dtype names (burn's ``DType`` spellings) and their numpy equivalents.

All containers translate their own dtype spelling into these names, so the state model and the
operations speak one vocabulary: ``F64 F32 Flex32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 Bool``
plus ``QFloat`` (opaque bytes). Bool has three storage forms in burnpack (``Native``/``U8``/``U32``);
they are kept as the dtype name ``Bool`` with the store recorded separately by the container.
"""

from __future__ import annotations

import sys
from functools import cache

from statekit.lazy import numpy as np

# name -> (numpy dtype string, bytes per element); numpy itself is imported on first use
_SPEC: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "Flex32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U64": ("<u8", 8),
    "U32": ("<u4", 4),
    "U16": ("<u2", 2),
    "U8": ("u1", 1),
    "Bool": ("?", 1),
}


@cache
def _numpy_table() -> dict[str, np.dtype]:
    """name -> little-endian numpy dtype, for the dtypes numpy has itself (BF16 is ml_dtypes':
    :func:`_extended`, imported only when a BF16 tensor is met — ml_dtypes 0.7 takes ~1 s)."""
    return {name: np.dtype(spec) for name, (spec, _) in _SPEC.items() if spec != "bfloat16"}


@cache
def _extended(name: str) -> np.dtype:
    if name != "BF16":
        raise KeyError(name)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


FLOAT_DTYPES = frozenset({"F64", "F32", "Flex32", "F16", "BF16"})
DTYPE_NAMES = frozenset(_SPEC) | {"QFloat"}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds elements of statekit dtype ``name`` (little-endian)."""
    try:
        return _numpy_table()[name]
    except KeyError:
        pass
    try:
        return _extended(name)
    except KeyError:
        raise ValueError(f"dtype {name!r} has no numpy equivalent") from None


def itemsize(name: str) -> int:
    try:
        return _SPEC[name][1]
    except KeyError:
        raise ValueError(f"dtype {name!r} has no numpy equivalent") from None


def from_numpy(dtype: np.dtype) -> str:
    """The statekit dtype name of a numpy dtype (Flex32 is never chosen: F32 is)."""
    dtype = np.dtype(dtype)
    ml_dtypes = sys.modules.get("ml_dtypes")  # (no array of its dtypes exists before it is imported)
    if ml_dtypes is not None and dtype == ml_dtypes.bfloat16:
        return "BF16"
    for name, dt in _numpy_table().items():
        if name == "Flex32":
            continue
        if dt == dtype.newbyteorder("<") or dt == dtype:
            return name
    raise ValueError(f"numpy dtype {dtype} is not supported")


def is_float(name: str) -> bool:
    return name in FLOAT_DTYPES
