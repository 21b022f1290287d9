"""AdaGrad (lr_decay, L2 weight decay, initial accumulator): torch, torch fused, burn 0.22.

Hyperparameters: ``lr lr_decay weight_decay eps initial_accumulator_value maximize``. Slot:
``sum`` (torch creates it in the constructor, filled with ``initial_accumulator_value``; a
missing ``sum`` starts there).

Scalar rounding, per flavor (``t`` = step number after the increment, a float32 in torch):

``torch`` (``foreach=False``/``True``)
    ``clr = lr / (1 + (t - 1) * lr_decay)`` in float64 (Python), used as ``f32(-clr)``;
    ``f32(weight_decay)``, ``f32(eps)``::

        g = -g (maximize);  g = fma(p, wd, g)
        sum = fma(g, g, sum)
        p = p + (f32(-clr) * g) / (sqrt(sum) + f32(eps))

    with torch's CPU root (MKL) when torch is installed.

``torch-fused`` (``fused=True`` on CPU: ``FusedAdagradKernel.cpp``)
    The same element-wise formulas (vector body and scalar tail agree) with the IEEE root; the
    C++ compiler contracts the denominator of ``clr``: ``clr = lr / fma(t - 1, lr_decay, 1)``.

``burn`` (burn 0.22 ``AdaGrad``; one rounding per op)
    ``weight_decay`` and ``eps`` are f32; ``new_lr = lr / (1 + (t - 1) * lr_decay)`` in f64,
    used as ``f32(new_lr)``. burn has no initial accumulator; first step is ``step == 0``::

        g = p*wd + g (weight_decay != 0)
        sum = g*g (first) else sum + g*g
        p = p - (g / (sqrt(sum) + eps)) * new_lr
"""

from __future__ import annotations

from statekit.optim.common import BURN, TORCH, TORCH_FUSED, make_step, no_tail, torch_grad
from statekit.optim.fp import f32, fma64


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``sum``."""
    return ("sum",)


def _torch_builder(fused: bool):
    def build(b, hp, step, present, like, vector_width):
        t = f32(step + 1)
        lr, lr_decay, wd, maximize = hp["lr"], hp["lr_decay"], hp["weight_decay"], hp["maximize"]
        clr = lr / (fma64(t - 1.0, lr_decay, 1.0) if fused else 1 + (t - 1) * lr_decay)
        sqrt = b.sqrt_ieee if fused else b.sqrt_torch
        values = {"wd": wd, "eps": hp["eps"], "neg_clr": -clr}
        k = {name: b.const(value, like) for name, value in values.items()}

        def kernel(p, g, s, tail):
            g = torch_grad(b, p, g, k["wd"], maximize, wd)
            total = b.fma32(g, g, s["sum"])
            s["sum"][...] = total
            p[...] = p + (k["neg_clr"] * g) / (sqrt(total) + k["eps"])

        kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_classic)
        return kernel, {"sum": hp["initial_accumulator_value"]}, no_tail

    return build


def _burn(b, hp, step, present, like, vector_width):
    t = step + 1
    wd = f32(hp["weight_decay"])
    first = step == 0
    new_lr = hp["lr"] / (1.0 + (t - 1.0) * hp["lr_decay"])
    values = {"wd": wd, "eps": hp["eps"], "lr": new_lr}
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        if wd != 0:
            g = p * k["wd"] + g
        gg = g * g
        total = gg if first else s["sum"] + gg
        s["sum"][...] = total
        p[...] = p - (g / (b.sqrt_ieee(total) + k["eps"])) * k["lr"]

    kernel.constants = values
    return kernel, {}, no_tail


BUILDERS = {TORCH_FUSED: _torch_builder(fused=True), TORCH: _torch_builder(fused=False), BURN: _burn}

step = make_step(BUILDERS, slot_names, "adagrad")
