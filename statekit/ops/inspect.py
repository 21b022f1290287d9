"""``inspect``: describe a checkpoint as one JSON-able dict (the CLI renders it as a table).

Without ``stats`` only the header and metadata are used; with it, each field is streamed in
blocks to compute min / max / mean / RMS and NaN / Inf counts, so memory stays one block.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from itertools import chain
from operator import attrgetter

from statekit import dtypes, naming
from statekit.errors import StatekitError
from statekit.lazy import numpy as np
from statekit.state import Checkpoint, ModelParam, OptimizerState, ParamState, describe_opaque, matches
from statekit.tensor import TensorRef

BLOCK = 1 << 20
LARGE = 2.0**500  # past this, squares of float64 values could overflow


def tensor_stats(ref: TensorRef, block: int = BLOCK) -> dict:
    """min / max / mean / rms / nan / inf of a tensor, streaming over ``block`` elements at a time.

    Sums run in float64; values past 2**500 (float64 state near its range) are summed divided by a
    power of two (exact), so mean and RMS neither overflow nor warn.
    """
    if ref.dtype == "QFloat":
        return {}
    if ref.numel == 1:  # (10^6 one-element views: numpy's per-call cost was most of --stats)
        return _one_value_stats(ref, block)
    return _streamed_stats(ref, block)


def _streamed_stats(ref: TensorRef, block: int) -> dict:
    from statekit.stream import nonfinite  # statistics only: a header-only inspect never loads it

    n = ref.numel
    lo, hi, total, squares, nan, inf, scale = math.inf, -math.inf, 0.0, 0.0, 0, 0, 1.0
    for piece in ref.pieces(block):  # read with pread, one block at a time
        with np.errstate(invalid="ignore", over="ignore"):
            chunk = piece.astype(np.float64)
        finite = chunk
        bad_nan, bad_inf = nonfinite(chunk) if dtypes.is_float(ref.dtype) else (0, 0)
        if bad_nan or bad_inf:
            nan, inf = nan + bad_nan, inf + bad_inf
            finite = chunk[np.isfinite(chunk)]
        if finite.size:
            cmin, cmax = float(finite.min()), float(finite.max())
            lo, hi = min(lo, cmin), max(hi, cmax)
            top = max(abs(cmin), abs(cmax))
            if top > LARGE and top > scale:
                grown = math.ldexp(1.0, min(math.frexp(top)[1], 1023))
                total, squares, scale = total * (scale / grown), squares * (scale / grown) ** 2, grown
            part = finite / scale if scale != 1.0 else finite
            total += float(part.sum())
            # numpy's pairwise sum, not BLAS dot: as fast on one core, and the same on any machine
            squares += float(np.square(part).sum())
    count = n - nan - inf
    out = {"min": lo if count else None, "max": hi if count else None,
           "mean": scale * (total / count) if count else None,
           "rms": scale * math.sqrt(squares / count) if count else None,
           "nan": nan, "inf": inf}
    return out


def _one_value_stats(ref: TensorRef, block: int) -> dict:
    """:func:`tensor_stats` of a one-element tensor, the same arithmetic on the one float64 value
    (read the same way) without numpy's per-call cost."""
    values = [float(v) for piece in ref.pieces(block) for v in piece.astype(np.float64).reshape(-1)]
    if len(values) != 1:  # (a reader that disagrees with the shape: the general path says how)
        return _streamed_stats(ref, block)
    return _value_stats(values[0])


def _value_stats(v: float) -> dict:
    """:func:`tensor_stats` of a tensor holding the one value ``v`` (a float64)."""
    if not math.isfinite(v):  # only floats can be: NaN or ±Inf, and no finite value left
        return {"min": None, "max": None, "mean": None, "rms": None, "nan": int(v != v), "inf": int(v == v)}
    scale, top = 1.0, abs(v)
    if top > LARGE and top > scale:  # (2^1023 at most: 2^1024 is no float, and the parts stay below 2)
        scale = math.ldexp(1.0, min(math.frexp(top)[1], 1023))
    part = v / scale if scale != 1.0 else v
    total, squares = 0.0 + part, 0.0 + part * part  # (as the sums start: -0.0 becomes 0.0)
    return {"min": v, "max": v, "mean": scale * (total / 1), "rms": scale * math.sqrt(squares / 1),
            "nan": 0, "inf": 0}


