"""Readers for burn ≤ 0.21 *legacy* records: ``.mpk``, ``.mpk.gz``, ``.bin``, ``.bin.gz``.

Layout (``docs/burn-formats.md`` §4): every file is a ``BurnRecord {metadata, item, _b}`` written by
rmp-serde (named msgpack: structs are maps keyed by field name) or by bincode 2 (``standard()``
config: fields in order, no names, varint integers); either may be gzip'd. The file kind is sniffed
from the content, never from the extension.

``item`` is interpreted as one of

- **optimizer** (``OptimizerAdaptor`` record): ``{<base32 ParamId>: {"V1": {"Rank<D>": <state>}}}``;
  each entry becomes a :class:`LegacyParamState` with dotted leaf names (``momentum.moment_1``), the
  same names burnpack uses (§2.2). Bincode has no field names, so the state is decoded by trying the
  known optimizer layouts (:data:`OPTIMIZER_LAYOUTS`) until one consumes the bytes exactly;
- **model** (module record): nested maps whose parameters are ``{"id", "param"}`` maps, collected
  with their key chain as :class:`LegacyModelParam` (named msgpack only: bincode model records carry
  no field names, so module paths cannot be recovered and they are refused);
- **scheduler** (LR scheduler record): a bare integer/float/nil, or ``{"schedulers": [...]}``.

Tensors (``TensorData {bytes, shape, dtype}``) become :class:`~statekit.tensor.TensorRef` objects
over the stored bytes: zero-copy slices of a memory map for bincode, the ``bytes`` objects msgpack
produced for named msgpack. Every malformed input raises :class:`~statekit.errors.FormatError`.
"""

from __future__ import annotations

import gzip
import io
import math
import mmap
import os
import re
import tempfile
import uuid
import zlib
from dataclasses import dataclass, field

import msgpack
import numpy as np

from statekit import dtypes, paramid
from statekit.errors import FormatError
from statekit.formats import limits
from statekit.formats.bincode import BincodeError, BincodeReader
from statekit.tensor import TensorRef

__all__ = [
    "LegacyModel",
    "LegacyModelParam",
    "LegacyOptimizer",
    "LegacyParamState",
    "LegacyRecord",
    "LegacyScheduler",
    "OPTIMIZER_LAYOUTS",
    "is_legacy_record",
    "param_id_from_str",
    "param_id_to_str",
    "read_legacy",
    "read_legacy_bytes",
    "sniff",
]

GZIP_MAGIC = b"\x1f\x8b"
MSGPACK_MAGIC = b"\x83\xa8metadata"
METADATA_FIELDS = ("float", "int", "format", "version", "settings")
# `type_name::<S::FloatElem>()` of burn's precision settings (half's types live in submodules).
FLOAT_TYPE_NAMES = frozenset({"f32", "f64", "f16", "bf16", "half::binary16::f16", "half::bfloat::bf16"})
_MAX_DEPTH = 64
_CHUNK = 1 << 20

# ---------------------------------------------------------------------------------------------
# Public data objects
# ---------------------------------------------------------------------------------------------

Scalar = int | float | bool


@dataclass
class LegacyParamState:
    """One parameter's optimizer state.

    ``fields`` maps dotted leaf names (``"momentum.time"``, ``"momentum.moment_1"``) to a
    :class:`TensorRef` (dtype as stored: F32, F16 or F64) or a Python scalar; ``None`` optionals are
    absent. ``id`` is the u64 ParamId, ``None`` only for UUID-era ids (burn hashed those with ahash).
    """

    display_id: str
    id: int | None
    rank: int
    fields: dict[str, TensorRef | Scalar]


@dataclass
class LegacyOptimizer:
    """An ``OptimizerAdaptor`` record: entries in file order plus the optimizer types that fit.

    ``families`` lists every optimizer whose state layout matches all entries, e.g.
    ``("adam", "adamw")`` (their states are identical); ``()`` when no known layout fits.
    ``alternatives`` holds other complete readings of the same bytes with a *different* layout —
    only bincode can have them (SGD-with-momentum ``01 <tensor>`` is byte-identical to AdaGrad with
    ``time = 1``); ``entries`` is the reading of the first layout in :data:`OPTIMIZER_LAYOUTS`.
    """

    entries: list[LegacyParamState]
    families: tuple[str, ...]
    alternatives: list[LegacyOptimizer] = field(default_factory=list)

    def by_id(self) -> dict[int, LegacyParamState]:
        return {e.id: e for e in self.entries if e.id is not None}


@dataclass
class LegacyModelParam:
    """A module parameter: its path (``"l1.weight"``, ``"layers.0.bias"``), id and tensor."""

    path: str
    display_id: str
    id: int | None
    tensor: TensorRef


