"""The distributed optimizer's bucket space written (``dp_reshardable``, mcore >= 0.15's default):
the inverse of :mod:`.bucket_space`, for dense models at any TP and PP.

Megatron keeps one ``optimizer.distributed.dp_group_idx_{mp}`` per model-parallel rank
``mp = pp_rank × TP + tp_rank`` (TP fastest, ``shared/docs/megatron-formats.md`` §2.4, §8.4). Each
holds that rank's pipeline stage's parameters in their TP-local shapes, laid out in buffers and
buckets for the DP×CP ranks by the rules the reader cuts them with (:mod:`.buckets`):

- the stage's parameters (:func:`.bucket_space._on_stage`: the embedding on the first stage, the
  final norm and the output layer on the last, each stage its layers) in registration order
  (:func:`.bucket_space.registration_order`), each in its TP-local shape
  (:func:`.bucket_space._local_shape`), split into buffers by (param dtype, grad dtype);
- each buffer laid out in reverse, 64-element starts, bucket ends padded to ``lcm(DP×CP, 128)``
  (rule ``>=0.8``: ``dp_reshardable`` exists from core 0.15), the bucket size Megatron resolves
  for that pipeline rank (one bucket on every rank but the first);
- per bucket and slot the 1-D F32 tensor ``…gbuf_idx_{g}.dtype_({pdt}, {gdt}).bucket_idx_{b}.{slot}``
  of the bucket's ``numel_unpadded`` elements: each parameter's TP shard at its offset, the gaps
  zero (what Megatron's ``torch.zeros`` shards hold);
- beside them the rank's ShardedObjects ``.optimizer`` (``{"param_groups": …}``: mcore gathers the
  groups' keys over the world, so every rank holds the same groups), ``.per_bucket_numel`` and
  ``.per_bucket_numel_unpadded`` (per buffer ``{(param dtype, grad dtype): [sizes]}``).

A TP shard is what the reader joins (:func:`.bucket_space._tp_joined`): column-parallel weights
cut on axis 0, row-parallel on axis 1, SwiGLU's ``linear_fc1`` ``[W; V]`` as ``[W_r; V_r]``,
replicated parameters whole. It is streamed from the parameter's global state: each rank's
bucket reads the parameter through once and keeps its ranges (memory: one piece; a column-parallel
shard's rows pass as views of the pieces read, a row-parallel shard's column blocks are gathered).

Refused in one line (:func:`check`): tied embeddings with PP > 1 (the last stage's copy has a
bucket of its own, which no fixture has proved), virtual pipelines, non-uniform pipeline
layouts, expert parameters (MoE).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from statekit import dtypes
from statekit.errors import MappingError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import STATEKIT_TO_TORCH, TorchDtype
from statekit.frameworks.megatron import bucket_space, buckets, config
from statekit.frameworks.megatron.names import tp_axis
from statekit.tensor import PIECE, TensorRef, cut_runs, extend_runs, file_runs

SLOTS = bucket_space.SLOTS  # ("param", "exp_avg", "exp_avg_sq"): the fp32 master, then the moments
_ITEM = 4  # the buckets hold F32


def sharded_object(value: object) -> dcp.RawBytes:
    """A ShardedObject's payload: ``torch.save`` of the list of its (one) shard's data."""
    return dcp.RawBytes(megatron_dist.common_archive([value]))


def check(cfg: config.MegatronConfig, where: str) -> None:
    """Refuse the target layouts this writer does not build, one line each."""
    pp = cfg.pp or 1
    if cfg.vp not in (None, 1):
        raise MappingError(f"dp_reshardable with virtual pipeline size {cfg.vp}: not written in bucket space", where)
    if cfg.num_experts and ((cfg.ep or 1), (cfg.tp or 1), pp) != (1, 1, 1):
        # at EP = TP = PP = 1 megatron-core 0.19.2 puts the experts in the dense buffer as dense parameters
        raise MappingError(f"dp_reshardable with experts (MoE) at EP {cfg.ep or 1} TP {cfg.tp or 1} PP {pp}: not "
                           "written in bucket space yet (fully_reshardable is)", where)
    if pp > 1:
        for arg, value in (("decoder_first_pipeline_num_layers", cfg.first_stage_layers),
                           ("decoder_last_pipeline_num_layers", cfg.last_stage_layers),
                           ("pipeline_model_parallel_layout", cfg.pipeline_layout),
                           ("account_for_embedding_in_pipeline_split", cfg.account_for_embedding or None),
                           ("account_for_loss_in_pipeline_split", cfg.account_for_loss or None)):
            if value is not None:
                raise MappingError(f"dp_reshardable at PP {pp} with args.{arg} {value!r}: statekit writes uniform "
                                   "pipeline stages only", where)
        if not cfg.need("untie_embeddings", "the pipeline stages' parameters"):
            raise MappingError(f"dp_reshardable at PP {pp} with tied embeddings (the last stage's copy of the "
                               "embedding has a bucket of its own): not written in bucket space yet "
                               "(fully_reshardable is)", where)


def write(model: dict[str, dcp.TensorEntry], cfg: config.MegatronConfig, states: dict[str, dict[str, TensorRef]],
          groups: list[dict], where: str) -> dict[str, object]:
    """The DCP items of a ``dp_reshardable`` optimizer for the run ``cfg`` (the target's args):
    ``model`` the target's global model tensors (key → entry, vocabulary rows already the
    target's), ``states`` their global stacked states by slot, ``groups`` the param groups."""
    check(cfg, where)
    tp, pp = cfg.tp or 1, cfg.pp or 1
    order = bucket_space.registration_order(model, cfg, where)
    if (tp, pp, cfg.ep or 1) != (1, 1, 1) and any(".mlp.experts." in row[0] for row in order):
        raise MappingError("expert parameters: not written in bucket space yet", where)
    out: dict[str, object] = {}
    for mp in range(tp * pp):
        out.update(_rank(model, cfg, states, groups, order, mp, where))
    return out


def _rank(model: dict[str, dcp.TensorEntry], cfg: config.MegatronConfig, states: dict, groups: list[dict],
          order: list[tuple], mp: int, where: str) -> dict[str, object]:
    """Model-parallel rank ``mp``'s buffers, buckets and ShardedObjects."""
    tp = cfg.tp or 1
    tp_rank, pp_rank = mp % tp, mp // tp
    mine = [row for row in order if bucket_space._on_stage(row[0], cfg, pp_rank, where)]
    rows = [(key, lead, bucket_space._local_shape(name, shape, tp, where), dtype, name)
            for name, key, lead, shape, dtype in mine]
    params, split = bucket_space._buffers(cfg, rows)
    size = cfg.bucket_size(sum(p.numel for p in params), pp_rank=pp_rank, chunk=0)
    origin = {name: (key, lead) for name, key, lead, _shape, _dtype in mine}
    prefix = f"optimizer.distributed.dp_group_idx_{mp}"
    out: dict[str, object] = {}
    numel, unpadded = [], []
    for g, (bkey, members) in enumerate(split.items()):
        layout = buckets.layout_buffer(members, size, cfg.dp_cp_size(), buckets.rule(bucket_space.RULE),
                                       bool(cfg.pad_buckets_for_high_nccl_busbw))
        torch_names = tuple(f"torch.{STATEKIT_TO_TORCH[d]}" for d in (bkey.param_dtype, bkey.grad_dtype))
        dtype_key = tuple(TorchDtype(STATEKIT_TO_TORCH[d]) for d in (bkey.param_dtype, bkey.grad_dtype))
        for b in layout.buckets:
            placed = sorted((layout.placements[n] for n in b.params), key=lambda p: p.start)
            for slot in SLOTS:
                parts = []
                for place in placed:
                    key, lead = origin[place.name]
                    whole = _piece(states[key][slot], lead, model[key].shape)
                    if whole.dtype != "F32":
                        raise MappingError(f"{place.name}: its {slot} state is {whole.dtype}; the buckets hold F32",
                                           where)
                    parts.append((place.bucket_offset, tp_shard(whole, place.name, cfg, tp_rank)))
                name = f"{prefix}.gbuf_idx_{g}.dtype_({torch_names[0]}, {torch_names[1]}).bucket_idx_{b.index}.{slot}"
                out[name] = bucket(parts, b.numel_unpadded, name)
        numel.append({dtype_key: [b.numel for b in layout.buckets]})
        unpadded.append({dtype_key: [b.numel_unpadded for b in layout.buckets]})
    out[f"{prefix}.optimizer/shard_0_1"] = sharded_object({"param_groups": groups})
    out[f"{prefix}.per_bucket_numel/shard_0_1"] = sharded_object(numel)
    out[f"{prefix}.per_bucket_numel_unpadded/shard_0_1"] = sharded_object(unpadded)
    return out


def _piece(stacked: TensorRef, lead: tuple[int, ...], shape: tuple[int, ...]) -> TensorRef:
    """Element ``lead`` of the stacked axes of ``stacked``: the parameter's own state it was stacked from."""
    if not lead:
        return stacked
    parts = stacked.info.get("parts")
    if parts is None:
        raise MappingError(f"a stacked state of shape {list(stacked.shape)} without its parameters' parts")
    return parts[int(np.ravel_multi_index(lead, shape[:len(lead)]))]


def shard_ranges(shape: tuple[int, ...], axis: int, tp: int, rank: int, swiglu: bool,
                 name: str) -> list[tuple[int, int]]:
    """TP rank ``rank``'s elements of a C-order tensor of ``shape`` cut on ``axis``: flat
    ``[lo, hi)`` ranges in order. SwiGLU's fc1 (axis 0, ``[W; V]``): rows ``W_r`` then ``V_r``."""
    if axis >= len(shape):
        raise MappingError(f"parameter {name}: shape {list(shape)} has no TP axis {axis}")
    outer, size, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    if swiglu:
        if axis != 0 or size % (2 * tp):
            raise MappingError(f"parameter {name}: SwiGLU rows {size} do not split into 2 × TP {tp} equal parts")
        half, part = size // 2, size // (2 * tp)
        spans = [(rank * part, (rank + 1) * part), (half + rank * part, half + (rank + 1) * part)]
    else:
        if size % tp:
            raise MappingError(f"parameter {name}: axis {axis} of size {size} does not split into TP {tp} shards")
        part = size // tp
        spans = [(rank * part, (rank + 1) * part)]
    return [(o * size * inner + a * inner, o * size * inner + b * inner) for o in range(outer) for a, b in spans]


def tp_shard(whole: TensorRef, name: str, cfg: config.MegatronConfig, rank: int) -> TensorRef:
    """TP rank ``rank``'s shard of a parameter's global state (lazy, streamed), as the reader
    joins it; a replicated parameter (a norm, a row-parallel bias) is returned whole."""
    tp = cfg.tp or 1
    if tp == 1:
        return whole
    known, axis = tp_axis(name)
    if not known:
        raise MappingError(f"parameter {name}: statekit knows no TP axis for it (TP {tp}); refusing to guess how to "
                           "cut its state")
    if axis is None:
        return whole
    swiglu = bool(cfg.swiglu) and ".linear_fc1." in name and axis == 0
    ranges = shard_ranges(tuple(whole.shape), axis, tp, rank, swiglu, name)
    item = dtypes.itemsize(whole.dtype)
    local = tuple(d // tp if i == axis else d for i, d in enumerate(whole.shape))

    def pieces(size: int) -> Iterator[bytes]:
        yield from _select(whole, [(lo * item, hi * item) for lo, hi in ranges], size or PIECE)

    def runs():  # the ranges' bytes of the whole's runs (few long ones: a column-parallel shard)
        spans = file_runs(whole)
        out: list = []
        if spans is None or any(not cut_runs(spans, lo * item, (hi - lo) * item, out) for lo, hi in ranges):
            return None
        return out

    return TensorRef(whole.dtype, local, chunk_reader=pieces, info={"param": name, "megatron_tp_shard": f"{rank} of {tp}"},
                     runs=runs)


def _select(ref: TensorRef, ranges: list[tuple[int, int]], size: int) -> Iterator[bytes | memoryview]:
    """The bytes of ``ref`` inside the sorted, disjoint byte ``ranges``, streamed: ``ref`` read
    once from its start to the last range's end. A kept run of a quarter piece or more is given
    out as a view of the piece read (no copy); shorter runs (a row-parallel shard's rows) are
    gathered into pieces of about ``size`` bytes."""
    held = bytearray()
    it = iter(ranges)
    lo, hi = next(it, (None, None))
    at = 0
    for piece in ref.iter_bytes(size):
        buf = memoryview(piece).cast("B")
        end = at + len(buf)
        while lo is not None and lo < end:
            a, b = max(lo, at), min(hi, end)
            if b - a >= size // 4:
                if held:
                    yield bytes(held)
                    held = bytearray()
                yield buf[a - at:b - at]
            elif a < b:
                held += buf[a - at:b - at]
                if len(held) >= size:
                    yield bytes(held)
                    held = bytearray()
            if hi > end:
                break
            lo, hi = next(it, (None, None))
        at = end
        if lo is None:
            break
    if lo is not None:
        raise MappingError(f"a state of {ref.nbytes} bytes ended before its TP shard's range {lo}..{hi}")
    if held:
        yield bytes(held)


def bucket(parts: list[tuple[int, TensorRef]], numel: int, key: str) -> TensorRef:
    """A 1-D F32 bucket of ``numel`` elements: each part at its offset (sorted), zeros between.
    A part that gives other than its own size in bytes is refused, never placed."""

    def pieces(size: int) -> Iterator[bytes | memoryview]:
        at = 0
        for offset, ref in parts:
            gap = (offset - at) * _ITEM
            if gap < 0:
                raise MappingError(f"{key}: two parameters overlap in the bucket")
            if gap:
                yield bytes(gap)
            given = 0
            for piece in ref.iter_bytes(size):
                given += len(piece) if isinstance(piece, bytes) else memoryview(piece).nbytes
                yield piece
            if given != ref.numel * _ITEM:
                raise MappingError(f"{key}: a parameter's state gave {given} bytes, not its {ref.numel * _ITEM}")
            at = offset + ref.numel
        if at > numel:
            raise MappingError(f"{key}: the parameters end at element {at}, beyond the bucket's {numel}")
        if numel > at:
            yield bytes((numel - at) * _ITEM)

    def runs():  # the parts' runs at their offsets, zeros between (None where a part's are not known)
        out: list = []
        at = 0
        for offset, ref in parts:
            got = file_runs(ref)
            if got is None or offset < at or ref.dtype != "F32":
                return None  # (the pieces refuse what does not fit, with the message)
            extend_runs(out, ([(offset - at) * _ITEM] if offset > at else []) + got)
            at = offset + ref.numel
        if at > numel:
            return None
        return extend_runs(out, [(numel - at) * _ITEM] if numel > at else [])

    return TensorRef("F32", (numel,), chunk_reader=pieces, runs=runs)
