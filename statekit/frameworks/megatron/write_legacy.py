"""Write a Megatron legacy checkpoint (``--ckpt-format torch``) at another TP × PP × EP × DP.

The source is a legacy checkpoint statekit reads (:mod:`.legacy`: every parameter named globally,
its TP shards joined, every master proved against its weight). For each target rank folder
``iter_N/mp_rank_TT[_PPP][_EEE]/`` this writes what megatron-core 0.19.2 writes
(``/work/shared/docs/megatron-formats.md`` §1.2, §1.4; compared key by key with the
``fixtures/megatron/0.19.2/*_torch_distopt_*`` saves):

``model_optim_rng.pt``
    ``args`` (the source's Namespace with the target's ``tensor/pipeline/expert_model_parallel_size``,
    ``expert_tensor_parallel_size`` (= TP), ``data_parallel_size``, ``world_size``,
    ``padded_vocab_size`` and ``make_vocab_size_divisible_by`` changed; Megatron's
    ``check_checkpoint_args`` compares TP and PP with the loading run), ``checkpoint_version``,
    ``iteration``, ``model`` (the rank's shards in the order Megatron's modules register them, the
    source's ``_extra_state`` entries kept), ``optimizer`` (the distributed optimizer's
    ``state_dict``: the source's param groups without tensors; a ChainedOptimizer's list),
    ``opt_param_scheduler``, ``num_floating_point_operations_so_far`` — and ``rng_state``, copied
    from the source rank only when TP, PP and EP are unchanged (an RNG state belongs to its rank;
    on any other change none is written and Megatron must be run with ``--no-load-rng``, as its own
    TP/PP change ignores it).
``distrib_optim.pt``
    the coalesced form of mcore ≥ 0.7 (``{"buckets_coalesced": True, buffer: {(param dtype, grad
    dtype): {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}}}``) laid out by :mod:`.buckets`
    for the target (rule ≥ 0.8, the target's DP×CP and bucket size); gaps are zeros. A
    ChainedOptimizer's list holds the dense state in EP-rank-0 folders only (None elsewhere).

The optimizer is written in the source's form unless :attr:`Target.distributed` says otherwise:
the distributed form above (a non-distributed source's per-parameter steps folded into its groups)
or the non-distributed one (``Float16OptimizerWithFloat16Params``: torch's state by ids, a ``step``
tensor per parameter, ``fp32_from_fp16_params``; no ``distrib_optim.pt``). Refused, each in one line: a source that is not a legacy
checkpoint, an EP change whose expert and dense groups disagree, vocabulary
padding rows that hold state and the target would drop, a tied output layer copy that differs from
the embedding, non-uniform pipeline layouts. Memory: one parameter at a time (the tensors are
written lazily, each rank shard cut from its whole tensor when the file streams it).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

from statekit import dtypes, stream
from statekit.errors import FormatError, UsageError
from statekit.formats import megatron_legacy as container
from statekit.formats import torch_pt
from statekit.formats.torch_pickle import Record
from statekit.frameworks.megatron import buckets, config, legacy, names, shard
from statekit.lazy import numpy as np
from statekit.tensor import PIECE, TensorRef, extend_runs, file_runs

SLOTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Target:
    tp: int
    pp: int
    ep: int
    dp: int
    vocab_divisible_by: int | None = None
    distributed: bool | None = None  # the optimizer's form (None: the source's)
    cp: int | None = None  # the context-parallel size (None: the source's); distrib_optim.pt spans DP x CP


@dataclass
class Result:
    out: str
    folders: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Param:
    """One whole-model parameter: its tensors (lazy) and group identity."""

    name: str
    weight: TensorRef
    master: TensorRef
    moments: dict[str, TensorRef]
    expert: bool


def _shard_ref(ref: TensorRef, rows: int | None, name: str, tp: int, rank: int, axis: int | None, swiglu: bool,
               shape: tuple[int, ...]) -> TensorRef:
    """Rank ``rank``'s TP shard of ``ref`` with its first axis padded with zero rows or cut to
    ``rows`` first (:func:`.shard.resize_rows` then :func:`.shard.tp_shard`), streamed: the
    source's rows are read in order, a few MiB at a time, and only the shard's bytes kept."""
    if tp == 1 and (rows is None or rows == ref.shape[0]):
        return ref
    rank = rank if tp > 1 else 0  # (a replicated tensor: every rank's is the whole)
    full = (rows, *ref.shape[1:])
    item = dtypes.itemsize(ref.dtype)
    row = math.prod(ref.shape[1:]) * item
    if axis == 0 or tp == 1:
        size = full[0]
        if swiglu and size % (2 * tp):
            raise FormatError(f"parameter {name}: SwiGLU rows {size} do not split into 2 × TP {tp} equal parts")
        part = size // (2 * tp if swiglu else tp)
        spans = [(rank * part, (rank + 1) * part)]
        if swiglu:
            spans.append((size // 2 + rank * part, size // 2 + (rank + 1) * part))
        cols = None
    else:
        part = full[axis] // tp
        inner = math.prod(full[axis + 1:]) * item
        spans = [(0, rows)]
        cols = (math.prod(full[1:axis]), full[axis] * inner, rank * part * inner, (rank + 1) * part * inner)

    def chunks(size: int) -> Iterator[bytes | memoryview]:
        per = max(1, (size or PIECE) // max(1, row))
        source = _Rows(ref.iter_bytes(per * row), row, ref.shape[0])
        for lo, hi in spans:
            source.skip_to(lo)
            for a in range(lo, hi, per):
                block = source.take(min(per, hi - a))
                if cols is not None:
                    outer, width, c0, c1 = cols
                    block = np.ascontiguousarray(block.reshape(-1, outer, width)[:, :, c0:c1])
                view = memoryview(block.reshape(-1))
                for b in range(0, len(view), size or PIECE):  # (a row wider than a piece: cut)
                    yield view[b:b + (size or PIECE)]

    return TensorRef(ref.dtype, shape, loader=lambda: b"".join(bytes(c) for c in chunks(PIECE)), chunk_reader=chunks)


class _Rows:
    """A tensor's bytes read in order as rows of ``row`` bytes (uint8 arrays of ``n`` rows);
    rows at and past ``have`` are zero (vocabulary padding)."""

    def __init__(self, pieces: Iterator, row: int, have: int):
        self._pieces, self._row, self._have = pieces, row, have
        self._buf = memoryview(b"")
        self.at = 0  # the next row's index

    def _bytes(self, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        done = 0
        while done < n:
            if not self._buf:
                piece = next(self._pieces, None)
                if piece is None:
                    raise FormatError(f"a tensor ended after {self.at} rows of {self._have}")
                self._buf = memoryview(piece).cast("B")
            k = min(n - done, len(self._buf))
            out[done:done + k] = np.frombuffer(self._buf[:k], np.uint8)
            self._buf = self._buf[k:]
            done += k
        return out

    def take(self, n: int) -> np.ndarray:
        real = max(0, min(n, self._have - self.at))
        data = self._bytes(real * self._row)
        if real < n:
            data = np.concatenate([data, np.zeros((n - real) * self._row, np.uint8)])
        self.at += n
        return data

    def skip_to(self, index: int) -> None:
        while self.at < index:
            self.take(min(index - self.at, max(1, PIECE // max(1, self._row))))


class _Writer:
    def __init__(self, src: str, target: Target):
        self.src = src
        self.t = target
        self.reader = legacy._Reader(src)
        self.ckpt = self.reader.read()
        self.cfg = self.reader.cfg
        self.ranks = self.reader.rank_records
        if self.ckpt.optimizer is None:
            raise FormatError("no optimizer state to write", src)
        for name, v in (("TP", target.tp), ("PP", target.pp), ("EP", target.ep), ("DP", target.dp)):
            if v < 1:
                raise UsageError(f"--{name.lower()} {v}: a parallel size is at least 1")
        shard.check_uniform(self.cfg, f"{src}: the source")
        self.notes: list[str] = []
        self._params()
        self._target_args()

    # ---- the whole model
    def _params(self) -> None:
        state = {p.key: p for p in self.ckpt.optimizer.params}
        self.params: dict[str, _Param] = {}
        for mp in self.ckpt.model.params:
            ps = state.get(mp.path)
            if ps is None or legacy.MASTER not in ps.slots or not all(s in ps.slots for s in SLOTS):
                raise FormatError(f"parameter {mp.path}: no fp32 master and Adam moments to write", self.src)
            self.params[mp.path] = _Param(mp.path, mp.tensor, ps.slots[legacy.MASTER],
                                          {s: ps.slots[s] for s in SLOTS}, bool(legacy._EXPERT.search(mp.path)))
        # every key of the model state (parameters, _extra_state entries, buffers), named globally, in
        # the order the modules register them, with the non-parameter values (rank TP 0's)
        entries = []
        for rank in self.ranks:
            if rank.where.tp != 0:
                continue
            for c, chunk in enumerate(legacy._chunks(rank.obj, rank.folder)):
                blocks: dict[str, int] = {}
                for q, (key, value) in enumerate(chunk.items()):
                    m = legacy._EXPERT.search(key)
                    block = blocks.setdefault(key[:m.end()], q) if m else q
                    entries.append(((c, rank.where.pp, block, rank.where.ep, q), rank, key, value))
        entries.sort(key=lambda e: e[0])
        self.keys: dict[str, object] = {}
        for _k, rank, key, value in entries:
            name = names.globalize(key, self.cfg, rank.where.pp, None, rank.where.ep)
            if name not in self.keys:
                self.keys[name] = None if name in self.params else value
        self.tied = self.cfg.untie_embeddings is False
        emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
        if self.tied and out in self.params and self.t.pp == 1:
            self._check_copy(emb, out)
            del self.params[out]
            del self.keys[out]
            self.notes.append("tied embeddings: the last stage's output_layer.weight copy equals the embedding "
                              "(weight, master, moments, bit for bit), so PP 1 keeps the embedding's alone")
        elif self.tied and out not in self.params and self.t.pp > 1 and emb in self.params:
            src = self.params[emb]
            self.params[out] = _Param(out, src.weight, src.master, dict(src.moments), False)
            keys = list(self.keys.items())
            at = next((i for i, (k, _) in enumerate(keys) if k.startswith("output_layer.")), len(keys))
            keys.insert(at, (out, None))
            self.keys = dict(keys)
            self.notes.append("tied embeddings with PP > 1: the last stage gets output_layer.weight, a copy of the "
                              "embedding with its state (as Megatron keeps it)")

    def _check_copy(self, a: str, b: str) -> None:
        pa, pb = self.params[a], self.params[b]
        for what, x, y in (("weight", pa.weight, pb.weight), ("fp32 master", pa.master, pb.master),
                           *((s, pa.moments[s], pb.moments[s]) for s in SLOTS)):
            if not stream.same_bytes(x, y):  # (dtype, shape and bits; streamed, never whole tensors)
                raise FormatError(f"tied embeddings: the {what} of {b} (the last stage's copy) differs from {a}'s: "
                                  "PP 1 has one tensor for both, so statekit does not choose", self.src)

    # ---- args
    def _target_args(self) -> None:
        cfg, t = self.cfg, self.t
        raw = dict(cfg.raw)
        if cfg.etp is not None and cfg.etp != (cfg.tp or 1):
            raise FormatError(f"the source's expert_tensor_parallel_size {cfg.etp} differs from its TP", self.src)
        if cfg.num_experts and cfg.num_experts % t.ep:
            raise UsageError(f"--ep {t.ep}: the model's {cfg.num_experts} experts do not split into EP {t.ep}")
        if not cfg.num_experts and t.ep != 1:
            raise UsageError(f"--ep {t.ep}: the model has no experts")
        layers = cfg.need("num_layers", "the pipeline stages")
        if layers % t.pp:
            raise UsageError(f"--pp {t.pp}: the model's {layers} layers do not split into PP {t.pp} equal stages")
        cp = config.target_cp(cfg, t.cp, self.src)
        world = t.tp * t.pp * t.dp * cp
        if world % (t.tp * t.ep * t.pp):
            raise UsageError(f"--ep {t.ep}: world size TP×PP×DP×CP = {world} is not a multiple of TP×EP×PP")
        divisible = t.vocab_divisible_by or cfg.make_vocab_size_divisible_by
        vocab = cfg.vocab_size
        if vocab is None or divisible is None:
            if t.tp != (cfg.tp or 1):
                raise FormatError("args has no vocab_size / make_vocab_size_divisible_by: the padded vocabulary "
                                  "at another TP is unknown", self.src)
            padded = cfg.padded_vocab_size
        else:
            padded = config.padded_vocab(vocab, divisible, t.tp)
        source_distributed = (bool(cfg.use_distributed_optimizer) if cfg.use_distributed_optimizer is not None
                              else any(r.distrib is not None for r in self.ranks))
        self.distributed = source_distributed if t.distributed is None else t.distributed
        raw.update({"tensor_model_parallel_size": t.tp, "pipeline_model_parallel_size": t.pp,
                    "expert_model_parallel_size": t.ep, "data_parallel_size": t.dp, "world_size": world,
                    "context_parallel_size": cp,
                    "padded_vocab_size": padded, "use_distributed_optimizer": self.distributed})
        for key, value in (("expert_tensor_parallel_size", t.tp), ("transformer_pipeline_model_parallel_size", t.pp),
                           ("tensor_parallel_num_weight_shards", t.tp),
                           ("expert_tensor_parallel_num_weight_shards", t.tp),
                           ("make_vocab_size_divisible_by", divisible)):
            if key in raw:
                raw[key] = value
        self.args = raw
        self.tcfg = config.from_args(raw, self.src)
        self.padded = padded
        self.same_layout = (t.tp, t.pp, t.ep) == (cfg.tp or 1, cfg.pp or 1, cfg.ep or 1)
        self._vocab_rows()
        self._optimizer_parts()

    def _optimizer_parts(self) -> None:
        """The target's optimizer state_dict(s): one optimizer, or dense + expert (a ChainedOptimizer)
        when the experts have their own buffer (EP > 1 or ETP ≠ TP). All ranks hold the same param
        groups (mcore 0.19 aligns them over the world); a change of structure moves the groups."""
        src = self.ranks[0].obj.get("optimizer")
        parts = [self._opt_state(p) for p in (src if isinstance(src, list) else [src])]
        before = len(parts) == 2
        after = bool(self.cfg.num_experts) and self.tcfg.experts_in_own_buffer()
        self.chained = after
        if before == after:
            self.opt_parts = parts
            return
        if before:  # EP > 1 → EP 1: the expert groups join the dense ones with their identifiers
            dense, expert = parts
            for g in expert["optimizer"]["param_groups"]:
                twin = self._twin(dense["optimizer"]["param_groups"], g, False)
                differ = [k for k in legacy._GROUP_AGREE if twin.get(k) != g.get(k)]
                if differ:
                    raise FormatError(f"the expert param group {_ident(g)} has other {differ} than the dense group it "
                                      "joins at EP 1: statekit does not choose", self.src)
            self.opt_parts = [dense]
            self.notes.append("EP 1: the experts are in the dense optimizer (the expert groups joined the dense groups "
                              "of the same identifiers, their hyperparameters and step checked equal)")
            return
        # EP 1 → EP > 1: an expert group per identifier the expert parameters have, from its dense twin
        (dense,) = parts
        wanted = []
        for p in self.params.values():
            if p.expert:
                ident = legacy._group_identity(_AsLocal(p), self.cfg, False)
                if ident not in wanted:
                    wanted.append(ident)
        groups = dense["optimizer"]["param_groups"]
        expert = [dict(self._twin(groups, {**ident, "is_expert_parallel": False}, False), is_expert_parallel=True)
                  for ident in wanted]
        order = {id(g): i for i, g in enumerate(groups)}
        expert.sort(key=lambda g: order[id(self._twin(groups, {**g, "is_expert_parallel": False}, False))])
        self.opt_parts = [dense, {**{k: v for k, v in dense.items() if k != "optimizer"},
                                  "optimizer": {"param_groups": expert}}]
        self.notes.append("EP > 1: the experts get their own optimizer (a ChainedOptimizer member), its groups the dense "
                          "groups of the same identifiers marked is_expert_parallel")

    def _twin(self, groups: list[dict], g: dict, expert: bool) -> dict:
        keys = ("wd_mult", "lr_mult", "is_decoupled_lr")
        hits = [h for h in groups if all(h.get(k, d) == g.get(k, d) for k, d in zip(keys, (1.0, 1.0, False),
                                                                                    strict=True))
                and bool(h.get("is_expert_parallel")) == expert]
        if len(hits) != 1:
            raise FormatError(f"param group {_ident(g)}: {len(hits)} groups of the other optimizer have its identifiers; "
                              "statekit does not guess", self.src)
        return hits[0]

    def _vocab_rows(self) -> None:
        for name, p in self.params.items():
            if not shard.VOCAB_ROWS.search(name):
                continue
            rows = p.weight.shape[0]
            if rows == self.padded:
                continue
            if rows > self.padded:
                for what, ref in (("weight", p.weight), ("fp32 master", p.master),
                                  *((s, p.moments[s]) for s in SLOTS)):
                    n = shard.rows_zero(ref.numpy(), self.padded)
                    if n:
                        raise FormatError(
                            f"parameter {name}: vocabulary padding rows {self.padded}-{rows - 1} hold {n} nonzero "
                            f"{what} elements, and at TP {self.t.tp} with make_vocab_size_divisible_by "
                            f"{self.args.get('make_vocab_size_divisible_by')} the padded vocabulary is {self.padded}: "
                            "statekit does not drop them (pass --vocab-divisible-by so the padded vocabulary keeps "
                            f"{rows} rows, and run Megatron with the same --make-vocab-size-divisible-by)", self.src)
                self.notes.append(f"{name}: padding rows {self.padded}-{rows - 1} (all zero) removed")
            else:
                self.notes.append(f"{name}: padding rows {rows}-{self.padded - 1} added, zero (as Megatron fills them)")

    # ---- one rank
    def rank_keys(self, pp: int, ep: int) -> list[tuple[str, str]]:
        """(global name, local name) of every model-state key of rank folder (pp, ep), in order."""
        out = []
        layers = self.cfg.num_layers
        for name in self.keys:
            where = shard.place(name, self.cfg, layers, self.t.pp, self.t.ep)
            if where.pp != pp or (where.ep is not None and where.ep != ep):
                continue
            out.append((name, where.local))
        return out

    def tensor(self, p: _Param, ref: TensorRef, tp_rank: int) -> TensorRef:
        """The lazy rank-``tp_rank`` shard of one of ``p``'s tensors (vocabulary rows resized first)."""
        name, tp = p.name, self.t.tp
        swiglu = shard.is_swiglu_fc1(name, self.cfg)
        vocab = bool(shard.VOCAB_ROWS.search(name))
        shape = list(ref.shape)
        if vocab:
            shape[0] = self.padded
        known, axis = legacy.tp_axis(name)
        if tp > 1 and not known:
            raise FormatError(f"parameter {name}: statekit knows no TP axis for it (TP {tp}); refusing to guess")
        if axis is not None and tp > 1:
            if shape[axis] % tp:
                raise FormatError(f"parameter {name}: axis {axis} of {shape[axis]} does not split into TP {tp}")
            shape[axis] //= tp
        rows = self.padded if vocab else (ref.shape[0] if ref.shape else None)
        return _shard_ref(ref, rows, name, tp if axis is not None else 1, tp_rank, axis, swiglu, tuple(shape))

    def layout(self, local: list[tuple[str, _Param]], pp: int, expert_part: bool | None):
        """The buffers of one rank's optimizer member: [(key, BufferLayout, {local name: param})]."""
        tcfg = self.tcfg
        sep = tcfg.experts_in_own_buffer()
        lp = []
        for lname, p in local:
            is_exp = p.expert and sep
            if expert_part is not None and is_exp != expert_part:
                continue
            shape = tuple(self._local_shape(p))
            shared = self.tied and self.t.pp > 1 and lname.endswith(("word_embeddings.weight", "output_layer.weight"))
            lp.append(buckets.LayoutParam(lname, shape, p.weight.dtype, p.expert, shared))
        num_parameters = sum(math.prod(self._local_shape(p)) for _, p in local)
        size = tcfg.bucket_size(num_parameters, pp, 0)
        dp = tcfg.expert_dp_size() if expert_part else tcfg.dp_cp_size()
        split = buckets.split_buffers(lp, bool(tcfg.grad_reduce_in_fp32), sep)
        return [(key, buckets.layout_buffer(members, size, dp, buckets.rule(">=0.8"),
                                            bool(tcfg.pad_buckets_for_high_nccl_busbw))) for key, members in split.items()]

    def _local_shape(self, p: _Param) -> list[int]:
        shape = list(p.weight.shape)
        if shard.VOCAB_ROWS.search(p.name):
            shape[0] = self.padded
        known, axis = legacy.tp_axis(p.name)
        if axis is not None and self.t.tp > 1:
            shape[axis] //= self.t.tp
        return shape

    def coalesced(self, layout: buckets.BufferLayout, by_local: dict[str, _Param], tp_rank: int, slot: str):
        total = layout.numel_unpadded
        order = sorted(layout.placements.values(), key=lambda pl: pl.coalesced)

        def chunks(size: int):
            at = 0
            for pl in order:
                if pl.coalesced > at:
                    yield bytes(4 * (pl.coalesced - at))
                p = by_local[pl.name]
                ref = p.master if slot == "param" else p.moments[slot]
                shard_ref = self.tensor(p, ref, tp_rank)
                if shard_ref.numel != pl.numel or shard_ref.dtype != "F32":
                    raise FormatError(f"parameter {p.name}: its {slot} shard is {shard_ref.dtype} of "
                                      f"{shard_ref.numel} elements, the layout {pl.numel} F32")
                yield from shard_ref.iter_bytes(size)
                at = pl.coalesced + pl.numel
            if total > at:
                yield bytes(4 * (total - at))

        def runs():  # the shards' runs at their places, zeros between (None where one's are not known)
            out: list = []
            at = 0
            for pl in order:
                p = by_local[pl.name]
                shard_ref = self.tensor(p, p.master if slot == "param" else p.moments[slot], tp_rank)
                got = file_runs(shard_ref)
                if got is None or pl.coalesced < at or shard_ref.numel != pl.numel or shard_ref.dtype != "F32":
                    return None  # (the chunks refuse what does not fit, with the message)
                extend_runs(out, ([4 * (pl.coalesced - at)] if pl.coalesced > at else []) + got)
                at = pl.coalesced + pl.numel
            return extend_runs(out, [4 * (total - at)] if total > at else [])

        return TensorRef("F32", (total,), loader=lambda: b"".join(chunks(PIECE)), chunk_reader=chunks, runs=runs)

    def rank_objects(self, tp_rank: int, pp: int, ep: int) -> tuple[dict, object]:
        keys = self.rank_keys(pp, ep)
        model = {}
        local: list[tuple[str, _Param]] = []
        for name, lname in keys:
            p = self.params.get(name)
            if p is None:
                model[lname] = self.keys[name]
                continue
            w = self.tensor(p, p.weight, tp_rank)
            model[lname] = w
            local.append((lname, p))
        first = self.ranks[0].obj
        opt_parts = self.opt_parts
        fields = dict(self.args)
        if "rank" in fields:  # the rank that writes this folder (DP rank 0), Megatron's default order tp-cp-ep-dp-pp
            t, cp = self.t, self.tcfg.cp or 1
            fields["rank"] = tp_rank + t.tp * ep + t.tp * cp * t.dp * pp if ep == 0 else \
                tp_rank + t.tp * ep + t.tp * t.ep * self.tcfg.expert_dp_size() * pp
            if "local_rank" in fields:
                fields["local_rank"] = fields["rank"]
        args = Record("argparse.Namespace", fields)
        obj = {"args": args, "checkpoint_version": first.get("checkpoint_version", 3.0),
               "iteration": first.get("iteration"), "model": model,
               "optimizer": None}
        parts = opt_parts if self.distributed else self._plain_parts(local, tp_rank)
        obj["optimizer"] = parts if self.chained else parts[0]
        for key in ("opt_param_scheduler", "lr_scheduler"):
            if key in first:
                obj[key] = first[key]
        if self.same_layout:
            src_rank = next(r for r in self.ranks if (r.where.tp, r.where.pp, r.where.ep) == (tp_rank, pp, ep))
            if "rng_state" in src_rank.obj:
                obj["rng_state"] = src_rank.obj["rng_state"]
        for key in ("rerun_state_machine", "num_floating_point_operations_so_far"):
            if key in first:
                obj[key] = first[key]
        if not self.distributed:
            return obj, None
        by_local = dict(local)
        members = [False, True] if self.chained else [None]
        dist = []
        for index, expert_part in enumerate(members):
            if expert_part is False and ep != 0:
                dist.append(None)  # the dense state is EP rank 0's (Megatron writes None elsewhere)
                continue
            entry: dict = {}
            for g, (key, lay) in enumerate(self.layout(local, pp, expert_part)):
                dtype_key = (_torch_dtype(key.param_dtype), _torch_dtype(key.grad_dtype))
                tensors = {s: self.coalesced(lay, by_local, tp_rank, s) for s in ("param", *SLOTS)}
                tensors["numel_unpadded"] = lay.numel_unpadded
                entry[g] = {dtype_key: tensors}
            dist.append({"buckets_coalesced": True, **entry})
            del index
        return obj, dist if self.chained else dist[0]

    def _plain_parts(self, local: list[tuple[str, _Param]], tp_rank: int) -> list[dict]:
        """The non-distributed optimizer's state_dict(s) (``Float16OptimizerWithFloat16Params``): torch's
        state keyed by ids numbering each group's parameters in order (Megatron's group rule over the
        rank's registration order), a ``step`` tensor per parameter, and ``fp32_from_fp16_params``
        (per group, the half-precision parameters' masters)."""
        sep = self.tcfg.experts_in_own_buffer()
        members = [False, True] if self.chained else [None]
        out = []
        for part, expert_part in zip(self.opt_parts, members, strict=True):
            groups = [{k: v for k, v in g.items() if k != "step"} for g in part["optimizer"]["param_groups"]]
            steps = {g.get("step") for g in part["optimizer"]["param_groups"]}
            if len(steps) != 1 or None in steps:
                raise FormatError(f"the param groups' steps are {sorted(map(str, steps))}: statekit does not choose "
                                  "one per parameter", self.src)
            (step,) = steps
            held: list[list[_Param]] = [[] for _ in groups]
            for lname, p in local:
                if expert_part is not None and bool(p.expert and sep) != expert_part:
                    continue
                g = legacy._match_group(legacy._group_identity(_AsLocal(p), self.tcfg, sep), groups, lname, self.src)
                held[g].append(p)
            state: dict[int, dict] = {}
            masters: list[list[TensorRef]] = []
            pid = 0
            for group, params in zip(groups, held, strict=True):
                group["params"] = list(range(pid, pid + len(params)))
                halves = []
                for p in params:
                    state[pid] = {"step": TensorRef.from_array(np.array(step, dtype=np.float32)),
                                  **{s: self.tensor(p, p.moments[s], tp_rank) for s in SLOTS}}
                    if p.weight.dtype != "F32":
                        halves.append(self.tensor(p, p.master, tp_rank))
                    pid += 1
                masters.append(halves)
            extra = {k: v for k, v in part.items() if k != "optimizer"}
            out.append({"optimizer": {"state": state, "param_groups": groups}, "fp32_from_fp16_params": masters,
                        **extra})
        return out

    def grid(self) -> list[tuple[int, int, int]]:
        t = self.t
        return [(tp, pp, ep) for pp in range(t.pp) for ep in range(t.ep) for tp in range(t.tp)]

    def folders(self) -> list[str]:
        return [rank_folder(tp, pp, ep, self.t) for tp, pp, ep in self.grid()]

    def _opt_state(self, part: object) -> object:
        if part is None:
            return None
        inner = part.get("optimizer", part)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.get("param_groups", [])]
        if any("step" not in g for g in groups):
            # the non-distributed optimizer keeps torch's step per parameter; the distributed one's
            # state_dict folds the one step of all its parameters into every group (as a float)
            steps = {p.step for p in self.ckpt.optimizer.params}
            if len(steps) != 1 or None in steps:
                raise FormatError(f"the parameters' steps are {sorted(map(str, steps))}: the distributed "
                                  "optimizer keeps one step, so statekit does not choose", self.src)
            (step,) = steps
            for g in groups:
                g.setdefault("step", float(step))
        out = {k: v for k, v in part.items() if k not in ("optimizer", "fp32_from_fp16_params")}
        return {"optimizer": {"param_groups": groups}, **out}


