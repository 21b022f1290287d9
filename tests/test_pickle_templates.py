"""Templates (statekit.formats.torch_pickle.template, .repeats) against the opcode loop alone.

A container's repeating items are read by templates learned from the pickle itself, whatever
opcodes its writer chose. Every test reads the same pickle twice — with templates, and with the
loop alone (``_Unpickler.templates = False``) — and the two must agree: the same objects, or the
same error word for word. References: real torch.save (its own form, without a memo, with
MARK…TUPLE tuples, protocols 2–5) and torch.load; hand-written bytes where single bytes must
change from one call to the next.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import random
import struct
import types
import zipfile

import numpy as np
import pytest
from test_torch_pickle import op_global, op_str, wrap

from statekit.errors import FormatError, UnsafePickleError
from statekit.formats import torch_pickle
from statekit.formats.torch_pickle import Storage, StorageId, interpreter, template
from statekit.formats.torch_pickle.repeats import Repeats
from statekit.tensor import TensorRef

TEMPLATES_AFTER = interpreter._Unpickler.templates_after  # the default, before the fixture below


@pytest.fixture(autouse=True)
def templates_from_the_first_opcode(monkeypatch):
    """These pickles are short: templates are tried from their first opcode on (by default only
    once the loop has run ``_Unpickler.templates_after``: test_templates_wait_for_a_long_pickle)."""
    monkeypatch.setattr(interpreter._Unpickler, "templates_after", 0)


def torch_saved(obj: object) -> tuple[bytes, dict[str, bytes]]:
    """data.pkl and the storages of what real torch.save writes for ``obj``."""
    return torch_saved_with(obj)[1:]


def views_and_state() -> object:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    base, big = torch.arange(40.0), torch.zeros(70_000, dtype=torch.float64)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    views = {"slice": base[5:9], "t": base.view(5, 8).t(), "empty": base[:0], "scalar": base[7],
             "rank3": base[:24].view(2, 3, 4), "rank4": base[:16].view(2, 2, 2, 2), "far": big[66_000:66_003],
             "grad": torch.ones(3, requires_grad=True), "ints": torch.arange(5)}
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "views": views,
            "many": {f"v{i}": base[i % 40 : i % 40 + 1] for i in range(300)}}


def load_both(pkl: bytes, storages: dict[str, bytes], monkeypatch, files=None,
              messages: bool = False) -> tuple[object, object, int]:
    """The outcome with templates and with the opcode loop alone, and the items templates ran.
    ``files``: a folder where each storage is written to a file its tensors read (FileSpan), as
    a .pt's are; ``messages``: an error is its class and message (else its class alone)."""
    from statekit.tensor import FileSpan, SourceFile

    cache: dict[str, Storage] = {}

    def loader(sid: StorageId) -> Storage:
        data = memoryview(storages[sid.key])
        if len(data) != sid.nbytes:
            raise FormatError("storage size")
        if files is None:
            return Storage(sid, lambda: data)
        if sid.key not in cache:  # one Storage a key, as torch_pt's loader keeps them
            path = files / f"storage-{sid.key}"
            path.write_bytes(data)
            cache[sid.key] = storage = Storage(sid, lambda: data)
            storage.span = FileSpan(SourceFile.open(str(path)), 0, len(data))
        return cache[sid.key]

    def outcome() -> object:
        try:
            return normalized(torch_pickle.loads(pkl, storage_loader=loader)[0])
        except FormatError as exc:
            return (type(exc), str(exc)) if messages else type(exc)

    made: list[Repeats] = []

    class Counted(Repeats):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(interpreter, "Repeats", Counted)
    templated = outcome()
    monkeypatch.setattr(interpreter._Unpickler, "templates", False)
    return templated, outcome(), sum(r.items for r in made)


def templated_share(pkl: bytes, storages: dict[str, bytes], monkeypatch) -> float:
    """The share of the pickle's opcodes that templates ran."""
    made: list[Repeats] = []

    class Counted(Repeats):
        def __init__(self):
            super().__init__()
            made.append(self)

    with monkeypatch.context() as patch:
        patch.setattr(interpreter, "Repeats", Counted)
        patch.setattr(interpreter._Unpickler, "templates", True)  # (load_both turns them off)
        torch_pickle.loads(pkl, storage_loader=lambda sid: Storage(sid, lambda: memoryview(storages[sid.key])))
    return made[0].ops / sum(1 for _ in pickletools.genops(pkl))


def assert_agree_when_damaged(pkl: bytes, storages: dict[str, bytes], monkeypatch, seed: int, low: int,
                              tokens: bytes, files=None) -> None:
    """150 copies of ``pkl`` with 1–3 bytes from ``low`` on changed (to any byte, or one of
    ``tokens``): templates give the opcode loop's result or its error class, never something else."""
    rng = random.Random(seed)
    for _ in range(150):
        damaged = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(low, len(pkl))] = rng.choice([rng.randrange(256), *tokens])
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(bytes(damaged), storages, patch, files=files)
        assert fast == slow


