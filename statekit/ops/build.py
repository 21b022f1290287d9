"""Build a :class:`~statekit.ops.plan.Plan` from a source state and the user's options.

The same builder serves ``convert`` (a new format, same model) and ``remap`` (a new model): it
decides every parameter's target path (rename rules, presets), identity (burn ParamId or torch
position), layout (transpose), shape (resize) and the target hyperparameters, and refuses
whatever it would otherwise have to guess, listing every conflict at once.
"""

from __future__ import annotations

import re

from statekit import hyper, naming, paramid, versions
from statekit.errors import MappingError, UsageError
from statekit.formats import registry
from statekit.frameworks import bnb
from statekit.ops import crossing as cross
from statekit.ops.options import Options
from statekit.ops.plan import ParamAction, Plan
from statekit.ops.rules import NORM_PRESET, RenameRule, matches_any, rename
from statekit.state import OptimizerState, ParamState, refuse_unusable

MEGATRON_NOTE = "Megatron GPT → Hugging Face"  # statekit.ops.megatron_hf's map notes start so

# burn-store's PyTorchToBurnAdapter renames a norm layer's weight/bias (decided here by the module class)
NORM_RENAMES = {"weight": "gamma", "bias": "beta"}
# torch families statekit reads but does not convert (their state or update is not modelled)
NOT_CONVERTED = ("asgd", "rprop", "sparseadam")


def resolve_families(state: OptimizerState, optimizer: str | None) -> OptimizerState:
    """``state`` with ``--optimizer`` applied part by part where its parameters hold several
    families' state (a burn record with Muon for the matrices and AdamW for the rest, whose
    velocity fields are also SGD's: ``--optimizer muon`` settles those and leaves the others as
    they are; ``muon,adamw`` settles both). A state of one family is returned unchanged."""
    if not optimizer or state.family != "mixed" or not state.ambiguous:
        return state
    return state.resolved(optimizer)


def _family(state: OptimizerState, opts: Options, crossing: bool, dst_fw: str = "neutral",
            target_format: str | None = None) -> str:
    family = _chosen_family(state, opts, crossing)
    if not (target_format in BNB_FORMATS and family in bnb.SLOTS):  # bitsandbytes has Lion where torch has none
        cross.refuse_missing(family, state.framework, dst_fw)
    return family


def _chosen_family(state: OptimizerState, opts: Options, crossing: bool) -> str:
    from statekit.frameworks import torch_thirdparty

    if torch_thirdparty.is_foreign(state):  # convert and remap adapt it first (torch_thirdparty.adapt)
        raise MappingError(f"{state.family_label} state: statekit moves it only through convert or remap, as the "
                           "optimizer that continues it")
    family = state.family
    wanted = opts.optimizer.lower() if opts.optimizer else None
    if family is None and wanted and state.candidates:  # a name that is not a candidate is refused, naming them
        state.settle(wanted)  # the user settles what the file cannot tell (an older torch's Adam or AdamW,
        return wanted  # a bitsandbytes one-state optimizer: its state1 gets that family's name)
    if family == "mixed" and any(g.family for g in state.groups):
        if wanted:
            state = resolve_families(state, wanted)
        if state.family == "mixed":
            raise MappingError(f"the record holds several optimizers, one per parameter group ({state.family_label}); "
                               "statekit does not convert such a record yet")
        family = state.family
        wanted = None if family == wanted or family in (wanted or "").split(",") else wanted
    if family in (None, "mixed"):
        label = state.family_label if state.family_detail else "mixed or unknown layouts"
        raise MappingError(f"the optimizer family could not be determined from the file: {label}; "
                           "statekit converts only states it recognises exactly")
    if state.framework == "torch" and family in NOT_CONVERTED and not crossing:
        from statekit.frameworks.torch_families import class_name

        raise MappingError(f"{class_name(family)} state: statekit reads it but does not convert it")
    if wanted:
        allowed = set(state.candidates) | {family}
        if wanted not in allowed:
            from statekit.frameworks.torch_families import BY_NAME

            known = sorted({lay.family for fw in naming.FRAMEWORKS.values() for lay in fw}
                           | {a for fw in naming.FRAMEWORKS.values() for lay in fw for a in lay.also} | set(BY_NAME))
            if wanted not in known:
                raise UsageError(f"--optimizer {wanted}: not an optimizer statekit knows; the file holds "
                                 f"{state.family_label} state (known: {', '.join(known)})")
            raise UsageError(f"--optimizer {wanted}: the file holds {state.family_label} state, not {wanted} "
                             f"(say --optimizer {' or '.join(sorted(allowed))})")
        return wanted
    if crossing and len(state.candidates) > 1:
        raise UsageError(
            f"{' and '.join(state.candidates)} keep identical state in {state.framework}; "
            f"say which with --optimizer {'|'.join(state.candidates)}"
        )
    return family


