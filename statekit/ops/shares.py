"""Which share of a conversion this process runs: ``--shard I/N``, torchrun or SLURM.

No collectives and no cluster of statekit's own: clusters start ``statekit convert`` the way they
start training, and each process learns its share from what the launcher sets:

- ``--shard I/N`` (explicit; wins over everything);
- torchrun: ``RANK`` / ``WORLD_SIZE``;
- SLURM array tasks: ``SLURM_ARRAY_TASK_ID`` − ``SLURM_ARRAY_TASK_MIN`` of ``SLURM_ARRAY_TASK_COUNT``;
- SLURM tasks (``srun -n N``): ``SLURM_PROCID`` / ``SLURM_NTASKS``.

Shares split the output's data files (DCP directories); the work is planned identically in every
process, so a process needs nothing from the others but the files they leave behind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from statekit.errors import UsageError
from statekit.formats.dcp import Share


def parse(text: str) -> tuple[int, int]:
    """``"I/N"`` → (I, N) with 0 ≤ I < N."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


def from_environment(env: Mapping[str, str] | None = None) -> Share | None:
    """The share a launcher's variables give, or None when no launcher set any."""
    env = os.environ if env is None else env
    candidates = (
        ("torchrun (RANK/WORLD_SIZE)", _int(env, "RANK"), _int(env, "WORLD_SIZE")),
        ("SLURM array (SLURM_ARRAY_TASK_ID)",
         None if _int(env, "SLURM_ARRAY_TASK_ID") is None else
         _int(env, "SLURM_ARRAY_TASK_ID") - (_int(env, "SLURM_ARRAY_TASK_MIN") or 0),
         _int(env, "SLURM_ARRAY_TASK_COUNT")),
        ("SLURM (SLURM_PROCID/SLURM_NTASKS)", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")),
    )
    for source, index, count in candidates:
        if index is None or count is None:
            continue
        if count < 1 or not 0 <= index < count:
            raise UsageError(f"{source}: share {index} of {count} is not a valid share")
        return Share(index, count, source)
    return None


def resolve(flag: str | None, env: Mapping[str, str] | None = None) -> Share | None:
    """``--shard`` if given, else the launcher's share, else None (one process does everything)."""
    if flag is not None:
        i, n = parse(flag)
        return Share(i, n, "--shard")
    return from_environment(env)
