"""Checkpoints that training programs wrap around a torch optimizer state_dict, read by content.

* HF Trainer ``checkpoint-N/``: ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json`` and the
  model (``model.safetensors``, ``pytorch_model.bin`` or a sharded ``*.index.json``).
* Accelerate ``save_state`` folders: ``optimizer.bin`` (``optimizer_1.bin`` … for more
  optimizers), ``scheduler.bin``, ``model.safetensors`` / ``pytorch_model.bin``.
* Lightning ``.ckpt`` (one ``torch.save`` dict): handled by :mod:`statekit.frameworks.torch_io`,
  which finds ``optimizer_states[0]`` and describes its ``lr_schedulers``.

A folder opens as one :class:`Checkpoint` of format ``torch``: the optimizer state from its
optimizer file, the model's names and shapes from its model file (which names the optimizer's
positions), the LR scheduler's state and the trainer's counters for display. Facts about the
layouts: ``../shared/docs/sharded-formats.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from statekit.errors import FormatError, MappingError, StatekitError
from statekit.formats import torch_pt
from statekit.frameworks import hf_args, schedule_hf, schedule_torch, torch_io, torch_state
from statekit.state import Checkpoint, ModelInfo, ModelParam

FORMAT = "torch"  # a folder opens as the torch checkpoint its optimizer file is
DESCRIPTION = "HF Trainer checkpoint-N/ and Accelerate save_state folders (optimizer.pt / optimizer.bin)"


@dataclass(frozen=True)
class FolderLayout:
    """One program's checkpoint folder: the file that identifies it and the files around it."""

    name: str
    optimizer: str  # the optimizer file (``--key`` picks ``optimizer_1`` … where there are several)
    scheduler: str
    marker: str | None = None  # a file only this program writes


# Trainer first: its folder also matches Accelerate's looser test when it holds optimizer.pt.
LAYOUTS: tuple[FolderLayout, ...] = (
    FolderLayout("hf-trainer", "optimizer.pt", "scheduler.pt", marker="trainer_state.json"),
    FolderLayout("accelerate", "optimizer.bin", "scheduler.bin"),
)
# Model files in the order they are preferred; an index lists the shards of a sharded model.
MODEL_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")
# Files whose order is the model's named_parameters() order (torch.save keeps a state_dict's
# order; the safetensors writer sorts by dtype and name, and an index's weight_map by name).
ORDERED_MODEL_FILES = ("pytorch_model.bin",)
TRAINER_COUNTERS = ("global_step", "max_steps", "epoch", "num_train_epochs", "save_steps")


def claims(head: bytes, path: str) -> bool:
    """The registry's sniffer: a folder one of :data:`LAYOUTS` describes."""
    return os.path.isdir(path) and layout_of(path) is not None


def layout_of(path: str) -> FolderLayout | None:
    """The program that wrote folder ``path``, from the files in it (None: none statekit knows)."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    for lay in LAYOUTS:
        if lay.optimizer in names and (lay.marker is None or lay.marker in names or lay.scheduler in names):
            return lay
    if "optimizer.pt" in names:  # a Trainer folder without trainer_state.json / scheduler.pt
        return LAYOUTS[0]
    return None


def _optimizer_file(path: str, lay: FolderLayout, key: str | None) -> str:
    stem, ext = os.path.splitext(lay.optimizer)
    present = sorted(n for n in os.listdir(path) if n.startswith(stem) and n.endswith(ext))
    if key is None:
        return os.path.join(path, lay.optimizer)
    wanted = key if key.endswith(ext) else key + ext
    if wanted not in present:
        raise FormatError(f"no optimizer file {wanted!r} in the folder (it holds {', '.join(present)})", path)
    return os.path.join(path, wanted)


def _model_file(path: str, optimizer_file: str) -> str | None:
    suffix = os.path.splitext(os.path.basename(optimizer_file))[0][len("optimizer"):]  # "" or "_1"
    for name in MODEL_FILES:
        stem, dot, ext = name.partition(".")
        candidate = os.path.join(path, f"{stem}{suffix}{dot}{ext}")
        if os.path.isfile(candidate):
            return candidate
    return None


def read_model_file(path: str) -> tuple[ModelInfo, bool]:
    """A model's tensors (names, shapes) from a safetensors / torch file or a sharded index, and
    whether their order is the model's ``named_parameters()`` order."""
    if path.endswith(".index.json"):
        return _read_index(path), False
    if path.endswith(".safetensors"):
        from statekit.frameworks.safetensors_io import SafetensorsFile

        with SafetensorsFile(path) as sf:
            model = ModelInfo([ModelParam(n, shape, dt, buffer=not dt.startswith(("F", "BF")))
                               for n, (dt, shape) in sf.entries.items()])
        return _number(model), False
    sd = torch_state.find_model(torch_pt.load_pt(path))
    if sd is None:
        raise FormatError("holds no model state_dict", path)
    return torch_state.read_model(sd), os.path.basename(path) in ORDERED_MODEL_FILES