def plain_value(value: object, depth: int = 0) -> object:
    """A param-group value as JSON can hold it: a 0-dim tensor (torchao's ``lr``, torch-optimi's
    ``step``) as its number, another tensor as ``"tensor [shape] dtype"``, an object as its type."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, TensorRef):
        if value.numel == 1 and not value.shape and value.dtype != "QFloat":
            return plain_value(value.numpy().reshape(-1)[0].item())
        return f"tensor {list(value.shape)} {value.dtype}"
    if isinstance(value, list | tuple) and depth < 8:
        return [plain_value(v, depth + 1) for v in value]
    if isinstance(value, dict) and depth < 8:
        return {str(k): plain_value(v, depth + 1) for k, v in value.items()}
    return f"({type(value).__name__})"


def _native(state: OptimizerState, p: ParamState) -> dict[str, str]:
    """neutral slot name → the framework's own name (read only: shared by every parameter)."""
    return _native_names(state.framework, p.family or state.family)


@cache
def _native_names(framework: str | None, family: str | None) -> dict[str, str]:
    if framework in naming.FRAMEWORKS and family not in (None, "mixed"):
        try:
            lay = naming.layout(framework, family)
        except KeyError:  # a family statekit reads but has no field table for: show the names as stored
            return {}
        return lay.native_of()
    return {}


def _candidates(state: OptimizerState, p: ParamState) -> list[str]:
    """The families a parameter's state fits: its own, else the state's where it has the state's family."""
    cands = p.candidates or (state.candidates if p.family == state.family else ())
    return list(cands) if len(cands) > 1 else []


def describe_param(state: OptimizerState, p: ParamState, stats: bool = False,
                   stats_of: Callable[[TensorRef], dict] = tensor_stats) -> dict:
    native = _native(state, p)
    fields: dict[str, dict] = {}
    for slot, ref in p.slots.items():
        enc = p.encoding.get(slot)
        if enc is not None:  # a library's own storage (bitsandbytes): the field as stored, and its meaning
            _encoded_fields(fields, slot, ref, enc, stats, stats_of, _meaning(state, slot))
            continue
        item = {"shape": list(ref.shape), "dtype": ref.dtype, "slot": slot}
        if type(ref.info) is dict and "stored_as" in ref.info:  # a value decoded from another form (torchao codes)
            item["stored_as"] = ref.info["stored_as"]
            if "stored_label" in ref.info:
                item["stored_label"] = ref.info["stored_label"]
        if stats:
            item["stats"] = stats_of(ref)
        fields[native.get(slot, slot)] = item
    for name, value in p.extra.items():
        if isinstance(value, TensorRef):
            item = {"shape": list(value.shape), "dtype": value.dtype}
            if stats:
                item["stats"] = stats_of(value)
            fields[name] = item
    for name, value in p.opaque.items():
        fields[name] = _opaque_field(value)
    shape = p.shape
    out = {
        "id": None if p.id is None else str(p.id),
        "display_id": p.display_id,
        "index": p.index,
        "path": p.path,
        "rank": p.rank,
        "shape": None if shape is None else list(shape),
        "dtype": p.dtype,
        "step": p.step,
        "group": p.group,
        "family": p.family or (state.family if state.family not in (None, "mixed") else
                               "unknown" if state.family == "mixed" else state.family_label),
        "family_candidates": _candidates(state, p),
        "fields": fields,
    }
    if state.framework == "burn":
        out.pop("index")
    return out


MEANING = {"exp_avg": "first moment (m)", "exp_avg_sq": "second moment (v)",
           "exp_avg_slow": "AdEMAMix's slow first moment (m2)", "momentum_buffer": "momentum buffer",
           "square_avg": "running average of squared gradients", "sum": "sum of squared gradients"}


