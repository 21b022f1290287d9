"""The CLI's one output module: human tables or JSON on stdout, one-line errors on stderr.

Everything a command shows goes through :class:`Output`, so ``--json`` and the human mode stay
in step and errors always look the same: ``statekit: error: <file>: <problem>``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator


def _as_given(exc: UnicodeError) -> tuple[bytes, int]:
    """The codec error handler :func:`names_as_given` installs: a character stdout's encoding cannot
    hold is written as the byte a file name held (Python reads a name that is not UTF-8 with
    ``surrogateescape``: byte 0xff is U+DCFF), else as a backslash escape (``\\xb7``)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = bytearray()
    for char in exc.object[exc.start : exc.end]:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(code - 0xDC00)
        else:
            out += char.encode("ascii", "backslashreplace")
    return bytes(out), exc.end


def names_as_given() -> None:
    """Let stdout and stderr write any name: file and parameter names are bytes the user chose, and
    one that is not UTF-8 (or a character a non-UTF-8 terminal's encoding lacks) ended a command in
    UnicodeEncodeError where the stream's errors were ``strict`` (a UTF-8 locale other than C.UTF-8,
    ``PYTHONIOENCODING``). Names come out as the bytes given, like ``ls`` writes them to a pipe."""
    import codecs

    try:
        codecs.lookup_error("statekit.as_given")
    except LookupError:
        codecs.register_error("statekit.as_given", _as_given)
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "backslashreplace", "surrogateescape") and hasattr(
                stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="statekit.as_given")


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
    if isinstance(value, list | tuple) or getattr(type(value), "json_list", False):
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
    return "".join(dump_chunks(obj))


class _Pieces(list):
    """The pieces :func:`_dump` appends; every :data:`PIECES` of them joined into one chunk, so
    that a description of 10^6 parameters is held as its text, not as 2·10^7 small strings."""

    __slots__ = ("checking", "chunks", "sink")

    def __init__(self, sink=None, checking: bool = False) -> None:
        super().__init__()
        self.chunks: list[str] = []
        self.sink = sink  # where each chunk goes instead (Output.json: stdout), or None: kept
        self.checking = checking  # write_chunks' first walk: only whether json is needed counts

    def fold(self) -> None:
        if self.sink is None:
            self.chunks.append("".join(self))
        else:
            self.sink("".join(self))
        self.clear()


PIECES = 1 << 16


def dump_chunks(obj: object) -> list[str]:
    """:func:`dumps`'s text in chunks (written one after the other, never joined: see ``Output.json``)."""
    global _quote
    if _quote is None:
        from json.encoder import encode_basestring_ascii as _quote  # json.dumps's own (ensure_ascii), in C
    out = _Pieces()
    try:
        _dump(obj, out, "\n")
    except _Unusual:
        import json

        return [json.dumps(_jsonable(obj), indent=2, allow_nan=False)]
    out.fold()
    return out.chunks


def write_chunks(obj: object, write) -> None:
    """:func:`dumps`'s text given to ``write`` chunk by chunk, none of it kept (10^6 parameters'
    text held at once was ~0.35 GB). A first walk writes nothing: a value only :mod:`json` can
    write is found before any output (then json writes it all), so output is never partial."""
    global _quote
    if _quote is None:
        from json.encoder import encode_basestring_ascii as _quote
    try:
        _dump(obj, _Pieces(lambda chunk: None, checking=True), "\n")
    except _Unusual:
        import json

        write(json.dumps(_jsonable(obj), indent=2, allow_nan=False))
        return
    out = _Pieces(write)
    _dump(obj, out, "\n")
    out.fold()


_quote = None  # json's string quoting, imported by the first dumps()
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
    elif kind is list or kind is tuple or getattr(kind, "json_list", False):  # (json_list: ops.inspect.Rows)
        if out.checking and kind is not list and kind is not tuple and hasattr(value, "json_check"):
            checked = value.json_check()
            if checked is not value:
                _dump(checked, out, newline)
                return
        if not value:
            out.append("[]")
            return
        inner = newline + "  "
        sep = "[" + inner
        for item in value:
            out.append(sep)
            _dump(item, out, inner)
            sep = "," + inner
            if len(out) > PIECES:
                out.fold()
        out.append(newline + "]")
    elif hasattr(value, "item") and not isinstance(value, dict | list | tuple | str):  # numpy scalars
        _dump(value.item(), out, newline)
    else:
        raise _Unusual


