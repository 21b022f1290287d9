"""Every bad input a clean error: one minimal reproducer per class of issue 14's fuzzing findings.

Each test builds the smallest file that used to end in a bare exception (or a hang) and checks
that the Python API now answers with a one-line StatekitError naming the problem (or, where the
input is valid, with a result).
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import struct
import zipfile
from pathlib import Path

import msgpack
import numpy as np
import pytest

import statekit
from statekit.errors import StatekitError
from statekit.formats import cbor

PID = 18402649998147242804


def bpk(tensors: dict, scalars: dict | None = None, metadata: dict | None = None, data: bytes = b"") -> bytes:
    meta: dict = {"tensors": tensors}
    if metadata:
        meta["metadata"] = metadata
    if scalars:
        meta["scalars"] = scalars
    raw = cbor.encode(meta)
    start = -(-(10 + len(raw)) // 256) * 256
    return b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw + b"\0" * (start - 10 - len(raw)) + data


def adam_bpk(shape: list, data: bytes, rank: object = None, dtype: object = "F32") -> bytes:
    tensors = {
        f"{PID}.momentum.{slot}": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)], "param_id": PID}
        for slot in ("moment_1",)
    }
    scalars = {f"{PID}.momentum.time": {"UInt": 3}}
    if rank is not None:
        scalars[f"{PID}.__rank"] = rank
    return bpk(tensors, scalars, {str(PID): "l1.weight"}, data)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text, text
    return text


def refuse(path, *parts: str, stats: bool = True) -> str:
    """The file is refused by open or inspect with a StatekitError whose message has ``parts``."""
    with pytest.raises(StatekitError) as info:
        statekit.inspect(path, stats=stats)
    text = one_line(info.value)
    for part in parts:
        assert part in text, text
    return text


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**63, 2**63], [0] + [2**40] * 3])
def test_zero_size_dimension_beside_huge_ones_is_refused(tmp_path, shape):
    refuse(write(tmp_path, "z.bpk", adam_bpk(shape, b"")), "shape")


def test_rank_65_zero_byte_tensor_is_refused(tmp_path):
    refuse(write(tmp_path, "r.bpk", adam_bpk([0] * 65, b"")), "rank 65")


def test_bool_inside_a_shape_is_not_an_integer(tmp_path):
    refuse(write(tmp_path, "b.bpk", adam_bpk([True, 2], b"\0" * 8)), "shape")


@pytest.mark.parametrize("rank", [{"Float": math.nan}, {"Float": math.inf}, {"Float": 1.5}, {"UInt": 2**40}])
def test_rank_scalar_must_be_a_small_integer(tmp_path, rank):
    refuse(write(tmp_path, "k.bpk", adam_bpk([2], b"\0" * 8, rank=rank)), "__rank")


def test_bool_slot_stored_as_u32_converts(tmp_path):
    """A {"Bool": "U32"} tensor is 4 bytes an element on disk and one bool each everywhere else."""
    data = struct.pack("<4I", 1, 0, 7, 0)
    flags = {"dtype": {"Bool": "U32"}, "shape": [4], "data_offsets": [0, 16], "param_id": PID}
    src = write(tmp_path, "bool.bpk", bpk({"flags": flags}, data=data))
    with statekit.open(src) as ckpt:
        ref = ckpt.model.params[0].tensor
        assert ref.nbytes == 4 and bytes(ref.raw()) == b"\1\0\1\0"
        assert ref.numpy().tolist() == [True, False, True, False]
    statekit.convert(src, tmp_path / "out.safetensors")
    with statekit.open(tmp_path / "out.safetensors") as again:
        assert again.model.params[0].tensor.numpy().tolist() == [True, False, True, False]
    statekit.convert(src, tmp_path / "copy.bpk")  # an exact copy keeps burn's own storage
    assert (tmp_path / "copy.bpk").read_bytes() == src.read_bytes()


def test_slot_of_another_rank_than_the_plan_is_refused(tmp_path):
    """Two slots of one parameter with different ranks used to reach a zip() of unequal lengths."""
    t = {
        f"{PID}.momentum.moment_1": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8], "param_id": PID},
        f"{PID}.momentum.moment_2": {"dtype": "F32", "shape": [2], "data_offsets": [256, 264], "param_id": PID},
    }
    data = b"\0" * 256 + b"\0" * 8
    scalars = {f"{PID}.momentum.time": {"UInt": 3}, f"{PID}.__rank": {"UInt": 2}}
    src = write(tmp_path, "ranks.bpk", bpk(t, scalars, {str(PID): "l1.weight"}, data))
    with pytest.raises(StatekitError) as info:
        statekit.convert(src, tmp_path / "out.pt", optimizer="adam", names=["l1.weight"])
    assert "differ in rank" in one_line(info.value)


# ------------------------------------------------------------------------------ legacy msgpack


def record(item) -> bytes:
    meta = {"float": "f32", "int": "i64", "format": "burn::record::file::NamedMpkFileRecorder",
            "version": "0.21.0", "settings": "FullPrecisionSettings"}
    return msgpack.packb({"metadata": meta, "item": item, "_b": []}, use_bin_type=True)


def adam_item(moment_1) -> dict:
    tensor = {"bytes": b"\0" * 8, "shape": [2], "dtype": "F32"}
    state = {"momentum": {"time": 3, "moment_1": moment_1, "moment_2": tensor}}
    return {"0000000000000": {"V1": {"Rank1": state}}}


def test_number_where_a_tensor_record_is_expected(tmp_path):
    refuse(write(tmp_path, "n.mpk", record(adam_item(1.5))), "moment_1")
    refuse(write(tmp_path, "n.mpk.gz", gzip.compress(record(adam_item(1.5)))), "moment_1")


def test_msgpack_level_lies_are_format_errors(tmp_path):
    good = record(adam_item({"bytes": b"\0" * 8, "shape": [2], "dtype": "F32"}))
    for data in (good[:-3], good + b"\xc1", good.replace(b"\xc4\x08", b"\xc6\xff\xff\xff\xff", 1)):
        refuse(write(tmp_path, "lie.mpk", data))


# ------------------------------------------------------------------------------ torch zip


def torch_zip(pkl: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        for key, data in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def test_negative_local_header_offset_is_refused(tmp_path, fixtures):
    data = (fixtures / "torch" / "state_dict.pt").read_bytes()
    cut = data.index(b"PK\x01\x02")  # bytes removed before the central directory
    refuse(write(tmp_path, "neg.pt", data[:100] + data[cut - 4000 if cut > 4000 else 200 :]))
    refuse(write(tmp_path, "neg2.pt", data[:cut - 64] + data[cut:]))


def test_zip_version_needed_64_is_refused(tmp_path, fixtures):
    data = bytearray((fixtures / "torch" / "state_dict.pt").read_bytes())
    central = data.index(b"PK\x01\x02")
    data[central + 6 : central + 8] = struct.pack("<H", 64)
    data[4:6] = struct.pack("<H", 64)
    path = write(tmp_path, "v64.pt", bytes(data))
    try:
        statekit.inspect(path, stats=True)
    except StatekitError as exc:
        one_line(exc)


def test_lone_surrogate_in_a_name_is_refused_by_name(tmp_path):
    raw = "l1.\ud800".encode("utf-8", "surrogatepass")
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw
    pkl += pickle.BININT1 + b"\x01" + pickle.SETITEM + pickle.STOP
    text = refuse(write(tmp_path, "s.pt", torch_zip(pkl)), "surrogate")
    assert "l1." in text


def legacy_pt(obj_pickle: bytes, storages: list[tuple[str, bytes]]) -> bytes:
    head = pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True}, 2)
    tail = pickle.dumps([k for k, _ in storages], 2)
    body = b"".join(struct.pack("<q", len(d) // 4) + d for _, d in storages)
    return head + obj_pickle + tail + body


def rebuild_call(size: tuple, stride: tuple, numel: int = 4) -> bytes:
    """A protocol-2 pickle of ``_rebuild_tensor_v2(storage '0' of ``numel`` floats, 0, size, stride, …)``."""
    def tup(items):
        return pickle.MARK + b"".join(pickle.LONG1 + bytes([len(r)]) + r for r in map(pickle.encode_long, items)) \
            + pickle.TUPLE
    out = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n"
    out += pickle.MARK + pickle.MARK + pickle.BINUNICODE + struct.pack("<I", 7) + b"storage"
    out += pickle.GLOBAL + b"torch\nFloatStorage\n" + pickle.BINUNICODE + struct.pack("<I", 1) + b"0"
    out += pickle.BINUNICODE + struct.pack("<I", 3) + b"cpu" + pickle.BININT1 + bytes([numel]) + pickle.NONE
    out += pickle.TUPLE + pickle.BINPERSID + pickle.BININT1 + b"\0" + tup(size) + tup(stride)
    out += pickle.NEWFALSE + pickle.EMPTY_DICT + pickle.TUPLE + pickle.REDUCE
    return out


def test_legacy_stride_near_2_62_is_refused(tmp_path):
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", 1) + b"w"
    pkl += rebuild_call((1, 2), (2**62, 1))[2:-0 or None] + pickle.SETITEM + pickle.STOP
    path = write(tmp_path, "stride.pt", legacy_pt(pkl, [("0", b"\0" * 16)]))
    refuse(path, "stride")


# ------------------------------------------------------------------------------ safetensors


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = __import__("json").dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def test_deeply_nested_json_metadata_is_refused(tmp_path, fixtures):
    import json

    from safetensors import safe_open

    src = fixtures / "candle" / "optimizer.safetensors"
    data = src.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    with safe_open(str(src), "np"):
        pass
    header["__metadata__"] = {"format": "statekit.state", "format_version": "1",
                              "params": "[" * 100_000 + "]" * 100_000}
    refuse(write(tmp_path, "deep.safetensors", safetensors_bytes(header, data[8 + n :])), "nest")


def test_safetensors_zero_size_dimension_beside_huge_ones(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [0, 2**63, 2**63], "data_offsets": [0, 0]}}
    try:
        statekit.inspect(write(tmp_path, "z.safetensors", safetensors_bytes(header)), stats=True)
    except StatekitError as exc:
        one_line(exc)


# ------------------------------------------------------------------------------ regex renames


def test_norm_preset_rename_of_a_70000_character_path():
    """The preset rules are suffix rules: linear in the path length (bench/robustness.py times it;
    the quadratic version took minutes on a path this long)."""
    from statekit.ops.rules import NORM_PRESET, RenameRule, rename

    rules = [RenameRule(p, r, "preset") for p, r in NORM_PRESET]
    assert rename("a" * 70_000 + ".gamma", rules) == "a" * 70_000 + ".weight"
    assert rename("b." * 35_000, rules) == "b." * 35_000
    assert rename("ln.gamma.beta", rules) == "ln.gamma.bias"


# ------------------------------------------------------------------------------ limits while decoding


def hyper_pickle(value: bytes) -> bytes:
    """``{"param_groups": [{"lr": <value>}]}`` with ``value`` as raw opcodes."""
    s = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", 12) + b"param_groups"
    s += pickle.EMPTY_LIST + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", 2) + b"lr" + value
    return s + pickle.SETITEM + pickle.APPEND + pickle.SETITEM + pickle.STOP


def memo_laughs(levels: int) -> bytes:
    s = pickle.NONE
    for i in range(levels):
        s += pickle.BINPUT + bytes([i]) + pickle.POP + pickle.MARK + pickle.BINGET + bytes([i])
        s += pickle.BINGET + bytes([i]) + pickle.LIST
    return s


PICKLE_BOMBS = {
    "memo-laughs": (memo_laughs(40), "memo bomb"),
    "self-list": (pickle.EMPTY_LIST + pickle.BINPUT + b"\0" + pickle.BINGET + b"\0" + pickle.APPEND, "itself"),
    "self-dict": (pickle.EMPTY_DICT + pickle.BINPUT + b"\0" + pickle.BININT1 + b"\1" + pickle.BINGET + b"\0"
                  + pickle.SETITEM, "itself"),
    "deep-marks": ((pickle.EMPTY_LIST + pickle.MARK) * 10**5 + pickle.NONE + pickle.APPENDS * 10**5, "deeper"),
    "deep-tuples": (pickle.NONE + pickle.TUPLE1 * 10**5, "deeper"),
    "huge-long4": (pickle.LONG4 + struct.pack("<i", 10**6) + b"\1" * 10**6, "too large"),
    "tuple-key-hash": (pickle.EMPTY_DICT + pickle.NONE + pickle.TUPLE1 * 3 + pickle.NONE + pickle.SETITEM,
                       "dict key"),
}


@pytest.mark.parametrize("name", [k for k, v in PICKLE_BOMBS.items() if v[1]])
def test_pickle_bombs_are_refused_while_decoding(tmp_path, name):
    value, message = PICKLE_BOMBS[name]
    refuse(write(tmp_path, f"{name}.pt", torch_zip(hyper_pickle(value))), message)


def test_nested_shared_tuples_as_a_key_are_refused_before_hashing(tmp_path):
    """Hashing t40 = (t39, t39) … would visit 2^40 tuples; the key is refused by its type first."""
    s = pickle.NONE
    for i in range(40):
        s += pickle.BINPUT + bytes([i]) + pickle.POP + pickle.BINGET + bytes([i]) + pickle.BINGET + bytes([i])
        s += pickle.TUPLE2
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + s + pickle.NONE + pickle.SETITEM + pickle.STOP
    refuse(write(tmp_path, "hash.pt", torch_zip(pkl)), "dict key")


def test_memo_bomb_in_a_refused_argument_is_named_without_expanding_it(tmp_path):
    """The error for a bad tensor size names it with a bounded repr: a 40-level memo bomb as the
    size is refused at once (its full repr has 2^40 leaves; the message used to build it)."""
    def op_str(text: str) -> bytes:
        return pickle.BINUNICODE + struct.pack("<I", len(text)) + text.encode()

    def op_global(module: str, name: str) -> bytes:
        return pickle.GLOBAL + f"{module}\n{name}\n".encode()

    pid = (pickle.MARK + op_str("storage") + op_global("torch", "FloatStorage") + op_str("0") + op_str("cpu")
           + pickle.BININT1 + b"\4" + pickle.TUPLE + pickle.BINPERSID)
    args = (pickle.MARK + pid + pickle.BININT1 + b"\0" + memo_laughs(40) + pickle.MARK + pickle.BININT1 + b"\1"
            + pickle.TUPLE + pickle.NEWFALSE + op_global("collections", "OrderedDict") + pickle.EMPTY_TUPLE
            + pickle.REDUCE + pickle.TUPLE)
    pkl = (pickle.PROTO + b"\2" + pickle.EMPTY_DICT + op_str("w") + op_global("torch._utils", "_rebuild_tensor_v2")
           + args + pickle.REDUCE + pickle.SETITEM + pickle.STOP)
    text = refuse(write(tmp_path, "laughs-size.pt", torch_zip(pkl, {"0": bytes(16)})), "tensor size [[[[...]")
    assert len(text) < 400, text


def test_pickle_opcode_count_limit(tmp_path, monkeypatch):
    from statekit.formats import torch_pickle

    monkeypatch.setattr(torch_pickle.interpreter, "MAX_STEPS", 1000)
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + (pickle.NONE + pickle.APPEND) * 600 + pickle.STOP
    refuse(write(tmp_path, "steps.pt", torch_zip(pkl)), "opcodes")


def test_burnpack_tensor_count_is_refused_at_the_map_head(tmp_path):
    """A map declaring more tensors than burn's limit is refused before any entry is decoded."""
    head = cbor._head(5, 1) + cbor.encode("tensors") + cbor._head(5, 100_001)
    refuse(write(tmp_path, "many.bpk", b"NRUB" + struct.pack("<HI", 1, len(head)) + head), "100000")


