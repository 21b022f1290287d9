"""Run a block kernel over a parameter and its state, a cache-sized block at a time.

A *kernel* is ``kernel(p, g, s, tail) -> None``: ``p``, ``g`` and the values of ``s`` (slot name
→ array) are 1-D views of one block, and the kernel writes the new ``p`` and slots into them
(``p[...] = new``). ``tail`` is True only for the last ``tail`` elements of the whole tensor,
which torch's fused CPU kernels handle with scalar code (see :mod:`statekit.optim.adam`); block
boundaries never split the vector body from that tail, so blocking does not change results.

A kernel may carry ``around``: a context manager factory that :func:`run` enters once around
all of one step's blocks (the torch flavor's square root holds torch at one thread with it).

Memory stays bounded: the kernels' temporaries are block-sized, and with ``inplace=True`` the
only full-size arrays are the caller's own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from statekit.errors import UsageError
from statekit.optim.backend import Backend

Kernel = Callable[..., None]


def prepare(b: Backend, param, grad, slots: Mapping, names, init: Mapping[str, float], inplace: bool):
    """Float32 C-contiguous ``(param, grad, slots)`` for :func:`run`, plus the original shape.

    Slots in ``names`` that ``slots`` lacks are created filled with ``init.get(name, 0.0)``;
    slots outside ``names`` are refused. Without ``inplace`` the parameter and slots are copies;
    with it they must already be writable float32 C-contiguous arrays of ``b``, and are updated
    in place.
    """
    unknown = sorted(set(slots) - set(names))
    if unknown:
        raise UsageError(f"unexpected optimizer state slots {unknown}; expected {list(names)}")
    shape = tuple(param.shape)
    if tuple(grad.shape) != shape:
        raise UsageError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {shape}")
    for name, value in slots.items():
        if tuple(value.shape) != shape:
            raise UsageError(f"state {name!r} has shape {tuple(value.shape)}, parameter has {shape}")
    if inplace:
        for name, value in [("param", param), *slots.items()]:
            if not (b.owns(value) and b.is_float32_contiguous(value)):
                raise UsageError(f"inplace=True needs {name!r} as a writable float32 C-contiguous array")
    p = b.to_float32(param, copy=not inplace)
    s = {name: b.to_float32(value, copy=not inplace) for name, value in slots.items()}
    for name in names:
        if name not in s:
            s[name] = b.full_like(p, init.get(name, 0.0))
    g = b.to_float32(grad, copy=False)
    return p, g, s, shape


def threads() -> int:
    """Threads for numpy blocks: ``STATEKIT_THREADS``, else the CPUs this process may use."""
    value = os.environ.get("STATEKIT_THREADS")
    if value:
        return max(1, int(value))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, with room for ``workers`` threads (grown when asked for more)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statekit-block")
        return _POOL


def run(b: Backend, kernel: Kernel, p, g, s: dict, tail: int = 0) -> None:
    """Apply ``kernel`` to ``(p, g, s)`` block by block; the last ``tail`` elements go alone.

    On numpy, :func:`threads` workers (the calling thread and pool threads) each take the next
    block from a shared counter until none is left: one task per worker, not per block (a
    future per block cost more than the block's arithmetic on a busy machine), and
    a worker that the OS delays leaves its blocks to the others. numpy releases the GIL inside
    its loops and the kernels' scratch buffers are per thread; every element is computed
    alone, so the result does not depend on the number of threads or on which thread took
    which block.
    """
    pf, gf = b.flat(p), b.flat(g)
    sf = {name: b.flat(value) for name, value in s.items()}
    n = pf.shape[0]
    body = n - tail
    size = b.block

    def one(start: int) -> None:
        stop = min(start + size, body)
        kernel(pf[start:stop], gf[start:stop], {k: v[start:stop] for k, v in sf.items()}, False)

    count = -(-body // size)
    workers = min(threads(), count) if b.name == "numpy" else 1
    with getattr(kernel, "around", contextlib.nullcontext)():
        if workers > 1:
            _in_parallel(one, size, count, workers)
        else:
            for start in range(0, body, size):
                one(start)
        if tail:
            kernel(pf[body:], gf[body:], {k: v[body:] for k, v in sf.items()}, True)


def _in_parallel(one: Callable[[int], None], size: int, count: int, workers: int) -> None:
    """``one(i * size)`` for every ``i < count`` on ``workers`` threads, this one included."""
    counter = itertools.count()  # next() on it is atomic: each block is taken exactly once
    failed = threading.Event()

    def worker() -> None:
        try:
            for i in iter(counter.__next__, None):
                if i >= count or failed.is_set():
                    return
                one(i * size)
        except BaseException:
            failed.set()
            raise

    helpers = [_pool(workers - 1).submit(worker) for _ in range(workers - 1)]
    try:
        worker()
    finally:
        for future in helpers:
            # a helper that has not started has nothing left to do (and, should this run on a
            # pool thread itself, might never start); the others are waited for, so no block
            # is still being written when this returns or raises
            if not future.cancel():
                future.exception()
    for future in helpers:
        if not future.cancelled():
            future.result()
