"""The allow-listing unpickler and the protocol-2 pickler behind .pt files (statekit.formats.torch_pickle).

References: CPython's own pickle module (for plain values, both directions) and torch's
weights_only unpickler / allow-list (for what a .pt pickle may contain).
"""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statekit.errors import FormatError, MappingError, UnsafePickleError
from statekit.formats import torch_pickle
from statekit.formats.torch_pickle import Storage, StorageId, TorchDtype
from statekit.tensor import TensorRef

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# hand-assembled pickles (protocol 2 opcodes), for inputs no well-behaved pickler produces


def op_str(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def op_int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return pickle.BININT + struct.pack("<i", value)
    raw = pickle.encode_long(value)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def op_global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def op_tuple(*parts: bytes) -> bytes:
    return pickle.MARK + b"".join(parts) + pickle.TUPLE


def wrap(body: bytes) -> bytes:
    return pickle.PROTO + b"\x02" + body + pickle.STOP


def call(module: str, name: str, *args: bytes) -> bytes:
    return op_global(module, name) + op_tuple(*args) + pickle.REDUCE


def tensor_call(
    key="0", storage="FloatStorage", numel=4, offset=0, size=(4,), stride=(1,), module="torch", location="cpu"
) -> bytes:
    """_rebuild_tensor_v2(<storage pid>, offset, size, stride, False, OrderedDict()) as torch writes it."""
    pid = op_tuple(
        op_str("storage"), op_global(module, storage), op_str(key), op_str(location), op_int(numel)
    )
    return call(
        "torch._utils",
        "_rebuild_tensor_v2",
        pid + pickle.BINPERSID,
        op_int(offset),
        op_tuple(*map(op_int, size)),
        op_tuple(*map(op_int, stride)),
        pickle.NEWFALSE,
        call("collections", "OrderedDict"),
    )


def float_storages(**arrays: np.ndarray):
    """A storage loader serving float32 arrays by key, recording what it was asked for."""
    asked: list[StorageId] = []

    def load(sid: StorageId) -> Storage:
        asked.append(sid)
        data = memoryview(arrays[sid.key].astype("<f4").tobytes())
        return Storage(sid, lambda: data)

    load.asked = asked
    return load


# --------------------------------------------------------------------------------------------
# plain values against CPython's pickle

PLAIN_VALUES = [
    None,
    True,
    False,
    0,
    255,
    256,
    65535,
    65536,
    -1,
    2**31 - 1,
    -(2**31),
    2**31,
    2**63,
    -(2**200),
    0.1,
    -0.0,
    math.inf,
    "",
    "ünïcødé ✓",
    b"\x00\xffbytes",
    1.5 - 2j,
    (),
    (1,),
    (1, 2),
    (1, 2, 3),
    (1, 2, 3, 4),
    [],
    [1, [2, (3, {"k": None})]],
    {},
    {"b": 1, "a": 2, 3: "int key", (1, 2): "tuple key"},
    {1, 2, 3},
]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_reads_what_cpython_pickles(value, protocol):
    result, end = torch_pickle.loads(pickle.dumps(value, protocol=protocol))
    assert result == value and type(result) is type(value)
    if isinstance(value, dict):
        assert list(result) == list(value)


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_cpython_reads_what_we_pickle(value):
    data, tensors = torch_pickle.dumps(value)
    assert tensors == []
    result = pickle.loads(data)
    assert result == value and type(result) is type(value)
    assert torch_pickle.loads(data) == (result, len(data))


def test_empty_bytes_round_trip():
    data, _ = torch_pickle.dumps(b"")
    assert pickle.loads(data) == b"" and torch_pickle.loads(data)[0] == b""


def test_nan_round_trips():
    result, _ = torch_pickle.loads(torch_pickle.dumps(math.nan)[0])
    assert math.isnan(result)


def test_ordered_dict_becomes_a_dict_in_order():
    from collections import OrderedDict

    value = OrderedDict([("z", 1), ("a", (2, 3))])
    result, _ = torch_pickle.loads(pickle.dumps(value, protocol=2))
    assert type(result) is dict and list(result.items()) == list(value.items())


def test_loads_reports_where_the_pickle_ends():
    first, second = pickle.dumps(7, protocol=2), pickle.dumps("x", protocol=2)
    assert torch_pickle.loads(first + second) == (7, len(first))
    assert torch_pickle.loads(first + second, len(first)) == ("x", len(first) + len(second))


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(min_size=1, max_size=8)  # CPython pickles b"" via builtins.bytes, which torch refuses
    | st.complex_numbers(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)


@FAST
@given(plain)
def test_property_pickler_and_unpickler_agree_with_cpython(value):
    ours, _ = torch_pickle.dumps(value)
    assert pickle.loads(ours) == value
    assert torch_pickle.loads(ours)[0] == value
    assert torch_pickle.loads(pickle.dumps(value, protocol=2))[0] == value


# --------------------------------------------------------------------------------------------
# the allow-list


class SystemCall:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class ExecCall:
    def __init__(self, source: str):
        self.source = source

    def __reduce__(self):
        return exec, (self.source,)


def exec_payload(marker) -> bytes:
    return pickle.dumps({"state": ExecCall(f"open({str(marker)!r}, 'w').close()")}, protocol=2)


def test_exec_payload_is_real(tmp_path):
    """The payload used below does create its marker when CPython's pickle loads it."""
    marker = tmp_path / "proof"
    pickle.loads(exec_payload(marker))
    assert marker.exists()


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (lambda m: exec_payload(m), "builtins.exec"),
        (lambda m: pickle.dumps([SystemCall(f"touch {m}")], protocol=2), f"{os.system.__module__}.system"),
        (lambda m: pickle.dumps([SystemCall(f"touch {m}")], protocol=4), f"{os.system.__module__}.system"),
        (lambda m: wrap(call("os", "system", op_str(f"touch {m}"))), "os.system"),
        (lambda m: wrap(call("__builtin__", "eval", op_str(f"open({str(m)!r}, 'w')"))), "builtins.eval"),
        (
            lambda m: wrap(call("subprocess", "Popen", op_tuple(op_str("touch"), op_str(str(m))))),
            "subprocess.Popen",
        ),
        (lambda m: wrap(call("posix", "system", op_str(f"touch {m}"))), "posix.system"),
        (lambda m: wrap(call("__main__", "Evil")), "__main__.Evil"),
        (lambda m: wrap(call("torch", "load", op_str(str(m)))), "torch.load"),
        (lambda m: wrap(tensor_call()[:-1] + call("os", "system", op_str(f"touch {m}"))), "os.system"),
    ],
    ids=[
        "exec",
        "os.system",
        "os.system-proto4",
        "os-GLOBAL",
        "eval-py2",
        "Popen",
        "posix",
        "class",
        "torch.load",
        "nested",
    ],
)
def test_refuses_globals_outside_the_allow_list(tmp_path, payload, named):
    marker = tmp_path / "marker"
    with pytest.raises(UnsafePickleError) as caught:
        torch_pickle.loads(payload(marker), storage_loader=float_storages(**{"0": np.arange(4)}))
    assert f"refusing to load global '{named}' from pickle: not on statekit's allow-list" in str(caught.value)
    assert not marker.exists()