@dataclass
class LegacyModel:
    params: list[LegacyModelParam]

    def paths_by_id(self) -> dict[int, str]:
        return {p.id: p.path for p in self.params if p.id is not None}


@dataclass
class LegacyScheduler:
    """An LR scheduler record.

    ``candidates`` maps each scheduler type the bytes fit to the state value under that reading
    (``{"linear": 7, "cosine": 7, "noam": 7, "step": 7}``; bincode's zig-zag ``i32`` can differ);
    ``"constant"`` → ``None``, ``"exponential"`` → float, ``"composed"`` → ``None`` with
    ``children`` holding one single-candidate scheduler per composed entry.
    """

    candidates: dict[str, Scalar | None]
    children: list[LegacyScheduler] = field(default_factory=list)


@dataclass
class LegacyRecord:
    """A decoded legacy file.

    ``metadata``: the five ``BurnMetadata`` strings (float, int, format, version, settings).
    ``kind``: ``"optimizer" | "model" | "scheduler" | "unknown"``; ``item`` is the matching
    :class:`LegacyOptimizer` / :class:`LegacyModel` / :class:`LegacyScheduler`, or for ``"unknown"``
    the decoded msgpack tree (``None`` for bincode). ``encoding``: ``"msgpack" | "bincode"``.
    ``notes``: one-line remarks about ambiguities or things that were skipped.
    """

    metadata: dict[str, str]
    kind: str
    item: object
    encoding: str
    compressed: bool = False
    path: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def precision(self) -> str | None:
        """``"full" | "half" | "double"`` from the settings string, ``None`` if unrecognised."""
        return {
            "FullPrecisionSettings": "full",
            "HalfPrecisionSettings": "half",
            "DoublePrecisionSettings": "double",
        }.get(self.metadata.get("settings", ""))


# ---------------------------------------------------------------------------------------------
# Optimizer state layouts (field order matters for bincode)
# ---------------------------------------------------------------------------------------------

TENSOR = "tensor"
USIZE = "usize"


@dataclass(frozen=True)
class Opt:
    """``Option<inner>``: msgpack ``nil``/value (or an absent key), bincode tag byte + value."""

    inner: object


# A schema is a tuple of (field name, TENSOR | USIZE | Opt | schema) in declaration order.
_ADAPTIVE_MOMENTUM = (
    ("time", USIZE),
    ("moment_1", TENSOR),
    ("moment_2", TENSOR),
    ("max_moment_2", Opt(TENSOR)),  # burn 0.21+ (AMSGrad)
)
_MOMENTUM = (("velocity", TENSOR),)


@dataclass(frozen=True)
class Layout:
    families: tuple[str, ...]
    schema: tuple
    note: str = ""


OPTIMIZER_LAYOUTS: tuple[Layout, ...] = (
    Layout(("adam", "adamw"), (("momentum", _ADAPTIVE_MOMENTUM),), "burn 0.21"),
    Layout(("adam", "adamw"), (("momentum", _ADAPTIVE_MOMENTUM[:3]),), "burn <= 0.20 (no max_moment_2)"),
    Layout(("sgd",), (("momentum", Opt(_MOMENTUM)),)),
    Layout(("muon",), (("momentum", _MOMENTUM),), "burn 0.20+"),
    Layout(("adagrad",), (("lr_decay", (("time", USIZE), ("sum", TENSOR))),)),
    Layout(
        ("adan",),
        (
            (
                "momentum",
                (
                    ("time", USIZE),
                    ("exp_avg", TENSOR),
                    ("exp_avg_sq", TENSOR),
                    ("exp_avg_diff", TENSOR),
                    ("neg_pre_grad", TENSOR),
                ),
            ),
        ),
        "burn 0.21",
    ),
    Layout(
        ("rmsprop",),
        (
            ("square_avg", (("square_avg", TENSOR),)),
            ("centered", (("grad_avg", Opt(TENSOR)), ("avg", TENSOR))),
            ("momentum", Opt((("buf", TENSOR),))),
        ),
    ),
)

# ---------------------------------------------------------------------------------------------
# ParamId strings (§3)
# ---------------------------------------------------------------------------------------------

def param_id_to_str(value: int) -> str:
    """burn's ``ParamId`` display form: BASE32_DNSSEC (base32hex, lower case, no padding) of the
    8 little-endian bytes — 13 characters (:func:`statekit.paramid.to_display`)."""
    return paramid.to_display(value)


def _is_base32_id(text: str) -> bool:
    try:
        paramid.from_base32(text)
    except ValueError:
        return False
    return True


