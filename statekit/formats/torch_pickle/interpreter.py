"""The opcode interpreter: reads one pickle using only the opcodes registered in ``_OPS``, every
global through the allow-list; a container's items that repeat through templates (``repeats``)."""

from __future__ import annotations

import mmap
import pickle
import struct
from collections.abc import Callable, Mapping
from itertools import repeat

from statekit.errors import FormatError
from statekit.formats import limits
from statekit.formats.torch_pickle.allowlist import _call, _StorageType, find_global
from statekit.formats.torch_pickle.dtype_table import statekit_dtype
from statekit.formats.torch_pickle.geometry import Storage, StorageId
from statekit.formats.torch_pickle.objects import built, new_record
from statekit.formats.torch_pickle.opcodes import (
    _BINGET,
    _BINPUT,
    _BINUNICODE,
    _F64,
    _GLOBAL,
    _I32,
    _INLINE_CONSTANTS,
    _INT_FORMATS,
    _INTS,
    _LONG_BINGET,
    _LONG_BINPUT,
    _MARK,
    _REDUCE,
    _STOP,
    _TUPLE,
    _TUPLE1,
    _TUPLE3,
    _U16,
    _U32,
    _U64,
)
from statekit.formats.torch_pickle.repeats import Repeats
from statekit.formats.torch_pickle.structure import (
    _CONTAINERS,
    MAX_DEPTH,
    MAX_EXPANSION,
    MAX_STEPS,
    check_structure,
    no_gc,
)
from statekit.formats.torch_pickle.values import Record, RecordClass, _key, _keys, _text

StorageLoader = Callable[[StorageId], Storage]

_MAX_LONG_BYTES = 1024
(_MEMOIZE, _SHORT_BINUNICODE, _NEWOBJ, _BUILD, _EMPTY_DICT, _EMPTY_LIST, _SETITEMS, _SETITEM, _LONG1) = (
    op[0] for op in (pickle.MEMOIZE, pickle.SHORT_BINUNICODE, pickle.NEWOBJ, pickle.BUILD, pickle.EMPTY_DICT,
                     pickle.EMPTY_LIST, pickle.SETITEMS, pickle.SETITEM, pickle.LONG1))
_STR = frozenset((str,))
_PUTS = frozenset((_MEMOIZE, _BINPUT, _LONG_BINPUT))
_SIZED = frozenset((_SHORT_BINUNICODE, _BINUNICODE, _LONG1))
_OPS: dict[int, Callable[[_Unpickler], None]] = {}


def _op(*codes: bytes):
    def register(fn):
        for code in codes:
            _OPS[code[0]] = fn
        return fn

    return register


