"""Atomic output files: write to a sibling temporary file, fsync, then rename over the target.

What is written goes through :class:`OutputFile`: small files are written as usual; large ones
leave through reused staging blocks that a background thread writes into the page cache in
pieces of at most 256 KiB and starts writing out at once (``sync_file_range``), overlapped with the
producer — see its docstring for why.

A failure (an exception, Ctrl-C, SIGTERM in the CLI) removes the temporary file, so a target is
either the complete new file or untouched. The temporary file's name records the host and
process that write it (``.NAME.statekit-HOST-PID.XXXXXXXX.tmp``); a process killed outright
(SIGKILL, power loss) cannot remove its own, so every later write to the same target removes the
temporary files of that target whose writer, on this host, is gone.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

from statekit.errors import UsageError


def _mode_for(path: str) -> int:
    """Keep an existing target's permissions; new files get the usual 0666 & ~umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _host() -> str:
    import socket  # socket and tempfile on first use: a command that writes nothing never loads them

    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _prefix(base: str) -> str:
    return f".{base}.statekit-{_host()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return True
    return True


def remove_stale(path: str | os.PathLike) -> list[str]:
    """Remove temporary files statekit left for ``path`` whose writing process is gone; their names."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _prefix(os.path.basename(path))
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.[A-Za-z0-9_]+\.tmp")
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    path = os.fspath(path)
    if "\0" in path:  # (only an API string can hold one; os would raise ValueError)
        raise UsageError(f"{path!r}: a file name cannot hold a NUL byte")
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale(path)
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_prefix(os.path.basename(path))}{os.getpid()}.", suffix=".tmp",
                                   dir=directory)
    except OSError as exc:  # name the file the user asked for, not the temporary one
        raise OSError(exc.errno, f"cannot write there: {exc.strerror}", path) from None
    try:
        fh = OutputFile(fd)
        try:
            yield fh
            fh.finish()
            os.fsync(fd)
        finally:
            fh.close()
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


BLOCK = 8 << 20  # bytes per staging block (a multiple of ALIGN)
DEPTH = 5  # staging blocks per output: one filled, the others on their way to the disk
BATCH = 4  # direct I/O: blocks written by one call when they are waiting (more of the disk kept busy)
PIECE = 256 << 10  # the largest write into the page cache (see OutputFile: 1 MiB ones cost 4x here)
ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory (the page size covers every device)
WRITE_OUT = 2  # SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages, do not wait
SLOW_CACHE_RATE = 512 << 20  # bytes per CPU second below which a copy into the page cache is slow (2-4 GB/s when not)
SLOW_BLOCKS = 2  # slow blocks in a row that switch an output to direct writes
_CACHE_SLOW = False  # a copy into the page cache was slow: this process's later outputs go direct
_POOL: dict[int, list[mmap.mmap]] = {}  # staging blocks of finished outputs by size, reused by the next one
_POOL_LOCK = threading.Lock()


def _direct_wanted() -> bool:
    """``STATEKIT_DIRECT_IO=1``: blocks go to the disk with ``O_DIRECT`` (nothing of the output in
    the page cache, at the disk's speed for one request at a time); ``0``: always through the page
    cache; unset: through the page cache until copying into it is slow (:class:`OutputFile`)."""
    return os.environ.get("STATEKIT_DIRECT_IO") == "1" and hasattr(os, "O_DIRECT")


def _auto_direct() -> bool:
    return os.environ.get("STATEKIT_DIRECT_IO") != "0" and hasattr(os, "O_DIRECT")


def _write_out_function():
    """``sync_file_range`` from the C library (Linux), or None: where there is none, the pages are
    written out by the kernel's own writeback and the final fsync."""
    if not hasattr(os, "O_DIRECT"):  # not Linux (the call is Linux's alone)
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


class OutputFile:
    """The file object :func:`atomic_write` yields: ``write``, ``tell``, ``fileno``, ``flush``.

    Bytes are copied into staging blocks of :data:`BLOCK` bytes (anonymous maps, so aligned; at
    most :data:`DEPTH` per file, taken from and returned to a process-wide pool, so their memory is
    touched once). A file that ends within its first block is written at the end, through the
    page cache like every block. Larger files: each full block is handed to a writer thread while the
    producer fills the next one. The thread writes the block into the page cache in pieces of at
    most :data:`PIECE` (256 KiB) and at once asks the kernel to start writing it out
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk works while the
    producer does and the final fsync finds little left: a 1 GiB convert took 0.78-1.01 s where
    ``cp`` + ``sync`` took 1.16-1.61 s (docs/streaming.md has the tables).

    Copying into the page cache is fast only while the kernel has memory at hand that the machine
    has already supplied: on this VM a fresh page costs a fault in the host, and then the copy runs
    at a tenth of its speed (an 8 MiB block in 35-50 ms of CPU instead of 2-4 ms; a 4 GiB convert
    11-23 s). Larger writes get larger page-cache folios, which meet such memory sooner, hence the
    small pieces (1 MiB pieces made a 1 GiB convert 3.2-3.9 s where 256 KiB made it 0.8). So the
    thread measures the CPU time of each block's copy: after :data:`SLOW_BLOCKS` blocks in a row
    slower than :data:`SLOW_CACHE_RATE`, the rest of the file, and every later output of the
    process, is written with ``O_DIRECT`` from the reused blocks (no fresh memory at all; the disk
    at one request at a time: 4 GiB in 3.0-3.1 s there). ``STATEKIT_DIRECT_IO=1`` asks for
    ``O_DIRECT`` from the first block (blocks waiting are then written together, up to
    :data:`BATCH` in one ``pwritev``), ``STATEKIT_DIRECT_IO=0`` never. A file system that refuses
    ``O_DIRECT`` (tmpfs, some network file systems) gets the same blocks through the page cache.
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._bs = BLOCK  # this file's staging block size
        self._pos = 0  # bytes accepted: the file offset of the next byte written
        self._block: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._fill = 0
        self._base = 0  # file offset of the current block
        self._blocks: list[mmap.mmap] = []  # every block this file took from the pool
        self._free: queue.Queue | None = None
        self._todo: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._direct = False
        self._write_out = None  # sync_file_range, once the writer thread runs (a file past one block)
        self._slow = 0  # blocks in a row copied into the page cache slower than SLOW_CACHE_RATE
        self._direct_refused = False  # the file system answered O_DIRECT writes with EINVAL
        self._closed = False

    # -- the file-object surface writers use
    def write(self, data) -> int:
        if self._closed:
            raise ValueError("write to a closed output file")
        mv = data if isinstance(data, memoryview) else memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        done = 0
        while done < n:
            if self._block is None:
                self._take_block()
            k = min(n - done, self._bs - self._fill)
            self._view[self._fill : self._fill + k] = mv[done : done + k]
            self._fill += k
            done += k
            if self._fill == self._bs:
                self._submit()
        self._pos += n
        return n

    def staging(self, limit: int) -> memoryview:
        """A writable view of at most ``limit`` bytes (≥ 1 when ``limit`` is) at the current position,
        inside one staging block: fill a prefix of it, then :meth:`commit` that many bytes."""
        if self._closed:
            raise ValueError("write to a closed output file")
        if self._block is None:
            self._take_block()
        return self._view[self._fill : self._fill + min(limit, self._bs - self._fill)]

    def commit(self, n: int) -> None:
        """``n`` bytes of the last :meth:`staging` view are written."""
        self._fill += n
        self._pos += n
        if self._fill == self._bs:
            self._submit()

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:  # blocks leave when full; finish() writes the rest
        return None

    def writable(self) -> bool:
        return True

    # -- staging blocks and the writer thread
    def _take_block(self) -> None:
        if self._free is not None and len(self._blocks) >= DEPTH:
            while True:  # wait for the writer thread to hand one back (or fail)
                self._raise_failure()
                try:
                    self._block = self._free.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
        else:
            with _POOL_LOCK:
                free = _POOL.get(self._bs)
                block = free.pop() if free else mmap.mmap(-1, self._bs)
            self._blocks.append(block)
            self._block = block
        self._view = memoryview(self._block)
        self._fill = 0

    def _submit(self) -> None:
        if self._thread is None:
            self._free, self._todo = queue.Queue(), queue.Queue()
            self._direct = (_direct_wanted() or _CACHE_SLOW and _auto_direct()) and self._set_direct(True)
            self._write_out = _write_out_function()
            self._thread = threading.Thread(target=self._drain, name="statekit-output", daemon=True)
            self._thread.start()
        self._raise_failure()
        self._view.release()
        self._todo.put((self._block, self._base))
        self._base += self._bs
        self._block = self._view = None

    def _set_direct(self, on: bool) -> bool:
        import fcntl

        try:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
            return True
        except OSError:
            return False

    def _drain(self) -> None:
        """The writer thread: blocks in file order; with direct I/O those already waiting are
        written together (a 32 MiB direct write measured 1.5 × the throughput of 8 MiB ones)."""
        while True:
            item = self._todo.get()
            if item is None:
                return
            batch, stop = [item], False
            while self._direct and len(batch) < BATCH:
                try:
                    more = self._todo.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                if self._error is None:
                    self._pwrite([block for block, _ in batch], self._bs, batch[0][1])
            except BaseException as exc:  # reported to the producer at its next write or at finish
                self._error = exc
            for block, _ in batch:
                self._free.put(block)
            if stop:
                return

    def _pwrite(self, blocks: list[mmap.mmap], length: int, offset: int) -> None:
        """The first ``length`` bytes of each block, back to back from ``offset``: with direct I/O
        in one ``pwritev``; else into the page cache :data:`PIECE` at a time, then the range's
        writeback started."""
        views = [memoryview(block)[:length] for block in blocks]
        try:
            done, total = 0, length * len(views)
            while done < total and self._direct:
                k, r = divmod(done, length)
                try:
                    done += os.pwritev(self._fd, [views[k][r:], *views[k + 1 :]], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct = False  # this file system takes no direct writes: through the cache
                    self._direct_refused = True
                    self._set_direct(False)
            if done == total:
                return
            cpu = time.thread_time()
            while done < total:
                k, r = divmod(done, length)
                done += os.pwrite(self._fd, views[k][r : r + PIECE], offset + done)
            copied = time.thread_time() - cpu
            if self._write_out is not None:
                self._write_out(self._fd, offset, total, WRITE_OUT)  # a hint: its failure changes nothing
            if total >= self._bs:  # whole blocks only: a short tail's CPU time is mostly the calls'
                self._judge_cache(total, copied)
        finally:
            for view in views:
                view.release()

    def _judge_cache(self, nbytes: int, cpu_seconds: float) -> None:
        """After a block was copied into the page cache: :data:`SLOW_BLOCKS` blocks in a row copied
        slower than :data:`SLOW_CACHE_RATE` (CPU time: waiting for the disk does not count) switch
        this file, and the process's later outputs, to direct writes (see :class:`OutputFile`)."""
        global _CACHE_SLOW

        self._slow = self._slow + 1 if cpu_seconds * SLOW_CACHE_RATE > nbytes else 0
        if self._slow >= SLOW_BLOCKS and not self._direct_refused and _auto_direct() and self._set_direct(True):
            self._direct = _CACHE_SLOW = True

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        """Write what is left; after this the file holds every byte written (not yet fsync'ed)."""
        self._stop()
        self._raise_failure()
        if self._direct:
            self._direct = False
            self._set_direct(False)
        if self._block is not None and self._fill:
            self._view.release()
            self._view = None
            self._pwrite([self._block], self._fill, self._base)
            self._base += self._fill
            self._fill = 0

    def close(self) -> None:
        """Stop the writer thread, return the blocks to the pool, close the file descriptor."""
        if self._closed:
            return
        self._closed = True
        self._error = self._error or _Closed()  # a failure mid-file: the thread skips what is queued
        self._stop()
        if self._view is not None:
            self._view.release()
        with _POOL_LOCK:
            for block in self._blocks:
                _POOL.setdefault(len(block), []).append(block)
        self._blocks = []
        os.close(self._fd)


class _Closed(Exception):
    pass


class Terminated(SystemExit):
    """SIGTERM arrived: unwinds like Ctrl-C, so that ``atomic_write`` removes its temporary file."""


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` (exit status 143) in the main thread, if nobody else
    handles it; the CLI calls this, library users keep their own signal handling."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def handler(signum, frame):
        raise Terminated(128 + signum)

    signal.signal(signal.SIGTERM, handler)
