"""The resume guard (statekit.guard) on real runs: plain torch, DCP on CPU gloo, HF Trainer, Accelerate, Lightning.

Each broken resume is reproduced the way the reports describe it (user-demand-2026.md rows 1, 5, 7):
a fresh optimizer after a load that filled nothing, ``dcp.load`` given a fresh optimizer's state dict
(no state tensors to fill), a Trainer checkpoint whose ``optimizer.pt`` is gone or replaced, param
groups built in another order (torch loads by position without a word), a weights-only resume that
restored the moments. The guard must name the parameters; a correct resume must pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from conftest import ROOT

torch = pytest.importorskip("torch")

from statekit import guard  # noqa: E402
from statekit.errors import StatekitError, UsageError  # noqa: E402

pytestmark = pytest.mark.torch
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def build(seed: int = 0, groups: str = "one"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    named = dict(model.named_parameters())
    if groups == "one":
        params = model.parameters()
    else:  # decay / no-decay, as Trainer builds them; "swapped": the other order (equal sizes: torch accepts it)
        decay = {"params": [named["0.weight"], named["2.weight"]], "weight_decay": 0.1}
        no_decay = {"params": [named["0.bias"], named["2.bias"]], "weight_decay": 0.0}
        params = [decay, no_decay] if groups == "decay-first" else [no_decay, decay]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps: int = 5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.fixture
def saved(tmp_path):
    """A run saved as plain torch does: model, optimizer and scheduler state dicts, and the fingerprint."""
    model, opt, sched = build()
    train(model, opt, sched)
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
    written = guard.save_fingerprint(opt, ckpt, scheduler=sched, model=model)
    assert written == f"{ckpt}.{guard.FILE}"
    return ckpt


def resumed(ckpt, *, optimizer: bool = True, scheduler: bool = True, groups: str = "one"):
    model, opt, sched = build(seed=7, groups=groups)  # another process: other initial weights
    sd = torch.load(ckpt, weights_only=True)
    model.load_state_dict(sd["model"])
    if optimizer:
        opt.load_state_dict(sd["optim"])
    if scheduler:
        sched.load_state_dict(sd["sched"])
    return model, opt, sched


def kinds(exc) -> dict[str, list[str]]:
    return {p.kind: p.params for p in exc.problems}


# ----------------------------------------------------------------------------- plain torch


def test_a_correct_resume_passes(saved):
    model, opt, sched = resumed(saved)
    report = guard.check_resume(opt, saved, scheduler=sched, model=model)
    assert report.ok and report.checked == 4


def test_a_fresh_optimizer_after_a_load_that_filled_nothing_is_named(saved):
    model, opt, sched = resumed(saved, optimizer=False, scheduler=False)
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt, saved, scheduler=sched, model=model)
    assert isinstance(e.value, StatekitError) and e.value.path == f"{saved}.{guard.FILE}"
    found = kinds(e.value)
    assert found["empty"] == NAMES
    assert "last_epoch 5 → 0" in str(e.value)  # the scheduler restarted too
    assert "group 0 lr 0.0025 → 0.01" in str(e.value)  # 1e-2 halved twice by StepLR at save
    assert "\n" not in str(e.value)


def test_a_changed_param_group_order_is_named(tmp_path):
    """torchtitan PR#3356's shape of bug: groups of equal sizes in another order load by position, silently."""
    model, opt, sched = build(groups="decay-first")
    train(model, opt, sched)
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
    guard.save_fingerprint(opt, ckpt, scheduler=sched, model=model)
    model2, opt2, sched2 = resumed(ckpt, groups="no-decay-first")  # torch raises nothing
    assert opt2.state[model2[0].bias]["exp_avg"].shape == (8, 4)  # the weight's moments on the bias
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt2, ckpt, scheduler=sched2, model=model2)
    found = kinds(e.value)
    assert sorted(found["moved"]) == sorted(["0.bias ← 0.weight", "2.bias ← 2.weight", "0.weight ← 0.bias",
                                             "2.weight ← 2.bias"])
    assert "param groups reordered: live groups [0, 1] are the saved groups [1, 0]" in str(e.value)


