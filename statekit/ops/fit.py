"""``fit``: a torch optimizer state fitted to a changed trainable set or a new optimizer split.

A state saved before a freeze / unfreeze, a LoRA ``modules_to_save`` change, or before one AdamW
became Muon + AdamW is fitted to the optimizer the next run builds. The new model (``--model``)
gives the parameters in ``named_parameters()`` order; ``--trainable`` / ``--frozen`` globs (or the
model's own ``requires_grad``, for a peft adapter) say which are trained; ``--group`` globs (or the
state's own groups) say how they are grouped. Every trainable parameter then is:

- **kept**: in the state under the same name with the same shape: its state is copied unchanged
  and its position renumbered to the new optimizer's (group by group, in the order the groups are
  given, ``named_parameters()`` order inside a group: what ``torch.optim`` numbers);
- **new**: not in the state: no state entry at all, which is what torch holds for a parameter
  never stepped (its first step creates step 0 and zero moments, then takes step 1);
- **refused**: in the state with another shape (nothing is guessed), unless ``resize``: in the same
  rank its elementwise state is padded (new elements start as a new parameter's: zero moments) or
  truncated, the leading block kept, the step kept — a grown vocabulary;

and every parameter of the state that is not trainable now is **dropped** (listed).

``--reset-step``: every kept parameter's step restarts at 0, its moments kept, so that the whole
fitted state counts its steps from 0 as the new parameters do (Adam's bias correction then treats
the kept moments as one step old at the next update). Without it each keeps its own step.

``--optimizer muon`` over an Adam/AdamW state (speculators #1066: the 2-D matrices go to Muon):
Muon keeps only ``momentum_buffer``, updated ``buf.lerp_(grad, 1 - momentum)`` — the very
recursion of Adam's ``exp_avg`` with β1 = momentum. ``--momentum-from exp_avg`` carries each kept
``exp_avg`` as the buffer (refused unless the group's momentum equals the state's β1: then the
buffer is exactly what Muon would hold after the same gradients); ``--momentum-from fresh`` starts
every buffer at zero. ``exp_avg_sq`` and ``step`` are dropped either way (Muon keeps neither). Nothing
is carried without one of the two said.

The plan (a JSON-able dict) is made first and returned with the result; the file is written
atomically by the torch writer ``convert`` uses.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.ops.merge import MAX_NAMED, save_state
from statekit.ops.options import parse_setting
from statekit.ops.progress import ProgressFactory, silent
from statekit.state import GLOB_CHARS, OptimizerState, ParamGroup, ParamState, matches, refuse_unusable

ADAM_FAMILIES = ("adam", "adamw")
MOMENTUM_FROM = ("exp_avg", "fresh")
NEW_POLICY = ("no state entry: torch creates it at the parameter's first step (step 0, zero moments), "
              "as for any parameter never stepped")


@dataclass
class Target:
    """A trainable parameter of the new model, in ``named_parameters()`` order."""

    path: str
    shape: tuple[int, ...]


@dataclass
class GroupSpec:
    """``--group NAME=GLOB[,GLOB...][:KEY=VALUE,...]``."""

    name: str
    patterns: list[str]
    settings: dict[str, object] = field(default_factory=dict)


# ----------------------------------------------------------------------------- what the user gives


def parse_groups(specs: list[str]) -> list[GroupSpec]:
    """``["muon=*.weight:lr=0.02,momentum=0.9", "rest=*"]``; a value with commas (``betas=0.9,0.95``)
    takes the words that follow it up to the next ``KEY=``."""
    out: list[GroupSpec] = []
    for spec in specs or ():
        name, sep, rest = spec.partition("=")
        globs, _, settings = rest.partition(":")
        pats = [p.strip() for p in globs.split(",") if p.strip()]
        name = name.strip()
        if not sep or not name or not pats:
            raise UsageError(f"--group {spec!r}: expected NAME=GLOB[,GLOB...][:KEY=VALUE,...]")
        if any(g.name == name for g in out):
            raise UsageError(f"--group: the group name {name!r} is given twice")
        words: list[str] = []
        for word in (w.strip() for w in settings.split(",")) if settings.strip() else ():
            if "=" in word or not words:
                words.append(word)
            else:
                words[-1] += "," + word
        values = dict(parse_setting(w) for w in words)
        out.append(GroupSpec(name, pats, values))
    return out


def _selected(pattern: str, path: str) -> bool:
    return matches(pattern, path=path)


def trainable_set(model: str, *, trainable: list[str] = (), frozen: list[str] = (), model_config: str | None = None,
                  trust_remote_code: bool = False) -> tuple[list[Target], str, list | None]:
    """The new model's trainable parameters in ``named_parameters()`` order, where they came from, and
    Trainer's possible decay splits of the model (:attr:`hf_model.Definition.decays`; None without a
    definition)."""
    from statekit.frameworks import hf_model, hf_peft

    model = os.fspath(model)
    decays = None
    if not os.path.exists(model):
        raise UsageError(f"--model {model}: no such file or folder")
    adapter_file = os.path.basename(model) in (*hf_peft.WEIGHTS, hf_peft.CONFIG)
    if (os.path.isdir(model) or adapter_file) and hf_peft.adapter_folders(model):
        definition = hf_peft.build(model, model_config=model_config, trust_remote_code=trust_remote_code)
        params = [Target(p.name, tuple(p.shape)) for p in definition.params if p.trainable]
        source = f"the requires_grad parameters of {definition.describe()}"
        decays = definition.decays
    elif (config := (model_config or hf_model.config_path(model)
                     or (model if model.endswith(hf_model.CONFIG) and os.path.isfile(model) else None))):
        definition = hf_model.build(config, trust_remote_code=trust_remote_code)
        params = [Target(p.name, tuple(p.shape)) for p in definition.params]
        source = f"named_parameters() of {definition.describe()}"
        decays = definition.decays
    else:
        with io.open_checkpoint(model) as ckpt:
            if ckpt.model is None:
                raise UsageError(f"{model}: not a model file (it holds {ckpt.format} {ckpt.kind} data)")
            if ckpt.model.order != "named_parameters":
                raise MappingError("its tensors are not in named_parameters() order (safetensors sorts them by name): "
                                   "give the model's folder with its config.json, or a torch state_dict (.pt)", model)
            params, tied = _untied([m for m in ckpt.model.params if not m.buffer])
            source = f"the parameters of {model} (a torch state_dict, in named_parameters() order)"
            if tied:
                source += (", tied aliases left out as named_parameters() leaves them: "
                           + ", ".join(f"{a} (= {b})" for a, b in tied))
    for flag, globs in (("--trainable", trainable), ("--frozen", frozen)):
        idle = [g for g in globs or () if not any(_selected(g, t.path) for t in params)]
        if idle:
            raise UsageError(f"{flag} {', '.join(idle)}: selects no parameter of the model", model)
    if trainable:
        params = [t for t in params if any(_selected(g, t.path) for g in trainable)]
        source += f", those {', '.join(trainable)} select"
    if frozen:
        params = [t for t in params if not any(_selected(g, t.path) for g in frozen)]
        source += f", less those {', '.join(frozen)} select"
    if not params:
        raise MappingError("the model has no trainable parameter left to fit the state to", model)
    return params, source, decays


def _untied(model_params) -> tuple[list[Target], list[tuple[str, str]]]:
    """A state_dict's parameters less the aliases of tied ones (one storage, offset, shape and dtype in the
    file: a tensor saved under two names, ``lm_head.weight`` beside ``wte.weight``), the first name kept
    as ``named_parameters()`` keeps it; and the ``(alias, kept)`` pairs."""
    first: dict[tuple, str] = {}
    out, tied = [], []
    for m in model_params:
        info = m.tensor.info if m.tensor is not None and isinstance(m.tensor.info, Mapping) else {}
        key = (info["storage_key"], info.get("storage_offset"), tuple(m.shape), m.dtype) if "storage_key" in info \
            else None
        if key is not None and key in first:
            tied.append((m.path, first[key]))
            continue
        if key is not None:
            first[key] = m.path
        out.append(Target(m.path, tuple(m.shape)))
    return out, tied


def trainer_groups(args_path: str, targets: list[Target], decays: list | None, model: str) -> list[GroupSpec]:
    """The two groups HF Trainer's ``create_optimizer`` builds over the trainable parameters: those
    ``get_decay_parameter_names`` keeps, with the run's weight decay, then the others with 0.0; both
    with its learning rate, betas and epsilon (``training_args.bin``). Every release's decay rule that
    statekit knows must place the parameters alike, else it is refused (give ``--group``)."""
    from statekit.frameworks import hf_args

    if not decays:
        raise UsageError(f"--training-args: Trainer's decay groups follow the model's module classes (norm layers); "
                         f"{model} holds no model definition: give its Hugging Face folder (config.json) or peft "
                         "adapter folder, or the groups with --group", model)
    args = hf_args.read(args_path)
    optim = hf_args.optim_of(args)
    if optim is not None and not optim.startswith("adamw_torch"):
        raise MappingError(f"TrainingArguments.optim is {optim}: fit builds the groups of torch's AdamW "
                           "(adamw_torch, adamw_torch_fused); give the groups with --group", args_path)
    hp = hf_args.hyperparams(args)
    splits = {tuple(t.path for t in targets if t.path in d.decayed) for d in decays}
    if len(splits) > 1:
        a, b = list(splits)[:2]
        differ = sorted(set(a) ^ set(b))
        raise MappingError(f"Trainer's releases split the trainable parameters differently ({_listed(differ)} decayed "
                           "by one rule, not another): give the groups with --group", model)
    decayed = next(iter(splits))
    wd = hp.pop("weight_decay", None)
    return [GroupSpec("decay", list(decayed), {**hp, **({"weight_decay": wd} if wd is not None else {})}),
            GroupSpec("no_decay", ["*"], {**hp, "weight_decay": 0.0})]


# ----------------------------------------------------------------------------- the fitted state


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else ""
    return ", ".join(items[:MAX_NAMED]) + more


def _plain(value: object) -> object:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return repr(value)


def _muon_defaults() -> dict[str, object]:
    """torch.optim.Muon's own param-group defaults (the installed torch's)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is what reads the .pt
        raise UsageError("--optimizer muon needs torch installed (its Muon's defaults)") from None
    if not hasattr(torch.optim, "Muon"):
        raise UsageError(f"the installed torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9 has)")
    return dict(torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults)