def _same_shapes(p: ParamState) -> str | None:
    """Why the slots of a parameter differ in rank (transposes and resizes apply to every slot alike), or
    None. Factored state (Adafactor's row_var [n, 1] and col_var [1, m]) keeps one rank and passes."""
    shapes = {name: list(ref.shape) for name, ref in p.slots.items() if ref.shape}  # scalars (NAdam's mu_product) aside
    if len({len(s) for s in shapes.values()}) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        return f"parameter {p.label()}: its state slots differ in rank ({listed})"
    return None


def _slots_missing(p: ParamState, family: str, target: str, src: str = "neutral") -> tuple[str, ...]:
    """The slots of ``p`` the target framework's state has no field for (refused, never dropped)."""
    if target not in naming.FRAMEWORKS:
        return ()
    lay = naming.layout(target, family)
    neutral = set(lay.native_of())
    return tuple(s for s in p.slots if s not in neutral and s not in _derived(family))


def _grouped(by_problem: dict[tuple, list[str]], say) -> list[str]:
    """One problem line per distinct problem, naming the parameters it concerns (a few, then a count)."""
    out = []
    for key, labels in by_problem.items():
        more = f" (+{len(labels) - 3} more)" if len(labels) > 3 else ""
        out.append(say(key, f"{', '.join(labels[:3])}{more}"))
    return out


def _derived(family: str) -> frozenset[str]:
    """Slots a target can drop because they are recomputed from others (burn RMSProp's ``avg``)."""
    return naming.derived_slots(family)


BNB_FORMATS = ("bnb", "bnb-flat", "bnb-2048")


def _check_library(state: OptimizerState, family: str, dst_fw: str, target_format: str) -> None:
    """A bitsandbytes state moves only to an optimizer that continues it: refused by name otherwise."""
    if state.library != bnb.LIBRARY or target_format in BNB_FORMATS or dst_fw not in naming.FRAMEWORKS:
        return
    try:
        naming.layout(dst_fw, family)
    except KeyError:
        raise MappingError(f"bitsandbytes {family} state: {dst_fw} has no {family} optimizer to continue it"
                           + (" (burn's Lion does: convert to .bpk)" if family == "lion" and dst_fw == "torch" else ""),
                           ) from None


def _library_notes(state: OptimizerState, family: str, target_format: str, plan: Plan) -> None:
    """What a bitsandbytes side of the conversion does to the values, said in the plan."""
    eight = sorted({enc.block for p in state.params for enc in p.encoding.values() if enc.bits == 8})
    if state.library == bnb.LIBRARY and eight:
        plan.warnings.append("bitsandbytes 8-bit moments (blocks of " + " and ".join(map(str, eight)) + ") become "
                             "float32 exactly as bitsandbytes' dequantize_blockwise gives them (the file's own "
                             "qmap and absmax)")
    if state.library == bnb.LIBRARY and family == "sgd":
        damp = sorted({b[1] for g in state.groups if len(b := tuple(g.hyperparams.get("betas") or ())) == 2 and b[1]})
        if damp:  # its kernels step s = momentum·s + g whatever the dampening
            plan.warnings.append(f"bitsandbytes' SGD stores dampening {', '.join(f'{d:g}' for d in damp)} but its "
                                 "kernels ignore it: continued with dampening 0, as bitsandbytes stepped")
    if target_format in BNB_FORMATS:
        for h in plan.hyperparams:
            bnb.bnb_group(family, h, target_format == "bnb-2048")  # refused now, before any byte is written
        block = 2048 if target_format == "bnb-2048" else 256
        if any(p.stored_as and p.stored_as[0] == 8 and p.stored_as[1] == block for p in state.params):
            plan.warnings.append("moments bitsandbytes stored in 8 bits get back their own codes and scales (recovered "
                                 "where they give the values back bit for bit; elsewhere bitsandbytes' CPU quantizer); "
                                 "those it kept in 32 bits, and smaller ones, stay float32")
        else:
            plan.warnings.append(f"moments of parameters with at least {bnb.MIN_8BIT_SIZE} elements quantized to 8 bits "
                                 f"in blocks of {block} by bitsandbytes' CPU quantizer (quantize_blockwise on a CPU, as "
                                 "its 8-bit optimizers do there; its pure-torch quantizer differs on a few codes); "
                                 "smaller ones, and those the source keeps in 32 bits, stay float32")
        plan.warnings.extend(_installed_bnb(target_format))


def _installed_bnb(target_format: str) -> list[str]:
    """What the bitsandbytes installed here writes, when it is not the layout asked for (--to), and
    its release when it lies outside the tested range (statekit.versions); nothing without one."""
    have = versions.installed("bitsandbytes")
    version = versions.parse(have)
    if version is None:
        return []
    out = [line] if (line := versions.outside("bitsandbytes", have)) else []
    own = bnb.format_for(version)
    if own != target_format:
        out.append(f"--to {target_format} writes the layout of {bnb.LAYOUTS[target_format][1]}; the installed "
                   f"bitsandbytes {have} writes that of {bnb.LAYOUTS[own][1]}: --to {own} for it")
    return out


