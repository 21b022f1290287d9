"""burn ≤ 0.21 legacy records (.mpk, .mpk.gz, .bin, .bin.gz): fixtures, hand-built bytes, bad input."""

from __future__ import annotations

import gzip
import importlib.util
import mmap
import struct
import time
import uuid

import msgpack
import numpy as np
import pytest
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from statekit.errors import FormatError
from statekit.formats import burn_legacy as bl
from statekit.formats.bincode import BincodeError, BincodeReader
from statekit.tensor import TensorRef

LEGACY = ROOT / "fixtures" / "legacy"


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_legacy_fixtures", ROOT / "scripts" / "make_legacy_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _load_script()  # the fixture writer: its byte helpers build extra cases below
TRUTH = dict(np.load(LEGACY / "truth.npz"))
IDS = {
    "l1.weight": 18402649998147242804,
    "l1.bias": 4872954564708272749,
    "l2.weight": 708128169117982014,
    "l2.bias": 2021826497617271949,
}
RANKS = {"l1.weight": 2, "l1.bias": 1, "l2.weight": 2, "l2.bias": 1}


def full_meta(recorder: str = "NamedMpkFileRecorder", version: str = "0.21.0") -> dict[str, str]:
    meta = W.metadata(recorder, "Full")
    meta["version"] = version
    return meta


def mp_file(item: object, meta: dict | None = None) -> bytes:
    """A BurnRecord in named msgpack, packed here with msgpack directly (not the script)."""
    return msgpack.packb({"metadata": meta or full_meta(), "item": item, "_b": []}, use_bin_type=True)


def td(arr: np.ndarray, dtype: str = "F32") -> dict:
    return {
        "bytes": np.asarray(arr, dtype=W.NUMPY[dtype]).tobytes(),
        "shape": list(np.shape(arr)),
        "dtype": dtype,
    }


# ------------------------------------------------------------------------------------------------
# ParamId strings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [(18402649998147242804, "6j5mg0dcb1hvu"), (9505838338724798577, "e4gfnnsqgnlo6"), (0, "0000000000000")],
)
def test_param_id_known(value, text):
    assert bl.param_id_to_str(value) == text
    assert bl.param_id_from_str(text) == value
    assert bl.param_id_from_str(text.upper()) == value


@given(st.integers(0, 2**64 - 1))
def test_param_id_round_trip(value):
    text = bl.param_id_to_str(value)
    assert text == W.id_to_str(value)
    assert bl.param_id_from_str(text) == value


def test_param_id_short_and_uuid_and_bad():
    six = 0x0000_A1B2_C3D4_E5F6
    short = W.id_to_str(six)[:10]  # 6 little-endian bytes → 10 characters
    assert bl.param_id_from_str(short) == six
    assert bl.param_id_from_str(str(uuid.UUID(int=12345))) is None  # ahash'd by burn: unrecoverable
    for bad in ("6j5mg0dcb1hvv", "not-an-id", "6j5mg0dcb1hv", "wwwwwwwwwwwww", "0" * 16):
        with pytest.raises(ValueError):
            bl.param_id_from_str(bad)


# ------------------------------------------------------------------------------------------------
# Fixtures against the truth file
# ------------------------------------------------------------------------------------------------


