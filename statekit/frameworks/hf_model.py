"""A Hugging Face model's parameters from its own definition: names, order, shapes, owning modules.

A Trainer ``checkpoint-N/`` holds ``config.json``; its ``architectures[0]`` names the exact class
that was trained. Built on PyTorch's meta device (no weight is allocated: an 8B model builds in well
under a second), the model gives what no file in the folder keeps (``model.safetensors`` sorts its
tensors by name and drops tied aliases):

* ``named_parameters()`` order and shapes, tied weights as transformers ties them (one position
  under the first name, ``model.embed_tokens.weight`` for Llama, ``transformer.wte.weight`` GPT-2);
* each parameter's owning module class, which fixes its layout: ``nn.Linear`` ``[out, in]``,
  ``Conv1D`` ``[in, out]``, embeddings and norms as they are (norm ``weight``/``bias`` are burn's
  ``gamma``/``beta``), 3-D expert weights by their module's own ``is_transposed``;
* where the class does not say (a mixture of experts' router, experts without ``is_transposed``,
  custom modules, peft's trainable token rows), how the forward uses the weight: traced on the
  meta device (:mod:`statekit.frameworks.hf_trace`), which then also cross-checks every weight the
  class table decided — a disagreement leaves the weight undecided, naming both;
* Trainer's decay / no-decay split of its two param groups, by the rule of the transformers
  release that wrote the checkpoint (``config.json["transformers_version"]``; the rule changed in
  4.49 and in 4.53, :data:`DECAY_RULES`).

Code from the hub (``auto_map``) runs only when the caller passes ``trust_remote_code=True``
(``--trust-remote-code``), never by default. transformers and torch are imported here only, when a
definition is asked for; without them :class:`MissingDefinitionError` says in one line what to
install (the ``statekit[hf]`` extra) or to pass ``--names``. Facts:
``../shared/docs/names-and-layouts.md`` §1-§3.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace

from statekit import clients, versions
from statekit.errors import MappingError

INSTALL = "pip install 'statekit[hf]'"
CONFIG = "config.json"

# layouts by owning module (names-and-layouts.md §3): what a rank-2 weight is and what burn calls it
OUT_IN, IN_OUT, EMBEDDING, NORM, CONV, EXPERTS, EXPERTS_IN_OUT, OTHER, VECTOR = (
    "out_in", "in_out", "embedding", "norm", "conv", "experts", "experts_in_out", "other", "vector")
# where a layout came from (DefinedParam.layout_from)
BY_CLASS, BY_FORWARD, BY_BOTH = "module class", "forward", "module class; the forward agrees"


class MissingDefinitionError(MappingError):
    """transformers or torch is not importable: the model's definition cannot be built."""


@dataclass(frozen=True)
class DefinedParam:
    """One parameter as the model defines it. ``layout``: one of the constants above."""

    name: str
    shape: tuple[int, ...]
    module: str  # the owning module's class name
    layout: str | None  # None: undecided (``problem`` says why)
    trainable: bool = True  # requires_grad: Trainer builds its groups from these alone
    layout_from: str = BY_CLASS
    problem: str | None = None  # the class table and the forward disagree, or the forward's uses do

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass(frozen=True)
class DecayRule:
    """Trainer's ``get_decay_parameter_names`` in one range of transformers releases."""

    label: str
    first: tuple[int, int]  # the first release (major, minor) it applies to
    layer_norms: str  # "all": ALL_LAYERNORM_LAYERS (nn.LayerNorm plus what modeling files appended), "torch": nn.LayerNorm
    patterns: tuple[str, ...]  # matched against the lower-cased dotted name
    regex: bool  # re.search (≥4.53) or a substring test
    lower: bool = True  # ≤4.48 tested "bias" in the name as it is


