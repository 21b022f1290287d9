"""``merge``: one optimizer state from several (parameter groups saved apart, or several runs).

Parameters are matched across inputs like ``diff`` does (burn ParamId when every parameter has
one, else module path, else torch index). A parameter present in more than one input is a
conflict: refused by default, naming every conflicting parameter; ``first`` / ``last`` take it
from the first / last input that has it; ``mean`` averages each slot elementwise (accumulated in
float64, cast back to the slot's dtype) and keeps the largest step. All inputs must hold the same
optimizer family. The output keeps the inputs' order (each parameter at its first appearance), so
merging the halves of a split burn file gives back the file byte for byte. Written atomically;
inputs are only read. Averaged tensors are computed when written, one at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from statekit import dtypes, io, stream
from statekit.errors import MappingError, UsageError
from statekit.formats import registry
from statekit.frameworks import bnb, torch_thirdparty
from statekit.ops.diff import METHOD_WORDS, match_key, match_method
from statekit.ops.progress import ProgressFactory, silent
from statekit.state import Checkpoint, OptimizerState, ParamGroup, ParamState, refuse_unusable
from statekit.tensor import TensorRef

POLICIES = ("error", "first", "last", "mean")
MAX_NAMED = 12


def _families(state: OptimizerState) -> set[str]:
    return {f for f in (state.family, *state.candidates) if f}


def _mean_ref(refs: list[TensorRef]) -> TensorRef:
    """A lazy tensor: the elementwise mean of ``refs`` (float64 sum, cast back to the dtype)."""
    first = refs[0]
    dtype = first.dtype
    target = dtypes.numpy_dtype(dtype)

    def mean(*pieces: np.ndarray) -> np.ndarray:
        acc = np.zeros(pieces[0].shape, np.float64)
        for piece in pieces:
            acc += piece.astype(np.float64)
        acc /= len(pieces)
        if not dtypes.is_float(dtype):
            acc = np.rint(acc)
        return acc.astype(target)

    info = {k: v for k, v in first.info.items() if k == "burn_dtype"}
    return stream.combine(refs, mean, dtype, info=info)


def _step_max(steps: list):
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def _mean_param(name: str, entries: list[tuple[int, ParamState]], paths: list[str]) -> ParamState:
    params = [p for _, p in entries]
    first = params[0]
    for (i, p) in entries[1:]:
        if set(p.slots) != set(first.slots):
            raise MappingError(f"cannot average {name}: {paths[entries[0][0]]} has fields "
                               f"{sorted(first.slots)}, {paths[i]} has {sorted(p.slots)}")
        for slot, ref in p.slots.items():
            other = first.slots[slot]
            if tuple(ref.shape) != tuple(other.shape) or ref.dtype != other.dtype:
                raise MappingError(
                    f"cannot average {name}.{slot}: {paths[entries[0][0]]} has {other.dtype} "
                    f"{list(other.shape)}, {paths[i]} has {ref.dtype} {list(ref.shape)}")
        if any(isinstance(v, TensorRef) for v in p.extra.values()):
            raise MappingError(f"cannot average {name}: its state layout is not recognised")
    slots = {slot: _mean_ref([p.slots[slot] for p in params]) for slot in first.slots}
    return ParamState(key=first.key, id=first.id, index=first.index, path=first.path, rank=first.rank,
                      step=_step_max([p.step for p in params]), slots=slots, extra=dict(first.extra),
                      group=first.group, declared_shape=first.declared_shape, family=first.family)


def merge_states(ckpts: list[Checkpoint], on_conflict: str = "error") -> tuple[OptimizerState, dict]:
    """The merged state and a JSON-able account of what came from where."""
    if on_conflict not in POLICIES:
        raise UsageError(f"--on-conflict must be one of {', '.join(POLICIES)} (got {on_conflict!r})")
    states = [_state_of(ckpt) for ckpt in ckpts]
    paths = [c.path for c in ckpts]
    for state, path in zip(states, paths, strict=True):
        refuse_unusable(state, path, "merge")
        if torch_thirdparty.is_foreign(state):
            raise MappingError(f"{state.family_label} state: merge joins torch's, burn's and candle's own states; "
                               "convert it first where an optimizer continues it (statekit convert)", path)
        if state.library == bnb.LIBRARY and state.params:  # its 8-bit codes and packed group are no torch state
            raise MappingError("bitsandbytes state: merge writes torch's own layout, which is neither bitsandbytes' "
                               "nor, with bitsandbytes' param group, torch's; convert each input to torch first "
                               "(statekit convert … --names), merge those, and convert back with --to bnb", path)
    _check_one_family(paths, states)
    _check_one_framework(paths, states)
    method = match_method(*[s.params for s in states])
    occurrences: dict[object, list[tuple[int, ParamState]]] = {}
    for i, state in enumerate(states):
        for p in state.params:
            occurrences.setdefault(match_key(p, method), []).append((i, p))
    conflicts = {k: v for k, v in occurrences.items() if len(v) > 1}
    if conflicts and on_conflict == "error":
        named = [f"{v[0][1].label()} ({', '.join(paths[i] for i, _ in v)})" for v in conflicts.values()]
        more = f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
        raise MappingError(
            f"{len(conflicts)} parameter{'s are' if len(conflicts) != 1 else ' is'} in more than one input: "
            f"{'; '.join(named[:MAX_NAMED])}{more}; choose with --on-conflict first|last|mean")
    merged, sources, taken, report = _resolve(occurrences, paths, len(states), on_conflict)
    family, candidates = _surviving_family(states)
    nonempty = [s for s in states if s.params]
    merged, groups = _regrouped(states, merged, sources)
    result = OptimizerState(
        family=family, candidates=candidates, params=merged, groups=groups,
        hyperparams_stored=any(s.hyperparams_stored for s in states),
        framework=nonempty[0].framework if nonempty else states[0].framework,
    )
    notes, warnings = _remarks(conflicts, on_conflict, merged, method)
    account = {
        "inputs": [{"path": p, "format": c.format, "family": s.family_label if s.params else None,
                    "params": len(s.params), "taken": t}
                   for p, c, s, t in zip(paths, ckpts, states, taken, strict=True)],
        "matched_by": method,
        "matched_by_words": METHOD_WORDS.get(method, method),
        "on_conflict": on_conflict,
        "params": len(merged),
        "family": result.family_label if merged else None,
        "conflicts": report,
        "notes": notes,
        "warnings": warnings,
    }
    return result, account


def _state_of(ckpt: Checkpoint) -> OptimizerState:
    """An input's optimizer state (an empty file is an empty state); other kinds are refused."""
    if ckpt.kind == "empty":
        return OptimizerState(family=None, framework=registry.framework_of(ckpt.format))
    if ckpt.kind != "optimizer" or ckpt.optimizer is None:
        raise MappingError(f"holds {ckpt.kind} data, not optimizer state; merge combines optimizer states", ckpt.path)
    if ckpt.optimizer.global_slots:
        raise MappingError(f"{ckpt.optimizer.family_label} keeps one global state over all parameters; "
                           "it cannot be merged per parameter", ckpt.path)
    return ckpt.optimizer