def _meaning(state: OptimizerState, slot: str) -> str:
    """What a slot holds; one whose family is still open (bitsandbytes' state1), what it is in each."""
    named = {f: names[slot] for f, names in state.slot_renames.items() if slot in names}
    if slot in MEANING or not named:
        return MEANING.get(slot, slot)
    return " or ".join(f"{f}'s {n} ({MEANING.get(n, n)})" for f, n in named.items()) + ": say which with --optimizer"


def _encoded_fields(fields: dict, slot: str, ref: TensorRef, enc, stats: bool, stats_of, meaning: str) -> None:
    """A slot a library stores its own way (``enc``: :class:`statekit.frameworks.bnb.Encoded`):
    the stored field (codes or float32 state) with its meaning, and the stored map and scales;
    ``stats`` are of the values the slot holds (dequantized)."""
    name = enc.field if enc.part is None else f"{enc.field}[{enc.part}]"
    item = {"shape": list(enc.codes.shape) if enc.part is None else list(ref.shape), "dtype": enc.codes.dtype,
            "slot": slot, "meaning": meaning, "encoding": enc.describe()}
    if stats:
        item["stats"] = stats_of(ref)
    fields[name] = item
    if enc.bits == 8:
        n = enc.field[-1]
        for key, ref2, role in ((f"qmap{n}", enc.qmap, f"quantization map of {enc.field}"),
                                (f"absmax{n}", enc.absmax, f"block scales of {enc.field}")):
            if key not in fields:
                extra = {"shape": list(ref2.shape), "dtype": ref2.dtype, "role": role}
                if stats and key.startswith("absmax"):
                    extra["stats"] = stats_of(ref2)
                fields[key] = extra


def _opaque_field(value: object, depth: int = 0) -> dict:
    """A value statekit does not understand, as it is: its type, and a dict's keys and entries."""
    if isinstance(value, TensorRef):
        return {"shape": list(value.shape), "dtype": value.dtype}
    if isinstance(value, bool | int | float | str) or value is None:
        return {"value": value}
    out: dict = {"understood": False, "type": type(value).__name__}
    if isinstance(value, dict):
        out["keys"] = [str(k) for k in value]
        if depth < 3:
            out["entries"] = {str(k): _opaque_field(v, depth + 1) for k, v in value.items()}
    elif isinstance(value, list | tuple):
        out["length"] = len(value)
    return out


def opaque_warning(state: OptimizerState) -> str | None:
    """One line naming the entries statekit does not understand, or None."""
    holders = [p for p in state.params if p.opaque]
    if not holders:
        return None
    kinds: dict[str, list[str]] = {}
    for p in holders:
        for name, value in p.opaque.items():
            kinds.setdefault(f"{name} ({describe_opaque(value)})", []).append(p.label())
    parts = []
    for what, labels in kinds.items():
        more = f" +{len(labels) - 3} more" if len(labels) > 3 else ""
        parts.append(f"{what} in {len(labels)} parameter{'s' if len(labels) != 1 else ''} "
                     f"({', '.join(labels[:3])}{more})")
    return ("state statekit does not understand: " + "; ".join(parts)
            + " — not read as optimizer state; doctor and convert refuse it")


def select(ckpt: Checkpoint, only: list[str] | None) -> set[int] | None:
    """Positions of the parameters a user named (a path or a glob of paths, either ParamId
    spelling, key or #index; :func:`statekit.state.matches`); a name that selects nothing is refused."""
    if not only:
        return None
    if ckpt.optimizer is not None:
        items = [dict(path=p.path, key=p.key, id=p.id, index=p.index) for p in ckpt.optimizer.params]
    elif ckpt.model is not None:
        items = [dict(path=m.path, id=m.id) for m in ckpt.model.params]
    else:
        items = []
    chosen: set[int] = set()
    for name in only:
        hits = {i for i, item in enumerate(items) if matches(name, **item)}
        if not hits:
            raise StatekitError(f"no parameter {name!r} (give a path or a glob, a decimal or 13-character ParamId, "
                                "or #index)", ckpt.path)
        chosen |= hits
    return chosen


