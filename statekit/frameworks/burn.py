"""burn 0.22 records in burnpack files ⇄ the neutral state model (the registry's ``burnpack`` entry).

An optimizer record (``shared/docs/burn-formats.md`` §2) stores, per parameter id ``P``, tensors
``P.<field path>`` (each with ``param_id = P``), scalars ``P.__rank`` and e.g. ``P.momentum.time``,
and string metadata ``P → module path``. Model records store one tensor per module path with its
``param_id``; scheduler records store only scalars; L-BFGS stores one global state without ids.
"""

from __future__ import annotations

import json
from functools import cache

from statekit import dtypes, hyper, naming, paramid
from statekit.errors import FormatError, MappingError
from statekit.formats import limits
from statekit.formats.burnpack import BurnpackFile, PackTensor, Scalar, copy_burnpack, write_burnpack
from statekit.frameworks import base
from statekit.lazy import numpy as np
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState, regroup
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
    if kind == "scheduler":
        from statekit.errors import StatekitError
        from statekit.frameworks import schedule_burn

        try:
            ckpt.schedule = schedule_burn.read_pack(pack)
        except StatekitError as exc:
            ckpt.warnings.append(f"not read as an LR scheduler record: {exc.message}")
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
    if stored_family and any(stored_family in p.candidates for p in params.values()):
        state.resolved([stored_family])  # each parameter's family too (burn's Adam layout is also AdamW's)
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
        for group in state.groups:  # a family per group where its parameters agree
            fams = {params[k].family for k in group.keys}
            if len(fams) == 1 and state.family == "mixed":
                group.family = fams.pop()
    else:
        for group in state.groups:  # one group per family (regroup), the stored hyperparameters on each
            group.hyperparams = dict(hp)
    if hyper.TORCH_NAMES_KEY in pack.metadata:
        state.torch_names_in_file = pack.metadata[hyper.TORCH_NAMES_KEY] != "0"
    args = hyper.training_args_from_metadata(pack.metadata)
    if args is not None:
        state.training_args = args
    _library_record(state, params, pack.metadata.get(hyper.LIBRARY_KEY))
    # torch's param_names, kept by statekit in torch's order: the torch positions too
    for position, (key, path) in enumerate(hyper.paths_from_metadata(pack.metadata).items()):
        if key in params:  # the torch name may differ from burn's path (a norm's weight is burn's gamma)
            params[key].path = params[key].path or path
            params[key].index = position
    return state



def _library_record(state: OptimizerState, params: dict, text: str | None) -> None:
    """The optimizer library a torch state came from (bitsandbytes), as the .bpk records it: its layout
    and how it stored each parameter, for writing that layout back (hyper.LIBRARY_KEY)."""
    if not text:
        return
    try:
        record = json.loads(text)
        fmt, stored = record["format"], record.get("stored", {})
        state.library_format = fmt if isinstance(fmt, str) else None
        for key, (bits, block) in stored.items():
            if key in params:
                params[key].stored_as = (int(bits), None if block is None else int(block))
    except (ValueError, KeyError, TypeError):
        state.notes.append(f"unreadable {hyper.LIBRARY_KEY} metadata: the way back writes torch's layout")
        state.library_format = None

def _group_families(state: OptimizerState, params: dict[str, ParamState], families: list[str | None]) -> None:
    """Groups statekit stored with their optimizer (a Muon run's Muon and AdamW groups): each
    parameter takes its group's, where its fields allow it (burn's velocity is SGD's or Muon's)."""
    if not any(families):
        return
    for index, group in enumerate(state.groups):
        family = families[index] if index < len(families) else None
        for key in group.keys:
            p = params[key]
            if family and p.family and (p.family == family or family in p.candidates):
                p.family, p.candidates = family, ()
        group.family, group.candidates = family, ()
    regroup(state)
    if state.family == "mixed":
        for index, group in enumerate(state.groups):
            group.family = families[index] if index < len(families) else None
    state.notes = [n for n in state.notes if "cannot tell them apart" not in n and "one optimizer per" not in n]
    state.notes.append("each group's optimizer recorded by statekit in the file's metadata: "
                       + ", ".join(f"group {i} {f}" for i, f in enumerate(families) if f))


