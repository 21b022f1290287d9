"""Structural maps in plans: the map learned from the weights (or the rules) turned into plan actions.

``remap --old-model OLD --model NEW`` with both files holding values learns the map
(:func:`weights_map`, :mod:`statekit.structure.infer`); ``--fuse/--split/--stack/--unstack`` give it
without weights (:func:`rules_map`). :func:`actions` makes each target one plan action:

- a whole tensor moved (renamed), transposed, or grown in place becomes the ordinary ``keep`` /
  ``rename`` action with ``transpose`` / ``resize`` — the data path that streams those;
- anything else is ``assemble``: its pieces, and the source parameters it reads (each shown as
  ``into`` the targets that read it);

and checks what each optimizer's state allows: the sources of one assembled tensor must agree on
their step and their per-parameter scalars (NAdam's ``mu_product``, ASGD's ``eta``/``mu``) and
belong to one param group; elementwise slots must be shaped like their weight; Adafactor's factored
moments follow only maps made of whole rows (or columns). :func:`move` builds an assembled
parameter's state when the plan is carried out.
"""

from __future__ import annotations

import math
import os

from statekit import io, naming
from statekit.errors import MappingError
from statekit.ops.options import Options
from statekit.ops.plan import ParamAction, Plan
from statekit.ops.rules import NORM_PRESET, RenameRule, rename
from statekit.state import OptimizerState, ParamState
from statekit.structure import apply as moving
from statekit.structure import coverage
from statekit.structure import infer as inference
from statekit.structure import rules as structure_rules
from statekit.structure.access import Weight
from statekit.structure.pieces import Piece, StructureMap, TargetMap, compress, describe

# families whose per-parameter scalar state (0-dim slots) must agree across fused pieces
SCALAR_NOTE = "per-parameter scalars"
BY_RULES = "by rules: the map is not proved on weights (give --old-model and --model with values to prove it)"


# ----------------------------------------------------------------------------- where the map comes from

def structure_for(opts: Options, state: OptimizerState, where: str, progress=None) -> tuple[StructureMap | None,
                                                                                              list[str]]:
    """The map a remap or convert runs with: the rules when given, else (remap) the one the weights prove."""
    ruled = rules_map(opts, state, where)
    if ruled is not None:
        if opts.old_model is not None and opts.model is not None and opts.match != "paths":
            _prove_rules(ruled, opts, where)
        return ruled, []
    return weights_map(opts, state, where, progress)


def _prove_rules(smap: StructureMap, opts: Options, where: str) -> None:
    """Rules given beside both models' weights are proved on them like a learned map: a rule that does not
    make the new weights (q's rows permuted, a wrong order) is refused, naming the first element."""
    from contextlib import ExitStack

    from statekit.structure import proof

    with ExitStack() as stack:
        old = {w.path: w for w in _weights(opts.old_model, opts.old_model.source, stack)}
        new = {w.path: w for w in _weights(opts.model, opts.model.source, stack)}
        if not old or not new:
            return
        for t in smap.targets.values():
            if t.path not in new or any(s not in old for s in t.sources):
                continue
            problem = proof.disagreement(t, new[t.path], old)
            if problem:
                raise MappingError(f"the rule's map does not make the new weights: {problem}", where)
    smap.origin = "rules, proved"


def rules_map(opts: Options, state: OptimizerState, where: str) -> StructureMap | None:
    rules = structure_rules.parse(opts.fuse, opts.split, opts.stack, opts.unstack)
    if not rules:
        return None
    old = {p.path: tuple(p.shape) for p in state.params if p.path and p.shape is not None}
    new = {m.path: tuple(m.shape) for m in opts.model.params if not m.buffer} if opts.model else None
    return structure_rules.build(rules, old, new, state.framework, where)


