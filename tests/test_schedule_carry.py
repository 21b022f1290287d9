"""convert and the LR schedule beside the optimizer (issue 36 item 4): carried where the target can
express it, refused in one line where it cannot, dropped only when ``--no-schedule`` says so.

The sources are real programs' files (``scripts/make_schedule_fixtures.py``: transformers Trainer
runs, torch 2.13 schedulers); the burn records are laid out as burn 0.22 writes them
(``../shared/docs/burn-formats.md`` §2.4).
"""

from __future__ import annotations

import json
import math
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


# ------------------------------------------------ a real Trainer checkpoint → burn → back, resumed


def _trainer_run(out_dir, kind: str, kwargs: dict, max_steps: int, resume=None):
    """A transformers Trainer run of the tiny model make_schedule_fixtures.py trains (warm-up 3,
    gradient accumulation 2, saved every 5 updates); returns the lr each update used and the weights."""
    torch = pytest.importorskip("torch")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            out = self.proj(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    used: list[list[float]] = []

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            used.append([float(g["lr"]) for g in optimizer.param_groups])

    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=max_steps, save_strategy="steps", save_steps=5,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, warmup_steps=3, lr_scheduler_type=kind,
        lr_scheduler_kwargs=kwargs, learning_rate=0.01, weight_decay=0.1, logging_steps=1, report_to="none",
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=[Record()])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return used, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.hf
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("kind,kwargs", [("cosine", {}), ("linear", {}), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                         ("inverse_sqrt", {})])
def test_a_trainer_checkpoint_to_burn_and_back_resumes_with_the_same_lr_at_every_next_step(cli, tmp_path, kind,
                                                                                            kwargs):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    _trainer_run(tmp_path / "run", kind, kwargs, max_steps=5)
    orig = tmp_path / "run" / "checkpoint-5"
    burn = tmp_path / "burn" / "optim-1.bpk"
    burn.parent.mkdir()
    res = cli("convert", orig, burn, "--transpose", "proj.weight")
    assert res.returncode == 0, res.stderr
    assert (burn.parent / "scheduler-1.bpk").is_file()
    back = tmp_path / "back" / "checkpoint-5"
    back.mkdir(parents=True)
    res = cli("convert", burn, back / "optimizer.pt")
    assert res.returncode == 0, res.stderr
    assert {p.name for p in back.iterdir()} == {"optimizer.pt", "scheduler.pt", "trainer_state.json"}
    for name in ("model.safetensors", "rng_state.pth"):  # what statekit does not write: the run's own
        shutil.copy(orig / name, back / name)
    # statekit's scheduler.pt: torch's own state for this schedule (weights_only, as Trainer loads it)
    mine = torch.load(back / "scheduler.pt", weights_only=True)
    assert mine == torch.load(orig / "scheduler.pt", weights_only=True)

    want, weights_want = _trainer_run(tmp_path / "resume-a", kind, kwargs, max_steps=25, resume=orig)
    got, weights_got = _trainer_run(tmp_path / "resume-b", kind, kwargs, max_steps=25, resume=back)
    assert len(want) == 20 and len(set(map(tuple, want))) > 5  # 20 updates, on a schedule that moves
    saved = torch.load(orig / "optimizer.pt", weights_only=True)["param_groups"]
    assert want[0] == [g["lr"] for g in saved]  # the resume went on from the checkpoint's position
    assert got == want  # the same lr, bit for bit, at every one of the next 20 updates
    for k in weights_want:  # and the optimizer state was loaded (Trainer skips it without scheduler.pt)
        assert torch.equal(weights_got[k], weights_want[k]), k


# ------------------------------------------------ what burn's built-ins express (against the real runs)


def _hf_ref(kind):
    import json

    return json.loads((HF / "reference.json").read_text())[kind]["lrs_after_step"]


@pytest.mark.parametrize("kind", ["cosine", "linear", "cosine_with_min_lr", "constant", "constant_with_warmup",
                                  "inverse_sqrt"])
