"""Weights as the structural map reads them: bits in the stored dtype, in bounded pieces, and keys of lines.

A *line* is a vector along one axis of a tensor: a *row* runs along the last axis (a 1-D tensor is
one row), a *column* along the second-to-last axis, one per column of each matrix of a batch. Two
lines can only be the same line if their keys are equal: a key hashes a line's length and the bits of
:data:`SAMPLES` elements at positions that depend on the length alone, so a row of a new tensor and
the column of an old one it was transposed from get equal keys. Keys only propose; every match is
proved on all the bits (:mod:`statekit.structure.proof`) before anything is moved.

Bits are compared as unsigned integers of the element's width (bf16 as 16 bits), so ``-0.0`` and
``0.0`` differ and NaN payloads count, as a bit-for-bit proof needs.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading

from statekit import dtypes
from statekit.errors import FormatError
from statekit.lazy import numpy as np
from statekit.tensor import TensorRef

SAMPLES = 16  # elements of a line hashed into its key
WHOLE_SAMPLES = 64  # elements of a whole tensor hashed into its key
BUFFER_MIN = 1 << 20  # bytes a read buffer starts at
SMALL_READ = 256 << 10  # bytes of a tensor read whole for its whole-tensor key (else an element a read)
RELEASE_EVERY = 16 << 20  # bytes of a mapped tensor touched before its pages are let go (madvise)
_BITS = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_M = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


class Weight:
    """One weight tensor of a model file: ``path``, ``shape``, ``dtype`` and its bits on demand."""

    def __init__(self, path: str, ref: TensorRef, source: str | None = None):
        self.path = path
        self.ref = ref
        self.shape = tuple(int(n) for n in ref.shape)
        self.dtype = ref.dtype
        self.file = source
        try:
            self.itemsize = dtypes.itemsize(ref.dtype)
        except ValueError:
            self.itemsize = 0
        self.bits = np.dtype(_BITS[self.itemsize]) if self.itemsize in _BITS else None
        self._whole: np.ndarray | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def comparable(self) -> bool:
        return self.bits is not None

    def read(self, lo: int, n: int) -> np.ndarray:
        """Elements ``[lo, lo + n)`` (flat, C order) as bits."""
        span = self.ref.span
        if span is not None and self.ref.array_loader is None:
            return np.frombuffer(span.read(lo * self.itemsize, n * self.itemsize), self.bits)
        return self.flat()[lo : lo + n]

    def flat(self) -> np.ndarray:
        """All elements as bits (the whole tensor in memory; kept for the tensors that have no file span).
        Read as bytes: a bf16 tensor's bits need no bf16 type (importing ml_dtypes costs a second)."""
        if self._whole is None:
            self._whole = np.frombuffer(self.ref.raw(), self.bits)
        return self._whole

    def chunks(self, elements: int):
        """``(first element, bits)`` in consecutive pieces of ``elements`` (the last shorter)."""
        lo = 0
        for raw in self.ref.iter_bytes(max(1, elements) * self.itemsize):
            bits = np.frombuffer(raw, self.bits)
            yield lo, bits
            lo += bits.size

    @contextlib.contextmanager
    def mapped(self, sequential: bool = False):
        """The bits as a read-only flat array over the file's pages (no copy) where the tensor is a
        file span, else in memory. :func:`Mapped.touched` lets pages go as they are left behind;
        ``sequential``: the reader goes through all of it in order (the kernel reads ahead)."""
        span = self.ref.span
        if span is None or self.ref.array_loader is not None or not self.numel:
            yield Mapped(self.flat(), None)
            return
        fd = span.file.fh.fileno()
        start = span.offset - span.offset % mmap.ALLOCATIONGRANULARITY
        if os.fstat(fd).st_size < span.offset + span.length:
            raise FormatError(f"{self.path}: the file ends inside this tensor", self.file or span.file.path)
        region = mmap.mmap(fd, span.offset + span.length - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                           offset=start)
        if sequential and hasattr(region, "madvise"):
            with contextlib.suppress(OSError, ValueError):
                region.madvise(mmap.MADV_SEQUENTIAL)
        arr = np.frombuffer(region, dtype=self.bits, count=self.numel, offset=span.offset - start)
        holder = Mapped(arr, region)
        try:
            yield holder
        finally:
            del arr
            holder.array = None
            with contextlib.suppress(BufferError):
                region.close()


