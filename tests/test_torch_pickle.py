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
