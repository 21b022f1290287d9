"""Adadelta (L2 weight decay): torch 2.13 (for-loop and foreach round alike).

Hyperparameters: ``lr rho eps weight_decay maximize``. Slots: ``square_avg``, ``acc_delta``.
Element-wise (``sqrt``: torch's CPU root, as for Adam)::

    g = -g (maximize);  g = fma(p, f32(wd), g)
    sq = fma(f32(1-rho) * g, g, sq * f32(rho))
    delta = (sqrt(acc + f32(eps)) / sqrt(sq + f32(eps))) * g
    acc = fma(f32(1-rho) * delta, delta, acc * f32(rho))
    p = fma(delta, f32(-lr), p)
"""

from __future__ import annotations

from statekit.optim.common import TORCH, make_step, no_tail, torch_grad


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``square_avg``, ``acc_delta``."""
    return ("square_avg", "acc_delta")


def constants(hp, step: int) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once)."""
    rho = hp["rho"]
    return {"wd": hp["weight_decay"], "rho": rho, "c": 1 - rho, "eps": hp["eps"], "neg_lr": -hp["lr"]}


def _torch(b, hp, step, present, like, vector_width):
    wd, maximize = hp["weight_decay"], hp["maximize"]
    values = constants(hp, step)
    k = {name: b.const(value, like) for name, value in values.items()}
    sqrt, around = b.torch_root()

    def kernel(p, g, s, tail):
        g = torch_grad(b, p, g, k["wd"], maximize, wd)
        sq = b.fma32(k["c"] * g, g, s["square_avg"] * k["rho"])
        s["square_avg"][...] = sq
        delta = (sqrt(s["acc_delta"] + k["eps"]) / sqrt(sq + k["eps"])) * g
        s["acc_delta"][...] = b.fma32(k["c"] * delta, delta, s["acc_delta"] * k["rho"])
        p[...] = b.fma32(delta, k["neg_lr"], p)

    kernel.around = around
    kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
    return kernel, {}, no_tail


BUILDERS = {TORCH: _torch}

step = make_step(BUILDERS, slot_names, "adadelta")
