"""Errors statekit reports to users.

Every error that reaches the CLI is a :class:`StatekitError`: the CLI prints ``statekit: <file>:
<message>`` on one line and exits 1 (``STATEKIT_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import os


class StatekitError(Exception):
    """A problem with the user's input, named with the file (when there is one)."""

    exit_code = 1

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else os.fspath(path)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class FormatError(StatekitError):
    """A file is not a valid instance of the format it claims to be (or was sniffed as)."""


class UnsafePickleError(FormatError):
    """A pickle asked for a global that the allow-list does not permit; nothing was executed."""


class MappingError(StatekitError):
    """State cannot be mapped between frameworks or models without losing or misplacing data."""


class UsageError(StatekitError):
    """The command line asks for something inconsistent (exit code 2, like click's usage errors)."""

    exit_code = 2
