"""Which optional packages the Python running a benchmark can import, printed beside its table:
the goals are for the README's ``pip install -e .`` (which installs isal and ml_dtypes, not numba,
torch or cupy), and each changes what statekit runs (replay kernels, CRC-32, extended dtypes)."""

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


def installed_env(root, **extra: str) -> dict:
    """The environment a benchmark's child commands run in, as an install has them: statekit's
    modules compiled once (pip compiles a wheel's bytecode; an editable install writes it on first
    import), and ``PYTHONDONTWRITEBYTECODE`` (which some sandboxes set) dropped, else every run
    would compile every module again (about 0.2 s a command)."""
    import os
    import subprocess

    env = {**os.environ, **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(str(root), "statekit")], env=env,
                   stdout=subprocess.DEVNULL, check=True)
    return env
