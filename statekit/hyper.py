"""Hyperparameters: each framework's defaults per optimizer, and how a conversion fills them.

burn stores no hyperparameters in its optimizer files, and its defaults differ from torch's (Adam
eps 1e-5 against 1e-8; AdamW weight decay 1e-4 against 1e-2; SGD dampening 0.1 against 0). A
wrong eps is not caught by any later number, so conversions write every value explicitly and say
which ones were assumed rather than given.
"""

from __future__ import annotations

import json

# ---------------------------------------------------------------------------------------------
# THE table: every framework's own defaults per optimizer, in its own key order, in statekit's
# neutral names (torch's: ``betas`` is a pair). ``None``: the framework has no default (burn's
# learning rate lives in its LR scheduler, not in the optimizer config). ``fixed``: keys the
# framework cannot change. The compute core (:mod:`statekit.optim.registry`), conversions
# (:func:`conversion_defaults`), candle's writer and torch's param groups all read this table.

# torch 2.13's param_group keys in insertion order, with the constructor defaults
# (torch-candle-numerics.md §1.2); the execution flags (EXECUTION_FLAGS) do not change the math.
TORCH_GROUPS: dict[str, dict[str, object]] = {
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "decoupled_weight_decay": False},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
              "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
              "fused": None, "decoupled_weight_decay": True},
    "sgd": {"lr": 1e-3, "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
            "maximize": False, "foreach": None, "differentiable": False, "fused": None},
    "rmsprop": {"lr": 1e-2, "momentum": 0, "alpha": 0.99, "eps": 1e-8, "centered": False,
                "weight_decay": 0, "capturable": False, "foreach": None, "maximize": False,
                "differentiable": False},
    "adagrad": {"lr": 1e-2, "lr_decay": 0, "eps": 1e-10, "weight_decay": 0, "initial_accumulator_value": 0,
                "foreach": None, "maximize": False, "differentiable": False, "fused": None},
    "nadam": {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "momentum_decay": 4e-3,
              "decoupled_weight_decay": False, "maximize": False, "foreach": None, "capturable": False,
              "differentiable": False},
    "radam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "maximize": False,
              "foreach": None, "capturable": False, "decoupled_weight_decay": False, "differentiable": False},
    "adamax": {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "foreach": None,
               "maximize": False, "differentiable": False, "capturable": False},
    "adadelta": {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0, "maximize": False, "capturable": False,
                 "foreach": None, "differentiable": False},
    "adafactor": {"lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.0,
                  "foreach": None, "maximize": False},
    "asgd": {"lr": 1e-2, "lambd": 1e-4, "alpha": 0.75, "t0": 1e6, "weight_decay": 0, "foreach": None,
             "maximize": False, "differentiable": False, "capturable": False},
    "rprop": {"lr": 1e-2, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50), "foreach": None, "maximize": False,
              "differentiable": False, "capturable": False},
    "muon": {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
             "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None},
    "lbfgs": {"lr": 1, "max_iter": 20, "max_eval": 25, "tolerance_grad": 1e-7, "tolerance_change": 1e-9,
              "history_size": 100, "line_search_fn": None},
}
EXECUTION_FLAGS = frozenset({"foreach", "capturable", "differentiable", "fused"})

# Slots whose fresh value is a hyperparameter, not zero: torch creates Adagrad's ``sum`` filled with
# ``initial_accumulator_value`` and Rprop's ``step_size`` with ``lr`` (torch/optim/adagrad.py,
# rprop.py). A resized parameter's new elements start there, as a new parameter's state would.
FRESH_FROM: dict[str, dict[str, str]] = {"adagrad": {"sum": "initial_accumulator_value"},
                                         "rprop": {"step_size": "lr"}}


def fresh_value(family: str | None, slot: str, group: dict[str, object]) -> float | None:
    """The value ``slot`` of ``family`` starts at for a new element under param group ``group``:
    0.0 for most, the group's hyperparameter (:data:`FRESH_FROM`) for the others, None where the
    group lacks it."""
    key = FRESH_FROM.get(family or "", {}).get(slot)
    if key is None:
        return 0.0
    value = group.get(key)
    return None if value is None else float(value)

_NO_MAXIMIZE = frozenset({"maximize"})