def _hyperparams(spec: GroupSpec | None, sources: list[ParamGroup], base: dict | None, label: str,
                 problems: list[str]) -> dict[str, object]:
    """A new group's hyperparameters: ``base`` (a family change: the new optimizer's defaults), else
    the old groups its members come from, where they agree; then what ``--group`` sets."""
    settings = spec.settings if spec else {}
    if base is not None:
        unknown = [k for k in settings if k not in base]
        if unknown:
            problems.append(f"group {label}: the new optimizer has no hyperparameter {', '.join(unknown)} "
                            f"(it has {', '.join(base)})")
        return {**base, **settings}
    out: dict[str, object] = {}
    keys = list(dict.fromkeys(k for g in sources for k in g.hyperparams))
    unknown = [k for k in settings if k not in keys]
    if unknown and sources:
        problems.append(f"group {label}: the state's optimizer has no hyperparameter {', '.join(unknown)} "
                        f"(it has {', '.join(keys)})")
    for k in keys:
        if k in settings:
            out[k] = settings[k]
            continue
        values = [g.hyperparams.get(k) for g in sources]
        if any(repr(v) != repr(values[0]) for v in values[1:]):
            problems.append(f"group {label}: its parameters come from groups with different {k} "
                            f"({', '.join(repr(v) for v in values)}); say it: --group {label}=…:{k}=VALUE")
            continue
        out[k] = values[0]
    return out


