"""PyTorch ``.pt`` files (``torch.save``): the zip container, the pre-1.6 legacy stream, sniffing.

**Zip format** (torch ≥ 1.6, the default): an uncompressed zip whose entries all sit under one
top-level folder (the file stem when torch wrote a path, ``archive`` for a file object; any name
is accepted)::

    <stem>/data.pkl                  the object, pickled with protocol 2 (see torch_pickle)
    <stem>/.format_version           b"1"
    <stem>/.storage_alignment        b"64"
    <stem>/byteorder                 b"little" (or b"big"; missing means little)
    <stem>/data/<key>                raw bytes of storage <key> ("0", "1", ... in pickling order)
    <stem>/version                   b"3\\n"
    <stem>/.data/serialization_id    40 ASCII digits (an identifier torch logs; never checked)

torch's writer (miniz) puts every entry's bytes on a 64-byte boundary by padding the local
header's extra field with an ``FB`` record of ``Z`` bytes, marks entries with bit 3 (sizes and
CRC in a data descriptor after the bytes, none for empty entries) and bit 11 (UTF-8 names), and
switches to zip64 records past 4 GiB or 65535 entries.

**Legacy format** (``_use_new_zipfile_serialization=False``): five pickles back to back, then
raw storages: the magic number 0x1950a86a20f9469cfc6c, the protocol version 1001, a sys_info dict
(``little_endian``, type sizes), the object (persistent ids carry a sixth element, a storage
view or None), and the sorted list of storage keys. Then, for each key, an int64 element count
followed by that many elements, both little-endian whatever sys_info says (torch swaps on
big-endian machines).

The even older tar format (torch < 0.4: members ``sys_info``, ``pickle``, ``storages``,
``tensors``) is recognised and refused.

Opening a file memory-maps it and reads the pickles only; tensor bytes are sliced from the map
when a TensorRef is asked for its values. Nothing here knows about optimizers.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from typing import BinaryIO

from statekit import dtypes
from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError
from statekit.formats import limits, torch_pickle
from statekit.formats.torch_pickle import Storage, StorageId
from statekit.stream import PieceStream, ordered
from statekit.tensor import FileSpan, SourceFile, TensorRef

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL_VERSION = 1001
ALIGNMENT = 64
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record
_LOCATOR64 = struct.Struct("<IIQI")  # zip64 end of central directory locator
_END = struct.Struct("<IHHHHIIH")
_ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets at or above this need zip64 records
_ZIP64_COUNT_LIMIT = 0xFFFF  # as do this many entries


# --------------------------------------------------------------------------------------------
# sniffing


def sniff_pt(path: str | os.PathLike) -> str | None:
    """Which torch.save format ``path`` holds: ``"zip"``, ``"legacy"``, ``"tar"``, or None."""
    try:
        head = _head(path)
        if head.startswith(ZIP_MAGIC):
            _zip_records(path)
            return "zip"
    except FormatError:
        return None
    if _is_legacy(head):
        return "legacy"
    return "tar" if _is_torch_tar(path) else None


def claims(head: bytes, path: str) -> bool:
    """Sniffer (from the first bytes only): a zip archive, a pickle, or a tar (legacy torch.save)."""
    pickle = head[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05")
    return head[:4] == ZIP_MAGIC or pickle or (len(head) > 262 and head[257:262] == b"ustar")


def is_pt(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file written by ``torch.save`` (zip, legacy or tar format)."""
    return sniff_pt(path) is not None


def _head(path: str | os.PathLike) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(64)
    except OSError as exc:
        raise FormatError(f"cannot read file: {exc.strerror}") from None


def _is_legacy(head: bytes) -> bool:
    """Whether the file starts with a pickle of the legacy magic number (any protocol)."""
    try:
        return head[:1] == b"\x80" and torch_pickle.loads(head)[0] == LEGACY_MAGIC_NUMBER
    except FormatError:
        return False


