"""Lightning checkpoints' LR schedule (issue 36): inspect shows the lr Lightning's own resume uses.

Fixtures: ``fixtures/schedule/lightning/<case>/*.ckpt`` written by ``Trainer.fit`` of lightning 2.6.6
under torch 2.13 (``scripts/make_lightning_fixtures.py``); ``reference.json``: the group lrs of the
first six updates after ``Trainer.fit(ckpt_path=...)`` resumed each file (recorded in
``on_before_optimizer_step``). Reading needs only statekit; comparisons are exact.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from statekit import io
from statekit.ops.doctor import doctor_files
from statekit.ops.inspect import inspect
from statekit.schedule import model

ROOT = FIXTURES / "schedule" / "lightning"
REFS = {case.name: json.loads((case / "reference.json").read_text()) for case in sorted(ROOT.iterdir())}
SAVES = [(case, ckpt) for case, ref in REFS.items() for ckpt in ref["resumed"]]
CHECKS = {"schedule-lr", "schedule-args", "initial-lr", "no-scheduler", "counters", "warmup-again"}


def test_fixtures_are_lightning_written():
    assert len(SAVES) == 9 and {r["versions"]["lightning"] for r in REFS.values()} == {"2.6.6"}


@pytest.mark.parametrize("case,ckpt", SAVES)
def test_inspect_shows_the_lr_of_lightnings_resume(case, ckpt):
    ref = REFS[case]
    lrs = ref["resumed"][ckpt]["lrs"]
    with io.open_checkpoint(str(ROOT / case / ckpt)) as c:
        s = inspect(c)["schedule"]
        sched = c.schedule.schedule
    assert s["lr_now"] == lrs[0]  # the first update after the resume
    if case == "epoch_midsave":  # interval='epoch' saved mid-epoch: when the epoch ends is not saved
        assert s["lr_next"] is None and "interval" in s["lr_next_why"]
        return
    assert s["lr_next"] == lrs[1]
    assert model.next_lrs(sched, n=5) == lrs[1:6]  # across the next epoch boundary for interval='epoch'
    assert sched.interval == ref["interval"]


@pytest.mark.parametrize("case,ckpt", SAVES)
def test_doctor_finds_nothing_in_lightning_checkpoints(case, ckpt):
    assert [f for f in doctor_files(ROOT / case / ckpt)["findings"] if f["check"] in CHECKS] == []


@pytest.mark.lightning
def test_lightning_loads_the_fixtures():
    pl = pytest.importorskip("lightning.pytorch")
    torch = pytest.importorskip("torch")
    for case, ckpt in SAVES:
        obj = pl.core.saving.pl_load(str(ROOT / case / ckpt), map_location="cpu")
        assert obj["lr_schedulers"][0]["last_epoch"] == inspect_position(ROOT / case / ckpt)
    assert torch.__version__.startswith("2.13")


def inspect_position(path) -> int:
    with io.open_checkpoint(str(path)) as c:
        return inspect(c)["schedule"]["position"]