def _refuse(problems: list[str], path: str) -> None:
    if problems:
        raise MappingError("; ".join(problems[:MAX_NAMED]) + (f" (+{len(problems) - MAX_NAMED} more)"
                                                               if len(problems) > MAX_NAMED else ""), path)


def _families(state: OptimizerState, optimizer: str | None, momentum_from: str | None, reset_step: bool,
              path: str) -> tuple[str, str]:
    """``(the state's family, the new optimizer's)``, refusing what fit does not carry."""
    refuse_unusable(state, path, "fit")
    if state.framework != "torch":
        raise MappingError(f"holds {state.framework} state; fit writes torch optimizer state "
                           "(a burn record follows its model with statekit remap --model)", path)
    family = state.family
    if family is None or family == "mixed" or state.global_slots:
        raise MappingError(f"{state.family_label} state: fit moves per-parameter state of one known torch optimizer",
                           path)
    unnamed = [p for p in state.params if not p.path]
    if unnamed:
        raise MappingError(f"{len(unnamed)} positions have no names ({_listed([p.label() for p in unnamed])}): fit "
                           "matches parameters by name; give --names FILE (the old run's named_parameters() names)", path)
    target = (optimizer or family).lower()
    if target != family and not (target == "muon" and family in ADAM_FAMILIES):
        raise UsageError(f"--optimizer {target}: fit keeps the state's {family}, or turns Adam/AdamW into Muon; "
                         f"{family} → {target} is not one it knows how to carry")
    if target != family and momentum_from not in MOMENTUM_FROM:
        raise UsageError(f"{family} → muon: Muon keeps one momentum_buffer, Adam keeps exp_avg and exp_avg_sq; say "
                         "--momentum-from exp_avg (carry exp_avg: Muon's buffer is the same average when momentum = "
                         "β1) or --momentum-from fresh (zero buffers)")
    if target == family and momentum_from is not None:
        raise UsageError("--momentum-from applies to --optimizer muon over an Adam/AdamW state")
    if target != family and reset_step:
        raise UsageError("--reset-step with --optimizer muon: Muon keeps no step count")
    return family, target


