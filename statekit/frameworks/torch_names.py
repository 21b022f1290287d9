"""Names for a torch optimizer state's positions, solved from shapes and order, never guessed.

A torch optimizer ``state_dict`` knows its parameters only by position: ``param_groups[g]["params"]``
lists ids, and torch pairs them with the live parameters by position at load time. Which module
path a position belongs to is not in the file unless the optimizer was built from
``named_parameters()`` (then each group has ``param_names``).

Facts the solver relies on (torch-candle-numerics.md §1.1, sharded-formats.md "HF Trainer"):

- every param group is an **order-preserving subsequence** of the model's ``named_parameters()``
  list (a training program builds groups by filtering that list: HF Trainer puts parameters with
  weight decay in group 0 and the rest in group 1, each in model order), groups are disjoint, and
  parameters may be in no group at all (frozen);
- a position's state tensors have the parameter's shape; a position without state (never stepped,
  frozen) says nothing about its shape.

What order a model source really has:

- a torch ``state_dict`` file (``.pt``/``.bin``) keeps the module registration order, which is
  ``named_parameters()`` order once buffers and tied duplicates (same storage) are removed;
- a names list (``--names``) has the order its author says: ``named_parameters()`` order unless
  ``--names-order optimizer`` says it lists the optimizer's positions;
- **safetensors** stores tensors sorted by name and a **burn** ``.bpk`` in burn's module order: no
  ``named_parameters()`` order at all, so only shapes count (burn Linear weights are ``[in, out]``,
  so a rank-2 shape also matches its reverse).

:func:`resolve` finds every assignment of positions to model parameters that satisfies these
constraints: exactly one → it is used; several → :class:`NamesError` naming the ambiguous positions
and how to settle them; none → :class:`NamesError` with the first conflict. The search walks the
model list once, keeping the set of "how far each group has got" states (a DAG whose paths are the
solutions), so it counts solutions exactly and finds every position's candidates without trying
permutations; a state budget turns a pathological case into a refusal, never a guess.

API (used by inspect, convert, doctor, diff, remap, verify-resume and the checkpoint-folder
readers)::

    model = from_model_info(ckpt.model, path)          # or from_names(...) / read_names_file(path)
    res = name_state(state, model, path)                # sets ParamState.path; raises NamesError
    res.describe()                                      # one line for plans and inspect
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from statekit.errors import MappingError, UsageError

MAX_STATES = 2_000_000  # search states before giving up (a refusal, not a guess)
NAMES_ORDERS = ("model", "optimizer")
HOW_TO_SETTLE = ("give --names FILE listing the optimizer's parameters in its own order "
                 "(one name per line, group after group) with --names-order optimizer")
HOW_TO_SETTLE_UNORDERED = ("give --names FILE in model.named_parameters() order beside this model file, "
                           "or a torch state_dict (.pt/.bin) model file, which keeps that order")


class NamesError(MappingError):
    """The positions of a torch state cannot be named without guessing.

    ``ambiguous``: True when several namings fit (more information settles it), False when none does.
    """

    def __init__(self, message: str, path=None, *, ambiguous: bool = False):
        super().__init__(message, path)
        self.ambiguous = ambiguous


Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    shape: Shape | None  # None: unknown (a names list without shapes)


@dataclass
class ModelOrder:
    """A model's parameters as one source knows them.

    ``ordered``: ``entries`` are in ``named_parameters()`` order (else only shapes count).
    ``transposable``: a rank-2 shape also matches its reverse (burn Linear weights are [in, out]).
    ``positional``: the list names the optimizer's positions directly, group after group
    (``--names-order optimizer``). ``source``: how messages and plans name it.
    """

    entries: list[ModelEntry]
    ordered: bool
    source: str
    transposable: bool = False
    positional: bool = False
    declared: bool = False  # the user said the order (--names-order)

    def shapes(self) -> dict[str, Shape]:
        return {e.name: e.shape for e in self.entries if e.shape is not None}


@dataclass
class Resolution:
    """Names per group and position, and how they were found (for the plan)."""

    names: list[list[str]]
    source: str
    how: str
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"parameter names from {self.source}: {self.how}"


# ----------------------------------------------------------------------------- sources

def from_model_info(model, source: str, *, ordered: bool | None = None) -> ModelOrder:
    """A :class:`~statekit.state.ModelInfo` as an order source: buffers and tied duplicates dropped.

    ``model.order`` says what order its file keeps: ``"named_parameters"`` for torch state_dicts;
    anything else (safetensors: sorted by name; burn: burn's module order) counts as no order.
    ``ordered`` overrides it (a caller that knows where the list came from).
    """
    tied = tied_duplicates(model)
    entries = [ModelEntry(m.path, tuple(m.shape)) for m in model.params if not m.buffer and m.path not in tied]
    order = getattr(model, "order", None)
    burn = order == "burn" or any(m.id is not None for m in model.params)
    if ordered is None:
        ordered = order == "named_parameters"
    what = "named_parameters() order" if ordered else "shapes only: the file keeps no named_parameters() order"
    return ModelOrder(entries, ordered=ordered, source=f"{source} ({what})", transposable=burn and not ordered)


def tied_duplicates(model) -> set[str]:
    """Paths of a torch state_dict that share another's storage (a tied LM head): named_parameters()
    lists such a parameter once, under its first name, and the optimizer holds it once."""
    seen: set = set()
    out: set[str] = set()
    for m in model.params:
        info = getattr(m.tensor, "info", None) or {}
        if m.buffer or "storage_key" not in info:
            continue
        ident = (info["storage_key"], info.get("storage_offset"), tuple(m.shape), info.get("stride"))
        if ident in seen:
            out.add(m.path)
        seen.add(ident)
    return out


def from_names(names: Sequence[str], shapes: Sequence[Shape | None] | None = None, *, source: str,
               order: str | None = None) -> ModelOrder:
    """A names list (``order``: ``model`` = named_parameters() order, ``optimizer`` = positions)."""
    if order is not None and order not in NAMES_ORDERS:
        raise UsageError(f"--names-order {order!r}: expected {' or '.join(NAMES_ORDERS)}")
    shapes = list(shapes) if shapes is not None else [None] * len(names)
    entries = [ModelEntry(n, None if s is None else tuple(s)) for n, s in zip(names, shapes, strict=True)]
    said = {"model": "named_parameters() order", "optimizer": "the optimizer's order", None: "its order"}[order]
    return ModelOrder(entries, ordered=True, source=f"{source} ({said})", positional=order == "optimizer",
                      declared=order is not None)


_SHAPE = re.compile(r"^\s*[\[(]?\s*(\d+(?:\s*[,x×]\s*\d+)*)?\s*,?\s*[\])]?\s*$")


def _parse_shape(text: str, where: str) -> Shape:
    match = _SHAPE.match(text)
    if not match:
        raise UsageError(f"{where}: {text.strip()!r} is not a shape (e.g. [32, 96] or 32x96)")
    body = match.group(1)
    return tuple(int(x) for x in re.split(r"\s*[,x×]\s*", body)) if body else ()


def read_names_file(path: str, *, order: str | None = None) -> ModelOrder:
    """A names file: one name per line (optionally followed by its shape, ``ln_1.weight [768]``), a
    JSON list of names or of ``[name, shape]`` pairs, or a JSON object ``{name: shape}``."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read names: {exc.strerror}", path) from None
    if raw[:4] in (b"PK\x03\x04", b"NRUB") or raw[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05") or (
            len(raw) > 8 and raw[8:9] == b"{" and b"\0" in raw[:8]):
        raise UsageError("is a model or state file, not a names list; give a model file with --model", path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("is not a UTF-8 text names list (one name per line or a JSON list); "
                         "give a model file with --model", path) from None
    names: list[str] = []
    shapes: list[Shape | None] = []
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UsageError(f"names file is not valid JSON: {exc}", path) from None
        items = list(data.items()) if isinstance(data, dict) else data
        for item in items:
            if isinstance(item, str):
                names.append(item)
                shapes.append(None)
            elif (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
                  and isinstance(item[1], list) and all(isinstance(d, int) for d in item[1])):
                names.append(item[0])
                shapes.append(tuple(item[1]))
            else:
                raise UsageError(f"names file entry {item!r} is neither a name nor [name, shape]", path)
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, _, rest = line.strip().partition(" ")
            if "\t" in name:
                name, _, rest = line.strip().partition("\t")
            names.append(name)
            shapes.append(_parse_shape(rest, f"{path}:{lineno}") if rest.strip() else None)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"names file lists {', '.join(dup[:3])} more than once", path)
    if any(s is not None for s in shapes) and any(s is None for s in shapes):
        raise UsageError("names file gives shapes for some names but not others", path)
    return from_names(names, shapes, source=path, order=order)


