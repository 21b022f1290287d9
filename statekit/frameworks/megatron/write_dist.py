"""Megatron-Core torch_dist checkpoints written by statekit: a Megatron run's optimizer moved to
another tensor / pipeline / data-parallel size (``statekit convert SRC OUT --to megatron --tp N``).

torch_dist stores every tensor *globally* (``shared/docs/megatron-formats.md`` §2.1–2.4): the TP,
PP and DP split lives only in the DCP chunks, which Megatron's load re-cuts for whatever run loads
it. A model-space optimizer (``fully_reshardable``) stores ``optimizer.state.{param,exp_avg,
exp_avg_sq}.<model key>`` with the model key's own global shape, so a change of TP/PP/DP is:

- the same global tensors, each written as one DCP chunk (:func:`statekit.formats.dcp.save`);
  the optimizer's tensors re-stacked from the parameters the reader named and proved
  (:mod:`.dist`: a ``dp_reshardable`` source's buckets are cut back into parameters there), one
  layer's piece at a time;
- the vocabulary-padded rows (``embedding.word_embeddings.weight``, ``output_layer.weight``,
  their states) padded or cut to the target's ``padded_vocab_size`` (a multiple of
  ``make_vocab_size_divisible_by × TP``, §4.4): new rows are zero (what Megatron's own load does
  for ``allow_shape_mismatch`` tensors); rows cut are beyond ``args.vocab_size``, and the result
  says whether they held values;
- the common state (core 0.19's ``common_state`` item, or ``common.pt`` before): the source's,
  with ``args``' parallel sizes (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
  ``data_parallel_size``, ``world_size``, ``padded_vocab_size``…) set to the target's, and the
  optimizer part in the fully_reshardable form (its param groups; ``param_state_sharding_type``;
  ``content_metadata``'s ``distrib_optim_sharding_type``). Megatron's ``load_checkpoint`` reads
  the TP/PP of the checkpoint from these args (``ckpt_tp_pp``) and accepts a TP/PP change for
  this sharding type;
- ShardedObjects copied byte for byte where the target run asks for them: the layers'
  ``_extra_state``; ``rng_state`` only at the source's TP/PP. Since ``args`` name the target's
  sizes, Megatron would ask for the RNG state of each target rank, which no source rank had:
  ``args.no_save_rng`` is set instead (Megatron's load then skips it, as it does after a TP/PP
  change it sees). ``rerun_state_machine_state`` and the common state's ``rerun_state_machine``
  only at the same world, TP, PP and DP.

``--sharding dp_reshardable`` (dense, any TP and PP): the same model tensors, and per
model-parallel rank, buffer and bucket the 1-D
``optimizer.distributed.dp_group_idx_{mp}.gbuf_idx_{g}.dtype_(…).bucket_idx_{b}.{slot}`` holding
the rank's stage's parameters in TP-local shapes as the target DP lays the bucket out, beside
them the ShardedObjects ``.optimizer`` (the param groups), ``.per_bucket_numel`` and
``.per_bucket_numel_unpadded``: :mod:`.write_buckets`. Written at a source's own sizes it gives
megatron-core's own dp_reshardable tensors and objects back bit for bit.

The iteration folder is written under a temporary name and renamed when complete (``metadata.json``
last, then ``latest_checkpointed_iteration.txt``): nothing partial is left under its real name.
A MoE run (a ChainedOptimizer's dense + expert members) and an EP change: :mod:`.write_moe`.
Refused in one line: virtual pipelines, ``dp_reshardable`` output with tied embeddings at PP > 1
or with experts beyond EP = TP = PP = 1 (:func:`.write_buckets.check`), the non-distributed optimizer.

A legacy source (``--ckpt-format torch`` with ``distrib_optim.pt``) is read by
:mod:`.legacy` (TP shards joined, layer indices global, masters proved) and stacked into the
torch_dist keys (:func:`_legacy_key`); its tied output copy (PP > 1) is stored once when it equals
the embedding bit for bit, the layers' ``_extra_state`` (None in the local spec) written as their
ShardedObjects, ``args.ckpt_format`` set to ``torch_dist``, no RNG state carried.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from statekit import dtypes, naming, stream
from statekit.atomic import atomic_write
from statekit.errors import FormatError, MappingError, UsageError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import Record
from statekit.frameworks.megatron import bridge_config, config, stacking, write_buckets, write_moe
from statekit.frameworks.megatron import dist as dist_reader
from statekit.frameworks.megatron.write_buckets import sharded_object as _object
from statekit.tensor import TensorRef, extend_runs, file_runs, prefix_runs

SHARDINGS = ("fully_reshardable", "dp_reshardable")
LATER: tuple[str, ...] = ()
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
SLOTS = (("param", naming.MASTER_SLOT), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
_PIECE = 8 << 20


@dataclass
class Target:
    """The run that will load the checkpoint: its parallel sizes (None: the source's)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    sharding: str = "fully_reshardable"
    cp: int | None = None  # the context-parallel size (the distributed optimizer shards over DP x CP)
    ep: int | None = None


@dataclass
class Written:
    """What :func:`write` wrote and what it did to get there (for the CLI's closing lines)."""

    path: str
    iteration: int | str
    sizes: dict[str, int]
    tensors: int = 0
    nbytes: int = 0
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- tensors


def _rows(ref: TensorRef, rows: int) -> TensorRef:
    """``ref`` with its first axis padded with zero rows, or cut, to ``rows`` (streamed)."""
    have = ref.shape[0]
    if rows == have:
        return ref
    row = int(np.prod(ref.shape[1:], dtype=np.int64)) * dtypes.itemsize(ref.dtype)
    keep = min(rows, have) * row

    def pieces(size: int):
        left = keep
        for piece in ref.iter_bytes(size):
            if left <= 0:
                break
            piece = piece[:left]
            left -= len(piece)
            yield piece
        extra = (rows - have) * row if rows > have else 0
        while extra > 0:
            n = min(size, extra)
            yield bytes(n)
            extra -= n

    def runs():  # the first rows' runs, then the padding rows' zeros
        spans = file_runs(ref)
        if spans is None:
            return None
        return prefix_runs(spans, keep) + ([(rows - have) * row] if rows > have else [])

    return TensorRef(ref.dtype, (rows, *ref.shape[1:]), chunk_reader=pieces, info=dict(ref.info), runs=runs)


def _stacked(parts: list[TensorRef], lead_shape: tuple[int, ...], key: str) -> TensorRef:
    """One tensor of shape ``lead_shape + part shape`` from the parts in C order of the lead axes."""
    first = parts[0]
    for p in parts:
        if p.shape != first.shape or p.dtype != first.dtype:
            raise MappingError(f"{key}: its parameters' states differ in shape or dtype "
                               f"({p.dtype} {list(p.shape)} vs {first.dtype} {list(first.shape)})")
    if not lead_shape:
        return first

    def pieces(size: int):
        for p in parts:
            yield from p.iter_bytes(size)

    def runs():
        spans = []
        for p in parts:
            got = file_runs(p)
            if got is None:
                return None
            extend_runs(spans, got)
        return spans

    return TensorRef(first.dtype, (*lead_shape, *first.shape), chunk_reader=pieces, info={"parts": parts}, runs=runs)


def _held_rows(ref: TensorRef, start: int) -> bool:
    """Whether rows ``start:`` of ``ref`` hold anything but zeros (the rows a cut drops)."""
    row = int(np.prod(ref.shape[1:], dtype=np.int64))
    skip, seen = start * row, 0
    for piece in ref.pieces(1 << 20):
        lo = max(0, skip - seen)
        seen += piece.size
        if lo < piece.size and np.any(piece[lo:] != 0):
            return True
    return False


# ----------------------------------------------------------------------------- args


def _target_sizes(cfg: config.MegatronConfig, target: Target, where: str) -> dict[str, int]:
    tp = target.tp or cfg.need("tp", "the source's tensor-parallel size")
    pp = target.pp or cfg.need("pp", "the source's pipeline-parallel size")
    dp = target.dp or cfg.need("dp", "the source's data-parallel size")
    cp = config.target_cp(cfg, target.cp, where)
    for name, value in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if value < 1:
            raise UsageError(f"{name} {value}: a parallel size is at least 1")
    if cfg.vp not in (None, 1):
        raise MappingError(f"args.virtual_pipeline_model_parallel_size is {cfg.vp}: statekit does not write "
                           "interleaved-pipeline checkpoints yet", where)
    layers = cfg.need("num_layers", "the pipeline split")
    if layers % pp:
        raise UsageError(f"--pp {pp}: num_layers {layers} is not divisible by it (Megatron's even split)")
    for name, value in (("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", cfg.num_query_groups),
                        ("ffn_hidden_size", cfg.ffn_hidden_size)):
        if value is not None and value % tp:
            raise UsageError(f"--tp {tp}: {name} {value} is not divisible by it (Megatron refuses such a run)")
    vocab = cfg.need("vocab_size", "the vocabulary padding of the target TP")
    divisible = cfg.need("make_vocab_size_divisible_by", "the vocabulary padding of the target TP")
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "world_size": tp * pp * dp * cp,
            "padded_vocab_size": config.padded_vocab(vocab, divisible, tp),
            **write_moe.sizes(cfg, target.ep, tp, pp, dp, where)}


