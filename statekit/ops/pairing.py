"""Which migrated parameter continues which original one: verify-resume's pairing.

A conversion or remap records in the file it writes (burnpack and safetensors keep string
metadata) where each target parameter's state came from: the source key (a torch position, a
burn ParamId) and path, and whether the state was transposed or resized on the way
(:data:`MOVES_KEY`). verify-resume pairs through, in this order: a remap plan the user gives
(``--plan``), that record, and else equal paths. Transposes come from the plan or the record, so
the rules given at conversion need not be repeated; without either, a non-square rank-2 state
whose shape is reversed is recognised as transposed, and ``--transpose GLOB`` names square ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from statekit.errors import MappingError
from statekit.ops.plan import Plan
from statekit.state import Checkpoint, ParamState

MOVES_KEY = "statekit.moves"
MOVES_SOURCE_KEY = "statekit.moves.source"  # the format the recorded moves came from
MOVES_OPERATION_KEY = "statekit.moves.operation"  # remap: the paths are another model's, not to be restored


def moves_metadata(plan: Plan) -> dict[str, str]:
    """The record a written file keeps of where each of its parameters' state came from: kept
    when the source pairs by position (torch) or a parameter was renamed, transposed or resized
    (a plain burn → burn copy records nothing and stays byte-identical to burn's own file)."""
    from statekit.formats import registry

    positional = registry.framework_of(plan.source_format) == "torch"
    if not positional and all(a.src_path == a.dst_path and not (a.transpose or a.resize or a.reset_step)
                              for a in plan.params if a.action in ("keep", "rename")):
        return {}
    moves = []
    for a in plan.params:
        if a.action not in ("keep", "rename") or not a.dst_path:  # assembled targets pair with no one source
            continue
        item = {"to": a.dst_path, "key": a.src_key, "from": a.src_path}
        item.update({flag: True for flag in ("transpose", "resize", "reset_step") if getattr(a, flag)})
        moves.append({k: v for k, v in item.items() if v is not None})
    if not moves:
        return {}
    out = {MOVES_KEY: json.dumps(moves, separators=(",", ":")), MOVES_SOURCE_KEY: plan.source_format}
    if plan.operation == "remap":
        out[MOVES_OPERATION_KEY] = "remap"
    return out


@dataclass(frozen=True)
class Move:
    """One original → migrated correspondence, as a plan or a file's record states it."""

    src_key: str | None
    src_path: str | None
    dst_path: str
    transpose: bool = False
    resize: bool = False
    reset_step: bool = False


def recorded_moves(ckpt: Checkpoint) -> list[Move] | None:
    """The moves a file recorded when statekit wrote it (None: it records none)."""
    text = ckpt.metadata.get(MOVES_KEY) if ckpt.metadata else None
    if not text:
        return None
    try:
        return [Move(m.get("key"), m.get("from"), m["to"], bool(m.get("transpose")), bool(m.get("resize")),
                     bool(m.get("reset_step"))) for m in json.loads(text)]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise MappingError(f"unreadable {MOVES_KEY} metadata", ckpt.path) from None


def recorded_source(ckpt: Checkpoint) -> str | None:
    """The format a file's recorded moves came from (None: no record)."""
    return (ckpt.metadata or {}).get(MOVES_SOURCE_KEY) if recorded_moves(ckpt) is not None else None


def plan_moves(plan: Plan) -> list[Move]:
    return [Move(a.src_key, a.src_path, a.dst_path, a.transpose, a.resize, a.reset_step)
            for a in plan.params if a.action in ("keep", "rename") and a.dst_path]


@dataclass
class Pairing:
    """An original parameter and the migrated one that continues it.

    ``transpose``: the migrated state is the original's transposed. ``kept``: for a resized
    state, the region both hold (in the original's orientation); the migrated one's other
    elements are new. ``reset``: the remap restarted this state on purpose (compare with a cold
    start, not with the original).
    """

    path: str
    original: ParamState
    migrated: ParamState | None
    transpose: bool
    kept: tuple[int, ...] | None = None
    reset: bool = False
    via: str = "path"
    origin: object = None  # where the original's state was read from, when not one parameter (megatron_verify.Origin)

    @property
    def migrated_shape(self) -> tuple[int, ...]:
        """The migrated state's shape in the original's orientation."""
        if self.migrated is None or self.migrated.shape is None:
            return tuple(self.original.shape or ())
        shape = tuple(self.migrated.shape)
        return shape[::-1] if self.transpose else shape


def pair(original: Checkpoint, migrated: Checkpoint, transpose_globs: list[str], plan: Plan | None = None
         ) -> tuple[list[Pairing], list[str]]:
    """Pair every original parameter with its migrated continuation; returns pairs and notes."""
    from statekit.ops.rules import matches_any

    a_state, b_state = original.optimizer, migrated.optimizer
    by_path = {p.path: p for p in b_state.params if p.path}
    notes: list[str] = []
    moves, via = (plan_moves(plan), "plan") if plan is not None else (recorded_moves(migrated), "record")
    by_src_path = {m.src_path: m for m in moves or [] if m.src_path}
    by_src_key = {m.src_key: m for m in moves or [] if m.src_key is not None}
    unnamed = [p for p in a_state.params if p.path is None]
    b_unnamed = bool(b_state.params) and not any(p.path for p in b_state.params)
    if (unnamed or b_unnamed) and moves is None and a_state.framework == b_state.framework == "torch":
        by_position, why = _by_position(a_state, b_state)
        if by_position is not None:
            return by_position, [POSITIONAL_NOTE]
        side, who = (original, unnamed) if unnamed else (migrated, b_state.params)
        raise MappingError(
            f"{len(who)} parameters ({', '.join(p.label() for p in who[:3])}…) have no names, the migrated file "
            f"records no source positions, and the two torch states cannot be paired by position ({why}): "
            "give --names or --model to name them", side.path)
    if unnamed and moves is None:
        raise MappingError(
            f"{len(unnamed)} original parameters ({', '.join(p.label() for p in unnamed[:3])}…) have no names and "
            "the migrated file records no source positions: give --names or --model to name them", original.path)
    dropped = {(a.src_key, a.src_path) for a in plan.params if a.action == "drop"} if plan is not None else set()
    skipped = []
    pairs: list[Pairing] = []
    for p in a_state.params:
        if dropped and any(key == p.key or (path and path == p.path) for key, path in dropped):
            skipped.append(p.label())
            continue
        move = by_src_path.get(p.path) if p.path else None
        if move is None and (p.path is None or p.path not in by_path):
            move = by_src_key.get(p.key)
        m = by_path.get(move.dst_path) if move else by_path.get(p.path)
        label = p.path or (move.dst_path if move else p.label())
        if m is None:
            pairs.append(Pairing(label, p, None, False, via=via if move else "path"))
            continue
        a, b = tuple(p.shape or ()), tuple(m.shape or ())
        if move is not None:
            t = move.transpose
        elif len(a) == 2 and a[0] == a[1]:
            t = matches_any(label, transpose_globs)
        else:
            t = len(a) == 2 and a != b and a[::-1] == b
        pr = Pairing(label, p, m, t, via=via if move else "path", reset=bool(move and move.reset_step))
        shape_b = pr.migrated_shape
        if m.slots and shape_b != a:
            if len(shape_b) != len(a) or not (move and move.resize):
                raise MappingError(f"{label}: original state {list(a)} and migrated {list(b)} are not the same layout"
                                   + ("" if move else " (a remap? give its plan with --plan)"), migrated.path)
            pr.kept = tuple(min(x, y) for x, y in zip(a, shape_b, strict=True))
        pairs.append(pr)
    if skipped:
        notes.append(f"not compared (the plan drops them): {', '.join(skipped)}")
    missing = [pr.path for pr in pairs if pr.migrated is None]
    if missing and plan is None:
        notes.append(f"{len(missing)} original parameters have no counterpart in the migrated file "
                     f"({', '.join(missing[:3])}{'…' if len(missing) > 3 else ''}); renamed by a remap? give its --plan")
    if any(pr.via == "record" for pr in pairs) and unnamed:
        notes.append("original parameters paired through the source positions the migrated file records "
                     "(their names are not checked: give --names to check them too)")
    return pairs, notes


POSITIONAL_NOTE = ("paired by position: both are torch states whose param groups and shapes agree position for "
                   "position (torch itself pairs state with parameters so)")


def _groups(state) -> list[list[ParamState]]:
    by_key = {p.key: p for p in state.params}
    if state.groups:
        return [[by_key[k] for k in g.keys if k in by_key] for g in state.groups]
    return [list(state.params)]


def _by_position(a_state, b_state) -> tuple[list[Pairing] | None, str]:
    """Two torch states paired position for position, or None and the first disagreement."""
    ga, gb = _groups(a_state), _groups(b_state)
    if len(ga) != len(gb):
        return None, f"{len(ga)} param groups against {len(gb)}"
    pairs = []
    for g, (xs, ys) in enumerate(zip(ga, gb, strict=True)):
        if len(xs) != len(ys):
            return None, f"group {g} holds {len(xs)} parameters against {len(ys)}"
        for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if tuple(x.shape or ()) != tuple(y.shape or ()) or set(x.slots) != set(y.slots):
                return None, (f"group {g} position {k} (#{x.key}) is {list(x.shape or ())} {sorted(x.slots)} against "
                              f"{list(y.shape or ())} {sorted(y.slots)}")
            pairs.append(Pairing(x.path or y.path or f"#{x.key}", x, y, False, via="position"))
    return pairs, ""
