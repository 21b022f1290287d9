"""The ``statekit`` console script: answers ``--version`` before importing anything heavy.

``statekit --version`` needs one string; importing the command line (typer, click, rich) for it
costs several times Python's own start-up. Everything else goes to :func:`statekit.cli.main`.
"""

from __future__ import annotations

import gc
import os
import sys

MATRIX_COMMANDS = ("replay", "verify-resume")  # steps with matrix products (Muon's Newton-Schulz)


def one_blas_thread(args: list[str], environ=os.environ) -> None:
    """For a command that multiplies no matrices, ask numpy's OpenBLAS for one thread (unless the
    user chose a number). At import it starts a worker per core, and they spin before they sleep:
    ``import numpy`` then a sleep costs 0.20 s of CPU with them, 0.09 s with one, and on 2 cores
    that spinning took a core from a convert's start-up and its copies (4.5 % of a 1 GiB
    transposing convert's samples). Moving, checking and comparing bytes never calls BLAS."""
    if not args or args[0] not in MATRIX_COMMANDS:
        environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> None:
    # no cycle collection while the command line is imported (tens of thousands of long-lived
    # objects, scanned again and again as they pile up); statekit.cli.main resumes it
    gc.disable()
    if sys.argv[1:] == ["--version"]:
        from statekit import __version__

        sys.stdout.write(f"statekit {__version__}\n")
        sys.exit(0)
    one_blas_thread(sys.argv[1:])
    from statekit.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
