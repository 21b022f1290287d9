"""``report``: the optimizer-state health report, as numbers (the surface draws them).

One pass over the state's bytes, tensor by tensor, piece by piece (``--jobs`` tensors at a time):
per tensor the effective step size's percentiles, the share of ε-dominated coordinates, the
update's RMS, the update:weight ratio (``weights``), zero shares and steps, the depth profile of
RMS(m), √mean(v) and RMS(w), the distribution of ``log10 √v̂`` and each family's own view; then the
findings, and with ``against`` the per-tensor comparison with another state. The formulas follow
each family's arithmetic (:mod:`statekit.ops.report.formulas`, docs/report.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

from statekit import hyper, io
from statekit.errors import MappingError, UsageError
from statekit.ops.report import findings as checks
from statekit.ops.report.depth import places
from statekit.ops.report.family_views import family_view
from statekit.ops.report.formulas import Plan, plan_for
from statekit.ops.report.measure import Job, measure
from statekit.state import Checkpoint, ModelInfo, OptimizerState, ParamState


@dataclass
class Report:
    """The report of one state: per-tensor numbers, findings, the comparison (``--against``)."""

    state: str
    format: str
    family: str
    framework: str
    tensors: list[dict]
    findings: list[dict]
    compare: list[dict] = field(default_factory=list)
    common_step: float | None = None
    weights: str | None = None
    against: str | None = None
    notes: list[str] = field(default_factory=list)
    hyperparameters: list[dict] = field(default_factory=list)
    schedule: dict | None = None  # the lr curve (:func:`statekit.ops.report.lr_curve.curve`), when one is read

    def to_json(self) -> dict:
        return {"state": self.state, "format": self.format, "family": self.family, "framework": self.framework,
                "weights": self.weights, "against": self.against, "common_step": self.common_step,
                "hyperparameters": self.hyperparameters, "notes": self.notes, "tensors": self.tensors,
                "findings": self.findings, "compare": self.compare, "schedule": self.schedule}


def _state(ckpt: Checkpoint) -> OptimizerState:
    if ckpt.kind == "empty":  # an optimizer that never stepped
        return OptimizerState(family=None)
    if ckpt.kind != "optimizer" or ckpt.optimizer is None:
        raise MappingError(f"holds {ckpt.kind} data, not optimizer state", ckpt.path)
    return ckpt.optimizer


def _settle(state: OptimizerState, optimizer: str | None) -> None:
    if not optimizer:
        return
    if state.family is None and state.candidates:
        state.settle(optimizer)
    elif state.ambiguous:
        state.resolved(optimizer)


def _family(state: OptimizerState, p: ParamState) -> str | None:
    fam = p.family or (state.family if state.family not in (None, "mixed") else None)
    return fam


def _weights_for(state: OptimizerState, model: ModelInfo | None) -> dict[int, object]:
    """Position in ``state.params`` → the model tensor of the same parameter (by ParamId, else path)."""
    if model is None:
        return {}
    by_id, by_path = model.by_id(), model.by_path()
    out = {}
    for i, p in enumerate(state.params):
        m = by_id.get(p.id) if p.id is not None and by_id else None
        if m is None and p.path:
            m = by_path.get(p.path)
        if m is not None and m.tensor is not None:
            out[i] = m.tensor
    return out


def _pairs(state: OptimizerState, other: OptimizerState | None) -> dict[int, ParamState]:
    if other is None:
        return {}
    from statekit.ops.diff import match_method, pair_params

    method = match_method(state.params, other.params)
    pairs, _, _ = pair_params(state.params, other.params, method)
    where = {id(p): i for i, p in enumerate(state.params)}
    return {where[id(a)]: b for a, b in pairs}


def _selected(state: OptimizerState, only: list[str], path: str) -> list[ParamState]:
    """The parameters ``only`` names (paths, globs, ParamIds, #index); a name that selects none is refused."""
    for name in only:
        if not state.select([name]):
            raise UsageError(f"no parameter {name!r} (give a path or a glob, a decimal or 13-character ParamId, "
                             "or #index)", path)
    return state.select(only)


def _hyper_rows(plans: list[Plan], state: OptimizerState) -> list[dict]:
    """The hyperparameters used, once per distinct set (with the families and how many tensors)."""
    rows: dict[str, dict] = {}
    for plan in plans:
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.hyper.items()
                  if (isinstance(v, int | float | bool | str | tuple | list) or v is None)
                  and k not in hyper.EXECUTION_FLAGS and k != "maximize"}
        key = repr((plan.family, sorted(values.items(), key=lambda kv: kv[0])))
        row = rows.setdefault(key, {"family": plan.family, "values": values, "tensors": 0,
                                    "assumed": list(plan.assumed)})
        row["tensors"] += 1
    return list(rows.values())