def test_cbor_nesting_limit():
    with pytest.raises(cbor.CborError, match="nesting"):
        cbor.decode(b"\x81" * 200 + b"\x00")


def test_msgpack_nesting_limit(tmp_path):
    deep: object = 0
    for _ in range(200):
        deep = [deep]
    refuse(write(tmp_path, "deep.mpk", record({"a": deep})), "nested deeper")


def test_gzip_inflate_cap(tmp_path):
    import zlib

    from statekit.formats import limits

    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    data = comp.compress(b"\x83\xa8metadata" + b"\0" * (limits.MAX_INFLATE + (1 << 20))) + comp.flush()
    assert limits.inflate_cap(len(data)) == limits.MAX_INFLATE  # the floor applies to this small file
    refuse(write(tmp_path, "bomb.mpk.gz", data), "decompression bomb")


def test_bincode_entry_count_limit():
    from statekit.formats import limits
    from statekit.formats.bincode import BincodeError, BincodeReader

    n = limits.MAX_CONTAINER + 1
    data = b"\xfc" + struct.pack("<I", n) + b"\0" * (3 * n)
    with pytest.raises(BincodeError, match="limit"):
        BincodeReader(data).length(min_item_size=3)


def test_unhashable_bool_store_is_an_unknown_dtype(tmp_path):
    """Found by scripts/fuzz.py (burnpack 105421): ``{"Bool": [..]}`` used to fail a dict lookup."""
    refuse(write(tmp_path, "b.bpk", adam_bpk([2], b"\0" * 2, dtype={"Bool": ["U32"]})), "dtype")