# torch keeps param_names in each param group since 2.6 (optimizers built from named_parameters())
PARAM_NAMES_FROM = (2, 6)


def _installed_torch(plan: Plan, target_format: str) -> None:
    """A torch .pt with param_names, for an installed torch older than the release that reads them."""
    have = versions.installed("torch")
    if (target_format != "torch" or plan.metadata.get(hyper.OMIT_NAMES_KEY) == "omit" or have is None
            or versions.at_least("torch", PARAM_NAMES_FROM)
            or not all(a.dst_path for a in plan.params if a.action != "drop")):
        return
    plan.warnings.append(f"each param group keeps param_names, as torch >= 2.6 writes them; the installed torch "
                         f"{have} loads them as a group key it does not use")


def build_plan(state: OptimizerState, source: str, source_format: str, target: str, target_format: str,
               opts: Options, operation: str = "convert") -> Plan:
    """The plan for moving ``state`` to ``target``: every name, identity, layout and
    hyperparameter decided, or a MappingError listing every conflict at once."""
    refuse_unusable(state, source, operation)
    src_fw = state.framework
    dst_fw = registry.framework_of(target_format)
    crossing = src_fw != dst_fw and dst_fw != "neutral"
    family = _family(state, opts, crossing, dst_fw, target_format)
    _check_library(state, family, dst_fw, target_format)
    plan = Plan(operation, source, source_format, target, target_format, family)
    plan.names_from = state.names_from
    plan.step_policy, plan.allow_nonfinite = opts.step_policy, opts.allow_nonfinite
    problems: list[str] = []
    actions = _renamed(state, family, src_fw, dst_fw, opts, plan, problems,
                       fields_checked=target_format not in BNB_FORMATS)  # bitsandbytes' writer checks its own
    into: list[ParamAction] = []
    if opts.structure is not None:
        actions, into = _structural(state, family, opts, plan, problems, actions)
    dropped = [a for a in actions if a.action == "drop"]  # nothing in the new model reads them
    actions = [a for a in actions if a.action != "drop"]
    if dst_fw == "torch":
        actions = _order_for_torch(state, actions, opts, problems, plan)
    elif dst_fw in ("burn", "candle", "neutral"):
        _ids_for_burn(state, actions, opts, problems, plan, dst_fw)
    _check_duplicates(actions, problems)
    cross_layout = crossing and {src_fw, dst_fw} in ({"burn", "torch"}, {"burn", "candle"})
    _layout(state, actions, opts, cross_layout, dst_fw, plan, problems)
    if problems:
        raise MappingError("; ".join(problems), source)
    actions += dropped + into
    plan.params = actions
    _hyperparams(state, family, src_fw, dst_fw, opts, plan)
    _resize_warning(plan)
    _library_notes(state, family, target_format, plan)
    _training_args(state, plan, dst_fw)
    flips = [a for a in actions if any(n.endswith(DEFINITION_NOTES) for n in a.notes)]
    if flips:
        traced = sum(1 for a in flips if any(n.endswith(DEFINITION_NOTES[1:]) for n in a.notes))
        plan.layouts_from = (f"layouts and norm names from the module classes of the model's definition: "
                             f"{sum(1 for a in flips if a.transpose)} transposed, "
                             f"{sum(1 for a in flips if not a.transpose and a.src_path != a.dst_path)} renamed, "
                             f"{len(flips)} decided in all"
                             + (f"; {traced} by or checked against the forward, traced on the meta device" if traced
                                else ""))
    solved = state.torch_names_in_file is False  # a torch file without param_names (statekit named it)
    if dst_fw == "torch" and solved and operation == "convert" and opts.names is None and opts.model is None:
        # back to torch with nothing said about names: the original kept no param_names, nor does its copy
        plan.metadata[hyper.OMIT_NAMES_KEY] = "omit"
    if dst_fw == "burn" and src_fw == "torch" and solved:
        plan.metadata[hyper.TORCH_NAMES_KEY] = "0"
    if dst_fw == "burn" and state.library_format in BNB_FORMATS:  # converting back writes that library's layout
        plan.metadata[hyper.LIBRARY_KEY] = bnb.library_record(state, actions)
    if dst_fw == "burn" and src_fw == "torch" and operation == "convert":  # torch's param_names survive the trip
        plan.metadata.update(hyper.paths_to_metadata(
            {a.dst_id: a.src_path for a in actions if a.dst_id and a.src_path and a.action in ("keep", "rename")}))
    _installed_torch(plan, target_format)
    return plan


