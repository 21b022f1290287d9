"""Megatron's ``opt_param_scheduler`` as a schedule (issue 36 item 1): position in samples and iterations,
lr now / next per group, weight decay, doctor's checks.

References: ``fixtures/megatron/schedule_refs.json``, written by megatron-core 0.19.2's own
``OptimizerParamScheduler`` (``scripts/make_megatron_schedule_refs.py``: ``load_state_dict`` of each
fixture's saved scheduler, then ``step(increment=global_batch_size)`` as ``train_step`` does; and one
scheduler per decay style stepped through its horizon). The checkpoints are megatron-core's own
(``fixtures/megatron/README.md``). Comparisons are exact (``==`` on floats); hand values are worked in
the comments.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import FIXTURES

from statekit import io
from statekit.frameworks import schedule_megatron
from statekit.ops import doctor_schedule
from statekit.ops.doctor import _finding
from statekit.ops.inspect import inspect
from statekit.schedule import megatron_lr, model

REFS = json.loads((FIXTURES / "megatron" / "schedule_refs.json").read_text())
# (the 2-bucket fully_reshardable saves are refused by the reader: Megatron's bucket-shift bug, see their README)
CASES = sorted(c for c in REFS["fixtures"] if "2buckets" not in c)


def inspected(path) -> dict:
    with io.open_checkpoint(str(path)) as ckpt:
        return inspect(ckpt)


def test_references_are_megatron_core_0_19_2():
    assert REFS["megatron_core"] == "0.19.2" and len(CASES) >= 20


@pytest.mark.parametrize("case", CASES)
def test_inspect_shows_the_lr_megatron_uses(case):
    ref = REFS["fixtures"][case]
    d = inspected(FIXTURES / "megatron" / case)
    s = d["schedule"]
    sd = ref["state_dict"]
    trace, gbs = ref["trace"], ref["global_batch_size"]
    assert s["kind"] == f"megatron:{sd['lr_decay_style']}" and s["unit"] == "samples"
    assert s["position"] == sd["num_steps"] == trace[0]["num_steps"]
    assert s["warmup"] == sd["lr_warmup_steps"] and s["horizon"] == sd["lr_decay_steps"]
    assert s["per_update"] == gbs
    assert s["updates"]["position"] == sd["num_steps"] // gbs == ref["iteration"]
    assert s["steps_left"] == sd["lr_decay_steps"] - sd["num_steps"]
    n = len(s["lr_now"])
    if ref["groups_from"] == "file":  # the real class stepped the saved groups themselves
        assert s["lr_now"] == trace[0]["lr"] and s["lr_next"] == trace[1]["lr"]
        assert s["wd_now"] == trace[0]["weight_decay"] and s["wd_next"] == trace[1]["weight_decay"]
    else:  # the real class stepped Megatron's default group (max_lr = args.lr): every group here is one
        assert s["lr_now"] == trace[0]["lr"] * n and s["lr_next"] == trace[1]["lr"] * n
    # the group lr Megatron saved is the lr its scheduler set after the last update
    assert [g["hyperparameters"]["lr"] for g in d["groups"]] == s["lr_now"]
    assert s["counters"]["global_step"] == ref["iteration"]


@pytest.mark.parametrize("case", CASES)
def test_the_next_six_updates(case):
    ref = REFS["fixtures"][case]
    with io.open_checkpoint(str(FIXTURES / "megatron" / case)) as ckpt:
        ss = ckpt.schedule
    got = model.next_lrs(ss.schedule, n=6)
    want = [t["lr"] for t in ref["trace"][1:7]]
    if ref["groups_from"] == "args":
        want = [lr * len(got[0]) for lr in want]
    assert got == want


def test_next_step_fixture_saved_the_lr_predicted_one_iteration_before():
    """One run saved at iteration 3 and 4: the lr statekit says iteration 3's next update after the
    next uses is the lr Megatron's scheduler wrote into the groups it saved at iteration 4."""
    base = FIXTURES / "megatron" / "0.19.2"
    at3 = inspected(base / "gpt_torch_dist_dp_reshardable_tp1pp1dp2")["schedule"]
    at4 = inspected(base / "gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step")
    assert at3["lr_next"] == [g["hyperparameters"]["lr"] for g in at4["groups"]]


def _synthetic_args(kw: dict, increment: int) -> dict:
    return {"lr_warmup_init": kw["init_lr"], "global_batch_size": increment, "train_iters": 100,
            "lr_wsd_decay_iters": None if kw["wsd_decay_steps"] is None else kw["wsd_decay_steps"] // increment,
            "lr_wsd_decay_style": kw["lr_wsd_decay_style"]}


@pytest.mark.parametrize("i", range(len(REFS["synthetic"])),
                         ids=[f"{c['kwargs']['lr_decay_style']}-{c['kwargs']['lr_wsd_decay_style']}-"
                              f"wd-{c['kwargs']['wd_incr_style']}" for c in REFS["synthetic"]])
