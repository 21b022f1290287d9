"""burn's ParamId: a u64 written in decimal in burnpack names, displayed as 13 base32hex characters.

The display form (``Display`` in burn, and the key of legacy records) is RFC 4648 *base32hex*
(``0-9a-v``), lower case, unpadded, of the id's 8 little-endian bytes:
``18402649998147242804`` ⇄ ``6j5mg0dcb1hvu``. Older burn ids were 6 bytes (10 characters); they are
zero-extended, as burn does.
"""

from __future__ import annotations

import base64
import binascii
import re

U64_MAX = (1 << 64) - 1
_DISPLAY = re.compile(r"^[0-9a-vA-V]{10}$|^[0-9a-vA-V]{13}$")
_BASE32 = re.compile(r"^[0-9a-vA-V]+$")
_LENGTHS = (0, 2, 4, 5, 7)  # unpadded base32 lengths mod 8 that hold whole bytes


_DIGITS = "0123456789abcdefghijklmnopqrstuv"
_PAIRS = [a + b for a in _DIGITS for b in _DIGITS]  # 10 bits → two base32hex digits


def to_display(value: int) -> str:
    """The 13-character string burn displays for a ParamId.

    ``base64.b32hexencode(value.to_bytes(8, "little"))`` lower-cased without padding, computed on
    the integer (base64's encoder is a Python loop: 30 ms for 10,000 ids): the 8 bytes read big-end
    first, padded with one zero bit to 65, are 13 digits of 5 bits.
    """
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"ParamId {value} is not a u64")
    n = int.from_bytes(value.to_bytes(8, "little"), "big") << 1
    pairs = _PAIRS
    return (pairs[n >> 55] + pairs[(n >> 45) & 1023] + pairs[(n >> 35) & 1023] + pairs[(n >> 25) & 1023]
            + pairs[(n >> 15) & 1023] + pairs[(n >> 5) & 1023] + _DIGITS[n & 31])


def from_base32(text: str) -> int:
    """Decode any unpadded base32hex ParamId string as burn's ``ParamId`` parser does.

    burn accepts every canonical ``BASE32_DNSSEC`` string (any case, zero trailing bits) of at most
    8 bytes and zero-extends shorter values (older ids were 6 bytes: 10 characters).
    """
    if not _BASE32.fullmatch(text) or len(text) % 8 not in _LENGTHS or len(text) * 5 // 8 > 8:
        raise ValueError(f"{text!r} is not a burn ParamId string (13 base32hex characters)")
    try:
        raw = base64.b32hexdecode(text.upper() + "=" * (-len(text) % 8))
    except binascii.Error as exc:
        raise ValueError(f"{text!r} is not a burn ParamId string: {exc}") from None
    if base64.b32hexencode(raw).decode().rstrip("=").lower() != text.lower():
        raise ValueError(f"{text!r} is not a canonical burn ParamId string (trailing bits set)")
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


def from_display(text: str) -> int:
    """Decode burn's base32hex display form (10 or 13 characters, any case) to the u64."""
    if not _DISPLAY.match(text):
        raise ValueError(f"{text!r} is not a burn ParamId string (13 base32hex characters)")
    return from_base32(text)


def parse(text: str | int) -> int:
    """Accept either spelling a user may type: decimal u64 or the 13-character display form.

    A 13-character all-digit string is ambiguous in principle; decimal wins when it is a valid
    u64 of that length, since burnpack names use decimal.
    """
    if isinstance(text, int):
        if not 0 <= text <= U64_MAX:
            raise ValueError(f"ParamId {text} is not a u64")
        return text
    text = text.strip()
    if text.isdigit():
        value = int(text)
        if value > U64_MAX:
            raise ValueError(f"{text} is larger than a u64 ParamId")
        return value
    return from_display(text)


def is_decimal_id(text: str) -> bool:
    """True when ``text`` is how burnpack spells an id: a decimal u64 without sign or padding."""
    return text.isdigit() and (text == "0" or not text.startswith("0")) and int(text) <= U64_MAX


def generated(path: str) -> int:
    """A stable ParamId for a path that has none (the same path always gets the same id)."""
    import hashlib  # here: 2.5 ms of start-up that only a path's derived id needs

    try:
        raw = path.encode()
    except UnicodeEncodeError as exc:  # a name from bytes that are no UTF-8 (a command-line argument)
        from statekit.errors import MappingError

        raise MappingError(f"parameter path {path!r} holds a lone surrogate ({path[exc.start]!r} at {exc.start}) "
                           "and cannot be written as UTF-8") from None
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
