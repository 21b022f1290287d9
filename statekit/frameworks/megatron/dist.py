"""Megatron-Core torch_dist checkpoints as Checkpoints: every parameter named as Megatron names it.

The container (:mod:`statekit.formats.megatron_dist`) gives the DCP values, the common state and
the ShardedObjects; this module finds the optimizer's part (``shared/docs/megatron-formats.md``
§2.4) and turns it into one :class:`~statekit.state.ParamState` per parameter:

- the sharding type: ``param_state_sharding_type`` in the common state's ``optimizer`` entry
  (absent: the non-distributed optimizer); a ChainedOptimizer (dense + expert) is a dict of its
  members there, ``{0: …, 1: …}``, whose tensor and object keys may carry ``chained_{i}.``;
- model-space types (non-distributed, ``fully_sharded_model_space``, ``fully_reshardable``):
  ``[chained_i.]optimizer.state.<slot>.<model key>`` per slot (``exp_avg``, ``exp_avg_sq``, the
  fp32 master ``fp32_param`` or, for fully_reshardable, ``param``), stacked like the model key;
  ``fully_sharded_model_space`` stores them N-D reformulated (:mod:`.regions`);
- bucket-space types (``dp_reshardable``, ``fully_sharded_bucket_space``,
  ``dp_zero_gather_scatter``) are cut into parameters by the bucket layout rules
  (:mod:`.bucket_space`);
- stacked keys are unstacked into ``decoder.layers.{i}.…`` and per-expert names (:mod:`.stacking`),
  NeMo 2's ``module.`` prefix dropped;
- param groups: each parameter's group by Megatron's own rule (``_get_param_groups``: no weight
  decay for 1-D parameters and biases, expert-parallel parameters apart, decoupled lr for the
  embedding and output layer), matched to the stored groups by those keys, never by position;
  the step is the group's ``step`` (distributed optimizer) or ``common_step`` (the
  non-distributed one);
- the fp32 master is slot ``fp32_master`` (:data:`statekit.naming.MASTER_SLOT`, as the legacy
  reader names it), the stored weights the checkpoint's model; every master is **proved**: where
  the checkpoint holds the model weight, the master rounded to the weight's dtype must equal it
  bit for bit before any state is called that parameter's (:mod:`.dist_proof_adapter`). A
  parameter that does not prove is refused, naming it and the rule; ``prove="report"`` (doctor)
  keeps the state and records each failure in :attr:`MegatronDistCheckpoint.disproofs`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from statekit import naming
from statekit.errors import FormatError, MappingError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import Record
from statekit.frameworks.megatron import (
    bridge_config,
    bridge_state,
    bucket_space,
    config,
    proof,
    regions,
    stacking,
)
from statekit.frameworks.torch_state import describe_scheduler
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

FORMAT = "megatron-dist"
MODEL_SPACE = ("fully_sharded_model_space", "fully_reshardable")
BUCKET_SPACE = ("dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter")
BUCKETS_READ = ("dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter")
MASTERS = ("fp32_param", "param")
MOMENTS = ("exp_avg", "exp_avg_sq")  # the fp32 master's slot name (fully_reshardable: param)
_STATE_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.([A-Za-z_][A-Za-z0-9_]*?)\.(.+)$")
_BUCKET_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.")
_STATE_SLOTS = ("exp_avg_sq", "exp_avg", "fp32_param", "param", "momentum_buffer")
# the input embedding's padding rows (beyond args.vocab_size) are never looked up: no gradient, no
# moments. Not so the output layer's (their logits enter the loss) nor a tied embedding's.
INPUT_EMBEDDING = "embedding.word_embeddings.weight"
PROOF_RULE = "the master-vs-weight rule"
MULTI_BUCKET_FIX = "32a03b77c5"  # Megatron-LM's fix of the fully_reshardable save (#5077, after core 0.19.0)


@dataclass
class Disproved:
    """A parameter whose master does not round to its stored weight."""

    param: str
    key: str
    message: str  # the proof's own line (the first element that differs)
    sharding: str


@dataclass
class MegatronDistCheckpoint:
    """The container behind a Checkpoint: the torch_dist folder and what reading it found."""

    dist: megatron_dist.MegatronDist
    sharding: str = "non_distributed"
    disproofs: list[Disproved] = field(default_factory=list)
    padding: dict[str, tuple[int, int]] = field(default_factory=dict)  # param -> (true rows, stored rows)
    position_disagreements: list[str] = field(default_factory=list)  # a Bridge folder's (bridge_state)

    def close(self) -> None:
        self.dist.close()

    def doctor_findings(self, params: list[ParamState]) -> list[tuple[str, str, str, str]]:
        """What ``doctor`` reports beyond its generic checks, as (severity, check, parameter,
        message): parameters whose master does not round to their weight (with the known cause
        when the sharding type has one), and vocabulary padding rows that hold state."""
        out = []
        for d in self.disproofs:
            cause = ""
            if d.sharding == "fully_reshardable":
                cause = ("; the known cause: the fully_reshardable save of mcore 0.15-0.19 cut every parameter "
                         "after the buffer's first bucket at padded offsets (shifted states; fixed in Megatron-LM "
                         f"{MULTI_BUCKET_FIX}), so these moments and this master belong to other elements")
            out.append(("error", "megatron-master", d.param, f"{d.message} (weight {d.key}){cause}"))
        by_path = {p.path: p for p in params}
        for name, (rows, stored) in self.padding.items():
            p = by_path.get(name)
            if p is None:
                continue
            held = [slot for slot, ref in p.slots.items() if slot in MOMENTS and _rows_hold(ref, rows)]
            if held:
                out.append(("warning", "padding-state", name,
                            f"{', '.join(held)} non-zero in the vocabulary padding rows {rows}..{stored - 1} "
                            f"(args.vocab_size {rows}): no token looks them up, so no gradient ever reached them; "
                            "the state there was left by something else"))
        for d in self.position_disagreements:
            out.append(("warning", "counters", None, f"Megatron-Bridge's train_state.pt: {d}"))
        return out


def _rows_hold(ref: TensorRef, rows: int) -> bool:
    """Whether any element of rows ``rows:`` of ``ref`` is non-zero (read in pieces)."""
    per_row = ref.numel // ref.shape[0] if ref.shape and ref.shape[0] else 0
    start = rows * per_row
    pos = 0
    for piece in ref.pieces(1 << 20):
        lo = max(0, start - pos)
        if lo < piece.size and piece[lo:].any():
            return True
        pos += piece.size
    return False


def _fields(value: object) -> dict:
    if isinstance(value, Record):
        return dict(value.fields)
    return value if isinstance(value, dict) else {}


def _members(common: dict, where: str) -> dict[int | None, dict]:
    """The optimizer's members in the common state: {None: one} or a ChainedOptimizer's {i: …}."""
    opt = common.get("optimizer")
    if opt is None:
        raise FormatError("the common state has no 'optimizer' entry: the checkpoint was saved without the "
                          "optimizer (--no-save-optim)", where)
    if not isinstance(opt, dict):
        raise FormatError(f"the common state's optimizer is a {type(opt).__name__}, not a dict", where)
    if opt and all(type(k) is int for k in opt):
        if not all(isinstance(v, dict) for v in opt.values()):
            raise FormatError("a ChainedOptimizer member in the common state is not a dict", where)
        return dict(sorted(opt.items()))
    return {None: opt}


def _sharding(member: dict) -> str:
    kind = member.get("param_state_sharding_type")
    if kind is None:
        return "non_distributed"
    if not isinstance(kind, str):
        raise FormatError(f"param_state_sharding_type is {kind!r}, not a name")
    return kind


def _chain(i: int | None) -> str:
    return "" if i is None else f"chained_{i}."


def _groups(dist: megatron_dist.MegatronDist, member: dict, i: int | None, sharding: str) -> list[dict]:
    """The member's param groups: in the common state (non-distributed, fully-reshardable types)
    or in the ShardedObject of each model-parallel rank (the others; all ranks must agree)."""
    inner = member.get("optimizer")
    if isinstance(inner, dict) and isinstance(inner.get("param_groups"), list):
        groups = inner["param_groups"]
    else:
        found = dist.objects_like(f"{_chain(i)}optimizer.distributed.dp_group_idx_", ".optimizer")
        if not found:
            raise FormatError(f"no param groups for the {sharding} optimizer{'' if i is None else f' member {i}'}: "
                              "neither in the common state nor as optimizer.distributed.dp_group_idx_*.optimizer",
                              dist.directory)
        values = [dist.object(k) for k in sorted(found)]
        groups = None
        for key, value in zip(sorted(found), values, strict=True):
            got = value.get("param_groups") if isinstance(value, dict) else None
            if not isinstance(got, list):
                raise FormatError(f"{key}: holds no param_groups list", dist.directory)
            if groups is None:
                groups = got
            elif [_identity(g) for g in got] != [_identity(g) for g in groups]:
                raise FormatError(f"{key}: the model-parallel ranks' param groups differ; statekit cannot tell "
                                  "which group a parameter of each rank is in", dist.directory)
    if not all(isinstance(g, dict) for g in groups):
        raise FormatError("a param group is not a dict", dist.directory)
    return groups


def _identity(group: dict) -> tuple:
    """How Megatron identifies a group on load (``param_group_identifier_keys``)."""
    return tuple(group.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr"))


def _step(member: dict, groups: list[dict], where: str) -> int | float | None:
    """The member's step: the groups' ``step`` (one value), else the non-distributed optimizer's
    ``common_step``."""
    steps = {g["step"] for g in groups if "step" in g and g["step"] is not None}
    inner = member.get("optimizer")
    common = inner.get("state", {}).get("common_step") if isinstance(inner, dict) and isinstance(
        inner.get("state"), dict) else None
    if isinstance(common, TensorRef):
        if common.shape not in ((), (1,)):
            raise FormatError(f"common_step has shape {list(common.shape)}, not a scalar", where)
        common = common.numpy().reshape(-1)[0].item()
    if common is not None:
        steps.add(common)
    values = {float(s) for s in steps if isinstance(s, int | float)}
    if len(values) > 1:
        raise FormatError(f"the param groups hold different steps {sorted(values)}", where)
    if not values:
        return None
    value = values.pop()
    return int(value) if value.is_integer() else value


# ----------------------------------------------------------------------------- groups by rule


def _group_of(name: str, shape: tuple[int, ...], groups: list[dict], args: dict, member: int | None) -> int:
    """The index of ``name``'s param group, by Megatron's ``_get_param_groups`` rule."""
    no_wd = name.endswith(".bias") or len(shape) == 1
    if args.get("apply_wd_to_qk_layernorm") and re.search(r"\.(q|k)_layernorm\.", name):
        no_wd = False
    expert = ".mlp.experts." in name and _experts_apart(args)
    decoupled = args.get("decoupled_lr") is not None and (
        name.startswith("embedding.") or name.startswith("output_layer."))
    fits = []
    for g, group in enumerate(groups):
        wd_mult = group.get("wd_mult")
        if wd_mult is None:
            continue
        if (wd_mult == 0.0) != no_wd:
            continue
        if bool(group.get("is_expert_parallel", False)) != expert:
            continue
        if bool(group.get("is_decoupled_lr", False)) != decoupled:
            continue
        fits.append(g)
    if len(fits) != 1:
        what = (f"{'no' if no_wd else 'with'} weight decay, {'expert' if expert else 'dense'}"
                f"{', decoupled lr' if decoupled else ''}")
        raise MappingError(f"{name}: {len(fits)} of the optimizer{'' if member is None else f' member {member}'}'s "
                           f"{len(groups)} param groups fit it ({what}); statekit cannot tell which group it is in")
    return fits[0]


def _experts_apart(args: dict) -> bool:
    """Whether the experts are expert-parallel parameters (``allreduce=False``: their own groups
    and optimizer member): megatron-core 0.19.2 marks them so only when EP > 1 or ETP ≠ TP
    (``tensor_parallel/layers.py`` ``use_expert_pgs``); at EP 1 they are dense parameters."""
    tp = args.get("tensor_model_parallel_size") or 1
    etp = args.get("expert_tensor_parallel_size")
    return (args.get("expert_model_parallel_size") or 1) > 1 or (etp is not None and etp != tp)


def _family(args: dict, groups: list[dict]) -> str | None:
    kind = args.get("optimizer", "adam")
    if kind != "adam":
        return "sgd" if kind == "sgd" else None
    modes = {g.get("adam_w_mode") for g in groups if "adam_w_mode" in g}
    if modes == {False} or args.get("decoupled_weight_decay") is False:
        return "adam"
    return "adamw"


def _hyper(group: dict) -> dict:
    """A group's hyperparameters: torch's names (lr, betas, eps, weight_decay) and Megatron's keys."""
    return {k: v for k, v in group.items() if k != "params"}