def _classified(params: dict[str, ParamState], fields: dict[str, dict[str, object]]) -> OptimizerState:
    """Each parameter's burn fields matched to a layout (naming.BURN); the state's family, its
    groups (one per family: burn's ``ModuleOptimizer::with_group`` gives each parameter its own
    optimizer, Muon for the matrices and AdamW for the rest) and notes."""
    unknown = 0
    for key, p in params.items():
        leaves = fields[key]
        if not leaves:
            lay = naming.layout("burn", naming.BURN_STATELESS)
        else:
            lay = naming.classify("burn", set(leaves))
        if lay is not None and not _kinds_fit(lay, leaves):
            lay = None  # the names fit, the kinds do not (a scalar where burn keeps a tensor)
        for leaf, value in leaves.items():
            if lay is not None and leaf == lay.step:
                p.step = value.value
                p.extra["__step_kind"] = value.kind
            elif lay is not None and leaf in lay.slots:
                p.slots[lay.slot_of(leaf, p.rank if p.rank is not None else len(value.shape))] = value
            else:
                p.extra[leaf] = value
        if p.rank is None and p.shape is not None:
            p.rank = len(p.shape)
        why = None if lay is None else _inconsistent(lay.family, p)
        if lay is None or why:
            p.slots, p.step = {}, None
            p.extra = dict(leaves)
            unknown += 1
            if why:
                p.extra["__why"] = why
            continue
        p.family = lay.family
        candidates = lay.candidates(p.rank)
        p.candidates = candidates if len(candidates) > 1 else ()
    state = OptimizerState(family=None, params=list(params.values()), framework="burn",
                           groups=[ParamGroup(keys=list(params))])
    regroup(state)
    if unknown:
        known = {p.family for p in state.params if p.family}
        state.family = "mixed" if known else None
        whys = sorted({p.extra["__why"] for p in state.params if "__why" in p.extra})
        state.notes.append(f"{unknown} parameter(s) hold a state layout statekit does not recognise: "
                           "their fields are kept under their burn names" + (f" ({'; '.join(whys)})" if whys else ""))
    elif state.family == "mixed":
        shown = ", ".join(f"{g.family_label} ({len(g.keys)} params)" for g in state.groups)
        state.notes.append(f"the record holds one optimizer per parameter group (burn's with_group): {shown}")
    if len(state.candidates) > 1:  # one family, which burn stores as another's too (text kept as written before)
        state.notes.append(
            f"{' and '.join(state.candidates)} store identical state in burn; the file cannot tell them apart"
        )
    elif state.family == "mixed":
        for cands in dict.fromkeys(g.candidates for g in state.groups if len(g.candidates) > 1):
            lay = naming.layout("burn", cands[0])
            limit = "".join(f"; {f} holds only {'/'.join(map(str, sorted(lay.ranks[f])))}-D parameters"
                            for f in cands if f in lay.ranks)
            state.notes.append(f"{' and '.join(cands)} store identical state in burn; the file cannot tell them apart "
                               f"(say --optimizer {'|'.join(cands)}, for that part only{limit})")
    return state


def _kinds_fit(lay, leaves: dict[str, object]) -> bool:
    """The step is a scalar and every other field a tensor, as burn's state struct has them."""
    return all(isinstance(v, Scalar) == (leaf == lay.step) for leaf, v in leaves.items())


def _inconsistent(family: str, p: ParamState) -> str | None:
    """Why a parameter's fields, though named as ``family``'s, cannot be its state: burn's
    Adafactor keeps a row factor [..., rows, 1] and a column factor [..., 1, cols] for D ≥ 2 and one
    full second moment for D = 1 (its step would panic on anything else)."""
    if family != "adafactor":
        return None
    row, col = p.slots.get("row_var", p.slots.get("variance")), p.slots.get("col_var")
    rank = p.rank
    if col is None:
        if rank is not None and rank >= 2 or "row_var" in p.slots:
            return f"{p.label()}: a {rank}-D Adafactor state without column_second_moment"
        return None
    if row is None or "variance" in p.slots:
        return f"{p.label()}: a column_second_moment for a vector's Adafactor state"
    r, c = tuple(row.shape), tuple(col.shape)
    if len(r) < 2 or len(r) != len(c) or r[-1] != 1 or c[-2] != 1 or r[:-2] != c[:-2] or (
            rank is not None and rank != len(r)):
        return f"{p.label()}: Adafactor factors second_moment {list(r)} and column_second_moment {list(c)} do not fit"
    return None


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
            native = lay.native_of()
            for slot, ref in p.slots.items():
                if slot not in native:
                    raise MappingError(f"parameter {p.label()}: burn's {family} state has no field for {slot!r}")
                tensors.append(PackTensor(f"{key}.{native[slot]}", ref, param_id=p.id))
            if lay.step is None and p.step is not None:  # a whole count (base.optimizer_writer checked)
                scalars[f"{key}.{STEP_KEY}"] = Scalar("UInt", int(p.step))
            elif lay.step is not None:
                if p.step is None:
                    raise MappingError(f"parameter {p.label()}: burn's {family} state needs a step count")
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


@base.optimizer_writer
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
