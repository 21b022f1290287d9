#!/usr/bin/env python3
"""Does every command run at disk speed in the memory of a piece, at any file size?

Builds burn Adam optimizer states of 0.25, 1 and 4 GiB (16 GiB more with ``--big``), each with
200 parameters: ``embed.weight`` (the largest tensor: 256 MiB per moment at 4 GiB), 99
``layers.N.weight`` [R, 1024], 99 ``layers.N.bias`` and ``norm.bias`` [1024]. For each size it
runs, in fresh processes and side by side with ``cp``/``cmp`` of the same bytes:

    convert bpk → pt (--no-transpose), bpk → pt (--transpose '*.weight'), pt → bpk,
    bpk → safetensors, safetensors → bpk, remap (200 renames, new ids), diff (equal files),
    diff (files differing in one tensor), inspect --stats, doctor, merge (two halves)

and prints the wall time, the ratio to the baseline (``cp`` + ``sync`` of the file for writers,
which fsync their output; plain ``cp`` alongside; ``cmp`` of two equal copies for diff, since
``cmp`` stops at the first difference; a writer's and the equal-files diff's baseline is run
just before each of its runs, so that both see the disk in the same state), the peak RSS of the child (``os.wait4``), and the growth
of time and peak RSS from size to size. Files live in a temporary folder under /tmp (``--dir``)
and are deleted as soon as they are used.

Usage: python bench/scale.py [--sizes-gib 0.25 1 4] [--big] [--jobs N] [--repeat N] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import optional  # noqa: E402

from statekit.formats.burnpack import (  # noqa: E402
    HEADER_SIZE,
    MAGIC,
    VERSION,
    BurnpackFile,
    PackTensor,
    Scalar,
    plan_layout,
    write_burnpack,
)
from statekit.tensor import TensorRef  # noqa: E402

PARAMS = 200
WIDTH = 1024  # columns of every weight; bias length
LARGEST_AT_4GIB = 256 << 20  # bytes of one moment of embed.weight in the 4 GiB state
MIB = 1 << 20


def layout(total: int) -> list[tuple[str, tuple[int, ...]]]:
    """The 200 parameters (path, shape) of a state of ``total`` bytes (two F32 moments each)."""
    scale = total / (4 << 30)
    embed_rows = max(1, int(LARGEST_AT_4GIB * scale) // (4 * WIDTH))
    per_moment = total // 2
    biases = 100 * WIDTH * 4
    rest = per_moment - embed_rows * WIDTH * 4 - biases
    rows = max(1, rest // 99 // (4 * WIDTH))
    params = [("embed.weight", (embed_rows, WIDTH))]
    for i in range(99):
        params += [(f"layers.{i}.weight", (rows, WIDTH)), (f"layers.{i}.bias", (WIDTH,))]
    params.append(("norm.bias", (WIDTH,)))
    assert len(params) == PARAMS
    return params


def _filler(seed: int, positive: bool):
    block = np.random.default_rng(seed).standard_normal(4 * MIB).astype(np.float32) * np.float32(1e-3)
    if positive:
        block = block * block
    raw = block.tobytes()

    def chunks(nbytes: int):
        def read(size: int):
            left = nbytes
            while left:
                n = min(left, size, len(raw))
                yield raw[:n]
                left -= n
        return read

    return chunks


def state_tensors(params, ids):
    m1, m2 = _filler(1, False), _filler(2, True)
    tensors, strings, scalars = [], {}, {}
    for (path, shape), pid in zip(params, ids, strict=True):
        nbytes = math.prod(shape) * 4
        for field, fill in (("momentum.moment_1", m1), ("momentum.moment_2", m2)):
            ref = TensorRef(dtype="F32", shape=shape, nbytes_hint=nbytes, chunk_reader=fill(nbytes))
            tensors.append(PackTensor(f"{pid}.{field}", ref, param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", len(shape))
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 100)
        strings[str(pid)] = path
    return tensors, strings, scalars


def sparse_model(path: str, params, ids, prefix: str = "") -> None:
    """A burn model file whose tensor bytes are a hole (only its header is ever read)."""
    tensors = [PackTensor(prefix + p, TensorRef(dtype="F32", shape=s, nbytes_hint=math.prod(s) * 4), param_id=pid)
               for (p, s), pid in zip(params, ids, strict=True)]
    lay, _ = plan_layout(tensors, {}, {})
    with open(path, "wb") as fh:
        fh.write(MAGIC + VERSION.to_bytes(2, "little") + len(lay.metadata).to_bytes(4, "little") + lay.metadata)
        assert fh.tell() == HEADER_SIZE + len(lay.metadata)
        fh.truncate(lay.file_size)


def build(folder: str, total: int) -> dict:
    params = layout(total)
    ids = [10**18 + 7 * i for i in range(PARAMS)]
    files = {k: os.path.join(folder, k) for k in (
        "optim.bpk", "model.bpk", "model-new.bpk", "names.txt", "half1.bpk", "half2.bpk")}
    tensors, strings, scalars = state_tensors(params, ids)
    write_burnpack(files["optim.bpk"], tensors, strings, scalars)
    sparse_model(files["model.bpk"], params, ids)
    sparse_model(files["model-new.bpk"], params, [2 * 10**18 + 3 * i for i in range(PARAMS)], prefix="net.")
    with open(files["names.txt"], "w") as fh:
        fh.write("\n".join(p for p, _ in params) + "\n")
    return {"files": files, "params": params, "ids": ids, "largest": max(math.prod(s) for _, s in params) * 4}


def write_halves(files: dict) -> None:
    with BurnpackFile(files["optim.bpk"]) as src:
        pids = sorted({e.param_id for e in src.tensors.values()})
        for k, half in enumerate((pids[0::2], pids[1::2])):
            keep = set(half)
            tensors = [PackTensor(n, src.tensor(n), src.tensors[n].burn_dtype, src.tensors[n].param_id)
                       for n in src.data_order if src.tensors[n].param_id in keep]
            strings = {k2: v for k2, v in src.metadata.items() if int(k2) in keep}
            scalars = {k2: v for k2, v in src.scalars.items() if int(k2.split(".")[0]) in keep}
            write_burnpack(files[f"half{k + 1}.bpk"], tensors, strings, scalars)


def patch_one_tensor(path: str, name_hint: str) -> str:
    """Scale every value of one mid-file tensor by 1.5 in place; returns its name."""
    with BurnpackFile(path) as pack:
        pid = next(int(k) for k, v in pack.metadata.items() if v == name_hint)
        name = f"{pid}.momentum.moment_1"
        entry = pack.tensors[name]
        start = pack.data_start + entry.start
    with open(path, "r+b") as fh:
        fh.seek(start)
        values = np.frombuffer(fh.read(entry.nbytes), np.float32) * np.float32(1.5)
        fh.seek(start)
        fh.write(values.tobytes())
    return name


TIME = shutil.which("time") or "/usr/bin/time"
ENV = optional.installed_env(ROOT)  # bytecode compiled once and kept, as an install has it


def run(cmd: list[str], expect: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Wall seconds and the command's peak RSS (KiB). The peak comes from ``/usr/bin/time -v``
    (its child is exec'd from a small process: os.wait4 on a child of this one would report this
    process's own high-water mark, which the kernel carries over the exec)."""
    with tempfile.NamedTemporaryFile("w+") as report, tempfile.TemporaryFile() as err:
        wrapped = [TIME, "-f", "%M", "-o", report.name, *cmd] if os.path.exists(TIME) else cmd
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, err.fileno(), 2)]
            t = time.perf_counter()
            pid = os.posix_spawnp(wrapped[0], wrapped, ENV, file_actions=actions)
            _, status, usage = os.wait4(pid, 0)
            wall = time.perf_counter() - t
        finally:
            os.close(devnull)
        code = os.waitstatus_to_exitcode(status)
        if code not in expect:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{err.read().decode(errors='replace')[-2000:]}")
        lines = [ln for ln in report.read().split() if ln.isdigit()]
    return wall, int(lines[-1]) if wrapped is not cmd and lines else usage.ru_maxrss


