"""burn ≤ 0.21 records (``.mpk``, ``.mpk.gz``, ``.bin``, ``.bin.gz``) ⇄ the neutral state model.

:mod:`statekit.formats.burn_legacy` decodes the bytes; this module gives the result the same
meaning a burn 0.22 burnpack file gets from :mod:`statekit.frameworks.burn` (``burn-formats.md``
§4.6): the base32 key becomes the u64 ParamId (decimal key), ``Rank<D>`` the rank, ``time`` the
step, the dotted leaves are classified with :func:`statekit.naming.classify` exactly as burnpack
leaves are, and ``nil`` optionals are simply absent. An optimizer record written from such a state
by :func:`statekit.frameworks.burn.to_pack` is the record burn 0.22 would write itself.

Legacy optimizer records hold no module paths; ``open_checkpoint(path, model=MODEL)`` takes them
from a model record (legacy ``.mpk`` or burnpack), joined on the ParamId. Model records become a
:class:`~statekit.state.ModelInfo` and can be written as burnpack model files with
:func:`statekit.frameworks.burn.save_model`.
"""

from __future__ import annotations

import os

from statekit import dtypes, naming
from statekit.errors import MappingError
from statekit.formats.burn_legacy import (
    LegacyModel,
    LegacyOptimizer,
    LegacyRecord,
    LegacyScheduler,
    read_legacy,
)
from statekit.formats.burnpack import Scalar
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

FORMAT = "burn-legacy"
NO_HYPERPARAMS = "burn optimizer files store no hyperparameters (lr, betas, eps, decay)"


def open_checkpoint(path: str, model: object = None, **options) -> Checkpoint:
    """Open a legacy record as a :class:`Checkpoint` (format ``burn-legacy``).

    ``model``: a model file path (legacy record or burnpack), a :class:`ModelInfo` or a model
    :class:`Checkpoint`; optimizer parameters get their module paths from it, joined on ParamId.
    """
    rec = read_legacy(path)
    return from_record(rec, path, model=model)


def from_record(rec: LegacyRecord, path: str | None = None, model: object = None) -> Checkpoint:
    """The Checkpoint for an already decoded :class:`LegacyRecord`."""
    path = path if path is not None else rec.path
    if model is not None and rec.kind != "optimizer":
        raise MappingError(f"a model file only applies to optimizer records, not to a {rec.kind} record", path)
    ckpt = Checkpoint(
        path=path,
        format=FORMAT,
        kind="tensors",
        version=rec.metadata.get("version"),
        metadata=dict(rec.metadata),
        container=rec,
    )
    if rec.kind == "optimizer":
        ckpt.kind = "optimizer"
        ckpt.optimizer = optimizer_state(rec.item, list(rec.notes))
        if model is not None:
            attach_paths(ckpt.optimizer, load_model_info(model))
        tensors = [v for p in ckpt.optimizer.params for v in (*p.slots.values(), *p.extra.values())
                   if isinstance(v, TensorRef)]
        ckpt.n_tensors = len(tensors)
        ckpt.nbytes = sum(t.nbytes for t in tensors)
        ckpt.n_scalars = sum(_scalar_count(p) for p in ckpt.optimizer.params)
    elif rec.kind == "model":
        ckpt.kind = "model"
        ckpt.model = model_info(rec.item)
        ckpt.n_tensors = len(ckpt.model.params)
        ckpt.nbytes = sum(p.tensor.nbytes for p in ckpt.model.params)
        ckpt.warnings.extend(rec.notes)
    elif rec.kind == "scheduler":
        ckpt.kind = "scheduler"
        ckpt.scalars, notes = scheduler_scalars(rec.item)
        ckpt.n_scalars = len(ckpt.scalars)
        ckpt.warnings.extend(rec.notes + notes)
    else:
        ckpt.warnings.extend(rec.notes or ["record item is neither an optimizer, a model nor a scheduler"])
    return ckpt


# ----------------------------------------------------------------------------- optimizer


def _scalar_count(p: ParamState) -> int:
    """Scalars the burnpack record of ``p`` holds: ``__rank``, the step, scalar extras."""
    return 1 + (p.step is not None) + sum(isinstance(v, Scalar) for v in p.extra.values())