def check_entries(opt: bl.LegacyOptimizer, fields: tuple[str, ...], dtype: str) -> None:
    assert {e.id for e in opt.entries} == set(IDS.values())
    by_id = opt.by_id()
    for path, pid in IDS.items():
        entry = by_id[pid]
        assert entry.display_id == bl.param_id_to_str(pid)
        assert entry.rank == RANKS[path] == TRUTH[f"{pid}.__rank"]
        expected = {f"momentum.{f}" for f in fields}
        if "moment_1" in fields:
            expected.add("momentum.time")
            assert entry.fields["momentum.time"] == 21 == TRUTH[f"{pid}.momentum.time"]
        assert set(entry.fields) == expected
        for name in fields:
            ref = entry.fields[f"momentum.{name}"]
            assert isinstance(ref, TensorRef) and ref.dtype == dtype
            want = TRUTH[f"{pid}.momentum.{name}"]
            got = ref.numpy()
            assert got.shape == want.shape
            if dtype == "F16":
                np.testing.assert_array_equal(got, want.astype(np.float16))
            else:
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("name", "encoding", "compressed", "precision", "dtype"),
    [
        ("adam_full.mpk", "msgpack", False, "full", "F32"),
        ("adam_half.mpk", "msgpack", False, "half", "F16"),
        ("adam_half.mpk.gz", "msgpack", True, "half", "F16"),
        ("adam_full.bin", "bincode", False, "full", "F32"),
    ],
)
def test_adam_fixtures(name, encoding, compressed, precision, dtype):
    rec = bl.read_legacy(LEGACY / name)
    assert (rec.kind, rec.encoding, rec.compressed, rec.precision) == (
        "optimizer",
        encoding,
        compressed,
        precision,
    )
    assert rec.metadata["version"] == "0.21.0"
    assert rec.item.families == ("adam", "adamw")
    assert rec.item.alternatives == []
    check_entries(rec.item, ("moment_1", "moment_2"), dtype)  # max_moment_2 absent (nil / tag 0)


def test_half_precision_metadata():
    rec = bl.read_legacy(LEGACY / "adam_half.mpk")
    assert rec.metadata["float"] == "half::binary16::f16"  # type_name::<half::f16>()
    assert rec.metadata["int"] == "i16"
    assert rec.metadata["settings"] == "HalfPrecisionSettings"
    assert rec.metadata["format"].endswith(
        "NamedMpkFileRecorder<burn_core::record::settings::HalfPrecisionSettings>"
    )
    assert "NamedMpkGzFileRecorder" in bl.read_legacy(LEGACY / "adam_half.mpk.gz").metadata["format"]


def test_amsgrad_fixture():
    rec = bl.read_legacy(LEGACY / "adamw_amsgrad.mpk")
    assert rec.item.families == ("adam", "adamw")
    check_entries(rec.item, ("moment_1", "moment_2", "max_moment_2"), "F32")


def test_sgd_fixtures():
    rec = bl.read_legacy(LEGACY / "sgd_momentum.mpk")
    assert rec.item.families == ("sgd", "muon")  # same named-msgpack shape
    check_entries(rec.item, ("velocity",), "F32")

    rec = bl.read_legacy(LEGACY / "sgd_momentum_half.bin.gz")
    assert (rec.encoding, rec.compressed, rec.precision) == ("bincode", True, "half")
    assert rec.item.families == ("sgd",)  # bincode's Option tag rules Muon out...
    check_entries(rec.item, ("velocity",), "F16")
    # ...but `01 <tensor>` is also AdaGrad with time = 1: reported, not guessed away
    assert [alt.families for alt in rec.item.alternatives] == [("adagrad",)]
    alt = rec.item.alternatives[0].by_id()[IDS["l1.weight"]]
    assert alt.fields["lr_decay.time"] == 1 and alt.fields["lr_decay.sum"].shape == (4, 16)
    assert any("adagrad" in note for note in rec.notes)


def test_model_fixture_and_join():
    rec = bl.read_legacy(LEGACY / "model-21.mpk")
    assert rec.kind == "model"
    assert [(p.path, p.id) for p in rec.item.params] == list(IDS.items())
    for p in rec.item.params:
        assert p.display_id == bl.param_id_to_str(p.id)
        np.testing.assert_array_equal(p.tensor.numpy(), TRUTH[f"model.{p.path}"])
    assert rec.item.paths_by_id() == {v: k for k, v in IDS.items()}
    assert set(rec.item.paths_by_id()) == set(bl.read_legacy(LEGACY / "adam_full.mpk").item.by_id())
    assert [p.tensor.shape for p in rec.item.params] == [(4, 16), (16,), (16, 1), (1,)]


def test_truth_file_layout():
    assert list(TRUTH["ids"]) == list(IDS.values())
    assert list(TRUTH["paths"]) == list(IDS)
    moment_2 = [TRUTH[f"{pid}.momentum.moment_2"] for pid in IDS.values()]
    assert all(m.dtype == np.float32 and (m >= 0).all() for m in moment_2)
    for pid in IDS.values():
        assert (TRUTH[f"{pid}.momentum.max_moment_2"] >= TRUTH[f"{pid}.momentum.moment_2"]).all()