def _args(args: Record, cfg: config.MegatronConfig, sizes: dict[str, int], sharding: str) -> Record:
    fields = dict(args.fields)
    fields.update({
        "tensor_model_parallel_size": sizes["tp"],
        "pipeline_model_parallel_size": sizes["pp"],
        "data_parallel_size": sizes["dp"],
        "context_parallel_size": sizes["cp"],
        "world_size": sizes["world_size"],
        "padded_vocab_size": sizes["padded_vocab_size"],
        "use_distributed_optimizer": True,
        "dist_ckpt_optim_fully_reshardable": sharding == "fully_reshardable",
    })
    # sizes Megatron derives from TP/PP at start-up, where the source has them
    if fields.get("expert_tensor_parallel_size") == cfg.tp:
        fields["expert_tensor_parallel_size"] = sizes["tp"]
    if "expert_model_parallel_size" in fields or sizes["ep"] != 1:
        fields["expert_model_parallel_size"] = sizes["ep"]
    if "transformer_pipeline_model_parallel_size" in fields:
        fields["transformer_pipeline_model_parallel_size"] = sizes["pp"]
    return Record(args.cls, fields)


# ----------------------------------------------------------------------------- writing


@dataclass
class _Source:
    """What writing needs of a source checkpoint, torch_dist or legacy, all global."""

    where: str
    folder: str  # the iteration folder's name
    common: dict  # for writing again (args a Record, Megatron's enums kept)
    cfg: config.MegatronConfig
    sharding: str  # the source's optimizer sharding type
    groups: list[dict]
    model: dict[str, dcp.TensorEntry]  # model key -> its global dtype and shape
    weights: dict[str, TensorRef]
    states: dict[str, dict[str, TensorRef]]  # model key -> slot -> stacked state
    objects: dict[str, dcp.RawBytes] = field(default_factory=dict)  # ShardedObjects to carry, by DCP key
    backend: dict = field(default_factory=dict)
    common_pt: bool = False  # the common state as common.pt (core <= 0.18) rather than the common_state item
    rng_kept: bool = True  # the source's RNG states are torch_dist ShardedObjects (kept at the same TP/PP)
    notes: list[str] = field(default_factory=list)
    members: list[list[dict]] | None = None  # a MoE run's optimizer members' groups (:mod:`.write_moe`)
    used: dict[int, set[bool]] = field(default_factory=dict)  # one member's groups: dense / expert params in it


