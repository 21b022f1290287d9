"""candle-nn AdamW state in a safetensors file ⇄ the state model (``docs/candle.md``).

candle-nn's ``AdamW`` keeps ``first_moment`` / ``second_moment`` per variable and one global
``step_t``, and cannot save them. statekit's layout for them (``torch-candle-numerics.md`` §4.4)::

    first_moment.<var name>    the var's dtype and shape      m
    second_moment.<var name>   the var's dtype and shape      v
    step_t                     I64, shape []                  the global step
    __metadata__               format=statekit.candle_adamw, format_version=1,
                               optimizer=candle_nn::AdamW, step_t, lr, beta1, beta2, eps,
                               weight_decay (Python repr of the f64), source

Var names are the ``VarMap`` names (``l1.weight``), so the file pairs with ``VarMap::save``'s
weights by name, never by position (``VarMap::all_vars`` order is random per process).

What candle cannot hold is refused by name: state of another optimizer, AMSGrad, L2-Adam (Adam
with ``weight_decay`` ≠ 0: candle's decay is decoupled), ``maximize``, several parameter groups
with different hyperparameters, and per-parameter steps that differ (unless
``step_policy="max"``, which writes the largest with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from statekit import hyper
from statekit.errors import FormatError, MappingError
from statekit.formats.safetensors import write_safetensors
from statekit.frameworks import base
from statekit.state import Checkpoint, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

FORMAT = "candle"
FORMAT_TAG = "statekit.candle_adamw"
FORMAT_VERSION = "1"
OPTIMIZER = "candle_nn::AdamW"
FIRST, SECOND, STEP = "first_moment", "second_moment", "step_t"
KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
# candle-nn's ``ParamsAdamW::default()``, from the one table of defaults (statekit.hyper).
DEFAULTS: dict[str, float] = {k: v for k, v in hyper.core_defaults("candle", "adamw").items() if k in KEYS}
STEP_POLICIES = ("exact", "max")
ONE_STEP_NOTE = "candle-nn's AdamW keeps one step_t for all variables"


# ----------------------------------------------------------------------------- reading


def looks_like_candle_state(names: list[str]) -> bool:
    """A file without the format tag is candle AdamW state when every tensor is a moment or
    ``step_t`` (what a candle user writes with ``candle::safetensors::save``)."""
    return STEP in names and all(n == STEP or n.startswith((FIRST + ".", SECOND + ".")) for n in names)


def read(sf) -> Checkpoint:
    """Interpret an opened :class:`~statekit.formats.safetensors.SafetensorsFile`."""
    meta = sf.metadata
    tagged = meta.get("format") == FORMAT_TAG
    if tagged and meta.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"candle AdamW layout version {meta.get('format_version')!r} is not supported "
                          f"(only {FORMAT_VERSION})", sf.path)
    if STEP not in sf.entries:
        raise FormatError("candle AdamW state has no step_t tensor", sf.path)
    step_dtype, step_shape = sf.entries[STEP]
    if step_dtype not in ("I64", "I32", "U64", "U32") or step_shape not in ((), (1,)):
        raise FormatError(f"step_t must be a 0-dim integer tensor, found {step_dtype} {list(step_shape)}", sf.path)
    step = int(sf.scalar(STEP))
    state = OptimizerState(family="adamw", candidates=("adamw",), framework="candle", notes=[ONE_STEP_NOTE])
    names: list[str] = []
    for tensor in sf.names:
        prefix, _, var = tensor.partition(".")
        if tensor == STEP:
            continue
        if prefix not in (FIRST, SECOND) or not var:
            raise FormatError(f"tensor {tensor!r} is not part of the candle AdamW layout "
                              f"({FIRST}.<var>, {SECOND}.<var>, {STEP})", sf.path)
        if prefix == FIRST:
            names.append(var)
    for var in names:
        second = f"{SECOND}.{var}"
        if second not in sf.entries:
            raise FormatError(f"var {var!r} has a first_moment but no second_moment", sf.path)
        m, v = sf.tensor(f"{FIRST}.{var}"), sf.tensor(second)
        if m.shape != v.shape or m.dtype != v.dtype:
            raise FormatError(f"var {var!r}: first_moment is {m.dtype} {list(m.shape)} but second_moment "
                              f"is {v.dtype} {list(v.shape)}", sf.path)
        state.params.append(ParamState(key=var, path=var, rank=len(m.shape), step=step, family="adamw",
                                       slots={"exp_avg": m, "exp_avg_sq": v}))
    orphans = [t for t in sf.names if t.startswith(SECOND + ".") and t[len(SECOND) + 1:] not in names]
    if orphans:
        raise FormatError(f"{orphans[0]!r} has no matching first_moment", sf.path)
    hyper: dict[str, object] = {}
    for key in KEYS:
        if key in meta:
            try:
                hyper[key] = float(meta[key])
            except ValueError:
                raise FormatError(f"metadata {key}={meta[key]!r} is not a number", sf.path) from None
    state.hyperparams_stored = bool(hyper)
    state.groups = [ParamGroup(hyperparams=hyper, keys=[p.key for p in state.params])]
    if not tagged:
        state.notes.append("no statekit metadata: hyperparameters are not stored in this file")
    ckpt = Checkpoint(path=sf.path, format=FORMAT, kind="optimizer", version=int(FORMAT_VERSION),
                      metadata=dict(sf.metadata), n_tensors=len(sf.entries), nbytes=sf.nbytes, container=sf)
    if STEP in meta and meta[STEP] != str(step):
        ckpt.warnings.append(f"metadata says step_t={meta[STEP]} but the step_t tensor holds {step}")
    ckpt.optimizer = state
    return ckpt


# ----------------------------------------------------------------------------- writing


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def _number(value: object, key: str) -> float:
    if isinstance(value, TensorRef):
        value = value.numpy().reshape(-1)[0].item()
    if isinstance(value, bool) or not isinstance(value, int | float | np.generic):
        raise MappingError(f"hyperparameter {key}={value!r} is not a number")
    return float(value)


def hyperparams(group: dict) -> tuple[dict[str, float], list[str]]:
    """candle's five AdamW values from a param group in any framework's names (torch's ``betas``
    pair is split); missing ones take candle's defaults and are returned as assumed."""
    values: dict[str, float] = {}
    given = dict(group)
    betas = given.pop("betas", None)
    if betas is not None:
        given = {**hyper.split_betas({"betas": betas}), **given}
    assumed = []
    for key in KEYS:
        if given.get(key) is None:
            values[key] = DEFAULTS[key]
            assumed.append(key)
        else:
            values[key] = _number(given[key], key)
    return values, assumed


