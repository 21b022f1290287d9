"""The structural map's language: affine pieces that say where every element of a new tensor comes from.

A :class:`Piece` copies the elements of an index box (``shape``) from an old tensor to a new one,
both addressed affinely in flat C order: element ``i`` (a multi-index over ``shape``) is read at
``src_offset + Σ i_k·src_strides[k]`` of the source and written at ``dst_offset + Σ
i_k·dst_strides[k]`` of the target. Renames, transposes, slices, joins along any axis, GQA
interleaves, row permutations (RoPE), stacks and unstacks are all a few such pieces (the same idea
as DeepSpeed's affine IR, ``deepspeed/checkpoint/affine.py``). A :class:`TargetMap` lists one new
tensor's pieces; elements no piece writes are *new* (fresh optimizer state, as a grown vocabulary's
rows). A :class:`StructureMap` holds every target, as plain JSON for plans.

:func:`compress` folds runs of pieces that differ by constant offsets into one piece with a further
axis, so a RoPE permutation of 32 heads is one piece, not 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from statekit.errors import MappingError
from statekit.lazy import numpy as np


@dataclass(frozen=True)
class Piece:
    source: str
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def src_span(self) -> tuple[int, int]:
        """The lowest and highest flat source index the piece reads."""
        return _span(self.src_offset, self.src_strides, self.shape)

    def dst_span(self) -> tuple[int, int]:
        return _span(self.dst_offset, self.dst_strides, self.shape)

    def src_view(self, flat: np.ndarray, start: int = 0) -> np.ndarray:
        """The piece's elements in ``flat`` (a source tensor, flat, or its part from element ``start``),
        as a strided view (no copy)."""
        return _view(flat, self.src_offset - start, self.src_strides, self.shape)

    def dst_view(self, flat: np.ndarray, start: int = 0) -> np.ndarray:
        return _view(flat, self.dst_offset - start, self.dst_strides, self.shape)

    def to_json(self) -> dict:
        return {"source": self.source, "shape": list(self.shape), "src_offset": self.src_offset,
                "src_strides": list(self.src_strides), "dst_offset": self.dst_offset,
                "dst_strides": list(self.dst_strides)}

    @classmethod
    def from_json(cls, data: dict) -> Piece:
        try:
            shape = tuple(int(n) for n in data["shape"])
            piece = cls(str(data["source"]), shape, int(data["src_offset"]),
                        tuple(int(s) for s in data["src_strides"]), int(data["dst_offset"]),
                        tuple(int(s) for s in data["dst_strides"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MappingError(f"malformed structural piece {data!r}: {exc}") from None
        if not (len(piece.src_strides) == len(piece.dst_strides) == len(shape)) or min(shape, default=1) < 1:
            raise MappingError(f"malformed structural piece {data!r}: shape and strides disagree")
        return piece


def _span(offset: int, strides: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    lo = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    hi = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0)
    return lo, hi


def _view(flat: np.ndarray, offset: int, strides: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    item = flat.dtype.itemsize
    base = flat[offset:] if offset else flat
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=tuple(s * item for s in strides),
                                           writeable=flat.flags.writeable)


@dataclass
class TargetMap:
    """One new tensor: its path, shape, and the pieces that write it; ``new`` elements are written
    by none (they start as a new parameter's state would)."""

    path: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    new: int = 0
    kind: str = "assembled"  # whole, transposed, grown, fused, split, stacked, unstacked, permuted, interleaved
    notes: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sources(self) -> list[str]:
        """The old tensors it reads, in order of first use."""
        return list(dict.fromkeys(p.source for p in self.pieces))

    def to_json(self) -> dict:
        return {"path": self.path, "shape": list(self.shape), "kind": self.kind, "new": self.new,
                "notes": list(self.notes), "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, data: dict) -> TargetMap:
        try:
            return cls(str(data["path"]), tuple(int(n) for n in data["shape"]),
                       [Piece.from_json(p) for p in data.get("pieces", [])], int(data.get("new", 0)),
                       str(data.get("kind", "assembled")), [str(n) for n in data.get("notes", [])])
        except (KeyError, TypeError, ValueError) as exc:
            raise MappingError(f"malformed structural target {str(data)[:80]}: {exc}") from None


@dataclass
class StructureMap:
    """Every new tensor's :class:`TargetMap`, and where the map came from."""

    targets: dict[str, TargetMap] = field(default_factory=dict)
    # "weights" (inferred and proved), "rules" (--fuse, --split, --stack, --unstack) or "rules, proved"
    origin: str = "weights"
    notes: list[str] = field(default_factory=list)
    # the target model's named_parameters() order, where the map knows it (Megatron → Hugging Face names):
    # a torch target is ordered by it when no --model or --names gives one
    order: list[str] | None = None

    def to_json(self) -> dict:
        return {"origin": self.origin, "notes": list(self.notes),
                "targets": [t.to_json() for t in self.targets.values()]}

    @classmethod
    def from_json(cls, data: dict) -> StructureMap:
        targets = [TargetMap.from_json(t) for t in data.get("targets", [])]
        return cls({t.path: t for t in targets}, str(data.get("origin", "weights")),
                   [str(n) for n in data.get("notes", [])])


def whole(source: str, shape: tuple[int, ...]) -> Piece:
    """The piece that copies all of ``source`` (of ``shape``) in order."""
    return Piece(source, (math.prod(shape),), 0, (1,), 0, (1,))


def transposed(source: str, src_shape: tuple[int, int]) -> Piece:
    """The piece that writes ``source`` [r, c] transposed into a new [c, r] tensor."""
    r, c = src_shape
    return Piece(source, (c, r), 0, (1, c), 0, (r, 1))


def compress(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with runs folded: consecutive pieces of one source, one shape and the same strides,
    whose offsets step by the same amounts, become one piece with a new leading axis. Repeated until
    nothing folds; then size-1 axes are dropped and axes that continue each other merged."""
    pieces = [_simplified(p) for p in pieces]
    while True:
        folded = _fold_once(pieces)
        if len(folded) == len(pieces):
            return [_simplified(p) for p in folded]
        pieces = folded


def _fold_once(pieces: list[Piece]) -> list[Piece]:
    """Pieces of one form (source, shape, strides), in order, whose offsets step evenly, as one piece
    each run; pieces of other sources may lie between them (an interleave: q, k, v, q, k, v)."""
    groups: dict[tuple, list[Piece]] = {}
    for p in pieces:
        groups.setdefault((p.source, p.shape, p.src_strides, p.dst_strides), []).append(p)
    out: list[Piece] = []
    for group in groups.values():
        i = 0
        while i < len(group):
            p, j = group[i], i + 1
            if j < len(group):
                ds, dd = group[j].src_offset - p.src_offset, group[j].dst_offset - p.dst_offset
                while j + 1 < len(group) and group[j + 1].src_offset - group[j].src_offset == ds \
                        and group[j + 1].dst_offset - group[j].dst_offset == dd:
                    j += 1
                out.append(Piece(p.source, (j - i + 1, *p.shape), p.src_offset, (ds, *p.src_strides), p.dst_offset,
                                 (dd, *p.dst_strides)))
                i = j + 1
            else:
                out.append(p)
                i += 1
    return sorted(out, key=lambda p: p.dst_offset)


def _same_form(a: Piece, b: Piece) -> bool:
    return a.source == b.source and a.shape == b.shape and a.src_strides == b.src_strides \
        and a.dst_strides == b.dst_strides


def _simplified(p: Piece) -> Piece:
    """Size-1 axes dropped, axes in the target's memory order (an order of axes is no part of what a
    piece copies), and an axis merged into the next when both sides step over it exactly."""
    axes = [(n, s, d) for n, s, d in zip(p.shape, p.src_strides, p.dst_strides, strict=True) if n != 1]
    axes.sort(key=lambda a: -abs(a[2]))
    merged: list[tuple[int, int, int]] = []
    for n, s, d in axes:
        if merged:
            n0, s0, d0 = merged[-1]
            if s0 == s * n and d0 == d * n:
                merged[-1] = (n0 * n, s, d)
                continue
        merged.append((n, s, d))
    if not merged:
        merged = [(1, 1, 1)]
    shape, src, dst = zip(*merged, strict=True)
    return Piece(p.source, tuple(shape), p.src_offset, tuple(src), p.dst_offset, tuple(dst))


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A flat C-order index as a multi-index of ``shape``."""
    out = []
    for n in reversed(shape):
        out.append(flat % n if n else 0)
        flat = flat // n if n else 0
    return tuple(reversed(out))


def describe(p: Piece, target_shape: tuple[int, ...], source_shape: tuple[int, ...] | None,
             name: str | None = None) -> str:
    """A piece for people: ``[0:32, :] ← q_proj.weight, rows permuted per head (RoPE, 4 heads)``;
    ``name``: how to call the source (default its path)."""
    text = f"{_region(p.dst_offset, p.dst_strides, p.shape, target_shape)} ← {name or p.source}"
    if source_shape is not None:
        text += _region(p.src_offset, p.src_strides, p.shape, source_shape, whole="")
    order = sorted(range(len(p.shape)), key=lambda k: -abs(p.dst_strides[k]))
    src = [p.src_strides[k] for k in order]
    if src == sorted(src, key=abs, reverse=True) and all(s > 0 for s in src):
        return text
    if len(p.shape) == 2 and src == sorted(src):
        return text + ", transposed"
    if _rope(p):
        return text + f", rows permuted per head (RoPE, {p.shape[0]} heads)"
    return text + f", reordered ({'×'.join(str(p.shape[k]) for k in order)} read with strides {src})"


def _rope(p: Piece) -> bool:
    """transformers' Meta → HF ``permute``: [heads, 2, rows/2, cols] read as [heads, rows/2, 2, cols]."""
    if len(p.shape) != 4 or p.shape[1] != 2:
        return False
    heads, two, half, cols = p.shape
    return p.dst_strides == (2 * half * cols, half * cols, cols, 1) and \
        p.src_strides == (2 * half * cols, cols, 2 * cols, 1)


def _region(offset: int, strides, shape, full: tuple[int, ...], whole: str = "[all]") -> str:
    lo, hi = _span(offset, tuple(strides), tuple(shape))
    first, last = unravel(lo, full), unravel(hi, full)
    axes = [":" if a == 0 and b == n - 1 else (str(a) if a == b else f"{a}:{b + 1}")
            for a, b, n in zip(first, last, full, strict=True)]
    boxed = math.prod(b - a + 1 for a, b in zip(first, last, strict=True))
    if all(a == ":" for a in axes):
        text = whole
    else:
        text = "[" + ", ".join(axes) + "]"
    if boxed != math.prod(shape) and text:
        text += " (strided)"
    return text
