"""``diff``: compare two files' optimizer state (or two models), parameter by parameter.

Parameters are matched by burn ParamId when both files have one for every parameter, else by
module path, else by torch parameter index (:func:`match_method`); the result says which. For
each matched pair: shape / dtype / step / rank / family differences and, per field (neutral slot
name), the largest absolute and relative difference and the largest distance in ULPs of the
field's float format. Comparison is NaN-aware: NaN against NaN at the same place is equal, NaN
against a number differs. An element is within tolerance when ``|a − b| ≤ atol + rtol·max(|a|,
|b|)`` (symmetric, so ``diff A B`` and ``diff B A`` agree); the defaults (0, 0) ask for equal
values (``-0.0`` equals ``0.0``).

Tensors are streamed one field pair at a time, in blocks, so memory stays one pair.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator

import numpy as np

from statekit import dtypes, io, stream
from statekit import tensor as _tensor
from statekit.errors import MappingError, UsageError
from statekit.ops import ulp
from statekit.ops.inspect import plain_value
from statekit.state import Checkpoint, ModelInfo, OptimizerState, ParamState, matches, settle_from
from statekit.tensor import TensorRef

BLOCK = 1 << 18
GLOBAL = "(global state)"
METHOD_WORDS = {"id": "burn ParamId", "path": "module path", "index": "torch parameter index",
                "key": "state key"}


# ----------------------------------------------------------------------------- matching


def _all_have(params: list, attr: str) -> bool:
    return all(getattr(p, attr) is not None for p in params)


def _unique(params: list, attr: str) -> bool:
    values = [getattr(p, attr) for p in params]
    return len(set(values)) == len(values)


def match_method(*sides: list) -> str:
    """How to pair parameters of several states: ``id``, ``path``, ``index`` or ``key``.

    burn ParamIds when every parameter on every side has one (unless the sides share no id but do
    share paths, as a state and its remapped copy do); module paths when every parameter has a
    unique one; torch positions when every parameter has one; the state key otherwise.
    """
    by_path = any(sides) and all(_all_have(s, "path") and _unique(s, "path") for s in sides)
    if any(sides) and all(_all_have(s, "id") for s in sides):
        shared_ids = set.intersection(*({p.id for p in s} for s in sides))
        shared_paths = set.intersection(*({p.path for p in s} for s in sides)) if by_path else set()
        # states remapped onto a new model share paths, not ids: pair those by path
        if shared_ids or not shared_paths:
            return "id"
    if by_path:
        return "path"
    if any(sides) and all(_all_have(s, "index") for s in sides):
        return "index"
    return "key"


def match_key(p, method: str):
    return getattr(p, method)


def pair_params(a: list, b: list, method: str) -> tuple[list[tuple], list, list]:
    """(pairs, only in a, only in b) in a's order, then b's leftovers in b's order."""
    index_b: dict[object, list] = {}
    for p in b:
        index_b.setdefault(match_key(p, method), []).append(p)
    pairs, only_a = [], []
    for p in a:
        candidates = index_b.get(match_key(p, method))
        if candidates:
            pairs.append((p, candidates.pop(0)))
        else:
            only_a.append(p)
    taken = {id(q) for _, q in pairs}
    only_b = [q for q in b if id(q) not in taken]
    return pairs, only_a, only_b


# ----------------------------------------------------------------------------- values


def _jsonable_scalar(value):
    if isinstance(value, np.generic):
        return value.item()
    return value


def _index(flat: int, shape: tuple[int, ...]) -> list[int]:
    return [int(i) for i in np.unravel_index(flat, shape)] if shape else []


