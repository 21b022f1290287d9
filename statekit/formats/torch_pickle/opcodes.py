"""Pickle opcode bytes and argument formats shared by the interpreter and its fast path."""

from __future__ import annotations

import pickle
import struct

_STOP = pickle.STOP[0]
_GLOBAL = pickle.GLOBAL[0]
_I32, _U16, _U32, _U64, _F64 = (struct.Struct(f) for f in ("<i", "<H", "<I", "<Q", ">d"))

_PUTS = (pickle.BINPUT, pickle.LONG_BINPUT)

_INTS = {pickle.BININT1[0]: 1, pickle.BININT2[0]: 2, pickle.BININT[0]: 4}  # opcode -> argument bytes
_INT_FORMATS = {2: _U16, 4: _I32}
_INLINE_CONSTANTS = {pickle.NONE[0]: None, pickle.NEWTRUE[0]: True, pickle.NEWFALSE[0]: False, pickle.EMPTY_TUPLE[0]: ()}

(_BINGET, _LONG_BINPUT, _BININT1, _MARK, _TUPLE, _TUPLE1, _BINPUT, _BININT, _NEWFALSE, _EMPTY_TUPLE, _BININT2) = (
    op[0] for op in (pickle.BINGET, pickle.LONG_BINPUT, pickle.BININT1, pickle.MARK, pickle.TUPLE, pickle.TUPLE1,
                     pickle.BINPUT, pickle.BININT, pickle.NEWFALSE, pickle.EMPTY_TUPLE, pickle.BININT2))
(_REDUCE, _TUPLE2, _TUPLE3, _BINUNICODE, _BINPERSID, _LONG_BINGET) = (
    op[0] for op in (pickle.REDUCE, pickle.TUPLE2, pickle.TUPLE3, pickle.BINUNICODE, pickle.BINPERSID,
                     pickle.LONG_BINGET))


def _int_op(raw: bytes) -> int:
    """The value of one BININT1 / BININT2 / BININT opcode with its argument."""
    return raw[1] if raw[0] == _BININT1 else _INT_FORMATS[len(raw) - 1].unpack_from(raw, 1)[0]
