"""The same input gives the same bits on every run, for every optimizer, flavor and kernel.

Each kernel steps the same problem several times while two other threads keep the cores busy
(numpy and torch work in a loop), on inputs placed at different alignments in memory, with
statekit's, numba's and torch's thread counts changed between runs; the parameter and every slot
must come out with the same bits every time. The problem is large enough for several of the
reference's blocks on several threads and for numba's thread pool (140 003 elements; Adafactor a
140 x 1001 matrix, Muon 96 x 80).

What it guards against: a result depending on which thread took which block, on a scratch buffer
shared between threads, on the thread count, or on where in memory an array starts (torch's
root is MKL's vector math, which can treat an unaligned head apart: statekit hands it 64-byte
aligned memory, as torch's own allocator does).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

import statekit.optim as so
from statekit.optim import backend, kernels

N = 140_003
SHAPES = {"adafactor": (140, 1001), "muon": (96, 80)}
STEPS = 2
HP = {"lr": 1e-3}
#: (algorithm, flavor) with the hyperparameters burn needs (its lr has no default)
CASES = [(name, flavor) for name, algo in so.ALGORITHMS.items() for flavor in algo.flavors]


def _kernels(name: str, flavor: str) -> list[str]:
    out = ["reference"]
    if backend.torch_available() and (name, flavor) in kernels.TORCH_SUPPORTS:
        out.append("torch")
    if kernels.numba_available() and (name, flavor) in kernels.NUMBA_SUPPORTS:
        out.append("numba")
    return out


PARAMS = [pytest.param(name, flavor, kernel, id=f"{name}-{flavor}-{kernel}")
          for name, flavor in CASES for kernel in _kernels(name, flavor)
          if not (name == "muon" and flavor == "torch" and not backend.torch_available())]


@pytest.fixture(scope="module")
def busy():
    """Two threads keeping the cores busy (numpy, and torch when installed) until the module ends."""
    stop = threading.Event()

    def work(seed):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((256, 256), dtype=np.float32)
        torch = None
        if backend.torch_available():
            import torch
        while not stop.is_set():
            np.sqrt(np.abs(a @ a) + 1, out=a)
            a /= np.float32(np.abs(a).max() + 1)
            if torch is not None:
                torch.from_numpy(a).sqrt().sum()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join()


def _placed(array: np.ndarray, offset: int) -> np.ndarray:
    """``array`` copied to a buffer ``offset`` floats past a 64-byte boundary."""
    buf = backend.aligned_empty(array.size + 16)
    out = buf[offset:offset + array.size].reshape(array.shape)
    out[...] = array
    return out


def _digest(name, flavor, kernel, offset, inplace) -> str:
    shape = SHAPES.get(name, (N,))
    rng = np.random.default_rng(0)
    p = _placed(rng.standard_normal(shape, dtype=np.float32), offset)
    slots, step = {}, 0
    for _ in range(STEPS):
        g = _placed(rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2), (offset * 3) % 16)
        p, slots, step = so.step(name, p, g, slots, step, HP if flavor in ("burn", "candle") else {}, flavor,
                                 kernel=kernel, inplace=inplace and step > 0)
        if inplace:  # the next step's inputs at another place in memory
            p = _placed(np.asarray(p), (offset + 5) % 16)
            slots = {k: _placed(np.asarray(v), (offset + 7) % 16) for k, v in slots.items()}
    h = hashlib.sha256(np.ascontiguousarray(p).tobytes())
    for key in sorted(slots):
        h.update(key.encode() + np.ascontiguousarray(slots[key]).tobytes())
    return h.hexdigest()


def _threads(monkeypatch, count: int) -> None:
    monkeypatch.setenv("STATEKIT_THREADS", str(count))
    if backend.torch_available():
        import torch

        torch.set_num_threads(count)
    if kernels.numba_available():
        import numba

        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))


@pytest.mark.usefixtures("busy")
@pytest.mark.parametrize(("name", "flavor", "kernel"), PARAMS)
def test_every_run_gives_the_same_bits(name, flavor, kernel, monkeypatch):
    """bit-identical: three runs of 2 steps, at 1, 2 and 3 threads, inputs at offsets 0, 1 and 5
    floats from a 64-byte boundary (in place and not), while other threads are busy."""
    saved = None
    if backend.torch_available():
        import torch

        saved = torch.get_num_threads()
    try:
        runs = []
        for threads, offset, inplace in ((1, 0, False), (3, 1, True), (2, 5, False)):
            if kernel == "torch" and name in ("adafactor", "muon"):
                threads = saved  # torch's reductions may split by thread count, as torch's own run does
            _threads(monkeypatch, threads)
            runs.append(_digest(name, flavor, kernel, offset, inplace))
    finally:
        if saved is not None:
            import torch

            torch.set_num_threads(saved)
    assert len(set(runs)) == 1, runs
