"""torch.distributed.checkpoint (DCP) directories, read and written without torch.

A DCP checkpoint is a directory::

    .metadata            pickle.dump(Metadata) — what every key is and where its bytes lie
    __0_0.distcp ...     data files: each tensor chunk (and each non-tensor value) is a complete
                         torch.save zip archive, written back to back

``Metadata`` (``torch/distributed/checkpoint/metadata.py``) holds ``state_dict_metadata`` (flat
key → ``TensorStorageMetadata(properties, size, chunks=[ChunkStorageMetadata(offsets,
sizes)])`` or ``BytesStorageMetadata()``), ``storage_data`` (``MetadataIndex(fqn, offset,
index)`` → ``_StorageInfo(relative_path, offset, length[, transform_descriptors])``),
``planner_data`` (flat key → the key's path in the nested state_dict that was saved: ``"optim.
state.fc.weight.exp_avg"`` → ``("optim", "state", "fc.weight", "exp_avg")``), ``storage_meta``
and ``version``.

Reading: torch loads ``.metadata`` with an unrestricted ``pickle.load``; statekit reads it with
its own allow-listing unpickler (:mod:`statekit.formats.torch_pickle`), allowing exactly the
classes below, built as plain records — nothing of torch runs and any other global is refused.
Tensors come back lazy: a chunk's archive is parsed only when its values are asked for, and
chunks that split a tensor along its first axis stream one after another.

Writing: one chunk per tensor (the whole tensor), tensors spread over N data files balanced by
bytes; a ``.metadata`` pickled with only the DCP names, which real torch loads with
``dcp.load`` (any world size: DCP reshards on load). Data files are written by
:func:`write_part` (each atomically, plus a JSON part manifest) and :func:`finalize` writes
``.metadata`` once every part is present, so several processes can each write a share.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import mmap
import os
import pickle
import posixpath
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from statekit import dtypes
from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.formats import limits, torch_pickle, torch_pt
from statekit.formats.torch_pickle import Record, RecordClass, TorchDtype
from statekit.tensor import SourceFile, TensorRef

METADATA = ".metadata"
SUFFIX = ".distcp"
VERSION = "1.0.0"
PART_SUFFIX = ".part.json"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_OLD = "torch.distributed._shard.sharded_tensor.metadata"
_PROPERTIES = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
_LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn")


# --------------------------------------------------------------------------------------------
# the allow-list: DCP's classes by exact name, as plain records


def _enum(name: str):
    def make(value: object) -> str:
        if type(value) is not int or not 0 <= value <= 2:
            raise FormatError(f"{name}({value!r}) is not a memory format encoding")
        return ("contiguous_format", "channels_last", "preserve_format")[value]

    return torch_pickle.allowed_callable(name, make)


def _layout(name: object) -> str:
    if name not in _LAYOUTS:
        raise FormatError(f"torch.serialization._get_layout({name!r}) is not a known layout")
    return name


def _path(*parts: object) -> str:
    if not parts or not all(isinstance(p, str) for p in parts):
        raise FormatError(f"PosixPath arguments {parts!r} are not strings")
    return posixpath.join(*parts)


def _globals() -> dict[str, object]:
    allowed: dict[str, object] = {}
    for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                 "StorageMeta", "MetadataIndex"):
        allowed[f"{_MD}.{name}"] = RecordClass(f"{_MD}.{name}")
    for module in (_MD, _OLD):
        allowed[f"{module}.TensorProperties"] = RecordClass(f"{module}.TensorProperties", _PROPERTIES)
    allowed[f"{_MD}._MEM_FORMAT_ENCODING"] = _enum(f"{_MD}._MEM_FORMAT_ENCODING")
    allowed[f"{_OLD}.MEM_FORMAT_ENCODING"] = _enum(f"{_OLD}.MEM_FORMAT_ENCODING")
    for name in ("_StorageInfo", "_StoragePrefix"):
        allowed[f"{_FS}.{name}"] = RecordClass(f"{_FS}.{name}")
    allowed["torch.serialization._get_layout"] = torch_pickle.allowed_callable("_get_layout", _layout)
    allowed["torch.strided"] = "torch.strided"
    for module in ("pathlib", "pathlib._local"):
        allowed[f"{module}.PosixPath"] = torch_pickle.allowed_callable(f"{module}.PosixPath", _path)
    return allowed


DCP_GLOBALS = _globals()


# --------------------------------------------------------------------------------------------
# metadata as plain data


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and where its archive lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorEntry:
    key: str
    dtype: str  # statekit dtype name
    shape: tuple[int, ...]
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass
class BytesEntry:
    """A non-tensor value: a torch.save'd Python object at one byte range."""

    key: str
    file: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    entries: dict[str, TensorEntry | BytesEntry]
    paths: dict[str, tuple]  # flat key -> nested path (planner_data), every key present
    version: str | None = None
    files: list[str] = field(default_factory=list)
    # fields of the pickled Metadata beyond torch's own (Megatron's ``mcore_data``), as read
    attributes: dict[str, object] = field(default_factory=dict)


