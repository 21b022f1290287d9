"""Templates: a :class:`~.segment.Segment`'s program made into code that runs it, and every later
item whose bytes are the same but for some literals and the memo indices it appends at.

A template is the segment's bytes cut into fixed chunks and *slots*: the literals allowed to
vary (a name, an offset …), read and decoded per item, and the memo indices, which must be the
next ones in order. Whatever else the program computes from fixed bytes alone — globals, memo
entries made before, tuples of those, the storage a fixed persistent id names, calls of pure
stand-ins (``torch.Size``, ``torch.device``) — is computed once, when the template is built
(:func:`build`); per item only what depends on a slot or must be a new object is made, and a
tensor call of one storage, size and stride checks just its offset (:func:`.geometry.view_plan`).

An item runs all or nothing: its bytes are matched and its objects made before anything is
pushed or memoized, and any failure (other bytes, an offset past the storage's end, a name that
is not UTF-8, a stand-in refusing its arguments) leaves it to the opcode loop, which then reads
it and raises its own error, word for word."""

from __future__ import annotations

import struct
from operator import itemgetter

from statekit.formats.torch_pickle.allowlist import _ALLOWED, _Callable, find_global
from statekit.formats.torch_pickle.geometry import Storage, view_plan
from statekit.formats.torch_pickle.objects import built, new_record
from statekit.formats.torch_pickle.opcodes import _F64, _I32, _U16, _U32
from statekit.formats.torch_pickle.segment import (
    ADDITEMS,
    APPEND,
    BUILD,
    CALL,
    CONST,
    DICT,
    GLOBAL,
    LIST,
    LIT,
    MEMO,
    NEWOBJ,
    PERSID,
    SET,
    SETITEMS,
    SGLOBAL,
    TUPLE,
    Segment,
)
from statekit.formats.torch_pickle.structure import _CONTAINERS, MAX_DEPTH
from statekit.formats.torch_pickle.values import _FLAT_KEY_TYPES, _keys

_FN = {name: value.fn for name, value in _ALLOWED.items() if type(value) is _Callable}
_ORDERED_DICT = _FN["collections.OrderedDict"]
_REBUILD_TENSOR_V2 = _FN["torch._utils._rebuild_tensor_v2"]
_CONTAINER_RESULTS = {_ORDERED_DICT, _FN["torch.Size"], _FN["builtins.set"]}
_SCALAR_RESULTS = set(_FN.values()) - _CONTAINER_RESULTS  # tensors, devices, layouts, numbers, bytes
# stand-ins whose result depends on their arguments alone and is immutable: called once per template
_PURE = {_FN[name] for name in ("torch.Size", "torch.device", "torch.serialization._get_layout",
                                "builtins.complex", "_codecs.encode")}

# slots: how a varying literal is read (opcode -> kind); the others are never varied
_FIXED, _PACKED, _TEXT4, _INT1, _INT2, _INT4, _TEXT1, _STR1, _STR4, _BYTES1, _BYTES4, _LONG1, _FLOAT, _SKIP8 = range(14)
_SLOT = {0x4B: _INT1, 0x4D: _INT2, 0x4A: _INT4, 0x8A: _LONG1, 0x47: _FLOAT, 0x8C: _TEXT1, 0x58: _TEXT4,
         0x55: _STR1, 0x54: _STR4, 0x43: _BYTES1, 0x42: _BYTES4}
VARIABLE = frozenset(_SLOT)  # the literal opcodes a slot may read
_FRAME, _BINPUT, _BINGET = 0x95, 0x71, 0x68
_u16, _i32, _u32, _f64 = _U16.unpack_from, _I32.unpack_from, _U32.unpack_from, _F64.unpack_from


class _Miss(Exception):
    """This item's bytes are not the template's."""


class _Refused(Exception):
    """No template from this segment (the loop reads its bytes)."""


def _getter(indices):
    """A function of the registers giving the tuple of those at ``indices``."""
    if not indices:
        return lambda r: ()
    if len(indices) == 1:
        (a,) = indices
        return lambda r: (r[a],)
    return itemgetter(*indices)


def _sw(data):
    if type(data) is bytes:
        return data.startswith
    return lambda chunk, pos: data[pos : pos + len(chunk)] == chunk  # (an mmap: legacy .pt files)


