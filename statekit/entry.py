"""The ``statekit`` console script: answers ``--version`` before importing anything heavy.

``statekit --version`` needs one string; importing the command line (typer, click, rich) for it
costs several times Python's own start-up. Everything else goes to :func:`statekit.cli.main`.
"""

from __future__ import annotations

import gc
import sys


def main() -> None:
    # no cycle collection while the command line is imported (tens of thousands of long-lived
    # objects, scanned again and again as they pile up); statekit.cli.main resumes it
    gc.disable()
    if sys.argv[1:] == ["--version"]:
        from statekit import __version__

        sys.stdout.write(f"statekit {__version__}\n")
        sys.exit(0)
    from statekit.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
