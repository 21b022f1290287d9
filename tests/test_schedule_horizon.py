"""``statekit schedule --max-steps``: a saved schedule re-horizoned (issue 36 item 5), checked in the real
programs. torch 2.13 loads the rewritten files and steps (``fresh``: exactly the lrs of torch building the
scheduler with the new horizon; ``continue``: the lrs statekit states, and the stated formula by hand);
transformers resumes the rewritten Trainer folder with the new max_steps; burn's record is read back."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from conftest import FIXTURES, run_cli

from statekit.formats.burnpack import Scalar, write_burnpack

K = 4  # updates checked after the resume


def _sched_json(*args) -> dict:
    r = run_cli("schedule", *map(str, args), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------------------- torch

def _optimizer(torch):
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    return torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.05}], lr=0.1, momentum=0.9)


def _update(torch, opt):
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def _cases(S):
    """name → (make(opt, horizon) → scheduler, saved horizon, steps taken, new horizon)."""
    return {
        "cosine": (lambda o, n: S.CosineAnnealingLR(o, T_max=n, eta_min=1e-4), 10, 4, 25),
        "linear": (lambda o, n: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=n), 8, 3, 20),
        "polynomial": (lambda o, n: S.PolynomialLR(o, total_iters=n, power=2.0), 8, 3, 13),
        "onecycle": (lambda o, n: S.OneCycleLR(o, max_lr=[0.1, 0.2], total_steps=n), 10, 4, 30),
        "sequential": (lambda o, n: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3),
                                                       S.CosineAnnealingLR(o, T_max=n - 3, eta_min=1e-3)],
                                                   milestones=[3]), 10, 5, 18),
        "sequential-warm": (lambda o, n: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3),
                                                            S.CosineAnnealingLR(o, T_max=n - 3)],
                                                        milestones=[3]), 10, 2, 18),
    }


def _run(torch, make, horizon, steps):
    opt = _optimizer(torch)
    sched = make(opt, horizon)
    for _ in range(steps):
        _update(torch, opt)
        sched.step()
    return opt, sched


def _next(torch, opt, sched, k=K):
    """The groups' lr now (the next update's), then ``get_last_lr()`` after each of k updates + step()."""
    now = [g["lr"] for g in opt.param_groups]
    out = []
    for _ in range(k):
        _update(torch, opt)
        sched.step()
        out.append(list(sched.get_last_lr()))
    return now, out


def _saved(torch, tmp_path, name):
    make, horizon, steps, new = _cases(torch.optim.lr_scheduler)[name]
    opt, sched = _run(torch, make, horizon, steps)
    folder = tmp_path / name
    folder.mkdir()
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    return folder, make, horizon, steps, new, [g["lr"] for g in opt.param_groups]


def _resumed(torch, out, make, horizon):
    """Resumed as training code does: optimizer and scheduler built as before, then both states loaded."""
    opt = _optimizer(torch)
    sched = make(opt, horizon)
    opt.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    sched.load_state_dict(torch.load(out / "scheduler.pt", weights_only=True))
    return opt, sched


@pytest.mark.torch
@pytest.mark.parametrize("name", ["cosine", "linear", "polynomial", "onecycle", "sequential", "sequential-warm"])
def test_fresh_gives_torch_built_with_the_new_horizon_exactly(tmp_path, name):
    torch = pytest.importorskip("torch")
    folder, make, horizon, steps, new, _ = _saved(torch, tmp_path, name)
    out = tmp_path / "out"
    d = _sched_json(folder, "--max-steps", new, "--rule", "fresh", "-o", out)
    assert d["written"] and (folder / "scheduler.pt").read_bytes() != (out / "scheduler.pt").read_bytes()
    want_now, want_next = _next(torch, *_run(torch, make, new, steps))
    got_now, got_next = _next(torch, *_resumed(torch, out, make, horizon))
    assert got_now == want_now and got_next == want_next
    assert d["lr_now"] == want_now and d["lr_next"][:K] == want_next
    if name == "onecycle":  # the momentum OneCycleLR cycles is the fresh run's too
        opt_a, _ = _run(torch, make, new, steps)
        opt_b, _ = _resumed(torch, out, make, horizon)
        assert [g["momentum"] for g in opt_a.param_groups] == [g["momentum"] for g in opt_b.param_groups]


def _formula(name, lr_t, t, n, base=None):
    """The continue rule as docs/schedules.md states it, by hand."""
    if name == "cosine":
        eta = 1e-4
        return lambda s: eta + (lr_t - eta) * (1 + math.cos(math.pi * s / n)) / (1 + math.cos(math.pi * t / n))
    if name == "linear":
        return lambda s: lr_t + (base * 0.1 - lr_t) * (s - t) / (n - t)
    if name == "polynomial":
        return lambda s: lr_t * ((1 - s / n) / (1 - t / n)) ** 2.0
    raise KeyError(name)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["cosine", "linear", "polynomial"])
def test_continue_keeps_the_lr_and_decays_over_the_new_horizon_in_torch(tmp_path, name):
    torch = pytest.importorskip("torch")
    folder, make, horizon, steps, new, saved = _saved(torch, tmp_path, name)
    out = tmp_path / "out"
    d = _sched_json(folder, "--max-steps", new, "-o", out)
    assert sorted(p.name for p in out.iterdir()) == ["optimizer.pt", "scheduler.pt"]
    assert (out / "optimizer.pt").read_bytes() == (folder / "optimizer.pt").read_bytes()  # copied: no lr changes
    now, nxt = _next(torch, *_resumed(torch, out, make, horizon), k=new - steps)
    assert now == saved == d["lr_now"] and d["jump"] is None
    assert nxt[:K] == d["lr_next"][:K]  # what torch does is what statekit states, bit for bit
    for g, (lr_t, base) in enumerate(zip(saved, (0.1, 0.05), strict=True)):
        f = _formula(name, lr_t, steps, new, base)
        for k, lrs in enumerate(nxt, 1):
            assert math.isclose(lrs[g], f(steps + k), rel_tol=1e-9, abs_tol=1e-15), (k, lrs[g], f(steps + k))
    end = {"cosine": 1e-4, "linear": None, "polynomial": 0.0}[name]
    if end is not None:
        assert all(math.isclose(x, end, abs_tol=1e-15) for x in nxt[-1])


@pytest.mark.torch
def test_extend_adds_to_the_saved_horizon(tmp_path):
    torch = pytest.importorskip("torch")
    folder, *_ = _saved(torch, tmp_path, "cosine")
    d = _sched_json(folder, "--extend", 15, "--dry-run")
    assert (d["old_horizon"], d["new_horizon"], d["written"]) == (10, 25, False)
    assert not (tmp_path / "out").exists()


@pytest.mark.torch
@pytest.mark.parametrize(("make", "culprit"), [
    (lambda S, o: S.StepLR(o, step_size=2), "no horizon"),
    (lambda S, o: S.ExponentialLR(o, gamma=0.9), "no horizon"),
    (lambda S, o: S.LinearLR(o, start_factor=0.1, total_iters=5), "rises"),
    (lambda S, o: S.CosineAnnealingLR(o, T_max=30), "not past the saved position"),
])
def test_what_cannot_be_re_horizoned_is_refused_in_one_line(tmp_path, make, culprit):
    torch = pytest.importorskip("torch")
    opt = _optimizer(torch)
    sched = make(torch.optim.lr_scheduler, opt)
    for _ in range(3):
        _update(torch, opt)
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    r = run_cli("schedule", str(tmp_path / "scheduler.pt"), "--max-steps", "2", "-o", str(tmp_path / "out"))
    if culprit != "not past the saved position":
        r = run_cli("schedule", str(tmp_path / "scheduler.pt"), "--max-steps", "50", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and culprit in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.torch
def test_the_input_is_never_the_output(tmp_path):
    pytest.importorskip("torch")
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "schedule" / "torch" / "polynomial", folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    r = run_cli("schedule", str(folder), "--max-steps", "20", "-o", str(folder))
    assert r.returncode == 2 and "never overwritten" in r.stderr
    r = run_cli("schedule", str(folder), "--max-steps", "20", "-o", str(folder / "longer"))
    assert r.returncode == 2 and "inside the input folder" in r.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# ------------------------------------------------------------------------------------------ HF Trainer

class _Tiny:
    """The fixtures' tiny model and data (scripts/make_schedule_fixtures.py), built on demand."""

    @staticmethod
    def model(torch):
        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.proj = torch.nn.Linear(4, 2)

            def forward(self, x, labels=None):
                out = self.proj(x)
                return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

        return Tiny()

    @staticmethod
    def data(torch):
        class Data(torch.utils.data.Dataset):
            def __init__(self, n=12, seed=1):
                g = torch.Generator().manual_seed(seed)
                self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)

            def __len__(self):
                return len(self.x)

            def __getitem__(self, i):
                return {"x": self.x[i], "labels": self.y[i]}

        return Data()


