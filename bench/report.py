#!/usr/bin/env python3
"""``statekit report`` against ``inspect --stats`` of the same file, in the same run.

Builds a burn Adam state of 1 GiB (``--size-gib``) as ``bench/scale.py`` does (200 parameters,
the largest 64 MiB per moment at 1 GiB), then runs, in fresh processes, warm cache, alternating:

    statekit inspect STATE --stats --json       (the baseline: reads every byte once)
    statekit report STATE --json                (reads every byte once, more arithmetic per byte)
    statekit report STATE --against STATE --json   (two states side by side)

and prints the best wall time of ``--repeat`` runs, the ratio to inspect --stats, and the peak
RSS of each (``/usr/bin/time``), against the limits: report ≤ 1.5 × inspect --stats, peak RSS ≤
228 MiB.

Usage: python bench/report.py [--size-gib 1] [--repeat 3] [--jobs N] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import scale  # noqa: E402

from statekit.formats.burnpack import write_burnpack  # noqa: E402

TIME_LIMIT = 1.5
RSS_LIMIT_MIB = 228


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    total = int(args.size_gib * (1 << 30))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="statekit-report-bench-") as folder:
        state = os.path.join(folder, "optim.bpk")
        params = scale.layout(total)
        ids = [10**18 + 7 * i for i in range(scale.PARAMS)]
        write_burnpack(state, *scale.state_tensors(params, ids))
        sk = [sys.executable, "-m", "statekit"]
        jobs = ["--jobs", str(args.jobs)] if args.jobs else []
        cmds = {
            "inspect --stats": [*sk, "inspect", state, "--stats", "--json", *jobs],
            "report": [*sk, "report", state, "--json", *jobs],
            "report --against (same size)": [*sk, "report", state, "--against", state, "--json", *jobs],
        }
        best = {k: (float("inf"), 0) for k in cmds}
        for _ in range(args.repeat):  # alternating, so that each sees the machine in the same state
            for label, cmd in cmds.items():
                scale.warm([state])
                wall, rss = scale.run(cmd)
                best[label] = (min(best[label][0], wall), max(best[label][1], rss))
        size = os.path.getsize(state)
    base = best["inspect --stats"][0]
    print(f"state: {size / (1 << 30):.2f} GiB burn Adam, {scale.PARAMS} parameters; best of {args.repeat}; "
          f"jobs {args.jobs or os.cpu_count()}; cores {os.cpu_count()}")
    print("| command | seconds | × inspect --stats | peak RSS MiB | limits |")
    print("|---|---|---|---|---|")
    ok = True
    for label, (wall, rss) in best.items():
        mib = rss / 1024
        limit = ""
        if label == "report":
            good = wall <= TIME_LIMIT * base and mib <= RSS_LIMIT_MIB
            ok &= good
            limit = f"≤ {TIME_LIMIT}×, ≤ {RSS_LIMIT_MIB} MiB: {'met' if good else 'NOT met'}"
        print(f"| {label} | {wall:.2f} | {wall / base:.2f} | {mib:.0f} | {limit} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
