"""Issue 29's table (``python bench/replay.py --marginal``): every optimizer's marginal cost of 7
more steps, gradient files read on both sides, statekit's ``replay`` against torch's own loop.

For each optimizer one torch run writes, in a temporary folder, a state after 2 steps
(``{"model", "optimizer"}`` ``.pt``), its parameters and 8 gradient files (safetensors). Then,
in this process, alternating, ``repeat`` times, best of each:

* statekit: :func:`statekit.ops.replay.replay_files` (what ``statekit replay`` runs: reads the
  state and parameters, steps, writes the parameters) with the first 1 and the first 8 gradient
  files, ``kernel=auto``, in each torch implementation's flavor (``torch`` for the for-loop,
  ``torch-foreach`` where foreach rounds otherwise, ``torch-fused``);
* torch: the same work as a training script does it: ``torch.load`` the state,
  ``load_state_dict``, for each gradient file ``safetensors.torch.load_file`` then ``step()``,
  ``save_file`` the parameters; ``foreach=False`` (for-loop), ``foreach=True``, ``fused=True``.

The marginal cost is T(8) - T(1): the 7 more steps and 7 more gradient files, start-up and file
writing cancelled. ratio = torch / statekit (above 1: statekit is faster).

Without torch: the same statekit runs in a child process where ``import torch`` fails (the
numba kernels, or the numpy reference where numba has none), one thread
(``STATEKIT_THREADS=1``, ``NUMBA_NUM_THREADS=1``), against torch on one thread
(``torch.set_num_threads(1)``) in this process. burn's LAMB, Lion, Adan, Adafactor and Muon have
no torch counterpart: their rows (fresh state, ``--optimizer X --flavor burn``) have no ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRADS = 8
FOREACH_FLAVOR = {"nadam", "radam", "asgd", "adafactor"}


@dataclass
class Case:
    name: str  # statekit's algorithm
    cls: str | None  # torch.optim class (None: burn only)
    shape: str  # "vector", "matrix" (Adafactor), "square" (Muon)
    kwargs: dict = field(default_factory=dict)
    impls: tuple = ("for-loop", "foreach")


CASES = [
    Case("adam", "Adam", "vector", {"lr": 1e-3}, ("for-loop", "foreach", "fused")),
    Case("adamw", "AdamW", "vector", {"lr": 1e-3, "weight_decay": 0.01}, ("for-loop", "foreach", "fused")),
    Case("sgd", "SGD", "vector", {"lr": 1e-3, "momentum": 0.9}, ("for-loop", "foreach", "fused")),
    Case("adagrad", "Adagrad", "vector", {"lr": 1e-2}, ("for-loop", "foreach", "fused")),
    Case("rmsprop", "RMSprop", "vector", {"lr": 1e-3}),
    Case("nadam", "NAdam", "vector"),
    Case("radam", "RAdam", "vector"),
    Case("adamax", "Adamax", "vector"),
    Case("adadelta", "Adadelta", "vector"),
    Case("asgd", "ASGD", "vector"),
    Case("rprop", "Rprop", "vector"),
    Case("adafactor", "Adafactor", "matrix"),
    Case("muon", "Muon", "square", {"lr": 1e-2}, ("for-loop",)),
    Case("lamb", None, "vector", {"lr": 1e-3}, ()),
    Case("lion", None, "vector", {"lr": 1e-4}, ()),
    Case("adan", None, "vector", {"lr": 1e-3}, ()),
    Case("adafactor", None, "matrix", {"lr": 1e-2}, ()),
    Case("muon", None, "square", {"lr": 1e-2}, ()),
]
#: torch optimizers whose torch-free replay is refused (torch's bfloat16 Newton–Schulz order is the CPU's)
REFUSED_WITHOUT_TORCH = {"muon"}
IMPL_KW = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def label(case: Case) -> str:
    return case.cls or f"burn {case.name}"


def flavor_of(case: Case, impl: str) -> str:
    if case.cls is None:
        return "burn"
    if impl == "fused":
        return "torch-fused"
    return "torch-foreach" if impl == "foreach" and case.name in FOREACH_FLAVOR else "torch"


def shape_of(case: Case, numel: int, side: int) -> tuple[int, ...]:
    if case.shape == "square":
        return (side, side)
    if case.shape == "matrix":
        cols = 2048
        return (max(1, numel // cols), cols)
    return (numel,)


def write_problem(case: Case, shape, folder: Path) -> dict:
    """A torch state after 2 steps (burn rows: none), its parameters and 8 gradient files."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    p = rng.standard_normal(shape, dtype=np.float32)
    files = {"params": folder / "params.safetensors", "grads": [folder / f"g{i}.safetensors" for i in range(GRADS)],
             "state": None, "out": folder / "out.safetensors"}
    if case.cls is not None:
        import torch

        param = torch.nn.Parameter(torch.from_numpy(p.copy()))
        opt = getattr(torch.optim, case.cls)([param], **case.kwargs)
        for _ in range(2):
            param.grad = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2))
            opt.step()
        files["state"] = folder / "state.pt"
        torch.save({"model": {"w": param.detach().clone()}, "optimizer": opt.state_dict()}, files["state"])
        p = param.detach().numpy().copy()
    save_file({"w": p}, str(files["params"]))
    for path in files["grads"]:
        save_file({"w": rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2)}, str(path))
    return files


