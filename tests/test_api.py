"""The Python API a conversion script uses, end to end on the shipped fixtures."""

import hashlib

import numpy as np
import pytest
from conftest import ROOT

import statekit

HAND = ROOT / "fixtures/hand-optim.bpk"


def test_open_find_and_lazy_values():
    with statekit.open(HAND) as ckpt:
        p = ckpt.optimizer.find("6j5mg0dcb1hvu")
        assert (p.path, p.step, p.shape) == ("l1.weight", 21, (4, 16))
        truth = np.load(ROOT / "fixtures/hand-train-adam.npz")
        assert np.array_equal(p.slots["exp_avg"].numpy(), truth["l1.weight/moment_1"])


def test_inspect_selection():
    d = statekit.inspect(HAND, params=["l2.bias"], stats=True)
    assert [p["path"] for p in d["params"]] == ["l2.bias"]
    assert d["params"][0]["fields"]["momentum.moment_2"]["stats"]["min"] > 0


def test_convert_round_trip_and_diff(tmp_path):
    pytest.importorskip("torch")
    names = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    plan = statekit.convert(HAND, tmp_path / "h.pt", optimizer="adam", names=names, transpose=["*.weight"], lr=3e-4)
    assert plan.hyperparams[0]["lr"] == 3e-4 and "eps" in plan.assumed
    assert [a.transpose for a in plan.params] == [True, False, True, False]
    back = statekit.convert(tmp_path / "h.pt", tmp_path / "back.bpk", model=ROOT / "fixtures/hand-model.bpk",
                            transpose=["*.weight"])
    assert {a.dst_id for a in back.params} == {"18402649998147242804", "4872954564708272749",
                                               "708128169117982014", "2021826497617271949"}
    assert statekit.diff(HAND, tmp_path / "back.bpk")["equal"]
    assert statekit.verify_resume(HAND, tmp_path / "h.pt", lr=3e-4)["tracks"]


def test_exact_copy_returns_no_plan(tmp_path):
    assert statekit.convert(HAND, tmp_path / "copy.bpk") is None
    assert hashlib.sha256((tmp_path / "copy.bpk").read_bytes()).digest() == hashlib.sha256(HAND.read_bytes()).digest()


def test_remap_doctor_merge(tmp_path):
    fx = ROOT / "fixtures"
    plan = statekit.remap(fx / "lm-optim.bpk", tmp_path / "v2.bpk", model=fx / "lm-model-v2.bpk",
                          rename=[r"^ff\.=blocks.0.ff."], resize=True)
    assert [a.action for a in plan.params].count("new") == 1
    report = statekit.doctor(tmp_path / "v2.bpk", fx / "lm-model-v2.bpk")
    assert {f["check"] for f in report["findings"]} == {"missing"}
    with pytest.raises(statekit.errors.StatekitError):
        statekit.merge([HAND, HAND], tmp_path / "m.bpk")


def test_unknown_option_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="learning_rate"):
        statekit.convert(HAND, tmp_path / "x.pt", learning_rate=1)


def test_import_is_light():
    import subprocess
    import sys

    code = "import statekit, sys; print(any(m in sys.modules for m in ('torch', 'numpy', 'rich')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_replay_sgd_by_hand(tmp_path):
    """statekit.replay: plain SGD is p - lr·g per step, in float32 (hand-computed)."""
    from safetensors.numpy import load_file, save_file

    p = np.array([1.0, -2.0, 0.5], np.float32)
    g1, g2 = np.array([0.5, 0.25, -1.0], np.float32), np.array([1.0, 1.0, 1.0], np.float32)
    save_file({"w": p}, str(tmp_path / "p.safetensors"))
    save_file({"w": g1}, str(tmp_path / "g1.safetensors"))
    save_file({"w": g2}, str(tmp_path / "g2.safetensors"))
    result = statekit.replay(tmp_path / "p.safetensors", [tmp_path / "g1.safetensors", tmp_path / "g2.safetensors"],
                             tmp_path / "out.safetensors", optimizer="sgd", flavor="torch", lr=0.5)
    assert result["steps"] == 2 and result["step_counts"] == {"w": 2} and result["hyperparams"]["lr"] == 0.5
    assert load_file(str(tmp_path / "out.safetensors"))["w"].tolist() == [0.25, -2.625, 0.5]
    with pytest.raises(TypeError, match="unknown options: lrr"):
        statekit.replay(tmp_path / "p.safetensors", [], tmp_path / "o.safetensors", optimizer="sgd", lrr=1)