def is_dcp_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def claims(head: bytes, path: str) -> bool:
    """Registry sniffer (directories): a folder with a ``.metadata`` file."""
    return is_dcp_dir(path)


def directory_of(path: str | os.PathLike) -> str | None:
    """The checkpoint directory when ``path`` is one of its data files or its ``.metadata``."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if (path.endswith(SUFFIX) or os.path.basename(path) == METADATA) and is_dcp_dir(parent):
        return parent
    return None


def _ints(value: object, what: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise FormatError(f"{key}: {what} {value!r} is not a tuple of non-negative integers")
    return tuple(value)


def _record(value: object, kind: str, where: str) -> Record:
    if not isinstance(value, Record) or value.kind != kind:
        got = value.kind if isinstance(value, Record) else type(value).__name__
        raise FormatError(f"{where} is a {got}, expected {kind}")
    return value


def read_metadata(directory: str | os.PathLike, extra_globals: dict | None = None,
                  metadata_kinds: tuple[str, ...] = ("Metadata",)) -> DcpMetadata:
    """Parse ``directory/.metadata`` and check it against the data files; FormatError naming the
    file and the offending key on any inconsistency. ``extra_globals``: more globals allowed in
    the pickle than DCP's own (a writer that added attributes of its own classes);
    ``metadata_kinds``: the class names the pickled root may have (a writer's subclass of
    ``Metadata``, allowed by ``extra_globals``)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise FormatError(f"cannot read DCP metadata: {exc.strerror}", path) from None
    try:
        obj, end = torch_pickle.loads(data, 0, None, {**DCP_GLOBALS, **(extra_globals or {})})
        kind = obj.kind if isinstance(obj, Record) else None
        meta = _record(obj, kind if kind in metadata_kinds else "Metadata", "the pickle")
        return _interpret(meta, directory)
    except FormatError as exc:
        if exc.path is None:
            exc.path = path
        raise


def _storage_index(storage: object) -> dict[tuple[str, tuple | None], Record]:
    if not isinstance(storage, dict):
        raise FormatError(f"storage_data is a {type(storage).__name__}, not a dict")
    out: dict[tuple[str, tuple | None], Record] = {}
    for index, info in storage.items():
        index = _record(index, "MetadataIndex", "a storage_data key")
        info = _record(info, "_StorageInfo", f"storage_data[{index.get('fqn')!r}]")
        fqn, offset = index.get("fqn"), index.get("offset")
        if not isinstance(fqn, str):
            raise FormatError(f"storage_data key {index.fields!r} has no fqn")
        out[fqn, None if offset is None else _ints(offset, "offset", fqn)] = info
    return out


def _where(info: Record, key: str, sizes: dict[str, int]) -> tuple[str, int, int]:
    rel, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    if not isinstance(rel, str) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise FormatError(f"{key}: malformed storage record {info.fields!r}")
    if rel != posixpath.basename(rel) or rel in ("", ".", ".."):
        raise FormatError(f"{key}: data file {rel!r} is not a plain file name in the checkpoint directory")
    transforms = info.get("transform_descriptors")
    if transforms:
        raise FormatError(f"{key}: chunk is stored through {list(transforms)} (compressed); statekit reads "
                          "uncompressed DCP checkpoints only")
    if rel not in sizes:
        raise FormatError(f"{key}: data file {rel} is missing from the checkpoint directory")
    if offset + length > sizes[rel]:
        raise FormatError(f"{key}: bytes [{offset}, {offset + length}) lie past the end of {rel} "
                          f"({sizes[rel]} bytes): the file is truncated")
    return rel, offset, length