# ----------------------------------------------------------------------------- the reader


def _strip(key: str) -> tuple[str, bool]:
    if key.startswith(stacking.NEMO_PREFIX):
        return key[len(stacking.NEMO_PREFIX):], True
    return key, False


def _state_keys(entries: dict[str, dcp.TensorEntry], where: str) -> tuple[dict, dict, dict]:
    """{(member, model key): {slot: entry}}, {model key: entry}, {bucket-space key: entry}."""
    states: dict[tuple[int | None, str], dict[str, dcp.TensorEntry]] = {}
    model: dict[str, dcp.TensorEntry] = {}
    buckets: dict[str, dcp.TensorEntry] = {}
    for key, entry in entries.items():
        if _BUCKET_KEY.match(key):
            buckets[key] = entry
            continue
        if key.startswith("optimizer.") or re.match(r"chained_\d+\.", key):
            m = _STATE_KEY.match(key)
            slot = None
            if m:
                rest = f"{m.group(2)}.{m.group(3)}"
                slot = next((s for s in _STATE_SLOTS if rest.startswith(s + ".")), None)
            if slot is None:
                raise FormatError(f"{key}: an optimizer tensor statekit does not know (not optimizer.state.<slot>."
                                  "<param> nor optimizer.distributed.*)", where)
            member = None if m.group(1) is None else int(m.group(1))
            target = rest[len(slot) + 1:]
            states.setdefault((member, target), {})[slot] = entry
            continue
        model[key] = entry
    return states, model, buckets


