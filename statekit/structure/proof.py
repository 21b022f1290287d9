"""The proof: the map applied to the old weights gives the new weights, bit for bit.

Each piece is compared a bounded block at a time, as cheaply as its shape allows: a contiguous run on
both sides is read :data:`PIECE` bytes at a time into two reused buffers and ``memcmp``'d; a block
whose elements lie within :data:`WINDOW` bytes of both tensors (a head of RoPE-permuted rows, a band
of rows) is read the same way and compared as strided views; anything wider (a column of a matrix, a
transpose) is compared over read-only maps of the files whose pages are let go as the comparison
moves on. The buffers stay in the core's cache, and ``preadv``, ``memcmp`` and numpy's comparisons
let the GIL go, so threads compare at once (maps would serialise them on the process's memory map).
Memory stays a few buffers, whatever the tensors' size. The first element that disagrees is named
with both values.

Above 4 MiB a target's comparisons run on the cores (``STATEKIT_JOBS``, else the CPUs the process may
use), on threads kept for the process, each with its own buffers: a contiguous run in chunks, the
blocks of another piece in tasks of about as many bytes (about four tasks a core, 1 to 32 MiB). A
proof may be left under way (:func:`start`) while the caller reads the next tensor's keys; its
results are taken in the pieces' order, so the disagreement named is the one a single thread would
name, and the tasks after it are cancelled.
"""

from __future__ import annotations

import math
import threading

from statekit import dtypes, stream
from statekit.lazy import numpy as np
from statekit.structure.access import Weight, on_disk, thread_buffers
from statekit.structure.pieces import Piece, TargetMap, unravel

BLOCK = 1 << 18  # elements compared at once
PIECE = 1 << 20  # bytes of a contiguous run read and compared at once (in the core's cache)
WINDOW = 4 << 20  # bytes of a tensor a block may span to be read into a buffer (else compared over maps)


def disagreement(t: TargetMap, new: Weight, old: dict[str, Weight], advance=None) -> str | None:
    """None when every piece of ``t`` reads from ``old`` exactly what ``new`` holds; else where not
    (the first disagreement in the pieces' order, whichever thread found it)."""
    return start(t, new, old, advance).result()


def start(t: TargetMap, new: Weight, old: dict[str, Weight], advance=None) -> Proving:
    """The proof of ``t`` begun on the comparison threads, not awaited: the caller goes on (the keys of
    the next tensor) while the cores compare; :meth:`Proving.result` is :func:`disagreement`'s answer.
    A target below :data:`PARALLEL_MIN` bytes, or with one core, is proved at once."""
    cores = stream.current_jobs()
    total = 2 * sum(p.numel for p in t.pieces) * new.itemsize
    tasks = list(_tasks(t, new, old, task_bytes(total, cores)))
    if min(cores, len(tasks)) < 2 or total < PARALLEL_MIN:
        return Proving(None, _first((task() for task, _ in tasks), advance), advance)
    pool = _pool(cores)
    return Proving([(pool.submit(task), n) for task, n in tasks], None, advance)


class Proving:
    """A proof under way: its tasks' futures in the pieces' order (or the answer, when made at once)."""

    def __init__(self, futures: list | None, answer: str | None, advance):
        self._futures = futures
        self._answer = answer
        self._advance = advance

    def done(self) -> bool:
        return self._futures is None or all(f.done() for f, _ in self._futures)

    def result(self) -> str | None:
        """None when every piece reads what the new tensor holds, else the first disagreement in the
        pieces' order (the tasks after it are cancelled)."""
        if self._futures is not None:
            futures = self._futures
            try:
                self._answer = _first((f.result() for f, _ in futures), self._advance)
            finally:
                self.cancel()
        return self._answer

    def cancel(self) -> None:
        """Tasks not started never are; those started are awaited (no thread is left reading)."""
        futures, self._futures = self._futures or [], None
        for f, _ in futures:
            f.cancel()
        for f, _ in futures:
            if not f.cancelled():
                f.exception()


PARALLEL_MIN = 4 << 20  # bytes compared (both sides) below which one thread does it all
RUN_CHUNK = 32 << 20  # bytes (both sides) compared by one task at most