def _plain_width() -> int | None:
    """The width stdout's rich console would have, when it draws without any style; else None.

    rich draws without styles when stdout is not a terminal by its rules (``TTY_COMPATIBLE``,
    ``FORCE_COLOR``, ``isatty``), and keeps its box characters when stdout's encoding is UTF.
    Then :mod:`statekit.render.boxes` writes the same text without importing rich. The width is
    :attr:`Output.console`'s: ``COLUMNS`` when it is a number, else a terminal's on stdin or
    stderr (or 80), at least 160 unless ``COLUMNS`` is set.
    """
    import builtins

    env = os.environ
    if os.name != "posix" or hasattr(builtins, "get_ipython") or hasattr(sys.stdout, "rich_proxied_file"):
        return None
    if env.get("TTY_COMPATIBLE", "") == "1" or env.get("TTY_COMPATIBLE", "") != "0" and env.get("FORCE_COLOR"):
        return None
    if env.get("TTY_COMPATIBLE", "") != "0" and env.get("FORCE_COLOR") is None:
        try:
            if sys.stdout.isatty():
                return None
        except (AttributeError, ValueError):
            pass
    if not (getattr(sys.stdout, "encoding", "utf-8") or "utf-8").lower().startswith("utf"):
        return None
    columns = env.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
    else:
        width = 80
        for fd in (0, 1, 2):
            try:
                width = os.get_terminal_size(fd).columns or 80
                break
            except (AttributeError, ValueError, OSError):
                continue
        if not columns:
            width = max(width, 160)
    return width if width >= 8 else None


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
        if self._out is None:
            plain = _plain_width()
            if plain is not None:
                return plain
        return self.console.width

    def show(self, kind: str, result, **options) -> None:
        """Render an operation's result in the chosen format (:mod:`statekit.render`)."""
        from statekit import render

        if self.format == "json":
            self.json(result.to_json() if hasattr(result, "to_json") else result)
        elif self.format == "tsv":
            batch: list[str] = []  # written a few thousand lines at a time: never the whole text
            for line in render.tsv_lines(kind, result):
                batch.append(line)
                if len(batch) >= 4096:
                    sys.stdout.write("\n".join(batch) + "\n")
                    batch.clear()
            if batch:
                sys.stdout.write("\n".join(batch) + "\n")
        else:
            for item in render.table(kind, result, **options):
                self.print(item)

    def json(self, obj: object) -> None:
        write_chunks(obj, sys.stdout.write)
        sys.stdout.write("\n")

    def print(self, *objects: object) -> None:
        """Tables fit the width; lines of text are never wrapped (scripts grep them)."""
        if self.format == "table" and not self.quiet:
            if len(objects) == 1 and type(objects[0]).__name__ == "PlainLines":  # statekit.render: as is
                sys.stdout.write(objects[0])
                return
            if len(objects) == 1 and self._plain(objects[0]):
                return
            from rich.text import Text

            objects = tuple(o.to_rich() if hasattr(o, "to_rich") else o for o in objects)
            self.console.print(*objects, soft_wrap=all(isinstance(o, str | Text) for o in objects))

    def _plain(self, item: object) -> bool:
        """Write a :mod:`statekit.render.boxes` line or table without rich when rich would draw
        exactly that text (no terminal, no styles); False when rich must draw it."""
        if not hasattr(item, "to_rich") or self._out is not None:
            return False
        width = _plain_width()
        if width is None:
            return False
        from statekit.render import boxes

        text = item.plain(width) if isinstance(item, boxes.Line) else boxes.draw(item, width)
        if text is None:
            return False
        sys.stdout.write(text)
        return True

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
