#!/usr/bin/env python3
"""Write ``fixtures/schedule/``: LR schedulers saved by the real programs, with what they do next.

    python scripts/make_schedule_fixtures.py            # torch 2.13 and transformers 5.x

The test suite does not run this: it reads the committed files. Nothing here is computed by
statekit; every reference value is what torch or transformers itself produced.

* ``torch/<case>/scheduler.pt`` + ``optimizer.pt``: one ``torch.optim.lr_scheduler`` class (every
  class of torch 2.13, some twice to reach their branches) driving SGD with momentum over two
  param groups (lr 0.1 and 0.05), stepped ``steps`` times (``optimizer.step()`` then
  ``scheduler.step()``) and saved as training code saves them. ``torch/reference.json`` holds per
  case the class, the steps, ``lr_now`` (``get_last_lr()`` as saved: the lr the next update uses)
  and ``lr_next``: ``get_last_lr()`` after each of ``NEXT`` more ``step()`` calls (ReduceLROnPlateau:
  ``lr_next_better`` / ``lr_next_worse`` after one step with an improving / a worse metric).
* ``hf/<type>/checkpoint-5/``: a ``transformers.Trainer`` run per ``SchedulerType`` on a tiny
  linear model on CPU: 10 updates (``max_steps``), 3 warm-up steps, gradient accumulation 2, 12
  samples in batches of 2 (3 updates per epoch), saved at update 5 (mid-epoch), less
  ``rng_state.pth``. ``hf/reference.json``: per type the arguments and, for every update s, the
  param-group lrs after it (the lrs update s+1 uses), read from the live optimizer in
  ``on_step_end``.
* ``planted/``: doctor's cases, made from real runs and then broken the way users break them:
  ``lr-edited`` (a group lr set by hand after the scheduler), ``no-initial-lr`` (``initial_lr``
  removed from the saved groups), ``fresh-scheduler`` (a scheduler.pt of a new scheduler beside a
  stepped optimizer: the warm-up runs again), ``fp16-skipped`` (a Trainer folder whose
  global_step counts 2 updates the loss scaler skipped, with ``scaler.pt``).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch.optim import lr_scheduler as S

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "schedule"
NEXT = 3
LRS = (0.1, 0.05)


def optimizer() -> torch.optim.SGD:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    return torch.optim.SGD([{"params": [a], "lr": LRS[0]}, {"params": [b], "lr": LRS[1]}], lr=LRS[0], momentum=0.9)


def update(opt) -> None:
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def torch_cases() -> dict:
    """name → (make(opt) → scheduler, steps, plateau metrics or None)."""
    return {
        "lambda": (lambda o: S.LambdaLR(o, lambda e: 0.95 ** e), 4, None),
        "multiplicative": (lambda o: S.MultiplicativeLR(o, lambda e: 0.9), 4, None),
        "step": (lambda o: S.StepLR(o, step_size=3, gamma=0.5), 5, None),
        "multistep": (lambda o: S.MultiStepLR(o, milestones=[2, 6, 6], gamma=0.5), 5, None),
        "constant": (lambda o: S.ConstantLR(o, factor=0.5, total_iters=4), 3, None),
        "linear": (lambda o: S.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=6), 3, None),
        "exponential": (lambda o: S.ExponentialLR(o, gamma=0.9), 4, None),
        "polynomial": (lambda o: S.PolynomialLR(o, total_iters=8, power=2.0), 3, None),
        "cosine": (lambda o: S.CosineAnnealingLR(o, T_max=5, eta_min=1e-4), 5, None),
        "cosine-past": (lambda o: S.CosineAnnealingLR(o, T_max=5, eta_min=1e-4), 8, None),
        "warm-restarts": (lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-5), 4, None),
        "cyclic": (lambda o: S.CyclicLR(o, base_lr=[0.01, 0.02], max_lr=[0.1, 0.2], step_size_up=3,
                                        mode="triangular2"), 7, None),
        "cyclic-exp": (lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, step_size_down=3,
                                            mode="exp_range", gamma=0.97), 6, None),
        "onecycle": (lambda o: S.OneCycleLR(o, max_lr=[0.1, 0.2], total_steps=10), 4, None),
        "onecycle-3phase": (lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=12, three_phase=True,
                                                   anneal_strategy="linear"), 6, None),
        "sequential": (lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3),
                                                    S.ExponentialLR(o, gamma=0.9)], milestones=[3]), 2, None),
        "sequential-late": (lambda o: S.SequentialLR(o, [S.ConstantLR(o, factor=0.5, total_iters=2),
                                                         S.CosineAnnealingLR(o, T_max=6)], milestones=[2]), 5, None),
        "chained": (lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3),
                                                  S.ExponentialLR(o, gamma=0.9)]), 2, None),
        "plateau": (lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5, min_lr=[0.0, 0.03]), 4,
                    [1.0, 0.9, 0.95, 0.97]),
    }


def write_torch() -> None:
    base = OUT / "torch"
    shutil.rmtree(base, ignore_errors=True)
    reference = {}
    for name, (make, steps, metrics) in torch_cases().items():
        opt = optimizer()
        sched = make(opt)
        for i in range(steps):
            update(opt)
            sched.step(metrics[i]) if metrics else sched.step()
        folder = base / name
        folder.mkdir(parents=True)
        torch.save(sched.state_dict(), folder / "scheduler.pt")
        torch.save(opt.state_dict(), folder / "optimizer.pt")
        entry = {"class": type(sched).__name__, "steps": steps, "lr_now": list(sched.get_last_lr())}
        if metrics:
            for word, metric in (("better", 0.1), ("worse", 5.0)):
                o2, s2 = copy.deepcopy((opt, sched))
                update(o2)
                s2.step(metric)
                entry[f"lr_next_{word}"] = list(s2.get_last_lr())
        else:
            entry["lr_next"] = []
            for _ in range(NEXT):
                update(opt)
                sched.step()
                entry["lr_next"].append(list(sched.get_last_lr()))
        reference[name] = entry
    (base / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


# ---------------------------------------------------------------------------------- HF Trainer

HF_TYPES = {
    "linear": {}, "cosine": {}, "cosine_with_restarts": {"num_cycles": 2},
    "polynomial": {"power": 2.0, "lr_end": 1e-5}, "constant": {}, "constant_with_warmup": {},
    "inverse_sqrt": {}, "reduce_lr_on_plateau": {"patience": 0, "factor": 0.5},
    "cosine_with_min_lr": {"min_lr_rate": 0.1},
    "warmup_stable_decay": {"num_decay_steps": 4, "min_lr_ratio": 0.1},
}
MAX_STEPS, WARMUP, GA, SAVE = 10, 3, 2, 5


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        out = self.proj(x)
        loss = torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n=12, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def trainer_run(kind: str, kwargs: dict, dest: Path, **extra) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    lrs: dict[int, list[float]] = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            lrs[state.global_step] = [float(g["lr"]) for g in optimizer.param_groups]

    plateau = kind == "reduce_lr_on_plateau"
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE, per_device_train_batch_size=2,
            gradient_accumulation_steps=GA, warmup_steps=WARMUP, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs,
            learning_rate=0.01, weight_decay=0.1, logging_steps=1, report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
            eval_strategy="steps" if plateau else "no", eval_steps=1 if plateau else None,
            metric_for_best_model="loss" if plateau else None, per_device_eval_batch_size=4, **extra)
        trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(), eval_dataset=Data(4, 2) if plateau else None,
                          callbacks=[Record()])
        trainer.train()
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copytree(Path(tmp) / f"checkpoint-{SAVE}", dest / f"checkpoint-{SAVE}",
                        ignore=shutil.ignore_patterns("rng_state*.pth"))
    return {"kwargs": kwargs, "max_steps": MAX_STEPS, "warmup_steps": WARMUP, "gradient_accumulation_steps": GA,
            "saved_at": SAVE, "lrs_after_step": {str(k): v for k, v in sorted(lrs.items())}}


def write_hf() -> None:
    import transformers

    base = OUT / "hf"
    shutil.rmtree(base, ignore_errors=True)
    reference = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    for kind, kwargs in HF_TYPES.items():
        reference[kind] = trainer_run(kind, kwargs, base / kind)
    (base / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


# ---------------------------------------------------------------------------------- planted cases


def write_planted() -> None:
    base = OUT / "planted"
    shutil.rmtree(base, ignore_errors=True)
    # a hand-set lr after the scheduler (a recursive scheduler then scales every later lr by its error)
    opt = optimizer()
    sched = S.ExponentialLR(opt, gamma=0.9)
    for _ in range(3):
        update(opt)
        sched.step()
    for g in opt.param_groups:
        g["lr"] = 0.02
    folder = base / "lr-edited"
    folder.mkdir(parents=True)
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    # initial_lr dropped from the saved groups (an optimizer restored through DCP, pytorch#140900)
    opt = optimizer()
    sched = S.StepLR(opt, step_size=2)
    for _ in range(3):
        update(opt)
        sched.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["initial_lr"]
    folder = base / "no-initial-lr"
    folder.mkdir(parents=True)
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save(sd, folder / "optimizer.pt")
    # a Trainer folder whose scheduler.pt is a new scheduler's: the warm-up runs again
    src = OUT / "hf" / "linear" / f"checkpoint-{SAVE}"
    folder = base / "fresh-scheduler" / f"checkpoint-{SAVE}"
    shutil.copytree(src, folder)
    opt = optimizer()
    fresh = S.LambdaLR(opt, lambda e: 1.0)
    sd = fresh.state_dict()
    saved = torch.load(src / "scheduler.pt", weights_only=True)
    sd["base_lrs"], sd["_last_lr"] = saved["base_lrs"], [0.0 for _ in saved["base_lrs"]]
    sd["lr_lambdas"] = [{} for _ in saved["base_lrs"]]
    torch.save(sd, folder / "scheduler.pt")
    # fp16: 2 updates skipped by the loss scaler (global_step counts them, scheduler and optimizer do not)
    folder = base / "fp16-skipped" / f"checkpoint-{SAVE + 2}"
    shutil.copytree(src, folder)
    state = json.loads((src / "trainer_state.json").read_text())
    state["global_step"] = SAVE + 2
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    torch.save({"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                "_growth_tracker": 3}, folder / "scaler.pt")


def main() -> None:
    write_torch()
    write_hf()
    write_planted()
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    main()