# burn 0.22's optimizer configs (burn-formats.md §2.5; crates/burn-optim/src/optim/*.rs).
# SgdConfig has no momentum unless a MomentumConfig is given; that config's defaults are
# BURN_MOMENTUM (§2.5.2: momentum 0.9, dampening 0.1, not torch's 0).
BURN_CONFIGS: dict[str, dict[str, object]] = {
    "adam": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-5, "weight_decay": 0.0, "amsgrad": False},
    "adamw": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-5, "weight_decay": 1e-4, "amsgrad": False},
    "sgd": {"lr": None, "momentum": 0.0, "dampening": 0.1, "nesterov": False, "weight_decay": 0.0},
    "rmsprop": {"lr": None, "alpha": 0.99, "eps": 1e-5, "momentum": 0.9, "centered": False, "weight_decay": 0.0},
    "adagrad": {"lr": None, "lr_decay": 0.0, "eps": 1e-5, "weight_decay": 0.0, "initial_accumulator_value": 0.0},
    "adan": {"lr": None, "beta1": 0.98, "beta2": 0.92, "beta3": 0.99, "eps": 1e-8, "weight_decay": 0.0,
             "no_prox": False},
    # AdafactorConfig (optimizers-burn-torch.md §1.2) in torch's names where the meaning is the same
    # (decay_rate = beta2_decay, clip_threshold = d, epsilon_2 = eps[1]); burn's epsilon_1 is added to
    # g² (torch's eps[0] is a clamp) and its two switches have no torch key.
    "adafactor": {"lr": None, "beta2_decay": -0.8, "epsilon_1": 1e-30, "epsilon_2": 1e-3, "d": 1.0,
                  "weight_decay": 0.0, "relative_step": True, "scale_parameter": True},
    # MuonConfig (§1.5): momentum {0.95, dampening 0, nesterov}, no weight decay unless configured,
    # adjust_lr_fn Original (torch's None / "original")
    "muon": {"lr": None, "weight_decay": 0.0, "momentum": 0.95, "dampening": 0.0, "nesterov": True,
             "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": "original"},
    # LambConfig (§1.3) and LionConfig (§1.4); torch has neither
    "lamb": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "use_trust_ratio": True},
    "lion": {"lr": None, "betas": (0.9, 0.99), "weight_decay": 0.0},
    # LBFGSConfig (§1.6): torch's defaults, max_eval None = max_iter * 5 / 4
    "lbfgs": {"lr": None, "max_iter": 20, "max_eval": 25, "tolerance_grad": 1e-7, "tolerance_change": 1e-9,
              "history_size": 100, "line_search_fn": None},
}
BURN_MOMENTUM: dict[str, object] = {"momentum": 0.9, "dampening": 0.1, "nesterov": False}
BURN_FIXED: dict[str, frozenset[str]] = {
    "adam": _NO_MAXIMIZE, "adamw": _NO_MAXIMIZE, "sgd": _NO_MAXIMIZE, "rmsprop": _NO_MAXIMIZE,
    "adagrad": frozenset({"initial_accumulator_value", "maximize"}), "adan": frozenset(),
    "adafactor": frozenset({"maximize", "eps"}),  # torch's eps pair: burn's are epsilon_1 / epsilon_2
    "lamb": frozenset(), "lion": frozenset(), "muon": frozenset(),
}

# candle-nn's ``ParamsAdamW::default()`` (docs/candle.md): the same values as torch.optim.AdamW's.
# candle-nn's ``SGD::new(vars, learning_rate)``: a learning rate and nothing else (no default, no
# momentum, no weight decay).
CANDLE_CONFIGS: dict[str, dict[str, object]] = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
    "sgd": {"lr": None},
}
CANDLE_FIXED: dict[str, frozenset[str]] = {
    "adamw": frozenset({"amsgrad", "maximize", "decoupled_weight_decay"}),
    "sgd": frozenset({"momentum", "dampening", "weight_decay", "nesterov", "maximize"}),
}

CONFIGS: dict[str, dict[str, dict[str, object]]] = {
    "torch": {f: {k: v for k, v in g.items() if k not in EXECUTION_FLAGS} for f, g in TORCH_GROUPS.items()},
    "burn": BURN_CONFIGS,
    "candle": CANDLE_CONFIGS,
}
FIXED: dict[str, dict[str, frozenset[str]]] = {"torch": {}, "burn": BURN_FIXED, "candle": CANDLE_FIXED}

# The hyperparameters the CLI and the Python API accept (--lr, lr=…), in one list.
FLAGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov")
# --hyper KEY=VALUE sets any other key of the family's table (burn's relative_step, Muon's ns_steps …)