def _renamed(state, family, src_fw, dst_fw, opts, plan, problems, fields_checked: bool = True) -> list[ParamAction]:
    """One action per source parameter with its target path: the user's rename rules, then the
    norm preset when crossing burn ⇄ torch; slots the target cannot hold are problems."""
    rules = [RenameRule.parse(r) for r in opts.renames]
    if not rules:  # back to the framework the file came from: its recorded names (a --rename overrides)
        rules = [RenameRule("^" + re.escape(to) + "$", frm, origin="record")
                 for to, frm in opts.recorded_names if "$" not in frm and "\\" not in frm]
    if opts.preset and src_fw == "burn" and dst_fw in ("torch", "candle"):
        rules += [RenameRule(pat, rep, origin="preset") for pat, rep in NORM_PRESET]
    old_paths = opts.old_model.by_id() if opts.old_model else {}
    actions: list[ParamAction] = []
    no_field: dict[tuple, list[str]] = {}
    if dst_fw in naming.FRAMEWORKS and fields_checked:
        try:
            naming.layout(dst_fw, family)
        except KeyError:
            raise MappingError(f"{dst_fw} has no {family} optimizer: this state cannot move to {dst_fw}",
                               plan.source) from None
    for p in state.params:
        src_path = p.path
        if src_path is None and p.id is not None and p.id in old_paths:
            src_path = old_paths[p.id].path
        dst_path = rename(src_path, rules)
        notes = []
        if dst_path == src_path and src_path and opts.preset and src_fw == "torch" and dst_fw == "burn" \
                and p.layout == "norm" and src_path.rpartition(".")[2] in NORM_RENAMES:
            head, _, leaf = src_path.rpartition(".")
            dst_path = f"{head}.{NORM_RENAMES[leaf]}" if head else NORM_RENAMES[leaf]
            notes.append(f"{leaf} → {NORM_RENAMES[leaf]}: {p.module} is a norm layer (module class)")
        actions.append(ParamAction(
            action="keep" if dst_path == src_path else "rename",
            src_key=p.key, src_path=src_path, src_shape=list(p.shape) if p.shape is not None else None,
            dst_path=dst_path, group=p.group, notes=notes,
        ))
        if p.slots or p.step is not None:
            uneven = _same_shapes(p)
            if uneven:
                problems.append(uneven)
            missing = _slots_missing(p, family, dst_fw, src_fw) if fields_checked else ()
            if missing:
                no_field.setdefault(missing, []).append(p.label())
    problems += _grouped(no_field, lambda m, who: f"{dst_fw}'s {family} state has no field for {', '.join(m)} "
                                                  f"(parameters {who})")
    for rule in rules:
        if rule.matches == 0 and rule.origin == "user":
            plan.warnings.append(f"rename rule {rule.pattern!r} matched no parameter")
    plan.rules = [r.to_json() for r in rules]
    return actions


def _structural(state, family, opts, plan, problems, actions) -> tuple[list[ParamAction], list[ParamAction]]:
    """The map's targets as actions (:mod:`statekit.ops.structural`): a source moved whole, transposed or
    grown keeps its own action, now aimed at its target; sources read into assembled targets leave the
    list (returned apart, shown as ``into``). With a map learned from the weights every new tensor is
    accounted for, so a source nothing reads is dropped; with rules, the rest move by path."""
    from statekit.ops import structural

    smap = opts.structure
    plan.structure = {"origin": smap.origin, "notes": list(smap.notes)}
    targets, into, consumed = structural.actions(smap, state, family, plan, problems)
    single = {a.src_key: a for a in targets if a.action != "assemble"}
    out = []
    for a in actions:
        if a.src_key in single:
            out.append(single[a.src_key])
        elif a.src_key in consumed:
            continue
        elif smap.origin == "weights":
            a.action = "drop"
            out.append(a)
        else:
            out.append(a)
    out += [a for a in targets if a.action == "assemble"]
    if smap.origin == "rules" and any(n.startswith(MEGATRON_NOTE) for n in smap.notes):
        plan.warnings.append("Megatron → Hugging Face names by the run's args (q/k/v per query group, gate/up, "
                             "vocabulary padding stripped): the checkpoint holds no Hugging Face weights to prove "
                             "the map on; its masters were proved against its stored weights when it was read")
    elif smap.origin == "rules":
        plan.warnings.append("structural rules: the map is not proved on weights (give --old-model and --model "
                             "with values to prove it)")
    elif smap.origin == "rules, proved":
        plan.warnings.append("structural rules: proved on the --old-model and --model weights")
    return out, into


def _check_duplicates(actions: list[ParamAction], problems: list[str]) -> None:
    """Two sources onto one target are refused."""
    seen: dict[str, str] = {}
    for a in actions:
        if a.action in ("drop", "new") or a.dst_path is None:
            continue
        if a.dst_path in seen:
            problems.append(f"{seen[a.dst_path]} and {a.src_path or a.src_key} both map to {a.dst_path}")
        seen[a.dst_path] = a.src_path or a.src_key


