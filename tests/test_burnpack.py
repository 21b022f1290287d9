"""The burnpack container: a real burn file, our fixtures, the writer's byte rules, bad input."""

import hashlib
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statekit.errors import FormatError
from statekit.formats import burnpack, cbor
from statekit.formats.burnpack import (
    BurnpackFile,
    PackTensor,
    Scalar,
    copy_burnpack,
    write_burnpack,
)
from statekit.frameworks import burn
from statekit.tensor import TensorRef

MNIST = ROOT / "fixtures/burn/mnist-model.bpk"
VALID = sorted((ROOT / "fixtures").glob("*.bpk")) + [MNIST]
MALFORMED = sorted((ROOT / "fixtures/malformed").glob("*.bpk"))


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_mnist_model_as_burn_wrote_it():
    with BurnpackFile(MNIST) as pack:
        assert (pack.version, pack.metadata_size, pack.data_start) == (1, 1398, 1536)
        assert len(pack.tensors) == 18 and not pack.metadata and not pack.scalars
        bias = pack.tensors["conv1.conv.bias"]
        assert bias.param_id == 9505838338724798577
        assert (bias.start, bias.end) == (2304, 2560)
        assert pack.data_order[:2] == ["conv1.conv.weight", "conv1.conv.bias"]  # traversal order
        assert pack.tensors["fc1.weight"].shape == (1600, 128)
        w = pack.tensor("conv1.conv.weight").numpy()
        # the first four data bytes at 0x600 are 42 c3 10 be (burn-formats.md §1.9)
        assert w.reshape(-1)[:1].view(np.uint8).tobytes() == bytes.fromhex("42c310be")
        assert w.shape == (64, 1, 3, 3) and w.dtype == np.float32
        assert pack.tensor("conv1.norm.running_var").numpy().min() > 0
        assert pack.canonical


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_rewrite_is_byte_identical(path, tmp_path):
    out = tmp_path / "copy.bpk"
    with BurnpackFile(path) as pack:
        copy_burnpack(pack, out)
    assert sha(out) == sha(path)


@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-optim-amsgrad.bpk", "hand-optim-rmsprop.bpk",
                                  "hand-optim-sgd.bpk", "hand-optim-adagrad.bpk", "hand-optim-bf16.bpk"])
def test_rewrite_through_the_state_model_is_byte_identical(name, tmp_path):
    src = ROOT / "fixtures" / name
    with BurnpackFile(src) as pack:
        state = burn.read(pack).optimizer
        tensors, strings, scalars = burn.to_pack(state)
        write_burnpack(tmp_path / "out.bpk", tensors, strings, scalars)
    assert sha(tmp_path / "out.bpk") == sha(src)


def test_empty_pack_is_exactly_the_header_block(tmp_path):
    # An optimizer that never stepped: metadata A1 67 "tensors" A0, padded to 256 bytes (§2.1).
    write_burnpack(tmp_path / "e.bpk", [])
    data = (tmp_path / "e.bpk").read_bytes()
    meta = bytes.fromhex("a1") + bytes([0x67]) + b"tensors" + bytes.fromhex("a0")
    assert data == b"NRUB" + struct.pack("<HI", 1, len(meta)) + meta + b"\0" * (256 - 10 - len(meta))


def test_unaligned_019_layout_reads_the_same_values():
    with BurnpackFile(ROOT / "fixtures/hand-optim-019.bpk") as old, BurnpackFile(ROOT / "fixtures/hand-optim.bpk") as new:
        assert old.layout == "0.19-unaligned" and new.layout == "aligned"
        assert old.data_start == 10 + old.metadata_size
        for name in new.tensors:
            assert np.array_equal(old.tensor(name).numpy(), new.tensor(name).numpy())


def test_bf16_fixture_holds_the_f32_values_rounded():
    with BurnpackFile(ROOT / "fixtures/hand-optim-bf16.bpk") as b16, BurnpackFile(ROOT / "fixtures/hand-optim.bpk") as f32:
        for name in f32.tensors:
            got = b16.tensor(name).numpy()
            assert got.dtype == ml_dtypes.bfloat16
            assert np.array_equal(got, f32.tensor(name).numpy().astype(ml_dtypes.bfloat16))


