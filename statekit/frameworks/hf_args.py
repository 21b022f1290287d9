"""A Trainer folder's ``training_args.bin``, read without executing anything.

``Trainer`` saves its whole ``TrainingArguments`` with ``torch.save`` (names-and-layouts.md §2.4):
a zip pickle of a dataclass (``NEWOBJ`` + ``BUILD`` with a state dict), enums (``OptimizerNames``,
``SchedulerType`` …, ``REDUCE`` of their value), a ``torch.device`` and accelerate's cached
``PartialState``. ``torch.load(weights_only=True)`` refuses it and a plain unpickler would import
transformers and accelerate. statekit reads it through its own allow-listing pickle reader
(:mod:`statekit.formats.torch_pickle`) with stand-ins for exactly those globals, allowed for this
one file: classes become plain records (nothing of them runs) and enums their values.

:func:`read` gives the optimizer's settings (:data:`FIELDS`), :func:`hyperparams` them in torch's
param-group names, and :func:`compare` the disagreements with the saved param groups.
:func:`settle` uses ``optim`` for what an optimizer file cannot say: which of bitsandbytes' one-state
optimizers (Lion, RMSprop, SGD, and their paged variants) wrote it — they pack their settings into
``betas``/``eps`` alike — and reports an ``optim`` the state contradicts.
"""

from __future__ import annotations

import math
import os

from statekit.errors import FormatError, StatekitError
from statekit.formats import torch_pickle, torch_pt

FILE = "training_args.bin"
# what the optimizer was built with (Trainer: AdamW(lr=learning_rate, betas=(adam_beta1, adam_beta2),
# eps=adam_epsilon, weight_decay=weight_decay) for adamw_torch / adamw_torch_fused)
FIELDS = ("optim", "optim_args", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
          "max_grad_norm", "lr_scheduler_type", "warmup_steps", "warmup_ratio")
# Trainer's optimizer names statekit reads as torch.optim.AdamW (trainer_optimizer.py)
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
# TrainingArguments.optim → the family statekit reads that optimizer's state as, for the names whose
# state statekit reads (transformers 5.x trainer_optimizer.py: the _BITSANDBYTES_OPTIMIZERS are
# bitsandbytes' AdamW, AdEMAMix, Lion and RMSprop, 8-bit with "8bit" in the name, paged with "paged")
OPTIM_FAMILIES = {
    **dict.fromkeys(ADAMW, "adamw"),
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"), "adamw"),
    **dict.fromkeys(("ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit"), "ademamix"),
    **dict.fromkeys(("lion_8bit", "lion_32bit", "paged_lion_32bit", "paged_lion_8bit"), "lion"),
    **dict.fromkeys(("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit"), "rmsprop"),
    "sgd": "sgd", "adagrad": "adagrad", "rmsprop": "rmsprop", "adafactor": "transformers-adafactor",
}
# what the schedule and the data position are rebuilt from (Trainer.create_scheduler, _inner_training_loop)
SCHEDULE_FIELDS = ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "learning_rate",
                   "max_steps", "num_train_epochs", "gradient_accumulation_steps", "per_device_train_batch_size",
                   "ignore_data_skip", "fp16", "bf16", "metric_for_best_model")
BITSANDBYTES = frozenset(n for n in OPTIM_FAMILIES if n not in ADAMW and n not in (
    "sgd", "adagrad", "rmsprop", "adafactor"))
SAME = {"adam": "adamw", "adamw": "adamw"}  # torch's AdamW state is Adam's: either name agrees with adamw
# classes Trainer pickles as NEWOBJ + BUILD (records); enums and torch.device are REDUCE'd (values)
RECORDS = ("TrainingArguments", "Seq2SeqTrainingArguments", "AcceleratorConfig", "PartialState", "AcceleratorState",
           "GradientAccumulationPlugin")
ENUM_ENDINGS = ("Names", "Type", "Strategy", "Option", "Mode", "Precision")
ARGS_MODULES = ("transformers.", "accelerate.", "trl.", "peft.")


class _Globals(dict):
    """The stand-ins allowed for ``training_args.bin``: records for the dataclasses, values for the enums."""

    def get(self, full: str, default=None):
        module, _, name = full.rpartition(".")
        if full == "torch.device":
            return torch_pickle.allowed_callable(full, lambda *args: ":".join(str(a) for a in args))
        if not module.startswith(ARGS_MODULES):
            return default
        if name in RECORDS or name.endswith(("Arguments", "Config")):
            return torch_pickle.RecordClass(full)
        if name.endswith(ENUM_ENDINGS):
            return torch_pickle.allowed_callable(full, lambda value, *_: value)
        return default


def path_in(folder: str) -> str | None:
    candidate = os.path.join(folder, FILE)
    return candidate if os.path.isfile(candidate) else None


def read(path: str, fields: tuple[str, ...] = FIELDS) -> dict:
    """The optimizer settings (or other ``fields``) of a ``training_args.bin`` (a FormatError when it is not one)."""
    obj = torch_pt.load_pt(path, extra_globals=_Globals())
    if not isinstance(obj, torch_pickle.Record) or not obj.kind.endswith(("Arguments", "Config")):
        raise FormatError("is not a pickled TrainingArguments", path)
    out = {k: obj.fields[k] for k in fields if k in obj.fields}
    out["class"] = obj.kind
    return out


def read_folder(folder: str) -> tuple[dict | None, str | None]:
    """``(settings, None)``, ``(None, why it could not be read)``, or ``(None, None)`` without the file."""
    path = path_in(folder)
    if path is None:
        return None, None
    try:
        return read(path), None
    except StatekitError as exc:
        return None, f"{FILE} not read ({exc.message}); hyperparameters from the param groups only"