def write(src: str, dst: str, target: Target, shards: int | None = None) -> Written:
    """Write the Megatron checkpoint ``src`` (torch_dist or legacy; a save root or an ``iter_N``
    folder) as torch_dist into the save root ``dst`` for the run ``target`` describes."""
    if target.sharding not in SHARDINGS:
        raise UsageError(f"--sharding {target.sharding!r}: one of {', '.join(SHARDINGS)}")
    if megatron_dist.resolve(src) is None:
        from statekit.frameworks.megatron import legacy  # noqa: PLC0415 (same floor)

        ckpt = legacy.open_checkpoint(src)
        return _write(_from_legacy(ckpt, src), dst, target, shards)
    ckpt = dist_reader.open_checkpoint(src)
    try:
        return _write(_from_dist(ckpt), dst, target, shards)
    finally:
        ckpt.container.close()


def _namespace(common: dict, where: str) -> Record:
    args = common.get("args")
    if not isinstance(args, Record) or args.cls != megatron_dist.NAMESPACE:
        if args is None and bridge_config.beside(where):
            raise MappingError("a Megatron-Bridge folder (its settings in run_config.yaml, no args in the common "
                               "state): a Megatron-LM torch_dist folder needs an args Namespace that Megatron's "
                               "load_checkpoint accepts, which statekit does not synthesize from run_config.yaml; "
                               "--to hf-trainer reads this folder", where)
        raise FormatError("the common state has no args Namespace: the target run's sizes cannot be written", where)
    return args


