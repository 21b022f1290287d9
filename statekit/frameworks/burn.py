"""burn 0.22 records in burnpack files ⇄ the neutral state model (the registry's ``burnpack`` entry).

An optimizer record (``shared/docs/burn-formats.md`` §2) stores, per parameter id ``P``, tensors
``P.<field path>`` (each with ``param_id = P``), scalars ``P.__rank`` and e.g. ``P.momentum.time``,
and string metadata ``P → module path``. Model records store one tensor per module path with its
``param_id``; scheduler records store only scalars; L-BFGS stores one global state without ids.
"""

from __future__ import annotations

from functools import cache

from statekit import dtypes, hyper, naming, paramid
from statekit.errors import FormatError, MappingError
from statekit.formats import limits
from statekit.formats.burnpack import BurnpackFile, PackTensor, Scalar, copy_burnpack, write_burnpack
from statekit.lazy import numpy as np
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

FORMAT = "burnpack"
# A step count for families whose burn state has none (RMSProp): kept as an extra scalar, which
# burn ignores on load, so that torch → burn → torch keeps torch's counter.
STEP_KEY = "statekit.step"


def _split(name: str) -> tuple[str, str] | None:
    head, dot, rest = name.partition(".")
    if dot and rest and _is_id(head):
        return head, rest
    return None


#: is_decimal_id once per distinct head: an optimizer record names each parameter id 4–6 times
_is_id = cache(paramid.is_decimal_id)


def _kind(pack: BurnpackFile) -> str:
    names = list(pack.tensors) + list(pack.scalars)
    if not names:
        return "empty"
    if set(naming.BURN_GLOBAL_FAMILIES["lbfgs"]) <= set(pack.scalars):
        return "optimizer"
    if all(_split(n) for n in names) and any(n.endswith("." + naming.BURN_RANK) for n in pack.scalars):
        return "optimizer"
    if not pack.tensors:
        return "scheduler"
    if all(e.param_id is not None for e in pack.tensors.values()) and not any(_split(n) for n in pack.tensors):
        return "model"
    return "tensors"


def read(pack: BurnpackFile) -> Checkpoint:
    """Interpret an opened burnpack file (does not read tensor data)."""
    kind = _kind(pack)
    ckpt = Checkpoint(
        path=pack.path,
        format=FORMAT,
        kind=kind,
        version=pack.version,
        n_tensors=len(pack.tensors),
        n_scalars=len(pack.scalars),
        nbytes=sum(e.nbytes for e in pack.tensors.values()),
        container=pack,
    )
    if pack.layout != "aligned":
        ckpt.warnings.append("burn 0.19 layout: tensor data is not 256-byte aligned (read as such)")
    if pack.trailing_bytes:
        ckpt.warnings.append(f"{pack.trailing_bytes} bytes follow the last tensor (burn writes none)")
    if not pack.canonical:
        ckpt.warnings.append("metadata is not encoded as burn encodes it; a rewrite will differ in bytes")
    if kind == "optimizer":
        if set(naming.BURN_GLOBAL_FAMILIES["lbfgs"]) <= set(pack.scalars):
            ckpt.optimizer = _read_lbfgs(pack)
        else:
            ckpt.optimizer = _read_optimizer(pack)
        ckpt.metadata = {k: v for k, v in pack.metadata.items() if not paramid.is_decimal_id(k)}
    elif kind == "model":
        ckpt.model = ModelInfo(
            [
                ModelParam(n, pack.tensors[n].shape, pack.tensors[n].dtype, id=pack.tensors[n].param_id,
                           tensor=pack.tensor(n))
                for n in pack.data_order
            ],
            order="burn",
        )
        ckpt.metadata = dict(pack.metadata)
    else:
        ckpt.metadata = dict(pack.metadata)
        ckpt.scalars = {k: v.value for k, v in pack.scalars.items()}
    return ckpt