def with_shapes(names: ModelOrder, model: ModelOrder) -> ModelOrder:
    """A names list's order with a model file's shapes (``--names`` and ``--model`` together)."""
    shapes = model.shapes()
    missing = [e.name for e in names.entries if e.shape is None and e.name not in shapes]
    if missing:
        raise NamesError(f"{len(missing)} names are not in {model.source.split(' (')[0]}: "
                         f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}")
    entries = [ModelEntry(e.name, e.shape if e.shape is not None else shapes[e.name]) for e in names.entries]
    return ModelOrder(entries, ordered=True, source=f"{names.source} with shapes from {model.source.split(' (')[0]}",
                      transposable=model.transposable, positional=names.positional)


# ----------------------------------------------------------------------------- solving

def _key(shape: Shape | None, transposable: bool) -> Shape | None:
    if shape is None:
        return None
    shape = tuple(shape)
    return tuple(sorted(shape)) if transposable and len(shape) == 2 else shape


def _fits(state: Shape | None, model: Shape | None, transposable: bool) -> bool:
    return state is None or model is None or _key(state, transposable) == _key(model, transposable)


def _fmt(shape: Shape | None) -> str:
    return "no state" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _pos(g: int, k: int, groups: Sequence[Sequence], offsets: list[int]) -> str:
    return f"#{offsets[g] + k} (group {g} position {k})" if len(groups) > 1 else f"#{k}"


