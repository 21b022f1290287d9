"""Megatron → a Hugging Face Trainer checkpoint folder (``checkpoint-N/``) that ``Trainer.train(
resume_from_checkpoint=...)`` continues from.

The folder holds what Trainer reads on resume (transformers 5.24, ``Trainer._load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``TrainerState.load_from_json``):

- ``model.safetensors``: the fp32 masters in the HF names and shapes (``weights="master"``, the default), or the
  masters rounded to the run's dtype (``"model"``: bf16 for a bf16 run, which is the model's stored weights
  bit for bit — the reader proved it); the same structural map as the optimizer state's
  (:mod:`statekit.ops.megatron_hf`), the vocabulary padding rows stripped;
- ``config.json``: built from the run's args (:mod:`statekit.ops.megatron_config`), or ``--hf-config`` checked
  against them;
- ``optimizer.pt``: the moments by the Trainer's positions and groups (the ``statekit convert … optimizer.pt``
  path);
- ``scheduler.pt``: torch ``LambdaLR.state_dict()`` at ``last_epoch`` = the iteration, ``base_lrs`` = each
  group's peak lr (Megatron's ``max_lr`` × ``lr_mult``), ``_last_lr`` = its current lr. Trainer loads
  ``optimizer.pt`` only when ``scheduler.pt`` is beside it. The λ itself is not saved by torch: the Trainer
  rebuilds it from its own arguments (:func:`scheduler_state`);
- ``trainer_state.json``: ``global_step`` = the iteration, ``max_steps`` = ``train_iters``.

No ``rng_state.pth`` (Trainer logs that it found none and goes on; Megatron's RNG states are not torch's
per-device generators of an HF run) and no ``training_args.bin`` (a pickled ``TrainingArguments``: the resuming
run brings its own). The folder is written in a temporary sibling and renamed into place: all of it or nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

from statekit import naming
from statekit.errors import MappingError, UsageError
from statekit.formats import registry

WEIGHTS = ("master", "model")
FILES = ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")


def is_target(src: str, dst: str, to: str | None) -> bool:
    """``--to hf-trainer``, or a Megatron source going to a destination named like a Trainer checkpoint
    (``checkpoint-N``: any other source keeps its own meaning of a folder, a DCP checkpoint)."""
    if to == "hf-trainer":
        return True
    if to is not None or not re.fullmatch(r"checkpoint-\d+", os.path.basename(os.path.normpath(dst))):
        return False
    from statekit.errors import StatekitError

    try:
        return registry.framework_of(registry.sniff(src)) == "megatron"
    except (StatekitError, OSError):
        return False  # the ordinary path names the file and what is wrong with it


def scheduler_state(groups) -> dict:
    """The torch ``LambdaLR.state_dict()`` a Trainer resumes its scheduler from, one entry per group: the
    step count, each group's peak lr (``base_lrs``: what the Trainer's λ multiplies) and current lr. The λ is
    the Trainer's own (from its ``lr_scheduler_type``, ``warmup_steps``, ``max_steps``): give it Megatron's
    schedule (the ``opt_param_scheduler`` inspect shows) for the lr to go on as it would have."""
    steps = {float(g.hyperparams.get("step", 0) or 0) for g in groups}
    if len(steps) != 1:
        raise MappingError(f"the param groups are at different steps ({sorted(steps)}): one scheduler step")
    step = int(steps.pop())
    base, last = [], []
    for g in groups:
        hp = g.hyperparams
        if hp.get("lr") is None:
            raise MappingError("a param group has no lr: the scheduler's current lr")
        base.append(float(hp.get("max_lr", hp["lr"])) * float(hp.get("lr_mult", 1.0)))
        last.append(float(hp["lr"]))
    return {"base_lrs": base, "last_epoch": step, "_step_count": step + 1, "_is_initial": False,
            "_get_lr_called_within_step": False, "_last_lr": last, "lr_lambdas": [None] * len(groups)}


def _iteration(meta: dict, step: int) -> int:
    """The run's iteration: the common state's, or a Megatron-Bridge folder's ``train_state.pt`` step (refused
    where the two disagree)."""
    common, bridge = meta.get("megatron.iteration"), meta.get("megatron.train_state.step")
    if common is not None and bridge is not None and int(common) != int(bridge):
        raise MappingError(f"{meta.get('megatron.train_state.source')} is at step {bridge}, the common state's "
                           f"iteration is {common}: trainer_state.json's global_step would be a guess")
    return int(bridge if bridge is not None else common or step)


def trainer_state(meta: dict, step: int) -> dict:
    """``trainer_state.json``: the counters Trainer resumes from (``global_step`` = the iteration, a
    Megatron-Bridge folder's ``train_state.pt`` step)."""
    iteration = _iteration(meta, step)
    train_iters = meta.get("megatron.args.train_iters")
    flops = meta.get("megatron.flops_so_far")
    micro = meta.get("megatron.args.micro_batch_size")  # per rank and micro-step, as Trainer's per-device size
    return {"epoch": 0.0, "global_step": iteration,
            "max_steps": int(train_iters) if train_iters not in (None, "None") else iteration,
            "logging_steps": 500, "eval_steps": None, "save_steps": 500,
            "train_batch_size": int(micro) if micro not in (None, "None") else 1,
            "num_train_epochs": 1, "num_input_tokens_seen": 0, "total_flos": float(flops) if flops else 0.0,
            "log_history": [], "best_metric": None, "best_global_step": None, "best_model_checkpoint": None,
            "is_local_process_zero": True, "is_world_process_zero": True, "is_hyper_param_search": False,
            "trial_name": None, "trial_params": None, "stateful_callbacks": {}}


def _weights_dtype(meta: dict, weights: str, where: str) -> str:
    if weights not in WEIGHTS:
        raise UsageError(f"--weights {weights}: master (the fp32 masters) or model (rounded to the run's dtype)")
    if weights == "master":
        return "F32"
    if meta.get("megatron.bf16") == "True":
        return "BF16"
    return "F16" if meta.get("megatron.fp16") == "True" else "F32"


@dataclass
class Folder:
    """What a Trainer folder is made of besides optimizer.pt: the map, the masters it reads, the weights'
    dtype, config.json, and the notes for the plan."""

    hf_type: str
    structure: object
    masters: dict
    dtype: str
    config: dict
    notes: list[str] = field(default_factory=list)


def refuse_existing(dst: str) -> None:
    if os.path.isdir(dst) and os.listdir(dst):
        raise UsageError(f"{dst} exists and is not empty: a Trainer folder is written whole, never over another")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise UsageError(f"{dst} is a file; a Hugging Face Trainer checkpoint is a folder")


def prepare(ckpt, src: str, hf_model_type: str | None, hf_config: str | None, weights: str) -> Folder:
    """The folder's parts from an opened Megatron checkpoint (its masters taken before the optimizer
    state drops them; a tied PP copy dropped; the Hugging Face type, map and config)."""
    from statekit.ops import megatron_config, megatron_hf
    from statekit.state import refuse_bad_steps

    if registry.framework_of(ckpt.format) != "megatron" or ckpt.optimizer is None:
        raise UsageError(f"a Hugging Face Trainer folder (--to hf-trainer) is written from a Megatron "
                         f"checkpoint, not from a {ckpt.format} one")
    state, meta = ckpt.optimizer, ckpt.metadata
    refuse_bad_steps(state, src)
    _iteration(meta, 0)
    dtype = _weights_dtype(meta, weights, src)
    masters = {}
    for p in state.params:
        if naming.MASTER_SLOT not in p.slots:
            raise MappingError(f"{p.path}: no fp32 master in the checkpoint, so no weight for model.safetensors", src)
        masters[p.path] = p.slots[naming.MASTER_SLOT]
    tied = megatron_hf.drop_tied_copy(state, meta, src)
    given = megatron_config.read(hf_config).get("model_type") if hf_config is not None else None
    hf_type = megatron_hf.model_type(meta, hf_model_type or given, src)
    structure = megatron_hf.build(meta, {p.path: tuple(p.shape) for p in state.params}, src, hf_type)
    if tied:
        structure.notes.append(tied)
    config = megatron_config.build(meta, hf_type, dtype, src)
    if hf_config is not None:
        config = megatron_config.given(hf_config, config, src)
    megatron_hf.trainer_groups(state, src)
    megatron_hf.check_trainer_decay(state, structure, src)
    how = "fp32 masters" if dtype == "F32" else f"fp32 masters rounded to {dtype} (the model's stored weights)"
    note = (f"Hugging Face Trainer folder ({hf_type}): model.safetensors holds the {how}; config.json, "
            "optimizer.pt, scheduler.pt, trainer_state.json beside it; no rng_state.pth")
    return Folder(hf_type, structure, masters, dtype, config, [note])


def finish_plan(plan, folder: Folder, said: list[str], dst: str) -> None:
    """The optimizer.pt plan as the folder's: its target the folder, the notes that fit this source, and
    ``initial_lr`` in each group (what a torch scheduler built over the optimizer adds)."""
    plan.warnings = [w for w in plan.warnings if not w.startswith("structural rules: the map is not proved")]
    plan.warnings += [w for w in said if not w.startswith("the fp32 master weights")] + folder.notes
    plan.warnings.append("the LR schedule: scheduler.pt holds the position (the iteration) and each group's lr, "
                         "not the λ (torch saves none): after the first resumed step the lr is the Trainer's own "
                         "schedule, from its lr_scheduler_type, warmup_steps and max_steps; give it the "
                         "opt_param_scheduler `statekit inspect` shows (its steps count samples)")
    plan.target = dst
    base = [float(h.get("max_lr", h.get("lr", 0.0))) * float(h.get("lr_mult", 1.0)) for h in plan.hyperparams]
    for group, lr in zip(plan.hyperparams, base, strict=True):
        group.setdefault("initial_lr", lr)


def write_folder(plan, state, ckpt, folder: Folder, dst: str, progress=None) -> tuple[int, list[str]]:
    """Write the folder in a temporary sibling and rename it into place; (bytes written, writer warnings)."""
    from statekit.formats.safetensors import write_safetensors
    from statekit.formats.torch_pt import save_pt
    from statekit.ops.execute import write
    from statekit.ops.progress import silent
    from statekit.structure.apply import assembled

    sched = scheduler_state(state.groups)
    tstate = trainer_state(ckpt.metadata, sched["last_epoch"])
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(dst))}.statekit-", dir=parent)
    warnings: list[str] = []
    try:
        with (progress or silent)("writing", ckpt.nbytes, unit_bytes=True) as advance:
            write(plan, state, os.path.join(tmp, "optimizer.pt"), progress=advance, on_warning=warnings.append)
            tensors = [(path, assembled(folder.structure.targets[path], folder.masters, folder.dtype))
                       for path in folder.structure.order]
            write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
        for name, obj in (("config.json", folder.config), ("trainer_state.json", tstate)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as fh:
                json.dump(obj, fh, indent=2)
                fh.write("\n")
        save_pt(sched, os.path.join(tmp, "scheduler.pt"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700: a folder as mkdir makes it
        refuse_existing(dst)
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sum(os.path.getsize(os.path.join(dst, n)) for n in FILES), warnings
