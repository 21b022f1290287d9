"""``split``: one optimizer state per part (per optimizer), the inverse of ``merge``.

Each part is ``NAME=PATTERN[,PATTERN...]``; a pattern is what ``--param`` takes
(:func:`statekit.state.matches`: a path, a glob of paths, a ParamId, ``#index``). Each parameter
goes to the first part, in the order given, with a pattern that selects it; a parameter selected by
none is refused, naming it, unless ``rest`` names the part that takes them. A part that selects
nothing is refused (a mistyped pattern would otherwise write an empty state). Each part keeps the
input's parameter groups that have members in it, with their hyperparameters, in order; a group left
empty is dropped. Parameters keep the input's order, so ``merge`` of the parts in the order given
gives back the input (byte for byte for burnpack when the parts are contiguous runs). Written in the
input's format (or ``fmt``, of the same framework), all parts or none: every part is written into a
temporary folder beside the outputs and moved into place only when all are written.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.formats import registry
from statekit.frameworks import bnb, torch_thirdparty
from statekit.ops.merge import MAX_NAMED, save_state
from statekit.ops.progress import ProgressFactory, silent
from statekit.state import OptimizerState, ParamGroup, ParamState, matches, refuse_unusable

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_parts(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["muon=*.weight", "adamw=*.bias,#3"]`` → ``[("muon", ["*.weight"]), ("adamw", [...])]``."""
    parts: list[tuple[str, list[str]]] = []
    for spec in specs:
        name, sep, patterns = spec.partition("=")
        name = name.strip()
        pats = [p.strip() for p in patterns.split(",") if p.strip()]
        if not sep or not pats:
            raise UsageError(f"--into {spec!r}: expected NAME=PATTERN[,PATTERN...] (a path, glob, ParamId or #index)")
        if not NAME_RE.match(name):
            raise UsageError(f"--into {spec!r}: the part name {name!r} becomes a file name: use letters, digits, '.', '_', '-'")
        if any(name == n for n, _ in parts):
            raise UsageError(f"--into: the part name {name!r} is given twice")
        parts.append((name, pats))
    if not parts:
        raise UsageError("split needs at least one --into NAME=PATTERN")
    return parts


def _selects(pattern: str, p: ParamState) -> bool:
    return matches(pattern, path=p.path, key=p.key, id=p.id, index=p.index)


def _check_splittable(state: OptimizerState | None, kind: str, path: str) -> OptimizerState:
    if kind != "optimizer" or state is None:
        raise MappingError(f"holds {kind} data, not optimizer state; split divides an optimizer state", path)
    refuse_unusable(state, path, "split")
    if state.global_slots:
        raise MappingError(f"{state.family_label} keeps one global state over all parameters; "
                           "it cannot be split per parameter", path)
    if torch_thirdparty.is_foreign(state):
        raise MappingError(f"{state.family_label} state: split divides torch's, burn's and candle's own states; "
                           "convert it first where an optimizer continues it (statekit convert)", path)
    if state.library == bnb.LIBRARY and state.params:
        raise MappingError("bitsandbytes state: split writes torch's own layout, not bitsandbytes'; convert it to "
                           "torch first (statekit convert … --names), split that, and convert each part back with --to bnb",
                           path)
    if not state.params:
        raise MappingError("the state holds no parameters; there is nothing to split", path)
    return state


def split_state(state: OptimizerState, parts: list[tuple[str, list[str]]], rest: str | None = None,
                path: str = "") -> tuple[list[tuple[str, OptimizerState]], list[dict]]:
    """The parts' states, in the order given (``rest`` last when new), and each part's plan."""
    names = [n for n, _ in parts]
    if rest is not None and not NAME_RE.match(rest):
        raise UsageError(f"--rest {rest!r}: the part name becomes a file name: use letters, digits, '.', '_', '-'")
    order = names + ([rest] if rest is not None and rest not in names else [])
    chosen: dict[str, list[ParamState]] = {n: [] for n in order}
    by: dict[str, list[str]] = {n: [] for n in order}  # the pattern that chose each parameter
    unmatched: list[ParamState] = []
    for p in state.params:
        hit = next(((n, pat) for n, pats in parts for pat in pats if _selects(pat, p)), None)
        if hit is None:
            if rest is None:
                unmatched.append(p)
                continue
            hit = (rest, "--rest")
        chosen[hit[0]].append(p)
        by[hit[0]].append(hit[1])
    if unmatched:
        named = [p.label() for p in unmatched]
        more = f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
        unnamed = "" if all(p.path for p in state.params) else (
            "; its parameters have no paths, so globs select nothing: name them (--names or --model) or use #index")
        raise MappingError(f"{len(unmatched)} parameter{'s are' if len(unmatched) != 1 else ' is'} selected by no "
                           f"--into part: {', '.join(named[:MAX_NAMED])}{more}; add a pattern or --rest NAME{unnamed}",
                           path)
    empty = [n for n in order if not chosen[n]]
    if empty:
        pats = {n: ",".join(p) for n, p in parts}
        raise MappingError("; ".join(f"--into {n}={pats[n]} selects no parameter" if n in pats else
                                     f"--rest {n} receives no parameter" for n in empty)
                           + " (each parameter goes to the first part that selects it)", path)
    out: list[tuple[str, OptimizerState]] = []
    plan: list[dict] = []
    for name in order:
        params, groups = _regrouped(state, chosen[name])
        out.append((name, dataclasses.replace(state, params=params, groups=groups, notes=list(state.notes))))
        plan.append({
            "name": name,
            "patterns": dict(parts).get(name) or ["--rest"],
            "params": len(params),
            "tensor_bytes": sum(p.nbytes for p in params),
            "bytes": None,  # the file's size, once written
            "groups": len(groups),
            "members": [{"name": p.label(), "by": b} for p, b in zip(chosen[name], by[name], strict=True)],
        })
    return out, plan


