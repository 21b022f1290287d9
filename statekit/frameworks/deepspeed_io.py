"""DeepSpeed ZeRO (stage 1, 2, 3) and universal checkpoints → the neutral state, per parameter.

ZeRO keeps each optimizer group as one flat fp32 vector split across the data-parallel ranks; a
rank's optimizer shard holds its partition of the master weights and of every moment. The
consolidation rules are DeepSpeed's own (``deepspeed/utils/zero_to_fp32.py``):

- **stage 1/2**: per group, the ranks' partitions (``single_partition_of_fp32_groups``, and
  ``base_optimizer_state["state"][g]``'s moments) concatenated in rank order are the group's
  parameters back to back in ``param_shapes[g]`` order, each followed by its
  ``param_alignment_paddings`` entry; the tail is padding up to a multiple of ``2 * world``.
- **stage 3**: each parameter is split on its own: every rank holds ``ceil(numel / world)``
  elements of it (the last rank zero-padded) at the same offset of its flat vector
  (``fp32_flat_groups`` and the ``optimizer_state_dict`` moments, groups concatenated); the
  parameter is the ranks' pieces concatenated and cut to ``numel``.

Nothing is gathered up front: each parameter's slots are lazy tensors that read their byte ranges
from the shard files (with ``pread``) only when asked. The fp32 master weights become the
checkpoint's model (what ``zero_to_fp32`` returns); the moments and step the optimizer state.

A universal checkpoint (``ds_to_universal``) already holds one file per parameter and slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import re
from collections.abc import Iterator

from statekit import dtypes
from statekit.errors import FormatError
from statekit.formats import deepspeed, limits
from statekit.frameworks import base, torch_state
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState
from statekit.tensor import PIECE, TensorRef

FORMAT = "deepspeed"
SLOTS = ("exp_avg", "exp_avg_sq")
Segment = tuple[TensorRef, int, int]  # a flat source tensor, first element, element count


def open_checkpoint(path: str, **options) -> Checkpoint:
    if deepspeed.is_universal_dir(path):
        return _open_universal(path)
    tag = deepspeed.tag_dir(path)
    if tag is None:
        raise FormatError("not a DeepSpeed checkpoint folder (no *_optim_states.pt, no latest, no zero/)", path)
    try:
        return _open_zero(path, tag)
    except FormatError as exc:
        if exc.path is None:
            exc.path = path
        raise


def _dict(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise FormatError(f"{what} is a {type(value).__name__}, not a dict")
    return value


def _flat(value: object, what: str) -> TensorRef:
    if not isinstance(value, TensorRef) or len(value.shape) != 1 or value.dtype != "F32":
        raise FormatError(f"{what} is not a flat fp32 tensor")
    return value


def _shapes(model_states: dict) -> list[dict[str, tuple[int, ...]]]:
    shapes = model_states.get("param_shapes")
    if isinstance(shapes, dict):
        shapes = [shapes]
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise FormatError("model states have no param_shapes list")
    return [{str(k): tuple(v) for k, v in g.items()} for g in shapes]


def _open_zero(path: str, tag: str) -> Checkpoint:
    files = deepspeed.optim_files(tag)
    world = len(files)
    shards = [_dict(deepspeed.load(files[r]), files[r]) for r in range(world)]
    osds = [_dict(s.get("optimizer_state_dict"), f"{files[r]}: optimizer_state_dict") for r, s in enumerate(shards)]
    stage = osds[0].get("zero_stage")
    model_states = _dict(deepspeed.load(deepspeed.model_file(tag)), "model states")
    shapes = _shapes(model_states)
    if stage in (1, 2):
        fp32 = [[_flat(t, f"rank {r} fp32 partition") for t in o.get("single_partition_of_fp32_groups", [])]
                for r, o in enumerate(osds)]
        bases = [_dict(o.get("base_optimizer_state"), "base_optimizer_state") for o in osds]
        paddings = osds[0].get("param_alignment_paddings")
        layout = _layout_zero12(shapes, [g.numel for g in fp32[0]], world, paddings)
    elif stage == 3:
        fp32 = [[_flat(t, f"rank {r} fp32 partition") for t in o.get("fp32_flat_groups", [])]
                for r, o in enumerate(osds)]
        bases = [_dict(o.get("optimizer_state_dict"), "optimizer_state_dict") for o in osds]
        layout = _layout_zero3(shapes, [g.numel for g in fp32[0]], world)
    else:
        raise FormatError(f"ZeRO stage {stage!r} is not one statekit reads (1, 2 or 3)", files[0])
    if any(len(f) != len(shapes) for f in fp32):
        raise FormatError(f"{len(shapes)} parameter groups in param_shapes, but the shards hold "
                          f"{[len(f) for f in fp32]} flat groups", tag)
    groups_hp = bases[0].get("param_groups")
    if not isinstance(groups_hp, list) or len(groups_hp) != len(shapes):
        raise FormatError("the optimizer's param_groups do not match param_shapes", files[0])
    flats = {"fp32": fp32}
    for slot in SLOTS:
        flats[slot] = [[_flat(_dict(b.get("state"), "state").get(g, {}).get(slot), f"rank {r} group {g} {slot}")
                        for g in range(len(shapes))] for r, b in enumerate(bases)]
    sd_state: dict[int, dict] = {}
    sd_groups: list[dict] = []
    model = ModelInfo()
    for g, group_shapes in enumerate(shapes):
        step = _dict(bases[0].get("state"), "state").get(g, {}).get("step")
        group = {**{k: v for k, v in _dict(groups_hp[g], f"param_groups[{g}]").items() if k != "params"},
                 "params": [], "param_names": []}
        for name, shape in group_shapes.items():
            index = len(model.params)
            segs = layout[name]
            sd_state[index] = {"step": step, **{slot: _gathered(flats[slot], segs, shape) for slot in SLOTS}}
            group["params"].append(index)
            group["param_names"].append(name)
            model.params.append(ModelParam(name, shape, "F32", index=index, tensor=_gathered(fp32, segs, shape)))
        sd_groups.append(group)
    state = _as_torch_state(sd_state, sd_groups, path, f"DeepSpeed ZeRO stage {stage} at data-parallel world size "
                            f"{world}, consolidated per parameter (ds_version {osds[0].get('ds_version')})")
    params = state.params
    ckpt = Checkpoint(path=path, format=FORMAT, kind="optimizer", optimizer=state, model=model)
    ckpt.n_tensors = sum(len(p.slots) for p in params)
    ckpt.nbytes = sum(p.nbytes for p in params)
    ckpt.metadata.update(zero_stage=str(stage), world_size=str(world), tag=os.path.basename(tag))
    _attach_schedule(ckpt, model_states, groups_hp, path)
    return ckpt


def _attach_schedule(ckpt: Checkpoint, model_states: dict, groups: list, path: str) -> None:
    from statekit.errors import StatekitError
    from statekit.frameworks import schedule_deepspeed

    try:
        ckpt.schedule = schedule_deepspeed.read(model_states, groups, path)
    except StatekitError as exc:
        ckpt.warnings.append(f"LR schedule not read: {exc.message}")


def _as_torch_state(sd_state: dict, sd_groups: list[dict], path: str, note: str) -> OptimizerState:
    """The consolidated state read as the torch optimizer state_dict it is (family, groups, steps)."""
    state = torch_state.read_optimizer({"state": sd_state, "param_groups": sd_groups}, path)
    state.notes.insert(0, note)
    return state


def _engine_steps(model_states: dict) -> int | None:
    """Optimizer steps the engine took (ZeRO steps every parameter of a group together)."""
    steps, skipped = model_states.get("global_steps"), model_states.get("skipped_steps", 0)
    if type(steps) is not int or type(skipped) is not int or skipped > steps:
        return None
    return steps - skipped


def _shaped(ref: TensorRef, shape: tuple | None, what: str, path: str) -> TensorRef:
    """``ref`` with the parameter's shape (ds_to_universal of ZeRO-3 saves moments flat)."""
    if shape is None or tuple(ref.shape) == tuple(shape):
        return ref
    if ref.numel != math.prod(shape) or ref.span is None:
        raise FormatError(f"{what} has shape {list(ref.shape)}, the parameter {list(shape)}", path)
    return TensorRef(ref.dtype, tuple(shape), span=ref.span, info=dict(ref.info))


