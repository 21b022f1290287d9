"""Adam and AdamW: torch (for-loop/foreach), torch fused CPU kernel, burn 0.22, candle-nn.

Hyperparameters: ``lr beta1 beta2 eps weight_decay amsgrad maximize decoupled_weight_decay``
(AdamW is Adam with ``decoupled_weight_decay=True``). Slots: ``exp_avg``, ``exp_avg_sq`` and,
with amsgrad, ``max_exp_avg_sq``. ``t`` below is the step number after the increment.

Scalar rounding, per flavor (``f32(x)``: a float64 rounded once to float32):

``torch`` (``torch.optim.Adam/AdamW``, ``foreach=False`` or ``True``: identical on CPU)
    ``t`` is the float32 ``state['step']`` read as a Python float. ``bc1 = 1 - beta1**t``,
    ``bc2 = 1 - beta2**t``, ``step_size = lr / bc1`` and ``bc2_sqrt = bc2**0.5`` are float64
    (libm ``pow``); the kernels see ``f32(-step_size)``, ``f32(bc2_sqrt)``, ``f32(eps)``,
    ``f32(beta2)``, ``f32(1 - beta2)``, ``f32(1 - beta1)`` (lerp weight), ``f32(weight_decay)``
    and ``f32(1 - lr*weight_decay)``. Element-wise, in order::

        g = -g (maximize);  AdamW: p = p * f32(1 - lr*wd)   Adam: g = fma(p, f32(wd), g)
        m = fma(w, g - m, m)              (lerp, w = f32(1 - beta1) < 0.5; else fma(w-1, g-m, g))
        v = fma(f32(1-beta2) * g, g, v * f32(beta2))
        vmax = max(vmax, v)               (amsgrad; used for v below)
        p = p + (f32(-step_size) * m) / (sqrt(v) / f32(bc2_sqrt) + f32(eps))

    ``sqrt`` is torch's own float32 CPU ``sqrt`` (MKL ``vmsSqrt``, not correctly rounded),
    called through torch when it is installed: then the replay is bit-exact; without torch it
    is the IEEE root and the replay is within tolerance (:func:`statekit.optim.exactness`).

``torch-fused`` (``fused=True`` on CPU: ``FusedAdamKernel.cpp``)
    The same scalars, except ``bc2_sqrt = sqrt(bc2)`` (C ``sqrt``; never differs from
    ``bc2**0.5`` after rounding to float32) and AdamW's ``f32(fma(-lr, wd, 1))``: the C++
    compiler contracts ``1 - lr*weight_decay`` into one float64 FMA (seen in the AVX2 object
    code of torch 2.13). The same element-wise formulas with the IEEE root,
    except in the scalar tail: the last ``numel % 8`` elements (8 floats per AVX2 vector; torch
    has no AVX-512 variant of this kernel, so AVX-512 CPUs run the AVX2 one too; the parallel
    chunks are multiples of 16 floats, so this tail exists only at the end of the whole tensor)
    contract the second moment the other way: ``v = fma(v, f32(beta2),
    (f32(1-beta2) * g) * g)``.

``burn`` (burn 0.22 ``Adam`` / ``AdamW``, one rounding per tensor op, no FMA)
    ``beta1 beta2 eps weight_decay`` are f32; ``1 - beta`` is computed in f32;
    ``beta.powi(t)`` is f32 repeated squaring (:func:`statekit.optim.fp.powi`); ``lr`` is f64
    and multiplies as ``f32(lr)``. First step (``step == 0``, burn's missing state):
    ``m = g*c1``, ``v = (g*g)*c2``, ``vmax = v``; later ``m = m*beta1 + g*c1``,
    ``v = v*beta2 + (g*g)*c2``, ``vmax = max(vmax, v)``.

    * Adam: ``g = p*wd + g`` (when ``weight_decay != 0``); ``b2 = sqrt(1 - beta2^t)`` and
      ``cf = b2 / (1 - beta1^t)`` in f32; ``p = p - ((m*cf) / (sqrt(v) + eps*b2)) * f32(lr)``.
    * AdamW: ``u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)`` (f32 scalars);
      ``d = lr * wd`` in f64; ``p = p * f32(1 - d)`` unless ``d == 0``; ``p = p - u * f32(lr)``.

``candle`` (candle-nn ``AdamW``, CPU backend without ``mkl``)
    Every scalar is f64 and reaches the tensor through ``affine(x, mul, add) = x*f32(mul) +
    f32(add)`` (so ``x * s`` also adds ``+0.0``). ``t`` is the optimizer-wide ``step_t``;
    ``scale_m = 1/(1 - beta1.powi(t))``, ``scale_v = 1/(1 - beta2.powi(t))`` in f64::

        m = m*beta1 + g*(1-beta1);   v = v*beta2 + (g*g)*(1-beta2)
        p = p*(1 - lr*wd) - ((m*scale_m) / (sqrt(v*scale_v) + eps)) * lr
"""

