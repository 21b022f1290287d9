"""Shared paths and the ``cli`` fixture.

``cli(*args, env=..., cwd=...)`` runs ``statekit`` in this process, through the same ``_run``
the console script calls (exit codes and one-line errors included), and returns an object with
``returncode``, ``stdout`` and ``stderr`` like :func:`subprocess.run`. :func:`run_entry_point`
starts the real console script in a fresh interpreter; a few tests use it to check the entry
point itself (start-up imports, ``python -m statekit``).

The suite's verdict must not depend on the shell it is run from: :data:`UNSET` is removed from the
environment before any test runs (the in-process commands and every subprocess see it gone), and
:func:`run_cli` sees no terminal on any descriptor (as under CI). Output is then as a pipe gets it
(tables at least 160 columns wide). A test that needs a width, a terminal style or a launcher's
share sets it itself (``env={"COLUMNS": "80"}``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

UNSET = (
    # the terminal's width and style (rich and statekit.output read these)
    "COLUMNS", "LINES", "JUPYTER_COLUMNS", "JUPYTER_LINES", "TTY_COMPATIBLE", "TTY_INTERACTIVE",
    "FORCE_COLOR", "NO_COLOR", "CLICOLOR", "CLICOLOR_FORCE",
    # a launcher's share (statekit.ops.shares: a convert to DCP would write one share of N)
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT",
)


def _pin_environment() -> None:
    """Remove :data:`UNSET` and statekit's own switches (``STATEKIT_*``: jobs, threads, direct I/O,
    debug tracebacks) from the environment this test session and its subprocesses run in."""
    for name in list(os.environ):
        if name in UNSET or name.startswith(("STATEKIT_", "_STATEKIT_")):
            del os.environ[name]


# a megatron-core venv's python for the tests that run megatron-core itself (skipped without it);
# read before the pin below removes every STATEKIT_* variable (a test's ``from tests.conftest import``
# runs this module a second time, after the pin: it takes pytest's own import's value)
MCORE_PY = os.environ.get("STATEKIT_MCORE_PY") or getattr(sys.modules.get("conftest"), "MCORE_PY", None)
_pin_environment()


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class _Stream(io.TextIOWrapper):
    """A text stream over bytes that is not a terminal (as a pipe is)."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8", newline="", write_through=True)

    def text(self) -> str:
        self.flush()
        return self.buffer.getvalue().decode("utf-8", "surrogateescape")  # a name that is no UTF-8: as given


def _no_terminal(fd: int = 1):
    raise OSError(25, "Inappropriate ioctl for device")  # what os.get_terminal_size says off a terminal


@contextlib.contextmanager
def _environment(env: dict | None, cwd: Path):
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    if not env or "STATEKIT_DEBUG" not in env:
        os.environ.pop("STATEKIT_DEBUG", None)
    os.environ.update(env or {})
    os.chdir(cwd)
    saved_size, os.get_terminal_size = os.get_terminal_size, _no_terminal  # pytest's stdin may be one
    try:
        yield
    finally:
        os.get_terminal_size = saved_size
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> CliResult:
    """Run the CLI in this process, as the console script would, capturing its output."""
    from statekit.cli import _run

    argv = [str(a) for a in args]
    out, err = _Stream(), _Stream()
    with _environment(env, cwd or ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _run(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # STATEKIT_DEBUG=1 lets the traceback through, as Python prints it
            traceback.print_exc(file=sys.stderr)
            code = 1
    return CliResult(argv, code, out.text(), err.text())


def run_entry_point(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed console script as a user would (a fresh process)."""
    full_env = {**os.environ, **(env or {})}
    if not env or "STATEKIT_DEBUG" not in env:
        full_env.pop("STATEKIT_DEBUG", None)
    exe = shutil.which("statekit")
    cmd = [exe] if exe else [sys.executable, "-m", "statekit"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=full_env,
                          cwd=cwd or ROOT, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def entry_point():
    return run_entry_point