def open_checkpoint(path: str, prove: str = "refuse", **options) -> Checkpoint:
    """Read a torch_dist checkpoint (the ``iter_N`` folder, its save root, a NeMo 2 checkpoint).

    ``prove``: ``"refuse"`` (default) raises on the first parameter whose master does not round
    to its stored weight; ``"report"`` keeps it and records the failure (``doctor``)."""
    if prove not in ("refuse", "report"):
        raise MappingError(f"prove={prove!r}: 'refuse' or 'report'")
    dist = megatron_dist.MegatronDist(path)
    try:
        return _read(dist, path, prove)
    except BaseException:
        dist.close()
        raise


def _one_sharding(members: dict, where: str) -> str:
    kinds = {_sharding(m) for m in members.values()}
    if len(kinds) > 1:
        raise FormatError(f"the optimizer's members use different sharding types {sorted(kinds)}", where)
    sharding = kinds.pop()
    if sharding in BUCKET_SPACE and sharding not in BUCKETS_READ:
        raise FormatError(f"the distributed optimizer's state is saved in bucket space ({sharding}); statekit "
                          f"reads {', '.join(BUCKETS_READ)} of the bucket-space types only yet (resave with "
                          "--dist-ckpt-optim-fully-reshardable to read it)", where)
    if sharding not in ("non_distributed", *MODEL_SPACE, *BUCKETS_READ):
        raise FormatError(f"optimizer sharding type {sharding!r} is not one statekit reads", where)
    return sharding


