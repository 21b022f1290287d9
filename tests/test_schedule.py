"""The LR schedule (issue 36): read from torch 2.13's schedulers, HF Trainer folders and burn records,
shown by inspect, checked by doctor.

References are what the real programs did next (``scripts/make_schedule_fixtures.py``): torch's
``get_last_lr()`` after more ``step()`` calls, the lrs a ``transformers.Trainer`` run's optimizer
held after each update. Every comparison is exact (``==`` on floats).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from conftest import FIXTURES

from statekit import io
from statekit.errors import UnsafePickleError
from statekit.formats import torch_pt
from statekit.formats.burnpack import Scalar, write_burnpack
from statekit.frameworks import schedule_hf, schedule_torch
from statekit.ops.doctor import doctor_files
from statekit.ops.inspect import inspect
from statekit.schedule import hf_lr, model, torch_lr

SCHEDULE_CHECKS = {"schedule-lr", "schedule-args", "initial-lr", "no-scheduler", "counters", "warmup-again"}


@pytest.fixture(scope="module")
def torch_ref():
    return json.loads((FIXTURES / "schedule" / "torch" / "reference.json").read_text())


@pytest.fixture(scope="module")
def hf_ref():
    ref = json.loads((FIXTURES / "schedule" / "hf" / "reference.json").read_text())
    ref.pop("versions")
    return ref


def described(path) -> dict:
    with io.open_checkpoint(path) as ckpt:
        return inspect(ckpt)["schedule"]


# ------------------------------------------------------------------------------------ torch


def test_every_torch_scheduler_class_has_a_fixture(torch_ref):
    assert {r["class"] for r in torch_ref.values()} == set(torch_lr.CLASSES)


@pytest.mark.parametrize("case", sorted(json.loads((FIXTURES / "schedule" / "torch" / "reference.json").read_text())))
def test_torch_scheduler_file_shows_the_lr_torch_uses_next(fixtures, torch_ref, case):
    ref = torch_ref[case]
    s = described(fixtures / "schedule" / "torch" / case / "scheduler.pt")
    assert s["lr_now"] == ref["lr_now"]
    assert s["position"] == ref["steps"]
    if ref["class"] in ("LambdaLR", "MultiplicativeLR"):  # their functions are not saved: said, not guessed
        assert s["lr_next"] is None and "save no function" in s["lr_next_why"]
        return
    if ref["class"] == "ReduceLROnPlateau":
        assert s["lr_next_if"] == {"better": ref["lr_next_better"], "worse": ref["lr_next_worse"]}
        return
    assert s["lr_next"] == ref["lr_next"][0]
    ss = schedule_torch.read_file(str(fixtures / "schedule" / "torch" / case / "scheduler.pt"))
    assert model.next_lrs(ss.schedule, ss.groups, len(ref["lr_next"])) == ref["lr_next"]


def test_one_cycle_needs_the_optimizer_groups(fixtures, tmp_path):
    """OneCycleLR's lr comes from the groups' initial_lr / max_lr / min_lr: without optimizer.pt it says so."""
    shutil.copy(fixtures / "schedule" / "torch" / "onecycle" / "scheduler.pt", tmp_path / "scheduler.pt")
    s = described(tmp_path / "scheduler.pt")
    assert s["lr_next"] is None and "max_lr" in s["lr_next_why"] and "optimizer" in s["lr_next_why"]


def test_the_counter_global_is_allowed_for_scheduler_files_only(fixtures):
    path = fixtures / "schedule" / "torch" / "multistep" / "scheduler.pt"
    with pytest.raises(UnsafePickleError, match="collections.Counter"):
        torch_pt.load_pt(path)
    assert schedule_torch.load(str(path))["milestones"] == {2: 1, 6: 2}


def test_closed_forms_agree_with_the_chainable_steps(fixtures, torch_ref):
    """Where torch has a closed form, it gives the lr the chainable steps reached (to rounding)."""
    for case, ref in torch_ref.items():
        ss = schedule_torch.read_file(str(fixtures / "schedule" / "torch" / case / "scheduler.pt"))
        closed = model.lr_at(ss.schedule, ss.schedule.position, ss.groups)
        if closed is not None and ref["class"] not in ("SequentialLR", "ChainedScheduler"):
            assert all(model.same_lr(a, b) for a, b in zip(closed, ref["lr_now"], strict=True)), case


def test_cosine_annealing_branches_are_torch_exact():
    """At T_max + 1 the chainable cosine takes its own branch (it rises again): hand-checked values."""
    st = {"T_max": 2, "eta_min": 0.0, "base_lrs": [1.0], "last_epoch": 2, "_step_count": 3, "_last_lr": [0.0]}
    st, groups = torch_lr.step("CosineAnnealingLR", st, [{"lr": 0.0}])
    # group lr + (base - eta_min) * (1 - cos(pi / T_max)) / 2, and cos(pi/2) is 6e-17, not 0
    assert st["last_epoch"] == 3 and groups[0]["lr"] == (1 - math.cos(math.pi / 2)) / 2 == 0.49999999999999994


# ------------------------------------------------------------------------------------ HF Trainer


@pytest.mark.parametrize("kind", sorted(hf_lr.TYPES[:8] + hf_lr.TYPES[8:9] + hf_lr.TYPES[10:]))
def test_trainer_folder_shows_the_lr_the_next_updates_use(fixtures, hf_ref, kind):
    ref = hf_ref[kind]
    after = ref["lrs_after_step"]
    s = described(fixtures / "schedule" / "hf" / kind / "checkpoint-5")
    assert s["kind"] == f"hf:{kind}" and s["position"] == 5
    assert s["counters"]["global_step"] == 5
    assert s["counters"]["skip_batches"] == (5 % 3) * 2 and s["counters"]["updates_per_epoch"] == 3  # 6 batches, GA 2
    if kind == "reduce_lr_on_plateau":  # stepped on the evaluation after on_step_end: update 6 uses lrs after it
        assert s["lr_now"] == after["6"]
        assert after["7"] in (s["lr_next_if"]["better"], s["lr_next_if"]["worse"])
        return
    assert s["lr_now"] == after["5"] and s["lr_next"] == after["6"]
    assert s["warmup"] == (0 if kind == "constant" else 3)
    ss = schedule_hf.read_folder(str(fixtures / "schedule" / "hf" / kind / "checkpoint-5"))
    assert model.next_lrs(ss.schedule, ss.groups, 4) == [after[str(k)] for k in range(6, 10)]
    if kind in ("linear", "cosine", "polynomial", "cosine_with_min_lr", "cosine_with_restarts"):
        assert s["horizon"] == 10 and s["steps_left"] == 5


def test_trainer_schedule_shown_in_the_table(fixtures, hf_ref, cli):
    res = cli("inspect", str(fixtures / "schedule" / "hf" / "cosine" / "checkpoint-5"))
    assert res.returncode == 0, res.stderr
    after = hf_ref["cosine"]["lrs_after_step"]
    assert "schedule: hf:cosine · warm-up 3 · horizon 10 · position 5 · steps left 5" in res.stdout
    assert f"lr now (next update): {after['5'][0]!r} (all 2 groups)" in res.stdout
    assert f"lr next (the update after): {after['6'][0]!r} (all 2 groups)" in res.stdout
    assert "skip batches 4" in res.stdout


def test_scheduler_pt_alone_shows_a_lambda_it_cannot_rebuild(fixtures, tmp_path):
    shutil.copy(fixtures / "schedule" / "hf" / "linear" / "checkpoint-5" / "scheduler.pt", tmp_path / "scheduler.pt")
    s = described(tmp_path / "scheduler.pt")
    assert s["position"] == 5 and s["lr_next"] is None and "save no function" in s["lr_next_why"]


@pytest.mark.parametrize(("step", "epoch", "ga", "want"), [
    (5, 1.6666666666666665, 2, (3, 4)),  # 6 batches, GA 2: 3 updates an epoch; 2 done in epoch 2 = 4 batches
    (3, 0.1875, 1, (16, 3)),  # 16 batches an epoch
    (6, 2.0, 2, (3, 0)),  # an epoch boundary: 5 or 6 batches an epoch, 3 updates either way, nothing to skip
    (5, 1.3, 2, None),  # no dataloader length gives this fraction
])
def test_data_position_from_the_epoch_fraction(step, epoch, ga, want):
    per_epoch, skip, why = schedule_hf.data_position(step, epoch, ga)
    if want is None:
        assert per_epoch is None and skip is None and "no dataloader length" in why
    else:
        assert (per_epoch, skip) == want and not why


# ------------------------------------------------------------------------------------ burn


def _record(path, scalars: dict) -> str:
    write_burnpack(str(path), [], {}, scalars)
    return str(path)


@pytest.mark.parametrize(("scalars", "kind", "position"), [
    ({"0.current_iter": Scalar("UInt", 2**64 - 1)}, "burn:cosine", 0),  # before the first call (wraps to 0)
    ({"0.current_iter": Scalar("UInt", 20)}, "burn:cosine", 21),
    ({"0.iter_idx": Scalar("Int", -1)}, "burn:step", 0),
    ({"0.iter_idx": Scalar("Int", 6)}, "burn:step", 7),
    ({"0.step": Scalar("Float", 21.0)}, "burn:noam", 21),
    ({"0.step": Scalar("UInt", 7), "0.0.remaining_iters": Scalar("UInt", 0), "0.1.current_iter": Scalar("UInt", 2)},
     "burn:sequential", 7),
    ({"0.remaining_iters": Scalar("UInt", 4)}, "burn:linear", None),  # N + 1 - remaining: needs N
])
def test_burn_records_read_back_to_positions(tmp_path, scalars, kind, position):
    s = described(_record(tmp_path / "scheduler-3.bpk", scalars))
    child = s["children"][0]
    assert child["kind"] == kind and child["position"] == position
    assert s["lr_next"] is None and "no scheduler config" in s["lr_next_why"]
    assert s["counters"]["epoch"] == 3.0 and s["counters"]["skip_batches"] == 0  # epoch files: a resume starts epoch 4


def test_hand_scheduler_record(fixtures):
    s = described(fixtures / "hand-scheduler.bpk")
    assert [(c["kind"], c["position"]) for c in s["children"]] == [("burn:noam", 21), ("burn:cosine", 21),
                                                                    ("burn:step", 0)]


# ------------------------------------------------------------------------------------ doctor


def schedule_findings(path) -> tuple[list[dict], list[str]]:
    report = doctor_files(path)
    return [f for f in report["findings"] if f["check"] in SCHEDULE_CHECKS], report["notes"]


@pytest.mark.parametrize("kind", sorted(hf_lr.TYPES[:8] + hf_lr.TYPES[8:9] + hf_lr.TYPES[10:]))
def test_doctor_finds_nothing_in_healthy_trainer_folders(fixtures, kind):
    assert schedule_findings(fixtures / "schedule" / "hf" / kind / "checkpoint-5")[0] == []


@pytest.mark.parametrize("case", ["step", "exponential", "cosine-past", "onecycle", "sequential", "chained", "plateau",
                                  "warm-restarts", "cyclic"])
def test_doctor_finds_nothing_beside_healthy_torch_schedulers(fixtures, case):
    assert schedule_findings(fixtures / "schedule" / "torch" / case / "optimizer.pt")[0] == []


def test_doctor_group_lr_off_the_schedule(fixtures):
    found, _ = schedule_findings(fixtures / "schedule" / "planted" / "lr-edited" / "optimizer.pt")
    assert [f["check"] for f in found] == ["schedule-lr", "schedule-lr"]
    # ExponentialLR after 3 steps: 0.1 * 0.9^3; the group was set to 0.02 by hand
    assert "0.07290000000000002" in found[0]["message"] and "every later lr is off" in found[0]["message"]


def test_doctor_initial_lr_missing(fixtures):
    found, _ = schedule_findings(fixtures / "schedule" / "planted" / "no-initial-lr" / "optimizer.pt")
    assert [f["check"] for f in found] == ["initial-lr"] and "groups 0, 1" in found[0]["message"]


def test_doctor_scheduler_pt_missing(fixtures, tmp_path):
    folder = tmp_path / "checkpoint-5"
    shutil.copytree(fixtures / "schedule" / "hf" / "linear" / "checkpoint-5", folder)
    (folder / "scheduler.pt").unlink()
    found, _ = schedule_findings(folder)
    assert [(f["severity"], f["check"]) for f in found] == [("error", "no-scheduler")]
    found, _ = schedule_findings(folder / "optimizer.pt")  # the optimizer file alone: its folder is looked at
    assert [f["check"] for f in found] == ["no-scheduler"]


def test_doctor_warmup_runs_again(fixtures):
    found, _ = schedule_findings(fixtures / "schedule" / "planted" / "fresh-scheduler" / "checkpoint-5")
    assert "warmup-again" in {f["check"] for f in found}
    assert "counters" in {f["check"] for f in found}


def test_doctor_counters_disagree(fixtures, tmp_path):
    folder = tmp_path / "checkpoint-5"
    shutil.copytree(fixtures / "schedule" / "hf" / "cosine" / "checkpoint-5", folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["global_step"] = 4
    (folder / "trainer_state.json").write_text(json.dumps(state))
    found, _ = schedule_findings(folder)
    assert [f["check"] for f in found] == ["counters"] and "global step is 4" in found[0]["message"]


def test_doctor_explains_updates_the_fp16_scaler_skipped(fixtures):
    found, notes = schedule_findings(fixtures / "schedule" / "planted" / "fp16-skipped" / "checkpoint-7")
    assert found == []
    assert any("2 updates skipped by the fp16 loss scaler" in n for n in notes)


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("sd", [
    {"step_size": "three", "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 2, "_step_count": 3, "_last_lr": [0.1]},
    {"gamma": 0.5, "base_lrs": "0.1", "last_epoch": 2, "_step_count": 3, "_last_lr": [0.1]},
    {"T_max": 0, "eta_min": 0.0, "base_lrs": [0.1], "last_epoch": 2, "_step_count": 3, "_last_lr": [0.1]},
    {"_milestones": [3], "_schedulers": "nothing", "last_epoch": 1, "_last_lr": [0.1]},
])
def test_a_malformed_scheduler_is_one_line_never_a_traceback(tmp_path, cli, sd):
    path = tmp_path / "scheduler.pt"
    torch_pt.save_pt(sd, path)
    res = cli("inspect", str(path))
    assert "Traceback" not in res.stdout + res.stderr
    if res.returncode == 0:  # read, with the next lr said to be unknown
        assert "lr next: not known" in res.stdout
    else:
        assert len(res.stderr.strip().splitlines()) == 1 and "scheduler.pt" in res.stderr


def test_an_lr_past_float_range_is_shown_as_torch_computes_it(tmp_path, cli):
    torch_pt.save_pt({"gamma": 1e300, "base_lrs": [0.1], "last_epoch": 2, "_step_count": 3, "_last_lr": [1e300]},
                     tmp_path / "scheduler.pt")
    res = cli("inspect", str(tmp_path / "scheduler.pt"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["schedule"]["lr_next"] == ["inf"]  # 1e300 * 1e300 in floats, as torch steps it


def test_a_burn_record_of_no_scheduler_is_a_warning(tmp_path):
    with io.open_checkpoint(_record(tmp_path / "scheduler-1.bpk", {"0.mystery": Scalar("UInt", 3)})) as ckpt:
        assert ckpt.schedule is None and any("no burn scheduler keeps it" in w for w in ckpt.warnings)


# ------------------------------------------------------------------------------------ Lightning, Accelerate


def _torch_next(sched_sd: dict, groups: list[dict]) -> list[float]:
    """Real torch: a StepLR over the saved groups' lrs, its saved state loaded, stepped once."""
    torch = pytest.importorskip("torch")
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": g["initial_lr"]} for g in groups])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for group, saved in zip(opt.param_groups, groups, strict=True):
        group["lr"] = saved["lr"]  # (what optimizer.load_state_dict restores)
    sched.load_state_dict(sched_sd)
    opt.step()
    sched.step()
    return sched.get_last_lr()