def resolve(groups: Sequence[Sequence[Shape | None]], model: ModelOrder) -> Resolution:
    """Name every position of ``groups`` (each a list of state shapes, None for "no state").

    Returns the unique solution; raises :class:`NamesError` when there is none or several.
    """
    groups = [[None if s is None else tuple(s) for s in g] for g in groups]
    offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
    total = sum(len(g) for g in groups)
    entries = model.entries
    if model.positional:
        return _positional(groups, model, offsets)
    if len(entries) < total:
        raise NamesError(f"{model.source.split(' (')[0]} has {len(entries)} parameters but the optimizer has "
                         f"{total}; the names must cover every parameter the optimizer was built with")
    if len(groups) > 1 and all(e.shape is None for e in entries) and model.declared:
        raise NamesError(ambiguous=True, message=
            f"the state has {len(groups)} param groups; a list in named_parameters() order without shapes cannot "
            "say which name is in which group: give --model MODEL too (or shapes in the names file)")
    if len(groups) > 1 and all(e.shape is None for e in entries):
        raise NamesError(ambiguous=True, message=
            f"the state has {len(groups)} param groups and {model.source.split(' (')[0]} is a flat list without "
            "shapes: its order does not say which name is in which group; say what order it is in with "
            "--names-order optimizer|model (model: also give --model MODEL for the shapes)")
    if not model.ordered:
        return _unordered(groups, model, offsets)
    return _ordered(groups, model, offsets)


def _positional(groups, model: ModelOrder, offsets) -> Resolution:
    total = sum(len(g) for g in groups)
    if len(model.entries) != total:
        raise NamesError(f"{model.source.split(' (')[0]} lists {len(model.entries)} names for the optimizer's "
                         f"{total} positions")
    names: list[list[str]] = []
    for g, group in enumerate(groups):
        row = []
        for k, shape in enumerate(group):
            e = model.entries[offsets[g] + k]
            if not _fits(shape, e.shape, model.transposable):
                raise NamesError(f"position {_pos(g, k, groups, offsets)} holds {_fmt(shape)} state but "
                                 f"{e.name} is {_fmt(e.shape)}")
            row.append(e.name)
        names.append(row)
    return Resolution(names, model.source, "taken in the optimizer's order")


