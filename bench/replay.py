"""Throughput of statekit's replay kernels beside torch's Adam and the machine's bandwidth.

    python bench/replay.py [--numel 50000000] [--repeat 3] [--threads 2] [--baseline-rev REV]
                           [--device cpu|cuda]

One float32 parameter of ``--numel`` elements with its gradient and Adam state; every row times
one in-place step, best of ``--repeat`` after a warm-up. Rows:

* the machine: ``np.copyto`` (2 streams) and a STREAM triad ``a = b + s*c`` (3 streams, 12 B per
  element) on one thread and on ``--threads`` threads (numba when installed, else torch);
* torch's ``Adam(fused=True)`` / ``AdamW(fused=True)`` on 1 and ``--threads`` threads;
* statekit's kernels (:mod:`statekit.optim.kernels`): ``torch`` (torch's own code on zero-copy
  numpy views), ``numba`` (1 and ``--threads`` threads) and the ``reference`` emulation, for
  each flavor (candle is AdamW with weight_decay 0, the same update);
* the reference of ``--baseline-rev`` (default: main before issue 13's kernels), exported
  with ``git archive`` and timed in a subprocess alternating with today's, same method. The
  baseline has no threads (one thread); today's reference is timed on one thread
  (``STATEKIT_THREADS=1``) and on ``--threads`` threads, and both ratios are printed, with
  the ratio of the one-thread runs' CPU times (steadier than wall time on a busy machine);
* issue 18's optimizers (NAdam, RAdam, Adamax, Adadelta, Adafactor, ASGD, Rprop, Muon): one step
  of torch's own for-loop (``foreach=False``) and foreach (``foreach=True``; Muon has none) and of
  statekit's reference replay of each (its ``torch`` flavor, and ``torch-foreach`` where that
  rounds differently), same run, same tensor, with the ratios statekit / torch. Adafactor steps a
  ``[numel/1024, 1024]`` matrix (its factored path), Muon a ``--muon-side`` square matrix (its
  Newton–Schulz products are cubic), the others a vector. ``--optimizers-only`` runs just these;
* ``statekit verify-resume`` of a torch Adam checkpoint of ``--verify-params`` parameters (four
  square Linear weights, written by torch) against itself, 10 steps, in a fresh process: wall
  time and peak RSS against the state's size (its two moments). ``--verify-params 0`` skips it.

Then the ratios of issue 13's "Done when", all from this run. An Adam step moves 7 float32
streams (p, g, m, v read; p, m, v written): 28 B per element.

``--device cuda`` times torch's fused Adam and statekit's torch kernel on CUDA tensors; without a
CUDA device it says so and exits 0 (no GPU was available where this was written: that path is
code-reviewed, not measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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

import statekit.optim as so  # noqa: E402
from statekit.optim import kernels  # noqa: E402

ADAM_BYTES = 7 * 4
TRIAD_BYTES = 3 * 4
FLAVORS = [("torch-fused", "adam"), ("torch", "adam"), ("burn", "adam"), ("candle", "adamw")]
HP = {"adam": {"lr": 1e-3}, "adamw": {"lr": 1e-3, "weight_decay": 0.0}}
#: main just before issue 13's kernels landed: "today" in the issue's numpy-fallback goal
BASELINE_REV = "519fc40"

# Times the reference of whatever statekit is on sys.path (today's or the baseline's export);
# run in a subprocess so that two versions of the package never share a process.
REFERENCE_SCRIPT = r"""
import json, sys, time
import numpy as np
import statekit.optim as so
numel, repeat = int(sys.argv[1]), int(sys.argv[2])
flavors = json.loads(sys.argv[3]); hps = json.loads(sys.argv[4])
rng = np.random.default_rng(0)
p0 = rng.standard_normal(numel, dtype=np.float32)
g = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-2)
out = {}
for flavor, algo in flavors:
    p, s, k = p0.copy(), {"exp_avg": np.zeros_like(p0), "exp_avg_sq": np.zeros_like(p0)}, 0
    extra = {"kernel": "reference"} if "kernel" in so.step.__code__.co_varnames else {}
    best = cpu = float("inf")
    for i in range(repeat + 1):
        t, c = time.perf_counter(), time.process_time()
        so.step(algo, p, g, s, k, hps[algo], flavor, inplace=True, **extra)
        k += 1
        if i:
            best = min(best, time.perf_counter() - t)
            cpu = min(cpu, time.process_time() - c)
    out[flavor] = [best, cpu]
