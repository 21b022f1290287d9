"""Carry out a :class:`~statekit.ops.plan.Plan`: map a source state onto the target, lazily.

Tensors are transformed (transposed, resized, cast) only when the writer asks for their bytes,
one at a time, so memory stays one tensor. The plan is checked against the state first: a plan
saved for another file is refused rather than half-applied.
"""

from __future__ import annotations

from statekit import hyper, naming, stream
from statekit.errors import MappingError
from statekit.formats import registry
from statekit.frameworks import burn
from statekit.ops.plan import ParamAction, Plan
from statekit.state import OptimizerState, ParamGroup, ParamState, refuse_bad_steps
from statekit.tensor import TensorRef


def transformed(ref: TensorRef, transpose: bool = False, shape: tuple | None = None, cast: str | None = None,
                fill: float = 0.0) -> TensorRef:
    """A lazy view of ``ref`` transposed, padded (with ``fill``) or truncated to ``shape``, and cast —
    produced piece by piece when a writer asks (:mod:`statekit.stream`)."""
    if not (transpose or cast or (shape is not None and tuple(shape) != _after_t(ref.shape, transpose))):
        return ref
    out = stream.transpose(ref) if transpose else ref
    if shape is not None and tuple(shape) != tuple(out.shape):
        out = stream.resize(out, tuple(shape), fill)
    if cast:
        out = stream.cast(out, cast)
    return out


def finite_checked(ref: TensorRef, label: str, path: str | None = None) -> TensorRef:
    """``ref``, refusing (when its values are read for writing) NaN or Inf in a float tensor.

    A non-finite moment turns the parameter into NaN at its next step; the check runs in the same
    pass that moves the bytes, and since outputs are written atomically, the refusal leaves no
    file behind.
    """
    return stream.checked(ref, label, path)


def _after_t(shape, transpose: bool) -> tuple:
    return tuple(shape)[::-1] if transpose else tuple(shape)


def _check(plan: Plan, state: OptimizerState) -> dict[str, ParamState]:
    by_key = {p.key: p for p in state.params}
    for a in plan.params:
        if a.src_key is None:
            continue
        p = by_key.get(a.src_key)
        if p is None:
            raise MappingError(f"the plan names source parameter {a.src_key!r}, which the input does not have", plan.source)
        if a.src_shape is not None and p.shape is not None and list(p.shape) != list(a.src_shape):
            raise MappingError(f"the plan expects {a.src_path or a.src_key} of shape {a.src_shape}, the input has "
                               f"{list(p.shape)}", plan.source)
        for s in a.sources or ():
            q = by_key.get(s.get("key"))
            if q is None or (q.path is not None and q.path != s.get("path")) \
                    or (q.shape is not None and list(q.shape) != s.get("shape")):
                raise MappingError(f"the plan builds {a.dst_path} from {s.get('path')} {s.get('shape')}, which the "
                                   "input does not have", plan.source)
    return by_key


def apply_plan(plan: Plan, state: OptimizerState) -> OptimizerState:
    """The target state the plan describes (tensors still lazy)."""
    refuse_bad_steps(state, plan.source)
    if state.family is None and plan.family in state.candidates:  # a saved plan settles what the file cannot tell
        state.settle(plan.family)
    by_key = _check(plan, state)
    target_fw = registry.framework_of(plan.target_format)
    if target_fw == "neutral":  # statekit's generic layout keeps the source framework's state as it is
        target_fw = state.framework
    params: list[ParamState] = []
    for a in plan.params:
        if a.action in ("drop", "into"):
            continue
        if a.action == "new" or a.reset_step:
            if target_fw == "torch":
                params.append(ParamState(key=str(a.dst_index), index=a.dst_index, path=a.dst_path, group=a.group))
            continue
        params.append(_move(a, by_key[a.src_key], plan, target_fw, by_key))
    seen: set[str] = set()
    for p in params:  # one source split into several targets (Megatron's linear_qkv → q/k/v) keeps no one key
        if p.key in seen and p.path and p.path not in seen:
            p.key = p.path
        seen.add(p.key)
    groups = [ParamGroup(hyperparams=dict(h), keys=[]) for h in plan.hyperparams] or [ParamGroup()]
    for p in params:
        if p.group >= len(groups):
            p.group = 0
        groups[p.group].keys.append(p.key)
    if plan.target_format == "safetensors":  # statekit's generic layout is a faithful dump of the source
        return OptimizerState(family=state.family if plan.family in state.candidates else plan.family,
                              candidates=state.candidates or (plan.family,), params=params, groups=groups,
                              hyperparams_stored=any(g.hyperparams for g in groups), framework=state.framework,
                              notes=list(state.notes))
    return OptimizerState(family=plan.family, candidates=(plan.family,), params=params, groups=groups,
                          hyperparams_stored=target_fw != "burn", framework=target_fw)


# Adafactor's factored second moment: transposing the parameter swaps the factors (the row factor
# [n, 1] of a [n, m] matrix is the column factor [1, n] of its transpose)
FACTORS = {"row_var": "col_var", "col_var": "row_var", "second_moment": "column_second_moment",
           "column_second_moment": "second_moment"}


