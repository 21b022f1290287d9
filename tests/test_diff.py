"""statekit diff: matching, per-field max |Δ| / relative / ULP, NaN-awareness, exit codes 0 / 1 / 2."""

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT
from hypothesis import given
from hypothesis import strategies as st

from statekit import io
from statekit.frameworks import burn
from statekit.ops import ulp
from statekit.ops.diff import compare_refs, diff, diff_files, match_method
from statekit.state import Checkpoint, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

FIX = ROOT / "fixtures"
MIG = FIX / "migration"
HAND = FIX / "hand-optim.bpk"


def bumped_copy(src: Path, dst: Path, path: str, slot: str, index: tuple, dtype: str) -> tuple[float, float]:
    """Write ``src`` again with one element of ``path``.``slot`` moved one ULP up; (old, new) values."""
    with io.open_checkpoint(src) as ckpt:
        state = ckpt.optimizer
        for p in state.params:
            p.slots = {s: TensorRef.from_array(np.array(r.numpy()), dtype) for s, r in p.slots.items()}
        p = state.find(path)
        arr = p.slots[slot].numpy()
        old = arr[index]
        new = np.nextafter(old.astype(np.float32), np.float32(np.inf)) if dtype == "F32" else None
        if dtype == "BF16":  # next bf16 value: one more in the bit pattern of a positive number
            new = np.array([old], ml_dtypes.bfloat16).view(np.uint16) + np.uint16(1)
            new = new.view(ml_dtypes.bfloat16)[0]
        arr[index] = new
        burn.save_optimizer(state, str(dst), metadata={})
    return float(old), float(new)


def field(result: dict, path: str, slot: str) -> dict:
    p = next(p for p in result["params"] if p["a"]["path"] == path)
    return next(f for f in p["fields"] if f["name"] == slot)


# ----------------------------------------------------------------------------- ULPs


def test_ulp_distance_basics():
    for dt in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
        fi = ml_dtypes.finfo(dt)
        a = np.array([1.0, -1.0, 0.0, -0.0, 0.0, float(fi.max), 2.0], dt)
        b = np.array([1.0 + float(fi.eps), -1.0 - float(fi.eps), -0.0, float(fi.smallest_subnormal),
                      -float(fi.smallest_subnormal), np.inf, 2.0], dt)
        assert ulp.distance(a, b).tolist() == [1, 1, 0, 1, 1, 1, 0], dt
    # across zero: every value in between counts
    x = np.array([-float(ml_dtypes.finfo(np.float16).smallest_subnormal) * 3], np.float16)
    y = np.array([float(ml_dtypes.finfo(np.float16).smallest_subnormal) * 2], np.float16)
    assert ulp.distance(x, y).tolist() == [5]
    # F64: exact even when the distance exceeds 2**53
    big = ulp.distance(np.array([-1e300]), np.array([1e300]))
    assert int(big[0]) == 2 * int(np.array([1e300]).view(np.int64)[0])


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_ulp_next_float32_is_one(x):
    a = np.array([x], np.float32)
    with np.errstate(over="ignore"):  # the next float32 after the largest finite one is inf
        b = np.nextafter(a, np.float32(np.inf))
    assert ulp.distance(a, b)[0] == (0 if a[0] == b[0] else 1)
    assert ulp.distance(b, a)[0] == ulp.distance(a, b)[0]


@given(st.lists(st.floats(width=16, allow_nan=False), min_size=2, max_size=20))
def test_ordinals_are_monotonic_f16(values):
    arr = np.array(sorted(values), np.float16)
    assert np.all(np.diff(ulp.ordinals(arr)) >= 0)


# ----------------------------------------------------------------------------- values


def test_compare_refs_blocks_agree():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(37, 11)).astype(np.float32)
    b = a.copy()
    b[5, 3] = np.nextafter(b[5, 3], np.float32(np.inf))
    b[30, 10] += 0.5
    b[0, 0] = np.nan
    ra, rb = TensorRef.from_array(a), TensorRef.from_array(b)
    whole, blocked = compare_refs(ra, rb), compare_refs(ra, rb, block=7)
    assert whole == blocked
    assert whole["differing"] == 3 and whole["nan_mismatch"] == 1
    assert whole["worst"]["index"] == [30, 10]
    assert whole["max_abs"] == pytest.approx(0.5, rel=1e-6)