def test_unsafe_pickle_error_is_a_format_error():
    assert issubclass(UnsafePickleError, FormatError)


@pytest.mark.parametrize(
    "callee",
    [
        op_global("torch", "float32"),
        op_global("torch", "FloatStorage"),
        op_str("os.system"),
        op_global("torch", "Tensor"),
    ],
    ids=["dtype", "storage-class", "string", "tensor-type"],
)
def test_reduce_calls_only_allowed_callables(callee):
    with pytest.raises(UnsafePickleError, match="refusing to call"):
        torch_pickle.loads(wrap(callee + op_tuple() + pickle.REDUCE))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (call("builtins", "bytearray", op_int(2**40)), "bytearray"),
        (call("_codecs", "encode", op_str("x"), op_str("rot13")), "latin1"),
        (call("builtins", "set", op_int(3)), "set"),
        (call("builtins", "complex", op_str("1+2j")), "complex"),
        (call("torch", "Size", op_tuple(op_int(-1))), "torch.Size"),
        (call("collections", "OrderedDict", op_str("ab")), "OrderedDict"),
    ],
    ids=["bytearray-size", "codec", "set", "complex-str", "size", "ordereddict"],
)
def test_allowed_callables_check_their_arguments(body, message):
    with pytest.raises(FormatError, match=message):
        torch_pickle.loads(wrap(body))


