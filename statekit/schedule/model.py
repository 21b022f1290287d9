"""The schedule model: a learning-rate schedule as a function of the step, where it stands, and the
trainer's counters around it.

* :class:`Schedule` — one framework's schedule: ``kind`` (``torch:StepLR``, ``hf:cosine``,
  ``burn:cosine``), ``params`` (its arguments: warm-up, horizon, gamma …), ``base_lrs`` per param
  group, ``position`` (the index the next update's lr has: torch's ``last_epoch``, burn's counters
  read back), ``lr_now`` (the lr per group the next update uses, as saved) and ``state`` (the
  framework's own counters, e.g. torch's state_dict, needed to step it exactly). A schedule whose
  lr cannot be computed (a LambdaLR's function, burn's config: not saved) keeps ``unknown``, the
  reason, and still says where it stands.
* :class:`Counters` — the trainer's position: global step (updates taken), epoch, micro-batches to
  skip on resume, consumed samples, each None where the files do not say.
* :class:`ScheduleState` — what one checkpoint holds: its schedule, counters, the optimizer
  groups' ``lr`` / ``initial_lr`` and step as saved beside it.

:func:`next_lrs` is the lr the update after the next one uses, exactly as the framework computes
it (for torch, one more ``scheduler.step()``: ``get_last_lr()``); :func:`lr_at` the closed form
at any position. Readers live on the frameworks floor (``frameworks/schedule_*.py``); this floor
imports nothing of theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from statekit.errors import MappingError
from statekit.schedule import burn_lr, hf_lr, megatron_lr, torch_lr, torchtitan_lr


@dataclass
class Schedule:
    kind: str  # "<framework>:<name>"
    params: dict = field(default_factory=dict)
    base_lrs: list[float] = field(default_factory=list)
    position: int | None = None  # the index into the schedule of the lr the next update uses
    lr_now: list[float] | None = None  # per group: the lr the next update uses, as saved
    state: dict = field(default_factory=dict)  # the framework's own counters (torch: the state_dict)
    unknown: str | None = None  # why the lr cannot be computed from the files
    warmup: int | None = None  # updates of warm-up (the lr rises until this position)
    horizon: int | None = None  # the position where the schedule ends (its decay reaches its end)
    lam: object = None  # HF: the rebuilt λ (torch LambdaLR's function)
    children: list[Schedule] = field(default_factory=list)  # burn: per param group / composite children
    disagrees: str | None = None  # a rebuilt schedule (HF) that does not give the saved lr: how
    notes: list[str] = field(default_factory=list)
    unit: str = "updates"  # what position, warmup and horizon count (Megatron: "samples")
    per_update: int | None = None  # units one update advances the position by (Megatron: the global batch size)
    interval: str | None = None  # Lightning: "step", "epoch" (stepped once an epoch) or "unknown"
    per_epoch: int | None = None  # interval "epoch": the updates one epoch takes (the lr holds over them)

    @property
    def framework(self) -> str:
        return self.kind.partition(":")[0]

    @property
    def name(self) -> str:
        return self.kind.partition(":")[2]

    @property
    def recursive(self) -> bool:
        """The next lr is computed from the group's current lr (torch's chainable forms)."""
        return self.framework == "torch" and self.name in torch_lr.RECURSIVE

    @property
    def steps_left(self) -> int | None:
        if self.horizon is None or self.position is None:
            return None
        return max(self.horizon - self.position, 0)


@dataclass
class Counters:
    global_step: int | None = None  # updates the trainer counted (HF: also those the fp16 scaler skipped)
    epoch: float | None = None
    skip_batches: int | None = None  # micro-batches a resume skips in the current epoch
    consumed_samples: int | None = None
    updates_per_epoch: int | None = None
    source: str | None = None  # the file they come from
    why: dict = field(default_factory=dict)  # counter → why it is not known


@dataclass
class ScheduleState:
    schedule: Schedule | None
    counters: Counters = field(default_factory=Counters)
    groups: list[dict] | None = None  # the optimizer's saved groups: lr, initial_lr, max_lr … (no params)
    optimizer_step: float | None = None  # the optimizer's own count of updates (Adam's step), when one
    files: dict = field(default_factory=dict)  # role → file name (scheduler, optimizer, trainer_state …)
    fp16: bool = False  # a loss scaler's state beside it (skipped updates are possible)
    deepspeed_skipped: int | None = None  # DeepSpeed's skipped_steps (global_steps counts them)
    metadata: dict = field(default_factory=dict)  # the scheduler file's own string metadata (a burnpack's)
    notes: list[str] = field(default_factory=list)


def groups_for(sched: Schedule, groups: list[dict] | None) -> list[dict]:
    """The param groups a step starts from: the optimizer's saved ones, else ``lr_now`` alone."""
    if groups:
        return [dict(g) for g in groups]
    if sched.lr_now is None:
        raise MappingError("the schedule holds no current lr to step from")
    return [{"lr": lr} for lr in sched.lr_now]


