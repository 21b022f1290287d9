"""``remap``: move optimizer state onto a refactored model (renamed, grown, with new parts).

Parameters are matched by module path (the state's own id → path map, or ``old_model`` joined on
ParamId), renamed by ordered rules, and given the new model's ParamIds (burn) or positions
(torch). Removed parameters are dropped and listed, new ones listed without state (both
frameworks initialise state lazily), shape changes refused unless ``resize`` pads or truncates.

When ``old_model`` and ``model`` both hold weights, the map from old tensors to new ones is learned
from their values and proved on them (:mod:`statekit.ops.structural`, :mod:`statekit.structure`):
fused, split, permuted, stacked, transposed and grown tensors keep their state, element by element;
``--fuse/--split/--stack/--unstack`` rules say the same without the weights.

A burn record that holds one path under several ParamIds (burn #5130: the states of earlier
launches, orphaned) keeps the state under the model's id and drops the others
(:mod:`statekit.ops.orphans` states the rule, and refuses candidates it cannot tell apart).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.formats import registry
from statekit.frameworks import torch_thirdparty
from statekit.ops import schedule_carry
from statekit.ops.build import Options, build_plan
from statekit.ops.convert import Result, carry_out, name_source_params, output_format
from statekit.ops.plan import Plan
from statekit.ops.progress import ProgressFactory


def remap(state_path: str, out_path: str, opts: Options, *, to: str | None = None, dry_run: bool = False,
          plan_in: str | None = None, plan_out: str | None = None, progress: ProgressFactory | None = None,
          on_plan: Callable[[Plan], None] | None = None, no_schedule: bool = False) -> Result:
    """``statekit remap``; the LR schedule beside the state is carried or refused as convert's
    (:mod:`statekit.ops.schedule_carry`): it does not depend on the model."""
    if opts.model is None and plan_in is None:
        raise UsageError("remap needs the new model: --model NEW_MODEL")
    if os.path.abspath(state_path) == os.path.abspath(out_path):
        raise UsageError("the output must be a new file: remap never overwrites its input")
    with io.open_checkpoint(state_path) as ckpt:
        if ckpt.optimizer is None:
            raise MappingError(f"holds {ckpt.kind} data, not optimizer state", state_path)
        if ckpt.optimizer.family == "lbfgs":
            raise MappingError("L-BFGS keeps one history of flat vectors over every parameter: remap does not re-cut "
                               "it onto another model (convert moves it between frameworks)", state_path)
        fmt = output_format(out_path, to) if (to or os.path.splitext(out_path)[1]) else ckpt.format
        opts.allow_drop = True
        name_source_params(ckpt.optimizer, opts, state_path, model_names_source=False)
        opts, carry = schedule_carry.carried(ckpt, state_path, out_path, fmt, opts, no_schedule=no_schedule)
        state, adapted = ckpt.optimizer, []
        pruned: list = []
        if plan_in is None and state.framework == "burn":
            from statekit.ops import orphans

            state, pruned, problems = orphans.resolve(state, opts.model)
            if problems:
                raise MappingError(f"{'; '.join(problems)}: {orphans.ADVICE}", state_path)
        if torch_thirdparty.is_foreign(state):  # transformers Adafactor, torchao, … as the optimizer continuing it
            state, adapted = torch_thirdparty.adapt(state, registry.framework_of(fmt), optimizer=opts.optimizer,
                                                     path=state_path)
        if plan_in:
            plan = Plan.load(plan_in)
            plan.source, plan.target = state_path, out_path
        else:
            from dataclasses import replace

            from statekit.ops import structural

            smap, why = structural.structure_for(opts, state, state_path, progress)
            opts = replace(opts, structure=smap)
            try:
                plan = build_plan(state, state_path, ckpt.format, out_path, fmt, opts, operation="remap")
            except MappingError as exc:  # (a refusal of the move by path says why the weights did not map it)
                if why:
                    raise MappingError(f"{exc.message}; {'; '.join(why)}", exc.path) from None
                raise
            plan.warnings.extend(adapted + why)
            if pruned:
                plan.warnings.append(orphans.summary(pruned))
        dropped = [a.src_path or a.src_key for a in plan.params if a.action == "drop"]
        new = [a.dst_path for a in plan.params if a.action == "new"]
        if dropped:
            plan.warnings.append(f"dropped (not in the new model): {', '.join(map(str, dropped))}")
        if new:
            plan.warnings.append(f"new without state (initialised at their first step): {', '.join(map(str, new))}")
        carry.refuse()
        plan.warnings.extend(carry.warnings)
        result = carry_out(plan, state, ckpt.nbytes, dry_run=dry_run, plan_out=plan_out, progress=progress,
                           on_plan=on_plan)
        return schedule_carry.write_files(carry, result, out_path, dry_run)
