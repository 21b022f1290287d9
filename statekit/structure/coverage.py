"""Coverage: every element of a new tensor is written by exactly one piece, or declared new.

Checked on contiguous segments, not elements: each piece is cut along an axis on which it writes
consecutive elements, so a row-wise map costs one entry per row, as its hashes did.
"""

from __future__ import annotations

from statekit.errors import MappingError
from statekit.lazy import numpy as np
from statekit.structure.pieces import TargetMap, unravel


def check(t: TargetMap, source_sizes: dict[str, int], where: str | None = None) -> None:
    """Refuse a map that reads outside a source, writes outside the target, writes an element twice,
    or leaves a number of elements unwritten other than the ``new`` it declares."""
    starts, lengths = [], []
    for p in t.pieces:
        if p.source not in source_sizes:
            raise MappingError(f"{t.path}: the map reads {p.source}, which the old weights do not have", where)
        lo, hi = p.src_span()
        if lo < 0 or hi >= source_sizes[p.source]:
            raise MappingError(f"{t.path}: the map reads outside {p.source} (elements {lo}..{hi} of "
                               f"{source_sizes[p.source]})", where)
        lo, hi = p.dst_span()
        if lo < 0 or hi >= t.numel:
            raise MappingError(f"{t.path}: the map writes outside the tensor (elements {lo}..{hi} of {t.numel})", where)
        s, n = _segments(p)
        starts.append(s)
        lengths.append(np.full(s.size, n, np.int64))
    if starts:
        s = np.concatenate(starts)
        n = np.concatenate(lengths)
        order = np.argsort(s, kind="stable")
        s, n = s[order], n[order]
        clash = np.flatnonzero(s[1:] < s[:-1] + n[:-1])
        if clash.size:
            at = int(s[clash[0] + 1])
            raise MappingError(f"{t.path}: two pieces of the map write element {list(unravel(at, t.shape))}", where)
        written = int(n.sum())
    else:
        written = 0
    if written + t.new != t.numel:
        raise MappingError(f"{t.path}: the map writes {written} of {t.numel} elements and declares {t.new} new; "
                           "every element must be written once or be new", where)


def _segments(p) -> tuple[np.ndarray, int]:
    """The piece as runs of consecutive target elements: their first flat indices, and their length."""
    unit = [k for k, s in enumerate(p.dst_strides) if s == 1]
    axis = max(unit, key=lambda k: p.shape[k]) if unit else None
    offs = np.array([p.dst_offset], np.int64)
    for k, (n, stride) in enumerate(zip(p.shape, p.dst_strides, strict=True)):
        if k != axis:
            offs = (offs[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    return offs, (p.shape[axis] if axis is not None else 1)