def task_bytes(total: int, cores: int) -> int:
    """Bytes (both sides) one task compares: a target cut into about four tasks a core (so that a
    tensor of a few MiB, a bf16 matrix, keeps every core busy too), between :data:`PIECE` and
    :data:`RUN_CHUNK`."""
    return min(RUN_CHUNK, max(PIECE, total // (4 * max(1, cores))))


def _first(results, advance) -> str | None:
    for problem, nbytes in results:
        if problem:
            return problem
        if advance is not None:
            advance(nbytes)
    return None


def _tasks(t: TargetMap, new: Weight, old: dict[str, Weight], size: int = RUN_CHUNK):
    """The comparisons, in order, as (task, bytes): a task returns (problem or None, bytes compared).
    A contiguous run is cut into chunks; another piece's blocks are grouped into tasks of about
    ``size`` bytes (both sides)."""
    for name in t.sources:
        source = old[name]
        for piece in t.pieces:
            if piece.source != name:
                continue
            if _contiguous(piece, new, source):
                for part in _run_chunks(piece, new, size):
                    yield (lambda part=part, source=source: _compare_run(t, new, source, part)), \
                        2 * part.numel * new.itemsize
                continue
            for group in _block_groups(piece, new.itemsize, size):
                yield (lambda group=group, source=source: _compare_blocks(t, new, source, group)), \
                    2 * sum(b.numel for b in group) * new.itemsize


def _contiguous(p: Piece, new: Weight, source: Weight) -> bool:
    return len(p.shape) == 1 and p.src_strides == (1,) and p.dst_strides == (1,) and new.itemsize == source.itemsize


def _run_chunks(p: Piece, new: Weight, size: int):
    step = max(1, size // (2 * max(1, new.itemsize)))
    if p.numel <= step:
        yield p
        return
    for lo in range(0, p.numel, step):
        n = min(step, p.numel - lo)
        yield Piece(p.source, (n,), p.src_offset + lo, (1,), p.dst_offset + lo, (1,))


def _block_groups(p: Piece, itemsize: int, size: int):
    group, nbytes = [], 0
    for block in blocks(p, BLOCK):
        group.append(block)
        nbytes += 2 * block.numel * itemsize
        if nbytes >= size:
            yield group
            group, nbytes = [], 0
    if group:
        yield group


def _compare_run(t: TargetMap, new: Weight, source: Weight, piece: Piece) -> tuple[str | None, int]:
    """A contiguous run: both sides read :data:`PIECE` bytes at a time into the thread's two buffers
    and ``memcmp``'d (the buffers stay in the core's cache; ``preadv`` and ``memcmp`` let the GIL go,
    so the threads compare at once — maps would serialise them on the process's memory map)."""
    nbytes = 2 * piece.numel * new.itemsize
    memcmp = stream._memcmp()
    if memcmp is None or not (on_disk(new) and on_disk(source)):
        return _compare_blocks(t, new, source, list(blocks(piece, BLOCK)))[0], nbytes
    size = new.itemsize
    buffers = thread_buffers()
    per = max(1, PIECE // size)
    for lo in range(0, piece.numel, per):
        n = min(per, piece.numel - lo)
        a = buffers.read(new, piece.dst_offset + lo, piece.dst_offset + lo + n - 1, 0)
        b = buffers.read(source, piece.src_offset + lo, piece.src_offset + lo + n - 1, 1)
        if memcmp(a.ctypes.data, b.ctypes.data, n * size):
            part = Piece(piece.source, (n,), piece.src_offset + lo, (1,), piece.dst_offset + lo, (1,))
            return _first_difference(t, new, source, part, a, b), nbytes
    return None, nbytes


def _compare_blocks(t: TargetMap, new: Weight, source: Weight, group: list[Piece]) -> tuple[str | None, int]:
    """Blocks of a piece that is not one run: a block whose elements lie within :data:`WINDOW` bytes
    of both tensors (a head of RoPE-permuted rows, a band of rows) read into the thread's two buffers
    and compared as strided views; a wider one (a column of a matrix, a transpose) over read-only maps
    of the files, whose pages are let go as the comparison moves on."""
    nbytes = 2 * sum(b.numel for b in group) * new.itemsize
    buffers = thread_buffers()
    wide = []
    for block in group:
        (dlo, dhi), (slo, shi) = block.dst_span(), block.src_span()
        if max(dhi - dlo + 1, shi - slo + 1) * new.itemsize > WINDOW:
            wide.append(block)
            continue
        a = block.dst_view(buffers.read(new, dlo, dhi, 0), dlo)
        b = block.src_view(buffers.read(source, slo, shi, 1), slo)
        if not _same(a, b):
            return _first_difference(t, new, source, block, a, b), nbytes
    if wide:
        with new.mapped(sequential=True) as target, source.mapped(sequential=True) as src:
            for block in wide:
                a, b = block.dst_view(target.array), block.src_view(src.array)
                if not _same(a, b):
                    return _first_difference(t, new, source, block, a, b), nbytes
                target.touched(a.nbytes)
                src.touched(b.nbytes)
            a = b = None
    return None, nbytes


_POOLS: dict[int, object] = {}
_POOLS_LOCK = threading.Lock()


def _pool(jobs: int):
    """The process's comparison threads for ``jobs`` (started once: a thread's start costs a
    proof of a small tensor more than the comparison)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(jobs)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _POOLS[jobs] = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="statekit-proof")
        return pool


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality: ``memcmp`` where both lie contiguous (no temporary), else numpy's."""
    if a.flags.c_contiguous and b.flags.c_contiguous and a.dtype == b.dtype:
        memcmp = stream._memcmp()
        if memcmp is not None:
            return not a.nbytes or memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
    return bool(np.array_equal(a, b))


def blocks(p: Piece, limit: int):
    """``p`` cut along its leading axes into pieces of at most ``limit`` elements."""
    if p.numel <= limit:
        yield p
        return
    if len(p.shape) == 1:
        for lo in range(0, p.shape[0], limit):
            yield Piece(p.source, (min(limit, p.shape[0] - lo),), p.src_offset + lo * p.src_strides[0], p.src_strides,
                        p.dst_offset + lo * p.dst_strides[0], p.dst_strides)
        return
    inner = math.prod(p.shape[1:])
    per = max(1, limit // inner)
    for lo in range(0, p.shape[0], per):
        n = min(per, p.shape[0] - lo)
        sub = Piece(p.source, (n, *p.shape[1:]), p.src_offset + lo * p.src_strides[0], p.src_strides,
                    p.dst_offset + lo * p.dst_strides[0], p.dst_strides)
        if sub.numel > limit:
            yield from blocks(sub, limit) if n > 1 else _inner_blocks(sub, limit)
        else:
            yield sub


def _inner_blocks(p: Piece, limit: int):
    """A piece of one leading index: cut along its next axis."""
    flat = Piece(p.source, p.shape[1:], p.src_offset, p.src_strides[1:], p.dst_offset, p.dst_strides[1:])
    yield from blocks(flat, limit)


def _first_difference(t: TargetMap, new: Weight, old: Weight, block: Piece, a: np.ndarray, b: np.ndarray) -> str:
    at = int(np.flatnonzero(a.reshape(-1) != b.reshape(-1))[0])
    index = unravel(at, block.shape)
    dst = block.dst_offset + sum(i * s for i, s in zip(index, block.dst_strides, strict=True))
    src = block.src_offset + sum(i * s for i, s in zip(index, block.src_strides, strict=True))
    return (f"{t.path}{list(unravel(dst, new.shape))} is {_value(new, a.reshape(-1)[at])} in the new weights, but "
            f"the map reads {_value(old, b.reshape(-1)[at])} from {old.path}{list(unravel(src, old.shape))}")


def _value(w: Weight, bits) -> str:
    try:
        return repr(np.array([bits], dtype=w.bits).view(dtypes.numpy_dtype(w.dtype))[0].item())
    except (TypeError, ValueError):
        return f"0x{int(bits):x}"
