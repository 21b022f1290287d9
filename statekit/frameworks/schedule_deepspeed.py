"""A DeepSpeed checkpoint's schedule position and counters, from ``mp_rank_00_model_states.pt``.

The model states keep ``lr_scheduler`` (a DeepSpeed scheduler's ``{'last_batch_iteration': i}``, a
client torch scheduler's state_dict, or None), ``global_steps`` (every update, also those the fp16
loss scaler skipped), ``skipped_steps``, ``global_samples`` (samples consumed) and ``ds_config``,
whose ``scheduler`` block names a DeepSpeed scheduler's type and parameters. DeepSpeed's schedulers
are not stepped at construction: after U stepped updates ``last_batch_iteration`` is U − 1, and the
group lr (the one the next update uses) is its lr at that index.

The lr of DeepSpeed's own schedulers is not computed: their formulas changed between releases
(WarmupCosineLR clamps its cosine progress at 1 in current DeepSpeed, not in 0.16.5), and no
DeepSpeed-written fixture with a scheduler is at hand to test them against.
"""

from __future__ import annotations

from statekit.frameworks import schedule_torch
from statekit.schedule import model, torch_lr

NOT_COMPUTED = ("DeepSpeed's own scheduler formulas are not implemented (they differ between DeepSpeed releases); "
                "the position and the group lr are read")


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(model_states: dict, groups: list[dict] | None, path: str) -> model.ScheduleState | None:
    """The schedule and counters of a model-states dict (None when it keeps neither)."""
    sd = model_states.get("lr_scheduler")
    steps = _int(model_states.get("global_steps"))
    if sd is None and steps is None:
        return None
    ss = model.ScheduleState(None, files={"deepspeed": "mp_rank_00_model_states.pt"})
    ss.groups = [{k: g[k] for k in schedule_torch.GROUP_KEYS if k in g} for g in groups or [] if isinstance(g, dict)]
    c = ss.counters
    c.global_step, c.consumed_samples, c.source = steps, _int(model_states.get("global_samples")), "model states"
    skipped = _int(model_states.get("skipped_steps")) or 0
    ss.fp16 = skipped > 0
    ss.deepspeed_skipped = skipped
    if skipped:
        ss.notes.append(f"{skipped} of global_steps {steps} were skipped by the fp16 loss scaler")
    config = model_states.get("ds_config")
    block = config.get("scheduler") if isinstance(config, dict) else None
    if isinstance(sd, dict) and torch_lr.class_of(sd) is not None:
        ss.schedule = schedule_torch.schedule_of(sd, path)
        ss.schedule.notes.append("a client torch scheduler, saved in the DeepSpeed model states")
    elif isinstance(sd, dict) and _int(sd.get("last_batch_iteration")) is not None:
        kind = block.get("type") if isinstance(block, dict) and isinstance(block.get("type"), str) else "unknown"
        params = block.get("params") if isinstance(block, dict) and isinstance(block.get("params"), dict) else {}
        lrs = [g["lr"] for g in ss.groups if isinstance(g.get("lr"), int | float)] or None
        ss.schedule = model.Schedule(f"deepspeed:{kind}", params=dict(params), state=dict(sd),
                                     position=sd["last_batch_iteration"], lr_now=lrs, unknown=NOT_COMPUTED)
        ss.schedule.notes.append("DeepSpeed's index: last_batch_iteration = updates stepped - 1 (no step at "
                                 "construction), one behind torch's last_epoch")
        if _int(params.get("warmup_num_steps")):
            ss.schedule.warmup = max(2, params["warmup_num_steps"])
        if _int(params.get("total_num_steps")):
            ss.schedule.horizon = params["total_num_steps"]
    elif sd is not None:
        ss.notes.append(f"lr_scheduler is a {type(sd).__name__} statekit does not read")
    else:
        ss.notes.append("no lr_scheduler in the model states (none configured through DeepSpeed)")
    return ss
