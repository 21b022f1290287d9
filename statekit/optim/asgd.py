"""ASGD (averaged SGD, L2 weight decay): torch 2.13 for-loop and foreach.

Hyperparameters: ``lr lambd alpha t0 weight_decay maximize``. Slots: ``ax`` (the average,
starts at 0) and the 0-dim ``eta`` (starts at ``f32(lr)``) and ``mu`` (starts at 1), which torch
keeps as float32 tensors on the parameter's device. ``t`` is the float32 step after the
increment; ``eta`` and ``mu`` below are the values before the step.

``torch`` (for-loop)::

    g = -g (maximize);  g = fma(p, f32(wd), g)
    p = p * f32(1 - lambd*eta);  p = fma(g, f32(-eta), p)
    mu != 1: ax = ax + (p - ax) * mu        else: ax = p
    eta' = f32(lr / (1 + lambd*lr*t)**alpha);  mu' = f32(1 / max(1, t - t0))      (float64)

``torch-foreach``::

    g = -g (maximize);  g = fma(p, f32(wd), g);  i = fma(p, f32(lambd), g)
    p = fma(-i, eta, p);  ax = fma(p - ax, mu, ax)                               (also when mu == 1)
    eta' = f32(lr) * (1 / f32(x ** alpha)),  x = f32(1 + f32(f32(lambd*lr) * t))     (float32 tensor ops;
                                                          the power in float64, rounded once)
    mu' = f32(1 / max(1, t - t0))
"""

from __future__ import annotations

import importlib

import numpy as np

from statekit.optim.backend import torch_available
from statekit.optim.common import TORCH, TORCH_FOREACH, torch_grad
from statekit.optim.fp import f32
from statekit.optim.tensorwise import make_scalar_step


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``eta`` (0-dim), ``mu`` (0-dim), ``ax``."""
    return ("eta", "mu", "ax")


def _next_eta_foreach(lr: float, lambd: float, alpha: float, t: float) -> float:
    """``lr / ((1 + lambd*lr*step) ** alpha)`` with ``step`` torch's float32 0-dim tensor: each
    operation a float32 tensor op; ``number / tensor`` is ``tensor.reciprocal() * number``.

    With torch installed, torch computes it (one 0-dim tensor): its ``pow`` by a scalar takes
    other kernels for some exponents (``0.5`` is its square root, MKL's, not the IEEE one: a
    float64 power rounded once missed 2 of 20 steps at ``alpha=0.5``). Without torch: the
    float64 power rounded once (measured: 0/3000 mismatches at the default 0.75, float32 ``powf``
    15/3000)."""
    if torch_available():
        torch = importlib.import_module("torch")
        step = torch.tensor(t, dtype=torch.float32)
        return float(torch.as_tensor(lr / ((1 + lambd * lr * step) ** alpha)).item())
    one = np.float32(1.0)
    x = np.float32(np.float32(lambd * lr) * np.float32(t))
    x = np.float32(one + x)
    x = np.float32(float(x) ** alpha)  # torch's float32 pow by a scalar: the float64 power, rounded once
    return float(np.float32(np.float32(one / x) * np.float32(lr)))


def constants(hp, step: int, scalars, foreach: bool) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once), the values
    of ``eta`` and ``mu`` before the step and after it (``new_eta``, ``new_mu``)."""
    t = f32(step + 1)
    lr, lambd, alpha, t0 = hp["lr"], hp["lambd"], hp["alpha"], hp["t0"]
    eta = scalars.get("eta", f32(lr))
    mu = scalars.get("mu", 1.0)
    new_eta = _next_eta_foreach(lr, lambd, alpha, t) if foreach else f32(lr / ((1 + lambd * lr * t) ** alpha))
    return {"wd": hp["weight_decay"], "lambd": lambd, "eta": eta, "mu": mu, "decay": 1 - lambd * eta,
            "neg_eta": -eta, "new_eta": new_eta, "new_mu": f32(1 / max(1, t - t0))}


def _builder(foreach: bool):
    def build(b, hp, step, present, like, scalars):
        wd, maximize = hp["weight_decay"], hp["maximize"]
        values = constants(hp, step, scalars, foreach)
        mu = values["mu"]
        k = {name: b.const(value, like) for name, value in values.items()}

        def kernel(p, g, s, tail):
            g = torch_grad(b, p, g, k["wd"], maximize, wd)
            if foreach:
                i = b.fma32(p, k["lambd"], g)
                p[...] = b.fma32(-i, k["eta"], p)
                s["ax"][...] = b.fma32(p - s["ax"], k["mu"], s["ax"])
                return
            p[...] = p * k["decay"]
            p[...] = b.fma32(g, k["neg_eta"], p)
            if mu != 1:
                s["ax"][...] = s["ax"] + (p - s["ax"]) * k["mu"]
            else:
                s["ax"][...] = p

        kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
        return kernel, {}, {"eta": values["new_eta"], "mu": values["new_mu"]}

    return build


BUILDERS = {TORCH: _builder(foreach=False), TORCH_FOREACH: _builder(foreach=True)}

step = make_scalar_step(BUILDERS, slot_names, ("eta", "mu"), "asgd")
