"""torchtitan checkpoints with an LR schedule, written by torchtitan's own classes (CPU, gloo, one rank).

Run with the interpreter of a venv holding torchtitan (statekit never imports it)::

    python -m venv --system-site-packages /work/venvs/sched-sources-tt   # torch 2.13 from the system
    /work/venvs/sched-sources-tt/bin/pip install --no-deps torchtitan==0.3.0
    /work/venvs/sched-sources-tt/bin/pip install tyro spmd_types          # torchtitan's imports
    /work/venvs/sched-sources-tt/bin/python scripts/make_torchtitan_fixtures.py --out fixtures/torchtitan

What is torchtitan's own (0.3.0): ``OptimizersContainer`` (two AdamW param groups from its
``ParamGroupConfig`` patterns), ``LRSchedulersContainer.Config.build`` (its LambdaLR with
warm-up, stable and decay phases), ``CheckpointManager.save`` (the DCP folder
``<dump>/checkpoint/step-N``: the flattened model, ``optimizer``, ``lr_scheduler``
(``{"last_epoch": N}``), ``dataloader``, ``train_state``). What is imitated: the trainer loop
(forward, backward, ``optimizers.step()``, ``lr_schedulers.step()``, ``checkpointer.save(step)``,
in ``Trainer.train``'s order), ``TrainState`` (its ``state_dict`` is ``{"step", "ntokens_seen"}``,
copied), the model (two ``nn.Linear``), and the job config file, which is the dict
``Trainer.Config.to_dict()`` writes with ``--debug.save_config_file`` (its ``lr_scheduler``,
``training``, ``optimizer`` and ``checkpoint`` sections from the real Config classes' ``to_dict()``;
the trainer's other sections are left out).

``reference.json`` per case: for every saved step, the lr per group the next update uses (the
optimizer's group lr right after the save) and the lrs of the next updates (after each further
``lr_schedulers.step()``), read from the running optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

STEPS = 10
CASES = {
    # name: (LRSchedulersContainer.Config kwargs, steps saved)
    "wsd_cosine": ({"warmup_steps": 3, "decay_ratio": 0.5, "decay_type": "cosine", "min_lr_factor": 0.1}, (2, 7)),
    "linear": ({"warmup_steps": 2, "decay_type": "linear"}, (4,)),
    "sqrt": ({"warmup_steps": 2, "decay_ratio": 0.6, "decay_type": "sqrt", "min_lr_factor": 0.2}, (8,)),
}


class TrainState:  # torchtitan's trainer.TrainState.state_dict / load_state_dict
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def run(name, kwargs, saves, out):
    import torch
    from torch import nn
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt_cfg = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"\.bias$", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 2e-3, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1})])
    optimizers = OptimizersContainer(opt_cfg, model_parts=[model])
    sched_cfg = LRSchedulersContainer.Config(**kwargs)
    schedulers = sched_cfg.build(optimizers=optimizers, training_steps=STEPS)
    state = TrainState()
    dump = os.path.join(out, name)
    shutil.rmtree(dump, ignore_errors=True)
    ckpt_cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0)
    checkpointer = CheckpointManager(ckpt_cfg, dataloader=None, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                                     base_folder=dump)

    def lrs():
        return [g["lr"] for o in optimizers.optimizers for g in o.param_groups]

    trace = [lrs()]  # trace[k]: the lr the update k+1 uses
    for step in range(1, STEPS + 1):
        state.step = step
        state.ntokens_seen += 5 * 4
        loss = model(torch.randn(5, 4)).pow(2).sum()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        trace.append(lrs())
        if step in saves:
            checkpointer.save(step)
    checkpointer.close()
    for step in range(1, STEPS + 1):  # only the chosen saves are kept as fixtures
        if step not in saves:
            shutil.rmtree(os.path.join(dump, "checkpoint", f"step-{step}"), ignore_errors=True)
    config = {"lr_scheduler": sched_cfg.to_dict(), "training": {"steps": STEPS}, "optimizer": opt_cfg.to_dict(),
              "checkpoint": ckpt_cfg.to_dict()}
    with open(os.path.join(dump, "job_config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    import importlib.metadata as md

    ref = {"versions": {"torchtitan": md.version("torchtitan"), "torch": torch.__version__},
           "steps": {str(s): {"lr_now": trace[s], "lr_next": trace[s + 1:]} for s in saves}}
    with open(os.path.join(dump, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures/torchtitan")
    a = ap.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)  # CheckpointManager asks for the rank
    for name, (kwargs, saves) in CASES.items():
        run(name, kwargs, saves, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