def param_id_from_str(text: str) -> int | None:
    """The u64 of a legacy ParamId string, as ``ParamId::try_deserialize`` computes it.

    Base32 (13 characters; older 10-character 6-byte ids are zero-extended) → the little-endian
    u64 (:func:`statekit.paramid.from_base32`). A UUID string → ``None`` (burn hashed it with
    ahash, which statekit cannot reproduce). Anything else raises ``ValueError``.
    """
    try:
        return paramid.from_base32(text)
    except ValueError:
        pass
    try:
        uuid.UUID(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a ParamId (base32hex or UUID)") from None
    return None


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def sniff(head: bytes) -> str | None:
    """``"gzip" | "msgpack" | "bincode"`` from the first bytes of a file, else ``None``."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[: len(MSGPACK_MAGIC)] == MSGPACK_MAGIC:
        return "msgpack"
    if head and head[0] < 251:
        name = head[1 : 1 + head[0]]
        if len(name) == head[0] and name.decode("ascii", "replace") in FLOAT_TYPE_NAMES:
            return "bincode"
    return None


def claims(head: bytes, path: str) -> bool:
    """Sniffer: a msgpack or bincode record, or gzip (unless the name says safetensors)."""
    kind = sniff(head)
    if kind == "gzip":
        return not path.endswith(".safetensors")
    return kind is not None


def is_legacy_record(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a legacy burn record (gzip'd ones are peeked into)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if sniff(head) == "gzip":
                fh.seek(0)
                with gzip.GzipFile(fileobj=fh) as gz:
                    head = gz.read(64)
    except (OSError, EOFError, zlib.error):
        return False
    return sniff(head) in ("msgpack", "bincode")


def read_legacy(path: str | os.PathLike) -> LegacyRecord:
    """Read a legacy record file (plain files are memory-mapped; gzip is inflated to a temp file)."""
    path = os.fspath(path)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise FormatError(f"cannot open: {exc.strerror}", path) from None
    with fh:
        head = fh.read(2)
        fh.seek(0)
        if head == GZIP_MAGIC:
            return _read_buffer(_gunzip_to_map(fh, path), path, compressed=True)
        if os.fstat(fh.fileno()).st_size == 0:
            raise FormatError("empty file, not a burn legacy record", path)
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # not mappable (a pipe, a special file): read it instead
            buf = fh.read()
    return _read_buffer(buf, path, compressed=False)


def read_legacy_bytes(data: bytes | bytearray | memoryview, path: str | None = None) -> LegacyRecord:
    """Like :func:`read_legacy` for bytes already in memory (``path`` only names errors)."""
    data = memoryview(data).cast("B")
    if bytes(data[:2]) == GZIP_MAGIC:
        out = io.BytesIO()
        _inflate(io.BytesIO(data), out, len(data), path)
        return _read_buffer(out.getbuffer(), path, compressed=True)
    return _read_buffer(data, path, compressed=False)


def _gunzip_to_map(fh, path: str) -> mmap.mmap:
    """Inflate a gzip file chunk by chunk into an anonymous temp file and map it (bounded memory)."""
    with tempfile.TemporaryFile() as tmp:
        _inflate(fh, tmp, os.fstat(fh.fileno()).st_size, path)
        if tmp.tell() == 0:
            raise FormatError("gzip stream is empty, not a burn legacy record", path)
        tmp.flush()
        return mmap.mmap(tmp.fileno(), 0, access=mmap.ACCESS_READ)


def _inflate(src, dst, compressed_size: int, path: str | None) -> None:
    """gunzip ``src`` into ``dst`` piece by piece, refusing at the inflate cap (a gzip bomb)."""
    cap = limits.inflate_cap(compressed_size)
    total = 0
    try:
        with gzip.GzipFile(fileobj=src) as gz:
            while chunk := gz.read(_CHUNK * 4):
                total += len(chunk)
                if total > cap:
                    raise FormatError(
                        f"gzip stream inflates past {cap >> 20} MiB, over {cap // max(compressed_size, 1)}x its "
                        f"{compressed_size} bytes: refused as a decompression bomb (gunzip it yourself and open "
                        "the result, or set STATEKIT_GZIP_RATIO)", path)
                dst.write(chunk)
    except (OSError, EOFError, zlib.error) as exc:
        raise FormatError(f"corrupt gzip stream: {_why(exc)}", path) from None


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _read_buffer(buf, path: str | None, compressed: bool) -> LegacyRecord:
    head = bytes(memoryview(buf)[:64])
    kind = sniff(head)
    if kind == "msgpack":
        rec = _read_msgpack(buf, path)
    elif kind == "bincode":
        rec = _read_bincode(buf, path)
    else:
        raise FormatError(_not_legacy_message(head, compressed), path)
    rec.compressed = compressed
    rec.path = path
    return rec


def _not_legacy_message(head: bytes, compressed: bool) -> str:
    inside = "gzip stream holds " if compressed else ""
    if head[:4] == b"NRUB":
        return f"{inside}a burnpack file, not a legacy record (read it as burnpack)"
    if head.lstrip()[:1] == b"{":
        return f"{inside}JSON; burn's JSON recorders are not supported (re-save as .mpk)"
    if head[:2] == GZIP_MAGIC:
        return "gzip inside gzip; not a burn legacy record"
    return (
        f"{inside}not a burn legacy record: expected named msgpack (83 A8 'metadata'), bincode "
        f"metadata ('f32'/'f16'/'f64' first) or gzip; found {head[:8].hex(' ')}"
    )


# ---------------------------------------------------------------------------------------------
# TensorData
# ---------------------------------------------------------------------------------------------

# bincode variant index → dtype name, by burn version (Flex32 arrived in 0.17, U16 in 0.16).
_DTYPES_017 = tuple("F64 F32 Flex32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 Bool QFloat".split())
_DTYPES_016 = tuple(d for d in _DTYPES_017 if d != "Flex32")
_DTYPES_014 = tuple(d for d in _DTYPES_016 if d != "U16")
_BOOL_STORES = ("Native", "U8", "U32")
_PLAIN_DTYPES = frozenset(_DTYPES_017) - {"Bool", "QFloat"}


def _make_tensor(
    data, shape: list[int], dtype: str, info: dict | None = None
) -> tuple[TensorRef | None, str | None]:
    """A TensorRef over ``data`` (bytes-like), or ``(None, reason)`` if sizes disagree."""
    info = dict(info or {})
    problem = limits.shape_problem(shape, 1 if dtype == "QFloat" else 4 if dtype == "Bool" else dtypes.itemsize(dtype))
    if problem:
        return None, problem
    shape = tuple(shape)
    numel = math.prod(shape)
    nbytes = len(data)
    if dtype == "QFloat":
        return TensorRef("QFloat", shape, loader=lambda: data, nbytes_hint=nbytes, info=info), None
    if dtype == "Bool":
        store = info.setdefault("bool_store", "Native")
        width = 4 if store == "U32" else 1
        if numel * width != nbytes:
            return None, f"Bool tensor {list(shape)} needs {numel * width} bytes, has {nbytes}"
        raw_dt = np.dtype("<u4") if width == 4 else np.dtype("u1")

        def as_bool() -> np.ndarray:
            return (np.frombuffer(data, dtype=raw_dt) != 0).reshape(shape)

        if width == 1:
            return TensorRef(
                "Bool", shape, loader=lambda: data, array_loader=as_bool, nbytes_hint=nbytes, info=info
            ), None
        # stored 4 bytes an element: seen as one byte each, as every writer holds Bool
        return TensorRef("Bool", shape, loader=lambda: as_bool().view(np.uint8).reshape(-1), array_loader=as_bool,
                         nbytes_hint=numel, info=info), None
    want = numel * dtypes.itemsize(dtype)
    if want != nbytes:
        return None, f"{dtype} tensor {list(shape)} needs {want} bytes, has {nbytes}"
    return TensorRef(dtype, shape, loader=lambda: data, info=info), None


def _is_tensor_data(node: object) -> bool:
    return isinstance(node, dict) and len(node) == 3 and set(node) == {"bytes", "shape", "dtype"}


def _msgpack_tensor(node: dict, where: str, path: str | None) -> TensorRef:
    """``TensorData`` map (rmp-serde) → TensorRef; FormatError naming ``where`` if malformed."""
    data, shape, dt = node["bytes"], node["shape"], node["dtype"]
    if not isinstance(data, bytes):
        raise FormatError(f"{where}: TensorData.bytes is {type(data).__name__}, expected binary", path)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise FormatError(f"{where}: TensorData.shape is not a list of sizes: {shape!r:.60}", path)
    info: dict = {}
    if isinstance(dt, str) and dt in _PLAIN_DTYPES | {"Bool"}:
        name = dt
    elif isinstance(dt, dict) and len(dt) == 1 and "Bool" in dt and dt["Bool"] in _BOOL_STORES:
        name, info["bool_store"] = "Bool", dt["Bool"]
    elif isinstance(dt, dict) and len(dt) == 1 and "QFloat" in dt:
        name, info["quant_scheme"] = "QFloat", dt["QFloat"]
    else:
        raise FormatError(f"{where}: unknown dtype {dt!r:.60}", path)
    ref, problem = _make_tensor(data, shape, name, info)
    if ref is None:
        raise FormatError(f"{where}: {problem}", path)
    return ref


def _bincode_tensor(r: BincodeReader, dtype_table: tuple[str, ...], bool_payload: bool) -> TensorRef:
    """``TensorData`` in bincode: bytes, shape (Vec<usize>), dtype (variant index [+ BoolStore])."""
    start = r.pos
    data = r.bytes()
    shape = r.usize_seq()
    idx = r.u32()
    if idx >= len(dtype_table):
        raise r.fail(f"unknown dtype variant {idx}")
    name = dtype_table[idx]
    info: dict = {}
    if name == "QFloat":
        raise r.fail("quantized (QFloat) tensors are not supported in bincode records")
    if name == "Bool" and bool_payload:
        store = r.u32()
        if store >= len(_BOOL_STORES):
            raise r.fail(f"unknown BoolStore variant {store}")
        info["bool_store"] = _BOOL_STORES[store]
    ref, problem = _make_tensor(data, shape, name, info)
    if ref is None:
        raise BincodeError(problem, start)
    return ref


# ---------------------------------------------------------------------------------------------
# Named msgpack
# ---------------------------------------------------------------------------------------------


def _read_msgpack(buf, path: str | None) -> LegacyRecord:
    try:
        top = msgpack.unpackb(buf, raw=False, use_list=True, strict_map_key=True,
                              max_array_len=limits.MAX_CONTAINER, max_map_len=limits.MAX_CONTAINER)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise FormatError(f"corrupt named msgpack: {_why(exc)}", path) from None
    problem = limits.depth_problem(top)
    if problem:
        raise FormatError(f"named msgpack {problem}", path)
    if not isinstance(top, dict) or set(top) != {"metadata", "item", "_b"}:
        keys = list(top) if isinstance(top, dict) else type(top).__name__
        raise FormatError(f"not a BurnRecord: expected keys metadata, item, _b; found {keys!r:.80}", path)
    if top["_b"] not in ([], None):
        raise FormatError(f"not a BurnRecord: _b is {top['_b']!r:.40}, expected []", path)
    meta = top["metadata"]
    if (
        not isinstance(meta, dict)
        or set(meta) != set(METADATA_FIELDS)
        or not all(isinstance(v, str) for v in meta.values())
    ):
        raise FormatError(
            "BurnRecord metadata must be the five strings float, int, format, version, settings", path
        )
    metadata = {k: meta[k] for k in METADATA_FIELDS}
    rec = LegacyRecord(metadata=metadata, kind="unknown", item=None, encoding="msgpack")
    _interpret_msgpack_item(top["item"], rec, path)
    return rec


def _interpret_msgpack_item(item: object, rec: LegacyRecord, path: str | None) -> None:
    sched = _msgpack_scheduler(item)
    if sched is not None:
        rec.kind, rec.item = "scheduler", sched
        if isinstance(item, int) and not isinstance(item, bool):
            rec.notes.append("an integer scheduler state fits Linear, CosineAnnealing, Noam and Step")
        return
    if isinstance(item, dict) and (not item or any(_is_v1(v) for v in item.values())):
        rec.kind, rec.item = "optimizer", _msgpack_optimizer(item, rec, path)
        return
    params: list[LegacyModelParam] = []
    _walk_model(item, [], params, rec.notes, path, 0)
    if params:
        rec.kind, rec.item = "model", LegacyModel(params)
    else:
        rec.kind, rec.item = "unknown", item
        rec.notes.append("item is neither an optimizer, a model nor a scheduler record")


def _is_v1(node: object) -> bool:
    return isinstance(node, dict) and list(node) == ["V1"]


_RANK_KEY = re.compile(r"Rank([0-8])")


def _msgpack_optimizer(item: dict, rec: LegacyRecord, path: str | None) -> LegacyOptimizer:
    entries: list[LegacyParamState] = []
    families: tuple[str, ...] | None = None
    for key, value in item.items():
        where = f"optimizer entry {key!r}"
        pid = _decode_id(key, where, path, rec.notes)
        inner = value.get("V1") if _is_v1(value) else None
        if not isinstance(inner, dict) or len(inner) != 1:
            raise FormatError(f"{where}: expected {{'V1': {{'Rank<D>': state}}}}", path)
        ((rank_key, state),) = inner.items()
        m = _RANK_KEY.fullmatch(rank_key) if isinstance(rank_key, str) else None
        if m is None or not isinstance(state, dict):
            raise FormatError(f"{where}: expected a Rank0..Rank8 state map, found {rank_key!r:.30}", path)
        rank = int(m.group(1))
        fields: dict[str, TensorRef | Scalar] = {}
        _flatten_state(state, "", fields, where, path, 0)
        _check_ranks(fields, rank, where, path)
        _check_field_types(fields, where, path)
        entries.append(LegacyParamState(display_id=key, id=pid, rank=rank, fields=fields))
        fits = _matching_families(state)
        families = fits if families is None else tuple(f for f in families if f in fits)
    if not entries:
        rec.notes.append("optimizer record has no parameter states (the optimizer never stepped)")
    elif not families:
        sample = ", ".join(entries[0].fields)
        rec.notes.append(f"optimizer state layout matches no known burn optimizer (leaves: {sample})")
    return LegacyOptimizer(entries=entries, families=families or ())


def _flatten_state(node: object, prefix: str, out: dict, where: str, path: str | None, depth: int) -> None:
    """Dotted leaves of a msgpack state map (§2.2 names; ``Vec`` → ``.len`` + ``.<i>``)."""
    if depth > _MAX_DEPTH:
        raise FormatError(f"{where}: state nested deeper than {_MAX_DEPTH}", path)
    if _is_tensor_data(node):
        out[prefix] = _msgpack_tensor(node, f"{where} {prefix}", path)
    elif isinstance(node, dict):
        for k, v in node.items():
            if not isinstance(k, str):
                raise FormatError(f"{where}: non-string field name {k!r:.30}", path)
            _flatten_state(v, f"{prefix}.{k}" if prefix else k, out, where, path, depth + 1)
    elif isinstance(node, list):
        out[f"{prefix}.len"] = len(node)
        for i, v in enumerate(node):
            _flatten_state(v, f"{prefix}.{i}", out, where, path, depth + 1)
    elif node is None:
        pass
    elif isinstance(node, int | float) and prefix:
        out[prefix] = node
    else:
        raise FormatError(
            f"{where}: unsupported value {type(node).__name__} at {prefix or 'top level'}", path
        )


def _tensor_leaves(schema: object, prefix: str = "", usize: bool = False) -> set[str]:
    """Dotted names a layout declares as tensors (``momentum.moment_1`` …), or as usize."""
    if schema == (USIZE if usize else TENSOR):
        return {prefix}
    if isinstance(schema, Opt):
        return _tensor_leaves(schema.inner, prefix, usize)
    if isinstance(schema, tuple):
        found: set[str] = set()
        for name, sub in schema:
            found |= _tensor_leaves(sub, f"{prefix}.{name}" if prefix else name, usize)
        return found
    return set()


_TENSOR_FIELDS = frozenset().union(*(_tensor_leaves(layout.schema) for layout in OPTIMIZER_LAYOUTS))
_USIZE_FIELDS = frozenset().union(*(_tensor_leaves(layout.schema, usize=True) for layout in OPTIMIZER_LAYOUTS))


def _check_field_types(fields: dict, where: str, path: str | None) -> None:
    """A field the known layouts hold as a tensor record must be one (not a number); a ``usize``
    field (``time``) an integer from 0 to 2^64 - 1."""
    for name, value in fields.items():
        if name in _TENSOR_FIELDS and not isinstance(value, TensorRef):
            raise FormatError(f"{where}: {name} is a {type(value).__name__}, expected a tensor record", path)
        if name in _USIZE_FIELDS and not (type(value) is int and 0 <= value < 1 << 64):
            raise FormatError(f"{where}: {name} is {limits.short(value)}, expected an unsigned integer", path)


def _check_ranks(fields: dict, rank: int, where: str, path: str | None) -> None:
    for name, value in fields.items():
        if isinstance(value, TensorRef) and len(value.shape) != rank:
            raise FormatError(
                f"{where}: {name} has shape {list(value.shape)} but the entry is Rank{rank}", path
            )


def _matches(schema: object, node: object) -> bool:
    """Whether a msgpack state node fits a layout schema (absent keys allowed for ``Opt``)."""
    if schema == TENSOR:
        return _is_tensor_data(node)
    if schema == USIZE:
        return type(node) is int and node >= 0
    if isinstance(schema, Opt):
        return node is None or _matches(schema.inner, node)
    if not isinstance(node, dict) or _is_tensor_data(node):
        return False
    names = {name for name, _ in schema}
    if not set(node) <= names:
        return False
    return all(_matches(sub, node[name]) if name in node else isinstance(sub, Opt) for name, sub in schema)


def _matching_families(state: dict) -> tuple[str, ...]:
    found: list[str] = []
    for layout in OPTIMIZER_LAYOUTS:
        if _matches(layout.schema, state):
            found += [f for f in layout.families if f not in found]
    return tuple(found)


def _walk_model(node: object, chain: list[str], out: list, notes: list, path: str | None, depth: int) -> None:
    """Collect every ``{"id", "param"}`` map with its key chain (list index = path segment)."""
    if depth > _MAX_DEPTH:
        raise FormatError(f"model record nested deeper than {_MAX_DEPTH}", path)
    where = ".".join(chain) or "item"
    if isinstance(node, dict):
        if set(node) == {"id", "param"}:  # ParamSerde
            if not _is_tensor_data(node["param"]):
                raise FormatError(f"parameter {where}: param is not a TensorData map", path)
            pid = _decode_id(node["id"], f"parameter {where}", path, notes)
            tensor = _msgpack_tensor(node["param"], f"parameter {where}", path)
            out.append(LegacyModelParam(path=where, display_id=node["id"], id=pid, tensor=tensor))
        elif _is_tensor_data(node):
            notes.append(f"tensor at {where} has no ParamId; skipped")
        else:
            for k, v in node.items():
                _walk_model(v, [*chain, str(k)], out, notes, path, depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _walk_model(v, [*chain, str(i)], out, notes, path, depth + 1)


_SCHED_VARIANTS = {"Linear": "linear", "Cosine": "cosine", "Exponential": "exponential", "Noam": "noam"}


def _msgpack_scheduler(item: object) -> LegacyScheduler | None:
    if item is None:
        return LegacyScheduler({"constant": None})
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        names = ("linear", "cosine", "noam", "step") if item >= 0 else ("step",)
        return LegacyScheduler(dict.fromkeys(names, item))
    if isinstance(item, float):
        return LegacyScheduler({"exponential": item})
    if isinstance(item, dict) and list(item) == ["schedulers"] and isinstance(item["schedulers"], list):
        children = []
        for child in item["schedulers"]:
            if not (isinstance(child, dict) and len(child) == 1):
                return None
            ((variant, value),) = child.items()
            name = _SCHED_VARIANTS.get(variant)
            ok = isinstance(value, float) if name == "exponential" else (type(value) is int and value >= 0)
            if name is None or not ok:
                return None
            children.append(LegacyScheduler({name: value}))
        return LegacyScheduler({"composed": None}, children)
    return None


def _decode_id(text: object, where: str, path: str | None, notes: list) -> int | None:
    if not isinstance(text, str):
        raise FormatError(f"{where}: ParamId is not a string", path)
    try:
        pid = param_id_from_str(text)
    except ValueError as exc:
        raise FormatError(f"{where}: {exc}", path) from None
    if pid is None:
        notes.append(f"{where}: UUID-era ParamId {text!r}; its u64 (an ahash) is not recoverable")
    return pid


# ---------------------------------------------------------------------------------------------
# bincode
# ---------------------------------------------------------------------------------------------


def _parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _read_bincode(buf, path: str | None) -> LegacyRecord:
    r = BincodeReader(buf)
    try:
        metadata = {name: r.string(max_len=4096) for name in METADATA_FIELDS}
    except BincodeError as exc:
        raise FormatError(f"corrupt bincode record metadata: {exc}", path) from None
    rec = LegacyRecord(metadata=metadata, kind="unknown", item=None, encoding="bincode")
    version = _parse_version(metadata["version"])
    if version is None:
        rec.notes.append(f"unrecognised burn version {metadata['version']!r}; assuming 0.21 layouts")
        version = (0, 21)
    if version < (0, 14):
        raise FormatError(
            f"burn {metadata['version']} records predate TensorData (0.14) and are not supported", path
        )
    table = _DTYPES_017 if version >= (0, 17) else _DTYPES_016 if version >= (0, 16) else _DTYPES_014
    bool_payload = version >= (0, 21)
    item_start = r.pos

    if r.remaining == 1 and buf[item_start] == 0:
        rec.kind, rec.item = "optimizer", LegacyOptimizer([], ())
        rec.notes.append("empty record: an optimizer that never stepped, or a scheduler state of 0")
        return rec

    opt, error = _bincode_optimizer(buf, item_start, table, bool_payload)
    if opt is not None:
        rec.kind, rec.item = "optimizer", opt
        for reading in [opt, *opt.alternatives]:
            for e in reading.entries:
                e.id = _decode_id(e.display_id, f"optimizer entry {e.display_id!r}", path, rec.notes)
        if opt.alternatives:
            others = "; ".join("/".join(alt.families) for alt in opt.alternatives)
            rec.notes.append(
                f"the bytes also decode as {others}; read as {'/'.join(opt.families)} "
                "(see LegacyOptimizer.alternatives)"
            )
        return rec
    sched = _bincode_scheduler(BincodeReader(buf, item_start))
    if sched is not None:
        rec.kind, rec.item = "scheduler", sched
        return rec
    first_id = _bincode_model_hint(buf, item_start)
    if first_id is not None:
        raise FormatError(
            f"bincode model record (first parameter id {first_id}): not supported — bincode stores no "
            "field names, so module paths cannot be recovered; re-save the model as .mpk",
            path,
        )
    raise FormatError(
        "bincode record matches no known optimizer layout (Adam/AdamW, SGD, Muon, AdaGrad, Adan, "
        f"RMSProp) or scheduler state; furthest attempt: {error}",
        path,
    )


def _bincode_model_hint(buf, start: int) -> str | None:
    """The first ParamSerde id if the item starts like a module record (``0D`` + 13 base32 chars
    + a non-zero tensor byte length), else ``None``."""
    r = BincodeReader(buf, start)
    try:
        while r.remaining and buf[r.pos] in (0, 1) and r.pos - start < 16:  # leading Option tags / empties
            r.pos += 1
        text = r.string(max_len=13)
        # an optimizer entry continues with V1 = 00; a ParamSerde with the tensor's byte length
        if len(text) == 13 and _is_base32_id(text) and r.remaining and buf[r.pos] != 0:
            return text
    except BincodeError:
        pass
    return None


def _bincode_optimizer(
    buf, start: int, table: tuple[str, ...], bool_payload: bool
) -> tuple[LegacyOptimizer | None, BincodeError | None]:
    """Try every layout; keep those that consume the item exactly.

    Layouts with the same schema (Adam/AdamW) merge into one reading; different schemas that
    both fit become :attr:`LegacyOptimizer.alternatives`. With no fit, returns the error of the
    attempt that got furthest.
    """
    readings: dict[tuple, LegacyOptimizer] = {}
    furthest: BincodeError | None = None
    for layout in OPTIMIZER_LAYOUTS:
        try:
            entries = _bincode_entries(BincodeReader(buf, start), layout.schema, table, bool_payload)
        except BincodeError as exc:
            if furthest is None or exc.offset > furthest.offset:
                furthest = exc
            continue
        reading = readings.setdefault(layout.schema, LegacyOptimizer(entries, ()))
        reading.families += tuple(f for f in layout.families if f not in reading.families)
    if not readings:
        return None, furthest
    first, *others = readings.values()
    first.alternatives = others
    return first, None


def _bincode_entries(
    r: BincodeReader, schema: tuple, table: tuple[str, ...], bool_payload: bool
) -> list[LegacyParamState]:
    """``HashMap<String, AdaptorRecordItem>``: len, then (key, V1=0, Rank index, state) pairs."""
    n = r.length(min_item_size=3)
    entries = []
    for _ in range(n):
        key = r.string(max_len=64)
        if r.u32() != 0:
            raise r.fail("unknown AdaptorRecordItem version (only V1 exists)")
        rank = r.u32()
        if rank > 8:
            raise r.fail(f"rank variant {rank} > 8")
        fields: dict[str, TensorRef | Scalar] = {}
        _bincode_value(r, schema, "", fields, table, bool_payload, rank)
        entries.append(LegacyParamState(display_id=key, id=None, rank=rank, fields=fields))
    if not r.at_end():
        raise r.fail(f"{r.remaining} bytes left over")
    return entries


def _bincode_value(
    r: BincodeReader, schema: object, name: str, out: dict, table: tuple, bool_payload: bool, rank: int
) -> None:
    if schema == TENSOR:
        start = r.pos
        ref = _bincode_tensor(r, table, bool_payload)
        if len(ref.shape) != rank:
            raise BincodeError(f"{name} has rank {len(ref.shape)}, entry is Rank{rank}", start)
        out[name] = ref
    elif schema == USIZE:
        out[name] = r.varint()
    elif isinstance(schema, Opt):
        if r.tag():
            _bincode_value(r, schema.inner, name, out, table, bool_payload, rank)
    else:
        for sub_name, sub in schema:
            _bincode_value(r, sub, f"{name}.{sub_name}" if name else sub_name, out, table, bool_payload, rank)


_BINCODE_SCHED = (("linear", "varint"), ("cosine", "varint"), ("exponential", "f64"), ("noam", "varint"))


def _bincode_scheduler(r: BincodeReader) -> LegacyScheduler | None:
    """Bare ``()``/usize/i32/f64 state, or ``Composed {schedulers: Vec<enum>}`` — exact fit only."""
    if r.at_end():
        return LegacyScheduler({"constant": None})
    start = r.pos
    total = r.remaining
    try:
        raw = r.varint()
        if r.at_end():
            step = (raw >> 1) ^ -(raw & 1)
            found = dict.fromkeys(("linear", "cosine", "noam"), raw)
            if -(2**31) <= step < 2**31:
                found["step"] = step
            return LegacyScheduler(found)
    except BincodeError:
        pass
    if total == 8:
        r.pos = start
        return LegacyScheduler({"exponential": r.f64()})
    r.pos = start
    try:
        children = []
        for _ in range(r.length(min_item_size=2)):
            idx = r.u32()
            if idx >= len(_BINCODE_SCHED):
                return None
            name, kind = _BINCODE_SCHED[idx]
            children.append(LegacyScheduler({name: r.f64() if kind == "f64" else r.varint()}))
        if r.at_end():
            return LegacyScheduler({"composed": None}, children)
    except BincodeError:
        pass
    return None