def _read_index(path: str) -> ModelInfo:
    try:
        with open(path, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"not a sharded-model index ({type(exc).__name__}: {exc})", path) from None
    params: list[ModelParam] = []
    folder = os.path.dirname(path)
    for shard in dict.fromkeys(weight_map.values()):
        shard_model, _ = read_model_file(os.path.join(folder, shard))
        params += [m for m in shard_model.params if weight_map.get(m.path) == shard]
    return _number(ModelInfo(params))


def _number(model: ModelInfo) -> ModelInfo:
    index = 0
    for m in model.params:
        m.index, m.tensor = (None if m.buffer else index), None
        index += 0 if m.buffer else 1
    return model


def open_folder(path: str, key: str | None = None, **options) -> Checkpoint:
    """Open a Trainer or Accelerate checkpoint folder as one torch checkpoint."""
    path = os.fspath(path).rstrip(os.sep) or os.sep
    lay = layout_of(path)
    if lay is None:
        raise FormatError(f"not a checkpoint folder statekit knows ({DESCRIPTION})", path)
    opt_file = _optimizer_file(path, lay, key)
    ckpt = torch_io.open_checkpoint(opt_file)
    if ckpt.optimizer is None:
        raise FormatError("holds no optimizer state_dict", opt_file)
    ckpt.path = path
    ckpt.metadata.update({"layout": lay.name, "optimizer_file": os.path.basename(opt_file)})
    model_file = _model_file(path, opt_file)
    defined = _name_from_definition(ckpt, path, options.get("trust_remote_code", False), options.get("model_config"))
    if model_file is not None:
        ckpt.model, ordered = read_model_file(model_file)
        ckpt.metadata["model_file"] = os.path.basename(model_file)
        if not defined and not any(p.path for p in ckpt.optimizer.params):
            torch_io.name_from_model(ckpt, ordered=ordered, source=os.path.basename(model_file))
    elif not defined:
        ckpt.warnings.append("the folder holds no model file (model.safetensors, pytorch_model.bin): "
                             "parameters stay unnamed unless --names or --model is given")
    _missing_definition(ckpt)
    if ckpt.optimizer.training_args is None:  # else read beside the optimizer file already
        args, why = hf_args.read_folder(path)
        hf_args.apply(ckpt, args, why)
    suffix = os.path.splitext(os.path.basename(opt_file))[0][len("optimizer"):]
    stem, ext = os.path.splitext(lay.scheduler)
    sched_file = os.path.join(path, f"{stem}{suffix}{ext}")
    if os.path.isfile(sched_file):
        ckpt.schedulers = [torch_state.describe_scheduler(schedule_torch.load(sched_file))]
        ckpt.metadata["scheduler_file"] = os.path.basename(sched_file)
    if lay.marker and os.path.isfile(os.path.join(path, lay.marker)):
        ckpt.scalars = _trainer_counters(os.path.join(path, lay.marker))
    _read_schedule(ckpt, path, lay, sched_file, opt_file)
    return ckpt


