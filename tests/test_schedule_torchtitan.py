"""torchtitan's LR schedule read from its DCP checkpoints (issue 36 item 1).

Fixtures: ``fixtures/torchtitan/<case>/`` written by torchtitan 0.3.0's own OptimizersContainer,
LRSchedulersContainer and CheckpointManager under torch 2.13 (``scripts/make_torchtitan_fixtures.py``,
which says what it imitates); ``reference.json``: the group lrs the running optimizer held after the
save and after each further ``lr_schedulers.step()``. Comparisons are exact.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FIXTURES

from statekit import io
from statekit.frameworks import schedule_torchtitan
from statekit.ops.doctor import doctor_files
from statekit.ops.inspect import inspect
from statekit.schedule import model, torchtitan_lr

ROOT = FIXTURES / "torchtitan"
SAVES = [(case.name, step) for case in sorted(ROOT.iterdir()) if case.is_dir()
         for step in json.loads((case / "reference.json").read_text())["steps"]]


def test_fixtures_are_torchtitan_0_3_0():
    assert len(SAVES) == 4
    for case in {c for c, _ in SAVES}:
        assert json.loads((ROOT / case / "reference.json").read_text())["versions"]["torchtitan"] == "0.3.0"


@pytest.mark.parametrize("case,step", SAVES)
def test_inspect_shows_the_lr_torchtitan_uses(case, step):
    ref = json.loads((ROOT / case / "reference.json").read_text())["steps"][step]
    with io.open_checkpoint(str(ROOT / case / "checkpoint" / f"step-{step}")) as ckpt:
        s = inspect(ckpt)["schedule"]
        ss = ckpt.schedule
    assert s["kind"] == "torchtitan:warmup_stable_decay"
    assert s["position"] == int(step) == s["counters"]["global_step"]
    assert s["lr_now"] == ref["lr_now"] and s["lr_next"] == ref["lr_next"][0]
    assert model.next_lrs(ss.schedule, n=len(ref["lr_next"])) == ref["lr_next"]
    assert s["horizon"] == 10 and s["steps_left"] == 10 - int(step)


def test_without_the_job_config_the_position_is_still_read(tmp_path):
    shutil.copytree(ROOT / "linear", tmp_path / "linear", ignore=shutil.ignore_patterns("job_config.json"))
    with io.open_checkpoint(str(tmp_path / "linear" / "checkpoint" / "step-4")) as ckpt:
        s = inspect(ckpt)["schedule"]
        sd = ckpt.container.state_dict()
        groups = [dict(g.hyperparams) for g in ckpt.optimizer.groups]
    assert s["position"] == 4 and s["lr_now"] == [0.0015, 0.00075] and s["lr_next"] is None
    assert "not recorded" in s["unknown"]
    # the config given through the API: the lr of the next updates again
    given = json.loads((ROOT / "linear" / "job_config.json").read_text())
    ss = schedule_torchtitan.read(sd, groups, str(tmp_path / "linear" / "checkpoint" / "step-4"), config=given)
    ref = json.loads((ROOT / "linear" / "reference.json").read_text())["steps"]["4"]
    assert model.next_lrs(ss.schedule, n=3) == ref["lr_next"][:3]


def test_two_recorded_configs_are_not_guessed_between(tmp_path):
    shutil.copytree(ROOT / "linear", tmp_path / "linear")
    shutil.copy(tmp_path / "linear" / "job_config.json", tmp_path / "linear" / "other.json")
    with io.open_checkpoint(str(tmp_path / "linear" / "checkpoint" / "step-4")) as ckpt:
        s = inspect(ckpt)["schedule"]
    assert s["lr_next"] is None and "2 job configs" in s["unknown"]


def test_hand_values():
    # warmup 2, total 10, no decay ratio: decay 8, stable 10+1-2-8 = 1; linear decay
    p = torchtitan_lr.lengths({"warmup_steps": 2, "decay_type": "linear"}, 10)
    assert (p["warmup_steps"], p["stable_steps"], p["decay_steps"]) == (2, 1, 8)
    assert torchtitan_lr.factor(0, p) == 0.5 and torchtitan_lr.factor(1, p) == 1.0  # (t+1)/2
    assert torchtitan_lr.factor(2, p) == 1.0  # the stable step
    # t=4: progress (4+1-3)/8 = 1/4, factor 3/4
    assert torchtitan_lr.factor(4, p) == 0.75
    # decay_ratio 0.5 of 10 = 5 decay steps, warm-up clamped to the total
    q = torchtitan_lr.lengths({"warmup_steps": 30, "decay_ratio": 0.5}, 10)
    assert (q["warmup_steps"], q["decay_steps"], q["stable_steps"]) == (10, 0, 1)


@pytest.mark.parametrize("case,step", SAVES)
def test_doctor_finds_nothing_in_healthy_torchtitan_checkpoints(case, step):
    report = doctor_files(ROOT / case / "checkpoint" / f"step-{step}")
    checks = {"schedule-lr", "schedule-args", "initial-lr", "no-scheduler", "counters", "warmup-again"}
    assert [f for f in report["findings"] if f["check"] in checks] == []