# what the model's definition makes of a rank-2 tensor (statekit.frameworks.hf_model's layouts, by
# the owning module's class or by how the forward uses it): transposed crossing to burn's Linear
# [in, out] or not, and the words the plan shows
CLASS_LAYOUTS = {
    "out_in": (True, "[out, in], burn's Linear [in, out]"),
    "in_out": (False, "[in, out] as burn's Linear"),
    "embedding": (False, "[num, dim] as burn's Embedding"),
    "norm": (False, "a norm's"),
    "conv": (False, "burn's conv layout"),
}
# 3-D expert weights (transformers v5 mixtures of experts): kept as torch stores them, the orientation said
EXPERT_LAYOUTS = {
    "experts": "[experts, out, in] (each expert's matrix as F.linear takes it)",
    "experts_in_out": "[experts, in, out] (each expert's matrix as burn's Linear has it)",
}
DEFINITION_NOTES = ("(module class)", "(forward)", "(module class; the forward agrees)")


def _decided_by(p: ParamState) -> str:
    return f"({p.layout_from or 'module class'})"


def _transpose(a: ParamAction, shape: tuple, want: tuple | None, opts: Options, p: ParamState | None = None
               ) -> bool | None:
    """Whether a rank-2 state crossing burn ⇄ torch/candle is transposed; None when undecidable.
    The user's globs first, then the owning module's class (from the model's definition), then shapes."""
    if matches_any(a.dst_path, opts.transpose) or matches_any(a.src_path, opts.transpose):
        a.notes.append("layout: --transpose")
        return True
    if matches_any(a.dst_path, opts.no_transpose) or matches_any(a.src_path, opts.no_transpose):
        a.notes.append("layout: --no-transpose")
        return False
    known = CLASS_LAYOUTS.get(p.layout) if p is not None and p.layout else None
    if known is not None:
        flip, words = known
        a.notes.append(f"{p.module} {words} {_decided_by(p)}")
        return flip
    if want is not None and shape[0] != shape[1] and tuple(want) == shape[::-1]:
        a.notes.append("transposed: the target model's shape is the reverse")
        return True
    if want is not None and shape[0] != shape[1] and tuple(want) == shape:
        return False
    return None


def _layout(state, actions, opts, cross_layout: bool, dst_fw: str, plan, problems) -> None:
    """Transposes, target shapes (resize, reset) and casts; undecidable layouts are problems."""
    target_shapes = {m.path: tuple(m.shape) for m in opts.model.params if not m.buffer} if opts.model else {}
    by_key = {p.key: p for p in state.params}
    undecided: list[str] = []
    misfit: list[str] = []
    for a in actions:
        if a.action in ("drop", "new") or a.src_shape is None:
            continue
        if dst_fw == "burn" and a.dst_path is None and a.src_path is None and a.dst_id is None:
            continue  # refused above for having no name at all
        shape = tuple(a.src_shape)
        want = target_shapes.get(a.dst_path) if a.dst_path else None
        if a.structure is not None:  # layout and shape decided by the map
            _mapped_shape(a, want, opts, misfit)
            if opts.dtype and by_key[a.src_key].dtype != opts.dtype:
                a.cast = opts.dtype
            continue
        p = by_key.get(a.src_key)
        if len(shape) == 2 and cross_layout:
            decided = _transpose(a, shape, want, opts, p)
            if decided is None:
                why = f" ({p.layout_problem})" if p is not None and p.layout_problem else ""
                undecided.append(f"{a.src_path or a.src_key} {list(shape)}{why}")
                continue
            a.transpose = decided
        elif len(shape) == 3 and cross_layout and p is not None and p.layout in EXPERT_LAYOUTS:
            a.notes.append(f"{p.module} {EXPERT_LAYOUTS[p.layout]}: kept as torch stores it, burn has no "
                           f"experts module {_decided_by(p)}")
        _target_shape(a, shape[::-1] if a.transpose else shape, want, opts, misfit)
        if opts.dtype and by_key[a.src_key].dtype != opts.dtype:
            a.cast = opts.dtype
    if misfit:
        more = f" (+{len(misfit) - 4} more)" if len(misfit) > 4 else ""
        problems.append(f"{len(misfit)} parameters' state does not fit the target model: {', '.join(misfit[:4])}{more}"
                        + ("" if opts.resize else "; use --resize to pad or truncate"))
    if undecided:
        problems.append(
            "cannot tell which rank-2 parameters are Linear weights (burn stores them [d_in, d_out], "
            f"torch and candle [out, in]): {', '.join(undecided)}; give --transpose GLOB for Linear weights "
            "and --no-transpose GLOB for the others (embeddings), or --model with the target shapes"
        )


ADAM_LIKE = frozenset({"adam", "adamw", "nadam", "radam", "adamax"})  # bias-corrected moments


