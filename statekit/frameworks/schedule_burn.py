"""burn's scheduler records (``scheduler-N.bpk``: a burnpack of scalars only) read as a schedule.

Keys are the record's field paths joined with ``.``; a composite scheduler nests its children under
``{i}.``, and the Learner's ``ModuleLrScheduler`` puts each param group's scheduler under ``{g}.``
(group 0: every parameter), so a Learner's cosine scheduler is ``0.current_iter``. Each scheduler
is told by its counter's key and variant (:mod:`statekit.schedule.burn_lr`), its position read
back where the counter alone says it. burn saves no config: the lr itself is not known from the
file (``unknown`` says so), only where each scheduler stands.
"""

from __future__ import annotations

import os
import re

from statekit.errors import FormatError
from statekit.schedule import burn_lr, model

EPOCH = re.compile(r"scheduler-(\d+)\.bpk$")


def _tree(scalars: dict) -> dict:
    root: dict = {"fields": {}, "children": {}}
    for key, scalar in scalars.items():
        node = root
        parts = key.split(".")
        for part in parts[:-1]:
            if not part.isdigit():
                raise FormatError(f"scheduler record key {key!r}: {part!r} is no child index")
            node = node["children"].setdefault(int(part), {"fields": {}, "children": {}})
        node["fields"][parts[-1]] = scalar
    return root


def _schedule(node: dict, where: str) -> model.Schedule:
    fields, children = node["fields"], [_schedule(node["children"][i], f"{where}{i}.")
                                        for i in sorted(node["children"])]
    if not fields:
        if not children:
            return model.Schedule("burn:constant", position=None, notes=["a constant lr: its record is empty"])
        return model.Schedule("burn:composed", children=children, position=children[0].position,
                              unknown=burn_lr.NO_CONFIG)
    if len(fields) != 1:
        raise FormatError(f"scheduler record {where or '(top)'} holds {sorted(fields)}: no burn scheduler's counters")
    key, scalar = next(iter(fields.items()))
    kind = burn_lr.kind_of(key, scalar.kind, bool(children))
    if kind is None:
        raise FormatError(f"scheduler record field {where}{key}: no burn scheduler keeps it")
    sched = model.Schedule(f"burn:{kind}", state={key: scalar.value}, children=children, unknown=burn_lr.NO_CONFIG)
    sched.position = burn_lr.position(kind, scalar.value, {})
    if sched.position is None:
        sched.notes.append(f"{where}{key}={scalar.value!r}: the position needs the config (num_iters / initial lr)")
    return sched


def read_pack(pack) -> model.ScheduleState:
    """An opened burnpack scheduler record (``BurnpackFile``) as a ScheduleState."""
    root = _tree(pack.scalars)
    groups = bool(root["children"]) and not root["fields"]
    if groups:  # the Learner's ModuleLrScheduler: one scheduler per param group
        top = model.Schedule("burn:groups", unknown=burn_lr.NO_CONFIG,
                             children=[_schedule(root["children"][g], f"{g}.") for g in sorted(root["children"])])
        top.position = top.children[0].position
        top.notes.append("one scheduler per param group (the Learner's ModuleLrScheduler; group 0: every parameter) "
                         "— or a composite's children, which the keys alone do not tell apart")
    else:
        top = _schedule(root, "")
    ss = model.ScheduleState(top, files={"scheduler": os.path.basename(pack.path)}, metadata=dict(pack.metadata))
    match = EPOCH.search(os.path.basename(pack.path))
    if match:
        ss.counters.epoch = float(match.group(1))
        ss.counters.source = os.path.basename(pack.path)
        ss.counters.why["skip_batches"] = "burn saves at the end of an epoch only: a resume starts the next epoch"
        ss.counters.skip_batches = 0
    return ss