class Template:
    """Runs a segment's items (:meth:`run`): see the module's docstring."""

    def __init__(self, seg: Segment, var: frozenset[int]):
        self.seg, self.var = seg, var
        self.ops = len(seg.ops)  # opcodes an item stands for (the loop's budget counts them)
        self.puts = len(seg.puts)
        self.items = 0  # items it ran
        self.interpreted = 0  # items :meth:`interpret` ran (the first few, before :attr:`compiled` is made)
        self.compiled = None  # :meth:`interpret` written out for this template's pieces (:func:`_compile`)

    def run(self, u, data, pos: int, stack: list, limit: int) -> tuple[int, int]:
        """Up to ``limit`` items from ``pos``: (the offset after the last, items run).

        The first :data:`COMPILE_AFTER` items run through :meth:`interpret`; a template that gets
        that far is then written out as a function of its own (:func:`_compile`: the same
        statements, less the loop over the pieces and the tests of their kinds), which runs the
        rest. A template used once or twice costs no compiling."""
        count = 0
        if self.compiled is None:
            first = min(limit, COMPILE_AFTER - self.interpreted)
            pos, count = self.interpret(u, data, pos, stack, first)
            self.interpreted += count
            if count < first or count == limit:
                return pos, count
            self.compiled = _compile(self)
        pos, more = self.compiled(u, data, pos, stack, limit - count)
        return pos, count + more

    def interpret(self, u, data, pos: int, stack: list, limit: int) -> tuple[int, int]:
        """:meth:`run`'s items, its pieces looped over (what :func:`_compile` writes out).

        One register list serves every item: each item writes a register (from a slot, or a
        step) before anything reads it, so nothing of the item before is ever read."""
        memo, end, sw = u.memo, len(data), _sw(data)
        n = len(memo)
        r, head, pairs, steps, put_get, push_get, nputs = (
            self.base, self.head, self.pairs, self.steps, self.put_get, self.push_get, self.puts)
        head_kind, head_chunk, head_length = head
        text4, int1, int2, int4, fixed, packed = _TEXT4, _INT1, _INT2, _INT4, _FIXED, _PACKED
        count = 0
        while count < limit:
            p = pos
            try:
                if head_kind == fixed:
                    if not sw(head_chunk, p):
                        raise _Miss
                    p += head_length
                elif head_kind == packed:
                    if not sw(head_chunk(n), p):
                        raise _Miss
                    p += head_length
                for slot, reg, code, kind, chunk, length in pairs:
                    if data[p] != code:
                        raise _Miss
                    if slot == text4:
                        k = p + 5 + _u32(data, p + 1)[0]
                        if k > end:
                            raise _Miss
                        r[reg] = data[p + 5 : k].decode()
                        p = k
                    elif slot == int1:
                        r[reg] = data[p + 1]
                        p += 2
                    elif slot == int2:
                        r[reg] = _u16(data, p + 1)[0]
                        p += 3
                    elif slot == int4:
                        r[reg] = _i32(data, p + 1)[0]
                        p += 5
                    else:
                        p = _slot(slot, data, p + 1, end, r, reg)
                    if kind == fixed:
                        if not sw(chunk, p):
                            raise _Miss
                        p += length
                    elif kind == packed:
                        if not sw(chunk(n), p):
                            raise _Miss
                        p += length
                steps(r)
            except Exception:  # (a mismatch, or a refusal: the loop reads this item)
                break
            if nputs:
                memo.extend(put_get(r))
            stack.extend(push_get(r))
            n += nputs
            pos = p
            count += 1
        return pos, count

    def slot_bytes(self, data, pos: int, n: int) -> tuple[list[bytes], int] | None:
        """The raw bytes of each slot of the item at ``pos`` (memo length ``n``) and where it ends,
        if its bytes are this template's; nothing is run."""
        sw, end, raws = _sw(data), len(data), []
        head_kind, head_chunk, head_length = self.head

        def chunk_at(kind: int, chunk, length: int, pos: int) -> int:
            if kind == _FIXED and not sw(chunk, pos) or kind == _PACKED and not sw(chunk(n), pos):
                raise _Miss
            return pos + length

        try:
            pos = chunk_at(head_kind, head_chunk, head_length, pos)
            for slot, _, code, kind, chunk, length in self.pairs:
                if data[pos] != code:
                    return None
                after = _slot(slot, data, pos + 1, end, {}, 0)
                raws.append(bytes(data[pos:after]))
                pos = chunk_at(kind, chunk, length, after)
        except Exception:
            return None
        return raws, pos

    def valid(self, u) -> bool:
        """Whether what it computed once still holds: no memo entry replaced since, the memo
        reads' containers as deep as they were."""
        return (u.overwrites == self.overwrites and type(u.memo) is list
                and all(u.depths.get(key) == depth for key, depth in self.read_depths))


