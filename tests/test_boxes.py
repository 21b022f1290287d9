"""statekit.render.boxes draws exactly what rich draws (rich itself is the reference), or declines.

Where stdout is not a terminal the CLI writes tables and lines with :mod:`statekit.render.boxes`
instead of importing rich; these tests lay thousands of random tables out both ways.
"""

from __future__ import annotations

import io
import json
import random

import pytest
from rich.console import Console

from statekit.output import _jsonable, dumps
from statekit.render import boxes
from statekit.render.boxes import Column, Grid, Line


def rich_draws(item, width: int) -> str:
    """What the CLI's rich console (no terminal, so no styles) prints for ``item``."""
    out = io.StringIO()
    Console(file=out, width=width, highlight=False, markup=False, emoji=False).print(
        item.to_rich(), soft_wrap=isinstance(item, Line))
    return out.getvalue()


def random_grid(rng: random.Random) -> Grid:
    letters = "abcdefgh.,_-0123456789 ×"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 13, 30])))

    def cell() -> str:
        if rng.random() < 0.1:
            return rng.choice(["", " ", "  a ", "x  ", " y", "a  b"])
        return " ".join(word() for _ in range(rng.choice([1, 1, 1, 2, 3, 5])))

    n = rng.randint(1, 8)
    grid = Grid([Column(word() or "c", rng.choice(["left", "right"]), rng.random() < 0.4) for _ in range(n)])
    for _ in range(rng.randint(0, 6)):
        grid.add_row([cell() for _ in range(n)], rng.choice(["", "dim"]), rng.random() < 0.3)
    return grid


@pytest.mark.parametrize("seed", range(4))
def test_tables_are_drawn_as_rich_draws_them(seed):
    rng = random.Random(seed)
    drawn = 0
    for _ in range(400):
        grid, width = random_grid(rng), rng.randint(5, 160)
        text = boxes.draw(grid, width)
        if text is not None:
            drawn += 1
            assert text == rich_draws(grid, width), (width, [c.name for c in grid.columns], grid.rows)
    assert drawn > 120  # most of them: wrapping, folding, sections, right-justified columns


def test_an_inspect_table_that_wraps_its_fields_column():
    grid = Grid([Column("path", wrap=True), Column("display id"), Column("rank", "right"), Column("step", "right"),
                 Column("fields", wrap=True)])
    for i in range(3):
        grid.add_row([f"layers.{i}.weight", "000699tjmrg0q", "1", "100", "momentum.moment_1, momentum.moment_2"])
    grid.add_row(["", "", "", "", "layers: 384 elements, 1.5 KiB"], style="dim", end_section=True)
    for width in (40, 60, 70, 80, 100, 160):
        text = boxes.draw(grid, width)
        assert text is not None and text == rich_draws(grid, width)
    wrapped = [line for line in boxes.draw(grid, 80).splitlines() if "moment_2" in line]
    assert wrapped and all("moment_1" not in line for line in wrapped)  # the fields cell did wrap there


@pytest.mark.parametrize("cell", ["größe", "层.weight", "a\tb", "a\x1b[31mb", "emoji 😀"])
def test_cells_outside_printable_ascii_are_left_to_rich(cell):
    grid = Grid([Column("path"), Column("fields", wrap=True)])
    grid.add_row([cell, "x"])
    assert boxes.draw(grid, 80) is None


def test_lines_are_written_as_rich_writes_them_or_left_to_it():
    rng = random.Random(5)
    pieces = ["path.bpk: ", "burnpack v1 · optimizer (adam)", "größe", "层", " ", "\t", "\x07", "a" * 200, "😀", "[bold]x"]
    written = 0
    for _ in range(500):
        line = Line(tuple((rng.choice(pieces), rng.choice(["", "bold", "cyan"])) for _ in range(rng.randint(1, 3))))
        width = rng.randint(10, 120)
        text = line.plain(width)
        if text is not None:
            written += 1
            assert text == rich_draws(line, width), line.parts
    assert written > 150


