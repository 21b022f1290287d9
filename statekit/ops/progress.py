"""How operations report progress without printing: a factory the caller passes in.

``progress(description, total, unit_bytes=False)`` returns a context manager that yields an
``advance(n=1)`` callback. The CLI passes :meth:`statekit.output.Output.progress` (a bar on a
terminal); the Python API passes nothing and gets :func:`silent`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol


class ProgressFactory(Protocol):
    def __call__(self, description: str, total: int | None, unit_bytes: bool = False
                 ) -> contextlib.AbstractContextManager[Callable[..., None]]: ...


@contextlib.contextmanager
def silent(description: str, total: int | None, unit_bytes: bool = False) -> Iterator[Callable[..., None]]:
    yield lambda advance=1: None