# names-and-layouts.md §2.2 (transformers trainer.py / trainer_pt_utils.py at each release)
DECAY_RULES: tuple[DecayRule, ...] = (
    DecayRule("transformers <= 4.48 (LayerNorm layers and names with 'bias')", (0, 0), "all", ("bias",), False,
              lower=False),
    DecayRule("transformers 4.49-4.52 (LayerNorm layers; 'bias', 'layernorm', 'rmsnorm' in the name)", (4, 49),
              "all", ("bias", "layernorm", "rmsnorm"), False),
    DecayRule("transformers >= 4.53 (nn.LayerNorm; bias and norm names)", (4, 53), "torch",
              (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"), True),
)


@dataclass
class Decay:
    """One way Trainer may have split the parameters: the decayed names (a set) and how."""

    rule: DecayRule
    decayed: frozenset[str]
    variant: str  # which layer-norm classes counted as ALL_LAYERNORM_LAYERS


@dataclass
class Definition:
    """A model's parameters from its definition (``named_parameters()`` order, tied aliases gone)."""

    architecture: str
    params: list[DefinedParam]
    tied: dict[str, str]  # alias -> the name its position is under
    written_by: str | None  # config.json's transformers_version
    built_with: str  # the transformers that built it here
    source: str  # the config.json it came from
    decays: list[Decay] = field(default_factory=list)  # Trainer's possible splits, the writer's rule first
    wrapped: str | None = None  # how an adapter library wrapped the model (peft), for describe()
    traced: str | None = None  # what the forward trace decided or why it could not run (None: not needed)
    warnings: list[str] = field(default_factory=list)  # the builder's releases outside statekit's tested range

    def by_name(self) -> dict[str, DefinedParam]:
        return {p.name: p for p in self.params}

    def trainable(self) -> list[DefinedParam]:
        return [p for p in self.params if p.trainable]

    def describe(self) -> str:
        tied = f", {len(self.tied)} tied ({', '.join(f'{a} = {b}' for a, b in self.tied.items())})" if self.tied else ""
        built = (f"{self.architecture} built on the meta device from {self.source} with transformers "
                 f"{self.built_with}{tied}")
        return f"{self.wrapped} over {built}" if self.wrapped else built


def config_path(path: str) -> str | None:
    """The ``config.json`` of a checkpoint folder or beside an optimizer file (None: none)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    candidate = os.path.join(folder, CONFIG)
    return candidate if os.path.isfile(candidate) else None


def read_config(path: str) -> dict:
    """config.json as plain JSON (nothing of transformers runs)."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except OSError as exc:
        raise MappingError(f"cannot read the model config: {exc.strerror}", path) from None
    except ValueError as exc:
        raise MappingError(f"the model config is not JSON: {exc}", path) from None
    if not isinstance(config, dict):
        raise MappingError("the model config is not a JSON object", path)
    return config


def version_tuple(text: object) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", str(text)) if text else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def rule_for(version: tuple[int, int] | None) -> DecayRule:
    """The decay rule of a release (the newest rule when the version is unknown)."""
    if version is None:
        return DECAY_RULES[-1]
    return [r for r in DECAY_RULES if r.first <= version][-1]


def _import():
    """transformers and torch, or the one line that says what to install."""
    try:
        with clients.quiet("importing torch and transformers"):  # what they print is not statekit's to show
            import torch
            import transformers
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "transformers"
        raise MissingDefinitionError(
            f"naming the optimizer's positions from the model's definition needs transformers and torch "
            f"({missing} is not installed): {INSTALL}, or give --names FILE (model.named_parameters() order)") from None
    return torch, transformers


def build(path: str, *, trust_remote_code: bool = False, trace: bool = False) -> Definition:
    """The model that ``config.json`` at ``path`` describes, built on the meta device (``trace``: run
    the forward even where the class table decides every layout, cross-checking all of them)."""
    built = build_model(path, trust_remote_code=trust_remote_code)
    return define(built.model, built.architecture, built.written_by, path, built.torch, built.transformers,
                  trace=trace)


@dataclass
class Built:
    """A model built on the meta device from its config, with what built it."""

    model: object
    architecture: str
    written_by: str | None
    torch: object
    transformers: object


def build_model(path: str, *, trust_remote_code: bool = False, wrap=None) -> Built:
    """The model class ``config.json`` at ``path`` names, built on the meta device (``wrap(model)``,
    when given, runs inside the same device context: an adapter library wrapping it)."""
    config = read_config(path)
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise MappingError(f"config.json names {'no' if not archs else len(archs)} architectures; statekit builds "
                           "the one class that was trained (architectures = [\"...ForCausalLM\"])", path)
    arch = archs[0]
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    remote = [ref for ref in auto_map.values() if isinstance(ref, str) and ref.rpartition(".")[2] == arch]
    torch, transformers = _import()
    _quiet(transformers)
    folder = os.path.dirname(os.path.abspath(path))
    if remote and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        with clients.quiet(f"importing {arch}'s code from the checkpoint"):
            cls = get_class_from_dynamic_module(remote[0], folder)
            config_ref = auto_map.get("AutoConfig")
            config_cls = get_class_from_dynamic_module(config_ref, folder) if config_ref else cls.config_class
    else:
        cls = getattr(transformers, arch, None)
        if cls is None and (remote or auto_map):
            raise MappingError(f"{arch} is a custom architecture (its code is in the checkpoint, auto_map); statekit "
                               "runs it only when asked: re-run with --trust-remote-code, or give --names FILE", path)
        if cls is None:
            raise MappingError(f"transformers {transformers.__version__} has no class {arch}: install the release that "
                               f"wrote the checkpoint ({config.get('transformers_version', 'unknown')}), "
                               "or give --names FILE", path)
        config_cls = cls.config_class
    try:
        with clients.quiet(f"building {arch} on the meta device"), torch.device("meta"):
            cfg = config_cls.from_dict({k: v for k, v in config.items() if k not in ("auto_map", "quantization_config")})
            model = cls(cfg)
            if wrap is not None:
                model = wrap(model)
    except MappingError:
        raise
    except Exception as exc:  # the model's own code: any failure is reported, never a traceback
        raise MappingError(f"cannot build {arch} from its config on the meta device "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", path) from None
    written = config.get("transformers_version")
    return Built(model, arch, written if isinstance(written, str) else None, torch, transformers)


def define(model, arch: str, written_by: str | None, source: str, torch, transformers, *,
           trace: bool = False) -> Definition:
    """A built model's :class:`Definition`: its parameters in ``named_parameters()`` order with their
    owning module classes and layouts (the class table first, the forward where it does not say),
    its tied aliases and Trainer's possible decay splits."""
    params = []
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        params.append(DefinedParam(name, tuple(p.shape), type(owner).__name__, _layout(owner, name, p, torch),
                                   trainable=bool(p.requires_grad)))
    firsts = {id(p): n for n, p in model.named_parameters()}
    tied = {n: firsts[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if firsts[id(p)] != n}
    definition = Definition(arch, params, tied, written_by, transformers.__version__, source)
    _forward_layouts(definition, model, torch, always=trace)
    definition.decays = _decays(model, torch, version_tuple(written_by))
    definition.warnings = builder_warnings(transformers.__version__, torch.__version__)
    return definition


def _needs_forward(p: DefinedParam) -> bool:
    """A trainable weight whose module class does not say how it is used."""
    return p.trainable and len(p.shape) >= 2 and p.layout in (OTHER, None)


def _forward_layouts(definition: Definition, model, torch, always: bool = False) -> None:
    """Layouts the class table leaves open, from how the forward uses each weight (hf_trace); every
    weight the class table decided is cross-checked on the way. Run only when needed (``always``: run)."""
    from statekit.frameworks import hf_trace

    if not always and not any(_needs_forward(p) for p in definition.params):
        return
    names = (OUT_IN, IN_OUT, EMBEDDING, NORM, CONV, EXPERTS, EXPERTS_IN_OUT)
    follow = {id(p): (n, p.dim()) for n, p in model.named_parameters()}
    try:
        with clients.quiet(f"running {type(model).__name__}'s forward on the meta device"):
            uses = hf_trace.trace(_traceable(model), follow, lambda: _inputs(model, torch))
    except hf_trace.TraceError as exc:
        definition.traced = f"the forward could not be run on the meta device ({exc})"
        definition.params = [replace(p, problem=f"{p.module}: its class does not say how the weight is used, and "
                                     f"{definition.traced}") if _needs_forward(p) else p for p in definition.params]
        return
    decided = 0
    out = []
    for p in definition.params:
        if not p.trainable or len(p.shape) < 2:
            out.append(p)
            continue
        traced = hf_trace.layout_of(len(p.shape), uses.seen.get(p.name, set()), names)
        if _needs_forward(p):
            if traced.layout is not None:
                decided += 1
                out.append(replace(p, layout=traced.layout, layout_from=BY_FORWARD))
            else:
                why = traced.conflict or traced.words
                out.append(replace(p, layout=None, problem=f"{p.module}: its class does not say how the weight is "
                                                           f"used, and the forward: {why}"))
        elif traced.conflict or (traced.layout is not None and traced.layout != p.layout):
            said = traced.conflict or traced.words
            out.append(replace(p, layout=None, problem=f"{p.module} makes it {_LAYOUT_WORDS.get(p.layout, p.layout)} "
                                                       f"but the forward: {said}"))
        else:
            out.append(replace(p, layout_from=BY_BOTH) if traced.layout is not None else p)
    definition.params = out
    agreed = sum(1 for p in out if p.layout_from == BY_BOTH)
    definition.traced = (f"the forward traced on the meta device ({uses.calls} calls): {decided} "
                         f"layout{'s' if decided != 1 else ''} decided by it, {agreed} of the class table's confirmed")


_LAYOUT_WORDS = {OUT_IN: "a [out, in] Linear weight", IN_OUT: "a [in, out] weight", EMBEDDING: "an embedding",
                 NORM: "a norm's", CONV: "a convolution's", EXPERTS: "[experts, out, in]",
                 EXPERTS_IN_OUT: "[experts, in, out]"}


def _traceable(model):
    """The model, with its experts (transformers v5) computed by batched matrix products: the same
    weights in the same orientation, without the eager loop's data-dependent expert selection."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    setter = getattr(inner, "set_experts_implementation", None)
    if setter is not None:
        try:
            setter("batched_mm")
        except Exception:  # noqa: BLE001 - a model without experts, or a release without that implementation
            pass
    return model


def _inputs(model, torch) -> dict:
    """A forward's smallest inputs on the meta device: one sequence of 4 tokens."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    if main != "input_ids":
        raise _no_inputs(main)
    out = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids
    return out


def _no_inputs(main: str):
    from statekit.frameworks.hf_trace import TraceError

    return TraceError(f"its forward takes {main}, and statekit traces models that take token ids")


def builder_warnings(transformers_version: str, torch_version: str) -> list[str]:
    """One line per library that built the definition from a release outside the tested range
    (:data:`statekit.versions.TESTED`): the definition is used all the same."""
    out = []
    for dist, version in (("transformers", transformers_version), ("torch", torch_version)):
        line = versions.outside(dist, version)
        if line:
            out.append(f"{line}; the model's definition was built with it")
    return out


def _quiet(transformers) -> None:
    try:
        transformers.logging.set_verbosity_error()
    except AttributeError:  # pragma: no cover - every release has it
        pass


def _is_norm(owner, torch) -> bool:
    nn = torch.nn
    if isinstance(owner, nn.LayerNorm | nn.GroupNorm | nn.modules.batchnorm._BatchNorm):
        return True
    if isinstance(owner, getattr(nn, "RMSNorm", ())):
        return True
    if isinstance(owner, nn.modules.instancenorm._InstanceNorm):
        return False  # burn-store renames no InstanceNorm (names-and-layouts.md §4.1)
    name = type(owner).__name__.lower()
    return name.endswith(("norm", "layernorm", "rmsnorm")) and all(
        p.dim() == 1 for p in owner.parameters(recurse=False))


def _layout(owner, name: str, p, torch) -> str:
    nn = torch.nn
    leaf = name.rpartition(".")[2]
    if isinstance(owner, nn.Linear):
        return OUT_IN if leaf == "weight" else VECTOR
    if type(owner).__name__ == "Conv1D" and getattr(owner, "nf", None) is not None:  # transformers.pytorch_utils
        return IN_OUT if leaf == "weight" else VECTOR
    if isinstance(owner, nn.Embedding):
        return EMBEDDING
    if _is_norm(owner, torch):
        return NORM
    if isinstance(owner, nn.modules.conv._ConvNd):
        return CONV
    if p.dim() == 3 and isinstance(getattr(owner, "is_transposed", None), bool):  # transformers' experts decorator
        return EXPERTS_IN_OUT if owner.is_transposed else EXPERTS
    return VECTOR if p.dim() <= 1 else OTHER


def _decays(model, torch, version) -> list[Decay]:
    """Trainer's possible splits: the writer's rule first (for ≤4.52 with and without the model's
    own norm classes counted as ALL_LAYERNORM_LAYERS, which depended on the modeling file)."""
    nn = torch.nn
    own_norms = tuple({type(m) for m in model.modules() if _is_norm(m, torch) and not isinstance(m, nn.LayerNorm)})
    writer = rule_for(version)
    rules = [writer] + [r for r in DECAY_RULES if r is not writer]
    out: list[Decay] = []
    for rule in rules:
        variants = [("nn.LayerNorm", (nn.LayerNorm,))]
        if rule.layer_norms == "all" and own_norms:
            variants.append((" and ".join(["nn.LayerNorm"] + sorted(c.__name__ for c in own_norms)),
                             (nn.LayerNorm,) + own_norms))
        for label, types in variants:
            out.append(Decay(rule, frozenset(_decay_names(model, rule, types)), label))
    return out


def _decay_names(model, rule: DecayRule, types: tuple) -> list[str]:
    """transformers' get_parameter_names + get_decay_parameter_names, as the rule's release had them."""
    compiled = [re.compile(p) for p in rule.patterns] if rule.regex else None

    def banned(name: str) -> bool:
        text = name.lower() if rule.lower else name
        if compiled is not None:
            return any(c.search(text) for c in compiled)
        return any(p in text for p in rule.patterns)

    def names(module) -> list[str]:
        result = []
        for child_name, child in module.named_children():
            for n in names(child):
                full = f"{child_name}.{n}"
                if not isinstance(child, types) and (not rule.lower or not banned(full)):
                    result.append(full)
        result += [k for k in module._parameters if not rule.lower or not banned(k)]
        return result

    found = names(model)
    if not rule.lower:  # ≤4.48: the "bias" test on the whole names, after the walk
        found = [n for n in found if not banned(n)]
    return found


# ----------------------------------------------------------------------------- naming a state

def _fmt(shape) -> str:
    return "no state" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _mismatch(groups: list[list], expected: list[list[str]], by_name: dict[str, DefinedParam]) -> str | None:
    """The first disagreement between a state's groups (shapes) and the names a rule gives (None: none)."""
    offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
    if len(groups) != len(expected):
        return f"the optimizer has {len(groups)} param groups, the definition gives {len(expected)}"
    for g, (have, want) in enumerate(zip(groups, expected, strict=True)):
        for k, (shape, name) in enumerate(zip(have, want, strict=False)):
            if shape is not None and tuple(shape) != by_name[name].shape:
                return (f"position #{offsets[g] + k} (group {g} position {k}) holds {_fmt(shape)} state but {name} "
                        f"is {_fmt(by_name[name].shape)}")
        if len(have) != len(want):
            return (f"group {g} has {len(have)} positions, the definition puts {len(want)} parameters there "
                    f"(first difference at position #{offsets[g] + min(len(have), len(want))})")
    return None


def _trainer_like(state) -> bool:
    """Trainer's two groups: weight decay, then 0.0 (names-and-layouts.md §2.1)."""
    return len(state.groups) == 2 and state.groups[1].hyperparams.get("weight_decay") in (0, 0.0)


def name_state(state, definition: Definition, path: str | None = None):
    """Name every position of a torch ``state`` from ``definition`` and give each its module and layout.

    Trainer's two groups are placed by its decay rule (the writer's release first; another rule or
    layer-norm variant only when it alone fits); any other grouping by ``named_parameters()`` order
    and shapes. Every shape is checked; a disagreement is a NamesError naming the position.
    """
    from statekit.frameworks import torch_names

    groups = torch_names.state_groups(state)
    by_name = definition.by_name()
    src = definition.source
    if _trainer_like(state):
        fits: dict[tuple, list[Decay]] = {}
        first_bad = None
        trainable = definition.trainable()  # Trainer builds its groups from the requires_grad parameters
        for decay in definition.decays:
            expected = [[p.name for p in trainable if p.name in decay.decayed],
                        [p.name for p in trainable if p.name not in decay.decayed]]
            bad = _mismatch(groups, expected, by_name)
            if bad is None:
                fits.setdefault(tuple(tuple(g) for g in expected), []).append(decay)
            elif first_bad is None:
                first_bad = (decay, bad)
        if not fits:
            decay, bad = first_bad
            raise torch_names.NamesError(
                f"the optimizer's param groups do not fit {definition.architecture} as Trainer groups it "
                f"({decay.rule.label}; nor by any other release's rule): {bad}", path)
        if len(fits) > 1:
            splits = list(fits)
            differ = [n for n in definition.by_name() if (n in splits[0][0]) != (n in splits[1][0])]
            raise torch_names.NamesError(
                f"Trainer's groups fit {definition.architecture} under more than one release's decay rule, and they "
                f"place {', '.join(differ[:4])} differently: give --names FILE listing the optimizer's parameters "
                "(--names-order optimizer)", path, ambiguous=True)
        (names, decays), = fits.items()
        decay = decays[0]
        writer = rule_for(version_tuple(definition.written_by))
        how = f"Trainer's decay / no-decay groups by the rule of {decay.rule.label}"
        if decay.rule is not writer:
            how += f" (config.json says transformers {definition.written_by}, whose rule does not fit; this one alone does)"
        if decay.rule.layer_norms == "all":
            how += f", {decay.variant} as ALL_LAYERNORM_LAYERS"
        names = [list(g) for g in names]
    else:
        order = torch_names.ModelOrder([torch_names.ModelEntry(p.name, p.shape) for p in definition.params],
                                       ordered=True, source=f"{src} (named_parameters() order)")
        names = torch_names.resolve(groups, order).names
        how = "named_parameters() order, shapes matching"
    flat = [n for g in names for n in g]
    positional = torch_names.ModelOrder([torch_names.ModelEntry(n, by_name[n].shape) for n in flat], ordered=True,
                                        source=src, positional=True)
    res = torch_names.name_state(state, positional, path)
    for p in state.params:
        d = by_name.get(p.path)
        if d is not None:
            p.module, p.layout, p.layout_from, p.layout_problem = d.module, d.layout, d.layout_from, d.problem
    res.source, res.how = definition.describe(), how
    if definition.traced:
        res.notes.append(definition.traced)
    state.names_from = res.describe()
    version = version_tuple(definition.written_by)
    if version is not None and version != version_tuple(definition.built_with):
        res.notes.append(f"the checkpoint was written by transformers {definition.written_by}; its definition was "
                         f"built with {definition.built_with} (every shape and group checked)")
    state.notes.extend(res.notes)
    return res