def _read_optimizer(pack: BurnpackFile) -> OptimizerState:
    params: dict[str, ParamState] = {}
    fields: dict[str, dict[str, object]] = {}

    def param(key: str) -> ParamState:
        p = params.get(key)
        if p is None:
            p = params[key] = ParamState(key=key, id=int(key), path=pack.metadata.get(key))
            fields[key] = {}
        return p

    for name in pack.data_order:  # data order = the order burn wrote (its hash map's)
        key, _, leaf = name.partition(".")  # every name splits so (_kind checked it: an optimizer)
        pid = pack.tensors[name].param_id
        if param(key).id != pid and pid is not None:
            raise FormatError(f"tensor {name!r} carries param_id {pid}, not {key}", pack.path)
        fields[key][leaf] = pack.tensor(name)
    for name, scalar in pack.scalars.items():
        key, _, leaf = name.partition(".")
        p = param(key)
        if leaf == naming.BURN_RANK:
            p.rank = _rank(scalar, name, pack.path)
        elif leaf == STEP_KEY:
            p.step = scalar.value  # a step burn's layout has no field for, kept by statekit
        else:
            fields[key][leaf] = scalar
    state = _classified(params, fields)
    stored_family, hp = hyper.from_metadata(pack.metadata)
    state.hyperparams_stored = bool(hp)
    if stored_family and stored_family in state.candidates and len(state.candidates) > 1:
        for p in params.values():  # each parameter's family too (burn's Adam layout is also AdamW's)
            if p.family in state.candidates:
                p.family = stored_family
        state.family, state.candidates = stored_family, (stored_family,)
        state.notes = [n for n in state.notes if "cannot tell them apart" not in n]
        state.notes.append(f"family {stored_family} recorded by statekit in the file's metadata")
    stored_groups = hyper.groups_from_metadata(pack.metadata)
    if stored_groups:  # several parameter groups, kept by statekit (burn itself has none in the file)
        state.groups = [ParamGroup(hyperparams=g, keys=[k for k in keys if k in params]) for g, keys in stored_groups]
        for index, group in enumerate(state.groups):
            for key in group.keys:
                params[key].group = index
        grouped = {k for g in state.groups for k in g.keys}
        state.groups[0].keys += [k for k in params if k not in grouped]
        _group_families(state, params, hyper.group_families_from_metadata(pack.metadata))
    else:
        state.groups = [ParamGroup(hyperparams=hp, keys=list(params))]
    # torch's param_names, kept by statekit in torch's order: the torch positions too
    for position, (key, path) in enumerate(hyper.paths_from_metadata(pack.metadata).items()):
        if key in params and params[key].path in (None, path):
            params[key].path = path
            params[key].index = position
    return state



def _group_families(state: OptimizerState, params: dict[str, ParamState], families: list[str | None]) -> None:
    """Groups statekit stored with their optimizer (a Muon run's Muon and AdamW groups): each
    parameter takes its group's, where its fields allow it (burn's velocity is SGD's or Muon's)."""
    if not any(families):
        return
    for index, group in enumerate(state.groups):
        family = families[index] if index < len(families) else None
        for key in group.keys:
            p = params[key]
            if family and p.family and (p.family == family or family in naming.layout("burn", p.family).also):
                p.family = family
                p.extra["__family_settled"] = True
    fams = {p.family for p in params.values()}
    if len(fams) == 1 and None not in fams:
        state.family = fams.pop()
        state.candidates = (state.family,)
    else:
        state.family = "mixed" if None not in fams else None
        state.candidates = ()
    state.notes = [n for n in state.notes if "cannot tell them apart" not in n]
    state.notes.append("each group's optimizer recorded by statekit in the file's metadata: "
                       + ", ".join(f"group {i} {f}" for i, f in enumerate(families) if f))


