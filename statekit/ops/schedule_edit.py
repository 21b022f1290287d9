"""``statekit schedule STATE --max-steps N``: a saved schedule re-horizoned for a run that goes on longer.

The rules (``continue`` / ``fresh``) and their formulas are in :mod:`statekit.schedule.horizon`.
Per framework:

* torch (``scheduler.pt`` / ``scheduler.bin``, a file or the folder holding it): the scheduler's
  horizon (``T_max``, ``total_iters``, ``total_steps``, SequentialLR's last child) is set; for
  ``fresh`` the optimizer file's groups get the new lr too (``optimizer.pt``, tensors streamed).
* HF Trainer ``checkpoint-N/``: ``scheduler.pt`` holds no horizon; a resumed Trainer rebuilds λ from
  *its own* arguments (``max_steps``, or epochs × dataloader length) and overwrites
  ``trainer_state.json``'s ``max_steps`` (transformers 5.24 ``Trainer._inner_training_loop`` →
  ``create_scheduler(num_training_steps=max_steps)``, ``TrainerState.init_training_references``).
  statekit writes ``trainer_state.json`` ``max_steps = N``, the scheduler's base lrs (``continue``) or
  the groups' lr (``fresh``), and says that the run must be resumed with ``max_steps=N``.
* burn ``scheduler-N.bpk``: burn saves no config; the record holds counters only, whose meaning does
  not depend on the horizon for cosine / noam / step / exponential (the record is written unchanged and
  the config to build is said); a linear record's counter counts down from its ``num_iters`` and is
  refused (its position needs the old config).

The output is a folder (``-o OUT``) that does not exist yet, written whole or not at all: the
rewritten files, and for a folder input every other file copied. The input is never modified.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from statekit.errors import FormatError, MappingError, UsageError
from statekit.frameworks import hf_args, schedule_burn, schedule_hf, schedule_torch, schedule_write
from statekit.schedule import horizon, model, torch_lr

SHOWN = 5  # the next updates' lrs stated


def rehorizon(state: str, output: str | None, max_steps: int | None = None, extend: int | None = None,
              rule: str = "continue", dry_run: bool = False, horizon_was: int | None = None) -> dict:
    """Plan (and unless ``dry_run`` write) the re-horizoned schedule of ``state`` into folder ``output``.
    ``horizon_was``: the horizon the run was built with, for files that do not save it (burn)."""
    if rule not in horizon.RULES:
        raise UsageError(f"--rule {rule!r}: choose {' or '.join(horizon.RULES)}")
    if (max_steps is None) == (extend is None):
        raise UsageError("give one of --max-steps N and --extend K")
    if output is None and not dry_run:
        raise UsageError("-o OUT names the folder the rewritten schedule is written to (or --dry-run)")
    state = os.fspath(state)
    if not os.path.exists(state):
        raise UsageError(f"{state}: no such file or folder")
    if output is not None:
        _check_output(state, os.fspath(output))
    if horizon_was is not None and horizon_was <= 0:
        raise UsageError(f"--horizon-was {horizon_was}: must be positive")
    plan = _plan(state, max_steps, extend, rule, horizon_was)
    plan.update(input=state, output=None if output is None else os.fspath(output), rule=rule, dry_run=dry_run,
                written=False)
    if not dry_run:
        _write(plan, state, os.fspath(output))
        plan["written"] = True
    return to_json(plan)


def _check_output(state: str, output: str) -> None:
    folder = os.path.realpath(state if os.path.isdir(state) else os.path.dirname(os.path.abspath(state)))
    inside = os.path.realpath(os.path.dirname(os.path.abspath(output)))
    if os.path.isdir(state) and (inside == folder or inside.startswith(folder + os.sep)):
        raise UsageError(f"the output {output} is inside the input folder {state}; inputs are never modified")
    if os.path.exists(output):
        if os.path.samefile(output, state) or os.path.samefile(output, os.path.dirname(os.path.abspath(state))):
            raise UsageError(f"the output {output} is the input's folder; inputs are never overwritten (write to a new "
                             "folder and move it)")
        raise UsageError(f"the output {output} exists: name a new folder")


def _horizon_of(extend: int | None, max_steps: int | None, old: int | None, where: str) -> int:
    if max_steps is not None:
        if max_steps <= 0:
            raise UsageError(f"--max-steps {max_steps}: must be positive")
        return max_steps
    if extend <= 0:
        raise UsageError(f"--extend {extend}: must be positive")
    if old is None:
        raise UsageError(f"--extend needs the saved horizon, which {where} does not hold: give --max-steps")
    return old + extend


def _plan(state: str, max_steps, extend, rule, was=None) -> dict:
    plan = _plan_any(state, max_steps, extend, rule, was)
    if was is not None and plan["framework"] != "burn" and plan["old_horizon"] != was:
        raise UsageError(f"--horizon-was {was}: the saved schedule's horizon is {plan['old_horizon']}")
    return plan


def _plan_any(state: str, max_steps, extend, rule, was) -> dict:
    if os.path.isdir(state):
        names = set(os.listdir(state))
        if schedule_hf.SCHEDULER in names and hf_args.FILE in names:
            return _plan_hf(state, max_steps, extend, rule)
        for name in ("scheduler.pt", "scheduler.bin"):
            if name in names:
                return _plan_torch(os.path.join(state, name), max_steps, extend, rule, folder=state)
        packs = sorted(n for n in names if schedule_burn.EPOCH.search(n))
        if packs:
            if len(packs) > 1:
                raise UsageError(f"the folder holds {len(packs)} scheduler records ({', '.join(packs)}): name one")
            return _plan_burn(os.path.join(state, packs[-1]), max_steps, extend, rule, was, folder=state)
        raise FormatError("holds no scheduler file (scheduler.pt, scheduler.bin, scheduler-N.bpk)", state)
    if state.endswith(".bpk"):
        return _plan_burn(state, max_steps, extend, rule, was)
    return _plan_torch(state, max_steps, extend, rule)


def _stated(sched: model.Schedule, groups: list[dict] | None, steps: int) -> tuple[list, str | None]:
    try:
        return model.next_lrs(sched, groups, max(0, min(SHOWN, steps))), None
    except MappingError as exc:
        return [], exc.message


def _base(framework, kind, t, n, old, edit: horizon.Rehorizoned, rule) -> dict:
    jump = None
    if rule == "fresh":
        jump = [None if b == 0 else a / b for a, b in zip(edit.lr_now, edit.lr_before, strict=True)]
    return {"framework": framework, "kind": kind, "position": t, "old_horizon": old, "new_horizon": n,
            "steps_left": None if t is None else n - t, "formula": edit.formula, "lr_before": edit.lr_before, "lr_now": edit.lr_now,
            "jump": jump, "end_lr": edit.end_lr, "notes": list(edit.notes), "must": [], "files": {}, "copy": []}


def _plan_torch(path: str, max_steps, extend, rule, folder: str | None = None) -> dict:
    ss = schedule_torch.read_file(path)
    sched = ss.schedule
    cls = torch_lr.class_of(sched.state)
    groups = ss.groups
    if groups is None:
        groups = [{"lr": lr} for lr in sched.lr_now or []]
        if rule == "fresh":
            raise MappingError("--rule fresh sets the optimizer groups' lr, and no optimizer file is beside the "
                               "scheduler's (optimizer.pt / optimizer.bin)", path)
    raw = schedule_torch.load(path)
    if _has_tensor(raw):
        raise MappingError("the scheduler holds tensor lrs: statekit writes float lrs only", path)
    old = sched.horizon
    if cls == "SequentialLR":
        last = sched.state["_schedulers"][-1]
        key = {"CosineAnnealingLR": "T_max", "LinearLR": "total_iters", "PolynomialLR": "total_iters"}.get(
            torch_lr.class_of(last))
        old = sched.state["_milestones"][-1] + last[key] if key and sched.state["_milestones"] else None
    n = _horizon_of(extend, max_steps, old, os.path.basename(path))
    try:
        edit = horizon.torch_state(cls, sched.state, groups, n, rule)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise MappingError(f"a {cls} state_dict this rule cannot use ({type(exc).__name__}: {exc})", path) from None
    except MappingError as exc:
        raise MappingError(exc.message, path) from None
    plan = _base("torch", f"torch:{cls}", sched.position, n, edit.old_horizon, edit, rule)
    new_groups = [dict(g) for g in groups]
    keys = [{} for _ in groups]
    if edit.group_lrs is not None:
        for g, k, lr in zip(new_groups, keys, edit.group_lrs, strict=True):
            g["lr"], k["lr"] = lr, lr
    for k, extra in zip(keys, edit.group_keys or [{}] * len(groups), strict=True):
        k.update(extra)
    after = model.build_torch(cls, edit.state)
    plan["lr_next"], plan["lr_next_why"] = _stated(after, new_groups, n - sched.position)
    base = os.path.basename(path)
    plan["files"][base] = {"role": "scheduler", "state": edit.state}
    if any(keys) and ss.files.get("optimizer"):
        plan["files"][ss.files["optimizer"]] = {"role": "optimizer", "keys": keys,
                                                "source": os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                       ss.files["optimizer"])}
    if folder is not None:
        plan["copy"] = sorted(n for n in os.listdir(folder) if n not in plan["files"])
    plan["must"].append(f"build the optimizer and the scheduler as before (any {_horizon_word(cls)}: load_state_dict "
                        "sets it), then load the optimizer's state and this scheduler's (a scheduler built after the "
                        "optimizer's state is loaded overwrites the groups' lr)")
    return plan


def _horizon_word(cls: str) -> str:
    return {"CosineAnnealingLR": "T_max", "LinearLR": "total_iters", "PolynomialLR": "total_iters",
            "OneCycleLR": "total_steps"}.get(cls, "horizon")


def _has_tensor(value, depth: int = 0) -> bool:
    from statekit.tensor import TensorRef

    if isinstance(value, TensorRef):
        return True
    if isinstance(value, dict) and depth < 8:
        return any(_has_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple) and depth < 8:
        return any(_has_tensor(v, depth + 1) for v in value)
    return False


def _plan_hf(folder: str, max_steps, extend, rule) -> dict:
    ss = schedule_hf.read_folder(folder)
    sched = ss.schedule
    args = hf_args.read(os.path.join(folder, hf_args.FILE), hf_args.SCHEDULE_FIELDS)
    kind = args.get("lr_scheduler_type")
    state_path = os.path.join(folder, schedule_hf.STATE)
    trainer = schedule_hf.trainer_state(state_path) if os.path.isfile(state_path) else None
    if trainer is None:
        raise FormatError(f"a Trainer folder without {schedule_hf.STATE}: its max_steps is what a resume reads",
                          folder)
    old = trainer.get("max_steps") if isinstance(trainer.get("max_steps"), int) else None
    if sched is not None and sched.framework == "torch" and sched.name != "LambdaLR|MultiplicativeLR":
        return _plan_hf_torch(folder, max_steps, extend, rule, args, state_path)
    n = _horizon_of(extend, max_steps, old, schedule_hf.STATE)
    if sched is None or sched.position is None:
        raise FormatError("scheduler.pt holds no position", folder)
    t = sched.position
    if kind == "reduce_lr_on_plateau":
        raise MappingError("lr_scheduler_type 'reduce_lr_on_plateau' follows the evaluation metric: it has no horizon",
                           folder)
    if sched.unknown or sched.lam is None:
        raise MappingError(f"lr_scheduler_type {kind!r}: its λ is not rebuilt ({sched.unknown or 'no λ'})", folder)
    lr_init = args.get("learning_rate") if isinstance(args.get("learning_rate"), int | float) else None
    lrs = [float(g["lr"]) for g in ss.groups] if ss.groups else list(sched.lr_now)
    try:
        edit, warmup = horizon.hf_lambda(kind, schedule_hf._kwargs(args.get("lr_scheduler_kwargs"), folder), args,
                                         lr_init, sched.state, lrs, n, rule)
    except MappingError as exc:
        raise MappingError(exc.message, folder) from None
    edit.old_horizon = old
    plan = _base("hf", f"hf:{kind}", t, n, old, edit, rule)
    after = model.build_hf(kind, schedule_hf._kwargs(args.get("lr_scheduler_kwargs"), folder), warmup, n, lr_init,
                           edit.state)
    plan["lr_next"], plan["lr_next_why"] = _stated(after, None, n - t)
    plan["files"][schedule_hf.SCHEDULER] = {"role": "scheduler", "state": edit.state}
    plan["files"][schedule_hf.STATE] = {"role": "trainer_state", "max_steps": n, "source": state_path}
    if edit.group_lrs is not None:
        if schedule_hf.OPTIMIZER not in os.listdir(folder):
            raise MappingError("--rule fresh sets the optimizer groups' lr, and the folder holds no optimizer.pt",
                               folder)
        plan["files"][schedule_hf.OPTIMIZER] = {"role": "optimizer", "keys": [{"lr": lr} for lr in edit.group_lrs],
                                                "source": os.path.join(folder, schedule_hf.OPTIMIZER)}
    plan["copy"] = sorted(x for x in os.listdir(folder) if x not in plan["files"])
    if args.get("max_steps") != n:
        plan["must"].append(f"resume with TrainingArguments(max_steps={n}) (--max_steps {n}): transformers takes the "
                            f"horizon from the arguments, not from {schedule_hf.STATE}, and this run's "
                            f"training_args.bin says max_steps={args.get('max_steps')!r}")
    w = args.get("warmup_steps") or 0
    if 0 < w < 1 or (not w and args.get("warmup_ratio")):
        plan["notes"].append(f"the warm-up is a ratio of max_steps: {warmup} steps with max_steps={n}")
    if kind in ("constant", "constant_with_warmup", "inverse_sqrt"):
        plan["notes"].append(f"{kind} has no horizon: its λ does not depend on max_steps (only a warm-up ratio does); "
                             f"{schedule_hf.STATE}'s max_steps is what changes")
    plan["must"].append("keep the other arguments (lr_scheduler_type, warmup_steps, learning_rate, "
                        "lr_scheduler_kwargs): the λ above is rebuilt from them")
    return plan


def _plan_hf_torch(folder: str, max_steps, extend, rule, args: dict, state_path: str) -> dict:
    """A Trainer folder whose scheduler.pt is a torch scheduler's own (a scheduler passed to the Trainer):
    re-horizoned as torch's, and trainer_state.json's max_steps set to the same horizon."""
    plan = _plan_torch(os.path.join(folder, schedule_hf.SCHEDULER), max_steps, extend, rule, folder=folder)
    n = plan["new_horizon"]
    plan["files"][schedule_hf.STATE] = {"role": "trainer_state", "max_steps": n, "source": state_path}
    plan["copy"] = [x for x in plan["copy"] if x != schedule_hf.STATE]
    plan["notes"].append(f"scheduler.pt is a {plan['kind']}'s state (a scheduler passed to the Trainer), not the λ "
                         f"of lr_scheduler_type={args.get('lr_scheduler_type')!r}: re-horizoned as torch's")
    if args.get("max_steps") != n:
        plan["must"].append(f"resume with TrainingArguments(max_steps={n}) (--max_steps {n}): the Trainer's run length "
                            f"comes from its arguments; training_args.bin says max_steps={args.get('max_steps')!r}")
    return plan


def _plan_burn(path: str, max_steps, extend, rule, was, folder: str | None = None) -> dict:
    from statekit.formats.burnpack import BurnpackFile, Scalar

    pack = BurnpackFile(path)
    ss = schedule_burn.read_pack(pack)
    if rule == "continue":
        raise MappingError("--rule continue keeps the lr now, and burn saves no scheduler config (LrSchedulerConfig): "
                           "the lr now is not in the file; --rule fresh rewrites what the record holds", path)
    n = _horizon_of(extend, max_steps, was, f"{os.path.basename(path)} (burn saves no config: --horizon-was)")
    leaves = _burn_leaves(ss.schedule)
    scalars = dict(pack.scalars)
    t = ss.schedule.position
    linear = [leaf for leaf in leaves if leaf.name == "linear"]
    for leaf in leaves:
        if leaf.name not in ("cosine", "noam", "step", "exponential", "constant", "linear"):
            raise MappingError(f"no re-horizoning rule for burn's {leaf.name} scheduler", path)
    rewrote = ""
    if linear:
        if len(leaves) != 1:
            raise MappingError("a burn composite holding a linear scheduler: which child's num_iters is the horizon is "
                               "in the config, which burn does not save", path)
        if was is None:
            raise MappingError("a burn linear scheduler's record counts the iterations left (remaining_iters) from its "
                               "config's num_iters, which burn does not save: give it as --horizon-was", path)
        key = next(k for k in scalars if k.endswith("remaining_iters"))
        remaining = int(scalars[key].value)
        if remaining == 0:
            raise MappingError(f"{key} is 0: the linear decay has ended, and how many calls past its end were made "
                               "is not saved", path)
        if remaining > was + 1:
            raise MappingError(f"{key} is {remaining}, more than --horizon-was {was} + 1: not this run's horizon", path)
        t = was + 1 - remaining
        if n < t:
            raise MappingError(f"the new horizon {n} is not past the saved position {t}", path)
        scalars[key] = Scalar(scalars[key].kind, n + 1 - t)
        rewrote = f"; {key} {remaining} → {n + 1 - t} (= {n} + 1 − {t})"
    edit = horizon.Rehorizoned({}, None, [], [], None, was,
                               f"fresh: the record's counters stand at position {t}{rewrote}; burn computes the lr "
                               f"from the config the program is built with, so build it with num_iters = {n}")
    plan = _base("burn", ss.schedule.kind, t, n, was, edit, rule)
    plan.update(lr_before=None, lr_now=None, jump=None, lr_next=[], lr_next_why=burn_note())
    base = os.path.basename(path)
    plan["files"][base] = {"role": "burn_record", "scalars": scalars}
    if folder is not None:
        plan["copy"] = sorted(x for x in os.listdir(folder) if x not in plan["files"])
    kinds = sorted({leaf.name for leaf in leaves})
    if {"cosine", "linear"} & set(kinds):
        plan["must"].append(f"build the {' / '.join(kinds)} scheduler config with num_iters = {n} (e.g. "
                            f"CosineAnnealingLrSchedulerConfig::new(initial_lr, {n}), LinearLrSchedulerConfig::new("
                            f"initial_lr, final_lr, {n})); its other values as before")
    else:
        plan["notes"].append(f"burn's {', '.join(kinds)} schedulers have no horizon: the record is unchanged")
    return plan


def burn_note() -> str:
    return "burn saves no scheduler config: the lrs need the config the program is built with"


def _burn_leaves(sched: model.Schedule) -> list[model.Schedule]:
    if not sched.children:
        return [sched]
    return [leaf for c in sched.children for leaf in _burn_leaves(c)]


def _write(plan: dict, state: str, output: str) -> None:
    """Every file into a new folder beside ``output``, then the folder renamed: all or nothing."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".statekit-schedule-", dir=parent)
    try:
        for name, spec in plan["files"].items():
            dst = os.path.join(tmp, name)
            role = spec["role"]
            if role == "scheduler":
                schedule_write.write_torch_scheduler(dst, spec["state"])
            elif role == "optimizer":
                schedule_write.write_torch_optimizer_group_lrs(spec["source"], dst, spec["keys"])
            elif role == "trainer_state":
                schedule_write.write_trainer_state_max_steps(spec["source"], dst, spec["max_steps"])
            elif role == "burn_record":
                schedule_write.write_burn_scalars(dst, spec["scalars"])
        folder = state if os.path.isdir(state) else None
        for name in plan["copy"] if folder else ():
            src = os.path.join(folder, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(tmp, name), symlinks=True)
            else:
                shutil.copy2(src, os.path.join(tmp, name))
        _read_back(plan, tmp, state)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_back(plan: dict, tmp: str, state: str) -> None:
    """The written files, read back by statekit's own readers, give the lrs stated (else nothing is written)."""
    files = plan["files"]
    if plan["framework"] == "burn":
        from statekit.formats.burnpack import BurnpackFile

        for name, spec in files.items():
            if BurnpackFile(os.path.join(tmp, name)).scalars != spec["scalars"]:
                raise MappingError(f"{name} read back holds other counters than were written: nothing written")
        return
    if plan["framework"] == "hf":
        ss = schedule_hf.read_folder(tmp)
    else:
        sched = next(n for n, spec in files.items() if spec["role"] == "scheduler")
        opt = next((n for n, spec in files.items() if spec["role"] == "optimizer"), None)
        if opt is not None:
            optimizer = os.path.join(tmp, opt)
        else:
            beside = os.path.dirname(os.path.abspath(state)) if not os.path.isdir(state) else tmp
            candidate = os.path.join(beside, schedule_torch.OPTIMIZER_FILES.get(sched, "optimizer.pt"))
            optimizer = candidate if os.path.isfile(candidate) else None
        ss = schedule_torch.read_file(os.path.join(tmp, sched), optimizer)
    now = [float(g["lr"]) for g in ss.groups] if ss.groups else ss.schedule.lr_now
    try:
        after = model.next_lrs(ss.schedule, ss.groups, len(plan["lr_next"])) if plan["lr_next"] else []
    except MappingError as exc:
        raise MappingError(f"the written schedule read back does not step ({exc.message}): nothing written") from None
    if now != plan["lr_now"] or after != plan["lr_next"]:
        raise MappingError(f"the written schedule read back gives lr {now} then {after[:1]}, not the {plan['lr_now']} "
                           f"then {plan['lr_next'][:1]} stated: nothing written")


def to_json(plan: dict) -> dict:
    """The plan without the in-memory file contents (``files``: name → role)."""
    out = {k: v for k, v in plan.items() if k != "files"}
    out["files"] = {name: spec["role"] for name, spec in plan["files"].items()}
    return model._plain(out)
