"""Moving state through a map: elementwise slots exactly as their weight moved; factored moments by rows.

:func:`assembled` builds a new tensor lazily from the old tensors a :class:`TargetMap` reads (an
optimizer slot of each source parameter, shaped like its weight): when a writer asks, the target is
filled piece by piece — its new elements with ``fill``, what a new parameter's state starts at — and
handed out in bounded pieces. It holds the target and one source at a time.

Adafactor keeps a matrix's second moment as a row factor and a column factor (means of v over the
columns and over the rows). :func:`line_map` tells whether a map builds every target row from one
whole source row (or every column from one whole column); then the factor along those lines moves
exactly (:func:`gathered`), and the other factor is the mean of the sources' factors weighted by how
many lines each gave (:func:`weighted`) — exact in real arithmetic, not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from statekit import dtypes, stream, tensor
from statekit.errors import MappingError
from statekit.lazy import numpy as np
from statekit.structure.pieces import Piece, TargetMap
from statekit.tensor import TensorRef


def assembled(t: TargetMap, slots: dict[str, TensorRef], dtype: str, fill: float = 0.0,
              label: str | None = None) -> TensorRef:
    """The slot of the new tensor ``t`` built from ``slots`` (old path → that slot of the old parameter)."""
    label = label or t.path
    for src in t.sources:
        ref = slots.get(src)
        if ref is None:
            raise MappingError(f"{label}: no state for {src}, which the map reads")
    whole = _whole(t, slots, dtype)
    if whole is not None:
        return whole
    np_dtype = dtypes.numpy_dtype(dtype)
    largest = max((slots[s].nbytes for s in t.sources), default=0)

    def source(elements: int) -> Iterator[np.ndarray]:
        out = np.full(t.numel, fill, np_dtype) if t.new else np.empty(t.numel, np_dtype)
        for src in t.sources:
            flat = _flat(slots[src])
            if flat.dtype != np_dtype:
                flat = flat.astype(np_dtype)
            for p in t.pieces:
                if p.source == src:
                    p.dst_view(out)[...] = p.src_view(flat)
            del flat
        for lo in range(0, t.numel, elements):
            yield out[lo : lo + elements]

    ref = stream.derived(dtype, t.shape, source, resident=t.numel * np_dtype.itemsize + largest)
    if not t.new and all(slots[s].dtype == dtype for s in t.sources):
        ref.runs = lambda: _file_runs(t, slots, np_dtype.itemsize)
    return ref


MAX_RUNS = 1 << 14  # contiguous runs of a target beyond which it is assembled in memory as before


def _element_runs(p: Piece) -> list[tuple[int, int, int]] | None:
    """The piece as ``(dst_start, src_start, length)`` element runs contiguous in both tensors, or
    None where there would be more than :data:`MAX_RUNS` (a transpose: one element each)."""
    k, block = len(p.shape), 1
    while k > 0 and (p.shape[k - 1] == 1 or (p.src_strides[k - 1] == block and p.dst_strides[k - 1] == block)):
        k -= 1
        block *= p.shape[k]
    outer = p.shape[:k]
    if math.prod(outer) > MAX_RUNS:
        return None
    runs = []
    for index in np.ndindex(*outer) if outer else [()]:
        dst = p.dst_offset + sum(i * st for i, st in zip(index, p.dst_strides, strict=False))
        src = p.src_offset + sum(i * st for i, st in zip(index, p.src_strides, strict=False))
        runs.append((dst, src, block))
    return runs


def _file_runs(t: TargetMap, slots: dict[str, TensorRef], item: int) -> list | None:
    """The target's bytes as file spans back to back, where its pieces copy contiguous runs of
    sources that are themselves file spans (a split of row blocks, a vocabulary cut, q/k/v out of
    a fused matrix): then a writer reads them straight from the files, nothing assembled in
    memory; None otherwise."""
    runs: list[tuple[int, str, int, int]] = []
    for p in t.pieces:
        got = _element_runs(p)
        if got is None or len(runs) + len(got) > MAX_RUNS:
            return None
        runs.extend((dst, p.source, src, n) for dst, src, n in got)
    runs.sort(key=lambda r: r[0])
    spans_of: dict[str, list | None] = {}
    out: list = []
    at = 0
    for dst, name, src, n in runs:
        if dst != at:  # (a gap or an overlap: not one run after another)
            return None
        if name not in spans_of:
            spans_of[name] = tensor.file_runs(slots[name])
        spans = spans_of[name]
        if spans is None or not tensor.cut_runs(spans, src * item, n * item, out):
            return None
        at += n
    return out if at == t.numel else None


def _flat(ref: TensorRef) -> np.ndarray:
    """``ref``'s values flat, read piece by piece into one array (a streamed tensor's ``numpy()``
    joins its pieces into bytes first: twice the tensor at once)."""
    if ref.array_loader is not None or (ref.chunk_reader is None and ref.span is None):
        return np.ascontiguousarray(ref.numpy()).reshape(-1)
    out = np.empty(ref.numel, dtypes.numpy_dtype(ref.dtype))
    view, at = memoryview(out.reshape(-1).view(np.uint8)), 0
    for piece in ref.iter_bytes():
        n = len(piece) if isinstance(piece, bytes) else memoryview(piece).nbytes
        if at + n > len(view):
            raise MappingError(f"a {ref.dtype} tensor of shape {list(ref.shape)} gave more than its {len(view)} bytes")
        view[at:at + n] = memoryview(piece).cast("B")
        at += n
    if at != len(view):
        raise MappingError(f"a {ref.dtype} tensor of shape {list(ref.shape)} gave {at} of its {len(view)} bytes")
    return out


def _whole(t: TargetMap, slots: dict[str, TensorRef], dtype: str) -> TensorRef | None:
    """The source itself, streamed, where ``t`` is one source's elements in the same C order and
    dtype (a rename or a reshape: nothing to hold whole), else None."""
    if t.new or len(t.pieces) != 1:
        return None
    p = t.pieces[0]
    ref = slots[p.source]
    if ref.dtype != dtype or ref.numel != t.numel or p.numel != t.numel or p.src_offset or p.dst_offset:
        return None
    axes = [k for k, n in enumerate(p.shape) if n != 1]
    step = 1
    for k in reversed(axes):  # C order over the piece's box, in both tensors
        if p.src_strides[k] != step or p.dst_strides[k] != step:
            return None
        step *= p.shape[k]
    if tuple(ref.shape) == tuple(t.shape):
        return ref
    return TensorRef(ref.dtype, tuple(t.shape), chunk_reader=ref.iter_bytes, info=dict(ref.info))


@dataclass(frozen=True)
class LineMap:
    """Target lines (rows: along the last axis; columns: along the second-to-last), each from one whole
    source line: ``target`` line numbers, their ``source`` paths and line numbers, and whether the source
    line is the source's own row (or column) in that orientation."""

    orient: str  # "rows" or "cols"
    target: np.ndarray
    source: list[str]
    line: np.ndarray