def _global_shape(dist: megatron_dist.MegatronDist, target: str, slots: dict, weight: dcp.TensorEntry | None,
                  where: str) -> tuple[int, ...]:
    """The model's global shape of ``target``'s states (reformulated ones by ``mcore_data``), the
    same for every slot and the weight."""
    shapes = {slot: dist.reformulated_shape(entry.key) or entry.shape for slot, entry in slots.items()}
    if len(set(shapes.values())) != 1:
        raise FormatError(f"{target}: its optimizer states have different global shapes "
                          f"{ {s: list(v) for s, v in shapes.items()} }", where)
    shape = next(iter(shapes.values()))
    if weight is not None and weight.shape != shape:
        raise FormatError(f"{target}: the optimizer state's global shape {list(shape)} is not the weight's "
                          f"{list(weight.shape)}", where)
    return shape


@dataclass
class _Reading:
    """What reading one checkpoint builds, parameter by parameter."""

    dist: megatron_dist.MegatronDist
    args: dict
    family: str | None
    member_groups: dict[int | None, list[dict]]
    steps: dict[int | None, int | float | None]
    container: MegatronDistCheckpoint
    params: list[ParamState] = field(default_factory=list)
    model: ModelInfo = field(default_factory=lambda: ModelInfo(order="named_parameters"))
    weights: dict[str, tuple[str, TensorRef]] = field(default_factory=dict)
    groups: list[ParamGroup] = field(default_factory=list)
    group_index: dict[tuple[int | None, int], int] = field(default_factory=dict)
    origin: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, gs in self.member_groups.items():
            for g, group in enumerate(gs):
                self.group_index[i, g] = len(self.groups)
                self.groups.append(ParamGroup(hyperparams=_hyper(group), family=self.family))

    def add_key(self, target: str, member: int | None, slots: dict, weight: dcp.TensorEntry | None) -> None:
        """Every parameter the (stacked) state key ``target`` holds."""
        where = self.dist.directory
        name_key, _ = _strip(target)
        shape = _global_shape(self.dist, target, slots, weight, where)
        _check_stack(name_key, shape, self.args, where)
        grouped = self.args.get("moe_grouped_gemm")
        for lead in stacking.indices(name_key, shape):
            name = stacking.param_name(name_key, lead, None if grouped is None else bool(grouped),
                                       self.args.get("transformer_impl"))
            if name in self.origin:
                raise FormatError(f"{name}: two state keys name this parameter ({self.origin[name][0]}, {target})",
                                  where)
            self.origin[name] = (target, lead)
            info = {"megatron_key": target, "stacked_index": list(lead)}
            refs = {}
            for slot, entry in slots.items():
                g_shape = self.dist.reformulated_shape(entry.key)
                refs[slot] = (regions.reformulated(self.dist.reader, entry, g_shape, lead, info) if g_shape
                              else regions.plain(self.dist.reader, entry, lead, info))
            master = next((refs.pop(s) for s in MASTERS if s in refs), None)
            self.add(name, name_key, shape[len(lead):], member, refs, master)
            if weight is not None:
                self.weights[name] = (target, regions.plain(self.dist.reader, weight, lead, info))

    def add(self, name: str, key: str, shape: tuple[int, ...], member: int | None, slots: dict,
            master: TensorRef | None) -> None:
        g = _group_of(name, shape, self.member_groups[member], self.args, member)
        gi = self.group_index[member, g]
        p = ParamState(key=name, path=name, index=len(self.params), step=self.steps[member], slots=slots, group=gi,
                       family=self.family)
        p.rank = len(shape)
        self.params.append(p)
        self.groups[gi].keys.append(p.key)
        if master is not None:
            p.slots[naming.MASTER_SLOT] = master
        vocab = self.args.get("vocab_size")
        if (key == INPUT_EMBEDDING and self.args.get("untie_embeddings_and_output_weights") is True
                and isinstance(vocab, int) and shape and shape[0] > vocab):
            self.container.padding[name] = (vocab, shape[0])


