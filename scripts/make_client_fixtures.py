"""Write ``fixtures/clients/``: checkpoints saved by the real training programs people use.

    HF_HUB_OFFLINE=1 python scripts/make_client_fixtures.py

Needs torch 2.13 and transformers, accelerate and pytorch-lightning (the test suite does not: it
reads the committed files). Every model is built from a config (no download) and trained for a
few steps on random tokens; each program saves its checkpoint in its own way:

* ``trainer/checkpoint-3/`` — ``transformers.Trainer`` (tiny GPT-2, AdamW in Trainer's two param
  groups: weight decay, then biases and LayerNorm weights; linear warmup ``LambdaLR``):
  ``optimizer.pt``, ``scheduler.pt``, ``model.safetensors``, ``trainer_state.json``, rng state.
* ``trainer-resume.safetensors`` — what the same, uninterrupted run did next: the gradients the
  optimizer saw at steps 4..8 (``grad.<k>.<name>``, after clipping), the parameters and AdamW
  moments after step 8 (``param.<name>``, ``exp_avg.<name>``, ``exp_avg_sq.<name>``), and in its
  metadata (JSON under ``resume``) Trainer's param groups by name, the learning rate of each of
  those steps and the scheduler's setup, so that a test with plain torch can resume from the
  checkpoint and compare bit for bit.
* ``accelerate/`` — ``Accelerator.save_state`` of a small MLP (AdamW, ``StepLR``):
  ``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``.
* ``lightning/epoch=0-step=4.ckpt`` — ``pytorch_lightning.Trainer.save_checkpoint`` of a small
  module (Adam, ``StepLR``): ``state_dict``, ``optimizer_states``, ``lr_schedulers`` and the rest.
* ``names.txt`` — the tiny GPT-2's ``named_parameters()`` names, one a line (docs use it).

Files are small (tens of KB) and differ from run to run only through library versions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "clients"
VOCAB, CTX, EMBD = 40, 16, 16
SAVE_AT, MORE = 3, 5  # checkpoint after step 3; the reference records steps 4..8


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, CTX), generator=torch.Generator().manual_seed(seed))


class TokenData(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ----------------------------------------------------------------------------- HF Trainer


def hf_trainer(out: Path) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    transformers.set_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=EMBD, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    names = [n for n, _ in model.named_parameters()]
    (out / "names.txt").write_text("\n".join(names) + "\n")

    record: dict = {"grads": [], "lrs": []}

    class Recorder(TrainerCallback):
        """Keep what the optimizer sees after the checkpoint: gradients and learning rates."""

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kw):
            if state.global_step >= SAVE_AT:  # global_step counts finished steps
                by_param = {p: n for n, p in model.named_parameters()}
                record["grads"].append({by_param[p]: p.grad.detach().clone()
                                        for g in optimizer.param_groups for p in g["params"]})
                record["lrs"].append([g["lr"] for g in optimizer.param_groups])

        def on_train_end(self, args, state, control, optimizer=None, model=None, lr_scheduler=None, **kw):
            by_param = {p: n for n, p in model.named_parameters()}
            record["groups"] = [[by_param[p] for p in g["params"]] for g in optimizer.param_groups]
            record["hyperparams"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            record["state"] = {by_param[p]: s for p, s in optimizer.state.items()}
            record["scheduler"] = {k: v for k, v in lr_scheduler.state_dict().items() if k != "lr_lambdas"}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=SAVE_AT + MORE, save_strategy="steps", save_steps=SAVE_AT,
            per_device_train_batch_size=4, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2,
            lr_scheduler_type="linear", logging_steps=100, report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, save_total_limit=None,
        )
        trainer = Trainer(model=model, args=args, train_dataset=TokenData(tokens(64, 1)), callbacks=[Recorder()])
        trainer.train()
        ckpt = out / "trainer" / f"checkpoint-{SAVE_AT}"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(Path(tmp) / f"checkpoint-{SAVE_AT}", ckpt)

    tensors = {}
    for k, grads in enumerate(record["grads"]):
        tensors.update({f"grad.{k}.{n}": g.contiguous() for n, g in grads.items()})
    tensors.update({f"param.{n}": p.contiguous() for n, p in record["params"].items()})
    for n, s in record["state"].items():
        tensors[f"exp_avg.{n}"] = s["exp_avg"].contiguous()
        tensors[f"exp_avg_sq.{n}"] = s["exp_avg_sq"].contiguous()
        tensors[f"step.{n}"] = s["step"].reshape(1).contiguous()
    resume = {
        "save_at": SAVE_AT, "steps": len(record["grads"]), "names": names,
        "shapes": {n: list(p.shape) for n, p in record["params"].items()},
        "groups": record["groups"], "hyperparams": record["hyperparams"], "lrs": record["lrs"],
        "scheduler": {"class": "LambdaLR", "lambda": "linear_warmup", "num_warmup_steps": 2,
                      "num_training_steps": SAVE_AT + MORE, **record["scheduler"]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    save_file(tensors, str(out / "trainer-resume.safetensors"), metadata={"resume": json.dumps(resume)})


# ----------------------------------------------------------------------------- Accelerate


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBD)
        self.norm = torch.nn.LayerNorm(EMBD)
        self.fc1 = torch.nn.Linear(EMBD, 2 * EMBD)
        self.fc2 = torch.nn.Linear(2 * EMBD, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(self.embed(ids)))))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def accelerate_state(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(tokens(32, 2), batch_size=4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for i, ids in enumerate(loader):
        loss = lm_loss(model, ids)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if i == 2:
            break
    dest = out / "accelerate"
    shutil.rmtree(dest, ignore_errors=True)
    accelerator.save_state(str(dest))


# ----------------------------------------------------------------------------- Lightning


def lightning_ckpt(out: Path) -> None:
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = MLP()

        def training_step(self, ids, _):
            return lm_loss(self.net, ids)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(tokens(32, 3), batch_size=4))
    dest = out / "lightning"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    trainer.save_checkpoint(str(dest / "epoch=0-step=4.ckpt"))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    hf_trainer(OUT)
    accelerate_state(OUT)
    lightning_ckpt(OUT)
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    main()