def _slot(kind: int, data, p: int, end: int, r, a: int) -> int:
    """Reads the rarer slots (r[a] = the value): the offset after it."""
    if kind == _SKIP8:
        if p + 8 > end:
            raise _Miss
        return p + 8
    if kind in (_INT1, _INT2, _INT4):
        width = {_INT1: 1, _INT2: 2, _INT4: 4}[kind]
        if p + width > end:
            raise _Miss
        r[a] = data[p] if width == 1 else (_u16 if width == 2 else _i32)(data, p)[0]
        return p + width
    if kind == _FLOAT:
        r[a] = _f64(data, p)[0]
        return p + 8
    if kind == _TEXT4:
        k = p + 4 + _u32(data, p)[0]
    elif kind == _STR4:
        length = _i32(data, p)[0]
        if length < 0:
            raise _Miss
        k = p + 4 + length
    elif kind == _BYTES4:
        k = p + 4 + _u32(data, p)[0]
    else:  # a one-byte length: _TEXT1, _STR1, _BYTES1, _LONG1
        k = p + 1 + data[p]
    if k > end:
        raise _Miss
    start = p + (4 if kind in (_TEXT4, _STR4, _BYTES4) else 1)
    raw = data[start:k]
    if kind in (_TEXT1, _TEXT4, _STR1, _STR4):
        r[a] = raw.decode()  # strict: anything else (a lone surrogate …) is the loop's to refuse
    elif kind == _LONG1:
        r[a] = int.from_bytes(raw, "little", signed=True)
    else:
        r[a] = bytes(raw)
    return k


# ------------------------------------------------------------------------------------------------
# building


def build(u, data, seg: Segment, var: frozenset[int]) -> Template | None:
    """The template of ``seg`` whose slots are the literals at the op indices ``var`` (the other
    literals fixed to instance one's bytes), or None where it cannot be built: then the loop
    reads the bytes (and raises, if they are bad)."""
    try:
        return _Builder(u, data, seg, var).template()
    except _Refused:
        return None
    except Exception:  # (a global, a persistent id, a call refused: the loop says so, at its place)
        return None