def test_fixtures_match_the_script():
    for name, data in W.build_fixtures().items():
        disk = (LEGACY / name).read_bytes()
        if name.endswith(".gz"):  # deflate output may differ between zlib builds; the content may not
            disk, data = gzip.decompress(disk), gzip.decompress(data)
        assert disk == data, f"{name} is stale: run scripts/make_legacy_fixtures.py"


def test_bincode_tensors_are_zero_copy_views():
    rec = bl.read_legacy(LEGACY / "adam_full.bin")
    raw = rec.item.entries[0].fields["momentum.moment_1"].loader()
    assert isinstance(raw, memoryview) and isinstance(raw.obj, mmap.mmap)


def test_sniff_and_is_legacy(tmp_path):
    for name in (
        "adam_full.mpk",
        "adam_half.mpk.gz",
        "adam_full.bin",
        "sgd_momentum_half.bin.gz",
        "model-21.mpk",
    ):
        assert bl.is_legacy_record(LEGACY / name)
    assert not bl.is_legacy_record(ROOT / "fixtures" / "burn" / "mnist-model.bpk")
    assert not bl.is_legacy_record(tmp_path / "missing.mpk")
    assert bl.sniff(b"\x03f16\x03i16") == "bincode"
    assert bl.sniff(b"\x13half::binary16::f16") == "bincode"
    assert bl.sniff(b"\x03abc") is None


def test_read_legacy_bytes_matches_file():
    data = (LEGACY / "adam_half.mpk.gz").read_bytes()
    rec = bl.read_legacy_bytes(data)
    assert rec.compressed and rec.item.families == ("adam", "adamw")
    check_entries(rec.item, ("moment_1", "moment_2"), "F16")


# ------------------------------------------------------------------------------------------------
# Hand-built named msgpack (composed here from the doc, not with the fixture writer)
# ------------------------------------------------------------------------------------------------


def test_doc_example_4_5():
    moment = np.array([0.5, -1.25], dtype="<f4")
    meta = {
        "float": "f32",
        "int": "i32",
        "format": "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>",
        "version": "0.21.0",
        "settings": "FullPrecisionSettings",
    }
    state = {
        "momentum": {
            "time": 3,
            "moment_1": {"bytes": moment.tobytes(), "shape": [2], "dtype": "F32"},
            "moment_2": {"bytes": (moment**2).tobytes(), "shape": [2], "dtype": "F32"},
            "max_moment_2": None,
        }
    }
    data = msgpack.packb(
        {"metadata": meta, "item": {"e4gfnnsqgnlo6": {"V1": {"Rank1": state}}}, "_b": []}, use_bin_type=True
    )
    expected_start = (
        b"\x83\xa8metadata\x85\xa5float\xa3f32\xa3int\xa3i32\xa6format\xd9\x61"
        + meta["format"].encode()
        + b"\xa7version\xa60.21.0\xa8settings\xb5FullPrecisionSettings\xa4item\x81\xade4gfnnsqgnlo6"
        + b"\x81\xa2V1\x81\xa5Rank1\x81\xa8momentum\x84\xa4time\x03"
    )
    assert data.startswith(expected_start)
    assert data.endswith(b"\xacmax_moment_2\xc0\xa2_b\x90")  # max_moment_2: nil, then _b: []
    rec = bl.read_legacy_bytes(data)
    (entry,) = rec.item.entries
    assert (entry.id, entry.rank, entry.fields["momentum.time"]) == (9505838338724798577, 1, 3)
    np.testing.assert_array_equal(entry.fields["momentum.moment_1"].numpy(), moment)
    assert "momentum.max_moment_2" not in entry.fields
    assert rec.item.families == ("adam", "adamw")


