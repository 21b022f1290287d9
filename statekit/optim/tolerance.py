"""Acceptance bounds for replays that are not bit-exact (``statekit.optim.exactness``).

Calibrated in ``docs/numerics.md`` (from the measurements in the torch/candle numerics notes):
after ``n`` steps from a common state, a correct replay of Adam-like optimizers stays within

* parameters: ``|Δp| <= 4·ulp(p) + 2e-5·lr·n``;
* first moment: ``|Δm| <= 1e-5·max|m| + 4·ulp(m)``;
* second moment: ``|Δv| <= 5e-5·|v| + 4·ulp(v)``,

where ``ulp`` is float32's spacing at the reference value. Every function takes numpy arrays
(or anything ``np.asarray`` accepts) and works in float64.
"""

from __future__ import annotations

import numpy as np


def ulp(x) -> np.ndarray:
    """float32 ULP at each element of ``x`` (the gap to the next float32 away from zero)."""
    return np.spacing(np.abs(np.asarray(x, dtype=np.float32))).astype(np.float64)


def param_bound(reference, lr: float, steps: int) -> np.ndarray:
    """``4·ulp(p) + 2e-5·lr·steps`` per element."""
    return 4 * ulp(reference) + 2e-5 * lr * steps


def exp_avg_bound(reference) -> np.ndarray:
    """``1e-5·max|m| + 4·ulp(m)`` per element."""
    ref = np.asarray(reference, dtype=np.float64)
    scale = np.abs(ref).max() if ref.size else 0.0
    return 1e-5 * scale + 4 * ulp(reference)


def exp_avg_sq_bound(reference) -> np.ndarray:
    """``5e-5·|v| + 4·ulp(v)`` per element."""
    return 5e-5 * np.abs(np.asarray(reference, dtype=np.float64)) + 4 * ulp(reference)


def worst_ratio(value, reference, bound) -> float:
    """``max |value - reference| / bound`` (``<= 1`` means within tolerance; 0 for empty)."""
    diff = np.abs(np.asarray(value, np.float64) - np.asarray(reference, np.float64))
    return float((diff / bound).max()) if diff.size else 0.0