class _Builder:
    def __init__(self, u, data, seg: Segment, var: frozenset[int]):
        self.u, self.data, self.seg = u, data, seg
        named = {x for ins in seg.program if ins[0] == SGLOBAL for x in ins[1:]}  # (a global's name: fixed)
        self.var = frozenset(k for k in var if k in seg.literals and seg.ops[k][0] in VARIABLE
                             and seg.literals[k] not in named)
        self.var_nodes = {seg.literals[k] for k in self.var}
        size = len(seg.program)
        self.static: list = [None] * size
        self.is_static = [False] * size
        self.kind = ["s"] * size  # "c" a container, "s" not, "?" unknown until made
        self.depth: list = [None] * size  # a container's depth as the loop would record it (None: unrecorded)
        self.read_depths: list[tuple[int, int | None]] = []
        self.pushed = set(seg.pushes)

    # -- what the program computes once

    def template(self) -> Template:
        seg = self.seg
        actions = [self.evaluate(i, ins) for i, ins in enumerate(seg.program)]
        live = self.live(actions)
        t = Template(seg, self.var)
        t.base = [v if s else None for v, s in zip(self.static, self.is_static, strict=True)]
        t.is_static = self.is_static
        t.step_list = [step for i, (action, step) in enumerate(actions) if step is not None and i in live]
        t.steps = _sequence(t.step_list)
        t.put_get, t.push_get = _getter(tuple(seg.puts)), itemgetter(*seg.pushes)
        t.head, t.pairs = _pairs(self.pieces())
        t.overwrites, t.read_depths = self.u.overwrites, self.read_depths
        return t

    def value_kind(self, node: int) -> tuple[str, int | None]:
        """("c", its recorded depth) for a container, ("s", None) for anything else, ("?", None)
        when only running tells."""
        if self.is_static[node]:
            value = self.static[node]
            if isinstance(value, _CONTAINERS):
                depth = self.u.depths.get(id(value))
                self.read_depths.append((id(value), depth))
                return "c", depth
            return "s", None
        return self.kind[node], self.depth[node]

    def nested(self, container: int, items) -> str | None:
        """What the loop's ``nest(container, items)`` does here: None (nothing: no container
        among the items, or a new container of depth 2 nobody can nest further without the
        memo, as the loop's fast paths always did), "record" (a depth to record), "run" (only
        running tells)."""
        kinds = [self.value_kind(x) for x in items]
        if any(k == "?" for k, _ in kinds):
            self.depth[container] = None
            return "run"
        if not any(k == "c" for k, _ in kinds):
            return None
        depth = self.depth[container] or 1
        for k, inner in kinds:
            if k != "c":
                continue
            if inner is None:
                depth = max(depth, 2)
            elif inner >= depth:
                depth = inner + 1
        if depth > MAX_DEPTH:
            raise _Refused
        self.depth[container] = depth
        return "record" if depth > 2 or container in self.pushed else None

    def set_static(self, i: int, value: object) -> None:
        self.static[i], self.is_static[i] = value, True

    def evaluate(self, i: int, ins: tuple) -> tuple[str, object]:  # noqa: C901 (one branch an instruction)
        """Instruction ``i``: computed now (static) or its step per item: (what it does, step)."""
        u, op = self.u, ins[0]
        if op == LIT:
            if i not in self.var_nodes:
                self.set_static(i, ins[2])
            return "lit", None
        if op == CONST:
            self.set_static(i, ins[1])
            return "const", None
        if op == MEMO:
            self.set_static(i, u.memo[ins[1]])
            return "memo", None
        if op == GLOBAL:
            self.set_static(i, u.cached_global(ins[1], ins[2]))
            return "global", None
        if op == SGLOBAL:
            module, name = (self.static[x] if self.is_static[x] else None for x in ins[1:])
            if type(module) is not str or type(name) is not str:
                raise _Refused
            self.set_static(i, find_global(module, name, u.extra_globals))
            return "global", None
        if op == TUPLE:
            items = ins[1]
            if all(self.is_static[x] for x in items):
                value = tuple(self.static[x] for x in items)
                if any(map(_is_container, value)):
                    u.nest(value, value)
                self.set_static(i, value)
                return "static", None
            self.kind[i] = "c"
            nest = self.nested(i, items)
            return ("effect" if nest == "run" else "new"), self.tuple_step(i, items, nest)
        if op == LIST:
            self.kind[i] = "c"
            nest = self.nested(i, ins[1])
            return ("effect" if nest == "run" else "new"), self.list_step(i, ins[1], nest)
        if op == DICT:
            self.kind[i] = "c"
            keys, values = ins[1][::2], ins[1][1::2]
            nest = self.nested(i, values)
            may_refuse = nest == "run" or not self.keys_checked(keys)
            return ("effect" if may_refuse else "new"), self.dict_step(i, keys, values, nest)
        if op == SET:
            self.kind[i] = "c"
            def new_set(r):
                r[i] = set()
            return "new", new_set
        if op in (APPEND, SETITEMS, ADDITEMS):
            return "effect", self.mutation_step(op, ins[1], ins[2])
        if op == CALL:
            return self.call(i, ins[1], ins[2])
        if op == PERSID:
            pid = ins[1]
            if self.is_static[pid]:
                self.set_static(i, u.persistent_load(self.static[pid]))
                return "static", None
            load = u.persistent_load

            def persid(r):
                r[i] = load(r[pid])
            return "effect", persid
        if op == NEWOBJ:
            cls, args = ins[1], ins[2]
            if u.extra_globals is None or not self.is_static[cls]:
                raise _Refused  # (the loop names the opcode's offset)
            records, rclass = u.records, self.static[cls]
            return "effect", self.binary(i, args, lambda r, a: new_record(records, rclass, a))
        if op == BUILD:
            inst, state = ins[1], ins[2]
            if self.is_static[inst]:
                raise _Refused
            self.kind[i], self.depth[i] = self.kind[inst], self.depth[inst]
            records = u.records
            return "effect", self.binary(i, state, lambda r, s: built(records, r[inst], s))
        raise _Refused

    def binary(self, i: int, arg: int, fn):
        """The step ``r[i] = fn(r, arg's value)``."""
        if self.is_static[arg]:
            value = self.static[arg]

            def fixed(r):
                r[i] = fn(r, value)
            return fixed

        def step(r):
            r[i] = fn(r, r[arg])
        return step

    # -- steps

    def tuple_step(self, i: int, items, nest):
        get, u = _getter(items), self.u
        if nest == "run":
            def step(r):
                r[i] = t = get(r)
                u.nest(t, t)
        elif nest == "record":
            depths, keep, depth = u.depths, u.built, self.depth[i]

            def step(r):
                r[i] = t = get(r)
                depths[id(t)] = depth
                keep.append(t)
            _source(step, [f"{{r{i}}} = t = {_tuple_source(items)}", "{depths}[id(t)] = {depth}", "{keep}(t)"],
                    depths=depths, depth=depth, keep=keep.append)
        else:
            def step(r):
                r[i] = get(r)
            _source(step, [f"{{r{i}}} = {_tuple_source(items)}"])
        return step

    def list_step(self, i: int, items, nest):
        get, u = _getter(items), self.u
        if nest is None:
            def plain(r):
                r[i] = list(get(r))
            return plain

        def step(r):
            r[i] = x = list(get(r))
            u.nest(x, x)
        return step

    def dict_step(self, i: int, keys, values, nest):
        keys_get, values_get, u = _getter(keys), _getter(values), self.u
        checked = self.keys_checked(keys)
        if not keys and nest is None:
            return _empty_dict_step(i)

        def step(r):
            ks = keys_get(r)
            r[i] = x = dict(zip(ks if checked else _keys(ks), values_get(r), strict=True))
            if nest is not None:
                u.nest(x, values_get(r))
        return step

    def keys_checked(self, keys) -> bool:
        """Whether these dict keys or set members pass the loop's key check (``_keys``) whatever
        the item: literals, and fixed values that passed it now."""
        fixed = [self.static[k] for k in keys if self.is_static[k]]
        if _keys(fixed) is not fixed:  # (converted or refused: checked per item)
            return False
        return all(self.is_static[k] or self.seg.program[k][0] == LIT for k in keys) and all(
            type(v) in _FLAT_KEY_TYPES for v in fixed)

    def mutation_step(self, op: int, target: int, items):
        if self.is_static[target]:
            raise _Refused  # (only what the segment made itself is changed)
        u, get = self.u, _getter(items)
        if op == APPEND:
            nest = self.nested(target, items)

            def step(r):
                x, values = r[target], get(r)
                if not isinstance(x, list):
                    raise _Refused
                if nest is not None:
                    u.nest(x, values)
                x.extend(values)
            return step
        if op == SETITEMS:
            keys, values = items[::2], items[1::2]
            nest, checked = self.nested(target, values), self.keys_checked(keys)
            keys_get, values_get = _getter(keys), _getter(values)

            def step(r):
                x, vs = r[target], values_get(r)
                if not isinstance(x, dict):
                    raise _Refused
                if nest is not None:
                    u.nest(x, vs)
                ks = keys_get(r)
                x.update(zip(ks if checked else _keys(ks), vs, strict=True))
            return step

        def step(r):  # ADDITEMS
            x = r[target]
            if not isinstance(x, set):
                raise _Refused
            x.update(_keys(get(r)))
        return step

    def call(self, i: int, func: int, args: int) -> tuple[str, object]:
        if not self.is_static[func] or type(self.static[func]) is not _Callable:
            raise _Refused  # (not an allowed callable: the loop refuses it)
        fn = self.static[func].fn
        self.kind[i] = "c" if fn in _CONTAINER_RESULTS else "s" if fn in _SCALAR_RESULTS else "?"
        if self.is_static[args]:
            value = self.static[args]
            if type(value) is not tuple:
                raise _Refused
            if fn in _PURE:
                self.set_static(i, fn(*value))
                return "static", None
            if fn is _ORDERED_DICT and value == ():
                return "new", _empty_dict_step(i)

            def fixed_call(r):
                r[i] = fn(*value)
            return "effect", fixed_call
        if self.seg.program[args][0] != TUPLE:
            raise _Refused  # (arguments that are not a tuple: the loop's error)
        items = self.seg.program[args][1]
        if fn is _REBUILD_TENSOR_V2 and (plan := self.view(items)) is not None:
            at, offset = plan
            if self.is_static[offset]:
                value = self.static[offset]

                def fixed_view(r):
                    r[i] = at(value)
                return ("tensor", offset), _source(fixed_view, [f"{{r{i}}} = {{at}}({{value}})"], at=at, value=value)

            def view(r):
                r[i] = at(r[offset])
            return ("tensor", offset), _source(view, [f"{{r{i}}} = {{at}}({{r{offset}}})"], at=at)
        get = _getter(items)

        def call(r):
            r[i] = fn(*get(r))
        return "effect", call

    def view(self, items) -> tuple | None:
        """The plan of a ``_rebuild_tensor_v2`` call whose storage, size, stride and grad flag are
        fixed and whose hooks are a dict made here (or None), and its offset's node; else None."""
        if len(items) not in (6, 7):
            return None
        storage, offset, size, stride, grad, hooks, *metadata = items
        fixed = self.is_static
        if not (fixed[storage] and fixed[size] and fixed[stride] and fixed[grad]):
            return None
        if metadata and not (fixed[metadata[0]] and self.static[metadata[0]] is None):
            return None
        if fixed[hooks]:
            if self.static[hooks] is not None and type(self.static[hooks]) is not dict:
                return None
        elif not self.makes_dict(hooks):
            return None
        if not (fixed[offset] or self.seg.program[offset][0] == LIT):
            return None
        value = self.static[offset] if fixed[offset] else self.seg.program[offset][2]
        if type(self.static[storage]) is not Storage or not isinstance(value, int):
            return None
        at = view_plan(self.static[storage], value, self.static[size], self.static[stride], None,
                       bool(self.static[grad]))
        return at, offset

    def makes_dict(self, node: int) -> bool:
        ins = self.seg.program[node]
        if ins[0] == DICT:
            return True
        return (ins[0] == CALL and self.is_static[ins[1]] and type(self.static[ins[1]]) is _Callable
                and self.static[ins[1]].fn is _ORDERED_DICT)

    # -- what runs per item

    def live(self, actions) -> set[int]:
        """The instructions whose step must run: what is pushed or memoized, what may refuse or
        changes something, and what those read. A tensor call of a plan reads its offset (and
        hooks) only, so the argument tuple is made only when the pickle memoizes it."""
        program, live = self.seg.program, set()
        todo = [*self.seg.pushes, *self.seg.puts]
        todo += [i for i, (action, _) in enumerate(actions) if action == "effect" or isinstance(action, tuple)]
        while todo:
            i = todo.pop()
            if i in live:
                continue
            live.add(i)
            action, ins = actions[i][0], program[i]
            if isinstance(action, tuple):  # a tensor call of a plan: its offset only
                todo += [x for x in action[1:] if not self.is_static[x]]
                continue
            op = ins[0]
            if op in (TUPLE, LIST, DICT):
                todo += ins[1]
            elif op in (APPEND, SETITEMS, ADDITEMS):
                todo += [ins[1], *ins[2]]
            elif op == CALL and not self.is_static[ins[2]] and program[ins[2]][0] == TUPLE:
                todo += [ins[1], *program[ins[2]][1]]  # (the call reads the tuple's items)
            elif op in (CALL, NEWOBJ, BUILD):
                todo += [ins[1], ins[2]]
            elif op == PERSID:
                todo.append(ins[1])
        return live

    def pieces(self) -> list[tuple]:
        """The segment's bytes as fixed chunks (memo indices packed in: the next ones) and slots."""
        seg, data, pieces, parts = self.seg, self.data, [], []
        for k, (code, a, b) in enumerate(seg.ops):
            op = bytes([code])
            if k in self.var or code == _FRAME:  # a slot (a FRAME's length is skipped)
                _flush(parts, pieces)
                pieces.append((_SLOT[code], seg.literals[k], code) if k in self.var else (_SKIP8, 0, code))
            elif k in seg.put_ops or k in seg.own_gets:
                parts += [op, ("B" if code in (_BINPUT, _BINGET) else "I", seg.put_ops.get(k, seg.own_gets.get(k)))]
            else:
                parts.append(bytes(data[a - 1 : b]))
        _flush(parts, pieces)
        return pieces