def _by_path(state: OptimizerState, targets: list[Target], change: bool, resize: bool,
             path: str) -> dict[str, ParamState]:
    """The state's parameters by name; a name twice, a shape changed (unless ``resize``, in the same rank), or
    a Muon target not 2-D is refused."""
    by_path: dict[str, ParamState] = {}
    for p in state.params:
        if p.path in by_path:
            raise MappingError(f"the state names {p.path} twice (positions {by_path[p.path].key} and {p.key})", path)
        by_path[p.path] = p
    problems: list[str] = []
    seen: set[str] = set()
    for t in targets:
        if t.path in seen:
            problems.append(f"the model names {t.path} twice")
        seen.add(t.path)
        old = by_path.get(t.path)
        if old is not None and old.shape is not None and tuple(old.shape) != t.shape and not (
                resize and len(old.shape) == len(t.shape)):
            problems.append(f"{t.path}: the state's is {list(old.shape)}, the model's {list(t.shape)} (a resized "
                            "tensor: --resize pads its state with fresh elements or truncates it, in the same rank; fit never guesses)")
        if change and len(t.shape) != 2:
            problems.append(f"{t.path}: Muon takes 2-D matrices only, this is {list(t.shape)} (leave it to the "
                            "AdamW part: --frozen or --trainable)")
    _refuse(problems, path)
    return by_path