def _split(base: int, count: int, part: int) -> list[tuple[int, int, int]]:
    """Global elements [base, base + count) of rank partitions of ``part`` elements: (rank, lo, n)."""
    out = []
    while count > 0:
        rank, lo = divmod(base, part)
        n = min(count, part - lo)
        out.append((rank, lo, n))
        base, count = base + n, count - n
    return out


def _layout_zero12(shapes, parts: list[int], world: int, paddings) -> dict[str, list[tuple[int, int, int, int]]]:
    """name → [(rank, group, first element, count)] for stage 1/2 (see the module docstring)."""
    layout: dict[str, list[tuple[int, int, int, int]]] = {}
    align = 2 * world
    for g, group in enumerate(shapes):
        offset = 0
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and len(pads) != len(group):
            raise FormatError(f"group {g}: {len(pads)} alignment paddings for {len(group)} parameters")
        avail = parts[g] * world
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise FormatError(f"{name}: needs elements up to {offset + numel}, the shards hold {avail}")
            layout[name] = [(r, g, lo, n) for r, lo, n in _split(offset, numel, parts[g])]
            offset += numel + (pads[i] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise FormatError(f"group {g}: the parameters use {offset} of {avail} elements; param_shapes do not "
                              "match the shards")
    return layout


def _layout_zero3(shapes, parts: list[int], world: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """name → [(rank, group, first element, count)] for stage 3 (see the module docstring)."""
    starts = [sum(parts[:g]) for g in range(len(parts) + 1)]
    layout: dict[str, list[tuple[int, int, int, int]]] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            per_rank = math.ceil(numel / world)
            segs, left = [], numel
            for r in range(world):
                lo, want = offset, min(per_rank, left)
                while want > 0:  # the rank's range may cross a group boundary
                    g = max(i for i in range(len(parts)) if starts[i] <= lo)
                    n = min(want, starts[g + 1] - lo)
                    if n <= 0:
                        raise FormatError(f"{name}: lies past the end of the flat groups")
                    segs.append((r, g, lo - starts[g], n))
                    lo, want, left = lo + n, want - n, left - n
            layout[name] = segs
            offset += per_rank
    if offset != starts[-1]:
        raise FormatError(f"the parameters use {offset} elements of each rank's {starts[-1]}; param_shapes do not "
                          "match the shards")
    return layout


def _gathered(flats: list[list[TensorRef]], segs, shape: tuple[int, ...]) -> TensorRef:
    """A lazy tensor of ``shape`` whose bytes are the segments of the ranks' flat tensors."""
    item = dtypes.itemsize("F32")

    def pieces(size: int) -> Iterator[bytes | memoryview]:
        step = max(1, (size or PIECE) // item)
        for r, g, lo, n in segs:
            ref = flats[r][g]
            for a in range(lo, lo + n, step):
                m = min(step, lo + n - a)
                if ref.span is not None:
                    yield ref.span.read(a * item, m * item)
                else:
                    yield ref.raw()[a * item:(a + m) * item]

    return TensorRef("F32", tuple(shape), loader=lambda: b"".join(bytes(p) for p in pieces(PIECE)),
                     chunk_reader=pieces, info={"deepspeed_segments": len(segs)})


# --------------------------------------------------------------------------------- universal

_PARAM_DIR = re.compile(r"^[^/\\\0]+$")


def _open_universal(path: str) -> Checkpoint:
    zero = os.path.join(path, "zero")
    opt_state = _dict(deepspeed.load(os.path.join(zero, "optimizer_state.pt")), "zero/optimizer_state.pt")
    groups_hp = opt_state.get("param_groups") or [{}]
    model_states: dict = {}
    try:
        model_states = _dict(deepspeed.load(deepspeed.model_file(path)), "model states")
        shapes = _shapes(model_states)
    except FormatError:
        shapes = [{n: None for n in sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))}]
    declared = {n: shape for g in shapes for n, shape in g.items()}
    order = list(declared)
    present = {n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))}
    missing = [n for n in order if n not in present]
    if missing:
        raise FormatError(f"zero/{missing[0]}/ is missing for a parameter of param_shapes", path)
    model = ModelInfo()
    sd_state: dict[int, dict] = {}
    step_note = False
    for index, name in enumerate(order):
        folder = os.path.join(zero, name)
        entry_state: dict[str, object] = {}
        for slot in ("fp32", *SLOTS):
            file = os.path.join(folder, f"{slot}.pt")
            if not os.path.isfile(file):
                if slot == "fp32":
                    raise FormatError(f"zero/{name}/fp32.pt is missing", path)
                continue
            entry = deepspeed.load(file)  # {'param': tensor, 'cat_dim': ...}, or (ZeRO-3 sources) the tensor
            ref = entry.get("param") if isinstance(entry, dict) else entry
            if not isinstance(ref, TensorRef):
                raise FormatError(f"zero/{name}/{slot}.pt holds no 'param' tensor", path)
            ref = _shaped(ref, declared[name], f"zero/{name}/{slot}.pt", path)
            if slot == "fp32":
                model.params.append(ModelParam(name, tuple(ref.shape), ref.dtype, index=index, tensor=ref))
            else:
                entry_state[slot] = ref
        step_file = os.path.join(folder, "step.pt")
        if os.path.isfile(step_file):
            entry_state = {"step": deepspeed.load(step_file), **entry_state}
        elif entry_state and _engine_steps(model_states) is not None:
            entry_state = {"step": float(_engine_steps(model_states)), **entry_state}
            step_note = True
        if entry_state:
            sd_state[index] = entry_state
    groups = [{**{k: v for k, v in _dict(groups_hp[0], "param_groups[0]").items() if k != "params"},
               "params": list(range(len(order))), "param_names": list(order)}]
    state = _as_torch_state(sd_state, groups, path, "DeepSpeed universal checkpoint (one file per parameter and slot)")
    if step_note:
        state.notes.append("no step.pt beside the moments (ds_to_universal of a ZeRO-3 checkpoint): the step is "
                           "the engine's optimizer steps, global_steps - skipped_steps from the model states")
    if any(p.slots and p.step is None for p in state.params):
        state.notes.append("no step.pt beside the moments (ds_to_universal of a ZeRO-3 checkpoint): the step "
                           "count is unknown here; the ZeRO shards themselves keep it")
    if len(groups_hp) > 1:
        state.notes.append("the universal checkpoint lists several param groups; their hyperparameters are those "
                           "of the first (ds_to_universal keeps no per-parameter group)")
    params = state.params
    ckpt = Checkpoint(path=path, format=FORMAT, kind="optimizer", optimizer=state, model=model)
    ckpt.n_tensors = sum(len(p.slots) for p in params)
    ckpt.nbytes = sum(p.nbytes for p in params)
    _attach_schedule(ckpt, model_states, groups_hp, path)
    return ckpt


