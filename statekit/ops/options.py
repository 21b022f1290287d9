"""Options objects, built once for the CLI and the Python API.

:func:`make_options` takes what a user gives — flags or keywords, paths or loaded objects — and
returns the :class:`Options` an operation runs with; :func:`given_hyperparams` does the same for
hyperparameters alone (``replay``, ``verify-resume``). The names a user may give are
:data:`statekit.hyper.FLAGS`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from statekit import hyper, io
from statekit.errors import UsageError
from statekit.state import ModelInfo


@dataclass
class Options:
    """What the user asked for (the CLI's flags, the Python API's keywords)."""

    optimizer: str | None = None
    hyperparams: dict[str, object] = field(default_factory=dict)
    renames: list[str] = field(default_factory=list)
    preset: bool = True
    transpose: list[str] = field(default_factory=list)
    no_transpose: list[str] = field(default_factory=list)
    names: object = None  # list[str] or a torch_names.ModelOrder (--names)
    names_order: str | None = None  # --names-order: "model" (named_parameters()) or "optimizer"
    model: ModelInfo | None = None  # the target model (ids, order, shapes)
    old_model: ModelInfo | None = None  # remap: the source's model, to learn paths by id
    resize: bool = False
    reset_step: list[str] = field(default_factory=list)  # globs; remap: reset the step of resized params
    allow_drop: bool = False
    dtype: str | None = None
    step_policy: str | None = None
    allow_nonfinite: bool = False  # NaN/Inf moments are refused unless asked for
    trust_remote_code: bool = False  # build a model whose code is in its checkpoint (config.json auto_map)
    model_config: str | None = None  # --model-config: the config.json that names a plain .pt's positions
    recorded_names: list = field(default_factory=list)  # (target path, source path) the file records (convert back)
    # structural refactors (statekit.structure): rules, what is declared new, and how remap matches
    fuse: list[str] = field(default_factory=list)
    split: list[str] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    unstack: list[str] = field(default_factory=list)
    new_params: list[str] = field(default_factory=list)  # --new GLOB: targets that start fresh
    match: str = "auto"  # remap: "values" (a map proved on the weights), "paths", or "auto"
    structure: object = None  # the StructureMap remap or convert built (statekit.structure.pieces)


def parse_betas(value: object) -> tuple[float, float] | None:
    """``"B1,B2"`` (the CLI's spelling) or a pair."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            b1, b2 = (float(x) for x in value.replace(" ", "").split(","))
        except ValueError:
            raise UsageError(f"--betas {value!r}: expected two numbers, e.g. 0.9,0.999") from None
        return (b1, b2)
    b1, b2 = value
    return (b1, b2)


def given_hyperparams(**values: object) -> dict[str, object]:
    """The hyperparameters a user gave (``None``: not given), by the names in ``hyper.FLAGS``."""
    unknown = set(values) - set(hyper.FLAGS)
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    if "betas" in values:
        values["betas"] = parse_betas(values["betas"])
    return {k: v for k, v in values.items() if v is not None}


def parse_setting(text: str) -> tuple[str, object]:
    """``--hyper KEY=VALUE``: ``true``/``false``, ``none``, a number, ``A,B`` (a tuple) or a word."""
    key, eq, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key.isidentifier():
        raise UsageError(f"--hyper {text!r}: expected KEY=VALUE, e.g. relative_step=false")

    def value(word: str) -> object:
        word = word.strip()
        low = word.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("none", "null"):
            return None
        try:
            return int(word) if word.lstrip("-").isdigit() else float(word)
        except ValueError:
            return word

    return key, tuple(value(w) for w in raw.split(",")) if "," in raw else value(raw)


def read_names(path: str, order: str | None = None):
    """A names file as a :class:`~statekit.frameworks.torch_names.ModelOrder` (see
    :func:`statekit.frameworks.torch_names.read_names_file` for the accepted forms)."""
    from statekit.frameworks import torch_names

    return torch_names.read_names_file(path, order=order)


def load_model(path: str) -> ModelInfo:
    """The model (parameter paths, ids, shapes) of a model file in any format."""
    with io.open_checkpoint(path) as ckpt:
        if ckpt.model is None:
            raise UsageError(f"{path}: not a model file (it holds {ckpt.format} {ckpt.kind} data)")
        ckpt.model.source = path
        return ckpt.model


def definition_beside_model(opts: Options) -> Options:
    """``--model DIR/model.safetensors`` (a Hugging Face model file, no ParamIds) with ``config.json``
    beside it, and nothing else said about names: the positions are named and laid out as the
    checkpoint folder's are, from the model's definition (``--model-config`` that config.json). The
    file itself is then not needed (its sorted names and v5's saved, not in-memory, expert layout
    only disagree with the definition); a burn model keeps its role (ParamIds and target shapes)."""
    from dataclasses import replace

    from statekit.frameworks import hf_model

    model = opts.model
    if model is None or opts.names is not None or opts.model_config is not None or opts.old_model is not None:
        return opts
    source = getattr(model, "source", None)
    if not source or not os.path.isfile(source) or model.order == "burn" or any(m.id is not None for m in model.params):
        return opts
    config = hf_model.config_path(source)
    return replace(opts, model=None, model_config=config) if config else opts


def _model(value: object) -> ModelInfo | None:
    return load_model(os.fspath(value)) if isinstance(value, str | os.PathLike) else value


def make_options(*, optimizer: str | None = None, names: object = None, names_order: str | None = None,
                 model: object = None,
                 old_model: object = None, transpose: Iterable[str] = (), no_transpose: Iterable[str] = (),
                 rename: Iterable[str] = (), rules: Iterable[object] = (), preset: bool = True,
                 dtype: str | None = None, resize: bool = False, reset_step: Iterable[str] = (),
                 step_policy: str | None = None, allow_nonfinite: bool = False, trust_remote_code: bool = False,
                 model_config: object = None, settings: Iterable[str] | dict | None = None,
                 fuse: Iterable[str] = (), split: Iterable[str] = (), stack: Iterable[str] = (),
                 unstack: Iterable[str] = (), new: Iterable[str] = (), match: str = "auto",
                 **hyperparams: object) -> Options:
    """:class:`Options` from a user's flags or keywords. ``names``: a list or a names file;
    ``names_order``: ``"model"`` or ``"optimizer"`` (what order ``names`` is in);
    ``model`` / ``old_model``: a path or a :class:`ModelInfo`; ``rules``: rename-rule files added
    after ``rename``; hyperparameters by the names of ``hyper.FLAGS`` (``betas`` as a pair or
    ``"B1,B2"``); ``settings``: any other key of the family's hyperparameters (``--hyper KEY=VALUE``
    strings, or a dict), e.g. burn Adafactor's ``relative_step``; ``fuse``, ``split``, ``stack``,
    ``unstack``: structural rules (:mod:`statekit.structure.rules`); ``new``: globs of new-model
    tensors that start fresh; ``match``: how ``remap`` pairs old and new tensors — ``values`` (a map
    learned from the weights and proved on them), ``paths``, or ``auto`` (values when both models hold
    weights that share any)."""
    from statekit.ops.rules import read_rules_file

    if step_policy not in (None, "max"):
        raise UsageError(f"--step {step_policy!r}: the only policy is 'max'")

    renames = list(rename or ())
    for path in rules or ():
        renames += read_rules_file(os.fspath(path))
    if isinstance(names, str | os.PathLike):
        names = read_names(os.fspath(names), names_order)
    elif names is not None and not hasattr(names, "entries"):
        names = list(names)
    given = given_hyperparams(**hyperparams)
    extra = dict(settings) if isinstance(settings, dict) else dict(parse_setting(t) for t in settings or ())
    for key in extra:
        if key in given:
            raise UsageError(f"--hyper {key}=…: give it as --{key.replace('_', '-')}")
    given.update(extra)
    if match not in ("auto", "values", "paths"):
        raise UsageError(f"--match {match}: expected auto, values or paths")
    return Options(optimizer=optimizer, hyperparams=given, renames=renames,
                   preset=preset, transpose=list(transpose or ()), no_transpose=list(no_transpose or ()),
                   names=names, names_order=names_order, model=_model(model),
                   old_model=_model(old_model), resize=resize, reset_step=list(reset_step or ()),
                   dtype=dtype.upper() if dtype else None, step_policy=step_policy, allow_nonfinite=allow_nonfinite,
                   trust_remote_code=trust_remote_code,
                   model_config=os.fspath(model_config) if model_config is not None else None,
                   fuse=list(fuse or ()), split=list(split or ()), stack=list(stack or ()),
                   unstack=list(unstack or ()), new_params=list(new or ()), match=match)
