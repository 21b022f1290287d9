"""torch_dist's bucket-space optimizer state (``dp_reshardable``) cut back into parameters.

``dp_reshardable`` (mcore >= 0.15's default, ``shared/docs/megatron-formats.md`` §2.4) stores the
distributed optimizer's buffers as they are in memory: per model-parallel rank ``mp``, buffer
``g`` (one per (param dtype, grad dtype)), bucket ``b`` and state ``s``, the 1-D tensor
``optimizer.distributed.dp_group_idx_{mp}.gbuf_idx_{g}.dtype_({pdt}, {gdt}).bucket_idx_{b}.{s}``
of the bucket's ``numel_unpadded`` elements: the world bucket with its 64-element gaps, without
its end padding; ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` beside it as ShardedObjects.

Which elements are which parameter's follows from the parameters in registration order and the
bucket rules (:mod:`.buckets`, the shared foundation). The registration order of a GPT model is
not in a torch_dist checkpoint (its ``.metadata`` lists keys in whatever order the ranks' plans
merged), so it is taken from Megatron's module definitions: the embedding, each layer's
parameters in the order its modules register them (:data:`LAYER_ORDER`, per
``args.transformer_impl``: the local spec registers ``input_layernorm`` before the attention, TE
fuses it into ``linear_qkv`` after ``linear_proj``), the final norm, the output layer. That order
is a proposal: every parameter's fp32 master is then proved against its stored weight
(:mod:`.proof`) before any state is called that parameter's; a layout that does not prove is
refused naming the parameter and the rule.

``fully_sharded_bucket_space`` (mcore 0.6-0.7 with ``--ckpt-fully-parallel-save``) has the same
keys and objects, but each bucket tensor is the whole *padded* world bucket (``per_bucket_numel``
elements; the last DP rank's end padding is ``torch.empty``) and the padding rules are that
release's: no 64-element starts, bucket ends padded to ``lcm(DP, 128)`` (0.7) or to DP (0.6).
Which of the two is told by the files: the rule whose buckets are the stored
``per_bucket_numel`` / ``per_bucket_numel_unpadded`` and the tensors' sizes (:func:`_fsbs_layout`).

Read here: dense models at any TP and PP (uniform or uneven pipeline splits, untied embeddings):
one model-parallel index per (TP, PP) rank, ``pp_rank × TP + tp_rank`` (mcore's model-parallel
group, TP fastest), each holding its stage's parameters in TP-local shapes; the TP shards are
joined on each parameter's TP axis (SwiGLU fc1 per half), replicated parameters are TP rank 0's.
MoE models at TP = PP = 1 whose ChainedOptimizer keeps the experts apart (one model-parallel
index per EP rank, each with its local experts; expert DP = world / (EP × PP × ETP)). Other
layouts (virtual pipelines, tied embeddings with PP > 1, experts with TP or PP > 1, ETP > 1) are
refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from statekit import dtypes
from statekit.errors import FormatError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import TorchDtype
from statekit.frameworks.megatron import buckets, regions, stacking
from statekit.frameworks.megatron.config import MegatronConfig
from statekit.lazy import numpy as np
from statekit.tensor import PIECE, TensorRef

SLOTS = ("param", "exp_avg", "exp_avg_sq")
_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                  r"dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.(\w+)$")

# a layer's parameters in registration order, by their names after "decoder.layers.{i}." (the local
# spec's input_layernorm / pre_mlp_layernorm are saved under TE's fused names, stacking.LOCAL_SPEC_KEYS)
_ATTENTION = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight")
_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_NORM_IN = ("input_layernorm.weight", "input_layernorm.bias")
_NORM_MLP = ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias")
LAYER_ORDER = {
    # TransformerLayer: input_layernorm, self_attention (Attention: linear_proj; SelfAttention: linear_qkv,
    # q/k_layernorm), pre_mlp_layernorm, mlp (linear_fc1, linear_fc2)
    "local": _NORM_IN + _ATTENTION + _QKV + _NORM_MLP + ("mlp.router.weight",) + _MLP,
    # TE spec: the norms live in TELayerNormColumnParallelLinear, which registers them before its weight
    "transformer_engine": ("input_layernorm.weight", "input_layernorm.bias") + _ATTENTION
                          + ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
                          + _QKV + ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                                    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
                                    "mlp.router.weight") + _MLP,
}
BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
RULE = ">=0.8"  # dp_reshardable exists from core 0.15: 64-element starts, ends padded to lcm(DP, 128)
FSBS = "fully_sharded_bucket_space"
FSBS_RULES = ("0.7", "<=0.6")  # fully_sharded_bucket_space is written by core 0.6-0.7 only


@dataclass
class Piece:
    """One parameter out of the buffers: its states (lazy, the parameter's shape) and master."""

    name: str
    key: str  # the model's torch_dist key
    lead: tuple[int, ...]
    shape: tuple[int, ...]
    slots: dict[str, TensorRef]
    master: TensorRef
    weight: TensorRef | None


def _torch_dtype(name: str) -> str:
    from statekit.formats import torch_pickle  # noqa: PLC0415 (same floor)

    return torch_pickle.statekit_dtype(name.split(".", 1)[1])


def registration_order(model: dict[str, dcp.TensorEntry], cfg: MegatronConfig, where: str) -> list[tuple]:
    """(name, key, lead, shape, dtype) of every parameter, in ``named_parameters`` order."""
    impl = cfg.transformer_impl or "transformer_engine"
    if impl not in LAYER_ORDER:
        raise FormatError(f"args.transformer_impl is {impl!r}: statekit knows the parameter order of "
                          f"{', '.join(LAYER_ORDER)} only", where)
    grouped = cfg.raw.get("moe_grouped_gemm")
    rows = []
    for key, entry in model.items():
        name_key, _ = _strip(key)
        if name_key.endswith(".expert_bias"):  # a buffer, not a parameter (no optimizer state)
            continue
        for lead in stacking.indices(name_key, entry.shape):
            name = stacking.param_name(name_key, lead, None if grouped is None else bool(grouped), impl)
            known = rank_of(name, impl)
            if known is None:
                raise FormatError(f"{name}: statekit does not know where Megatron registers this parameter, so the "
                                  "bucket-space state cannot be cut for it", where)
            rows.append((known, name, key, lead, entry.shape[len(lead):], entry.dtype))
    rows.sort()
    return [r[1:] for r in rows]


def _strip(key: str) -> tuple[str, bool]:
    if key.startswith(stacking.NEMO_PREFIX):
        return key[len(stacking.NEMO_PREFIX):], True
    return key, False


_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)|"
                     r"(linear_fc[12])\.(weight|bias)(\d+))$")


