"""convert across the remaining formats from the command line: burn ≤ 0.21 records, safetensors, candle."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

LEGACY, LEGACY_BPK = ROOT / "fixtures/legacy", ROOT / "fixtures/legacy-bpk"


def sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.mark.parametrize(("src", "expected"), [
    ("adam_full.mpk", "adam_full.bpk"), ("adam_full.bin", "adam_full.bpk"), ("adam_half.mpk", "adam_half.bpk"),
    ("adam_half.mpk.gz", "adam_half.bpk"), ("adamw_amsgrad.mpk", "adamw_amsgrad.bpk"),
    ("sgd_momentum.mpk", "sgd_momentum.bpk"), ("sgd_momentum_half.bin.gz", "sgd_momentum_half.bpk"),
])
def test_legacy_optimizer_to_burnpack(tmp_path, cli, src, expected):
    # the expected files are built from truth.npz alone (scripts/make_legacy_bpk_fixtures.py)
    r = cli("convert", LEGACY / src, tmp_path / "out.bpk", "--model", LEGACY / "model-21.mpk")
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "out.bpk") == sha(LEGACY_BPK / expected)


def test_legacy_model_to_burnpack(tmp_path, cli):
    assert cli("convert", LEGACY / "model-21.mpk", tmp_path / "m.bpk").returncode == 0
    assert sha(tmp_path / "m.bpk") == sha(LEGACY_BPK / "model-21.bpk")


def test_half_precision_cast_on_request(tmp_path, cli):
    r = cli("convert", LEGACY / "adam_half.mpk", tmp_path / "f32.bpk", "--model", LEGACY / "model-21.mpk", "--dtype", "f32")
    assert r.returncode == 0, r.stderr
    d = json.loads(cli("inspect", tmp_path / "f32.bpk", "--json").stdout)
    assert {f["dtype"] for p in d["params"] for f in p["fields"].values()} == {"F32"}
    truth = np.load(LEGACY / "truth.npz")
    from statekit import io

    with io.open_checkpoint(tmp_path / "f32.bpk") as ckpt:
        p = ckpt.optimizer.find("l1.weight")
        expect = truth[f"{p.id}.momentum.moment_1"].astype(np.float16).astype(np.float32)
        assert np.array_equal(p.slots["exp_avg"].numpy(), expect)


@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-optim-amsgrad.bpk", "hand-optim-rmsprop.bpk",
                                  "hand-optim-sgd.bpk", "hand-optim-bf16.bpk"])
def test_generic_safetensors_round_trip_is_byte_identical(tmp_path, cli, name):
    assert cli("convert", ROOT / "fixtures" / name, tmp_path / "s.safetensors").returncode == 0
    from safetensors.numpy import load_file

    assert all(k.startswith("state/") for k in load_file(str(tmp_path / "s.safetensors")))
    r = cli("convert", tmp_path / "s.safetensors", tmp_path / "back.bpk")
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "back.bpk") == sha(ROOT / "fixtures" / name)


def test_candle_via_convert_and_back(tmp_path, cli):
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "c.safetensors", "--to", "candle", "--optimizer", "adamw",
            "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file

    names = load_file(str(tmp_path / "c.safetensors"))
    assert names["first_moment.l1.weight"].shape == (16, 4) and names["step_t"].dtype == np.int64
    r = cli("convert", tmp_path / "c.safetensors", tmp_path / "back.bpk", "--model", "fixtures/hand-model.bpk",
            "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    r = cli("diff", "fixtures/hand-optim.bpk", tmp_path / "back.bpk")
    assert r.returncode == 0, r.stdout


def test_candle_refuses_differing_steps_unless_max(tmp_path, cli):
    differing = ROOT / "fixtures/migration/optim-steps.bpk"  # one parameter's step differs
    args = ["convert", differing, tmp_path / "c.safetensors", "--to", "candle", "--optimizer", "adamw",
            "--transpose", "*.weight"]
    r = cli(*args)
    assert r.returncode == 1 and "step" in r.stderr and not (tmp_path / "c.safetensors").exists()
    r = cli(*args, "--step", "max")
    assert r.returncode == 0, r.stderr


def test_nonfinite_state_is_refused_unless_allowed(tmp_path, cli):
    src = ROOT / "fixtures/migration/optim-nan.bpk"  # NaN and Inf planted in moments
    r = cli("convert", src, tmp_path / "x.safetensors")
    assert r.returncode == 1 and "NaN" in r.stderr and str(src) in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    r = cli("remap", src, "--model", "fixtures/hand-model.bpk", "-o", tmp_path / "y.bpk")
    assert r.returncode == 1 and not (tmp_path / "y.bpk").exists()
    assert cli("convert", src, tmp_path / "x.safetensors", "--allow-nonfinite").returncode == 0
    r = cli("diff", src, tmp_path / "x.safetensors")
    assert r.returncode == 0, r.stdout  # NaN at the same places compares equal


@pytest.mark.parametrize("src, out, code", [
    ("burn-optim/lion.bpk", "out.pt", 1),        # torch has no Lion
    ("burn-optim/lamb.bpk", "out.pt", 1),        # torch has no LAMB
    ("burn-optim/muon.bpk", "out.pt", 2),        # sgd or muon: the user must say
    ("burn-optim/muon-adamw.bpk", "out.safetensors", 1),
    ("burn-optim/muon-adamw.bpk", "out.pt", 2),   # its message already starts with the file: once
    ("bnb/ademamix8bit.pt", "out.pt", 1),        # torch has no AdEMAMix
    ("bnb/lamb8bit.pt", "out.bpk", 1),           # unorm_vec: not read
])
def test_a_refused_conversion_names_the_file_it_read(src, out, code, cli, tmp_path):
    """Refusals raised while planning (no Adan/LAMB/Lion in torch, sgd-or-muon, bitsandbytes
    families) said what was wrong but not of which file: one line naming it, no output file."""
    path = Path(__file__).resolve().parent.parent / "fixtures" / src
    res = cli("convert", path, tmp_path / out)
    assert res.returncode == code
    assert res.stderr.startswith(f"statekit: error: {path}") and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.count(str(path)) == 1
    assert not list(tmp_path.iterdir())
