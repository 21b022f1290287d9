"""The distributed optimizer's bucket space: which elements of a buffer are which parameter's.

Megatron's distributed optimizer keeps each model chunk's trainable parameters in contiguous
buffers, one per (param dtype, grad dtype, expert-parallel) key, cut into buckets that are split
evenly over the DP×CP ranks. The layout follows from the ordered parameters and a few settings
(``/work/shared/docs/megatron-formats.md`` §1.5; Megatron's
``DistributedOptimizer._compute_per_buffer_param_layout``, ``param_and_grad_buffer.py``):

1. **the parameters** in ``named_parameters()`` order (``requires_grad`` only), split into
   buffers by :class:`BufferKey` keeping their relative order (:func:`split_buffers`). A reader
   takes the order from the model state in the same checkpoint: the legacy ``model`` dict's order
   minus TE ``_extra_state`` entries and buffers (``router.expert_bias``) — the state_dict lists
   parameters in registration order. That order is *taken*, not trusted: :mod:`.proof` checks
   every parameter's fp32 master against its stored weight before its state is named.
2. the buffer is laid out **in reverse** (the last-registered parameter at offset 0);
3. each parameter's **start** is padded to a multiple of :attr:`Rule.param_align` (64 from
   mcore 0.8, 1 before);
4. a bucket **closes** once ``param_end − bucket_start ≥ bucket_size`` (``bucket_size`` None: one
   bucket); a parameter marked ``shared_embedding`` (a tied embedding / output weight with PP > 1)
   closes the bucket before it (at its padded start) and gets a bucket of its own;
5. a closed bucket's **end** is padded to a multiple of :meth:`Rule.end_divisor` (DP before 0.7,
   ``lcm(DP, 128)`` from 0.7, ``lcm(DP, 128, 2^16)`` with ``pad_buckets_for_high_nccl_busbw``);
   the next bucket starts there. A bucket's ``numel_unpadded`` is its closing end minus its start
   (the 64-element gaps inside included);
6. DP rank ``r`` owns elements ``[start + r·S, start + (r+1)·S)`` of each bucket,
   ``S = (end − start) / DP`` (:meth:`BufferLayout.rank_pieces`);
7. the coalesced form (legacy ``distrib_optim.pt`` from 0.7) drops each bucket's end padding: a
   parameter sits at ``start − bucket.start + Σ numel_unpadded(earlier buckets)``
   (:attr:`Placement.coalesced`).

The API (pure: no file, no torch; stable, ``mcore-dist`` builds on it):

- ``LayoutParam(name, shape, dtype, expert=False, shared_embedding=False)``;
- ``RULES`` / ``rule(name)``: the version rules ``"<=0.6"``, ``"0.7"``, ``">=0.8"``;
- ``split_buffers(params, grad_reduce_in_fp32, experts_separate) -> {BufferKey: [LayoutParam]}``;
- ``layout_buffer(params, bucket_size, dp, rule, pad_for_busbw=False) -> BufferLayout``;
- ``BufferLayout``: ``placements`` (by name), ``buckets``, ``numel``, ``numel_unpadded``,
  ``rank_pieces(name)``, ``check_numel_unpadded(n, what)``, ``check_buckets(...)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from statekit.errors import FormatError


@dataclass(frozen=True)
class Rule:
    """One mcore release range's padding rules."""

    name: str
    param_align: int  # a parameter's start is a multiple of this
    end_lcm_128: bool  # bucket ends padded to lcm(DP, 128) (else to DP)
    coalesced: bool  # the legacy distrib_optim.pt drops bucket-end padding (one tensor per buffer)

    def end_divisor(self, dp: int, pad_for_busbw: bool = False) -> int:
        if not self.end_lcm_128:
            return dp
        return math.lcm(dp, 128, 2**16) if pad_for_busbw else math.lcm(dp, 128)


RULES: dict[str, Rule] = {
    "<=0.6": Rule("<=0.6", 1, False, False),  # core 0.4-0.6: ends padded to DP, per-bucket world tensors
    "0.7": Rule("0.7", 1, True, True),  # core 0.7: lcm(DP, 128), coalesced file
    ">=0.8": Rule(">=0.8", 64, True, True),  # core 0.8+: plus 64-element parameter starts
}


def rule(name: str) -> Rule:
    try:
        return RULES[name]
    except KeyError:
        raise FormatError(f"unknown bucket layout rule {name!r} (known: {', '.join(RULES)})") from None