def _stat_order(p: ParamState) -> list[TensorRef]:
    """The tensors :func:`describe_param` asks statistics of for ``p``'s slots, in its order
    (an encoded slot's values, then its stored scales once)."""
    out, seen = [], set()
    for slot, ref in p.slots.items():
        out.append(ref)
        enc = p.encoding.get(slot)
        if enc is not None and enc.bits == 8 and f"absmax{enc.field[-1]}" not in seen:
            seen.add(f"absmax{enc.field[-1]}")
            out.append(enc.absmax)
    return out


def _prefetched_stats(ckpt: Checkpoint, chosen) -> Callable[[TensorRef], dict]:
    """``tensor_stats`` of every tensor inspect will ask for, computed ``--jobs`` at a time in
    the order asked (each holds one block)."""
    refs: list[TensorRef] = []
    if ckpt.optimizer is not None:
        for i, p in enumerate(ckpt.optimizer.params):
            if chosen is None or i in chosen:
                refs += _stat_order(p) + [v for v in p.extra.values() if isinstance(v, TensorRef)]
    elif ckpt.model is not None:
        refs = [m.tensor for i, m in enumerate(ckpt.model.params)
                if (chosen is None or i in chosen) and m.tensor is not None]
    from statekit import stream

    # one-element tensors inline, in their turn (a thread's hand-off costs more than their stats)
    results = stream.parallel_map(tensor_stats, [r for r in refs if r.numel != 1])
    return lambda ref: tensor_stats(ref) if ref.numel == 1 else next(results)


class Rows(Sequence):
    """The parameters' descriptions, each made when it is read and not kept (``inspect(stream=True)``):
    10^6 descriptions held at once took ~0.35 GB beside the loaded state. Reading it twice makes
    them twice, the same each time (statistics are computed once, kept as numbers: :class:`_Stats`).

    What the renderers ask of it besides (each optional; without it, a Rows is just its rows):
    ``bare`` makes row ``k`` without its statistics (the parameters table shows none),
    ``stat_values`` and ``stat_chunks`` give each row's own statistics without the rows, and
    ``plain`` says at no row's cost that every row holds JSON's types alone (:meth:`json_check`)."""

    json_list = True  # statekit.output writes it as a JSON list

    def __init__(self, make: Callable[[int], dict], n: int, *, bare: Callable[[int], dict] | None = None,
                 stat_values: Callable[[], Iterator[tuple]] | None = None,
                 stat_chunks: Callable[[], Iterator[tuple]] | None = None,
                 plain: Callable[[], bool] | None = None) -> None:
        self._make, self._n = make, n
        self._bare, self._stat_values, self._stat_chunks, self._plain = bare, stat_values, stat_chunks, plain

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._make(k) for k in range(self._n)[i]]
        if not -self._n <= i < self._n:
            raise IndexError("row index out of range")
        return self._make(i % self._n)

    def __iter__(self):
        return map(self._make, range(self._n))

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, Rows) else other)

    __hash__ = None

    def without_stats(self) -> Rows:
        """The same rows without their ``"stats"`` entries (cheaper to make: no statistics dicts)."""
        if self._bare is None:
            return self
        return Rows(self._bare, self._n)

    def stat_values(self) -> Iterator[tuple] | None:
        """``(path, id, values)`` for each row that holds statistics of its own (a model tensor's):
        ``values`` are the row's ``stats`` as a tuple in :data:`STAT_KEYS` order (:meth:`_Stats.each`),
        or None where they are ``{}``; a row without statistics is left out. None when the rows hold them by field
        (an optimizer's): read the rows."""
        return None if self._stat_values is None else self._stat_values()

    def stat_chunks(self) -> Iterator[tuple[list, list, np.ndarray]] | None:
        """:meth:`stat_values` a piece at a time, as numbers: ``(paths, ids, values)`` of up to
        :data:`PIECE_ROWS` rows, ``values`` a (rows, 6) float64 array in :data:`STAT_KEYS` order
        whose min, max, mean and rms are NaN where they are None (all four together); the rows
        whose statistics are ``{}`` left out. None as for :meth:`stat_values`."""
        return None if self._stat_chunks is None else self._stat_chunks()

    def json_check(self) -> Sequence:
        """What :func:`statekit.output.write_chunks`'s first walk needs to walk instead of the rows
        to know that only its fast writer is needed: ``()`` when every row is known to hold only
        ``str``/``int``/``float``/``bool``/None values under ``str`` keys (found from the loaded
        state, no row made); else the rows without statistics (the statistics are floats, ints and
        None by construction: :class:`_Stats`); else the rows themselves."""
        if self._plain is not None and self._plain():
            return ()
        return self.without_stats()