def test_fixture_values_are_the_training_state():
    truth = np.load(ROOT / "fixtures/hand-train-adam.npz")
    with BurnpackFile(ROOT / "fixtures/hand-optim.bpk") as pack:
        state = burn.read(pack).optimizer
        for p in state.params:
            assert np.array_equal(p.slots["exp_avg"].numpy(), truth[f"{p.path}/moment_1"])
            assert np.array_equal(p.slots["exp_avg_sq"].numpy(), truth[f"{p.path}/moment_2"])
            assert p.step == int(truth[f"{p.path}/time"]) == 21


@pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.name)
def test_malformed_files_are_refused(path):
    with pytest.raises(FormatError) as info:
        with BurnpackFile(path) as pack:
            for name in pack.tensors:
                pack.tensor(name).numpy()
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message


def test_bool_stores_and_qfloat(tmp_path):
    bools = np.array([True, False, True])
    as_u32 = TensorRef(dtype="Bool", shape=(3,), loader=lambda: np.array([1, 0, 1], "<u4").tobytes(), nbytes_hint=12)
    qbytes = bytes(range(10))
    qfloat = {"QFloat": {"value": "Q8S", "store": "Native", "mode": "Symmetric", "tensor": "F32", "block": None}}
    tensors = [
        PackTensor("native", TensorRef.from_array(bools)),
        PackTensor("u32", as_u32, burn_dtype={"Bool": "U32"}),
        PackTensor("q", TensorRef(dtype="QFloat", shape=(2, 4), loader=lambda: qbytes, nbytes_hint=10), burn_dtype=qfloat),
    ]
    write_burnpack(tmp_path / "b.bpk", tensors)
    with BurnpackFile(tmp_path / "b.bpk") as pack:
        assert pack.tensors["native"].burn_dtype == {"Bool": "Native"}
        assert np.array_equal(pack.tensor("native").numpy(), bools)
        assert np.array_equal(pack.tensor("u32").numpy(), bools)
        assert bytes(pack.tensor("q").raw()) == qbytes and pack.tensors["q"].burn_dtype == qfloat


def test_failed_write_leaves_nothing(tmp_path):
    def boom():
        raise RuntimeError("disk on fire")

    bad = TensorRef(dtype="F32", shape=(4,), loader=boom)
    target = tmp_path / "out.bpk"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        write_burnpack(target, [PackTensor("a", TensorRef.from_array(np.ones(3, np.float32))), PackTensor("b", bad)])
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bpk"]


@pytest.mark.slow
def test_too_many_tensors_is_refused(tmp_path):
    desc = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    meta = cbor.encode({"tensors": {f"t{i}": desc for i in range(100_001)}})
    (tmp_path / "many.bpk").write_bytes(b"NRUB" + struct.pack("<HI", 1, len(meta)) + meta)
    with pytest.raises(FormatError, match="100000"):
        BurnpackFile(tmp_path / "many.bpk")


DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool"]


@st.composite
def packs(draw):
    n = draw(st.integers(0, 5))
    tensors = []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        from statekit import dtypes

        raw = draw(st.binary(min_size=math.prod(shape) * dtypes.itemsize(dtype),
                             max_size=math.prod(shape) * dtypes.itemsize(dtype)))
        if dtype == "Bool":
            raw = bytes(b & 1 for b in raw)
        pid = draw(st.none() | st.integers(0, 2**64 - 1))
        tensors.append((f"{i}.{draw(st.text('abc._', min_size=1, max_size=6))}", dtype, shape, raw, pid))
    scalars = draw(st.dictionaries(
        st.text(min_size=1, max_size=6),
        st.builds(Scalar, st.just("UInt"), st.integers(0, 2**64 - 1))
        | st.builds(Scalar, st.just("Int"), st.integers(-(2**63), -1))
        | st.builds(Scalar, st.just("Float"), st.floats(allow_nan=False))
        | st.builds(Scalar, st.just("Bool"), st.booleans()),
        max_size=4))
    meta = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
    return tensors, scalars, meta


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(packs())
def test_write_read_roundtrip(tmp_path, case):
    tensors, scalars, meta = case
    path = tmp_path / "p.bpk"
    items = [
        PackTensor(name, TensorRef(dtype=dt, shape=shape, loader=(lambda r=raw: r), nbytes_hint=len(raw)), param_id=pid)
        for name, dt, shape, raw, pid in tensors
    ]
    size = write_burnpack(path, items, meta, scalars)
    data = path.read_bytes()
    assert len(data) == size
    with BurnpackFile(path) as pack:
        assert pack.metadata == meta and pack.scalars == scalars and pack.canonical
        end = 0
        for name, dt, shape, raw, pid in tensors:
            e = pack.tensors[name]
            assert (e.dtype, e.shape, e.param_id) == (dt, shape, pid)
            assert e.start % 256 == 0 and (pack.data_start + e.start) % 256 == 0
            assert bytes(pack.raw(name)) == raw
            assert data[pack.data_start + end : pack.data_start + e.start] == b"\0" * (e.start - end)
            end = e.end
        assert len(data) == pack.data_start + end