def _writers(where: str) -> int:
    """How many ranks wrote the DCP files (``__<rank>_<n>.distcp``): the world size of a run that
    stores none (Megatron-Bridge)."""
    ranks = {m.group(1) for m in (re.fullmatch(r"__(\d+)_\d+\.distcp", n) for n in os.listdir(where)) if m}
    if not ranks:
        raise FormatError("no __<rank>_<n>.distcp files: the world size is unknown", where)
    return len(ranks)


def _read(dist: megatron_dist.MegatronDist, path: str, prove: str) -> Checkpoint:
    where = dist.directory
    common = dist.common()
    bridge = common.get("args") is None and bridge_config.beside(where) is not None
    if bridge:
        common = {**common, "args": bridge_config.args_from_run_config(bridge_config.beside(where),
                                                                        _writers(where))}
    args = _fields(common.get("args"))
    members = _members(common, where)
    sharding = _one_sharding(members, where)
    states, model_entries, bucket_keys = _state_keys(dist.tensor_entries(), where)
    if bucket_keys and sharding not in BUCKET_SPACE:
        raise FormatError(f"{next(iter(bucket_keys))}: bucket-space optimizer state, but the common state says "
                          f"{sharding}", where)
    if sharding in BUCKET_SPACE and states:
        raise FormatError(f"{next(iter(states))[1]}: model-space optimizer state beside {sharding} buffers", where)
    member_groups = {i: _groups(dist, m, i, sharding) for i, m in members.items()}
    family = _family(args, [g for gs in member_groups.values() for g in gs])
    reading = _Reading(dist, args, family, member_groups,
                       {i: _step(m, member_groups[i], where) for i, m in members.items()},
                       MegatronDistCheckpoint(dist, sharding))
    reading.model.source = where
    member_of = _member_map(states, members, where)
    layout_notes: list[str] = []
    for (member, target), slots in sorted(states.items(), key=lambda kv: _order(kv[0][1], model_entries)):
        reading.add_key(target, member_of[member, target], slots, model_entries.get(target))
    if sharding in BUCKET_SPACE:
        cfg = config.from_args(common.get("args"), where) if common.get("args") is not None else None
        if cfg is None:
            raise FormatError(f"no args in the common state: the {sharding} buffers cannot be cut into parameters "
                              "without the run's settings", where)
        for member in members:
            chain = _chain(member)
            mine = {k: e for k, e in bucket_keys.items() if k.startswith(chain + "optimizer.")}
            expert = any(g.get("is_expert_parallel") for g in member_groups[member])
            for piece in bucket_space.read(dist, cfg, member, expert, mine, model_entries, sharding, layout_notes):
                reading.origin[piece.name] = (piece.key, piece.lead)
                reading.add(piece.name, _strip(piece.key)[0], piece.shape, member, piece.slots, piece.master)
                if piece.weight is not None:
                    reading.weights[piece.name] = (piece.key, piece.weight)
    params, model = reading.params, reading.model
    _named_order(params, model, reading.weights, list(model_entries), reading.origin,
                 args.get("transformer_impl") or "transformer_engine")
    proved, elements = _prove(params, model, reading.weights, reading.container, prove, where)
    state = OptimizerState(family=family, candidates=(family,) if family else (), params=params,
                           groups=reading.groups, hyperparams_stored=True, framework="torch",
                           torch_names_in_file=True, names_from=("parameter names from the torch_dist keys (stacked layers and experts unstacked with "
                                       "global indices); every fp32 master proved against its stored weight bit for bit"))
    nemo = any(k.startswith(stacking.NEMO_PREFIX) for k in model_entries)
    state.notes.append(_note(sharding, dist, nemo, len(members)))
    state.notes.extend(layout_notes)
    state.notes.append(f"proved: {proved} of {len(params)} parameters, {elements} elements (fp32 master rounded to "
                       "the weight's dtype == the stored weight)"
                       + (f"; {len(reading.container.disproofs)} did not prove" if reading.container.disproofs else ""))
    ckpt = Checkpoint(path=path, format=FORMAT, kind="optimizer", optimizer=state, model=model,
                      container=reading.container)
    ckpt.n_tensors = sum(len(p.slots) for p in params)
    ckpt.nbytes = sum(p.nbytes for p in params)
    ckpt.metadata.update(_metadata(dist, common, args, sharding, members))
    scheduler = common.get("opt_param_scheduler")
    position = bridge_state.find(where, dist.path) if bridge else None
    if position is not None:
        bridge_state.check(position, common.get("iteration"), scheduler,
                           common.get("num_floating_point_operations_so_far"))
        bridge_state.attach(ckpt, position, args)
        reading.container.position_disagreements = list(position.disagreements)
    if isinstance(scheduler, dict):
        ckpt.schedulers = [{"kind": "megatron opt_param_scheduler (units: samples)", **describe_scheduler(scheduler)}]
        from statekit.frameworks import schedule_megatron

        schedule_megatron.attach(ckpt, scheduler, args, common.get("iteration"), "common state")
    if isinstance(common.get("iteration"), int):
        ckpt.scalars["iteration"] = common["iteration"]
    return ckpt