def test_zero_moments_and_a_reset_step_from_a_dummy_step_template(saved):
    """A load template built by one step with zero gradients (UniRL PR#440): step 1, zero moments, not filled."""
    model, opt, sched = resumed(saved, optimizer=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt, saved, scheduler=sched, model=model, allow=("hyper",))
    found = kinds(e.value)
    assert sorted(found["zero"]) == sorted(f"{n}.{f}" for n in NAMES for f in ("exp_avg", "exp_avg_sq"))
    assert found["step"] == [f"{n} (5 → 1)" for n in NAMES]


def test_weights_only_intent_refuses_restored_moments(saved):
    model, opt, sched = resumed(saved)
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt, saved, model=model, expect="fresh")
    assert kinds(e.value) == {"restored": NAMES} and "4 of them exactly the state saved" in str(e.value)
    model, opt, sched = resumed(saved, optimizer=False, scheduler=False)
    assert guard.check_resume(opt, saved, model=model, expect="fresh").ok


def test_warn_instead_of_raise_and_allowed_kinds(saved):
    model, opt, sched = resumed(saved)
    for g in opt.param_groups:
        g["lr"] = 1e-4  # a deliberate new lr
    with pytest.warns(guard.ResumeWarning, match="group 0 lr 0.0025 → 0.0001"):
        report = guard.check_resume(opt, saved, scheduler=sched, model=model, on_problem="warn")
    assert [p.kind for p in report.problems] == ["hyper"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = guard.check_resume(opt, saved, scheduler=sched, model=model, allow=["hyper"])
    assert report.ok and [p.kind for p in report.allowed] == ["hyper"]


def test_without_names_positions_still_catch_lost_state(saved):
    model, opt, sched = resumed(saved, optimizer=False)
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt, saved, allow=("hyper",))  # saved with names, checked without: by position
    assert kinds(e.value)["empty"] == ["#0", "#1", "#2", "#3"]


def test_missing_or_foreign_fingerprint_and_bad_options(tmp_path, saved):
    model, opt, _ = build()
    with pytest.raises(guard.ResumeError, match="no fingerprint"):
        guard.check_resume(opt, tmp_path / "nothing.pt")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(guard.ResumeError, match="not a statekit guard fingerprint"):
        guard.check_resume(opt, tmp_path / "other.json")
    with pytest.raises(UsageError):
        guard.check_resume(opt, saved, expect="weights")
    with pytest.raises(UsageError):
        guard.check_resume(opt, saved, allow=("nope",))
    with pytest.raises(UsageError):
        guard.check_resume(opt, saved, on_problem="ignore")


def test_fingerprint_is_small_and_keyed_by_name(saved):
    data = json.loads(open(f"{saved}.{guard.FILE}").read())
    (opt,) = data["optimizers"]
    assert [p["name"] for p in opt["params"]] == NAMES and opt["class"] == "AdamW"
    st = opt["params"][0]["state"]
    assert st["step"] == 5.0 and set(st["fields"]) == {"exp_avg", "exp_avg_sq"}
    assert st["fields"]["exp_avg"]["sampled"] == guard.SAMPLE and st["fields"]["exp_avg"]["shape"] == [8, 4]
    assert data["schedulers"][0]["state"]["last_epoch"] == 5
    assert os.path.getsize(f"{saved}.{guard.FILE}") < 8000