from __future__ import annotations

import math

import numpy as np

from statekit.optim.burn_scalars import burn_scalars
from statekit.optim.common import (
    BURN,
    CANDLE,
    TORCH,
    TORCH_FUSED,
    fused_vector_width,
    lerp,
    make_step,
    no_tail,
    tail_of,
)
from statekit.optim.fp import f32, fma64, powi


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``."""
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if hp["amsgrad"] else ("exp_avg", "exp_avg_sq")


def _torch_kernel(b, hp, like, *, step_size: float, bc2_sqrt: float, decay: float, sqrt):
    """torch's element-wise Adam (single-tensor order; fused differs only in the tail)."""
    wd, amsgrad, maximize = hp["weight_decay"], hp["amsgrad"], hp["maximize"]
    decoupled = hp["decoupled_weight_decay"]
    k = {
        name: b.const(value, like)
        for name, value in {
            "decay": decay,
            "wd": wd,
            "beta2": hp["beta2"],
            "c2": 1.0 - hp["beta2"],
            "bc2_sqrt": bc2_sqrt,
            "eps": hp["eps"],
            "neg_step": -step_size,
        }.items()
    }
    weight = 1.0 - hp["beta1"]

    def kernel(p, g, s, tail):
        if maximize:
            g = -g
        # temporaries in this thread's reused block buffers (b.scratch): 0 new_p, 1 g, 2-4 the rest
        new_p = p
        if wd != 0:
            if decoupled:
                new_p = b.mul(p, k["decay"], b.scratch(p, 0))
            else:
                g = b.fma32(p, k["wd"], g, out=b.scratch(p, 1))
        m = lerp(b, s["exp_avg"], g, weight, like, out=s["exp_avg"], scratch=b.scratch(p, 2))
        cg = b.mul(k["c2"], g, b.scratch(p, 3))
        v = s["exp_avg_sq"]
        if tail:
            v = b.fma32(v, k["beta2"], b.mul(cg, g, b.scratch(p, 4)), out=v, positive=True)
        else:
            v = b.fma32(cg, g, b.mul(v, k["beta2"], b.scratch(p, 4)), out=v, positive=True)
        if amsgrad:
            v = b.maximum(s["max_exp_avg_sq"], v, out=s["max_exp_avg_sq"])
        # p = new_p + (neg_step * m) / (sqrt(v) / bc2_sqrt + eps), in place on two temporaries
        # (IEEE + and * are commutative, so the operand order does not change a bit)
        denom = sqrt(v, out=b.scratch(p, 3))
        denom /= k["bc2_sqrt"]
        denom += k["eps"]
        update = b.mul(k["neg_step"], m, b.scratch(p, 4))
        update /= denom
        if new_p is p:
            p += update
        else:
            update += new_p
            p[...] = update

    return kernel