@pytest.mark.parametrize("fixture", VALID, ids=lambda p: p.name)
def test_compiled_metadata_encoding_is_burns(fixture, monkeypatch):
    """The canonical check's compiled encoder (cbor2) writes burn's bytes: the same as the exact
    encoder, which reproduces the files burn wrote."""
    pack = BurnpackFile(str(fixture))
    fast = burnpack.encode_metadata(pack.tensors, pack.metadata, pack.scalars)
    monkeypatch.setattr(burnpack, "_fast_encode", lambda value: None)
    assert fast == burnpack.encode_metadata(pack.tensors, pack.metadata, pack.scalars)
    assert pack.canonical == (fast == pack.raw_metadata)
    pack.close()


def test_metadata_the_strict_decoder_refuses_is_still_refused(tmp_path):
    """cbor2 reads an indefinite-length map; burn's bytes never hold one, so the strict decoder
    has the last word and the file is refused as before, naming the file."""
    ok = tmp_path / "ok.bpk"
    write_burnpack(str(ok), [], {"a": "b"}, {})
    raw = ok.read_bytes()
    size = struct.unpack("<I", raw[6:10])[0]
    meta = raw[10 : 10 + size]
    assert cbor.decode(meta) == {"tensors": {}, "metadata": {"a": "b"}}
    # the same map, indefinite length: bf ... ff
    body = meta[1:]
    bad = b"\xbf" + body + b"\xff"
    assert burnpack._fast_decode(bad) == {"tensors": {}, "metadata": {"a": "b"}}  # cbor2 takes it
    path = tmp_path / "bad.bpk"
    path.write_bytes(raw[:6] + struct.pack("<I", len(bad)) + bad)
    with pytest.raises(FormatError, match="bad.bpk"):
        BurnpackFile(str(path))


# ------------------------------------------------------------------ the header's fast checks
def _reference_parse(monkeypatch):
    """BurnpackFile with the per-entry checks and the encode-and-compare canonical check only."""
    monkeypatch.setattr(BurnpackFile, "_entries", lambda self, t: {n: self._entry(n, d) for n, d in t.items()})
    monkeypatch.setattr(BurnpackFile, "_scalars", lambda self, s: {n: self._scalar(n, v) for n, v in s.items()})
    monkeypatch.setattr(burnpack, "_burn_encoded", lambda raw, meta: None)


def _outcome(path):
    try:
        with BurnpackFile(str(path)) as pack:
            return ("ok", pack.canonical, pack.data_order, pack.metadata,
                    {n: (e.name, e.burn_dtype, e.shape, e.start, e.end, e.param_id, e.dtype) for n, e in pack.tensors.items()},
                    # (a NaN equals nothing, not even the other parse's NaN: compared by name)
                    {n: (s.kind, s.value if s.value == s.value else "NaN", type(s.value)) for n, s in pack.scalars.items()})
    except FormatError as exc:
        return ("refused", str(exc))


def _header_file(path, meta: dict, data_bytes: int) -> None:
    raw = cbor.encode(meta)
    head = burnpack.MAGIC + struct.pack("<HI", 1, len(raw)) + raw
    path.write_bytes(head + b"\0" * (burnpack.aligned(len(head)) - len(head) + data_bytes))