def report(ckpt: Checkpoint, *, weights: Checkpoint | None = None, against: Checkpoint | None = None,
           given: dict[str, object] | None = None, optimizer: str | None = None, only: list[str] | None = None,
           progress=None) -> Report:
    """The report of an opened optimizer state (``weights``: its model; ``against``: another state
    of the same model, the earlier one). ``given``: hyperparameters by :data:`statekit.hyper.FLAGS`
    names, over those the file stores (burn files store none: the defaults, said in ``notes``)."""
    from statekit import stream

    state = _state(ckpt)
    _settle(state, optimizer)
    other = _state(against) if against is not None else None
    if other is not None:
        _settle(other, optimizer)
    model = None
    if weights is not None:
        if weights.kind != "model" or weights.model is None:
            raise MappingError(f"holds {weights.kind} data, not a model (give --weights the model's weights)",
                               weights.path)
        model = weights.model
    params = state.params if not only else _selected(state, only, ckpt.path)
    index = {id(p): i for i, p in enumerate(state.params)}
    given = dict(given or {})
    plans = [plan_for(state, p, _family(state, p), given) for p in params]
    w_of = _weights_for(state, model)
    pair_of = _pairs(state, other)
    jobs = []
    for p, plan in zip(params, plans, strict=True):
        i = index[id(p)]
        o = pair_of.get(i)
        o_plan = plan_for(other, o, _family(other, o), given) if o is not None else None
        jobs.append(Job(p, plan, w_of.get(i), o, o_plan))
    tensors, compare = [], []
    for k, (job, numbers) in enumerate(zip(jobs, stream.parallel_map(measure, jobs), strict=True)):
        tensors.append(_tensor(state, job, numbers, k))
        if job.other is not None:
            compare.append(_compare(job, numbers))
        if progress:
            progress()
    for t, where in zip(tensors, places([t["path"] for t in tensors]), strict=True):
        t.update(where)
    common = checks.common_step(tensors)
    found = checks.per_tensor(tensors, common) + checks.outliers(tensors)
    if compare:
        found += checks.compared(compare)
    order = {t["path"]: t["depth"] for t in tensors}
    notes = list(ckpt.warnings)
    if state.framework == "burn" and not state.hyperparams_stored:
        notes.append("burn optimizer files store no hyperparameters: the defaults were assumed "
                     "(give --lr, --betas, --eps, --weight-decay … for the run's)")
    if not state.params:
        notes.append("the state holds no parameters (an optimizer that never stepped)")
    if state.global_slots:
        notes.append(f"{state.family_label} keeps one global state: it has no per-tensor health numbers")
    if model is not None:
        missing = sum(1 for j in jobs if j.weight is None)
        if missing:
            notes.append(f"{missing} tensors have no weight in {weights.path} (matched by ParamId, else path)")
    if other is not None:
        unpaired = len(jobs) - len(compare)
        if unpaired:
            notes.append(f"{unpaired} tensors are not in {against.path}")
    from statekit.ops.report import lr_curve

    schedule, why = lr_curve.of_checkpoint(ckpt)
    if why:
        notes.append(why)
    return Report(state=ckpt.path, format=ckpt.format, family=state.family_label, framework=state.framework,
                  tensors=tensors, findings=checks.ordered(found, order), compare=compare, common_step=common,
                  weights=weights.path if weights is not None else None,
                  against=against.path if against is not None else None, notes=notes,
                  hyperparameters=_hyper_rows(plans, state), schedule=schedule)