def warm(paths) -> None:
    """Read files whole so that they are in the page cache (the measurements are warm-cache; an
    output statekit wrote with direct I/O is not cached until read)."""
    for path in paths:
        if path and os.path.isfile(path):
            with open(path, "rb", buffering=0) as fh:
                while fh.read(16 * MIB):
                    pass


def inputs(cmd: list[str]) -> list[str]:
    """The state files a command reads (not the sparse model files: only their headers are read)."""
    return [a for a in cmd[1:] if os.path.isfile(a) and a.endswith((".bpk", ".pt", ".safetensors"))
            and not os.path.basename(a).startswith("model")]


def best_plain(cmd: list[str], repeat: int, expect: tuple[int, ...] = (0,), cleanup: str | None = None) -> tuple[float, int]:
    """The best wall time of ``repeat`` runs (and the highest peak RSS). Each run starts as the
    baselines do: inputs in the page cache, the output file (``cleanup``) not there."""
    times, peak = [], 0
    for _ in range(repeat):
        if cleanup and os.path.exists(cleanup):
            os.remove(cleanup)
        warm(inputs(cmd))
        wall, rss = run(cmd, expect)
        times.append(wall)
        peak = max(peak, rss)
    return min(times), peak


def best_cmp(cmd: list[str], base_cmd: list[str], repeat: int) -> tuple[float, int, float]:
    """``cmd`` (which only reads) with ``cmp`` of the same files run just before each run."""
    times, bases, peak = [], [], 0
    for _ in range(repeat):
        warm(inputs(cmd))
        bases.append(run(base_cmd)[0])
        wall, rss = run(cmd)
        times.append(wall)
        peak = max(peak, rss)
    return min(times), peak, min(bases)


