"""The Python API conversion scripts use: one function per command, keyword options, results as data.

Every function takes paths (``str`` or ``os.PathLike``) and raises
:class:`statekit.errors.StatekitError` subclasses with one-line messages; outputs are written
atomically. torch is never imported unless a function needs it.

>>> import statekit
>>> with statekit.open("optim-10.bpk") as ckpt:
...     print(ckpt.optimizer.find("l1.weight").step)
>>> plan = statekit.convert("optim-10.bpk", "optim.pt", optimizer="adam", names=["l1.weight", ...],
...                         transpose=["*.weight"], lr=3e-4)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from statekit.ops.build import Options
from statekit.ops.plan import Plan
from statekit.state import Checkpoint

PathLike = str | os.PathLike


def open(path: PathLike, *, key: str | None = None) -> Checkpoint:  # noqa: A001 - mirrors io.open
    """Open any supported file as a :class:`~statekit.state.Checkpoint` (tensors stay lazy)."""
    from statekit import io

    return io.open_checkpoint(path, **({"key": key} if key else {}))


def inspect(path: PathLike, *, stats: bool = False, params: Sequence[str] | None = None) -> dict:
    """What ``statekit inspect --json`` prints, as a dict."""
    from statekit.ops.inspect import inspect as describe

    with open(path) as ckpt:
        return describe(ckpt, stats=stats, only=list(params) if params else None)


def _options(*, optimizer=None, names=None, model=None, old_model=None, transpose=(), no_transpose=(), rename=(),
             preset=True, dtype=None, resize=False, reset_step=(), step_policy=None, allow_nonfinite=False,
             **hyperparams) -> Options:
    from statekit.ops.convert import load_model, read_names

    def as_model(m):
        return load_model(os.fspath(m)) if isinstance(m, str | os.PathLike) else m

    if isinstance(names, str | os.PathLike):
        names = read_names(os.fspath(names))
    unknown = set(hyperparams) - {"lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov"}
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    return Options(optimizer=optimizer, hyperparams={k: v for k, v in hyperparams.items() if v is not None},
                   renames=list(rename), preset=preset, transpose=list(transpose), no_transpose=list(no_transpose),
                   names=list(names) if names is not None else None, model=as_model(model),
                   old_model=as_model(old_model), resize=resize, reset_step=list(reset_step),
                   dtype=dtype.upper() if dtype else None, step_policy=step_policy, allow_nonfinite=allow_nonfinite)


def convert(src: PathLike, dst: PathLike, *, to: str | None = None, key: str | None = None, dry_run: bool = False,
            plan: PathLike | None = None, plan_out: PathLike | None = None, **options) -> Plan | None:
    """``statekit convert``: returns the plan it carried out (None for an exact burnpack copy).

    Options: ``optimizer``, ``names`` (list or file), ``model`` (path or ModelInfo), ``transpose`` /
    ``no_transpose`` (globs), ``rename`` (``"REGEX=REPLACEMENT"`` rules), ``preset``, ``dtype``,
    ``step_policy``, and hyperparameters ``lr betas eps weight_decay amsgrad momentum dampening nesterov``.
    """
    from statekit.ops.convert import convert as run

    result = run(os.fspath(src), os.fspath(dst), _options(**options), to=to, key=key, dry_run=dry_run,
                 plan_in=os.fspath(plan) if plan else None, plan_out=os.fspath(plan_out) if plan_out else None)
    return result.plan


def remap(state: PathLike, dst: PathLike, *, model: PathLike, dry_run: bool = False, plan: PathLike | None = None,
          plan_out: PathLike | None = None, to: str | None = None, **options) -> Plan:
    """``statekit remap``: state onto a new model; returns the plan (options as for :func:`convert`,
    plus ``old_model``, ``resize`` and ``reset_step``)."""
    from statekit.ops.remap import remap as run

    return run(os.fspath(state), os.fspath(dst), _options(model=model, **options), to=to, dry_run=dry_run,
               plan_in=os.fspath(plan) if plan else None, plan_out=os.fspath(plan_out) if plan_out else None).plan


def diff(a: PathLike, b: PathLike, *, atol: float = 0.0, rtol: float = 0.0) -> dict:
    """``statekit diff --json`` as a dict (``result["equal"]`` says whether they match)."""
    from statekit.ops.diff import diff_files

    return diff_files(a, b, atol=atol, rtol=rtol)


def merge(inputs: Sequence[PathLike], output: PathLike, *, on_conflict: str = "error", dry_run: bool = False) -> dict:
    """``statekit merge``: one state from several; returns the account of what came from where."""
    from statekit.ops.merge import merge_files

    return merge_files(list(inputs), output, on_conflict=on_conflict, dry_run=dry_run)


def doctor(state: PathLike, model: PathLike | None = None) -> dict:
    """``statekit doctor --json`` as a dict."""
    from statekit.ops.doctor import doctor_files

    return doctor_files(state, model)


def verify_resume(original: PathLike, migrated: PathLike, *, steps: int = 10, seed: int = 0,
                  optimizer: str | None = None, lr: float | None = None, transpose: Sequence[str] = (),
                  kernel: str = "auto") -> dict:
    """``statekit verify-resume --json`` as a dict (``report["tracks"]``; ``report["kernels"]``:
    the code that ran each side, :mod:`statekit.optim.kernels`)."""
    from statekit.ops.replay import verify_resume as run

    with open(original) as a, open(migrated) as b:
        return run(a, b, steps=steps, seed=seed, optimizer=optimizer, given={"lr": lr} if lr else {},
                   transpose=list(transpose), kernel=kernel)
