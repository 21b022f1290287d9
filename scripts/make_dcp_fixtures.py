"""Write the torch.distributed.checkpoint fixtures in ``fixtures/dcp/`` (needs torch 2.13).

    python scripts/make_dcp_fixtures.py

Everything here is written by real torch: a small model wrapped in FSDP2 (``fully_shard`` on
CPU, gloo) trained a few steps with AdamW (two parameter groups, so per-group hyperparameters
differ), its model and optimizer state taken with ``get_model_state_dict`` /
``get_optimizer_state_dict`` (FQN-keyed) and saved with ``dcp.save`` from spawned processes at
world size 1 and 2. For each checkpoint torch's own offline converter writes the single-file
form (``dcp_to_torch_save``), which tests compare statekit against. ``ws2/`` also keeps the
training batches and the model/optimizer after 10 more steps, so a resume can be checked
bit-for-bit.

    fixtures/dcp/ws1/              dcp.save at world size 1 (one __0_0.distcp)
    fixtures/dcp/ws2/              dcp.save at world size 2 (FSDP2 shards on dim 0)
    fixtures/dcp/ws1.pt, ws2.pt    dcp_to_torch_save of the two directories
    fixtures/dcp/accelerate/optimizer_0/   the optimizer alone under an ``optimizer`` key
                                           (how Accelerate's FSDP save_state lays it out)
    fixtures/dcp/resume.pt         batches + the uninterrupted run's state after 10 more steps
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "dcp"
STEPS, MORE_STEPS = 3, 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(x))))


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """The model (FSDP2-sharded when it works on this machine) and its optimizer."""
    torch.manual_seed(0)
    model = Net()
    how = "plain"
    try:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.embed)
        fully_shard(model.head)
        fully_shard(model)
        how = "fsdp2"
    except Exception as exc:  # noqa: BLE001 - report and fall back to an unwrapped model
        print(f"FSDP2 unavailable ({exc}); saving plain replicated state", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    return model, opt, how


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(n)]


def train(model, opt, data) -> None:
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def full_state(model, opt) -> dict:
    """Model parameters and optimizer state, gathered to full plain tensors (same on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
    }


def worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt, how = build(world)
        data = batches(STEPS + MORE_STEPS)
        train(model, opt, data[:STEPS])
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=os.path.join(tmp, f"ws{world}"))
        if world == 1:
            dcp.save({"optimizer": state["optim"]}, checkpoint_id=os.path.join(tmp, "optimizer_0"))
        if world == 2:
            train(model, opt, data[STEPS:])
            after = full_state(model, opt)
            if rank == 0:
                torch.save({"how": how, "batches": data, "steps": STEPS, "after": after},
                           os.path.join(tmp, "resume.pt"))
        if rank == 0:
            Path(tmp, f"how{world}").write_text(how)
    finally:
        dist.destroy_process_group()


def resume_worker(rank: int, world: int, port: int, runs: list[tuple[str, str | None, str]]) -> None:
    """(For tests.) For each ``(ckpt, model_pt, out)``: resume from DCP checkpoint ``ckpt`` — model
    and optimizer, or only the optimizer (under ``optimizer``) with the model weights from
    ``model_pt`` — at world size ``world``, run the remaining steps, and save the full state to
    ``out`` (rank 0). One process group serves every run (starting processes is the slow part)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for ckpt, model_pt, out in runs:
            model, opt, _ = build(world)
            data = batches(STEPS + MORE_STEPS)
            if model_pt is None:
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
                dcp.load(state, checkpoint_id=ckpt)
                set_model_state_dict(model, state["model"])
                set_optimizer_state_dict(model, opt, state["optim"])
            else:
                weights = torch.load(model_pt, weights_only=True)["model"]
                set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
                state = {"optimizer": get_optimizer_state_dict(model, opt)}
                dcp.load(state, checkpoint_id=ckpt)
                set_optimizer_state_dict(model, opt, state["optimizer"])
            train(model, opt, data[STEPS:])
            after = full_state(model, opt)
            if rank == 0:
                torch.save(after, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        for world, port in ((1, 29611), (2, 29612)):
            mp.spawn(worker, args=(world, port, tmp), nprocs=world, join=True)
            shutil.copytree(os.path.join(tmp, f"ws{world}"), OUT / f"ws{world}")
            dcp_to_torch_save(OUT / f"ws{world}", OUT / f"ws{world}.pt")
            print(f"ws{world}: {Path(tmp, f'how{world}').read_text()}")
        shutil.copytree(os.path.join(tmp, "optimizer_0"), OUT / "accelerate" / "optimizer_0")
        shutil.copy(os.path.join(tmp, "resume.pt"), OUT / "resume.pt")


if __name__ == "__main__":
    main()