def _named_order(params: list[ParamState], model: ModelInfo, weights: dict, keys: list[str], origin: dict,
                 impl: str) -> None:
    """Parameters in ``named_parameters`` order: Megatron's registration order where statekit
    knows it (:func:`.bucket_space.rank_of`), else the embedding side, each layer's parameters in
    the order of their keys, what comes after; the model (the stored weights) in the same order."""
    stacked = [i for i, k in enumerate(keys) if "layers." in k]
    first, last = (stacked[0], stacked[-1]) if stacked else (len(keys), len(keys))

    def rank(p: ParamState) -> tuple:
        known = bucket_space.rank_of(p.path, impl)
        if known is not None:
            return known
        key, lead = origin[p.path]
        pos = keys.index(key) if key in keys else len(keys)
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", p.path)
        section = 0 if pos < first else 2 if pos > last else 1
        return (section, int(layer.group(1)) if layer and section == 1 else -1, 1000 + pos, lead)

    params.sort(key=rank)
    for i, p in enumerate(params):
        p.index = i
    model.params = [ModelParam(p.path, tuple(weights[p.path][1].shape), weights[p.path][1].dtype, index=p.index,
                               tensor=weights[p.path][1]) for p in params if p.path in weights]


def _member_map(states: dict, members: dict, where: str) -> dict[tuple[int | None, str], int | None]:
    """Which optimizer member each state key belongs to: its ``chained_i.`` prefix, or (without
    prefixes, fully-reshardable types from core 0.14) dense vs expert parameters."""
    out = {}
    keys = sorted(members, key=lambda k: -1 if k is None else k)
    for member, target in states:
        if member is not None:
            if member not in members:
                raise FormatError(f"chained_{member}. keys, but the common state has no member {member}", where)
            out[member, target] = member
        elif keys == [None]:
            out[member, target] = None
        else:  # dense first, expert second (Megatron's get_megatron_optimizer order)
            if len(keys) != 2:
                raise FormatError(f"{target}: a ChainedOptimizer of {len(keys)} members and state keys without "
                                  "chained_i. prefixes: statekit cannot tell which member holds it", where)
            out[member, target] = keys[1] if stacking.EXPERTS in target else keys[0]
    return out