def split_betas(values: dict[str, object]) -> dict[str, object]:
    """The compute core's spelling: torch's ``betas`` pair becomes ``beta1``/``beta2`` in place."""
    out: dict[str, object] = {}
    for key, value in values.items():
        if key == "betas" and value is not None:
            out["beta1"], out["beta2"] = (float(b) for b in value)
        else:
            out[key] = value
    return out


# torch defaults that are None as a setting, not as "no default" (Muon's adjust_lr_fn=None is
# the "original" adjustment): the compute core spells the setting out.
NONE_MEANS: dict[str, object] = {"adjust_lr_fn": "original"}


def core_defaults(framework: str, family: str) -> dict[str, object]:
    """Every hyperparameter the compute core knows for ``family`` with ``framework``'s defaults:
    the algorithm's keys (torch's math, execution flags left out) overlaid by the framework's
    config; ``beta1``/``beta2`` spelling, numbers as floats."""
    base = CONFIGS["torch"].get(family, {}) if framework != "torch" else {}
    merged = split_betas({**base, **CONFIGS[framework][family]})
    merged = {k: NONE_MEANS[k] if v is None and k in NONE_MEANS else v for k, v in merged.items()}
    return {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in merged.items()}


def fixed(framework: str, family: str) -> frozenset[str]:
    return FIXED[framework].get(family, frozenset())


def conversion_defaults(family: str) -> dict[str, object]:
    """What a conversion from burn assumes for values a burn file does not store: burn's config
    (a state with momentum was configured with BURN_MOMENTUM); burn keeps no learning rate, so
    torch's default for the family is assumed (and reported as assumed)."""
    values = dict(BURN_CONFIGS.get(family, {}))
    if family == "sgd":
        values.update(BURN_MOMENTUM)
    if values.get("lr", 0) is None and family in TORCH_GROUPS:
        values["lr"] = TORCH_GROUPS[family]["lr"]
    return values


def neutral(values: dict[str, object]) -> dict[str, object]:
    """torch's hyperparameter names are the neutral ones: candle's ``beta1``/``beta2`` → ``betas``."""
    out = dict(values)
    if "beta1" in out or "beta2" in out:
        b1, b2 = out.pop("beta1", 0.9), out.pop("beta2", 0.999)
        out.setdefault("betas", (b1, b2))
    return out


def resolve(family: str, given: dict[str, object], base: dict[str, object] | None = None
            ) -> tuple[dict[str, object], list[str]]:
    """Fill a family's hyperparameters: ``given`` (the user's) over ``base`` (stored) over
    :func:`conversion_defaults`. Returns the values and the names that were assumed."""
    values: dict[str, object] = {}
    assumed: list[str] = []
    for key, default in conversion_defaults(family).items():
        if given.get(key) is not None:
            values[key] = given[key]
        elif base and key in base:
            values[key] = base[key]
        else:
            values[key] = default
            assumed.append(key)
    for key, value in given.items():
        if value is not None and key not in values:
            values[key] = value
    for key, value in (base or {}).items():  # stored values the defaults table has no entry for
        values.setdefault(key, value)
    return values, assumed


def torch_group(family: str, values: dict[str, object]) -> dict[str, object]:
    """A complete torch param group (without ``params``) for ``family`` with ``values`` applied."""
    if family not in TORCH_GROUPS:
        raise KeyError(family)
    group = dict(TORCH_GROUPS[family])
    for key, value in values.items():  # every key survives: initial_lr, a scheduler's, the user's own
        if key in ("params", "param_names"):
            continue
        group[key] = tuple(value) if key in TUPLE_KEYS and isinstance(value, list | tuple) else value
    return group


# torch group values that are tuples (JSON brings them back as lists)
TUPLE_KEYS = frozenset({"betas", "eps", "etas", "step_sizes", "ns_coefficients"})
KEYS_KEY = "statekit.group_keys"  # the hyperparameter names stored as statekit.<name>
PATHS_KEY = "statekit.param_names"  # {ParamId: module path}: torch's param_names through burn
# whether the torch file a burnpack came from kept param_names ("0": statekit solved them; written back
# without them, as the original was); read back as OptimizerState.torch_names_in_file
TORCH_NAMES_KEY = "statekit.torch_param_names"
OMIT_NAMES_KEY = "torch.param_names"  # plan metadata for torch's writer: "omit" writes no param_names
ARGS_KEY = "statekit.training_args"  # an HF TrainingArguments' optimizer settings, as read from training_args.bin
# the optimizer library's layout a state came from and how it stored each parameter:
# {"format": "bnb" | "bnb-flat" | "bnb-2048", "stored": {param id: [bits, block]}} (bitsandbytes)
LIBRARY_KEY = "statekit.library"
NOT_HYPER = ("statekit.optimizer", "statekit.groups", KEYS_KEY, PATHS_KEY, ARGS_KEY, TORCH_NAMES_KEY)