class _Unpickler:
    """Interprets one pickle from ``data[pos:]`` using only the opcodes registered in ``_OPS``."""

    templates = True  # a container's repeating items through templates (False: the opcode loop alone)
    # opcodes the loop runs before templates are tried: learning costs more than it saves on a
    # pickle this short (a DCP .metadata of 2,000 tensors runs 45,000), and a long one repeats anyway
    templates_after = 1 << 16

    def __init__(
        self,
        data: bytes | mmap.mmap,
        pos: int,
        storage_loader: StorageLoader | None,
        extra_globals: Mapping[str, object] | None = None,
    ):
        self.data = data
        self.extra_globals = extra_globals
        self.records: dict[int, RecordClass] = {}  # id(Record) -> its class, for BUILD
        self.pos = self.at = pos  # (at: the offset of the opcode being run)
        self.code = 0  # the opcode being interpreted
        self.storage_loader = storage_loader
        self.stack: list = []
        self.metastack: list[list] = []
        # the memo: a list while the indices come in order (0, 1, 2, ... as every pickler writes
        # them: 8 bytes an entry, no int objects kept), a dict once one does not
        self.memo: list | dict[int, object] = []
        self.depths: dict[int, int] = {}  # id → nesting depth of the containers built so far
        self.built: list = []  # keeps them alive, so that ids stay unique
        self.steps = 0
        self.sids: dict[tuple, StorageId] = {}  # persistent ids parsed so far
        self.last_sid: StorageId | None = None
        self.overwrites = 0  # memo entries replaced so far (templates use what they read only if none was)
        self.globals: dict[tuple[bytes, bytes], object] = {}  # GLOBAL lines looked up so far (cached_global)
        self.repeats = Repeats() if self.templates else None

    def truncated(self, n: int) -> FormatError:
        return FormatError(
            f"pickle is truncated: needs {n} bytes at offset {self.pos}, data ends at {len(self.data)}"
        )

    def truncated_at(self, pos: int, n: int) -> FormatError:
        self.pos = pos
        return self.truncated(n)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self.truncated(1)
        self.pos += 1
        return self.data[self.pos - 1]

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.truncated(n)
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def unpack(self, fmt: struct.Struct) -> int | float:
        if self.pos + fmt.size > len(self.data):
            raise self.truncated(fmt.size)
        self.pos += fmt.size
        return fmt.unpack_from(self.data, self.pos - fmt.size)[0]

    def readline(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 1024)
        if end < 0 and self.pos + 1024 >= len(self.data):
            raise self.truncated(len(self.data) - self.pos + 1)
        if end < 0:
            raise FormatError(f"pickle GLOBAL name at offset {self.pos} is unterminated")
        line, self.pos = self.data[self.pos : end], end + 1
        return line.decode("utf-8")

    def nest(self, container: object, items) -> object:
        """Record ``container``'s depth from ``items`` (refused past the limit, as it is built).

        Containers of depth 1 (a tuple of ints) are not recorded — a container with no record
        counts as depth 1 — so the many small tuples of a large pickle are not kept alive; those
        recorded are, so that their ids stay unique."""
        if not _has_container(items):
            return container  # no container among the items (the values of a state_dict): no deeper
        return self.nest_in(container, items)

    def nest_in(self, container: object, items) -> object:
        """:meth:`nest` where ``items`` hold a container: ``container`` is then at least 2 deep
        (an unrecorded container counts as 1), and one more than the deepest recorded item."""
        depths = self.depths
        key = id(container)
        depth = max(depths.get(key, 1), 2, max(map(depths.get, map(id, items), repeat(0))) + 1)
        if depth > MAX_DEPTH:
            raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
        if key not in depths:
            self.built.append(container)
        depths[key] = depth
        return container

    def put(self, index: int, value: object) -> None:
        """memo[index] = value."""
        memo = self.memo
        if index == len(memo) and type(memo) is list:
            memo.append(value)
            return
        self.overwrites += 1  # (or a new sparse index: counted alike)
        if type(memo) is list:
            if index < len(memo):
                memo[index] = value
                return
            self.memo = memo = dict(enumerate(memo))
        memo[index] = value

    def pop_mark(self) -> list:
        if not self.metastack:
            raise FormatError("malformed pickle: no MARK on the stack")
        items, self.stack = self.stack, self.metastack.pop()
        return items

    def target(self, kind: type) -> object:
        top = self.stack[-1]
        if not isinstance(top, kind):
            raise _cannot_add(top)
        return top

    def dispatch(self, code: int, start: int) -> None:
        """Run one opcode through its handler in ``_OPS`` (those not inlined in :meth:`load`)."""
        self.check_steps(self.steps)
        handler = _OPS.get(code)
        if handler is None:
            raise FormatError(f"unsupported pickle opcode {bytes([code])!r} at offset {start}")
        handler(self)

    def load(self) -> object:
        """The pickle's object (:meth:`run`), a Python error on malformed input one FormatError that
        names the offset of the opcode that met it."""
        try:
            return self.run()
        except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError, struct.error) as exc:
            raise FormatError(f"malformed pickle at offset {self.at}: {type(exc).__name__}: {exc}") from None

    def run(self) -> object:  # noqa: C901 (one branch an opcode)
        """The loop: the common opcodes inline or through a method of their own (each as its
        ``_OPS`` handler does it, in the same order of checks), the others through
        :meth:`dispatch`; once the pickle has run :attr:`templates_after` opcodes, after a MARK,
        the items that follow through templates while they fit (:class:`Repeats`)."""
        data, u32, end = self.data, _U32.unpack_from, len(self.data)
        pos, start, steps = self.pos, self.pos, self.steps
        stack, metastack, memo, repeats = self.stack, self.metastack, self.memo, self.repeats
        records, after_steps = self.records, self.templates_after
        try:
            while True:
                start = pos
                if pos >= end:
                    raise self.truncated_at(pos, 1)
                code = data[pos]
                pos += 1
                steps += 1
                if code == _MEMOIZE and type(memo) is list:
                    memo.append(stack[-1])
                elif code == _BINGET or code == _LONG_BINGET:
                    width = 1 if code == _BINGET else 4
                    if pos + width > end:
                        raise self.truncated_at(pos, width)
                    stack.append(memo[data[pos] if width == 1 else u32(data, pos)[0]])
                    pos += width
                elif code in _PUTS:
                    pos = self.put_at(code, pos, stack[-1])
                    memo = self.memo
                elif code in _INLINE_CONSTANTS:
                    stack.append(_INLINE_CONSTANTS[code])
                elif code == _MARK:
                    if len(metastack) >= MAX_DEPTH:
                        raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
                    metastack.append(stack)
                    stack = []
                    if repeats is not None and steps >= after_steps:
                        pos, steps = repeats.run(self, data, pos, stack, steps)
                elif _TUPLE1 <= code <= _TUPLE3:
                    stack.append(self.tuple_of(stack, code - _TUPLE1 + 1))
                elif code in _INTS:
                    width = _INTS[code]
                    if pos + width > end:
                        raise self.truncated_at(pos, width)
                    stack.append(data[pos] if width == 1 else _INT_FORMATS[width].unpack_from(data, pos)[0])
                    pos += width
                elif code in _SIZED:
                    pos = self.sized_at(code, pos, stack)
                elif code == _NEWOBJ and self.extra_globals is not None:
                    args = stack.pop()
                    stack[-1] = new_record(records, stack[-1], args)
                elif code == _BUILD:
                    state = stack.pop()
                    stack[-1] = _build_fast(records, stack[-1], state)
                elif code == _EMPTY_DICT:
                    stack.append({})
                elif code == _EMPTY_LIST:
                    stack.append([])
                elif code == _SETITEMS:
                    stack = self.set_items(stack, steps)
                elif code == _REDUCE:
                    args = stack.pop()
                    stack[-1] = _call(stack[-1], args)
                elif code == _TUPLE:
                    stack = self.tuple_to_mark(stack)
                elif code == _SETITEM:
                    self.set_item(stack, steps)
                elif code == _GLOBAL and (after := self.global_at(data, pos, stack)) >= 0:
                    pos = after
                elif code == _STOP:
                    self.check_steps(steps)
                    return stack.pop() if stack else _fail("malformed pickle: empty stack at STOP")
                else:
                    self.pos, self.code, self.steps, self.stack = pos, code, steps, stack
                    self.dispatch(code, start)
                    pos, stack, memo = self.pos, self.stack, self.memo
        finally:
            self.pos, self.steps, self.at = pos, steps, start

    @staticmethod
    def check_steps(steps: int) -> None:
        if steps > MAX_STEPS:
            raise FormatError(f"pickle runs more than {MAX_STEPS} opcodes: refused")

    def put_at(self, code: int, pos: int, value: object) -> int:
        """MEMOIZE (into a memo that is a dict), BINPUT or LONG_BINPUT at ``pos``: the offset after."""
        if code == _MEMOIZE:
            self.put(len(self.memo), value)
            return pos
        width = 1 if code == _BINPUT else 4
        if pos + width > len(self.data):
            raise self.truncated_at(pos, width)
        self.put(self.data[pos] if width == 1 else _U32.unpack_from(self.data, pos)[0], value)
        return pos + width

    def sized_at(self, code: int, pos: int, stack: list) -> int:
        """SHORT_BINUNICODE, BINUNICODE or LONG1 at ``pos`` (a length, then that many bytes) pushed:
        the offset after."""
        data, width = self.data, 4 if code == _BINUNICODE else 1
        if pos + width > len(data):
            raise self.truncated_at(pos, width)
        n = data[pos] if width == 1 else _U32.unpack_from(data, pos)[0]
        pos += width
        if pos + n > len(data):
            raise self.truncated_at(pos, n) if width == 1 else self.truncated_at(pos - 4, 4 + n)
        raw = data[pos : pos + n]
        stack.append(int.from_bytes(raw, "little", signed=True) if code == _LONG1 else _text(raw))
        return pos + n

    def tuple_of(self, stack: list, n: int) -> tuple:
        """TUPLE1..3: the top ``n`` items popped into a tuple."""
        if len(stack) < n:
            raise FormatError("malformed pickle: stack underflow in TUPLE")
        items = tuple(stack[-n:])
        del stack[-n:]
        return self.nest_in(items, items) if _has_container(items) else items

    def tuple_to_mark(self, stack: list) -> list:
        """TUPLE: the items since the MARK as one tuple on the stack below; that stack."""
        if not self.metastack:
            raise FormatError("malformed pickle: no MARK on the stack")
        items = tuple(stack)
        stack = self.metastack.pop()
        stack.append(self.nest_in(items, items) if _has_container(items) else items)
        return stack

    def set_items(self, stack: list, steps: int) -> list:
        """SETITEMS: the pairs since the MARK into the dict below them; the stack below the MARK."""
        self.check_steps(steps)
        if not self.metastack:
            raise FormatError("malformed pickle: no MARK on the stack")
        items, stack = stack, self.metastack.pop()
        values = items[1::2]
        top = stack[-1]
        if not isinstance(top, dict):
            raise _cannot_add(top)
        if _has_container(values):
            self.nest_in(top, values)
        top.update(zip(_keys(items[::2]), values, strict=True))
        return stack

    def set_item(self, stack: list, steps: int) -> None:
        """SETITEM: the top key and value into the dict below them."""
        self.check_steps(steps)
        value, key = stack.pop(), stack.pop()
        top = stack[-1]
        if not isinstance(top, dict):
            raise _cannot_add(top)
        if isinstance(value, _CONTAINERS):
            self.nest_in(top, (value,))
        top[_key(key)] = value

    def global_at(self, data, pos: int, stack: list) -> int:
        """GLOBAL's two lines from ``pos`` looked up (once per pickle) and pushed: the offset after
        them, or -1 when they do not end within reach (its handler then says why)."""
        nl = data.find(b"\n", pos, pos + 1024)
        nl2 = data.find(b"\n", nl + 1, nl + 1025) if nl >= 0 else -1
        if nl2 < 0:
            return -1
        stack.append(self.cached_global(bytes(data[pos:nl]), bytes(data[nl + 1 : nl2])))
        return nl2 + 1

    def cached_global(self, module: bytes, name: bytes) -> object:
        """``find_global`` of a GLOBAL's two lines, remembered per pickle (the allow-list is fixed)."""
        found = self.globals.get((module, name))
        if found is None:
            found = self.globals[(module, name)] = find_global(module.decode(), name.decode(), self.extra_globals)
        return found

    def persistent_load(self, pid: object) -> Storage:
        """The storage a persistent id names (its parsing cached: 10^6 views of one storage
        repeat one id); the container is asked for each, as :func:`_persistent_load` does."""
        if type(pid) is tuple and len(pid) == 5 and type(pid[1]) is _StorageType:
            # hashable in constant time: only str/int/identity-hashed members are looked up
            _, _, key, location, numel = pid
            if type(key) is str and type(location) is str and type(numel) is int and type(pid[0]) is str:
                sid = self.sids.get(pid)
                if sid is not None and self.storage_loader is not None:
                    return self.storage_loader(sid)
                storage = _persistent_load(self, pid)
                self.sids[pid] = self.last_sid
                return storage
        return _persistent_load(self, pid)