def _read_schedule(ckpt: Checkpoint, path: str, lay: FolderLayout, sched_file: str, opt_file: str) -> None:
    """The folder's LR schedule and counters (a schedule that cannot be read is a warning: the
    optimizer state stands on its own)."""
    try:
        if lay.name == "hf-trainer" and os.path.basename(opt_file) == "optimizer.pt":
            ckpt.schedule = schedule_hf.read_folder(path)
        elif os.path.isfile(sched_file):
            ckpt.schedule = schedule_torch.read_file(sched_file, optimizer=opt_file)
    except StatekitError as exc:
        ckpt.warnings.append(f"LR schedule not read: {exc.message}")


def name_from_definition(ckpt: Checkpoint, config: str | None, trust_remote_code: bool = False,
                         adapter: str | None = None) -> bool:
    """Name a torch checkpoint's positions from the model ``config`` describes (:mod:`hf_model`), or
    from the peft ``adapter`` checkpoint (a folder holding ``adapter_config.json``) over the base model
    ``config`` (None: the one the adapter names, :mod:`hf_peft`).

    True when settled (named, or refused). A definition that cannot be built (no transformers, hub code
    not allowed) leaves the state to the model file, with ``unnamed_why`` saying what would settle it;
    one that disagrees with the state is a warning naming the position (the model file's shapes are
    not tried after it: the definition is the model's own word)."""
    from statekit.frameworks import hf_model

    state = ckpt.optimizer
    try:
        if adapter is not None:
            from statekit.frameworks import hf_peft

            definition = hf_peft.build(adapter, model_config=config, trust_remote_code=trust_remote_code)
            config = os.path.join(adapter, hf_peft.CONFIG) if os.path.isdir(adapter) else adapter
        else:
            definition = hf_model.build(config, trust_remote_code=trust_remote_code)
    except MappingError as exc:  # no transformers, hub code not allowed, no such class: the model file may still do
        where = os.path.basename(exc.path or config or "") or "the definition"
        state.unnamed_why = exc.message if isinstance(exc, hf_model.MissingDefinitionError) \
            else f"{where}: {exc.message}"
        if adapter is not None and not isinstance(exc, hf_model.MissingDefinitionError):
            ckpt.warnings.append(f"{torch_io.UNNAMED} {state.unnamed_why}")
            return True
        return False
    ckpt.warnings.extend(definition.warnings)
    try:
        hf_model.name_state(state, definition, ckpt.path)
    except MappingError as exc:
        state.unnamed_why = f"{os.path.basename(config)}: {exc.message}"
        ckpt.warnings.append(f"{torch_io.UNNAMED} {state.unnamed_why}")
        return True
    ckpt.metadata["model_config"] = config
    return True


def _name_from_definition(ckpt: Checkpoint, path: str, trust_remote_code: bool, config: str | None) -> bool:
    from statekit.frameworks import hf_model, hf_peft

    if any(p.path for p in ckpt.optimizer.params):
        return False
    if hf_peft.adapter_folders(path):  # a peft adapter checkpoint: config (if given) is its base model's
        return name_from_definition(ckpt, config, trust_remote_code, adapter=path)
    config = config or hf_model.config_path(path)
    if config is None:
        return False
    return name_from_definition(ckpt, config, trust_remote_code)


def _missing_definition(ckpt: Checkpoint) -> None:
    """Still unnamed for want of transformers: the reader's warning says what to install, in one line."""
    state = ckpt.optimizer
    if state.unnamed_why and not all(p.path for p in state.params) \
            and not any(state.unnamed_why in w for w in ckpt.warnings):
        ckpt.warnings = [w for w in ckpt.warnings if not w.startswith(torch_io.UNNAMED)]
        ckpt.warnings.append(f"{torch_io.UNNAMED} {state.unnamed_why}")


def _trainer_counters(path: str) -> dict:
    state = schedule_hf.trainer_state(path)
    return {k: state[k] for k in TRAINER_COUNTERS if isinstance(state.get(k), int | float)}


open_checkpoint = open_folder