def next_lrs(sched: Schedule, groups: list[dict] | None = None, n: int = 1) -> list[list[float]]:
    """The lr per group of each of the ``n`` updates after the next one, as the framework computes it
    (MappingError: not computable, with the reason)."""
    if sched.unknown:
        raise torch_lr.NotComputable(sched.unknown)
    fw = sched.framework
    if fw == "torch" or fw == "hf":
        if sched.name in ("ReduceLROnPlateau", "reduce_lr_on_plateau"):
            raise torch_lr.NotComputable("ReduceLROnPlateau steps on a metric: its next lr depends on the next "
                                         "evaluation (see plateau_next)")
        cls = "LambdaLR" if fw == "hf" else sched.name
        lambdas = [sched.lam] * len(sched.base_lrs) if sched.lam is not None else None
        st, gs = dict(sched.state), groups_for(sched, groups)
        if sched.interval == "unknown":
            raise torch_lr.NotComputable("the scheduler's interval (per step or per epoch) is not known")
        out = []
        if sched.interval == "epoch":  # update j (1-based) after the save: (j - 1) // per_epoch steps before it
            if sched.lr_now is None:
                raise torch_lr.NotComputable("the schedule holds no current lr")
            done, lrs = 0, list(sched.lr_now)
            for j in range(2, n + 2):
                while done < (j - 1) // sched.per_epoch:
                    st, gs = torch_lr.step(cls, st, gs, lambdas)
                    done, lrs = done + 1, [float(x) for x in st["_last_lr"]]
                out.append(list(lrs))
            return out
        for _ in range(n):
            st, gs = torch_lr.step(cls, st, gs, lambdas)
            out.append([float(x) for x in st["_last_lr"]])
        return out
    if fw == "burn":
        return [burn_lr.lr_at(sched, sched.position + 1 + k) for k in range(n)]
    if fw == "megatron":
        if not sched.per_update:
            raise torch_lr.NotComputable("the samples one update consumes are not known (args has no global batch "
                                         "size, or it ramps up)")
        return [megatron_lr.lr_at(sched, sched.position + (k + 1) * sched.per_update) for k in range(n)]
    if fw == "torchtitan":
        return [torchtitan_lr.lr_at(sched, sched.position + 1 + k) for k in range(n)]
    raise MappingError(f"no stepping for {sched.kind}")


def plateau_next(sched: Schedule, groups: list[dict] | None = None) -> dict[str, list[float]]:
    """ReduceLROnPlateau: the next lr if the next metric improves and if it does not."""
    gs = groups_for(sched, groups)
    return {word: [float(x) for x in torch_lr.plateau_step(sched.state, gs, word == "better")[0]["_last_lr"]]
            for word in ("better", "worse")}