def _check_one_family(paths: list[str], states: list[OptimizerState]) -> None:
    """One family for all (burn's adam and adamw cannot be told apart: their candidates overlap)."""
    reference = None
    for path, state in zip(paths, states, strict=True):
        if not state.params:
            continue
        fams = _families(state)
        if reference is None:
            reference = (path, state, fams)
            continue
        ref_path, ref_state, ref_fams = reference
        if not fams & ref_fams and (fams or ref_fams):
            raise MappingError(
                f"cannot merge {ref_state.family_label} state ({ref_path}) with "
                f"{state.family_label} state ({path}): all inputs must hold one optimizer family")
        reference = (ref_path, ref_state, ref_fams & fams if fams and ref_fams else ref_fams)


def _check_one_framework(paths: list[str], states: list[OptimizerState]) -> None:
    frameworks = [(path, s.framework) for path, s in zip(paths, states, strict=True) if s.params]
    for path, fw in frameworks[1:]:
        if fw != frameworks[0][1]:
            raise MappingError(
                f"cannot merge {frameworks[0][1]} state ({frameworks[0][0]}) with {fw} state ({path}): "
                "convert one of them first (statekit convert) so that parameters can be matched")


def _resolve(occurrences: dict, paths: list[str], n_inputs: int, on_conflict: str):
    """Each matched parameter once, by the policy: the merged parameters, the (input, parameter)
    behind each, how many each input gave, and the conflicts' account."""
    merged: list[ParamState] = []
    sources: list[tuple[int, ParamState]] = []
    taken = [0] * n_inputs
    report: list[dict] = []
    for key, entries in occurrences.items():
        source, chosen = entries[0], entries[0][1]
        if len(entries) > 1:
            name = entries[0][1].label()
            if on_conflict == "mean":
                chosen = _mean_param(name, entries, paths)
            else:
                source = entries[0] if on_conflict == "first" else entries[-1]
                chosen = source[1]
            report.append({
                "name": name,
                "key": str(key),
                "inputs": [paths[i] for i, _ in entries],
                "resolution": "mean" if on_conflict == "mean" else f"{on_conflict} ({paths[source[0]]})",
                "steps": [p.step for _, p in entries],
                "step": chosen.step,
            })
        for i, _ in (entries if on_conflict == "mean" else [source]):
            taken[i] += 1
        merged.append(chosen)
        sources.append(source)
    return merged, sources, taken, report


def _surviving_family(states: list[OptimizerState]) -> tuple[str | None, tuple[str, ...]]:
    """The families that survive: the intersection of every non-empty input's."""
    nonempty = [s for s in states if s.params]
    family = nonempty[0].family if nonempty else None
    candidates = nonempty[0].candidates if nonempty else ()
    if nonempty and len(candidates) > 1:
        common = set(candidates)
        for s in nonempty[1:]:
            common &= _families(s) or common
        candidates = tuple(c for c in candidates if c in common)
        family = candidates[0] if candidates else family
    return family, candidates


