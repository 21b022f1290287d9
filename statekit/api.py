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

from statekit.ops.options import given_hyperparams, make_options
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


def convert(src: PathLike, dst: PathLike, *, to: str | None = None, key: str | None = None, dry_run: bool = False,
            plan: PathLike | None = None, plan_out: PathLike | None = None, **options) -> Plan | None:
    """``statekit convert``: returns the plan it carried out (None for an exact burnpack copy).

    Options: ``optimizer``, ``names`` (list or file), ``model`` (path or ModelInfo), ``transpose`` /
    ``no_transpose`` (globs), ``rename`` (``"REGEX=REPLACEMENT"`` rules), ``preset``, ``dtype``,
    ``step_policy``, structural rules ``fuse``, ``split``, ``stack``, ``unstack`` (lists of the CLI's
    rule strings, :mod:`statekit.structure.rules`), and hyperparameters ``lr betas eps weight_decay
    amsgrad momentum dampening nesterov``. ``no_schedule=True`` drops an LR schedule the target cannot
    carry (else refused).
    """
    from statekit.ops.convert import convert as run

    no_schedule = bool(options.pop("no_schedule", False))
    result = run(os.fspath(src), os.fspath(dst), make_options(**options), to=to, key=key, dry_run=dry_run,
                 plan_in=os.fspath(plan) if plan else None, plan_out=os.fspath(plan_out) if plan_out else None,
                 no_schedule=no_schedule)
    return _warned(result).plan


def remap(state: PathLike, dst: PathLike, *, model: PathLike, dry_run: bool = False, plan: PathLike | None = None,
          plan_out: PathLike | None = None, to: str | None = None, **options) -> Plan:
    """``statekit remap``: state onto a new model; returns the plan (options as for :func:`convert`,
    plus ``old_model``, ``resize``, ``reset_step``, ``new`` (globs of tensors that start fresh) and
    ``match`` (``"auto"``, ``"values"``, ``"paths"``)). With ``old_model`` and ``model`` holding weights,
    the structural map is learned from them and proved (:mod:`statekit.structure`); each assembled
    target's pieces are in ``plan.params[i].pieces``."""
    from statekit.ops.remap import remap as run

    no_schedule = bool(options.pop("no_schedule", False))
    result = run(os.fspath(state), os.fspath(dst), make_options(model=model, **options), to=to, dry_run=dry_run,
                 plan_in=os.fspath(plan) if plan else None, plan_out=os.fspath(plan_out) if plan_out else None,
                 no_schedule=no_schedule)
    return _warned(result).plan


def _warned(result):
    """The writer's warnings (candle's assumed values, a step policy at work) as Python warnings."""
    import warnings

    for message in result.warnings:
        warnings.warn(message, UserWarning, stacklevel=3)
    return result


def diff(a: PathLike, b: PathLike, *, atol: float = 0.0, rtol: float = 0.0,
         params: Sequence[str] | None = None) -> dict:
    """``statekit diff --json`` as a dict (``result["equal"]`` says whether they match);
    ``params``: names or path globs to compare (as ``--param``)."""
    from statekit.ops.diff import diff_files

    return diff_files(a, b, atol=atol, rtol=rtol, only=list(params) if params else None)


def merge(inputs: Sequence[PathLike], output: PathLike, *, on_conflict: str = "error", dry_run: bool = False) -> dict:
    """``statekit merge``: one state from several; returns the account of what came from where."""
    from statekit.ops.merge import merge_files

    return merge_files(list(inputs), output, on_conflict=on_conflict, dry_run=dry_run)


def split(state: PathLike, into: Sequence[str], output_dir: PathLike, *, rest: str | None = None, to: str | None = None,
          dry_run: bool = False) -> dict:
    """``statekit split``: one state per part (``"NAME=GLOB,..."``) in ``output_dir``; returns the plan."""
    from statekit.ops.split import split_files

    return split_files(state, list(into), output_dir, rest=rest, to=to, dry_run=dry_run)


