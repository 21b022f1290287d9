"""RMSprop (centered, momentum, L2 weight decay): torch and burn 0.22. torch has no fused RMSprop.

Hyperparameters: ``lr alpha eps weight_decay momentum centered maximize``. Slots:
``square_avg``; ``grad_avg`` when centered; ``momentum_buffer`` when ``momentum > 0``; and, for
the burn flavor only, ``avg`` (burn stores ``centered.avg``: ``square_avg`` when not centered,
``square_avg - grad_avg**2`` when centered, both after the update).

Scalar rounding, per flavor:

``torch`` (``foreach=False``/``True``)
    ``f32(alpha)``, ``f32(1 - alpha)``, ``f32(weight_decay)``, ``f32(eps)``, ``f32(momentum)``,
    ``f32(-lr)``; torch's missing slots start at zero::

        g = -g (maximize);  g = fma(p, wd, g)
        sq = fma(f32(1-alpha) * g, g, sq * f32(alpha))
        centered: ga = lerp(ga, g, 1 - alpha);  avg = sqrt(fma(-ga, ga, sq))
        else:     avg = sqrt(sq)
        avg = avg + f32(eps)
        momentum > 0: buf = buf * f32(momentum) + g / avg;  p = fma(buf, f32(-lr), p)
        else:         p = p + (f32(-lr) * g) / avg

    ``sqrt`` is torch's CPU float32 root (MKL) when torch is installed, as for Adam.

``burn`` (burn 0.22 ``RmsProp``; one rounding per op)
    ``alpha eps momentum weight_decay`` are f32, ``1 - alpha`` in f32, ``f32(lr)``. First step
    is ``step == 0`` (burn's missing state); a missing ``grad_avg`` / ``momentum_buffer`` on a
    later step starts from its first-step value, as in burn::

        g = p*wd + g (weight_decay != 0)
        sq = (g*g)*c (first) else sq*alpha + (g*g)*c          (c = 1 - alpha)
        centered: ga = g*c (first) else ga*alpha + g*c;  avg = sq - ga*ga
        else:     avg = sq
        g' = g / (sqrt(avg) + eps)
        momentum > 0: buf = g' (first) else buf*momentum + g';  p = p - buf*lr
        else:         p = p - g'*lr
"""

from __future__ import annotations

import numpy as np

from statekit.optim.common import BURN, TORCH, lerp, make_step, no_tail, torch_grad


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``square_avg`` (+ ``avg`` for burn) (+ ``grad_avg``) (+ ``momentum_buffer``)."""
    names = ["square_avg"]
    if flavor == BURN:
        names.append("avg")
    if hp["centered"]:
        names.append("grad_avg")
    if hp["momentum"] > 0:
        names.append("momentum_buffer")
    return tuple(names)


def _torch(b, hp, step, present, like, vector_width):
    wd, momentum, centered, maximize = hp["weight_decay"], hp["momentum"], hp["centered"], hp["maximize"]
    alpha = hp["alpha"]
    values = {"wd": wd, "alpha": alpha, "c": 1.0 - alpha, "eps": hp["eps"], "momentum": momentum, "neg_lr": -hp["lr"]}
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        g = torch_grad(b, p, g, k["wd"], maximize, wd)
        sq = b.fma32(k["c"] * g, g, s["square_avg"] * k["alpha"])
        s["square_avg"][...] = sq
        if centered:
            ga = lerp(b, s["grad_avg"], g, 1.0 - alpha, like)
            s["grad_avg"][...] = ga
            sq = b.fma32(-ga, ga, sq)
        avg = b.sqrt_torch(sq) + k["eps"]
        if momentum > 0:
            buf = s["momentum_buffer"] * k["momentum"] + g / avg
            s["momentum_buffer"][...] = buf
            p[...] = b.fma32(buf, k["neg_lr"], p)
        else:
            p[...] = p + (k["neg_lr"] * g) / avg

    kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_classic)
    return kernel, {}, no_tail


def _burn(b, hp, step, present, like, vector_width):
    wd, momentum, centered = np.float32(hp["weight_decay"]), np.float32(hp["momentum"]), hp["centered"]
    alpha = np.float32(hp["alpha"])
    first = step == 0
    first_ga = first or "grad_avg" not in present
    first_buf = first or "momentum_buffer" not in present
    values = {name: float(value) for name, value in {"wd": wd, "alpha": alpha, "c": np.float32(1.0) - alpha,
                                                     "eps": hp["eps"], "momentum": momentum, "lr": hp["lr"]}.items()}
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        if wd != 0:
            g = p * k["wd"] + g
        gg = (g * g) * k["c"]
        sq = gg if first else s["square_avg"] * k["alpha"] + gg
        s["square_avg"][...] = sq
        avg = sq
        if centered:
            ga = g * k["c"] if first_ga else s["grad_avg"] * k["alpha"] + g * k["c"]
            s["grad_avg"][...] = ga
            avg = sq - ga * ga
        s["avg"][...] = avg
        update = g / (b.sqrt_ieee(avg) + k["eps"])
        if momentum > 0:
            update = update if first_buf else s["momentum_buffer"] * k["momentum"] + update
            s["momentum_buffer"][...] = update
        p[...] = p - update * k["lr"]

    kernel.constants = values
    return kernel, {}, no_tail


BUILDERS = {TORCH: _torch, BURN: _burn}

step = make_step(BUILDERS, slot_names, "rmsprop")