def _fill(a: ParamAction, family: str | None, slot: str, plan: Plan, target_fw: str) -> float:
    """What a resized slot's new elements hold: the value a new parameter's state starts at under
    the target group (Adagrad's ``sum``: initial_accumulator_value; where the group does not hold it,
    the target framework's default), zero for most."""
    group = plan.hyperparams[a.group] if a.group < len(plan.hyperparams) else {}
    value = hyper.fresh_value(family, slot, group)
    if value is None and family in hyper.CONFIGS.get(target_fw, {}):  # the target framework's own default
        value = hyper.fresh_value(family, slot, hyper.core_defaults(target_fw, family))
    if value is None:
        key = hyper.FRESH_FROM[family][slot]
        raise MappingError(f"{a.label()}: the new elements of {slot} start at {key}, which the target param group "
                           f"does not hold; give it (e.g. --lr)", plan.source)
    return value


def group_family(plan: Plan, group: int) -> str | None:
    """The optimizer of a target group: its own where groups hold different ones (Muon + AdamW)."""
    if plan.group_families and group < len(plan.group_families):
        return plan.group_families[group]
    return plan.family


def _move(a: ParamAction, p: ParamState, plan: Plan, target_fw: str, by_key=None) -> ParamState:
    family = group_family(plan, a.group)
    if a.action == "assemble":
        from statekit.ops import structural

        sources = [by_key[s["key"]] for s in a.sources]
        slots = structural.assembled_slots(a, sources, lambda name: _fill(a, family, name, plan, target_fw))
        return _finish(a, p, slots, plan, target_fw, family, encoding={})
    return _finish(a, p, _moved_slots(a, p, plan, target_fw, family), plan, target_fw, family)


def _moved_slots(a: ParamAction, p: ParamState, plan: Plan, target_fw: str, family: str | None) -> dict:
    """The slots of one source parameter, transposed, resized and cast as the action says."""
    shape = tuple(a.dst_shape) if a.dst_shape is not None else None
    slots = {}
    for name, ref in p.slots.items():
        # Adafactor's factored row_var/col_var, told by name (a factor of a [1, n] or [n, 1] weight has the
        # weight's own shape); any other slot of another shape cannot be transposed or resized either
        factor = name in FACTORS and FACTORS[name] in p.slots
        if ref.shape == () and p.shape != () and not factor:  # a per-parameter scalar (NAdam's mu_product) moves as it is
            slots[name] = transformed(ref, cast=a.cast)
        elif factor or (p.shape is not None and tuple(ref.shape) != tuple(p.shape)):
            if a.resize or (a.transpose and (name not in FACTORS or FACTORS[name] not in p.slots)):
                raise MappingError(f"{a.label()}: field {name} has shape {list(ref.shape)}, not the parameter's; "
                                   "it cannot be transposed or resized", plan.source)
            if a.transpose:  # [n, 1] → [1, n] under the other factor's name
                slots[FACTORS[name]] = transformed(ref, True, None, a.cast)
            else:
                slots[name] = transformed(ref, cast=a.cast)
        else:
            fill = _fill(a, family, name, plan, target_fw) if a.resize else 0.0
            slots[name] = transformed(ref, a.transpose, shape, a.cast, fill)
    if a.transpose:  # the row factor first again
        rows = [k for k in ("row_var", "second_moment") if k in slots]
        slots = {k: slots[k] for k in rows} | {k: v for k, v in slots.items() if k not in rows}
    return slots


def _finish(a: ParamAction, p: ParamState, slots: dict, plan: Plan, target_fw: str, family: str | None,
            encoding: dict | None = None) -> ParamState:
    """The target parameter: its slots checked for NaN/Inf, value transforms applied, derived slots,
    its step, and its identity in the target."""
    from statekit.ops import crossing

    shape = tuple(a.dst_shape) if a.dst_shape is not None else None
    if not plan.allow_nonfinite:
        slots = {name: finite_checked(ref, f"{a.label()}.{name}", plan.source) for name, ref in slots.items()}
    for t in plan.transforms:
        if t["group"] == a.group and t["slot"] in slots:
            slots[t["slot"]] = crossing.apply(slots[t["slot"]], t["op"], t["value"])
    if target_fw == "burn":
        slots = burn.with_derived_slots(family, slots)
    else:  # derived copies (burn RMSProp's avg): the other frameworks recompute them
        slots = {k: v for k, v in slots.items() if k not in naming.derived_slots(family)}
    step = p.step
    if a.reset_step:
        step = 0
    if step is not None and target_fw == "burn":  # burn counts steps in integers (apply_plan checked it is one)
        step = int(step)
    dst_id = int(a.dst_id) if a.dst_id is not None else None
    key = str(dst_id) if dst_id is not None else str(a.dst_index if a.dst_index is not None else p.key)
    extra = {k: v for k, v in p.extra.items() if k == "__step_kind"} if target_fw == "burn" else {}
    return ParamState(key=key, id=dst_id, index=a.dst_index, path=a.dst_path,
                      rank=len(shape) if shape is not None else p.rank, step=step, slots=slots, extra=extra,
                      group=a.group, family=family,
                      encoding={k: v for k, v in p.encoding.items() if k in slots} if encoding is None else encoding,
                      stored_as=p.stored_as)


def write(plan: Plan, state: OptimizerState, path: str, progress=None, on_warning=None) -> int:
    """Apply the plan and write the result with the target format's writer (atomically)."""
    target = apply_plan(plan, state)
    save = registry.writer(plan.target_format)
    return save(target, path, family=plan.family, groups=plan.hyperparams, metadata=dict(plan.metadata),
                progress=progress, step_policy=plan.step_policy, on_warning=on_warning)