def test_json_is_the_same_text_as_json_dumps():
    """statekit.output.dumps against json.dumps(indent=2) on random values (numpy scalars, NaN, keys
    that are not strings, tuples, unicode and escapes)."""
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    leaves = [None, True, False, 0, -5, 2**70, 1.5, float("nan"), float("inf"), -float("inf"), 1e300, -0.0,
              'a"b\\é😀\x01\u2028', "", np.float32(1.25), np.int64(7), np.bool_(True), (1, 2), np.float64("nan"),
              np.float32("inf"), 3.0]

    def value(depth=0):
        r = rng.random()
        if depth > 3 or r < 0.5:
            return rng.choice(leaves)
        if r < 0.75:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["k", "x", "ü", 1, 2.5, None, True]): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(3000):
        v = value()
        assert dumps(v) == json.dumps(_jsonable(v), indent=2, allow_nan=False)


def _with_rich_only(monkeypatch):
    monkeypatch.setattr(boxes, "draw", lambda grid, width: None)
    monkeypatch.setattr(boxes.Line, "plain", lambda self, width: None)


@pytest.mark.parametrize("columns", ["100", "60", "200", ""])
@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-model.bpk"])
def test_inspect_prints_the_same_without_rich(cli, fixtures, monkeypatch, name, columns):
    env = {"COLUMNS": columns}
    drawn_here, draw = [], boxes.draw
    monkeypatch.setattr(boxes, "draw", lambda grid, width: drawn_here.append(draw(grid, width)) or drawn_here[-1])
    plain = cli("inspect", fixtures / name, env=env)
    assert drawn_here and all(text is not None for text in drawn_here)  # no rich: boxes drew the table
    _with_rich_only(monkeypatch)
    drawn = cli("inspect", fixtures / name, env=env)
    assert plain.returncode == drawn.returncode == 0
    assert plain.stdout == drawn.stdout and "┏" in plain.stdout


def test_names_are_shown_as_they_are_not_as_rich_markup(cli, tmp_path, monkeypatch):
    """A parameter path with brackets or colons is printed as stored, table or not, terminal or not
    (rich's markup would have read ``[bold]`` as a style and ``:smile:`` as an emoji)."""
    from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
    from statekit.tensor import TensorRef

    np = pytest.importorskip("numpy")
    pid = 10**18
    path = "blocks[bold].attn:smile:.weight"
    write_burnpack(str(tmp_path / "odd.bpk"),
                   [PackTensor(f"{pid}.momentum.moment_1", TensorRef.from_array(np.zeros(4, np.float32)),
                               param_id=pid)],
                   {str(pid): path}, {f"{pid}.__rank": Scalar("UInt", 1)})
    plain = cli("inspect", tmp_path / "odd.bpk", env={"COLUMNS": "200"})
    assert plain.returncode == 0 and path in plain.stdout
    _with_rich_only(monkeypatch)
    drawn = cli("inspect", tmp_path / "odd.bpk", env={"COLUMNS": "200"})
    assert drawn.stdout == plain.stdout


@pytest.mark.parametrize("env", [{}, {"COLUMNS": "100"}, {"COLUMNS": "57"}, {"COLUMNS": "wide"}, {"COLUMNS": ""},
                                 {"TTY_COMPATIBLE": "0"}, {"FORCE_COLOR": ""}, {"COLUMNS": "300", "TTY_COMPATIBLE": "0"}])
def test_the_width_without_rich_is_the_width_rich_would_use(env, monkeypatch):
    from statekit.output import Output, _plain_width

    for name in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    width = _plain_width()
    assert width is not None and width == Output(fmt="table").console.width


@pytest.mark.parametrize("env", [{"TTY_COMPATIBLE": "1"}, {"FORCE_COLOR": "1"}])
def test_a_terminal_gets_rich_with_its_styles_and_the_same_text(cli, fixtures, env):
    """Where rich would style the output (a terminal, or told so) rich draws it; without its
    escape sequences the text is what statekit.render.boxes writes for a pipe."""
    import re

    styled = cli("inspect", fixtures / "hand-optim.bpk", env={"COLUMNS": "100", **env})
    plain = cli("inspect", fixtures / "hand-optim.bpk", env={"COLUMNS": "100"})
    assert "\x1b[" in styled.stdout and "\x1b[" not in plain.stdout
    assert re.sub(r"\x1b\[[0-9;]*m", "", styled.stdout) == plain.stdout