def _classified(params: dict[str, ParamState], fields: dict[str, dict[str, object]]) -> OptimizerState:
    """Each parameter's burn fields matched to a layout (naming.BURN); the state's family and notes."""
    families = set()
    for key, p in params.items():
        leaves = fields[key]
        if not leaves:
            lay = naming.layout("burn", naming.BURN_STATELESS)
        else:
            lay = naming.classify("burn", set(leaves))
        if lay is None:
            p.extra = dict(leaves)
            families.add(None)
            continue
        p.family = lay.family
        families.add(lay.family)
        for leaf, value in leaves.items():
            if leaf == lay.step:
                p.step = value.value
                p.extra["__step_kind"] = value.kind
            elif leaf in lay.slots:
                p.slots[lay.slots[leaf]] = value
        for slot, leaf in lay.alias.items():  # Adafactor: a 1-D parameter's second_moment is unfactored
            factored = lay.slots[leaf]
            if factored in p.slots and len(p.slots) == 1 and len(p.slots[factored].shape) <= 1:
                p.slots[slot] = p.slots.pop(factored)
        if p.rank is None and p.shape is not None:
            p.rank = len(p.shape)
    state = OptimizerState(family=None, params=list(params.values()), framework="burn")
    if len(families) == 1 and None not in families:
        family = families.pop()
        state.family = family
        state.candidates = (family, *naming.layout("burn", family).also)
    elif families:
        state.family = "mixed" if None not in families else None
        state.notes.append("parameters hold different optimizer layouts (several parameter groups?)")
    if state.family is None:
        state.notes.append("unrecognised state layout: fields are kept under their burn names")
    if len(state.candidates) > 1:
        state.notes.append(
            f"{' and '.join(state.candidates)} store identical state in burn; the file cannot tell them apart"
        )
    return state


def _read_lbfgs(pack: BurnpackFile) -> OptimizerState:
    state = OptimizerState(family="lbfgs", candidates=("lbfgs",), framework="burn")
    state.global_slots = {n: pack.tensor(n) for n in pack.data_order}
    state.global_scalars = {k: v.value for k, v in pack.scalars.items()}
    state.notes.append("L-BFGS keeps one global state over all parameters, tied to parameter order")
    family, hp = hyper.from_metadata(pack.metadata)  # torch's LBFGS group, kept by statekit
    if family == "lbfgs" and hp:
        state.groups = [ParamGroup(hyperparams=hp, keys=[])]
        state.hyperparams_stored = True
    return state


# ----------------------------------------------------------------------------- writing


def to_pack(state: OptimizerState, metadata: dict[str, str] | None = None):
    """The tensors, string metadata and scalars of a burn 0.22 optimizer record for ``state``.

    Raises :class:`MappingError` naming the parameter and field when the state cannot be expressed
    in burn (a slot burn has no field for, a parameter without a ParamId).
    """
    if state.family == "lbfgs":
        tensors = [PackTensor(n, ref) for n, ref in state.global_slots.items()]
        scalars = {k: Scalar.of(v) for k, v in state.global_scalars.items()}
        return tensors, dict(metadata or {}), scalars
    tensors: list[PackTensor] = []
    strings: dict[str, str] = dict(metadata or {})
    scalars: dict[str, Scalar] = {}
    for p in state.params:
        if p.id is None:
            raise MappingError(f"parameter {p.label()} has no burn ParamId (give --model MODEL.bpk)")
        key = str(p.id)
        family = p.family or state.family
        if not p.slots and not p.extra and p.step is None and family not in (None, "mixed", naming.BURN_STATELESS):
            continue  # never stepped (a frozen parameter): burn creates its state at the first step
        if family is None or family == "mixed":
            for leaf, value in p.extra.items():
                _put(tensors, scalars, key, leaf, value, p.id)
        else:
            lay = naming.layout("burn", family)
            native = {neutral: leaf for leaf, neutral in lay.slots.items()} | lay.alias
            for slot, ref in p.slots.items():
                if slot not in native:
                    raise MappingError(f"parameter {p.label()}: burn's {family} state has no field for {slot!r}")
                tensors.append(PackTensor(f"{key}.{native[slot]}", ref, param_id=p.id))
            if lay.step is None and p.step is not None and float(p.step) == int(p.step) and p.step >= 0:
                scalars[f"{key}.{STEP_KEY}"] = Scalar("UInt", int(p.step))
            elif lay.step is not None:
                if p.step is None:
                    raise MappingError(f"parameter {p.label()}: burn's {family} state needs a step count")
                if float(p.step) != int(p.step) or p.step < 0:
                    raise MappingError(f"parameter {p.label()}: step {p.step} is not a whole count")
                scalars[f"{key}.{lay.step}"] = Scalar(p.extra.get("__step_kind", "UInt"), int(p.step))
        rank = p.rank if p.rank is not None else (len(p.shape) if p.shape is not None else None)
        if rank is None:
            raise MappingError(f"parameter {p.label()}: rank unknown")
        scalars[f"{key}.{naming.BURN_RANK}"] = Scalar("UInt", rank)
        if p.path:
            strings[key] = p.path
    return tensors, strings, scalars


