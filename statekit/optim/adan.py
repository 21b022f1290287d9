"""Adan (adaptive Nesterov momentum), burn 0.22 only (torch has no Adan).

Hyperparameters: ``lr beta1 beta2 beta3 eps weight_decay no_prox``. Slots (burn's names are
statekit's): ``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff``, ``neg_pre_grad``.

Scalar rounding (``burn``; one rounding per tensor op, no FMA): ``beta1 beta2 beta3 eps
weight_decay`` are f32, ``1 - beta`` is computed in f32, ``beta.powi(t)`` is f32 repeated
squaring, ``sqrt(1 - beta3^t)`` is an f32 root; ``lr`` is f64, used as ``f32(lr)``, and
``d = lr * weight_decay`` is f64. First step is ``step == 0`` (burn's missing state)::

    first: m = g*c1; n = (g*g)*c3; dm = 0; npg = -g                    (c = 1 - beta)
    later: diff = npg + g;  q = diff*beta2 + g
           m = m*beta1 + g*c1;  dm = dm*beta2 + diff*c2;  n = n*beta3 + (q*q)*c3;  npg = -g
    denom = sqrt(n) / sqrt(1 - beta3^t) + eps
    u = (m / (1 - beta1^t)) / denom + ((dm*beta2) / (1 - beta2^t)) / denom
    delta = u * f32(lr)
    no_prox: p = p - delta (d == 0) else p*f32(1 - d) - delta
    default: p = p - delta (d == 0) else (p - delta) / f32(1 + d)
"""

from __future__ import annotations

import numpy as np

from statekit.optim.common import BURN, make_step, no_tail
from statekit.optim.fp import powi

SLOTS = ("exp_avg", "exp_avg_sq", "exp_avg_diff", "neg_pre_grad")


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff``, ``neg_pre_grad``."""
    return SLOTS


def constants(hp, step: int) -> dict:
    """The step's scalars as burn rounds them (float32 values, ``lr``, ``shrink`` and ``grow``
    float64 that each kernel rounds once), and ``decay`` (``lr * weight_decay``, float64)."""
    one = np.float32(1.0)
    beta1, beta2, beta3 = (np.float32(hp[name]) for name in ("beta1", "beta2", "beta3"))
    t = step + 1
    decay = hp["lr"] * float(np.float32(hp["weight_decay"]))
    return {name: float(value) for name, value in {
        "beta1": beta1,
        "beta2": beta2,
        "beta3": beta3,
        "c1": one - beta1,
        "c2": one - beta2,
        "c3": one - beta3,
        "bc1": one - np.float32(powi(beta1, t)),
        "bc2": one - np.float32(powi(beta2, t)),
        "bc3_sqrt": np.sqrt(one - np.float32(powi(beta3, t))),
        "eps": np.float32(hp["eps"]),
        "lr": hp["lr"],
        "shrink": 1.0 - decay,
        "grow": 1.0 + decay,
        "minus_one": -1.0,
        "decay": decay,
    }.items()}


def _burn(b, hp, step, present, like, vector_width):
    first, no_prox = step == 0, hp["no_prox"]
    values = constants(hp, step)
    decay = values["decay"]
    k = {name: b.const(value, like) for name, value in values.items() if name != "decay"}

    def kernel(p, g, s, tail):
        if first:
            m, n = g * k["c1"], (g * g) * k["c3"]
            s["exp_avg_diff"][...] = 0
        else:
            diff = s["neg_pre_grad"] + g
            q = diff * k["beta2"] + g
            m = s["exp_avg"] * k["beta1"] + g * k["c1"]
            n = s["exp_avg_sq"] * k["beta3"] + (q * q) * k["c3"]
            s["exp_avg_diff"][...] = s["exp_avg_diff"] * k["beta2"] + diff * k["c2"]
        dm = s["exp_avg_diff"]
        s["exp_avg"][...] = m
        s["exp_avg_sq"][...] = n
        s["neg_pre_grad"][...] = g * k["minus_one"]
        denom = b.sqrt_ieee(n) / k["bc3_sqrt"] + k["eps"]
        update = (m / k["bc1"]) / denom + ((dm * k["beta2"]) / k["bc2"]) / denom
        delta = update * k["lr"]
        if decay == 0:
            p[...] = p - delta
        elif no_prox:
            p[...] = p * k["shrink"] - delta
        else:
            p[...] = (p - delta) / k["grow"]

    kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
    return kernel, {}, no_tail


BUILDERS = {BURN: _burn}

step = make_step(BUILDERS, slot_names, "adan")