def test_every_decay_style_against_the_real_class(i):
    case = REFS["synthetic"][i]
    kw = case["kwargs"]
    ss = schedule_megatron.read(case["state_dict"], _synthetic_args(kw, case["increment"]), case["groups"], None,
                                "synthetic")
    sched = ss.schedule
    assert sched.unknown is None
    for point in case["trace"]:
        assert model.lr_at(sched, point["num_steps"]) == point["lr"], point["num_steps"]
        assert megatron_lr.wd_at(sched, point["num_steps"]) == point["weight_decay"], point["num_steps"]


def _sched(style="cosine", groups=None, **args):
    sd = {"max_lr": 0.01, "lr_warmup_steps": 4, "num_steps": 12, "lr_decay_style": style, "lr_decay_steps": 32,
          "min_lr": 0.001, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 32}
    full = {"lr_warmup_init": 0.0, "global_batch_size": 4, "train_iters": 8}
    full.update(args)
    return schedule_megatron.read(sd, full, groups or [{"max_lr": 0.01, "min_lr": 0.001, "lr": 0.5}], 3, "t")


def test_hand_values():
    sched = _sched().schedule
    # warm-up from 0 to 0.01 over 4 samples: at 2, half way
    assert megatron_lr.lr(sched.params, 2, 0.01, 0.001) == 0.005
    # cosine at 18 samples: decay ratio (18-4)/(32-4) = 1/2, coeff 1/2: 0.001 + 0.009/2
    assert math.isclose(model.lr_at(sched, 18)[0], 0.0055, rel_tol=1e-15)
    # past the horizon: min_lr
    assert model.lr_at(sched, 33) == [0.001]
    inv = _sched("inverse-square-root").schedule
    # inverse square root at 16 samples: 0.01 * sqrt(4) / sqrt(16) = 0.005
    assert model.lr_at(inv, 16) == [0.005]
    lin = _sched("linear").schedule
    # linear at 11 samples: ratio 7/28 = 1/4, coeff 3/4: 0.001 + 0.00675
    assert math.isclose(model.lr_at(lin, 11)[0], 0.00775, rel_tol=1e-15)
    assert model.lr_at(_sched("constant").schedule, 20) == [0.01]


def test_per_group_max_lr_and_min_lr():
    ss = _sched(groups=[{"lr": 1.0}, {"max_lr": 0.02, "min_lr": 0.0, "lr": 1.0}])
    # at 18 samples: coeff 1/2; group 0 the scheduler's 0.01 / 0.001, group 1 its own 0.02 / 0
    got = model.lr_at(ss.schedule, 18)
    assert math.isclose(got[0], 0.0055, rel_tol=1e-15) and math.isclose(got[1], 0.01, rel_tol=1e-15)


def test_not_computed_is_said():
    assert "lr_mult" in _sched(groups=[{"max_lr": 0.01, "lr_mult": 2.0}]).schedule.unknown
    assert "WSD" in _sched("WSD").schedule.unknown  # no lr_wsd_decay_iters in args
    assert "lr_warmup_init" in schedule_megatron.read(_sched().schedule.state, {"global_batch_size": 4}, [], 3,
                                                      "t").schedule.unknown
    view = model.describe(_sched(groups=[{"lr_mult": 2.0}]))
    assert view["lr_now"] is None and "lr_mult" in view["lr_next_why"]
    ramp = _sched(rampup_batch_size=["2", "2", "16"]).schedule
    assert ramp.per_update is None and "rampup" in ramp.notes[0]
    with pytest.raises(Exception, match="samples one update consumes"):
        model.next_lrs(ramp)


def _doctor(ss) -> list[dict]:
    class Ckpt:
        schedule = ss
        path = "x"
    findings, notes = [], []
    doctor_schedule.check(Ckpt, _finding, findings, notes)
    return findings


@pytest.mark.parametrize("case", CASES)
def test_doctor_finds_nothing_in_megatron_fixtures(case):
    with io.open_checkpoint(str(FIXTURES / "megatron" / case)) as ckpt:
        assert _doctor(ckpt.schedule) == []


def test_doctor_planted_group_lr_and_counters():
    with io.open_checkpoint(str(FIXTURES / "megatron" / "0.19.2" / "gpt_torch_no_distopt_tp1pp1dp2")) as ckpt:
        ss = ckpt.schedule
    ss.groups[1]["lr"] = 0.01
    found = _doctor(ss)
    assert [(f["check"], f["param"]) for f in found] == [("schedule-lr", "group 1")]
    assert "num_steps 12 samples gives 0.008305704108364302" in found[0]["message"]
    ss.groups[1]["lr"] = ss.schedule.lr_now[1]
    ss.counters.global_step = 5  # the iteration says 5, the scheduler 12 samples / 4 = 3 updates
    found = _doctor(ss)
    assert [f["check"] for f in found] == ["counters"] and "the iteration is 5" in found[0]["message"]


def test_doctor_warmup_again():
    ss = _sched()
    ss.schedule.position = 0  # a fresh scheduler over an optimizer 3 updates in
    ss.optimizer_step = 3.0
    ss.groups[0]["lr"] = 0.0
    ss.schedule.lr_now = model.lr_at(ss.schedule, 0)
    assert "warmup-again" in {f["check"] for f in _doctor(ss)}
