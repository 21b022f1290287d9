"""Tables and lines of text that draw themselves as rich would, without importing rich.

rich draws statekit's tables on a terminal. Where stdout is a pipe or a file there is no colour
or style to draw, and importing rich and laying a table out cell by cell costs more than Python's
own start-up (measured: 34 ms of a 0.1 s ``statekit inspect``). :class:`Grid` and :class:`Line`
hold what a table or a line says; :meth:`Grid.to_rich` / :meth:`Line.to_rich` build rich's
objects for a terminal, and :func:`draw` / :meth:`Line.plain` write the very same characters
rich writes when it draws without styles: rich's ``Table(box=HEAVY_HEAD, pad_edge=False)`` with
padding (0, 1), its column widths (natural widths, then wrappable columns collapsed from the
widest), its word wrap and folding (``rich._wrap.divide_line``), left or right justified.

They answer None whenever the text is outside what they reproduce for certain: a cell that is
not printable ASCII (wide or combining characters, tabs, control codes), a line with trailing
whitespace or anything unprintable, a table rich would squeeze below its unwrappable columns'
widths. Then rich draws it. ``tests/test_boxes.py`` compares both on thousands of random tables.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"\s*\S+\s*")  # rich._wrap.re_word
_TRAILING_SPACE = re.compile(r"\s+$")


class Column:
    """A column: its name, ``justify`` ("left" or "right"), and whether its cells wrap (rich's
    ``no_wrap=not wrap``; a wrapped cell folds words longer than the column)."""

    __slots__ = ("name", "justify", "wrap")

    def __init__(self, name: str, justify: str = "left", wrap: bool = False):
        self.name, self.justify, self.wrap = name, justify, wrap

    def __repr__(self) -> str:
        return f"Column({self.name!r}, {self.justify!r}, {self.wrap!r})"


class Grid:
    """A table: a header of column names, rows of text cells, a rule after a row that ends a section.

    (Plain classes, not dataclasses: building a dataclass costs start-up time.)
    """

    def __init__(self, columns: list[Column]):
        self.columns = columns
        self.rows: list[list[str]] = []
        self.styles: list[str] = []  # each row's style on a terminal ("" for none)
        self.section_ends: set[int] = set()

    def add_row(self, cells: list[str], style: str = "", end_section: bool = False) -> None:
        if end_section:
            self.section_ends.add(len(self.rows))
        self.rows.append(list(cells))
        self.styles.append(style)

    def to_rich(self):
        from rich.table import Table
        from rich.text import Text

        table = Table(show_lines=False, header_style="bold", pad_edge=False)
        for c in self.columns:
            table.add_column(c.name, justify=c.justify, no_wrap=not c.wrap, overflow="fold")
        for i, (cells, style) in enumerate(zip(self.rows, self.styles, strict=True)):
            shown = [Text(c, style=style) for c in cells] if style else cells
            table.add_row(*shown, end_section=i in self.section_ends)
        return table


class Line:
    """One line of text in parts, each with its style on a terminal: ``Line((("a: ", "bold"), ("b", "")))``."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[tuple[str, str], ...]):
        self.parts = parts

    @staticmethod
    def of(text: str, style: str = "") -> Line:
        return Line(((text, style),))

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.parts)

    def plain(self, width: int) -> str | None:
        """The line as rich prints it unwrapped and without styles, or None when not certain."""
        text = self.text
        if not text.isprintable() or _TRAILING_SPACE.search(text):
            return None
        return text + "\n"

    def to_rich(self):
        from rich.text import Text

        line = Text()
        for text, style in self.parts:
            line.append(text, style=style or None)
        return line


#: characters beyond ASCII that statekit's tables use, one terminal cell each in rich's measure
#: (``rich.cells.cell_len``) and never whitespace: shapes are written ``4×16``
_ONE_CELL = frozenset("×·")


def _printable_ascii(text: str) -> bool:
    """Printable ASCII (``×`` and ``·`` too): one character is one cell, as rich measures it."""
    return text.isprintable() and (text.isascii() or all(ch.isascii() or ch in _ONE_CELL for ch in text))


def draw(grid: Grid, width: int) -> str | None:
    """``grid`` as rich's Console(width=width, no colour).print(grid.to_rich()) writes it, or None."""
    columns = grid.columns
    n = len(columns)
    if not n or not all(_printable_ascii(c.name) for c in columns):
        return None
    if not all(_printable_ascii(cell) for row in grid.rows for cell in row):
        return None
    widths = _widths(grid, width)
    if widths is None:
        return None
    pads = [(0 if i == 0 else 1, 0 if i == n - 1 else 1) for i in range(n)]
    out = ["┏" + "┳".join("━" * w for w in widths) + "┓\n"]
    out += _row([c.name for c in columns], columns, widths, pads, "┃", header=True)
    out.append("┡" + "╇".join("━" * w for w in widths) + "┩\n")
    last = len(grid.rows) - 1
    for i, cells in enumerate(grid.rows):
        out += _row(cells, columns, widths, pads, "│", header=False)
        if i in grid.section_ends and i != last:
            out.append("├" + "┼".join("─" * w for w in widths) + "┤\n")
    out.append("└" + "┴".join("─" * w for w in widths) + "┘\n")
    return "".join(out)


