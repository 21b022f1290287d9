"""Bounded-bin histograms on float32 bit patterns, their percentiles, and exact thresholds.

A non-negative float32's bits, shifted right by :data:`SHIFT`, keep its exponent and its top four
mantissa bits: :data:`NBINS` bins, each 1/16 of an octave wide (0.019 decades), counted with one
``bincount`` per piece and no logarithm. Percentiles are read from the counts (nearest rank) and
land within one bin of the exact order statistic. Thresholds (:func:`threshold`) turn a monotone
predicate (``√(v/bc2) < ε`` in float64) into one comparison per element that counts exactly what
the predicate would.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

from statekit.lazy import numpy as np

SHIFT = 19
NBINS = 1 << (32 - SHIFT)
FINITE = 0x7F800000 >> SHIFT  # bins from here on hold Inf/NaN, and past NBINS // 2 negative values


def counts(x) -> np.ndarray:
    """The bin counts of a float32 array (any other float dtype is converted first)."""
    if x.dtype != np.float32:
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)
    return np.bincount(np.right_shift(x.view(np.uint32), SHIFT), minlength=NBINS)


def _float32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def value(b: int) -> float:
    """A bin's representative: the geometric middle of its values (0 for the bin of zero)."""
    if b == 0:
        return 0.0
    lo, hi = _float32(b << SHIFT), _float32(min((b + 1) << SHIFT, 0x7F7FFFFF))
    return math.sqrt(lo * hi) if lo > 0 else hi / 2


_LOG10: list = []  # log10 of every bin's representative (bins 1 .. FINITE - 1), made once


def log10_values():
    """``log10(value(b))`` for every finite bin ``b`` as one array (index 0: the bin of zero, NaN)."""
    if not _LOG10:
        b = np.arange(FINITE, dtype=np.uint64)
        lo = (b << SHIFT).astype(np.uint32).view(np.float32).astype(np.float64)
        hi = np.minimum((b + 1) << SHIFT, 0x7F7FFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            mid = np.where(lo > 0, np.sqrt(lo * hi), hi / 2)
            out = np.log10(mid)
        out[0] = np.nan
        _LOG10.append(out)
    return _LOG10[0]


def ranked(hist: np.ndarray, ranks: list[int]) -> list[float | None]:
    """The values at 1-based ``ranks`` among the finite non-negative values counted in ``hist``."""
    cum = np.cumsum(hist[:FINITE])
    total = int(cum[-1]) if len(cum) else 0
    out: list[float | None] = []
    for r in ranks:
        if total == 0 or r < 1 or r > total:
            out.append(None)
            continue
        out.append(value(int(np.searchsorted(cum, r))))
    return out


def finite_total(hist: np.ndarray) -> int:
    return int(hist[:FINITE].sum())


def log10_histogram(hist: np.ndarray, scale: float, power: float, width: float = 0.25) -> dict | None:
    """``log10((x·scale)^power)`` of the counted values, re-binned to ``width`` decades:
    ``{"lo", "width", "counts", "zeros"}`` over the occupied range (zeros counted apart)."""
    finite = hist[:FINITE]
    zeros = int(finite[0])
    nz = np.flatnonzero(finite[1:]) + 1
    if not len(nz):
        return {"lo": None, "width": width, "counts": [], "zeros": zeros} if zeros else None
    logs = power * (log10_values()[nz] + math.log10(scale))
    idx = np.floor(logs / width).astype(np.int64)
    lo = int(idx.min())
    out = np.zeros(int(idx.max()) - lo + 1, dtype=np.int64)
    np.add.at(out, idx - lo, finite[nz])
    return {"lo": lo * width, "width": width, "counts": out.tolist(), "zeros": zeros}


_THRESHOLDS: dict = {}


def cached_threshold(key: tuple, pred: Callable[[float], bool], dtype) -> float:
    """:func:`threshold`, once per ``key`` (the predicate's constants) and dtype in a process."""
    k = (key, np.dtype(dtype).str)
    if k not in _THRESHOLDS:
        _THRESHOLDS[k] = threshold(pred, dtype)
    return _THRESHOLDS[k]


def threshold(pred: Callable[[float], bool], dtype) -> float:
    """The smallest non-negative value ``T`` of ``dtype`` (float32 or float64) at which ``pred`` is
    false, ``pred`` being true below it (monotone): ``x < T`` then equals ``pred(x)`` for every
    non-negative ``x`` of that dtype. ``inf`` when ``pred`` holds everywhere."""
    if np.dtype(dtype) == np.float64:
        fmt, top = "<d", 0x7FF0000000000000
        pack = "<Q"
    else:
        fmt, top = "<f", 0x7F800000
        pack = "<I"

    def val(bits: int) -> float:
        return struct.unpack(fmt, struct.pack(pack, bits))[0]

    if pred(val(top)):
        return math.inf
    lo, hi = 0, top  # pred(val(hi)) is false; find the first false
    if not pred(val(lo)):
        return 0.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(val(mid)):
            lo = mid
        else:
            hi = mid
    return val(hi)