@dataclass(frozen=True)
class LayoutParam:
    """A parameter as the layout sees it: name, (local) shape, statekit dtype, flags."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: bool = False  # an expert parameter (MoE ``experts.``)
    shared_embedding: bool = False  # a tied embedding / output weight with PP > 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferKey:
    param_dtype: str
    grad_dtype: str
    expert: bool  # the expert-parallel buffer (allreduce=False)


def split_buffers(params: Sequence[LayoutParam], grad_reduce_in_fp32: bool,
                  experts_separate: bool) -> dict[BufferKey, list[LayoutParam]]:
    """The buffers of one model chunk, in the order Megatron creates them (first seen), each with
    its parameters in registration order. ``experts_separate``: expert parameters have their own
    buffer (EP > 1 or ETP ≠ TP, :meth:`.config.MegatronConfig.experts_in_own_buffer`)."""
    out: dict[BufferKey, list[LayoutParam]] = {}
    for p in params:
        grad = "F32" if grad_reduce_in_fp32 else p.dtype
        key = BufferKey(p.dtype, grad, bool(p.expert and experts_separate))
        out.setdefault(key, []).append(p)
    return out


@dataclass(frozen=True)
class Placement:
    """Where one parameter lies: buffer elements ``[start, end)``, in ``bucket``."""

    name: str
    start: int
    end: int
    bucket: int
    bucket_offset: int  # start − the bucket's start (its place in a per-bucket tensor)
    coalesced: int  # its first element in the coalesced tensor (bucket-end padding dropped)

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int
    end: int  # padded
    numel_unpadded: int
    params: tuple[str, ...]  # in layout (reversed) order

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class BufferLayout:
    """One buffer's layout (see the module docstring)."""

    dp: int
    rule: Rule
    bucket_size: int | None
    placements: dict[str, Placement] = field(default_factory=dict)  # in layout order
    buckets: list[Bucket] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def describe(self) -> str:
        size = "no bucket size" if self.bucket_size is None else f"bucket size {self.bucket_size}"
        return f"rule {self.rule.name}, DP×CP {self.dp}, {size}, {len(self.buckets)} bucket(s)"

    def rank_pieces(self, name: str) -> list[tuple[int, int, int, int, int]]:
        """The DP ranks' pieces of parameter ``name``: ``(bucket, rank, local_lo, param_lo, n)`` —
        ``n`` elements of the parameter (flat, from ``param_lo``) at ``local_lo`` of that rank's
        shard of that bucket (shards ignore parameter boundaries)."""
        p = self.placements[name]
        b = self.buckets[p.bucket]
        shard = b.numel // self.dp
        out = []
        lo = p.start
        while lo < p.end:
            rank, local = divmod(lo - b.start, shard)
            n = min(p.end - lo, shard - local)
            out.append((b.index, rank, local, lo - p.start, n))
            lo += n
        return out

    def check_numel_unpadded(self, stored: object, what: str) -> None:
        """The stored ``numel_unpadded`` must be the layout's (else the settings or the parameter
        list differ from the run's): FormatError naming ``what``, both numbers and the layout."""
        if stored != self.numel_unpadded:
            raise FormatError(f"{what}: numel_unpadded is {stored!r}, the layout of the model's parameters gives "
                              f"{self.numel_unpadded} ({self.describe()}): the parameter list or the bucket "
                              "settings in args are not the run's")

    def check_buckets(self, numel: Sequence[int] | None, numel_unpadded: Sequence[int] | None, what: str) -> None:
        """``per_bucket_numel`` / ``per_bucket_numel_unpadded`` as stored (either may be None)."""
        if numel is not None and list(numel) != [b.numel for b in self.buckets]:
            raise FormatError(f"{what}: per_bucket_numel is {list(numel)}, the layout gives "
                              f"{[b.numel for b in self.buckets]} ({self.describe()})")
        if numel_unpadded is not None and list(numel_unpadded) != [b.numel_unpadded for b in self.buckets]:
            raise FormatError(f"{what}: per_bucket_numel_unpadded is {list(numel_unpadded)}, the layout gives "
                              f"{[b.numel_unpadded for b in self.buckets]} ({self.describe()})")


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def layout_buffer(params: Sequence[LayoutParam], bucket_size: int | None, dp: int, rule: Rule,
                  pad_for_busbw: bool = False) -> BufferLayout:
    """The layout of one buffer holding ``params`` (registration order; laid out reversed)."""
    if dp < 1:
        raise FormatError(f"data-parallel size {dp} is not positive")
    out = BufferLayout(dp=dp, rule=rule, bucket_size=bucket_size)
    divisor = rule.end_divisor(dp, pad_for_busbw)
    raw: list[tuple[str, int, int, int]] = []  # name, start, end, bucket
    buckets: list[tuple[int, int, int, list[str]]] = []  # start, end (padded), unpadded, names
    start = bucket_start = 0
    members: list[str] = []

    def close(end: int) -> int:
        nonlocal bucket_start, members
        padded = _pad(end, divisor)
        buckets.append((bucket_start, padded, end - bucket_start, members))
        bucket_start, members = padded, []
        return padded

    for p in reversed(params):
        start = _pad(start, rule.param_align)
        if p.shared_embedding and members:
            start = close(start)
        end = start + p.numel
        raw.append((p.name, start, end, len(buckets)))
        members.append(p.name)
        if (bucket_size is not None and end - bucket_start >= bucket_size) or p.shared_embedding:
            start = close(end)
        else:
            start = end
    if members:
        close(raw[-1][2])
    before = 0
    for index, (b_start, b_end, unpadded, names) in enumerate(buckets):
        out.buckets.append(Bucket(index, b_start, b_end, unpadded, tuple(names)))
    offsets = []
    for b in out.buckets:
        offsets.append(before)
        before += b.numel_unpadded
    for name, s, e, bucket in raw:
        if name in out.placements:
            raise FormatError(f"parameter {name} is listed twice in one buffer")
        b = out.buckets[bucket]
        out.placements[name] = Placement(name, s, e, bucket, s - b.start, offsets[bucket] + s - b.start)
    return out