out["statekit"] = so.__file__
print(json.dumps(out))
"""


def best_time(fn, repeat: int, sync=lambda: None) -> float:
    """Best wall time of ``repeat`` calls of ``fn`` after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def set_threads(n: int) -> None:
    if have("torch"):
        import torch

        torch.set_num_threads(n)
    if have("numba"):
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def triad_seconds(numel: int, threads: int, repeat: int):
    """(seconds, how) of ``a = b + s*c`` on ``threads`` threads."""
    rng = np.random.default_rng(1)
    b, c = rng.standard_normal(numel, dtype=np.float32), rng.standard_normal(numel, dtype=np.float32)
    a = np.empty_like(b)
    s = np.float32(0.5)
    if have("numba"):
        import numba

        @numba.njit(parallel=True)
        def triad(a, b, c, s):
            for i in numba.prange(a.shape[0]):
                a[i] = b[i] + s * c[i]

        set_threads(threads)
        return best_time(lambda: triad(a, b, c, s), repeat), "numba"
    if have("torch"):
        import torch

        set_threads(threads)
        ta, tb, tc = (torch.from_numpy(x) for x in (a, b, c))
        return best_time(lambda: torch.add(tb, tc, alpha=0.5, out=ta), repeat), "torch"
    return best_time(lambda: (np.multiply(c, s, out=a), np.add(a, b, out=a)), repeat), "numpy (2 passes)"


class Host:
    def __init__(self, numel: int):
        rng = np.random.default_rng(0)
        self.p = rng.standard_normal(numel, dtype=np.float32)
        self.g = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-2)

    def slots(self):
        return {"exp_avg": np.zeros_like(self.p), "exp_avg_sq": np.zeros_like(self.p)}


def statekit_seconds(dev: Host, flavor: str, algo: str, kernel: str, repeat: int, xp=None) -> float:
    p, slots, state = dev.p.copy(), dev.slots(), {"step": 0}

    def one_step():
        so.step(algo, p, dev.g, slots, state["step"], HP[algo], flavor, xp, inplace=True, kernel=kernel)
        state["step"] += 1

    return best_time(one_step, repeat)


def torch_fused_seconds(dev: Host, algo: str, repeat: int, device: str = "cpu") -> float:
    import torch

    param = torch.nn.Parameter(torch.from_numpy(dev.p.copy()).to(device))
    param.grad = torch.from_numpy(dev.g).to(device)
    cls = torch.optim.AdamW if algo == "adamw" else torch.optim.Adam
    opt = cls([param], fused=True, **HP[algo])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return best_time(opt.step, repeat, sync)


