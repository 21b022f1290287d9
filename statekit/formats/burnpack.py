"""burn's burnpack container (``.bpk``): header, CBOR metadata, 256-byte aligned tensor data.

Layout (``shared/docs/burn-formats.md`` §1)::

    0   u32 LE magic 0x4255524E ("NRUB" on disk)
    4   u16 LE version (1)
    6   u32 LE metadata size N
    10  N bytes CBOR {"tensors": {name: {dtype, shape, data_offsets, [param_id]}},
                      ["metadata": {str: str}], ["scalars": {name: {"Int"|"UInt"|"Float"|"Bool": v}}]}
    D = ceil((10 + N) / 256) * 256: tensor data, offsets relative to D, each start 256-aligned

burn 0.19 wrote the same header without alignment (data right after the metadata, tensors back to
back); such files are recognised and read, and written back in their own layout.

This module knows nothing about optimizers: it maps bytes to named tensors, scalars and strings.
Opening a file reads the header and metadata only; tensor bytes are memory-mapped on demand.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter

from statekit import dtypes
from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.formats import cbor, limits
from statekit.lazy import numpy as np
from statekit.tensor import FileSpan, SourceFile, TensorRef

MAGIC = b"NRUB"
VERSION = 1
HEADER_SIZE = 10
ALIGNMENT = 256
MAX_METADATA_SIZE = 100 * 1024 * 1024
MAX_TENSOR_COUNT = 100_000
MAX_TENSOR_SIZE = 10 * 1024**3
MAX_RANK = 64
_BOOL_STORES = {"Native": "?", "U8": "u1", "U32": "<u4"}


def aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Scalar:
    """A burnpack scalar with its variant (``Int``/``UInt``/``Float``/``Bool``) kept for writing."""

    kind: str
    value: int | float | bool

    def to_cbor(self) -> dict:
        return {self.kind: self.value}

    @staticmethod
    def of(value: int | float | bool) -> Scalar:
        """The variant burn would write for a Rust field holding ``value``."""
        if isinstance(value, bool):
            return Scalar("Bool", value)
        if isinstance(value, int):
            return Scalar("UInt" if value >= 0 else "Int", value)
        return Scalar("Float", float(value))


class _DtypeName:
    """``TensorEntry.dtype``: the statekit dtype name, worked out at the first read and kept (a
    plain descriptor: ``functools.cached_property`` takes a lock per instance in Python 3.11)."""

    def __get__(self, entry, owner=None):
        if entry is None:
            return self
        name = entry.__dict__["dtype"] = dtype_name(entry.burn_dtype)
        return name


@dataclass
class TensorEntry:
    """One tensor descriptor: the CBOR dtype value as written, shape, byte range, param id."""

    name: str
    burn_dtype: object  # "F32", {"Bool": "Native"}, {"QFloat": {...}}, "Bool" (0.19/0.20)
    shape: tuple[int, ...]
    start: int
    end: int
    param_id: int | None = None

    dtype = _DtypeName()

    @property
    def nbytes(self) -> int:
        return self.end - self.start


#: bytes per element of each dtype burn spells as a plain string (QFloat needs its scheme)
_ITEMSIZES = {name: dtypes.itemsize(name) for name in dtypes.DTYPE_NAMES if name != "QFloat"}


def dtype_name(burn_dtype: object) -> str:
    """statekit's dtype name for a burnpack dtype value (raises ValueError when unknown)."""
    if type(burn_dtype) is str and burn_dtype in _ITEMSIZES:
        return burn_dtype
    if isinstance(burn_dtype, str):
        if burn_dtype in dtypes.DTYPE_NAMES and burn_dtype != "QFloat":
            return burn_dtype
    elif isinstance(burn_dtype, dict) and len(burn_dtype) == 1:
        (key, value), = burn_dtype.items()
        if key == "Bool" and isinstance(value, str) and value in _BOOL_STORES:
            return "Bool"
        if key == "QFloat" and isinstance(value, dict):
            return "QFloat"
    raise ValueError(f"unknown burnpack dtype {burn_dtype!r}")


