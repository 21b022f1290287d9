"""Megatron legacy checkpoints (``iter_N/mp_rank_*/model_optim_rng.pt`` [+ ``distrib_optim.pt``])
→ one :class:`~statekit.state.OptimizerState` of the whole model.

For every rank folder (TP × PP × EP; the DP×CP replicas wrote nothing of their own: the
distributed optimizer gathered them) statekit reads, lazily:

- the rank's **model** state (``model``, or ``model0``, ``model1``… with virtual pipeline chunks):
  its parameters in registration order, TE ``_extra_state`` entries and buffers left out
  (:data:`BUFFER_ENDINGS`);
- its **optimizer** state in one of the forms of ``/work/shared/docs/megatron-formats.md`` §1.3–1.4:
  the non-distributed ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` state (torch ids →
  parameters by the param groups, masters from ``fp32_from_fp16_params``), or the distributed
  optimizer's ``distrib_optim.pt`` in bucket space (coalesced, mcore ≥ 0.7; per bucket, 0.4–0.6),
  cut back into parameters by :mod:`.buckets`; a ChainedOptimizer's list (dense + expert);
- then **proves** every parameter's master against its weight (:mod:`.proof`) before any moment is
  called that parameter's.

The rank-local parameters are then named globally (:mod:`.names`: stage-local layer indices and
local expert indices made global) and joined over TP along each parameter's TP axis
(:data:`TP_AXES`; SwiGLU ``linear_fc1`` joins each rank's ``[W_r; V_r]`` as ``[W_0 … W_T-1;
V_0 … V_T-1]``), lazily: reading a joined tensor streams its shards in bounded pieces.

Group membership for the distributed optimizer (whose saved param groups list no parameters) follows
Megatron's default rule (``_get_param_groups``): no weight decay (``wd_mult`` 0) for biases and
1-D parameters (q/k layernorms excepted with ``apply_wd_to_qk_layernorm``), ``is_decoupled_lr`` for
the embedding and output weights when ``decoupled_lr`` is set, ``is_expert_parallel`` for experts;
each parameter joins the one saved group with those identifiers, or the read is refused.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from statekit import dtypes, naming
from statekit.errors import FormatError
from statekit.formats import megatron_legacy as container
from statekit.formats.torch_pickle import TorchDtype
from statekit.frameworks.megatron import buckets, config, names, proof
from statekit.frameworks.megatron.names import _FC1, TP_AXES, tp_axis  # noqa: F401 (the TP axes: names.py)
from statekit.lazy import numpy as np
from statekit.state import Checkpoint, ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import PIECE, FileSpan, TensorRef, cut_runs, file_runs, spanned_ref

FORMAT = "megatron-legacy"
MASTER = naming.MASTER_SLOT
SLOTS = ("exp_avg", "exp_avg_sq")
BUFFER_ENDINGS = ("_extra_state", ".expert_bias", ".local_tokens_per_expert", ".inv_freq")
_EXPERT = re.compile(r"\.mlp\.experts\.")

# a param group's identifiers (how Megatron matches groups on load) and what must agree across folders
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_GROUP_AGREE = ("lr", "weight_decay", "max_lr", "min_lr", "step", "betas", "eps")



# --------------------------------------------------------------------------------- lazy views


def _read(ref: TensorRef, lo: int, n: int) -> bytes | memoryview:
    if ref.span is not None and ref.loader is None and ref.array_loader is None:
        return ref.span.read(lo, n)
    return ref.raw()[lo:lo + n]


def _slice(flat: TensorRef, lo: int, shape: tuple[int, ...], what: str) -> TensorRef:
    """Elements ``[lo, lo + prod(shape))`` of a 1-D fp32 tensor, shaped (a sub-span: nothing read)."""
    n = math.prod(shape)
    if lo < 0 or lo + n > flat.numel:
        raise FormatError(f"{what}: needs elements [{lo}, {lo + n}) of a tensor of {flat.numel}: the file is "
                          "shorter than the layout")
    item = dtypes.itemsize(flat.dtype)
    if flat.span is not None:
        return spanned_ref(flat.dtype, tuple(shape), {}, FileSpan.at(flat.span.file, flat.span.offset + lo * item,
                                                                        n * item))
    return TensorRef(flat.dtype, tuple(shape), loader=lambda: flat.raw()[lo * item:(lo + n) * item])


def joined(parts: list[TensorRef], axis: int | None, swiglu: bool = False) -> TensorRef:
    """The tensor the TP shards ``parts`` are, joined along ``axis`` (None: replicated, rank 0's);
    ``swiglu``: each shard is ``[W_r; V_r]`` on axis 0, the whole ``[W_0…; V_0…]``. Lazy: bytes are
    produced in bounded pieces."""
    first = parts[0]
    if axis is None or len(parts) == 1:
        return first
    dtype, item = first.dtype, dtypes.itemsize(first.dtype)
    shape = list(first.shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    if axis == 0:
        segments: list[tuple[TensorRef, int, int]] = []
        if swiglu:
            for half in (0, 1):
                for p in parts:
                    size = p.nbytes // 2
                    segments.append((p, half * size, size))
        else:
            segments = [(p, 0, p.nbytes) for p in parts]

        def chunks(size: int) -> Iterator[bytes | memoryview]:
            size = max(item, (size or PIECE) // item * item)
            for ref, lo, n in segments:
                for a in range(lo, lo + n, size):
                    yield _read(ref, a, min(size, lo + n - a))

        def runs():  # each segment's bytes of its shard's runs, in order
            out: list = []
            for ref, lo, n in segments:
                got = file_runs(ref)
                if got is None or not cut_runs(got, lo, n, out):
                    return None
            return out

        return TensorRef(dtype, tuple(shape), loader=lambda: b"".join(bytes(c) for c in chunks(PIECE)),
                         chunk_reader=chunks, info={"megatron_tp_join": f"axis 0 of {len(parts)}"}, runs=runs)
    outer = math.prod(shape[:axis])
    widths = [math.prod(p.shape[axis:]) for p in parts]
    row = sum(widths)
    bits = np.dtype(f"<u{item}")  # (copied as bit patterns: a bf16 shard needs no bf16 type)

    def chunks(size: int) -> Iterator[bytes | memoryview]:
        size = max(item, (size or PIECE) // item * item)
        rows = max(1, size // (row * item))
        for a in range(0, outer, rows):
            b = min(outer, a + rows)
            blocks = [np.frombuffer(_read(p, a * w * item, (b - a) * w * item), dtype=bits).reshape(b - a, w)
                      for p, w in zip(parts, widths, strict=True)]
            block = memoryview(np.concatenate(blocks, axis=1).reshape(-1).view(np.uint8))
            for lo in range(0, len(block), size):  # (one row wider than a piece: cut)
                yield block[lo:lo + size]

    return TensorRef(dtype, tuple(shape), loader=lambda: b"".join(bytes(c) for c in chunks(PIECE)),
                     chunk_reader=chunks, info={"megatron_tp_join": f"axis {axis} of {len(parts)}"})


# ------------------------------------------------------------------------------- rank records


@dataclass
class Local:
    """One parameter of one rank's model chunk."""

    name: str  # as the rank names it (local indices)
    weight: TensorRef
    chunk: int
    expert: bool
    group: int | None = None  # index into the run's global group list
    master: TensorRef | None = None
    moments: dict[str, TensorRef] = field(default_factory=dict)
    step: int | float | None = None


@dataclass
class Rank:
    folder: str
    where: names.RankDir
    obj: dict
    chunks: list[list[Local]]
    distrib: object = None


def _as_dict(value: object, what: str, path: str) -> dict:
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise FormatError(f"{what} holds {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a dict", path)
    return value


def _chunks(obj: dict, path: str) -> list[dict]:
    if "model" in obj:
        return [_as_dict(obj["model"], "model", path)]
    found = []
    while f"model{len(found)}" in obj:
        found.append(_as_dict(obj[f"model{len(found)}"], f"model{len(found)}", path))
    if not found:
        raise FormatError("no model state (model / model0…): the parameter order is unknown", path)
    return found


def is_buffer(name: str, value: object) -> bool:
    """TE ``_extra_state`` entries and the buffers of :data:`BUFFER_ENDINGS` (no optimizer state)."""
    return (not isinstance(value, TensorRef) or name.endswith(BUFFER_ENDINGS)
            or not dtypes.is_float(value.dtype))


def _locals(chunk: dict, index: int, path: str) -> list[Local]:
    out = []
    for name, value in chunk.items():
        if not isinstance(name, str):
            raise FormatError(f"model state key {name!r} is not a string", path)
        if is_buffer(name, value):
            continue
        out.append(Local(name, value, index, bool(_EXPERT.search(name))))
    return out


# ---------------------------------------------------------------------------------- groups


def _group_identity(p: Local, cfg: config.MegatronConfig, experts_separate: bool) -> dict[str, object]:
    one_d = len(p.weight.shape) == 1
    qk_norm = ("q_layernorm" in p.name or "k_layernorm" in p.name) and bool(cfg.raw.get("apply_wd_to_qk_layernorm"))
    no_wd = (p.name.endswith(".bias") or one_d) and not qk_norm
    emb = p.name.endswith(("word_embeddings.weight", "output_layer.weight"))
    decoupled = emb and cfg.decoupled_lr is not None
    return {"wd_mult": 0.0 if no_wd else 1.0, "is_decoupled_lr": decoupled,
            "is_expert_parallel": bool(p.expert and experts_separate)}


def _match_group(identity: dict, groups: list[dict], name: str, path: str) -> int:
    """The one saved group (index) whose identifiers are ``identity``'s (a lone group holds everything)."""
    hits = []
    for i, g in enumerate(groups):
        ok = True
        for key, want in identity.items():
            if key in g and g[key] != want:
                ok = False
        if ok:
            hits.append(i)
    if len(groups) == 1:
        hits = [0]
    if len(hits) != 1:
        shown = ", ".join(f"{k}={v}" for k, v in identity.items())
        raise FormatError(f"parameter {name}: Megatron's group rule gives {shown}, which "
                          f"{'no' if not hits else 'more than one'} saved param group has (groups: "
                          f"{[{k: g.get(k) for k in identity} for g in groups]}); statekit does not guess its group",
                          path)
    return hits[0]


# ------------------------------------------------------------------------- optimizer forms


def _optimizer_parts(obj: dict, path: str) -> list[dict | None]:
    opt = obj.get("optimizer")
    if opt is None:
        raise FormatError("no optimizer state in model_optim_rng.pt (saved with --no-save-optim?)", path)
    return list(opt) if isinstance(opt, list) else [opt]


def _inner(part: dict, path: str) -> dict:
    inner = part.get("optimizer", part)
    return _as_dict(inner, "optimizer.optimizer", path)


def _group_step(group: dict) -> int | float | None:
    step = group.get("step")
    if isinstance(step, TensorRef):
        return step.numpy().reshape(-1)[0].item()
    return step if isinstance(step, int | float) and not isinstance(step, bool) else None


def _distrib_parts(rank: Rank, n: int) -> list[object]:
    d = rank.distrib
    parts = list(d) if isinstance(d, list) else [d]
    if len(parts) != n:
        raise FormatError(f"{container.DISTRIB_FILE} holds {len(parts)} optimizer states, model_optim_rng.pt "
                          f"{n}", os.path.join(rank.folder, container.DISTRIB_FILE))
    return parts


def _buffer_tensors(entry: dict, what: str, path: str) -> tuple[dict[str, TensorRef], object]:
    tensors = {}
    for key in ("param", *SLOTS):
        ref = entry.get(key)
        if not isinstance(ref, TensorRef) or ref.dtype != "F32" or len(ref.shape) != 1:
            raise FormatError(f"{what}: {key!r} is not a 1-D fp32 tensor", path)
        tensors[key] = ref
    return tensors, entry.get("numel_unpadded")


def _dtype_name(key: object) -> str:
    if isinstance(key, TorchDtype):
        return key.name
    if isinstance(key, tuple):
        return "(" + ", ".join(_dtype_name(k) for k in key) + ")"
    return repr(key)


class _Reader:
    def __init__(self, path: str):
        self.path = path
        self.iteration = container.iteration_dir(path)
        if self.iteration is None and os.path.isfile(os.path.join(path, container.TRACKER)):
            inner = os.path.join(path, container.read_tracker(path))  # (its own one-line refusal first)
            raise FormatError(f"{container.TRACKER} names {os.path.basename(inner)}, which holds no "
                              f"mp_rank_*/{container.MODEL_FILE}", path)
        if self.iteration is None:
            raise FormatError("not a Megatron legacy checkpoint folder (no mp_rank_*/model_optim_rng.pt, no "
                              f"{container.TRACKER})", path)
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self._pending: list[tuple] = []
        self.proved = 0
        self.proved_elements = 0
        self.forms: set[str] = set()
        self.rules: set[str] = set()

    # ---- folders
    def ranks(self) -> list[Rank]:
        folders = container.rank_dirs(self.iteration)
        first_file = os.path.join(self.iteration, folders[0], container.MODEL_FILE)
        first = _as_dict(container.load(first_file), container.MODEL_FILE, first_file)
        if "args" not in first:
            raise FormatError("no args in model_optim_rng.pt: the run's parallel layout is unknown", first_file)
        self.cfg = config.from_args(first["args"], first_file)
        self.first = first
        ranks = []
        for folder in folders:
            where = names.parse_rank_dir(folder, self.cfg)
            full = os.path.join(self.iteration, folder)
            file = os.path.join(full, container.MODEL_FILE)
            obj = first if folder == folders[0] else _as_dict(container.load(file), container.MODEL_FILE, file)
            chunks = [_locals(c, i, file) for i, c in enumerate(_chunks(obj, file))]
            rank = Rank(full, where, obj, chunks)
            distrib = os.path.join(full, container.DISTRIB_FILE)
            if os.path.isfile(distrib):
                rank.distrib = container.load(distrib)
            ranks.append(rank)
        tp, pp, ep = (self.cfg.tp or 1), (self.cfg.pp or 1), (self.cfg.ep or 1)
        have = {(r.where.tp, r.where.pp, r.where.ep) for r in ranks}
        missing = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in have]
        extra = sorted(have - {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)})
        if missing or extra:
            what = (f"rank folders for (tp, pp, ep) {missing[:4]} are missing" if missing
                    else f"rank folders {extra[:4]} lie outside TP {tp} × PP {pp} × EP {ep}")
            raise FormatError(f"{what} (args: TP {tp}, PP {pp}, EP {ep})", self.iteration)
        if self.cfg.etp is not None and self.cfg.etp != tp:
            raise FormatError(f"args.expert_tensor_parallel_size {self.cfg.etp} differs from TP {tp}: statekit "
                              "reads legacy expert shards only with ETP = TP", self.iteration)
        return ranks

    # ---- the per-rank optimizer state
    def fill(self, rank: Rank, groups_out: list[dict]) -> None:
        file = os.path.join(rank.folder, container.MODEL_FILE)
        parts = _optimizer_parts(rank.obj, file)
        params = [p for chunk in rank.chunks for p in chunk]
        experts_separate = self.cfg.experts_in_own_buffer()
        dense = [p for p in params if not (p.expert and experts_separate)]
        expert = [p for p in params if p.expert and experts_separate]
        if len(parts) > 1 and self.cfg.overlap_param_gather_with_optimizer_step:
            raise FormatError("a ChainedOptimizer with overlap_param_gather_with_optimizer_step (one optimizer per "
                              "model chunk): statekit reads dense (+ expert) chains only", file)
        if len(parts) == 1:
            members = [params]
        elif len(parts) == 2:
            members = [dense, expert]
        else:
            raise FormatError(f"a ChainedOptimizer of {len(parts)} members; statekit reads dense (+ expert) only",
                              file)
        distributed = (rank.distrib is not None if self.cfg.use_distributed_optimizer is None
                       else self.cfg.use_distributed_optimizer)
        if distributed and rank.distrib is None:
            raise FormatError(f"args.use_distributed_optimizer is set but {container.DISTRIB_FILE} is missing",
                              rank.folder)
        distrib_parts = _distrib_parts(rank, len(parts)) if distributed else [None] * len(parts)
        for index, (part, mine, dpart) in enumerate(zip(parts, members, distrib_parts, strict=True)):
            expert_part = len(parts) == 2 and index == 1
            if part is None:
                continue
            part = _as_dict(part, "optimizer", file)
            inner = _inner(part, file)
            groups = inner.get("param_groups")
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                raise FormatError("optimizer.optimizer.param_groups is not a list of dicts", file)
            gmap = self._global_groups(index, groups, groups_out, file)
            if distributed:
                if dpart is None:  # not this optimizer's DP-rank-0 folder: the dense state is EP rank 0's (§1.4)
                    if mine and (expert_part or rank.where.ep == 0):
                        raise FormatError(f"optimizer {index}'s state is None in {container.DISTRIB_FILE} although "
                                          "this folder has its parameters", rank.folder)
                    continue
                for p in mine:
                    local = _match_group(_group_identity(p, self.cfg, experts_separate), groups, p.name, file)
                    p.group, p.step = gmap[local], _group_step(groups[local])
                self._distributed(rank, mine, _as_dict(dpart, container.DISTRIB_FILE,
                                                       os.path.join(rank.folder, container.DISTRIB_FILE)), expert_part)
            else:
                self._plain(rank, mine, part, inner, groups, gmap, file, experts_separate)

    def _global_groups(self, index: int, groups: list[dict], out: list[dict], file: str) -> list[int]:
        """This folder's groups of optimizer ``index`` as indices into the run's group list ``out``,
        matched by their identifiers (as Megatron matches groups on load, not by position); a group
        first seen here is added."""
        mapping = []
        seen_here: set = set()
        for g in groups:
            ident = (index, *((k, g.get(k)) for k in _GROUP_IDENTITY))
            if ident in seen_here:
                raise FormatError(f"optimizer {index} has two param groups with {dict(ident[1:])}: statekit does not "
                                  "guess which one a parameter is in", file)
            seen_here.add(ident)
            shown = {k: v for k, v in g.items() if k != "params"}
            at = self._group_index.get(ident)
            if at is None:
                at = self._group_index[ident] = len(out)
                out.append(shown)
            else:
                differ = [k for k in _GROUP_AGREE if out[at].get(k) != shown.get(k)]
                if differ:
                    raise FormatError(f"optimizer {index}'s param group {dict(ident[1:])} has other {differ} here than "
                                      "in another rank folder", file)
            mapping.append(at)
        return mapping

    # ---- non-distributed (§1.3)
    def _plain(self, rank: Rank, mine: list[Local], part: dict, inner: dict, groups: list[dict], gmap: list[int],
               file: str, experts_separate: bool) -> None:
        self.forms.add("non-distributed optimizer (torch ids by param group, fp32_from_fp16_params)")
        state = _as_dict(inner.get("state", {}), "optimizer.optimizer.state", file)
        masters = part.get("fp32_from_fp16_params")
        members: list[list[Local]] = [[] for _ in groups]
        for p in mine:
            g = _match_group(_group_identity(p, self.cfg, experts_separate), groups, p.name, file)
            members[g].append(p)
        for g, group in enumerate(groups):
            ids = group.get("params")
            if not isinstance(ids, list):
                raise FormatError(f"param_groups[{g}] has no params list", file)
            if len(ids) != len(members[g]):
                raise FormatError(f"param_groups[{g}] holds {len(ids)} parameters; Megatron's group rule puts "
                                  f"{len(members[g])} of this rank's model there", file)
            halves = [p for p in members[g] if p.weight.dtype != "F32"]
            group_masters = None
            if halves:
                if not isinstance(masters, list) or g >= len(masters) or len(masters[g]) != len(halves):
                    raise FormatError(f"fp32_from_fp16_params[{g}] does not list this group's {len(halves)} "
                                      "half-precision parameters", file)
                group_masters = iter(masters[g])
            step = _group_step(group)
            for pid, p in zip(ids, members[g], strict=True):
                p.group = gmap[g]
                entry = state.get(pid, state.get(str(pid)))
                p.master = next(group_masters) if p.weight.dtype != "F32" else p.weight
                if not isinstance(p.master, TensorRef):
                    raise FormatError(f"parameter {p.name}: its fp32 master is not a tensor", file)
                p.step = step
                if entry is None:
                    continue
                entry = _as_dict(entry, f"state[{pid}]", file)
                for slot in SLOTS:
                    ref = entry.get(slot)
                    if isinstance(ref, TensorRef):
                        if tuple(ref.shape) != tuple(p.weight.shape):
                            raise FormatError(f"parameter {p.name}: state[{pid}].{slot} has shape {list(ref.shape)}, "
                                              f"the weight {list(p.weight.shape)}: the id order is not the rule's", file)
                        p.moments[slot] = ref
                if "step" in entry:
                    raw = entry["step"]
                    p.step = raw.numpy().reshape(-1)[0].item() if isinstance(raw, TensorRef) else raw
                unknown = sorted(set(entry) - {*SLOTS, "step"})
                if unknown:
                    raise FormatError(f"parameter {p.name}: optimizer state fields {unknown} are not Adam's", file)
            self._prove_all(members[g], f"the id order of param group {g} (Megatron's group rule over the model's "
                                        "parameter order)", file)

    # ---- distributed (§1.4)
    def _distributed(self, rank: Rank, mine: list[Local], dpart: dict, expert_part: bool) -> None:
        file = os.path.join(rank.folder, container.DISTRIB_FILE)
        coalesced = dpart.get("buckets_coalesced") is True
        dp = self.cfg.expert_dp_size() if expert_part else self.cfg.dp_cp_size()
        gbuf = 0
        for chunk in range(len(rank.chunks)):
            chunk_params = [p for p in mine if p.chunk == chunk]
            layout_params = [buckets.LayoutParam(p.name, tuple(p.weight.shape), p.weight.dtype, p.expert,
                                                 self._shared_embedding(p, rank)) for p in chunk_params]
            split = buckets.split_buffers(layout_params, bool(self.cfg.grad_reduce_in_fp32),
                                          self.cfg.experts_in_own_buffer())
            num_parameters = sum(p.weight.numel for c in rank.chunks for p in c)
            size = self.cfg.bucket_size(num_parameters, rank.where.pp, chunk)
            by_name = {p.name: p for p in chunk_params}
            for key, members in split.items():
                entry = dpart.get(gbuf)
                what = f"buffer {gbuf} ({key.param_dtype}, grad {key.grad_dtype}{', expert' if key.expert else ''})"
                if not isinstance(entry, dict) or len(entry) != 1:
                    raise FormatError(f"{what}: no single (param dtype, grad dtype) entry "
                                      f"(keys {list(dpart)[:6]})", file)
                ((dtype_key, tensors),) = entry.items()
                tensors = _as_dict(tensors, f"{what} {_dtype_name(dtype_key)}", file)
                if coalesced:
                    self._coalesced(members, by_name, tensors, size, dp, what, file)
                else:
                    self._per_bucket(members, by_name, tensors, size, dp, what, file, dpart)
                gbuf += 1
        stray = [k for k in dpart if isinstance(k, int) and k >= gbuf]
        if stray:
            raise FormatError(f"buffers {stray} in the file; the model's parameters make {gbuf}", file)

    def _shared_embedding(self, p: Local, rank: Rank) -> bool:
        tied = self.cfg.untie_embeddings is False
        if not tied or (self.cfg.pp or 1) == 1:
            return False
        return p.name.endswith(("word_embeddings.weight", "output_layer.weight"))

    def _coalesced(self, members, by_name, tensors, size, dp, what, file) -> None:
        flat, stored = _buffer_tensors(tensors, what, file)
        tried = []
        for rule_name in (">=0.8", "0.7"):
            layout = buckets.layout_buffer(members, size, dp, buckets.rule(rule_name),
                                           bool(self.cfg.pad_buckets_for_high_nccl_busbw))
            tried.append(f"{rule_name}: {layout.numel_unpadded}")
            if layout.numel_unpadded == stored:
                break
        else:
            raise FormatError(f"{what}: numel_unpadded is {stored!r}; the layout of the model's parameters gives "
                              f"{', '.join(tried)} (DP×CP {dp}, bucket size {size}): the parameter list or the bucket "
                              "settings in args are not the run's", file)
        for key, ref in flat.items():
            if ref.numel != stored:
                raise FormatError(f"{what}: {key!r} has {ref.numel} elements, numel_unpadded is {stored}", file)
        self.forms.add("distributed optimizer, coalesced buckets (mcore >= 0.7)")
        self.rules.add(f"{layout.rule.name}: {layout.describe()}")
        rule_text = (f"the bucket layout ({layout.describe()}; parameter order from the model state, reversed)")
        for name, place in layout.placements.items():
            p = by_name[name]
            shape = tuple(p.weight.shape)
            p.master = _slice(flat["param"], place.coalesced, shape, f"{what} param {name}")
            p.moments = {s: _slice(flat[s], place.coalesced, shape, f"{what} {s} {name}") for s in SLOTS}
        self._prove_all([by_name[n] for n in layout.placements], rule_text, file)
        owned = sorted((pl.coalesced, pl.coalesced + pl.numel) for pl in layout.placements.values())
        self._check_gaps(flat, [(0, owned, stored)], what, file)

    def _per_bucket(self, members, by_name, tensors, size, dp, what, file, dpart) -> None:
        layout = buckets.layout_buffer(members, size, dp, buckets.rule("<=0.6"))
        lists = {}
        for key in ("param", *SLOTS):
            value = tensors.get(key)
            if not isinstance(value, list) or len(value) != len(layout.buckets):
                raise FormatError(f"{what}: {key!r} is not a list of {len(layout.buckets)} bucket tensors "
                                  f"({layout.describe()})", file)
            for b, ref in zip(layout.buckets, value, strict=True):
                if not isinstance(ref, TensorRef) or ref.dtype != "F32" or ref.numel != b.numel:
                    got = ref.numel if isinstance(ref, TensorRef) else type(ref).__name__
                    raise FormatError(f"{what}: {key} bucket {b.index} holds {got} elements, the layout gives "
                                      f"{b.numel} ({layout.describe()})", file)
            lists[key] = value
        self.forms.add("distributed optimizer, per-bucket world tensors (mcore 0.4-0.6)")
        self.rules.add(f"{layout.rule.name}: {layout.describe()}")
        rule_text = f"the bucket layout ({layout.describe()}; parameter order from the model state, reversed)"
        for name, place in layout.placements.items():
            p = by_name[name]
            shape = tuple(p.weight.shape)
            p.master = _slice(lists["param"][place.bucket], place.bucket_offset, shape, f"{what} param {name}")
            p.moments = {s: _slice(lists[s][place.bucket], place.bucket_offset, shape, f"{what} {s} {name}")
                         for s in SLOTS}
        self._prove_all([by_name[n] for n in layout.placements], rule_text, file)
        for b in layout.buckets:
            owned = sorted((pl.bucket_offset, pl.bucket_offset + pl.numel) for pl in layout.placements.values()
                           if pl.bucket == b.index)
            self._check_gaps({k: v[b.index] for k, v in lists.items()}, [(0, owned, b.numel)], f"{what} bucket {b.index}",
                             file)

    def _check_gaps(self, tensors: dict[str, TensorRef], spans, what: str, file: str) -> None:
        """The elements no parameter owns (alignment gaps, padding) are zeros in a legacy file (Megatron
        fills its shards from ``torch.zeros``); a nonzero one is warned of, with how many."""
        for key, ref in tensors.items():
            nonzero = 0
            for _, owned, end in spans:
                at = 0
                for lo, hi in [*owned, (end, end)]:
                    if lo > at:
                        piece = _slice(ref, at, (lo - at,), what).numpy()
                        nonzero += int(np.count_nonzero(piece))
                    at = max(at, hi)
            if nonzero:
                self.warnings.append(f"{file}: {what}: {nonzero} {key} elements that no parameter owns (alignment "
                                     "gaps, padding) hold nonzero values; Megatron writes zeros there")

    def _prove_all(self, params: list[Local], rule_text: str, file: str) -> None:
        """Queue the proof of every parameter of ``params`` (run by :meth:`_run_proofs`)."""
        self._pending.extend((p.name, p.master, p.weight, rule_text, file) for p in params if p.master is not None)

    def _run_proofs(self) -> None:
        """Every queued proof, ``--jobs`` at a time (threads: numpy and ``pread`` release the GIL);
        the first failure in queue order is raised, so the message does not depend on timing."""
        pending, self._pending = self._pending, []
        results = proof.run_all(pending, stop_at_first=True)
        for outcome in results:
            if isinstance(outcome, proof.ProofError):
                raise outcome
        self.proved += len(results)
        self.proved_elements += sum(results)

    # ---- the whole model
    def read(self) -> Checkpoint:
        ranks = self.ranks()
        self.rank_records = ranks  # (kept: each rank's parameters with their pieces, for tests and tools)
        cfg = self.cfg
        self._group_index: dict[tuple, int] = {}
        groups_out: list[dict] = []
        for rank in ranks:
            self.fill(rank, groups_out)
        self._run_proofs()  # before any state is called a parameter's
        # the whole model's order: chunk by chunk (virtual stage, then pipeline rank: ascending layers),
        # each folder's registration order, an EP rank's experts after the lower EP ranks' of that layer
        entries = []
        for rank in ranks:
            for chunk in rank.chunks:
                blocks: dict[str, int] = {}
                for q, p in enumerate(chunk):
                    m = _EXPERT.search(p.name)
                    block = blocks.setdefault(p.name[:m.end()], q) if m else q
                    key = (p.chunk, rank.where.pp, block, rank.where.ep, q, rank.where.tp)
                    entries.append((key, rank, p))
        entries.sort(key=lambda e: e[0])
        merged: dict[str, dict[int, Local]] = {}
        for _key, rank, p in entries:
            vp_stage = p.chunk if cfg.vp else None
            name = names.globalize(p.name, cfg, rank.where.pp, vp_stage, rank.where.ep)
            slot = merged.setdefault(name, {})
            if rank.where.tp not in slot:  # (a dense parameter's replica in a later EP folder: EP rank 0's holds its state)
                slot[rank.where.tp] = p
        order = list(merged)
        state_params: list[ParamState] = []
        model = ModelInfo(order="named_parameters", source=self.path)
        tp = cfg.tp or 1
        for name in order:
            shards = merged[name]
            if sorted(shards) != list(range(tp)):
                raise FormatError(f"parameter {name}: TP shards {sorted(shards)} of {tp}", self.iteration)
            parts = [shards[t] for t in range(tp)]
            known, axis = tp_axis(name)
            if tp > 1 and not known:
                raise FormatError(f"parameter {name}: statekit knows no TP axis for it (TP {tp}); refusing to guess "
                                  "how its shards join", self.iteration)
            swiglu = bool(cfg.swiglu) and bool(_FC1.search(name)) and axis == 0
            shapes = {tuple(p.weight.shape) for p in parts}
            if axis is None and len(shapes) != 1:
                raise FormatError(f"parameter {name}: replicated over TP but its shards' shapes differ: {sorted(shapes)}",
                                  self.iteration)
            self._check_global(name, parts, axis)
            weight = joined([p.weight for p in parts], axis, swiglu)
            model.params.append(ModelParam(name, tuple(weight.shape), weight.dtype, index=len(model.params),
                                           tensor=weight))
            groups = {p.group for p in parts}
            if len(groups) != 1:
                raise FormatError(f"parameter {name}: its TP shards sit in different param groups {sorted(groups)}",
                                  self.iteration)
            ps = ParamState(key=name, index=len(state_params), path=name, group=parts[0].group or 0,
                            family=None, step=parts[0].step)
            if all(p.moments.keys() >= set(SLOTS) for p in parts):
                for slot in SLOTS:
                    ps.slots[slot] = joined([p.moments[slot] for p in parts], axis, swiglu)
            if all(p.master is not None for p in parts):
                ps.slots[MASTER] = joined([p.master for p in parts], axis, swiglu)
            ps.rank = len(weight.shape)
            state_params.append(ps)
        return self._checkpoint(state_params, groups_out, model)

    def _check_global(self, name: str, parts: list[Local], axis: int | None) -> None:
        """The joined shape against what args say the global shape is (where they say it)."""
        cfg = self.cfg
        shape = list(parts[0].weight.shape)
        if axis is not None:
            shape[axis] = sum(p.weight.shape[axis] for p in parts)
        want = None
        if name.endswith("linear_qkv.weight") and cfg.num_attention_heads and cfg.kv_channels:
            groups = cfg.num_query_groups or cfg.num_attention_heads
            want = ((cfg.num_attention_heads + 2 * groups) * cfg.kv_channels, 0)
        elif _FC1.search(name) and ".weight" in name and cfg.ffn_hidden_size and not _EXPERT.search(name):
            want = (cfg.ffn_hidden_size * (2 if cfg.swiglu else 1), 0)
        elif _FC1.search(name) and ".weight" in name and cfg.moe_ffn_hidden_size and _EXPERT.search(name):
            want = (cfg.moe_ffn_hidden_size * (2 if cfg.swiglu else 1), 0)
        elif name.endswith(("word_embeddings.weight", "output_layer.weight")) and cfg.padded_vocab_size:
            want = (cfg.padded_vocab_size, 0)
        if want is not None and shape[want[1]] != want[0]:
            raise FormatError(f"parameter {name}: its TP shards join to {shape}, args give {want[0]} rows",
                              self.iteration)

    def _checkpoint(self, params: list[ParamState], groups: list[dict], model: ModelInfo) -> Checkpoint:
        cfg = self.cfg
        opt = cfg.optimizer or "adam"
        if opt != "adam":
            raise FormatError(f"args.optimizer is {opt!r}: statekit reads Megatron's Adam state only", self.iteration)
        decoupled = cfg.raw.get("decoupled_weight_decay", True) is not False
        family = "adamw" if decoupled else "adam"
        for p in params:
            p.family = family
        state = OptimizerState(family=family, candidates=(family,), params=params, hyperparams_stored=True,
                               framework="torch")
        for g, hp in enumerate(groups):
            state.groups.append(ParamGroup(hyperparams=dict(hp), keys=[p.key for p in params if p.group == g],
                                           family=family))
        state.names_from = ("parameter names from the model state in the checkpoint, layer and expert indices made "
                            "global; every fp32 master proved against its stored weight bit for bit")
        state.notes.append(f"Megatron legacy checkpoint: {'; '.join(sorted(self.forms))}")
        state.notes.append(f"run: iteration {self.first.get('iteration')}, {_run_text(cfg)}")
        for rule in sorted(self.rules):
            state.notes.append(f"bucket layout {rule}")
        state.notes.append(f"proved: {self.proved} rank-local parameters, {self.proved_elements} elements "
                           "(fp32 master rounded to the weight's dtype == the stored weight)")
        state.notes.append(f"{family}: args.optimizer {opt!r}, decoupled weight decay {decoupled}; the fp32 master "
                           f"is slot {MASTER!r}")
        if cfg.untie_embeddings is False and (cfg.pp or 1) > 1:
            state.notes.append("tied embeddings with PP > 1: output_layer.weight is the last stage's copy of "
                               "embedding.word_embeddings.weight, with its own optimizer state")
        ckpt = Checkpoint(path=self.path, format=FORMAT, kind="optimizer", optimizer=state, model=model)
        ckpt.n_tensors = sum(len(p.slots) for p in params)
        ckpt.nbytes = sum(p.nbytes for p in params)
        ckpt.warnings.extend(self.warnings)
        first = self.first
        iteration = first.get("iteration")
        ckpt.metadata.update({"megatron.iteration": str(iteration),
                              "megatron.folder": os.path.basename(os.path.normpath(self.iteration)),
                              "megatron.checkpoint_version": str(first.get("checkpoint_version"))})
        if "num_floating_point_operations_so_far" in first:
            ckpt.metadata["megatron.flops_so_far"] = str(first["num_floating_point_operations_so_far"])
        ckpt.metadata.update(cfg.facts())
        for arg, since in cfg.version_signals().items():
            ckpt.metadata[f"megatron.signal.{arg}"] = since
        sched = first.get("opt_param_scheduler", first.get("lr_scheduler"))
        if isinstance(sched, dict):
            from statekit.frameworks.torch_state import describe_scheduler

            ckpt.schedulers = [{"kind": "megatron opt_param_scheduler (units: samples)", **describe_scheduler(sched)}]
            for k in ("num_steps", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
                if k in sched:
                    ckpt.metadata[f"megatron.scheduler.{k}"] = str(sched[k])
            from statekit.frameworks import schedule_megatron
            from statekit.frameworks.megatron.dist import _fields

            schedule_megatron.attach(ckpt, sched, _fields(first.get("args")), iteration, "model_optim_rng.pt")
        if isinstance(iteration, int):
            ckpt.scalars["iteration"] = iteration
        return ckpt


def _run_text(cfg: config.MegatronConfig) -> str:
    sizes = " · ".join(f"{k.upper()} {getattr(cfg, k) or 1}" for k in ("tp", "pp", "ep", "dp", "cp"))
    parts = [sizes + (f" · VP {cfg.vp}" if cfg.vp else "")]
    if cfg.num_layers:
        parts.append(f"{cfg.num_layers} layers")
    if cfg.hidden_size:
        parts.append(f"hidden {cfg.hidden_size}")
    if cfg.num_attention_heads:
        parts.append(f"{cfg.num_attention_heads} heads / {cfg.num_query_groups or cfg.num_attention_heads} query groups"
                     + (f" of {cfg.kv_channels}" if cfg.kv_channels else ""))
    if cfg.num_experts:
        parts.append(f"{cfg.num_experts} experts")
    if cfg.swiglu is not None:
        parts.append("SwiGLU" if cfg.swiglu else "no SwiGLU")
    if cfg.untie_embeddings is not None:
        parts.append("untied embeddings" if cfg.untie_embeddings else "tied embeddings")
    if cfg.padded_vocab_size:
        parts.append(f"padded vocab {cfg.padded_vocab_size}")
    parts.append({"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(_dtype_or(cfg), "precision unknown"))
    return ", ".join(parts)


def _dtype_or(cfg: config.MegatronConfig) -> str | None:
    try:
        return cfg.param_dtype
    except FormatError:
        return None


def open_checkpoint(path: str, **options) -> Checkpoint:
    """A Megatron legacy save root or iteration folder as one OptimizerState (see the module docstring)."""
    reader = _Reader(path)
    try:
        return reader.read()
    except FormatError as exc:
        if exc.path is None:
            exc.path = path
        raise