def _tensor(state: OptimizerState, job: Job, numbers: dict, position: int) -> dict:
    p, plan = job.p, job.plan
    shape = p.shape
    v_mean = numbers["v_sqrt_mean"]
    out = {
        "path": p.label(), "depth": position, "stack": None, "layer": None, "kind": None, "family": plan.family, "step": None if p.step is None else float(p.step),
        "numel": numbers["numel"], "shape": None if shape is None else list(shape), "dtype": p.dtype,
        "group": p.group,
        "eff_lr_log10": numbers["eff_lr_log10"], "eps_fraction": numbers["eps_fraction"],
        "update_rms": numbers["update_rms"], "update_weight_ratio": numbers["update_weight_ratio"],
        "m_zero_fraction": numbers["m_zero_fraction"], "v_zero_fraction": numbers["v_zero_fraction"],
        "nonfinite": numbers["nonfinite"], "m_rms": numbers["m_rms"], "v_sqrt_mean": v_mean,
        "v_hat_sqrt_mean": v_mean * math.sqrt(plan.v_scale) if v_mean is not None and plan.v_scale else None,
        "w_rms": numbers["w_rms"], "v_hat_sqrt_log10_hist": numbers["v_hat_sqrt_log10_hist"],
        "family_view": family_view(p, plan, job.weight),
        "formula": plan.formula,
    }
    if numbers["notes"]:
        out["notes"] = numbers["notes"]
    return out


def _compare(job: Job, numbers: dict) -> dict:
    """log2(RMS(v̂_B)/RMS(v̂_A)), cos(m_A, m_B), step_B − step_A (B: the state reported on)."""
    c = numbers.get("_compare")
    a, b = job.other, job.p
    delta = None if a.step is None or b.step is None else float(b.step) - float(a.step)
    row = {"path": b.label(), "v_rms_log2_ratio": None, "m_cosine": None, "step_delta": delta}
    if c:
        rb, ra = math.sqrt(c["v_sq"] / c["n"]), math.sqrt(c["a_v_sq"] / c["n"])  # RMS(v), as stored
        if ra > 0 and rb == 0:
            row["v_rms_log2_ratio"] = -math.inf  # fell to 0 (whatever either bias correction)
        elif ra > 0 and job.plan.v_scale and job.other_plan.v_scale:
            row["v_rms_log2_ratio"] = math.log2(rb * job.plan.v_scale / (ra * job.other_plan.v_scale))
        if c["has_m"] and c["m_sq"] > 0 and c["a_m_sq"] > 0:
            row["m_cosine"] = c["mm"] / math.sqrt(c["m_sq"] * c["a_m_sq"])
    numbers.pop("_compare", None)
    return row


def report_files(state: str | os.PathLike, *, weights: str | os.PathLike | None = None,
                 against: str | os.PathLike | None = None, key: str | None = None, progress=None,
                 **options) -> Report:
    """:func:`report` of files (``progress(description, total)``: a context giving a callback)."""
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(io.open_checkpoint(state, **({"key": key} if key else {})))
        w = stack.enter_context(io.open_checkpoint(weights)) if weights is not None else None
        if w is not None and ckpt.optimizer is not None and ckpt.optimizer.framework == "torch" \
                and not all(p.path for p in ckpt.optimizer.params) and w.model is not None:
            from statekit.ops.convert import name_checkpoint
            from statekit.ops.options import make_options

            name_checkpoint(ckpt, make_options(model=w.model), str(state))
        o = stack.enter_context(io.open_checkpoint(against, **({"key": key} if key else {}))) \
            if against is not None else None
        n = len(ckpt.optimizer.params) if ckpt.optimizer is not None else 0
        bar = progress("measuring", n) if progress else contextlib.nullcontext(None)
        with bar as advance:
            return report(ckpt, weights=w, against=o, progress=advance, **options)