def statekit_seconds(case: Case, files: dict, k: int, flavor: str) -> tuple[float, str]:
    """Seconds of one ``statekit replay`` of the first ``k`` gradient files, and its kernel."""
    from statekit.ops.replay import replay_files

    hyper = {} if case.cls is not None else {"lr": case.kwargs["lr"]}
    start = time.perf_counter()
    out = replay_files(str(files["params"]), [str(g) for g in files["grads"][:k]], str(files["out"]),
                       state=str(files["state"]) if files["state"] else None,
                       optimizer=None if case.cls is not None else case.name, flavor=flavor, hyperparams=hyper)
    return time.perf_counter() - start, out["kernel"]


def torch_seconds(case: Case, files: dict, k: int, impl: str) -> float:
    """Seconds of a training script's ``k`` steps from the saved state, gradients from files."""
    import torch
    from safetensors.torch import load_file, save_file

    start = time.perf_counter()
    saved = torch.load(files["state"], weights_only=True)
    param = torch.nn.Parameter(load_file(str(files["params"]))["w"])
    opt = getattr(torch.optim, case.cls)([param], **case.kwargs, **({} if case.name == "muon" else IMPL_KW[impl]))
    opt.load_state_dict(saved["optimizer"])
    for path in files["grads"][:k]:
        param.grad = load_file(str(path))["w"]
        opt.step()
    save_file({"w": param.detach()}, str(files["out"]))
    return time.perf_counter() - start


def marginal(run, repeat: int) -> float:
    """min T(8) - min T(1) over ``repeat`` alternating rounds (after one warm-up of each)."""
    run(1), run(GRADS)
    best = {1: float("inf"), GRADS: float("inf")}
    for _ in range(repeat):
        for k in (1, GRADS):
            best[k] = min(best[k], run(k))
    return best[GRADS] - best[1]


NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None  # import torch fails; importlib.util.find_spec("torch") is None
sys.path.insert(0, sys.argv[1])
import marginal
print(json.dumps(marginal.no_torch_rows(json.loads(sys.argv[2]), int(sys.argv[3]))))
"""


def no_torch_rows(jobs: list, repeat: int) -> list:
    """In a process without torch: (marginal seconds, kernel) of each ``[case index, flavor, files]``."""
    out = []
    for index, flavor, files in jobs:
        kernel = []

        def timed(k, case=CASES[index], files=files, flavor=flavor, kernel=kernel):
            seconds, ran = statekit_seconds(case, files, k, flavor)
            kernel.append(ran)
            return seconds

        out.append([marginal(timed, repeat), kernel[-1]])
    return out


def run(numel: int, side: int, repeat: int, threads: int, names: set | None = None) -> list[dict]:
    """Every case's rows: {optimizer, shape, impl, flavor, statekit, kernel, torch, ratio} (seconds)."""
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs, where = [], []
        for index, case in enumerate(CASES):
            if names and case.name not in names and label(case).lower() not in names:
                continue
            folder = Path(tmp) / f"{index}"
            folder.mkdir()
            shape = shape_of(case, numel, side)
            files = write_problem(case, shape, folder)
            torch.set_num_threads(threads)
            for impl in case.impls or ("-",):
                flavor = flavor_of(case, impl)
                kernel = []

                def timed(k, case=case, files=files, flavor=flavor, kernel=kernel):
                    seconds, ran = statekit_seconds(case, files, k, flavor)
                    kernel.append(ran)
                    return seconds

                ours = marginal(timed, repeat)
                theirs = marginal(lambda k, i=impl, c=case, f=files: torch_seconds(c, f, k, i), repeat) if case.cls else None
                rows.append({"optimizer": label(case), "shape": shape, "impl": impl, "flavor": flavor,
                             "statekit": ours, "kernel": kernel[-1], "torch": theirs, "threads": threads})
            if case.cls is None:
                continue
            # one thread: torch's for-loop (and fused) against statekit without torch
            torch.set_num_threads(1)
            for impl in [i for i in case.impls if i in ("for-loop", "fused")]:
                theirs = marginal(lambda k, i=impl, c=case, f=files: torch_seconds(c, f, k, i), repeat)
                rows.append({"optimizer": label(case), "shape": shape, "impl": impl + " 1 thr", "flavor":
                             flavor_of(case, impl), "statekit": None, "kernel": None, "torch": theirs, "threads": 1})
                if case.name in REFUSED_WITHOUT_TORCH:  # no torch-free path: replay refuses it (docs/kernels.md)
                    rows[-1]["kernel"] = "refused without torch"
                    continue
                jobs.append([index, flavor_of(case, impl), {k: (str(v) if isinstance(v, Path) else
                                                                [str(x) for x in v] if isinstance(v, list) else v)
                                                            for k, v in files.items()}])
                where.append(len(rows) - 1)
        torch.set_num_threads(threads)
        if jobs:
            env = dict(os.environ, STATEKIT_THREADS="1", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT))
            done = subprocess.run([sys.executable, "-c", NO_TORCH, str(ROOT / "bench"), json.dumps(jobs), str(repeat)],
                                  env=env, capture_output=True, text=True, cwd=tmp)
            if done.returncode:
                raise RuntimeError(f"the run without torch failed: {done.stderr[-800:]}")
            for row, (seconds, kernel) in zip(where, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
                rows[row]["statekit"], rows[row]["kernel"] = seconds, f"{kernel}, no torch"
    for row in rows:
        row["ratio"] = row["torch"] / row["statekit"] if row["torch"] and row["statekit"] and row["statekit"] > 0 \
            else None
    return rows


ADAM_FAMILY = {"Adam", "AdamW"}


def goal_of(row: dict) -> float | None:
    """Issue 29's goal for a row: every optimizer >= 1.0x torch's for-loop, the Adam family
    >= 1.0x torch fused, statekit without torch (numba) >= 0.9x torch on one thread."""
    if row["impl"].endswith(" 1 thr"):
        return 0.9
    if row["impl"] == "for-loop" or (row["impl"] == "fused" and row["optimizer"] in ADAM_FAMILY):
        return 1.0
    return None


def print_rows(rows: list[dict], load: tuple, numel: int, side: int) -> None:
    print(f"\nissue 29: marginal cost of {GRADS - 1} more steps (T({GRADS}) - T(1)), gradient files read on both "
          f"sides; vectors of {numel:,} float32, Adafactor [{numel // 2048}, 2048], Muon [{side}, {side}]; load "
          f"average {load[0]:.2f} at start; ratio = torch / statekit (>= 1: statekit as fast or faster)")
    header = (f"| {'optimizer':14} | {'torch impl':15} | {'statekit flavor':15} | {'statekit kernel':23} | "
              f"{'statekit s':>10} | {'torch s':>8} | {'ratio':>6} | {'goal':>6} |")
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for row in rows:
        want = goal_of(row)
        goal = "" if want is None or row["ratio"] is None else f"{'met' if row['ratio'] >= want else 'NOT'} {want:g}"
        torch_s = "-" if row["torch"] is None else f"{row['torch']:.3f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        ours = "-" if row["statekit"] is None else f"{row['statekit']:.3f}"
        print(f"| {row['optimizer']:14} | {row['impl']:15} | {row['flavor']:15} | {str(row['kernel']):23} | "
              f"{ours:>10} | {torch_s:>8} | {ratio:>6} | {goal:>6} |")
