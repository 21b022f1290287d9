"""Write the DeepSpeed ZeRO fixtures in ``fixtures/deepspeed/`` with real DeepSpeed on CPU.

    python3 -m venv --system-site-packages /work/venvs/sharded
    DS_BUILD_OPS=0 /work/venvs/sharded/bin/pip install -c <(echo torch==2.13.0) deepspeed
    DS_ACCELERATOR=cpu /work/venvs/sharded/bin/python scripts/make_deepspeed_fixtures.py

A tiny model trained 3 steps with AdamW (torch's, ``torch_adam``) at world size 2 (gloo, spawned
processes) under ZeRO stage 1, 2 and 3; ``engine.save_checkpoint`` writes the shards. For each
stage DeepSpeed's own tools give the reference values tests compare statekit against:
``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (fp32 master weights per parameter)
and ``ds_to_universal`` (a universal checkpoint: per parameter ``fp32``, ``exp_avg``,
``exp_avg_sq``, ``step``), saved as ``stage{N}-reference.pt``; the universal directory is kept
too (``stage{N}/universal``), so the universal reader is tested on DeepSpeed's own output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"
WORLD, STEPS = 2, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(x))))


def worker(rank: int, stage: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out, tag="step3")


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for stage, port in ((1, 29711), (2, 29712), (3, 29713)):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            mp.spawn(worker, args=(stage, port, ckpt), nprocs=WORLD, join=True)
            fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="step3")
            universal = os.path.join(tmp, "universal")
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            os.path.join(ckpt, "step3"), "--output_folder", universal, "--num_extract_workers", "1",
                            "--num_merge_workers", "1", "--inject_missing_state"], check=True)
            moments = {}
            zero = Path(universal) / "zero"
            for param_dir in sorted(p for p in zero.iterdir() if p.is_dir()):
                moments[param_dir.name] = {f.stem: torch.load(f, weights_only=False)
                                           for f in sorted(param_dir.glob("*.pt"))}
            target = OUT / f"stage{stage}"
            shutil.copytree(ckpt, target)
            shutil.copytree(universal, target / "universal")
            torch.save({"fp32": {k: v.clone() for k, v in fp32.items()}, "universal": moments},
                       OUT / f"stage{stage}-reference.pt")
            print(f"stage {stage}: {sorted(os.listdir(os.path.join(ckpt, 'step3')))}")


if __name__ == "__main__":
    main()