def _torch(b, hp, step, present, like, vector_width):
    t = f32(step + 1)
    bc1 = 1.0 - hp["beta1"] ** t
    bc2 = 1.0 - hp["beta2"] ** t
    decay = 1.0 - hp["lr"] * hp["weight_decay"]
    sqrt, around = b.torch_root()
    kernel = _torch_kernel(b, hp, like, step_size=hp["lr"] / bc1, bc2_sqrt=bc2**0.5, decay=decay, sqrt=sqrt)
    kernel.around = around
    return kernel, {}, no_tail


def _torch_fused(b, hp, step, present, like, vector_width):
    t = f32(step + 1)
    bc1 = 1.0 - math.pow(hp["beta1"], t)
    bc2 = 1.0 - math.pow(hp["beta2"], t)
    decay = fma64(-hp["lr"], hp["weight_decay"], 1.0)  # the C++ compiler contracts 1 - lr*wd
    kernel = _torch_kernel(
        b, hp, like, step_size=hp["lr"] / bc1, bc2_sqrt=math.sqrt(bc2), decay=decay, sqrt=b.sqrt_ieee
    )
    return kernel, {}, tail_of(fused_vector_width(vector_width))


def _burn(b, hp, step, present, like, vector_width):
    first, amsgrad, decoupled = step == 0, hp["amsgrad"], hp["decoupled_weight_decay"]
    scalars, decay = burn_scalars(hp, step)
    wd = scalars.get("wd", 0)
    k = {name: b.const(float(value), like) for name, value in scalars.items()}

    def kernel(p, g, s, tail):
        # the operations below, in place on the slots and two temporaries where possible
        # temporaries in this thread's reused block buffers (b.scratch 0-2)
        if not decoupled and wd != 0:
            decayed = b.mul(p, k["wd"], b.scratch(p, 0))
            decayed += g
            g = decayed
        m, v = s["exp_avg"], s["exp_avg_sq"]
        gg = b.mul(g, g, b.scratch(p, 1))
        if first:
            b.mul(g, k["c1"], m)
            b.mul(gg, k["c2"], v)
        else:
            m *= k["beta1"]
            m += b.mul(g, k["c1"], b.scratch(p, 2))
            v *= k["beta2"]
            gg *= k["c2"]
            v += gg
        if amsgrad:
            vmax = s["max_exp_avg_sq"]
            if not (first or "max_exp_avg_sq" not in present):
                b.maximum(vmax, v, out=vmax)
            else:
                vmax[...] = v
            v = vmax
        if decoupled:
            denom = b.div(v, k["bc2"], b.scratch(p, 2))
            denom = b.sqrt_ieee(denom, out=denom)
            denom += k["eps"]
            u = b.div(m, k["bc1"], b.scratch(p, 1))
        else:
            denom = b.sqrt_ieee(v, out=b.scratch(p, 2))
            denom += k["eps_b2"]
            u = b.mul(m, k["cf"], b.scratch(p, 1))
        u /= denom
        u *= k["lr"]
        if decoupled and decay != 0:
            p *= k["decay"]
        p -= u

    return kernel, {}, no_tail


def _candle(b, hp, step, present, like, vector_width):
    t = step + 1
    beta1, beta2, lr = hp["beta1"], hp["beta2"], hp["lr"]
    scalars = {
        "beta1": beta1,
        "c1": 1.0 - beta1,
        "beta2": beta2,
        "c2": 1.0 - beta2,
        "scale_m": 1.0 / (1.0 - powi(beta1, t, np.float64)),
        "scale_v": 1.0 / (1.0 - powi(beta2, t, np.float64)),
        "decay": 1.0 - lr * hp["weight_decay"],
        "eps": hp["eps"],
        "lr": lr,
        "one": 1.0,
        "zero": 0.0,
    }
    k = {name: b.const(value, like) for name, value in scalars.items()}
    # the short form below equals the literal one when eps is not -0.0 and 1 - beta2 is not
    # negative (see candle_short); otherwise the literal form runs
    short = not math.copysign(1.0, f32(hp["eps"])) < 0 and not math.copysign(1.0, f32(1.0 - beta2)) < 0
    if short:
        return _candle_short(b, k, unit_decay=f32(scalars["decay"]) == 1.0), {}, no_tail
    return _candle_literal(b, k), {}, no_tail