def _put(tensors, scalars, key, leaf, value, pid) -> None:
    if isinstance(value, Scalar):
        scalars[f"{key}.{leaf}"] = value
    elif leaf.startswith("__"):
        return
    else:
        tensors.append(PackTensor(f"{key}.{leaf}", value, param_id=pid))


def _rank(scalar, name: str, path: str) -> int:
    """A ``__rank`` scalar's value: an integer from 0 to the rank limit (burn writes a UInt)."""
    value = scalar.value
    if not limits.is_finite_integral(value) or not 0 <= value <= limits.MAX_RANK:
        raise FormatError(f"scalar {name!r} is {value!r}, not a tensor rank (0 to {limits.MAX_RANK})", path)
    return int(value)


def with_derived_slots(family: str | None, slots: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """``slots`` with what burn stores beside them: RMSProp's ``centered.avg`` = square_avg −
    grad_avg² (or square_avg), computed piece by piece when written."""
    if family != "rmsprop" or "avg" in slots or "square_avg" not in slots:
        return slots
    from statekit import stream  # writing only: reading a burnpack never loads it

    sa, ga = slots["square_avg"], slots.get("grad_avg")
    if ga is not None:
        avg = stream.combine([sa, ga], lambda square, g: square - g * g, sa.dtype)
    else:
        avg = stream.combine([sa], np.array, sa.dtype)

    ordered = {"square_avg": sa}
    if ga is not None:
        ordered["grad_avg"] = ga
    ordered["avg"] = avg
    ordered.update({k: v for k, v in slots.items() if k not in ordered})
    return ordered


# ----------------------------------------------------------------------------- the registry's entry points


def open_checkpoint(path: str, **options) -> Checkpoint:
    return read(BurnpackFile(path))


def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write ``state`` as a burn 0.22 optimizer record. burn keeps no hyperparameters or groups
    (``groups`` is not stored); ``metadata`` (e.g. statekit.* keys) is stored as extra string
    metadata, which burn ignores. Every parameter has its own step, so ``step_policy`` has
    nothing to decide."""
    if family is not None and state.family != family:
        state.family = family
    tensors, strings, scalars = to_pack(state, metadata)
    return write_burnpack(path, tensors, strings, scalars, progress=progress)


def save_model(model: ModelInfo, path: str, *, dtype: str | None = None, metadata: dict[str, str] | None = None,
               progress=None) -> int:
    """Write a model as a burn 0.22 burnpack model record: one tensor per module path with its
    ``param_id``, in record order. ``dtype`` casts float tensors (``"F32"`` for half-precision
    records); integer and bool tensors are kept. Returns the file size."""
    if dtype is not None and not dtypes.is_float(dtype):
        raise MappingError(f"cannot cast model tensors to {dtype}: not a float dtype")
    tensors: list[PackTensor] = []
    for p in model.params:
        if p.tensor is None:
            raise MappingError(f"model parameter {p.path} has no tensor data")
        if p.id is None:
            raise MappingError(f"model parameter {p.path} has no burn ParamId")
        ref = p.tensor
        if dtype is not None and dtypes.is_float(ref.dtype):
            ref = ref.cast(dtype)
        tensors.append(PackTensor(p.path, ref, param_id=p.id))
    return write_burnpack(path, tensors, dict(metadata or {}), {}, progress=progress)


def save_checkpoint(ckpt: Checkpoint, path: str, progress=None) -> int:
    """Write a checkpoint as burnpack; a burnpack source is copied exactly as burn wrote it."""
    if isinstance(ckpt.container, BurnpackFile):
        return copy_burnpack(ckpt.container, path, progress=progress)
    if ckpt.kind == "optimizer" and ckpt.optimizer is not None:
        return save_optimizer(ckpt.optimizer, path, metadata=ckpt.metadata, progress=progress)
    raise MappingError(f"cannot write a {ckpt.format} {ckpt.kind} file as burnpack yet", ckpt.path)