class Mapped:
    """A mapped tensor's bits; :meth:`touched` counts bytes read and releases the pages every
    :data:`RELEASE_EVERY` (they stay in the page cache), so memory stays bounded whatever the size."""

    def __init__(self, array: np.ndarray, region: mmap.mmap | None):
        self.array = array
        self.region = region
        self._since = 0

    def touched(self, nbytes: int) -> None:
        if self.region is None:
            return
        self._since += nbytes
        if self._since >= RELEASE_EVERY and hasattr(self.region, "madvise"):
            with contextlib.suppress(OSError, ValueError):
                self.region.madvise(mmap.MADV_DONTNEED)
            self._since = 0


def positions(length: int, samples: int = SAMPLES) -> np.ndarray:
    """Where a line of ``length`` elements is sampled for its key (a function of the length alone):
    ``samples`` elements at an even step from the first (:func:`sampled` as a slice)."""
    at = sampled(length, samples)
    return np.arange(at.start, at.stop, at.step, dtype=np.int64)


def sampled(length: int, samples: int = SAMPLES) -> slice:
    """:func:`positions` as a slice: gathered as a strided view, a sixth of the time of the same
    elements gathered by index (numpy's fancy indexing)."""
    k = min(samples, length)
    step = length // k if k else 1
    return slice(0, k * step, step)


def mix(values: np.ndarray, length: int) -> np.ndarray:
    """One 64-bit key per row of ``values`` (n × k element bits) for lines of ``length``: the row's
    bits mixed a 64-bit word at a time (four bf16 elements a step)."""
    words = _words(values)
    if words.shape[0] <= _FEW_ROWS:  # (per element, Python's integers beat numpy's calls on a few rows)
        return np.array([_mix_row(row, length) for row in words.tolist()], np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(words.shape[0], (length * _M[0]) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
        for k in range(words.shape[1]):
            h ^= words[:, k] + np.uint64(k + 1)
            h *= np.uint64(_M[1])
            h ^= h >> np.uint64(29)
        h *= np.uint64(_M[2])
        h ^= h >> np.uint64(32)
    return h


def _words(values: np.ndarray) -> np.ndarray:
    """Each row's element bits as little-endian 64-bit words (the last zero-padded)."""
    n, k = values.shape
    size = values.dtype.itemsize
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(n, k * size)
    if (k * size) % 8:
        raw = np.concatenate([raw, np.zeros((n, -(k * size) % 8), np.uint8)], axis=1)
    return raw.view("<u8")


_FEW_ROWS = 4
_MASK = (1 << 64) - 1


def _mix_row(row: list[int], length: int) -> int:
    """:func:`mix` of one row of words, the same bits."""
    m1, m2, mask = _M[1], _M[2], _MASK
    h = (length * _M[0]) & mask
    for k, x in enumerate(row, 1):
        h ^= (x + k) & mask
        h = (h * m1) & mask
        h ^= h >> 29
    h = (h * m2) & mask
    return h ^ (h >> 32)


def row_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1]) if shape else 1


def col_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else 0


