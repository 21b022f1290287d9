"""verify-resume from a Megatron checkpoint: its state as megatron-core's Adam continues it, paired piece by piece.

A Megatron state keeps three slots per parameter: ``exp_avg``, ``exp_avg_sq`` and ``fp32_master``. The master
is what megatron-core's Adam steps (the model's bf16 weight is its rounding, :mod:`statekit.optim.megatron`):
it is the *parameter* of the replay, not a slot of the state, so verify-resume (whose parameters are its
seeded ones) steps the moments over it in the ``megatron`` flavor. A state stepped by TE/apex FusedAdam (its
groups keep ``adam_w_mode`` / ``bias_correction``) is refused unless ``--flavor-original`` says which
arithmetic to run: statekit does not model that CUDA kernel.

The sides pair by what the conversion did, never by a second map:

- Megatron → Hugging Face (a Trainer folder, an ``optimizer.pt``): through the structural map ``convert`` uses
  (:func:`statekit.ops.megatron_hf.build`: q/k/v rows per query group, ``linear_fc1`` into gate/up, norms
  renamed, vocabulary padding rows dropped, stacked experts, a tied pipeline copy dropped once it equals the
  embedding). Each Hugging Face tensor is compared against *its* elements of the Megatron parameters (the
  map's pieces, read lazily, one target at a time): Adam is elementwise, so those elements stepped alone are
  exactly the rows Megatron's step gives them. A moment row moved elsewhere diverges at that tensor, and the
  report names the element there and in the Megatron parameter.
- Megatron → Megatron (other TP / PP / DP / EP sizes): by name. Megatron pads the vocabulary to a multiple of
  ``make_vocab_size_divisible_by × TP``, so the embedding and the output layer may have other padding rows:
  compared on the rows both hold, and rows the conversion added must step as a fresh state (zeros, what
  Megatron's own load puts there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from statekit import naming
from statekit.errors import MappingError, UsageError
from statekit.formats import registry as formats
from statekit.ops.pairing import Pairing
from statekit.optim import megatron as megatron_optim
from statekit.state import Checkpoint, ParamState
from statekit.structure.pieces import TargetMap

VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class Prepared:
    """Both sides as verify-resume steps them, their pairs, notes, and each side's flavor."""

    original: Checkpoint
    migrated: Checkpoint
    pairs: list[Pairing]
    notes: list[str] = field(default_factory=list)
    flavors: tuple[str | None, str | None] = (None, None)


def is_megatron(ckpt: Checkpoint) -> bool:
    return formats.framework_of(ckpt.format) == "megatron"


def prepare(original: Checkpoint, migrated: Checkpoint, flavors: tuple[str | None, str | None] = (None, None)
            ) -> Prepared | None:
    """None unless ``original`` is a Megatron checkpoint; else both sides without their masters, paired."""
    if not is_megatron(original):
        if is_megatron(migrated):
            raise UsageError(f"{migrated.path}: a Megatron checkpoint is compared against the Megatron checkpoint it "
                             "was converted from (give that as ORIGINAL); from another framework statekit does not "
                             "pair it yet")
        return None
    a, notes = _masterless(original, flavors[0], "--flavor-original")
    if is_megatron(migrated):
        b, more = _masterless(migrated, flavors[1], "--flavor-migrated")
        pairs = _by_name(a, b)
        notes += more + ["paired by name (both Megatron); the embedding and output layer on the vocabulary rows both "
                         "hold, rows the conversion added stepped as a fresh state"]
        return Prepared(a, b, pairs, notes, (megatron_optim.MEGATRON, megatron_optim.MEGATRON))
    a, pairs, more = _through_map(a, migrated)
    return Prepared(a, migrated, pairs, notes + more, (megatron_optim.MEGATRON, None))


def refuse_fused(ckpt: Checkpoint, flavor: str | None, flag: str) -> None:
    """A state TE/apex FusedAdam stepped is refused unless ``flag`` (a flavor option) says which arithmetic to run:
    statekit replays megatron-core's torch Adam/AdamW, not that CUDA kernel."""
    fused = megatron_optim.fused_adam(ckpt.optimizer.groups) if ckpt.optimizer is not None else None
    if fused is not None and flavor is None:
        raise MappingError(f"its param groups hold {fused!r}: the run stepped with TransformerEngine/apex FusedAdam, "
                           "whose CUDA arithmetic statekit does not replay (it replays megatron-core's torch "
                           f"Adam/AdamW); say which arithmetic to run with {flag}", ckpt.path)


def _masterless(ckpt: Checkpoint, flavor: str | None, flag: str) -> tuple[Checkpoint, list[str]]:
    """``ckpt`` with each parameter's fp32 master taken out of its slots (it is the parameter Megatron's Adam
    steps) and a tied pipeline copy of the embedding dropped once equal (:func:`megatron_hf.drop_tied_copy`)."""
    from statekit.ops import megatron_hf

    state = ckpt.optimizer
    if state is None:
        raise UsageError(f"{ckpt.path}: holds no optimizer state")
    refuse_fused(ckpt, flavor, flag)
    params = [replace(p, slots={k: v for k, v in p.slots.items() if k != naming.MASTER_SLOT}) for p in state.params]
    groups = [replace(g, keys=list(g.keys), hyperparams=dict(g.hyperparams)) for g in state.groups]
    state = replace(state, params=params, groups=groups)
    notes = []
    tied = megatron_hf.drop_tied_copy(state, ckpt.metadata, ckpt.path)
    if tied:
        notes.append(tied)
    if any(naming.MASTER_SLOT in p.slots for p in ckpt.optimizer.params):
        notes.append(f"{ckpt.path}: the fp32 masters are the parameters megatron-core's Adam steps (its bf16 "
                     "weights their rounding); the moments and step are compared")
    return replace(ckpt, optimizer=state), notes