def lr_at(sched: Schedule, t: int, groups: list[dict] | None = None) -> list[float] | None:
    """The closed-form lr per group at position ``t`` (None: the kind has none, or it is unknown)."""
    if sched.unknown:
        return None
    try:
        if sched.framework == "hf" and sched.lam is not None:
            return [base * sched.lam(t) for base in sched.base_lrs]
        if sched.framework == "torch":
            return torch_lr.closed_form(sched.name, sched.state, t, groups)
        if sched.framework == "burn":
            return burn_lr.lr_at(sched, t)
        if sched.framework == "megatron":
            return megatron_lr.lr_at(sched, t)
        if sched.framework == "torchtitan":
            return torchtitan_lr.lr_at(sched, t)
    except (MappingError, KeyError, TypeError, ZeroDivisionError, ValueError, OverflowError, IndexError):
        return None
    return None


def same_lr(a: float, b: float) -> bool:
    """Two lrs agree (to a few ulps: a closed form and its recursive form round differently)."""
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)


def build_hf(kind: str, kwargs: dict, warmup: int, max_steps: int, lr_init: float | None, state: dict) -> Schedule:
    """A Trainer schedule rebuilt from its arguments over the saved torch LambdaLR / plateau state."""
    sched = Schedule(f"hf:{kind}", state=dict(state), base_lrs=list(state.get("base_lrs") or []),
                     position=state.get("last_epoch"), lr_now=_floats(state.get("_last_lr")))
    if kind == "reduce_lr_on_plateau":
        sched.params = {k: state[k] for k in ("factor", "patience", "cooldown", "min_lrs", "mode", "threshold")
                        if k in state}
        sched.notes.append("stepped on the evaluation metric (metric_for_best_model), not every update")
        return sched
    sched.lam, sched.params = hf_lr.rebuild(kind, kwargs, warmup, max_steps, lr_init)
    sched.warmup = warmup if kind != "constant" else 0
    sched.horizon = max_steps if kind not in ("constant", "constant_with_warmup", "inverse_sqrt") else None
    if kind == "warmup_stable_decay":
        p = sched.params
        sched.horizon = p["num_warmup_steps"] + p["num_stable_steps"] + p["num_decay_steps"]
    return sched


def build_torch(cls: str, state: dict) -> Schedule:
    """A torch scheduler's state_dict (class ``cls``) as a Schedule."""
    sched = Schedule(f"torch:{cls}", state=dict(state), base_lrs=_floats(state.get("base_lrs")) or [],
                     position=state.get("last_epoch"), lr_now=_floats(state.get("_last_lr")))
    sched.params = {k: v for k, v in state.items() if not k.startswith("_") and k not in (
        "base_lrs", "last_epoch", "verbose", "lr_lambdas", "best", "num_bad_epochs", "cooldown_counter", "T_cur",
        "T_i", "mode_worse")}
    if "milestones" in sched.params:
        sched.params["milestones"] = sorted(k for k, n in state["milestones"].items() for _ in range(n))
    horizon = {"ConstantLR": "total_iters", "LinearLR": "total_iters", "PolynomialLR": "total_iters",
               "CosineAnnealingLR": "T_max", "OneCycleLR": "total_steps"}.get(cls)
    if horizon:
        sched.horizon = state[horizon]
    if cls == "LinearLR" and state["start_factor"] < state["end_factor"]:
        sched.warmup = state["total_iters"]
    if cls == "OneCycleLR":
        sched.warmup = math.floor(state["_schedule_phases"][0]["end_step"]) + 1
    if cls in ("LambdaLR|MultiplicativeLR", "LambdaLR", "MultiplicativeLR"):
        sched.unknown = ("LambdaLR and MultiplicativeLR save no function (state_dict keeps only a callable object's "
                         "__dict__): the lr at later steps depends on code statekit does not have")
    if cls == "CyclicLR" and state.get("_scale_fn_custom") is not None:
        sched.unknown = "CyclicLR's custom scale_fn is not saved"
    if cls == "SequentialLR":
        sched.params = {"milestones": list(state["_milestones"]),
                        "schedulers": [torch_lr.class_of(c) for c in state["_schedulers"]]}
        sched.base_lrs = _floats(state["_schedulers"][0].get("base_lrs")) or []
    if cls == "ChainedScheduler":
        sched.params = {"schedulers": [torch_lr.class_of(c) for c in state["_schedulers"]]}
        sched.base_lrs = _floats(state["_schedulers"][0].get("base_lrs")) or []
        sched.position = state["_schedulers"][0].get("last_epoch")
    if cls in ("SequentialLR", "ChainedScheduler") and any(
            c in (None, "LambdaLR|MultiplicativeLR") for c in sched.params["schedulers"]):
        sched.unknown = "a child scheduler is a LambdaLR or MultiplicativeLR, whose function is not saved"
    return sched


