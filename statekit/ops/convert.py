"""``convert``: rewrite optimizer state into another format or file.

For now: burnpack → burnpack (byte-identical for burn-written files).
"""

from __future__ import annotations

import os

from statekit import io
from statekit.errors import UsageError
from statekit.output import Output

FORMATS_BY_EXTENSION = {".bpk": "burnpack"}


def output_format(path: str | os.PathLike) -> str:
    ext = os.path.splitext(os.fspath(path))[1].lower()
    try:
        return FORMATS_BY_EXTENSION[ext]
    except KeyError:
        known = ", ".join(sorted(FORMATS_BY_EXTENSION))
        raise UsageError(f"cannot tell the output format from {os.fspath(path)!r} (known: {known})") from None


def convert_file(src, dst, out: Output | None = None, dry_run: bool = False) -> None:
    out = out or Output(quiet=True)
    fmt = output_format(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("source and destination are the same file")
    with io.open_checkpoint(src) as ckpt:
        if dry_run:
            out.info(f"would write {ckpt.format} {ckpt.kind} {src} → {fmt} {dst}")
            return
        from statekit.frameworks import burn_io

        with out.progress("writing", ckpt.nbytes, unit_bytes=True) as advance:
            size = burn_io.save_checkpoint(ckpt, os.fspath(dst), progress=advance)
        out.info(f"wrote {dst} ({size} bytes)")
