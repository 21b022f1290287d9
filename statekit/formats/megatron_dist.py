"""Megatron-Core ``torch_dist`` checkpoints (``--ckpt-format torch_dist``), read without torch.

A torch_dist checkpoint is a DCP directory (:mod:`statekit.formats.dcp`) written by
``megatron.core.dist_checkpointing`` (facts: ``shared/docs/megatron-formats.md`` §2)::

    <save>/latest_checkpointed_iteration.txt   the iteration (an integer, or ``release``)
    <save>/iter_0000100/                       the checkpoint (``release/`` for a release)
        metadata.json      {"sharded_backend": "torch_dist", ...}: written last, marks it complete
        .metadata          DCP's Metadata pickled as ``MCoreMetadata`` (core 0.8-0.15 add the
                           attribute ``mcore_data``: the true global shape of reformulated tensors)
        __{r}_{k}.distcp   data files
        common.pt          core <= 0.18: the non-sharded state (args, iteration, scheduler,
                           the optimizer's skeleton), ``torch.save`` of a dict. From core 0.19 it
                           is the DCP bytes item ``common_state/shard_0_1``, ``torch.save([dict])``.

NeMo 2 keeps the same files in ``<ckpt>/weights/``. Megatron's ShardedObjects (the RNG state,
the distributed optimizer's param groups per model-parallel rank ...) are DCP bytes items keyed
``{key}/shard_{offset}_{shape}`` whose bytes are ``torch.save`` of the object (Megatron's save
planner writes them untransformed).

Every pickle here is read by statekit's allow-listing reader with :data:`MEGATRON_GLOBALS`: DCP's
classes, Megatron's own ``safe_globals`` list (``megatron/core/safe_globals.py``; the table is
:data:`statekit.formats.megatron_legacy.MEGATRON_GLOBALS`) and the few classes torch_dist adds
(``MCoreMetadata``, core 0.19's save plans), all as plain records or values: nothing of Megatron
or torch is imported or run, and any other global is refused by name.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass

from statekit.errors import FormatError, MappingError
from statekit.formats import dcp, limits, megatron_legacy, torch_pickle, torch_pt
from statekit.formats.torch_pickle import Record, RecordClass

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
COMMON_STATE = "common_state"  # core >= 0.19: the common state inside the DCP
TRACKER = "latest_checkpointed_iteration.txt"
NEMO_WEIGHTS = "weights"
BACKEND = "torch_dist"
MCORE_METADATA = "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata"
METADATA_KINDS = ("Metadata", "MCoreMetadata")

# beyond Megatron's own allow-list (megatron_legacy.MEGATRON_GLOBALS, the one table of it) and DCP's
# classes: .metadata's root class, and the save plans kept in it (``all_local_plans``: core 0.14's
# MCoreSavePlan, 0.19's SavePlan)
_RECORDS = (
    MCORE_METADATA,
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData",
)
_ENUMS = ("torch.distributed.checkpoint.planner.WriteItemType",)


def _enum(full: str):
    def make(value: object = None) -> object:
        if not isinstance(value, int | str):
            raise FormatError(f"{full}({limits.short(value)}) is not an enum value")
        return value

    return torch_pickle.allowed_callable(full, make)


def _globals() -> dict[str, object]:
    allowed: dict[str, object] = {**dcp.DCP_GLOBALS, **megatron_legacy.MEGATRON_GLOBALS}
    for name in _RECORDS:
        allowed[name] = RecordClass(name)
    for name in _ENUMS:
        allowed[name] = _enum(name)
    return allowed


MEGATRON_GLOBALS = _globals()


# --------------------------------------------------------------------------------------------
# where the checkpoint is


def _json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_dist_dir(path: str) -> bool:
    data = _json(os.path.join(path, METADATA_JSON))
    return data is not None and data.get("sharded_backend") == BACKEND


def _tracked(root: str) -> str | None:
    """The iteration folder ``latest_checkpointed_iteration.txt`` names (None: no tracker)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    try:
        with open(tracker, encoding="utf-8") as fh:
            text = fh.read(64).strip()
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", tracker) from None
    if text == "release":
        return os.path.join(root, "release")
    if not re.fullmatch(r"\d{1,12}", text):
        raise FormatError(f"holds {text[:20]!r}, not an iteration number or 'release'", tracker)
    return os.path.join(root, f"iter_{int(text):07d}")