def normalized(value: object) -> object:
    if isinstance(value, TensorRef):
        span = value.span and (value.span.offset, value.span.length)
        return ("tensor", value.dtype, value.shape, dict(value.info), bytes(value.raw()), span)
    if isinstance(value, dict):
        return ("dict", [(k, normalized(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [normalized(v) for v in value])
    return value


def test_templates_read_torch_saves_pickle_as_the_opcode_loop_does(monkeypatch):
    pkl, storages = torch_saved(views_and_state())
    fast, slow, calls = load_both(pkl, storages, monkeypatch)
    assert fast == slow
    assert calls > 300  # nearly every tensor ran through a template
    views = dict(dict(fast[1])["views"][1])
    assert views["far"][3]["storage_offset"] == 66_000 and views["t"][3]["stride"] == (1, 8)
    assert views["grad"][3]["requires_grad"] and views["scalar"][2] == ()


def test_templates_agree_with_the_loop_on_damaged_torch_save_pickles(monkeypatch):
    """Bytes changed inside the tensor calls (memo indices, ints, opcodes)."""
    pkl, storages = torch_saved({f"v{i}": t for i, t in enumerate(views_and_state()["views"].values())}
                                | {"many": views_and_state()["many"]})
    assert_agree_when_damaged(pkl, storages, monkeypatch, 14, len(pkl) // 2, pkl[:40])


class FastPickler(pickle.Pickler):
    """CPython's pickler keeping no memo (``Pickler.fast``): every global, string and
    OrderedDict() written out each time, as other writers and older versions do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = True


def torch_saved_without_memo(obj: object) -> tuple[bytes, dict[str, bytes]]:
    """data.pkl and the storages of real torch.save for ``obj`` with :class:`FastPickler`:
    torch's own reducers and persistent ids, another opcode sequence."""
    return torch_saved_with(obj, FastPickler)[1:]


def test_templates_read_a_pickle_without_memo_as_the_opcode_loop_does(monkeypatch):
    obj = views_and_state()
    pkl, storages = torch_saved_without_memo(obj)
    assert not {op.name for op, _, _ in pickletools.genops(pkl)} & {"BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET"}
    fast, slow, calls = load_both(pkl, storages, monkeypatch)
    assert fast == slow
    assert calls > 300
    canonical, _ = torch_saved(obj)
    monkeypatch.undo()
    same, _, _ = load_both(canonical, torch_saved(obj)[1], monkeypatch)
    assert same == fast  # the same tensors, names and values as torch.save's own form


def test_templates_agree_with_the_loop_on_damaged_memo_less_pickles(monkeypatch):
    pkl, storages = torch_saved_without_memo({f"v{i}": t for i, t in enumerate(views_and_state()["views"].values())}
                                             | {"many": views_and_state()["many"]})
    assert_agree_when_damaged(pkl, storages, monkeypatch, 21, len(pkl) // 2, pkl[:40])


# runs of memo-less calls viewing one storage: hand-written in Pickler.fast's bytes (or with
# MARK…TUPLE tuples), so that single bytes can differ from one call to the next


def memo_less_views(entries: list[dict], numel: int = 70_000, mark_tuples: bool = False) -> bytes:
    """``OrderedDict(name -> _rebuild_tensor_v2(...))`` as CPython's pickler writes torch.save's
    objects without a memo (protocol 2, ``Pickler.fast``), SETITEMS every 1000 pairs. Each entry
    may set ``name`` (raw UTF-8 bytes), ``offset`` (int, or an int opcode's bytes), ``size`` and
    ``stride`` (tuples), ``grad`` (bool), ``key`` (the storage's). ``mark_tuples``: sizes and
    strides as ``MARK … TUPLE`` (protocol 1's tuples) instead of TUPLE1/2/3."""
    def small(values: tuple) -> bytes:
        if not values:
            return b")"
        ints = b"".join(op_small(v) for v in values)
        if mark_tuples or len(values) > 3:  # (CPython's pickler too, past three items)
            return pickle.MARK + ints + pickle.TUPLE
        return ints + bytes([pickle.TUPLE1[0] + len(values) - 1])

    def op_small(v: int) -> bytes:
        return (pickle.BININT1 + bytes([v]) if v < 256 else pickle.BININT2 + struct.pack("<H", v) if v < 65536
                else pickle.BININT + struct.pack("<i", v))

    pairs = []
    for i, e in enumerate(entries):
        name = e.get("name", f"t{i}".encode())
        offset = e.get("offset", i)
        pid = (b"((" + op_str("storage") + op_global("torch", "FloatStorage") + op_str(e.get("key", "0"))
               + op_str("cpu") + pickle.BININT + struct.pack("<i", numel) + b"tQ")
        pairs.append(pickle.BINUNICODE + struct.pack("<I", len(name)) + name + op_global("torch._utils", "_rebuild_tensor_v2")
                     + pid + (offset if isinstance(offset, bytes) else op_small(offset))
                     + small(e.get("size", (1,))) + small(e.get("stride", (1,)))
                     + (pickle.NEWTRUE if e.get("grad") else pickle.NEWFALSE)
                     + op_global("collections", "OrderedDict") + b")RtR")
    body = op_global("collections", "OrderedDict") + b")R"
    for k in range(0, len(pairs), 1000):
        body += pickle.MARK + b"".join(pairs[k : k + 1000]) + pickle.SETITEMS
    return wrap(body)


def views_storages(numel: int = 70_000) -> dict[str, bytes]:
    return {k: np.arange(numel, dtype=np.float32).tobytes() for k in ("0", "1")}


@pytest.mark.parametrize("spans", [False, True], ids=["loader", "file-span"])
def test_runs_of_memo_less_views_read_what_the_opcode_loop_reads(monkeypatch, tmp_path, spans):
    """2,500 views of one storage (three SETITEMS) with offsets in all three int opcodes, and
    calls among them that differ from the one before: another size, stride, rank, empty, grad,
    storage; the same tensors as opcode by opcode, nearly all run at once."""
    entries = [{"offset": o} for o in [*range(0, 1000), *range(60_000, 60_700), *range(300, 1100)]]
    for i, change in [(5, {"size": (2,)}), (6, {"size": (2,)}), (40, {"size": (0,)}), (41, {"size": (), "stride": ()}),
                      (42, {"size": (2, 3), "stride": (3, 1)}), (43, {"size": (3, 2), "stride": (1, 3)}),
                      (900, {"grad": True}), (901, {"grad": True}), (1200, {"key": "1"}), (1201, {"key": "1"}),
                      (1700, {"stride": (5,)}), (2100, {"name": "é∂".encode()})]:
        entries[i] = entries[i] | change
    fast, slow, calls = load_both(memo_less_views(entries), views_storages(), monkeypatch,
                                  files=tmp_path if spans else None)
    assert fast == slow
    assert calls >= 2400
    tensors = dict(fast[1])
    assert len(tensors) == 2500
    assert tensors["t1000"][2] == (1,) and tensors["t1000"][3]["storage_offset"] == 60_000
    assert tensors["t42"][2] == (2, 3) and tensors["t900"][3]["requires_grad"]
    assert tensors["t1200"][3]["storage_key"] == "1" and "é∂" in tensors
    assert tensors["t2499"][4] == np.float32(1099).tobytes()
    if spans:
        assert tensors["t1000"][5] == (60_000 * 4, 4)


@pytest.mark.parametrize("spans", [False, True], ids=["loader", "file-span"])
@pytest.mark.parametrize("change", [
    {"offset": 69_999 + 1}, {"offset": pickle.BININT + struct.pack("<i", -1)}, {"offset": 2**31 - 1},
    {"name": b"\xff"}, {"name": b"\xed\xa0\x80"}, {"size": (2,), "offset": 69_999},
    {"offset": pickle.BINFLOAT + struct.pack(">d", 3.0)}, {"offset": pickle.NONE},
], ids=["past-the-end", "negative", "huge", "not-utf8", "surrogate", "overhangs", "float", "none"])
def test_a_run_stops_at_a_bad_call_with_the_opcode_loops_error(monkeypatch, tmp_path, spans, change):
    """One bad call in the middle of a run of views (its 1,500th): the error message is the opcode
    loop's, word for word."""
    entries = [{} for _ in range(3000)]
    entries[1500] = change
    fast, slow, calls = load_both(memo_less_views(entries), views_storages(), monkeypatch,
                                  files=tmp_path if spans else None, messages=True)
    assert fast == slow
    assert isinstance(fast, tuple) and fast[0] in (FormatError, UnsafePickleError), fast


def test_a_truncated_run_is_the_opcode_loops_error(monkeypatch):
    pkl = memo_less_views([{} for _ in range(1200)])
    for cut in (len(pkl) // 3, len(pkl) // 3 + 7, len(pkl) // 2 + 1, len(pkl) - 40):
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(pkl[:cut], views_storages(), patch, messages=True)
        assert fast == slow and fast[0] is FormatError and "truncated" in fast[1]


@pytest.mark.parametrize("compile_after", [0, 64], ids=["compiled-at-once", "interpreted-first"])
def test_runs_agree_on_damaged_pickles(monkeypatch, tmp_path, compile_after):
    """Random bytes changed inside a run of memo-less views (every template compiled before its
    first item, or after the usual 64 interpreted ones)."""
    monkeypatch.setattr(template, "COMPILE_AFTER", compile_after)
    pkl = memo_less_views([{"offset": 3 * i} for i in range(400)])
    assert_agree_when_damaged(pkl, views_storages(), monkeypatch, 35, 200, b"KMJXtQRu(\x85\x86\x88\x89", tmp_path)


# runs of torch.save's own calls viewing one storage: real torch.save pickles, some with one
# call's bytes edited (a pickle holds no byte offsets: lengths may change)


def saved_views(n: int = 2500, changes: dict | None = None) -> tuple[bytes, dict[str, bytes]]:
    """torch.save of ``{f"v{i}": base[30 i : 30 i + 1]}`` (offsets in all three int opcodes,
    SETITEMS every 1000), ``changes`` putting other tensors at some positions."""
    torch = pytest.importorskip("torch")
    base = torch.arange(80_000, dtype=torch.float32)
    views = {f"v{i}": base[30 * i : 30 * i + 1] for i in range(n)}
    for i, make in (changes or {}).items():
        views[f"v{i}"] = make(base, torch)
    return torch_saved(views)


def edited(pkl: bytes, name: str, edit) -> bytes:
    """``pkl`` with the call after the key ``name`` changed: ``edit(op, arg, raw)`` for its
    storage offset's int opcode returns the bytes to put there instead (or the key's own bytes
    when ``op`` is the BINUNICODE)."""
    ops = list(pickletools.genops(pkl))
    at = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "BINUNICODE" and arg == name)
    persid = next(i for i in range(at, len(ops)) if ops[i][0].name == "BINPERSID")
    target = at if edit(None, None, None) == "key" else persid + 1
    op, arg, pos = ops[target]
    end = ops[target + 1][2]
    return pkl[:pos] + edit(op.name, arg, pkl[pos:end]) + pkl[end:]


@pytest.mark.parametrize("spans", [False, True], ids=["loader", "file-span"])
def test_runs_of_torch_saves_views_read_what_the_opcode_loop_reads(monkeypatch, tmp_path, spans):
    changes = {5: lambda b, t: b[3:5], 6: lambda b, t: b[3:5], 40: lambda b, t: b[:0], 41: lambda b, t: b[7],
               42: lambda b, t: b[:6].view(2, 3), 43: lambda b, t: b[:6].view(2, 3).t(),
               900: lambda b, t: t.ones(1, requires_grad=True), 1200: lambda b, t: t.arange(3.0)[1:2],
               1201: lambda b, t: t.arange(3.0)[2:3], 1700: lambda b, t: b[::5][:1], 2100: lambda b, t: b.double()[:1]}
    pkl, storages = saved_views(changes=changes)
    fast, slow, calls = load_both(pkl, storages, monkeypatch, files=tmp_path if spans else None)
    assert fast == slow
    assert calls >= 2400
    tensors = dict(fast[1])
    assert len(tensors) == 2500
    assert tensors["v2499"][3]["storage_offset"] == 30 * 2499 and tensors["v2499"][4] == np.float32(74_970).tobytes()
    assert tensors["v42"][2] == (2, 3) and tensors["v900"][3]["requires_grad"] and tensors["v41"][2] == ()
    if spans:
        assert tensors["v1000"][5] == (30_000 * 4, 4)


@pytest.mark.parametrize("spans", [False, True], ids=["loader", "file-span"])
@pytest.mark.parametrize("edit", [
    lambda op, arg, raw: "offset" if op is None else pickle.BININT + struct.pack("<i", 80_000),
    lambda op, arg, raw: "offset" if op is None else pickle.BININT + struct.pack("<i", -1),
    lambda op, arg, raw: "offset" if op is None else pickle.BINFLOAT + struct.pack(">d", 3.0),
    lambda op, arg, raw: "offset" if op is None else pickle.NONE,
    lambda op, arg, raw: "key" if op is None else raw.replace(b"v1500", b"v\xff500"),
    lambda op, arg, raw: "key" if op is None else raw.replace(b"v1500", b"v\xed\xa0\x80"),
], ids=["past-the-end", "negative", "float", "none", "not-utf8", "surrogate"])
def test_a_torch_save_run_stops_at_a_bad_call_with_the_opcode_loops_error(monkeypatch, tmp_path, spans, edit):
    made: list = []
    real = template._compile
    monkeypatch.setattr(template, "_compile", lambda t: made.append(t) or real(t))
    pkl, storages = saved_views()
    fast, slow, _ = load_both(edited(pkl, "v1500", edit), storages, monkeypatch,
                              files=tmp_path if spans else None, messages=True)
    assert fast == slow
    assert isinstance(fast, tuple) and fast[0] is FormatError, fast
    assert made and max(t.items for t in made) > 400  # (the bad call met by a compiled template)


def test_a_torch_save_run_with_an_edited_memo_index_or_truncated_is_the_loops(monkeypatch):
    pkl, storages = saved_views(1200)
    ops = list(pickletools.genops(pkl))
    puts = [pos for op, _, pos in ops if op.name == "LONG_BINPUT"]
    for cut in (len(pkl) // 3, len(pkl) // 3 + 7, len(pkl) // 2 + 1, len(pkl) - 40):
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(pkl[:cut], storages, patch, messages=True)
        assert fast == slow and fast[0] is FormatError and "truncated" in fast[1]
    for put in (puts[len(puts) // 2], puts[len(puts) // 2 + 1], puts[-30]):  # an index one off: the memo turns sparse
        damaged = pkl[: put + 1] + struct.pack("<I", struct.unpack_from("<I", pkl, put + 1)[0] + 1) + pkl[put + 5 :]
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(damaged, storages, patch, messages=True)
        assert fast == slow
    # the key of v600 memoized one index off, and a call 100 tensors on reading the index it skipped
    at = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "BINUNICODE" and arg == "v600")
    index, put = ops[at + 1][1], ops[at + 1][2]
    later = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "BINUNICODE" and arg == "v700")
    od = next(i for i in range(later, len(ops)) if ops[i][0].name == "EMPTY_TUPLE") - 1
    od_pos, after_od = ops[od][2], ops[od + 1][2]
    damaged = (pkl[: put + 1] + struct.pack("<I", index + 1) + pkl[put + 5 : od_pos] + pickle.LONG_BINGET
               + struct.pack("<I", index) + pkl[after_od:])
    fast, slow, _ = load_both(damaged, storages, monkeypatch, messages=True)
    assert fast == slow and "KeyError" in fast[1]


@pytest.mark.parametrize("compile_after", [0, 64], ids=["compiled-at-once", "interpreted-first"])
def test_torch_save_runs_agree_on_damaged_pickles(monkeypatch, tmp_path, compile_after):
    """Random bytes changed inside a run of torch.save's views (compiled at once, or after 64)."""
    monkeypatch.setattr(template, "COMPILE_AFTER", compile_after)
    pkl, storages = saved_views(400)
    assert_agree_when_damaged(pkl, storages, monkeypatch, 36, len(pkl) // 4, b"KMJXtQRrhj\x85\x88\x89", tmp_path)


def test_filespan_at_is_the_frozen_dataclass(tmp_path):
    """FileSpan.at (the runs' constructor) builds what FileSpan(...) builds: equal, same hash,
    still frozen, reading the same bytes."""
    import dataclasses

    from statekit.tensor import FileSpan, SourceFile

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(100)))
    source = SourceFile.open(str(path))
    fast, plain = FileSpan.at(source, 10, 5), FileSpan(source, 10, 5)
    assert type(fast) is FileSpan and fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
    assert fast.read() == bytes(range(10, 15)) and fast != FileSpan(source, 10, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.offset = 3
    source.close()


def test_spanned_ref_is_the_dataclass(tmp_path):
    """spanned_ref (the views' constructor) builds what TensorRef(..., info=, span=) builds: every
    field equal, the same bytes read."""
    import dataclasses

    from statekit.tensor import FileSpan, SourceFile, spanned_ref

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(100)))
    source = SourceFile.open(str(path))
    info = {"storage_offset": 10}
    fast = spanned_ref("U8", (5,), info, FileSpan(source, 10, 5))
    plain = TensorRef("U8", (5,), info=info, span=FileSpan(source, 10, 5))
    assert type(fast) is TensorRef and fast == plain and repr(fast) == repr(plain)
    assert all(getattr(fast, f.name) == getattr(plain, f.name) for f in dataclasses.fields(TensorRef))
    assert bytes(fast.raw()) == bytes(range(10, 15)) and fast.nbytes == 5
    source.close()


def test_leaving_no_gc_hands_what_was_made_to_the_oldest_generation():
    """What a load made does not wait for a young collection after it (its objects join the
    oldest generation at once), a cycle made meanwhile is still collected, and objects someone
    else froze stay frozen."""
    import gc
    import weakref

    class Node:
        pass

    assert gc.isenabled()
    with torch_pickle.no_gc():
        made = [(i,) for i in range(50_000)]
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
    assert gc.get_count()[0] < 1000 and gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None and len(made) == 50_000
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with torch_pickle.no_gc():
            more = [(i,) for i in range(1000)]
        assert gc.get_freeze_count() == frozen and len(more) == 1000
    finally:
        gc.unfreeze()


def test_a_run_is_found_after_many_items_that_differ(monkeypatch):
    """600 views cycling through 12 ranks (more kinds of item than the templates kept: each
    learned template is used once, so learning backs off and the loop reads them), then 2,000
    alike in the next frames: they run through templates, and the tensors are the loop's."""
    entries = [{"size": (1,) * (1 + i % 12), "stride": (1,) * (1 + i % 12)} for i in range(600)]
    entries += [{} for _ in range(2000)]
    reads = []
    real = torch_pickle.repeats.read_segment
    monkeypatch.setattr(torch_pickle.repeats, "read_segment", lambda *a: reads.append(1) or real(*a))
    fast, slow, items = load_both(memo_less_views(entries), views_storages(), monkeypatch)
    assert fast == slow and len(dict(fast[1])) == 2600
    assert items >= 1000  # (the 400 alike in the first frame may go to the loop)
    assert len(reads) < 100  # not one look per item


# ------------------------------------------------------------------------------------------------
# other valid forms: MARK…TUPLE tuples, pickle protocols 2–5, each read as torch reads it


class MarkTuplePickler(pickle._Pickler):
    """CPython's pure-Python pickler writing every tuple as ``MARK … TUPLE`` (as protocol 1 does,
    where protocol 2 writes TUPLE1/2/3): a valid protocol-2 pickle torch.load reads."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_tuple(self, obj):
        if not obj:
            self.write(pickle.EMPTY_TUPLE)
            return
        self.write(pickle.MARK)
        for item in obj:
            self.save(item)
        if id(obj) in self.memo:  # (a tuple inside itself: what CPython's pickler does)
            self.write(pickle.POP_MARK + self.get(self.memo[id(obj)][0]))
            return
        self.write(pickle.TUPLE)
        self.memoize(obj)

    dispatch[tuple] = save_tuple


def torch_saved_with(obj: object, pickler=None, protocol: int = 2) -> tuple[bytes, bytes, dict[str, bytes]]:
    """(the .pt file's bytes, its data.pkl, its storages) of real torch.save with ``pickler``."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    module = types.SimpleNamespace(Pickler=pickler, __name__="other_pickle") if pickler else pickle
    torch.save(obj, buf, pickle_module=module, pickle_protocol=protocol)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        names = {n.split("/", 1)[1]: n for n in zf.namelist()}
        storages = {k[5:]: zf.read(n) for k, n in names.items() if k.startswith("data/")}
        return buf.getvalue(), zf.read(names["data.pkl"]), storages


def many_views() -> dict:
    """A state of 2,000 views of one storage, a model's state_dict and an optimizer's state."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    base = torch.arange(6000.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"views": {f"v{i}": base[3 * i : 3 * i + 2] for i in range(2000)}, "model": model.state_dict(),
            "optimizer": opt.state_dict()}


def same_as_torch(ours: object, theirs: object) -> bool:
    """Whether statekit's object holds torch.load's: the same names, tensors (dtype, shape, values) and values."""
    torch = pytest.importorskip("torch")
    if isinstance(theirs, torch.Tensor):
        return (isinstance(ours, TensorRef) and ours.shape == tuple(theirs.shape)
                and np.array_equal(ours.numpy(), theirs.numpy()) and ours.numpy().dtype == theirs.numpy().dtype)
    if isinstance(theirs, dict):
        return (isinstance(ours, dict) and list(ours) == list(theirs)
                and all(same_as_torch(ours[k], v) for k, v in theirs.items()))
    if isinstance(theirs, list | tuple):
        return (type(ours) is type(theirs) and len(ours) == len(theirs)
                and all(same_as_torch(a, b) for a, b in zip(ours, theirs, strict=True)))
    return ours == theirs


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("form", ["torch.save", "mark-tuple", "protocol-3"])
def test_valid_forms_read_as_torch_load_weights_only_reads_them(tmp_path, monkeypatch, form):
    """torch.save's own pickle, the same with MARK…TUPLE tuples and protocol 3: statekit reads
    the tensors torch.load(weights_only=True) reads, nearly all of them through templates."""
    torch = pytest.importorskip("torch")
    obj = many_views()
    raw, pkl, storages = torch_saved_with(obj, MarkTuplePickler if form == "mark-tuple" else None,
                                          3 if form == "protocol-3" else 2)
    ops = {op.name for op, _, _ in pickletools.genops(pkl)}
    assert ("TUPLE1" in ops) != (form == "mark-tuple") and "TUPLE" in ops
    path = tmp_path / "state.pt"
    path.write_bytes(raw)
    theirs = torch.load(path, weights_only=True)
    from statekit.formats.torch_pt import load_pt

    assert same_as_torch(load_pt(path), theirs)
    fast, slow, items = load_both(pkl, storages, monkeypatch)
    assert fast == slow and items >= 1990
    assert templated_share(pkl, storages, monkeypatch) > 0.85


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [4, 5])
def test_protocols_4_and_5_read_what_they_hold(tmp_path, monkeypatch, protocol):
    """torch.load(weights_only=True) refuses protocols 4 and 5 (SHORT_BINUNICODE, STACK_GLOBAL,
    MEMOIZE, FRAME); statekit reads them, through templates, to the tensors torch.load reads
    from this file written here (weights_only=False: the file is our own)."""
    torch = pytest.importorskip("torch")
    obj = many_views()
    raw, pkl, storages = torch_saved_with(obj, protocol=protocol)
    assert {"FRAME", "MEMOIZE", "STACK_GLOBAL"} <= {op.name for op, _, _ in pickletools.genops(pkl)}
    path = tmp_path / "state.pt"
    path.write_bytes(raw)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    from statekit.formats.torch_pt import load_pt

    assert same_as_torch(load_pt(path), torch.load(path, weights_only=False))
    fast, slow, items = load_both(pkl, storages, monkeypatch)
    assert fast == slow and items >= 1990
    assert templated_share(pkl, storages, monkeypatch) > 0.85


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_protocol_4_without_memo_reads_through_templates(monkeypatch):
    """Protocol 4 without a memo names every global with STACK_GLOBAL from two strings, in every
    item: those strings stay fixed in a template (a global is looked up once), and the items
    still run through templates."""
    _, pkl, storages = torch_saved_with(many_views()["views"], FastPickler, protocol=4)
    ops = [op.name for op, _, _ in pickletools.genops(pkl)]
    assert ops.count("STACK_GLOBAL") > 4000 and "BINPUT" not in ops and "MEMOIZE" not in ops
    fast, slow, items = load_both(pkl, storages, monkeypatch)
    assert fast == slow and items >= 1990
    assert templated_share(pkl, storages, monkeypatch) > 0.95


def test_loading_leaves_no_cycle_behind():
    """Templates hold the unpickler while it reads; once read, nothing of it (its memo: 7 entries
    a tensor in torch.save's form) waits for the cyclic collector."""
    import gc
    import weakref

    pkl = memo_less_views([{} for _ in range(500)])
    storages = views_storages()
    seen = []
    real = interpreter._Unpickler.__init__

    def init(self, *args):
        real(self, *args)
        seen.append(weakref.ref(self))

    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(interpreter._Unpickler, "__init__", init)
            obj, _ = torch_pickle.loads(pkl, storage_loader=lambda sid: Storage(sid, lambda: storages[sid.key]))
        assert len(obj) == 500 and seen and seen[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("protocol", [0, 1])
def test_protocols_0_and_1_are_refused_as_torch_load_refuses_them(tmp_path, protocol):
    """Protocols 0 and 1 write a bool as INT ``I01``, which torch.load(weights_only=True) refuses:
    so does statekit, in one line."""
    torch = pytest.importorskip("torch")
    raw, _, _ = torch_saved_with({"w": torch.ones(3)}, protocol=protocol)
    path = tmp_path / "state.pt"
    path.write_bytes(raw)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    from statekit.formats.torch_pt import load_pt

    with pytest.raises(FormatError, match="unsupported pickle opcode") as caught:
        load_pt(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("mark_tuples", [False, True], ids=["tuple1", "mark-tuple"])
def test_hand_written_runs_in_both_tuple_forms_read_what_the_loop_reads(monkeypatch, tmp_path, mark_tuples):
    entries = [{"offset": o} for o in [*range(0, 1000), *range(60_000, 60_700), *range(300, 1100)]]
    for i, change in [(5, {"size": (2,)}), (42, {"size": (2, 3), "stride": (3, 1)}), (900, {"grad": True}),
                      (1200, {"key": "1"}), (1201, {"key": "1"}), (2100, {"name": "é∂".encode()})]:
        entries[i] = entries[i] | change
    pkl = memo_less_views(entries, mark_tuples=mark_tuples)
    fast, slow, items = load_both(pkl, views_storages(), monkeypatch, files=tmp_path)
    assert fast == slow and items >= 2400 and templated_share(pkl, views_storages(), monkeypatch) > 0.95
    tensors = dict(fast[1])
    assert tensors["t42"][2] == (2, 3) and tensors["t42"][3]["stride"] == (3, 1)
    assert tensors["t1000"][5] == (60_000 * 4, 4) and tensors["t1200"][3]["storage_key"] == "1"


# ------------------------------------------------------------------------------------------------
# what templates must never do: call what the allow-list does not hold, outrun the limits


@pytest.mark.parametrize("at", [1, 700, 1999])
def test_a_forbidden_global_among_repeated_items_is_refused_as_the_loop_refuses_it(monkeypatch, at):
    """One item of 2,000 names ``os.system`` where the others name ``_rebuild_tensor_v2``: refused
    with the loop's message."""
    pkl = memo_less_views([{} for _ in range(2000)])
    good = op_global("torch._utils", "_rebuild_tensor_v2")
    items = pkl.split(good)
    evil = op_global("os", "system")
    pkl = good.join(items[: at + 1]) + evil + good.join(items[at + 1 :])
    fast, slow, _ = load_both(pkl, views_storages(), monkeypatch, messages=True)
    assert fast == slow and fast[0] is UnsafePickleError and "os.system" in fast[1]


def test_templates_call_no_global_outside_the_allow_list(monkeypatch):
    """Whatever a template runs went through find_global (the allow-list) or is a stand-in."""
    from statekit.formats.torch_pickle import allowlist

    looked_up = []
    real = allowlist.find_global
    monkeypatch.setattr(interpreter, "find_global", lambda *a: looked_up.append(a[:2]) or real(*a))
    fast, slow, items = load_both(memo_less_views([{} for _ in range(3000)], mark_tuples=True), views_storages(),
                                  monkeypatch)
    assert fast == slow and items >= 2990
    assert set(looked_up) <= {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
                              ("torch", "FloatStorage")}


@pytest.mark.parametrize("outer", [30, 60, 97, 98, 99])
def test_marks_inside_repeated_items_keep_the_depth_limit(monkeypatch, outer):
    """Items that each open two MARKs (a tuple inside a tuple), in a list nested ``outer`` deep:
    past 100 open MARKs the loop refuses, and so do templates, at the same place."""
    item = pickle.MARK + pickle.MARK + pickle.BININT1 + b"\x07" + pickle.TUPLE + pickle.TUPLE
    body = (pickle.EMPTY_LIST + pickle.MARK) * outer + item * 50 + pickle.APPENDS * outer
    fast, slow, items = load_both(wrap(body), {}, monkeypatch, messages=True)
    assert fast == slow
    assert (isinstance(fast, tuple) and "deeper than 100" in fast[1]) == (outer + 2 > 100)
    assert outer + 2 > 100 or items >= 20  # (two tuples an item)


def test_the_opcode_budget_is_the_loops(monkeypatch):
    """With the budget at 30,000 opcodes, 2,000 views (~24 opcodes each) are refused by both,
    with the same message."""
    from statekit.formats.torch_pickle import repeats

    monkeypatch.setattr(interpreter, "MAX_STEPS", 30_000)
    monkeypatch.setattr(repeats, "MAX_STEPS", 30_000)
    fast, slow, items = load_both(memo_less_views([{} for _ in range(2000)]), views_storages(), monkeypatch,
                                  messages=True)
    assert fast == slow and fast[0] is FormatError and "more than 30000 opcodes" in fast[1]
    assert items > 500


@pytest.mark.parametrize("offset", [0, 3, 69_998, 69_999, 70_000, -1, True, 2.0, 2**63])
def test_a_view_plan_at_another_offset_is_tensor_at_that_offset(offset):
    """geometry.view_plan (what templates make views with) at any offset: _tensor's result or error."""
    from statekit.formats.torch_pickle.geometry import _tensor, view_plan

    storage = Storage(StorageId("0", "float32", 70_000, "cpu", None), lambda: memoryview(bytes(280_000)))
    at = view_plan(storage, 5, (2,), (1,))

    def outcome(make):
        try:
            ref = make()
            return ref.shape, dict(ref.info), bytes(ref.raw())
        except FormatError as exc:
            return str(exc)

    assert outcome(lambda: at(offset)) == outcome(lambda: _tensor(storage, offset, (2,), (1,)))


def test_templates_wait_for_a_long_pickle(monkeypatch):
    """By default the opcode loop alone reads a pickle's first ``templates_after`` opcodes
    (learning costs more than it saves on a short pickle: a DCP .metadata); a long pickle's later
    items then run through templates, and both read what the loop alone reads."""
    monkeypatch.setattr(interpreter._Unpickler, "templates_after", TEMPLATES_AFTER)
    assert TEMPLATES_AFTER > 10_000
    short = memo_less_views([{"offset": i} for i in range(300)])
    assert sum(1 for _ in pickletools.genops(short)) < TEMPLATES_AFTER
    fast, slow, items = load_both(short, views_storages(), monkeypatch)
    assert fast == slow and len(fast[1]) == 300 and items == 0
    monkeypatch.setattr(interpreter._Unpickler, "templates_after", TEMPLATES_AFTER)  # (load_both's undone)
    monkeypatch.setattr(interpreter._Unpickler, "templates", True)
    n = 2 * TEMPLATES_AFTER // 20  # ~20 opcodes a view: twice the loop's share
    long = memo_less_views([{"offset": i % 60_000} for i in range(n)])
    ops = sum(1 for _ in pickletools.genops(long))
    fast, slow, items = load_both(long, views_storages(), monkeypatch)
    assert fast == slow and len(fast[1]) == n
    per_item = ops / n
    assert 0 < items * per_item <= ops - TEMPLATES_AFTER + 1000 * per_item  # (from the first MARK past it)
    assert items * per_item >= ops - TEMPLATES_AFTER - 1000 * per_item - 100


def test_alternating_weight_and_bias_items_cost_templates_few_failed_attempts(monkeypatch):
    """A real Adam state_dict whose params alternate 2-D weight and 1-D bias (their sizes TUPLE2
    then TUPLE1: two template families taking turns): templates run most of it, as the opcode
    loop reads it, and the items cost fewer failed attempts and fruitless specialisings than there are items."""
    torch = pytest.importorskip("torch")
    params = [p for _ in range(1500) for p in torch.nn.Linear(3, 2).parameters()]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    pkl, storages = torch_saved(opt.state_dict())
    made: list[Repeats] = []
    wasted = [0]

    class Counted(Repeats):
        def __init__(self):
            super().__init__()
            made.append(self)

        def attempt(self, *args):
            done = super().attempt(*args)
            wasted[0] += done is None
            return done

        def specialise(self, *args):
            special = super().specialise(*args)
            wasted[0] += special is None and not args[-1].wait
            return special

    with monkeypatch.context() as patch:
        patch.setattr(interpreter, "Repeats", Counted)
        patch.setattr(interpreter._Unpickler, "templates", True)
        fast = torch_pickle.loads(pkl, storage_loader=lambda sid: Storage(sid, lambda: memoryview(storages[sid.key])))
    items = sum(r.items for r in made)
    assert items > 2500  # most of the 3,000 params' entries, after the first 65,536 opcodes
    assert wasted[0] < items  # (before the follow-on family and the back-off: 3 an item)
    with monkeypatch.context() as patch:
        patch.setattr(interpreter._Unpickler, "templates", False)
        slow = torch_pickle.loads(pkl, storage_loader=lambda sid: Storage(sid, lambda: memoryview(storages[sid.key])))
    assert normalized(fast[0]) == normalized(slow[0])
