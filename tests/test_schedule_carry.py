"""convert and the LR schedule beside the optimizer (issue 36 item 4): carried where the target can
express it, refused in one line where it cannot, dropped only when ``--no-schedule`` says so.

The sources are real programs' files (``scripts/make_schedule_fixtures.py``: transformers Trainer
runs, torch 2.13 schedulers); the burn records are laid out as burn 0.22 writes them
(``../shared/docs/burn-formats.md`` §2.4).
"""

from __future__ import annotations

import shutil

import pytest
from conftest import FIXTURES

from statekit.formats.burnpack import Scalar, write_burnpack

HF = FIXTURES / "schedule" / "hf"
COSINE = HF / "cosine" / "checkpoint-5"


def _refused(res, out, *words):
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and "--no-schedule" in lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("target", ["x.bpk", "x.safetensors"])
def test_a_trainer_folder_to_a_target_that_cannot_carry_its_schedule_is_refused(cli, tmp_path, target):
    out = tmp_path / target
    res = cli("convert", COSINE, out, "--transpose", "proj.weight")
    _refused(res, out, "hf:cosine", "scheduler.pt")
    assert list(tmp_path.iterdir()) == []


def test_an_optimizer_pt_with_scheduler_pt_beside_is_refused_too(cli, tmp_path):
    out = tmp_path / "x.bpk"
    res = cli("convert", COSINE / "optimizer.pt", out, "--model", COSINE / "model.safetensors")
    _refused(res, out, "scheduler.pt")


def test_a_torch_scheduler_beside_a_plain_optimizer_pt_is_refused(cli, tmp_path):
    src = FIXTURES / "schedule" / "torch" / "step"
    out = tmp_path / "x.safetensors"
    (tmp_path / "names.txt").write_text("a [3]\nb [2]\n")
    res = cli("convert", src / "optimizer.pt", out, "--names", tmp_path / "names.txt")
    _refused(res, out, "torch:StepLR", "scheduler.pt")


def test_no_schedule_drops_it_and_the_plan_says_so(cli, tmp_path):
    out = tmp_path / "x.bpk"
    res = cli("convert", COSINE, out, "--transpose", "proj.weight", "--no-schedule")
    assert res.returncode == 0, res.stderr
    assert out.exists()
    said = [line for line in (res.stdout + res.stderr).splitlines() if "--no-schedule" in line]
    assert len(said) == 1 and "dropped" in said[0] and "hf:cosine" in said[0]


def test_a_burn_record_with_its_scheduler_beside_is_refused_going_to_torch(cli, tmp_path):
    optim = tmp_path / "optim-2.bpk"
    assert cli("convert", COSINE, optim, "--transpose", "proj.weight", "--no-schedule").returncode == 0
    write_burnpack(str(tmp_path / "scheduler-2.bpk"), [], {}, {"0.current_iter": Scalar("UInt", 4)})
    out = tmp_path / "back.pt"
    res = cli("convert", optim, out)
    _refused(res, out, "burn:", "scheduler-2.bpk")
    assert cli("convert", optim, out, "--no-schedule").returncode == 0 and out.exists()


def test_torch_to_torch_keeps_the_source_scheduler_valid_and_says_it_is_not_written(cli, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(COSINE, folder)
    out = tmp_path / "x.pt"
    res = cli("convert", folder, out, "--json")
    assert res.returncode == 0, res.stderr
    assert out.exists() and "applies to it unchanged" in res.stdout + res.stderr