def resolve(path: str | os.PathLike) -> str | None:
    """The torch_dist folder ``path`` means: itself, the iteration its save root's tracker names,
    or a NeMo 2 checkpoint's ``weights/``; None when it is none of these."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if _is_dist_dir(path):
        return path
    nemo = os.path.join(path, NEMO_WEIGHTS)
    if _is_dist_dir(nemo):
        return nemo
    try:
        tracked = _tracked(path)
    except FormatError:
        return None
    if tracked is not None and os.path.isdir(tracked):
        if _is_dist_dir(tracked):
            return tracked
        if _is_dist_dir(os.path.join(tracked, NEMO_WEIGHTS)):
            return os.path.join(tracked, NEMO_WEIGHTS)
    return None


def claims(head: bytes, path: str) -> bool:
    """Registry sniffer (directories): a Megatron torch_dist folder, its save root (the tracker
    file naming one), or a NeMo 2 checkpoint; tried before the plain DCP entry."""
    return resolve(path) is not None


# --------------------------------------------------------------------------------------------
# reading


class MegatronDist:
    """One torch_dist checkpoint: its DCP values (lazy), common state and ShardedObjects."""

    def __init__(self, path: str | os.PathLike):
        given = os.fspath(path)
        if os.path.isdir(given):
            tracked = _tracked(given)
            if tracked is not None and not os.path.isdir(tracked) and not _is_dist_dir(given):
                raise FormatError(f"{TRACKER} names {os.path.basename(tracked)}, which is not here", given)
        folder = resolve(given)
        if folder is None:
            raise FormatError("not a Megatron torch_dist checkpoint (no metadata.json with sharded_backend "
                              "'torch_dist' here, in weights/ or in the iteration the tracker names)", given)
        self.path = given
        self.directory = folder
        self.backend = _json(os.path.join(folder, METADATA_JSON)) or {}
        if not os.path.isfile(os.path.join(folder, dcp.METADATA)):
            raise FormatError("metadata.json is here but .metadata is not: the checkpoint is incomplete", folder)
        self.reader = dcp.DcpReader(folder, MEGATRON_GLOBALS, METADATA_KINDS)
        self.meta = self.reader.meta
        mcore = self.meta.attributes.get("mcore_data")
        if mcore is not None and not isinstance(mcore, dict):
            raise FormatError(f"mcore_data is a {type(mcore).__name__}, not a dict",
                              os.path.join(folder, dcp.METADATA))
        self.mcore_data: dict = mcore or {}
        self._common: dict | None = None

    def close(self) -> None:
        self.reader.close()

    # ------------------------------------------------------------------ the common state

    @property
    def common_source(self) -> str:
        """Where the common state lies: ``common.pt``, or the DCP item ``common_state`` (core >= 0.19)."""
        if os.path.isfile(os.path.join(self.directory, COMMON_PT)):
            return COMMON_PT
        if self.object_key(COMMON_STATE) is not None:
            return COMMON_STATE
        raise FormatError(f"neither {COMMON_PT} nor a {COMMON_STATE} item is here: the checkpoint is incomplete "
                          "(args, iteration and the optimizer's param groups are in it)", self.directory)

    def common(self) -> dict:
        """The common (non-sharded) state: a dict (args as a Record of argparse.Namespace)."""
        if self._common is None:
            source = self.common_source
            if source == COMMON_PT:
                where = os.path.join(self.directory, COMMON_PT)
                value = torch_pt.load_pt(where, MEGATRON_GLOBALS)
            else:
                where = os.path.join(self.directory, COMMON_STATE)
                value = self.object(COMMON_STATE)
            if not isinstance(value, dict):
                raise FormatError(f"the common state is a {type(value).__name__}, not a dict", where)
            self._common = value
        return self._common

    # ------------------------------------------------------------------ ShardedObjects

    def object_keys(self, key: str) -> list[str]:
        """The DCP items of ShardedObject ``key`` (``{key}/shard_...``)."""
        prefix = key + "/shard_"
        return [k for k, e in self.meta.entries.items() if k.startswith(prefix) and isinstance(e, dcp.BytesEntry)]

    def objects_like(self, start: str, end: str) -> list[str]:
        """The ShardedObjects ``{start}<number>{end}`` (``optimizer.distributed.dp_group_idx_0.optimizer``
        …), by their keys without the shard suffix, in number order."""
        pattern = re.compile(re.escape(start) + r"(\d+)" + re.escape(end) + r"/shard_")
        found = {}
        for k, e in self.meta.entries.items():
            m = pattern.match(k)
            if m and isinstance(e, dcp.BytesEntry):
                found[int(m.group(1))] = k.split("/shard_", 1)[0]
        return [found[n] for n in sorted(found)]

    def object_key(self, key: str) -> str | None:
        found = self.object_keys(key)
        if len(found) > 1:
            raise FormatError(f"ShardedObject {key} is stored {len(found)} times ({', '.join(found[:3])})",
                              self.directory)
        return found[0] if found else None

    def object(self, key: str) -> object:
        """The value of the single-shard ShardedObject ``key`` (its ``torch.save`` payload; a list
        payload of one item, as ``common_state`` is written, unwrapped)."""
        found = self.object_key(key)
        if found is None:
            raise FormatError(f"no ShardedObject {key} here", self.directory)
        value = self.reader.value(found)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        return value

    def raw_object(self, key: str) -> dcp.RawBytes:
        """The stored bytes of DCP bytes item ``key`` (a whole ``torch.save`` archive), to copy as is."""
        entry = self.meta.entries[key]
        if not isinstance(entry, dcp.BytesEntry):
            raise FormatError(f"{key} is a tensor, not a ShardedObject", self.directory)
        return dcp.RawBytes(bytes(self.reader._map(entry.file)[entry.offset:entry.offset + entry.length]))

    def common_to_rewrite(self) -> dict:
        """The common state read for writing it again: as :meth:`common`, but Megatron's enums kept
        as :class:`EnumValue` (their class and value), so that :func:`dumps_common` writes them back."""
        if self.common_source == COMMON_PT:
            value = torch_pt.load_pt(os.path.join(self.directory, COMMON_PT), REWRITE_GLOBALS)
        else:
            entry = self.meta.entries[self.object_key(COMMON_STATE)]
            value = torch_pt.load_pt_region(self.reader._map(entry.file), entry.offset, entry.length,
                                            self.reader._source(entry.file), REWRITE_GLOBALS)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
        if not isinstance(value, dict):
            raise FormatError(f"the common state is a {type(value).__name__}, not a dict", self.directory)
        return value

    # ------------------------------------------------------------------ tensors

    def tensor_entries(self) -> dict[str, dcp.TensorEntry]:
        return {k: e for k, e in self.meta.entries.items() if isinstance(e, dcp.TensorEntry)}

    def reformulated_shape(self, key: str) -> tuple[int, ...] | None:
        """The model's global shape of a tensor stored N-D reformulated (``mcore_data``), else None."""
        data = self.mcore_data.get(key)
        if data is None:
            return None
        shape = data.get("nd_reformulated_orig_global_shape") if isinstance(data, dict) else None
        if shape is None:
            return None
        if not isinstance(shape, tuple | list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"mcore_data[{key!r}]: nd_reformulated_orig_global_shape {limits.short(shape)} is "
                              "not a shape", os.path.join(self.directory, dcp.METADATA))
        return tuple(shape)


