"""The framework-neutral state model.

A file is opened into a :class:`Checkpoint`: what kind of file it is, and depending on the kind an
:class:`OptimizerState` (per-parameter typed state plus parameter groups), a :class:`ModelInfo`
(a model's parameters: path, id, shape, dtype) or loose scalars (an LR scheduler). Tensors stay
:class:`~statekit.tensor.TensorRef` s — lazy — until an operation asks for values.

Slot names are neutral (PyTorch's: ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``momentum_buffer``, …); :mod:`statekit.naming` maps each framework's field names onto them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
from dataclasses import dataclass, field

from statekit import naming, paramid
from statekit.errors import MappingError, UsageError
from statekit.formats import limits
from statekit.tensor import TensorRef

GLOB_CHARS = frozenset("*?[")
_PLAIN = int | float | bool | str | None


def understood(value: object) -> bool:
    """Whether statekit knows what a per-parameter value is: a tensor, a plain scalar, or a list of
    those (L-BFGS's history). A nested dict or any other object is not, and is never passed over
    silently (see :attr:`ParamState.opaque`)."""
    if isinstance(value, TensorRef | _PLAIN):
        return True
    return isinstance(value, list | tuple) and all(isinstance(v, TensorRef | _PLAIN) for v in value)


def nested_tensors(value: object) -> list[TensorRef]:
    """The tensors anywhere inside ``value`` (dicts, lists, tuples), in order."""
    if isinstance(value, TensorRef):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in nested_tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in nested_tensors(v)]
    return []


def describe_opaque(value: object) -> str:
    """A not-understood value for people: ``a dict (state1, qmap1, …)``, ``a GaLoreProjector``."""
    if isinstance(value, dict):
        return f"a dict ({', '.join(map(str, value)) or 'empty'})"
    if isinstance(value, list | tuple):
        kinds = sorted({type(v).__name__ for v in value if not isinstance(v, TensorRef | _PLAIN)})
        return f"a {type(value).__name__} of {len(value)} holding {', '.join(kinds)}"
    return f"a {type(value).__name__}"


def format_shape(dims) -> str:
    """A shape for people: ``4×16``; ``scalar`` for ``()``; ``-`` when unknown (one spelling everywhere)."""
    if dims is None:
        return "-"
    return "×".join(map(str, dims)) if len(dims) else "scalar"


def matches(pattern: str, *, path: str | None, key: str | None = None, id: int | None = None,
            index: int | None = None) -> bool:
    """Whether a user's parameter name selects this parameter: its path or key, a glob of paths
    (``l1.*``), its ParamId in either spelling, or ``#index`` (a position without an id). The one
    matcher behind ``--param`` of inspect, diff and doctor and :meth:`OptimizerState.find`."""
    if pattern in (path, key):
        return True
    if GLOB_CHARS & set(pattern):
        return path is not None and fnmatch.fnmatchcase(path, pattern)
    text = pattern[1:] if pattern.startswith("#") else pattern
    if text.isdigit() and index == int(text) and id is None:
        return True
    try:
        return id is not None and paramid.parse(pattern) == id
    except ValueError:
        return False


@dataclass
class ParamState:
    """One parameter's optimizer state.

    ``key`` identifies the parameter inside its state: burn's decimal ParamId, or torch's position
    as a string. ``id`` is burn's u64 ParamId when known, ``index`` torch's position when known.
    ``step`` is the parameter's step counter (burn ``time``, torch ``step``), None when the family
    keeps none. ``extra`` holds native fields that are not slots, kept for faithful round trips.
    """

    key: str
    id: int | None = None
    index: int | None = None
    path: str | None = None
    rank: int | None = None
    step: int | float | None = None
    slots: dict[str, TensorRef] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)
    group: int = 0
    declared_shape: tuple[int, ...] | None = None
    family: str | None = None
    encoding: dict[str, object] = field(default_factory=dict)  # slot → how a library stores it (bitsandbytes)
    module: str | None = None  # the owning module's class, from the model's definition (torch sources)
    layout: str | None = None  # what that class makes of the tensor (statekit.frameworks.hf_model: out_in, in_out, …)
    layout_from: str | None = None  # what decided it: the module class, the forward (hf_model.BY_*)
    layout_problem: str | None = None  # why the definition leaves it undecided (class and forward disagree …)
    # (bits, block) an optimizer library stored this state in (bitsandbytes: 8 or 32, 256 or 2048), as a
    # .bpk records it for the way back (a library's own file says it per slot: ``encoding``)
    stored_as: tuple[int, int | None] | None = None
    # every family this parameter's state could be (burn: SGD-momentum's fields are also Muon's for a
    # 2-D parameter); empty when only ``family`` fits
    candidates: tuple[str, ...] = ()

    def _tensors(self):
        """The state's tensors: its slots, then fields kept under their native names (an unknown layout)."""
        yield from self.slots.values()
        for value in self.extra.values():
            if isinstance(value, TensorRef):
                yield value

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The parameter's shape as its state shows it: the first field that is not a 0-dim
        per-parameter scalar (NAdam's ``mu_product``, ASGD's ``eta``/``mu``); for a factored
        second moment (torch's and burn's Adafactor keep a matrix's as a row factor [..., n, 1] and a
        column factor [..., 1, m], :data:`statekit.naming.FACTORED`; transformers' as
        ``exp_avg_sq_row`` [..., n] and ``exp_avg_sq_col`` [..., m]), the shape those imply."""
        for row_slot, col_slot in naming.FACTORED:
            row, col = self.slots.get(row_slot), self.slots.get(col_slot)
            if row is not None and col is not None and len(row.shape) == len(col.shape) >= 2:
                return tuple(row.shape[:-1]) + (col.shape[-1],)
        row, col = self.slots.get("exp_avg_sq_row"), self.slots.get("exp_avg_sq_col")  # transformers' Adafactor
        if row is not None and col is not None and len(row.shape) == len(col.shape) >= 1:
            return tuple(row.shape) + (col.shape[-1],)
        first = None
        for ref in self._tensors():
            if len(ref.shape) > 0:
                return tuple(ref.shape)
            first = () if first is None else first
        return first if first is not None else self.declared_shape

    @property
    def opaque(self) -> dict[str, object]:
        """Native entries statekit does not understand (a nested dict, an object): shown by
        ``inspect`` with their keys, refused by ``doctor`` and ``convert`` by name."""
        return {k: v for k, v in self.extra.items() if not understood(v)}

    def opaque_text(self) -> str:
        """The not-understood entries for a message: ``name (a dict (state1, …))``, joined."""
        return "; ".join(f"{k} ({describe_opaque(v)})" for k, v in self.opaque.items())

    @property
    def dtype(self) -> str | None:
        for ref in self._tensors():
            return ref.dtype
        return None

    @property
    def family_label(self) -> str | None:
        """``sgd/muon`` where the state fits several families, else the family."""
        return "/".join(self.candidates) if len(self.candidates) > 1 else self.family

    @property
    def display_id(self) -> str | None:
        return None if self.id is None else paramid.to_display(self.id)

    @property
    def nbytes(self) -> int:
        return sum(ref.nbytes for ref in self.slots.values())

    @property
    def numel(self) -> int:
        return sum(ref.numel for ref in self.slots.values())

    def label(self) -> str:
        """How messages name this parameter: path, then id, then key."""
        if self.path:
            return self.path
        if self.id is not None:
            return f"{self.id} ({self.display_id})"
        return f"#{self.key}"


@dataclass
class ParamGroup:
    """A parameter group: hyperparameters (framework's names) and the keys of its parameters."""

    hyperparams: dict[str, object] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    # the group's optimizer family where it is known per group (burn records whose parameters hold
    # different optimizers' state: Muon for the matrices, AdamW for the rest); None: the state's
    family: str | None = None
    candidates: tuple[str, ...] = ()

    @property
    def family_label(self) -> str | None:
        return "/".join(self.candidates) if len(self.candidates) > 1 else self.family


@dataclass
class OptimizerState:
    """Typed optimizer state, framework-neutral.

    ``family`` is the optimizer family when the state determines it (``adam``, ``sgd``, …);
    ``candidates`` lists every family whose state looks the same (burn's Adam and AdamW, SGD with
    momentum and Muon) so that nobody guesses silently. ``hyperparams_stored`` is False for burn
    files, which keep no hyperparameters at all.
    """

    family: str | None
    candidates: tuple[str, ...] = ()
    params: list[ParamState] = field(default_factory=list)
    groups: list[ParamGroup] = field(default_factory=list)
    global_slots: dict[str, TensorRef] = field(default_factory=dict)
    global_scalars: dict[str, object] = field(default_factory=dict)
    hyperparams_stored: bool = False
    framework: str = "neutral"
    notes: list[str] = field(default_factory=list)
    family_detail: str | None = None  # why the family is unknown: "unknown (fields …, group keys …)"; or, with a
    # family, its name for people (a third-party optimizer's: "transformers Adafactor (…)")
    names_from: str | None = None  # how a torch state's positions were named (statekit.frameworks.torch_names)
    library: str | None = None  # the optimizer library that wrote a torch file's state ("bitsandbytes")
    library_format: str | None = None  # the registry format of that library's layout ("bnb", "bnb-flat", "bnb-2048"),
    # read from its file or from a .bpk's record (converting back to a .pt writes it)
    unnamed_why: str | None = None  # why they could not be named (one line: what to install or give)
    torch_names_in_file: bool | None = None  # a torch state's param_names were in its file (False: solved)
    training_args: dict | None = None  # HF TrainingArguments' optimizer settings (statekit.frameworks.hf_args)
    # where the file cannot tell its family (one of ``candidates``) and the candidates name the same
    # stored field differently: family → {slot as read: that family's name} (bitsandbytes' state1 is
    # Lion's exp_avg, SGD's momentum_buffer, RMSprop's square_avg), applied by :meth:`settle`
    slot_renames: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def family_label(self) -> str:
        if not self.family:
            return self.family_detail or "unknown"
        if self.family == "mixed" and any(g.family for g in self.groups):
            return "mixed: " + " + ".join(g.family_label or "unknown" for g in self.groups)
        if self.family_detail:  # a family of its own, named for people (transformers Adafactor, …)
            return self.family_detail
        if len(self.candidates) > 1:
            return "/".join(self.candidates)
        return self.family

    def resolved(self, names: str | list[str]) -> OptimizerState:
        """This state with the families ``names`` settles (``--optimizer muon`` or ``muon,adamw``):
        each name applies to the parameters whose state fits it among several families (burn's
        SGD-momentum fields on a 2-D parameter are also Muon's), and nowhere else. A name that fits
        no such parameter is refused. The state is changed in place and returned; its family is the
        one left when every parameter agrees, else ``mixed`` with a family per group."""
        wanted = [n.strip().lower() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
        for name in wanted:
            hits = [p for p in self.params if len(p.candidates) > 1 and name in p.candidates]
            if not hits:
                fits = sorted({c for p in self.params for c in p.candidates if len(p.candidates) > 1})
                fits_text = f"it fits {' or '.join(fits)}" if fits else "no part of it is ambiguous"
                raise UsageError(f"--optimizer {name}: no parameter's state can be {name} "
                                 f"(the state holds {self.family_label}; {fits_text})")
            for p in hits:
                p.family, p.candidates = name, (name,)
        regroup(self)
        return self

    def settle(self, name: str) -> OptimizerState:
        """This state as ``name``'s, where the file cannot tell its family and ``name`` is one of its
        ``candidates`` (``--optimizer``): every parameter gets the family, and the slots the
        candidates name differently get ``name``'s names (:attr:`slot_renames`). In place; a name
        that is not a candidate is refused. A state whose family is known is returned unchanged."""
        if self.family is not None or not self.candidates:
            return self
        name = name.strip().lower()
        if name not in self.candidates:
            raise UsageError(f"--optimizer {name}: the state holds {self.family_label}, not {name} "
                             f"(say --optimizer {' or '.join(self.candidates)})")
        renames = self.slot_renames.get(name, {})
        for p in self.params:
            p.family = name
            if renames:
                p.slots = {renames.get(k, k): v for k, v in p.slots.items()}
                p.encoding = {renames.get(k, k): v for k, v in p.encoding.items()}
        self.family, self.candidates, self.family_detail, self.slot_renames = name, (name,), None, {}
        for g in self.groups:
            if g.family is None and g.candidates:
                g.family, g.candidates = name, ()
        return self

    @property
    def ambiguous(self) -> list[ParamState]:
        """Parameters whose state fits several families."""
        return [p for p in self.params if len(p.candidates) > 1]

    def find(self, name: str) -> ParamState:
        """The parameter a user names: by path, decimal or display ParamId, key, or ``#index``."""
        for p in self.params:
            if name in (p.path, p.key):
                return p
        for p in self.params:
            if matches(name, path=None, id=p.id, index=p.index):
                return p
        raise KeyError(name)

    def select(self, patterns: list[str]) -> list[ParamState]:
        """The parameters any of ``patterns`` selects (see :func:`matches`), in file order."""
        return [p for p in self.params if any(matches(n, path=p.path, key=p.key, id=p.id, index=p.index)
                                              for n in patterns)]

    def steps(self) -> set:
        return {p.step for p in self.params if p.step is not None}


def regroup(state: OptimizerState) -> None:
    """Recompute ``state``'s family from its parameters' (framework records that keep one
    optimizer per parameter: burn's groups). Parameters are grouped by family (candidates
    included) in file order, unless the state already has groups with hyperparameters of their
    own; one family for every parameter gives that family, several give ``mixed``."""
    if not state.params:
        return
    labels: dict[str | None, list[ParamState]] = {}
    for p in state.params:
        labels.setdefault(p.family, []).append(p)
    if None in labels:
        return  # an unknown layout somewhere: the state's family stays as the reader set it

    def union(members: list[ParamState]) -> tuple[str, ...]:
        out: dict[str, None] = {}
        for p in members:
            out.update(dict.fromkeys(p.candidates or (p.family,)))
        return tuple(out)

    if len(labels) == 1:
        (family, members), = labels.items()
        candidates = union(members)
        state.family, state.candidates = family, candidates
        for g in state.groups:
            g.family, g.candidates = family, candidates
        return
    state.family, state.candidates = "mixed", ()
    if any(g.hyperparams for g in state.groups):
        return  # groups of their own (statekit-stored hyperparameters): each parameter keeps its family
    hp = state.groups[0].hyperparams if state.groups else {}
    state.groups = []
    for index, (family, members) in enumerate(labels.items()):
        candidates = union(members)
        state.groups.append(ParamGroup(hyperparams=dict(hp), keys=[p.key for p in members], family=family,
                                       candidates=candidates if len(candidates) > 1 else ()))
        for p in members:
            p.group = index


def settle_from(original: OptimizerState, other: OptimizerState, path: str) -> list[str]:
    """A state compared with an original as the same optimizer's (diff, verify-resume): where its file
    cannot tell its family (a bitsandbytes one-state optimizer) and the original's family (named by a
    Trainer folder's training_args.bin, say) is one of its candidates, it is that family. Never the
    other way round: an original is not settled by what a conversion assumed. In place; the note."""
    if original.family and other.family is None and original.family in other.candidates:
        fits = ", ".join(other.candidates)
        other.settle(original.family)
        return [f"{path}: its state fits {fits} alike; taken as the original's {original.family}"]
    return []


def refuse_opaque(state: OptimizerState | None, source: str, doing: str) -> None:
    """Entries statekit does not understand are never passed over: a MappingError naming them."""
    holders = [p for p in state.params if p.opaque] if state is not None else []
    if holders:
        more = f" (+{len(holders) - 3} more parameters)" if len(holders) > 3 else ""
        listed = "; ".join(f"parameter {p.label()}: {p.opaque_text()}" for p in holders[:3])
        raise MappingError(f"state statekit does not understand: {listed}{more}; refusing to {doing} without it",
                           source)


def step_problem(step: object) -> str | None:
    """Why ``step`` is no step count, or None when it is one (or absent): a parameter's step counts
    the updates it took, a whole number from 0. NaN, Inf, a negative or a fractional step comes from
    a damaged file; written out, bias correction turns the parameter into NaN at its next update.
    The one check behind every writer (:func:`refuse_bad_steps`) and doctor's ``step`` finding."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        return f"step {limits.short(step)} is not a number"
    whole = isinstance(step, numbers.Integral) or (math.isfinite(step) and step == int(step))
    if not whole or step < 0:
        shown = limits.short(int(step)) if isinstance(step, numbers.Integral) else repr(float(step))
        return f"step {shown} is not a whole count of updates (0, 1, 2, …)"
    return None


def refuse_bad_steps(state: OptimizerState | None, source: str | None = None, writing: str | None = None) -> None:
    """A parameter whose step is no count (:func:`step_problem`) is refused, named: a MappingError
    against ``source`` (the file read), or, from a writer, saying that ``writing`` was not written."""
    params = state.params if state is not None else []
    try:  # the distinct steps first: a state of 10^6 parameters holds a handful
        if all(step_problem(step) is None for step in {p.step for p in params}):
            return
    except TypeError:  # a step that cannot be hashed (a list): found below
        pass
    for p in params:
        why = step_problem(p.step)
        if why is not None:
            refusing = f"refusing to write {writing}: " if writing is not None else ""
            raise MappingError(f"{refusing}parameter {p.label()}: {why}", source)


def refuse_unusable(state: OptimizerState | None, source: str, doing: str) -> None:
    """What no operation carries on is refused before it starts, named: state statekit does not
    understand (:func:`refuse_opaque`) and a step that is no count (:func:`refuse_bad_steps`)."""
    refuse_opaque(state, source, doing)
    refuse_bad_steps(state, source)


@dataclass(slots=True)  # one per model tensor: a state_dict may hold 10^6
class ModelParam:
    """A model tensor: module path, ParamId (burn), shape, dtype; ``buffer`` for non-parameters."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    id: int | None = None
    index: int | None = None
    buffer: bool = False
    tensor: TensorRef | None = None

    @property
    def display_id(self) -> str | None:
        return None if self.id is None else paramid.to_display(self.id)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_param(path: str, shape: tuple[int, ...], dtype: str, index: int | None, buffer: bool,
                tensor: TensorRef) -> ModelParam:
    """``ModelParam(path, shape, dtype, None, index, buffer, tensor)``, the same object built in
    half the time: the slots stored directly (a state_dict of 10^6 tensors makes one a tensor;
    the field list is checked against the dataclass's below, at import)."""
    p = _new_object(ModelParam)
    p.path = path
    p.shape = shape
    p.dtype = dtype
    p.id = None
    p.index = index
    p.buffer = buffer
    p.tensor = tensor
    return p


_new_object = object.__new__
if hasattr(ModelParam, "__post_init__") or [f.name for f in dataclasses.fields(ModelParam)] != [
        "path", "shape", "dtype", "id", "index", "buffer", "tensor"]:
    raise AssertionError("ModelParam's fields changed: model_param sets the old ones")


@dataclass
class ModelInfo:
    """A model's tensors. ``order`` says what order ``params`` are in, as far as the file knows:
    ``"named_parameters"`` (a torch state_dict: module registration order), ``"burn"`` (burn's
    module order), None (no meaningful order: safetensors sorts by name)."""

    params: list[ModelParam] = field(default_factory=list)
    order: str | None = None
    source: str | None = None  # the file it was read from, for messages

    def by_path(self) -> dict[str, ModelParam]:
        return {p.path: p for p in self.params}

    def by_id(self) -> dict[int, ModelParam]:
        return {p.id: p for p in self.params if p.id is not None}


@dataclass
class Checkpoint:
    """What one file holds, as statekit understands it."""

    path: str
    format: str
    kind: str
    version: int | str | None = None
    optimizer: OptimizerState | None = None
    model: ModelInfo | None = None
    scalars: dict[str, object] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    n_tensors: int = 0
    n_scalars: int = 0
    nbytes: int = 0
    warnings: list[str] = field(default_factory=list)
    schedulers: list[dict] = field(default_factory=list)  # LR scheduler state beside the optimizer, for display
    schedule: object = None  # a statekit.schedule.model.ScheduleState: the LR schedule and the trainer's counters
    container: object = None

    def close(self) -> None:
        closer = getattr(self.container, "close", None)
        if closer is not None:
            closer()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
