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
from statekit.tensor import PIECE, TensorRef

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis


def _intersect(chunk: dcp.Chunk, box: Box) -> Box | None:
    out = []
    for o, s, (a, b) in zip(chunk.offsets, chunk.sizes, box, strict=True):
        lo, hi = max(o, a), min(o + s, b)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def read_box(reader: dcp.DcpReader, entry: dcp.TensorEntry, box: Box) -> np.ndarray:
    """The values of ``entry`` inside ``box`` (an array of the box's shape); every element of
    the box must be covered by the chunks (DCP's tiling check saw to that)."""
    shape = tuple(b - a for a, b in box)
    out = np.empty(shape, dtype=dtypes.numpy_dtype(entry.dtype))
    for c in entry.chunks:
        part = _intersect(c, box)
        if part is None:
            continue
        values = reader.chunk(entry, c).numpy()
        src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(part, c.offsets, strict=True))
        dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, box, strict=True))
        out[dst] = values[src]
    return out


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

        return TensorRef(entry.dtype, rest, loader=lambda: reader.chunk(entry, whole).raw(),
                         chunk_reader=pieces, info=info)
    return TensorRef(entry.dtype, rest, array_loader=lambda: read_box(reader, entry, box).reshape(rest), info=info)


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

        return TensorRef(entry.dtype, rest, loader=lambda: b"".join(bytes(p) for p in pieces(PIECE)),
                         chunk_reader=pieces, info=info)
    return TensorRef(entry.dtype, rest, array_loader=assemble, info=info)