def test_many_views_of_one_storage_are_read_not_refused(tmp_path):
    """Sharing one storage is no bomb: every view reads its own element (bench/robustness.py times 10^6)."""
    n = 5000
    body = b""
    for i in range(n):
        key = f"t{i}".encode()
        call = rebuild_call((1,), (1,), numel=0)[2:]  # without PROTO
        call = call.replace(pickle.BININT1 + b"\0" + pickle.NONE, pickle.LONG1 + b"\x02" + struct.pack("<H", n) + pickle.NONE)
        call = call.replace(pickle.BINPERSID + pickle.BININT1 + b"\0", pickle.BINPERSID + pickle.LONG1 + b"\x03"
                            + i.to_bytes(3, "little"))
        body += pickle.BINUNICODE + struct.pack("<I", len(key)) + key + call
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.MARK + body + pickle.SETITEMS + pickle.STOP
    path = write(tmp_path, "views.pt", torch_zip(pkl, {"0": np.arange(n, dtype="<f4").tobytes()}))
    with statekit.open(path) as ckpt:
        params = ckpt.model.params
        assert len(params) == n
        assert [p.tensor.numpy().tolist() for p in params[::997]] == [[float(i)] for i in range(0, n, 997)]


def test_statekit_state_scalar_of_an_unknown_kind(tmp_path, fixtures):
    """Found by scripts/fuzz.py (safetensors 115939): a ``__scalar__`` whose kind was a list."""
    import json

    statekit.convert(fixtures / "hand-optim.bpk", tmp_path / "s.safetensors")
    data = (tmp_path / "s.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    params = json.loads(header["__metadata__"]["params"])
    params[0]["extra"] = {"x": {"__scalar__": [["UInt"], 3]}}
    header["__metadata__"]["params"] = json.dumps(params)
    refuse(write(tmp_path, "bad.safetensors", safetensors_bytes(header, data[8 + n :])), "scalar")


@pytest.mark.parametrize("change", [{"extra": {"__step_kind": {"UInt": 1}}}, {"step": 1e400}, {"step": [3]}],
                         ids=["step-kind", "step-inf", "step-list"])
def test_statekit_state_step_fields(tmp_path, fixtures, change):
    """Found by scripts/fuzz.py (safetensors 307153, 310024): a step kind burn has no variant for."""
    import json

    statekit.convert(fixtures / "hand-optim.bpk", tmp_path / "s.safetensors")
    data = (tmp_path / "s.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    params = json.loads(header["__metadata__"]["params"])
    params[0].update(change)
    header["__metadata__"]["params"] = json.dumps(params)
    refuse(write(tmp_path, "bad.safetensors", safetensors_bytes(header, data[8 + n :])), "wrong type")


def test_broadcast_view_that_outgrows_its_storage_is_refused(tmp_path):
    """Found by scripts/fuzz.py (torch-zip 353678): stride 0 over 2 floats made a 32 GiB array."""
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", 1) + b"w"
    pkl += rebuild_call((2, 2**32 - 1), (1, 0), numel=2)[2:] + pickle.SETITEM + pickle.STOP
    refuse(write(tmp_path, "wide.pt", torch_zip(pkl, {"0": b"\0" * 8})), "outgrow")


def test_a_quantized_tensor_without_its_scheme_is_refused_by_name_before_writing():
    """Fuzz crasher msgpack 3071368 (kept in fixtures/fuzz-corpus): a burn <= 0.21 record's QFloat
    tensor carries no burnpack quantization scheme, so writing it as burnpack is refused by name."""
    from statekit.errors import MappingError
    from statekit.formats.burnpack import PackTensor
    from statekit.tensor import TensorRef

    ref = TensorRef("QFloat", (4,), loader=lambda: b"\0" * 4, nbytes_hint=4)
    with pytest.raises(MappingError, match=r"^7\.momentum\.moment_1: a quantized \(QFloat\) tensor"):
        PackTensor("7.momentum.moment_1", ref)
    scheme = {"QFloat": {"value": "Q8S"}}  # with a scheme (read from a burnpack) it is kept as is
    assert PackTensor("x", TensorRef("QFloat", (4,), loader=lambda: b"\0" * 4, nbytes_hint=4,
                                     info={"burn_dtype": scheme})).burn_dtype == scheme


# ------------------------------------------------------------------------------ param groups (issue 21)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("key", [("a", "b"), 3, None])
@pytest.mark.parametrize("family", ["adam", "unknown"])
def test_param_group_with_a_key_that_is_not_a_string(tmp_path, key, family, legacy):
    """A param group key that is no string (torch.save writes what it is given) used to end in
    "internal error: TypeError: '<' not supported between instances of 'tuple' and 'str'" once
    the family was unknown (and to be written back as a string otherwise): one line naming it.
    A ``None`` key slipped past the check (None was its "nothing found"): issue 29's fuzz class,
    a legacy .pt (fixtures/fuzz-corpus/torch-legacy-d25d9498bed5.pt) in inspect, doctor, convert."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    if family == "adam":
        opt = torch.optim.Adam([p])
        p.grad = torch.ones(3)
        opt.step()
        sd = opt.state_dict()
    else:
        sd = {"state": {0: {"foo": torch.ones(3)}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    sd["param_groups"][0][key] = 1
    path = tmp_path / "group.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    for stats in (False, True):
        refuse(path, "param_groups[0]", "not a string", repr(key), stats=stats)
    for command in (["inspect"], ["doctor"], ["convert", "--to", "safetensors"]):
        args = [*command[:1], str(path), *([str(tmp_path / "out.safetensors")] if command[0] == "convert" else [])]
        done = subprocess.run([sys.executable, "-m", "statekit", *args, *command[1:]], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        assert done.returncode != 0 and not done.stdout
        assert done.stderr.count("\n") == 1 and str(path) in done.stderr and "internal error" not in done.stderr
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("key", [(128,), 3, None])
@pytest.mark.parametrize("family", ["adam", "bnb"])
def test_param_state_with_a_key_that_is_not_a_string(tmp_path, key, family):
    """Fuzz crasher torch-zip (fixtures/fuzz-corpus/torch-zip-8a5e87c6c3f4.pt, a bitsandbytes
    state): a per-parameter state key that is no string became a field "name" and ended in
    "internal error: TypeError: sequence item 5: expected str instance, tuple found" in inspect's
    table: one line naming it."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if family == "adam":
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([p])
        p.grad = torch.ones(3)
        opt.step()
        sd = opt.state_dict()
        path = tmp_path / "state.pt"
    else:  # the real bitsandbytes file, loaded by torch and saved back with the odd key
        sd = torch.load(Path(__file__).resolve().parent.parent / "fixtures" / "bnb" / "adamw8bit.pt",
                        weights_only=True)
        path = tmp_path / "bnb.pt"
    sd["state"][0][key] = 1
    torch.save(sd, path)
    for stats in (False, True):
        refuse(path, "state[0]", "not a string", repr(key), stats=stats)
    done = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(path)], capture_output=True, text=True)
    assert done.returncode != 0 and not done.stdout
    assert done.stderr.count("\n") == 1 and str(path) in done.stderr and "internal error" not in done.stderr