def row_keys(w: Weight) -> np.ndarray:
    """A key per row (line along the last axis): the sampled columns of every row, gathered as a
    strided view of the file's pages a band of :data:`RELEASE_EVERY` bytes at a time, the pages let go
    after each band (only the samples are kept: one tensor's worth, mixed at once). Only the sampled
    cache lines are read: copying the rows out cost five times as much."""
    length = w.shape[-1] if w.shape else 1
    if not length or not w.numel:
        return np.zeros(0, np.uint64)
    where = sampled(length)
    rows = row_count(w.shape)
    if not on_disk(w):
        return mix(w.flat().reshape(-1, length)[:, where], length)
    samples = np.empty((rows, min(SAMPLES, length)), w.bits)
    row_bytes = length * w.itemsize
    per = max(1, RELEASE_EVERY // row_bytes)
    with w.mapped(sequential=True) as m:
        for first in range(0, rows, per):
            n = min(per, rows - first)
            samples[first : first + n] = m.array[first * length : (first + n) * length].reshape(n, length)[:, where]
            m.touched(n * row_bytes)
    return mix(samples, length)


def on_disk(w: Weight) -> bool:
    """Whether ``w``'s bits lie in a file span (else they are in memory)."""
    return w.ref.span is not None and w.ref.array_loader is None


_LOCAL = threading.local()


def thread_buffers() -> Buffers:
    """The thread's two reused read buffers (the proof's pool threads keep theirs for the process)."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = Buffers()
    return buffers


class Buffers:
    """Two reused buffers (the new tensor's window, the old one's): no fresh memory, no page faults per
    read."""

    def __init__(self):
        self._raw: list[bytearray | None] = [None, None]

    def read(self, w: Weight, lo: int, hi: int, which: int) -> np.ndarray:
        """Elements ``[lo, hi]`` of ``w`` as bits (a view of buffer ``which``, valid until its next read)."""
        if not on_disk(w):
            return w.flat()[lo : hi + 1]
        n = (hi - lo + 1) * w.itemsize
        raw = self._raw[which]
        if raw is None or len(raw) < n:
            raw = self._raw[which] = bytearray(max(n, BUFFER_MIN))
        view = memoryview(raw)[:n]
        span = w.ref.span
        span.file.pread_into(view, span.offset + lo * w.itemsize)
        return np.frombuffer(view, w.bits)


def col_keys(w: Weight) -> np.ndarray:
    """A key per column (line along the second-to-last axis) of each matrix: only the sampled rows are read."""
    if len(w.shape) < 2 or not w.numel:
        return np.zeros(0, np.uint64)
    rows, cols = w.shape[-2], w.shape[-1]
    where = sampled(rows)
    with w.mapped() as m:
        picked = m.array.reshape(-1, rows, cols)[:, where, :]  # batches × k × cols: a view of the pages
        picked = picked.transpose(0, 2, 1).reshape(-1, picked.shape[1]).copy()  # (copied before the map goes)
    return mix(picked, rows)


def whole_key(w: Weight, order: np.ndarray | None = None) -> int:
    """A key of the whole tensor: its size and :data:`WHOLE_SAMPLES` elements at flat positions that
    depend on the size alone; ``order`` maps those positions to where this tensor holds them (a
    transposed candidate)."""
    where = positions(w.numel, WHOLE_SAMPLES)
    at = where if order is None else order
    if not w.numel:
        values = np.zeros(0, w.bits)
    elif not on_disk(w) or w.numel * w.itemsize <= SMALL_READ:
        values = w.read(0, w.numel)[at] if on_disk(w) else w.flat()[at]
    else:  # an element a read (mapping the tensor for them cost twice as much)
        span, size = w.ref.span, w.itemsize
        raw = b"".join(span.read(int(i) * size, size) for i in at.tolist())
        values = np.frombuffer(raw, w.bits)
    return int(mix(values.reshape(1, -1), w.numel)[0])


def transposed_positions(new_shape: tuple[int, int]) -> np.ndarray:
    """For a new [c, r] tensor that is an old [r, c] transposed: where the old tensor holds the new
    tensor's whole-key positions."""
    c, r = new_shape
    i, j = np.divmod(positions(c * r, WHOLE_SAMPLES), r)
    return j * c + i