def _same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two pieces hold the same bytes (``memcmp`` of the buffers read from the files)."""
    bx, by = x.base, y.base
    if type(bx) is bytes and type(by) is bytes and len(bx) == x.nbytes and len(by) == y.nbytes:
        return bx == by
    return x.nbytes == y.nbytes and np.array_equal(x.view(np.uint8), y.view(np.uint8))


class _Tally:
    """The running facts of one comparison, fed block by block where the bytes differ."""

    def __init__(self, atol: float, rtol: float, ulp_dtype: str | None):
        self.atol, self.rtol, self.ulp_dtype = atol, rtol, ulp_dtype
        self.max_abs, self.max_rel, self.max_ulp = 0.0, 0.0, 0
        self.worst_at, self.worst_d, self.worst = None, -1.0, None
        self.differing = self.nan_mismatch = 0
        self.first_nan, self.first_nan_values = None, None

    def block(self, x: np.ndarray, y: np.ndarray, lo: int) -> None:
        atol, rtol = self.atol, self.rtol
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        nx, ny = np.isnan(xf), np.isnan(yf)
        mismatch = nx ^ ny
        same = (xf == yf) | (nx & ny)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(xf - yf)
        d[same | mismatch] = 0.0
        scale = np.maximum(np.abs(np.where(nx, 0.0, xf)), np.abs(np.where(ny, 0.0, yf)))
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(d == 0, 0.0, np.where(np.isinf(d), np.inf, d / scale))
        with np.errstate(invalid="ignore", over="ignore"):
            limit = atol + rtol * scale if rtol else atol
            # Inf against a number (or an overflowing difference) is never within tolerance.
            bad = mismatch | (d > limit) | np.isinf(d)
        self.differing += int(bad.sum())
        count = int(mismatch.sum())
        if count and self.first_nan is None:
            k = int(np.argmax(mismatch))
            self.first_nan, self.first_nan_values = lo + k, (x[k], y[k])
        self.nan_mismatch += count
        if d.size:
            k = int(np.argmax(d))
            if d[k] > self.worst_d and d[k] > 0:
                self.worst_d, self.worst_at, self.worst = float(d[k]), lo + k, (x[k], y[k])
            self.max_abs = max(self.max_abs, float(d[k]))
            self.max_rel = max(self.max_rel, float(rel.max()))
        if self.ulp_dtype is not None and x.size:
            want = dtypes.numpy_dtype(self.ulp_dtype)
            xc = x if x.dtype == want else x.astype(want)
            yc = y if y.dtype == want else y.astype(want)
            u = ulp.distance(xc, yc)
            u[nx | ny | same] = 0
            self.max_ulp = max(self.max_ulp, int(u.max()))


def _element(value) -> object:
    return _jsonable_scalar(value.astype(np.float64) if value.dtype != bool else value)


def _plain_span(ref: TensorRef) -> bool:
    """Whether ``ref``'s values are its file span's bytes as they lie (what ``pieces`` reads)."""
    return ref.span is not None and ref.array_loader is None


def compare_refs(ra: TensorRef, rb: TensorRef, atol: float = 0.0, rtol: float = 0.0,
                 block: int = BLOCK) -> dict:
    """Compare two tensors elementwise; one dict of facts (JSON-able), ``equal`` among them.

    Both tensors are read in pieces side by side; pieces (then blocks) whose bytes are equal are
    skipped at ``memcmp`` speed, and differences, ULPs and tolerances are computed only where the
    bytes differ. Memory: two pieces.
    """
    out: dict = {
        "dtype_a": ra.dtype, "dtype_b": rb.dtype,
        "shape_a": list(ra.shape), "shape_b": list(rb.shape),
        "elements": ra.numel, "compared": False, "differing": 0, "nan_mismatch": 0,
        "max_abs": None, "max_rel": None, "max_ulp": None, "ulp_dtype": None, "worst": None,
    }
    if tuple(ra.shape) != tuple(rb.shape):
        out.update(equal=False, reason="shape")
        return out
    if "QFloat" in (ra.dtype, rb.dtype):
        same = ra.dtype == rb.dtype and ra.nbytes == rb.nbytes and all(
            bytes(x) == bytes(y) for x, y in zip(ra.iter_bytes(), rb.iter_bytes(), strict=False))
        out.update(compared=True, equal=same, differing=0 if same else ra.numel, reason="quantized bytes")
        return out
    float_a, float_b = dtypes.is_float(ra.dtype), dtypes.is_float(rb.dtype)
    ulp_dtype = None
    if float_a and float_b:
        ulp_dtype = ra.dtype if ra.dtype == rb.dtype else ulp.coarser(ra.dtype, rb.dtype)
        if ulp_dtype == "Flex32":
            ulp_dtype = "F32"
    tally = _Tally(atol, rtol, ulp_dtype)
    same_dtype = dtypes.numpy_dtype(ra.dtype) == dtypes.numpy_dtype(rb.dtype)
    widest = max(dtypes.itemsize(ra.dtype), dtypes.itemsize(rb.dtype))
    per_piece = max(block, _tensor.PIECE // widest // block * block)
    base = 0
    # two spans of files with the same bytes (the common case: a state against its copy) are
    # compared where they lie, nothing read; anything else is read in pieces and compared below
    identical = same_dtype and _plain_span(ra) and _plain_span(rb) and stream.same_spans(ra.span, rb.span)
    pieces = () if identical else zip(ra.pieces(per_piece), rb.pieces(per_piece), strict=True)
    for x, y in pieces:
        if not (same_dtype and _same_bytes(x, y)):
            for lo in range(0, x.size, block):
                xs, ys = x[lo : lo + block], y[lo : lo + block]
                if same_dtype and np.array_equal(xs.view(np.uint8), ys.view(np.uint8)):
                    continue
                tally.block(xs, ys, base + lo)
        base += x.size
    where = tally.worst_at if tally.worst_at is not None else tally.first_nan
    worst = None
    if where is not None:
        a, b = tally.worst if tally.worst_at is not None else tally.first_nan_values
        worst = {"index": _index(where, tuple(ra.shape)), "a": _element(a), "b": _element(b)}
    differing = tally.differing
    out.update(
        compared=True, equal=differing == 0 and ra.dtype == rb.dtype, differing=differing,
        nan_mismatch=tally.nan_mismatch, max_abs=tally.max_abs, max_rel=tally.max_rel,
        max_ulp=tally.max_ulp if ulp_dtype is not None else None, ulp_dtype=ulp_dtype, worst=worst,
    )
    if ra.dtype != rb.dtype:
        out["reason"] = "dtype"
    return out


def _same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # arrays and other exotic values: compare their text
        return repr(a) == repr(b)


def _scalar_value(value):
    return getattr(value, "value", value)


# ----------------------------------------------------------------------------- params


def _fields(p: ParamState) -> dict[str, TensorRef]:
    out = dict(p.slots)
    for name, value in p.extra.items():
        if isinstance(value, TensorRef) and name not in out:
            out[name] = value
    return out


def _extra_scalars(p: ParamState) -> dict[str, object]:
    return {k: _scalar_value(v) for k, v in p.extra.items()
            if not k.startswith("__") and not isinstance(v, TensorRef)}


def describe_ref(p: ParamState) -> dict:
    return {"label": p.label(), "id": None if p.id is None else str(p.id), "path": p.path,
            "index": p.index, "shape": None if p.shape is None else list(p.shape), "dtype": p.dtype,
            "step": p.step}


def field_pairs(pa: ParamState, pb: ParamState) -> list[tuple[TensorRef, TensorRef]]:
    """The tensor pairs :func:`compare_params` compares, in its order."""
    fa, fb = _fields(pa), _fields(pb)
    return [(fa[name], fb[name]) for name in fa if name in fb]


def _look_alike(a: str, b: str) -> bool:
    """Families whose per-parameter state is identical in burn (Adam/AdamW): a per-parameter label
    cannot tell them apart, so only the states' families (compared separately) can differ."""
    from statekit import naming

    return any({a, b} <= {lay.family, *lay.also} for lay in naming.BURN)


