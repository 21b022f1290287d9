"""Atomic output files: write to a sibling temporary file, fsync, then rename over the target.

A failure (an exception, Ctrl-C, SIGTERM in the CLI) removes the temporary file, so a target is
either the complete new file or untouched. The temporary file's name records the host and
process that write it (``.NAME.statekit-HOST-PID.XXXXXXXX.tmp``); a process killed outright
(SIGKILL, power loss) cannot remove its own, so every later write to the same target removes the
temporary files of that target whose writer, on this host, is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Iterator
from typing import BinaryIO


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
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale(path)
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_prefix(os.path.basename(path))}{os.getpid()}.", suffix=".tmp",
                                   dir=directory)
    except OSError as exc:  # name the file the user asked for, not the temporary one
        raise OSError(exc.errno, f"cannot write there: {exc.strerror}", path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
