"""The proof: the map applied to the old weights gives the new weights, bit for bit.

Each piece is compared where both tensors lie (read-only maps of the files, released as the
comparison moves on, so memory stays bounded), a bounded block at a time. The first element that
disagrees is named with both values.
"""

from __future__ import annotations

import math

from statekit import dtypes, stream
from statekit.lazy import numpy as np
from statekit.structure.access import Weight
from statekit.structure.pieces import Piece, TargetMap, unravel

BLOCK = 4 << 20  # elements compared at once


def disagreement(t: TargetMap, new: Weight, old: dict[str, Weight], advance=None) -> str | None:
    """None when every piece of ``t`` reads from ``old`` exactly what ``new`` holds; else where not."""
    with new.mapped(sequential=True) as target:
        for name in t.sources:
            source = old[name]
            with source.mapped(sequential=True) as src:
                for piece in t.pieces:
                    if piece.source != name:
                        continue
                    for block in blocks(piece, BLOCK):
                        a, b = block.dst_view(target.array), block.src_view(src.array)
                        if not _same(a, b):
                            return _first_difference(t, new, source, block, a, b)
                        target.touched(a.nbytes)
                        src.touched(b.nbytes)
                        if advance is not None:
                            advance(a.nbytes + b.nbytes)
    return None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality: ``memcmp`` where both lie contiguous (no temporary), else numpy's."""
    if a.flags.c_contiguous and b.flags.c_contiguous and a.dtype == b.dtype:
        memcmp = stream._memcmp()
        if memcmp is not None:
            return not a.nbytes or memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
    return bool(np.array_equal(a, b))


def blocks(p: Piece, limit: int):
    """``p`` cut along its leading axes into pieces of at most ``limit`` elements."""
    if p.numel <= limit:
        yield p
        return
    if len(p.shape) == 1:
        for lo in range(0, p.shape[0], limit):
            yield Piece(p.source, (min(limit, p.shape[0] - lo),), p.src_offset + lo * p.src_strides[0], p.src_strides,
                        p.dst_offset + lo * p.dst_strides[0], p.dst_strides)
        return
    inner = math.prod(p.shape[1:])
    per = max(1, limit // inner)
    for lo in range(0, p.shape[0], per):
        n = min(per, p.shape[0] - lo)
        sub = Piece(p.source, (n, *p.shape[1:]), p.src_offset + lo * p.src_strides[0], p.src_strides,
                    p.dst_offset + lo * p.dst_strides[0], p.dst_strides)
        if sub.numel > limit:
            yield from blocks(sub, limit) if n > 1 else _inner_blocks(sub, limit)
        else:
            yield sub


def _inner_blocks(p: Piece, limit: int):
    """A piece of one leading index: cut along its next axis."""
    flat = Piece(p.source, p.shape[1:], p.src_offset, p.src_strides[1:], p.dst_offset, p.dst_strides[1:])
    yield from blocks(flat, limit)


def _first_difference(t: TargetMap, new: Weight, old: Weight, block: Piece, a: np.ndarray, b: np.ndarray) -> str:
    at = int(np.flatnonzero(a.reshape(-1) != b.reshape(-1))[0])
    index = unravel(at, block.shape)
    dst = block.dst_offset + sum(i * s for i, s in zip(index, block.dst_strides, strict=True))
    src = block.src_offset + sum(i * s for i, s in zip(index, block.src_strides, strict=True))
    return (f"{t.path}{list(unravel(dst, new.shape))} is {_value(new, a.reshape(-1)[at])} in the new weights, but "
            f"the map reads {_value(old, b.reshape(-1)[at])} from {old.path}{list(unravel(src, old.shape))}")


def _value(w: Weight, bits) -> str:
    try:
        return repr(np.array([bits], dtype=w.bits).view(dtypes.numpy_dtype(w.dtype))[0].item())
    except (TypeError, ValueError):
        return f"0x{int(bits):x}"
