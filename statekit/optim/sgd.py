"""SGD with momentum, dampening, Nesterov and L2 weight decay: torch, torch fused, burn 0.22, candle.

Hyperparameters: ``lr momentum dampening weight_decay nesterov maximize``. Slot:
``momentum_buffer`` (only when ``momentum != 0``). A missing buffer means the first step with
momentum: the buffer starts as a copy of the (decayed) gradient in both frameworks.

Scalar rounding, per flavor:

``torch`` (``foreach=False``/``True``)
    ``f32(weight_decay)``, ``f32(momentum)``, ``f32(1 - dampening)`` (float64 subtraction),
    ``f32(-lr)``; every ``add(..., alpha=a)`` is one FMA::

        g = -g (maximize);  g = fma(p, wd, g)
        buf = fma(g, f32(1 - dampening), buf * f32(momentum))      (first step: buf = g)
        g = fma(buf, f32(momentum), g) if nesterov else buf
        p = fma(g, f32(-lr), p)

``torch-fused`` (``fused=True`` on CPU: ``FusedSGDKernel.cpp``, AVX2 kernel)
    The same, except the momentum update in the scalar tail (the last ``numel % 8`` elements),
    where the compiler fuses the other product:
    ``buf = fma(buf, f32(momentum), g * f32(1 - dampening))``.

``candle`` (candle-nn 0.11 ``SGD``: a learning rate and nothing else)
    ``var - grad * lr``, where ``grad * lr`` is candle's ``affine(grad, lr, 0.0)`` on the CPU
    backend: ``g * f32(lr) + 0.0`` (the ``+ 0.0`` turns a ``-0.0`` product into ``+0.0``)::

        p = p - (g * f32(lr) + 0.0)

``burn`` (burn 0.22 ``Sgd`` + ``Momentum``; one rounding per op)
    ``weight_decay`` is f32, ``momentum`` f64 used as f32, ``dampening`` f64 (``1 - dampening``
    in f64, then f32), ``lr`` f64 used as ``f32(lr)``. burn's ``MomentumConfig`` defaults to
    ``dampening = 0.1``; ``momentum == 0`` stands for "no momentum configured"::

        g = p*wd + g (weight_decay != 0)
        v = g (first step) else g*(1 - dampening) + v*momentum
        g = v*momentum + g if nesterov else v
        p = p - g*lr
"""

from __future__ import annotations

from statekit.optim.common import (
    BURN,
    CANDLE,
    TORCH,
    TORCH_FUSED,
    fused_vector_width,
    make_step,
    no_tail,
    tail_of,
    torch_grad,
)


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``momentum_buffer`` when ``momentum != 0``, else nothing."""
    return ("momentum_buffer",) if hp["momentum"] != 0 else ()


def _torch_builder(fused: bool):
    def build(b, hp, step, present, like, vector_width):
        wd, momentum, maximize, nesterov = hp["weight_decay"], hp["momentum"], hp["maximize"], hp["nesterov"]
        first = "momentum_buffer" not in present
        values = {"wd": wd, "momentum": momentum, "damp": 1.0 - hp["dampening"], "neg_lr": -hp["lr"]}
        k = {name: b.const(value, like) for name, value in values.items()}

        def kernel(p, g, s, tail):
            g = torch_grad(b, p, g, k["wd"], maximize, wd)
            if momentum != 0:
                if first:
                    buf = g
                elif fused and tail:
                    buf = b.fma32(s["momentum_buffer"], k["momentum"], g * k["damp"])
                else:
                    buf = b.fma32(g, k["damp"], s["momentum_buffer"] * k["momentum"])
                s["momentum_buffer"][...] = buf
                g = b.fma32(buf, k["momentum"], g) if nesterov else buf
            p[...] = b.fma32(g, k["neg_lr"], p)

        kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_classic)
        return kernel, {}, tail_of(fused_vector_width(vector_width)) if fused else no_tail

    return build


def _burn(b, hp, step, present, like, vector_width):
    wd, momentum, nesterov = hp["weight_decay"], hp["momentum"], hp["nesterov"]
    first = step == 0 or "momentum_buffer" not in present
    values = {"wd": wd, "momentum": momentum, "damp": 1.0 - hp["dampening"], "lr": hp["lr"]}
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        if wd != 0:
            g = p * k["wd"] + g
        if momentum != 0:
            v = g if first else g * k["damp"] + s["momentum_buffer"] * k["momentum"]
            s["momentum_buffer"][...] = v
            g = v * k["momentum"] + g if nesterov else v
        p[...] = p - g * k["lr"]

    kernel.constants = values
    return kernel, {}, no_tail


def _candle(b, hp, step, present, like, vector_width):
    values = {"lr": hp["lr"], "zero": 0.0}
    k = {name: b.const(value, like) for name, value in values.items()}

    def kernel(p, g, s, tail):
        update = g * k["lr"]
        update += k["zero"]
        p -= update

    kernel.constants = values
    return kernel, {}, no_tail


BUILDERS = {TORCH_FUSED: _torch_builder(fused=True), TORCH: _torch_builder(fused=False), BURN: _burn,
            CANDLE: _candle}

step = make_step(BUILDERS, slot_names, "sgd")