def _interpret(meta: Record, directory: str) -> DcpMetadata:
    sdm = meta.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise FormatError("Metadata has no state_dict_metadata dict")
    storage = _storage_index(meta.get("storage_data"))
    names = {info.get("relative_path") for info in storage.values()}
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in names
             if isinstance(n, str) and n == posixpath.basename(n) and os.path.isfile(os.path.join(directory, n))}
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for key, md in sdm.items():
        if not isinstance(key, str):
            raise FormatError(f"state_dict_metadata key {key!r} is not a string")
        if isinstance(md, Record) and md.kind == "BytesStorageMetadata":
            info = storage.get((key, None))
            if info is None:
                raise FormatError(f"{key}: no storage record for this value")
            entries[key] = BytesEntry(key, *_where(info, key, sizes))
            continue
        md = _record(md, "TensorStorageMetadata", key)
        props = md.get("properties")
        if not isinstance(props, Record) or props.kind != "TensorProperties":
            raise FormatError(f"{key}: tensor properties missing")
        torch_dtype = props.get("dtype")
        if not isinstance(torch_dtype, TorchDtype):
            raise FormatError(f"{key}: dtype {torch_dtype!r} is not a torch dtype")
        try:
            dtype = torch_pickle.statekit_dtype(torch_dtype.name)
        except FormatError as exc:
            raise FormatError(f"{key}: {exc.message}") from None
        shape = _ints(md.get("size"), "size", key)
        chunks = []
        for c in md.get("chunks") or []:
            c = _record(c, "ChunkStorageMetadata", f"{key} chunk")
            offsets, csizes = _ints(c.get("offsets"), "chunk offsets", key), _ints(c.get("sizes"), "chunk sizes", key)
            if len(offsets) != len(shape) or len(csizes) != len(shape) or any(
                    o + s > n for o, s, n in zip(offsets, csizes, shape, strict=True)):
                raise FormatError(f"{key}: chunk at {list(offsets)} of size {list(csizes)} lies outside the "
                                  f"tensor's shape {list(shape)}")
            info = storage.get((key, offsets))
            if info is None:
                raise FormatError(f"{key}: no storage record for the chunk at {list(offsets)}")
            chunks.append(Chunk(offsets, csizes, *_where(info, key, sizes)))
        _check_tiling(key, shape, chunks)
        entries[key] = TensorEntry(key, dtype, shape, chunks)
    paths = _paths(meta.get("planner_data"), entries)
    version = meta.get("version")
    attributes = {k: v for k, v in meta.fields.items() if k not in _METADATA_FIELDS}
    return DcpMetadata(entries, paths, version if isinstance(version, str) else None, sorted(sizes), attributes)


_METADATA_FIELDS = frozenset({"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"})