def test_importing_statekit_or_the_guard_imports_no_torch():
    code = ("import sys, statekit, statekit.guard; import statekit.cli; "
            "print('torch' in sys.modules, 'statekit.guard' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    done = subprocess.run([sys.executable, "-c", "import sys, statekit.cli; print('statekit.guard' in sys.modules)"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False"


# ----------------------------------------------------------------------------- DCP on CPU gloo, one process


@pytest.fixture
def gloo(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dcp_load_into_a_fresh_optimizer_fills_nothing_and_is_named(tmp_path, gloo):
    """KempnerForge PR#115: AdamW builds its state lazily, so dcp.load finds no moment tensors to fill."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt, _ = build()
    train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), steps=3)
    ckpt = tmp_path / "step-3"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    guard.save_fingerprint(opt, ckpt, model=model)
    assert (ckpt / guard.FILE).exists() and (ckpt / ".metadata").exists()
    # the bug: a fresh optimizer's state_dict() as the load template
    model2, opt2, _ = build(seed=7)
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])  # no error anywhere
    assert not opt2.state
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt2, ckpt, model=model2)
    assert kinds(e.value) == {"empty": NAMES}
    # the fix: a template with the state tensors (get_optimizer_state_dict initialises them)
    model3, opt3, _ = build(seed=7)
    sd = {"model": get_model_state_dict(model3), "optim": get_optimizer_state_dict(model3, opt3)}
    dcp.load(sd, checkpoint_id=ckpt)
    model3.load_state_dict(sd["model"])
    set_optimizer_state_dict(model3, opt3, sd["optim"])
    assert guard.check_resume(opt3, ckpt, model=model3).ok


# ----------------------------------------------------------------------------- HF Trainer


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _trainer(out, max_steps: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from statekit.guard.hf import ResumeGuardCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True)
    callback = ResumeGuardCallback()
    return Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[callback]), callback


@pytest.mark.hf
def test_hf_trainer_resume_with_the_optimizer_file_removed_or_replaced(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    trainer, _ = _trainer(out)
    trainer.train()
    ckpt = out / "checkpoint-2"
    assert (ckpt / guard.FILE).exists() and (ckpt / "optimizer.pt").exists()
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    trainer, callback = _trainer(out)  # a correct resume
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert callback.report is not None and callback.report.ok and callback.report.checked == len(names)
    # optimizer.pt gone: the Trainer skips the optimizer and the scheduler without a word
    os.remove(broken / "optimizer.pt")
    trainer, callback = _trainer(out)
    callback.checkpoint = str(broken)
    with pytest.raises(guard.ResumeError) as e:
        trainer.train(resume_from_checkpoint=str(broken))
    assert sorted(kinds(e.value)["empty"]) == sorted(names)
    assert "scheduler" in kinds(e.value)
    # optimizer.pt replaced by the one of checkpoint-4: loads, two steps ahead
    shutil.copy(out / "checkpoint-4" / "optimizer.pt", broken / "optimizer.pt")
    trainer, callback = _trainer(out)
    callback.checkpoint = str(broken)
    with pytest.raises(guard.ResumeError) as e:
        trainer.train(resume_from_checkpoint=str(broken))
    steps = kinds(e.value)["step"]
    assert sorted(s.split(" ")[0] for s in steps) == sorted(names) and all(s.endswith("(2 → 4)") for s in steps)


# ----------------------------------------------------------------------------- Accelerate


def _accelerated(groups: str):
    from accelerate import Accelerator

    from statekit.guard.accelerate import guard_accelerator

    acc = Accelerator(cpu=True)
    model, opt, sched = build(groups=groups)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, guard_accelerator(acc), model, opt, sched


def test_accelerate_save_and_load_state_hooks(tmp_path):
    pytest.importorskip("accelerate")
    acc, handle, model, opt, sched = _accelerated("decay-first")
    train(model, opt, sched, steps=3)
    acc.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / guard.FILE).exists()
    handle.remove()
    acc, handle, model, opt, sched = _accelerated("decay-first")
    acc.load_state(str(tmp_path / "ckpt"))
    assert handle.report.ok and handle.report.checked == 4
    handle.remove()
    acc, handle, model, opt, sched = _accelerated("no-decay-first")
    with pytest.raises(guard.ResumeError) as e:
        acc.load_state(str(tmp_path / "ckpt"))
    assert sorted(kinds(e.value)["moved"]) == sorted(["0.bias ← 0.weight", "2.bias ← 2.weight", "0.weight ← 0.bias",
                                                      "2.weight ← 2.bias"])
    handle.remove()
    assert acc.load_state.__func__ is type(acc).load_state  # remove() undid the wrapper


# ----------------------------------------------------------------------------- Lightning


@pytest.mark.lightning
def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from statekit.guard.lightning import ResumeGuard

    class Module(pl.LightningModule):
        def __init__(self, groups="decay-first"):
            super().__init__()
            self.net, _, _ = build(groups="one")
            self.groups = groups

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            n = dict(self.net.named_parameters())
            decay = {"params": [n["0.weight"], n["2.weight"]], "weight_decay": 0.1}
            no_decay = {"params": [n["0.bias"], n["2.bias"]], "weight_decay": 0.0}
            opt = torch.optim.AdamW([decay, no_decay] if self.groups == "decay-first" else [no_decay, decay], lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=4)

    def fit(module, steps, ckpt=None):
        cb = ResumeGuard()
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, callbacks=[cb],
                             enable_checkpointing=False)
        trainer.fit(module, data, ckpt_path=ckpt)
        return trainer, cb

    trainer, _ = fit(Module(), 3)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    assert "statekit_guard" in saved
    _, cb = fit(Module(), 5, tmp_path / "a.ckpt")
    assert cb.report is not None and cb.report.ok
    with pytest.raises(guard.ResumeError) as e:
        fit(Module(groups="no-decay-first"), 5, tmp_path / "a.ckpt")
    assert "net.0.bias ← net.0.weight" in kinds(e.value)["moved"]
    # optimizer states emptied (a restore that is a no-op): Lightning loads it without a word
    saved["optimizer_states"][0]["state"] = {}
    torch.save(saved, tmp_path / "b.ckpt")
    with pytest.raises(guard.ResumeError) as e:
        fit(Module(), 5, tmp_path / "b.ckpt")
    assert sorted(kinds(e.value)["empty"]) == sorted(f"net.{n}" for n in NAMES)


def test_state_landing_on_a_parameter_that_had_none_is_named(tmp_path):
    """A frozen layer (no state at save) listed first in the new run: torch hands it the next one's state."""
    model, _, _ = build()
    first, second = model[0], model[2]
    opt = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2)
    first.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(opt.state) == 2
    ckpt = tmp_path / "ckpt.pt"
    torch.save(opt.state_dict(), ckpt)
    guard.save_fingerprint(opt, ckpt, model=model)
    opt2 = torch.optim.AdamW([*second.parameters(), *first.parameters()], lr=1e-2)  # another order, same sizes
    opt2.load_state_dict(torch.load(ckpt, weights_only=True))
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt2, ckpt, model=model)
    found = kinds(e.value)
    assert sorted(found["empty"]) == ["2.bias", "2.weight"]
    assert sorted(found["moved"]) == ["0.bias ← 2.bias", "0.weight ← 2.weight"], found


def test_moments_cast_by_a_model_in_another_dtype_are_named(saved):
    """torch's load_state_dict casts floating state to each parameter's dtype: a bf16 resume of a float32 run."""
    model, opt, sched = build(seed=7)
    sd = torch.load(saved, weights_only=True)
    model.load_state_dict(sd["model"])
    model.to(torch.bfloat16)
    opt.load_state_dict(sd["optim"])
    sched.load_state_dict(sd["sched"])
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(guard.ResumeError) as e:
        guard.check_resume(opt, saved, scheduler=sched, model=model)
    assert sorted(kinds(e.value)["values"]) == sorted(f"{n}.{f} as bfloat16 (saved float32)" for n in NAMES
                                                      for f in ("exp_avg", "exp_avg_sq"))