def test_model_walk_vec_option_and_nil():
    p = {"id": W.id_to_str(1), "param": td(np.ones((2, 3)))}
    q = {"id": W.id_to_str(2), "param": td(np.zeros(3))}
    r = {"id": W.id_to_str(3), "param": td(np.zeros(2), "F64")}
    item = {
        "layers": [{"weight": p, "bias": None}, {"weight": p | {"id": W.id_to_str(4)}, "bias": q}],
        "activation": None,
        "dropout": None,
        "norm": {"gamma": r},
    }
    rec = bl.read_legacy_bytes(mp_file(item))
    assert rec.kind == "model"
    got = [(x.path, x.id, x.tensor.dtype, x.tensor.shape) for x in rec.item.params]
    assert got == [
        ("layers.0.weight", 1, "F32", (2, 3)),
        ("layers.1.weight", 4, "F32", (2, 3)),
        ("layers.1.bias", 2, "F32", (3,)),
        ("norm.gamma", 3, "F64", (2,)),
    ]


def test_bool_tensors_old_and_new_spelling():
    data = bytes([1, 0, 1])
    item = {
        "mask_old": {"id": W.id_to_str(5), "param": {"bytes": data, "shape": [3], "dtype": "Bool"}},
        "mask_new": {
            "id": W.id_to_str(6),
            "param": {"bytes": data, "shape": [3], "dtype": {"Bool": "Native"}},
        },
        "mask_u32": {
            "id": W.id_to_str(7),
            "param": {"bytes": np.array([1, 0, 9], "<u4").tobytes(), "shape": [3], "dtype": {"Bool": "U32"}},
        },
    }
    params = bl.read_legacy_bytes(mp_file(item)).item.params
    for p in params:
        assert p.tensor.dtype == "Bool"
        np.testing.assert_array_equal(p.tensor.numpy(), [True, False, True])
    assert params[2].tensor.info["bool_store"] == "U32"