def _names(params: list[ParamState], limit: int = 3) -> str:
    labels = [p.label() for p in params]
    return ", ".join(labels[:limit]) + (f" and {len(labels) - limit} more" if len(labels) > limit else "")


@base.optimizer_writer
def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning: Callable[[str], None] | None = None) -> int:
    """Write ``state`` as candle AdamW state (format ``candle``); returns the file size.

    ``groups``: one hyperparameter dict per parameter group (candle's names, or torch's
    ``betas``); when omitted the state's own groups are used. Parameters are named by their
    ``path`` (the candle var name). ``step_policy="max"`` writes the largest step when the
    parameters' steps differ (and warns through ``on_warning``, default :func:`warnings.warn`).
    """
    warn = on_warning or _warn
    step_policy = step_policy or "exact"
    if step_policy not in STEP_POLICIES:
        raise MappingError(f"step policy {step_policy!r} is not one of {', '.join(STEP_POLICIES)}")
    family = family or state.family
    live = [p for p in state.params if p.slots]
    hyper_sets = list(groups) if groups else [g.hyperparams for g in state.groups] or [{}]
    used = sorted({p.group for p in live}) or [0]
    for g in used:
        if g >= len(hyper_sets):
            raise MappingError(f"parameter group {g} has no hyperparameters")
    if any(hyper_sets[g].get("decoupled_weight_decay") for g in used) and family == "adam":
        family = "adamw"  # torch's Adam(decoupled_weight_decay=True) is AdamW

    if family not in ("adam", "adamw"):
        raise MappingError(f"candle-nn's optimizer state holds AdamW only; {family or 'unknown'} state cannot "
                           "be written as candle AdamW")
    amsgrad = [p for p in live if "max_exp_avg_sq" in p.slots]
    if amsgrad or any(hyper_sets[g].get("amsgrad") for g in used):
        where = f" ({_names(amsgrad)} hold max_exp_avg_sq)" if amsgrad else ""
        raise MappingError(f"amsgrad state cannot be written for candle: candle-nn's AdamW has no AMSGrad{where}")
    if any(hyper_sets[g].get("maximize") for g in used):
        raise MappingError("maximize=True cannot be written for candle: candle-nn's AdamW only minimizes")
    other = [p for p in live if set(p.slots) - {"exp_avg", "exp_avg_sq"}]
    if other:
        extra = sorted(set(other[0].slots) - {"exp_avg", "exp_avg_sq"})
        raise MappingError(f"parameter {other[0].label()}: candle AdamW has no field for {', '.join(extra)}")
    partial = [p for p in live if not {"exp_avg", "exp_avg_sq"} <= set(p.slots)]
    if partial:
        raise MappingError(f"parameter {partial[0].label()} lacks exp_avg or exp_avg_sq")

    resolved = {g: hyperparams(hyper_sets[g]) for g in used}
    distinct = {tuple(values.items()) for values, _ in resolved.values()}
    if len(distinct) > 1:
        first = resolved[used[0]][0]
        differ = [k for k in KEYS if len({values[k] for values, _ in resolved.values()}) > 1]
        listing = "; ".join(f"group {g}: " + ", ".join(f"{k}={resolved[g][0][k]:g}" for k in differ) for g in used)
        raise MappingError(f"several param groups with different {' / '.join(differ)} ({listing}): "
                           f"candle-nn's AdamW has one set of hyperparameters (group 0 has lr={first['lr']:g})")
    values, assumed = resolved[used[0]]
    if family == "adam" and values["weight_decay"] != 0:
        raise MappingError(
            f"L2-Adam (adam with weight_decay={values['weight_decay']:g}) cannot be written for candle: candle-nn's "
            "AdamW decays weights decoupled (θ·(1 − lr·wd)), Adam adds wd·θ to the gradient")
    if assumed:
        warn("candle AdamW hyperparameters not given, candle's defaults written: "
             + ", ".join(f"{k}={values[k]:g}" for k in assumed))

    unnamed = [p for p in live if not p.path]
    if unnamed:
        raise MappingError(f"parameter {unnamed[0].label()} has no name; candle state is keyed by VarMap names "
                           "(give the model file)")
    seen: dict[str, ParamState] = {}
    for p in live:
        if p.path in seen:
            raise MappingError(f"two parameters are both named {p.path!r}")
        seen[p.path] = p
    step_t = _global_step(live, step_policy, warn)

    tensors: list[tuple[str, TensorRef]] = []
    for p in live:
        tensors.append((f"{FIRST}.{p.path}", p.slots["exp_avg"]))
        tensors.append((f"{SECOND}.{p.path}", p.slots["exp_avg_sq"]))
    tensors.append((STEP, TensorRef.from_array(np.array(step_t, dtype="<i8"), "I64")))
    meta = dict(metadata or {})
    meta.update({"format": FORMAT_TAG, "format_version": FORMAT_VERSION, "optimizer": OPTIMIZER,
                 STEP: str(step_t), "source": f"{state.framework} {family}"})
    meta.update({k: repr(values[k]) for k in KEYS})
    return write_safetensors(path, tensors, meta, progress)


def _global_step(live: list[ParamState], policy: str, warn: Callable[[str], None]) -> int:
    steps: dict[int, list[ParamState]] = {}
    for p in live:
        if p.step is None:
            raise MappingError(f"parameter {p.label()} has no step count; candle AdamW needs step_t")
        steps.setdefault(int(p.step), []).append(p)  # a whole count (base.optimizer_writer checked)
    if not steps:
        return 0
    if len(steps) > 1:
        listing = ", ".join(f"{_names(ps, 2)} at {s}" for s, ps in sorted(steps.items()))
        if policy != "max":
            raise MappingError(f"candle-nn's AdamW keeps one step_t for all variables, but the parameters' steps "
                               f"differ ({listing}); use --step max to write the largest")
        warn(f"steps differ ({listing}); step_t = {max(steps)} written for every variable")
    return max(steps)
