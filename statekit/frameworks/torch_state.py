"""PyTorch ``torch.optim`` state_dicts ⇄ the neutral state model.

A state_dict is ``{"state": {int: {name: value}}, "param_groups": [{hyperparameters..., "params":
[int], ["param_names": [str]]}]}``; ids number parameters across groups in group order, and
torch pairs them with live parameters *by position* (torch-candle-numerics.md §1.1, §1.4). This
module reads such dicts (also inside a training checkpoint) and builds them, knowing nothing of
the ``.pt`` container.
"""

from __future__ import annotations

import numpy as np

from statekit import naming
from statekit.errors import FormatError, MappingError
from statekit.formats import limits
from statekit.formats.torch_pickle import WrapperTensor
from statekit.frameworks import bnb, torch_families, torch_thirdparty
from statekit.state import ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState, model_param
from statekit.tensor import TensorRef

LIGHTNING_OPTIMIZERS = "optimizer_states"  # Lightning .ckpt: a list, one state_dict per optimizer
MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module", "net")
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
_FLOATS = frozenset(("F64", "F32", "F16", "BF16"))
MAX_EXACT_STEP = 2**24  # float32 holds integers exactly up to here
# burn 0.22's optimizers that torch also has (LAMB, Lion and Adan are burn's alone)
BURN_FAMILIES = frozenset({"adam", "adamw", "sgd", "rmsprop", "adagrad", "adafactor", "muon", "lbfgs"})
STEP_NOT_IN_UPDATE = frozenset({"rmsprop"})  # torch counts steps there but its update never reads it


def is_optimizer_dict(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("param_groups"), list) and isinstance(obj.get("state"), dict)


def is_tensor_dict(obj: object) -> bool:
    # by the types present (C-level passes: a state_dict may hold 10^6 tensors)
    return (isinstance(obj, dict) and bool(obj) and all(issubclass(t, str) for t in set(map(type, obj)))
            and all(issubclass(t, TensorRef) for t in set(map(type, obj.values()))))


def find_optimizer(obj: object, key: str | None, path: str) -> tuple[dict | None, str | None]:
    """The optimizer state_dict in ``obj`` (itself, or one entry of a checkpoint dict)."""
    if key is not None:
        node = obj
        for part in key.split("."):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                continue
            if not isinstance(node, dict) or part not in node:
                raise FormatError(f"no entry {key!r} in the checkpoint ({_present(obj)})", path)
            node = node[part]
        if isinstance(node, list) and len(node) == 1 and is_optimizer_dict(node[0]):
            return node[0], f"{key}.0"
        if not is_optimizer_dict(node):
            kind = type(node).__name__
            raise FormatError(f"entry {key!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not an optimizer state_dict "
                              f"({_present(obj)})", path)
        return node, key
    if is_optimizer_dict(obj):
        return obj, None
    if not isinstance(obj, dict):
        return None, None
    listed = obj.get(LIGHTNING_OPTIMIZERS)
    if isinstance(listed, list) and listed and all(is_optimizer_dict(o) for o in listed):
        if len(listed) > 1:
            keys = ", ".join(f"{LIGHTNING_OPTIMIZERS}.{i}" for i in range(len(listed)))
            raise FormatError(f"{len(listed)} optimizer states in the checkpoint ({keys}); choose one with --key", path)
        return listed[0], f"{LIGHTNING_OPTIMIZERS}.0"
    found = ([k for k, v in obj.items() if isinstance(v, dict) and is_optimizer_dict(v)]
             if any(issubclass(kind, dict) for kind in set(map(type, obj.values()))) else [])  # (types: C-level)
    if len(found) > 1:
        raise FormatError(
            f"several optimizer state_dicts in the checkpoint ({', '.join(map(str, found))}); choose one with --key",
            path,
        )
    return (obj[found[0]], str(found[0])) if found else (None, None)


def _present(obj: object, limit: int = 8) -> str:
    """What a --key could name: the top-level keys, those holding optimizer state first."""
    if not isinstance(obj, dict):
        return f"the file holds a {type(obj).__name__}, not a dict of entries"
    keys = [str(k) for k in obj]
    good = [str(k) for k, v in obj.items() if is_optimizer_dict(v) or (
        isinstance(v, list) and v and all(is_optimizer_dict(o) for o in v))]
    shown = ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")
    hint = f"; optimizer state under: {', '.join(good)}" if good else "; none holds an optimizer state_dict"
    return f"keys present: {shown or 'none'}{hint}"


