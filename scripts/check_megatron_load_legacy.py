"""megatron-core loads a statekit-resharded LEGACY checkpoint at another TP/PP/EP/DP and trains.

For each check below this script (run with a megatron-core venv's python; statekit runs in its
own interpreter, ``--statekit-python``, default ``python3``):

1. has statekit write the fixture at the target sizes:
   ``statekit convert FIXTURE OUT --to megatron-legacy --tp … --pp … --ep … --dp …``;
2. starts Megatron at the target sizes (the fixture generator's own worker,
   ``scripts/make_megatron_fixtures.py --worker``: Megatron's argument parser,
   ``setup_model_and_optimizer`` → ``load_checkpoint`` of the statekit-written folder with
   ``--no-load-rng``), which saves **at once** (iteration 3: the state Megatron loaded, as its
   own ``save_checkpoint`` writes it) and again after **one training step** (iteration 4);
3. digests (sha256 of each tensor's bytes, with dtype and shape) every tensor of every rank file
   of the statekit-written folder and of Megatron's iteration-3 re-save, ``rng_state`` left out
   (none is written on a TP/PP/EP change), and requires them equal: every element Megatron
   loaded is the one statekit wrote, in the place statekit wrote it;
4. checks the step-4 save exists with finite tensors and that the loss was finite.

The result goes to ``fixtures/megatron_load_legacy/result.json`` (``--out``): per check the
command lines, the megatron-core and torch versions, the per-tensor digests, and the outcome.
``tests/test_megatron_reshard.py`` re-checks statekit's side against it in CI (statekit writes
the same folders again and their digests must be the recorded ones), and runs this script when
``STATEKIT_MCORE_PY`` names a megatron-core venv's python.

    /work/venvs/mcore-0.19.2/bin/python scripts/check_megatron_load_legacy.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import make_megatron_fixtures as gen  # noqa: E402  (the fixture generator's cases and worker)

# name: (fixture case, target tp, pp, ep, dp, extra statekit args, extra Megatron args)
CHECKS = {
    "tp2pp2dp1_to_tp1pp1dp2": ("gpt_torch_distopt_tp2pp2dp1", 1, 1, 1, 2, ["--vocab-divisible-by", "32"],
                               ["--make-vocab-size-divisible-by", "32"]),
    "no_distopt_tp1pp1dp2_to_tp2pp2dp1": ("gpt_torch_no_distopt_tp1pp1dp2", 2, 2, 1, 1, ["--distributed-optimizer"],
                                          ["--use-distributed-optimizer"]),
    # the non-distributed form kept (Megatron without --use-distributed-optimizer), the vocabulary kept at 112 rows
    "no_distopt_tp1pp1dp2_to_tp2pp2dp1_plain": ("gpt_torch_no_distopt_tp1pp1dp2", 2, 2, 1, 1,
                                                ["--vocab-divisible-by", "8"], ["--make-vocab-size-divisible-by", "8"]),
    "moe_ep2dp2_to_ep4dp4": ("moe_torch_distopt_ep2dp2", 1, 1, 4, 4, [], []),
    "moe_ep2dp2_to_ep1dp2": ("moe_torch_distopt_ep2dp2", 1, 1, 1, 2, [], []),
    # context parallelism: distrib_optim.pt is gathered over DP x CP; CP2 -> CP1, and CP1 -> CP2 (from the
    # non-distributed form into the distributed one laid out for DP x CP = 2)
    "cp2dp1_to_cp1dp1": ("gpt_torch_distopt_cp2dp1", 1, 1, 1, 1, ["--cp", "1"], ["--context-parallel-size", "1"]),
    "no_distopt_dp2_to_cp2dp1": ("gpt_torch_no_distopt_tp1pp1dp2", 1, 1, 1, 1, ["--cp", "2", "--distributed-optimizer"],
                                 ["--context-parallel-size", "2", "--use-distributed-optimizer"]),
}


def _cp(check: str) -> int:
    """The context-parallel size Megatron runs a check at: its own option, else the source case's."""
    case, *_, mg_extra = CHECKS[check]
    if "--context-parallel-size" in mg_extra:
        return int(mg_extra[mg_extra.index("--context-parallel-size") + 1])
    return gen.case_cp(case)