def _candle_literal(b, k):
    """candle's AdamW element-wise, one operation per ``affine`` term, as candle computes it."""

    def affine(x, mul, add="zero"):
        return x * k[mul] + k[add]

    def inplace_affine(x, mul, add="zero"):
        x *= k[mul]
        x += k[add]
        return x

    def kernel(p, g, s, tail):
        # the formulas above, in place on the slots and two temporaries
        m, v = s["exp_avg"], s["exp_avg_sq"]
        inplace_affine(m, "beta1")
        m += affine(g, "c1")
        inplace_affine(v, "beta2")
        v += inplace_affine(g * g, "c2")
        update = affine(m, "scale_m")
        update /= inplace_affine(b.sqrt_ieee(affine(v, "scale_v")), "one", "eps")
        inplace_affine(p, "decay")
        p -= inplace_affine(update, "lr")

    return kernel


def _candle_short(b, k, unit_decay: bool):
    """candle's AdamW with the ``+ 0.0`` and ``* 1.0`` of its ``affine`` calls dropped where
    they cannot change a bit; 16 operations per element instead of 24.

    Write ``N(x) = x + 0.0``. In round-to-nearest ``N(x)`` is ``x`` except that ``-0.0``
    becomes ``+0.0`` (a NaN stays the same NaN). For ``+`` and ``-``, ``N(a) ± N(b) ==
    N(a ± b)``: if ``a ± b`` is not zero the zeros' signs do not matter; if it is zero,
    both sides are ``+0.0`` (an exact zero sum of nonzero terms is ``+0.0``, and ``+0.0 ±
    +0.0`` is ``+0.0``). NaNs propagate from the same operands in the same order. So:

    * ``m' = N(m·β1) + N(g·c1) = N(m·β1 + g·c1)``: one ``+ 0.0`` instead of two;
    * ``v' = N(v·β2) + N((g·g)·c2) = N(v·β2 + (g·g)·c2)``, and ``(g·g)·c2`` is never ``-0.0``
      when ``c2 = f32(1 - β2)`` is not negative, so the sum is never ``-0.0``: no ``+ 0.0``;
    * the denominator ``N(sqrt(N(v'·sv)))·1 + ε`` is ``sqrt(v'·sv) + ε``: ``·1`` is exact, and
      the sign of a zero root vanishes in ``+ ε`` unless ``ε`` is ``-0.0``;
    * ``p' = N(p·decay) - N(N(m'·sm)/den·lr) = N(p·decay - (m'·sm)/den·lr)``: the inner ``N``
      can only flip the sign of a zero, which the outer one erases; ``p·1`` is ``p`` (a
      signalling NaN is quieted by the subtraction instead).
    """

    def kernel(p, g, s, tail):
        m, v = s["exp_avg"], s["exp_avg_sq"]
        m *= k["beta1"]
        m += b.mul(g, k["c1"], b.scratch(p, 0))
        m += k["zero"]
        v *= k["beta2"]
        gg = b.mul(g, g, b.scratch(p, 0))
        gg *= k["c2"]
        v += gg
        update = b.mul(m, k["scale_m"], b.scratch(p, 0))
        denom = b.mul(v, k["scale_v"], b.scratch(p, 1))
        denom = b.sqrt_ieee(denom, out=denom)
        denom += k["eps"]
        update /= denom
        update *= k["lr"]
        if not unit_decay:
            p *= k["decay"]
        p -= update
        p += k["zero"]

    return kernel


BUILDERS = {TORCH_FUSED: _torch_fused, TORCH: _torch, BURN: _burn, CANDLE: _candle}

step = make_step(BUILDERS, slot_names, "adam")