def _regrouped(states: list[OptimizerState], merged: list[ParamState], sources: list
               ) -> tuple[list[ParamState], list[ParamGroup]]:
    """The merged parameters in the inputs' groups (each input's groups kept, in order). A group of a
    later input with the very hyperparameters of an earlier input's group joins it: the parts that
    ``split`` cut from one group become that group again (one input's own groups are never joined)."""
    groups: list[ParamGroup] = []
    group_of: list[int] = [0] * len(merged)
    for i, state in enumerate(states):
        joined: set[int] = set()  # this input's groups so far: never two of them in one
        for g in state.groups or [ParamGroup(keys=[p.key for p in state.params])]:
            wanted = set(g.keys)
            members = [j for j, (src, p) in enumerate(sources) if src == i and p.key in wanted]
            if not members:
                continue
            same = next((k for k, other in enumerate(groups)
                         if k not in joined and g.hyperparams and _same_hyper(other.hyperparams, g.hyperparams)), None)
            if same is None:
                same = len(groups)
                groups.append(ParamGroup(hyperparams=dict(g.hyperparams), keys=[]))
            joined.add(same)
            for j in members:
                group_of[j] = same
            groups[same].keys.extend(merged[j].key for j in members)
    return [p if p.group == g else dataclasses.replace(p, group=g) for p, g in zip(merged, group_of, strict=True)], groups


def _same_hyper(a: dict, b: dict) -> bool:
    """The same hyperparameters, key for key (types too: 1 and 1.0 and True are not the same)."""
    return a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and a[k] == b[k] for k in a)


def _remarks(conflicts: dict, on_conflict: str, merged: list[ParamState], method: str) -> tuple[list, list]:
    notes: list[str] = []
    warnings: list[str] = []
    if conflicts and on_conflict == "mean":
        dts = sorted({r.dtype for c in conflicts.values() for _, p in c for r in p.slots.values()})
        notes.append(f"mean: {len(conflicts)} conflicting parameters have each slot averaged elementwise over "
                     f"the inputs that hold them (float64 sum, cast back to {', '.join(dts) or 'the slot dtype'}); "
                     "each keeps the largest step among them")
    steps = {p.step for p in merged if p.step is not None}
    if len(steps) > 1:
        warnings.append(f"the merged parameters have different steps ({', '.join(f'{s:g}' for s in sorted(steps))}); "
                        "each keeps its own bias correction")
    if method == "id":
        by_path: dict[str, set] = {}
        for p in merged:
            if p.path:
                by_path.setdefault(p.path, set()).add(p.id)
        dup = sorted(path for path, ids in by_path.items() if len(ids) > 1)
        if dup:
            warnings.append(f"paths held by more than one ParamId: {', '.join(dup[:MAX_NAMED])}")
    return notes, warnings


def _metadata(ckpts: list[Checkpoint], warnings: list[str]) -> dict[str, str]:
    """Non-parameter string metadata of all inputs (the first input wins on a clash)."""
    out: dict[str, str] = {}
    for ckpt in ckpts:
        for k, v in ckpt.metadata.items():
            if not isinstance(v, str):
                continue
            if k in out and out[k] != v:
                warnings.append(f"metadata {k!r} differs between inputs; kept {out[k]!r} from the first")
                continue
            out.setdefault(k, v)
    return out


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def save_state(state: OptimizerState, path: str, metadata: dict[str, str], fmt: str, progress=None) -> int:
    """Write ``state`` as ``fmt`` with the writer ``convert`` uses for that format (atomically)."""
    save = registry.writer(fmt)
    return save(state, path, family=state.family, groups=[dict(g.hyperparams) for g in state.groups],
                metadata=metadata, progress=progress)


def merge_files(inputs: list, output, on_conflict: str = "error", dry_run: bool = False,
                progress: ProgressFactory | None = None) -> dict:
    inputs = [os.fspath(p) for p in inputs]
    output = os.fspath(output)
    if len(inputs) < 2:
        raise UsageError("merge needs at least two input files")
    if on_conflict not in POLICIES:
        raise UsageError(f"--on-conflict must be one of {', '.join(POLICIES)} (got {on_conflict!r})")
    fmt = registry.from_extension(output)
    for path in inputs:
        if _same_file(path, output):
            raise UsageError(f"the output {output} is also an input; inputs are never overwritten")
    with contextlib.ExitStack() as stack:
        ckpts = [stack.enter_context(io.open_checkpoint(p)) for p in inputs]
        state, account = merge_states(ckpts, on_conflict)
        framework = registry.framework_of(fmt)
        if state.params and state.framework != framework:
            raise MappingError(
                f"the inputs hold {state.framework} state and {output} asks for {fmt}: merge writes the inputs' "
                f"own framework; merge to {registry.extension_of_framework(state.framework) or 'their format'} and then "
                "run statekit convert (which asks for what the other framework needs)")
        metadata = _metadata(ckpts, account["warnings"])
        account.update(output=output, format=fmt, written=False, bytes=None)
        if dry_run:
            return account
        total = sum(p.nbytes for p in state.params)
        with (progress or silent)("writing", total, unit_bytes=True) as advance:
            account["bytes"] = save_state(state, output, metadata, fmt, progress=advance)
        account["written"] = True
    return account