def _check_tiling(key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks cover the tensor exactly once (no gap, no overlap): else values would be wrong."""
    numel = math.prod(shape)
    if sum(c.numel for c in chunks) != numel:
        raise FormatError(f"{key}: its {len(chunks)} chunks hold {sum(c.numel for c in chunks)} elements, "
                          f"the tensor {numel}: the checkpoint is incomplete")
    if len(chunks) > 1 and numel:
        boxes = [c for c in chunks if c.numel]
        if _apart_as_slabs(boxes):
            return
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
                       zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                    raise FormatError(f"{key}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap")


def _apart_as_slabs(boxes: list[Chunk]) -> bool:
    """Whether ``boxes`` are slabs along one dimension (the same offsets and sizes in all the
    others) that lie apart along it: then no two overlap (sorted, in O(n log n); a tensor split
    along one dimension, as every writer splits them). False: the pairwise check decides."""
    if len(boxes) < 2:
        return True
    first = boxes[0]
    for j in range(len(first.offsets)):
        rest = (first.offsets[:j], first.offsets[j + 1:], first.sizes[:j], first.sizes[j + 1:])
        if all((b.offsets[:j], b.offsets[j + 1:], b.sizes[:j], b.sizes[j + 1:]) == rest for b in boxes):
            spans = sorted((b.offsets[j], b.offsets[j] + b.sizes[j]) for b in boxes)
            return all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    return False


def _paths(planner: object, entries: dict) -> dict[str, tuple]:
    if planner is None:
        return {k: (k,) for k in entries}
    if not isinstance(planner, dict):
        raise FormatError(f"planner_data is a {type(planner).__name__}, not a dict")
    out = {}
    for key in entries:
        path = planner.get(key)
        if path is None:
            out[key] = (key,)
            continue
        if not isinstance(path, tuple | list) or not path or not all(
                isinstance(p, str) or type(p) is int for p in path) or not isinstance(path[0], str):
            raise FormatError(f"planner_data[{key!r}] = {path!r} is not a path of names and indices")
        out[key] = tuple(path)
    return out


# --------------------------------------------------------------------------------------------
# reading values


class DcpReader:
    """Lazy access to a DCP checkpoint's values; data files are memory-mapped on first use."""

    def __init__(self, directory: str | os.PathLike, extra_globals: dict | None = None,
                 metadata_kinds: tuple[str, ...] = ("Metadata",)):
        """``extra_globals``: globals allowed in the non-tensor values' pickles (and in
        ``.metadata``) besides torch's own, for one writer's checkpoints (Megatron's classes)."""
        self.directory = os.fspath(directory)
        self.extra_globals = extra_globals
        self.meta = read_metadata(self.directory, extra_globals, metadata_kinds)
        self._maps: dict[str, mmap.mmap] = {}
        self._sources: dict[str, SourceFile] = {}
        self._chunks: dict[tuple[str, Chunk], TensorRef] = {}
        self._lock = threading.Lock()  # (readers on several threads: one parses an archive at a time)

    def close(self) -> None:
        self._maps.clear()  # views handed out keep their maps alive until dropped
        self._sources.clear()  # a file closes with the last tensor span that reads it
        self._chunks.clear()

    def _map(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            path = os.path.join(self.directory, name)
            with open(path, "rb") as fh:
                self._maps[name] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[name]

    def _source(self, name: str) -> SourceFile:
        if name not in self._sources:
            self._sources[name] = SourceFile.open(os.path.join(self.directory, name))
        return self._sources[name]

    def _archive(self, key: str, file: str, offset: int, length: int) -> object:
        """The torch.save archive at ``file[offset:offset + length]``: its zip directory and pickle
        are parsed from the map, tensor bytes read later with pread."""
        try:
            return torch_pt.load_pt_region(self._map(file), offset, length, self._source(file), self.extra_globals)
        except FormatError as exc:
            raise FormatError(f"{key}: {exc.message}", os.path.join(self.directory, file)) from None

    def chunk(self, entry: TensorEntry, c: Chunk) -> TensorRef:
        """One chunk as a lazy tensor, checked against the metadata; its archive is parsed once
        (a stacked tensor's chunk is asked for by every layer cut out of it). Not to be changed
        by the caller: the same object is handed out again."""
        cached = self._chunks.get((entry.key, c))
        if cached is not None:
            return cached
        with self._lock:
            cached = self._chunks.get((entry.key, c))
            if cached is not None:
                return cached
            return self._parse_chunk(entry, c)

    def _parse_chunk(self, entry: TensorEntry, c: Chunk) -> TensorRef:
        ref = self._archive(entry.key, c.file, c.offset, c.length)
        where = os.path.join(self.directory, c.file)
        if not isinstance(ref, TensorRef):
            raise FormatError(f"{entry.key}: the chunk at {list(c.offsets)} holds a {type(ref).__name__}, "
                              "not a tensor", where)
        if tuple(ref.shape) != c.sizes or ref.dtype != entry.dtype:
            raise FormatError(f"{entry.key}: the chunk at {list(c.offsets)} is {ref.dtype} {list(ref.shape)}, "
                              f"the metadata says {entry.dtype} {list(c.sizes)}", where)
        self._chunks[entry.key, c] = ref
        return ref

    def value(self, key: str) -> object:
        entry = self.meta.entries[key]
        if isinstance(entry, BytesEntry):
            return self._archive(key, entry.file, entry.offset, entry.length)
        return self.tensor(entry)

    def tensor(self, entry: TensorEntry) -> TensorRef:
        chunks = [c for c in entry.chunks if c.numel] or entry.chunks[:1]
        info = {"dcp_key": entry.key, "chunks": len(entry.chunks)}
        if not math.prod(entry.shape):
            return TensorRef(entry.dtype, entry.shape, loader=lambda: b"", info=info)
        if len(chunks) == 1:
            c = chunks[0]
            return TensorRef(entry.dtype, entry.shape, loader=lambda: self.chunk(entry, c).raw(),
                             chunk_reader=lambda size: self.chunk(entry, c).iter_bytes(size), info=info)
        starts = [_flat_start(c, entry.shape) for c in chunks]
        if None not in starts:  # each chunk one run of the C-order bytes (row blocks; a layer's halves)
            ordered = [c for _, c in sorted(zip(starts, chunks, strict=True), key=lambda sc: sc[0])]

            def pieces(size: int) -> Iterator[bytes | memoryview]:
                for c in ordered:
                    yield from self.chunk(entry, c).iter_bytes(size)

            return TensorRef(entry.dtype, entry.shape, loader=lambda: b"".join(bytes(p) for p in pieces(16 << 20)),
                             chunk_reader=pieces, info=info)

        def assemble() -> np.ndarray:
            out = np.empty(entry.shape, dtype=dtypes.numpy_dtype(entry.dtype))
            for c in chunks:
                region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
                out[region] = self.chunk(entry, c).numpy()
            return out

        return TensorRef(entry.dtype, entry.shape, array_loader=assemble, info=info)

    def state_dict(self) -> dict:
        """The nested state_dict that was saved (as ``dcp_to_torch_save`` rebuilds it): tensors lazy,
        other values read now."""
        root: dict = {}
        for key in self.meta.entries:
            _set_element(root, self.meta.paths[key], self.value(key), key)
        return root


def _flat_start(c: Chunk, shape: tuple[int, ...]) -> int | None:
    """The C-order element index where chunk ``c`` starts, if its elements are one contiguous run of
    the tensor's (size 1 on the axes before one, whole axes after it), else None. Chunks that tile
    the tensor (checked on reading the metadata) and are each one run follow each other in this order."""
    axis = next((a for a, n in enumerate(c.sizes) if n != 1), len(shape))
    if any(c.offsets[a] or c.sizes[a] != shape[a] for a in range(axis + 1, len(shape))):
        return None
    return int(np.ravel_multi_index(c.offsets, shape)) if shape else 0


def _set_element(root: dict, path: tuple, value: object, key: str) -> None:
    """torch's ``_traverse.set_element``: create dicts for str keys and lists for int keys."""
    container: dict | list = root
    for prev, nxt in zip(path, path[1:], strict=False):
        default = {} if isinstance(nxt, str) else []
        container = _child(container, prev, default, key)
    last = path[-1]
    if isinstance(container, list):
        if type(last) is not int:
            raise FormatError(f"{key}: path {path!r} indexes a list with a name")
        container.extend([None] * (last + 1 - len(container)))
    elif type(last) is not str:
        raise FormatError(f"{key}: path {path!r} indexes a dict with a number")
    container[last] = value


def _child(container: dict | list, k: object, default: dict | list, key: str) -> dict | list:
    if isinstance(container, dict):
        if type(k) is not str:
            raise FormatError(f"{key}: path indexes a dict with {k!r}")
        found = container.setdefault(k, default)
    else:
        if type(k) is not int:
            raise FormatError(f"{key}: path indexes a list with {k!r}")
        container.extend([None] * (k + 1 - len(container)))
        if container[k] is None:
            container[k] = default
        found = container[k]
    if not isinstance(found, dict | list):
        raise FormatError(f"{key}: the path runs through a value that is not a container")
    return found


# --------------------------------------------------------------------------------------------
# writing


@dataclass(frozen=True)
class RawBytes:
    """A non-tensor value already serialized (a whole ``torch.save`` archive): written as it is.
    Megatron's ShardedObjects copied from another checkpoint, or pickled by its own writer."""

    data: bytes


@dataclass
class Item:
    """One flat key to write: its nested path and its value (a tensor, a :class:`RawBytes`, or a
    Python object)."""

    key: str
    path: tuple
    value: object

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, TensorRef)

    @property
    def nbytes(self) -> int:
        return self.value.nbytes if isinstance(self.value, TensorRef) else 0


def flatten(state_dict: dict) -> list[Item]:
    """Flat keys as torch's ``flatten_state_dict`` makes them (``_traverse.traverse_state_dict``):
    dicts are walked, lists only when they hold tensors or containers, other values are leaves."""
    items: list[Item] = []
    seen: set[str] = set()

    def terminal(value: object) -> bool:
        if isinstance(value, dict):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, TensorRef) or (isinstance(v, dict | list) and not terminal(v)) for v in value)

    def walk(path: tuple, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif terminal(value):
            key = ".".join(map(str, path))
            limits.utf8_all((key, value))  # refused here, before any part of the directory is written
            if key in seen:
                raise MappingError(f"two entries flatten to the same DCP key {key!r}")
            seen.add(key)
            items.append(Item(key, path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    for k, v in state_dict.items():
        walk((str(k),), v)
    return items


def split_by_bytes(items: list[Item], bins: int) -> list[list[Item]]:
    """Items in ``bins`` groups of nearly equal tensor bytes (largest first into the lightest
    bin, as torch's ``_split_by_size_and_type``); non-tensor values spread round-robin. Stable:
    the same items give the same groups."""
    bins = max(1, bins)
    groups: list[list[Item]] = [[] for _ in range(bins)]
    loads = [0] * bins
    values = [it for it in items if not it.is_tensor]
    for i, it in enumerate(values):
        groups[i % bins].append(it)
    for it in sorted((it for it in items if it.is_tensor), key=lambda it: -it.nbytes):
        j = min(range(bins), key=lambda b: (loads[b], b))
        groups[j].append(it)
        loads[j] += it.nbytes
    order = {it.key: n for n, it in enumerate(items)}
    return [sorted(g, key=lambda it: order[it.key]) for g in groups]


def data_file_name(index: int) -> str:
    return f"__{index}_0{SUFFIX}"


# --------------------------------------------------------------------------------------------
# shares: several processes (machines) each write some of the data files; the last finalizes


@dataclass
class Share:
    """Which share of the work this process does (``index`` of ``count``), and what it did."""

    index: int = 0
    count: int = 1
    source: str = "single process"  # where index/count came from (flag, torchrun, SLURM)
    written: list[int] = field(default_factory=list)  # part numbers written by this process
    skipped: list[int] = field(default_factory=list)  # already complete from an earlier run
    parts: int = 0
    finalized: bool = False
    waiting: list[int] = field(default_factory=list)  # parts still missing when this one ended


_SHARE: contextvars.ContextVar[Share | None] = contextvars.ContextVar("statekit_dcp_share", default=None)


@contextlib.contextmanager
def sharing(share: Share) -> Iterator[Share]:
    """DCP writes inside the block do only ``share``'s parts (and finalize when they end the work)."""
    token = _SHARE.set(share)
    try:
        yield share
    finally:
        _SHARE.reset(token)


def assign(groups: list[list[Item]], count: int) -> list[list[int]]:
    """Part numbers per process, balanced by bytes (largest part first to the lightest process);
    with as many parts as processes, part ``i`` goes to process ``i``."""
    if len(groups) == count:
        return [[i] for i in range(count)]
    loads = [0] * count
    out: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(groups)), key=lambda i: (-sum(it.nbytes for it in groups[i]), i)):
        j = min(range(count), key=lambda b: (loads[b], b))
        out[j].append(i)
        loads[j] += sum(it.nbytes for it in groups[i])
    return [sorted(x) for x in out]


def plan_id(items: list[Item], parts: int) -> str:
    """A digest of what the whole checkpoint holds and how it is split: parts of one plan only."""
    digest = hashlib.sha256(f"{parts}".encode())
    for it in items:
        shape = list(it.value.shape) if isinstance(it.value, TensorRef) else None
        dtype = it.value.dtype if isinstance(it.value, TensorRef) else None
        digest.update(json.dumps([it.key, list(it.path), dtype, shape]).encode())
    return digest.hexdigest()[:32]


def write_part(directory: str | os.PathLike, index: int, items: list[Item], progress=None, *,
               order: dict[str, int] | None = None, plan: str = "", parts: int = 1) -> dict:
    """Write data file ``index`` (its items' archives back to back) atomically, then its part
    manifest; returns the manifest. Tensor bytes stream through in bounded pieces."""
    directory = os.fspath(directory)
    name = data_file_name(index)
    _remove_stale_temporaries(directory, name)
    records = []
    with atomic_write(os.path.join(directory, name)) as fh:
        pos = 0
        for it in items:
            value = it.value
            if isinstance(value, RawBytes):
                fh.write(value.data)
                length = len(value.data)
            else:
                length = torch_pt.write_pt_stream(fh, value)
            rec = {"key": it.key, "path": list(it.path), "offset": pos, "length": length,
                   "order": (order or {}).get(it.key, len(records))}
            if isinstance(value, TensorRef):
                rec.update(dtype=value.dtype, shape=list(value.shape))
            records.append(rec)
            pos += length
            if progress is not None:
                progress(it.nbytes)
        size = pos
    manifest = {"file": name, "size": size, "part": index, "parts": parts, "plan": plan, "items": records}
    with atomic_write(os.path.join(directory, name + PART_SUFFIX)) as fh:
        fh.write(json.dumps(manifest).encode())
    return manifest


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Temporary files a killed earlier run left for this part (atomic_write's ``.<name>.*.tmp``)."""
    for entry in os.listdir(directory):
        if entry.startswith(f".{name}.") and entry.endswith(".tmp"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))


def _manifest(directory: str, index: int) -> dict | None:
    return _read_manifest(os.path.join(directory, data_file_name(index) + PART_SUFFIX))


def _part_ok(directory: str, manifest: dict | None, plan: str | None = None) -> bool:
    """A manifest whose data file is present with the size it records (and of plan ``plan``)."""
    if manifest is None or (plan is not None and manifest.get("plan") != plan):
        return False
    data = os.path.join(directory, str(manifest.get("file")))
    return posixpath.basename(str(manifest.get("file"))) == manifest.get("file") and os.path.isfile(data) \
        and os.path.getsize(data) == manifest.get("size")


def part_complete(directory: str | os.PathLike, index: int, items: list[Item], plan: str) -> bool:
    """Whether part ``index`` was already written completely for exactly these items."""
    directory = os.fspath(directory)
    manifest = _manifest(directory, index)
    return _part_ok(directory, manifest, plan) and [r.get("key") for r in manifest.get("items", [])] == [
        it.key for it in items]


def _read_manifest(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def missing_parts(directory: str | os.PathLike, parts: int, plan: str) -> list[int]:
    directory = os.fspath(directory)
    return [i for i in range(parts) if not _part_ok(directory, _manifest(directory, i), plan)]


def finalize(directory: str | os.PathLike, parts: int | None = None, plan: str | None = None) -> int:
    """Write ``.metadata`` from the part manifests once every part is present and matches its data
    file and the same plan; returns its size. FormatError naming the missing or damaged part
    otherwise. ``parts``/``plan`` default to what the manifests record (``statekit finalize``)."""
    directory = os.fspath(directory)
    if parts is None or plan is None:
        found = sorted(n for n in os.listdir(directory) if n.endswith(PART_SUFFIX))
        first = _read_manifest(os.path.join(directory, found[0])) if found else None
        if first is None:
            raise FormatError("no part manifests (*.part.json) here: nothing to finalize", directory)
        parts, plan = int(first.get("parts", 0)), str(first.get("plan"))
    records: list[tuple[str, dict]] = []
    for index in range(parts):
        manifest = _manifest(directory, index)
        mpath = os.path.join(directory, data_file_name(index) + PART_SUFFIX)
        if manifest is None:
            raise FormatError(f"part {index} of {parts} is missing; run its share again", mpath)
        if manifest.get("plan") != plan:
            raise FormatError(f"part {index} was written for another plan (another input or --shards); "
                              "run its share again", mpath)
        if not _part_ok(directory, manifest):
            raise FormatError(f"part {index}: the data file does not match its manifest; run its share again",
                              os.path.join(directory, data_file_name(index)))
        records.extend((manifest["file"], rec) for rec in manifest.get("items", []))
    keys = [rec["key"] for _, rec in records]
    if len(set(keys)) != len(keys):
        raise FormatError("the parts hold some keys twice", directory)
    records.sort(key=lambda fr: fr[1].get("order", 0))
    payload = _metadata_pickle(records)
    with atomic_write(os.path.join(directory, METADATA)) as fh:
        fh.write(payload)
    return len(payload)


def save(directory: str | os.PathLike, state_dict: dict, shards: int | None = None, progress=None) -> int:
    """Write ``state_dict`` (nested dicts/lists, TensorRefs, Python values) as a DCP checkpoint
    with ``shards`` data files (default: one, or one per process when sharing); returns the bytes
    this process wrote.

    Inside :func:`sharing`, only this process's parts are written (parts already complete from an
    earlier run are skipped), and whichever process finds every part present writes
    ``.metadata``. Alone, the part manifests are removed once ``.metadata`` is written.
    """
    directory = os.fspath(directory)
    items = flatten(state_dict)  # (refuses what it cannot write before the directory exists)
    os.makedirs(directory, exist_ok=True)
    share = _SHARE.get()
    alone = share is None
    share = share or Share()
    groups = split_by_bytes(items, shards or share.count)
    plan = plan_id(items, len(groups))
    order = {it.key: n for n, it in enumerate(items)}
    share.parts = len(groups)
    total = 0
    for index in assign(groups, share.count)[share.index]:
        if not alone and part_complete(directory, index, groups[index], plan):
            share.skipped.append(index)
            continue
        total += write_part(directory, index, groups[index], progress, order=order, plan=plan,
                            parts=len(groups))["size"]
        share.written.append(index)
    share.waiting = missing_parts(directory, len(groups), plan)
    if not share.waiting:
        total += finalize(directory, len(groups), plan)
        share.finalized = True
        if alone:
            remove_manifests(directory, len(groups))
    return total


def remove_manifests(directory: str, parts: int) -> None:
    for index in range(parts):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, data_file_name(index) + PART_SUFFIX))