def _order(target: str, model_entries: dict) -> tuple[int, str]:
    keys = list(model_entries)
    return (keys.index(target) if target in model_entries else len(keys), target)


def _check_stack(key: str, shape: tuple[int, ...], args: dict, where: str) -> None:
    axes = stacking.stack_axes(key)
    for axis, (what, arg) in enumerate((a, {"layer": "num_layers", "expert": "num_experts"}[a]) for a in axes):
        want = args.get(arg)
        if key.startswith("mtp.") and what == "layer":
            want = args.get("mtp_num_layers")
        if isinstance(want, int) and shape[axis] != want:
            raise FormatError(f"{key}: its stacked {what} axis has {shape[axis]} entries, args.{arg} is {want}", where)


def _prove(params, model: ModelInfo, weights: dict, container: MegatronDistCheckpoint, prove: str,
           where: str) -> tuple[int, int]:
    """Every master against its stored weight (:func:`.proof.prove`); refused, or recorded.
    ``--jobs`` proofs at a time (threads: numpy and ``pread`` release the GIL); the outcomes are
    taken in parameter order, so the first failure named does not depend on timing.
    Returns the parameters and elements proved."""
    rule = f"{PROOF_RULE} ({container.sharding})"
    pending = []
    for p in params:
        master = p.slots.get(naming.MASTER_SLOT)
        if p.path in weights and master is not None:
            pending.append((p.path, weights[p.path][0], master, weights[p.path][1]))
    proved = elements = 0
    for (path, key, _, _), outcome in zip(pending, proof.run_all(
            [(path, master, weight, rule, where) for path, _, master, weight in pending]), strict=True):
        if isinstance(outcome, proof.ProofError):
            if prove == "refuse":
                raise proof.ProofError(f"{outcome.message}, so its state is not this parameter's"
                                       f"{_cause(container.sharding)}", where) from None
            container.disproofs.append(Disproved(path, key, outcome.message, container.sharding))
            continue
        elements += outcome
        proved += 1
    return proved, elements