def rank_of(name: str, impl: str) -> tuple | None:
    """Where ``name`` comes in Megatron's registration order (a sort key), None when unknown.
    A MoE layer registers its router, then its experts: SequentialMLP expert by expert (fc1, fc2
    each), TEGroupedMLP all fc1 weights then all fc2 weights."""
    table = LAYER_ORDER.get(impl)
    if table is None:
        return None
    if name in BEFORE:
        return (0, BEFORE.index(name))
    if name in AFTER:
        return (2, AFTER.index(name))
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest in table:
        return (1, layer, table.index(rest))
    e = _EXPERT.match(rest)
    if e is None:
        return None
    at = table.index("mlp.router.weight")
    if e.group(1) is not None:  # local_experts.{i}.linear_fcK.weight
        return (1, layer, at, int(e.group(1)), e.group(2), e.group(3) == "bias")
    return (1, layer, at, -1, e.group(4), int(e.group(6)), e.group(5) == "bias")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _local_experts(cfg: MegatronConfig, rank: int, where: str) -> range:
    experts = cfg.need("num_experts", "which experts each expert-parallel rank holds")
    ep = cfg.ep or 1
    if experts % ep:
        raise FormatError(f"args say {experts} experts over expert-parallel size {ep}", where)
    n = experts // ep
    return range(rank * n, (rank + 1) * n)


def _expert_index(name: str) -> int:
    m = re.search(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.(?:weight|bias)(\d+)$)", name)
    if m is None:
        raise FormatError(f"{name}: no expert index in the name")
    return int(m.group(1) if m.group(1) is not None else m.group(2))