STAT_KEYS = ("min", "max", "mean", "rms", "nan", "inf")


class _Stats:
    """:func:`tensor_stats` of many tensors as one float64 table (6 numbers a tensor, exact: Python's
    floats are float64; None as NaN, which no finite min/max/mean/rms is; ``{}`` as a NaN count):
    :func:`_stat_table`'s."""

    def __init__(self, table) -> None:
        self.table = table
        self._lo, self._rows = 0, []  # a piece of the table as Python floats, read in order

    def row(self, i: int) -> list[float]:
        """Row ``i`` of the table as floats (read in order, :data:`PIECE_ROWS` rows at a time)."""
        at = i - self._lo
        if not 0 <= at < len(self._rows):
            if at != len(self._rows) and i % PIECE_ROWS:  # (not read in order: this row alone)
                return self.table[i].tolist()
            self._lo = i - i % PIECE_ROWS
            self._rows = self.table[self._lo : self._lo + PIECE_ROWS].tolist()
            at = i - self._lo
        return self._rows[at]

    def each(self) -> Iterator[tuple | None]:
        """The statistics of each row in order, in :data:`STAT_KEYS` order (min, max, mean and rms
        all floats or all None), or None for ``{}``."""
        for lo in range(0, len(self.table), PIECE_ROWS):
            for low, high, mean, rms, nan, inf in self.table[lo : lo + PIECE_ROWS].tolist():
                if nan != nan:
                    yield None
                elif low != low:
                    yield None, None, None, None, int(nan), int(inf)
                else:
                    yield low, high, mean, rms, int(nan), int(inf)

    def stats(self, i: int) -> dict:
        """Row ``i`` as the :func:`tensor_stats` dict it was."""
        lo, hi, mean, rms, nan, inf = self.row(i)
        if nan != nan:
            return {}
        if lo != lo:
            return {"min": None, "max": None, "mean": None, "rms": None, "nan": int(nan), "inf": int(inf)}
        return {"min": lo, "max": hi, "mean": mean, "rms": rms, "nan": int(nan), "inf": int(inf)}

    def reader(self, start: int) -> Callable[[TensorRef], dict]:
        """The statistics asked for from row ``start`` on, in the order they were computed."""
        at = iter(range(start, len(self.table)))
        return lambda _ref: self.stats(next(at))


PIECE_ROWS = 4096
_EMPTY = (math.nan,) * 6


def _encoded(st: dict) -> tuple | list:
    """A :func:`tensor_stats` dict as :class:`_Stats` keeps it."""
    return [st[k] if st[k] is not None else math.nan for k in STAT_KEYS] if st else _EMPTY


ONE_BATCH = 4096  # tensors whose statistics are computed together (their one-element ones read at once)
ONE_READ = 1 << 20  # the most bytes one read of a batch's one-element tensors may span