def _sequence(steps: list):
    """One function running ``steps`` in order (written out for up to three: most items have one to three)."""
    if not steps:
        return lambda r: None
    if len(steps) == 1:
        return steps[0]
    if len(steps) == 2:
        a, b = steps

        def two(r):
            a(r)
            b(r)
        return two
    if len(steps) == 3:
        a, b, c = steps

        def three(r):
            a(r)
            b(r)
            c(r)
        return three

    def many(r):
        for step in steps:
            step(r)
    return many


_NONE = (-1, None, 0)  # no chunk


def _pairs(pieces: list[tuple]) -> tuple[tuple, list[tuple]]:
    """The pieces as the chunk before the first slot, and (slot kind, register, opcode, the
    chunk after it: kind, bytes or packer, length) per slot."""
    head, pairs = _NONE, []
    for kind, a, b in pieces:
        if kind in (_FIXED, _PACKED):
            if pairs:
                pairs[-1] = pairs[-1][:3] + (kind, a, b)
            else:
                head = (kind, a, b)
        else:
            pairs.append((kind, a, b, *_NONE))
    return head, pairs


def _empty_dict_step(i: int):
    def step(r):
        r[i] = {}
    return _source(step, [f"{{r{i}}} = {{{{}}}}"])


def _source(step, lines: list[str], **names):
    """``step`` with the statements that do what it does, for :func:`_compile` to write out in its
    place: ``lines``, format strings whose fields are registers (``r5``: what ``r[5]`` is) and
    ``names`` (the objects they refer to)."""
    step.source, step.names = lines, names
    return step


