"""Adamax (infinity-norm Adam, L2 weight decay): torch 2.13 (for-loop and foreach round alike).

Hyperparameters: ``lr beta1 beta2 eps weight_decay maximize``. Slots: ``exp_avg``, ``exp_inf``.
``t`` is the float32 step after the increment; ``clr = lr / (1 - beta1**t)`` in float64::

    g = -g (maximize);  g = fma(p, f32(wd), g)
    m = lerp(m, g, 1 - beta1)
    u = maximum(u * f32(beta2), |g| + f32(eps))
    p = p + (f32(-clr) * m) / u
"""

from __future__ import annotations

from statekit.optim.common import TORCH, lerp, make_step, no_tail, torch_grad
from statekit.optim.fp import f32


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``exp_avg``, ``exp_inf``."""
    return ("exp_avg", "exp_inf")


def constants(hp, step: int) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once)."""
    clr = hp["lr"] / (1 - hp["beta1"] ** f32(step + 1))
    return {"wd": hp["weight_decay"], "beta2": hp["beta2"], "eps": hp["eps"], "neg_clr": -clr}


def _torch(b, hp, step, present, like, vector_width):
    beta1, wd, maximize = hp["beta1"], hp["weight_decay"], hp["maximize"]
    values = constants(hp, step)
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        g = torch_grad(b, p, g, k["wd"], maximize, wd)
        m = lerp(b, s["exp_avg"], g, 1 - beta1, like)
        s["exp_avg"][...] = m
        u = b.maximum(s["exp_inf"] * k["beta2"], abs(g) + k["eps"])
        s["exp_inf"][...] = u
        p[...] = p + (k["neg_clr"] * m) / u

    kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
    return kernel, {}, no_tail


BUILDERS = {TORCH: _torch}

step = make_step(BUILDERS, slot_names, "adamax")