def test_the_burn_record_gives_the_trainers_lrs_from_its_position_on(cli, tmp_path, kind):
    """burn's own arithmetic (burn-optim 0.22, statekit.schedule.burn_lr) on the written config and
    counter gives what the real Trainer run used after its checkpoint (to rounding: burn computes its
    cosine in another order)."""
    from statekit.formats.burnpack import BurnpackFile
    from statekit.frameworks import schedule_burn
    from statekit.ops.schedule_carry import SCHEDULE_KEY
    from statekit.schedule import burn_lr, carry

    out = tmp_path / "optim-1.bpk"
    res = cli("convert", HF / kind / "checkpoint-5", out, "--transpose", "proj.weight")
    assert res.returncode == 0, res.stderr
    ss = schedule_burn.read_pack(BurnpackFile(str(tmp_path / "scheduler-1.bpk")))  # as convert reads it back
    meta, sched = json.loads(ss.metadata[SCHEDULE_KEY]), ss.schedule
    form = carry.BurnForm(meta["burn"]["kind"], meta["burn"]["config"], meta["burn"]["position"], meta["offset"])
    if form.kind != "constant":
        node = sched.children[0]
        assert node.kind == f"burn:{form.kind}"
        assert carry.burn_position(form.kind, form.config, next(iter(node.state.values()))) == form.local
    ref = _hf_ref(kind)
    for step in range(5, 10):  # the lr after update `step` is the one position `step` gives
        assert math.isclose(burn_lr.lr(form.kind, form.config, step - form.offset), ref[str(step)][0],
                            rel_tol=1e-12, abs_tol=1e-18), step


@pytest.mark.parametrize("name", ["step", "exponential", "cosine", "linear"])
def test_torch_closed_forms_become_burns_own_schedulers(name):
    """torch 2.13's StepLR / ExponentialLR / CosineAnnealingLR / LinearLR (one group of the fixture's),
    as burn's step / exponential / cosine / linear: the next lrs torch gave, from the written counter."""
    import json

    from statekit.frameworks import schedule_torch
    from statekit.schedule import burn_lr, carry, model

    ref = json.loads((FIXTURES / "schedule" / "torch" / "reference.json").read_text())[name]
    ss = schedule_torch.read_file(str(FIXTURES / "schedule" / "torch" / name / "scheduler.pt"))
    state = dict(ss.schedule.state, base_lrs=ss.schedule.state["base_lrs"][:1])
    form = carry.to_burn(model.build_torch(ref["class"], state))
    counter = carry.burn_counter(form)
    assert carry.burn_position(form.kind, form.config, counter[2]) == form.local == ref["steps"]
    want = [ref["lr_now"][0]] + [lrs[0] for lrs in ref["lr_next"]]
    got = [burn_lr.lr(form.kind, form.config, form.local + k) for k in range(len(want))]
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18) for a, b in zip(got, want, strict=True)), (got, want)


def test_what_burn_cannot_express_is_refused_naming_it(cli, tmp_path):
    # a Trainer folder standing inside its warm-up (a fresh scheduler: position 0 of 3): HF starts at lr 0
    out = tmp_path / "optim-1.bpk"
    res = cli("convert", FIXTURES / "schedule" / "planted" / "fresh-scheduler" / "checkpoint-5", out, "--transpose", "*")
    _refused(res, out, "warm-up", "initial_lr > 0")
    # torch groups of two base lrs: burn's Learner schedules per ParamGroup, which the record does not name
    (tmp_path / "names.txt").write_text("a [3]\nb [2]\n")
    res = cli("convert", FIXTURES / "schedule" / "torch" / "step" / "optimizer.pt", out, "--names",
              tmp_path / "names.txt")
    _refused(res, out, "base lrs")
    # kinds burn has no built-in for
    res = cli("convert", HF / "polynomial" / "checkpoint-5", out, "--transpose", "proj.weight")
    _refused(res, out, "hf:polynomial")
    # a burn target not named as burn's Learner names it
    res = cli("convert", COSINE, tmp_path / "x.bpk", "--transpose", "proj.weight")
    _refused(res, tmp_path / "x.bpk", "optim-N.bpk")
    assert list(tmp_path.iterdir()) == [tmp_path / "names.txt"]