def line_map(t: TargetMap, shapes: dict[str, tuple[int, ...]]) -> LineMap | None:
    """How ``t`` is built from whole source lines of the same orientation, or None (then a factored
    moment cannot follow the map)."""
    if len(t.shape) < 2:
        return None
    for orient in ("rows", "cols"):
        parts = [_piece_lines(p, t.shape, shapes[p.source], orient) for p in t.pieces]
        if all(part is not None for part in parts):
            target = np.concatenate([a for a, _ in parts]) if parts else np.zeros(0, np.int64)
            names = [p.source for p, (a, _) in zip(t.pieces, parts, strict=True) for _ in range(a.size)]
            line = np.concatenate([b for _, b in parts]) if parts else np.zeros(0, np.int64)
            return LineMap(orient, target, names, line)
    return None


def _piece_lines(p: Piece, shape: tuple, src_shape: tuple, orient: str):
    """The (target line, source line) pairs of a piece that copies whole lines in order, else None."""
    if len(src_shape) < 2:
        return None
    n, m = shape[-2], shape[-1]
    sn, sm = src_shape[-2], src_shape[-1]
    length, step, src_length, src_step = (m, 1, sm, 1) if orient == "rows" else (n, m, sn, sm)
    if length != src_length:
        return None
    p = _lines_split(p, step, src_step, length)
    axes = [k for k, d in enumerate(p.dst_strides)
            if d == step and p.shape[k] == length and p.src_strides[k] == src_step]
    if not axes:
        return None
    k = axes[0]
    dst = np.array([p.dst_offset], np.int64)
    src = np.array([p.src_offset], np.int64)
    for j, size in enumerate(p.shape):
        if j != k:
            dst = (dst[:, None] + np.arange(size, dtype=np.int64) * p.dst_strides[j]).reshape(-1)
            src = (src[:, None] + np.arange(size, dtype=np.int64) * p.src_strides[j]).reshape(-1)
    if not (_starts(dst, shape, orient) and _starts(src, src_shape, orient)):
        return None
    return _line_numbers(dst, shape, orient), _line_numbers(src, src_shape, orient)