@pytest.mark.parametrize(("path", "where"), [
    ("clients/lightning/epoch=0-step=4.ckpt", "lightning"), ("clients/accelerate", "accelerate")])
def test_lightning_and_accelerate_schedules_step_as_torch_does(fixtures, path, where):
    torch = pytest.importorskip("torch")
    if where == "lightning":
        obj = torch.load(fixtures / path, weights_only=False)
        sd, groups = obj["lr_schedulers"][0], obj["optimizer_states"][0]["param_groups"]
    else:
        sd = torch.load(fixtures / path / "scheduler.bin", weights_only=True)
        groups = torch.load(fixtures / path / "optimizer.bin", weights_only=True)["param_groups"]
    s = described(fixtures / path)
    assert s["kind"] == "torch:StepLR" and s["position"] == sd["last_epoch"]
    assert s["lr_now"] == sd["_last_lr"] and s["lr_next"] == _torch_next(sd, groups)
    if where == "lightning":
        assert s["counters"]["global_step"] == obj["global_step"] and s["optimizer_step"] == obj["global_step"]
    assert schedule_findings(fixtures / path)[0] == []


def test_doctor_arguments_that_rebuild_another_schedule(fixtures, tmp_path):
    """max_steps 10 → 20 in trainer_state.json: the rebuilt linear λ no longer gives the saved lr at 5."""
    folder = tmp_path / "checkpoint-5"
    shutil.copytree(fixtures / "schedule" / "hf" / "linear" / "checkpoint-5", folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["max_steps"] = 20
    (folder / "trainer_state.json").write_text(json.dumps(state))
    found, _ = schedule_findings(folder)
    assert [f["check"] for f in found] == ["schedule-args"]
    assert "0.0071428571428571435" in found[0]["message"]  # 0.01 * (10 - 5) / 7, the saved lr
    assert "0.008823529411764706" in found[0]["message"]  # 0.01 * (20 - 5) / 17, the rebuilt one
    assert described(folder)["lr_next"] == [0.01 * (20 - 6) / 17] * 2  # what a resume with these arguments uses


def test_doctor_a_chainable_lr_that_drifted_from_its_closed_form(tmp_path):
    """StepLR(step_size 2, gamma 0.5) at 5 is 0.1 * 0.5^2 = 0.025; its saved lr (and the group's) is 0.05."""
    torch_pt.save_pt({"step_size": 2, "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 5, "_step_count": 6,
                      "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [0.05]},
                     tmp_path / "scheduler.pt")
    torch_pt.save_pt({"state": {}, "param_groups": [{"lr": 0.05, "initial_lr": 0.1, "params": [0]}]},
                     tmp_path / "optimizer.pt")
    found, _ = schedule_findings(tmp_path / "optimizer.pt")
    assert [f["check"] for f in found] == ["schedule-lr"] and "0.025" in found[0]["message"]


def test_data_position_of_a_long_run_is_quick():
    """A long run: 10 epochs of 90 909 updates (727 272 batches, GA 8) done, 90 000 updates into the 11th."""
    import time

    n, ga = 727_272, 8
    per_epoch = n // ga  # 90 909
    step = 10 * per_epoch + 90_000
    epoch = 10 + (90_000 * ga) / n
    start = time.perf_counter()
    assert schedule_hf.data_position(step, epoch, ga)[:2] == (per_epoch, 90_000 * ga)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------------ DeepSpeed


def _deepspeed_with(fixtures, tmp_path, **entries):
    """The stage-2 DeepSpeed fixture (3 updates) with entries set in its model states (real torch.save)."""
    torch = pytest.importorskip("torch")
    folder = tmp_path / "step3"
    shutil.copytree(fixtures / "deepspeed" / "stage2" / "step3", folder)
    states = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    states.update(entries)
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    return folder


def test_deepspeed_scheduler_position_and_counters(fixtures, tmp_path):
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}}}
    folder = _deepspeed_with(fixtures, tmp_path, lr_scheduler={"last_batch_iteration": 1}, skipped_steps=1,
                             ds_config=config)
    s = described(folder)
    assert s["kind"] == "deepspeed:WarmupLR" and s["position"] == 1 and s["warmup"] == 10
    assert s["lr_next"] is None and "not implemented" in s["lr_next_why"]
    assert s["counters"]["global_step"] == 3 and s["counters"]["consumed_samples"] == 24
    found, notes = schedule_findings(folder)  # 3 updates, 1 skipped: stepped twice, last_batch_iteration 1
    assert found == [] and any("1 skipped by the fp16 loss scaler" in n for n in notes)
    found, _ = schedule_findings(_deepspeed_with(fixtures, tmp_path / "b", lr_scheduler={"last_batch_iteration": 5},
                                                 ds_config=config))
    assert [f["check"] for f in found] == ["counters"]


def test_deepspeed_with_a_client_torch_scheduler(fixtures, tmp_path):
    # StepLR(step_size 2, gamma 0.5) from 0.02 at position 3: 0.01, the fixture's group lr; at 4 it halves
    sd = {"step_size": 2, "gamma": 0.5, "base_lrs": [0.02], "last_epoch": 3, "_step_count": 4, "_is_initial": False,
          "_get_lr_called_within_step": False, "_last_lr": [0.01]}
    folder = _deepspeed_with(fixtures, tmp_path, lr_scheduler=sd)
    s = described(folder)
    assert s["kind"] == "torch:StepLR" and s["position"] == 3 and s["lr_next"] == [0.01 * 0.5]
    # 3 updates at position 3 agree; the run had no scheduler, so its groups keep no initial_lr
    assert [f["check"] for f in schedule_findings(folder)[0]] == ["initial-lr"]