def weights_map(opts: Options, state: OptimizerState, where: str, progress=None) -> tuple[StructureMap | None,
                                                                                            list[str]]:
    """The map learned from the old and the new model's weights, proved; (None, [why]) when the models
    hold no values, or (in ``--match auto``) share none at all: no new tensor but constant ones (untrained
    norms, zero biases) found a candidate among the old tensors (:attr:`inference.Inference.related`).
    Weights that share values and cannot be mapped are refused, naming what cannot be produced."""
    if opts.match == "paths" or opts.old_model is None or opts.model is None:
        return None, []
    sources = (opts.old_model.source, opts.model.source)
    if opts.match == "auto" and not all(_has_values(m) for m in (opts.old_model, opts.model)):
        return None, []
    from contextlib import ExitStack

    with ExitStack() as stack:
        old, new = (_weights(m, path, stack) for m, path in zip((opts.old_model, opts.model), sources, strict=True))
        if not old or not new:
            if opts.match == "values":
                raise MappingError("--match values: the models hold no weight values to match", where)
            return None, []
        total = sum(w.ref.nbytes for w in old) + sum(w.ref.nbytes for w in new)
        rename_fn = _renamer(opts)
        with (progress or _no_progress)("matching weights", total, unit_bytes=True) as advance:
            try:
                found = inference.infer(old, new, names=rename_fn, declared_new=opts.new_params, advance=advance,
                                        where=sources[1])
            except inference.Unproduced as exc:
                if opts.match == "auto" and not exc.related:
                    return None, [_unrelated(sources)]
                raise
    if opts.match == "auto" and not found.related:
        return None, [_unrelated(sources)]
    by_how: dict[str, list[str]] = {}
    for target, how in found.settled.items():
        by_how.setdefault(how, []).append(target)
    found.map.notes += [f"{len(ts)} value-identical tensor{'s' if len(ts) > 1 else ''} settled by {how}: "
                        f"{', '.join(ts[:3])}{f' (+{len(ts) - 3} more)' if len(ts) > 3 else ''}"
                        for how, ts in by_how.items()]
    return found.map, []


def _unrelated(sources) -> str:
    return (f"the weights of {sources[0]} and {sources[1]} share no values: the state is moved by path "
            "(give --match values to require a map proved on the weights)")


def _has_values(model) -> bool:
    return any(m.tensor is not None for m in model.params) or bool(model.source)


def _weights(model, path: str | None, stack) -> list[Weight]:
    if path and os.path.exists(path):
        ckpt = stack.enter_context(io.open_checkpoint(path))
        model = ckpt.model if ckpt.model is not None else model
    return [Weight(m.path, m.tensor, path) for m in model.params if m.tensor is not None and not m.buffer]


def _renamer(opts: Options):
    """What the user's --rename rules (and, crossing to or from burn, its norm names) call an old path."""
    rules = [RenameRule.parse(r) for r in opts.renames]
    chains = [rules]
    if opts.preset:
        chains += [rules + [RenameRule(p, r, origin="preset") for p, r in NORM_PRESET],
                   rules + [RenameRule(r"^(.*)\.weight$", "$1.gamma", "preset"),
                            RenameRule(r"^(.*)\.bias$", "$1.beta", "preset")]]

    def names(path: str) -> set[str]:
        return {rename(path, chain) for chain in chains}

    return names


class _no_progress:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- plan actions

def actions(smap: StructureMap, state: OptimizerState, family: str, plan: Plan, problems: list[str]
            ) -> tuple[list[ParamAction], list[ParamAction], set[str]]:
    """``(target actions, into actions, consumed source keys)`` for the map's targets."""
    by_path = {p.path: p for p in state.params if p.path}
    out: list[ParamAction] = []
    moved: set[str] = set()  # source keys an action moves whole (transposed, grown) already
    readers: dict[str, list[str]] = {}
    for t in smap.targets.values():
        if not t.pieces:
            continue
        srcs = [by_path.get(s) for s in t.sources]
        stateful = [p for p in srcs if p is not None and (p.slots or p.step is not None)]
        if not stateful:
            continue  # nothing to move: the new tensor starts fresh, as its sources would have
        if len(stateful) != len(srcs):
            missing = [s for s, p in zip(t.sources, srcs, strict=True) if p is None or not (p.slots or p.step)]
            problems.append(f"{t.path}: the map reads {', '.join(missing)}, which hold no optimizer state, beside "
                            f"{', '.join(p.path for p in stateful)}, which do")
            continue
        # an old tensor moved whole into one target and read whole by another too (a tie undone, a layer
        # copied): the second is assembled from it, so that both keep its state (a plan action per source
        # key would leave the first to start fresh)
        a = _action(t, srcs, family, plan, problems, whole=srcs[0].key not in moved)
        if a is None:
            continue
        out.append(a)
        if a.action != "assemble":
            moved.add(a.src_key)
        for s in srcs:
            readers.setdefault(s.key, []).append(t.path)
    into = []
    moved_whole = {a.src_key for a in out if a.action != "assemble"}
    for p in state.params:
        if p.key in readers and p.key not in moved_whole:
            into.append(ParamAction(action="into", src_key=p.key, src_path=p.path, src_shape=_shape(p),
                                    group=p.group, notes=[f"into {', '.join(readers[p.key])}"]))
    return out, into, set(readers)


