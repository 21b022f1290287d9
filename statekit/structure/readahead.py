"""Weight files not in the page cache read once, in order, before or while the map is learned from them.

Learning the map reads the weights out of order: a few elements of each tensor for its keys, the
sampled rows of the new ones, then every byte for the proof. From a cold page cache each of those reads
waits for the disk, a page or a fault-around at a time. Files that fit in the memory the system has
free (half of ``MemAvailable``, and 8 GiB at most: the map's progress bar does not move while they
are read, a few seconds) are read front to back first, each on its own thread in 1 MiB pieces
(into one reused buffer: nothing is kept but the page cache), and the map is then learned from cached
pages: a 1.93 GiB pair written just before took 0.8-0.9 s against 1.2-2.2 s read alongside the
map, whose threads took the cores from the reader. Larger files are read on one thread while the map
is learned (their first pages would be gone before the map came back to them), the map's reads
finding the pages cached or waiting for a read already in flight, and the few elements of every
tensor its keys start from asked for at once (:func:`will_need`). Files mostly cached (``mincore``)
are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

from statekit.lazy import numpy as np

PIECE = 1 << 20  # bytes read at once
PROBES, PROBE = 64, 64 << 10  # windows of a file whose pages are looked up, and their size
CACHED = 0.5  # the fraction of a file's pages in the page cache above which it is not read ahead
FITS = 0.5  # the fraction of the system's available memory cold files may take to be read first
FIRST_MAX = 8 << 30  # bytes of cold files read first at most (the progress bar stands while they are read)


@contextlib.contextmanager
def reading_ahead(files: list[tuple[int, int, int]]):
    """``files``: (fd, first byte, end) of each file the map reads. The uncached ones are read first when
    they fit in memory (yields an empty set: nothing is cold then), else read ahead on a thread until the
    block ends (the thread stops at its next piece; yields the set of their fds, see :func:`will_need`)."""
    todo = [f for f in files if f[2] > f[1] and cached_fraction(*f) < CACHED]
    if not todo:
        yield set()
        return
    free = available_memory()
    size = sum(hi - lo for _, lo, hi in todo)
    if free is not None and size <= min(free * FITS, FIRST_MAX):
        read_first(todo)
        yield set()
        return
    stop = threading.Event()
    thread = threading.Thread(target=_read, args=(todo, stop), name="statekit-readahead", daemon=True)
    thread.start()
    try:
        yield {fd for fd, _, _ in todo}
    finally:
        stop.set()
        thread.join()


def read_first(files: list[tuple[int, int, int]]) -> None:
    """``files`` read into the page cache, each on its own thread (two streams keep a disk busier than
    one), awaited; an interruption stops them at their next piece."""
    stop = threading.Event()
    threads = [threading.Thread(target=_read, args=([f], stop), name="statekit-read", daemon=True) for f in files]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def available_memory() -> int | None:
    """Bytes the system can give without swapping (``MemAvailable``), None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def will_need(fd: int, offsets) -> None:
    """Ask the kernel for the pages holding ``offsets`` (bytes) at once, without waiting for them: a
    few elements of every tensor of a file not in the page cache (the keys' samples) otherwise come a
    disk latency each, one after the other (0.7 s of a 1 GiB pair, against 0.04 s asked at once)."""
    if not hasattr(os, "posix_fadvise"):
        return
    page = mmap.PAGESIZE
    for first in sorted({int(at) // page for at in offsets}):
        try:
            os.posix_fadvise(fd, first * page, page, os.POSIX_FADV_WILLNEED)
        except OSError:  # (only advice: the reads themselves say what is wrong)
            return


def _read(files: list[tuple[int, int, int]], stop: threading.Event) -> None:
    buffer = memoryview(bytearray(PIECE))
    for fd, lo, hi in files:
        for at in range(lo, hi, PIECE):
            if stop.is_set():
                return
            try:
                if not os.preadv(fd, [buffer[: min(PIECE, hi - at)]], at):
                    break
            except OSError:  # (a file gone or shorter: the map's own reads say so)
                break


def cached_fraction(fd: int, lo: int, hi: int) -> float:
    """The fraction of ``[lo, hi)``'s pages in the page cache, from :data:`PROBES` evenly spread
    windows of :data:`PROBE` bytes (the kernel walks its cache a page at a time: all of a 1 GiB file
    costs 0.2 s); 1.0 when it cannot tell."""
    mincore = _mincore()
    if mincore is None:
        return 1.0
    start = lo - lo % mmap.ALLOCATIONGRANULARITY
    try:
        region = mmap.mmap(fd, hi - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
    except (OSError, ValueError):
        return 1.0
    try:
        size = hi - start
        window = min(PROBE, size)
        vec = np.zeros((window + mmap.PAGESIZE - 1) // mmap.PAGESIZE, np.uint8)
        mapped = np.frombuffer(region, np.uint8)
        base = mapped.ctypes.data
        seen = cached = 0
        for at in np.linspace(0, size - window, PROBES).astype(np.int64) // mmap.PAGESIZE * mmap.PAGESIZE:
            if mincore(base + int(at), window, vec.ctypes.data) != 0:
                return 1.0
            seen += vec.size
            cached += int(np.count_nonzero(vec & 1))
        del mapped
        return cached / seen if seen else 1.0
    finally:
        with contextlib.suppress(BufferError):
            region.close()


_MINCORE: list = []


def _mincore():
    if not _MINCORE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _MINCORE.append(fn)
    return _MINCORE[0]
