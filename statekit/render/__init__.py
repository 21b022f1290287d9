"""Rendering of operation results: a table (rich), JSON or TSV, chosen by ``--format``.

One entry per kind of result in :data:`VIEWS`: the module that builds its table and its TSV
rows. Submodules are imported only when a result is rendered, so importing the CLI stays light.
JSON is the result itself (the operations return JSON-able dicts or objects with ``to_json``).
"""

from __future__ import annotations

import importlib

FORMATS = ("table", "json", "tsv")

# kind → (module, table function, tsv function); the functions take the result.
VIEWS: dict[str, tuple[str, str, str]] = {
    "inspect": ("statekit.render.inspect", "inspect_view", "inspect_tsv"),
    "plan": ("statekit.render.plan", "plan_view", "plan_tsv"),
    "diff": ("statekit.render.reports", "diff_view", "diff_tsv"),
    "merge": ("statekit.render.reports", "merge_view", "merge_tsv"),
    "split": ("statekit.render.reports", "split_view", "split_tsv"),
    "fit": ("statekit.render.reports", "fit_view", "fit_tsv"),
    "doctor": ("statekit.render.reports", "doctor_view", "doctor_tsv"),
    "verify": ("statekit.render.reports", "verify_view", "verify_tsv"),
    "replay": ("statekit.render.reports", "replay_view", "replay_tsv"),
    "report": ("statekit.render.report", "report_view", "report_tsv"),
    "schedule": ("statekit.render.schedule", "schedule_view", "schedule_tsv"),
}


def _function(kind: str, which: int):
    module, *names = VIEWS[kind]
    return getattr(importlib.import_module(module), names[which])


def table(kind: str, result, **options) -> list:
    """Renderables (rich tables, text lines) for a result."""
    return _function(kind, 0)(result, **options)


def tsv_lines(kind: str, result):
    """One header line and one line per row, tab-separated (tabs and newlines in cells become spaces)."""
    header, rows = _function(kind, 1)(result)
    return _lines(header, rows)


def _lines(header, rows):
    """(a generator: rows may be one, made as they are written)"""
    yield "\t".join(_cell(c) for c in header)
    for row in rows:
        yield "\t".join(_cell(c) for c in row)


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("\t", " ").replace("\n", " ")


def shape(dims) -> str:
    """``4×16``; ``scalar`` for ``[]``; ``-`` when unknown (:func:`statekit.state.format_shape`)."""
    from statekit.state import format_shape

    return format_shape(dims)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