def _stat_table(refs: list[TensorRef], done: Callable[[int], None]) -> np.ndarray:
    """:func:`tensor_stats` of each of ``refs`` as a (len(refs), 6) float64 table (:class:`_Stats`),
    computed in order, the tensors of more than one element ``--jobs`` at a time; ``done(n)`` once
    the first ``n`` are. A batch's one-element tensors that lie close together in one file are read
    with one ``pread`` and computed as one array (10^6 views of a storage: ~8 µs each one by one),
    the same numbers as :func:`_value_stats`; any other, one by one in its turn."""
    from statekit import stream

    table = np.empty((len(refs), 6))
    results = stream.parallel_map(tensor_stats, [r for r in refs if r.numel != 1])
    for lo in range(0, len(refs), ONE_BATCH):
        batch = refs[lo : lo + ONE_BATCH]
        part = table[lo : lo + len(batch)]
        read = _read_ones(batch)
        if read is not None:
            at, values = read
            part[at] = _one_rows(values)
        if read is None or len(read[0]) < len(batch):
            skip = set(read[0]) if read is not None else ()
            for k, r in enumerate(batch):
                if k not in skip:
                    part[k] = _encoded(next(results) if r.numel != 1 else tensor_stats(r))
        done(lo + len(batch))
    return table


_ONE_DTYPES = dtypes.DTYPE_NAMES - {"QFloat"}