def _floats(values) -> list[float] | None:
    if not isinstance(values, list | tuple):
        return None
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        return None


def describe(ss: ScheduleState) -> dict:
    """The JSON view ``inspect`` shows: kind, warm-up, horizon, position, lr now / next, steps left."""
    sched = ss.schedule
    out: dict = {"files": dict(ss.files)}
    if sched is not None:
        out.update({"kind": sched.kind, "params": _plain(sched.params), "base_lrs": _plain(sched.base_lrs),
                    "position": sched.position, "warmup": sched.warmup, "horizon": sched.horizon,
                    "steps_left": sched.steps_left, "lr_now": _plain(sched.lr_now), "lr_next": None})
        try:
            if sched.name in ("ReduceLROnPlateau", "reduce_lr_on_plateau"):
                out["lr_next_if"] = _plain(plateau_next(sched, ss.groups))
            else:
                out["lr_next"] = _plain(next_lrs(sched, ss.groups)[0])
        except (MappingError, KeyError, TypeError, ZeroDivisionError, ValueError, OverflowError, IndexError) as exc:
            out["lr_next_why"] = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        if sched.unknown:
            out["unknown"] = sched.unknown
        if sched.disagrees:
            out["disagrees"] = sched.disagrees
        if sched.children:
            out["children"] = [_child(c) for c in sched.children]
        if sched.unit != "updates":
            out.update(_in_updates(sched))
        out["notes"] = list(sched.notes)
    c = ss.counters
    out["counters"] = {k: getattr(c, k) for k in ("global_step", "epoch", "skip_batches", "consumed_samples",
                                                  "updates_per_epoch")}
    if c.why:
        out["counters_why"] = dict(c.why)
    if ss.optimizer_step is not None:
        out["optimizer_step"] = ss.optimizer_step
    out["notes"] = out.get("notes", []) + list(ss.notes)
    return out


def _in_updates(sched: Schedule) -> dict:
    """A schedule counted in samples (Megatron): its unit, the samples per update, the positions in updates
    (iterations), and the weight decay now / next where the kind computes one."""
    out: dict = {"unit": sched.unit, "per_update": sched.per_update}
    if sched.per_update:
        out["updates"] = {k: (None if v is None else _count(v / sched.per_update)) for k, v in (
            ("position", sched.position), ("warmup", sched.warmup), ("horizon", sched.horizon),
            ("steps_left", sched.steps_left))}
    if sched.framework == "megatron" and not sched.unknown and sched.position is not None:
        try:
            out["wd_now"] = megatron_lr.wd_at(sched, sched.position)
            if sched.per_update and out["wd_now"] is not None:
                out["wd_next"] = megatron_lr.wd_at(sched, sched.position + sched.per_update)
        except (KeyError, TypeError, ZeroDivisionError, ValueError):
            out.pop("wd_now", None)
    return out


def _count(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _child(sched: Schedule) -> dict:
    out = {"kind": sched.kind, "position": sched.position, "state": _plain(sched.state)}
    if sched.children:
        out["children"] = [_child(c) for c in sched.children]
    return out


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return f"({type(value).__name__})"
