"""The learning-rate curve ``report`` draws (issue 36 item 2): the lr per group along the schedule, with
the saved position marked, lr now / next and the steps left. Numbers only; the surfaces draw them.

The curve is the schedule's closed form (:func:`statekit.schedule.model.lr_at`) at up to
:data:`POINTS` positions from 0 to the horizon (or past the position when the schedule has none).
A schedule counted in samples (Megatron) is drawn along updates (iterations): its position in
samples is the iteration times the samples per update. Where the kind has no closed form or its
lr cannot be computed from the files, the curve is left out and the reason kept (the position and
lr now are still shown).
"""

from __future__ import annotations

from statekit.errors import MappingError
from statekit.schedule import model

POINTS = 400


def _positions(end: int) -> list[int]:
    if end + 1 <= POINTS:
        return list(range(end + 1))
    step = end / (POINTS - 1)
    return sorted({round(i * step) for i in range(POINTS)} | {end})


def curve(ss: model.ScheduleState | None) -> dict | None:
    """``{"kind", "unit" (updates; for Lightning: epochs for interval='epoch', scheduler steps when the interval is not known), "position", "lr_now", "lr_next", "steps_left", "x", "lrs", "why"}`` (x in
    the unit; ``lrs``: one list per group, None where not computable) — None without a schedule."""
    if ss is None or ss.schedule is None:
        return None
    view = model.describe(ss)
    sched = ss.schedule
    per = sched.per_update if sched.unit != "updates" else 1
    unit = {"epoch": "epochs", "unknown": "scheduler steps"}.get(sched.interval or "", "updates" if per else sched.unit)
    out = {"kind": sched.kind, "unit": unit, "position": None,
           "lr_now": view.get("lr_now"), "lr_next": view.get("lr_next"), "steps_left": None, "warmup": None,
           "horizon": None, "x": [], "lrs": [], "why": view.get("lr_next_why") or view.get("unknown"),
           "samples_per_update": sched.per_update if sched.unit == "samples" else None}

    def in_updates(v):
        return None if v is None or not per else v / per

    out["position"] = in_updates(sched.position)
    out["steps_left"] = in_updates(sched.steps_left)
    out["warmup"], out["horizon"] = in_updates(sched.warmup), in_updates(sched.horizon)
    if sched.position is None or sched.unknown or not per:
        out["why"] = out["why"] or ("the position is not known" if sched.position is None else
                                    "the samples per update are not known")
        return out
    horizon = out["horizon"]
    end = int(max(horizon if horizon is not None else 0, out["position"] * 2, out["position"] + 10))
    if horizon is not None:
        end = int(max(horizon + max(1, horizon // 20), out["position"] + 1))
    xs, rows = [], []
    try:
        for x in _positions(end):
            lrs = model.lr_at(sched, x * per, ss.groups)
            if lrs is None:
                raise MappingError(f"{sched.kind} has no closed form statekit computes")
            xs.append(x)
            rows.append(lrs)
    except MappingError as exc:
        out["why"] = exc.message
        return out
    out["x"] = xs
    out["lrs"] = [list(col) for col in zip(*rows, strict=True)] if rows else []
    return out


def of_checkpoint(ckpt) -> tuple[dict | None, str | None]:
    """The curve of the schedule read with (or beside) an optimizer checkpoint, and a note when the
    schedule beside it could not be read."""
    from statekit.ops.doctor_schedule import schedule_of

    ss, why = schedule_of(ckpt)
    return curve(ss), why