def _build_fast(records: dict[int, RecordClass], inst: object, state: object) -> object:
    """BUILD: :func:`built`, its commonest case (a NEWOBJ record's fields by name) inline."""
    if type(inst) is Record and type(state) is dict and records.get(id(inst)) is not None \
            and set(map(type, state)) <= _STR:
        inst.fields.update(state)
        return inst
    return built(records, inst, state)


def _fail(message: str) -> None:
    raise FormatError(message)


def _cannot_add(top: object) -> FormatError:
    return FormatError(f"malformed pickle: cannot add items to a {type(top).__name__}")


_CONTAINER_KIND: dict[type, bool] = {}  # type -> whether it is one of _CONTAINERS (a subclass counts)


def _has_container(items) -> bool:
    """Whether any of ``items`` is a container (``any(map(_is_container, items))``, by type)."""
    for kind in set(map(type, items)):
        flag = _CONTAINER_KIND.get(kind)
        if flag is None:
            flag = _CONTAINER_KIND[kind] = issubclass(kind, _CONTAINERS)
        if flag:
            return True
    return False


def loads(
    data: bytes | mmap.mmap,
    pos: int = 0,
    storage_loader: StorageLoader | None = None,
    extra_globals: Mapping[str, object] | None = None,
) -> tuple[object, int]:
    """Read one pickle from ``data`` at ``pos``; returns ``(object, offset after its STOP)``.

    ``storage_loader`` supplies the storage for each persistent id; a pickle with persistent ids
    and no loader is a FormatError. ``extra_globals`` allows more globals for this pickle only
    (stand-ins: :class:`_Callable` for REDUCE, :class:`RecordClass` for NEWOBJ, or constants).
    """
    unpickler = _Unpickler(data, pos, storage_loader, extra_globals)
    with no_gc():  # building 10^6 objects that all stay alive: collections would only rescan them
        try:
            obj = unpickler.load()
        except RecursionError:
            raise FormatError("malformed pickle: nesting too deep") from None
        finally:  # (its templates' steps hold the unpickler: without this, a cycle keeps the memo alive)
            unpickler.repeats = None
        check_structure(obj, max_nodes=MAX_EXPANSION + 16 * unpickler.steps)
    return obj, unpickler.pos