def _is_torch_tar(path: str | os.PathLike) -> bool:
    try:
        with tarfile.open(path, "r:") as tar:
            return {"pickle", "storages"} <= set(tar.getnames())
    except (OSError, tarfile.TarError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# loading


def load_pt(path: str | os.PathLike, extra_globals: dict | None = None) -> object:
    """The object ``torch.save`` stored in ``path``, with tensors as lazy TensorRefs.

    Tensors carry ``info`` = {torch_dtype, parameter, requires_grad, device, storage_key,
    storage_offset, stride[, python_state]}; dicts (also OrderedDicts) keep their order, tuples
    stay tuples. Any problem with the file raises FormatError (UnsafePickleError for a global
    outside the allow-list) naming ``path``.
    """
    try:
        head = _head(path)
        if head.startswith(ZIP_MAGIC):
            return _load_zip(path, extra_globals)
        if _is_legacy(head):
            return _load_legacy(_map(path), extra_globals)
        if _is_torch_tar(path):
            raise FormatError(
                "this is PyTorch's pre-1.0 tar format (torch < 0.4), which statekit does not read; "
                "re-save it with a current torch.save"
            )
        raise FormatError("not a PyTorch file: no zip signature and no legacy torch.save magic number")
    except FormatError as exc:
        if exc.path is None:
            exc.path = os.fspath(path)
        raise


def _map(path: str | os.PathLike) -> mmap.mmap:
    with open(path, "rb") as fh:
        try:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise FormatError("file is empty") from None


def _zip_records(path: str | os.PathLike | BinaryIO) -> dict[str, zipfile.ZipInfo]:
    """Entries by name inside the archive folder (the first entry's folder, as torch takes it)."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError,
            struct.error) as exc:  # NotImplementedError: a "version needed" zipfile does not know
        raise FormatError(f"damaged zip archive: {exc}") from None
    prefix = entries[0].filename.split("/", 1)[0] + "/" if entries and "/" in entries[0].filename else "?"
    records = {info.filename[len(prefix) :]: info for info in entries if info.filename.startswith(prefix)}
    if "data.pkl" not in records:
        names = [info.filename for info in entries[:3]]
        raise FormatError(
            f"zip archive has no <folder>/data.pkl entry (first entries: {names}): not a torch.save file"
        )
    return records


def _load_zip(path: str | os.PathLike, extra_globals: dict | None = None) -> object:
    # tensor bytes are read from the file with pread
    return _load_zip_buffer(_map(path), _zip_records(path), SourceFile.open(os.fspath(path)), 0, extra_globals)


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (zipfile reads a region without copying it)."""

    def __init__(self, view: memoryview):
        self.view = view
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        data = self.view[self.pos : self.pos + len(buffer)]
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def load_pt_region(buffer: mmap.mmap | memoryview, offset: int, length: int, source: SourceFile,
                   extra_globals: dict | None = None) -> object:
    """The object a ``torch.save`` zip archive lying at ``buffer[offset:offset + length]`` holds.

    DCP's ``.distcp`` files hold such archives back to back. ``source`` is the same file, from
    which tensor bytes are read with pread; any problem raises FormatError (the caller names the
    file).
    """
    if offset < 0 or length <= 0 or offset + length > len(buffer):
        raise FormatError(f"byte range [{offset}, {offset + length}) lies outside the file ({len(buffer)} bytes)")
    view = memoryview(buffer)[offset : offset + length]
    if bytes(view[:4]) != ZIP_MAGIC:
        raise FormatError(f"no torch.save archive at offset {offset} (starts with {bytes(view[:4]).hex(' ')})")
    return _load_zip_buffer(view, _zip_records(_ViewFile(view)), source, offset, extra_globals)


def _load_zip_buffer(buffer: mmap.mmap | memoryview, records: dict[str, zipfile.ZipInfo], source: SourceFile,
                     base: int, extra_globals: dict | None = None) -> object:
    """The archive's object; ``buffer`` holds the archive, which starts at ``base`` in ``source``."""
    byteorder = _entry_bytes(buffer, records["byteorder"]).tobytes() if "byteorder" in records else b"little"
    if byteorder not in (b"little", b"big"):
        raise FormatError(f"unknown byteorder record {byteorder[:20]!r}")
    storages: dict[str, Storage] = {}

    def load_storage(sid: StorageId) -> Storage:
        if sid.key in storages:
            return _same_storage(storages[sid.key], sid)
        info = records.get(f"data/{sid.key}")
        if info is None:
            raise FormatError(f"data.pkl refers to storage '{sid.key}', but data/{sid.key} is missing")
        if info.file_size != sid.nbytes:
            raise FormatError(
                f"storage '{sid.key}' should hold {sid.numel} {sid.dtype} elements ({sid.nbytes} bytes), "
                f"but data/{sid.key} holds {info.file_size} bytes"
            )
        data = _entry_bytes(buffer, info, source, base)
        storage = Storage(sid, lambda: data, big_endian=byteorder == b"big")
        storage.span = FileSpan(source, base + _entry_start(buffer, info, source, base), info.file_size)
        storages[sid.key] = storage
        return storage

    info = records["data.pkl"]
    _entry_bytes(buffer, info, source, base)  # (its checks; the map's pages are not touched)
    # read, not copied from the map: its pages would stay resident beside the copy while the pickle is read
    pkl = FileSpan(source, base + _entry_start(buffer, info, source, base), info.file_size).read()
    obj, _ = torch_pickle.loads(pkl, 0, load_storage, extra_globals)
    return obj


def _local_header(buffer: mmap.mmap, offset: int, source: SourceFile | None, base: int) -> tuple:
    """The local header at ``offset``: read with pread from ``source`` when given. Reading it from the
    map would map (and count in the resident set) the page-cache folios around it, up to megabytes
    each: for a cached file with hundreds of entries, most of the file."""
    if source is None:
        return _LOCAL_HEADER.unpack_from(buffer, offset)
    return _LOCAL_HEADER.unpack(source.pread(base + offset, _LOCAL_HEADER.size).ljust(_LOCAL_HEADER.size, b"\0"))


def _entry_start(buffer: mmap.mmap, info: zipfile.ZipInfo, source: SourceFile | None = None, base: int = 0) -> int:
    """Where an entry's bytes start in the file (after its local header; checked by _entry_bytes)."""
    *_, name_length, extra_length = _local_header(buffer, info.header_offset, source, base)
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _entry_bytes(buffer: mmap.mmap, info: zipfile.ZipInfo, source: SourceFile | None = None,
                 base: int = 0) -> memoryview:
    """The stored bytes of one entry, sliced from the map (not read)."""
    name = info.filename
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise FormatError(
            f"zip entry {name} is compressed (method {info.compress_type}); torch.save stores entries"
        )
    if info.flag_bits & 0x1:
        raise FormatError(f"zip entry {name} is encrypted")
    offset = info.header_offset
    if offset < 0:
        raise FormatError(f"zip entry {name}: local header offset {offset} lies before the start of the file")
    if offset + _LOCAL_HEADER.size > len(buffer):
        raise FormatError(f"zip entry {name}: local header lies past the end of the file")
    signature, *_, name_length, extra_length = _local_header(buffer, offset, source, base)
    if signature != 0x04034B50:
        raise FormatError(f"zip entry {name}: no local header at offset {offset}")
    start = offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > len(buffer):
        raise FormatError(
            f"zip entry {name} is truncated: needs {start + info.file_size} bytes, file has {len(buffer)}"
        )
    return memoryview(buffer)[start : start + info.file_size]


def _same_storage(storage: Storage, sid: StorageId) -> Storage:
    if storage.dtype != sid.dtype or storage.nbytes != sid.nbytes:
        raise FormatError(f"storage '{sid.key}' is referenced with different dtypes or sizes")
    return storage


def _load_legacy(buffer: mmap.mmap, extra_globals: dict | None = None) -> object:
    pos = 0
    for expected, what in (
        (LEGACY_MAGIC_NUMBER, "magic number"),
        (LEGACY_PROTOCOL_VERSION, "protocol version"),
    ):
        value, pos = torch_pickle.loads(buffer, pos)
        if value != expected:
            raise FormatError(f"legacy torch.save file has {what} {limits.short(value)}, expected {expected!r}")
    _sys_info, pos = torch_pickle.loads(buffer, pos)  # informational: storages are always little-endian
    roots: dict[str, StorageId] = {}
    data: dict[str, memoryview] = {}
    storages: dict[tuple, Storage] = {}

    def load_storage(sid: StorageId) -> Storage:
        root = roots.setdefault(sid.key, sid)
        if (root.dtype, root.numel) != (sid.dtype, sid.numel):
            raise FormatError(f"storage '{sid.key}' is referenced with different dtypes or sizes")
        start, numel, key = _legacy_view(sid)
        if (key, start) not in storages:
            lo, hi = start * sid.itemsize, (start + numel) * sid.itemsize
            view = StorageId(key, sid.dtype, numel, sid.location, None)
            storages[key, start] = Storage(view, lambda: data[sid.key][lo:hi])
        return storages[key, start]

    obj, pos = torch_pickle.loads(buffer, pos, load_storage, extra_globals)
    keys, pos = torch_pickle.loads(buffer, pos)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or set(keys) != set(roots):
        raise FormatError(f"legacy storage list {limits.short(keys)} does not match the storages the pickle uses")
    for key in keys:
        data[key], pos = _legacy_storage(buffer, pos, roots[key])
    return obj


def _legacy_view(sid: StorageId) -> tuple[int, int, str]:
    """(first element, element count, key) of the storage a legacy persistent id refers to."""
    if sid.view is None:
        return 0, sid.numel, sid.key
    if not isinstance(sid.view, tuple) or len(sid.view) != 3:
        raise FormatError(f"malformed legacy storage view {limits.short(sid.view)}")
    view_key, offset, numel = sid.view
    if not isinstance(view_key, str) or type(offset) is not int or type(numel) is not int:
        raise FormatError(f"malformed legacy storage view {limits.short(sid.view)}")
    if offset < 0 or numel < 0 or offset + numel > sid.numel:
        raise FormatError(f"storage view {view_key} [{offset}, +{numel}) lies outside storage '{sid.key}'")
    return offset, numel, view_key


def _legacy_storage(buffer: mmap.mmap, pos: int, sid: StorageId) -> tuple[memoryview, int]:
    """One legacy storage record at ``pos``: int64 element count, then the elements."""
    if pos + 8 > len(buffer):
        raise FormatError(f"legacy storage '{sid.key}' is missing: file ends at {len(buffer)}")
    (numel,) = struct.unpack_from("<q", buffer, pos)
    if numel != sid.numel:
        raise FormatError(f"legacy storage '{sid.key}' holds {numel} elements, the pickle says {sid.numel}")
    start, end = pos + 8, pos + 8 + sid.nbytes
    if end > len(buffer):
        raise FormatError(
            f"legacy storage '{sid.key}' is truncated: needs {end} bytes, file has {len(buffer)}"
        )
    return memoryview(buffer)[start:end], end


# --------------------------------------------------------------------------------------------
# saving


def save_pt(obj: object, path: str | os.PathLike) -> None:
    """Write ``obj`` to ``path`` in torch.save's zip format, atomically.

    ``obj`` nests dict/list/tuple and Python scalars/str/None with TensorRefs or numpy arrays
    (see :func:`torch_pickle.dumps`); each tensor gets its own storage. The file loads with
    ``torch.load(path, weights_only=True)``, with or without ``mmap=True``.
    """
    with atomic_write(path) as fh:
        write_pt_stream(fh, obj, _archive_name(path))


WRITE_PIECE = 4 << 20  # bytes per piece a tensor is computed in on its way out: with the staging
# blocks (statekit.atomic) and the tensors read ahead (stream.ordered, a few pieces per worker), what
# writing holds, whatever the checkpoint's size (16 MiB pieces held ~100 MiB more in flight)


def write_pt_stream(fh: BinaryIO, obj: object, folder: str = "archive", dumps=None) -> int:
    """Write ``obj`` as one torch.save zip archive at ``fh``'s position; returns its length.

    Offsets inside the archive count from where it starts, as when torch.save writes to a stream
    (DCP writes its chunks this way, back to back in one file). Tensor bytes are streamed.
    ``dumps``: the pickler (default :func:`torch_pickle.dumps`; one that knows more classes, as
    Megatron's common state needs).
    """
    pickled, tensors = (dumps or torch_pickle.dumps)(obj)
    writer = _ZipWriter(fh, folder)
    writer.add("data.pkl", pickled)
    writer.add(".format_version", b"1")
    writer.add(".storage_alignment", str(ALIGNMENT).encode())
    writer.add("byteorder", b"little")
    sizes = [_tensor_size(tensor) for tensor in tensors]
    for key, (_, stream) in enumerate(ordered(tensors, crc=True, out=fh, piece=WRITE_PIECE)):
        writer.add(f"data/{key}", sizes[key], stream)
    writer.add("version", b"3\n")
    writer.add(".data/serialization_id", writer.serialization_id())
    writer.finish()
    return writer.pos


def _archive_name(path: str | os.PathLike) -> str:
    """torch's folder name: the file name without its last extension; "archive" if that is empty or
    the path is not ASCII (torch.save then writes through a Python stream, which names it so)."""
    path = os.fspath(path)
    if not path.isascii():  # a name in UTF-8 or bytes that are none (a lone surrogate here): as torch
        return "archive"
    name = os.path.basename(path)
    return (name.rsplit(".", 1)[0] if "." in name else name) or "archive"


def _tensor_size(tensor: TensorRef) -> int:
    expected = tensor.numel * dtypes.itemsize(tensor.dtype)
    if tensor.nbytes != expected:
        raise MappingError(
            f"a {tensor.dtype} tensor of shape {list(tensor.shape)} has {tensor.nbytes} bytes, not {expected}"
        )
    return expected


class _ZipWriter:
    """Writes stored entries laid out as torch's miniz writer does (see the module docstring)."""

    def __init__(self, fh: BinaryIO, prefix: str):
        self.fh = fh
        self.prefix = prefix
        self.pos = 0
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, header offset

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.pos += len(data)

    def add(self, name: str, data: bytes | memoryview | int, pieces: Iterable | None = None) -> None:
        """Add an entry: ``data`` bytes, or its size with ``pieces`` streaming the bytes (CRC on the go)."""
        raw_name = f"{self.prefix}/{name}".encode()
        if pieces is None:
            size, pieces = len(data), (data,)
        else:
            size = data
        offset = self.pos
        extra = _zip64_extra(size, offset)
        padding = -(offset + _LOCAL_HEADER.size + len(raw_name) + len(extra) + 4) % ALIGNMENT
        extra += b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = 0x0808 if size else 0x0800
        local_size = 0xFFFFFFFF if size >= _ZIP64_LIMIT else 0
        self.write(
            _LOCAL_HEADER.pack(
                0x04034B50, 0, flags, 0, 0, 0, 0, local_size, local_size, len(raw_name), len(extra)
            )
        )
        self.write(raw_name + extra)
        crc = written = 0
        if isinstance(pieces, PieceStream):  # computes its CRC on the way, writes straight to the file
            pieces.write_to(self.fh)
            written = pieces.nbytes
            self.pos += written
            crc = pieces.crc
        else:
            for piece in pieces:
                self.write(piece)
                crc = zlib.crc32(piece, crc)
                written += len(piece)
        if written != size:
            raise MappingError(f"entry {name} produced {written} bytes, expected {size}")
        if size:
            wide = size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT
            self.write(struct.pack("<IIQQ" if wide else "<IIII", 0x08074B50, crc, size, size))
        self.entries.append((raw_name, crc, size, offset))

    def serialization_id(self) -> bytes:
        """40 digits: a hash of the record names, then one of their CRCs (as torch composes it)."""
        names = hashlib.sha256(b"\0".join(e[0] for e in self.entries)).digest()
        crcs = hashlib.sha256(b"".join(struct.pack("<I", e[1]) for e in self.entries)).digest()
        digits = (int.from_bytes(h[:8], "little") % 10**20 for h in (names, crcs))
        return "".join(f"{d:020d}" for d in digits).encode()

    def finish(self) -> None:
        directory_offset = self.pos
        for raw_name, crc, size, offset in self.entries:
            self.write(_central_header(raw_name, crc, size, offset))
        directory_size = self.pos - directory_offset
        count = len(self.entries)
        largest = max(directory_offset, directory_size, *(max(e[2], e[3]) for e in self.entries))
        if count >= _ZIP64_COUNT_LIMIT or largest >= _ZIP64_LIMIT:
            end64 = self.pos
            self.write(
                _END64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, directory_size, directory_offset)
            )
            self.write(_LOCATOR64.pack(0x07064B50, 0, end64, 1))
        small_count = count if count < _ZIP64_COUNT_LIMIT else 0xFFFF
        self.write(
            _END.pack(
                0x06054B50, 0, 0, small_count, small_count, _clip(directory_size), _clip(directory_offset), 0
            )
        )


def _clip(value: int) -> int:
    return value if value < _ZIP64_LIMIT else 0xFFFFFFFF


def _zip64_extra(size: int, offset: int) -> bytes:
    """The zip64 extra field: (uncompressed, compressed) size and offset, each only when too large."""
    fields = [v for v in (size, size, offset) if v >= _ZIP64_LIMIT]
    return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""


def _central_header(raw_name: bytes, crc: int, size: int, offset: int) -> bytes:
    extra = _zip64_extra(size, offset)
    version = 45 if extra else 0
    flags = 0x0808 if size else 0x0800
    header = _CENTRAL_HEADER.pack(
        0x02014B50,
        version,
        version,
        flags,
        0,
        0,
        0,
        crc,
        _clip(size),
        _clip(size),
        len(raw_name),
        len(extra),
        0,
        0,
        0,
        0,
        _clip(offset),
    )
    return header + raw_name + extra