def _members(state: OptimizerState, targets: list[Target], groups: list[GroupSpec] | None,
             by_path: dict[str, ParamState], path: str) -> tuple[list[list[Target]], list[GroupSpec | None], list[str]]:
    """The new groups' members (``named_parameters()`` order inside each), their specs and names: by the
    first ``--group`` that selects each, else by the state's own groups (a new parameter only where the
    state has one group)."""
    if groups:
        members: list[list[Target]] = [[] for _ in groups]
        unplaced = []
        exact = [{p for p in g.patterns if not GLOB_CHARS & set(p)} for g in groups]  # (--training-args: names)
        globs = [[p for p in g.patterns if GLOB_CHARS & set(p)] for g in groups]
        for t in targets:
            i = next((i for i in range(len(groups))
                      if t.path in exact[i] or any(_selected(pat, t.path) for pat in globs[i])), None)
            if i is None:
                unplaced.append(t.path)
            else:
                members[i].append(t)
        if unplaced:
            raise MappingError(f"{len(unplaced)} trainable parameter{'s are' if len(unplaced) != 1 else ' is'} in no "
                               f"--group: {_listed(unplaced)}; add a glob (a last --group rest='*' takes the others)",
                               path)
        return members, list(groups), [g.name for g in groups]
    members = [[] for _ in state.groups or [None]]
    homeless = []
    for t in targets:
        old = by_path.get(t.path)
        if old is not None:
            members[old.group].append(t)
        elif len(members) == 1:
            members[0].append(t)
        else:
            homeless.append(t.path)
    if homeless:
        raise MappingError(f"new parameter{'s' if len(homeless) != 1 else ''} {_listed(homeless)}: the state has "
                           f"{len(members)} param groups and nothing says which one a new parameter joins; "
                           "give the new groups with --group NAME=GLOB", path)
    used = [i for i, m in enumerate(members) if m]  # a group left without members is dropped
    return [members[i] for i in used], [None] * len(used), [str(i) for i in used]


def fit_state(state: OptimizerState, targets: list[Target], groups: list[GroupSpec] | None = None, *,
              optimizer: str | None = None, momentum_from: str | None = None, reset_step: bool = False,
              resize: bool = False, path: str = "") -> tuple[OptimizerState, dict]:
    """The fitted state and its plan: kept, new, dropped, groups (nothing written)."""
    family, target = _families(state, optimizer, momentum_from, reset_step, path)
    change = target != family
    by_path = _by_path(state, targets, change, resize, path)
    members, specs, names = _members(state, targets, groups, by_path, path)
    old_groups = state.groups or [ParamGroup(keys=[p.key for p in state.params])]
    problems: list[str] = []
    base = _muon_defaults() if change else None
    hyper = []
    for spec, m, name in zip(specs, members, names, strict=True):
        used = sorted({by_path[t.path].group for t in m if t.path in by_path})
        hyper.append(_hyperparams(spec, [old_groups[i] for i in used] or list(old_groups), base, name, problems))
    params: list[ParamState] = []
    kept, new = [], []
    for gi, m in enumerate(members):
        for t in m:
            idx = len(params)
            old = by_path.get(t.path)
            if old is None:
                params.append(ParamState(key=str(idx), index=idx, path=t.path, group=gi, family=target,
                                         declared_shape=t.shape))
                new.append({"name": t.path, "position": idx, "group": names[gi]})
                continue
            moved = dataclasses.replace(old, key=str(idx), index=idx, group=gi, slots=dict(old.slots),
                                        extra=dict(old.extra))
            if change:
                moved = _to_muon(moved, old, hyper[gi], old_groups[old.group].hyperparams, momentum_from, problems)
            elif reset_step and moved.step is not None:
                moved.step = 0
            grown = old.shape is not None and tuple(old.shape) != t.shape
            if grown:
                moved.slots = _resized(moved, tuple(old.shape), t.shape, target, hyper[gi], problems)
            params.append(moved)
            kept.append({"name": t.path, "position": idx, "old_position": int(old.key) if old.key.isdigit() else
                         old.key, "group": names[gi], "step": moved.step, "has_state": bool(moved.slots),
                         **({"resized": [list(old.shape), list(t.shape)]} if grown else {})})
    _refuse(problems, path)
    trained = {t.path for t in targets}
    dropped = [p.path for p in state.params if p.path not in trained]
    out = OptimizerState(family=target, candidates=(target,), params=params,
                         groups=[ParamGroup(hyperparams=h, keys=[p.key for p in params if p.group == i])
                                 for i, h in enumerate(hyper)],
                         hyperparams_stored=True, framework="torch", notes=list(state.notes),
                         torch_names_in_file=True)
    empty = [g.name for g, m in zip(specs, members, strict=True) if g is not None and not m]
    plan = {
        "family": target, "from_family": family, "params": len(params), "new_policy": NEW_POLICY,
        "reset_step": reset_step, "momentum_from": momentum_from,
        "groups": [{"name": names[i], "params": len(m), "hyperparams": {k: _plain(v) for k, v in hyper[i].items()},
                    "patterns": specs[i].patterns if specs[i] else None} for i, m in enumerate(members)],
        "kept": kept, "new": new, "dropped": dropped,
        "warnings": _warnings(empty, new, dropped, reset_step, family if change else None, momentum_from),
    }
    resized = [f"{k['name']} {k['resized'][0]} → {k['resized'][1]}" for k in kept if "resized" in k]
    if resized:
        plan["warnings"].append(f"--resize: {_listed(resized)}: the elements both shapes hold keep their state, new "
                                "ones start fresh (zero moments, as a new parameter's), the step kept; cut ones dropped")
    return out, plan


