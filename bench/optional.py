"""Which optional packages the Python running a benchmark can import, printed beside its table:
the goals are for the README's ``pip install -e .`` (none of them), and numba, isal or ml_dtypes
change what statekit runs (replay kernels, CRC-32, extended dtypes)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

OPTIONAL = ("numba", "isal", "ml_dtypes", "torch", "cupy")


def line() -> str:
    found = []
    for name in OPTIONAL:
        if importlib.util.find_spec(name) is None:
            found.append(f"{name} no")
            continue
        try:
            found.append(f"{name} {importlib.metadata.version(name.replace('_', '-'))}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} yes")
    venv = "venv" if sys.prefix != sys.base_prefix else "system Python"
    return f"optional packages importable ({sys.executable}, {venv}): " + ", ".join(found)
