#!/usr/bin/env python3
"""Start-up and big-table times of the ``statekit`` command against Python's own, same run.

    python bench/startup.py [--repeat 7] [--params 10000] [--keep DIR]

Every row is the best wall time of ``--repeat`` fresh processes, the rows interleaved round by
round so that load on a shared machine hits them alike (and the best CPU time, user + system, a
steadier figure where the machine is shared; ``import numpy`` starts threads, so its wall time
can be below its CPU time). statekit's bytecode is compiled first, as an installed package has it:

* ``python -c pass`` and ``python -c "import numpy"``: the baselines;
* ``statekit --version`` (``python -m statekit``, the console script's code path);
* ``statekit inspect`` of a 4 GiB burnpack (header and metadata only), as a table and ``--json``;
* ``statekit inspect`` of a burnpack with ``--params`` parameters (Adam: two moments each), as a
  table, ``--json`` and ``--format tsv`` (when the command has it).

Then issue 13's ratios: inspect (4 GiB) ≤ 1.0 × import numpy, ``--version`` ≤ 3 × ``pass``, the
10,000-parameter inspect ≤ 1 s. The 4 GiB file is written once (about 4 GiB of disk, a few
seconds) into a temporary folder, or ``--keep DIR`` to reuse it across runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import optional  # noqa: E402
from burnpack_scale import build  # noqa: E402

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

GIB = 1 << 30


def many_params(path: Path, params: int) -> None:
    """An Adam-layout burnpack with ``params`` parameters of 16 floats (two moments each)."""
    tensors, scalars, meta = [], {}, {}
    values = np.arange(16, dtype=np.float32)
    for i in range(params):
        pid = 10**18 + i
        for field in ("momentum.moment_1", "momentum.moment_2"):
            tensors.append(PackTensor(f"{pid}.{field}", TensorRef.from_array(values), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", 1)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 10)
        meta[str(pid)] = f"layers.{i // 4}.block.{i % 4}.weight"
    write_burnpack(str(path), tensors, meta, scalars)


def run_once(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    return elapsed, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--keep", type=Path, help="folder to keep (and reuse) the generated files in")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        big, wide = folder / "adam-4gib.bpk", folder / f"adam-{args.params}-params.bpk"
        if not big.exists():
            build(str(big), 4 * GIB, 8)
        if not wide.exists():
            many_params(wide, args.params)

        env = optional.installed_env(ROOT, PYTHONPATH=str(ROOT), COLUMNS="100")
        py = sys.executable
        statekit = [py, "-m", "statekit"]
        rows = {
            "python -c pass": [py, "-c", "pass"],
            "python -c 'import numpy'": [py, "-c", "import numpy"],
            "statekit --version": [*statekit, "--version"],
            "statekit inspect 4 GiB .bpk": [*statekit, "inspect", str(big)],
            "statekit inspect 4 GiB .bpk --json": [*statekit, "inspect", str(big), "--json"],
            f"statekit inspect {args.params} params": [*statekit, "inspect", str(wide)],
            f"statekit inspect {args.params} params --json": [*statekit, "inspect", str(wide), "--json"],
        }
        # issue 21: the 3 KiB convert of a float32 file (its time against import numpy)
        fixtures = ROOT / "fixtures"
        small = [*statekit, "convert", str(fixtures / "hand-optim.bpk"), str(folder / "hand-optim.pt"),
                 "--optimizer", "adam", "--names", str(fixtures / "hand-names.txt"), "--transpose", "*"]
        rows["statekit convert 3 KiB .bpk → .pt (float32)"] = small
        tsv = [*statekit, "inspect", str(wide), "--format", "tsv"]
        if subprocess.run(tsv, env=env, capture_output=True).returncode == 0:
            rows[f"statekit inspect {args.params} params --format tsv"] = tsv
        imported = subprocess.run([py, "-X", "importtime", *small[1:]], env=env, capture_output=True, text=True)
        ml_dtypes_imported = any(ln.rstrip().endswith("| ml_dtypes") for ln in imported.stderr.splitlines())
        best, cpu = dict.fromkeys(rows, float("inf")), dict.fromkeys(rows, float("inf"))
        for _ in range(args.repeat):
            for label, cmd in rows.items():
                wall, used = run_once(cmd, env)
                best[label], cpu[label] = min(best[label], wall), min(cpu[label], used)

    load = os.getloadavg()
    print(f"best of {args.repeat} fresh processes, interleaved; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the end; {os.cpu_count()} CPUs; {sys.version.split()[0]}")
    print(optional.line())
    base, numpy_s = best["python -c pass"], best["python -c 'import numpy'"]
    header = f"| {'command':52} | {'seconds':>7} | {'x pass':>6} | {'x import numpy':>14} | {'CPU s':>6} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for label, seconds in best.items():
        print(f"| {label:52} | {seconds:7.3f} | {seconds / base:6.2f} | {seconds / numpy_s:14.2f} | {cpu[label]:6.3f} |")

    print("\nissue 13 Done-when (this run):")

    def verdict(label, value, goal, unit=""):
        state = "met" if value <= goal else "NOT met"
        print(f"  {label:60} {value:6.2f}{unit}  (goal <= {goal:g}{unit}: {state})")

    verdict("inspect 4 GiB burnpack / import numpy", best["statekit inspect 4 GiB .bpk"] / numpy_s, 1.0)
    cpu_ratio = cpu["statekit inspect 4 GiB .bpk"] / cpu["python -c 'import numpy'"]
    print(f"  {'  the same in CPU time':60} {cpu_ratio:6.2f}")
    verdict("statekit --version / python -c pass", best["statekit --version"] / base, 3.0)
    verdict(f"inspect {args.params} parameters (table)", best[f"statekit inspect {args.params} params"], 1.0, " s")
    print("\nissue 21 Done-when (this run):")
    print(f"  {'the float32 convert imports ml_dtypes':60} {'yes' if ml_dtypes_imported else 'no'}  "
          f"(goal: no: {'NOT met' if ml_dtypes_imported else 'met'})")
    verdict("convert 3 KiB .bpk → .pt / import numpy", best["statekit convert 3 KiB .bpk → .pt (float32)"] / numpy_s,
            3.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
