"""What a safetensors file means: plain model files (candle ``VarMap``), candle AdamW state,
and statekit's generic optimizer-state layout (the "neutral" framework).

The container itself (header, dtypes, streaming writer) is :mod:`statekit.formats.safetensors`.
Which of three things a file holds is decided by its ``__metadata__["format"]``:

- ``statekit.state`` — any :class:`OptimizerState`, from any framework, in the layout of
  ``docs/safetensors-layout.md`` (:func:`save_state` / :func:`read_state`);
- ``statekit.candle_adamw`` — candle-nn AdamW state (``docs/candle.md``), read and written by
  :mod:`statekit.frameworks.candle`; files a candle user saved without metadata are recognised
  by their tensor names;
- anything else (no metadata, or e.g. ``{"format": "pt"}``) — model weights: a
  :class:`ModelInfo` with one parameter per tensor, in file order (``VarMap::save`` writes
  ``l1.weight`` ``[out, in]``, ``l1.bias``…).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np

from statekit import dtypes, paramid
from statekit.errors import FormatError, MappingError
from statekit.formats import limits
from statekit.formats.burnpack import Scalar
from statekit.formats.safetensors import SafetensorsFile, write_safetensors
from statekit.frameworks import base, candle
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

__all__ = ["SafetensorsFile", "write_safetensors", "open_checkpoint", "save_optimizer", "save_model",
           "save_state", "read_state", "read_model"]

FORMAT = "safetensors"
STATE_FORMAT = "statekit.state"
STATE_VERSION = "1"

# ----------------------------------------------------------------------------- opening


def open_checkpoint(path: str, **options) -> Checkpoint:
    """Open a safetensors file as a model, a candle AdamW state or a generic state file."""
    sf = SafetensorsFile(path)
    try:
        fmt = sf.metadata.get("format")
        if fmt == STATE_FORMAT:
            return read_state(sf)
        if fmt == candle.FORMAT_TAG or (fmt is None and candle.looks_like_candle_state(sf.names)):
            return candle.read(sf)
        return read_model(sf)
    except BaseException:
        sf.close()
        raise


def _checkpoint(sf: SafetensorsFile, fmt: str, kind: str, version: int | str | None = None) -> Checkpoint:
    return Checkpoint(path=sf.path, format=fmt, kind=kind, version=version, metadata=dict(sf.metadata),
                      n_tensors=len(sf.entries), nbytes=sf.nbytes, container=sf)


def read_model(sf: SafetensorsFile) -> Checkpoint:
    """Plain tensors (a candle ``VarMap``, a torch/HF model): one model parameter per tensor."""
    ckpt = _checkpoint(sf, FORMAT, "model" if sf.entries else "empty")
    ckpt.model = ModelInfo([
        ModelParam(name, shape, dtype, buffer=not dtypes.is_float(dtype), tensor=sf.tensor(name))
        for name, (dtype, shape) in sf.entries.items()
    ])
    return ckpt


def save_model(model: ModelInfo, path: str, *, dtype: str | None = None, metadata: dict[str, str] | None = None,
               progress=None) -> int:
    """Write model weights as candle's ``VarMap::save`` does: one tensor per path, no metadata —
    unless every name is one of candle AdamW's (``first_moment.*``, ``second_moment.*``,
    ``step_t``): a file without a format tag is read as candle state then, so the weights are
    tagged ``{"format": "pt"}`` (the tag torch's safetensors files carry) and read back as weights."""
    tensors = []
    for p in model.params:
        if p.tensor is None:
            raise MappingError(f"model parameter {p.path} has no tensor data")
        tensors.append((p.path, p.tensor.cast(dtype) if dtype and dtypes.is_float(p.tensor.dtype) else p.tensor))
    metadata = dict(metadata or {})
    if "format" not in metadata and candle.looks_like_candle_state([name for name, _ in tensors]):
        metadata["format"] = "pt"
    return write_safetensors(path, tensors, metadata or None, progress)


# ----------------------------------------------------------------------------- generic layout

_MARKERS = ("__tuple__", "__tensor__", "__scalar__", "__float__", "__items__", "__int__")


class _Encoder:
    """JSON-able values for metadata; tensors found inside values are collected under names."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, TensorRef]] = []

    def tensor(self, name: str, ref: TensorRef) -> str:
        if ref.dtype == "QFloat":
            raise MappingError(f"{name}: quantized (QFloat) tensors cannot be stored in safetensors")
        self.tensors.append((name, ref))
        return name

    def value(self, value: object, where: str) -> object:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, np.generic):
            return self.value(value.item(), where)
        if isinstance(value, tuple):
            return {"__tuple__": [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Scalar):
            return {"__scalar__": [value.kind, self.value(value.value, where)]}
        if isinstance(value, TensorRef):
            return {"__tensor__": self.tensor(where, value)}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _MARKERS):
                return {k: self.value(v, f"{where}/{k}") for k, v in value.items()}
            return {"__items__": [[self.value(k, where), self.value(v, f"{where}/{k}")] for k, v in value.items()]}
        raise MappingError(f"{where}: a {type(value).__name__} value cannot be stored in safetensors metadata")


def _scalar(inner: object, sf: SafetensorsFile) -> Scalar:
    """A ``{"__scalar__": [kind, value]}`` entry: a burn scalar variant and a value that fits it."""
    if isinstance(inner, list) and len(inner) == 2 and inner[0] in ("Int", "UInt", "Float", "Bool"):
        kind, value = inner[0], _decode(inner[1], sf)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if {"Int": type(value) is int, "UInt": type(value) is int and value >= 0, "Float": number,
                "Bool": isinstance(value, bool)}[kind]:
            return Scalar(kind, value)
    raise FormatError(f"metadata scalar {limits.short(inner)} is not [Int|UInt|Float|Bool, value]", sf.path)


def _decode(value: object, sf: SafetensorsFile) -> object:
    if isinstance(value, list):
        return [_decode(v, sf) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == "__tuple__":
            return tuple(_decode(v, sf) for v in inner)
        if key == "__tensor__":
            if inner not in sf.entries:
                raise FormatError(f"metadata refers to a missing tensor {inner!r}", sf.path)
            return sf.tensor(inner)
        if key == "__scalar__":
            return _scalar(inner, sf)
        if key == "__float__":
            return float(inner)
        if key == "__items__":
            return {_decode(k, sf): _decode(v, sf) for k, v in inner}
    return {k: _decode(v, sf) for k, v in value.items()}


# metadata keys of the layout that hold the state itself (not shown as free-form metadata)
_STATE_KEYS = frozenset({"family", "candidates", "hyperparams_stored", "groups", "params", "global", "notes"})


def state_tensor_name(key: str, slot: str) -> str:
    return f"state/{key}/{slot}"


def save_state(state: OptimizerState, path: str, *, metadata: dict[str, str] | None = None, progress=None) -> int:
    """Write any :class:`OptimizerState` in statekit's generic safetensors layout (round-trips)."""
    enc = _Encoder()
    params = []
    keys: set[str] = set()
    for p in state.params:
        if p.key in keys:
            raise MappingError(f"two parameters share the key {p.key!r}")
        keys.add(p.key)
        slots, flex = {}, []
        for slot, ref in p.slots.items():
            slots[slot] = enc.tensor(state_tensor_name(p.key, slot), ref)
            if ref.dtype == "Flex32":
                flex.append(slot)
        entry: dict[str, object] = {
            "key": p.key,
            "id": None if p.id is None else str(p.id),
            "index": p.index,
            "path": p.path,
            "rank": p.rank,
            "step": enc.value(p.step, f"{p.label()} step"),
            "group": p.group,
            "family": p.family,
            "declared_shape": None if p.declared_shape is None else list(p.declared_shape),
            "slots": slots,
            "extra": {k: enc.value(v, f"state/{p.key}/extra/{k}") for k, v in p.extra.items()},
        }
        if flex:
            entry["flex32"] = flex
        params.append(entry)
    groups = [{"hyperparams": enc.value(g.hyperparams, f"groups/{i}"), "keys": list(g.keys)}
              for i, g in enumerate(state.groups)]
    global_slots = {n: enc.tensor(f"global/{n}", ref) for n, ref in state.global_slots.items()}
    meta = dict(metadata or {})
    meta.update({
        "format": STATE_FORMAT,
        "format_version": STATE_VERSION,
        "framework": state.framework,
        "family": _dumps(state.family),
        "candidates": _dumps(list(state.candidates)),
        "hyperparams_stored": _dumps(state.hyperparams_stored),
        "groups": _dumps(groups),
        "params": _dumps(params),
        "global": _dumps({"slots": global_slots,
                          "scalars": enc.value(state.global_scalars, "global/scalars")}),
        "notes": _dumps(list(state.notes)),
    })
    return write_safetensors(path, enc.tensors, meta, progress)


@base.optimizer_writer
def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """The writer interface for format ``safetensors`` (the generic layout).

    ``family`` (when given) replaces the state's family; ``groups`` (when given) replaces the
    hyperparameters of the state's param groups, one dict per group, in order.
    """
    if family is not None or groups:
        state = _with(state, family, groups)
    return save_state(state, path, metadata=metadata, progress=progress)


def _with(state: OptimizerState, family: str | None, groups: list[dict] | None) -> OptimizerState:
    new_groups = list(state.groups)
    if groups:
        if not state.groups and len(groups) == 1:
            new_groups = [ParamGroup(hyperparams=dict(groups[0]), keys=[p.key for p in state.params])]
        elif len(groups) != len(state.groups):
            raise MappingError(f"{len(groups)} hyperparameter sets given for {len(state.groups)} parameter groups")
        else:
            new_groups = [ParamGroup(hyperparams=dict(h), keys=list(g.keys)) for h, g in zip(groups, state.groups, strict=True)]
    out = replace(state, groups=new_groups, hyperparams_stored=state.hyperparams_stored or bool(groups))
    if family is not None and family != state.family:
        out.family, out.candidates = family, (family,)
    return out


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _loads(sf: SafetensorsFile, key: str, default: object = None) -> object:
    text = sf.metadata.get(key)
    if text is None:
        return default
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"metadata {key!r} is not valid JSON: {exc.msg}", sf.path) from None
    except RecursionError:
        value = [[]] * (limits.MAX_DEPTH + 1)  # nested far too deep: refused below
    problem = limits.depth_problem(value)
    if problem:
        raise FormatError(f"metadata {key!r}: JSON {problem}", sf.path)
    if "\\u" in text:  # a \uD800 escape decodes to a lone surrogate, which no output can hold
        try:
            _dumps(value).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise FormatError(f"metadata {key!r}: JSON string holds a lone surrogate "
                              f"({exc.object[exc.start]!r}) and cannot be written as UTF-8", sf.path) from None
    return value