@_op(pickle.PROTO)
def _proto(u: _Unpickler) -> None:
    if u.byte() > pickle.HIGHEST_PROTOCOL:
        raise FormatError("unsupported pickle protocol")


@_op(pickle.FRAME)
def _frame(u: _Unpickler) -> None:
    u.read(8)  # frames only group opcodes; their contents follow inline


@_op(pickle.MARK)
def _mark(u: _Unpickler) -> None:
    if len(u.metastack) >= MAX_DEPTH:
        raise FormatError(f"pickle nests containers deeper than {MAX_DEPTH} levels")
    u.metastack.append(u.stack)
    u.stack = []


@_op(pickle.POP)
def _pop(u: _Unpickler) -> None:
    if u.stack:
        u.stack.pop()
    else:
        u.pop_mark()


@_op(pickle.POP_MARK)
def _pop_mark(u: _Unpickler) -> None:
    u.pop_mark()


@_op(pickle.DUP)
def _dup(u: _Unpickler) -> None:
    u.stack.append(u.stack[-1])


_CONSTANTS = {pickle.NONE[0]: None, pickle.NEWTRUE[0]: True, pickle.NEWFALSE[0]: False}


@_op(pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE)
def _constant(u: _Unpickler) -> None:
    u.stack.append(_CONSTANTS[u.code])