# ------------------------------------------------------------------------- universal: writing

# The fp32 master weights a universal checkpoint needs are model tensors, not optimizer state: the
# caller (``ops.convert``) hands them over for the duration of one write (``--model``, else the
# checkpoint's own model — a DeepSpeed checkpoint's consolidated master weights).
_WEIGHTS: contextvars.ContextVar[ModelInfo | None] = contextvars.ContextVar("deepspeed_universal_weights",
                                                                            default=None)
UNIVERSAL_DS_VERSION = "0.19.8"  # the DeepSpeed release whose ds_to_universal layout this writer matches


def _plain(ref: TensorRef) -> TensorRef:
    """``ref`` pickled as a plain tensor (DeepSpeed saves tensors, not ``nn.Parameter``s)."""
    if not ref.info.get("parameter"):
        return ref
    return dataclasses.replace(ref, info={k: v for k, v in ref.info.items() if k not in ("parameter", "requires_grad")})


@contextlib.contextmanager
def universal_weights(model: ModelInfo | None):
    token = _WEIGHTS.set(model)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


@base.optimizer_writer
def save_universal(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """Write ``state`` as the folder ``ds_to_universal`` writes for a ZeRO 1/2 checkpoint:
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (``{'cat_dim': 0, 'param': tensor}``),
    ``zero/<name>/step.pt`` (a 0-d fp32 tensor), ``zero/optimizer_state.pt`` (``param_groups``,
    ``ds_version``), ``mp_rank_00_model_states.pt`` (``module``: the fp32 weights, ``param_shapes``,
    steps) and, like ``ds_to_universal``, ``latest_universal`` beside the folder naming it."""
    import numpy as np

    from statekit.atomic import atomic_write
    from statekit.formats import torch_pt

    path = os.fspath(path).rstrip("/" + os.sep) or os.fspath(path)
    groups = groups if groups is not None else [g.hyperparams for g in state.groups]
    plan = _universal_entries(state, path, family or state.family)
    limits.utf8_all(([name for name, _, _ in plan], groups))  # refused before the first file is written
    steps = {step for _, _, step in plan}
    written = 0
    zero = os.path.join(path, "zero")
    for name, tensors, step in plan:
        folder = os.path.join(zero, name)
        os.makedirs(folder, exist_ok=True)
        for slot, ref in tensors.items():
            ref = _plain(ref if ref.dtype == "F32" else ref.cast("F32"))
            torch_pt.save_pt({"cat_dim": 0, "param": ref}, os.path.join(folder, f"{slot}.pt"))
            written += os.path.getsize(os.path.join(folder, f"{slot}.pt"))
            if progress is not None:
                progress(ref.nbytes)
        if step is not None:
            torch_pt.save_pt(np.array(float(step), dtype=np.float32), os.path.join(folder, "step.pt"))
            written += os.path.getsize(os.path.join(folder, "step.pt"))
    names = [name for name, _, _ in plan]
    by_group: list[list[int]] = [[] for _ in groups] or [[]]
    for i, p in enumerate(state.params):
        by_group[min(p.group, len(by_group) - 1)].append(i)
    # ZeRO's base optimizer holds one flat tensor per group: group g's "params" is [g]
    param_groups = [{**{k: v for k, v in dict(g).items() if k not in ("params", "param_names")}, "params": [i]}
                    for i, g in enumerate(groups or [{}])]
    optimizer_state = {"param_groups": param_groups, "ds_version": UNIVERSAL_DS_VERSION}
    torch_pt.save_pt(optimizer_state, os.path.join(zero, "optimizer_state.pt"))
    written += os.path.getsize(os.path.join(zero, "optimizer_state.pt"))
    step = next(iter(steps)) if len(steps) == 1 else None
    model_states: dict[str, object] = {
        "module": {name: _plain(tensors["fp32"]) for name, tensors, _ in plan},
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [{names[i]: tuple(plan[i][1]["fp32"].shape) for i in idx} for idx in by_group],
        "frozen_param_shapes": {},
        "shared_params": {},
        "lr_scheduler": None,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": UNIVERSAL_DS_VERSION,
    }
    if step is not None and float(step).is_integer():
        model_states.update(global_steps=int(step), skipped_steps=0)
    torch_pt.save_pt(model_states, os.path.join(path, "mp_rank_00_model_states.pt"))
    written += os.path.getsize(os.path.join(path, "mp_rank_00_model_states.pt"))
    root, folder = os.path.split(os.path.abspath(path))
    with atomic_write(os.path.join(root, "latest_universal")) as fh:
        fh.write(os.fsencode(folder))  # the folder name's bytes, as given (a name need not be UTF-8)
    return written


def _universal_entries(state: OptimizerState, path: str, family: str | None) -> list[tuple[str, dict, object]]:
    """(name, {slot: tensor} with the fp32 weight, step) per parameter; refused before any byte is written."""
    from statekit.errors import MappingError

    if family not in ("adam", "adamw"):
        raise MappingError(f"a DeepSpeed universal checkpoint holds Adam/AdamW state (exp_avg, exp_avg_sq); this "
                           f"state is {family}", path)
    model = _WEIGHTS.get()
    weights = {p.path: p for p in model.params if not p.buffer} if model is not None else {}
    plan: list[tuple[str, dict, object]] = []
    for p in state.params:
        if not p.path or not _PARAM_DIR.match(p.path) or p.path in (".", ".."):
            raise MappingError(f"parameter {p.label()}: a universal checkpoint keeps one folder per parameter name; "
                               "this one has no usable name (give --names or --model)", path)
        weight = weights.get(p.path)
        if weight is None or weight.tensor is None:
            where = "the model given with --model" if model is not None else "the input (it holds no weights)"
            raise MappingError(f"parameter {p.path}: no fp32 master weight in {where}; a universal checkpoint "
                               "needs the weights (give --model with them)", path)
        missing = [s for s in SLOTS if s not in p.slots]
        if missing:
            raise MappingError(f"parameter {p.path}: no {missing[0]} in the optimizer state", path)
        for t in (weight.tensor, *(p.slots[s] for s in SLOTS)):
            if tuple(t.shape) != tuple(p.slots["exp_avg"].shape):
                raise MappingError(f"parameter {p.path}: weight and moments have shapes {list(weight.tensor.shape)}, "
                                   f"{list(p.slots['exp_avg'].shape)}", path)
        plan.append((p.path, {"fp32": weight.tensor, **{s: p.slots[s] for s in SLOTS}}, p.step))
    if not plan:
        raise MappingError("no parameter state to write", path)
    return plan