def _lines_split(p: Piece, step: int, src_step: int, length: int) -> Piece:
    """A compressed piece whose run along the lines covers several whole lines, cut back into lines."""
    for k, (size, d, s) in enumerate(zip(p.shape, p.dst_strides, p.src_strides, strict=True)):
        if d == step and s == src_step and size > length and size % length == 0:
            return Piece(p.source, (*p.shape[:k], size // length, length, *p.shape[k + 1 :]), p.src_offset,
                         (*p.src_strides[:k], s * length, s, *p.src_strides[k + 1 :]), p.dst_offset,
                         (*p.dst_strides[:k], d * length, d, *p.dst_strides[k + 1 :]))
    return p


def _starts(first: np.ndarray, shape: tuple, orient: str) -> bool:
    """Whether every offset is where a line of ``shape`` begins."""
    n, m = shape[-2], shape[-1]
    return bool((first % m == 0).all()) if orient == "rows" else bool((first % (n * m) < m).all())


def _line_numbers(first: np.ndarray, shape: tuple, orient: str) -> np.ndarray:
    """Line numbers of lines starting at flat offsets ``first`` (rows: offset / m; columns: b·m + j)."""
    n, m = shape[-2], shape[-1]
    if orient == "rows":
        return first // m
    b, rest = np.divmod(first, n * m)
    return b * m + rest % m


def factors(lines: LineMap, along: dict[str, np.ndarray], across: dict[str, np.ndarray],
            shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, bool]:
    """A factored moment through a line map. ``along``: each source's factor with one value per line of
    the map's orientation (rows: the row factor); ``across``: the other (one vector per matrix).
    Returns the target's two factors, flat, and whether both are exact: the factor along the lines is
    gathered exactly; the other is copied where one source matrix gave a whole target matrix, else the
    mean of the sources' vectors weighted by the lines each gave."""
    rows = lines.orient == "rows"
    n, m = shape[-2], shape[-1]
    per, length = (n, m) if rows else (m, n)
    matrices = math.prod(shape[:-2])
    out_along = np.zeros(matrices * per, np.float64)
    sums = np.zeros((matrices, length), np.float64)
    count = np.zeros(matrices, np.int64)
    first: dict[int, tuple[str, int]] = {}
    exact = True
    for name, line, target in zip(lines.source, lines.line.tolist(), lines.target.tolist(), strict=True):
        src_per = shapes[name][-2] if rows else shapes[name][-1]
        b_t, b_s = target // per, line // src_per
        out_along[target] = along[name].reshape(-1)[line]
        sums[b_t] += across[name].reshape(-1, length)[b_s]
        count[b_t] += 1
        if first.setdefault(b_t, (name, b_s)) != (name, b_s) or src_per != per:
            exact = False
    out_across = np.zeros((matrices, length), np.float64)
    for b in range(matrices):
        if b in first and exact:
            name, b_s = first[b]
            out_across[b] = across[name].reshape(-1, length)[b_s]
        elif count[b]:
            out_across[b] = sums[b] / count[b]
    return out_along, out_across.reshape(-1), exact