def training_args_to_metadata(args: dict[str, object]) -> dict[str, str]:
    return {ARGS_KEY: json.dumps(args, separators=(",", ":"), allow_nan=True)} if args else {}


def training_args_from_metadata(metadata: dict[str, str]) -> dict[str, object] | None:
    try:
        data = json.loads(metadata.get(ARGS_KEY, "null"))
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _json(key: str, value: object) -> str:
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value, allow_nan=True)
    except (TypeError, ValueError):
        from statekit.errors import MappingError

        raise MappingError(f"param group key {key!r} holds a {type(value).__name__}, which burnpack string "
                           "metadata cannot keep") from None


def to_metadata(family: str, values: dict[str, object]) -> dict[str, str]:
    """burnpack string metadata keys (``statekit.*``) that keep hyperparameters beside burn state."""
    out = {"statekit.optimizer": family}
    keys = []
    for key, value in values.items():
        if key in ("params", "param_names"):  # torch's execution flags (fused, foreach …) are kept too
            continue
        out[f"statekit.{key}"] = _json(key, value)
        keys.append(key)
    out[KEYS_KEY] = json.dumps(keys)
    return out


GROUPS_KEY = "statekit.groups"


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def groups_to_metadata(groups: list[dict[str, object]], members: list[list[str]],
                       families: list[str] | None = None) -> dict[str, str]:
    """Several parameter groups (hyperparameters and member ParamIds; each group's optimizer when
    they differ, as a Muon run's Muon and AdamW groups) as one metadata entry."""
    skip = ("params", "param_names")
    payload = [{"hyperparams": {k: _plain(v) for k, v in g.items() if k not in skip}, "params": ids}
               for g, ids in zip(groups, members, strict=True)]
    for g, family in zip(payload, families or [], strict=False):
        g["optimizer"] = family
    for g in payload:
        for k, v in g["hyperparams"].items():
            _json(k, v)
    return {GROUPS_KEY: json.dumps(payload, separators=(",", ":"))}


def groups_from_metadata(metadata: dict[str, str]) -> list[tuple[dict[str, object], list[str]]]:
    """The groups :func:`groups_to_metadata` stored ([] when none or unreadable)."""
    try:
        payload = json.loads(metadata.get(GROUPS_KEY, "[]"))
        return [({k: tuple(v) if isinstance(v, list) and k in TUPLE_KEYS else v for k, v in g["hyperparams"].items()},
                 [str(i) for i in g["params"]]) for g in payload]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return []


def group_families_from_metadata(metadata: dict[str, str]) -> list[str | None]:
    """Each stored group's optimizer (None where :func:`groups_to_metadata` kept none)."""
    try:
        payload = json.loads(metadata.get(GROUPS_KEY, "[]"))
        return [g.get("optimizer") if isinstance(g.get("optimizer"), str) else None for g in payload]
    except (json.JSONDecodeError, TypeError, AttributeError):
        return []


def from_metadata(metadata: dict[str, str]) -> tuple[str | None, dict[str, object]]:
    family = metadata.get("statekit.optimizer")
    values: dict[str, object] = {}
    try:
        listed = json.loads(metadata[KEYS_KEY]) if KEYS_KEY in metadata else None
    except json.JSONDecodeError:
        listed = None
    for key, text in metadata.items():
        if not key.startswith("statekit.") or key in NOT_HYPER:
            continue
        name = key[len("statekit."):]
        if listed is not None and name not in listed:
            continue  # other statekit metadata (not a hyperparameter)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        values[name] = tuple(value) if name in TUPLE_KEYS and isinstance(value, list) else value
    return family, values


def paths_to_metadata(paths: dict[str, str]) -> dict[str, str]:
    """torch's ``param_names`` (ParamId → module path) kept in a burnpack's metadata."""
    return {PATHS_KEY: json.dumps(paths, separators=(",", ":"))} if paths else {}


def paths_from_metadata(metadata: dict[str, str]) -> dict[str, str]:
    try:
        data = json.loads(metadata.get(PATHS_KEY, "{}"))
    except json.JSONDecodeError:
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}
