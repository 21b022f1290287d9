"""burn #5130: a record grown over three relaunches (fixtures/burn-orphans/, scripts/make_burn_orphan_fixtures.py).

doctor names the orphaned ParamIds and their bytes; remap --model keeps the state under the model's
ids and writes the record burn with PR #5177 would have written, byte for byte; candidates it
cannot tell apart are refused.
"""

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
from conftest import ROOT

from statekit.formats import cbor
from statekit.formats.burnpack import BurnpackFile, PackTensor, Scalar, write_burnpack
from statekit.ops.doctor import doctor_files
from statekit.tensor import TensorRef

FIX = ROOT / "fixtures" / "burn-orphans"
GROWN, MODEL, NEW_IDS, LAST = (FIX / n for n in ("grown-optim.bpk", "model.bpk", "model-new-ids.bpk",
                                                  "last-launch-optim.bpk"))
PATHS = {"l1.weight": (4, 16), "l1.bias": (16,), "l2.weight": (16, 1), "l2.bias": (1,)}
# three orphaned AdamW states per path, two float32 moments each: 3 × 97 elements × 2 × 4 bytes
WASTED = 3 * sum(int(np.prod(s)) for s in PATHS.values()) * 2 * 4

_spec = importlib.util.spec_from_file_location("orphan_fixtures", ROOT / "scripts" / "make_burn_orphan_fixtures.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def model_ids(path) -> dict[str, int]:
    with BurnpackFile(path) as pack:
        return {n: e.param_id for n, e in pack.tensors.items()}


def found(report: dict) -> set:
    return {(f["severity"], f["check"], f["param"]) for f in report["findings"]}


def check_burn_022_layout(path: Path) -> dict:
    """The bytes of a burn 0.22 optimizer record, read without statekit's reader (burn-formats.md §1, §2.1)."""
    raw = path.read_bytes()
    assert raw[:4] == b"NRUB"
    version, size = struct.unpack("<HI", raw[4:10])
    assert version == 1
    meta = cbor.decode(raw[10:10 + size])
    assert list(meta) == ["tensors", "metadata", "scalars"]
    d = -(-(10 + size) // 256) * 256
    assert not any(raw[10 + size:d])  # zero padding up to the data section
    tensors = meta["tensors"]
    assert list(tensors) == sorted(tensors, key=lambda k: k.encode())  # bytewise sorted keys
    spans = sorted((desc["data_offsets"][0], desc["data_offsets"][1], name) for name, desc in tensors.items())
    at = 0
    for start, end, name in spans:
        desc = tensors[name]
        assert list(desc) == ["dtype", "shape", "data_offsets", "param_id"]
        assert desc["dtype"] == "F32" and end - start == 4 * int(np.prod(desc["shape"]))
        assert start == -(-at // 256) * 256 and not any(raw[d + at:d + start])  # tiled, zero gaps
        assert name.split(".", 1)[0] == str(desc["param_id"])  # "<id>.<field>" carries param_id = id
        at = end
    assert len(raw) == d + at  # nothing after the last tensor
    for key in meta["metadata"]:
        assert meta["scalars"][f"{key}.__rank"]["UInt"] == len(tensors[f"{key}.momentum.moment_1"]["shape"])
    return meta


def test_the_fixture_is_three_relaunches_of_one_model():
    meta = check_burn_022_layout(GROWN)
    paths = list(meta["metadata"].values())
    assert sorted(paths) == sorted(list(PATHS) * 4) and len(meta["tensors"]) == 32
    ids = model_ids(MODEL)
    for path, pid in ids.items():  # the model's ids are the last launch's, stepped LAUNCHES[-1] times
        assert meta["metadata"][str(pid)] == path
        assert meta["scalars"][f"{pid}.momentum.time"] == {"UInt": script.LAUNCHES[-1]}
    assert sorted(s["UInt"] for k, s in meta["scalars"].items() if k.endswith(".time")) == sorted(script.LAUNCHES * 4)
    assert not set(model_ids(NEW_IDS).values()) & {int(k) for k in meta["metadata"]}


def test_doctor_names_the_orphans_and_their_bytes():
    d = doctor_files(GROWN, MODEL)
    assert found(d) == {("warning", "orphan-ids", p) for p in PATHS} | {("warning", "orphan-ids", None)}
    ids = model_ids(MODEL)
    with BurnpackFile(GROWN) as pack:
        stale = {int(k) for k, v in pack.metadata.items() if ids[v] != int(k)}
    by_param = {f["param"]: f["message"] for f in d["findings"]}
    for path, (rows, *cols) in ((p, s) for p, s in PATHS.items()):
        message = by_param[path]
        assert f"{3 * rows * (cols[0] if cols else 1) * 8:,} bytes" in message
        assert f"the model's ParamId {ids[path]} step {script.LAUNCHES[-1]}" in message
    assert all(str(i) in " ".join(by_param.values()) for i in stale) and len(stale) == 12
    assert f"{WASTED:,} bytes" in by_param[None] and "statekit remap" in by_param[None]
    assert not d["clean"]


def test_doctor_without_the_model_says_the_duplicates_and_asks_for_it():
    d = doctor_files(GROWN)
    assert {(s, c, p) for s, c, p in found(d) if c == "duplicate-path"} == {("error", "duplicate-path", p) for p in PATHS}
    weight = next(f["message"] for f in d["findings"] if f["param"] == "l1.weight")
    assert f"{3 * 64 * 8:,} bytes beyond one state" in weight and "--model" in weight


def test_doctor_on_the_pruned_record_is_clean(tmp_path, cli):
    out = tmp_path / "optim.bpk"
    assert cli("remap", GROWN, "--model", MODEL, "-o", out).returncode == 0
    d = doctor_files(out, MODEL)
    assert d["clean"] and d["findings"] == []


def test_remap_keeps_the_model_ids_as_burn_would_have_written_them(tmp_path, cli):
    out = tmp_path / "optim.bpk"
    r = cli("remap", GROWN, "--model", MODEL, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "orphaned states dropped (12, " in r.stderr and f"{WASTED:,} bytes" in r.stderr
    assert sha(out) == sha(LAST)  # the script's record of the last launch alone, in the same order
    meta = check_burn_022_layout(out)
    ids = model_ids(MODEL)
    assert meta["metadata"] == {str(pid): path for path, pid in ids.items()}
    with BurnpackFile(GROWN) as src, BurnpackFile(out) as dst:
        for pid in ids.values():
            for field in ("momentum.moment_1", "momentum.moment_2"):
                name = f"{pid}.{field}"
                assert dst.tensors[name].param_id == pid
                assert bytes(dst.tensor(name).raw()) == bytes(src.tensor(name).raw())
            assert dst.scalars[f"{pid}.momentum.time"] == src.scalars[f"{pid}.momentum.time"]


def test_remap_refuses_when_no_state_is_the_models(tmp_path, cli):
    out = tmp_path / "optim.bpk"
    r = cli("remap", GROWN, "--model", NEW_IDS, "-o", out)
    assert r.returncode == 1 and not out.exists()
    line = r.stderr.strip()
    assert "\n" not in line and str(GROWN) in line
    for path, pid in model_ids(NEW_IDS).items():
        assert f"{path}: 4 different states" in line and f"none is the model's ParamId {pid}" in line
    assert "step counter does not tell the newest" in line


def test_remap_of_one_launch_onto_new_ids_moves_it_by_path(tmp_path, cli):
    out = tmp_path / "optim.bpk"
    r = cli("remap", LAST, "--model", NEW_IDS, "-o", out)
    assert r.returncode == 0, r.stderr
    meta = check_burn_022_layout(out)
    assert meta["metadata"] == {str(pid): path for path, pid in model_ids(NEW_IDS).items()}


def test_identical_candidates_are_one_state(tmp_path, cli):
    """The same state written twice under two ids (a copy, not a relaunch): kept once, under the model's id."""
    rng = np.random.default_rng(0)
    m1, m2 = rng.normal(size=(3,)).astype(np.float32), rng.random(3).astype(np.float32)
    tensors, scalars, meta = [], {}, {}
    for pid in (11, 22):
        tensors += [PackTensor(f"{pid}.momentum.moment_1", TensorRef.from_array(m1), param_id=pid),
                    PackTensor(f"{pid}.momentum.moment_2", TensorRef.from_array(m2), param_id=pid)]
        scalars |= {f"{pid}.__rank": Scalar("UInt", 1), f"{pid}.momentum.time": Scalar("UInt", 4)}
        meta[str(pid)] = "b"
    write_burnpack(tmp_path / "dup.bpk", tensors, meta, scalars)
    write_burnpack(tmp_path / "model.bpk", [PackTensor("b", TensorRef.from_array(np.zeros(3, np.float32)),
                                                       param_id=33)])
    r = cli("remap", tmp_path / "dup.bpk", "--model", tmp_path / "model.bpk", "-o", tmp_path / "out.bpk", "--json")
    assert r.returncode == 0, r.stderr
    meta = check_burn_022_layout(tmp_path / "out.bpk")
    assert meta["metadata"] == {"33": "b"} and meta["scalars"]["33.momentum.time"] == {"UInt": 4}
    with BurnpackFile(tmp_path / "out.bpk") as pack:
        assert np.array_equal(pack.tensor("33.momentum.moment_1").numpy(), m1)
    assert any("orphaned states dropped (1," in w for w in json.loads(r.stdout)["warnings"])
    # one byte different: two states, neither the model's: refused
    other = m1.copy()
    other[0] = np.nextafter(other[0], np.float32(1))
    tensors[2] = PackTensor("22.momentum.moment_1", TensorRef.from_array(other), param_id=22)
    write_burnpack(tmp_path / "dup2.bpk", tensors, {"11": "b", "22": "b"}, scalars)
    r = cli("remap", tmp_path / "dup2.bpk", "--model", tmp_path / "model.bpk", "-o", tmp_path / "out2.bpk")
    assert r.returncode == 1 and "b: 2 different states" in r.stderr and not (tmp_path / "out2.bpk").exists()