def _from_dist(ckpt) -> _Source:
    dist: megatron_dist.MegatronDist = ckpt.container.dist
    where = dist.directory
    common = dist.common_to_rewrite()
    cfg = config.from_args(_namespace(common, where), where)
    members = dist_reader._members(dist.common(), where)
    sharding = ckpt.container.sharding
    if sharding == "non_distributed":
        raise MappingError("the source's optimizer is not Megatron's distributed optimizer (no fp32 master "
                           "'param' slot to write): not written yet", where)
    member_groups = [[{k: v for k, v in g.items() if k != "params"} for g in dist_reader._groups(dist, m, i, sharding)]
                     for i, m in members.items()]
    groups = member_groups[0]
    model = {k: e for k, e in dist.tensor_entries().items() if not k.startswith(("optimizer.", "chained_"))}
    args = dist_reader._fields(dist.common().get("args"))
    states = _optimizer_tensors(ckpt.optimizer.params, model, args, where)
    objects = {}
    for key, entry in dist.meta.entries.items():
        if not isinstance(entry, dcp.BytesEntry):
            continue
        base = key.split("/shard_", 1)[0]
        if base == megatron_dist.COMMON_STATE or base.startswith(("optimizer.", "chained_")):
            continue  # rewritten / the source's optimizer, converted
        if not (base.endswith("._extra_state") or base in ("rng_state", "rerun_state_machine_state")):
            raise MappingError(f"ShardedObject {key}: statekit does not know whether the target run needs it", where)
        objects[key] = dist.raw_object(key)
    moe = (len(member_groups) > 1 or bool(cfg.num_experts)) or None
    return _Source(where, os.path.basename(where.rstrip(os.sep)), common, cfg, sharding, groups, model,
                   {k: dist.reader.tensor(e) for k, e in model.items()}, states, objects, dict(dist.backend),
                   dist.common_source == megatron_dist.COMMON_PT, members=moe and member_groups,
                   used=write_moe.groups_used(ckpt.optimizer) if moe else {})


