"""Structural maps from rules, for when the old weights are not at hand.

``--fuse 'NEW=OLD1,OLD2,…'``: NEW is the OLDs joined in that order along one axis.
``--split 'OLD=NEW1,NEW2,…'``: the inverse; the NEWs' sizes come from the new model.
``--stack 'NEW=OLD_GLOB'``: NEW's first axis stacks the OLDs the glob's last ``*`` numbers, in
numeric order (0, 1, …, E−1); several globs (``NEW=G1,G2``) join each number's tensors first, as
transformers v5 stores a mixture of experts' gate and up projections in one ``gate_up_proj``.
``--unstack 'OLD=NEW_GLOB'`` (or several globs): the inverse.

The axis: a join runs along the first axis of a torch (or candle) tensor — ``[out, in]`` rows —
and along the second of a burn matrix (``[d_in, d_out]`` columns); ``NEW@AXIS=…`` chooses. A ``*``
stands for one path component (``[^.]+``) and is matched consistently on both sides:
``layers.*.attn.qkv.weight=layers.*.attn.q.weight,layers.*.attn.k.weight,layers.*.attn.v.weight``.
Every map a rule makes is checked for coverage like an inferred one; it is not proved on weights,
and the plan says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from statekit.errors import MappingError, UsageError
from statekit.structure.pieces import Piece, StructureMap, TargetMap, compress

KINDS = ("fuse", "split", "stack", "unstack")


@dataclass(frozen=True)
class Rule:
    kind: str
    left: str  # fuse, stack: the new tensor; split, unstack: the old one
    right: tuple[str, ...]
    axis: int | None = None

    @classmethod
    def parse(cls, kind: str, text: str) -> Rule:
        flag = f"--{kind}"
        left, eq, right = text.partition("=")
        parts = tuple(p.strip() for p in right.split(",") if p.strip())
        if not eq or not left.strip() or not parts:
            raise UsageError(f"{flag} {text!r}: expected {_SYNTAX[kind]}")
        left = left.strip()
        axis = None
        if "@" in left:
            left, _, raw = left.rpartition("@")
            try:
                axis = int(raw)
            except ValueError:
                raise UsageError(f"{flag} {text!r}: @{raw} is not an axis number") from None
        stars = {p.count("*") for p in parts}
        want = left.count("*") + (1 if kind in ("stack", "unstack") else 0)
        if len(stars) != 1 or stars.pop() != want:
            extra = ", plus one for the number" if kind in ("stack", "unstack") else ""
            raise UsageError(f"{flag} {text!r}: the right side needs as many '*' as the left{extra} "
                             f"({_SYNTAX[kind]})")
        if kind == "split" and len(parts) < 2 or kind == "fuse" and len(parts) < 2:
            raise UsageError(f"{flag} {text!r}: name at least two tensors")
        return cls(kind, left, parts, axis)

    def text(self) -> str:
        axis = f"@{self.axis}" if self.axis is not None else ""
        return f"--{self.kind} '{self.left}{axis}={','.join(self.right)}'"


_SYNTAX = {"fuse": "'NEW=OLD1,OLD2,…'", "split": "'OLD=NEW1,NEW2,…'", "stack": "'NEW=OLD_GLOB'",
           "unstack": "'OLD=NEW_GLOB'"}


def parse(fuse=(), split=(), stack=(), unstack=()) -> list[Rule]:
    return [Rule.parse(kind, text) for kind, texts in zip(KINDS, (fuse, split, stack, unstack), strict=True)
            for text in texts or ()]


def build(rules: list[Rule], old: dict[str, tuple[int, ...]], new: dict[str, tuple[int, ...]] | None,
          framework: str, where: str | None = None) -> StructureMap:
    """The map the rules describe over the old tensors (path → shape); ``new``: the new model's shapes
    (needed by --split and --unstack's sizes; when given, every target must have its shape there)."""
    targets: dict[str, TargetMap] = {}
    for rule in rules:
        made = _expand(rule, old, new, framework, where)
        if not made:
            raise MappingError(f"{rule.text()} matches no tensor of the state", where)
        for t in made:
            if t.path in targets:
                raise MappingError(f"{t.path} is made by two rules", where)
            if new is not None and t.path in new and tuple(new[t.path]) != t.shape:
                raise MappingError(f"{rule.text()} makes {t.path} {list(t.shape)}, but the new model has it "
                                   f"{list(new[t.path])}", where)
            if new is not None and t.path not in new:
                raise MappingError(f"{rule.text()} makes {t.path}, which the new model does not have", where)
            targets[t.path] = t
    return StructureMap(targets, "rules", [r.text() for r in rules])


def _expand(rule: Rule, old, new, framework, where) -> list[TargetMap]:
    pattern = _regex(rule.right[0] if rule.kind in ("fuse", "stack") else rule.left)
    out: list[TargetMap] = []
    groups: dict[tuple, dict[int, str]] = {}
    for path in old:
        m = pattern.fullmatch(path)
        if not m:
            continue
        caps = m.groups()
        if rule.kind == "stack":
            if caps[-1].isdigit():
                groups.setdefault(caps[:-1], {})[int(caps[-1])] = path
        elif rule.kind == "fuse":
            names = [_fill(p, caps) for p in rule.right]
            shapes = [_shape(old, n, rule, where) for n in names]
            out.append(_joined(_fill(rule.left, caps), names, shapes, _axis(rule, shapes[0], framework), rule,
                               "fused", where))
        elif rule.kind == "split":
            names = [_fill(p, caps) for p in rule.right]
            out += _cut(path, old[path], 0, names, _axis(rule, old[path], framework), new, rule, where)
        else:
            out += _unstack(rule, path, old[path], caps, new, framework, where)
    for caps, members in sorted(groups.items()):
        out.append(_stack(rule, caps, members, old, framework, where))
    return out


def _stack(rule, caps, members: dict[int, str], old, framework, where) -> TargetMap:
    numbers = sorted(members)
    if numbers != list(range(len(numbers))):
        raise MappingError(f"{rule.text()}: the numbered tensors are {numbers}, not 0…{len(numbers) - 1}", where)
    pieces, slab = [], None
    for e in numbers:
        names = [_fill(p, (*caps, str(e))) for p in rule.right]
        shapes = [_shape(old, n, rule, where) for n in names]
        one = _joined("", names, shapes, _axis(rule, shapes[0], framework), rule, "", where)
        if slab is None:
            slab = one.shape
        elif one.shape != slab:
            raise MappingError(f"{rule.text()}: number {e} has shape {list(one.shape)}, number 0 {list(slab)}", where)
        size = math.prod(slab)
        pieces += [Piece(p.source, p.shape, p.src_offset, p.src_strides, p.dst_offset + e * size, p.dst_strides)
                   for p in one.pieces]
    return TargetMap(_fill(rule.left, caps), (len(numbers), *slab), compress(pieces), kind="stacked")


def _unstack(rule, path, shape, caps, new, framework, where) -> list[TargetMap]:
    if len(shape) < 2:
        raise MappingError(f"{rule.text()}: {path} {list(shape)} has no axis to unstack", where)
    slab, size = tuple(shape[1:]), math.prod(shape[1:])
    out = []
    for e in range(shape[0]):
        names = [_fill(p, (*caps, str(e))) for p in rule.right]
        if len(names) == 1:
            out.append(TargetMap(names[0], slab, [Piece(path, (size,), e * size, (1,), 0, (1,))], kind="unstacked"))
        else:
            parts = _cut(path, slab, e * size, names, _axis(rule, slab, framework), new, rule, where)
            out += [TargetMap(t.path, t.shape, t.pieces, kind="unstacked") for t in parts]
    return out


def _joined(path, names, shapes, axis, rule, kind, where) -> TargetMap:
    base = shapes[0]
    for n, s in zip(names, shapes, strict=True):
        if len(s) != len(base) or any(a != b for k, (a, b) in enumerate(zip(s, base, strict=True)) if k != axis):
            raise MappingError(f"{rule.text()}: {n} {list(s)} does not join {names[0]} {list(base)} along axis "
                               f"{axis}", where)
    shape = tuple(sum(s[axis] for s in shapes) if k == axis else n for k, n in enumerate(base))
    pieces, at = [], 0
    for n, s in zip(names, shapes, strict=True):
        start = tuple(at if k == axis else 0 for k in range(len(shape)))
        pieces.append(_box(n, s, (0,) * len(s), shape, start, s))
        at += s[axis]
    return TargetMap(path, shape, compress(pieces), kind=kind)


def _cut(src, shape, base, names, axis, new, rule, where) -> list[TargetMap]:
    """``src`` (its part of ``shape`` at flat ``base``) cut along ``axis`` into the new model's ``names``."""
    if new is None:
        raise MappingError(f"{rule.text()}: the new tensors' sizes come from the new model: give --model", where)
    out, at = [], 0
    for n in names:
        if n not in new:
            raise MappingError(f"{rule.text()}: the new model has no {n}", where)
        s = tuple(new[n])
        if len(s) != len(shape) or any(a != b for k, (a, b) in enumerate(zip(s, shape, strict=True)) if k != axis):
            raise MappingError(f"{rule.text()}: {n} {list(s)} is not a part of {src} {list(shape)} along axis {axis}",
                               where)
        start = tuple(at if k == axis else 0 for k in range(len(shape)))
        box = _box(src, shape, start, s, (0,) * len(s), s)
        box = Piece(box.source, box.shape, box.src_offset + base, box.src_strides, box.dst_offset, box.dst_strides)
        out.append(TargetMap(n, s, compress([box]), kind="split"))
        at += s[axis]
    if at != shape[axis]:
        raise MappingError(f"{rule.text()}: the parts' sizes along axis {axis} add up to {at}, {src} has "
                           f"{shape[axis]}", where)
    return out


def _box(source, src_shape, src_start, dst_shape, dst_start, box) -> Piece:
    ss, ds = _strides(src_shape), _strides(dst_shape)
    return Piece(source, tuple(box), sum(a * b for a, b in zip(src_start, ss, strict=True)), ss,
                 sum(a * b for a, b in zip(dst_start, ds, strict=True)), ds)


def _strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _axis(rule: Rule, shape: tuple, framework: str) -> int:
    if rule.axis is not None:
        axis = rule.axis + len(shape) if rule.axis < 0 else rule.axis
        if not 0 <= axis < len(shape):
            raise UsageError(f"{rule.text()}: axis {rule.axis} of a tensor of rank {len(shape)}")
        return axis
    return 1 if framework == "burn" and len(shape) == 2 else 0


def _shape(old, name, rule, where) -> tuple:
    if name not in old:
        raise MappingError(f"{rule.text()}: the state has no {name}", where)
    return tuple(old[name])


def _regex(glob: str) -> re.Pattern:
    return re.compile("".join("([^.]+)" if c == "*" else re.escape(c) for c in glob))


def _fill(glob: str, caps: tuple) -> str:
    parts = glob.split("*")
    if len(parts) - 1 != len(caps):
        raise UsageError(f"{glob!r}: {len(parts) - 1} '*' for {len(caps)} values")
    return "".join(p + (caps[i] if i < len(caps) else "") for i, p in enumerate(parts))