def optimizer_state(opt: LegacyOptimizer, notes: list[str] | None = None) -> OptimizerState:
    """The neutral state of a legacy ``OptimizerAdaptor`` record (framework ``burn``)."""
    params: list[ParamState] = []
    families: set[str | None] = set()
    for entry in opt.entries:
        key = str(entry.id) if entry.id is not None else entry.display_id
        p = ParamState(key=key, id=entry.id, rank=entry.rank)
        fields = entry.fields
        lay = (naming.classify("burn", set(fields), exclude=naming.BURN_022_FAMILIES) if fields
               else naming.layout("burn", naming.BURN_STATELESS))
        if lay is None:
            p.extra = {leaf: _as_extra(value) for leaf, value in fields.items()}
            families.add(None)
        else:
            p.family = lay.family
            families.add(lay.family)
            for leaf, value in fields.items():
                if leaf == lay.step:
                    p.step = int(value)
                    p.extra["__step_kind"] = "UInt"  # burn's `time: usize`
                else:
                    p.slots[lay.slots[leaf]] = value
        params.append(p)
    state = OptimizerState(family=None, params=params, framework="burn", notes=list(notes or []))
    if len(families) == 1 and None not in families:
        family = families.pop()
        state.family = family
        candidates = (family, *naming.layout("burn", family).also)
        narrowed = tuple(f for f in candidates if f in opt.families)
        state.candidates = narrowed or candidates
    elif families:
        state.family = "mixed" if None not in families else None
        state.notes.append("parameters hold different optimizer layouts (several parameter groups?)")
    if state.family is None and params:
        state.notes.append("unrecognised state layout: fields are kept under their burn names")
    if len(state.candidates) > 1:
        state.notes.append(
            f"{' and '.join(state.candidates)} store identical state in burn; the file cannot tell them apart"
        )
    unresolved = [p.key for p in params if p.id is None]
    if unresolved:
        state.notes.append(
            f"{len(unresolved)} parameters have UUID-era ids whose u64 burn derived by hashing; "
            "a burnpack needs their ids from a model file"
        )
    state.notes.append(NO_HYPERPARAMS)
    state.groups = [ParamGroup(hyperparams={}, keys=[p.key for p in params])]
    return state


def _as_extra(value: object) -> object:
    """Unclassified leaves keep burnpack's representation: tensors as is, numbers as Scalars."""
    return value if isinstance(value, TensorRef) else Scalar.of(value)


def load_model_info(model: object) -> ModelInfo:
    """A :class:`ModelInfo` from a path (legacy record or burnpack), a Checkpoint or a ModelInfo."""
    if isinstance(model, ModelInfo):
        return model
    if isinstance(model, Checkpoint):
        if model.model is None:
            raise MappingError(f"{model.path} is a {model.kind} file, not a model", model.path)
        return model.model
    if isinstance(model, str | os.PathLike):
        from statekit.formats import registry

        with registry.open_checkpoint(os.fspath(model)) as ckpt:
            if ckpt.kind != "model" or ckpt.model is None:
                raise MappingError(f"a model record is needed for module paths, found a {ckpt.kind} file",
                                   os.fspath(model))
            return ckpt.model
    raise TypeError(f"model must be a path, Checkpoint or ModelInfo, not {type(model).__name__}")


def attach_paths(state: OptimizerState, model: ModelInfo) -> None:
    """Give each parameter its module path from ``model`` (joined on ParamId), noting misses."""
    by_id = model.by_id()
    if not by_id:
        raise MappingError("the model file has no ParamIds to join on (a burn model record is needed)")
    missing: list[str] = []
    for p in state.params:
        entry = by_id.get(p.id) if p.id is not None else None
        if entry is None:
            missing.append(p.label())
            continue
        p.path = entry.path
        if p.shape is not None and tuple(p.shape) != tuple(entry.shape):
            if tuple(p.shape) == tuple(reversed(entry.shape)) and len(p.shape) == 2:
                state.notes.append(
                    f"{entry.path}: state is {list(p.shape)} but the model record holds {list(entry.shape)} "
                    "(a Linear saved in column layout?)"
                )
            else:
                state.notes.append(
                    f"{entry.path}: state shape {list(p.shape)} differs from the model's {list(entry.shape)}"
                )
    if missing:
        shown = ", ".join(missing[:3]) + (", …" if len(missing) > 3 else "")
        state.notes.append(f"{len(missing)} parameters are not in the model record: {shown}")
    unused = len(by_id) - (len(state.params) - len(missing))
    if unused > 0:
        state.notes.append(f"{unused} model parameters have no optimizer state (frozen or never stepped)")


# ----------------------------------------------------------------------------- model / scheduler


def model_info(model: LegacyModel) -> ModelInfo:
    return ModelInfo([
        ModelParam(p.path, tuple(p.tensor.shape), p.tensor.dtype, id=p.id,
                   buffer=not dtypes.is_float(p.tensor.dtype), tensor=p.tensor)
        for p in model.params
    ], order="burn")


def scheduler_scalars(sched: LegacyScheduler) -> tuple[dict[str, object], list[str]]:
    """Scheduler state as named scalars (``<scheduler type>`` → value; composed:
    ``schedulers.<i>.<type>``) and a note when the record cannot tell the scheduler type."""
    out: dict[str, object] = {}
    notes: list[str] = []
    if sched.children:
        for i, child in enumerate(sched.children):
            for name, value in child.candidates.items():
                out[f"schedulers.{i}.{name}"] = value
        return out, notes
    for name, value in sched.candidates.items():
        if value is not None:
            out[name] = value
    if len(sched.candidates) > 1:
        notes.append(
            f"the state fits the {', '.join(sched.candidates)} schedulers; the record does not say which"
        )
    return out, notes