def hyperparams(args: dict) -> dict:
    """The TrainingArguments' values in torch's param-group names (what Trainer passed to AdamW)."""
    out: dict = {}
    if isinstance(args.get("learning_rate"), int | float):
        out["lr"] = float(args["learning_rate"])
    if isinstance(args.get("adam_beta1"), int | float) and isinstance(args.get("adam_beta2"), int | float):
        out["betas"] = (float(args["adam_beta1"]), float(args["adam_beta2"]))
    if isinstance(args.get("adam_epsilon"), int | float):
        out["eps"] = float(args["adam_epsilon"])
    if isinstance(args.get("weight_decay"), int | float):
        out["weight_decay"] = float(args["weight_decay"])
    return out


def _same(a, b) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    except (TypeError, ValueError):
        return a == b


def optim_of(args: dict | None) -> str | None:
    optim = (args or {}).get("optim")
    return optim if isinstance(optim, str) else None


def settle(state, args: dict | None) -> list[str]:
    """Settle a bitsandbytes state's family from ``TrainingArguments.optim`` where its file fits several
    (in place); returns what the two disagree on (``optim`` names an optimizer whose state this is not)."""
    optim = optim_of(args)
    family = OPTIM_FAMILIES.get(optim or "")
    if family is None:
        return []
    by_bnb = optim in BITSANDBYTES
    library = "bitsandbytes " if by_bnb else ""
    if by_bnb != (state.library == "bitsandbytes"):
        return [f"TrainingArguments.optim is {optim!r} ({'a bitsandbytes' if by_bnb else 'not a bitsandbytes'} "
                f"optimizer), but the optimizer file holds {'bitsandbytes' if state.library else 'torch'}' "
                f"{state.family_label} state"]
    if state.family is None and state.candidates:
        if family in state.candidates:
            from statekit.frameworks.bnb import UNSETTLED

            fitted = state.candidates
            state.settle(family)
            state.notes = [n for n in state.notes if UNSETTLED not in n]
            state.notes.append(f"family from {FILE}: optim={optim!r} is bitsandbytes' {family} (its param groups "
                               f"alone fit {', '.join(fitted)} alike)")
            return []
        return [f"TrainingArguments.optim is {optim!r} ({library}{family}), but the param groups are not what "
                f"{library}{family} stores ({state.family_label})"]
    have = SAME.get(state.family or "", state.family)
    if state.family is not None and have != SAME.get(family, family) and family not in state.candidates:
        return [f"TrainingArguments.optim is {optim!r} ({library}{family}), but the optimizer file holds "
                f"{state.family_label} state"]
    return []


def compare(args: dict, groups: list[dict]) -> list[str]:
    """Where the param groups disagree with the TrainingArguments (Trainer's two groups: group 0 decays
    by ``weight_decay``, group 1 by 0; every group starts at ``learning_rate``: ``initial_lr``). Which
    of the arguments the optimizer took depends on ``optim`` (Trainer gives Lion ``adam_beta1``/
    ``adam_beta2`` and no eps; RMSprop, SGD, Adagrad and Adafactor their own ``optim_args``)."""
    want = hyperparams(args)
    out = []
    optim = optim_of(args)
    if optim is not None and optim not in OPTIM_FAMILIES:
        out.append(f"TrainingArguments.optim is {optim!r}, an optimizer whose settings statekit does not compare")
        return out
    expected = OPTIM_FAMILIES.get(optim or "", "adamw")
    if expected in ("rmsprop", "sgd", "adagrad", "transformers-adafactor"):
        want = {k: v for k, v in want.items() if k in ("lr", "weight_decay")}  # their settings come from optim_args
    if expected == "lion":
        want.pop("eps", None)
    for g, group in enumerate(groups):
        checks = {"betas": want.get("betas"), "eps": want.get("eps"),
                  "initial_lr" if "initial_lr" in group else "lr": want.get("lr")}
        if "weight_decay" in want and len(groups) == 2:
            checks["weight_decay"] = want["weight_decay"] if g == 0 else 0.0
        for key, value in checks.items():
            if value is None or key not in group:
                continue
            if not _same(group[key], value):
                out.append(f"param group {g} has {key}={group[key]!r}, TrainingArguments say {value!r}")
    return out


def apply(ckpt, args: dict | None, why: str | None) -> None:
    """A Trainer folder's TrainingArguments on its opened checkpoint: kept with the state, its ``optim``
    settling what the optimizer file cannot say (bitsandbytes' one-state optimizers), its
    disagreements reported (warnings: optim; notes: the hyperparameters)."""
    if args is not None:
        ckpt.optimizer.training_args = args
        ckpt.metadata["training_args"] = FILE
        ckpt.warnings += [f"{FILE}: {d}" for d in settle(ckpt.optimizer, args)]
        ckpt.optimizer.notes += [f"{FILE}: {d}" for d in compare(args, [g.hyperparams for g in ckpt.optimizer.groups])]
    elif why:
        ckpt.warnings.append(why)


OPTIMIZER_FILES = ("optimizer.pt",)  # Trainer's optimizer file, which training_args.bin sits beside


def beside(ckpt) -> None:
    """A Trainer folder's optimizer file opened alone: the ``training_args.bin`` beside it still says
    which optimizer wrote it (kept, and settling a bitsandbytes family, as for the folder)."""
    if ckpt.optimizer is None or ckpt.optimizer.training_args is not None:
        return
    if os.path.basename(ckpt.path) not in OPTIMIZER_FILES:
        return
    args, why = read_folder(os.path.dirname(os.path.abspath(ckpt.path)))
    apply(ckpt, args, why)