def _cause(sharding: str) -> str:
    if sharding == "fully_reshardable":
        return (" (a fully_reshardable save of mcore 0.15-0.19 with more than one bucket shifts the states after "
                f"bucket 0; fixed in Megatron-LM {MULTI_BUCKET_FIX}; `statekit doctor` lists every parameter hit)")
    return ""


def _note(sharding: str, dist: megatron_dist.MegatronDist, nemo: bool, members: int) -> str:
    parts = [f"Megatron torch_dist checkpoint, distributed-optimizer sharding {sharding}"]
    if members > 1:
        parts.append(f"a ChainedOptimizer of {members} members")
    if dist.mcore_data:
        parts.append(f"{len(dist.mcore_data)} tensors N-D reformulated (mcore_data)")
    if nemo:
        parts.append("NeMo 2 'module.' prefix dropped from the names")
    return "; ".join(parts)


def _metadata(dist, common: dict, args: dict, sharding: str, members: dict) -> dict[str, str]:
    """What ``inspect`` shows of the run, keyed as the legacy reader keys it (``megatron.*``)."""
    out = {"megatron.format": "torch_dist", "megatron.sharding": sharding, "megatron.common": dist.common_source,
           "megatron.folder": os.path.relpath(dist.directory, dist.path) if dist.directory != dist.path else "."}
    for key, name in (("iteration", "iteration"), ("checkpoint_version", "checkpoint_version"),
                      ("num_floating_point_operations_so_far", "flops_so_far"), ("global_step", "global_step")):
        if key in common and isinstance(common[key], int | float | str):
            out[f"megatron.{name}"] = str(common[key])
    if common.get("args") is not None:
        cfg = config.from_args(common["args"], dist.directory)
        out.update(cfg.facts())
        for arg, since in cfg.version_signals().items():
            out[f"megatron.signal.{arg}"] = since
    content = common.get("content_metadata")
    if isinstance(content, dict):
        for k, v in content.items():
            if isinstance(v, bool | int | float | str):
                out[f"megatron.content_metadata.{k}"] = str(v)
    for k, v in dist.backend.items():
        out[f"megatron.metadata_json.{k}"] = str(v)
    if len(members) > 1:
        out["megatron.chained_members"] = str(len(members))
    scheduler = common.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        for k in ("num_steps", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
            if k in scheduler:
                out[f"megatron.scheduler.{k}"] = str(scheduler[k])
    return out
