#!/usr/bin/env python3
"""Resource bombs and large valid files: time and peak memory, each in a fresh process.

    PYTHONPATH=. python3 bench/robustness.py            # bombs, renames, .pt of 10^4..10^6 tensors
    PYTHONPATH=. python3 bench/robustness.py --max-tensors 100000

Every bomb must be refused (a StatekitError) in ≤ 1 s and ≤ 200 MiB; the baseline row, measured in
the same run, is opening a small valid file, so the ratios say what a bomb costs over nothing. The
.pt rows read a valid torch.save-layout file of N one-element tensors sharing one storage; "per
tensor" staying flat as N grows is the linear-time claim (goal: 10^6 tensors in ≤ 10 s and, as
for every fuzz case, ≤ 1 GiB peak RSS). "marginal" is the time a tensor from the row above to this
one (start-up cancels: flat means linear); "x 10 s" and "x 1 GiB" are the 10^6 row's wall time
and peak RSS over the goals (≤ 1.00 meets them). The machine's load (``uptime``) and CPU seconds
say how far a busy machine inflated the wall time.

Then issue 21's table (``--views N``, default 10^6; ``--only-views`` for it alone, ``--no-stats``
to leave ``inspect --stats`` out): the N-view file in torch.save's own opcodes, pickled without
a memo (``Pickler.fast``, as other writers do) and with ``MARK … TUPLE`` tuples (issue 29's
third form), each opened and inspected (table, TSV, JSON, ``--stats``) in a fresh process;
goals: open ≤ 10 s, inspect ≤ 30 s, ``--stats`` ≤ 45 s, each ≤ 1 GiB, whatever the form.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------- files


def torch_zip(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        for key, data in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", b"3\n")


def hyper_dict(value: bytes) -> bytes:
    """A pickle of ``{"param_groups": [{"lr": <value>}], "state": {}}`` with ``value`` opcodes."""
    P = pickle
    s = P.PROTO + b"\x02" + P.EMPTY_DICT + P.BINUNICODE + struct.pack("<I", 5) + b"state" + P.EMPTY_DICT + P.SETITEM
    s += P.BINUNICODE + struct.pack("<I", 12) + b"param_groups" + P.EMPTY_LIST + P.EMPTY_DICT
    s += P.BINUNICODE + struct.pack("<I", 2) + b"lr" + value + P.SETITEM + P.APPEND + P.SETITEM + P.STOP
    return s


def memo_laughs(levels: int = 40) -> bytes:
    P = pickle
    s = P.NONE
    for i in range(levels):
        s += P.BINPUT + bytes([i]) + P.POP + P.MARK + P.BINGET + bytes([i]) + P.BINGET + bytes([i]) + P.LIST
    return s


def deep_list(depth: int) -> bytes:
    return (pickle.EMPTY_LIST + pickle.MARK) * depth + pickle.NONE + pickle.APPENDS * depth


def self_list() -> bytes:
    return pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND


def burnpack_many(path: Path, n: int) -> None:
    from statekit.formats import cbor

    tensors = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = cbor.encode({"tensors": tensors})
    path.write_bytes(b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw)


def gzip_bomb(path: Path, inflated: int) -> None:
    """A .mpk.gz whose stream inflates to ``inflated`` bytes (a msgpack header, then zeros)."""
    import zlib

    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    head = b"\x83\xa8metadata"
    with open(path, "wb") as fh:
        fh.write(comp.compress(head))
        zeros = b"\0" * (16 << 20)
        for _ in range(inflated // len(zeros)):
            fh.write(comp.compress(zeros))
        fh.write(comp.flush())


#: the pickle forms of the N-view file: torch.save's own opcodes, the same objects pickled without
#: a memo (``Pickler.fast``: every global, string and OrderedDict() written out again for each
#: tensor, as other writers do), and with every tuple as ``MARK … TUPLE`` (protocol 1's tuples in a
#: protocol-2 pickle, where the other two write TUPLE1: CPython's pure-Python pickler, its
#: ``save_tuple`` told so)
FORMS = ("torch.save", "no memo", "MARK…TUPLE")


def shared_storage_pt(path: Path, n: int, form: str = "torch.save") -> None:
    """torch.save's layout for ``{f"t{i}": base[i:i+1]}``: n views of one n-element storage, written
    with CPython's pickler and stand-in globals (torch.save itself takes minutes for 10^6), each
    view's size and stride a new tuple as torch.save writes them, in one of :data:`FORMS`."""
    code = f"""
import collections, io, pickle, sys, types, zipfile
torch = types.ModuleType("torch"); utils = types.ModuleType("torch._utils")
sys.modules.update(torch=torch, **{{"torch._utils": utils}})
class FloatStorage: pass
FloatStorage.__module__ = "torch"; torch.FloatStorage = FloatStorage
def _rebuild_tensor_v2(*a): pass
_rebuild_tensor_v2.__module__ = "torch._utils"; utils._rebuild_tensor_v2 = _rebuild_tensor_v2
class View:
    def __init__(self, i): self.i = i
    def __reduce__(self):  # (size and stride: new tuples, as tuple(t.size()) and t.stride() are)
        return (_rebuild_tensor_v2, (STORAGE, self.i, tuple([1]), tuple([1]), False, collections.OrderedDict()))
STORAGE = object()
class MarkTuple(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()
    def save_tuple(self, obj):
        if not obj:
            self.write(pickle.EMPTY_TUPLE); return
        self.write(pickle.MARK)
        for item in obj:
            self.save(item)
        self.write(pickle.TUPLE); self.memoize(obj)
    dispatch[tuple] = save_tuple
form = {form!r}
class P(MarkTuple if form == "MARK…TUPLE" else pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", FloatStorage, "0", "cpu", {n}) if obj is STORAGE else None
buf = io.BytesIO()
pickler = P(buf, protocol=2)
pickler.fast = form == "no memo"
pickler.dump(collections.OrderedDict((f"t{{i}}", View(i)) for i in range({n})))
with zipfile.ZipFile({str(path)!r}, "w", zipfile.ZIP_STORED) as zf:
    zf.writestr("archive/data.pkl", buf.getvalue())
    zf.writestr("archive/data/0", bytes(4 * {n}))
    zf.writestr("archive/version", b"3\\n")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------- measuring

PROBE = """
import json, sys, time
import statekit
from statekit.errors import StatekitError
start, cpu = time.perf_counter(), time.process_time()
try:
    with statekit.open(sys.argv[1]) as ckpt:
        n = len(ckpt.model.params) if ckpt.model else len(ckpt.optimizer.params) if ckpt.optimizer else 0
    outcome = f"read ({n} tensors)"
