"""Open any supported file as a :class:`~statekit.state.Checkpoint`, by content, not extension.

Each format registers a sniffer and an opener in :data:`READERS`; the first sniffer that claims
the file's leading bytes wins. Readers are imported only when used, so ``statekit --help`` loads
neither torch nor any format it does not need.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from statekit.errors import FormatError
from statekit.state import Checkpoint

SNIFF_BYTES = 64


@dataclass(frozen=True)
class Reader:
    name: str
    sniff: Callable[[bytes, str], bool]
    module: str  # module with ``open_checkpoint(path, **options) -> Checkpoint``


def _burnpack(head: bytes, path: str) -> bool:
    return head[:4] == b"NRUB"


def _zip_or_pickle(head: bytes, path: str) -> bool:
    return head[:4] == b"PK\x03\x04" or head[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05") or (
        len(head) > 262 and head[257:262] == b"ustar"
    )


def _legacy(head: bytes, path: str) -> bool:
    if head[:2] == b"\x1f\x8b":
        return not path.endswith(".safetensors")
    if head[:10] == b"\x83\xa8metadata":
        return True
    # bincode records start with the FloatElem type name (half precision: "half::binary16::f16")
    floats = (b"f32", b"f16", b"f64", b"bf16", b"half::binary16::f16", b"half::bfloat::bf16")
    return bool(head) and head[1 : 1 + head[0]] in floats


def _safetensors(head: bytes, path: str) -> bool:
    return len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100 * 1024 * 1024


READERS: tuple[Reader, ...] = (
    Reader("burnpack", _burnpack, "statekit.frameworks.burn_io"),
    Reader("safetensors", _safetensors, "statekit.frameworks.safetensors_io"),
    Reader("burn-legacy", _legacy, "statekit.frameworks.burn_legacy_io"),
    Reader("torch", _zip_or_pickle, "statekit.frameworks.torch_io"),
    Reader("dcp", lambda head, path: False, "statekit.frameworks.dcp_io"),  # directories: see sniff
)


def _dcp_directory(path: str) -> str | None:
    """The DCP checkpoint directory ``path`` is, or is a data/metadata file of; None otherwise."""
    if os.path.isdir(path):
        return path if os.path.isfile(os.path.join(path, ".metadata")) else None
    parent = os.path.dirname(os.path.abspath(path))
    if (path.endswith(".distcp") or os.path.basename(path) == ".metadata") and os.path.isfile(
            os.path.join(parent, ".metadata")):
        return parent
    return None


def sniff(path: str | os.PathLike) -> str:
    """The name of the format whose reader claims ``path``; FormatError when none does."""
    path = os.fspath(path)
    if _dcp_directory(path) is not None:
        return "dcp"
    if os.path.isdir(path):
        raise FormatError("is a directory, but not a torch.distributed checkpoint (no .metadata file in it)", path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError as exc:
        raise FormatError(f"cannot open: {exc.strerror}", path) from None
    for reader in READERS:
        if reader.sniff(head, path):
            return reader.name
    if not head:
        raise FormatError("file is empty", path)
    raise FormatError(
        f"unrecognised file format (starts with {head[:8].hex(' ')}); statekit reads burnpack .bpk, "
        "PyTorch .pt, burn .mpk/.bin records and safetensors",
        path,
    )


def reader_for(name: str) -> Reader:
    for reader in READERS:
        if reader.name == name:
            return reader
    raise KeyError(name)


def open_checkpoint(path: str | os.PathLike, **options) -> Checkpoint:
    """Open ``path`` with the reader its content asks for. Tensor data stays on disk until used."""
    name = sniff(path)
    module = importlib.import_module(reader_for(name).module)
    if name == "dcp":
        path = _dcp_directory(os.fspath(path))
    return module.open_checkpoint(os.fspath(path), **options)