# --------------------------------------------------------------------------------------------
# writing the common state (statekit.frameworks.megatron.write_dist)


@dataclass(frozen=True)
class EnumValue:
    """A Megatron enum member read for writing back: its class's full name and its value."""

    cls: str
    value: object


def _keep_enum(name: str):
    def make(value: object, *_rest: object) -> EnumValue:
        if not isinstance(value, int | str | float | tuple):
            raise FormatError(f"{name}({value!r}) is not an enum value")
        return EnumValue(name, value)

    return torch_pickle.allowed_callable(name, make)


REWRITE_GLOBALS = {**MEGATRON_GLOBALS, **{name: _keep_enum(name) for name in megatron_legacy._ENUMS}}
NAMESPACE = "argparse.Namespace"


class _CommonPickler(torch_pickle._Pickler):
    """torch.save's pickle of Megatron's common state: what :func:`torch_pickle.dumps` writes, plus
    ``argparse.Namespace`` (NEWOBJ + BUILD, as pickle protocol 2 writes a plain object) and the
    enums of Megatron's ``safe_globals`` (``Enum(value)``, as an enum reduces): what Megatron's
    ``torch.load(weights_only=True)`` with its safe globals rebuilds."""

    def save(self, obj: object, where: str) -> None:
        if isinstance(obj, EnumValue):
            module, name = obj.cls.rsplit(".", 1)
            self.call(module, name, (obj.value,), where)
        elif isinstance(obj, Record):
            if obj.cls != NAMESPACE:
                raise MappingError(f"cannot write a {obj.cls} into Megatron's common state (at {where})")
            self.global_("argparse", "Namespace")
            self.emit(pickle.EMPTY_TUPLE, pickle.NEWOBJ)
            self.save_container(dict(obj.fields), where)
            self.emit(pickle.BUILD)
        else:
            super().save(obj, where)


def dumps_common(obj: object) -> tuple[bytes, list]:
    pickler = _CommonPickler()
    pickler.save(obj, "common state")
    pickler.emit(pickle.STOP)
    return b"".join(pickler.out), pickler.tensors


def common_archive(obj: object) -> bytes:
    """``torch.save(obj)`` of a common state (or of ``[common]``, the 0.19 ShardedObject payload)."""
    buffer = io.BytesIO()
    torch_pt.write_pt_stream(buffer, obj, "archive", dumps=dumps_common)
    return buffer.getvalue()