def _trainer_lrs(torch, tmp_path, kind, kwargs, max_steps, resume=None) -> dict[int, list[float]]:
    """The lr each update used (read in on_step_begin) of a Trainer run with ``max_steps``, resumed from
    ``resume`` when given."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    lrs: dict[int, list[float]] = {}

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            lrs[state.global_step + 1] = [float(g["lr"]) for g in optimizer.param_groups]

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=max_steps, save_strategy="no", per_device_train_batch_size=2,
        gradient_accumulation_steps=2, warmup_steps=3, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs,
        learning_rate=0.01, weight_decay=0.1, logging_steps=1, report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=_Tiny.model(torch), args=args, train_dataset=_Tiny.data(torch), callbacks=[Record()])
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return lrs


HF_CASES = {"cosine": {}, "linear": {}, "polynomial": {"power": 2.0, "lr_end": 1e-5},
            "cosine_with_min_lr": {"min_lr_rate": 0.1},
            "warmup_stable_decay": {"num_decay_steps": 4, "min_lr_ratio": 0.1}}  # (the fixtures' arguments)


@pytest.mark.torch
@pytest.mark.hf
@pytest.mark.parametrize("rule", ["continue", "fresh"])
@pytest.mark.parametrize("kind", sorted(HF_CASES))
def test_a_trainer_resumes_the_rewritten_folder_with_the_stated_lrs(tmp_path, kind, rule):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    src = FIXTURES / "schedule" / "hf" / kind / "checkpoint-5"
    out = tmp_path / "checkpoint-5-long"
    new = 16
    d = _sched_json(src, "--max-steps", new, "--rule", rule, "-o", out)
    assert any(f"max_steps={new}" in m for m in d["must"])
    assert json.loads((out / "trainer_state.json").read_text())["max_steps"] == new
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    got = _trainer_lrs(torch, tmp_path, kind, HF_CASES[kind], new, resume=out)
    assert sorted(got) == list(range(6, new + 1))  # updates 6..16 ran
    stated = [d["lr_now"], *d["lr_next"]]
    assert [got[6 + k] for k in range(len(stated))] == stated  # update 6 uses position 5's lr
    saved = json.loads((FIXTURES / "schedule" / "hf" / "reference.json").read_text())[kind]["lrs_after_step"]["5"]
    if rule == "continue":
        assert got[6] == saved  # no jump
    else:  # the lrs of a Trainer started with max_steps=16, from update 6 on
        fresh = _trainer_lrs(torch, tmp_path / "fresh", kind, HF_CASES[kind], new)
        assert all(got[s] == fresh[s] for s in range(6, new + 1))
        assert (got[6] == saved) == (kind == "warmup_stable_decay")  # (its stable phase: λ = 1 for either horizon)


@pytest.mark.torch
def test_an_accelerate_folder_is_rewritten_in_its_own_names(tmp_path):
    torch = pytest.importorskip("torch")
    folder, make, horizon, steps, new, _ = _saved(torch, tmp_path, "cosine")
    for name in ("scheduler", "optimizer"):
        (folder / f"{name}.pt").rename(folder / f"{name}.bin")
    (folder / "model.safetensors").write_bytes(b"weights")
    out = tmp_path / "out"
    d = _sched_json(folder, "--max-steps", new, "--rule", "fresh", "-o", out)
    assert d["files"] == {"scheduler.bin": "scheduler", "optimizer.bin": "optimizer"}
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.bin", "scheduler.bin"]
    opt = _optimizer(torch)
    sched = make(opt, horizon)
    opt.load_state_dict(torch.load(out / "optimizer.bin", weights_only=True))
    sched.load_state_dict(torch.load(out / "scheduler.bin", weights_only=True))
    assert _next(torch, opt, sched) == _next(torch, *_run(torch, make, new, steps))


def test_hf_plateau_is_refused(tmp_path):
    r = run_cli("schedule", str(FIXTURES / "schedule" / "hf" / "reduce_lr_on_plateau" / "checkpoint-5"),
                "--max-steps", "20", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "reduce_lr_on_plateau" in r.stderr and not (tmp_path / "out").exists()


def test_hf_extend_reads_the_horizon_from_trainer_state():
    d = _sched_json(FIXTURES / "schedule" / "hf" / "linear" / "checkpoint-5", "--extend", 6, "--dry-run")
    assert (d["old_horizon"], d["new_horizon"], d["position"]) == (10, 16, 5)
    # continue for linear: lr_t·(16 − s)/(16 − 5) — a straight line from the lr now to 0 at the new horizon
    lr_t = 0.01 * (10 - 5) / (10 - 3)
    assert d["lr_now"] == [lr_t, lr_t]
    for k, lrs in enumerate(d["lr_next"], 1):
        assert all(math.isclose(x, lr_t * (16 - 5 - k) / (16 - 5), rel_tol=1e-12) for x in lrs)


# ------------------------------------------------------------------------------------------------ burn

def test_burn_record_is_rewritten_in_its_layout_and_read_back(tmp_path):
    src = tmp_path / "run"
    src.mkdir()
    write_burnpack(str(src / "scheduler-3.bpk"), [], {}, {"0.current_iter": Scalar("UInt", 20)})
    (src / "model-3.bpk").write_bytes(b"model")
    out = tmp_path / "out"
    d = _sched_json(src, "--max-steps", 200, "--rule", "fresh", "-o", out)
    assert d["kind"] == "burn:groups" and d["position"] == 21 and d["lr_now"] is None
    assert any("num_iters = 200" in m for m in d["must"])
    assert (out / "model-3.bpk").read_bytes() == b"model"
    r = run_cli("inspect", str(out / "scheduler-3.bpk"), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["schedule"]
    assert s["position"] == 21 and s["children"][0]["kind"] == "burn:cosine"


def test_burn_continue_and_linear_are_refused(tmp_path):
    write_burnpack(str(tmp_path / "scheduler-1.bpk"), [], {}, {"0.current_iter": Scalar("UInt", 4)})
    r = run_cli("schedule", str(tmp_path / "scheduler-1.bpk"), "--max-steps", "50", "-o", str(tmp_path / "o"))
    assert r.returncode == 1 and "saves no scheduler config" in r.stderr
    write_burnpack(str(tmp_path / "scheduler-2.bpk"), [], {}, {"0.remaining_iters": Scalar("UInt", 4)})
    r = run_cli("schedule", str(tmp_path / "scheduler-2.bpk"), "--max-steps", "50", "--rule", "fresh",
                "-o", str(tmp_path / "o"))
    assert r.returncode == 1 and "remaining_iters" in r.stderr and not (tmp_path / "o").exists()


def test_burn_linear_is_rewritten_given_the_horizon_it_was_built_with(tmp_path):
    # burn's LinearLrScheduler after n calls holds remaining_iters = N + 1 − n (N = num_iters; 11 at first):
    # built with N = 10 and called 4 times, it holds 7; with num_iters 30 it would hold 27 after 4 calls
    write_burnpack(str(tmp_path / "scheduler-2.bpk"), [], {}, {"0.remaining_iters": Scalar("UInt", 7)})
    out = tmp_path / "out"
    d = _sched_json(tmp_path / "scheduler-2.bpk", "--extend", 20, "--horizon-was", 10, "--rule", "fresh", "-o", out)
    assert (d["position"], d["old_horizon"], d["new_horizon"]) == (4, 10, 30)
    from statekit.formats.burnpack import BurnpackFile

    assert BurnpackFile(str(out / "scheduler-2.bpk")).scalars == {"0.remaining_iters": Scalar("UInt", 27)}
    r = run_cli("schedule", str(tmp_path / "scheduler-2.bpk"), "--max-steps", "3", "--horizon-was", "10",
                "--rule", "fresh", "-o", str(tmp_path / "o2"))
    assert r.returncode == 1 and "not past the saved position 4" in r.stderr


@pytest.mark.torch
def test_a_failed_write_leaves_no_output(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from statekit.errors import FormatError
    from statekit.frameworks import schedule_write

    def broken(src, dst, keys):
        with open(dst, "wb") as fh:
            fh.write(b"half")
        raise FormatError("disk full (planted)", dst)

    monkeypatch.setattr(schedule_write, "write_torch_optimizer_group_lrs", broken)
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "schedule" / "torch" / "polynomial", folder)
    r = run_cli("schedule", str(folder), "--max-steps", "20", "--rule", "fresh", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "disk full (planted)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.torch
def test_the_written_files_are_read_back_before_they_are_kept(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from statekit.frameworks import schedule_write

    real = schedule_write.write_torch_scheduler

    def off_by_one(path, state):  # a writer that gets the horizon wrong
        return real(path, dict(state, total_iters=state["total_iters"] + 1))

    monkeypatch.setattr(schedule_write, "write_torch_scheduler", off_by_one)
    r = run_cli("schedule", str(FIXTURES / "schedule" / "torch" / "polynomial"), "--max-steps", "20",
                "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "read back" in r.stderr and "nothing written" in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.torch
def test_a_trainer_folder_with_its_own_torch_scheduler_is_re_horizoned_as_torch(tmp_path):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "checkpoint-5"
    shutil.copytree(FIXTURES / "schedule" / "hf" / "linear" / "checkpoint-5", folder)
    make, horizon, steps, new = _cases(torch.optim.lr_scheduler)["cosine"]
    opt, sched = _run(torch, make, horizon, steps)
    torch.save(sched.state_dict(), folder / "scheduler.pt")  # a scheduler passed to Trainer(optimizers=...)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    out = tmp_path / "out"
    d = _sched_json(folder, "--max-steps", new, "--rule", "fresh", "-o", out)
    assert d["kind"] == "torch:CosineAnnealingLR" and any("passed to the Trainer" in n for n in d["notes"])
    assert json.loads((out / "trainer_state.json").read_text())["max_steps"] == new
    assert any(f"max_steps={new}" in m for m in d["must"])
    assert _next(torch, *_resumed(torch, out, make, horizon)) == _next(torch, *_run(torch, make, new, steps))