# ----------------------------------------------------------------------- the .metadata pickle


class _Size(tuple):
    """A tuple written as ``torch.Size(...)``."""


class _StorageDict(list):
    """(key, value) pairs written as a dict whose keys are objects (MetadataIndex records)."""


@dataclass
class _Obj:
    """An instance of a DCP class: written as NEWOBJ(cls, ()) + BUILD(state)."""

    module: str
    name: str
    state: object


@dataclass
class _Call:
    module: str
    name: str
    args: tuple


class _MetaPickler(torch_pickle._Pickler):
    """Protocol 2 with only DCP's globals (what ``pickle.load`` in torch rebuilds as its classes)."""

    def save(self, obj: object, where: str) -> None:
        if isinstance(obj, _Size):
            self.call("torch", "Size", (tuple(obj),), where)
        elif isinstance(obj, _Obj):
            self.global_(obj.module, obj.name)
            self.emit(pickle.EMPTY_TUPLE, pickle.NEWOBJ)
            self.save(obj.state, where)
            self.emit(pickle.BUILD)
        elif isinstance(obj, _Call):
            self.call(obj.module, obj.name, obj.args, where)
        elif isinstance(obj, _StorageDict):
            self.emit(pickle.EMPTY_DICT)
            if obj:
                self.emit(pickle.MARK)
                for key, value in obj:
                    self.save(key, where)
                    self.save(value, where)
                self.emit(pickle.SETITEMS)
        else:
            super().save(obj, where)

    def global_(self, module: str, name: str) -> None:  # more than 256 memo slots are never needed here
        full = f"{module}.{name}"
        if full in self.globals:
            self.emit(pickle.LONG_BINGET, struct.pack("<I", self.globals[full]))
            return
        index = len(self.globals)
        self.globals[full] = index
        self.emit(pickle.GLOBAL, f"{module}\n{name}\n".encode(), pickle.LONG_BINPUT, struct.pack("<I", index))