def _widths(grid: Grid, width: int) -> list[int] | None:
    """rich's Table._calculate_column_widths for this table, or None where rich squeezes further."""
    n = len(grid.columns)
    available = width - (2 + n - 1)  # the edges and the dividers
    if available < 1:
        return None
    widths, wrappable = [], []
    for i, column in enumerate(grid.columns):
        pad = (0 if i == 0 else 1) + (0 if i == n - 1 else 1)
        natural = max([len(column.name)] + [len(row[i]) for row in grid.rows])
        # a padded cell's measure, clamped to the space there is (rich: Measurement.with_maximum)
        widths.append(min(natural + pad, available) or 1)
        wrappable.append(column.wrap)
    if sum(widths) > available:
        widths = _collapse(widths, wrappable, available)
        if sum(widths) > available:
            return None  # rich would shrink every column evenly, unwrappable ones too: left to rich
    for i in range(n):
        pad = (0 if i == 0 else 1) + (0 if i == n - 1 else 1)
        if widths[i] - pad < 1:
            return None
    return widths


def _collapse(widths: list[int], wrappable: list[bool], max_width: int) -> list[int]:
    """rich's Table._collapse_widths: shrink the widest wrappable columns first."""
    total = sum(widths)
    excess = total - max_width
    if not any(wrappable):
        return widths
    while total and excess > 0:
        widest = max(w for w, ok in zip(widths, wrappable, strict=True) if ok)
        second = max(w if ok and w != widest else 0 for w, ok in zip(widths, wrappable, strict=True))
        difference = widest - second
        ratios = [1 if (w == widest and ok) else 0 for w, ok in zip(widths, wrappable, strict=True)]
        if not any(ratios) or not difference:
            break
        widths = _ratio_reduce(excess, ratios, [min(excess, difference)] * len(widths), widths)
        total = sum(widths)
        excess = total - max_width
    return widths


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    """rich._ratio.ratio_reduce."""
    ratios = [r if m else 0 for r, m in zip(ratios, maximums, strict=True)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    remaining = total
    result = []
    for ratio, maximum, value in zip(ratios, maximums, values, strict=True):
        if ratio and total_ratio > 0:
            distributed = min(maximum, round(ratio * remaining / total_ratio))
            result.append(value - distributed)
            remaining -= distributed
            total_ratio -= ratio
        else:
            result.append(value)
    return result


def _row(cells: list[str], columns: list[Column], widths: list[int], pads: list[tuple[int, int]], edge: str,
         header: bool) -> list[str]:
    """The text lines of one row: each cell wrapped to its column, shorter cells padded below
    (a header's cells sit at the bottom, rich's vertical alignment for headers)."""
    blocks = []
    for cell, column, width, (left, right) in zip(cells, columns, widths, pads, strict=True):
        inner = width - left - right
        lines = _wrap(cell, inner, column.wrap, column.justify)
        blocks.append([" " * left + line + " " * right for line in lines])
    height = max(len(b) for b in blocks)
    for b, width in zip(blocks, widths, strict=True):
        blank = [" " * width] * (height - len(b))
        if header:
            b[:0] = blank
        else:
            b += blank
    return [edge + edge.join(b[k] for b in blocks) + edge + "\n" for k in range(height)]


def _wrap(text: str, width: int, wrap: bool, justify: str) -> list[str]:
    """rich's Text.wrap for one line of printable ASCII, justified and padded to ``width``."""
    if wrap:
        offsets = _divide_line(text, width)
        bounds = [0, *offsets, len(text)]
        lines = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    else:
        lines = [text]
    out = []
    for line in lines:
        if len(line) > width:  # Text.rstrip_end: whitespace beyond the width goes
            trailing = _TRAILING_SPACE.search(line)
            if trailing is not None:
                line = line[: len(line) - min(len(trailing.group(0)), len(line) - width)]
        if justify == "right":
            line = line.rstrip()[:width]
            line = " " * (width - len(line)) + line
        else:
            line = line[:width].ljust(width)
        out.append(line)
    return out


def _divide_line(text: str, width: int) -> list[int]:
    """rich._wrap.divide_line with fold=True, for text whose characters are one cell each."""
    breaks: list[int] = []
    offset = 0
    for match in _WORD.finditer(text):
        start, word = match.start(), match.group(0)
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width:
            pieces = [word[i : i + width] for i in range(0, len(word), width)]
            for k, piece in enumerate(pieces):
                if start:
                    breaks.append(start)
                if k == len(pieces) - 1:
                    offset = len(piece)
                else:
                    start += len(piece)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    return breaks
