"""One parameter's values out of a torch_dist tensor: a box of a (stacked) DCP tensor, or of the
N-D reformulated tensor ``fully_sharded_model_space`` saves (``shared/docs/megatron-formats.md``
§2.5), as lazy tensors that read only the chunks the box touches.

Reformulation: a distributed-optimizer tensor whose model global shape is ``G`` and whose
rank-local shape (one layer, one TP shard, one expert...) is ``l`` is stored with the shape
``axis_fragmentations + [prod(l)]``, ``frag[i] = G[i] / l[i]``: fragment ``t`` holds the local
tensor flattened row-major (each DP rank wrote a contiguous range of it, one chunk each). The
original ``G`` is in ``.metadata``'s ``mcore_data``. Decoding places fragment ``t``'s values,
reshaped to ``l``, at ``t * l`` of ``G``. The local shape is recovered from ``G`` and the stored
fragment counts; a fragment count that does not divide ``G`` is refused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from statekit import dtypes
from statekit.errors import FormatError
from statekit.formats import dcp
from statekit.tensor import PIECE, FileSpan, TensorRef

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis


def _intersect(chunk: dcp.Chunk, box: Box) -> Box | None:
    out = []
    for o, s, (a, b) in zip(chunk.offsets, chunk.sizes, box, strict=True):
        lo, hi = max(o, a), min(o + s, b)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _bits(dtype: str) -> np.dtype:
    """An unsigned integer dtype of ``dtype``'s width: boxes are copied as bit patterns, so a bf16
    weight needs no bf16 type (importing ml_dtypes costs a second)."""
    return np.dtype(f"<u{dtypes.itemsize(dtype)}")


def _file_span(ref: TensorRef) -> FileSpan | None:
    """The chunk's bytes as a plain span of its file (C order, little-endian), else None."""
    if ref.span is None or ref.loader is not None or ref.array_loader is not None or ref.piece_source is not None:
        return None
    return ref.span


def _strides(sizes: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= n
    return out[::-1]


def _chunk_part(reader: dcp.DcpReader, entry: dcp.TensorEntry, c: dcp.Chunk, part: Box, bits: np.dtype):
    """The elements of chunk ``c`` inside ``part`` (an array of the part's shape, as bits), reading
    only the rows of the chunk that the part touches: the leading axes where the part is one index
    are fixed, the next axis's range read whole, the later axes sliced from it."""
    ref = reader.chunk(entry, c)
    local = tuple((lo - o, hi - o) for (lo, hi), o in zip(part, c.offsets, strict=True))
    span = _file_span(ref)
    if span is None or not local:
        values = np.frombuffer(ref.raw(), dtype=bits).reshape(c.sizes)
        return values[tuple(slice(lo, hi) for lo, hi in local)]
    j = next((i for i, (lo, hi) in enumerate(local) if hi - lo > 1), len(local) - 1)
    strides = _strides(c.sizes)
    first = sum(lo * st for (lo, _), st in zip(local[:j + 1], strides, strict=False))
    rows = local[j][1] - local[j][0]
    count = rows * strides[j]
    raw = span.read(first * bits.itemsize, count * bits.itemsize)
    values = np.frombuffer(raw, dtype=bits).reshape((rows, *c.sizes[j + 1:]))
    return values[(slice(None), *(slice(lo, hi) for lo, hi in local[j + 1:]))]


def read_box_bits(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box) -> np.ndarray:
    """The values of ``entry`` inside ``box`` as unsigned bit patterns (an array of the box's shape);
    every element of the box must be covered by the chunks (DCP's tiling check saw to that)."""
    bits = _bits(entry.dtype)
    out = np.empty(tuple(b - a for a, b in box), dtype=bits)
    for c in entry.chunks:
        part = _intersect(c, box)
        if part is None:
            continue
        dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, box, strict=True))
        out[dst] = _chunk_part(reader, entry, c, part, bits).reshape(out[dst].shape)
    return out


def read_box(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box) -> np.ndarray:
    """The values of ``entry`` inside ``box`` (an array of the box's shape, of the entry's dtype)."""
    return read_box_bits(reader, entry, box).view(dtypes.numpy_dtype(entry.dtype))