def _metadata_pickle(records: list[tuple[str, dict]]) -> bytes:
    sdm: dict[str, _Obj] = {}
    storage: list = []
    planner: dict[str, tuple] = {}
    for file, rec in records:
        key = rec["key"]
        planner[key] = tuple(rec["path"])
        info = _Obj(_FS, "_StorageInfo", {"relative_path": file, "offset": rec["offset"], "length": rec["length"]})
        if "dtype" in rec:
            shape = _Size(rec["shape"])
            props = _Obj(_MD, "TensorProperties", (
                TorchDtype(torch_pickle.STATEKIT_TO_TORCH[rec["dtype"]]),
                _Call("torch.serialization", "_get_layout", ("torch.strided",)), False,
                _Call(_MD, "_MEM_FORMAT_ENCODING", (0,)), False))
            chunk = _Obj(_MD, "ChunkStorageMetadata", {"offsets": _Size([0] * len(shape)), "sizes": shape})
            sdm[key] = _Obj(_MD, "TensorStorageMetadata", {"properties": props, "size": shape, "chunks": [chunk]})
            index = _Obj(_MD, "MetadataIndex", {"fqn": key, "offset": _Size([0] * len(shape)), "index": 0})
        else:
            sdm[key] = _Obj(_MD, "BytesStorageMetadata", {})
            index = _Obj(_MD, "MetadataIndex", {"fqn": key, "offset": None, "index": None})
        storage.append((index, info))
    meta = _Obj(_MD, "Metadata", {
        "state_dict_metadata": sdm,
        "planner_data": planner,
        "storage_data": _StorageDict(storage),
        "storage_meta": _Obj(_MD, "StorageMeta", {"checkpoint_id": None, "save_id": None, "load_id": None,
                                                  "modules": []}),
        "version": VERSION,
    })
    pickler = _MetaPickler()
    pickler.save(meta, "metadata")
    pickler.emit(pickle.STOP)
    return b"".join(pickler.out)