def _tuple_source(items) -> str:
    """What ``_getter(items)(r)`` makes, as an expression (registers as fields)."""
    return "(" + "".join(f"{{r{x}}}, " for x in items) + ")"


def _is_container(value: object) -> bool:
    return isinstance(value, _CONTAINERS)


def _flush(parts: list, pieces: list) -> None:
    """The chunk in ``parts`` (bytes, and (format, put) for a memo index) as a piece."""
    if not parts:
        return
    merged: list = [b""]  # bytes, then (format, put) and bytes by turns
    for part in parts:
        if type(part) is bytes:
            merged[-1] += part
        else:
            merged += [part, b""]
    parts.clear()
    if len(merged) == 1:
        pieces.append((_FIXED, merged[0], len(merged[0])))
        return
    fmt = struct.Struct("<" + "".join(f"{len(x)}s" if type(x) is bytes else x[0] for x in merged))
    pieces.append((_PACKED, _packer(fmt.pack, merged[0::2], [x[1] for x in merged[1::2]]), fmt.size))


def _packer(pack, b: list[bytes], r: list[int]):
    """The chunk's bytes as a function of the memo length ``n``: ``b[0]``, index ``n + r[0]``,
    ``b[1]`` … (the arguments written out for up to five indices: most chunks have one to five);
    its ``parts`` are ``(pack, b, r)``, for :func:`_compile`."""
    fn = _pack_fn(pack, b, r)
    fn.parts = (pack, tuple(b), tuple(r))
    return fn