@dataclass
class _AsLocal:
    """A whole-model parameter as :func:`.legacy._group_identity` reads one (name, weight, expert)."""

    p: _Param

    @property
    def name(self) -> str:
        return self.p.name

    @property
    def weight(self) -> TensorRef:
        return self.p.weight

    @property
    def expert(self) -> bool:
        return self.p.expert


def _ident(g: dict) -> dict:
    return {k: g.get(k) for k in legacy._GROUP_IDENTITY}


def _torch_dtype(name: str):
    from statekit.formats.torch_pickle.dtype_table import STATEKIT_TO_TORCH, TorchDtype

    return TorchDtype(STATEKIT_TO_TORCH[name])


def rank_folder(tp: int, pp: int, ep: int, target: Target) -> str:
    name = f"mp_rank_{tp:02d}"
    if target.pp > 1:
        name += f"_{pp:03d}"
    if target.ep > 1:
        name += f"_{ep:03d}"
    return name


def source_sizes(src: str) -> dict[str, int]:
    """The source's TP, PP, EP and DP (from its args), for sizes the caller leaves unset."""
    reader = legacy._Reader(src)
    folders = container.rank_dirs(reader.iteration)
    file = os.path.join(reader.iteration, folders[0], container.MODEL_FILE)
    obj = container.load(file)
    if not isinstance(obj, dict) or "args" not in obj:
        raise FormatError("no args in model_optim_rng.pt: the run's parallel layout is unknown", file)
    cfg = config.from_args(obj["args"], file)
    return {"tp": cfg.tp or 1, "pp": cfg.pp or 1, "ep": cfg.ep or 1, "dp": cfg.need("dp", "the source's DP size"),
            "cp": cfg.cp or 1}


