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


# ----------------------------------------------------------------------------- diff / merge / doctor
# (statekit/ops/diff.py, merge.py, doctor.py; renderers in statekit/render_ops.py)


def _exit(code: int) -> None:
    """End the command with ``code``. typer.Exit would be returned, not raised, by the runner."""
    sys.stdout.flush()
    raise SystemExit(code)


def _errors_exit_2(run):
    """Run ``run()``; any error ends with exit code 2 (1 means "differ"/"problems found")."""
    try:
        return run()
    except StatekitError as exc:
        exc.exit_code = 2
        raise
    except OSError as exc:
        err = StatekitError(exc.strerror or str(exc), exc.filename)
        err.exit_code = 2
        raise err from None
    except (KeyboardInterrupt, click.ClickException):
        raise
    except Exception as exc:
        if os.environ.get("STATEKIT_DEBUG"):
            raise
        error_line(f"internal error: {type(exc).__name__}: {exc} (run with STATEKIT_DEBUG=1 for the traceback)")
        _exit(2)


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(metavar="A", help="First file (any supported format).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Second file (any supported format).")],
    atol: Annotated[float, typer.Option("--atol", help="Absolute tolerance per element (default 0: equal values).")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance, times max(|a|, |b|) per element.")] = 0.0,
    json_out: JsonOpt = False,
) -> None:
    """Compare two optimizer states (or two models) parameter by parameter.

    Parameters are matched by burn ParamId when both files have them, else by module path, else
    by torch parameter index. Reports parameters only in A or B, shape / dtype / step
    differences, and per field the max absolute and relative difference and the max distance
    in ULPs. NaN equals NaN at the same place. Exit status: 0 equal within tolerance, 1 they
    differ, 2 error (like GNU diff).
    """
    from statekit.ops.diff import diff_files
    from statekit.render_ops import diff_view

    out = Output(json_out)
    result = _errors_exit_2(lambda: diff_files(a, b, atol=atol, rtol=rtol,
                                               progress=lambda d, t: out.progress(d, t, unit_bytes=True)))
    if json_out:
        out.json(result)
    else:
        for item in diff_view(result):
            out.print(item)
    _exit(0 if result["equal"] else 1)


@app.command()
def merge(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="Optimizer state files, in order.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output file; its extension picks the format (.bpk).")],
    on_conflict: Annotated[str, typer.Option(
        "--on-conflict", metavar="error|first|last|mean",
        help="A parameter in several inputs: refuse (error), take the first or last, or average the moments "
             "elementwise and keep the largest step (mean).")] = "error",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be merged and write nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Merge optimizer states (parameter groups saved apart, or several runs) into one file.

    Parameters are matched by burn ParamId (else path, else torch index); all inputs must hold
    the same optimizer family. The output keeps the inputs' order and is written atomically;
    the inputs are only read.
    """
    from statekit.ops.merge import merge_files
    from statekit.render_ops import merge_view

    out = Output(json_out)
    result = merge_files(inputs, output, on_conflict=on_conflict, dry_run=dry_run, out=out)
    if json_out:
        out.json(result)
    else:
        for item in merge_view(result):
            out.print(item)


@app.command()
def doctor(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="Optimizer state file (any supported format).")],
    model: Annotated[Path | None, typer.Option("--model", help="The model it will be loaded into (burn .bpk with ParamIds, or a state_dict).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Find what bites when training resumes from STATE (and, with --model, into MODEL).

    NaN/Inf, all-zero moments after step 1, differing steps, ranks above 8, __rank vs shape,
    duplicate paths; with --model: orphaned state, parameters without state, shape mismatches
    (transposed ones named as such). Exit status: 0 clean, 1 problems found, 2 error.
    """
    from statekit.ops.doctor import doctor_files
    from statekit.render_ops import doctor_view

    out = Output(json_out)
    result = _errors_exit_2(lambda: doctor_files(state, model, progress=lambda d, t: out.progress(d, t)))
    if json_out:
        out.json(result)
    else:
        for item in doctor_view(result):
            out.print(item)
    _exit(0 if result["clean"] else 1)


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