def _unordered(groups, model: ModelOrder, offsets) -> Resolution:
    """Shapes only: a position is named when its shape class has exactly one name and one position."""
    tr = model.transposable
    by_key: dict = {}
    for e in model.entries:
        by_key.setdefault(_key(e.shape, tr), []).append(e.name)
    want: dict = {}
    for g, group in enumerate(groups):
        for k, shape in enumerate(group):
            want.setdefault(_key(shape, tr), []).append((g, k))
    unknown_names = by_key.pop(None, [])
    wild = want.pop(None, [])
    for key, positions in want.items():
        have = len(by_key.get(key, [])) + len(unknown_names)
        if have < len(positions):
            g, k = positions[len(by_key.get(key, []))]
            raise NamesError(f"position {_pos(g, k, groups, offsets)} holds {_fmt(key)} state but "
                             f"{model.source.split(' (')[0]} has only {len(by_key.get(key, []))} parameters of "
                             f"that shape for {len(positions)} positions")
    names = [[""] * len(g) for g in groups]
    ambiguous: list[str] = []
    for key, positions in want.items():
        cands = by_key.get(key, [])
        if len(positions) == 1 and len(cands) == 1 and not unknown_names:
            g, k = positions[0]
            names[g][k] = cands[0]
        else:
            ambiguous += [f"{_pos(g, k, groups, offsets)} {_fmt(key)}: one of {_list(cands + unknown_names)}"
                          for g, k in positions]
    spare = [n for key, ns in by_key.items() if len(ns) > len(want.get(key, [])) for n in ns] + unknown_names
    if wild:
        if len(wild) == 1 and len(spare) == 1 and not ambiguous:
            g, k = wild[0]
            names[g][k] = spare[0]
        else:
            ambiguous += [f"{_pos(g, k, groups, offsets)} (no state): one of {_list(spare)}" for g, k in wild]
    if ambiguous:
        raise NamesError(ambiguous=True, message=_ambiguity(ambiguous, model, "the file keeps no named_parameters() order, and several "
                                    "parameters share a shape"))
    return Resolution(names, model.source, "each position's shape fits exactly one parameter")


