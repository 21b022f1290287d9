"""``convert``: move optimizer state to another format (and framework), through a plan.

burnpack → burnpack with nothing to change copies the file with burn's writer rules (byte-identical
for burn's own files). Everything else builds a :class:`~statekit.ops.plan.Plan` from the source
state and the options, shows it, and (unless ``dry_run``) writes the target atomically.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from statekit import io
from statekit.errors import MappingError, StatekitError, UsageError
from statekit.formats import registry
from statekit.formats.dcp import Share
from statekit.formats.dcp import sharing as dcp_sharing
from statekit.frameworks import torch_thirdparty
from statekit.ops import schedule_carry
from statekit.ops.build import build_plan
from statekit.ops.execute import write
from statekit.ops.options import Options, definition_beside_model, load_model, read_names  # noqa: F401 (the API's names)
from statekit.ops.pairing import moves_metadata
from statekit.ops.plan import Plan
from statekit.ops.progress import ProgressFactory, silent
from statekit.state import Checkpoint, refuse_bad_steps

RECORDS_MOVES = ("burnpack", "safetensors")  # formats with free-form string metadata

output_format = registry.from_extension


def name_source_params(state, opts: Options, path: str, *, model_names_source: bool = True, own_model=None):
    """Give source parameters their paths.

    A torch source's positions are named by :mod:`statekit.frameworks.torch_names` from ``--names``
    (its order: ``opts.names_order``) and/or a model (``--old-model``, else ``--model`` when
    ``model_names_source``: for convert it is the same model) — solved from order and shapes, refused
    when ambiguous. A model with ParamIds names sources that have ids but no paths (burn ≤ 0.21).
    ``own_model``: the model the checkpoint itself holds (a Trainer folder's model.safetensors, a
    Lightning ``state_dict``): its shapes complete a ``--names`` list given without ``--model``.
    Returns the :class:`~statekit.frameworks.torch_names.Resolution` used, or None.
    """
    resolution = None
    if state.framework == "torch":
        resolution = _name_torch(state, opts, path, model_names_source, own_model)
    for model in (opts.old_model, opts.model):
        by_id = model.by_id() if model is not None else {}
        for p in state.params:
            if p.path is None and p.id is not None and p.id in by_id:
                p.path = by_id[p.id].path
    return resolution


def name_checkpoint(ckpt: Checkpoint, opts: Options, path: str, **kw):
    """:func:`name_source_params` for an opened checkpoint: its own model (a folder's model file, a
    training checkpoint's state_dict) completes a names list; once named, the reader's warning
    that it could not name them goes."""
    from statekit.frameworks.torch_io import UNNAMED

    state = ckpt.optimizer
    if state.framework == "torch" and not all(p.path for p in state.params):
        opts = definition_beside_model(opts)
    if opts.model_config and state.framework == "torch" and opts.names is None \
            and not all(p.path for p in state.params):
        from statekit.frameworks import hf_peft
        from statekit.frameworks.wrappers import name_from_definition

        for p in state.params:  # the definition names every position or none
            p.path = None
        adapter = ckpt.path if hf_peft.adapter_folders(ckpt.path) else None  # --model-config: the base model's
        name_from_definition(ckpt, opts.model_config, opts.trust_remote_code, adapter=adapter)
        if state.unnamed_why and not all(p.path for p in state.params):
            raise MappingError(state.unnamed_why, opts.model_config)
    resolution = name_source_params(ckpt.optimizer, opts, path, own_model=ckpt.model, **kw)
    if all(p.path for p in ckpt.optimizer.params):
        ckpt.warnings = [w for w in ckpt.warnings if not w.startswith(UNNAMED)]
    return resolution


def _name_torch(state, opts: Options, path: str, model_names_source: bool, own_model=None):
    from statekit.frameworks import torch_names

    names = opts.names
    if names is not None and not isinstance(names, torch_names.ModelOrder):
        names = torch_names.from_names(list(names), source="--names", order=opts.names_order)
    elif names is not None and opts.names_order and not names.positional and opts.names_order == "optimizer":
        names.positional = True
    model = opts.old_model if opts.old_model is not None else opts.model if model_names_source else None
    flag = "--model" if opts.old_model is None else "--old-model"
    model_src = torch_names.from_model_info(model, model.source or flag) \
        if model is not None and any(not m.buffer for m in model.params) else None
    if names is not None:
        shapes_src = model_src
        if shapes_src is None and own_model is not None and len(state.groups) > 1 \
                and any(not m.buffer for m in own_model.params):  # a flat list cannot place several groups
            shapes_src = torch_names.from_model_info(own_model, "the checkpoint's model")
        if shapes_src is not None and all(e.shape is None for e in names.entries):
            names = torch_names.with_shapes(names, shapes_src)
        return torch_names.name_state(state, names, path)
    if model_src is not None and not all(p.path for p in state.params):
        return torch_names.name_state(state, model_src, path)
    return None


@dataclass
class Result:
    """What ``convert`` / ``remap`` did: the plan carried out (None for an exact burnpack copy or a
    model file), the bytes written (None on a dry run), and lines for a human reader."""

    plan: Plan | None
    written: int | None
    copied: bool = False
    messages: list[str] = field(default_factory=list)
    also: Plan | None = None  # the second output's plan (--also-out)
    warnings: list[str] = field(default_factory=list)  # the writer's, found while writing
    summary: dict | None = None  # what was written, for --json (a Megatron torch_dist output)


def is_plain_copy(ckpt: Checkpoint, fmt: str, opts: Options) -> bool:
    return ckpt.format == fmt == "burnpack" and opts == Options()


def convert(src: str, dst: str, opts: Options | None = None, *, to: str | None = None, key: str | None = None,
            dry_run: bool = False, plan_in: str | None = None, plan_out: str | None = None,
            progress: ProgressFactory | None = None, on_plan: Callable[[Plan], None] | None = None,
            shards: int | None = None, share: Share | None = None, also: str | None = None,
            also_key: str | None = None, also_out: str | None = None, no_schedule: bool = False,
            parallel: dict | None = None, **folder) -> Result:
    """Convert ``src`` to ``dst``; the Python API behind ``statekit convert``. ``on_plan(plan)`` is
    called with the finished plan before any byte is written (the CLI shows it there). ``shards``
    (DCP output, a directory) is the number of data files to write; ``share`` is the part of them
    this process writes (:mod:`statekit.ops.shares`; the last process to finish writes the index).
    ``also`` / ``also_key``: a second torch optimizer state over the same model (a Muon run's AdamW)
    joining a burn output as further groups; ``also_out``: where a burn record's second optimizer
    goes as its own torch state_dict (:mod:`statekit.ops.pair`). The source's LR schedule: carried, else
    refused unless ``no_schedule`` (:mod:`statekit.ops.schedule_carry`). ``to="megatron"``: a Megatron
    torch_dist checkpoint for another parallel layout, ``parallel`` = {tp, pp, dp, sharding}
    (:func:`convert_to_megatron`). ``folder``: ``hf_model_type``, ``hf_config``, ``weights`` of a Megatron
    source going to Hugging Face (a Trainer folder: :func:`_trainer_folder`)."""
    opts = opts or Options()
    if to == "megatron" or parallel:
        return convert_to_megatron(src, dst, opts, to=to, parallel=parallel or {}, dry_run=dry_run, shards=shards,
                                   plan_in=plan_in, plan_out=plan_out, share=share, no_schedule=no_schedule)
    several = plan_in or shards or also or also_out or (share is not None and share.count > 1)
    if _trainer_folder_wanted(src, dst, to, folder, several):
        return _trainer_folder(src, dst, opts, folder, dry_run=dry_run, progress=progress, on_plan=on_plan,
                               plan_out=plan_out)
    if also is not None or also_key is not None or also_out is not None:
        return _convert_pair(src, dst, opts, to=to, key=key, dry_run=dry_run, plan_out=plan_out, plan_in=plan_in,
                             progress=progress, on_plan=on_plan, also=also, also_key=also_key, also_out=also_out,
                             no_schedule=no_schedule)
    # a directory (existing, or a name without extension) is a torch.distributed checkpoint
    directory = os.path.isdir(dst) or dst.endswith(("/", os.sep)) or not os.path.splitext(dst)[1]
    fmt = output_format(dst, to or ("dcp" if shards or directory else None))
    if shards is not None and (fmt != "dcp" or shards < 1):
        raise UsageError("--shards applies to DCP (directory) output and must be at least 1")
    if share is not None and share.count > 1 and fmt != "dcp":
        if share.source == "--shard":
            raise UsageError("--shard splits a DCP (directory) output; a single file is written by one process")
        if share.index != 0:
            return Result(None, None, messages=[f"share {share.index}/{share.count} ({share.source}): "
                                                "a single-file output is written by share 0 alone"])
        share = None
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("source and destination are the same file")
    if fmt == "dcp" and share is not None:
        with dcp_sharing(share):
            result = convert(src, dst, opts, to="dcp", key=key, dry_run=dry_run, plan_in=plan_in,
                             plan_out=plan_out if share.index == 0 else None, progress=progress,
                             on_plan=on_plan if share.index == 0 else None, shards=shards, no_schedule=no_schedule)
        result.messages.append(_share_summary(share, dst))
        return result
    return _convert_state(src, dst, fmt, opts, to=to, key=key, dry_run=dry_run, plan_in=plan_in, plan_out=plan_out,
                          progress=progress, on_plan=on_plan, shards=shards, no_schedule=no_schedule,
                          hf_model_type=folder.get("hf_model_type"))


def _convert_state(src: str, dst: str, fmt: str, opts: Options, *, to, key, dry_run, plan_in, plan_out, progress,
                   on_plan, shards, no_schedule, hf_model_type) -> Result:
    """One process's convert of an optimizer state (or a model, or a container copy) to ``fmt``."""
    with io.open_checkpoint(src, **open_options(opts, key)) as ckpt, _naming(src):
        refuse_bad_steps(ckpt.optimizer, src)  # before any path that writes, copies included
        if plan_in is None and opts == Options() and is_container_copy(ckpt, fmt):
            return _copy_container(ckpt, dst, fmt, shards, dry_run, progress or silent)
        if plan_in is None and is_plain_copy(ckpt, fmt, opts):
            return _copy(ckpt, dst, dry_run, progress or silent)
        if ckpt.kind == "model" and ckpt.model is not None and plan_in is None:
            return _convert_model(ckpt, dst, fmt, opts, dry_run)
        if ckpt.kind != "optimizer" or ckpt.optimizer is None:
            raise MappingError(f"holds {ckpt.kind} data, not optimizer state; convert moves optimizer state", src)
        state = ckpt.optimizer
        opts, fmt, said = _prepare(ckpt, opts, src, fmt, to)
        opts, carry = schedule_carry.carried(ckpt, src, dst, fmt, opts, no_schedule=no_schedule)
        if state.family in ("lbfgs", "mixed"):
            done = _global_or_mixed(ckpt, src, dst, fmt, opts, plan_in, dry_run, plan_out, progress, on_plan, carry)
            if done is not None:
                return done
        adapted: list[str] = []
        if torch_thirdparty.is_foreign(state):  # transformers Adafactor, torchao, … as the optimizer continuing it
            state, adapted = torch_thirdparty.adapt(state, registry.framework_of(fmt), optimizer=opts.optimizer,
                                                     path=src)
        if plan_in:
            plan = Plan.load(plan_in)
            if plan.target_format != fmt:
                raise UsageError(f"the plan writes {plan.target_format}, but {dst} asks for {fmt}")
            plan.source, plan.target = src, dst
        else:
            opts, recorded = recorded_layout(ckpt, fmt, opts)
            plan = build_plan(state, src, ckpt.format, dst, fmt, _with_rules(opts, state, src, ckpt.metadata if registry.framework_of(ckpt.format) == "megatron" else None, hf_model_type))
            plan.warnings.extend(adapted)
            if recorded:
                plan.warnings.append(recorded)
            plan.warnings.extend(said)
        carry.refuse()  # before the plan is shown or a byte written
        plan.warnings.extend(carry.warnings)
        if fmt == "dcp" and shards:  # the DCP writer's layout choice travels with the plan (and a saved plan)
            plan.metadata[SHARDS_KEY] = str(shards)
        with _writer_context(fmt, opts, ckpt):
            result = carry_out(plan, state, ckpt.nbytes, dry_run=dry_run, plan_out=plan_out, progress=progress,
                               on_plan=on_plan)
        return schedule_carry.write_files(carry, result, dst, dry_run)


def _writer_context(fmt: str, opts: Options, ckpt: Checkpoint):
    """What the target's writer needs around it: DeepSpeed universal output takes the fp32 master weights
    (--model, else the input's own model)."""
    if fmt != "deepspeed-universal":
        return contextlib.nullcontext()
    from statekit.frameworks.deepspeed_io import universal_weights

    return universal_weights(opts.model if opts.model is not None else ckpt.model)


def _trainer_folder_wanted(src: str, dst: str, to: str | None, folder: dict, others) -> bool:
    """A Megatron source to a Hugging Face Trainer folder (``to="hf-trainer"``, or a ``checkpoint-N`` DST);
    --hf-config / --weights anywhere else, and options a folder has no use for, are refused."""
    from statekit.ops import megatron_trainer

    unknown = set(folder) - {"hf_model_type", "hf_config", "weights"}
    if unknown:
        raise TypeError(f"convert() got unexpected keyword arguments {sorted(unknown)}")
    if not megatron_trainer.is_target(src, dst, to):
        if folder.get("hf_config") is not None or folder.get("weights") is not None:
            raise UsageError("--hf-config and --weights apply to a Hugging Face Trainer folder (DST checkpoint-N/ "
                             "or --to hf-trainer)")
        return False
    if others:
        raise UsageError("a Hugging Face Trainer folder is written by one process, from no saved plan, shards or "
                         "second state")
    return True


def _trainer_folder(src: str, dst: str, opts: Options, folder: dict, *, dry_run: bool, progress, on_plan,
                    plan_out: str | None) -> Result:
    """``statekit convert MEGATRON checkpoint-N/`` (:mod:`statekit.ops.megatron_trainer`): optimizer.pt by the
    ordinary plan, with model.safetensors, config.json, scheduler.pt and trainer_state.json beside it."""
    from dataclasses import replace

    from statekit.ops import megatron_trainer as trainer

    trainer.refuse_existing(dst)
    with io.open_checkpoint(src) as ckpt, _naming(src):
        parts = trainer.prepare(ckpt, src, folder.get("hf_model_type"), folder.get("hf_config"),
                                folder.get("weights") or "master")
        opts, _, said = _prepare(ckpt, replace(opts, structure=parts.structure), src, "torch", "torch")
        plan = build_plan(ckpt.optimizer, src, ckpt.format, os.path.join(dst, "optimizer.pt"), "torch", opts)
        trainer.finish_plan(plan, parts, said, dst)
        written = carry_out_with(plan, ckpt.nbytes, lambda advance, warnings: 0, dry_run=True, plan_out=plan_out,
                                 on_plan=on_plan)
        if dry_run:
            return written
        size, warnings = trainer.write_folder(plan, ckpt.optimizer, ckpt, parts, dst, progress)
    files = ", ".join(trainer.FILES)
    return Result(plan, size, messages=[f"wrote {dst} ({size} bytes: {files})"], warnings=warnings)


def _prepare(ckpt: Checkpoint, opts: Options, src: str, fmt: str, to: str | None) -> tuple[Options, str, list[str]]:
    """Before planning: the source named (``--model DIR/model.safetensors`` with config.json beside it
    as the folder is), and the target format a recorded library layout asks for; what to say."""
    state, said = ckpt.optimizer, []
    if state.framework == "torch" and not all(p.path for p in state.params):
        given = opts.model
        opts = definition_beside_model(opts)
        if opts.model is None and given is not None:
            said.append(f"--model {given.source}: a Hugging Face model file with {opts.model_config} beside it; "
                        "named and laid out from that definition, as its checkpoint folder is")
    name_checkpoint(ckpt, opts, src)
    if registry.framework_of(ckpt.format) == "megatron" and registry.framework_of(fmt) != "megatron":
        said += _without_master(state)
    fmt, library_said = _library_layout(state, fmt, to)
    return opts, fmt, said + ([library_said] if library_said else [])


def _without_master(state) -> list[str]:
    """A Megatron state going to another framework: its fp32 masters are weights, not optimizer state (the
    target's optimizer has no field for them); taken out, and the plan says so in one line."""
    from statekit import naming

    held = [p for p in state.params if naming.MASTER_SLOT in p.slots]
    for p in held:
        del p.slots[naming.MASTER_SLOT]
    if not held:
        return []
    return [f"the fp32 master weights of {len(held)} parameters are not carried: they are model weights, which "
            "an optimizer state_dict has no field for (the model's weights are the master rounded to its dtype)"]


def _library_layout(state, fmt: str, to: str | None) -> tuple[str, str | None]:
    """Back to a ``.pt`` with no ``--to``: the layout of the optimizer library the state first came
    from, as the file records it (a bitsandbytes state through burn goes back to bitsandbytes')."""
    recorded = getattr(state, "library_format", None)
    if to is not None or fmt != "torch" or state.framework == "torch" or not recorded:
        return fmt, None
    return recorded, (f"written in bitsandbytes' layout ({recorded}), the optimizer the state came from (as the "
                      "file records); --to torch writes torch's own")


def _with_rules(opts: Options, state, src: str, megatron_facts: dict | None = None,
                hf_type: str | None = None) -> Options:
    """``opts`` with the structural map its --fuse/--split/--stack/--unstack rules describe; a Megatron
    source going to another framework: the map to Hugging Face names its args give (:mod:`.megatron_hf`)."""
    from dataclasses import replace

    if hf_type is not None and megatron_facts is None:
        raise UsageError("--hf-model-type names a Megatron checkpoint's parameters for a Hugging Face model; "
                         f"{src} is not a Megatron checkpoint")
    if megatron_facts is not None and opts.structure is None and not (opts.fuse or opts.split or opts.stack
                                                                           or opts.unstack):
        from statekit.ops import megatron_hf

        tied = megatron_hf.drop_tied_copy(state, megatron_facts, src)
        shapes = {p.path: tuple(p.shape) for p in state.params if p.path and p.shape is not None}
        structure = megatron_hf.build(megatron_facts, shapes, src, hf_type)
        if tied:
            structure.notes.append(tied)
        megatron_hf.trainer_groups(state, src)
        megatron_hf.check_trainer_decay(state, structure, src)
        return replace(opts, structure=structure)
    if not (opts.fuse or opts.split or opts.stack or opts.unstack):
        return opts
    from statekit.ops import structural

    return replace(opts, structure=structural.rules_map(opts, state, src))


@contextlib.contextmanager
def _naming(src: str):
    """A refusal raised while planning (no such optimizer in torch, sgd-or-muon …) names the file read."""
    try:
        yield
    except StatekitError as exc:
        if exc.path is None and not exc.message.startswith(os.fspath(src)):
            exc.path = os.fspath(src)
        raise


def _global_or_mixed(ckpt, src, dst, fmt, opts, plan_in, dry_run, plan_out, progress, on_plan,
                     carry) -> Result | None:
    """L-BFGS's one global state (:mod:`statekit.ops.lbfgs`); a record of two families going to torch,
    which needs --also-out (:mod:`statekit.ops.pair`). None: the ordinary path."""
    state = ckpt.optimizer
    carry.refuse()
    if state.family == "lbfgs":
        from statekit.ops import lbfgs

        plan = lbfgs.saved_plan(plan_in, src, dst, fmt) if plan_in else lbfgs.build(ckpt, src, dst, fmt, opts)
        plan.warnings.extend(carry.warnings)
        done = carry_out_with(plan, ckpt.nbytes, lbfgs.writer(plan, ckpt, fmt, dst), dry_run=dry_run,
                              plan_out=plan_out, progress=progress, on_plan=on_plan)
        return schedule_carry.write_files(carry, done, dst, dry_run)
    if registry.framework_of(fmt) == "torch":
        from statekit.ops import pair

        pair.settle(state, pair.wanted_families(opts.optimizer), src)
        parts = [f for f, _ in pair.split(state, pair.wanted_families(opts.optimizer))]
        raise UsageError(f"{src} holds {' and '.join(parts)} state: torch keeps one optimizer per state_dict; "
                         f"give --also-out FILE for the {' and '.join(parts[1:])} part")
    return None


def open_options(opts: Options | None, key: str | None = None) -> dict:
    """What a reader is told besides the path: ``key``, and whether a checkpoint folder's model code may run."""
    out: dict = {"key": key} if key else {}
    if opts is not None and opts.trust_remote_code:
        out["trust_remote_code"] = True
    return out


def recorded_layout(ckpt: Checkpoint, fmt: str, opts: Options) -> tuple[Options, str | None]:
    """Going back to the framework a file was converted from, the transposes it records
    (:data:`statekit.ops.pairing.MOVES_KEY`) are undone without repeating --transpose /
    --no-transpose. Anything the user says about layout, or a model, takes precedence."""
    from dataclasses import replace

    from statekit.ops.pairing import recorded_moves, recorded_source

    if opts.transpose or opts.no_transpose or opts.model is not None:
        return opts, None
    came_from = recorded_source(ckpt)
    if came_from is None or registry.framework_of(came_from) != registry.framework_of(fmt) \
            or registry.framework_of(came_from) == registry.framework_of(ckpt.format):
        return opts, None
    moves = recorded_moves(ckpt) or []
    exact = [_glob_literal(m.dst_path) for m in moves]
    flipped = [_glob_literal(m.dst_path) for m in moves if m.transpose]
    from statekit.ops.pairing import MOVES_OPERATION_KEY

    remapped = (ckpt.metadata or {}).get(MOVES_OPERATION_KEY) == "remap"  # the old model's names are not this one's
    names = [] if remapped else [(m.dst_path, m.src_path) for m in moves if m.src_path and m.src_path != m.dst_path]
    opts = replace(opts, transpose=flipped, no_transpose=[p for p in exact if p not in flipped], recorded_names=names)
    return opts, (f"layout as recorded when the file was converted from {came_from}: "
                  f"{len(flipped)} of {len(moves)} parameters transposed back")


def _glob_literal(path: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


FQN_NOTE = "optimizer state keyed by parameter name (torch.distributed form)"
SHARDS_KEY = "dcp.shards"  # plan metadata the DCP writer reads: how many data files


def is_container_copy(ckpt: Checkpoint, fmt: str) -> bool:
    """DCP ⇄ torch.save with nothing to change moves the whole saved object, as torch's own
    ``dcp_to_torch_save`` / ``torch_save_to_dcp`` do: the model and every other entry come along,
    the optimizer stays keyed by name (what ``set_optimizer_state_dict`` loads)."""
    if ckpt.format not in ("dcp", "torch") or fmt not in ("dcp", "torch") or ckpt.format == fmt == "torch":
        return False
    if ckpt.format == "dcp" or ckpt.optimizer is None:
        return True
    return FQN_NOTE in ckpt.optimizer.notes


def _copy_container(ckpt: Checkpoint, dst: str, fmt: str, shards: int | None, dry_run: bool,
                    progress: ProgressFactory) -> Result:
    """DCP → .pt, .pt → DCP, DCP → DCP (resharded): the whole saved object, tensors streamed."""
    from statekit.formats import dcp, torch_pt

    if dry_run:
        return Result(None, None, copied=True, messages=[
            f"would copy the whole saved state_dict: {ckpt.format} {ckpt.path} → {fmt} {dst}"])
    whole = ckpt.container.state_dict() if ckpt.format == "dcp" else torch_pt.load_pt(ckpt.path)
    with progress("writing", ckpt.nbytes or None, unit_bytes=True) as advance:
        if fmt == "torch":
            torch_pt.save_pt(whole, dst)
            size = os.path.getsize(dst)
        else:
            size = dcp.save(dst, whole, shards=shards, progress=advance)
    return Result(None, size, copied=True, messages=[f"wrote {dst} ({size} bytes, the whole saved state_dict)"])


def _share_summary(share: Share, dst: str) -> str:
    done = f"share {share.index}/{share.count} ({share.source}): wrote parts {share.written or 'none'}"
    if share.skipped:
        done += f", skipped {share.skipped} (complete from an earlier run)"
    if share.finalized:
        return done + f"; all {share.parts} parts present: wrote {dst}/.metadata"
    return done + (f"; waiting for parts {share.waiting}: the last share to finish writes .metadata "
                   f"(or run: statekit finalize {dst})")


def _copy(ckpt: Checkpoint, dst: str, dry_run: bool, progress: ProgressFactory) -> Result:
    """burnpack → burnpack with nothing to change: burn's own bytes, copied."""
    if dry_run:
        return Result(None, None, copied=True, messages=[
            f"would copy {ckpt.path} → {dst} byte for byte (burnpack → burnpack, nothing to change)"])
    from statekit.frameworks import burn

    with progress("writing", ckpt.nbytes, unit_bytes=True) as advance:
        size = burn.save_checkpoint(ckpt, dst, progress=advance)
    return Result(None, size, copied=True, messages=[f"wrote {dst} ({size} bytes, an exact copy)"])


def carry_out_with(plan: Plan, nbytes: int, write_target, *, dry_run: bool, plan_out: str | None,
                   progress: ProgressFactory | None = None, on_plan: Callable[[Plan], None] | None = None) -> Result:
    """Save the plan if asked, hand it to ``on_plan``, and (unless a dry run) ``write_target(advance,
    warnings)`` (returns the size written)."""
    if plan_out:
        from statekit.atomic import atomic_write

        with atomic_write(plan_out) as fh:
            fh.write(plan.dumps().encode() + b"\n")
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return Result(plan, None, messages=["dry run: nothing written"])
    warnings: list[str] = []
    with (progress or silent)("writing", nbytes, unit_bytes=True) as advance:
        size = write_target(advance, warnings)
    return Result(plan, size, messages=[f"wrote {plan.target} ({size} bytes)"], warnings=warnings)


def carry_out(plan: Plan, state, nbytes: int, *, dry_run: bool, plan_out: str | None,
              progress: ProgressFactory | None = None, on_plan: Callable[[Plan], None] | None = None) -> Result:
    """Save the plan if asked, hand it to ``on_plan``, and (unless a dry run) write the target."""
    if plan_out:
        from statekit.atomic import atomic_write

        with atomic_write(plan_out) as fh:
            fh.write(plan.dumps().encode() + b"\n")
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return Result(plan, None, messages=["dry run: nothing written"])
    if plan.target_format in RECORDS_MOVES:  # where each parameter's state came from, for verify-resume
        plan.metadata = {**plan.metadata, **moves_metadata(plan)}
    warnings: list[str] = []
    with (progress or silent)("writing", nbytes, unit_bytes=True) as advance:
        size = write(plan, state, plan.target, progress=advance, on_warning=warnings.append)
    return Result(plan, size, messages=[f"wrote {plan.target} ({size} bytes)"], warnings=warnings)


def _convert_model(ckpt: Checkpoint, dst: str, fmt: str, opts: Options, dry_run: bool) -> Result:
    """Model records change container, not layout: burn ≤ 0.21 → burnpack, any → safetensors."""
    if opts != Options(dtype=opts.dtype):
        raise UsageError("model files are converted as they are: only --dtype applies")
    model = ckpt.model
    if dry_run:
        return Result(None, None, messages=[
            f"would write {len(model.params)} model tensors from {ckpt.path} to {fmt} {dst}"])
    if fmt == "safetensors" and opts.dtype:
        raise UsageError("--dtype applies to burnpack model output only")
    if fmt not in ("burnpack", "safetensors"):
        raise UsageError(f"model files convert to burnpack or safetensors, not {fmt} (statekit moves optimizer "
                         "state; weights across frameworks need their layout changes too)")
    size = registry.model_writer(fmt)(model, dst, dtype=opts.dtype)
    return Result(None, size, messages=[f"wrote {dst} ({size} bytes, {len(model.params)} model tensors)"])


def _convert_pair(src: str, dst: str, opts: Options, *, to, key, dry_run, plan_out, plan_in, progress, on_plan,
                  also, also_key, also_out, no_schedule=False) -> Result:
    """Two torch optimizers ⇄ one burn record of two families (:mod:`statekit.ops.pair`)."""
    from statekit.ops import pair

    if plan_in:
        raise UsageError("--plan applies one saved plan to one output; --also / --also-out build theirs")
    fmt = output_format(dst, to)
    if also_out is not None and (also is not None or also_key is not None):
        raise UsageError("--also (a second input) and --also-out (a second output) go in opposite directions")
    for out in (dst, also_out):
        if out is not None and os.path.abspath(src) == os.path.abspath(out):
            raise UsageError("source and destination are the same file")
    with io.open_checkpoint(src, key=key) if key else io.open_checkpoint(src) as ckpt:
        if ckpt.kind != "optimizer" or ckpt.optimizer is None:
            raise MappingError(f"holds {ckpt.kind} data, not optimizer state; convert moves optimizer state", src)
        name_checkpoint(ckpt, opts, src)
        schedule_carry.refuse_uncarried(ckpt, src, dst, fmt, no_schedule=no_schedule)
        wanted = pair.wanted_families(opts.optimizer)
        if also_out is None:  # torch pair → one burn record
            return _pair_to_burn(ckpt, src, dst, fmt, opts, also or src, also_key, dry_run, plan_out, progress,
                                 on_plan)
        return _pair_to_torch(ckpt, src, dst, fmt, also_out, opts, wanted, dry_run, plan_out, progress, on_plan)

def _pair_to_torch(ckpt, src, dst, fmt, also_out, opts, wanted, dry_run, plan_out, progress, on_plan) -> Result:
    """One burn record of two families → two torch state_dicts (DST and --also-out), both or neither."""
    from dataclasses import replace

    from statekit.ops import pair

    state = ckpt.optimizer
    if registry.framework_of(fmt) != "torch" or registry.framework_of(output_format(also_out, None)) != "torch":
        raise UsageError("--also-out writes the second optimizer of a burn record as its own torch state_dict: "
                         "both outputs are .pt")
    pair.settle(state, wanted, src)
    parts = pair.split(state, wanted)
    if len(parts) != 2:
        raise UsageError(f"--also-out: {src} holds {' and '.join(f for f, _ in parts) or 'no'} optimizer "
                         f"state, not two families")
    order = _target_order(opts)
    plans = []
    for (family, part), out in zip(parts, (dst, also_out), strict=True):
        part_opts = replace(opts, optimizer=family)
        if order is not None:  # each optimizer's positions: its own parameters, in the model's order
            mine = {p.path for p in part.params}
            part_opts = replace(part_opts, names=[n for n in order if n in mine])
        part_opts, recorded = recorded_layout(ckpt, "torch", part_opts)
        plan = build_plan(part, src, ckpt.format, out, output_format(out, None), part_opts)
        if recorded:
            plan.warnings.append(recorded)
        plans.append((plan, part))
    results = []
    try:
        for (plan, part), out in zip(plans, (dst, also_out), strict=True):
            results.append(carry_out(plan, part, ckpt.nbytes, dry_run=dry_run,
                                     plan_out=None if out != dst else plan_out, progress=progress,
                                     on_plan=on_plan))
    except BaseException:
        if results and not dry_run and os.path.exists(dst):  # all or nothing: not half a pair
            os.unlink(dst)
        raise
    first, second = results
    return Result(first.plan, first.written, messages=first.messages + second.messages,
                  warnings=first.warnings + second.warnings, also=second.plan)


def _pair_to_burn(ckpt, src, dst, fmt, opts, other_path, also_key, dry_run, plan_out, progress, on_plan) -> Result:
    """Two torch states (the input and --also) → one burn record, one group set after the other."""
    from dataclasses import replace

    from statekit.ops import pair

    if registry.framework_of(fmt) != "burn":
        raise UsageError(f"--also joins two torch states into one burn record; {dst} is {fmt}")
    state = ckpt.optimizer
    with (io.open_checkpoint(other_path, key=also_key) if also_key else io.open_checkpoint(other_path)) as other:
        if other.kind != "optimizer" or other.optimizer is None:
            raise MappingError(f"holds {other.kind} data, not optimizer state", other_path)
        name_source_params(other.optimizer, opts, other_path, own_model=other.model or ckpt.model)
        if other.model is not None and not all(p.path for p in other.optimizer.params):
            from statekit.frameworks.torch_io import name_from_model

            name_from_model(other, ordered=True, source="its checkpoint's model state_dict")
        if not all(p.path for p in other.optimizer.params) and ckpt.model is not None:
            from statekit.frameworks import torch_names

            torch_names.name_state(other.optimizer, torch_names.from_model_info(
                ckpt.model, "the input's model state_dict", ordered=True), other_path)
        merged = pair.merge(state, other.optimizer, other_path)
        opts_plain = replace(opts, optimizer=None)
        opts_plain, _ = recorded_layout(ckpt, fmt, opts_plain)
        plans = [build_plan(part, src if i == 0 else other_path, ckpt.format, dst, fmt, opts_plain)
                 for i, (_, part) in enumerate(pair.split(merged, []))]
        plan = pair.combine(plans)
        plan.source = f"{src} + {other_path}"
        return carry_out(plan, merged, ckpt.nbytes + other.nbytes, dry_run=dry_run, plan_out=plan_out,
                         progress=progress, on_plan=on_plan)


def _target_order(opts: Options) -> list[str] | None:
    """The torch parameter order --names or --model gives (None: neither)."""
    if opts.names is not None:
        return [e.name for e in opts.names.entries] if hasattr(opts.names, "entries") else list(opts.names)
    if opts.model is not None and opts.model.order == "named_parameters":
        return [m.path for m in opts.model.params if not m.buffer]
    return None


def _refuse_hf_schedule(src: str) -> None:
    """HF / torch → Megatron: the written ``opt_param_scheduler`` is ``--megatron-args``' (positioned at the
    HF step), never the HF run's own: a schedule beside the source is not dropped in silence."""
    with io.open_checkpoint(src) as ckpt:
        _, label = schedule_carry.source_schedule(ckpt)
    if label is not None:
        raise MappingError(f"the LR schedule ({label}) is not carried to megatron: the opt_param_scheduler written "
                           "is --megatron-args' own (its warm-up, decay and lrs), positioned at the HF step; "
                           f"{schedule_carry.DROP_HINT}", src)


def convert_to_megatron(src: str, dst: str, opts: Options, *, to: str | None, parallel: dict, dry_run: bool,
                        shards: int | None, plan_in: str | None, plan_out: str | None, share: Share | None,
                        no_schedule: bool = False) -> Result:
    """Megatron torch_dist → torch_dist at the parallel sizes ``parallel`` names
    (:mod:`statekit.frameworks.megatron.write_dist`); ``dst`` is the new save root."""
    if to != "megatron":
        raise UsageError("--tp/--pp/--dp/--cp apply to --to megatron or --to megatron-legacy; --sharding/--megatron-args "
                         "to --to megatron")
    from dataclasses import replace as _replace

    megatron_args = parallel.get("megatron_args")
    extra = _replace(opts, model=None, names=None, names_order=None) if megatron_args else opts
    if extra != Options() or plan_in or plan_out or dry_run:
        raise UsageError("--to megatron takes only --tp, --pp, --ep, --dp, --cp, --sharding, --shards and, from an HF / torch "
                         "state, --megatron-args with --model / --names (no plan, renames or hyperparameters)")
    if share is not None and share.count > 1:
        raise UsageError("--to megatron is written by one process")
    from statekit.frameworks.megatron import write_dist

    target = write_dist.Target(tp=parallel.get("tp"), pp=parallel.get("pp"), dp=parallel.get("dp"),
                               sharding=parallel.get("sharding") or "fully_reshardable", ep=parallel.get("ep"),
                               cp=parallel.get("cp"))
    if megatron_args:
        from statekit.ops import megatron_from_hf

        if not no_schedule:
            _refuse_hf_schedule(src)
        done = megatron_from_hf.write(src, dst, megatron_args, parallel.get("model_path"), target,
                                      lambda state: name_source_params(state, opts, src), shards=shards)
    else:
        done = write_dist.write(src, dst, target, shards=shards)
    sizes = done.sizes
    ep = f"EP {sizes['ep']} (expert DP {sizes['expert_dp']}) " if "expert_dp" in sizes else ""
    cp = f" CP {sizes['cp']}" if sizes.get("cp", 1) != 1 else ""
    lines = [f"wrote {done.path}: Megatron torch_dist, {target.sharding}, TP {sizes['tp']} PP {sizes['pp']} {ep}"
             f"DP {sizes['dp']}{cp} (world {sizes['world_size']}), {done.tensors} tensors, iteration {done.iteration}"]
    summary = {"path": done.path, "format": "megatron-dist", "sharding": target.sharding, "iteration": done.iteration,
               "sizes": done.sizes, "tensors": done.tensors, "bytes": done.nbytes, "notes": done.notes}
    return Result(None, done.nbytes, messages=lines + done.notes, summary=summary)
