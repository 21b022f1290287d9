#!/usr/bin/env python3
"""Long fuzz runs: mutated files per reader group through the Python API, in guarded workers.

    python3 scripts/fuzz.py --cases 100000                    # every reader group
    python3 scripts/fuzz.py --cases 5000 --groups burnpack gzip --jobs 2 --start 1000000

Each case (group, seed) is made by ``tests/fuzz/harness.py`` and run in a worker subprocess that
has a per-case time limit (``--timeout``, SIGALRM, and a watchdog in this process that kills a
worker that stops answering) and a memory limit (peak RSS checked after every case, ``--rss-mib``;
address space capped at 4x that as a backstop). A case passes when it ends in a result or a
``StatekitError``; anything else — another exception, a hang, too much memory, a dead worker —
is a crasher: its bytes are kept under ``fixtures/fuzz-corpus/`` (at most ``--keep`` files per
distinct failure) and replayed by ``tests/fuzz/test_corpus.py`` from then on.

Prints a table per group: cases, crashers, rate, slowest case, peak RSS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402


class CaseTimeout(BaseException):
    """Raised by SIGALRM inside a case (a BaseException so that no ``except Exception`` eats it)."""


def _alarm(signum, frame):
    raise CaseTimeout()


def worker(timeout: float, rss_mib: int) -> None:
    """Read ``group seed`` lines, answer one JSON line per case."""
    limit = rss_mib * 4 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    tmp = Path(tempfile.mkdtemp(prefix="statekit-fuzz-"))
    for line in sys.stdin:
        group, seed = line.split()
        seed = int(seed)
        answer: dict = {"group": group, "seed": seed}
        try:
            data = harness.make_case(group, seed)
            path = tmp / f"case{harness.EXTENSIONS[group]}"
            path.write_bytes(data)
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                answer["outcome"] = harness.exercise(path, tmp, seed)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            answer["seconds"] = time.perf_counter() - start
        except CaseTimeout:
            answer.update(outcome="crash", kind="hang", detail=f"over {timeout} s")
        except Exception as exc:  # noqa: BLE001 - this is what the fuzzer looks for
            frames = traceback.extract_tb(exc.__traceback__)
            frame = next((f for f in reversed(frames) if "/statekit/" in f.filename), frames[-1])
            where = f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
            answer.update(outcome="crash", kind=type(exc).__name__, where=where, detail=str(exc)[:300])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
        answer["rss_mib"] = peak
        if peak > rss_mib and answer.get("outcome") != "crash":
            answer.update(outcome="crash", kind="rss", detail=f"peak RSS {peak} MiB")
        for leftover in tmp.iterdir():
            leftover.unlink()
        print(json.dumps(answer), flush=True)
        if peak > rss_mib:
            return  # a fresh worker measures the next case from a clean peak


class Worker:
    def __init__(self, args):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--timeout", str(args.timeout), "--rss-mib", str(args.rss_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.case: tuple[str, int] | None = None
        self.since = 0.0

    def send(self, group: str, seed: int) -> None:
        self.case, self.since = (group, seed), time.monotonic()
        self.proc.stdin.write(f"{group} {seed}\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def save_crasher(answer: dict, counts: dict, keep: int) -> str | None:
    signature = (answer["group"], answer.get("kind"), answer.get("where"))
    counts[signature] = counts.get(signature, 0) + 1
    if counts[signature] > keep:
        return None
    data = harness.make_case(answer["group"], answer["seed"])
    harness.CORPUS.mkdir(parents=True, exist_ok=True)
    name = f"{answer['group']}-{hashlib.sha256(data).hexdigest()[:12]}{harness.EXTENSIONS[answer['group']]}"
    (harness.CORPUS / name).write_bytes(data)
    return name


def run(args) -> int:
    # round robin over the groups, so that a run stopped by --minutes has covered each alike
    cases = [(g, s) for s in range(args.start, args.start + args.cases) for g in args.groups]
    cases.reverse()
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else None
    for g in args.groups:
        harness.seeds(g)  # fail early if a seed cannot be made
    stats = {g: {"cases": 0, "crashers": 0, "seconds": 0.0, "slowest": 0.0, "rss": 0, "errors": 0} for g in args.groups}
    counts: dict = {}
    crashers = []
    workers = [Worker(args) for _ in range(args.jobs)]
    sel = selectors.DefaultSelector()
    for w in workers:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
    started = time.monotonic()
    idle = list(workers)
    busy = 0
    last_report = started

    def record(answer: dict) -> None:
        s = stats[answer["group"]]
        s["cases"] += 1
        s["seconds"] += answer.get("seconds", 0.0)
        s["slowest"] = max(s["slowest"], answer.get("seconds", 0.0))
        s["rss"] = max(s["rss"], answer.get("rss_mib", 0))
        if answer["outcome"] == "crash":
            s["crashers"] += 1
            answer["file"] = save_crasher(answer, counts, args.keep)
            crashers.append(answer)
            print(f"CRASH {answer['group']} {answer['seed']}: {answer.get('kind')} {answer.get('where', '')} "
                  f"{answer.get('detail', '')[:160]}", flush=True)
        elif answer["outcome"] != "ok":
            s["errors"] += 1

    stop = []
    signal.signal(signal.SIGINT, lambda *a: stop.append("interrupted"))
    signal.signal(signal.SIGTERM, lambda *a: stop.append("terminated"))
    while cases or busy:
        if stop and cases:
            print(f"... {stop[0]}: {len(cases)} cases not run", flush=True)
            cases.clear()
        if deadline is not None and time.monotonic() > deadline and cases:
            print(f"... --minutes {args.minutes} reached: {len(cases)} cases not run", flush=True)
            cases.clear()
        while idle and cases:
            w = idle.pop()
            w.send(*cases.pop())
            busy += 1
        for key, _ in sel.select(timeout=1.0):
            w = key.data
            line = w.proc.stdout.readline()
            busy -= 1
            if line:
                record(json.loads(line))
            else:  # the worker died (a signal, the address-space cap): that case is a crasher
                group, seed = w.case
                record({"group": group, "seed": seed, "outcome": "crash", "kind": "worker-died",
                        "detail": f"exit {w.proc.wait()}"})
            if w.proc.poll() is None:
                idle.append(w)
            else:
                sel.unregister(w.proc.stdout)
                workers.remove(w)
                nw = Worker(args)
                workers.append(nw)
                sel.register(nw.proc.stdout, selectors.EVENT_READ, nw)
                idle.append(nw)
        now = time.monotonic()
        for w in list(workers):
            if w not in idle and now - w.since > args.timeout * 3 + 30:
                group, seed = w.case
                sel.unregister(w.proc.stdout)
                w.kill()
                busy -= 1
                record({"group": group, "seed": seed, "outcome": "crash", "kind": "hang-killed",
                        "detail": "no answer from the worker"})
                workers.remove(w)
                nw = Worker(args)
                workers.append(nw)
                sel.register(nw.proc.stdout, selectors.EVENT_READ, nw)
                idle.append(nw)
        if now - last_report > 60:
            last_report = now
            done = sum(s["cases"] for s in stats.values())
            crashed = sum(s["crashers"] for s in stats.values())
            print(f"... {done} cases, {crashed} crashers in {now - started:.0f} s", flush=True)
    for w in workers:
        w.proc.stdin.close()
        w.proc.wait()
    wall = time.monotonic() - started
    print(f"\n{'group':<14}{'cases':>9}{'crashers':>10}{'refused':>9}{'ms/case':>9}{'slowest s':>11}{'peak RSS MiB':>14}")
    for g, s in stats.items():
        print(f"{g:<14}{s['cases']:>9}{s['crashers']:>10}{s['errors']:>9}{1000 * s['seconds'] / max(s['cases'], 1):>9.1f}"
              f"{s['slowest']:>11.2f}{s['rss']:>14}")
    total = sum(s["cases"] for s in stats.values())
    print(f"{'all':<14}{total:>9}{sum(s['crashers'] for s in stats.values()):>10}{'':>9}{1000 * wall / max(total, 1):>9.1f}"
          f"   wall {wall:.0f} s ({total / wall:.1f} cases/s), {args.jobs} worker(s), first seed {args.start}")
    if args.report:
        Path(args.report).write_text(json.dumps({"wall_s": wall, "jobs": args.jobs, "start": args.start,
                                                 "stats": stats, "crashers": crashers}, indent=1))
    return 1 if crashers else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases per reader group")
    parser.add_argument("--groups", nargs="+", default=list(harness.GROUPS), choices=harness.GROUPS)
    parser.add_argument("--start", type=int, default=0, help="first case seed")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per case")
    parser.add_argument("--rss-mib", type=int, default=1024, help="peak RSS per worker")
    parser.add_argument("--keep", type=int, default=3, help="corpus files kept per distinct failure")
    parser.add_argument("--report", help="write the counts and crashers as JSON here")
    parser.add_argument("--minutes", type=float, help="stop starting cases after this long (counts say how many ran)")
    parser.add_argument("--replay", nargs=2, metavar=("GROUP", "SEED"), help="run one case here, with its traceback")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        group, seed = args.replay[0], int(args.replay[1])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"case{harness.EXTENSIONS[group]}"
            path.write_bytes(harness.make_case(group, seed))
            print(harness.exercise(path, tmp, seed))
        return 0
    if args.worker:
        worker(args.timeout, args.rss_mib)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