def _write(source: _Source, dst: str, target: Target, shards: int | None) -> Written:
    where, common, cfg = source.where, source.common, source.cfg
    args = _namespace(common, where)
    sizes = _target_sizes(cfg, target, where)
    notes: list[str] = list(source.notes)
    iteration = common.get("iteration")
    folder_name = source.folder
    out_folder = os.path.join(dst, folder_name)
    if os.path.exists(out_folder):
        raise UsageError(f"{out_folder} exists already; choose an empty save root")
    if os.path.abspath(dst) == os.path.abspath(os.path.dirname(where)):
        raise UsageError("the output save root is the source's")

    flat: dict[str, object] = {}
    model_space: dict[str, dict[str, TensorRef]] = {}
    states = dict(source.states)
    rows = sizes["padded_vocab_size"]
    for key in source.model:
        ref = source.weights[key]
        name_key, _ = dist_reader._strip(key)
        if name_key in VOCAB_KEYS:
            notes.extend(_vocab_note(key, ref, rows, cfg))
            ref = _rows(ref, rows)
        flat[key] = ref
        resized = {slot: _rows(stacked, rows) if name_key in VOCAB_KEYS else stacked
                   for slot, stacked in states.pop(key, {}).items()}
        if target.sharding == "fully_reshardable":
            for slot, stacked in resized.items():
                flat[f"optimizer.state.{slot}.{key}"] = stacked
        else:
            model_space[key] = resized
    if states:
        raise MappingError(f"optimizer state for {next(iter(states))}, which the checkpoint's model does not hold", where)

    same_tp_pp = source.rng_kept and (sizes["tp"], sizes["pp"], sizes["ep"]) == (cfg.tp, cfg.pp, cfg.ep or 1)
    same_world = same_tp_pp and sizes["dp"] == cfg.dp and sizes["world_size"] == cfg.world_size
    for key, raw in source.objects.items():
        base = key.split("/shard_", 1)[0]
        if base == "rng_state" and not same_tp_pp or base == "rerun_state_machine_state" and not same_world:
            continue
        flat[key] = raw
    if not same_tp_pp:
        notes.append("rng_state not carried (the source's TP/PP/EP ranks are not the target's): args.no_save_rng set, "
                     "so Megatron starts the RNG afresh as after any TP/PP change")
    if not same_world:
        notes.append("rerun state not carried (other ranks): Megatron ignores it then")

    groups = source.groups
    new_args = _args(args, cfg, sizes, target.sharding)
    members = write_moe.target(source.members, source.used, sizes, target.sharding, notes, where)
    if target.sharding == "dp_reshardable":
        target_model = {k: dataclasses.replace(e, shape=(rows, *e.shape[1:])) if dist_reader._strip(k)[0] in VOCAB_KEYS
                        else e for k, e in source.model.items()}
        flat.update(write_buckets.write(target_model, config.from_args(new_args, where), model_space, groups, where))
    new_common = _new_common(common, new_args, target, members or [groups], same_tp_pp, same_world)
    legacy_common = source.common_pt
    if not legacy_common:
        flat[f"{megatron_dist.COMMON_STATE}/shard_0_1"] = dcp.RawBytes(megatron_dist.common_archive([new_common]))

    nbytes = _save(dst, folder_name, flat, shards, source, new_common, legacy_common, iteration)
    n_tensors = sum(isinstance(v, TensorRef) for v in flat.values())
    changed = ", ".join(f"{k.upper()} {getattr(cfg, k) or 1} → {sizes[k]}" for k in ("tp", "pp", "ep", "dp", "cp")
                        if (getattr(cfg, k) or 1) != sizes[k]) or "sizes unchanged"
    notes.insert(0, f"{source.sharding} → {target.sharding}; {changed}; padded vocabulary {cfg.padded_vocab_size} → {rows}")
    return Written(out_folder, iteration, sizes, n_tensors, nbytes, notes)


def _new_common(common: dict, new_args, target: Target, members, same_tp_pp: bool, same_world: bool) -> dict:
    """The target's common state: the source's, with the target's args, optimizer skeleton and content metadata."""
    new_common = dict(common)
    new_common["args"] = new_args
    if not same_tp_pp:  # the args name the target's sizes: without this Megatron would ask for its RNG states
        new_common["args"].fields["no_save_rng"] = True
    if not same_world:
        new_common.pop("rerun_state_machine", None)
    if target.sharding == "fully_reshardable":
        new_common["optimizer"] = write_moe.common_optimizer(members, target.sharding)
    else:  # the groups are each model-parallel rank's ShardedObject
        new_common["optimizer"] = {"param_state_sharding_type": target.sharding}
    content = dict(common.get("content_metadata") or {})
    content["distrib_optim_sharding_type"] = target.sharding
    if target.sharding == "fully_reshardable":
        content.setdefault("distrib_optim_fully_reshardable_mem_efficient", False)
    else:
        content.pop("distrib_optim_fully_reshardable_mem_efficient", None)
    content.setdefault("singleton_local_shards", False)
    content.setdefault("chained_optim_avoid_prefix", True)
    new_common["content_metadata"] = content
    return new_common