def _action(t: TargetMap, srcs: list[ParamState], family: str, plan: Plan, problems: list[str],
            whole: bool = True) -> ParamAction | None:
    """The target's plan action: the source's own action aimed at it where it is moved whole, transposed
    or grown (``whole``: its source is not moved so already), else ``assemble``."""
    first = srcs[0]
    base = dict(src_key=first.key, src_path=first.path, src_shape=_shape(first), dst_path=t.path,
                dst_shape=list(t.shape), group=first.group, structure=t.kind)
    shape_problem = _shapes(t, srcs)
    if shape_problem:
        problems.append(shape_problem)
        return None
    if whole and len(srcs) == 1 and len(t.pieces) == 1:
        p = t.pieces[0]
        shape = tuple(first.shape)
        if p == Piece(first.path, (math.prod(shape),), 0, (1,), 0, (1,)) and shape == t.shape:
            same = first.path == t.path  # the same tensor under the same name: nothing to say
            return ParamAction(action="keep" if same else "rename", notes=[] if same else [_by(plan, "whole")],
                               **base)
        if len(shape) == 2 and t.shape == shape[::-1] and t.kind == "transposed":
            return ParamAction(action="keep" if first.path == t.path else "rename", transpose=True,
                               notes=[_by(plan, "transposed")], **base)
        if t.new and len(shape) == len(t.shape) and _leading_block(p, shape, t.shape):
            return ParamAction(action="keep" if first.path == t.path else "rename", resize=True,
                               notes=[_by(plan, "grown"), f"resized {list(shape)} → {list(t.shape)}"], **base)
    why = _disagreements(t, srcs, family)
    if why:
        problems.append(why)
        return None
    a = ParamAction(action="assemble", **base,
                    sources=[{"key": s.key, "path": s.path, "shape": _shape(s)} for s in srcs],
                    pieces=[p.to_json() for p in t.pieces], new_elements=t.new,
                    notes=[_by(plan, t.kind)] + _describe(t, srcs) + _family_notes(t, srcs, family, problems))
    return a


def _by(plan: Plan, kind: str) -> str:
    origin = plan.structure.get("origin") if plan.structure else "weights"
    how = {"weights": "inferred from the weights, proved", "rules, proved": "by rule, proved on the weights"}
    return f"{kind} ({how.get(origin, 'by rule')})"


def _shape(p: ParamState) -> list[int] | None:
    return list(p.shape) if p.shape is not None else None


def _shapes(t: TargetMap, srcs: list[ParamState]) -> str | None:
    """Elementwise state must be shaped like the weight the map reads."""
    for p in t.pieces:
        src = next(s for s in srcs if s.path == p.source)
        lo, hi = p.src_span()
        size = math.prod(src.shape or ())
        if src.shape is None or hi >= size:
            return (f"{t.path}: the map reads {p.source} up to element {hi}, but its state has shape "
                    f"{list(src.shape or [])}: the state does not belong to these weights")
    return None


def _leading_block(p: Piece, shape: tuple, target: tuple) -> bool:
    box = structure_rules._box(p.source, shape, (0,) * len(shape), target, (0,) * len(target), shape)
    return compress([box]) == [p]


def _disagreements(t: TargetMap, srcs: list[ParamState], family: str) -> str | None:
    """Sources of one new tensor must agree on what is one value per parameter."""
    if len(srcs) < 2:
        return None
    names = ", ".join(s.path for s in srcs)
    steps = [s.step for s in srcs]
    if len({repr(x) for x in steps}) > 1:
        shown = ", ".join(f"{s.path}={s.step}" for s in srcs)
        return f"{t.path}: its pieces have different steps ({shown}); one tensor has one step"
    groups = sorted({s.group for s in srcs})
    if len(groups) > 1:
        shown = ", ".join(f"{s.path} (group {s.group})" for s in srcs)
        return f"{t.path}: its pieces come from different param groups ({shown}); one tensor has one group"
    slot_sets = {tuple(sorted(s.slots)) for s in srcs}
    if len(slot_sets) > 1:
        return f"{t.path}: its pieces ({names}) hold different state fields ({' vs '.join(map(str, slot_sets))})"
    for name, ref in srcs[0].slots.items():
        if ref.shape == ():
            values = [float(s.slots[name].numpy()) for s in srcs]
            if len({repr(v) for v in values}) > 1:
                shown = ", ".join(f"{s.path}={v!r}" for s, v in zip(srcs, values, strict=True))
                return f"{t.path}: its pieces have different {name} ({shown}); one tensor has one"
    return None