def _resize_warning(plan: Plan) -> None:
    """What the padded rows of resized parameters do differently from a new parameter's, by family
    (their values are a new parameter's, hyper.FRESH_FROM; their step count is the tensor's)."""
    if not any(a.resize and not a.reset_step for a in plan.params):
        return
    restart = "--reset-step GLOB restarts those parameters' state from step 0"
    if plan.family in ADAM_LIKE:
        plan.warnings.append("padded rows of resized parameters inherit the parameter's step: their first Adam update "
                             "is about (1-β1)/√(1-β2) ≈ 3.16× a fresh parameter's with default betas; " + restart)
    elif plan.family == "sgd":  # a new parameter's buffer starts at its first gradient, a padded row's at 0
        damp = sorted({float(h.get("dampening") or 0) for h in plan.hyperparams} - {0.0})
        if damp:
            plan.warnings.append(
                "padded rows of resized parameters start with a zero momentum buffer where a new parameter's starts "
                f"at its first gradient: with dampening {', '.join(f'{d:g}' for d in damp)} their first update is "
                f"{', '.join(f'{1 - d:g}' for d in damp)}× a new parameter's; " + restart)
    elif plan.family != "muon":  # torch's Muon starts its buffer at zero too: a padded row is a new one
        plan.warnings.append("padded rows of resized parameters inherit the parameter's step count (its decays and "
                             "schedules); " + restart)


def _target_shape(a: ParamAction, out_shape: tuple, want: tuple | None, opts: Options, misfit: list[str]) -> None:
    a.dst_shape = list(out_shape)
    if want is None or tuple(want) == out_shape:
        return
    if opts.resize and len(want) == len(out_shape):
        a.resize = True
        a.dst_shape = list(want)
        a.notes.append(f"resized {list(out_shape)} → {list(want)}")
        if matches_any(a.dst_path, opts.reset_step):
            a.reset_step = True
            a.notes.append("state reset: starts again from step 0 with zero moments")
    else:
        misfit.append(f"{a.dst_path} (state {list(out_shape)}, model {list(want)})")


def _mapped_shape(a: ParamAction, want: tuple | None, opts: Options, misfit: list[str]) -> None:
    """A target the structural map built has the map's shape; the new model must agree."""
    if want is not None and tuple(want) != tuple(a.dst_shape):
        misfit.append(f"{a.dst_path} (the map makes {list(a.dst_shape)}, model {list(want)})")
    if a.resize and matches_any(a.dst_path, opts.reset_step):
        a.reset_step = True
        a.notes.append("state reset: starts again from step 0 with zero moments")


def _order_for_torch(state, actions, opts, problems, plan) -> list[ParamAction]:
    """torch pairs state with parameters by position: fix that position from names or a model."""
    # --names names a torch *source*'s parameters (applied before planning); it orders the target
    # only when the source is another framework.
    names = opts.names if state.framework != "torch" else None
    if names is not None and hasattr(names, "entries"):  # a torch_names.ModelOrder
        names = [e.name for e in names.entries]
    known = getattr(opts.structure, "order", None)  # the map's target model's order (Megatron → HF names)
    if names is None and opts.model is None and known:
        names = known
    elif known and opts.model is not None and opts.model.order == "named_parameters":
        names = [m.path for m in opts.model.params if not m.buffer]
    if names is None and state.framework == "torch" and plan.operation == "convert":
        for i, a in enumerate(actions):  # the same optimizer: every position stays where it is
            a.dst_index = i
        return actions
    if names is None and opts.model is None and state.params and all(
            p.index is not None and p.path for p in state.params):  # torch's order, recorded in the file
        target = {a.src_key: a.dst_path for a in actions}
        names = [target.get(p.key) or p.path for p in sorted(state.params, key=lambda p: p.index)]
    if names is None and opts.model is not None:
        if opts.model.order != "named_parameters":
            problems.append(
                "the --model file keeps no model.named_parameters() order (safetensors sorts tensors by name; a "
                "burn model has burn's order), and PyTorch pairs optimizer state with parameters by position: "
                "give --names FILE in named_parameters() order, or a torch state_dict (.pt/.bin) as --model")
            return actions
        names = [m.path for m in opts.model.params if not m.buffer]
    if names is None:
        # torch.distributed (DCP) keys optimizer state by parameter name: a named state needs no order
        by_name = plan.target_format == "dcp" and all(a.dst_path for a in actions)
        if state.framework == "torch" or by_name:
            for i, a in enumerate(actions):
                a.dst_index = i
            return actions
        problems.append(
            "PyTorch pairs optimizer state with parameters by position: give --names FILE "
            "(model.named_parameters() order) or --model MODEL.pt so statekit can order them")
        return actions
    by_path = {a.dst_path: a for a in actions if a.dst_path}
    unnamed = [a for a in actions if not a.dst_path]
    if unnamed:
        problems.append(f"{len(unnamed)} parameters have no path to match against the names "
                        f"({', '.join('#' + a.src_key for a in unnamed[:5])})")
    ordered: list[ParamAction] = []
    for i, name in enumerate(names):
        a = by_path.pop(name, None)
        if a is None:
            a = ParamAction(action="new", dst_path=name, notes=["no state: torch starts it at step 0"])
        a.dst_index = i
        ordered.append(a)
    absent = []
    for a in by_path.values():
        if opts.allow_drop:
            a.action = "drop"
            ordered.append(a)
        else:
            absent.append(a.dst_path if a.dst_path == (a.src_path or a.src_key) else
                          f"{a.dst_path} (from {a.src_path or a.src_key})")
    if absent:
        more = f" (+{len(absent) - 4} more)" if len(absent) > 4 else ""
        problems.append(f"not among the target's parameters: {', '.join(absent[:4])}{more}")
    # torch numbers ids group after group; each group keeps named_parameters() order
    ordered.sort(key=lambda a: a.group)
    index = 0
    for a in ordered:
        if a.action != "drop":
            a.dst_index = index
            index += 1
    return ordered