def test_nan_aware():
    a = np.array([np.nan, 1.0, np.inf, -0.0], np.float32)
    same = compare_refs(TensorRef.from_array(a), TensorRef.from_array(np.array([np.nan, 1.0, np.inf, 0.0], np.float32)))
    assert same["equal"] and same["differing"] == 0  # NaN = NaN at the same place; -0.0 = 0.0
    other = compare_refs(TensorRef.from_array(a), TensorRef.from_array(np.array([0.0, np.nan, 5.0, 0.0], np.float32)),
                         atol=1e9)
    assert not other["equal"] and other["nan_mismatch"] == 2 and other["differing"] == 3  # inf vs 5 too


def test_tolerances_symmetric():
    a = TensorRef.from_array(np.array([1.0, 100.0], np.float32))
    b = TensorRef.from_array(np.array([1.001, 100.1], np.float32))
    assert not compare_refs(a, b, rtol=1e-4)["equal"]
    assert compare_refs(a, b, rtol=1e-3)["equal"] and compare_refs(b, a, rtol=1e-3)["equal"]
    assert compare_refs(a, b, atol=0.2)["equal"]


# ----------------------------------------------------------------------------- files


def test_self_is_equal():
    for name in ("hand-optim.bpk", "hand-optim-bf16.bpk", "hand-optim-amsgrad.bpk", "hand-model.bpk",
                 "hand-scheduler.bpk", "empty-optim.bpk"):
        d = diff_files(FIX / name, FIX / name)
        assert d["equal"], name
    d = diff_files(HAND, HAND)
    assert d["matched_by"] == "id" and d["summary"]["fields_compared"] == 8 and d["summary"]["max_abs"] == 0


def test_one_ulp_f32(tmp_path):
    dst = tmp_path / "ulp.bpk"
    old, new = bumped_copy(HAND, dst, "l1.weight", "exp_avg_sq", (1, 2), "F32")
    d = diff_files(HAND, dst)
    f = field(d, "l1.weight", "exp_avg_sq")
    assert not d["equal"] and f["max_ulp"] == 1 and f["differing"] == 1
    assert f["max_abs"] == float(np.spacing(np.float32(old))) == new - old
    assert f["worst"]["index"] == [1, 2] and f["worst"]["a"] == old and f["worst"]["b"] == new
    assert d["summary"]["fields_differing"] == 1 and d["summary"]["params_differing"] == 1
    assert diff_files(HAND, dst, atol=float(np.spacing(np.float32(old))))["equal"]
    assert not diff_files(HAND, dst, atol=float(np.spacing(np.float32(old))) / 2)["equal"]
    assert diff_files(HAND, dst, rtol=1e-6)["equal"]


def test_one_ulp_bf16(tmp_path):
    src, dst = FIX / "hand-optim-bf16.bpk", tmp_path / "ulp16.bpk"
    old, new = bumped_copy(src, dst, "l2.weight", "exp_avg_sq", (3, 0), "BF16")
    f = field(diff_files(src, dst), "l2.weight", "exp_avg_sq")
    assert f["max_ulp"] == 1 and f["ulp_dtype"] == "BF16"
    assert f["max_abs"] == new - old == float(2.0 ** (np.floor(np.log2(old)) - 7))  # bf16: 7 mantissa bits


def test_shipped_one_ulp_fixture():
    d = diff_files(HAND, MIG / "optim-one-ulp.bpk")
    f = field(d, "l1.weight", "exp_avg_sq")
    assert f["max_ulp"] == 1 and f["worst"]["index"] == [0, 0]


