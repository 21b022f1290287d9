#!/usr/bin/env python3
"""Does `inspect` stay flat as files grow, and does a round-trip copy stay near one tensor of memory?

Builds burnpack optimizer files of growing size (same number of parameters, larger tensors) in a
temporary folder, then for each size measures, in fresh processes:
- `statekit inspect` wall time (header and metadata only), against the smallest file's time;
- a round-trip copy (`statekit convert A.bpk B.bpk`) wall time, throughput and peak RSS, against
  the largest tensor's size and `cp` + `sync` of the same file measured in the same run.

Usage: python bench/burnpack_scale.py [--sizes-gib 0.25 1 4] [--params 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402


def build(path: str, total_bytes: int, params: int) -> int:
    """An Adam-layout optimizer file: `params` parameters × 2 moments, filled block by block."""
    per_tensor = total_bytes // (2 * params) // 4 * 4
    numel = per_tensor // 4
    block = np.arange(1 << 20, dtype=np.float32)

    def chunks(size: int):
        remaining = per_tensor
        raw = block.tobytes()
        while remaining:
            n = min(remaining, len(raw), size)
            yield raw[:n]
            remaining -= n

    tensors, scalars, meta = [], {}, {}
    for i in range(params):
        pid = 10**18 + i
        for field in ("momentum.moment_1", "momentum.moment_2"):
            ref = TensorRef(dtype="F32", shape=(numel,), nbytes_hint=per_tensor, chunk_reader=chunks)
            tensors.append(PackTensor(f"{pid}.{field}", ref, param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", 1)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 100)
        meta[str(pid)] = f"layers.{i}.weight"
    write_burnpack(path, tensors, meta, scalars)
    return per_tensor


def timed(cmd: list[str], repeat: int = 3) -> tuple[float, int]:
    """Best wall time of `repeat` runs, and the peak RSS (KiB) of the children."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t)
    return best, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def peak_rss_kib(cmd: list[str]) -> int:
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    return int(subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--params", type=int, default=8)
    ap.add_argument("--keep", help="folder to build in (kept); default: a temporary folder")
    args = ap.parse_args()
    statekit = [sys.executable, "-m", "statekit"]
    folder = args.keep or tempfile.mkdtemp(prefix="statekit-bench-")
    os.makedirs(folder, exist_ok=True)
    rows = []
    try:
        for gib in args.sizes_gib:
            src = os.path.join(folder, f"optim-{gib:g}GiB.bpk")
            dst = os.path.join(folder, "copy.bpk")
            per_tensor = build(src, int(gib * (1 << 30)), args.params)
            size = os.path.getsize(src)
            t_inspect, _ = timed([*statekit, "inspect", src, "--json"])
            t_copy, _ = timed([*statekit, "convert", src, dst], repeat=1)
            rss_copy = peak_rss_kib([*statekit, "convert", src, dst])
            # baseline: the same bytes copied by cp, then flushed to disk as statekit's atomic write does
            t_cp, _ = timed(["sh", "-c", f"cp '{src}' '{dst}' && sync '{dst}'"], repeat=1)
            rss_inspect = peak_rss_kib([*statekit, "inspect", src, "--json"])
            os.remove(dst)
            os.remove(src)
            rows.append((size, per_tensor, t_inspect, rss_inspect, t_copy, t_cp, rss_copy))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    base_inspect = rows[0][2]
    print(f"{'file':>10} {'largest tensor':>15} {'inspect s':>10} {'× smallest':>10} {'inspect RSS':>12} "
          f"{'copy s':>8} {'copy GB/s':>10} {'cp+sync s':>9} {'copy/cp':>8} {'copy RSS':>10} {'RSS/tensor':>11}")
    for size, per_tensor, ti, ri, tc, tcp, rc in rows:
        print(f"{size / 2**30:>8.2f}Gi {per_tensor / 2**20:>13.0f}Mi {ti:>10.3f} {ti / base_inspect:>10.2f} "
              f"{ri / 1024:>10.0f}Mi {tc:>8.2f} {size / tc / 1e9:>10.2f} {tcp:>9.2f} {tc / tcp:>8.2f} "
              f"{rc / 1024:>8.0f}Mi {rc * 1024 / per_tensor:>11.2f}")
    print("inspect reads the header and metadata only; copy streams tensors in 16 MiB pieces.")


if __name__ == "__main__":
    main()
