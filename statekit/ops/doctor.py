"""``doctor``: the problems in an optimizer state that bite when training resumes.

Without a model: NaN / Inf in any field (counts), all-zero moments at step > 1, a step that is no
whole count (NaN, Inf, negative, fractional), steps that differ between parameters, ranks above 8 (burn panics loading them), ``__rank`` disagreeing with the
tensors' shape, fields of one parameter with different shapes, unrecognised layouts (burn drops
them silently), duplicate module paths. With ``model``: the orphaned ParamIds of earlier launches beside the
model's own state for a path (burn #5130, :mod:`statekit.ops.orphans`) and the bytes they hold: state that matches no model parameter
(orphans), model parameters without state, shape mismatches (a reversed shape is reported as a
transposed match). Parameters are matched to the model like ``diff`` matches files: by burn
ParamId when both sides have them, else by module path, else by torch parameter index.

Each finding has a severity (``error``: resume fails or silently corrupts the update; ``warning``:
resume works but state is lost or suspicious; ``info``: worth knowing) and a one-line reason.
Tensors are streamed one at a time, in blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Callable

import numpy as np

from statekit import dtypes, io, naming
from statekit.errors import MappingError
from statekit.frameworks import bnb
from statekit.frameworks.torch_state import BUFFER_SUFFIXES
from statekit.ops import orphans
from statekit.ops.diff import METHOD_WORDS
from statekit.state import (
    Checkpoint,
    ModelInfo,
    ModelParam,
    OptimizerState,
    ParamState,
    matches,
    step_problem,
)
from statekit.state import format_shape as _shape
from statekit.stream import nonfinite
from statekit.tensor import TensorRef

BLOCK = 1 << 20
REPORTING_READERS = frozenset({"megatron-dist"})  # formats whose reader takes prove="report"
BURN_MAX_RANK = 8
SEVERITIES = ("error", "warning", "info")
# Model tensors that no optimizer updates (batch-norm statistics): never "missing state".
MAX_NAMED = 8

WHY = {
    "nan": "a NaN or Inf in a moment reaches the parameter at the first update after resume and spreads",
    "zero-moments": "after more than one step a moment is only all-zero if every gradient was exactly zero; "
                    "more likely the state was reset or badly written, and the step counter no longer matches it",
    "step": "a step counts the updates a parameter took (a whole number from 0); this one comes from a damaged "
            "file: bias correction turns the parameter into NaN (or nonsense) at the first update after resume, "
            "and statekit refuses to write it",
    "steps": "bias correction uses each parameter's own step: state from different runs or a partial load "
             "resumes with inconsistent update sizes (expected only for parameters added later)",
    "rank": "burn panics loading optimizer state of rank above 8 ('Unsupported tensor rank')",
    "rank-mismatch": "burn rebuilds each state with the rank in __rank; tensors of another rank fail the load",
    "field-shapes": "the fields of one parameter must have its shape; the optimizer's elementwise update fails",
    "layout": "burn silently drops a state whose fields do not match its optimizer; that parameter restarts fresh",
    "duplicate-path": "two states claim one module path: path-based groups and remapping cannot tell which is meant",
    "orphan": "burn silently drops state whose ParamId matches no parameter (PyTorch misplaces it by position): "
              "those moments are lost",
    "missing": "the parameter resumes with fresh moments and step 0 while the rest continue",
    "shape": "the moments do not fit the parameter: the first optimizer step fails (or broadcasts wrongly)",
    "transposed": "same elements in the other layout (torch Linear is [out, in], burn [in, out]): "
                  "transpose the moments or every update lands on the wrong weight",
    "path": "burn matches state by ParamId, so this resumes fine; tools that match by path will not",
    "names": "PyTorch pairs state with parameters by position; which model parameter each position belongs to "
             "could not be worked out from the model's order and shapes, so the model checks were skipped",
    "opaque": "statekit does not understand this entry (a nested dict or an object), so the moments in it were "
              "not checked, and a reader that expects plain tensors (torch's own optimizers, burn) would drop "
              "or reject them",
    "orphan-ids": "burn before PR #5177 gave every relaunch new ParamIds and kept the earlier launches' states "
                  "beside the new ones (burn #5130): the record grows by one state set per relaunch, and the "
                  "live state restarted fresh; remap --model keeps the model's own",
    "no-path": "burn picks a parameter group's optimizer by path; without one only the catch-all group applies",
    "megatron-master": "a mixed-precision run's weight is its fp32 master rounded to the weight's dtype; where they "
                       "disagree the state was cut at the wrong offsets, and resuming trains every such parameter "
                       "with another parameter's moments and master",
    "padding-state": "an input embedding's padding rows are never looked up, so their gradient is zero: moments "
                     "there were written by something else (a resharding or conversion that moved rows), and the "
                     "rows they belong to resume without them",
    "schedule-lr": "the next update uses the param group's lr; a chainable torch scheduler (StepLR, ExponentialLR, "
                   "CosineAnnealingLR …) computes every later lr from it, so each is off by the same factor "
                   "(a closed-form one, LambdaLR / HF, is back on its schedule one update later)",
    "schedule-args": "Trainer rebuilds the λ from the arguments of the resumed run: arguments that do not rebuild "
                     "the saved lr continue another schedule from this position",
    "initial-lr": "a scheduler built with last_epoch >= 0 raises KeyError 'initial_lr' (pytorch#140900), and "
                  "OneCycleLR computes every lr from it; the scheduler's base lrs cannot be checked against it",
    "no-scheduler": "HF Trainer loads optimizer.pt only when scheduler.pt is beside it: without it the optimizer "
                    "state is silently ignored on resume (fresh moments) and the schedule restarts at step 0",
    "counters": "the trainer's global step, the scheduler's position and the optimizer's step count one update "
                "each; when they disagree the schedule resumes at another point of training than the optimizer",
    "warmup-again": "the scheduler stands before the end of its warm-up while the optimizer has taken more updates "
                    "than the warm-up: the lr ramps up again from near zero on a trained model",
}


def _finding(severity: str, check: str, param: str | None, message: str) -> dict:
    return {"severity": severity, "check": check, "param": param, "message": message, "why": WHY[check]}


def scan(ref: TensorRef, block: int = BLOCK) -> dict:
    """NaN / Inf counts and whether every element is zero, streaming ``block`` elements at a time."""
    if ref.dtype in ("QFloat", "Bool"):
        return {"nan": 0, "inf": 0, "zero": False}
    nan = inf = 0
    zero = ref.numel > 0
    is_float = dtypes.is_float(ref.dtype)
    for chunk in ref.pieces(block):  # read with pread, one block at a time
        if is_float:
            n, i = nonfinite(chunk)
            nan, inf = nan + n, inf + i
        if zero and np.any(chunk != 0):
            zero = False
    return {"nan": nan, "inf": inf, "zero": zero and not nan}


def _check_param(p: ParamState, findings: list[dict]) -> None:
    label = p.label()
    # per-parameter scalars (transformers Adafactor's RMS, optimi's eps_sq) and an Adafactor's factored
    # second moment (row and column factors) are not the parameter's shape by design
    # bitsandbytes' code table and block scales (kept as stored when its family is not read) neither
    shapes = {slot: tuple(ref.shape) for slot, ref in p.slots.items()
              if ref.shape and slot not in naming.FACTORED_SLOTS
              and not ("state1" in p.slots and slot in bnb.STATE_KEYS[2:])}
    if len(set(shapes.values())) > 1:
        detail = ", ".join(f"{slot} {_shape(s)}" for slot, s in shapes.items())
        findings.append(_finding("error", "field-shapes", label, f"fields have different shapes: {detail}"))
    shape = p.shape
    rank = p.rank if p.rank is not None else (len(shape) if shape is not None else None)
    if rank is not None and rank > BURN_MAX_RANK:
        findings.append(_finding("error", "rank", label, f"rank {rank} (shape {_shape(shape)}); burn supports ≤ 8"))
    if p.rank is not None and shape is not None and p.rank != len(shape):
        findings.append(_finding("error", "rank-mismatch", label,
                                 f"__rank says {p.rank} but the tensors are {_shape(shape)} (rank {len(shape)})"))
    if p.family is None and any(isinstance(v, TensorRef) for v in p.extra.values()):
        names = ", ".join(k for k, v in p.extra.items() if isinstance(v, TensorRef))
        findings.append(_finding("warning", "layout", label, f"unrecognised state fields: {names}"))
    if p.opaque:
        findings.append(_finding("error", "opaque", label, f"state not understood, not checked: {p.opaque_text()}"))
    fields = {_field_label(p, slot): ref for slot, ref in p.slots.items()}
    fields.update({k: v for k, v in p.extra.items() if isinstance(v, TensorRef)})
    bad, zeros = [], []
    for name, ref in fields.items():
        facts = scan(ref)
        if facts["nan"] or facts["inf"]:
            counts = [f"{facts[k]} {word}" for k, word in (("nan", "NaN"), ("inf", "Inf")) if facts[k]]
            bad.append(f"{name}: {' + '.join(counts)} of {ref.numel}")
        if facts["zero"]:
            zeros.append(name)
    if bad:
        findings.append(_finding("error", "nan", label, "; ".join(bad)))
    if zeros and p.step is not None and p.step > 1:
        findings.append(_finding("warning", "zero-moments", label,
                                 f"{', '.join(zeros)} all zero at step {p.step:g}"))


def _field_label(p: ParamState, slot: str) -> str:
    """A slot as findings name it; one a library quantizes says where its values come from."""
    enc = p.encoding.get(slot)
    if enc is None:
        return slot
    if enc.bits == 8:
        return f"{slot} ({enc.field}{'' if enc.part is None else f'[{enc.part}]'} dequantized with absmax{enc.field[-1]})"
    return f"{slot} ({enc.field})"


def _check_steps(params: list[ParamState], findings: list[dict], skip: set[int] = frozenset()) -> None:
    counted = []
    for p in params:
        if id(p) in skip:  # orphans of earlier launches (named by orphan-ids)
            continue
        why = step_problem(p.step)
        if why is not None:
            findings.append(_finding("error", "step", p.label(), why))
        elif p.step is not None:
            counted.append(p)
    steps = Counter(p.step for p in counted)
    if len(steps) < 2:
        return
    top = max(steps.values())
    common = max(step for step, count in steps.items() if count == top)  # ties: the furthest along
    parts = []
    for step, count in sorted(steps.items(), key=lambda kv: (kv[0] != common, -kv[1], kv[0])):
        text = f"{step:g} ({count} parameter{'s' if count != 1 else ''}"
        if step != common:
            names = [p.label() for p in counted if p.step == step]
            more = f", +{len(names) - MAX_NAMED}" if len(names) > MAX_NAMED else ""
            text += f": {', '.join(names[:MAX_NAMED])}{more}"
        parts.append(text + ")")
    findings.append(_finding("warning", "steps", None, f"steps differ: {'; '.join(parts)}"))


def _check_paths(params: list[ParamState], findings: list[dict], shared: list[orphans.SharedPath]) -> None:
    for s in shared:
        if s.live is not None:  # the model names the live one: orphan-ids says it
            continue
        ps = s.holders
        who = ", ".join(orphans.describe(p) for p in ps)
        extra = sum(orphans.nbytes(p) for p in ps) - max(orphans.nbytes(p) for p in ps)
        message = f"{len(ps)} states have this path ({who}); {extra:,} bytes beyond one state"
        if all(p.id is not None for p in ps):
            message += ("; give --model the model saved with this record to tell the live one from the orphans "
                        "of earlier launches (burn #5130)")
        findings.append(_finding("error", "duplicate-path", s.path, message))
    if params and any(p.id is not None for p in params):
        missing = [p for p in params if not p.path]
        if missing and len(missing) < len(params):  # all missing: a state never stepped since a load
            names = ", ".join(p.label() for p in missing[:MAX_NAMED])
            findings.append(_finding("info", "no-path", None, f"{len(missing)} states store no module path: {names}"))
        elif missing:
            findings.append(_finding("info", "no-path", None, "no state stores a module path"))


def _name_positions(state: OptimizerState, model_ckpt: Checkpoint, findings: list[dict], notes: list[str]) -> bool:
    """Name a torch state's positions from the model (solved, see torch_names) before pairing by path;
    False (with a finding) when that cannot be done without guessing."""
    if state.framework != "torch" or not state.params or all(p.path for p in state.params):
        return True
    from statekit.frameworks import torch_names

    try:
        res = torch_names.name_state(state, torch_names.from_model_info(model_ckpt.model, model_ckpt.path))
    except torch_names.NamesError as exc:
        findings.append(_finding("warning" if exc.ambiguous else "error", "names", None, exc.message))
        return False
    notes.append(res.describe())
    return True


def _is_buffer(m: ModelParam) -> bool:
    return m.buffer or m.path.rsplit(".", 1)[-1] in BUFFER_SUFFIXES


def _model_method(params: list[ParamState], model: ModelInfo) -> str:
    if not params:
        return "id" if model.params and all(m.id is not None for m in model.params) else "path"
    if all(p.id is not None for p in params) and all(m.id is not None for m in model.params):
        return "id"
    if params and all(p.path for p in params):
        return "path"
    return "index"


def _check_orphan_ids(shared: list[orphans.SharedPath], findings: list[dict], state_path: str,
                      model_path: str) -> None:
    resolved = [s for s in shared if s.live is not None]
    for s in resolved:
        findings.append(_finding("warning", "orphan-ids", s.path,
                                 f"{len(s.orphans)} orphaned state{'s' if len(s.orphans) > 1 else ''} "
                                 f"({', '.join(orphans.describe(p) for p in s.orphans)}; {s.wasted:,} bytes) beside "
                                 f"the model's {orphans.describe(s.live)}"))
    if resolved:
        n = sum(len(s.orphans) for s in resolved)
        ids = len({p.id for s in resolved for p in s.orphans})
        findings.append(_finding("warning", "orphan-ids", None,
                                 f"{n} orphaned states under {ids} ParamIds the model no longer has, "
                                 f"{sum(s.wasted for s in resolved):,} bytes of tensor data: statekit remap "
                                 f"{state_path} --model {model_path} -o OUT keeps the model's"))


def _check_model(params: list[ParamState], model: ModelInfo, findings: list[dict], skip: set[int] = frozenset()
                 ) -> str:
    method = _model_method(params, model)
    from statekit.frameworks.torch_names import tied_duplicates

    tied = tied_duplicates(model)  # a tied LM head is the embedding itself: it has that one's state
    trainable = [m for m in model.params if not _is_buffer(m) and m.path not in tied]
    if method == "id":
        table = model.by_id()
    elif method == "path":
        table = model.by_path()
    else:
        table = {m.index if m.index is not None else i: m for i, m in enumerate(trainable)}
    by_path = model.by_path()
    matched: set[int] = set()
    orphans: list[tuple[ParamState, object]] = []
    for p in params:
        if id(p) in skip:  # an orphan of an earlier launch (orphan-ids names it)
            continue
        want = p.id if method == "id" else p.path if method == "path" else (
            p.index if p.index is not None else int(p.key) if p.key.isdigit() else None)
        m = table.get(want)
        if m is None:
            orphans.append((p, want))
            continue
        matched.add(id(m))
        if method == "id" and p.path and p.path != m.path:
            findings.append(_finding("info", "path", p.label(), f"the model calls ParamId {p.id} {m.path}"))
        shape, want_shape = p.shape, tuple(m.shape)
        if shape is None or tuple(shape) == want_shape:
            continue
        if len(want_shape) > 1 and tuple(shape) == want_shape[::-1]:
            findings.append(_finding("error", "transposed", p.label(),
                                     f"state {_shape(shape)}, model {m.path} {_shape(want_shape)} (transposed)"))
        else:
            findings.append(_finding("error", "shape", p.label(),
                                     f"state {_shape(shape)}, model {m.path} {_shape(want_shape)}"))
    stateless = [m for m in trainable if id(m) not in matched]
    for p, want in orphans:
        message = f"no model parameter has {METHOD_WORDS[method]} {want}"
        other = by_path.get(p.path) if p.path else None
        if method == "id" and other is not None:
            if id(other) in matched:
                message += f"; the model's {p.path} (ParamId {other.id}) already has other state"
            else:
                message += (f"; the model has {p.path} under ParamId {other.id} ({other.display_id}): "
                            "remap the state (statekit remap) to keep it")
        elif p.shape is not None:
            message += f" (shape {_shape(p.shape)})"
            same = [m.path for m in stateless if tuple(m.shape) == tuple(p.shape)]
            if same:
                more = f" (+{len(same) - 3})" if len(same) > 3 else ""
                message += (f"; model parameters without state of that shape: {', '.join(same[:3])}{more} "
                            "— renamed? (statekit remap)")
        findings.append(_finding("warning", "orphan", p.label(), message))
    for m in stateless:
        findings.append(_finding("warning", "missing", m.path, f"no state for {m.path} ({_shape(m.shape)})"))
    return method


def _selected(state: OptimizerState, model: ModelInfo | None, only: list[str] | None):
    """The parameters ``only`` names (paths, globs, ids, #index), in the state and in the model."""
    if not only:
        return state, model
    if model is not None:
        model = ModelInfo([m for m in model.params if any(matches(n, path=m.path, id=m.id) for n in only)])
    return dataclasses.replace(state, params=state.select(only)), model


def doctor(state_ckpt: Checkpoint, model_ckpt: Checkpoint | None = None,
           on_param: Callable[[], None] | None = None, only: list[str] | None = None) -> dict:
    """Check an opened optimizer state (and, given, its model); a JSON-able report. ``only``:
    parameter names or path globs (:func:`statekit.state.matches`) to check, in state and model."""
    if state_ckpt.kind == "empty":
        state = OptimizerState(family=None)
    elif state_ckpt.kind != "optimizer" or state_ckpt.optimizer is None:
        raise MappingError(f"holds {state_ckpt.kind} data, not optimizer state", state_ckpt.path)
    else:
        state = state_ckpt.optimizer
    if model_ckpt is not None and (model_ckpt.kind != "model" or model_ckpt.model is None):
        raise MappingError(f"holds {model_ckpt.kind} data, not a model (give --model the model's weights)",
                           model_ckpt.path)
    findings: list[dict] = []
    notes: list[str] = []
    # a torch state's positions are named from the whole model before any selection
    named = model_ckpt is None or _name_positions(state, model_ckpt, findings, notes)
    state, model = _selected(state, model_ckpt.model if model_ckpt is not None else None, only)
    if not state.params and not state.global_slots:
        notes.append("the state holds no parameters (an optimizer that never stepped): training resumes fresh")
    for p in state.params:
        _check_param(p, findings)
        if on_param:
            on_param()
    if state.global_slots:
        glob = ParamState(key="(global state)", path="(global state)", slots=dict(state.global_slots))
        _check_param(glob, findings)
        notes.append(f"{state.family_label} keeps one global state; per-parameter checks do not apply to it")
    method = _model_method(state.params, model) if model_ckpt is not None and named else None
    shared = orphans.shared_paths(state, model if method == "id" else None)
    skip = {id(p) for s in shared for p in s.orphans}
    _check_steps(state.params, findings, skip)
    _check_paths(state.params, findings, shared)
    reader_checks = getattr(state_ckpt.container, "doctor_findings", None)
    if reader_checks is not None:  # what only the reader of a format can see (megatron-dist: the master proof)
        findings.extend(_finding(*f) for f in reader_checks(state.params))
    from statekit.ops import doctor_schedule

    doctor_schedule.check(state_ckpt, _finding, findings, notes)
    if method is not None:
        _check_orphan_ids(shared, findings, state_ckpt.path, model_ckpt.path)
        _check_model(state.params, model, findings, skip)
    findings.sort(key=lambda f: SEVERITIES.index(f["severity"]))
    counts = {s: sum(1 for f in findings if f["severity"] == s) for s in SEVERITIES}
    steps = sorted(state.steps()) if state.params else []
    return {
        "state": state_ckpt.path,
        "format": state_ckpt.format,
        "family": state.family_label if state.params else None,
        "params": len(state.params),
        "steps": steps,
        "model": None if model_ckpt is None else model_ckpt.path,
        "model_params": None if model is None else len(model.params),
        "matched_by": method,
        "findings": findings,
        "counts": counts,
        "clean": counts["error"] == 0 and counts["warning"] == 0,
        "notes": notes + list(state_ckpt.warnings),
    }


def doctor_files(state_path: str | os.PathLike, model_path: str | os.PathLike | None = None,
                 progress=None, only: list[str] | None = None, *, names: object = None,
                 names_order: str | None = None) -> dict:
    """``names`` / ``names_order``: name a torch state's positions (with ``model_path``'s shapes)."""
    with contextlib.ExitStack() as stack:
        # readers that refuse a state they cannot prove (megatron-dist) report it to doctor instead
        options = {"prove": "report"} if io.sniff(state_path) in REPORTING_READERS else {}
        state_ckpt = stack.enter_context(io.open_checkpoint(state_path, **options))
        if names is not None and state_ckpt.optimizer is not None and state_ckpt.optimizer.framework == "torch":
            from statekit.ops.convert import name_source_params
            from statekit.ops.options import make_options

            name_source_params(state_ckpt.optimizer, make_options(names=names, names_order=names_order,
                                                                  model=model_path), str(state_path))
        model_ckpt = stack.enter_context(io.open_checkpoint(model_path)) if model_path is not None else None
        n = len(state_ckpt.optimizer.params) if state_ckpt.optimizer else 0
        bar = progress("checking", n) if progress else contextlib.nullcontext(None)
        with bar as advance:
            return doctor(state_ckpt, model_ckpt, on_param=advance, only=only)