def test_same_framework_copies_the_schedule_files_beside_an_optimizer_pt(cli, tmp_path):
    out = tmp_path / "out" / "optimizer.pt"
    out.parent.mkdir()
    res = cli("convert", COSINE, out)
    assert res.returncode == 0, res.stderr
    for name in ("scheduler.pt", "trainer_state.json"):
        assert (out.parent / name).read_bytes() == (COSINE / name).read_bytes()


@pytest.mark.torch
def test_a_burn_run_that_went_on_comes_back_at_its_new_position_and_steps_in_torch(cli, tmp_path):
    """The burn record stepped 3 more calls (burn's cosine: current_iter + 3): scheduler.pt stands at
    update 8, its lr the real Trainer run's after update 8; LambdaLR.load_state_dict over transformers'
    own λ then steps to the run's lr after update 9."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    optim = tmp_path / "burn" / "optim-1.bpk"
    optim.parent.mkdir()
    assert cli("convert", COSINE, optim, "--transpose", "proj.weight").returncode == 0
    from statekit.formats.burnpack import BurnpackFile

    pack = BurnpackFile(str(optim.parent / "scheduler-1.bpk"))
    scalars = {k: Scalar(v.kind, v.value + 3) for k, v in pack.scalars.items()}
    write_burnpack(str(optim.parent / "scheduler-1.bpk"), [], dict(pack.metadata), scalars)
    out = tmp_path / "back" / "optimizer.pt"
    out.parent.mkdir()
    res = cli("convert", optim, out)
    assert res.returncode == 0, res.stderr
    ref = _hf_ref("cosine")
    sd = torch.load(out.parent / "scheduler.pt", weights_only=True)
    assert sd["last_epoch"] == 8 and sd["_last_lr"] == ref["8"]
    groups = torch.load(out, weights_only=True)["param_groups"]
    assert [g["lr"] for g in groups] == ref["8"] and [g["initial_lr"] for g in groups] == [0.01, 0.01]
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.01)
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=10)
    sched.load_state_dict(sd)
    opt.step()
    sched.step()
    assert sched.get_last_lr() == ref["9"]
    state = json.loads((out.parent / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and math.isclose(state["epoch"], 8 / 3)


# ------------------------------------------------ verify-resume compares the lr sequences too


def test_verify_resume_compares_the_learning_rates_of_both_runs(cli, tmp_path):
    optim = tmp_path / "optim-1.bpk"
    assert cli("convert", COSINE, optim, "--transpose", "proj.weight").returncode == 0
    res = cli("verify-resume", COSINE, optim, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    ref = _hf_ref("cosine")  # the Trainer run's lr after each update 5..9 (its max_steps: 10)
    lrs = report["schedule"]["original"]
    assert lrs[:5] == [ref[str(s)][0] for s in range(5, 10)] and report["schedule"]["same"]
    # the burn record stepped 3 calls on: its schedule no longer continues the original's
    from statekit.formats.burnpack import BurnpackFile

    pack = BurnpackFile(str(tmp_path / "scheduler-1.bpk"))
    write_burnpack(str(tmp_path / "scheduler-1.bpk"), [], dict(pack.metadata),
                   {k: Scalar(v.kind, v.value + 3) for k, v in pack.scalars.items()})
    res = cli("verify-resume", COSINE, optim, "--json")
    assert res.returncode == 1
    report = json.loads(res.stdout)
    assert not report["tracks"] and report["schedule"]["first_difference"]["update"] == 1
    assert report["schedule"]["migrated"][0] == pytest.approx(ref["8"][0], rel=1e-12)


def test_a_dry_run_says_which_schedule_files_it_would_write_and_writes_none(cli, tmp_path):
    out = tmp_path / "optim-3.bpk"
    res = cli("convert", COSINE, out, "--transpose", "proj.weight", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "would write" in res.stdout + res.stderr and "scheduler-3.bpk" in res.stdout + res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.torch
def test_a_group_lr_set_by_hand_is_refused_going_to_burn(cli, tmp_path):
    """burn takes every lr from its scheduler: a Trainer folder whose optimizer.pt groups were set to
    another lr after the scheduler (as doctor's schedule-lr finds) is not carried as if on schedule."""
    torch = pytest.importorskip("torch")
    folder = tmp_path / "checkpoint-5"
    shutil.copytree(COSINE, folder)
    sd = torch.load(folder / "optimizer.pt", weights_only=True)
    for g in sd["param_groups"]:
        g["lr"] = 0.02
    torch.save(sd, folder / "optimizer.pt")
    out = tmp_path / "optim-1.bpk"
    res = cli("convert", folder, out, "--transpose", "proj.weight")
    _refused(res, out, "schedule-lr", "0.02")


@pytest.mark.torch
def test_a_lightning_steplr_goes_to_burn_and_back_and_steps_in_torch(cli, tmp_path):
    """Lightning's StepLR (interval='step': its position is the optimizer steps) as burn's step
    scheduler; back in torch, after the burn run took 2 more calls, the state is torch's own StepLR
    after 6 steps, and StepLR.load_state_dict steps on as torch does."""
    torch = pytest.importorskip("torch")
    ckpt = FIXTURES / "clients" / "lightning" / "epoch=0-step=4.ckpt"
    optim = tmp_path / "burn" / "optim-1.bpk"
    optim.parent.mkdir()
    res = cli("convert", ckpt, optim, "--transpose", "net.fc*.weight", "--no-transpose", "net.embed.weight")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "back" / "optimizer.pt"
    out.parent.mkdir()
    assert cli("convert", optim, out, "--optimizer", "adam").returncode == 0
    saved = torch.load(ckpt, weights_only=False)["lr_schedulers"][0]
    assert torch.load(out.parent / "scheduler.pt", weights_only=True) == saved
    from statekit.formats.burnpack import BurnpackFile

    pack = BurnpackFile(str(optim.parent / "scheduler-1.bpk"))
    write_burnpack(str(optim.parent / "scheduler-1.bpk"), [], dict(pack.metadata),
                   {k: Scalar(v.kind, v.value + 2) for k, v in pack.scalars.items()})
    assert cli("convert", optim, out, "--optimizer", "adam").returncode == 0
    p = torch.nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.Adam([p], lr=saved["base_lrs"][0])
    ref = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=saved["step_size"], gamma=saved["gamma"])
    for _ in range(6):
        ref_opt.step()
        ref.step()
    mine = torch.load(out.parent / "scheduler.pt", weights_only=True)
    assert mine == ref.state_dict()
    assert [g["lr"] for g in torch.load(out, weights_only=True)["param_groups"]] == ref.get_last_lr()
    opt = torch.optim.Adam([p], lr=saved["base_lrs"][0])
    opt.param_groups[0]["initial_lr"] = saved["base_lrs"][0]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=saved["step_size"], gamma=saved["gamma"], last_epoch=0)
    sched.load_state_dict(mine)
    opt.param_groups[0]["lr"] = mine["_last_lr"][0]
    for _ in range(3):
        opt.step(), sched.step(), ref_opt.step(), ref.step()
        assert sched.get_last_lr() == ref.get_last_lr()