except StatekitError as exc:
    outcome = "refused: " + str(exc).split(": ", 1)[-1][:60]
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": seconds, "cpu": cpu, "rss": int(hwm) >> 10, "outcome": outcome}))
"""


_ENV: dict[Path, dict] = {}


def _env(root: Path = ROOT) -> dict:
    """The children's environment: statekit from ``root`` (this checkout, or ``--against``'s), its
    bytecode compiled once and kept, as an install has it (``optional.installed_env``)."""
    if root not in _ENV:
        sys.path.insert(0, str(ROOT / "bench"))
        import optional

        _ENV[root] = optional.installed_env(root, PYTHONPATH=str(root))
    return _ENV[root]


def probe(path: Path, root: Path = ROOT) -> dict:
    # (run in root: ``-c`` and ``-m`` put the working directory first on sys.path)
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=600,
                         env=_env(root), cwd=root)
    if out.returncode:
        return {"seconds": float("nan"), "cpu": float("nan"), "rss": 0, "outcome": "CRASH " + out.stderr.strip().splitlines()[-1][:60]}
    return json.loads(out.stdout)


def command(args: list[str], root: Path = ROOT) -> dict:
    """Wall seconds, CPU seconds and peak RSS (MiB, from ``/usr/bin/time``: the child's own) of one
    ``statekit`` command in a fresh process (statekit from ``root``), its output thrown away."""
    import resource
    import shutil

    env = {**_env(root), "COLUMNS": "100"}
    cmd = [sys.executable, "-m", "statekit", *args]
    timer = shutil.which("time") or "/usr/bin/time"
    with tempfile.NamedTemporaryFile("w+") as report:
        wrapped = [timer, "-f", "%M", "-o", report.name, *cmd] if os.path.exists(timer) else cmd
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(wrapped, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=root)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak = [ln for ln in report.read().split() if ln.isdigit()]
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    outcome = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-60:]}"
    return {"seconds": seconds, "cpu": cpu, "rss": int(peak[-1]) >> 10 if peak else after.ru_maxrss >> 10,
            "outcome": outcome}


#: issue 21's goals for the 10^6-view file whatever its opcodes: (seconds, MiB)
VIEW_GOALS = {"open": (10, 1024), "inspect": (30, 1024), "inspect --format tsv": (30, 1024),
              "inspect --json": (30, 1024), "inspect --stats": (45, 1024)}


def views_table(tmp: Path, n: int, stats: bool, against: Path | None = None) -> None:
    """The n-view file in each of :data:`FORMS`: open, inspect (table, TSV, JSON) and inspect
    --stats, each against issue 21's goals (issue 29: whatever the form); with ``against``
    (another checkout, e.g. main's), each command run by it too, just before, and the ratios of
    seconds and CPU seconds to it ("x base")."""
    print(f"\n{n:,} views of one storage, in three pickle forms (protocol 2): torch.save's opcodes, the same "
          "pickled without a memo (Pickler.fast), and with MARK…TUPLE tuples"
          + (f"; base = {against}" if against else ""))
    head = f"{'form':<12}{'command':<24}{'seconds':>9}{'CPU s':>8}{'peak MiB':>10}{'x goal s':>10}{'x 1 GiB':>9}"
    if against:
        head += f"{'base s':>9}{'base CPU':>9}{'base MiB':>9}{'x base s':>9}{'x b CPU':>8}"
    print(head + "  outcome")
    for form in FORMS:
        path = tmp / f"views-{FORMS.index(form)}.pt"
        shared_storage_pt(path, n, form)
        rows = [("open", None)] + [(f"inspect{s}", ["inspect", str(path), *s.split()])
                                   for s in ("", " --format tsv", " --json")]
        if stats:
            rows.append(("inspect --stats", ["inspect", str(path), "--stats"]))
        for label, args in rows:
            b = None if not against else probe(path, against) if args is None else command(args, against)
            r = probe(path) if args is None else command(args)
            goal_s, goal_mib = VIEW_GOALS[label.strip()]
            line = (f"{form:<12}{label:<24}{r['seconds']:>9.2f}{r['cpu']:>8.2f}{r['rss']:>10}"
                    f"{r['seconds'] / goal_s:>10.2f}{r['rss'] / goal_mib:>9.2f}")
            if b is not None:
                line += (f"{b['seconds']:>9.2f}{b['cpu']:>9.2f}{b['rss']:>9}{r['seconds'] / b['seconds']:>9.2f}"
                         f"{r['cpu'] / b['cpu']:>8.2f}")
                if b["outcome"] != r["outcome"]:
                    line += f"  base: {b['outcome']}"
            print(f"{line}  {r['outcome']}")
        path.unlink()


def rename_seconds(n: int) -> float:
    sys.path.insert(0, str(ROOT))
    from statekit.ops.rules import NORM_PRESET, RenameRule, rename

    rules = [RenameRule(p, r, "preset") for p, r in NORM_PRESET]
    start = time.perf_counter()
    rename("b." * (n // 2), rules)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tensors", type=int, default=1_000_000)
    parser.add_argument("--views", type=int, default=1_000_000,
                        help="views of the open/inspect table, in the three pickle forms (0: skip it)")
    parser.add_argument("--no-stats", action="store_true", help="leave inspect --stats out of that table")
    parser.add_argument("--only-views", action="store_true", help="that table alone")
    parser.add_argument("--against", type=Path, help="that table also for another checkout's statekit (e.g. "
                        "`git worktree add /tmp/base main`), each command just before this one's: x base")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import optional

    print(optional.line())
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs at start")
    if args.only_views:
        with tempfile.TemporaryDirectory() as tmp:
            views_table(Path(tmp), args.views, not args.no_stats, args.against and args.against.resolve())
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases: list[tuple[str, Path]] = [("baseline: small valid .bpk", ROOT / "fixtures" / "hand-optim.bpk")]
        torch_zip(tmp / "laughs.pt", hyper_dict(memo_laughs(40)))
        cases.append(("memo billion laughs (2^40 by reference)", tmp / "laughs.pt"))
        torch_zip(tmp / "self.pt", hyper_dict(self_list()))
        cases.append(("self-referencing list", tmp / "self.pt"))
        torch_zip(tmp / "deep.pt", hyper_dict(deep_list(10**6)))
        cases.append(("list nested 10^6 deep", tmp / "deep.pt"))
        burnpack_many(tmp / "many.bpk", 10**6)
        cases.append(("burnpack declaring 10^6 tensors", tmp / "many.bpk"))
        gzip_bomb(tmp / "bomb.mpk.gz", 10 << 30)
        cases.append((f"gzip {os.path.getsize(tmp / 'bomb.mpk.gz') >> 20} MiB inflating to 10 GiB", tmp / "bomb.mpk.gz"))
        print(f"{'case':<44}{'seconds':>9}{'CPU s':>8}{'peak MiB':>10}{'x base s':>10}  outcome")
        base = None
        for name, path in cases:
            r = probe(path)
            base = base or r
            print(f"{name:<44}{r['seconds']:>9.3f}{r['cpu']:>8.3f}{r['rss']:>10}{r['seconds'] / base['seconds']:>10.1f}  "
                  f"{r['outcome']}")

        print(f"\n{'valid .pt, N views of one storage':<44}{'seconds':>9}{'CPU s':>8}{'peak MiB':>10}{'us/tensor':>10}"
              f"{'x 10^4':>8}{'marginal':>9}{'x 10 s':>8}{'x 1 GiB':>8}")
        first = previous = None
        n = 10_000
        while n <= args.max_tensors:
            path = tmp / f"shared{n}.pt"
            shared_storage_pt(path, n)
            r = probe(path)
            per = r["seconds"] / n * 1e6
            first = first or per
            # us a tensor from the previous row to this one (start-up costs cancel): flat = linear
            marginal = f"{(r['seconds'] - previous) / (0.9 * n) * 1e6:>9.1f}" if previous is not None else f"{'':>9}"
            goal = f"{r['seconds'] / 10:>8.2f}{r['rss'] / 1024:>8.2f}" if n == 1_000_000 else f"{'':>16}"
            print(f"{'N = ' + format(n, ','):<44}{r['seconds']:>9.2f}{r['cpu']:>8.2f}{r['rss']:>10}{per:>10.1f}"
                  f"{per / first:>8.2f}{marginal}{goal}  {r['outcome']}")
            previous = r["seconds"]
            path.unlink()
            n *= 10
        if args.views:
            views_table(tmp, args.views, not args.no_stats, args.against and args.against.resolve())

    print(f"\n{'norm-preset rename of a path of':<44}{'seconds':>9}{'x 8k':>10}")
    first = None
    for n in (8_000, 32_000, 128_000):
        s = rename_seconds(n)
        first = first or s
        print(f"{format(n, ',') + ' characters':<44}{s:>9.4f}{s / first:>10.1f}")


if __name__ == "__main__":
    main()
