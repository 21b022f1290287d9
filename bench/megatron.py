#!/usr/bin/env python3
"""What does reading a ~1 GiB Megatron optimizer checkpoint cost, against ``cp -r`` of the folder?

Builds, with the real megatron-core (``scripts/make_megatron_fixtures.py`` run by the venv of
``--mcore-python``, on CPU, gloo), one checkpoint of each main layout, scaled up from the fixtures'
tiny GPT to hidden 1024, ffn 2304, 6 layers, vocab 8192 (~75 M parameters: bf16 weights + fp32
master, exp_avg, exp_avg_sq ≈ 1 GiB):

- ``gpt_torch_dist_dp_reshardable_tp1pp1dp2``: torch_dist, distributed optimizer, dp_reshardable;
- ``gpt_torch_dist_fully_reshardable_tp2pp1dp2``: torch_dist, fully_reshardable (model space), TP2;
- ``gpt_torch_distopt_tp2pp2dp1``: legacy torch, ``distrib_optim.pt`` per rank, TP2·PP2.

Then, per checkpoint, each command's wall time and peak RSS (``os.wait4``): ``statekit inspect``
(which proves every fp32 master against its bf16 weight, so reads every byte of both), ``inspect
--stats`` (reads the moments too), and ``statekit diff`` of the folder against itself (reads it
twice); baselines measured in the same run: ``cp -r`` of the folder (into the same file system,
then ``sync``) and ``cat`` of every file ``> /dev/null``. "cold" runs start with the folder's pages
dropped from the page cache (``posix_fadvise(DONTNEED)`` on every file, no root needed), "warm"
ones after a read of it. Each time is the best of ``--repeat`` runs. The ratio columns divide by
``cp -r`` in the same state (cold by cold, warm by warm).

Each command runs with its bytecode cached (``PYTHONPYCACHEPREFIX`` under the bench's temporary
folder, ``PYTHONDONTWRITEBYTECODE`` dropped; one untimed run first), as an installed package runs:
without it every run compiles statekit's modules again (~0.25 s of CPU).

The machine this was written on is a shared 2-core box: the load average is printed; read the
ratios, not the absolute numbers, when it is high.

Usage: python bench/megatron.py [--dir /tmp] [--keep DIR] [--repeat 3]
  (``--keep DIR``: build into DIR once and reuse it on the next run; keep it outside the
  repository, e.g. /tmp/mcore-bench: it is ~3 GiB and never committed.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATOR = os.path.join(ROOT, "scripts", "make_megatron_fixtures.py")
MCORE_PYTHON = "/work/venvs/mcore-0.19.2/bin/python"
VERSION = "0.19.2"
CASES = [
    ("gpt_torch_dist_dp_reshardable_tp1pp1dp2", "torch_dist dp_reshardable"),
    ("gpt_torch_dist_fully_reshardable_tp2pp1dp2", "torch_dist fully_reshardable"),
    ("gpt_torch_distopt_tp2pp2dp1", "legacy distrib_optim"),
]
MODEL_ARGS = ("--hidden-size 1024 --ffn-hidden-size 2304 --num-layers 6 --num-attention-heads 16 "
              "--num-query-groups 4 --kv-channels 64 --vocab-size 8192 --train-iters 3")


def build(root: str, python: str) -> None:
    missing = [c for c, _ in CASES if not os.path.isdir(os.path.join(root, VERSION, c))]
    if not missing:
        return
    t = time.perf_counter()
    cmd = [python, GENERATOR, "--out", root, "--port", "29671", "--model-args", MODEL_ARGS]
    for c in missing:
        cmd += ["--case", c]
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir())
    print(f"built {len(missing)} checkpoint(s) with megatron-core in {time.perf_counter() - t:.0f} s")


def _files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def _bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in _files(path))


def evict(path: str) -> None:
    """Drop the folder's pages from the page cache (clean pages only: they are)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: str) -> None:
    for f in _files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