def compare_params(pa: ParamState, pb: ParamState, method: str, atol: float, rtol: float,
                   on_bytes: Callable[[int], None] | None = None, compared: Iterator[dict] | None = None) -> dict:
    """One pair's differences; ``compared`` (when given) yields the :func:`compare_refs` results
    of :func:`field_pairs` in order (computed ahead, concurrently)."""
    diffs: list[dict] = []

    def note(what: str, a, b) -> None:
        diffs.append({"what": what, "a": a, "b": b})

    if method != "path" and pa.path and pb.path and pa.path != pb.path:
        note("path", pa.path, pb.path)
    if method != "id" and pa.id is not None and pb.id is not None and pa.id != pb.id:
        note("id", str(pa.id), str(pb.id))
    if not _same_value(pa.step, pb.step):
        note("step", pa.step, pb.step)
    if pa.rank is not None and pb.rank is not None and pa.rank != pb.rank:
        note("rank", pa.rank, pb.rank)
    if pa.family and pb.family and pa.family != pb.family and not _look_alike(pa.family, pb.family):
        note("family", pa.family, pb.family)
    if pa.shape is not None and pb.shape is not None and tuple(pa.shape) != tuple(pb.shape):
        note("shape", list(pa.shape), list(pb.shape))
    if pa.dtype and pb.dtype and pa.dtype != pb.dtype:
        note("dtype", pa.dtype, pb.dtype)
    fa, fb = _fields(pa), _fields(pb)
    fields: list[dict] = []
    for name in [*fa, *(n for n in fb if n not in fa)]:
        if name not in fb:
            fields.append({"name": name, "only": "a", "equal": False, "shape_a": list(fa[name].shape),
                           "dtype_a": fa[name].dtype})
            continue
        if name not in fa:
            fields.append({"name": name, "only": "b", "equal": False, "shape_b": list(fb[name].shape),
                           "dtype_b": fb[name].dtype})
            continue
        facts = next(compared) if compared is not None else compare_refs(fa[name], fb[name], atol, rtol)
        item = {"name": name, **facts}
        fields.append(item)
        if on_bytes:
            on_bytes(fa[name].nbytes + fb[name].nbytes)
    sa, sb = _extra_scalars(pa), _extra_scalars(pb)
    for name in [*sa, *(n for n in sb if n not in sa)]:
        if not _same_value(sa.get(name), sb.get(name)):
            note(f"scalar {name}", sa.get(name), sb.get(name))
    equal = not diffs and all(f["equal"] for f in fields)
    return {"a": describe_ref(pa), "b": describe_ref(pb), "label": pa.label(), "equal": equal,
            "differences": diffs, "fields": fields}


