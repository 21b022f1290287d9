"""Orphaned ParamIds: one module path held by several states of a burn record (burn #5130).

Before burn PR #5177, ``Module::load_record`` restored weights but not ParamIds: every relaunch
gave each module path a new random id, ``ModuleOptimizer::load_record`` still loaded the old
states (each with its path), and ``to_record`` wrote them all again beside the new, fresh ones.
The record grows by one state per parameter and relaunch; all but one are orphaned.

The rule (used by ``doctor`` to name them and by ``remap --model`` to keep the live ones):

- the state under the ParamId the model has now for that path is the live one; the others are
  orphans, dropped;
- when none carries the model's id (a model file from another launch, or one without ids), the
  candidates are one state only if they are identical (step and every byte of every field);
  otherwise statekit refuses, naming them. The step counter does not tell the newest: each
  relaunch restarted it at 1 (the newest orphan cohort may have the smallest step).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from statekit.state import ModelInfo, OptimizerState, ParamState
from statekit.tensor import TensorRef

PIECE = 1 << 20


@dataclass
class SharedPath:
    """The states of one module path that more than one state holds."""

    path: str
    holders: list[ParamState]
    model_id: int | None = None  # the model's ParamId for this path (None: no model, or no id)
    live: ParamState | None = None  # the holder under the model's id
    orphans: list[ParamState] = field(default_factory=list)  # the others, when ``live`` is known

    @property
    def wasted(self) -> int:
        return sum(nbytes(p) for p in self.orphans)


def nbytes(p: ParamState) -> int:
    """Bytes of tensor data a parameter's state holds (its fields, as stored)."""
    return sum(ref.nbytes for ref in p._tensors())


def shared_paths(state: OptimizerState, model: ModelInfo | None = None) -> list[SharedPath]:
    """Every path held by several states, in file order, each with its live state and orphans when
    the model's ParamId for the path is one of the holders' ids."""
    holders: dict[str, list[ParamState]] = {}
    for p in state.params:
        if p.path:
            holders.setdefault(p.path, []).append(p)
    by_path = model.by_path() if model is not None else {}
    out = []
    for path, ps in holders.items():
        if len(ps) < 2:
            continue
        m = by_path.get(path)
        shared = SharedPath(path, ps, model_id=m.id if m is not None else None)
        live = [p for p in ps if shared.model_id is not None and p.id == shared.model_id]
        if live:
            shared.live = live[0]
            shared.orphans = [p for p in ps if p is not live[0]]
        out.append(shared)
    return out


def _digest(p: ParamState) -> tuple:
    """What makes two states the same state: step, fields and their bytes."""
    fields = []
    for name, ref in sorted(list(p.slots.items()) + [(k, v) for k, v in p.extra.items() if isinstance(v, TensorRef)],
                            key=lambda kv: kv[0]):
        h = hashlib.sha256()
        for piece in ref.iter_bytes(PIECE):
            h.update(piece)
        fields.append((name, ref.dtype, tuple(ref.shape), h.hexdigest()))
    scalars = sorted((k, repr(v)) for k, v in p.extra.items() if not isinstance(v, TensorRef))
    return repr(p.step), tuple(fields), tuple(scalars)


ADVICE = ("the step counter does not tell the newest (each burn relaunch restarted it): give --model the model "
          "saved with this record (its ParamIds name the live states)")


def describe(p: ParamState) -> str:
    step = "" if p.step is None else f" step {p.step:g}"
    return f"ParamId {p.id}{step}" if p.id is not None else f"#{p.key}{step}"


def resolve(state: OptimizerState, model: ModelInfo | None) -> tuple[OptimizerState, list[SharedPath], list[str]]:
    """``(state without its orphans, the paths resolved, problems)``. A path whose candidates differ
    and none of which is the model's is a problem (one line naming them), never a guess."""
    from dataclasses import replace

    shared = shared_paths(state, model)
    if not shared:
        return state, [], []
    if model is not None:
        in_model = model.by_path()
        shared = [s for s in shared if s.path in in_model]  # the rest are dropped as not in the model
    drop: set[int] = set()
    problems = []
    for s in shared:
        if s.live is None:
            first = _digest(s.holders[0])
            if all(_digest(p) == first for p in s.holders[1:]):
                s.live, s.orphans = s.holders[0], s.holders[1:]
            else:
                whose = (f"none is the model's ParamId {s.model_id}" if s.model_id is not None
                         else "the model gives no ParamIds to choose by")
                problems.append(f"{s.path}: {len(s.holders)} different states "
                                f"({', '.join(describe(p) for p in s.holders)}) and {whose}")
                continue
        drop.update(id(p) for p in s.orphans)
    kept = replace(state, params=[p for p in state.params if id(p) not in drop]) if drop else state
    return kept, [s for s in shared if s.live is not None], problems


def summary(resolved: list[SharedPath]) -> str:
    """One line for a plan's warnings: what was dropped, and the bytes it held."""
    n = sum(len(s.orphans) for s in resolved)
    wasted = sum(s.wasted for s in resolved)
    parts = [f"{s.path} ({', '.join(describe(p) for p in s.orphans)}; kept {describe(s.live)})" for s in resolved]
    return (f"orphaned states dropped ({n}, {wasted:,} bytes; burn #5130: the same module path under the "
            f"ParamIds of earlier launches): {'; '.join(parts)}")
