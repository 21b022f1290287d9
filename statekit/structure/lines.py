"""Matching lines of new tensors to lines of old ones, and turning matched lines into pieces.

The old lines are indexed by key (:class:`LineIndex`: every row and column of the old tensors, by
length). A new tensor's rows (or columns) each look up their candidates; :func:`pick` chooses one per
line, preferring the candidate that continues its neighbours' run where several lines are
value-identical (zero rows); :func:`runs` cuts the chosen lines into runs — consecutive new lines
reading an arithmetic progression of one old tensor's lines — and :func:`pieces_of` writes each run
as affine pieces (:mod:`statekit.structure.pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass

from statekit.lazy import numpy as np
from statekit.structure import access
from statekit.structure.access import Weight
from statekit.structure.pieces import Piece, compress

ROW, COL = 0, 1


@dataclass(frozen=True)
class Lines:
    """How a tensor is cut into lines: rows (along the last axis) or columns (along the second-to-last)."""

    shape: tuple[int, ...]
    orient: int

    @property
    def length(self) -> int:
        if self.orient == ROW:
            return self.shape[-1] if self.shape else 1
        return self.shape[-2]

    @property
    def count(self) -> int:
        return access.row_count(self.shape) if self.orient == ROW else access.col_count(self.shape)

    @property
    def per_matrix(self) -> int:
        """Lines of one matrix (the unit in which lines are consecutive in memory)."""
        if self.orient == ROW:
            return self.shape[-2] if len(self.shape) >= 2 else 1
        return self.shape[-1]

    def offset(self, line: int) -> int:
        if self.orient == ROW:
            return line * self.length
        rows, cols = self.shape[-2], self.shape[-1]
        b, j = divmod(line, cols)
        return b * rows * cols + j

    @property
    def step(self) -> int:
        """Flat distance between consecutive lines of one matrix."""
        return self.length if self.orient == ROW else 1

    @property
    def elem_stride(self) -> int:
        return 1 if self.orient == ROW else self.shape[-1]

    def keys(self, w: Weight) -> np.ndarray:
        return access.row_keys(w) if self.orient == ROW else access.col_keys(w)


class LineIndex:
    """Every line of a set of old tensors, sorted by key, so a new line finds its candidates by search."""

    def __init__(self):
        self._parts: list[tuple[np.ndarray, int, int]] = []  # (keys, tensor number, orient)
        self.weights: list[Weight] = []
        self.lengths: set[int] = set()  # of the lines indexed: a new line of another length has no candidate
        self._sorted: tuple | None = None

    def add(self, w: Weight, orients: tuple[int, ...], known=None) -> None:
        """``w``'s lines cut each way of ``orients``; ``known(w, orient)``: their keys where already read."""
        number = len(self.weights)
        self.weights.append(w)
        for orient in orients:
            if orient == COL and len(w.shape) < 2:
                continue
            lines = Lines(w.shape, orient)
            keys = known(w, orient) if known is not None else None
            self._parts.append((lines.keys(w) if keys is None else keys, number, orient))
            self.lengths.add(lines.length)
        self._sorted = None

    def _build(self) -> tuple:
        if self._sorted is None:
            if not self._parts:
                empty = np.zeros(0, np.int64)
                self._sorted = (np.zeros(0, np.uint64), empty, empty, empty)
            else:
                keys = np.concatenate([k for k, _, _ in self._parts])
                tensor = np.concatenate([np.full(k.size, t, np.int64) for k, t, _ in self._parts])
                orient = np.concatenate([np.full(k.size, o, np.int64) for k, _, o in self._parts])
                line = np.concatenate([np.arange(k.size, dtype=np.int64) for k, _, _ in self._parts])
                order = np.argsort(keys)  # (equal keys in any order: candidates are a set)
                self._sorted = (keys[order], tensor[order], orient[order], line[order])
        return self._sorted

    def candidates(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each key, the range ``[lo, hi)`` of matching entries."""
        sorted_keys = self._build()[0]
        order = np.argsort(keys)  # (sorted needles: each search starts where the last ended, in cache)
        needles = keys[order]
        at = np.searchsorted(sorted_keys, needles, "left")
        hi_sorted = at.copy()  # most keys match one entry or none: the right end searched only where more
        inside = at < sorted_keys.size
        hits = np.flatnonzero(inside)
        hi_sorted[hits] += sorted_keys[at[hits]] == needles[hits]
        more = hits[(hi_sorted[hits] < sorted_keys.size)
                    & (sorted_keys[np.minimum(hi_sorted[hits], sorted_keys.size - 1)] == needles[hits])]
        if more.size:
            hi_sorted[more] = np.searchsorted(sorted_keys, needles[more], "right")
        lo, hi = np.empty(keys.size, np.int64), np.empty(keys.size, np.int64)
        lo[order] = at
        hi[order] = hi_sorted
        return lo, hi

    def entry(self, k: int) -> tuple[int, int, int]:
        _, tensor, orient, line = self._build()
        return int(tensor[k]), int(orient[k]), int(line[k])

    def entries(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _, tensor, orient, line = self._build()
        return tensor[ks], orient[ks], line[ks]


@dataclass
class Picked:
    """One chosen source line per new line (``tensor`` −1: none), and the lines left ambiguous."""

    tensor: np.ndarray
    orient: np.ndarray
    line: np.ndarray
    ambiguous: list[tuple[int, list[tuple[int, int, int]]]]

    @property
    def covered(self) -> np.ndarray:
        return self.tensor >= 0


def pick(index: LineIndex, keys: np.ndarray) -> Picked:
    """A source line for every new line that has one: the only candidate, else the one that continues
    the run of the line before (or after) it; lines whose candidates still tie are listed."""
    lo, hi = index.candidates(keys)
    count = hi - lo
    n = keys.size
    tensor = np.full(n, -1, np.int64)
    orient = np.zeros(n, np.int64)
    line = np.zeros(n, np.int64)
    one = count == 1
    if one.any():
        tensor[one], orient[one], line[one] = index.entries(lo[one])
    several = np.flatnonzero(count > 1)
    pending: dict[int, list[tuple[int, int, int]]] = {
        int(i): [index.entry(k) for k in range(int(lo[i]), int(hi[i]))] for i in several}
    for direction in (1, -1):  # forward, continuing the line before; then backward, the line after
        for i in sorted(pending, reverse=direction < 0):
            j, k = i - direction, i - 2 * direction  # the neighbour, and the one beyond it
            if not 0 <= j < n or tensor[j] < 0:
                continue
            same = 0 <= k < n and tensor[k] == tensor[j] and orient[k] == orient[j] and line[k] != line[j]
            stride = int(line[j] - line[k]) * direction if same else 1
            want = (int(tensor[j]), int(orient[j]), int(line[j]) + direction * stride)
            if want in pending[i]:
                tensor[i], orient[i], line[i] = want
                del pending[i]
    return Picked(tensor, orient, line, sorted(pending.items()))


@dataclass(frozen=True)
class Run:
    first: int  # new line
    count: int
    tensor: int
    orient: int
    line: int  # source line of the first new line
    stride: int  # source lines between consecutive new lines


def runs(p: Picked) -> list[Run]:
    """The chosen lines cut greedily into maximal runs (uncovered lines belong to none)."""
    n = p.tensor.size
    if n == 0:
        return []
    same = (p.tensor[1:] == p.tensor[:-1]) & (p.orient[1:] == p.orient[:-1]) & (p.tensor[1:] >= 0)
    d = p.line[1:] - p.line[:-1]
    # k is a break after which a run of stride d[i] cannot go on past line k
    breaks = np.flatnonzero(~same | np.r_[False, d[1:] != d[:-1]] | (d == 0))
    out: list[Run] = []
    i = 0
    while i < n:
        if p.tensor[i] < 0:
            i += 1
            continue
        if i < n - 1 and same[i] and d[i] != 0:
            b = np.searchsorted(breaks, i + 1)
            end = int(breaks[b]) if b < breaks.size else n - 1  # last line of the run
            out.append(Run(i, end - i + 1, int(p.tensor[i]), int(p.orient[i]), int(p.line[i]), int(d[i])))
            i = end + 1
        else:
            out.append(Run(i, 1, int(p.tensor[i]), int(p.orient[i]), int(p.line[i]), 1))
            i += 1
    return out


def pieces_of(run_list: list[Run], new: Lines, sources: list[Weight]) -> list[Piece]:
    """Affine pieces writing ``run_list``'s lines of a tensor cut as ``new`` (compressed)."""
    out: list[Piece] = []
    for r in run_list:
        src_w = sources[r.tensor]
        src = Lines(src_w.shape, r.orient)
        for first, count, line in _segments(r, new, src):
            out.append(Piece(src_w.path, (count, new.length), src.offset(line), (r.stride * src.step, src.elem_stride),
                             new.offset(first), (new.step, new.elem_stride)))
    return compress(out)


def _segments(r: Run, new: Lines, src: Lines):
    """A run cut where either side leaves a matrix (lines are consecutive in memory only within one)."""
    i, count, line = r.first, r.count, r.line
    while count > 0:
        room_new = count if new.orient == ROW else new.per_matrix - i % new.per_matrix
        per = src.per_matrix
        if src.orient == ROW:  # rows follow each other in memory across matrices too
            room_src = count
        elif r.stride > 0:
            room_src = (per - line % per + r.stride - 1) // r.stride
        else:
            room_src = line % per // -r.stride + 1
        n = max(1, min(count, room_new, room_src))
        yield i, n, line
        i, count, line = i + n, count - n, line + n * r.stride


def uncovered_tail(p: Picked, new: Lines) -> bool:
    """Whether the lines with no source are, in every matrix, its last ones (grown rows or columns)."""
    if p.covered.all():
        return True
    per = new.per_matrix
    cov = p.covered.reshape(-1, per) if p.covered.size % per == 0 else p.covered.reshape(1, -1)
    # covered lines must come first: no covered line after an uncovered one
    after = np.logical_and.accumulate(cov, axis=1)
    return bool((after == cov).all())
