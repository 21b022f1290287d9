"""Checkpoints written by HF Trainer, Accelerate and Lightning (fixtures/clients/, made by
scripts/make_client_fixtures.py with the real programs), read and converted by statekit and resumed
with real torch 2.13 against the uninterrupted run's record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

CLIENTS = Path(__file__).resolve().parent.parent / "fixtures" / "clients"
TRAINER = CLIENTS / "trainer" / "checkpoint-3"
REFERENCE = CLIENTS / "trainer-resume.safetensors"
ACCELERATE = CLIENTS / "accelerate"
LIGHTNING = CLIENTS / "lightning" / "epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def record() -> dict:
    with safe_open(str(REFERENCE), "pt") as fh:
        meta = json.loads(fh.metadata()["resume"])
    return {"meta": meta, "tensors": load_file(str(REFERENCE))}


def linear_warmup(warmup: int, total: int):
    """transformers' get_linear_schedule_with_warmup lambda, as written there."""

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))

    return factor


def resume_with_torch(record: dict, optimizer_file) -> tuple[dict, torch.optim.Optimizer]:
    """Trainer's resume in plain torch: AdamW over the checkpoint's parameters in Trainer's groups,
    the saved state loaded by position, LambdaLR rebuilt with last_epoch, the recorded gradients fed."""
    meta, ref = record["meta"], record["tensors"]
    weights = load_file(str(TRAINER / "model.safetensors"))
    params = {n: torch.nn.Parameter(weights[n].clone()) for n in meta["names"]}
    groups = []
    for names, hp in zip(meta["groups"], meta["hyperparams"], strict=True):
        hp = {k: tuple(v) if k == "betas" else v for k, v in hp.items() if k != "initial_lr"}
        groups.append({"params": [params[n] for n in names], **hp})
    opt = torch.optim.AdamW(groups)
    opt.load_state_dict(torch.load(optimizer_file, weights_only=True))
    sched = meta["scheduler"]
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        opt, linear_warmup(sched["num_warmup_steps"], sched["num_training_steps"]), last_epoch=meta["save_at"] - 1)
    for k in range(meta["steps"]):
        assert [g["lr"] for g in opt.param_groups] == meta["lrs"][k]
        for n, p in params.items():
            p.grad = ref[f"grad.{k}.{n}"].clone()
        opt.step()
        lr_sched.step()
        opt.zero_grad()
    return params, opt


def assert_bit_identical(record: dict, params: dict, opt) -> None:
    ref = record["tensors"]
    for n, p in params.items():
        assert torch.equal(p.detach(), ref[f"param.{n}"]), n
        state = opt.state[p]
        assert torch.equal(state["exp_avg"], ref[f"exp_avg.{n}"]), n
        assert torch.equal(state["exp_avg_sq"], ref[f"exp_avg_sq.{n}"]), n
        assert torch.equal(state["step"].reshape(1), ref[f"step.{n}"]), n


def test_the_record_replays_from_trainers_own_files(record):
    """The reference itself: Trainer's optimizer.pt resumed in plain torch reproduces the run."""
    params, opt = resume_with_torch(record, TRAINER / "optimizer.pt")
    assert_bit_identical(record, params, opt)
