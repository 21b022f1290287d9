"""statekit doctor: every planted problem in fixtures/migration/ is found; the shipped fixtures are clean."""

import json

import pytest
from conftest import ROOT

from statekit.ops.doctor import doctor_files

FIX = ROOT / "fixtures"
MIG = FIX / "migration"
HAND, MODEL = FIX / "hand-optim.bpk", FIX / "hand-model.bpk"


def found(report: dict) -> set[tuple[str, str, str | None]]:
    return {(f["severity"], f["check"], f["param"]) for f in report["findings"]}


@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-optim-019.bpk", "hand-optim-bf16.bpk", "hand-optim-amsgrad.bpk",
                                  "hand-optim-sgd.bpk", "hand-optim-rmsprop.bpk", "hand-optim-adagrad.bpk"])
def test_shipped_states_are_clean(name):
    d = doctor_files(FIX / name, MODEL)
    assert d["clean"] and d["findings"] == [], d["findings"]
    assert d["matched_by"] == "id" and d["params"] == d["model_params"] == 4
    assert doctor_files(FIX / name)["clean"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("optim-nan.bpk", {("error", "nan", "l1.weight"), ("error", "nan", "l2.weight")}),
        ("optim-zero.bpk", {("warning", "zero-moments", "l1.bias")}),
        ("optim-steps.bpk", {("warning", "steps", None)}),
        ("optim-rank9.bpk", {("error", "rank", "deep.kernel"), ("warning", "orphan", "deep.kernel")}),
        # the model's id names the live state: the other is an orphan (burn #5130, test_burn_orphans.py)
        ("optim-dup-path.bpk", {("warning", "orphan-ids", "l1.bias"), ("warning", "orphan-ids", None)}),
        ("optim-bad-rank.bpk", {("error", "rank-mismatch", "l1.weight")}),
        ("optim-transposed.bpk", {("error", "transposed", "l1.weight")}),
    ],
)
def test_planted_state_problems(name, expected):
    d = doctor_files(MIG / name, MODEL)
    assert found(d) == expected
    assert not d["clean"]
    assert all(f["why"] and "\n" not in f["why"] for f in d["findings"])


def test_messages_carry_the_numbers():
    d = doctor_files(MIG / "optim-nan.bpk")
    messages = {f["param"]: f["message"] for f in d["findings"]}
    assert messages == {"l1.weight": "exp_avg: 2 NaN of 64", "l2.weight": "exp_avg_sq: 1 Inf of 16"}
    d = doctor_files(MIG / "optim-steps.bpk")
    assert d["findings"][0]["message"] == "steps differ: 21 (2 parameters); 5 (2 parameters: l2.weight, l2.bias)"
    assert d["steps"] == [5, 21]
    d = doctor_files(MIG / "optim-zero.bpk")
    assert d["findings"][0]["message"] == "exp_avg, exp_avg_sq all zero at step 21"
    d = doctor_files(MIG / "optim-rank9.bpk")
    assert "rank 9" in next(f["message"] for f in d["findings"] if f["check"] == "rank")
    d = doctor_files(MIG / "optim-transposed.bpk", MODEL)
    assert d["findings"][0]["message"] == "state 16×4, model l1.weight 4×16 (transposed)"


def test_renamed_model():
    d = doctor_files(HAND, MIG / "model-renamed.bpk")
    orphans = {f["param"]: f["message"] for f in d["findings"] if f["check"] == "orphan"}
    missing = {f["param"] for f in d["findings"] if f["check"] == "missing"}
    assert set(orphans) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
    assert missing == {"encoder.0.weight", "encoder.0.bias", "head.weight", "head.bias"}
    assert "encoder.0.weight" in orphans["l1.weight"] and "renamed?" in orphans["l1.weight"]
    assert all(f["severity"] == "warning" for f in d["findings"])


def test_new_head_and_grown_model():
    d = doctor_files(HAND, MIG / "model-new-head.bpk")
    assert found(d) == {("warning", "missing", "aux_head.weight"), ("warning", "missing", "aux_head.bias")}
    d = doctor_files(HAND, MIG / "model-grown.bpk")
    assert found(d) == {("error", "shape", "l1.weight")}
    assert d["findings"][0]["message"] == "state 4×16, model l1.weight 6×16"


def test_buffers_need_no_state():
    d = doctor_files(HAND, FIX / "burn/mnist-model.bpk")
    missing = {f["param"] for f in d["findings"] if f["check"] == "missing"}
    assert "conv1.norm.gamma" in missing and not any("running" in m for m in missing)
    assert len(missing) == 14  # 18 tensors, 4 of them batch-norm statistics


def test_empty_state():
    assert doctor_files(FIX / "empty-optim.bpk")["clean"]
    d = doctor_files(FIX / "empty-optim.bpk", MODEL)
    assert d["matched_by"] == "id" and {f["check"] for f in d["findings"]} == {"missing"}


# ----------------------------------------------------------------------------- CLI (fresh processes)


def test_cli_doctor(cli):
    r = cli("doctor", HAND, "--model", MODEL)
    assert r.returncode == 0, r.stderr
    assert "no problems found in 4 parameters against" in r.stdout and "matched by burn ParamId" in r.stdout
    r = cli("doctor", MIG / "optim-nan.bpk")
    assert r.returncode == 1 and r.stderr == ""
    assert "exp_avg: 2 NaN of 64" in r.stdout and "why it matters at resume" in r.stdout
    assert "2 problems (2 errors)" in r.stdout
    r = cli("doctor", MIG / "optim-transposed.bpk", "--model", MODEL, "--json")
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["counts"] == {"error": 1, "warning": 0, "info": 0} and d["findings"][0]["check"] == "transposed"
    for args in [(MODEL,), (HAND, "--model", HAND), ("missing.bpk",), (FIX / "malformed/bad-magic.bpk",)]:
        r = cli("doctor", *args)
        assert r.returncode == 2, args
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.torch
def test_torch_state_against_torch_model(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("statekit.frameworks.torch_io")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    d = doctor_files(tmp_path / "opt.pt", tmp_path / "model.pt")
    # positions are named from the model's named_parameters() order and shapes, then paired by path
    assert d["clean"] and d["matched_by"] == "path" and d["params"] == d["model_params"] == 4
    assert any("parameter names from" in n for n in d["notes"])