def _pack_fn(pack, b: list[bytes], r: list[int]):
    if len(r) == 1:
        (b0, b1), (r0,) = b, r
        return lambda n: pack(b0, n + r0, b1)
    if len(r) == 2:
        (b0, b1, b2), (r0, r1) = b, r
        return lambda n: pack(b0, n + r0, b1, n + r1, b2)
    if len(r) == 3:
        (b0, b1, b2, b3), (r0, r1, r2) = b, r
        return lambda n: pack(b0, n + r0, b1, n + r1, b2, n + r2, b3)
    if len(r) == 4:
        (b0, b1, b2, b3, b4), (r0, r1, r2, r3) = b, r
        return lambda n: pack(b0, n + r0, b1, n + r1, b2, n + r2, b3, n + r3, b4)
    if len(r) == 5:
        (b0, b1, b2, b3, b4, b5), (r0, r1, r2, r3, r4) = b, r
        return lambda n: pack(b0, n + r0, b1, n + r1, b2, n + r2, b3, n + r3, b4, n + r4, b5)
    last = b[-1]
    return lambda n: pack(*[x for pair in zip(b, [n + rel for rel in r], strict=False) for x in pair], last)


def slot_ops(seg: Segment) -> frozenset[int]:
    """Every literal of ``seg`` a slot may read (a general template: any such item fits)."""
    return frozenset(k for k in seg.literals if seg.ops[k][0] in VARIABLE)



# ------------------------------------------------------------------------------------------------
# compiling

# items a template runs through Template.interpret before it is compiled: a compile (~0.5 ms for a
# tensor call's item, growing with the item's opcodes) then costs at most about what interpreting
# those items did, so a pickle whose shapes keep changing (each compiled anew) stays linear
COMPILE_AFTER = 64
_CODE: dict[str, object] = {}  # compiled code by source: templates of the same pieces share it (bounded)
_MAX_CODE = 4096