def _warnings(empty: list[str], new: list[dict], dropped: list[str], reset_step: bool, changed_from: str | None,
              momentum_from: str | None) -> list[str]:
    out = [f"--group {name} selects no trainable parameter: written as an empty group, as torch keeps one "
           "(each parameter goes to the first group that selects it)" for name in empty]
    if new:
        out.append(f"new without state ({NEW_POLICY}): {_listed([n['name'] for n in new])}")
    if dropped:
        out.append(f"dropped (not among the parameters the new optimizer trains): {_listed(dropped)}")
    if reset_step and changed_from is None:
        out.append("--reset-step: every kept parameter's step restarts at 0 with its moments kept; Adam's bias "
                   "correction at the next update treats them as one step old")
    if changed_from is not None:
        out.append(f"{changed_from} → muon: exp_avg_sq and step dropped (Muon keeps neither); momentum_buffer "
                   + ("= the kept exp_avg (the same average of the same gradients: momentum = β1)"
                      if momentum_from == "exp_avg" else "starts at zero for every parameter (--momentum-from fresh)"))
    return out


def _resized(p: ParamState, old: tuple, shape: tuple, family: str, group: dict, problems: list[str]) -> dict:
    """``p``'s slots padded (with what a fresh element starts at) or truncated to ``shape``, leading block kept."""
    from statekit import hyper, stream

    out = {}
    for name, ref in p.slots.items():
        if tuple(ref.shape) == ():
            out[name] = ref  # a per-parameter scalar
            continue
        if tuple(ref.shape) != old:
            problems.append(f"{p.path}: its {name} is {list(ref.shape)}, not shaped like the parameter: --resize "
                            "pads elementwise state only")
            continue
        fill = hyper.fresh_value(family, name, group)
        if fill is None:
            problems.append(f"{p.path}: the new elements of {name} start at a hyperparameter its group does not hold")
            continue
        out[name] = stream.resize(ref, shape, fill)
    return out