def test_statistics_of_values_near_the_float64_limit(tmp_path):
    """Values at or past 2^1023 (float64's top binade) ended inspect --stats in an internal
    OverflowError (the sums' scale was 2^1024, no float); now scaled by 2^1023. Hand-computed
    references: both values equal, so min = max = mean = rms."""
    from statekit.ops.inspect import tensor_stats
    from statekit.tensor import TensorRef

    for values in ([1e308, 1e308], [-1.7e308, -1.7e308, -1.7e308], [1e308]):
        s = tensor_stats(TensorRef.from_array(np.array(values, dtype=np.float64)))
        v = values[0]
        assert (s["min"], s["max"], s["nan"], s["inf"]) == (v, v, 0, 0)
        assert s["mean"] == pytest.approx(v, rel=1e-15) and s["rms"] == pytest.approx(abs(v), rel=1e-15)


def test_param_group_whose_params_is_no_list(tmp_path):
    """A group whose ``params`` is a float ended in "internal error: TypeError: 'float' object is not
    iterable" while telling names from ids (frameworks/torch_fqn.py; found beside issue 29's fuzz
    classes, fixtures/fuzz-corpus/torch-zip-c012d79c95f5.pt): one line naming the group."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(3)
    opt.step()
    for value in (0.5, "0", None, {0: 0}):
        sd = opt.state_dict()
        sd["param_groups"][0]["params"] = value
        torch.save(sd, tmp_path / "group.pt")
        refuse(tmp_path / "group.pt", "param_groups[0] has no 'params' list")


def empty_view_at(offset: int) -> bytes:
    """torch.save's own file of an empty view (``torch.ones(3)[3:]``: storage offset 3), its offset
    then set to ``offset`` in the pickle."""
    torch = pytest.importorskip("torch")
    out = io.BytesIO()
    torch.save({"w": torch.ones(3)[3:]}, out)
    with zipfile.ZipFile(io.BytesIO(out.getvalue())) as zf:
        entries = [(info.filename, zf.read(info)) for info in zf.infolist()]
    name, pkl = next((n, b) for n, b in entries if n.endswith("/data.pkl"))
    at = pkl.index(pickle.BINPERSID) + 1
    assert pkl[at : at + 2] == pickle.BININT1 + b"\x03"
    raw = pickle.encode_long(offset)
    pkl = pkl[:at] + pickle.LONG1 + bytes([len(raw)]) + raw + pkl[at + 2 :]
    new = io.BytesIO()
    with zipfile.ZipFile(new, "w", zipfile.ZIP_STORED) as zf:
        for n, body in entries:
            zf.writestr(n, pkl if n == name else body)
    return new.getvalue()


def test_an_empty_tensor_at_a_storage_offset_past_int64_is_refused(tmp_path):
    """Reading such a tensor raised OverflowError ("Python int too large to convert to C long")
    through the Python API (issue 29's fuzz class, fixtures/fuzz-corpus/torch-zip-ed67e17488bd.pt);
    torch itself refuses the offset ("Overflow when unpacking long long")."""
    path = write(tmp_path, "e.pt", empty_view_at(2**63))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="Overflow"):
        torch.load(path, weights_only=True)
    with pytest.raises(StatekitError) as info:
        with statekit.open(path) as ckpt:
            [p.tensor.numpy() for p in ckpt.model.params]
    assert "offset 9223372036854775808" in one_line(info.value)


def test_an_empty_tensor_far_past_its_storage_reads_empty_as_in_torch(tmp_path):
    """An offset within int64 is an empty tensor's own business: torch loads it, so does statekit,
    reading nothing (the offset times the item size is past any file position)."""
    torch = pytest.importorskip("torch")
    path = write(tmp_path, "e.pt", empty_view_at(2**62))
    theirs = torch.load(path, weights_only=True)["w"]
    with statekit.open(path) as ckpt:
        ours = ckpt.model.params[0].tensor.numpy()
    assert ours.shape == tuple(theirs.shape) == (0,) and ours.dtype == np.float32
    assert statekit.inspect(path, stats=True)["params"][0]["shape"] == [0]
