"""Distances in units in the last place (ULPs) for F64 / F32 / F16 / BF16 arrays.

Floats of one format are mapped onto integers that count representable values in order
(``-0.0`` and ``+0.0`` both map to 0), so the ULP distance of two values is the difference of
their ordinals: adjacent floats are 1 apart, ``x`` and ``np.nextafter(x, inf)`` too, and the
distance across zero counts every value in between. The caller handles NaN (its ordinal is
meaningless).
"""

from __future__ import annotations

import numpy as np

from statekit import dtypes

_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}


def mantissa_bits(dtype: str) -> int:
    """Explicit mantissa bits of a statekit float dtype (F64 52, F32 23, F16 10, BF16 7)."""
    if dtype == "BF16":  # (ml_dtypes' finfo, imported only for a BF16 tensor)
        import ml_dtypes

        return int(ml_dtypes.finfo(ml_dtypes.bfloat16).nmant)
    return int(np.finfo(dtypes.numpy_dtype(dtype)).nmant)


def coarser(a: str, b: str) -> str:
    """The float dtype of the two with fewer mantissa bits (ties: ``a``)."""
    return b if mantissa_bits(b) < mantissa_bits(a) else a


def ordinals(values: np.ndarray) -> np.ndarray:
    """Each float's position in its format's ordered set of values, as int64 (``±0`` → 0)."""
    width = values.dtype.itemsize
    bits = np.ascontiguousarray(values).view(_SIGNED[width]).astype(np.int64)
    lowest = np.int64(np.iinfo(_SIGNED[width]).min)
    # Negative floats have the sign bit set: as signed integers they grow as the float shrinks.
    # ``lowest - bits`` turns them into -1, -2, … below zero without overflowing.
    return np.where(bits < 0, lowest - bits, bits)


def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ULP distance of two arrays of the same float format, as uint64 (exact even for F64)."""
    if a.dtype != b.dtype:
        raise ValueError(f"ULP distance needs one float format, got {a.dtype} and {b.dtype}")
    oa, ob = ordinals(a), ordinals(b)
    ua, ub = oa.view(np.uint64), ob.view(np.uint64)
    # The difference of two int64 taken modulo 2**64 is exact as long as it is non-negative.
    return np.where(oa >= ob, ua - ub, ub - ua)
