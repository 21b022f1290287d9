"""PyTorch ``.pt`` files: open as a Checkpoint, write optimizer state and state_dicts.

Implements :class:`statekit.frameworks.base.Framework` for the registry's ``torch`` entry.

``open_checkpoint`` finds the optimizer state_dict (the file itself, or an entry of a training
checkpoint; ``key=`` chooses when several), and a model state_dict when the checkpoint carries
one, whose parameter names (buffers excluded) name the optimizer's positions.
"""

from __future__ import annotations

import operator
import os

from statekit import dtypes, hyper
from statekit.errors import FormatError, MappingError, StatekitError, UnsafePickleError
from statekit.formats import torch_pt
from statekit.formats.torch_pickle import no_gc
from statekit.frameworks import base, schedule_torch, torch_state, torch_thirdparty
from statekit.schedule import torch_lr
from statekit.state import Checkpoint, ModelInfo, OptimizerState

FORMAT = "torch"
_NBYTES = operator.attrgetter("nbytes")  # (mapped over 10^6 tensors: no generator frame a tensor)
UNNAMED = "parameters left unnamed:"  # how a reader's warning starts when naming from the file's model failed


def open_checkpoint(path: str, key: str | None = None, **options) -> Checkpoint:
    from statekit.formats import dcp, deepspeed, megatron_legacy

    # one chunk file of a DCP checkpoint, one rank's shard of a DeepSpeed or Megatron one: read the whole checkpoint
    directory = dcp.directory_of(path) or deepspeed.directory_of(path) or megatron_legacy.directory_of(path)
    if directory is not None:
        from statekit.formats import registry

        return registry.open_checkpoint(directory, **({"key": key} if key else {}), **options)
    with no_gc():  # 10^6 tensors become 10^6 records: no collection needs to rescan them meanwhile
        try:
            obj = torch_pt.load_pt(path)
        except UnsafePickleError as exc:  # a class only one optimizer library pickles: refused by its name
            name = exc.message.partition("global '")[2].partition("'")[0]
            if name not in schedule_torch.GLOBALS:
                torch_thirdparty.refuse_global(name, path)
                raise
            obj = schedule_torch.load(path)  # MultiStepLR's milestones: allowed where schedulers are saved only
            if torch_lr.class_of(obj) is None and not (isinstance(obj, dict) and obj.get("lr_schedulers")):
                raise
        if torch_lr.class_of(obj) is not None:
            return scheduler_checkpoint(path, obj)
        ckpt = checkpoint_from_object(obj, path, key, FORMAT)
        if isinstance(obj, dict) and obj.get("lr_schedulers"):  # a Lightning checkpoint's
            try:
                ckpt.schedule = schedule_torch.from_lightning(obj, path)
            except StatekitError as exc:
                ckpt.warnings.append(f"LR schedule not read: {exc.message}")
    if ckpt.optimizer is not None and ckpt.optimizer.training_args is None:
        from statekit.frameworks import hf_args

        hf_args.beside(ckpt)  # a Trainer folder's optimizer.pt: its training_args.bin says which optimizer wrote it
    return ckpt


def scheduler_checkpoint(path: str, obj: object) -> Checkpoint:
    """A torch LR scheduler's file (``scheduler.pt``): its schedule, with the optimizer file beside it."""
    if torch_lr.class_of(obj) is None:
        raise FormatError("holds neither an optimizer state_dict nor an LR scheduler's", path)
    ckpt = Checkpoint(path=path, format=FORMAT, kind="scheduler")
    ckpt.schedulers = [torch_state.describe_scheduler(obj)]
    ckpt.schedule = schedule_torch.read_file(path)
    return ckpt


def stored_nbytes(refs: list) -> int:
    """The bytes the file stores for ``refs``: a value decoded from other tensors (torchao's
    quantized moments) counts those tensors, and a tensor saved twice (one qmap shared by every
    moment) counts once."""
    seen: dict = {}
    for ref in refs:
        info = ref.info if type(ref.info) is dict else {}
        for r in info.get("stored_tensors", (ref,)):
            i = r.info if type(r.info) is dict else {}
            key = ((i["storage_key"], i.get("storage_offset"), r.shape, r.dtype) if "storage_key" in i
                   else id(r))
            seen.setdefault(key, r.nbytes)
    return sum(seen.values())


# where a torch file's own names came from (said where inspect and plans say where names came from)
NAMES_IN_FILE = ("parameter names from the file's param_names (what torch >= 2.6 keeps in each param group for an "
                 "optimizer built from named_parameters())")