def _by_name(a: Checkpoint, b: Checkpoint) -> list[Pairing]:
    """Megatron → Megatron pairs by name; the vocabulary tensors on the rows both hold."""
    by_path = {p.path: p for p in b.optimizer.params if p.path}
    pairs = []
    for p in a.optimizer.params:
        m = by_path.get(p.path)
        pr = Pairing(p.path, p, m, False, via="path")
        if m is not None and tuple(m.shape or ()) != tuple(p.shape or ()):
            sa, sb = tuple(p.shape or ()), tuple(m.shape or ())
            if p.path not in VOCAB_TENSORS or len(sa) != 2 or len(sb) != 2 or sa[1] != sb[1]:
                raise MappingError(f"{p.path}: {list(sa)} in {a.path}, {list(sb)} here: not the same parameter "
                                   "(only the vocabulary tensors' padding rows change with TP)", b.path)
            pr.kept = (min(sa[0], sb[0]), sa[1])
        pairs.append(pr)
    return pairs


def _through_map(a: Checkpoint, migrated: Checkpoint) -> tuple[Checkpoint, list[Pairing], list[str]]:
    """The Megatron state ``a`` as the Hugging Face tensors of convert's map (each tensor's state assembled lazily
    from its pieces of the Megatron parameters), paired with ``migrated``'s tensors of those names."""
    from statekit.ops import megatron_hf

    state = a.optimizer
    shapes = {p.path: tuple(p.shape) for p in state.params if p.path and p.shape is not None}
    structure = megatron_hf.build(a.metadata, shapes, a.path)
    by_src = {p.path: p for p in state.params}
    by_dst = {p.path: p for p in migrated.optimizer.params if p.path}
    params, pairs = [], []
    for path in structure.order or list(structure.targets):
        t = structure.targets[path]
        p = _assembled(t, [by_src[s] for s in t.sources], a.path)
        params.append(p)
        m = by_dst.get(path)
        if m is not None and tuple(m.shape or ()) != t.shape:
            raise MappingError(f"{path}: {list(m.shape or ())} here, but the Megatron → Hugging Face map makes it "
                               f"{list(t.shape)} from {', '.join(t.sources)}", migrated.path)
        pairs.append(Pairing(path, p, m, False, via="map", origin=Origin(t, {s: shapes[s] for s in t.sources})))
    view = replace(state, params=params, groups=[replace(g, keys=[]) for g in state.groups])
    for p in params:
        view.groups[p.group].keys.append(p.key)
    notes = [f"paired through the map convert uses ({structure.notes[0]}): each tensor against its elements of "
             "the Megatron parameters"]
    extra = sorted(set(by_dst) - set(structure.targets))
    if extra:
        notes.append(f"{len(extra)} tensors of {migrated.path} come from no Megatron parameter: {', '.join(extra[:3])}")
    return replace(a, optimizer=view), pairs, notes


def _assembled(t: TargetMap, sources: list[ParamState], where: str) -> ParamState:
    """The state of the Hugging Face tensor ``t`` read from its Megatron ``sources`` (lazy, slot by slot)."""
    from statekit.structure.apply import assembled

    steps = {s.step for s in sources}
    groups = {s.group for s in sources}
    names = {tuple(sorted(s.slots)) for s in sources}
    if len(steps) > 1 or len(groups) > 1 or len(names) > 1:
        raise MappingError(f"{t.path} is made from {', '.join(t.sources)}, whose steps {sorted(map(str, steps))}, "
                           f"groups {sorted(groups)} or slots {sorted(names)} differ: one tensor has one of each",
                           where)
    first = sources[0]
    slots = {name: assembled(t, {s.path: s.slots[name] for s in sources}, "F32") for name in first.slots}
    return ParamState(key=t.path, path=t.path, step=first.step, slots=slots, group=first.group,
                      declared_shape=t.shape, family=first.family, candidates=first.candidates)


@dataclass(frozen=True)
class Origin:
    """Where a Hugging Face tensor came from: its target map and the shapes of the Megatron parameters it reads."""

    target: TargetMap
    shapes: dict[str, tuple[int, ...]]

    def describe(self, index: tuple[int, ...] | None = None) -> str:
        """The Megatron parameters the tensor reads; with ``index``, the one element of theirs it holds there."""
        found = source_element(self.target, index) if index is not None else None
        if found is None:
            return ", ".join(self.target.sources)
        name, flat = found
        return f"{name} element {list(_unflat(flat, self.shapes[name]))}"


def source_element(t: TargetMap, index: tuple[int, ...]) -> tuple[str, int] | None:
    """The Megatron parameter and flat element that element ``index`` of ``t`` is written from, else None."""
    flat, acc = 0, 1
    for i, n in zip(reversed(index), reversed(t.shape), strict=True):
        flat += i * acc
        acc *= n
    for piece in t.pieces:
        rest, at = flat - piece.dst_offset, []
        for k in sorted(range(len(piece.shape)), key=lambda k: -piece.dst_strides[k]):
            q = rest // piece.dst_strides[k] if piece.dst_strides[k] > 0 else 0
            at.append((k, q))
            rest -= q * piece.dst_strides[k]
        if rest == 0 and all(0 <= q < piece.shape[k] for k, q in at):
            return piece.source, piece.src_offset + sum(q * piece.src_strides[k] for k, q in at)
    return None


def _unflat(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))
