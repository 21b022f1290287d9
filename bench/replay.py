"""Throughput of statekit's Adam replays beside torch's Adam and the machine's copy bandwidth.

    python bench/replay.py [--numel 50000000] [--repeat 3] [--device cpu|cuda]

One float32 parameter of ``--numel`` elements with its gradient and Adam state. For each
statekit flavor (Adam; candle is AdamW with weight_decay 0, i.e. the same update) one in-place
step is timed, best of ``--repeat``; beside them torch's Adam with ``foreach=False``,
``foreach=True`` and ``fused=True``, and a plain copy of the same size (``np.copyto`` on CPU,
``Tensor.copy_`` / CuPy on CUDA) that gives the memory bandwidth. "fraction of memory bound"
divides elements/s by bandwidth/28: an Adam step reads p, g, m, v and writes p, m, v, 7 float32
streams of 4 bytes; the copy counts its 2 streams (8 bytes per element).

``--device cuda`` runs the statekit flavors on torch CUDA tensors (or CuPy arrays when torch
has no CUDA) against a device copy; without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import numpy as np

import statekit.optim as so

ADAM_BYTES = 7 * 4
COPY_BYTES = 2 * 4
FLAVORS = [("torch-fused", "adam"), ("torch", "adam"), ("burn", "adam"), ("candle", "adamw")]
HP = {
    "adam": {"lr": 1e-3},
    "adamw": {"lr": 1e-3, "weight_decay": 0.0},
}


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


class Host:
    """numpy arrays; torch CPU tensors for the torch rows (when torch is installed)."""

    name = "cpu"
    xp = np

    def __init__(self, numel: int):
        rng = np.random.default_rng(0)
        self.p = rng.standard_normal(numel, dtype=np.float32)
        self.g = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-2)

    def sync(self):
        pass

    def fresh(self, array):
        return array.copy()

    def zeros(self):
        return np.zeros_like(self.p)

    def copy_seconds(self, repeat):
        dst = np.empty_like(self.p)
        return best_time(lambda: np.copyto(dst, self.p), repeat)

    def torch_pair(self):
        if not importlib.util.find_spec("torch"):
            return None
        import torch

        return torch.from_numpy(self.p.copy()), torch.from_numpy(self.g)


class Cuda:
    """torch CUDA tensors, or CuPy arrays when torch has no CUDA (then there are no torch rows)."""

    name = "cuda"

    def __init__(self, numel: int, module):
        self.xp = module
        host = Host(numel)
        if module.__name__ == "torch":
            self.p, self.g = (module.from_numpy(a).cuda() for a in (host.p, host.g))
            self.sync = module.cuda.synchronize
        else:
            self.p, self.g = (module.asarray(a) for a in (host.p, host.g))
            self.sync = module.cuda.Device().synchronize

    def fresh(self, array):
        return array.clone() if self.xp.__name__ == "torch" else array.copy()

    def zeros(self):
        return self.xp.zeros_like(self.p)

    def copy_seconds(self, repeat):
        dst = self.xp.empty_like(self.p)
        if self.xp.__name__ == "torch":
            return best_time(lambda: dst.copy_(self.p), repeat, self.sync)
        return best_time(lambda: self.xp.copyto(dst, self.p), repeat, self.sync)

    def torch_pair(self):
        return (self.p.clone(), self.g.clone()) if self.xp.__name__ == "torch" else None


def cuda_device():
    """A :class:`Cuda` factory, or None when no CUDA device is usable."""
    if importlib.util.find_spec("torch"):
        import torch

        if torch.cuda.is_available():
            return lambda numel: Cuda(numel, torch)
    if importlib.util.find_spec("cupy"):
        import cupy

        try:
            if cupy.cuda.runtime.getDeviceCount() > 0:
                return lambda numel: Cuda(numel, cupy)
        except cupy.cuda.runtime.CUDARuntimeError:
            return None
    return None


def statekit_rows(dev, repeat):
    """(label, seconds) for one in-place step of each statekit flavor."""
    for flavor, algo in FLAVORS:
        p, slots = dev.fresh(dev.p), {"exp_avg": dev.zeros(), "exp_avg_sq": dev.zeros()}
        state = {"step": 0}

        def one_step(p=p, slots=slots, state=state, flavor=flavor, algo=algo):
            so.step(algo, p, dev.g, slots, state["step"], HP[algo], flavor, dev.xp, inplace=True)
            state["step"] += 1

        exact = so.exactness(flavor, so.get_backend(dev.xp, like=dev.p), algo)
        yield f"statekit {flavor} ({exact})", best_time(one_step, repeat, dev.sync)


def torch_rows(dev, repeat):
    """(label, seconds) for torch's Adam: for-loop, foreach and fused."""
    for label, kwargs in [
        ("for-loop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ]:
        pair = dev.torch_pair()
        if pair is None:
            return
        import torch

        param = torch.nn.Parameter(pair[0])
        param.grad = pair[1]
        opt = torch.optim.Adam([param], lr=1e-3, **kwargs)
        yield f"torch Adam {label}", best_time(opt.step, repeat, dev.sync)
        del opt, param


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        factory = cuda_device()
        if factory is None:
            print("no CUDA device (torch.cuda / CuPy): skipping the CUDA benchmark")
            return 0
        dev = factory(args.numel)
    else:
        dev = Host(args.numel)

    copy_s = dev.copy_seconds(args.repeat)
    bandwidth = COPY_BYTES * args.numel / copy_s
    bound = bandwidth / ADAM_BYTES
    rows = list(statekit_rows(dev, args.repeat)) + list(torch_rows(dev, args.repeat))
    fused = dict(rows).get("torch Adam fused")

    print(
        f"{args.numel:,} float32 elements on {args.device}; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(2 streams) -> Adam memory bound {bound / 1e6:,.0f} M elem/s ({ADAM_BYTES} B/elem)"
    )
    header = f"| {'implementation':38} | {'ms/step':>8} | {'M elem/s':>9} | {'x torch fused':>13} | {'of memory bound':>15} |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for label, seconds in rows:
        rate = args.numel / seconds
        vs_fused = f"{fused / seconds:.2f}" if fused else "-"
        print(
            f"| {label:38} | {seconds * 1e3:8.1f} | {rate / 1e6:9.1f} | {vs_fused:>13} | {rate / bound:15.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