def _save(dst: str, folder_name: str, flat: dict, shards: int | None, source: _Source, new_common: dict,
          legacy_common: bool, iteration) -> int:
    """The iteration folder written in a temporary sibling and renamed into place, then the tracker file."""
    os.makedirs(dst, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{folder_name}.", suffix=".tmp", dir=dst)
    try:
        nbytes = dcp.save(tmp, flat, shards=shards)
        if legacy_common:
            with atomic_write(os.path.join(tmp, megatron_dist.COMMON_PT)) as fh:
                megatron_dist.torch_pt.write_pt_stream(fh, new_common, "common", dumps=megatron_dist.dumps_common)
        with atomic_write(os.path.join(tmp, megatron_dist.METADATA_JSON)) as fh:  # last: marks it complete
            fh.write(json.dumps(source.backend or {"sharded_backend": "torch_dist", "sharded_backend_version": 1}).encode())
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 is not a checkpoint's
        os.rename(tmp, os.path.join(dst, folder_name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tracker = "release" if folder_name == "release" else str(iteration)
    with atomic_write(os.path.join(dst, megatron_dist.TRACKER)) as fh:
        fh.write(tracker.encode())
    return nbytes


def _vocab_note(key: str, ref: TensorRef, rows: int, cfg: config.MegatronConfig) -> list[str]:
    have = ref.shape[0]
    if rows > have:
        return [f"{key}: rows {have}..{rows - 1} added, zero (vocabulary padding for the target TP)"]
    if rows < have:
        held = _held_rows(ref, rows)
        return [f"{key}: rows {rows}..{have - 1} cut (beyond vocab_size {cfg.vocab_size}, padding at the source's "
                f"TP){'; they held nonzero values, as Megatron trains padding rows' if held else ', all zero'}"]
    return []


def _optimizer_tensors(params: list, model: dict[str, dcp.TensorEntry], args: dict,
                       where: str) -> dict[str, dict[str, TensorRef]]:
    """{model key: {slot: stacked global tensor}} from the named, proved parameters."""
    grouped = args.get("moe_grouped_gemm")
    impl = args.get("transformer_impl")
    by_name = {p.key: p for p in params}
    used: set[str] = set()
    out: dict[str, dict[str, TensorRef]] = {}
    for key, entry in model.items():
        name_key, _ = dist_reader._strip(key)
        leads = stacking.indices(name_key, entry.shape)
        names = [stacking.param_name(name_key, lead, None if grouped is None else bool(grouped), impl) for lead in leads]
        found = [n for n in names if n in by_name]
        if not found:
            raise MappingError(f"{key}: no optimizer state for it in the source (a frozen parameter or a buffer): "
                               "statekit does not write those yet", where)
        if len(found) != len(names):
            missing = next(n for n in names if n not in by_name)
            raise MappingError(f"{key}: {missing} has no optimizer state, its stack's other parameters do", where)
        lead_shape = entry.shape[:len(stacking.stack_axes(name_key))]
        slots = {}
        for slot, ours in SLOTS:
            parts = []
            for n in names:
                ref = by_name[n].slots.get(ours)
                if ref is None:
                    raise MappingError(f"{n}: no {ours} state to write as {slot}", where)
                parts.append(ref)
            stacked = _stacked(parts, lead_shape, key)
            if stacked.shape != entry.shape:
                raise MappingError(f"{key}: its {slot} state is {list(stacked.shape)}, the weight {list(entry.shape)}",
                                   where)
            slots[slot] = stacked
        extra = set().union(*(by_name[n].slots for n in names)) - {ours for _, ours in SLOTS}
        if extra:
            raise MappingError(f"{names[0]}: state {sorted(extra)} has no place in a fully_reshardable checkpoint", where)
        used.update(names)
        out[key] = slots
    left = [p.key for p in params if p.key not in used]
    if left:
        raise MappingError(f"{left[0]}: its optimizer state belongs to no model tensor of the checkpoint", where)
    return out



# ----------------------------------------------------------------------------- legacy sources

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_KEPT_COMMON = ("args", "checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far")


def _legacy_key(name: str, impl: str | None) -> tuple[str, tuple[int, ...]]:
    """The torch_dist key and stacked index of a legacy parameter name (global layer index), the
    inverse of :func:`.stacking.param_name` for a homogeneous dense decoder."""
    m = _LAYER.match(name)
    if m is None:
        return name, ()
    rest = m.group(2)
    if impl == "local":
        for saved, own in stacking.LOCAL_SPEC_KEYS.items():
            if rest.startswith(own):
                rest = saved + rest[len(own):]
                break
    return f"decoder.layers.{rest}", (int(m.group(1)),)


def _from_legacy(ckpt, src: str) -> _Source:
    """A legacy (``--ckpt-format torch``) checkpoint, as the reader joined it (TP shards joined,
    layer indices global, every master proved), for writing as torch_dist."""
    from statekit.formats import megatron_legacy, torch_pt  # noqa: PLC0415 (same floor)

    folder = megatron_legacy.iteration_dir(src)
    ranks = megatron_legacy.rank_dirs(folder)
    first_file = os.path.join(folder, ranks[0], megatron_legacy.MODEL_FILE)
    top = torch_pt.load_pt(first_file, megatron_dist.REWRITE_GLOBALS)
    common = {k: top[k] for k in _KEPT_COMMON if k in top}
    cfg = config.from_args(_namespace(common, first_file), first_file)
    if cfg.num_experts or (cfg.ep or 1) > 1:
        raise MappingError("a MoE run (experts, a dense + expert ChainedOptimizer): statekit does not write its "
                           "torch_dist optimizer yet", folder)
    if not cfg.use_distributed_optimizer:
        raise MappingError("the source's optimizer is not Megatron's distributed optimizer (no fp32 master "
                           "'param' slot to write): not written yet", folder)
    plain = megatron_legacy.load(first_file)
    opt = plain.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("optimizer", {}).get("param_groups"), list):
        raise FormatError("optimizer.optimizer.param_groups is not here (a ChainedOptimizer's list?): not written yet",
                          first_file)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["optimizer"]["param_groups"]]
    impl = cfg.transformer_impl
    layers = cfg.need("num_layers", "stacking the layers")
    by_name = {p.path: p for p in ckpt.model.params}
    params = {p.key: p for p in ckpt.optimizer.params}
    notes = []
    tied = cfg.untie_embeddings is False
    if tied and "output_layer.weight" in params:  # the last stage's copy (PP > 1): kept only if identical
        a, b = params.pop("output_layer.weight"), params["embedding.word_embeddings.weight"]
        same = set(a.slots) == set(b.slots) and all(stream.same_bytes(a.slots[s], b.slots[s]) for s in b.slots)
        same = same and stream.same_bytes(by_name["output_layer.weight"].tensor,
                                          by_name["embedding.word_embeddings.weight"].tensor)
        if not same:
            raise MappingError("tied embeddings with PP > 1: the last stage's output_layer.weight copy holds other "
                               "values or state than embedding.word_embeddings.weight; torch_dist keeps one", folder)
        by_name.pop("output_layer.weight")
        notes.append("output_layer.weight (the last stage's copy of the tied embedding) equals "
                     "embedding.word_embeddings.weight bit for bit, weight and state: stored once, as torch_dist does")
    stacks: dict[str, dict[tuple[int, ...], str]] = {}
    for name in by_name:
        key, lead = _legacy_key(name, impl)
        stacks.setdefault(key, {})[lead] = name
    model: dict[str, dcp.TensorEntry] = {}
    weights: dict[str, TensorRef] = {}
    for key, found in stacks.items():
        leads = sorted(found)
        if leads != [()] and leads != [(i,) for i in range(layers)]:
            raise MappingError(f"{key}: layers {[lead[0] for lead in leads]} hold it, not all {layers}: not a "
                               "homogeneous decoder statekit stacks", folder)
        refs = [by_name[found[lead]].tensor for lead in leads]
        weight = _stacked(refs, (layers,) if leads != [()] else (), key)
        model[key] = dcp.TensorEntry(key, weight.dtype, weight.shape, [])
        weights[key] = weight
    states = _optimizer_tensors(list(params.values()), model, dict(_namespace(common, first_file).fields), folder)
    objects = {}
    for k, v in plain.get("model", {}).items():
        m = _LAYER.match(k)
        if m and k.endswith("._extra_state"):
            if v is not None:
                raise MappingError(f"{k}: extra state {type(v).__name__} (Transformer Engine's?): not written yet",
                                   first_file)
            for layer in range(layers):
                objects[f"decoder.layers.{m.group(2)}/shard_{layer}_{layers}"] = _object(None)
    args = _namespace(common, first_file)
    fields = dict(args.fields)
    fields["ckpt_format"] = "torch_dist"
    if "use_dist_ckpt" in fields:
        fields["use_dist_ckpt"] = True
    common["args"] = Record(args.cls, fields)
    common["content_metadata"] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    notes.append("from a legacy (--ckpt-format torch) checkpoint: the common state written in core 0.19's form "
                 "(the common_state item)")
    return _Source(folder, os.path.basename(folder.rstrip(os.sep)), common, cfg, "legacy distributed optimizer",
                   groups, model, weights, states, objects, {}, False, rng_kept=False, notes=notes)
