"""The CLI's one output module: human tables or JSON on stdout, one-line errors on stderr.

Everything a command shows goes through :class:`Output`, so ``--json`` and the human mode stay
in step and errors always look the same: ``statekit: error: <file>: <problem>``.
"""

from __future__ import annotations

import contextlib
import json
import json.encoder
import math
import os
import sys
from collections.abc import Iterator


def _console(stderr: bool = False, width: int | None = None):
    """A rich console, imported on first use: JSON, TSV and long plain tables never need one.

    No markup and no emoji codes: what statekit prints (paths, names) is shown as it is
    (rich would turn a path such as ``blocks[bold]x`` into ``blocksx``).
    """
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, markup=False, emoji=False, width=width)


def _text(message: str, style: str | None = None):
    from rich.text import Text

    return Text(message, style=style or "")


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


class _Unusual(Exception):
    """A value the fast encoder leaves to :mod:`json` (which explains what is wrong with it)."""


def dumps(obj: object) -> str:
    """``json.dumps(_jsonable(obj), indent=2, allow_nan=False)``, the same text, written faster.

    json's indented output runs its pure-Python encoder, a generator per container (measured:
    0.2 s of a 10,000-parameter ``inspect --json``). This walks the value once, appending pieces,
    with C's string quoting; a value it does not know goes back to json itself.
    """
    out: list[str] = []
    try:
        _dump(obj, out, "\n")
    except _Unusual:
        return json.dumps(_jsonable(obj), indent=2, allow_nan=False)
    return "".join(out)


_quote = json.encoder.encode_basestring_ascii  # json.dumps's own (ensure_ascii), in C
_LITERAL = {None: "null", True: "true", False: "false"}


def _dump(value: object, out: list[str], newline: str) -> None:
    """``value`` as indented JSON after ``newline`` (a newline and this depth's indent)."""
    kind = type(value)
    if kind is str:
        out.append(_quote(value))
    elif kind is int:
        out.append(int.__repr__(value))
    elif kind is float:
        out.append(float.__repr__(value) if math.isfinite(value) else _quote(str(value)))
    elif value is None or kind is bool:
        out.append(_LITERAL[value])
    elif kind is dict:
        if not value:
            out.append("{}")
            return
        inner = newline + "  "
        sep = "{" + inner
        for key, item in value.items():
            if type(key) is not str:
                raise _Unusual
            out.append(sep)
            out.append(_quote(key))
            out.append(": ")
            _dump(item, out, inner)
            sep = "," + inner
        out.append(newline + "}")
    elif kind is list or kind is tuple:
        if not value:
            out.append("[]")
            return
        inner = newline + "  "
        sep = "[" + inner
        for item in value:
            out.append(sep)
            _dump(item, out, inner)
            sep = "," + inner
        out.append(newline + "]")
    elif hasattr(value, "item") and not isinstance(value, dict | list | tuple | str):  # numpy scalars
        _dump(value.item(), out, newline)
    else:
        raise _Unusual


class Output:
    """Where a command's output goes, in the format the user chose (``table``, ``json``, ``tsv``)."""

    def __init__(self, json_mode: bool = False, quiet: bool = False, fmt: str | None = None):
        self.format = fmt or ("json" if json_mode else "table")
        self.quiet = quiet
        self._out = self._err = None

    @property
    def console(self):
        """stdout's console. Tables are wide: when stdout is not a terminal (a pipe, a file) do not
        squeeze them to 80 columns, unless COLUMNS says how wide to be."""
        if self._out is None:
            probe = _console()
            width = None if probe.is_terminal or os.environ.get("COLUMNS") else max(probe.width, 160)
            self._out = _console(width=width)
        return self._out

    @property
    def err(self):
        """stderr's console: never wrapped when it is not a terminal."""
        if self._err is None:
            self._err = _console(stderr=True)
            if not self._err.is_terminal:
                self._err = _console(stderr=True, width=1000)
        return self._err

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
        sys.stdout.write(dumps(obj) + "\n")

    def print(self, *objects: object) -> None:
        """Tables fit the width; lines of text are never wrapped (scripts grep them)."""
        if self.format == "table" and not self.quiet:
            if len(objects) == 1 and type(objects[0]).__name__ == "PlainLines":  # statekit.render: as is
                self.console.file.flush()
                sys.stdout.write(objects[0])
                return
            from rich.text import Text

            self.console.print(*objects, soft_wrap=all(isinstance(o, str | Text) for o in objects))

    def info(self, message: str) -> None:
        """A remark for humans (stderr in JSON mode so stdout stays parseable)."""
        if self.quiet:
            return
        (self.console if self.format == "table" else self.err).print(_text(message), soft_wrap=True)

    def warn(self, message: str) -> None:
        self.err.print(_text("warning: ", "yellow") + _text(message), soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None, unit_bytes: bool = False) -> Iterator:
        """A transient progress bar on stderr when it is a terminal; a no-op callback otherwise."""
        if self.quiet or not total or not self.err.is_terminal:
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
