"""bitsandbytes optimizer state_dicts ⇄ the neutral state model (docs/third-party.md).

bitsandbytes' optimizers save through ``torch.save`` like any torch optimizer, but each parameter's
state is its own: ``state1`` (and ``state2``), either float32 or uint8 codes with a 256-entry map
(``qmap1``/``qmap2``) and one scale per block (``absmax1``/``absmax2``), and a Python int ``step``.
bitsandbytes <= 0.49.1 wrote that entry flat; 0.49.2 nests the tensors under
``__bnb_optimizer_quant_state__`` (``step`` stays outside). The block size is read from the number
of scales (256 since 0.44, 2048 before). Parameters below ``min_8bit_size`` (4096 elements), and
those a ``GlobalOptimManager`` override keeps in 32 bits (transformers' Trainer does it for every
embedding), have float32 state inside an 8-bit optimizer: each parameter is read as it is stored.

The file does not name the optimizer: it is told from the state and the param group, as
bitsandbytes packs its hyperparameters (``betas`` holds SGD's momentum and dampening, RMSprop's
alpha and momentum, Adagrad's zeros; Lion and SGD store ``eps=0``). bitsandbytes' Adam and AdamW
are one kernel with decoupled weight decay: both read as ``adamw``.

Moments are exposed as float32 slots (``exp_avg`` …) that dequantize lazily, a bounded piece at a
time, exactly as bitsandbytes' ``dequantize_blockwise`` does (:mod:`statekit.optim.blockwise`);
``ParamState.encoding`` says how each was stored. Writing quantizes with bitsandbytes' CPU
quantizer (the one its 8-bit optimizers use on a CPU), also piece by piece.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from statekit.errors import FormatError, MappingError
from statekit.formats import limits, torch_pt
from statekit.frameworks import base
from statekit.lazy import numpy as np
from statekit.state import OptimizerState, ParamGroup, ParamState
from statekit.tensor import Elements, TensorRef


def _blockwise():
    """:mod:`statekit.optim.blockwise`, imported when a block is (de)quantized: reading which
    library wrote a torch file must not import the compute core (``statekit.optim``)."""
    from statekit.optim import blockwise

    return blockwise

FORMAT = "bnb"  # the registry's entry (also "bnb-flat", "bnb-2048": the older layouts)
LIBRARY = "bitsandbytes"
QUANT_KEY = "__bnb_optimizer_quant_state__"
MIN_8BIT_SIZE = 4096  # bitsandbytes' default min_8bit_size: smaller parameters keep 32-bit state
STATE_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
# keys of bitsandbytes states statekit does not read, with what they belong to
NOT_READ = {"unorm_vec": "LAMB/LARS's update norm", "max1": "non-blockwise 8-bit state (<= 0.49)",
            "max2": "non-blockwise 8-bit state (<= 0.49)", "new_max1": "non-blockwise 8-bit state (<= 0.49)",
            "new_max2": "non-blockwise 8-bit state (<= 0.49)", "gnorm_vec": "percentile clipping"}
ADAM_GROUP_KEYS = ("alpha", "t_alpha", "t_beta3")  # every Optimizer2State group since 0.44

# family → (the slot state1 holds, the slot state2 holds); AdEMAMix's state1 holds two
SLOTS: dict[str, tuple] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "ademamix": (("exp_avg", "exp_avg_slow"), "exp_avg_sq"),
    "lion": ("exp_avg",),
    "sgd": ("momentum_buffer",),
    "rmsprop": ("square_avg",),
    "adagrad": ("sum",),
}
CLASSES = {"adamw": "Adam8bit/AdamW8bit/PagedAdamW8bit/AdamW32bit …", "ademamix": "AdEMAMix8bit/AdEMAMix32bit",
           "lion": "Lion8bit/PagedLion8bit/Lion32bit", "sgd": "SGD8bit/SGD32bit",
           "rmsprop": "RMSprop8bit/RMSprop32bit", "adagrad": "Adagrad8bit/Adagrad32bit"}
MEANING = {"exp_avg": "first moment (m)", "exp_avg_sq": "second moment (v)",
           "exp_avg_slow": "AdEMAMix's slow first moment (m2, beta3)", "momentum_buffer": "momentum buffer",
           "square_avg": "running average of squared gradients", "sum": "sum of squared gradients"}
SIGNED = frozenset({"state1"})
UNSETTLED = "until --optimizer says which"  # the note of a family the file cannot tell (dropped once settled)  # bitsandbytes codes state1 with the signed map, state2 with the unsigned


@dataclass(frozen=True)
class Encoded:
    """How one slot is stored: ``field`` (``state1``), 8 or 32 bits, the block size, the tensors
    (``codes``: the uint8 codes or the float32 state as stored) and, for AdEMAMix, which half."""

    field: str
    bits: int
    block: int | None = None
    codes: TensorRef | None = None
    absmax: TensorRef | None = None
    qmap: TensorRef | None = None
    part: int | None = None

    @property
    def label(self) -> str:
        where = self.field if self.part is None else f"{self.field}[{self.part}]"
        if self.bits == 8:
            return f"{where} (8-bit, block {self.block})"
        return f"{where} (32-bit)"

    def describe(self) -> dict:
        out: dict = {"bits": self.bits}
        if self.bits == 8:
            n = self.field[-1]
            out.update(block=self.block, qmap=f"qmap{n}", absmax=f"absmax{n}",
                       map="signed" if self.field in SIGNED else "unsigned")
        if self.part is not None:
            out["part"] = self.part
        return out


def is_bnb(state_map: dict) -> bool:
    """Whether a torch state_dict's ``state`` was written by bitsandbytes."""
    return any(isinstance(e, dict) and (QUANT_KEY in e or "state1" in e) for e in state_map.values())


