"""One item of a pickle's container read without running it: its opcodes, their arguments, and
what they compute as a small program (:class:`Segment`), from which :mod:`.template` builds the
code that runs the item and every later one written alike.

A segment starts where a container's items start (after a MARK, or after the segment before)
and ends at the first opcode boundary where it has pushed two objects (a dict's key and value,
or two list items), closed every MARK it opened, the next opcode is the one it started with, and
what follows does not reach back into it (protocol 4 names a global by two strings, then
STACK_GLOBAL: a key and a module's name are not an item).
It may read the memo (entries made before it, or by itself), append to it in order, and build,
call and mutate only what it made itself; anything else — touching the stack below its start, a
memo index out of order, an unknown opcode, more than :data:`MAX_OPS` opcodes — and there is no
segment: the opcode loop reads those bytes as always; nor for fewer than :data:`MIN_OPS`. Nothing
is run here."""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass

from statekit.errors import FormatError
from statekit.formats.torch_pickle.opcodes import _F64, _I32, _U16, _U32, _U64
from statekit.formats.torch_pickle.values import _text

MAX_OPS = 2048  # opcodes in one segment (a tensor call is ~25; an optimizer's per-parameter dict ~100)
MIN_OPS = 6  # fewer (two memo reads, a small int key and value) run as fast in the loop

# argument layouts
(NO_ARG, U8, U16, I32, U32, F64, U64, LEN_U8, LEN_U32, LEN_U64, LEN_I32, LONG_I32, LINES) = range(13)
_MAX_LONG_BYTES = 1024  # LONG4's limit, as the loop's

P = pickle
_LAYOUT = {
    P.FRAME: U64, P.BININT1: U8, P.BININT2: U16, P.BININT: I32, P.LONG1: LEN_U8, P.LONG4: LONG_I32,
    P.BINFLOAT: F64, P.SHORT_BINUNICODE: LEN_U8, P.BINUNICODE: LEN_U32, P.BINUNICODE8: LEN_U64,
    P.SHORT_BINSTRING: LEN_U8, P.BINSTRING: LEN_I32, P.SHORT_BINBYTES: LEN_U8, P.BINBYTES: LEN_U32,
    P.BINBYTES8: LEN_U64, P.BINGET: U8, P.LONG_BINGET: U32, P.BINPUT: U8, P.LONG_BINPUT: U32, P.GLOBAL: LINES,
}
_NO_ARGS = (P.MARK, P.POP, P.POP_MARK, P.DUP, P.NONE, P.NEWTRUE, P.NEWFALSE, P.EMPTY_TUPLE, P.EMPTY_LIST,
            P.EMPTY_DICT, P.EMPTY_SET, P.TUPLE, P.TUPLE1, P.TUPLE2, P.TUPLE3, P.LIST, P.DICT, P.APPEND, P.APPENDS,
            P.SETITEM, P.SETITEMS, P.ADDITEMS, P.MEMOIZE, P.STACK_GLOBAL, P.REDUCE, P.NEWOBJ, P.BUILD,
            P.BINPERSID)
LAYOUT = {**{op[0]: NO_ARG for op in _NO_ARGS}, **{op[0]: kind for op, kind in _LAYOUT.items()}}
_WIDTH = {U8: 1, U16: 2, I32: 4, U32: 4, F64: 8, U64: 8}
_LENGTH = {LEN_U8: (1, None), LEN_U32: (4, _U32), LEN_U64: (8, _U64), LEN_I32: (4, _I32), LONG_I32: (4, _I32)}

# literals: opcode -> how its argument becomes a value ("int", "float", "text", "str", "bytes")
LITERALS = {P.BININT1[0]: "int", P.BININT2[0]: "int", P.BININT[0]: "int", P.LONG1[0]: "long",
            P.LONG4[0]: "long", P.BINFLOAT[0]: "float", P.SHORT_BINUNICODE[0]: "text", P.BINUNICODE[0]: "text",
            P.BINUNICODE8[0]: "text", P.SHORT_BINSTRING[0]: "str", P.BINSTRING[0]: "str",
            P.SHORT_BINBYTES[0]: "bytes", P.BINBYTES[0]: "bytes", P.BINBYTES8[0]: "bytes"}
_CONSTANTS = {P.NONE[0]: None, P.NEWTRUE[0]: True, P.NEWFALSE[0]: False, P.EMPTY_TUPLE[0]: ()}
_FRAME, _PUTS, _GETS = P.FRAME[0], (P.BINPUT[0], P.LONG_BINPUT[0]), (P.BINGET[0], P.LONG_BINGET[0])

# the instructions of a segment's program: (kind, operands...); an instruction's index is the
# node it defines (mutations define none that is read)
LIT, CONST, MEMO, GLOBAL, SGLOBAL, TUPLE, LIST, DICT, SET, APPEND, SETITEMS, ADDITEMS, CALL, PERSID, NEWOBJ, BUILD = (
    range(16))