PYCACHE = os.path.join(tempfile.gettempdir(), "statekit-bench-pycache")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=PYCACHE)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(cmd: list[str] | str, shell: bool = False) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one command; its failure stops the bench."""
    env = _env()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{cmd} failed: {err.strip()[-2000:]}")
    return secs, usage.ru_maxrss * 1024


def measure(src: str, tmp: str, repeat: int) -> dict[str, dict[str, tuple[float, int]]]:
    copy = os.path.join(tmp, "copy")

    def cp() -> list[str]:
        if os.path.exists(copy):
            shutil.rmtree(copy)
        return ["sh", "-c", f"cp -r '{src}' '{copy}' && sync"]

    sk = [sys.executable, "-m", "statekit"]
    commands = {
        "cp -r + sync": cp,
        "cat > /dev/null": lambda: ["sh", "-c", f"find '{src}' -type f -exec cat {{}} + > /dev/null"],
        "inspect": lambda: sk + ["inspect", src],
        "inspect --stats": lambda: sk + ["inspect", "--stats", src],
        "diff self": lambda: sk + ["diff", src, src],
    }
    out: dict[str, dict[str, tuple[float, int]]] = {}
    _run(commands["inspect --stats"]())  # (untimed: writes the bytecode cache)
    for name, make in commands.items():
        out[name] = {}
        for state in ("cold", "warm"):
            best = None
            for _ in range(repeat):
                if state == "cold":
                    evict(src)
                else:
                    warm(src)
                os.sync()
                got = _run(make())
                best = got if best is None or got[0] < best[0] else best
            out[name][state] = best
    if os.path.exists(copy):
        shutil.rmtree(copy)
    return out


# (label, source case, convert arguments after SRC DST, DST's last component)
CONVERSIONS = [
    ("→ torch_dist TP2 (fully_reshardable)", CASES[0][0], ["--to", "megatron", "--tp", "2"], "out"),
    ("→ torch_dist dp_reshardable (TP1)", CASES[0][0], ["--to", "megatron", "--sharding", "dp_reshardable"], "out"),
    ("legacy → TP1·PP1 (megatron-legacy)", CASES[2][0], ["--to", "megatron-legacy", "--tp", "1", "--pp", "1"], "out"),
    ("→ HF Trainer folder", CASES[0][0], ["--to", "hf-trainer"], "checkpoint-3"),
]


def measure_convert(src: str, tmp: str, repeat: int, rows: list[tuple[str, list[str], str]]
                    ) -> dict[str, dict[str, tuple[float, int]]]:
    """Each conversion of ``src`` (written into ``tmp``, then ``sync``) against ``cp -r`` of it."""
    out_root = os.path.join(tmp, "convert")
    sk = f"'{sys.executable}' -m statekit convert"

    def fresh() -> None:
        if os.path.exists(out_root):
            shutil.rmtree(out_root)
        os.makedirs(out_root)

    def cp() -> list[str]:
        fresh()
        return ["sh", "-c", f"cp -r '{src}' '{out_root}/copy' && sync"]

    def convert(args: list[str], leaf: str):
        def make() -> list[str]:
            fresh()
            quoted = " ".join(f"'{a}'" for a in args)
            return ["sh", "-c", f"{sk} '{src}' '{out_root}/{leaf}' {quoted} && sync"]
        return make

    commands = {"cp -r + sync": cp}
    for name, args, leaf in rows:
        commands[name] = convert(args, leaf)
    out: dict[str, dict[str, tuple[float, int]]] = {}
    for make in list(commands.values())[1:]:
        _run(make())  # (untimed: writes the bytecode cache, and fails early)
    for name, make in commands.items():
        out[name] = {}
        for state in ("cold", "warm"):
            best = None
            for _ in range(repeat):
                cmd = make()
                if state == "cold":
                    evict(src)
                else:
                    warm(src)
                os.sync()
                got = _run(cmd)
                best = got if best is None or got[0] < best[0] else best
            out[name][state] = best
    if os.path.exists(out_root):
        shutil.rmtree(out_root)
    return out


def table(label: str, nbytes: int, res: dict[str, dict[str, tuple[float, int]]]) -> str:
    base = res["cp -r + sync"]
    head = (f"| {label} ({nbytes / 2**30:.2f} GiB) | cold s | × cp cold | warm s | × cp warm | GB/s warm "
            f"| peak RSS MiB |")
    lines = [head, "|" + "---|" * 7]
    for name, r in res.items():
        rss = max(r["cold"][1], r["warm"][1]) / 2**20
        lines.append(f"| {name} | {r['cold'][0]:.2f} | {r['cold'][0] / base['cold'][0]:.2f} | {r['warm'][0]:.2f} "
                     f"| {r['warm'][0] / base['warm'][0]:.2f} | {nbytes / r['warm'][0] / 1e9:.2f} | {rss:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the copies and a temporary build go")
    ap.add_argument("--keep", help="build into (and reuse) this folder instead of a temporary one")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mcore-python", default=MCORE_PYTHON, help="a python with megatron-core (see the generator)")
    ap.add_argument("--case", action="append", help="only these cases")
    ap.add_argument("--only", choices=("read", "convert"), help="only the reading or the converting rows")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = args.keep or os.path.join(tmp, "build")
        build(root, args.mcore_python)
        for case, label in CASES:
            if (args.case and case not in args.case) or args.only == "convert":
                continue
            src = os.path.join(root, VERSION, case)
            print("\n" + table(label, _bytes(src), measure(src, tmp, args.repeat)), flush=True)
        for case, label in CASES:
            rows = [(name, a, leaf) for name, c, a, leaf in CONVERSIONS if c == case]
            if not rows or (args.case and case not in args.case) or args.only == "read":
                continue
            src = os.path.join(root, VERSION, case)
            res = measure_convert(src, tmp, args.repeat, rows)
            print("\n" + table(f"convert {label}", _bytes(src), res), flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
