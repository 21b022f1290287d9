"""The client libraries statekit runs (transformers, peft and what they import: accelerate,
bitsandbytes, huggingface_hub …), kept quiet: what they print is not statekit's to show.

Importing them, or building a model with them on the meta device, may print: bitsandbytes
announces at import which CPU kernels it failed to load, transformers and peft warn about
versions and configs. :func:`quiet` holds all of it while its block runs — writes to
``sys.stdout`` and ``sys.stderr``, writes straight to file descriptors 1 and 2 (a library's C
code, or a stream handler made before the block), warnings, and log records — and drops it;
with ``STATEKIT_DEBUG`` set it shows it on stderr once the block is over, under one line naming
what was run. A stream a library keeps from inside the block (a logging handler made at import)
writes where ``sys.stdout``/``sys.stderr`` did before it, once the block is over.

This module imports none of those libraries; callers import them inside the block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import warnings

#: one block at a time: the streams and descriptors swapped are the process's
_LOCK = threading.RLock()
_held: list[tuple[str, str]] = []  # (what, text) of the blocks run so far that printed, newest last
_KEEP = 16
_depth = threading.local()  # a block inside a block: the outer one holds it all


def held() -> list[tuple[str, str]]:
    """``(what, text)`` of the most recent blocks (at most 16) whose libraries printed something."""
    return list(_held)


class _Held:
    """A text stream that holds what is written while its block runs, then passes writes on to the
    stream it stood in for (a library may keep it: a logging handler made at import)."""

    def __init__(self, target):
        self._target = target
        self._parts: list[str] | None = []

    def write(self, text: str) -> int:
        if self._parts is not None:
            self._parts.append(str(text))
            return len(text)
        return self._target.write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._parts is None:
            self._target.flush()

    def isatty(self) -> bool:
        return False if self._parts is not None else self._target.isatty()

    def release(self) -> str:
        text, self._parts = "".join(self._parts or ()), None
        return text

    def __getattr__(self, name):  # encoding, errors, fileno, buffer …: the stream's own
        return getattr(self._target, name)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.name}: {record.levelname}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a record whose message cannot be formatted
            self.lines.append(f"{record.name}: {record.levelname}: {record.msg!r}")


@contextlib.contextmanager
def _descriptors():
    """File descriptors 1 and 2 pointed at one temporary file while the block runs; yields a
    function that returns what reached it (empty where a descriptor cannot be swapped)."""
    saved: list[tuple[int, int]] = []
    spool = None
    try:
        spool = tempfile.TemporaryFile()
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # closed (a daemon, pythonw): nothing can reach it anyway
                continue
            os.dup2(spool.fileno(), fd)
    except OSError:
        pass
    text: list[str] = []
    try:
        yield text
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        if spool is not None:
            spool.seek(0)
            text.append(spool.read().decode("utf-8", "replace"))
            spool.close()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


@contextlib.contextmanager
def quiet(what: str):
    """Run the block with everything the client libraries print held back (see the module);
    ``what`` names it (``"importing peft"``) in the ``STATEKIT_DEBUG`` output; a block inside
    another is the outer one's."""
    if getattr(_depth, "n", 0):
        yield
        return
    with _LOCK:
        _depth.n = 1
        _flush()
        out, err = _Held(sys.stdout), _Held(sys.stderr)
        records = _Records()
        root = logging.getLogger()
        sys.stdout, sys.stderr = out, err
        root.addHandler(records)
        try:
            with warnings.catch_warnings(record=True) as caught, _descriptors() as raw:
                warnings.simplefilter("default")  # each once per place, as Python shows them
                try:
                    yield
                finally:
                    _flush()
        finally:
            _depth.n = 0
            root.removeHandler(records)
            sys.stdout, sys.stderr = out._target, err._target
            parts = [out.release(), err.release(), *raw]
            parts += [line + "\n" for line in records.lines]
            parts += [warnings.formatwarning(w.message, w.category, w.filename, w.lineno, None) for w in caught]
            text = "".join(parts)
            if text.strip():
                _held.append((what, text))
                del _held[:-_KEEP]
                if os.environ.get("STATEKIT_DEBUG"):
                    body = "".join(f"  {line}\n" for line in text.rstrip("\n").splitlines())
                    sys.stderr.write(f"statekit: {what} printed (shown because STATEKIT_DEBUG is set):\n{body}")
                    _flush()