@pytest.mark.parametrize(
    "data",
    [
        b"(lp0\nI1\na.",  # protocol 0 text opcodes
        wrap(b"(" + op_global("collections", "OrderedDict") + b"o"),  # OBJ
        wrap(op_global("collections", "OrderedDict") + op_tuple() + pickle.NEWOBJ),
        wrap(b"\x82\x01"),  # EXT1
        wrap(b"P0\n"),  # text PERSID
        pickle.dumps(bytearray(b"x"), protocol=5),  # BYTEARRAY8
        pickle.dumps(frozenset({1}), protocol=4),  # FROZENSET
    ],
    ids=["protocol0", "OBJ", "NEWOBJ", "EXT1", "PERSID", "BYTEARRAY8", "FROZENSET"],
)
def test_unsupported_opcodes_are_refused(data):
    with pytest.raises(FormatError, match="unsupported pickle opcode"):
        torch_pickle.loads(data)


def test_frozenset_global_is_refused_like_torch_does():
    with pytest.raises(UnsafePickleError, match="builtins.frozenset"):
        torch_pickle.loads(pickle.dumps(frozenset({1}), protocol=2))


def test_every_truncation_is_a_format_error():
    data = wrap(b"}" + op_str("t") + tensor_call() + pickle.SETITEM)
    loader = float_storages(**{"0": np.arange(4)})
    assert torch_pickle.loads(data, storage_loader=loader)[0]["t"].numpy().tolist() == [0, 1, 2, 3]
    for end in range(len(data)):
        with pytest.raises(FormatError):
            torch_pickle.loads(data[:end], storage_loader=loader)


@FAST
@given(st.data())
def test_property_corrupted_pickles_raise_only_format_errors(data):
    original = bytearray(
        wrap(b"}" + op_str("t") + tensor_call(numel=6, size=(2, 3), stride=(3, 1)) + pickle.SETITEM)
    )
    for _ in range(data.draw(st.integers(1, 4))):
        original[data.draw(st.integers(0, len(original) - 1))] = data.draw(st.integers(0, 255))
    try:
        torch_pickle.loads(bytes(original), storage_loader=float_storages(**{"0": np.arange(6)}))
    except FormatError:
        pass


@pytest.mark.parametrize(
    ("pid", "message"),
    [
        (op_str("storage"), "only tensor storages"),
        (
            op_tuple(op_str("module"), op_str("x"), op_str("y"), op_str("z"), op_int(1)),
            "only tensor storages",
        ),
        (
            op_tuple(op_str("storage"), op_str("FloatStorage"), op_str("0"), op_str("cpu"), op_int(4)),
            "storage class",
        ),
        (
            op_tuple(
                op_str("storage"), op_global("torch", "FloatStorage"), op_str("0"), op_str("cpu"), op_int(-4)
            ),
            "malformed",
        ),
    ],
    ids=["not-a-tuple", "module", "type-is-string", "negative-numel"],
)
def test_bad_persistent_ids(pid, message):
    with pytest.raises(FormatError, match=message):
        torch_pickle.loads(wrap(pid + pickle.BINPERSID), storage_loader=float_storages())


def test_persistent_id_without_storages_is_refused():
    with pytest.raises(FormatError, match="has none"):
        torch_pickle.loads(wrap(tensor_call()))


# --------------------------------------------------------------------------------------------
# tensors from hand-made pickles