def _model_params(model: ModelInfo) -> list[ParamState]:
    """Model tensors as parameter-like records with one field, ``value``."""
    out = []
    for i, m in enumerate(model.params):
        slots = {"value": m.tensor} if m.tensor is not None else {}
        out.append(ParamState(key=m.path, id=m.id, index=m.index if m.index is not None else i, path=m.path,
                              rank=len(m.shape), slots=slots, declared_shape=tuple(m.shape)))
    return out


def _state_params(state: OptimizerState | None) -> list[ParamState]:
    if state is None:
        return []
    params = list(state.params)
    if state.global_slots:
        params.append(ParamState(key=GLOBAL, path=GLOBAL, slots=dict(state.global_slots)))
    return params


def _selected(params: list[ParamState], only: list[str]) -> list[ParamState]:
    return [p for p in params if any(matches(n, path=p.path, key=p.key, id=p.id, index=p.index) for n in only)]


def _side(ckpt: Checkpoint) -> tuple[str, list[ParamState]]:
    if ckpt.kind in ("optimizer", "empty"):
        return "optimizer", _state_params(ckpt.optimizer)
    if ckpt.kind == "model" and ckpt.model is not None:
        return "model", _model_params(ckpt.model)
    if ckpt.kind == "scheduler":
        return "scheduler", []
    raise MappingError(f"diff compares optimizer states, models and schedulers; this is a {ckpt.kind} file",
                       ckpt.path)