def arg_end(data, code: int, pos: int, end: int) -> int:
    """Where the argument of opcode ``code`` starting at ``pos`` ends, or -1 where the loop would
    refuse it (truncated, a negative or oversized length, an unterminated GLOBAL line)."""
    kind = LAYOUT.get(code)
    if kind is None:
        return -1
    if kind == NO_ARG:
        return pos
    width = _WIDTH.get(kind)
    if width is not None:
        return pos + width if pos + width <= end else -1
    if kind == LINES:
        nl = data.find(b"\n", pos, pos + 1024)
        nl2 = data.find(b"\n", nl + 1, nl + 1025) if nl >= 0 else -1
        return nl2 + 1 if nl2 >= 0 else -1
    width, fmt = _LENGTH[kind]
    if pos + width > end:
        return -1
    n = data[pos] if fmt is None else fmt.unpack_from(data, pos)[0]
    if n < 0 or (kind == LONG_I32 and n > _MAX_LONG_BYTES):
        return -1
    return pos + width + n if pos + width + n <= end else -1


def literal(code: int, raw: bytes) -> object:
    """The value a literal opcode pushes from its argument bytes ``raw`` (length prefix included),
    as the loop decodes it; raises what the loop raises (text with a lone surrogate, bad UTF-8)."""
    kind = LITERALS[code]
    if kind == "int":
        return raw[0] if len(raw) == 1 else _U16.unpack(raw)[0] if len(raw) == 2 else _I32.unpack(raw)[0]
    if kind == "float":
        return _F64.unpack(raw)[0]
    width = _LENGTH[LAYOUT[code]][0]
    payload = raw[width:]
    if kind == "long":
        return int.from_bytes(payload, "little", signed=True)
    if kind == "text":
        return _text(payload)
    if kind == "str":
        return payload.decode("utf-8")
    return payload


@dataclass
class Segment:
    """One item's opcodes as read at ``start`` (instance one), and its program."""

    start: int
    end: int  # the offset after its last opcode
    ops: list[tuple[int, int, int]]  # (opcode, argument start, argument end), offsets in data
    program: list[tuple]  # instructions, see LIT ... BUILD
    literals: dict[int, int]  # op index -> the LIT node it defines
    puts: list[int]  # the nodes memoized, in order (memo indices n, n + 1, ... for a segment at memo length n)
    put_ops: dict[int, int]  # op index of a BINPUT/LONG_BINPUT -> which put it is
    own_gets: dict[int, int]  # op index of a BINGET/LONG_BINGET of an entry this segment made -> which put
    pushes: list[int]  # the nodes it leaves on the stack (two)
    marks: int  # MARKs open at once, at most
    memo_base: int  # memo length at ``start``: memo reads below it are of entries made before

    @property
    def first(self) -> int:
        return next(code for code, _, _ in self.ops if code != _FRAME)


def next_op(data, pos: int, end: int) -> int:
    """The opcode at ``pos`` past any FRAMEs (they only group bytes), -1 at the end."""
    while pos < end and data[pos] == _FRAME:
        pos += 9
    return data[pos] if pos < end else -1


class _Refused(Exception):
    """No segment here (the loop reads these bytes)."""


class _Below(_Refused):
    """The opcodes take from the stack below where they started."""


def read_segment(data, start: int, memo_length: int, max_ops: int = MAX_OPS) -> Segment | None:
    """The segment at ``start`` of ``data`` (memo length ``memo_length`` there), or None."""
    try:
        return _Reader(data, start, memo_length).read(max_ops)
    except (_Refused, IndexError, struct.error, ValueError, FormatError):  # (a literal the loop refuses)
        return None


