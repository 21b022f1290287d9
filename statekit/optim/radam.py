"""RAdam (rectified Adam, L2 or decoupled weight decay): torch 2.13 for-loop and foreach.

Hyperparameters: ``lr beta1 beta2 eps weight_decay decoupled_weight_decay maximize``. Slots:
``exp_avg``, ``exp_avg_sq``. ``t`` is the float32 step after the increment; in Python float64::

    bc1 = 1 - beta1**t;  bc2 = 1 - beta2**t
    rho_inf = 2/(1 - beta2) - 1;  rho_t = rho_inf - 2*t*beta2**t / bc2
    rect = ((rho_t-4) * (rho_t-2) * rho_inf / ((rho_inf-4) * (rho_inf-2) * rho_t))**0.5

Element-wise (``sqrt``: torch's CPU root)::

    g = -g (maximize);  decoupled: p = p * f32(1 - lr*wd)   else: g = fma(p, f32(wd), g)
    m = lerp(m, g, 1 - beta1);  v = fma(f32(1-beta2) * g, g, v * f32(beta2))

``torch`` (for-loop; a Python number divided by a tensor is torch's ``reciprocal() * number``)::

    rho_t > 5: p = p - ((m / f32(bc1)) * f32(lr)) * ((1 / (sqrt(v) + f32(eps))) * f32(bc2**0.5)) * f32(rect)
    else:      p = p - (m / f32(bc1)) * f32(lr)

``torch-foreach`` (the bias corrections folded into two scalars; ``rect = 0`` when ``rho_t <= 5``)::

    unrect = (lr * (0 if rect > 0 else 1) / bc1) * -1;  coef = bc2**0.5 * (lr * rect / bc1) * -1
    p = fma(m, 1 / ((sqrt(v) + f32(eps)) / f32(coef)) + f32(unrect), p)
"""

from __future__ import annotations

import numpy as np

from statekit.optim.common import TORCH, TORCH_FOREACH, make_step, no_tail, torch_adam_moments
from statekit.optim.fp import f32


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``exp_avg``, ``exp_avg_sq``."""
    return ("exp_avg", "exp_avg_sq")


def constants(hp, step: int) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once); ``rectified``
    says which branch the for-loop takes."""
    t = f32(step + 1)
    beta1, beta2, lr, wd = hp["beta1"], hp["beta2"], hp["lr"], hp["weight_decay"]
    bc1 = 1 - beta1**t
    bc2 = 1 - beta2**t
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * (beta2**t) / bc2
    rectified = rho_t > 5
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5 \
        if rectified else 0
    return {"decay": 1 - lr * wd, "wd": wd, "beta2": beta2, "c2": 1 - beta2, "eps": hp["eps"], "bc1": bc1, "lr": lr,
            "bc2_sqrt": bc2**0.5, "rect": rect or 0.0, "one": 1.0, "rectified": rectified,
            # torch-foreach's two folded scalars (coef is -0.0 before rectification)
            "unrect": (lr * (0 if rect > 0 else 1.0) / bc1) * -1,
            "coef": ((1 - beta2**t) ** 0.5) * (lr * rect / bc1) * -1}


def _builder(foreach: bool):
    def build(b, hp, step, present, like, vector_width):
        beta1, wd = hp["beta1"], hp["weight_decay"]
        decoupled, maximize = hp["decoupled_weight_decay"], hp["maximize"]
        values = constants(hp, step)
        rectified = values["rectified"]
        k = {name: b.const(value, like) for name, value in values.items() if name != "rectified"}
        sqrt, around = b.torch_root()

        def kernel(p, g, s, tail):
            g, m, v = torch_adam_moments(b, p, g, s, k, decoupled=decoupled, maximize=maximize, wd=wd,
                                         beta1=beta1, like=like)
            if foreach:
                with np.errstate(divide="ignore"):  # unrectified: coef is -0.0, the buffer -inf, its reciprocal -0.0
                    buffer = k["one"] / ((sqrt(v) + k["eps"]) / k["coef"]) + k["unrect"]
                p[...] = b.fma32(m, buffer, p)
            elif rectified:
                adaptive = (k["one"] / (sqrt(v) + k["eps"])) * k["bc2_sqrt"]
                p[...] = p - ((m / k["bc1"]) * k["lr"]) * adaptive * k["rect"]
            else:
                p[...] = p - (m / k["bc1"]) * k["lr"]

        kernel.around = around
        kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
        return kernel, {}, no_tail

    return build


BUILDERS = {TORCH: _builder(foreach=False), TORCH_FOREACH: _builder(foreach=True)}

step = make_step(BUILDERS, slot_names, "radam")