def _runs(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box) -> list[FileSpan] | None:
    """The box's bytes as file spans in C order, where the chunks cut it along its first axis of
    more than one index only and each chunk's share is one run of its file (a stacked tensor's
    layer, a TP shard of rows, the DP ranks' ranges of a bucket); None otherwise."""
    k = next((i for i, (a, b) in enumerate(box) if b - a > 1), len(box) - 1)
    found = []
    for c in entry.chunks:
        part = _intersect(c, box)
        if part is None:
            continue
        if any(part[i] != box[i] for i in range(k + 1, len(box))):
            return None  # (the chunks also cut a later axis)
        local = [(lo - o, hi - o) for (lo, hi), o in zip(part, c.offsets, strict=True)]
        j = next((i for i, (lo, hi) in enumerate(local) if hi - lo > 1), len(local) - 1)
        if any(local[i] != (0, c.sizes[i]) for i in range(j + 1, len(local))):
            return None  # (its share is not contiguous in the chunk)
        span = _file_span(reader.chunk(entry, c))
        if span is None:
            return None
        item = dtypes.itemsize(entry.dtype)
        first = sum(lo * st for (lo, _), st in zip(local, _strides(c.sizes), strict=True))
        found.append((part[k][0], FileSpan.at(span.file, span.offset + first * item, math.prod(
            hi - lo for lo, hi in part) * item)))
    found.sort(key=lambda f: f[0])
    spans: list[FileSpan] = []
    for _, sp in found:  # neighbours in one file join
        last = spans[-1] if spans else None
        if last is not None and last.file is sp.file and last.offset + last.length == sp.offset:
            spans[-1] = FileSpan.at(sp.file, last.offset, last.length + sp.length)
        else:
            spans.append(sp)
    return spans