def _hyperparameters(sa: OptimizerState | None, sb: OptimizerState | None) -> tuple[list[dict], list[str]]:
    diffs: list[dict] = []
    notes: list[str] = []
    stored_a = bool(sa and sa.hyperparams_stored)
    stored_b = bool(sb and sb.hyperparams_stored)
    if stored_a != stored_b:
        side = "A" if stored_a else "B"
        notes.append(f"only {side} stores hyperparameters; they were not compared")
    if not (stored_a and stored_b):
        return diffs, notes
    if len(sa.groups) != len(sb.groups):
        diffs.append({"group": None, "name": "groups", "a": len(sa.groups), "b": len(sb.groups)})
    for i, (ga, gb) in enumerate(zip(sa.groups, sb.groups, strict=False)):
        # a group value stored as a tensor (torchao's lr, torch-optimi's step) is compared by its number
        ha = {k: _group_value(v) for k, v in ga.hyperparams.items() if k not in ("params", "param_names")}
        hb = {k: _group_value(v) for k, v in gb.hyperparams.items() if k not in ("params", "param_names")}
        for name in [*ha, *(k for k in hb if k not in ha)]:
            if not _same_value(ha.get(name), hb.get(name)):
                diffs.append({"group": i, "name": name, "a": ha.get(name), "b": hb.get(name)})
    return diffs, notes


def _group_value(value):
    if isinstance(value, TensorRef):
        return plain_value(value)
    if isinstance(value, list | tuple):
        return type(value)(_group_value(v) for v in value)
    return value


def _scalar_diffs(a: dict, b: dict, prefix: str) -> list[dict]:
    out = []
    for name in [*a, *(n for n in b if n not in a)]:
        va, vb = _scalar_value(a.get(name)), _scalar_value(b.get(name))
        if name not in a or name not in b or not _same_value(va, vb):
            out.append({"what": f"{prefix}{name}", "a": va if name in a else None,
                        "b": vb if name in b else None})
    return out


def _file_facts(ckpt: Checkpoint, params: list) -> dict:
    state = ckpt.optimizer
    return {"path": ckpt.path, "format": ckpt.format, "kind": ckpt.kind,
            "family": state.family_label if state is not None and state.family else None,
            "params": len(params)}