def read(dist: megatron_dist.MegatronDist, cfg: MegatronConfig, member: int | None, expert: bool,
         states: dict[str, dcp.TensorEntry], model: dict[str, dcp.TensorEntry],
         sharding: str = "dp_reshardable", notes: list[str] | None = None) -> list[Piece]:
    """Every parameter's state out of one optimizer member's bucket space: the bucket tensors
    (``states``: their keys; ``dp_reshardable``, ``fully_sharded_bucket_space``) or each
    model-parallel rank's ``param_state`` object (``dp_zero_gather_scatter``: the legacy coalesced
    dict). ``expert``: the member holds the expert parameters (the ChainedOptimizer's expert part:
    one model-parallel index per expert-parallel rank, each with its local experts). ``notes``
    gets a line for each buffer whose padding rule the files told (fully_sharded_bucket_space)."""
    where = dist.directory
    tp, pp = cfg.tp or 1, cfg.pp or 1
    if cfg.vp:
        raise FormatError(f"args say virtual pipeline size {cfg.vp}: not read in bucket space yet", where)
    if (cfg.etp or 1) != 1 and cfg.raw.get("num_experts"):  # (without experts it only mirrors TP)
        raise FormatError(f"args say expert-tensor-parallel size {cfg.etp}: not read in bucket space yet", where)
    if (tp > 1 or pp > 1) and (expert or sharding not in ("dp_reshardable", FSBS)):
        what = "expert parameters" if expert else sharding
        raise FormatError(f"args say TP {tp} · PP {pp}: statekit reads bucket-space {what} of TP = PP = 1 only yet",
                          where)
    if pp > 1 and not cfg.need("untie_embeddings", "the pipeline stages' parameters"):
        raise FormatError(f"args say PP {pp} with tied embeddings (the last stage's copy of the embedding has a "
                          "bucket of its own): not read in bucket space yet", where)
    order = registration_order(model, cfg, where)
    chain = "" if member is None else f"chained_{member}."
    if sharding == "dp_zero_gather_scatter":
        objects = dist.objects_like(f"{chain}optimizer.distributed.dp_group_idx_", ".param_state")
        found = {int(k.rsplit("dp_group_idx_", 1)[1].split(".", 1)[0]): k for k in objects}
    else:
        found = _found(states, where)
    ranks = sorted(found)
    want = list(range(cfg.ep or 1)) if expert else list(range(tp * pp))
    apart = cfg.experts_in_own_buffer()  # at EP 1 (ETP = TP) the experts are dense parameters
    if not expert and member is None and apart and any(_is_expert(r[0]) for r in order):
        raise FormatError("expert parameters but a single optimizer: not a layout statekit knows", where)
    if ranks != want:
        raise FormatError(f"{chain}optimizer.distributed: model-parallel indices {ranks} stored, the run's "
                          f"{'expert-parallel' if expert else 'model-parallel'} ranks are {want}", where)
    origin = {name: (key, lead, shape, dtype) for name, key, lead, shape, dtype in order}
    pieces: list[Piece] = []
    shards: dict[str, dict[int, dict[str, tuple[dcp.TensorEntry, int]]]] = {}
    for mp in ranks:
        tp_rank, pp_rank = (0, 0) if expert else (mp % tp, mp // tp)  # (mcore's model-parallel rank: TP fastest)
        if expert:
            mine = _local_experts(cfg, mp, where)
            names = [r[0] for r in order if _is_expert(r[0]) and _expert_index(r[0]) in mine]
            dp = cfg.expert_dp_size()
        else:
            names = [r[0] for r in order if not (apart and _is_expert(r[0])) and _on_stage(r[0], cfg, pp_rank, where)]
            dp = cfg.dp_cp_size()
        prefix = f"{chain}optimizer.distributed.dp_group_idx_{mp}"
        rows = [(*origin[n][:2], _local_shape(n, origin[n][2], tp, where), origin[n][3], n) for n in names]
        if sharding == "dp_zero_gather_scatter":
            pieces += _cut_coalesced(dist, cfg, found[mp], rows, dp, model)
            continue
        for name, slots in _cut(dist, cfg, prefix, rows, found[mp], dp, pp_rank, sharding, notes):
            shards.setdefault(name, {})[tp_rank] = slots
    for name, by_rank in shards.items():
        key, lead, shape, _ = origin[name]
        if sorted(by_rank) != list(range(tp)):
            raise FormatError(f"parameter {name}: bucket-space state of TP ranks {sorted(by_rank)} of {tp}", where)
        local = _local_shape(name, shape, tp, where)
        axis = _tp_axis(name, tp, where)
        swiglu = bool(cfg.swiglu) and ".linear_fc1." in name and axis == 0
        slots = {}
        for slot in by_rank[0]:
            parts = [by_rank[t][slot] for t in range(tp)]
            info = {"dcp_key": parts[0][0].key, "bucket_offset": parts[0][1], "param": name}
            slots[slot] = (_slice(dist, parts[0][0], parts[0][1], local, name) if axis is None else
                           _tp_joined(dist.reader, parts, local, axis, swiglu, info))  # (replicated: TP rank 0's)
        weight = regions.plain(dist.reader, model[key], lead, {"megatron_key": key})
        pieces.append(Piece(name, key, lead, shape, slots, slots.pop("param"), weight))
    rank = {row[0]: i for i, row in enumerate(order)}
    pieces.sort(key=lambda x: rank[x.name])
    return pieces


def _on_stage(name: str, cfg: MegatronConfig, pp_rank: int, where: str) -> bool:
    """Whether pipeline rank ``pp_rank`` holds ``name`` (a global name): the embedding on the
    first stage, the final norm and the output layer on the last, each stage its layers
    (:func:`.names.layer_offset`, uneven splits included)."""
    from statekit.frameworks.megatron import names as megatron_names  # noqa: PLC0415 (same floor)

    pp = cfg.pp or 1
    if pp == 1:
        return True
    if name in BEFORE:
        return pp_rank == 0
    if name in AFTER:
        return pp_rank == pp - 1
    m = re.match(r"^decoder\.layers\.(\d+)\.", name)
    if m is None:
        raise FormatError(f"{name}: statekit does not know which pipeline stage holds it", where)
    lo = megatron_names.layer_offset(cfg, pp_rank)
    hi = megatron_names.layer_offset(cfg, pp_rank + 1) if pp_rank + 1 < pp else cfg.need(
        "num_layers", "the last pipeline stage's layers")
    return lo <= int(m.group(1)) < hi


def _tp_axis(name: str, tp: int, where: str) -> int | None:
    if tp == 1:
        return None
    from statekit.frameworks.megatron.names import tp_axis  # noqa: PLC0415 (same floor)

    known, axis = tp_axis(name)
    if not known:
        raise FormatError(f"parameter {name}: statekit knows no TP axis for it (TP {tp}); refusing to guess how its "
                          "bucket-space shards join", where)
    return axis


def _local_shape(name: str, shape: tuple[int, ...], tp: int, where: str) -> tuple[int, ...]:
    """A parameter's shape on one TP rank: its TP axis divided by TP (replicated: the whole)."""
    axis = _tp_axis(name, tp, where)
    if axis is None:
        return tuple(shape)
    if axis >= len(shape) or shape[axis] % tp:
        raise FormatError(f"parameter {name}: its shape {list(shape)} does not split over TP {tp} on axis {axis}",
                          where)
    return tuple(d // tp if i == axis else d for i, d in enumerate(shape))


def _tp_joined(reader: dcp.DcpReader, parts: list[tuple[dcp.TensorEntry, int]], local: tuple[int, ...],
               axis: int, swiglu: bool, info: dict) -> TensorRef:
    """The whole parameter out of its TP ranks' bucket ranges (``parts``: each rank's bucket
    tensor and the parameter's start in it, TP order), joined along ``axis`` as Megatron's
    torch_dist weight is (SwiGLU fc1: each rank's ``[W_r; V_r]``, the whole ``[W_0…; V_0…]``).
    Streamed: row blocks of each rank's range, copied as bits, a piece at a time."""
    dtype = parts[0][0].dtype
    item = dtypes.itemsize(dtype)
    tp, n_local = len(parts), math.prod(local)
    shape = tuple(d * tp if i == axis else d for i, d in enumerate(local))

    def bits(entry: dcp.TensorEntry, lo: int, hi: int):
        return regions.read_box_bits(reader, entry, ((lo, hi),))

    if axis == 0:
        halves = 2 if swiglu else 1
        size_of = n_local // halves
        segments = [(e, s + h * size_of, s + (h + 1) * size_of) for h in range(halves) for e, s in parts]

        def pieces(size: int) -> Iterator[memoryview]:
            step = max(1, (size or PIECE) // item)
            for e, lo, hi in segments:
                for a in range(lo, hi, step):
                    yield memoryview(bits(e, a, min(hi, a + step)).view(np.uint8))
    else:
        outer, width = math.prod(local[:axis]), math.prod(local[axis:])

        def pieces(size: int) -> Iterator[memoryview]:
            size = max(item, (size or PIECE) // item * item)
            rows = max(1, size // (width * tp * item))
            for a in range(0, outer, rows):
                b = min(outer, a + rows)
                blocks = [bits(e, s + a * width, s + b * width).reshape(b - a, width) for e, s in parts]
                block = memoryview(np.concatenate(blocks, axis=1).reshape(-1).view(np.uint8))
                for lo in range(0, len(block), size):  # (one row wider than a piece: cut)
                    yield block[lo:lo + size]

    return TensorRef(dtype, shape, loader=lambda: b"".join(bytes(p) for p in pieces(PIECE)), chunk_reader=pieces,
                     info={**info, "megatron_tp_join": f"axis {axis} of {tp}"})


def _cut(dist: megatron_dist.MegatronDist, cfg: MegatronConfig, prefix: str, rows: list[tuple],
         found: dict, dp: int, pp_rank: int = 0, sharding: str = "dp_reshardable",
         notes: list[str] | None = None) -> list[tuple[str, dict[str, tuple[dcp.TensorEntry, int]]]]:
    """One model-parallel index's buffers cut into its parameters ``rows`` (key, lead, local
    shape, dtype, name; registration order): per parameter, each slot's bucket tensor and the
    parameter's start in it."""
    where = dist.directory
    params, split = _buffers(cfg, rows)
    if sorted(found) != list(range(len(split))):
        raise FormatError(f"{prefix}: buffers {sorted(found)} stored, the model's parameters make {len(split)} "
                          f"({', '.join(f'{k.param_dtype}/{k.grad_dtype}' for k in split)})", where)
    per_bucket = _per_bucket(dist, prefix)
    size = cfg.bucket_size(sum(p.numel for p in params), pp_rank=pp_rank, chunk=0)
    out = []
    for g, (bkey, members) in enumerate(split.items()):
        dtype_key, tensors = found[g]
        if dtype_key != (bkey.param_dtype, bkey.grad_dtype):
            raise FormatError(f"{prefix}: buffer {g} is stored as {dtype_key}, the model's parameters make "
                              f"({bkey.param_dtype}, {bkey.grad_dtype})", where)
        what = f"{prefix}.gbuf_idx_{g}"
        stored = (None, None) if per_bucket is None else (_for(per_bucket[0], g), _for(per_bucket[1], g))
        if sharding == FSBS:
            layout, told = _fsbs_layout(members, size, dp, stored, tensors, what, where)
            if notes is not None:
                notes.append(f"{what}: bucket layout {layout.describe()}; {told}")
        else:
            layout = buckets.layout_buffer(members, size, dp, buckets.rule(RULE),
                                           bool(cfg.pad_buckets_for_high_nccl_busbw))
            layout.check_buckets(*stored, what)
            _check_tensors(layout, tensors, what, where, padded=False)
        for p in members:
            place = layout.placements[p.name]
            slots = {slot: (entry, place.bucket_offset) for slot, entry in tensors[place.bucket].items()}
            if "param" not in slots:
                raise FormatError(f"{what}: no fp32 master ('param') stored beside the moments", where)
            out.append((p.name, slots))
    return out


def _check_tensors(layout: buckets.BufferLayout, tensors: dict, what: str, where: str, padded: bool) -> None:
    """Each stored bucket tensor has the layout's size: ``numel_unpadded`` (dp_reshardable) or the
    padded world bucket (``padded``: fully_sharded_bucket_space)."""
    if sorted(tensors) != list(range(len(layout.buckets))):
        raise FormatError(f"{what}: buckets {sorted(tensors)} stored, the layout has {len(layout.buckets)} "
                          f"({layout.describe()})", where)
    for b in layout.buckets:
        want = b.numel if padded else b.numel_unpadded
        for entry in tensors[b.index].values():
            if entry.shape != (want,):
                raise FormatError(f"{entry.key}: {list(entry.shape)} elements, the layout's bucket {b.index} has "
                                  f"{want} ({layout.describe()})", where)


def _fsbs_layout(members: list, size: int | None, dp: int, stored: tuple, tensors: dict, what: str,
                 where: str) -> tuple[buckets.BufferLayout, str]:
    """The layout of a ``fully_sharded_bucket_space`` buffer and the line saying what chose its
    rule: of mcore 0.7's (ends padded to lcm(DP, 128)) and 0.6's (to DP), neither with 64-element
    starts, the one whose buckets are the stored ``per_bucket_numel`` / ``_unpadded`` and whose
    padded sizes are the stored tensors'. Neither: refused, naming both."""
    numel, unpadded = stored
    sizes = {b: next(iter(t.values())).shape for b, t in tensors.items()}
    tried = []
    for name in FSBS_RULES:
        layout = buckets.layout_buffer(members, size, dp, buckets.rule(name))
        got = [b.numel for b in layout.buckets]
        fits = (sorted(sizes) == list(range(len(got))) and all(sizes[i] == (n,) for i, n in enumerate(got))
                and numel in (None, got) and unpadded in (None, [b.numel_unpadded for b in layout.buckets]))
        if fits:
            _check_tensors(layout, tensors, what, where, padded=True)
            other = [r for r in FSBS_RULES if r != name]
            same = [r for r in other if [b.numel for b in buckets.layout_buffer(members, size, dp, buckets.rule(r)
                                                                                 ).buckets] == got]
            told = (f"rule {name} told by per_bucket_numel {numel if numel is not None else '(not stored)'} and the "
                    f"bucket tensors' sizes {got}" + (f" (rule {same[0]} lays it out the same)" if same else ""))
            return layout, told
        tried.append(f"rule {name}: {got}")
    shown = [list(sizes[b]) for b in sorted(sizes)]
    raise FormatError(f"{what}: bucket tensors of {shown} elements, per_bucket_numel {numel}, per_bucket_numel_unpadded "
                      f"{unpadded}; the layouts of the model's parameters give {'; '.join(tried)} (DP×CP {dp}, "
                      f"bucket size {size}): neither mcore 0.6's nor 0.7's bucket rule holds", where)


def _buffers(cfg: MegatronConfig, rows: list[tuple]) -> tuple[list, dict]:
    params = [buckets.LayoutParam(name, shape, dtype, expert=_is_expert(name))
              for _key, _lead, shape, dtype, name in rows]
    grad_fp32 = cfg.grad_reduce_in_fp32
    if grad_fp32 is None:
        grad_fp32 = bool(cfg.need("grad_reduce_in_fp32", "the distributed optimizer's buffer keys"))
    return params, buckets.split_buffers(params, grad_fp32, experts_separate=False)


def _cut_coalesced(dist: megatron_dist.MegatronDist, cfg: MegatronConfig, key: str, rows: list[tuple], dp: int,
                   model: dict[str, dcp.TensorEntry]) -> list[Piece]:
    """``dp_zero_gather_scatter``: the ShardedObject ``key`` holds what the legacy ``distrib_optim.pt``
    holds, in the coalesced form of mcore >= 0.7 (``{"buckets_coalesced": True, g: {(param dtype,
    grad dtype): {"param", "exp_avg", "exp_avg_sq": 1-D, "numel_unpadded"}}}``): each buffer's
    buckets back to back without their end padding. A parameter sits at its coalesced offset. Of
    the 0.7 and >= 0.8 rules the one whose total is the stored ``numel_unpadded`` is taken (they
    agree where no gap is padded), then proved like every layout."""
    where = dist.directory
    state = dist.object(key)
    if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
        raise FormatError(f"{key}: not the coalesced distributed-optimizer state (mcore >= 0.7) statekit reads",
                          where)
    params, split = _buffers(cfg, rows)
    stored = {g: v for g, v in state.items() if g != "buckets_coalesced"}
    if sorted(stored) != list(range(len(split))):
        raise FormatError(f"{key}: buffers {sorted(stored)} stored, the model's parameters make {len(split)}", where)
    size = cfg.bucket_size(sum(p.numel for p in params), pp_rank=0, chunk=0)
    where_of = {row[4]: row for row in rows}
    pieces: list[Piece] = []
    for g, (bkey, members) in enumerate(split.items()):
        by_dtype = stored[g]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise FormatError(f"{key}: buffer {g} is not one (param dtype, grad dtype) entry", where)
        dtype_key, tensors = next(iter(by_dtype.items()))
        names = tuple(_statekit(d) for d in dtype_key) if isinstance(dtype_key, tuple) else None
        if names != (bkey.param_dtype, bkey.grad_dtype):
            raise FormatError(f"{key}: buffer {g} is stored as {dtype_key}, the model's parameters make "
                              f"({bkey.param_dtype}, {bkey.grad_dtype})", where)
        unpadded = tensors.get("numel_unpadded") if isinstance(tensors, dict) else None
        layout = None
        for rule in (RULE, "0.7"):
            candidate = buckets.layout_buffer(members, size, dp, buckets.rule(rule),
                                              bool(cfg.pad_buckets_for_high_nccl_busbw))
            if candidate.numel_unpadded == unpadded:
                layout = candidate
                break
        if layout is None:
            buckets.layout_buffer(members, size, dp, buckets.rule(RULE)).check_numel_unpadded(
                unpadded, f"{key} buffer {g}")
        flats = {s: t for s, t in tensors.items() if isinstance(t, TensorRef)}
        if "param" not in flats or any(t.shape != (unpadded,) for t in flats.values()):
            raise FormatError(f"{key}: buffer {g} holds {sorted(flats)}, not 1-D tensors of {unpadded} elements "
                              "with the fp32 master 'param'", where)
        for p in members:
            lo = layout.placements[p.name].coalesced
            slots = {s: _flat_slice(t, lo, p.shape, p.name) for s, t in flats.items()}
            row = where_of[p.name]
            weight = regions.plain(dist.reader, model[row[0]], row[1], {"megatron_key": row[0]})
            pieces.append(Piece(p.name, row[0], row[1], p.shape, slots, slots.pop("param"), weight))
    return pieces


def _statekit(dtype: object) -> str | None:
    from statekit.formats import torch_pickle  # noqa: PLC0415 (same floor)

    return torch_pickle.statekit_dtype(dtype.name) if isinstance(dtype, TorchDtype) else None


def _flat_slice(flat: TensorRef, lo: int, shape: tuple[int, ...], name: str) -> TensorRef:
    """Elements ``[lo, lo + numel)`` of a lazy 1-D tensor, as ``shape`` (read from its file span)."""
    numel = math.prod(shape)
    item = dtypes.itemsize(flat.dtype)
    if flat.span is None:
        raise FormatError(f"{name}: the coalesced state is not a plain span of its file")
    span = flat.span
    from statekit.tensor import FileSpan  # noqa: PLC0415 (floor 0)

    part = FileSpan.at(span.file, span.offset + lo * item, numel * item)
    return TensorRef(flat.dtype, shape, span=part, info={"coalesced_offset": lo, "param": name})


def _found(states: dict[str, dcp.TensorEntry], where: str) -> dict[int, dict[int, tuple[tuple[str, str], dict]]]:
    """model-parallel index -> gbuf index -> ((param dtype, grad dtype), {bucket: {slot: entry}})."""
    out: dict[int, dict[int, tuple[tuple[str, str], dict]]] = {}
    for key, entry in states.items():
        m = _KEY.match(key)
        if m is None:
            raise FormatError(f"{key}: not a bucket-space tensor key statekit knows", where)
        mp, g, b, slot = int(m.group(2)), int(m.group(3)), int(m.group(6)), m.group(7)
        dtype_key = (_torch_dtype(m.group(4)), _torch_dtype(m.group(5)))
        have = out.setdefault(mp, {}).setdefault(g, (dtype_key, {}))
        if have[0] != dtype_key:
            raise FormatError(f"{key}: buffer {g} stored under two dtype keys", where)
        have[1].setdefault(b, {})[slot] = entry
    return out


def _per_bucket(dist: megatron_dist.MegatronDist, prefix: str):
    keys = [f"{prefix}.per_bucket_numel", f"{prefix}.per_bucket_numel_unpadded"]
    if any(dist.object_key(k) is None for k in keys):
        return None
    return tuple(dist.object(k) for k in keys)


def _for(stored: object, g: int) -> list[int] | None:
    """The bucket sizes stored for buffer ``g`` (a list per buffer of {dtype tuple: [sizes]})."""
    if not isinstance(stored, list) or g >= len(stored) or not isinstance(stored[g], dict):
        return None
    for key, sizes in stored[g].items():
        if isinstance(key, tuple) and all(isinstance(d, TorchDtype) for d in key):
            return list(sizes)
    return None


def _slice(dist: megatron_dist.MegatronDist, entry: dcp.TensorEntry, start: int, shape: tuple[int, ...],
           name: str) -> TensorRef:
    numel = math.prod(shape)
    box = ((start, start + numel),)
    return regions.boxed(dist.reader, entry, box, shape, {"dcp_key": entry.key, "bucket_offset": start, "param": name})