def _check_param(p: ParamState, sf: SafetensorsFile) -> None:
    """The types the layout's parameter entries hold (a list where a step belongs is refused here)."""
    def integer(v: object) -> bool:
        return type(v) is int

    checks = {
        "key": isinstance(p.key, str),
        "id": p.id is None or (integer(p.id) and 0 <= p.id < 1 << 64),
        "index": p.index is None or (integer(p.index) and p.index >= 0),
        "path": p.path is None or isinstance(p.path, str),
        "rank": p.rank is None or (integer(p.rank) and 0 <= p.rank <= limits.MAX_RANK),
        "step": p.step is None or (type(p.step) in (int, float) and math.isfinite(p.step)),
        "extra": p.extra.get("__step_kind", "UInt") in ("Int", "UInt"),
        "group": integer(p.group) and p.group >= 0,
        "family": p.family is None or isinstance(p.family, str),
        "declared_shape": p.declared_shape is None or limits.shape_problem(p.declared_shape) is None,
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        value = getattr(p, bad[0])
        raise FormatError(f"parameter entry {p.key!r:.40}: {bad[0]} {limits.short(value)} has the wrong type", sf.path)


def _check_state(state: OptimizerState, sf: SafetensorsFile) -> None:
    """The types of the layout's state-wide entries (family, candidates, notes, groups)."""
    def texts(values) -> bool:
        return all(isinstance(v, str) for v in values)

    checks = {
        "family": state.family is None or isinstance(state.family, str),
        "candidates": texts(state.candidates),
        "notes": texts(state.notes),
        "framework": isinstance(state.framework, str),
        "groups": all(isinstance(g.hyperparams, dict) and texts(g.hyperparams) and texts(g.keys)
                      for g in state.groups),
        "global": isinstance(state.global_scalars, dict) and texts(state.global_scalars),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise FormatError(f"statekit state metadata: {bad[0]} has the wrong type", sf.path)


def read_state(sf: SafetensorsFile) -> Checkpoint:
    """Read a file in the generic layout back into the exact :class:`OptimizerState` written."""
    version = sf.metadata.get("format_version")
    if version != STATE_VERSION:
        raise FormatError(f"statekit state layout version {version!r} is not supported (only {STATE_VERSION})", sf.path)
    try:
        state = OptimizerState(
            family=_loads(sf, "family"),
            candidates=tuple(_loads(sf, "candidates", [])),
            hyperparams_stored=bool(_loads(sf, "hyperparams_stored", False)),
            framework=sf.metadata.get("framework", "neutral"),
            notes=list(_loads(sf, "notes", [])),
        )
        used: set[str] = set()
        for entry in _loads(sf, "params", []):
            p = ParamState(
                key=entry["key"],
                id=None if entry.get("id") is None else paramid.parse(entry["id"]),
                index=entry.get("index"),
                path=entry.get("path"),
                rank=entry.get("rank"),
                step=_decode(entry.get("step"), sf),
                group=entry.get("group", 0),
                family=entry.get("family"),
                declared_shape=None if entry.get("declared_shape") is None else tuple(entry["declared_shape"]),
            )
            for slot, name in entry.get("slots", {}).items():
                if not isinstance(name, str) or name not in sf.entries:
                    raise FormatError(f"parameter {p.key!r}: slot {slot!r} refers to a missing tensor", sf.path)
                p.slots[slot] = sf.tensor(name)
                used.add(name)
            for slot in entry.get("flex32", []):
                p.slots[slot].dtype = "Flex32"
            p.extra = {k: _decode(v, sf) for k, v in entry.get("extra", {}).items()}
            _check_param(p, sf)
            state.params.append(p)
        for g in _loads(sf, "groups", []):
            state.groups.append(ParamGroup(hyperparams=_decode(g["hyperparams"], sf), keys=list(g["keys"])))
        glob = _loads(sf, "global", {}) or {}
        for n, name in glob.get("slots", {}).items():
            if name not in sf.entries:
                raise FormatError(f"global slot {n!r} refers to a missing tensor", sf.path)
            state.global_slots[n] = sf.tensor(name)
        state.global_scalars = _decode(glob.get("scalars", {}), sf)
        _check_state(state, sf)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"malformed statekit state metadata: {type(exc).__name__}: {exc}", sf.path) from None
    ckpt = _checkpoint(sf, FORMAT, "optimizer", int(STATE_VERSION))
    ckpt.metadata = {k: v for k, v in sf.metadata.items() if k not in _STATE_KEYS}
    ckpt.optimizer = state
    return ckpt