def _ids_for_burn(state, actions, opts, problems, plan, dst_fw) -> None:
    # a model without ParamIds (a torch/safetensors file) gives paths and shapes; ids are then generated
    model_ids = {m.path: m.id for m in opts.model.params if m.id is not None} if opts.model else {}
    model_paths = {m.path for m in opts.model.params} if opts.model else set()
    by_key = {p.key: p for p in state.params}
    generated = []
    nameless: list[str] = []
    not_in_model: list[str] = []
    for a in actions:
        p = by_key[a.src_key]
        if opts.model is not None and a.dst_path not in model_paths:
            if state.framework == "torch" and a.dst_path and _reverse_preset(a.dst_path) in model_paths:
                a.dst_path = _reverse_preset(a.dst_path)
                a.action = "rename"
                a.notes.append("torch weight/bias → burn gamma/beta (the target model's names)")
            elif opts.allow_drop:
                a.action = "drop"
                continue
            else:
                not_in_model.append(a.dst_path or a.src_key)
                continue
        if a.dst_path in model_ids:
            a.dst_id = str(model_ids[a.dst_path])
        elif dst_fw == "burn" and p.id is not None and not model_ids:
            a.dst_id = str(p.id)
        elif dst_fw == "burn":
            if not a.dst_path:
                nameless.append(f"#{a.src_key}")
                continue
            a.dst_id = str(paramid.generated(a.dst_path))
            generated.append(a.dst_path)
        elif p.id is not None:
            a.dst_id = str(p.id)
    if not_in_model:
        more = f" (+{len(not_in_model) - 4} more)" if len(not_in_model) > 4 else ""
        problems.append(f"not in the target model: {', '.join(not_in_model[:4])}{more}")
    if nameless:
        more = f" (+{len(nameless) - 3} more)" if len(nameless) > 3 else ""
        why = state.unnamed_why or "name a torch state's positions with --names FILE or --model MODEL"
        problems.append(f"{len(nameless)} parameters have neither a path nor an id ({', '.join(nameless[:3])}{more}); "
                        f"{why}")
    if generated:
        why = "no --model given" if opts.model is None else "the --model file has no ParamIds"
        plan.warnings.append(f"generated ParamIds for {len(generated)} parameters ({why}): "
                             "burn will only match them to a model saved with the same ids")
    if opts.model is not None:
        present = {a.dst_path for a in actions if a.action != "drop"}
        for m in opts.model.params:
            if m.path not in present and not m.buffer:
                actions.append(ParamAction(action="new", dst_path=m.path,
                                           dst_id=None if m.id is None else str(m.id),
                                           dst_shape=list(m.shape), notes=["no state: initialised at its first step"]))


def _training_args(state, plan, dst_fw) -> None:
    """An HF TrainingArguments the source folder holds: recorded with the plan (and in a burnpack's
    metadata); its disagreements with the param groups, which are what the optimizer ran with, warned."""
    args = state.training_args
    if not args:
        return
    from statekit.frameworks import hf_args

    shown = {k: v for k, v in args.items() if k in hf_args.FIELDS and v is not None}
    plan.training_args = shown
    for line in hf_args.compare(args, [g.hyperparams for g in state.groups]):
        plan.warnings.append(f"{hf_args.FILE}: {line} (the param group's value is written)")
    if dst_fw == "burn":
        plan.metadata.update(hyper.training_args_to_metadata(shown))


def _reverse_preset(path: str) -> str:
    for suffix, burn in ((".weight", ".gamma"), (".bias", ".beta")):
        if path.endswith(suffix):
            return path[: -len(suffix)] + burn
    return path