@_op(pickle.BININT)
def _binint(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_I32))


@_op(pickle.BININT1)
def _binint1(u: _Unpickler) -> None:
    u.stack.append(u.byte())


@_op(pickle.BININT2)
def _binint2(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_U16))


@_op(pickle.LONG1)
def _long1(u: _Unpickler) -> None:
    u.stack.append(int.from_bytes(u.read(u.byte()), "little", signed=True))


@_op(pickle.LONG4)
def _long4(u: _Unpickler) -> None:
    n = u.unpack(_I32)
    if n < 0:
        raise FormatError("malformed pickle: negative LONG4 length")
    if n > _MAX_LONG_BYTES:
        raise FormatError(f"pickled integer of {n} bytes is too large (limit {_MAX_LONG_BYTES})")
    u.stack.append(int.from_bytes(u.read(n), "little", signed=True))


@_op(pickle.BINFLOAT)
def _binfloat(u: _Unpickler) -> None:
    u.stack.append(u.unpack(_F64))


@_op(pickle.SHORT_BINUNICODE)
def _short_binunicode(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.byte())))


@_op(pickle.BINUNICODE)
def _binunicode(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.unpack(_U32))))


@_op(pickle.BINUNICODE8)
def _binunicode8(u: _Unpickler) -> None:
    u.stack.append(_text(u.read(u.unpack(_U64))))


@_op(pickle.SHORT_BINSTRING)
def _short_binstring(u: _Unpickler) -> None:
    u.stack.append(u.read(u.byte()).decode("utf-8"))  # Python 2 str, as torch.load decodes it


@_op(pickle.BINSTRING)
def _binstring(u: _Unpickler) -> None:
    n = u.unpack(_I32)
    if n < 0:
        raise FormatError("malformed pickle: negative BINSTRING length")
    u.stack.append(u.read(n).decode("utf-8"))


@_op(pickle.SHORT_BINBYTES)
def _short_binbytes(u: _Unpickler) -> None:
    u.stack.append(u.read(u.byte()))


@_op(pickle.BINBYTES)
def _binbytes(u: _Unpickler) -> None:
    u.stack.append(u.read(u.unpack(_U32)))


@_op(pickle.BINBYTES8)
def _binbytes8(u: _Unpickler) -> None:
    u.stack.append(u.read(u.unpack(_U64)))


_EMPTY = {
    pickle.EMPTY_TUPLE[0]: tuple,
    pickle.EMPTY_LIST[0]: list,
    pickle.EMPTY_DICT[0]: dict,
    pickle.EMPTY_SET[0]: set,
}


@_op(pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET)
def _empty(u: _Unpickler) -> None:
    u.stack.append(_EMPTY[u.code]())


@_op(pickle.TUPLE)
def _tuple(u: _Unpickler) -> None:
    items = u.pop_mark()  # before touching u.stack: pop_mark replaces it
    u.stack.append(u.nest(tuple(items), items))