def burn_dtype_for(name: str) -> object:
    """The CBOR dtype value burn 0.22 writes for a statekit dtype name."""
    if name == "Bool":
        return {"Bool": "Native"}
    if name == "QFloat":
        raise ValueError("QFloat tensors need their scheme; copy the burn dtype from the source")
    dtypes.numpy_dtype(name)
    return name


def _element_size(burn_dtype: object) -> int:
    """Bytes per stored element (no numpy: a header-only read never imports it)."""
    if isinstance(burn_dtype, dict) and "Bool" in burn_dtype:
        return {"Native": 1, "U8": 1, "U32": 4}[burn_dtype["Bool"]]
    return dtypes.itemsize(dtype_name(burn_dtype))


def _element_numpy_dtype(burn_dtype: object) -> np.dtype:
    if isinstance(burn_dtype, dict) and "Bool" in burn_dtype:
        return np.dtype(_BOOL_STORES[burn_dtype["Bool"]])
    return dtypes.numpy_dtype(dtype_name(burn_dtype))


def claims(head: bytes, path: str) -> bool:
    """Sniffer: the file starts with burnpack's magic bytes."""
    return head[:4] == MAGIC


class BurnpackFile:
    """A burnpack file opened for reading: metadata parsed and validated, tensors lazy.

    Use as a context manager or call :meth:`close`. ``tensors`` is in metadata (name) order;
    ``data_order`` lists names in the order their bytes appear in the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fh = None
        self._map: mmap.mmap | None = None
        self._source: SourceFile | None = None
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise FormatError(f"cannot open: {exc.strerror}", self.path) from None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ parsing
    def _error(self, message: str) -> FormatError:
        return FormatError(message, self.path)

    def _parse(self) -> None:
        size = os.fstat(self._fh.fileno()).st_size
        self.file_size = size
        header = self._fh.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise self._error(f"file is {size} bytes, too short for a burnpack header (10 bytes)")
        magic, self.version, self.metadata_size = header[:4], *struct.unpack("<HI", header[4:])
        if magic != MAGIC:
            raise self._error(
                f"not a burnpack file: magic bytes are {magic.hex(' ')}, expected 4e 52 55 42 ('NRUB')"
            )
        if self.version > VERSION:
            raise self._error(f"burnpack version {self.version} is newer than supported (1)")
        if self.metadata_size > MAX_METADATA_SIZE:
            raise self._error(
                f"metadata size {self.metadata_size} exceeds burn's limit of {MAX_METADATA_SIZE} bytes"
            )
        if HEADER_SIZE + self.metadata_size > size:
            raise self._error(
                f"truncated: header claims {self.metadata_size} bytes of metadata, "
                f"file has {size - HEADER_SIZE} after the header"
            )
        self.raw_metadata = self._fh.read(self.metadata_size)
        declared = _declared_tensor_count(self.raw_metadata)
        if declared is not None and declared > MAX_TENSOR_COUNT:  # refused before decoding any entry
            raise self._error(f"{declared} tensors exceed burn's limit of {MAX_TENSOR_COUNT}")
        # cbor2's compiled decoder first; the strict decoder (cbor.decode) settles every file
        # whose bytes are not burn's own encoding (checked below), so both accept the same files.
        meta = _fast_decode(self.raw_metadata)
        fast = meta is not None
        if not fast:
            meta = self._strict_decode()
        if not isinstance(meta, dict) or "tensors" not in meta:
            raise self._error("metadata has no 'tensors' map")
        tensors, strings, scalars = meta["tensors"], meta.get("metadata", {}), meta.get("scalars", {})
        if not isinstance(tensors, dict) or not isinstance(strings, dict) or not isinstance(scalars, dict):
            raise self._error("metadata 'tensors', 'metadata' and 'scalars' must be maps")
        if len(tensors) > MAX_TENSOR_COUNT:
            raise self._error(f"{len(tensors)} tensors exceed burn's limit of {MAX_TENSOR_COUNT}")
        self.tensors = self._entries(tensors)
        self.metadata = self._strings(strings)
        self.scalars = self._scalars(scalars)
        self.data_order = [e.name for e in sorted(self.tensors.values(), key=attrgetter("start", "end"))]
        self._place_data(size)
        self.canonical = _burn_encoded(self.raw_metadata, meta) if fast else None
        if self.canonical is None:
            self.canonical = self.raw_metadata == encode_metadata(self.tensors, self.metadata, self.scalars)
        if fast and not self.canonical:
            self._strict_decode()  # refuses what the strict decoder refuses (indefinite lengths, tags …)

    def _strict_decode(self) -> object:
        try:  # no list or map longer than burn's tensor limit: refused at its head, before decoding it
            return cbor.decode(self.raw_metadata, max_items=MAX_TENSOR_COUNT)
        except cbor.CborError as exc:
            raise self._error(f"invalid CBOR metadata: {exc}") from None

    def _entries(self, tensors: dict) -> dict[str, TensorEntry]:
        """Every descriptor checked as :meth:`_entry` checks it, the usual ones here in one loop
        (measured: 0.1 s of a 20,000-tensor header went to the general checks). An entry the
        loop does not settle (a dtype map, a zero-size dimension, anything odd) goes to
        :meth:`_entry`, which accepts it or words the refusal."""
        sizes, max_rank, entry_of, out = _ITEMSIZES, limits.MAX_RANK, TensorEntry, {}
        for name, desc in tensors.items():
            if type(name) is str and type(desc) is dict:
                dtype, shape, offsets, pid = (desc.get("dtype"), desc.get("shape"), desc.get("data_offsets"),
                                              desc.get("param_id"))
                itemsize = sizes.get(dtype) if type(dtype) is str else None
                if (itemsize and type(shape) is list and len(shape) <= max_rank and type(offsets) is list
                        and len(offsets) == 2 and (pid is None or type(pid) is int and 0 <= pid < 1 << 64)):
                    start, end = offsets
                    numel = 1
                    for d in shape:  # positive dimensions: the product bounds every limit below
                        if type(d) is not int or d <= 0:
                            numel = -1
                            break
                        numel *= d
                    if (type(start) is int and type(end) is int and 0 <= start <= end
                            and end - start <= MAX_TENSOR_SIZE and numel * itemsize == end - start):
                        out[name] = entry_of(name, dtype, tuple(shape), start, end, pid)
                        continue
            out[name] = self._entry(name, desc)
        return out

    def _scalars(self, scalars: dict) -> dict[str, Scalar]:
        """:meth:`_scalar` for each, integer and boolean ones checked here and shared (frozen)."""
        known: dict[tuple, Scalar] = {}
        out = {}
        for name, value in scalars.items():
            if type(name) is str and type(value) is dict and len(value) == 1:
                (kind, v), = value.items()
                t = type(v)
                if (t is int and (kind == "UInt" and 0 <= v < 1 << 64 or kind == "Int" and -(1 << 63) <= v < 1 << 63)
                        or t is bool and kind == "Bool"):
                    scalar = known.get((kind, v))
                    if scalar is None:
                        scalar = known[(kind, v)] = Scalar(kind, v)
                    out[name] = scalar
                    continue
            out[name] = self._scalar(name, value)
        return out

    def _entry(self, name: object, desc: object) -> TensorEntry:
        if not isinstance(name, str) or not isinstance(desc, dict):
            raise self._error(f"tensor descriptor {name!r} is not a name → map entry")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in desc]
        if missing:
            raise self._error(f"tensor {name!r} has no {', '.join(missing)}")
        try:
            dtype = dtype_name(desc["dtype"])
        except ValueError as exc:
            raise self._error(f"tensor {name!r}: {exc}") from None
        shape, offsets, pid = desc["shape"], desc["data_offsets"], desc.get("param_id")
        itemsize = 1 if dtype == "QFloat" else _element_size(desc["dtype"])
        problem = limits.shape_problem(shape, itemsize)
        if problem:
            raise self._error(f"tensor {name!r}: {problem}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offsets)
        ):
            raise self._error(f"tensor {name!r}: data_offsets {offsets!r} is not [start, end]")
        start, end = offsets
        if end < start:
            raise self._error(f"tensor {name!r}: data_offsets end {end} is before start {start}")
        if end - start > MAX_TENSOR_SIZE:
            raise self._error(f"tensor {name!r}: {end - start} bytes exceed burn's 10 GiB tensor limit")
        if pid is not None and not (isinstance(pid, int) and 0 <= pid < 1 << 64):
            raise self._error(f"tensor {name!r}: param_id {pid!r} is not a u64")
        if dtype != "QFloat":
            expected = math.prod(shape) * _element_size(desc["dtype"])
            if expected != end - start:
                raise self._error(
                    f"tensor {name!r}: {end - start} bytes of data but shape {shape} of {dtype} needs {expected}"
                )
        return TensorEntry(name, desc["dtype"], tuple(shape), start, end, pid)

    def _strings(self, strings: dict) -> dict[str, str]:
        for key, value in strings.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise self._error(f"string metadata entry {key!r} is not text → text")
        return dict(strings)

    def _scalar(self, name: object, value: object) -> Scalar:
        if isinstance(name, str) and isinstance(value, dict) and len(value) == 1:
            (kind, v), = value.items()
            ok = {
                "Int": isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < 1 << 63,
                "UInt": isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64,
                "Float": isinstance(v, float | int) and not isinstance(v, bool),
                "Bool": isinstance(v, bool),
            }.get(kind, False)
            if ok:
                return Scalar(kind, float(v) if kind == "Float" else v)
        raise self._error(f"scalar {name!r} has value {value!r}, expected {{Int|UInt|Float|Bool: value}}")

    def _place_data(self, size: int) -> None:
        """Find the data section (aligned ≥0.20 or unaligned 0.19) and check every range."""
        header_end = HEADER_SIZE + self.metadata_size
        data_end = max((e.end for e in self.tensors.values()), default=0)
        aligned_start = aligned(header_end)
        unaligned = (
            aligned_start != header_end
            and size == header_end + data_end
            and size < aligned_start + data_end
        )
        self.layout = "0.19-unaligned" if unaligned else "aligned"
        self.data_start = header_end if unaligned else aligned_start
        if self.tensors and self.data_start + data_end > size:
            raise self._error(
                f"truncated: tensor data ends at byte {self.data_start + data_end}, file has {size} bytes"
            )
        self.trailing_bytes = max(0, size - (self.data_start + data_end)) if self.tensors else 0
        previous = None
        for name in self.data_order:
            entry = self.tensors[name]
            if not unaligned and entry.start % ALIGNMENT:
                raise self._error(f"tensor {name!r} starts at offset {entry.start}, not 256-byte aligned")
            if previous is not None and entry.start < previous.end and entry.nbytes and previous.nbytes:
                raise self._error(f"tensors {previous.name!r} and {name!r} overlap in the data section")
            previous = entry if entry.nbytes or previous is None else previous

    # ------------------------------------------------------------------ access
    def _mapped(self) -> mmap.mmap | bytes:
        if self._map is None:
            if self.file_size == 0:
                return b""
            self._map = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    def raw(self, name: str) -> memoryview:
        entry = self._get(name)
        lo = self.data_start + entry.start
        return memoryview(self._mapped())[lo : lo + entry.nbytes]

    def read_chunks(self, name: str, size: int) -> Iterator[bytes]:
        """A tensor's bytes read with ``pread`` in pieces: copies never map the whole file."""
        entry = self._get(name)
        lo, end = self.data_start + entry.start, self.data_start + entry.end
        while lo < end:
            piece = os.pread(self._fh.fileno(), min(size, end - lo), lo)
            if not piece:
                raise self._error(f"tensor {name!r}: file ended while reading")
            yield piece
            lo += len(piece)

    def _get(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise self._error(f"no tensor named {name!r}") from None

    def tensor(self, name: str) -> TensorRef:
        """A lazy view of one tensor; its bytes are read with ``pread`` in pieces when asked for."""
        entry = self._get(name)
        info = {"burn_dtype": entry.burn_dtype, "param_id": entry.param_id, "name": name}
        if self._source is None:
            self._source = SourceFile(self._fh, self.path, self.file_size)
        dtype, nbytes = entry.dtype, entry.end - entry.start
        ref = TensorRef(dtype=dtype, shape=entry.shape, nbytes_hint=nbytes, info=info,
                        span=FileSpan(self._source, self.data_start + entry.start, nbytes))
        if dtype != "Bool":
            return ref
        if _element_size(entry.burn_dtype) != 1:
            return self._wide_bool(entry, info)
        store = _element_numpy_dtype(entry.burn_dtype)
        ref.array_loader = lambda: np.frombuffer(ref.span.read(), dtype=store).reshape(entry.shape) != 0
        return ref

    def _wide_bool(self, entry: TensorEntry, info: dict) -> TensorRef:
        """A Bool tensor stored 4 bytes an element (``{"Bool": "U32"}``) seen as one byte each, as every
        other reader and writer holds Bool; :meth:`stored_tensor` keeps burn's own bytes for copies."""
        store = _element_numpy_dtype(entry.burn_dtype)
        numel = math.prod(entry.shape)

        def values() -> np.ndarray:
            return np.frombuffer(self.raw(entry.name), dtype=store).reshape(entry.shape) != 0

        info = {**info, "burn_dtype": {"Bool": "Native"}, "bool_store": entry.burn_dtype["Bool"]}
        return TensorRef(dtype="Bool", shape=entry.shape, loader=lambda: values().view(np.uint8).reshape(-1),
                         array_loader=values, nbytes_hint=numel, info=info)

    def stored_tensor(self, name: str) -> TensorRef:
        """A tensor's bytes exactly as stored (burn's dtype value and width), for byte-exact copies."""
        entry = self._get(name)
        if self._source is None:
            self._source = SourceFile(self._fh, self.path, self.file_size)
        return TensorRef(dtype=entry.dtype, shape=entry.shape, nbytes_hint=entry.nbytes,
                         info={"burn_dtype": entry.burn_dtype, "param_id": entry.param_id, "name": name},
                         span=FileSpan(self._source, self.data_start + entry.start, entry.nbytes))

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # arrays still view the map; it closes when they go
                pass
            self._map = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> BurnpackFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- writing


@dataclass
class PackTensor:
    """A tensor to write: its burnpack name, dtype value, shape, param id and byte source."""

    name: str
    source: TensorRef
    burn_dtype: object = None
    param_id: int | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.burn_dtype is None:
            self.burn_dtype = self.source.info.get("burn_dtype")
        if self.burn_dtype is None:
            if self.source.dtype == "QFloat":  # e.g. read from a burn <= 0.21 record: no scheme to write
                raise MappingError(f"{self.name}: a quantized (QFloat) tensor without its burnpack "
                                   "quantization scheme cannot be written to burnpack")
            self.burn_dtype = burn_dtype_for(self.source.dtype)
        if self.shape is None:
            self.shape = tuple(self.source.shape)


@dataclass
class Layout:
    """Where each tensor lands: offsets relative to the data section, in write order."""

    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    metadata: bytes = b""
    data_start: int = 0
    file_size: int = 0


def encode_metadata(
    tensors: dict[str, TensorEntry], strings: dict[str, str], scalars: dict[str, Scalar]
) -> bytes:
    """CBOR metadata exactly as burn writes it: sorted maps, tensors/metadata/scalars order."""
    def sort(d: dict) -> dict:
        return {k: d[k] for k in sorted(d, key=limits.utf8)}  # (a name that is no UTF-8: refused, named)

    desc = {}
    for name, e in sort(tensors).items():
        item = {"dtype": e.burn_dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
        if e.param_id is not None:
            item["param_id"] = e.param_id
        desc[name] = item
    top: dict = {"tensors": desc}
    if strings:
        top["metadata"] = sort(strings)
    if scalars:
        top["scalars"] = {k: v.to_cbor() for k, v in sort(scalars).items()}
    if not any(isinstance(v.value, float) for v in scalars.values()):
        # Without floats (the one type cbor2 writes differently: always 8 bytes), cbor2's
        # compiled encoder writes exactly these bytes: shortest heads, definite lengths, the
        # maps in the order given. Offsets and ids are below 2**64 (checked when read).
        fast = _fast_encode(top)
        if fast is not None:
            return fast
    return cbor.encode(top)


_DESCRIPTOR_KEYS = (("dtype", "shape", "data_offsets"), ("dtype", "shape", "data_offsets", "param_id"))


def _burn_encoded(raw: bytes, meta: dict) -> bool | None:
    """Is ``raw`` what :func:`encode_metadata` writes for its content? Without a second encode
    of the content: ``meta`` (cbor2's decoding of ``raw``, maps in file order) must be laid out
    as burn lays it out (maps sorted, descriptor fields in burn's order, no empty map, no null
    id, integer scalars), and cbor2 must encode ``meta`` back to exactly ``raw`` (shortest heads,
    definite lengths). None where this cannot tell (a Float scalar: cbor2 writes floats in 8
    bytes, burn in the fewest exact ones); the caller then encodes the content and compares."""
    tensors, strings, scalars = meta["tensors"], meta.get("metadata", {}), meta.get("scalars", {})
    if list(meta) != ["tensors"] + ["metadata"] * bool(strings) + ["scalars"] * bool(scalars):
        return False
    for value in scalars.values():
        if "Float" in value:
            return None
    for mapping in (tensors, strings, scalars):  # keys in UTF-8 byte order (= code point order)
        keys = list(mapping)
        if keys != sorted(keys):
            return False
    for desc in tensors.values():
        if tuple(desc) not in _DESCRIPTOR_KEYS or len(desc) == 4 and desc["param_id"] is None:
            return False
    encoded = _fast_encode(meta)
    return None if encoded is None else encoded == raw


def _declared_tensor_count(raw: bytes) -> int | None:
    """The entry count the ``tensors`` map declares in its head, when it is the metadata map's first
    key (as burn writes it); None otherwise (the strict decoder then limits every map at its head)."""
    if len(raw) < 9 or raw[0] >> 5 != 5 or raw[1:9] != b"\x67tensors":
        return None
    head = raw[9] if len(raw) > 9 else 0
    if head >> 5 != 5:
        return None
    info = head & 0x1F
    if info < 24:
        return info
    width = {24: 1, 25: 2, 26: 4, 27: 8}.get(info)
    return int.from_bytes(raw[10 : 10 + width], "big") if width and len(raw) >= 10 + width else None


def _fast_decode(raw: bytes) -> object | None:
    """``raw`` decoded by cbor2 (no tags allowed), or None when cbor2 is missing or refuses it."""
    try:
        import cbor2
    except ImportError:  # pragma: no cover - a dependency
        return None

    def no_tags(decoder, tag):
        raise ValueError("tag")

    try:
        return cbor2.loads(raw, tag_hook=no_tags)
    except Exception:  # the strict decoder gives the error message
        return None


def _fast_encode(value: object) -> bytes | None:
    try:
        import cbor2
    except ImportError:  # pragma: no cover - a dependency
        return None
    try:
        return cbor2.dumps(value)
    except Exception:  # pragma: no cover - the exact encoder decides
        return None


def plan_layout(
    tensors: list[PackTensor],
    strings: dict[str, str],
    scalars: dict[str, Scalar],
    unaligned: bool = False,
) -> tuple[Layout, dict[str, TensorEntry]]:
    entries: dict[str, TensorEntry] = {}
    cursor = 0
    for t in tensors:
        if t.name in entries:
            raise ValueError(f"duplicate tensor name {t.name!r}")
        nbytes = t.source.nbytes
        if dtype_name(t.burn_dtype) != "QFloat":
            need = math.prod(t.shape) * _element_numpy_dtype(t.burn_dtype).itemsize
            if need != nbytes:
                raise ValueError(f"tensor {t.name!r}: {nbytes} bytes but shape {list(t.shape)} needs {need}")
        start = cursor if unaligned else aligned(cursor)
        entries[t.name] = TensorEntry(t.name, t.burn_dtype, tuple(t.shape), start, start + nbytes, t.param_id)
        cursor = start + nbytes
    meta = encode_metadata(entries, strings, scalars)
    if len(meta) > 0xFFFFFFFF:
        raise ValueError("metadata longer than 4 GiB")
    header_end = HEADER_SIZE + len(meta)
    data_start = header_end if unaligned else aligned(header_end)
    layout = Layout({n: (e.start, e.end) for n, e in entries.items()}, meta, data_start, data_start + cursor)
    return layout, entries


def write_burnpack(
    path: str | os.PathLike,
    tensors: Iterable[PackTensor],
    metadata: dict[str, str] | None = None,
    scalars: dict[str, Scalar] | None = None,
    *,
    unaligned: bool = False,
    version: int = VERSION,
    progress=None,
) -> int:
    """Write a burnpack file atomically, tensor by tensor, in the order given. Returns its size.

    ``progress``, when given, is called with the byte count of each tensor after it is written.
    """
    tensors = list(tensors)
    metadata, scalars = metadata or {}, scalars or {}
    layout, _ = plan_layout(tensors, metadata, scalars, unaligned)
    with atomic_write(path) as out:
        out.write(MAGIC + struct.pack("<HI", version, len(layout.metadata)) + layout.metadata)
        position = HEADER_SIZE + len(layout.metadata)

        def pad(i: int, _ref: TensorRef) -> None:
            start, _ = layout.offsets[tensors[i].name]
            out.write(b"\0" * (layout.data_start + start - position))

        def done(i: int, _ref: TensorRef, stream) -> None:
            nonlocal position
            t = tensors[i]
            start, end = layout.offsets[t.name]
            if stream.nbytes != end - start:
                raise ValueError(f"tensor {t.name!r} produced {stream.nbytes} bytes, expected {end - start}")
            position = layout.data_start + end
            if progress is not None:
                progress(end - start)

        from statekit.stream import write_all  # writing only: a header-only read never loads it

        write_all(out, [t.source for t in tensors], before=pad, after=done)
        if not tensors:
            out.write(b"\0" * (layout.data_start - position))
    return layout.file_size


def copy_burnpack(src: BurnpackFile, dst: str | os.PathLike, progress=None) -> int:
    """Rewrite an opened burnpack file with burn's writer rules (byte-identical for burn's files)."""
    tensors = [
        PackTensor(n, src.stored_tensor(n), src.tensors[n].burn_dtype, src.tensors[n].param_id)
        for n in src.data_order
    ]
    return write_burnpack(
        dst,
        tensors,
        src.metadata,
        src.scalars,
        unaligned=src.layout == "0.19-unaligned",
        version=src.version,
        progress=progress,
    )