def _slabs(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box, size: int) -> Iterator[memoryview]:
    """The box's bytes in C order, a slab of its first axis of more than one index at a time (at
    most ``size`` bytes where a row of the later axes fits in it)."""
    k = next((i for i, (a, b) in enumerate(box) if b - a > 1), len(box) - 1)
    a, b = box[k]
    row = math.prod(hi - lo for lo, hi in box[k + 1:]) * dtypes.itemsize(entry.dtype)
    step = max(1, size // max(1, row))
    for lo in range(a, b, step):
        sub = (*box[:k], (lo, min(b, lo + step)), *box[k + 1:])
        yield memoryview(read_box_bits(reader, entry, sub).reshape(-1).view(np.uint8))


def boxed(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box, shape: tuple[int, ...], info: dict) -> TensorRef:
    """The values of ``entry`` inside ``box`` as a lazy tensor of ``shape`` (the box's element
    count), streamed: the runs of each chunk's file in order where the chunks cut the box along
    one axis, else slabs of the box copied out of the rows of the chunks they touch. Memory is one
    piece, whatever the box's size; nothing is read (not even a chunk's archive) until asked."""
    plan: list[list[FileSpan] | None] = []

    def runs() -> list[FileSpan] | None:
        if not plan:
            plan.append(_runs(reader, entry, box))
        return plan[0]

    def pieces(size: int) -> Iterator[bytes | memoryview]:
        spans = runs()
        if spans is None:
            yield from _slabs(reader, entry, box, size or PIECE)
            return
        for sp in spans:
            yield from sp.chunks(size or PIECE)

    return TensorRef(entry.dtype, shape, loader=lambda: b"".join(bytes(p) for p in pieces(PIECE)),
                     chunk_reader=pieces, info=info, runs=runs)


def _joined(chunks: list[TensorRef]) -> list[FileSpan] | None:
    """The chunks' bytes back to back as file spans (what their ``iter_bytes`` give), or None
    where one is not a plain span of its file."""
    spans = [_file_span(c) for c in chunks]
    return None if any(sp is None for sp in spans) else spans


def _whole_chunk(entry: dcp.TensorEntry, box: Box) -> dcp.Chunk | None:
    """The one chunk that is exactly ``box`` (then its bytes are the box's, in order)."""
    for c in entry.chunks:
        if tuple((o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True)) == box:
            return c
    return None


def plain(reader: dcp.DcpReader, entry: dcp.TensorEntry, lead: tuple[int, ...], info: dict) -> TensorRef:
    """Element ``lead`` of the leading (stacked) axes of ``entry``, as a lazy tensor of the
    remaining axes' shape."""
    rest = entry.shape[len(lead):]
    box: Box = tuple((i, i + 1) for i in lead) + tuple((0, d) for d in rest)
    info = {**info, "dcp_key": entry.key}
    if not math.prod(rest):
        return TensorRef(entry.dtype, rest, loader=lambda: b"", info=info)
    whole = _whole_chunk(entry, box)
    if whole is not None:  # one chunk holds exactly this parameter: streamed as stored
        def pieces(size: int) -> Iterator[bytes | memoryview]:
            yield from reader.chunk(entry, whole).iter_bytes(size)

        def runs() -> list[FileSpan] | None:
            return _joined([reader.chunk(entry, whole)])

        return TensorRef(entry.dtype, rest, loader=lambda: reader.chunk(entry, whole).raw(),
                         chunk_reader=pieces, info=info, runs=runs)
    return boxed(reader, entry, box, rest, info)


def local_shape(key: str, stored: tuple[int, ...], global_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The rank-local shape of a reformulated tensor: ``G / fragments``, checked against the
    stored flat length."""
    frag = stored[:-1]
    if len(frag) != len(global_shape) or any(f <= 0 or g % f for f, g in zip(frag, global_shape, strict=True)):
        raise FormatError(f"{key}: stored shape {list(stored)} is not a reformulation of the global shape "
                          f"{list(global_shape)} (fragments must divide each axis)")
    local = tuple(g // f for g, f in zip(global_shape, frag, strict=True))
    if math.prod(local) != stored[-1]:
        raise FormatError(f"{key}: a fragment of {stored[-1]} elements cannot hold the local shape {list(local)}")
    return local


def reformulated(reader: dcp.DcpReader, entry: dcp.TensorEntry, global_shape: tuple[int, ...],
                 lead: tuple[int, ...], info: dict) -> TensorRef:
    """Element ``lead`` of the stacked axes of the model tensor ``global_shape`` that ``entry``
    stores reformulated, decoded into the parameter's own shape (lazy)."""
    local = local_shape(entry.key, entry.shape, global_shape)
    n = len(lead)
    if any(d != 1 for d in local[:n]):
        raise FormatError(f"{entry.key}: the stacked axes are not one fragment per layer/expert (local shape "
                          f"{list(local)}); statekit cannot cut one parameter out of it")
    rest = global_shape[n:]
    frag = entry.shape[n:-1]
    flat = entry.shape[-1]
    info = {**info, "dcp_key": entry.key, "reformulated": list(entry.shape)}

    def assemble() -> np.ndarray:
        out = np.empty(rest, dtype=dtypes.numpy_dtype(entry.dtype))
        for t in itertools.product(*(range(f) for f in frag)):
            box: Box = tuple((i, i + 1) for i in lead) + tuple((i, i + 1) for i in t) + ((0, flat),)
            values = read_box(reader, entry, box).reshape(local[n:])
            out[tuple(slice(i * s, (i + 1) * s) for i, s in zip(t, local[n:], strict=True))] = values
        return out

    box: Box = tuple((i, i + 1) for i in lead) + tuple((0, 1) for _ in frag) + ((0, flat),)
    ranges = sorted((c for c in entry.chunks if _intersect(c, box)), key=lambda c: c.offsets[-1])
    if all(f == 1 for f in frag) and all(set(c.sizes[:-1]) <= {1} for c in ranges):
        # one fragment, chunks that are ranges of it: its flat bytes are the parameter's, in order
        def pieces(size: int) -> Iterator[bytes | memoryview]:
            for c in ranges:
                yield from reader.chunk(entry, c).iter_bytes(size or PIECE)

        def runs() -> list[FileSpan] | None:
            return _joined([reader.chunk(entry, c) for c in ranges])

        return TensorRef(entry.dtype, rest, loader=lambda: b"".join(bytes(p) for p in pieces(PIECE)),
                         chunk_reader=pieces, info=info, runs=runs)
    return TensorRef(entry.dtype, rest, array_loader=assemble, info=info)