def find_model(obj: object) -> dict | None:
    """A model state_dict (name → tensor) in ``obj``, itself or under a usual checkpoint key."""
    if is_tensor_dict(obj):
        return obj
    if isinstance(obj, dict):
        for key in MODEL_KEYS:
            if is_tensor_dict(obj.get(key)):
                return obj[key]
    return None


def is_buffer(name: str, ref: TensorRef) -> bool:
    """Buffers in a state_dict (BatchNorm statistics, integer tensors) are not parameters."""
    return ref.dtype not in _FLOATS or name.rpartition(".")[2] in BUFFER_SUFFIXES


def read_model(sd: dict) -> ModelInfo:
    params: list[ModelParam] = []
    append, new, index = params.append, model_param, 0
    for name, ref in sd.items():
        buf = ref.dtype not in _FLOATS or name.rpartition(".")[2] in BUFFER_SUFFIXES  # is_buffer(), inline
        append(new(name, tuple(ref.shape), ref.dtype, None if buf else index, buf, ref))
        index += 0 if buf else 1
    return ModelInfo(params, order="named_parameters")


def _step_value(value: object, where: str, path: str) -> tuple[float | int, str]:
    if isinstance(value, TensorRef):
        if value.numel != 1:
            raise FormatError(f"{where}: step has {value.numel} elements, expected one", path)
        return value.numpy().reshape(-1)[0].item(), value.dtype
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value, "python"
    raise FormatError(f"{where}: step is {type(value).__name__}, expected a number or 0-dim tensor", path)


def _field_names(entry: dict, idx: int, path: str) -> set[str]:
    odd = [k for k in entry if not isinstance(k, str)]  # (a None key is one: no None sentinel)
    if odd:  # torch.optim names every state field by a string
        raise FormatError(f"state[{idx}] has a key that is not a string: {limits.short(odd[0])}; torch's "
                          f"optimizers name state fields by strings", path)
    return set(entry)