def command(check: str) -> list[str]:
    case, tp, pp, ep, dp, sk_extra, _ = CHECKS[check]
    return ["convert", f"fixtures/megatron/0.19.2/{case}", "OUT", "--to", "megatron-legacy", "--tp", str(tp),
            "--pp", str(pp), "--ep", str(ep), "--dp", str(dp), *sk_extra]


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every tensor, and the value of every plain entry, of every rank file under ``folder``'s
    iteration (``rng_state`` and ``args`` out)."""
    import torch

    out: dict[str, str] = {}

    def walk(obj, where):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[where] = f"{str(t.dtype)[6:]}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()[:32]}"
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if k in ("rng_state", "args"):
                    continue
                walk(v, f"{where}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
        elif obj is None or isinstance(obj, (bool, int, float, str)):
            out[where] = repr(obj)  # param groups (step, lr…), the scheduler, iteration: compared as values
        else:
            out[where] = type(obj).__name__

    (iteration,) = [d for d in os.listdir(folder) if d.startswith("iter_")]
    for rank in sorted(os.listdir(folder / iteration)):
        for name in sorted(os.listdir(folder / iteration / rank)):
            walk(torch.load(folder / iteration / rank / name, weights_only=False), f"{rank}/{name}")
    return out


def finite(folder: Path) -> bool:
    import torch

    ok = True

    def walk(obj):
        nonlocal ok
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            ok = ok and bool(torch.isfinite(obj.float()).all())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for path in folder.rglob("*.pt"):
        walk(torch.load(path, weights_only=False))
    return ok


def run_check(check: str, statekit_python: str, port: int) -> dict:
    case, tp, pp, ep, dp, _, mg_extra = CHECKS[check]
    tmp = Path(tempfile.gettempdir()) / "statekit-mcore-load-legacy" / check
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written = tmp / "statekit"
    argv = [a if a != "OUT" else str(written) for a in command(check)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sk = subprocess.run([statekit_python, "-m", "statekit", *argv, "--json"], cwd=ROOT, env=env,
                        capture_output=True, text=True)
    if sk.returncode:
        raise SystemExit(f"{check}: statekit failed: {sk.stderr.strip()}")
    # Megatron at the target sizes: the case's own arguments with the sizes replaced (argparse keeps the last)
    _, base = gen.case_argv(case, str(tmp / "megatron"))
    world = tp * pp * _cp(check) * dp
    # the source run's global batch (the scheduler counts samples: Megatron refuses another), split over DP
    gbs = int(base[base.index("--global-batch-size") + 1])
    mbs = min(2, gbs // dp)
    mg_argv = base + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                      "--expert-model-parallel-size", str(ep), "--global-batch-size", str(gbs),
                      "--micro-batch-size", str(mbs), *mg_extra, "--load", str(written), "--no-load-rng"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}",
           str(Path(__file__).resolve()), "--worker", "--saves", "3,4", "--facts", str(tmp / "facts.json"),
           "--megatron-args", shlex.join(mg_argv)]
    log = tmp / "log.txt"
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")).returncode
    text = log.read_text()
    if rc:
        raise SystemExit(f"{check}: Megatron failed (rc {rc}); log {log}:\n{text[-4000:]}")
    losses = [line.split("loss ")[1].split(" grad")[0] for line in text.splitlines() if line.startswith("iteration ")]
    resaved = tmp / "megatron_iter3"
    resaved.mkdir()
    shutil.copytree(tmp / "megatron" / "iter_0000003", resaved / "iter_0000003")
    ours, theirs = digests(written), digests(resaved)
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    stepped = tmp / "megatron" / "iter_0000004"
    facts = json.loads((tmp / "facts.json").read_text())
    return {
        "check": check,
        "source_fixture": f"fixtures/megatron/0.19.2/{case}",
        "statekit_command": "statekit " + shlex.join(argv).replace(str(written), "OUT"),
        "megatron_args": shlex.join(mg_argv).replace(str(tmp), "<tmp>"),
        "world_size": world,
        "megatron_core_version": facts["megatron_core_version"],
        "torch_version": facts["torch_version"],
        "loaded_equals_written": not differ,
        "tensors_compared": len(ours),
        "differ": differ[:20],
        "step_4_saved": stepped.is_dir(),
        "step_4_finite": stepped.is_dir() and finite(stepped),
        "losses": losses,
        "loss_finite": bool(losses) and all(math.isfinite(float(v)) for x in losses
                                            for v in re.findall(r"tensor\(([-+0-9.e]+|nan|inf)", x)),
        "digests": ours,
    }


def _worker() -> None:
    """The fixture generator's worker, with one CPU-only fix on top of its shim: on the CPU,
    Megatron's optimizer is torch's Adam (no TE/Apex), whose state holds a per-parameter
    ``step`` tensor; ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every
    tensor of that state from the loaded ``distrib_optim.pt`` entry, which (saved by any mcore,
    GPU or CPU) holds only ``param`` and the moments, so a legacy load fails with KeyError 'step'
    (megatron-core's own legacy distributed-optimizer save does too). The step is left to the
    generator's post-load fix (each parameter gets its group's loaded ``step``). Nothing else
    changes: every loaded master and moment is copied by Megatron's own code."""
    import mcore_cpu_shim

    install = mcore_cpu_shim.install

    def install_and_patch():
        mode = install()
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        orig = DistributedOptimizer._set_main_param_and_optimizer_states

        def set_states(self, model_param, tensors):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            if "step" in self.optimizer.state.get(main, {}) and "step" not in tensors:
                tensors = {**tensors, "step": None}  # not a tensor: Megatron's loop skips it
            return orig(self, model_param, tensors)

        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
        return mode

    mcore_cpu_shim.install = install_and_patch
    gen.main()


def main() -> None:
    if "--worker" in sys.argv:
        _worker()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="append", choices=list(CHECKS))
    p.add_argument("--statekit-python", default="python3")
    p.add_argument("--out", default=str(ROOT / "fixtures" / "megatron_load_legacy" / "result.json"))
    p.add_argument("--port", type=int, default=29733)
    ns = p.parse_args()
    results = {}
    for i, check in enumerate(ns.check or list(CHECKS)):
        r = run_check(check, ns.statekit_python, ns.port + i)
        results[check] = r
        print(f"{check}: loaded == written: {r['loaded_equals_written']} ({r['tensors_compared']} tensors), "
              f"one step: {r['step_4_saved'] and r['step_4_finite']}, losses {r['losses']}", flush=True)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else {}
    old.update(results)
    out.write_text(json.dumps(dict(sorted(old.items())), indent=1) + "\n")
    bad = [c for c, r in results.items()
           if not (r["loaded_equals_written"] and r["step_4_saved"] and r["step_4_finite"] and r["loss_finite"])]
    if bad:
        raise SystemExit(f"failed: {', '.join(bad)}")


if __name__ == "__main__":
    main()
