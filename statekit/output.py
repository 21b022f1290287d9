"""The CLI's one output module: human tables or JSON on stdout, one-line errors on stderr.

Everything a command shows goes through :class:`Output`, so ``--json`` and the human mode stay
in step and errors always look the same: ``statekit: error: <file>: <problem>``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return _jsonable(value.item())
    return value


class Output:
    """Where a command's output goes, in the format the user chose (``table``, ``json``, ``tsv``)."""

    def __init__(self, json_mode: bool = False, quiet: bool = False, fmt: str | None = None):
        self.format = fmt or ("json" if json_mode else "table")
        self.quiet = quiet
        # Tables are wide: when stdout is not a terminal (a pipe, a file) do not squeeze to 80,
        # unless COLUMNS says how wide to be.
        probe = Console()
        width = None if probe.is_terminal or os.environ.get("COLUMNS") else max(probe.width, 160)
        self.console = Console(highlight=False, width=width)
        self.err = Console(stderr=True, highlight=False, width=None if Console(stderr=True).is_terminal else 1000)

    @property
    def json_mode(self) -> bool:
        return self.format == "json"

    @property
    def width(self) -> int:
        return self.console.width

    def show(self, kind: str, result, **options) -> None:
        """Render an operation's result in the chosen format (:mod:`statekit.render`)."""
        from statekit import render

        if self.format == "json":
            self.json(result.to_json() if hasattr(result, "to_json") else result)
        elif self.format == "tsv":
            sys.stdout.write("".join(line + "\n" for line in render.tsv_lines(kind, result)))
        else:
            for item in render.table(kind, result, **options):
                self.print(item)

    def json(self, obj: object) -> None:
        sys.stdout.write(json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")

    def print(self, *objects: object) -> None:
        """Tables fit the width; lines of text are never wrapped (scripts grep them)."""
        if self.format == "table" and not self.quiet:
            if len(objects) == 1 and type(objects[0]).__name__ == "PlainLines":  # statekit.render: as is
                self.console.file.flush()
                sys.stdout.write(objects[0])
                return
            self.console.print(*objects, soft_wrap=all(isinstance(o, str | Text) for o in objects))

    def info(self, message: str) -> None:
        """A remark for humans (stderr in JSON mode so stdout stays parseable)."""
        if self.quiet:
            return
        (self.console if self.format == "table" else self.err).print(Text(message), soft_wrap=True)

    def warn(self, message: str) -> None:
        self.err.print(Text("warning: ", style="yellow") + Text(message), soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None, unit_bytes: bool = False) -> Iterator:
        """A transient progress bar on stderr when it is a terminal; a no-op callback otherwise."""
        if self.quiet or not self.err.is_terminal or not total:
            yield lambda advance=1: None
            return
        # imported here: a short command, or one whose stderr is not a terminal, never needs it
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        columns = [TextColumn("{task.description}"), BarColumn()]
        columns += [DownloadColumn()] if unit_bytes else [TextColumn("{task.completed}/{task.total}")]
        with Progress(*columns, TimeRemainingColumn(), console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda advance=1: bar.advance(task, advance)


def error_line(message: str) -> None:
    """Print one error line on stderr, never wrapped."""
    sys.stderr.write(f"statekit: error: {' '.join(message.split())}\n")
    sys.stderr.flush()