def best_against(cmd: list[str], base_cmd: list[str], base_out: str, base_in: str, repeat: int,
                 cleanup: str | None = None) -> tuple[float, int, float]:
    """:func:`best` of ``cmd`` with its own baseline ``base_cmd`` (writing ``base_out``, which is
    deleted after each run) run just before each of its runs, in the same state of the disk: a
    virtual disk's write speed drifts by 20-30 % from minute to minute, which a baseline measured
    only at the start and the end of the run cannot follow. (best wall, peak RSS, best base wall)."""
    times, bases, peak = [], [], 0
    for _ in range(repeat):
        for path in (base_out, cleanup):
            if path and os.path.exists(path):
                os.remove(path)
        warm([base_in])
        bases.append(run(base_cmd)[0])
        os.remove(base_out)
        warm(inputs(cmd))
        wall, rss = run(cmd)
        times.append(wall)
        peak = max(peak, rss)
    return min(times), peak, min(bases)


def measure(folder: str, total: int, args) -> tuple[list[tuple], dict]:
    sk = [sys.executable, "-m", "statekit"]
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    info = build(folder, total)
    f = info["files"]
    optim = f["optim.bpk"]
    out = {ext: os.path.join(folder, f"out.{ext}") for ext in ("pt", "bpk", "safetensors")}
    copy = os.path.join(folder, "copy.bpk")
    r = args.repeat
    rows = []

    def row(label: str, wall_rss: tuple, base: str, transposes: bool = False) -> None:
        """``wall_rss``: (wall, rss) against the run's baseline, or (wall, rss, own baseline's wall)."""
        rows.append((label, *wall_rss[:2], base, transposes, *wall_rss[2:]))

    def best(cmd: list[str], repeat: int, expect: tuple[int, ...] = (0,), cleanup: str | None = None) -> tuple:
        """Writers against cp + sync of their input run just before each run (best_against);
        the rest as measured (the module's best)."""
        if cleanup is not None and expect == (0,):  # every output is the state's size: cp + sync of it
            return best_against(cmd, cp_sync_cmd, copy, optim, repeat, cleanup)
        return best_plain(cmd, repeat, expect, cleanup)

    os.sync()  # the build's own writeback must not land on the first measurement
    # baselines: the same bytes through cp (+ fsync, as statekit's atomic writes do), and cmp;
    # measured before and again after the statekit commands, the better time kept
    cp_cmd = ["cp", optim, copy]
    cp_sync_cmd = ["sh", "-c", f"cp '{optim}' '{copy}' && sync '{copy}'"]
    row("cp", best_plain(cp_cmd, r, cleanup=copy), "cp")
    row("cp + sync", best_plain(cp_sync_cmd, r, cleanup=copy), "cp+sync")
    row("cmp (equal files)", best_plain(["cmp", optim, copy], r), "cmp")
    os.remove(copy)  # made again for diff: at 16 GiB the disk holds the input, two outputs and no more

    # the fixed cost of any command: interpreter start, imports, reading the header and metadata
    row("inspect (header only: start-up)", best([*sk, "inspect", optim, "--json"], r), "cmp")
    common = ["--optimizer", "adam", "--names", f["names.txt"]]
    row("convert bpk → pt", best([*sk, "convert", optim, out["pt"], *common, "--no-transpose", "*", *jobs], r,
                                  cleanup=out["pt"]), "cp+sync")
    row("convert bpk → pt --transpose", best([*sk, "convert", optim, out["pt"], *common, "--transpose", "*.weight",
                                              *jobs], r, cleanup=out["pt"]), "cp+sync", transposes=True)
    # the last bpk → pt (transposed) is the input of pt → bpk: transposed back
    row("convert pt → bpk --transpose", best([*sk, "convert", out["pt"], out["bpk"], "--names", f["names.txt"],
                                              "--model", f["model.bpk"], "--transpose", "*.weight", *jobs], r,
                                             cleanup=out["bpk"]), "cp+sync", transposes=True)
    run([*sk, "convert", optim, out["pt"], *common, "--no-transpose", "*", *jobs])
    row("convert pt → bpk", best([*sk, "convert", out["pt"], out["bpk"], "--names", f["names.txt"], "--model",
                                  f["model.bpk"], "--no-transpose", "*", *jobs], r, cleanup=out["bpk"]), "cp+sync")
    os.remove(out["pt"])
    row("convert bpk → safetensors", best([*sk, "convert", optim, out["safetensors"], *jobs], r,
                                           cleanup=out["safetensors"]), "cp+sync")
    row("convert safetensors → bpk", best([*sk, "convert", out["safetensors"], out["bpk"], *jobs], r,
                                           cleanup=out["bpk"]), "cp+sync")
    os.remove(out["safetensors"])
    row("remap (200 renames, new ids)", best([*sk, "remap", optim, "--model", f["model-new.bpk"], "-o", out["bpk"],
                                              "--rename", "^(.*)$=net.$1", *jobs], r, cleanup=out["bpk"]),
        "cp+sync")
    os.remove(out["bpk"])
    for i, cmd in ((0, cp_cmd), (1, cp_sync_cmd), (2, ["cmp", optim, copy])):  # baselines again (cp makes copy)
        again = best_plain(cmd, r, cleanup=copy if i != 2 else None)
        rows[i] = (rows[i][0], min(rows[i][1], again[0]), max(rows[i][2], again[1]), *rows[i][3:])
    if not os.path.exists(copy):
        run(cp_cmd)
    row("diff A B (equal files)", best_cmp([*sk, "diff", optim, copy, *jobs], ["cmp", optim, copy], r), "cmp")
    patch_one_tensor(copy, "layers.50.weight")
    row("diff A B (one tensor differs)", best([*sk, "diff", optim, copy, *jobs], r, expect=(1,)), "cmp")
    os.remove(copy)
    row("inspect --stats", best([*sk, "inspect", optim, "--stats", "--json"], r), "cmp")
    row("doctor", best([*sk, "doctor", optim, *jobs], r, expect=(0, 1)), "cmp")
    write_halves(f)
    row("merge (two halves)", best([*sk, "merge", f["half1.bpk"], f["half2.bpk"], "-o", out["bpk"], *jobs], r,
                                    cleanup=out["bpk"]), "cp+sync")
    for path in (*f.values(), *out.values()):
        if os.path.exists(path):
            os.remove(path)
    return rows, {"size": total, "largest": info["largest"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--big", action="store_true", help="add a 16 GiB state")
    ap.add_argument("--jobs", type=int, default=None, help="--jobs for statekit (default: its own, the cores)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per command; the best time is kept")
    ap.add_argument("--dir", default="/tmp", help="where the temporary folder goes")
    args = ap.parse_args()
    sizes = list(args.sizes_gib) + ([16.0] if args.big else [])
    jobs = args.jobs or len(os.sched_getaffinity(0))
    results = []
    print(optional.line())
    folder = tempfile.mkdtemp(prefix="statekit-scale-", dir=args.dir)
    try:
        for gib in sizes:
            rows, facts = measure(folder, int(gib * (1 << 30)), args)
            results.append((gib, rows, facts))
            report(gib, rows, facts, jobs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    growth(results)
    print(f"\nload: {open('/proc/loadavg').read().split()[:3]} on {os.cpu_count()} cores; statekit --jobs {jobs}")


GOALS = {  # issue 11's "Done when": the most × its baseline (cp + sync for writers, cmp for diff)
    "convert bpk → pt": 1.3, "convert pt → bpk": 1.3, "convert bpk → safetensors": 1.3,
    "convert safetensors → bpk": 1.3, "remap (200 renames, new ids)": 1.3,
    "convert bpk → pt --transpose": 2.0, "convert pt → bpk --transpose": 2.0,
    "diff A B (equal files)": 1.5, "diff A B (one tensor differs)": 2.0,
}


def report(gib: float, rows, facts: dict, jobs: int) -> None:
    base = {b: w for label, w, _, b, *_ in rows if label in ("cp", "cp + sync", "cmp (equal files)")
            for b in [{"cp": "cp", "cp + sync": "cp+sync", "cmp (equal files)": "cmp"}[label]]}
    limit_plain = 100 + 64 * jobs
    limit_t = 100 + 2 * facts["largest"] / MIB
    print(f"\n{facts['size'] / 2**30:g} GiB state, {PARAMS} parameters, largest tensor {facts['largest'] / MIB:.0f} MiB")
    start = next(w for label, w, *_ in rows if label.startswith("inspect (header only"))
    print(f"{'command':<32} {'wall s':>8} {'× base':>7} {'base':>8} {'base s':>6} {'× cp':>6} {'(wall-start)/base':>18} "
          f"{'peak RSS':>10} {'RSS limit':>10}  Done when")
    for label, wall, rss, b, transposes, *own in rows:
        limit = limit_t if transposes else limit_plain
        against = own[0] if own else base.get(b)
        ratio = wall / against if against else float("nan")
        net = (wall - start) / against if b and not label.startswith(("cp", "cmp", "inspect (header")) else ratio
        goal = GOALS.get(label)
        verdict = "" if goal is None else (
            f"≤ {goal:g} × {b}: {'met' if ratio <= goal else 'NOT met'}; RSS {'met' if rss / 1024 <= limit else 'NOT met'}")
        print(f"{label:<32} {wall:>8.2f} {ratio:>7.2f} {b:>8} {against or float('nan'):>6.2f} {wall / base['cp']:>6.2f} "
              f"{net:>18.2f} {rss / 1024:>8.0f}Mi {limit:>8.0f}Mi  {verdict}")
    print("start-up = `statekit inspect` of the same file (interpreter, imports, header); (wall-start)/base is "
          "the data path alone against the baseline; base s = the baseline each ratio is against: for the "
          "writers and diff of equal files, their own (cp + sync of the input, or cmp) run just before each of "
          "their runs, best of as many")
    sys.stdout.flush()


def growth(results) -> None:
    if len(results) < 2:
        return
    print("\ngrowth from size to size (time should grow with the bytes, peak RSS should not)")
    labels = [r[0] for r in results[0][1]]
    head = " ".join(f"{f'{a:g}→{b:g} GiB':>20}" for (a, _, _), (b, _, _) in zip(results, results[1:], strict=False))
    print(f"{'command':<32} {'peak RSS per size (MiB)':>28}  {head}")
    for i, label in enumerate(labels):
        rss = "/".join(f"{res[1][i][2] / 1024:.0f}" for res in results)
        steps = []
        for (_, ra, _), (_, rb, _) in zip(results, results[1:], strict=False):
            steps.append(f"time ×{rb[i][1] / ra[i][1]:5.2f} RSS ×{rb[i][2] / ra[i][2]:4.2f}")
        print(f"{label:<32} {rss:>28}  " + " ".join(f"{s:>20}" for s in steps))


if __name__ == "__main__":
    main()
