"""The releases of torch, transformers and bitsandbytes installed beside statekit: read, never imported.

What statekit reads or calls changed between these libraries' releases: Trainer's decay rule
(transformers 4.49 and 4.53), ``param_names`` in torch's param groups (torch 2.6), the
``decoupled_weight_decay`` argument of torch's ``adam()`` that replay's torch kernel passes (torch
2.7), bitsandbytes' state layouts (0.44: blocks of 256; 0.49.2: nested entries). A file says which
release wrote it where it can; where statekit runs a library (a model's definition built with
transformers, a replay step with torch's kernel) or writes for one (bitsandbytes' layout), the
installed release decides. It is read from the package's installed metadata (its ``.dist-info``
folder), so asking costs no import of torch or transformers, which take seconds to import.

:data:`TESTED` gives each library's range: from the oldest release whose behaviour statekit relies
on (what ``pyproject.toml``'s extras require) to the newest the suite was run with
(``constraints.txt``, or the fixtures' writers). A release outside it gets one warning line
(:func:`outside`), never a refusal.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from functools import cache

Version = tuple[int, ...]

# (oldest relied on, newest tested) by (major, minor); keep in step with pyproject.toml and constraints.txt
TESTED: dict[str, tuple[Version, Version]] = {
    "torch": ((2, 7), (2, 13)),
    "transformers": ((4, 46), (5, 24)),
    # fixtures/bnb were written by 0.50.2; the older layouts are read from bitsandbytes' code (docs/third-party.md)
    "bitsandbytes": ((0, 50), (0, 50)),
    # fixtures/finetune were written by peft 0.21.2 (pyproject's peft extra, constraints.txt)
    "peft": ((0, 21), (0, 21)),
}


def parse(text: object) -> Version | None:
    """``"2.13.0+cpu"`` → ``(2, 13, 0)``; None for anything without a leading ``major.minor``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text)) if text else None
    if not match:
        return None
    return tuple(int(g) for g in match.groups() if g is not None)


@cache
def installed(dist: str) -> str | None:
    """The installed release of distribution ``dist``, None when absent.

    A wheel installs ``{name}-{version}.dist-info`` (PEP 427): the first such folder on
    ``sys.path`` names the release, as ``importlib.metadata.version`` would find it, without
    importing ``importlib.metadata`` (email, zipfile, csv: a third of numpy's import time, measured
    on every convert to .pt). Anything else (an egg, a folder elsewhere) asks importlib.metadata,
    unless no module of that name can be imported either.
    """
    prefix = re.sub(r"[-_.]+", "_", dist).lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or os.curdir)
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and name.lower().startswith(prefix):
                return name[len(prefix):-len(".dist-info")]
    if importlib.util.find_spec(prefix[:-1]) is None:  # no such module either: absent (torch, transformers and
        return None  # bitsandbytes are imported by their distribution's name)
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def at_least(dist: str, version: Version, *, unknown: bool = True) -> bool:
    """Whether the installed ``dist`` is ``version`` or newer (``unknown`` when it is absent or unreadable)."""
    have = parse(installed(dist))
    return unknown if have is None else have >= version


def _show(version: Version) -> str:
    return ".".join(map(str, version))


def outside(dist: str, text: str | None = None) -> str | None:
    """One warning line when ``dist``'s release (``text``; default: the installed one) lies outside
    :data:`TESTED`, else None (also when it is absent or unreadable)."""
    text = installed(dist) if text is None else text
    have = parse(text)
    if have is None or dist not in TESTED:
        return None
    low, high = TESTED[dist]
    tested = f"{_show(low)} to {_show(high)}" if low != high else _show(low)
    if low <= have[:2] <= high:
        return None
    return f"{dist} {text} is {'older' if have[:2] < low else 'newer'} than the releases statekit was tested with ({tested})"