def _regrouped(state: OptimizerState, chosen: list[ParamState]) -> tuple[list[ParamState], list[ParamGroup]]:
    """``chosen`` in the input's groups that keep members (hyperparameters kept, order kept)."""
    keys = {p.key for p in chosen}
    groups: list[ParamGroup] = []
    new_index: dict[int, int] = {}
    for i, g in enumerate(state.groups or [ParamGroup(keys=[p.key for p in state.params])]):
        members = [k for k in g.keys if k in keys]
        if members:
            new_index[i] = len(groups)
            groups.append(ParamGroup(hyperparams=dict(g.hyperparams), keys=members))
    if not state.groups:
        new_index = {p.group: 0 for p in chosen}
    params = [p if new_index[p.group] == p.group else dataclasses.replace(p, group=new_index[p.group]) for p in chosen]
    return params, groups


def _output_format(input_format: str, framework: str, to: str | None, input_path: str) -> tuple[str, str]:
    """The parts' format and file extension."""
    if to is not None:
        fmt = registry.from_extension("", to)
    else:
        fmt = input_format
        try:
            writable = registry.get(fmt).write
        except KeyError:
            writable = False
        if not writable:
            raise UsageError(f"{input_format} cannot be written; choose the parts' format with --to", input_path)
    if registry.framework_of(fmt) != framework:
        raise MappingError(
            f"the input holds {framework} state and --to {fmt} is {registry.framework_of(fmt)}'s: split writes the "
            "input's own framework; split first, then run statekit convert on each part", input_path)
    exts = registry.get(fmt).extensions
    if not exts:
        raise UsageError(f"{fmt} has no file extension to name the parts by; choose another --to", input_path)
    return fmt, exts[0]


def split_files(input_path, parts: list[str] | list[tuple[str, list[str]]], out_dir, *, rest: str | None = None,
                to: str | None = None, dry_run: bool = False, progress: ProgressFactory | None = None,
                name_with=None, on_plan=None, key: str | None = None) -> dict:
    """Split ``input_path`` into ``out_dir/NAME.<ext>``, one file per part.

    ``name_with(ckpt)`` names a torch state's positions first (``--names`` / ``--model``);
    ``on_plan(account)`` is called with the plan before anything is written."""
    input_path = os.fspath(input_path)
    out_dir = os.fspath(out_dir)
    parts = parse_parts(parts) if parts and isinstance(parts[0], str) else list(parts or [])
    if not parts:
        raise UsageError("split needs at least one --into NAME=PATTERN")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"-o {out_dir} is a file; split writes one file per part into a folder")
    opts = {"key": key} if key else {}
    with io.open_checkpoint(input_path, **opts) as ckpt:
        if name_with is not None and ckpt.optimizer is not None:
            name_with(ckpt)
        state = _check_splittable(ckpt.optimizer, ckpt.kind, input_path)
        fmt, ext = _output_format(ckpt.format, state.framework, to, input_path)
        states, plan = split_state(state, parts, rest, input_path)
        outputs = [os.path.join(out_dir, name + ext) for name, _ in states]
        for item, out in zip(plan, outputs, strict=True):
            item["output"] = out
            if os.path.exists(input_path) and os.path.exists(out) and os.path.samefile(input_path, out):
                raise UsageError(f"the output {out} is the input; inputs are never overwritten")
        metadata = {k: v for k, v in ckpt.metadata.items() if isinstance(v, str)}
        account = {"input": input_path, "format": fmt, "family": state.family_label, "params": len(state.params),
                   "output_dir": out_dir, "rest": rest, "parts": plan, "dry_run": dry_run, "written": False, "bytes": None,
                   "warnings": list(ckpt.warnings)}
        if on_plan is not None:
            on_plan(account)
        if dry_run:
            return account
        os.makedirs(out_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".statekit-split-", dir=out_dir)
        try:
            written = []
            total = sum(p.nbytes for p in state.params)
            with (progress or silent)("writing", total, unit_bytes=True) as advance:
                for (name, part), item in zip(states, plan, strict=True):
                    item["bytes"] = save_state(part, os.path.join(tmp, name + ext), metadata, fmt, progress=advance)
                    written.append(name + ext)
            for name in written:
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        account["written"] = True
        account["bytes"] = sum(item["bytes"] for item in plan)
    return account