def fit(state: PathLike, model: PathLike, output: PathLike, *, groups: Sequence[str] | None = None,
        trainable: Sequence[str] = (), frozen: Sequence[str] = (), training_args: PathLike | None = None,
        optimizer: str | None = None, momentum_from: str | None = None, reset_step: bool = False,
        resize: bool = False, names: PathLike | None = None, dry_run: bool = False) -> dict:
    """``statekit fit``: the state fitted to ``model``'s trainable set and the new groups
    (``groups``: ``["NAME=GLOB[,GLOB][:KEY=VALUE,...]", ...]``); returns the plan (kept, new, dropped)."""
    from statekit.ops.fit import fit_file

    return fit_file(state, model, output, groups=list(groups or ()), trainable=list(trainable), frozen=list(frozen),
                    training_args=os.fspath(training_args) if training_args is not None else None,
                    optimizer=optimizer, momentum_from=momentum_from, reset_step=reset_step, resize=resize,
                    names=os.fspath(names) if names is not None else None, dry_run=dry_run)


def doctor(state: PathLike, model: PathLike | None = None, *, params: Sequence[str] | None = None) -> dict:
    """``statekit doctor --json`` as a dict (``params``: names or path globs to check, as ``--param``)."""
    from statekit.ops.doctor import doctor_files

    return doctor_files(state, model, only=list(params) if params else None)


def report(state: PathLike, *, weights: PathLike | None = None, against: PathLike | None = None,
           params: Sequence[str] | None = None, optimizer: str | None = None, html: PathLike | None = None,
           **hyperparameters) -> dict:
    """``statekit report --json`` as a dict (``html``: also write the page, as ``-o``; needs plotly);
    hyperparameters by the names of ``statekit.hyper.FLAGS``, over those the file stores."""
    from statekit.ops.report import report_files

    result = report_files(state, weights=weights, against=against, given=given_hyperparams(**hyperparameters),
                          optimizer=optimizer, only=list(params) if params else None)
    if html is not None:
        from statekit.render.report_html import check_available, write_page

        check_available()
        write_page(result, os.fspath(html))
    return result.to_json()


def verify_resume(original: PathLike, migrated: PathLike, *, steps: int = 10, seed: int = 0,
                  optimizer: str | None = None, transpose: Sequence[str] = (), kernel: str = "auto",
                  names: Sequence[str] | PathLike | None = None, model=None, plan: PathLike | None = None,
                  key: str | None = None, **hyperparams) -> dict:
    """``statekit verify-resume --json`` as a dict (``report["tracks"]``; ``report["kernels"]``:
    the code that ran each side, :mod:`statekit.optim.kernels`). ``names`` / ``model`` name torch
    positions; ``plan``: the remap plan that made ``migrated``; hyperparameters ``lr betas eps
    weight_decay amsgrad momentum dampening nesterov`` override the stored ones."""
    from statekit.ops.options import load_model, read_names
    from statekit.ops.replay import verify_resume_files

    if isinstance(names, str | os.PathLike):
        names = read_names(os.fspath(names))
    if isinstance(model, str | os.PathLike):
        model = load_model(os.fspath(model))
    return verify_resume_files(os.fspath(original), os.fspath(migrated), names=list(names) if names else None,
                               model=model, plan=os.fspath(plan) if plan else None, key=key, steps=steps, seed=seed,
                               optimizer=optimizer, given=given_hyperparams(**hyperparams),
                               transpose=list(transpose), kernel=kernel)


def replay(params: PathLike, grads: Sequence[PathLike], out_params: PathLike, *, state: PathLike | None = None,
           out_state: PathLike | None = None, optimizer: str | None = None, flavor: str | None = None,
           device: str = "cpu", backend: str | None = None, kernel: str = "auto", **hyperparams) -> dict:
    """``statekit replay --json`` as a dict: apply one gradient file per step to ``params`` (and
    ``state``, reconstructed from the gradients when omitted), write ``out_params`` (and
    ``out_state``). Hyperparameters ``lr betas eps weight_decay amsgrad momentum dampening nesterov``;
    ``kernel``: ``auto``, ``torch``, ``numba`` or ``reference`` (``result["kernel"]`` says which ran)."""
    from statekit.ops.replay import replay_files

    return replay_files(os.fspath(params), [os.fspath(g) for g in grads], os.fspath(out_params),
                        state=os.fspath(state) if state else None, out_state=os.fspath(out_state) if out_state else None,
                        optimizer=optimizer, flavor=flavor, hyperparams=given_hyperparams(**hyperparams),
                        device=device, backend=backend, kernel=kernel)