def _read_ones(batch: list[TensorRef]):
    """(positions, float64 values) of the one-element tensors of ``batch`` that read their bytes
    from one file's span (as :meth:`TensorRef.pieces` does), of the first such one's file and
    dtype, aligned to their item size within :data:`ONE_READ` bytes, read with one ``pread``;
    None when there are none, or the read fails or comes short (each is then read alone: its
    error in its turn)."""
    at, offsets = [], []
    source = dtype = None
    size = 0
    for k, r in enumerate(batch):
        span = r.span
        if span is None or type(r) is not TensorRef or r.array_loader is not None or r.numel != 1:
            continue
        if source is None:
            if r.dtype not in _ONE_DTYPES:
                continue
            source, dtype, size = span.file, r.dtype, dtypes.itemsize(r.dtype)
        elif span.file is not source or r.dtype != dtype:
            continue
        if span.length != size:
            continue
        at.append(k)
        offsets.append(span.offset)
    if not at:
        return None
    offs = np.array(offsets, dtype=np.int64)
    first = int(offs.min())
    length = int(offs.max()) + size - first
    rel = offs - first
    if length > ONE_READ or (rel % size).any():
        return None
    try:
        data = source.pread(first, length)
    except (StatekitError, OSError):
        return None
    if len(data) != length:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.frombuffer(data, dtype=dtypes.numpy_dtype(dtype))[rel // size].astype(np.float64)
    return at, values


def _one_rows(x: np.ndarray) -> np.ndarray:
    """:func:`_value_stats` of each of the values ``x`` as :class:`_Stats` rows: for a finite value
    within :data:`LARGE`, ``v, v, 0.0 + v, sqrt(v * v), 0, 0`` (IEEE operations, the same in numpy as
    in Python, square root included); any other value through :func:`_value_stats` itself."""
    rows = np.empty((len(x), 6))
    with np.errstate(all="ignore"):
        rows[:, 0] = x
        rows[:, 1] = x
        rows[:, 2] = x + 0.0
        rows[:, 3] = np.sqrt(x * x)
        rows[:, 4:] = 0.0
        other = np.flatnonzero(~(np.isfinite(x) & (np.abs(x) <= LARGE)))
    for k in other.tolist():
        rows[k] = _encoded(_value_stats(float(x[k])))
    return rows


def _stat_refs(state: OptimizerState | None, x) -> list[TensorRef]:
    """The tensors a row asks statistics of, in its order (a parameter's or a model tensor's)."""
    if state is not None:
        return _stat_order(x) + [v for v in x.extra.values() if isinstance(v, TensorRef)]
    return [x.tensor] if x.tensor is not None else []


def _streamed(ckpt: Checkpoint, chosen, stats: bool, on_param) -> Rows:
    """``inspect(stream=True)``'s rows: statistics (if asked) computed first, ``--jobs`` at a time, in order."""
    from array import array

    state = ckpt.optimizer
    items = state.params if state is not None else ckpt.model.params
    picked = items if chosen is None else [x for i, x in enumerate(items) if i in chosen]
    table, starts = None, array("q")
    if stats:
        refs: list[TensorRef] = []
        for x in picked:
            starts.append(len(refs))
            refs += _stat_refs(state, x)
        row = 0

        def done(n: int) -> None:  # progress: once for each row whose tensors are all done
            nonlocal row
            upto = bisect_right(starts, n) - 1
            while on_param and row < upto:
                on_param()
                row += 1
        table = _Stats(_stat_table(refs, done))
        del refs
        for _ in range(len(items) - row):
            if on_param:
                on_param()
    elif on_param:
        for _ in items:
            on_param()
    if state is not None:
        def make(k: int) -> dict:
            return describe_param(state, picked[k], stats, table.reader(starts[k]) if stats else tensor_stats)

        def bare(k: int) -> dict:
            return describe_param(state, picked[k])
        return Rows(make, len(picked), bare=bare if stats else None)

    def model_row(k: int) -> dict:
        m = picked[k]
        item = _model_row(m, False, None)
        if stats and m.tensor is not None:  # (its one tensor's, as _model_row adds them: last)
            item["stats"] = table.stats(starts[k])
        return item

    def bare_model_row(k: int) -> dict:
        return _model_row(picked[k], False, None)

    def stat_values() -> Iterator[tuple]:  # (each model tensor has one row of the table, in order)
        values = table.each()
        for m in picked:
            if m.tensor is not None:
                yield m.path, None if m.id is None else str(m.id), next(values)

    def stat_chunks() -> Iterator[tuple[list, list, np.ndarray]]:
        paths: list = []
        ids: list = []
        done = 0
        for m in picked:
            if m.tensor is not None:
                paths.append(m.path)
                ids.append(None if m.id is None else str(m.id))
                if len(paths) == PIECE_ROWS:
                    yield _stat_chunk(paths, ids, table.table[done : done + len(paths)])
                    done += len(paths)
                    paths, ids = [], []
        if paths:
            yield _stat_chunk(paths, ids, table.table[done : done + len(paths)])

    return Rows(model_row, len(picked), bare=bare_model_row if stats else None,
                stat_values=stat_values if stats else None, stat_chunks=stat_chunks if stats else None,
                plain=lambda: _plain_models(picked))


def _stat_chunk(paths: list, ids: list, values: np.ndarray) -> tuple[list, list, np.ndarray]:
    """A piece of :meth:`Rows.stat_chunks`: the rows whose statistics are ``{}`` left out."""
    kept = values[:, 4] == values[:, 4]  # (a NaN count: {})
    if kept.all():
        return paths, ids, values
    at = np.flatnonzero(kept).tolist()
    return [paths[i] for i in at], [ids[i] for i in at], values[at]


def _plain_models(params: list[ModelParam]) -> bool:
    """Whether every model row holds only ``str``, ``int`` and None (and literals, and statistics:
    floats), from the types of what they are made of (paths, dtypes, ids, shapes), no row made."""
    kinds = set(map(type, params))
    if not kinds <= {ModelParam}:  # (a subclass could describe itself otherwise)
        return False
    kinds = set(map(type, map(attrgetter("path"), params)))
    kinds.update(map(type, map(attrgetter("dtype"), params)))
    kinds.update(map(type, map(attrgetter("id"), params)))
    kinds.update(map(type, chain.from_iterable(map(attrgetter("shape"), params))))
    return kinds <= {str, int, type(None)}


def _model_row(m, stats: bool, stats_of) -> dict:
    item = {"id": None if m.id is None else str(m.id), "display_id": m.display_id, "path": m.path,
            "rank": len(m.shape), "shape": list(m.shape), "dtype": m.dtype}
    if m.buffer:
        item["buffer"] = True
    if stats and m.tensor is not None:
        item["stats"] = stats_of(m.tensor)
    return item


def inspect(ckpt: Checkpoint, stats: bool = False, on_param: Callable[[], None] | None = None,
            only: list[str] | None = None, stream: bool = False) -> dict:
    """The description of ``ckpt`` that ``statekit inspect --json`` prints (``only``: a selection).

    ``stream``: ``"params"`` is a :class:`Rows`, each row described when it is read."""
    chosen = select(ckpt, only)
    out: dict = {
        "path": ckpt.path,
        "format": ckpt.format,
        "version": ckpt.version,
        "kind": ckpt.kind,
        "family": None,
        "family_candidates": [],
        "tensors": ckpt.n_tensors,
        "scalars": ckpt.n_scalars,
        "bytes": ckpt.nbytes,
        "file_bytes": _file_size(ckpt.path),
        "metadata": ckpt.metadata,
        "hyperparameters_stored": False,
        "groups": [],
        "params": [],
        "warnings": list(ckpt.warnings),
        "notes": [],
    }
    state = ckpt.optimizer
    stats_of = _prefetched_stats(ckpt, chosen) if stats and not stream else tensor_stats
    if state is not None:
        out["family"] = state.family or state.family_label  # a name, or "unknown (…)": never blank
        if state.library:
            out["library"] = state.library
        unread = opaque_warning(state)
        if unread:
            out["warnings"].append(unread)
        out["family_label"] = state.family_label
        decoded = sum(ref.nbytes for p in state.params for ref in p.slots.values()
                      if type(ref.info) is dict and "stored_tensors" in ref.info)
        if decoded:  # "bytes" counts what the file stores (torchao's codes); these are the values as read
            out["dequantized_bytes"] = decoded
        out["family_candidates"] = list(state.candidates)
        out["hyperparameters_stored"] = state.hyperparams_stored
        out["notes"] = list(state.notes) + ([state.names_from] if state.names_from else [])
        out["groups"] = [{"hyperparameters": {str(k): plain_value(v) for k, v in g.hyperparams.items()},
                          "params": len(g.keys)} for g in state.groups]
        if state.family == "mixed":  # one optimizer per group (burn's with_group): each group's family
            for item, g in zip(out["groups"], state.groups, strict=True):
                item["family"] = g.family
                item["family_candidates"] = list(g.candidates) if len(g.candidates) > 1 else []
        if stream:
            out["params"] = _streamed(ckpt, chosen, stats, on_param)
        for i, p in enumerate(state.params if not stream else ()):
            if chosen is None or i in chosen:
                out["params"].append(describe_param(state, p, stats, stats_of))
            if on_param:
                on_param()
        if state.global_slots or state.global_scalars:
            out["global"] = {
                "tensors": {n: {"shape": list(r.shape), "dtype": r.dtype} for n, r in state.global_slots.items()},
                "scalars": state.global_scalars,
            }
            if stats:
                for n, r in state.global_slots.items():
                    out["global"]["tensors"][n]["stats"] = tensor_stats(r)
        if ckpt.format == "burnpack" and not state.hyperparams_stored:
            out["notes"].append("burn optimizer files store no hyperparameters (lr, betas, eps, decay)")
    elif ckpt.model is not None:
        if stream:
            out["params"] = _streamed(ckpt, chosen, stats, on_param)
        for i, m in enumerate(ckpt.model.params if not stream else ()):
            if chosen is not None and i not in chosen:
                continue
            out["params"].append(_model_row(m, stats, stats_of))
            if on_param:
                on_param()
    _beside(ckpt, out)
    return out


def _beside(ckpt: Checkpoint, out: dict) -> None:
    """Loose scalars, LR schedulers and the schedule (:func:`statekit.schedule.model.describe`)."""
    if ckpt.scalars:
        out["scalar_values"] = ckpt.scalars
    if ckpt.schedulers:
        out["schedulers"] = ckpt.schedulers
    if ckpt.schedule is not None:
        from statekit.schedule import model as schedule_model

        out["schedule"] = schedule_model.describe(ckpt.schedule)


def _file_size(path: str) -> int | None:
    """The size on disk: the file's, or a folder's files together (sharded checkpoints)."""
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        return os.path.getsize(path)
    except OSError:
        return None