def test_structural_differences():
    d = diff_files(HAND, MIG / "optim-steps.bpk")
    steps = {p["label"]: p["differences"] for p in d["params"] if not p["equal"]}
    assert steps == {"l2.weight": [{"what": "step", "a": 21, "b": 5}], "l2.bias": [{"what": "step", "a": 21, "b": 5}]}
    d = diff_files(HAND, MIG / "optim-transposed.bpk")
    l1 = next(p for p in d["params"] if p["label"] == "l1.weight")
    assert {"what": "shape", "a": [4, 16], "b": [16, 4]} in l1["differences"]
    d = diff_files(HAND, MIG / "optim-rank9.bpk")
    assert [p["path"] for p in d["only_in_b"]] == ["deep.kernel"] and not d["only_in_a"]
    d = diff_files(HAND, FIX / "hand-optim-bf16.bpk")
    assert all({"what": "dtype", "a": "F32", "b": "BF16"} in p["differences"] for p in d["params"])
    f = field(d, "l1.weight", "exp_avg")
    assert f["ulp_dtype"] == "BF16" and f["max_ulp"] == 0  # the bf16 file is the f32 state rounded
    d = diff_files(HAND, MIG / "optim-nan.bpk")
    assert field(d, "l1.weight", "exp_avg")["nan_mismatch"] == 2
    assert field(d, "l2.weight", "exp_avg_sq")["max_abs"] == float("inf")


def test_family_difference():
    d = diff_files(HAND, FIX / "hand-optim-sgd.bpk")
    assert not d["equal"] and d["differences"][0]["what"] == "family"


def _ckpt(params, hyper=None):
    state = OptimizerState(family="adam", candidates=("adam",), params=params, framework="torch",
                           groups=[ParamGroup(hyper or {}, [p.key for p in params])], hyperparams_stored=hyper is not None)
    return Checkpoint(path="mem", format="test", kind="optimizer", optimizer=state)


def _p(key, path=None, index=None, value=1.0, step=3):
    return ParamState(key=key, path=path, index=index, step=step,
                      slots={"exp_avg": TensorRef.from_array(np.full((2,), value, np.float32))})


def test_matching_by_path_and_index_and_hyperparameters():
    a = _ckpt([_p("0", "x.w", 0), _p("1", "x.b", 1)], {"lr": 1e-3, "betas": (0.9, 0.999)})
    b = _ckpt([_p("0", "x.b", 0), _p("1", "x.w", 1, value=2.0)], {"lr": 1e-3, "betas": (0.9, 0.99)})
    d = diff(a, b)
    assert d["matched_by"] == "path"
    assert [p["label"] for p in d["params"] if not p["equal"]] == ["x.w"]
    assert d["hyperparameters"] == [{"group": 0, "name": "betas", "a": (0.9, 0.999), "b": (0.9, 0.99)}]
    a2 = _ckpt([_p("0", None, 0), _p("1", None, 1)])
    b2 = _ckpt([_p("1", None, 1), _p("0", None, 0)])
    assert match_method(a2.optimizer.params, b2.optimizer.params) == "index"
    d = diff(a2, b2)
    assert d["equal"] and d["notes"] == []
    d = diff(a, dataclasses.replace(b, optimizer=dataclasses.replace(b.optimizer, hyperparams_stored=False)))
    assert d["notes"] == ["only A stores hyperparameters; they were not compared"]


# ----------------------------------------------------------------------------- CLI (fresh processes)


def test_cli_exit_codes(cli, tmp_path):
    r = cli("diff", HAND, HAND)
    assert r.returncode == 0, r.stderr
    assert "equal: 4 parameters, 8 fields (matched by burn ParamId)" in r.stdout
    r = cli("diff", HAND, MIG / "optim-one-ulp.bpk")
    assert r.returncode == 1 and r.stderr == ""
    assert "exp_avg_sq" in r.stdout and "1/64" in r.stdout and "max 1 ulp" in r.stdout
    assert cli("diff", HAND, MIG / "optim-one-ulp.bpk", "--atol", "1e-9").returncode == 0
    for args in [(HAND, tmp_path / "missing.bpk"), (HAND, FIX / "malformed/truncated.bpk"), (HAND, FIX / "hand-model.bpk"),
                 (HAND, HAND, "--atol", "-1")]:
        r = cli("diff", *args)
        assert r.returncode == 2, args
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("statekit: error: ")
    assert cli("diff", HAND).returncode == 2  # usage