def reference_runs(numel: int, repeat: int, rev: str, threads: int) -> dict[str, dict]:
    """Best seconds per flavor of the reference: the baseline export (which runs on one thread:
    it has no threads), today's on one thread and on ``threads`` threads (``STATEKIT_THREADS``),
    each in a fresh process, the three alternating twice."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "statekit"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        args = [str(numel), str(repeat), json.dumps(FLAVORS), json.dumps(HP)]
        runs = {"baseline": (tmp, 1), "today 1": (str(ROOT), 1)}
        if threads > 1:
            runs[f"today {threads}"] = (str(ROOT), threads)
        best: dict[str, dict] = {key: {} for which in runs for key in (which, which + " cpu")}
        for _ in range(2):
            for which, (path, workers) in runs.items():
                env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", STATEKIT_THREADS=str(workers))
                # -P: without it "python -c" puts the working directory first on sys.path, and
                # run from a checkout both sides would import today's statekit
                out = json.loads(subprocess.run([sys.executable, "-P", "-c", REFERENCE_SCRIPT, *args], env=env,
                                                check=True, capture_output=True, text=True).stdout)
                imported = Path(out.pop("statekit")).resolve()
                if not imported.is_relative_to(Path(path).resolve()):
                    raise RuntimeError(f"the {which} run imported {imported}, not statekit from {path}")
                for flavor, (seconds, cpu) in out.items():
                    best[which][flavor] = min(seconds, best[which].get(flavor, float("inf")))
                    best[which + " cpu"][flavor] = min(cpu, best[which + " cpu"].get(flavor, float("inf")))
        return best


VERIFY_SCRIPT = r"""
import resource, sys, time
sys.argv = ["statekit", "verify-resume", sys.argv[1], sys.argv[1], "--steps", sys.argv[2], "--json"]
from statekit.cli import _run
start = time.perf_counter()
code = _run()
sys.stderr.write(f"RESULT {time.perf_counter() - start} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\n")
sys.exit(code)
"""


def verify_resume_run(total: int, steps: int = 10) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, state bytes) of ``statekit verify-resume`` on a torch Adam
    checkpoint of ``total`` parameters against itself."""
    import math

    import torch

    side = int(math.isqrt(total // 4))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adam.pt"
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(4)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        opt.step()
        numel = sum(p.numel() for p in model.parameters())
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        del model, opt
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", VERIFY_SCRIPT, str(path), str(steps)], env=env,
                              capture_output=True, text=True)
        line = [x for x in done.stderr.splitlines() if x.startswith("RESULT")]
        if done.returncode != 0 or not line:
            raise RuntimeError(f"verify-resume failed: {done.stderr[-500:]}")
        report = json.loads(done.stdout)
        assert report["tracks"], "verify-resume of a state against itself must track"
        seconds, rss_kib = line[0].split()[1:]
        return float(seconds), int(rss_kib) * 1024, 2 * 4 * numel


NEW_OPTIMIZERS = ("NAdam", "RAdam", "Adamax", "Adadelta", "Adafactor", "ASGD", "Rprop", "Muon")


def optimizer_rows(numel: int, repeat: int, muon_side: int) -> list[tuple]:
    """(name, shape, torch for-loop s, torch foreach s or None, statekit torch s, statekit foreach s or None)."""
    import torch

    rows = []
    rng = np.random.default_rng(0)
    for cls_name in NEW_OPTIMIZERS:
        name = cls_name.lower()
        if name == "muon":
            shape = (muon_side, muon_side)
        elif name == "adafactor":
            shape = (max(1, numel // 1024), 1024)
        else:
            shape = (numel,)
        p0 = rng.standard_normal(shape, dtype=np.float32)
        g = rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2)
        cls = getattr(torch.optim, cls_name)

        def torch_seconds(foreach, cls=cls, p0=p0, g=g, name=name):
            param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
            param.grad = torch.from_numpy(g)
            opt = cls([param], **({} if name == "muon" else {"foreach": foreach}))
            return best_time(opt.step, repeat)

        def ours_seconds(flavor, p0=p0, g=g, name=name):
            state = {"p": p0.copy(), "s": {}, "k": 0}

            def one():
                state["p"], state["s"], state["k"] = so.step(name, state["p"], g, state["s"], state["k"], {}, flavor)

            return best_time(one, repeat)

        flavors = so.ALGORITHMS[name].flavors
        rows.append((cls_name, shape, torch_seconds(False), None if name == "muon" else torch_seconds(True),
                     ours_seconds("torch"), ours_seconds("torch-foreach") if "torch-foreach" in flavors else None))
    return rows


def print_optimizer_rows(rows, load) -> None:
    print(f"\nissue 18 optimizers, one step (load average {load[0]:.2f} at start); statekit = its reference replay, "
          "bit-exact; ratio = statekit time / torch time (lower is faster)")
    header = (f"| {'optimizer':9} | {'shape':>13} | {'torch loop ms':>13} | {'torch foreach ms':>16} | "
              f"{'statekit ms':>11} | {'statekit foreach ms':>19} | {'/ loop':>6} | {'/ foreach':>9} |")
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    for name, shape, loop, foreach, ours, ours_fe in rows:
        vs_fe = None if foreach is None else (ours_fe if ours_fe is not None else ours) / foreach
        print(f"| {name:9} | {'x'.join(map(str, shape)):>13} | {ms(loop):>13} | {ms(foreach):>16} | {ms(ours):>11} | "
              f"{ms(ours_fe):>19} | {ours / loop:6.2f} | {'-' if vs_fe is None else f'{vs_fe:.2f}':>9} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument("--no-baseline", action="store_true", help="skip the reference-vs-baseline rows")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--verify-params", type=int, default=100_000_000)
    parser.add_argument("--verify-only", action="store_true", help="only the verify-resume measurement")
    parser.add_argument("--optimizers-only", action="store_true", help="only issue 18's optimizer rows")
    parser.add_argument("--optimizer-numel", type=int, default=None,
                        help="elements per tensor for issue 18's optimizer rows (default: --numel)")
    parser.add_argument("--muon-side", type=int, default=1024, help="Muon's square matrix side")
    parser.add_argument("--marginal", action="store_true",
                        help="only issue 29's table: each optimizer's marginal cost of 7 more steps from gradient "
                             "files, statekit replay against torch's own loops (bench/marginal.py)")
    parser.add_argument("--marginal-numel", type=int, default=4_000_000, help="elements per vector in --marginal")
    parser.add_argument("--only", default="", help="--marginal: a comma-separated list of optimizers")
    args = parser.parse_args(argv)
    n, r, threads = args.numel, args.repeat, args.threads
    if args.marginal:
        if not have("torch"):
            print("torch is not installed: no torch rows to compare with")
            return 0
        import marginal

        load = os.getloadavg()
        names = {x.strip().lower() for x in args.only.split(",") if x.strip()} or None
        rows = marginal.run(args.marginal_numel, args.muon_side, r, threads, names)
        print(optional.line())
        marginal.print_rows(rows, load, args.marginal_numel, args.muon_side)
        return 0
    if args.optimizers_only:
        if not have("torch"):
            print("torch is not installed: no torch rows to compare with")
            return 0
        set_threads(threads)
        load = os.getloadavg()
        print_optimizer_rows(optimizer_rows(args.optimizer_numel or n, r, args.muon_side), load)
        return 0

    if args.device == "cuda":
        return cuda_main(args)

    load = os.getloadavg()
    verify = None
    if args.verify_params and have("torch"):
        verify = verify_resume_run(args.verify_params)
    if args.verify_only:
        print_verify(args, verify, load)
        return 0
    dev = Host(n)
    rows: list[tuple[str, float, float]] = []  # label, seconds, bytes per element

    def add(label, seconds, nbytes=ADAM_BYTES):
        rows.append((label, seconds, nbytes))
        return seconds

    dst = np.empty_like(dev.p)
    add("np.copyto (1 thread)", best_time(lambda: np.copyto(dst, dev.p), r), 8)
    triad = {}
    for t in sorted({1, threads}):
        seconds, how = triad_seconds(n, t, r)
        triad[t] = add(f"triad a=b+s*c, {how} ({t} thr)", seconds, TRIAD_BYTES)

    fused = {}
    if have("torch"):
        for t in sorted({1, threads}):
            set_threads(t)
            for algo in ("adam", "adamw"):
                fused[algo, t] = add(f"torch {algo} fused=True ({t} thr)", torch_fused_seconds(dev, algo, r))
    set_threads(threads)
    ours = {}
    if have("torch"):
        for algo in ("adam", "adamw"):
            ours["torch", "torch-fused", algo, threads] = add(
                f"statekit torch kernel torch-fused {algo} ({threads} thr)",
                statekit_seconds(dev, "torch-fused", algo, "torch", r))
        ours["torch", "torch", "adam", threads] = add(
            f"statekit torch kernel torch adam ({threads} thr)", statekit_seconds(dev, "torch", "adam", "torch", r))
    if kernels.numba_available():
        for t in sorted({1, threads}):
            set_threads(t)
            for flavor, algo in [*FLAVORS, ("torch-fused", "adamw")]:
                ours["numba", flavor, algo, t] = add(
                    f"statekit numba {flavor} {algo} ({t} thr)", statekit_seconds(dev, flavor, algo, "numba", r))
        set_threads(threads)
    reference = {}
    if not args.no_baseline:
        reference = reference_runs(n, r, args.baseline_rev, threads)
        for flavor, _ in FLAVORS:
            add(f"reference {flavor} @ {args.baseline_rev} (1 thr)", reference["baseline"][flavor])
            for t in sorted({1, threads}):
                add(f"reference {flavor} today ({t} thr)", reference[f"today {t}"][flavor])

    print(f"{n:,} float32 elements; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; "
          f"{os.cpu_count()} CPUs, --threads {threads}; torch {'yes' if have('torch') else 'no'}, numba "
          f"{'yes' if kernels.numba_available() else 'no'}")
    print(optional.line())
    header = f"| {'row':46} | {'ms/step':>8} | {'M elem/s':>9} | {'GB/s':>6} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for label, seconds, nbytes in rows:
        print(f"| {label:46} | {seconds * 1e3:8.1f} | {n / seconds / 1e6:9.1f} | {n * nbytes / seconds / 1e9:6.1f} |")

    print("\nissue 13 Done-when ratios (this run):")

    def ratio(label, value, goal):
        verdict = "met" if value >= goal else "NOT met"
        print(f"  {label:72} {value:6.2f}  (goal >= {goal:g}: {verdict})")

    for algo in ("adam", "adamw"):
        key = ("torch", "torch-fused", algo, threads)
        if key in ours and (algo, threads) in fused:
            ratio(f"with torch: statekit {algo} torch-fused / torch fused ({threads} thr)",
                  fused[algo, threads] / ours[key], 1.0)
    for algo in ("adam", "adamw"):
        key = ("numba", "torch-fused", algo, 1)
        if key in ours and (algo, 1) in fused:
            ratio(f"numba {algo} torch-fused / torch fused (1 thr)", fused[algo, 1] / ours[key], 0.9)
        key = ("numba", "torch-fused", algo, threads)
        if key in ours:
            frac = (n * ADAM_BYTES / ours[key]) / (n * TRIAD_BYTES / triad[threads])
            ratio(f"numba {algo} torch-fused bandwidth / triad bandwidth ({threads} thr)", frac, 0.6)
    for flavor, _ in FLAVORS:
        if reference:
            base = reference["baseline"][flavor]
            for t in sorted({1, threads}):
                ratio(f"reference {flavor}: today ({t} thr) / {args.baseline_rev} (1 thr)",
                      base / reference[f"today {t}"][flavor], 2.0)
            # CPU seconds of the one-thread runs: what a busy machine's wall time hides
            ratio(f"reference {flavor}: today / {args.baseline_rev}, CPU time (1 thr both)",
                  reference["baseline cpu"][flavor] / reference["today 1 cpu"][flavor], 2.0)
    print_verify(args, verify, load)
    if have("torch"):
        set_threads(threads)
        print_optimizer_rows(optimizer_rows(args.optimizer_numel or n, r, args.muon_side), os.getloadavg())
    return 0


def print_verify(args, verify, load) -> None:
    if verify is not None:
        seconds, rss, state = verify
        print(f"\nload average at start {load[0]:.2f}; verify-resume, {args.verify_params:,} parameters (torch Adam .pt), 10 steps, fresh process: "
              f"{seconds:.1f} s, peak RSS {rss / 2**30:.2f} GiB, state {state / 2**30:.2f} GiB")
        print(f"  {'verify-resume seconds':72} {seconds:6.1f}  (goal <= 60: {'met' if seconds <= 60 else 'NOT met'})")
        print(f"  {'verify-resume peak RSS / state size':72} {rss / state:6.2f}  "
              f"(goal <= 4: {'met' if rss <= 4 * state else 'NOT met'})")


def cuda_main(args) -> int:
    if not have("torch"):
        print("torch is not installed: skipping the CUDA benchmark")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: skipping the CUDA benchmark")
        return 0
    n, r = args.numel, args.repeat
    p = torch.randn(n, device="cuda")
    g = torch.randn(n, device="cuda") * 1e-2
    for algo in ("adam", "adamw"):
        host = Host.__new__(Host)
        host.p, host.g = p.cpu().numpy(), g.cpu().numpy()
        t_fused = torch_fused_seconds(host, algo, r, "cuda")
        pp, slots, state = p.clone(), {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}, {"k": 0}

        def one_step(algo=algo, pp=pp, slots=slots, state=state):
            so.step(algo, pp, g, slots, state["k"], HP[algo], "torch-fused", inplace=True, kernel="torch")
            state["k"] += 1

        t_ours = best_time(one_step, r, torch.cuda.synchronize)
        print(f"cuda {algo}: torch fused {n / t_fused / 1e6:,.0f} M elem/s, statekit torch kernel "
              f"{n / t_ours / 1e6:,.0f} M elem/s, ratio {t_fused / t_ours:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