def _compile(t: Template):
    """``t``'s :meth:`Template.interpret` written out for its pieces: per item, the same tests
    and reads in the same order (a slot's opcode, its value, the chunk after it), then the same
    steps, memo appends and pushes. The pieces' bytes, packers and fixed values are the
    function's globals, so templates of the same shape share one compiled code object; the
    registers are its locals where every step has its statements (else the register list, which
    the other steps read). Nothing of the pickle's bytes is in the source: only opcodes, register
    numbers, lengths and relative memo indices, all ints."""
    env = {"_u16": _u16, "_i32": _i32, "_u32": _u32, "_slot": _slot, "_sw": _sw, "base": t.base}
    local = all(getattr(step, "source", None) is not None for step in t.step_list)
    regs = {}
    for i, static in enumerate(t.is_static):
        if static:
            env[f"s{i}"] = t.base[i]
        regs[f"r{i}"] = f"s{i}" if static else f"r{i}" if local else f"r[{i}]"
    body: list[str] = []

    def chunk(kind: int, c, length: int, name: str) -> None:
        if kind == _FIXED:
            env[name] = c
            body.append(f"if not sw({name}, p): break")
        elif kind == _PACKED:
            pack, bs, rs = c.parts
            env[name] = pack
            args = []
            for j, b in enumerate(bs):
                env[f"{name}_{j}"] = b
                args.append(f"{name}_{j}")
                if j < len(rs):
                    args.append(f"n + {rs[j]}" if rs[j] else "n")
            body.append(f"if not sw({name}({', '.join(args)}), p): break")
        else:
            return
        body.append(f"p += {length}")

    chunk(*t.head, "head")
    for i, (slot, reg, code, kind, c, length) in enumerate(t.pairs):
        body.append(f"if data[p] != {code}: break")
        target = regs[f"r{reg}"]
        if slot == _TEXT4:
            body += ["k = p + 5 + _u32(data, p + 1)[0]", "if k > end: break", f"{target} = data[p + 5 : k].decode()",
                     "p = k"]
        elif slot == _INT1:
            body += [f"{target} = data[p + 1]", "p += 2"]
        elif slot == _INT2:
            body += [f"{target} = _u16(data, p + 1)[0]", "p += 3"]
        elif slot == _INT4:
            body += [f"{target} = _i32(data, p + 1)[0]", "p += 5"]
        elif local and slot != _SKIP8:
            body += ["p = _slot(" + str(slot) + ", data, p + 1, end, one, 0)", f"{target} = one[0]"]
        else:
            body.append(f"p = _slot({slot}, data, p + 1, end, r, {reg})")
        chunk(kind, c, length, f"c{i}")
    for j, step in enumerate(t.step_list):
        if getattr(step, "source", None) is None:
            env[f"step_{j}"] = step
            body.append(f"step_{j}(r)")
            continue
        fields = {**regs, **{name: f"{name}_{j}" for name in step.names}}
        env.update({f"{name}_{j}": value for name, value in step.names.items()})
        body += [line.format(**fields) for line in step.source]
    after = []
    if t.puts:
        after += [f"memo_extend(({''.join(regs[f'r{x}'] + ', ' for x in t.seg.puts)}))", f"n += {t.puts}"]
    after.append(f"stack_extend(({''.join(regs[f'r{x}'] + ', ' for x in t.seg.pushes)}))")
    return _function(body, after, env)


def _function(body: list[str], after: list[str], env: dict):
    """The run function of a template whose item is ``body`` (matched and computed: a failure
    breaks off before anything of the item is kept) then ``after`` (memo appends, pushes), its
    globals ``env``; the code compiled once per source."""
    source = "\n".join([
        "def run(u, data, pos, stack, limit):",
        "    memo = u.memo",
        "    end, n, r, one = len(data), len(memo), base, [None]",
        "    sw = data.startswith if type(data) is bytes else _sw(data)",
        "    memo_extend, stack_extend = memo.extend, stack.extend",
        "    count = 0",
        "    while count < limit:",
        "        p = pos",
        "        try:",
        *("            " + line for line in body),
        "        except Exception:  # (a mismatch, or a refusal: the loop reads this item)",
        "            break",
        *("        " + line for line in after),
        "        pos = p",
        "        count += 1",
        "    return pos, count",
    ])
    code = _CODE.get(source)
    if code is None:
        code = compile(source, "<statekit template>", "exec")
        if len(_CODE) < _MAX_CODE:
            _CODE[source] = code
    exec(code, env)
    return env["run"]
