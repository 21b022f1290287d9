"""Family-specific views: Adafactor's row and column factors, 8-bit blockwise state (absmax and
saturation), Muon's and SGD's momentum buffers. Each reads only small tensors, or streams codes."""

from __future__ import annotations

import math

from statekit.lazy import numpy as np
from statekit.ops.report.formulas import Plan
from statekit.state import ParamState
from statekit.tensor import TensorRef

PIECE = 1 << 20


def _spread(x) -> dict:
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    x = x[np.isfinite(x)]
    pos = x[x > 0]
    return {"rms": float(np.sqrt(np.mean(x * x))) if x.size else None,
            "min": float(x.min()) if x.size else None, "max": float(x.max()) if x.size else None,
            "spread_log10": float(np.log10(pos.max() / pos.min())) if pos.size else None}


def _factors(p: ParamState, plan: Plan) -> dict | None:
    if not plan.factored:
        return None
    row, col = (p.slots[s] for s in plan.factored)
    return {"row": _spread(row.numpy()), "col": _spread(col.numpy())}


def _quantized(p: ParamState) -> dict | None:
    out = {}
    for slot, enc in p.encoding.items():
        if getattr(enc, "bits", None) != 8 or enc.codes is None or enc.qmap is None:
            continue
        qmap = np.abs(enc.qmap.numpy().astype(np.float64).reshape(-1))
        top = np.flatnonzero(qmap == qmap.max())
        hist = np.zeros(256, dtype=np.int64)
        for piece in enc.codes.pieces(PIECE):
            hist += np.bincount(piece.reshape(-1).astype(np.uint8), minlength=256)[:256]
        n = int(hist.sum())
        absmax = enc.absmax.numpy().astype(np.float64).reshape(-1) if enc.absmax is not None else np.zeros(0)
        absmax = absmax[np.isfinite(absmax)]
        out[slot] = {"field": enc.field, "block": enc.block,
                     "saturation": float(hist[top].sum() / n) if n else None,
                     "absmax_max": float(absmax.max()) if absmax.size else None,
                     "absmax_median": float(np.median(absmax)) if absmax.size else None}
    return out or None


def _buffer(p: ParamState, plan: Plan) -> dict | None:
    if plan.family not in ("muon", "sgd") or "momentum_buffer" not in p.slots:
        return None
    shape = p.shape or ()
    out: dict = {"slot": "momentum_buffer"}
    if plan.family == "muon" and len(shape) == 2 and min(shape):
        # an orthogonalized A×B update has RMS 1/√max(A, B); times the step's √max(1, A/B)
        out["nominal_update_rms"] = math.sqrt(max(1.0, shape[0] / shape[1])) / math.sqrt(max(shape))
    return out


def family_view(p: ParamState, plan: Plan, weight: TensorRef | None) -> dict | None:
    view = {}
    for key, value in (("factors", _factors(p, plan)), ("quantization", _quantized(p)),
                       ("buffer", _buffer(p, plan))):
        if value:
            view[key] = value
    return view or None
