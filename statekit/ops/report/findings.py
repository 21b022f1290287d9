"""What the report's numbers say is wrong: one finding per sick tensor and check.

Each finding is ``{"severity", "check", "path", "message"}``; the thresholds are named here and in
docs/report.md.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import median

SEVERITIES = ("error", "warning", "info")
EPS_DOMINATED = 0.5  # a tensor with at least this share of coordinates where √v̂ < ε
OUTLIER_DECADES = 3.0  # √mean(v) this many decades from the median of its kind
V_DROP = math.log2(10)  # --against: v̂'s RMS fell by more than 10×


def finding(severity: str, check: str, path: str, message: str) -> dict:
    return {"severity": severity, "check": check, "path": path, "message": message}


def common_step(tensors: list[dict]) -> float | None:
    """The most common step (ties: the furthest along)."""
    steps = Counter(t["step"] for t in tensors if t["step"] is not None)
    if not steps:
        return None
    top = max(steps.values())
    return max(s for s, c in steps.items() if c == top)


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def per_tensor(tensors: list[dict], common: float | None) -> list[dict]:
    """NaN/Inf, resets (a step behind the rest), steps ahead, zero moments, ε-domination."""
    out: list[dict] = []
    behind = sum(1 for t in tensors if t["step"] is not None and common is not None and t["step"] == common)
    for t in tensors:
        path, step = t["path"], t["step"]
        if t["nonfinite"]:
            out.append(finding("error", "nonfinite", path, f"{t['nonfinite']} NaN/Inf values in the state"))
        if step is not None and common is not None and step < common:
            out.append(finding("warning", "reset", path,
                               f"step {step:g} where {behind} of {len(tensors)} tensors are at {common:g}: "
                               "its state restarted"))
        elif step is not None and common is not None and step > common:
            out.append(finding("warning", "step", path, f"step {step:g} is ahead of the common step {common:g}"))
        zeros = [name for name, key in (("m", "m_zero_fraction"), ("v", "v_zero_fraction"))
                 if t.get(key) == 1.0 and t["numel"]]
        if zeros and step is not None and step > 1:
            out.append(finding("warning", "zero-moments", path,
                               f"{' and '.join(zeros)} all zero at step {step:g}: reset or never written"))
        eps = t.get("eps_fraction")
        if eps is not None and eps >= EPS_DOMINATED:
            out.append(finding("warning", "eps", path,
                               f"{_pct(eps)} of coordinates have √v̂ < ε: ε sets their step, not the gradient"))
    return out


def _kind(t: dict) -> tuple:
    """A tensor's peers: on the layer pattern, the same module kind in every layer of its stack
    (``self_attn.v_proj.bias``: never ``k_proj.bias``, whose v is its own); off it, the other
    tensors off it with the same last name, matrix or vector."""
    if t.get("layer") is not None:
        return (t["family"], "layer", t["stack"], t["kind"])
    shape = t.get("shape") or []
    return (t["family"], "apart", (t["path"] or "").rsplit(".", 1)[-1], len(shape) > 1)


def outliers(tensors: list[dict]) -> list[dict]:
    """Tensors whose √mean(v̂) lies :data:`OUTLIER_DECADES` from the median of their kind (see
    :func:`_kind`; kinds of three or more tensors), along depth."""
    groups: dict[tuple, list[tuple[dict, float]]] = {}
    for t in tensors:
        x = t.get("v_hat_sqrt_mean")
        if x is not None and x > 0 and math.isfinite(x):
            groups.setdefault(_kind(t), []).append((t, math.log10(x)))
    out = []
    for members in groups.values():
        if len(members) < 3:
            continue
        mid = median(x for _, x in members)
        for t, x in members:
            if abs(x - mid) > OUTLIER_DECADES:
                word = "above" if x > mid else "below"
                out.append(finding("info", "outlier", t["path"],
                                   f"√mean(v̂) {10**x:.3g} is {abs(x - mid):.1f} decades {word} the median "
                                   f"of its kind ({10**mid:.3g})"))
    return out


def compared(rows: list[dict]) -> list[dict]:
    """--against: v fell by more than 10×, or the step went back."""
    out = []
    for r in rows:
        ratio, delta = r.get("v_rms_log2_ratio"), r.get("step_delta")
        if delta is not None and delta < 0:
            out.append(finding("warning", "step-back", r["path"], f"step went back by {-delta:g} against the other "
                               "state: restarted between them"))
        if ratio is not None and ratio < -V_DROP:
            how = "to 0" if math.isinf(ratio) else f"{2 ** -ratio:.3g}×"  # against zero: no factor
            out.append(finding("warning", "v-drop", r["path"], f"RMS(v̂) fell {how} against the other state"))
    return out


def ordered(items: list[dict], order: dict[str, int]) -> list[dict]:
    """Errors first, then warnings, then infos; within each, along depth."""
    return sorted(items, key=lambda f: (SEVERITIES.index(f["severity"]), order.get(f["path"], 1 << 30)))