def test_views_of_one_storage():
    base = np.arange(12, dtype=np.float32)
    body = (
        b"]"
        + pickle.MARK
        + tensor_call(numel=12, size=(3, 4), stride=(4, 1))
        + tensor_call(numel=12, offset=1, size=(3, 3), stride=(1, 4))
        + tensor_call(numel=12, offset=5, size=(), stride=())
        + tensor_call(numel=12, offset=2, size=(2, 3), stride=(0, 3))
        + tensor_call(numel=12, offset=12, size=(0, 5), stride=(5, 1))
        + pickle.APPENDS
    )
    loader = float_storages(**{"0": base})
    full, transposed, scalar, expanded, empty = torch_pickle.loads(wrap(body), storage_loader=loader)[0]
    grid = base.reshape(3, 4)
    np.testing.assert_array_equal(full.numpy(), grid)
    np.testing.assert_array_equal(
        transposed.numpy(), [[base[1 + i + 4 * j] for j in range(3)] for i in range(3)]
    )
    assert scalar.shape == () and scalar.numpy() == 5
    np.testing.assert_array_equal(expanded.numpy(), np.tile(base[[2, 5, 8]], (2, 1)))
    assert empty.shape == (0, 5) and empty.numpy().size == 0
    assert len(loader.asked) == 5 and {sid.key for sid in loader.asked} == {"0"}
    assert transposed.info["stride"] == (1, 4) and transposed.info["storage_offset"] == 1
    assert full.info == {
        "torch_dtype": "float32",
        "parameter": False,
        "requires_grad": False,
        "device": "cpu",
        "storage_key": "0",
        "storage_offset": 0,
        "stride": (4, 1),
    }


def test_cuda_storage_spelling_and_location():
    body = tensor_call(module="torch.cuda", location="cuda:0")
    loaded = torch_pickle.loads(wrap(body), storage_loader=float_storages(**{"0": np.arange(4)}))[0]
    assert loaded.info["device"] == "cuda:0" and loaded.numpy().tolist() == [0, 1, 2, 3]


def test_rebuild_tensor_without_grad_arguments():
    pid = op_tuple(
        op_str("storage"), op_global("torch", "LongStorage"), op_str("0"), op_str("cpu"), op_int(2)
    )
    body = call(
        "torch._utils",
        "_rebuild_tensor",
        pid + pickle.BINPERSID,
        op_int(1),
        op_tuple(op_int(1)),
        op_tuple(op_int(1)),
    )

    def load(sid):
        data = memoryview(np.array([5, 6], "<i8").tobytes())
        return Storage(sid, lambda: data)

    loaded = torch_pickle.loads(wrap(body), storage_loader=load)[0]
    assert loaded.dtype == "I64" and loaded.numpy().tolist() == [6]


def test_view_past_the_storage_end_is_refused():
    loader = float_storages(**{"0": np.arange(4)})
    with pytest.raises(FormatError, match="needs 5 elements of storage '0', which holds 4"):
        torch_pickle.loads(wrap(tensor_call(numel=4, offset=1, size=(4,))), storage_loader=loader)
    huge = wrap(tensor_call(numel=4, size=(2**30, 2**30), stride=(2**30, 1)))
    with pytest.raises(FormatError, match="which holds 4"):
        torch_pickle.loads(huge, storage_loader=loader)


def test_bad_geometry_is_refused():
    loader = float_storages(**{"0": np.arange(4)})
    for body in (tensor_call(size=(2, 2), stride=(1,)), tensor_call(offset=-1), tensor_call(size=(-4,))):
        with pytest.raises(FormatError):
            torch_pickle.loads(wrap(body), storage_loader=loader)


@pytest.mark.parametrize(
    ("storage", "dtype"),
    [("ComplexFloatStorage", "complex64"), ("QInt8Storage", "qint8"), ("ComplexDoubleStorage", "complex128")],
)
def test_unsupported_storage_dtypes_are_named(storage, dtype):
    with pytest.raises(FormatError, match=f"tensor dtype torch.{dtype} is not supported"):
        torch_pickle.loads(wrap(tensor_call(storage=storage)), storage_loader=float_storages())


def test_conjugate_bit_is_refused():
    body = (
        tensor_call()[:-2]
        + b"}"
        + op_str("conj")
        + pickle.NEWTRUE
        + pickle.SETITEM
        + pickle.TUPLE
        + pickle.REDUCE
    )
    with pytest.raises(FormatError, match="conjugate"):
        torch_pickle.loads(wrap(body), storage_loader=float_storages(**{"0": np.arange(4)}))


# --------------------------------------------------------------------------------------------
# writing


