"""A bounds-checked reader for bincode 2 ``config::standard()`` data (what burn ≤ 0.21 wrote).

Only the primitives burn's records need, as serde drives bincode 2:

- unsigned integers: varint — one byte below 251, else a marker ``FB``/``FC``/``FD``/``FE`` followed by
  a little-endian u16/u32/u64/u128; signed integers are zig-zag encoded first;
- ``bool``/``Option`` tag: one byte 0/1; enum variant index: varint u32;
- ``f32``/``f64``: raw little-endian;
- strings, byte strings and sequences: varint length, then the items.

Every length is checked against the bytes that remain *before* anything is sliced or allocated, so a
claimed 4 GB length in a small file fails at once. Slices are zero-copy ``memoryview``\\ s of the input.
Errors are :class:`BincodeError` (carrying the offset); callers turn them into ``FormatError``.
"""

from __future__ import annotations

import struct

from statekit.formats import limits

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class BincodeError(ValueError):
    """The bytes are not the bincode value the caller asked for (``offset`` = where it failed)."""

    def __init__(self, message: str, offset: int):
        super().__init__(f"{message} (at byte {offset})")
        self.offset = offset


class BincodeReader:
    """Sequential reader over a buffer; ``pos`` is the next unread byte."""

    def __init__(self, data: bytes | bytearray | memoryview, pos: int = 0):
        self.buf = memoryview(data).cast("B")
        self.pos = pos

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def at_end(self) -> bool:
        return self.pos == len(self.buf)

    def fail(self, message: str) -> BincodeError:
        return BincodeError(message, self.pos)

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes as a zero-copy slice (checked before slicing)."""
        if n < 0 or n > self.remaining:
            raise self.fail(f"needs {n} bytes but only {self.remaining} remain")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def u8(self) -> int:
        if self.remaining < 1:
            raise self.fail("unexpected end of data")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self, limit: int = U64_MAX) -> int:
        """An unsigned varint no larger than ``limit`` (u64 unless told)."""
        marker = self.u8()
        if marker < 251:
            value = marker
        elif marker == 251:
            value = _U16.unpack(self.take(2))[0]
        elif marker == 252:
            value = _U32.unpack(self.take(4))[0]
        elif marker == 253:
            value = _U64.unpack(self.take(8))[0]
        elif marker == 254:
            raw = self.take(16)
            value = int.from_bytes(raw, "little")
        else:
            self.pos -= 1
            raise self.fail("invalid varint marker 0xFF")
        if value > limit:
            raise self.fail(f"integer {value} exceeds {limit}")
        return value

    def u32(self) -> int:
        return self.varint(U32_MAX)

    def length(self, min_item_size: int = 1) -> int:
        """A sequence/byte length, refused if the items could not fit in what remains."""
        start = self.pos
        n = self.varint()
        if n * min_item_size > self.remaining:
            self.pos = start
            raise self.fail(f"claimed length {n} exceeds the {self.remaining} bytes that remain")
        if n > limits.MAX_CONTAINER and min_item_size > 1:
            self.pos = start
            raise self.fail(f"claimed length {n} exceeds the limit of {limits.MAX_CONTAINER} items")
        return n

    def tag(self, what: str = "option") -> bool:
        """An ``Option``/``bool`` tag byte: 0 → False, 1 → True, anything else is an error."""
        b = self.u8()
        if b > 1:
            self.pos -= 1
            raise self.fail(f"invalid {what} tag {b}")
        return b == 1

    def f32(self) -> float:
        return _F32.unpack(self.take(4))[0]

    def f64(self) -> float:
        return _F64.unpack(self.take(8))[0]

    def bytes(self) -> memoryview:
        return self.take(self.length())

    def string(self, max_len: int | None = None) -> str:
        start = self.pos
        n = self.length()
        if max_len is not None and n > max_len:
            self.pos = start
            raise self.fail(f"string length {n} exceeds {max_len}")
        raw = self.take(n)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            self.pos = start
            raise self.fail("string is not valid UTF-8") from None

    def usize_seq(self) -> list[int]:
        n = self.length()
        return [self.varint() for _ in range(n)]
