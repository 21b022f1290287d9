"""The ``statekit`` command line: a thin typer layer over :mod:`statekit.ops`.

Errors are one line on stderr (``statekit: error: FILE: problem``) with exit code 1 (2 for usage
errors); ``STATEKIT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import click
import typer

from statekit.errors import StatekitError
from statekit.output import Output, error_line

app = typer.Typer(
    name="statekit",
    help=(
        "See, move and replay optimizer state: burn burnpack (.bpk), PyTorch (.pt), "
        "burn .mpk/.bin records and safetensors.\n\n"
        "Examples:\n\n"
        "  statekit inspect optim-10.bpk            # one row per parameter\n\n"
        "  statekit inspect optim-10.bpk --json     # the same for scripts\n\n"
        "  statekit convert optim-10.bpk copy.bpk   # rewrite (byte-identical for burn's files)"
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

FileArg = Annotated[Path, typer.Argument(metavar="FILE", help="A burnpack .bpk, PyTorch .pt, burn .mpk/.bin or safetensors file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


@app.command()
def inspect(
    file: FileArg,
    stats: Annotated[bool, typer.Option("--stats", help="Add min/max/mean/RMS and NaN/Inf counts per field (reads all data).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Show what a file holds: kind, optimizer family, one row per parameter.

    Reads only the header and metadata unless --stats is given. Parameters are grouped by module
    prefix with element and byte totals. burn ids are shown in both spellings (decimal u64 and
    the 13-character form burn prints).
    """
    from statekit import io
    from statekit.ops.inspect import inspect as describe
    from statekit.render import inspect_table

    out = Output(json_out)
    with io.open_checkpoint(file) as ckpt:
        total = len(ckpt.optimizer.params) if ckpt.optimizer else len(ckpt.model.params) if ckpt.model else 0
        with out.progress("statistics", total if stats else None) as advance:
            result = describe(ckpt, stats=stats, on_param=advance)
    if json_out:
        out.json(result)
    else:
        for item in inspect_table(result, stats):
            out.print(item)


@app.command()
def convert(
    src: FileArg,
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Output file; its extension picks the format (.bpk).")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Convert optimizer state between formats (written atomically: all or nothing).

    burnpack → burnpack rewrites the file with burn's writer rules: a file written by burn comes
    out byte-identical.
    """
    from statekit.ops.convert import convert_file

    out = Output(json_out)
    convert_file(src, dst, out=out, dry_run=dry_run)


def _click_exception(exc: BaseException) -> int | None:
    """Exit code for click's (or typer's vendored click's) own exceptions; None for others."""
    name = type(exc).__name__
    if name == "Exit" and hasattr(exc, "exit_code"):
        return exc.exit_code
    if name == "Abort":
        error_line("aborted")
        return 130
    if isinstance(exc, click.ClickException) or (hasattr(exc, "show") and hasattr(exc, "exit_code")):
        exc.show()
        return exc.exit_code
    return None


def _run(args: list[str] | None = None) -> int:
    debug = bool(os.environ.get("STATEKIT_DEBUG"))
    try:
        app(args=args, standalone_mode=False, prog_name="statekit")
    except StatekitError as exc:
        if debug:
            raise
        error_line(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        error_line("interrupted")
        return 130
    except OSError as exc:
        if debug:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        error_line(f"{where}{exc.strerror or exc}")
        return 1
    except Exception as exc:  # a bug: still one line, with the way to see more
        code = _click_exception(exc)
        if code is not None:
            return code
        if debug:
            raise
        error_line(f"internal error: {type(exc).__name__}: {exc} (run with STATEKIT_DEBUG=1 for the traceback)")
        return 1
    return 0


def main() -> None:
    sys.exit(_run())