def pickle_globals(data: bytes) -> set[str]:
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def sample_state() -> dict:
    return {
        "state": {0: {"step": np.array(3.0, dtype=np.float32), "exp_avg": np.ones((2, 3), np.float32)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        "u16": np.arange(3, dtype=np.uint16),
        "bf16": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        "param": TensorRef.from_array(np.zeros(2, np.float64)),
        "bytes": b"ab",
        "set": {1},
        "complex": 1j,
        "dtype": TorchDtype("bfloat16"),
    }


def test_dumps_emits_only_torch_weights_only_globals():
    torch = pytest.importorskip("torch")
    from torch._weights_only_unpickler import _get_allowed_globals

    state = sample_state()
    state["param"].info.update(parameter=True, requires_grad=True)
    data, tensors = torch_pickle.dumps(state)
    assert len(tensors) == 5
    used = pickle_globals(data)
    assert used <= set(_get_allowed_globals()), used - set(_get_allowed_globals())
    assert {"torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter", "torch.bfloat16"} <= used
    assert torch.__version__.startswith("2.")


def test_dumps_round_trips_through_loads():
    state = sample_state()
    data, tensors = torch_pickle.dumps(state)
    raws = {str(i): memoryview(bytes(t.raw())) for i, t in enumerate(tensors)}

    def load(sid):
        return Storage(sid, lambda: raws[sid.key])

    back, end = torch_pickle.loads(data, storage_loader=load)
    assert end == len(data)
    assert back["param_groups"] == state["param_groups"]
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert list(back["state"]) == [0]
    assert back["state"][0]["step"].shape == () and back["state"][0]["step"].numpy() == 3.0
    assert back["u16"].dtype == "U16" and back["u16"].info["torch_dtype"] == "uint16"
    assert back["bf16"].dtype == "BF16" and back["bf16"].numpy().astype(np.float32).tolist() == [1.5, -2.0]
    assert (back["bytes"], back["set"], back["complex"], back["dtype"]) == (
        b"ab",
        {1},
        1j,
        TorchDtype("bfloat16"),
    )


def test_dumps_writes_one_storage_per_tensor_object():
    shared = TensorRef.from_array(np.arange(3.0))
    data, tensors = torch_pickle.dumps({"a": shared, "b": shared, "c": np.arange(3.0)})
    assert len(tensors) == 2
    keys = [arg for op, arg, _ in pickletools.genops(data) if op.name == "BINUNICODE" and arg in ("0", "1")]
    assert keys == ["0", "0", "1"]


def test_dumps_converts_numpy_scalars_to_python_numbers():
    data, _ = torch_pickle.dumps({"a": np.float32(0.5), "b": np.int64(3), "c": np.bool_(True)})
    result = pickle.loads(data)
    assert result == {"a": 0.5, "b": 3, "c": True}
    assert [type(v) for v in result.values()] == [float, int, bool]


@pytest.mark.parametrize(
    "value",
    [
        object(),
        frozenset({1}),
        slice(1),
        {"k": [print]},
        TensorRef("QFloat", (2,), loader=lambda: b"ab"),
        2**3000,
    ],
    ids=["object", "frozenset", "slice", "function", "qfloat", "huge-int"],
)
def test_dumps_refuses_what_a_pt_file_cannot_hold(value):
    with pytest.raises(MappingError, match="cannot write|too large"):
        torch_pickle.dumps(value)


def test_dumps_refuses_cycles():
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(MappingError, match="self-referencing"):
        torch_pickle.dumps({"x": cyclic})


# --------------------------------------------------------------------------------------------
# the tensor-call fast path (_Unpickler.tensor_call) against the opcode loop


def torch_saved(obj: object) -> tuple[bytes, dict[str, bytes]]:
    """data.pkl and the storages of what real torch.save writes for ``obj``."""
    import io
    import zipfile

    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        names = {n.split("/", 1)[1]: n for n in zf.namelist()}
        storages = {k[5:]: zf.read(n) for k, n in names.items() if k.startswith("data/")}
        return zf.read(names["data.pkl"]), storages


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
    """The outcome through the fast path and through the opcode loop alone, and fast calls run.
    ``files``: a folder where each storage is written to a file its tensors read (FileSpan), as
    a .pt's are; ``messages``: an error is its class and message (else its class alone)."""
    import re

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

    calls = []
    for name in ("tensor_call", "inline_call"):
        real = getattr(torch_pickle._Unpickler, name)
        monkeypatch.setattr(torch_pickle._Unpickler, name, lambda *a, real=real: calls.append(1) or real(*a))
    real_run = torch_pickle.fastpath.inline_run

    real_keyed_run = torch_pickle.fastpath.keyed_run

    def run(*args):  # a run of repeated memo-less calls: one fast call per tensor it pushed
        pos, ops = real_run(*args)
        calls.extend([1] * (ops // torch_pickle.fastpath._INLINE_RUN_OPS))
        return pos, ops

    def keyed_run(*args):  # a run of torch.save's repeated calls, likewise
        pos, ops = real_keyed_run(*args)
        calls.extend([1] * (ops // torch_pickle.fastpath._KEYED_RUN_OPS))
        return pos, ops

    monkeypatch.setattr(torch_pickle.fastpath, "inline_run", run)
    monkeypatch.setattr(torch_pickle.fastpath, "keyed_run", keyed_run)
    fast = outcome()
    monkeypatch.setattr(torch_pickle.interpreter, "_TENSOR_CALL", re.compile(rb"(?!)"))  # matches nothing
    monkeypatch.setattr(torch_pickle.interpreter, "_KEYED_CALL", re.compile(rb"(?!)"))
    monkeypatch.setattr(torch_pickle.interpreter, "_INLINE_CALL", re.compile(rb"(?!)"))
    return fast, outcome(), len(calls)


def normalized(value: object) -> object:
    if isinstance(value, TensorRef):
        span = value.span and (value.span.offset, value.span.length)
        return ("tensor", value.dtype, value.shape, dict(value.info), bytes(value.raw()), span)
    if isinstance(value, dict):
        return ("dict", [(k, normalized(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [normalized(v) for v in value])
    return value


def test_tensor_call_fast_path_reads_what_the_opcode_loop_reads(monkeypatch):
    pkl, storages = torch_saved(views_and_state())
    fast, slow, calls = load_both(pkl, storages, monkeypatch)
    assert fast == slow
    assert calls > 300  # nearly every tensor (not the first of its kind, nor rank 4) ran at once
    views = dict(dict(fast[1])["views"][1])
    assert views["far"][3]["storage_offset"] == 66_000 and views["t"][3]["stride"] == (1, 8)
    assert views["grad"][3]["requires_grad"] and views["scalar"][2] == ()


def test_tensor_call_fast_path_agrees_on_damaged_pickles(monkeypatch):
    """Bytes changed inside the tensor calls (memo indices, ints, opcodes): the fast path gives
    the opcode loop's result or its error class, never something else."""
    import random

    pkl, storages = torch_saved({f"v{i}": t for i, t in enumerate(views_and_state()["views"].values())}
                                | {"many": views_and_state()["many"]})
    rng = random.Random(14)
    for _ in range(150):
        damaged = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(pkl) // 2, len(pkl))] = rng.choice([rng.randrange(256), *damaged[:40]])
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(bytes(damaged), storages, patch)
        assert fast == slow


def torch_saved_without_memo(obj: object) -> tuple[bytes, dict[str, bytes]]:
    """data.pkl and the storages of real torch.save for ``obj`` with a pickler that keeps no memo
    (``Pickler.fast``: every global, string and OrderedDict() written out each time), as other
    writers and older versions do: torch's own reducers and persistent ids, another opcode sequence."""
    import io
    import types
    import zipfile

    torch = pytest.importorskip("torch")

    class Fast(pickle.Pickler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fast = True

    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=types.SimpleNamespace(Pickler=Fast, __name__="fast_pickle"))
    with zipfile.ZipFile(buf) as zf:
        names = {n.split("/", 1)[1]: n for n in zf.namelist()}
        storages = {k[5:]: zf.read(n) for k, n in names.items() if k.startswith("data/")}
        return zf.read(names["data.pkl"]), storages


def test_inline_fast_path_reads_a_pickle_without_memo_as_the_opcode_loop_does(monkeypatch):
    obj = views_and_state()
    pkl, storages = torch_saved_without_memo(obj)
    import pickletools

    assert not {op.name for op, _, _ in pickletools.genops(pkl)} & {"BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET"}
    fast, slow, calls = load_both(pkl, storages, monkeypatch)
    assert fast == slow
    assert calls > 300
    canonical, _ = torch_saved(obj)
    monkeypatch.undo()
    same, _, _ = load_both(canonical, torch_saved(obj)[1], monkeypatch)
    assert same == fast  # the same tensors, names and values as torch.save's own form


def test_inline_fast_path_agrees_on_damaged_pickles(monkeypatch):
    import random

    pkl, storages = torch_saved_without_memo({f"v{i}": t for i, t in enumerate(views_and_state()["views"].values())}
                                             | {"many": views_and_state()["many"]})
    rng = random.Random(21)
    for _ in range(150):
        damaged = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(pkl) // 2, len(pkl))] = rng.choice([rng.randrange(256), *damaged[:40]])
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(bytes(damaged), storages, patch)
        assert fast == slow


# runs of memo-less calls viewing one storage (fastpath.inline_run): hand-written in
# Pickler.fast's bytes, so that single bytes can differ from one call to the next


def memo_less_views(entries: list[dict], numel: int = 70_000) -> bytes:
    """``OrderedDict(name -> _rebuild_tensor_v2(...))`` as CPython's pickler writes torch.save's
    objects without a memo (protocol 2, ``Pickler.fast``), SETITEMS every 1000 pairs. Each entry
    may set ``name`` (raw UTF-8 bytes), ``offset`` (int, or an int opcode's bytes), ``size`` and
    ``stride`` (tuples), ``grad`` (bool), ``key`` (the storage's)."""
    def small(values: tuple) -> bytes:
        return b"".join(op_small(v) for v in values) + bytes([pickle.TUPLE1[0] + len(values) - 1]) if values else b")"

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


def test_runs_agree_on_damaged_pickles(monkeypatch, tmp_path):
    """Random bytes changed inside a run of memo-less views: the fast path gives the opcode
    loop's result or its error class, never something else."""
    import random

    pkl = memo_less_views([{"offset": 3 * i} for i in range(400)])
    rng = random.Random(35)
    for _ in range(150):
        damaged = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(200, len(pkl))] = rng.choice([rng.randrange(256), *b"KMJXtQRu(\x85\x86\x88\x89"])
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(bytes(damaged), views_storages(), patch, files=tmp_path)
        assert fast == slow


# runs of torch.save's own calls viewing one storage (fastpath.keyed_run): real torch.save
# pickles, some with one call's bytes edited (a pickle holds no byte offsets: lengths may change)


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
    pkl, storages = saved_views()
    fast, slow, _ = load_both(edited(pkl, "v1500", edit), storages, monkeypatch,
                              files=tmp_path if spans else None, messages=True)
    assert fast == slow
    assert isinstance(fast, tuple) and fast[0] is FormatError, fast


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


def test_torch_save_runs_agree_on_damaged_pickles(monkeypatch, tmp_path):
    """Random bytes changed inside a run of torch.save's views: the fast path gives the opcode
    loop's result or its error class, never something else."""
    import random

    pkl, storages = saved_views(400)
    rng = random.Random(36)
    for _ in range(150):
        damaged = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(pkl) // 4, len(pkl))] = rng.choice([rng.randrange(256), *b"KMJXtQRrhj\x85\x88\x89"])
        with monkeypatch.context() as patch:
            fast, slow, _ = load_both(bytes(damaged), storages, patch, files=tmp_path)
        assert fast == slow


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


def test_a_run_is_found_after_many_calls_that_differ(monkeypatch):
    """600 views whose size changes every call (each look for a run finds none: the looks back
    off), then 2,000 alike: the run is still found, and the tensors are the opcode loop's."""
    entries = [{"size": (1 + i % 2,)} for i in range(600)] + [{} for _ in range(2000)]
    pkl = memo_less_views(entries)
    in_runs = []
    real = torch_pickle.fastpath.inline_run

    def counted(*args):
        pos, ops = real(*args)
        in_runs.append(ops // torch_pickle.fastpath._INLINE_RUN_OPS)
        return pos, ops

    monkeypatch.setattr(torch_pickle.fastpath, "inline_run", counted)
    fast, slow, _ = load_both(pkl, views_storages(), monkeypatch)
    assert fast == slow and len(dict(fast[1])) == 2600
    assert sum(in_runs) >= 1500