def checkpoint_from_object(obj: object, path: str, key: str | None, fmt: str) -> Checkpoint:
    """A Checkpoint for the object a torch file (or DCP directory) holds."""
    from statekit.frameworks import torch_fqn

    obj, fqn_notes = torch_fqn.normalize(obj, path)
    sd, where = torch_state.find_optimizer(obj, key, path)
    model_sd = torch_state.find_model(obj)
    ckpt = Checkpoint(path=path, format=fmt, kind="tensors")
    if sd is not None:
        ckpt.kind = "optimizer"
        ckpt.optimizer = torch_state.read_optimizer(sd, path)
        ckpt.optimizer.notes.extend(fqn_notes)
        if ckpt.optimizer.torch_names_in_file and not fqn_notes:
            ckpt.optimizer.names_from = NAMES_IN_FILE
        from statekit.frameworks.bnb import stored_tensors
        from statekit.state import nested_tensors

        refs = [r for p in ckpt.optimizer.params for r in (stored_tensors(p) if p.encoding else p.slots.values())]
        refs += [r for p in ckpt.optimizer.params for v in p.opaque.values() for r in nested_tensors(v)]
        ckpt.n_tensors = len(refs) + sum(1 for p in ckpt.optimizer.params if "__step_dtype" in p.extra
                                         and p.extra["__step_dtype"] != "python")
        ckpt.nbytes = stored_nbytes(refs)
        if where:
            ckpt.metadata["key"] = where
            ckpt.optimizer.notes.append(f"optimizer state found under {where!r} in a training checkpoint")
        if isinstance(obj, dict):
            ckpt.scalars = {str(k): v for k, v in obj.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
    if model_sd is not None:
        ckpt.model = torch_state.read_model(model_sd)
        if ckpt.kind != "optimizer":
            ckpt.kind = "model"
            ckpt.n_tensors = len(model_sd)
            ckpt.nbytes = sum(map(_NBYTES, model_sd.values()))
        elif not any(p.path for p in ckpt.optimizer.params):
            name_from_model(ckpt, ordered=True, source="the checkpoint's model state_dict")
    ckpt.schedulers = torch_state.schedulers_of(obj)
    if ckpt.kind == "tensors" and not (isinstance(obj, dict) and obj):
        raise FormatError("holds neither an optimizer state_dict nor a model state_dict", path)
    if ckpt.kind == "tensors":
        _refuse_unread_tensors(obj, path)
    return ckpt


def _first_tensor(value: object, where: tuple = ()) -> tuple | None:
    """The key path of the first tensor inside ``value`` (dicts, lists, tuples), or None."""
    from statekit.tensor import TensorRef

    if isinstance(value, TensorRef):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for k, v in items:
        found = _first_tensor(v, (*where, k))
        if found is not None:
            return found
    return None


def _refuse_unread_tensors(obj: object, path: str) -> None:
    """A file whose tensors sit where no optimizer or model state_dict is never shown as holding none."""
    from statekit.state import nested_tensors

    where = _first_tensor(obj)
    if where is not None:
        n = len(nested_tensors(obj))
        raise FormatError(f"holds {n} tensor{'s' * (n != 1)} but neither an optimizer state_dict nor a model "
                          f"state_dict (the first under {' → '.join(map(repr, where))}): statekit does not "
                          "know what they are", path)


def name_from_model(ckpt: Checkpoint, *, ordered: bool | None = None, source: str) -> None:
    """Name positional optimizer parameters from a model's parameters (``ckpt.model``): solved by
    :mod:`statekit.frameworks.torch_names` from order and shapes, never assumed.

    ``ordered``: the model lists its parameters in ``named_parameters()`` order (a torch state_dict
    does; a safetensors file does not); None: what ``ckpt.model.order`` says. A naming that is
    ambiguous or impossible leaves the parameters unnamed, with the reason as a warning.
    """
    from statekit.frameworks import torch_names

    try:
        torch_names.name_state(ckpt.optimizer, torch_names.from_model_info(ckpt.model, source, ordered=ordered),
                               ckpt.path)
    except MappingError as exc:
        ckpt.warnings.append(f"{UNNAMED} {exc.message}")


@base.optimizer_writer
def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write ``state`` as a torch ``optimizer.state_dict()``. ``family`` defaults to the state's,
    ``groups`` (torch's param_group dicts) to the state's own groups; torch keeps no free-form
    metadata and a step per parameter, so ``metadata`` and ``step_policy`` are not used."""
    family = family or state.family
    if groups is None:
        groups = [dict(g.hyperparams) for g in state.groups] or [{}]
    names = (metadata or {}).get(hyper.OMIT_NAMES_KEY) != "omit"
    torch_pt.save_pt(torch_state.to_state_dict(state, family, groups, names=names), path)
    return os.path.getsize(path)


def save_model(model: ModelInfo, path: str, *, dtype: str | None = None, metadata: dict[str, str] | None = None,
               progress=None) -> int:
    """Write named tensors as a torch ``state_dict`` (``{name: tensor}``, ``torch.save`` zip format)."""
    tensors = {}
    for p in model.params:
        if p.tensor is None:
            raise MappingError(f"model parameter {p.path} has no tensor data")
        tensors[p.path] = p.tensor.cast(dtype) if dtype and dtypes.is_float(p.tensor.dtype) else p.tensor
    torch_pt.save_pt(tensors, path)
    return os.path.getsize(path)