class _Reader:
    def __init__(self, data, start: int, memo_length: int):
        self.data, self.start, self.end = data, start, len(data)
        self.memo_length = memo_length
        self.levels: list[list[int]] = [[]]  # the segment's stack, then one list per MARK it opened
        self.program: list[tuple] = []
        self.ops: list[tuple[int, int, int]] = []
        self.literals: dict[int, int] = {}
        self.puts: list[int] = []
        self.put_ops: dict[int, int] = {}
        self.own_gets: dict[int, int] = {}
        self.marks = 0

    def node(self, *instruction) -> int:
        self.program.append(instruction)
        return len(self.program) - 1

    def pop(self) -> int:
        level = self.levels[-1]
        if not level:
            raise _Below if len(self.levels) == 1 else _Refused  # (an empty MARK: the loop says why)
        return level.pop()

    def top(self) -> int:
        if not self.levels[-1]:
            raise _Below if len(self.levels) == 1 else _Refused
        return self.levels[-1][-1]

    def pop_mark(self) -> list[int]:
        if len(self.levels) == 1:
            raise _Refused  # the container's own MARK: the items end here
        return self.levels.pop()

    def push(self, node: int) -> None:
        self.levels[-1].append(node)

    def read(self, max_ops: int, look: bool = True) -> Segment | None:
        """The segment; ``look``: whether to check that what follows it does not reach into it."""
        data, pos, end = self.data, self.start, self.end
        first = next_op(data, pos, end)
        if first < 0 or first in _PUTS:
            return None
        for _ in range(max_ops):
            if (len(self.ops) >= (MIN_OPS if look else 1) and len(self.levels) == 1 and len(self.levels[0]) == 2
                    and next_op(data, pos, end) == first and (not look or self.followed(pos, max_ops))):
                return Segment(self.start, pos, self.ops, self.program, self.literals, self.puts, self.put_ops,
                               self.own_gets, list(self.levels[0]), self.marks, self.memo_length)
            if pos >= end:
                return None
            code = data[pos]
            after = arg_end(data, code, pos + 1, end)
            if after < 0:
                return None
            self.ops.append((code, pos + 1, after))
            self.step(code, len(self.ops) - 1, bytes(data[pos + 1 : after]))
            pos = after
        return None

    def followed(self, pos: int, max_ops: int) -> bool:
        """Whether the next item, from ``pos``, leaves this one alone until its own end (or the
        container's): read it too, without looking further."""
        try:
            _Reader(self.data, pos, self.memo_length + len(self.puts)).read(max_ops, look=False)
        except _Below:
            return False
        except (_Refused, IndexError, struct.error, ValueError, FormatError):
            pass  # (it ends the container, or the loop will say what is wrong with it)
        return True

    def step(self, code: int, index: int, raw: bytes) -> None:  # noqa: C901 (one branch an opcode)
        if code in LITERALS:
            self.literals[index] = node = self.node(LIT, index, literal(code, raw))
            self.push(node)
        elif code in _CONSTANTS:
            self.push(self.node(CONST, _CONSTANTS[code]))
        elif code == _FRAME:
            pass
        elif code in _GETS:
            at = raw[0] if code == _GETS[0] else _U32.unpack(raw)[0]
            if at < self.memo_length:
                self.push(self.node(MEMO, at))
            elif at - self.memo_length < len(self.puts):
                self.own_gets[index] = at - self.memo_length
                self.push(self.puts[at - self.memo_length])
            else:
                raise _Refused  # (an entry not made: the loop's KeyError)
        elif code in _PUTS:
            at = raw[0] if code == _PUTS[0] else _U32.unpack(raw)[0]
            if at != self.memo_length + len(self.puts):
                raise _Refused  # not an append in order
            self.put_ops[index] = len(self.puts)
            self.puts.append(self.top())
        elif code == P.MEMOIZE[0]:
            self.puts.append(self.top())
        elif code == P.MARK[0]:
            self.levels.append([])
            self.marks = max(self.marks, len(self.levels) - 1)
        else:
            self.structure(code, raw)

    def structure(self, code: int, raw: bytes) -> None:  # noqa: C901
        if code == P.TUPLE[0]:
            self.push(self.node(TUPLE, tuple(self.pop_mark())))
        elif P.TUPLE1[0] <= code <= P.TUPLE3[0]:
            level = self.levels[-1]
            n = code - P.TUPLE1[0] + 1
            if len(level) < n:
                raise _Refused
            items = tuple(level[-n:])
            del level[-n:]
            self.push(self.node(TUPLE, items))
        elif code == P.EMPTY_LIST[0]:
            self.push(self.node(LIST, ()))
        elif code == P.EMPTY_DICT[0]:
            self.push(self.node(DICT, ()))
        elif code == P.EMPTY_SET[0]:
            self.push(self.node(SET))
        elif code == P.LIST[0]:
            self.push(self.node(LIST, tuple(self.pop_mark())))
        elif code == P.DICT[0]:
            items = self.pop_mark()
            if len(items) % 2:
                raise _Refused
            self.push(self.node(DICT, tuple(items)))
        elif code == P.APPEND[0]:
            item = self.pop()
            self.node(APPEND, self.top(), (item,))
        elif code in (P.APPENDS[0], P.SETITEMS[0], P.ADDITEMS[0]):
            items = self.pop_mark()
            kind = {P.APPENDS[0]: APPEND, P.SETITEMS[0]: SETITEMS, P.ADDITEMS[0]: ADDITEMS}[code]
            if kind == SETITEMS and len(items) % 2:
                raise _Refused
            self.node(kind, self.top(), tuple(items))
        elif code == P.SETITEM[0]:
            value, key = self.pop(), self.pop()
            self.node(SETITEMS, self.top(), (key, value))
        elif code == P.POP[0]:
            if self.levels[-1]:
                self.levels[-1].pop()
            else:
                self.pop_mark()
        elif code == P.POP_MARK[0]:
            self.pop_mark()
        elif code == P.DUP[0]:
            self.push(self.top())
        elif code == P.GLOBAL[0]:
            module, name = raw.split(b"\n")[:2]
            self.push(self.node(GLOBAL, module, name))
        elif code == P.STACK_GLOBAL[0]:
            name, module = self.pop(), self.pop()
            self.push(self.node(SGLOBAL, module, name))
        elif code in (P.REDUCE[0], P.NEWOBJ[0], P.BUILD[0]):
            arg = self.pop()
            kind = {P.REDUCE[0]: CALL, P.NEWOBJ[0]: NEWOBJ, P.BUILD[0]: BUILD}[code]
            self.push(self.node(kind, self.pop(), arg))
        elif code == P.BINPERSID[0]:
            self.push(self.node(PERSID, self.pop()))
        else:
            raise _Refused  # PROTO, STOP and what the loop does not read
