"""The CBOR subset burnpack metadata uses, encoded exactly as burn's ciborium 0.2 does.

Encoding rules (``shared/docs/burn-formats.md`` §1.2): definite lengths only, shortest integer
heads, floats in the shortest width that holds the value exactly (half, single, double), text keys,
maps in the order given (the caller sorts ``BTreeMap``s bytewise). The decoder is strict and
bounded: a nesting limit (burn's 128), lengths checked against the bytes that remain before
anything is allocated, and no tags.
"""

from __future__ import annotations

import math
import struct

from statekit.formats import limits

MAX_DEPTH = 128


class CborError(ValueError):
    """Malformed or unsupported CBOR, with the byte offset where it was found."""


# --------------------------------------------------------------------------- encoding


def _head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([(major << 5) | value])
    for extra, size, fmt in ((24, 1, ">B"), (25, 2, ">H"), (26, 4, ">I"), (27, 8, ">Q")):
        if value < (1 << (8 * size)):
            return bytes([(major << 5) | extra]) + struct.pack(fmt, value)
    raise CborError(f"integer {value} does not fit CBOR's 64-bit head")


def _float(value: float) -> bytes:
    """Shortest lossless width, as ciborium picks it (half, then single, then double)."""
    if math.isnan(value):
        bits = struct.unpack(">Q", struct.pack(">d", value))[0]
        if bits & ((1 << 42) - 1) == 0:  # payload fits a half: 52-bit mantissa, low 42 bits zero
            half = ((bits >> 48) & 0x8000) | 0x7C00 | ((bits >> 42) & 0x3FF)
            return b"\xf9" + struct.pack(">H", half)
        if bits & ((1 << 29) - 1) == 0:
            return b"\xfa" + struct.pack(">f", value)
        return b"\xfb" + struct.pack(">d", value)
    try:
        half = struct.pack(">e", value)
        if struct.unpack(">e", half)[0] == value or math.isinf(value):
            if math.copysign(1.0, struct.unpack(">e", half)[0]) == math.copysign(1.0, value):
                return b"\xf9" + half
    except OverflowError:
        pass
    try:
        single = struct.pack(">f", value)
        if struct.unpack(">f", single)[0] == value:
            return b"\xfa" + single
    except OverflowError:
        pass
    return b"\xfb" + struct.pack(">d", value)


def encode(value: object) -> bytes:
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: object, out: bytearray) -> None:
    if value is None:
        out += b"\xf6"
    elif value is True:
        out += b"\xf5"
    elif value is False:
        out += b"\xf4"
    elif isinstance(value, int):
        out += _head(0, value) if value >= 0 else _head(1, -1 - value)
    elif isinstance(value, float):
        out += _float(value)
    elif isinstance(value, str):
        raw = limits.utf8(value)
        out += _head(3, len(raw)) + raw
    elif isinstance(value, bytes | bytearray):
        out += _head(2, len(value)) + bytes(value)
    elif isinstance(value, list | tuple):
        out += _head(4, len(value))
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        out += _head(5, len(value))
        for key, item in value.items():
            _encode(key, out)
            _encode(item, out)
    else:
        raise CborError(f"cannot encode {type(value).__name__} in burnpack metadata")


# --------------------------------------------------------------------------- decoding


class _Decoder:
    def __init__(self, data: bytes | memoryview, max_depth: int, max_items: int | None):
        self.data = data
        self.pos = 0
        self.max_depth = max_depth
        self.max_items = max_items

    def length(self, arg: int, start: int) -> None:
        if self.max_items is not None and arg > self.max_items:
            raise CborError(f"a list or map of {arg} items at byte {start} exceeds the limit of {self.max_items}")

    def need(self, n: int) -> None:
        if n > len(self.data) - self.pos:
            raise CborError(f"CBOR ends early at byte {self.pos}: needs {n} more bytes")

    def take(self, n: int) -> bytes:
        self.need(n)
        chunk = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return chunk

    def argument(self, info: int) -> int:
        if info < 24:
            return info
        sizes = {24: 1, 25: 2, 26: 4, 27: 8}
        if info not in sizes:
            raise CborError(f"indefinite length or reserved value at byte {self.pos - 1}")
        return int.from_bytes(self.take(sizes[info]), "big")

    def item(self, depth: int) -> object:
        if depth > self.max_depth:
            raise CborError(f"CBOR nesting deeper than {self.max_depth} levels")
        start = self.pos
        initial = self.take(1)[0]
        major, info = initial >> 5, initial & 0x1F
        if major == 7:
            return self.simple(info, start)
        arg = self.argument(info)
        if major == 0:
            return arg
        if major == 1:
            return -1 - arg
        if major in (2, 3):
            raw = self.take(arg)
            if major == 2:
                return raw
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CborError(f"invalid UTF-8 text at byte {start}") from None
        if major == 4:
            self.length(arg, start)
            self.need(arg)  # every item takes at least one byte
            return [self.item(depth + 1) for _ in range(arg)]
        if major == 5:
            self.length(arg, start)
            self.need(2 * arg)
            result: dict = {}
            for _ in range(arg):
                key = self.item(depth + 1)
                if isinstance(key, list | dict):
                    raise CborError(f"unsupported map key type at byte {start}")
                result[key] = self.item(depth + 1)
            return result
        raise CborError(f"CBOR tags are not used by burnpack (tag at byte {start})")

    def simple(self, info: int, start: int) -> object:
        if info == 20:
            return False
        if info == 21:
            return True
        if info in (22, 23):
            return None
        if info == 25:
            return struct.unpack(">e", self.take(2))[0]
        if info == 26:
            return struct.unpack(">f", self.take(4))[0]
        if info == 27:
            return struct.unpack(">d", self.take(8))[0]
        raise CborError(f"unsupported CBOR simple value {info} at byte {start}")


def decode(data: bytes | memoryview, max_depth: int = MAX_DEPTH, max_items: int | None = None) -> object:
    """Decode exactly one CBOR item that fills ``data`` (lists and maps of at most ``max_items``)."""
    dec = _Decoder(data, max_depth, max_items)
    value = dec.item(1)
    if dec.pos != len(data):
        raise CborError(f"{len(data) - dec.pos} unexpected bytes after the CBOR item")
    return value