def diff(ca: Checkpoint, cb: Checkpoint, atol: float = 0.0, rtol: float = 0.0,
         on_bytes: Callable[[int], None] | None = None, only: list[str] | None = None) -> dict:
    """Compare two opened checkpoints; a JSON-able dict with ``equal`` and every difference.
    ``only``: parameter names or path globs (:func:`statekit.state.matches`) to compare."""
    if not (atol >= 0 and rtol >= 0):  # also refuses NaN
        raise UsageError(f"--atol and --rtol must be non-negative numbers (got {atol}, {rtol})")
    settled = settle_from(ca.optimizer, cb.optimizer, cb.path) if ca.optimizer and cb.optimizer else []
    kind_a, params_a = _side(ca)
    kind_b, params_b = _side(cb)
    if only:
        params_a, params_b = _selected(params_a, only), _selected(params_b, only)
    if kind_a != kind_b:
        raise MappingError(f"cannot compare {ca.path} ({kind_a}) with {cb.path} ({kind_b})")
    method = match_method(params_a, params_b)
    pairs, only_a, only_b = pair_params(params_a, params_b, method)
    tasks = [pair for pa, pb in pairs for pair in field_pairs(pa, pb)]
    results = stream.parallel_map(lambda t: compare_refs(t[0], t[1], atol, rtol), tasks)
    compared = [compare_params(pa, pb, method, atol, rtol, on_bytes, results) for pa, pb in pairs]
    state_diffs: list[dict] = []
    sa, sb = ca.optimizer, cb.optimizer
    notes: list[str] = list(settled)
    if sa is not None and sb is not None and sa.params and sb.params:
        fam_a = {sa.family, *sa.candidates} - {None}
        fam_b = {sb.family, *sb.candidates} - {None}
        if fam_a and fam_b and not fam_a & fam_b:
            state_diffs.append({"what": "family", "a": sa.family_label, "b": sb.family_label})
    if sa is not None and sb is not None:
        state_diffs += _scalar_diffs(sa.global_scalars, sb.global_scalars, "global ")
    state_diffs += _scalar_diffs(ca.scalars, cb.scalars, "")
    if method == "key" and params_a and params_b and not pairs:
        notes.append("the files share no way to match parameters (burn ids, module paths or torch indices); "
                     "convert one of them with names or a model first")
    hyper, hyper_notes = _hyperparameters(sa, sb)
    notes += hyper_notes
    fields = [f for p in compared for f in p["fields"]]
    numeric = [f for f in fields if f.get("compared")]
    ulps = [f["max_ulp"] for f in numeric if f.get("max_ulp") is not None]
    summary = {
        "params_compared": len(compared),
        "params_differing": sum(1 for p in compared if not p["equal"]),
        "only_in_a": len(only_a),
        "only_in_b": len(only_b),
        "fields_compared": len(fields),
        "fields_differing": sum(1 for f in fields if not f["equal"]),
        "max_abs": max((f["max_abs"] for f in numeric), default=None),
        "max_rel": max((f["max_rel"] for f in numeric), default=None),
        "max_ulp": max(ulps, default=None),
        "nan_mismatch": sum(f["nan_mismatch"] for f in numeric),
    }
    equal = (not only_a and not only_b and not state_diffs and not hyper
             and all(p["equal"] for p in compared))
    return {
        "a": _file_facts(ca, params_a),
        "b": _file_facts(cb, params_b),
        "kind": kind_a,
        "matched_by": method,
        "atol": atol,
        "rtol": rtol,
        "equal": equal,
        "only_in_a": [describe_ref(p) for p in only_a],
        "only_in_b": [describe_ref(p) for p in only_b],
        "differences": state_diffs,
        "hyperparameters": hyper,
        "params": compared,
        "summary": summary,
        "notes": notes,
    }


def diff_files(a: str | os.PathLike, b: str | os.PathLike, atol: float = 0.0, rtol: float = 0.0,
               progress=None, only: list[str] | None = None, *, names: object = None,
               names_order: str | None = None, model: object = None) -> dict:
    """Open both files and :func:`diff` them. ``progress(description, total)`` is a context
    manager factory yielding an ``advance(n)`` callback (see :meth:`Output.progress`).
    ``names`` / ``names_order`` / ``model`` name a torch side's positions (solved by
    :mod:`statekit.frameworks.torch_names`) so it can be matched by path."""
    if not (atol >= 0 and rtol >= 0):
        raise UsageError(f"--atol and --rtol must be non-negative numbers (got {atol}, {rtol})")
    with contextlib.ExitStack() as stack:
        ca = stack.enter_context(io.open_checkpoint(a))
        cb = stack.enter_context(io.open_checkpoint(b))
        if names is not None or model is not None:
            from statekit.ops.convert import name_source_params
            from statekit.ops.options import make_options

            opts = make_options(names=names, names_order=names_order, model=model)
            for ckpt in (ca, cb):
                state = ckpt.optimizer
                if state is not None and state.framework == "torch" and not all(p.path for p in state.params):
                    name_source_params(state, opts, ckpt.path)
        bar = progress("comparing", ca.nbytes + cb.nbytes) if progress else contextlib.nullcontext(None)
        with bar as advance:
            return diff(ca, cb, atol, rtol, on_bytes=advance, only=only)