def test_cli_json(cli):
    r = cli("diff", HAND, MIG / "optim-steps.bpk", "--json")
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["equal"] is False and d["matched_by"] == "id" and d["summary"]["params_differing"] == 2
    assert d["a"]["path"].endswith("hand-optim.bpk") and d["b"]["format"] == "burnpack"


# ----------------------------------------------------------------------------- PyTorch files


def _torch_files(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("statekit.frameworks.torch_io")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(opt.state_dict(), a)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 1e-2
    sd["state"][2]["step"] = torch.tensor(5.0)
    torch.save(sd, b)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    return a, b


@pytest.mark.torch
def test_torch_states_match_by_index(tmp_path, cli):
    a, b = _torch_files(tmp_path)
    d = diff_files(a, a)
    assert d["equal"] and d["matched_by"] == "index" and d["summary"]["fields_compared"] == 8
    d = diff_files(a, b)
    assert not d["equal"]
    assert d["hyperparameters"] == [{"group": 0, "name": "lr", "a": 1e-3, "b": 1e-2}]
    assert [(p["label"], p["differences"]) for p in d["params"] if not p["equal"]] == [
        ("#2", [{"what": "step", "a": 3, "b": 5}])]
    assert cli("diff", a, b).returncode == 1
    d = diff_files(a, HAND)  # nothing in common: says so instead of guessing by position
    assert d["summary"]["params_compared"] == 0 and "no way to match" in d["notes"][0]


def test_path_difference_when_matched_by_id():
    def state(path):
        p = ParamState(key="7", id=7, path=path, step=1, slots={"exp_avg": TensorRef.from_array(np.zeros(2, np.float32))})
        return Checkpoint(path="mem", format="test", kind="optimizer",
                          optimizer=OptimizerState(family="adam", params=[p], framework="burn"))

    d = diff(state("enc.w"), state("encoder.w"))
    assert d["matched_by"] == "id" and d["params"][0]["differences"] == [{"what": "path", "a": "enc.w", "b": "encoder.w"}]


def test_a_remapped_state_is_paired_by_path(tmp_path, cli):
    r = cli("remap", "fixtures/lm-optim.bpk", "--model", "fixtures/lm-model-v2.bpk", "-o", tmp_path / "v2.bpk",
            "--rename", r"^ff\.=blocks.0.ff.", "--resize")
    assert r.returncode == 0, r.stderr
    r = cli("diff", "fixtures/lm-optim.bpk", tmp_path / "v2.bpk", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 1 and d["matched_by"] == "path"
    assert {p["path"] for p in d["only_in_a"]} == {"ff.weight", "ff.bias"}


def _torch_state_with_tensor_lr(path: Path, lr: float) -> None:
    import torch

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([p], lr=torch.tensor(lr))  # torch takes a tensor lr (torchao stores one too)
    p.grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), path)


@pytest.mark.parametrize("fixture", ["thirdparty/torchao-adamw8bit.pt", "thirdparty/optimi-stableadamw.pt"])
def test_a_file_diffed_with_itself_is_equal_when_a_group_value_is_a_tensor(fixture, cli):
    f = ROOT / "fixtures" / fixture
    res = cli("diff", f, f)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TensorRef" not in res.stdout


def test_group_values_stored_as_tensors_are_compared_by_value(tmp_path, cli):
    pytest.importorskip("torch")
    a, a2, b = tmp_path / "a.pt", tmp_path / "a2.pt", tmp_path / "b.pt"
    _torch_state_with_tensor_lr(a, 0.01)
    _torch_state_with_tensor_lr(a2, 0.01)
    _torch_state_with_tensor_lr(b, 0.25)
    assert cli("diff", a, a2).returncode == 0
    res = cli("diff", a, b, "--json")
    assert res.returncode == 1
    hyper = json.loads(res.stdout)["hyperparameters"]
    assert [(h["name"], h["a"], h["b"]) for h in hyper] == [("lr", pytest.approx(0.01), 0.25)]