def _list(names: Sequence[str], limit: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _ambiguity(items: list[str], model: ModelOrder, why: str) -> str:
    shown = "; ".join(items[:4]) + (f"; and {len(items) - 4} more" if len(items) > 4 else "")
    how = HOW_TO_SETTLE if model.ordered else f"{HOW_TO_SETTLE_UNORDERED}; or {HOW_TO_SETTLE}"
    return (f"cannot name the optimizer's positions from {model.source.split(' (')[0]} without guessing "
            f"({why}): {shown}. To settle it, {how}")


def _ordered(groups, model: ModelOrder, offsets) -> Resolution:
    """Each group an order-preserving subsequence of the model list: walk the list once, keeping every
    reachable "next position per group" state; the solutions are the paths through those states."""
    tr = model.transposable
    entries = model.entries
    n, sizes, total = len(entries), [len(g) for g in groups], sum(len(g) for g in groups)
    start, end = tuple(0 for _ in groups), tuple(sizes)
    layers: list[set] = [{start}]
    budget = 0
    for i, e in enumerate(entries):
        nxt: set = set()
        left = n - i - 1
        for state in layers[-1]:
            done = sum(state)
            if total - done <= left:  # entry i may belong to no group (frozen, tied, a buffer)
                nxt.add(state)
            for g, p in enumerate(state):
                if p < sizes[g] and _fits(groups[g][p], e.shape, tr):
                    nxt.add(state[:g] + (p + 1,) + state[g + 1:])
        budget += len(nxt)
        if budget > MAX_STATES:
            raise NamesError(f"too many ways to place the optimizer's positions in {model.source.split(' (')[0]} "
                             f"to decide; {HOW_TO_SETTLE}", ambiguous=True)
        if not nxt:
            raise NamesError(_conflict(groups, model, offsets, layers[-1], i))
        layers.append(nxt)
    if end not in layers[-1]:
        raise NamesError(_conflict(groups, model, offsets, layers[-1], n))
    # backward: keep the states on some path to the end, count paths (capped at 2), and note for
    # every position the model entries it takes on some complete path
    paths = {end: 1}
    cands: dict[tuple[int, int], set[int]] = {}
    for i in range(n - 1, -1, -1):
        e = entries[i]
        count: dict = {}
        for state in layers[i]:
            c = paths.get(state, 0) if total - sum(state) <= n - i - 1 else 0  # entry i in no group
            for g, p in enumerate(state):
                if p < sizes[g] and _fits(groups[g][p], e.shape, tr):
                    succ = state[:g] + (p + 1,) + state[g + 1:]
                    if succ in paths:
                        c += paths[succ]
                        cands.setdefault((g, p), set()).add(i)
            if c:
                count[state] = min(c, 2)
        paths = count
    solutions = paths.get(start, 0)
    if solutions == 0:  # pragma: no cover - the forward pass already refused
        raise NamesError(_conflict(groups, model, offsets, set(), n))
    if solutions > 1:
        items = []
        for g, group in enumerate(groups):
            for k, shape in enumerate(group):
                where = sorted(cands.get((g, k), ()))
                if len(where) > 1:
                    items.append(f"{_pos(g, k, groups, offsets)} {_fmt(shape)}: one of "
                                 f"{_list([entries[j].name for j in where])}")
        raise NamesError(_ambiguity(items, model, "several parameters of one shape fit the same positions"),
                         ambiguous=True)
    names = [[entries[min(cands[(g, k)])].name for k in range(len(group))] for g, group in enumerate(groups)]
    how = ("the one placement of its param groups in that order with matching shapes"
           if len(groups) > 1 else "in that order, shapes matching")
    return Resolution(names, model.source, how)


def _conflict(groups, model: ModelOrder, offsets, reached: set, i: int) -> str:
    """The first conflict: the first position of a group that no later model parameter fits (each group
    placed alone, earliest first), else the groups' overlap."""
    src = model.source.split(" (")[0]
    if len(groups) == 1 and len(model.entries) == len(groups[0]):  # no room to skip: pairs by position
        for k, (shape, e) in enumerate(zip(groups[0], model.entries, strict=True)):
            if not _fits(shape, e.shape, model.transposable):
                return (f"position #{k} holds {_fmt(shape)} state but {e.name!r} (entry {k + 1} of {src}) is "
                        f"{_fmt(e.shape)}: the list is not in the optimizer's order, or not its model")
    for g, group in enumerate(groups):
        j, prev = 0, None
        for k, shape in enumerate(group):
            while j < len(model.entries) and not _fits(shape, model.entries[j].shape, model.transposable):
                j += 1
            if j == len(model.entries):
                fits = [e.name for e in model.entries if _fits(shape, e.shape, model.transposable)]
                after = f" after {prev}" if prev else ""
                return (f"no parameter of {src} fits position {_pos(g, k, groups, offsets)} {_fmt(shape)}{after} "
                        f"(parameters of that shape: {_list(fits) or 'none'}); the model is not the one this "
                        "optimizer was built for, or the list is not in named_parameters() order")
            prev = model.entries[j].name
            j += 1
    return (f"the param groups cannot all be placed in {src} at once (each fits alone, but they would need "
            "the same parameters): the model is not the one this optimizer was built for")


# ----------------------------------------------------------------------------- states

def state_groups(state) -> list[list[Shape | None]]:
    """The shapes per group and position of a torch :class:`~statekit.state.OptimizerState`."""
    by_key = {p.key: p for p in state.params}
    if state.groups:
        return [[param_shape(by_key[k]) for k in g.keys] for g in state.groups]
    return [[param_shape(p) for p in state.params]]


def param_shape(p) -> Shape | None:
    """The parameter's shape as its state shows it (:attr:`ParamState.shape`); None for L-BFGS."""
    if p.family == "lbfgs":  # one flat global state under the first id: no parameter's shape
        return None
    return None if p.shape is None else tuple(p.shape)


def name_state(state, model: ModelOrder, path: str | None = None) -> Resolution:
    """Set every position's ``path`` from ``model``; positions already named (``param_names``) must agree.

    Raises :class:`NamesError` (a MappingError naming ``path``) instead of guessing.
    """
    try:
        res = resolve(state_groups(state), model)
    except NamesError as exc:
        raise NamesError(exc.message, path, ambiguous=exc.ambiguous) from None
    by_key = {p.key: p for p in state.params}
    keys = [g.keys for g in state.groups] if state.groups else [[p.key for p in state.params]]
    clashes = []
    for g, row in enumerate(keys):
        for k, key in enumerate(row):
            p = by_key[key]
            if p.path and p.path != res.names[g][k]:
                clashes.append(f"#{p.key} is {p.path!r} in the file but {res.names[g][k]!r} from {model.source}")
    if clashes:
        raise NamesError("; ".join(clashes[:3]) + (f"; +{len(clashes) - 3} more" if len(clashes) > 3 else ""), path)
    shapes = model.shapes()
    for g, row in enumerate(keys):
        for k, key in enumerate(row):
            p = by_key[key]
            p.path = res.names[g][k]
            if p.shape is None and shapes.get(p.path) is not None:  # no state to show it (SGD without momentum)
                p.declared_shape = tuple(shapes[p.path])
                p.rank = len(p.declared_shape) if p.rank is None else p.rank
    state.names_from = res.describe()
    return res


def check_named(state, model: ModelOrder, path: str | None = None) -> list[str]:
    """For a state that names its positions (``param_names``): the shape conflicts with ``model``."""
    shapes = model.shapes()
    out = []
    for p in state.params:
        want = shapes.get(p.path) if p.path else None
        have = param_shape(p)
        if want is not None and have is not None and not _fits(have, want, model.transposable):
            out.append(f"{p.path}: state {_fmt(have)}, model {_fmt(want)}")
    return out