def stored_tensors(p: ParamState) -> list[TensorRef]:
    """The tensors of ``p`` as the file stores them (codes, maps, scales), each once."""
    seen: dict[int, TensorRef] = {}
    for enc in p.encoding.values():
        for ref in (enc.codes, enc.absmax, enc.qmap):
            if ref is not None:
                seen.setdefault(id(ref), ref)
    return list(seen.values())


# ----------------------------------------------------------------------------- reading


def _range(ref: TensorRef, start: int, count: int, step: int) -> Iterator[np.ndarray]:
    """Elements ``start .. start+count`` of ``ref`` (flat), in pieces of ``step``: bounded memory."""
    taker = Elements(ref.pieces(max(step, 1 << 16)))
    skip = start
    while skip > 0:
        got = taker.take(min(skip, 1 << 20)).size
        if not got:
            return
        skip -= got
    left = count
    while left > 0:
        piece = taker.take(min(step, left))
        if not piece.size:
            return
        left -= piece.size
        yield piece


def dequantized(codes: TensorRef, absmax: TensorRef, qmap: TensorRef, block: int, shape: tuple[int, ...],
                part: int = 0) -> TensorRef:
    """The float32 values of codes (``part``: AdEMAMix's half of a (2, …) state), lazily."""
    n = int(np.prod(shape)) if shape else 1
    nblocks = _blockwise().blocks(n, block)

    def pieces(elements: int) -> Iterator[np.ndarray]:
        k = max(1, elements // block)
        table = qmap.numpy().reshape(-1).astype(np.float32)
        scales = _range(absmax, part * nblocks, nblocks, k)
        for c in _range(codes, part * n, n, k * block):
            yield _blockwise().dequantize(c, next(scales), table, block)

    return TensorRef(dtype="F32", shape=tuple(shape), piece_source=pieces)


def _half(ref: TensorRef, part: int, shape: tuple[int, ...]) -> TensorRef:
    n = int(np.prod(shape)) if shape else 1
    return TensorRef(dtype=ref.dtype, shape=tuple(shape),
                     piece_source=lambda elements: _range(ref, part * n, n, max(1, elements)))


# How bitsandbytes 0.50's one-state optimizers pack their param group (Optimizer1State keeps lr,
# betas, eps, weight_decay and checks every beta in [0, 1)): SGD (momentum, dampening) with eps 0.0
# and momentum != 0; RMSprop (alpha, momentum) with its own eps and alpha != 0; Lion its betas with
# eps 0.0; Adagrad (0.0, 0.0) with its own eps. Values several of them can store are ambiguous.
ONE_STATE = ("adagrad", "lion", "rmsprop", "sgd")
PACKING = "SGD: betas (momentum ≠ 0, dampening), eps 0; RMSprop: betas (alpha ≠ 0, momentum), any eps; " \
          "Lion: betas (beta1, beta2), eps 0; Adagrad: betas (0, 0), any eps"


def group_candidates(betas: tuple, eps) -> tuple[str, ...]:
    """The one-state bitsandbytes optimizers that store ``betas``/``eps`` so (:data:`PACKING`)."""
    b0, b1 = betas
    fits = {"adagrad": b0 == 0 and b1 == 0, "lion": eps == 0, "rmsprop": b0 != 0, "sgd": eps == 0 and b0 != 0}
    return tuple(f for f in ONE_STATE if fits[f])


def _family(entries: list[dict], groups: list[dict]) -> tuple[str | None, tuple[str, ...], str]:
    """The family the state and groups show (None: unknown), the families it fits, and why it is
    not one: every group of one optimizer must fit it, so the candidates are those all fit."""
    keys = set().union(*(e.keys() for e in entries)) if entries else set()
    unread = sorted(k for k in keys if k in NOT_READ)
    if unread:
        return None, (), f"bitsandbytes state with {', '.join(unread)} ({NOT_READ[unread[0]]}): not read by statekit"
    two = {("state2" in e) for e in entries}
    if len(two) > 1:
        return None, (), "bitsandbytes state mixing one- and two-state parameters"
    families: set[str] = set()
    fits: list[tuple[tuple, object, tuple[str, ...]]] = []  # each one-state group: betas, eps, what fits
    for g in groups:
        betas = tuple(g.get("betas") or ())
        eps = g.get("eps")
        if two == {True} or (not entries and any(k in g for k in ADAM_GROUP_KEYS)):
            families.add("ademamix" if len(betas) == 3 else "adamw")
        elif len(betas) == 2 and isinstance(eps, (int, float)) and all(isinstance(b, (int, float)) for b in betas):
            fits.append((betas, eps, group_candidates(betas, eps)))
        else:
            return None, (), f"bitsandbytes param group without the betas/eps it packs its hyperparameters in: {sorted(g)}"
    if families and fits or len(families) > 1:
        return None, (), f"param groups of different bitsandbytes optimizers: {', '.join(sorted(families) or ['a one-state optimizer'])}"
    if families:
        return families.pop(), (), ""
    common = [f for f in ONE_STATE if all(f in c for _, _, c in fits)]
    seen = "; ".join(dict.fromkeys(f"betas {_num(b)}, eps {_num(e)}" for b, e, _ in fits))
    if not common:
        return None, (), f"bitsandbytes one-state param groups ({seen}) that no optimizer of it stores ({PACKING})"
    if len(common) == 1:
        return common[0], (), ""
    return None, tuple(common), (f"bitsandbytes stores no optimizer name, and {seen} fit {', '.join(common[:-1])} "
                                 f"and {common[-1]} alike")


def _num(v) -> str:
    return f"({', '.join(_num(x) for x in v)})" if isinstance(v, tuple) else f"{v:g}"


def _check_8bit(codes, absmax, qmap, where: str, n: int, path: str) -> int:
    for name, ref, dtype in (("absmax", absmax, "F32"), ("qmap", qmap, "F32")):
        if not isinstance(ref, TensorRef) or ref.dtype != dtype:
            raise FormatError(f"{where}: 8-bit state without a float32 {name}", path)
    if qmap.numel != 256:
        raise FormatError(f"{where}: its qmap has {qmap.numel} entries, not 256", path)
    rows = absmax.shape[0] if len(absmax.shape) == 2 else 1
    block = _blockwise().block_size(n, absmax.numel // rows)
    if block is None or absmax.numel % rows:
        raise FormatError(f"{where}: {absmax.numel} absmax values for {n} elements fit no bitsandbytes block size "
                          f"({' or '.join(map(str, _blockwise().BLOCK_SIZES))})", path)
    return block


def read_optimizer(sd: dict, path: str, step_value) -> OptimizerState:
    """A bitsandbytes state_dict (either layout) as an OptimizerState with float32 slots
    (``step_value``: how torch_state reads a step)."""
    state_map = sd["state"]
    raw_groups = sd["param_groups"]
    entries: dict[int, dict] = {}
    opaque: dict[int, dict] = {}
    for idx, entry in state_map.items():
        if not isinstance(entry, dict):
            raise FormatError(f"state[{idx}] is not a dict", path)
        flat = {k: v for k, v in entry.items() if k != QUANT_KEY}
        inner = entry.get(QUANT_KEY)
        if isinstance(inner, dict):
            flat.update(inner)
        elif inner is not None:
            opaque[idx] = {QUANT_KEY: inner}
        entries[idx] = flat
    family, candidates, why = _family([e for e in entries.values() if "state1" in e], raw_groups)
    params: list[ParamState] = []
    groups: list[ParamGroup] = []
    seen: set[int] = set()
    for g, group in enumerate(raw_groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise FormatError(f"param_groups[{g}] has no 'params' list", path)
        keys = []
        for idx in group["params"]:
            if not isinstance(idx, int) or idx in seen:
                raise FormatError(f"param_groups[{g}]: parameter id {idx!r} is not a fresh integer", path)
            seen.add(idx)
            p = ParamState(key=str(idx), index=idx, group=g, family=family)
            entry = entries.get(idx, entries.get(str(idx)))
            if entry is not None:
                _read_param(p, entry, family, f"state[{idx}]", path, step_value, bool(candidates))
            p.extra.update(opaque.get(idx, {}))
            if p.shape is not None:
                p.rank = len(p.shape)
            params.append(p)
            keys.append(p.key)
        names = group.get("param_names")
        if isinstance(names, list) and len(names) == len(keys):
            for p, name in zip(params[-len(keys):], names, strict=True):
                p.path = name
        groups.append(ParamGroup(hyperparams={k: v for k, v in group.items() if k not in ("params", "param_names")},
                                 keys=keys))
    layout = "nested (bitsandbytes >= 0.49.2)" if any(QUANT_KEY in e for e in state_map.values() if isinstance(e, dict)) \
        else "flat (bitsandbytes <= 0.49.1)"
    blocks_seen = sorted({enc.block for p in params for enc in p.encoding.values() if enc.block})
    notes = [f"bitsandbytes optimizer state, {layout} layout"
             + (f", 8-bit blocks of {' and '.join(map(str, blocks_seen))}" if blocks_seen else "")
             + (f": {CLASSES[family]}" if family else "")]
    if family in ONE_STATE or candidates:
        notes.append("bitsandbytes stores no optimizer name: its one-state optimizers are told apart by how they "
                     f"pack the param group ({PACKING})"
                     + (f"; this one fits {', '.join(candidates)}: {UNSETTLED}, its state1 is "
                        "kept under bitsandbytes' own name" if candidates else ""))
    label = (f"unknown ({why}; one of {', '.join(candidates)}: say which with --optimizer)" if candidates
             else None if family else f"unknown ({why})")
    nested = any(QUANT_KEY in e for e in state_map.values() if isinstance(e, dict))
    library_format = "bnb-2048" if 2048 in blocks_seen else "bnb" if nested else "bnb-flat"
    return OptimizerState(family=family, candidates=candidates or ((family,) if family else ()), params=params,
                          groups=groups, hyperparams_stored=True, framework="torch", notes=notes,
                          family_detail=label, library=LIBRARY, library_format=library_format,
                          slot_renames={f: {"state1": SLOTS[f][0]} for f in candidates})


def _read_param(p: ParamState, entry: dict, family: str | None, where: str, path: str, step_value,
                ambiguous: bool = False) -> None:
    odd = [k for k in entry if not isinstance(k, str)]  # (a None key is one: no None sentinel)
    if odd:  # bitsandbytes names every state field by a string
        raise FormatError(f"{where} has a key that is not a string: {limits.short(odd[0])}", path)
    for name, value in entry.items():
        if name == "step":
            p.step, p.extra["__step_dtype"] = step_value(value, where, path)
        elif name not in STATE_KEYS:
            p.extra[name] = value
    if family is None and not ambiguous:  # unread: keep the tensors as they are, under their own names
        for name in STATE_KEYS:
            if isinstance(entry.get(name), TensorRef):
                p.slots[name] = entry[name]
        return
    # a one-state optimizer the group does not tell: state1's values, under bitsandbytes' own name
    # until --optimizer settles the family (OptimizerState.settle gives it that family's name)
    for k, slot in enumerate(SLOTS[family] if family else ("state1",), start=1):
        field = f"state{k}"
        ref = entry.get(field)
        if ref is None:
            raise FormatError(f"{where}: bitsandbytes {family or 'one-state'} state without {field}", path)
        if not isinstance(ref, TensorRef):
            raise FormatError(f"{where}: {field} is {type(ref).__name__}, not a tensor", path)
        parts = slot if isinstance(slot, tuple) else (slot,)
        shape = tuple(ref.shape[1:]) if len(parts) == 2 else tuple(ref.shape)
        if len(parts) == 2 and (not ref.shape or ref.shape[0] != 2):
            raise FormatError(f"{where}: AdEMAMix's {field} has shape {list(ref.shape)}, not (2, …)", path)
        n = int(np.prod(shape)) if shape else 1
        for part, name in enumerate(parts):
            half = part if len(parts) == 2 else None
            if ref.dtype == "U8":
                absmax, qmap = entry.get(f"absmax{k}"), entry.get(f"qmap{k}")
                block = _check_8bit(ref, absmax, qmap, f"{where}.{field}", n, path)
                p.slots[name] = dequantized(ref, absmax, qmap, block, shape, part or 0)
                p.encoding[name] = Encoded(field, 8, block, ref, absmax, qmap, half)
            elif ref.dtype == "F32":
                p.slots[name] = _half(ref, part, shape) if half is not None else ref
                p.encoding[name] = Encoded(field, 32, None, ref, part=half)
            else:
                raise FormatError(f"{where}: {field} is {ref.dtype}; bitsandbytes keeps uint8 codes or float32", path)


# ----------------------------------------------------------------------------- hyperparameters


def torch_hyperparams(family: str, group: dict) -> dict:
    """A bitsandbytes param group in torch's words (``betas`` unpacked as bitsandbytes packs it)."""
    out = {k: v for k, v in group.items() if k not in ("betas", "eps", *ADAM_GROUP_KEYS)}
    betas = tuple(group.get("betas") or ())
    if family == "adamw":
        out.update(betas=betas, eps=group.get("eps"), decoupled_weight_decay=True)
    elif family == "lion":
        out.update(betas=betas)
    elif family == "sgd":
        out.update(momentum=betas[0], dampening=0.0, nesterov=False)  # bitsandbytes' kernel has no dampening
    elif family == "rmsprop":
        if betas[1]:
            raise MappingError(f"bitsandbytes RMSprop with momentum {betas[1]}: its momentum is not modelled")
        out.update(alpha=betas[0], momentum=0.0, eps=group.get("eps"), centered=False)
    elif family == "adagrad":
        out.update(eps=group.get("eps"), lr_decay=0.0, initial_accumulator_value=0.0)
    return out


def bnb_group(family: str, group: dict, old: bool) -> dict:
    """A torch-style group as bitsandbytes stores it (``old``: <= 0.43, without AdEMAMix's keys)."""
    def refuse(why: str):
        raise MappingError(f"bitsandbytes {family}: {why}")

    if group.get("maximize"):
        refuse("maximize=True has no bitsandbytes equivalent")
    out = {"lr": group.get("lr")}
    if family in ("adam", "adamw"):
        if group.get("amsgrad"):
            refuse("AMSGrad has no bitsandbytes equivalent")
        if family == "adam" and group.get("weight_decay") and not group.get("decoupled_weight_decay"):
            refuse("torch Adam's weight decay is added to the gradient; bitsandbytes' Adam decays the weights "
                   "(decoupled, as AdamW)")
        out.update(betas=tuple(group.get("betas", (0.9, 0.999))), eps=group.get("eps", 1e-8),
                   weight_decay=group.get("weight_decay", 0.0))
        if not old:
            out.update(alpha=0.0, t_alpha=None, t_beta3=None)
    elif family == "lion":
        out.update(betas=tuple(group.get("betas", (0.9, 0.99))), eps=0.0, weight_decay=group.get("weight_decay", 0.0))
    elif family == "sgd":
        if group.get("nesterov") or group.get("dampening"):
            refuse("Nesterov momentum and dampening have no bitsandbytes equivalent")
        if not group.get("momentum"):
            refuse("SGD without momentum keeps no state (bitsandbytes' SGD8bit needs momentum)")
        out.update(betas=(group["momentum"], 0), eps=0.0, weight_decay=group.get("weight_decay", 0.0))
    elif family == "rmsprop":
        if group.get("momentum") or group.get("centered"):
            refuse("momentum and centered RMSprop are not supported by bitsandbytes")
        out.update(betas=(group.get("alpha", 0.99), 0), eps=group.get("eps", 1e-8),
                   weight_decay=group.get("weight_decay", 0.0))
    elif family == "adagrad":
        if group.get("lr_decay") or group.get("initial_accumulator_value"):
            refuse("lr_decay and initial_accumulator_value are not supported by bitsandbytes")
        out.update(betas=(0.0, 0.0), eps=group.get("eps", 1e-10), weight_decay=group.get("weight_decay", 0.0))
    else:
        refuse("statekit writes bitsandbytes Adam/AdamW, Lion, SGD, RMSprop and Adagrad state")
    if "initial_lr" in group:  # an LR scheduler's key, which it adds to any optimizer's groups
        out["initial_lr"] = group["initial_lr"]
    return out


# ----------------------------------------------------------------------------- writing


LIBRARY_BLOCKS = {"bnb": 256, "bnb-flat": 256, "bnb-2048": 2048}


def library_record(state: OptimizerState, actions) -> str:
    """What a .bpk keeps of a bitsandbytes source (hyper.LIBRARY_KEY): its layout, and for each
    parameter whose state it stored in 8 bits or kept in 32 at 4096 elements or more, how."""
    import json

    by_key = {p.key: p for p in state.params}
    stored = {}
    for a in actions:
        p = by_key.get(a.src_key) if a.src_key is not None else None
        encs = list(p.encoding.values()) if p is not None else []
        if a.dst_id and encs and (encs[0].bits == 8 or (p.shape and int(np.prod(p.shape)) >= MIN_8BIT_SIZE)):
            stored[a.dst_id] = [encs[0].bits, encs[0].block]
    return json.dumps({"format": state.library_format, "stored": stored}, separators=(",", ":"))


def quantized(ref: TensorRef, qmap: np.ndarray, block: int, what: str, exact: bool = False) -> TensorRef:
    """Lazily, the uint8 codes (``what="codes"``) or float32 scales (``"absmax"``) of ``ref``'s
    values by bitsandbytes' CPU quantizer, a bounded number of blocks at a time. ``exact``: the values
    are bitsandbytes' own dequantization at this block size (a state going back to the layout it
    came from): each block's own codes and scale are recovered where they give the values back bit
    for bit (:func:`statekit.optim.blockwise.requantize`)."""
    n = ref.numel
    shape = tuple(ref.shape) if what == "codes" else (_blockwise().blocks(n, block),)

    def pieces(elements: int) -> Iterator[np.ndarray]:
        k = max(1, (elements if what == "codes" else elements * block) // block)
        for piece in ref.pieces(k * block):
            if exact:
                codes, absmax, _ = _blockwise().requantize(piece.astype(np.float32), qmap, block)
            else:
                codes, absmax = _blockwise().quantize(piece.astype(np.float32), qmap, block, "cpu")
            yield codes if what == "codes" else absmax

    return TensorRef(dtype="U8" if what == "codes" else "F32", shape=shape, piece_source=pieces)


def to_state_dict(state: OptimizerState, family: str, groups: list[dict], *, block: int = 256,
                  nested: bool = True) -> dict:
    """bitsandbytes' state_dict for ``state``: each parameter 8-bit when it has at least 4096
    elements (unless its source kept it in 32 bits), float32 otherwise."""
    family = "adamw" if family == "adam" else family
    slots = SLOTS.get(family)
    if slots is None or family == "ademamix":
        raise MappingError(f"statekit writes bitsandbytes Adam/AdamW, Lion, SGD, RMSprop and Adagrad state, not {family}")
    old = block == 2048
    out_groups = [dict(bnb_group(family, g, old), params=[]) for g in groups]
    maps = {"state1": TensorRef.from_array(_blockwise().dynamic_map(True)),
            "state2": TensorRef.from_array(_blockwise().dynamic_map(False))}
    tables = {k: v.numpy() for k, v in maps.items()}
    out_state: dict[int, dict] = {}
    for idx, p in enumerate(state.params):
        out_groups[min(p.group, len(out_groups) - 1)]["params"].append(idx)
        if not p.slots and p.step is None:
            continue
        if p.step is None:
            raise MappingError(f"parameter {p.label()}: bitsandbytes state needs a step count")
        tensors: dict[str, TensorRef] = {}
        for k, slot in enumerate(slots, start=1):
            ref = p.slots.get(slot)
            if ref is None:
                raise MappingError(f"parameter {p.label()}: bitsandbytes {family} state needs {slot}")
            field = f"state{k}"
            enc = p.encoding.get(slot)
            bits, was_block = (enc.bits, enc.block) if enc is not None else (p.stored_as or (None, None))
            ref = ref if ref.dtype == "F32" else ref.cast("F32")
            if ref.numel < MIN_8BIT_SIZE or bits == 32:  # small, or kept in 32 bits by its source (an embedding)
                tensors[field] = ref
                continue
            exact = bits == 8 and was_block == block  # back to the codes it came from
            tensors[field] = quantized(ref, tables[field], block, "codes", exact)
            tensors[f"qmap{k}"] = maps[field]
            tensors[f"absmax{k}"] = quantized(ref, tables[field], block, "absmax", exact)
        unknown = set(p.slots) - set(slots)
        if unknown:
            raise MappingError(f"parameter {p.label()}: bitsandbytes {family} state has no field for "
                               f"{', '.join(sorted(unknown))}")
        order = [k for k in ("state1", "qmap1", "state2", "qmap2", "absmax1", "absmax2") if k in tensors]
        ordered = {k: tensors[k] for k in order}
        step = int(p.step)
        if step != p.step:
            raise MappingError(f"parameter {p.label()}: step {p.step} is not a whole number; bitsandbytes counts in ints")
        out_state[idx] = {"step": step, QUANT_KEY: ordered} if nested else {"step": step, **ordered}
    return {"state": out_state, "param_groups": out_groups}


# each writer's layout (the registry's formats) and the first release that writes it (docs/third-party.md)
LAYOUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "bnb-2048": ((0,), "bitsandbytes <= 0.43 (flat entries, blocks of 2048)"),
    "bnb-flat": ((0, 44), "bitsandbytes 0.44 to 0.49.1 (flat entries, blocks of 256)"),
    "bnb": ((0, 49, 2), "bitsandbytes >= 0.49.2 (nested entries, blocks of 256)"),
}


def format_for(version: tuple[int, ...]) -> str:
    """The writer (a registry format) of the layout bitsandbytes ``version`` itself writes."""
    return [name for name, (first, _) in LAYOUTS.items() if version >= first][-1]


def _save(state, path, family, groups, *, block: int, nested: bool) -> int:
    family = family or state.family
    if groups is None:
        groups = [dict(g.hyperparams) for g in state.groups] or [{}]
    torch_pt.save_pt(to_state_dict(state, family, groups, block=block, nested=nested), path)
    return os.path.getsize(path)


@base.optimizer_writer
def save_optimizer(state: OptimizerState, path: str, *, family: str | None = None, groups: list[dict] | None = None,
                   metadata: dict[str, str] | None = None, progress=None, step_policy: str | None = None,
                   on_warning=None) -> int:
    """bitsandbytes >= 0.49.2's layout (nested), block size 256: what bitsandbytes 0.50 writes."""
    return _save(state, path, family, groups, block=256, nested=True)


@base.optimizer_writer
def save_optimizer_flat(state: OptimizerState, path: str, *, family: str | None = None,
                        groups: list[dict] | None = None, metadata: dict[str, str] | None = None, progress=None,
                        step_policy: str | None = None, on_warning=None) -> int:
    """bitsandbytes 0.44 … 0.49.1's layout: flat entries, block size 256."""
    return _save(state, path, family, groups, block=256, nested=False)


@base.optimizer_writer
def save_optimizer_2048(state: OptimizerState, path: str, *, family: str | None = None,
                        groups: list[dict] | None = None, metadata: dict[str, str] | None = None, progress=None,
                        step_policy: str | None = None, on_warning=None) -> int:
    """bitsandbytes <= 0.43's layout: flat entries, block size 2048, no AdEMAMix group keys."""
    return _save(state, path, family, groups, block=2048, nested=False)
