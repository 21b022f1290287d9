"""Rprop (resilient backpropagation): torch 2.13 (for-loop and foreach round alike).

Hyperparameters: ``lr etas step_sizes maximize`` (``etas = (eta_minus, eta_plus)``,
``step_sizes = (min, max)``, torch's pairs). Slots: ``prev`` (starts at 0) and ``step_size``
(starts at ``f32(lr)``). Element-wise, every scalar rounded to float32::

    g = -g (maximize)
    s = sign(g * prev)                       (the float32 product: an underflow to 0 counts as 0)
    factor = eta_plus where s > 0, eta_minus where s < 0, 1 where s == 0
    step_size = clamp(step_size * factor, min, max)
    g = 0 where factor == eta_minus
    p = p - sign(g) * step_size;  prev = g
"""

from __future__ import annotations

from statekit.optim.common import TORCH, make_step, no_tail


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``prev``, ``step_size``."""
    return ("prev", "step_size")


def constants(hp, step: int) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once)."""
    (eta_minus, eta_plus), (smin, smax) = hp["etas"], hp["step_sizes"]
    return {"minus": eta_minus, "plus": eta_plus, "one": 1.0, "zero": 0.0, "min": smin, "max": smax}


def _torch(b, hp, step, present, like, vector_width):
    maximize = hp["maximize"]
    values = constants(hp, step)
    k = {name: b.const(value, like) for name, value in values.items()}
    xp = b.xp

    def kernel(p, g, s, tail):
        if maximize:
            g = -g
        sign = xp.sign(g * s["prev"])
        factor = b.where(sign > 0, k["plus"], b.where(sign < 0, k["minus"], b.where(sign == 0, k["one"], sign)))
        size = s["step_size"] * factor
        s["step_size"][...] = _clamp(xp, size, k["min"], k["max"])
        g = b.where(factor == k["minus"], k["zero"], g)
        p[...] = p - xp.sign(g) * s["step_size"]
        s["prev"][...] = g

    kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
    return kernel, {"step_size": hp["lr"]}, no_tail


def _clamp(xp, x, low, high):
    """torch's ``clamp_(low, high)``: ``min(max(x, low), high)``, a NaN stays NaN."""
    return xp.minimum(xp.maximum(x, low), high)


BUILDERS = {TORCH: _torch}

step = make_step(BUILDERS, slot_names, "rprop")