def _to_muon(moved: ParamState, old: ParamState, group: dict, old_group: dict, momentum_from: str,
             problems: list[str]) -> ParamState:
    moved.family, moved.candidates, moved.step = "muon", (), None
    moved.extra = {k: v for k, v in moved.extra.items() if not k.startswith("__step")}
    if momentum_from == "fresh" or "exp_avg" not in old.slots:
        moved.slots = {}
        return moved
    beta1 = (old_group.get("betas") or (None,))[0]
    momentum = group.get("momentum")
    if beta1 is None or momentum is None or not math.isclose(float(beta1), float(momentum), rel_tol=0, abs_tol=0):
        problems.append(f"{old.path}: --momentum-from exp_avg carries Adam's average with β1 = {beta1}, Muon's group "
                        f"has momentum = {momentum}: they are the same average only when equal (set momentum={beta1} "
                        "in its --group, or --momentum-from fresh)")
    moved.slots = {"momentum_buffer": old.slots["exp_avg"]}
    return moved


def fit_file(state_path, model, out_path, *, groups: list[str] | list[GroupSpec] | None = None,
             trainable: list[str] = (), frozen: list[str] = (), optimizer: str | None = None,
             momentum_from: str | None = None, reset_step: bool = False, resize: bool = False, dry_run: bool = False,
             names=None, names_order: str | None = None, model_config: str | None = None,
             trust_remote_code: bool = False, key: str | None = None, training_args: str | None = None,
             progress: ProgressFactory | None = None, on_plan=None) -> dict:
    """Fit the optimizer state at ``state_path`` to ``model`` and write it to ``out_path`` (a torch .pt).

    ``names``: a names file or list for the state's positions (when its file has no param_names);
    ``training_args``: a ``training_args.bin`` whose Trainer groups are the new groups (:func:`trainer_groups`);
    ``on_plan(plan)`` is called before anything is written."""
    from statekit.formats import registry

    state_path, out_path = os.fspath(state_path), os.fspath(out_path)
    fmt = registry.from_extension(out_path) if os.path.splitext(out_path)[1] else "torch"
    if registry.framework_of(fmt) != "torch":
        raise UsageError(f"-o {out_path}: fit writes a torch optimizer state (.pt)")
    if os.path.isdir(out_path):
        raise UsageError(f"-o {out_path} is a folder; fit writes one file (OUT.pt)")
    if os.path.exists(out_path) and os.path.exists(state_path) and os.path.samefile(state_path, out_path):
        raise UsageError(f"the output {out_path} is the input; inputs are never overwritten")
    specs = parse_groups(groups) if groups and isinstance(groups[0], str) else list(groups or [])
    targets, source, decays = trainable_set(os.fspath(model), trainable=list(trainable or ()),
                                            frozen=list(frozen or ()), model_config=model_config,
                                            trust_remote_code=trust_remote_code)
    if training_args is not None:
        if specs or optimizer:
            raise UsageError("--training-args gives Trainer's groups of its AdamW: not with --group or --optimizer")
        specs = trainer_groups(os.fspath(training_args), targets, decays, os.fspath(model))
    opts = {"key": key} if key else {}
    with io.open_checkpoint(state_path, **opts) as ckpt:
        if ckpt.optimizer is None:
            raise MappingError(f"holds {ckpt.kind} data, not optimizer state", state_path)
        if names is not None:
            from statekit.ops.convert import name_checkpoint
            from statekit.ops.options import make_options

            name_checkpoint(ckpt, make_options(names=names, names_order=names_order), state_path)
        fitted, plan = fit_state(ckpt.optimizer, targets, specs, optimizer=optimizer, momentum_from=momentum_from,
                                 reset_step=reset_step, resize=resize, path=state_path)
        plan = {"input": state_path, "model": os.fspath(model), "trainable_from": source, "output": out_path,
                "format": fmt, **plan, "dry_run": dry_run, "written": False, "bytes": None}
        plan["warnings"] = list(ckpt.warnings) + plan["warnings"]
        if on_plan is not None:
            on_plan(plan)
        if dry_run:
            return plan
        total = sum(p.nbytes for p in fitted.params)
        with (progress or silent)("writing", total, unit_bytes=True) as advance:
            plan["bytes"] = save_state(fitted, out_path, {}, fmt, progress=advance)
        plan["written"] = True
    return plan
