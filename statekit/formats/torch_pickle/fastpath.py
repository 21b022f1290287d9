"""torch.save's fast path: one tensor's whole ``_rebuild_tensor_v2`` call, recognised by its exact
opcode bytes and run at once with the same checks the opcode loop makes (:func:`tensor_call`).

The functions are methods of the interpreter's ``_Unpickler`` (its ``u``), which imports them."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

from statekit.formats.torch_pickle.allowlist import (
    _ORDERED_DICT,
    _REBUILD_TENSOR_V2,
    _call,
    _Callable,
    find_global,
)
from statekit.formats.torch_pickle.geometry import _DTYPE_CACHE, TensorInfo, _geometry, _tensor
from statekit.formats.torch_pickle.opcodes import (
    _BININT,
    _BININT1,
    _BININT2,
    _BINUNICODE,
    _I32,
    _INTS,
    _TUPLE1,
    _U16,
    _U32,
    _int_op,
)
from statekit.formats.torch_pickle.structure import MAX_DEPTH, _is_container
from statekit.tensor import FileSpan, TensorRef


def _small_tuple(ints: bytes | None, op: bytes | None) -> tuple | bool:
    """The size or stride tuple a tensor call builds from ints (BININT* then TUPLE1/2/3), or from
    nothing (EMPTY_TUPLE); False when the opcodes do not build what they seem to."""
    if ints is None:
        return ()
    if len(ints) == 2 and ints[0] == _BININT1:  # (one dimension below 256: most of them)
        return (ints[1],) if op[0] == _TUPLE1 else False
    values, i = [], 0
    while i < len(ints):
        width = _INTS[ints[i]]
        values.append(_int_op(ints[i : i + 1 + width]))
        i += 1 + width
    return tuple(values) if len(values) == op[0] - _TUPLE1 + 1 else False


def _tensor_call_pattern() -> re.Pattern:
    """The opcodes of one ``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
    OrderedDict())`` call as torch.save (protocol 2) writes it, from the MARK after the callable:
    every argument but the ints comes from the memo (BINGET/LONG_BINGET), every object built is
    memoized (BINPUT/LONG_BINPUT)."""
    get, put = rb"(h.|j.{4})", rb"(q.|r.{4})"
    integer = rb"(K.|M.{2}|J.{4})"
    ints = rb"((?:K.|M.{2}|J.{4}){1,3})"
    small_tuple = rb"(?:" + get + rb"|" + ints + rb"([\x85-\x87])" + put + rb"|\))"
    pattern = (rb"\(\(" + get + get + rb"(?:" + get + rb"|X([\x01-\x14])\x00\x00\x00([0-9]+)" + put + rb")"
               + get + integer + rb"t" + put + rb"Q" + integer + small_tuple + small_tuple + rb"([\x88\x89])"
               + get + rb"\)R" + put + rb"t" + put + rb"R" + put)
    return re.compile(pattern, re.DOTALL)


def _inline_call_pattern() -> re.Pattern:
    """The same call as another writer pickles it without a memo (``Pickler.fast``, older
    versions, other libraries): every global, string and ``OrderedDict()`` written out again, no
    BINPUT; any argument may also come from the memo (BINGET/LONG_BINGET)."""
    get = rb"(h.|j.{4})"
    integer = rb"(K.|M.{2}|J.{4})"
    ints = rb"((?:K.|M.{2}|J.{4}){1,3})"
    small_tuple = rb"(?:" + get + rb"|" + ints + rb"([\x85-\x87])|\))"
    pattern = (rb"\(\((?:X\x07\x00\x00\x00storage|" + get + rb")"
               + rb"(?:c([A-Za-z0-9_.]{1,64})\n([A-Za-z0-9_]{1,64})\n|" + get + rb")"
               + rb"(?:X([\x01-\x14])\x00\x00\x00([0-9]{1,20})|" + get + rb")"
               + rb"(?:X([\x01-\x20])\x00\x00\x00([A-Za-z0-9:_]{1,32})|" + get + rb")"
               + integer + rb"tQ" + integer + small_tuple + small_tuple + rb"([\x88\x89])"
               + rb"(?:ccollections\nOrderedDict\n|" + get + rb")\)RtR")
    return re.compile(pattern, re.DOTALL)


_TENSOR_CALL = _tensor_call_pattern()
_KEYED_CALL = re.compile(rb"(q.|r.{4})(h.|j.{4})" + _TENSOR_CALL.pattern, re.DOTALL)  # after a BINUNICODE
_PUT_RUNS = {k: struct.Struct("<" + "xI" * k) for k in range(1, 9)}  # k LONG_BINPUTs -> their indices
_INLINE_CALL = _inline_call_pattern()
_TENSOR_CALL_OPS = 25  # opcodes one such call runs, counted toward MAX_STEPS (a few more or fewer)
_INLINE_CALL_OPS = 21


def keyed_call(u, groups: tuple, stack: list) -> bool:
    """:meth:`tensor_call` after the BINPUT of the string on top (a dict key) and the BINGET of
    the callable, as :data:`_KEYED_CALL` matched them; False — nothing done — if not quite."""
    memo, get = u.memo, int.from_bytes(groups[1][1:], "little")
    func = memo[get] if type(memo) is list and get < len(memo) else None
    return type(func) is _Callable and u.tensor_call(groups[2:], stack, (groups[0], func))


def tensor_call(u, groups: tuple, stack: list, keyed: tuple | None = None) -> bool:
    """Run a whole ``_rebuild_tensor_v2`` call that :data:`_TENSOR_CALL` matched (MARK to the
    REDUCE's BINPUT) as its ~25 opcodes would, with the same checks, in the canonical case only:
    every BINGET reads an entry that exists, the BINPUTs append to the memo in order. False —
    nothing done — otherwise (the loop then runs the opcodes). ``keyed``: the BINPUT of the
    string on top and the callable a BINGET pushes, which come first."""
    (storage_name, stype, key_get, key_len, key, key_put, location, numel, pid_put, offset,
     size_get, size_ints, size_op, size_put, stride_get, stride_ints, stride_op, stride_put, grad,
     od_get, od_put, args_put, out_put) = groups
    memo, index = u.memo, int.from_bytes
    if type(memo) is not list or len(u.metastack) + 2 > MAX_DEPTH:
        return False
    puts = b"".join(filter(None, (keyed and keyed[0], key_put, pid_put, size_put, stride_put, od_put, args_put,
                                  out_put)))
    k = 4 + (keyed is not None) + (key_put is not None) + (size_put is not None) + (stride_put is not None)
    if len(puts) != 5 * k or _PUT_RUNS[k].unpack(puts) != tuple(range(len(memo), len(memo) + k)):
        return False  # (LONG_BINPUTs appending in order; anything else runs opcode by opcode)
    try:
        same, reads = u.last_call, groups[:8]
        reuse = key is None and same[0] == reads and same[1] == u.overwrites
        if not reuse:
            storage_name, stype = memo[index(storage_name[1:], "little")], memo[index(stype[1:], "little")]
            location = memo[index(location[1:], "little")]
            key = memo[index(key_get[1:], "little")] if key is None else key.decode()
        size = memo[index(size_get[1:], "little")] if size_get else _small_tuple(size_ints, size_op)
        stride = memo[index(stride_get[1:], "little")] if stride_get else _small_tuple(stride_ints, stride_op)
        od_func = memo[index(od_get[1:], "little")]
    except IndexError:  # an entry not yet (or never) made
        return False
    if size is False or stride is False or (key_len is not None and len(key) != key_len[0]):
        return False
    # from here on, exactly what the opcodes do
    new = [stack[-1]] if keyed else []
    if keyed:
        stack.append(keyed[1])
    if reuse:
        pid, storage = same[2], same[3]  # the previous call's id, from the same memo entries: equal
    else:
        if key_put:
            new.append(key)
        pid = (storage_name, stype, key, location, _int_op(numel))
        if not (type(storage_name) is str and type(key) is str and type(location) is str):
            pid = u.nest(pid, pid)  # (a _StorageType is no container)
        storage = u.persistent_load(pid)
        u.last_call = (reads, u.overwrites, pid, storage)
    new.append(pid)
    if size_put:
        new.append(size)
    if stride_put:
        new.append(stride)
    backward_hooks = {} if od_func is _ORDERED_DICT else _call(od_func, ())
    args = (storage, _int_op(offset), size, stride, grad == b"\x88", backward_hooks)
    depths = u.depths
    if not (type(size) is tuple and type(stride) is tuple and id(size) not in depths and id(stride) not in depths
            and id(backward_hooks) not in depths):
        u.nest(args, args)
    # else depth 2 (flat size and stride), not recorded: one entry per tensor saved; should a later
    # BINGET nest the tuple, check_structure still bounds the depth of what the pickle returns
    if stack[-1] is _REBUILD_TENSOR_V2 and type(backward_hooks) is dict:  # what its stand-in does
        stack[-1] = _tensor(storage, args[1], size, stride, None, args[4])
    else:
        stack[-1] = _call(stack[-1], args)
    new += (backward_hooks, args, stack[-1])
    memo += new
    return True


def _get(memo, op: bytes) -> object:
    """What a BINGET / LONG_BINGET (``op``, with its argument) pushes; IndexError/KeyError if none."""
    return memo[int.from_bytes(op[1:], "little")]


def cached_global(u, module: bytes, name: bytes) -> object:
    """``find_global`` of a GLOBAL's two lines, remembered per pickle (the allow-list is fixed)."""
    found = u.globals.get((module, name))
    if found is None:
        found = u.globals[(module, name)] = find_global(module.decode(), name.decode(), u.extra_globals)
    return found


def inline_call(u, groups: tuple, stack: list) -> bool:
    """Run a whole call that :data:`_INLINE_CALL` matched (MARK to its REDUCE, no memo written) as
    its ~21 opcodes would, with the same checks and in their order; False — nothing done — when
    a memo entry it reads is not there or the opcodes do not build what they seem to (the loop
    then runs them and says why)."""
    (name_get, st_module, st_name, st_get, key_len, key, key_get, loc_len, location, loc_get, numel, offset,
     size_get, size_ints, size_op, stride_get, stride_ints, stride_op, grad, od_get) = groups
    if len(u.metastack) + 2 > MAX_DEPTH:
        return False
    if (key is not None and len(key) != key_len[0]) or (location is not None and len(location) != loc_len[0]):
        return False
    memo = u.memo
    try:  # every memo read first: a missing entry leaves everything to the loop
        size = _get(memo, size_get) if size_get else _small_tuple(size_ints, size_op)
        stride = _get(memo, stride_get) if stride_get else _small_tuple(stride_ints, stride_op)
        od_func = _get(memo, od_get) if od_get else None
        reads = groups[:11]
        inline = name_get is None and st_get is None and key_get is None and loc_get is None
        if not (inline and u.last_inline[0] == reads):
            storage_name = "storage" if name_get is None else _get(memo, name_get)
            stype = _get(memo, st_get) if st_get is not None else None
            key = key.decode() if key is not None else _get(memo, key_get)
            location = location.decode() if location is not None else _get(memo, loc_get)
    except (IndexError, KeyError):
        return False
    if size is False or stride is False:
        return False
    # from here on, exactly what the opcodes do
    if inline and u.last_inline[0] == reads:
        storage = u.last_inline[1]  # the same bytes as the previous call's id: the same storage
    else:
        if stype is None:
            stype = cached_global(u, st_module, st_name)
        pid = (storage_name, stype, key, location, _int_op(numel))
        if any(map(_is_container, pid)):
            pid = u.nest(pid, pid)
        storage = u.persistent_load(pid)
        u.last_inline = (reads, storage) if inline else ((), None)
    if od_func is None:
        od_func = cached_global(u, b"collections", b"OrderedDict")
    backward_hooks = {} if od_func is _ORDERED_DICT else _call(od_func, ())
    args = (storage, _int_op(offset), size, stride, grad == b"\x88", backward_hooks)
    depths = u.depths
    if not (type(size) is tuple and type(stride) is tuple and id(size) not in depths and id(stride) not in depths
            and id(backward_hooks) not in depths):
        u.nest(args, args)
    if stack[-1] is _REBUILD_TENSOR_V2 and type(backward_hooks) is dict:  # what its stand-in does
        stack[-1] = _tensor(storage, args[1], size, stride, None, args[4])
    else:
        stack[-1] = _call(stack[-1], args)
    return True


# ------------------------------------------------------------------------------------------------
# runs of memo-less calls viewing one storage


_REBUILD_GLOBAL = b"ctorch._utils\n_rebuild_tensor_v2\n"
_OFFSET_GROUP = 12  # (of _INLINE_CALL: the storage offset's int opcode)
_INLINE_RUN_OPS = 3 + _INLINE_CALL_OPS  # BINUNICODE, GLOBAL, MARK, then the call


def inline_template(u, data, match, after: int, func: object, ref: object) -> tuple | None:
    """What :func:`inline_run` needs to repeat the call ``match`` just ran (``func`` called, ``ref``
    built), or None when the next pair does not repeat it or it cannot be repeated byte for byte:
    every argument written inline (no memo read), the callable torch.save's ``_rebuild_tensor_v2``
    named by a GLOBAL, and a plain view of a storage (what :func:`_tensor` builds first)."""
    if type(data) is not bytes or data[after : after + 1] != b"X" or after + 5 > len(data):
        return None
    head = _REBUILD_GLOBAL + data[match.start() : match.start(_OFFSET_GROUP)]
    tail = data[match.end(_OFFSET_GROUP) : match.end()]
    k = after + 5 + _U32.unpack_from(data, after + 1)[0]
    o = k + len(head)
    if not (data.startswith(head, k) and data.startswith(tail, o + 1 + _INTS.get(data[o] if o < len(data) else 0, 0))):
        return None  # (the next pair is not this call again: nothing more is done for it)
    groups = match.groups()
    if (func is not _REBUILD_TENSOR_V2 or type(ref) is not TensorRef or type(ref.info) is not TensorInfo
            or ref.info.own is not None or ref.array_loader is not None
            or any(groups[i] is not None for i in (0, 3, 6, 9, 12, 15, 19))
            or cached_global(u, b"torch._utils", b"_rebuild_tensor_v2") is not _REBUILD_TENSOR_V2
            or cached_global(u, b"collections", b"OrderedDict") is not _ORDERED_DICT):
        return None
    storage = u.last_inline[1]
    name, _, itemsize = _DTYPE_CACHE[storage.dtype]
    size, stride = ref.shape, ref.info.stride
    numel, extent, _ = _geometry(size, stride, itemsize, storage.key)
    span = storage.span
    if name != ref.dtype or (span is None) != (ref.span is None):
        return None
    return (head, tail, storage, size, stride, name, ref.info.shared, itemsize, numel, extent,
            storage.nbytes // itemsize, span)


def inline_run(u, run: tuple, data: bytes, pos: int, stack: list) -> tuple[int, int]:
    """The (dict key, tensor) pairs from ``pos`` that repeat the ``run`` (:func:`inline_template`) call byte for byte but
    for the key and the storage offset — a BINUNICODE, the GLOBAL, the call — pushed as their
    opcodes would push them: (the offset after the last, opcodes run). It stops (and leaves the
    rest to the loop) at anything else: another opcode, other bytes, an offset that is negative
    or past the storage's end, a key that is not UTF-8."""
    (head, tail, storage, size, stride, name, shared, itemsize, numel, extent, capacity, span) = run
    skey, length, end, steps = storage.key, numel * itemsize, len(data), 0
    span_at, file, base = FileSpan.at, span and span.file, span and span.offset
    lh, lt = len(head), len(tail)
    if len(u.metastack) + 2 > MAX_DEPTH:
        return pos, 0
    u32, u16, i32, append = _U32.unpack_from, _U16.unpack_from, _I32.unpack_from, stack.append
    while pos + 5 <= end and data[pos] == _BINUNICODE:
        k = pos + 5 + u32(data, pos + 1)[0]
        if not data.startswith(head, k):
            break
        o = k + lh
        code = data[o] if o < end else -1
        if code == _BININT1 and o + 2 <= end:
            offset, q = data[o + 1], o + 2
        elif code == _BININT2 and o + 3 <= end:
            offset, q = u16(data, o + 1)[0], o + 3
        elif code == _BININT and o + 5 <= end:
            offset, q = i32(data, o + 1)[0], o + 5
        else:
            break
        if offset < 0 or (numel and offset + extent >= capacity) or not data.startswith(tail, q):
            break
        try:
            key = data[pos + 5 : k].decode()
        except UnicodeDecodeError:
            break
        info = TensorInfo(shared, skey, offset, stride)
        if span is not None:
            ref = TensorRef(name, size, info=info, span=span_at(file, base + offset * itemsize, length))
        else:
            start = offset * itemsize
            ref = TensorRef(name, size, loader=lambda start=start: storage.resolve()[start : start + length], info=info)
        append(key)
        append(ref)
        steps += _INLINE_RUN_OPS
        pos = q + lt
    return pos, steps


# runs of torch.save's calls viewing one storage


_KEYED_RUN_OPS = 1 + _TENSOR_CALL_OPS + 3  # BINUNICODE, then what keyed_call counts
_BINPERSID_CODE = 0x51


def _puts_after(segments: list[bytes]) -> tuple[int, Callable[[int], bytes]]:
    """The length of ``segments`` each followed by a LONG_BINPUT, and a function of the first
    put's memo index giving those bytes (the following puts' indices one more each)."""
    segments = [seg + b"r" for seg in segments]
    fmt = struct.Struct("<" + "".join(f"{len(seg)}sI" for seg in segments))
    pack = fmt.pack
    if len(segments) == 2:
        a, b = segments
        return fmt.size, lambda n: pack(a, n, b, n + 1)
    if len(segments) == 3:
        a, b, c = segments
        return fmt.size, lambda n: pack(a, n, b, n + 1, c, n + 2)
    if len(segments) == 4:
        a, b, c, d = segments
        return fmt.size, lambda n: pack(a, n, b, n + 1, c, n + 2, d, n + 3)
    a, b, c, d, e = segments
    return fmt.size, lambda n: pack(a, n, b, n + 1, c, n + 2, d, n + 3, e, n + 4)


def keyed_template(u, data, match, after: int, ref: object) -> tuple | None:
    """What :func:`keyed_run` needs to repeat the keyed call ``match`` just ran in its reuse case
    (the persistent id's memo reads those of the call before, no entry overwritten since) — or
    None when the next pair does not repeat it or it cannot be repeated: the storage's key read
    from the memo, the callable ``_rebuild_tensor_v2``, a plain view (what :func:`_tensor`
    builds first)."""
    if type(data) is not bytes or data[after : after + 1] != b"X" or after + 5 > len(data):
        return None
    groups = match.groups()
    if groups[4] is None:  # (the storage's key written out: not a repeat)
        return None
    s1 = data[match.start(2) : match.start(11)]  # the callable's read to the persistent id's TUPLE
    segments, seg, inline = [], b"", []  # after the offset: the bytes between LONG_BINPUTs
    for get, ints_op in ((13, 15), (17, 19)):  # size, stride: a memo read, (), or built and memoized
        inline.append(groups[ints_op - 2] is not None)
        if inline[-1]:
            segments.append(seg + data[match.start(ints_op - 1) : match.end(ints_op)])
            seg = b""
        else:
            seg += data[match.start(get) : match.end(get)] if groups[get - 1] is not None else b")"
    segments += [seg + data[match.start(21) : match.end(22)] + b")R", b"t", b"R"]
    pre_length, pre = _puts_after([b"", s1])
    post_length, post = _puts_after(segments)
    n = len(u.memo)
    k = after + 5 + _U32.unpack_from(data, after + 1)[0]
    o = k + pre_length + 1
    if not (data.startswith(pre(n), k) and data[o - 1] == _BINPERSID_CODE and o < len(data)
            and data.startswith(post(n + 2), o + 1 + _INTS.get(data[o], len(data)))):
        return None  # (the next pair is not this call again)
    memo = u.memo
    func, od_func = _get(memo, groups[1]), _get(memo, groups[21])
    storage, pid = u.last_call[3], u.last_call[2]
    if (type(memo) is not list or func is not _REBUILD_TENSOR_V2 or od_func is not _ORDERED_DICT
            or type(ref) is not TensorRef or type(ref.info) is not TensorInfo or ref.info.own is not None
            or ref.array_loader is not None):
        return None
    size, stride = ref.shape, ref.info.stride
    if (type(size) is not tuple or type(stride) is not tuple or id(size) in u.depths or id(stride) in u.depths
            or (groups[12] is not None and _get(memo, groups[12]) is not size)
            or (groups[16] is not None and _get(memo, groups[16]) is not stride)):
        return None
    name, _, itemsize = _DTYPE_CACHE[storage.dtype]
    numel, extent, _ = _geometry(size, stride, itemsize, storage.key)
    span = storage.span
    if name != ref.dtype or (span is None) != (ref.span is None):
        return None
    built = ((size,) if inline[0] else ()) + ((stride,) if inline[1] else ())
    return (pre, pre_length, post, post_length, storage, pid, built, size, stride, groups[20] == b"\x88", name,
            ref.info.shared, itemsize, numel, extent, storage.nbytes // itemsize, span)


def keyed_run(u, run: tuple, data: bytes, pos: int, stack: list) -> tuple[int, int]:
    """The (dict key, tensor) pairs from ``pos`` that repeat the ``run`` (:func:`keyed_template`)
    call of torch.save's form byte for byte but for the key, the storage offset and the memo
    indices its LONG_BINPUTs append (in order), pushed and memoized as their opcodes would
    do (a size or stride built inline: the same tuple for the whole run): (the offset after
    the last, opcodes run). It stops — and leaves the rest to the loop — at anything else, an
    offset that is negative or past the storage's end, a key that is not UTF-8."""
    (pre, pre_length, post, post_length, storage, pid, built, size, stride, grad, name, shared, itemsize, numel,
     extent, capacity, span) = run
    memo = u.memo
    if type(memo) is not list or len(u.metastack) + 2 > MAX_DEPTH:
        return pos, 0
    skey, length, end, steps, n = storage.key, numel * itemsize, len(data), 0, len(memo)
    span_at, file, base = FileSpan.at, span and span.file, span and span.offset
    count = 5 + len(built)  # memo entries a call appends
    u32, u16, i32, append, extend = _U32.unpack_from, _U16.unpack_from, _I32.unpack_from, stack.append, memo.extend
    while pos + 5 <= end and data[pos] == _BINUNICODE:
        k = pos + 5 + u32(data, pos + 1)[0]
        o = k + pre_length + 1
        if o >= end or not data.startswith(pre(n), k) or data[o - 1] != _BINPERSID_CODE:
            break
        code = data[o]
        if code == _BININT1 and o + 2 <= end:
            offset, q = data[o + 1], o + 2
        elif code == _BININT2 and o + 3 <= end:
            offset, q = u16(data, o + 1)[0], o + 3
        elif code == _BININT and o + 5 <= end:
            offset, q = i32(data, o + 1)[0], o + 5
        else:
            break
        if offset < 0 or (numel and offset + extent >= capacity) or not data.startswith(post(n + 2), q):
            break
        try:
            key = data[pos + 5 : k].decode()
        except UnicodeDecodeError:
            break
        info = TensorInfo(shared, skey, offset, stride)
        if span is not None:
            ref = TensorRef(name, size, info=info, span=span_at(file, base + offset * itemsize, length))
        else:
            start = offset * itemsize
            ref = TensorRef(name, size, loader=lambda start=start: storage.resolve()[start : start + length], info=info)
        hooks = {}
        extend((key, pid, *built, hooks, (storage, offset, size, stride, grad, hooks), ref))
        append(key)
        append(ref)
        n += count
        steps += _KEYED_RUN_OPS
        pos = q + post_length
    return pos, steps