_ODD_DESCRIPTORS = [
    {"shape": [True, 4]}, {"shape": [0, 4], "data_offsets": [0, 0]}, {"shape": [-1]}, {"shape": (2, 2)},
    {"shape": [2**62, 2**3]}, {"shape": [1] * 65}, {"shape": []}, {"shape": [2, 2.0]},
    {"data_offsets": [0, 8]}, {"data_offsets": [16, 0]}, {"data_offsets": [True, 16]}, {"data_offsets": [0]},
    {"data_offsets": [0, 16, 32]}, {"data_offsets": [-16, 0]}, {"param_id": None}, {"param_id": True},
    {"param_id": 2**64 - 1}, {"param_id": -2**64}, {"param_id": -1}, {"param_id": "7"}, {"dtype": "QFloat"}, {"dtype": "F16"},
    {"dtype": {"Bool": "Native"}, "shape": [16]}, {"dtype": {"Bool": "U32"}, "shape": [4]}, {"dtype": "Bogus"},
    {"dtype": ["F32"]}, {"dtype": None}, {"extra": 1}, {"shape": None}, {"data_offsets": None},
]


@pytest.mark.parametrize("odd", range(len(_ODD_DESCRIPTORS)))
def test_fast_header_checks_accept_and_refuse_as_the_per_entry_checks(tmp_path, monkeypatch, odd):
    """The one-loop checks of descriptors and scalars, and the canonical check without a second
    encode, give the same tensors, scalars, canonical flag or refusal as the per-entry ones."""
    base = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], "param_id": 7}
    tensors = {"a.x": dict(base), "b.y": {**base, "data_offsets": [256, 272]}}
    tensors["b.y"].update(_ODD_DESCRIPTORS[odd])
    tensors["b.y"] = {k: v for k, v in tensors["b.y"].items() if v is not None or k == "param_id"}
    scalars = {"a.__rank": {"UInt": 2}, "b.t": {"Int": -3}, "c.f": {"Bool": True}}
    path = tmp_path / "odd.bpk"
    _header_file(path, {"tensors": tensors, "metadata": {"7": "l.w"}, "scalars": scalars}, 512)
    fast = _outcome(path)
    _reference_parse(monkeypatch)
    assert fast == _outcome(path)


@pytest.mark.parametrize("change", ["none", "unsorted", "empty-metadata", "descriptor-order", "extra-top", "float",
                                   "int-as-float", "bool-scalar", "uint-as-int", "big-uint", "null-id"])
def test_canonical_flag_is_the_encode_and_compare_answer(tmp_path, monkeypatch, change):
    tensors = {f"{i}.m": {"dtype": "F32", "shape": [4], "data_offsets": [256 * i, 256 * i + 16], "param_id": i}
               for i in range(3)}
    meta = {"tensors": tensors, "metadata": {"0": "a", "1": "b"}, "scalars": {"0.__rank": {"UInt": 1}}}
    if change == "unsorted":
        meta["tensors"] = dict(reversed(list(tensors.items())))
    elif change == "empty-metadata":
        meta["metadata"] = {}
    elif change == "descriptor-order":
        tensors["1.m"] = {"shape": [4], "dtype": "F32", "data_offsets": [256, 272], "param_id": 1}
    elif change == "extra-top":
        meta["other"] = 1
    elif change == "float":
        meta["scalars"]["0.lr"] = {"Float": 0.5}
    elif change == "int-as-float":
        meta["scalars"]["0.lr"] = {"Float": 3}
    elif change == "bool-scalar":
        meta["scalars"]["0.b"] = {"Bool": False}
    elif change == "uint-as-int":
        meta["scalars"]["0.i"] = {"Int": 5}
    elif change == "big-uint":
        meta["scalars"]["0.u"] = {"UInt": 2**64 - 1}
    elif change == "null-id":
        tensors["2.m"]["param_id"] = None
    path = tmp_path / "c.bpk"
    _header_file(path, meta, 3 * 256)
    fast = _outcome(path)
    _reference_parse(monkeypatch)
    assert fast == _outcome(path)
    assert fast[0] == "ok" and fast[1] == (change in ("none", "float", "bool-scalar", "uint-as-int", "big-uint"))


@pytest.mark.parametrize("path", sorted(ROOT.glob("fixtures/**/*.bpk")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_burnpack_fixture_reads_as_the_per_entry_checks_read_it(path, monkeypatch):
    fast = _outcome(path)
    _reference_parse(monkeypatch)
    assert fast == _outcome(path)