@_op(pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
def _tuple_n(u: _Unpickler) -> None:
    n = u.code - pickle.TUPLE1[0] + 1
    if len(u.stack) < n:
        raise FormatError("malformed pickle: stack underflow in TUPLE")
    items = tuple(u.stack[-n:])
    u.stack[-n:] = [u.nest(items, items)]


@_op(pickle.LIST)
def _list(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.stack.append(u.nest(items, items))


@_op(pickle.DICT)
def _dict(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.stack.append(u.nest(dict(zip(_keys(items[::2]), items[1::2], strict=True)), items[1::2]))


@_op(pickle.APPEND)
def _append(u: _Unpickler) -> None:
    item = u.stack.pop()
    u.nest(u.target(list), (item,)).append(item)


@_op(pickle.APPENDS)
def _appends(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.nest(u.target(list), items).extend(items)


@_op(pickle.SETITEM)
def _setitem(u: _Unpickler) -> None:
    value, key = u.stack.pop(), u.stack.pop()
    u.nest(u.target(dict), (value,))[_key(key)] = value


@_op(pickle.SETITEMS)
def _setitems(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.nest(u.target(dict), items[1::2]).update(zip(_keys(items[::2]), items[1::2], strict=True))


@_op(pickle.ADDITEMS)
def _additems(u: _Unpickler) -> None:
    items = u.pop_mark()
    u.target(set).update(_keys(items))


@_op(pickle.BINGET)
def _binget(u: _Unpickler) -> None:
    u.stack.append(u.memo[u.byte()])


@_op(pickle.LONG_BINGET)
def _long_binget(u: _Unpickler) -> None:
    u.stack.append(u.memo[u.unpack(_U32)])


@_op(pickle.BINPUT)
def _binput(u: _Unpickler) -> None:
    u.put(u.byte(), u.stack[-1])


@_op(pickle.LONG_BINPUT)
def _long_binput(u: _Unpickler) -> None:
    u.put(u.unpack(_U32), u.stack[-1])


@_op(pickle.MEMOIZE)
def _memoize(u: _Unpickler) -> None:
    u.put(len(u.memo), u.stack[-1])


@_op(pickle.GLOBAL)
def _global(u: _Unpickler) -> None:
    module = u.readline()
    u.stack.append(find_global(module, u.readline(), u.extra_globals))


@_op(pickle.STACK_GLOBAL)
def _stack_global(u: _Unpickler) -> None:
    name, module = u.stack.pop(), u.stack.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        raise FormatError("malformed pickle: STACK_GLOBAL names are not strings")
    u.stack.append(find_global(module, name, u.extra_globals))


@_op(pickle.REDUCE)
def _reduce(u: _Unpickler) -> None:
    args = u.stack.pop()
    u.stack[-1] = _call(u.stack[-1], args)


@_op(pickle.NEWOBJ)
def _newobj(u: _Unpickler) -> None:
    if u.extra_globals is None:  # torch.save pickles never create objects this way
        raise FormatError(f"unsupported pickle opcode {pickle.NEWOBJ!r} at offset {u.pos - 1}")
    args = u.stack.pop()
    u.stack[-1] = new_record(u.records, u.stack[-1], args)


@_op(pickle.BUILD)
def _build(u: _Unpickler) -> None:
    state = u.stack.pop()
    u.stack[-1] = built(u.records, u.stack[-1], state)


@_op(pickle.BINPERSID)
def _binpersid(u: _Unpickler) -> None:
    u.stack.append(u.persistent_load(u.stack.pop()))


def _persistent_load(u: _Unpickler, pid: object) -> Storage:
    """Parse ``('storage', type, key, location, numel[, view])`` and ask the container for it."""
    if not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] not in ("storage", b"storage"):
        raise FormatError(f"unsupported persistent id {limits.short(pid)}: only tensor storages are allowed")
    if u.storage_loader is None:
        raise FormatError("pickle refers to a tensor storage, but this part of the file has none")
    _, stype, key, location, numel, *view = pid
    if not isinstance(stype, _StorageType):
        raise FormatError(f"persistent id storage type {limits.short(stype)} is not a torch storage class")
    statekit_dtype(stype.dtype)
    key, location = (v.decode("ascii") if isinstance(v, bytes) else v for v in (key, location))
    if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
        raise FormatError(f"malformed storage persistent id {limits.short(pid)}")
    u.last_sid = sid = StorageId(key, stype.dtype, numel, location, view[0] if view else None)
    return u.storage_loader(sid)