def read_optimizer(sd: dict, path: str) -> OptimizerState:
    """Interpret a torch optimizer state_dict (no tensor data is read, except 0-dim steps)."""
    state_map = sd["state"]
    if bnb.is_bnb(state_map):
        return bnb.read_optimizer(sd, path, _step_value)
    notes: list[str] = []
    if any(isinstance(k, str) for k in state_map):
        notes.append("state is keyed by strings: torch ignores such entries on load and restarts from step 1")
    params: list[ParamState] = []
    groups: list[ParamGroup] = []
    seen: set[int] = set()
    per_group_fields: list[list[set[str]]] = []
    raw_groups: list[dict] = []
    for g, group in enumerate(sd["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise FormatError(f"param_groups[{g}] has no 'params' list", path)
        ids = group["params"]
        names = group.get("param_names")
        if names is not None and (not isinstance(names, list) or len(names) != len(ids)):
            raise FormatError(f"param_groups[{g}]: param_names does not match params", path)
        odd = [k for k in group if not isinstance(k, str)]  # (a None key is one: no None sentinel)
        if odd:  # torch.optim names every hyperparameter by a string
            raise FormatError(f"param_groups[{g}] has a key that is not a string: {limits.short(odd[0])}; torch's "
                              f"optimizers name hyperparameters by strings", path)
        hp = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        keys = []
        fields_here: list[set[str]] = []
        for pos, idx in enumerate(ids):
            if not isinstance(idx, int) or idx in seen:
                raise FormatError(f"param_groups[{g}]: parameter id {idx!r} is not a fresh integer", path)
            seen.add(idx)
            p = ParamState(key=str(idx), index=idx, path=names[pos] if names else None, group=g)
            entry = state_map.get(idx, state_map.get(str(idx)))
            if entry is not None:
                if not isinstance(entry, dict):
                    raise FormatError(f"state[{idx}] is not a dict", path)
                fields_here.append(_field_names(entry, idx, path))
                for name, value in entry.items():
                    if name == "step":
                        p.step, p.extra["__step_dtype"] = _step_value(value, f"state[{idx}]", path)
                    elif isinstance(value, TensorRef) and value.shape == () and name == "mu_product":
                        p.slots[name] = value
                    elif isinstance(value, TensorRef):
                        p.slots[name] = value
                    elif isinstance(value, WrapperTensor):  # torchao's quantized moments, dequantized lazily
                        p.slots[name] = torch_thirdparty.wrapper_slot(value, f"state[{idx}].{name}", path)
                    else:
                        p.extra[name] = value
                if p.shape is not None:
                    p.rank = len(p.shape)
            params.append(p)
            keys.append(p.key)
        per_group_fields.append(fields_here)
        raw_groups.append(group)
        groups.append(ParamGroup(hyperparams=hp, keys=keys))
    verdict = torch_families.classify(raw_groups, per_group_fields)
    foreign = None if verdict.family else torch_thirdparty.identify(sd, path)
    for p in params:
        p.family = verdict.family
    if verdict.family and verdict.family not in BURN_FAMILIES:
        notes.append(f"burn has no {torch_families.class_name(verdict.family).split('.')[-1]} optimizer: "
                     "this state can move to other torch files, not to burn")
    _note_extra_ids(state_map, seen, notes)
    state = OptimizerState(
        family=verdict.family,
        candidates=(verdict.family,) if verdict.family else verdict.candidates,
        params=params,
        groups=groups,
        hyperparams_stored=True,
        framework="torch",
        notes=notes,
        family_detail=None if verdict.family else verdict.label,
        torch_names_in_file=bool(params) and all(p.path for p in params),
    )
    if verdict.family == "lbfgs":  # one global state, filed under the first parameter
        state.global_slots, state.global_scalars = _lbfgs_global(params, path, notes)
    if foreign is not None:  # an optimizer from outside torch.optim (transformers, torchao, …)
        torch_thirdparty.settle(foreign, state, sd, path)
    return state


def _note_extra_ids(state_map: dict, seen: set, notes: list[str]) -> None:
    extra_ids = [k for k in state_map if (k if isinstance(k, int) else -1) not in seen and not isinstance(k, str)]
    if extra_ids:
        notes.append(f"state has entries for ids in no group: {extra_ids} (torch keeps but never uses them)")


LBFGS_LISTS = ("old_dirs", "old_stps", "ro")  # lists of tensors (y, s, 1/(y·s)); "al" is scratch
LBFGS_SCRATCH = "al"


def _lbfgs_global(params: list[ParamState], path: str, notes: list[str]) -> tuple[dict[str, TensorRef], dict]:
    """torch LBFGS's one state (under its first parameter) as global state: tensors by name
    (``old_dirs.0`` …, ``d``, ``prev_flat_grad``, ``H_diag`` or ``t`` when they are tensors) and
    scalars (``n_iter``, ``func_evals``, ``t``, ``prev_loss``, ``H_diag`` before any pair, each
    list's ``.len``); torch's scratch ``al`` is left out (rebuilt before it is read)."""
    notes.append("L-BFGS keeps one global state over all parameters (torch files it under the first parameter), "
                 "tied to parameter order")
    slots: dict[str, TensorRef] = {}
    scalars: dict[str, object] = {}
    holders = [p for p in params if p.slots or len(p.extra) > 1 or (p.extra and "__step_dtype" not in p.extra)]
    if len(holders) > 1:
        raise FormatError(f"LBFGS state under {len(holders)} parameters; torch keeps it under the first only", path)
    for p in holders:
        fields = {**p.slots, **{k: v for k, v in p.extra.items() if not k.startswith("__")}}
        for name, value in fields.items():
            if name == LBFGS_SCRATCH:
                continue
            if name in LBFGS_LISTS:
                if not isinstance(value, list | tuple) or not all(isinstance(v, TensorRef) for v in value):
                    raise FormatError(f"LBFGS state {name} is not a list of tensors", path)
                scalars[f"{name}.len"] = len(value)
                for i, ref in enumerate(value):
                    slots[f"{name}.{i}"] = ref
            elif isinstance(value, TensorRef):
                slots[name] = value
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise FormatError(f"LBFGS state {name} is a {type(value).__name__}, not a number or tensor", path)
            else:
                scalars[name] = value
        p.slots, p.extra = {}, {}
    return slots, scalars


def describe_scheduler(sd: object) -> dict:
    """The JSON-able part of an LR scheduler's state_dict (``last_epoch``, ``base_lrs``, …)."""
    if not isinstance(sd, dict):
        return {"value": type(sd).__name__}
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, TensorRef):
            out[k] = f"tensor {list(v.shape)} {v.dtype}"
        elif isinstance(v, bool | int | float | str) or v is None:
            out[k] = v
        elif isinstance(v, list | tuple) and all(isinstance(x, bool | int | float | str) or x is None for x in v):
            out[k] = list(v)
        elif k == "lr_lambdas":  # LambdaLR keeps only a callable object's __dict__ (functions: None)
            out[k] = [None if x is None else "(object state)" for x in v]
        else:
            out[k] = type(v).__name__
    return out


def schedulers_of(obj: object) -> list[dict]:
    """A Lightning checkpoint's ``lr_schedulers`` (a list of scheduler state_dicts), described."""
    if isinstance(obj, dict) and isinstance(obj.get("lr_schedulers"), list):
        return [describe_scheduler(s) for s in obj["lr_schedulers"]]
    return []


# ----------------------------------------------------------------------------- writing


def step_tensor(step: float | int) -> TensorRef:
    return TensorRef.from_array(np.array(step, dtype=np.float32), "F32")


def to_state_dict(state: OptimizerState, family: str, groups: list[dict], *, names: bool = True) -> dict:
    """A torch state_dict for ``state``: ids 0..N-1 in ``state.params`` order, one group per entry
    of ``groups`` (each a full hyperparameter dict; parameters join the group of their ``group``).
    """
    if family == "lbfgs":
        return _lbfgs_state_dict(state, groups, names=names)
    out_state: dict[int, dict] = {}
    out_groups = [dict(g, params=[]) for g in groups]
    names_known = names and all(p.path for p in state.params)
    if names_known:
        for g in out_groups:
            g["param_names"] = []
    torch_layout = naming.layout("torch", family)
    for idx, p in enumerate(state.params):
        group = out_groups[p.group]
        group["params"].append(idx)
        if names_known:
            group["param_names"].append(p.path)
        if not p.slots and p.step is None:
            continue  # a parameter without state: torch creates it lazily
        entry: dict[str, object] = {}
        if torch_layout.step is not None:
            if p.step is None and family in STEP_NOT_IN_UPDATE:
                p.step = 0  # burn keeps no count; torch's is a counter its update never reads
            if p.step is None:
                raise MappingError(f"parameter {p.label()}: torch's {family} state needs a step count")
            if p.step > MAX_EXACT_STEP:
                raise MappingError(f"parameter {p.label()}: step {p.step} exceeds 2^24, which float32 cannot hold exactly")
            entry["step"] = step_tensor(p.step)
        for slot in p.slots:
            if slot not in torch_layout.slots.values():
                raise MappingError(f"parameter {p.label()}: torch's {family} state has no field for {slot!r}")
        for slot in torch_layout.slots.values():  # torch's own key order
            if slot in p.slots:
                entry[slot] = p.slots[slot]
        out_state[idx] = entry
    return {"state": out_state, "param_groups": out_groups}


LBFGS_ORDER = ("func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss")


def _lbfgs_state_dict(state: OptimizerState, groups: list[dict], *, names: bool = True) -> dict:
    """torch LBFGS's state_dict: one group, the whole state under the first parameter (torch's key order)."""
    if len(groups) != 1:
        raise MappingError(f"torch's LBFGS takes exactly one param group, not {len(groups)}")
    group = dict(groups[0], params=list(range(len(state.params))))
    if names and state.params and all(p.path for p in state.params):
        group["param_names"] = [p.path for p in state.params]
    g, sc = state.global_slots, state.global_scalars
    entry: dict[str, object] = {}
    for name in LBFGS_ORDER:
        if name in LBFGS_LISTS:
            n = int(sc.get(f"{name}.len", 0))
            if n or f"{name}.len" in sc:
                entry[name] = [g[f"{name}.{i}"] for i in range(n)]
        elif name in g:
            entry[name] = g[name]
        elif name in sc:
            entry[name] = sc[name]
    return {"state": {0: entry} if entry and state.params else {}, "param_groups": [group]}