def test_a_scheduler_file_statekit_cannot_read_is_not_dropped_either(cli, tmp_path):
    from statekit.formats import torch_pt

    folder = tmp_path / "checkpoint-5"
    shutil.copytree(COSINE, folder)
    torch_pt.save_pt({"not_a_scheduler": 1}, str(folder / "scheduler.pt"))
    out = tmp_path / "optim-1.bpk"
    res = cli("convert", folder, out, "--transpose", "proj.weight")
    _refused(res, out, "LR schedule not read")
    res = cli("convert", folder, out, "--transpose", "proj.weight", "--no-schedule")
    assert res.returncode == 0 and out.exists() and "dropped (--no-schedule)" in res.stdout + res.stderr


def test_remap_carries_or_refuses_the_schedule_as_convert_does(cli, tmp_path):
    model = COSINE / "model.safetensors"
    res = cli("remap", COSINE, "--model", model, "-o", tmp_path / "x.bpk")
    _refused(res, tmp_path / "x.bpk", "hf:cosine", "optim-N.bpk")
    res = cli("remap", COSINE, "--model", model, "-o", tmp_path / "optim-2.bpk")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "scheduler-2.bpk").is_file()
    res = cli("remap", COSINE, "--model", model, "-o", tmp_path / "y.bpk", "--no-schedule")
    assert res.returncode == 0 and "dropped (--no-schedule)" in res.stdout + res.stderr
