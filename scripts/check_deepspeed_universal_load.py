"""Check with real DeepSpeed that a statekit-written universal checkpoint loads and resumes.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/venvs/sharded/bin/python scripts/check_deepspeed_universal_load.py

Not part of the test suite (it needs DeepSpeed). statekit converts the committed ZeRO-2 fixture
(``fixtures/deepspeed/stage2``, world size 2) to the universal layout; DeepSpeed 0.19.8 then loads
it with ``checkpoint.load_universal`` at world size ``--world`` (ZeRO stage 2, the fixture's model
and AdamW), and so does DeepSpeed's own ``ds_to_universal`` output of the same checkpoint
(``fixtures/deepspeed/stage2/universal``). Both runs take 3 more identical steps; the script
prints whether the parameters after them are bit-identical, and exits non-zero if not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_deepspeed_fixtures import Net  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "deepspeed" / "stage2"
STEPS = 3


def worker(rank: int, world: int, port: int, load_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(123)  # different initial weights: the load must replace them
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"load_universal": True},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(load_dir)  # the tag from latest_universal
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    if rank == 0:
        torch.save({"loaded": loaded, "after": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
                    "global_steps": engine.global_steps}, out)


def run(load_dir: str, world: int, port: int, out: str) -> dict:
    mp.spawn(worker, args=(world, port, load_dir, out), nprocs=world, join=True)
    return torch.load(out, weights_only=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--via-pt", action="store_true", help="write ours from a plain .pt optimizer state and "
                        "--model (not from the ZeRO shards): universal → .pt → universal")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp, "ours"), Path(tmp, "theirs")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        statekit = [sys.executable, "-m", "statekit", "convert"]
        if args.via_pt:
            subprocess.run([*statekit, str(FIXTURE / "universal"), f"{tmp}/opt.pt"], check=True, env=env)
            module = torch.load(FIXTURE / "universal" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
            torch.save(module, f"{tmp}/model.pt")
            subprocess.run([*statekit, f"{tmp}/opt.pt", str(ours / "univ"), "--to", "deepspeed-universal", "--model",
                            f"{tmp}/model.pt"], check=True, env=env)
        else:
            subprocess.run([*statekit, str(FIXTURE), str(ours / "univ"), "--to", "deepspeed-universal"], check=True,
                           env=env)
        shutil.copytree(FIXTURE / "universal", theirs / "univ")
        (theirs / "latest_universal").write_text("univ")
        a = run(str(ours), args.world, 29741, os.path.join(tmp, "a.pt"))
        b = run(str(theirs), args.world, 29742, os.path.join(tmp, "b.pt"))
    same_loaded = all(torch.equal(a["loaded"][n], b["loaded"][n]) for n in b["loaded"])
    same_after = all(torch.equal(a["after"][n], b["after"][n]) for n in b["after"])
    source = "a .pt and --model" if args.via_pt else "the ZeRO-2 shards"
    print(f"ours from {source}, world size {args.world}: loaded weights identical: {same_loaded}; after {STEPS} more steps "
          f"bit-identical: {same_after}; global_steps {a['global_steps']} vs {b['global_steps']}")
    return 0 if same_loaded and same_after and a["global_steps"] == b["global_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