def test_other_optimizers_msgpack():
    t = td(np.ones(2))
    cases = {
        "adagrad": {"lr_decay": {"time": 4, "sum": t}},
        "adan": {
            "momentum": {"time": 2, "exp_avg": t, "exp_avg_sq": t, "exp_avg_diff": t, "neg_pre_grad": t}
        },
        "rmsprop": {
            "square_avg": {"square_avg": t},
            "centered": {"grad_avg": None, "avg": t},
            "momentum": {"buf": t},
        },
    }
    for family, state in cases.items():
        rec = bl.read_legacy_bytes(mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank1": state}}}))
        assert rec.item.families == (family,)
    # SGD without momentum: only `momentum: nil` — a state with no leaves
    rec = bl.read_legacy_bytes(mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank0": {"momentum": None}}}}))
    assert rec.item.families == ("sgd",) and rec.item.entries[0].fields == {}
    # burn <= 0.20 Adam had no max_moment_2 key at all
    old = {"momentum": {"time": 1, "moment_1": t, "moment_2": t}}
    assert bl.read_legacy_bytes(mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank1": old}}})).item.families == (
        "adam",
        "adamw",
    )


def test_unknown_layout_msgpack_is_read_generically():
    state = {"custom": {"step": 7, "buffers": [td(np.ones(2)), td(np.zeros(2))]}}
    rec = bl.read_legacy_bytes(mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank1": state}}}))
    assert rec.kind == "optimizer" and rec.item.families == ()
    fields = rec.item.entries[0].fields
    assert fields["custom.step"] == 7 and fields["custom.buffers.len"] == 2
    assert fields["custom.buffers.1"].shape == (2,)
    assert any("matches no known" in n for n in rec.notes)


def test_empty_optimizer_msgpack():
    rec = bl.read_legacy_bytes(mp_file({}))
    assert rec.kind == "optimizer" and rec.item.entries == [] and rec.item.families == ()


def test_schedulers_msgpack():
    def sched(item):
        rec = bl.read_legacy_bytes(mp_file(item))
        assert rec.kind == "scheduler"
        return rec.item

    assert sched(7).candidates == {"linear": 7, "cosine": 7, "noam": 7, "step": 7}
    assert sched(-1).candidates == {"step": -1}
    assert sched(0.0125).candidates == {"exponential": 0.0125}
    assert sched(None).candidates == {"constant": None}
    composed = sched(
        {"schedulers": [{"Linear": 5}, {"Exponential": 0.5}, {"Noam": 9}, {"Cosine": 2**64 - 1}]}
    )
    assert composed.candidates == {"composed": None}
    assert [c.candidates for c in composed.children] == [
        {"linear": 5},
        {"exponential": 0.5},
        {"noam": 9},
        {"cosine": 2**64 - 1},
    ]


# ------------------------------------------------------------------------------------------------
# Hand-built bincode (using the writer's primitives)
# ------------------------------------------------------------------------------------------------


def bc_file(item: bytes, version: str = "0.21.0") -> bytes:
    return W.bc_record(full_meta("BinFileRecorder", version), item)


def bc_one(state: bytes, rank: int = 1) -> bytes:
    return W.bc_optimizer({9505838338724798577: (rank, state)})


def test_other_optimizers_bincode():
    t = W.bc_tensor(np.ones(2, np.float32), "F32")
    cases = {
        ("muon",): t,
        ("adan",): W.varint(300) + t * 4,
        ("rmsprop",): t + W.bc_option(None) + t + W.bc_option(t),
        ("adam", "adamw"): W.varint(2) + t + t + W.bc_option(t),
    }
    for families, state in cases.items():
        rec = bl.read_legacy_bytes(bc_file(bc_one(state)))
        assert rec.item.families == families, families
        assert rec.item.alternatives == []
    rec = bl.read_legacy_bytes(bc_file(bc_one(W.varint(300) + t * 4)))
    assert rec.item.entries[0].fields["momentum.time"] == 300


def test_bincode_adam_before_amsgrad():
    t = W.bc_tensor(np.arange(6, dtype=np.float32).reshape(2, 3), "F32")
    rec = bl.read_legacy_bytes(bc_file(bc_one(W.varint(9) + t + t, rank=2), version="0.20.1"))
    assert rec.item.families == ("adam", "adamw")
    assert set(rec.item.entries[0].fields) == {"momentum.time", "momentum.moment_1", "momentum.moment_2"}


def test_bincode_dtype_index_follows_version():
    # burn 0.16 had no Flex32, so F16 was variant 2 (and F32 still 1)
    arr = np.array([1.5, -2.0], dtype="<f2")
    tensor = W.varint(4) + arr.tobytes() + W.varint(1) + W.varint(2) + W.varint(2)
    rec = bl.read_legacy_bytes(bc_file(bc_one(W.bc_option(tensor)), version="0.16.1"))
    ref = rec.item.entries[0].fields["momentum.velocity"]
    assert ref.dtype == "F16"
    np.testing.assert_array_equal(ref.numpy(), arr)
    with pytest.raises(FormatError, match="predate"):
        bl.read_legacy_bytes(bc_file(b"\x00\x00", version="0.13.0"))


def test_schedulers_bincode():
    def sched(item: bytes) -> dict:
        rec = bl.read_legacy_bytes(bc_file(item))
        assert rec.kind == "scheduler"
        return rec.item

    assert sched(b"").candidates == {"constant": None}
    assert sched(W.varint(1000)).candidates == {"linear": 1000, "cosine": 1000, "noam": 1000, "step": 500}
    assert sched(W.varint(3)).candidates["step"] == -2  # zig-zag
    assert sched(W.varint(2**64 - 1)).candidates == dict.fromkeys(("linear", "cosine", "noam"), 2**64 - 1)
    assert sched(struct.pack("<d", 0.001)).candidates == {"exponential": 0.001}
    composed = sched(W.varint(2) + W.varint(0) + W.varint(5) + W.varint(2) + struct.pack("<d", 0.25))
    assert [c.candidates for c in composed.children] == [{"linear": 5}, {"exponential": 0.25}]
    # a lone 00 is both an optimizer that never stepped and a scheduler state of 0
    rec = bl.read_legacy_bytes(bc_file(b"\x00"))
    assert rec.kind == "optimizer" and rec.item.entries == [] and rec.notes


def test_bincode_model_is_refused_clearly():
    param = W.bc_str(W.id_to_str(1)) + W.bc_tensor(np.ones((2, 2), np.float32), "F32")
    item = (
        param + W.bc_option(W.bc_str(W.id_to_str(2)) + W.bc_tensor(np.ones(2, np.float32), "F32")) + b"\x00"
    )
    with pytest.raises(FormatError, match="bincode model record .*module paths cannot be recovered"):
        bl.read_legacy_bytes(bc_file(item))


@given(st.integers(0, 2**64 - 1))
@settings(max_examples=200)
def test_varint_round_trip(n):
    data = W.varint(n) + b"\xaa"
    r = BincodeReader(data)
    assert r.varint() == n and r.remaining == 1


def test_bincode_reader_limits():
    with pytest.raises(BincodeError):
        BincodeReader(b"\xfd" + struct.pack("<Q", 2**32) + b"abc").bytes()
    with pytest.raises(BincodeError):
        BincodeReader(b"\xff").varint()
    with pytest.raises(BincodeError):
        BincodeReader(b"\xfc" + struct.pack("<I", 2**32 - 1)).varint(limit=2**31)
    with pytest.raises(BincodeError):
        BincodeReader(b"\x02").tag()


# ------------------------------------------------------------------------------------------------
# Bad input: always a one-line FormatError, quickly
# ------------------------------------------------------------------------------------------------


def assert_format_error(data: bytes, match: str | None = None) -> FormatError:
    start = time.perf_counter()
    with pytest.raises(FormatError, match=match) as info:
        bl.read_legacy_bytes(data, path="x.mpk")
    assert time.perf_counter() - start < 1.0
    assert "\n" not in str(info.value) and str(info.value).startswith("x.mpk: ")
    return info.value


@pytest.mark.parametrize("name", ["adam_full.mpk", "adamw_amsgrad.mpk", "model-21.mpk", "adam_half.mpk.gz"])
def test_truncated_msgpack_and_gzip(name):
    data = (LEGACY / name).read_bytes()
    for cut in sorted({1, 2, 5, 10, 11, 50, 150, 200, *range(0, len(data) - 1, 37), len(data) - 1}):
        assert_format_error(data[:cut])


@pytest.mark.parametrize("name", ["adam_full.bin"])
def test_truncated_bincode(name):
    data = (LEGACY / name).read_bytes()
    meta_end = len(W.bc_record(W.metadata("BinFileRecorder", "Full"), b""))
    for cut in range(1, len(data) - 1, 7):
        if cut in (meta_end, meta_end + 1):
            # bincode has no framing: metadata alone is a constant-scheduler record and metadata plus
            # the map length a scheduler state — valid files, read as such
            assert bl.read_legacy_bytes(data[:cut]).kind == "scheduler"
            continue
        assert_format_error(data[:cut])
    assert_format_error(data[: len(data) - 1])
    assert_format_error(data + b"\x00", match="no known optimizer layout")


def test_truncated_bincode_gz():
    data = (LEGACY / "sgd_momentum_half.bin.gz").read_bytes()
    for cut in range(0, len(data) - 1, 13):
        assert_format_error(data[:cut])


def test_garbage():
    rng = np.random.default_rng(1)
    assert_format_error(b"", match="not a burn legacy record")
    assert_format_error(rng.bytes(1000), match="not a burn legacy record")
    assert_format_error(gzip.compress(rng.bytes(1000)), match="not a burn legacy record")
    assert_format_error(gzip.compress(b""), match="not a burn legacy record")
    assert_format_error(b"\x1f\x8b" + rng.bytes(200), match="corrupt gzip")
    assert_format_error((LEGACY / "adam_full.mpk").read_bytes()[:20] + rng.bytes(100))
    assert_format_error(
        (ROOT / "fixtures" / "burn" / "mnist-model.bpk").read_bytes()[:4096], match="burnpack"
    )
    assert_format_error(b'{"metadata": {}}', match="JSON")


def test_huge_claimed_lengths():
    # a bin32 claiming 4 GB inside an otherwise valid record
    head = mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank1": {"momentum": {"velocity": td(np.ones(2))}}}}})
    i = head.index(b"\xc4\x08")  # bin8 of the 8 tensor bytes
    assert_format_error(head[:i] + b"\xc6\xff\xff\xff\xff" + head[i + 2 :], match="corrupt named msgpack")
    # an array32 claiming 4 G elements for the shape
    j = head.index(b"\xa5shape\x91") + 6
    assert_format_error(head[:j] + b"\xdd\xff\xff\xff\xff" + head[j + 1 :])
    # bincode: a u64 varint byte length of 2^62, and a u64 map length
    t = W.bc_tensor(np.ones(2, np.float32), "F32")
    huge = b"\xfd" + struct.pack("<Q", 2**62) + t[1:]
    assert_format_error(bc_file(bc_one(W.bc_option(huge))), match="no known optimizer layout")
    assert_format_error(bc_file(b"\xfd" + struct.pack("<Q", 2**63) + b"\x00" * 40))
    assert_format_error(W.bc_str("f32") + b"\xfd" + struct.pack("<Q", 2**40) + b"i32", match="metadata")


def test_structural_errors_msgpack():
    ok_state = {"momentum": {"velocity": td(np.ones(2))}}
    cases = [
        (
            {
                "e4gfnnsqgnlo6": {
                    "V1": {"Rank1": {"momentum": {"velocity": td(np.ones(2), "F32") | {"dtype": "F8"}}}}
                }
            },
            "unknown dtype",
        ),
        (
            {"e4gfnnsqgnlo6": {"V1": {"Rank1": {"momentum": {"velocity": td(np.ones(2)) | {"shape": [3]}}}}}},
            "needs 12 bytes",
        ),
        ({"e4gfnnsqgnlo6": {"V1": {"Rank2": ok_state}}}, "Rank2"),
        ({"e4gfnnsqgnlo6": {"V1": {"Rank9": ok_state}}}, "Rank0..Rank8"),
        ({"e4gfnnsqgnlo6": {"V2": {"Rank1": ok_state}}, "x": {"V1": {}}}, "V1"),
        ({"not!an!id": {"V1": {"Rank1": ok_state}}}, "not a ParamId"),
        ({"e4gfnnsqgnlo6": {"V1": {"Rank1": {"momentum": "fast"}}}}, "unsupported value"),
    ]
    for item, match in cases:
        assert_format_error(mp_file(item), match=match)
    assert_format_error(
        msgpack.packb({"metadata": full_meta(), "item": None}), match="not a burn legacy record"
    )
    assert_format_error(
        msgpack.packb({"metadata": full_meta(), "item": None, "_c": []}), match="not a BurnRecord"
    )
    assert_format_error(msgpack.packb({"metadata": full_meta(), "item": None, "_b": 3}), match="_b")
    assert_format_error(
        msgpack.packb({"metadata": {"float": "f32"}, "item": None, "_b": []}), match="metadata"
    )
    deep: object = td(np.ones(1))
    for _ in range(100):
        deep = {"a": deep}
    assert_format_error(mp_file({"e4gfnnsqgnlo6": {"V1": {"Rank1": deep}}}), match="deeper")
    assert_format_error(mp_file({"model": deep}), match="deeper")
    assert_format_error(mp_file({"fc": {"weight": {"id": "e4gfnnsqgnlo6", "param": 3}}}), match="fc.weight")
    assert_format_error(mp_file({"fc": {"weight": {"id": 7, "param": td(np.ones(1))}}}), match="not a string")


def test_structural_errors_bincode():
    t = W.bc_tensor(np.ones(2, np.float32), "F32")
    bad_dtype = t[:-1] + W.varint(40)
    assert_format_error(bc_file(bc_one(W.bc_option(bad_dtype))), match="no known optimizer layout")
    bad_size = W.varint(4) + t[1 + 8 - 4 :]  # claims 4 bytes for a [2] F32 tensor
    assert_format_error(bc_file(bc_one(W.bc_option(bad_size))))
    bad_rank = bc_one(W.bc_option(t), rank=3)
    assert_format_error(bc_file(bad_rank), match="rank")
    bad_key = W.varint(1) + W.bc_str("zz!zz") + W.varint(0) + W.varint(1) + W.bc_option(t)
    assert_format_error(bc_file(bad_key), match="not a ParamId")


def test_read_legacy_missing_and_empty(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        bl.read_legacy(tmp_path / "nope.mpk")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(FormatError, match="empty file"):
        bl.read_legacy(tmp_path / "empty.bin")
    (tmp_path / "bad.bin.gz").write_bytes(gzip.compress(b"\x03f32\x03i32")[:-6])
    with pytest.raises(FormatError, match="corrupt gzip"):
        bl.read_legacy(tmp_path / "bad.bin.gz")