def check(src: str, out: str, target: Target) -> _Writer:
    """Everything :func:`write` refuses, refused before anything is written; the prepared writer."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{out}: exists and is not an empty folder; statekit writes a new save root")
    w = _Writer(src, target)
    source_distributed = w.cfg.use_distributed_optimizer is not False
    if w.distributed != source_distributed:
        w.notes.append("the source used the " + ("distributed" if source_distributed else "non-distributed")
                       + " optimizer; the target is written in the " + ("distributed" if w.distributed else
                                                                         "non-distributed")
                       + " form (run Megatron " + ("with" if w.distributed else "without")
                       + " --use-distributed-optimizer)")
    if not w.same_layout:
        w.notes.append("TP, PP or EP changed: no rng_state is written (it belongs to a rank); run Megatron with "
                       "--no-load-rng")
    return w


def write(src: str, out: str, target: Target) -> Result:
    """Write the legacy checkpoint ``src`` to the new save root ``out`` at ``target``'s sizes
    (``out`` must not exist; it appears whole or not at all)."""
    w = check(src, out, target)
    iteration = os.path.basename(os.path.normpath(w.reader.iteration))
    parent = os.path.dirname(os.path.abspath(out)) or "."
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.statekit-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    result = Result(out, notes=w.notes)
    try:
        os.makedirs(os.path.join(tmp, iteration))
        for tp, pp, ep in w.grid():
            folder = rank_folder(tp, pp, ep, target)
            full = os.path.join(tmp, iteration, folder)
            os.makedirs(full)
            obj, dist = w.rank_objects(tp, pp, ep)
            torch_pt.save_pt(obj, os.path.join(full, container.MODEL_FILE))
            if dist is not None:
                torch_pt.save_pt(dist, os.path.join(full, container.DISTRIB_FILE))
            result.folders.append(folder)
            result.nbytes += sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full))
        with open(os.path.join(tmp, container.TRACKER), "w") as fh:
            fh.write(str(w.ckpt.metadata.get("megatron.iteration", "")) if iteration.startswith("iter_")
                     else "release")
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
