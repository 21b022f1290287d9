"""burn ≤ 0.21 records → the state model → burn 0.22 burnpack (issue #6).

Every legacy optimizer fixture converts to a burnpack record equal, field for field and byte for
byte, to the burnpack fixture of the same state (``fixtures/legacy-bpk/``, written from
``truth.npz`` by ``scripts/make_legacy_bpk_fixtures.py``, not from the legacy files).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from conftest import ROOT

from statekit import io, paramid
from statekit.errors import FormatError, MappingError
from statekit.formats.burnpack import BurnpackFile, Scalar, write_burnpack
from statekit.frameworks import burn, burn_legacy_io
from statekit.state import ModelInfo, ModelParam

LEGACY = ROOT / "fixtures" / "legacy"
EXPECTED = ROOT / "fixtures" / "legacy-bpk"
MODEL = LEGACY / "model-21.mpk"
TRUTH = dict(np.load(LEGACY / "truth.npz"))
PATHS = {int(i): str(p) for i, p in zip(TRUTH["ids"], TRUTH["paths"], strict=True)}

CASES = [
    ("adam_full.mpk", "adam_full.bpk", ("moment_1", "moment_2"), "F32"),
    ("adam_full.bin", "adam_full.bpk", ("moment_1", "moment_2"), "F32"),
    ("adam_half.mpk", "adam_half.bpk", ("moment_1", "moment_2"), "F16"),
    ("adam_half.mpk.gz", "adam_half.bpk", ("moment_1", "moment_2"), "F16"),
    ("adamw_amsgrad.mpk", "adamw_amsgrad.bpk", ("moment_1", "moment_2", "max_moment_2"), "F32"),
    ("sgd_momentum.mpk", "sgd_momentum.bpk", ("velocity",), "F32"),
    ("sgd_momentum_half.bin.gz", "sgd_momentum_half.bpk", ("velocity",), "F16"),
]


def convert(src: Path, dst: Path, model: object = MODEL) -> int:
    with burn_legacy_io.open_checkpoint(str(src), model=model) as ckpt:
        return write_burnpack(dst, *burn.to_pack(ckpt.optimizer))


def fields_of(pack: BurnpackFile) -> dict:
    """Every field of a burnpack file: tensors (dtype, shape, param_id, bytes), scalars, metadata."""
    tensors = {
        n: (e.burn_dtype, e.shape, e.param_id, bytes(pack.raw(n))) for n, e in pack.tensors.items()
    }
    scalars = {n: (s.kind, s.value) for n, s in pack.scalars.items()}
    return {"tensors": tensors, "scalars": scalars, "metadata": dict(pack.metadata), "order": pack.data_order}


@pytest.mark.parametrize(("src", "expected", "fields", "dtype"), CASES)
def test_converts_to_the_burnpack_of_the_same_state(tmp_path, src, expected, fields, dtype):
    out = tmp_path / expected
    size = convert(LEGACY / src, out)
    assert size == out.stat().st_size
    with BurnpackFile(out) as got, BurnpackFile(EXPECTED / expected) as want:
        assert fields_of(got) == fields_of(want)
        # ...and against the truth, field by field: decimal ids, __rank, time, paths, values
        for pid, path in PATHS.items():
            assert got.metadata[str(pid)] == path
            assert got.scalars[f"{pid}.__rank"] == Scalar("UInt", int(TRUTH[f"{pid}.__rank"]))
            if "moment_1" in fields:
                assert got.scalars[f"{pid}.momentum.time"] == Scalar("UInt", 21)
            else:
                assert f"{pid}.momentum.time" not in got.scalars
            for name in fields:
                entry = got.tensors[f"{pid}.momentum.{name}"]
                assert (entry.dtype, entry.param_id) == (dtype, pid)  # F16 stays F16
                want_values = TRUTH[f"{pid}.momentum.{name}"]
                values = got.tensor(f"{pid}.momentum.{name}").numpy()
                np.testing.assert_array_equal(values, want_values.astype(values.dtype))
        assert len(got.tensors) == 4 * len(fields)
    assert out.read_bytes() == (EXPECTED / expected).read_bytes()


@pytest.mark.parametrize(("src", "expected", "fields", "dtype"), CASES[:1])
def test_reopened_through_io_as_burnpack(tmp_path, src, expected, fields, dtype):
    out = tmp_path / "x.bpk"
    convert(LEGACY / src, out)
    with io.open_checkpoint(out) as a, io.open_checkpoint(LEGACY / src, model=str(MODEL)) as b:
        assert (a.format, b.format) == ("burnpack", "burn-legacy")
        pa, pb = a.optimizer, b.optimizer
        assert (pa.family, pa.candidates) == (pb.family, pb.candidates) == ("adam", ("adam", "adamw"))
        for x, y in zip(pa.params, pb.params, strict=True):
            assert (x.key, x.id, x.path, x.rank, x.step, x.family) == (y.key, y.id, y.path, y.rank, y.step, y.family)
            assert list(x.slots) == list(y.slots) == ["exp_avg", "exp_avg_sq"]
            for slot in x.slots:
                assert bytes(x.slots[slot].raw()) == bytes(y.slots[slot].raw())


def test_state_model_of_a_legacy_file():
    with io.open_checkpoint(LEGACY / "adamw_amsgrad.mpk") as ckpt:
        assert (ckpt.format, ckpt.kind, ckpt.version) == ("burn-legacy", "optimizer", "0.21.0")
        assert ckpt.metadata["settings"] == "FullPrecisionSettings"
        state = ckpt.optimizer
        assert state.framework == "burn" and state.family == "adam" and state.candidates == ("adam", "adamw")
        assert not state.hyperparams_stored
        p = state.find("6j5mg0dcb1hvu")
        assert (p.key, p.id, p.rank, p.step, p.path) == ("18402649998147242804", 18402649998147242804, 2, 21, None)
        assert list(p.slots) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        assert (ckpt.n_tensors, ckpt.n_scalars) == (12, 8)
        assert state.groups[0].keys == [p.key for p in state.params]


def test_bincode_sgd_keeps_the_adagrad_reading_as_a_note():
    with io.open_checkpoint(LEGACY / "sgd_momentum_half.bin.gz") as ckpt:
        state = ckpt.optimizer
        assert state.family == "sgd" and state.candidates == ("sgd",)  # bincode's Option tag rules Muon out
        assert any("adagrad" in n for n in state.notes)
        assert all(p.step is None and p.slots["momentum_buffer"].dtype == "F16" for p in state.params)
    with io.open_checkpoint(LEGACY / "sgd_momentum.mpk") as ckpt:
        assert ckpt.optimizer.candidates == ("sgd", "muon")  # as in burnpack


def test_model_given_as_burnpack_or_model_info(tmp_path):
    for model in (EXPECTED / "model-21.bpk", io.open_checkpoint(MODEL).model):
        out = tmp_path / "a.bpk"
        convert(LEGACY / "adam_full.bin", out, model=model)
        assert out.read_bytes() == (EXPECTED / "adam_full.bpk").read_bytes()


def test_without_model_no_paths(tmp_path):
    out = tmp_path / "a.bpk"
    convert(LEGACY / "adam_full.mpk", out, model=None)
    with BurnpackFile(out) as got, BurnpackFile(EXPECTED / "adam_full.bpk") as want:
        a, b = fields_of(got), fields_of(want)
        assert a["metadata"] == {} and a["tensors"] == b["tensors"] and a["scalars"] == b["scalars"]


def test_partial_model_and_bad_model(tmp_path):
    model = io.open_checkpoint(MODEL).model
    partial = ModelInfo([p for p in model.params if p.path != "l2.bias"]
                        + [ModelParam("extra.weight", (2, 2), "F32", id=7), ModelParam("extra.bias", (2,), "F32", id=8)])
    with burn_legacy_io.open_checkpoint(str(LEGACY / "adam_full.mpk"), model=partial) as ckpt:
        notes = ckpt.optimizer.notes
        assert any("1 parameters are not in the model record: 2021826497617271949" in n for n in notes)
        assert any("2 model parameters have no optimizer state" in n for n in notes)
        assert ckpt.optimizer.find("l1.weight").id == 18402649998147242804
    transposed = ModelInfo([ModelParam(p.path, tuple(reversed(p.shape)), p.dtype, id=p.id) for p in model.params])
    with burn_legacy_io.open_checkpoint(str(LEGACY / "adam_full.mpk"), model=transposed) as ckpt:
        assert any("column layout" in n for n in ckpt.optimizer.notes)
    with pytest.raises(MappingError, match="model record is needed"):
        burn_legacy_io.open_checkpoint(str(LEGACY / "adam_full.mpk"), model=str(LEGACY / "adam_full.bin"))
    with pytest.raises(MappingError, match="no ParamIds"):
        burn_legacy_io.open_checkpoint(str(LEGACY / "adam_full.mpk"), model=ModelInfo([ModelParam("a", (1,), "F32")]))
    with pytest.raises(MappingError, match="only applies to optimizer"):
        burn_legacy_io.open_checkpoint(str(MODEL), model=str(MODEL))


def test_model_record_to_burnpack(tmp_path):
    with io.open_checkpoint(MODEL) as ckpt:
        assert (ckpt.kind, ckpt.n_tensors, ckpt.nbytes) == ("model", 4, 388)
        assert [(p.path, p.id, p.shape, p.dtype) for p in ckpt.model.params] == [
            (path, pid, TRUTH[f"model.{path}"].shape, "F32") for pid, path in PATHS.items()
        ]
        out = tmp_path / "model-21.bpk"
        size = burn.save_model(ckpt.model, str(out))
        assert size == out.stat().st_size
        assert out.read_bytes() == (EXPECTED / "model-21.bpk").read_bytes()
        half = tmp_path / "half.bpk"
        burn.save_model(ckpt.model, str(half), dtype="F16")
    with io.open_checkpoint(out) as bpk:
        assert bpk.kind == "model"
        assert [(p.path, p.id) for p in bpk.model.params] == [(p, i) for i, p in PATHS.items()]
    with BurnpackFile(half) as pack:
        w = pack.tensor("l1.weight")
        assert w.dtype == "F16" and pack.tensors["l1.weight"].param_id == 18402649998147242804
        np.testing.assert_array_equal(w.numpy(), TRUTH["model.l1.weight"].astype(np.float16))
    with pytest.raises(MappingError, match="not a float"):
        burn.save_model(ckpt.model, str(half), dtype="I32")
    with pytest.raises(MappingError, match="no burn ParamId"):
        burn.save_model(ModelInfo([ModelParam("a", (1,), "F32", tensor=w)]), str(half))


def test_half_to_full_cast_is_exact():
    with io.open_checkpoint(LEGACY / "adam_half.mpk") as ckpt:
        ref = ckpt.optimizer.params[0].slots["exp_avg"]
        wide = ref.cast("F32")
        assert (wide.dtype, wide.shape) == ("F32", ref.shape)
        np.testing.assert_array_equal(wide.numpy(), ref.numpy().astype(np.float32))
        assert len(bytes(wide.raw())) == 2 * ref.nbytes


def record(item: object) -> bytes:
    meta = {"float": "f32", "int": "i32", "format": "burn_core::record::file::NamedMpkFileRecorder<"
            "burn_core::record::settings::FullPrecisionSettings>", "version": "0.20.1",
            "settings": "FullPrecisionSettings"}
    return msgpack.packb({"metadata": meta, "item": item, "_b": []}, use_bin_type=True)


def td(arr: np.ndarray) -> dict:
    arr = np.asarray(arr, dtype="<f4")
    return {"bytes": arr.tobytes(), "shape": list(arr.shape), "dtype": "F32"}


def test_other_layouts_and_unknown_fields(tmp_path):
    pid = 9505838338724798577
    key = paramid.to_display(pid)
    cases = {
        "adagrad": {"lr_decay": {"time": 4, "sum": td(np.ones(2))}},
        "rmsprop": {"square_avg": {"square_avg": td(np.ones(2))}, "centered": {"grad_avg": None, "avg": td(np.ones(2))},
                    "momentum": None},
        "sgd": {"momentum": None},
        None: {"mystery": {"count": 3, "buf": td(np.ones(2))}},
    }
    for family, state in cases.items():
        path = tmp_path / "o.mpk"
        path.write_bytes(record({key: {"V1": {"Rank1": state}}}))
        with io.open_checkpoint(path) as ckpt:
            st = ckpt.optimizer
            assert st.family == family and ckpt.version == "0.20.1"
            (p,) = st.params
            assert (p.key, p.id, p.rank) == (str(pid), pid, 1)
            out = tmp_path / "o.bpk"
            write_burnpack(out, *burn.to_pack(st))
        with io.open_checkpoint(out) as back:
            q = back.optimizer.params[0]
            assert (back.optimizer.family, q.step, q.rank, list(q.slots)) == (family, p.step, 1, list(p.slots))
            if family is None:
                assert q.extra["mystery.count"] == Scalar("UInt", 3)
                np.testing.assert_array_equal(q.extra["mystery.buf"].numpy(), np.ones(2, np.float32))
    assert any("unrecognised state layout" in n for n in st.notes)


def test_uuid_ids_need_a_model(tmp_path):
    path = tmp_path / "u.mpk"
    path.write_bytes(record({"3b241101-e2bb-4255-8caf-4136c566a962": {"V1": {"Rank1": {"momentum": {"velocity": td([1.0])}}}}}))
    with io.open_checkpoint(path) as ckpt:
        (p,) = ckpt.optimizer.params
        assert p.id is None and p.key == "3b241101-e2bb-4255-8caf-4136c566a962"
        assert any("UUID" in n for n in ckpt.optimizer.notes)
        with pytest.raises(MappingError, match="no burn ParamId"):
            burn.to_pack(ckpt.optimizer)


def test_schedulers_and_unknown_items(tmp_path):
    path = tmp_path / "s.mpk"
    path.write_bytes(record(7))
    with io.open_checkpoint(path) as ckpt:
        assert ckpt.kind == "scheduler" and ckpt.scalars == {"linear": 7, "cosine": 7, "noam": 7, "step": 7}
        assert any("does not say which" in w for w in ckpt.warnings)
    path.write_bytes(record({"schedulers": [{"Linear": 5}, {"Exponential": 0.5}]}))
    with io.open_checkpoint(path) as ckpt:
        assert ckpt.scalars == {"schedulers.0.linear": 5, "schedulers.1.exponential": 0.5}
    path.write_bytes(record("hello"))
    with io.open_checkpoint(path) as ckpt:
        assert ckpt.kind == "tensors" and ckpt.warnings


def test_sniffer_claims_every_legacy_spelling(tmp_path):
    for name in ("adam_full.mpk", "adam_full.bin", "adam_half.mpk.gz", "sgd_momentum_half.bin.gz", "model-21.mpk"):
        assert io.sniff(LEGACY / name) == "burn-legacy"
    plain = tmp_path / "sgd_momentum_half.bin"  # half-precision bincode starts "half::binary16::f16"
    plain.write_bytes(gzip.decompress((LEGACY / "sgd_momentum_half.bin.gz").read_bytes()))
    assert plain.read_bytes()[:20] == b"\x13half::binary16::f16"
    assert io.sniff(plain) == "burn-legacy"
    with io.open_checkpoint(plain) as ckpt:
        assert ckpt.optimizer.family == "sgd"


def test_bad_legacy_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.mpk"
    bad.write_bytes((LEGACY / "adam_full.mpk").read_bytes()[:300])
    with pytest.raises(FormatError):
        io.open_checkpoint(bad)
    r = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "bad.mpk" in r.stderr


def _comparable(d: dict) -> dict:
    d = dict(d)
    for key in ("path", "format", "version", "metadata", "notes", "file_bytes"):  # the container, not the state
        d.pop(key)
    d["params"] = [{k: v for k, v in p.items() if k != "path"} for p in d["params"]]
    return d


def test_cli_inspect_matches_burnpack(cli):
    r = cli("inspect", "fixtures/legacy/adam_full.mpk")
    assert r.returncode == 0, r.stderr
    assert "burn-legacy v0.21.0" in r.stdout and "optimizer (adam/adamw)" in r.stdout
    assert "8 tensors, 8 scalars" in r.stdout and "6j5mg0dcb1hvu" in r.stdout and "18402649998147242804" in r.stdout
    assert "store no hyperparameters" in r.stdout
    legacy = json.loads(cli("inspect", "fixtures/legacy/adam_full.mpk", "--json").stdout)
    bpk = json.loads(cli("inspect", "fixtures/legacy-bpk/adam_full.bpk", "--json").stdout)
    assert (legacy["format"], legacy["version"], legacy["kind"]) == ("burn-legacy", "0.21.0", "optimizer")
    assert _comparable(legacy) == _comparable(bpk)
    assert legacy["params"][0]["fields"]["momentum.moment_1"] == {"shape": [4, 16], "dtype": "F32", "slot": "exp_avg"}
    assert set(legacy["notes"]) == set(bpk["notes"])
    stats = json.loads(cli("inspect", "fixtures/legacy/adam_half.mpk.gz", "--stats", "--json").stdout)
    m1 = stats["params"][0]["fields"]["momentum.moment_1"]
    want = TRUTH["18402649998147242804.momentum.moment_1"].astype(np.float16).astype(np.float64)
    assert m1["dtype"] == "F16" and m1["stats"]["max"] == pytest.approx(float(want.max()))


def test_paramid_base32_as_burn_parses_it():
    """burn zero-extends any canonical base32 id of at most 8 bytes; users type 10 or 13 characters."""
    assert paramid.from_base32("04") == 1 and paramid.from_base32("6J5MG0DCB1HVU") == 18402649998147242804
    for bad in ("", "05", "6j5mg0dcb1hvu0", "0" * 16, "6j5mg0dcb1hv\n", "zz"):
        with pytest.raises(ValueError):
            paramid.from_base32(bad)
    with pytest.raises(ValueError):
        paramid.from_display("04")
