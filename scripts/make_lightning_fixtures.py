"""Lightning checkpoints with an LR scheduler (interval ``step`` and ``epoch``), and the lrs Lightning's
own resume uses, for statekit's tests.

Run with the interpreter of a venv holding lightning (statekit's test suite never imports it)::

    python -m venv --system-site-packages /work/venvs/sched-sources-lt   # torch 2.13 from the system
    /work/venvs/sched-sources-lt/bin/pip install lightning                # 2.6.6 when written
    /work/venvs/sched-sources-lt/bin/python scripts/make_lightning_fixtures.py --out fixtures/schedule/lightning

Per case (``<out>/<case>/``): a tiny ``LightningModule`` (one ``nn.Linear``, AdamW) whose
``configure_optimizers`` returns a torch scheduler with Lightning's ``interval``; ``Trainer.fit`` on
random data (4 batches an epoch) with a ``ModelCheckpoint`` saving the ``.ckpt`` files kept here
(mid-epoch every 3 steps for ``step``; at each epoch's end for ``epoch``). Then every ``.ckpt`` is
resumed by Lightning itself (``Trainer.fit(ckpt_path=...)`` with more epochs) and the lr per group
of the first updates after the resume is recorded (``on_before_optimizer_step``: the group lrs the
update is about to use) into ``reference.json``: ``{ckpt: {"lrs": [[lr per group] per update]}}``.
Nothing in it is computed by statekit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

CASES = {
    # name: (scheduler, interval, ModelCheckpoint kwargs, epochs)
    "step_cosine": ("cosine", "step", {"every_n_train_steps": 3}, 2),
    "epoch_exponential": ("exponential", "epoch", {"every_n_epochs": 1}, 2),
    "epoch_multistep": ("multistep", "epoch", {"every_n_epochs": 1}, 3),
    "epoch_midsave": ("exponential", "epoch", {"every_n_train_steps": 3}, 2),
}


def _module(kind: str, interval: str, record: list):
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW([{"params": [self.net.weight], "lr": 0.01},
                                     {"params": [self.net.bias], "lr": 0.02, "weight_decay": 0.0}])
            if kind == "cosine":
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.001)
            elif kind == "exponential":
                sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
            else:
                sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 2, 4], gamma=0.3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}

        def on_before_optimizer_step(self, optimizer):
            record.append([g["lr"] for g in optimizer.param_groups])

    return Tiny()


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def _trainer(epochs, callbacks, root):
    import lightning.pytorch as pl

    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, default_root_dir=root)


def run(name, out):
    import lightning.pytorch as pl
    import torch

    kind, interval, every, epochs = CASES[name]
    dest = os.path.join(out, name)
    shutil.rmtree(dest, ignore_errors=True)
    torch.manual_seed(0)
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=dest, save_top_k=-1, **every)
    seen: list = []
    _trainer(epochs, [ckpt_cb], dest).fit(_module(kind, interval, seen), _data())
    ref = {"versions": {"lightning": pl.__version__, "torch": torch.__version__}, "interval": interval,
           "run": seen, "resumed": {}}
    for ckpt in sorted(f for f in os.listdir(dest) if f.endswith(".ckpt")):
        after: list = []
        torch.manual_seed(0)
        _trainer(epochs + 2, [], os.path.join(dest, "_resume")).fit(_module(kind, interval, after), _data(),
                                                                     ckpt_path=os.path.join(dest, ckpt))
        ref["resumed"][ckpt] = {"lrs": after[:6]}
    shutil.rmtree(os.path.join(dest, "_resume"), ignore_errors=True)
    with open(os.path.join(dest, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures/schedule/lightning")
    a = ap.parse_args()
    for name in CASES:
        run(name, a.out)


if __name__ == "__main__":
    main()
