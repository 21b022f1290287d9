"""One parameter's numbers, from one pass over its state's bytes, piece by piece.

Every slot a :class:`~statekit.ops.report.formulas.Plan` names (and, given, the weight and the
other state's moments) is read side by side in pieces of :data:`PIECE` elements; each piece adds
to counts, float64 sums and bounded-bin histograms (:mod:`statekit.ops.report.bins`), and is then
dropped. Memory is a few pieces per tensor whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from statekit import dtypes
from statekit.lazy import numpy as np
from statekit.ops.report import bins
from statekit.ops.report.formulas import Plan
from statekit.state import ParamState
from statekit.tensor import TensorRef, rechunk

PIECE = 1 << 18
PERCENTILES = (("p5", 0.05), ("p50", 0.5), ("p95", 0.95))


@dataclass
class Job:
    """What to measure for one parameter."""

    p: ParamState
    plan: Plan
    weight: TensorRef | None = None
    other: ParamState | None = None  # the --against state's parameter
    other_plan: Plan | None = None


class _Sums:
    """The running counts and sums of one parameter."""

    def __init__(self) -> None:
        self.n = self.total = self.nonfinite = self.m_zero = self.v_zero = self.eps = 0
        self.m_sq = self.v_sum = self.v_sq = self.u_sq = self.uw_sq = self.w_sq = 0.0
        self.a_m_sq = self.a_v_sq = self.mm = 0.0
        self.d_hist = self.v_hist = None
        self.sign_nz = 0


def _floats(x):
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def _readable(ref: TensorRef | None) -> bool:
    return ref is not None and ref.dtype != "QFloat" and (dtypes.is_float(ref.dtype) or ref.dtype == "Bool")


def _factored(p: ParamState, plan: Plan) -> Iterator:
    """Adafactor's second moment rebuilt from its factors, a band of rows at a time:
    ``v = R·C / mean(R)`` (torch: ``mean(R)`` clamped at ε1)."""
    row_slot, col_slot = plan.factored
    row, col = p.slots[row_slot], p.slots[col_slot]
    m = col.shape[-1]
    rows = row.numpy().astype(np.float32).reshape(-1, row.shape[-2])
    cols = col.numpy().astype(np.float32).reshape(-1, m)

    def pieces(elements: int) -> Iterator:
        band = max(1, elements // max(m, 1))
        for r, c in zip(rows, cols, strict=True):
            mean = max(float(r.astype(np.float64).mean()), plan.factored_eps)
            for lo in range(0, len(r), band):
                yield (np.outer(r[lo : lo + band], c) / np.float32(mean)).reshape(-1)

    return pieces


def _sources(job: Job) -> tuple[list[str], list, list[str]]:
    """(names, piece iterators, notes): every array read side by side for ``job``."""
    p, plan = job.p, job.plan
    names: list[str] = []
    refs: list = []
    notes: list[str] = []
    numel = _numel(p, plan)

    def add(name: str, ref) -> None:
        if name in names:
            return
        names.append(name)
        refs.append(ref)

    wanted = [plan.m, plan.v, *plan.d_slots, plan.u_slot]
    for slot in wanted:
        if slot and slot in p.slots and _readable(p.slots[slot]) and p.slots[slot].numel == numel:
            add(slot, p.slots[slot])
    if plan.factored and all(s in p.slots for s in plan.factored):
        add("D", _factored(p, plan))
    if job.weight is not None:
        if job.weight.numel == numel and _readable(job.weight):
            add("w", job.weight)
        else:
            notes.append(f"weight of shape {list(job.weight.shape)} does not fit the state; left out")
    if job.other is not None and job.other_plan is not None:
        o, op = job.other, job.other_plan
        for key, slot in (("a_m", op.m), ("a_v", op.v)):
            ref = o.slots.get(slot) if slot else None
            if ref is not None and _readable(ref) and ref.numel == numel:
                add(key, ref)
    iters = [rechunk(r(PIECE), PIECE) if callable(r) else r.pieces(PIECE) for r in refs]
    return names, iters, notes


def _numel(p: ParamState, plan: Plan) -> int:
    shape = p.shape
    return math.prod(shape) if shape is not None else 0


def measure(job: Job) -> dict:
    """The numbers of one parameter (``report``'s per-tensor entry, before findings)."""
    from statekit.stream import nonfinite

    p, plan = job.p, job.plan
    names, iters, notes = _sources(job)
    s = _Sums()
    d_name = "D" if "D" in names else (plan.d_slots[0] if plan.d_slots and plan.d_slots[0] in names else None)
    has_d = d_name is not None and all(x in names for x in plan.d_slots)
    thresholds: dict = {}
    extra_nonfinite = _scan_rest(p, names)
    for arrays in zip(*iters, strict=True):
        a = dict(zip(names, (_floats(x) for x in arrays), strict=True))
        n = len(arrays[0]) if arrays else 0
        s.total += n
        D = _counts(s, a, plan, d_name if has_d else None, thresholds)
        checked = [k for k in names if k not in ("w", "a_m", "a_v")]
        if any(sum(nonfinite(a[k])) for k in checked):
            keep = np.ones(n, dtype=bool)
            for k in names:
                fin = np.isfinite(a[k])
                if k in checked and k != "D":
                    s.nonfinite += int(n - np.count_nonzero(fin))
                keep &= fin
            a = {k: x[keep] for k, x in a.items()}
            D = None
        s.n += len(next(iter(a.values()))) if a else 0
        _sums(s, a, plan, d_name if has_d else None, D)
    out = _result(job, s, names, has_d, notes)
    out["nonfinite"] = s.nonfinite + extra_nonfinite
    return out


def _scan_rest(p: ParamState, read: list[str]) -> int:
    """NaN/Inf in the float slots the plan does not read (counted, not measured)."""
    from statekit.stream import nonfinite

    total = 0
    for slot, ref in p.slots.items():
        if slot in read or not _readable(ref) or not dtypes.is_float(ref.dtype):
            continue
        for piece in ref.pieces(PIECE):
            total += sum(nonfinite(piece))
    return total


def _counts(s: _Sums, a: dict, plan: Plan, d_name: str | None, thresholds: dict):
    """Zeros, ε-dominated coordinates and histograms of a piece as read (NaN is neither zero nor
    below a threshold, and falls in no finite bin); returns ``D`` for :func:`_sums`."""
    m = a.get(plan.m) if plan.m else None
    if m is not None:
        s.m_zero += len(m) - int(np.count_nonzero(m))
        if plan.u_kind == "sign":
            s.sign_nz += int(np.count_nonzero(m))
    v = _v(a, plan)
    if v is not None:
        s.v_zero += len(v) - int(np.count_nonzero(v))
    D = None
    if d_name is not None:
        D = plan.d_fn(*(a[k] for k in plan.d_slots)) if plan.d_fn is not None else a[d_name]
        hist = bins.counts(D)
        s.d_hist = hist if s.d_hist is None else s.d_hist + hist
        if plan.eps_pred is not None:
            key = D.dtype.str
            if key not in thresholds:
                own = getattr(plan.eps_pred, "key", None)
                found = bins.cached_threshold(own, plan.eps_pred, D.dtype) if own else \
                    bins.threshold(plan.eps_pred, D.dtype)
                thresholds[key] = D.dtype.type(found)
            s.eps += int(np.count_nonzero(D < thresholds[key]))
    if v is not None and v is not D:
        vh = bins.counts(v)
        s.v_hist = vh if s.v_hist is None else s.v_hist + vh
    return D


def _v(a: dict, plan: Plan):
    if plan.factored:
        return a.get("D")
    return a.get(plan.v) if plan.v else None


def _sums(s: _Sums, a: dict, plan: Plan, d_name: str | None, D) -> None:
    """The float64 sums of a piece whose every array is finite."""
    m = a.get(plan.m) if plan.m else None
    if m is not None:
        m64 = m.astype(np.float64)
        s.m_sq += float(np.dot(m64, m64))
    v = _v(a, plan)
    if v is not None:
        s.v_sum += float(np.add.reduce(v, dtype=np.float64))
        if "a_v" in a:
            v64 = v.astype(np.float64)
            s.v_sq += float(np.dot(v64, v64))
    w64 = a["w"].astype(np.float64) if "w" in a else None
    if d_name is not None and plan.u_kind == "ratio" and m is not None:
        if D is None:
            D = plan.d_fn(*(a[k] for k in plan.d_slots)) if plan.d_fn is not None else a[d_name]
        d = np.sqrt(D) if plan.d_pow == 0.5 else D.copy()
        if plan.d_a != 1.0:
            d *= D.dtype.type(plan.d_a)
        if plan.d_b:
            d += D.dtype.type(plan.d_b)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = m / d
        q64 = q.astype(np.float64)
        s.u_sq += float(np.dot(q64, q64))
        if w64 is not None:
            x = q64 * plan.u_k + plan.wd * w64
            s.uw_sq += float(np.dot(x, x))
    elif plan.u_kind == "slot" and plan.u_slot in a:
        u64 = a[plan.u_slot].astype(np.float64)
        s.u_sq += float(np.dot(u64, u64))
        if w64 is not None:
            x = u64 * plan.u_k + plan.wd * w64
            s.uw_sq += float(np.dot(x, x))
    elif plan.u_kind == "sign" and m is not None and w64 is not None:
        x = np.sign(m).astype(np.float64) + plan.wd * w64
        s.uw_sq += float(np.dot(x, x))
    if w64 is not None:
        s.w_sq += float(np.dot(w64, w64))
    if "a_m" in a and m is not None:
        am = a["a_m"].astype(np.float64)
        s.a_m_sq += float(np.dot(am, am))
        s.mm += float(np.dot(am, m.astype(np.float64)))
    if "a_v" in a:
        av = a["a_v"].astype(np.float64)
        s.a_v_sq += float(np.dot(av, av))


def _rms(total: float, n: int) -> float | None:
    return math.sqrt(total / n) if n else None


def _result(job: Job, s: _Sums, names: list[str], has_d: bool, notes: list[str]) -> dict:
    p, plan = job.p, job.plan
    n = _numel(p, plan)
    finite = s.n  # elements whose every array was finite
    out: dict = {"numel": n, "notes": notes}
    out["m_rms"] = _rms(s.m_sq, finite) if plan.m in names else None
    out["m_zero_fraction"] = s.m_zero / n if plan.m in names and n else None
    has_v = (plan.v in names) or (plan.factored is not None and "D" in names)
    out["v_sqrt_mean"] = math.sqrt(s.v_sum / finite) if has_v and finite and s.v_sum >= 0 else None
    out["v_zero_fraction"] = s.v_zero / n if has_v and n else None
    out["eps_fraction"] = s.eps / n if has_d and plan.eps_pred is not None and n else None
    out["eff_lr_log10"] = _eff(plan, s, has_d)
    out["update_rms"] = _update_rms(plan, s, names, has_d)
    out["w_rms"] = _rms(s.w_sq, finite) if "w" in names else None
    ratio = None
    if "w" in names and out["w_rms"] and plan.lr is not None and plan.u_kind is not None:
        if plan.u_kind != "ratio" or has_d:
            ratio = plan.lr * _rms(s.uw_sq, finite) / out["w_rms"]
    out["update_weight_ratio"] = ratio
    hist = s.v_hist if s.v_hist is not None else (s.d_hist if has_d and _v_is_d(plan) else None)
    out["v_hat_sqrt_log10_hist"] = bins.log10_histogram(hist, plan.v_scale, 0.5) \
        if hist is not None and plan.v_scale else None
    if "a_v" in names and has_v and finite:
        out["_compare"] = {"v_sq": s.v_sq, "a_v_sq": s.a_v_sq, "n": finite, "m_sq": s.m_sq,
                           "a_m_sq": s.a_m_sq, "mm": s.mm, "has_m": "a_m" in names and plan.m in names}
    return out


def _v_is_d(plan: Plan) -> bool:
    return bool(plan.factored) or (plan.d_fn is None and plan.d_slots[:1] == (plan.v,))


def _eff(plan: Plan, s: _Sums, has_d: bool) -> dict | None:
    if plan.eff_const is not None:
        x = math.log10(plan.eff_const) if plan.eff_const > 0 else None
        return {"p5": x, "p50": x, "p95": x}
    if not has_d or plan.eff_num is None or s.d_hist is None:
        return None
    total = bins.finite_total(s.d_hist)
    if not total:
        return None
    # eff decreases with D: the eff value at rank r is D's at rank total + 1 - r (nearest rank)
    ranks = [total + 1 - max(1, math.ceil(q * total)) for _, q in PERCENTILES]
    out = {}
    for (key, _), dv in zip(PERCENTILES, bins.ranked(s.d_hist, ranks), strict=True):
        d = plan.d_a * (dv**plan.d_pow if dv > 0 else 0.0) + plan.d_b if dv is not None else None
        out[key] = math.log10(plan.eff_num / d) if d and plan.eff_num > 0 else None
    return out


def _update_rms(plan: Plan, s: _Sums, names: list[str], has_d: bool) -> float | None:
    if not s.n:
        return None
    if plan.u_kind == "ratio" and has_d and plan.m in names:
        return plan.u_k * math.sqrt(s.u_sq / s.n)
    if plan.u_kind == "slot" and plan.u_slot in names:
        return plan.u_k * math.sqrt(s.u_sq / s.n)
    if plan.u_kind == "sign" and plan.m in names:
        return math.sqrt(s.sign_nz / s.total) if s.total else None
    return None