def _hyperparams(state, family, src_fw, dst_fw, opts, plan) -> None:
    """Target groups' hyperparameters: given > stored > the source framework's defaults."""
    given = {k: v for k, v in opts.hyperparams.items() if v is not None}
    has_max = any("max_exp_avg_sq" in p.slots for p in state.params)
    if family in ("adam", "adamw"):
        if given.get("amsgrad") is False and has_max:
            raise MappingError("--no-amsgrad, but the state holds max_exp_avg_sq (AMSGrad) moments")
        if given.get("amsgrad") and not has_max:
            raise MappingError("--amsgrad, but the state holds no max_exp_avg_sq moments; torch would fail at step()")
        given.setdefault("amsgrad", has_max)
    if family == "sgd" and src_fw == "burn" and not any("momentum_buffer" in p.slots for p in state.params):
        given.setdefault("momentum", 0.0)  # burn SGD without momentum keeps no state at all
        given.setdefault("dampening", 0.0)
    if family == "rmsprop" and src_fw == "burn":
        given.setdefault("centered", any("grad_avg" in p.slots for p in state.params))
        if not any("momentum_buffer" in p.slots for p in state.params):
            given.setdefault("momentum", 0.0)
    groups = [type(g)(hyperparams=hyper.neutral(g.hyperparams), keys=g.keys) for g in state.groups or []]
    if state.library == bnb.LIBRARY:  # bitsandbytes packs hyperparameters its own way: in torch's words
        groups = [type(g)(hyperparams=bnb.torch_hyperparams(family, g.hyperparams), keys=g.keys) for g in groups]
    if src_fw == "burn" and len(groups) > 1:  # groups statekit kept in a burn file's metadata
        plan.hyperparams = []
        for g in groups:
            values, assumed = hyper.resolve(family, given, g.hyperparams)
            plan.hyperparams.append(values)
            plan.assumed = sorted(set(plan.assumed) | set(assumed))
    elif src_fw == "burn" or not groups:
        stored = groups[0].hyperparams if groups else {}
        values, assumed = hyper.resolve(family, given, stored or None)
        plan.assumed = assumed
        plan.hyperparams = [values]
    else:
        plan.hyperparams = []
        for g in groups:
            values = dict(g.hyperparams)
            values.update(given)
            plan.hyperparams.append(values)
    if src_fw != dst_fw and dst_fw != "neutral":  # values that change meaning or refuse the crossing
        plan.hyperparams = [cross.target_values(family, src_fw, dst_fw, v, plan.assumed)
                            for v in plan.hyperparams]
        plan.transforms = [t.to_json() for i, v in enumerate(plan.hyperparams)
                           for t in cross.transforms(family, src_fw, dst_fw, v, i)]
        plan.exactness = cross.exactness(family, src_fw, dst_fw)
        scale = cross.muon_scale_differs(family, src_fw, dst_fw, plan.params, plan.hyperparams[0]
                                         if plan.hyperparams else {})
        if scale:
            plan.warnings.append(scale)
            plan.exactness = "does not track for the weights the warning names: " + scale.split(": ", 1)[1]
    if dst_fw == "torch" and (family in hyper.TORCH_GROUPS or plan.target_format not in BNB_FORMATS):
        plan.hyperparams = [hyper.torch_group(family, v) for v in plan.hyperparams]
    if dst_fw == "burn" and len(plan.hyperparams) > 1:
        members = [[a.dst_id for a in plan.params if a.group == i and a.action not in ("drop", "new")]
                   for i in range(len(plan.hyperparams))]
        first = {k: v for k, v in plan.hyperparams[0].items() if k not in plan.assumed}
        plan.metadata = {**hyper.to_metadata(family, first), **hyper.groups_to_metadata(plan.hyperparams, members)}
        plan.warnings.append(f"{len(plan.hyperparams)} parameter groups kept in the burnpack's statekit.groups "
                             "metadata (burn itself ignores it; statekit restores them)")
        return
    if dst_fw in ("burn", "neutral"):
        # burn files store nothing of their own: keep only what was stored or given, never assumptions
        known = {k: v for k, v in (plan.hyperparams[0] if plan.hyperparams else {}).items() if k not in plan.assumed}
        user_given = bool(opts.optimizer) or any(k in opts.hyperparams for k in known)
        if src_fw == "burn" and not user_given and not (groups and groups[0].hyperparams):
            plan.hyperparams, plan.assumed, plan.metadata = [], [], {}
        else:
            plan.hyperparams, plan.assumed = [known], []
            plan.metadata = hyper.to_metadata(family, known) if dst_fw == "burn" else {}
    if plan.assumed and src_fw == "burn" and dst_fw != "burn":
        shown = ", ".join(f"{k}={plan.hyperparams[0][k]}" for k in plan.assumed if k in plan.hyperparams[0])
        plan.warnings.append(f"burn files store no hyperparameters; assumed burn's defaults: {shown}")