def _family_notes(t: TargetMap, srcs: list[ParamState], family: str, problems: list[str]) -> list[str]:
    notes = []
    slots = set(srcs[0].slots)
    if slots & naming.FACTORED_SLOTS:
        lines = moving.line_map(t, {s.path: tuple(s.shape) for s in srcs})
        if lines is None or not {"row_var", "col_var"} >= (slots & naming.FACTORED_SLOTS):
            problems.append(f"{t.path}: Adafactor's factored second moment cannot follow this map (only maps of "
                            "whole rows or whole columns)")
        else:
            notes.append(f"Adafactor: the {'row' if lines.orient == 'rows' else 'column'} factor moves exactly; "
                         "the other is the sources' factors averaged by lines (tracks, not bit-exact)"
                         if len(srcs) > 1 else "Adafactor: factors moved exactly")
    if family == "muon":
        notes.append("Muon: the momentum buffer moves exactly; Newton–Schulz now orthogonalises the new matrix")
    if any(s.encoding for s in srcs):
        notes.append("8-bit state: dequantized, moved, re-quantized by the target's writer (not bit-exact)")
    return notes


def _describe(t: TargetMap, srcs: list[ParamState]) -> list[str]:
    """Each piece for people: what part of the target, from what part of which source."""
    shapes = {s.path: tuple(s.shape) for s in srcs}
    out = [describe(p, t.shape, shapes.get(p.source), _short(p.source, t.path)) for p in t.pieces[:4]]
    if len(t.pieces) > 4:
        out.append(f"… {len(t.pieces) - 4} more pieces (--plan-out lists them)")
    if t.new:
        out.append(f"{t.new} new elements (fresh state)")
    return out


# ----------------------------------------------------------------------------- carrying it out

def _short(source: str, target: str) -> str:
    """A source named after the module path it shares with its target: ``q_proj.weight`` beside qkv_proj."""
    head = 0
    for a, b in zip(source.split("."), target.split("."), strict=False):
        if a != b:
            break
        head += len(a) + 1
    return source[head:] or source


def target_map(a: ParamAction) -> TargetMap:
    return TargetMap(a.dst_path, tuple(a.dst_shape), [Piece.from_json(p) for p in a.pieces], a.new_elements,
                     a.structure or "assembled")


def assembled_slots(a: ParamAction, sources: list[ParamState], fill) -> dict[str, object]:
    """The new parameter's slots: elementwise slots assembled, 0-dim scalars taken once (they agree),
    Adafactor's factors through the line map. Sources are named as the plan names them (a state
    reapplying a saved plan may have no paths of its own)."""
    t = target_map(a)
    named = {s["path"]: p for s, p in zip(a.sources, sources, strict=True)}
    shapes = {path: tuple(p.shape) for path, p in named.items()}
    coverage.check(t, {path: math.prod(shape) for path, shape in shapes.items()})  # a saved plan, too
    first = sources[0]
    out = {}
    factored = [n for n in first.slots if n in naming.FACTORED_SLOTS]
    for name, ref in first.slots.items():
        if name in factored:
            continue
        if ref.shape == ():
            out[name] = ref
            continue
        refs = {path: p.slots[name] for path, p in named.items()}
        out[name] = moving.assembled(t, refs, ref.dtype, fill(name) if t.new else 0.0, label=f"{a.dst_path}.{name}")
    if factored:
        out.update(_factored(t, named, shapes))
    return out


def _factored(t: TargetMap, named: dict[str, ParamState], shapes) -> dict[str, object]:
    from statekit.tensor import TensorRef

    lines = moving.line_map(t, shapes)
    if lines is None:
        raise MappingError(f"{t.path}: Adafactor's factored second moment cannot follow this map")
    rows = lines.orient == "rows"
    along_name, across_name = ("row_var", "col_var") if rows else ("col_var", "row_var")
    along = {path: s.slots[along_name].numpy() for path, s in named.items()}
    across = {path: s.slots[across_name].numpy() for path, s in named.items()}
    a, b, _ = moving.factors(lines, along, across, t.shape, shapes)
    dtype = next(iter(named.values())).slots["row_var"].numpy().dtype
    lead = tuple(t.shape[:-2])
    row_shape, col_shape = (*lead, t.shape[-2], 1), (*lead, 1, t.shape[-1])
    row, col = (a, b) if rows else (b, a)
    return {"row_var": TensorRef.from_array(row.astype(dtype).reshape(row_shape)),
            "col_var": TensorRef.from_array(col.astype(dtype).reshape(col_shape))}
